"""The parallel dimensions of a `ParallelStrategy`, validated in one place.

`ParallelDims` is the frozen record of how a mesh is used: which axis
splits the batch (data), which one holds pipeline stages (pipe), which
one the tensor-parallel styles split weights over (model), how many model
parts each pipeline stage holds (virtual stages), and the data-parallel
options (fsdp, reshard_after_forward, offload, per_host_input). Every check
runs when it is made, with the error messages `ParallelStrategy` raises; the
sizes the rest of tfpar needs are derived from it. What is declared here
need not be repeated: `tfpar.PipelineModel`'s `virtual_stages`, the styles'
axis (`ColumnParallel()` etc.) and `tfpar.auto_rules`' axis default to the
current strategy's dims, and an explicit value contradicting them is an
error naming both (`resolve_virtual_stages`, `resolve_model_axis`).

Example:

>>> import tfpar
>>> tfpar.use_virtual_cpus(8)
>>> from tfpar.parallel_dims import ParallelDims
>>> dims = ParallelDims(tfpar.Mesh({"data": 2, "model": 4}), fsdp=True)
>>> dims.data_parallel_size, dims.num_stages, dims.model_parallel_size
(2, 1, 4)
>>> dims = ParallelDims(tfpar.Mesh({"pipe": 2, "data": 4}), virtual_stages=2)
>>> dims.model_axis, dims.parts_per_stage, dims.num_parts
('model', 2, 4)
"""

import dataclasses
import functools

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import layout as layout_lib
from tfpar.mesh import Mesh, default_devices, short_device_name

