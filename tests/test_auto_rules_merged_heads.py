"""auto_rules splits attention whose heads are made or merged by reshapes.

auto_rules knew attention as an output EinsumDense contracting two
dimensions (heads, head_dim) that reads EinsumDense projections making
two (Llama, Gemma, Mistral, Qwen, BERT's keras-hub attention). keras-hub
models written the other common way kept their attention whole on every
device (warned "in no MLP or attention pattern"):

- GPT-NeoX (Pythia): one fused EinsumDense "abc,cde->abde" makes
  (heads, 3·head_dim); the attention's (batch, seq, heads, head_dim) is
  merged by a reshape and projected by "abc,cd->abd" (one contracted
  dimension);
- SmolLM3, T5, ESM2, RoFormerV2: Dense q/k/v making heads·head_dim,
  reshaped to (batch, seq, heads, head_dim); the output a Dense after a
  merging reshape (T5, ESM2, RoFormerV2) or an EinsumDense (SmolLM3). T5's
  attention also returns the position bias its core adds, and SmolLM3's
  rotary frequencies are a (non-trainable) weight of their own layer: not
  projections, so they no longer hide the pattern.

A reshape splitting or merging (heads, head_dim) heads-major makes a
heads·head_dim dimension's t blocks the heads' t blocks: the projections
are ColumnParallel and the output RowParallel, one all-reduce follows, as
with (heads, head_dim) kernels.
"""

import warnings

import keras
import pytest

import tfpar

import hub_probes
from hub_probes import HEAD_DIM, HEADS, SEQ

MESH = {"data": 2, "model": 4}


def attention_block(transpose_heads=False, heads=HEADS, head_dim=HEAD_DIM):
    """q, k, v EinsumDense (batch, seq, heads, head_dim), softmax attention,
    the heads merged by a reshape (after swapping heads and head_dim when
    `transpose_heads`), a Dense "out", the residual and a norm."""
    hidden = heads * head_dim
    x = keras.Input((SEQ, hidden))

    def project(name):
        return keras.layers.EinsumDense(
            "btd,dnh->btnh", (SEQ, heads, head_dim), name=name)(x)
    q, k, v = project("q"), project("k"), project("v")
    scores = keras.ops.softmax(keras.ops.einsum("btnh,bsnh->bnts", q, k))
    attended = keras.ops.einsum("bnts,bsnh->btnh", scores, v)
    if transpose_heads:
        attended = keras.ops.transpose(attended, (0, 1, 3, 2))
    merged = keras.layers.Reshape((SEQ, hidden))(attended)
    out = keras.layers.Dense(hidden, name="out")(merged)
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


@pytest.mark.parametrize("heads, head_dim", [(HEADS, HEAD_DIM), (8, 8)])
def test_heads_merged_after_a_transpose_are_not_read_as_heads(heads,
                                                              head_dim):
    """(head_dim, heads) merged: the rows' blocks are not heads, so the
    output is not planned as attention (it stays whole, warned) — also
    when heads == head_dim, where the shapes cannot tell."""
    planned, warned = rules(attention_block(True, heads, head_dim))
    assert "out" not in planned, planned
    assert "out (Dense): in no MLP or attention pattern" in warned


def test_heads_made_by_reshapes_the_axis_does_not_divide_stay_whole():
    """4 heads on model=8: attention made by reshapes was kept whole
    before it was read as attention (SegFormer's 1- and 2-head stages), so
    it stays whole, warned with the reason, rather than an error."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        planned = tfpar.auto_rules(attention_block(),
                                   mesh=tfpar.Mesh({"model": 8}))
    assert "out" not in dict(planned.items())
    assert ("out (Dense): 4 attention heads (made by reshapes), which mesh "
            "axis 'model' of size 8 does not divide") in " ".join(
                str(w.message) for w in caught)


def kept_whole(warned):
    """The Dense/EinsumDense layers auto_rules' warning keeps whole."""
    return [line.strip() for line in warned.splitlines()
            if "(Dense)" in line or "(EinsumDense)" in line]


@pytest.mark.parametrize("name", [
    "gpt_neox", pytest.param("smollm3", marks=pytest.mark.slow),
    pytest.param("t5", marks=pytest.mark.slow),
    pytest.param("esm2", marks=pytest.mark.slow),
    pytest.param("roformer_v2", marks=pytest.mark.slow)])
def test_keras_hub_attention_trains_split_by_heads_like_one_device(name):
    planned, warned = rules(hub_probes.probe_model(name))
    assert kept_whole(warned) == [
        "probe (Dense): an output head, kept whole so the logits are whole"
    ], warned
    assert "RowParallel" in planned.values(), planned

    programs = hub_probes.assert_trains_like_one_device(name, MESH)
    # Inside the attention nothing moves over the model axis but the
    # row-parallel output's all-reduce (and the column-parallel inputs'
    # gradient all-reduce): each device computes its own heads.
    moved = [c for c in programs.train_report().select(spans="model")
             if ("attention" in c.name or "attn" in c.name)
             and c.purpose != "all-reduce"]
    assert not moved, [(c.phase, c.purpose, c.name) for c in moved]
