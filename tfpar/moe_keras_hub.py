"""keras-hub's mixture-of-experts blocks in tfpar: their masked
computation with the expert banks split, or token dispatch.

keras-hub 0.32's sparse MoE blocks (Mixtral's `MixtralSparseMoeBlock`,
Qwen-MoE's `QwenSparseMoeBlock`, Qwen3-MoE's `Qwen3SparseMoeBlock`,
GPT-OSS' `GptOssSparseMoeBlock` with its `GptOssTopKRouter`) compute every
expert on every token and mask the result with the routing weights, built
with `top_k` and `one_hot`. With the expert banks split over an "expert"
mesh axis (`tfpar.auto_rules`), DTensor 2.21 lays those out with the
experts dimension split too, and fails: `tf.OneHot` does not compile under
that layout ("SPMD expansion resulted in op output inconsistent with the
provided layout ... non-broadcastable operands", a Mixtral block on data=2
x expert=4), and TopKV2's gradient scatters by global positions into local
blocks ("indices[255] = [1019] does not index into shape [512]"). Inside a
tfpar step, while one of these blocks runs (its router and aux loss
included), this module's patches compute both by equality: `one_hot` as
`indices[..., None] == range(depth)`, `top_k`'s values as
`sum_e x[..., e] * [e == index]` (TF's top-k indices, no gradient through
them): the same values and gradients, laid out like any product. So each
device computes its own experts on every token (E/n of the banks' FLOPs
and memory) and DTensor sums the experts dimension over "expert". Outside
a step or outside these blocks, TF's own ops run.

In a tfpar step whose mesh splits experts (an expert axis of more than
one device, or `expert_axis="data"`), every one of these blocks runs
`tfpar.experts.moe` (GShard dispatch to per-expert slots, the experts on
their slots, the weighted combine; dropless) instead: automatic, because
the masked computation on a split bank computes every local expert on
every token, E/k times the FLOPs routing promises. `dispatch_experts(
model, capacity_factor=None)` sets a capacity (and dispatches on one
device too); `mask_experts(model)` keeps the masked computation.

The patches (`PATCHES`) join the strategy's group (`tfpar.patches.install`);
`dispatch_experts` installs them too (`install`), for one device. A Python
without keras-hub gets none of the block patches.

Example:

>>> strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "expert": 4}))
>>> with strategy.scope():
...     lm = keras_hub.models.MixtralCausalLM(backbone, preprocessor=None)
...     tfpar.moe_keras_hub.dispatch_experts(lm, 1.25)  # optional
...     strategy.apply_rules(lm, tfpar.auto_rules(lm))  # banks over expert
...     lm.compile(optimizer="adam", loss=loss)
>>> lm.fit(token_ids, targets)
"""

import collections
import functools
import sys
import threading

import keras
import tensorflow as tf

from tfpar import _compat
from tfpar import experts
from tfpar import parallel_dims
from tfpar import step_context

# (keras-hub module, MoE block class) whose `call` builds a one-hot mask.
MOE_BLOCKS = (
    ("keras_hub.src.models.mixtral.mixtral_decoder", "MixtralSparseMoeBlock"),
    ("keras_hub.src.models.qwen_moe.qwen_moe_decoder", "QwenSparseMoeBlock"),
    ("keras_hub.src.models.qwen3_moe.qwen3_moe_decoder",
     "Qwen3SparseMoeBlock"),
    ("keras_hub.src.models.qwen3_5_moe.qwen3_5_moe_decoder",
     "Qwen3_5MoeSparseMoeBlock"),
    ("keras_hub.src.models.gpt_oss.gpt_oss_decoder", "GptOssSparseMoeBlock"),
)

_inside = threading.local()  # depth of MoE block calls on this thread


def in_moe_block():
    """Whether one of keras-hub's MoE blocks is running on this thread."""
    return getattr(_inside, "depth", 0) > 0


def _marked_call(original, hooks):
    """The block's `call`, marked as running (`in_moe_block`) while it
    runs, so that its one-hot masks become equalities in a step; a block
    `dispatch_experts` chose runs `_dispatched_call` instead (on a static
    sequence length: a symbolic trace of unknown length runs the masked
    call, whose layers and shapes are the same)."""
    if original is None:
        return None

    @functools.wraps(original)
    def call(self, *args, **kwargs):
        _inside.depth = getattr(_inside, "depth", 0) + 1
        try:
            if _dispatches(self, args, kwargs):
                return _dispatched_call(self, *args, **kwargs)
            return original(self, *args, **kwargs)
        finally:
            _inside.depth -= 1

    return call


