"""auto_rules splits attention whose output projection reads merged heads.

keras-hub's GPT-NeoX (Pythia) computes query, key and value with one
EinsumDense "abc,cde->abde" of kernel (hidden, heads, 3·head_dim), merges
the attention's (batch, seq, heads, head_dim) into (batch, seq, hidden)
with a reshape, and projects it with an EinsumDense "abc,cd->abd" that
contracts one dimension. auto_rules looked for an output projection
contracting two dimensions (heads, head_dim), so it kept both whole on
every device (its warning: "in no MLP or attention pattern"). A reshape
merging (heads, head_dim) heads-major makes the merged rows' t blocks the
heads' t blocks: the output is RowParallel, the fused projection
ColumnParallel by heads, and one all-reduce follows, as with split q/k/v.
"""

import warnings

import keras
import keras_hub
import numpy as np

import tfpar

import models
import test_keras_hub as hub_checks

HEADS, HEAD_DIM, SEQ = 4, 8, 16
HIDDEN = HEADS * HEAD_DIM
MESH = {"data": 2, "model": 4}


def gpt_neox():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPTNeoXBackbone(
        vocabulary_size=256, num_layers=2, num_heads=HEADS,
        hidden_dim=HIDDEN, intermediate_dim=64, max_sequence_length=SEQ)
    return keras_hub.models.GPTNeoXCausalLM(backbone=backbone,
                                            preprocessor=None)


def attention_block(transpose_heads=False):
    """q, k, v EinsumDense (batch, seq, heads, head_dim), softmax attention,
    the heads merged by a reshape (after swapping heads and head_dim when
    `transpose_heads`), a Dense "out", the residual and a norm."""
    x = keras.Input((SEQ, HIDDEN))

    def project(name):
        return keras.layers.EinsumDense(
            "btd,dnh->btnh", (SEQ, HEADS, HEAD_DIM), name=name)(x)
    q, k, v = project("q"), project("k"), project("v")
    scores = keras.ops.softmax(keras.ops.einsum("btnh,bsnh->bnts", q, k))
    heads = keras.ops.einsum("bnts,bsnh->btnh", scores, v)
    if transpose_heads:
        heads = keras.ops.transpose(heads, (0, 1, 3, 2))
    merged = keras.layers.Reshape((SEQ, HIDDEN))(heads)
    out = keras.layers.Dense(HIDDEN, name="out")(merged)
    # A norm after the residual: "out" is not the model's output head.
    return keras.Model(x, keras.layers.LayerNormalization(name="norm")(
        keras.layers.Add()([x, out])))


def rules(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        planned = tfpar.auto_rules(model, mesh=tfpar.Mesh(MESH))
    return ({path: type(style).__name__
             for path, style in planned.items()},
            " ".join(str(w.message) for w in caught))


def test_an_output_dense_over_merged_heads_is_row_parallel():
    planned, _ = rules(attention_block())
    assert planned == {"q": "ColumnParallel", "k": "ColumnParallel",
                       "v": "ColumnParallel", "out": "RowParallel"}


def test_heads_merged_after_a_transpose_are_not_read_as_heads():
    """(head_dim, heads) merged: the rows' blocks are not heads, so the
    output is not planned as attention (it stays whole, warned)."""
    planned, warned = rules(attention_block(transpose_heads=True))
    assert "out" not in planned, planned
    assert "out (Dense): in no MLP or attention pattern" in warned


def test_gpt_neox_attention_trains_split_by_heads_like_one_device():
    planned, warned = rules(gpt_neox())
    for layer in (0, 1):
        attention = f"transformer_layer_{layer}/self_attention/"
        assert planned[attention + "query_key_value"] == "ColumnParallel"
        assert planned[attention + "attention_output"] == "RowParallel"
    assert "self_attention" not in warned, warned

    weights = gpt_neox().get_weights()
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 256, (16, SEQ)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids, bool)}
    y = rng.integers(0, 256, (16, SEQ))

    def build(strategy):
        def built():
            model = gpt_neox()
            model.set_weights(weights)
            if strategy is not None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # embeddings: not here
                    strategy.apply_rules(
                        model, tfpar.auto_rules(model, mesh=strategy.mesh))
            model.compile(optimizer=keras.optimizers.SGD(0.1),
                          loss=keras.losses.SparseCategoricalCrossentropy(
                              from_logits=True), weighted_metrics=[])
            return model
        return built

    reference, want = models.train_built(None, build(None), x, y, 8)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(MESH))
    with tfpar.communication.capture() as programs:
        model, got = models.train_built(strategy, build(strategy), x, y, 8)
    assert models.relative_error(want, got) < 1e-4, (want, got)
    hub_checks.assert_same_weights(reference, model)
    # Each device holds its heads: a quarter of the fused projection's
    # heads (hidden, heads/4, 3·head_dim) and of the output's merged rows.
    for weight in model.weights:
        if "query_key_value/kernel" in weight.path:
            models.assert_one_block_per_device(weight, (None, "model", None))
        elif "attention_output/kernel" in weight.path:
            models.assert_one_block_per_device(weight, ("model", None))
    # The attention moves nothing but its all-reduce over the model axis:
    # the only model-axis gathers are the hidden-split token embedding's.
    gathers = [c for c in programs.train_report().select(spans="model")
               if c.purpose != "all-reduce"]
    assert gathers and all("token_embedding" in c.name for c in gathers), (
        [(c.phase, c.purpose, c.name) for c in gathers])

