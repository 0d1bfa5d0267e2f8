"""Expert parallelism: keras-hub's masked MoE on data=8 against
`tfpar.layers.MixtureOfExperts` with dispatch on data=2 x expert=4.

Run it with

    python benchmarks/moe.py            # the sizes below, 3 rounds
    python benchmarks/moe.py --quick    # tiny sizes, 1 round (the test's)

The model, Mixtral-style and sized so the expert FFNs dominate: tokens
(batch, seq, hidden) -> LAYERS x [x + MoE(x)] -> Dense(hidden), mse. The
MoE is either keras-hub 0.32's masked Mixtral computation (`MaskedMixtral`:
its expert bank, every expert on every token, `einsum("th,ehm->etm")`)
or tfpar's layer with the
same experts, top-k and widths, in three modes: capacity_factor 1.25,
1.0, and dropless (None). Configurations, one global batch for all:

- "masked data=8": keras-hub's block, `Mesh({"data": 8})`: each device
  computes every expert on its 1/8 of the tokens, every bank whole;
- "dispatch data=2xexpert=4 cf=…": tfpar's layer, banks split over
  `expert`: each device computes its E/4 experts on their slots of its
  data shard's tokens (1/2 of them; see `tfpar.experts` for why tokens
  are split over data only).

Figures per configuration: matmul FLOPs per device of one compiled
training step (`matmul_flops`: 2 x the product of an Einsum's / MatMul's
/ BatchMatMul's index sizes, read from DTensor's per-device program;
forward and backward), its ratio to masked data=8's, expert-bank bytes per
device (`strategy.memory_per_device`'s params are all weights; the banks
are reported from their per-device blocks), and the median step time
over rounds divided by one device's step time with the same model and
batch (virtual CPU devices share the host's cores: this measures
overhead, not speed-up).
"""

import argparse
import os
import re
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

import tfpar  # noqa: E402
from tfpar import experts  # noqa: E402
from tfpar.reports import program as program_lib  # noqa: E402

import keras  # noqa: E402
from keras_hub.src.models.mixtral import mixtral_decoder  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

MATMUL_OPS = ("MatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum")
FULL = dict(batch=16, seq=64, hidden=64, intermediate=256, experts=8,
            top_k=2, layers=2, steps=4, rounds=3)
QUICK = dict(batch=16, seq=16, hidden=16, intermediate=64, experts=8,
             top_k=2, layers=1, steps=2, rounds=1)


def _input_shapes(program, key):
    shapes = []
    for ref in program.nodes[key].input:
        if ref.startswith("^"):
            continue
        hit = program.producer(key, ref)
        if hit is None:
            shapes.append(None)
            continue
        node_key, index = hit
        outputs = program_lib.output_shapes(program.nodes[node_key])
        shapes.append(outputs[index] if index < len(outputs) else None)
    return shapes


def _node_flops(program, key):
    """2 x multiply-adds of one matmul-like node (0 when a shape is
    unknown)."""
    node = program.nodes[key]
    out = program_lib.output_shapes(node)
    shapes = _input_shapes(program, key)
    if not out or out[0] is None or None in shapes[:2]:
        return 0
    if node.op == "Einsum":
        equation = node.attr["equation"].s.decode()
        inputs, _ = equation.split("->")
        sizes = {}
        for labels, shape in zip(inputs.split(","), shapes):
            sizes.update(zip(labels, shape))
        return 2 * int(np.prod(list(sizes.values()), dtype=np.int64))
    a = shapes[0]
    transposed = (node.attr["transpose_a"].b if node.op == "MatMul"
                  else node.attr["adj_x"].b)
    inner = a[-2] if transposed else a[-1]
    return 2 * int(np.prod(out[0], dtype=np.int64)) * inner


def matmul_nodes(program, name_pattern=None):
    """Keys of the Einsum / MatMul / BatchMatMul nodes of a
    `tfpar.reports.program.Program` (whose node name matches
    `name_pattern`, a regex searched, when given)."""
    return [key for key in program.order
            if program.nodes[key].op in MATMUL_OPS
            and (name_pattern is None or re.search(name_pattern, key[1]))]


def matmul_flops(program, name_pattern=None):
    """Matmul FLOPs per device: the sum of `_node_flops` over
    `matmul_nodes`. A node whose input shapes the program does not record
    counts 0 (`unknown_nodes` lists them)."""
    return sum(_node_flops(program, key)
               for key in matmul_nodes(program, name_pattern))


def unknown_nodes(program, name_pattern=None):
    """The matmul nodes counted 0 for want of shapes."""
    return [key[1] for key in matmul_nodes(program, name_pattern)
            if _node_flops(program, key) == 0]


class MaskedMixtral(keras.layers.Layer):
    """keras-hub 0.32 Mixtral's masked MoE: its expert bank
    (`MixtralMoeExperts`: every expert on every token, three
    `einsum("th,ehm->etm")`-style products) weighted by a top-k routing.
    The routing is `tfpar.experts.route` (the same probabilities and
    weights): keras-hub's own `MixtralSparseMoeBlock` cannot train on a
    batch-split mesh in TF 2.21 — the gradient of its `ops.top_k`
    (TopKV2's ScatterNd over flattened indices) fails on data=8 with
    "indices[511] = [2044] does not index into shape [256]"."""

    def __init__(self, hidden, intermediate, experts, top_k, **kwargs):
        super().__init__(**kwargs)
        self.experts, self.top_k = experts, top_k
        self.router = keras.layers.Dense(experts, use_bias=False,
                                         name="router")
        self.bank = mixtral_decoder.MixtralMoeExperts(
            experts, hidden, intermediate, name="experts")

    def build(self, input_shape):
        self.router.build(input_shape)
        self.bank.build(input_shape)

    def call(self, x):
        hidden = x.shape[-1]
        flat = keras.ops.reshape(x, (-1, hidden))
        routing = experts.route(self.router(flat), self.top_k)
        full = keras.ops.sum(keras.ops.one_hot(routing.experts, self.experts)
                             * routing.weights[..., None], axis=1)  # [t, e]
        out = keras.ops.sum(self.bank(flat) * keras.ops.transpose(
            full)[:, :, None], axis=0)
        return keras.ops.reshape(out, keras.ops.shape(x))


