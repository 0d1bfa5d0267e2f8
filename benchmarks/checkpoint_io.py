"""Checkpoint save/restore time and peak host memory: tfpar vs Keras .h5.

Run it with

    python benchmarks/checkpoint_io.py             # ~100M parameters, 3 rounds
    python benchmarks/checkpoint_io.py --quick     # ~10M parameters, 1 round
    python benchmarks/checkpoint_io.py --help

It builds two float32 Keras MLPs with the same number of parameters
(100.7M, 403 MB; `--quick` 10.5M, 42 MB) that differ only in how the
parameters are cut into variables:

- "few huge":   Input(4096) -> Dense(12288, "up0") -> Dense(4096, "down0"):
                2 kernels of 50.3M parameters (201 MB each);
- "many small": Input(2048) -> 12 x [Dense(2048, "up<i>"), Dense(2048,
                "down<i>")]: 24 kernels of 4.2M parameters (16.8 MB each).

Each is built twice, in one process: on one device without any strategy,
and under `tfpar.ParallelStrategy(tfpar.Mesh({"model": 8}), rules=RULES)` on
8 virtual CPU devices (up kernels split by columns, down kernels by rows:
every device holds 1/8 of every kernel). Both are compiled with Adam and
the optimizer is built (`model.optimizer.build(model.trainable_variables)`)
so its state (2 slots per weight) exists. The methods, each a save into a
fresh directory then a restore from it, round-robin over `--rounds`:

- keras .h5, 1 device (the baseline): `model.save_weights("x.weights.h5")`,
  `model.load_weights(...)` of the single-device model. Keras 3 writes the
  optimizer's variables into it too: params + Adam, 3x the parameter bytes;
- keras .h5, model=8: the same calls on the sharded model (tfpar's Keras
  path gathers one whole variable at a time to the host);
- tfpar, 1 device: `tfpar.save_checkpoint(model, dir)`,
  `tfpar.restore_checkpoint(model, dir)` (params + Adam), single-device;
- tfpar, model=8: the same on the sharded model (one .npy per device block);
- tfpar params only, model=8: the same with `optimizer=False`.

Time is wall-clock, median over rounds. Memory is the peak extra resident
memory of the process above its level just before the operation (after
`gc.collect()` and `malloc_trim(0)`): the kernel's high-water mark VmHWM,
reset through /proc/self/clear_refs before each operation, cross-checked by
a thread sampling VmRSS every 2 ms (tracemalloc cannot see TF's buffers).
The maximum over rounds is shown. It includes file pages a restore maps
(RssFile), not the page cache of written files. So that memory freed by one
operation is returned to the OS instead of silently reused by the next
(hiding its peak), glibc is told to serve every allocation of 64 KiB or more
with its own mmap (`mallopt(M_MMAP_THRESHOLD)`), for all methods alike; one
untimed warm-up round on tiny models runs first. tfpar fsyncs every file it
writes (crash safety); Keras' .h5 writer does not, so the .h5 save time
includes an fsync of the file (durable saves on both sides). `os.sync()` runs
before each timed operation, and restores read files just written (warm
page cache), for every method alike. Disk speed on a shared host is noisy:
compare within one run.

The memory claim checked: the sharded save's peak extra memory follows the
largest per-device block, not the largest variable (the "few huge" model's
kernels are 12x the "many small" ones, its blocks too, and the peak is
printed next to both).
"""

import argparse
import ctypes
import gc
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

NUM_DEVICES = 8
RULES = {
    r".*up\d+/kernel": (None, "model"),   # column-parallel: split outputs
    r".*up\d+/bias": ("model",),
    r".*down\d+/kernel": ("model", None),  # row-parallel: split inputs
}
# name -> (input width, [(layer name, units)]) at full size; --quick divides
# every width by QUICK_DIVISOR (parameters by ~its square).
SHAPES = {
    "few huge": (4096, [("up0", 12288), ("down0", 4096)]),
    "many small": (2048, [(f"{kind}{i}", 2048) for i in range(12)
                          for kind in ("up", "down")]),
}
QUICK_DIVISOR = 3.1
MB = 1e6


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Prints one table; compare ratios within one run only.")
    parser.add_argument("--quick", action="store_true",
                        help="~10M-parameter models and 1 round (a smoke run)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="round-robin rounds per method (default 3; 1 "
                             "with --quick)")
    parser.add_argument("--dir", default=None,
                        help="where checkpoints are written (default: a new "
                             "temporary directory, removed at the end); "
                             "needs ~2.5 GB free at full size")
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    return args


args = parse_args() if __name__ == "__main__" else None

import tfpar  # noqa: E402  (imports TensorFlow, does not initialise it)

if __name__ == "__main__":
    tfpar.use_virtual_cpus(NUM_DEVICES)  # first thing, before any TF op

import keras  # noqa: E402
import numpy as np  # noqa: E402

# ---------------------------------------------------------------------------
# Peak resident memory
# ---------------------------------------------------------------------------


def _status_kb(*fields):
    """{field: kB} from /proc/self/status (VmRSS, VmHWM, RssAnon, ...)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in fields:
                out[name] = int(rest.split()[0])
    return out


def _unmap_freed_memory():
    """glibc: allocations >= 64 KiB get their own mmap, unmapped when freed.
    Without it, freed blocks stay in malloc's arenas, and the RSS of the
    next operation does not rise while it reuses them."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: the RSS figures may then understate
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 64 * 1024)
                and libc.mallopt(m_trim_threshold, 128 * 1024))


