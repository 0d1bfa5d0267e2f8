"""`tfpar.layers.MixtureOfExperts` and the math of `tfpar.experts`.

The model: tokens (batch, 8, 16) -> MixtureOfExperts(4 experts, top 2,
width 32) -> + tokens -> Dense(3), mse. Its tokens are drawn so that every
token's 2nd and 3rd router probabilities are apart by more than
`MARGIN` (float32 noise is ~1e-7) at every training step (checked on the
one-device run, batch by batch): on any mesh the routing cannot flip, so
one device's results are the reference, within 1e-4 relative (fp32).
"""

import contextlib
import functools
import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import keras
from keras_hub.src.models.mixtral import mixtral_decoder

import tfpar
from tfpar import experts, placement

import models

RTOL = 1e-4
SEQ, HIDDEN, EXPERTS, TOP_K, WIDTH = 8, 16, 4, 2, 32
BATCH, STEPS = 8, 3
MARGIN = 1e-3


def build(num_experts=EXPERTS, **options):
    options = dict(dict(capacity_factor=1.0), **options)
    tokens = keras.Input((SEQ, HIDDEN))
    mixed = tfpar.layers.MixtureOfExperts(num_experts, TOP_K, WIDTH,
                                          name="moe", **options)(tokens)
    out = keras.layers.Dense(3, name="head")(keras.layers.Add()([tokens,
                                                                 mixed]))
    return keras.Model(tokens, out)


def margins(tokens, router_kernel):
    """Each token's k-th minus (k+1)-th router probability."""
    probabilities = np.asarray(experts.router_probabilities(
        np.asarray(tokens, "float32") @ router_kernel))
    ordered = -np.sort(-probabilities, axis=-1)
    return ordered[..., TOP_K - 1] - ordered[..., TOP_K]


def tokens_with_margin(router_kernel, count, seed=0):
    """`count` sequences of tokens whose routing has a margin of 0.05."""
    rng = np.random.RandomState(seed)
    candidates = rng.normal(size=(20 * count * SEQ, HIDDEN)).astype("f4")
    kept = candidates[margins(candidates, router_kernel) > 0.05]
    assert len(kept) >= count * SEQ
    return kept[:count * SEQ].reshape(count, SEQ, HIDDEN)


class RouterMargin(keras.callbacks.Callback):
    """Records the smallest routing margin of each batch before its step."""

    def __init__(self, x):
        super().__init__()
        self.x, self.smallest = x, []

    def on_train_batch_begin(self, batch, logs=None):
        kernel = self.model.get_layer("moe").router_kernel.numpy()
        rows = self.x[batch * BATCH:(batch + 1) * BATCH]
        self.smallest.append(float(margins(rows, kernel).min()))


def train(strategy=None, optimizer="adam", microbatches=None, **options):
    """(losses, {path: weights}, dropped, model) of STEPS steps from seed
    0's weights on the margin data; a `tfpar.PipelineModel` of
    `microbatches` micro-batches when given."""
    keras.utils.set_random_seed(0)
    reference = build(**options)
    weights = reference.get_weights()
    kernel = reference.get_layer("moe").router_kernel.numpy()
    x = tokens_with_margin(kernel, BATCH * STEPS)
    y = np.random.RandomState(1).normal(size=(len(x), SEQ, 3)).astype("f4")
    scope = strategy.scope() if strategy else tf.init_scope()
    with scope:
        model = build(**options) if strategy else reference
        model.set_weights(weights)
        trained = (model if microbatches is None else
                   tfpar.PipelineModel(model, num_microbatches=microbatches))
        trained.compile(optimizer=models.optimizer(optimizer), loss="mse")
    losses, margin = models.BatchLosses(), RouterMargin(x)
    trained.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                callbacks=[losses] + ([margin] if strategy is None else []))
    if strategy is None:  # the reference run: routing cannot flip
        assert min(margin.smallest) > MARGIN, margin.smallest
    return (losses.losses, {v.path: np.asarray(v.numpy(), "float32")
                            for v in model.weights},
            float(model.get_layer("moe").dropped_tokens.numpy()), model)


