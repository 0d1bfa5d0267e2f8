"""PipelineModel: a Keras model whose parts run on different sub-meshes.

Under a `ParallelStrategy` whose mesh has a pipeline axis of size p, the
wrapped model is cut into p stages (`tfpar.pipeline.split`); stage s's
weights move to the sub-mesh at coordinate s of that axis (the other axes,
e.g. data × model, work inside every stage). With `virtual_stages=v` the
model is cut into v × p parts and part k runs on stage k mod p (Megatron-
LM's virtual pipeline stages); without, a part is a stage. A global batch of
B samples is cut into m micro-batches of B/m, each split over the data axis.

Where each piece lives:

- `tfpar.pipeline.part.ModelPart`: one part — its layers, weights, mesh,
  optimizer, and the tapes of its micro-batches in flight, with
  `forward(i)`, `backward(i)` and the zero-bubble halves
  `backward_input(i)` / `backward_weight(i)`;
- `tfpar.pipeline.runner.PipelineRunner`: the step, one `tf.function`
  looping over the schedule's actions (GPipe, 1F1B, ZB-H1, ZB-H2, ZB-V,
  the interleaved forms), each dispatched to its part; activations and
  gradients cross between parts by the stage-to-stage moves of
  `tfpar.collectives`, and a stage's actions are chained in the schedule's
  order by data (ordering tokens, `tfpar.pipeline.ordering`: DTensor drops
  control dependencies);
- this module: the Keras face (validation, compile, one optimizer per part,
  save, summary).

Each micro-batch loss is scaled by 1/m, so the summed weight gradients are
those of the mean loss over the whole batch: the step equals the full-batch
step (gradient accumulation).

Keras' optimizer keeps scalar state (`iterations`, the learning rate) that
every update reads; a DTensor op cannot read tensors of two meshes, so each
stage gets its own copy of the optimizer (same config, kept in step; the
compiled optimizer — `model.optimizer` — serves the last stage).

Example:

>>> import keras, numpy as np, tfpar
>>> tfpar.use_virtual_cpus(8)
>>> strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 2, "data": 4}))
>>> with strategy.scope():
...     model = keras.Sequential([keras.Input((8,))] + [
...         keras.layers.Dense(16, activation="relu", name=f"d{i}")
...         for i in range(4)])
...     pipe = tfpar.PipelineModel(model, num_microbatches=4)
...     pipe.compile(optimizer="adam", loss="mse")
>>> print(pipe.split_report())  # doctest: +ELLIPSIS
stage 0 on CPU:0..CPU:3: 2 layer(s) d0..d1, ...
>>> x = np.random.rand(64, 8).astype("float32")
>>> history = pipe.fit(x, np.zeros((64, 16)), batch_size=32, verbose=0)
"""

import time
import types

import keras
import numpy as np
import tensorflow as tf

from tfpar import _compat
from tfpar import layout as layout_lib
from tfpar import mesh as mesh_lib
from tfpar import optimizer_copies
from tfpar import placement
from tfpar import styles
from tfpar import training
from tfpar.pipeline import cross_host
from tfpar.pipeline import schedules as schedules_lib
from tfpar.pipeline import split as split_lib
from tfpar.pipeline import tied as tied_lib
from tfpar.pipeline.part import ModelPart, inseparable_message
from tfpar.pipeline.runner import Microbatching


