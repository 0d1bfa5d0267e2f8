"""A keras-hub Llama trained data x model parallel with no hand-written plan.

Builds a small `keras_hub.models.LlamaCausalLM` from constructor arguments
(random weights, grouped-query attention, tied embeddings, token ids in)
and trains it twice from the same initial weights on the same token
batches: once on one device, once on a data x model mesh of 8 virtual CPU
devices. The mesh run is planned either

- by `tfpar.auto_rules` (the default): zero hand-written rules, or
- by Keras' own distribution API (`--keras-distribution`): unchanged Keras
  code, `keras.distribution.ModelParallel` with keras-hub's
  `LlamaBackbone.get_layout_map` (weights split over both mesh axes),
  which tfpar runs on TensorFlow.

It prints the per-step losses side by side, the largest relative loss and
weight differences (parity with one device) and where each weight lives.

    python examples/keras_hub_llama.py [--data 2 --model 4]
    python examples/keras_hub_llama.py --keras-distribution
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfpar  # noqa: E402

TOLERANCE = 1e-4  # relative, float32


def build_llama(args):
    import keras_hub  # noqa: PLC0415

    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=args.vocab, num_layers=args.layers,
        num_query_heads=8, num_key_value_heads=2, hidden_dim=64,
        intermediate_dim=128, tie_word_embeddings=True)
    return keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)


def token_batches(args):
    """Random token ids; the target of each token is the next one."""
    import numpy as np  # noqa: PLC0415

    rng = np.random.default_rng(0)
    ids = rng.integers(1, args.vocab, (args.steps * args.batch_size,
                                       args.seq_len + 1)).astype("int32")
    x = {"token_ids": ids[:, :-1], "padding_mask": np.ones_like(ids[:, :-1])}
    return x, ids[:, 1:]


def train(model, x, y, args):
    """Compiles `model` (in the current scope) and fits it; per-step losses."""
    import keras  # noqa: PLC0415

    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    losses = []
    callback = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: losses.append(float(logs["loss"])))
    model.fit(x, y, batch_size=args.batch_size, epochs=1, shuffle=False,
              verbose=0, callbacks=[callback])
    return losses


def with_auto_rules(initial, x, y, args):
    """tfpar.ParallelStrategy planned by tfpar.auto_rules."""
    mesh = tfpar.Mesh({"data": args.data, "model": args.model})
    strategy = tfpar.ParallelStrategy(mesh)
    with strategy.scope():
        model = build_llama(args)
        rules = tfpar.auto_rules(model, mesh=mesh)
        strategy.apply_rules(model, rules)
        model.set_weights(initial)
        print(f"auto_rules plan on {mesh}: {rules}")
        losses = train(model, x, y, args)
    return model, losses, strategy


def with_keras_distribution(initial, x, y, args):
    """Unchanged Keras code: keras.distribution.ModelParallel with
    keras-hub's own layout map; tfpar runs it on TensorFlow."""
    import keras  # noqa: PLC0415
    import keras_hub  # noqa: PLC0415

    import tfpar.keras_distribution  # noqa: F401, PLC0415 (the opt-in hook)

    device_mesh = keras.distribution.DeviceMesh(
        (args.data, args.model), ("batch", "model"),
        devices=keras.distribution.list_devices())
    layout_map = keras_hub.models.LlamaBackbone.get_layout_map(device_mesh)
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch")
    print(f"keras.distribution.ModelParallel on {device_mesh}, layout map:")
    for key, layout in layout_map.items():
        print(f"  {key:58s} {layout.axes}")
    with distribution.scope():
        model = build_llama(args)
        model.set_weights(initial)
        losses = train(model, x, y, args)
    return model, losses, tfpar.keras_distribution.strategy_for(distribution)


def relative(a, b):
    import numpy as np  # noqa: PLC0415

    a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-12))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=int, default=2, help="data axis size")
    parser.add_argument("--model", type=int, default=4,
                        help="model axis size")
    parser.add_argument("--keras-distribution", action="store_true",
                        help="plan with keras.distribution.ModelParallel and "
                             "keras-hub's get_layout_map instead of "
                             "tfpar.auto_rules")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8,
                        help="global batch size")
    parser.add_argument("--seq-len", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=64)
    args = parser.parse_args()

    tfpar.use_virtual_cpus(args.data * args.model)
    import keras  # noqa: PLC0415

    x, y = token_batches(args)
    keras.utils.set_random_seed(0)
    reference = build_llama(args)
    initial = reference.get_weights()
    print("single device ...")
    single = train(reference, x, y, args)

    run = with_keras_distribution if args.keras_distribution else with_auto_rules
    model, losses, strategy = run(initial, x, y, args)

    print("\nstep  single-device loss  tfpar loss")
    for step, (a, b) in enumerate(zip(single, losses)):
        print(f"{step:4d}  {a:18.6f}  {b:10.6f}")
    loss_gap = relative(single, losses)
    weight_gap = max(relative(a, b) for a, b in
                     zip(reference.get_weights(), model.get_weights()))
    print(f"largest relative loss difference: {loss_gap:.2e}")
    print(f"largest relative weight difference: {weight_gap:.2e}")
    ok = len(losses) == len(single) and max(loss_gap, weight_gap) < TOLERANCE
    print(f"parity with one device: {'OK' if ok else 'FAILED'}")

    print("\nwhere each weight lives (spec per dimension; None = replicated):")
    for path, spec, block in sorted(strategy.placements("params")):
        print(f"  {path:58s} {str(spec):24s} per-device block {block}")
    first = strategy.mesh.devices[0]
    print(f"\nbytes on {first}: {strategy.memory_per_device()[first]}")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
