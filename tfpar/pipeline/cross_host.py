"""Pipeline stages on different hosts: the host-driven step.

With several hosts (`tfpar.connect_hosts`) the stages' sub-meshes lie on
different hosts: with the pipe axis along them (e.g. `Mesh({"pipe": 2,
"data": 2, "model": 2})` on 2 hosts × 4 devices) each on one host, or on
whole hosts when there are more hosts than stages; with the data axis
first, on every host. DTensor (TF 2.21) cannot copy a
tensor between two hosts' meshes ("Send and receive hosts don't match",
`tests/dtensor_cross_host_repro.py`), so the one-`tf.function` step of
`tfpar.pipeline.runner` cannot run. `CrossHostRunner` runs the schedule's
actions from Python instead, on every host in the same order:

- F(k, i): part k's forward of micro-batch i, a `tf.function` on its
  stage's mesh. Only the hosts holding that mesh compute it; every other
  host runs it too, as a no-op on stand-ins of the right layout (DTensor
  numbers the collectives of the programs each host compiles in order, so
  every host must compile the same programs in the same order: case (d)
  of `tests/dtensor_cross_host_repro.py`);
- B(k, i): part k's backward, a `tf.function` that recomputes the forward
  under a tape (a tape cannot outlive a `tf.function` call) and takes the
  vector-Jacobian product with the output gradients from part k+1 (the
  last part: its loss, whose metrics it updates); the weight gradients are
  summed over the micro-batches;
- a move from part k to a part on other hosts is `Bridge.move`: each
  sending host puts each of its devices' blocks in the slot of the
  receiving device's local position, in a tensor laid out over every
  device of the cluster, a compiled all-gather over the hosts carries the
  slots across, and each receiving host packs its slots onto its stage's
  mesh (exact; each device sends its block, or zeros, to every other
  host). Moves between two meshes of the same hosts go through each of
  them alone (its blocks, device by device);
- after the last action each part's optimizer applies its summed
  gradients (a `tf.function` each; under `offload="optimizer"` the
  update runs on the stage's hosts' offload devices instead,
  `tfpar.offload.OffloadCrossHostRunner`); logs and predictions are the
  holders' values, sent to every host (`tfpar.placement.fetch`: a
  collective). Under a `LossScaleOptimizer` all parts skip an overflowing
  step together (`tfpar.pipeline.loss_scale`): each part's finite flag
  moves through the bridge to the last part, whose verdict (a factor, 1
  or NaN) comes back to every part before it applies;
- weights tied across stages (a causal LM's embedding read again by its
  output head; frozen weights a later stage reads) are held as on one
  host, a persistent copy on each later stage (`tfpar.pipeline.tied`);
  after the last action each copy's gradient sum moves to the weight's
  home part, is added there, and the sum moves back to every copy
  (`TiedAcrossHosts`: two weight-sized moves per copy and step);
- a Keras mask on a tensor part k sends (`Embedding(mask_zero=True)` and
  the layers after it) moves with it, so attention on part k+1 ignores
  padding as on one host;
- a loss a layer before the last part adds (add_loss, a regularizer) is
  part of its part's objective in B(k, i); its value, returned by F(k, i),
  moves to the last part, whose loss adds it (a scalar move per
  micro-batch and such part);
- every small int32/int64/float32 tensor enters a stage function as its
  bits (`SmallTensorsAsBits`), so that every host compiles each program
  once.

Each backward recomputes its forward, so a step costs one more forward
per stage but the last (whose forward runs inside its backward); the
random seeds F(k, i) drew (Dropout's masks) are returned with its outputs
and replayed by B(k, i) (`step_context.Seeds`), so the recomputation
draws the same numbers: random layers train as on one host. Interleaved
schedules run as they are (a host holds every stage of its own, so parts
alternate between the hosts). Zero-bubble schedules
and `tied_weights="per_step"` are refused (`check_supported`).

Per-host input (`ParallelStrategy(per_host_input=True)`, which needs the
data axis first: each host holds its own range of it, so a whole
pipeline): each host's batch is its share of the global batch, and
micro-batch i of the global batch is every host's i-th micro-batch of
its share, in host order (`HostShares`). The micro-batches' gradients sum
to the whole batch's, as in Keras' gradient accumulation; predictions
come back in the global batch's order (host 0's rows, then host 1's...),
as the strategy's do.

Example (the same script on every host, e.g. under `python -m
tfpar.launch --hosts 2 --virtual-cpus 4`; `fit` picks this runner):

>>> tfpar.connect_hosts()                                 # doctest: +SKIP
>>> strategy = tfpar.ParallelStrategy(tfpar.Mesh(
...     {"pipe": 2, "data": 2, "model": 2}))              # doctest: +SKIP
>>> with strategy.scope():                                # doctest: +SKIP
...     pipe = tfpar.PipelineModel(model, num_microbatches=2)
>>> pipe.fit(x, y, batch_size=16)                         # doctest: +SKIP
"""

