"""keras-hub backbones beyond tests/hub_models.py, each with a probe head.

Small backbones built from constructor arguments (no preset download),
each given a Dense "probe" of 4 units on its (decoder's) sequence output,
trained with MSE: every weight of the backbone trains, whatever its task
head would be. `train(name, strategy)` fits one the same way on one device
(`strategy` None) or planned by `tfpar.auto_rules` on a strategy's mesh.
Used by tests/test_auto_rules_merged_heads.py and
tests/test_keras_hub_more.py.
"""

import warnings

import keras
import keras_hub
import numpy as np
from keras.src.utils import naming

import tfpar

import models

HEADS, HEAD_DIM, SEQ = 4, 8, 16
HIDDEN = HEADS * HEAD_DIM
VOCAB, FFN = 256, 64
_M = keras_hub.models
_TEXT = dict(vocabulary_size=VOCAB, num_layers=2, hidden_dim=HIDDEN,
             intermediate_dim=FFN)

BACKBONES = {
    # attention with heads made or merged by reshapes
    "gpt_neox": lambda: _M.GPTNeoXBackbone(
        num_heads=HEADS, max_sequence_length=SEQ, **_TEXT),
    "smollm3": lambda: _M.SmolLM3Backbone(
        vocabulary_size=VOCAB, hidden_dim=2 * HIDDEN, intermediate_dim=FFN,
        num_layers=2, num_attention_heads=2 * HEADS,
        num_key_value_heads=HEADS, attention_bias=False,
        attention_dropout=0.0, rope_layer_enabled_list=[True, False],
        layer_types=["attention", "attention"], mlp_bias=False,
        layer_norm_epsilon=1e-6, max_position_embeddings=SEQ,
        rope_theta=10000.0, partial_rotary_factor=1.0),
    "t5": lambda: _M.T5Backbone(num_heads=HEADS, **_TEXT),
    "esm2": lambda: _M.ESM2Backbone(num_heads=HEADS, **_TEXT),
    "roformer_v2": lambda: _M.RoformerV2Backbone(
        num_heads=HEADS, head_size=HEAD_DIM, **_TEXT),
    # other keras-hub families
    "xlnet": lambda: _M.XLNetBackbone(num_heads=HEADS, **_TEXT),
    "opt": lambda: _M.OPTBackbone(
        num_heads=HEADS, max_sequence_length=SEQ, **_TEXT),
    "bloom": lambda: _M.BloomBackbone(num_heads=HEADS, **_TEXT),
    "falcon": lambda: _M.FalconBackbone(num_attention_heads=HEADS, **_TEXT),
    "phi3": lambda: _M.Phi3Backbone(
        num_query_heads=HEADS, num_key_value_heads=HEADS, **_TEXT),
    "qwen": lambda: _M.QwenBackbone(
        num_query_heads=HEADS, num_key_value_heads=HEADS, **_TEXT),
    "gemma3": lambda: _M.Gemma3Backbone(
        image_size=None, num_query_heads=HEADS, num_key_value_heads=HEADS,
        head_dim=HEAD_DIM, **_TEXT),
    "deberta_v3": lambda: _M.DebertaV3Backbone(
        num_heads=HEADS, max_sequence_length=SEQ, **_TEXT),
    "bart": lambda: _M.BartBackbone(
        num_heads=HEADS, max_sequence_length=SEQ, **_TEXT),
    "whisper": lambda: _M.WhisperBackbone(
        num_heads=HEADS, max_encoder_sequence_length=SEQ,
        max_decoder_sequence_length=SEQ, **_TEXT),
    "dinov2": lambda: _M.DINOV2Backbone(
        patch_size=4, num_layers=2, hidden_dim=HIDDEN, num_heads=HEADS,
        intermediate_dim=FFN, image_shape=(16, 16, 3)),
    "swin": lambda: _M.SwinTransformerBackbone(
        image_shape=(16, 16, 3), embed_dim=16, depths=[2], num_heads=[2],
        window_size=2, patch_size=2),
    "mit": lambda: _M.MiTBackbone(
        layerwise_depths=[1, 1], num_layers=2, layerwise_num_heads=[1, 2],
        layerwise_sr_ratios=[2, 1], max_drop_path_rate=0.0,
        layerwise_patch_sizes=[3, 3], layerwise_strides=[2, 2],
        image_shape=(16, 16, 3), hidden_dims=[8, 16]),
    "deit": lambda: _M.DeiTBackbone(
        image_shape=(16, 16, 3), patch_size=4, num_layers=2,
        num_heads=HEADS, hidden_dim=HIDDEN, intermediate_dim=FFN),
}


