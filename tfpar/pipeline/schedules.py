"""Pipeline-parallel schedules as plain data (no devices, no TensorFlow).

A pipeline cuts a model into `p` consecutive *stages* (one per device) and a
batch into `m` *micro-batches*. A schedule says, for every stage, in which
order it runs the forward ("F") and backward ("B") pass of each micro-batch.
Two classic schedules are provided, modelled on
`torch.distributed.pipelining` and Megatron-LM:

* GPipe (Huang et al., 2019): every stage runs all `m` forwards, then all `m`
  backwards. Simple, but stage `s` keeps the activations of all `m`
  micro-batches alive at once.
* 1F1B (PipeDream-Flush / Megatron-LM): each stage runs a few forwards to
  fill the pipe (warm-up), then alternates one forward and one backward
  (steady state), then drains the remaining backwards (cool-down). Stage `s`
  keeps at most `p - s` micro-batches alive, independent of `m`.

With equal forward and backward costs both have the same idle ("bubble")
fraction, `(p - 1) / (m + p - 1)`: 1F1B saves memory, not time.

Zero-bubble schedules (Qi et al., 2024, arXiv 2401.10241) split every
backward into "B", the gradient of the stage's inputs (which the previous
stage waits for), and "W", the gradient of its weights (which nobody waits
for), and move W's into the idle slots:

* ZB-H1: 1F1B's forwards and B's, each W delayed just enough to fill the
  cool-down; every stage holds at most `p` micro-batches (1F1B's peak,
  reached on stage 0). Idle time per stage `(p - 1)(T_F + T_B - T_W)`
  instead of 1F1B's `(p - 1)(T_F + T_B + T_W)`: a third for equal costs.
  Needs `m >= p`.
* ZB-H2: `p - 1` more warm-up forwards (stage `s` runs `2(p - s - 1)`),
  at most `2p - 1` micro-batches alive: no stage ever idles between its
  first and its last action (a parallelogram). The paper's zero bubble
  counts exactly that: it starts the next step on stage 0 while the last
  stage finishes, "bypassing optimizer synchronisation". With a
  synchronised optimizer step (as `PipelineModel` runs) the fill time
  `(p - 1) T_F` stays, the minimum any schedule has. Needs `m >= 2p - 1`.

* ZB-V (the paper's section 6; PyTorch's `ScheduleZBVZeroBubble`): two
  model chunks per stage in a V: stage `s` holds part `s` and part
  `2p - 1 - s`, so the first and last parts share stage 0 and the turn of
  the V needs no transfer. At most `2p` chunk-micro-batches alive per
  stage (each chunk half a stage: 1F1B's activation memory); with T_F =
  T_B = T_W no stage idles inside its own span, and only the fill of
  `p - 1` chunk forwards, `(p - 1) / (6m + p - 1)`, remains with a
  synchronised optimizer step. Needs `m >= 2p - 1`.

The non-zero-bubble schedules also come *interleaved*
(`virtual_stages=v > 1`, Narayanan et al., 2021, Megatron-LM's virtual
pipeline stages): the model is cut into `v * p` chunks and stage `s` holds
chunks `s, s + p, s + 2p, ...`, so a micro-batch crosses every stage `v` times, each time doing
`1/v` of the stage's work. The pipe fills and drains `v` times faster:
interleaved 1F1B's bubble is `(p - 1) / (v * m + p - 1)`, at the price of
`v` times more stage-to-stage transfers. Interleaved 1F1B needs `m` to be a
multiple of `p` (Megatron-LM's rule: micro-batches go through the chunks in
groups of `p`).

Example:

>>> from tfpar.pipeline import one_f_one_b
>>> schedule = one_f_one_b(num_stages=2, num_microbatches=3)
>>> [str(a) for a in schedule.actions[0]]
['0F0', '0F1', '0B0', '0F2', '0B1', '0B2']
>>> schedule.peak_in_flight(0), schedule.peak_in_flight(1)
(2, 1)
>>> timeline = schedule.simulate(forward_time=1.0, backward_time=1.0)
>>> bubble_fraction(timeline) == (2 - 1) / (3 + 2 - 1)
True
"""

import dataclasses
import operator
from typing import NamedTuple

__all__ = [
    "Action",
    "Schedule",
    "TimelineEntry",
    "SCHEDULE_NAMES",
    "bubble_fraction",
    "get_schedule",
    "gpipe",
    "one_f_one_b",
    "theoretical_bubble_fraction",
    "zero_bubble",
    "zero_bubble_v",
]

FORWARD = "F"
BACKWARD = "B"
WEIGHT = "W"
ZERO_BUBBLE = ("zb-h1", "zb-h2", "zbv")
# Where model part k runs: "loop" puts chunk c of stage s at part c·p + s
# (interleaving), "v" chunk 0 at part s and chunk 1 at part 2p - 1 - s.
PLACEMENTS = ("loop", "v")


