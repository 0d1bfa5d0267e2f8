"""Layout rules: which weights are sharded over which mesh axes.

A *spec* is a tuple with one entry per dimension of a variable: the name of a
mesh axis that dimension is split over, or `None` for "every device holds the
whole dimension". `LayoutRules` maps regular expressions over Keras variable
paths to specs (or to tensor-parallel styles). Specs become DTensor layouts
here (`to_dtensor_layout`).
"""

import collections
import collections.abc
import re

from tensorflow.experimental import dtensor


class LayoutRules:
    """An ordered mapping `{regex: spec}` from Keras variable paths to specs.

    Each regex is `re.fullmatch`ed against `variable.path`, e.g.
    `"sequential/up0/kernel"` (or `"up0/kernel"` in a functional model).
    Variables that no rule matches are replicated. Stricter than its PyTorch
    and Keras cousins: a variable matched by two rules is an error, and so is
    a rule that matches no variable (reported when training starts).

    A Keras Dense kernel is (in, out): column-parallel shards axis 1
    (`(None, "model")`, bias `("model",)`), row-parallel shards axis 0
    (`("model", None)`, bias replicated).

    Example:

    >>> rules = tfpar.LayoutRules({
    ...     r".*up\\d/kernel": (None, "model"),
    ...     r".*up\\d/bias": ("model",),
    ...     r".*down\\d/kernel": ("model", None),
    ... })
    >>> rules.spec_for("sequential/up0/kernel", (512, 1024))
    (None, 'model')

    Args:
        mapping: ordered mapping of regex (str) to spec (tuple of mesh axis
            names or None).
    """

    def __init__(self, mapping=None):
        if mapping is None:
            mapping = {}
        if not isinstance(mapping, collections.abc.Mapping):
            raise TypeError(
                "LayoutRules(mapping) needs a mapping {regex: spec}, e.g. "
                "{r'.*dense/kernel': (None, 'model')}. "
                f"Received: mapping={mapping!r} of type {type(mapping).__name__}"
            )
        self._rules = []
        for pattern, spec in mapping.items():
            if not isinstance(pattern, str):
                raise TypeError(
                    "LayoutRules keys must be regex strings. "
                    f"Received: key {pattern!r} of type {type(pattern).__name__}"
                )
            try:
                regex = re.compile(pattern)
            except re.error as e:
                raise ValueError(
                    f"LayoutRules key {pattern!r} is not a valid regex: {e}"
                ) from None
            self._rules.append((pattern, regex, _check_spec(pattern, spec)))
        self._matched = set()

    @classmethod
    def from_keras(cls, layout_map):
        """Rules from a `keras.distribution.LayoutMap`: each key is a regex
        `re.fullmatch`ed against variable paths, as in Keras, and each
        `TensorLayout`'s axes are the spec. Keys ending in "/output" are
        layouts of layer outputs (Keras' `Layer.__call__` asks for
        "<layer path>/output" and applies them with
        `keras.distribution.distribute_tensor`), not of weights: they are
        left out. Stricter than Keras: a weight key that matches no
        variable is an error when training starts.

        Example:

        >>> layout_map = keras.distribution.LayoutMap(device_mesh)
        >>> layout_map[".*dense.*kernel"] = (None, "model")
        >>> tfpar.LayoutRules.from_keras(layout_map)
        LayoutRules({'.*dense.*kernel': (None, 'model')})

        Args:
            layout_map: a `keras.distribution.LayoutMap` (or any mapping of
                regex to `TensorLayout` or tuple of axis names).
        """
        if not isinstance(layout_map, collections.abc.Mapping):
            raise TypeError(
                "LayoutRules.from_keras(layout_map) needs a "
                "keras.distribution.LayoutMap. Received: "
                f"layout_map={layout_map!r} of type "
                f"{type(layout_map).__name__}")
        return cls({
            key: tuple(getattr(layout, "axes", layout))
            for key, layout in layout_map.items()
            if not key.endswith("/output")})

    @property
    def patterns(self):
        return [pattern for pattern, _, _ in self._rules]

    def items(self):
        return [(pattern, spec) for pattern, _, spec in self._rules]

    def axes_used(self):
        """{axis name: first rule naming it} over all specs and styles."""
        axes = {}
        for pattern, _, spec in self._rules:
            for axis in (spec.axes() if is_style(spec) else spec):
                if axis is not None:
                    axes.setdefault(axis, pattern)
        return axes

    def spec_for(self, path, shape, layer=None):
        """The spec for the variable at `path` with `shape`, or None.

        A raw spec rule matches the variable path; a style rule (e.g.
        `tfpar.ColumnParallel()`) matches the path of the layer owning the
        variable, and the style lays out the weight given `layer`. Raises
        ValueError when two rules match `path` or the spec's length is not
        the variable's rank. Marks the matching rule as used.

        A LoRA factor of a kernel (`lora_kernel_a`/`lora_kernel_b`, made by
        Keras' `enable_lora`) that no spec rule names follows its kernel's
        spec (`lora_factor_spec`).
        """
        lora = self._lora_spec_for(path, shape, layer)
        if lora is not None:
            return lora
        hits = []
        for pattern, regex, spec in self._rules:
            if is_style(spec):
                match = layer_prefix_match(regex, path)
                if match is not None:
                    hits.append((pattern, (spec, match[1])))
            elif regex.fullmatch(path):
                hits.append((pattern, spec))
        if not hits:
            return None
        if len(hits) > 1:
            raise ValueError(
                f"Variable {path!r} is matched by {len(hits)} layout rules: "
                f"{[p for p, _ in hits]}. Each variable may match at most one "
                "rule; make the regexes exclusive."
            )
        pattern, spec = hits[0]
        self._matched.add(pattern)
        if isinstance(spec, tuple) and len(spec) == 2 and is_style(spec[0]):
            style, role = spec
            spec = style.spec_for(layer, role, tuple(shape))
        if len(spec) != len(shape):
            raise ValueError(
                f"Layout rule {pattern!r} gives spec {spec} with {len(spec)} "
                f"entries, but variable {path!r} has rank {len(shape)} "
                f"(shape={tuple(shape)}). Give one entry per dimension."
            )
        return spec

    def _lora_spec_for(self, path, shape, layer):
        """The spec of the LoRA factor at `path` derived from its layer's
        kernel's, or None: not a LoRA factor, no kernel known, a spec rule
        naming the factor itself (the rule wins), or a kernel the factor's
        shape does not fit (int4's packed kernel): the rules decide."""
        owner, _, name = path.rpartition("/")
        if name not in LORA_FACTORS:
            return None
        kernel = getattr(layer, "_kernel", None)
        if kernel is None or any(
                not is_style(spec) and regex.fullmatch(path)
                for _, regex, spec in self._rules):
            return None
        kernel_shape, shape = tuple(kernel.shape), tuple(shape)
        if (shape[:-1] != kernel_shape[:-1] if name == "lora_kernel_a"
                else shape[-1:] != kernel_shape[-1:]):
            return None
        kernel_spec = self.spec_for(f"{owner}/kernel", kernel_shape, layer)
        return None if kernel_spec is None else lora_factor_spec(
            name, kernel_spec)

    def pattern_for(self, path):
        """The pattern of the rule that lays out the variable at `path` (a
        spec rule matching it, or a style rule matching its layer), or None.
        Unlike `spec_for`, it marks no rule used.

        >>> tfpar.LayoutRules({r".*up/kernel": (None, "model")}).pattern_for(
        ...     "sequential/up/kernel")
        '.*up/kernel'
        """
        for pattern, regex, spec in self._rules:
            if (layer_prefix_match(regex, path) is not None
                    if is_style(spec) else regex.fullmatch(path)):
                return pattern
        return None

    def unmatched(self):
        """Patterns that have matched no variable so far."""
        return [p for p, _, _ in self._rules if p not in self._matched]

    def __len__(self):
        return len(self._rules)

    def __repr__(self):
        body = ", ".join(f"{p!r}: {s!r}" for p, _, s in self._rules)
        return f"LayoutRules({{{body}}})"


