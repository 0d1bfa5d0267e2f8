"""The parallel dimensions declared once, in `ParallelDims`.

`ParallelStrategy(model_axis=..., virtual_stages=...)` declares the
tensor-parallel axis and the interleaving of pipelines; the styles,
`auto_rules` and `PipelineModel` read them when not given, and a value that
contradicts them is an error naming both. Parity oracle: single-device Keras
on the same weights and data (fp32, 1e-4 relative).
"""

import functools

import keras
import numpy as np
import pytest
from tensorflow.experimental import dtensor

import tfpar
from tfpar.parallel_dims import ParallelDims

import models

RTOL = 1e-4


def build_mlp():
    """16 -> 3 through four Dense layers (four parts: one per layer)."""
    return keras.Sequential(
        [keras.Input((16,))]
        + [keras.layers.Dense(32, activation="relu", name=f"d{i}")
           for i in range(3)]
        + [keras.layers.Dense(3, name="out")], name="mlp")


@functools.lru_cache(maxsize=None)
def initial_weights():
    keras.utils.set_random_seed(0)
    return tuple(build_mlp().get_weights())


def train(model):
    """Per-batch losses and final weights of 2 Adam steps of batch 32."""
    model.set_weights(list(initial_weights()))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    losses = models.BatchLosses()
    x, y = models.mlp_data()
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0,
              callbacks=[losses])
    return losses.losses, [np.asarray(w) for w in model.get_weights()]


@functools.lru_cache(maxsize=None)
def reference():
    return train(build_mlp())


def assert_parity(result, expected):
    losses, weights = result
    assert len(losses) == len(expected[0]) == 2
    assert models.relative_error(expected[0], losses) < RTOL
    for want, got in zip(expected[1], weights):
        assert models.relative_error(want, got) < RTOL


def interleaved(strategy_v, pipeline_v):
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 2, "data": 4}),
                                      virtual_stages=strategy_v)
    with strategy.scope():
        kwargs = {} if pipeline_v is None else {"virtual_stages": pipeline_v}
        return tfpar.PipelineModel(build_mlp(), num_microbatches=4, **kwargs)


def test_interleaved_pipeline_declared_in_the_dims_equals_one_declared_by_the_model():
    declared_once = interleaved(strategy_v=2, pipeline_v=None)
    by_the_model = interleaved(strategy_v=None, pipeline_v=2)
    for pipe in (declared_once, by_the_model):
        assert pipe.virtual_stages == pipe.schedule.virtual_stages == 2
        assert len(pipe.stages) == 4  # v × p parts, part k on stage k mod 2
    first = train(declared_once)
    assert_parity(first, reference())
    assert_parity(train(by_the_model), first)
    # The same value given twice is no contradiction.
    assert interleaved(strategy_v=2, pipeline_v=2).virtual_stages == 2
    assert interleaved(strategy_v=None, pipeline_v=None).virtual_stages == 1


def test_contradicting_virtual_stages_is_an_error_naming_both():
    with pytest.raises(ValueError, match=(
            r"PipelineModel\(virtual_stages=3\) contradicts the strategy's "
            r"ParallelStrategy\(virtual_stages=2\)")):
        interleaved(strategy_v=2, pipeline_v=3)
    with pytest.raises(ValueError, match=(
            r"ParallelStrategy\(virtual_stages\) needs an int >= 1 \(model "
            r"parts per stage\)\. Received: virtual_stages=0")):
        tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 2, "data": 4}),
                               virtual_stages=0)
    with pytest.raises(ValueError, match=(
            r"PipelineModel\(virtual_stages\) needs an int >= 1.*"
            r"virtual_stages=True")):
        interleaved(strategy_v=2, pipeline_v=True)


def test_styles_and_auto_rules_take_the_model_axis_from_the_dims():
    mesh = tfpar.Mesh({"data": 2, "tp": 4})
    strategy = tfpar.ParallelStrategy(mesh, model_axis="tp", rules={
        r".*d0": tfpar.ColumnParallel(), r".*d1": tfpar.RowParallel()})
    assert strategy.model_axis == strategy.dims.model_axis == "tp"
    assert strategy.dims.tensor_parallel_size == 4
    with strategy.scope():
        model = build_mlp()
        planned = dict(tfpar.auto_rules(model).items())  # axis, size: dims'
    assert planned["mlp/d0"] == tfpar.ColumnParallel("tp")
    assert planned["mlp/d1"] == tfpar.RowParallel("tp")
    specs = {p: s for p, s, _ in strategy.placements("params")}
    assert specs["mlp/d0/kernel"] == (None, "tp")
    assert specs["mlp/d0/bias"] == ("tp",)
    assert specs["mlp/d1/kernel"] == ("tp", None)
    # Each device holds only its block of d0's (16, 32) kernel.
    blocks = dtensor.unpack(model.get_layer("d0").kernel.value.read_value())
    assert [tuple(b.shape) for b in blocks] == [(16, 8)] * 8
    assert_parity(train(model), reference())


def test_an_axis_contradicting_the_dims_is_an_error_naming_both():
    mesh = tfpar.Mesh({"data": 2, "tp": 4})
    with pytest.raises(ValueError, match=(
            r"ColumnParallel\(axis='model'\) contradicts the strategy's model "
            r"axis ParallelStrategy\(model_axis='tp'\)")):
        tfpar.ParallelStrategy(mesh, model_axis="tp", rules={
            r".*d0": tfpar.ColumnParallel("model")})
    strategy = tfpar.ParallelStrategy(mesh, model_axis="tp")
    with strategy.scope():
        model = build_mlp()
        with pytest.raises(ValueError, match=(
                r"auto_rules\(axis='model'\) contradicts.*"
                r"model_axis='tp'")):
            tfpar.auto_rules(model, axis="model")
        with pytest.raises(ValueError, match=(
                r"RowParallel\(axis='x'\) contradicts.*model_axis='tp'")):
            strategy.apply_rules(model, {r".*d1": tfpar.RowParallel("x")})


