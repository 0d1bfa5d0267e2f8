"""Tensor-parallel styles, auto_rules and a transformer block in parity."""

import keras
import numpy as np
import pytest
from tensorflow.experimental import dtensor

import tfpar
from tfpar import layout as layout_lib

import models

VOCAB, SEQ, DIM, HEADS = 32, 6, 16, 4


def transformer():
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(VOCAB, DIM, name="embed")(tokens)
    a = keras.layers.MultiHeadAttention(HEADS, DIM // HEADS, name="attn")(h, h)
    h = keras.layers.LayerNormalization(name="ln1")(h + a)
    m = keras.layers.Dense(4 * DIM, activation="gelu", name="mlp_up")(h)
    m = keras.layers.Dropout(0.0, name="drop")(m)
    m = keras.layers.Dense(DIM, name="mlp_down")(m)
    h = keras.layers.LayerNormalization(name="ln2")(h + m)
    logits = keras.layers.Dense(VOCAB, name="head")(h)
    return keras.Model(tokens, logits, name="gpt")


def lm_data(n=32, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randint(0, VOCAB, size=(n, SEQ)).astype("int32")
    return x, np.roll(x, -1, axis=1)


def test_dense_and_embedding_specs():
    dense = keras.layers.Dense(8)
    dense.build((None, 4))
    col, row = tfpar.ColumnParallel(), tfpar.RowParallel()
    assert col.spec_for(dense, "kernel", (4, 8)) == (None, "model")
    assert col.spec_for(dense, "bias", (8,)) == ("model",)
    assert row.spec_for(dense, "kernel", (4, 8)) == ("model", None)
    assert row.spec_for(dense, "bias", (8,)) == (None,)
    embed = keras.layers.Embedding(10, 8)
    assert col.spec_for(embed, "embeddings", (10, 8)) == (None, "model")
    assert row.spec_for(embed, "embeddings", (10, 8)) == ("model", None)
    assert tfpar.Replicated().spec_for(dense, "kernel", (4, 8)) == (None, None)


def test_attention_is_split_by_heads():
    attn = keras.layers.MultiHeadAttention(HEADS, 4)
    attn.build((None, SEQ, DIM), (None, SEQ, DIM))
    col = tfpar.ColumnParallel()
    q = attn._query_dense
    assert col.spec_for(q, "query/kernel", (DIM, HEADS, 4)) == (None, "model", None)
    assert col.spec_for(q, "query/bias", (HEADS, 4)) == ("model", None)
    out = attn._output_dense
    assert col.spec_for(out, "attention_output/kernel", (HEADS, 4, DIM)) == ("model", None, None)
    assert col.spec_for(out, "attention_output/bias", (DIM,)) == (None,)
    with pytest.raises(ValueError, match="RowParallel does not apply to MultiHeadAttention"):
        tfpar.RowParallel().spec_for(q, "query/kernel", (DIM, HEADS, 4))


def test_style_on_unknown_layer_is_an_error():
    conv = keras.layers.Conv2D(4, 3)
    with pytest.raises(ValueError, match=r"does not know how to lay out weight 'kernel'.*Conv2D"):
        tfpar.ColumnParallel().spec_for(conv, "kernel", (3, 3, 2, 4))


def test_style_rules_match_layer_paths():
    rules = tfpar.LayoutRules({r".*attn": tfpar.ColumnParallel()})
    assert layout_lib.layer_prefix_match(
        rules._rules[0][1], "gpt/attn/query/kernel") == ("gpt/attn", "query/kernel")
    assert rules.axes_used() == {"model": r".*attn"}


def test_auto_rules_plans_the_transformer():
    keras.utils.set_random_seed(0)
    model = transformer()
    rules = tfpar.auto_rules(model, axis_size=4)
    assert dict(rules.items()) == {
        "embed": tfpar.ColumnParallel(),
        "attn": tfpar.ColumnParallel(),
        "mlp_up": tfpar.ColumnParallel(),
        "mlp_down": tfpar.RowParallel(),
    }


def test_auto_rules_rejects_indivisible_heads_and_warns_on_unknown_layers():
    model = transformer()
    with pytest.raises(ValueError, match=r"Layer 'attn' \(MultiHeadAttention\) has num_heads=4, which mesh axis 'model' of size 8"):
        tfpar.auto_rules(model, axis_size=8)
    conv_model = keras.Sequential([keras.Input((6, 6, 1)),
                                   keras.layers.Conv2D(2, 3, name="conv"),
                                   keras.layers.Flatten(), keras.layers.Dense(4)])
    with pytest.warns(UserWarning, match=r"conv \(Conv2D\)"):
        tfpar.auto_rules(conv_model, axis_size=2)


def _with_router(router_units):
    """(8, 16) -> MLP 32 wide, plus a router MLP Dense(router_units) ->
    tanh -> Dense(16) on the same input, as Gemma 3n's AltUp router."""
    x = keras.Input((8, 16))
    h = keras.layers.Dense(32, activation="gelu", name="up")(x)
    h = keras.layers.Dense(16, name="down")(h)
    r = keras.layers.Dense(router_units, activation="tanh", name="router")(x)
    r = keras.layers.Dense(16, name="router_out")(r)
    out = keras.layers.Dense(4, name="head")(keras.layers.Add()([h, r]))
    return keras.Model(x, out)


def test_auto_rules_keeps_an_mlp_narrower_than_the_axis_whole():
    """A hidden layer of 2 units on model=4 cannot be split: the pair stays
    whole, named in the warning, and the other MLP is split (auto_rules
    raised on keras-hub's Gemma 3n before). A hidden layer of 6 units the
    axis does not divide is still the error naming it."""
    with pytest.warns(UserWarning, match=r"router \(Dense\): an MLP 2 units "
                      r"wide, fewer than mesh axis 'model' has devices \(4\)"):
        rules = tfpar.auto_rules(_with_router(2), axis_size=4)
    assert dict(rules.items()) == {"up": tfpar.ColumnParallel(),
                                   "down": tfpar.RowParallel()}
    with pytest.raises(ValueError, match=r"'router' \(Dense\) has units=6"):
        tfpar.auto_rules(_with_router(6), axis_size=4)


class _WrappedAttention(keras.layers.Layer):
    """A block holding a MultiHeadAttention "attention" (BLIP-2's Q-Former
    attention block)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(4, 8,
                                                         name="attention")

    def call(self, x):
        return self.attention(x, x)


def _two_models_one_path():
    """Two sub-models, each with a layer named "attn": the first's wraps an
    attention ("attn/attention/query/kernel"), the second's is one
    ("attn/query/kernel") — as keras-hub's BLIP-2's Q-Former and language
    model both have "transformer_layer_0/self_attention"."""
    x = keras.Input((8, 32))
    first = keras.Model(x, _WrappedAttention(name="attn")(x), name="first")
    y = keras.Input((8, 32))
    second = keras.Model(y, keras.layers.MultiHeadAttention(
        4, 8, name="attn")(y, y), name="second")
    z = keras.Input((8, 32))
    return keras.Model(z, keras.layers.Dense(4, name="head")(
        second(first(z))))


def test_auto_rules_keeps_a_layer_whole_whose_path_holds_other_weights():
    """A rule for path "attn" is matched by every weight under "attn/",
    the other attention's too, which its own rule also matches: auto_rules
    gave both rules, and applying them failed ("matched by 2 layout
    rules"; keras-hub's BLIP-2). The layer whose path holds other weights
    stays whole, named in the warning; the other is split."""
    model = _two_models_one_path()
    with pytest.warns(UserWarning, match=r"attn \(MultiHeadAttention\): "
                      r"another layer's weights sit under its path"):
        rules = tfpar.auto_rules(model, axis_size=4)
    assert dict(rules.items()) == {r"attn/attention": tfpar.ColumnParallel()}
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}))
    with strategy.scope():
        model = _two_models_one_path()
    strategy.apply_rules(model, rules)
    split = {path for path, spec, _ in strategy.placements("params")
             if "model" in spec}
    assert split and all(path.startswith("attn/attention/")
                         for path in split), split


def train_transformer(strategy=None, plan=None, epochs=2):
    """Trains the transformer from fixed weights; `plan(model)` gives the
    rules `strategy.apply_rules` lays it out by."""
    keras.utils.set_random_seed(0)
    weights = transformer().get_weights()
    x, y = lm_data()

    def build():
        model = transformer()
        model.set_weights(weights)
        if plan is not None:
            strategy.apply_rules(model, plan(model))
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    return models.train_built(strategy, build, x, y, 8, epochs)


@pytest.mark.parametrize("data,model_axis", [(2, 4), (1, 8)], ids=["2x4", "1x8"])
def test_transformer_auto_rules_parity_and_sharding(data, model_axis):
    if model_axis == 8:
        # 4 heads cannot split 8 ways: the clear error is the behaviour.
        strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 1, "model": 8}))
        with strategy.scope():
            model = transformer()
            with pytest.raises(ValueError, match="num_heads=4"):
                tfpar.auto_rules(model, mesh=strategy.mesh)
        return
    reference, ref_losses = train_transformer()
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"data": data, "model": model_axis}))
    parallel, losses = train_transformer(
        strategy, plan=lambda m: tfpar.auto_rules(m, mesh=strategy.mesh))
    assert models.relative_error(ref_losses, losses) < 1e-4
    for a, b in zip(reference.weights, parallel.weights):
        if a.path == "attn/key/bias":
            # Its gradient is analytically zero (softmax ignores a shift of
            # all logits of a query), so both runs hold Adam-amplified
            # rounding noise of ~1e-6 there: nothing to compare.
            assert np.abs(b.numpy()).max() < 1e-4
            continue
        assert models.relative_error(a.numpy(), b.numpy()) < 1e-4, a.path
    layouts = {v.path: tuple(None if s == dtensor.UNSHARDED else s
                             for s in dtensor.fetch_layout(v.value).sharding_specs)
               for v in parallel.weights}
    assert layouts["attn/query/kernel"] == (None, "model", None)
    assert layouts["attn/attention_output/kernel"] == ("model", None, None)
    assert layouts["mlp_up/kernel"] == (None, "model")
    assert layouts["mlp_down/kernel"] == ("model", None)
    assert layouts["embed/embeddings"] == (None, "model")
    assert layouts["head/kernel"] == (None, None)
    block = dtensor.unpack(parallel.get_layer("attn")._query_dense.kernel.value.read_value())[0]
    assert block.shape == (DIM, HEADS // model_axis, DIM // HEADS)
    # Adam slots followed the new layouts.
    slot = [v for v in parallel.optimizer.variables if "attn_query_kernel" in v.path][0]
    assert dtensor.fetch_layout(slot.value) == dtensor.fetch_layout(
        parallel.get_layer("attn")._query_dense.kernel.value)


def test_auto_rules_keeps_the_output_head_whole():
    model = keras.Sequential([keras.Input((8,)),
                              keras.layers.Dense(16, activation="relu", name="hidden"),
                              keras.layers.Dense(4, name="logits")])
    assert dict(tfpar.auto_rules(model, axis_size=2).items()) == {}


def test_einsum_bias_split_follows_the_output_dims():
    layer = keras.layers.EinsumDense("ab,bcd->acd", output_shape=(4, 6),
                                     bias_axes="d")
    layer.build((None, 8))
    col = tfpar.ColumnParallel()
    assert col.spec_for(layer, "kernel", (8, 4, 6)) == (None, "model", None)
    # Only d (the second output dim) carries a bias; c is split: bias whole.
    assert col.spec_for(layer, "bias", (6,)) == (None,)


def test_vocab_wise_embedding_trains_in_parity():
    """RowParallel on an Embedding splits the vocabulary over the model axis."""
    reference, ref_losses = train_transformer(epochs=1)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}))
    model, losses = train_transformer(
        strategy, plan=lambda m: {"embed": tfpar.RowParallel()}, epochs=1)
    assert models.relative_error(ref_losses, losses) < 1e-4
    table = model.get_layer("embed").embeddings
    assert models.relative_error(reference.get_layer("embed").embeddings.numpy(),
                                 table.numpy()) < 1e-4
    assert dtensor.unpack(table.value.read_value())[0].shape == (VOCAB // 4, DIM)


class GatedBlock(keras.layers.Layer):
    """A subclassed decoder block: grouped-query attention with separate
    query/key/value EinsumDense layers (4 query, 2 key/value heads) and a
    gated MLP down(silu(gate(x)) * up(x)), each after an RMS norm."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = keras.layers.RMSNormalization(name="norm")
        self.q = keras.layers.EinsumDense("bsd,dnh->bsnh", (None, 4, 4), name="q")
        self.k = keras.layers.EinsumDense("bsd,dnh->bsnh", (None, 2, 4), name="k")
        self.v = keras.layers.EinsumDense("bsd,dnh->bsnh", (None, 2, 4), name="v")
        self.o = keras.layers.EinsumDense("bsnh,nhd->bsd", (None, DIM), name="o")
        self.gate = keras.layers.Dense(32, activation="silu", name="gate")
        self.up = keras.layers.Dense(32, name="up")
        self.down = keras.layers.Dense(DIM, name="down")

    def call(self, x):
        h = self.norm(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        k, v = keras.ops.repeat(k, 2, axis=2), keras.ops.repeat(v, 2, axis=2)
        scores = keras.ops.softmax(keras.ops.einsum("bsnh,btnh->bnst", q, k))
        x = x + self.o(keras.ops.einsum("bnst,btnh->bsnh", scores, v))
        return x + self.down(self.gate(x) * self.up(x))


def gated_model():
    tokens = keras.Input((SEQ,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, DIM, name="embed")(tokens)
    h = GatedBlock(name="block")(h)
    return keras.Model(tokens, keras.layers.Dense(VOCAB, name="head")(h))


def test_auto_rules_plans_inside_a_subclassed_block():
    model = gated_model()
    with pytest.warns(UserWarning) as caught:
        rules = dict(tfpar.auto_rules(model, axis_size=4).items())
    col, row = tfpar.ColumnParallel(), tfpar.RowParallel()
    assert rules == {"block/o": row, "block/q": col, "block/down": row,
                     "block/gate": col, "block/up": col, "embed": col}
    # Named by their own paths, with the reason; the block is not named.
    message = str(caught[0].message)
    assert "block/k (EinsumDense): 2 key/value heads" in message
    assert "block/v (EinsumDense)" in message and "grouped-query" in message
    assert "head (Dense): an output head" in message
    assert "block (GatedBlock)" not in message
    # On 2 devices the key/value heads split too.
    rules = dict(tfpar.auto_rules(model, axis_size=2).items())
    assert rules["block/k"] == rules["block/v"] == col
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}))
    with strategy.scope():
        model = gated_model()
        with pytest.warns(UserWarning):
            strategy.apply_rules(model, tfpar.auto_rules(model, mesh=strategy.mesh))
    blocks = {p: b for p, _, b in strategy.placements("params")}
    assert blocks["block/q/kernel"] == (DIM, 1, 4)
    assert blocks["block/o/kernel"] == (1, 4, DIM)
    assert blocks["block/gate/kernel"] == blocks["block/up/kernel"] == (DIM, 8)
    assert blocks["block/down/kernel"] == (8, DIM)
    assert blocks["block/k/kernel"] == (DIM, 2, 4)


class EagerOnly(keras.layers.Layer):
    """Builds in a functional graph (its own output spec) but cannot be
    traced: its call reads values."""

    def call(self, x):
        return x * float(x.numpy().mean())

    def compute_output_spec(self, x):
        return keras.KerasTensor(x.shape, x.dtype)


def test_auto_rules_says_what_to_do_when_the_trace_fails():
    inputs = keras.Input((8,))
    model = keras.Model(inputs, keras.layers.Dense(4)(EagerOnly()(inputs)),
                        name="eager_only")
    with pytest.raises(ValueError, match=r"traces model 'eager_only'.*trace failed.*Received: AttributeError.*LayoutRules"):
        tfpar.auto_rules(model, axis_size=2)


def test_styles_are_data_and_apply_is_the_one_step_that_changes_a_layer():
    """spec_for and activation_layouts answer without touching the layer;
    `apply` installs the relayouts the activation layouts name."""
    from tfpar import styles  # noqa: PLC0415

    model = transformer()
    up, embed = model.get_layer("mlp_up"), model.get_layer("embed")
    column = tfpar.ColumnParallel(sequence_parallel=True)
    assert column.spec_for(up, "kernel", (DIM, 4 * DIM)) == (None, "model")
    assert column.activation_layouts(up, "kernel", (DIM, 4 * DIM)) == (
        styles.ActivationLayout("sequence", "model", split=False), None)
    assert str(column.input_layout) == "sequence gathered over 'model'"
    assert column.activation_layouts(embed, "embeddings", (VOCAB, DIM)) == (
        None, styles.ActivationLayout("sequence", "model", split=True))
    assert tfpar.ColumnParallel().activation_layouts(
        embed, "embeddings", (VOCAB, DIM)) == (
        None, styles.ActivationLayout("hidden", "model", split=False))
    assert str(tfpar.RowParallel(sequence_parallel=True).output_layout) == (
        "sequence split over 'model'")
    assert tfpar.RowParallel().output_layout is None
    assert "call" not in vars(up) and not styles.is_sequence_parallel(up)
    column.apply(up, "kernel", (DIM, 4 * DIM))
    assert "call" in vars(up) and styles.is_sequence_parallel(up)
    assert styles.activation_layouts_of(up) == {"input": column.input_layout}


def test_apply_rules_with_an_unused_rule_changes_no_layer_and_no_weight():
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 4, "model": 2}))
    with strategy.scope():
        model = transformer()
    before = strategy.placements("params")
    calls = {layer.name: layer.call for layer in model._flatten_layers()}
    rules = tfpar.auto_rules(model, mesh=strategy.mesh, sequence_parallel=True)
    rules = tfpar.LayoutRules({**dict(rules.items()),
                               "nothing": tfpar.RowParallel()})
    with pytest.raises(ValueError, match=r"\['nothing'\] matched no weight"):
        strategy.apply_rules(model, rules)
    assert strategy.placements("params") == before
    for layer in model._flatten_layers():
        assert layer.call == calls[layer.name], layer.name
        assert "call" not in vars(layer), layer.name


