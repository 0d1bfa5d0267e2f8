"""Pipeline schedules as pure data: no devices, no TensorFlow ops."""

import doctest
import itertools
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
    assert tuple(entry) == (0, "F", 0, 0, 1.0)


@pytest.mark.parametrize("module", [pipeline, pipeline.schedules, pipeline.timeline])
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
