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
import functools
import time

import numpy as np
import tensorflow as tf

from tfpar import logs
from tfpar import mesh as mesh_lib
from tfpar.planner import calibrate
from tfpar.planner import hardware as hardware_lib


_ZERO_OK = ("update_bandwidth", "op_time", "send_time", "conv_flops",
            "conv_time", "slice_bandwidth")


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
        shared_host: True when the devices of a host share its cores and
            memory (virtual CPUs): their work adds up instead of running
            side by side, so the cost model sums the stages (no pipeline
            bubble, no overlap of communication with compute) and costs a
            collective as every device reading its group's blocks through
            host memory (n · B/β). False (the default) for accelerators.
        update_bandwidth: bytes/s per device at which the optimizer's
            elementwise update reads Adam's weights (0: not counted, the
            default for described clusters).
        op_time: seconds of runtime overhead per op per device (a shared
            host: every device of a mesh runs its copy of each op of the
            SPMD program on the same cores; 0: not counted, the default).
        send_time: seconds per device of a stage-to-stage move
            (`copy_to_mesh`) on a shared host, in place of the latency
            (0: the latency, the default).
        conv_flops: sustained FLOP/s per device of a convolution's forward
            and backward pass (0: `device_flops`, the default).
        conv_time: seconds per device of the runtime's cost of one
            convolution layer's forward and backward pass beyond its FLOPs
            (a shared host: every device of a mesh runs its own; 0: not
            counted, the default).
        source: {figure: "measured" | "looked up" | "given"}, for reports.
        of_this_process: True for `Cluster.local()`, this process's own
            devices (`tfpar.plan` checks its choice on them); False (the
            default) for a described cluster.
        hardware: the `hardware.Hardware` of a preset (vendor figures and
            efficiency constants for `tfpar.estimate`'s roofline), or None.
        num_slices: the hosts' slices (TPU pods: each slice one ICI
            torus of num_hosts / num_slices hosts), joined by a data-center
            network; 1 (the default): one network.
        slice_bandwidth: bytes/s each device sends across slices (its
            share of the data-center network; needed with num_slices > 1).
        slice_latency: seconds per message across slices.
    """

    num_hosts: int
    devices_per_host: int
    device_memory: float
    device_flops: float
    intra_host_bandwidth: float
    inter_host_bandwidth: float
    intra_host_latency: float = 5e-6
    inter_host_latency: float = 2e-5
    shared_host: bool = False
    update_bandwidth: float = 0.0
    op_time: float = 0.0
    send_time: float = 0.0
    conv_flops: float = 0.0
    conv_time: float = 0.0
    source: dict = dataclasses.field(default=None, compare=False)
    of_this_process: bool = dataclasses.field(default=False, compare=False)
    hardware: object = dataclasses.field(default=None, compare=False)
    num_slices: int = 1
    slice_bandwidth: float = 0.0
    slice_latency: float = 1e-5

    def __post_init__(self):
        for name in ("num_hosts", "devices_per_host", "num_slices"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(
                    f"Cluster({name}) must be a positive integer. "
                    f"Received: {name}={value!r}")
        if self.num_hosts % self.num_slices:
            raise ValueError(
                f"Cluster(num_slices) must divide num_hosts ({self.num_hosts}"
                f"): each slice holds whole hosts. Received: num_slices="
                f"{self.num_slices}.")
        if self.num_slices > 1 and not (
                isinstance(self.slice_bandwidth, (int, float, np.number))
                and self.slice_bandwidth > 0):
            raise ValueError(
                f"Cluster(num_slices={self.num_slices}) needs "
                "slice_bandwidth, the bytes/s each device sends across "
                "slices (its share of the data-center network). Received: "
                f"slice_bandwidth={self.slice_bandwidth!r}.")
        if not isinstance(self.shared_host, (bool, np.bool_)):
            raise ValueError(
                "Cluster(shared_host) must be True or False. Received: "
                f"shared_host={self.shared_host!r}")
        for name in ("device_memory", "device_flops", "intra_host_bandwidth",
                     "inter_host_bandwidth", "intra_host_latency",
                     "inter_host_latency", "update_bandwidth", "op_time",
                     "send_time", "conv_flops", "conv_time",
                     "slice_bandwidth", "slice_latency"):
            value = getattr(self, name)
            zero_ok = "latency" in name or name in _ZERO_OK
            if not isinstance(value, (int, float, np.number)) or value < 0 or (
                    value == 0 and not zero_ok):
                raise ValueError(
                    f"Cluster({name}) must be a positive number (bytes, "
                    f"FLOP/s, bytes/s or seconds). Received: {name}={value!r}")

    @property
    def num_devices(self):
        return self.num_hosts * self.devices_per_host

    @property
    def devices_per_slice(self):
        """Devices per slice (the whole cluster when it is one)."""
        return self.num_devices // self.num_slices

    def link(self, group_size, stride):
        """(α seconds, β bytes/s) of a group of `group_size` devices whose
        members are `stride` devices apart in the row-major device order
        (hosts hold consecutive devices, slices consecutive hosts):
        inter-host once the group spans more than one host, and across
        slices hierarchical (`hardware.across_slices`) once it spans more
        than one slice."""
        if group_size * stride <= self.devices_per_host:
            return self.intra_host_latency, self.intra_host_bandwidth
        inter = self.inter_host_latency, self.inter_host_bandwidth
        if group_size > 1 and group_size * stride > self.devices_per_slice:
            per_slice = self.devices_per_slice // stride
            return hardware_lib.across_slices(
                group_size, per_slice,
                self.link(per_slice, stride) if per_slice > 1 else inter,
                (self.slice_latency, self.slice_bandwidth))
        return inter

    def to_dict(self):
        return dataclasses.asdict(self)

    @classmethod
    def preset(cls, name, num_hosts=1, devices_per_host=None, num_slices=1,
               slice_bandwidth=None):
        """A cluster of `num_hosts` hosts of a known accelerator, in its
        vendor's figures (`tfpar/planner/hardware.py` cites each).

        Names: "a100-40gb", "a100-80gb", "h100-sxm", "h200" (DGX-style
        hosts of 8 GPUs: NVLink inside, one InfiniBand port per GPU
        across), "tpu-v4", "tpu-v5p" (hosts of 4 chips; the ICI torus
        spans hosts, so groups inside and across hosts get the same link).
        `num_slices` cuts a TPU cluster's hosts into that many slices (ICI
        inside each) joined by the data-center network, at the vendor's
        bandwidth per chip (v5p) or `slice_bandwidth` (bytes/s per
        device; v4 has no published figure); collectives over a group
        spanning slices are costed hierarchically.
        `device_flops` is the sustained rate of a large bf16 GEMM (the
        dense peak × the hardware's fitted `gemm` efficiency, what
        `tfpar.plan`'s cost model multiplies FLOPs by); `hardware` carries
        the peaks and the efficiency constants `tfpar.estimate` uses.

        >>> dgx = tfpar.Cluster.preset("a100-80gb", num_hosts=4)
        >>> dgx.num_devices, dgx.hardware.peak("bfloat16")
        (32, 312000000000000.0)
        """
        if name not in hardware_lib.PRESETS:
            raise ValueError(
                f"Cluster.preset(name) does not know {name!r}. Known: "
                f"{', '.join(sorted(hardware_lib.PRESETS))}; describe other "
                "hardware with tfpar.Cluster(...).")
        hw = hardware_lib.PRESETS[name]
        slices = _slice_link(name, hw, num_slices, slice_bandwidth)
        return cls(
            num_hosts=num_hosts,
            devices_per_host=(hw.devices_per_host if devices_per_host is None
                              else devices_per_host),
            device_memory=hw.memory,
            device_flops=hw.peak("bfloat16") * hw.gemm,
            intra_host_bandwidth=hw.intra_bandwidth,
            inter_host_bandwidth=hw.inter_bandwidth,
            intra_host_latency=hw.intra_latency,
            inter_host_latency=hw.inter_latency,
            source={"all": f"preset {name!r} (vendor figures: "
                           "tfpar/planner/hardware.py)"},
            hardware=hw, num_slices=num_slices, **slices)

    def calibrated(self, measured_step_time_s, estimate):
        """This cluster with its devices' speed scaled so that `estimate`
        of it predicts `measured_step_time_s` (e.g. a `StepTimeMonitor`'s
        `measured_step_time_s`).

        One measured step fits one number, k, the factor of the device's
        kernel speed; hardware facts (peaks, HBM and link bandwidths and
        latencies, memory) are kept. A preset's kernel efficiencies `gemm`,
        `flash` and `hbm` become k × theirs, each at most 1 (never above
        the vendor peak), and `device_flops` its bf16 peak × the new
        `gemm`; a described cluster's device rates (`device_flops`,
        `conv_flops`, `update_bandwidth`) are multiplied by k and its
        per-op times (`op_time`, `conv_time`) divided by k. Links are not
        touched: a step that is mostly exposed communication calibrates
        badly. k is solved (regula falsi, Illinois) on re-estimates, so
        `estimate(cluster.calibrated(t, estimate)).step_time_s` is t to
        1e-9; `source["calibrated"]` records k.

        Args:
            measured_step_time_s: seconds per training step, measured.
            estimate: a function of a `Cluster` returning the `Estimate`
                of the configuration that was measured (an `Estimate`
                alone cannot be re-costed).

        >>> dgx = tfpar.Cluster.preset("a100-80gb")
        >>> same = lambda c: tfpar.estimate(gpt, 64, cluster=c,
        ...                                 axes={"data": 8})
        >>> tuned = dgx.calibrated(1.3 * same(dgx).step_time_s, same)
        >>> same(tuned).step_time_s / same(dgx).step_time_s   # 1.3
        """
        if isinstance(measured_step_time_s, bool) or not isinstance(
                measured_step_time_s, (int, float, np.number)) or not (
                0 < measured_step_time_s < float("inf")):
            raise ValueError(
                "Cluster.calibrated(measured_step_time_s) must be a positive "
                f"number of seconds. Received: {measured_step_time_s!r}")
        if not callable(estimate):
            raise TypeError(
                "Cluster.calibrated(estimate) must be a function of a "
                "Cluster returning the Estimate of the measured "
                "configuration, e.g. lambda c: tfpar.estimate(model, 512, "
                "cluster=c, axes={'data': 8}); an Estimate alone cannot be "
                f"re-costed. Received: {estimate!r}")
        k = _solve_speed(self, float(measured_step_time_s), estimate)
        tuned = _faster(self, k)
        note = (f"kernel speed x {k:.4g} to a measured step of "
                f"{measured_step_time_s:.4g} s")
        return dataclasses.replace(
            tuned, source={**(self.source or {}), "calibrated": note})

    @classmethod
    def local(cls):
        """This machine's devices (tfpar's default devices: TPU > GPU > CPU).

        Measured here: FLOP/s (a float32 matmul timed on the first device;
        for virtual CPUs the host's rate split evenly over its logical
        devices, which share the cores). For virtual CPUs
        (`shared_host=True`) also, on a mesh of all of them: the α and β of
        a collective (an all-reduce over every device of 4 kB and of 4 MB
        per device, fitted to α + n · B/β) and the rate of Adam's update
        (Keras' Adam on one device, split like the FLOP/s), the runtime's
        time per op per device (Keras' Adam on many small weights, per op)
        and per stage-to-stage move (`copy_to_mesh` between two devices),
        and a convolution's FLOP/s and time per device (a 3×3 Conv2D's
        forward and backward pass on one device and split over all). On
        virtual CPUs every figure is timed by the process' CPU time, not
        the wall clock: other jobs on the host stretch the wall clock by
        a factor that differs between the micro-benchmarks (measured at
        load 15–17: wall-clock FLOP/s 0.9 and 1.7 G per device in two
        calibrations, CPU-time 3.5 and 3.6 G), so a shared host's
        `step_time_s` is the CPU seconds a step costs. Otherwise the
        bandwidth is a host memory copy and the latencies are looked up.
        The memory per device is looked up (host memory / devices for CPUs;
        the device's reported limit otherwise). See `source` for which is
        which; the micro-benchmarks take 3–5 s on a loaded host, once per
        process.
        """
        devices = mesh_lib.default_devices()
        n = len(devices)
        if mesh_lib.default_device_type() != "CPU":
            copy = _copy_bandwidth()
            return cls(
                num_hosts=1, devices_per_host=n,
                device_memory=float(_device_memory(devices[0])),
                device_flops=_matmul_flops(devices[0]),
                intra_host_bandwidth=copy, inter_host_bandwidth=copy,
                of_this_process=True,
                source={"device_flops": "measured (matmul)",
                        "intra_host_bandwidth": "measured (host memory copy)",
                        "inter_host_bandwidth": "measured (host memory copy)",
                        "device_memory": "looked up",
                        "latency": "looked up"})
        with logs.quiet_steps():  # the calibrations' DTensor INFO lines
            return _shared_cpus(cls, tuple(devices))


@functools.lru_cache(maxsize=4)
def _shared_cpus(cls, devices):
    """`Cluster.local()` for virtual CPUs sharing one host (measured once
    per process and device list)."""
    n = len(devices)
    alpha, beta = calibrate.collective_alpha_beta(devices)
    conv_flops, conv_time = calibrate.conv_rate_and_time(devices)
    return cls(
        num_hosts=1, devices_per_host=n, device_memory=_host_memory() / n,
        device_flops=_matmul_flops(devices[0], clock=time.process_time) / n,
        intra_host_bandwidth=beta, inter_host_bandwidth=beta,
        intra_host_latency=alpha, inter_host_latency=alpha,
        shared_host=True,
        update_bandwidth=calibrate.update_bandwidth(devices[0]) / n,
        op_time=calibrate.op_time(devices[0]),
        send_time=calibrate.send_time(devices),
        conv_flops=conv_flops / n, conv_time=conv_time,
        of_this_process=True,
        source={"device_flops": "measured (matmul, host rate / devices)",
                "intra_host_bandwidth": "measured (all-reduce on the mesh)",
                "inter_host_bandwidth": "measured (all-reduce on the mesh)",
                "latency": "measured (all-reduce on the mesh)",
                "update_bandwidth": "measured (Adam update, host rate / "
                                    "devices)",
                "op_time": "measured (Adam on small weights, per op)",
                "send_time": "measured (copy_to_mesh between devices)",
                "conv_flops": "measured (Conv2D, host rate / devices)",
                "conv_time": "measured (Conv2D on one device and on all)",
                "device_memory": "looked up (host memory / devices)"})


def _matmul_flops(device, n=512, repeats=5, clock=time.perf_counter):
    """FLOP/s of an n x n float32 matmul on `device` (best of `repeats`
    by `clock`: the wall clock, or for a shared host the process' CPU
    time)."""
    with tf.device(device):
        a = tf.random.stateless_uniform((n, n), seed=(1, 2))
        matmul = tf.function(lambda x: tf.linalg.matmul(x, x))
        matmul(a).numpy()
        best = float("inf")
        for _ in range(repeats):
            start = clock()
            matmul(a).numpy()
            best = min(best, clock() - start)
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


def _device_memory(device):
    info = tf.config.experimental.get_memory_info(device.split("device:")[-1])
    return info.get("limit") or info.get("peak")


def _slice_link(name, hw, num_slices, slice_bandwidth):
    """`Cluster.preset`'s slice fields: none for one slice; the
    data-center network's bandwidth (given, or the vendor's) and latency
    for several, on TPUs only."""
    if num_slices == 1:
        if slice_bandwidth is not None:
            raise ValueError(
                f"Cluster.preset({name!r}, slice_bandwidth="
                f"{slice_bandwidth!r}) sets the network between slices, and "
                "num_slices=1 has none. Received: num_slices=1. Pass "
                "num_slices= too, or drop slice_bandwidth.")
        return {}
    if hw.nics_shared:
        raise ValueError(
            f"Cluster.preset({name!r}, num_slices={num_slices}): slices are "
            "a TPU pod's (ICI tori joined by the data-center network); a "
            "GPU cluster is one network (NVLink in a host, InfiniBand "
            "across). Leave num_slices=1, or describe other networks with "
            "tfpar.Cluster(..., num_slices=, slice_bandwidth=).")
    bandwidth = slice_bandwidth or hw.dcn_bandwidth
    if bandwidth is None:
        raise ValueError(
            f"Cluster.preset({name!r}, num_slices={num_slices}) needs the "
            "data-center network's bandwidth per chip, which Google does not "
            f"publish for {name}. Pass slice_bandwidth= (bytes/s per chip "
            "and direction).")
    return {"slice_bandwidth": float(bandwidth),
            "slice_latency": hw.dcn_latency or 1e-5}


def _faster(cluster, k):
    """`cluster` with its devices' kernels k times as fast (each preset
    efficiency at most 1)."""
    hw = cluster.hardware
    if hw is None:
        return dataclasses.replace(
            cluster, device_flops=cluster.device_flops * k,
            conv_flops=cluster.conv_flops * k,
            update_bandwidth=cluster.update_bandwidth * k,
            op_time=cluster.op_time / k, conv_time=cluster.conv_time / k)
    faster = dataclasses.replace(hw, gemm=min(1.0, hw.gemm * k),
                                 flash=min(1.0, hw.flash * k),
                                 hbm=min(1.0, hw.hbm * k))
    return dataclasses.replace(
        cluster, hardware=faster,
        device_flops=faster.peak("bfloat16") * faster.gemm)


def _solve_speed(cluster, measured, estimate, tolerance=1e-9):
    """k with estimate(_faster(cluster, k)).step_time_s == measured: the
    step time falls as k grows; bracketed by doubling (or halving) k, then
    regula falsi in 1/k (Illinois), in which the device's share of the
    step is linear."""
    def excess(k):
        return estimate(_faster(cluster, k)).step_time_s - measured

    hw = cluster.hardware
    fastest = (float("inf") if hw is None
               else 1.0 / min(hw.gemm, hw.flash, hw.hbm))
    a, fa = 1.0, excess(1.0)
    b, fb = a, fa
    for _ in range(80):          # k within 2^±80 of the estimate's
        if fa * fb <= 0:
            return _illinois(excess, a, fa, b, fb, tolerance * measured)
        a, fa = b, fb
        b = min(b * (2.0 if fa > 0 else 0.5), fastest)
        fb = excess(b)
        if fb > 0 and b == fastest:
            break
    raise ValueError(
        f"Cluster.calibrated: the measured step ({measured:.4g} s) is "
        f"faster than the estimate allows with the fastest kernels "
        f"({fb + measured:.4g} s; a preset's every efficiency at 1). Check "
        "the measurement (warm-up steps left out?) and the configuration "
        "estimated (axes, recomputation, flash attention, links).")


def _illinois(excess, a, fa, b, fb, tolerance):
    """The root of excess(k) between a and b (signs of fa, fb differ),
    by regula falsi in u = 1/k, halving the stale end's value when the
    same end moves twice (Illinois)."""
    for k, fk in ((a, fa), (b, fb)):
        if abs(fk) <= tolerance:
            return k
    ua, ub, side = 1.0 / a, 1.0 / b, 0
    for _ in range(200):
        u = (ua * fb - ub * fa) / (fb - fa)
        fu = excess(1.0 / u)
        if abs(fu) <= tolerance:
            return 1.0 / u
        if fu * fb > 0:          # u on b's side: b moves
            ub, fb = u, fu
            fa = fa / 2 if side == -1 else fa
            side = -1
        else:                    # u on a's side: a moves
            ua, fa = u, fu
            fb = fb / 2 if side == 1 else fb
            side = 1
    raise ValueError("Cluster.calibrated: the re-estimates did not settle "
                     f"on the measured step time (last excess {fu:.3g} s).")
