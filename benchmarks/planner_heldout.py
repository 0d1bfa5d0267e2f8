"""tfpar.estimate against published runs NOT in the development set.

The development set (`planner_published.py`, ../shared/planner) is where
the roofline's fitted constants were chosen; this held-out set checks
the same code, unchanged, on other tables of other trainers: Megatron-
Core's H100 weak-scaling table (tensor, pipeline and data parallelism),
llm-foundry's MPT tables on A100-40GB, A100-80GB and H100 (PyTorch FSDP:
fsdp-style data parallelism), BigScience's BLOOM topology benchmarks on
A100-80GB (Megatron-DeepSpeed: the same 181B model under 16 t/p/d and
micro-batch configurations), torchtitan's Llama 3.1 runs (FSDP, TP) and
MaxText's TPU v5p and v4 tables (JAX/XLA: FSDP, with tensor parallelism
on v5p; the only TPU runs, so the TPU presets' first check: their GEMM
constants are the A100's, unfitted).
Every row cites the file and table it comes from
(`benchmarks/planner_heldout.csv`, written by `--csv`).

Published seconds per iteration, as each source states them:
Megatron-Core gives model TFLOP/s per GPU of its `num_floating_point_
operations` (F = 72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h)) for these GPTs):
seconds = F / (TFLOP/s · GPUs); llm-foundry and torchtitan give tokens/s
per GPU: seconds = B·s / (tokens/s · GPUs); BLOOM's tables give seconds
per iteration; MaxText gives TFLOP/s per chip of its
`calculate_tflops_training_per_device` (per chip: 3 · b·s · (L · (6·h·f
+ 2·h·(a + 2·kv)·d_h + 2·h·a·d_h) + 2·h·V) + 3 · L · 4 · b·s²·a·d_h,
attention counted without causality; b the per-chip batch): seconds =
that / TFLOP/s.

The rule for what a row leaves unstated (written before evaluating):

- micro-batch size: Megatron-Core's table states none: 1 with a pipeline,
  else the per-replica batch halved while it does not fit (the
  development set's rule); the other sources state theirs.
- recomputation: Megatron-Core: none (its default; its MFU counts model
  FLOPs), llm-foundry: "Activation Checkpointing" column (True: full),
  torchtitan: its config (full, or op-level selective: mapped to
  "selective"), BLOOM: full (the tr11 slurm script), MaxText: its
  script's `remat_policy` ("minimal" saves every weight matmul's output
  and recomputes the rest, attention's core included: "selective";
  "full": full).
- MaxText: its `base.yml` model (Llama-2 decoder: SwiGLU MLP, rotary
  positions, no dropout, untied logits, V = 32000, s = 2048) at the
  script's `global_parameter_scale` (MaxText's rule: of log₂ scale = 3q
  + r, heads and MLP × 2^(q + [r > 0]), width × 2^(q + [r > 1]), layers
  × 2^q), flash attention (`attention='flash'`); a v5p-N slice holds N/2
  chips; the tensor axis its script's `ici_tensor_parallelism`, the rest
  fsdp; each tensor group's batch (the micro-batch) b · t; its
  activations' hidden dimension split over the tensor axis
  (`activation_embed: tensor`: sequence parallelism's bytes); the
  tensor-parallel collectives overlapped (its scripts' XLA flags
  `--xla_tpu_overlap_compute_collective_tc`, async collective fusion:
  `tp_overlap`). Heads are 128 wide (`head_dim`), so the 128B model's 128
  heads span twice its width. Left out: the 1024B rows (its script's
  `ici_tensor_parallelism=8\\ ici_data_parallelism=16` passes one
  argument, the axes it ran with are not readable) and every two-slice
  row (fsdp inside each slice, data parallelism across the data-center
  network: hybrid sharding, which neither tfpar nor `tfpar.estimate`
  runs; the presets' `num_slices` costs tfpar's own layouts).
- MaxText on TPU v4: the v4 README's first commit (76bd53b0, 2023-12),
  with that commit's scripts and `base.yml` (a ReLU MLP, heads 256 wide,
  logits through the token table, V = 32768, s = 2048, flash attention)
  at the script's explicit widths; all fsdp, full recomputation
  (`remat_policy=full`); a v4-N slice holds N/2 chips (megacore: one
  device per chip); seconds from that commit's FLOP count (6 ·
  parameters · s · b plus causal attention). Its two-slice rows left out
  as on v5p.
- Megatron-Core: sequence parallelism when t > 1 (its
  `--tp-comm-overlap`, stated, requires it: megatron/training/
  arguments.py), fused (flash) attention (Transformer Engine), 1F1B
  without interleaving, dropout 0.1 and learned positions (its defaults),
  untied logits (the stated parameter counts need them).
- vocabulary: as published (131072, 50368, 128256, BLOOM 250880,
  MaxText 32000).
- pairs: every two rows of one source, model, hardware and sequence
  length whose published throughput per GPU differs by at least 10%
  (BLOOM's repeated measurement of one configuration differs by 3%: a
  closer pair is noise); the estimate must order them the same way.
- counted in the bounds: every row on a preset's hardware. torchtitan's
  H100s are not one (500 W power limit, 96 GB HBM2e at 2.4 TB/s; its
  README: "the actual peak TFLOPs number is between SXM and NVL, and we
  don't know its exact value"): reported, not counted.

    python benchmarks/planner_heldout.py [--csv]
"""

