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
]

FORWARD = "F"
BACKWARD = "B"


@dataclasses.dataclass(frozen=True)
class Action:
    """One unit of pipeline work: a forward or backward of one micro-batch.

    Args:
        stage: Pipeline stage (device) index, 0 is the first stage.
        kind: "F" for the forward pass, "B" for the backward pass.
        microbatch: Micro-batch index, 0-based.

    Example:

    >>> str(Action(stage=1, kind="F", microbatch=0))
    '1F0'
    >>> str(Action(0, "B", 3))
    '0B3'
    """

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self):
        if self.kind not in (FORWARD, BACKWARD):
            raise ValueError(
                f"Action kind must be 'F' or 'B'. Received: kind={self.kind!r}")
        for field in ("stage", "microbatch"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"Action {field} must be an integer >= 0. "
                    f"Received: {field}={value!r}")

    def __str__(self):
        return f"{self.stage}{self.kind}{self.microbatch}"


class TimelineEntry(NamedTuple):
    """One simulated action: which stage ran what, from `start` to `end`.

    A `NamedTuple`, so it also unpacks as
    `(stage, kind, microbatch, start, end)`.
    """

    stage: int
    kind: str
    microbatch: int
    start: float
    end: float


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

    Every `(stage, kind, microbatch)` must appear exactly once, on its own
    stage's list, with the forward of a micro-batch before its backward.

    Args:
        name: Schedule name, e.g. "gpipe" or "1f1b".
        actions: One sequence of `Action`s per stage; `actions[s]` is the
            order in which stage `s` runs its work.
        num_microbatches: Number of micro-batches `m`; inferred when omitted.

    Attributes:
        name: The schedule name.
        actions: Tuple (one per stage) of tuples of `Action`s.
        num_stages: `p`, the number of stages.
        num_microbatches: `m`, the number of micro-batches.

    Example:

    >>> schedule = gpipe(num_stages=2, num_microbatches=2)
    >>> print(schedule)
    gpipe schedule, 2 stages x 2 micro-batches
    stage 0 | 0F0 0F1 0B0 0B1
    stage 1 | 1F0 1F1 1B0 1B1
    """

    def __init__(self, name, actions, num_microbatches=None):
        self.name = str(name)
        self.actions = tuple(tuple(stage_actions) for stage_actions in actions)
        self.num_stages = _check_count(len(self.actions), "num_stages")
        if num_microbatches is None:
            num_microbatches = 1 + max(
                (a.microbatch for row in self.actions for a in row), default=-1)
        self.num_microbatches = _check_count(num_microbatches, "num_microbatches")
        self._validate()

    def _validate(self):
        m = self.num_microbatches
        for s, row in enumerate(self.actions):
            seen = set()
            for position, action in enumerate(row):
                if not isinstance(action, Action):
                    raise TypeError(
                        f"Schedule {self.name!r}: actions[{s}] must hold "
                        f"Action objects. Received: {action!r} at position "
                        f"{position}")
                if action.stage != s or action.microbatch >= m:
                    raise ValueError(
                        f"Schedule {self.name!r}: actions[{s}] may only hold "
                        f"actions of stage {s} on micro-batches 0..{m - 1}. "
                        f"Received: {action} at position {position}")
                if action in seen:
                    raise ValueError(
                        f"Schedule {self.name!r}: {action} appears twice on "
                        f"stage {s}")
                if (action.kind == BACKWARD
                        and Action(s, FORWARD, action.microbatch) not in seen):
                    raise ValueError(
                        f"Schedule {self.name!r}: {action} comes before "
                        f"{Action(s, FORWARD, action.microbatch)} on stage {s}")
                seen.add(action)
            if len(seen) != 2 * m:
                missing = [str(Action(s, k, i)) for i in range(m)
                           for k in (FORWARD, BACKWARD)
                           if Action(s, k, i) not in seen]
                raise ValueError(
                    f"Schedule {self.name!r}: stage {s} misses "
                    f"{', '.join(missing)}")

    def peak_in_flight(self, stage):
        """Max number of micro-batches alive on `stage` at once.

        A micro-batch is "in flight" on a stage from the start of its forward
        until its backward has run: the stage must keep its activations. This
        is what bounds activation memory.

        Args:
            stage: Stage index, `0 <= stage < num_stages`.

        Returns:
            The peak count over the stage's action list: GPipe gives `m`,
            1F1B gives `min(p - stage, m)`.

        Example:

        >>> one_f_one_b(4, 8).peak_in_flight(0), gpipe(4, 8).peak_in_flight(0)
        (4, 8)
        """
        if not 0 <= stage < self.num_stages:
            raise ValueError(
                f"stage must be in [0, {self.num_stages}). "
                f"Received: stage={stage!r}")
        alive = peak = 0
        for action in self.actions[stage]:
            alive += 1 if action.kind == FORWARD else -1
            peak = max(peak, alive)
        return peak

    def simulate(self, forward_time=1.0, backward_time=2.0):
        """Computes when each action runs, as early as its dependencies allow.

        Rules: each stage runs its actions one at a time in list order;
        `F(s, i)` needs `F(s - 1, i)` done (activations arrive from the
        previous stage); `B(s, i)` needs `B(s + 1, i)` done (gradients arrive
        from the next stage) and `F(s, i)` done. Communication is free.

        Args:
            forward_time: Duration of one forward on one stage.
            backward_time: Duration of one backward on one stage (about twice
                the forward in practice, hence the default).

        Returns:
            A list of `TimelineEntry(stage, kind, microbatch, start, end)`,
            sorted by start time then stage; time starts at 0.

        Raises:
            ValueError: If the durations are negative, or the action orders
                deadlock (impossible for `gpipe` and `one_f_one_b`).

        Example:

        >>> gpipe(2, 1).simulate(forward_time=1, backward_time=2)[:2]
        [TimelineEntry(stage=0, kind='F', microbatch=0, start=0, end=1), \
TimelineEntry(stage=1, kind='F', microbatch=0, start=1, end=2)]
        """
        for arg, value in (("forward_time", forward_time),
                           ("backward_time", backward_time)):
            if not value >= 0:
                raise ValueError(f"{arg} must be >= 0. Received: {arg}={value!r}")
        duration = {FORWARD: forward_time, BACKWARD: backward_time}
        p = self.num_stages
        end = {}                    # (stage, kind, microbatch) -> end time
        next_index = [0] * p        # next action to run, per stage
        free_at = [0] * p           # when each stage finishes its last action
        timeline = []
        progress = True
        while progress:
            progress = False
            for s in range(p):
                while next_index[s] < len(self.actions[s]):
                    a = self.actions[s][next_index[s]]
                    if a.kind == FORWARD:
                        deps = [(s - 1, FORWARD, a.microbatch)] if s > 0 else []
                    else:
                        deps = [(s, FORWARD, a.microbatch)]
                        if s < p - 1:
                            deps.append((s + 1, BACKWARD, a.microbatch))
                    if any(d not in end for d in deps):
                        break       # wait for another stage; try it next sweep
                    # Start as soon as the stage is free and inputs are ready.
                    start = max([free_at[s]] + [end[d] for d in deps])
                    finish = start + duration[a.kind]
                    end[(s, a.kind, a.microbatch)] = finish
                    free_at[s] = finish
                    timeline.append(
                        TimelineEntry(s, a.kind, a.microbatch, start, finish))
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

    def bubble_fraction(self, forward_time=1.0, backward_time=1.0):
        """`bubble_fraction(self.simulate(forward_time, backward_time))`."""
        return bubble_fraction(self.simulate(forward_time, backward_time))

    def __str__(self):
        header = (f"{self.name} schedule, {self.num_stages} stages x "
                  f"{self.num_microbatches} micro-batches")
        width = len(str(self.num_stages - 1))
        rows = [f"stage {s:>{width}} | " + " ".join(str(a) for a in row)
                for s, row in enumerate(self.actions)]
        return "\n".join([header] + rows)

    def __repr__(self):
        return (f"Schedule(name={self.name!r}, num_stages={self.num_stages}, "
                f"num_microbatches={self.num_microbatches})")


def gpipe(num_stages, num_microbatches):
    """GPipe: all forwards, then all backwards, on every stage.

    Stage `s` runs `F0 .. F(m-1)` then `B0 .. B(m-1)`, so it holds the
    activations of all `m` micro-batches at its peak.

    Args:
        num_stages: `p >= 1`, the number of pipeline stages.
        num_microbatches: `m >= 1`, the number of micro-batches per batch.

    Returns:
        A `Schedule` named "gpipe".

    Example:

    >>> [str(a) for a in gpipe(2, 2).actions[1]]
    ['1F0', '1F1', '1B0', '1B1']
    """
    p = _check_count(num_stages, "num_stages")
    m = _check_count(num_microbatches, "num_microbatches")
    actions = [[Action(s, FORWARD, i) for i in range(m)]
               + [Action(s, BACKWARD, i) for i in range(m)]
               for s in range(p)]
    return Schedule("gpipe", actions, m)


def one_f_one_b(num_stages, num_microbatches):
    """1F1B (PipeDream-Flush, Megatron-LM's non-interleaved schedule).

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

    Args:
        num_stages: `p >= 1`, the number of pipeline stages.
        num_microbatches: `m >= 1`, the number of micro-batches per batch.

    Returns:
        A `Schedule` named "1f1b".

    Example:

    >>> print(one_f_one_b(3, 4))
    1f1b schedule, 3 stages x 4 micro-batches
    stage 0 | 0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3
    stage 1 | 1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3
    stage 2 | 2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3
    """
    p = _check_count(num_stages, "num_stages")
    m = _check_count(num_microbatches, "num_microbatches")
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


_SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}
SCHEDULE_NAMES = tuple(_SCHEDULES)


def get_schedule(name, num_stages, num_microbatches):
    """Builds a schedule by name.

    Args:
        name: "gpipe" or "1f1b" (case-insensitive).
        num_stages: `p >= 1`, the number of pipeline stages.
        num_microbatches: `m >= 1`, the number of micro-batches per batch.

    Returns:
        The `Schedule`.

    Raises:
        ValueError: For an unknown name, or a count below 1.
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
    return _SCHEDULES[key](num_stages, num_microbatches)


def bubble_fraction(timeline):
    """Idle fraction of a simulated timeline.

    With `p` stages busy for a total of `busy` time units over a makespan
    `T = max(end) - min(start)`, the pipeline offers `p * T` stage-time and
    the bubble is `(p * T - busy) / (p * T)`. The number of stages is
    `1 + max(stage)`; a stage's busy time is the union of its actions'
    intervals (measured actions may overlap).

    Args:
        timeline: `TimelineEntry` records or `(stage, kind, microbatch,
            start, end)` tuples, e.g. from `Schedule.simulate`.

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


def theoretical_bubble_fraction(num_stages, num_microbatches):
    """`(p - 1) / (m + p - 1)`: the GPipe and 1F1B bubble, equal F/B costs.

    Each stage idles `p - 1` slots while the pipe fills and `p - 1` while it
    drains, out of `2 (m + p - 1)` slots of a step where a slot is one F or B.

    Example:

    >>> theoretical_bubble_fraction(4, 8)
    0.2727272727272727
    """
    p = _check_count(num_stages, "num_stages")
    m = _check_count(num_microbatches, "num_microbatches")
    return (p - 1) / (m + p - 1)


def _as_tuple(entry):
    """`(stage, kind, microbatch, start, end)` from a tuple or an object."""
    if isinstance(entry, tuple):
        if len(entry) != 5:
            raise ValueError(
                "A timeline entry needs 5 fields (stage, kind, microbatch, "
                f"start, end). Received: {entry!r}")
        return tuple(entry)
    try:
        return (entry.stage, entry.kind, entry.microbatch, entry.start,
                entry.end)
    except AttributeError:
        raise TypeError(
            "A timeline entry must be a (stage, kind, microbatch, start, end) "
            "tuple or have those attributes. Received: "
            f"{entry!r}") from None
