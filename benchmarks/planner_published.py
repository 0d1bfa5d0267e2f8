"""tfpar.estimate against published training runs (the development set).

For every row of `published_runs.csv` (../shared/planner, 35 runs from six
sources) that states a step time or a rate and a batch, the published
configuration is estimated on `tfpar.Cluster.preset` of its hardware and
printed next to the published seconds per iteration: the error, the mean
absolute error, the worst, the error of each source when the fitted
constants are fitted without it (leave-one-source-out), and the constants
with their citations.

Published seconds per iteration, as each source states them
(../shared/planner/README.md): Narayanan et al. 2021 (S1) report TFLOP/s
per GPU of their eq. 3 (F = 96·B·s·L·h²·(1 + s/(6h) + V/(16·L·h)), full
recomputation counted): seconds = F / (TFLOP/s · GPUs); Korthikanti et al.
2022 (S3), MT-NLG (S4), BLOOM (S5) and the Megatron-LM README of 2020
(S15) state seconds per iteration; llm-foundry (S14) states tokens/s per
GPU: seconds = B·s / (tokens/s · GPUs).

The one rule for what a row leaves unstated (written before evaluating,
the same for every row):

- micro-batch size: 1 with a pipeline (p > 1, Megatron's default for
  pipelined GPTs); without one, the whole per-replica batch as one
  micro-batch (Megatron's and DDP's default: no gradient accumulation),
  halved while the estimated memory exceeds the device's.
- schedule: 1F1B without interleaving (v = 1).
- recomputation: full (the Megatron default of those runs, which their
  reported FLOP/s count).
- vocabulary: Megatron-LM pads it to a multiple of 128 · t (its
  `make-vocab-size-divisible-by` 128 times the tensor size).
- precision: half-precision activations and GEMMs (fp16 or bf16: the same
  peak), fp32 master weights.
- dropout as the source's model has it (GPT/BLOOM 0.1; MPT none).
- what the runtime overlaps, read from its code (`RUNTIME`): Megatron-LM
  of 2020-2022 and DeepSpeed's pipeline engine reduce the gradients after
  the last micro-batch (exposed); PyTorch FSDP prefetches (overlapped,
  paying the cores NCCL takes from the compute beside it).

Left out: K22-5 (Korthikanti's abstract states only MFU, no batch or
step time).

Fitted, once for all rows of a hardware (a grid; not per row): the
A100's large-GEMM efficiency `gemm` and skinny-GEMM constant `gemm_half`
(`tfpar/planner/hardware.py` holds the fitted values; `fit` here
reproduces them), and the fraction of its Omni-Path line rate NCCL
reaches on BLOOM's cluster, Jean Zay (`LINKS`, fitted on its S5 rows by
`fit_links`: no other source ran there). The H100's are not fitted (one
source, llm-foundry, cannot tell a hardware fact from its trainer:
`hardware.py`). Every other figure is the vendor's or a cited measurement
(`tfpar/planner/hardware.py`).

    python benchmarks/planner_published.py
"""

import dataclasses
import itertools
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tfpar.planner import hardware, roofline  # noqa: E402

GPT = dict(dropout=True, tied=True, position_embedding=True)
BLOOM = dict(dropout=True, tied=True, position_embedding=False)
MPT = dict(dropout=False, tied=True, position_embedding=False)


def _n21(tflops, L, h, B, s=2048, V=51200):
    """Seconds from Narayanan's eq. 3 and a TFLOP/s per GPU figure."""
    return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h)) / tflops


