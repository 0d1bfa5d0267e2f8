"""Attention computed over key/value blocks with an online softmax.

The math of flash attention (and of ring attention's inner loop), written
with plain TF ops so that DTensor lays it out: for a query block Q (here the
queries a device holds, s/cp of them under context parallelism) and key /
value blocks K_j, V_j (j = 1..n),

    S_j = scale · Q K_jᵀ + A_j          (A_j: 0 where allowed, -1e9 where
                                         masked: Keras' additive mask)
    m_j = max(m_{j-1}, rowmax S_j)      (running maximum)
    l_j = l_{j-1}·exp(m_{j-1} - m_j) + rowsum exp(S_j - m_j)
    O_j = O_{j-1}·exp(m_{j-1} - m_j) + exp(S_j - m_j) V_j
    O   = O_n / l_n                     (m_n and l_n kept)

so only one (q × block) score matrix exists at a time, never (q × s). The
backward pass recomputes each block's probabilities from L instead of
keeping them (P_j = exp(S_j - m_n) / l_n), with D = rowsum(dO ∘ O):

    dV_j = P_jᵀ dO,   dS_j = P_j ∘ (dO V_jᵀ - D),
    dQ = scale · Σ_j dS_j K_j,   dK_j = scale · dS_jᵀ Q.

It keeps Q, K, V, O, m and l for the backward pass: O(q + s) per row of heads,
not O(q·s). Masks are given by position: `query_positions[i] >=
key_positions[j]` (causal; and `- key_positions[j] < window`, a sliding
window), so a device holding a permuted (load-balanced) piece of the
sequence masks by global position; padding is given factored, as
(batch, s) key and (batch, q) query validity vectors (`BlockMasks`), and
each tile's (q × tile) mask is built from them and the positions at run
time; only a general `mask` is held whole, (batch, q, s). A key block
no query may see (every pair masked, known when tracing) is skipped. Masked entries
count 0 in l and O, so a row whose every key is masked (a padded query
under a sliding window) gets output 0, as Keras' `Softmax` gives it.

Peak memory: the visible blocks are computed in tiles of at most
`TILE_KEYS` keys (`key_tiles`), and each tile's ops wait, by a data
dependency (a zero computed from the previous tile's results: forward,
added to Q from the running sum and output, `_waiting_on`; backward, to Q
from dQ and to the next K and V tile from dK and dV, `_zero_per_head`),
for the previous tile to be folded in.
Independent, the tiles could all run at once (TF's executor starts every
op whose inputs exist) and hold q × s scores per head; chained, one
(q × TILE_KEYS) tile per head is live at a time, so with q = s/cp the peak,
like the saved activations, is linear in s (tests/test_context_peak.py).

Trace size: when an attention computes more than `LOOP_TILES_ABOVE`
tiles, all of one width, the tiles run as a `tf.while_loop` over their
index (`KeyTiles`), forward and backward: the traced step holds one copy
of a tile's ops, not one per tile (s / TILE_KEYS per layer and pass), so
its trace and compile time do not grow with the sequence
(benchmarks/context_trace.py). Same ops, same order: bit-identical to the
unrolled tiles (tests/test_context_tile_loop.py). The backward loop
collects dK and dV tile by tile in a (batch, s / tile, tile, ...) tensor
by a select (each tile written once); DTensor lays the loop's state out
like the unrolled tensors.

Example (one device, against plain softmax attention):

>>> import numpy as np, tensorflow as tf
>>> q, k, v = (tf.random.normal((1, 8, 2, 4), seed=i) for i in range(3))
>>> out = blockwise_attention(q, k, v, np.arange(8), np.arange(8),
...                           scale=0.5, causal=True, block_size=2)
>>> s = tf.einsum("btnh,bsnh->bnts", q, k) * 0.5
>>> s += np.where(np.tril(np.ones((8, 8))) > 0, 0.0, -1e9)
>>> want = tf.einsum("bnts,bsnh->btnh", tf.nn.softmax(s), v)
>>> bool(np.allclose(out, want, atol=1e-5))
True
"""