import csv
import itertools
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
if HERE not in sys.path:
    sys.path.append(HERE)  # its sibling planner_published

import planner_published as dev  # noqa: E402

GPT_UNTIED = dict(dropout=True, tied=False, position_embedding=True)
MPT = dev.MPT
BLOOM = dev.BLOOM
LLAMA_8B = dict(dropout=False, tied=False, position_embedding=False,
                gated=True, kv_heads=8, ffn=14336)
LLAMA_70B = dict(LLAMA_8B, ffn=28672)

MC_CITE = ("NVIDIA/Megatron-LM README.md 'Training Speed and Scalability' "
           "and images/model_table.png (commit f2e5db402c, 2024-07-15; "
           "Megatron-Core r0.8.0, DGX H100)")
LF_CITE = ("mosaicml/llm-foundry scripts/train/benchmarking/README.md "
           "(commit 8c8dd48f), table '{}'; model dims from "
           "scripts/train/yamls/pretrain/mpt-{}.yaml")
BL_CITE = ("bigscience-workshop/bigscience train/tr11-176B-ml/"
           "chronicles-prequel.md, '{}' (02-25; 48 nodes of 8 A100-80GB, "
           "Jean Zay)")
MX_CITE = ("AI-Hypercomputer/maxtext MaxText/configs/v5p/README.md "
           "(commit 0ed7bd52), {} model, 1x {}; config MaxText/configs/v5p/"
           "{}.sh (commit {}) and MaxText/configs/base.yml")
MX_V4_CITE = ("AI-Hypercomputer/maxtext MaxText/configs/v4/README.md "
              "(commit 76bd53b0, its first), {} model, 1x {}; config "
              "MaxText/configs/v4/{}.sh and MaxText/configs/base.yml at "
              "that commit")
TT_CITE = ("pytorch/torchtitan benchmarks/{} (Grand Teton H100 96GB "
           "HBM2e, 500 W); seq_len from train_configs/llama3_{}.toml at "
           "commit 9dec370")


def _mc(tflops, L, h, B, gpus, s=4096, V=131072):
    """Seconds from Megatron-Core's model FLOPs and TFLOP/s per GPU."""
    flops = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    return flops / (tflops * 1e12 * gpus)


def _tokens(B, s, per_gpu, gpus):
    return B * s / (per_gpu * gpus)


def _mc_row(L, h, a, t, p, d, B, tflops):
    return ("MC", "h100-sxm", (L, h, a, 4096, 131072), GPT_UNTIED, B, None,
            t, p, d, 1, t > 1, None, False, True,
            _mc(tflops, L, h, B, t * p * d), MC_CITE)


