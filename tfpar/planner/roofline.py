"""Step time and memory of a transformer stack on given hardware, per op.

The cost model of `tfpar.estimate`: a transformer of L blocks (hidden h,
heads a, head width dₕ (h/a unless given: Gemma's 256 at h = 3072, a =
16), attention width q = a·dₕ, MLP width f, sequence s, vocabulary V) trained
with data d × pipe p × model t, micro-batches of b samples, costed op by op
on one device of the slowest pipeline stage (Megatron-LM's layout:
Narayanan et al. 2021, Korthikanti et al. 2022).

Every op is a roofline (Williams et al. 2009): time = max(FLOPs ÷
achievable FLOP/s, bytes ÷ achievable HBM bandwidth), compute-bound or
memory-bound by whichever is larger.

An encoder-decoder is one stack of its encoder and decoder blocks, a
decoder block holding a cross attention too (`Transformer.
cross_attention`: per block on average): its GEMMs, scores (unmasked),
norm, residual add, tensor-parallel all-reduces and stored activations
are another attention's, over the same length s; `Transformer.gated` is
the share of blocks whose MLP is gated (an encoder and a decoder may
differ), `Transformer.causal` the share whose self-attention is causal
(the decoder's; a fused kernel skips half their scores).

- GEMMs (forward per block, T = b·s tokens: QKV T×h×(h+2·kv·dₕ)/t,
  projection T×(h/t)×h, MLP T×h×f/t and T×(f/t)×h, gated MLPs one more)
  reach `peak × gemm × Π_x x/(x + gemm_half)` over their three dimensions
  (skinny or small matmuls — a tensor-parallel slice, attention's head
  width — run below peak; `peak` is the compute dtype's: bf16's, float32
  as TF32 when `Parallel.tf32`). Backward: the data and weight gradients, two
  GEMMs of the same FLOPs each (the weight gradients' × the share of the
  weights that train, `Transformer.trainable_share`: < 1 for a LoRA
  fine-tune).
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
- Logits (last stage), as the head is split over the model axis
  (`Parallel.head`): vocabulary-parallel ("vocab": Megatron-LM's, and
  tfpar's `VocabParallel`), the T × V/t × h GEMM and its two gradients
  and the cross-entropy over T·V/t fp32 logits (14 bytes per element
  forward, 10 backward); split over the hidden dimension ("hidden":
  tfpar's embedding heads without `vocab_parallel`), T × V × h/t GEMMs
  whose partial logits an all-reduce of T·V sums, then the cross-entropy
  over all T·V; whole ("replicated": a Dense head without
  `vocab_parallel`), T × V × h GEMMs on every device, its V·h weights
  and their gradients not split over t. tfpar's `VocabParallel` on a
  tied table (`Parallel.table_gradient_gemm`) makes the table's gradient
  a GEMM of one-hot ids and the lookup's output gradient (V/t × T × h per
  device, its one-hot T × V/t held meanwhile), where Megatron-LM adds
  rows (`vocab_parallel.lookup`), and sums that gradient over the data
  axis apart from the projection's (V/t × h once more). A model without a
  vocabulary head (`Transformer.lm_head` False: a classifier, a bare
  backbone; "none") has no logits: nothing of this.
- Tensor parallelism: per block 2 all-reduces of T·h forward and 2 in the
  backward pass, one more each per cross attention (with sequence
  parallelism a reduce-scatter and an all-gather each, the same ring
  time), plus the embedding's forward and
  the logits' backward one (the logits': none for a replicated head, and
  the partial logits' all-reduce too for a hidden-split one); a ring
  over t: 2(t-1)/t · bytes/β + 2(t-1)·α, exposed (Megatron-LM does not
  overlap them); with `tp_overlap` (Megatron-Core's `--tp-comm-overlap`:
  Transformer Engine splits each all-gather / reduce-scatter into chunks
  pipelined with the GEMM that consumes / produces it) only what exceeds
  the block's GEMM time shows.
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

- Expert parallelism (mixture-of-experts blocks: E experts of MLP width f,
  top-k routing, the banks split e ways), in tfpar's two placements. A
  device's dispatch group is its T = b·s/c tokens; each expert takes at
  most C = ⌈cf·k·T/E⌉ of them (`capacity_factor` cf; dropless: C = T,
  which under static shapes computes as much as masking every expert on
  every token). Per block: the router GEMM T×E×h (float32), GShard's
  dispatch and combine einsums, and the expert GEMMs.
  * A separate expert axis (`expert_on_data=False`): tokens are split
    over data only, so every device of the expert axis holds the same
    tokens and repeats every op outside the expert GEMMs (DTensor maps a
    tensor dimension to one mesh axis); each runs its E/e experts on C
    slots each (cf·k·T/e token-experts) and the combine is one
    all-reduce of T×h over e forward; backward the all-reduce of its
    gradient (T×h) and an all-gather of the combine weights' gradient
    (T×E×C float32) for the router.
  * Experts over the data axis (`expert_on_data=True`, e = d, GShard's
    placement): each device routes its own tokens, the dispatched
    [E, C, h] block is exchanged over the data axis before the expert
    FFN and back after it (tfpar's all-to-all is an all-gather of the n
    blocks and a slice under DTensor 2.21: n× a true all-to-all's
    bytes, and DTensor runs the gather as an all-reduce of zero-padded
    blocks, 2(n-1)/n of that message, unless fsdp on a one-axis mesh
    makes it a real gather: `gather_kind`), 4 exchanges per block,
    exposed; each device runs its E/e experts on e·C slots. Nothing
    outside the MoE blocks is repeated.
  Expert banks' gradients are reduced over data (× context) with a
  separate axis and not at all over the data axis that owns them.
- Context parallelism (the sequence split over c, Megatron-Core's
  all-gather mode): every token op runs on s/c tokens; each block
  all-gathers its keys and values over c (b·s·2·kv·dₕ/t elements per
  device) and reduce-scatters their gradients backward; attention scores
  are (s/c) × s per head (halved with a fused kernel and causal load
  balance, which evens the unmasked blocks over the devices); the
  weights' gradients are reduced over data × context.

Links: a group of n devices whose members are `stride` apart uses NVLink
when it fits in a host, else InfiniBand (tfpar's mesh lays its axes out
data, pipe, model: model groups are neighbours, data members t·p apart;
Megatron-LM and DeepSpeed put the pipe axis outermost,
`Parallel.pipe_outermost`: data members t apart, stage neighbours t·d
apart); on GPU hosts the group's k members per host share k network
ports (rail-optimised: β = k × per-GPU port), on a TPU torus every group
gets the ICI axis' bandwidth.

Memory per device (Korthikanti et al. 2022, eq. 1-2 and their Table 2):
activations per block and micro-batch s·b·h·(10 + 24/t + 5·a·s/(h·t))
bytes, 34/t + 5as/(ht) with sequence parallelism (the 24/t's 8/t of
query, key, value and the output projection's input × q/h when the
attention width is not h, its MLP's 16/t × f/(4h), × 1.5 for a gated
MLP: gate, up and their product against GeLU's input and output; a
cross attention adds another attention's 5 + 8/t, 13/t, and scores),
without the score term
with selective recomputation or a fused kernel, 2 (the block's input)
with full recomputation (plus one block's whole activations, rebuilt
for its backward pass; tfpar recomputes each block whole where it finds
it, `tfpar.recompute_spans`, else layer by layer, when a block of several
layers keeps each one's output: 2 per h-wide output plus 2·w/(h·t) per
wider one, `Transformer.kept_hidden`, `kept_wide`); where the first
stage is the last, the final norm's and the head's inputs, 2 + 2;
× compute bytes / 2 for other than 16-bit activations; the first stage
holds p micro-batches of its
L/p blocks (1F1B; × (1 + (p-1)/(p·v)) interleaved, m with GPipe);
weights `param_bytes`, fp32 gradients and optimizer slots of the
`trainable_share` that trains (/d with fsdp; a replicated head's not
split over t), the last stage's fp32 logits and their gradient (T·V/t,
or T·V when the head is not vocabulary-parallel), and with
`table_gradient_gemm` the one-hot ids of the tied table's gradient
(T × V/t in the compute dtype).

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
# How the output head is split over the model axis (`Parallel.head`).
HEADS = ("vocab", "hidden", "replicated", "none")


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
    key_dim: int = 0        # width of one head (0: hidden // heads)
    # SwiGLU-style MLP (three kernels): the share of blocks with one
    # (True: every block; an encoder-decoder may mix, Moonshine)
    gated: float = False
    dropout: bool = True    # hidden and attention dropout
    # Causal self-attention: the share of blocks masking later tokens (an
    # encoder-decoder's decoder blocks; True: every block)
    causal: float = True
    tied: bool = True       # logits share the embedding (no V × h of
    #                         their own; without `lm_head`: none held)
    # The logits are the token embedding layer's projection (a tied table,
    # or keras-hub's untied ReversibleEmbedding's reverse table: split by
    # hidden unless vocabulary-parallel); False: a separate Dense head.
    embedding_head: bool = True
    position_embedding: bool = True
    token_tables: int = 1   # V × h tables (an encoder's and a decoder's)
    compute_bytes: int = 2  # bf16/fp16 activations
    param_bytes: float = 4  # stored weights (fp32 master; 2 + 4 Megatron;
    #                         a Keras model's mean over its weights: an
    #                         int8-quantized one ~1)
    # The share of the weights that train (their gradients and optimizer
    # slots): < 1 with frozen weights (a LoRA fine-tune's backbone).
    trainable_share: float = 1.0
    experts: int = 0        # mixture-of-experts MLPs (0: a dense MLP)
    top_k: int = 0          # experts per token
    # Logits over the vocabulary (`transformer.vocab_head`); False: none
    # (a classifier's few outputs or a backbone's states end the model).
    lm_head: bool = True
    # What full recomputation keeps of a block: recomputed whole (a block
    # `tfpar.recompute_spans` finds, or one that is one layer) its input
    # alone, as Megatron-LM does: (1, 0), Korthikanti's 2·s·b·h bytes;
    # recomputed layer by layer, its layers' outputs (the next layers'
    # inputs), h wide (`kept_hidden` of them, whole on every device) and
    # wider (their widths over h summed in `kept_wide`, split over t:
    # column-parallel outputs).
    kept_hidden: float = 1.0
    kept_wide: float = 0.0
    # Cross-attention layers per block: an encoder-decoder's decoder
    # blocks hold one each (queries from the decoder, keys and values from
    # the encoder's output), averaged over its blocks (0.5 for as many
    # encoder as decoder blocks); each costed as another attention of the
    # block, its scores unmasked, over the same length s.
    cross_attention: float = 0.0

    @property
    def ffn_width(self):
        return self.ffn or 4 * self.hidden

    @property
    def head_dim(self):
        return self.key_dim or self.hidden // self.heads

    @property
    def attention_width(self):
        """q = heads · head width: the query's and the output projection's
        inner width (h unless the heads are wider or narrower)."""
        return self.heads * self.head_dim

    def mlp_params(self):
        """One MLP's (one expert's) kernels."""
        return (2 + self.gated) * self.hidden * self.ffn_width

    def bank_params(self):
        """A block's expert banks (0 without experts)."""
        return self.experts * self.mlp_params()

    def attention_params(self):
        """One attention's kernels (query, key, value, output projection),
        biases and its norm's scale and offset."""
        h, q = self.hidden, self.attention_width
        kv = (self.kv_heads or self.heads) * self.head_dim
        return h * (q + 2 * kv) + q * h + q + 2 * kv + h + 2 * h

    def block_params(self):
        h, f = self.hidden, self.ffn_width
        mlp = (self.bank_params() + h * self.experts if self.experts
               else self.mlp_params())
        # its attentions, the MLP with its bias and its norm's scale and
        # offset
        return self.attentions * self.attention_params() + mlp + f + 2 * h

    @property
    def attentions(self):
        """Attention layers per block: its own and `cross_attention`."""
        return 1 + self.cross_attention

    @property
    def branches(self):
        """Residual branches per block, its attentions and its MLP: each
        has a norm, a residual add and a tensor-parallel all-reduce each
        way."""
        return 1 + self.attentions

    def embedding_params(self):
        position = self.seq * self.hidden if self.position_embedding else 0
        return self.token_tables * self.vocab * self.hidden + position

    def head_params(self):
        """The logits' own kernel: V·h for an untied head (or a reverse
        table held without a head), else 0."""
        return 0 if self.tied else self.vocab * self.hidden

    def num_params(self):
        return (self.layers * self.block_params() + self.embedding_params()
                + self.head_params() + 2 * self.hidden)


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
    # Rank order: tfpar's mesh lays devices out data, pipe, model (data
    # members t·p apart, stage neighbours t apart); Megatron-LM's and
    # DeepSpeed's is pipe, data, model (True: data members t apart).
    pipe_outermost: bool = False
    optimizer_slots: int = 2
    expert: int = 1              # expert banks split e ways (EP)
    expert_on_data: bool = False  # the data axis splits the banks (e = d)
    context: int = 1             # sequences split c ways (CP)
    capacity_factor: float = None  # tokens per expert ÷ k·T/E (None: dropless)
    # The output head over the model axis (`HEADS`, `head_layout`): split
    # over the vocabulary (Megatron-LM's vocab-parallel head, tfpar's
    # `VocabParallel`), over the hidden dimension (partial logits summed),
    # or replicated ("none": the model has no vocabulary head);
    # `table_gradient_gemm`: a tied table split over the vocabulary gets
    # its gradient from a GEMM of one-hot ids (tfpar under DTensor:
    # `vocab_parallel.lookup`), not from rows added (Megatron-LM).
    head: str = "vocab"
    table_gradient_gemm: bool = False

    def __post_init__(self):
        if self.head not in HEADS:
            raise ValueError(f"Parallel(head) must be one of {HEADS}. "
                             f"Received: head={self.head!r}")

    @property
    def vocab_parallel(self):
        """Whether each device computes V/t of the logits."""
        return self.head == "vocab" or self.model == 1

    @property
    def logits(self):
        """Whether the model computes logits over a vocabulary."""
        return self.head != "none"

    @property
    def replicas(self):
        """Devices holding other samples or tokens of one stage's weights:
        data × context (the gradients' reduction group; the devices of a
        separate expert axis hold the same tokens)."""
        return self.data * self.context

    @property
    def expert_axis_size(self):
        """The separate expert axis' size (1 when the banks are split over
        the data axis, or not at all)."""
        return 1 if self.expert_on_data else self.expert

    @property
    def data_stride(self):
        """How many ranks apart the data axis' members are."""
        return self.model * (1 if self.pipe_outermost else self.pipe)

    @property
    def pipe_stride(self):
        """How many ranks apart neighbouring stages are."""
        return self.model * (self.data if self.pipe_outermost else 1)


