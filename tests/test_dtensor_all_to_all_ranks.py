"""Why `tfpar.collectives.all_to_all` gathers and slices (n times the bytes
of a true all-to-all) instead of using DTensor's all-to-all: measured on
TF 2.21 by tests/dtensor_all_to_all_ranks_repro.py (pure TF + DTensor, in a
subprocess: the switch is process-wide).

1. TF reads DTENSOR_USE_ALL_TO_ALL_RELAYOUT once per process (a static in
   EnableAllToAllForRelayout), at the first relayout it expands: tfpar
   cannot turn the all-to-all on for one relayout only.
2. With it on, moving a split between two of dimensions 1-3 of a rank-4
   tensor is wrong for every pair, and 8 of the 12 such moves of a rank-5
   tensor; moves of ranks 2 and 3, and every move to or from dimension 0,
   are right.
3. Folded to a rank-3 view (transpose to (0, c, s, rest), merge s with the
   rest, move 1 -> 2, undo), every move is right and the compiled forward
   sends one all-to-all of the block (768 bytes) instead of the gather's
   zero-padded all-reduce of the block with the concatenated dimension
   whole (3072 bytes: n = 4 times). But only with the switch on for the
   whole process, where DTensor's own rank-4 relayouts (inside its einsum
   and batch-norm expansions) are wrong (tests/test_dtensor_all_to_all.py).

When one of these assertions fails on a newer TF, revisit `all_to_all`:
if the direct moves become right, the switch can go on (tfpar/__init__.py)
and `all_to_all` can relayout directly (or folded) for n times fewer bytes.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPRO = Path(__file__).with_name("dtensor_all_to_all_ranks_repro.py")
RANK_4 = "r4 1>2, r4 1>3, r4 2>1, r4 2>3, r4 3>1, r4 3>2"
BYTES_ON = ("bytes through_whole [('CollectiveReduceV2', 3072)] "
            "folded [('CollectiveAllToAllV2', 768)]")


def run_repro(first, quick):
    env = dict(os.environ, REPRO_FIRST=first,
               REPRO_QUICK="1" if quick else "0")
    result = subprocess.run([sys.executable, str(REPRO)], env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()[-4:]


def test_all_to_all_switch_is_per_process_wrong_on_rank_4_right_folded():
    """Ranks 3 and 4 with dimension 0 split over data (~15 s)."""
    assert run_repro("1", quick=True) == [
        "flag read once: yes",
        f"direct wrong 6 of 8: {RANK_4}",
        "folded wrong 0 of 8",
        BYTES_ON,
    ]


@pytest.mark.slow  # ranks 2-5, every pair, with and without the data split
def test_every_rank_and_pair_with_the_switch_on_and_off():
    """~30 s + ~30 s."""
    rank_4 = RANK_4.split(", ")
    rank_5 = ["r5 1>2", "r5 1>3", "r5 1>4", "r5 2>1", "r5 3>1", "r5 3>4",
              "r5 4>1", "r5 4>3"]
    wrong = [f"{case} nobatch" for case in rank_4] + rank_4 + [
        f"{case} nobatch" for case in rank_5] + rank_5
    assert run_repro("1", quick=False) == [
        "flag read once: yes",
        f"direct wrong 28 of 60: {', '.join(wrong)}",
        "folded wrong 0 of 60",
        BYTES_ON,
    ]
    # Off first (tfpar's setting): every move right, by a gather, whatever
    # the environment says later.
    assert run_repro("0", quick=False) == [
        "flag read once: yes",
        "direct wrong 0 of 60",
        "folded wrong 0 of 60",
        "bytes through_whole [('CollectiveReduceV2', 3072)] "
        "folded [('CollectiveReduceV2', 3072)]",
    ]