import numpy as np
import tensorflow as tf

from tfpar import data_dependency

# Keras' additive mask value for float32 scores (`Softmax`'s adder).
MASKED = -1e9
# Keys per score tile: a device holds heads × q × TILE_KEYS scores at once.
TILE_KEYS = 128
# Tiles run as a tf.while_loop when an attention computes more than this
# many (None: always unrolled). Each unrolled tile adds the same ops per
# attention layer, so compile time grows with the sequence; looped, the
# graph is one tile's. Up to 8 tiles unrolled steps ran faster, beyond
# they take the same time (measured: docs/benchmarks.md, "Compile time of
# context-parallel steps"; benchmarks/context_trace.py).
LOOP_TILES_ABOVE = 8


def key_blocks(key_positions, block_size):
    """[(start, stop)] of the key blocks, `block_size` keys each."""
    length = len(key_positions)
    if block_size is None or block_size >= length:
        return [(0, length)]
    if length % block_size:
        raise ValueError(
            f"blockwise_attention: block_size={block_size} does not divide "
            f"the key length {length}. Use a block size dividing it.")
    return [(start, start + block_size)
            for start in range(0, length, block_size)]


def visible_blocks(query_positions, key_positions, block_size, causal,
                   window=None):
    """The key blocks at least one query may see (all when not causal):
    the blocks the step computes. A block is skipped when every key comes
    after the latest query (causal), or, with a sliding `window`, when the
    earliest query is `window` or more past the block's latest key."""
    blocks = key_blocks(key_positions, block_size)
    if not causal:
        return blocks
    latest_query = np.max(query_positions)
    earliest_query = np.min(query_positions)
    return [(start, stop) for start, stop in blocks
            if np.min(key_positions[start:stop]) <= latest_query and (
                window is None
                or earliest_query < np.max(key_positions[start:stop]) + window)]


def key_tiles(blocks, tile_size):
    """The (start, stop) key ranges the step computes one after another:
    each block of `blocks` cut into tiles of at most `tile_size` keys.

    >>> key_tiles([(0, 4), (8, 12)], 3)
    [(0, 3), (3, 4), (8, 11), (11, 12)]
    """
    if not isinstance(tile_size, (int, np.integer)) or tile_size < 1:
        raise ValueError(
            f"blockwise_attention: tile_size={tile_size!r}; it must be a "
            "positive number of keys (or None for TILE_KEYS).")
    return [(first, min(first + tile_size, stop)) for start, stop in blocks
            for first in range(start, stop, tile_size)]


def unmasked_block_counts(query_positions_per_device, key_positions,
                          block_size):
    """How many (query block, key block) pairs of `block_size` rows hold
    at least one allowed (causal) pair, per device: the work a device
    needs, given the global positions of the queries it holds.

    >>> unmasked_block_counts([np.arange(4), np.arange(4, 8)],
    ...                       np.arange(8), 2)
    [3, 7]
    """
    counts = []
    for positions in query_positions_per_device:
        positions = np.asarray(positions)
        counts.append(sum(
            len(visible_blocks(positions[start:start + block_size],
                               key_positions, block_size, causal=True))
            for start in range(0, len(positions), block_size)))
    return counts


def _additive_mask(anchor, query_positions, key_positions, masks):
    """A_j of the module docstring: (batch or 1, heads or 1, q, block)
    float32, from `masks` (a `BlockMasks` restricted to the block).

    The causal part (and the sliding window) is compared at run time,
    tile by tile, from the (q,) and (block,) position vectors and Q
    (`anchor`, (batch, q, heads, dim)): a row's position plus isnan(its
    first Q entry), 0 unless the row is NaN anyway. Built from constants
    alone, TF would fold every block's mask into a (q x block) constant
    held for the whole program: s/cp x s per layer and pass, quadratic in
    the sequence. The padding vectors broadcast to the tile here, so a
    factored mask never exists larger than one (q x block) tile."""
    adder = None
    if masks.causal:
        first = tf.transpose(anchor[..., :1], (0, 2, 1, 3))  # (b, n, q, 1)
        rows = tf.constant(np.asarray(query_positions, np.int32))[
            :, None] + tf.cast(tf.math.is_nan(first), tf.int32)
        keys = (key_positions if tf.is_tensor(key_positions)
                else tf.constant(np.asarray(key_positions, np.int32)))
        allowed = rows >= keys
        if masks.window is not None:  # p_i - p_j < window
            allowed = tf.logical_and(allowed, rows < keys + masks.window)
        adder = tf.where(allowed, 0.0, MASKED)
    for part in masks.additive_parts():
        adder = part if adder is None else tf.minimum(adder, part)
    return adder