def pipe_outermost(axes):
    """Whether the ordered `axes` ({name: size}, a mesh's axes: devices
    laid out row-major) put "pipe" before "data", as Megatron-LM and
    DeepSpeed do (`Parallel.pipe_outermost`)."""
    order = list(axes)
    return ("pipe" in order and "data" in order
            and order.index("pipe") < order.index("data"))


def tokens(model, cfg):
    """T, the tokens of one micro-batch on one device: b·s/c."""
    return cfg.microbatch * model.seq / cfg.context


def capacity(model, cfg):
    """C, the tokens one expert takes from one dispatch group (a device's
    T tokens): ⌈cf·k·T/E⌉, or T when dropless."""
    group = tokens(model, cfg)
    if cfg.capacity_factor is None:
        return group
    return math.ceil(cfg.capacity_factor * model.top_k * group
                     / model.experts)


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
    `stride` apart in row-major device order (`cluster`: a `Network`, or
    a `Cluster`); over several slices hierarchical
    (`hardware.across_slices`: a ring in each slice, then one over the
    slices on the data-center network)."""
    per_host = cluster.devices_per_host
    if n * stride <= per_host:
        return hw.intra_latency, hw.intra_bandwidth * hw.network_intra
    per_slice = cluster.devices_per_slice
    if n > 1 and n * stride > per_slice:
        members = per_slice // stride
        inner = (link(cluster, hw, members, stride) if members > 1
                 else _across_hosts(hw, 1))
        return hardware.across_slices(n, members, inner, (
            cluster.slice_latency, cluster.slice_bandwidth * hw.network_inter))
    return _across_hosts(hw, max(1, min(n, per_host // stride)))


def _across_hosts(hw, members):
    """(α, β) across hosts of a group with `members` per host: with
    shared network ports (GPU hosts) the k members use k of them."""
    beta = hw.inter_bandwidth * hw.network_inter
    if hw.nics_shared:
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
    """(m, n, k, count) of a block's forward GEMMs on one device (T = b·s;
    count: `model.attentions` for the attention's)."""
    rows, t = tokens(model, cfg), cfg.model
    h, f, q = model.hidden, model.ffn_width, model.attention_width
    kv = (model.kv_heads or model.heads) * model.head_dim
    up = (1 + model.gated) * f
    n = model.attentions
    attention = [(rows, (q + 2 * kv) / t, h, n), (rows, h, q / t, n)]
    if model.experts:  # the MLP is `_experts`' routed FFN
        return attention
    return attention + [(rows, up / t, h, 1), (rows, h, f / t, 1)]


