"""keras-hub models train under `tfpar.auto_rules` in parity with one device.

Small GPT-2, Llama (also with grouped-query attention), Gemma, Mistral, BERT
and ViT models (tests/hub_models.py) are planned by `auto_rules` with no
hand-written rule, laid out by `strategy.apply_rules` and trained with `fit`
on data=2 x model=4, model=8 and data=8: the per-step losses and the final
weights equal one device's within 1e-4 (relative), and the attention and
MLP kernels are really split (each device holds a block). The default run
trains two cases (grouped-query Llama with plain SGD on 2x4, Gemma with
Adam on model=8) and checks every model's plan on 2x4; the full matrix
(7 models x 3 meshes x 3 optimizers) is `slow`.
"""

import re
import warnings

import keras
import numpy as np
import pytest

import tfpar

import hub_models
import models

MESHES = {"2x4": {"data": 2, "model": 4}, "1x8": {"data": 1, "model": 8},
          "8x1": {"data": 8, "model": 1}}
OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),  # plain: no momentum
    "momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
}
BATCH, STEPS = 8, 2
# The attention and MLP kernels each model must have split over "model"
# (the layers of the hand-written Megatron plans).
MUST_SPLIT = {name: [re.compile(p + r"/(query/|key/|value/|attention_output/)?kernel")
                     for p in rules]
              for name, rules in hub_models.MEGATRON_RULES.items()}
# Key/value projections with fewer heads than the model axis stay whole:
# llama_gqa has 2 key/value heads, mistral 4 (see the auto_rules warning).
KV_HEADS = {"llama_gqa": 2, "mistral": 4}
# A key bias shifts every attention logit of a query alike, and softmax
# ignores such a shift: its true gradient is zero. Both runs then hold only
# rounding noise there (amplified by Adam), compared absolutely.
ZERO_GRADIENT = re.compile(r".*/key/bias")


def train(name, optimizer, mesh_shape=None, plan=None):
    """(model, per-step losses, strategy) after STEPS batches of fit."""
    weights = hub_models.build(name).get_weights()
    x, y = hub_models.data(name, batch=BATCH * STEPS)
    strategy = None if mesh_shape is None else tfpar.ParallelStrategy(
        tfpar.Mesh(mesh_shape))

    def build():
        model = hub_models.build(name)
        model.set_weights(weights)
        if plan is not None:
            strategy.apply_rules(model, plan(model, strategy.mesh))
        model.compile(optimizer=OPTIMIZERS[optimizer](),
                      loss=hub_models.loss(name), weighted_metrics=[])
        return model

    return (*models.train_built(strategy, build, x, y, BATCH), strategy)


def auto(model, mesh):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # layers kept whole: checked below
        return tfpar.auto_rules(model, mesh=mesh)


def sharded_fraction(strategy):
    """Bytes of parameters split over "model" / all parameter bytes (0 when
    the model axis has size 1)."""
    ways = strategy.mesh.axis_size("model")
    total = split = 0
    for _, spec, block in strategy.placements("params"):
        size = int(np.prod(block)) * (ways if "model" in spec else 1)
        total += size
        split += size if "model" in spec and ways > 1 else 0
    return split / total


def check_split(name, model, strategy):
    """The attention and MLP kernels of MUST_SPLIT are split over "model":
    each device holds a block with exactly one dimension 1/size as long;
    grouped-query key/value kernels the axis does not divide are whole."""
    size = strategy.mesh.axis_size("model")
    shapes = {w.path: tuple(w.shape) for w in model.weights}
    checked = 0
    for path, spec, block in strategy.placements("params"):
        if not any(p.fullmatch(path) for p in MUST_SPLIT[name]):
            continue
        kv = re.search(r"/(key|value)/kernel$", path)
        if size == 1 or kv and KV_HEADS.get(name, size) % size:
            assert block == shapes[path], path  # whole: see the warning
            continue
        checked += 1
        assert [a // b for a, b in zip(shapes[path], block)].count(size) == 1, (
            path, shapes[path], block)
        assert spec.count("model") == 1, (path, spec)
    assert checked >= 4 or size == 1, (name, checked)


def check_parity(name, optimizer, mesh_id):
    reference, ref_losses, _ = train(name, optimizer)
    model, losses, strategy = train(name, optimizer, MESHES[mesh_id], auto)
    assert models.relative_error(ref_losses, losses) < 1e-4, (ref_losses, losses)
    for a, b in zip(reference.weights, model.weights):
        assert a.path == b.path
        if ZERO_GRADIENT.fullmatch(a.path):
            assert np.abs(a.numpy() - b.numpy()).max() < 1e-4, a.path
            continue
        assert models.relative_error(a.numpy(), b.numpy()) < 1e-4, a.path
    check_split(name, model, strategy)
    fraction = sharded_fraction(strategy)
    print(f"\n{name} {mesh_id} {optimizer}: {fraction:.1%} of parameter "
          f"bytes split over 'model'")
    return fraction


@pytest.mark.parametrize("name,optimizer,mesh_id", [
    ("llama_gqa", "sgd", "2x4"),
    pytest.param("gemma", "adam", "1x8", marks=pytest.mark.slow),
])
def test_parity_subset(name, optimizer, mesh_id):
    check_parity(name, optimizer, mesh_id)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_id", list(MESHES))
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("name", list(hub_models.BUILDERS))
def test_parity_matrix(name, optimizer, mesh_id):
    check_parity(name, optimizer, mesh_id)


WARNED = re.compile(r"^  (\S+) \((\w+)\): (.*)$", re.M)


@pytest.mark.parametrize("sequence_parallel,mesh_id", [
    (False, "2x4"),
    pytest.param(False, "1x8", marks=pytest.mark.slow),
    pytest.param(True, "2x4", marks=pytest.mark.slow),
    pytest.param(True, "1x8", marks=pytest.mark.slow),
])
def test_every_plan_is_accepted_and_whole_layers_are_named(sequence_parallel,
                                                           mesh_id):
    """Over all the models: apply_rules accepts the plan auto_rules returns,
    and the warning names each layer it leaves whole by the layer's own
    path (a layer owning those weights itself, not the block containing
    it), and every weight of those is whole."""
    for name in hub_models.BUILDERS:
        strategy = tfpar.ParallelStrategy(tfpar.Mesh(MESHES[mesh_id]))
        with strategy.scope():
            model = hub_models.build(name)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                rules = tfpar.auto_rules(
                    model, mesh=strategy.mesh,
                    sequence_parallel=sequence_parallel)
            strategy.apply_rules(model, rules)
        check_split(name, model, strategy)
        warned = [m for w in caught for m in WARNED.findall(str(w.message))]
        specs = {p: s for p, s, _ in strategy.placements("params")}
        for path, kind, reason in warned:
            own = [w.path for w in model.weights
                   if w.path.rsplit("/", 1)[0] == path]
            assert own, (name, path, "owns no weight itself")
            assert all(not any(specs[w]) for w in own), (name, path)
        if name in KV_HEADS and KV_HEADS[name] % strategy.mesh.axis_size("model"):
            assert any("grouped-query" in r for *_, r in warned), name
