"""`tfpar.estimate`: the predicted step time and memory of exactly one
training configuration (no search), from the per-op roofline of
`roofline.py`.

The model's transformer dimensions (blocks L, width h, heads a, MLP width
f, sequence s, vocabulary V, tied logits, position embedding, dropout)
are read from its layers (`profile.py`'s inspection), so a builder of a
model far larger than this host is read without allocating a weight.

>>> gpt = lambda: build_gpt(vocab=51200, seq_len=2048, dim=2304, heads=24,
...                         layers=24)
>>> e = tfpar.estimate(gpt, 512, cluster=tfpar.Cluster.preset(
...     "a100-80gb", num_hosts=4), axes={"data": 32}, recompute="full")
>>> e.step_time_s, e.breakdown["compute"]
"""

import keras
import numpy as np

from tfpar.planner import cost as cost_lib
from tfpar.planner import hardware as hardware_lib
from tfpar.planner import head_rules
from tfpar.planner import optimizers
from tfpar.planner import profile as profile_lib
from tfpar.planner import roofline
from tfpar.planner import transformer as transformer_lib
from tfpar.planner.cluster import Cluster
from tfpar.planner.transformer import transformer_of

AXES = ("data", "pipe", "model", "expert", "context")
_RECOMPUTE = {None: None, False: None, "none": None, "selective": "selective",
              "full": "full", True: "full"}
# A described Cluster (no preset): its device_flops is taken as the rate
# GEMMs reach and its HBM streams at device_flops / 150 bytes/s (the
# A100's ridge point: 312 TFLOP/s over 2.04 TB/s ≈ 153 FLOP/byte).
_RIDGE_FLOPS_PER_BYTE = 150.0


