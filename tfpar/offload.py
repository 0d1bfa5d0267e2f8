"""Optimizer offload (`ParallelStrategy(offload="optimizer")`): the
optimizer's state and its update on host devices, ZeRO-Offload's split.

A step runs in three parts:

1. the compiled step on the device mesh: Keras' `train_step` (or the
   model's own) computes the loss, metrics and gradients; its call to the
   optimizer only records the gradients (each laid out like its stored
   weight: fsdp's reduce-scattered blocks), which the step returns;
2. each gradient moves to the host mesh block by block (`move_blocks`):
   the component a mesh device holds is copied to its host device
   (`offload_devices[i]` for mesh device i) and the components are packed
   into a DTensor of the same layout on the host mesh — no device and no
   host ever holds more than its own block;
3. a compiled function on the host mesh runs the optimizer's `apply` over
   the host's copy of the weights (`mirror`s, one per trainable weight,
   laid out like it), whose slots were made next to them (a slot follows
   its weight's mesh); each updated weight moves back block by block and
   is assigned to the device weight.

The host copy stays current from the update itself: a step copies each
gradient to the host and each updated weight back, nothing else. A device
weight written by anything else — `set_weights`, `load_weights`,
`restore_checkpoint`, `assign` in a callback or in the step itself — is
copied into its host copy before the next update: every `ShardedVariable`
counts its Python-level assignments (`writes`), and the offload keeps the
count it last saw (`pull_weights`).

Under `mixed_float16` a `LossScaleOptimizer`'s scale and counter live on
the host too (its overflow check is part of the update); the device step
scales the loss by a copy of the scale on the devices (`DeviceLossScale`).

A `PipelineModel` has one optimizer per part (`stage_optimizers`); each
gets its own `Offload` on the host devices of its stage's devices (the
part's `host_mesh`), and the pipeline step — every stage, one program —
returns each part's gradients to its host update (`OffloadPipelineRunner`).

So the devices hold the weights, the gradients and the step's tensors, and
no optimizer slot: per device, `strategy.memory_per_device()` drops by the
slots' bytes (and the optimizer's two scalars, iterations and learning
rate, which live with the slots). The host devices appear in the same
report holding the weights' copy and the slots.

Why not inside one step: DTensor 2.21 cannot `copy_to_mesh` a sharded
value to another mesh (tests/dtensor_offload_repro.py, "copy_sharded");
the route that compiles goes through a replicated value (every device
holding the whole tensor). The eager per-device route above works
("per_device_route" there), so the moves are eager, between compiled
functions, and the host round trip is not overlapped with compute.

On a CPU mesh the devices are the host: DTensor's host mesh is the mesh
itself, and offload needs `offload_devices` naming other (virtual) CPUs.
On this machine those share the devices' physical memory: the tests show
placement and parity, not saved RAM. On GPU/TPU the default host is
DTensor's host mesh (`Mesh.host_mesh()`, CPUs of the mesh's shape).

Across hosts (`tfpar.connect_hosts`) every move stays inside a host: the
mesh and the host mesh are "spread" meshes (the same local devices of
every host, `tfpar.Mesh`), `offload_devices[i]` is on mesh device i's
host, each host moves its own blocks and all hosts run the host update
together (tests/test_offload_hosts.py). A pipeline whose stages live on
different hosts (`tfpar.pipeline.cross_host`: one stage's mesh on one
host, its host mesh on the same host's `offload_devices`) runs each
part's update on its own host (`OffloadCrossHostRunner`): every host runs
every part's moves and host update in the same order, the hosts without
that stage on stand-ins (`move_blocks`), as they run its stage functions.

Example (8 virtual CPUs: the mesh on CPU:0-3, the "host" CPU:4-7):

>>> import keras, numpy as np, tfpar
>>> tfpar.use_virtual_cpus(8)
>>> strategy = tfpar.ParallelStrategy(
...     tfpar.Mesh({"data": 4}, devices=[f"CPU:{i}" for i in range(4)]),
...     offload="optimizer",
...     offload_devices=[f"CPU:{i}" for i in range(4, 8)])
>>> with strategy.scope():
...     model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(16)])
...     model.compile(optimizer="adam", loss="mse")
>>> x = np.ones((64, 16), "float32")
>>> history = model.fit(x, x, batch_size=16, verbose=0)
>>> memory = strategy.memory_per_device()
>>> memory["CPU:0"]["optimizer"], memory["CPU:4"]["optimizer"]  # Adam's m, v
(0, 2176)
"""

