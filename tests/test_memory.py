"""fsdp that frees gathered weights (`reshard_after_forward=True`) and the
per-device memory report of a step (`tfpar.memory_report`).

Parity with one device; the compiled step keeps no gathered weight for the
backward pass and gathers again there (counted by the communication
report); the report's figures equal the analytic ones for replicated data
parallelism, fsdp with and without freeing, fsdp + recomputation and
tensor parallelism.
"""

import contextlib

import keras
import pytest

import tfpar

import models
import test_parity as parity

WIDTHS = (64, 128, 128, 64)   # 16 -> 64 -> 128 -> 128 -> 64 -> 3
BATCH = 16


@pytest.mark.parametrize("kind,optimizer,data,model", [
    ("functional", "adam", 8, 1),
    ("functional", "sgd-default", 8, 1),
    ("subclassed", "adam", 2, 4),
    pytest.param("sequential", "sgd", 2, 4, marks=pytest.mark.slow),
], ids=["functional-adam-8", "functional-sgd-default-8",
        "subclassed-adam-2x4", "sequential-sgd-momentum-2x4"])
def test_resharded_fsdp_matches_one_device(kind, optimizer, data, model):
    # One device first: a strategy with rules made before it would (rightly)
    # warn that this model trains outside its scope.
    expected = parity.single_device(kind, optimizer)
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"data": data, "model": model}),
        rules=models.tp_rules(kind) if model > 1 else None, fsdp=True,
        reshard_after_forward=True)
    assert strategy.reshard_after_forward
    parity.assert_same(expected, parity.train(kind, optimizer, strategy))


class Pair(keras.layers.Layer):
    """h2(h1(x)): two Dense layers, recomputed together under RematScope."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.h1 = keras.layers.Dense(WIDTHS[1], activation="relu", name="h1")
        self.h2 = keras.layers.Dense(WIDTHS[2], activation="relu", name="h2")

    def call(self, x):
        return self.h2(self.h1(x))


class SelfScaled(keras.layers.Layer):
    """(x * sum(w)) @ w: the matmul's other input is computed from the same
    gathered weight, so its gather cannot wait for that input."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], 8), name="w")

    def call(self, x):
        w = keras.ops.convert_to_tensor(self.w)
        return keras.ops.matmul(x * keras.ops.sum(w), w)


def test_a_weight_feeding_its_own_readers_input_matches_one_device():
    def build():
        return keras.Sequential([keras.Input((16,)), SelfScaled(name="s"),
                                 keras.layers.Dense(3, name="out")])

    keras.utils.set_random_seed(0)
    weights = build().get_weights()
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}), fsdp=True,
                                      reshard_after_forward=True)
    results = []
    for scope in (contextlib.nullcontext(), strategy.scope()):
        with scope:
            model = build()
            model.set_weights(weights)
            model.compile(optimizer="adam", loss="mse")
        history = models.fit_mlp(model, epochs=1)
        results.append((history.history["loss"], model.get_weights()))
    (want, want_weights), (got, got_weights) = results
    assert models.relative_error(want, got) < parity.RTOL
    for a, b in zip(want_weights, got_weights):
        assert models.relative_error(a, b) < parity.RTOL


def _mlp(remat=False):
    with (keras.RematScope(mode="list_of_layers", layer_names=["pair"])
          if remat else contextlib.nullcontext()):
        pair = Pair(name="pair")
    return keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(WIDTHS[0], activation="relu", name="h0"), pair,
        keras.layers.Dense(WIDTHS[3], activation="relu", name="h3"),
        keras.layers.Dense(3, name="out")], name="mlp")


def _report(axes, rules=None, remat=False, **options):
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes), rules=rules,
                                      **options)
    with strategy.scope():
        model = _mlp(remat)
        model.compile(optimizer="adam", loss="mse")
    report = tfpar.memory_report(model, *models.mlp_data(n=BATCH))
    return strategy, model, report, report.communication


