"""Keras' own distribution API (`keras.distribution`) on TensorFlow.

On JAX, `keras.distribution.set_distribution(d)` (or `with d.scope():`)
makes Keras lay out every new variable by `d.get_variable_layout` and split
every batch over `d.batch_dim_name`. Keras 3.15's TensorFlow backend does
neither: its `distribution_lib` is a "DO NOT USE" prototype and the
distribution is silently ignored. After `import tfpar.keras_distribution`
(an opt-in: `import tfpar` alone leaves Keras unchanged; importing this
module installs the hook, `hook_keras_distribution`, and
`tfpar.keras_distribution` imports it on first access) the same code trains
sharded on TensorFlow: setting a distribution makes the
`tfpar.ParallelStrategy` it stands for (`strategy_for(d)`) current, as
`tf.distribute.experimental_set_strategy` does, so models built while it is
set are built under that strategy and `fit` trains them on its mesh:

- `DataParallel(...)` is `ParallelStrategy(Mesh.from_keras(d.device_mesh),
  data_axis=d.batch_dim_name)`: weights replicated, the batch split over the
  mesh's first axis (Keras' choice).
- `ModelParallel(layout_map=m, batch_dim_name=b)` is
  `ParallelStrategy(Mesh.from_keras(m.device_mesh),
  rules=LayoutRules.from_keras(m), data_axis=b)`: each weight laid out by the
  key of `m` that matches its path (real DTensor layouts), the batch split
  over `b`. A weight whose layout also splits it over `b` (keras-hub's
  `get_layout_map`: Llama and Gemma weights over "batch" and "model") is
  stored so but gathered over `b` where a step reads it, tfpar's fsdp
  mechanism; its gradient is reduce-scattered back.
- `keras.distribution.distribute_tensor(x, layout)` relayouts `x` inside a
  step, or puts a host value on the mesh; so do `LayoutMap` keys ending in
  "/output", which Keras applies to layer outputs.

Refused with an error that says what to do: a `Distribution` subclass other
than these two, a batch axis the mesh lacks, setting a distribution inside
another strategy's `with scope():`, `keras.distribution.initialize` (use
`tfpar.connect_hosts`), and `distribute_tensor` with no tfpar distribution
set or a layout for another mesh.

Example (8 devices):

>>> import keras, tfpar
>>> mesh = keras.distribution.DeviceMesh(
...     (2, 4), ("batch", "model"), devices=keras.distribution.list_devices())
>>> layout_map = keras.distribution.LayoutMap(mesh)
>>> layout_map["up/kernel"] = (None, "model")
>>> layout_map["down/kernel"] = ("model", None)
>>> distribution = keras.distribution.ModelParallel(
...     layout_map=layout_map, batch_dim_name="batch")
>>> with distribution.scope():
...     model = keras.Sequential([
...         keras.Input((16,)), keras.layers.Dense(64, name="up"),
...         keras.layers.Dense(16, name="down")])
...     model.compile(optimizer="sgd", loss="mse")
>>> tfpar.keras_distribution.strategy_for(distribution).placements("params")[0]
('sequential/up/kernel', (None, 'model'), (16, 16))
"""

import types
import weakref

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import _compat
from tfpar import layout as layout_lib
from tfpar import placement
from tfpar.mesh import Mesh
from tfpar.step_context import in_spmd_step
from tfpar.strategy import ParallelStrategy

# A pipeline axis name no Keras mesh can have (axis names are identifiers):
# Keras' distributions have no pipeline stages.
_NO_PIPELINE = "-"
_STRATEGIES = weakref.WeakKeyDictionary()  # distribution -> its strategy


def strategy_for(distribution):
    """The `tfpar.ParallelStrategy` a Keras distribution stands for (one per
    distribution object, so every `scope()` of it builds on the same mesh).

    Args:
        distribution: a `keras.distribution.DataParallel` or
            `keras.distribution.ModelParallel`.

    Raises:
        TypeError: another kind of distribution.
        ValueError: its batch axis is not an axis of its mesh, or a layout
            names an axis the mesh lacks.
    """
    strategy = _STRATEGIES.get(distribution)
    if strategy is None:
        strategy = _new_strategy(distribution)
        _STRATEGIES[distribution] = strategy
    return strategy


def _new_strategy(distribution):
    from keras import distribution as keras_distribution  # noqa: PLC0415

    if type(distribution) is keras_distribution.DataParallel:
        rules = None
    elif type(distribution) is keras_distribution.ModelParallel:
        rules = layout_lib.LayoutRules.from_keras(distribution._layout_map)  # noqa: SLF001
    else:
        raise TypeError(
            "tfpar runs keras.distribution.DataParallel and ModelParallel on "
            "TensorFlow. Received: a distribution of type "
            f"{type(distribution).__name__}. Use one of those two, or a "
            "tfpar.ParallelStrategy(tfpar.Mesh.from_keras(device_mesh), "
            "rules=...) with `with strategy.scope():`.")
    mesh = Mesh.from_keras(distribution.device_mesh)
    batch = distribution.batch_dim_name
    if batch not in mesh.shape:
        raise ValueError(
            f"The distribution's batch_dim_name {batch!r} is not an axis of "
            f"its device mesh {list(mesh.axis_names)}. Received: "
            f"{distribution!r}. Pass batch_dim_name= one of the mesh's axis "
            "names.")
    return ParallelStrategy(mesh, rules=rules, data_axis=batch,
                            pipeline_axis=_NO_PIPELINE)


