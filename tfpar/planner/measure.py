"""Timing candidates on this machine's devices (`tfpar.plan(measure=k)`,
`benchmarks/planner.py`), and checking that one trains here
(`first_step_error`: `tfpar.plan`'s self-check of its choice).

Each candidate's model is built under its strategy (from the builder, or
rebuilt from a built model's config: same layers, shared as they were,
fresh weights), laid out by the candidate, compiled with the plan's optimizer
and a mean-squared-error loss on random data of the model's input and
output shapes, and warmed up (traced and compiled) once. The built
candidates are then timed round after round (`interleaved`): each round
runs every candidate's `steps` steps, in a shuffled order, and keeps the
fastest; a candidate's time is the median over rounds. On a host whose
load changes (other jobs), a round's load falls on all candidates alike,
where one candidate after the other measures the load as much as the
plan.
"""

import re
import time

import keras
import numpy as np

from tfpar.auto_plan import auto_rules
from tfpar.layout import LayoutRules
from tfpar.planner.profile import build_without_weights
from tfpar.planner.result import Plan

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RAISED = re.compile(r"[A-Za-z_.]*(Error|Exception): ")


def synthetic_batch(model, batch, seed=0, sequence_length=None):
    """Random (x, y) for `model`'s inputs and outputs: floats N(0, 1),
    integer inputs zeros (valid token ids), boolean ones True (padding
    masks); unknown dimensions besides the batch `sequence_length` long."""
    rng = np.random.default_rng(seed)

    def make(tensor):
        shape = (batch,) + tuple(sequence_length if d is None else d
                                 for d in tensor.shape[1:])
        if "int" in str(tensor.dtype):
            return np.zeros(shape, str(tensor.dtype))
        if "bool" in str(tensor.dtype):
            return np.ones(shape, bool)
        return rng.standard_normal(shape).astype("float32")

    return (keras.tree.map_structure(make, model.input),
            keras.tree.map_structure(make, model.output))


def candidate_plan(candidate, source, global_batch_size, optimizer="adam"):
    """A `Plan` holding just `candidate` (for timing or applying it)."""
    shapes = _shapes(source)
    t = candidate.axes["model"]
    rules = (auto_rules(shapes, axis_size=t,
                        sequence_parallel=candidate.sequence_parallel,
                        vocab_parallel=candidate.vocab_parallel)
             if t > 1 else LayoutRules({}))
    starts = candidate.stage_starts or [0]
    return Plan(candidate, [candidate], rules, starts,
                info={"model": shapes.name,
                      "global_batch_size": global_batch_size,
                      "optimizer": str(optimizer)})


def _shapes(source):
    """`source` itself, or the model it builds without weights."""
    return (source if isinstance(source, keras.Model)
            else build_without_weights(source))


def build_and_apply(plan, source):
    """The model from `source` (a builder or a built model) under
    `plan.strategy()`, laid out by `plan`."""
    with plan.strategy().scope():
        model = (_uncompiled_clone(source)
                 if isinstance(source, keras.Model) else source())
        return plan.apply(model)


def _uncompiled_clone(model):
    """The same model with fresh weights (`_same_model`), not compiled:
    Keras compiles the clone of a compiled model (a keras-hub task
    compiles in its constructor) and builds its optimizer, after which its
    weights can no longer be laid out (`apply_rules`)."""
    clone = _same_model(model)
    clone.optimizer, clone.compiled = None, False
    return clone


def _same_model(model):
    """`type(model).from_config(model.get_config())`, which keeps layers
    shared between calls, or where that fails `keras.models.clone_model`;
    an error if the copy's weights are not the model's (by shape, in
    order). `clone_model` of a keras-hub task is a plain Functional whose
    nested backbone is cloned apart from the task's own calls: GPT-2's
    tied token embedding came back untied (37 weights for 36, the head a
    second table), so the planner's self-check trained another model and
    refused its plans."""
    try:
        clone = type(model).from_config(model.get_config())
    except Exception:  # noqa: BLE001 (no config: Keras' cloning instead)
        clone = keras.models.clone_model(model)
    shapes = [tuple(w.shape) for w in model.weights]
    if [tuple(w.shape) for w in clone.weights] != shapes:
        raise ValueError(
            f"tfpar.plan could not rebuild model {model.name!r} with the "
            f"same weights to check a plan on this machine (its copy has "
            f"{len(clone.weights)} weights, the model {len(shapes)}). Pass "
            "a zero-argument builder of the model instead (as "
            "`tfpar.plan(lambda: build_model(), ...)`).")
    return clone


