"""Hardware described in numbers, for planning.

A `Cluster` is `num_hosts` hosts of `devices_per_host` devices each; every
device has `device_memory` bytes and computes `device_flops` FLOP/s; a
collective whose group stays inside a host moves data at
`intra_host_bandwidth` bytes/s per device, one that spans hosts at
`inter_host_bandwidth`. Each message also pays a latency (the α of the α-β
model): time(B bytes) = α + B / β.

Example:

>>> a100s = tfpar.Cluster(num_hosts=8, devices_per_host=8,
...     device_memory=80e9, device_flops=312e12,
...     intra_host_bandwidth=300e9, inter_host_bandwidth=25e9)
>>> a100s.num_devices
64
"""

import dataclasses
import time

import numpy as np


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Devices, memory, speed and links of the hardware to plan for.

    Args:
        num_hosts: hosts (machines).
        devices_per_host: accelerators (or logical CPUs) per host.
        device_memory: bytes of memory per device.
        device_flops: sustained FLOP/s per device in the compute dtype.
        intra_host_bandwidth: bytes/s each device sends to the others of
            its host (e.g. NVLink).
        inter_host_bandwidth: bytes/s each device sends across hosts
            (e.g. its InfiniBand share).
        intra_host_latency: seconds per message inside a host (α).
        inter_host_latency: seconds per message across hosts.
        source: {figure: "measured" | "looked up" | "given"}, for reports.
    """

    num_hosts: int
    devices_per_host: int
    device_memory: float
    device_flops: float
    intra_host_bandwidth: float
    inter_host_bandwidth: float
    intra_host_latency: float = 5e-6
    inter_host_latency: float = 2e-5
    source: dict = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        for name in ("num_hosts", "devices_per_host"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(
                    f"Cluster({name}) must be a positive integer. "
                    f"Received: {name}={value!r}")
        for name in ("device_memory", "device_flops", "intra_host_bandwidth",
                     "inter_host_bandwidth", "intra_host_latency",
                     "inter_host_latency"):
            value = getattr(self, name)
            if not isinstance(value, (int, float, np.number)) or value < 0 or (
                    value == 0 and "latency" not in name):
                raise ValueError(
                    f"Cluster({name}) must be a positive number (bytes, "
                    f"FLOP/s, bytes/s or seconds). Received: {name}={value!r}")

    @property
    def num_devices(self):
        return self.num_hosts * self.devices_per_host

    def link(self, group_size, stride):
        """(α seconds, β bytes/s) of a group of `group_size` devices whose
        members are `stride` devices apart in the row-major device order
        (hosts hold consecutive devices): inter-host once the group spans
        more than one host."""
        if group_size * stride > self.devices_per_host:
            return self.inter_host_latency, self.inter_host_bandwidth
        return self.intra_host_latency, self.intra_host_bandwidth

    def to_dict(self):
        return dataclasses.asdict(self)

    @classmethod
    def local(cls):
        """This machine's devices (tfpar's default devices: TPU > GPU > CPU).

        Measured here: FLOP/s (a float32 matmul timed on the first device,
        the host's rate split evenly over its logical devices when they are
        virtual CPUs sharing the cores) and bandwidth (a host memory copy,
        split likewise: virtual CPUs exchange data through host memory).
        Looked up: the memory per device (host memory / devices for
        CPUs; the device's reported limit otherwise) and the latencies.
        See `source` for which is which.
        """
        import tensorflow as tf  # noqa: PLC0415

        from tfpar import mesh as mesh_lib  # noqa: PLC0415

        devices = mesh_lib.default_devices()
        n = len(devices)
        cpu = mesh_lib.default_device_type() == "CPU"
        flops = _matmul_flops(devices[0])
        copy = _copy_bandwidth()
        share = n if cpu else 1
        memory = _host_memory() / n if cpu else _device_memory(devices[0], tf)
        return cls(
            num_hosts=1, devices_per_host=n, device_memory=float(memory),
            device_flops=flops / share, intra_host_bandwidth=copy / share,
            inter_host_bandwidth=copy / share,
            intra_host_latency=1e-4 if cpu else 5e-6,
            inter_host_latency=1e-4 if cpu else 2e-5,
            source={"device_flops": "measured (matmul)",
                    "intra_host_bandwidth": "measured (host memory copy)",
                    "inter_host_bandwidth": "measured (host memory copy)",
                    "device_memory": "looked up",
                    "latency": "looked up"})


def _matmul_flops(device, n=512, repeats=5):
    """FLOP/s of an n x n float32 matmul on `device` (best of `repeats`)."""
    import tensorflow as tf  # noqa: PLC0415

    with tf.device(device):
        a = tf.random.stateless_uniform((n, n), seed=(1, 2))
        matmul = tf.function(lambda x: tf.linalg.matmul(x, x))
        matmul(a).numpy()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            matmul(a).numpy()
            best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best


def _copy_bandwidth(nbytes=1 << 25, repeats=5):
    source = np.ones(nbytes // 4, np.float32)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def _host_memory():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("Cluster.local() could not read /proc/meminfo")


def _device_memory(device, tf):
    info = tf.config.experimental.get_memory_info(device.split("device:")[-1])
    return info.get("limit") or info.get("peak")
