"""Runs what tests/test_quiet_logs.py reads the output of, with TF's default
logging.

`python quiet_logs_child.py MODELS` trains MODELS Dense models with
verbose=1 (each traces its own steps: before tfpar's fix, two models made
TF warn about retracing), with inference batch sizes the data axis does not
divide, then prints the user's own warnings.

`python quiet_logs_child.py hub [generate] [MEMORY_OPTIMIZATION]` plans a
keras-hub GPT-2 with `tfpar.plan` (which calibrates this machine's
devices), then trains it with `auto_rules` on a data x model mesh of 4
devices (and generates from it, with `generate`); with a
MEMORY_OPTIMIZATION (a `RewriterConfig.MemOptType` name) the user has
chosen Grappler's memory optimization in the function-call config first.
"""

import logging
import sys
import warnings

import tfpar

HUB = sys.argv[1] == "hub"
tfpar.use_virtual_cpus(4 if HUB else 8)  # fewer devices, fewer compilations

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def train_dense_models(models):
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"data": 2, "model": 4}),
        rules={r".*up/kernel": (None, "model"), r".*up/bias": ("model",),
               r".*down/kernel": ("model", None)})
    x = np.random.RandomState(0).rand(40, 16).astype("float32")
    y = x[:, :4]
    for _ in range(models):
        with strategy.scope():
            model = keras.Sequential([keras.Input((16,)),
                                      keras.layers.Dense(32, name="up"),
                                      keras.layers.Dense(4, name="down")])
            model.compile(optimizer="adam", loss="mse", metrics=["mae"])
        model.fit(x, y, batch_size=8, epochs=1, verbose=1, validation_split=0.2)
        for n in (1, 7, 33):
            model.predict(x[:n], verbose=1)
            model.evaluate(x[:n], y[:n], verbose=1)


def choose_memory_optimization(name):
    """What a user who chose Grappler's memory optimization does."""
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
    from tensorflow.python.eager import context

    options = context.context().function_call_options
    config = config_pb2.ConfigProto.FromString(options.config_proto_serialized)
    config.graph_options.rewrite_options.memory_optimization = getattr(
        rewriter_config_pb2.RewriterConfig, name)
    options.config_proto_serialized = config


def plan_and_train_hub_gpt2():
    import hub_models  # keras-hub, only for this mode

    print("PLAN", file=sys.stderr, flush=True)
    print(tfpar.plan(hub_models.build("gpt2"), 8, sequence_length=8))
    print("TRAIN", file=sys.stderr, flush=True)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 2}))
    with strategy.scope():
        model = hub_models.build("gpt2")
        strategy.apply_rules(model, tfpar.auto_rules(model))
        model.compile(optimizer="adam", loss=hub_models.loss("gpt2"))
    x, y = hub_models.data("gpt2", batch=8)
    model.fit(x, y, batch_size=8, epochs=1)
    return model


def generate(model):
    print("GENERATE", file=sys.stderr, flush=True)
    model.compile(sampler="greedy")
    prompts = {"token_ids": np.ones((4, 8), "int32"),
               "padding_mask": np.broadcast_to(np.arange(8) < 3, (4, 8))}
    print(model.generate(prompts, stop_token_ids=None)["token_ids"].shape)


if HUB:
    options = sys.argv[2:]
    for name in set(options) - {"generate"}:
        choose_memory_optimization(name)
    trained = plan_and_train_hub_gpt2()
    if "generate" in options:
        generate(trained)
else:
    train_dense_models(int(sys.argv[1]))
warnings.warn("the user's own warning")
tf.get_logger().warning("the user's own TF log warning")
logging.getLogger("user").error("the user's own error")
print("DONE")