@dataclasses.dataclass(frozen=True)
class Action:
    """One unit of pipeline work: a forward or backward of one micro-batch.

    Args:
        stage: Pipeline stage (device) index, 0 is the first stage.
        kind: "F" for the forward pass, "B" for the backward pass (in a
            zero-bubble schedule only its input gradient), "W" for the
            weight gradient of a backward that a zero-bubble schedule split.
        microbatch: Micro-batch index, 0-based.
        chunk: Which of the stage's model chunks runs (interleaved
            schedules; 0 otherwise). With `p` stages, chunk `c` of stage `s`
            is model part `c * p + s` (`Schedule.part`).

    Example:

    >>> str(Action(stage=1, kind="F", microbatch=0))
    '1F0'
    >>> str(Action(0, "B", 3, chunk=1))
    '0B3.1'
    """

    stage: int
    kind: str
    microbatch: int
    chunk: int = 0

    def __post_init__(self):
        if self.kind not in (FORWARD, BACKWARD, WEIGHT):
            raise ValueError(
                "Action kind must be 'F' or 'B' (forward, backward), or 'W' "
                "(the weight-gradient half of a backward that a zero-bubble "
                f"schedule splits). Received: kind={self.kind!r}")
        for field in ("stage", "microbatch", "chunk"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"Action {field} must be an integer >= 0. "
                    f"Received: {field}={value!r}")

    def __str__(self):
        suffix = f".{self.chunk}" if self.chunk else ""
        return f"{self.stage}{self.kind}{self.microbatch}{suffix}"


class TimelineEntry(NamedTuple):
    """One simulated action: which stage ran what, from `start` to `end`.

    A `NamedTuple`, so it also unpacks as
    `(stage, kind, microbatch, start, end, chunk)`; `chunk` (the stage's
    model chunk, see `Action`) may be left out when building one.
    """

    stage: int
    kind: str
    microbatch: int
    start: float
    end: float
    chunk: int = 0


def _check_count(value, arg):
    """Returns `value` as an int >= 1, else raises naming `arg`."""
    if isinstance(value, bool):
        raise TypeError(f"{arg} must be an integer. Received: {arg}={value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{arg} must be an integer. Received: {arg}={value!r} "
            f"of type {type(value).__name__}") from None
    if value < 1:
        raise ValueError(f"{arg} must be >= 1. Received: {arg}={value}")
    return value


