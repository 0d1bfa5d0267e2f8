"""Variables on a mesh: where each one lives, and the registry of them.

Every variable a `ParallelStrategy` makes carries one `Placement`
(`variable.placement`): its path, kind, stored spec, (sub-)mesh and the
spec steps compute with. That record is the only place these are kept;
the strategy's `VariableRegistry` lists the live variables in creation
order and makes, adopts, moves and re-lays them out, each time giving the
variable (or its replacement) a new Placement.

Example:

>>> import keras, tfpar
>>> tfpar.use_virtual_cpus(8)
>>> strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}), fsdp=True)
>>> with strategy.scope():
...     layer = keras.layers.Dense(16)
...     layer.build((None, 8))
>>> place = tfpar.variables.placement_of(layer.kernel)
>>> place.kind, place.spec, place.compute_spec
('params', ('data', None), (None, None))
"""

import contextlib
import dataclasses
import difflib
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import _compat
from tfpar import experts
from tfpar import layout as layout_lib
from tfpar import collectives
from tfpar import placement as placement_lib
from tfpar import step_context
from tfpar import styles
from tfpar import variable_creation
from tfpar.keras_graph import owning_layers

KINDS = ("params", "optimizer", "other")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a variable lives and how steps read it (immutable).

    One convention for "nothing": `mesh` is None while the variable waits
    on the host (the weights of a pipeline model until `PipelineModel` puts
    each on its stage); `spec` and `compute_spec` are always tuples, one
    entry per dimension (a mesh axis or None), and equal unless a step
    gathers the variable over the data axis (fsdp, or a rule splitting it
    over that axis).

    Attributes:
        path: the Keras variable path, e.g. "sequential/up/kernel".
        kind: "params" (trainable weights), "optimizer" (slots made for
            them) or "other" (every other variable).
        spec: the spec it is stored with.
        mesh: the `tfpar.Mesh` (or pipeline stage sub-mesh) holding it, or
            None (the host).
        compute_spec: the spec steps read it with.
    """

    path: str
    kind: str
    spec: tuple
    mesh: object
    compute_spec: tuple

    @property
    def gathered(self):
        """Whether each read in a step gathers it (compute_spec != spec)."""
        return self.compute_spec != self.spec

    def replace(self, **changes):
        """A copy with `changes` (e.g. `spec=..., mesh=...`)."""
        return dataclasses.replace(self, **changes)


def placement_of(variable):
    """The Placement of a variable made by a strategy (a Keras variable or
    its backing tf.Variable), or None."""
    return getattr(_compat.backing_variable(variable), "placement", None)


class ShardedVariable(_compat.DVariable):
    """A DTensor variable that accepts host values like a plain tf.Variable.

    Keras' `set_weights`, `load_weights` and optimizers assign plain tensors
    and read back numpy; a bare DVariable only takes DTensors and cannot turn
    a sharded value into numpy. This subclass puts host values on the mesh
    with the variable's own layout and assembles numpy from the shards.

    Under `fsdp`, or when its rule splits it over the data axis, a weight
    is stored split over the data axis (`placement.spec`) but computed
    with whole (`placement.compute_spec`): each read in a step gathers it,
    and the gradient of that gather is a reduce-scatter back to the stored
    blocks. Optimizer updates read the stored blocks. Row look-ups
    (`sparse_read`/`gather_nd`, i.e. `tf.gather` of the variable) in a
    table split by rows over the data axis (by fsdp or a rule) are a
    GatherV2 of the stored blocks, inside a step or not: DTensor 2.21 has
    no ResourceGather from such a table.
    """

    def __init__(self, *args, placement, extended, compute_dtype=None,
                 **kwargs):
        self.placement = placement
        # The dtype the layer adding it computes in (None: not a layer's
        # weight); `tfpar.offload.master` keeps a weight in it on devices.
        self.compute_dtype = compute_dtype or getattr(
            variable_creation.keras_layer_adding_weight(), "compute_dtype", None)
        self._tfpar_extended = weakref.ref(extended)
        spec = placement.spec
        self._split_rows = bool(spec) and spec[0] == extended.data_axis
        super().__init__(*args, **kwargs)

    def _read_variable_op(self, no_copy=False):
        value = super()._read_variable_op(no_copy=no_copy)
        # In a step's replica context; optimizer updates run in the
        # cross-replica context (extended.update's merge_call).
        if (self.placement.gathered and not tf.executing_eagerly()
                and step_context.in_spmd_step()):
            again = step_context.recompute_dependency()
            extended = self._tfpar_extended()
            reshard = (again is None and extended is not None
                       and extended.reshard_after_forward)
            if again is not None:  # recomputing: a new gather, not the old
                value = value + tf.cast(again, value.dtype)
            value = collectives.gather_from_fsdp_shards(
                value, self.placement.compute_spec, self.placement.mesh,
                reshard)
        return value

    def _stored_value(self):
        return super()._read_variable_op()

    def sparse_read(self, indices, name=None):
        if self._split_rows:
            return tf.gather(self._stored_value(), indices, name=name)
        return super().sparse_read(indices, name=name)

    def gather_nd(self, indices, name=None):
        if self._split_rows:
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
            value = placement_lib.same_on_every_host(value)
        else:
            layout = dtensor.fetch_layout(value)
            if layout == dtensor.fetch_layout(self):
                return value  # already laid out like this variable
            if layout.mesh != self.placement.mesh.dtensor_mesh:
                value = placement_lib.fetch(value)  # another mesh: via host
        return placement_lib.put(value, self.placement.spec,
                                 self.placement.mesh, dtype=self.dtype)

    # `writes` counts the assignments made through Python (eagerly, or
    # traced into a function): `tfpar.offload` copies a weight into its
    # host copy only when it changed since the offload's own last write.
    writes = 0

    def assign(self, value, use_locking=None, name=None, read_value=True):
        self.writes += 1
        return super().assign(self._on_mesh(value), use_locking, name,
                              read_value)

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        self.writes += 1
        return super().assign_add(self._on_mesh(delta), use_locking, name,
                                  read_value)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        self.writes += 1
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
        return placement_lib.fetch(self.read_value())

    def __array__(self, dtype=None, copy=None):
        value = self.numpy()
        return value if dtype is None else value.astype(dtype)


def device_bytes(holdings, devices):
    """{device: {"params", "optimizer", "other": bytes}} from `holdings`,
    an iterable of (kind, devices holding a block, bytes of the block);
    every device of `devices` is listed (0 where it holds nothing). The
    one per-device sum behind `strategy.memory_per_device()` and
    `tfpar.visualize.summary`."""
    memory = {device: dict.fromkeys(KINDS, 0) for device in devices}
    for kind, holders, nbytes in holdings:
        for device in holders:
            memory.setdefault(device, dict.fromkeys(KINDS, 0))[kind] += nbytes
    return memory


def _nearest(pattern, paths, count=12):
    """Up to `count` of `paths`, the most similar to `pattern` first."""
    return difflib.get_close_matches(pattern, sorted(paths), n=count,
                                     cutoff=0.0)


def _keras_kwargs(backing):
    """The tf.Variable arguments that remake `backing` elsewhere."""
    return {"trainable": backing.trainable,
            "name": backing.name.split(":")[0], "dtype": backing.dtype,
            "compute_dtype": getattr(backing, "compute_dtype", None)}


def _on_host(host_creator, initial_value, kwargs, place, layer):
    """A weight made by `host_creator` on the host (CPU:0) until a
    `PipelineModel` moves it to its stage, noting its `place` and the
    compute dtype of `layer` for its ShardedVariable there
    (`tfpar.offload.master` keeps a weight in it)."""
    with tf.device("CPU:0"):
        variable = host_creator(initial_value=initial_value, **kwargs)
    variable.placement = place
    variable.compute_dtype = getattr(layer, "compute_dtype", None)
    return variable


def _initial_variable(registry, initial_value, place, kwargs):
    """A tracked ShardedVariable of `registry` laid out by `place`,
    holding `initial_value` (a host value: host 0's, on every host); for
    a `variable_creation.DeferredValue`, each device's block allocated and
    left unwritten (`placement.unwritten`), the variable noted on it."""
    if isinstance(initial_value, variable_creation.DeferredValue):
        variable = registry._sharded(placement_lib.unwritten(  # noqa: SLF001
            place.spec, place.mesh, initial_value.shape.as_list(),
            initial_value.dtype), place, kwargs)
        initial_value.created = weakref.ref(variable)
        return variable
    value = placement_lib.put(placement_lib.same_on_every_host(initial_value),
                              place.spec, place.mesh, dtype=kwargs.get("dtype"))
    return registry._sharded(value, place, kwargs)  # noqa: SLF001


def _rules_for_state(rules, path, layer, layout, slot_of):
    """Empty rules (replicated) for a Keras SeedGenerator's state made
    inside a layer that a style rule lays out (an attention's dropout: a
    style lays out its layer's own weights only); None (the strategy's
    rules) for everything else. Other variables of no layer under a style
    still get the style's clear error naming them."""
    if (layer is None and layout is None and slot_of is None
            and path.endswith("seed_generator_state")
            and styles.style_rule_for(rules, path) is not None):
        return layout_lib.LayoutRules({})
    return None


class VariableRegistry:
    """The live variables one strategy made, in creation order, and how they
    are made, adopted, moved and re-laid out (each through
    `layout.plan_specs`).

    Args:
        extended: the strategy's `ParallelExtended` (held weakly; its
            `dims` and `rules` plan every variable).
    """

    def __init__(self, extended):
        self._extended = weakref.ref(extended)
        self._dims = extended.dims
        self._rules = extended.rules
        self._live = {}  # id(variable) -> weakref to it, in creation order
        self._weight_paths = set()  # paths of model weights (for errors)
        self._placing = []  # stack of meshes new variables go to
        self._rules_checked = False

    # -- where new variables go ---------------------------------------------

    @contextlib.contextmanager
    def placing_on(self, mesh):
        """New variables (other than optimizer slots, which follow their
        weight) are created on `mesh`, a pipeline stage's sub-mesh; or, a
        `Placement`, laid out by it as given (its path replaced by theirs),
        e.g. `tfpar.offload`'s host copy of a weight, on another mesh."""
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
            return getattr(self._placing[-1], "mesh", self._placing[-1])
        return self._dims.mesh if self._dims.num_stages == 1 else None

    def _plan(self, path, shape, mesh, trainable, layer=None, rules=None,
              layout=None, slot_of=None):
        """`layout.plan_specs` with this strategy's dimensions; a weight
        laid out by the strategy's own rules also gets its layer's style
        applied (its activation relayouts), once its spec is valid. Under
        `placing_on(placement)`: that Placement (kind, spec, compute spec)."""
        if self._placing and isinstance(self._placing[-1], Placement):
            return self._placing[-1]
        plan = layout_lib.plan_specs(
            path, shape, mesh or self._dims.stage_meshes[0], layer=layer,
            rules=self._rules if rules is None else rules, layout=layout,
            trainable=trainable, slot_of=slot_of, fsdp=self._dims.fsdp,
            data_axis=self._dims.data_axis, expert_axis=self._dims.expert_axis,
            context_axis=self._dims.context_axis)
        if rules is None and layout is None and slot_of is None:
            styles.apply_styles(self._rules, [(path, shape, layer)])
        return plan

    # -- making and tracking ------------------------------------------------

    def create(self, path, initial_value, colocate_with, kwargs,
               host_creator=None):
        """A new variable at `path` holding `initial_value` (host): a
        ShardedVariable on the placement mesh, laid out by the plan; a
        host variable from `host_creator` while weights wait for their
        pipeline stage; a slot (`colocate_with` its weight) follows it."""
        shape = initial_value.shape.as_list()
        reference = (None if colocate_with is None
                     else self.placement_of(colocate_with))
        mesh = self.placement_mesh if reference is None else reference.mesh
        layer = variable_creation.keras_layer_adding_weight()
        layout = variable_creation.keras_variable_layout(path)
        plan = self._plan(path, shape, mesh, kwargs.get("trainable", True),
                          layer, layout=layout, slot_of=reference,
                          rules=_rules_for_state(self._rules, path, layer,
                                                 layout, reference))
        if layer is not None:
            self._weight_paths.add(path)  # a layer's weight, not state
        place = Placement(path, plan.kind, plan.spec, mesh, plan.compute_spec)
        with tf.init_scope():  # also when first built inside a tf.function
            if mesh is None:  # on the host until PipelineModel places it
                return self._track(_on_host(host_creator, initial_value,
                                            kwargs, place, layer))
            return _initial_variable(self, initial_value, place, kwargs)

    def _sharded(self, value, place, kwargs, cls=None):
        """A tracked ShardedVariable (or subclass `cls`) holding `value`."""
        return self._track((cls or ShardedVariable)(
            value, placement=place, extended=self._extended(), **kwargs))

    def _track(self, variable):
        key = id(variable)
        self._live[key] = weakref.ref(variable)
        weakref.finalize(variable, self._live.pop, key, None)
        return variable

    def _rebind(self, variable, backing, place, value, cls=None, **extra):
        """Keras `variable` holds `value` in a new `_sharded`, not `backing`."""
        replacement = self._sharded(value, place,
                                    {**_keras_kwargs(backing), **extra}, cls)
        self._live.pop(id(backing), None)
        _compat.rebind_keras_variable(variable, replacement)

    # -- looking up ---------------------------------------------------------

    def placement_of(self, variable):
        """The Placement of a live variable made here, else None."""
        backing = _compat.backing_variable(variable)
        ref = self._live.get(id(backing))
        return backing.placement if ref and ref() is backing else None

    def owns(self, variable):
        """Whether `variable` was made (and still lives) in this scope."""
        return self.placement_of(variable) is not None

    def require_on_mesh(self, variable):
        """The Placement of a Keras weight; an error if made elsewhere."""
        place = self.placement_of(variable)
        if place is None:
            raise ValueError(
                f"Model weight {variable.path!r} was created outside the "
                "strategy's scope. Build the model inside "
                "`with strategy.scope():`, and call what adds weights to a "
                "built model there too (Keras' `quantize`, `enable_lora`)."
            )
        return place

    def entries(self, kind=None):
        """[(placement, variable)] of the live variables (of `kind`)."""
        live = [ref() for ref in list(self._live.values())]
        return [(v.placement, v) for v in live
                if v is not None and kind in (None, v.placement.kind)]

    def tracked_variables(self):
        """[(path, variable)] of the live variables, in creation order."""
        return [(place.path, v) for place, v in self.entries()]

    def placements(self, kind=None):
        """[(path, spec, per-device block shape)] (see the strategy's)."""
        return [(place.path, place.spec, layout_lib.shard_shape(
                    v.shape.as_list(), place.spec,
                    place.mesh or self._dims.stage_meshes[0]))
                for place, v in self.entries(kind)]

    def memory_per_device(self):
        """{device: {kind: bytes}} of the variables on a mesh (see the
        strategy's): layouts split evenly, so every device of a variable's
        (sub-)mesh holds a block of the same size."""
        return device_bytes(
            ((place.kind, place.mesh.devices, _block_bytes(place, v))
             for place, v in self.entries() if place.mesh is not None),
            self._dims.mesh.devices)

    # -- moving existing variables ------------------------------------------

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
            self.require_on_mesh(variable)
        for variable in state:
            backing = _compat.backing_variable(variable)
            if isinstance(backing, ShardedVariable):
                continue
            replacement = self.create(
                variable.path, tf.convert_to_tensor(backing), None,
                _keras_kwargs(backing))
            _compat.rebind_keras_variable(variable, replacement)

    def adopt_model(self, model):
        """Moves the weights of a model built outside the scope onto the mesh.

        `compile` inside `strategy.scope()` of a model built outside it
        calls this: each weight still on the host becomes a mesh variable
        with the same value, laid out by the rules (as if it had been built
        in the scope). Weights on another strategy's mesh, or a pipeline
        mesh (whose stages `PipelineModel` places), are an error.
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
        owners = owning_layers(model)
        mesh = self._dims.mesh
        for variable in outside:
            backing = _compat.backing_variable(variable)
            plan = self._plan(variable.path, backing.shape.as_list(), mesh,
                              backing.trainable, owners.get(id(variable)))
            with tf.init_scope():
                value = placement_lib.put(
                    placement_lib.same_on_every_host(
                        tf.convert_to_tensor(backing)),
                    plan.spec, mesh, dtype=backing.dtype)
                replacement = self._sharded(value, Placement(
                    variable.path, plan.kind, plan.spec, mesh,
                    plan.compute_spec), _keras_kwargs(backing))
            _compat.rebind_keras_variable(variable, replacement)
        self._weight_paths.update(v.path for v in model.weights)

    def apply_rules(self, model, rules):
        """Re-lays out the existing weights of `model` by `rules` (see
        `ParallelStrategy.apply_rules`): every weight is planned and every
        rule checked first, so nothing changes unless the plan is valid."""
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
        rules = self._dims.bind_rules(rules)  # fresh usage, model axis
        changes = self._relayout_plan(model, rules)
        unmatched = rules.unmatched()
        if unmatched:
            raise ValueError(
                f"Layout rule(s) {unmatched} matched no weight of model "
                f"{model.name!r} (its weights, nearest first: "
                f"{_nearest(unmatched[0], [v.path for v in model.weights])}). "
                "Fix or remove them."
            )
        for variable, backing, place in changes:
            if place.mesh is None:  # on the host: laid out when placed
                backing.placement = place
                continue
            with tf.init_scope():
                value = placement_lib.relayout(backing.read_value(),
                                               place.spec, place.mesh)
                self._rebind(variable, backing, place, value)
        owners = owning_layers(model)
        styles.apply_styles(rules, [(v.path, v.shape, owners.get(id(v)))
                                    for v in model.weights])

    def _relayout_plan(self, model, rules):
        """[(Keras weight, backing, new Placement)] of `model`'s weights
        `rules` lay out differently (raises on a bad rule); a weight's own
        Keras layout (tfpar's MixtureOfExperts banks) wins, as when made."""
        owners = owning_layers(model)
        changes = []
        for variable in model.weights:
            place = self.require_on_mesh(variable)
            backing = _compat.backing_variable(variable)
            layout = variable_creation.layout_spec_of(variable)
            plan = self._plan(variable.path, backing.shape.as_list(),
                              place.mesh, backing.trainable,
                              owners.get(id(variable)), rules, layout=layout)
            new = place.replace(kind=plan.kind, spec=plan.spec,
                                compute_spec=plan.compute_spec)
            if (new.spec, new.compute_spec) != (place.spec,
                                                place.compute_spec):
                changes.append((variable, backing, new))
        return changes

    def move_to(self, variable, mesh):
        """Moves a Keras weight (made in this scope) onto `mesh`, keeping its
        spec (from the rules or `apply_rules`), e.g. a pipeline stage's
        sub-mesh, which has the same axes but the pipeline axis. The value
        travels through the host; each device receives only its block.
        """
        place = self.require_on_mesh(variable)
        if place.mesh == mesh:
            return
        backing = _compat.backing_variable(variable)
        layout_lib.check_divisible(place.path, backing.shape.as_list(),
                                   place.spec, mesh)
        with tf.init_scope():
            value = placement_lib.put(backing.numpy(), place.spec, mesh,
                                      dtype=backing.dtype)
            self._rebind(variable, backing, place.replace(mesh=mesh), value)

    def check_rules_used(self, expert_axis=True):
        """Raises when a layout rule matched no weight, and (`expert_axis`)
        when an expert axis splits no weight (`experts.
        check_expert_axis_used`); each once per strategy. Called when a
        model is compiled (without the expert check: keras-hub tasks
        compile in their constructor, before `apply_rules` splits their
        banks), when its train/test/predict function is made and when a
        step starts."""
        done = self._rules_checked
        if done == "all" or (done and not expert_axis):
            return
        _check_rules_matched(self._rules, self._weight_paths)
        specs = [place.spec for place, _ in self.entries()]
        if specs:  # no variable yet: checked again when there are some
            if expert_axis:
                experts.check_expert_axis_used(self._dims, specs)
            self._rules_checked = "all" if expert_axis else "rules"


def _check_rules_matched(rules, weight_paths):
    """Raises when a rule of `rules` matched no weight."""
    unmatched = rules.unmatched()
    if unmatched:
        raise ValueError(
            f"Layout rule(s) {unmatched} matched no variable. Rules are "
            "re.fullmatch'ed against the model's weight paths; nearest "
            f"first: {_nearest(unmatched[0], weight_paths)}. Fix or remove "
            "those rules.")


def replace_storage(registry, variable, value, cls, **kwargs):
    """Makes Keras `variable` (made by `registry`, a VariableRegistry) hold
    `value` (a DTensor laid out like it, maybe of another dtype) in a new
    tracked `cls` (a ShardedVariable subclass taking more `kwargs`) with
    the same placement; returns it (`tfpar.offload.master`)."""
    backing = _compat.backing_variable(variable)
    registry._rebind(variable, backing, backing.placement, value,  # noqa: SLF001
                     cls, dtype=value.dtype, **kwargs)
    return _compat.backing_variable(variable)


def _block_bytes(place, variable):
    """Bytes of one device's block of `variable` laid out by `place`."""
    block = layout_lib.shard_shape(variable.shape.as_list(), place.spec,
                                   place.mesh)
    return int(np.prod(block)) * variable.dtype.size