def _malloc_trim():
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _reset_high_water_mark():
    """Resets VmHWM to the current VmRSS (Linux >= 4.0); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRSS:
    """Peak extra resident memory (bytes) of the process inside `with`.

    extra = max(VmRSS during the block) - VmRSS at entry, where the maximum
    is the kernel's VmHWM (reset at entry) or, if it cannot be reset, the
    largest of the 2 ms samples.
    """

    def __init__(self, interval=0.002):
        self.interval = interval
        self.extra = self.sampled_extra = None

    def __enter__(self):
        gc.collect()
        _malloc_trim()
        self._hwm = _reset_high_water_mark()
        self._base = _status_kb("VmRSS")["VmRSS"]
        self._peak = self._base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(self.interval):
            self._peak = max(self._peak, _status_kb("VmRSS")["VmRSS"])

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        now = _status_kb("VmRSS", "VmHWM")
        sampled = max(self._peak, now["VmRSS"])
        peak = max(sampled, now["VmHWM"]) if self._hwm else sampled
        self.extra = (peak - self._base) * 1024
        self.sampled_extra = (sampled - self._base) * 1024
        return False


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------


def build_model(shape, divisor, strategy=None):
    """The MLP `shape` (one device, or under `strategy`), compiled with Adam,
    its optimizer built, biases set non-zero (restores are then checked)."""
    width, layers = SHAPES[shape]

    def scale(n):
        return max(8, int(n / divisor) // 8 * 8)  # divisible by 8 devices

    def make():
        model = keras.Sequential(
            [keras.Input((scale(width),))]
            + [keras.layers.Dense(scale(units), name=name)
               for name, units in layers],
            name=shape.replace(" ", "_"))
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        model.optimizer.build(model.trainable_variables)
        return model

    if strategy is None:
        model = make()
    else:
        with strategy.scope():
            model = make()
    rng = np.random.default_rng(0)
    for variable in model.weights:
        if variable.path.endswith("bias"):
            variable.assign(rng.normal(size=variable.shape).astype("float32"))
    return model


def sizes(model, blocks_per_kernel):
    """(parameters, largest variable bytes, largest per-device block bytes)
    where a kernel is cut into `blocks_per_kernel` blocks (1: one device)."""
    count = sum(int(np.prod(v.shape)) for v in model.weights)
    largest = max(int(np.prod(v.shape)) * 4 for v in model.weights)
    return count, largest, largest // blocks_per_kernel


# ---------------------------------------------------------------------------
# Methods
# ---------------------------------------------------------------------------


class Method:
    """save(model, directory) / restore(model, directory) of one kind."""

    def __init__(self, name, mesh, save, restore):
        self.name, self.mesh = name, mesh
        self.save, self.restore = save, restore


def _h5(directory):
    return os.path.join(directory, "x.weights.h5")


def _save_h5(model, directory):
    """save_weights, then fsync the file: durable, as tfpar's save is."""
    model.save_weights(_h5(directory))
    with open(_h5(directory), "rb") as f:
        os.fsync(f.fileno())


def _tfpar(optimizer):
    return (lambda m, d: tfpar.save_checkpoint(m, d, optimizer=optimizer,
                                               step=0),
            lambda m, d: tfpar.restore_checkpoint(m, d, optimizer=optimizer))


# Keras 3's save_weights writes the optimizer's variables too: the .h5 rows
# hold params + Adam, as the tfpar rows but the last.
METHODS = [
    Method("keras .h5, 1 device", None, _save_h5,
           lambda m, d: m.load_weights(_h5(d))),
    Method("keras .h5, model=8", "model=8", _save_h5,
           lambda m, d: m.load_weights(_h5(d))),
    Method("tfpar, 1 device", None, *_tfpar(True)),
    Method("tfpar, model=8", "model=8", *_tfpar(True)),
    Method("tfpar params only, model=8", "model=8", *_tfpar(False)),
]
BASELINE = METHODS[0].name


