"""Zero-bubble schedules (ZB-H1, ZB-H2, ZB-V) as data: no devices, no TF
ops."""

import itertools
from collections import defaultdict

import pytest

from tfpar.pipeline import (
    Action,
    Schedule,
    format_timeline,
    get_schedule,
    one_f_one_b,
    theoretical_bubble_fraction,
    zero_bubble,
    zero_bubble_v,
)

# (name, p, m) with m at least what each schedule needs.
CASES = [("zb-h1", p, m) for p in (1, 2, 3, 4) for m in (p, p + 1, 2 * p, 8)] + [
    ("zb-h2", p, m) for p in (1, 2, 3, 4) for m in (2 * p - 1, 2 * p, 12)]
ZB = pytest.mark.parametrize("name,p,m", CASES)


@ZB
def test_every_f_b_w_once_in_order(name, p, m):
    schedule = get_schedule(name, p, m)
    assert schedule.split_backward and schedule.name == name
    for s, row in enumerate(schedule.actions):
        assert sorted(row, key=str) == sorted(
            (Action(s, k, i) for k in "FBW" for i in range(m)), key=str)
        at = {(a.kind, a.microbatch): n for n, a in enumerate(row)}
        for i in range(m):
            assert at[("F", i)] < at[("B", i)] < at[("W", i)]
        for kind in "FBW":  # micro-batches in order, per kind
            assert [a.microbatch for a in row if a.kind == kind] == list(range(m))


@ZB
@pytest.mark.parametrize("times", [(1.0, 2.0, 1.0), (1.0, 3.0, 1.0),
                                   (2.0, 3.0, 1.5)])
def test_simulation_respects_dependencies(name, p, m, times):
    forward, backward, weight = times
    timeline = get_schedule(name, p, m).simulate(forward, backward, weight)
    at = {(e.stage, e.kind, e.microbatch): e for e in timeline}
    assert len(at) == len(timeline) == 3 * p * m
    for s, i in itertools.product(range(p), range(m)):
        f, b, w = at[(s, "F", i)], at[(s, "B", i)], at[(s, "W", i)]
        assert (f.end - f.start, b.end - b.start, w.end - w.start) == (
            forward, backward - weight, weight)
        assert f.end <= b.start and b.end <= w.start
        if s + 1 < p:  # activations down, input gradients back up
            assert f.end <= at[(s + 1, "F", i)].start
            assert at[(s + 1, "B", i)].end <= b.start
    by_stage = defaultdict(list)
    for e in timeline:
        by_stage[e.stage].append(e)
    for entries in by_stage.values():
        entries.sort(key=lambda e: e.start)
        assert all(a.end <= b.start for a, b in zip(entries, entries[1:]))


@pytest.mark.parametrize("p,m", [(p, m) for p in (1, 2, 3, 4, 5)
                                 for m in (p, 2 * p, 3 * p + 1)])
def test_zb_h1_bubble_is_the_papers(p, m):
    """arXiv 2401.10241: ZB-H1 idles (p-1)(T_F + T_B - T_W) per stage,
    1F1B (p-1)(T_F + T_B + T_W); equal costs: a third, (p-1)/(3m+p-1) of
    the step. Its memory is 1F1B's peak: p micro-batches (stage 0's)."""
    zb = get_schedule("zb-h1", p, m)
    assert zb.bubble_fraction(1.0, 2.0, 1.0) == pytest.approx(
        theoretical_bubble_fraction(p, m, schedule="zb-h1"))
    assert theoretical_bubble_fraction(p, m, schedule="zb-h1") == (
        pytest.approx((p - 1) / (3 * m + p - 1)))
    for forward, b, w in [(1.0, 1.0, 0.5), (1.0, 1.5, 1.0), (1.0, 2.0, 1.0)]:
        makespan = max(e.end for e in zb.simulate(forward, b + w, w))
        idle = makespan - m * (forward + b + w)
        assert idle == pytest.approx((p - 1) * (forward + b - w))
        one = max(e.end for e in one_f_one_b(p, m).simulate(forward, b + w))
        assert one - m * (forward + b + w) == pytest.approx(
            (p - 1) * (forward + b + w))
    assert max(zb.peak_in_flight(s) for s in range(p)) == max(
        one_f_one_b(p, m).peak_in_flight(s) for s in range(p)) == p


