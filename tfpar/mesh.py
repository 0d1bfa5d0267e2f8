"""Named device meshes and virtual CPU devices.

A `Mesh` is an ordered set of named axes over a list of devices, e.g.
`Mesh({"data": 2, "model": 4})` arranges 8 devices as a 2 x 4 grid whose rows
split the batch and whose columns split the weights. It is a thin, validated
front for `tf.experimental.dtensor.Mesh`.
"""

import collections.abc
import math

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import logs

_DEVICE_PREFERENCE = ("TPU", "GPU", "CPU")


def use_virtual_cpus(n):
    """Splits the host CPU into `n` logical devices (for tests and demos).

    Must run before TensorFlow initialises its devices. Calling it again with
    the same `n` is a no-op.

    Example:

    >>> import tfpar
    >>> tfpar.use_virtual_cpus(8)
    >>> len(tf.config.list_logical_devices("CPU"))
    8

    Args:
        n: number of logical CPU devices, a positive int.

    Raises:
        ValueError: `n` is not a positive int.
        RuntimeError: TensorFlow already initialised its devices with another
            number of logical CPUs.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(
            f"use_virtual_cpus(n) needs a positive int. Received: n={n!r}"
        )
    with logs.filtered_stderr(logs.NO_GPU_DRIVER_LINES):  # CPUs need no GPU
        cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is not None and len(current) == n:
        return
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * n
        )
    except RuntimeError:
        existing = len(tf.config.list_logical_devices("CPU"))
        if existing == n:
            return
        raise RuntimeError(
            f"use_virtual_cpus({n}) was called after TensorFlow initialised "
            f"its devices with {existing} logical CPU(s). Received: n={n}. "
            "Call tfpar.use_virtual_cpus(n) first thing in the program, "
            "before any TensorFlow op, model or strategy is created."
        ) from None


def default_device_type():
    """The device type tfpar uses by default: "TPU", else "GPU", else "CPU"."""
    devices = _pick_devices(tf.config.list_logical_devices())
    return devices[0].split(":")[0] if devices else "CPU"


def default_devices():
    """All logical devices of `default_device_type()`, in index order.

    Example:

    >>> tfpar.use_virtual_cpus(8)
    >>> tfpar.mesh.default_devices()[:3]
    ['CPU:0', 'CPU:1', 'CPU:2']

    Raises:
        RuntimeError: TensorFlow lists no TPU, GPU or CPU device.
    """
    logical = tf.config.list_logical_devices()
    devices = _pick_devices(logical)
    if not devices:
        raise RuntimeError(
            "tfpar found no TPU, GPU or CPU device. Received: logical "
            f"devices={[d.name for d in logical]!r}. Check the TensorFlow "
            "install with `python -m tfpar.env`."
        )
    return _global_names(devices)


def _global_names(local_devices):
    """With several hosts (`tfpar.connect_hosts`) the mesh devices are the
    cluster's: host h's local device k is global device h * L + k (L
    devices per host, DTensor's numbering). One host: `local_devices`."""
    hosts = dtensor.num_clients()
    if hosts == 1:
        return local_devices
    kind = local_devices[0].split(":")[0]
    return [f"{kind}:{i}" for i in range(hosts * len(local_devices))]


def _pick_devices(logical_devices):
    """Chooses the default mesh devices from a list of logical devices.

    A pure function (no TensorFlow calls), so it can be tested with made-up
    device lists: all TPU cores if there are any, else all GPUs, else all
    CPUs, as short names ordered by numeric index ("GPU:2" before "GPU:10").
    Other device types (e.g. "TPU_SYSTEM") are ignored; a short name listed
    twice (the same index in two jobs) is kept once.

    Example:

    >>> _pick_devices([("CPU", "CPU:0"), ("GPU", "GPU:10"), ("GPU", "GPU:2")])
    ['GPU:2', 'GPU:10']

    Args:
        logical_devices: `tf.config.LogicalDevice`s, or any objects with
            `.name` and `.device_type`, or `(device_type, name)` pairs.

    Returns:
        A list of short device names like "GPU:0"; empty when there is no
        TPU, GPU or CPU device.
    """
    by_type = {}
    for device in logical_devices:
        # Attributes first: a LogicalDevice is a (name, device_type) tuple.
        if hasattr(device, "name") and hasattr(device, "device_type"):
            device_type, name = device.device_type, device.name
        elif isinstance(device, tuple) and len(device) == 2:
            device_type, name = device
        else:
            raise TypeError(
                "_pick_devices(logical_devices) needs LogicalDevice-like "
                "objects (with .name and .device_type) or (device_type, name) "
                f"pairs. Received: {device!r} in logical_devices="
                f"{list(logical_devices)!r}"
            )
        short = short_device_name(name)
        by_type.setdefault(str(device_type).upper(), {})[short] = None
    for device_type in _DEVICE_PREFERENCE:
        if by_type.get(device_type):
            return sorted(by_type[device_type], key=device_index)
    return []


def device_index(name):
    """7 for "CPU:7" (across hosts a global device name: host 7 // L's
    local device 7 mod L, L devices per host)."""
    return int(name.rsplit(":", 1)[-1])


def short_device_name(name):
    """'/job:localhost/replica:0/task:0/device:CPU:3' -> 'CPU:3'."""
    return name.rsplit("device:", 1)[-1]


class Mesh:
    """A named grid of devices.

    Axis sizes multiply to the number of devices; devices fill the grid in
    row-major order, so in `Mesh({"data": 2, "model": 4})` devices 0-3 form
    data row 0 and devices 4-7 data row 1 (model groups are neighbours).

    Example:

    >>> tfpar.use_virtual_cpus(8)
    >>> mesh = tfpar.Mesh({"data": 2, "model": 4})
    >>> mesh
    Mesh({'data': 2, 'model': 4}, devices=CPU:0..CPU:7)
    >>> mesh.shape["model"]
    4

    Args:
        axes: ordered mapping of axis name (str) to size (positive int).
        devices: optional list of device names ("CPU:3", "/device:GPU:0", ...),
            possibly a subset of the machine's devices. Defaults to all TPU
            cores, else all GPUs, else all logical CPUs (on a TPU host call
            `tfpar.connect_tpu()` first so the TPU cores are listed).
    """

    def __init__(self, axes, devices=None):
        if not isinstance(axes, collections.abc.Mapping) or not axes:
            raise TypeError(
                "Mesh(axes) needs a non-empty mapping of axis name to size, "
                f"e.g. {{'data': 2, 'model': 4}}. Received: axes={axes!r}"
            )
        for name, size in axes.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(
                    "Mesh axis names must be identifiers like 'data'. "
                    f"Received: axis name {name!r} in axes={dict(axes)!r}"
                )
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(
                    f"Mesh axis {name!r} needs a positive int size. "
                    f"Received: axes={dict(axes)!r}"
                )
        self._axes = dict(axes)
        if devices is None:
            devices = default_devices()
        else:
            devices = _normalize_devices(devices)
        size = math.prod(self._axes.values())
        if size != len(devices):
            hint = ""
            if size > len(devices) and devices[0].split(":")[-2] == "CPU":
                hint = (f" On CPU, call tfpar.use_virtual_cpus({size}) first "
                        "thing in the program to split the host into "
                        f"{size} devices.")
            raise ValueError(
                f"Mesh axes multiply to {size} but "
                f"{len(devices)} device(s) are given. Received: "
                f"axes={self._axes!r}, devices={_device_range(devices)}. "
                "Choose axis sizes whose product is the number of devices, "
                f"or pass `devices=` with that many devices.{hint}"
            )
        self._devices = tuple(devices)
        self._dtensor_mesh = None

    @classmethod
    def from_keras(cls, device_mesh):
        """The mesh a `keras.distribution.DeviceMesh` describes: the same
        axis names and sizes over the same devices, in the same order.

        Example:

        >>> device_mesh = keras.distribution.DeviceMesh(
        ...     (2, 4), ("batch", "model"),
        ...     devices=keras.distribution.list_devices())
        >>> tfpar.Mesh.from_keras(device_mesh)
        Mesh({'batch': 2, 'model': 4}, devices=CPU:0..CPU:7)

        Args:
            device_mesh: a `keras.distribution.DeviceMesh`.
        """
        names = getattr(device_mesh, "axis_names", None)
        shape = getattr(device_mesh, "shape", None)
        devices = getattr(device_mesh, "devices", None)
        if names is None or shape is None or devices is None:
            raise TypeError(
                "Mesh.from_keras(device_mesh) needs a "
                "keras.distribution.DeviceMesh. Received: "
                f"device_mesh={device_mesh!r} of type "
                f"{type(device_mesh).__name__}")
        if len(set(names)) != len(names):
            raise ValueError(
                "Mesh.from_keras(device_mesh) needs distinct axis names. "
                f"Received: axis_names={list(names)!r}")
        return cls(dict(zip(names, (int(n) for n in shape))),
                   devices=[str(d) for d in np.asarray(devices).ravel()])

    @property
    def axis_names(self):
        """Axis names in order, e.g. ('data', 'model')."""
        return tuple(self._axes)

    @property
    def shape(self):
        """A dict axis name -> size (a copy)."""
        return dict(self._axes)

    @property
    def size(self):
        """Number of devices."""
        return len(self._devices)

    @property
    def devices(self):
        """Device names in mesh order (row-major over the axes)."""
        return self._devices

    @property
    def device_type(self):
        """The kind of device the mesh runs on: "TPU", "GPU" or "CPU"."""
        return short_device_name(self._devices[0]).split(":")[0]

    def axis_size(self, name):
        """Size of axis `name`, or 1 when the mesh has no such axis."""
        return self._axes.get(name, 1)

    def submesh(self, axis, index):
        """The devices at coordinate `index` of `axis`, as a mesh over the
        remaining axes (in order). A pipeline stage is such a sub-mesh.

        >>> tfpar.Mesh({"data": 2, "pipe": 2, "model": 2}).submesh("pipe", 1)
        Mesh({'data': 2, 'model': 2}, devices=[CPU:2, CPU:3, CPU:6, CPU:7])
        """
        if axis not in self._axes:
            raise ValueError(
                f"Mesh.submesh(axis) needs one of the mesh axes "
                f"{self.axis_names}. Received: axis={axis!r}")
        if not 0 <= index < self._axes[axis]:
            raise ValueError(
                f"Mesh.submesh(index) needs 0 <= index < {self._axes[axis]} "
                f"(the size of axis {axis!r}). Received: index={index!r}")
        rest = {name: size for name, size in self._axes.items() if name != axis}
        if not rest:
            rest = {axis: 1}
        # Row-major: flat position -> coordinates along every axis.
        grid = np.arange(self.size).reshape(tuple(self._axes.values()))
        picked = np.take(grid, index, axis=self.axis_names.index(axis))
        stage = Mesh(rest, devices=[self._devices[i] for i in picked.ravel()])
        return stage

    @property
    def dtensor_mesh(self):
        """The `tf.experimental.dtensor.Mesh` this mesh stands for (cached)."""
        if self._dtensor_mesh is None:
            if dtensor.num_clients() > 1:
                self._dtensor_mesh = self._cluster_mesh()
            else:
                self._dtensor_mesh = dtensor.create_mesh(
                    list(self._axes.items()),
                    devices=[short_device_name(d) for d in self._devices],
                )
        return self._dtensor_mesh

    def _cluster_mesh(self):
        """The DTensor mesh over several hosts (see `tfpar.connect_hosts`).

        DTensor numbers the cluster's devices in order, host h's local
        device k being global device h * L + k (L devices per host), and
        needs a mesh's ids increasing by one. A mesh across hosts is one of:
        all devices in order; consecutive devices of one host, or of whole
        consecutive hosts (a pipeline stage's sub-mesh with the pipe axis
        first), its ids the global ones; or the same local devices of each
        of some hosts, in increasing host order, each host's in order
        ("spread": e.g. CPU:0-3 of every host, the others left to
        `offload_devices`, or a stage's sub-mesh with the pipe axis not
        first), its ids the mesh positions 0..n-1 and its devices named
        by DeviceSpecs. Built on every host, its local devices this host's
        ([] on the others). Anything else (a reordering, another subset)
        is refused by the same check on every host."""
        kind = self.device_type
        per_host = dtensor.num_local_devices(kind)
        everything = default_devices()
        ids = [device_index(d) for d in self._devices]
        shape = cluster_mesh_kind(ids, per_host, len(everything))
        whole, spread = shape == "whole", shape == "spread"
        if shape is None:
            raise ValueError(
                f"Across hosts a mesh must use all {len(everything)} devices "
                f"in order ({_device_range(everything)}), or consecutive "
                f"devices of one host or of whole hosts ({per_host} per "
                f"host: e.g. CPU:{per_host}..CPU:{2 * per_host - 1} of host "
                "1), or the same devices of each of some hosts (e.g. "
                "CPU:0-3 of each), in host order. Received: "
                f"{self!r}. Reorderings, and subsets whose hosts hold "
                "different numbers of their devices, are not supported "
                "across hosts: list the devices in increasing order, as "
                "many on each host (for a pipeline's stages: axis sizes "
                "that split each host's devices evenly).")

        def spec(i):
            return tf.DeviceSpec(job=dtensor.job_name(), replica=0,
                                 task=i // per_host, device_type=kind,
                                 device_index=i % per_host)

        host = dtensor.client_id()
        mesh_ids = list(range(len(ids))) if spread else ids
        local = [(m, spec(i)) for m, i in zip(mesh_ids, ids)
                 if i // per_host == host]
        extra = {} if whole else {"global_devices": [spec(i) for i in ids]}
        return dtensor.Mesh(
            list(self._axes),
            np.array(mesh_ids).reshape(tuple(self._axes.values())),
            [m for m, _ in local], [d for _, d in local], **extra)

    def hosts(self):
        """The hosts (`tfpar.connect_hosts`) holding this mesh's devices, in
        increasing order: host h holds global devices h·L … h·L + L − 1 (L
        devices per host); (0,) on one host.

        >>> tfpar.Mesh({"data": 8}).hosts()
        (0,)
        """
        if dtensor.num_clients() == 1:
            return (0,)
        per_host = dtensor.num_local_devices(self.device_type)
        return tuple(sorted({device_index(d) // per_host
                             for d in self._devices}))

    def is_local(self):
        """Whether this host holds any of the mesh's devices (always on one
        host; across hosts, False for another host's stage sub-mesh).

        >>> tfpar.Mesh({"pipe": 2, "data": 4}).submesh("pipe", 1).is_local()
        True
        """
        return bool(self.dtensor_mesh.local_device_ids())

    def __eq__(self, other):
        return (
            isinstance(other, Mesh)
            and list(self._axes.items()) == list(other._axes.items())
            and self._devices == other._devices
        )

    def __hash__(self):
        return hash((tuple(self._axes.items()), self._devices))

    def __repr__(self):
        return f"Mesh({self._axes!r}, devices={_device_range(self._devices)})"


def local_device_names(dtensor_mesh):
    """Names ("CPU:5") of this host's devices of a DTensor mesh, in its
    local order; across hosts the global names (`tfpar.connect_hosts`)."""
    if dtensor.num_clients() > 1:
        # From the devices themselves: a spread mesh's ids are positions.
        per_host = dtensor.num_local_devices(dtensor_mesh.device_type())
        specs = [tf.DeviceSpec.from_string(d)
                 for d in dtensor_mesh.local_devices()]
        return [f"{s.device_type}:{s.task * per_host + s.device_index}"
                for s in specs]
    return [short_device_name(d) for d in dtensor_mesh.local_devices()]


def _normalize_devices(devices):
    if isinstance(devices, (str, bytes)) or not isinstance(
        devices, collections.abc.Sequence
    ):
        raise TypeError(
            "Mesh(devices=...) needs a list of device names like "
            f"['CPU:0', 'CPU:1']. Received: devices={devices!r}"
        )
    names = []
    for device in devices:
        if isinstance(device, tf.config.LogicalDevice):
            device = device.name
        spec = tf.DeviceSpec.from_string(str(device))
        if spec.device_type is None or spec.device_index is None:
            raise ValueError(
                "Each mesh device needs a type and an index like 'GPU:1'. "
                f"Received: {device!r} in devices={list(devices)!r}"
            )
        names.append(f"{spec.device_type.upper()}:{spec.device_index}")
    if len(set(names)) != len(names):
        raise ValueError(
            f"Mesh devices must be distinct. Received: devices={names!r}"
        )
    device_types = {n.split(":")[0] for n in names}
    if len(device_types) != 1:
        raise ValueError(
            "All mesh devices must be of one type. Received: "
            f"devices={names!r}"
        )
    device_type = device_types.pop()
    logical = tf.config.list_logical_devices()
    local = sorted({short_device_name(d.name) for d in logical
                    if d.device_type.upper() == device_type},
                   key=device_index)
    available = set(_global_names(local)) if local else set()
    missing = [n for n in names if n not in available]
    if missing:
        if available:
            hint = (
                f"Choose among the available {device_type} devices "
                f"{sorted(available, key=device_index)}"
            )
        else:
            hint = (
                f"This host has no {device_type} device; omit devices= to use "
                f"{_device_range(_pick_devices(logical) or ['CPU:0'])}"
            )
        if device_type == "CPU":
            hint += ", or call tfpar.use_virtual_cpus(n) first for more CPUs"
        elif device_type == "TPU":
            hint += ", or call tfpar.connect_tpu() first thing on a TPU host"
        raise ValueError(
            f"Mesh devices {missing} do not exist on this host. Received: "
            f"devices={names!r}. {hint}."
        )
    return names


def cluster_mesh_kind(ids, per_host, total):
    """How a mesh of global device `ids` (`per_host` devices per host,
    `total` in the cluster) is built across hosts (`Mesh._cluster_mesh`):
    "whole" (every device in order), "global" (consecutive devices inside
    one host or of whole hosts: its ids the global ones), "spread" (the
    same local devices of each of some hosts: its ids positions), or None
    (refused: a reordering, or hosts holding different numbers of its
    devices).

    >>> cluster_mesh_kind([4, 5, 6, 7], per_host=4, total=8)
    'global'
    >>> cluster_mesh_kind([0, 1, 4, 5], per_host=4, total=8)
    'spread'
    >>> cluster_mesh_kind([0, 1, 2, 4], per_host=4, total=8) is None
    True
    """
    if ids == list(range(total)):
        return "whole"
    if ids == list(range(ids[0], ids[0] + len(ids))) and (
            ids[0] // per_host == ids[-1] // per_host
            or (ids[0] % per_host == 0 and len(ids) % per_host == 0)):
        return "global"
    return "spread" if _spread_over_hosts(ids, per_host) else None


def _spread_over_hosts(ids, per_host):
    """Whether global device `ids` are the same local devices of each of
    some hosts (every host, or a pipeline stage's), in increasing host
    order, each host's in increasing order: a "spread" mesh."""
    hosts = sorted({i // per_host for i in ids})
    if len(ids) % len(hosts):
        return False
    share = len(ids) // len(hosts)
    first = [i - hosts[0] * per_host for i in ids[:share]]
    return sorted(set(first)) == first and first[-1] < per_host and ids == [
        h * per_host + i for h in hosts for i in first]


def _device_range(devices):
    short = [short_device_name(d) for d in devices]
    kind = short[0].split(":")[0]
    indices = [device_index(d) for d in short]
    contiguous = indices == list(range(indices[0], indices[0] + len(indices)))
    if len(short) > 2 and contiguous and all(d.startswith(kind) for d in short):
        return f"{short[0]}..{short[-1]}"
    return "[" + ", ".join(short) + "]"
