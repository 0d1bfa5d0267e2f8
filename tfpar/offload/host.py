"""The offload update (`tfpar.offload`, where the whole step is described):
the host mesh of a mesh's weights (`host_mesh`), the block-by-block moves
between the two (`move_blocks`, `move_alike`), and `Offload`, one
optimizer's host copies of its weights and its update on the host devices
(`attach` makes one); under a `LossScaleOptimizer` the scale the device
step reads (`DeviceLossScale`).

It knows a strategy only by the objects it is given (its `dims`, its
`extended.registry`, `scope()` and `replica_scope()`) and imports neither
`tfpar.pipeline` nor `tfpar.training`: the runners that call it from a
step are `tfpar.offload.runners`.
"""

import contextlib

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import _compat
from tfpar import layout as layout_lib
from tfpar import optimizer_copies
from tfpar import placement as placement_lib
from tfpar.mesh import Mesh, short_device_name
from tfpar.offload import master as offload_master


def host_mesh(dims, mesh=None):
    """The `tfpar.Mesh` offload keeps the state of `mesh`'s weights on (the
    strategy's mesh, or a pipeline stage's sub-mesh of it), in its shape:
    host device i of the strategy's mesh device i is `dims.offload_devices[i]`,
    else DTensor's host mesh of the (GPU/TPU) mesh."""
    hosts = dims.offload_devices
    if hosts is None:
        hosts = [short_device_name(d) for d in
                 dims.mesh.dtensor_mesh.host_mesh().local_devices()]
    mesh = dims.mesh if mesh is None else mesh
    host_of = {short_device_name(device): short_device_name(host)
               for device, host in zip(dims.mesh.devices, hosts)}
    return Mesh(mesh.shape, devices=[
        host_of[short_device_name(device)] for device in mesh.devices])


def move_blocks(value, layout):
    """DTensor `value` on another mesh of `layout`'s shape, laid out by
    `layout`: the block mesh device i holds is copied to device i of
    `layout`'s mesh (eager; an identity under `tf.device` per block).
    Across hosts both meshes are one host's (`host_mesh`): on the others
    it gives a stand-in (`tfpar.placement.stand_in`)."""
    if not layout.mesh.local_device_ids():
        return placement_lib.stand_in(layout, value.shape, value.dtype)
    moved = []
    for block, device in zip(dtensor.unpack(value),
                             layout.mesh.local_devices()):
        with tf.device(device):
            moved.append(tf.identity(block))
    return dtensor.pack(moved, layout)


def move_alike(value, mesh):
    """`move_blocks` of DTensor `value` to `mesh`, laid out with the same
    sharding there; of an IndexedSlices its values and indices (no dense
    shape: the host update makes it a constant, `Offload._host_update`)."""
    if isinstance(value, tf.IndexedSlices):
        return tf.IndexedSlices(move_alike(value.values, mesh),
                                move_alike(value.indices, mesh))
    specs = dtensor.fetch_layout(value).sharding_specs
    return move_blocks(value, dtensor.Layout(specs, mesh.dtensor_mesh))


def _layout_of(variable):
    """The DTensor layout of a (Keras) variable a strategy made, from its
    Placement (`dtensor.fetch_layout` of a variable reads its value: a
    copy of every block)."""
    place = _compat.backing_variable(variable).placement
    return layout_lib.to_dtensor_layout(place.spec, place.mesh)


def attach(optimizer, strategy, mesh=None):
    """Makes `optimizer` (of weights on `mesh`: the strategy's mesh, or a
    pipeline stage's) keep its state on the host devices of `mesh` (called
    by `compile` under an offloading strategy, or by a `PipelineModel` for
    each part's optimizer); it must not be built yet. Returns the
    `Offload` (None for no optimizer)."""
    if optimizer is None:
        return None
    existing = offload_of(optimizer)
    if existing is not None:
        return existing
    _check_optimizer(optimizer)
    if strategy.dims.offload == offload_master.OPTION:
        offload_master.check()
    offload = Offload(optimizer, strategy, host_mesh(strategy.dims, mesh))
    optimizer._tfpar_offload = offload  # noqa: SLF001 (tfpar's own)
    return offload


def offload_of(optimizer):
    """The `Offload` `attach` gave `optimizer`, or None (not offloaded)."""
    return getattr(optimizer, "_tfpar_offload", None)


