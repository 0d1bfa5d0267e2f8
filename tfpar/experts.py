"""Mixture-of-experts routing and dispatch: the pure functions
`tfpar.layers.MixtureOfExperts` and the keras-hub MoE blocks share.

A mixture-of-experts block sends each token to `top_k` of `num_experts`
feed-forward networks chosen by a router and sums their outputs weighted
by the router's probabilities. Here, as in GShard, with static shapes
(DTensor needs them):

1. `route`: router logits -> probabilities (softmax or sigmoid, always in
   float32, also under mixed precision) -> the `top_k` experts of each
   token and their weights (optionally normalised to sum to 1).
2. `capacity`: each expert takes at most C tokens of a dispatch group,
   C = ceil(capacity_factor * top_k * group_tokens / num_experts), at
   most the group's tokens; capacity_factor=None is dropless (C = the
   group's tokens: no token can be dropped, and the cost is the masked
   computation's: every expert runs on every slot — a user training for
   speed sets a factor, e.g. 1.25).
3. `dispatch_plan`: GShard's dispatch and combine tensors over
   [groups, group tokens, experts, capacity]. Slots are filled in order of
   choice then token: every token's first choice before any second
   choice, tokens in sequence order. An assignment past an expert's
   capacity is dropped: its combine weight is 0, so the token gets less
   (or none) of the block's output and passes through the residual
   around the block. `dropped` counts dropped (token, expert)
   assignments.
4. `moe`: the block. tokens [groups, g, hidden] -> per-expert buffers
   [groups, experts, capacity, hidden] (dispatch einsum) -> the expert
   FFN (`expert_ffn`, or the caller's) -> combine einsum back to tokens,
   in name scopes "router", "dispatch", "expert_ffn" and "combine" (the
   compiled step's nodes, forward and backward, carry them).

**The dispatch group** (which tokens compete for capacity): `group_size`
consecutive tokens of one sequence (default: the whole sequence). It is
a property of the model, not of the mesh, so which tokens drop is the
same on one device and on every mesh.

**On a mesh with an expert axis** (`expert_axis`) the expert banks
[experts, in, out] are split over it along the experts, in one of two
placements (DTensor 2.21 maps one tensor dimension to at most one mesh
axis, so the batch cannot be split over a data and a separate expert
axis together):

* A separate expert axis (`Mesh({"data": 2, "expert": 4})`): tokens are
  split over data only, and the devices of the expert axis hold the same
  tokens (as Megatron-Core's all-gather token dispatcher after its
  gather). Each cuts the combine weights to its own experts
  (`collectives.split_along`: a slice, no communication), gathers its
  experts' slots and runs its experts only; the combine einsum's sum
  over experts is one all-reduce over the expert axis of the tokens'
  outputs [tokens, hidden]; backward, one all-reduce of their gradient
  (when the block's input needs one) and one all-gather of the combine
  weights' gradient [tokens, experts, capacity] (for the router). The
  cost: the router, the dispatch bookkeeping and every layer outside the
  MoE blocks run on the data shard's tokens on every device of the
  expert axis (x-fold repeated work, x the expert axis size): on
  data=2 x expert=4 attention and embeddings cost what they cost on
  data=2.
* The expert axis is the data axis (GShard's and DeepSpeed-MoE's
  placement: `ParallelStrategy(Mesh({"data": 8}), expert_axis="data")`,
  `dims.experts_carry_data`): each device has its own tokens and its own
  experts. It dispatches its groups locally to [groups, experts,
  capacity, hidden], the slots are exchanged over data so that each
  device holds its experts' slots of every group (`collectives.all_to_all`
  from the groups to the experts dimension), it runs its experts, the
  slots go back (the reverse move) and it combines locally: no all-reduce
  of the outputs, and the banks' gradients need no reduction over data
  (each device owns its experts; their reads are not gathered:
  `tfpar.layout.plan_specs`). Backward, the reverse of each exchange
  (the dispatch side's only when the block's input needs a gradient).
  Nothing outside the MoE blocks is repeated.

Measured (tests/test_moe_layer.py, compiled steps, float32): per MoE
block and device, the separate axis moves one all-reduce over expert of
the data shard's tokens x hidden forward; the folded placement moves two
exchanges over data forward, each, in DTensor 2.21, a gather whose
message is every group's slots, global tokens x top_k x capacity_factor
x hidden (n times what a true all-to-all sends per device: tfpar keeps
DTensor's all-to-all relayout off, wrong on rank-4 tensors). On 8
devices, 8 experts, top 2, capacity factor 1.0, 64 tokens of hidden 16:
8 KiB per exchange folded, against 2 KiB per all-reduce on data=2 x
expert=4 — while the layers outside the block cost each device 1/4 of
their FLOPs there. When to use which: the folded placement when the
layers outside the MoE blocks (attention, embeddings) are a large share
of the step or memory for their activations is short; a separate expert
axis when the expert axis is small and the exchanges' n-fold gather
would dominate (the gather grows with the data axis, the all-reduce
does not). Both split the banks and compute top_k * capacity_factor /
num_experts of the masked computation's expert FLOPs for the tokens a
device holds.

Example (one device; in a tfpar step give `expert_axis` and
`batch_axis`):

>>> x = tf.random.normal((2, 8, 16))                 # batch, seq, hidden
>>> router = tf.random.normal((16, 4))                 # hidden, experts
>>> banks = [tf.random.normal(s) for s in
...          ((4, 16, 32), (4, 16, 32), (4, 32, 16))]  # up, gate, down
>>> out = experts.moe(x, router, lambda t: experts.expert_ffn(t, *banks),
...                   num_experts=4, top_k=2, capacity_factor=1.25)
>>> out.outputs.shape, out.capacity
(TensorShape([2, 8, 16]), 5)
"""