def _experts(dev, model, cfg, backward=False):
    """A mixture-of-experts MLP of one micro-batch on one device: router,
    dispatch and combine einsums (over all E experts' slots with experts
    on the data axis, the E/e local ones' with a separate axis), the E/e
    local experts' GEMMs on e·C (resp. C) slots each; the exchanges are
    `_exchanges`'."""
    time = _Time()
    if not model.experts:
        return time
    rows, c = tokens(model, cfg), model.compute_bytes
    e, t, E = cfg.expert, cfg.model, model.experts
    cap = capacity(model, cfg)
    h, f = model.hidden, model.ffn_width
    up = (1 + model.gated) * f
    slots = E * cap if cfg.expert_on_data else E / e * cap
    per_expert = e * cap if cfg.expert_on_data else cap
    shapes = [((rows, E, h), 1, 4),                 # router, float32
              ((slots, h, rows), 1, c),             # dispatch einsum
              ((rows, h, slots), 1, c),             # combine einsum
              ((per_expert, up / t, h), E / e, c),  # expert FFN, per expert
              ((per_expert, h, f / t), E / e, c)]
    for (m, n, k), count, itemsize in shapes:
        if backward:
            dev.gemm(time, m, k, n, count=count, itemsize=itemsize)
            dev.gemm(time, k, n, m, count=count, itemsize=itemsize)
        else:
            dev.gemm(time, m, n, k, count=count, itemsize=itemsize)
    # elementwise passes over f: (3, 2) plain, (5, 3) gated
    act = (3 + 2 * model.gated) if backward else (2 + model.gated)
    dev.stream(time, E / e * per_expert * act * f / t * c)
    return time


