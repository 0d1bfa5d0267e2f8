"""`tfpar.plan`: the search for an automatic parallel plan, returning a
`Plan` (`tfpar/planner/result.py`, whose example applies one).

Example (8 virtual CPUs):

>>> plan = tfpar.plan(build_model, global_batch_size=64,
...                   memory_per_device=2e6)
>>> plan.axes        # e.g. {"data": 2, "model": 4}
>>> plan.checked     # "passed: one training step compiled and ran ..."
"""

import math

import keras
import numpy as np

from tfpar import layout as layout_lib
from tfpar.planner import measure as measure_lib
from tfpar.planner import optimizers
from tfpar.planner import profile as profile_lib
from tfpar.planner import search as search_lib
from tfpar.planner import split_axes
from tfpar.planner import transformer as transformer_lib
from tfpar.planner.cluster import Cluster
from tfpar.weightless import build_without_weights, names_given_back
from tfpar.planner.result import Plan
from tfpar.planner.search import format_bytes as _gb


# The most candidates the self-check builds and runs before giving up, and
# the most of one mesh shape (its other candidates are then skipped).
_MAX_CHECKS = 4
_MAX_PER_MESH = 2


def plan(model, global_batch_size, *, cluster=None, memory_per_device=None,
         optimizer="adam", measure=0, sequence_length=None, check=True):
    """Chooses data × pipe × model, layouts, micro-batches, fsdp and
    recomputation for training `model` on `cluster`; for a
    mixture-of-experts model also an expert axis (or the experts over the
    data axis), for a transformer also a context axis
    (`tfpar/planner/split_axes.py`).

    Args:
        model: a built Keras model (Sequential or functional, keras-hub
            models included), or a zero-argument function that builds one;
            a function is called inside `keras.StatelessScope` without
            initialising any weight, so models far larger than this host's
            memory can be planned; its layer names are given back, and
            `plan.strategy()` is then made with the plan's rules, so that
            the function run again in its scope (`from_preset` of a
            pretrained model included) creates every split weight split.
        global_batch_size: samples per training step (all devices).
        cluster: a `tfpar.Cluster`; default `Cluster.local()`.
        memory_per_device: bytes a device may use (default: the cluster's
            `device_memory`).
        optimizer: name or Keras optimizer (its slots count as memory;
            the sums its update makes of a looked-up table's sparse
            gradient as data-axis reductions).
        measure: time the `measure` best candidates on this machine's
            devices and choose the fastest measured (all built first,
            then timed in 3 interleaved rounds of 2 steps each, medians:
            `tfpar.planner.measure.time_candidates`).
        sequence_length: the length of dimensions the model leaves unknown
            besides the batch (keras-hub models), for costing.
        check: on this process's devices (`Cluster.local()`, the
            default cluster), build the chosen candidate and run one
            training step on synthetic data; if it fails (e.g. DTensor
            cannot compile it), reject it with the reason (shown in
            `explain()`) and check the next best (up to 4, at most 2 of
            one mesh shape). The model is built with its weights for
            this. On a described cluster the plan is "not checked"
            (`Plan.checked`). False: no check.

    Returns:
        A `Plan`. Raises ValueError when no candidate fits (with the
        smallest memory any candidate needs and what would help), for a
        `global_batch_size` no plan can use, and for a model it cannot
        analyse.
    """
    kwargs = dict(cluster=cluster, memory_per_device=memory_per_device,
                  optimizer=optimizer, measure=measure,
                  sequence_length=sequence_length, check=check)
    if isinstance(model, keras.Model) or not callable(model):
        return _planned(model, global_batch_size, **kwargs)
    # A builder: the check's builds give their layer names back too, so the
    # user's next build has the paths of the plan's rules, and the plan's
    # strategy creates every split weight split (`Plan.strategy`).
    with names_given_back():
        chosen = _planned(model, global_batch_size, **kwargs)
    chosen.info["rules_at_creation"] = True
    return chosen


