"""Activation checkpointing for Keras on TensorFlow: `keras.RematScope`.

Keras 3.15 rematerializes a layer on the TF backend with
`tf.recompute_grad`, which refuses keyword arguments in graph mode and draws
new Dropout masks in the recomputation. `recompute` takes its place, with
the seed replay of `next_seed` (`REMAT_PATCHES`): making a
`ParallelStrategy` installs them (`install`); without a strategy,
`tfpar.recompute.install()` is what makes `keras.RematScope` work on
TensorFlow. Where a thread is in a recomputation (the stacks of
checkpointed calls, replayed seeds and variable-read dependencies) is kept
in `tfpar.step_context`.

`set_recompute(model, mode)` chooses what a model recomputes: nothing,
each attention layer's core (`"selective"`, Korthikanti et al.) or each
transformer block whole and every other layer (`"full"`; the blocks are
`tfpar.recompute_spans`'); `tfpar.Plan.apply` sets a plan's with it.

Example (a layer recomputed in the backward pass, the same gradients):

>>> import keras, numpy as np, tensorflow as tf
>>> from tfpar.recompute import recompute
>>> layer = keras.layers.Dense(4)
>>> x = tf.constant(np.ones((2, 3), "float32"))
>>> with tf.GradientTape() as tape:
...     y = recompute(layer)(x)
>>> [g.shape for g in tape.gradient(y, layer.trainable_weights)]
[TensorShape([3, 4]), TensorShape([4])]
"""

import functools
import types

import keras
import tensorflow as tf

from tfpar import _compat
from tfpar import data_dependency
from tfpar import keras_graph
from tfpar import recompute_spans
from tfpar import step_context
from tfpar.pipeline import split
from tfpar.step_context import pushed

# Keras' per-thread attributes a layer's call reads: its `training` value
# and mixed-precision autocast. The recomputation runs with the forward's.
_KERAS_CALL_CONTEXT = ("current_call_ctx", "autocast_scope")


def next_seed(generator, original, check_replay, ordered=True):
    """`keras.random.SeedGenerator.next`, replaying inside a recomputation
    (after `check_replay(generator)`, which may refuse)."""
    frames = step_context.stack("seeds")
    if frames and frames[-1].replaying:
        if not step_context.layout_free():
            check_replay(generator)
        if not frames[-1].values:
            raise RuntimeError(
                "A recomputed layer drew more random seeds in the backward "
                "pass than in its forward pass (e.g. a random op inside "
                "keras.ops.cond/while_loop, or a branch on a Python value "
                "that changed), so its recomputation cannot reproduce the "
                f"forward pass. Received: seed generator {generator.name!r}. "
                "Leave this layer out of keras.RematScope.")
        return frames[-1].values.pop(0)
    value = original(generator, ordered)
    if frames:
        frames[-1].values.append(value)
    return value


class _Call:
    """One call of `f` split into its tensors (which get gradients) and
    everything else (kept as passed)."""

    def __init__(self, f, args, kwargs):
        self.f = f
        self.structure = (args, kwargs)
        self.leaves = tf.nest.flatten(self.structure)
        self.at = [i for i, leaf in enumerate(self.leaves) if tf.is_tensor(leaf)]

    def tensors(self):
        return [self.leaves[i] for i in self.at]

    def run(self, *tensors):
        """`f` called with `tensors` in place of the call's tensors, as a
        checkpointed call (its own checkpointed sublayers run plainly)."""
        filled = list(self.leaves)
        for i, tensor in zip(self.at, tensors):
            filled[i] = tensor
        args, kwargs = tf.nest.pack_sequence_as(self.structure, filled)
        with pushed("checkpoints", self.f):
            return self.f(*args, **kwargs)


def _scope_values():
    """([id(variable)], [value]) of the Keras `StatelessScope` the forward
    pass runs in (empty outside one): the values its variables read there,
    e.g. a pipeline stage's copy of a weight tied to an earlier stage
    (`keras_graph.reading_values`)."""
    scope = _compat.keras_global("stateless_scope")
    pairs = list(scope.state_mapping.items()) if scope is not None else []
    return [key for key, _ in pairs], [value for _, value in pairs]