class Schedule:
    """Per-stage ordered lists of `Action`s, checked on construction.

    Every `(stage, kind, microbatch, chunk)` must appear exactly once, on
    its own stage's list, with the forward of a micro-batch before its
    backward (for each chunk). A schedule with any "W" action splits every
    backward: each B (input gradient) then needs its W (weight gradient)
    after it, on the same stage.

    Args:
        name: Schedule name, e.g. "gpipe" or "1f1b".
        actions: One sequence of `Action`s per stage; `actions[s]` is the
            order in which stage `s` runs its work.
        num_microbatches: Number of micro-batches `m`; inferred when omitted.
        virtual_stages: Model chunks per stage `v` (1: not interleaved);
            inferred when omitted.
        placement: "loop" (default: chunk `c` of stage `s` is model part
            `c * p + s`) or "v" (two chunks: chunk 0 is part `s`, chunk 1
            part `2p - 1 - s`; ZB-V).

    Attributes:
        name: The schedule name.
        actions: Tuple (one per stage) of tuples of `Action`s.
        num_stages: `p`, the number of stages (devices, rows).
        num_microbatches: `m`, the number of micro-batches.
        virtual_stages: `v`, model chunks per stage.
        num_parts: `v * p`, the model parts (chunks) in pipeline order.
        split_backward: True when backwards are split into B and W.
        placement: "loop" or "v" (see `part`).

    Example:

    >>> schedule = gpipe(num_stages=2, num_microbatches=2)
    >>> print(schedule)
    gpipe schedule, 2 stages x 2 micro-batches
    stage 0 | 0F0 0F1 0B0 0B1
    stage 1 | 1F0 1F1 1B0 1B1
    """

    def __init__(self, name, actions, num_microbatches=None,
                 virtual_stages=None, placement="loop"):
        self.name = str(name)
        self.actions = tuple(tuple(stage_actions) for stage_actions in actions)
        self.num_stages = _check_count(len(self.actions), "num_stages")
        everything = [a for row in self.actions for a in row]
        if num_microbatches is None:
            num_microbatches = 1 + max(
                (getattr(a, "microbatch", 0) for a in everything), default=-1)
        self.num_microbatches = _check_count(num_microbatches, "num_microbatches")
        if virtual_stages is None:
            virtual_stages = 1 + max(
                (getattr(a, "chunk", 0) for a in everything), default=0)
        self.virtual_stages = _check_count(virtual_stages, "virtual_stages")
        self.num_parts = self.virtual_stages * self.num_stages
        if placement not in PLACEMENTS or (
                placement == "v" and self.virtual_stages != 2):
            raise ValueError(
                f"Schedule {self.name!r}: placement must be one of "
                f"{PLACEMENTS} ('v' with exactly 2 chunks per stage). "
                f"Received: placement={placement!r}, virtual_stages="
                f"{self.virtual_stages}")
        self.placement = placement
        self.split_backward = any(a.kind == WEIGHT for a in everything
                                  if isinstance(a, Action))
        self._validate()

    def part(self, action):
        """The model part (0 .. num_parts - 1, in pipeline order) that
        `action` runs: chunk `c` of stage `s` is part `c * p + s` ("loop"
        placement), or part `s` / `2p - 1 - s` for chunk 0 / 1 ("v").

        >>> one_f_one_b(2, 2, virtual_stages=2).part(Action(1, "F", 0, 1))
        3
        >>> zero_bubble_v(2, 3).part(Action(1, "F", 0, 1))
        2
        """
        p = self.num_stages
        if self.placement == "v" and action.chunk:
            return 2 * p - 1 - action.stage
        return action.chunk * p + action.stage

    def stage_and_chunk(self, part):
        """(stage, chunk) of model part `part`: the inverse of `part`.

        >>> zero_bubble_v(2, 3).stage_and_chunk(3)
        (0, 1)
        """
        p = self.num_stages
        if self.placement == "v" and part >= p:
            return 2 * p - 1 - part, 1
        return part % p, part // p

    def _validate(self):
        m, v = self.num_microbatches, self.virtual_stages
        for s, row in enumerate(self.actions):
            seen = set()
            for position, action in enumerate(row):
                if not isinstance(action, Action):
                    raise TypeError(
                        f"Schedule {self.name!r}: actions[{s}] must hold "
                        f"Action objects. Received: {action!r} at position "
                        f"{position}")
                if (action.stage != s or action.microbatch >= m
                        or action.chunk >= v):
                    raise ValueError(
                        f"Schedule {self.name!r}: actions[{s}] may only hold "
                        f"actions of stage {s} on micro-batches 0..{m - 1}"
                        + (f" and chunks 0..{v - 1}" if v > 1 else "")
                        + f". Received: {action} at position {position}")
                if action in seen:
                    raise ValueError(
                        f"Schedule {self.name!r}: {action} appears twice on "
                        f"stage {s}")
                # F before B before W (of one micro-batch and chunk).
                needs = {BACKWARD: FORWARD, WEIGHT: BACKWARD}.get(action.kind)
                before = needs and Action(s, needs, action.microbatch,
                                          action.chunk)
                if before and before not in seen:
                    raise ValueError(
                        f"Schedule {self.name!r}: {action} comes before "
                        f"{before} on stage {s}")
                seen.add(action)
            kinds = self._kinds()
            if len(seen) != len(kinds) * m * v:
                missing = [str(Action(s, k, i, c)) for c in range(v)
                           for i in range(m) for k in kinds
                           if Action(s, k, i, c) not in seen]
                raise ValueError(
                    f"Schedule {self.name!r}: stage {s} misses "
                    f"{', '.join(missing)}")

    def _kinds(self):
        return ((FORWARD, BACKWARD, WEIGHT) if self.split_backward
                else (FORWARD, BACKWARD))

    def peak_in_flight(self, stage):
        """Max number of micro-batches alive on `stage` at once.

        A micro-batch is "in flight" on a stage from the start of its forward
        until its backward has run (its W, when backwards are split: the
        weight gradient still reads the layer inputs): the stage must keep
        its activations. This is what bounds activation memory.

        Args:
            stage: Stage index, `0 <= stage < num_stages`.

        Returns:
            The peak count over the stage's action list: GPipe gives `m`,
            1F1B gives `min(p - stage, m)`, ZB-H1 `p`, ZB-H2 `2p - 1`. With interleaving a micro-batch
            counts once per chunk it is alive in (each chunk keeps `1/v` of
            the stage's activations).

        Example:

        >>> one_f_one_b(4, 8).peak_in_flight(0), gpipe(4, 8).peak_in_flight(0)
        (4, 8)
        """
        if not 0 <= stage < self.num_stages:
            raise ValueError(
                f"stage must be in [0, {self.num_stages}). "
                f"Received: stage={stage!r}")
        last = WEIGHT if self.split_backward else BACKWARD
        alive = peak = 0
        for action in self.actions[stage]:
            alive += {FORWARD: 1, last: -1}.get(action.kind, 0)
            peak = max(peak, alive)
        return peak

    def simulate(self, forward_time=1.0, backward_time=2.0,
                 weight_time=None):
        """Computes when each action runs, as early as its dependencies allow.

        Rules: each stage runs its actions one at a time in list order;
        `F(k, i)` of model part `k` needs `F(k - 1, i)` done (activations
        arrive from the previous part); `B(k, i)` needs `B(k + 1, i)` done
        (gradients arrive from the next part) and `F(k, i)` done; `W(k, i)`
        needs `B(k, i)` done. Without interleaving part `k` is stage `k`.
        Communication is free.

        Args:
            forward_time: Duration of one forward on one stage (a chunk's
                forward takes `forward_time / virtual_stages`).
            backward_time: Duration of one whole backward on one stage
                (about twice the forward in practice, hence the default).
                When backwards are split, B takes `backward_time -
                weight_time` and W `weight_time`.
            weight_time: Duration of one W (split backwards only); default
                half the backward. `simulate(1, 2, 1)` is the paper's
                T_F = T_B = T_W.

        Returns:
            A list of `TimelineEntry(stage, kind, microbatch, start, end,
            chunk)`, sorted by start time then stage; time starts at 0.

        Raises:
            ValueError: If the durations are negative, or the action orders
                deadlock (impossible for `gpipe` and `one_f_one_b`).

        Example:

        >>> gpipe(2, 1).simulate(forward_time=1, backward_time=2)[:2]
        [TimelineEntry(stage=0, kind='F', microbatch=0, start=0, end=1, \
chunk=0), TimelineEntry(stage=1, kind='F', microbatch=0, start=1, end=2, \
chunk=0)]
        """
        if weight_time is None:
            weight_time = backward_time / 2
        for arg, value in (("forward_time", forward_time),
                           ("backward_time", backward_time),
                           ("weight_time", weight_time)):
            if not value >= 0:
                raise ValueError(f"{arg} must be >= 0. Received: {arg}={value!r}")
        if self.split_backward:
            if weight_time > backward_time:
                raise ValueError(
                    "weight_time is the W part of backward_time, so it must "
                    f"be <= backward_time. Received: weight_time="
                    f"{weight_time!r}, backward_time={backward_time!r}")
            backward_time = backward_time - weight_time
        v = self.virtual_stages
        # A chunk is 1/v of a stage (v = 1 keeps the times exact).
        duration = {kind: time / v if v > 1 else time for kind, time in (
            (FORWARD, forward_time), (BACKWARD, backward_time),
            (WEIGHT, weight_time))}
        p, last = self.num_stages, self.num_parts - 1
        end = {}                    # (part, kind, microbatch) -> end time
        next_index = [0] * p        # next action to run, per stage
        free_at = [0] * p           # when each stage finishes its last action
        timeline = []
        progress = True
        while progress:
            progress = False
            for s in range(p):
                while next_index[s] < len(self.actions[s]):
                    a = self.actions[s][next_index[s]]
                    k, i = self.part(a), a.microbatch
                    if a.kind == FORWARD:
                        deps = [(k - 1, FORWARD, i)] if k > 0 else []
                    elif a.kind == WEIGHT:
                        deps = [(k, BACKWARD, i)]
                    else:
                        deps = [(k, FORWARD, i)]
                        if k < last:
                            deps.append((k + 1, BACKWARD, i))
                    if any(d not in end for d in deps):
                        break       # wait for another stage; try it next sweep
                    # Start as soon as the stage is free and inputs are ready.
                    start = max([free_at[s]] + [end[d] for d in deps])
                    finish = start + duration[a.kind]
                    end[(k, a.kind, i)] = finish
                    free_at[s] = finish
                    timeline.append(TimelineEntry(s, a.kind, i, start, finish,
                                                  a.chunk))
                    next_index[s] += 1
                    progress = True
        stuck = [str(self.actions[s][next_index[s]]) for s in range(p)
                 if next_index[s] < len(self.actions[s])]
        if stuck:
            raise ValueError(
                f"Schedule {self.name!r} deadlocks: every stage waits, next "
                f"actions are {', '.join(stuck)}")
        timeline.sort(key=lambda e: (e.start, e.stage))
        return timeline

    def execution_order(self):
        """Every `Action` once, in an order that respects the data flow
        and each stage's list (the simulated start order, backward twice
        the forward): the order a single program can issue them in."""
        return [Action(e.stage, e.kind, e.microbatch, e.chunk)
                for e in self.simulate(forward_time=1.0, backward_time=2.0)]

    def bubble_fraction(self, forward_time=1.0, backward_time=1.0,
                        weight_time=None, per_stage=False):
        """`bubble_fraction(self.simulate(forward_time, backward_time,
        weight_time), per_stage)`."""
        return bubble_fraction(
            self.simulate(forward_time, backward_time, weight_time),
            per_stage)

    def __str__(self):
        chunks = (f" x {self.virtual_stages} chunks"
                  if self.virtual_stages > 1 else "")
        header = (f"{self.name} schedule, {self.num_stages} stages{chunks} x "
                  f"{self.num_microbatches} micro-batches")
        width = len(str(self.num_stages - 1))
        rows = [f"stage {s:>{width}} | " + " ".join(str(a) for a in row)
                for s, row in enumerate(self.actions)]
        return "\n".join([header] + rows)

    def __repr__(self):
        chunks = (f", virtual_stages={self.virtual_stages}"
                  if self.virtual_stages > 1 else "")
        return (f"Schedule(name={self.name!r}, num_stages={self.num_stages}, "
                f"num_microbatches={self.num_microbatches}{chunks})")


