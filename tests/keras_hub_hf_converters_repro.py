"""Minimal reproductions: keras-hub 0.32's Hugging Face converters lose or
break weights in a round trip (export with its name map, import with its
converter), shown without the `safetensors` package (its maps and
converters are called directly, with an in-memory loader).

1. GPT-2: the importer reads the MLP width as 4 * n_embd and ignores
   `n_inner`, which its exporter writes: a GPT-2 whose intermediate_dim is
   not 4 * hidden_dim fails to load back with a reshape error.
2. Gemma: the exporter writes only the first key/value head
   (`key_dense.weights[0][0]`): right for Gemma 2B (one head), a tensor
   of the wrong shape for several heads (Gemma 7B has 16).
3. Mistral: the importer casts every tensor to float16: a float32
   checkpoint loads rounded.
4. Llama3: `Llama3Backbone`'s export (include_lm_head=False) leaves the
   untied `lm_head.weight` out, which its importer requires.

tfpar works around each (`tfpar/pretrained.py`: `_CONFIG_FIXES`,
`_MAP_FIXES`, `_KEEP_PRECISION`, lm_head for untied backbones);
tests/test_pretrained.py's round trips pass through tfpar.

Run: python tests/keras_hub_hf_converters_repro.py   (prints 4 lines, each
"BUG ..." while keras-hub has the bug)
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
from keras_hub.src.utils.transformers import (  # noqa: E402
    convert_gemma, convert_gpt2, convert_llama3, convert_mistral)
from keras_hub.src.utils.transformers.export import (  # noqa: E402
    hf_exporter)


class MemoryLoader:
    """keras-hub's loader interface over a {name: array} dict."""

    def __init__(self, tensors):
        self.tensors = tensors

    def get_tensor(self, key):
        """The tensor `key`, or the one `key` ends (a "transformer." prefix,
        as keras-hub's loader allows)."""
        if key in self.tensors:
            return self.tensors[key]
        for name, tensor in self.tensors.items():
            if name.endswith("." + key):
                return tensor
        raise KeyError(key)

    def port_weight(self, keras_variable, hf_weight_key, hook_fn=None):
        tensor = self.get_tensor(hf_weight_key)
        if hook_fn is not None:
            tensor = hook_fn(tensor, list(keras_variable.shape))
        keras_variable.assign(tensor)


def exported(backbone, include_lm_head=False):
    kind = type(backbone).__name__
    config = hf_exporter.MODEL_CONFIGS[kind](backbone)
    weights = hf_exporter.MODEL_EXPORTERS[kind](
        backbone, include_lm_head=include_lm_head)
    return config, {k: keras.ops.convert_to_numpy(v) for k, v in
                    weights.items()}


def reimport(converter, config, tensors):
    backbone = converter.backbone_cls(**converter.convert_backbone_config(
        config))
    converter.convert_weights(backbone, MemoryLoader(tensors), config)
    return backbone


def gpt2():
    source = keras_hub.models.GPT2Backbone(
        vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=16,
        intermediate_dim=48, max_sequence_length=8)
    try:
        reimport(convert_gpt2, *exported(source))
        return "ok: GPT-2 with intermediate_dim != 4 * hidden_dim loads back"
    except ValueError as error:
        return f"BUG GPT-2 (n_inner ignored): {str(error)[:90]}"


def gemma():
    source = keras_hub.models.GemmaBackbone(
        vocabulary_size=64, num_layers=1, num_query_heads=4,
        num_key_value_heads=4, hidden_dim=16, intermediate_dim=32,
        head_dim=4)
    _, tensors = exported(source)
    shape = tensors["model.layers.0.self_attn.k_proj.weight"].shape
    if shape != (16, 16):
        return f"BUG Gemma: k_proj exported as {shape}, HF has (16, 16)"
    return "ok: Gemma's key/value heads exported whole"


def mistral():
    keras.utils.set_random_seed(0)
    source = keras_hub.models.MistralBackbone(
        vocabulary_size=64, num_layers=1, num_query_heads=4,
        num_key_value_heads=2, hidden_dim=16, intermediate_dim=32)
    loaded = reimport(convert_mistral, *exported(source, True))
    want = source.token_embedding.embeddings.numpy()
    got = loaded.token_embedding.embeddings.numpy()
    if not np.array_equal(want, got):
        error = np.max(np.abs(want - got) / np.abs(want).max())
        return f"BUG Mistral: float32 weights load rounded (rel. {error:.1e})"
    return "ok: Mistral's float32 weights load exactly"


def llama3():
    source = keras_hub.models.Llama3Backbone(
        vocabulary_size=64, num_layers=1, num_query_heads=4,
        num_key_value_heads=4, hidden_dim=16, intermediate_dim=32)
    try:
        reimport(convert_llama3, *exported(source))
        return "ok: Llama3Backbone's export loads back"
    except KeyError as error:
        return f"BUG Llama3Backbone: its export lacks {error}"


if __name__ == "__main__":
    for case in (gpt2, gemma, mistral, llama3):
        print(case())
