"""Pipeline schedules as pure data: no devices, no TensorFlow ops."""

import doctest
import itertools
import re
from collections import defaultdict

import pytest

from tfpar import pipeline
from tfpar.pipeline import (
    Action,
    Schedule,
    TimelineEntry,
    bubble_fraction,
    format_timeline,
    get_schedule,
    gpipe,
    one_f_one_b,
    plot_schedule,
    theoretical_bubble_fraction,
)

STAGES = [1, 2, 3, 4]
MICROBATCHES = [1, 2, 4, 8]
GRID = pytest.mark.parametrize(
    "name,p,m", list(itertools.product(["gpipe", "1f1b"], STAGES, MICROBATCHES)))


@GRID
def test_every_action_appears_once_with_forward_before_backward(name, p, m):
    schedule = get_schedule(name, p, m)
    assert schedule.num_stages == p and schedule.num_microbatches == m
    assert len(schedule.actions) == p
    everything = [a for row in schedule.actions for a in row]
    expected = {Action(s, k, i) for s in range(p) for k in "FB" for i in range(m)}
    assert len(everything) == len(expected) == 2 * p * m
    assert set(everything) == expected
    for s, row in enumerate(schedule.actions):
        assert all(a.stage == s for a in row)
        position = {(a.kind, a.microbatch): n for n, a in enumerate(row)}
        for i in range(m):
            assert position[("F", i)] < position[("B", i)]


@GRID
@pytest.mark.parametrize("forward_time,backward_time", [(1.0, 1.0), (1.0, 2.0)])
def test_simulated_timeline_respects_dependencies(name, p, m, forward_time,
                                                  backward_time):
    timeline = get_schedule(name, p, m).simulate(forward_time, backward_time)
    assert len(timeline) == 2 * p * m
    at = {(e.stage, e.kind, e.microbatch): e for e in timeline}
    for s, i in itertools.product(range(p), range(m)):
        f, b = at[(s, "F", i)], at[(s, "B", i)]
        assert f.end - f.start == forward_time
        assert b.end - b.start == backward_time
        assert f.end <= b.start
        if s + 1 < p:
            # Activations flow down the pipe, gradients flow back up.
            assert f.end <= at[(s + 1, "F", i)].start
            assert at[(s + 1, "B", i)].end <= b.start
    by_stage = defaultdict(list)
    for e in timeline:
        by_stage[e.stage].append(e)
    for s, entries in by_stage.items():
        entries.sort(key=lambda e: e.start)
        # One action at a time per stage.
        for before, after in zip(entries, entries[1:]):
            assert before.end <= after.start
        for kind in "FB":
            order = [e.microbatch for e in entries if e.kind == kind]
            assert order == list(range(m)), (s, kind, order)


@GRID
def test_simulation_follows_each_stage_list_order(name, p, m):
    schedule = get_schedule(name, p, m)
    timeline = schedule.simulate()
    for s in range(p):
        ran = sorted((e for e in timeline if e.stage == s), key=lambda e: e.start)
        assert [Action(e.stage, e.kind, e.microbatch) for e in ran] == list(
            schedule.actions[s])


@pytest.mark.parametrize("p,m", list(itertools.product(STAGES, MICROBATCHES)))
def test_in_flight_micro_batches(p, m):
    f1b1, gp = one_f_one_b(p, m), gpipe(p, m)
    for s in range(p):
        assert f1b1.peak_in_flight(s) <= p - s <= p
        assert f1b1.peak_in_flight(s) == min(p - s, m)
        assert gp.peak_in_flight(s) == m
    with pytest.raises(ValueError, match=r"stage must be in \[0, 4\).*stage=4"):
        gpipe(4, m).peak_in_flight(4)


@GRID
@pytest.mark.parametrize("cost", [1.0, 0.5, 3.0])
def test_bubble_equals_theory_for_equal_costs(name, p, m, cost):
    timeline = get_schedule(name, p, m).simulate(cost, cost)
    # (p - 1) / (m + p - 1), exactly: times are sums of one cost.
    assert bubble_fraction(timeline) == (p - 1) / (m + p - 1)
    assert bubble_fraction(timeline) == theoretical_bubble_fraction(p, m)


