"""ParallelStrategy: a tf.distribute.Strategy over a DTensor mesh.

The whole training step runs as one SPMD program on the mesh: inputs are
split along the data axis, weights are laid out by `LayoutRules`, and DTensor
inserts the collectives (gradient all-reduce over the data axis, the
all-reduce after a row-parallel matmul over the model axis). Keras therefore
sees a single replica holding global values: `num_replicas_in_sync` is 1, a
replica-context `all_reduce` returns its input (the value is already global)
and `extended.update(var, fn)` simply calls `fn(var)`.

The options are validated once into a `tfpar.parallel_dims.ParallelDims`
(`strategy.dims`); every variable made in the scope is planned by
`tfpar.layout.plan_specs` and tracked, with its `Placement`, by the
`tfpar.variables.VariableRegistry` (`strategy.extended.registry`).
"""

import gc
import os
import sys
import types
import warnings
import weakref

import tensorflow as tf
from tensorflow.experimental import dtensor

import keras

from tfpar import _compat
from tfpar import collectives
from tfpar import context_parallel
from tfpar import inputs
from tfpar import layout as layout_lib
from tfpar import offload
from tfpar import optimizer_copies
from tfpar import patches
from tfpar import placement
from tfpar import recompute
from tfpar import runners
from tfpar import training
from tfpar import variable_creation
from tfpar import variables as variables_lib
from tfpar import parallel_dims
from tfpar.parallel_dims import ParallelDims
from tfpar.step_context import ReplicaScope
from tfpar.variables import ShardedVariable


def _from_dims(name, doc=None):
    """A read-only property: `self.dims.<name>` (the strategy's
    `ParallelDims`)."""
    return property(lambda self: getattr(self.dims, name), doc=doc)