def disk_bytes(directory):
    return sum(os.path.getsize(os.path.join(root, f))
               for root, _, files in os.walk(directory) for f in files)


def run_once(method, model, root):
    """(save s, restore s, save extra B, restore extra B, bytes on disk)."""
    directory = tempfile.mkdtemp(dir=root)
    try:
        os.sync()  # no earlier writes still being flushed during the timing
        with PeakRSS() as save_mem:
            start = time.perf_counter()
            method.save(model, directory)
            save_time = time.perf_counter() - start
        size = disk_bytes(directory)
        # The last bias is zeroed so the restore has something to undo.
        sentinel = model.weights[-1]
        expected = np.asarray(sentinel)
        sentinel.assign(np.zeros(sentinel.shape, "float32"))
        os.sync()
        with PeakRSS() as restore_mem:
            start = time.perf_counter()
            method.restore(model, directory)
            restore_time = time.perf_counter() - start
        if not np.array_equal(np.asarray(sentinel), expected):
            raise AssertionError(f"{method.name}: restore did not restore "
                                 f"{sentinel.path}")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return (save_time, restore_time, save_mem.extra, restore_mem.extra, size,
            max(save_mem.extra - save_mem.sampled_extra,
                restore_mem.extra - restore_mem.sampled_extra))


def main(args):
    if not _unmap_freed_memory():
        print("warning: mallopt failed; freed memory may be reused unseen "
              "and the peak figures understate", file=sys.stderr)
    root = args.dir or tempfile.mkdtemp(prefix="tfpar-ckpt-bench-")
    os.makedirs(root, exist_ok=True)
    divisor = QUICK_DIVISOR if args.quick else 1.0
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"model": NUM_DEVICES}),
                                      rules=RULES)
    print(f"checkpoints in {root}; {args.rounds} round(s); "
          f"load average {os.getloadavg()}", flush=True)
    # Warm-up: imports, tracing and first-call costs of every method.
    for shape in SHAPES:
        for mesh in (None, "model=8"):
            tiny = build_model(shape, 64, strategy if mesh else None)
            for method in METHODS:
                if method.mesh == mesh:
                    run_once(method, tiny, root)
    models, info = {}, {}
    for shape in SHAPES:
        start = time.perf_counter()
        models[shape, None] = build_model(shape, divisor)
        models[shape, "model=8"] = build_model(shape, divisor, strategy)
        count, largest, block = sizes(models[shape, None], NUM_DEVICES)
        info[shape] = (count, largest, block)
        print(f"built {shape!r}: {count / 1e6:.1f}M parameters "
              f"({count * 4 / MB:.0f} MB), largest variable "
              f"{largest / MB:.1f} MB, its model=8 block {block / MB:.1f} MB "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    results = {}
    worst_gap = 0
    for round_ in range(args.rounds):
        for shape in SHAPES:
            for method in METHODS:
                out = run_once(method, models[shape, method.mesh], root)
                results.setdefault((shape, method.name), []).append(out[:5])
                worst_gap = max(worst_gap, out[5])
        print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average at end: {os.getloadavg()}")
    print(f"(VmHWM exceeded the 2 ms VmRSS samples by at most "
          f"{worst_gap / MB:.0f} MB)")
    print_table(results, info)


def print_table(results, info):
    def summary(runs):
        save, restore = (statistics.median(r[i] for r in runs) for i in (0, 1))
        save_mem, restore_mem = (max(r[i] for r in runs) for i in (2, 3))
        return save, restore, save_mem, restore_mem, runs[-1][4]

    header = ("| model | method | on disk MB | save s | ×base | restore s "
              "| ×base | save peak +MB | restore peak +MB |")
    print()
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for shape in SHAPES:
        base = summary(results[shape, BASELINE])
        for method in METHODS:
            save, restore, save_mem, restore_mem, size = summary(
                results[shape, method.name])
            print(f"| {shape} | {method.name} | {size / MB:.0f} "
                  f"| {save:.2f} | {save / base[0]:.2f} "
                  f"| {restore:.2f} | {restore / base[1]:.2f} "
                  f"| {save_mem / MB:.0f} | {restore_mem / MB:.0f} |")
    print()
    print("| model | parameters | largest variable MB | largest model=8 "
          "block MB | tfpar model=8 save peak +MB (params / + Adam) |")
    print("|---|---|---|---|---|")
    for shape in SHAPES:
        count, largest, block = info[shape]
        peaks = [summary(results[shape, name])[2] / MB
                 for name in ("tfpar params only, model=8",
                              "tfpar, model=8")]
        print(f"| {shape} | {count / 1e6:.1f}M | {largest / MB:.1f} "
              f"| {block / MB:.1f} | {peaks[0]:.0f} / {peaks[1]:.0f} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main(args)