@GRID
def test_bubble_with_backward_twice_forward(name, p, m):
    # Fill and drain each cost (p - 1) (t_f + t_b) out of (m + p - 1)(t_f + t_b):
    # the same fraction, for GPipe and 1F1B alike.
    schedule = get_schedule(name, p, m)
    makespan = max(e.end for e in schedule.simulate(1.0, 2.0))
    assert makespan == 3.0 * (m + p - 1)
    assert schedule.bubble_fraction(1.0, 2.0) == pytest.approx((p - 1) / (m + p - 1))


def test_one_f_one_b_phases():
    # p=4, m=6, stage 1: warm-up 2 forwards, 4 steady 1F1B pairs, 2 backwards.
    row = [str(a) for a in one_f_one_b(4, 6).actions[1]]
    assert row == ["1F0", "1F1",
                   "1F2", "1B0", "1F3", "1B1", "1F4", "1B2", "1F5", "1B3",
                   "1B4", "1B5"]
    # Last stage: no warm-up, pure alternation.
    assert [str(a) for a in one_f_one_b(4, 2).actions[3]] == ["3F0", "3B0", "3F1", "3B1"]
    # m < p degenerates to GPipe on the first stages (warm-up capped at m).
    assert one_f_one_b(4, 2).actions[0] == gpipe(4, 2).actions[0]


def test_action_string_and_validation():
    assert str(Action(1, "F", 0)) == "1F0"
    assert str(Action(0, "B", 3)) == "0B3"
    with pytest.raises(ValueError, match=r"'F' or 'B'.*kind='X'"):
        Action(0, "X", 0)
    with pytest.raises(ValueError, match=r"microbatch must be an integer >= 0"):
        Action(0, "F", -1)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_str_shows_one_row_per_stage(name):
    text = str(get_schedule(name, 3, 4))
    assert "1F0" in text and "0B3" in text and name in text
    assert [line.split("|")[0].strip() for line in text.splitlines()[1:]] == [
        "stage 0", "stage 1", "stage 2"]


def test_get_schedule_names_are_case_insensitive():
    assert get_schedule("GPipe", 2, 2).name == "gpipe"
    assert get_schedule("1F1B", 2, 2).name == "1f1b"


def test_unknown_schedule_name_is_rejected():
    with pytest.raises(ValueError) as info:
        get_schedule("interleaved", 2, 4)
    message = str(info.value)
    assert "name" in message
    assert "Received: name='interleaved'" in message
    assert "'gpipe'" in message and "'1f1b'" in message
    with pytest.raises(TypeError, match=r"Received: name=None"):
        get_schedule(None, 2, 4)


@pytest.mark.parametrize("build", [gpipe, one_f_one_b,
                                   lambda p, m: get_schedule("1f1b", p, m)])
def test_counts_below_one_are_rejected(build):
    with pytest.raises(ValueError,
                       match=r"num_stages must be >= 1. Received: num_stages=0"):
        build(0, 4)
    with pytest.raises(
            ValueError,
            match=r"num_microbatches must be >= 1. Received: num_microbatches=0"):
        build(2, 0)
    with pytest.raises(TypeError, match=r"num_stages must be an integer"):
        build(2.0, 4)


def test_bad_custom_schedules_are_rejected():
    with pytest.raises(ValueError, match=r"0B0 comes before 0F0"):
        Schedule("bad", [[Action(0, "B", 0), Action(0, "F", 0)]])
    with pytest.raises(ValueError, match=r"stage 0 misses 0B0"):
        Schedule("bad", [[Action(0, "F", 0)]])
    # Each list is valid alone, but 0B0 needs 1B0, which stage 1 runs after
    # 1F1, which needs 0F1, which stage 0 runs after 0B0: a cycle.
    crossed = Schedule("crossed", [
        [Action(0, "F", 0), Action(0, "B", 0), Action(0, "F", 1), Action(0, "B", 1)],
        [Action(1, "F", 1), Action(1, "F", 0), Action(1, "B", 0), Action(1, "B", 1)],
    ])
    with pytest.raises(ValueError, match=r"deadlocks.*0B0, 1F1"):
        crossed.simulate()