def _recomputed_gradients(call, tensors, read, seeds, context, upstream,
                          variables, masks):
    """The gradients of `call` at `tensors` (its own, then the values its
    forward pass read through a StatelessScope, keyed by `read`) and
    `variables`, from running it again in the forward pass's Keras
    `context` with its `seeds`, state updates discarded. The recomputation
    reads those values through a scope of its own (the backward runs
    outside the forward's scope): a tied weight's copy gets its gradient
    as an input does. The call's own tensors it does not reach get zeros;
    values and variables it does not reach, None (no gradient)."""
    # 0 computed from the first upstream gradient (NaN if its sum is): the
    # recomputation waits for the backward pass to reach this call.
    zero = data_dependency.scalar_zero_waiting_on(upstream[0])
    again = [t + tf.cast(zero, t.dtype) if t.dtype.is_floating else t
             for t in tensors]
    # The call's tensors carry the Keras masks they had in the forward
    # pass (an Embedding(mask_zero=True)'s padding mask, which attention
    # and pooling read from their inputs).
    for tensor, mask in zip(again, masks):
        if mask is not None:
            _compat.set_keras_mask(tensor, mask)
    own = len(again) - len(read)
    variables = list(variables or ())
    with _compat.keras_globals(dict(zip(_KERAS_CALL_CONTEXT, context))), \
            tf.GradientTape() as tape:
        tape.watch([t for t in again if t.dtype.is_floating])
        tape.watch(variables)
        replay = step_context.Seeds(seeds.values, replaying=True)
        with pushed("dependencies", zero), pushed("seeds", replay), \
                keras.StatelessScope() as stateless:
            stateless.state_mapping.update(zip(read, again[own:]))
            recomputed = call.run(*again[:own])
    if replay.values:
        raise RuntimeError(
            "A recomputed layer drew fewer random seeds in the backward pass "
            "than in its forward pass, so its recomputation does not "
            "reproduce it. Leave it out of keras.RematScope.")
    # Every gradient op waits for the recomputed output, so the optimizer's
    # update of a weight waits for each read of it the recomputation made.
    # The step's automatic control edges order those reads before the
    # updates, but TF 2.21's Grappler dependency optimizer drops them (a
    # read whose value reaches only other weights' gradients, e.g. the
    # last Dense kernel and bias of a recomputed block): the update could
    # then run first and the recomputation read the new value, now and
    # then (tests/test_recompute.py). Control inputs on the gradient ops
    # themselves, not an Identity after them: a new op would be laid out on
    # the step's mesh, not a pipeline stage's.
    sources = again + variables
    with tf.control_dependencies(tf.nest.flatten(recomputed)):
        grads = tape.gradient(
            recomputed, sources, output_gradients=upstream,
            unconnected_gradients=tf.UnconnectedGradients.NONE)
    inputs = [tf.zeros_like(t) if g is None and i < own else g
              for i, (t, g) in enumerate(zip(again, grads))]
    return inputs, grads[len(again):]


def _checkpointed(call):
    """`call` run without keeping intermediate results; its gradient
    recomputes it (`_recomputed_gradients`). The values it reads through
    an enclosing StatelessScope are inputs too, so they get gradients."""
    context = [_compat.keras_global(name) for name in _KERAS_CALL_CONTEXT]
    read, values = _scope_values()
    own = len(call.at)
    masks = [_compat.keras_mask(t) for t in call.tensors()]
    made = {}

    @tf.custom_gradient
    def checkpointed(*tensors):
        # Keep no intermediate results; note the seeds drawn.
        with _compat.stop_recording(), \
                pushed("seeds", step_context.Seeds()) as seeds:
            result = call.run(*tensors[:own])
        made["masks"] = [_compat.keras_mask(t)
                         for t in tf.nest.flatten(result)]

        def grad(*upstream, variables=None):
            return _recomputed_gradients(call, tensors, read, seeds, context,
                                         upstream, variables, masks)

        return result, grad

    result = checkpointed(*call.tensors(), *values)
    # custom_gradient hands back copies: give them the outputs' masks.
    for tensor, mask in zip(tf.nest.flatten(result), made["masks"]):
        if mask is not None:
            _compat.set_keras_mask(tensor, mask)
    return result