LORA_FACTORS = ("lora_kernel_a", "lora_kernel_b")

# The weights Keras' `quantize` adds beside a layer's int8/int4 (GPTQ,
# AWQ) kernel or table: per-channel or per-row scales, zero points, group
# indices. Constants: no call changes them.
QUANTIZATION_CONSTANTS = frozenset({
    "kernel_scale", "kernel_zero", "embeddings_scale", "embeddings_zero",
    "reverse_embeddings_scale", "reverse_embeddings_zero", "zero_point",
    "g_idx", "awq_scales"})
# And float8's (Keras' `quantize("float8")`): scales and amax histories,
# which every training call updates.
QUANTIZATION_STATE = QUANTIZATION_CONSTANTS | frozenset({
    "inputs_scale", "outputs_grad_scale", "inputs_amax_history",
    "kernel_amax_history", "outputs_grad_amax_history"})


def lora_factor_spec(name, kernel_spec):
    """The spec of LoRA factor `name` of a kernel laid out by `kernel_spec`.

    Keras' LoRA kernel is W + (alpha / r) * A @ B, with A of shape
    W.shape[:-1] + (r,) and B of shape (r, W.shape[-1]): A takes W's spec on
    its leading dimensions and B W's spec on the output dimension, the rank
    r is whole. A @ B contracts only the whole rank, so it is W's layout
    (no activation is gathered for it); the factor on W's split side is
    split like W, the other one (r wide) whole. (Keras computes A @ B of a
    rank-3 EinsumDense kernel with `tf.tensordot`, which flattens A to 2-D:
    when W is split on a middle dimension, as Llama's (hidden, heads,
    head_dim) query, DTensor gathers A forward and the gradient of A @ B
    backward; tests/test_pretrained_lora.py measures it.) For a Dense kernel (in, out) that is Megatron's convention:
    column-parallel (None, "model") gives A replicated, B (None, "model");
    row-parallel ("model", None) gives A ("model", None), B replicated.

    >>> tfpar.layout.lora_factor_spec("lora_kernel_a", (None, "model", None))
    (None, 'model', None)
    >>> tfpar.layout.lora_factor_spec("lora_kernel_b", (None, "model", None))
    (None, None)

    Args:
        name: "lora_kernel_a" or "lora_kernel_b".
        kernel_spec: the kernel's spec (a tuple, one entry per dimension).
    """
    if name not in LORA_FACTORS:
        raise ValueError(
            f"lora_factor_spec(name) takes one of {LORA_FACTORS}. Received: "
            f"name={name!r}")
    kernel_spec = tuple(kernel_spec)
    if name == "lora_kernel_a":
        return kernel_spec[:-1] + (None,)
    return (None, kernel_spec[-1])


