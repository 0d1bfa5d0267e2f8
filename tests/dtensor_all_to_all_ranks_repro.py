"""Pure TF + DTensor: which all-to-all relayouts DTensor 2.21 gets wrong, that
its switch is read once per process, and what a right all-to-all would save.

On a Mesh(data=2, expert=4) of CPUs, a tensor with dimension 0 split over
`data` (when it is not moved) has its `expert` split moved from dimension c
to dimension s, for every c != s, in a tf.function:

- "direct": `dtensor.relayout` from one layout to the other. With
  DTENSOR_USE_ALL_TO_ALL_RELAYOUT on, DTensor lowers it to one
  CollectiveAllToAllV2 (reshape, all-to-all, reshape, transpose, reshape).
- "folded": the same move made on a rank-3 view: transpose to (0, c, s,
  the rest), merge s with the rest (a split of a merged dimension along its
  leading factor is a split of that factor), move the split from view
  dimension 1 to 2, undo the reshape and the transpose (local ops).

Each result is compared with the input exactly. Printed:
- "flag read once: yes|no": the first relayout runs with the switch as
  REPRO_FIRST sets it ("1" by default), then the environment is set to the
  opposite value and a second, new relayout asks again: "yes" when it
  behaves as the first;
- "direct wrong N of M: <rank c>s, ...>" (" nobatch": dimension 0 not split
  over data) and "folded wrong N of M";
- "bytes through_whole [(op, bytes)] folded [(op, bytes)]": the collective
  over `expert` of the compiled forward move of a (4, 8, 4, 12) float32
  tensor from dimension 1 to 2 and its message, going through the layout
  where neither is split (tfpar's route: an all-gather, which DTensor runs
  on CPU as an all-reduce of zero-padded blocks) and folded.
REPRO_QUICK=1: ranks 3 and 4, pairs among dimensions 1-3 (the default
test); else ranks 2-5, every pair, with and without the data split.

TF reads the switch in a function-local static (tensorflow/dtensor/cc/
dtensor_utils.cc, EnableAllToAllForRelayout): the first relayout DTensor
expands in a process fixes it for the process. Where the wrong values
come from (read off the expanded program on a 1-D mesh of 4, shapes
(4, 8, 12[, 16]), split moved from dimension 1 to 2): DTensor's CPU/GPU
lowering rotates the block so the concatenated dimension leads, runs
CollectiveAllToAllV2 on a (4, -1) view, and rotates back. On rank 3 the
rotations are Transpose [1, 2, 0] then [2, 0, 1] (inverse: right); on
rank 4, [1, 2, 3, 0] then [2, 3, 0, 1], which is not its inverse
([3, 0, 1, 2]), so the blocks land permuted.
"""

import itertools
import os

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
FIRST = os.environ.get("REPRO_FIRST", "1")
os.environ["DTENSOR_USE_ALL_TO_ALL_RELAYOUT"] = FIRST

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402
from tensorflow.python.eager import context  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
mesh = dtensor.create_mesh([("data", 2), ("expert", 4)], device_type="CPU")
U = dtensor.UNSHARDED
QUICK = os.environ.get("REPRO_QUICK") == "1"
SHAPE = (4, 8, 4, 12, 8)  # every dimension divides over expert=4


def layout(rank, dim, batch):
    specs = [U] * rank
    if batch and dim != 0:
        specs[0] = "data"
    specs[dim] = "expert"
    return dtensor.Layout(specs, mesh)


def put(value, target):
    replicated = dtensor.Layout.replicated(mesh, value.ndim)
    return dtensor.relayout(dtensor.copy_to_mesh(tf.constant(value),
                                                 replicated), target)


def whole(value):
    replicated = dtensor.Layout.replicated(mesh, value.shape.rank)
    return dtensor.unpack(dtensor.relayout(value, replicated))[0].numpy()


def direct(t, c, s, batch):
    return dtensor.relayout(t, layout(t.shape.rank, s, batch))


def folded(t, c, s, batch):
    rank = t.shape.rank
    perm = [0, c, s] if 0 not in (c, s) else [c, s]
    perm += [d for d in range(rank) if d not in perm]
    view = tf.transpose(t, perm)
    lead = 3 if 0 not in (c, s) else 2  # (0,) c, s: s merged with the rest
    merged = tf.reshape(view, view.shape.as_list()[:lead - 1] + [-1])
    moved = dtensor.relayout(merged, layout(lead, lead - 1, batch))
    return tf.transpose(tf.reshape(moved, view.shape), np.argsort(perm))


def moved_right(route, rank, c, s, batch):
    x = np.random.RandomState(rank).normal(size=SHAPE[:rank]).astype("f4")
    fn = tf.function(lambda t: route(t, c, s, batch))
    return np.array_equal(whole(fn(put(x, layout(rank, c, batch)))), x)


def cases():
    for rank in (3, 4) if QUICK else (2, 3, 4, 5):
        for batch in (True,) if QUICK else (False, True):
            for c, s in itertools.permutations(range(rank), 2):
                if not batch or 0 not in (c, s):
                    yield rank, c, s, batch


def expert_messages(fn, *args):
    """(op, message bytes) of each collective in the expanded per-device
    program DTensor registered for `fn` (a move's: over `expert`); the
    message is the collective's output (float32)."""
    name = fn.get_concrete_function(*args).function_def.signature.name
    names = [n for n in context.context().list_function_names()
             if n.startswith(name + "__func_")]
    found, todo, seen = [], list(names), set(names)
    while todo:
        fdef = context.context().get_function_def(todo.pop())
        for node in fdef.node_def:
            for value in node.attr.values():
                if value.HasField("func") and value.func.name not in seen:
                    seen.add(value.func.name)
                    todo.append(value.func.name)
            if node.op in ("CollectiveAllToAllV2", "CollectiveReduceV2"):
                shape = node.attr["_output_shapes"].list.shape[0].dim
                size = int(np.prod([d.size for d in shape]))
                found.append((node.op, 4 * size))
    return found


def forward_bytes(route):
    x = np.zeros((4, 8, 4, 12), "f4")
    fn = tf.function(lambda t: route(t, 1, 2, True))
    placed = put(x, layout(4, 1, True))
    fn(placed)
    return expert_messages(fn, placed)


def through_whole(t, c, s, batch):
    specs = [U] * t.shape.rank
    specs[0] = "data"
    gathered = dtensor.relayout(t, dtensor.Layout(specs, mesh))
    return dtensor.relayout(gathered, layout(t.shape.rank, s, batch))


first = moved_right(direct, 4, 1, 2, True)
os.environ["DTENSOR_USE_ALL_TO_ALL_RELAYOUT"] = "0" if FIRST != "0" else "1"
second = moved_right(direct, 4, 2, 1, True)
print("flag read once:", "yes" if first == second else "no")
for route in (direct, folded):
    results = [(case, moved_right(route, *case)) for case in cases()]
    wrong = [f"r{r} {c}>{s}" + ("" if b else " nobatch")
             for (r, c, s, b), right in results if not right]
    print(f"{route.__name__} wrong {len(wrong)} of {len(results)}"
          + (": " + ", ".join(wrong) if wrong else ""))
print("bytes", *(f"{route.__name__} {forward_bytes(route)}"
                 for route in (through_whole, folded)))