def recompute(f):
    """`f` whose gradient recomputes `f` from its inputs instead of keeping
    its intermediate results (activation checkpointing).

    Like `tf.recompute_grad`, except that: keyword arguments are accepted
    (tensor ones get gradients); the recomputation runs in the Keras
    context of the forward pass (its `training` value and mixed-precision
    autocast) with state updates discarded (BatchNormalization's moving
    statistics, seed generators, losses: the forward pass made them) and
    the Keras random seeds of the forward pass replayed (the same Dropout
    mask); it waits for the upstream gradient through one all-reduced
    scalar, 0.0 (NaN if that gradient is NaN), where `tf.recompute_grad`
    takes the upstream gradient's first element, which DTensor turns into
    an all-gather of the whole tensor; and
    `step_context.recompute_dependency()` hands that scalar to variable
    reads, so an fsdp weight is gathered again in the backward pass instead
    of the forward gather being kept (the compiler merges identical
    reads); variables read through an enclosing `keras.StatelessScope`
    (a pipeline stage's copy of a weight tied to an earlier stage) read
    the same values in the recomputation and get their gradients. A
    checkpointed call inside another
    (a recomputed layer's sublayers) runs plainly: the outer checkpoint
    recomputes it once. Without a gradient tape (predict, evaluate) `f`
    just runs.
    """

    def call(*args, **kwargs):
        if not _compat.tape_recording() or step_context.stack("checkpoints"):
            return f(*args, **kwargs)
        layer = getattr(f, "__self__", None)  # a Layer's call (or an op's)
        if not hasattr(layer, "losses"):
            layer = None
        losses_before = len(layer.losses) if layer is not None else 0
        result = _checkpointed(_Call(f, args, kwargs))
        if layer is not None and len(layer.losses) > losses_before:
            raise ValueError(
                f"Layer {layer.name!r} adds a loss in call() (add_loss) and "
                "is recomputed (keras.RematScope): its forward pass runs "
                "without recording gradients, so that loss would get none. "
                "Leave this layer out of the RematScope (e.g. mode="
                "'list_of_layers' with the other layers' names).")
        return result

    return call


def _run_span(nodes, span, tensors, run):
    """Runs `nodes[span.start:span.stop]` as one `recompute`d call: only
    the span's inputs are kept for the backward pass, which runs the span
    again (`recompute_spans`). Refuses a span whose layers add losses."""
    layers = [node.operation for node in nodes[span.start:span.stop]]
    losses_before = [len(getattr(layer, "losses", ())) for layer in layers]

    def block(*values):
        local = {id(t): v for t, v in zip(span.inputs, values)}
        for node in nodes[span.start:span.stop]:
            run(node, local)
        return [local[id(t)] for t in span.outputs]

    values = recompute(block)(*[tensors[id(t)] for t in span.inputs])
    adding = [layer.name for layer, before in zip(layers, losses_before)
              if len(getattr(layer, "losses", ())) > before]
    if adding:
        raise ValueError(
            f"Layers {adding} add a loss in call() (add_loss) and are "
            "recomputed as one block (set_recompute(model, 'full')): the "
            "block's forward pass runs without recording gradients, so "
            "that loss would get none. Recompute with mode='selective' or "
            "None, or move the loss out of the layer.")
    tensors.update(zip([id(t) for t in span.outputs], values))


def run_graph(nodes, spans, tensors, run):
    """Runs a graph's `nodes` in order, each of `spans` (`recompute_spans.
    Span`) as one recomputed call; `run(node, tensors)` runs one node,
    adding its outputs to `tensors` (values by id(KerasTensor))."""
    by_start = {span.start: span for span in spans}
    i = 0
    while i < len(nodes):
        span = by_start.get(i)
        if span is None:
            run(nodes[i], tensors)
            i += 1
        else:
            _run_span(nodes, span, tensors, run)
            i = span.stop


