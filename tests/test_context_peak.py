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
once and the resident set follows the live tensors. Doubling s must
multiply the step's peak by about 2 (linear), not about 4 (unchained score
tiles: 3.93-4.0× measured, docs/benchmarks.md).
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tfpar import blockwise_attention

import context_models

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# Many heads and a small width: the s/cp × s score terms, if any, dominate.
CONFIG = dict(vocab=32, dim=32, heads=16, layers=1)
GROWTH_LIMIT = 2.6  # of the step's peak when s doubles (linear: 2, s²: 4)

CHILD = r"""
import ctypes, gc, json, sys
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
    ctypes.CDLL(None).malloc_trim(0)  # free heap pages: RSS = live bytes
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


def test_step_peak_memory_grows_linearly_in_the_sequence():
    """512 -> 1024 tokens: key blocks of s/cp = 128 and 256 keys, tiles of
    TILE_KEYS = 128 (below cp x TILE_KEYS tokens the tile widens with s)."""
    assert blockwise_attention.TILE_KEYS == 128
    assert_peak_linear(512)


def dense_attention(q, k, v, positions, scale, mask, soft_cap):
    """Keras' softmax attention (the additive mask, soft cap first)."""
    scores = tf.einsum("btnh,bsnh->bnts", q, k) * scale
    scores = soft_cap * tf.tanh(scores / soft_cap)
    allowed = (positions[:, None] >= positions[None, :])[None] & mask
    scores += tf.where(allowed[:, None], 0.0, blockwise_attention.MASKED)
    return tf.einsum("bnts,bsnh->btnh", tf.nn.softmax(scores), v)


@pytest.mark.parametrize("tile_size", [3, 8, None])
def test_tiles_keep_values_and_gradients(tile_size, monkeypatch):
    """Tiles narrower than the blocks (3 does not divide 8: tiles of 3, 3
    and 2), as wide, and the default (None: `TILE_KEYS` read at the call,
    set to 3 here): the same outputs and dQ, dK, dV as dense attention,
    with a causal mask by permuted (load balanced) positions, padding (a
    fully masked query row) and a soft cap."""
    monkeypatch.setattr(blockwise_attention, "TILE_KEYS", 3)
    q, k, v = (tf.random.stateless_normal((2, 16, 2, 4), (i, 0))
               for i in range(3))
    positions = np.array([0, 1, 14, 15, 2, 3, 12, 13,
                          4, 5, 10, 11, 6, 7, 8, 9])
    mask = np.ones((2, 16, 16), bool)
    mask[1, :, 9:] = False  # padded keys
    mask[1, 5] = False  # a query seeing no key: output 0

    def tiled(q, k, v):
        return blockwise_attention.blockwise_attention(
            q, k, v, positions, positions, scale=0.5, mask=mask,
            block_size=8, soft_cap=5.0, tile_size=tile_size)

    def dense(q, k, v):
        out = dense_attention(q, k, v, positions, 0.5, mask, 5.0)
        return out * np.any(mask, -1)[..., None, None]  # Keras' 0 rows

    gradients = context_models.values_and_gradients
    for got, want in zip(gradients(tiled, q, k, v),
                         gradients(dense, q, k, v)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bad_tile_size_is_refused_naming_it():
    q = tf.zeros((1, 4, 1, 2))
    with pytest.raises(ValueError, match=r"tile_size=0.*positive"):
        blockwise_attention.blockwise_attention(
            q, q, q, np.arange(4), np.arange(4), scale=1.0, tile_size=0)


@pytest.mark.slow
def test_tiled_attention_data2_context4_parity(monkeypatch):
    """Tiles of 2 keys in blocks of 8 (32 tokens over context=4) on
    data=2 x context=4: the chained tiles train in parity with one
    device."""
    monkeypatch.setattr(blockwise_attention, "TILE_KEYS", 2)
    config = dict(vocab=32, seq_len=32, dim=32, heads=4, layers=1)
    weights, x, y = context_models.weights_and_corpus(config, 32, 32)
    runs = [context_models.train_transformer(mesh, weights, x, y, **config)
            for mesh in (None, {"data": 2, "context": 4})]
    context_models.assert_parity(*runs[0], *runs[1])