@pytest.mark.parametrize("p,m", [(p, m) for p in (2, 3, 4)
                                 for m in (2 * p - 1, 2 * p, 12)])
def test_zb_h2_has_no_bubble_inside_any_stage(p, m):
    """ZB-H2 runs 2(p-s-1) warm-up forwards, holds up to 2p-1 micro-batches
    and never idles between a stage's first and last action: the paper's
    zero bubble (next step starts early). With the optimizer step
    synchronising the stages the fill (p-1) T_F remains, as for ZB-H1."""
    zb = get_schedule("zb-h2", p, m)
    assert zb.bubble_fraction(1.0, 2.0, 1.0, per_stage=True) == 0.0 == (
        theoretical_bubble_fraction(p, m, schedule="zb-h2"))
    assert zb.bubble_fraction(1.0, 2.0, 1.0) == pytest.approx(
        (p - 1) / (3 * m + p - 1))
    assert [zb.peak_in_flight(s) for s in range(p)] == [2 * p - 1] * p
    # ZB-H1 does idle inside its stages (the first stages wait in warm-up).
    assert get_schedule("zb-h1", p, m).bubble_fraction(
        1.0, 2.0, 1.0, per_stage=True) > 0


def test_measured_costs_give_a_printed_bubble():
    """Measured (unequal) costs: the simulator gives the bubble to print."""
    zb = get_schedule("zb-h1", 4, 8)
    bubble = zb.bubble_fraction(0.7, 1.9, 0.6)
    assert 0 < bubble < one_f_one_b(4, 8).bubble_fraction(0.7, 1.9)
    text = format_timeline(zb.simulate(1.0, 2.0, 1.0))
    assert "W = weight gradient" in text and "W0" in text


def test_zero_bubble_order_for_two_stages():
    assert [str(a) for a in zero_bubble("zb-h1", 2, 2).actions[1]] == [
        "1F0", "1B0", "1F1", "1B1", "1W0", "1W1"]
    assert [str(a) for a in zero_bubble("zb-h2", 2, 3).actions[0]] == [
        "0F0", "0F1", "0F2", "0B0", "0W0", "0B1", "0W1", "0B2", "0W2"]


def test_too_few_microbatches_and_interleaving_are_clear_errors():
    with pytest.raises(ValueError, match=r"'zb-h1' needs num_microbatches >= "
                       r"num_stages = 4.*Received: num_microbatches=3"):
        get_schedule("zb-h1", 4, 3)
    with pytest.raises(ValueError, match=r"'zb-h2' needs num_microbatches >= "
                       r"2 × num_stages - 1 = 7.*num_microbatches=6"):
        get_schedule("ZB-H2", 4, 6)
    with pytest.raises(ValueError, match=r"virtual_stages=2"):
        get_schedule("zb-h1", 2, 4, virtual_stages=2)
    # Unchecked (an epoch's smaller last batch): still a valid order.
    assert zero_bubble("zb-h2", 4, 2, check=False).num_microbatches == 2
    with pytest.raises(ValueError, match=r"weight_time.*<= backward_time"):
        get_schedule("zb-h1", 2, 2).simulate(1.0, 1.0, 2.0)


def test_bad_split_schedules_are_rejected():
    with pytest.raises(ValueError, match=r"0W0 comes before 0B0"):
        Schedule("bad", [[Action(0, "F", 0), Action(0, "W", 0),
                          Action(0, "B", 0)]])
    with pytest.raises(ValueError, match=r"stage 0 misses 0W1"):
        Schedule("bad", [[Action(0, "F", 0), Action(0, "B", 0),
                          Action(0, "W", 0), Action(0, "F", 1),
                          Action(0, "B", 1)]])
    with pytest.raises(ValueError, match=r"'W' \(the weight-gradient half"):
        Action(0, "X", 0)


# -- ZB-V: two chunks per stage in a V ---------------------------------------

ZBV = pytest.mark.parametrize("p,m", [(p, m) for p in (1, 2, 3, 4)
                                      for m in (2 * p - 1, 2 * p, 9)])


