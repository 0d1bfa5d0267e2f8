"""The search: every mesh shape, layout, stage cut, micro-batch count,
schedule, fsdp and recomputation setting, each costed by `cost.estimate`.

- Mesh shapes: every ordered factorisation data × pipe × model of the
  device count, laid out data, pipe, model; on a preset cluster of
  several hosts also pipe, data, model (Megatron-LM's order: a data
  group's members t apart rather than t·p, sharing a host's network
  ports), where the roofline prices that faster (`_in_faster_order`).
- Layouts: for each model-axis size t, `tfpar.auto_rules(model,
  axis_size=t)` (what it cannot split — heads or widths t does not divide
  — rejects the candidates with its message), and the same with
  `sequence_parallel=True` (norms and the residual stream split over the
  sequence: every kept activation 1/t as large, Megatron-LM's sequence
  parallelism). A transformer's output head is split over the vocabulary
  (`vocab_parallel=True`, `VocabParallel`) where `head_rules.vocab_rules`
  splits it (t divides the vocabulary, no sequence parallelism, a head
  auto_rules splits), else kept whole (`Layout.whole_head`);
  the candidate records it (`Candidate.vocab_parallel`), the plan applies
  it and the cost model costs that head (`Layout`).
- Stage cuts (Alpa's inter-op pass, simplified to one objective): for p
  stages, the contiguous cut of the model's layers (those PipelineModel
  cuts between) minimising the
  slowest stage's compute — the optimum of the dynamic programme
  best[k][j] = min over i < j of max(best[k-1][i], cost(i..j)), found by
  bisection over the bottleneck (`min_max_cuts`).
- Micro-batches m: the powers of two (and the largest count) that split
  the per-replica batch, from 1 up; schedules 1F1B and GPipe, and on a
  preset cluster (`Cluster.preset`, whose roofline prices them) interleaved
  1F1B with v = 2 or 4 virtual stages per device (`_interleaved`).
- Deterministic: candidates are built in a fixed order and ranked by
  (predicted step time, memory, that order).
"""

import bisect
import dataclasses
import functools
import itertools
import time
import warnings

import numpy as np

from tfpar import auto_plan as tp
from tfpar.planner import cost as cost_lib
from tfpar.planner import head_rules
from tfpar.planner import roofline


@dataclasses.dataclass
class Candidate:
    """One plan considered: its choices, its `Estimate`, `rejected` (None,
    or why it cannot be used) and, when timed, `measured_step_time_s`."""

    axes: dict
    fsdp: bool
    recompute: str  # None, "selective" (the attention core) or "full"
    num_microbatches: int
    schedule: str
    stage_boundaries: list
    estimate: object = None
    rejected: str = None
    measured_step_time_s: float = None
    sequence_parallel: bool = False
    # Each stage's first op, by position in the model's graph: a builder
    # that leaves layers unnamed names them anew at every call (add, add_1,
    # ...), so a model built again is cut by position, not by these names.
    stage_starts: list = None
    # Model parts per pipeline stage (interleaved 1F1B when > 1): the model
    # is cut into virtual_stages × pipe parts at `stage_boundaries`.
    virtual_stages: int = 1
    # The mesh axis the expert banks are split over: None (no expert
    # split), "expert" (axes["expert"]) or "data" (GShard's placement).
    expert_axis: str = None
    # The output head split over the vocabulary (auto_rules'
    # vocab_parallel=True) rather than kept whole.
    vocab_parallel: bool = False

    @property
    def label(self):
        axes = "×".join(f"{k}{v}" for k, v in self.axes.items())
        extra = []
        if self.axes.get("pipe", 1) > 1:
            extra.append(f"m={self.num_microbatches} {self.schedule}"
                         + (f" interleaved v={self.virtual_stages}"
                            if self.virtual_stages > 1 else ""))
        if self.expert_axis == "data":
            extra.append("experts over data")
        if self.sequence_parallel:
            extra.append("sp")
        if self.vocab_parallel:
            extra.append("vocab-parallel")
        if self.fsdp:
            extra.append("fsdp")
        if self.recompute:
            extra.append({"selective": "selective recompute",
                          "full": "recompute"}[self.recompute])
        return " ".join([axes] + extra)

    def to_dict(self):
        d = dataclasses.asdict(self)
        d["estimate"] = self.estimate.to_dict() if self.estimate else None
        return d

    @classmethod
    def from_dict(cls, d):
        d = dict(d)
        # Plans saved when recompute was a bool: True was full.
        d["recompute"] = _OLD_RECOMPUTE.get(d.get("recompute"),
                                            d.get("recompute"))
        if d.get("estimate"):
            d["estimate"] = cost_lib.Estimate.from_dict(d["estimate"])
        return cls(**d)