def _check_optimizer(optimizer):
    """Refuses an optimizer whose update cannot run on the host mesh."""
    reason = None
    if optimizer.built:
        reason = "it is built already (its slots are on the devices)"
    elif not isinstance(optimizer, keras.optimizers.Optimizer):
        reason = "it is not a Keras optimizer"
    if reason:
        raise ValueError(
            f"ParallelStrategy(offload='optimizer') cannot run optimizer "
            f"{optimizer.name!r} on the host: {reason}. Received: "
            f"{type(optimizer).__name__}. Compile with an unbuilt Keras "
            "optimizer (e.g. 'adam'), or use offload=None.")


def _with_dense_shape(gradient, weight):
    """A sparse `gradient` (IndexedSlices) of `weight` given its dense
    shape as a constant of the traced host update: Keras' optimizers turn
    it dense (Adam's m += (g - m)(1 - beta_1)) with an UnsortedSegmentSum
    over dense_shape[0] rows, whose row count DTensor must know to split
    the sum over the rows of a row-split slot (fsdp). Given as an argument
    of the update it was unknown until DTensor folded it, too late: "tf.
    DTensorAllScatter ... EmitAllScatter requires slice on input axis 0
    which is dynamic" (tests/dtensor_sparse_gradient_repro.py)."""
    if not isinstance(gradient, tf.IndexedSlices):
        return gradient
    return tf.IndexedSlices(gradient.values, gradient.indices,
                            tf.constant(weight.shape.as_list(), tf.int64))


class DeviceLossScale:
    """A `LossScaleOptimizer`'s scale under offload: its `dynamic_scale`
    and `step_counter` live on the host with the update (which checks the
    gradients for overflow, unscales them and grows or halves the scale),
    and the device step scales the loss by a copy of the scale on the
    devices (a replicated scalar), refreshed after each host update.

    Args:
        optimizer: the (unbuilt) LossScaleOptimizer; its `scale_loss` is
            routed here.
        strategy: the offloading `ParallelStrategy`.
    """

    def __init__(self, optimizer, strategy):
        self._optimizer = optimizer
        self._strategy = strategy
        self._scale_loss = optimizer.scale_loss
        self.copy = None  # the devices' copy, made with the scale
        optimizer.scale_loss = self.scale_loss

    def built(self, host_mesh):
        """After `optimizer.build`: moves the scale and its counter to
        `host_mesh` and makes the devices' copy of the scale."""
        registry = self._strategy.extended.registry
        for variable in (self._optimizer.step_counter,
                         self._optimizer.dynamic_scale):
            registry.move_to(variable, host_mesh)
        with tf.init_scope(), self._strategy.scope():
            self.copy = keras.Variable(
                self._optimizer.dynamic_scale.numpy(), trainable=False,
                name="loss_scale_on_devices")

    def scale_loss(self, loss):
        """`loss` times the scale: its devices' copy once built."""
        if self.copy is None:
            return self._scale_loss(loss)
        return keras.ops.multiply(loss, keras.ops.cast(self.copy,
                                                       loss.dtype))

    def refresh(self):
        """The scale the host update left, copied to the devices."""
        self.copy.assign(self._optimizer.dynamic_scale.numpy())


