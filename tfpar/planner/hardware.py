"""Accelerators in vendor figures, for `Cluster.preset` and the roofline.

Each `Hardware` holds what its vendor publishes (peak dense FLOP/s per
compute dtype, HBM bytes and bandwidth, the links inside a host and across
hosts) and the achievable-efficiency constants the roofline cost model
(`roofline.py`) multiplies them by. The figures, with their sources:

| figure | A100-40GB | A100-80GB | H100 SXM | H200 | TPU v4 | TPU v5p |
|---|---|---|---|---|---|---|
| dense bf16/fp16 FLOP/s | 312 T | 312 T | 989 T | 989 T | 275 T | 459 T |
| dense tf32 / fp32 FLOP/s | 156 T / 19.5 T | 156 T / 19.5 T | 495 T / 67 T | 495 T / 67 T | – | – |
| HBM | 40 GB, 1.555 TB/s | 80 GB, 2.039 TB/s | 80 GB, 3.35 TB/s | 141 GB, 4.8 TB/s | 32 GiB, 1.2 TB/s | 95 GB, 2.765 TB/s |
| in a host, per device per direction | NVLink3 300 GB/s | NVLink3 300 GB/s | NVLink4 450 GB/s | NVLink4 450 GB/s | ICI | ICI |
| across hosts, per device per direction | HDR IB 25 GB/s | HDR IB 25 GB/s | NDR IB 50 GB/s | NDR IB 50 GB/s | ICI | ICI |
| devices per host | 8 (DGX A100) | 8 | 8 (DGX H100) | 8 | 4 | 4 |
| across slices (data-center network), per chip | – | – | – | – | not published | 50 Gb/s |

Sources: NVIDIA A100 Tensor Core GPU datasheet (2021, dense figures, the
sparse ones are 2×) and the DGX A100 user guide (8 × 200 Gb/s HDR
InfiniBand ConnectX-6 per node, one per GPU); NVIDIA H100 datasheet (SXM5:
989.4 TFLOP/s dense bf16, 3.35 TB/s, NVLink 900 GB/s bidirectional) and
DGX H100 user guide (8 × 400 Gb/s ConnectX-7); NVIDIA H200 datasheet
(141 GB HBM3e, 4.8 TB/s); Google Cloud TPU system-architecture pages for
v4 (275 TFLOP/s bf16, 32 GiB, 1,200 GB/s, ICI 2,400 Gb/s per chip over 6
links of a 3-D torus) and v5p (459 TFLOP/s, 95 GB, 2,765 GB/s, ICI 4,800
Gb/s). A TPU slice's torus spans hosts: a ring along one torus axis uses 2
of a chip's 6 links, a third of its ICI bandwidth, inside a host or across.

Slices (TPU): a pod is cut into slices, each one ICI torus; slices are
joined by the data-center network (DCN), which Google gives per chip for
v5p: 50 Gb/s (Cloud TPU v5p page, "Data center network (DCN) bandwidth
per chip"), taken as per direction. For v4 Google publishes no DCN
figure (`dcn_bandwidth` None: `Cluster.preset("tpu-v4", num_slices=2)`
asks for one). The DCN's latency is not published either: InfiniBand's
10 µs is taken, and its efficiency is `network_inter`'s. A collective
over a group spanning slices runs hierarchically, as XLA's and NCCL's do
(`across_slices`).

Latencies (α per ring step): NCCL's measured small-message all-reduce
latency inside a DGX is ~5–10 µs for 8 GPUs (NCCL tests; Calculon and
llm-analysis take 5 µs NVLink, 10 µs InfiniBand, per step); ICI 5 µs.

Achievable-efficiency constants (what the cost model multiplies peaks by):
`gemm` is the fraction of peak a large dense GEMM reaches and `gemm_half`
the GEMM dimension at which a skinny one runs at half of that (wave and
tile quantisation: per dimension x the factor is x / (x + gemm_half)).
The A100's two are fitted, once for all sources, on the development
set of published runs (`benchmarks/planner_published.py`, which also
reports them left out one source at a time): 0.75 and 128 (cuBLAS fp16
on A100 reaches 230–280 of 312 TFLOP/s on large GEMMs, 0.75–0.9;
Calculon's a100 file 0.95 above 128 GFLOP), for both A100 presets (one
chip). The H100's are not fitted: the development set has one H100
source (llm-foundry's MPT on PyTorch FSDP), and fitting two constants to
it (0.7 and 1024) made Megatron-Core's H100 table
(`benchmarks/planner_heldout.py`) 14–88% too slow — a fit to one
trainer, not a hardware fact. They are: `gemm` 0.7 (bf16 cuBLAS 600–750
of 989 TFLOP/s on large GEMMs), `gemm_half` 256, the A100's 128 scaled
by Hopper's tile (a warpgroup MMA tile of 128×256 against Ampere's
128×128: twice the quantisation length). The others
are published figures: `hbm` the fraction of peak bandwidth a streaming
elementwise kernel reaches (≈ 0.8–0.9 in STREAM-like copies; llm-analysis
and Calculon take 0.85–0.9 for large transfers); `network_intra`
and `network_inter` the fractions of link bandwidth NCCL's ring reaches
as bus bandwidth (nccl-tests on DGX A100 ≈ 210–230 of NVLink's 300 GB/s,
Calculon's a100 file 0.65; InfiniBand ≈ 0.9 of line rate, Calculon 0.9);
`flash` the fraction of peak a fused (flash) attention kernel's FLOPs
reach, forward and backward together (FlashAttention-2, Dao 2023: up to
225 TFLOP/s on A100, 72% of peak, ≈ 0.6 over head widths and masks; up to
335 TFLOP/s on H100 without Hopper-specific instructions, 34%).
`collective_share` the
fraction of a GPU's SMs NCCL's kernels occupy while a collective overlaps
compute (24 thread blocks beside a GEMM on an H100 in Nsight Systems,
NVIDIA developer forum "Compute-Communication Overlap Causes Severe GEMM
Performance Degradation because of Tail Effect": 24/108 on A100, 24/132
on H100; 0 on a TPU: not measured). TPU v4
and v5p have no published run in the development set: their GEMM
constants are the A100's, unfitted. The v5p's are checked on the
held-out set (`benchmarks/planner_heldout.py`: MaxText's v5p table,
FSDP with tensor parallelism): five of six runs within 7%, the one
with full recomputation 30% slow; the v4's on MaxText's v4 table (FSDP,
full recomputation): both runs within 9%.

>>> from tfpar.planner import hardware
>>> hardware.PRESETS["a100-80gb"].peak_flops["bfloat16"]
312000000000000.0
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator: vendor figures and achievable efficiencies.

    Attributes:
        name: the preset's name.
        peak_flops: {compute dtype: dense peak FLOP/s}.
        memory: HBM bytes per device.
        hbm_bandwidth: HBM bytes/s per device (peak).
        intra_bandwidth, inter_bandwidth: bytes/s per device per direction
            inside a host and across hosts.
        intra_latency, inter_latency: seconds per ring step.
        devices_per_host: the platform's own.
        nics_shared: True when a host's devices share its network
            interfaces (a GPU host: a group with k members per host gets
            devices_per_host / k devices' worth of inter-host bandwidth
            each, rail-optimised); False for a torus (TPU ICI).
        gemm, gemm_half, hbm, network_intra, network_inter, flash:
            achievable-efficiency
            constants (module docstring).
        collective_share: the fraction of the device's cores a collective's
            kernels occupy while it overlaps compute (NCCL runs on the SMs:
            the compute beside it slows by that much).
        dcn_bandwidth, dcn_latency: bytes/s per device per direction and
            seconds per message of the data-center network joining a
            pod's slices (TPUs; None where the vendor publishes none, or
            the platform has no slices).
    """

    name: str
    peak_flops: dict
    memory: float
    hbm_bandwidth: float
    intra_bandwidth: float
    inter_bandwidth: float
    intra_latency: float
    inter_latency: float
    devices_per_host: int
    nics_shared: bool = True
    gemm: float = 0.75
    gemm_half: float = 128.0
    hbm: float = 0.85
    network_intra: float = 0.7
    network_inter: float = 0.9
    flash: float = 0.6
    collective_share: float = 0.0
    dcn_bandwidth: float = None
    dcn_latency: float = None

    def peak(self, dtype):
        """Dense peak FLOP/s in `dtype` (float16 counts as bfloat16)."""
        key = {"float16": "bfloat16", "mixed_float16": "bfloat16",
               "mixed_bfloat16": "bfloat16"}.get(dtype, dtype)
        if key not in self.peak_flops:
            raise ValueError(
                f"Hardware {self.name!r} has no peak FLOP/s for dtype "
                f"{dtype!r}; it knows {sorted(self.peak_flops)}.")
        return self.peak_flops[key]

    def compute_peak(self, compute_dtype, tf32=False):
        """Dense peak FLOP/s of matmuls computed in `compute_dtype`:
        float32 as TF32 when `tf32` (TensorFlow allows it) and the device
        has it, else at its float32 peak, or as bf16 passes where it has
        none (TPUs); half precision at the bf16 peak."""
        if compute_dtype == "float32":
            if tf32 and "tensorfloat32" in self.peak_flops:
                return self.peak_flops["tensorfloat32"]
            if "float32" not in self.peak_flops:
                return self.peak("bfloat16")
        return self.peak(compute_dtype)