def assert_same(want, got, same_dropped=True):
    """Losses and weights within RTOL; the dropped count of the last batch
    the same (`same_dropped`)."""
    assert models.relative_error(want[0], got[0]) < RTOL, (want[0], got[0])
    for path, value in want[1].items():
        if path.endswith("dropped_tokens"):
            continue
        error = models.relative_error(value, got[1][path])
        assert error < RTOL, (path, error)
    assert want[2] == got[2] or not same_dropped


def bank_blocks(model):
    """The per-device blocks' shapes of the MoE layer's up bank."""
    bank = model.get_layer("moe").up_kernel
    return [tuple(b.shape) for b in dtensor.unpack(bank.value.read_value())]


def test_data2_expert4_trains_as_one_device_with_adam_banks_split():
    """Capacity factor 1.0 (some assignments dropped), aux loss on."""
    want = train()
    assert want[2] > 0  # the capacity drops something: the test covers it
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "expert": 4}))
    got = train(strategy)
    assert_same(want, got)
    layer = got[3].get_layer("moe")
    for bank in (layer.up_kernel, layer.gate_kernel, layer.down_kernel):
        blocks = dtensor.unpack(bank.value.read_value())
        assert len(blocks) == 8
        assert {tuple(b.shape) for b in blocks} == {
            (EXPERTS // 4,) + tuple(bank.shape[1:])}
        # Each device of one data row holds a different expert.
        firsts = [float(b.numpy().ravel()[0]) for b in blocks]
        assert len(set(firsts)) == 4
    assert {tuple(b.shape) for b in dtensor.unpack(
        layer.router_kernel.value.read_value())} == {(HIDDEN, EXPERTS)}


def folded_strategy():
    """GShard's placement: 8 devices, the data axis also the expert axis."""
    return tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}), expert_axis="data")


def test_experts_on_the_data_axis_train_as_one_device_with_adam():
    """expert_axis="data" on Mesh({"data": 8}), 8 experts (one of each
    bank per device), capacity factor 1.0 (assignments dropped)."""
    want = train(num_experts=8)
    assert want[2] > 0
    got = train(folded_strategy(), num_experts=8)
    assert_same(want, got)
    layer = got[3].get_layer("moe")
    for bank in (layer.up_kernel, layer.gate_kernel, layer.down_kernel):
        blocks = dtensor.unpack(bank.value.read_value())
        assert {tuple(b.shape) for b in blocks} == {(1,) + tuple(
            bank.shape[1:])} and len(blocks) == 8
        np.testing.assert_array_equal(  # device i holds expert i
            np.concatenate([b.numpy() for b in blocks]), bank.numpy())


def test_banks_on_the_data_axis_are_computed_split_not_gathered():
    """A weight split over the data axis is gathered in a step (fsdp's
    reads), unless the expert axis is the data axis and the split is of
    the first (experts) dimension."""
    mesh = tfpar.Mesh({"data": 8})
    plan = functools.partial(tfpar.layout.plan_specs, "moe/up_kernel",
                             (8, HIDDEN, WIDTH), mesh,
                             layout=("data", None, None))
    assert plan(expert_axis="data").compute_spec == ("data", None, None)
    assert plan(expert_axis="expert").compute_spec == (None, None, None)
    assert plan(expert_axis="data", layout=(None, "data", None)
                ).compute_spec == (None, None, None)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer,options", [
    ("sgd", {}),
    ("adam", dict(capacity_factor=None)),
])
def test_experts_on_the_data_axis_in_more_modes(optimizer, options):
    want = train(None, optimizer, num_experts=8, **options)
    got = train(folded_strategy(), optimizer, num_experts=8, **options)
    assert_same(want, got)


def compiled_step(strategy, num_experts=8):
    """The `Program` of the model's compiled training step on `strategy`."""
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build(num_experts=num_experts)
        model.compile(optimizer="adam", loss="mse")
    return tfpar.reports.program.keras_program(
        model, np.zeros((BATCH, SEQ, HIDDEN), "f4"),
        np.zeros((BATCH, SEQ, 3), "f4"))


