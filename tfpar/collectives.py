"""Named collectives: every relayout tfpar makes with its gradient.

Each function here is one forward/backward pair (Megatron's
`tensor_parallel/mappings.py` is the model), written as a DTensor relayout
with a custom gradient: DTensor inserts the collective a relayout needs.
A relayout only moves data, so values are unchanged.

| function                  | forward                 | backward              |
|---------------------------|-------------------------|-----------------------|
| `gather_from_fsdp_shards` | all-gather (data axis)  | reduce-scatter        |
| `reshard_after_forward`   | frees the forward gather: the backward reads gathers of its own |
| `gather_hidden`           | all-gather (hidden)     | slice (DTensor's)     |
| `gather_sequence`         | all-gather (sequence)   | reduce-scatter        |
| `scatter_sequence`        | reduce-scatter / slice  | all-gather            |
| `whole_along`             | all-gather (one dim)    | pinned the same way, then DTensor's slice |
| `all_to_all`              | a split moved from one dimension to another (gather + slice) | the reverse move |
| `split_along`             | slice (one dim split over an axis) | all-gather back to whole |
| `move_to_mesh` (pipeline) | copy to another stage's mesh; its backward is an explicit move back |

The styles (`tfpar.styles`) install the activation ones on layers; the
strategy's fsdp variables read their weights through the first two.

Self-attention feeds one tensor to the query, key and value projections;
each asks for the same sequence gather. `gather_sequence` makes it once per
traced graph (a relayout is a pure function of its input: reusing it is
exact), so the backward pass sums the three partial gradients before one
collective.
"""

import weakref

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import _compat
from tfpar import data_dependency
from tfpar import placement
from tfpar import step_context


# -- fsdp: weights stored split over the data axis -----------------------------


def gather_from_fsdp_shards(stored, spec, mesh, reshard=False):
    """`stored` (a weight's blocks) all-gathered over the data axis into
    `spec`. The gradient is the reverse relayout (a reduce-scatter), except
    that a sparse gradient (IndexedSlices: rows looked up with tf.gather, as
    in Keras' Embedding) stays sparse, as on one device: Keras' Adam treats
    sparse gradients differently (it squares each looked-up row before
    summing repeated rows).

    With `reshard` (`ParallelStrategy(reshard_after_forward=True)`), once
    the gather's gradient is built (so every op that reads the gathered
    weight exists): see `reshard_after_forward`.
    """
    gathered = []  # the custom gradient's output, which the consumers read

    @tf.custom_gradient
    def gather(value):
        def grad(upstream):
            if reshard:
                reshard_after_forward(gathered[0], value, spec, mesh, upstream)
            if isinstance(upstream, tf.IndexedSlices):
                return upstream
            return dtensor.relayout_like(upstream, value)

        return placement.relayout(value, spec, mesh), grad

    gathered.append(gather(stored))
    return gathered[0]


def reshard_after_forward(forward, stored, spec, mesh, gradient):
    """Orders the gather of `stored` that made `forward` after its forward
    reader's other input, and points the gradient ops reading `forward`
    (or a view of it) at new gathers, one per other input they read.
    `gradient` is the gradient arriving at the gather.

    The gather then waits for the other input of the forward op that reads
    it (e.g. x of x @ W), instead of running at the start of the step with
    every other gather, and every gradient op that reads it (e.g.
    dx = dy @ W^T) reads a gather of its own, made once its other input
    (dy) exists. The forward gather is freed after its forward use and only
    the stored blocks are kept between the passes.

    Waiting for a tensor t is adding 0 computed from it to `stored`: a sum
    of t, all-reduced (a scalar per gather), then 0 (NaN if t holds NaN,
    as the matmul would give). The compiler cannot fold it nor merge the
    new gathers with the forward one; DTensor keeps data dependencies (not
    control ones), hence a 0. A gradient op with no other input (e.g. a
    transpose of W in an einsum's gradient) waits for `gradient` instead,
    unless that is computed from it.
    """
    def after(tensor):
        zero = data_dependency.scalar_zero_waiting_on(tensor)
        return stored + tf.cast(zero, stored.dtype)

    views, readers = _views_and_readers(forward)
    _wait_for_forward_input(forward, readers, after)
    if isinstance(gradient, tf.IndexedSlices):
        gradient = gradient.values
    regathered = {}  # (id(upstream), id(view)) -> the view of its gather
    for tensor, rebuild in views:
        for op, index in _compat.backward_uses(tensor):
            upstream = _other_input(op, tensor)
            if upstream is None and not _compat.depends_on(gradient, op):
                upstream = gradient
            if upstream is None:
                continue  # nothing to wait for: keep the forward gather
            key = (id(upstream), id(tensor))
            if key not in regathered:
                regathered[key] = rebuild(placement.relayout(
                    after(upstream), spec, mesh))
            _compat.rewire_input(op, index, regathered[key])