import contextlib

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import _compat
from tfpar import collectives
from tfpar import inputs
from tfpar import layout as layout_lib
from tfpar import placement
from tfpar import step_context
from tfpar.mesh import Mesh
from tfpar.mesh import device_index
from tfpar.mesh import local_device_names
from tfpar.pipeline import loss_scale
from tfpar.pipeline.runner import PipelineRunner
from tfpar.pipeline.runner import extra_losses
from tfpar.pipeline.runner import part_objective
from tfpar.pipeline.schedules import FORWARD
from tfpar.pipeline.tied import accumulate


def spans_hosts(extended):
    """Whether pipeline stages live on different hosts."""
    return dtensor.num_clients() > 1 and len(extended.stage_meshes) > 1


def check_supported(model, parts, schedule, extended, tied_weights):
    """Raises (on every host alike, before any step) for what the
    host-driven step does not run: split backwards, weights
    tied across stages sent in every micro-batch (`tied_weights=
    "per_step"`: a move inside a stage's step)."""
    if not spans_hosts(extended):
        return
    problem = None
    if schedule.split_backward:
        problem = (f"schedule={schedule.name!r} (zero-bubble: split "
                   "backwards)", "schedule='gpipe' or '1f1b'")
    elif tied_weights == "per_step" and any(
            part.shared or part.guests for part in parts):
        problem = ("tied_weights='per_step' (weights tied across stages "
                   "sent in every micro-batch)",
                   "tied_weights='persistent' (the default)")
    if problem is not None:
        raise ValueError(
            "Pipeline stages on different hosts run a host-driven step "
            f"that does not support {problem[0]} yet. Received: "
            f"{problem[0]} on {len(extended.stage_meshes)} stages over "
            f"{dtensor.num_clients()} hosts. Use {problem[1]}, or keep "
            "the pipeline on one host.")


