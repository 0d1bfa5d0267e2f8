"""The cost model: memory by kind, communication and step time of a plan.

Inputs: a `ModelProfile` (per-layer weights, FLOPs and activations per
sample, see `profile.py`), the tensor-parallel rules for a model axis of
size t (`auto_rules`' plan, read through `tfpar.layout`'s specs), a
candidate's choices and a `Cluster`.

Communication — the collectives each layout implies, with the message
sizes `tfpar.communication_report` reads from a compiled step (`bytes`,
per device):

- data axis d: one all-reduce of each trainable weight's gradient (its
  per-device block, in the compute dtype); with fsdp one all-gather of
  each weight block per forward pass (per micro-batch in a pipeline, again
  in the backward pass of a recomputed layer) and one reduce-scatter of
  its gradient. A looked-up table's sparse gradient is reduced once per
  sum the optimizer's update makes of it (`optimizers.sparse_gradient_
  sums`: Adam sums g and g² apart).
- model axis t (Megatron): a column-parallel layer all-reduces its input
  gradient in the backward pass (unless nothing before it needs
  gradients); a row-parallel layer all-reduces its output in the forward
  pass; attention split by heads does both; a hidden-split embedding
  gathers its output. Each message is the (batch/d, tokens, width)
  activation.
- pipe axis p: each stage sends the tensors a cut carries to the next
  stage per micro-batch, and their gradients back.

On a preset cluster (`Cluster.preset`, which carries vendor figures and
efficiencies) a transformer's step time is the per-op roofline of
`roofline.py` (the one `tfpar.estimate` uses) instead of what follows;
memory and message bytes stay this module's. The output head is costed as
the rules lay it out: split over the vocabulary under `VocabParallel`
(`Layout.vocab_parallel`), else whole (`roofline.head_layout`; here, its
weights' specs). A model has one iff `transformer.vocab_head` finds it
(the rule `tfpar.estimate` asks too); what its weights do not show is
added with the roofline's formulas (`Layout._add_head`): a tied reverse
projection's FLOPs, a hidden-split head's partial logits' all-reduce
(T·V), and a vocabulary-split tied table's gradient GEMM (one-hot ids ×
the output's gradient: 2·T·V/t·h, `vocab_parallel.lookup`; its lookup's
all-reduce of T·h comes with its rule).

Time (α-β): an all-reduce of B bytes over n devices costs
2(n-1)·α + 2(n-1)/n · B/β (a ring), an all-gather or reduce-scatter half
of that; α and β are the cluster's intra- or inter-host figures,
depending on whether the axis' groups span hosts (axes are laid out
data, pipe, model: model groups are neighbours). The data axis'
gradient reduction overlaps the backward pass (only what exceeds the
backward compute shows, as in DDP's and Megatron-LM's bucketed
reduction). Compute costs
(3 + recompute) × forward FLOPs / device FLOP/s (backward = 2 × forward;
recompute 1 for full recomputation), with the split part of each layer
divided by t; selective recomputation adds the attention cores' forward
FLOPs once more (4·s·width per token per attention layer: QKᵀ and
attention over V) and no collective (the core has none). A pipeline takes
(m + p - 1)/m × the slowest stage (the bubble (p-1)/(m+p-1) is the same
for GPipe and 1F1B); nothing overlaps communication with compute.

A shared host (`Cluster.shared_host`: virtual CPUs, every device's work on
the same cores and memory) runs nothing side by side: the step is every
stage's compute, collectives and optimizer update added up (each measured
at the rate of all devices at once, so a stage's share is 1/p of its
devices' time: the mean over stages) plus each stage-to-stage send, with
no bubble and no overlap; a collective over n devices of B bytes per
device costs α + n · B/β (each device reads every block of its group
through host memory: measured, see `calibrate.py`); the update costs
trainable bytes · (1 + slots)/3 / `update_bandwidth` (Adam's measured
rate; 0 for described clusters, which keep their plans).

The runtime's fixed costs on a calibrated shared host (`Cluster.op_time`
> 0, what `Cluster.local()` measures on virtual CPUs; 0 for described
clusters): every op of the SPMD step runs once per device of its mesh, so
a stage costs (its ops) × (d · t) × `op_time` — its ops counted per
micro-batch (each layer's forward and backward, the stage's bookkeeping,
its cuts' moves, the loss on the last stage) times m, plus the update's
per trainable weight (`_fixed_time`); each stage-to-stage move costs the
measured `send_time` per device of the stage instead of a collective's α;
and the data axis' gradient all-reduces count one per layer (DTensor
combines those of gradients ready together). Measured on this machine (a
tiny 33-layer Dense stack, 12 layouts): the old model ranked them with
rho 0.41, this one 0.99. A layer's ops are counted by kind
(`profile.layer_ops`: attention, norms, Dropout, some activations run many
more than a Dense).
Convolutions, when the cluster measures them (`conv_flops`, `conv_time`):
their FLOPs at the convolution's own rate, and each conv layer's forward
and backward pass costs `conv_time` on every device of its mesh per
micro-batch (in the fixed cost).

Memory per device (the most loaded stage), by kind: params (stored
blocks), gradients (same blocks), optimizer (slots × trainable blocks),
activations (kept for the backward pass: per micro-batch of b/(d·m)
samples, times the micro-batches in flight: m for GPipe, p - s on stage s
for 1F1B; with full recomputation only each layer's inputs; with selective
recomputation all but the attention cores' scores and probabilities
(2·heads·s² per sample per attention layer, Korthikanti et al.'s 5·a·s²·b
in fp16 with the dropout mask); with sequence
parallelism every kept activation 1/t as large, plus the gathered inputs of
column-parallel layers when not recomputing) and workspace (transient:
fsdp's gathered weights — every weight of the stage whole for the step, or
two layers' worth with full recomputation — and the internals of the one
layer, or attention core, being recomputed, for one micro-batch).
"""

import collections.abc
import dataclasses
import math
import re

import keras
import numpy as np
import tensorflow as tf

from tfpar import layout as layout_lib
from tfpar import styles as tp
from tfpar import vocab_parallel
from tfpar.planner import profile as profile_lib
from tfpar.planner import roofline
from tfpar.planner import transformer as transformer_lib

