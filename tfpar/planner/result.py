"""The `Plan` that `tfpar.plan` returns: a chosen candidate, explained,
saved and loaded, and applied (its mesh, its strategy, the model laid out).

Example (8 virtual CPUs):

>>> plan = tfpar.plan(build_model, global_batch_size=64,
...                   memory_per_device=2e6)
>>> print(plan.explain())
>>> with plan.strategy().scope():
...     model = plan.apply(build_model())    # a PipelineModel if pipe > 1
...     model.compile(optimizer="adam", loss="mse")
>>> model.fit(x, y, batch_size=64)
>>> plan.save("plan.json"); tfpar.Plan.load("plan.json").axes
"""

import json

import numpy as np

from tfpar import layout as layout_lib
from tfpar import mesh as mesh_lib
from tfpar import recompute
from tfpar import styles as tp
from tfpar.auto_plan import auto_rules
from tfpar.pipeline import split
from tfpar.pipeline.model import PipelineModel
from tfpar.planner import calibrate
from tfpar.planner import cost as cost_lib
from tfpar.planner import search as search_lib
from tfpar.planner.search import format_bytes as _gb
from tfpar.strategy import ParallelStrategy

_STYLES = {"ColumnParallel": tp.ColumnParallel, "RowParallel": tp.RowParallel,
           "Replicated": tp.Replicated,
           "SequenceParallel": tp.SequenceParallel,
           "VocabParallel": tp.VocabParallel}