_A100_FLOPS = {"bfloat16": 312e12, "tensorfloat32": 156e12, "float32": 19.5e12}
_H100_FLOPS = {"bfloat16": 989e12, "float8": 1979e12, "tensorfloat32": 495e12,
               "float32": 67e12}
_GPU_LINKS = dict(intra_latency=5e-6, inter_latency=1e-5, devices_per_host=8)
# NCCL's all-gather launched 24 thread blocks beside a GEMM on an H100
# (Nsight Systems, NVIDIA developer forum "Compute-Communication Overlap
# Causes Severe GEMM Performance Degradation because of Tail Effect"):
# 24 of the A100's 108 SMs, of the H100 SXM's 132 (datasheets).
_NCCL_BLOCKS = 24
# TPU ICI: per chip 2,400 Gb/s (v4) / 4,800 Gb/s (v5p) over 6 torus links;
# a ring along one axis uses 2 of them (a third), per direction half.
_TPU_LINKS = dict(intra_latency=5e-6, inter_latency=5e-6, devices_per_host=4,
                  nics_shared=False)
# The v5p's data-center network: 50 Gb/s per chip (Cloud TPU v5p page);
# latency not published, InfiniBand's 10 µs taken.
_V5P_DCN = dict(dcn_bandwidth=50e9 / 8, dcn_latency=1e-5)