def _attention_core(dev, model, cfg, backward=False):
    """QKᵀ, softmax, dropout and the product with V (or their gradients)
    of one block and micro-batch: its self-attention's and its
    `cross_attention`'s (scores unmasked)."""
    time = _self_attention_core(dev, model, cfg, backward)
    if model.cross_attention:
        cross = dataclasses.replace(model, causal=False)
        time.merge(_self_attention_core(dev, cross, cfg, backward).scaled(
            model.cross_attention))
    return time


def _self_attention_core(dev, model, cfg, backward=False):
    time = _Time()
    # q queries (the device's s/c) against all s keys (gathered over c).
    s, q, dh = model.seq, model.seq / cfg.context, model.head_dim
    heads = cfg.microbatch * model.heads / cfg.model
    c = model.compute_bytes
    if cfg.flash:
        # a causal mask's tiles above the diagonal skipped: half the FLOPs
        flops = 4.0 * heads * q * s * dh * (1.0 - 0.5 * model.causal)
        dev.flash(time, flops * (2.5 if backward else 1.0))
        return time
    if backward:  # dQ, dK of QKᵀ; dP, dV of the product with V
        for shape in ((q, dh, s), (s, dh, q), (q, s, dh), (s, dh, q)):
            dev.gemm(time, *shape, count=heads, itemsize=c)
    else:
        dev.gemm(time, q, s, dh, count=heads, itemsize=c)
        dev.gemm(time, q, dh, s, count=heads, itemsize=c)
    softmax = 3.0 if backward else 2.0
    dropout = 2.5 if model.dropout else 0.0
    dev.stream(time, heads * q * s * (softmax + dropout) * c)
    return time


def _block(dev, model, cfg, backward=False):
    """One block's forward (or backward) pass, one micro-batch, without its
    tensor-parallel communication."""
    time = _Time()
    c = model.compute_bytes
    for m, n, k, count in _gemm_shapes(model, cfg):
        if backward:
            dev.gemm(time, m, k, n, count=count, itemsize=c)  # data grad
            # weight grad: the trained share's (frozen weights have none)
            dev.gemm(time, k, n, m, count=count * model.trainable_share,
                     itemsize=c)
        else:
            dev.gemm(time, m, n, k, count=count, itemsize=c)
    time.merge(_attention_core(dev, model, cfg, backward))
    time.merge(_experts(dev, model, cfg, backward))
    h, f, t = model.hidden, model.ffn_width, cfg.model
    split = t if cfg.sequence_parallel else 1
    norm = 3 if backward else 2
    add = (2.5 if backward else 3.5) if model.dropout else (
        1 if backward else 3)
    # elementwise passes over f: (3, 2) plain, (5, 3) gated
    act = (3 + 2 * model.gated) if backward else (2 + model.gated)
    if model.experts:  # counted in `_experts`
        act = 0
    # a norm and a residual add per residual branch
    elements = tokens(model, cfg) * (model.branches * (norm + add) * h / split
                                     + act * f / t)
    dev.stream(time, elements * c)
    return time


def _embedding(dev, model, cfg, backward=False):
    """The lookup (T·h written, 4 elements per token with the position add
    and dropout) or its backward: T·h read and the dense gradient of the
    table a device holds (V/t × h) added to the fp32 one (12 bytes per
    element), made by a one-hot GEMM (V/t × h × T) with
    `table_gradient_gemm`."""
    time = _Time()
    rows = tokens(model, cfg)
    c = model.compute_bytes
    if backward:
        if cfg.table_gradient_gemm:
            dev.gemm(time, model.vocab / cfg.model, model.hidden, rows,
                     itemsize=c)
        dev.stream(time, rows * model.hidden * c
                   + 12.0 * model.vocab / cfg.model * model.hidden)
    else:
        dev.stream(time, 4.0 * rows * model.hidden * c)
    return time