def gpipe(num_stages, num_microbatches, virtual_stages=1):
    """GPipe: all forwards, then all backwards, on every stage.

    Stage `s` runs `F0 .. F(m-1)` then `B0 .. B(m-1)`, so it holds the
    activations of all `m` micro-batches at its peak. Interleaved
    (`virtual_stages=v`, torch.distributed.pipelining's "looped BFS"): the
    forwards of chunk 0, then of chunk 1, ..., then the backwards from the
    last chunk back to chunk 0. Any `m` works.

    Args:
        num_stages: `p >= 1`, the number of pipeline stages.
        num_microbatches: `m >= 1`, the number of micro-batches per batch.
        virtual_stages: `v >= 1`, model chunks per stage.

    Returns:
        A `Schedule` named "gpipe".

    Example:

    >>> [str(a) for a in gpipe(2, 2).actions[1]]
    ['1F0', '1F1', '1B0', '1B1']
    >>> [str(a) for a in gpipe(2, 1, virtual_stages=2).actions[0]]
    ['0F0', '0F0.1', '0B0.1', '0B0']
    """
    p = _check_count(num_stages, "num_stages")
    m = _check_count(num_microbatches, "num_microbatches")
    v = _check_count(virtual_stages, "virtual_stages")
    actions = [[Action(s, FORWARD, i, c) for c in range(v) for i in range(m)]
               + [Action(s, BACKWARD, i, c) for c in reversed(range(v))
                  for i in range(m)]
               for s in range(p)]
    return Schedule("gpipe", actions, m, v)