# -- token dispatch (tfpar.experts) instead of the masked einsums -----------

Dispatch = collections.namedtuple("Dispatch", "capacity_factor group_size")
Dispatch.__doc__ = """How a block dispatches its tokens (`dispatch_experts`);
`MASKED` (`mask_experts`): the block keeps its masked computation."""
MASKED = Dispatch("masked", None)
AUTOMATIC = Dispatch(None, None)  # dropless, one group per sequence
_DISPATCH = "_tfpar_dispatch"  # the block attribute holding its Dispatch
# The blocks whose dispatched call is written below: every block of
# MOE_BLOCKS (SwiGLU experts; GPT-OSS' biased router and clamped GLU
# experts with biases; Qwen-MoE's and Qwen3.5-MoE's gated shared expert).
DISPATCHABLE = tuple(name for _, name in MOE_BLOCKS)


def dispatch_experts(model, capacity_factor=None, group_size=None):
    """Runs the keras-hub MoE blocks of `model` (Mixtral's, Qwen-MoE's,
    Qwen3-MoE's, Qwen3.5-MoE's, GPT-OSS') with GShard token dispatch
    (`tfpar.experts.moe`) instead of their masked einsums, on one device
    and under any tfpar mesh alike.

    Under a strategy whose mesh has an expert axis (of more than one
    device, or the data axis as expert axis) the blocks dispatch dropless
    without this call; call it to set a capacity, or to dispatch on one
    device too. `mask_experts(model)` opts out.

    Dropless by default (`capacity_factor=None`): every expert gets a slot
    for every token of its dispatch group, so the results are the masked
    model's (the same sums in another order: float32 rounding), and, with
    static shapes, so is the cost. With a `capacity_factor` (e.g. 1.25)
    each expert takes at most ceil(factor * top_k * group / experts)
    tokens of each group (`group_size` consecutive tokens of a sequence,
    default the whole sequence); the assignments past that are dropped:
    they add nothing, the token keeps its residual (and, in Qwen-MoE and
    Qwen3.5-MoE, its shared expert's output). Each block keeps the count
    of its last call's dropped assignments in `tfpar_dropped`. The block
    returns what it returned (router logits; GPT-OSS: its router scores);
    the load-balancing aux loss, where the model has one, is computed by
    keras-hub's own function from the block's router logits as before;
    the routing itself runs in float32, and so do the dispatch and the
    weighted combine (the experts compute in the block's compute dtype:
    under mixed_bfloat16 the slots are bfloat16 values held in float32,
    twice the bytes of a bfloat16 exchange, for one rounding of the
    combined sum).

    >>> n = tfpar.moe_keras_hub.dispatch_experts(lm, capacity_factor=1.25)

    Args:
        model: a Keras model holding keras-hub MoE blocks.
        capacity_factor: None (dropless) or a float > 0.
        group_size: tokens of a dispatch group (a divisor of the sequence
            length), or None: one group per sequence.

    Returns:
        The number of blocks that now dispatch.
    """
    if capacity_factor is not None and (
            isinstance(capacity_factor, bool)
            or not isinstance(capacity_factor, (int, float))
            or capacity_factor <= 0):
        raise ValueError(
            "dispatch_experts(capacity_factor) must be None (dropless) or "
            f"a number > 0. Received: capacity_factor={capacity_factor!r}")
    blocks = _blocks(model, "dispatch_experts")
    for block in blocks:
        if getattr(block, "router_jitter_noise", 0):
            raise ValueError(
                f"dispatch_experts: block {block.path!r} has "
                f"router_jitter_noise={block.router_jitter_noise}, which "
                "the dispatched call does not draw. Build the model with "
                "router_jitter_noise=0.")
        setattr(block, _DISPATCH, Dispatch(capacity_factor, group_size))
    install()
    return len(blocks)


def mask_experts(model):
    """Keeps the keras-hub MoE blocks of `model` on their own masked
    computation (every expert on every token, masked by the routing
    weights) also under a mesh with an expert axis, where they would
    dispatch: the opt-out of the automatic dispatch. Their banks still
    split over the expert axis (each device computes its experts on every
    token). Returns the number of blocks.

    >>> n = tfpar.moe_keras_hub.mask_experts(lm)
    """
    blocks = _blocks(model, "mask_experts")
    for block in blocks:
        setattr(block, _DISPATCH, MASKED)
    install()
    return len(blocks)