def test_format_timeline_accepts_tuples():
    timeline = [tuple(e) for e in gpipe(2, 2).simulate(1, 1)]
    text = format_timeline(timeline)
    assert text.splitlines()[:2] == ["stage 0 |F0 F1 ......B0 B1",
                                     "stage 1 |...F0 F1 B0 B1 ..."]
    assert "bubble 33.3%" in text


@pytest.mark.parametrize("as_tuples", [False, True])
def test_plot_schedule_writes_png(tmp_path, as_tuples):
    timeline = one_f_one_b(4, 8).simulate()
    if as_tuples:
        timeline = [tuple(e) for e in timeline]
    path = tmp_path / "schedule.png"
    assert plot_schedule(timeline, str(path), title="1F1B p=4 m=8") == str(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_timeline_entries_are_tuples():
    entry = gpipe(1, 1).simulate()[0]
    assert isinstance(entry, TimelineEntry)
    assert tuple(entry) == (0, "F", 0, 0, 1.0, 0)
    assert TimelineEntry(1, "B", 2, 0.5, 1.5) == (1, "B", 2, 0.5, 1.5, 0)


# -- interleaved schedules (virtual stages) ----------------------------------

INTERLEAVED = pytest.mark.parametrize("name,p,m,v", [
    (name, p, m, v) for name in ("gpipe", "1f1b") for p in (1, 2, 4)
    for m in (p, 2 * p, 4 * p) for v in (2, 3)])


@INTERLEAVED
def test_interleaved_schedules_run_every_chunk_once(name, p, m, v):
    schedule = get_schedule(name, p, m, virtual_stages=v)
    assert (schedule.num_stages, schedule.num_microbatches,
            schedule.virtual_stages, schedule.num_parts) == (p, m, v, p * v)
    for s, row in enumerate(schedule.actions):
        assert sorted(row, key=str) == sorted(
            (Action(s, k, i, c) for c in range(v) for k in "FB"
             for i in range(m)), key=str)
    # Part k = chunk * p + stage: stage s holds parts s, s + p, s + 2p, ...
    parts = {schedule.part(a) for row in schedule.actions for a in row}
    assert parts == set(range(p * v))
    assert all(schedule.part(a) % p == s
               for s, row in enumerate(schedule.actions) for a in row)


@INTERLEAVED
def test_interleaved_timeline_respects_dependencies_between_parts(name, p, m, v):
    schedule = get_schedule(name, p, m, virtual_stages=v)
    timeline = schedule.simulate(1.0, 2.0)
    at = {(e.chunk * p + e.stage, e.kind, e.microbatch): e for e in timeline}
    assert len(at) == len(timeline) == 2 * p * v * m
    for k, i in itertools.product(range(p * v), range(m)):
        f, b = at[(k, "F", i)], at[(k, "B", i)]
        assert f.end - f.start == pytest.approx(1.0 / v)
        assert b.end - b.start == pytest.approx(2.0 / v)
        assert f.end <= b.start
        if k + 1 < p * v:  # activations to part k+1, its gradients back
            assert f.end <= at[(k + 1, "F", i)].start
            assert at[(k + 1, "B", i)].end <= b.start
    order = schedule.execution_order()
    assert [(a.stage, a.kind, a.microbatch, a.chunk) for a in order] == [
        (e.stage, e.kind, e.microbatch, e.chunk) for e in timeline]


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (4, 16, 2),
                                   (3, 6, 3)])
