"""Activations stay split over the data axis in keras-hub training steps.

An all-gather over the data axis of an activation (or of its gradient)
makes a tensor that should stay split by batch whole on every data replica:
bytes moved for nothing, and every replica then computes that op on the
whole batch. Measured on TF 2.21 before `collectives.
broadcast_split_over_data`: keras-hub GPT-2 on data=2 x model=4 with the
default plan (`tfpar.auto_rules`) all-gathered the gradient of its
residual stream over the data axis (`AddN_13`, per-device (8, 8, 8) = 2,048
B), because PositionEmbedding's `broadcast_to(table, (batch, seq,
hidden))` was laid out whole along the batch and its gradient (a sum over
the batch) was then computed on every device from the whole batch.

These tests train GPT-2 and Llama beside one device (same weights and data,
the parity checks of tests/test_keras_hub.py) and read the compiled step
(`tfpar.communication.capture`). What they assert of it: no collective
whose DTensor purpose is an all-gather spans the data axis, forward or
backward (the default plan has no fsdp, so no weight is gathered over data
either: every data-axis all-gather would be an activation's or an
activation gradient's); and, for GPT-2, the position table's gradient is
summed per device and all-reduced over data at its own (seq, hidden / 4)
size. (Llama, which has no position table, compiled no data-axis gather
before the fix either; it is here so a rotary or mask broadcast that
gathers the batch fails this test.)
"""

import re

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfpar
from tfpar import collectives, placement
from tfpar.reports import program as program_lib

import hub_models
import models
import test_keras_hub as hub_checks

MESH = {"data": 2, "model": 4}
POSITION_GRADIENT = "gradient_tape/.*position_embedding"


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
    for a, b in zip(reference.weights, model.weights):
        assert a.path == b.path
        if hub_checks.ZERO_GRADIENT.fullmatch(a.path):
            assert np.abs(a.numpy() - b.numpy()).max() < 1e-4, a.path
            continue
        assert models.relative_error(a.numpy(), b.numpy()) < 1e-4, a.path
    hub_checks.check_split(name, model, strategy)
    return programs.train_report()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_no_activation_is_gathered_over_the_data_axis(name):
    report = train_step_report(name)
    gathered = report.select(purpose="all-gather", spans="data")
    assert not gathered, "\n".join(
        f"{c.phase} {c.name} {c.shape}" for c in gathered)
    if name == "gpt2":
        # d table = sum over the batch of dy: each device sums its 4 rows,
        # then one all-reduce over data of its (seq, hidden / 4) block.
        position = [c for c in report.select(spans="data")
                    if re.match(POSITION_GRADIENT, c.name)]
        assert [(c.purpose, c.axes, c.shape) for c in position] == [
            ("all-reduce", ("data",), (hub_models.SEQ_LEN, 32 // 4))], report


def broadcast_step(strategy, broadcast):
    """(per-device blocks of the broadcast, d loss / d table, the traced
    step's program) of sum(broadcast(table, (8, 3, 4)) * scale), scale
    split over data along the batch."""
    table = np.arange(12, dtype="float32").reshape(3, 4)
    scale = np.arange(96, dtype="float32").reshape(8, 3, 4)

    def step(table, scale):
        with tf.GradientTape() as tape:
            tape.watch(table)
            out = broadcast(table, (8, 3, 4))
            loss = tf.reduce_sum(out * scale)
        return out, strategy.extended.replicate(tape.gradient(loss, table))

    traced = tf.function(lambda t, s: strategy.run(step, args=(t, s)))
    placed = (placement.put(table, (None, None), strategy.mesh),
              placement.put(scale, ("data", None, None), strategy.mesh))
    out, grad = traced(*placed)
    name = traced.get_concrete_function(*placed).name
    name = name.decode() if isinstance(name, bytes) else name
    return ([tuple(b.shape) for b in dtensor.unpack(out)],
            placement.fetch(grad), program_lib.program_for_traced(name))


def test_a_broadcast_along_the_batch_is_split_over_data_in_a_step():
    """`collectives.broadcast_split_over_data` in a step: the (3, 4) table
    broadcast to (8, 3, 4) holds each device's 4 batch rows only (TF's
    broadcast_to: all 8 on every device), and d table is the one-device
    sum over the batch of scale, summed per device and all-reduced over
    data."""
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(MESH))
    scale = np.arange(96, dtype="float32").reshape(8, 3, 4)
    blocks, grad, _ = broadcast_step(strategy, tf.broadcast_to)
    assert set(blocks) == {(8, 3, 4)}  # what the patch changes
    blocks, grad, program = broadcast_step(
        strategy, collectives.broadcast_split_over_data)
    assert set(blocks) == {(4, 3, 4)}
    np.testing.assert_array_equal(grad, scale.sum(axis=0))
    backward = program.collectives(program.backward_nodes())
    assert [(c.purpose, c.axes) for c in backward
            if c.phase == "backward"] == [("all-reduce", ("data",))], backward