def is_style(spec):
    return callable(getattr(spec, "spec_for", None))


def layer_prefix_match(regex, path):
    """(layer path, role) if `regex` fullmatches a layer prefix of `path`.

    The longest matching prefix wins: `.*attn` matches
    "block/attn/query/kernel" with role "query/kernel".
    """
    parts = path.split("/")
    for cut in range(len(parts) - 1, 0, -1):
        prefix = "/".join(parts[:cut])
        if regex.fullmatch(prefix):
            return prefix, "/".join(parts[cut:])
    return None


def _check_spec(pattern, spec):
    if is_style(spec):
        return spec
    if isinstance(spec, list):
        spec = tuple(spec)
    if not isinstance(spec, tuple) or not all(
        s is None or isinstance(s, str) for s in spec
    ):
        raise TypeError(
            f"Layout rule {pattern!r} needs a spec: a tuple of mesh axis names "
            f"or None, one per dimension, e.g. (None, 'model'), or a style "
            f"such as tfpar.ColumnParallel(). Received: {spec!r}"
        )
    named = [s for s in spec if s is not None]
    if len(set(named)) != len(named):
        raise ValueError(
            f"Layout rule {pattern!r} shards two dimensions over one mesh axis. "
            f"Received: {spec!r}. Name each mesh axis at most once."
        )
    return spec


def replicated_spec(rank):
    return (None,) * rank