@pytest.mark.slow
def test_experts_on_the_data_axis_exchange_slots_and_repeat_nothing():
    """GShard's placement on Mesh({"data": 8}), 8 experts: inside the MoE
    block, over `data`, forward the exchange of the dispatched slots
    (groups, experts, capacity, hidden) to each device's expert and back,
    backward the reverse of the second (the block's input is data: no
    input gradient), besides the aux loss's means and the dropped count —
    no all-reduce of the tokens' outputs, no gather of a bank, no
    reduction of a bank's gradient (each device owns its expert). Each
    exchange is a gather whose message is every group's slots: global
    tokens x top_k x capacity_factor x hidden x 4 bytes, 8 times what a
    true all-to-all would send per device (`collectives.all_to_all`).
    And the layer outside the block (the head) costs each device 1/4 of
    its FLOPs on data=2 x expert=4, where it is repeated on the 4
    devices of the expert axis."""
    folded = compiled_step(folded_strategy())
    in_block = [(c.phase, c.purpose, c.shape, c.bytes,
                 c.name.split("/moe_1/")[1].split("/")[0])
                for c in folded.collectives(folded.backward_nodes())
                if "/moe_1/" in c.name]
    assert all(c.axes == ("data",) for c in folded.collectives(set()))
    slots = BATCH * SEQ * TOP_K * HIDDEN * 4  # capacity factor 1.0: exact
    groups = (BATCH, 8, experts.capacity(SEQ, 8, TOP_K, 1.0), HIDDEN)
    assert in_block == [
        ("forward", "all-reduce", (8,), 32, "Mean_1"),  # aux loss: f_e
        ("forward", "all-reduce", (8,), 32, "Mean"),  # and P_e
        ("forward", "all-gather", groups, slots, "dispatch"),
        ("forward", "all-reduce", (), 4, "router"),  # dropped count
        ("forward", "all-gather", groups, slots, "expert_ffn"),
        ("backward", "all-gather", groups, slots, "combine"),
        ("backward", "all-reduce", (HIDDEN, 8), HIDDEN * 8 * 4, "router")]
    separate = compiled_step(tfpar.ParallelStrategy(
        tfpar.Mesh({"data": 2, "expert": 4})))
    bench = load_benchmark()
    head = [bench.matmul_flops(p, "head") for p in (folded, separate)]
    assert head[0] > 0 and head[0] * 4 == head[1]


@pytest.mark.slow
@pytest.mark.parametrize("axes,optimizer,options", [
    ({"data": 8}, "adam", {}),
    ({"data": 2, "expert": 4}, "sgd", {}),
    ({"data": 2, "expert": 4}, "adam", dict(capacity_factor=None)),
    ({"data": 4, "expert": 2}, "adam", dict(group_size=4, gated=False,
                                            activation="gelu")),
])
def test_more_meshes_and_modes_train_as_one_device(axes, optimizer, options):
    want = train(None, optimizer, **options)
    got = train(tfpar.ParallelStrategy(tfpar.Mesh(axes)), optimizer,
                **options)
    assert_same(want, got)