def _blocks(model, caller):
    """The keras-hub MoE blocks of `model`, or a clear error."""
    blocks = [layer for layer in _compat.all_layers(model, include_self=False)
              if type(layer).__name__ in DISPATCHABLE]
    if not blocks:
        raise ValueError(
            f"{caller} found no keras-hub MoE block of {DISPATCHABLE} "
            f"in model {model.name!r}. Received: a {type(model).__name__}. "
            "Pass a Mixtral, Qwen-MoE, Qwen3-MoE, Qwen3.5-MoE or GPT-OSS "
            "model.")
    return blocks


def _settings(block):
    """The block's `Dispatch`: its own (`dispatch_experts`), `AUTOMATIC`
    in a tfpar step whose mesh splits experts (an expert axis of more than
    one device, or experts carried by the data axis) unless the block
    draws router jitter, else None (its masked call)."""
    own = getattr(block, _DISPATCH, None)
    if own is not None:
        return None if own == MASKED else own
    if getattr(block, "router_jitter_noise", 0) or not (
            step_context.in_spmd_step()):
        return None
    dims = parallel_dims.current()
    if dims is None or not (dims.experts_carry_data
                            or dims.expert_parallel_size > 1):
        return None
    return AUTOMATIC


def _dispatches(block, args, kwargs):
    """Whether `block`, called with `args`/`kwargs`, dispatches."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    return (_settings(block) is not None
            and None not in tuple(getattr(hidden, "shape", (None,)))[1:])


def install():
    """Installs this module's patches (once per process): what
    `dispatch_experts` does, so that a dispatching block also runs so on
    one device with no strategy. The strategy installs them with its own
    group (`tfpar.patches.install`)."""
    _compat.install_group("moe_keras_hub", PATCHES, None)


def _router_of(block):
    """The block's router Dense layer (logits = hidden @ kernel (+ bias))."""
    if hasattr(block, "router"):  # GPT-OSS' GptOssTopKRouter
        return block.router.router_dense
    if hasattr(block, "_router_gate"):  # Qwen3.5-MoE
        return block._router_gate  # noqa: SLF001
    return block._sparse_feedforward_gate_dense  # noqa: SLF001


def _dispatched_call(block, hidden_states, attention_mask=None,
                     training=None):
    """The block's (outputs, router logits or scores) by `experts.moe`:
    the router logits from the block's own router, its aux loss from
    keras-hub's function (when training and the model has one), the
    experts on their dispatched slots, the gated shared expert added."""
    settings = _settings(block)
    router = _router_of(block)
    flat = keras.ops.reshape(hidden_states, (-1, block.hidden_dim))
    logits = router(flat)
    dims = (parallel_dims.current() if step_context.in_spmd_step()
            else None)
    compute_dtype = tf.convert_to_tensor(hidden_states).dtype
    # A quantized router (Keras' int8 Dense) routes by its own logits: its
    # `kernel` is the int8 matrix, not the float one.
    quantized = getattr(router, "quantization_mode", None) is not None
    out = experts.moe(
        tf.cast(hidden_states, tf.float32),  # combined in float32
        None if quantized else tf.convert_to_tensor(router.kernel),
        _in_compute_dtype(_expert_fn(block), compute_dtype),
        block.num_experts, block.top_k,
        capacity_factor=settings.capacity_factor,
        group_size=settings.group_size,
        normalize=getattr(block, "norm_top_k_prob", True),
        expert_axis=None if dims is None else dims.expert_axis,
        batch_axis=None if dims is None else dims.data_axis,
        router_bias=(tf.convert_to_tensor(router.bias) if router.use_bias
                     else None),
        router_logits=logits if quantized else None)
    block.tfpar_dropped = out.dropped
    outputs = tf.cast(out.outputs, compute_dtype) + _shared_expert(
        block, flat, hidden_states)
    if training:  # from float32 logits (keras-hub's own fails on bf16)
        _add_aux_loss(block, tf.cast(logits, tf.float32) if quantized
                      else _float32_logits(router, flat), attention_mask)
    if hasattr(block, "router"):  # GPT-OSS returns its router scores
        return outputs, _router_scores(out.routing, block.num_experts,
                                       logits.dtype)
    return outputs, logits


def _in_compute_dtype(expert_fn, compute_dtype):
    """`expert_fn` on slots cast to the block's compute dtype (bfloat16
    under mixed_bfloat16), its outputs cast back to float32: the tokens
    are dispatched and combined in float32 (exact copies of their
    compute-dtype values), so the combine's sum over the experts -- split
    over the expert axis, an all-reduce of each device's partial sums --
    rounds once, as one device's does, not once per device (a bfloat16
    all-reduce moved GPT-OSS' weights 5.6e-2 from one device's after 2
    SGD steps on data=2 x expert=4). The identity in float32."""
    if compute_dtype == tf.float32:
        return expert_fn
    return lambda slots: tf.cast(expert_fn(tf.cast(slots, compute_dtype)),
                                 tf.float32)


