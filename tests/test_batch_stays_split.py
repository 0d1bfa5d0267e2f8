"""Activations stay split over the data axis in keras-hub training steps.

An all-gather over the data axis of an activation (or of its gradient)
makes a tensor that should stay split by batch whole on every data replica:
bytes moved for nothing, and every replica then computes that op on the
whole batch.

These tests train a keras-hub model beside one device (same weights and
data, the parity checks of tests/test_keras_hub.py) and read the compiled
step (`tfpar.communication.capture`). What they assert of it: no collective
whose DTensor purpose is an all-gather spans the data axis, forward or
backward (the default plan has no fsdp, so no weight is gathered over data
either: every data-axis all-gather would be an activation's or an
activation gradient's).

GPT-2 is the case this guards: on data=2 x model=4 it all-gathered its
residual stream's gradient over data (`AddN_13`, per-device (8, 8, 8))
until `tfpar.hub_positions` laid keras-hub PositionEmbedding's
`broadcast_to(table, (batch, seq, hidden))` out split over data (DTensor
2.21 laid it out whole along the batch, so the table's gradient, a sum
over the batch, was computed on every device from the whole batch).
Llama, which has no position table, compiled no data-axis gather before
either; it is here so that a rotary or mask broadcast that gathers the
batch fails this test. The other layouts of GPT-2's table (split and not
gathered, whole, fsdp, a data-only mesh): tests/test_hub_positions.py.
"""

import pytest

import tfpar

import hub_models
import models
import test_keras_hub as hub_checks

MESH = {"data": 2, "model": 4}


def train_step_report(name):
    """Trains `name` with the default plan on data=2 x model=4 and on one
    device, checks parity (losses, every weight after plain SGD, the
    attention and MLP kernels split over "model") and returns the report of
    the compiled training step."""
    reference, ref_losses, _ = hub_checks.train(name, "sgd")
    with tfpar.communication.capture() as programs:
        model, losses, strategy = hub_checks.train(name, "sgd", MESH,
                                                   hub_checks.auto)
    assert models.relative_error(ref_losses, losses) < 1e-4, (ref_losses,
                                                              losses)
    hub_checks.assert_same_weights(reference, model)
    hub_checks.check_split(name, model, strategy)
    return programs.train_report()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_no_activation_is_gathered_over_the_data_axis(name):
    report = train_step_report(name)
    gathered = report.select(purpose="all-gather", spans="data")
    assert not gathered, "\n".join(
        f"{c.phase} {c.name} {c.shape}" for c in gathered)
