"""Hugging Face's own models give a sharded tfpar model's logits (issue 37).

A small Llama3, Gemma and Mistral causal LM is built on a model=8 mesh with
rules from a builder (every split weight created split), exported with
`tfpar.pretrained.export_to_transformers` (each tensor gathered from its
blocks), loaded by the `transformers` package (`AutoModelForCausalLM`,
float32) and run on the same tokens: its logits equal the sharded model's
within 1e-4 relative.

`transformers` and torch live in a second environment, never in one
process with TensorFlow: `python3 dev.py test-all` makes it
(.venv-transformers, from requirements-transformers.txt) and passes its
Python as TFPAR_TRANSFORMERS_PYTHON; tests/transformers_logits_child.py
runs there. Without it the test fails, saying so (it is never skipped).
Slow only (torch's import and the three builds).
"""

import os
import subprocess

import keras
import keras_hub
import numpy as np
import pytest

import tfpar

import hub_models
from fuzzing import RTOL, relative_error

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CHILD = os.path.join(HERE, "transformers_logits_child.py")
SMALL = dict(vocabulary_size=hub_models.VOCAB, num_layers=2,
             num_query_heads=8, hidden_dim=64, intermediate_dim=128)
FAMILIES = {  # (backbone, causal LM, arguments beyond SMALL)
    "llama3": (keras_hub.models.Llama3Backbone,
               keras_hub.models.Llama3CausalLM, dict(num_key_value_heads=8)),
    "gemma": (keras_hub.models.GemmaBackbone, keras_hub.models.GemmaCausalLM,
              dict(num_key_value_heads=8, head_dim=8)),
    "mistral": (keras_hub.models.MistralBackbone,
                keras_hub.models.MistralCausalLM,
                dict(num_key_value_heads=8,
                     sliding_window=hub_models.SEQ_LEN)),
}


def transformers_python():
    """The Python of the environment with torch and transformers."""
    python = os.environ.get("TFPAR_TRANSFORMERS_PYTHON") or os.path.join(
        ROOT, ".venv-transformers", "bin", "python")
    if not os.path.exists(python):
        pytest.fail(
            f"No Python with the transformers package at {python!r}. Run "
            "`python3 dev.py test-all` (it makes .venv-transformers from "
            "requirements-transformers.txt), or set TFPAR_TRANSFORMERS_PYTHON "
            "to a Python that has torch and transformers.")
    return python


def transformers_logits(python, checkpoint, tokens, tmp_path):
    """Logits of `checkpoint` by transformers' AutoModelForCausalLM, run by
    `python`."""
    tokens_file = str(tmp_path / "tokens.npy")
    out_file = str(tmp_path / "logits.npy")
    np.save(tokens_file, tokens)
    result = subprocess.run(
        [python, CHILD, checkpoint, tokens_file, out_file],
        capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    return np.load(out_file)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_transformers_logits_equal_the_sharded_models(tmp_path, family):
    python = transformers_python()  # fails first when there is none
    backbone_cls, lm_cls, arguments = FAMILIES[family]

    def build():
        keras.utils.set_random_seed(0)
        return backbone_cls(**SMALL, **arguments)

    mesh = tfpar.Mesh({"model": 8})
    strategy = tfpar.ParallelStrategy(
        mesh, rules=tfpar.auto_rules(build, mesh=mesh))
    x, _ = hub_models.data("llama", batch=2)
    with strategy.scope():
        model = lm_cls(build(), preprocessor=None)
        want = np.asarray(model(x))
    split = [p for p, spec, _ in strategy.placements() if "model" in spec]
    assert len(split) >= 2 * 7, split  # attention and MLP of both blocks
    checkpoint = str(tmp_path / "hf")
    tfpar.pretrained.export_to_transformers(model, checkpoint)
    got = transformers_logits(python, checkpoint, x["token_ids"], tmp_path)
    assert got.shape == want.shape
    assert relative_error(want, got) < RTOL