class _BlockRunner:
    """What a functional model under `set_recompute(model, "full")` runs
    in place of Keras' `Functional._run_through_graph` when a training step
    records gradients: its graph with nested models inlined (the graph a
    pipeline runs, `split.model_graph`), each block of `recompute_spans`
    recomputed as one call. Anywhere else (inference, symbolic calls, a
    recomputation's forward) Keras' own runs."""

    def __init__(self, model, keras_runner):
        self.model = model
        self.nodes, _, self.inputs, self.outputs, _ = split.model_graph(model)
        self.spans = recompute_spans.block_spans(self.nodes, self.outputs)
        self.keras_runner = keras_runner

    def __call__(self, inputs, operation_fn=lambda op: op, call_fn=None):
        flat = keras.tree.flatten(inputs)
        if (call_fn is not None or not _compat.tape_recording()
                or step_context.stack("checkpoints")
                or keras_graph.has_keras_tensor(flat)):
            return self.keras_runner(inputs, operation_fn, call_fn)
        tensors = {id(k): v for k, v in zip(self.inputs, flat)}
        run_graph(self.nodes, self.spans, tensors,
                  lambda node, values: node.run(values, None, operation_fn))
        return keras_graph.model_output_structure(
            self.model, [tensors[id(t)] for t in self.outputs])


def spans_in(model, nodes, outputs):
    """The blocks of `model` recomputed whole (`recomputes_blocks`) in a
    pipeline part that runs `nodes` (`split.GraphNode`s, in order) and
    hands on `outputs`, as spans of `nodes`: a block the part holds
    whole, or the part's piece of a block a stage boundary cuts, each one
    recomputed call."""
    if not recomputes_blocks(model):
        return []
    every = _compat.graph_runner(_compat.functional_of(model))
    at = {id(node.node): i for i, node in enumerate(nodes)}  # Keras' nodes
    spans = []
    for span in every.spans:
        local = sorted(at[id(node.node)]
                       for node in every.nodes[span.start:span.stop]
                       if id(node.node) in at)
        if len(local) > 1 and local[-1] - local[0] == len(local) - 1:
            spans.append(recompute_spans.span_of(
                nodes, local[0], local[-1] + 1, outputs))
    return spans


def recomputes_blocks(model):
    """Whether `model` recomputes its blocks whole: `set_recompute(model,
    "full")` was called on it and its graph has blocks
    (`recompute_spans.block_spans`)."""
    graph = _compat.functional_of(model)
    return graph is not None and isinstance(
        _compat.graph_runner(graph), _BlockRunner)


def _check_random_recomputation(generator):
    """Refuses to recompute a random op on a mesh that splits tensors over
    more than the data (and pipeline) axis.

    A recomputation draws the forward pass's seed again, but DTensor
    derives each device's random numbers from the seed and the tensor's
    layout, and the recomputed tensor may be laid out otherwise: on
    data=2×model=4, BatchNormalization then Dropout drew another mask in
    the recomputation before Dropout drew its numbers whole. Keras'
    dropout, normal, uniform, truncated_normal and randint now draw whole
    on every device in a step (`step_context.layout_free_draw`, not checked
    here: GaussianNoise, GaussianDropout, AlphaDropout, SpatialDropout...),
    and so does shuffle's; gamma, beta and binomial are refused in any step
    (DTensor cannot lay them out); other draws from a seed generator
    (keras.random.categorical, a TF op on `SeedGenerator.next()`) may
    still draw per block. On data (× pipe) meshes tensors are split by the
    batch alone, and the numbers are the same.
    """
    extended = step_context.step_extended()
    if extended is None:
        return
    other = extended.dims.model_axes
    if other:
        raise ValueError(
            "A recomputed layer (keras.RematScope) draws random numbers "
            f"(seed generator {generator.name!r}) with an op tfpar cannot "
            "draw as one device (e.g. keras.random.categorical or a "
            "tf.random op on the generator's seed; Keras' dropout, normal, "
            "uniform, truncated_normal, randint and shuffle are fine, so are "
            "the layers using them) on a mesh "
            f"that also splits tensors over {other}: DTensor may lay the "
            "recomputed tensor out differently from the forward pass and "
            "draw another mask, so the gradients would be wrong. Leave "
            "layers with random ops out of the RematScope (e.g. mode="
            "'list_of_layers'), or recompute them on a data-only mesh. "
            f"Received mesh: {extended.mesh!r}.")


