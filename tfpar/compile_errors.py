"""Errors that name the layers when DTensor cannot compile a step.

DTensor 2.21 compiles a step's SPMD program the first time it runs it. A
layout combination it has no expansion for fails there with a message that
names only a TF op and points at the user's `fit` line, e.g.
"Contracting dimension for matmul has sharding dimension batch for the left
input and model for the right input which are not equal" or "Filter for
convolution must have fully replicated layout". `explaining(function, ...)`
re-raises such an error as a `ValueError` naming the op, DTensor's reason,
the weights whose per-device blocks are the op's operands (matched by block
shape; failing that, every weight with a non-replicated layout) with their
layers, layouts and the rules that laid them out, and what to change.
DTensor's own error is its `__cause__` (Keras drops that chain from the
traceback it shows unless `keras.config.disable_traceback_filtering()`).

Example:

>>> strategy = tfpar.ParallelStrategy(
...     tfpar.Mesh({"data": 2, "model": 4}),
...     rules={r".*conv/kernel": (None, None, "model", None)})
>>> with strategy.scope():
...     model = keras.Sequential([
...         keras.Input((8, 8, 4)), keras.layers.Conv2D(8, 3, name="conv"),
...         keras.layers.Flatten(), keras.layers.Dense(2)])
...     model.compile(optimizer="sgd", loss="mse")
>>> model.fit(np.ones((8, 8, 8, 4)), np.ones((8, 2)), verbose=0)
Traceback (most recent call last):
ValueError: DTensor could not compile the train step of model 'sequential'
on Mesh({'data': 2, 'model': 4}, devices=CPU:0..CPU:7): its tf.Conv2D op
failed: Filter for convolution must have fully replicated layout.
Weights involved (their per-device blocks are the op's operands):
  layer 'sequential/conv' (Conv2D): weight 'sequential/conv/kernel' shape
  (3, 3, 4, 8), layout (None, None, 'model', None), per-device block
  (3, 3, 1, 8), by rule '.*conv/kernel'
What to change: DTensor's convolutions take only replicated filters: ...
"""

import functools
import re

import tensorflow as tf

from tfpar import _compat
from tfpar import layout as layout_lib

# DTensor's compile errors (SPMD expansion, layout propagation) say so.
_DTENSOR_ERROR = re.compile(
    r"SPMD expansion|layout propagation|tensorflow/dtensor/"
    r"|ComputeLayout(Forward|Backward) error")
_REASON = re.compile(r"error: (.*)")
_OPERATION = re.compile(r'see current operation: .*?"tf\.(\w+)"(.*)')
_NAMED_OPERATION = re.compile(r"'tf\.(\w+)' op")  # no operands named
_TENSOR = re.compile(r"tensor<((?:\d+x)*)[a-z]+\d*>")
_ADVICE = (
    ("Filter for convolution must have fully replicated layout",
     "DTensor's convolutions take only replicated filters: give the "
     "convolution kernels no rule (replicated) and split other layers."),
    ("Contracting dimension for matmul",
     "the two operands of a matmul split the dimension it sums over "
     "(contracts) over different mesh axes: split that dimension over the "
     "same axis on both sides (a row-parallel kernel after a "
     "column-parallel one), or leave it whole (None) on one side."),
    ("'tf.LookupTable",
     "a lookup table (Keras' StringLookup, IntegerLookup, "
     "TextVectorization) cannot run inside a DTensor step: apply the layer "
     "to the data before the model, in the input pipeline (`dataset.map("
     "lambda x, y: (lookup(x), y))`, as Keras advises for distributed "
     "training), and give the model the integer ids."),
    ("CopyToMeshOp must be used",
     "an op reads tensors of two meshes. DTensor 2.21 does this in a "
     "PipelineModel whose stages split weights over data and model with "
     "fsdp=True once another mesh was used earlier in the same process "
     "(tests/test_plans_train.py): train it in a fresh process, before any "
     "other strategy. Otherwise change the layout of the weights listed, "
     "e.g. replicate one of them, until the step compiles."),
    ("only supports batch parallel layouts",
     "this op runs only on tensors split over the batch: replicate the "
     "weights of the layers around it (their rules make its inputs or "
     "gradients split over another axis)."),
)
_MAX_LISTED = 12
# "All inputs to `tf_device.Cluster` must have same mesh configuration":
# DTensor lists each input's producing op and mesh on the lines after it.
_MIXED_MESHES = "must have same mesh configuration"
_INPUT_CLUSTER = re.compile(
    r'Input Cluster \d+:.*?"tf\.(\w+)".*?_mesh = "([^"]*)"', re.DOTALL)


