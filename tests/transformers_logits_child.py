"""Logits of a Hugging Face checkpoint by the `transformers` package, run
with the Python of the transformers environment (no tfpar, no TensorFlow:
torch and transformers only), for tests/test_transformers_logits.py.

    python transformers_logits_child.py CHECKPOINT_DIR TOKENS.npy OUT.npy

Loads CHECKPOINT_DIR with `AutoModelForCausalLM` in float32 and writes
the logits (batch, sequence, vocabulary) for the token ids in TOKENS.npy
(batch, sequence; every position attended) to OUT.npy.
"""

import sys

import numpy as np
import torch
import transformers


def main(checkpoint, tokens_file, out_file):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32)
    model.eval()
    tokens = torch.from_numpy(np.load(tokens_file).astype("int64"))
    with torch.no_grad():
        logits = model(input_ids=tokens,
                       attention_mask=torch.ones_like(tokens)).logits
    np.save(out_file, logits.numpy())
    print(type(model).__name__, transformers.__version__, torch.__version__)


if __name__ == "__main__":
    main(*sys.argv[1:])