def _seed_generator():
    return _compat.keras_module("random.seed_generator").SeedGenerator


# Keras 3.15 rematerializes (`keras.RematScope`, `keras.remat`) with
# `tf.recompute_grad(call)` called with the layer's keyword arguments, which
# `tf.custom_gradient` refuses in graph mode: `RematScope(mode="full")` fails
# in any `fit`, even on one device (tests/test_recompute.py), and new Dropout
# masks would be drawn. `recompute` replaces Keras' TF `remat`, and
# `SeedGenerator.next` replays seeds inside a recomputation (`next_seed`).
REMAT_PATCHES = (
    _compat.Patch("remat", _compat.keras_tf_core, "remat",
                  lambda _, hooks: hooks.recompute),
    _compat.Patch("seed_next", _seed_generator, "next",
                  lambda original, hooks: functools.partialmethod(
                      hooks.next_seed, original, hooks.check_replay)),
)


def install():
    """Installs `REMAT_PATCHES`: Keras' TF `remat` is `recompute`, seeds
    replayed by `next_seed` (refused by `_check_random_recomputation` where
    DTensor could draw another mask); idempotent. Making a
    `ParallelStrategy` calls it; without a strategy, calling it is the
    opt-in that makes `keras.RematScope` work on TensorFlow."""
    _compat.install_group("remat", REMAT_PATCHES, types.SimpleNamespace(
        recompute=recompute, next_seed=next_seed,
        check_replay=_check_random_recomputation))


# -- tfpar's recomputation modes: none, selective (the attention core), full --

RECOMPUTE_MODES = (None, "selective", "full")
_CORE = recompute_spans.CORE_METHOD  # the attention core's method

def _attention_cores(model):
    """The (layer, kind) pairs of `model`'s attention cores: "method" (a
    layer with `_compute_attention`) or "whole" (a layer that is a core);
    raises for a layer named like attention whose core is neither."""
    layers = _compat.all_layers(model, include_self=False)
    cores = []
    for layer in layers:
        kind = recompute_spans.is_core(layer)
        if kind:
            cores.append((layer, kind))
    found = {id(layer) for layer, _ in cores}
    for layer in layers:
        inner = _compat.all_layers(layer, include_self=False)
        if ("attention" in type(layer).__name__.lower()
                and id(layer) not in found
                and not any(id(x) in found for x in inner)):
            raise ValueError(_unsupported(layer, model))
    if not cores:
        raise ValueError(
            "set_recompute(mode='selective') recomputes the attention core "
            f"of each attention layer, but model {model.name!r} has none. "
            f"Supported: {_SUPPORTED}. Use mode='full' to recompute its "
            "layers whole, or None.")
    return cores


_SUPPORTED = ("layers with a `_compute_attention(query, key, value, ...)` "
              "method (keras.layers.MultiHeadAttention, "
              "keras.layers.GroupedQueryAttention, keras-hub's "
              "CachedMultiHeadAttention and its Llama, Gemma, Mistral, Qwen, "
              "Phi-3, GPT-NeoX attention layers) and keras.layers.Attention "
              "/ AdditiveAttention")


def _unsupported(layer, model):
    return (
        f"set_recompute(mode='selective'): layer {layer.name!r} of model "
        f"{model.name!r} (class {type(layer).__name__}) looks like attention, "
        "but tfpar cannot find its attention core (QK^T, softmax, dropout, "
        f"attention over V) to recompute. Supported: {_SUPPORTED}. Give the "
        "class a `_compute_attention(query, key, value, ...)` method holding "
        "that core, or use mode='full'.")


def _full_layers(model):
    """The layers `model`'s graph calls (nested functional models opened),
    those with trainable weights: what mode="full" recomputes whole."""
    out = []
    for layer in getattr(model, "layers", ()):
        graph = _compat.functional_of(layer) if isinstance(
            layer, keras.Model) else None
        if graph is not None and _compat.nodes_by_depth(graph) is not None:
            out.extend(_full_layers(layer))
        elif _compat.trained_weights(layer):
            out.append(layer)
    return out