# MPT sizes: (L, h, heads), from the yamls.
_MPT = {"1b": (24, 2048, 16), "3b": (32, 2560, 20), "7b": (32, 4096, 32),
        "13b": (40, 5120, 40), "30b": (48, 7168, 56), "70b": (80, 8192, 64)}
_LF_TABLES = {"a100-40gb": "A100 40GB with 1600 Gbps node-node interconnect "
                           "(RoCE)",
              "a100-80gb": "A100 80GB with 1600 Gbps node-node interconnect "
                           "(RoCE)",
              "h100-sxm": "H100 80GB BF16",
              "h100-large": "H100 80GB BF16 (Large Scale, >= 128 GPUs)"}


def _lf_row(table, size, s, gpus, mb, ga, B, ac, per_gpu, sharded=True):
    L, h, a = _MPT[size]
    hw = "h100-sxm" if table == "h100-large" else table
    assert B == mb * ga * gpus or ga == 1, (size, gpus)
    return ("LF", hw, (L, h, a, s, 50368), MPT, B, mb, 1, 1, gpus, 1, False,
            "full" if ac else None, sharded, True,
            _tokens(B, s, per_gpu, gpus),
            LF_CITE.format(_LF_TABLES[table], size))


MAXTEXT = dict(dropout=False, tied=False, position_embedding=False,
              gated=True)


# MaxText's base.yml of 2023-12 (commit 76bd53b0): a ReLU MLP, heads 256
# wide, logits through the token table, V = 32768, dropout rate 0.
MAXTEXT_2023 = dict(dropout=False, tied=True, position_embedding=False,
                    gated=False)


def _mx_v4_row(size, slice_cores, dims, b, tflops):
    """A MaxText TPU v4 row: (model size, v4-N, (layers, width, heads,
    MLP width) from its script, per-chip batch, TFLOP/s per chip), all
    fsdp, full recomputation; seconds from that commit's FLOP count
    (`train.calculate_training_tflops`: 6 · parameters · s · b, plus the
    causal half of attention's 12 · heads · L · d_h · s² · b)."""
    L, h, heads, f = dims
    head_dim, s, V, chips = 256, 2048, 32768, slice_cores // 2
    width = heads * head_dim
    params = L * (4 * h * width + 2 * h * f + 2 * h) + V * h + h
    per_chip = 6 * params * s * b + 6 * heads * L * head_dim * s * s * b
    return ("MX", "tpu-v4", (L, h, heads, s, V),
            dict(MAXTEXT_2023, ffn=f, key_dim=head_dim), b * chips, b, 1,
            1, chips, 1, False, "full", True, True,
            per_chip / (tflops * 1e12),
            MX_V4_CITE.format(size, f"v4-{slice_cores}", size.lower()))


def _mx_row(size, slice_cores, scale, b, t, remat, tflops, commit):
    """A MaxText v5p row: (model size, v5p-N, global_parameter_scale,
    per-chip batch, ici_tensor_parallelism, remat_policy, TFLOP/s per chip,
    the config's commit)."""
    # scale = 8^octaves · 2^r: each factor 8 doubles depth, width, heads
    octaves, r = divmod(scale.bit_length() - 1, 3)
    heads = 16 * 2 ** (octaves + (r > 0))
    L = 16 * 2 ** octaves
    h = 2048 * 2 ** (octaves + (r > 1))
    f = 7168 * 2 ** (octaves + (r > 0))
    width = heads * 128  # base.yml's head_dim: attention is h or 2h wide
    s, V, chips = 2048, 32000, slice_cores // 2
    per_chip = 3 * b * s * (L * (6 * h * f + 2 * h * 3 * width
                                 + 2 * h * width)
                            + 2 * h * V) + 3 * L * 4 * b * s * s * width
    return ("MX", "tpu-v5p", (L, h, heads, s, V),
            dict(MAXTEXT, ffn=f, key_dim=128),
            b * chips, b * t, t, 1, chips // t, 1, True,
            {"minimal": "selective", "full": "full"}[remat], True, True,
            per_chip / (tflops * 1e12),
            MX_CITE.format(size, f"v5p-{slice_cores}", size.lower(), commit))