def explaining(function, model, extended, mode):
    """`function` whose DTensor compile errors are re-raised explained."""

    def run(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except tf.errors.OpError as error:
            message = str(error.message)
            if not _DTENSOR_ERROR.search(message):
                raise
            raise ValueError(
                explain(message, model, extended, mode)) from error

    return run


def explain(message, model, extended, mode="train"):
    """The text of the error re-raised for DTensor's `message`."""
    reason = _REASON.search(message)
    reason = reason[1].strip() if reason else message.strip().splitlines()[0]
    if _MIXED_MESHES in reason:
        return _explain_mixed_meshes(message, model, extended, mode)
    operation = _OPERATION.search(message)
    named = operation or _NAMED_OPERATION.search(message)
    op = f"its tf.{named[1]} op" if named else "an op"
    operands = set()
    if operation:
        signature = operation[2].rsplit("} : (", 1)[-1].split(") ->")[0]
        operands = {tuple(int(d) for d in dims.split("x") if d)
                    for dims in _TENSOR.findall(signature)}
    owners = {id(w): layer for layer in _compat.all_layers(model)
              for w in layer.weights}
    rules = getattr(extended, "rules", None)
    split, involved = [], []
    for weight in model.weights:
        info = extended.registry.placement_of(weight)
        if info is None or info.mesh is None:
            continue
        shape = tuple(weight.shape)
        blocks = {layout_lib.shard_shape(shape, spec, info.mesh)
                  for spec in (info.spec, info.compute_spec)}
        if all(block == shape for block in blocks):
            continue  # replicated (or over axes of size 1)
        pattern = (rules.pattern_for(weight.path) if isinstance(
            rules, layout_lib.LayoutRules) else None)
        line = _describe(weight, owners.get(id(weight)), info, shape, pattern)
        split.append(line)
        if blocks & operands:
            involved.append(line)
    advice = next((text for key, text in _ADVICE if key in reason),
                  "change the layout of the weights listed (their rules in "
                  "LayoutRules or keys in the Keras LayoutMap), e.g. "
                  "replicate one of them, until the step compiles.")
    if involved:
        listed = ("Weights involved (their per-device blocks are the op's "
                  "operands):\n" + "\n".join(involved[:_MAX_LISTED]))
    elif split:
        listed = ("No weight's block is an operand of that op itself; the "
                  "weights with non-replicated layouts are:\n"
                  + "\n".join(split[:_MAX_LISTED]))
    else:
        listed = "Every weight is replicated."
    return (
        f"DTensor could not compile the {mode} step of model "
        f"{model.name!r} on {extended.mesh!r}: {op} failed: "
        f"{reason}\n{listed}\nWhat to change: {advice}")


def _explain_mixed_meshes(message, model, extended, mode):
    """The text for an op whose inputs DTensor placed on different meshes
    (sub-meshes: pipeline stages), naming each input's op and devices.
    No layout rule makes or fixes this: a value made on one mesh was read
    on another without being moved there."""
    inputs = [f"  tf.{op} on {_mesh_devices(mesh)}"
              for op, mesh in _INPUT_CLUSTER.findall(message)]
    listed = ("Its inputs come from:\n" + "\n".join(inputs[:_MAX_LISTED])
              if inputs else "DTensor named none of its inputs.")
    return (
        f"DTensor could not compile the {mode} step of model "
        f"{model.name!r} on {extended.mesh!r}: an op reads tensors placed on "
        f"different meshes (e.g. two pipeline stages' devices), which "
        f"DTensor cannot run as one op.\n{listed}\nWhat to change: no "
        "layout rule causes this: a tensor made on one mesh is read on "
        "another without being moved there. If the plan or pipeline came "
        "from tfpar (tfpar.plan, PipelineModel), this is a tfpar bug: "
        "please report it with the model; meanwhile try the plan without "
        "recomputation or another stage cut (stage_boundaries). In your "
        "own code, move the tensor with tfpar.placement.relayout(tensor, "
        "spec, mesh) first.")


def _mesh_devices(mesh):
    """"CPU:4..CPU:7 (model=4)" of DTensor's mesh string
    "|model=4|0,1,2,3|0,1,2,3|/job:.../device:CPU:4,..."."""
    fields = mesh.split("|")
    if len(fields) < 5:
        return mesh
    devices = [d.rsplit("device:", 1)[-1] for d in fields[4].split(",")]
    span = (devices[0] if len(devices) == 1
            else f"{devices[0]}..{devices[-1]}")
    return f"{span} ({fields[1]})"


def _describe(weight, layer, info, shape, pattern=None):
    owner = weight.path.rsplit("/", 1)[0]
    kind = f" ({type(layer).__name__})" if layer is not None else ""
    computed = ("" if info.compute_spec == info.spec
                else f", computed as {info.compute_spec}")
    block = layout_lib.shard_shape(shape, info.spec, info.mesh)
    rule = f", by rule {pattern!r}" if pattern is not None else ""
    return (f"  layer {owner!r}{kind}: weight {weight.path!r} shape {shape}, "
            f"layout {info.spec}{computed}, per-device block {block}{rule}")


def _error_interpolation():
    return _compat.tf_python_module("framework.error_interpolation")


# TF's error tag "{{type name}}" (its error_interpolation's _TAG_REGEX).
_NAME = r"[A-Za-z0-9_.][A-Za-z0-9_.\-/]*?"
_ERROR_TAG = re.compile(r"\{\{%s %s\}\}" % (_NAME, _NAME))


def _error_tags_read_to_the_last(original, hooks):
    """TF's `error_interpolation.parse_message`, which finds the
    "{{node ...}}" tags of an error raised from a function, read up to
    the end of the message's last tag only, the rest appended as it is.

    TF's reads with the pattern `(.*?)({{tag}})` from every position, so
    the text after the last tag costs the square of its length: a DTensor
    compile error carries the whole step's program (a million characters
    for Keras' RandomElasticTransform on data=8, with no tag), and its
    reading did not end in ten minutes — the failure looked like a hang.
    Up to the last tag each position's match ends at the next tag (linear),
    and no match ends after the last tag, so the result is TF's own."""
    @functools.wraps(original)
    def parse_message(message):
        end = max((tag.end() for tag in _ERROR_TAG.finditer(message)),
                  default=0)
        parsed, function_tags, node_tags = original(message[:end])
        return parsed + message[end:], function_tags, node_tags

    return parse_message


PATCHES = (_compat.Patch("error_tags", _error_interpolation, "parse_message",
                         _error_tags_read_to_the_last),)