@pytest.mark.slow
def test_a_pipeline_stage_with_an_expert_axis_trains_as_one_device():
    """pipe=2 x data=2 x expert=2, two micro-batches. The aux loss is off:
    under a pipeline it is each micro-batch's (a product of per-batch
    means, so not the whole batch's), and `dropped_tokens` is the last
    micro-batch's."""
    want = train(aux_loss_coef=0)
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"pipe": 2, "data": 2, "expert": 2}))
    got = train(strategy, microbatches=2, aux_loss_coef=0)
    assert_same(want, got, same_dropped=False)
    assert bank_blocks(got[3]) == [(EXPERTS // 2, HIDDEN, WIDTH)] * 4


@contextlib.contextmanager
def dtype_policy(name):
    """Keras' dtype policy `name` inside, the previous one after."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(name)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


@pytest.mark.slow
@pytest.mark.parametrize("axes,options,num_experts", [
    ({"data": 2, "expert": 4}, {}, EXPERTS),
    ({"data": 8}, dict(expert_axis="data"), 8),  # GShard's placement
])
def test_mixed_bfloat16_with_experts_split_is_one_devices_mixed_run(
        axes, options, num_experts):
    """Under mixed_bfloat16 the router still computes in float32 (its
    kernel is not autocast), and a mesh splitting the experts stays
    within the suite's mixed-precision oracle (tests/test_mixed_precision.py): 3 x
    the distance between one device's float32 and bfloat16 runs, per
    weight and for the losses, with SGD with momentum (the combine's sum
    over the expert axis is a bfloat16 all-reduce of partial sums; with
    the experts on the data axis, bfloat16 slots are exchanged)."""
    exact = train(optimizer="sgd", num_experts=num_experts)
    with dtype_policy("mixed_bfloat16"):
        want = train(optimizer="sgd", num_experts=num_experts)
        got = train(tfpar.ParallelStrategy(tfpar.Mesh(axes), **options),
                    optimizer="sgd", num_experts=num_experts)
        assert got[3].get_layer("moe").router_kernel.dtype == "float32"

    def distance(a, b):
        return np.abs(np.subtract(a, b)).max()

    assert distance(want[0], got[0]) <= 3 * distance(exact[0], want[0])
    for path, value in want[1].items():
        if path.endswith("dropped_tokens"):
            assert got[1][path] == value
            continue
        budget = distance(exact[1][path], value)
        assert 0 < budget and distance(value, got[1][path]) <= 3 * budget, (
            path, distance(value, got[1][path]), budget)


@pytest.mark.slow
def test_the_step_exchanges_tokens_over_expert_as_documented():
    """tfpar.experts: forward, one all-reduce over `expert` of the data
    shard's token outputs (groups, group tokens, hidden) — the combine's
    sum over experts; backward (the block's input is data: no input
    gradient), one all-gather of the combine weights' gradient (groups,
    group tokens, experts, capacity) for the router."""
    keras.utils.set_random_seed(0)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "expert": 4}))
    with strategy.scope():
        model = build()
        model.compile(optimizer="adam", loss="mse")
    x = np.zeros((BATCH, SEQ, HIDDEN), "f4")
    program = tfpar.reports.program.keras_program(
        model, x, np.zeros((BATCH, SEQ, 3), "f4"))
    # Bytes: the message (the whole gathered tensor for a gather).
    over_expert = [(c.phase, c.purpose, c.bytes) for c in
                   program.collectives(program.backward_nodes())
                   if "expert" in (c.axes or ())]
    capacity = experts.capacity(SEQ, EXPERTS, TOP_K, 1.0)
    assert over_expert == [
        ("forward", "all-reduce", BATCH // 2 * SEQ * HIDDEN * 4),
        ("backward", "all-gather", BATCH // 2 * SEQ * EXPERTS * capacity * 4)]


def load_benchmark():
    """benchmarks/moe.py as a module, loaded from its file under a name of
    its own (benchmarks/ is not on this test's path)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "moe.py"
    spec = importlib.util.spec_from_file_location("moe_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_expert_flops_per_device_with_capacity_are_k_cf_over_e_of_masked():
    """From the compiled steps (forward and backward): per device, the
    expert FFN FLOPs of data=2 x expert=4 with capacity_factor=1.25 are
    at most top_k x 1.25 / experts of the masked computation's on data=8
    (keras-hub Mixtral's expert bank, every expert on every token) for
    the same global batch. Capacity: ceil(1.25 * 2 * 16 / 8) = 5 slots,
    exactly 1.25 x the balanced share, so the ratio is exactly 0.3125."""
    bench = load_benchmark()
    size = bench.QUICK
    x, y = bench.data(size)
    flops = {}
    for mode, axes in (("masked", {"data": 8}),
                       (1.25, {"data": 2, "expert": 4})):
        keras.utils.set_random_seed(0)
        strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes))
        with strategy.scope():
            model = bench.build(mode, size)
            model.compile(optimizer="adam", loss="mse")
        program = tfpar.reports.program.keras_program(
            model, x[:size["batch"]], y[:size["batch"]])
        flops[mode] = (bench.matmul_flops(program, bench.EXPERT_NODES),
                       bench.matmul_flops(program, r"^(?!gradient_tape).*("
                                          + bench.EXPERT_NODES + ")"))
        assert not bench.unknown_nodes(program, bench.EXPERT_NODES)
    e, t = size["experts"], size["batch"] * size["seq"]
    # Masked, forward: 3 products of E x (tokens / 8) x hidden x width.
    assert flops["masked"][1] == 3 * 2 * e * (t // 8) * size["hidden"] * (
        size["intermediate"])
    ratio = flops[1.25][0] / flops["masked"][0]
    assert ratio == pytest.approx(size["top_k"] * 1.25 / e, rel=1e-9)


# -- the math ------------------------------------------------------------------


def silu(z):
    return z / (1 + np.exp(-z))


def test_dropless_is_the_masked_computation():
    """capacity_factor=None: every token gets its top-2 experts' outputs,
    weighted by their renormalised probabilities (numpy, one loop)."""
    rng = np.random.RandomState(0)
    x = rng.normal(size=(2, SEQ, HIDDEN)).astype("f4")
    router = rng.normal(size=(HIDDEN, EXPERTS)).astype("f4")
    up, gate, down = (rng.normal(size=s).astype("f4") * 0.3 for s in (
        (EXPERTS, HIDDEN, WIDTH), (EXPERTS, HIDDEN, WIDTH),
        (EXPERTS, WIDTH, HIDDEN)))
    result = experts.moe(tf.constant(x), router,
                         lambda t: experts.expert_ffn(t, up, gate, down),
                         EXPERTS, TOP_K)
    probabilities = np.asarray(tf.nn.softmax(x @ router))
    want = np.zeros_like(x)
    for b, s in np.ndindex(2, SEQ):
        chosen = np.argsort(-probabilities[b, s])[:TOP_K]
        weights = probabilities[b, s, chosen] / probabilities[b, s,
                                                              chosen].sum()
        for w, e in zip(weights, chosen):
            t = x[b, s]
            want[b, s] += w * ((silu(t @ gate[e]) * (t @ up[e])) @ down[e])
    np.testing.assert_allclose(result.outputs, want, rtol=1e-5, atol=1e-5)
    assert int(result.dropped) == 0 and result.capacity == SEQ


def test_capacity_drops_exactly_the_documented_assignments():
    """An overloaded expert: all 8 tokens of a group choose expert 0 first
    and expert 1 second; 4 experts, top 2, capacity factor 1.0: capacity
    ceil(1.0 * 2 * 8 / 4) = 4 slots. Expert 0 serves tokens 0-3 (first
    choices, in token order) and drops 4-7; expert 1's first choices are
    none, so its second choices from tokens 0-3 fill it and 4-7 drop.
    Tokens 4-7 get nothing (they pass through the residual); dropped = 8
    assignments."""
    logits = np.tile(np.array([3.0, 2.0, 0.0, -1.0], "f4"), (1, 8, 1))
    routing = experts.route(logits, TOP_K)
    plan = experts.dispatch_plan(
        experts.Routing(routing.probabilities,
                        tf.reshape(routing.weights, (1, 8, 2)),
                        tf.reshape(routing.experts, (1, 8, 2))),
        EXPERTS, experts.capacity(8, EXPERTS, TOP_K, 1.0))
    dispatch = np.asarray(plan.dispatch)[0]  # (token, expert, slot)
    assert dispatch.shape == (8, 4, 4)
    for token in range(4):  # token t fills slot t of experts 0 and 1
        assert dispatch[token, 0, token] == 1 and dispatch[token, 1,
                                                           token] == 1
    assert dispatch.sum() == 8 and dispatch[4:].sum() == 0
    combine = np.asarray(plan.combine)[0]
    weights = np.asarray(routing.weights)[0]
    np.testing.assert_allclose(combine[:4].sum(axis=(1, 2)), 1, rtol=1e-6)
    np.testing.assert_allclose(combine[0, 0, 0], weights[0, 0], rtol=1e-6)
    assert combine[4:].sum() == 0 and int(plan.dropped) == 8


def test_aux_loss_is_mixtrals():
    """The load-balancing loss equals keras-hub Mixtral's on the same
    logits (1.0 for a balanced router)."""
    logits = np.random.RandomState(0).normal(size=(32, EXPERTS)).astype("f4")
    want = mixtral_decoder.compute_load_balancing_loss(
        tf.constant(logits), EXPERTS, TOP_K)
    got = experts.load_balancing_loss(experts.route(logits, TOP_K), EXPERTS)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)