def _bl_row(d, t, p, mb, B, seconds, table):
    return ("BL", "a100-80gb", (72, 14336, 64, 2048, 250880), BLOOM, B, mb,
            t, p, d, 1, False, "full", False, False, seconds,
            BL_CITE.format(table))


_LOWER_PP = "table 'some more configs with lower PP'"
_TWEAK_TP = "table 'Tweaking TP for the first time'"
_GBS = "section 'GBS Variations'"

# id: (source, hardware, (L, h, a, s, V), model kwargs, B, micro-batch,
#      t, p, d, v, sp, recompute, fsdp, flash, seconds, citation)
ROWS = {
    # Megatron-Core, H100: (L, h, a, t, p, d, B, model TFLOP/s per GPU).
    "MC-1.7B": _mc_row(24, 2048, 16, 1, 1, 48, 192, 408.8),
    "MC-7.1B": _mc_row(30, 4096, 32, 2, 1, 48, 192, 465.9),
    "MC-16B": _mc_row(32, 6144, 48, 4, 1, 48, 192, 489.1),
    "MC-32B": _mc_row(48, 7168, 56, 8, 1, 48, 192, 459.6),
    "MC-70B": _mc_row(84, 8192, 64, 8, 2, 48, 384, 419.7),
    "MC-119B": _mc_row(92, 10240, 80, 8, 4, 48, 768, 420.5),
    "MC-177B": _mc_row(96, 12288, 96, 8, 6, 48, 1152, 432.8),
    "MC-314B": _mc_row(96, 16384, 128, 8, 8, 48, 1536, 474.4),
    "MC-462B": _mc_row(112, 18432, 144, 8, 16, 48, 3072, 459.9),
    # llm-foundry MPT, FSDP FULL_SHARD (SHARD_GRAD_OP: sharded=False):
    # (table, size, s, GPUs, micro-batch, grad accum, B, checkpointing,
    #  tokens/s per GPU).
    "LF-A40-70b-128": _lf_row("a100-40gb", "70b", 2048, 128, 4, 1, 512,
                              True, 376),
    "LF-A40-70b-64": _lf_row("a100-40gb", "70b", 2048, 64, 2, 1, 128, True,
                             276),
    "LF-A40-30b-128": _lf_row("a100-40gb", "30b", 2048, 128, 6, 1, 768,
                              True, 865),
    "LF-A40-13b-64": _lf_row("a100-40gb", "13b", 2048, 64, 16, 1, 1024,
                             True, 1976),
    "LF-A40-13b-8": _lf_row("a100-40gb", "13b", 2048, 8, 4, 16, 512, True,
                            1668),
    "LF-A40-7b-64": _lf_row("a100-40gb", "7b", 2048, 64, 18, 1, 1152, True,
                            3665),
    "LF-A40-3b-64": _lf_row("a100-40gb", "3b", 2048, 64, 6, 1, 384, False,
                            9736),
    "LF-A40-1b-64": _lf_row("a100-40gb", "1b", 2048, 64, 10, 1, 640, False,
                            19001),
    "LF-A80-70b-64": _lf_row("a100-80gb", "70b", 2048, 64, 8, 4, 2048, True,
                             410),
    "LF-A80-70b-32": _lf_row("a100-80gb", "70b", 2048, 32, 2, 16, 1024,
                             True, 373),
    "LF-A80-30b-8": _lf_row("a100-80gb", "30b", 2048, 8, 3, 21, 504, True,
                            916),
    "LF-A80-13b-8": _lf_row("a100-80gb", "13b", 2048, 8, 2, 3, 48, False,
                            2262),
    "LF-A80-7b-8": _lf_row("a100-80gb", "7b", 2048, 8, 6, 2, 96, False,
                           4641),
    "LF-A80-7b-8-s8k": _lf_row("a100-80gb", "7b", 8192, 8, 8, 2, 128, True,
                               3206),
    "LF-H-70b-32": _lf_row("h100-sxm", "70b", 2048, 32, 2, 16, 1024, True,
                           882),
    "LF-H-30b-16": _lf_row("h100-sxm", "30b", 2048, 16, 10, 3, 480, True,
                           2263),
    "LF-H-30b-8": _lf_row("h100-sxm", "30b", 2048, 8, 3, 21, 504, True,
                          2002),
    "LF-H-13b-8-s4k": _lf_row("h100-sxm", "13b", 4096, 8, 10, 3, 240, True,
                              4717),
    "LF-H-3b-16": _lf_row("h100-sxm", "3b", 2048, 16, 10, 3, 480, False,
                          24142),
    "LF-H-1b-64": _lf_row("h100-sxm", "1b", 2048, 64, 20, 1, 1280, False,
                          44402),
    "LF-HL-70b-512": _lf_row("h100-large", "70b", 2048, 512, 8, 1, 4096,
                             True, 1007),
    "LF-HL-30b-512": _lf_row("h100-large", "30b", 2048, 512, 8, 1, 4096,
                             True, 2115),
    "LF-HL-13b-512": _lf_row("h100-large", "13b", 2048, 512, 16, 1, 8192,
                             True, 4952),
    "LF-HL-7b-512": _lf_row("h100-large", "7b", 2048, 512, 6, 1, 3072,
                            False, 9670),
    "LF-HL-7b-128": _lf_row("h100-large", "7b", 2048, 128, 6, 1, 768, False,
                            10475),
    "LF-HL-3b-512": _lf_row("h100-large", "3b", 2048, 512, 8, 1, 4096,
                            False, 21664, sharded=False),
    # BLOOM 181B (L=72, h=14336, 64 heads), fp16, ZeRO-1: (d, t, p,
    # micro-batch, B, seconds per iteration).
    "BL-d6t8p8m4": _bl_row(6, 8, 8, 4, 2016, 113.16, _LOWER_PP),
    "BL-d12t8p4m2": _bl_row(12, 8, 4, 2, 2016, 125.52, _LOWER_PP),
    "BL-d12t8p4m4": _bl_row(12, 8, 4, 4, 2016, 114.81, _LOWER_PP),
    "BL-d24t8p2m1": _bl_row(24, 8, 2, 1, 2016, 145.45, _LOWER_PP),
    "BL-d24t8p2m2": _bl_row(24, 8, 2, 2, 2016, 136.13, _LOWER_PP),
    "BL-d8t8p6m4": _bl_row(8, 8, 6, 4, 2048, 114.11, _GBS),
    "BL-d4t8p12m4": _bl_row(4, 8, 12, 4, 2048, 117.07, _GBS),
    "BL-d4t8p12m2": _bl_row(4, 8, 12, 2, 2048, 128.82, _GBS),
    "BL-d8t4p12m4": _bl_row(8, 4, 12, 4, 2048, 111.89, _TWEAK_TP),
    "BL-d8t4p12m2": _bl_row(8, 4, 12, 2, 2048, 110.48, _TWEAK_TP),
    "BL-d16t4p6m4": _bl_row(16, 4, 6, 4, 2048, 117.11, _TWEAK_TP),
    "BL-d16t4p6m2": _bl_row(16, 4, 6, 2, 2048, 111.71, _TWEAK_TP),
    "BL-d16t2p12m2": _bl_row(16, 2, 12, 2, 2048, 112.50, _TWEAK_TP),
    "BL-d8t2p24m1": _bl_row(8, 2, 24, 1, 2048, 119.53, _TWEAK_TP),
    "BL-d8t2p24m2": _bl_row(8, 2, 24, 2, 2048, 122.75, _TWEAK_TP),
    "BL-d4t4p24m1": _bl_row(4, 4, 24, 1, 2048, 130.60, _TWEAK_TP),
    # torchtitan Llama 3.1, bf16, no Float8 (reported, not counted).
    "TT-8B-fsdp8": ("TT", "h100-sxm", (32, 4096, 32, 8192, 128256),
                    LLAMA_8B, 16, 2, 1, 1, 8, 1, False, "selective", True,
                    True, _tokens(16, 8192, 5762, 8),
                    TT_CITE.format("llama3_h100_202412_torchtitan.md Table 1"
                                   " (FSDP, eager)", "8b")),
    "TT-8B-fsdp128": ("TT", "h100-sxm", (32, 4096, 32, 8192, 128256),
                      LLAMA_8B, 256, 2, 1, 1, 128, 1, False, "selective",
                      True, True, _tokens(256, 8192, 5605, 128),
                      TT_CITE.format("llama3_h100_202412_torchtitan.md "
                                     "Table 3 (FSDP, eager)", "8b")),
    "TT-70B-fsdp32-tp8": ("TT", "h100-sxm", (80, 8192, 64, 8192, 128256),
                          LLAMA_70B, 512, 16, 8, 1, 32, 1, True, "full",
                          True, True, _tokens(512, 8192, 597.3, 256),
                          TT_CITE.format("asyncTP_llama3_h100_2025-06_"
                                         "torchtitan.md, 70b bfloat16 "
                                         "vanilla TP", "70b")),
    # MaxText, TPU v5p, one slice: (size, v5p-N, global_parameter_scale,
    # per-chip batch, tensor, remat_policy, TFLOP/s per chip, commit).
    "MX-32B": _mx_row("32B", 128, 32, 7, 4, "minimal", 328, "0d9779a5"),
    "MX-64B": _mx_row("64B", 128, 64, 3, 4, "minimal", 323, "3d048f7b"),
    "MX-128B-256": _mx_row("128B", 256, 128, 1, 8, "minimal", 315,
                           "07775101"),
    "MX-128B-512": _mx_row("128B", 512, 128, 1, 8, "minimal", 316,
                           "07775101"),
    "MX-256B": _mx_row("256B", 1024, 256, 1, 8, "minimal", 308, "07775101"),
    "MX-512B": _mx_row("512B", 1024, 512, 2, 8, "full", 294, "07775101"),
    # MaxText, TPU v4, one slice: (size, v4-N, (L, h, heads, MLP), per-chip
    # batch, TFLOP/s per chip).
    "MX-v4-22B": _mx_v4_row("22B", 128, (48, 6144, 24, 24576), 16, 156),
    "MX-v4-52B": _mx_v4_row("52B", 384, (32, 12288, 32, 49152), 10, 154),
}
LINKS = {"BL": dev.LINKS["S5"],
         "TT": {"hbm_bandwidth": 2.4e12, "memory": 96e9}}
