"""The pipeline's step: a loop over the schedule's actions.

`PipelineRunner` is the pipeline case of `tfpar.training.Runner` (which
compiles the step and assembles predictions for both cases). On the host it
cuts a global batch of B samples into m micro-batches of B/m (`Microbatching`)
and places them on the first part's mesh (inputs) and the last part's
(targets). Traced, one training step is one `tf.function`:

- for each action of the schedule (`tfpar.pipeline.Schedule`, plain data) in
  its execution order, the action's `ModelPart` runs F (`forward`), B
  (`backward`, or `backward_input` when the schedule splits backwards) or W
  (`backward_weight`) for its micro-batch;
- after F the outputs are sent to the next part and after B the input
  gradients to the previous one (`_send_forward`, `_send_backward`: the
  stage-to-stage moves of `tfpar.collectives`);
- each action starts after the previous action of its stage (an ordering
  token, `tfpar.pipeline.ordering`): a stage's actions run in the schedule's
  order, different stages concurrently wherever the data flow allows;
- each micro-batch loss is scaled by 1/m, so the summed weight gradients
  are those of the mean loss over the whole batch: the step equals the
  full-batch step (gradient accumulation). Then the gradients of weights
  tied across stages are summed between the stages holding them
  (`tfpar.pipeline.tied`), and every part applies its optimizer to its
  weights (and its copies of tied weights).

Evaluate and predict run the parts forward, micro-batch by micro-batch.

Example (what `fit` builds; see `tfpar.PipelineModel`):

>>> runner = PipelineRunner(pipe, "train")   # doctest: +SKIP
>>> runner.run([(x, y)])                     # doctest: +SKIP
"""

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import _compat
from tfpar import collectives
from tfpar import keras_graph
from tfpar import layout as layout_lib
from tfpar import placement
from tfpar import training
from tfpar.pipeline import loss_scale
from tfpar.pipeline import ordering
from tfpar.pipeline import profiler
from tfpar.pipeline import schedules as schedules_lib
from tfpar.pipeline.schedules import BACKWARD, FORWARD, ZERO_BUBBLE

_ACTION_SCOPE = profiler.ACTION_SCOPE  # names each action's ops