def fully_sharded_spec(spec, shape, data_axis, mesh):
    """`spec` with `data_axis` added on the first dimension that `spec`
    leaves whole and that the data axis divides (FSDP / ZeRO-3 storage);
    `spec` itself when it already names the axis or no dimension fits.
    E.g. a (512, 1024) kernel with spec (None, "model") on a mesh with
    data=2 is stored as ("data", "model").
    """
    spec = tuple(spec)
    size = mesh.axis_size(data_axis)
    if size <= 1 or data_axis in spec:
        return spec
    for dim, (length, axis) in enumerate(zip(shape, spec)):
        if axis is None and length and length % size == 0:
            return spec[:dim] + (data_axis,) + spec[dim + 1:]
    return spec


def check_divisible(path, shape, spec, mesh):
    """Raises ValueError unless every sharded dimension splits evenly."""
    for dim, (size, axis) in enumerate(zip(shape, spec)):
        if axis is None:
            continue
        if axis not in mesh.shape:
            raise ValueError(
                f"Variable {path!r} is sharded over mesh axis {axis!r}, which "
                f"the mesh lacks. Received: spec={spec}, mesh={mesh!r}."
            )
        if size is not None and size % mesh.shape[axis]:
            raise ValueError(
                f"Variable {path!r} has dimension {dim} of size {size}, which "
                f"mesh axis {axis!r} of size {mesh.shape[axis]} does not divide. "
                f"Received: shape={tuple(shape)}, spec={spec}. Choose sizes "
                "divisible by the axis, or replicate that dimension (None)."
            )


_LAYOUT_CACHE = {}


def to_dtensor_layout(spec, mesh):
    """The DTensor layout for `spec` on `mesh` (cached).

    Axes of size 1 become unsharded: DTensor counts a size-1 axis as sharded,
    which some kernels (e.g. Conv2D filters) reject.
    """
    key = (spec, mesh)
    layout = _LAYOUT_CACHE.get(key)
    if layout is None:
        sharding = [
            dtensor.UNSHARDED
            if axis is None or mesh.axis_size(axis) == 1
            else axis
            for axis in spec
        ]
        layout = dtensor.Layout(sharding, mesh.dtensor_mesh)
        _LAYOUT_CACHE[key] = layout
    return layout


def spec_of(dtensor_layout):
    """Back from a DTensor layout to a spec tuple."""
    return tuple(
        None if s == dtensor.UNSHARDED else s
        for s in dtensor_layout.sharding_specs
    )


def axis_sizes_of(dtensor_layout):
    """{axis name: size} of the mesh of a DTensor layout."""
    dmesh = dtensor_layout.mesh
    return dict(zip(dmesh.dim_names, dmesh.shape()))


def block_shape(shape, spec, axis_sizes):
    """Shape of one device's block of a value of `shape` laid out by `spec`
    on a mesh with `axis_sizes` ({axis: size}): a dimension of size n split
    over an axis of size k has blocks of n / k."""
    return tuple(
        size if axis is None else size // axis_sizes.get(axis, 1)
        for size, axis in zip(shape, spec)
    )


def shard_shape(shape, spec, mesh):
    """Shape of one device's block for a variable of `shape` laid out by
    `spec` on the `tfpar.Mesh` `mesh`."""
    return block_shape(shape, spec, mesh.shape)


# -- planning: where a new variable goes ---------------------------------------

SpecPlan = collections.namedtuple("SpecPlan", "kind spec compute_spec")
SpecPlan.__doc__ = """A variable's planned layout: `kind` ("params",
"optimizer" or "other"), the `spec` it is stored with and the
`compute_spec` steps read it with (equal to `spec` unless a step gathers
it over the data axis)."""