KINDS = ("params", "gradients", "optimizer", "activations", "workspace")


class ByStage(collections.abc.Sequence):
    """`Estimate.memory_by_stage` as a search holds it: reads as a list of
    {kind: bytes} per pipeline stage, each made when read from
    {kind: per-stage array} (a plan's search holds thousands of estimates
    of up to hundreds of stages: with a dict per stage a trillion-parameter
    GPT's plan grew the process by 0.72 GB, with these by 0.25 GB).

    >>> ByStage({"params": [1.0, 2.0]})[1]
    {'params': 2.0}
    """

    def __init__(self, arrays):
        self._arrays = {k: np.array(v, float) for k, v in arrays.items()}

    def __len__(self):
        return len(next(iter(self._arrays.values())))

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        return {k: float(a[index]) for k, a in self._arrays.items()}

    def __eq__(self, other):
        return list(self) == list(other)

    def __repr__(self):
        return repr(list(self))


@dataclasses.dataclass
class Estimate:
    """Predicted cost of one plan (per device, per training step).

    Attributes:
        step_time_s: seconds per step.
        memory_per_device: {kind: bytes} for params, gradients, optimizer,
            activations, workspace (the most loaded stage).
        communication_bytes_per_device: sum of collective message sizes a
            device takes part in per step (`CommunicationReport.bytes`).
        communication_bytes_by_axis: the same per mesh axis.
        time_s: {compute, bubble, model, data, pipe, update} parts of the
            step time, and on a calibrated shared host `fixed` (the
            runtime's cost per op and device) and `accumulate` (adding
            each micro-batch's gradients).
        memory_by_stage: [{kind: bytes}] per pipeline stage (the devices of
            stage s), of which `memory_per_device` is the most loaded.
        executed_flops: FLOPs a device executes per step, recomputation
            included (`tfpar.estimate`'s roofline; 0: not counted).
        split_axes: for a candidate with an expert or context axis
            (`split_axes.py`), {"expert" or "context": facts}: the axis'
            size, its exchange (or gather) bytes per step and device, the
            bank (or activation) bytes per device with and without it.
    """

    step_time_s: float
    memory_per_device: dict
    communication_bytes_per_device: float
    communication_bytes_by_axis: dict
    time_s: dict
    memory_by_stage: list = None
    executed_flops: float = 0.0
    split_axes: dict = None

    @property
    def breakdown(self):
        """{part: seconds} of the step time (`time_s`)."""
        return self.time_s

    @property
    def total_memory(self):
        return sum(self.memory_per_device.values())

    def to_dict(self):
        out = dataclasses.asdict(dataclasses.replace(
            self, memory_by_stage=None))
        if self.memory_by_stage is not None:
            out["memory_by_stage"] = list(self.memory_by_stage)
        return out

    @classmethod
    def from_dict(cls, d):
        return cls(**d)


class _Sizes:
    """Stands in for a tfpar.Mesh where only axis sizes matter."""

    def __init__(self, **sizes):
        self.shape = sizes

    def axis_size(self, name):
        return self.shape.get(name, 1)


class _LayerShape:
    """What a style reads of a layer (no hooks are installed on the
    user's model while planning)."""

    def __init__(self, layer):
        self.path = getattr(layer, "path", "")
        self.equation = getattr(layer, "equation", None)
        self.bias_axes = getattr(layer, "bias_axes", None)

    def call(self, *args, **kwargs):  # what a style's hook would wrap
        return None


