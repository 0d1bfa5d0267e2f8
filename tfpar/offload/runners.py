"""Offload's three runners (`tfpar.offload`): the device step, then each
optimizer's update on its host devices (`tfpar.offload.host.Offload`).

- `OffloadRunner`: a plain model's step (`tfpar.training.StepRunner`);
- `OffloadPipelineRunner`: a `PipelineModel`'s one-program step
  (`tfpar.pipeline.runner.PipelineRunner`), each part's update on the host
  devices of its stage;
- `OffloadCrossHostRunner`: a `PipelineModel` whose stages live on
  different hosts (`tfpar.pipeline.cross_host.CrossHostRunner`).

Each is the training case of its base's row in the table of step runners
(`tfpar.runners.RUNNERS`); evaluate and predict run the bases.
"""

import contextlib
import functools

from tfpar import training
from tfpar.offload import host
from tfpar.pipeline import cross_host
from tfpar.pipeline import runner as pipeline_runner


class OffloadRunner(training.StepRunner):
    """`fit`'s step under offload (see `tfpar.offload`): the device step
    returns its logs and gradients, then `Offload.apply_on_host` updates
    the weights; one step per call (`steps_per_execution` batches run one
    after another: the host round trip sits between steps). Between the
    device step and the update, the weights something else wrote reach
    the host copies (`pull_weights`; none in a plain `fit`)."""

    def __init__(self, model, extended, mode):
        # (Attached at compile already: this finds that `Offload`.)
        self._offload = host.attach(model.optimizer,
                                    extended._container_strategy())  # noqa: SLF001
        super().__init__(model, extended, mode)

    def _in_replica(self, batch):
        with self._offload.capturing() as captured:
            # (The base class named: AutoGraph converts this method, and
            # a zero-argument super() is a closure it cannot convert.)
            logs = training.StepRunner._in_replica(self, batch)
        return logs, self._offload.step_gradients(captured)

    def run_steps(self, host_batches):
        logs = None
        for batch in host_batches:
            logs = self._one(self._placer.place(batch))
        return logs

    def _one(self, placed):
        logs, grads = self._offload.device_step(
            lambda: self._call(self._one_step, placed))
        self._offload.pull_weights()
        self._offload.apply_on_host(grads)
        return logs

    def traced_step(self, host_batch):
        """Runs one step (device step and host update, as `fit`) and returns
        the device step's concrete function (`tfpar.communication`)."""
        placed = self._placer.place(host_batch)
        self._one(placed)
        return self._one_step.get_concrete_function(placed)


class OffloadPipelineRunner(pipeline_runner.PipelineRunner):
    """A `PipelineModel`'s train step under offload: the pipeline step (all
    stages, one program) returns its logs and each part's gradients, which
    its optimizer's `Offload` applies on that part's host devices; each
    part's weights written elsewhere (a tied copy's sync, `set_weights`)
    reach its host copies first (`Offload.pull_weights`)."""

    def _train(self, xs, targets, split):
        offloads = part_offloads(self._model)
        with contextlib.ExitStack() as stack:
            captured = [stack.enter_context(offload.capturing())
                        for offload in offloads]
            logs = pipeline_runner.PipelineRunner._train(self, xs, targets,
                                                         split)
        return logs, [offload.step_gradients(calls) for offload, calls
                      in zip(offloads, captured)]

    def _run_batch(self, batch):
        logs, _ = run_and_update(
            self._model,
            lambda: pipeline_runner.PipelineRunner._run_batch(self, batch))
        return logs


def part_offloads(pipeline):
    """Each part's optimizer's `Offload` (building them on first use)."""
    return [host.offload_of(optimizer)
            for optimizer in pipeline.stage_optimizers]


def run_and_update(pipeline, step):
    """`step()` (a pipeline's device step, returning (anything, each part's
    `step_gradients`)), then each part's host update; returns the step's
    result. The weights the step or anything else wrote reach the host
    copies first (`Offload.device_step`, `Offload.pull_weights`)."""
    offloads = part_offloads(pipeline)
    for offload in offloads:
        step = functools.partial(offload.device_step, step)
    result = step()
    for offload, part_grads in zip(offloads, result[1]):
        offload.pull_weights()
        offload.apply_on_host(part_grads)
    return result


class OffloadCrossHostRunner(cross_host.CrossHostRunner):
    """A `PipelineModel`'s train step under offload when its stages live on
    different hosts (`tfpar.pipeline.cross_host`): after the host-driven
    schedule, each part's "offload" function (on its stage's mesh) hands
    its summed gradients over, laid out like its stored weights, and its
    `Offload` runs the update on its stage's host devices — of its own
    host (`offload_devices`). Every host runs every part's moves and
    update in the same order; on the hosts without that stage they are
    no-ops on stand-ins (`move_blocks`), as the stage's functions are."""

    def _train(self, xs, targets, split, rows):
        def step():
            sums = self._gradient_sums(xs, targets, split, rows)
            return None, [
                self._stage_function("offload", k)(part_sums, factor)
                for k, (part_sums, factor) in enumerate(
                    zip(sums, self._overflow_factors(sums)))]

        run_and_update(self._model, step)

    def _offload_body(self, part, training, sums, factor):
        """Traced: the part's optimizer call records its gradients (the
        `Offload` captures it), which the function returns."""
        offload = host.offload_of(part.optimizer)
        with offload.capturing() as captured:
            self._apply_body(part, training, sums, factor)
        return offload.step_gradients(captured)
