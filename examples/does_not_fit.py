"""My model does not fit one device: let tfpar.plan choose, train, resume elsewhere.

The path the README recommends to a newcomer, on a keras-hub GPT-2 causal
LM (random weights, built from constructor arguments):

1. `tfpar.plan` under a memory limit per device that plain data
   parallelism exceeds: it chooses data × pipe × model, micro-batches,
   fsdp and recomputation, and checks that its choice compiles here;
2. `fit` the planned model, side by side with the same model on one
   device from the same weights (parity of the losses);
3. save a checkpoint, restore it on a different mesh (data × model, laid
   out by `tfpar.auto_rules`) and train on, again beside one device.

    python examples/does_not_fit.py [--memory 900000 --steps 4]
"""

import argparse
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfpar  # noqa: E402

TOLERANCE = 1e-4  # relative, float32
VOCAB, SEQ_LEN = 256, 32


def build_gpt2():
    """A 2-layer keras-hub GPT-2 causal LM (no preprocessor: token ids in)."""
    import keras_hub  # noqa: PLC0415 (keras-hub loads after the virtual devices)

    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=4, hidden_dim=64,
        intermediate_dim=128, dropout=0.0, max_sequence_length=SEQ_LEN)
    return keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)


def token_batches(samples, seed):
    """Random token ids; each token's target is the next one."""
    import numpy as np  # noqa: PLC0415

    ids = np.random.default_rng(seed).integers(
        1, VOCAB, (samples, SEQ_LEN + 1)).astype("int32")
    x = {"token_ids": ids[:, :-1], "padding_mask": np.ones_like(ids[:, :-1])}
    return x, ids[:, 1:]


def compile_lm(model):
    """Adam and the next-token loss (in the current scope)."""
    import keras  # noqa: PLC0415

    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def fit(model, x, y, batch_size):
    """Trains the compiled `model` one epoch; the loss of every step."""
    import keras  # noqa: PLC0415

    losses = []
    callback = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: losses.append(float(logs["loss"])))
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0,
              callbacks=[callback])
    return losses


def report(title, single, parallel):
    """Prints the losses side by side; the largest relative difference."""
    print(f"\n{title}\nstep  one device   parallel")
    for i, (a, b) in enumerate(zip(single, parallel)):
        print(f"{i:4d}  {a:10.5f}  {b:9.5f}")
    worst = max(abs(a - b) / abs(a) for a, b in zip(single, parallel))
    print(f"largest relative loss difference: {worst:.2e} "
          f"({'OK' if worst < TOLERANCE else 'FAILED'})")
    return worst


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--memory", type=float, default=900_000,
                        help="bytes a device may use (weights, optimizer "
                             "state, activations)")
    args = parser.parse_args()
    tfpar.use_virtual_cpus(args.devices)
    import keras  # noqa: PLC0415

    # 1. Plan: a builder, so that nothing is allocated while planning.
    plan = tfpar.plan(build_gpt2, args.batch_size, memory_per_device=args.memory,
                      sequence_length=SEQ_LEN)
    print(plan.explain(top=5))

    # 2. Train the plan beside one device, from the same initial weights.
    x, y = token_batches(args.steps * args.batch_size, seed=0)
    keras.utils.set_random_seed(0)
    reference = build_gpt2()
    initial = reference.get_weights()
    single = fit(compile_lm(reference), x, y, args.batch_size)
    with plan.strategy().scope():
        model = build_gpt2()
        model.set_weights(initial)
        planned = plan.apply(model)
        parallel = fit(compile_lm(planned), x, y, args.batch_size)
    worst = report(f"trained {plan}:", single, parallel)

    # 3. Save, restore on another mesh, train on.
    x2, y2 = token_batches(args.steps * args.batch_size, seed=1)
    single_more = fit(reference, x2, y2, args.batch_size)
    directory = tempfile.mkdtemp(prefix="tfpar-does-not-fit-")
    tfpar.save_checkpoint(planned, directory, step=1)
    mesh = tfpar.Mesh({"data": 2, "model": args.devices // 2})
    strategy = tfpar.ParallelStrategy(mesh)
    with strategy.scope():
        resumed = build_gpt2()
        strategy.apply_rules(resumed, tfpar.auto_rules(resumed, mesh=mesh))
        compile_lm(resumed)
        step = tfpar.restore_checkpoint(resumed, tfpar.latest_checkpoint(directory))
        more = fit(resumed, x2, y2, args.batch_size)
    worst = max(worst, report(f"resumed step {step} from {directory} on {mesh}:",
                              single_more, more))
    return 0 if worst < TOLERANCE else 1


if __name__ == "__main__":
    raise SystemExit(main())