class Layout:
    """Per-layer costs of `profile` under tensor parallelism of size t.

    `rules` are auto_rules' LayoutRules for t (None: t = 1), made with
    `vocab_parallel` (the head split over the vocabulary, or whole: what
    the roofline costs, `roofline.head_layout`); the profile's
    `Weight.reads` tells which column-parallel layers share one backward
    all-reduce.
    Arrays hold one entry per op of the profile (a layer PipelineModel can
    cut before), per sample where sizes scale with the batch.
    """

    def __init__(self, profile, rules, t, sequence_parallel=False,
                 vocab_parallel=False, table_sums=1):
        self.t = t
        self.rules = rules
        self.table_sums = table_sums
        self.sequence_parallel = sequence_parallel
        self.vocab_parallel = vocab_parallel
        self._profile = profile
        # The model's transformer dimensions (None: no attention), for the
        # roofline of a preset cluster (`_roofline_time`).
        self.transformer = transformer_lib.read(profile)
        n = len(profile.ops)
        self.flops_split, self.flops_repl = np.zeros(n), np.zeros(n)
        # Convolutions' part of them, and per op its convolution kernels and
        # the ops its layers run beyond 4 per weight (`profile.layer_ops`).
        self.conv_split, self.conv_repl = np.zeros(n), np.zeros(n)
        self.convs = np.array([sum(w.conv for w in op.weights)
                               for op in profile.ops], float)
        self.layer_ops = np.array([op.layer_ops for op in profile.ops], float)
        self.kept, self.internal = np.zeros(n), np.zeros(n)
        self.kept_full, self.recomputed = np.zeros(n), np.zeros(n)
        # The attention core's part of `internal` (scores and softmax, per
        # device) and its forward FLOPs per device: what selective
        # recomputation drops and runs again.
        self.attention_internal = np.zeros(n)
        self.attention_flops = np.zeros(n)
        self.tp_bytes_fwd, self.tp_bytes_bwd = np.zeros(n), np.zeros(n)
        self.tp_count_fwd, self.tp_count_bwd = np.zeros(n), np.zeros(n)
        # Under sequence parallelism: each hidden-split embedding's output
        # re-split along the sequence, an all-gather of its whole output
        # (DTensor's all-to-all is off: tfpar/__init__.py).
        self.resplit_bytes, self.resplit_count = np.zeros(n), np.zeros(n)
        self.carried = np.array([op.carried_in for op in profile.ops])
        self.split_out = np.zeros(n)  # 1: the op's output split over model
        params = [w.itemsize for op in profile.ops for w in op.weights
                  if w.trainable] or [profile.compute_itemsize]
        self.grad_ratio = profile.compute_itemsize / max(params)
        self._weights = []  # per op: [(tp block shape, spec, itemsize, trainable)]
        fresh, exact = _rule_lookup(rules)
        self._add_head(profile, vocab_parallel)
        split_layers = _model_axis_collectives(profile, rules)
        # Sequence parallelism splits the tokens of every activation from the
        # first SequenceParallel norm to the last (the transformer stack;
        # embeddings before it and the head after it stay whole).
        norms = split_layers.get("sequence_split", []) if sequence_parallel else []
        sequence_lo, sequence_hi = (min(norms), max(norms)) if norms else (n, -1)
        for i, op in enumerate(profile.ops):
            self._weights.append(self._add_compute(i, op, fresh, exact))
            out = op.outputs
            if id(op.layer) in split_layers.get("column_out", set()) or (
                    sequence_lo <= i <= sequence_hi):
                out /= t  # split by features, or (sequence parallel) by tokens
                self.split_out[i] = float(t > 1)
            self._add_kept(i, out, profile.ops)
            self._add_collectives(i, op, split_layers.get(i, []),
                                  profile.compute_itemsize)
        self.sparse_gradient = _looked_up_tables(profile, self._weights)
        self._state_cache = {}

    def _add_kept(self, i, out, ops):
        """Op i's output bytes kept for the backward pass (`out`), also
        under full recomputation: kept unless read only inside its block
        (`Op.in_block`); recomputing a block holds its outputs and
        internals at once (summed up to the block's last op)."""
        self.kept[i] = out
        self.kept_full[i] = 0.0 if ops[i].in_block else out
        before = self.recomputed[i - 1] if i and ops[i - 1].in_block else 0.0
        self.recomputed[i] = (self.internal[i] + before
                              + (out if ops[i].in_block else 0.0))

    def _add_head(self, profile, vocab_parallel):
        """The vocabulary head's terms the profile does not hold, by the
        roofline's formulas (`cfg`: a micro-batch of one sample): a tied
        reverse projection's FLOPs (T × V × h, on the op making the
        logits), a hidden-split head's partial logits' all-reduce (T·V),
        a vocabulary-split reverse projection's input gradient's (T·h)
        and a vocabulary-split tied table's gradient, a GEMM of one-hot
        ids and the lookup's output gradient (T × V/t × h per device,
        backward only: a third of a forward op's three passes;
        `vocab_parallel.lookup`), which DTensor sums over the data axis
        apart from the projection's part (`table_gradient`: V/t × h once
        more; measured on keras-hub Gemma)."""
        self.table_gradient = np.zeros(len(profile.ops))
        model = self.transformer
        head, cfg = _vocab_head(profile, model, self.t, vocab_parallel)
        if head is None:
            return
        whole = roofline.logits_flops(model, cfg) * cfg.model
        if head.tied:  # split over t both ways (V/t or h/t per device)
            (self.flops_split if self.t > 1 else self.flops_repl)[
                head.logits_op] += whole
            if cfg.head == "vocab" and self.t > 1:
                self.flops_split[head.table_op] += whole / 3
                # the token table: its op's largest weight
                table = max(profile.ops[head.table_op].weights,
                            key=lambda w: math.prod(w.shape))
                self.table_gradient[head.table_op] = (
                    math.prod(table.shape) / self.t * table.itemsize)
        if cfg.head == "hidden":
            self.tp_bytes_fwd[head.logits_op] += roofline.logits_bytes(
                model, cfg)
            self.tp_count_fwd[head.logits_op] += 1
        if cfg.head == "vocab" and head.embedding and self.t > 1:
            # the reverse projection's input gradient (T·h, partial over
            # the vocabulary split): a Dense head's comes with its rule
            self.tp_bytes_bwd[head.logits_op] += roofline.hidden_bytes(
                model, cfg)
            self.tp_count_bwd[head.logits_op] += 1

    def _add_compute(self, i, op, fresh, exact):
        """FLOPs split over the model axis or not, and the internals kept,
        of op i; returns its weights' (block, spec, itemsize, trainable)."""
        t, blocks = self.t, []
        internal = op.internal - op.attention_internal
        attention_split = False
        for w in op.weights:
            spec = _spec(fresh, exact, w) or (None,) * len(w.shape)
            block = layout_lib.shard_shape(w.shape, spec, _Sizes(model=t))
            blocks.append((block, spec, w.itemsize, w.trainable))
            if "model" in spec and t > 1:
                self.flops_split[i] += w.flops
                self.conv_split[i] += w.flops * w.conv
                # split: the input's part of what it keeps if the split
                # dimension is contracted (row-parallel), else the output's
                side = (w.activation_in if any(
                    c for c, axis in zip(w.contracted, spec)
                    if axis == "model") else w.activation - w.activation_in)
                internal -= side * (1 - 1 / t)
                attention_split = True
            else:
                self.flops_repl[i] += w.flops
                self.conv_repl[i] += w.flops * w.conv
        att = op.attention_flops
        share = 1.0
        if attention_split and att:
            self.flops_split[i] += att
            internal -= op.attention_internal * (1 - 1 / t)
            share = 1 / t
        else:
            self.flops_repl[i] += att
        self.internal[i] = internal + op.attention_internal
        self.attention_internal[i] = op.attention_internal * share
        self.attention_flops[i] = att * share
        return blocks

    def _add_collectives(self, i, op, entries, itemsize):
        """The model-axis message bytes and counts of op i, per sample."""
        for kind, phase, nbytes, top in entries:
            if phase == "backward" and top and not op.needs_input_grad:
                continue  # nothing before this layer needs gradients
            if kind == "resplit":
                self.resplit_bytes[i] += nbytes * itemsize
                self.resplit_count[i] += 1
            elif phase == "forward":
                self.tp_bytes_fwd[i] += nbytes * itemsize
                self.tp_count_fwd[i] += 1
            else:
                self.tp_bytes_bwd[i] += nbytes * itemsize
                self.tp_count_bwd[i] += 1

    def whole_head(self):
        """This layout with the output head kept whole, as
        `auto_rules(vocab_parallel=False)` plans it (`_whole_head_rules`),
        made once; itself when its head is not vocabulary-parallel."""
        if not self.vocab_parallel:
            return self
        if "whole_head" not in self._state_cache:
            self._state_cache["whole_head"] = Layout(
                self._profile, _whole_head_rules(self._profile, self.rules),
                self.t, self.sequence_parallel, table_sums=self.table_sums)
        return self._state_cache["whole_head"]

    def prefix(self, d, fsdp):
        """{array name: its prefix sums}, per-op arrays and state bytes."""
        key = ("prefix", d, fsdp)
        if key not in self._state_cache:
            state = self.state_bytes(d, fsdp)
            arrays = {name: getattr(self, name) for name in (
                "flops_split", "flops_repl", "conv_split", "conv_repl",
                "convs", "layer_ops", "tp_bytes_fwd", "tp_bytes_bwd",
                "tp_count_fwd", "tp_count_bwd", "resplit_bytes",
                "resplit_count", "kept", "kept_full", "internal",
                "attention_internal",
                "attention_flops", "table_gradient", "sparse_gradient")}
            arrays.update(stored=state[:, 0], trainable=state[:, 1],
                          gathered=state[:, 2], count=state[:, 3],
                          weighted=(state[:, 3] > 0).astype(float))
            self._state_cache[key] = {
                name: np.concatenate([[0.0], np.cumsum(v)])
                for name, v in arrays.items()}
        return self._state_cache[key]

    def stage_max(self, name, d, fsdp, lo, hi):
        """Per stage, the largest single op's value of `name`."""
        values = (self.state_bytes(d, fsdp)[:, 2] if name == "gathered"
                  else getattr(self, name))
        return np.maximum.reduceat(values, lo)  # over [lo[k], lo[k+1])

    def state_bytes(self, d, fsdp):
        """Per op: (stored bytes of all weights, of trainable weights,
        gathered (tp-block) bytes of trainable weights, number of
        trainable weights) with a data axis of size d."""
        key = (d, fsdp)
        if key not in self._state_cache:
            # Each distinct (block, spec, itemsize, trainable) once (a
            # transformer's blocks repeat a few kinds), then counts · bytes.
            kinds, counts = self._weight_kinds()
            sizes = _Sizes(model=self.t, data=d)
            rows = np.zeros((len(kinds), 4))
            for k, (block, spec, itemsize, is_trainable) in enumerate(kinds):
                whole = float(math.prod(block)) * itemsize
                part = whole
                if fsdp and is_trainable and d > 1:
                    fs = layout_lib.fully_sharded_spec(
                        spec, tuple(block_shape_full(block, spec, self.t)),
                        "data", sizes)
                    if "data" in fs:
                        part = whole / d
                rows[k] = (part, part * is_trainable, whole * is_trainable,
                           float(is_trainable))
            self._state_cache[key] = counts @ rows
        return self._state_cache[key]

    def _weight_kinds(self):
        """(distinct weight kinds, {op: count of each kind} as an array)."""
        if "kinds" not in self._state_cache:
            index = {}
            for blocks in self._weights:
                for kind in blocks:
                    index.setdefault(kind, len(index))
            counts = np.zeros((len(self._weights), len(index)))
            for i, blocks in enumerate(self._weights):
                for kind in blocks:
                    counts[i, index[kind]] += 1
            self._state_cache["kinds"] = (list(index), counts)
        return self._state_cache["kinds"]