# id: (source, hardware, (L, h, a, s, V), model kwargs, B, micro-batch (None:
#      the rule), t, p, d, v, sp, recompute, fsdp, flash, seconds)
ROWS = {
    "N21-T1-1": ("S1", "a100-80gb", (24, 2304, 24, 2048, 51200), GPT, 512,
                 None, 1, 1, 32, 1, False, "full", False, False,
                 _n21(137e12 * 32, 24, 2304, 512)),
    "N21-T1-2": ("S1", "a100-80gb", (30, 3072, 32, 2048, 51200), GPT, 512,
                 None, 2, 1, 32, 1, False, "full", False, False,
                 _n21(138e12 * 64, 30, 3072, 512)),
    "N21-T1-3": ("S1", "a100-80gb", (36, 4096, 32, 2048, 51200), GPT, 512,
                 None, 4, 1, 32, 1, False, "full", False, False,
                 _n21(142e12 * 128, 36, 4096, 512)),
    "N21-T1-4": ("S1", "a100-80gb", (40, 6144, 48, 2048, 51200), GPT, 1024,
                 None, 8, 1, 32, 1, False, "full", False, False,
                 _n21(135e12 * 256, 40, 6144, 1024)),
    "N21-T1-5": ("S1", "a100-80gb", (48, 8192, 64, 2048, 51200), GPT, 1536,
                 None, 8, 2, 32, 1, False, "full", False, False,
                 _n21(138e12 * 512, 48, 8192, 1536)),
    "N21-T1-6": ("S1", "a100-80gb", (60, 10240, 80, 2048, 51200), GPT, 1792,
                 None, 8, 4, 32, 1, False, "full", False, False,
                 _n21(140e12 * 1024, 60, 10240, 1792)),
    "N21-T1-7": ("S1", "a100-80gb", (80, 12288, 96, 2048, 51200), GPT, 2304,
                 None, 8, 8, 24, 1, False, "full", False, False,
                 _n21(148e12 * 1536, 80, 12288, 2304)),
    "N21-T1-8": ("S1", "a100-80gb", (96, 16384, 128, 2048, 51200), GPT, 2160,
                 None, 8, 16, 15, 1, False, "full", False, False,
                 _n21(155e12 * 1920, 96, 16384, 2160)),
    "N21-T1-9": ("S1", "a100-80gb", (105, 20480, 128, 2048, 51200), GPT, 2520,
                 None, 8, 35, 9, 1, False, "full", False, False,
                 _n21(163e12 * 2520, 105, 20480, 2520)),
    "N21-T1-10": ("S1", "a100-80gb", (128, 25600, 160, 2048, 51200), GPT,
                  3072, None, 8, 64, 6, 1, False, "full", False, False,
                  _n21(163e12 * 3072, 128, 25600, 3072)),
    "K22-1a": ("S3", "a100-80gb", (48, 6144, 64, 2048, 51200), GPT, 4, 4, 8,
               1, 1, 1, False, "full", False, False, 1.42),
    "K22-1b": ("S3", "a100-80gb", (48, 6144, 64, 2048, 51200), GPT, 4, 4, 8,
               1, 1, 1, True, "selective", False, False, 1.10),
    "K22-2a": ("S3", "a100-80gb", (96, 12288, 96, 2048, 51200), GPT, 64, 1, 8,
               8, 1, 3, False, "full", False, False, 18.13),
    "K22-2b": ("S3", "a100-80gb", (96, 12288, 96, 2048, 51200), GPT, 64, 1, 8,
               8, 1, 3, True, "selective", False, False, 13.75),
    "K22-3a": ("S3", "a100-80gb", (105, 20480, 128, 2048, 51200), GPT, 280, 1,
               8, 35, 1, 3, False, "full", False, False, 49.05),
    "K22-3b": ("S3", "a100-80gb", (105, 20480, 128, 2048, 51200), GPT, 280, 1,
               8, 35, 1, 3, True, "selective", False, False, 37.83),
    "K22-4a": ("S3", "a100-80gb", (128, 25600, 160, 2048, 51200), GPT, 512, 1,
               8, 64, 1, 1, False, "full", False, False, 94.42),
    "K22-4b": ("S3", "a100-80gb", (128, 25600, 160, 2048, 51200), GPT, 512, 1,
               8, 64, 1, 1, True, "selective", False, False, 71.49),
    "MTNLG-1": ("S4", "a100-80gb", (105, 20480, 128, 2048, 50257), GPT, 1920,
                None, 8, 35, 8, 1, False, "full", False, False, 60.1),
    "MTNLG-2": ("S4", "a100-80gb", (105, 20480, 128, 2048, 50257), GPT, 1920,
                None, 8, 35, 10, 1, False, "full", False, False, 50.2),
    "MTNLG-3": ("S4", "a100-80gb", (105, 20480, 128, 2048, 50257), GPT, 1920,
                None, 8, 35, 12, 1, False, "full", False, False, 44.4),
    "BLOOM-1": ("S5", "a100-80gb", (70, 14336, 112, 2048, 250880), BLOOM,
                2048, 2, 4, 12, 8, 1, False, "full", False, False, 105.22),
    "BLOOM-2": ("S5", "a100-80gb", (70, 14336, 112, 2048, 250880), BLOOM,
                2048, 2, 4, 12, 8, 1, False, "full", False, False, 104.50),
    "BLOOM-3": ("S5", "a100-80gb", (70, 14336, 64, 2048, 250880), BLOOM,
                2048, 2, 4, 12, 8, 1, False, "full", False, False, 102.03),
    "BLOOM-4": ("S5", "a100-80gb", (70, 14336, 64, 2048, 250880), BLOOM,
                2048, 2, 8, 12, 4, 1, False, "full", False, False, 121.63),
    "MPT-1": ("S14", "h100-sxm", (80, 8192, 64, 2048, 50368), MPT, 2048, 8,
              1, 1, 64, 1, False, "full", True, True,
              2048 * 2048 / (1039 * 64)),
    "MPT-2": ("S14", "h100-sxm", (48, 7168, 56, 2048, 50368), MPT, 1344, 14,
              1, 1, 32, 1, False, "full", True, True,
              1344 * 2048 / (2308 * 32)),
    "MPT-3": ("S14", "h100-sxm", (40, 5120, 40, 2048, 50368), MPT, 128, 2,
              1, 1, 64, 1, False, None, True, True,
              128 * 2048 / (4800 * 64)),
    "MPT-4": ("S14", "h100-sxm", (32, 4096, 32, 2048, 50368), MPT, 48, 6,
              1, 1, 8, 1, False, None, True, True, 48 * 2048 / (10643 * 8)),
    "MPT-5": ("S14", "h100-sxm", (32, 4096, 32, 8192, 50368), MPT, 128, 8,
              1, 1, 8, 1, False, "full", True, True, 128 * 8192 / (6935 * 8)),
    "MLM20-1": ("S15", "a100-80gb", (24, 1920, 15, 1024, 51200), GPT, 16,
                None, 1, 1, 1, 1, False, "full", False, False, 1.076),
    "MLM20-2": ("S15", "a100-80gb", (42, 4096, 32, 1024, 51200), GPT, 16,
                None, 8, 1, 1, 1, False, "full", False, False, 1.343),
    "MLM20-4": ("S15", "a100-80gb", (24, 1920, 15, 1024, 51200), GPT, 2048,
                None, 1, 1, 128, 1, False, "full", False, False, 1.153),
    "MLM20-5": ("S15", "a100-80gb", (42, 4096, 32, 1024, 51200), GPT, 2048,
                None, 8, 1, 128, 1, False, "full", False, False, 1.380),
}
# Hardware a source describes beyond its preset: BLOOM's Jean Zay nodes
# (BLOOM model card, "Technical Specifications": "8 GPUs per node using
# NVLink 4 inter-gpu connects, 4 OmniPath links"): 4 NVLink3 links of 25
# GB/s per direction per GPU (100 GB/s, where a DGX's NVSwitch gives 12:
# 300 GB/s) and 4 Omni-Path links of 100 Gb/s per node of 8 GPUs (6.25
# GB/s per GPU across nodes).
#
# The fraction of that Omni-Path line rate NCCL's rings reach
# (`network_inter`) is fitted on the development set's Jean Zay rows (S5,
# `fit_links`; the only rows on that network) over LINK_GRID: 0.35, where
# the preset's InfiniBand figure is 0.9 (2.2 GB/s per GPU with all eight
# GPUs of a node sending). NCCL drives Omni-Path through its
# InfiniBand-verbs transport (NVIDIA/nccl#333: "NET/IB : Using
# [0]hfi1_0:1/IB ..."), and without GPUDirect RDMA it stages every
# message through host memory: nccl-tests reach about half of one 100
# Gb/s link's rate that way with one GPU (NVIDIA/nccl#465: 6 GB/s bus
# bandwidth, "half of what I expected"); eight GPUs staging at once share
# the host's memory and PCIe too. Whether Jean Zay's nodes had GPUDirect
# RDMA the sources do not say: the figure is a fit, below that
# measurement, not a citation.
LINKS = {"S5": {"intra_bandwidth": 4 * 25e9,
                "inter_bandwidth": 4 * 100e9 / 8 / 8,
                "network_inter": 0.35}}
