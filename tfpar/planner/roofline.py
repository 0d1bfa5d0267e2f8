"""Step time and memory of a transformer stack on given hardware, per op.

The cost model of `tfpar.estimate`: a transformer of L blocks (hidden h,
heads a, head width h/a, MLP width f, sequence s, vocabulary V) trained
with data d × pipe p × model t, micro-batches of b samples, costed op by op
on one device of the slowest pipeline stage (Megatron-LM's layout:
Narayanan et al. 2021, Korthikanti et al. 2022).

Every op is a roofline (Williams et al. 2009): time = max(FLOPs ÷
achievable FLOP/s, bytes ÷ achievable HBM bandwidth), compute-bound or
memory-bound by whichever is larger.

- GEMMs (forward per block, T = b·s tokens: QKV T×h×(h+2·kv·dₕ)/t,
  projection T×(h/t)×h, MLP T×h×f/t and T×(f/t)×h, gated MLPs one more)
  reach `peak × gemm × Π_x x/(x + gemm_half)` over their three dimensions
  (skinny or small matmuls — a tensor-parallel slice, attention's head
  width — run below peak; `peak` is the compute dtype's: bf16's, float32
  as TF32 when `Parallel.tf32`). Backward: the data and weight gradients, two
  GEMMs of the same FLOPs each.
- Attention without a fused kernel: QKᵀ and the product with V are
  batched GEMMs over b·a/t heads (s×s×dₕ: memory-bound below dₕ ≈ 156 on
  an A100), the fused scale-mask-softmax and the dropout stream the b·a/t·s²
  scores (2 and 2.5 elements each forward, 3 and 2.5 backward). With a
  fused (flash) kernel: 4·b·(a/t)·s²·dₕ FLOPs forward (half with a causal
  mask: masked tiles are skipped), 2.5× that backward, at `flash` × peak;
  no score tensor.
- Memory-bound ops per token (elements, forward / backward): two
  LayerNorms 2h / 3h each, two bias-dropout-adds 3.5h / 2.5h each (an add
  without dropout 3h / h), the activation 2f/t / 3f/t (a gated one 3f/t /
  5f/t); the norms and adds split over t with sequence parallelism.
- Embedding (first stage): the lookup writes T·h (4 elements per token
  with position add and dropout); its backward writes the dense V/t × h
  gradient and adds it to the fp32 one (12 bytes per element).
- Logits (last stage): the T × V/t × h GEMM and its two gradients, and
  the vocabulary-parallel cross-entropy over T·V/t fp32 logits (14 bytes
  per element forward, 10 backward).
- Tensor parallelism: per block 2 all-reduces of T·h forward and 2 in the
  backward pass (with sequence parallelism a reduce-scatter and an
  all-gather each, the same ring time), plus the embedding's forward and
  the logits' backward one; a ring over t: 2(t-1)/t · bytes/β + 2(t-1)·α,
  exposed (Megatron-LM does not overlap them); with `tp_overlap`
  (Megatron-Core's `--tp-comm-overlap`: Transformer Engine splits each
  all-gather / reduce-scatter into chunks pipelined with the GEMM that
  consumes / produces it) only what exceeds the block's GEMM time shows.
- Pipeline: each micro-batch sends T·h forward and its gradient back per
  stage boundary (1/t of it over the inter-stage link when t > 1, then an
  all-gather inside the host: Narayanan's scatter-gather), 2v - 1 times
  on the end stages and 2v on the others with v virtual stages (the
  chunks wrap around from the last stage to the first); the step is
  (m + (p-1)/v) micro-batches of the slowest stage (1F1B, interleaved
  1F1B and GPipe alike): the bubble is (p-1)/v of them.
- Recomputation: "full" runs each block's forward again (with its
  tensor-parallel all-reduces) before its backward; "selective" runs the
  attention core (QKᵀ, softmax, dropout, attention over V) again; nothing
  with a fused kernel, which recomputes it anyway.
- Data parallelism: the gradients' all-reduce (or, ZeRO-1, a
  reduce-scatter and an all-gather: the same ring time) over d, one
  bucket per block (each paying the ring's latency), so that the
  backward pass of the last micro-batch hides part of it — none of it
  without `grad_overlap` (Megatron-LM's local DDP before 2023 and
  DeepSpeed's pipeline engine reduce after the last micro-batch); with
  fsdp (ZeRO-3) every micro-batch all-gathers the weights for the
  forward and again for the backward pass and reduce-scatters the
  gradients, prefetched under that micro-batch's compute (what exceeds
  it shows, and each micro-batch's first gather). A collective that
  overlaps compute still costs `collective_share` of its time: NCCL's
  kernels occupy that fraction of the SMs (24 thread blocks: 22% of an
  A100's, 18% of an H100's), which the compute beside them loses.
- Optimizer update: Adam on the local weights streams 22 + 8·slots bytes
  per parameter (fp32 weight, gradient, slots; the half-precision copy;
  the gradient norm), split over d with fsdp or `zero1` (Megatron's
  distributed optimizer, DeepSpeed ZeRO-1: the fp32 master weights and
  slots sharded over d, also in `memory`).

Links: a group of n devices whose members are `stride` apart (axes laid
out data, pipe, model: model groups are neighbours) uses NVLink when it
fits in a host, else InfiniBand; on GPU hosts the group's k members per
host share k network ports (rail-optimised: β = k × per-GPU port), on a
TPU torus every group gets the ICI axis' bandwidth.

Memory per device (Korthikanti et al. 2022, eq. 1-2 and their Table 2):
activations per block and micro-batch s·b·h·(10 + 24/t + 5·a·s/(h·t))
bytes, 34/t + 5as/(ht) with sequence parallelism, without the score term
with selective recomputation or a fused kernel, 2 (the block's input)
with full recomputation (plus one block's whole activations, rebuilt
for its backward pass); × compute bytes / 2 for other than 16-bit
activations; the first stage holds p micro-batches of its
L/p blocks (1F1B; × (1 + (p-1)/(p·v)) interleaved, m with GPipe);
weights `param_bytes`, fp32 gradients, fp32 optimizer slots (/d with
fsdp), and the last stage's fp32 logits.

>>> gpt = Transformer(layers=24, hidden=2304, heads=24, seq=2048,
...                   vocab=51200)
>>> cfg = Parallel(data=32, microbatch=16)
>>> step_time(gpt, cfg, hardware.PRESETS["a100-80gb"], 512)["total"]  # s
"""