def estimate(model, global_batch_size, *, cluster, axes,
             num_microbatches=None, schedule="1f1b", virtual_stages=1,
             sequence_parallel=False, recompute=None, fsdp=False,
             optimizer="adam", sequence_length=None, capacity_factor=None,
             expert_axis="expert", vocab_parallel=None):
    """The `Estimate` of training `model` in one given configuration.

    Args:
        model: a built Keras transformer (functional; keras-hub backbones
            and `examples/gpt.py`'s GPT included) or a zero-argument
            function building one (built without allocating a weight).
        global_batch_size: samples per step over all devices.
        cluster: a `tfpar.Cluster`; `Cluster.preset(...)` carries the
            vendor figures and efficiencies the roofline uses.
        axes: {"data": d, "pipe": p, "model": t, "expert": e,
            "context": c} (missing axes are 1); their product must be the
            cluster's device count. Their order is the mesh's (devices
            laid out row-major, as `tfpar.Mesh(axes)` does): tfpar's plans
            put data first, so a data group's members are t·p apart; with
            "pipe" before "data" (Megatron-LM's and DeepSpeed's order)
            they are t apart, more of them share a host and its network
            ports, and neighbouring stages sit t·d apart. The batch is
            split over data, expert banks over expert (its devices hold
            the same tokens: every op outside the expert FFNs runs on
            each; a model without experts refuses e > 1), the sequence
            over context (s a multiple of c).
        num_microbatches: micro-batches per step (gradient-accumulation
            steps without a pipe axis). None: micro-batches of one sample
            with a pipe axis, else one micro-batch.
        schedule: "1f1b", "gpipe" or "interleaved" (1F1B with
            `virtual_stages` chunks per device).
        virtual_stages: chunks per device of an interleaved schedule
            (pipe > 1, micro-batches a multiple of pipe, blocks a multiple
            of pipe × virtual_stages).
        sequence_parallel: Megatron-LM's sequence parallelism over model.
        recompute: None, "selective" (the attention core recomputed in the
            backward pass) or "full" (every block's forward again).
        fsdp: weights, gradients and optimizer state sharded over data
            (ZeRO-3), gathered per micro-batch.
        optimizer: its name or a Keras optimizer (slots per weight).
        sequence_length: for models that leave the sequence unknown.
        capacity_factor: tokens an expert takes from a device's tokens,
            as a multiple of their fair share k·T/E; None: dropless (every
            routed token computed; under static shapes as costly as
            computing every expert on every token).
        expert_axis: "expert" (a separate expert axis, `axes["expert"]`)
            or "data": the expert banks split over the data axis (as
            `ParallelStrategy(expert_axis="data")`: each device routes its
            own tokens, exchanged with the devices holding their experts).
        vocab_parallel: the output head split over the vocabulary
            (`auto_rules(vocab_parallel=True)`: each device computes V/t of
            the logits). None: as `tfpar.plan` lays it out — split when the
            model axis t > 1 divides the vocabulary, without sequence
            parallelism, and auto_rules splits the head (a Dense or
            EinsumDense head, keras-hub's ReversibleEmbedding and
            MaskedLMHead; not a projection onto the table written in a
            layer of the user's: `planner.head_rules`), else
            whole (an embedding head split over the hidden dimension, its
            partial logits all-reduced; a Dense head replicated), and
            costed so.
            True where that cannot be is an error; False: whole. A model
            without a vocabulary head (a classifier, a bare backbone:
            neither a reverse call of its token embedding nor a last
            kernel of V outputs, `transformer.vocab_head`) is costed
            without logits, as `tfpar.plan` costs it.

    Returns:
        A `cost.Estimate`: `step_time_s`, `memory_per_device` (first
        stage), `breakdown` ({compute, memory_bound, recompute, model,
        expert, context, pipe, data, bubble, update}: seconds adding up to
        the step), `communication_bytes_by_axis` and
        `executed_flops` (per device per step, recomputation included).

    Attention is costed with a fused kernel only when Keras' flash-attention
    flag is explicitly True (`keras.config.is_flash_attention_enabled()`;
    its default None, "when the backend can", and Keras' TensorFlow backend
    has no fused kernel), else as two batched
    matmuls and a softmax over the whole s × s scores.

    Example (a few seconds; nothing is allocated):

    ```python
    import keras_hub, tfpar

    def llama_8b():                      # Llama 3 8B's shape
        return keras_hub.models.LlamaBackbone(
            vocabulary_size=128256, num_layers=32, num_query_heads=32,
            num_key_value_heads=8, hidden_dim=4096, intermediate_dim=14336)

    cluster = tfpar.Cluster.preset("h100-sxm", num_hosts=4)   # 32 GPUs
    estimate = tfpar.estimate(
        llama_8b, 256, cluster=cluster, sequence_length=8192,
        axes={"data": 8, "model": 4}, num_microbatches=8,
        recompute="selective")
    print(f"{estimate.step_time_s:.2f} s per step", estimate.breakdown)
    ```
    """
    if not isinstance(cluster, Cluster):
        raise TypeError(
            "tfpar.estimate(cluster) needs a tfpar.Cluster, e.g. "
            f"tfpar.Cluster.preset('a100-80gb'). Received: {cluster!r}")
    batch = _positive_int("global_batch_size", global_batch_size)
    shape = _axes(axes, cluster)
    if isinstance(model, keras.Model) or not callable(model):
        built = model
    else:
        built = profile_lib.build_without_weights(model)
    profile = profile_lib.profile_model(built, sequence_length)
    transformer = transformer_of(profile)
    t = shape.get("model", 1)
    # Whether tfpar's plans split its head over the vocabulary on t (an
    # auto_rules trace, only where the vocabulary and t allow it).
    plans_split = vocab_parallel is False or t == 1 or head_rules.vocab_rules(
        profile, built, t, bool(sequence_parallel)) is not None
    cfg = configuration(
        shape, batch, num_microbatches=num_microbatches, schedule=schedule,
        virtual_stages=virtual_stages, sequence_parallel=sequence_parallel,
        recompute=recompute, fsdp=fsdp,
        slots=optimizers.optimizer_slots(optimizer),
        flash=cost_lib.flash_attention(), tf32=cost_lib.tf32(),
        layers=transformer.layers, capacity_factor=capacity_factor,
        transformer=transformer, expert_axis=expert_axis,
        vocab_parallel=vocab_parallel, plans_split_head=plans_split)
    return estimate_transformer(transformer, cfg, batch, cluster)