class BlockMasks:
    """The mask of `blockwise_attention`, kept factored: `causal` and
    `window` by position, and at most three tensors: `dense` (batch, q, s)
    bool (a general mask: quadratic, s/cp × s per device under context
    parallelism), `key_valid` (batch, s) and `query_valid` (batch, q)
    (padding: False where masked; None: all valid). The one definition of
    these fields and of their check (a `window` needs `causal`):
    `context_parallel.FactoredMask`, the form Keras layers carry, is one
    without `dense`. `block(start, stop)` restricts it to the keys
    [start, stop); `additive_parts` are the tensors' -1e9 / 0 adders,
    shaped to broadcast against (batch, heads, q, block).

    >>> BlockMasks(causal=True, window=4).block(0, 2)
    BlockMasks(causal=True, window=4, key_valid=None, query_valid=None)
    """

    def __init__(self, causal, window=None, dense=None, key_valid=None,
                 query_valid=None):
        _check_window(window, causal, type(self).__name__)
        self.causal, self.window = bool(causal), window
        self.dense, self.key_valid = dense, key_valid
        self.query_valid = query_valid

    def block(self, start, stop):
        return self._keys(lambda valid: valid[..., start:stop])

    def tile(self, index, width):
        """`block` of the keys [index·width, (index+1)·width), `index` a
        scalar tensor (a `tf.while_loop`'s tile, `KeyTiles`)."""
        def tiled(valid):  # (..., s) -> (..., s/width, width), tile `index`
            shape = _shape(valid)[:-1] + [-1, width]
            return tf.gather(tf.reshape(valid, shape), index,
                             axis=len(shape) - 2)
        return self._keys(tiled)

    def _keys(self, take):
        """The mask of some keys: `take` applied to the tensors whose last
        dimension is the keys (`dense`, `key_valid`)."""
        return BlockMasks(
            self.causal, self.window,
            None if self.dense is None else take(self.dense),
            None if self.key_valid is None else take(self.key_valid),
            self.query_valid)

    @property
    def empty(self):
        """Whether it masks nothing (no causal band, no tensor)."""
        return not self.causal and all(
            t is None for t in (self.dense, self.key_valid, self.query_valid))

    def additive_parts(self):
        def adder(valid):
            return (1.0 - tf.cast(valid, tf.float32)) * MASKED
        if self.dense is not None:  # (b, 1, q, block)
            yield adder(tf.expand_dims(self.dense, 1))
        if self.key_valid is not None:  # (b, 1, 1, block)
            yield adder(self.key_valid[:, None, None, :])
        if self.query_valid is not None:  # (b, 1, q, 1)
            yield adder(self.query_valid[:, None, :, None])

    def __repr__(self):
        def shown(t):
            return None if t is None else tuple(t.shape)
        dense = "" if self.dense is None else f", dense={shown(self.dense)}"
        return (f"{type(self).__name__}(causal={self.causal}, "
                f"window={self.window}{dense}, "
                f"key_valid={shown(self.key_valid)}, "
                f"query_valid={shown(self.query_valid)})")


def _scores(query, key_block, scale, adder, soft_cap=None):
    """S_j, soft-capped first when `soft_cap`: c·tanh(scale·Q K_jᵀ / c)."""
    scores = tf.einsum("btnh,bsnh->bnts", query, key_block) * scale
    if soft_cap is not None:
        scores = soft_cap * tf.tanh(scores / soft_cap)
    return scores if adder is None else scores + adder