def _recomputed_core(method):
    """`method` (an attention core) under `recompute`, which takes tensors
    out only: its `None` outputs (Keras' attention scores when not asked
    for) are put back in place after."""
    last = {}

    def tensors_out(*args, **kwargs):
        last["structure"] = method(*args, **kwargs)
        return [t for t in tf.nest.flatten(last["structure"]) if t is not None]

    checkpointed = recompute(tensors_out)

    def core(*args, **kwargs):
        flat = iter(checkpointed(*args, **kwargs))
        return tf.nest.map_structure(
            lambda t: None if t is None else next(flat), last["structure"])

    return core


def _reset(model):
    """Every layer of `model` back to no recomputation."""
    for layer in _compat.all_layers(model):
        if _compat.remat_mode(layer) is not None:
            _compat.set_remat_mode(layer, None)
        if _CORE in vars(layer):  # the instance's recomputed core
            delattr(layer, _CORE)
    graph = _compat.functional_of(model)
    if graph is not None and recomputes_blocks(model):
        _compat.set_graph_runner(graph, None)


def set_recompute(model, mode):
    """Sets what `model` recomputes in the backward pass instead of keeping:
    `None` (nothing), `"selective"` or `"full"`. Call it before `compile`
    (or after, then compile again); it replaces any earlier mode.

    - `"selective"` (Korthikanti et al., "Reducing Activation
      Recomputation in Large Transformer Models", 2022): each attention
      layer's core - QK^T, softmax, dropout, attention over V - is
      recomputed (`recompute`, seeds replayed: the same dropout mask); the
      Q, K, V and output projections and every other layer keep their
      activations. A layer's s×s scores, softmax and dropout output and
      mask (5·a·s²·b bytes per layer in fp16, a heads, s sequence length,
      b batch) are no longer kept, for one more forward pass of the core
      (its FLOPs: 4·b·s²·h of the layer's 24·b·s·h² + 4·b·s²·h). Supported
      attention: a layer with a `_compute_attention` method (Keras'
      MultiHeadAttention, GroupedQueryAttention, keras-hub's attention
      layers) or `keras.layers.Attention`; another layer named like
      attention raises a ValueError naming it.
    - `"full"`: each transformer block of a functional model's graph
      (`tfpar.recompute_spans.block_spans`: the nodes from one block's
      input to the next's, found between attention layers) runs as one
      recomputed call, in plain steps and in pipeline parts (a block a
      stage boundary cuts: one call on each side): only the block's input
      is kept, as in Megatron-LM, also when the block is written one
      Keras layer per op. Every other layer with weights is
      recomputed on its own (`keras.RematScope(mode="full")`, also the
      blocks' layers where a step runs Keras' own graph: inference, a
      zero-bubble schedule's split backward), keeping its inputs.

    It installs tfpar's recomputation (`install`), so it also works on one
    device without a `ParallelStrategy`.

    Example (a transformer block's attention core recomputed):

    >>> import keras
    >>> from tfpar.recompute import set_recompute
    >>> x = keras.Input((8, 16))
    >>> a = keras.layers.MultiHeadAttention(2, 8, dropout=0.1)(x, x)
    >>> model = keras.Model(x, keras.layers.Dense(4)(a))
    >>> set_recompute(model, "selective")
    >>> model.compile(optimizer="adam", loss="mse")
    """
    if mode not in RECOMPUTE_MODES:
        raise ValueError(
            "set_recompute(mode) must be None, 'selective' (the attention "
            "core recomputed) or 'full' (every layer recomputed). "
            f"Received: mode={mode!r}")
    cores = _attention_cores(model) if mode == "selective" else ()
    install()
    _reset(model)
    for layer, kind in cores:
        if kind == "whole":
            _compat.set_remat_mode(layer, "full")
        else:  # the bound method, recomputed; looked up on the instance
            method = getattr(type(layer), _CORE).__get__(layer)
            setattr(layer, _CORE, _recomputed_core(method))
    if mode == "full":
        for layer in _full_layers(model):
            _compat.set_remat_mode(layer, "full")
        if keras_graph.functional_graph(model) is not None:
            functional = _compat.functional_of(model)
            runner = _BlockRunner(model, _compat.graph_runner(functional))
            if runner.spans:  # its blocks, each one recomputed call
                _compat.set_graph_runner(functional, runner)