def _other_input(op, tensor):
    """The first float input of `op` other than `tensor`, or None."""
    return next((t for t in op.inputs if t is not tensor
                 and t.dtype.is_floating), None)


def _views_and_readers(forward):
    """([(view, how to make it from a new gather)], [(reader op, the view
    it reads)]) of the gathered weight `forward` in the forward pass (e.g.
    LayerNormalization's reshaped gamma, a mixed-precision cast)."""
    views = [(forward, lambda t: t)]
    readers = []
    for op in _compat.forward_readers(forward):
        rebuild = _view(op)
        if rebuild is None:
            readers.append((op, forward))
        else:
            views.append((op.outputs[0], rebuild))
            readers += [(r, op.outputs[0])
                        for r in _compat.forward_readers(op.outputs[0])]
    return views, readers


def _wait_for_forward_input(forward, readers, after):
    """Makes the gather of `forward` wait for its readers' other input when
    they all read one (and waiting makes no cycle)."""
    forward_inputs = {id(t): t for op, tensor in readers
                      if (t := _other_input(op, tensor)) is not None}
    relayout = _compat.relayout_op(forward)
    if len(forward_inputs) == 1:  # one reader (or several of one input)
        (before,) = forward_inputs.values()
        if not _compat.depends_on(before, relayout):  # else: a cycle
            _compat.rewire_input(relayout, 0, after(before))


def _view(op):
    """For an op that only re-views its one float input (Reshape, Cast,
    Identity): a function making the same view of another tensor."""
    if op.type == "Reshape":
        return lambda t: tf.reshape(t, op.inputs[1])
    if op.type == "Cast":
        return lambda t: tf.cast(t, op.outputs[0].dtype)
    if op.type == "Identity":
        return tf.identity
    return None


# -- tensor parallelism: activations -------------------------------------------


def step_mesh(tensor):
    """The DTensor mesh `tensor` lives on inside a tfpar step, or None when
    it is not on a mesh (e.g. Keras' symbolic build, a single device)."""
    if tf.executing_eagerly():
        return dtensor.fetch_layout(tensor).mesh if dtensor.is_dtensor(tensor) else None
    # The whole mesh, or the pipeline stage being traced (None between a
    # pipeline's parts: no tfpar relayout there); None outside a step.
    mesh = step_context.step_mesh()
    return None if mesh is None else mesh.dtensor_mesh


def gather_hidden(outputs):
    """`outputs` (batch, ..., hidden) made whole along every dimension but
    the batch, which keeps its layout (split over data or not).

    Forward: an all-gather over the model axis of a hidden-wise split
    Embedding's lookup (which itself needs no communication), as in
    Megatron. Backward: DTensor's relayout gradient (each device keeps its
    hidden block: a slice). Left to itself, DTensor 2.21 propagates the
    hidden split into the following LayerNormalization and then fails to
    expand the backward pass (EmitAllScatter).
    """
    mesh = step_mesh(outputs)
    if mesh is None:
        return outputs
    specs = [dtensor.MATCH] + [dtensor.UNSHARDED] * (outputs.shape.rank - 1)
    return dtensor.relayout(outputs, dtensor.Layout(specs, mesh))