def estimate_transformer(transformer, cfg, global_batch_size, cluster):
    """The `Estimate` of a `roofline.Transformer` trained as `cfg` (a
    `roofline.Parallel`) on `cluster`."""
    hw = hardware_of(cluster)
    parts = roofline.step_time(transformer, cfg, hw, global_batch_size,
                               cluster)
    step = parts.pop("total")
    executed = parts.pop("executed_flops")
    comm = roofline.communication_bytes(transformer, cfg, global_batch_size)
    return cost_lib.Estimate(
        step_time_s=step,
        memory_per_device=roofline.memory(transformer, cfg,
                                          global_batch_size),
        communication_bytes_per_device=float(sum(comm.values())),
        communication_bytes_by_axis=comm, time_s=parts,
        executed_flops=executed)


def hardware_of(cluster):
    """The cluster's preset `Hardware`, or one made of its own figures:
    `device_flops` as the rate GEMMs reach (efficiency 1, no shape
    penalty), HBM at device_flops / 150 bytes/s, its links."""
    if cluster.hardware is not None:
        return cluster.hardware
    flops = cluster.device_flops
    return hardware_lib.Hardware(
        name="described", peak_flops={"bfloat16": flops, "float32": flops},
        memory=cluster.device_memory,
        hbm_bandwidth=flops / _RIDGE_FLOPS_PER_BYTE,
        intra_bandwidth=cluster.intra_host_bandwidth,
        inter_bandwidth=cluster.inter_host_bandwidth,
        intra_latency=cluster.intra_host_latency,
        inter_latency=cluster.inter_host_latency,
        devices_per_host=cluster.devices_per_host, gemm=1.0, gemm_half=0.0,
        hbm=1.0, network_intra=1.0, network_inter=1.0, flash=1.0)


