"""The memory report of a `PipelineModel`'s training step
(`tfpar.memory_report(pipeline, x, y)`; the kinds as in
`tfpar.reports.memory`).

A pipeline's step is one `tf.function` over every stage's mesh, which
DTensor expands into one program per stage mesh
(`tfpar.reports.program.programs_for_traced`). Each stage's devices get
their row from their stage's program:

- `params`, `gradients`, `optimizer`, `other`: the variables of the parts
  on the stage as stored (`memory_per_device()`); the gradient sums over
  the micro-batches are laid out like the weights;
- `activations`: the most bytes of saved activations live at once — a
  saved activation is a tensor of a forward action, computed from the
  batch or from what the previous stage sent, that the backward of the
  same micro-batch reads — with the program's ops run in the order of
  `tfpar.reports.buffers.run_order` (a stage's actions are chained by ordering
  tokens in its schedule's order, and a receive waits for its first
  reader). So GPipe, whose forwards all run first, holds all m
  micro-batches' activations; 1F1B on stage s of p at most
  min(p - s, m) micro-batches' (`StageMemory.in_flight`: how many are held
  at that moment, `per_microbatch`: the bytes of one);
- `gathered`: the same for weights all-gathered in forward actions (fsdp:
  once per micro-batch) that backward actions read;
- `peak`: the variables, the batch blocks the stage holds (the stacked
  inputs on the first stage, the targets on the last, each split over the
  data axis) and the most bytes of its program's tensors live at once.

Example (pipe=2 x data=4, 1F1B, 4 micro-batches):

>>> import keras, numpy as np, tfpar
>>> tfpar.use_virtual_cpus(8)
>>> strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 2, "data": 4}))
>>> with strategy.scope():
...     pipe = tfpar.PipelineModel(keras.Sequential([keras.Input((16,)),
...         keras.layers.Dense(32, activation="relu", name="a"),
...         keras.layers.Dense(8, name="b")]), num_microbatches=4,
...         schedule="1f1b")
...     pipe.compile(optimizer="adam", loss="mse")
>>> x = np.ones((32, 16), "float32")
>>> report = tfpar.memory_report(pipe, x, x[:, :8])
>>> [stage.in_flight for stage in report.stages]   # p - s micro-batches
[2, 1]
"""

import collections
import re

from tfpar.pipeline import cross_host
from tfpar.pipeline import profiler
from tfpar.reports import buffers
from tfpar.reports import program as program_lib
from tfpar.reports.communication import program_report

# A forward action's scope: part, micro-batch.
_FORWARD = re.compile(profiler.ACTION_SCOPE + r"(\d+)F(\d+)/")
_BACKWARD = re.compile(profiler.ACTION_SCOPE + r"\d+[BW]\d+/")


class StageMemory(collections.namedtuple("StageMemory", [
        "devices", "function_name", "activations", "gathered", "in_flight",
        "per_microbatch", "live", "communication"])):
    """One stage program's figures (`MemoryReport.stages`): its `devices`
    (short names), `function_name`, per device `activations` and
    `gathered` bytes (at their most), `in_flight` (micro-batches, of any
    part on the stage, whose activations are held at that moment),
    `per_microbatch` (the saved activation bytes of one micro-batch of
    one part, the largest), `live` (bytes of its live tensors after each
    op) and its `communication` report."""


def pipeline_report(model, x, y=None, sample_weight=None):
    """`tfpar.memory_report` of `PipelineModel` `model` (see the module)."""
    extended = model.distribute_strategy.extended
    if cross_host.spans_hosts(extended):
        raise ValueError(
            f"memory_report reads each stage's compiled program, and the "
            f"stages of {model.name!r} live on different hosts (a "
            "host-driven step: one program per action, each on one host). "
            "Received: a PipelineModel across hosts. Use "
            "strategy.memory_per_device() for its variables, or report it "
            "with its stages on one host.")
    programs = program_lib.keras_programs(model, x, y, sample_weight,
                                          "memory_report")
    stage_of = {tuple(mesh.devices): s
                for s, mesh in enumerate(extended.stage_meshes)}
    programs.sort(key=lambda program: stage_of.get(program.devices, 0))
    stages, saved = zip(*map(_stage_memory, programs))
    of_device = {device: stage for stage in stages
                 for device in stage.devices}
    strategy = model.distribute_strategy
    split = strategy.data_parallel_size
    held_batch = collections.Counter()
    for part, data in ((model.parts[0], (x,)),
                       (model.parts[-1], (y, sample_weight))):
        for device in part.mesh.devices:
            held_batch[device] += buffers.batch_bytes(data) // split
    per_device = {}
    for device, held in strategy.memory_per_device().items():
        stage = of_device.get(device)
        if stage is None:  # offload's host devices
            per_device[device] = buffers.host_update_memory(held)
            continue
        per_device[device] = buffers.device_memory(
            held, stage.activations, stage.gathered,
            held_batch[device] + max(stage.live, default=0))
    top = max(stages, key=lambda stage: max(stage.live, default=0))
    by_layer = _by_layer(saved, buffers.LayerPaths(model.wrapped))
    return buffers.MemoryReport(
        per_device, by_layer, top.live, top.communication,
        top.function_name, stages=list(stages))