def ids_split_over_data(ids):
    """An Embedding's `ids` (batch, ...) split over the data axis along the
    batch, the rest whole: a local slice of ids computed whole (no
    communication), nothing for ids already split so (the model's inputs).

    Ids the step computes, such as positions (`zeros_like(tokens) +
    arange(seq)`), DTensor 2.21 may lay out whole on every device when the
    table is split along the hidden dimension; the lookup is then whole
    over the data axis too, and its gradient, dL/dy of shape (batch, seq,
    hidden/t), is all-gathered over the data axis (B·S·H/t values) instead
    of each device summing its own rows into the table's gradient and
    all-reducing that (V·H/t values; V rows of the table). Left alone: ids
    of rank 1 or whose first dimension is unknown or does not divide over
    the data axis (they may not be a batch).
    """
    mesh = step_mesh(ids)
    if mesh is None or ids.shape.rank is None or ids.shape.rank < 2:
        return ids
    dims = tf.distribute.get_strategy().extended.dims
    data_axis = dims.batch_split(ids.shape[0])
    if data_axis is None or data_axis not in mesh.dim_names:
        return ids
    specs = [data_axis] + [dtensor.UNSHARDED] * (ids.shape.rank - 1)
    return dtensor.relayout(ids, dtensor.Layout(specs, mesh))


def whole_along(tensor, axis):
    """`tensor` whole along dimension `axis` (non-negative) on every device
    of its mesh; one other dimension (the first: a batch split over the
    data axis) as DTensor lays it out, and, from rank 3, the rest whole
    too — DTensor 2.21 takes one MATCH per layout ("Attempted to shard two
    or more tensor dimensions over mesh dimension match"), so a rank-3
    concat in a step (ViT's class token) failed to trace. Whole is always
    right; a consumer splitting a dimension slices its block.

    Forward: a relayout, an all-gather along `axis` where DTensor would
    split it (nothing where it is whole). Backward: the gradient pinned the
    same way, then DTensor relayouts it to the input's layout (a slice).
    The gradient is pinned explicitly, not by DTensor's own relayout
    gradient (`RelayoutLike`): with that, DTensor 2.21 put the slices of a
    concat's gradient inside a pipeline stage on another mesh ("'tf.Slice'
    op CopyToMeshOp must be used to send data across mesh"). A sparse
    gradient (IndexedSlices) passes unchanged. Outside a step (no mesh):
    `tensor` itself.
    """
    mesh = step_mesh(tensor)
    if mesh is None:
        return tensor
    specs = [dtensor.UNSHARDED] * tensor.shape.rank
    kept = 1 if axis == 0 else 0  # as laid out (the only MATCH allowed)
    if kept < len(specs):
        specs[kept] = dtensor.MATCH
    layout = dtensor.Layout(specs, mesh)

    @tf.custom_gradient
    def pin(x):
        def grad(dy):
            if isinstance(dy, tf.IndexedSlices):
                return dy
            return dtensor.relayout(dy, layout)
        return dtensor.relayout(x, layout), grad

    return pin(tensor)


def gather_sequence(tensor, axis, layer, where):
    """`tensor` (batch, sequence, ...) whole along the sequence (Megatron-SP's
    g before a column-parallel layer).

    Forward: all-gather of the sequence blocks over `axis`. Backward: the
    gradient is a sum of partial gradients (query, key and value of
    self-attention, each partial over the heads), made whole once (one
    all-reduce of the sum), then each device keeps its sequence block: a
    reduce-scatter. `layer` and `where` ("input"/"output") name it in
    errors.
    """
    return _sequence_relayout(tensor, axis, layer, where, split=False)