# -- what DTensor 2.21 cannot do, which the design works around ---------------


def test_dtensor_splits_one_dimension_over_one_mesh_axis_only():
    """Why tokens are split over data only (tfpar.experts): a batch split
    over data and expert together is no DTensor layout."""
    mesh = tfpar.Mesh({"data": 2, "expert": 4}).dtensor_mesh
    with pytest.raises(ValueError, match="must either be a valid mesh "
                                         "dimension or UNSHARDED"):
        dtensor.Layout(["data,expert", dtensor.UNSHARDED], mesh)


@pytest.mark.slow  # a child process importing TF: ~10 s
def test_top_k_gradient_fails_on_a_batch_split_and_route_does_not():
    """TopKV2's gradient (a ScatterNd over flattened indices) fails on a
    batch split over data (tests/dtensor_top_k_gradient_repro.py, pure
    TF + DTensor, in a child process: the failed collective poisons the
    process's executor); `experts.route` reads the top-k weights by a
    one-hot product instead, whose gradient in a tfpar step on data=8 is
    one device's. If the repro starts printing "top_k: right" on a newer
    TF, route may use tf.math.top_k's values again."""
    repro = Path(__file__).with_name("dtensor_top_k_gradient_repro.py")
    result = subprocess.run([sys.executable, str(repro)], capture_output=True,
                            text=True, timeout=300)
    assert result.stdout.strip().splitlines()[-1].startswith(
        "top_k: failed, "), result.stdout + result.stderr[-2000:]
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}))
    logits = np.random.RandomState(0).normal(size=(16, 8, 4)).astype("f4")

    def squared_weights(z):
        return tf.reduce_sum(experts.route(z, TOP_K, normalize=False)
                             .weights ** 2)

    def step(z):
        with tf.GradientTape() as tape:
            tape.watch(z)
            total = squared_weights(z)
        return strategy.extended.replicate(tape.gradient(total, z))

    placed = placement.put(logits, ("data", None, None), strategy.mesh)
    got = tf.function(lambda z: strategy.run(step, args=(z,)))(placed)
    z = tf.constant(logits)
    with tf.GradientTape() as tape:
        tape.watch(z)
        total = squared_weights(z)
    np.testing.assert_allclose(placement.fetch(got),
                               tape.gradient(total, z), rtol=1e-5, atol=1e-7)


