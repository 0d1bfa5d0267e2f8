"""A small GPT-style language model trained tensor parallel with auto_rules.

Token + position embeddings, N pre-norm blocks (causal multi-head attention,
GELU MLP), a final norm and an LM head. `tfpar.auto_rules` plans the split:
attention by heads, each MLP column -> row (Megatron), embeddings along the
hidden dimension, norms and the head replicated; with --sequence-parallel
the residual stream and norms are also split along the sequence
(Megatron-SP); with --pipe > 1 it is also cut into pipeline stages (a
tfpar.PipelineModel: Megatron's 3D parallelism). The script trains it on a
data x [pipe x] model mesh of virtual CPUs and on one device from the same
weights, and prints both loss curves, the
per-device memory and the communication of the compiled training step.

    python examples/gpt.py [--data 2 --model 4 --layers 2 --sequence-parallel]
    python examples/gpt.py --data 2 --pipe 2 --model 2   # 3D: data x pipe x model
    python examples/gpt.py --fsdp --recompute    # ZeRO-3 + activation checkpointing
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

def build_gpt(vocab=64, seq_len=16, dim=64, heads=8, layers=2, name="gpt",
              recompute=False):
    """The model; call inside `strategy.scope()` to train it in parallel.
    With `recompute`, every layer of the blocks keeps only its inputs for
    the backward pass and runs again there (`keras.RematScope`)."""
    import contextlib  # noqa: PLC0415

    import keras  # noqa: PLC0415

    tokens = keras.Input((seq_len,), dtype="int32", name="tokens")
    # Position ids as an op on the symbolic input, so they are computed in
    # the training step (a constant tensor here would run eagerly now).
    positions = keras.ops.zeros_like(tokens) + keras.ops.arange(seq_len)
    h = keras.layers.Embedding(vocab, dim, name="tok_embed")(tokens)
    h = h + keras.layers.Embedding(seq_len, dim, name="pos_embed")(positions)
    for i in range(layers):
        with (keras.RematScope(mode="full") if recompute
              else contextlib.nullcontext()):
            a = keras.layers.LayerNormalization(name=f"b{i}_ln1")(h)
            a = keras.layers.MultiHeadAttention(heads, dim // heads,
                                                name=f"b{i}_attn")(
                a, a, use_causal_mask=True)
            h = h + a
            m = keras.layers.LayerNormalization(name=f"b{i}_ln2")(h)
            m = keras.layers.Dense(4 * dim, activation="gelu",
                                   name=f"b{i}_up")(m)
            m = keras.layers.Dense(dim, name=f"b{i}_down")(m)
            h = h + m
    h = keras.layers.LayerNormalization(name="ln_f")(h)
    logits = keras.layers.Dense(vocab, name="lm_head")(h)
    return keras.Model(tokens, logits, name=name)


def toy_corpus(n, vocab=64, seq_len=16, seed=0):
    """Sequences counting upward mod vocab from a random start: learnable."""
    import numpy as np  # noqa: PLC0415

    start = np.random.RandomState(seed).randint(0, vocab, size=(n, 1))
    x = (start + np.arange(seq_len + 1)[None, :]) % vocab
    return x[:, :-1].astype("int32"), x[:, 1:].astype("int32")


def compile_gpt(model):
    import keras  # noqa: PLC0415

    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


def train(strategy, weights, x, y, batch_size, epochs,
          sequence_parallel=False, num_microbatches=4, **gpt_kwargs):
    """Builds the GPT from `weights` (under `strategy` with auto_rules when
    given, sequence parallel if asked; as a `tfpar.PipelineModel` with
    `num_microbatches` when the mesh has a "pipe" axis) and trains it;
    returns (model, per-batch losses)."""
    import tfpar  # noqa: PLC0415
    import keras  # noqa: PLC0415

    class Losses(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.values = []

        def on_train_batch_end(self, batch, logs=None):
            self.values.append(float(logs["loss"]))

    if strategy is None:
        model = build_gpt(**gpt_kwargs)
        model.set_weights(weights)
        compile_gpt(model)
    else:
        with strategy.scope():
            model = build_gpt(**gpt_kwargs)
            model.set_weights(weights)
            strategy.apply_rules(model, tfpar.auto_rules(
                model, mesh=strategy.mesh, sequence_parallel=sequence_parallel))
            if strategy.num_stages > 1:
                model = tfpar.PipelineModel(model, num_microbatches)
            compile_gpt(model)
    losses = Losses()
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False,
              verbose=0, callbacks=[losses])
    return model, losses.values


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--data", type=int, default=2, help="data axis size")
    parser.add_argument("--model", type=int, default=4,
                        help="model (tensor-parallel) axis size")
    parser.add_argument("--pipe", type=int, default=1,
                        help="pipeline stages (data x pipe x model devices); "
                             "> 1 trains a tfpar.PipelineModel")
    parser.add_argument("--microbatches", type=int, default=4,
                        help="micro-batches per batch with --pipe > 1")
    parser.add_argument("--layers", type=int, default=2,
                        help="transformer blocks")
    parser.add_argument("--epochs", type=int, default=3, help="epochs")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="global batch size")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="split norms and the residual stream along the "
                             "sequence over the model axis (Megatron-SP)")
    parser.add_argument("--fsdp", action="store_true",
                        help="also split weights and Adam state over the "
                             "data axis (ZeRO-3); needs --data > 1")
    parser.add_argument("--recompute", action="store_true",
                        help="recompute the blocks' layers in the backward "
                             "pass instead of keeping their activations "
                             "(keras.RematScope); with --fsdp their weights "
                             "are gathered again there too")
    args = parser.parse_args()
    import tfpar  # noqa: PLC0415  (after argparse: --help is fast)

    tfpar.use_virtual_cpus(args.data * args.pipe * args.model)
    import keras  # noqa: PLC0415

    x, y = toy_corpus(128)
    keras.utils.set_random_seed(0)
    weights = build_gpt(layers=args.layers).get_weights()
    _, single = train(None, weights, x, y, args.batch_size, args.epochs,
                      layers=args.layers)  # the reference: no recomputation
    axes = {"data": args.data, "pipe": args.pipe, "model": args.model}
    mesh = tfpar.Mesh({k: v for k, v in axes.items() if k != "pipe" or v > 1})
    strategy = tfpar.ParallelStrategy(mesh, fsdp=args.fsdp)
    with tfpar.communication.capture() as programs:
        model, parallel = train(strategy, weights, x, y, args.batch_size,
                                args.epochs, args.sequence_parallel,
                                args.microbatches, layers=args.layers,
                                recompute=args.recompute)
    if args.pipe > 1:
        print(f"pipeline stages ({args.microbatches} micro-batches, 1F1B):")
        print(model.split_report())
    print(f"GPT on {mesh}; sharded weights (the rest is replicated):")
    for path, spec, block in strategy.placements("params"):
        if any(spec):
            print(f"  {path:32s} {str(spec):24s} block {block}")
    print("\nstep  single-device loss  tfpar loss")
    for i, (a, b) in enumerate(zip(single, parallel)):
        if i % 4 == 0 or i == len(single) - 1:
            print(f"{i:4d}  {a:18.5f}  {b:10.5f}")
    worst = max(abs(a - b) / abs(a) for a, b in zip(single, parallel))
    print(f"largest relative loss difference: {worst:.2e}")
    memory = strategy.memory_per_device()[mesh.devices[0]]
    print(f"bytes on {mesh.devices[0]}: {memory}")
    if args.pipe > 1:
        return  # the step spans several stage meshes: no per-mesh report
    report = programs.train_report()
    seq_len, dim = model.input_shape[1], model.get_layer("tok_embed").output_dim
    megatron = tfpar.communication.megatron_tp_bytes(
        args.batch_size // args.data, seq_len, dim, args.layers, args.model)
    print(f"\ncompiled training step: {report.count(spans='model')} "
          f"collectives over the model axis, {report.total_bytes(spans='model')} "
          f"bytes per step (Megatron-LM formula for these shapes: "
          f"{megatron['bytes']} + the embedding gather); activations kept "
          f"for the backward pass: {report.saved_activation_bytes} bytes per "
          "device")


if __name__ == "__main__":
    main()