class ParallelStrategy(tf.distribute.Strategy):
    """Data and tensor parallelism for Keras 3 on one named mesh.

    Example:

    >>> import keras, numpy as np, tfpar
    >>> tfpar.use_virtual_cpus(8)
    >>> strategy = tfpar.ParallelStrategy(
    ...     tfpar.Mesh({"data": 2, "model": 4}),
    ...     rules=tfpar.LayoutRules({
    ...         r".*up/kernel": (None, "model"), r".*up/bias": ("model",),
    ...         r".*down/kernel": ("model", None)}))
    >>> with strategy.scope():
    ...     model = keras.Sequential([
    ...         keras.Input((16,)),
    ...         keras.layers.Dense(64, activation="relu", name="up"),
    ...         keras.layers.Dense(16, name="down")])
    ...     model.compile(optimizer="adam", loss="mse")
    >>> x = np.random.rand(64, 16).astype("float32")
    >>> history = model.fit(x, x, batch_size=16, epochs=2, verbose=0)

    Args:
        mesh: a `tfpar.Mesh`.
        rules: a `tfpar.LayoutRules` (or a plain mapping, converted); None
            replicates every weight.
        data_axis: the mesh axis the batch is split over. A mesh without it
            means no data parallelism.
        pipeline_axis: the mesh axis whose coordinates are pipeline stages
            (see `tfpar.PipelineModel`). Each stage is the sub-mesh of the
            other axes at one coordinate; rules lay weights out within it.
            A mesh without this axis (or with size 1) has one stage.
        fsdp: fully sharded data parallelism (ZeRO-3): every trainable
            weight is also split over the data axis, on the first dimension
            its rule leaves whole and the axis divides, and so are its
            optimizer slots. Each read of a weight in a step gathers it over
            the data axis (once per step for a layer; once per micro-batch
            in a PipelineModel) and its gradient is reduce-scattered, so the
            optimizer updates only the local block: stored weights and
            optimizer state take 1/data of the memory and the optimizer
            1/data of the work. The gathered weights live until the backward
            pass has used them (no re-gather in the backward pass), so a
            step's peak holds every weight whole, unless
            `reshard_after_forward`. Losses and weights equal plain data
            parallelism's.
        reshard_after_forward: under fsdp, free each gathered weight after
            its forward use and gather it again for the backward pass
            (PyTorch FSDP's `reshard_after_forward`; no recomputation of
            the layer): between the passes a device keeps only the stored
            blocks, for one more all-gather per weight read in the backward
            pass (plus a scalar all-reduce that orders it). Default False:
            the gathers of today's fsdp, fewest collectives.
        offload: None, or "optimizer": optimizer slots (and the optimizer's
            counters) live on host devices and the update runs there
            (ZeRO-Offload's split, `tfpar.offload`): each step computes
            the gradients on the mesh, moves each device's gradient block
            to its host device, runs the optimizer there (a compiled
            function on the host mesh, over the host's copy of the
            weights) and moves each updated block back; a device holds no
            optimizer state. Plain models and `PipelineModel`s (each
            stage's optimizer on the host devices of its own devices),
            on one host or several (stages on different hosts included:
            each stage's state on its own host). "optimizer+master":
            under a mixed policy the devices also keep each weight only
            in its compute dtype, its float32 master on the host devices
            (`tfpar.offload.master`; refused under a float32 policy).
        offload_devices: the devices offload keeps the state on, one per
            mesh device in mesh order (device i's blocks go to
            offload_devices[i]), e.g. `[f"CPU:{i}" for i in range(8, 16)]`
            for a mesh on CPU:0-7. None (default): DTensor's host mesh of
            a GPU/TPU mesh; on a CPU mesh, where the devices are the host,
            offload needs them named (an error otherwise), and across
            hosts too: cluster-wide names, each on its mesh device's host.
        per_host_input: with several hosts (`tfpar.connect_hosts`), each
            host feeds only its share of every global batch — the rows of
            the data coordinates its devices hold (host h of H: blocks
            [h D/H, (h+1) D/H) of the data axis of size D) — instead of
            every host reading every global batch. The arrays or dataset a
            host gives `fit`/`evaluate` are then its own samples, batched
            with the per-host batch size (global / H);
            `distribute_datasets_from_function` passes an InputContext with
            `num_input_pipelines=H` and `input_pipeline_id=h`. Hosts check
            at every step that they all have a batch of the same size (a
            clear error otherwise). One host: no effect.
        model_axis: the mesh axis tensor parallelism splits weights over:
            the default axis of the styles (`tfpar.ColumnParallel()`, ...)
            in `rules` and `apply_rules`, and of `tfpar.auto_rules` in this
            scope. A style or `auto_rules` naming another axis is an error
            naming both. A mesh without it: no tensor parallelism by styles.
        virtual_stages: v, model parts per pipeline stage of every
            `tfpar.PipelineModel` made in this scope (see its argument of
            the same name), declared once here; None (default): each
            PipelineModel's own argument (default 1). A PipelineModel
            passing another v is an error naming both.
        expert_axis: the mesh axis mixture-of-experts layers split their
            expert banks over.
        context_axis: the mesh axis long sequences are split over.

    Every mesh axis of size > 1 must play a role: be the data, pipeline,
    model, expert or context axis (by name or as declared above) or be
    named by `rules`; another axis is a ValueError naming it (it would copy
    each tensor, the batch included, to all of its devices).
    """

    def __init__(self, mesh, rules=None, data_axis="data",
                 pipeline_axis="pipe", fsdp=False,
                 reshard_after_forward=False, offload=None,
                 per_host_input=False, model_axis="model",
                 virtual_stages=None, offload_devices=None,
                 expert_axis="expert", context_axis="context"):
        parallel_dims.check_mesh(mesh)
        _compat.ensure_dtensor_device()  # also after an eager context reset
        _install_patches()  # tfpar's Keras/TF hooks, once per process
        dims = ParallelDims(mesh, data_axis, pipeline_axis, fsdp,
                            reshard_after_forward, offload, per_host_input,
                            model_axis, virtual_stages, offload_devices,
                            expert_axis, context_axis)
        # This strategy's own copy (its own usage record), styles bound to
        # the model axis.
        rules = dims.bind_rules({} if rules is None else rules)
        dims.check_roles(rules)
        super().__init__(ParallelExtended(self, dims, rules))
        if len(rules):
            _NEVER_ENTERED.add(self)

    def scope(self):
        """`tf.distribute.Strategy.scope`; a RuntimeError if TF's eager
        context was reset since this strategy was created."""
        self.extended.check_context()
        _NEVER_ENTERED.discard(self)
        return super().scope()

    @property
    def dims(self):
        """The validated `tfpar.parallel_dims.ParallelDims` of this strategy."""
        return self.extended.dims

    mesh = _from_dims("mesh", "The `tfpar.Mesh`.")
    data_axis = _from_dims("data_axis", "The mesh axis splitting the batch.")
    pipeline_axis = _from_dims(
        "pipeline_axis", "The mesh axis whose coordinates are stages.")
    fsdp = _from_dims(
        "fsdp", "Whether trainable weights are also split over the data axis.")
    reshard_after_forward = _from_dims(
        "reshard_after_forward", "Whether fsdp's gathered weights are "
        "gathered again for the backward pass instead of being kept from "
        "the forward pass.")
    model_axis = _from_dims(
        "model_axis", "The mesh axis tensor-parallel styles split over.")
    expert_axis = _from_dims(
        "expert_axis", "The mesh axis expert banks are split over.")
    context_axis = _from_dims(
        "context_axis", "The mesh axis sequences are split over.")
    offload = _from_dims(
        "offload", "None, \"optimizer\" (optimizer state on the host) or "
        "\"optimizer+master\" (the float32 weights too).")
    virtual_stages = _from_dims(
        "virtual_stages", "Model parts per pipeline stage as declared, or "
        "None (each PipelineModel's own argument).")
    num_stages = _from_dims(
        "num_stages",
        "Pipeline stages: the size of the pipeline axis (1 without one).")
    data_parallel_size = _from_dims(
        "data_parallel_size",
        "How many ways the batch is split (the data axis size, or 1).")

    @property
    def rules(self):
        return self.extended.rules

    @property
    def stage_meshes(self):
        """The sub-mesh of every pipeline stage ([mesh] without a pipeline)."""
        return list(self.dims.stage_meshes)

    def variables(self):
        """[(path, variable)] of every live variable created in scope."""
        return self.extended.registry.tracked_variables()

    def apply_rules(self, model, rules):
        """Re-lays out the weights of a model built in this scope by `rules`.

        For plans computed from the built model, e.g. `tfpar.auto_rules`.
        Must run before the optimizer is built (compile/fit build it later).
        Every rule must match a weight of `model`.
        """
        self.extended.registry.apply_rules(model, rules)

    def placements(self, kind=None):
        """[(path, spec, per-device block shape)] of live variables.

        `kind` filters by "params", "optimizer" or "other" (see
        `memory_per_device`); None lists all.
        """
        return self.extended.registry.placements(kind)

    def memory_per_device(self):
        """Bytes of variables held by each device, split by kind.

        Returns a dict {device name: {"params": bytes, "optimizer": bytes,
        "other": bytes}}: "params" are trainable weights, "optimizer" the
        optimizer slots made for them (e.g. Adam moments, laid out like their
        weight), "other" every other variable (non-trainable state such as
        BatchNormalization statistics, optimizer counters, metrics).
        Only live variables count: garbage is collected first (a Keras
        model no longer referenced keeps its variables until Python's
        cycle collector runs, as Keras models hold reference cycles).
        """
        gc.collect()
        return self.extended.registry.memory_per_device()


