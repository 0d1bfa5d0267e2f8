"""Lines TensorFlow prints that a tfpar user cannot act on, filtered out.

Importing TensorFlow prints C++ INFO lines before absl's logging starts
(so `TF_CPP_MIN_LOG_LEVEL` does not reach them): "All log messages before
absl::InitializeLog() is called are written to STDERR", oneDNN's and the
CPU feature guard's notices, "Could not find cuda drivers" — each twice, as
two of TF's libraries start. On a machine with no GPU, the first device
query adds "failed call to cuInit". `filtered_stderr` reads the process's
stderr (file descriptor 2, where C++ and Python both write) through a pipe
for the duration of a block and forwards every line except those matching
the given patterns, as they arrive; the filter is a process of its own,
so a native abort inside the block loses no line (the ones before it are
the ones that say why). A user who asked TF for its INFO lines
(`TF_CPP_MIN_LOG_LEVEL=0`, or any `TF_CPP_MAX_VLOG_LEVEL`) gets them: then
nothing is filtered. (`TF_CPP_MIN_LOG_LEVEL=2`, the usual way to
quiet TF, does not reach these lines by itself; here it is honoured.)
While tfpar runs its steps and the planner's calibrations, `quiet_steps`
drops DTensor's C++ INFO lines (one pair per SPMD expansion) by raising
absl's minimum log level (`quiet_cpp_info_logs`), and turns off Grappler's
memory optimizer, whose cost model logs "Incompatible Matrix dimensions"
errors on DTensor's per-device graphs (`without_grappler_memory_optimizer`):
the cause removed, not its lines filtered.

>>> from tfpar import logs
>>> with logs.filtered_stderr(logs.TENSORFLOW_IMPORT_LINES):
...     import tensorflow
"""

import contextlib
import ctypes
import mmap
import os
import re
import subprocess
import sys

# An absl/TF C++ INFO line ("I0000 00:00:1796137006.143502   20382 port.cc:153]
# ..."), the CPU feature guard's second line, and absl's pre-init notice.
TENSORFLOW_IMPORT_LINES = (
    re.compile(rb"^I\d{4} [\d:.]+ +\d+ \S+:\d+\] "),
    re.compile(rb"^To enable the following instructions: "),
    re.compile(rb"^WARNING: All log messages before absl::InitializeLog\(\) "
               rb"is called are written to STDERR"),
)
# TF's CUDA platform probing on a host with no usable GPU driver: said when
# the user asked for virtual CPU devices, which need none.
NO_GPU_DRIVER_LINES = (
    re.compile(rb"^E\d{4} [\d:.]+ +\d+ cuda_(platform|executor)\.cc:\d+\] "
               rb"failed call to cuInit"),
)


def _user_wants_tf_info_lines():
    return (os.environ.get("TF_CPP_MIN_LOG_LEVEL", "").strip() == "0"
            or "TF_CPP_MAX_VLOG_LEVEL" in os.environ)


# The filter runs in a process of its own, reading the pipe that stands in
# for stderr: when this process dies inside the block (a native abort, a
# fatal CHECK while TensorFlow loads), the pipe still holds what was written
# and the filter forwards all of it, to the end. (A reader thread would die
# with the process, and the last lines, the ones that say why, with it.)
# Ctrl-C is the program's to handle, so the filter ignores SIGINT.
_FORWARDER = r"""
import os, re, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
patterns = [re.compile(a.encode("latin-1")) for a in sys.argv[1:]]
def write(data):
    while data:
        data = data[os.write(1, data):]
def kept(line):
    return not any(p.match(line) for p in patterns)
pending = b""
while chunk := os.read(0, 65536):
    *lines, pending = (pending + chunk).split(b"\n")
    write(b"".join(line + b"\n" for line in lines if kept(line)))
if pending and kept(pending):
    write(pending)
"""