def blockwise_attention(query, key, value, query_positions, key_positions,
                        scale, causal=True, mask=None, block_size=None,
                        soft_cap=None, tile_size=None, key_valid=None,
                        query_valid=None, window=None):
    """softmax(scale · Q Kᵀ + mask) V over key blocks (module docstring).

    Args:
        query: (batch, q, heads, key_dim).
        key: (batch, s, heads, key_dim).
        value: (batch, s, heads, value_dim).
        query_positions: a numpy int array (q,): the global position of
            each query row, for the causal mask.
        key_positions: the same (s,) for the key rows.
        scale: the factor of the scores (1/sqrt(key_dim)).
        causal: whether query i sees key j only if its position is >= j's.
        mask: None or a bool (batch, q, s) tensor: False where masked,
            combined with the others. A general mask, held whole: q × s
            per sample (quadratic in s when q = s/cp); padding is better
            given factored, as `key_valid` / `query_valid`.
        key_valid: None or a bool (batch, s) tensor: False at padded keys,
            which no query sees.
        query_valid: None or a bool (batch, q) tensor: False at padded
            queries, which see no key (output 0, as Keras gives them).
        window: None or w: with `causal`, query i sees key j only if
            p_i - p_j < w as well (a sliding window by position).
        block_size: keys per block (None: one block).
        soft_cap: None, or c: scores c·tanh(scale·q·k / c) before the mask
            (Gemma's logit soft-capping); the backward pass multiplies
            dS by its derivative 1 - tanh².
        tile_size: at most this many keys per score tile (None:
            `TILE_KEYS`, read at the call). The visible blocks are
            computed in tiles, one after another (module docstring: peak
            memory), so a device holds one (q × tile_size) score tile
            per head at a time.

    Returns (batch, q, heads, value_dim) in the query's dtype; computed in
    float32.
    """
    dtype = query.dtype
    query, key, value = (tf.cast(t, tf.float32) for t in (query, key, value))
    key_positions = np.asarray(key_positions)
    masks = BlockMasks(causal, window, mask, key_valid, query_valid)
    blocks = _computed_tiles(query_positions, key_positions, block_size,
                             causal, window, tile_size)

    tiles = KeyTiles(blocks, query_positions, key_positions, masks)

    @tf.custom_gradient
    def attend(q, k, v):
        out, stats = _forward(q, k, v, scale, tiles, soft_cap)

        def grad(d_out):
            return _backward(q, k, v, out, stats, d_out, scale, tiles,
                             soft_cap)

        return out, grad

    return tf.cast(attend(query, key, value), dtype)


def _computed_tiles(query_positions, key_positions, block_size, causal,
                    window, tile_size):
    """`key_tiles` of the `visible_blocks` (`window` checked by
    `BlockMasks`)."""
    return key_tiles(visible_blocks(np.asarray(query_positions),
                                    key_positions, block_size, causal,
                                    window),
                     TILE_KEYS if tile_size is None else tile_size)


