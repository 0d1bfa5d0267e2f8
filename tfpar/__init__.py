"""tfpar: data, tensor and pipeline parallelism for TensorFlow 2 / Keras 3.

>>> import tfpar
>>> tfpar.use_virtual_cpus(8)           # only for CPU tests and demos
>>> strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}))

`import tfpar` changes nothing in Keras or TensorFlow: tfpar's hooks into
them (`tfpar/_compat.py`) are installed when the first `ParallelStrategy` is
made. Two of them are also opt-ins without a strategy: Keras' own
distribution API (`keras.distribution.set_distribution`) reaching tfpar,
installed when `tfpar.keras_distribution` is imported (`import
tfpar.keras_distribution`, or any use of `tfpar.keras_distribution`, which
this package imports on first access), and `keras.RematScope` working on
TensorFlow, installed by `tfpar.recompute.install()`.
"""

import importlib
import os

# These are read by TensorFlow itself, not patches of it: each is read once,
# when the first DTensor function compiles, so they must be set before any
# DTensor function runs, and the user's first `import tfpar` is the last
# moment tfpar is sure to come before that.
#
# DTensor's all-reduce combiner (DTensorAllReduceCombineOptimization) moves
# a variable update that follows an all-reduce past later reads of that
# variable: it tracks data dependencies only. Keras' `metric.result()` then
# reads a stale `total` and Adam a stale moment. TF reads this switch once,
# when the first DTensor function compiles, and only the exact string "0"
# turns the pass off. See tests/test_dtensor_ordering.py.
os.environ["DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION"] = "0"
# DTensor moves a split from one dimension to another (a relayout such as
# [-, "model", -, -] -> [-, -, "model", -]) by an all-to-all; on a rank-4
# tensor that all-to-all returns wrong values, silently, for every move
# between dimensions 1-3 (36 of 618 relayouts of a 4x4x4x4 tensor on a 2x2
# mesh; ranks 2 and 3 are right): tests/dtensor_all_to_all_repro.py. Rank 5
# is wrong too, and TF reads this switch once per process (it cannot be on
# for one relayout only): tests/dtensor_all_to_all_ranks_repro.py. Found
# by the fuzzing: a BatchNormalization and a MultiHeadAttention whose
# weights were split over one axis trained far from one device. With "0"
# DTensor gathers and slices instead (right, and more bytes moved). Only
# the exact string "0" turns it off; tfpar insists on it.
os.environ["DTENSOR_USE_ALL_TO_ALL_RELAYOUT"] = "0"
# On GPU meshes DTensor lowers collectives to NCCL when this is set (it needs
# one logical device per physical GPU); CPU and TPU meshes ignore it. A
# user's own setting wins. (Not yet run on a GPU: see README.)
os.environ.setdefault("DTENSOR_GPU_USE_NCCL_COMMUNICATION", "1")

import sys  # noqa: E402

from tfpar import logs as _logs  # noqa: E402

# TensorFlow's import prints C++ INFO lines before its logging starts (so
# TF_CPP_MIN_LOG_LEVEL cannot silence them): dropped here (tfpar/logs.py).
if "tensorflow" not in sys.modules:
    with _logs.filtered_stderr(_logs.TENSORFLOW_IMPORT_LINES):
        import tensorflow  # noqa: E402, F401

from tfpar.layout import LayoutRules  # noqa: E402
from tfpar import checkpoint, layers, pipeline, pretrained  # noqa: E402
# The reports' old import paths (aliases of tfpar.reports.*).
from tfpar import communication, memory, visualize  # noqa: E402, F401
from tfpar.checkpoint import (  # noqa: E402
    latest_checkpoint,
    restore_checkpoint,
    save_checkpoint,
)
from tfpar.reports.communication import communication_report  # noqa: E402
from tfpar.reports.memory import memory_report  # noqa: E402
from tfpar.mesh import Mesh, use_virtual_cpus  # noqa: E402
from tfpar.pipeline import get_schedule, plot_schedule  # noqa: E402
from tfpar.pipeline.model import PipelineModel  # noqa: E402
from tfpar.strategy import ParallelStrategy  # noqa: E402
from tfpar.styles import (  # noqa: E402
    ColumnParallel,
    Replicated,
    RowParallel,
    SequenceParallel,
    VocabParallel,
)
from tfpar.auto_plan import auto_rules  # noqa: E402
from tfpar.hosts import connect_hosts  # noqa: E402
from tfpar.preemption import (  # noqa: E402
    PreemptionCheckpoint,
    on_preemption,
)
from tfpar.watchdog import StepWatchdog  # noqa: E402
from tfpar.planner import Cluster, Plan, estimate, plan  # noqa: E402
from tfpar.planner.monitor import StepTimeMonitor  # noqa: E402
from tfpar.tpu import connect_tpu  # noqa: E402
from tfpar.reports.visualize import summary, visualize_layout  # noqa: E402

__all__ = [
    "Cluster",
    "ColumnParallel",
    "LayoutRules",
    "Mesh",
    "ParallelStrategy",
    "Plan",
    "PipelineModel",
    "Replicated",
    "RowParallel",
    "SequenceParallel",
    "StepTimeMonitor",
    "VocabParallel",
    "auto_rules",
    "checkpoint",
    "communication",
    "communication_report",
    "connect_hosts",
    "PreemptionCheckpoint",
    "StepWatchdog",
    "connect_tpu",
    "estimate",
    "get_schedule",
    "keras_distribution",
    "layers",
    "latest_checkpoint",
    "memory_report",
    "on_preemption",
    "pipeline",
    "plan",
    "plot_schedule",
    "pretrained",
    "restore_checkpoint",
    "save_checkpoint",
    "summary",
    "use_virtual_cpus",
    "visualize",
    "visualize_layout",
]
__version__ = "0.1.0"

_LAZY_MODULES = ("keras_distribution", "recompute")  # imported on first access: see above


def __getattr__(name):
    """`tfpar.keras_distribution` (its Keras hooks installed) and
    `tfpar.recompute`, imported on first access (PEP 562)."""
    if name in _LAZY_MODULES:
        return importlib.import_module(f"tfpar.{name}")
    raise AttributeError(f"module 'tfpar' has no attribute {name!r}")