def _vocab_head(profile, model, t, vocab_parallel):
    """(`transformer.vocab_head` of `profile`, the `roofline.Parallel` of
    its head over t for one sample), or (None, None) for a model without
    attention (`model` None) or without a vocabulary head."""
    head = (transformer_lib.vocab_head(profile, model.hidden)
            if model is not None else None)
    if head is None:
        return None, None
    return head, roofline.Parallel(model=t, **roofline.head_layout(
        model, t, vocab_parallel))


def _whole_head_rules(profile, rules):
    """`rules` (auto_rules' with vocab_parallel=True) as auto_rules plans
    them without it: a `VocabParallel` embedding split by hidden
    (`ColumnParallel`), a `VocabParallel` Dense head and the logits' bias
    of a head holding its token embedding
    (`vocab_parallel.reverse_head_biases`) left whole."""
    whole = {}
    for pattern, style in rules.items():
        path = _unescaped(pattern)
        if not layout_lib.is_style(style) and "/" in path:
            head = profile.layers_by_path.get(path.rsplit("/", 1)[0])
            if head is not None and vocab_parallel.reverse_head_biases(head):
                continue  # a MaskedLMHead's logits bias: whole
        if isinstance(style, tp.VocabParallel):
            layer = layer_for(profile, pattern)
            if getattr(layer, "embeddings", None) is None:
                continue
            style = tp.ColumnParallel(style.axis)
        whole[pattern] = style
    return layout_lib.LayoutRules(whole)


def _spec(rules, exact, weight):
    """The spec `rules` give `weight` (None: replicated)."""
    if rules is None:
        return None
    if exact is None:
        return rules.spec_for(weight.path, weight.shape,
                              layer=_LayerShape(weight.owner))
    # A raw spec over the model axis (auto_rules': a MaskedLMHead's logits
    # bias; expert banks, over the expert axis, are costed by split_axes).
    raw = exact.get(weight.path)
    if (raw is not None and not layout_lib.is_style(raw)
            and set(raw) <= {None, "model"}):
        return tuple(raw)
    parts = weight.path.split("/")
    for cut in range(len(parts) - 1, 0, -1):
        style = exact.get("/".join(parts[:cut]))
        if style is not None:
            return style.spec_for(_LayerShape(weight.owner),
                                  "/".join(parts[cut:]), weight.shape)
    return None


def _rule_lookup(rules):
    """(`rules` as fresh LayoutRules or None, {layer path: style} when
    every pattern is an escaped layer path — auto_rules' — else None:
    hand-written regexes are matched one by one)."""
    fresh = (layout_lib.LayoutRules(dict(rules.items()))
             if rules is not None else None)
    exact = {_unescaped(p): s for p, s in rules.items()
             if re.escape(_unescaped(p)) == p} if rules else {}
    if fresh is not None and len(exact) < len(fresh):
        exact = None
    return fresh, exact