import dataclasses
import math

from tfpar.planner import hardware

RECOMPUTE = (None, "selective", "full")
SCHEDULES = ("1f1b", "gpipe", "interleaved")


@dataclasses.dataclass(frozen=True)
class Transformer:
    """The dimensions of a decoder stack (GPT-style)."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    ffn: int = 0            # MLP width (0: 4 · hidden)
    kv_heads: int = 0       # key/value heads (0: heads)
    gated: bool = False     # SwiGLU-style MLP: three kernels
    dropout: bool = True    # hidden and attention dropout
    causal: bool = True
    tied: bool = True       # logits share the embedding
    position_embedding: bool = True
    compute_bytes: int = 2  # bf16/fp16 activations
    param_bytes: int = 4    # stored weights (fp32 master; 2 + 4 Megatron)

    @property
    def ffn_width(self):
        return self.ffn or 4 * self.hidden

    @property
    def head_dim(self):
        return self.hidden // self.heads

    def block_params(self):
        h, f = self.hidden, self.ffn_width
        kv = (self.kv_heads or self.heads) * self.head_dim
        mlp = (3 if self.gated else 2) * h * f
        return h * (h + 2 * kv) + h * h + mlp + 4 * h + h + 2 * kv + f + h

    def embedding_params(self):
        position = self.seq * self.hidden if self.position_embedding else 0
        return self.vocab * self.hidden + position

    def num_params(self):
        head = 0 if self.tied else self.vocab * self.hidden
        return (self.layers * self.block_params() + self.embedding_params()
                + head + 2 * self.hidden)


@dataclasses.dataclass(frozen=True)
class Parallel:
    """One training configuration (Megatron-LM's names in comments)."""

    data: int = 1
    pipe: int = 1
    model: int = 1
    microbatch: int = 1          # samples per micro-batch (b)
    virtual_stages: int = 1      # interleaved chunks per device (v)
    schedule: str = "1f1b"
    sequence_parallel: bool = False
    recompute: str = None        # None, "selective", "full"
    fsdp: bool = False           # ZeRO-3
    flash: bool = False          # fused attention kernel
    tf32: bool = False           # float32 matmuls as TF32
    tp_overlap: bool = False     # --tp-comm-overlap (Transformer Engine)
    zero1: bool = False          # optimizer sharded over data (ZeRO-1)
    grad_overlap: bool = True    # data-axis reduction under the backward
    optimizer_slots: int = 2


class _Time:
    """Seconds by category and FLOPs executed, accumulated."""

    def __init__(self):
        self.parts = {"compute": 0.0, "memory_bound": 0.0}
        self.flops = 0.0

    def add(self, seconds, kind, flops=0.0):
        self.parts[kind] = self.parts.get(kind, 0.0) + seconds
        self.flops += flops

    def total(self):
        return sum(self.parts.values())

    def scaled(self, factor):
        out = _Time()
        out.parts = {k: v * factor for k, v in self.parts.items()}
        out.flops = self.flops * factor
        return out

    def merge(self, other):
        for k, v in other.parts.items():
            self.add(v, k)
        self.flops += other.flops


class _Device:
    """The roofline of one device: GEMMs, streams, collectives."""

    def __init__(self, hw, compute_bytes=2, tf32=False):
        self.hw = hw
        dtype = "float32" if compute_bytes >= 4 else "bfloat16"
        self.peak = hw.compute_peak(dtype, tf32)
        self.bandwidth = hw.hbm_bandwidth * hw.hbm

    def gemm(self, time, m, n, k, count=1.0, itemsize=2):
        """count × an (m × k) · (k × n) matmul."""
        flops = 2.0 * m * n * k * count
        efficiency = self.hw.gemm
        for x in (m, n, k):
            efficiency *= x / (x + self.hw.gemm_half)
        compute = flops / (self.peak * efficiency)
        memory = (m * k + k * n + m * n) * itemsize * count / self.bandwidth
        if compute >= memory:
            time.add(compute, "compute", flops)
        else:
            time.add(memory, "memory_bound", flops)

    def stream(self, time, nbytes):
        """An elementwise kernel reading and writing `nbytes` in all."""
        time.add(nbytes / self.bandwidth, "memory_bound")

    def flash(self, time, flops):
        time.add(flops / (self.peak * self.hw.flash), "compute", flops)


def link(cluster, hw, n, stride):
    """(α seconds per ring step, β bus bytes/s) of a group of n devices
    `stride` apart in row-major device order."""
    per_host = cluster.devices_per_host
    if n * stride <= per_host:
        return hw.intra_latency, hw.intra_bandwidth * hw.network_intra
    beta = hw.inter_bandwidth * hw.network_inter
    if hw.nics_shared:
        # k members of the group per host use k of the host's ports.
        members = max(1, min(n, per_host // stride))
        beta = min(beta * members, hw.intra_bandwidth * hw.network_intra)
    return hw.inter_latency, beta


def ring(kind, nbytes, n, alpha_beta, count=1):
    """Seconds of `count` ring all-reduces (2(n-1) steps each) or
    all-gathers / reduce-scatters ((n-1) steps) moving `nbytes` per device
    in all over n."""
    if n <= 1:
        return 0.0
    alpha, beta = alpha_beta
    steps = 2 * (n - 1) if kind == "all-reduce" else n - 1
    return count * steps * alpha + steps / n * nbytes / beta


def _gemm_shapes(model, cfg):
    """(m, n, k) of a block's forward GEMMs on one device (T = b·s)."""
    tokens, t = cfg.microbatch * model.seq, cfg.model
    h, f = model.hidden, model.ffn_width
    kv = (model.kv_heads or model.heads) * model.head_dim
    up = (2 if model.gated else 1) * f
    return [(tokens, (h + 2 * kv) / t, h), (tokens, h, h / t),
            (tokens, up / t, h), (tokens, h, f / t)]


def _attention_core(dev, model, cfg, backward=False):
    """QKᵀ, softmax, dropout and the product with V (or their gradients)
    of one block and micro-batch."""
    time = _Time()
    s, dh = model.seq, model.head_dim
    heads = cfg.microbatch * model.heads / cfg.model
    c = model.compute_bytes
    if cfg.flash:
        flops = 4.0 * heads * s * s * dh * (0.5 if model.causal else 1.0)
        dev.flash(time, flops * (2.5 if backward else 1.0))
        return time
    if backward:  # dQ, dK of QKᵀ; dP, dV of the product with V
        for shape in ((s, dh, s), (s, dh, s), (s, s, dh), (s, dh, s)):
            dev.gemm(time, *shape, count=heads, itemsize=c)
    else:
        dev.gemm(time, s, s, dh, count=heads, itemsize=c)
        dev.gemm(time, s, dh, s, count=heads, itemsize=c)
    softmax = 3.0 if backward else 2.0
    dropout = 2.5 if model.dropout else 0.0
    dev.stream(time, heads * s * s * (softmax + dropout) * c)
    return time


def _block(dev, model, cfg, backward=False):
    """One block's forward (or backward) pass, one micro-batch, without its
    tensor-parallel communication."""
    time = _Time()
    c = model.compute_bytes
    for m, n, k in _gemm_shapes(model, cfg):
        if backward:
            dev.gemm(time, m, k, n, itemsize=c)   # data gradient
            dev.gemm(time, k, n, m, itemsize=c)   # weight gradient
        else:
            dev.gemm(time, m, n, k, itemsize=c)
    time.merge(_attention_core(dev, model, cfg, backward))
    h, f, t = model.hidden, model.ffn_width, cfg.model
    split = t if cfg.sequence_parallel else 1
    norm = 3 if backward else 2
    add = (2.5 if backward else 3.5) if model.dropout else (
        1 if backward else 3)
    act = (5 if backward else 3) if model.gated else (3 if backward else 2)
    tokens = cfg.microbatch * model.seq
    elements = tokens * (2 * (norm + add) * h / split + act * f / t)
    dev.stream(time, elements * c)
    return time


def _embedding(dev, model, cfg, backward=False):
    time = _Time()
    tokens = cfg.microbatch * model.seq
    c = model.compute_bytes
    if backward:
        dev.stream(time, tokens * model.hidden * c
                   + 12.0 * model.vocab / cfg.model * model.hidden)
    else:
        dev.stream(time, 4.0 * tokens * model.hidden * c)
    return time


def _logits(dev, model, cfg, backward=False):
    time = _Time()
    tokens = cfg.microbatch * model.seq
    m, n, k = tokens, model.vocab / cfg.model, model.hidden
    c = model.compute_bytes
    if backward:
        dev.gemm(time, m, k, n, itemsize=c)
        dev.gemm(time, k, n, m, itemsize=c)
    else:
        dev.gemm(time, m, n, k, itemsize=c)
    dev.stream(time, tokens * n * (10.0 if backward else 14.0))
    return time


def _tensor_parallel(model, cfg, cluster, hw):
    """Seconds of one block's forward all-reduces over the model axis (its
    backward costs the same), and of the embedding's/logits' one."""
    nbytes = cfg.microbatch * model.seq * model.hidden * model.compute_bytes
    one = ring("all-reduce", nbytes, cfg.model,
               link(cluster, hw, cfg.model, 1))
    return 2 * one, one


def _stage_blocks(layers, p):
    """Blocks per stage: ⌈L/p⌉ or ⌊L/p⌋, the first and last stages (which
    hold the embedding and the logits) taking the fewer."""
    base, extra = divmod(layers, p)
    counts = [base] * p
    order = list(range(1, p - 1)) + [0, p - 1] if p > 2 else list(range(p))
    for i in order[:extra]:
        counts[i] += 1
    return counts


def _stage(dev, parts, model, cfg, blocks, first, last):
    """(forward+backward _Time, recompute _Time, model-axis seconds) of one
    micro-batch on a stage of `blocks` blocks."""
    work = parts["forward"].scaled(blocks)
    work.merge(parts["backward"].scaled(blocks))
    tp_block, tp_edge = parts["tensor_parallel"]
    model_axis = blocks * 2 * tp_block
    if cfg.tp_overlap:  # only what exceeds the block's GEMMs shows
        gemms = (parts["forward"].parts["compute"]
                 + parts["backward"].parts["compute"])
        model_axis = blocks * max(0.0, 2 * tp_block - gemms)
    for flag, name in ((first, "embedding"), (last, "logits")):
        if flag:
            work.merge(parts[name + "_forward"])
            work.merge(parts[name + "_backward"])
            model_axis += tp_edge
    recompute = _Time()
    if cfg.recompute == "full":
        recompute = parts["forward"].scaled(blocks)
        recompute.add(blocks * tp_block, "model")
    elif cfg.recompute == "selective" and not cfg.flash:
        recompute = parts["attention"].scaled(blocks)
    return work, recompute, model_axis


def _pipe_seconds(model, cfg, cluster, hw, stage):
    """Seconds per micro-batch of a stage's sends (activations forward,
    gradients back) to its neighbours. With v virtual stages chunk k lives
    on stage k mod p and each of the v·p chunks sends to the next and
    previous one but the ends: 2v sends per stage, one fewer on the first
    and on the last stage (2v - 1 for those: the wrap-around sends)."""
    p, t = cfg.pipe, cfg.model
    if p == 1:
        return 0.0
    nbytes = cfg.microbatch * model.seq * model.hidden * model.compute_bytes
    sends = 2 * cfg.virtual_stages - (stage == 0) - (stage == p - 1)
    if t * p <= cluster.devices_per_host:
        alpha, beta = hw.intra_latency, hw.intra_bandwidth * hw.network_intra
        gather = 0.0
    else:
        alpha, beta = hw.inter_latency, hw.inter_bandwidth * hw.network_inter
        gather = ring("all-gather", nbytes, t, link(cluster, hw, t, 1))
        nbytes /= t
    return sends * (alpha + nbytes / beta + gather)


def _parts(dev, model, cfg, cluster):
    """Per-block and per-edge costs of one micro-batch."""
    return {"forward": _block(dev, model, cfg),
            "backward": _block(dev, model, cfg, backward=True),
            "attention": _attention_core(dev, model, cfg),
            "embedding_forward": _embedding(dev, model, cfg),
            "embedding_backward": _embedding(dev, model, cfg, True),
            "logits_forward": _logits(dev, model, cfg),
            "logits_backward": _logits(dev, model, cfg, True),
            "tensor_parallel": _tensor_parallel(model, cfg, cluster,
                                                dev.hw)}


def stage_params(model, blocks, first, last):
    """Parameters of a stage (whole, before the model axis splits them)."""
    params = blocks * model.block_params()
    if first:
        params += model.embedding_params()
    if last:  # the final norm; a tied head is the first stage's table
        params += 2 * model.hidden + (
            0 if model.tied else model.vocab * model.hidden)
    return params


def _overlapped(comm, compute, share):
    """Exposed seconds of `comm` run under `compute`: what exceeds it, and
    the compute the collective's kernels take from it while they overlap
    (`share`: the fraction of the device's cores they occupy)."""
    hidden = min(comm, compute)
    return comm - hidden + hidden * share


def _data_axis(model, cfg, cluster, hw, params, *, blocks, backward,
               microbatches):
    """Exposed seconds of the data axis: the gradients' all-reduce (or
    ZeRO-1's reduce-scatter and all-gather, the same ring time) beyond the
    last micro-batch's backward pass — all of it without `grad_overlap`
    (Megatron-LM's local DDP before 2023 and DeepSpeed's pipeline engine
    reduce after the last micro-batch) — or fsdp's two gathers and one
    reduce-scatter per micro-batch beyond that micro-batch's compute
    (`backward`: one micro-batch's backward seconds, its forward half of
    them) plus each micro-batch's first gather, which nothing hides. What
    overlaps costs the compute it runs beside `hw.collective_share` of its
    time (the cores NCCL's kernels occupy). Each block's weights are one
    collective (a gradient bucket, an fsdp unit): its latency is paid per
    block; the first gather is one of the stage's `blocks` blocks."""
    d = cfg.data
    if d == 1:
        return 0.0
    ab = link(cluster, hw, d, cfg.model * cfg.pipe)
    nbytes = params / cfg.model * model.compute_bytes
    units = max(1, round(params / model.block_params()))
    share = hw.collective_share
    if not cfg.fsdp:
        reduce = ring("all-reduce", nbytes, d, ab, units)
        return _overlapped(reduce, backward if cfg.grad_overlap else 0.0,
                           share)
    per_microbatch = (2 * ring("all-gather", nbytes, d, ab, units)
                      + ring("reduce-scatter", nbytes, d, ab, units))
    first_gather = ring("all-gather", nbytes / max(1, blocks), d, ab)
    return microbatches * (first_gather + _overlapped(
        per_microbatch, 1.5 * backward, share))


def step_time(model, cfg, hw, global_batch, devices_per_host=None):
    """{part: seconds} of one training step on the slowest stage (their sum
    under "total"), and "executed_flops" per device (recomputation
    included)."""
    cluster = _Host(devices_per_host or hw.devices_per_host)
    dev = _Device(hw, model.compute_bytes, cfg.tf32)
    parts = _parts(dev, model, cfg, cluster)
    m = global_batch // (cfg.data * cfg.microbatch)
    p, v = cfg.pipe, cfg.virtual_stages
    best = None
    for s, blocks in enumerate(_stage_blocks(model.layers, p)):
        first, last = s == 0, s == p - 1
        work, recompute, model_axis = _stage(dev, parts, model, cfg, blocks,
                                             first, last)
        pipe = _pipe_seconds(model, cfg, cluster, hw, s)
        per_microbatch = work.total() + recompute.total() + model_axis + pipe
        backward = (parts["backward"].total() * blocks
                    + recompute.total() + model_axis / 2)
        params = stage_params(model, blocks, first, last)
        data = _data_axis(model, cfg, cluster, hw, params, blocks=blocks,
                          backward=backward, microbatches=m)
        local = params / cfg.model / (
            cfg.data if cfg.fsdp or cfg.zero1 else 1)
        update = local * (22 + 8 * cfg.optimizer_slots) / dev.bandwidth
        bubble = per_microbatch * (p - 1) / v
        total = m * per_microbatch + bubble + data + update
        if best is None or total > best["total"]:
            best = dict(work.scaled(m).parts)
            best.update(recompute=m * recompute.total(),
                        model=m * model_axis, pipe=m * pipe, bubble=bubble,
                        data=data, update=update, total=total,
                        executed_flops=m * (work.flops + recompute.flops))
    return best


class _Host:
    """What `link` reads of a cluster."""

    def __init__(self, devices_per_host):
        self.devices_per_host = devices_per_host


def memory(model, cfg, global_batch):
    """{kind: bytes} per device of the first stage (the most activations
    in flight): params, gradients, optimizer, activations, workspace."""
    p, t, d, v = cfg.pipe, cfg.model, cfg.data, cfg.virtual_stages
    blocks = _stage_blocks(model.layers, p)[0]
    params = stage_params(model, blocks, True, p == 1) / t
    trainable_split = d if cfg.fsdp else 1
    m = global_batch // (d * cfg.microbatch)
    sbh = model.seq * cfg.microbatch * model.hidden * model.compute_bytes / 2
    # Korthikanti's bytes per s·b·h (2-byte activations; `sbh` scales them
    # to the compute dtype) of one block: what it stores without
    # recomputation (the scores dropped by a fused kernel), what a full
    # recomputation rebuilds one block at a time (the workspace).
    scores = 0.0 if cfg.flash else (
        5.0 * model.heads * model.seq / model.hidden / t)
    whole_block = scores + (
        34.0 / t if cfg.sequence_parallel else 10 + 24.0 / t)
    per_block = {None: whole_block, "selective": whole_block - scores,
                 "full": 2.0}[cfg.recompute]
    in_flight = m if cfg.schedule == "gpipe" else min(m, p)
    if v > 1:
        in_flight *= 1 + (p - 1) / (p * v)
    activations = per_block * sbh * blocks * in_flight
    workspace = whole_block * sbh if cfg.recompute == "full" else 0.0
    if p == 1:  # the logits and their gradient, fp32
        workspace += 8.0 * model.seq * cfg.microbatch * model.vocab / t
    # ZeRO-1 (Megatron's distributed optimizer): the fp32 master weights
    # and the slots sharded over data, the half-precision copy whole.
    master = model.param_bytes - model.compute_bytes
    param_bytes = (model.compute_bytes + master / d if cfg.zero1
                   else model.param_bytes)
    optimizer_split = d if cfg.zero1 else trainable_split
    return {"params": params * param_bytes / trainable_split,
            "gradients": params * 4 / trainable_split,
            "optimizer": params * 4 * cfg.optimizer_slots / optimizer_split,
            "activations": activations, "workspace": workspace}


def communication_bytes(model, cfg, global_batch):
    """{axis: bytes} each device of the first stage sends or receives in
    collectives per step (message sizes, as `communication_report`
    counts them)."""
    m = global_batch // (cfg.data * cfg.microbatch)
    blocks = _stage_blocks(model.layers, cfg.pipe)[0]
    activation = cfg.microbatch * model.seq * model.hidden * model.compute_bytes
    passes = 4 + (2 if cfg.recompute == "full" else 0)
    params = stage_params(model, blocks, True, cfg.pipe == 1) / cfg.model
    grads = params * model.compute_bytes
    data = (3 * m * grads if cfg.fsdp else grads) if cfg.data > 1 else 0.0
    return {"model": (blocks * passes + 1) * activation * m
            if cfg.model > 1 else 0.0,
            "data": float(data),
            # first stage: v chunks send forward and receive gradients,
            # v - 1 receive activations and send gradients.
            "pipe": (4.0 * cfg.virtual_stages - 2) * activation * m
            if cfg.pipe > 1 else 0.0}