_OLD_RECOMPUTE = {True: "full", False: None}


def factorisations(n):
    """(data, pipe, model) with data · pipe · model = n, in a fixed order."""
    out = []
    for t in _divisors(n):
        for p in _divisors(n // t):
            out.append((n // t // p, p, t))
    return out


def _divisors(n):
    return [k for k in range(1, n + 1) if n % k == 0]


def min_max_cuts(costs, p):
    """Start indices of stages 0..p-1 (contiguous, non-empty) minimising the
    largest stage's summed cost.

    The optimum of the dynamic programme
    best[k][j] = min over i < j of max(best[k-1][i], cost(i..j)) (Alpa's
    inter-op pass with one objective), found in O(p log n) per probe: the
    bottleneck T is bisected over, a greedy pass packing each stage up to T
    tells whether p stages suffice, and stages left over split the longest
    runs (which cannot raise the maximum).
    """
    costs = np.asarray(costs, dtype=float)
    n = len(costs)
    # Python floats: bisect on a list is ~10x numpy's searchsorted per call.
    prefix = np.concatenate([[0.0], np.cumsum(costs)]).tolist()

    def pack(limit):
        starts, i = [], 0
        while i < n and len(starts) <= p:
            starts.append(i)
            # the furthest j with prefix[j] - prefix[i] <= limit (>= i + 1)
            j = bisect.bisect_right(prefix, prefix[i] + limit) - 1
            i = max(j, i + 1)
        return starts if i >= n else None

    lo, hi = float(costs.max()), prefix[-1]
    for _ in range(60):
        if hi - lo <= 1e-12 * max(hi, 1e-30):
            break
        mid = (lo + hi) / 2
        if (found := pack(mid)) is not None and len(found) <= p:
            hi = mid
        else:
            lo = mid
    starts = pack(hi)
    while len(starts) < p:  # split the longest run that has two layers
        ends = starts[1:] + [n]
        k = max((e - b, -i) for i, (b, e) in enumerate(zip(starts, ends))
                if e - b > 1)[1] * -1
        starts.insert(k + 1, starts[k] + 1)
    return starts


@functools.lru_cache(maxsize=256)
def _cuts(costs, p):
    """`min_max_cuts` of float64 `costs` bytes, once per (costs, p): the
    layouts with and without sequence parallelism cost the same FLOPs."""
    return tuple(min_max_cuts(np.frombuffer(costs), p))


def microbatch_counts(per_replica, p):
    if p == 1:
        return [1]
    counts = [m for m in (2 ** k for k in range(per_replica.bit_length()))
              if per_replica % m == 0]
    if per_replica not in counts:
        counts.append(per_replica)
    return counts


def search(profile, model, global_batch_size, cluster, memory_limit,
           slots, table_sums=1):
    """Every candidate (list of `Candidate`), the search's seconds and the
    cost `Layout` of each (model-axis size, sequence parallel);
    `table_sums`: `optimizers.sparse_gradient_sums` of the optimizer."""
    start = time.perf_counter()
    layouts, rule_errors = {}, {}
    candidates = []
    # Sequence parallelism needs a token dimension (not an MLP's features).
    sequence = max((op.tokens for op in profile.ops), default=1)
    sequences = sequence > 1
    with tp.unchanged_model(model):
        for d, p, t in factorisations(cluster.num_devices):
            axes = {"data": d, "pipe": p, "model": t}
            for sp in (False, True) if t > 1 and sequences else (False,):
                key = (t, sp)
                if key not in layouts and key not in rule_errors:
                    try:
                        layouts[key] = _layout(profile, model, t, sp,
                                               table_sums)
                    except ValueError as e:
                        rule_errors[key] = str(e)
                reject = _reject_reason(axes, rule_errors.get(key),
                                        global_batch_size, len(profile.ops),
                                        sequence if sp else None)
                if reject:
                    candidates.append(Candidate(
                        axes, False, None, 1, "1f1b", None, rejected=reject,
                        sequence_parallel=sp))
                    continue
                candidates += _candidates(profile, layouts[key], axes,
                                          global_batch_size, cluster,
                                          memory_limit, slots)
    return ranked(candidates), time.perf_counter() - start, layouts


def ranked(candidates):
    """`candidates` best first: usable before rejected, then by predicted
    step time, memory and their order in the list (deterministic)."""
    order = {id(c): i for i, c in enumerate(candidates)}
    return sorted(candidates, key=lambda c: (
        c.rejected is not None,
        c.estimate.step_time_s if c.estimate else np.inf,
        c.estimate.total_memory if c.estimate else np.inf,
        order[id(c)]))


def _layout(profile, model, t, sequence_parallel=False, table_sums=1):
    """The cost `Layout` of `auto_rules` over a model axis of size t: with
    the head split over the vocabulary where `head_rules.vocab_rules`
    gives it, else whole."""
    rules = head_rules.vocab_rules(profile, model, t, sequence_parallel)
    vocab_parallel = rules is not None
    if rules is None and t > 1:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rules = tp.auto_rules(model, axis_size=t,
                                  sequence_parallel=sequence_parallel)
    if t > 1 and not len(rules):
        raise ValueError("auto_rules found no layer to split over the model "
                         "axis")
    return cost_lib.Layout(profile, rules, t, sequence_parallel,
                           vocab_parallel, table_sums)


def _reject_reason(axes, rule_error, global_batch_size, n_ops,
                   sequence=None):
    """Why a mesh shape cannot run at all, or None (`sequence`: the tokens
    a sequence-parallel candidate splits over the model axis, None for
    the others)."""
    d, p, t = axes["data"], axes["pipe"], axes["model"]
    if rule_error:
        return f"model={t}: {rule_error}"
    if global_batch_size % d:
        return (f"global_batch_size {global_batch_size} does not split over "
                f"data={d}")
    if p > n_ops:
        return (f"pipe={p} needs at least {p} layers to cut between; the "
                f"model has {n_ops} (PipelineModel's cut points: its layers, "
                "nested functional models inlined)")
    if sequence is not None and sequence % t:
        # auto_rules checks a sequence the model's shapes state; this is
        # the one given as `sequence_length` (keras-hub models).
        return (f"sequence parallelism splits the sequence of {sequence} "
                f"tokens over model={t}, which does not divide it (DTensor "
                "splits a dimension evenly)")
    if sequence is not None and p > 1 and d == 1:
        # PipelineModel refuses it: DTensor (TF 2.21) crashes compiling it.
        return ("sequence parallelism inside pipeline stages needs a data "
                "axis (DTensor 2.21 cannot compile it without one)")
    return None


def _candidates(profile, layout, axes, global_batch_size, cluster,
                memory_limit, slots):
    """Every (micro-batches, schedule, fsdp, recompute) choice on one mesh
    shape, estimated; those over `memory_limit` marked rejected."""
    d, p = axes["data"], axes["pipe"]
    stages, boundaries = stage_cuts(profile, layout, p)
    found = []
    # Selective recomputation only where there is attention to recompute.
    recomputes = ((None, "selective", "full") if layout.attention_flops.any()
                  else (None, "full"))
    for m, schedule, fsdp, recompute in itertools.product(
            microbatch_counts(global_batch_size // d, p),
            ("1f1b", "gpipe") if p > 1 else ("1f1b",),
            (False, True) if d > 1 else (False,), recomputes):
        c = Candidate(dict(axes), fsdp, recompute, m, schedule, boundaries,
                      sequence_parallel=layout.sequence_parallel,
                      stage_starts=[int(i) for i in stages] if p > 1 else None,
                      vocab_parallel=layout.vocab_parallel)
        _in_faster_order(c, layout, cluster, functools.partial(
            cost_lib.estimate, layout, stages, d=d, p=p, m=m,
            schedule=schedule, fsdp=fsdp, recompute=recompute,
            batch=global_batch_size, cluster=cluster, slots=slots))
        reject_unfit(c, memory_limit)
        found.append(c)
    return found + _interleaved(profile, layout, found, stages,
                                global_batch_size, cluster, memory_limit,
                                slots)


def stage_cuts(profile, layout, p):
    """(stage start indices, stage boundaries) of the min-max cut into p
    stages of the layout's per-op costs ([0], None for p = 1)."""
    if p == 1:
        return [0], None
    stages = _cuts(_stage_cost(layout), p)
    return stages, [profile.ops[i].name for i in stages[1:]]


def _in_faster_order(candidate, layout, cluster, estimate):
    """Sets `candidate.estimate` (`estimate(pipe_outermost=...)`), and its
    axes to pipe, data, model where a preset cluster's roofline prices
    that order faster than data, pipe, model (only a data and a pipe axis
    over several hosts can differ: their groups' hosts and ports)."""
    candidate.estimate = estimate(pipe_outermost=False)
    axes = candidate.axes
    if (cluster.hardware is None or layout.transformer is None
            or cluster.num_hosts == 1 or axes["pipe"] == 1
            or axes["data"] == 1):
        return
    pipe_first = estimate(pipe_outermost=True)
    if pipe_first.step_time_s < candidate.estimate.step_time_s:
        candidate.axes = {"pipe": axes["pipe"], **{
            k: v for k, v in axes.items() if k != "pipe"}}
        candidate.estimate = pipe_first


def _stage_cost(layout):
    """Per-op FLOPs per device (bytes of float64, for `_cuts`): what a
    stage cut balances."""
    return (layout.flops_split / layout.t + layout.flops_repl
            + 1e-9).tobytes()


def reject_unfit(candidate, memory_limit):
    """Marks `candidate` rejected when its estimate exceeds the limit."""
    need = candidate.estimate.total_memory
    if need > memory_limit:
        candidate.rejected = (f"does not fit: needs {format_bytes(need)} per "
                              f"device, limit {format_bytes(memory_limit)}")


# Virtual stages per device tried (Narayanan et al. 2021 use 2-4 chunks).
VIRTUAL_STAGES = (2, 4)


def _interleaved(profile, layout, found, stages, global_batch_size,
                 cluster, memory_limit, slots):
    """Interleaved 1F1B copies of the 1F1B candidates in `found`, with v in
    `VIRTUAL_STAGES`: the model cut into v·p parts (min-max over the same
    per-op costs), part k on stage k mod p; only where PipelineModel runs
    it (m a multiple of p, v·p parts no more than the model's cut points,
    and v·p dividing its transformer blocks) and on a preset cluster, whose
    roofline prices the schedule (the α-β model of a described or local
    cluster does not count the extra moves' fixed costs). `stages`: the
    1F1B candidates' p stage starts, the span each stage is costed as."""
    model = layout.transformer
    if len(stages) < 2 or cluster.hardware is None or model is None:
        return []
    out = []
    for v in VIRTUAL_STAGES:
        for c in found:
            p, m = c.axes["pipe"], c.num_microbatches
            if (c.schedule != "1f1b" or m % p or v * p > len(profile.ops)
                    or model.layers % (v * p)):
                continue
            parts = _cuts(_stage_cost(layout), v * p)
            x = dataclasses.replace(
                c, estimate=None, rejected=None, virtual_stages=v,
                stage_boundaries=[profile.ops[i].name for i in parts[1:]],
                stage_starts=[int(i) for i in parts])
            d = c.axes["data"]
            x.estimate = cost_lib.estimate(
                layout, stages, d=d, p=p, m=m, schedule="1f1b",
                fsdp=c.fsdp, recompute=c.recompute, batch=global_batch_size,
                cluster=cluster, slots=slots, virtual_stages=v,
                pipe_outermost=roofline.pipe_outermost(c.axes))
            reject_unfit(x, memory_limit)
            out.append(x)
    return out


def format_bytes(nbytes):
    """1.23 GB / 4.56 MB / 7.8 kB."""
    if nbytes >= 1e9:
        return f"{nbytes / 1e9:.2f} GB"
    if nbytes >= 1e6:
        return f"{nbytes / 1e6:.2f} MB"
    return f"{nbytes / 1e3:.1f} kB"
