"""Lines TensorFlow prints that a tfpar user cannot act on, filtered out.

Importing TensorFlow prints C++ INFO lines before absl's logging starts
(so `TF_CPP_MIN_LOG_LEVEL` does not reach them): "All log messages before
absl::InitializeLog() is called are written to STDERR", oneDNN's and the
CPU feature guard's notices, "Could not find cuda drivers" — each twice, as
two of TF's libraries start. On a machine with no GPU, the first device
query adds "failed call to cuInit". `filtered_stderr` reads the process's
stderr (file descriptor 2, where C++ and Python both write) through a pipe
for the duration of a block and forwards every line except those matching
the given patterns, as they arrive (nothing is held back: a crash inside
the block loses at most a partial line). A user who asked TF for its INFO
lines (`TF_CPP_MIN_LOG_LEVEL=0`, or any `TF_CPP_MAX_VLOG_LEVEL`) gets them:
then nothing is filtered. (`TF_CPP_MIN_LOG_LEVEL=2`, the usual way to
quiet TF, does not reach these lines by itself; here it is honoured.)
While tfpar runs its steps, `quiet_cpp_info_logs` drops DTensor's C++ INFO
lines (one pair per SPMD expansion) by raising absl's minimum log level.

>>> from tfpar import logs
>>> with logs.filtered_stderr(logs.TENSORFLOW_IMPORT_LINES):
...     import tensorflow
"""

import contextlib
import ctypes
import mmap
import os
import re
import sys
import threading

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


def _forward(read_end, out, patterns):
    """Copies lines from `read_end` to file descriptor `out`, dropping
    those a pattern matches (a final line without newline is kept)."""
    with os.fdopen(read_end, "rb", buffering=0) as pipe:
        pending = b""
        while chunk := pipe.read(65536):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            kept = [line + b"\n" for line in lines
                    if not any(p.match(line) for p in patterns)]
            if kept:
                os.write(out, b"".join(kept))
        if pending and not any(p.match(pending) for p in patterns):
            os.write(out, pending)


@contextlib.contextmanager
def filtered_stderr(patterns):
    """Inside the block, lines of stderr that a pattern (bytes regexes,
    `re.match`ed) matches are dropped; everything else passes through."""
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
    reader = threading.Thread(target=_forward, args=(read_end, original, patterns),
                              name="tfpar-stderr-filter", daemon=True)
    reader.start()
    os.dup2(write_end, stderr_fd)
    os.close(write_end)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(original, stderr_fd)  # closes the pipe's last write end
        reader.join()
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