def scatter_sequence(tensor, axis, layer, where):
    """`tensor` (batch, sequence, ...) split along the sequence over `axis`
    (Megatron-SP's g-bar after a row-parallel layer, and the input and
    output of a norm).

    Forward: after a row-parallel layer (a partial sum on every device)
    a reduce-scatter, Y_i = (sum_j Y^(j))[sequence block i]; from a whole
    tensor a slice; from a hidden-wise split one (an Embedding's lookup) a
    gather and a slice (DTensor's all-to-all is off: tfpar/__init__.py). Backward: the gradient is pinned to the sequence split, so
    it stays in the sequence-parallel region (no gather in the backward
    pass of a norm); DTensor relayouts it to the input's layout (an
    all-gather where that is whole).
    """
    return _sequence_relayout(tensor, axis, layer, where, split=True)


def _sequence_relayout(tensor, axis, layer, where, split):
    """`tensor` split along the sequence over `axis` (`split`) or whole
    along it; the batch keeps its layout (split over the data axis or not),
    every other dimension is whole. The gradient is pinned to the
    sequence-split layout. Made once per traced graph for one input."""
    mesh = step_mesh(tensor)
    if mesh is None or axis not in mesh.dim_names or mesh.dim_size(axis) == 1:
        return tensor
    _check_sequence_shape(tensor, axis, mesh.dim_size(axis), layer, where)
    whole = [dtensor.MATCH] + [dtensor.UNSHARDED] * (tensor.shape.rank - 1)
    split_specs = list(whole)
    split_specs[1] = axis
    target = dtensor.Layout(split_specs if split else whole, mesh)
    sequence = dtensor.Layout(split_specs, mesh)
    made = _relayouts_of_this_graph()
    key = (tensor.ref(), target.to_string())
    if key in made:
        return made[key]

    @tf.custom_gradient
    def relayout(x):
        def grad(dy):
            if not split:  # the sum of the partial gradients, made whole
                dy = dtensor.relayout(dy, dtensor.Layout(whole, mesh))
            return dtensor.relayout(dy, sequence)
        return dtensor.relayout(x, target), grad

    result = relayout(tensor)
    made[key] = result
    return result


# The sequence relayouts made in each graph being traced:
# {graph: {(input tensor ref, target layout): output}}. An entry lives as
# long as its graph; eagerly (no graph being traced) nothing is reused.
_RELAYOUTS_BY_GRAPH = weakref.WeakKeyDictionary()


def _relayouts_of_this_graph():
    if tf.executing_eagerly():
        return {}
    graph = tf.compat.v1.get_default_graph()
    return _RELAYOUTS_BY_GRAPH.setdefault(graph, {})


def _check_sequence_shape(tensor, axis, size, layer, where):
    """Refuses activations with no sequence, or one `size` does not divide."""
    path = getattr(layer, "path", None) or getattr(layer, "name", layer)
    rank = tensor.shape.rank
    if rank is None or rank < 3:
        raise ValueError(
            f"Sequence parallelism needs (batch, sequence, features) "
            f"activations, but the {where} of layer {path!r} has shape "
            f"{tensor.shape}. Received: rank={rank}. Turn sequence_parallel "
            "off for this layer (plain ColumnParallel/RowParallel, or no "
            "SequenceParallel rule)."
        )
    length = tensor.shape[1]
    if length is not None and length % size:
        raise ValueError(
            f"Sequence parallelism splits the sequence (dimension 1) of the "
            f"{where} of layer {path!r} over mesh axis {axis!r} of size "
            f"{size}, which does not divide it. Received: shape="
            f"{tensor.shape}. Use a sequence length that is a multiple of "
            f"{size}, or sequence_parallel=False."
        )


# -- expert and context parallelism: moving a split between dimensions -------