def one_f_one_b(num_stages, num_microbatches, virtual_stages=1):
    """1F1B (PipeDream-Flush, Megatron-LM's schedules).

    Stage `s` runs three phases:

    1. warm-up: `w = min(p - s - 1, m)` forwards, filling the pipe so that
       the last stage can start backwards as soon as possible;
    2. steady state: `m - w` rounds of one forward then one backward;
    3. cool-down: the `w` backwards still owed.

    So stage `s` holds at most `w + 1 = p - s` micro-batches (`min(p-s, m)`)
    instead of GPipe's `m`, with the same bubble.

    `m < p` is allowed: warm-up is capped at `m`, so stages `s < p - m` do
    all forwards then all backwards, i.e. the schedule degenerates to GPipe
    (same bubble, in-flight `min(p - s, m) = m` there). Choose `m >= p`
    (ideally `m >> p`) for the memory saving and a small bubble.

    With `virtual_stages=v > 1` this is Megatron-LM's interleaved 1F1B: see
    `_interleaved_one_f_one_b`.

    Args:
        num_stages: `p >= 1`, the number of pipeline stages.
        num_microbatches: `m >= 1`, the number of micro-batches per batch
            (a multiple of `p` when `v > 1`).
        virtual_stages: `v >= 1`, model chunks per stage.

    Returns:
        A `Schedule` named "1f1b".

    Raises:
        ValueError: If `v > 1` and `m` is not a multiple of `p`.

    Example:

    >>> print(one_f_one_b(3, 4))
    1f1b schedule, 3 stages x 4 micro-batches
    stage 0 | 0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3
    stage 1 | 1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3
    stage 2 | 2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3
    """
    p = _check_count(num_stages, "num_stages")
    m = _check_count(num_microbatches, "num_microbatches")
    v = _check_count(virtual_stages, "virtual_stages")
    if v > 1:
        return _interleaved_one_f_one_b(p, m, v)
    actions = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        steady = m - warmup
        # Warm-up: forwards of micro-batches 0 .. warmup-1.
        row = [Action(s, FORWARD, i) for i in range(warmup)]
        # Steady state: round k runs forward (warmup + k), then backward k;
        # the backward of k lags its forward by `warmup` micro-batches.
        for k in range(steady):
            row += [Action(s, FORWARD, warmup + k), Action(s, BACKWARD, k)]
        # Cool-down: backwards of micro-batches steady .. m-1.
        row += [Action(s, BACKWARD, i) for i in range(steady, m)]
        actions.append(row)
    return Schedule("1f1b", actions, m)


