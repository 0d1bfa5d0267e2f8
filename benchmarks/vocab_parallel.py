"""Logits per device, whole vs split over the vocabulary (8 virtual CPUs).

    python benchmarks/vocab_parallel.py [--vocab 32768] [--batch 8] [--seq 64]
                                        [--keras-argmax]

Builds a small keras-hub GPT-2 (tied ReversibleEmbedding head) and Llama
(untied head) with a large vocabulary, plans each on data=2 x model=4 with
`tfpar.auto_rules` twice (the default: head whole or hidden-split, logits
whole; and `vocab_parallel=True`: head split over the vocabulary), and reads
one compiled training step of each (`tfpar.communication_report`, nothing
trained) for, per device:

- loss logits: bytes of the (tokens, vocab) tensor the cross-entropy keeps
  for the backward pass (softmax - one_hot(target));
- logits coll.: bytes of the forward collectives over "model" that move
  logits (named after the head's projection or the loss op);
- logits gathers: bytes of all-gathers over "model" of whole-vocabulary
  tensors (keras-hub's default metric, SparseCategoricalAccuracy, takes
  an argmax of the logits; tfpar computes it by reductions in a step,
  `tfpar.vocab_parallel`, else DTensor gathers the logits whole);
- table gather: bytes of the all-gather of the embedding table the lookup
  reads (DTensor gathers a vocab-split table whole for a lookup);
- model coll.: bytes of every collective over "model" (forward and
  backward);
- saved: all forward activations the backward pass keeps.

`--keras-argmax` measures with Keras' own argmax (tfpar's
`vocab_parallel.PATCHES` not installed), for comparison.
"""

import argparse
import os
import re
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import tfpar  # noqa: E402
from tfpar import vocab_parallel  # noqa: E402

tfpar.use_virtual_cpus(8)

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

LOSS_OP = re.compile(r"compile_loss/.*SparseSoftmaxCrossEntropyWithLogits")
LOGITS_OPS = re.compile(
    r"^compile_loss/|token_embedding[^/]*/(Tensordot|MatMul|einsum)")
TABLE_READ = re.compile(r"token_embedding[^/]*/GatherV2/ReadVariableOp/")


def build(name, vocab, seq):
    if name == "gpt2":
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=vocab, num_layers=2, num_heads=8, hidden_dim=64,
            intermediate_dim=128, dropout=0.0, max_sequence_length=seq)
        return keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=vocab, num_layers=2, num_query_heads=8,
        hidden_dim=64, intermediate_dim=128, num_key_value_heads=8)
    return keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)


def measure(name, vocab, batch, seq, vocab_parallel):
    mesh = tfpar.Mesh({"data": 2, "model": 4})
    strategy = tfpar.ParallelStrategy(mesh)
    with strategy.scope():
        model = build(name, vocab, seq)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rules = tfpar.auto_rules(model, mesh=mesh,
                                     vocab_parallel=vocab_parallel)
        strategy.apply_rules(model, rules)
        # keras-hub's default weighted metric: SparseCategoricalAccuracy.
        model.compile(optimizer="sgd", loss=keras.losses
                      .SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, (batch, seq)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids, bool)}
    report = tfpar.communication_report(model, x, np.roll(ids, -1, 1))
    loss = sum(int(np.prod(shape)) * dtype.size for key, (shape, dtype)
               in report.saved_activations.items()
               if LOSS_OP.search(key) and len(shape) == 2 and shape[1] > 1)
    logits = sum(c.bytes for c in report.select(phase="forward",
                                                spans="model")
                 if LOGITS_OPS.search(c.name))
    gathers = report.select(purpose="all-gather", spans="model")
    table = sum(c.bytes for c in gathers if TABLE_READ.search(c.name))
    whole = sum(c.bytes for c in gathers if c.shape[-1] == vocab)
    return (loss, logits, whole, table, report.total_bytes(spans="model"),
            report.saved_activation_bytes)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--keras-argmax", action="store_true")
    args = parser.parse_args()
    if args.keras_argmax:  # before the first strategy installs the patches
        vocab_parallel.PATCHES = ()
    print(f"data=2 x model=4, vocab {args.vocab}, batch {args.batch}, "
          f"seq {args.seq}, hidden 64, float32; bytes per device")
    print(f"{'model':6s} {'plan':14s} {'loss logits':>12s} "
          f"{'logits coll.':>13s} {'logits gath.':>13s} {'table gather':>13s} "
          f"{'model coll.':>12s} {'saved':>12s}")
    for name in ("gpt2", "llama"):
        for split in (False, True):
            row = measure(name, args.vocab, args.batch, args.seq,
                          split)
            plan = "vocab_parallel" if split else "default"
            print(f"{name:6s} {plan:14s} {row[0]:12d} {row[1]:13d} "
                  f"{row[2]:13d} {row[3]:13d} {row[4]:12d} {row[5]:12d}")


if __name__ == "__main__":
    main()