NOT_COUNTED = {"TT": "hardware not a preset: 500 W H100 with HBM2e, peak "
                     "unstated by the source"}
# What a source's runtime does, as it states it: Megatron-Core's table ran
# with --tp-comm-overlap and --overlap-param-gather (which requires its
# distributed optimizer: megatron/training/arguments.py); BLOOM with
# DeepSpeed's pipeline engine and ZeRO stage 1 (gradients reduced after
# the last micro-batch: planner_published.RUNTIME["S5"]); PyTorch FSDP
# (llm-foundry, torchtitan) overlaps; MaxText's scripts turn on XLA's
# overlap of collectives with compute (`--xla_tpu_overlap_compute_
# collective_tc`, async collective fusion).
RUNTIME = {"MC": {"tp_overlap": True, "zero1": True,
                  "pipe_outermost": True},
           "BL": dev.RUNTIME["S5"], "MX": {"tp_overlap": True}}
TABLE = dict(rows=ROWS, links=LINKS, megatron_sources=(), runtime=RUNTIME)


def _per_gpu_rate(row):
    """Published samples per second per GPU (higher: faster)."""
    r = ROWS[row]
    return r[4] / r[14] / (r[6] * r[7] * r[8])


def estimate_row(row, presets=None):
    return dev.estimate_row(row, presets, **TABLE)