class Plan:
    """A chosen parallel plan with everything that was considered.

    Attributes:
        axes: ordered mesh axes of size > 1, e.g. {"data": 2, "pipe": 2,
            "model": 2} ({"data": 1} for one device).
        rules: `tfpar.LayoutRules` for the model axis (auto_rules' plan).
        fsdp, sequence_parallel: bools (sequence parallelism: the rules
            hold `SequenceParallel` norms).
        vocab_parallel: whether the output head is split over the
            vocabulary (`auto_rules(vocab_parallel=True)`, `VocabParallel`:
            each device of the model axis computes 1/t of the logits; the
            estimate costs it so) or kept whole (its logits computed whole
            on every device, and costed whole).
        recompute: None, "selective" (each attention layer's core
            recomputed) or "full" (every layer recomputed): what
            `apply` sets with `tfpar.recompute.set_recompute`.
        num_microbatches, schedule, stage_boundaries: the pipeline's
            (m = 1 and boundaries None without a pipe axis).
        virtual_stages: model parts per pipeline stage (v > 1: interleaved
            1F1B, the model cut into v × pipe parts at `stage_boundaries`;
            searched on preset clusters).
        estimate: the chosen candidate's `Estimate`.
        candidates: every `Candidate` considered, best first.
        info: model and search facts (parameters, FLOPs, search seconds;
            on a shared host "calibration", the spread of the timings the
            predictions come from: `tfpar.planner.calibrate.timing_spread`).
        checked: what `tfpar.plan`'s self-check found ("checked: ...", or
            "not checked: ..." with the reason).
    """

    def __init__(self, chosen, candidates, rules, stage_starts, info):
        self._chosen = chosen
        self.candidates = candidates
        self.rules = rules
        self._stage_starts = list(stage_starts)
        self.info = info
        if "calibration" not in info and info.get("cluster", {}).get(
                "shared_host"):
            self.info = {**info, "calibration": calibrate.timing_spread()}
        self._strategy = None

    axes = property(lambda self: {k: v for k, v in self._chosen.axes.items()
                                  if v > 1} or {"data": 1})
    fsdp = property(lambda self: self._chosen.fsdp)
    recompute = property(lambda self: self._chosen.recompute)
    sequence_parallel = property(lambda self: self._chosen.sequence_parallel)
    vocab_parallel = property(lambda self: self._chosen.vocab_parallel)
    num_microbatches = property(lambda self: self._chosen.num_microbatches)
    schedule = property(lambda self: self._chosen.schedule)
    stage_boundaries = property(lambda self: self._chosen.stage_boundaries)
    virtual_stages = property(lambda self: self._chosen.virtual_stages)
    expert_axis = property(lambda self: self._chosen.expert_axis)
    estimate = property(lambda self: self._chosen.estimate)
    checked = property(lambda self: self.info.get("checked", "not checked"))

    def explain(self, top=12, against=None):
        """A readable table of the candidates, the binding constraint and
        why the runner-up lost; with `against` (an `Estimate`, e.g.
        `tfpar.estimate` of a published or hand-written configuration on
        the same cluster) also that configuration's step time next to the
        chosen one's and the breakdown term that makes the difference
        (`compare`)."""
        i = self.info
        c = self._chosen
        e = c.estimate
        lines = [
            f"Plan for {i['model']!r}: {i['num_params']:,} parameters, "
            f"{i['forward_flops_per_sample'] / 1e9:.3g} GFLOP forward per "
            f"sample; global batch {i['global_batch_size']}, optimizer "
            f"{i['optimizer']}, {_devices(i['cluster'])}, memory limit "
            f"{_gb(i['memory_limit'])} per device.",
            f"Searched {len(self.candidates)} candidates in "
            f"{i['search_s']:.2f} s; "
            f"{sum(x.rejected is None for x in self.candidates)} fit.",
            f"Chosen: {c.label}: predicted {e.step_time_s * 1e3:.3g} ms per "
            f"step ({_parts(e)}), {_gb(e.total_memory)} per device ("
            + ", ".join(f"{k} {_gb(v)}" for k, v in e.memory_per_device.items())
            + f"), {_gb(e.communication_bytes_per_device)} of collectives.",
            *_split_axes_lines(e), *_head_line(c, i),
            "Self-check: " + i.get("checked", "not checked"),
            "Binding constraint: " + self._binding(),
            "Runner-up (best other mesh shape): " + self._runner_up(),
            *([self._against(against)] if against is not None else []),
            *_timing_notes(i), "",
            f"{'#':>3s}  {'candidate':50s} {'step ms':>9s} {'measured':>9s} "
            f"{'memory':>10s} {'comm':>10s}  rejected"]
        shown = [x for x in self.candidates if x.estimate is not None][:top]
        shown += [x for x in self.candidates if x.estimate is None][:4]
        for k, x in enumerate(shown):
            est = x.estimate
            measured = getattr(x, "measured_step_time_s", None)
            lines.append(
                f"{k:3d}  {x.label:50s} "
                f"{_ms(est.step_time_s if est else None)} {_ms(measured)} "
                f"{_gb(est.total_memory) if est else '-':>10s} "
                f"{_gb(est.communication_bytes_per_device) if est else '-':>10s}"
                f"  {x.rejected or ''}")
        return "\n".join(lines)

    def _binding(self):
        c = self._chosen
        faster = [x for x in self.candidates if x.estimate is not None
                  and (x.rejected or "").startswith("does not fit")
                  and x.estimate.step_time_s < c.estimate.step_time_s]
        if faster:
            best = min(faster, key=lambda x: x.estimate.step_time_s)
            return (f"memory: {len(faster)} faster candidate(s) do not fit in "
                    f"{_gb(self.info['memory_limit'])}; the fastest, "
                    f"{best.label}, would take "
                    f"{best.estimate.step_time_s * 1e3:.3g} ms but needs "
                    f"{_gb(best.estimate.total_memory)}.")
        return "none: the fastest candidate fits in memory."

    def _runner_up(self):
        c = self._chosen
        rest = [x for x in self.candidates if x.rejected is None
                and x is not c and x.axes != c.axes]
        if not rest:
            return "none (no other mesh shape fits)."
        r = rest[0]
        a, b = c.estimate.time_s, r.estimate.time_s
        worst = max(b, key=lambda k: b[k] - a.get(k, 0.0))
        slower = (r.estimate.step_time_s / c.estimate.step_time_s - 1) * 100
        why = (f"its {worst} time is {b[worst] * 1e3:.3g} ms vs "
               f"{a[worst] * 1e3:.3g} ms")
        if getattr(c, "measured_step_time_s", None) and getattr(
                r, "measured_step_time_s", None):
            why += (f"; measured {r.measured_step_time_s * 1e3:.3g} ms vs "
                    f"{c.measured_step_time_s * 1e3:.3g} ms")
        return f"{r.label}, predicted {slower:.1f}% slower: {why}."

    def compare(self, reference):
        """{term: reference seconds − chosen seconds} over the step time's
        breakdown (`Estimate.breakdown`: compute, memory_bound, recompute,
        model, pipe, data, bubble, update, ...), the largest difference in
        size first: the first term is the one that makes the difference.

        >>> ref = tfpar.estimate(build, 512, cluster=cluster,
        ...                      axes={"data": 32}, recompute="full")
        >>> next(iter(plan.compare(ref)))      # e.g. "compute"
        """
        if not isinstance(reference, cost_lib.Estimate):
            raise TypeError(
                "Plan.compare(reference) / explain(against=) needs an "
                "Estimate, e.g. tfpar.estimate(model, batch, cluster=..., "
                f"axes=...). Received: {type(reference).__name__}")
        cluster = self.info.get("cluster", {})
        if cluster.get("hardware") is None:
            raise ValueError(
                "Plan.compare(reference) / explain(against=) compares with "
                "tfpar.estimate's roofline, which costs this plan only on a "
                "tfpar.Cluster.preset(...) cluster; this plan was made on a "
                "described cluster (no hardware preset: "
                f"{_devices(cluster)}, device_flops="
                f"{cluster.get('device_flops'):.3g}), costed by another "
                "model. Plan again with cluster=tfpar.Cluster.preset(name, "
                "num_hosts=...) to compare.")
        mine, theirs = self.estimate.breakdown, reference.breakdown
        terms = list(mine) + [k for k in theirs if k not in mine]
        diff = {k: theirs.get(k, 0.0) - mine.get(k, 0.0) for k in terms}
        return dict(sorted(diff.items(), key=lambda kv: -abs(kv[1])))

    def _against(self, reference):
        """explain()'s line comparing the chosen plan with `reference`."""
        diff = self.compare(reference)
        chosen, other = self.estimate.step_time_s, reference.step_time_s
        slower = other / chosen - 1
        head = (f"Against the given configuration: predicted "
                f"{other * 1e3:.4g} ms per step, {abs(slower) * 100:.1f}% "
                f"{'slower' if slower >= 0 else 'faster'} than the chosen "
                f"plan's {chosen * 1e3:.4g} ms")
        term, delta = next(iter(diff.items()))
        if abs(delta) <= 1e-9 * max(chosen, other):
            return head + "; no term of the step differs."
        mine = self.estimate.breakdown.get(term, 0.0)
        return (head + f"; the term that makes the difference: {term} "
                f"({(mine + delta) * 1e3:.4g} ms vs {mine * 1e3:.4g} ms); "
                "by term (given − chosen, ms): " + ", ".join(
                    f"{k} {v * 1e3:+.3g}" for k, v in diff.items() if v)
                + ".")

    def mesh(self):
        """The `tfpar.Mesh` of this plan on this machine's devices."""
        return mesh_lib.Mesh(self.axes)

    def strategy(self):
        """The `ParallelStrategy` for this plan (the same one every call);
        for a plan of a builder, made with the plan's rules."""
        if self._strategy is None:
            need = int(np.prod(list(self.axes.values())))
            have = len(mesh_lib.default_devices())
            if need != have:
                raise ValueError(
                    f"This plan is for {need} devices ({self.axes}) but this "
                    f"machine has {have}. Plan with cluster=None "
                    "(tfpar.Cluster.local()) to run here.")
            # A plan of a builder (`tfpar.plan(builder)`): its rules name
            # the paths the builder's next build has, so the strategy
            # creates every split weight already split (no device ever
            # holds it whole; a pipeline's wait on the host, laid out).
            rules = self.rules if self.info.get("rules_at_creation") else None
            self._strategy = ParallelStrategy(
                self.mesh(), rules=rules, fsdp=self.fsdp,
                expert_axis=self.expert_axis or "expert")
        return self._strategy

    def apply(self, model):
        """Lays out `model` (built inside `plan.strategy().scope()`) by this
        plan: recomputation, the model-axis rules (auto_rules on `model`,
        checked against the plan's), and a `tfpar.PipelineModel` with the
        plan's stages and micro-batches when pipe > 1. Call it before
        compile; returns the model to compile."""
        strategy = self.strategy()
        weights = model.weights
        if not weights or not all(strategy.extended.registry.owns(w) for w in weights):
            raise ValueError(
                f"Plan.apply needs model {model.name!r} built inside "
                "plan.strategy().scope() (its weights are not on the plan's "
                "mesh). Build it there, then call plan.apply(model).")
        layers = split.model_graph(model)[1]
        if self.recompute:
            recompute.set_recompute(model, self.recompute)
        if self.expert_axis:
            # The model axis' rules and keras-hub's banks' (a
            # tfpar.layers.MixtureOfExperts lays its banks out itself: no
            # rule, and no empty relayout that would gather them back).
            rules = auto_rules(model, mesh=strategy.mesh,
                               expert_axis=self.expert_axis,
                               sequence_parallel=self.sequence_parallel,
                               vocab_parallel=self.vocab_parallel)
            if len(rules):
                strategy.apply_rules(model, rules)
        elif "model" in self.axes:
            rules = auto_rules(model, mesh=strategy.mesh,
                               sequence_parallel=self.sequence_parallel,
                               vocab_parallel=self.vocab_parallel)
            planned = [type(s).__name__ for _, s in self.rules.items()]
            if [type(s).__name__ for _, s in rules.items()] != planned:
                raise ValueError(
                    f"Plan.apply: auto_rules on model {model.name!r} gives "
                    f"{len(rules)} rules, but the plan was made for "
                    f"{len(planned)}: {self.rules}. Apply the plan to the "
                    "model it was planned for.")
            strategy.apply_rules(model, rules)
        if "pipe" in self.axes:
            if max(self._stage_starts) >= len(layers):
                raise ValueError(
                    f"Plan.apply: model {model.name!r} has {len(layers)} "
                    f"layers, fewer than the plan's stage cut needs "
                    f"({self.stage_boundaries}).")
            boundaries = [layers[i].name for i in self._stage_starts[1:]]
            model = PipelineModel(model, self.num_microbatches,
                                  schedule=self.schedule,
                                  stage_boundaries=boundaries,
                                  virtual_stages=self.virtual_stages)
        return model

    def to_dict(self):
        return {
            "chosen": self._chosen.to_dict(),
            "rules": [[p, type(s).__name__, getattr(s, "axis", None),
                       getattr(s, "sequence_parallel", False)]
                      for p, s in self.rules.items()],
            "stage_starts": self._stage_starts, "info": self.info,
            "candidates": [c.to_dict() for c in self.candidates]}

    def save(self, path):
        """Writes the plan (choices, estimates, candidates) as JSON."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1, default=float)

    @classmethod
    def load(cls, path):
        """The `Plan` saved at `path`."""
        with open(path) as f:
            d = json.load(f)
        rules = {}
        for pattern, name, axis, sp in d["rules"]:
            style = _STYLES[name]
            if name == "Replicated":
                rules[pattern] = style()
            elif name in ("SequenceParallel", "VocabParallel"):
                rules[pattern] = style(axis)
            else:
                rules[pattern] = style(axis, sequence_parallel=sp)
        candidates = [search_lib.Candidate.from_dict(c) for c in d["candidates"]]
        chosen = search_lib.Candidate.from_dict(d["chosen"])
        for c in candidates:  # the chosen one is the first equal candidate
            if c.to_dict() == chosen.to_dict():
                chosen = c
                break
        # (A plan saved without its calibration's spread does not get
        # this process' one.)
        info = {"calibration": None, **d["info"]}
        return cls(chosen, candidates, layout_lib.LayoutRules(rules),
                   d["stage_starts"], info)

    def __repr__(self):
        return (f"<Plan {self._chosen.label}: "
                f"{self.estimate.step_time_s * 1e3:.3g} ms/step, "
                f"{_gb(self.estimate.total_memory)}/device>")


def _devices(cluster):
    return (f"{cluster['num_hosts']} host(s) × {cluster['devices_per_host']} "
            f"devices")


def _ms(seconds):
    """A table cell in ms, or "-" (not costed, not timed)."""
    return f"{seconds * 1e3:9.3g}" if seconds else f"{'-':>9s}"


def _timing_notes(info):
    """What the "measured" column shows, and the calibration's spread
    when the predictions are timed on this (shared, perhaps loaded) host:
    another calibration moves them by as much or more."""
    timed = info.get("measured", 0)
    notes = [f"measured: the {timed} best candidates timed here "
             "(tfpar.plan(measure=k)); \"-\": not timed." if timed else
             "measured: \"-\", not timed (tfpar.plan(measure=k) times the "
             "k best on this machine's devices)."]
    spread = info.get("calibration")
    if spread:
        notes.append(
            f"Calibration spread ±{spread['spread'] * 100:.0f}% over "
            f"{spread['timings']} timings (host load {spread['load']:.1f} on "
            f"{spread['cores']} cores): predictions on a shared host come "
            "from micro-benchmarks timed once per process, and another "
            "process, at another load, can predict a candidate that much "
            "(or more) faster or slower.")
    return notes


def _split_axes_lines(estimate):
    """explain()'s lines on the chosen plan's expert or context axis."""
    facts = estimate.split_axes or {}
    lines = []
    if "expert" in facts:
        x = facts["expert"]
        where = ("the data axis (GShard's placement: each device routes its "
                 "own tokens)" if x["axis"] == "data" else
                 "a separate expert axis (its devices hold the same tokens)")
        cf = ("dropless" if x["capacity_factor"] is None
              else f"capacity factor {x['capacity_factor']:g}")
        lines.append(
            f"Expert axis: {x['experts']} experts (top {x['top_k']}, {cf}) "
            f"split {x['size']} ways over {where}: expert banks "
            f"{_gb(x['bank_bytes'])} per device (whole "
            f"{_gb(x['bank_bytes_whole'])}), token exchanges "
            f"{_gb(x['exchange_bytes'])} per step and device.")
    if "context" in facts:
        x = facts["context"]
        lines.append(
            f"Context axis: the sequence of {x['sequence']} split "
            f"{x['size']} ways: saved activations "
            f"{_gb(x['activation_bytes'])} per device (unsplit "
            f"{_gb(x['activation_bytes_whole'])}), key/value gathers "
            f"{_gb(x['gather_bytes'])} per step and device.")
    return lines


def _head_line(candidate, info):
    """explain()'s line on the output head of a model with a vocabulary
    (`info["vocabulary"]`): split over it, or whole and why."""
    vocab = info.get("vocabulary")
    t = candidate.axes.get("model", 1)
    if not vocab:
        return []
    if t == 1:
        return [f"Output head: whole (no model axis), logits over the "
                f"vocabulary of {vocab} on every device."]
    if candidate.vocab_parallel:
        return [f"Output head: vocabulary-parallel (VocabParallel): each "
                f"device of model={t} computes {vocab // t} of the "
                f"{vocab} logits, and the estimate costs that."]
    why = (f"model={t} does not divide the vocabulary" if vocab % t else
           "sequence parallelism (auto_rules does not combine it with "
           "vocab_parallel)" if candidate.sequence_parallel else
           "a context axis (kept whole there for now: some model x "
           "context steps do not compile on DTensor 2.21, whatever the "
           "head)" if candidate.axes.get("context", 1) > 1
           else "auto_rules cannot split it over the vocabulary")
    return [f"Output head: whole on every device of model={t} (its {vocab} "
            f"logits computed whole, and costed whole): {why}."]


def _parts(e):
    return ", ".join(f"{k} {v * 1e3:.3g}" for k, v in e.time_s.items() if v)
