"""keras-hub's position table broadcast split over the batch
(`tfpar.hub_positions`).

keras-hub's `PositionEmbedding` returns `broadcast_to(table rows, (batch,
seq, hidden))`; in a tfpar step whose batch is split over the data axis
that broadcast is laid out split over data, so the table's gradient is
summed per device and all-reduced, not computed from an all-gather of the
residual stream's gradient (tests/test_batch_stays_split.py reads that off
GPT-2's default plan).

Here: the broadcast itself in a step (layout per device, gradient, the one
collective of its backward), and GPT-2 (tests/hub_models.py, built from
constructor arguments) trained beside one device with SGD under each way
its table can be laid out — its hidden dimension split over the model axis
and gathered after the lookup (the default plan), split and not gathered
(a raw spec, so the broadcast's last dimension stays split), its hidden
dimension split over the data axis (a raw spec), whole (a plan without the
embeddings), split over data too (fsdp), on a data-only mesh —
each in parity with one device (losses and every weight, 1e-4 relative),
each device holding its block of the table, no process abort, and no
activation gathered over data; and GPT-2 under context parallelism, its
broadcast split over the context axis along the sequence.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfpar
from tfpar import hub_positions, placement
from tfpar.reports import program as program_lib

import hub_models
import models
import test_context_parallel as context_checks
import test_keras_hub as hub_checks

MESH = {"data": 2, "model": 4}
TABLE = "position_embedding/embeddings"
HIDDEN = 32  # hub_models' GPT-2


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


def test_the_broadcast_is_split_over_data_in_a_step():
    """`broadcast_split_over_batch` in a step: the (3, 4) table broadcast
    to (8, 3, 4) holds each device's 4 batch rows only (TF's broadcast_to:
    all 8 on every device), and d table is the one-device sum over the
    batch of scale, summed per device and all-reduced over data; outside
    a step it is TF's broadcast_to."""
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(MESH))
    scale = np.arange(96, dtype="float32").reshape(8, 3, 4)
    blocks, _, _ = broadcast_step(strategy, tf.broadcast_to)
    assert set(blocks) == {(8, 3, 4)}  # what the patch changes
    blocks, grad, program = broadcast_step(
        strategy, hub_positions.broadcast_split_over_batch)
    assert set(blocks) == {(4, 3, 4)}
    np.testing.assert_array_equal(grad, scale.sum(axis=0))
    backward = program.collectives(program.backward_nodes())
    assert [(c.purpose, c.axes, c.shape) for c in backward] == [
        ("all-reduce", ("data",), (3, 4))], backward
    np.testing.assert_array_equal(
        hub_positions.broadcast_split_over_batch(tf.ones((1, 3)), (4, 2, 3)),
        np.ones((4, 2, 3)))


def auto(model, mesh):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # layers kept whole: not checked here
        return tfpar.auto_rules(model, mesh=mesh)


def megatron(table_spec=None):
    """The hand-written Megatron plan of GPT-2 (attention and MLP only: the
    embeddings whole), with `table_spec` for the position table if given."""
    styles = {"column": tfpar.ColumnParallel(), "row": tfpar.RowParallel()}

    def plan(model, mesh):
        rules = {pattern: styles[style] for pattern, style
                 in hub_models.MEGATRON_RULES["gpt2"].items()}
        if table_spec is not None:
            rules[".*" + TABLE] = table_spec
        return tfpar.LayoutRules(rules)
    return plan


# name: (mesh, plan, strategy options, the table's spec on the mesh).
# Before tfpar.hub_positions, "split_gathered" and "fsdp" all-gathered the
# residual stream's gradient over data; the others had no such gather and
# check that the broadcast's layouts train in parity without an abort:
# "split_not_gathered" keeps its last dimension split over the model axis,
# "split_over_data" has the broadcast's source split over the data axis
# along its last dimension (what asked DTensor for [data, ..., data] and
# aborted the process under the reverted patch of every float broadcast).
PLANS = {
    "split_gathered": (MESH, auto, {}, (None, "model")),
    "split_not_gathered": (MESH, megatron((None, "model")), {},
                           (None, "model")),
    "split_over_data": (MESH, megatron((None, "data")), {}, (None, "data")),
    "whole": (MESH, megatron(), {}, (None, None)),
    "fsdp": (MESH, auto, {"fsdp": True}, ("data", "model")),
    "data_only": ({"data": 8}, None, {}, (None, None)),
}


