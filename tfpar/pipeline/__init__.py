"""Pipeline parallelism: schedules as plain data, the model split, pictures.

Which stage runs which forward/backward, in what order (`gpipe`,
`one_f_one_b`, the zero-bubble `zero_bubble` and `zero_bubble_v` with
split backwards), a dependency-respecting simulation of the resulting
timeline, its bubble fraction, and text/PNG renderings — all device-free —
plus `split_model` (cutting a Keras graph into parts). The runtime that
executes them on sub-meshes is `tfpar.PipelineModel`
(`tfpar/pipeline/model.py`: the Keras face; `part.py`: a model part with
its forward and backward; `runner.py`: the step, a loop over the
schedule's actions; `ordering.py`: the tokens that keep a stage's actions
in order).

Example:

>>> from tfpar.pipeline import get_schedule, format_timeline
>>> schedule = get_schedule("1f1b", num_stages=4, num_microbatches=8)
>>> timeline = schedule.simulate(forward_time=1.0, backward_time=1.0)
>>> round(schedule.bubble_fraction(), 4)   # (p - 1) / (m + p - 1) = 3 / 11
0.2727
"""

from tfpar.pipeline.schedules import (
    SCHEDULE_NAMES,
    Action,
    Schedule,
    TimelineEntry,
    bubble_fraction,
    get_schedule,
    gpipe,
    one_f_one_b,
    theoretical_bubble_fraction,
    zero_bubble,
    zero_bubble_v,
)
from tfpar.pipeline.timeline import format_timeline, plot_schedule
from tfpar.pipeline.split import Part, Stage, split_model

__all__ = [
    "SCHEDULE_NAMES",
    "Action",
    "Part",
    "Schedule",
    "Stage",
    "TimelineEntry",
    "bubble_fraction",
    "format_timeline",
    "get_schedule",
    "gpipe",
    "one_f_one_b",
    "plot_schedule",
    "split_model",
    "theoretical_bubble_fraction",
    "zero_bubble",
    "zero_bubble_v",
]
