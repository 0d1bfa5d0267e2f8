"""Why tfpar turns off DTensor's all-to-all relayout (see tfpar/__init__.py).

On TF 2.21 moving a split between two dimensions of a rank-4 tensor by an
all-to-all gives wrong values, silently: the fuzzing found a BatchNormal-
ization and a MultiHeadAttention with weights split over one mesh axis
training 40% away from one device (the attention's projections are rank-4
einsums). If `test_all_to_all_relayout_is_wrong_and_tfpar_setting_fixes_it`
starts failing on a newer TF because the default is fixed, the workaround
in tfpar/__init__.py can go.
"""

import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import tfpar

import fuzzing
import models
from test_fuzz_models import build, data

REPRO = Path(__file__).with_name("dtensor_all_to_all_repro.py")


def run_repro(setting, quick=True):
    env = dict(os.environ, REPRO_QUICK="1" if quick else "0")
    env.pop("DTENSOR_USE_ALL_TO_ALL_RELAYOUT", None)
    if setting is not None:
        env["DTENSOR_USE_ALL_TO_ALL_RELAYOUT"] = setting
    result = subprocess.run([sys.executable, str(REPRO)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()[-1]


def test_all_to_all_relayout_is_wrong_and_tfpar_setting_fixes_it():
    """Rank 4, one mesh axis moved: 6 of the 20 relayouts are wrong."""
    assert run_repro(None) == "wrong 6 of 20"   # TF's default
    assert run_repro("0") == "right 20"


@pytest.mark.slow  # every relayout of ranks 2-4 with both axes: ~1 min
def test_every_relayout_wrong_only_on_rank_4_and_right_with_tfpar_setting():
    assert run_repro(None, quick=False) == "wrong 36 of 618"
    assert run_repro("0", quick=False) == "right 618"


def test_importing_tfpar_turns_the_all_to_all_off():
    assert os.environ["DTENSOR_USE_ALL_TO_ALL_RELAYOUT"] == "0"


def test_the_fuzzing_case_trains_as_one_device():
    """The case the fuzzing found (shrunk): on extra=2, BatchNormalization's
    beta and a MultiHeadAttention's query bias split over `extra`; its
    first loss was 2.34 where one device's is 3.85."""
    trunk = [("batchnorm", 0), ("attention", 4), ("conv", 1)]
    keras.utils.set_random_seed(0)
    single = build(trunk, None)
    weights = single.get_weights()
    x, y = data(None)
    want = fuzzing.train(single, x, y, weights, models.BatchLosses())
    rules = {"batchnorm0/beta": ("extra",),
             "attention1/query/bias": ("extra", None)}
    mesh = tfpar.Mesh({"extra": 2}, devices=["CPU:0", "CPU:1"])
    with tfpar.ParallelStrategy(mesh, rules=rules).scope():
        model = build(trunk, None)
    got = fuzzing.train(model, x, y, weights, models.BatchLosses())
    exact = fuzzing.train_in_float64(lambda: build(trunk, None), x, y,
                                     weights)
    fuzzing.assert_parity(want[0], got[0], want[1], got[1], exact=exact)
    assert np.isfinite(got[0]).all()