def errors(presets=None, counted_only=True):
    out = {}
    for row, r in ROWS.items():
        if counted_only and r[0] in NOT_COUNTED:
            continue
        estimated, published, _, _ = estimate_row(row, presets)
        out[row] = estimated / published - 1
    return out


def pairs():
    """(faster, slower) rows: same source, model, hardware, sequence,
    published rates per GPU at least 10% apart."""
    out = []
    for a, b in itertools.combinations(ROWS, 2):
        ra, rb = ROWS[a], ROWS[b]
        if ra[0] in NOT_COUNTED or (ra[0], ra[1], ra[2]) != (
                rb[0], rb[1], rb[2]):
            continue
        fa, fb = _per_gpu_rate(a), _per_gpu_rate(b)
        if max(fa, fb) / min(fa, fb) >= 1.10:
            out.append((a, b) if fa > fb else (b, a))
    return out


def pair_agreement(presets=None):
    """(agreeing pairs, all pairs, [disagreeing pairs])."""
    estimated = {}
    for row in ROWS:
        seconds, published, _, _ = estimate_row(row, presets)
        estimated[row] = _per_gpu_rate(row) * published / seconds
    wrong = [(f, s) for f, s in pairs() if estimated[f] <= estimated[s]]
    total = len(pairs())
    return total - len(wrong), total, wrong