def test_interleaved_1f1b_shrinks_the_bubble_as_megatron_says(p, m, v):
    """Narayanan et al. 2021: the bubble goes from (p-1)/(m+p-1) to
    (p-1)/(vm+p-1); stage s keeps (p-s-1)*2 + (v-1)*p + 1 chunk
    activations alive (Megatron-LM's warm-up plus one), all m*v if m == p.
    Looped GPipe matches that bubble for m >= p, not below."""
    interleaved = one_f_one_b(p, m, virtual_stages=v)
    assert interleaved.bubble_fraction(1.0, 1.0) == pytest.approx(
        theoretical_bubble_fraction(p, m, v)) == pytest.approx(
        (p - 1) / (v * m + p - 1))
    assert interleaved.bubble_fraction(1.0, 1.0) < one_f_one_b(
        p, m).bubble_fraction(1.0, 1.0)
    for s in range(p):
        assert interleaved.peak_in_flight(s) == min(
            (p - s - 1) * 2 + (v - 1) * p + 1, m * v)
        assert one_f_one_b(p, p, v).peak_in_flight(s) == p * v  # all warm-up
    # 1F1B in steady state: stage 0 never holds all m * v chunk-batches
    # once m is larger than p (GPipe does).
    assert gpipe(p, m, v).peak_in_flight(0) == m * v
    assert gpipe(p, m, v).bubble_fraction(1.0, 1.0) == pytest.approx(
        theoretical_bubble_fraction(p, m, v))
    if p > 1:
        assert gpipe(p, p - 1, v).bubble_fraction(1.0, 1.0) > \
            theoretical_bubble_fraction(p, p - 1, v)
    if m > p:
        assert interleaved.peak_in_flight(0) < m * v


def test_interleaved_1f1b_order_matches_megatron():
    """p=2, v=2, m=4: micro-batches go through chunk 0 in groups of p, then
    chunk 1; backwards walk the chunks in reverse. Warm-up (p-s-1)*2 +
    (v-1)*p forwards: 4 on stage 0, 2 on stage 1; with m == p every
    forward is warm-up (Megatron-LM's all_warmup_microbatches)."""
    schedule = one_f_one_b(2, 4, 2)
    assert [str(a) for a in schedule.actions[0]] == [
        "0F0", "0F1", "0F0.1", "0F1.1", "0F2", "0B0.1", "0F3", "0B1.1",
        "0F2.1", "0B0", "0F3.1", "0B1", "0B2.1", "0B3.1", "0B2", "0B3"]
    assert [str(a) for a in schedule.actions[1]] == [
        "1F0", "1F1", "1F0.1", "1B0.1", "1F1.1", "1B1.1", "1F2", "1B0",
        "1F3", "1B1", "1F2.1", "1B2.1", "1F3.1", "1B3.1", "1B2", "1B3"]
    for row in one_f_one_b(2, 2, 2).actions:
        assert [a.kind for a in row] == ["F"] * 4 + ["B"] * 4
        assert [(a.microbatch, a.chunk) for a in row] == [
            (0, 0), (1, 0), (0, 1), (1, 1), (0, 1), (1, 1), (0, 0), (1, 0)]
    assert str(one_f_one_b(2, 2, 2)).splitlines()[0] == (
        "1f1b schedule, 2 stages x 2 chunks x 2 micro-batches")


def test_interleaved_1f1b_needs_microbatches_multiple_of_stages():
    with pytest.raises(ValueError, match=r"multiple of num_stages \(4\)\. "
                                         r"Received: num_microbatches=6"):
        one_f_one_b(4, 6, virtual_stages=2)
    assert gpipe(4, 6, virtual_stages=2).num_microbatches == 6
    with pytest.raises(ValueError, match="virtual_stages must be >= 1"):
        get_schedule("1f1b", 2, 2, virtual_stages=0)


def test_interleaved_schedule_validation_and_rendering():
    with pytest.raises(ValueError, match=r"chunks 0\.\.1"):
        Schedule("bad", [[Action(0, "F", 0, 2), Action(0, "B", 0, 2)]],
                 virtual_stages=2)
    with pytest.raises(ValueError, match=r"0B0\.1 comes before 0F0\.1"):
        Schedule("bad", [[Action(0, "F", 0), Action(0, "B", 0, 1),
                          Action(0, "F", 0, 1), Action(0, "B", 0)]])
    with pytest.raises(ValueError, match=r"misses 0F0\.1, 0B0\.1"):
        Schedule("bad", [[Action(0, "F", 0), Action(0, "B", 0)]],
                 virtual_stages=2)
    text = format_timeline(gpipe(2, 1, 2).simulate(1.0, 1.0))
    assert re.findall(r"[FB]\d(?:\.\d)?", text.splitlines()[0]) == [
        "F0", "F0.1", "B0.1", "B0"]


@pytest.mark.parametrize("module", [pipeline, pipeline.schedules, pipeline.timeline,
                                    pipeline.profiler])
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