import collections
import math

import tensorflow as tf

from tfpar import collectives
from tfpar.parallel_dims import DEFAULT_EXPERT_AXIS

ROUTERS = ("softmax", "sigmoid")

Routing = collections.namedtuple("Routing", "probabilities weights experts")
Routing.__doc__ = """The router's choice for each token: `probabilities`
[..., experts] (float32), `weights` [..., top_k] (float32, normalised if
asked) and `experts` [..., top_k] (int32) in decreasing probability."""

DispatchPlan = collections.namedtuple("DispatchPlan",
                                      "combine dispatch dropped")
DispatchPlan.__doc__ = """`combine` [groups, g, experts, capacity]
(float32): a token's weight in each slot it fills, 0 elsewhere;
`dispatch` the same shape, 1.0 where a token fills a slot; `dropped`
(int32 scalar): (token, expert) assignments past an expert's capacity."""

MoEOutput = collections.namedtuple(
    "MoEOutput", "outputs aux_loss dropped capacity routing")
MoEOutput.__doc__ = """What `moe` returns: `outputs` (the input's shape
and dtype), `aux_loss` (float32 scalar, `load_balancing_loss`),
`dropped` (int32 scalar), `capacity` (int) and the `Routing`."""


def router_probabilities(logits, router="softmax"):
    """Router probabilities [..., experts] in float32 from `logits`:
    softmax over the experts, or an independent sigmoid per expert."""
    logits = tf.cast(logits, tf.float32)
    if router == "softmax":
        return tf.nn.softmax(logits, axis=-1)
    if router == "sigmoid":
        return tf.sigmoid(logits)
    raise ValueError(f"router must be one of {ROUTERS}. Received: "
                     f"router={router!r}.")


def route(logits, top_k, router="softmax", normalize=True):
    """The `Routing` of `logits` [..., experts]: the `top_k` most probable
    experts of each token and their probabilities, divided by their sum
    when `normalize` (Mixtral, Qwen3-MoE), else the probabilities."""
    probabilities = router_probabilities(logits, router)
    # The choice carries no gradient; the weights are read back from the
    # probabilities by a one-hot product (TopKV2's own gradient, a
    # ScatterNd over flattened indices, is wrong on a batch-split DTensor:
    # "indices[255] = [511] does not index into shape [64]").
    chosen = tf.math.top_k(tf.stop_gradient(probabilities), k=top_k).indices
    weights = tf.reduce_sum(
        tf.one_hot(chosen, probabilities.shape[-1], dtype=tf.float32)
        * probabilities[..., None, :], axis=-1)
    if normalize:
        weights = weights / tf.reduce_sum(weights, axis=-1, keepdims=True)
    return Routing(probabilities, weights, chosen)