def _model_axis_collectives(profile, rules):
    """{op index: [(kind, phase, per-sample elements)]} of the model
    axis collectives each style implies, plus helper sets (a lookup of
    a table split by rows, `RowParallel` or a tied `VocabParallel`, an
    all-reduce of its output; one split by hidden, a gather where its
    outputs meet); one backward all-reduce for the column-parallel
    layers of an op reading one tensor (`Weight.reads`: the compiled
    step sums their partial input gradients, dX = Σ dYᵢ·Wᵢᵀ, first)."""
    out = {"column_out": set(), "gathered": set()}
    if rules is None:
        return out
    reduced = set()  # (op, tensor) whose input gradient is all-reduced
    reads = {id(w.owner): w.reads for op in profile.ops for w in op.weights
             if w.reads}
    op_of = _op_of_layers(profile)
    for pattern, style in rules.items():
        layer = layer_for(profile, pattern)
        if layer is None or id(layer) not in op_of:
            continue
        i = op_of[id(layer)]
        tokens = profile.ops[i].tokens
        top = profile.ops[i].layer is layer
        entries = out.setdefault(i, [])
        if isinstance(style, tp.SequenceParallel):
            out.setdefault("sequence_split", []).append(i)
        if isinstance(style, (tp.SequenceParallel, tp.Replicated)):
            continue
        row = isinstance(style, tp.RowParallel) or _splits_rows(style, layer)
        if hasattr(layer, "input_dim") and hasattr(layer, "output_dim"):
            # DTensor gathers hidden-split embeddings once where their
            # outputs meet (e.g. token + position embeddings).
            meet = frozenset(profile.ops[i].consumers) if top else None
            if not row:
                entries.append(("resplit", "forward",
                                tokens * layer.output_dim, top))
            if row or meet is None or meet not in out["gathered"]:
                entries.append(("all-reduce" if row else "all-gather",
                                "forward", tokens * layer.output_dim, top))
                out["gathered"].add(meet)
            continue
        attention = profile_lib.attention_hidden(layer)
        if attention:
            entries.append(("all-reduce", "forward", tokens * attention, top))
            entries.append(("all-reduce", "backward", tokens * attention,
                            top))
            continue
        kernel = getattr(layer, "kernel", None)
        if kernel is None:
            continue
        shape = tuple(kernel.shape)
        if row:
            entries.append(("all-reduce", "forward",
                            tokens * profile_lib.out_width(layer, shape), top))
        else:
            read = (i, reads.get(id(layer)) or id(layer))
            if read not in reduced:
                reduced.add(read)
                entries.append((
                    "all-reduce", "backward",
                    tokens * profile_lib.in_width(layer, shape), top))
            if top:
                out["column_out"].add(id(layer))
    return out


def _looked_up_tables(profile, weights):
    """Per op, the model-axis block bytes of its trainable lookup tables
    (an Embedding's `embeddings`) that no op reuses as a projection: their
    gradients reach the optimizer sparse (rows by token; a tied table's
    adds the projection's dense gradient; an untied ReversibleEmbedding
    projects with a kernel of its own). `weights`: `Layout._weights`."""
    reused = {id(layer) for op in profile.ops for layer in op.reuses}
    out = np.zeros(len(profile.ops))
    for i, op in enumerate(profile.ops):
        projects = {id(w.owner) for w in op.weights if w.flops}
        for w, (block, _, itemsize, trainable) in zip(op.weights, weights[i]):
            tied = id(w.owner) in reused and id(w.owner) not in projects
            if (trainable and not tied and hasattr(w.owner, "input_dim")
                    and w.path.rsplit("/", 1)[-1] == "embeddings"):
                out[i] += float(math.prod(block)) * itemsize
    return out


def _splits_rows(style, layer):
    """Whether `style` splits `layer`'s lookup table by rows and its
    lookups are summed over the model axis: a tied ReversibleEmbedding
    under `VocabParallel` (`vocab_parallel.takes_vocab_parallel_lookups`;
    a plain Embedding's rows-split table, gathered for its lookups, is
    costed as a hidden-split one's, T·h gathered, not V·h)."""
    return (isinstance(style, tp.VocabParallel)
            and vocab_parallel.takes_vocab_parallel_lookups(layer))


def _op_of_layers(profile):
    """{id(layer): index of the profile's op holding it} for each op's
    layer and the layers nested in it."""
    op_of = {}
    for i, op in enumerate(profile.ops):
        op_of[id(op.layer)] = i
        for sub in profile_lib.sublayers(op.layer, include_self=False):
            op_of.setdefault(id(sub), i)
    return op_of


def block_shape_full(block, spec, t):
    """The full shape back from a model-axis block (for fsdp's choice of
    dimension, which looks at the whole weight)."""
    return tuple(b * t if axis == "model" else b for b, axis in zip(block, spec))


def _unescaped(pattern):
    """`pattern` with its escapes removed (auto_rules' patterns are
    `re.escape`d layer or weight paths)."""
    return re.sub(r"\\(.)", r"\1", pattern)


def layer_for(profile, pattern):
    """The layer of `profile` a rule's `pattern` (an escaped path or a
    regex) names, or None."""
    layer = profile.layers_by_path.get(_unescaped(pattern))
    if layer is not None:
        return layer
    regex = re.compile(pattern)
    for path, candidate in profile.layers_by_path.items():
        if path is not None and regex.fullmatch(path):  # (a layer no model
            return candidate                            # has built: None)
    return None


def _collective_time(kind, nbytes, n, link, count=1, shared=False):
    """α-β seconds of `count` collectives moving `nbytes` in total.

    A ring (`shared=False`): 2(n-1) steps of α and 2(n-1)/n · B/β for an
    all-reduce, half of that for an all-gather or reduce-scatter. On a host
    whose devices share its memory (`Cluster.shared_host`: virtual CPUs)
    each collective is one α and every device reads the n blocks of its
    group: n · B/β, B the whole message (measured by `Cluster.local()`)."""
    if n <= 1:
        return np.zeros_like(np.asarray(nbytes, float))
    alpha, beta = link
    if shared:
        return count * alpha + n * nbytes / beta
    steps = 2 * (n - 1) if kind == "all-reduce" else (n - 1)
    return count * steps * alpha + steps / n * nbytes / beta