# Link figures fitted on the development set: {source: (field, grid)}.
LINK_GRID = {"S5": ("network_inter",
                    (0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65,
                     0.7, 0.75, 0.8, 0.85, 0.9))}
LEFT_OUT = {"K22-5": "the abstract states MFU only: no batch, no step time"}
MEGATRON_SOURCES = ("S1", "S3", "S4", "S15")
# What each source's runtime overlaps (not fitted: read from its code).
# Megatron-LM before 2023 all-reduced the gradients after the last
# micro-batch (`--DDP-impl local`, its default: megatron/training.py
# `model_module.allreduce_gradients()` after forward_backward_func); so
# did DeepSpeed's pipeline engine (deepspeed/runtime/pipe/schedule.py:
# TrainSchedule issues ReduceGrads after the last micro-batch), with ZeRO
# stage 1 for BLOOM. llm-foundry's FSDP overlaps (the default).
# And where each runtime puts the ranks (`pipe_outermost`, not fitted):
# Megatron-LM orders them model, data, pipe from the fastest
# (megatron/mpu/initialize.py, `initialize_model_parallel`'s docstring:
# with t=2, p=4 on 16 GPUs the data groups are [g0, g2], [g1, g3], ...
# and the pipeline groups [g0, g4, g8, g12], ...), and so does DeepSpeed
# (deepspeed/runtime/pipe/topology.py: PipeModelDataParallelTopology's
# axes ['pipe', 'data', 'model'], row-major): the data axis' members are
# t ranks apart, so with t < 8 a data group has 8/t members per host.
RUNTIME = {source: {"grad_overlap": False, "pipe_outermost": True}
           for source in MEGATRON_SOURCES}