OFFLOAD_OPTIONS = (None, "optimizer", "optimizer+master")
DEFAULT_MODEL_AXIS = "model"
DEFAULT_EXPERT_AXIS = "expert"
# The roles a mesh axis can play, each with the option declaring its axis
# (and the conventional name it defaults to).
ROLE_OPTIONS = {"data": "data_axis", "pipe": "pipeline_axis",
                "model": "model_axis", "expert": "expert_axis",
                "context": "context_axis"}


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """How a `tfpar.Mesh` is used (see the module docstring and
    `ParallelStrategy` for each option). Raises the errors
    `ParallelStrategy(...)` documents for invalid combinations.

    Attributes:
        mesh: the `tfpar.Mesh`.
        data_axis: the axis the batch is split over (absent: size 1).
        pipeline_axis: the axis whose coordinates are pipeline stages.
        fsdp: whether trainable weights are also split over `data_axis`.
        reshard_after_forward: whether fsdp gathers again for the
            backward pass.
        offload: None, "optimizer" (optimizer state and its update on
            the host devices, `tfpar.offload`) or "optimizer+master" (the
            float32 master weights there too, `tfpar.offload.master`).
        offload_devices: the host devices offload moves each mesh device's
            blocks to (one per mesh device, in mesh order), or None: the
            DTensor host mesh of an accelerator mesh.
        per_host_input: whether each host feeds only its share of a batch.
        model_axis: the axis tensor-parallel styles split weights over
            (the default axis of `ColumnParallel()`, `RowParallel()`,
            `SequenceParallel()` and `auto_rules`; absent: size 1).
        virtual_stages: model parts per pipeline stage of a
            `tfpar.PipelineModel` (an int >= 1), or None: not declared
            (the PipelineModel's own argument, default 1).
        expert_axis: the axis mixture-of-experts layers split their expert
            banks over (absent: size 1). It may be the data axis
            (`experts_carry_data`): GShard's placement, the data axis then
            also splits the expert banks along their experts and each
            device dispatches its own tokens to every expert (two token
            exchanges over data per MoE block, no layer repeated; see
            `tfpar.experts`).
        context_axis: the axis long sequences are split over (absent:
            size 1).

    Axis roles, one rule: every mesh axis of size > 1 plays a role — it is
    the data, pipeline, model, expert or context axis (by its conventional
    name or as declared here), or the strategy's layout rules name it (an
    extra axis weights are split over). The axes of different roles
    differ, with one exception: `expert_axis` may equal `data_axis` (the
    batch and the expert banks split over the same devices, as GShard and
    DeepSpeed-MoE place experts across data-parallel ranks; `role_of`
    answers "data" for it). Any other axis is an error
    (`check_roles`): it would copy every tensor to each of its devices,
    e.g. `Mesh({"batch": 4})` with the default `data_axis="data"` would
    train the whole batch on every device.
    """

    mesh: Mesh
    data_axis: str = "data"
    pipeline_axis: str = "pipe"
    fsdp: bool = False
    reshard_after_forward: bool = False
    offload: object = None
    per_host_input: bool = False
    model_axis: str = DEFAULT_MODEL_AXIS
    virtual_stages: object = None
    offload_devices: object = None
    expert_axis: str = DEFAULT_EXPERT_AXIS
    context_axis: str = "context"

    def __post_init__(self):
        check_mesh(self.mesh)
        self._check_axes()
        if self.virtual_stages is not None:
            check_virtual_stages(self.virtual_stages, "ParallelStrategy")
        _check_bool("fsdp", self.fsdp)
        if self.fsdp and self.data_parallel_size == 1:
            raise ValueError(
                "ParallelStrategy(fsdp=True) shards weights over the data "
                f"axis {self.data_axis!r}, which this mesh lacks or has of "
                f"size 1. Received: mesh={self.mesh!r}, "
                f"data_axis={self.data_axis!r}. Add a data axis of size > 1 "
                "or leave fsdp=False."
            )
        _check_bool("reshard_after_forward", self.reshard_after_forward)
        if self.reshard_after_forward and not self.fsdp:
            raise ValueError(
                "ParallelStrategy(reshard_after_forward=True) frees the "
                "weights fsdp gathers, so it needs fsdp=True. Received: "
                "fsdp=False. Pass fsdp=True too, or drop "
                "reshard_after_forward."
            )
        _check_bool("per_host_input", self.per_host_input)
        _check_offload(self.offload, self.offload_devices, self.mesh)

    def _check_axes(self):
        """Axis names are strings; the axes of different roles differ, but
        the expert axis may be the data axis (`experts_carry_data`)."""
        named = {}
        for role, option in ROLE_OPTIONS.items():
            value = getattr(self, option)
            _check_axis_name(option, value)
            if role == "expert" and named.get(value) == "data":
                continue  # GShard's placement: experts across data ranks
            if value in named:
                raise ValueError(
                    f"ParallelStrategy needs different {named[value]} and "
                    f"{role} axes. Received: "
                    f"{ROLE_OPTIONS[named[value]]}={value!r}, "
                    f"{option}={value!r}")
            named[value] = role

    def role_of(self, axis):
        """The role ("data", "pipe", "model", "expert", "context") the mesh
        axis named `axis` plays by declaration or convention, else None."""
        for role, option in ROLE_OPTIONS.items():
            if getattr(self, option) == axis:
                return role
        return None

    def check_roles(self, rules):
        """Raises unless every mesh axis of size > 1 plays a role: a role
        axis (`role_of`) or an axis `rules` (a `LayoutRules`) names."""
        named = set(rules.axes_used())
        idle = {axis: self.mesh.axis_size(axis)
                for axis in self.mesh.axis_names
                if self.mesh.axis_size(axis) > 1
                and self.role_of(axis) is None and axis not in named}
        if not idle:
            return
        declared = ", ".join(f"{option}={getattr(self, option)!r}"
                             for option in ROLE_OPTIONS.values())
        first = next(iter(idle))
        raise ValueError(
            f"Mesh axes {idle} play no role: they are not the data, "
            "pipeline, model, expert or context axis and no layout rule "
            "names them, so every tensor would be copied whole to each of "
            "their devices (the batch too: each device would train on all "
            f"of it). Received: mesh={self.mesh!r} with {declared}. Declare "
            f"the role, e.g. ParallelStrategy(..., data_axis={first!r}) to "
            "split the batch over it, name the axis in a layout rule, or "
            "use a conventional axis name (data, pipe, model, expert, "
            "context).")

    @property
    def data_parallel_size(self):
        """How many ways the batch is split (the data axis size, or 1)."""
        return self.mesh.axis_size(self.data_axis)

    def batch_split(self, batch_size):
        """The data axis when a batch of `batch_size` rows is split over it
        (the axis has more than one device and divides the batch, as the
        inputs are split), else None: the one answer to "is this batch
        split?" for layouts chosen inside a step.

        >>> import tfpar
        >>> dims = ParallelDims(tfpar.Mesh({"data": 2, "model": 4}))
        >>> dims.batch_split(8), dims.batch_split(3), dims.batch_split(None)
        ('data', None, None)
        """
        size = self.data_parallel_size
        if size > 1 and batch_size is not None and batch_size % size == 0:
            return self.data_axis
        return None

    @property
    def expert_parallel_size(self):
        """How many ways expert banks are split (the expert axis size, 1
        without one)."""
        return self.mesh.axis_size(self.expert_axis)

    @property
    def experts_carry_data(self):
        """Whether the expert axis is the data axis: each device holds its
        own tokens and its own experts, and MoE blocks exchange token slots
        over data (`tfpar.experts`)."""
        return self.expert_axis == self.data_axis

    @property
    def context_parallel_size(self):
        """How many ways sequences are split (the context axis size, 1
        without one)."""
        return self.mesh.axis_size(self.context_axis)

    @property
    def num_stages(self):
        """Pipeline stages: the size of the pipeline axis (1 without one)."""
        return self.mesh.axis_size(self.pipeline_axis)

    @property
    def model_axes(self):
        """{axis: size} of the axes of size > 1 other than data and pipe:
        the ones tensor (model) parallelism splits weights over."""
        return {axis: self.mesh.axis_size(axis)
                for axis in self.mesh.axis_names
                if axis not in (self.data_axis, self.pipeline_axis)
                and self.mesh.axis_size(axis) > 1}

    @property
    def model_parallel_size(self):
        """Devices one data-parallel replica of a stage spans: the product
        of the model axes' sizes (1 without any)."""
        size = 1
        for axis_size in self.model_axes.values():
            size *= axis_size
        return size

    @property
    def tensor_parallel_size(self):
        """How many ways the styles split a weight: the model axis size
        (1 when the mesh lacks it)."""
        return self.mesh.axis_size(self.model_axis)

    @property
    def parts_per_stage(self):
        """v, model parts per pipeline stage: `virtual_stages`, 1 when not
        declared."""
        return self.virtual_stages or 1

    @property
    def num_parts(self):
        """v × p, the model parts of a `PipelineModel` on this mesh."""
        return self.parts_per_stage * self.num_stages

    def resolve_virtual_stages(self, given, owner="PipelineModel"):
        """The v an `owner` (e.g. `PipelineModel(virtual_stages=given)`)
        uses: `given` when the dims declare none, the declared one when
        `given` is None; a ValueError naming both when they differ."""
        if given is None:
            return self.parts_per_stage
        check_virtual_stages(given, owner)
        if self.virtual_stages is not None and given != self.virtual_stages:
            raise ValueError(
                f"{owner}(virtual_stages={given}) contradicts the strategy's "
                f"ParallelStrategy(virtual_stages={self.virtual_stages}). "
                f"Received: virtual_stages={given}. Declare it once: leave "
                f"{owner}'s virtual_stages out, or pass the same value.")
        return given

    def resolve_axis(self, role, given, owner, argument="axis"):
        """The axis of `role` (a key of `ROLE_OPTIONS`) an `owner` (a
        style, `auto_rules`) uses: the dims' when `given` (its `argument`)
        is None; a ValueError naming both when they differ."""
        option = ROLE_OPTIONS[role]
        declared = getattr(self, option)
        if given is None or given == declared:
            return declared
        raise ValueError(
            f"{owner}({argument}={given!r}) contradicts the strategy's "
            f"{role} axis ParallelStrategy({option}={declared!r}). "
            f"Received: {argument}={given!r}. Declare it once: leave "
            f"{argument} out (it defaults to {declared!r}), or pass "
            f"ParallelStrategy({option}={given!r}).")

    def resolve_model_axis(self, given, owner):
        """`resolve_axis` of the model axis."""
        return self.resolve_axis("model", given, owner)

    def bind_rules(self, rules):
        """A fresh `LayoutRules` of `rules` (its own record of used rules)
        whose styles split over this model axis (`Style.on_axis`); raises
        unless every axis it names is usable (`check_rules`)."""
        if not isinstance(rules, layout_lib.LayoutRules):
            rules = layout_lib.LayoutRules(rules)
        bound = layout_lib.LayoutRules({
            pattern: (spec.on_axis(self.resolve_model_axis(
                spec.given_axis, type(spec).__name__))
                if callable(getattr(spec, "on_axis", None)) else spec)
            for pattern, spec in rules.items()})
        self.check_rules(bound)
        return bound

    @functools.cached_property
    def stage_meshes(self):
        """The sub-mesh of every pipeline stage ((mesh,) without a pipeline):
        the other axes at one coordinate of the pipeline axis."""
        if self.num_stages == 1:
            return (self.mesh,)
        return tuple(self.mesh.submesh(self.pipeline_axis, s)
                     for s in range(self.num_stages))

    @property
    def real_all_gathers(self):
        """Whether steps compile all-gathers as CollectiveGatherV2 ops: under
        fsdp on a mesh with one axis of size > 1, where no relayout can
        gather over two axes (see `_compat.collective_all_gathers`)."""
        return self.fsdp and sum(
            self.mesh.axis_size(a) > 1 for a in self.mesh.axis_names) == 1

    def _check_one_sequence_split(self, rules):
        """Sequence parallelism (Megatron-SP: the sequence split over the
        model axis between blocks) and a context axis (the sequence split
        over it everywhere) cannot split one dimension over two axes where
        they meet: DTensor 2.21 fails to compile the step ("label 'b' is
        mapped to mesh dimension 'model' and 'context'",
        tests/test_context_embedding.py). Refused before training."""
        patterns = _sequence_parallel_rules(rules)
        if patterns and self.context_parallel_size > 1:
            raise ValueError(
                f"Layout rule {patterns[0]!r} turns on sequence parallelism "
                f"(sequence_parallel=True), and the mesh splits sequences "
                f"over its context axis {self.context_axis!r} of size "
                f"{self.context_parallel_size}: DTensor 2.21 cannot split "
                "the sequence over both. Received: sequence-parallel rules "
                f"{patterns}. Leave sequence_parallel=False beside a "
                "context axis (the context axis already splits every "
                "activation along the sequence).")

    def check_rules(self, rules):
        """Raises unless every axis `rules` (a `LayoutRules`) names is a
        mesh axis other than a pipeline axis of size > 1, and no style
        splits the sequence (sequence parallelism) beside a context axis."""
        self._check_one_sequence_split(rules)
        for axis, pattern in rules.axes_used().items():
            if axis == self.pipeline_axis and self.num_stages > 1:
                raise ValueError(
                    f"Layout rule {pattern!r} shards over the pipeline axis "
                    f"{axis!r}. Pipeline stages own whole layers, so rules "
                    "may only name the other axes "
                    f"{[a for a in self.mesh.axis_names if a != axis]}. "
                    f"Received: rule {pattern!r}."
                )
            if axis not in self.mesh.shape:
                raise ValueError(
                    f"Layout rule {pattern!r} names mesh axis {axis!r}, "
                    "which the mesh lacks. Received: mesh axes "
                    f"{self.mesh.axis_names}. Use one of the mesh's axis "
                    "names or add that axis."
                )