def capacity(group_tokens, num_experts, top_k, capacity_factor=None):
    """Slots per expert in one dispatch group of `group_tokens` tokens:
    ceil(capacity_factor * top_k * group_tokens / num_experts), at least
    1 and at most `group_tokens`; `group_tokens` when `capacity_factor` is
    None (dropless: an expert appears at most once among a token's
    choices, so it never gets more)."""
    if capacity_factor is None:
        return group_tokens
    slots = math.ceil(capacity_factor * top_k * group_tokens / num_experts)
    return max(1, min(group_tokens, slots))


def dispatch_plan(routing, num_experts, slots):
    """The `DispatchPlan` of `routing` (weights and experts of shape
    [groups, g, top_k]) with `slots` slots per expert and group.

    Position of assignment (token t, choice j) in expert e's buffer: the
    number of assignments to e before it in the order (choice, token) —
    a cumulative sum of one-hot choices over that order. Kept when the
    position is < `slots`.
    """
    one_hot = tf.one_hot(routing.experts, num_experts, dtype=tf.float32)
    groups, tokens, top_k = (tf.shape(one_hot)[0], one_hot.shape[1],
                             one_hot.shape[2])
    by_choice = tf.reshape(tf.transpose(one_hot, [0, 2, 1, 3]),
                           [groups, top_k * tokens, num_experts])
    before = tf.cumsum(by_choice, axis=1, exclusive=True)
    before = tf.transpose(tf.reshape(
        before, [groups, top_k, tokens, num_experts]), [0, 2, 1, 3])
    position = tf.reduce_sum(before * one_hot, axis=-1)  # [G, g, k]
    kept = tf.cast(position < slots, tf.float32)
    slot = tf.one_hot(tf.cast(position, tf.int32), slots,
                      dtype=tf.float32) * kept[..., None]  # [G, g, k, C]
    dispatch = tf.einsum("gske,gskc->gsec", one_hot, slot)
    combine = tf.einsum("gske,gskc->gsec",
                        one_hot * routing.weights[..., None], slot)
    dropped = tf.cast(tf.reduce_sum(1.0 - kept), tf.int32)
    return DispatchPlan(combine, dispatch, dropped)


def load_balancing_loss(routing, num_experts):
    """Switch Transformer's auxiliary loss, as keras-hub's Mixtral computes
    it: num_experts * sum_e f_e * P_e over all tokens, f_e the fraction of
    the (token, choice) assignments that chose expert e (before capacity
    drops), P_e the mean router probability of e. 1.0 when balanced
    (softmax router)."""
    rank = routing.probabilities.shape.rank
    chosen = tf.one_hot(routing.experts, num_experts, dtype=tf.float32)
    fraction = tf.reduce_mean(chosen, axis=list(range(rank)))
    mean_probability = tf.reduce_mean(routing.probabilities,
                                      axis=list(range(rank - 1)))
    return num_experts * tf.reduce_sum(fraction * mean_probability)


def expert_ffn(slots, up_kernel, gate_kernel, down_kernel,
               activation=tf.nn.silu):
    """Each expert's feed-forward network on its slots [groups, experts,
    capacity, hidden], kernels [experts, in, out]: down(activation(gate x)
    * up x) when `gate_kernel` is given (SwiGLU with silu), else
    down(activation(up x)). Under a mesh whose expert axis splits the
    experts, each device computes only its experts."""
    dtype = slots.dtype
    up = tf.einsum("gech,ehf->gecf", slots, tf.cast(up_kernel, dtype))
    if gate_kernel is None:
        hidden = activation(up)
    else:
        gate = tf.einsum("gech,ehf->gecf", slots,
                         tf.cast(gate_kernel, dtype))
        hidden = activation(gate) * up
    return tf.einsum("gecf,efh->gech", hidden, tf.cast(down_kernel, dtype))