RUNTIME["S5"] = {"grad_overlap": False, "zero1": True,
                 "pipe_outermost": True}


def published_config(row_id, presets=None, rows=None, links=None,
                     megatron_sources=MEGATRON_SOURCES, runtime=RUNTIME):
    """(Transformer, Parallel, Hardware, global batch, published seconds)
    of a row (of `rows`, default ROWS), the rule applied to what it leaves
    unstated; `links` ({source: Hardware fields}) the hardware a source
    describes beyond its preset, `runtime` ({source: Parallel fields})
    what its runtime overlaps as the source states it."""
    (source, name, (L, h, a, s, V), kwargs, B, mb, t, p, d, v, sp,
     recompute, fsdp, flash, seconds) = (rows or ROWS)[row_id][:15]
    hw = (presets or hardware.PRESETS)[name]
    overrides = (LINKS if links is None else links).get(source)
    if overrides:
        hw = dataclasses.replace(hw, **overrides)
    if source in megatron_sources:
        V = -(-V // (128 * t)) * 128 * t
    model = roofline.Transformer(layers=L, hidden=h, heads=a, seq=s,
                                 vocab=V, param_bytes=2 + 4, **kwargs)
    cfg = roofline.Parallel(
        data=d, pipe=p, model=t, microbatch=mb or 1, virtual_stages=v,
        schedule="interleaved" if v > 1 else "1f1b", sequence_parallel=sp,
        recompute=recompute, fsdp=fsdp, flash=flash,
        **(runtime or {}).get(source, {}))
    if mb is None and p == 1:
        cfg = dataclasses.replace(cfg, microbatch=B // d)
        while cfg.microbatch > 1 and sum(roofline.memory(
                model, cfg, B).values()) > hw.memory:
            cfg = dataclasses.replace(cfg, microbatch=cfg.microbatch // 2)
    return model, cfg, hw, B, seconds


def estimate_row(row_id, presets=None, **table):
    """(estimated seconds, published seconds, executed FLOP/s per device,
    peak FLOP/s) of a row (`table`: published_config's rows, links,
    megatron_sources)."""
    model, cfg, hw, batch, seconds = published_config(row_id, presets,
                                                      **table)
    parts = roofline.step_time(model, cfg, hw, batch)
    return (parts["total"], seconds,
            parts["executed_flops"] / parts["total"], hw.peak("bfloat16"))


def errors(presets=None, rows=None, links=None):
    """{row: relative error (estimated / published - 1)}; `links` as
    published_config's (default LINKS)."""
    out = {}
    for row in rows or ROWS:
        estimated, published, _, _ = estimate_row(row, presets, links=links)
        out[row] = estimated / published - 1
    return out


def summary(errs):
    values = [abs(e) for e in errs.values()]
    return sum(values) / len(values), max(values)


# The fitted constants: (gemm, gemm_half) of the A100 over a grid (the
# same for every row); without A100 rows it keeps its prior, the published
# figure: large-GEMM fraction 0.8 (cuBLAS fp16, 250 of 312 TFLOP/s),
# gemm_half 128. The H100 keeps its hardware figures (hardware.py): 0.7
# (bf16 cuBLAS 600-750 of 989), gemm_half 256 (twice the A100's tile).
GRID = {"gemm": (0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9),
        "gemm_half": (64.0, 128.0, 256.0, 512.0, 1024.0)}
FITTED = ("a100-80gb",)
SAME_CHIP = {"a100-80gb": ("a100-40gb",)}   # one chip, one GEMM
PRIORS = {"a100-80gb": (0.8, 128.0), "h100-sxm": (0.7, 256.0)}


def with_constants(constants):
    """The presets with {hardware name: (gemm, gemm_half)} replaced."""
    presets = dict(hardware.PRESETS)
    for name, (gemm, half) in constants.items():
        for chip in (name,) + SAME_CHIP.get(name, ()):
            presets[chip] = dataclasses.replace(presets[chip], gemm=gemm,
                                                gemm_half=half)
    return presets


def fit(rows):
    """{hardware: (gemm, gemm_half)} minimising the mean absolute error of
    `rows` on that hardware (each hardware's rows are fitted on their own:
    the constants of one do not touch the other's rows); PRIORS for a
    hardware none of `rows` uses."""
    constants = dict(PRIORS)
    for name in FITTED:
        mine = [r for r in rows if ROWS[r][1] == name]
        if not mine:
            continue
        best = None
        for point in itertools.product(*GRID.values()):
            mae, _ = summary(errors(with_constants({name: point}), mine))
            if best is None or mae < best[0] - 1e-12:
                best = (mae, point)
        constants[name] = best[1]
    return constants


def fit_links(rows, presets=None):
    """LINKS with each LINK_GRID figure fitted (the grid point of least
    mean absolute error) on its source's rows among `rows`; a source with
    none of them keeps its preset's figure (the field dropped)."""
    links = {source: dict(fields) for source, fields in LINKS.items()}
    for source, (field, grid) in LINK_GRID.items():
        links[source].pop(field, None)
        mine = [r for r in rows if ROWS[r][0] == source]
        if not mine:
            continue
        scored = []
        for value in grid:
            trial = dict(links, **{source: dict(links[source],
                                                **{field: value})})
            scored.append((summary(errors(presets, mine, trial))[0], value))
        links[source][field] = min(scored)[1]
    return links


def leave_one_source_out():
    """{source: ({row: error} of its rows with the constants and link
    figures fitted on the other sources, those constants)}."""
    out = {}
    for source in sorted({r[0] for r in ROWS.values()}):
        held = [k for k, r in ROWS.items() if r[0] == source]
        others = [k for k in ROWS if k not in held]
        constants = fit(others)
        presets = with_constants(constants)
        out[source] = (errors(presets, held, fit_links(others, presets)),
                       constants)
    return out


def constants_table():
    """Markdown rows: every constant the estimates use, with its source."""
    rows = []
    for name in ("a100-80gb", "h100-sxm"):
        hw = hardware.PRESETS[name]
        rows += [
            f"| {name} | peak dense bf16/fp16 | {hw.peak('bfloat16') / 1e12:.0f}"
            " TFLOP/s | vendor datasheet |",
            f"| {name} | HBM bandwidth × hbm | {hw.hbm_bandwidth / 1e12:.3g} "
            f"TB/s × {hw.hbm} | datasheet; STREAM-like copies |",
            f"| {name} | NVLink per direction × network_intra | "
            f"{hw.intra_bandwidth / 1e9:.0f} GB/s × {hw.network_intra} | "
            "datasheet; nccl-tests, Calculon |",
            f"| {name} | InfiniBand per GPU × network_inter | "
            f"{hw.inter_bandwidth / 1e9:.0f} GB/s × {hw.network_inter} | "
            "DGX user guide; Calculon |",
            f"| {name} | latency per ring step (NVLink, IB) | "
            f"{hw.intra_latency * 1e6:.0f}, {hw.inter_latency * 1e6:.0f} µs |"
            " NCCL tests; Calculon, llm-analysis |",
            f"| {name} | flash attention fraction of peak | {hw.flash} | "
            "FlashAttention-2 (Dao 2023) |",
            f"| {name} | gemm, gemm_half | {hw.gemm}, {hw.gemm_half:.0f} | "
            + ("fitted on the development set (all sources) |"
               if name in FITTED else
               "cuBLAS bf16 large GEMMs; the A100's tile length × 2 |")]
    jz = LINKS["S5"]
    rows.append(
        f"| Jean Zay (S5, BLOOM) | Omni-Path per GPU × network_inter | "
        f"{jz['inter_bandwidth'] / 1e9:.2f} GB/s × {jz['network_inter']} | "
        "BLOOM model card (4 × 100 Gb/s per 8 GPUs); fitted on the "
        "development set's S5 rows (NCCL without GPUDirect RDMA: about "
        "0.5 of one link for one GPU, NVIDIA/nccl#465) |")
    return "\n".join(rows)


def main():
    print("| run | hardware | published s/iter | estimated s/iter | error | "
          "executed TFLOP/s/device (peak) |")
    print("|---|---|---|---|---|---|")
    errs = {}
    for row in ROWS:
        estimated, published, flops, peak = estimate_row(row)
        errs[row] = estimated / published - 1
        print(f"| {row} | {ROWS[row][1]} | {published:.3g} | {estimated:.3g} "
              f"| {errs[row]:+.1%} | {flops / 1e12:.0f} ({peak / 1e12:.0f}) |")
    for row, why in LEFT_OUT.items():
        print(f"| {row} | – | – | – | left out: {why} | – |")
    mae, worst = summary(errs)
    print(f"\nrows {len(errs)} of {len(errs) + len(LEFT_OUT)}; mean absolute "
          f"error {mae:.1%}; worst {worst:.1%}")
    links = fit_links(list(ROWS))
    fitted = {f"{k}.{field}": links[k][field]
              for k, (field, _) in LINK_GRID.items()}
    print(f"\nfitted on all rows: {fit(list(ROWS))}; links {fitted}")
    print("\nleave-one-source-out (constants fitted on the other sources):")
    held_out = {}
    for source, (errs, constants) in leave_one_source_out().items():
        held_out.update(errs)
        mae, worst = summary(errs)
        print(f"  {source}: MAE {mae:.1%}, worst {worst:.1%} with {constants}")
    mae, worst = summary(held_out)
    print(f"  every row predicted with its source left out: MAE {mae:.1%}, "
          f"worst {worst:.1%}")
    print("\n| hardware | figure | value | source |\n|---|---|---|---|")
    print(constants_table())


if __name__ == "__main__":
    main()
