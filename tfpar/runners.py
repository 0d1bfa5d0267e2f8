"""The one table of step runners: which `tfpar.training.Runner` runs a
model's Keras step (train, test or predict) under a `ParallelStrategy`.

A runner is chosen by two things:

- the kind of step the model needs (`step_kind`): "plain", the SPMD step
  on the whole mesh (any Keras model); "pipeline", the one-program step
  of a `StagedModel` (`tfpar.PipelineModel`) over its stage meshes;
  "cross_host", that model's host-driven step when its stages live on
  different hosts (`tfpar.pipeline.cross_host.spans_hosts`);
- whether its optimizer's update runs on the host devices: training under
  `offload="optimizer"` or `"optimizer+master"` (`tfpar.offload`);
  evaluate and predict have no update and run the plain row.

`RUNNERS` maps (kind, offload) to the class; this module is the only place
that picks one. The strategy asks it (`ParallelExtended.make_runner`),
for `fit` (`tfpar.training.make_function`) and for a `PipelineModel`'s
eager calls alike; nothing below the strategy imports it.

>>> RUNNERS["pipeline", True].__name__
'OffloadPipelineRunner'
>>> make_runner(model, strategy.extended, "train")  # doctest: +SKIP
"""

from tfpar import training
from tfpar.offload import runners as offload_runners
from tfpar.pipeline import cross_host
from tfpar.pipeline import runner as pipeline_runner

# (kind, offload) -> Runner class. A "plain" class is made as
# cls(model, extended, mode), the others as cls(pipeline, mode) (a
# pipeline knows its strategy).
RUNNERS = {
    ("plain", False): training.StepRunner,
    ("plain", True): offload_runners.OffloadRunner,
    ("pipeline", False): pipeline_runner.PipelineRunner,
    ("pipeline", True): offload_runners.OffloadPipelineRunner,
    ("cross_host", False): cross_host.CrossHostRunner,
    ("cross_host", True): offload_runners.OffloadCrossHostRunner,
}


def step_kind(model, extended):
    """"plain", "pipeline" or "cross_host" (see the module): the step
    `model` runs on the mesh of `extended`. A plain model on a mesh with a
    pipeline axis is refused (it needs stages)."""
    if isinstance(model, training.StagedModel):
        return "cross_host" if cross_host.spans_hosts(extended) else "pipeline"
    if len(extended.stage_meshes) > 1:
        raise ValueError(
            f"The mesh has a pipeline axis {extended.pipeline_axis!r} of size "
            f"{len(extended.stage_meshes)}, so a model needs stages to run "
            f"on it. Received: model {model.name!r} of type "
            f"{type(model).__name__}. Wrap it in the scope: "
            "`model = tfpar.PipelineModel(model, num_microbatches=...)`, "
            "or drop the pipeline axis from the mesh."
        )
    return "plain"


def runner_class(model, extended, mode):
    """The `RUNNERS` entry of `model`'s Keras step `mode`."""
    offload = mode == "train" and extended.dims.offload is not None
    return RUNNERS[step_kind(model, extended), offload]


def make_runner(model, extended, mode):
    """The `Runner` of `model`'s Keras step `mode` ("train", "test",
    "predict") under the strategy of `extended` (`runner_class`'s)."""
    cls = runner_class(model, extended, mode)
    if isinstance(model, training.StagedModel):
        return cls(model, mode)
    return cls(model, extended, mode)