@ZBV
def test_zbv_runs_every_part_once_in_a_v(p, m):
    """2p parts, stage s holding part s (chunk 0) and 2p - 1 - s (chunk 1);
    every F, B, W of both chunks once, F before B before W, micro-batches
    in order per chunk and kind."""
    zbv = get_schedule("zbv", p, m)
    assert (zbv.name, zbv.virtual_stages, zbv.placement) == ("zbv", 2, "v")
    assert zbv.split_backward and zbv.num_parts == 2 * p
    for s, row in enumerate(zbv.actions):
        assert sorted(row, key=str) == sorted(
            (Action(s, k, i, c) for k in "FBW" for i in range(m)
             for c in (0, 1)), key=str)
        assert {zbv.part(a) for a in row} == {s, 2 * p - 1 - s}
        for c, kind in itertools.product((0, 1), "FBW"):
            assert [a.microbatch for a in row if a.kind == kind
                    and a.chunk == c] == list(range(m))
    assert [zbv.stage_and_chunk(k) for k in range(2 * p)] == [
        (s, 0) for s in range(p)] + [(s, 1) for s in reversed(range(p))]


@ZBV
def test_zbv_simulation_follows_the_v(p, m):
    """Activations go down chunk 0 and back up chunk 1 (part k feeds part
    k + 1, the turn on the last stage), input gradients the other way."""
    zbv = get_schedule("zbv", p, m)
    timeline = zbv.simulate(1.0, 2.0, 1.0)
    assert len(timeline) == 2 * 3 * p * m
    at = {(zbv.part(Action(e.stage, e.kind, e.microbatch, e.chunk)),
           e.kind, e.microbatch): e for e in timeline}
    for k, i in itertools.product(range(2 * p), range(m)):
        f, b, w = at[(k, "F", i)], at[(k, "B", i)], at[(k, "W", i)]
        assert f.end - f.start == 0.5  # a chunk is half a stage
        assert f.end <= b.start and b.end <= w.start
        if k + 1 < 2 * p:
            assert f.end <= at[(k + 1, "F", i)].start
            assert at[(k + 1, "B", i)].end <= b.start


@ZBV
def test_zbv_bubble_and_memory(p, m):
    """T_F = T_B = T_W: no stage idles inside its span (the paper's zero),
    and with the optimizer step synchronising the stages only the fill of
    p - 1 chunk forwards remains: (p-1)/(6m+p-1), half of ZB-H1's and
    ZB-H2's. Memory: at most 2p chunk-micro-batches per stage, each half a
    stage's activations: 1F1B's and ZB-H1's p micro-batches."""
    zbv = get_schedule("zbv", p, m)
    assert zbv.bubble_fraction(1.0, 2.0, 1.0, per_stage=True) == 0.0
    assert zbv.bubble_fraction(1.0, 2.0, 1.0) == pytest.approx(
        theoretical_bubble_fraction(p, m, schedule="zbv"))
    assert theoretical_bubble_fraction(p, m, schedule="zbv") == (
        pytest.approx((p - 1) / (6 * m + p - 1)))
    assert zbv.bubble_fraction(1.0, 2.0, 1.0) <= get_schedule(
        "zb-h2", p, m).bubble_fraction(1.0, 2.0, 1.0)
    assert max(zbv.peak_in_flight(s) for s in range(p)) == 2 * p
    # Measured (unequal) costs: a bubble to print, below 1F1B's.
    assert zbv.bubble_fraction(0.7, 1.9, 0.6) < one_f_one_b(
        p, m).bubble_fraction(0.7, 1.9) or p == 1


def test_zbv_clear_errors_and_a_smaller_last_batch():
    with pytest.raises(ValueError, match=r"'zbv' needs num_microbatches >= "
                       r"2 × num_stages - 1 = 5.*num_microbatches=4"):
        get_schedule("zbv", 3, 4)
    with pytest.raises(ValueError, match=r"exactly two model parts per "
                       r"stage.*virtual_stages=3"):
        get_schedule("zbv", 2, 4, virtual_stages=3)
    assert get_schedule("ZBV", 2, 4, virtual_stages=2).placement == "v"
    with pytest.raises(ValueError, match=r"placement must be one of"):
        Schedule("bad", one_f_one_b(2, 2).actions, placement="v")
    # Unchecked (an epoch's smaller last batch): still a valid V.
    for m in (1, 2, 3):
        small = zero_bubble_v(3, m, check=False)
        assert small.num_microbatches == m
        small.simulate(1.0, 2.0, 1.0)  # no deadlock