def _shared_expert(block, flat, hidden_states):
    """Qwen-MoE's and Qwen3.5-MoE's shared expert, gated by the sigmoid of
    its gate: shared(x) * sigmoid(gate x), in the input's shape; 0 for the
    blocks without one."""
    for shared, gate in (("shared_expert_dense", "shared_expert_gate_dense"),
                         ("shared_expert", "_shared_expert_gate")):
        if hasattr(block, shared):
            shared, gate = getattr(block, shared), getattr(block, gate)
            break
    else:
        return tf.zeros((), hidden_states.dtype)
    gated = shared(flat) * keras.ops.sigmoid(gate(flat))
    return tf.reshape(gated, tf.shape(hidden_states))


def _float32_logits(router, flat):
    """The router's logits computed in float32 (x W (+ b)), as
    `experts.moe` routes: under mixed precision keras-hub's aux loss
    function multiplies bfloat16 probabilities by a float32 mask (a
    TypeError in keras-hub 0.32's own masked blocks)."""
    logits = tf.matmul(tf.cast(flat, tf.float32),
                       tf.cast(router.kernel, tf.float32))
    if router.use_bias:
        logits = logits + tf.cast(router.bias, tf.float32)
    return logits


def _add_aux_loss(block, logits, attention_mask):
    """keras-hub's load-balancing aux loss of the block's module, times the
    block's coefficient (GPT-OSS has none: nothing added)."""
    loss = getattr(sys.modules[type(block).__module__],
                   "compute_load_balancing_loss", None)
    if loss is None:
        return
    coefficient = getattr(block, "router_aux_loss_coef", None)
    if coefficient is None:
        coefficient = block.router_aux_loss_coefficient
    block.add_loss(coefficient * loss(
        router_logits=logits, num_experts=block.num_experts,
        top_k=block.top_k, attention_mask=attention_mask))


def _router_scores(routing, num_experts, dtype):
    """GPT-OSS' router scores [tokens, experts]: each token's weights at
    its chosen experts (sum_j weight_j * [e == expert_j]), 0 elsewhere."""
    scores = tf.reduce_sum(
        _equality_mask(routing.experts, num_experts, tf.float32)
        * routing.weights[..., None], axis=-2)
    return tf.cast(tf.reshape(scores, [-1, num_experts]), dtype)


def _expert_fn(block):
    """[groups, experts, capacity, hidden] -> the same, by the block's
    bank: Mixtral's separate gate / intermediate / output kernels, GPT-OSS'
    interleaved gate-up kernel with biases, or the Qwen MoEs' fused
    gate-up kernel (gate first) and output kernel."""
    bank = (block.expert_bank if hasattr(block, "expert_bank")
            else block.experts)
    if hasattr(bank, "gate_up_proj"):
        return functools.partial(_gpt_oss_experts, bank)
    down = tf.convert_to_tensor(bank._expert_feedforward_output_dense)  # noqa: SLF001
    if hasattr(bank, "_expert_feedforward_intermediate_dense"):
        up = tf.convert_to_tensor(
            bank._expert_feedforward_intermediate_dense)  # noqa: SLF001
        gate = tf.convert_to_tensor(bank._expert_feedforward_gate_dense)  # noqa: SLF001
        return lambda slots: experts.expert_ffn(slots, up, gate, down)
    gate_up = tf.convert_to_tensor(bank._expert_feedforward_gate_dense)  # noqa: SLF001
    # Qwen3.5-MoE computes the silu in float32 (a no-op in float32).
    silu_in_float32 = type(bank).__name__ == "Qwen3_5MoeExperts"

    def fused(slots):
        both = tf.einsum("gech,ehf->gecf", slots,
                         tf.cast(gate_up, slots.dtype))
        gate, up = tf.split(both, 2, axis=-1)
        if silu_in_float32:
            gate = tf.cast(tf.nn.silu(tf.cast(gate, tf.float32)), up.dtype)
        else:
            gate = tf.nn.silu(gate)
        return tf.einsum("gecf,efh->gech", up * gate,
                         tf.cast(down, slots.dtype))

    return fused