def _pinned_relayout(tensor, source, target):
    """`tensor` relaid out from `source` to `target` (DTensor layouts); its
    gradient moved back from `target` to `source` the same way. A
    relayout that moves a split between two dimensions goes through the
    layout where neither is split (`source` and `target` each split one
    of them): an all-gather, then a local slice."""
    mesh = source.mesh
    whole = dtensor.Layout(
        [a if a == b else dtensor.UNSHARDED
         for a, b in zip(source.sharding_specs, target.sharding_specs)],
        mesh)

    def move(value, to):
        return dtensor.relayout(dtensor.relayout(value, whole), to)

    @tf.custom_gradient
    def relayout(x):
        def grad(dy):
            if isinstance(dy, tf.IndexedSlices):
                dy = tf.convert_to_tensor(dy)
            return move(dy, source)
        return move(x, target), grad

    return relayout(tensor)


def _move_specs(rank, mesh_axis, split_dim, mesh, others):
    """A layout of rank `rank` with dimension `split_dim` (or none: None)
    split over `mesh_axis` and the dimensions in `others` (the batch:
    dimension 0 unless moved) split as `others` maps them."""
    specs = [dtensor.UNSHARDED] * rank
    for dim, axis in others.items():
        specs[dim] = axis
    if split_dim is not None:
        specs[split_dim] = mesh_axis
    return dtensor.Layout(specs, mesh)


def _step_axis(tensor, mesh_axis):
    """The DTensor mesh of `tensor` in a step when `mesh_axis` is one of
    its axes with more than one device, else None (nothing to move)."""
    mesh = step_mesh(tensor)
    if mesh is None or mesh_axis not in mesh.dim_names:
        return None
    return mesh if mesh.dim_size(mesh_axis) > 1 else None


def _check_dims(tensor, mesh, mesh_axis, dims, what):
    rank = tensor.shape.rank
    size = mesh.dim_size(mesh_axis)
    for name, dim in dims.items():
        if dim is None:
            continue
        if not 0 <= dim < rank:
            raise ValueError(
                f"{what}: {name}={dim} is not a dimension of a tensor of "
                f"rank {rank} (shape {tensor.shape}). Give one in "
                f"[0, {rank}).")
        if tensor.shape[dim] is not None and tensor.shape[dim] % size:
            raise ValueError(
                f"{what}: dimension {name}={dim} of shape {tensor.shape} "
                f"does not divide over mesh axis {mesh_axis!r} of size "
                f"{size}. Use a size that is a multiple of {size}.")