class Offload:
    """One model's offloaded optimizer (see the module): its host mesh,
    the host copy (`mirror`) of each trainable weight, the optimizer's
    `build` and `apply` routed to those copies, and the host update.

    Args:
        optimizer: a Keras optimizer, not built yet.
        strategy: the offloading `ParallelStrategy` of its weights.
        mesh: the host `tfpar.Mesh` (`host_mesh`) of its weights' mesh.
    """

    def __init__(self, optimizer, strategy, mesh):
        self._strategy = strategy
        self._registry = strategy.extended.registry
        self.mesh = mesh
        self.optimizer = optimizer
        self._mirrors = {}  # id(device weight's backing) -> (weight, mirror)
        # id(device weight's backing) -> its `writes` when the host copy
        # last equalled it; and the weights the device step itself writes.
        self._seen = {}
        self._written_in_step = set()
        self._captured = None  # gradients recorded while tracing a step
        self._master = strategy.dims.offload == offload_master.OPTION
        self._build = self.optimizer.build
        self._apply = self.optimizer.apply
        self._finalize = self.optimizer.finalize_variable_values
        self.optimizer.build = self.build
        self.optimizer.apply = self.apply
        self.optimizer.finalize_variable_values = self.finalize
        for variable in self.optimizer.variables:  # iterations, rate
            self._registry.move_to(variable, self.mesh)
        self._update = tf.function(self._host_update)
        self._loss_scale = DeviceLossScale(self.optimizer, strategy) if (
            isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)
        ) else None

    def mirror(self, weight):
        """The host copy of trainable Keras `weight` (made on first use,
        from its value block by block): same path, spec, constraint."""
        backing = _compat.backing_variable(weight)
        if id(backing) in self._mirrors:
            return self._mirrors[id(backing)][1]
        place = self._registry.require_on_mesh(weight)
        host_place = place.replace(mesh=self.mesh, compute_spec=place.spec)
        value = move_blocks(backing.read_value(),
                            layout_lib.to_dtensor_layout(host_place.spec,
                                                         self.mesh))
        *scopes, name = weight.path.split("/")
        with contextlib.ExitStack() as stack:
            stack.enter_context(self._strategy.scope())
            stack.enter_context(self._registry.placing_on(host_place))
            for scope in scopes:
                stack.enter_context(keras.name_scope(scope))
            copy = keras.Variable(value, dtype=weight.dtype, trainable=True,
                                  name=name)
        copy.constraint = weight.constraint
        copy.overwrite_with_gradient = weight.overwrite_with_gradient
        if self._master and offload_master.keeps_compute_copy(weight):
            # "+master": the devices keep only cast(copy, compute dtype).
            backing = offload_master.to_compute_copy(
                self._registry, weight, copy, move_blocks)
        self._mirrors[id(backing)] = (weight, copy)
        self._seen[id(backing)] = backing.writes
        return copy

    def build(self, variables):
        """`optimizer.build` over the host copies of `variables`: the
        slots are made on the host mesh, each laid out like its weight;
        state made apart from a weight (Nadam's `u_product`, Adafactor's
        row and column factors: made on the devices) moves there too. A
        weight excluded from weight decay has its copy excluded."""
        variables = list(variables)
        exclude = optimizer_copies.stand_in_exclusions(self.optimizer,
                                                       variables)
        with self._strategy.scope():
            copies = [self.mirror(v) for v in variables]
            exclude(copies)
            self._build(copies)
        for variable in self.optimizer.variables:
            self._registry.move_to(variable, self.mesh)
        if self._loss_scale is not None:
            self._loss_scale.built(self.mesh)

    def apply(self, grads, trainable_variables=None):
        """`optimizer.apply`: inside a device step only records the
        gradients (`capturing`); elsewhere applies them to the host copies
        (host gradients, e.g. from `apply_on_host`)."""
        if trainable_variables is None:
            trainable_variables = [w for w, _ in self._mirrors.values()]
        trainable_variables = list(trainable_variables)
        if self._captured is not None:
            self._captured.append((list(grads), trainable_variables))
            return None
        return self._apply(list(grads),
                           [self._host_copy(v) for v in trainable_variables])

    def finalize(self, var_list):
        """`optimizer.finalize_variable_values` (what `fit` ends with: an
        EMA's averages written into the weights, a MultiOptimizer's
        sub-optimizers each given theirs) run on the host copies of
        `var_list`'s weights, which the optimizer was built for; each copy
        it wrote is moved into its device weight."""
        pairs = [self._mirrors[id(_compat.backing_variable(weight))]
                 for weight in var_list
                 if id(_compat.backing_variable(weight)) in self._mirrors]
        before = [_compat.backing_variable(copy).writes for _, copy in pairs]
        self._finalize([copy for _, copy in pairs])
        for (weight, copy), writes in zip(pairs, before):
            if _compat.backing_variable(copy).writes != writes:
                self._write_back(weight,
                                 offload_master.compute_cast(weight, copy))

    def write_back_all(self):
        """Moves every host copy into its device weight: after something
        other than the host update wrote the copies (Keras'
        `SwapEMAWeights` swapping them with the moving averages)."""
        for weight, copy in list(self._mirrors.values()):
            self._write_back(weight, offload_master.compute_cast(weight, copy))

    def _write_back(self, weight, cast):
        """Moves `weight`'s host copy into the device weight block by
        block (a ComputeCopy: `cast`, the copy in its compute dtype)."""
        backing = _compat.backing_variable(weight)
        if cast is not None:
            backing.sync(cast)
        else:
            backing.assign(move_blocks(
                self.mirror(weight).value.read_value(), _layout_of(backing)))
        self._seen[id(backing)] = backing.writes

    def _host_copy(self, variable):
        """`variable` if it is a host copy already, else its `mirror`."""
        backing = _compat.backing_variable(variable)
        if any(backing is _compat.backing_variable(copy)
               for _, copy in self._mirrors.values()):
            return variable
        return self.mirror(variable)

    @contextlib.contextmanager
    def capturing(self):
        """Records the optimizer calls of a step being traced: yields the
        list of (gradients, weights) the step passed to `apply`."""
        self._captured = captured = []
        try:
            yield captured
        finally:
            self._captured = None

    def pull_weights(self):
        """Copies into its host copy, block by block, each device weight
        written by something other than the host update since (its
        `writes` count moved): a checkpoint restore, `set_weights`,
        `assign` in a callback or in the step itself reaches the host
        before the update. The update keeps the copies current itself, so
        in a plain `fit` nothing moves here."""
        for key, (weight, copy) in self._mirrors.items():
            backing = _compat.backing_variable(weight)
            # A ComputeCopy written eagerly wrote its master first.
            current = getattr(backing, "master_writes", None) == backing.writes
            if key in self._written_in_step or (
                    backing.writes != self._seen[key] and not current):
                _compat.backing_variable(copy).assign(move_blocks(
                    tf.cast(backing.read_value(), copy.dtype),
                    _layout_of(copy)))
            self._seen[key] = backing.writes

    def device_step(self, call):
        """`call()` (the device step) and its result; a weight the step
        assigned while it was traced is written by every run of it, and is
        pulled after each (`pull_weights`)."""
        before = {key: _compat.backing_variable(weight).writes
                  for key, (weight, _) in self._mirrors.items()}
        result = call()
        self._written_in_step.update(
            key for key, (weight, _) in self._mirrors.items()
            if key in before
            and _compat.backing_variable(weight).writes != before[key])
        return result

    def step_gradients(self, captured):
        """In a traced step: the gradients it gave the optimizer (one
        `apply` call, `captured` by `capturing`) in the order of
        `self.weights`: each dense one laid out like its stored weight; a
        sparse one (IndexedSlices: an Embedding's rows) kept sparse, as
        Keras' optimizers treat it differently (Adam squares each slice,
        so repeated rows differ from the dense gradient's square)."""
        if len(captured) != 1:
            raise ValueError(
                "ParallelStrategy(offload='optimizer') runs one optimizer "
                "update per step on the host; this train_step called "
                f"optimizer.apply {len(captured)} times. Received: "
                f"{len(captured)} calls. Call it once per step (Keras' own "
                "train_step does), or use offload=None.")
        grads, self.weights = captured[0]
        placed = []
        for grad, weight in zip(grads, self.weights):
            place = self._registry.require_on_mesh(weight)
            if isinstance(grad, tf.IndexedSlices):
                # Values and indices replicated (every host device updates
                # the rows of its block); the dense shape is remade on the
                # host (`_host_update`).
                grad = tf.IndexedSlices(*[
                    placement_lib.relayout(part, (None,) * part.shape.rank,
                                           place.mesh)
                    for part in (grad.values, grad.indices)])
            elif grad is not None:
                grad = placement_lib.relayout(
                    tf.convert_to_tensor(grad), place.spec, place.mesh)
            placed.append(grad)
        return placed

    def apply_on_host(self, grads):
        """Moves `grads` (a step's `step_gradients`) to the host block by
        block, runs the optimizer there and moves the updated weights
        back into the device weights, block by block."""
        host = [None if g is None else move_alike(g, self.mesh)
                for w, g in zip(self.weights, grads)]
        casts = self._update(host)
        if self._loss_scale is not None:
            self._loss_scale.refresh()
        for weight, grad, cast in zip(self.weights, grads, casts):
            if grad is not None:
                self._write_back(weight, cast)

    def _host_update(self, grads):
        """The compiled update on the host mesh: `optimizer.apply` to the
        host copies of the step's weights (slots, counters, weight decay;
        Keras skips the None gradients); returns, for each ComputeCopy
        ("+master"), its updated master cast to the compute dtype (else
        None)."""
        # The gradient of a ComputeCopy is in its compute dtype: the
        # master's update takes it in float32 (the gradient of a cast is
        # the cast of the gradient, as under offload="optimizer").
        grads = [None if g is None
                 else tf.cast(_with_dense_shape(g, w), w.dtype)
                 for g, w in zip(grads, self.weights)]
        with self._strategy.extended.replica_scope():
            self.apply(grads, self.weights)
        return [offload_master.compute_cast(w, self.mirror(w))
                for w in self.weights]
