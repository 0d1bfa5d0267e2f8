"""Pure TF + DTensor sweep: ops that take an axis, spelled negative and
non-negative, on split inputs and under consumers that split their output.

Found by tfpar's fuzzing (issue 17): DTensor 2.21 lays `ConcatV2` out
wrongly when its axis is negative and a consumer splits the joined
dimension. a (16, 8) and b (16, 64), replicated, joined along their last
dimension and multiplied by g (72,) split over a mesh axis of 4: DTensor
propagates g's split back into the concat and concatenates each device's
blocks of a and b, so device i holds [a[:, 2i:2i+2] | b[:, 16i:16i+16]]
where columns 18i..18i+17 of [a | b] belong — a wrong result, no error.
With `axis=1` (the same axis, non-negative) its Concat expander sees the
split and refuses ("Concat op SPMD with concat dimension in sharded
dimension is not supported"): its check misses the negative spelling,
which is Keras' (`Concatenate(axis=-1)`). Pinning the joined dimension
whole after the concat (a relayout) gives the right values; that is what
tfpar's steps do (`tfpar.spmd_ops.concat_whole_along_axis`).

The sweep asks the same of every op below on a 2 x 2 CPU mesh (axes x, y):
a rank-2 (8, 8) and a rank-3 (4, 8, 8) input, replicated or with one
dimension split over x, each result multiplied by a tensor of its shape
that is replicated or split over y along one dimension (the consumer whose
split DTensor propagates back into the op), every axis spelled both ways.
Each result is compared with numpy's. Prints one line per op:
"<op>: right N" or "<op>: wrong W (negative W-, non-negative W+) of N,
fails F (negative F-, non-negative F+)" (fails: DTensor refuses with an
error), the first few wrong cases and refusals. Then a last line
"silently wrong: <ops>" (or "silently wrong: none").

The first three lines printed are the first paragraph's case (the default
test of `tests/test_dtensor_concat_axis.py`); the sweep is its slow test.

Run: python tests/dtensor_concat_axis_repro.py [op ...]
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# As `import tfpar` sets: DTensor's all-to-all relayout is wrong on rank 4
# (tests/dtensor_all_to_all_repro.py); keep its error out of this sweep.
os.environ["DTENSOR_USE_ALL_TO_ALL_RELAYOUT"] = "0"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

U = dtensor.UNSHARDED


def softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def one_hot(i, axis):
    return np.moveaxis(np.eye(8, dtype="float32")[i], -1, axis)


# name: (TF op of (x, axis), numpy's, the ranks of the axis: "in" the
# input's, "out" the output's (stack, expand_dims, one_hot), input kind).
OPS = {
    "concat": (lambda x, a: tf.concat([x, 2 * x], a),
               lambda x, a: np.concatenate([x, 2 * x], a), "in", "float"),
    "stack": (lambda x, a: tf.stack([x, 2 * x], a),
              lambda x, a: np.stack([x, 2 * x], a), "out", "float"),
    "split": (lambda x, a: tf.split(x, 2, a)[1],
              lambda x, a: np.split(x, 2, a)[1], "in", "float"),
    "split_v": (lambda x, a: tf.split(x, [2, 2], a)[1] if x.shape[a] == 4
                else tf.split(x, [2, 6], a)[1],
                lambda x, a: np.split(x, [2], a)[1], "in", "float"),
    "unstack": (lambda x, a: tf.unstack(x, axis=a)[1],
                lambda x, a: np.take(x, 1, a), "in", "float"),
    "gather": (lambda x, a: tf.gather(x, [3, 0, 1, 2], axis=a),
               lambda x, a: np.take(x, [3, 0, 1, 2], a), "in", "float"),
    "reduce_sum": (lambda x, a: tf.reduce_sum(x, a),
                   lambda x, a: x.sum(a), "in", "float"),
    "reduce_mean": (lambda x, a: tf.reduce_mean(x, a),
                    lambda x, a: x.mean(a), "in", "float"),
    "reduce_max": (lambda x, a: tf.reduce_max(x, a),
                   lambda x, a: x.max(a), "in", "float"),
    "reduce_sum_keepdims": (lambda x, a: tf.reduce_sum(x, a, keepdims=True),
                            lambda x, a: x.sum(a, keepdims=True), "in",
                            "float"),
    "moments": (lambda x, a: tf.nn.moments(x, [a])[0],
                lambda x, a: x.mean(a), "in", "float"),
    "softmax": (lambda x, a: tf.nn.softmax(x, a), softmax, "in", "float"),
    "log_softmax": (lambda x, a: tf.nn.log_softmax(x, a),
                    lambda x, a: np.log(softmax(x, a)), "in", "float"),
    "l2_normalize": (lambda x, a: tf.math.l2_normalize(x, a),
                     lambda x, a: x / np.sqrt((x * x).sum(a, keepdims=True)),
                     "in", "float"),
    "cumsum": (lambda x, a: tf.cumsum(x, a),
               lambda x, a: np.cumsum(x, a), "in", "float"),
    "argmax": (lambda x, a: tf.cast(tf.argmax(x, a), tf.float32),
               lambda x, a: x.argmax(a).astype("float32"), "in", "float"),
    "reverse": (lambda x, a: tf.reverse(x, [a]),
                lambda x, a: np.flip(x, a), "in", "float"),
    "roll": (lambda x, a: tf.roll(x, 1, a),
             lambda x, a: np.roll(x, 1, a), "in", "float"),
    "repeat": (lambda x, a: tf.repeat(x, 2, a),
               lambda x, a: np.repeat(x, 2, a), "in", "float"),
    "expand_dims": (lambda x, a: tf.expand_dims(x, a),
                    lambda x, a: np.expand_dims(x, a), "out", "float"),
    "squeeze": (lambda x, a: tf.squeeze(tf.expand_dims(x, -1 if a < 0 else
                                                       x.shape.rank), a),
                lambda x, a: x, "squeeze", "float"),
    "one_hot": (lambda i, a: tf.one_hot(i, 8, axis=a), one_hot, "one_hot",
                "int"),
}


def mesh_of_four():
    return dtensor.create_mesh([("x", 2), ("y", 2)],
                               devices=[f"CPU:{i}" for i in range(4)])


def put(value, specs, mesh):
    replicated = dtensor.Layout.replicated(mesh, value.ndim)
    on_mesh = dtensor.copy_to_mesh(tf.constant(value), replicated)
    return dtensor.relayout(on_mesh, dtensor.Layout(list(specs), mesh))


def whole(value, mesh):
    replicated = dtensor.Layout.replicated(mesh, value.shape.rank)
    return dtensor.unpack(dtensor.relayout(value, replicated))[0].numpy()


def split_on(rank, dim, axis_name):
    """A spec splitting dimension `dim` (None: none) over `axis_name`."""
    return tuple(axis_name if d == dim else U for d in range(rank))


def axes(kind, rank):
    """(non-negative, negative) spellings of each axis the op takes."""
    if kind == "out":
        return [(a, a - rank - 1) for a in range(rank + 1)]
    if kind == "one_hot":
        return [(rank, -1)]  # one_hot accepts only -1 as a negative axis
    if kind == "squeeze":
        return [(rank, -1)]
    return [(a, a - rank) for a in range(rank)]


def cases(name):
    """(axis, the same axis non-negative, input value, input spec) for op
    `name`: every axis spelled both ways, the input replicated or split
    over x along one dimension."""
    _, _, kind, dtype = OPS[name]
    rng = np.random.default_rng(0)
    for shape in [(8, 8), (4, 8, 8)]:
        rank = len(shape) - (dtype == "int")
        x = (rng.integers(0, 8, size=shape[:rank]).astype("int32")
             if dtype == "int" else rng.normal(size=shape).astype("float32"))
        for positive, negative in axes(kind, rank):
            for in_dim in [None, *range(rank)]:
                if in_dim is not None and x.shape[in_dim] % 2:
                    continue
                for axis in (negative, positive):
                    yield axis, positive, x, split_on(rank, in_dim, "x")


def consumers(name, axis, positive, x, in_spec):
    """The cases of one op, axis and input: (axis, description, input, its
    spec, consumer value, consumer spec, wanted result)."""
    fn, want_fn = OPS[name][:2]
    want = want_fn(x, positive)
    g = np.random.default_rng(1).normal(size=want.shape).astype("float32")
    for out_dim in [None, *range(want.ndim)]:
        if out_dim is None or want.shape[out_dim] % 2 == 0:
            yield (axis, (x.shape, axis, in_spec, out_dim), x, in_spec, g,
                   split_on(want.ndim, out_dim, "y"), want * g)


def run(fn, group, mesh):
    """{description: "right", "wrong" or "fails: ..."} for cases of one op,
    all in one tf.function (each case's result times its consumer); when
    DTensor refuses the function, each case alone."""
    args = [put(v, spec, mesh) for case in group
            for v, spec in ((case[2], case[3]), (case[4], case[5]))]
    axes_of = [case[0] for case in group]

    def traced(*args):
        return [fn(args[2 * i], axis) * args[2 * i + 1]
                for i, axis in enumerate(axes_of)]
    try:
        got = tf.function(traced, autograph=False)(*args)
    except (tf.errors.OpError, ValueError) as error:
        if len(group) == 1:
            return {group[0][1]: "fails: " + str(error).split(
                "error: ")[-1].splitlines()[0]}
        return {k: v for case in group for k, v in run(fn, [case],
                                                       mesh).items()}
    return {case[1]: "right" if np.allclose(whole(value, mesh), case[6],
                                            atol=1e-5) else "wrong"
            for case, value in zip(group, got)}


def sweep(names):
    """{op: {(input shape, axis, input spec, consumer-split dimension):
    result}}: one tf.function per op, input rank and axis spelling."""
    mesh = mesh_of_four()
    found = {}
    for name in names:
        groups = {}
        for axis, positive, x, in_spec in cases(name):
            groups.setdefault((x.ndim, axis), []).extend(
                consumers(name, axis, positive, x, in_spec))
        found[name] = {}
        for group in groups.values():
            found[name].update(run(OPS[name][0], group, mesh))
    return found


def by_sign(cases):
    """"N (negative N-, non-negative N+)" of the cases (their axis: c[1])."""
    negative = sum(1 for c in cases if c[1] < 0)
    return (f"{len(cases)} (negative {negative}, non-negative "
            f"{len(cases) - negative})")


def summary(name, results):
    wrong = [c for c, r in results.items() if r == "wrong"]
    fails = [c for c, r in results.items() if r.startswith("fails")]
    if not wrong and not fails:
        return f"{name}: right {len(results)}"
    return (f"{name}: wrong {by_sign(wrong)} of {len(results)}, fails "
            f"{by_sign(fails)}")


def concat_case():
    """The docstring's case on a mesh extra=4: {way: result}."""
    mesh = dtensor.create_mesh([("extra", 4)],
                               devices=[f"CPU:{i}" for i in range(4)])
    rng = np.random.default_rng(0)
    a = rng.normal(size=(16, 8)).astype("float32")
    b = rng.normal(size=(16, 64)).astype("float32")
    g = rng.normal(size=(72,)).astype("float32")
    want = np.concatenate([a, b], axis=1) * g
    whole_columns = dtensor.Layout([dtensor.MATCH, U], mesh)
    ways = {
        "concat(axis=-1) * g": lambda a, b, g: tf.concat([a, b], -1) * g,
        "concat(axis=1) * g": lambda a, b, g: tf.concat([a, b], 1) * g,
        "relayout(concat(axis=-1), whole columns) * g":
            lambda a, b, g: dtensor.relayout(
                tf.concat([a, b], -1), whole_columns) * g,
    }
    inputs = (put(a, (U, U), mesh), put(b, (U, U), mesh),
              put(g, ("extra",), mesh))
    found = {}
    for name, f in ways.items():
        try:
            got = whole(tf.function(f, autograph=False)(*inputs), mesh)
        except tf.errors.OpError as error:
            found[name] = ("fails: " +
                           str(error).split("error: ")[-1].splitlines()[0])
            continue
        found[name] = "right" if np.allclose(got, want, atol=1e-6) else "wrong"
    return found


def main():
    tf.get_logger().setLevel("ERROR")  # the sweep retraces on purpose
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
    for name, result in concat_case().items():
        print(f"{name}: {result}", flush=True)
    found = sweep(sys.argv[1:] or list(OPS))
    silent = []
    for name, results in found.items():
        print(summary(name, results), flush=True)
        wrong = [c for c, r in results.items() if r == "wrong"]
        for shape, axis, in_spec, out_dim in wrong[:3]:
            print(f"  wrong: shape {shape} axis {axis} input {in_spec} "
                  f"consumer splits dim {out_dim}")
        for message in sorted({r for r in results.values()
                               if r.startswith("fails")})[:2]:
            print(f"  {message}")
        if wrong:
            silent.append(name)
    print("silently wrong:", ", ".join(silent) or "none")


if __name__ == "__main__":
    main()