def plan_specs(path, shape, mesh, *, rules=None, layer=None, trainable=True,
               data_axis="data", fsdp=False, layout=None, slot_of=None,
               expert_axis=None, context_axis=None):
    """How a variable is laid out: a pure function of what it is and of the
    parallel dimensions, called by `ParallelStrategy` for every variable it
    makes or re-lays out, and callable without a strategy (e.g. to plan a
    model before building it on a mesh).

    Optimizer slots (`slot_of`: the SpecPlan, or `tfpar.variables.Placement`,
    of the weight the slot is made for) follow their weight's stored spec
    when they have its rank, else are replicated. Other variables take
    `layout` (a `keras.Variable(layout=...)`, which wins as in Keras),
    else the `rules`' spec (matching `path`, or `layer` for styles), else
    replicated; every split dimension must divide evenly on `mesh`.
    Trainable ones are "params", the rest "other".

    In a step the data axis splits the batch, so a variable split over it
    (by fsdp or a rule) is computed with whole over that axis (its
    `compute_spec` drops the axis; a gather in the step) — except, when
    `expert_axis` is the data axis (GShard's placement), a split of the
    first dimension over it, which is an expert bank's split along its
    experts: each device computes with its own experts (`tfpar.experts`),
    so nothing is gathered. With `fsdp`, a
    "params" variable is also stored split over the data axis on its first
    dimension the rule leaves whole and the axis divides
    (`fully_sharded_spec`), and, on a mesh whose `context_axis` has size
    > 1, over the context axis on the next such dimension (ZeRO over the
    data x context group; a DTensor dimension is split over one mesh axis
    only, tests/dtensor_combined_axes_repro.py). The context axis splits
    the sequence in a step, so it is gathered there as the data axis.

    Example:

    >>> mesh = tfpar.Mesh({"data": 2, "model": 4})
    >>> rules = tfpar.LayoutRules({r".*up/kernel": (None, "model")})
    >>> tfpar.layout.plan_specs("up/kernel", (512, 1024), mesh, rules=rules,
    ...                         fsdp=True)
    SpecPlan(kind='params', spec=('data', 'model'), compute_spec=(None, 'model'))

    Args:
        path: the variable's path, e.g. "sequential/up/kernel".
        shape: its global shape.
        mesh: the `tfpar.Mesh` (a pipeline stage's sub-mesh) it lives on.
        rules: a `LayoutRules` (None: replicate).
        layer: the Keras layer owning it (for style rules), or None.
        trainable: whether it is a trainable weight.
        data_axis: the mesh axis the batch is split over.
        fsdp: whether trainable weights are also split over `data_axis`.
        layout: an explicit spec for it, or None.
        slot_of: for an optimizer slot, its weight's plan; else None.
        expert_axis: the mesh axis expert banks are split over, or None.
        context_axis: the mesh axis sequences are split over, or None.

    Returns:
        A `SpecPlan(kind, spec, compute_spec)`.
    """
    if slot_of is not None:
        if slot_of.kind == "params" and len(shape) == len(slot_of.spec):
            return SpecPlan("optimizer", slot_of.spec, slot_of.spec)
        spec = replicated_spec(len(shape))
        return SpecPlan("optimizer", spec, spec)
    spec = _explicit_or_ruled_spec(path, shape, rules, layer, layout)
    check_divisible(path, shape, spec, mesh)
    kind = "params" if trainable else "other"
    compute = spec
    if mesh.axis_size(data_axis) > 1:
        banks = expert_axis == data_axis  # dimension 0 stays split
        compute = tuple(axis if axis != data_axis or (banks and d == 0)
                        else None for d, axis in enumerate(spec))
    context = context_axis if context_axis in mesh.shape and mesh.axis_size(
        context_axis) > 1 else None
    if context is not None:
        compute = tuple(None if axis == context else axis
                        for axis in compute)
    if fsdp and kind == "params":
        spec = fully_sharded_spec(spec, shape, data_axis, mesh)
        if context is not None:
            spec = fully_sharded_spec(spec, shape, context, mesh)
    return SpecPlan(kind, spec, compute)


def _explicit_or_ruled_spec(path, shape, rules, layer, layout):
    """`layout` (checked against the rank), else the rules', else None."""
    if layout is not None:
        if len(layout) != len(shape):
            raise ValueError(
                f"Variable {path!r} was given layout={layout} with "
                f"{len(layout)} axes, but has rank {len(shape)} "
                f"(shape={tuple(shape)}). Give one mesh axis name or None "
                "per dimension.")
        return tuple(layout)
    spec = None if rules is None else rules.spec_for(path, shape, layer)
    return replicated_spec(len(shape)) if spec is None else spec
