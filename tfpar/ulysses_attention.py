"""The Ulysses exchange of context-parallel attention, and the choice of it.

Context-parallel attention (`context_parallel.attend_across_context`)
starts from queries, keys and values (batch, s, heads, dim) split over the
context axis along the sequence (a device holds s/cp rows of every head).
Two exchanges make attention over the whole sequence possible:

- "gather" (Megatron's and MaxText's all_gather): the keys and values are
  all-gathered over the context axis (grouped-query: the key/value heads
  only); each device attends its own s/cp queries to all s keys.
- "ulysses" (DeepSpeed-Ulysses): q, k and v are moved by an all-to-all from
  sequence-split to head-split, (b, s/cp, h, d) -> (b, s, h/cp, d): each
  device holds the whole sequence of h/cp heads and attends it with no
  further communication; the output is moved back (a fourth all-to-all).
  Grouped-query keys and values are given repeated to the query heads
  (Keras' layers and keras-hub's decoders repeat them before attention), so
  they are moved repeated: only the query heads must divide by cp, at
  kv_groups times the bytes of moving the key/value heads alone.

Attention itself is `blockwise_attention` in both, with the causal and
padding masks by global position: the sequence a device holds after the
Ulysses move is the concatenation of every device's rows, i.e. the stored
(possibly load-balanced) order `ContextSplit.order(s)`, so its query and
key positions are both that order. A padding mask (batch, s, s) is then
needed whole on every device (it is gathered; a constant causal mask is
not communicated).

Ulysses runs on meshes whose only axes of size > 1 are the data and
context axes (a model axis splitting the heads would be gathered by the
moves): elsewhere "auto" gathers and a forced "ulysses" is an error
naming the layer, as are query heads the context axis does not divide.

Bytes each device sends per attention layer in the forward pass (the
backward pass makes the reverse moves), b the device's batch rows, e the
bytes of one value, kv_bytes = b·s·kv_heads·dim·e, block = b·s·heads·dim·e:

    gather  = 2 · kv_bytes · (cp−1)/cp                (k and v)
    ulysses = (4 · block/cp · f + mask_bytes) · (cp−1)/cp   (q, k, v, o)

f is what one all-to-all costs over a true one: 1 for a true all-to-all;
cp on TF 2.21 (`ALL_TO_ALL_IS_GATHER`), where the move is an all-gather and
a slice (`collectives.all_to_all`; DTensor's own all-to-all relayout is
wrong on rank-4/5 tensors and switched on per process only,
tests/dtensor_all_to_all_ranks_repro.py). With a true all-to-all Ulysses
moves fewer bytes when 4·heads/cp < 2·kv_heads, i.e. cp > 2·kv_groups
(multi-head attention: cp > 2); with f = cp it never does. "auto" (the
default) picks the smaller, so on TF 2.21 it picks "gather".

Choose per strategy (or process-wide with None):

>>> import tfpar
>>> tfpar.use_virtual_cpus(8)
>>> strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "context": 4}))
>>> set_attention_exchange(strategy, "ulysses")
'auto'
>>> exchange_of(strategy.extended)
'ulysses'
"""

import weakref

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

MODES = ("gather", "ulysses", "auto")
# TF 2.21: an all-to-all over the context axis is an all-gather and a slice
# (module docstring), whose message is cp times a true all-to-all's.
ALL_TO_ALL_IS_GATHER = True

_BY_STRATEGY = weakref.WeakKeyDictionary()  # strategy.extended -> mode
_PROCESS = {"mode": "auto"}  # the mode of strategies given none


def set_attention_exchange(strategy, mode):
    """Sets the exchange of context-parallel attention: "gather",
    "ulysses" or "auto" (the smaller of the two by `exchange_bytes`), for
    `strategy` (a `ParallelStrategy` with a context axis), or for every
    strategy given none when `strategy` is None. Call before the model's
    first step is traced. Returns the mode it replaces.

    >>> previous = set_attention_exchange(None, "gather")
    >>> set_attention_exchange(None, previous)
    'gather'
    """
    if mode not in MODES:
        raise ValueError(
            f"set_attention_exchange: mode must be one of {MODES}. "
            f"Received: mode={mode!r}.")
    if strategy is None:
        previous, _PROCESS["mode"] = _PROCESS["mode"], mode
        return previous
    extended = strategy.extended
    if getattr(extended.input_placer, "context", None) is None:
        raise ValueError(
            "set_attention_exchange needs a context axis of size > 1 on the "
            f"strategy's mesh. Received: mesh {strategy.mesh!r}. Add one, "
            "e.g. tfpar.Mesh({'data': 2, 'context': 4}), or pass None to "
            "set the mode of every strategy.")
    previous = exchange_of(extended)
    _BY_STRATEGY[extended] = mode
    return previous


def exchange_of(extended):
    """The mode set for the strategy whose `extended` this is (its own,
    else the process-wide one)."""
    if extended is not None and extended in _BY_STRATEGY:
        return _BY_STRATEGY[extended]
    return _PROCESS["mode"]