def _model_axis(layout, total, *, r, b, m, link, shared):
    """(bytes, α-β seconds) per stage on the model axis. The forward
    collectives run again when recomputing."""
    model_bytes = (total("tp_bytes_fwd") * (1 + r) + total("tp_bytes_bwd")) * b
    count = (total("tp_count_fwd") * (1 + r) + total("tp_count_bwd")) * m
    kind = "all-reduce"
    if layout.sequence_parallel:
        # Each all-reduce becomes a reduce-scatter and an all-gather of the
        # same message (Megatron-LM's sequence parallelism): twice the
        # messages and the bytes communication_report counts, the same
        # ring time (each moves (t-1)/t of the message).
        kind, model_bytes, count = "all-gather", 2 * model_bytes, 2 * count
        # ... plus the embeddings' re-splits (again when recomputing).
        model_bytes += total("resplit_bytes") * (1 + r) * b
        count += total("resplit_count") * (1 + r) * m
    return model_bytes, _collective_time(kind, model_bytes, layout.t, link,
                                         count, shared)


def _internals(layout, total, *, recompute, d, fsdp, span):
    """Bytes per sample kept inside a stage's layers: all of them, without
    the attention cores' with selective recomputation, or with full
    recomputation the largest one layer's or block's (recomputed one at
    a time; a block, `tfpar.recompute_spans`, with the outputs it makes
    and reads itself)."""
    if recompute == "full":
        return layout.stage_max("recomputed", d, fsdp, *span)
    internal = total("internal")
    if recompute == "selective":
        internal = internal - total("attention_internal")
    if layout.sequence_parallel:
        # Sequence parallelism gathers the split tokens before a column-
        # parallel layer (the input its backward all-reduce has): that layer
        # keeps the gathered input whole.
        return internal + total("tp_bytes_bwd")
    return internal


def _data_axis(layout, total, *, d, m, r, fsdp, link, span, shared,
               combined=False):
    """(bytes, α-β seconds, gathered-weight workspace) per stage on the data
    axis: an all-reduce of the gradients, or with fsdp an all-gather of the
    stored weights per micro-batch (again when recomputing) plus a
    reduce-scatter of the gradients."""
    gathered, count = total("gathered"), total("count")
    if combined:
        # DTensor combines the all-reduces of gradients that are ready
        # together (a layer's kernel and bias): one per layer that has
        # trainable weights, fitted to the measured steps (see
        # `_fixed_time`).
        count = total("weighted")
    p = len(gathered)
    # Gradients are summed in the compute dtype (bfloat16 under
    # mixed_bfloat16); fsdp gathers the stored (float32) weights. A
    # vocabulary-split tied table's block twice (its lookup's part, its
    # projection's); a looked-up table's sparse gradient once per sum the
    # optimizer's update makes of it.
    grads = (gathered + total("table_gradient") + (layout.table_sums - 1)
             * total("sparse_gradient")) * layout.grad_ratio
    if not (fsdp and d > 1):
        data_bytes = grads if d > 1 else np.zeros(p)
        return (data_bytes,
                _collective_time("all-reduce", grads, d, link, count, shared),
                np.zeros(p))
    gathers = m * (1 + r)
    time = (_collective_time("all-gather", gathered * gathers, d, link,
                             count * gathers, shared)
            + _collective_time("reduce-scatter", grads, d, link, count,
                               shared))
    workspace = (2 * layout.stage_max("gathered", d, fsdp, *span) if r
                 else gathered - total("trainable"))
    return gathered * gathers + grads, time, workspace


def _pipe_axis(layout, lo, hi, *, m, mb, link, send=None):
    """Activations forward and gradients back, per micro-batch, over the cut
    before a stage (none for stage 0) and the one after it (none for the
    last): (bytes carried in before, after, α-β seconds) per stage. `send`:
    seconds per move in place of α (a shared host's measured
    `copy_to_mesh`, per device of the stage)."""
    p = len(lo)
    s = np.arange(p)
    carried = np.append(layout.carried, 0.0)
    before = np.where(s > 0, carried[lo], 0.0)
    after = np.where(s < p - 1, carried[hi], 0.0)
    sends = (s > 0).astype(float) + (s < p - 1)
    alpha, beta = link
    alpha = alpha if send is None else send
    return before, after, 2 * m * (alpha * sends + (before + after) * mb / beta)


def _gathers_before_sends(layout, lo, *, d, m, batch, link):
    """Seconds per stage, on a calibrated shared host, of the all-gathers
    before its moves: a move relays its tensor out to replicated on the
    source mesh first (`collectives.move_to_mesh`), which gathers it over
    the data axis (d > 1) and over the model axis when the layer before
    the cut splits its output. Each such cut costs, per micro-batch and
    direction (activations forward, gradients back), one all-gather of the
    whole micro-batch's tensor: α + bytes/β (every device reads it whole).
    A cut's cost is on both its stages, as the sends are (summed, halved)."""
    p = len(lo)
    if p == 1:
        return np.zeros(1)
    alpha, beta = link
    cuts = lo[1:]
    gathered = (d > 1) | (layout.split_out[cuts - 1] > 0)
    per_cut = np.where(gathered, 2 * m * (
        alpha + layout.carried[cuts] * batch / m / beta), 0.0)
    return np.append(per_cut, 0.0) + np.append(0.0, per_cut)


