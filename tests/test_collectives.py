"""Communication you can check: collectives in the compiled steps.

Megatron's MLP pair (column -> row) needs exactly one all-reduce in the
forward pass (summing the row-parallel partial products) and one in the
backward pass (summing the column-parallel input gradients), except that
the first pair's input is data and needs no gradient. Two pairs on
Mesh({"model": 8}) therefore give 2 all-reduces to predict and 2 + 1 to
train. A transformer layer under Megatron tensor parallelism needs 2
all-reduces of the (b, s, h) activation forward (after attention, after the
MLP) and 2 backward.

The counts come from DTensor's SPMD-expanded programs, read in this process
by `tfpar.communication` from the runtime's function library. The MLP test
checks that reader against the files TF itself dumps (in a child process:
TF reads TF_DUMP_GRAPH_PREFIX once, at start).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import pytest

import tfpar

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import gpt  # noqa: E402

CHILD = Path(__file__).with_name("collectives_child.py")


def test_megatron_mlp_pairs_need_one_all_reduce_each_way(tmp_path):
    env = dict(os.environ, TF_DUMP_GRAPH_PREFIX=str(tmp_path),
               TF_DUMP_GRAPH_NAME_FILTER="*")
    result = subprocess.run([sys.executable, str(CHILD)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    counts = json.loads(result.stdout.strip().splitlines()[-1])
    assert counts["dump"]["predict"] == {"CollectiveReduceV2": 2}
    assert counts["dump"]["train"] == {"CollectiveReduceV2": 3}
    # The in-process reader sees what TF dumps, for fit's own step and for
    # the copy communication_report compiles.
    assert counts["capture"] == counts["dump"]
    assert counts["report"]["train"] == counts["dump"]["train"]


# b=8 sequences of s=8 tokens, h=32, on Mesh({"model": 4}) of CPU:0-3.
GPT = dict(vocab=32, seq_len=8, dim=32, heads=8, layers=2)
BATCH, MODEL = 8, 4


@pytest.fixture(scope="module")
def gpt_report():
    mesh = tfpar.Mesh({"model": MODEL},
                      devices=[f"CPU:{i}" for i in range(MODEL)])
    strategy = tfpar.ParallelStrategy(mesh)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = gpt.build_gpt(**GPT)
        strategy.apply_rules(model, tfpar.auto_rules(model, mesh=mesh))
        gpt.compile_gpt(model)
        model.optimizer.build(model.trainable_variables)  # Adam moments exist
    x, y = gpt.toy_corpus(BATCH, vocab=GPT["vocab"], seq_len=GPT["seq_len"])
    def state():
        return [v.numpy() for v in model.weights + model.optimizer.variables]

    before = state()
    report = tfpar.communication_report(model, x, y)
    return report, before, state()


def test_transformer_layers_need_two_all_reduces_each_way(gpt_report):
    report = gpt_report[0]
    layers, message = GPT["layers"], BATCH * GPT["seq_len"] * GPT["dim"] * 4
    forward = report.select(axes=("model",), phase="forward")
    backward = report.select(axes=("model",), phase="backward")
    # Forward: the embeddings' hidden-wise gather (once; DTensor sums the
    # token and position gathers into one all-reduce) + 2 per layer.
    assert [c.purpose for c in forward].count("all-gather") == 1
    assert [c.purpose for c in forward].count("all-reduce") == 2 * layers
    assert len(backward) == 2 * layers
    assert all(c.kind == "all-reduce" and c.purpose == "all-reduce"
               for c in backward)
    # Every one moves the whole (b, s, h) activation over the model axis.
    assert {c.bytes for c in forward + backward} == {message}
    assert {c.group_size for c in forward + backward} == {MODEL}


def test_bytes_per_step_match_megatron_formula(gpt_report):
    report = gpt_report[0]
    formula = tfpar.communication.megatron_tp_bytes(
        BATCH, GPT["seq_len"], GPT["dim"], GPT["layers"], MODEL)
    in_layers = [c for c in report.collectives
                 if c.axes == ("model",) and c.purpose == "all-reduce"]
    assert len(in_layers) == formula["count"]
    assert sum(c.bytes for c in in_layers) == formula["bytes"]
    assert sum(c.ring_bytes for c in in_layers) == pytest.approx(
        formula["ring_bytes"])
    # Total = the layers + the embedding gather; nothing else on one axis.
    gather = report.total_bytes(purpose="all-gather")
    assert report.total_bytes() == formula["bytes"] + gather
    text = str(report)
    assert "all-reduce" in text and f"{report.total_bytes()} bytes" in text


def test_report_leaves_the_model_unchanged(gpt_report):
    _, before, after = gpt_report  # weights, Adam moments, iterations
    assert before and len(before) == len(after)
    for a, b in zip(before, after):
        assert (a == b).all()


def test_report_errors_name_what_to_fix():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="built under a tfpar.ParallelStrategy"):
        tfpar.communication_report(model, [[1.0] * 4], [[0.0] * 2])
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"model": 8}))
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="not compiled.*model.compile"):
        tfpar.communication_report(model, [[1.0] * 4] * 8, [[0.0] * 2] * 8)
    with pytest.raises(TypeError, match="Received: str"):
        tfpar.communication_report("model")
    with pytest.raises(RuntimeError, match="No DTensor-expanded program"):
        tfpar.communication.report_for_traced("__inference_not_a_function_1")
    with tfpar.communication.capture() as nothing:
        pass
    with pytest.raises(RuntimeError, match="exactly one training step.*Received: 0"):
        nothing.train_report()


def test_dtensor_cpu_lowering_of_sequence_parallel_collectives():
    """What DTensor 2.21 compiles on CPU for Megatron-SP's collectives (see
    tests/dtensor_sp_collectives_repro.py). If this fails on a newer TF,
    the README's sequence-parallel figures and notes need updating."""
    repro = Path(__file__).with_name("dtensor_sp_collectives_repro.py")
    env = {k: v for k, v in os.environ.items()
           if k != "LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2"}
    result = subprocess.run([sys.executable, str(repro)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    # An all-gather is an all-reduce of zero-padded blocks; a reduce-scatter
    # an all-reduce then a slice; the real gather fails over two axes.
    assert found["gather"] == ["CollectiveReduceV2"]
    assert found["reduce_scatter"] == ["CollectiveReduceV2"]
    assert found["gather_v2"].startswith("fails:")
