"""ParallelStrategy: a tf.distribute.Strategy over a DTensor mesh.

The whole training step runs as one SPMD program on the mesh: inputs are
split along the data axis, weights are laid out by `LayoutRules`, and DTensor
inserts the collectives (gradient all-reduce over the data axis, the
all-reduce after a row-parallel matmul over the model axis). Keras therefore
sees a single replica holding global values: `num_replicas_in_sync` is 1, a
replica-context `all_reduce` returns its input (the value is already global)
and `extended.update(var, fn)` simply calls `fn(var)`.
"""

import collections
import contextlib
import difflib
import gc
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import _compat
from tfpar import collectives
from tfpar import inputs
from tfpar import layout as layout_lib
from tfpar import placement
from tfpar import styles
from tfpar.mesh import Mesh


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
        offload: None, or "optimizer" (optimizer slots and their update in
            host memory) / "optimizer+master" (also the fp32 master weights
            of mixed precision). Not available yet: on a mesh of CPU
            devices there is no separate host (DTensor's host mesh of a CPU
            mesh is the mesh itself), and on TF 2.21 DTensor cannot move a
            sharded value to another mesh inside a step
            (tests/dtensor_offload_repro.py); both raise before training.
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
    """

    def __init__(self, mesh, rules=None, data_axis="data",
                 pipeline_axis="pipe", fsdp=False,
                 reshard_after_forward=False, offload=None,
                 per_host_input=False):
        if not isinstance(mesh, Mesh):
            raise TypeError(
                "ParallelStrategy(mesh) needs a tfpar.Mesh, e.g. "
                "tfpar.Mesh({'data': 2, 'model': 4}). "
                f"Received: mesh={mesh!r} of type {type(mesh).__name__}"
            )
        _compat.ensure_dtensor_device()  # also after an eager context reset
        _compat.install()  # tfpar's Keras/TF hooks, once per process
        if rules is None:
            rules = {}
        elif isinstance(rules, layout_lib.LayoutRules):
            rules = dict(rules.items())  # this strategy's own usage record
        rules = layout_lib.LayoutRules(rules)
        if not isinstance(data_axis, str):
            raise TypeError(
                "ParallelStrategy(data_axis) needs a mesh axis name (str). "
                f"Received: data_axis={data_axis!r}"
            )
        if not isinstance(pipeline_axis, str):
            raise TypeError(
                "ParallelStrategy(pipeline_axis) needs a mesh axis name (str). "
                f"Received: pipeline_axis={pipeline_axis!r}"
            )
        if pipeline_axis == data_axis:
            raise ValueError(
                "ParallelStrategy needs different data and pipeline axes. "
                f"Received: data_axis={data_axis!r}, "
                f"pipeline_axis={pipeline_axis!r}"
            )
        if not isinstance(fsdp, bool):
            raise TypeError(
                "ParallelStrategy(fsdp) needs True or False. "
                f"Received: fsdp={fsdp!r}"
            )
        if fsdp and mesh.axis_size(data_axis) == 1:
            raise ValueError(
                "ParallelStrategy(fsdp=True) shards weights over the data "
                f"axis {data_axis!r}, which this mesh lacks or has of size 1. "
                f"Received: mesh={mesh!r}, data_axis={data_axis!r}. Add a "
                "data axis of size > 1 or leave fsdp=False."
            )
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(
                "ParallelStrategy(reshard_after_forward) needs True or False. "
                f"Received: reshard_after_forward={reshard_after_forward!r}"
            )
        if reshard_after_forward and not fsdp:
            raise ValueError(
                "ParallelStrategy(reshard_after_forward=True) frees the "
                "weights fsdp gathers, so it needs fsdp=True. Received: "
                "fsdp=False. Pass fsdp=True too, or drop "
                "reshard_after_forward."
            )
        if not isinstance(per_host_input, bool):
            raise TypeError(
                "ParallelStrategy(per_host_input) needs True or False. "
                f"Received: per_host_input={per_host_input!r}"
            )
        _check_offload(offload, mesh)
        _check_axes(rules, mesh, pipeline_axis)
        super().__init__(ParallelExtended(self, mesh, rules, data_axis,
                                          pipeline_axis, fsdp, per_host_input))
        self.extended.reshard_after_forward = reshard_after_forward

    def scope(self):
        """`tf.distribute.Strategy.scope`; a RuntimeError if TF's eager
        context was reset since this strategy was created."""
        self.extended.check_context()
        return super().scope()

    @property
    def mesh(self):
        return self.extended.mesh

    @property
    def rules(self):
        return self.extended.rules

    @property
    def data_axis(self):
        return self.extended.data_axis

    @property
    def pipeline_axis(self):
        return self.extended.pipeline_axis

    @property
    def fsdp(self):
        """Whether trainable weights are also split over the data axis."""
        return self.extended.fsdp

    @property
    def reshard_after_forward(self):
        """Whether fsdp's gathered weights are gathered again for the
        backward pass instead of being kept from the forward pass."""
        return self.extended.reshard_after_forward

    @property
    def num_stages(self):
        """Pipeline stages: the size of the pipeline axis (1 without one)."""
        return len(self.extended.stage_meshes)

    @property
    def stage_meshes(self):
        """The sub-mesh of every pipeline stage ([mesh] without a pipeline)."""
        return list(self.extended.stage_meshes)

    @property
    def data_parallel_size(self):
        """How many ways the batch is split (the data axis size, or 1)."""
        return self.mesh.axis_size(self.data_axis)

    def variables(self):
        """[(path, variable)] of every live variable created in scope."""
        return self.extended.tracked_variables()

    def apply_rules(self, model, rules):
        """Re-lays out the weights of a model built in this scope by `rules`.

        For plans computed from the built model, e.g. `tfpar.auto_rules`.
        Must run before the optimizer is built (compile/fit build it later).
        Every rule must match a weight of `model`.
        """
        self.extended.apply_rules(model, rules)

    def placements(self, kind=None):
        """[(path, spec, per-device block shape)] of live variables.

        `kind` filters by "params", "optimizer" or "other" (see
        `memory_per_device`); None lists all.
        """
        return self.extended.placements(kind)

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
        return self.extended.memory_per_device()


OFFLOAD_OPTIONS = (None, "optimizer", "optimizer+master")


def _check_offload(offload, mesh):
    """Refuses `offload` values, and offload where it cannot be done."""
    if offload not in OFFLOAD_OPTIONS:
        raise ValueError(
            "ParallelStrategy(offload) is one of "
            f"{list(OFFLOAD_OPTIONS)}. Received: offload={offload!r}")
    if offload is None:
        return
    if mesh.device_type == "CPU":
        raise ValueError(
            f"ParallelStrategy(offload={offload!r}) moves optimizer state "
            "from the devices to the host, but this mesh's devices are "
            "the host's CPUs (DTensor's host mesh of a CPU mesh is the mesh "
            f"itself), so there is nothing to offload to. Received: "
            f"mesh={mesh!r}. Use offload=None on CPU meshes; fsdp=True "
            "splits optimizer state over the data axis instead.")
    raise NotImplementedError(
        f"ParallelStrategy(offload={offload!r}) is not implemented: DTensor "
        "2.21 cannot copy a sharded value to the host mesh inside a step "
        "(copy_to_mesh needs a replicated value, i.e. every device holding "
        "the whole optimizer state; tests/dtensor_offload_repro.py). "
        f"Received: a {mesh.device_type} mesh {mesh!r}. Use offload=None; "
        "fsdp=True splits optimizer state over the data axis.")


def _nearest(pattern, paths, count=12):
    """Up to `count` of `paths`, the most similar to `pattern` first."""
    return difflib.get_close_matches(pattern, sorted(paths), n=count,
                                     cutoff=0.0)


def _check_axes(rules, mesh, pipeline_axis):
    for axis, pattern in rules.axes_used().items():
        if axis == pipeline_axis and mesh.axis_size(axis) > 1:
            raise ValueError(
                f"Layout rule {pattern!r} shards over the pipeline axis "
                f"{axis!r}. Pipeline stages own whole layers, so rules may "
                "only name the other axes "
                f"{[a for a in mesh.axis_names if a != axis]}. Received: "
                f"rule {pattern!r}."
            )
        if axis not in mesh.shape:
            raise ValueError(
                f"Layout rule {pattern!r} names mesh axis {axis!r}, which "
                f"the mesh lacks. Received: mesh axes {mesh.axis_names}. "
                "Use one of the mesh's axis names or add that axis."
            )


def _owning_layers(model):
    """{id(weight): the innermost layer that owns it}."""
    owners = {}
    for layer in _compat.all_layers(model):
        for weight in layer.weights:
            owners[id(weight)] = layer  # inner layers come later: they win
    return owners


class _VariableInfo(
    collections.namedtuple("_VariableInfo",
                           "path spec kind ref mesh compute_spec")
):
    """What the strategy knows of a variable it created: its stored spec,
    on which (sub-)mesh it lives (None: the host), and the spec steps
    compute with (differs from `spec` only under fsdp)."""


class ShardedVariable(_compat.DVariable):
    """A DTensor variable that accepts host values like a plain tf.Variable.

    Keras' `set_weights`, `load_weights` and optimizers assign plain tensors
    and read back numpy; a bare DVariable only takes DTensors and cannot turn
    a sharded value into numpy. This subclass puts host values on the mesh
    with the variable's own layout and assembles numpy from the shards.

    Under `fsdp`, or when its rule splits it over the data axis, a weight
    is stored split over the data axis
    (`tfpar_spec`) but computed with whole (`tfpar_compute_spec`): each read
    in a step gathers it, and the gradient of that gather is a
    reduce-scatter back to the stored blocks. Optimizer updates read the
    stored blocks. Row look-ups (`sparse_read`/`gather_nd`, i.e. `tf.gather`
    of the variable) in a table split by rows over the data axis (by fsdp
    or a rule) are a GatherV2 of the stored blocks, inside a step or not:
    DTensor 2.21 has no ResourceGather from such a table.
    """

    def __init__(self, *args, tfpar_extended, tfpar_spec, tfpar_mesh,
                 tfpar_compute_spec=None, tfpar_split_rows=False, **kwargs):
        self._tfpar_extended = weakref.ref(tfpar_extended)
        self._tfpar_spec = tfpar_spec
        self._tfpar_mesh = tfpar_mesh
        self._tfpar_compute_spec = tfpar_compute_spec
        self._tfpar_split_rows = tfpar_split_rows
        super().__init__(*args, **kwargs)

    def _read_variable_op(self, no_copy=False):
        value = super()._read_variable_op(no_copy=no_copy)
        # In a step's replica context; optimizer updates run in the
        # cross-replica context (extended.update's merge_call).
        if (self._tfpar_compute_spec is not None
                and not tf.executing_eagerly() and in_spmd_step()):
            from tfpar import recompute  # noqa: PLC0415 (its import hooks Keras)

            again = recompute.recompute_dependency()
            extended = self._tfpar_extended()
            reshard = (again is None and extended is not None
                       and extended.reshard_after_forward)
            if again is not None:  # recomputing: a new gather, not the old
                value = value + tf.cast(again, value.dtype)
            value = collectives.gather_from_fsdp_shards(
                value, self._tfpar_compute_spec, self._tfpar_mesh, reshard)
        return value

    def _stored_value(self):
        return super()._read_variable_op()

    def sparse_read(self, indices, name=None):
        if self._tfpar_split_rows:
            return tf.gather(self._stored_value(), indices, name=name)
        return super().sparse_read(indices, name=name)

    def gather_nd(self, indices, name=None):
        if self._tfpar_split_rows:
            return tf.gather_nd(self._stored_value(), indices, name=name)
        return super().gather_nd(indices, name=name)

    def _on_mesh(self, value):
        """`value` laid out like this variable (eager values only)."""
        if not tf.executing_eagerly():
            return value  # inside a DTensor function: DTensor lays it out
        if isinstance(value, tf.Variable):
            value = value.read_value()
        if not dtensor.is_dtensor(value):
            # From this host (set_weights): host 0's value on every host.
            value = placement.same_on_every_host(value)
        else:
            layout = dtensor.fetch_layout(value)
            if layout == dtensor.fetch_layout(self):
                return value  # already laid out like this variable
            if layout.mesh != self._tfpar_mesh.dtensor_mesh:
                value = placement.fetch(value)  # another mesh: via the host
        return placement.put(value, self._tfpar_spec, self._tfpar_mesh,
                             dtype=self.dtype)

    def assign(self, value, use_locking=None, name=None, read_value=True):
        return super().assign(self._on_mesh(value), use_locking, name,
                              read_value)

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        return super().assign_add(self._on_mesh(delta), use_locking, name,
                                  read_value)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        return super().assign_sub(self._on_mesh(delta), use_locking, name,
                                  read_value)

    # Sparse updates. Keras' TF optimizers apply a sparse gradient
    # (IndexedSlices: the rows an Embedding or tf.gather looked up) with
    # scatter ops, which DTensor 2.21 cannot lay out ("'tf.ResourceScatterSub'
    # op does not implement layout propagation"): plain SGD, Adagrad,
    # Adadelta, RMSprop and Adafactor failed on every mesh. Each is the same
    # update written with ops DTensor lays out: scatter_add/sub sum the
    # slices into rows, D_i = sum_{j: idx_j = i} v_j (an UnsortedSegmentSum;
    # repeated rows add, as ResourceScatterAdd/Sub do), then var += D or
    # var -= D; scatter_update writes the slices into the value
    # (TensorScatterUpdate; of repeated rows one wins, as in TF).

    def _summed_rows(self, sparse_delta):
        values = tf.convert_to_tensor(sparse_delta.values, self.dtype)
        return tf.math.unsorted_segment_sum(values, sparse_delta.indices,
                                            self.shape[0])

    @tf.autograph.experimental.do_not_convert  # zero-argument super()
    def scatter_add(self, sparse_delta, use_locking=False, name=None):
        return self.assign_add(self._summed_rows(sparse_delta), name=name)

    @tf.autograph.experimental.do_not_convert  # zero-argument super()
    def scatter_sub(self, sparse_delta, use_locking=False, name=None):
        return self.assign_sub(self._summed_rows(sparse_delta), name=name)

    @tf.autograph.experimental.do_not_convert  # zero-argument super()
    def scatter_update(self, sparse_delta, use_locking=False, name=None):
        values = tf.convert_to_tensor(sparse_delta.values, self.dtype)
        return self.assign(tf.tensor_scatter_nd_update(
            self.read_value(), sparse_delta.indices[:, None], values),
            name=name)

    def numpy(self):
        return placement.fetch(self.read_value())

    def __array__(self, dtype=None, copy=None):
        value = self.numpy()
        return value if dtype is None else value.astype(dtype)


class ParallelExtended(_compat.StrategyExtendedV2):
    """The machinery behind `ParallelStrategy` (see the module docstring)."""

    def __init__(self, container_strategy, mesh, rules, data_axis,
                 pipeline_axis, fsdp=False, per_host_input=False):
        super().__init__(container_strategy)
        self.mesh = mesh
        self.rules = rules
        self.data_axis = data_axis
        self.pipeline_axis = pipeline_axis
        self.fsdp = fsdp
        self.reshard_after_forward = False
        stages = mesh.axis_size(pipeline_axis)
        self.stage_meshes = ([mesh] if stages == 1 else
                             [mesh.submesh(pipeline_axis, s)
                              for s in range(stages)])
        self.input_placer = inputs.InputPlacer(
            mesh, data_axis, per_host=per_host_input and dtensor.num_clients() > 1)
        if self.input_placer.per_host:
            _compat.count_array_batches()
        self._variables = {}  # id(variable) -> _VariableInfo, live ones only
        self._rules_checked = False
        self._weight_paths = set()  # paths of model weights (for errors)
        self._placing = []  # stack of meshes new variables go to
        self._context = _compat.eager_context_token()

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

    @contextlib.contextmanager
    def placing_on(self, mesh):
        """New variables (other than optimizer slots, which follow their
        weight) are created on `mesh`, a pipeline stage's sub-mesh."""
        self._placing.append(mesh)
        try:
            yield mesh
        finally:
            self._placing.pop()

    @property
    def placement_mesh(self):
        """Where a new variable goes: the innermost `placing_on` mesh, else
        the whole mesh; None (the host) on a pipeline mesh, where a model's
        weights wait for `PipelineModel` to put each on its stage."""
        if self._placing:
            return self._placing[-1]
        return self.mesh if len(self.stage_meshes) == 1 else None

    # -- variables -----------------------------------------------------------

    def _create_variable(self, next_creator, **kwargs):
        # DTensor variables replace the default creator, except for weights
        # waiting on the host for their pipeline stage (`placement_mesh`).
        colocate_with = kwargs.pop("colocate_with", None)
        for unsupported in ("use_resource", "expected_shape", "caching_device"):
            kwargs.pop(unsupported, None)
        keras_variable = _compat.keras_variable_being_created()
        if keras_variable is not None:
            path = keras_variable.path
        else:
            name = kwargs.get("name") or "Variable"
            scope = tf.get_current_name_scope()
            path = f"{scope}/{name}" if scope else name
        initial_value = kwargs.pop("initial_value")
        dtype = kwargs.get("dtype")
        with tf.init_scope(), tf.device("CPU:0"):
            if callable(initial_value):
                initial_value = initial_value()
            if not dtensor.is_dtensor(initial_value):
                initial_value = tf.convert_to_tensor(initial_value, dtype=dtype)
        return self._new_variable(path, initial_value, colocate_with, kwargs,
                                  next_creator)

    def _new_variable(self, path, initial_value, colocate_with, kwargs,
                      host_creator=None):
        shape = initial_value.shape.as_list()
        reference = (None if colocate_with is None
                     else self._info_of(colocate_with))
        mesh = self.placement_mesh if reference is None else reference.mesh
        spec, kind = self._spec_for(
            path, shape, colocate_with, kwargs.get("trainable", True),
            _compat.keras_layer_adding_weight(),
            mesh=mesh or self.stage_meshes[0])
        spec, compute_spec = self._fsdp_specs(spec, kind, shape)
        if _compat.keras_layer_adding_weight() is not None:
            self._weight_paths.add(path)  # a layer's weight, not state
        with tf.init_scope():  # also when first built inside a tf.function
            if mesh is None:  # on the host until PipelineModel places it
                with tf.device("CPU:0"):
                    variable = host_creator(initial_value=initial_value,
                                            **kwargs)
                return self._track(variable, path, spec, kind, None,
                                   compute_spec)
            value = placement.put(
                placement.same_on_every_host(initial_value), spec, mesh,
                dtype=kwargs.get("dtype"))
            return self._register(path, spec, kind, value, kwargs, mesh,
                                  compute_spec)

    def _fsdp_specs(self, spec, kind, shape):
        """(stored spec, compute spec) of a variable its rules lay out by
        `spec`: under fsdp a trainable weight is stored split over the data
        axis too, and gathered where a step reads it. In a step the data
        axis splits the batch, so a variable whose rule itself splits it
        over the data axis (e.g. keras-hub's 2-D layout maps, weights split
        over "batch" and "model") is computed with whole over that axis
        too, by the same gather: a Dense kernel (in, out) ruled
        ("data", "model") is stored so and computed as (None, "model")."""
        compute = spec
        if kind != "optimizer" and self.mesh.axis_size(self.data_axis) > 1:
            compute = tuple(None if axis == self.data_axis else axis
                            for axis in spec)
        if not self.fsdp or kind != "params":
            return spec, compute
        return layout_lib.fully_sharded_spec(spec, shape, self.data_axis,
                                             self.mesh), compute

    def _register(self, path, spec, kind, value, kwargs, mesh,
                  compute_spec=None):
        """A ShardedVariable holding `value` on `mesh`, tracked until it is
        freed; `compute_spec` is how steps read it (default: `spec`)."""
        variable = ShardedVariable(
            value, tfpar_extended=self, tfpar_spec=spec, tfpar_mesh=mesh,
            tfpar_compute_spec=(None if compute_spec in (None, spec)
                                else compute_spec),
            tfpar_split_rows=bool(spec) and spec[0] == self.data_axis,
            **kwargs)
        return self._track(variable, path, spec, kind, mesh, compute_spec)

    def _track(self, variable, path, spec, kind, mesh, compute_spec=None):
        key = id(variable)
        self._variables[key] = _VariableInfo(
            path, spec, kind, weakref.ref(variable), mesh,
            spec if compute_spec is None else compute_spec)
        weakref.finalize(variable, self._variables.pop, key, None)
        return variable

    def adopt_state_variables(self, model, extra=()):
        """Moves metric/optimizer state made outside the scope onto the mesh.

        Keras metrics passed to `compile` are often constructed before it,
        outside `strategy.scope()`, and so own plain tf.Variables. DTensor
        would silently compute wrong values with those inside the SPMD
        step, so each is replaced (same value, replicated) by a mesh
        variable; so are the Keras variables in `extra` (e.g. a keras-hub
        sampler's seed). A model weight outside the mesh is an error.
        """
        optimizer = getattr(model, "optimizer", None)
        state = list(model.metrics_variables) + list(extra)
        if optimizer is not None:
            state += list(optimizer.variables)
        for variable in model.variables:
            self._require_on_mesh(variable)
        for variable in state:
            backing = _compat.backing_variable(variable)
            if isinstance(backing, ShardedVariable):
                continue
            replacement = self._new_variable(
                variable.path, tf.convert_to_tensor(backing), None,
                {"trainable": backing.trainable, "name": backing.name.split(":")[0],
                 "dtype": backing.dtype})
            _compat.rebind_keras_variable(variable, replacement)

    def adopt_model(self, model):
        """Moves the weights of a model built outside the scope onto the mesh.

        `compile` inside `strategy.scope()` of a model built outside it
        calls this: each weight still on the host becomes a mesh variable
        with the same value, laid out by the rules (as if it had been built
        in the scope), and the model is bound to this strategy. Weights on
        another strategy's mesh, or a pipeline mesh (whose stages
        `PipelineModel` places), are an error.
        """
        outside = [v for v in model.weights if not self.owns(v)]
        foreign = [v.path for v in outside if isinstance(
            _compat.backing_variable(v), ShardedVariable)]
        if outside and (foreign or self.placement_mesh is None):
            why = (f"weights {foreign[:4]} live on another strategy's mesh"
                   if foreign else "this mesh has pipeline stages")
            raise ValueError(
                f"The weights of model {model.name!r} were created outside "
                f"this strategy's scope and cannot be moved onto it ({why}). "
                f"Received: weights such as {[v.path for v in outside][:4]}. "
                "Build the model inside `with strategy.scope():`."
            )
        owners = _owning_layers(model)
        for variable in outside:
            backing = _compat.backing_variable(variable)
            shape = backing.shape.as_list()
            spec, kind = self._spec_for(
                variable.path, shape, None, backing.trainable,
                owners.get(id(variable)), mesh=self.mesh)
            spec, compute_spec = self._fsdp_specs(spec, kind, shape)
            with tf.init_scope():
                value = placement.put(
                    placement.same_on_every_host(tf.convert_to_tensor(backing)),
                    spec, self.mesh, dtype=backing.dtype)
                replacement = self._register(
                    variable.path, spec, kind, value,
                    {"trainable": backing.trainable,
                     "name": backing.name.split(":")[0],
                     "dtype": backing.dtype},
                    self.mesh, compute_spec)
            _compat.rebind_keras_variable(variable, replacement)
        self._weight_paths.update(v.path for v in model.weights)
        _compat.bind_model_strategy(model, self._container_strategy())

    def apply_rules(self, model, rules):
        """Re-lays out the existing weights of `model` by `rules`."""
        if not isinstance(rules, layout_lib.LayoutRules):
            rules = layout_lib.LayoutRules(rules)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and optimizer.built:
            raise ValueError(
                "apply_rules must run before the optimizer is built (its "
                f"slots follow the weights' layouts); {optimizer.name!r} is "
                "built already. Call strategy.apply_rules(model, rules) right "
                "after building the model, before compile/fit."
            )
        rules = layout_lib.LayoutRules(dict(rules.items()))  # fresh usage
        _check_axes(rules, self.mesh, self.pipeline_axis)
        owners = _owning_layers(model)
        # Plan every weight and check every rule first: nothing changes
        # unless the whole plan is valid.
        plan = []
        for variable in model.weights:
            info = self._require_on_mesh(variable)
            backing = _compat.backing_variable(variable)
            shape = backing.shape.as_list()
            spec, kind = self._spec_for(
                variable.path, shape, None, backing.trainable,
                owners.get(id(variable)), rules,
                mesh=info.mesh or self.stage_meshes[0])
            spec, compute_spec = self._fsdp_specs(spec, kind, shape)
            if (spec, compute_spec) != (info.spec, info.compute_spec):
                plan.append((variable, backing, info, spec, kind,
                             compute_spec))
        unmatched = rules.unmatched()
        if unmatched:
            raise ValueError(
                f"Layout rule(s) {unmatched} matched no weight of model "
                f"{model.name!r} (its weights, nearest first: "
                f"{_nearest(unmatched[0], [v.path for v in model.weights])}). "
                "Fix or remove them."
            )
        for variable, backing, info, spec, kind, compute_spec in plan:
            if info.mesh is None:  # on the host: laid out when placed
                self._variables[id(backing)] = info._replace(
                    spec=spec, kind=kind, compute_spec=compute_spec)
                continue
            with tf.init_scope():
                value = placement.relayout(backing.read_value(), spec,
                                           info.mesh)
                self._replace(variable, backing, info, spec, kind, value,
                              info.mesh, compute_spec)
        styles.apply_styles(rules, [(v.path, v.shape, owners.get(id(v)))
                                    for v in model.weights])

    def move_to(self, variable, mesh):
        """Moves a Keras weight (made in this scope) onto `mesh`, keeping its
        spec (from the rules or `apply_rules`), e.g. a pipeline stage's
        sub-mesh, which has the same axes but the pipeline axis. The value
        travels through the host; each device receives only its block.
        """
        info = self._require_on_mesh(variable)
        if info.mesh == mesh:
            return
        backing = _compat.backing_variable(variable)
        layout_lib.check_divisible(info.path, backing.shape.as_list(),
                                   info.spec, mesh)
        with tf.init_scope():
            value = placement.put(backing.numpy(), info.spec, mesh,
                                  dtype=backing.dtype)
            self._replace(variable, backing, info, info.spec, info.kind,
                          value, mesh, info.compute_spec)

    def _replace(self, variable, backing, info, spec, kind, value, mesh,
                 compute_spec):
        """Makes Keras `variable` hold `value` in a new tracked variable."""
        replacement = self._register(
            info.path, spec, kind, value,
            {"trainable": backing.trainable,
             "name": backing.name.split(":")[0], "dtype": backing.dtype},
            mesh, compute_spec)
        self._variables.pop(id(backing), None)
        _compat.rebind_keras_variable(variable, replacement)

    def owns(self, variable):
        """Whether `variable` was made (and still lives) in this scope."""
        return self._info_of(variable) is not None

    def _require_on_mesh(self, variable):
        """The _VariableInfo of a Keras weight; error if made elsewhere."""
        info = self._info_of(variable)
        if info is None:
            raise ValueError(
                f"Model weight {variable.path!r} was created outside the "
                "strategy's scope. Build the model inside "
                "`with strategy.scope():`."
            )
        return info

    def _spec_for(self, path, shape, colocate_with, trainable, layer=None,
                  rules=None, mesh=None):
        """(spec, kind) for a new variable; slots follow their weight."""
        if colocate_with is not None:
            reference = self._info_of(colocate_with)
            if reference is not None:
                if reference.kind == "params" and len(shape) == len(reference.spec):
                    return reference.spec, "optimizer"
                return layout_lib.replicated_spec(len(shape)), "optimizer"
        own_rules = rules is None
        rules = self.rules if own_rules else rules
        # keras.Variable(layout=...) wins over the rules, as in Keras.
        spec = _compat.keras_variable_layout(path)
        if spec is not None and len(spec) != len(shape):
            raise ValueError(
                f"Variable {path!r} was given layout={spec} with {len(spec)} "
                f"axes, but has rank {len(shape)} (shape={tuple(shape)}). "
                "Give one mesh axis name or None per dimension.")
        by_rules = spec is None
        if by_rules:
            spec = rules.spec_for(path, shape, layer)
        if spec is None:
            spec = layout_lib.replicated_spec(len(shape))
        layout_lib.check_divisible(path, shape, spec, mesh or self.mesh)
        if by_rules and own_rules:  # a new weight, laid out once it is valid
            styles.apply_styles(rules, [(path, shape, layer)])
        return spec, ("params" if trainable else "other")

    def _info_of(self, variable):
        info = self._variables.get(id(_compat.backing_variable(variable)))
        return info if info is not None and info.ref() is not None else None

    def tracked_variables(self):
        return [(i.path, i.ref()) for i in list(self._variables.values())
                if i.ref() is not None]

    def placements(self, kind=None):
        return [
            (info.path, info.spec,
             layout_lib.shard_shape(info.ref().shape.as_list(), info.spec,
                                    info.mesh or self.stage_meshes[0]))
            for info in list(self._variables.values())
            if info.ref() is not None and kind in (None, info.kind)
        ]

    def memory_per_device(self):
        # Layouts split evenly, so every device of a variable's (sub-)mesh
        # holds a block of the same size; other devices hold nothing of it.
        totals = {}  # mesh -> {kind: bytes}
        for info in list(self._variables.values()):
            variable = info.ref()
            if variable is None or info.mesh is None:  # gone, or on the host
                continue
            shape = variable.shape.as_list()
            block = layout_lib.shard_shape(shape, info.spec, info.mesh)
            per_kind = totals.setdefault(
                info.mesh, {"params": 0, "optimizer": 0, "other": 0})
            per_kind[info.kind] += int(np.prod(block)) * variable.dtype.size
        memory = {device: {"params": 0, "optimizer": 0, "other": 0}
                  for device in self.mesh.devices}
        for mesh, per_kind in totals.items():
            for device in mesh.devices:
                for kind, size in per_kind.items():
                    memory[device][kind] += size
        return memory

    def check_rules_used(self):
        """Raises when a layout rule matched no weight (once per strategy).

        Called when a model is compiled or its train/test/predict function
        is made (outside any traced function), and when a step starts.
        """
        if self._rules_checked:
            return
        unmatched = self.rules.unmatched()
        if unmatched:
            raise ValueError(
                f"Layout rule(s) {unmatched} matched no variable. Rules are "
                "re.fullmatch'ed against the model's weight paths; nearest "
                f"first: {_nearest(unmatched[0], self._weight_paths)}. Fix "
                "or remove those rules."
            )
        self._rules_checked = True

    # -- running the step ----------------------------------------------------

    def replica_scope(self):
        """Enters the strategy scope and its single SPMD replica context."""
        self.check_context()
        self.check_rules_used()
        return _ReplicaScope(self._container_strategy())

    @property
    def real_all_gathers(self):
        """Whether steps compile all-gathers as CollectiveGatherV2 ops: under
        fsdp on a mesh with one axis of size > 1, where no relayout can
        gather over two axes (see `_compat.collective_all_gathers`)."""
        return self.fsdp and sum(
            self.mesh.axis_size(a) > 1 for a in self.mesh.axis_names) == 1

    def replicate(self, value):
        """`value` relaid out so that every device holds all of it."""
        if not isinstance(value, tf.Tensor) or (
                tf.executing_eagerly() and not dtensor.is_dtensor(value)):
            return value
        rank = value.shape.rank
        return placement.relayout(value, layout_lib.replicated_spec(rank),
                                  self.mesh)

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


