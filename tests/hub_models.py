"""Small keras-hub 0.32 models built from constructor arguments, and data.

Shared by every test that trains a model nobody here wrote. No preset
weights (nothing can be downloaded here): each model is built from its
backbone's constructor with widths that every mesh axis of size 2, 4 or 8
divides (heads 8, hidden 32 or 64, intermediate 64 or 128), random weights,
`preprocessor=None`, token ids (or images) in. Dropout is 0 so training is
deterministic and comparable with one device (RANDOM_BUILDERS keep theirs).

>>> model = hub_models.build("llama_gqa")
>>> x, y = hub_models.data("llama_gqa", batch=8)
"""

import keras
import keras_hub
import numpy as np

SEQ_LEN = 8
VOCAB = 64
IMAGE_SHAPE = (16, 16, 3)
NUM_CLASSES = 4


def _gpt2(dropout=0.0):
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=8, hidden_dim=32,
        intermediate_dim=64, dropout=dropout, max_sequence_length=SEQ_LEN)
    return keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)


def _llama(num_key_value_heads):
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=8,
        hidden_dim=64, intermediate_dim=128,
        num_key_value_heads=num_key_value_heads)
    return keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)


def _gemma():
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=8,
        num_key_value_heads=8, hidden_dim=64, intermediate_dim=128,
        head_dim=8)
    return keras_hub.models.GemmaCausalLM(backbone, preprocessor=None)


def _mistral():
    backbone = keras_hub.models.MistralBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=8,
        hidden_dim=64, intermediate_dim=128, num_key_value_heads=4,
        sliding_window=SEQ_LEN)
    return keras_hub.models.MistralCausalLM(backbone, preprocessor=None)


def _bert():
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=8, hidden_dim=32,
        intermediate_dim=64, dropout=0.0, max_sequence_length=SEQ_LEN)
    return keras_hub.models.BertTextClassifier(
        backbone, num_classes=NUM_CLASSES, preprocessor=None, dropout=0.0)


def _vit():
    backbone = keras_hub.models.ViTBackbone(
        image_shape=IMAGE_SHAPE, patch_size=4, num_layers=2, num_heads=8,
        hidden_dim=32, mlp_dim=64)
    return keras_hub.models.ViTImageClassifier(
        backbone, num_classes=NUM_CLASSES, preprocessor=None)


def _mixtral():
    backbone = keras_hub.models.MixtralBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=8,
        hidden_dim=32, intermediate_dim=64, num_key_value_heads=4,
        num_experts=8, top_k=2, sliding_window=SEQ_LEN)
    return keras_hub.models.MixtralCausalLM(backbone, preprocessor=None)


def _qwen3_moe():
    backbone = keras_hub.models.Qwen3MoeBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=8,
        num_key_value_heads=4, hidden_dim=32, intermediate_dim=64,
        moe_intermediate_dim=32, num_experts=8, head_dim=8, top_k=2,
        norm_top_k_prob=True)
    return keras_hub.models.Qwen3MoeCausalLM(backbone, preprocessor=None)


def _gpt_oss():
    backbone = keras_hub.models.GptOssBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=8,
        hidden_dim=32, intermediate_dim=32, num_key_value_heads=4,
        num_experts=8, top_k=2, head_dim=8, sliding_window=SEQ_LEN)
    return keras_hub.models.GptOssCausalLM(backbone, preprocessor=None)


BUILDERS = {
    "gpt2": _gpt2,
    "llama": lambda: _llama(8),
    "llama_gqa": lambda: _llama(2),  # grouped-query: 8 query, 2 kv heads
    "gemma": _gemma,
    "mistral": _mistral,
    "bert": _bert,
    "vit": _vit,
}
# Mixture-of-experts causal LMs (tests/test_moe_keras_hub.py), apart from
# BUILDERS, whose every model has a Megatron plan: 8 experts (every expert
# axis of 2, 4 or 8 divides them), top-2 routing, expert banks
# [experts, in, out].
MOE_BUILDERS = {
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
    "gpt_oss": _gpt_oss,
}
MOE_LMS = tuple(MOE_BUILDERS)
# With keras-hub's own Dropout (tests that seed Keras alike on both sides:
# tests/test_hosts_pipeline.py).
RANDOM_BUILDERS = {"gpt2_dropout": lambda: _gpt2(dropout=0.1)}
CAUSAL_LMS = ("gpt2", "llama", "llama_gqa", "gemma", "mistral")

# Hand-written Megatron plans (attention by heads, MLP column -> row) that
# train each model in parity: what auto_rules must find by itself.
_LLAMA_RULES = {r".*self_attention": "column",
                r".*feedforward_(gate|intermediate)_dense": "column",
                r".*feedforward_output_dense": "row"}
MEGATRON_RULES = {
    "gpt2": {r".*self_attention": "column",
             r".*feedforward_intermediate_dense": "column",
             r".*feedforward_output_dense": "row"},
    "llama": _LLAMA_RULES,
    "llama_gqa": _LLAMA_RULES,
    "mistral": _LLAMA_RULES,
    "gemma": {r".*attention": "column", r".*ffw_gating(_2)?": "column",
              r".*ffw_linear": "row"},
    "bert": {r".*self_attention_layer": "column",
             r".*feedforward_intermediate_dense": "column",
             r".*feedforward_output_dense": "row"},
    "vit": {r".*mha": "column", r".*mlp/dense_1": "column",
            r".*mlp/dense_2": "row"},
}


def megatron_rules(name):
    """MEGATRON_RULES[name] as `tfpar.LayoutRules`."""
    import tfpar  # noqa: PLC0415 (the builders need no tfpar)

    styles = {"column": tfpar.ColumnParallel(), "row": tfpar.RowParallel()}
    return tfpar.LayoutRules({pattern: styles[style] for pattern, style
                              in MEGATRON_RULES[name].items()})


def build(name, seed=0):
    """The model `name` (a key of BUILDERS), built, with seeded weights."""
    keras.utils.set_random_seed(seed)
    model = {**BUILDERS, **MOE_BUILDERS, **RANDOM_BUILDERS}[name]()
    if not model.built:  # keras-hub's functional models build in __init__
        x, _ = data(name, batch=2)
        model(x)
    return model


def data(name, batch=16, seed=1):
    """(x, y) for `name`: token ids and next-token targets for the causal
    LMs, token ids / images and class labels for the classifiers."""
    rng = np.random.default_rng(seed)
    if name == "vit":
        x = rng.random((batch,) + IMAGE_SHAPE).astype("float32")
        return x, rng.integers(0, NUM_CLASSES, (batch,))
    ids = rng.integers(1, VOCAB, (batch, SEQ_LEN)).astype("int32")
    mask = np.ones_like(ids, dtype=bool)
    if name == "bert":
        x = {"token_ids": ids, "segment_ids": np.zeros_like(ids),
             "padding_mask": mask}
        return x, rng.integers(0, NUM_CLASSES, (batch,))
    x = {"token_ids": ids, "padding_mask": mask}
    return x, rng.integers(0, VOCAB, (batch, SEQ_LEN))


def loss(name):
    """The loss each model trains with (logits out)."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)
