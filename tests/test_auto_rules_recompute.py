"""auto_rules and tfpar.plan on models that recompute (`keras.RematScope`).

Recomputation changes neither which weights a layer reads nor any shape,
so a recomputed model gets the plan of the same model without it. The
symbolic trace behind both runs with Keras' recomputation off
(`tfpar._compat.remat_off`): TF's `tf.recompute_grad`, what Keras calls
when tfpar's replacement is not installed (`import tfpar` alone installs
nothing), refuses the keyword arguments (`training=`) every Keras layer
gets inside a graph (issue 17).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import pytest
from tensorflow.experimental import dtensor

import tfpar
from tfpar import _compat
from tfpar import recompute

import models

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import gpt  # noqa: E402

GPT = dict(vocab=32, seq_len=8, dim=32, heads=8, layers=2)

# Run in a fresh process: `import tfpar` only, so Keras' TF `remat` is
# still `tf.recompute_grad` (this suite's other modules install tfpar's).
_FRESH = r"""
import functools, json, sys, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, "examples")
import keras
import gpt
import tfpar
from tfpar import auto_plan, keras_graph
from keras.src.backend.tensorflow import core

GPT = dict(vocab=32, seq_len=8, dim=32, heads=8, layers=3)
HOST = tfpar.Cluster(num_hosts=1, devices_per_host=8, device_memory=1e9,
                     device_flops=1e10, intra_host_bandwidth=1e9,
                     inter_host_bandwidth=1e9)
TRACE = keras_graph.trace_layer_calls
tf_remat = core.remat


def sequential(remat):
    with keras.RematScope(mode="full" if remat else None):
        return keras.Sequential([
            keras.Input((16,)), keras.layers.Dense(64, name="up"),
            keras.layers.Dense(64, activation="relu", name="mid"),
            keras.layers.Dense(16, name="down")], name="mlp")


def functional(remat):
    x = keras.Input((8, 16))
    with keras.RematScope(mode="full" if remat else None):
        a = keras.layers.MultiHeadAttention(2, 8, name="attn")(x, x)
        h = keras.layers.Dense(32, activation="gelu", name="up")(a)
        h = keras.layers.Dense(16, name="down")(h)
    return keras.Model(x, h, name="block")


def rules(model, **kwargs):
    return [(p, repr(s)) for p, s in tfpar.auto_rules(model, **kwargs).items()]


out = {}
for by_node in (True, False):
    auto_plan._TRACES.clear()
    keras_graph.trace_layer_calls = functools.partial(TRACE, by_node=by_node)
    for remat in (False, True):
        model = gpt.build_gpt(recompute=remat, **GPT)
        key = f"{by_node}/{remat}"
        out["gpt/" + key] = rules(model, axis_size=2)
        out["gpt-sp/" + key] = rules(model, axis_size=2,
                                     sequence_parallel=True)
        out["sequential/" + key] = rules(sequential(remat), axis_size=2)
        out["functional/" + key] = rules(functional(remat), axis_size=2)
        out["remat modes/" + key] = sorted(
            str(layer._remat_mode) for layer in model.layers
            if layer._remat_mode is not None)
keras_graph.trace_layer_calls = TRACE
for remat in (False, True):
    plan = tfpar.plan(functools.partial(gpt.build_gpt, recompute=remat, **GPT),
                      16, cluster=HOST)
    out[f"plan/{remat}"] = [plan.axes, [(p, repr(s)) for p, s in
                                        plan.rules.items()],
                            len(plan.candidates),
                            sum(c.axes["model"] > 1 for c in plan.candidates)]
