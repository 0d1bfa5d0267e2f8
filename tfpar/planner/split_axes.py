"""The expert and context axes in `tfpar.plan`'s search: the candidates
that split a mixture-of-experts model's expert banks, or a long
sequence, besides data × pipe × model.

Which candidates (for each of the search's layouts: with sequence
parallelism beside an expert axis only, as a context axis splits the
sequence itself, `ParallelDims`), without a pipe axis and with
one of every size p that divides the devices per model coordinate and
the transformer's blocks (each stage at least one cut point; the
search's min-max stage cut; 1F1B with the three largest micro-batch
counts m ≥ p):

- Expert axis, for a model with mixture-of-experts blocks (the planner
  reads them as `tfpar.estimate` does: a layer with integer
  `num_experts`, `top_k` and `intermediate_dim`, e.g.
  `tfpar.layers.MixtureOfExperts`, keras-hub's Mixtral, Qwen3-MoE and
  GPT-OSS blocks): a separate axis, data × expert × model with e dividing
  the experts (the devices of the expert axis hold the same tokens), and
  the banks over the data axis (`ParallelStrategy(expert_axis="data")`,
  GShard's placement) when the data axis divides the experts.
- Context axis, for a transformer whose sequence 2·c divides (the causal
  load balance's 2·c chunks, `tfpar.context_parallel.load_balance`):
  data × context × model. Rejected, naming the layer, when an attention
  layer is not one tfpar splits over the sequence
  (`context_keras_hub.unsplit_attention`: DTensor would run it whole).
- Both, for a mixture-of-experts model with such a sequence: the context
  axis c first, then either expert placement on the devices it leaves
  (data × expert × context × model with e·c dividing them, or the banks
  over the data axis of data × context × model when that axis divides
  the experts): long-sequence MoE training, where Megatron-Core
  combines expert and context parallelism too.

With a pipe axis and a context axis no fsdp (`_options`).

How they are costed: the step of the same configuration without the new
axis (data d', pipe p, model t, m micro-batches: the cost model every
other candidate gets) scaled by the roofline's ratio (`roofline.py`,
`tfpar.estimate`'s) of the step with the axis to the step without it,
and each kind of each stage's memory by the roofline's ratio of that
kind (banks split e ways, activations over c):

    step = step_base(d', p, t) · roofline(d', p, t, e or c)
                               / roofline(d', p, t)
    memory[stage][kind] = memory_base[stage][kind]
                          · roofline_mem[kind](with) / roofline_mem[kind](without)

so that on a preset cluster (whose base step is that roofline) it is
exactly `tfpar.estimate`'s step, and on `Cluster.local()` the measured
calibration's scale is kept (ratios, not differences: the two models'
absolute figures differ, their ratios are what the axis changes). The
time's breakdown is the base's, scaled; the axis' own terms are the
roofline's (`Estimate.split_axes`). The exchange bytes (expert), gather bytes
(context) and bank memory are in `Estimate.split_axes`, which
`Plan.explain()` prints.

>>> from tfpar.planner import split_axes
>>> split_axes.capacity_factor(profile)   # None: dropless
"""

import dataclasses

from tfpar import context_keras_hub
from tfpar.planner import cost as cost_lib
from tfpar.planner import estimator
from tfpar.planner import search as search_lib