def _gpt_oss_experts(bank, slots):
    """GPT-OSS' experts on [groups, experts, capacity, hidden]: gate_up =
    x W_gu + b_gu, gate = gate_up[..., 0::2] clipped above at `limit`,
    up = gate_up[..., 1::2] clipped to [-limit, limit], out =
    ((up + 1) * gate * sigmoid(alpha * gate)) W_d + b_d (an empty slot
    computes the biases alone; its combine weight is 0)."""
    dtype = slots.dtype
    gate_up = tf.einsum("gech,ehf->gecf", slots,
                        tf.cast(bank.gate_up_proj, dtype))
    gate_up = gate_up + _per_expert(bank.gate_up_proj_bias, dtype)
    # The interleaved columns as [..., intermediate, 2]: reshapes, no
    # strided slice of a tensor split over the expert axis (the biases
    # indexed `b[None, :, None]` segfaulted the compiled step on data=2 x
    # expert=4 in TF 2.21).
    pairs = tf.reshape(gate_up, tf.concat(
        [tf.shape(gate_up)[:-1], [bank.intermediate_dim, 2]], 0))
    gate, up = tf.unstack(pairs, 2, axis=-1)
    gate = tf.minimum(gate, tf.cast(bank.limit, dtype))
    up = tf.clip_by_value(up, -bank.limit, bank.limit)
    glu = gate * tf.sigmoid(gate * bank.alpha)
    out = tf.einsum("gecf,efh->gech", (up + 1) * glu,
                    tf.cast(bank.down_proj, dtype))
    return out + _per_expert(bank.down_proj_bias, dtype)


def _per_expert(bias, dtype):
    """A bias [experts, features] as [1, experts, 1, features], by
    `expand_dims`: `bias[None, :, None, :]` of a bias split over the
    expert axis fails to lay out in DTensor 2.21
    (tests/dtensor_newaxis_slice_repro.py)."""
    return tf.expand_dims(tf.expand_dims(tf.cast(bias, dtype), 0), 2)


def _equality_mask(indices, depth, dtype):
    """`one_hot(indices, depth)` as `indices[..., None] == range(depth)`."""
    return tf.cast(tf.equal(indices[..., None],
                            tf.range(depth, dtype=indices.dtype)), dtype)


def _in_block_step():
    return in_moe_block() and step_context.in_spmd_step()


def _mask_by_equality(original, hooks):
    """`tf.one_hot` (Keras' TF `one_hot` calls it) computed as
    `indices[..., None] == range(depth)` inside an MoE block in a tfpar
    step, for the default on/off values and the last axis; TF's own
    elsewhere."""

    @functools.wraps(original)
    def one_hot(indices, depth, on_value=None, off_value=None, axis=None,
                dtype=None, name=None):
        if (not _in_block_step() or on_value is not None
                or off_value is not None or axis not in (None, -1)):
            return original(indices, depth, on_value=on_value,
                            off_value=off_value, axis=axis, dtype=dtype,
                            name=name)
        indices = tf.convert_to_tensor(indices)
        if not indices.dtype.is_integer:
            indices = tf.cast(indices, "int32")
        return _equality_mask(indices, int(depth), dtype or tf.float32)

    return one_hot


def _top_k_by_mask(original, hooks):
    """`tf.math.top_k` inside an MoE block in a tfpar step: the indices
    of TF's top-k (no gradient through them), the values as
    `sum_e x[..., e] * [e == index]` (exactly x at the indices: x times 1
    plus zeros), whose gradient is the mask, laid out like x. (TopKV2's
    own gradient scatters into the flattened input by global position,
    which DTensor 2.21 expands wrongly once the experts dimension is laid
    out split: "indices[255] = [1019] does not index into shape [512]".)
    TF's own elsewhere."""

    @functools.wraps(original)
    def top_k(input, k=1, sorted=True, index_type=tf.int32, name=None):  # noqa: A002
        if not _in_block_step():
            return original(input, k, sorted=sorted, index_type=index_type,
                            name=name)
        x = tf.convert_to_tensor(input)
        indices = original(tf.stop_gradient(x), k, sorted=sorted,
                           index_type=index_type).indices
        mask = _equality_mask(indices, x.shape[-1], x.dtype)
        return TopK(tf.reduce_sum(x[..., None, :] * mask, axis=-1), indices)

    return top_k


TopK = collections.namedtuple("TopK", "values indices")


PATCHES = (
    *(_compat.Patch(f"moe_block:{name}",
                    _compat.optional_owner(module, name), "call",
                    _marked_call) for module, name in MOE_BLOCKS),
    _compat.Patch("moe_one_hot", lambda: tf, "one_hot", _mask_by_equality),
    _compat.Patch("moe_top_k", lambda: tf.math, "top_k", _top_k_by_mask),
)