PRESETS = {
    "a100-40gb": Hardware("a100-40gb", _A100_FLOPS, 40e9, 1.555e12, 300e9,
                          25e9, collective_share=_NCCL_BLOCKS / 108,
                          **_GPU_LINKS),
    "a100-80gb": Hardware("a100-80gb", _A100_FLOPS, 80e9, 2.039e12, 300e9,
                          25e9, collective_share=_NCCL_BLOCKS / 108,
                          **_GPU_LINKS),
    "h100-sxm": Hardware("h100-sxm", _H100_FLOPS, 80e9, 3.35e12, 450e9, 50e9,
                         gemm=0.7, gemm_half=256.0, flash=0.34,
                         collective_share=_NCCL_BLOCKS / 132, **_GPU_LINKS),
    "h200": Hardware("h200", _H100_FLOPS, 141e9, 4.8e12, 450e9, 50e9,
                     gemm=0.7, gemm_half=256.0, flash=0.34,
                     collective_share=_NCCL_BLOCKS / 132, **_GPU_LINKS),
    "tpu-v4": Hardware("tpu-v4", {"bfloat16": 275e12}, 32 * 2**30, 1.2e12, 2400e9 / 8 / 3 / 2,
                       2400e9 / 8 / 3 / 2, **_TPU_LINKS),
    "tpu-v5p": Hardware("tpu-v5p", {"bfloat16": 459e12}, 95e9, 2.765e12, 4800e9 / 8 / 3 / 2,
                        4800e9 / 8 / 3 / 2, **_TPU_LINKS, **_V5P_DCN),
}


def across_slices(n, per_slice, inner, outer):
    """(α, β) of a ring collective over n devices spread evenly over
    slices, `per_slice` of them in each, run hierarchically (as XLA and
    NCCL do): a ring over each slice's k = `per_slice` members on the
    slice's link `inner` = (α_i, β_i), then a ring over the s = n / k
    slices on the data-center link `outer` = (α_o, β_o), each of the k
    members carrying 1/k of the bytes on its own chip's link. As one
    ring's figures (`roofline.ring`: steps · α + steps / n · bytes / β,
    steps c·(n − 1)), the same seconds:

        α = ((k − 1) α_i + (s − 1) α_o) / (n − 1)
        β = ((n − 1) / n) / ((k − 1) / (k β_i) + (s − 1) / (s k β_o))

    >>> across_slices(4, 1, (1e-6, 1e11), (1e-5, 1e9))   # 1 per slice
    (1e-05, 1000000000.0)
    """
    k = max(1, min(n, per_slice))
    s = n // k
    (alpha_in, beta_in), (alpha_out, beta_out) = inner, outer
    alpha = ((k - 1) * alpha_in + (s - 1) * alpha_out) / (n - 1)
    beta = ((n - 1) / n) / ((k - 1) / (k * beta_in)
                            + (s - 1) / (s * k * beta_out))
    return alpha, beta