def estimate(layout, stages, *, d, p, m, schedule, fsdp, recompute,
             batch, cluster, slots, virtual_stages=1, pipe_outermost=False):
    """The `Estimate` of one candidate; `stages` are the first op index of
    each of the p stages (vectorised over stages: prefix sums). Interleaved
    (`virtual_stages` v > 1: stage s holds parts s, s + p, ... of v·p): a
    stage costed as its span, v times the sends, bubble (p-1)/(v·m),
    activations in flight × (1 + (p-1)/(p·v)) (Narayanan et al. 2021).
    `pipe_outermost`: the mesh's axes ordered pipe, data, model (the
    roofline's links of a preset cluster; the α-β model lays data first)."""
    v, t = virtual_stages, layout.t
    lo = np.asarray(stages)
    hi = np.append(lo[1:], len(layout.flops_split))
    b = batch / d          # samples per device per step
    mb = b / m             # samples per micro-batch per device
    pre = layout.prefix(d, fsdp)

    def total(name):
        return pre[name][hi] - pre[name][lo]

    links = {"model": cluster.link(t, 1), "pipe": cluster.link(p, t),
             "data": cluster.link(d, t * p)}
    shared = cluster.shared_host
    r = 1 if recompute == "full" else 0  # collectives run again too
    compute = _stage_compute(total, t, b, recompute, cluster)
    model_bytes, model_time = _model_axis(layout, total, r=r, b=b, m=m,
                                          link=links["model"], shared=shared)
    trainable = total("trainable")
    fixed = shared and cluster.op_time > 0  # the runtime's fixed costs
    data_bytes, data_time, workspace = _data_axis(
        layout, total, d=d, m=m, r=r, fsdp=fsdp, link=links["data"],
        span=(lo, hi), shared=shared, combined=fixed)
    send = cluster.send_time * d * t if fixed and cluster.send_time else None
    before, after, pipe_time = _pipe_axis(layout, lo, hi, m=m * v, mb=mb,
                                          link=links["pipe"], send=send)
    if send is not None:
        pipe_time = pipe_time + _gathers_before_sends(
            layout, lo, d=d, m=m, batch=batch, link=cluster.link(d * t, p))
    memory = _memory(layout, total, before=before, recompute=recompute,
                     d=d, fsdp=fsdp, span=(lo, hi), schedule=schedule, m=m,
                     mb=mb, slots=slots, workspace=workspace,
                     virtual_stages=v)
    comm = {"model": model_bytes if t > 1 else np.zeros(p),
            "data": np.asarray(data_bytes, float),
            "pipe": (before + after) * b * 2 * v}
    parts = {"compute": compute, "model": model_time, "data": data_time,
             "pipe": pipe_time,
             "update": _update_time(trainable, slots, cluster)}
    if fixed:
        # Each micro-batch after the first adds its weight gradients to the
        # accumulated ones: one read-add-write of the trainable bytes, a
        # third of Adam's update of them (measured on the wide MLP: 15–17 ms
        # per micro-batch, predicted 15).
        parts["accumulate"] = (m - 1) * _update_time(trainable, 0, cluster)
        parts["fixed"] = _fixed_time(layout, total, lo, hi, devices=d * t,
                                     m=m, r=r, slots=slots, cluster=cluster)
    step, time_s = (_shared_step(parts, m=m) if shared
                    else _step(parts, m=m * v, p=p, r=r))
    step, time_s, executed = _roofline_time(
        layout, (step, time_s), d=d, p=p, m=m, schedule=schedule, fsdp=fsdp,
        recompute=recompute, batch=batch, cluster=cluster, slots=slots,
        virtual_stages=v, pipe_outermost=pipe_outermost)
    return _per_device(step, time_s, executed, memory, comm)


def _per_device(step, time_s, executed, memory, comm):
    """The `Estimate` of per-stage `memory` and `comm` arrays: those of the
    stage with the most memory (what must fit on every device)."""
    w = int(np.argmax(sum(memory.values())))
    return Estimate(
        step_time_s=float(step),
        memory_per_device={kind: float(x[w]) for kind, x in memory.items()},
        communication_bytes_per_device=float(sum(x[w] for x in comm.values())),
        communication_bytes_by_axis={a: float(x[w]) for a, x in comm.items()},
        time_s=time_s,
        memory_by_stage=ByStage(memory),
        executed_flops=executed)