def _logits_shape(model, cfg):
    """(m, n, k) of the head's GEMM on one device: T × V/t × h split over
    the vocabulary, T × V × h/t over the hidden dimension (partial
    logits), T × V × h replicated."""
    m, n, k = tokens(model, cfg), model.vocab, model.hidden
    if cfg.head == "vocab":
        n /= cfg.model
    elif cfg.head == "hidden":
        k /= cfg.model
    return m, n, k


def logits_flops(model, cfg):
    """Forward FLOPs of the head's GEMM on one device (2·m·n·k of
    `_logits_shape`; 0 without a vocabulary head)."""
    if not cfg.logits:
        return 0.0
    m, n, k = _logits_shape(model, cfg)
    return 2.0 * m * n * k


def _logits(dev, model, cfg, backward=False):
    """The head's GEMM (or its data and weight gradients) and the
    cross-entropy over the logits a device holds (m × n, fp32: 14 bytes
    per element forward, 10 backward); nothing without a vocabulary
    head."""
    time = _Time()
    if not cfg.logits:
        return time
    m, n, k = _logits_shape(model, cfg)
    c = model.compute_bytes
    if backward:
        dev.gemm(time, m, k, n, itemsize=c)
        dev.gemm(time, k, n, m, itemsize=c)
    else:
        dev.gemm(time, m, n, k, itemsize=c)
    dev.stream(time, m * n * (10.0 if backward else 14.0))
    return time


def head_layout(model, t, vocab_parallel):
    """{"head", "table_gradient_gemm"}: the `Parallel` fields of the head
    tfpar runs for `model` over a model axis of t — `VocabParallel` when
    `vocab_parallel` (a tied table's gradient then a one-hot GEMM), else
    auto_rules' default: an embedding head split by hidden (partial
    logits summed over t), a Dense head whole; "none" for a model
    without a vocabulary head (`Transformer.lm_head`)."""
    if not model.lm_head:
        return {"head": "none", "table_gradient_gemm": False}
    if t == 1 or vocab_parallel:
        return {"head": "vocab",
                "table_gradient_gemm": bool(t > 1 and model.tied)}
    return {"head": "hidden" if model.embedding_head else "replicated",
            "table_gradient_gemm": False}


def _edges(model, cfg, group, one):
    """Seconds per micro-batch of the embedding's and the logits' model-axis
    collectives over `group` (α, β): `one` all-reduce of T·h each (the
    lookup's, the input gradient's); for the logits none when the head is
    replicated, and the partial logits' all-reduce (T·V) too when it is
    split over the hidden dimension."""
    logits = {"vocab": one, "replicated": 0.0, "none": 0.0,
              "hidden": one + ring("all-reduce", logits_bytes(model, cfg),
                                   cfg.model, group)}[cfg.head]
    return one, logits


def hidden_bytes(model, cfg):
    """One micro-batch's T·h activations in the compute dtype: what a
    block's tensor-parallel all-reduce, a pipeline send and a vocabulary-
    split head's input gradient move."""
    return tokens(model, cfg) * model.hidden * model.compute_bytes


def logits_bytes(model, cfg):
    """The partial logits one all-reduce sums (T·V, compute dtype) when the
    head is split over the hidden dimension."""
    return tokens(model, cfg) * model.vocab * model.compute_bytes


def _tensor_parallel(model, cfg, cluster, hw):
    """Seconds of one block's forward all-reduces over the model axis (its
    backward costs the same): one per residual branch; and
    (embedding, logits) of `_edges`."""
    nbytes = hidden_bytes(model, cfg)
    group = link(cluster, hw, cfg.model, 1)
    one = ring("all-reduce", nbytes, cfg.model, group)
    return model.branches * one, _edges(model, cfg, group, one)


def expert_exchange_bytes(model, cfg):
    """{"forward", "backward"}: the message bytes (as
    `communication_report` counts them: a gather's whole gathered tensor)
    of one MoE block's collectives over its expert group, one micro-batch,
    per device.

    Experts on the data axis: a true all-to-all would send each device's
    dispatched block, E·C·h = cf·k·T·h elements (tokens × top-k ×
    capacity factor × hidden: issue 36's formula, × dtype bytes), for
    the dispatch and again for the combine, forward and backward (the
    backward of each exchange is the reverse exchange: 4 per block when
    the block's input needs a gradient, as in every block after an
    embedding). `collectives.all_to_all` under DTensor 2.21 is a gather
    of the e devices' blocks then a slice: its message is e·cf·k·T·h,
    e times the formula (measured: tests/test_moe_layer.py,
    "global tokens × top_k × capacity_factor × hidden").

    A separate expert axis: forward, the combine's all-reduce of the
    tokens' outputs, T·h; backward, the all-reduce of their gradient
    (T·h, the input gradient's sum over the axis' local experts) and the
    gather of the combine weights' gradient (T·E·C, float32) for the
    router (tfpar/experts.py's module docstring)."""
    if not model.experts or cfg.expert == 1:
        return {"forward": 0.0, "backward": 0.0}
    rows, cap, c = tokens(model, cfg), capacity(model, cfg), (
        model.compute_bytes)
    if cfg.expert_on_data:
        one = cfg.expert * model.experts * cap * model.hidden * c
        return {"forward": 2 * one, "backward": 2 * one}
    outputs = rows * model.hidden * c
    return {"forward": outputs,
            "backward": outputs + rows * model.experts * cap * 4.0}