out["remat restored"] = core.remat is tf_remat
print(json.dumps(out))
"""


def _fresh_process():
    result = subprocess.run(
        [sys.executable, "-c", _FRESH], capture_output=True, text=True,
        timeout=600, cwd=ROOT,
        env={**os.environ, "KERAS_BACKEND": "tensorflow"})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_auto_rules_and_plan_of_recomputed_models_in_a_fresh_process():
    """The reported case: auto_rules on a GPT whose blocks are all under
    `RematScope(mode="full")`, traced node by node and whole, a Sequential
    and a functional model with attention, and tfpar.plan of a recomputed
    GPT builder: the same rules as without recomputation, and the model
    still recomputes (its layers' modes, Keras' `remat`, unchanged)."""
    out = _fresh_process()
    for by_node in (True, False):
        for name in ("gpt", "gpt-sp", "sequential", "functional"):
            want = out[f"{name}/{by_node}/False"]
            assert out[f"{name}/{by_node}/True"] == want, (name, by_node)
        assert out[f"remat modes/{by_node}/False"] == []
        # 5 layers in each of the fresh process's 3 blocks.
        assert len(out[f"remat modes/{by_node}/True"]) == 5 * 3
    assert dict(out["gpt/True/True"])["b0_attn"].startswith("ColumnParallel")
    assert dict(out["gpt/True/True"])["b2_down"].startswith("RowParallel")
    assert dict(out["sequential/True/True"]) == {  # the first pair
        "mlp/up": "ColumnParallel(axis='model')",
        "mlp/mid": "RowParallel(axis='model')"}
    assert "attn" in dict(out["functional/True/True"])
    # The planner considers the model-axis candidates too (before the fix
    # their layouts failed to trace and were silently dropped: measured
    # 80 of 244 candidates left for a 2-block GPT on 8 devices) and
    # chooses as without recomputation.
    assert out["plan/True"] == out["plan/False"]
    assert out["plan/True"][3] > 0  # candidates with a model axis
    assert out["remat restored"]


def _train(strategy, weights, x, y, recompute_blocks):
    with strategy.scope():
        model = gpt.build_gpt(recompute=recompute_blocks, **GPT)
        model.set_weights(weights)
        rules = tfpar.auto_rules(model, mesh=strategy.mesh)
        strategy.apply_rules(model, rules)
        gpt.compile_gpt(model)
    losses = models.BatchLosses()
    with tfpar.communication.capture() as programs:
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                  callbacks=[losses])
    return model, rules, losses.losses, programs.train_report()


# Slow: by default auto_rules of recomputed models is checked above and
# recomputation trains on data=2 x model=4 in tests/test_recompute.py.
@pytest.mark.slow
def test_recomputed_gpt_trains_with_auto_rules_like_one_device():
    """data=2×model=4: auto_rules on the recomputed GPT gives the rules of
    the GPT without recomputation, and trained with them it matches one
    device without recomputation (losses and weights, 1e-4); each device
    holds a quarter of a split weight, and the blocks are still recomputed
    (less kept for the backward pass)."""
    x, y = gpt.toy_corpus(32, vocab=GPT["vocab"], seq_len=GPT["seq_len"])
    keras.utils.set_random_seed(0)
    weights = gpt.build_gpt(**GPT).get_weights()
    reference, want = gpt.train(None, weights, x, y, 16, 2, **GPT)
    mesh = tfpar.Mesh({"data": 2, "model": 4})
    found = {}
    for remat in (False, True):
        found[remat] = _train(tfpar.ParallelStrategy(mesh), weights, x, y,
                              remat)
    model, rules, losses, report = found[True]
    assert [(p, repr(s)) for p, s in rules.items()] == \
        [(p, repr(s)) for p, s in found[False][1].items()]
    assert _compat.keras_tf_core().remat is recompute.recompute
    assert models.relative_error(want, losses) < 1e-4
    for a, b in zip(reference.weights, model.weights):
        if a.path.endswith("attn/key/bias"):
            # Its true gradient is zero (softmax ignores a per-query
            # constant): rounding noise only (measured ~1.6e-5 apart),
            # compared absolutely, far below the ~4 * 3e-3 that 4 Adam
            # steps of lr 3e-3 move a weight with a real gradient.
            assert abs(a.numpy() - b.numpy()).max() < 1e-4, a.path
            continue
        assert models.relative_error(a.numpy(), b.numpy()) < 1e-4, a.path
    query = model.get_layer("b0_attn")._query_dense.kernel  # noqa: SLF001
    shard = dtensor.unpack(query.value.read_value())[0]
    assert shard.shape == (GPT["dim"], GPT["heads"] // 4, GPT["dim"] // 8)
    # Each recomputed layer keeps only its inputs for the backward pass.
    kept = found[False][3]
    assert report.saved_activation_bytes < 0.7 * kept.saved_activation_bytes, (
        sorted(report.saved_activations), sorted(kept.saved_activations))