# -- config, saving and errors -------------------------------------------------


def test_config_round_trip_and_keras_file(tmp_path):
    keras.utils.set_random_seed(0)
    model = build(capacity_factor=1.25, group_size=4, router="sigmoid")
    layer = model.get_layer("moe")
    again = tfpar.layers.MixtureOfExperts.from_config(layer.get_config())
    assert again.get_config() == layer.get_config()
    path = tmp_path / "moe.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    x = np.random.RandomState(0).normal(size=(2, SEQ, HIDDEN)).astype("f4")
    np.testing.assert_array_equal(loaded.predict(x, verbose=0),
                                  model.predict(x, verbose=0))
    assert loaded.get_layer("moe").capacity_factor == 1.25


@pytest.mark.parametrize("options,match", [
    (dict(top_k=5), r"top_k must be an integer in \[1, 4\]\. Received: top_k=5"),
    (dict(capacity_factor=0), r"capacity_factor must be None .*Received: "
                              r"capacity_factor=0"),
    (dict(router="relu"), r"router must be one of"),
])
def test_bad_arguments_are_refused_when_the_layer_is_made(options, match):
    arguments = dict(dict(num_experts=EXPERTS, top_k=TOP_K,
                          intermediate_dim=WIDTH), **options)
    with pytest.raises(ValueError, match=match):
        tfpar.layers.MixtureOfExperts(**arguments)


def test_experts_not_dividing_over_the_expert_axis_are_refused():
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "expert": 4}))
    with strategy.scope(), pytest.raises(
            ValueError, match=r"'moe': num_experts=6 does not divide over "
                              r"the expert axis 'expert' of size 4"):
        tfpar.layers.MixtureOfExperts(6, TOP_K, WIDTH, name="moe")(
            keras.Input((SEQ, HIDDEN)))


def test_an_expert_axis_no_layer_uses_is_refused_before_the_first_step():
    """Not at compile: keras-hub tasks compile in their constructor,
    before `apply_rules` splits their banks."""
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "expert": 4}))
    with strategy.scope():
        model = keras.Sequential([keras.Input((HIDDEN,)),
                                  keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss="mse")
    before = model.get_weights()
    with pytest.raises(ValueError, match=r"expert axis 'expert' has 4 "
                                         r"devices, but no weight is "
                                         r"split over it"):
        model.fit(np.ones((8, HIDDEN), "float32"),
                  np.ones((8, 3), "float32"), verbose=0)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