def _sequence_parallel_rules(rules):
    """The patterns of `rules` whose styles turn sequence parallelism on."""
    return [pattern for pattern, spec in rules.items()
            if getattr(spec, "sequence_parallel", False)]


def current():
    """The `ParallelDims` of the current `tf.distribute` strategy when it is
    a `tfpar.ParallelStrategy` (inside its scope), else None."""
    dims = getattr(tf.distribute.get_strategy(), "dims", None)
    return dims if isinstance(dims, ParallelDims) else None


def check_virtual_stages(value, owner):
    """Raises unless `value` (`owner`'s virtual_stages) is an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{owner}(virtual_stages) needs an int >= 1 (model "
            f"parts per stage). Received: virtual_stages={value!r}")


def check_mesh(mesh):
    """Raises TypeError unless `mesh` is a `tfpar.Mesh`, and ValueError
    (on every host alike) when, across hosts, some host holds none of its
    devices: every host runs every step, and TensorFlow crashes on a host
    running a step on a mesh it holds nothing of."""
    if not isinstance(mesh, Mesh):
        raise TypeError(
            "ParallelStrategy(mesh) needs a tfpar.Mesh, e.g. "
            "tfpar.Mesh({'data': 2, 'model': 4}). "
            f"Received: mesh={mesh!r} of type {type(mesh).__name__}"
        )
    hosts = dtensor.num_clients()
    missing = sorted(set(range(hosts)) - set(mesh.hosts()))
    if missing:
        raise ValueError(
            "Across hosts the strategy's mesh must include devices of every "
            f"host (each host runs every step). Received: mesh={mesh!r} on "
            f"host(s) {list(mesh.hosts())} of {hosts}; host(s) {missing} "
            "hold none of it. Use all devices (tfpar.Mesh({...}) without "
            "devices=), or the same devices of every host.")


def _check_axis_name(option, value):
    if not isinstance(value, str):
        raise TypeError(
            f"ParallelStrategy({option}) needs a mesh axis name (str). "
            f"Received: {option}={value!r}"
        )


def _check_bool(option, value):
    if not isinstance(value, bool):
        raise TypeError(
            f"ParallelStrategy({option}) needs True or False. "
            f"Received: {option}={value!r}"
        )


def _check_offload(offload, devices, mesh):
    """Refuses `offload` values, and offload where it cannot be done (see
    `tfpar.offload`): before any variable is made."""
    if offload not in OFFLOAD_OPTIONS:
        raise ValueError(
            "ParallelStrategy(offload) is one of "
            f"{list(OFFLOAD_OPTIONS)}. Received: offload={offload!r}")
    if offload is None:
        if devices is not None:
            raise ValueError(
                "ParallelStrategy(offload_devices) names the host devices of "
                "offload=\"optimizer\". Received: offload=None, "
                f"offload_devices={devices!r}. Pass offload=\"optimizer\" "
                "too, or drop offload_devices.")
        return
    _check_offload_host(offload, devices, mesh)


def _check_offload_host(offload, devices, mesh):
    """Offload needs a host: `devices` (checked), or DTensor's host mesh of
    an accelerator mesh (one logical CPU per device)."""
    if devices is not None:
        _check_offload_devices(devices, mesh)
        return
    if dtensor.num_clients() > 1:
        raise ValueError(
            f"ParallelStrategy(offload={offload!r}) across hosts needs the "
            "host devices named: each mesh device's own host's CPU "
            f"(offload_devices=[...], {mesh.size} cluster-wide names, e.g. "
            "after tfpar.use_virtual_cpus(8) on 2 hosts a mesh on CPU:0-3 "
            "and CPU:8-11, offload_devices CPU:4-7 and CPU:12-15). "
            f"Received: mesh={mesh!r}, offload_devices=None "
            f"({dtensor.num_clients()} hosts).")
    if mesh.device_type == "CPU":
        raise ValueError(
            f"ParallelStrategy(offload={offload!r}) moves optimizer "
            "state from the devices to the host, but this mesh's "
            "devices are the host's CPUs (DTensor's host mesh of a CPU "
            "mesh is the mesh itself), so there is nothing to offload "
            f"to. Received: mesh={mesh!r}. Name {mesh.size} other "
            "devices to hold it (offload_devices=[...], e.g. after "
            f"tfpar.use_virtual_cpus({2 * mesh.size}) a mesh on CPU:0-"
            f"{mesh.size - 1} and offload_devices=[f'CPU:{{i}}' for i in "
            f"range({mesh.size}, {2 * mesh.size})]), or use "
            "offload=None; fsdp=True splits optimizer state over the "
            "data axis instead.")
    cpus = len(tf.config.list_logical_devices("CPU"))
    if cpus < mesh.size:
        raise ValueError(
            f"ParallelStrategy(offload={offload!r}) keeps the state on "
            f"DTensor's host mesh of this {mesh.device_type} mesh: one "
            f"logical CPU per device, {mesh.size}, but this host has "
            f"{cpus}. Received: mesh={mesh!r}. Split the CPU before TF "
            "starts (tf.config.set_logical_device_configuration(cpu, "
            f"[tf.config.LogicalDeviceConfiguration()] * {mesh.size})), "
            "or name the devices: offload_devices=[...].")


def _other_hosts(names, mesh):
    """[(mesh device, host device)] on different hosts (global device i is
    on host i // L, L devices per host); [] on one host."""
    if dtensor.num_clients() == 1:
        return []
    per_host = dtensor.num_local_devices(mesh.device_type)

    def host(name):
        return int(name.rsplit(":", 1)[1]) // per_host

    return [(d, n) for d, n in zip(mesh.devices, names) if host(d) != host(n)]


def _check_offload_devices(devices, mesh):
    """`devices`: one existing device per mesh device, none of the mesh's."""
    names = [short_device_name(str(d)) for d in devices] if isinstance(
        devices, (list, tuple)) else None
    problem = None
    known = {short_device_name(d.name) for d in tf.config.list_logical_devices()}
    known |= set(default_devices())  # across hosts: every host's, by global name
    if names is None or len(names) != mesh.size:
        problem = f"a list of {mesh.size} device names (one per mesh device)"
    elif len(set(names)) != len(names):
        problem = "distinct devices"
    elif set(names) & {short_device_name(d) for d in mesh.devices}:
        problem = "devices outside the mesh (the host to offload to)"
    elif not set(names) <= known:
        problem = (f"existing devices (unknown: "
                   f"{sorted(set(names) - known)[:4]})")
    elif _other_hosts(names, mesh):
        problem = ("each mesh device's host device on its own host (a "
                   f"block moves within its host; not so for "
                   f"{_other_hosts(names, mesh)[:2]})")
    if problem:
        raise ValueError(
            f"ParallelStrategy(offload_devices) needs {problem}. Received: "
            f"offload_devices={devices!r} for mesh={mesh!r}. Name one host "
            "device per mesh device, in mesh order.")