def build(mode, size):
    """The benchmark model: "masked" (keras-hub's block) or a capacity
    factor (float, or None: dropless) for tfpar's layer."""
    tokens = keras.Input((size["seq"], size["hidden"]))
    x = tokens
    for i in range(size["layers"]):
        if mode == "masked":
            mixed = MaskedMixtral(size["hidden"], size["intermediate"],
                                  size["experts"], size["top_k"],
                                  name=f"moe{i}")(x)
        else:
            mixed = tfpar.layers.MixtureOfExperts(
                size["experts"], size["top_k"], size["intermediate"],
                capacity_factor=mode, name=f"moe{i}")(x)
        x = keras.layers.Add()([x, mixed])
    return keras.Model(tokens, keras.layers.Dense(size["hidden"],
                                                  name="head")(x))


def data(size):
    rng = np.random.RandomState(0)
    shape = (size["batch"] * size["steps"], size["seq"], size["hidden"])
    return (rng.normal(size=shape).astype("float32"),
            rng.normal(size=shape).astype("float32"))


def step_time(model, x, y, size, rounds):
    """Median seconds per step over `rounds` fits of `steps` steps (one
    warm-up fit first)."""
    model.fit(x, y, batch_size=size["batch"], epochs=1, verbose=0,
              shuffle=False)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        model.fit(x, y, batch_size=size["batch"], epochs=1, verbose=0,
                  shuffle=False)
        times.append((time.perf_counter() - start) / size["steps"])
    return statistics.median(times)


def bank_bytes_per_device(model):
    """Bytes of the expert banks (3-D weights) one device holds."""
    total = 0
    for weight in model.weights:
        if len(weight.shape) == 3:
            block = dtensor.unpack(weight.value.read_value())[0]
            total += int(np.prod(block.shape)) * block.dtype.size
    return total


def measure(mode, axes, size, rounds):
    """{flops, bank_bytes, seconds} of `mode` on `Mesh(axes)` (None: one
    device, no strategy)."""
    x, y = data(size)
    keras.utils.set_random_seed(0)
    if axes is None:
        model = build(mode, size)
        model.compile(optimizer="adam", loss="mse")
        return dict(seconds=step_time(model, x, y, size, rounds))
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes))
    with strategy.scope():
        model = build(mode, size)
        model.compile(optimizer="adam", loss="mse")
    program = program_lib.keras_program(
        model, x[:size["batch"]], y[:size["batch"]])
    return dict(flops=matmul_flops(program),
                expert_flops=matmul_flops(program, EXPERT_NODES),
                unknown=unknown_nodes(program),
                bank_bytes=bank_bytes_per_device(model),
                seconds=step_time(model, x, y, size, rounds))


# The expert FFNs' nodes (forward and backward): tfpar's "expert_ffn" name
# scope, the masked model's "experts" bank layer.
EXPERT_NODES = r"/expert_ffn(_\d+)?/|/experts(_\d+)?/"

CONFIGS = [
    ("masked data=8", "masked", {"data": 8}),
    ("dispatch data=2xexpert=4 cf=1.25", 1.25, {"data": 2, "expert": 4}),
    ("dispatch data=2xexpert=4 cf=1.0", 1.0, {"data": 2, "expert": 4}),
    ("dispatch data=2xexpert=4 dropless", None, {"data": 2, "expert": 4}),
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    size = QUICK if args.quick else FULL
    tfpar.use_virtual_cpus(8)
    rounds = size["rounds"]
    print(f"sizes: {size}")
    results = {}
    for label, mode, axes in CONFIGS:
        one = measure(mode, None, size, rounds)["seconds"]
        got = measure(mode, axes, size, rounds)
        got["vs_one_device"] = got["seconds"] / one
        results[label] = got
    masked = results["masked data=8"]
    print(f"{'configuration':36} {'MFLOP/dev':>9} {'÷masked':>7} "
          f"{'expert MFLOP':>12} {'÷masked':>7} {'bank KiB/dev':>12} "
          f"{'step ms':>8} {'÷1 dev':>7}")
    for label, r in results.items():
        print(f"{label:36} {r['flops'] / 1e6:9.2f} "
              f"{r['flops'] / masked['flops']:7.3f} "
              f"{r['expert_flops'] / 1e6:12.2f} "
              f"{r['expert_flops'] / masked['expert_flops']:7.3f} "
              f"{r['bank_bytes'] / 1024:12.1f} "
              f"{r['seconds'] * 1e3:8.1f} {r['vs_one_device']:7.2f}")
    for label, r in results.items():
        if r["unknown"]:
            print(f"{label}: counted 0 (shapes unknown in the program): "
                  f"{r['unknown']}")
    return results


if __name__ == "__main__":
    sys.exit(main() and 0)