class Microbatching:
    """How a batch of `size` samples is cut into micro-batches.

    The first training batch of `fit` (or `train_on_batch`) must split into
    m micro-batches, each split over the data axis; a smaller batch after it
    (an epoch's last) and any evaluate/predict batch use the most
    micro-batches that divide it (the step's result does not depend on m).
    """

    def __init__(self, num_microbatches, data_axis, data_size):
        self.num_microbatches = num_microbatches
        self._data_axis, self._data_size = data_axis, data_size
        self._expect_full_batch = True

    def expect_full_batch(self):
        """The next training batch is a first one (`fit` starts)."""
        self._expect_full_batch = True

    def split(self, size, training):
        """(m, whether each micro-batch is split over the data axis)."""
        m, d = self.num_microbatches, self._data_size
        if size % (m * d) == 0:
            counts = m, True
        elif training and self._expect_full_batch:
            raise ValueError(
                f"The global batch size {size} is not divisible by "
                f"num_microbatches ({m}) × the data axis {self._data_axis!r} "
                f"({d}) = {m * d}. Received: batch_size={size}. Use a batch "
                f"size that is a multiple of {m * d}, or change "
                "num_microbatches.")
        else:
            k = max(k for k in range(1, m + 1) if size % k == 0)
            counts = k, (size // k) % d == 0
        if training:
            self._expect_full_batch = False
        return counts


def _check_no_load_balance(extended):
    """Raises if the strategy's context axis is load balanced: a pipeline
    places its micro-batches in natural order (it does not reorder them as
    `tfpar.inputs.InputPlacer` does), while attention would mask by the
    balanced order, so the result would be silently wrong."""
    split = getattr(extended.input_placer, "context", None)
    if split is not None and split.load_balance:
        raise ValueError(
            "A PipelineModel cannot train with the causal load balance of "
            f"the context axis {split.axis!r} (size {split.size}): its "
            "stages take micro-batches in natural order. Received: "
            "tfpar.context_parallel.load_balance(strategy) on mesh "
            f"{extended.mesh!r}. Call load_balance(strategy, enabled=False) "
            "(the context split itself works in pipeline stages).")


def check_context_with_fsdp(extended):
    """Raises if the strategy splits weights over data × context (fsdp
    with a context axis): a pipeline stage's step then does not compile on
    DTensor 2.21 ("'tf.Sum' op CopyToMeshOp must be used to send data
    across mesh"; `tests/test_context_more.py` pins it with the data axis
    first; with the pipe axis first it compiled alone and failed after
    other context tests in one process), where either split alone
    works."""
    split = extended.input_placer.context
    if split is None or not extended.dims.fsdp:
        return
    raise ValueError(
        "A PipelineModel cannot train with fsdp=True beside the context "
        f"axis {split.axis!r} (size {split.size}): DTensor 2.21 does not "
        "compile a stage whose weights are split over data and context "
        f"together. Received: fsdp=True on mesh {extended.mesh!r}. Use "
        "fsdp=False (the context split works in pipeline stages), or drop "
        "the context axis.")


def extra_losses(own_loss, carried):
    """The losses the last part's loss adds to Keras' compiled one: its
    layers' own (with their gradients) and the values of those `carried`
    from the earlier parts (in training their gradients are those parts'
    own: `part_objective`)."""
    return [own_loss] + [tf.stop_gradient(loss) for loss in carried]


def part_objective(part, own_loss, scale):
    """The objective of a part before the last: the losses its layers
    added (add_loss, regularizers) times the micro-batch's share `scale`,
    loss-scaled by the part's optimizer as the last part's objective is (a
    `LossScaleOptimizer` unscales its gradients); None without such
    losses."""
    return None if own_loss is None else part.optimizer.scale_loss(
        own_loss * scale)


class PipelineRunner(training.Runner):
    """Runs train/test/predict steps of a `PipelineModel` (see module doc)."""

    eager_training_error = (
        "compile(run_eagerly=True) cannot train a PipelineModel: "
        "DTensor has no eager gradients. Received: run_eagerly=True. "
        "Compile with run_eagerly=False (the default).")

    def __init__(self, pipeline, mode):
        extended = pipeline.distribute_strategy.extended
        _check_no_load_balance(extended)
        check_context_with_fsdp(extended)
        super().__init__(pipeline, extended, mode)
        self._parts = pipeline.parts
        self._ties = pipeline.ties
        self._meshes = [part.mesh for part in self._parts]
        self._data_axis = extended.data_axis
        self._context = extended.input_placer.context  # or None
        with extended.registry.placing_on(self._meshes[-1]):
            extended.registry.adopt_state_variables(pipeline)
        self._functions = {}

    # -- host side ---------------------------------------------------------

    def run_steps(self, host_batches):
        outputs = None
        for batch in host_batches:
            outputs = self._run_batch(batch)
        return outputs

    def predict_batch(self, batch):
        return self.predict_inputs(_x_of(batch))

    def _place(self, structure, part, m, split):
        """Host tensors of B samples as DTensors (m, B/m, ...) on part
        `part`'s mesh, each micro-batch split over the data axis when
        `split` and its sequence over the context axis
        (`collectives.sequence_split`)."""
        mesh = self._meshes[part]

        def put(t):
            if t is None:
                return None
            array = np.asarray(t)
            array = array.reshape((m, array.shape[0] // m) + array.shape[1:])
            return placement.put(array, (None, *collectives.microbatch_spec(
                array.shape[1:], split, mesh, self._data_axis,
                self._context)), mesh)

        return tf.nest.map_structure(put, structure)

    def _arguments(self, batch):
        """(xs, targets, split) of the step on host `batch` (`_place`)."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
        size = int(np.shape(tf.nest.flatten(x)[0])[0])
        training_step = self._mode == "train"
        m, split = self._model.microbatching.split(size, training_step)
        if training_step:
            self._model.sync_stage_optimizers()
        return (self._place(x, 0, m, split),
                self._place((y, sample_weight), -1, m, split), split)

    def traced_step(self, host_batch):
        """Runs a step on `host_batch` as `fit` does; its concrete function
        (`tfpar.reports.pipeline_memory` reads its programs, one per stage)."""
        self._run_batch(host_batch)
        return self._function("train").get_concrete_function(
            *self._arguments(host_batch))

    def _run_batch(self, batch):
        xs, targets, split = self._arguments(batch)
        function = self._function(self._mode)
        if not (self._mode == "train" and self._model.record_timeline):
            return function(xs, targets, split)
        with profiler.OpEvents(self._meshes) as trace:
            logs = function(xs, targets, split)
            _wait_for_every_part(self._parts)
        self._model.last_timeline = profiler.executed_timeline(
            trace.events, len(self._extended.stage_meshes),
            self._model.schedule.stage_and_chunk)
        return logs

    def predict_inputs(self, x):
        """The model's outputs on inputs `x` (host tensors), as host
        arrays."""
        size = int(np.shape(tf.nest.flatten(x)[0])[0])
        m, split = self._model.microbatching.split(size, training=False)
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
            self._functions[mode] = self.compiled(
                step, reduce_retracing=mode == "train")
        return self._functions[mode]

    # -- traced: moves between parts ------------------------------------------

    def _send(self, tensor, source, target, split):
        """`tensor` moved from part `source` to part `target`, with its
        Keras mask (`Embedding(mask_zero=True)` and the layers after it):
        a layer that reads its inputs' masks rather than a mask argument
        (MultiHeadAttention) sees them on the next part as on one device."""
        sent = collectives.send_activation(tensor, source, target,
                                           self._meshes, split,
                                           self._data_axis, self._context)
        mask = _compat.keras_mask(tensor)
        if mask is not None:
            _compat.set_keras_mask(sent, collectives.send_activation(
                mask, source, target, self._meshes, split, self._data_axis,
                self._context))
        return sent

    def _send_forward(self, k, i, outputs, losses, split):
        """Part k's outputs of micro-batch i, and the losses so far, to
        part k+1."""
        self._parts[k + 1].receive(
            i, [self._send(v, k, k + 1, split) for v in outputs],
            [self._send(e, k, k + 1, split) for e in losses])

    def _send_backward(self, k, i, gradients, split):
        """The gradients of part k's inputs of micro-batch i to part k-1,
        one per output of part k-1 (None for integers)."""
        self._parts[k - 1].receive_gradients(i, [
            None if g is None else self._send(g, k, k - 1, split)
            for g in gradients])

    def _microbatch(self, structure, i, part, split):
        """Micro-batch i of stacked (m, B/m, ...) inputs on part `part`,
        laid out like every activation (batch split over the data axis when
        `split`). tf.gather, not t[i]: DTensor mis-lays out a strided slice
        dropping the leading dimension; the explicit layout keeps DTensor
        from propagating a consumer's layout into the gather."""
        mesh, axis, context = (self._meshes[part], self._data_axis,
                               self._context)
        return tf.nest.map_structure(
            lambda t: None if t is None else placement.relayout(tf.gather(
                t, i), collectives.microbatch_spec(
                    t.shape[1:], split, mesh, axis, context), mesh),
            structure)

    # -- traced: the last part's loss and metrics --------------------------------

    def _loss(self, y_pred, y, sample_weight, extra):
        """Keras' compiled loss of one micro-batch plus `extra` (the
        regularisation losses of all parts), as `compute_loss` adds them."""
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

    def _y_pred(self, values):
        return keras_graph.model_output_structure(self._model.wrapped, values)

    def _update_metrics(self, rows, y_pred, y, sample_weight, loss):
        model = self._model
        model._loss_tracker.update_state(loss, sample_weight=rows)  # noqa: SLF001
        if model._compile_metrics is not None:  # noqa: SLF001
            model._compile_metrics.update_state(y, y_pred, sample_weight)  # noqa: SLF001

    def _logs(self):
        last = self._meshes[-1]
        return tf.nest.map_structure(
            lambda t: placement.relayout(
                t, layout_lib.replicated_spec(t.shape.rank), last),
            self._model.get_metrics_result())

    # -- traced: evaluate and predict ---------------------------------------------

    def _forward_only(self, xs, split, i):
        """Outputs of the last part for micro-batch i, and the other parts'
        additional losses moved to the last part."""
        values = tf.nest.flatten(self._microbatch(xs, i, 0, split))
        extra = []
        for k, part in enumerate(self._parts):
            if k:
                values = [self._send(v, k - 1, k, split) for v in values]
                extra = [self._send(e, k - 1, k, split) for e in extra]
            with part.on_mesh():
                values, loss = part.run(values, training=False)
            if loss is not None:
                extra.append(loss)
        return values, extra

    def _test(self, xs, targets, split):
        m, rows = tf.nest.flatten(xs)[0].shape[:2]
        for i in range(m):
            values, extra = self._forward_only(xs, split, i)
            with self._parts[-1].on_mesh():
                y, sample_weight = self._microbatch(targets, i, -1, split)
                y_pred = self._y_pred(values)
                loss = self._loss(y_pred, y, sample_weight, extra)
                self._update_metrics(rows, y_pred, y, sample_weight, loss)
        with self._parts[-1].on_mesh():
            return self._logs()

    def _predict(self, xs, targets, split):
        m = tf.nest.flatten(xs)[0].shape[0]
        return [self._y_pred(self._forward_only(xs, split, i)[0])
                for i in range(m)]

    # -- traced: training, a loop over the schedule's actions ---------------------

    def _schedule_for(self, m):
        return schedule_for(self._model.schedule, m)

    def _train(self, xs, targets, split):
        m, rows = tf.nest.flatten(xs)[0].shape[:2]
        schedule = self._schedule_for(m)
        batch = _Batch(xs, targets, split, rows, 1.0 / m,
                       schedule.split_backward)
        for part in self._parts:
            part.start_step()
        # Per stage (device): zeros computed from its last action.
        tokens = [None] * schedule.num_stages
        for action in schedule.execution_order():
            part = self._parts[schedule.part(action)]
            run = (self._forward if action.kind == FORWARD else
                   self._backward if action.kind == BACKWARD else
                   self._weight_backward)
            # The scope names the action's ops (profiler.executed_timeline).
            with part.on_mesh(), tf.name_scope(
                    f"{_ACTION_SCOPE}{part.index}{action.kind}"
                    f"{action.microbatch}"):
                done = run(part, action.microbatch, batch,
                           tokens[action.stage])
            tokens[action.stage] = ordering.token_of(done, rows)
        self._model.stage_optimizers  # noqa: B018 (each part's, built)
        self._ties.exchange()  # tied weights' gradients summed between stages
        # Under loss scaling: every part skips an overflowing step together.
        loss_scale.skip_together(self._parts, self._model.optimizer)
        for part in self._parts:
            part.apply_gradients()
        with self._parts[-1].on_mesh():
            return self._logs()

    def _forward(self, part, i, batch, token):
        """F: part runs micro-batch i; its outputs go to the next part (the
        last part's loss and metrics instead)."""
        if part.index == 0:
            values = tf.nest.flatten(self._microbatch(batch.xs, i, 0,
                                                      batch.split))
            carried = []
        else:
            values, carried = part.received(i)
        values = ordering.after(values, token)
        last = part.index == len(self._parts) - 1
        seen = {}

        def objective_of(outputs, own_loss):
            if not last:
                return part_objective(part, own_loss, batch.scale), None
            y, sample_weight = self._microbatch(batch.targets, i, -1,
                                                batch.split)
            y_pred = self._y_pred(outputs)
            loss = self._loss(y_pred, y, sample_weight,
                              extra_losses(own_loss, carried))
            seen["metrics"] = (y_pred, y, sample_weight, loss)
            return self._model.optimizer.scale_loss(loss * batch.scale), loss

        outputs, own_loss, loss = part.forward(i, values, objective_of,
                                               batch.split_backward)
        if last:
            self._update_metrics(batch.rows, *seen["metrics"])
            return [loss]
        carried = carried + ([own_loss] if own_loss is not None else [])
        self._send_forward(part.index, i, outputs, carried, batch.split)
        return outputs

    def _backward(self, part, i, batch, token):
        """B: the part's backward (its input half when split); the input
        gradients go to the previous part."""
        backward = part.backward_input if batch.split_backward else \
            part.backward
        gradients, done = backward(i, token)
        if part.index > 0:
            self._send_backward(part.index, i, gradients, batch.split)
        return done

    def _weight_backward(self, part, i, batch, token):
        """W: the weight half of a split backward."""
        del batch
        return part.backward_weight(i, token)


def schedule_for(full, m):
    """The schedule of a batch of m micro-batches of a pipeline whose full
    batches run schedule `full` (an epoch's smaller last batch may have
    fewer micro-batches than the model's)."""
    if m == full.num_microbatches:
        return full
    if full.name == "zbv":  # same V, fewer micro-batches
        return schedules_lib.zero_bubble_v(full.num_stages, m, check=False)
    if full.virtual_stages > 1 and m % full.num_stages:
        # Interleaved 1F1B needs p | m; looped GPipe runs any m and the
        # step's result does not depend on the order.
        return schedules_lib.gpipe(full.num_stages, m, full.virtual_stages)
    if full.name in ZERO_BUBBLE:  # same order, fewer micro-batches
        return schedules_lib.zero_bubble(full.name, full.num_stages, m,
                                         check=False)
    return schedules_lib.get_schedule(full.name, full.num_stages, m,
                                      full.virtual_stages)


class _Batch:
    """The stacked micro-batches of one traced training step."""

    def __init__(self, xs, targets, split, rows, scale, split_backward):
        self.xs, self.targets, self.split = xs, targets, split
        self.rows, self.scale = rows, scale  # samples per micro-batch, 1/m
        self.split_backward = split_backward


def _wait_for_every_part(parts):
    """Returns when every device has run its share of the step. The logs
    alone do not wait for it: they need only the forward passes, and a
    stage's last backward and update (not an input of the loss) can still
    be running on its devices when they are ready — then the profiler
    stopped without its ops (the first part's last backward missing from
    the timeline, now and then). A read of a weight on every device of each
    part runs after the step there."""
    for part in parts:
        for weight in part.weights[:1]:
            value = tf.convert_to_tensor(weight)
            for block in (dtensor.unpack(value) if dtensor.is_dtensor(value)
                          else [value]):
                block.numpy()


def _x_of(batch):
    """The inputs of a batch, as host arrays (Keras' predict loop hands
    over batches its iterator already placed on the whole mesh)."""
    x, _, _ = keras.utils.unpack_x_y_sample_weight(batch)
    return tf.nest.map_structure(placement.fetch, x)