class ParallelExtended(_compat.StrategyExtendedV2):
    """The tf.distribute contract of `ParallelStrategy` (see the module
    docstring): the variable creator hook (planned and tracked by its
    `registry`, a `tfpar.variables.VariableRegistry`), the identity
    reductions of one SPMD replica, replica contexts and input
    distribution."""

    def __init__(self, container_strategy, dims, rules):
        super().__init__(container_strategy)
        self.dims = dims
        self.rules = rules
        self.input_placer = inputs.InputPlacer(
            dims.mesh, dims.data_axis,
            per_host=dims.per_host_input and dtensor.num_clients() > 1,
            context=context_parallel.split_of(dims.mesh, dims.context_axis))
        if self.input_placer.per_host:
            patches.count_array_batches()
        self.registry = variables_lib.VariableRegistry(self)
        self._context = _compat.eager_context_token()

    # The exchange of split dimensions over a mesh axis, for the patches of
    # modules below `collectives` (context parallelism's Ulysses moves).
    all_to_all = staticmethod(collectives.all_to_all)

    mesh = _from_dims("mesh")
    data_axis = _from_dims("data_axis")
    pipeline_axis = _from_dims("pipeline_axis")
    fsdp = _from_dims("fsdp")
    reshard_after_forward = _from_dims("reshard_after_forward")
    stage_meshes = _from_dims("stage_meshes")
    real_all_gathers = _from_dims("real_all_gathers")

    def check_context(self):
        """Raises if TF's eager context was reset since this strategy was
        created: its variables and compiled steps went with that context."""
        if self._context is not _compat.eager_context_token():
            raise RuntimeError(
                f"This ParallelStrategy on {self.mesh!r} belongs to a reset "
                "TensorFlow context: the eager context was reset (e.g. by "
                "context._reset_context() in a TF/Keras/DTensor test class) "
                "after it was created, and its variables went with it. "
                "Create a new ParallelStrategy, and the model in its scope, "
                "after the reset.")

    # -- variables -----------------------------------------------------------

    def _create_variable(self, next_creator, **kwargs):
        # DTensor variables replace the default creator, except for weights
        # waiting on the host for their pipeline stage (`placement_mesh`).
        colocate_with = kwargs.pop("colocate_with", None)
        for unsupported in ("use_resource", "expected_shape", "caching_device"):
            kwargs.pop(unsupported, None)
        keras_variable = variable_creation.keras_variable_being_created()
        if keras_variable is not None:
            path = keras_variable.path
        else:
            name = kwargs.get("name") or "Variable"
            scope = tf.get_current_name_scope()
            path = f"{scope}/{name}" if scope else name
        initial_value = kwargs.pop("initial_value")
        dtype = kwargs.get("dtype")
        deferred = (None if colocate_with is not None or
                    self.registry.placement_mesh is None else
                    variable_creation.deferred_value(initial_value, dtype))
        if deferred is not None:  # blocks allocated unwritten: to be loaded
            return self.registry.create(path, deferred, None, kwargs,
                                        next_creator)
        with tf.init_scope(), tf.device("CPU:0"):
            if callable(initial_value):
                initial_value = initial_value()
            if not dtensor.is_dtensor(initial_value):
                initial_value = tf.convert_to_tensor(initial_value, dtype=dtype)
        return self.registry.create(path, initial_value, colocate_with,
                                    kwargs, next_creator)

    # -- running the step ----------------------------------------------------

    def replica_scope(self):
        """Enters the strategy scope and its single SPMD replica context."""
        self.check_context()
        self.registry.check_rules_used()
        return ReplicaScope(self._container_strategy())


    def replicate(self, value):
        """`value` relaid out so that every device holds all of it (every
        device of the pipeline stage whose step is being traced)."""
        if not isinstance(value, tf.Tensor) or (
                tf.executing_eagerly() and not dtensor.is_dtensor(value)):
            return value
        rank = value.shape.rank
        return placement.relayout(value, layout_lib.replicated_spec(rank),
                                  self.registry.placement_mesh or self.mesh)

    def _call_for_each_replica(self, fn, args, kwargs):
        if tf.executing_eagerly():
            args, kwargs = self.input_placer.place_arrays((args, kwargs or {}))
        with self.replica_scope():
            return fn(*args, **(kwargs or {}))

    def call_for_each_replica(self, fn, args=(), kwargs=None):
        _compat.require_cross_replica_or_default_context(self)
        return self._call_for_each_replica(fn, args, kwargs)  # enters scope

    def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
        # One SPMD replica: the value already is the global value.
        return value

    def _reduce_to(self, reduce_op, value, destinations, options):
        return value

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        return [v for v, _ in value_destination_pairs]

    def _gather_to_implementation(self, value, destinations, axis, options):
        return value

    def _broadcast_to(self, tensor, destinations):
        return tensor

    def _update(self, var, fn, args, kwargs, group):
        return fn(var, *args, **(kwargs or {}))

    def _update_non_slot(self, colocate_with, fn, args, kwargs, group):
        return fn(*args, **(kwargs or {}))

    def _local_results(self, val):
        return (val,)

    def value_container(self, value):
        return value

    def read_var(self, var):
        return tf.identity(var)

    def _use_merge_call(self):
        return False

    @property
    def _num_replicas_in_sync(self):
        return 1

    @property
    def worker_devices(self):
        return self.mesh.devices

    @property
    def parameter_devices(self):
        return self.mesh.devices

    def _in_multi_worker_mode(self):
        return False

    def non_slot_devices(self, var_list):
        return self.mesh.devices

    def _get_local_replica_id(self, replica_id_in_sync_group):
        return replica_id_in_sync_group

    @property
    def experimental_between_graph(self):
        return False

    @property
    def experimental_should_init(self):
        return True

    @property
    def should_checkpoint(self):
        return True

    @property
    def should_save_summary(self):
        return True

    # -- inputs --------------------------------------------------------------

    def _experimental_distribute_dataset(self, dataset, options):
        return inputs.DistributedBatches(dataset, self.input_placer)

    def _distribute_datasets_from_function(self, dataset_fn, options):
        hosts = dtensor.num_clients() if self.input_placer.per_host else 1
        context = tf.distribute.InputContext(
            num_input_pipelines=hosts,
            input_pipeline_id=dtensor.client_id() if hosts > 1 else 0,
            num_replicas_in_sync=1)
        return inputs.DistributedBatches(dataset_fn(context), self.input_placer)

    def _experimental_distribute_values_from_function(self, value_fn):
        return value_fn(tf.distribute.experimental.ValueContext(0, 1))

    def _make_dataset_iterator(self, dataset):
        raise RuntimeError(
            "make_dataset_iterator is a TF1 API; use "
            "strategy.experimental_distribute_dataset(dataset) instead."
        )

    def _make_input_fn_iterator(self, input_fn, replication_mode):
        raise RuntimeError(
            "make_input_fn_iterator is a TF1 API; use "
            "strategy.distribute_datasets_from_function(fn) instead."
        )

    # -- what a step runs on: the runner, the optimizer's state ----------------

    def make_runner(self, model, mode):
        """The `tfpar.training.Runner` of `model`'s Keras step `mode`
        ("train", "test", "predict"), from the table of step runners
        (`tfpar.runners.RUNNERS`)."""
        return runners.make_runner(model, self, mode)

    def place_optimizer_state(self, optimizer, mesh=None):
        """Where (unbuilt) `optimizer` of the weights on `mesh` (the mesh,
        or a pipeline stage's) keeps its state: under offload="optimizer"
        its host devices (`tfpar.offload.attach`), else beside the weights
        (nothing to do)."""
        if self.dims.offload is not None:
            offload.attach(optimizer, self._container_strategy(), mesh)