def all_to_all(tensor, split_dim, concat_dim, mesh_axis, batch_axis=None):
    """`tensor`, split over `mesh_axis` along `concat_dim`, returned split
    over it along `split_dim` instead (the names of `tf.raw_ops.AllToAll`:
    each device cuts its block along `split_dim` into one piece per device
    and concatenates what it receives along `concat_dim`). Values are
    unchanged; dimension 0, when it is neither of the two, stays split over
    `batch_axis` (e.g. "data"; None: whole); every other dimension is
    whole. Outside a step, or when `mesh_axis` is not an axis of the step's
    mesh with more than one device: `tensor` itself.

    How: a relayout through the layout where neither dimension is split
    (an all-gather over `mesh_axis`, then a local slice); the gradient is
    the reverse move, built the same way. Measured (tests/test_all_to_all.py):
    one collective over `mesh_axis` per move, whose message is the block
    with `concat_dim` whole — n times the per-device block a true
    all-to-all sends (n: the axis size; on CPU DTensor runs the gather as
    an all-reduce of zero-padded blocks, ring bytes 2(n-1)/n of that
    message).

    Why not a true all-to-all (measured on TF 2.21,
    tests/dtensor_all_to_all_ranks_repro.py): DTensor's only one is its
    relayout with DTENSOR_USE_ALL_TO_ALL_RELAYOUT on, a switch TF reads
    once per process (at the first relayout it expands), so it cannot be
    on for one move only; tfpar keeps it off (tfpar/__init__.py) because
    with it on DTensor's own moves between dimensions 1-3 of rank-4 (and
    most of rank-5) tensors are wrong. A user graph cannot hold a
    collective DTensor did not place (CollectiveAllToAllV2: "does not
    implement layout propagation"). With the switch on, this move made on
    a rank-3 view (transpose to (0, concat_dim, split_dim, rest), merge
    split_dim with the rest) would be right for every rank and pair and n
    times fewer bytes; with it off, a relayout between two splits is
    DTensor's same gather-and-slice, so the explicit intermediate changes
    no byte and stays right either way.

    Example (inside a step on Mesh({"data": 2, "context": 4})): Ulysses'
    move from sequence-split to head-split of (batch, seq, heads, dim):

    >>> moved = collectives.all_to_all(q, split_dim=2, concat_dim=1,
    ...                                mesh_axis="context",
    ...                                batch_axis="data")

    Args:
        tensor: a tensor of rank >= 2.
        split_dim: the dimension split over `mesh_axis` afterwards.
        concat_dim: the dimension split over it before (whole afterwards).
        mesh_axis: the mesh axis whose split moves.
        batch_axis: the mesh axis dimension 0 stays split over, or None.
    """
    mesh = _step_axis(tensor, mesh_axis)
    if mesh is None:
        return tensor
    what = f"all_to_all over {mesh_axis!r}"
    _check_dims(tensor, mesh, mesh_axis,
                {"split_dim": split_dim, "concat_dim": concat_dim}, what)
    if split_dim == concat_dim:
        raise ValueError(f"{what}: split_dim and concat_dim are both "
                         f"{split_dim}. Give two different dimensions.")
    others = _batch_split(mesh, batch_axis, (split_dim, concat_dim))
    rank = tensor.shape.rank
    return _pinned_relayout(
        tensor, _move_specs(rank, mesh_axis, concat_dim, mesh, others),
        _move_specs(rank, mesh_axis, split_dim, mesh, others))


def split_along(tensor, dim, mesh_axis, batch_axis=None):
    """`tensor`, whole along `dim`, returned split over `mesh_axis` along
    it: each device keeps its block (a local slice, no communication).
    Dimension 0, when it is not `dim`, stays split over `batch_axis`
    (None: whole); the rest is whole. Backward: the gradient's blocks are
    all-gathered back to whole (one collective over `mesh_axis`). Outside
    a step, or when `mesh_axis` is not an axis of the step's mesh with
    more than one device: `tensor` itself.

    Example: the combine weights of a mixture of experts, (groups,
    tokens, experts, capacity), cut to each device's experts:

    >>> local = collectives.split_along(combine, 2, "expert", "data")
    """
    mesh = _step_axis(tensor, mesh_axis)
    if mesh is None:
        return tensor
    _check_dims(tensor, mesh, mesh_axis, {"dim": dim},
                f"split_along over {mesh_axis!r}")
    others = _batch_split(mesh, batch_axis, (dim,))
    rank = tensor.shape.rank
    return _pinned_relayout(
        tensor, _move_specs(rank, mesh_axis, None, mesh, others),
        _move_specs(rank, mesh_axis, dim, mesh, others))


def _batch_split(mesh, batch_axis, moved):
    """{0: batch_axis} when dimension 0 is not moved and `batch_axis` is
    an axis of `mesh` with more than one device, else {}."""
    if (0 in moved or batch_axis is None or batch_axis not in mesh.dim_names
            or mesh.dim_size(batch_axis) == 1):
        return {}
    return {0: batch_axis}


# --- stage-to-stage moves (pipeline) ---
# A pipeline step runs each model part on its stage's sub-mesh; a DTensor op
# reads tensors of one mesh only, so what crosses from part k to part k' is
# moved: relaid out to replicated on the source mesh (an all-gather over the
# source's axes), copied to the target mesh whole (`copy_to_mesh`: the
# source's devices send, the target's receive), relaid out there to the
# layout the target reads (a local slice, no communication). Forward moves
# carry activations (and the losses added so far), backward moves their
# gradients. A weight tied across stages (`pipeline.tied.TiedWeights`) moves
# the same way: with persistent copies, each copy's summed gradient to the
# weight's home part and the total back, once per step; per step, the weight
# to the later part in every forward and its gradient back, laid out as the
# weight is. Each move is one name scope ("send_k_to_k'",
# "tied_<what>_k_to_k'"), which tests and profiles read.


