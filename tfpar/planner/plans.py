"""`tfpar.plan`: the automatic parallel plan, and the `Plan` it returns.

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
import math

import keras
import numpy as np

from tfpar import _compat
from tfpar import layout as layout_lib
from tfpar import styles as tp
from tfpar.auto_plan import auto_rules
from tfpar.planner import cost as cost_lib
from tfpar.planner import profile as profile_lib
from tfpar.planner import search as search_lib
from tfpar.planner.cluster import Cluster
from tfpar.planner.search import format_bytes as _gb

_STYLES = {"ColumnParallel": tp.ColumnParallel, "RowParallel": tp.RowParallel,
           "Replicated": tp.Replicated, "SequenceParallel": tp.SequenceParallel}


def plan(model, global_batch_size, *, cluster=None, memory_per_device=None,
         optimizer="adam", measure=0, sequence_length=None):
    """Chooses data × pipe × model, layouts, micro-batches, fsdp and
    recomputation for training `model` on `cluster`.

    Args:
        model: a built Keras model (Sequential or functional, keras-hub
            models included), or a zero-argument function that builds one;
            a function is called inside `keras.StatelessScope` without
            initialising any weight, so models far larger than this host's
            memory can be planned.
        global_batch_size: samples per training step (all devices).
        cluster: a `tfpar.Cluster`; default `Cluster.local()`.
        memory_per_device: bytes a device may use (default: the cluster's
            `device_memory`).
        optimizer: name or Keras optimizer (its slots count as memory).
        measure: time the `measure` best candidates on this machine's
            devices and choose the fastest measured (all built first,
            then timed in 3 interleaved rounds of 2 steps each, medians:
            `tfpar.planner.measure.time_candidates`).
        sequence_length: the length of dimensions the model leaves unknown
            besides the batch (keras-hub models), for costing.

    Returns:
        A `Plan`. Raises ValueError when no candidate fits (with the
        smallest memory any candidate needs and what would help), for a
        `global_batch_size` no plan can use, and for a model it cannot
        analyse.
    """
    if (isinstance(global_batch_size, bool)
            or not isinstance(global_batch_size, (int, np.integer))
            or global_batch_size < 1):
        raise ValueError(
            "tfpar.plan(global_batch_size) must be a positive integer (the "
            f"samples of one step over all devices). Received: "
            f"global_batch_size={global_batch_size!r}")
    if not isinstance(measure, (int, np.integer)) or measure < 0:
        raise ValueError(
            f"tfpar.plan(measure) must be an integer >= 0. Received: "
            f"measure={measure!r}")
    slots = cost_lib.optimizer_slots(optimizer)
    build = model if callable(model) and not isinstance(model, keras.Model) else None
    if build is not None:
        model = build_without_weights(build)
    profile = profile_lib.profile_model(model, sequence_length)
    if cluster is None:
        cluster = Cluster.local()
    if not isinstance(cluster, Cluster):
        raise TypeError(
            f"tfpar.plan(cluster) needs a tfpar.Cluster. Received: "
            f"{cluster!r} of type {type(cluster).__name__}")
    limit = float(memory_per_device if memory_per_device is not None
                  else cluster.device_memory)
    if not limit > 0:
        raise ValueError(
            "tfpar.plan(memory_per_device) must be a positive number of "
            f"bytes. Received: memory_per_device={memory_per_device!r}")
    candidates, seconds, layouts = search_lib.search(
        profile, model, int(global_batch_size), cluster, limit, slots)
    feasible = [c for c in candidates if c.rejected is None]
    if not feasible:
        _raise_nothing_fits(profile, candidates, global_batch_size, limit,
                            cluster)
    if measure:
        from tfpar.planner import measure as measure_lib  # noqa: PLC0415
        source = build if build is not None else model
        timed = measure_lib.time_candidates(
            feasible[:measure], source, int(global_batch_size),
            optimizer=optimizer)
        for c, seconds in zip(feasible[:measure], timed):
            c.measured_step_time_s = seconds
        feasible[:measure] = sorted(feasible[:measure],
                                    key=lambda c: c.measured_step_time_s)
        candidates = feasible[:measure] + [
            c for c in candidates if c not in feasible[:measure]]
    chosen = candidates[0]
    t = chosen.axes["model"]
    rules = (layouts[t, chosen.sequence_parallel].rules if t > 1
             else layout_lib.LayoutRules({}))
    return Plan(chosen, candidates, rules, chosen.stage_starts or [0],
                info={"model": profile.name, "num_params": profile.num_params,
                      "forward_flops_per_sample": profile.total_flops,
                      "global_batch_size": int(global_batch_size),
                      "memory_limit": limit, "optimizer": str(optimizer),
                      "cluster": cluster.to_dict(), "search_s": seconds,
                      "measured": int(measure)})


def build_without_weights(build):
    """Calls `build()` inside `keras.StatelessScope(initialize_variables=
    False)`: every weight gets its shape and dtype but no memory."""
    with keras.StatelessScope(initialize_variables=False):
        model = build()
    if not isinstance(model, keras.Model):
        raise TypeError(
            "tfpar.plan(model) as a function must return a Keras model. "
            f"Received: {build!r} returned {type(model).__name__}.")
    _compat.forget_uninitialized_variables(model.weights)
    return model


def _raise_nothing_fits(profile, candidates, batch, limit, cluster):
    costed = [c for c in candidates if c.estimate is not None]
    if not costed:
        reasons = sorted({c.rejected for c in candidates})
        raise ValueError(
            f"tfpar.plan found no usable plan for model {profile.name!r} with "
            f"global_batch_size={batch} on {cluster.num_devices} devices: "
            + "; ".join(reasons[:6]))
    smallest = min(costed, key=lambda c: c.estimate.total_memory)
    need = smallest.estimate.total_memory
    helps = [f"about {math.ceil(need / limit * cluster.num_devices)} devices "
             f"(now {cluster.num_devices})" if need > limit else None]
    if not smallest.fsdp:
        helps.append("fsdp (a data axis splitting weights and optimizer "
                     "state)")
    if not smallest.recompute:
        helps.append("recomputation")
    helps.append("a smaller global_batch_size (activations)")
    raise ValueError(
        f"No plan for model {profile.name!r} fits in memory_per_device="
        f"{_gb(limit)} on {cluster.num_devices} devices: the "
        f"smallest any of the {len(costed)} candidates needs is "
        f"{_gb(need)} per device ({smallest.label}: "
        + ", ".join(f"{k} {_gb(v)}"
                    for k, v in smallest.estimate.memory_per_device.items())
        + "). It would take " + ", or ".join(h for h in helps if h) + ".")


class Plan:
    """A chosen parallel plan with everything that was considered.

    Attributes:
        axes: ordered mesh axes of size > 1, e.g. {"data": 2, "pipe": 2,
            "model": 2} ({"data": 1} for one device).
        rules: `tfpar.LayoutRules` for the model axis (auto_rules' plan).
        fsdp, recompute, sequence_parallel: bools (sequence parallelism:
            the rules hold `SequenceParallel` norms).
        num_microbatches, schedule, stage_boundaries: the pipeline's
            (m = 1 and boundaries None without a pipe axis).
        estimate: the chosen candidate's `Estimate`.
        candidates: every `Candidate` considered, best first.
        info: model and search facts (parameters, FLOPs, search seconds).
    """

    def __init__(self, chosen, candidates, rules, stage_starts, info):
        self._chosen = chosen
        self.candidates = candidates
        self.rules = rules
        self._stage_starts = list(stage_starts)
        self.info = info
        self._strategy = None

    axes = property(lambda self: {k: v for k, v in self._chosen.axes.items()
                                  if v > 1} or {"data": 1})
    fsdp = property(lambda self: self._chosen.fsdp)
    recompute = property(lambda self: self._chosen.recompute)
    sequence_parallel = property(lambda self: self._chosen.sequence_parallel)
    num_microbatches = property(lambda self: self._chosen.num_microbatches)
    schedule = property(lambda self: self._chosen.schedule)
    stage_boundaries = property(lambda self: self._chosen.stage_boundaries)
    estimate = property(lambda self: self._chosen.estimate)

    def explain(self, top=12):
        """A readable table of the candidates, the binding constraint and
        why the runner-up lost."""
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
            "Binding constraint: " + self._binding(),
            "Runner-up (best other mesh shape): " + self._runner_up(), "",
            f"{'#':>3s}  {'candidate':38s} {'step ms':>9s} {'measured':>9s} "
            f"{'memory':>10s} {'comm':>10s}  rejected"]
        shown = [x for x in self.candidates if x.estimate is not None][:top]
        shown += [x for x in self.candidates if x.estimate is None][:4]
        for k, x in enumerate(shown):
            est = x.estimate
            measured = getattr(x, "measured_step_time_s", None)
            lines.append(
                f"{k:3d}  {x.label:38s} "
                f"{(est.step_time_s * 1e3 if est else float('nan')):9.3g} "
                f"{(measured * 1e3 if measured else float('nan')):9.3g} "
                f"{_gb(est.total_memory) if est else '-':>10s} "
                f"{_gb(est.communication_bytes_per_device) if est else '-':>10s}"
                f"  {x.rejected or ''}")
        return "\n".join(lines)

    def _binding(self):
        c = self._chosen
        faster = [x for x in self.candidates if x.estimate is not None
                  and x.rejected and x.estimate.step_time_s < c.estimate.step_time_s]
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

    def mesh(self):
        """The `tfpar.Mesh` of this plan on this machine's devices."""
        from tfpar.mesh import Mesh  # noqa: PLC0415
        return Mesh(self.axes)

    def strategy(self):
        """The `ParallelStrategy` for this plan (the same one every call)."""
        if self._strategy is None:
            from tfpar.strategy import ParallelStrategy  # noqa: PLC0415
            from tfpar import mesh as mesh_lib  # noqa: PLC0415
            need = int(np.prod(list(self.axes.values())))
            have = len(mesh_lib.default_devices())
            if need != have:
                raise ValueError(
                    f"This plan is for {need} devices ({self.axes}) but this "
                    f"machine has {have}. Plan with cluster=None "
                    "(tfpar.Cluster.local()) to run here.")
            self._strategy = ParallelStrategy(self.mesh(), fsdp=self.fsdp)
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
        from tfpar.pipeline import split  # noqa: PLC0415
        layers = split.model_graph(model)[1]
        if self.recompute:
            for layer in layers:  # Keras ops in the graph have no weights
                if getattr(layer, "trainable_weights", None):
                    _compat.set_remat_mode(layer, "full")
        if "model" in self.axes:
            rules = auto_rules(model, mesh=strategy.mesh,
                               sequence_parallel=self.sequence_parallel)
            planned = [type(s).__name__ for _, s in self.rules.items()]
            if [type(s).__name__ for _, s in rules.items()] != planned:
                raise ValueError(
                    f"Plan.apply: auto_rules on model {model.name!r} gives "
                    f"{len(rules)} rules, but the plan was made for "
                    f"{len(planned)}: {self.rules}. Apply the plan to the "
                    "model it was planned for.")
            strategy.apply_rules(model, rules)
        if "pipe" in self.axes:
            from tfpar.pipeline.model import PipelineModel  # noqa: PLC0415
            if max(self._stage_starts) >= len(layers):
                raise ValueError(
                    f"Plan.apply: model {model.name!r} has {len(layers)} "
                    f"layers, fewer than the plan's stage cut needs "
                    f"({self.stage_boundaries}).")
            boundaries = [layers[i].name for i in self._stage_starts[1:]]
            model = PipelineModel(model, self.num_microbatches,
                                  schedule=self.schedule,
                                  stage_boundaries=boundaries)
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
            elif name == "SequenceParallel":
                rules[pattern] = style(axis)
            else:
                rules[pattern] = style(axis, sequence_parallel=sp)
        candidates = [search_lib.Candidate.from_dict(c) for c in d["candidates"]]
        chosen = search_lib.Candidate.from_dict(d["chosen"])
        for c in candidates:  # the chosen one is the first equal candidate
            if c.to_dict() == chosen.to_dict():
                chosen = c
                break
        return cls(chosen, candidates, layout_lib.LayoutRules(rules),
                   d["stage_starts"], d["info"])

    def __repr__(self):
        return (f"<Plan {self._chosen.label}: "
                f"{self.estimate.step_time_s * 1e3:.3g} ms/step, "
                f"{_gb(self.estimate.total_memory)}/device>")


def _devices(cluster):
    return (f"{cluster['num_hosts']} host(s) × {cluster['devices_per_host']} "
            f"devices")


def _parts(e):
    return ", ".join(f"{k} {v * 1e3:.3g}" for k, v in e.time_s.items() if v)