class PipelineModel(cross_host.MetricsOnEveryHost, keras.Model,
                    training.StagedModel):
    """Runs a Sequential or functional model as a pipeline of stages.

    Create it inside `strategy.scope()` of a `tfpar.ParallelStrategy` whose
    mesh has a pipeline axis (default name "pipe"); then `compile`, `fit`,
    `evaluate`, `predict`, `get_weights`/`set_weights`, `get_layer` work as
    for any Keras model.

    Args:
        model: a built Sequential (with `keras.Input`) or functional model,
            created in the same scope; functional models used as its
            layers (a keras-hub task's backbone) are cut inside.
        num_microbatches: m, micro-batches per global batch. The global
            batch must be divisible by m × the data axis size.
        schedule: "1f1b" (default: at most p micro-batches' activations
            alive per stage; interleaved, Megatron-LM's warm-up
            (p-s-1)·2 + (v-1)·p plus one part-micro-batch pairs, each 1/v
            of a stage), "gpipe" (all m), or the zero-bubble "zb-h1"
            (m >= p; at most p alive), "zb-h2" (m >= 2p - 1; at most
            2p - 1 alive) and "zbv" (m >= 2p - 1; two parts per stage in
            a V, stage s holding parts s and 2p - 1 - s: the model is cut
            into 2p parts; at most 2p half-stage parts alive), which split
            each backward into input and weight gradients
            (`tfpar.pipeline.zero_bubble`, `zero_bubble_v`).
        virtual_stages: v, model parts per stage (default 1). With v > 1
            the model is cut into v × p parts, part k on stage k mod p, and
            the schedule is interleaved ("1f1b": Megatron-LM's interleaved
            1F1B, num_microbatches a multiple of p; "gpipe": looped GPipe):
            the bubble shrinks from (p-1)/(m+p-1) to (p-1)/(v·m+p-1) (looped
            GPipe: only for m >= p) for v times more stage-to-stage
            transfers. None (the default) takes the strategy's
            `ParallelStrategy(virtual_stages=...)` when it declares one (else
            1); a different v than the strategy declares is an error naming
            both.
        stage_boundaries: names of the layers where parts 1..v·p-1 begin
            (stages 1..p-1 without interleaving); layers of nested models
            (inlined) by path, e.g. "llama_backbone/transformer_layer_1",
            or by name when unique; None cuts automatically. A layer called
            again on a later stage (a tied output head) stays on the stage
            of its first call; the later stage reads its weights (see
            `tied_weights`).
        tied_weights: how a later stage reads the weights of a layer it
            calls again (tied weights, `tfpar.pipeline.tied`):
            "persistent" (default, Megatron-LM's): each stage that reads
            them holds a copy, updated by its own optimizer; per step each
            copy's summed gradient goes to the weight's home stage and the
            total back (two weight-sized moves per step), so the copies
            stay bit-equal and one optimizer step applies the sum, as on
            one device. "per_step": the later stage holds no copy and
            receives the weight in every micro-batch forward, sending its
            gradient back (2m moves per step, no copy or slots in memory).
            Either way `get_weights` and checkpoints see one weight.
        balance: what the automatic cut balances: "params" (parameter
            count, default) or "time" (each layer's measured forward time
            on one batch of zeros; needs `input_shape` known, i.e. a model
            with `keras.Input`).
        record_timeline: keep the executed timeline of each training step
            in `last_timeline` (runs TF's profiler around every step, so
            for diagnosis: it slows the step; the step's collective groups
            are formed before the profiler starts, as TF 2.21's profiler
            aborts the process when one forms under it,
            docs/guides/robustness.md).
        name: model name (default "pipeline_<model name>").
    """

    def __init__(self, model, num_microbatches, schedule="1f1b",
                 stage_boundaries=None, balance="params",
                 record_timeline=False, name=None, virtual_stages=None,
                 tied_weights="persistent"):
        extended = _pipeline_extended()
        _check_arguments(model, num_microbatches)
        tied_lib.check_mode(tied_weights)
        virtual_stages = extended.dims.resolve_virtual_stages(virtual_stages)
        num_stages = len(extended.stage_meshes)
        # Validates the name (and m for interleaving) before anything changes.
        full_schedule = schedules_lib.get_schedule(
            schedule, num_stages, num_microbatches, virtual_stages)
        virtual_stages = full_schedule.virtual_stages  # "zbv": always 2
        _check_parts(model, num_stages, virtual_stages, balance,
                     full_schedule.name)
        costs = None
        if stage_boundaries is None and balance == "time":
            costs = _measured_layer_times(model, extended)
        _check_sequence_parallel(model, extended)
        if full_schedule.split_backward:
            _check_separable(model, full_schedule.name)
        layers = split_lib.split_model(model, num_stages * virtual_stages,
                                       stage_boundaries, costs)
        cross_host.check_supported(model, layers, full_schedule, extended,
                                   tied_weights)
        super().__init__(name=name or f"pipeline_{model.name}")
        self.wrapped = model
        self._extended = extended
        self._layers_of_parts = layers
        self._schedule = full_schedule
        self.microbatching = Microbatching(
            num_microbatches, extended.data_axis,
            extended.stage_meshes[0].axis_size(extended.data_axis))
        self.record_timeline = record_timeline
        self.last_timeline = None
        self._optimizers = self._learning_rate = None
        self._eager_runner = None
        # The unpipelined copy `generate` runs, in a holder Keras does not
        # track (its weights are not the pipeline's).
        self._generator = types.SimpleNamespace(model=None)
        self._place_parts()
        self._parts = [ModelPart(part, self.part_mesh(part.index), extended,
                                 self) for part in layers]
        # Keras does not track it: the copies are not the model's weights.
        self._tied = types.SimpleNamespace(weights=tied_lib.TiedWeights(
            self._parts, extended.registry, tied_weights))
        for part in self._parts:
            part.ties = self._tied.weights
        self.built = True

    # -- structure -----------------------------------------------------------

    def part_mesh(self, part):
        """The `tfpar.Mesh` of model part `part`: its stage's (`part mod
        p`, or in ZB-V's V part `2p - 1 - part` past the turn)."""
        stage, _ = self._schedule.stage_and_chunk(part)
        return self._extended.stage_meshes[stage]

    def _place_parts(self):
        """Moves every part's weights and other state onto its stage's
        sub-mesh (a weight held by layers of two parts: the first's), after
        checking that every tie can be honoured."""
        tied_lib.check_ties(self._layers_of_parts, "part" if len(
            self._layers_of_parts) > len(self._extended.stage_meshes)
            else "stage")
        for stage in self._layers_of_parts:
            mesh = self.part_mesh(stage.index)
            tied = {id(w) for w in stage.shared}  # held by an earlier part
            for layer in stage.layers:
                # All state: weights and random seed generators (Dropout's
                # seed drawn elsewhere would put its mask on another mesh).
                for variable in getattr(layer, "variables", []):
                    if id(variable) not in tied:
                        self._extended.registry.move_to(variable, mesh)

    def _last_mesh(self):
        """The mesh of the last part (loss, metrics, the compiled
        optimizer): the last stage's, or stage 0's in ZB-V's V."""
        return self.part_mesh(self._schedule.num_parts - 1)

    @property
    def stages(self):
        """The layers of each model part (`tfpar.pipeline.split.Part`s) in
        pipeline order: one per stage, or v per stage when interleaved."""
        return list(self._layers_of_parts)

    @property
    def parts(self):
        """The model parts (`tfpar.pipeline.part.ModelPart`s: layers, mesh,
        optimizer, micro-batches in flight) in pipeline order."""
        return list(self._parts)

    @property
    def ties(self):
        """The `tfpar.pipeline.tied.TiedWeights`: weights read on several
        stages, their persistent copies (`ties.copies`) and how their
        gradients are summed."""
        return self._tied.weights

    def tied_copy_state(self):
        """The persistent copies of tied weights and their optimizer slots
        (they mirror the model's weights; checkpoints skip them)."""
        return self.ties.copy_state()

    def sync_tied_copies(self, optimizer=True):
        """Refills every persistent copy of a tied weight (and, with
        `optimizer`, its optimizer slots) from the weight it mirrors.
        `set_weights`, `load_weights` and `tfpar.restore_checkpoint` call
        it; call it after assigning a tied weight yourself."""
        self.ties.sync(optimizer)

    def set_weights(self, weights):
        super().set_weights(weights)
        self.sync_tied_copies(optimizer=False)

    def save_weights(self, filepath, *args, **kwargs):
        """Saves the wrapped model's weights (one per weight, no copy): the
        file loads into the plain model, on any strategy or none."""
        return self.wrapped.save_weights(filepath, *args, **kwargs)

    def load_weights(self, filepath, *args, **kwargs):
        """Loads a weights file of the wrapped model (`save_weights`) and
        refills the persistent copies of tied weights."""
        result = self.wrapped.load_weights(filepath, *args, **kwargs)
        self.sync_tied_copies(optimizer=False)
        return result

    @property
    def virtual_stages(self):
        """v, model parts per stage (1: not interleaved)."""
        return self._schedule.virtual_stages

    @property
    def num_microbatches(self):
        return self.microbatching.num_microbatches

    @property
    def schedule(self):
        """The `tfpar.pipeline.Schedule` a full training batch runs."""
        return self._schedule

    def split_report(self):
        """Which stage holds which layers and parameters, on which devices."""
        devices = [_device_range(self.part_mesh(stage.index))
                   for stage in self._layers_of_parts]
        return split_lib.format_split(self._layers_of_parts, devices,
                                      len(self._extended.stage_meshes),
                                      self._schedule.stage_and_chunk)

    def call(self, inputs, training=None):
        # Symbolic use only (Keras builds output specs with it); concrete
        # inputs are run stage by stage by the pipeline runner.
        return self.wrapped(inputs, training=training)

    def get_layer(self, name=None, index=None):
        return self.wrapped.get_layer(name=name, index=index)

    def generate(self, *args, sampler=None, **kwargs):
        """The wrapped model's `generate` (keras-hub `CausalLM`), run
        unpipelined: an unpipelined copy of the wrapped model (built once
        from its config, outside any strategy: on one device) receives the current
        weights (`get_weights`, through the host) and generates; the
        pipeline's stages are not used. Fine for evaluation-sized
        generation; for a model too large for one device's copy, save it
        and generate under a tensor-parallel strategy instead. `sampler`
        (e.g. "greedy"; keras-hub's `compile(sampler=...)`) is the copy's;
        default the wrapped model's.

        >>> pipe.generate({"token_ids": ids, "padding_mask": mask},
        ...               max_length=8, sampler="greedy")  # doctest: +SKIP
        """
        _check_can_generate(self.wrapped)
        if self._generator.model is None:
            self._generator.model = type(self.wrapped).from_config(
                self.wrapped.get_config())
        sampler = sampler or getattr(self.wrapped, "sampler", None)
        if sampler is not None:
            self._generator.model.compile(sampler=sampler)
        self._generator.model.set_weights(self.get_weights())
        return self._generator.model.generate(*args, **kwargs)

    def summary(self, *args, **kwargs):
        print(self.split_report())
        return self.wrapped.summary(*args, **kwargs)

    def save(self, filepath, *args, **kwargs):
        """Saves the wrapped model: a plain Keras model (whole weights, not
        compiled) that loads anywhere, also without tfpar; wrap it in a
        `PipelineModel` again to resume pipeline training (or restore a
        `tfpar.save_checkpoint` for the optimizer state)."""
        return self.wrapped.save(filepath, *args, **kwargs)

    def compile(self, *args, **kwargs):
        """Keras `compile`; loss, metrics and this optimizer live on the
        last part's stage (the other parts get copies of the optimizer)."""
        last = self._last_mesh()
        with self._extended.registry.placing_on(last):
            super().compile(*args, **kwargs)
        # An optimizer or metrics made before compile (in the scope) have
        # their counters on the first stage: the last stage updates them.
        state = list(self.metrics_variables)
        if self.optimizer is not None:
            for optimizer in optimizer_copies.with_delegates(self.optimizer):
                state.append(optimizer.iterations)
                rate = _compat.optimizer_learning_rate_variable(optimizer)
                if rate is not None:
                    state.append(rate)
        for variable in state:
            if self._extended.registry.owns(variable):
                self._extended.registry.move_to(variable, last)
        if getattr(self.optimizer, "global_clipnorm", None):
            raise ValueError(
                "PipelineModel cannot clip by global norm: the norm would "
                "span several stages' meshes. Received: global_clipnorm="
                f"{self.optimizer.global_clipnorm}. Use clipnorm= or "
                "clipvalue= (per variable) instead.")

    def _symbolic_build(self, *args, **kwargs):
        # Keras builds metrics here (they belong on the last stage) and the
        # optimizer for *all* weights; each stage's optimizer is built for
        # its own weights instead (slots then exist once, on their stage).
        last = self._last_mesh()
        with self.distribute_strategy.scope(), \
                self._extended.registry.placing_on(last):
            if self.optimizer is not None and not self.optimizer.built:
                _build_optimizer(self, self.optimizer, self._parts[-1])
            return super()._symbolic_build(*args, **kwargs)

    @property
    def stage_optimizers(self):
        """One built optimizer per model part (per stage unless
        interleaved), for that part's weights; the last is `self.optimizer`
        (the others are copies of its config, created on first use, kept in
        step by `sync_stage_optimizers`)."""
        optimizer = self.optimizer
        if optimizer is None:
            return []
        if self._optimizers is None or self._optimizers[-1] is not optimizer:
            meshes = [part.mesh for part in self._parts]
            with self.distribute_strategy.scope():
                if not optimizer.built:
                    _build_optimizer(self, optimizer, self._parts[-1])
                copies = []
                for s, mesh in enumerate(meshes[:-1]):
                    with self._extended.registry.placing_on(mesh):
                        copy = optimizer_copies.copy_optimizer(optimizer)
                    _build_optimizer(self, copy, self._parts[s])
                    copies.append(copy)
            self._optimizers = copies + [optimizer]
            for part, part_optimizer in zip(self._parts, self._optimizers):
                part.optimizer = part_optimizer
            _finalize_by_part(optimizer, self._parts, self._optimizers)
            self._learning_rate = None
            self.sync_stage_optimizers(iterations=True)
        return list(self._optimizers)

    def sync_stage_optimizers(self, iterations=False):
        """Copies `self.optimizer`'s learning rates (a callback may have
        changed them; its delegates' too) and, with `iterations=True` (e.g.
        after restoring a checkpoint), its step counters into the other
        stages' optimizers."""
        optimizers = self.stage_optimizers  # creates them on first use
        if len(optimizers) < 2:
            return  # no optimizer, or a single stage
        self._learning_rate = optimizer_copies.keep_in_step(
            optimizers[-1], optimizers[:-1], self._learning_rate, iterations)

    def fit(self, *args, **kwargs):
        self.microbatching.expect_full_batch()
        return super().fit(*args, **kwargs)

    def train_on_batch(self, *args, **kwargs):
        self.microbatching.expect_full_batch()
        return super().train_on_batch(*args, **kwargs)

    # -- the protocol of `tfpar.training.StagedModel`, and its runner ---------

    def make_runner(self, mode):
        """The runner of Keras step `mode` the strategy gives this model
        (`tfpar.runners`: a `PipelineRunner`; across hosts its host-driven
        form, `cross_host.CrossHostRunner`; each one's offload form)."""
        return self._extended.make_runner(self, mode)

    def eager_call(self, args, kwargs):
        """`model(x)` on concrete inputs: the pipeline's forward pass."""
        x = args[0] if args else kwargs.pop("inputs")
        x = tf.nest.map_structure(tf.convert_to_tensor, x)
        if self._eager_runner is None:
            self._eager_runner = self.make_runner("predict")
        return tf.nest.map_structure(
            tf.constant, self._eager_runner.predict_inputs(x))