class KeyTiles:
    """The key tiles one attention computes (`ranges`, (start, stop) each),
    read one after another: unrolled (a copy of a tile's ops per tile in
    the traced step), or as a `tf.while_loop` (one copy, the tile read by
    the loop's index) when there are more than `LOOP_TILES_ABOVE` of
    them, all of one width dividing the key length and starting at
    multiples of it (`looped`). The forward and backward passes go
    through `repeat`, `read` and `adder`; the backward pass collects dK
    and dV with `no_gradient`, `store` and `assemble`.

    >>> KeyTiles([(0, 2), (4, 6)], np.arange(8), np.arange(8),
    ...          BlockMasks(causal=True)).count
    2
    """

    def __init__(self, ranges, query_positions, key_positions, masks):
        self.ranges, self.count = ranges, len(ranges)
        self.query_positions = query_positions
        self.key_positions, self.masks = key_positions, masks
        self.width = _loop_width(ranges, len(key_positions))
        self.looped = (LOOP_TILES_ABOVE is not None and self.width
                       is not None and self.count > max(LOOP_TILES_ABOVE, 1))
        if self.looped:
            self.ids = tf.constant([start // self.width
                                    for start, _ in ranges], tf.int32)

    def repeat(self, step, state):
        """`state` after `state = step(j, state)` for j = 1..count-1."""
        if not self.looped:
            for j in range(1, self.count):
                state = step(j, state)
            return state
        # One iteration at a time (the data dependencies chain them too).
        _, state = tf.while_loop(
            lambda j, _: j < self.count,
            lambda j, state: (j + 1, step(j, state)),
            (tf.constant(1), state), parallel_iterations=1)
        return state

    def read(self, tensor, j):
        """Tile j's rows of a (batch, s, ...) tensor."""
        if not self.looped:
            start, stop = self.ranges[j]
            return tensor[:, start:stop]
        return tf.gather(self._tiled(tensor), tf.gather(self.ids, j),
                         axis=1)

    def adder(self, anchor, j):
        """A_j (`_additive_mask`), or None when nothing is masked."""
        if self.masks.empty:
            return None
        if not self.looped:
            start, stop = self.ranges[j]
            return _additive_mask(anchor, self.query_positions,
                                  self.key_positions[start:stop],
                                  self.masks.block(start, stop))
        index = tf.gather(self.ids, j)
        positions = tf.constant(np.asarray(self.key_positions, np.int32)
                                .reshape(-1, self.width))
        return _additive_mask(anchor, self.query_positions,
                              tf.gather(positions, index),
                              self.masks.tile(index, self.width))

    def no_gradient(self, tensor):
        """The gradient of `tensor` before any tile's is stored."""
        if not self.looped:
            return {}
        return tf.zeros_like(self._tiled(tensor))

    def store(self, gradient, j, tile_gradient):
        """`gradient` with tile j's rows set to `tile_gradient` (a select,
        not a sum: exact, and a NaN stays in its tile)."""
        if not self.looped:
            return {**gradient, j: tile_gradient}
        at_tile = tf.equal(tf.range(len(self.key_positions) // self.width),
                           tf.gather(self.ids, j))
        # (expand_dims, not [:, None]: DTensor 2.21 fails on a new-axis
        # slice of a batch-split tensor, tests/dtensor_newaxis_slice_repro.py)
        return tf.where(tf.reshape(at_tile, (1, -1, 1, 1, 1)),
                        tf.expand_dims(tile_gradient, 1), gradient)

    def assemble(self, gradient, tensor):
        """The (batch, s, ...) gradient of `tensor`: 0 at skipped keys."""
        if self.looped:
            return tf.reshape(gradient, _shape(tensor))
        parts, covered = [], 0
        for j, (start, stop) in enumerate(self.ranges):
            if start > covered:  # skipped keys: no gradient
                parts.append(tf.zeros_like(tensor[:, covered:start]))
            parts.append(gradient[j])
            covered = stop
        if covered < tensor.shape[1]:
            parts.append(tf.zeros_like(tensor[:, covered:]))
        return tf.concat(parts, axis=1)

    def _tiled(self, tensor):
        """(batch, s, ...) as (batch, s / width, width, ...)."""
        shape = _shape(tensor)
        return tf.reshape(tensor, shape[:1] + [-1, self.width] + shape[2:])


def _shape(tensor):
    """`tensor`'s shape, a list: its static dimensions, the unknown ones
    read at run time."""
    dynamic = tf.shape(tensor)
    return [dynamic[i] if size is None else size
            for i, size in enumerate(tf.TensorShape(tensor.shape).as_list())]


def _loop_width(ranges, length):
    """The tiles' one width if it divides `length` and every tile starts
    at a multiple of it (a `tf.while_loop` reads tile i of the keys
    reshaped to (s / width, width)); else None."""
    width = ranges[0][1] - ranges[0][0]
    if length % width or any(stop - start != width or start % width
                             for start, stop in ranges):
        return None
    return width


def _check_window(window, causal, owner):
    """Raises a ValueError naming `owner` (the mask's class) unless
    `window` is None or a positive number of keys on a causal mask."""
    if window is not None and (not causal or not isinstance(
            window, (int, np.integer)) or window < 1):
        raise ValueError(
            f"blockwise_attention's mask ({owner}): window={window!r} with "
            f"causal={bool(causal)}; a sliding window is a positive number "
            "of keys on a causal mask. Pass causal=True and window >= 1, or "
            "window=None.")


def _kept(probs, adder):
    """exp(S_j - m) with the masked entries 0 (not exp(-1e9 - m) = 1 when
    a row's every key is masked): such a row gets l = 0 and output 0, as
    Keras' `Softmax` gives it (it zeroes masked positions)."""
    if adder is None:
        return probs
    return probs * tf.cast(adder > MASKED / 2, probs.dtype)


def _nonzero(row_sum):
    """l, with 1 where a row has no visible key (its O and P are 0)."""
    return tf.where(row_sum > 0, row_sum, tf.ones_like(row_sum))


def _forward(q, k, v, scale, tiles, soft_cap=None):
    """(O, L) of the module docstring's recursion over the tiles, each
    tile's scores computed only once the previous tile is folded into
    the running max, sum and output (`_waiting_on`)."""
    state = _fold_tile(None, q, k, v, 0, tiles, scale, soft_cap)

    def step(j, state):
        running_max, running_sum, acc = state
        anchor = q + _waiting_on(acc[..., 0] + running_sum)
        return _fold_tile(state, anchor, k, v, j, tiles, scale, soft_cap)

    running_max, running_sum, acc = tiles.repeat(step, state)
    out = acc / tf.expand_dims(_nonzero(running_sum), -1)
    return tf.transpose(out, (0, 2, 1, 3)), (running_max, running_sum)


def _fold_tile(state, anchor, k, v, j, tiles, scale, soft_cap):
    """(m_j, l_j, O_j) from (m_{j-1}, l_{j-1}, O_{j-1}) (`state`; None
    before the first tile) and tile j's scores of `anchor` (Q)."""
    tile_adder = tiles.adder(anchor, j)
    scores = _scores(anchor, tiles.read(k, j), scale, tile_adder, soft_cap)
    block_max = tf.reduce_max(scores, axis=-1)
    if state is None:
        new_max = block_max
    else:
        new_max = tf.maximum(state[0], block_max)
    probs = _kept(tf.exp(scores - tf.expand_dims(new_max, -1)), tile_adder)
    block_out = tf.einsum("bnts,bsnh->bnth", probs, tiles.read(v, j))
    if state is None:
        return new_max, tf.reduce_sum(probs, axis=-1), block_out
    running_max, running_sum, acc = state
    correction = tf.exp(running_max - new_max)
    running_sum = running_sum * correction + tf.reduce_sum(probs, axis=-1)
    acc = acc * tf.expand_dims(correction, -1) + block_out
    return new_max, running_sum, acc


def _waiting_on(rows):
    """0 shaped (batch, q, heads, 1), computed from `rows` (batch, heads,
    q): added to Q, it makes every op reading that Q wait for `rows`. TF's
    executor runs an op as soon as its inputs exist, so without such data
    dependencies the blocks of one attention, each reading only Q, K and
    V, could all run at once:

    - forward, `rows` from block j's output and row sum: block j+1's
      (q × block) scores are made once block j's probabilities are folded
      in (and freed), so one block's scores are live at a time, not
      s/cp × s floats per head;
    - backward, `rows` from D (so from dO): the recomputation of every S_j
      and P_j waits for the gradient, or it would run in the forward pass
      and keep every P_j until the backward pass reads it (TF's
      `recompute_grad` adds such a dependency for the same reason); then
      from dQ after block j, chaining the blocks as in the forward pass.

    A NaN in `rows` stays NaN (the result would be NaN anyway)."""
    zero = data_dependency.zeros_like_waiting_on(rows)
    return tf.expand_dims(tf.transpose(zero, (0, 2, 1)), -1)


def _zero_per_head(block_gradient):
    """0 shaped (batch, 1, heads, 1) computed from a key block's gradient
    (batch, block, heads, dim): added to the next key (value) block, it
    makes that block's ops wait for this one's dK_j (dV_j). A NaN in dK_j
    spreads to the rest of that head's dQ, dK and dV (the kernel
    gradients summing them would be NaN anyway)."""
    rows = tf.reduce_sum(block_gradient[..., :1], axis=1, keepdims=True)
    return data_dependency.zeros_like_waiting_on(rows)


def _backward(q, k, v, out, stats, d_out, scale, tiles, soft_cap=None):
    """(dQ, dK, dV) of the module docstring, tile by tile: tile j waits
    for dQ after tile j-1 (through Q) and for dK_{j-1} and dV_{j-1}
    (through its keys and values)."""
    d_out = tf.cast(d_out, tf.float32)
    row_dot = tf.einsum("btnh,btnh->bnt", d_out, out)
    q = q + _waiting_on(row_dot)
    terms = (d_out, row_dot) + tuple(stats)
    d_query, d_key, d_value = _tile_gradients(
        q, q, (k, v), 0, tiles, terms, scale, soft_cap)
    state = (tf.zeros_like(q) + d_query,
             tiles.store(tiles.no_gradient(k), 0, d_key),
             tiles.store(tiles.no_gradient(v), 0, d_value), d_key, d_value)

    def step(j, state):
        d_query, d_keys, d_values, last_key, last_value = state
        # The tile waits for dQ, dK_{j-1} and dV_{j-1}: P and dS freed.
        anchor = q + _waiting_on(tf.transpose(d_query[..., 0], (0, 2, 1)))
        waits = (_zero_per_head(last_key), _zero_per_head(last_value))
        d_q, d_key, d_value = _tile_gradients(
            q, anchor, (k, v), j, tiles, terms, scale, soft_cap, waits)
        return (d_query + d_q, tiles.store(d_keys, j, d_key),
                tiles.store(d_values, j, d_value), d_key, d_value)

    d_query, d_keys, d_values, _, _ = tiles.repeat(step, state)
    return d_query, tiles.assemble(d_keys, k), tiles.assemble(d_values, v)


def _tile_gradients(q, anchor, keys_values, j, tiles, terms, scale,
                    soft_cap, waits=(0.0, 0.0)):
    """(dQ's part, dK_j, dV_j) of tile j: P_j is exp(S_j - m) / l rather
    than exp(S_j - L): a row every key of which is masked has S ≈ -1e9,
    where float32's spacing is 64, and only S - m (both rounded alike)
    keeps the forward pass's values. `terms`: (dO, D, m, l); `waits`:
    zeros added to the key and value tile (`_zero_per_head`)."""
    d_out, row_dot, row_max, row_sum = terms
    key_block, value_block = (tiles.read(t, j) + wait
                              for t, wait in zip(keys_values, waits))
    scores = _scores(anchor, key_block, scale, None, soft_cap)
    tile_adder = tiles.adder(anchor, j)
    masked = scores if tile_adder is None else scores + tile_adder
    probs = _kept(tf.exp(masked - tf.expand_dims(row_max, -1)),
                  tile_adder) / tf.expand_dims(_nonzero(row_sum), -1)
    d_value = tf.einsum("bnts,btnh->bsnh", probs, d_out)
    d_probs = tf.einsum("btnh,bsnh->bnts", d_out, value_block)
    d_scores = probs * (d_probs - tf.expand_dims(row_dot, -1))
    if soft_cap is not None:  # d(c·tanh(x/c))/dx = 1 - tanh²
        d_scores *= 1.0 - tf.square(scores / soft_cap)
    d_query = tf.einsum("bnts,bsnh->btnh", d_scores, key_block) * scale
    d_key = tf.einsum("bnts,btnh->bsnh", d_scores, q) * scale
    return d_query, d_key, d_value