def _interleaved_one_f_one_b(p, m, v):
    """Megatron-LM's interleaved 1F1B (`forward_backward_pipelining_with_
    interleaving`), p stages x v chunks x m micro-batches, p | m.

    Stage `s` runs `m * v` forwards and as many backwards. Its k-th forward
    is chunk `(k // p) % v` on micro-batch `(k // (p v)) p + k % p`:
    groups of `p` micro-batches go through chunk 0, then chunk 1, ...; its
    k-th backward walks the chunks from the last one back. Warm-up:
    `(p - s - 1) * 2 + (v - 1) * p` forwards (all of them when `m == p`),
    then one forward and one backward at a time, then the backwards owed.
    """
    if m % p:
        raise ValueError(
            f"Interleaved 1F1B (virtual_stages={v}) needs num_microbatches "
            f"to be a multiple of num_stages ({p}). Received: "
            f"num_microbatches={m}. Use e.g. num_microbatches="
            f"{(m // p + 1) * p}, or schedule='gpipe' (any count).")
    total = m * v

    def action(s, k, kind):
        chunk = (k % (p * v)) // p
        if kind == BACKWARD:
            chunk = v - 1 - chunk
        return Action(s, kind, (k // (p * v)) * p + k % p, chunk)

    actions = []
    for s in range(p):
        warmup = total if m == p else min((p - s - 1) * 2 + (v - 1) * p, total)
        row = [action(s, k, FORWARD) for k in range(warmup)]
        for k in range(total - warmup):
            row += [action(s, warmup + k, FORWARD), action(s, k, BACKWARD)]
        row += [action(s, k, BACKWARD) for k in range(total - warmup, total)]
        actions.append(row)
    return Schedule("1f1b", actions, m, v)


def zero_bubble(name, num_stages, num_microbatches, virtual_stages=1,
                check=True):
    """ZB-H1 or ZB-H2 (arXiv 2401.10241, section 3): backwards split into
    B (input gradient) and W (weight gradient).

    Stage `s` of `p` runs `w` warm-up forwards (ZB-H1: `p - s - 1`, as
    1F1B; ZB-H2: `2 (p - s - 1)`), then `m - w` rounds of one F and one B,
    each followed by as many W's (oldest first) as keep at most `c`
    micro-batches alive before the next F (ZB-H1: `c = p`; ZB-H2: `c = 2p -
    1`); then the `w` B's still owed, each followed by one W (filling the
    wait for the next stage's B), then the remaining W's.

    Args:
        name: "zb-h1" or "zb-h2".
        num_stages: `p >= 1`.
        num_microbatches: `m`; ZB-H1 needs `m >= p`, ZB-H2 `m >= 2p - 1`
            (fewer micro-batches leave the bubble the schedule is for).
        virtual_stages: must be 1 (no interleaved zero-bubble schedule).
        check: False builds the same order for any `m >= 1` (a smaller
            last batch of an epoch: the result does not depend on the
            order, only the bubble does).

    Returns:
        A `Schedule` named `name` with F, B and W actions.

    Example:

    >>> print(zero_bubble("zb-h1", 2, 3))
    zb-h1 schedule, 2 stages x 3 micro-batches
    stage 0 | 0F0 0F1 0B0 0W0 0F2 0B1 0W1 0B2 0W2
    stage 1 | 1F0 1B0 1F1 1B1 1W0 1F2 1B2 1W1 1W2
    """
    p = _check_count(num_stages, "num_stages")
    m = _check_count(num_microbatches, "num_microbatches")
    v = _check_count(virtual_stages, "virtual_stages")
    if v > 1:
        raise ValueError(
            f"Schedule {name!r} has no interleaved form. Received: "
            f"virtual_stages={v}. Use virtual_stages=1, schedule='zbv' (two "
            "parts per stage in a V), or schedule='1f1b' with virtual "
            "stages.")
    h2 = name == "zb-h2"
    least = 2 * p - 1 if h2 else p
    if check and m < least:
        raise ValueError(
            f"Schedule {name!r} needs num_microbatches >= "
            f"{'2 × num_stages - 1' if h2 else 'num_stages'} = {least} (with "
            "fewer there are not enough micro-batches to fill the pipe). "
            f"Received: num_microbatches={m}, num_stages={p}. Use "
            f"num_microbatches={least} or more, or schedule='1f1b'.")
    cap = 2 * p - 1 if h2 else p
    actions = []
    for s in range(p):
        warmup = min(2 * (p - s - 1) if h2 else p - s - 1, m)
        row = [Action(s, FORWARD, i) for i in range(warmup)]
        forwards, weights = warmup, 0   # F's and W's run so far
        for k in range(m - warmup):
            row += [Action(s, FORWARD, forwards), Action(s, BACKWARD, k)]
            forwards += 1
            # W's (their B's ran) until the next F fits under the cap.
            while forwards - weights >= cap and weights <= k:
                row.append(Action(s, WEIGHT, weights))
                weights += 1
        for i in range(m - warmup, m):
            row.append(Action(s, BACKWARD, i))
            if weights <= i:
                row.append(Action(s, WEIGHT, weights))
                weights += 1
        row += [Action(s, WEIGHT, i) for i in range(weights, m)]
        actions.append(row)
    return Schedule(name, actions, m)


def zero_bubble_v(num_stages, num_microbatches, check=True):
    """ZB-V (arXiv 2401.10241, section 6; the order of PyTorch's
    `ScheduleZBVZeroBubble`): 2p model parts in a V, stage `s` holding
    chunk 0 = part `s` and chunk 1 = part `2p - 1 - s`; backwards split
    into B and W.

    Stage `s` runs, in chunk-sized slots (each half a stage's work):

    1. warm-up: `2(p - s) - 1` forwards of chunk 0, then `s` pairs (chunk 1
       F, chunk 0 F), then `p - s` triples (chunk 1 F, B, W): the V fills
       down chunk 0 and turns on the last stage into chunk 1;
    2. steady state, until every forward ran: chunk 0 F (while any is
       left), B, W, then chunk 1 F, B, W;
    3. cool-down: `s` pairs of B (chunk 0, chunk 1), then `p - s` pairs of
       chunk 0 B and W (filling the wait for the next stage's B), then the
       W's still owed (chunk 1 first).

    With n = max(m, 2p - 1) micro-batches built and those >= m dropped,
    any m >= 1 gives a valid order.

    Args:
        num_stages: `p >= 1`.
        num_microbatches: `m`; needs `m >= 2p - 1` (fewer leave the V
            unfilled: the bubble the schedule is for).
        check: False allows any `m >= 1` (an epoch's smaller last batch).

    Returns:
        A `Schedule` named "zbv" with 2 chunks per stage, placement "v".

    Example:

    >>> print(zero_bubble_v(2, 3))
    zbv schedule, 2 stages x 2 chunks x 3 micro-batches
    stage 0 | 0F0 0F1 0F2 0F0.1 0B0.1 0W0.1 0F1.1 0B1.1 0W1.1 0B0 0W0 \
0F2.1 0B2.1 0W2.1 0B1 0W1 0B2 0W2
    stage 1 | 1F0 1F0.1 1F1 1F1.1 1B0.1 1W0.1 1F2 1B0 1W0 1F2.1 1B1.1 \
1W1.1 1B1 1B2.1 1B2 1W1 1W2.1 1W2
    """
    p = _check_count(num_stages, "num_stages")
    m = _check_count(num_microbatches, "num_microbatches")
    least = 2 * p - 1
    if check and m < least:
        raise ValueError(
            f"Schedule 'zbv' needs num_microbatches >= 2 × num_stages - 1 "
            f"= {least} (with fewer the V is never full). Received: "
            f"num_microbatches={m}, num_stages={p}. Use num_microbatches="
            f"{least} or more, or schedule='zb-h1'.")
    n = max(m, least)
    actions = [[a for a in _zbv_row(s, p, n) if a.microbatch < m]
               for s in range(p)]
    return Schedule("zbv", actions, m, 2, placement="v")


def _zbv_row(s, p, n):
    """Stage s's ZB-V actions for n >= 2p - 1 micro-batches (see
    `zero_bubble_v`)."""
    row = []
    done = {(c, k): 0 for c in (0, 1) for k in (FORWARD, BACKWARD, WEIGHT)}

    def run(chunk, *kinds):
        for kind in kinds:
            row.append(Action(s, kind, done[chunk, kind], chunk))
            done[chunk, kind] += 1

    for _ in range(2 * (p - s) - 1):
        run(0, FORWARD)
    for _ in range(s):
        run(1, FORWARD)
        run(0, FORWARD)
    for _ in range(p - s):
        run(1, FORWARD, BACKWARD, WEIGHT)
    while done[1, FORWARD] < done[0, FORWARD] or done[0, FORWARD] < n:
        if done[0, FORWARD] < n:
            run(0, FORWARD)
        run(0, BACKWARD, WEIGHT)
        run(1, FORWARD, BACKWARD, WEIGHT)
    # Cool-down: W's lag their B's from here on.
    weights = {c: done[c, BACKWARD] for c in (0, 1)}
    for _ in range(s):
        run(0, BACKWARD)
        run(1, BACKWARD)
    for _ in range(p - s):
        run(0, BACKWARD)
        row.append(Action(s, WEIGHT, weights[0], 0))
        weights[0] += 1
    for c in (1, 0):
        row += [Action(s, WEIGHT, i, c)
                for i in range(weights[c], done[c, BACKWARD])]
    return row


_SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b,
              "zb-h1": lambda p, m, v: zero_bubble("zb-h1", p, m, v),
              "zb-h2": lambda p, m, v: zero_bubble("zb-h2", p, m, v),
              "zbv": lambda p, m, v: _zbv_for(p, m, v)}
SCHEDULE_NAMES = tuple(_SCHEDULES)


def _zbv_for(p, m, v):
    """ZB-V always runs 2 chunks per stage: `virtual_stages` 1 (the
    default) or 2 asks for it."""
    if v not in (1, 2):
        raise ValueError(
            "Schedule 'zbv' runs exactly two model parts per stage (a V). "
            f"Received: virtual_stages={v}. Use virtual_stages=2 (or leave "
            "it at 1: 'zbv' cuts 2 × num_stages parts by itself).")
    return zero_bubble_v(p, m)


def get_schedule(name, num_stages, num_microbatches, virtual_stages=1):
    """Builds a schedule by name.

    Args:
        name: "gpipe", "1f1b", "zb-h1", "zb-h2" (see `zero_bubble`) or
            "zbv" (`zero_bubble_v`: always 2 chunks per stage);
            case-insensitive.
        num_stages: `p >= 1`, the number of pipeline stages.
        num_microbatches: `m >= 1`, the number of micro-batches per batch.
        virtual_stages: `v >= 1`, model chunks per stage (interleaving).

    Returns:
        The `Schedule`.

    Raises:
        ValueError: For an unknown name, a count below 1, or too few
            micro-batches for a zero-bubble schedule.
        TypeError: For a non-string name or a non-integer count.

    Example:

    >>> get_schedule("1F1B", 4, 8)
    Schedule(name='1f1b', num_stages=4, num_microbatches=8)
    """
    if not isinstance(name, str):
        raise TypeError(
            f"get_schedule() needs the schedule name as a string, one of "
            f"{', '.join(map(repr, SCHEDULE_NAMES))}. Received: name={name!r} "
            f"of type {type(name).__name__}")
    key = name.strip().lower()
    if key not in _SCHEDULES:
        raise ValueError(
            f"get_schedule() got an unknown schedule name. Received: "
            f"name={name!r}. Valid names (case-insensitive): "
            f"{', '.join(map(repr, SCHEDULE_NAMES))}")
    return _SCHEDULES[key](num_stages, num_microbatches, virtual_stages)


def bubble_fraction(timeline, per_stage=False):
    """Idle fraction of a simulated timeline.

    With `p` stages busy for a total of `busy` time units over a makespan
    `T = max(end) - min(start)`, the pipeline offers `p * T` stage-time and
    the bubble is `(p * T - busy) / (p * T)`: every stage waits for the
    step's optimizer update. The number of stages is `1 + max(stage)`; a
    stage's busy time is the union of its actions' intervals (measured
    actions may overlap).

    Args:
        timeline: `TimelineEntry` records or `(stage, kind, microbatch,
            start, end)` tuples, e.g. from `Schedule.simulate`.
        per_stage: count each stage's time only from its first start to
            its last end (steps overlapping, no optimizer synchronisation:
            the zero-bubble paper's measure of ZB-H2).

    Returns:
        A float in `[0, 1)`; 0.0 for an empty or zero-length timeline.

    Example:

    >>> bubble_fraction(gpipe(4, 8).simulate(1.0, 1.0))   # 3 / 11
    0.2727272727272727
    """
    entries = [TimelineEntry(*_as_tuple(e)) for e in timeline]
    if not entries:
        return 0.0
    p = 1 + max(e.stage for e in entries)
    makespan = max(e.end for e in entries) - min(e.start for e in entries)
    if makespan <= 0:
        return 0.0
    if per_stage:
        spans = [[e for e in entries if e.stage == s] for s in range(p)]
        makespan = sum(max(e.end for e in row) - min(e.start for e in row)
                       for row in spans if row) / p
    # Busy time of a stage is the union of its actions' intervals (in a
    # measured timeline a stage's actions may overlap).
    busy = 0.0
    for stage in range(p):
        reach = None
        for e in sorted((e for e in entries if e.stage == stage),
                        key=lambda e: e.start):
            if reach is None or e.start >= reach:
                busy += e.end - e.start
                reach = e.end
            elif e.end > reach:
                busy += e.end - reach
                reach = e.end
    total = p * makespan
    return (total - busy) / total


def theoretical_bubble_fraction(num_stages, num_microbatches,
                                virtual_stages=1, schedule="1f1b"):
    """The papers' bubble fractions for equal costs.

    "gpipe", "1f1b": `(p - 1) / (v m + p - 1)`, equal F/B. Each stage
    idles `p - 1` slots while the pipe fills and `p - 1` while it drains,
    out of `2 (v m + p - 1)` slots of a step where a slot is one chunk's F
    or B (`1/v` of a stage's work). With `v = 1` GPipe's bubble too.

    "zb-h1": `(p - 1) / (3 m + p - 1)`, T_F = T_B = T_W: idle `(p - 1)
    (T_F + T_B - T_W)` per stage beside `m (T_F + T_B + T_W)` of work.

    "zb-h2": 0, the paper's figure: no stage idles between its first and
    last action (`bubble_fraction(..., per_stage=True)`); with the
    optimizer step synchronising the stages the fill `(p - 1) T_F` stays,
    `(p - 1) / (3 m + p - 1)` as ZB-H1.

    "zbv": `(p - 1) / (6 m + p - 1)`, T_F = T_B = T_W: no stage idles
    inside its own span; the synchronised step keeps the fill of `p - 1`
    chunk forwards, `(p - 1) T_F / 2`, beside `3 m T_F` of work per stage.

    Example:

    >>> theoretical_bubble_fraction(4, 8)
    0.2727272727272727
    >>> theoretical_bubble_fraction(4, 8, virtual_stages=2)   # 3 / 19
    0.15789473684210525
    >>> theoretical_bubble_fraction(4, 8, schedule="zb-h1")   # 3 / 27
    0.1111111111111111
    >>> theoretical_bubble_fraction(4, 8, schedule="zbv")     # 3 / 51
    0.058823529411764705
    """
    p = _check_count(num_stages, "num_stages")
    m = _check_count(num_microbatches, "num_microbatches")
    v = _check_count(virtual_stages, "virtual_stages")
    if schedule == "zb-h1":
        return (p - 1) / (3 * m + p - 1)
    if schedule == "zb-h2":
        return 0.0
    if schedule == "zbv":
        return (p - 1) / (6 * m + p - 1)
    if schedule not in ("gpipe", "1f1b"):
        raise ValueError(
            "theoretical_bubble_fraction(schedule) must be one of "
            f"{', '.join(map(repr, SCHEDULE_NAMES))}. Received: "
            f"schedule={schedule!r}")
    return (p - 1) / (v * m + p - 1)


def _as_tuple(entry):
    """`(stage, kind, microbatch, start, end, chunk)` from a tuple (chunk
    optional) or an object."""
    if isinstance(entry, tuple):
        if len(entry) not in (5, 6):
            raise ValueError(
                "A timeline entry needs 5 fields (stage, kind, microbatch, "
                f"start, end) and optionally chunk. Received: {entry!r}")
        return tuple(entry) + (0,) * (6 - len(entry))
    try:
        return (entry.stage, entry.kind, entry.microbatch, entry.start,
                entry.end, getattr(entry, "chunk", 0))
    except AttributeError:
        raise TypeError(
            "A timeline entry must be a (stage, kind, microbatch, start, end) "
            "tuple or have those attributes. Received: "
            f"{entry!r}") from None