def gather_kind(cfg):
    """The ring a DTensor 2.21 all-gather runs as: "all-reduce" (of
    zero-padded blocks: 2(n-1)/n of the message per device, DTensor's
    lowering on CPU and GPU), or "all-gather" ((n-1)/n) when tfpar
    compiles real gathers — fsdp on a mesh with one axis of size > 1
    (`ParallelDims.real_all_gathers`, `_compat.collective_all_gathers`).
    Applies to tfpar's own gathers (the expert exchanges, the context
    keys' and values'); the data and model axes' terms model the runs
    they were fitted to."""
    split = sum(n > 1 for n in (cfg.data, cfg.pipe, cfg.model,
                                cfg.expert_axis_size, cfg.context))
    return "all-gather" if cfg.fsdp and split == 1 else "all-reduce"


def context_gather_bytes(model, cfg):
    """Bytes of one block's key/value all-gathers over the context axis per
    device: the gathered keys and values, b·s·2·kv·dₕ/t elements, for
    each of its attentions."""
    if cfg.context == 1:
        return 0.0
    kv = (model.kv_heads or model.heads) * model.head_dim
    return (cfg.microbatch * model.seq * 2 * kv / cfg.model
            * model.compute_bytes * model.attentions)


def all_to_all(nbytes, n, alpha_beta):
    """Seconds of an all-to-all over n devices, each sending `nbytes` in
    all ((n-1)/n of it leaves the device, in n-1 steps)."""
    if n <= 1:
        return 0.0
    alpha, beta = alpha_beta
    return (n - 1) * alpha + (n - 1) / n * nbytes / beta


def _exchanges(model, cfg, cluster, hw):
    """(expert forward, expert backward, context) seconds of one block:
    the exchanges over the expert group (`expert_exchange_bytes`: on the
    data axis, whose members are t·p·c apart (t·c with the pipe axis
    outermost), or on a separate expert axis inside it: model innermost,
    then expert, then context) and the keys' and values' all-gather over
    c (its backward reduce-scatter costs the same). tfpar's gathers run as
    `gather_kind(cfg)`'s ring."""
    t, e, c = cfg.model, cfg.expert, cfg.context
    sizes = expert_exchange_bytes(model, cfg)
    gather = gather_kind(cfg)
    if cfg.expert_on_data:
        group = link(cluster, hw, e, cfg.data_stride * c)
        forward = backward = 2 * ring(gather, sizes["forward"] / 2, e, group)
    else:
        group = link(cluster, hw, e, t)
        outputs = sizes["forward"]
        forward = ring("all-reduce", outputs, e, group)
        backward = (ring("all-reduce", outputs, e, group)
                    + ring(gather, sizes["backward"] - outputs, e, group))
    context = ring(gather, context_gather_bytes(model, cfg), c,
                   link(cluster, hw, c, t * cfg.expert_axis_size))
    return forward, backward, context


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
    expert, expert_back, context = parts["exchanges"]
    work.add(blocks * (expert + expert_back), "expert")
    work.add(blocks * 2 * context, "context")
    model_axis = blocks * 2 * tp_block
    if cfg.tp_overlap:  # only what exceeds the block's GEMMs shows
        gemms = (parts["forward"].parts["compute"]
                 + parts["backward"].parts["compute"])
        model_axis = blocks * max(0.0, 2 * tp_block - gemms)
    for flag, name, edge in ((first, "embedding", tp_edge[0]),
                             (last, "logits", tp_edge[1])):
        if flag:
            work.merge(parts[name + "_forward"])
            work.merge(parts[name + "_backward"])
            model_axis += edge
    recompute = _Time()
    if cfg.recompute == "full":
        recompute = parts["forward"].scaled(blocks)
        recompute.add(blocks * (tp_block + expert + context), "model")
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
    nbytes = hidden_bytes(model, cfg)
    sends = 2 * cfg.virtual_stages - (stage == 0) - (stage == p - 1)
    if p * cfg.pipe_stride <= cluster.devices_per_host:
        alpha, beta = hw.intra_latency, hw.intra_bandwidth * hw.network_intra
        gather = 0.0
    else:
        alpha, beta = hw.inter_latency, hw.inter_bandwidth * hw.network_inter
        if p * cfg.pipe_stride > cluster.devices_per_slice:
            # Stages in other slices: the sends at a slice boundary take
            # the data-center network, and the stages between wait for
            # them, so every send is costed at its rate.
            alpha = cluster.slice_latency
            beta = cluster.slice_bandwidth * hw.network_inter
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
                                                dev.hw),
            "exchanges": _exchanges(model, cfg, cluster, dev.hw)}


def stage_params(model, blocks, first, last):
    """Parameters of a stage (whole, before the model axis splits them)."""
    params = blocks * model.block_params()
    if first:
        params += model.embedding_params()
    if last:  # the final norm; a tied head is the first stage's table
        params += 2 * model.hidden + model.head_params()
    return params


def _overlapped(comm, compute, share):
    """Exposed seconds of `comm` run under `compute`: what exceeds it, and
    the compute the collective's kernels take from it while they overlap
    (`share`: the fraction of the device's cores they occupy)."""
    hidden = min(comm, compute)
    return comm - hidden + hidden * share