def test_dims_validate_and_derive_the_dimensions():
    mesh = tfpar.Mesh({"pipe": 2, "data": 2, "model": 2})
    dims = ParallelDims(mesh, virtual_stages=3)
    assert (dims.num_stages, dims.parts_per_stage, dims.num_parts,
            dims.tensor_parallel_size) == (2, 3, 6, 2)
    assert ParallelDims(mesh).parts_per_stage == 1
    assert ParallelDims(mesh).virtual_stages is None  # not declared
    with pytest.raises(ValueError, match=(
            r"needs different data and model axes\. Received: "
            r"data_axis='data', model_axis='data'")):
        ParallelDims(mesh, model_axis="data")
    with pytest.raises(TypeError, match=r"model_axis.*Received: model_axis=4"):
        ParallelDims(mesh, model_axis=4)
    # Outside any strategy, styles and auto_rules default to "model".
    assert tfpar.ColumnParallel().axis == "model"
    assert tfpar.ColumnParallel() == tfpar.ColumnParallel("model")


def test_an_axis_with_no_role_is_an_error_naming_it():
    """Issue 38 item 5: `Mesh({"batch": 4})` with the default data_axis
    used to copy the whole batch to every device and train on."""
    with pytest.raises(ValueError, match=(
            r"Mesh axes \{'batch': 8\} play no role(?s:.*)"
            r"data_axis='data'(?s:.*)data_axis='batch'")):
        tfpar.ParallelStrategy(tfpar.Mesh({"batch": 8}))
    with pytest.raises(ValueError, match=r"\{'tp': 4\} play no role"):
        tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "tp": 4}))
    # Declared, by convention, named by a rule, or of size 1: valid.
    assert tfpar.ParallelStrategy(
        tfpar.Mesh({"batch": 8}), data_axis="batch").dims.data_parallel_size == 8
    tfpar.ParallelStrategy(tfpar.Mesh({"model": 8}))
    tfpar.ParallelStrategy(tfpar.Mesh({"extra": 2, "data": 4}),
                           rules={r"d0/kernel": (None, "extra")})
    tfpar.ParallelStrategy(tfpar.Mesh({"batch": 1, "data": 8}))


def test_every_role_has_one_axis_and_each_axis_one_role():
    dims = ParallelDims(tfpar.Mesh({"data": 2, "expert": 2, "context": 2}))
    assert [dims.role_of(a) for a in ("data", "expert", "context", "pipe",
                                      "model", "other")] == [
        "data", "expert", "context", "pipe", "model", None]
    assert (dims.data_parallel_size, dims.expert_parallel_size,
            dims.context_parallel_size) == (2, 2, 2)
    dims = ParallelDims(tfpar.Mesh({"data": 2, "ep": 4}), expert_axis="ep")
    assert dims.role_of("ep") == "expert" and dims.expert_parallel_size == 4
    with pytest.raises(ValueError, match=(
            r"different model and expert axes. Received: "
            r"model_axis='model', expert_axis='model'")):
        ParallelDims(tfpar.Mesh({"model": 8}), expert_axis="model")
    with pytest.raises(TypeError, match=r"context_axis\) needs a mesh axis"):
        ParallelDims(tfpar.Mesh({"data": 8}), context_axis=3)


def test_the_expert_axis_may_be_the_data_axis_and_no_other_role_may():
    """GShard's placement: expert_axis == data_axis is allowed (the data
    axis also splits the expert banks); its role stays "data"; any other
    pair of equal role axes is still an error."""
    dims = ParallelDims(tfpar.Mesh({"data": 8}), expert_axis="data")
    assert dims.experts_carry_data and dims.role_of("data") == "data"
    assert (dims.data_parallel_size, dims.expert_parallel_size) == (8, 8)
    assert not ParallelDims(tfpar.Mesh({"data": 2, "expert": 4})
                            ).experts_carry_data
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"batch": 8}),
                                      data_axis="batch", expert_axis="batch")
    assert strategy.dims.experts_carry_data
    for options, pair in ((dict(context_axis="data"), "data and context"),
                          (dict(expert_axis="data", context_axis="data"),
                           "data and context"),
                          (dict(expert_axis="pipe"), "pipe and expert")):
        with pytest.raises(ValueError, match=f"different {pair} axes"):
            ParallelDims(tfpar.Mesh({"data": 8}), **options)


def test_an_expert_axis_contradicting_the_dims_is_an_error_naming_both():
    """One rule for every role's axis (`ParallelDims.resolve_axis`)."""
    dims = ParallelDims(tfpar.Mesh({"data": 2, "ep": 4}), expert_axis="ep")
    assert dims.resolve_axis("expert", None, "auto_rules") == "ep"
    with pytest.raises(ValueError, match=(
            r"auto_rules\(expert_axis='expert'\) contradicts the strategy's "
            r"expert axis ParallelStrategy\(expert_axis='ep'\)")):
        dims.resolve_axis("expert", "expert", "auto_rules", "expert_axis")
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}))
    with strategy.scope():
        model = build_mlp()
        with pytest.raises(ValueError, match=r"expert_axis='ep'\) contra"):
            tfpar.auto_rules(model, expert_axis="ep")
