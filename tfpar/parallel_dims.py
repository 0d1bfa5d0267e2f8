"""The parallel dimensions of a `ParallelStrategy`, validated in one place.

`ParallelDims` is the frozen record of how a mesh is used: which axis
splits the batch (data), which one holds pipeline stages (pipe), the
remaining axes (tensor/model parallelism), and the data-parallel options
(fsdp, reshard_after_forward, offload, per_host_input). Every check runs
when it is made, with the error messages `ParallelStrategy` raises; the
sizes the rest of tfpar needs are derived from it.

Example:

>>> import tfpar
>>> tfpar.use_virtual_cpus(8)
>>> from tfpar.parallel_dims import ParallelDims
>>> dims = ParallelDims(tfpar.Mesh({"data": 2, "model": 4}), fsdp=True)
>>> dims.data_parallel_size, dims.num_stages, dims.model_parallel_size
(2, 1, 4)
"""

import dataclasses
import functools

from tfpar.mesh import Mesh

OFFLOAD_OPTIONS = (None, "optimizer", "optimizer+master")


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
        offload: None (the only value available today).
        per_host_input: whether each host feeds only its share of a batch.
    """

    mesh: Mesh
    data_axis: str = "data"
    pipeline_axis: str = "pipe"
    fsdp: bool = False
    reshard_after_forward: bool = False
    offload: object = None
    per_host_input: bool = False

    def __post_init__(self):
        check_mesh(self.mesh)
        _check_axis_name("data_axis", self.data_axis)
        _check_axis_name("pipeline_axis", self.pipeline_axis)
        if self.pipeline_axis == self.data_axis:
            raise ValueError(
                "ParallelStrategy needs different data and pipeline axes. "
                f"Received: data_axis={self.data_axis!r}, "
                f"pipeline_axis={self.pipeline_axis!r}"
            )
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
        _check_offload(self.offload, self.mesh)

    @property
    def data_parallel_size(self):
        """How many ways the batch is split (the data axis size, or 1)."""
        return self.mesh.axis_size(self.data_axis)

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

    def check_rules(self, rules):
        """Raises unless every axis `rules` (a `LayoutRules`) names is a
        mesh axis other than a pipeline axis of size > 1."""
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


def check_mesh(mesh):
    """Raises TypeError unless `mesh` is a `tfpar.Mesh`."""
    if not isinstance(mesh, Mesh):
        raise TypeError(
            "ParallelStrategy(mesh) needs a tfpar.Mesh, e.g. "
            "tfpar.Mesh({'data': 2, 'model': 4}). "
            f"Received: mesh={mesh!r} of type {type(mesh).__name__}"
        )


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