def _roofline_time(layout, alpha_beta, *, d, p, m, schedule, fsdp, recompute,
                   batch, cluster, slots, virtual_stages=1,
                   pipe_outermost=False):
    """(step seconds, {part: seconds}, executed FLOPs per device) of a
    transformer on a preset cluster (`Cluster.preset`: vendor figures and
    efficiencies), from the per-op roofline `tfpar.estimate` uses
    (`roofline.py`); otherwise the
    α-β model's (step, parts) in `alpha_beta`, FLOPs not counted."""
    if cluster.hardware is None or layout.transformer is None:
        return (*alpha_beta, 0.0)
    cfg = roofline.Parallel(
        data=d, pipe=p, model=layout.t, microbatch=max(1, batch // (d * m)),
        virtual_stages=virtual_stages,
        schedule="interleaved" if virtual_stages > 1 else schedule,
        sequence_parallel=layout.sequence_parallel,
        recompute=recompute, fsdp=fsdp, flash=flash_attention(),
        tf32=tf32(), optimizer_slots=slots, pipe_outermost=pipe_outermost,
        **roofline.head_layout(
            layout.transformer, layout.t, layout.vocab_parallel))
    parts = roofline.step_time(layout.transformer, cfg, cluster.hardware,
                               batch, cluster)
    step = parts.pop("total")
    return step, parts, parts.pop("executed_flops")


def flash_attention():
    """Whether the roofline costs attention as a fused kernel: Keras'
    flash attention explicitly on (`is_flash_attention_enabled()` is True;
    None, its default, is "when the backend can", not costed as fused)."""
    return keras.config.is_flash_attention_enabled() is True


def tf32():
    """Whether TensorFlow computes float32 matmuls as TF32 (its default
    on Ampere and later; `tf.config.experimental.
    enable_tensor_float_32_execution`)."""
    return bool(tf.config.experimental.tensor_float_32_execution_enabled())


def _memory(layout, total, *, before, recompute, d, fsdp, span, schedule, m,
            mb, slots, workspace, virtual_stages=1):
    """{kind: bytes per device} per stage."""
    p = len(before)
    s = np.arange(p)
    stored, trainable = total("stored"), total("trainable")
    # What stage 0 reads is the batch itself, not an activation.
    kept = total("kept_full" if recompute == "full" else "kept") + before
    internal = _internals(layout, total, recompute=recompute, d=d, fsdp=fsdp,
                          span=span)
    in_flight = np.full(p, m) if schedule == "gpipe" else np.minimum(p - s, m)
    if virtual_stages > 1:  # Megatron's interleaved warm-up, in stages' worth
        in_flight = in_flight * (1 + (p - 1) / (p * virtual_stages))
    # Every micro-batch in flight keeps its layers' outputs (the next
    # layers' inputs; under full recomputation those read outside their
    # block) and, without full recomputation, their internals (selective:
    # not the attention cores'). Recomputed internals are transient: only
    # the one layer, block or attention core being recomputed holds them,
    # for one micro-batch at a time (workspace, as fsdp's gathers).
    full = recompute == "full"
    saved_internal = 0.0 if full else internal * in_flight
    recomputing = internal if full else 0.0
    if recompute == "selective":
        recomputing = layout.stage_max("attention_internal", d, fsdp, *span)
    return {"params": stored, "gradients": trainable,
            "optimizer": slots * trainable,
            "activations": (kept * in_flight + saved_internal) * mb,
            "workspace": np.maximum(workspace, 0.0) + recomputing * mb}


# Ops a compiled step runs, counted in the traced steps of Dense stacks
# (`docs/guides/planner.md`): each layer's forward and backward pass per
# micro-batch 6 (`profile.layer_ops`: more for attention, norms, Dropout
# and some activations) + 4 per weight (a Dense: 14), every stage's
# bookkeeping per micro-batch 6 (the micro-batch's gather and relayout,
# ordering, gradient accumulation), every cut's moves per micro-batch 10
# (relayouts around `copy_to_mesh`, both ways; half on each side of the
# cut), the loss and metrics per micro-batch 50 on the last stage, the
# optimizer's update 13 + 14 per slot for every trainable weight (Keras'
# Adam: 41).
_OPS_WEIGHT, _OPS_STAGE, _OPS_CUT, _OPS_LOSS = 4, 6, 10, 50


def _fixed_time(layout, total, lo, hi, *, devices, m, r, slots, cluster):
    """Seconds per stage of the runtime's fixed cost on a shared host: the
    ops the stage's step runs (forward, backward — again the forward when
    recomputing — bookkeeping, moves, loss, update), each once per device
    of the stage's mesh, at the measured `cluster.op_time` per op."""
    p = len(lo)
    weights = total("count")
    passes = (2 + r) / 2  # forward + backward = 2 halves; recompute +1
    s = np.arange(p)
    cuts = ((s > 0).astype(float) + (s < p - 1)) / 2
    per_microbatch = (passes * (total("layer_ops") + _OPS_WEIGHT * weights)
                      + _OPS_STAGE + _OPS_CUT * cuts + _OPS_LOSS * (s == p - 1))
    ops = m * per_microbatch + (13 + 14 * slots) * weights
    # Each convolution's forward and backward pass on each device also
    # costs the measured `conv_time` beyond its FLOPs (3 thirds; again the
    # forward third when recomputing).
    convs = m * total("convs") * (3 + r) / 3 * cluster.conv_time
    return (ops * cluster.op_time + convs) * devices


def _stage_compute(total, t, b, recompute, cluster):
    """Seconds per stage of FLOPs for b samples per device: forward and
    backward (3 × forward), the forward again with full recomputation;
    selective recomputation runs the attention cores' forward again (QKᵀ
    and attention over V, no collective)."""
    full = 1 if recompute == "full" else 0
    seconds = _compute_time(total, t=t, work=(3 + full) * b, cluster=cluster)
    if recompute == "selective":
        seconds = seconds + total("attention_flops") * b / cluster.device_flops
    return seconds


def _compute_time(total, *, t, work, cluster):
    """Seconds per stage of FLOPs: the model-axis-split part over t, times
    `work` (passes × samples per device), at the device's FLOP/s — and a
    convolution's part at the measured `cluster.conv_flops` when given
    (below a matmul's rate on this CPU: `calibrate.conv_rate_and_time`)."""
    split, repl = total("flops_split") / t, total("flops_repl")
    if not cluster.conv_flops:
        return (split + repl) * work / cluster.device_flops
    conv = total("conv_split") / t + total("conv_repl")
    return ((split + repl - conv) / cluster.device_flops
            + conv / cluster.conv_flops) * work


def _update_time(trainable, slots, cluster):
    """Seconds per stage of the optimizer's elementwise update: trainable
    bytes · (1 + slots)/3 at the measured rate of Adam's update (zero when
    the cluster gives no `update_bandwidth`)."""
    if not cluster.update_bandwidth:
        return np.zeros_like(trainable)
    return trainable * (1 + slots) / 3 / cluster.update_bandwidth


def _step(parts, *, m, p, r):
    """Step seconds on dedicated devices: the slowest stage's compute and
    model-axis time, plus the bubble (p-1)/m of it, the data-axis time the
    backward pass does not hide, the stage's sends and its update."""
    busy = parts["compute"] + parts["model"]
    k = int(np.argmax(busy))
    bubble = busy[k] * (p - 1) / m
    # The data-axis gradient reduction overlaps the backward pass (2/3 of
    # the compute), as DDP and Megatron-LM bucket it; the rest shows.
    exposed = max(0.0, parts["data"][k] - parts["compute"][k] * 2 / (3 + r))
    step = busy[k] + bubble + exposed + parts["pipe"][k] + parts["update"][k]
    return step, {"compute": float(parts["compute"][k]),
                  "bubble": float(bubble), "model": float(parts["model"][k]),
                  "data": float(exposed), "pipe": float(parts["pipe"][k]),
                  "update": float(parts["update"][k])}


def _shared_step(parts, *, m):
    """Step seconds when all devices share one host's cores and memory
    (`Cluster.shared_host`): nothing runs concurrently with anything else,
    so the step is the work of every stage added up — per stage its devices'
    compute, collectives and update (measured at the rates of all devices
    at once, so each stage's share is 1/p: the mean over stages) plus every
    stage-to-stage send once (each cut appears in two stages' sends) and,
    when calibrated, every stage's fixed cost (its ops times its devices,
    already per device: summed). An idle stage frees the cores: no
    bubble."""
    means = {k: float(np.mean(v)) for k, v in parts.items()
             if k not in ("pipe", "fixed")}
    means["pipe"] = float(np.sum(parts["pipe"]) / 2)
    if "fixed" in parts:
        means["fixed"] = float(np.sum(parts["fixed"]))
    means["bubble"] = 0.0
    return sum(means.values()), means