def build_candidate(candidate, source, global_batch_size, optimizer="adam"):
    """(model, plan): `candidate` built from `source`, laid out and
    compiled, not yet run."""
    plan = candidate_plan(candidate, source, global_batch_size, optimizer)
    model = build_and_apply(plan, source)
    with plan.strategy().scope():
        model.compile(optimizer=optimizer, loss="mse", weighted_metrics=[])
    return model, plan


def built_here(source, plan):
    """The model from `source` built under `plan.strategy()` (not laid
    out), or the error that building it raised (nothing candidate-specific:
    no candidate can be checked then)."""
    try:
        with plan.strategy().scope():
            return (_uncompiled_clone(source)
                    if isinstance(source, keras.Model) else source()), None
    except Exception as error:  # noqa: BLE001 (reported, not raised)
        return None, _first_line(error)


def first_step_error(plan, model, global_batch_size, optimizer="adam",
                     sequence_length=None):
    """None when `model` (built under `plan.strategy()`, `built_here`),
    laid out by `plan`, compiles and runs one training step on synthetic
    data (`synthetic_batch`) here; else why not (the error's type and
    first line): DTensor compiles a step's program the first time it
    runs."""
    x, y = synthetic_batch(model, global_batch_size,
                           sequence_length=sequence_length)
    try:
        with plan.strategy().scope():
            model = plan.apply(model)
            # No metric: a keras-hub task's default weighted accuracy
            # compares integer targets, not the synthetic float ones.
            model.compile(optimizer=_fresh(optimizer), loss="mse",
                          weighted_metrics=[])
        model.train_on_batch(x, y)
    except Exception as error:  # noqa: BLE001 (the reason is the result)
        return _first_line(error)
    return None


def _fresh(optimizer):
    """A new optimizer like `optimizer` (a name, or an instance whose
    configuration is copied: an instance serves one model)."""
    if isinstance(optimizer, str):
        return optimizer
    return type(optimizer).from_config(optimizer.get_config())


def _first_line(error):
    """The error's type and first line that says what failed, at most 300
    characters: colour codes and Keras' "Exception encountered when
    calling ..." header skipped; for an error raised in a traced function
    ("in user code:", then its stack) the original error's line."""
    lines = [_ANSI.sub("", line).strip() for line in str(error).splitlines()]
    lines = [line for line in lines if line]
    kind = f"{type(error).__name__}: "
    if lines and lines[0] == "in user code:":
        raised = [k for k, line in enumerate(lines) if _RAISED.match(line)]
        if raised:
            kind = _RAISED.match(lines[raised[-1]])[0]
            lines = [lines[raised[-1]][len(kind):]] + lines[raised[-1] + 1:]
    lines = [line for line in lines
             if not line.startswith("Exception encountered")]
    return f"{kind}{(lines or [''])[0][:300]}"


def interleaved(steppers, rounds=3, steps=2, seed=0):
    """({key: [wall seconds per round]}, {key: [CPU seconds per round]}) of
    `steppers` ({key: a function running one training step}): each round
    runs every stepper `steps` times, in a shuffled order, and keeps its
    fastest step by the wall clock and by this process' CPU time (all its
    threads: the work a step costs, which other jobs' load hardly
    changes, where it stretches the wall clock)."""
    rng = np.random.default_rng(seed)
    keys = list(steppers)
    wall, cpu = {key: [] for key in keys}, {key: [] for key in keys}
    for _ in range(rounds):
        for j in rng.permutation(len(keys)):
            fastest, least = float("inf"), float("inf")
            for _ in range(steps):
                start, used = time.perf_counter(), time.process_time()
                steppers[keys[j]]()
                fastest = min(fastest, time.perf_counter() - start)
                least = min(least, time.process_time() - used)
            wall[keys[j]].append(fastest)
            cpu[keys[j]].append(least)
    return wall, cpu


def time_candidates(candidates, source, global_batch_size, optimizer="adam",
                    rounds=3, steps=2, warmup=2):
    """Median over `rounds` interleaved rounds of each candidate's fastest of
    `steps` steps (seconds), after building all and `warmup` steps each."""
    x, y = synthetic_batch(_shapes(source), global_batch_size)
    steppers = {}
    for i, candidate in enumerate(candidates):
        model, _ = build_candidate(candidate, source, global_batch_size,
                                   optimizer)
        for _ in range(warmup):
            model.train_on_batch(x, y)
        steppers[i] = (lambda m=model: m.train_on_batch(x, y))
    times, _ = interleaved(steppers, rounds=rounds, steps=steps)
    return [float(np.median(times[i])) for i in range(len(candidates))]