def candidates(profile, layouts, batch, cluster, memory_limit, slots):
    """The expert and context `Candidate`s of a profiled model (`layouts`:
    `search.search`'s {(model size, sequence parallel): Layout}), each
    estimated, with and without a pipe axis; those over `memory_limit`
    and context axes over attention tfpar does not split marked rejected.
    [] for a model without attention (the roofline's transformer)."""
    found = []
    cf = capacity_factor(profile)
    unsplit = context_keras_hub.unsplit_attention(
        profile.layers_by_path.values())
    for (t, sp), layout in sorted(layouts.items()):
        model = layout.transformer
        if model is None:
            continue
        for p in _pipe_sizes(cluster.num_devices // t, len(profile.ops),
                             model.layers):
            stages, boundaries = search_lib.stage_cuts(profile, layout, p)
            for data, extra, expert_axis in _shapes(
                    model, cluster.num_devices // (t * p)):
                if sp and ("context" in extra or p > 1 and data == 1):
                    # One sequence split only (ParallelDims); in pipeline
                    # stages only beside a data axis (search's rejection).
                    continue
                axes = {"data": data, "pipe": p, "model": t, **extra}
                if "context" in extra and unsplit is not None:
                    found.append(search_lib.Candidate(
                        axes, False, None, 1, "1f1b", None,
                        rejected=f"layer {unsplit.path!r} ("
                                 f"{type(unsplit).__name__}) computes "
                                 "attention tfpar does not split over a "
                                 "context axis",
                        expert_axis=expert_axis))
                    continue
                if batch % data:
                    found.append(search_lib.Candidate(
                        axes, False, None, 1, "1f1b", None,
                        rejected=f"global_batch_size {batch} does not "
                                 f"split over data={data}",
                        expert_axis=expert_axis))
                    continue
                for m in _microbatch_counts(batch // data, p):
                    fsdp_ok = p == 1 or "context" not in extra
                    for fsdp, recompute in _options(layout, data, fsdp_ok):
                        c = search_lib.Candidate(
                            axes, fsdp, recompute, m, "1f1b", boundaries,
                            sequence_parallel=sp, expert_axis=expert_axis,
                            vocab_parallel=layout.vocab_parallel,
                            stage_starts=([int(i) for i in stages]
                                          if p > 1 else None))
                        c.estimate = _estimate(layout, c, stages, batch,
                                               cluster, slots, cf)
                        search_lib.reject_unfit(c, memory_limit)
                        found.append(c)
    return found


def _pipe_sizes(devices, cut_points, blocks):
    """Pipeline sizes p (1 first) that divide `devices` (per model
    coordinate) and the transformer's blocks (balanced stages), with at
    least one cut point per stage."""
    return [p for p in range(1, devices + 1)
            if devices % p == 0 and blocks % p == 0 and p <= cut_points]


def _microbatch_counts(per_replica, p):
    """The three largest of the search's micro-batch counts
    (`search.microbatch_counts`) that fill a pipeline of p stages (m ≥ p:
    fewer leave a 1F1B's stages idle for longer than a smaller pipe
    would), or the largest count when none does."""
    counts = search_lib.microbatch_counts(per_replica, p)
    return [m for m in counts if m >= p][-3:] or counts[-1:]


def capacity_factor(profile):
    """The capacity factor of the model's first mixture-of-experts layer
    (None: dropless, as keras-hub's blocks run under tfpar)."""
    for layer in profile.layers_by_path.values():
        if isinstance(getattr(layer, "num_experts", None), int):
            value = getattr(layer, "capacity_factor", None)
            return float(value) if isinstance(value, (int, float)) else None
    return None


def _shapes(model, devices):
    """(data size, {expert and/or context: size}, expert axis) of every
    split `devices` (per model and pipe coordinate) allows: a context axis
    c with 2·c | s (or none), and on the devices it leaves a separate
    expert axis e | E, the data axis when it divides E, or neither (a
    context axis alone)."""
    for c in _divisors(devices, first=1):
        if c > 1 and model.seq % (2 * c):
            continue
        rest, context = devices // c, ({"context": c} if c > 1 else {})
        if model.experts:
            for e in _divisors(rest, first=2):
                if model.experts % e == 0:
                    yield rest // e, {"expert": e, **context}, "expert"
            if model.experts % rest == 0 and rest > 1:
                yield rest, context, "data"
        if c > 1:
            yield rest, context, None


def _divisors(n, first):
    """The divisors of n from `first` up."""
    return [k for k in range(first, n + 1) if n % k == 0]


def _options(layout, data, fsdp=True):
    """(fsdp, recompute) choices: fsdp with a data axis (and `fsdp`: not
    beside a context axis in pipeline stages, which DTensor 2.21 does not
    compile: `tfpar.pipeline.runner.check_context_with_fsdp`); selective
    recomputation where there is attention."""
    recomputes = ((None, "selective", "full") if layout.attention_flops.any()
                  else (None, "full"))
    for fsdp in (False, True) if data > 1 and fsdp else (False,):
        for recompute in recomputes:
            yield fsdp, recompute


def _estimate(layout, candidate, stages, batch, cluster, slots, cf):
    """The candidate's `Estimate`: the base configuration's (its data,
    pipe and model axes alone; `stages`: its stage starts) scaled by the
    roofline (module docstring)."""
    d, p = candidate.axes["data"], candidate.axes["pipe"]
    base = cost_lib.estimate(
        layout, stages, d=d, p=p, m=candidate.num_microbatches,
        schedule="1f1b", fsdp=candidate.fsdp,
        recompute=candidate.recompute, batch=batch, cluster=cluster,
        slots=slots)
    with_axis = _roofline(layout.transformer, candidate, batch, cluster,
                          slots, cf, split=True)
    without = _roofline(layout.transformer, candidate, batch, cluster,
                        slots, cf, split=False)
    ratio = with_axis.step_time_s / without.step_time_s
    stages = [{k: _scaled(v, with_axis.memory_per_device.get(k, 0.0),
                          without.memory_per_device.get(k, 0.0))
               for k, v in stage.items()} for stage in base.memory_by_stage]
    memory = max(stages, key=lambda stage: sum(stage.values()))
    comm = dict(base.communication_bytes_by_axis)
    for axis in ("expert", "context"):
        comm[axis] = with_axis.communication_bytes_by_axis.get(axis, 0.0)
    return dataclasses.replace(
        base, step_time_s=base.step_time_s * ratio, memory_per_device=memory,
        memory_by_stage=cost_lib.ByStage(
            {k: [stage[k] for stage in stages] for k in memory}),
        time_s={k: v * ratio for k, v in base.time_s.items()},
        communication_bytes_by_axis=comm,
        communication_bytes_per_device=float(sum(comm.values())),
        split_axes=_facts(layout.transformer, candidate, with_axis, without,
                          cf))


def _scaled(base, with_axis, without):
    """`base` bytes scaled as the roofline's bytes of that kind change
    with the axis (with / without), or increased by them when the
    roofline has none without it."""
    return base * with_axis / without if without > 0 else base + with_axis


def _roofline(model, candidate, batch, cluster, slots, cf, split):
    """`tfpar.estimate`'s Estimate of the candidate (`split`) or of its
    base configuration, the data, pipe and model axes alone (not
    `split`)."""
    axes = {k: candidate.axes[k] for k in ("data", "pipe", "model")}
    if split:
        axes.update((k, v) for k, v in candidate.axes.items()
                    if k in ("expert", "context"))
    cfg = estimator.configuration(
        axes, batch, num_microbatches=candidate.num_microbatches,
        recompute=candidate.recompute, fsdp=candidate.fsdp,
        slots=slots, flash=cost_lib.flash_attention(), tf32=cost_lib.tf32(),
        layers=model.layers, capacity_factor=cf, transformer=model,
        expert_axis="data" if split and candidate.expert_axis == "data"
        else "expert", vocab_parallel=candidate.vocab_parallel,
        sequence_parallel=candidate.sequence_parallel)
    return estimator.estimate_transformer(model, cfg, batch, cluster)


def _facts(model, candidate, with_axis, without, cf):
    """{"expert": {...}, "context": {...}} (either or both): what
    `Plan.explain` says of each split axis (sizes, exchanged bytes per
    step and device, bank or activation memory with and without it)."""
    facts = {}
    if candidate.expert_axis:
        size = (candidate.axes["data"] if candidate.expert_axis == "data"
                else candidate.axes["expert"])
        whole = (model.layers * model.bank_params() * model.param_bytes
                 / candidate.axes["model"])
        facts["expert"] = {
            "axis": candidate.expert_axis, "size": size,
            "experts": model.experts, "top_k": model.top_k,
            "capacity_factor": cf,
            "exchange_bytes": with_axis.communication_bytes_by_axis["expert"],
            "bank_bytes": whole / size, "bank_bytes_whole": whole}
    if candidate.axes.get("context", 1) > 1:
        facts["context"] = {
            "size": candidate.axes["context"], "sequence": model.seq,
            "gather_bytes": with_axis.communication_bytes_by_axis["context"],
            "activation_bytes": with_axis.memory_per_device["activations"],
            "activation_bytes_whole":
                without.memory_per_device["activations"]}
    return facts