def move_to_mesh(tensor, source, target, spec, scope):
    """`tensor` from `tfpar.Mesh` `source` to `target`, laid out there by
    `spec`, in name scope `scope`; unchanged when the meshes are one (two
    parts on one stage)."""
    if source is target:
        return tensor
    rank = tensor.shape.rank
    with tf.name_scope(scope):
        whole = dtensor.relayout(tensor, dtensor.Layout.replicated(
            source.dtensor_mesh, rank))
        moved = dtensor.copy_to_mesh(whole, dtensor.Layout.replicated(
            target.dtensor_mesh, rank))
        return placement.relayout(moved, spec, target)


def batch_spec(rank, split, data_axis):
    """The layout spec of a micro-batch's activation (or its gradient): the
    batch dimension split over `data_axis` when `split`, the rest whole."""
    spec = [None] * rank
    if rank and split:
        spec[0] = data_axis
    return tuple(spec)


def sequence_split(spec, shape, context, min_rank):
    """`spec` with dimension 1 (a sequence) split over the context axis
    of `context` (a `context_parallel.ContextSplit`; None: `spec`) when
    the tensor has at least `min_rank` dimensions and the axis divides
    that length: as the strategy places a step's inputs (every one of
    rank ≥ 2), so that a pipeline part reads the sequences it receives as
    a step on one mesh reads them. (Sent whole along the sequence, an
    activation that attention split over context and another layer read
    too failed to compile: `tests/test_plan_axes.py`.)

    >>> import types
    >>> split = types.SimpleNamespace(axis="context", size=2)
    >>> sequence_split(("data", None, None), (4, 16, 8), split, 3)
    ('data', 'context', None)
    """
    if (context is None or len(shape) < min_rank or shape[1] is None
            or shape[1] % context.size):
        return tuple(spec)
    return tuple(spec[:1]) + (context.axis,) + tuple(spec[2:])


def microbatch_spec(shape, split, mesh, data_axis, context, min_rank=2):
    """The layout of a micro-batch tensor of `shape` on `mesh`: its batch
    split over `data_axis` when `split` (and the mesh has that axis), its
    sequence over the context axis of `context` (None: no context axis)
    when it has at least `min_rank` dimensions (2: an input's [batch,
    tokens]; 3: an activation's [batch, sequence, width] or its gradient),
    as the strategy places a step's inputs (`sequence_split`).
    """
    return sequence_split(batch_spec(
        len(shape), split and mesh.axis_size(data_axis) > 1, data_axis),
        shape, context, min_rank)


def send_activation(tensor, source_part, target_part, meshes, split,
                    data_axis, context=None):
    """An activation (or its gradient) of part `source_part` moved to part
    `target_part` (`meshes[k]`: part k's mesh), batch-split as every
    activation is, its sequence over the context axis (`microbatch_spec`,
    of `context`: the strategy's, or None)."""
    return move_to_mesh(
        tensor, meshes[source_part], meshes[target_part],
        microbatch_spec(tensor.shape, split, meshes[source_part], data_axis,
                        context, min_rank=3),
        f"send_{source_part}_to_{target_part}")


def send_tied(tensor, source_part, target_part, meshes, spec, what):
    """A tied weight's value (`what`="weight"), a part's gradient of it
    ("grad") or the gradient summed over the parts that read it ("sum")
    moved between parts, laid out by the weight's own `spec` on the target
    (name scope "tied_<what>_<source>_to_<target>")."""
    return move_to_mesh(tensor, meshes[source_part], meshes[target_part],
                        spec, f"tied_{what}_{source_part}_to_{target_part}")