@pytest.fixture(scope="module")
def reports():
    """Memory and communication reports of the MLP under each layout."""
    tp = {r".*h0/kernel": (None, "model"), r".*h0/bias": ("model",),
          r".*h1/kernel": ("model", None),
          r".*h2/kernel": (None, "model"), r".*h2/bias": ("model",),
          r".*h3/kernel": ("model", None)}
    return {
        "replicated": _report({"data": 8}),
        "fsdp": _report({"data": 8}, fsdp=True),
        "freed": _report({"data": 8}, fsdp=True, reshard_after_forward=True),
        "recompute": _report({"data": 8}, remat=True, fsdp=True),
        "tensor": _report({"data": 2, "model": 4}, tp),
    }


def _kernels():
    widths = (16,) + WIDTHS + (3,)
    return [(a, b) for a, b in zip(widths[:-1], widths[1:])]


def _param_bytes():
    return sum(4 * (a * b + b) for a, b in _kernels())


def test_report_has_every_kind_for_every_device(reports, tmp_path):
    strategy, model, report, _ = reports["fsdp"]
    assert list(report) == list(strategy.mesh.devices)
    for kinds in report.values():
        assert set(tfpar.memory.KINDS) <= set(kinds)
    text = str(report)
    assert strategy.mesh.devices[0] in text and "gathered" in text
    assert set(tfpar.memory.KINDS) <= set(text.splitlines()[0].split())
    x, y = models.mlp_data(n=BATCH)
    path = tmp_path / "memory.png"
    tfpar.memory_report(model, x, y, path=str(path))
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_params_gradients_optimizer_follow_the_layouts(reports):
    total = _param_bytes()
    for name, blocks in [("replicated", total),
                         ("fsdp", None), ("freed", None)]:
        strategy, _, report, _ = reports[name]
        if blocks is None:  # fsdp: 1/8 of every weight but out/bias (3,)
            blocks = (total - 12) // 8 + 12
        for kinds in report.values():
            assert kinds["params"] == blocks, name
            assert kinds["gradients"] == blocks
            assert kinds["optimizer"] == 2 * blocks  # Adam's two moments
    # Megatron pairs on model=4: h0..h3 weights split 4 ways but h1, h3
    # biases; the head replicated.
    _, _, report, _ = reports["tensor"]
    (a0, b0), (a1, b1), (a2, b2), (a3, b3), (a4, b4) = _kernels()
    split = a0 * b0 + b0 + a1 * b1 + a2 * b2 + b2 + a3 * b3
    whole = b1 + b3 + a4 * b4 + b4
    for kinds in report.values():
        assert kinds["params"] == 4 * (split // 4 + whole)


def test_saved_activations_are_the_hidden_outputs(reports):
    per_device = BATCH // 8
    hidden = per_device * 4 * (sum(WIDTHS) + 3)  # ReLU outputs, mse diff
    for name in ("replicated", "fsdp", "freed"):
        report = reports[name][2]
        assert {k["activations"] for k in report.values()} == {hidden}, name
    # data=2 x model=4: 8 rows per device, column outputs split 4 ways.
    rows = BATCH // 2
    tensor = rows * 4 * (WIDTHS[0] // 4 + WIDTHS[1] + WIDTHS[2] // 4
                         + WIDTHS[3] + 3)
    assert {k["activations"] for k in reports["tensor"][2].values()} == {
        tensor}
    # The recomputed pair keeps only its input: not h1's output.
    recomputed = hidden - per_device * 4 * WIDTHS[1]
    assert {k["activations"] for k in reports["recompute"][2].values()} == {
        recomputed}


def test_one_device_keeps_the_whole_batch_activations(reports):
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(
        {"data": 1}, devices=tfpar.Mesh({"data": 8}).devices[:1]))
    with strategy.scope():
        model = _mlp()
        model.compile(optimizer="adam", loss="mse")
    (kinds,) = tfpar.memory_report(model, *models.mlp_data(n=BATCH)).values()
    data8 = reports["replicated"][2][reports["replicated"][0].mesh.devices[0]]
    assert kinds["activations"] == 8 * data8["activations"]
    assert kinds["params"] == _param_bytes()


