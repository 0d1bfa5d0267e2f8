"""Memory you can check: what each device holds during a training step.

`memory_report(model, x, y)` compiles and runs one training step exactly as
`fit` does (see `tfpar.communication_report`), reads the per-device program
DTensor expanded it into and, per device, adds up (bytes):

- `params`: trainable weights as stored (fsdp: the device's blocks);
- `gradients`: the gradients the optimizer receives, laid out like the
  stored weights (fsdp: reduce-scattered blocks), so equal to `params`;
  the whole gradients that exist before a reduce-scatter are in `peak`;
- `optimizer`: optimizer slots (Adam's moments; laid out like their weight);
- `other`: every other variable (BatchNormalization statistics, counters,
  metrics);
- `activations`: forward tensors computed from the batch that the backward
  pass reads (`CommunicationReport.saved_activation_bytes`);
- `gathered`: weights all-gathered in the forward pass (fsdp) that the
  backward pass reads, i.e. held whole between the passes (0 with
  `reshard_after_forward=True` or in recomputed layers);
- `peak`: the most bytes live at once: the variables above and the
  device's block of the batch plus the program's tensors, each live from the op that makes it to the last op
  that reads it (views such as reshapes share their input's buffer;
  variable reads share the variable's), each op run as soon as its inputs
  are ready, as TF's executor does (first ready, first run).

A `PipelineModel`'s step is one program per stage mesh: each stage's
devices get their row from their stage's program, its activations those
held at once in the schedule's order (`tfpar.reports.pipeline_memory`).

Under `offload="optimizer"` (`tfpar.offload`) the devices' rows hold no
optimizer state and their step no update; the host devices that hold the
state have rows too: the weights' copy, the gradients moved there and the
state, `peak` their sum (the update's temporaries not counted), no
activations.

The peak is what the program needs if no kernel reuses an input's buffer
for its output (constants not counted) and ops run in that order; TF's
executor runs ready ops on several threads, so its order, and its peak,
can differ a little. On a GPU, `tf.config.experimental.
get_memory_info(device)["peak"]` after a step would cross-check it (not
available on the virtual CPUs this was tested on).

The rows and the accounting of the program's buffers (`run_order`,
`live_bytes`, ...) are `tfpar.reports.buffers`', shared with the pipeline's
report.

Example:

>>> import keras, numpy as np, tfpar
>>> tfpar.use_virtual_cpus(8)
>>> strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}), fsdp=True,
...                                   reshard_after_forward=True)
>>> with strategy.scope():
...     model = keras.Sequential([keras.Input((16,)),
...         keras.layers.Dense(64, activation="relu", name="up"),
...         keras.layers.Dense(16, name="down")])
...     model.compile(optimizer="adam", loss="mse")
>>> x = np.ones((16, 16), "float32")
>>> report = tfpar.memory_report(model, x, x)
>>> report[strategy.mesh.devices[0]]["gathered"]   # freed after forward
0
>>> print(report)          # one row per device, then the layers
"""

import collections

import keras
import numpy as np

from tfpar import _compat
from tfpar import training
from tfpar.reports import buffers
from tfpar.reports import pipeline_memory
from tfpar.reports import program as program_lib
from tfpar.reports.communication import program_report


def memory_report(model, x=None, y=None, sample_weight=None, path=None,
                  batch_size=None):
    """Per-device memory of one training step of a model under a
    `tfpar.ParallelStrategy` (see the module docstring for each kind; a
    `tfpar.PipelineModel`: `tfpar.reports.pipeline_memory`).

    Compiles and runs one step on the global batch `(x, y)` as `fit` does,
    then puts every variable back. `path` also saves `report.plot(path)`.
    The layer rows are named by the layers' paths, the names their
    weights' paths start with.

    Without `x`, the batch is made from the model's inputs (a functional
    model's `model.inputs`, every dimension but the batch known): zeros
    for integer inputs (valid token ids), ones for float ones, and targets
    shaped like the outputs (without the last dimension, as integers, for
    a sparse loss). Its size is `batch_size`, by default the smallest the
    step accepts (the data axis' size, times the micro-batches of a
    `PipelineModel`): activations grow with the batch, so pass your own
    `batch_size` (or `x`, `y`) to read them for your training.

    Example (a functional model, no data at hand):

    >>> report = tfpar.memory_report(model, batch_size=64)

    Returns:
        A `tfpar.reports.buffers.MemoryReport`: {device name: {"params",
        "gradients", "optimizer", "other", "activations", "gathered",
        "peak": bytes}}.
    """
    if x is None:
        x, y = batch_from_inputs(model, batch_size, y)
    if isinstance(model, training.StagedModel):
        report = pipeline_memory.pipeline_report(model, x, y, sample_weight)
    else:
        report = _step_report(model, x, y, sample_weight)
    if path is not None:
        report.plot(path)
    return report