def exchange_bytes(batch, length, heads, kv_heads, head_dim, cp, itemsize,
                   mask_bytes=0, all_to_all_is_gather=ALL_TO_ALL_IS_GATHER):
    """{"gather": bytes, "ulysses": bytes} each device sends per attention
    layer in the forward pass (module docstring's formulas); `batch` is the
    device's rows, `mask_bytes` the whole (batch, s, s) mask Ulysses needs
    (0 when none or a constant).

    >>> exchange_bytes(8, 32, 4, 4, 8, 4, 4, all_to_all_is_gather=False)
    {'gather': 49152.0, 'ulysses': 24576.0}
    >>> exchange_bytes(8, 32, 4, 4, 8, 4, 4)
    {'gather': 49152.0, 'ulysses': 98304.0}
    """
    share = (cp - 1) / cp
    kv_bytes = batch * length * kv_heads * head_dim * itemsize
    block = batch * length * heads * head_dim * itemsize
    factor = cp if all_to_all_is_gather else 1
    return {"gather": 2 * kv_bytes * share,
            "ulysses": (4 * block / cp * factor + mask_bytes) * share}


def _other_split_axes(mesh, axis, batch_axis):
    """The mesh axes of size > 1 besides the context and batch axes (a
    model axis splitting the heads): Ulysses' moves would gather them."""
    return [a for a in mesh.axis_names
            if mesh.axis_size(a) > 1 and a not in (axis, batch_axis)]


def choose(extended, axis, query, batch_spec, kv_groups=1, mask=None):
    """"gather" or "ulysses" for the attention of `query` (batch, s, heads,
    dim; global shape) on the context axis `axis` of `extended`'s mesh,
    by the strategy's mode (`exchange_of`). `batch_spec` is how the caller
    lays out the batch dimension (the data axis when it divides the batch,
    else `dtensor.UNSHARDED`): a device's rows are counted from it, as
    `attend` is given it. Raises a ValueError naming the layer (its name
    scope) when "ulysses" is forced where it cannot run: heads the axis
    does not divide, or another axis splitting them."""
    mode = exchange_of(extended)
    if mode == "gather":
        return mode
    mesh, cp = extended.mesh, extended.mesh.axis_size(axis)
    batch_axis = extended.dims.data_axis
    batch, length, heads, head_dim = query.shape
    problem = None
    if heads % cp:
        problem = (f"its {heads} query heads do not divide over the "
                   f"context axis {axis!r} of size {cp}")
    elif _other_split_axes(mesh, axis, batch_axis):
        problem = (f"the mesh also splits over "
                   f"{_other_split_axes(mesh, axis, batch_axis)} (heads "
                   "split by tensor parallelism)")
    if problem and mode == "ulysses":
        raise ValueError(
            f"The Ulysses exchange cannot run layer "
            f"{tf.get_current_name_scope()!r}: {problem}. Received: query "
            f"shape {tuple(query.shape)}. Use set_attention_exchange("
            "strategy, 'gather') or 'auto', or a context axis dividing the "
            "heads.")
    if problem:
        return "gather"
    if mode == "ulysses":
        return mode
    rows = _rows_per_device(batch or 1, batch_spec, mesh)
    sizes = exchange_bytes(rows, length, heads, heads // kv_groups, head_dim,
                           cp, query.dtype.size,
                           _mask_bytes(mask, batch, batch_spec, mesh))
    return "ulysses" if sizes["ulysses"] < sizes["gather"] else "gather"


def _rows_per_device(rows, spec, mesh):
    """A device's share of `rows` batch rows laid out by `spec` (a mesh
    axis of `mesh`, a tfpar `Mesh`, or `dtensor.UNSHARDED`: all)."""
    return rows if spec == dtensor.UNSHARDED else rows // mesh.axis_size(
        spec)


def _mask_batch_spec(mask, query_batch, batch_spec):
    """The layout of a (batch or 1, s, s) mask's batch dimension: the
    queries' `batch_spec` when it has their batch, else whole (broadcast)."""
    return batch_spec if mask.shape[0] == query_batch else dtensor.UNSHARDED


def _mask_bytes(mask, query_batch, batch_spec, mesh):
    """The bytes of a device's whole (batch, s, s) `mask`, its batch laid
    out as `attend` lays it out: 0 for none or a constant (made on every
    device, not moved)."""
    if mask is None or tf.get_static_value(mask) is not None:
        return 0
    rows = _rows_per_device(mask.shape[0], _mask_batch_spec(
        mask, query_batch, batch_spec), mesh)
    return rows * int(np.prod(mask.shape[1:])) * mask.dtype.size


def attend(query, key, value, mask, attention, all_to_all, batch_spec,
           mesh):
    """`attention(q, k, v, mask)` of head-split tensors: q, k, v (batch,
    s, heads, dim) moved from sequence-split to head-split (each device:
    the whole sequence of heads/cp heads), the (batch, s, s) `mask` (or
    None) made whole but for the batch, the output moved back to
    sequence-split. `all_to_all(tensor, split_dim, concat_dim)` is the
    move over the context axis (`collectives.all_to_all`, passed down by
    the caller: the one exchange tfpar has, with its gradient);
    `batch_spec`: dimension 0's mesh axis (or `dtensor.UNSHARDED`) and
    `mesh` the DTensor mesh, for the mask."""
    query, key, value = (all_to_all(t, split_dim=2, concat_dim=1)
                         for t in (query, key, value))
    if mask is not None:
        mask = dtensor.relayout(mask, dtensor.Layout(
            [_mask_batch_spec(mask, query.shape[0], batch_spec),
             dtensor.UNSHARDED, dtensor.UNSHARDED], mesh))
    output = attention(query, key, value, mask)
    return all_to_all(output, split_dim=1, concat_dim=2)