COLUMNS = ("id", "source", "model_dims", "s", "V", "global_batch",
           "micro_batch", "t", "p", "d_vp", "SP", "recompute", "precision",
           "flash_attn", "hardware_count", "measured", "citation")


def write_csv(path):
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(COLUMNS)
        for row, r in ROWS.items():
            (source, hw, (L, h, a, s, V), kw, B, mb, t, p, d, v, sp, rc,
             fsdp, flash, seconds, cite) = r
            dims = f"L={L} h={h} a={a}"
            for key in ("ffn", "kv_heads", "gated"):
                if key in kw:
                    dims += f" {key}={kw[key]}"
            dp = f"{d} ({'FSDP' if fsdp else 'DP'}; vp={v})"
            precision = "fp16 mixed" if source == "BL" else "bf16"
            out.writerow([row, source, dims, s, V, B,
                          mb if mb else "n/s (rule: " + (
                              "1" if p > 1 else "per-replica batch") + ")",
                          t, p, dp, "yes" if sp else "no", rc or "none",
                          precision, "yes" if flash else "no",
                          f"{t * p * d}x {hw}", f"{seconds:.4g} s/iter",
                          cite])


def main():
    if "--csv" in sys.argv:
        write_csv(os.path.join(HERE, "planner_heldout.csv"))
    print("| run | hardware | GPUs | t/p/d | published s/iter | estimated "
          "s/iter | error |")
    print("|---|---|---|---|---|---|---|")
    for row, r in ROWS.items():
        estimated, published, _, _ = estimate_row(row)
        note = " (not counted)" if r[0] in NOT_COUNTED else ""
        fsdp = " fsdp" if r[12] else ""
        print(f"| {row} | {r[1]} | {r[6] * r[7] * r[8]} | {r[6]}/{r[7]}/"
              f"{r[8]}{fsdp} | {published:.3g} | {estimated:.3g} | "
              f"{estimated / published - 1:+.1%}{note} |")
    errs = errors()
    mae, worst = dev.summary(errs)
    print(f"\ncounted rows {len(errs)} of {len(ROWS)}; mean absolute error "
          f"{mae:.1%}; worst {worst:.1%}")
    for source in sorted({r[0] for r in ROWS.values()}):
        mine = {k: v for k, v in errors(counted_only=False).items()
                if ROWS[k][0] == source}
        m, w = dev.summary(mine)
        print(f"  {source}: {len(mine)} rows, MAE {m:.1%}, worst {w:.1%}")
    agree, total, wrong = pair_agreement()
    print(f"pairs ordered as published: {agree} of {total}; wrong: {wrong}")


if __name__ == "__main__":
    main()