def _data_axis(model, cfg, cluster, hw, params, *, blocks, backward,
               microbatches, whole=0.0):
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
    block; the first gather is one of the stage's `blocks` blocks.

    With expert or context axes the reduction group grows: the weights
    outside the expert banks over data × context (the devices of a separate
    expert axis compute the same gradients), the banks over data × context
    with a separate expert axis and over context alone when the data axis
    splits them; fsdp gathers over data alone. `whole`: parameters of
    `params` not split over the model axis (a replicated head's)."""
    d, share = cfg.data, hw.collective_share
    banks = blocks * model.bank_params()
    reduce, gathers, first_gather = 0.0, 0.0, 0.0
    for weights, n, split, units, unsplit in (
            (params - banks, cfg.replicas, 1,
             max(1, round(params / model.block_params())), whole),
            (banks, cfg.context if cfg.expert_on_data else d * cfg.context,
             cfg.expert, max(1, blocks), 0.0)):
        if weights <= 0 or n == 1:
            continue
        ab = _reduction_link(cluster, hw, cfg, n)
        nbytes = ((weights - unsplit) / cfg.model / split
                  + unsplit) * model.compute_bytes
        if not cfg.fsdp:
            reduce += ring("all-reduce", nbytes, n, ab, units)
            continue
        ab_data = _reduction_link(cluster, hw, cfg, d)
        gathers += (2 * ring("all-gather", nbytes, d, ab_data, units)
                    + ring("reduce-scatter", nbytes, n, ab, units))
        first_gather += ring("all-gather", nbytes / max(1, blocks), d,
                             ab_data)
    if not cfg.fsdp:
        return _overlapped(reduce, backward if cfg.grad_overlap else 0.0,
                           share)
    return microbatches * (first_gather + _overlapped(
        gathers, 1.5 * backward, share))


def _reduction_link(cluster, hw, cfg, n):
    """The link of a gradient reduction over n devices: the data axis
    (outermost: its members t·p apart), or, with expert or context axes,
    a group whose first members are t apart (an approximation: the
    expert and context coordinates are neighbours, the data ones far)."""
    if n == cfg.data or cfg.context == 1:
        return link(cluster, hw, n, cfg.data_stride)
    return link(cluster, hw, n, cfg.model)


def step_time(model, cfg, hw, global_batch, network=None):
    """{part: seconds} of one training step on the slowest stage (their sum
    under "total"), and "executed_flops" per device (recomputation
    included). `network`: the cluster's hosts and slices (a `Cluster` or
    a `Network`; default one slice of `hw`'s hosts)."""
    cluster = network or Network(hw.devices_per_host)
    dev = _Device(hw, model.compute_bytes, cfg.tf32)
    parts = _parts(dev, model, cfg, cluster)
    m = microbatches(cfg, global_batch)
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
        data = _data_axis(model, cfg, cluster, hw,
                          summed_params(model, cfg, params, first),
                          blocks=blocks,
                          backward=backward, microbatches=m,
                          whole=replicated_head_params(model, cfg, last))
        local = _local_params(model, cfg, params, blocks, last) / (
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


def summed_params(model, cfg, params, first):
    """The parameters of a stage holding `params` whose gradients the data
    axis sums: `params`, and under tfpar a vocabulary-split tied table
    (`Parallel.table_gradient_gemm`) once more on the `first` stage: its
    lookup's gradient (the one-hot GEMM) and its projection's are each
    summed where DTensor makes them."""
    return params + (model.vocab * model.hidden
                     if cfg.table_gradient_gemm and first else 0.0)


def microbatches(cfg, global_batch):
    """m, micro-batches per step: the batch is split over data (a
    separate expert axis holds the same samples), each replica's share
    into m of b."""
    return global_batch // (cfg.data * cfg.microbatch)


def _local_params(model, cfg, params, blocks, last=False):
    """A stage's parameters on one device: split over model (but a
    replicated head's, on the `last` stage), its expert banks also over
    expert."""
    banks = blocks * model.bank_params()
    whole = replicated_head_params(model, cfg, last)
    return (params - banks - whole + banks / cfg.expert) / cfg.model + whole


def replicated_head_params(model, cfg, last=True):
    """Parameters of a Dense head kept whole on every device of the model
    axis (`Parallel.head` "replicated"; 0 otherwise or off the last
    stage)."""
    if not last or cfg.head != "replicated" or cfg.model == 1 or model.tied:
        return 0.0
    return float(model.vocab * model.hidden)


@dataclasses.dataclass(frozen=True)
class Network:
    """What `link` reads of a cluster (a `Cluster` has the same
    attributes): devices per host and per slice, and the data-center
    network's bandwidth per device and latency between slices."""

    devices_per_host: int
    devices_per_slice: float = math.inf
    slice_bandwidth: float = 0.0
    slice_latency: float = 0.0


def memory(model, cfg, global_batch):
    """{kind: bytes} per device of the first stage (the most activations
    in flight): params, gradients, optimizer, activations, workspace."""
    p, t, d, v = cfg.pipe, cfg.model, cfg.data, cfg.virtual_stages
    blocks = _stage_blocks(model.layers, p)[0]
    params = _local_params(model, cfg, stage_params(model, blocks, True,
                                                    p == 1), blocks, p == 1)
    trainable_split = d if cfg.fsdp else 1
    m = microbatches(cfg, global_batch)
    sbh = hidden_bytes(model, cfg) / 2
    # Korthikanti's bytes per s·b·h (2-byte activations; `sbh` scales them
    # to the compute dtype) of one block: what it stores without
    # recomputation (the scores dropped by a fused kernel), what a full
    # recomputation rebuilds one block at a time (the workspace).
    scores = 0.0 if cfg.flash else (
        5.0 * model.heads * model.seq / model.hidden / t)
    # what tensor parallelism alone leaves whole (norms' inputs, dropout
    # masks) sequence parallelism splits over t
    whole = 1.0 / t if cfg.sequence_parallel else 1.0
    # Per attention: its norm's input, the query's input and the output's
    # dropout mask (5), Q, K, V and the output projection's input (8/t at
    # width h, × q/h), the scores; the MLP: its norm's input, its input
    # and the dropout mask (5), GeLU's input and output (16/t, 4h wide;
    # × `_mlp_width`). One attention: 10 + 24/t (34/t), Korthikanti's.
    attention = 5.0 * whole + 8.0 / t * model.attention_width / model.hidden
    mlp = 5.0 * whole + 16.0 / t * _mlp_width(model)
    whole_block = (model.attentions * (attention + scores) + mlp
                   + _moe_and_context_activations(model, cfg))
    per_block = {None: whole_block,
                 "selective": whole_block - model.attentions * scores,
                 "full": 2.0 * (model.kept_hidden + model.kept_wide / t)
                 }[cfg.recompute]
    in_flight = m if cfg.schedule == "gpipe" else min(m, p)
    if v > 1:
        in_flight *= 1 + (p - 1) / (p * v)
    activations = per_block * sbh * blocks * in_flight
    if p == 1:
        # The first stage is the last: the final norm's input and the
        # output layer's input are kept too, 2 + 2 (÷ t under sequence
        # parallelism), Korthikanti et al. 2022, section 4.3.
        activations += (4.0 / t if cfg.sequence_parallel else 4.0) * sbh
    workspace = whole_block * sbh if cfg.recompute == "full" else 0.0
    if p == 1 and cfg.logits:  # the logits and their gradient, fp32
        # (whole unless split over the vocabulary)
        workspace += 8.0 * tokens(model, cfg) * model.vocab / (
            t if cfg.vocab_parallel else 1)
    if cfg.table_gradient_gemm:  # the one-hot ids of the table's gradient
        workspace += tokens(model, cfg) * model.vocab / t * model.compute_bytes
    # ZeRO-1 (Megatron's distributed optimizer): the fp32 master weights
    # and the slots sharded over data, the half-precision copy whole.
    master = max(0.0, model.param_bytes - model.compute_bytes)
    param_bytes = (min(model.compute_bytes, model.param_bytes) + master / d
                   if cfg.zero1 else model.param_bytes)
    optimizer_split = d if cfg.zero1 else trainable_split
    trained = params * model.trainable_share
    return {"params": params * param_bytes / trainable_split,
            "gradients": trained * 4 / trainable_split,
            "optimizer": trained * 4 * cfg.optimizer_slots / optimizer_split,
            "activations": activations, "workspace": workspace}


def _mlp_width(model):
    """The MLP's stored activations against Korthikanti's (f = 4h, GeLU:
    its input and output, two f-wide tensors): × f/(4h), and × 1.5 gated
    (the gate's and the up projection's outputs, which Megatron-LM's fused
    SwiGLU keeps, and their product, the down projection's input)."""
    return model.ffn_width / (4.0 * model.hidden) * (
        1.0 + 0.5 * model.gated)


def _moe_and_context_activations(model, cfg):
    """Extra bytes per (T·h at 2 bytes) of one block: the MLP's stored
    activations (Korthikanti's 2 + 16/t for f = 4h, scaled by f and
    gating) taken r = E·C/T times over by the routed copies of the
    tokens, and the keys and values gathered over the context axis
    (2·kv·dₕ·s·b elements against T·h)."""
    t, extra = cfg.model, 0.0
    if model.experts:
        slots = model.experts * capacity(model, cfg) / (
            1 if cfg.expert_on_data else cfg.expert)
        routed = slots / tokens(model, cfg)
        extra += (routed - 1) * (2.0 + 16.0 / t * _mlp_width(model))
    if cfg.context > 1:
        kv = (model.kv_heads or model.heads) * model.head_dim
        extra += (4.0 * kv * cfg.context / (model.hidden * t)
                  * model.attentions)
    return extra


def _expert_bytes_per_block(model, cfg):
    """One micro-batch's expert-group bytes of a block: forward and
    backward, and the forward again under full recomputation."""
    sizes = expert_exchange_bytes(model, cfg)
    again = sizes["forward"] if cfg.recompute == "full" else 0.0
    return sizes["forward"] + sizes["backward"] + again


def communication_bytes(model, cfg, global_batch):
    """{axis: bytes} each device of the first stage sends or receives in
    collectives per step (message sizes, as `communication_report`
    counts them)."""
    m = microbatches(cfg, global_batch)
    blocks = _stage_blocks(model.layers, cfg.pipe)[0]
    activation = hidden_bytes(model, cfg)
    full = cfg.recompute == "full"
    # one all-reduce per residual branch, forward, backward and (full
    # recomputation) forward again
    passes = model.branches * (2 + full)
    params = _local_params(model, cfg, summed_params(model, cfg, stage_params(
        model, blocks, True, cfg.pipe == 1), True), blocks, cfg.pipe == 1)
    grads = params * model.compute_bytes
    data = (3 * m * grads if cfg.fsdp else grads) if cfg.replicas > 1 else 0.0
    return {"model": _model_axis_bytes(model, cfg, blocks * passes, m)
            if cfg.model > 1 else 0.0,
            "data": float(data),
            # dispatch and combine, forward and backward (and again when
            # a full recomputation reruns the forward pass)
            "expert": blocks * m * _expert_bytes_per_block(model, cfg),
            # the keys' and values' gather forward, their gradients'
            # reduce-scatter backward
            "context": blocks * (2 + full) * context_gather_bytes(model, cfg)
            * m,
            # first stage: v chunks send forward and receive gradients,
            # v - 1 receive activations and send gradients.
            "pipe": (4.0 * cfg.virtual_stages - 2) * activation * m
            if cfg.pipe > 1 else 0.0}


def _model_axis_bytes(model, cfg, collectives, m):
    """The model axis' message bytes of the first stage per step: its
    blocks' `collectives` T·h all-reduces and the embedding's per
    micro-batch, and when it holds a head split over the hidden dimension
    its partial logits'."""
    activation = hidden_bytes(model, cfg)
    nbytes = (collectives + 1) * activation * m
    if cfg.pipe == 1 and cfg.head == "hidden":
        nbytes += logits_bytes(model, cfg) * m
    return nbytes