def configuration(axes, batch, *, num_microbatches=None, schedule="1f1b",
                  virtual_stages=1, sequence_parallel=False, recompute=None,
                  fsdp=False, slots=2, flash=False, tf32=False,
                  layers=None, capacity_factor=None, transformer=None,
                  expert_axis="expert", vocab_parallel=None,
                  plans_split_head=True):
    """The `roofline.Parallel` of `estimate`'s arguments, checked
    (`layers`: the model's transformer blocks, when known; `transformer`:
    its `roofline.Transformer`, to check the expert and context axes and
    to lay out its head: `_head`; `plans_split_head`: False when
    `auto_rules` does not split that head, `head_rules.vocab_rules`)."""
    d, p, t, e, c = (axes.get(k, 1) for k in AXES)
    on_data = _expert_placement(expert_axis, axes)
    if on_data:
        e = d
    _check_expert_and_context(transformer, e, c, capacity_factor)
    replicas = d
    if batch % replicas:
        raise ValueError(
            f"tfpar.estimate: global_batch_size={batch} does not split over "
            f"data={replicas}; use a multiple of {replicas}.")
    if num_microbatches is None:
        num_microbatches = batch // replicas if p > 1 else 1
    m = _positive_int("num_microbatches", num_microbatches)
    if (batch // replicas) % m:
        raise ValueError(
            f"tfpar.estimate: num_microbatches={m} does not split the "
            f"{batch // replicas} samples per data replica; use a divisor "
            "of it.")
    v = _interleaving(schedule, virtual_stages, p=p, m=m, layers=layers)
    if recompute not in _RECOMPUTE:
        raise ValueError(
            "tfpar.estimate(recompute) must be None, 'selective' or 'full'. "
            f"Received: recompute={recompute!r}")
    if fsdp and d == 1:
        raise ValueError("tfpar.estimate(fsdp=True) needs a data axis > 1; "
                         f"received axes data={d}.")
    sequence_parallel = bool(sequence_parallel and t > 1)
    return roofline.Parallel(
        pipe_outermost=roofline.pipe_outermost(axes),
        data=d, pipe=p, model=t, expert=e, expert_on_data=on_data, context=c,
        capacity_factor=capacity_factor, microbatch=batch // replicas // m,
        virtual_stages=v, schedule="interleaved" if v > 1 else schedule,
        sequence_parallel=sequence_parallel,
        recompute=_RECOMPUTE[recompute], fsdp=bool(fsdp), flash=flash,
        tf32=tf32, optimizer_slots=slots,
        **_head(transformer, t, sequence_parallel, vocab_parallel,
                plans_split_head))


def _head(transformer, t, sequence_parallel, vocab_parallel,
          plans_split_head=True):
    """The `Parallel` fields of the head (`roofline.head_layout`) tfpar
    runs: split over the vocabulary where `transformer_lib.vocab_parallel`
    allows it and auto_rules splits it (`plans_split_head`; None: then;
    True: the same, or an error saying why not), else whole. Without a
    `transformer`, the defaults (vocabulary-parallel)."""
    if not (vocab_parallel is None or isinstance(vocab_parallel, bool)):
        raise ValueError(
            "tfpar.estimate(vocab_parallel) must be None, True or False. "
            f"Received: vocab_parallel={vocab_parallel!r}")
    if transformer is None:
        return {}
    if vocab_parallel and not transformer.lm_head:
        raise ValueError(
            "tfpar.estimate(vocab_parallel=True) splits the logits over the "
            "vocabulary, and this model has no vocabulary head (its token "
            "embedding is not called again as the logits' projection and "
            "its last kernel does not make "
            f"{transformer.vocab} outputs: a classifier or a bare "
            "backbone), so it is costed without logits. Received: "
            "vocab_parallel=True. Pass vocab_parallel=None.")
    allowed = transformer_lib.vocab_parallel(transformer, t,
                                             sequence_parallel)
    if vocab_parallel and t > 1 and allowed and not plans_split_head:
        raise ValueError(
            "tfpar.estimate(vocab_parallel=True) splits the head over the "
            "vocabulary as tfpar.auto_rules(vocab_parallel=True) lays it "
            "out, and auto_rules does not split this model's head (it "
            "splits Dense and EinsumDense heads and keras-hub's "
            "ReversibleEmbedding and MaskedLMHead; a projection onto the "
            "table written in a layer of the user's stays whole). "
            "Received: vocab_parallel=True. Pass "
            "vocab_parallel=None (the head costed whole, as tfpar runs it).")
    allowed = allowed and plans_split_head
    if vocab_parallel and t > 1 and not allowed:
        raise ValueError(
            "tfpar.estimate(vocab_parallel=True) splits the head over the "
            f"vocabulary of {transformer.vocab} on a model axis of {t}: "
            "the axis must divide it and sequence_parallel must be False. "
            f"Received: axes model={t}, sequence_parallel="
            f"{sequence_parallel}. Pad the vocabulary, or pass "
            "vocab_parallel=None.")
    split = allowed if vocab_parallel is None else vocab_parallel and t > 1
    return roofline.head_layout(transformer, t, split)


def _interleaving(schedule, virtual_stages, *, p, m, layers):
    """The virtual stages v of `schedule`, checked as `tfpar.plan` builds
    an interleaved schedule: v · p chunks of whole blocks, micro-batches
    in groups of p, a pipe axis to interleave over."""
    if schedule not in roofline.SCHEDULES:
        raise ValueError(
            f"tfpar.estimate(schedule) must be one of {roofline.SCHEDULES}. "
            f"Received: schedule={schedule!r}")
    v = _positive_int("virtual_stages", virtual_stages)
    if v > 1 and schedule == "gpipe":
        raise ValueError(
            "tfpar.estimate: virtual_stages > 1 is an interleaved 1F1B "
            f"schedule; received schedule='gpipe', virtual_stages={v}.")
    if schedule == "interleaved" and v == 1:
        raise ValueError(
            "tfpar.estimate(schedule='interleaved') needs virtual_stages >= "
            "2 (chunks per device); received virtual_stages=1. Pass e.g. "
            "virtual_stages=2, or schedule='1f1b'.")
    if v == 1:
        return v
    if p == 1:
        raise ValueError(
            f"tfpar.estimate(virtual_stages={v}) interleaves pipeline "
            "stages: it needs axes with 'pipe' > 1; received pipe=1.")
    if m % p:
        raise ValueError(
            f"tfpar.estimate(virtual_stages={v}): the interleaved schedule "
            f"runs micro-batches in groups of pipe={p}; received "
            f"num_microbatches={m}. Use a multiple of {p}.")
    if layers is not None and layers % (p * v):
        raise ValueError(
            f"tfpar.estimate(virtual_stages={v}): the model's {layers} "
            f"blocks do not split into pipe × virtual_stages = {p * v} "
            "chunks; choose virtual_stages so that it divides "
            f"{layers} // {p}.")
    return v


def _expert_placement(expert_axis, axes):
    """Whether the expert banks are split over the data axis."""
    if expert_axis not in ("expert", "data"):
        raise ValueError(
            "tfpar.estimate(expert_axis) is 'expert' (a separate axis) or "
            f"'data' (the data axis splits the banks). Received: "
            f"expert_axis={expert_axis!r}")
    if expert_axis == "data" and axes.get("expert", 1) > 1:
        raise ValueError(
            "tfpar.estimate(expert_axis='data') splits the banks over the "
            f"data axis; axes has expert={axes['expert']} too. Drop one.")
    return expert_axis == "data"


def _check_expert_and_context(transformer, e, c, capacity_factor):
    """An expert axis needs experts it divides; a context axis a sequence
    it divides; a capacity factor is a positive number."""
    if capacity_factor is not None and (
            isinstance(capacity_factor, bool)
            or not isinstance(capacity_factor, (int, float))
            or capacity_factor <= 0):
        raise ValueError(
            "tfpar.estimate(capacity_factor) must be None (dropless) or a "
            f"positive number such as 1.25. Received: {capacity_factor!r}")
    if transformer is None:
        return
    if e > 1 and not transformer.experts:
        raise ValueError(
            f"tfpar.estimate: expert parallelism of {e}, but the model has "
            "no mixture-of-experts layer (a layer with num_experts and top_k) "
            "whose banks it would split. Drop the expert axis or use data.")
    if transformer.experts and transformer.experts % e:
        raise ValueError(
            f"tfpar.estimate: expert parallelism of {e} does not divide "
            f"the model's {transformer.experts} experts; use a divisor of "
            "it.")
    if transformer.seq % c:
        raise ValueError(
            f"tfpar.estimate(axes): context={c} does not divide the "
            f"sequence length {transformer.seq}; use a divisor of it.")


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
            or value < 1:
        raise ValueError(f"tfpar.estimate({name}) must be a positive "
                         f"integer. Received: {name}={value!r}")
    return int(value)


def _axes(axes, cluster):
    """{axis: size} of every axis in `AXES`, checked against the cluster."""
    if not isinstance(axes, dict):
        raise TypeError("tfpar.estimate(axes) must be a dict such as "
                        f"{{'data': 4, 'model': 8}}. Received: {axes!r}")
    unknown = sorted(set(axes) - set(AXES))
    if unknown:
        raise ValueError(
            f"tfpar.estimate(axes) has {unknown}: it knows {list(AXES)}.")
    # In the caller's order (the mesh's: `pipe_outermost`), then the rest.
    sizes = {k: _positive_int(f"axes[{k!r}]", axes.get(k, 1))
             for k in [*axes, *(k for k in AXES if k not in axes)]}
    if int(np.prod(list(sizes.values()))) != cluster.num_devices:
        raise ValueError(
            f"tfpar.estimate(axes={axes}) uses {np.prod(list(sizes.values()))}"
            f" devices; the cluster has {cluster.num_devices}. Make the "
            "product of the axes equal to it.")
    return sizes