def adopt_optimizer(model, strategy):
    """Makes sure `model.optimizer` was created under `strategy` (its
    `compile` calls this).

    Keras' TF optimizer remembers the strategy current at construction and
    creates its `iterations` and `learning_rate` variables right away. One
    built outside `strategy.scope()` therefore cannot train under it (Keras
    fails with "Mixing different tf.distribute.Strategy objects"). While it
    has no slots yet, an equal optimizer is rebuilt from its config under the
    scope (with its weight-decay exclusions, which the config does not
    hold: `optimizer_copies.copy_optimizer`) and becomes `model.optimizer`.
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or _compat.optimizer_strategy(optimizer) in (
            None, strategy):
        return
    if optimizer.built:
        raise ValueError(
            f"The optimizer {optimizer.name!r} was created and built outside "
            "the strategy's scope. Received: an optimizer bound to "
            f"{type(_compat.optimizer_strategy(optimizer)).__name__}. Create "
            "it inside `with strategy.scope():` or pass its name to compile()."
        )
    try:
        with strategy.scope():
            model.optimizer = optimizer_copies.copy_optimizer(optimizer)
    except Exception as error:  # noqa: BLE001 (any failure: explain how to fix)
        raise ValueError(
            f"The optimizer {optimizer.name!r} was created outside the "
            "strategy's scope and could not be rebuilt from its config "
            f"({error}). Create it inside `with strategy.scope():`."
        ) from error


def _adopt_and_offload(model, strategy):
    """`adopt_optimizer`, then (offload="optimizer") hands the optimizer's
    state to the host devices before anything builds it (`tfpar.offload`)."""
    adopt_optimizer(model, strategy)
    if not isinstance(model, training.StagedModel):  # (per part instead)
        strategy.extended.place_optimizer_state(
            getattr(model, "optimizer", None))


def ema_optimizers(model):
    """[(optimizer, written)]: the optimizers with moving averages of
    `model`'s weights (`use_ema=True`), for Keras' `SwapEMAWeights`
    (`patches`), each with what moves a swap's writes to the devices:
    every stage's optimizer of a pipeline and the optimizers each
    delegates to; an offloaded one swaps host copies of the weights, which
    `Offload.write_back_all` then writes into them. None for a model of no
    ParallelStrategy (Keras' own swap)."""
    if not isinstance(strategy_of_layer(model), ParallelStrategy):
        return None
    staged = isinstance(model, training.StagedModel)
    found = []
    for optimizer in model.stage_optimizers if staged else [model.optimizer]:
        host = offload.offload_of(optimizer)
        written = host.write_back_all if host is not None else _nothing
        found.extend((inner, written)
                     for inner in optimizer_copies.with_delegates(optimizer)
                     if getattr(inner, "use_ema", False))
    return found


def _nothing():
    """What follows a swap of weights on the devices themselves."""


# Strategies with rules whose scope was never entered: a model trained
# outside them ignores their rules (`warn_if_never_entered`).
_NEVER_ENTERED = weakref.WeakSet()
# The libraries between a user's `fit` and tfpar's warnings about it.
_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep
    for path in (keras.__file__, tf.__file__, __file__))


