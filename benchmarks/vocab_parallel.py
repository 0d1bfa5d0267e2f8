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
  reads (DTensor alone gathers a vocab-split table whole for a lookup;
  tfpar's `vocab_parallel.lookup` reads each device's rows);
- model coll.: bytes of every collective over "model" (forward and
  backward);
- data coll.: bytes of every collective over "data" (the gradients' sums;
  a vocab-split tied table's whole gradient when its lookup gathers it);
- saved: all forward activations the backward pass keeps;
- step ms: the median of 10 timed training steps (after 2), each row's
  steps timed in turn with the other rows' (round-robin).

The row "vocab_parallel, gathered lookup" is GPT-2's vocab_parallel plan
with DTensor's own lookup of its tied table (the table gathered; tfpar's
before 2026-12-07), for comparison. `--keras-argmax` measures with Keras'
own argmax (tfpar's `vocab_parallel.PATCHES` not installed).
"""

import argparse
import os
import re
import statistics
import time
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


def measure(name, vocab, batch, seq, vocab_parallel, gathered=False):
    """(the row's byte columns, the compiled model and its batch);
    `gathered`: the token table's lookups DTensor's own (the
    `vocab_parallel.lookup` call installed by `apply_rules` unwrapped)."""
    mesh = tfpar.Mesh({"data": 2, "model": 4})
    strategy = tfpar.ParallelStrategy(mesh)
    with strategy.scope():
        model = build(name, vocab, seq)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rules = tfpar.auto_rules(model, mesh=mesh,
                                     vocab_parallel=vocab_parallel)
        strategy.apply_rules(model, rules)
        if gathered:
            table = model.backbone.token_embedding
            table.call = table.call.__wrapped__
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
            report.total_bytes(spans="data"),
            report.saved_activation_bytes), (model, x, np.roll(ids, -1, 1))


def step_times(trained, rounds=10):
    """Median seconds of one training step for each (model, x, y) of
    `trained`, timed round-robin (2 steps of each first, not timed)."""
    steps = []
    for model, x, y in trained:
        for _ in range(2):
            model.train_on_batch(x, y)
        steps.append([])
    for _ in range(rounds):
        for (model, x, y), times in zip(trained, steps):
            start = time.perf_counter()
            model.train_on_batch(x, y)
            times.append(time.perf_counter() - start)
    return [statistics.median(times) for times in steps]


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
    print(f"{'model':6s} {'plan':32s} {'loss logits':>12s} "
          f"{'logits coll.':>13s} {'logits gath.':>13s} {'table gather':>13s} "
          f"{'model coll.':>12s} {'data coll.':>11s} {'saved':>12s} "
          f"{'step ms':>8s}")
    rows, trained = [], []
    for name, split, gathered in (
            ("gpt2", False, False), ("gpt2", True, False),
            ("gpt2", True, True), ("llama", False, False),
            ("llama", True, False)):
        row, compiled = measure(name, args.vocab, args.batch, args.seq,
                                split, gathered)
        plan = ("vocab_parallel" if split else "default") + (
            ", gathered lookup" if gathered else "")
        rows.append((name, plan, row))
        trained.append(compiled)
    for (name, plan, row), step in zip(rows, step_times(trained)):
        print(f"{name:6s} {plan:32s} {row[0]:12d} {row[1]:13d} "
              f"{row[2]:13d} {row[3]:13d} {row[4]:12d} {row[5]:11d} "
              f"{row[6]:12d} {step * 1e3:8.1f}")


if __name__ == "__main__":
    main()