def _stage_memory(program):
    """The `StageMemory` of one stage's expanded program, and its saved
    tensors ({"activations"/"gathered": {owner: (size, chunk)}})."""
    step = buffers.run_order(program)
    readers = buffers.readers_of(program)
    backward = _backward(program)
    from_batch = _from_batch(program)
    saved = _saved_activations(program, backward, readers, from_batch)
    gathered = {owner: (size, _chunk(owner, readers))
                for owner, size in buffers.saved_gathered(
                    program, backward, from_batch).items()}
    activations, in_flight = _most_live(saved, readers, step)
    per_chunk = collections.Counter()
    for size, chunk in saved.values():
        per_chunk[chunk] += program_lib.nbytes(*size)
    return StageMemory(
        program.devices, program.name, activations,
        _most_live(gathered, readers, step)[0], in_flight,
        max(per_chunk.values(), default=0),
        buffers.live_bytes(program, step), program_report(program)), {
            "activations": saved, "gathered": gathered}


def _backward(program):
    """Keys of the backward actions' nodes, by name: gradient ops (named
    "gradient_tape/<forward action>/...") and the rest of each B and W
    action. (Not `Program.backward_nodes`, everything downstream of a
    gradient: a stage's later forwards wait for its backwards' ordering
    tokens.)"""
    return {key for key in program.order
            if key[1].startswith(program_lib.BACKWARD_MARK)
            or _BACKWARD.search(key[1])}


def _from_batch(program):
    """Keys of the nodes computed from the step's data inputs or from what
    another stage sent (`_HostRecv`)."""
    received = [k for k in program.order
                if program.nodes[k].op == "_HostRecv"]
    return program.batch_dependent_nodes() | program.downstream(received)


def _saved_activations(program, backward, readers, from_batch):
    """{(node key, output index): ((shape, dtype), (part, micro-batch))}
    of the buffers forward actions compute `from_batch` that backward ops
    read."""
    saved = {}
    for owner, reading in readers.items():
        key, index = owner
        node = program.nodes[key]
        if (key in backward or key not in from_batch
                or not _FORWARD.search(key[1])
                or node.op in program_lib.NOT_ACTIVATIONS
                or not reading & backward):
            continue
        size = program_lib.output_size(node, index)
        if size is not None:
            saved[owner] = (size, _chunk(owner, readers))
    return saved


def _chunk(owner, readers):
    """(part, micro-batch) of a saved buffer: of the forward action its
    backward readers differentiate (gradient ops are named after the
    forward op, "gradient_tape/<forward action>/..."), else its own."""
    names = sorted(key[1] for key in readers.get(owner, ())) + [owner[0][1]]
    match = next(m for m in map(_FORWARD.search, names) if m)
    return int(match.group(1)), int(match.group(2))


def _most_live(tensors, readers, step):
    """(most bytes of `tensors` — {owner: ((shape, dtype), chunk)} — live
    at once in the order `step`, how many chunks they belong to then)."""
    events = collections.defaultdict(list)  # step -> [(bytes, chunk)]
    for (key, index), (size, chunk) in tensors.items():
        begin, end = buffers.buffer_interval(readers, step, key, index)
        nbytes = program_lib.nbytes(*size)
        events[begin].append((nbytes, chunk))
        events[end + 1].append((-nbytes, chunk))
    best, chunks_then, total = 0, 0, 0
    live = collections.Counter()
    for moment in sorted(events):
        for nbytes, chunk in events[moment]:
            total += nbytes
            live[chunk] += 1 if nbytes > 0 else -1
        if total > best:
            best = total
            chunks_then = sum(1 for count in live.values() if count > 0)
    return best, chunks_then


def _by_layer(saved, paths):
    """{layer path: {"activations", "gathered": bytes}} of one
    micro-batch (the largest), from every stage's saved tensors (`paths`:
    a `tfpar.reports.buffers.LayerPaths` of the pipelined model)."""
    found = collections.defaultdict(collections.Counter)
    for tensors in (t for stage in saved for t in stage.items()):
        kind, owners = tensors
        for (key, _), (size, chunk) in owners.items():
            layer = paths(_FORWARD.sub("", key[1]))
            found[(layer, kind)][chunk] += program_lib.nbytes(*size)
    by_layer = collections.defaultdict(lambda: {"activations": 0,
                                                "gathered": 0})
    for (layer, kind), per_chunk in found.items():
        by_layer[layer][kind] = max(per_chunk.values())
    return by_layer