def _start_forwarder(read_end, out, patterns):
    """The filter process: copies `read_end` to file descriptor `out`,
    dropping the lines a pattern matches; None if it cannot start (no
    Python executable, as in a frozen or embedded interpreter)."""
    if not sys.executable or getattr(sys, "frozen", False):
        return None
    args = [p.pattern.decode("latin-1") for p in patterns]
    try:
        return subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _FORWARDER, *args],
            stdin=read_end, stdout=out, stderr=out)
    except OSError:
        return None


@contextlib.contextmanager
def filtered_stderr(patterns):
    """Inside the block, lines of stderr that a pattern (bytes regexes,
    `re.match`ed) matches are dropped; everything else passes through, as
    it arrives, and all of it even if the process dies inside the block."""
    if _user_wants_tf_info_lines():
        yield
        return
    try:
        stderr_fd = sys.__stderr__.fileno()
    except (AttributeError, OSError, ValueError):  # no real stderr (embedded)
        yield
        return
    sys.stderr.flush()
    original = os.dup(stderr_fd)
    read_end, write_end = os.pipe()
    forwarder = _start_forwarder(read_end, original, patterns)
    os.close(read_end)
    if forwarder is None:
        os.close(write_end)
        os.close(original)
        yield
        return
    os.dup2(write_end, stderr_fd)
    os.close(write_end)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(original, stderr_fd)  # closes the pipe's last write end
        forwarder.wait()  # until it has forwarded everything
        os.close(original)


# -- TensorFlow's C++ INFO lines while tfpar runs its steps -------------------

# TF 2.21 logs through absl: each time DTensor SPMD-expands a step for a new
# input shape or layout it logs two INFO lines ("DTensor cache key lookup
# missed for __inference__in_replica_... (re-)computing its SPMD
# transformation") straight to stderr, into Keras' progress bar. Nothing in
# them is actionable. The level that filters them, TF_CPP_MIN_LOG_LEVEL, is
# read once when TensorFlow loads (before tfpar, when `import keras` comes
# first), so tfpar raises absl's minimum level from INFO to WARNING while its
# steps run, through absl's exported C++ API. Warnings and errors still show.
_ABSL_SET_MIN = rb"_ZN4absl\d+lts_\d+14SetMinLogLevelENS0_18LogSeverityAtLeastE"
_ABSL_GET_MIN = rb"_ZN4absl\d+lts_\d+11MinLogLevelEv"
_absl_log_level = []  # [(get, set)] once looked up; [None] if unavailable