def _planned(model, global_batch_size, *, cluster, memory_per_device,
             optimizer, measure, sequence_length, check):
    """`plan`'s search (see there)."""
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
    slots = optimizers.optimizer_slots(optimizer)
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
        profile, model, int(global_batch_size), cluster, limit, slots,
        optimizers.sparse_gradient_sums(optimizer))
    candidates = search_lib.ranked(candidates + split_axes.candidates(
        profile, layouts, int(global_batch_size), cluster, limit, slots))
    feasible = [c for c in candidates if c.rejected is None]
    if not feasible:
        _raise_nothing_fits(profile, candidates, global_batch_size, limit,
                            cluster)
    source = build if build is not None else model
    if measure:
        candidates = _measured_first(candidates, feasible[:measure], source,
                                     int(global_batch_size), optimizer)
    chosen, checked = _checked_choice(
        candidates, source, layouts, cluster, check,
        (int(global_batch_size), optimizer, sequence_length))
    return Plan(chosen, candidates, _rules(chosen, layouts),
                chosen.stage_starts or [0],
                info={"model": profile.name, "num_params": profile.num_params,
                      "forward_flops_per_sample": profile.total_flops,
                      "global_batch_size": int(global_batch_size),
                      "memory_limit": limit, "optimizer": str(optimizer),
                      "cluster": cluster.to_dict(), "search_s": seconds,
                      "measured": int(measure), "checked": checked,
                      "vocabulary": _vocabulary(profile)})


def _vocabulary(profile):
    """The vocabulary of a transformer's logits (what `Plan.explain` says
    of its head), or None (no attention, or no vocabulary head:
    `transformer.vocab_head`)."""
    model = transformer_lib.read(profile)
    return None if model is None or not model.lm_head else int(model.vocab)


def _measured_first(candidates, timed, source, batch, optimizer):
    """`candidates` with the `timed` ones first, fastest measured first
    (each `measured_step_time_s` set)."""
    times = measure_lib.time_candidates(timed, source, batch,
                                        optimizer=optimizer)
    for c, step_s in zip(timed, times):
        c.measured_step_time_s = step_s
    timed = sorted(timed, key=lambda c: c.measured_step_time_s)
    return timed + [c for c in candidates if c not in timed]


def _rules(candidate, layouts):
    """The candidate's model-axis rules: its layout's, with the head whole
    when the candidate keeps it whole (`Layout.whole_head`)."""
    t = candidate.axes["model"]
    if t == 1:
        return layout_lib.LayoutRules({})
    layout = layouts[t, candidate.sequence_parallel]
    if not candidate.vocab_parallel:
        layout = layout.whole_head()
    return layout.rules


def _checked_choice(candidates, source, layouts, cluster, check, step):
    """(the best candidate that trains here, what the check found). Each
    feasible candidate in rank order, up to `_MAX_CHECKS` and
    `_MAX_PER_MESH` of one mesh shape, is built from `source` and run one
    step (`measure_lib.first_step_error` with `step`: global batch size,
    optimizer, sequence length); one that fails is rejected with the
    reason. Unchecked (first feasible chosen) when `check` is off or the
    cluster is not `Cluster.local()`."""
    feasible = [c for c in candidates if c.rejected is None]
    if not check:
        return feasible[0], "not checked (check=False)"
    if not cluster.of_this_process:
        return feasible[0], (
            "not checked: planned for a described cluster, not this "
            "process's devices (tfpar.Cluster.local())")
    failures = []
    for candidate in feasible:
        if len(failures) == _MAX_CHECKS:
            break
        if sum(c.axes == candidate.axes for c in failures) == _MAX_PER_MESH:
            continue  # that mesh shape fails: try the next one
        trial = Plan(candidate, [candidate], _rules(candidate, layouts),
                     candidate.stage_starts or [0], info={})
        model, error = measure_lib.built_here(source, trial)
        if error is not None:  # the same for every candidate
            return candidate, ("not checked: building the model failed: "
                               f"{error}")
        error = measure_lib.first_step_error(trial, model, *step)
        if error is None:
            return candidate, (
                "passed: one training step compiled and ran on this "
                "machine's devices"
                + (f" after {len(failures)} candidate(s) failed"
                   if failures else ""))
        candidate.rejected = f"fails to train here: {error}"
        failures.append(candidate)
    raise ValueError(
        f"tfpar.plan: the {len(failures)} best candidates that fit all "
        "failed to train one step on this machine: "
        + "; ".join(f"{c.label}: {c.rejected}" for c in failures)
        + ". Pass check=False to get the plan anyway, or report this as a "
        "tfpar bug with the model.")


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
    if smallest.recompute != "full":
        helps.append("full recomputation" if smallest.recompute
                     else "recomputation")
    helps.append("a smaller global_batch_size (activations)")
    raise ValueError(
        f"No plan for model {profile.name!r} fits in memory_per_device="
        f"{_gb(limit)} on {cluster.num_devices} devices: the "
        f"smallest any of the {len(costed)} candidates needs is "
        f"{_gb(need)} per device ({smallest.label}: "
        + ", ".join(f"{k} {_gb(v)}"
                    for k, v in smallest.estimate.memory_per_device.items())
        + "). It would take " + ", or ".join(h for h in helps if h) + ".")
