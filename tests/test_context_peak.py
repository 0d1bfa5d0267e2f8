"""Blockwise attention keeps PEAK memory, not only saved activations,
linear in the sequence.

tests/test_context_memory.py reads the saved activations (what the
backward pass keeps) from the compiled program. The peak also holds the
transient score tiles: if the key tiles of one attention were independent
ops, TF's executor could run them all at once and hold every (s/cp × tile)
score tile together, s/cp × s floats per head: quadratic in s. Chained
(each tile's scores wait for the previous tile's fold into the running
max, sum and output), one tile of at most `TILE_KEYS` keys is live at a
time: linear in s.

CPU TF keeps no per-device memory statistics, so the test measures the
operating system's count: a fresh child process builds the causal
transformer on data=2 × context=4 (the 8 virtual devices share the
process), runs one step to trace and compile it, resets the peak resident
set (Linux: "5" into /proc/self/clear_refs resets VmHWM) and runs a second
step; the step's peak is VmHWM minus the resident set before it. Tensors
are allocated with the system's malloc (TF_ONEDNN_USE_SYSTEM_ALLOCATOR:
oneDNN's allocator would keep freed memory in a pool), large ones with mmap
(MALLOC_MMAP_THRESHOLD_), so a freed tensor leaves the resident set at
once and the resident set follows the live tensors. Doubling s must multiply the step's peak by about 2 (linear), not
about 4 (the unchained score tiles: 3.4-3.9× measured, see the report).
"""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# Many heads and a small width: the s/cp × s score terms, if any, dominate.
CONFIG = dict(vocab=32, dim=32, heads=16, layers=1)
GROWTH_LIMIT = 2.6  # of the step's peak when s doubles (linear: 2, s²: 4)

CHILD = r"""
import gc, json, sys
import keras, numpy as np
import tfpar
import context_models

tfpar.use_virtual_cpus(8)


def resident(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024


def step_peak(seq_len, config):
    keras.utils.set_random_seed(0)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "context": 4}))
    with strategy.scope():
        model = context_models.causal_transformer(**config, seq_len=seq_len)
    model.compile(optimizer=keras.optimizers.SGD(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    x, y = context_models.corpus(2, seq_len=seq_len)
    model.fit(x, y, batch_size=2, epochs=1, verbose=0)  # trace, compile
    gc.collect()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # VmHWM := VmRSS
    before = resident("VmRSS")
    model.fit(x, y, batch_size=2, epochs=1, verbose=0)
    return resident("VmHWM") - before


config = json.loads(sys.argv[1])
print(json.dumps({s: step_peak(int(s), config) for s in sys.argv[2:]}))
"""


def step_peaks(lengths, **config):
    """{seq_len: bytes} of one training step's peak above its start, each
    length in the same fresh child process (module docstring)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536",
               TF_ONEDNN_USE_SYSTEM_ALLOCATOR="1",
               TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(
                   [ROOT, HERE, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(dict(CONFIG, **config)),
         *map(str, lengths)],
        env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return {int(s): b for s, b in json.loads(
        done.stdout.strip().splitlines()[-1]).items()}


def assert_peak_linear(short, **config):
    peaks = step_peaks([short, 2 * short], **config)
    growth = peaks[2 * short] / peaks[short]
    assert peaks[short] > 0 and growth <= GROWTH_LIMIT, (peaks, growth)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"),
                    reason="needs Linux's /proc/self/clear_refs")
def test_step_peak_memory_grows_linearly_in_the_sequence():
    assert_peak_linear(1024)