def test_fsdp_keeps_gathered_weights_unless_freed(reports):
    # The backward pass reads every kernel but the first (no gradient for
    # the input), whole, kept from the forward pass.
    kept = sum(4 * a * b for a, b in _kernels()[1:])
    assert {k["gathered"] for k in reports["fsdp"][2].values()} == {kept}
    assert {k["gathered"] for k in reports["freed"][2].values()} == {0}
    # The recomputed pair gathers h1, h2 again in its backward pass; h3
    # and out keep theirs.
    (_, _), (_, _), (_, _), (a3, b3), (a4, b4) = _kernels()
    assert {k["gathered"] for k in reports["recompute"][2].values()} == {
        4 * (a3 * b3 + a4 * b4)}
    for name in ("replicated", "tensor"):
        assert {k["gathered"] for k in reports[name][2].values()} == {0}


def test_freeing_gathers_each_backward_weight_again(reports):
    plain, freed = reports["fsdp"][3], reports["freed"][3]
    whole = sorted(4 * a * b for a, b in _kernels()[1:])
    assert plain.select(kind="all-gather", phase="backward") == []
    again = freed.select(kind="all-gather", phase="backward")
    assert sorted(c.bytes for c in again) == whole
    assert all(c.op == "CollectiveGatherV2" for c in again)
    assert (freed.count(kind="all-gather", phase="forward")
            == plain.count(kind="all-gather", phase="forward"))
    # One scalar all-reduce orders each gather after its reader's input.
    scalars = [c for c in freed.select(kind="all-reduce") if c.shape == ()]
    plain_scalars = [c for c in plain.select(kind="all-reduce")
                     if c.shape == ()]
    gathers_ordered = len(plain.select(kind="all-gather")) + len(again)
    assert len(scalars) - len(plain_scalars) == gathers_ordered


def test_peak_orders_the_layouts(reports):
    peak = {name: r[2][r[0].mesh.devices[0]]["peak"]
            for name, r in reports.items()}
    assert peak["freed"] < peak["fsdp"] < peak["replicated"]
    for name, (_, _, report, _) in reports.items():
        for kinds in report.values():
            resident = kinds["params"] + kinds["optimizer"] + kinds["other"]
            assert kinds["peak"] >= (resident + kinds["activations"]
                                     + kinds["gathered"]), name
    # Without freeing, all gathers run at the start of the step: the whole
    # weights are live together. Freed, the largest moment is h2's kernel
    # gathered again next to its whole gradient (on CPU DTensor's
    # reduce-scatter all-reduces it whole first).
    whole = _param_bytes()
    fsdp, freed = reports["fsdp"][2], reports["freed"][2]
    assert max(fsdp.live) >= whole - 4 * 3  # all but out/bias gathered
    h2 = 4 * WIDTHS[1] * WIDTHS[2]
    assert 2 * h2 <= max(freed.live) < max(fsdp.live)


def test_bad_arguments():
    with pytest.raises(ValueError, match="needs fsdp=True"):
        tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}),
                               reshard_after_forward=True)
    with pytest.raises(TypeError, match="reshard_after_forward=1"):
        tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}), fsdp=True,
                               reshard_after_forward=1)
    with pytest.raises(ValueError, match="no strategy"):
        model = _mlp()
        model.compile(optimizer="adam", loss="mse")
        tfpar.memory_report(model, *models.mlp_data(n=BATCH))


@pytest.mark.slow
def test_gpt_keeps_no_gathered_weight_when_freed():
    """The GPT example (attention's EinsumDense kernels, LayerNormalization
    gammas read through a reshape, the head) on data=8 with fsdp: every
    gathered weight is kept for the backward pass unless freed."""
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import gpt  # noqa: PLC0415

    config = dict(vocab=64, seq_len=16, dim=32, heads=4, layers=1)
    x, y = gpt.toy_corpus(16, vocab=64, seq_len=16)
    gathered = {}
    for freed in (False, True):
        strategy = tfpar.ParallelStrategy(
            tfpar.Mesh({"data": 8}), fsdp=True, reshard_after_forward=freed)
        with strategy.scope():
            model = gpt.build_gpt(**config)
            gpt.compile_gpt(model)
        report = tfpar.memory_report(model, x, y)
        gathered[freed] = report[strategy.mesh.devices[0]]["gathered"]
    kernels = 4 * (4 * 32 * 32 + 2 * 32 * 128 + 32 * 64) + 4 * 3 * 32
    assert gathered == {False: kernels, True: 0}
