"""Blockwise attention's key tiles as a `tf.while_loop` (`KeyTiles.looped`).

Unrolled, the traced step holds a copy of a tile's ops per tile (about
s / TILE_KEYS per attention layer and pass), so the graph and its trace
and compile time grow with the sequence (benchmarks/context_trace.py).
Looped, one copy whatever the number of tiles. The loop computes the same
ops in the same order: values and gradients are bit-identical to the
unrolled tiles, on one device and on a data=2 x context=4 mesh (the loop's
state laid out by DTensor); the peak stays linear in the sequence
(tests/test_context_peak.py runs the default, looped above
`LOOP_TILES_ABOVE` tiles).
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfpar import blockwise_attention

import context_models
import test_context_peak

POSITIONS = np.array([0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9])


def padding_masks():
    """A dense mask with padded keys and a query seeing no key; factored
    key validity."""
    dense = np.ones((2, 16, 16), bool)
    dense[1, :, 9:] = False
    dense[1, 5] = False
    key_valid = np.ones((2, 16), bool)
    key_valid[0, 11:] = False
    return dense, key_valid


def values_and_gradients(loop, tile_size, function=False, **options):
    """[O, dQ, dK, dV] of a sum of O times a fixed upstream, the tiles
    looped (`loop`) or unrolled, eagerly or in a `tf.function`."""
    q, k, v = (tf.random.stateless_normal((2, 16, 2, 4), (i, 0))
               for i in range(3))

    def attend(q, k, v):
        return blockwise_attention.blockwise_attention(
            q, k, v, POSITIONS, POSITIONS, scale=0.5, block_size=8,
            soft_cap=5.0, tile_size=tile_size, **options)

    with looped_above(0 if loop else None):
        return context_models.values_and_gradients(attend, q, k, v,
                                                   function)


@contextlib.contextmanager
def looped_above(threshold):
    saved = blockwise_attention.LOOP_TILES_ABOVE
    blockwise_attention.LOOP_TILES_ABOVE = threshold
    try:
        yield
    finally:
        blockwise_attention.LOOP_TILES_ABOVE = saved


def mask_options(name):
    dense, key_valid = padding_masks()
    return {"dense": dict(mask=dense),
            "window+keys": dict(key_valid=key_valid, window=5),
            "queries": dict(query_valid=key_valid),
            "none": dict(causal=False)}[name]


@pytest.mark.parametrize("masks", [
    "dense", *(pytest.param(name, marks=pytest.mark.slow)
               for name in ("window+keys", "queries", "none"))])
def test_looped_tiles_are_bit_identical_to_unrolled(masks):
    """Tiles of 2 keys in blocks of 8 (8 tiles), causal by permuted
    positions, a soft cap, each mask kind, traced."""
    options = mask_options(masks)
    for got, want in zip(values_and_gradients(True, 2, True, **options),
                         values_and_gradients(False, 2, True, **options)):
        np.testing.assert_array_equal(got, want)


def test_loop_only_for_tiles_of_one_width():
    """Tiles of 3 keys in blocks of 8 (3, 3, 2) cannot be read by one
    index: unrolled, whatever the threshold; tiles of 4 loop above it."""
    masks = blockwise_attention.BlockMasks(causal=True)
    with looped_above(0):
        uneven = blockwise_attention.KeyTiles(
            blockwise_attention.key_tiles([(0, 8), (8, 16)], 3),
            POSITIONS, POSITIONS, masks)
        even = blockwise_attention.KeyTiles(
            blockwise_attention.key_tiles([(0, 8), (8, 16)], 4),
            POSITIONS, POSITIONS, masks)
    with looped_above(4):
        four = blockwise_attention.KeyTiles(
            blockwise_attention.key_tiles([(0, 8), (8, 16)], 4),
            POSITIONS, POSITIONS, masks)
    assert (uneven.looped, even.looped, four.looped) == (False, True, False)


def traced_ops(loop, length):
    """Nodes of a traced forward + backward blockwise attention over
    `length` keys in tiles of 2 (one block)."""
    spec = tf.TensorSpec((1, length, 2, 4))
    positions = np.arange(length)

    def run(q, k, v):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = blockwise_attention.blockwise_attention(
                q, k, v, positions, positions, scale=0.5, tile_size=2)
        return tape.gradient(out, [q, k, v])

    with looped_above(0 if loop else None):
        graph = tf.function(run).get_concrete_function(
            spec, spec, spec).graph.as_graph_def()
    return len(graph.node) + sum(len(f.node_def)
                                 for f in graph.library.function)


def test_looped_trace_does_not_grow_with_the_tiles():
    """4 -> 16 tiles: the unrolled graph grows by a copy of the tile's ops
    per tile; the looped one stays the same size."""
    unrolled = [traced_ops(False, n) for n in (8, 32)]
    looped = [traced_ops(True, n) for n in (8, 32)]
    assert looped[0] == looped[1], looped
    assert unrolled[1] - unrolled[0] > 12 * 20, unrolled  # >20 ops a tile


@pytest.mark.slow  # 18-28 s: a child process and two compiled steps
def test_looped_step_peak_grows_linearly_in_the_sequence(monkeypatch):
    """tests/test_context_peak.py's measurement (a fresh child process,
    data=2 x context=4, 512 -> 1024 tokens: 4 -> 8 tiles of 128 keys per
    attention) with every tile loop looped: the loop's state and the
    select collecting dK and dV keep the step's peak linear in s
    (2.05x, then 1.59x to 2048, measured on 2026-12-05)."""
    monkeypatch.setattr(
        test_context_peak, "CHILD",
        "from tfpar import blockwise_attention\n"
        "blockwise_attention.LOOP_TILES_ABOVE = 0\n"
        + test_context_peak.CHILD)
    test_context_peak.assert_peak_linear(512)


def train(mesh, weights, x, y, loop):
    with looped_above(0 if loop else None):
        return context_models.train_transformer(mesh, weights, x, y,
                                                **CONFIG)


CONFIG = dict(vocab=32, seq_len=32, dim=32, heads=4, layers=1)
MESH = {"data": 2, "context": 4}


@pytest.fixture
def tiles_of_two(monkeypatch):
    """Tiles of 2 keys in key blocks of 8 (32 tokens over context=4): 16
    tiles, looped."""
    monkeypatch.setattr(blockwise_attention, "TILE_KEYS", 2)
    x, y = context_models.corpus(32, seq_len=32)
    keras.utils.set_random_seed(0)
    return context_models.causal_transformer(**CONFIG).get_weights(), x, y


def test_looped_tiles_data2_context4_parity(tiles_of_two):
    """Adam, 4 steps: one device's losses and weights within 1e-4."""
    weights, x, y = tiles_of_two
    reference = train(None, weights, x, y, loop=False)
    looped = train(MESH, weights, x, y, loop=True)
    context_models.assert_parity(*reference, *looped)


@pytest.mark.slow
def test_looped_tiles_data2_context4_bit_identical_to_unrolled(
        tiles_of_two):
    weights, x, y = tiles_of_two
    unrolled = train(MESH, weights, x, y, loop=False)
    looped = train(MESH, weights, x, y, loop=True)
    np.testing.assert_array_equal(unrolled[1], looped[1])
    for a, b in zip(unrolled[0].weights, looped[0].weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), a.path)
