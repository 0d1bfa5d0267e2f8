"""Optimizer offload (`ParallelStrategy(offload="optimizer")`): the
optimizer's state and its update on host devices, ZeRO-Offload's split.

Its modules: `tfpar.offload.host` (the update and the block moves: imports
neither `tfpar.pipeline` nor `tfpar.training`), `tfpar.offload.master`
(`"optimizer+master"`) and `tfpar.offload.runners` (the runners of the
step below, chosen by the table of step runners, `tfpar.runners`).

A step runs in three parts:

1. the compiled step on the device mesh: Keras' `train_step` (or the
   model's own) computes the loss, metrics and gradients; its call to the
   optimizer only records the gradients (each laid out like its stored
   weight: fsdp's reduce-scattered blocks), which the step returns;
2. each gradient moves to the host mesh block by block (`move_blocks`):
   the component a mesh device holds is copied to its host device
   (`offload_devices[i]` for mesh device i) and the components are packed
   into a DTensor of the same layout on the host mesh — no device and no
   host ever holds more than its own block;
3. a compiled function on the host mesh runs the optimizer's `apply` over
   the host's copy of the weights (`mirror`s, one per trainable weight,
   laid out like it), whose slots were made next to them (a slot follows
   its weight's mesh); each updated weight moves back block by block and
   is assigned to the device weight.

The host copy stays current from the update itself: a step copies each
gradient to the host and each updated weight back, nothing else. A device
weight written by anything else — `set_weights`, `load_weights`,
`restore_checkpoint`, `assign` in a callback or in the step itself — is
copied into its host copy before the next update: every `ShardedVariable`
counts its Python-level assignments (`writes`), and the offload keeps the
count it last saw (`pull_weights`).

Under `mixed_float16` a `LossScaleOptimizer`'s scale and counter live on
the host too (its overflow check is part of the update); the device step
scales the loss by a copy of the scale on the devices (`DeviceLossScale`).

A `PipelineModel` has one optimizer per part (`stage_optimizers`); each
gets its own `Offload` on the host devices of its stage's devices (the
part's `host_mesh`), and the pipeline step — every stage, one program —
returns each part's gradients to its host update (`OffloadPipelineRunner`).

So the devices hold the weights, the gradients and the step's tensors, and
no optimizer slot: per device, `strategy.memory_per_device()` drops by the
slots' bytes (and the optimizer's two scalars, iterations and learning
rate, which live with the slots). The host devices appear in the same
report holding the weights' copy and the slots.

Why not inside one step: DTensor 2.21 cannot `copy_to_mesh` a sharded
value to another mesh (tests/dtensor_offload_repro.py, "copy_sharded");
the route that compiles goes through a replicated value (every device
holding the whole tensor). The eager per-device route above works
("per_device_route" there), so the moves are eager, between compiled
functions, and the host round trip is not overlapped with compute.

On a CPU mesh the devices are the host: DTensor's host mesh is the mesh
itself, and offload needs `offload_devices` naming other (virtual) CPUs.
On this machine those share the devices' physical memory: the tests show
placement and parity, not saved RAM. On GPU/TPU the default host is
DTensor's host mesh (`Mesh.host_mesh()`, CPUs of the mesh's shape).

Across hosts (`tfpar.connect_hosts`) every move stays inside a host: the
mesh and the host mesh are "spread" meshes (the same local devices of
every host, `tfpar.Mesh`), `offload_devices[i]` is on mesh device i's
host, each host moves its own blocks and all hosts run the host update
together (tests/test_offload_hosts.py). A pipeline whose stages live on
different hosts (`tfpar.pipeline.cross_host`: one stage's mesh on one
host, its host mesh on the same host's `offload_devices`) runs each
part's update on its own host (`OffloadCrossHostRunner`): every host runs
every part's moves and host update in the same order, the hosts without
that stage on stand-ins (`move_blocks`), as they run its stage functions.

Example (8 virtual CPUs: the mesh on CPU:0-3, the "host" CPU:4-7):

>>> import keras, numpy as np, tfpar
>>> tfpar.use_virtual_cpus(8)
>>> strategy = tfpar.ParallelStrategy(
...     tfpar.Mesh({"data": 4}, devices=[f"CPU:{i}" for i in range(4)]),
...     offload="optimizer",
...     offload_devices=[f"CPU:{i}" for i in range(4, 8)])
>>> with strategy.scope():
...     model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(16)])
...     model.compile(optimizer="adam", loss="mse")
>>> x = np.ones((64, 16), "float32")
>>> history = model.fit(x, x, batch_size=16, verbose=0)
>>> memory = strategy.memory_per_device()
>>> memory["CPU:0"]["optimizer"], memory["CPU:4"]["optimizer"]  # Adam's m, v
(0, 2176)
"""

from tfpar.offload.host import (  # noqa: F401 (the package's names)
    DeviceLossScale, Offload, attach, host_mesh, move_alike, move_blocks,
    offload_of)
from tfpar.offload.runners import (  # noqa: F401
    OffloadCrossHostRunner, OffloadPipelineRunner, OffloadRunner,
    part_offloads, run_and_update)