def _build_optimizer(pipeline, optimizer, part):
    """Builds `optimizer` for `part`'s weights, on its mesh; its state
    where the strategy keeps it (under `offload="optimizer"` the part's
    own host devices: `ParallelExtended.place_optimizer_state`)."""
    extended = pipeline.distribute_strategy.extended
    extended.place_optimizer_state(optimizer, part.mesh)
    with extended.registry.placing_on(part.mesh):
        optimizer.build(part.updated)


def _finalize_by_part(main, parts, optimizers):
    """Keras' `fit` ends with `model.optimizer.finalize_variable_values(
    model.trainable_weights)` (an EMA's averages written into the weights,
    a MultiOptimizer's sub-optimizers each given theirs), but each stage's
    optimizer holds the state of its part's weights only: `main`'s call
    runs every part's optimizer over the weights it was built for."""
    finalizers = [(optimizer.finalize_variable_values, part)
                  for part, optimizer in zip(parts, optimizers)]

    def finalize_by_part(var_list):  # noqa: ARG001 (each part's own instead)
        for finalize, part in finalizers:
            finalize(part.updated)

    main.finalize_variable_values = finalize_by_part


def _check_can_generate(wrapped):
    """The wrapped model generates, and no strategy is in scope (the copy
    that generates must be made on one device)."""
    if not hasattr(wrapped, "generate"):
        raise AttributeError(
            f"PipelineModel.generate calls the wrapped model's "
            f"generate(), but model {wrapped.name!r} "
            f"({type(wrapped).__name__}) has none. Received: a "
            "model without generate (use predict).")
    if tf.distribute.has_strategy():
        raise RuntimeError(
            "PipelineModel.generate builds an unpipelined copy of the "
            "wrapped model, which must not be created on the pipeline's "
            "mesh. Received: a call inside `strategy.scope()` "
            f"({type(tf.distribute.get_strategy()).__name__}). Call "
            "generate outside the scope.")


