"""keras-hub Mixtral with expert parallelism on two hosts (issue 36): two
processes on this machine, 4 virtual CPUs each, one data=2 x expert=4 mesh
over both (`tests/moe_keras_hub_hosts_child.py`), automatic rules and
automatic dispatch; the losses and weights on both hosts equal one
device's (keras-hub's masked blocks) within 1e-4."""

from pathlib import Path

import numpy as np
import pytest

import models
import test_moe_keras_hub as hub_test
from test_hosts import run_two_hosts

CHILD = Path(__file__).with_name("moe_keras_hub_hosts_child.py")


@pytest.mark.slow  # two TF processes training a keras-hub model
def test_mixtral_on_two_hosts_trains_as_one_device(tmp_path):
    run_two_hosts(CHILD, tmp_path)
    reference, want_losses, _, margins = hub_test.train("mixtral", "sgd")
    assert min(margins) > hub_test.ROUTER_MARGIN, margins
    for host in range(2):
        got = dict(np.load(tmp_path / f"host{host}.npz"))
        assert models.relative_error(want_losses, got["losses"]) < 1e-4
        for i, weight in enumerate(reference.weights):
            assert models.relative_error(
                weight.numpy(), got[f"w{i}"]) < 1e-4, (host, weight.path)