def probe_model(name):
    """The backbone `name`, seeded, with a Dense "probe" of 4 units on its
    (decoder's) sequence output."""
    keras.utils.set_random_seed(0)
    naming.reset_uids()  # unnamed layers: the same paths every build
    backbone = BACKBONES[name]()
    output = backbone.output
    if isinstance(output, dict):
        output = output.get("decoder_sequence_output",
                            output.get("sequence_output"))
    return keras.Model(backbone.input,
                       keras.layers.Dense(4, name="probe")(output))


def probe_data(model, batch=16):
    """(x, y): random ids for the model's integer inputs, all-ones masks,
    zero segment ids, normal floats for its float inputs (images, audio
    features; unknown lengths SEQ); normal targets for the probe."""
    rng = np.random.default_rng(0)
    x = {}
    inputs = model.input if isinstance(model.input, dict) else {
        "images": model.input}
    for key, spec in inputs.items():
        shape = (batch,) + tuple(SEQ if d is None else d
                                 for d in spec.shape[1:])
        if "mask" in key:
            x[key] = np.ones(shape, bool)
        elif "segment" in key:
            x[key] = np.zeros(shape, "int32")
        elif "int" in str(spec.dtype):
            x[key] = rng.integers(1, VOCAB, shape).astype("int32")
        else:
            x[key] = rng.normal(size=shape).astype("float32")
    out = (batch,) + tuple(SEQ if d is None else d
                           for d in model.output.shape[1:])
    if not isinstance(model.input, dict):
        x = x["images"]
    return x, rng.normal(size=out).astype("float32")


def assert_same_weights(reference, model):
    """Every weight of `model` equals `reference`'s of the same path within
    1e-4 relative to the reference's largest value, or 1e-7 absolutely
    where that is below 1e-3: weights whose true gradient is zero (key
    biases under softmax, XLNet's segment bias on one segment) stay at
    their zero start plus float32 noise (1e-14..1e-9), which differs
    between one device and a mesh."""
    for want, got in zip(reference.weights, model.weights, strict=True):
        assert want.path == got.path, (want.path, got.path)
        a = np.asarray(want.numpy(), "float64")
        b = np.asarray(got.numpy(), "float64")
        scale = max(float(np.abs(a).max()), 1e-3)
        assert np.abs(a - b).max() <= 1e-4 * scale, (
            want.path, np.abs(a - b).max(), scale)


def train(name, strategy):
    """(model, per-batch losses) of `probe_model(name)` after one epoch of
    fit with SGD(0.1) on `probe_data` at batch 8, planned by auto_rules
    when `strategy` is given (one device when None)."""
    weights = probe_model(name).get_weights()
    x, y = probe_data(probe_model(name))

    def build():
        model = probe_model(name)
        model.set_weights(weights)
        if strategy is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the probe: whole
                strategy.apply_rules(
                    model, tfpar.auto_rules(model, mesh=strategy.mesh))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model
    return models.train_built(strategy, build, x, y, 8)


def assert_trains_like_one_device(name, mesh):
    """`train(name, ...)` on `mesh` ({axis: size}) in parity with one
    device (losses 1e-4 relative, every weight by `assert_same_weights`),
    each device holding only its block of every weight split over
    "model" (at least one). Returns the compiled step's
    `tfpar.communication` programs."""
    reference, want = train(name, None)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(mesh))
    with tfpar.communication.capture() as programs:
        model, got = train(name, strategy)
    assert models.relative_error(want, got) < 1e-4, (want, got)
    assert_same_weights(reference, model)
    weights = {w.path: w for w in model.weights}
    split = [(path, spec) for path, spec, _ in strategy.placements("params")
             if "model" in spec]
    assert split, "auto_rules split nothing"
    for path, spec in split:
        models.assert_one_block_per_device(weights[path], spec)
    return programs
