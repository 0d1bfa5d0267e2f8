"""PipelineModel: a Keras model whose stages run on different sub-meshes.

Under a `ParallelStrategy` whose mesh has a pipeline axis of size p, the
wrapped model is cut into p stages (`tfpar.pipeline.split`); stage s's
weights move to the sub-mesh at coordinate s of that axis (the other axes,
e.g. data × model, work inside every stage). A global batch of B samples is
cut into m micro-batches of B/m, each split over the data axis.

One training step is one `tf.function` holding every stage's work:

- forward F(s, i): stage s runs its layers on micro-batch i under its own
  `GradientTape`; the last stage also computes the loss and metrics.
  Activations cross to stage s+1 (DTensor: relayout to replicated on the
  source sub-mesh, `copy_to_mesh`, relayout to the batch split).
- backward B(s, i): the stage's tape gives the gradients of its weights and
  inputs, with the gradient arriving from stage s+1 as `output_gradients`
  (a vector-Jacobian product); input gradients cross back to stage s-1.
  Each micro-batch loss is scaled by 1/m, so the summed weight gradients
  are those of the mean loss over the whole batch: the step equals the
  full-batch step (gradient accumulation).
- zero-bubble schedules (ZB-H1, ZB-H2) split B(s, i) in two
  vector-Jacobian products over the one forward (a persistent tape): B
  gives the gradients of the stage's inputs (what the previous stage waits
  for) and of the outputs of every layer called once, W(s, i) later the
  weight gradients of such a layer from its own outputs' gradients alone,
  dL/dw_l = (dy_l/dw_l)^T dL/dy_l (no backward through the stage again).
  Weights a stage reads in several calls (a layer called twice, a weight
  shared by two layers) get theirs in W from the stage's whole
  vector-Jacobian product (a call's output may depend on the weight through
  an earlier call, which the per-layer product would count twice).
- each stage's actions run in its schedule's order (GPipe, 1F1B, ZB-H1,
  ZB-H2), chained by data dependencies; different stages run concurrently
  wherever the data flow allows. Then every stage applies its optimizer to
  its weights.
- interleaved (`virtual_stages=v`): the model is cut into v × p parts and
  part k runs on stage k mod p (Megatron-LM's virtual pipeline stages);
  everything above holds per part, a micro-batch crossing the stages v
  times, and a stage's actions (of all its parts) are chained in its
  schedule's order.

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

import contextlib
import time

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import _compat
from tfpar import layout as layout_lib
from tfpar import placement
from tfpar import styles
from tfpar.pipeline import profiler
from tfpar.pipeline import schedules as schedules_lib
from tfpar.pipeline import split as split_lib
from tfpar.pipeline.schedules import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    ZERO_BUBBLE,
)


class PipelineModel(keras.Model):
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
            (m >= p; at most p alive) and "zb-h2" (m >= 2p - 1; at most
            2p - 1 alive), which split each backward into input and weight
            gradients (`tfpar.pipeline.zero_bubble`).
        virtual_stages: v, model parts per stage (default 1). With v > 1
            the model is cut into v × p parts, part k on stage k mod p, and
            the schedule is interleaved ("1f1b": Megatron-LM's interleaved
            1F1B, num_microbatches a multiple of p; "gpipe": looped GPipe):
            the bubble shrinks from (p-1)/(m+p-1) to (p-1)/(v·m+p-1) (looped
            GPipe: only for m >= p) for v times more stage-to-stage
            transfers.
        stage_boundaries: names of the layers where parts 1..v·p-1 begin
            (stages 1..p-1 without interleaving); layers of nested models
            (inlined) by path, e.g. "llama_backbone/transformer_layer_1",
            or by name when unique; None cuts automatically. A layer called
            again on a later stage (a tied output head) stays on the stage
            of its first call; the later stage reads its weights.
        balance: what the automatic cut balances: "params" (parameter
            count, default) or "time" (each layer's measured forward time
            on one batch of zeros; needs `input_shape` known, i.e. a model
            with `keras.Input`).
        record_timeline: keep the executed timeline of each training step
            in `last_timeline` (runs TF's profiler around every step: for
            diagnosis, not for production runs).
        name: model name (default "pipeline_<model name>").
    """

    def __init__(self, model, num_microbatches, schedule="1f1b",
                 stage_boundaries=None, balance="params",
                 record_timeline=False, name=None, virtual_stages=1):
        strategy = tf.distribute.get_strategy()
        extended = getattr(strategy, "extended", None)
        if not hasattr(extended, "stage_meshes"):
            raise ValueError(
                "Create PipelineModel inside `with strategy.scope():` of a "
                "tfpar.ParallelStrategy (its mesh's pipeline axis gives the "
                f"stages). Received: current strategy {type(strategy).__name__}."
            )
        if not isinstance(model, keras.Model):
            raise TypeError(
                "PipelineModel(model) needs a Keras Model. Received: "
                f"model={model!r} of type {type(model).__name__}")
        if isinstance(num_microbatches, bool) or not isinstance(
                num_microbatches, int) or num_microbatches < 1:
            raise ValueError(
                "PipelineModel(num_microbatches) needs an int >= 1. "
                f"Received: num_microbatches={num_microbatches!r}")
        if isinstance(virtual_stages, bool) or not isinstance(
                virtual_stages, int) or virtual_stages < 1:
            raise ValueError(
                "PipelineModel(virtual_stages) needs an int >= 1 (model "
                f"parts per stage). Received: virtual_stages={virtual_stages!r}")
        num_stages = len(extended.stage_meshes)
        # Validates the name (and m for interleaving) before anything changes.
        full_schedule = schedules_lib.get_schedule(
            schedule, num_stages, num_microbatches, virtual_stages)
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
            raise ValueError(
                f"PipelineModel cuts the model into virtual_stages × stages "
                f"= {virtual_stages} × {num_stages} = "
                f"{virtual_stages * num_stages} parts, but model "
                f"{model.name!r} has only {num_layers} layer(s). Received: "
                f"virtual_stages={virtual_stages}. Use virtual_stages <= "
                f"{max(1, num_layers // num_stages)}.")
        costs = None
        if stage_boundaries is None and balance == "time":
            costs = _measured_layer_times(model, extended)
        _check_sequence_parallel(model, extended)
        if full_schedule.split_backward:
            _check_separable(model, full_schedule.name)
        stages = split_lib.split_model(model, num_stages * virtual_stages,
                                       stage_boundaries, costs)
        super().__init__(name=name or f"pipeline_{model.name}")
        self.wrapped = model
        self._extended = extended
        self._stages = stages
        self._num_microbatches = num_microbatches
        self._schedule = full_schedule
        self.record_timeline = record_timeline
        self.last_timeline = None
        self._optimizers = None
        self._learning_rate = None
        self._eager_runner = None
        self._expect_full_batch = True
        self._place_stages()
        self.built = True

    # -- structure -----------------------------------------------------------

    def part_mesh(self, part):
        """The `tfpar.Mesh` of model part `part`: stage `part mod p`'s."""
        meshes = self._extended.stage_meshes
        return meshes[part % len(meshes)]

    def _place_stages(self):
        """Moves every part's weights and other state onto its stage's
        sub-mesh (after checking that no weight is used by two parts)."""
        owner = {}
        for stage in self._stages:
            for layer in stage.layers:
                for weight in split_lib.weights_of(layer):
                    first = owner.setdefault(id(weight), (stage.index, layer))
                    if first[0] != stage.index:
                        unit = "part" if len(self._stages) > len(
                            self._extended.stage_meshes) else "stage"
                        raise ValueError(
                            f"Weight {weight.path!r} is used by layer "
                            f"{first[1].name!r} ({unit} {first[0]}) and by "
                            f"layer {layer.name!r} ({unit} {stage.index}). "
                            "A layer called on two stages is tied (its "
                            "weights read on both), but two different "
                            "layers holding one weight cannot be: each "
                            "would update it. Keep layers that share "
                            f"weights in one {unit} (stage_boundaries).")
            for guest in stage.guests:
                state = [v.path for v in getattr(guest, "variables", [])
                         if not v.trainable]
                if state:
                    raise ValueError(
                        f"Layer {guest.name!r} is called on stage "
                        f"{stage.index} and on an earlier stage, and has "
                        f"state {state} that a call updates: a tie cannot "
                        "keep it in step on two stages (only weights are "
                        "read on the later stage). Keep its calls in one "
                        "stage (stage_boundaries).")
        for stage in self._stages:
            mesh = self.part_mesh(stage.index)
            for layer in stage.layers:
                # All state: weights and random seed generators (Dropout's
                # seed drawn elsewhere would put its mask on another mesh).
                for variable in getattr(layer, "variables", []):
                    self._extended.move_to(variable, mesh)
        self._stage_weights = [
            [w for layer in stage.layers
             for w in split_lib.weights_of(layer, trainable=True)]
            for stage in self._stages]

    @property
    def stages(self):
        """The model parts (`tfpar.pipeline.split.Stage`s) in pipeline
        order: one per stage, or v per stage when interleaved."""
        return list(self._stages)

    @property
    def virtual_stages(self):
        """v, model parts per stage (1: not interleaved)."""
        return self._schedule.virtual_stages

    @property
    def num_microbatches(self):
        return self._num_microbatches

    @property
    def schedule(self):
        """The `tfpar.pipeline.Schedule` a full training batch runs."""
        return self._schedule

    def split_report(self):
        """Which stage holds which layers and parameters, on which devices."""
        devices = [_device_range(self.part_mesh(stage.index))
                   for stage in self._stages]
        return split_lib.format_split(self._stages, devices,
                                      len(self._extended.stage_meshes))

    def call(self, inputs, training=None):
        # Symbolic use only (Keras builds output specs with it); concrete
        # inputs are run stage by stage by the pipeline runner.
        return self.wrapped(inputs, training=training)

    def get_layer(self, name=None, index=None):
        return self.wrapped.get_layer(name=name, index=index)

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
        last stage (the other stages get copies of the optimizer)."""
        last = self._extended.stage_meshes[-1]
        with self._extended.placing_on(last):
            super().compile(*args, **kwargs)
        # An optimizer or metrics made before compile (in the scope) have
        # their counters on the first stage: the last stage updates them.
        state = list(self.metrics_variables)
        if self.optimizer is not None:
            state.append(self.optimizer.iterations)
            rate = _compat.optimizer_learning_rate_variable(self.optimizer)
            if rate is not None:
                state.append(rate)
        for variable in state:
            if self._extended.owns(variable):
                self._extended.move_to(variable, last)
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
        last = self._extended.stage_meshes[-1]
        with self.distribute_strategy.scope(), \
                self._extended.placing_on(last):
            if self.optimizer is not None and not self.optimizer.built:
                self.optimizer.build(self._stage_weights[-1])
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
            meshes = [self.part_mesh(k) for k in range(len(self._stages))]
            with self.distribute_strategy.scope():
                if not optimizer.built:
                    with self._extended.placing_on(meshes[-1]):
                        optimizer.build(self._stage_weights[-1])
                copies = []
                for s, mesh in enumerate(meshes[:-1]):
                    with self._extended.placing_on(mesh):
                        copy = type(optimizer).from_config(
                            optimizer.get_config())
                        copy.build(self._stage_weights[s])
                    copies.append(copy)
            self._optimizers = copies + [optimizer]
            self._learning_rate = None
            self.sync_stage_optimizers(iterations=True)
        return list(self._optimizers)

    def sync_stage_optimizers(self, iterations=False):
        """Copies `self.optimizer`'s learning rate (a callback may have
        changed it) and, with `iterations=True` (e.g. after restoring a
        checkpoint), its step counter into the other stages' optimizers."""
        optimizers = self.stage_optimizers  # creates them on first use
        if len(optimizers) < 2:
            return  # no optimizer, or a single stage
        main, copies = optimizers[-1], optimizers[:-1]
        rate = _compat.optimizer_learning_rate_variable(main)
        if rate is not None:
            value = float(rate.numpy())
            if value != self._learning_rate:
                for copy in copies:
                    _compat.optimizer_learning_rate_variable(copy).assign(
                        value)
                self._learning_rate = value
        if iterations:
            step = int(main.iterations.numpy())
            for copy in copies:
                copy.iterations.assign(step)

    def fit(self, *args, **kwargs):
        self._expect_full_batch = True
        return super().fit(*args, **kwargs)

    def train_on_batch(self, *args, **kwargs):
        self._expect_full_batch = True
        return super().train_on_batch(*args, **kwargs)

    # -- hooks the strategy calls ---------------------------------------------

    def _tfpar_pipeline_runner(self, mode):
        return PipelineRunner(self, mode)

    def _tfpar_eager_call(self, args, kwargs):
        """`model(x)` on concrete inputs: the pipeline's forward pass."""
        x = args[0] if args else kwargs.pop("inputs")
        x = tf.nest.map_structure(tf.convert_to_tensor, x)
        if self._eager_runner is None:
            self._eager_runner = PipelineRunner(self, "predict")
        return tf.nest.map_structure(
            tf.constant, self._eager_runner.predict_batch(x))