class Bridge:
    """Moves DTensors between stage meshes on the same hosts or on others
    (module doc). Every host calls `move` for every move, in the same
    order."""

    total_bytes_sent = 0  # by this host's devices, over all bridges

    def __init__(self):
        self._hosts = dtensor.num_clients()
        self._host = dtensor.client_id()
        self._per_host = dtensor.num_local_devices(
            dtensor.preferred_device_type())
        self._mesh = Mesh({"tfpar_hosts": self._hosts,
                           "tfpar_local": self._per_host}).dtensor_mesh
        self._gathers = {}
        self.bytes_sent = 0  # by this host's devices, since creation

    def _gather(self, rank):
        """All-gather over the hosts of a [hosts, local, ...] tensor."""
        if rank not in self._gathers:
            target = dtensor.Layout(["unsharded", "tfpar_local"] + [
                "unsharded"] * rank, self._mesh)
            self._gathers[rank] = tf.function(
                lambda t: dtensor.relayout(t, target))
        return self._gathers[rank]

    def move(self, value, source, target, spec):
        """`value` (a DTensor laid out by `spec` on `tfpar.Mesh` `source`,
        held by the source's hosts; elsewhere a stand-in of its shape) on
        `target`, held by the target's hosts (a stand-in elsewhere)."""
        senders, receivers = source.hosts(), target.hosts()
        layout = layout_lib.to_dtensor_layout(spec, target)
        value = placement.relayout(value, spec, source)
        shape = value.shape.as_list()
        if senders == receivers:  # each host its own blocks, in place
            if self._host not in senders:
                return placement.stand_in(layout, shape, value.dtype)
            return dtensor.pack(dtensor.unpack(value), layout)
        block = _block_shape(shape, spec, source)
        from_ids = _global_ids(source)
        to_ids = _global_ids(target)
        L = self._per_host
        zeros = tf.zeros([1, 1] + block, value.dtype)
        components = [zeros] * L
        if self._host in senders:
            blocks = dict(zip(_local_ids(source), dtensor.unpack(value)))
            for slot, sent_from in slot_plan(from_ids, to_ids, L).get(
                    self._host, {}).items():
                components[slot] = blocks[sent_from][None, None]
        slots = dtensor.Layout(["tfpar_hosts", "tfpar_local"] + [
            "unsharded"] * len(shape), self._mesh)
        whole = self._gather(len(shape))(dtensor.pack(components, slots))
        sent = (self._hosts - 1) * L * int(np.prod(block)) * value.dtype.size
        self.bytes_sent += sent
        Bridge.total_bytes_sent += sent
        if self._host not in receivers:
            return placement.stand_in(layout, shape, value.dtype)
        gathered = dtensor.unpack(whole)
        sender_of = dict(zip(to_ids, from_ids))
        return dtensor.pack([gathered[i % L][sender_of[i] // L, 0]
                             for i in _local_ids(target)], layout)


class HostShares:
    """Per-host input to a pipeline across hosts (module doc): places
    each host's micro-batches of its share on the first and last parts'
    meshes, and puts predictions back in the global batch's order.

    Host h holds coordinates [h·c, (h+1)·c) of the data axis (size D) in
    every stage (the strategy checks it: the data axis first), so the
    global batch has D / c shares (`shares`): host h's micro-batch i is
    rows [i·r, (i+1)·r) of its share (r = its rows / m), and the global
    micro-batch i is the hosts' in host order."""

    def __init__(self, meshes, data_axis):
        self._placers = {k: inputs.InputPlacer(meshes[k], data_axis,
                                               per_host=True)
                         for k in (0, -1)}
        self.shares = meshes[0].axis_size(data_axis) // self._placers[
            0].blocks_per_host

    def place(self, block, part):
        """This host's `block` of a micro-batch on part `part`'s mesh
        (0, or -1: the last), each local device its data coordinate's
        rows."""
        return self._placers[part].place(inputs.host_batch(block))

    def check(self, rows, m, split):
        """Raises unless this host's `rows` split into m micro-batches
        of whole blocks of its data coordinates (`split`: the global
        micro-batch splits over the data axis)."""
        blocks = self._placers[0].blocks_per_host
        if split and rows % m == 0:
            return
        raise ValueError(
            "With per_host_input=True each host's batch of a pipeline "
            f"splits into num_microbatches ({m}) micro-batches of its "
            f"{blocks} block(s) of the data axis, so it must divide by "
            f"{m * blocks}. Received: a batch of {rows} rows on host "
            f"{dtensor.client_id()}. Use a per-host batch size that is a "
            f"multiple of {m * blocks} (and drop_remainder=True in "
            "dataset.batch).")

    def in_global_order(self, outputs):
        """Predictions of the m global micro-batches (each the hosts'
        shares in host order) as the global batch's rows: every host's
        micro-batches in turn, host by host."""
        def reorder(*per_microbatch):
            # (shares, m, rows of a share's micro-batch, ...)
            stacked = np.stack([np.reshape(o, (self.shares, -1, *o.shape[1:]))
                                for o in per_microbatch], axis=1)
            return stacked.reshape((-1, *stacked.shape[3:]))
        return tf.nest.map_structure(reorder, *outputs)


