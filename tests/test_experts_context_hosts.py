"""Mixture of experts and context parallelism on two hosts (issues 36 and
39): two processes on this machine, 4 virtual CPUs each, one mesh over
both (`tests/experts_context_hosts_child.py`); losses and weights equal one
device's, on both hosts."""

from pathlib import Path

import keras
import numpy as np
import pytest

import context_models
import models
import test_context_parallel as context_test
import test_moe_layer as moe_test
from test_hosts import run_two_hosts

CHILD = Path(__file__).with_name("experts_context_hosts_child.py")


@pytest.mark.slow  # two TF processes training three models
def test_experts_and_context_on_two_hosts_train_as_one_device(tmp_path):
    run_two_hosts(CHILD, tmp_path)
    results = [dict(np.load(tmp_path / f"host{i}.npz")) for i in range(2)]
    want_losses, want_weights, _, _ = moe_test.train(num_experts=8)
    want_weights = np.concatenate([w.ravel() for w in want_weights.values()])
    x, y = context_models.corpus(context_test.N, seq_len=context_test.SEQ)
    keras.utils.set_random_seed(0)
    initial = context_models.causal_transformer(
        **context_test.CONFIG).get_weights()
    _, context_losses = context_test.train(None, initial, x, y)
    for got in results:
        for name in ("expert_axis", "experts_on_data"):
            assert models.relative_error(
                want_losses, got[f"{name}_losses"]) < 1e-4, name
            assert models.relative_error(
                want_weights, got[f"{name}_weights"]) < 1e-4, name
        assert models.relative_error(
            context_losses, got["context_losses"]) < 1e-4