def positions_model():
    """Token and position embeddings, the positions computed in the step
    (`zeros_like(tokens) + arange(seq)`, as examples/gpt.py does)."""
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    positions = keras.ops.zeros_like(tokens) + keras.ops.arange(SEQ)
    h = keras.layers.Embedding(VOCAB, DIM, name="embed")(tokens)
    h = h + keras.layers.Embedding(SEQ, DIM, name="pos")(positions)
    h = keras.layers.Dense(DIM, activation="gelu", name="mlp_up")(h)
    return keras.Model(tokens, keras.layers.Dense(VOCAB, name="head")(h))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_computed_position_ids_are_split_over_the_batch(optimizer):
    """On data=2 x model=4 with hidden-split embeddings, DTensor 2.21 laid
    the computed positions out whole on every device, so the position
    table's gradient dL/dy (batch, seq, hidden/4) was all-gathered over
    the data axis. The lookups' ids are now split over the batch: no
    all-gather on the data axis, the table's row sums all-reduced (one per
    sum Keras' optimizer takes: Adam sums the rows and their squares), and
    training in parity with one device (losses and weights within 1e-4)."""
    keras.utils.set_random_seed(0)
    weights = positions_model().get_weights()
    x, y = lm_data()

    def build(strategy=None):
        model = positions_model()
        model.set_weights(weights)
        if strategy is not None:
            strategy.apply_rules(model, tfpar.auto_rules(
                model, mesh=strategy.mesh))
        model.compile(optimizer=optimizer, loss=keras.losses.
                      SparseCategoricalCrossentropy(from_logits=True))
        return model

    reference, expected = models.train_built(None, build, x, y, 8)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}))
    parallel, got = models.train_built(strategy, lambda: build(strategy),
                                       x, y, 8)
    assert models.relative_error(expected, got) < 1e-4
    for a, b in zip(reference.weights, parallel.weights):
        assert models.relative_error(a.numpy(), b.numpy()) < 1e-4, a.path
    report = tfpar.communication_report(parallel, x[:8], y[:8])
    data = report.select(axes=("data",))
    assert not [c for c in data if c.purpose == "all-gather"], report
    table = [c for c in data if c.shape == (SEQ, DIM // 4)]
    assert len(table) == (2 if optimizer == "adam" else 1), report


def test_rules_known_before_build_leave_dropout_seed_state_replicated():
    """A strategy made with style rules (as `plan.strategy()` is) creates a
    styled attention's weights split as they are made; the SeedGenerator
    state of its dropout, made inside the attention but by no layer, is
    replicated (it failed with "ColumnParallel does not know how to lay
    out weight 'seed_generator_N/seed_generator_state'"), and the model
    trains."""
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"data": 2, "model": 4}),
        rules=tfpar.LayoutRules({"attention": tfpar.ColumnParallel()}))
    with strategy.scope():
        x = keras.Input((4, 16))
        h = keras.layers.MultiHeadAttention(4, 8, dropout=0.1,
                                            name="attention")(x, x)
        model = keras.Model(x, keras.layers.Dense(1, name="out")(h))
        model.compile(optimizer="sgd", loss="mse")
    states = [v for v in model.variables if "seed_generator_state" in v.path]
    assert states, [v.path for v in model.variables]
    for state in states:
        assert layout_lib.spec_of(dtensor.fetch_layout(state.value)) == (
            None,), state.path
    query = next(w for w in model.weights if w.path.endswith("query/kernel"))
    assert layout_lib.spec_of(dtensor.fetch_layout(query.value)) == (
        None, "model", None)
    rng = np.random.default_rng(0)
    model.fit(rng.normal(size=(8, 4, 16)).astype("float32"),
              rng.normal(size=(8, 4, 1)).astype("float32"), batch_size=8,
              verbose=0)
