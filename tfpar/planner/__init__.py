"""Automatic parallel plans: `tfpar.plan(model, global_batch_size)`.

One module per responsibility: `cluster` (the hardware in numbers),
`profile` (weights, FLOPs and activations from the model's shapes),
`cost` (memory by kind, collectives, α-β step time), `search` (mesh
shapes, layouts, stage cuts, micro-batches, fsdp, recomputation),
`plans` (`plan`, the search's entry point), `hardware` and `roofline`
(vendor figures; the per-op cost model of `estimator`'s `tfpar.estimate`), `result` (the `Plan` it
returns: explain, save/load, strategy, apply) and `measure` (timing
candidates on this machine).
"""

from tfpar.planner.cluster import Cluster
from tfpar.planner.estimator import estimate
from tfpar.planner.plans import plan
from tfpar.planner.result import Plan

__all__ = ["Cluster", "Plan", "estimate", "plan"]