def _absl_symbol_names(path):
    """The mangled names of absl's (MinLogLevel, SetMinLogLevel) in the
    library file at `path` (the absl version is part of them), or None."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0,
                                          access=mmap.ACCESS_READ) as m:
        found = [re.search(p, m) for p in (_ABSL_GET_MIN, _ABSL_SET_MIN)]
        names = [n.group().decode() for n in found if n is not None]
    return names if len(names) == 2 else None


def _absl_min_log_level_functions():
    """absl's (MinLogLevel, SetMinLogLevel) in TensorFlow's C++ library, or
    None (looked up once)."""
    if _absl_log_level:
        return _absl_log_level[0]
    # Loaded by now; not imported at this module's import, which comes
    # before TensorFlow's (`tfpar/__init__.py` filters its lines).
    import tensorflow as tf  # noqa: PLC0415

    functions = None
    path = os.path.join(tf.sysconfig.get_lib(), "libtensorflow_framework.so.2")
    try:
        names = _absl_symbol_names(path)
        functions = _absl_functions(path, names) if names else None
    except (OSError, AttributeError):
        pass  # another TF build: its INFO lines stay
    _absl_log_level.append(functions)
    return functions


def _absl_functions(path, names):
    """(get, set) of the C functions `names` (getter, setter of an int) in
    the library at `path`, through ctypes."""
    library = ctypes.CDLL(path)  # already loaded: the same handle
    get, set_ = (getattr(library, name) for name in names)
    get.restype, get.argtypes = ctypes.c_int, []
    set_.restype, set_.argtypes = None, [ctypes.c_int]
    return get, set_


_ABSL_WARNING = 1  # absl::LogSeverityAtLeast::kWarning (kInfo is 0)


@contextlib.contextmanager
def quiet_cpp_info_logs():
    """TensorFlow's C++ INFO lines are dropped inside the block (WARNING
    and above still print), unless the user set TF_CPP_MIN_LOG_LEVEL or
    TF_CPP_MAX_VLOG_LEVEL: then the logging is theirs to choose."""
    user_chose = any(v in os.environ for v in ("TF_CPP_MIN_LOG_LEVEL",
                                               "TF_CPP_MAX_VLOG_LEVEL"))
    functions = None if user_chose else _absl_min_log_level_functions()
    if functions is None:
        yield
        return
    get, set_ = functions
    before = get()
    set_(max(before, _ABSL_WARNING))
    try:
        yield
    finally:
        set_(before)


# -- Grappler's memory optimizer on tfpar's steps -----------------------------

# Grappler's memory optimizer (on by default) estimates each device's peak
# memory by simulating the whole step with its analytical cost model, once
# per device and function, to decide whether to swap tensors to the host
# (GPUs only) or to accumulate a many-input AddN in place (when the estimate
# passes 80% of a device's memory). Under DTensor its estimate is wrong: in
# the per-device graph Grappler sees the variables' global shapes next to
# the activations' local ones, so a row-parallel MatMul of a [32, 16] shard
# by its [16, 32] kernel shard reads as [32, 16] x [64, 32], and the cost
# model logs "E... op_level_cost_estimator.cc:1126] Incompatible Matrix
# dimensions" for it: 40 lines for a 2-layer keras-hub GPT-2 on 8 devices.
# Swap and AddN decisions taken on sizes the devices do not hold would be
# wrong too, and on CPUs the simulation decides nothing (no GPU to swap
# from, memory far below 80%). So tfpar calls its step functions with the
# memory optimizer off (NO_MEM_OPT in the function-call config, which
# Grappler reads when it optimizes a function), unless that config already
# names another memory optimization: then it is the user's choice.
def _without_memory_optimizer(options):
    """A copy of `options` (a FunctionCallOptions) with NO_MEM_OPT, or None
    when its config names a memory optimization."""
    # TensorFlow is loaded by now (see `_absl_min_log_level_functions`).
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2  # noqa: PLC0415
    from tensorflow.python.eager import context  # noqa: PLC0415

    config = config_pb2.ConfigProto.FromString(options.config_proto_serialized)
    rewrite = config.graph_options.rewrite_options
    if rewrite.memory_optimization != rewriter_config_pb2.RewriterConfig.DEFAULT_MEM_OPT:
        return None
    rewrite.memory_optimization = rewriter_config_pb2.RewriterConfig.NO_MEM_OPT
    return context.FunctionCallOptions(executor_type=options.executor_type,
                                       config_proto=config)


@contextlib.contextmanager
def without_grappler_memory_optimizer():
    """Functions first called inside the block (on this thread) are
    optimized without Grappler's memory optimizer, unless the function-call
    config already names a memory optimization."""
    from tensorflow.python.eager import context  # noqa: PLC0415

    eager = context.context()
    before = eager.function_call_options
    options = _without_memory_optimizer(before)
    if options is None:
        yield
        return
    eager.function_call_options = options
    try:
        yield
    finally:
        eager.function_call_options = before


@contextlib.contextmanager
def quiet_steps():
    """What tfpar runs its steps and calibrations in: TF's C++ INFO lines
    dropped (`quiet_cpp_info_logs`) and Grappler's memory optimizer, whose
    cost model logs errors on DTensor's graphs, off
    (`without_grappler_memory_optimizer`).

    >>> import tensorflow as tf
    >>> from tfpar import logs
    >>> with logs.quiet_steps():
    ...     float(tf.function(lambda x: x + 1)(tf.constant(1.0)))
    2.0
    """
    with quiet_cpp_info_logs(), without_grappler_memory_optimizer():
        yield