def _check_random_recomputation(generator):
    """Refuses to recompute a random op on a mesh that splits tensors over
    more than the data (and pipeline) axis.

    A recomputation draws the forward pass's seed again, but DTensor
    derives each device's random numbers from the seed and the tensor's
    layout, and the recomputed tensor may be laid out otherwise: on
    data=2×model=4, BatchNormalization then Dropout drew another mask in
    the recomputation (tests/test_recompute.py). On data (× pipe) meshes
    tensors are split by the batch alone, and the masks are the same.
    """
    context = tf.distribute.get_replica_context()
    if not isinstance(context, _SPMDReplicaContext):
        return
    extended = context.strategy.extended
    other = {axis: extended.mesh.axis_size(axis)
             for axis in extended.mesh.axis_names
             if axis not in (extended.data_axis, extended.pipeline_axis)
             and extended.mesh.axis_size(axis) > 1}
    if other:
        raise ValueError(
            "A recomputed layer (keras.RematScope) draws random numbers "
            f"(seed generator {generator.name!r}, e.g. Dropout) on a mesh "
            f"that also splits tensors over {other}: DTensor may lay the "
            "recomputed tensor out differently from the forward pass and "
            "draw another mask, so the gradients would be wrong. Leave "
            "layers with random ops out of the RematScope (e.g. mode="
            "'list_of_layers'), or recompute them on a data-only mesh. "
            f"Received mesh: {extended.mesh!r}.")


def in_spmd_step():
    """Whether the code runs inside a tfpar SPMD step (a traced step)."""
    return isinstance(tf.distribute.get_replica_context(), _SPMDReplicaContext)


class _SPMDReplicaContext(tf.distribute.ReplicaContext):
    """The single replica of an SPMD program: reductions are identities."""

    def __init__(self, strategy):
        super().__init__(strategy, replica_id_in_sync_group=0)

    def all_reduce(self, reduce_op, value, options=None):
        return value

    def all_gather(self, value, axis, options=None):
        return value


class _ReplicaScope:
    """`with strategy.scope(), _SPMDReplicaContext(strategy):` as one."""

    def __init__(self, strategy):
        self._scope = strategy.scope()
        self._context = _SPMDReplicaContext(strategy)

    def __enter__(self):
        self._scope.__enter__()
        self._context.__enter__()

    def __exit__(self, *exc):
        self._context.__exit__(*exc)
        self._scope.__exit__(*exc)