def _user_stacklevel():
    """`warnings.warn`'s stacklevel (for a call made by this function's
    caller) of the first frame outside keras, TensorFlow and tfpar: the
    user's line that started it."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(
            _LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def warn_if_never_entered(model):
    """Warns, once per strategy, when `model` (of no ParallelStrategy)
    starts training while a ParallelStrategy exists whose scope was never
    entered and whose rules match a weight of `model`: the model was most
    likely meant to be built in it, and trains on one device (or under
    another strategy) with those rules ignored."""
    for strategy in list(_NEVER_ENTERED):
        matched = next((strategy.rules.pattern_for(weight.path)
                        for weight in model.weights
                        if strategy.rules.pattern_for(weight.path)), None)
        if matched is None:
            continue  # its rules are for another model
        _NEVER_ENTERED.discard(strategy)
        warnings.warn(
            f"Model {model.name!r} trains without tfpar (on one device, or "
            "under another tf.distribute strategy): it was built outside "
            "every tfpar.ParallelStrategy, while a ParallelStrategy on mesh "
            f"{strategy.mesh.shape} whose layout rules match its weights "
            f"(e.g. {matched!r}) was made and its scope never entered, so "
            "its rules lay out nothing. Build and compile the model inside "
            "`with strategy.scope():`.", UserWarning,
            stacklevel=_user_stacklevel())


def compat_hooks():
    """What tfpar's patches of Keras ask the strategy (their `hooks`, see
    `tfpar.patches`), in one place: whether a strategy is tfpar's, whether
    a graph is traced under one, and the functions the routed Keras entry
    points call."""

    def owns(candidate):
        return isinstance(candidate, ParallelStrategy)

    return types.SimpleNamespace(
        function_for=keras_function_for,
        eager_call=training.eager_model_call,
        owns=owns,
        in_graph_step=lambda: not tf.executing_eagerly() and owns(
            tf.distribute.get_strategy()),
        strategy_of_layer=strategy_of_layer,
        adopt_optimizer=_adopt_and_offload,
        ema_optimizers=ema_optimizers,
        warn_if_never_entered=warn_if_never_entered,
        place_host_gradients=place_host_gradients)


def _install_patches():
    """The strategy's patches (`tfpar.patches`) and recomputation's
    (`tfpar.recompute`); once per process."""
    patches.install(compat_hooks())
    recompute.install()


def place_host_gradients(optimizer, grads, targets):
    """`grads` for `optimizer.apply` (`patches`' host-gradient patch):
    each one computed on the host laid out like its variable, when the
    optimizer was made under a ParallelStrategy and runs eagerly; else
    `grads` unchanged.

    The tf.distribute contract Keras' own tests use: in the scope, eagerly
    (`strategy.run(fn)` or plain code), `optimizer.apply_gradients` with
    gradients computed on the host (tf.constant, numpy). DTensor ops do not
    mix a DTensor variable with a regular tensor, so each such gradient is
    given every device (replicated) and relaid out to its variable's
    layout: one SPMD replica, the gradient is the global gradient (as
    single-device Keras; MirroredStrategy would sum one per replica).
    Gradients that are DTensors already (a compiled step's) pass as they
    are.
    """
    strategy = getattr(optimizer, "_distribution_strategy", None)
    if not isinstance(strategy, ParallelStrategy) or not tf.executing_eagerly():
        return grads
    grads, targets = list(grads), list(targets or ())
    if len(grads) != len(targets):
        return grads
    return [_like_variable(g, v) for g, v in zip(grads, targets)]


def _like_variable(gradient, variable):
    """Host `gradient` laid out like DTensor `variable` (else unchanged)."""
    backing = _compat.backing_variable(variable)
    if (gradient is None or isinstance(gradient, tf.IndexedSlices)
            or dtensor.is_dtensor(gradient)
            or not isinstance(backing, _compat.DVariable)):
        return gradient
    layout = dtensor.fetch_layout(backing)
    value = tf.convert_to_tensor(gradient)
    local = layout.mesh.local_device_ids()
    if not local:   # another host's pipeline stage: it holds none of it
        return placement.stand_in(layout, value.shape, value.dtype)
    replicated = dtensor.Layout.replicated(layout.mesh, value.shape.rank)
    return dtensor.relayout(dtensor.pack([value] * len(local), replicated),
                            layout)


def keras_function_for(model, mode):
    """`training.keras_function` under the strategy `model` belongs to; None
    (Keras' own function) for a model of no ParallelStrategy."""
    strategy = model.distribute_strategy
    if not isinstance(strategy, ParallelStrategy):
        # e.g. keras.Model(model.inputs, model.get_layer(...).output) made
        # outside the scope from layers whose weights live on a mesh.
        strategy = owning_strategy(model)
    if strategy is None:
        return None
    return training.keras_function(strategy.extended, model, mode)


def owning_strategy(model):
    """The ParallelStrategy that made `model`'s weights, or None."""
    for weight in model.weights:
        backing = _compat.backing_variable(weight)
        if isinstance(backing, ShardedVariable):
            extended = backing._tfpar_extended()  # noqa: SLF001
            return None if extended is None else extended._container_strategy()  # noqa: SLF001
    return None


def strategy_of_layer(owner):
    """The ParallelStrategy that made the weights of Keras layer `owner`,
    or None (not a layer, or weights not on a mesh)."""
    if not isinstance(owner, keras.layers.Layer):
        return None
    return owning_strategy(owner)