def _pipeline_extended():
    """The current strategy's `extended`; it must have stage meshes."""
    strategy = tf.distribute.get_strategy()
    extended = getattr(strategy, "extended", None)
    if not hasattr(extended, "stage_meshes"):
        raise ValueError(
            "Create PipelineModel inside `with strategy.scope():` of a "
            "tfpar.ParallelStrategy (its mesh's pipeline axis gives the "
            f"stages). Received: current strategy {type(strategy).__name__}."
        )
    return extended


def _check_arguments(model, num_microbatches):
    if not isinstance(model, keras.Model):
        raise TypeError(
            "PipelineModel(model) needs a Keras Model. Received: "
            f"model={model!r} of type {type(model).__name__}")
    if isinstance(num_microbatches, bool) or not isinstance(
            num_microbatches, int) or num_microbatches < 1:
        raise ValueError(
            "PipelineModel(num_microbatches) needs an int >= 1. "
            f"Received: num_microbatches={num_microbatches!r}")


def _check_parts(model, num_stages, virtual_stages, balance, schedule):
    """A known balance, and a built model with a layer for each of the
    v × p parts."""
    if balance not in split_lib.BALANCE_MODES:
        raise ValueError(
            f"PipelineModel(balance) must be one of "
            f"{split_lib.BALANCE_MODES}. Received: balance={balance!r}")
    if not model.built:
        raise ValueError(
            f"PipelineModel needs a built model; model {model.name!r} is "
            "not built. Give it a keras.Input (Sequential) or build it.")
    num_layers = len(split_lib.model_graph(model)[1])
    if virtual_stages > 1 and num_stages * virtual_stages > num_layers:
        if schedule == "zbv":
            raise ValueError(
                f"schedule='zbv' cuts the model into 2 × stages = "
                f"{2 * num_stages} parts (two per stage, in a V), but model "
                f"{model.name!r} has only {num_layers} layer(s). Received: "
                f"schedule='zbv' on {num_stages} stages. Use schedule="
                "'zb-h1' or 'zb-h2' (one part per stage), or fewer stages.")
        raise ValueError(
            f"PipelineModel cuts the model into virtual_stages × stages "
            f"= {virtual_stages} × {num_stages} = "
            f"{virtual_stages * num_stages} parts, but model "
            f"{model.name!r} has only {num_layers} layer(s). Received: "
            f"virtual_stages={virtual_stages}. Use virtual_stages <= "
            f"{max(1, num_layers // num_stages)}.")