def train(mesh_shape=None, plan=None, **options):
    """(model, per-step losses, strategy) of GPT-2 after hub_checks.STEPS
    batches of fit with plain SGD(0.1), on one device when `mesh_shape` is
    None."""
    weights = hub_models.build("gpt2").get_weights()
    x, y = hub_models.data("gpt2", batch=hub_checks.BATCH * hub_checks.STEPS)
    strategy = None if mesh_shape is None else tfpar.ParallelStrategy(
        tfpar.Mesh(mesh_shape), **options)

    def build():
        model = hub_models.build("gpt2")
        model.set_weights(weights)
        if plan is not None:
            strategy.apply_rules(model, plan(model, strategy.mesh))
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=hub_models.loss("gpt2"), weighted_metrics=[])
        return model

    model, losses = models.train_built(strategy, build, x, y,
                                       hub_checks.BATCH)
    return model, losses, strategy


def activation_gathers(report):
    """The step's all-gathers over the data axis but fsdp's weight gathers
    (made where a weight is read: `.../ReadVariableOp/...`)."""
    return [c for c in report.select(purpose="all-gather", spans="data")
            if "/ReadVariableOp/" not in c.name]


def recorded_layouts(monkeypatch):
    """The sharding specs `hub_positions` gives each broadcast it is asked
    for in a step from now on (None: left to TF), as a list that grows."""
    seen = []
    original = hub_positions._split_layout  # noqa: SLF001

    def record(tensor, shape):
        layout = original(tensor, shape)
        seen.append(None if layout is None else layout.sharding_specs)
        return layout

    monkeypatch.setattr(hub_positions, "_split_layout", record)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_gpt2_trains_in_parity_with_its_table_split_over_the_batch(
        name, monkeypatch):
    mesh_shape, plan, options, table_spec = PLANS[name]
    reference, ref_losses, _ = train()
    layouts = recorded_layouts(monkeypatch)
    with tfpar.communication.capture() as programs:
        model, losses, strategy = train(mesh_shape, plan, **options)
    # The position table's broadcast, traced in the step, split over data
    # along the batch (the sequence and hidden dimensions: see the module).
    assert layouts and all(specs == ["data", dtensor.UNSHARDED, dtensor.MATCH]
                           for specs in layouts), layouts
    assert models.relative_error(ref_losses, losses) < 1e-4, (ref_losses,
                                                              losses)
    hub_checks.assert_same_weights(reference, model)
    specs = {path: spec for path, spec, _ in strategy.placements("params")}
    table = next(w for w in model.weights if w.path == TABLE)
    assert specs[TABLE] == table_spec, specs[TABLE]
    models.assert_one_block_per_device(table, table_spec)
    report = programs.train_report()
    gathered = activation_gathers(report)
    assert not gathered, "\n".join(
        f"{c.phase} {c.name} {c.shape}" for c in gathered)


@pytest.mark.slow
def test_gpt2_under_context_parallelism_keeps_its_sequence_split(monkeypatch):
    """GPT-2 on data=2 x context=4, load balanced (its rows' positions are
    looked up, so the broadcast's source is (1, seq, hidden)): in parity
    with one device (test_context_parallel's check), the broadcast split
    over data along the batch and over the context axis along the
    sequence, as the token embeddings it is added to."""
    layouts = recorded_layouts(monkeypatch)
    context_checks.assert_hub_parity("gpt2", balance=True)
    assert layouts and all(
        specs == ["data", "context", dtensor.MATCH] for specs in layouts
    ), layouts
