"""keras-hub's mixture-of-experts blocks inside a tfpar step.

keras-hub 0.32's sparse MoE blocks (Mixtral's `MixtralSparseMoeBlock`,
Qwen-MoE's `QwenSparseMoeBlock`, Qwen3-MoE's `Qwen3SparseMoeBlock`,
GPT-OSS' `GptOssSparseMoeBlock` with its `GptOssTopKRouter`) compute every
expert on every token and mask the result with the routing weights, which
they build with `ops.one_hot(top-k expert indices, experts)`. With the
expert banks split over an "expert" mesh axis (`tfpar.auto_rules`), DTensor
2.21 lays that one-hot mask out with its experts dimension split too, and
its SPMD expansion of `tf.OneHot` under that layout fails to compile ("op
output inconsistent with the provided layout ... non-broadcastable
operands"; measured on a Mixtral block, data=2 x expert=4). Inside a tfpar
step, while one of these blocks (or the aux-loss function it calls) runs,
this module's patch computes the same mask as `indices[..., None] ==
range(experts)`: equal values (1 at each index in range, 0 elsewhere,
negative indices included), which DTensor lays out with any split. So each
device computes the tokens of its own experts (E/n of the banks' FLOPs and
memory) and DTensor sums the experts dimension over "expert". Outside a
step, and outside these blocks, Keras' `one_hot` runs unchanged.

The patches (`PATCHES`) join the strategy's group (`tfpar.patches.install`).
A Python without keras-hub gets none of the block patches.

Example (what the strategy does; nothing to call by hand):

>>> strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "expert": 4}))
>>> with strategy.scope():
...     lm = keras_hub.models.MixtralCausalLM(backbone, preprocessor=None)
...     strategy.apply_rules(lm, tfpar.auto_rules(lm))
...     lm.compile(optimizer="adam", loss=loss)
>>> lm.fit(token_ids, targets)  # the blocks' masks built by equality
"""

import functools
import importlib
import threading

import tensorflow as tf

from tfpar import _compat
from tfpar import step_context

# (keras-hub module, MoE block class) whose `call` builds a one-hot mask.
MOE_BLOCKS = (
    ("keras_hub.src.models.mixtral.mixtral_decoder", "MixtralSparseMoeBlock"),
    ("keras_hub.src.models.qwen_moe.qwen_moe_decoder", "QwenSparseMoeBlock"),
    ("keras_hub.src.models.qwen3_moe.qwen3_moe_decoder",
     "Qwen3SparseMoeBlock"),
    ("keras_hub.src.models.gpt_oss.gpt_oss_decoder", "GptOssSparseMoeBlock"),
)

_inside = threading.local()  # depth of MoE block calls on this thread


class _Absent:
    """The owner patched when keras-hub (or one of its models) is absent."""


def _block_class(module, name):
    """keras-hub's class `name` of `module`, or `_Absent`."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return _Absent


def in_moe_block():
    """Whether one of keras-hub's MoE blocks is running on this thread."""
    return getattr(_inside, "depth", 0) > 0


def _marked_call(original, hooks):
    """The block's `call`, marked as running (`in_moe_block`) while it
    runs, so that its one-hot masks become equalities in a step."""
    if original is None:
        return None

    @functools.wraps(original)
    def call(self, *args, **kwargs):
        _inside.depth = getattr(_inside, "depth", 0) + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _inside.depth -= 1

    return call


def _mask_by_equality(original, hooks):
    """Keras' TF `one_hot`, computed as `x[..., None] == range(n)` (moved
    to `axis`) inside an MoE block in a tfpar step; Keras' own elsewhere
    and for sparse outputs."""

    @functools.wraps(original)
    def one_hot(x, num_classes, axis=-1, dtype=None, sparse=False):
        if sparse or not (in_moe_block() and step_context.in_spmd_step()):
            return original(x, num_classes, axis=axis, dtype=dtype,
                            sparse=sparse)
        x = tf.convert_to_tensor(x)
        if not x.dtype.is_integer:
            x = tf.cast(x, "int32")
        hit = _equality_mask(x, num_classes, dtype or "float32")
        rank = x.shape.rank + 1
        axis = axis % rank
        if axis != rank - 1:  # the classes dimension where Keras puts it
            order = list(range(rank - 1))
            order.insert(axis, rank - 1)
            hit = tf.transpose(hit, order)
        return hit

    return one_hot


def _equality_mask(indices, depth, dtype):
    """`one_hot(indices, depth)` as `indices[..., None] == range(depth)`."""
    return tf.cast(tf.equal(indices[..., None],
                            tf.range(depth, dtype=indices.dtype)), dtype)


def _top_k_by_mask(original, hooks):
    """Keras' TF `top_k` inside an MoE block in a tfpar step: the indices
    of `tf.math.top_k` (no gradient through them), the values as
    `sum_e x[..., e] * [e == index]` (exactly x at the indices; x times 1
    plus zeros), whose gradient is the mask itself, laid out like x.
    (TopKV2's own gradient scatters into the flattened input by global
    position, which DTensor 2.21 expands wrongly when the experts
    dimension is split: "indices[255] = [1019] does not index into shape
    [512]".) Keras' own elsewhere."""

    @functools.wraps(original)
    def top_k(x, k, sorted=True):  # noqa: A002 (Keras' argument name)
        if not (in_moe_block() and step_context.in_spmd_step()):
            return original(x, k, sorted=sorted)
        x = tf.convert_to_tensor(x)
        indices = tf.math.top_k(tf.stop_gradient(x), k, sorted=sorted).indices
        mask = _equality_mask(indices, x.shape[-1], x.dtype)
        return tf.reduce_sum(x[..., None, :] * mask, axis=-1), indices

    return top_k


PATCHES = (
    *(_compat.Patch(f"moe_block:{name}",
                    functools.partial(_block_class, module, name), "call",
                    _marked_call) for module, name in MOE_BLOCKS),
    _compat.Patch("moe_one_hot",
                  lambda: _compat.keras_module("backend.tensorflow.nn"),
                  "one_hot", _mask_by_equality),
    _compat.Patch("moe_top_k",
                  lambda: _compat.keras_module("backend.tensorflow.math"),
                  "top_k", _top_k_by_mask),
)