def _on_set_distribution(distribution):
    """Keras' `set_distribution(distribution)` is about to run."""
    strategy = None if distribution is None else strategy_for(distribution)
    try:
        tf.distribute.experimental_set_strategy(strategy)
    except RuntimeError:  # "Must not be called inside a Strategy scope"
        raise RuntimeError(
            "keras.distribution.set_distribution (or distribution.scope()) "
            "was called inside `with strategy.scope():` of "
            f"{type(tf.distribute.get_strategy()).__name__}. Received: "
            f"distribution={distribution!r}. Set the Keras distribution "
            "outside any strategy scope, or use only the strategy."
        ) from None


def distribute_tensor(tensor, layout):
    """Keras' `distribute_tensor` on TensorFlow: `tensor` (or each tensor
    of a nested structure) laid out by `layout`, a
    `keras.distribution.TensorLayout` on the current distribution's mesh.
    Inside a step this is a DTensor relayout; eagerly a host value is put on
    the mesh. Other tensors (Keras' symbolic ones) pass unchanged.
    """
    strategy = tf.distribute.get_strategy()
    if not isinstance(strategy, ParallelStrategy):
        raise ValueError(
            "keras.distribution.distribute_tensor on TensorFlow needs a "
            "distribution set with keras.distribution.set_distribution(...) "
            "or `with distribution.scope():` (after `import tfpar`). "
            f"Received: layout={layout!r} with no distribution set.")
    spec = _spec_of(layout, strategy.mesh)

    def one(value):
        if not isinstance(value, (tf.Tensor, tf.Variable)):
            return value
        if value.shape.rank != len(spec):
            raise ValueError(
                f"distribute_tensor got a layout with {len(spec)} axes for a "
                f"tensor of rank {value.shape.rank}. Received: "
                f"layout={layout!r}, tensor shape={value.shape}. Give one "
                "axis (or None) per dimension.")
        if tf.executing_eagerly():
            if dtensor.is_dtensor(value):
                return placement.relayout(value, spec, strategy.mesh)
            return placement.put(value, spec, strategy.mesh)
        if not in_spmd_step():
            return value  # a shape-only trace (Keras' compute_output_spec)
        return placement.relayout(value, spec, strategy.mesh)

    return tf.nest.map_structure(one, tensor)


def _spec_of(layout, mesh):
    """The spec of a TensorLayout (or DTensor layout) on `mesh`."""
    spec = names = None
    if isinstance(layout, dtensor.Layout):
        spec, names = layout_lib.spec_of(layout), list(layout.mesh.dim_names)
    elif hasattr(layout, "axes"):
        spec = tuple(layout.axes)
        names = list(getattr(layout.device_mesh, "axis_names", None)
                     or mesh.axis_names)
    if spec is None or names != list(mesh.axis_names) or any(
            axis is not None and axis not in mesh.shape for axis in spec):
        raise ValueError(
            "keras.distribution.distribute_tensor needs a TensorLayout on the "
            f"current distribution's mesh {mesh!r}. Received: "
            f"layout={layout!r}. Use axis names of that mesh.")
    return spec


def _initialize(job_addresses=None, num_processes=None, process_id=None):
    raise NotImplementedError(
        "keras.distribution.initialize is not implemented on TensorFlow. "
        f"Received: job_addresses={job_addresses!r}, "
        f"num_processes={num_processes!r}, process_id={process_id!r}. With "
        "tfpar, join the hosts with tfpar.connect_hosts(addresses, host_id) "
        "first thing, then build the mesh and distribution.")


def _tf_distribution_lib():
    return _compat.keras_module("backend.tensorflow.distribution_lib")


def _announcing_distribution(original, hooks):
    def set_global_attribute(name, value):
        if name == "distribution":
            hooks.on_set(value)
        original(name, value)

    return set_global_attribute


def _device_count(_, hooks):
    """Keras' `distribution_lib.get_device_count`, which Keras 3.15's TF
    backend lacks: the devices its `list_devices` finds."""
    library = _tf_distribution_lib()
    return lambda device_type=None: len(library.list_devices(device_type))


_KERAS_DISTRIBUTION_PATCHES = (
    _compat.Patch("set_global_attribute", _compat.keras_global_state,
                  "set_global_attribute", _announcing_distribution),
    _compat.Patch("distribute_tensor", _tf_distribution_lib,
                  "distribute_tensor",
                  lambda _, hooks: hooks.distribute_tensor),
    _compat.Patch("initialize", _tf_distribution_lib, "initialize",
                  lambda _, hooks: hooks.initialize),
    _compat.Patch("get_device_count", _tf_distribution_lib, "get_device_count",
                  _device_count),
)


def hook_keras_distribution(on_set, distribute_tensor, initialize):
    """Makes Keras' distribution API reach tfpar on the TF backend; once
    (importing this module calls it; `_compat.uninstall` undoes it).

    Keras keeps the current distribution in its global attribute
    "distribution", written only by `keras.distribution.set_distribution`
    (which `Distribution.scope()` calls on entry and exit) through
    `global_state.set_global_attribute`: that writer is wrapped so that
    `on_set(value)` runs first (and may refuse by raising), whichever
    binding of `set_distribution` the user imported. Keras 3.15's TF
    `distribution_lib` (a "DO NOT USE" prototype) lacks `distribute_tensor`,
    `get_device_count` and `initialize`, which `keras.distribution` calls:
    they are supplied (`_KERAS_DISTRIBUTION_PATCHES`). A distribution set
    before this hook is installed is handed to `on_set` now.
    """
    if not _compat.install_group(
            "keras_distribution", _KERAS_DISTRIBUTION_PATCHES,
            types.SimpleNamespace(on_set=on_set, initialize=initialize,
                                  distribute_tensor=distribute_tensor)):
        return
    current = _compat.keras_global_state().get_global_attribute("distribution")
    if current is not None:
        on_set(current)


hook_keras_distribution(_on_set_distribution, distribute_tensor, _initialize)
