"""Saved activations per device under recomputation: what the compiled
step keeps, next to `tfpar.plan`'s count and `tfpar.estimate`'s.

    python benchmarks/recompute_memory.py

On 8 virtual CPUs, data=2 × model=4, float32, batch 8 of 128 tokens, two
blocks of width 256 (8 heads, MLP 1024), vocabulary 512, for the same GPT
written two ways: with each block one Keras layer (keras-hub's GPT-2) and
with one Keras layer per op (examples/gpt.py), and keras-hub's Llama (a
gated MLP of width 768); without recomputation and
with full recomputation (each block recomputed whole,
`tfpar.recompute_spans`). Printed per row: the plan's candidate, its
activations by `tfpar.plan`'s count (the α-β model's, per traced layer),
by `tfpar.estimate`'s (Korthikanti et al.'s formulas; under full
recomputation what the blocks keep, `Transformer.kept_hidden` /
`kept_wide`) and measured
(`tfpar.memory_report`: the distinct forward tensors the compiled
step's backward pass reads, on the largest device).
"""

import os
import sys

import keras
import keras_hub
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
import tfpar  # noqa: E402
from gpt import build_gpt  # noqa: E402
from tfpar.planner import measure  # noqa: E402

SEQ, BATCH, VOCAB = 128, 8, 512


def blocks():
    return keras_hub.models.GPT2CausalLM(keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=8, hidden_dim=256,
        intermediate_dim=1024, max_sequence_length=SEQ, dropout=0.1),
        preprocessor=None)


def gated_blocks():
    """keras-hub's Llama (gated MLP: gate and up read one tensor) at the
    same width, depth and MLP FLOPs (three 256 × 768 kernels)."""
    return keras_hub.models.LlamaCausalLM(keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=8,
        num_key_value_heads=8, hidden_dim=256, intermediate_dim=768),
        preprocessor=None)


def ops():
    return build_gpt(vocab=VOCAB, seq_len=SEQ, dim=256, heads=8, layers=2)


def saved_activations(candidate, build, hub):
    """The compiled step's saved activations on the largest device."""
    plan = measure.candidate_plan(candidate, build, BATCH)
    model = measure.build_and_apply(plan, build)
    with plan.strategy().scope():
        model.compile(optimizer="adam",
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True))
    x = np.random.default_rng(0).integers(1, VOCAB, (BATCH, SEQ))
    x = x.astype("int32")
    inputs = ({"token_ids": x, "padding_mask": np.ones_like(x, bool)}
              if hub else x)
    report = tfpar.memory_report(model, inputs, x)
    return max(row["activations"] for row in report.values())


def main():
    print("| GPT | recompute | candidate | plan (MB) | estimate (MB) | "
          "measured (MB) |")
    print("|---|---|---|---|---|---|")
    for name, build in (("blocks (keras-hub GPT-2)", blocks),
                        ("gated blocks (keras-hub Llama)", gated_blocks),
                        ("one layer per op (examples/gpt.py)", ops)):
        plan = tfpar.plan(build, BATCH, cluster=tfpar.Cluster.local(),
                          check=False, sequence_length=SEQ)
        for recompute in (None, "full"):
            candidate = next(
                c for c in plan.candidates
                if (c.axes["data"], c.axes["pipe"], c.axes["model"]) == (
                    2, 1, 4) and c.num_microbatches == 1 and not c.fsdp
                and c.recompute == recompute and not c.sequence_parallel)
            estimate = tfpar.estimate(
                build, BATCH, cluster=tfpar.Cluster.preset("a100-80gb"),
                axes={"data": 2, "model": 4}, recompute=recompute,
                sequence_length=SEQ,
                vocab_parallel=candidate.vocab_parallel)
            measured = saved_activations(candidate, build, build is not ops)
            counts = (candidate.estimate.memory_per_device["activations"],
                      estimate.memory_per_device["activations"], measured)
            print(f"| {name} | {recompute or 'none'} | {candidate.label} | "
                  + " | ".join(f"{n / 1e6:.2f}" for n in counts) + " |",
                  flush=True)


if __name__ == "__main__":
    tfpar.use_virtual_cpus(8)
    main()