def moe(inputs, router_kernel, expert_fn, num_experts, top_k,
        capacity_factor=None, group_size=None, router="softmax",
        normalize=True, expert_axis=None, batch_axis=None,
        router_bias=None, router_logits=None):
    """A mixture-of-experts block on `inputs` [batch, seq, hidden] (the
    module docstring says how it is computed and laid out).

    Args:
        inputs: the tokens; their dtype is the block's compute dtype.
        router_kernel: [hidden, experts]; logits are computed in float32.
        expert_fn: [groups, experts, capacity, hidden] -> the same shape,
            e.g. `lambda t: expert_ffn(t, up, gate, down)`.
        num_experts, top_k: experts and experts per token.
        capacity_factor: None (dropless) or a float > 0: see `capacity`.
        group_size: tokens of a dispatch group (a divisor of seq), or None:
            one group per sequence.
        router: "softmax" or "sigmoid"; normalize: see `route`.
        expert_axis: in a tfpar step, the mesh axis the expert banks are
            split over (None or absent from the mesh: nothing is split).
        batch_axis: the mesh axis the batch is split over (the data axis).
            When it is `expert_axis`, GShard's placement: slots are
            exchanged over it (module docstring).
        router_bias: None or [experts], added to the logits (GPT-OSS).
        router_logits: None, or the logits [batch * seq, experts] the
            caller's router computed (a quantized router, whose kernel is
            not a float matrix: Keras' int8 Dense), routed in float32
            instead of `inputs @ router_kernel` (then None) + `router_bias`.

    Returns:
        `MoEOutput(outputs, aux_loss, dropped, capacity, routing)`.
    """
    seq, hidden = inputs.shape[1], inputs.shape[2]
    group = seq if group_size is None else group_size
    groups = tf.reshape(inputs, [-1, group, hidden])
    slots = capacity(group, num_experts, top_k, capacity_factor)
    with tf.name_scope("router"):
        if router_logits is not None:
            logits = tf.reshape(tf.cast(router_logits, tf.float32),
                                [-1, group, num_experts])
        else:
            logits = tf.matmul(tf.cast(groups, tf.float32),
                               tf.cast(router_kernel, tf.float32))
        if router_bias is not None and router_logits is None:
            logits = logits + tf.cast(router_bias, tf.float32)
        routing = route(logits, top_k, router, normalize)
        plan = dispatch_plan(routing, num_experts, slots)
    combine, dispatch = plan.combine, tf.stop_gradient(plan.dispatch)
    folded = expert_axis is not None and expert_axis == batch_axis
    if expert_axis is not None and not folded:  # its experts' slots only
        combine = collectives.split_along(combine, 2, expert_axis, batch_axis)
        dispatch = collectives.split_along(dispatch, 2, expert_axis,
                                           batch_axis)
    dtype = inputs.dtype
    with tf.name_scope("dispatch"):
        gathered = tf.einsum("gsec,gsh->gech", tf.cast(dispatch, dtype),
                             groups)
        if folded:  # each device: every group's slots of its experts
            gathered = collectives.all_to_all(gathered, 1, 0, expert_axis)
    with tf.name_scope("expert_ffn"):
        computed = expert_fn(gathered)
    with tf.name_scope("combine"):
        if folded:  # back: each device, its groups' slots of every expert
            computed = collectives.all_to_all(computed, 0, 1, expert_axis)
        outputs = tf.einsum("gech,gsec->gsh", computed,
                            tf.cast(combine, dtype))
    return MoEOutput(tf.reshape(outputs, [-1, seq, hidden]),
                     load_balancing_loss(routing, num_experts), plan.dropped,
                     slots, routing)


def expert_axis_of(dims):
    """The expert axis name of `dims` (a `ParallelDims`, or None)."""
    return getattr(dims, "expert_axis", DEFAULT_EXPERT_AXIS)


def check_expert_axis_used(dims, specs):
    """Raises when the mesh of `dims` has an expert axis of more than one
    device and none of `specs` (the variables' layouts) splits anything
    over it: no mixture-of-experts layer and no rule for expert banks, so
    every device of that axis would repeat the same work (never when the
    expert axis is the data axis: its devices split the batch). Called by
    the strategy when a train/test/predict function is made or a step
    starts (not at compile: keras-hub tasks compile in their constructor)."""
    axis = expert_axis_of(dims)
    mesh = dims.mesh
    if getattr(dims, "experts_carry_data", False):
        return  # the axis splits the batch: nothing is repeated
    if axis not in mesh.axis_names or mesh.axis_size(axis) < 2:
        return
    if any(axis in spec for spec in specs):
        return
    raise ValueError(
        f"The mesh's expert axis {axis!r} has {mesh.axis_size(axis)} "
        "devices, but no weight is split over it: the model has no "
        "mixture-of-experts layer (tfpar.layers.MixtureOfExperts, built in "
        "the strategy's scope) and no layout rule for expert banks. "
        f"Received: mesh axes {mesh.shape}. Drop the {axis!r} axis (or "
        "give its devices to the data axis), or add MoE layers.")