def _check_separable(model, schedule):
    """Weight regularisers add a loss read from the weights directly (not
    through the layer's outputs): a split backward would miss it."""
    owner = {}  # regularised weight -> its innermost layer
    for layer in _compat.all_layers(model):  # outermost first
        if getattr(layer, "activity_regularizer", None) is not None:
            owner[id(layer)] = layer.name
        for w in _compat.trained_weights(layer):
            if getattr(w, "regularizer", None) is not None:
                owner[id(w)] = layer.name
    regularized = list(dict.fromkeys(owner.values()))
    if regularized:
        raise ValueError(inseparable_message(
            schedule, regularized, "have weight or activity regularizers"))


def _check_sequence_parallel(model, extended):
    """Sequence parallelism inside stages whose mesh has no data axis
    (e.g. pipe=2 × model=4) crashes DTensor's compiler (a segmentation
    fault on TF 2.21, found with examples/gpt.py); with a data axis (pipe=2
    × data=2 × model=2) it trains in parity. Refuse the crashing case."""
    if len(extended.stage_meshes) < 2 or extended.stage_meshes[0].axis_size(
            extended.data_axis) > 1:
        return
    for layer in _compat.all_layers(model):
        if styles.is_sequence_parallel(layer):
            raise ValueError(
                "Sequence parallelism inside pipeline stages needs a data "
                "axis in the mesh: without one, DTensor (TF 2.21) crashes "
                f"compiling the step. Received: layer {layer.name!r} planned "
                "with sequence_parallel=True on stages "
                f"{extended.stage_meshes[0]!r}. Add a data axis (e.g. "
                "Mesh({'pipe': 2, 'data': 2, 'model': 2})) or plan without "
                "sequence_parallel.")


def _device_range(mesh):
    return mesh_lib._device_range(mesh.devices)  # noqa: SLF001 (tfpar's own)


def _measured_layer_times(model, extended, batch_size=32, repeats=3):
    """Seconds per layer of one forward on `batch_size` zeros (the best of
    `repeats` eager runs on the mesh the weights were created on)."""
    nodes, layers, inputs, _, _ = split_lib.model_graph(model)
    mesh = extended.registry.placement_mesh  # None: the weights are on the host
    tensors = {}
    for k in inputs:
        shape = [batch_size if d is None else d for d in k.shape]
        zeros = np.zeros(shape, dtype=k.dtype)
        tensors[id(k)] = tf.constant(zeros) if mesh is None else placement.put(
            zeros, layout_lib.replicated_spec(len(shape)), mesh)
    seconds = {id(layer): 0.0 for layer in layers}
    for node in nodes:
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            node.run(tensors, training=False)  # synchronous
            best = min(best, time.perf_counter() - start)
        seconds[id(node.operation)] += best
    return [seconds[id(layer)] for layer in layers]