def slot_plan(from_ids, to_ids, per_host):
    """{sending host: {slot: global id of the device whose block it
    sends}} of a bridge move from stage devices `from_ids` to `to_ids`
    (global ids by mesh position): the block at position j goes from
    from_ids[j]'s host in the slot of to_ids[j]'s local position, where
    to_ids[j] reads it. Two stages' devices are each other's shifted by
    one offset (sub-meshes of one mesh), so a host's blocks, from ids
    under L apart, go to ids under L apart: distinct slots. A clash
    would swap blocks silently, so it raises.

    >>> slot_plan([0, 1, 2, 3], [4, 5, 6, 7], per_host=2)
    {0: {0: 0, 1: 1}, 1: {0: 2, 1: 3}}
    """
    plan = {}
    for sent_from, sent_to in zip(from_ids, to_ids):
        slots = plan.setdefault(sent_from // per_host, {})
        slot = sent_to % per_host
        if slot in slots:
            raise RuntimeError(
                f"Bridge.move: devices {slots[slot]} and {sent_from} of "
                f"host {sent_from // per_host} would send in one slot "
                f"({slot}): stage devices {from_ids} -> {to_ids}, "
                f"{per_host} per host. This is a tfpar bug; please report "
                "it with the mesh.")
        slots[slot] = sent_from
    return plan


def _block_shape(shape, spec, mesh):
    """The shape of one device's block of a `shape` value laid out by
    `spec` on `mesh`."""
    return [d // (mesh.axis_size(a) if a is not None else 1)
            for d, a in zip(shape, spec)]


def _global_ids(mesh):
    """The global device ids of stage mesh `mesh`, by mesh position."""
    return [device_index(name) for name in mesh.devices]


def _local_ids(mesh):
    """The global ids of this host's devices of stage mesh `mesh`, in
    DTensor's local order (that of `dtensor.unpack`)."""
    return [device_index(name)
            for name in local_device_names(mesh.dtensor_mesh)]


class MetricsOnEveryHost:
    """`PipelineModel`'s `get_metrics_result`: across hosts the metrics live
    on the last stage's host, and every host gets their values (eagerly; a
    collective per value, in the same order on every host)."""

    def get_metrics_result(self):
        results = super().get_metrics_result()
        if not (tf.executing_eagerly() and spans_hosts(self._extended)):
            return results
        return tf.nest.map_structure(
            lambda t: tf.constant(placement.fetch(t))
            if dtensor.is_dtensor(t) else t, results)


def _unmasked(x):
    """Host input `x` as the first part's (values, masks): no masks."""
    values = tf.nest.flatten(x)
    return values, [None] * len(values)


def _sent_mask(output, spec_of, mesh):
    """Inside a stage function: `output`'s Keras mask (`Embedding(
    mask_zero=True)` and the layers after it) as int32, laid out as a
    micro-batch (`spec_of(shape)`), to move with it; None without one."""
    mask = _compat.keras_mask(output)
    if mask is None:
        return None
    return placement.relayout(tf.cast(mask, tf.int32),
                              spec_of(mask.shape), mesh)


def _masked(inputs):
    """Inside a stage function: a part's input tensors from (values,
    masks), each value with its Keras mask again (a layer that reads its
    inputs' masks, MultiHeadAttention, sees them as on one host)."""
    values, masks = inputs
    for value, mask in zip(values, masks):
        if mask is not None:
            _compat.set_keras_mask(value, tf.cast(mask, tf.bool))
    return list(values)


def _portable(gradients):
    """A part's gradient sums as every host can pass them to a compiled
    function: each IndexedSlices (an embedding lookup's rows) without its
    dense shape, a tensor that a host not holding the part cannot read —
    tracing a function reads it, and that host crashed
    (`_with_dense_shape` restores it inside the function)."""
    return [tf.IndexedSlices(g.values, g.indices)
            if isinstance(g, tf.IndexedSlices) else g for g in gradients]


def _whole(tensor):
    """The spec of `tensor` replicated."""
    return (None,) * tensor.shape.rank


def _with_dense_shape(gradient, shape):
    """Inside a stage function: a `_portable` IndexedSlices with the dense
    shape of its variable (static `shape`) again."""
    if isinstance(gradient, tf.IndexedSlices) and \
            gradient.dense_shape is None:
        return tf.IndexedSlices(gradient.values, gradient.indices,
                                tf.constant(tuple(shape), tf.int32))
    return gradient


def _tie_sum_body(part, training, total, terms, shape):
    """On a tied weight's home part (of `shape`): its gradient sum plus
    the copies' (`TiedAcrossHosts.exchange`)."""
    del part, training
    total = _with_dense_shape(total, shape)
    for gradient in terms:
        total = accumulate(total, _with_dense_shape(gradient, shape))
    return total


def _tied_layout_body(part, training, gradient, spec):
    """A tied weight's gradient sum laid out as the weight (`spec`), or a
    sparse one's rows and indices whole (`TiedAcrossHosts`)."""
    del training
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(
            placement.relayout(gradient.values, _whole(gradient.values),
                               part.mesh),
            placement.relayout(gradient.indices, (None,), part.mesh))
    return placement.relayout(gradient, spec, part.mesh)


def _finite_body(part, training, sums):
    """1.0 when all the part's gradient sums are finite, else 0.0."""
    del training
    return placement.relayout(loss_scale.all_finite(sums), (), part.mesh)


def _verdict_body(part, training, flags):
    """On the last part: every part's flag -> the factor (1 or NaN)."""
    del training
    return placement.relayout(loss_scale.factor_of(flags), (), part.mesh)


# Stage functions whose bodies need no runner (the rest are its methods
# `_<kind>_body`), by kind (`CrossHostRunner._stage_function`).
_PART_BODIES = {"tie_sum": _tie_sum_body, "tied_layout": _tied_layout_body,
                "finite": _finite_body, "verdict": _verdict_body}


class TiedAcrossHosts:
    """Weights tied across stages on different hosts: the gradient
    exchange of `CrossHostRunner` (`exchange`), its compiled parts the
    "tie_sum" and "tied_layout" stage functions (`_tie_sum_body`,
    `_tied_layout_body`)."""

    def __init__(self, ties, bridge, meshes, stage_function):
        self._ties, self._bridge, self._meshes = ties, bridge, meshes
        self._stage_function = stage_function

    def exchange(self, sums):
        """Weights tied across stages (`tfpar.pipeline.tied`: a persistent
        copy on each later stage that reads one): the one-host step's
        `TiedWeights.exchange` through the bridge. Each copy's gradient
        sum g_c moves to the weight's home part, which adds them,
        g = g_home + Σ_c g_c (a compiled sum on its mesh), and g moves back
        to every copy: home and copies apply one g, so they stay equal."""
        for copies in self._ties.trained_copies():
            weight, home, j = copies[0].weight, copies[0].home.index, \
                copies[0].index
            terms = [self._move(sums[c.holder.index][c.slot], weight,
                                c.holder.index, home)
                     for c in copies if sums[c.holder.index][c.slot]
                     is not None]
            total = sums[home][j]
            if terms:
                total = self._stage_function("tie_sum", home)(
                    total, terms, tuple(weight.shape))
            if total is None:
                continue  # no micro-batch reached it: zeros everywhere
            sums[home][j] = total
            for c in copies:
                sums[c.holder.index][c.slot] = self._move(
                    total, weight, home, c.holder.index)

    def _move(self, gradient, weight, source, target):
        """A tied weight's gradient sum from part `source` to `target`:
        dense laid out as the weight; sparse (an embedding lookup's
        IndexedSlices) as its rows and their indices, whole."""
        spec = self._ties.spec_of(weight)
        # Laid out in a compiled function of the source's (an eager
        # relayout on the host not holding it would crash that host), so
        # the bridge's own relayout has nothing to do.
        gradient = self._stage_function("tied_layout", source)(gradient,
                                                               spec)

        def move(tensor, layout):
            return self._bridge.move(tensor, self._meshes[source],
                                     self._meshes[target], layout)

        if isinstance(gradient, tf.IndexedSlices):
            return tf.IndexedSlices(
                move(gradient.values, _whole(gradient.values)),
                move(gradient.indices, (None,)))
        return move(gradient, spec)


# The dtypes whose small replicated tensors DTensor folds, and their bits.
_BITS = {tf.int32: tf.uint32, tf.int64: tf.uint64, tf.float32: tf.uint32}
# Fewer elements than this are small (DTensor folded 17, not 31, here).
_SMALL = 64
_bitcast = tf.function(tf.bitcast, reduce_retracing=True)


def _to_bits(tensor):
    """A small tensor as its bits (`SmallTensorsAsBits`), computed on its
    own mesh (a no-op on the hosts without it, as a stage function)."""
    return _bitcast(tensor, _BITS[tensor.dtype])


class SmallTensorsAsBits:
    """A stage function whose small int32/int64/float32 inputs arrive as
    their bits.

    DTensor (TF 2.21) keys a compiled program on the values of its small
    replicated int32, int64 and float32 inputs (it reads them as shapes,
    axes and constants) and compiles it again the first time such a value
    changes. Across hosts only the host holding a stage sees those values
    — elsewhere they are stand-ins that never change — so that host alone
    compiled the stage's step a second time (a Dropout's seeds, sparse
    labels on a mesh without a data axis, a loss carried from an earlier
    stage, a loss-scaling verdict), and the collectives of that extra
    program advanced its collective instance keys: the next program
    compiled on every host (a move of a new shape, the first `evaluate`)
    then waited for keys the other host never used — a hang (the
    recompilation: `tests/test_hosts_pipeline.py`). So every such tensor
    of fewer than `_SMALL` elements enters a stage function as uint32/
    uint64 bits (`_to_bits`; DTensor folds neither), bitcast back inside
    (`from_bits`): exact, and each program compiles once on every host."""

    def __init__(self, function):
        self._function = function

    def __call__(self, *args):
        leaves = tf.nest.flatten(args, expand_composites=True)
        encoded = tuple(
            (i, leaf.dtype.name) for i, leaf in enumerate(leaves)
            if isinstance(leaf, tf.Tensor) and leaf.dtype in _BITS
            and leaf.shape.num_elements() < _SMALL)
        if not encoded:
            return self._function(*args)
        for i, _ in encoded:
            leaves[i] = _to_bits(leaves[i])
        return self._function(*tf.nest.pack_sequence_as(
            args, leaves, expand_composites=True), encoded=encoded)


def from_bits(encoded, args):
    """Inside a stage function: `args` with the leaves `encoded` by
    `SmallTensorsAsBits` ((position, dtype name) pairs; its keyword
    argument `encoded`, given only when some are) bitcast back."""
    if not encoded:
        return args
    leaves = tf.nest.flatten(args, expand_composites=True)
    for i, dtype in encoded:
        leaves[i] = tf.bitcast(leaves[i], dtype)
    return tf.nest.pack_sequence_as(args, leaves, expand_composites=True)


class CrossHostRunner(PipelineRunner):
    """The host-driven train/test/predict step of a `PipelineModel` whose
    stages live on different hosts (see module doc).

    Every host runs every action, in schedule order: DTensor numbers the
    collectives of each program it compiles in order, so all hosts must
    compile the same programs in the same order. A program on another
    host's mesh returns at once, holding nothing (`tests/
    dtensor_cross_host_repro.py`, case b_function); only the host owning
    a stage computes it."""

    def __init__(self, pipeline, mode):
        if pipeline.record_timeline:
            raise ValueError(
                "PipelineModel(record_timeline=True) profiles one "
                "tf.function step, but stages on different hosts run a "
                "host-driven step of many. Received: record_timeline=True "
                f"on {len(pipeline.parts)} stages over "
                f"{dtensor.num_clients()} hosts. Use record_timeline=False.")
        super().__init__(pipeline, mode)
        self.bridge = Bridge()
        self._stage_functions = {}
        self._drawn = {}
        self._carried = {}
        self._tied = TiedAcrossHosts(self._ties, self.bridge, self._meshes,
                                     self._stage_function)
        self._shares = (HostShares(self._meshes, self._data_axis)
                        if self._extended.input_placer.per_host else None)

    # -- host side -----------------------------------------------------------

    def run_steps(self, host_batches):
        for batch in host_batches:
            self._run_batch(batch)
        return self._model.get_metrics_result()  # on every host

    def _run_batch(self, batch):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
        training_step = self._mode == "train"
        m, split, rows = self._microbatches(x, training_step)
        xs = self._cut(x, 0, m, split)
        targets = self._cut((y, sample_weight), -1, m, split)
        if training_step:
            self._model.sync_stage_optimizers()
            self._train(xs, targets, split, rows)
            return
        for i in range(m):
            self._forward_all(xs[i], targets[i], split, rows)

    def predict_inputs(self, x):
        m, split, rows = self._microbatches(x, training=False)
        outputs = [self._y_pred([placement.fetch(v) for v in
                                 self._forward_all(xs, None, split, rows)])
                   for xs in self._cut(x, 0, m, split)]
        if self._shares is not None:
            return self._shares.in_global_order(outputs)
        return tf.nest.map_structure(lambda *ys: np.concatenate(ys),
                                     *outputs)

    def _microbatches(self, x, training):
        """(m, whether each micro-batch splits over the data axis, the
        global rows of one) of the batch whose host inputs are `x` (per
        host: this host's share of it)."""
        size = int(np.shape(tf.nest.flatten(x)[0])[0])
        total = size * (self._shares.shares if self._shares else 1)
        m, split = self._model.microbatching.split(total, training)
        if self._shares is not None:
            self._shares.check(size, m, split)
        return m, split, total // m

    def _spec(self, shape, split, mesh, min_rank=3):
        """The layout of a micro-batch tensor of `shape` (an activation's
        or gradient's; an input's with `min_rank`=2), as the single-host
        runner lays it out (`microbatch_spec`): batch over the data axis
        when `split`, sequence over the context axis if any."""
        return collectives.microbatch_spec(shape, split, mesh,
                                           self._data_axis, self._context,
                                           min_rank)

    def _cut(self, structure, part, m, split):
        """Micro-batches 0..m-1 of host tensors on part `part`'s mesh
        (stand-ins on the hosts without it: `placement.put`)."""
        mesh = self._meshes[part]

        def put(t, i):
            if t is None:
                return None
            array = np.asarray(t)
            rows = array.shape[0] // m
            block = array[i * rows:(i + 1) * rows]
            if self._shares is not None:
                return self._shares.place(block, part)
            return placement.put(block, self._spec(block.shape, split,
                                                   mesh, min_rank=2), mesh)

        return [tf.nest.map_structure(lambda t, i=i: put(t, i), structure)
                for i in range(m)]

    def _send(self, values, source, target, split):
        """Part `source`'s `values` (None entries stay None) on part
        `target`'s mesh."""
        return [None if v is None else self.bridge.move(
            v, self._meshes[source], self._meshes[target],
            self._spec(v.shape, split, self._meshes[source]))
            for v in values]

    # -- the schedule --------------------------------------------------------

    def _train(self, xs, targets, split, rows):
        sums = self._gradient_sums(xs, targets, split, rows)
        for k, (part_sums, factor) in enumerate(
                zip(sums, self._overflow_factors(sums))):
            self._stage_function("apply", k)(part_sums, factor)

    def _gradient_sums(self, xs, targets, split, rows):
        """Every action of the schedule; each part's weight gradients
        summed over the micro-batches (on its mesh), tied weights' summed
        between their stages (`TiedAcrossHosts`)."""
        schedule = self._schedule_for(len(xs))
        self._drawn = {}  # (part, micro-batch) -> the seeds its F drew
        self._carried = {}  # micro-batch -> earlier parts' losses, on last
        inputs = {(0, i): _unmasked(x) for i, x in enumerate(xs)}
        incoming = {}  # (part, micro-batch) -> its outputs' gradients
        sums = [None] * len(self._parts)
        for action in schedule.execution_order():
            k, i = schedule.part(action), action.microbatch
            if action.kind == FORWARD:
                self._forward_action(k, i, inputs, split)
            else:
                self._backward_action(k, i, inputs, incoming, targets,
                                      sums, (split, rows, 1.0 / len(xs)))
        self._tied.exchange(sums)
        return sums

    def _overflow_factors(self, sums):
        """Under a `LossScaleOptimizer`, one overflow decision for every
        part (`tfpar.pipeline.loss_scale`): each part's finite flag moves
        to the last part (through the bridge), which combines them; its
        factor (1: all finite, NaN: skip) comes back to every part, whose
        gradients it multiplies. None per part otherwise."""
        if not loss_scale.applies_to(self._model.optimizer) or \
                len(sums) < 2:
            return [None] * len(sums)
        last = len(sums) - 1
        flags = [self.bridge.move(self._stage_function("finite", k)(s),
                                  self._meshes[k], self._meshes[last], ())
                 for k, s in enumerate(sums)]
        factor = self._stage_function("verdict", last)(flags)
        return [self.bridge.move(factor, self._meshes[last], mesh, ())
                for mesh in self._meshes]

    def _forward_action(self, k, i, inputs, split):
        """F(k, i): part k's forward, its outputs to part k+1 (the last
        part's forward runs inside its backward)."""
        if k == len(self._parts) - 1:
            return
        (sent, losses), self._drawn[k, i] = self._stage_function(
            "forward_drawing", k)(inputs[k, i], split)
        self._carry(k, i, losses)
        inputs[k + 1, i] = self._send_masked(sent, k, split)

    def _send_masked(self, sent, k, split):
        """Part k's (outputs, their masks) on part k+1's mesh."""
        return tuple(self._send(values, k, k + 1, split) for values in sent)

    def _carry(self, k, i, losses):
        """The losses part k's layers added in micro-batch i (add_loss,
        regularizers: their gradients are part k's own) to the last part,
        whose loss adds their values (as one host's `carried`)."""
        last = len(self._parts) - 1
        self._carried.setdefault(i, []).extend(
            self.bridge.move(loss, self._meshes[k], self._meshes[last], ())
            for loss in losses)

    def _backward_action(self, k, i, inputs, incoming, targets, sums, how):
        """B(k, i): part k's backward (its weight gradients added to
        `sums[k]`), its inputs' gradients to part k-1."""
        split, rows, scale = how
        last = k == len(self._parts) - 1
        gradients, weights = self._stage_function("backward", k)(
            inputs.pop((k, i)), incoming.pop((k, i), None),
            (targets[i], self._carried.pop(i, [])) if last else None,
            scale, rows, split, self._drawn.pop((k, i), None))
        weights = _portable(weights)
        sums[k] = list(weights) if sums[k] is None else [
            b if a is None else a if b is None else accumulate(a, b)
            for a, b in zip(sums[k], weights)]
        if k > 0:
            incoming[k - 1, i] = self._send(gradients, k, k - 1, split)

    def _forward_all(self, x, targets, split, rows):
        """Every part forward on one micro-batch (not training): the last
        part's outputs, or, given `targets`, its loss and metrics
        updated (None)."""
        values = _unmasked(x)
        last = len(self._parts) - 1
        self._carried = {}
        for k in range(last):
            sent, losses = self._stage_function("forward", k, False)(
                values, split)
            if targets is not None:
                self._carry(k, 0, losses)
            values = self._send_masked(sent, k, split)
        if targets is not None:
            return self._stage_function("evaluate", last, False)(
                values, (targets, self._carried.pop(0, [])), rows)
        (outputs, _), _ = self._stage_function("forward", last, False)(
            values, split)
        return outputs

    # -- traced: one part's functions ------------------------------------------

    def _stage_function(self, kind, k, training=True):
        """The compiled `kind` step of part k ("forward", "backward",
        "evaluate", "apply"), on its mesh (its small inputs passed as
        bits: `SmallTensorsAsBits`)."""
        key = (kind, k, training)
        if key not in self._stage_functions:
            body = _PART_BODIES.get(kind) or getattr(self, f"_{kind}_body")
            self._stage_functions[key] = SmallTensorsAsBits(self.compiled(
                self._step_of(body, self._parts[k], training),
                reduce_retracing=False))
        return self._stage_functions[key]

    def _step_of(self, body, part, training):
        def step(*args, encoded=()):
            args = from_bits(encoded, args)
            with self._extended.replica_scope(), part.on_mesh():
                return body(part, training, *args)

        step.__name__ = f"{body.__name__[1:]}_part{part.index}"
        return step

    def _forward_body(self, part, training, inputs, split):
        """((the part's outputs, their Keras masks), the losses its layers
        added: [] or one)."""
        outputs, own_loss = part.run(_masked(inputs), training)

        def spec_of(shape):
            return self._spec(shape, split, part.mesh)

        sent = ([placement.relayout(o, spec_of(o.shape), part.mesh)
                 for o in outputs],
                [_sent_mask(o, spec_of, part.mesh) for o in outputs])
        losses = [] if own_loss is None else [
            placement.relayout(own_loss, (), part.mesh)]
        return sent, losses

    def _forward_drawing_body(self, part, training, inputs, split):
        """F(k, i) training: (`_forward_body`'s, the random seeds its
        layers drew, which B(k, i) replays)."""
        with step_context.pushed("seeds", step_context.Seeds()) as drawn:
            outputs = self._forward_body(part, training, inputs, split)
        return outputs, drawn.values

    def _metrics_of(self, outputs, own_loss, targets):
        """(y_pred, y, sample_weight, loss) of the last part's outputs;
        `targets` (y, sample_weight) and the losses carried from the
        earlier parts (values only: their gradients are those parts')."""
        (y, sample_weight), carried = targets
        y_pred = self._y_pred(outputs)
        return y_pred, y, sample_weight, self._loss(
            y_pred, y, sample_weight, extra_losses(own_loss, carried))

    def _evaluate_body(self, part, training, inputs, targets, rows):
        del training
        outputs, own_loss = part.run(_masked(inputs), False)
        self._update_metrics(rows, *self._metrics_of(outputs, own_loss,
                                                     targets))

    def _backward_body(self, part, training, inputs, gradients, targets,
                       scale, rows, split, drawn):
        """The part's forward again under a tape, with the seeds its F drew
        (`drawn`; None for the last part, which has no F: it draws), then
        its backward: (its inputs' gradients, its weights' gradients)."""
        del training
        part.start_step()
        if gradients is not None:
            part.receive_gradients(0, list(gradients))
        seen = []

        def objective_of(outputs, own_loss):
            if targets is None:
                return part_objective(part, own_loss, scale), None
            seen.append(self._metrics_of(outputs, own_loss, targets))
            loss = seen[0][-1]
            return self._model.optimizer.scale_loss(loss * scale), loss

        replay = step_context.Seeds(drawn or (), replaying=True)
        with step_context.pushed("seeds", replay) if drawn is not None \
                else contextlib.nullcontext():
            part.forward(0, _masked(inputs), objective_of, False)
        if seen:
            self._update_metrics(rows, *seen[0])
        grads, _ = part.backward(0, None)
        return ([None if g is None else placement.relayout(
            g, self._spec(g.shape, split, part.mesh), part.mesh)
            for g in grads], list(part.gradient_sums))

    def _apply_body(self, part, training, sums, factor):
        """The part's optimizer step on its sums (times `factor`, if any)."""
        del training
        part.gradient_sums = [
            loss_scale.times(_with_dense_shape(g, w.shape), factor)
            for g, w in zip(sums, part.updated)]
        part.apply_gradients()