import contextlib
import functools

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import _compat
from tfpar import layout as layout_lib
from tfpar import offload_master
from tfpar import placement as placement_lib
from tfpar import training
from tfpar.pipeline import cross_host
from tfpar.pipeline import runner as pipeline_runner
from tfpar.mesh import Mesh, short_device_name


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
    existing = getattr(optimizer, "_tfpar_offload", None)
    if existing is not None:
        return existing
    _check_optimizer(optimizer)
    if strategy.dims.offload == offload_master.OPTION:
        offload_master.check()
    offload = Offload(optimizer, strategy, host_mesh(strategy.dims, mesh))
    optimizer._tfpar_offload = offload  # noqa: SLF001 (tfpar's own)
    return offload


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
        self.optimizer.build = self.build
        self.optimizer.apply = self.apply
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
        row and column factors: made on the devices) moves there too."""
        with self._strategy.scope():
            self._build([self.mirror(v) for v in variables])
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
                backing = _compat.backing_variable(weight)
                if cast is not None:  # a ComputeCopy: the host's cast moved
                    backing.sync(cast)
                else:
                    backing.assign(move_blocks(
                        self.mirror(weight).value.read_value(),
                        _layout_of(backing)))
                self._seen[id(backing)] = backing.writes

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


class OffloadRunner(training.StepRunner):
    """`fit`'s step under offload (see the module): the device step
    returns its logs and gradients, then `Offload.apply_on_host` updates
    the weights; one step per call (`steps_per_execution` batches run one
    after another: the host round trip sits between steps). Between the
    device step and the update, the weights something else wrote reach
    the host copies (`pull_weights`; none in a plain `fit`)."""

    def __init__(self, model, extended, offload):
        super().__init__(model, extended, "train")
        self._offload = offload

    def _in_replica(self, batch):
        with self._offload.capturing() as captured:
            # (The base class named: AutoGraph converts this method, and
            # a zero-argument super() is a closure it cannot convert.)
            logs = training.StepRunner._in_replica(self, batch)
        return logs, self._offload.step_gradients(captured)

    def run_steps(self, host_batches):
        logs = None
        for batch in host_batches:
            logs = self._one(self._placer.place(batch))
        return logs

    def _one(self, placed):
        logs, grads = self._offload.device_step(
            lambda: self._call(self._one_step, placed))
        self._offload.pull_weights()
        self._offload.apply_on_host(grads)
        return logs

    def traced_step(self, host_batch):
        """Runs one step (device step and host update, as `fit`) and returns
        the device step's concrete function (`tfpar.communication`)."""
        placed = self._placer.place(host_batch)
        self._one(placed)
        return self._one_step.get_concrete_function(placed)


class OffloadPipelineRunner(pipeline_runner.PipelineRunner):
    """A `PipelineModel`'s train step under offload: the pipeline step (all
    stages, one program) returns its logs and each part's gradients, which
    its optimizer's `Offload` applies on that part's host devices; each
    part's weights written elsewhere (a tied copy's sync, `set_weights`)
    reach its host copies first (`Offload.pull_weights`)."""

    def __init__(self, pipeline):
        super().__init__(pipeline, "train")

    def _train(self, xs, targets, split):
        offloads = part_offloads(self._model)
        with contextlib.ExitStack() as stack:
            captured = [stack.enter_context(offload.capturing())
                        for offload in offloads]
            logs = pipeline_runner.PipelineRunner._train(self, xs, targets,
                                                         split)
        return logs, [offload.step_gradients(calls) for offload, calls
                      in zip(offloads, captured)]

    def _run_batch(self, batch):
        logs, grads = run_and_update(
            self._model,
            lambda: pipeline_runner.PipelineRunner._run_batch(self, batch))
        return logs


def part_offloads(pipeline):
    """Each part's optimizer's `Offload` (building them on first use)."""
    return [optimizer._tfpar_offload  # noqa: SLF001 (tfpar's own)
            for optimizer in pipeline.stage_optimizers]


def run_and_update(pipeline, step):
    """`step()` (a pipeline's device step, returning (anything, each part's
    `step_gradients`)), then each part's host update; returns the step's
    result. The weights the step or anything else wrote reach the host
    copies first (`Offload.device_step`, `Offload.pull_weights`)."""
    offloads = part_offloads(pipeline)
    for offload in offloads:
        step = functools.partial(offload.device_step, step)
    result = step()
    for offload, part_grads in zip(offloads, result[1]):
        offload.pull_weights()
        offload.apply_on_host(part_grads)
    return result


class OffloadCrossHostRunner(cross_host.CrossHostRunner):
    """A `PipelineModel`'s train step under offload when its stages live on
    different hosts (`tfpar.pipeline.cross_host`): after the host-driven
    schedule, each part's "offload" function (on its stage's mesh) hands
    its summed gradients over, laid out like its stored weights, and its
    `Offload` runs the update on its stage's host devices — of its own
    host (`offload_devices`). Every host runs every part's moves and
    update in the same order; on the hosts without that stage they are
    no-ops on stand-ins (`move_blocks`), as the stage's functions are."""

    def __init__(self, pipeline):
        super().__init__(pipeline, "train")

    def _train(self, xs, targets, split, rows):
        def step():
            sums = self._gradient_sums(xs, targets, split, rows)
            return None, [
                self._stage_function("offload", k)(part_sums, factor)
                for k, (part_sums, factor) in enumerate(
                    zip(sums, self._overflow_factors(sums)))]

        run_and_update(self._model, step)

    def _offload_body(self, part, training, sums, factor):
        """Traced: the part's optimizer call records its gradients (the
        `Offload` captures it), which the function returns."""
        offload = part.optimizer._tfpar_offload  # noqa: SLF001 (tfpar's own)
        with offload.capturing() as captured:
            self._apply_body(part, training, sums, factor)
        return offload.step_gradients(captured)


def make_runner(model, extended):
    """The train `Runner` of `model` under an offloading strategy (of a
    `PipelineModel`: `OffloadPipelineRunner`, across hosts
    `OffloadCrossHostRunner`)."""
    if isinstance(model, training.StagedModel):
        if cross_host.spans_hosts(extended):
            return OffloadCrossHostRunner(model)
        return OffloadPipelineRunner(model)
    strategy = extended._container_strategy()  # noqa: SLF001
    return OffloadRunner(model, extended, attach(model.optimizer, strategy))