class PipelineRunner:
    """Runs train/test/predict steps of a `PipelineModel` (see module doc)."""

    def __init__(self, pipeline, mode):
        if pipeline.run_eagerly and mode == "train":
            raise ValueError(
                "compile(run_eagerly=True) cannot train a PipelineModel: "
                "DTensor has no eager gradients. Received: run_eagerly=True. "
                "Compile with run_eagerly=False (the default).")
        self._model = pipeline
        self._extended = extended = pipeline._extended  # noqa: SLF001
        self._stages = pipeline._stages  # noqa: SLF001  (the model parts)
        self._layers_by_id = {id(layer): layer for stage in self._stages
                              for layer in stage.layers}
        # Where each weight is updated: (part, index in its weights).
        self._home = {id(w): (k, j) for k, weights in enumerate(
            pipeline._stage_weights) for j, w in enumerate(weights)}  # noqa: SLF001
        # Layout specs of tied weights (read eagerly: DTensor's rule).
        self._tied_specs = {
            id(w): layout_lib.spec_of(dtensor.fetch_layout(
                _compat.backing_variable(w)))
            for stage in self._stages for layer in stage.guests
            for w in split_lib.weights_of(layer, trainable=True)}
        # Indexed by part (the model part runs on its stage's mesh).
        self._meshes = [pipeline.part_mesh(k) for k in range(len(self._stages))]
        self._mode = mode
        self._data_axis = extended.data_axis
        last = self._meshes[-1]
        with extended.placing_on(last):
            extended.adopt_state_variables(pipeline)
        self._functions = {}

    # -- host side ---------------------------------------------------------

    def run(self, host_batches):
        outputs = None
        if self._mode == "predict":
            results = [self.predict_batch(_x_of(b)) for b in host_batches]
            return tf.nest.map_structure(
                lambda *xs: tf.constant(np.concatenate(xs)), *results)
        for batch in host_batches:
            outputs = self._run_batch(batch)
        return outputs

    def _microbatches(self, size):
        """(m, split over data) for a batch of `size` samples.

        The first training batch must split into m micro-batches, each
        split over the data axis; a smaller batch after it (an epoch's last)
        and any evaluate/predict batch use the most micro-batches that
        divide it (the step's result does not depend on m).
        """
        m = self._model._num_microbatches  # noqa: SLF001
        d = self._meshes[0].axis_size(self._data_axis)
        if size % (m * d) == 0:
            return m, True
        if self._mode == "train" and self._model._expect_full_batch:  # noqa: SLF001
            raise ValueError(
                f"The global batch size {size} is not divisible by "
                f"num_microbatches ({m}) × the data axis {self._data_axis!r} "
                f"({d}) = {m * d}. Received: batch_size={size}. Use a batch "
                f"size that is a multiple of {m * d}, or change "
                "num_microbatches.")
        k = max(k for k in range(1, m + 1) if size % k == 0)
        return k, (size // k) % d == 0

    def _place(self, structure, mesh_index, m, split):
        """Host tensors of B samples as DTensors (m, B/m, ...) on a stage,
        each micro-batch split over the data axis when `split`."""
        mesh = self._meshes[mesh_index]

        def put(t):
            if t is None:
                return None
            array = np.asarray(t)
            array = array.reshape((m, array.shape[0] // m) + array.shape[1:])
            spec = [None] * array.ndim
            if split and mesh.axis_size(self._data_axis) > 1:
                spec[1] = self._data_axis
            return placement.put(array, tuple(spec), mesh)

        return tf.nest.map_structure(put, structure)

    def _run_batch(self, batch):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
        size = int(np.shape(tf.nest.flatten(x)[0])[0])
        m, split = self._microbatches(size)
        if self._mode == "train":
            self._model._expect_full_batch = False  # noqa: SLF001
            self._model.sync_stage_optimizers()
        xs = self._place(x, 0, m, split)
        targets = self._place((y, sample_weight), -1, m, split)
        function = self._function(self._mode)
        if not (self._mode == "train" and self._model.record_timeline):
            return function(xs, targets, split)
        with profiler.OpEvents() as trace:
            logs = function(xs, targets, split)
            tf.nest.map_structure(placement.fetch, logs)  # wait for the step
        self._model.last_timeline = profiler.executed_timeline(
            trace.events, len(self._extended.stage_meshes))
        return logs

    def predict_batch(self, x):
        size = int(np.shape(tf.nest.flatten(x)[0])[0])
        m, split = self._microbatches(size)
        outputs = self._function("predict")(
            self._place(x, 0, m, split), None, split)
        return tf.nest.map_structure(
            lambda *ys: np.concatenate([placement.fetch(t) for t in ys]),
            *outputs)

    def _function(self, mode):
        if mode not in self._functions:
            body = {"train": self._train, "test": self._test,
                    "predict": self._predict}[mode]

            def step(xs, targets, split, _body=body):
                with self._extended.replica_scope():
                    return _body(xs, targets, split)

            # The micro-batch count is the static leading dimension of xs:
            # evaluate/predict batches of any size give varying counts, so
            # those steps trace each shape exactly (no relaxation to None).
            self._functions[mode] = (step if self._model.run_eagerly else
                                     tf.function(step, reduce_retracing=(
                                         mode == "train")))
        return self._functions[mode]

    # -- traced steps ------------------------------------------------------

    def _move(self, tensor, source, target, split):
        """`tensor` from stage `source`'s mesh to stage `target`'s, with the
        batch dimension split over the data axis when `split`."""
        if self._meshes[source] is self._meshes[target]:
            return tensor  # parts on one stage (e.g. one stage, v > 1)
        rank = tensor.shape.rank
        src, dst = self._meshes[source], self._meshes[target]
        with tf.name_scope(f"send_{source}_to_{target}"):
            whole = dtensor.relayout(tensor, dtensor.Layout.replicated(
                src.dtensor_mesh, rank))
            moved = dtensor.copy_to_mesh(whole, dtensor.Layout.replicated(
                dst.dtensor_mesh, rank))
            return placement.relayout(moved, self._batch_spec(rank, split),
                                      dst)

    def _batch_spec(self, rank, split):
        spec = [None] * rank
        if rank and split:
            spec[0] = self._data_axis
        return tuple(spec)

    def _guest_weights(self, s, watch=None):
        """(weight, value on part s) of the layers of earlier parts that
        part s calls again (tied weights): each read where it is updated and
        copied here with its layout (`watch`ed for its gradient)."""
        pairs = []
        for layer in self._stages[s].guests:
            for w in split_lib.weights_of(layer, trainable=True):
                home = self._home[id(w)][0]
                with self._on_stage(home):
                    value = tf.convert_to_tensor(w.value)
                value = self._move_like(value, home, s,
                                        self._tied_specs[id(w)])
                if watch is not None:
                    watch(value)
                pairs.append((w, value))
        return pairs

    def _move_like(self, tensor, source, target, spec):
        """`tensor` from part `source`'s mesh to part `target`'s, laid out
        there by `spec` (a weight or its gradient, as the weight is)."""
        if self._meshes[source] is self._meshes[target]:
            return tensor
        src, dst = self._meshes[source], self._meshes[target]
        rank = tensor.shape.rank
        with tf.name_scope(f"tie_{source}_to_{target}"):
            whole = dtensor.relayout(tensor, dtensor.Layout.replicated(
                src.dtensor_mesh, rank))
            moved = dtensor.copy_to_mesh(whole, dtensor.Layout.replicated(
                dst.dtensor_mesh, rank))
            return placement.relayout(moved, spec, dst)

    def _run_stage(self, s, values, training, layer_outputs=None,
                   guests=()):
        """Runs stage s on its input tensors; (outputs, its own losses).
        With a dict `layer_outputs`, also records there, per layer with
        trainable weights (by id), the floating outputs of each call.
        `guests`: (weight, value) pairs the stage reads instead of those
        weights of earlier stages (`_guest_weights`)."""
        stage = self._stages[s]
        tensors = {id(k): v for k, v in zip(stage.inputs, values)}
        guests = list(guests) or self._guest_weights(s)
        with _compat.reading_values(guests, [
                v for layer in stage.layers
                for v in getattr(layer, "variables", [])]):
            for node in stage.nodes:
                node.run(tensors, training)
                if layer_outputs is not None and \
                        node.operation not in stage.guests and \
                        split_lib.weights_of(node.operation, trainable=True):
                    layer_outputs.setdefault(id(node.operation), []).append(
                        [v for v in (tensors[id(k)] for k in node.outputs)
                         if v.dtype.is_floating])
        outputs = [tensors[id(k)] for k in stage.outputs]
        losses = [self._model._aggregate_additional_loss(loss)  # noqa: SLF001
                  for layer in stage.layers
                  for loss in getattr(layer, "losses", [])]
        if losses and layer_outputs is not None:
            raise ValueError(_inseparable_message(
                self._model.schedule.name,
                [layer.name for layer in stage.layers
                 if getattr(layer, "losses", [])], "add losses in call()"))
        return outputs, (tf.add_n(losses) if losses else None)

    def _last_stage_loss(self, y_pred, y, sample_weight, extra):
        """Keras' compiled loss of one micro-batch plus `extra` (the
        regularisation losses of all stages), as `compute_loss` adds them."""
        model = self._model
        losses = []
        if model._compile_loss is not None:  # noqa: SLF001
            loss = model._compile_loss(y, y_pred, sample_weight)  # noqa: SLF001
            if loss is not None:
                losses.append(loss)
        losses += [e for e in extra if e is not None]
        if not losses:
            raise ValueError(
                "No loss to compute. Provide a `loss` argument in compile().")
        return tf.add_n(losses) if len(losses) > 1 else losses[0]

    def _microbatch(self, structure, i, stage, split):
        """Micro-batch i of stacked (m, B/m, ...) inputs on `stage`, laid
        out like every activation (batch split over the data axis when
        `split`). tf.gather, not t[i]: DTensor mis-lays out a strided slice
        that drops the leading dimension; and the explicit layout keeps
        DTensor from propagating a consumer's layout into the gather, which
        it then cannot expand."""
        mesh = self._meshes[stage]
        return tf.nest.map_structure(
            lambda t: None if t is None else placement.relayout(
                tf.gather(t, i), self._batch_spec(t.shape.rank - 1, split),
                mesh),
            structure)

    def _forward_only(self, xs, split, i):
        """Outputs of the last stage for micro-batch i, and the other
        stages' additional losses moved to the last stage."""
        values = tf.nest.flatten(self._microbatch(xs, i, 0, split))
        extra = []
        for s in range(len(self._stages)):
            if s:
                values = [self._move(v, s - 1, s, split) for v in values]
                extra = [self._move(e, s - 1, s, split) for e in extra]
            with self._on_stage(s):
                values, loss = self._run_stage(s, values, training=False)
            if loss is not None:
                extra.append(loss)
        return values, extra

    def _y_pred(self, values):
        return _compat.model_output_structure(self._model.wrapped, values)

    def _update_metrics(self, x_size, y_pred, y, sample_weight, loss):
        model = self._model
        model._loss_tracker.update_state(loss, sample_weight=x_size)  # noqa: SLF001
        if model._compile_metrics is not None:  # noqa: SLF001
            model._compile_metrics.update_state(y, y_pred, sample_weight)  # noqa: SLF001

    def _test(self, xs, targets, split):
        m = tf.nest.flatten(xs)[0].shape[0]
        size = tf.nest.flatten(xs)[0].shape[1]
        for i in range(m):
            values, extra = self._forward_only(xs, split, i)
            with self._on_stage(len(self._stages) - 1):
                y, sample_weight = self._microbatch(targets, i, -1, split)
                y_pred = self._y_pred(values)
                loss = self._last_stage_loss(y_pred, y, sample_weight, extra)
                self._update_metrics(size, y_pred, y, sample_weight, loss)
        with self._on_stage(len(self._stages) - 1):
            return self._logs()

    def _predict(self, xs, targets, split):
        m = tf.nest.flatten(xs)[0].shape[0]
        return [self._y_pred(self._forward_only(xs, split, i)[0])
                for i in range(m)]

    def _logs(self):
        last = self._meshes[-1]
        return tf.nest.map_structure(
            lambda t: placement.relayout(
                t, layout_lib.replicated_spec(t.shape.rank), last),
            self._model.get_metrics_result())

    def _schedule_for(self, m):
        """The schedule of a batch of m micro-batches (an epoch's smaller
        last batch may have fewer than the model's)."""
        full = self._model.schedule
        if m == full.num_microbatches:
            return full
        if full.virtual_stages > 1 and m % full.num_stages:
            # Interleaved 1F1B needs p | m; looped GPipe runs any m and the
            # step's result does not depend on the order.
            return schedules_lib.gpipe(full.num_stages, m, full.virtual_stages)
        if full.name in ZERO_BUBBLE:  # same order, fewer micro-batches
            return schedules_lib.zero_bubble(full.name, full.num_stages, m,
                                             check=False)
        return schedules_lib.get_schedule(full.name, full.num_stages, m,
                                          full.virtual_stages)

    def _train(self, xs, targets, split):
        m = tf.nest.flatten(xs)[0].shape[0]
        size = tf.nest.flatten(xs)[0].shape[1]
        schedule = self._schedule_for(m)
        weights = self._model._stage_weights  # noqa: SLF001
        # Keyed by (k, i): model part k, micro-batch i.
        activations = {}   # inputs of part k
        gradients = {}     # gradients of part k's outputs
        extras = {}        # additional losses so far (stop-grad)
        tapes = {}         # (tape, watched inputs, targets)
        pending = {}       # W still owed: layers' outputs and their grads
        sums = [[None] * len(w) for w in weights]
        # Per stage (device): zeros computed from its last action.
        tokens = [None] * schedule.num_stages
        scale = 1.0 / m
        for action in schedule.execution_order():
            k, i, kind = schedule.part(action), action.microbatch, action.kind
            # The scope names the action's ops (profiler.executed_timeline).
            with self._on_stage(k), \
                    tf.name_scope(f"{_ACTION_SCOPE}{k}{kind}{i}"):
                if kind == FORWARD:
                    done = self._train_forward(
                        k, i, xs, targets, split, size, scale, activations,
                        extras, tapes, tokens[action.stage],
                        schedule.split_backward)
                elif kind == BACKWARD:
                    done = self._train_backward(
                        k, i, split, weights[k], sums, gradients, tapes,
                        tokens[action.stage], pending)
                else:
                    done = self._train_weights(
                        k, sums, pending.pop((k, i)), tokens[action.stage])
                tokens[action.stage] = _token(done, size)
        for s, optimizer in enumerate(self._model.stage_optimizers):
            grads = [tf.zeros_like(w) if g is None else g
                     for g, w in zip(sums[s], weights[s])]
            with self._on_stage(s):
                optimizer.apply(grads, weights[s])
        with self._on_stage(len(self._stages) - 1):
            return self._logs()

    @contextlib.contextmanager
    def _on_stage(self, s):
        """Code traced in this context runs on part s's mesh: ops with no
        DTensor input (constants) are placed there, and so are tfpar's own
        relayouts inside layers (`extended.placement_mesh`)."""
        mesh = self._meshes[s]
        with dtensor.default_mesh(mesh.dtensor_mesh), \
                self._extended.placing_on(mesh):
            yield

    def _train_forward(self, s, i, xs, targets, split, size, scale,
                       activations, extras, tapes, token, split_backward):
        p = len(self._stages)
        if s == 0:
            values = tf.nest.flatten(self._microbatch(xs, i, 0, split))
            extra_in = []
        else:
            values = activations.pop((s, i))
            extra_in = extras.pop((s, i))
        values = _after(values, token)
        # Stage 0 reads data (no gradient); integer inputs have none either.
        watched = [v if s and v.dtype.is_floating else None for v in values]
        # Split backwards run two gradient calls on the tape (B, then W).
        layer_outputs = {} if split_backward else None
        with tf.GradientTape(watch_accessed_variables=True,
                             persistent=split_backward) as tape:
            tape.watch([v for v in watched if v is not None])
            guests = self._guest_weights(s, watch=tape.watch)
            outputs, own_loss = self._run_stage(s, values, training=True,
                                                layer_outputs=layer_outputs,
                                                guests=guests)
            if s == p - 1:
                y, sample_weight = self._microbatch(targets, i, -1, split)
                y_pred = self._y_pred(outputs)
                loss = self._last_stage_loss(
                    y_pred, y, sample_weight,
                    [own_loss] + [tf.stop_gradient(e) for e in extra_in])
                objective = self._model.optimizer.scale_loss(loss * scale)
            elif own_loss is not None:
                objective = own_loss * scale
            else:
                objective = None
        tapes[(s, i)] = (tape, watched, outputs, objective, layer_outputs,
                         guests)
        if s == p - 1:
            self._update_metrics(size, y_pred, y, sample_weight, loss)
            return [loss]
        carried = extra_in + ([own_loss] if own_loss is not None else [])
        activations[(s + 1, i)] = [self._move(v, s, s + 1, split)
                                   for v in outputs]
        extras[(s + 1, i)] = [self._move(e, s, s + 1, split)
                              for e in carried]
        return outputs

    def _train_backward(self, s, i, split, weights, sums, gradients, tapes,
                        token, pending):
        p = len(self._stages)
        (tape, watched, outputs, objective, layer_outputs,
         guests) = tapes.pop((s, i))
        if s == p - 1:
            targets, seeds = [objective], _after([tf.ones_like(objective)],
                                                 token)
        else:
            incoming = _after(gradients.pop((s, i)), token)
            pairs = [(o, g) for o, g in zip(outputs, incoming)
                     if g is not None]
            targets = [o for o, _ in pairs]
            seeds = [g for _, g in pairs]
            if objective is not None:
                targets.append(objective)
                seeds.append(tf.ones_like(objective))
        sources = [v for v in watched if v is not None]
        tied = [w for w, _ in guests]   # read here, updated on their stage
        if layer_outputs is None:
            own = list(weights) + [value for _, value in guests]  # B and W
        else:
            # B of a split backward: the outputs of layers called once with
            # weights of their own stand in for those weights; W
            # (`_train_weights`) finishes from their gradients.
            uses = {}
            for key, calls in layer_outputs.items():
                for w in split_lib.weights_of(self._layer(key), trainable=True):
                    uses[id(w)] = uses.get(id(w), 0) + len(calls)
            layers = [key for key, calls in layer_outputs.items()
                      if all(uses[id(w)] == 1 for w in split_lib.weights_of(
                          self._layer(key), trainable=True))]
            own = [y for key in layers for y in layer_outputs[key][0]]
            # The rest: W takes them from the stage's whole product.
            simple = {id(w) for key in layers
                      for w in split_lib.weights_of(self._layer(key),
                                                    trainable=True)}
            tangled = [w for w in weights if id(w) not in simple]
            wholes = tangled + [value for _, value in guests]
        # d(targets · seeds)/d(inputs, own): the vector-Jacobian product.
        # Unconnected: None (a weight keeps no gradient, so a tied sparse
        # embedding is not made dense by a zero); inputs' are zeros.
        grads = tape.gradient(
            targets, sources + _tensors(own), output_gradients=seeds)
        input_grads = iter(tf.zeros_like(v) if g is None else g
                           for v, g in zip(sources, grads))
        if layer_outputs is None:
            for w, g in zip(list(weights) + tied, grads[len(sources):]):
                self._add_gradient(sums, s, w, g)
        else:
            owed = iter(grads[len(sources):])
            products = []
            for key in layers:
                own = split_lib.weights_of(self._layer(key), trainable=True)
                outs = layer_outputs[key][0]
                seeds_of = [next(owed) for _ in outs]
                products.append((own, own, outs, [
                    tf.zeros_like(y) if g is None else g
                    for y, g in zip(outs, seeds_of)]))
            if wholes:
                products.append((tangled + tied, wholes, targets, seeds))
            pending[(s, i)] = (tape, products)
        if s > 0:
            # One gradient per output of stage s-1 (None for integers).
            gradients[(s - 1, i)] = [
                None if v is None else
                self._move(next(input_grads), s, s - 1, split)
                for v in watched]
        return [g.values if isinstance(g, tf.IndexedSlices) else g
                for g in grads if g is not None]

    def _layer(self, key):
        return self._layers_by_id[key]

    def _train_weights(self, s, sums, owed, token):
        """W of a split backward: each layer's weight gradients, the
        vector-Jacobian product of its own outputs with their gradients
        from B (dL/dw = (dy/dw)^T dL/dy); weights read by several calls
        and tied weights, the product of the stage's targets with their
        seeds."""
        tape, products = owed
        done = []
        for weights, sources, outputs, seeds in products:
            grads = tape.gradient(
                outputs, _tensors(sources),
                output_gradients=_after(seeds, token))
            for w, g in zip(weights, grads):
                if g is not None:  # unconnected
                    self._add_gradient(sums, s, w, g)
                    done.append(g.values if isinstance(g, tf.IndexedSlices)
                                else g)
        return done

    def _add_gradient(self, sums, s, weight, gradient):
        """Adds part s's gradient of `weight` to the sum of the part that
        updates it: a tied weight's gradient goes back to its home part, so
        one optimizer step sees the sum over every stage that reads it."""
        if gradient is None:  # unconnected
            return
        k, j = self._home[id(weight)]
        if k != s:
            gradient = self._move_like(tf.convert_to_tensor(gradient), s, k,
                                       self._tied_specs[id(weight)])
        sums[k][j] = _accumulate(sums[k][j], gradient)


_ACTION_SCOPE = profiler.ACTION_SCOPE  # names each action's ops


def _tensors(sources):
    """Gradient sources with TF dtypes: a Keras weight's tf.Variable (the
    tape's zeros for an unconnected Keras weight fail on its string
    dtype), tensors as they are."""
    return [_compat.backing_variable(v) if hasattr(v, "path") else v
            for v in sources]



def _inseparable_message(schedule, layers, why):
    return (
        f"schedule={schedule!r} splits each backward into input and weight "
        "gradients, the weight gradients of a layer computed from its "
        f"outputs' gradients alone; layer(s) {layers} {why}, so their "
        "weight gradients do not flow through their outputs only and cannot "
        "be separated. Received: schedule="
        f"{schedule!r}. Use schedule='1f1b' or 'gpipe', or remove those "
        "losses.")


def _check_separable(model, schedule):
    """Weight regularisers add a loss read from the weights directly (not
    through the layer's outputs): a split backward would miss it."""
    owner = {}  # regularised weight -> its innermost layer
    for layer in _compat.all_layers(model):  # outermost first
        if getattr(layer, "activity_regularizer", None) is not None:
            owner[id(layer)] = layer.name
        for w in layer.trainable_weights:
            if getattr(w, "regularizer", None) is not None:
                owner[id(w)] = layer.name
    regularized = list(dict.fromkeys(owner.values()))
    if regularized:
        raise ValueError(_inseparable_message(
            schedule, regularized, "have weight or activity regularizers"))


def _accumulate(total, gradient):
    """Sum of micro-batch gradients. Sparse ones (embedding lookups) stay
    sparse: their rows are concatenated in micro-batch order, which is
    exactly the IndexedSlices the whole batch gives on one device (Keras'
    optimizers treat sparse and dense gradients differently)."""
    if total is None:
        return gradient
    if isinstance(total, tf.IndexedSlices) and isinstance(
            gradient, tf.IndexedSlices):
        return tf.IndexedSlices(
            tf.concat([total.values, gradient.values], 0),
            tf.concat([total.indices, gradient.indices], 0),
            total.dense_shape)
    return tf.convert_to_tensor(total) + tf.convert_to_tensor(gradient)


# DTensor's graph lowering keeps only data dependencies between stateless
# ops (control dependencies are dropped), so a stage's actions are chained
# by data: each action yields a zero "token" computed from its results, and
# the next action on that stage adds the token to its inputs. Adding zeros
# changes no value; the executor cannot start the action before the
# previous one produced its results.

def _token(tensors, rows):
    """Zeros that depend on `tensors`. From a tensor with `rows` (micro-batch)
    rows: one zero per row, split like the batch (no communication);
    otherwise a scalar (e.g. from a loss or a weight gradient)."""
    tensors = [t for t in tensors if t is not None and t.dtype.is_floating]
    if not tensors:
        return None
    batched = [t for t in tensors if t.shape.rank and t.shape[0] == rows]
    source = min(batched or tensors,
                 key=lambda t: t.shape.num_elements() or 0)
    if batched and source.shape.rank > 1:
        source = source[..., :1]  # one column: the batch split stays local
    # min(|t|, 0) is 0 but, unlike t * 0 or zeros_like(t), is not folded
    # away by TF's graph optimiser, so the dependency survives.
    zeros = tf.cast(tf.minimum(tf.abs(source), 0), tf.float32)
    axes = list(range(1 if batched else 0, source.shape.rank))
    return tf.reduce_sum(zeros, axis=axes) if axes else zeros


def _after(values, token):
    """`values` plus zero from `token`: they exist only after the token."""
    if token is None:
        return values
    out = []
    for v in values:
        if v is None or v.dtype == tf.bool:
            out.append(v)
            continue
        t = token
        if t.shape.rank and not (v.shape.rank and v.shape[0] == t.shape[0]):
            t = tf.reduce_sum(t)  # a value without the batch dimension
        if t.shape.rank:
            t = tf.reshape(t, [-1] + [1] * (v.shape.rank - 1))
        out.append(v + tf.cast(t, v.dtype))
    return out


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


def _x_of(batch):
    """The inputs of a batch, as host arrays (Keras' predict loop hands
    over batches its iterator already placed on the whole mesh)."""
    x, _, _ = keras.utils.unpack_x_y_sample_weight(batch)
    return tf.nest.map_structure(placement.fetch, x)


def _device_range(mesh):
    from tfpar.mesh import _device_range as device_range  # noqa: PLC0415

    return device_range(mesh.devices)


def _measured_layer_times(model, extended, batch_size=32, repeats=3):
    """Seconds per layer of one forward on `batch_size` zeros (the best of
    `repeats` eager runs on the mesh the weights were created on)."""
    nodes, layers, inputs, _, _ = split_lib.model_graph(model)
    mesh = extended.placement_mesh  # None: the weights are on the host
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
