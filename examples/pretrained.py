"""Fine-tune a pretrained model that does not fit one device.

The route of docs/guides/pretrained.md, end to end, on 8 virtual CPUs:

1. a pretrained checkpoint: here a small random keras-hub Llama3 saved as
   a keras-hub preset, or as a Hugging Face checkpoint (`--hf`: config.json
   and safetensors), standing in for a download;
2. layout rules from a builder (`tfpar.auto_rules(build)`), before any
   weight exists;
3. the model built in the strategy's scope and `deferred_init()`, every
   split weight allocated split and unwritten, then each device's block
   read from the file (`tfpar.pretrained.load_weights`);
4. LoRA fine-tuning (`backbone.enable_lora(rank)`), or full fine-tuning
   (`--rank 0`), on a data x model mesh;
5. export back to a Hugging Face checkpoint, one tensor at a time
   (`tfpar.pretrained.export_to_transformers`), and a check that the
   export, loaded back on one device, gives the fine-tuned model's
   outputs.

It prints the layout of a few weights, the per-step losses and where the
files went.

    python examples/pretrained.py [--hf] [--data 2 --model 4] [--rank 4]
"""

import argparse
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfpar  # noqa: E402

TOLERANCE = 1e-4  # relative, float32
LLAMA3 = dict(vocabulary_size=256, num_layers=2, num_query_heads=8,
              num_key_value_heads=4, hidden_dim=64, intermediate_dim=128)


def save_checkpoint(directory, hf):
    """A small random Llama3 backbone saved as a keras-hub preset or a
    Hugging Face checkpoint (what a download would give); its path and a
    zero-argument builder of the model it holds (no weights loaded)."""
    import keras  # noqa: PLC0415
    import keras_hub  # noqa: PLC0415

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.Llama3Backbone(**LLAMA3)
    if hf:
        path = os.path.join(directory, "llama3-hf")
        tfpar.pretrained.export_to_transformers(backbone, path)
        return path, lambda: tfpar.pretrained.transformers_backbone(path)
    path = os.path.join(directory, "llama3-preset")
    backbone.save_to_preset(path)
    return path, lambda: keras_hub.models.Llama3Backbone.from_preset(
        path, load_weights=False)


def token_batches(steps, batch_size, seq_len):
    """Random token ids; the target of each token is the next one."""
    import numpy as np  # noqa: PLC0415

    rng = np.random.default_rng(0)
    ids = rng.integers(1, LLAMA3["vocabulary_size"],
                       (steps * batch_size, seq_len + 1)).astype("int32")
    x = {"token_ids": ids[:, :-1], "padding_mask": np.ones_like(ids[:, :-1])}
    return x, ids[:, 1:]


def fine_tune(path, build, args):
    """Loads the checkpoint into shards, fine-tunes it; the backbone and the
    per-step losses."""
    import keras  # noqa: PLC0415
    import keras_hub  # noqa: PLC0415

    mesh = tfpar.Mesh({"data": args.data, "model": args.model})
    strategy = tfpar.ParallelStrategy(mesh,
                                      rules=tfpar.auto_rules(build, mesh=mesh))
    with strategy.scope(), tfpar.pretrained.deferred_init():
        backbone = build()
        tfpar.pretrained.load_weights(backbone, path)
    with strategy.scope():
        if args.rank:
            backbone.enable_lora(args.rank)
        model = keras_hub.models.Llama3CausalLM(backbone, preprocessor=None)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for path, spec, block in sorted(strategy.placements("params"))[:8]:
        print(f"  {path:55s} {str(spec):22s} per-device block {block}")
    x, y = token_batches(args.steps, args.batch_size, args.seq_len)
    losses = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: losses.append(
            float(logs["loss"])))
    model.fit(x, y, batch_size=args.batch_size, epochs=1, shuffle=False,
              verbose=0, callbacks=[record])
    return backbone, losses


def export_and_check(backbone, directory, args):
    """Exports the fine-tuned backbone (LoRA merged into its kernels) to a
    Hugging Face checkpoint and reads it back on one device: the largest
    relative difference of the two backbones' outputs on the same tokens."""
    import numpy as np  # noqa: PLC0415

    path = os.path.join(directory, "llama3-tuned-hf")
    tfpar.pretrained.export_to_transformers(backbone, path)
    reloaded = tfpar.pretrained.transformers_backbone(path)
    tfpar.pretrained.load_weights(reloaded, path)
    x, _ = token_batches(1, args.batch_size, args.seq_len)
    want = np.asarray(backbone(x), "float64")
    got = np.asarray(reloaded(x), "float64")
    worst = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    return path, worst


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", action="store_true",
                        help="start from a Hugging Face checkpoint instead "
                             "of a keras-hub preset")
    parser.add_argument("--data", type=int, default=2, help="data axis size")
    parser.add_argument("--model", type=int, default=4,
                        help="model axis size")
    parser.add_argument("--rank", type=int, default=4,
                        help="LoRA rank (0: full fine-tuning)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8,
                        help="global batch size")
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--dir", default=None,
                        help="where the checkpoints go (default: a "
                             "temporary directory)")
    args = parser.parse_args()

    tfpar.use_virtual_cpus(args.data * args.model)
    directory = args.dir or tempfile.mkdtemp(prefix="tfpar-pretrained-")
    path, build = save_checkpoint(directory, args.hf)
    print(f"checkpoint: {path}")
    print(f"loaded into shards on data={args.data} x model={args.model}; "
          "a few weights' layouts:")
    backbone, losses = fine_tune(path, build, args)
    mode = f"LoRA rank {args.rank}" if args.rank else "full fine-tuning"
    print(f"{mode}, losses per step: "
          + ", ".join(f"{loss:.4f}" for loss in losses))
    exported, worst = export_and_check(backbone, directory, args)
    print(f"exported to {exported}; reloaded on one device, its outputs "
          f"differ from the fine-tuned model's by {worst:.2e} (relative)")
    if worst > TOLERANCE:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