def batch_from_inputs(model, batch_size=None, y=None):
    """(x, y) of `batch_size` samples shaped like functional `model`'s
    inputs and outputs (`memory_report` without `x`); `y` when given."""
    strategy = model.distribute_strategy
    smallest = strategy.data_parallel_size * getattr(
        model, "num_microbatches", 1)
    if batch_size is None:
        batch_size = smallest
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1 or (
            batch_size % smallest):
        raise ValueError(
            f"memory_report(batch_size) must be a positive multiple of "
            f"{smallest} (the data axis' size, times the micro-batches of a "
            f"PipelineModel). Received: batch_size={batch_size!r}")
    graph = _compat.functional_of(getattr(model, "wrapped", model))
    inputs = None if graph is None else _compat.inputs_struct(graph)
    name = getattr(model, "name", type(model).__name__)
    if inputs is None:
        raise ValueError(
            f"memory_report(model) without x: the inputs of {name!r} are "
            "not known (a subclassed model has no model.inputs). Received: "
            "x=None. Pass a batch: tfpar.memory_report(model, x, y).")
    x = keras.tree.map_structure(
        lambda t: _filled(t, batch_size, name, "x"), inputs)
    if y is None:
        sparse = "sparse" in str(getattr(model, "loss", "")).lower()
        y = keras.tree.map_structure(
            lambda t: _filled(t, batch_size, name, "y", sparse),
            _compat.outputs_struct(graph))
    return x, y


def _filled(tensor, batch_size, name, argument, sparse=False):
    """A host array of `batch_size` samples shaped like symbolic `tensor`:
    zeros if integer (or `sparse` targets: integer, without the last
    dimension), else ones."""
    shape = tuple(tensor.shape[1:-1] if sparse else tensor.shape[1:])
    if None in shape:
        raise ValueError(
            f"memory_report(model) without {argument}: {tensor.name!r} of "
            f"{name!r} has shape {tuple(tensor.shape)}, a dimension other "
            f"than the batch unknown (e.g. the sequence length). Received: "
            f"{argument}=None. Pass a batch: tfpar.memory_report(model, x, "
            "y), e.g. x of shape (batch, sequence length) for token ids.")
    dtype = "int32" if sparse else str(tensor.dtype)
    if "int" in dtype or "bool" in dtype:
        return np.zeros((batch_size, *shape), dtype)
    return np.ones((batch_size, *shape), dtype)


def _step_report(model, x, y, sample_weight):
    """`memory_report` of a model whose step is one SPMD program."""
    program = program_lib.keras_program(model, x, y, sample_weight,
                                        "memory_report")
    strategy = model.distribute_strategy
    backward = program.backward_nodes()
    collectives = program_report(program)
    gathered = buffers.saved_gathered(program, backward)
    live = buffers.live_bytes(program, buffers.run_order(program))
    by_layer = collections.defaultdict(lambda: {"activations": 0,
                                                "gathered": 0})
    paths = buffers.LayerPaths(model)
    for kind, tensors in (
            ("activations", collectives.saved_activations),
            ("gathered", {f"{key[1]}:{index}": size
                          for (key, index), size in gathered.items()})):
        for name, (shape, dtype) in tensors.items():
            by_layer[paths(name)][kind] += program_lib.nbytes(shape, dtype)
    activations = sum(v["activations"] for v in by_layer.values())
    gathered_bytes = sum(v["gathered"] for v in by_layer.values())
    # The step's batch blocks, live for the whole step.
    batch = (buffers.batch_bytes((x, y, sample_weight))
             // strategy.data_parallel_size)
    per_device = {}
    mesh_devices = set(strategy.mesh.devices)
    for device, held in strategy.memory_per_device().items():
        if device not in mesh_devices:  # offload's host devices
            per_device[device] = buffers.host_update_memory(held)
            continue
        per_device[device] = buffers.device_memory(
            held, activations, gathered_bytes, batch + max(live, default=0))
    return buffers.MemoryReport(per_device, by_layer, live, collectives,
                                program.name)
