"""Memory you can check: what each device holds during a training step.

`memory_report(model, x, y)` compiles and runs one training step exactly as
`fit` does (see `tfpar.communication_report`), reads the per-device program
DTensor expanded it into and, per device, adds up (bytes):

- `params`: trainable weights as stored (fsdp: the device's blocks);
- `gradients`: the gradients the optimizer receives, laid out like the
  stored weights (fsdp: reduce-scattered blocks), so equal to `params`;
  the whole gradients that exist before a reduce-scatter are in `peak`;
- `optimizer`: optimizer slots (Adam's moments; laid out like their weight);
- `other`: every other variable (BatchNormalization statistics, counters,
  metrics);
- `activations`: forward tensors computed from the batch that the backward
  pass reads (`CommunicationReport.saved_activation_bytes`);
- `gathered`: weights all-gathered in the forward pass (fsdp) that the
  backward pass reads, i.e. held whole between the passes (0 with
  `reshard_after_forward=True` or in recomputed layers);
- `peak`: the most bytes live at once: the variables above and the
  device's block of the batch plus the program's tensors, each live from the op that makes it to the last op
  that reads it (views such as reshapes share their input's buffer;
  variable reads share the variable's), each op run as soon as its inputs
  are ready, as TF's executor does (first ready, first run).

Under `offload="optimizer"` (`tfpar.offload`) the devices' rows hold no
optimizer state and their step no update; the host devices that hold the
state have rows too: the weights' copy, the gradients moved there and the
state, `peak` their sum (the update's temporaries not counted), no
activations.

The peak is what the program needs if no kernel reuses an input's buffer
for its output (constants not counted) and ops run in that order; TF's
executor runs ready ops on several threads, so its order, and its peak,
can differ a little. On a GPU, `tf.config.experimental.
get_memory_info(device)["peak"]` after a step would cross-check it (not
available on the virtual CPUs this was tested on).

Example:

>>> import keras, numpy as np, tfpar
>>> tfpar.use_virtual_cpus(8)
>>> strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}), fsdp=True,
...                                   reshard_after_forward=True)
>>> with strategy.scope():
...     model = keras.Sequential([keras.Input((16,)),
...         keras.layers.Dense(64, activation="relu", name="up"),
...         keras.layers.Dense(16, name="down")])
...     model.compile(optimizer="adam", loss="mse")
>>> x = np.ones((16, 16), "float32")
>>> report = tfpar.memory_report(model, x, x)
>>> report[strategy.mesh.devices[0]]["gathered"]   # freed after forward
0
>>> print(report)          # one row per device, then the layers
"""

import collections

import numpy as np
import tensorflow as tf

from tfpar import communication
from tfpar import training

KINDS = ("params", "gradients", "optimizer", "other", "activations",
         "gathered", "peak")
# Producers whose outputs need no buffer of their own in the step.
_NO_BUFFER = {"ReadVariableOp", "Const", "VarHandleOp", "_Arg", "NoOp",
              "AssignVariableOp", "AssignAddVariableOp",
              "AssignSubVariableOp"}


class MemoryReport(dict):
    """{device name: {kind: bytes}} of one training step (see the module).

    Attributes:
        by_layer: {layer scope: {"activations": bytes, "gathered": bytes}}
            per device, from the names of the saved tensors' ops.
        live: bytes of the step's tensors live after each op, in the order
            the analysis ran them (variables not included).
        communication: the `tfpar.CommunicationReport` of the same program
            (its collectives, e.g. the all-gathers).
        function_name: the expanded function the figures come from.
    """

    def __init__(self, per_device, by_layer, live, communication_report,
                 function_name):
        super().__init__(per_device)
        self.by_layer = dict(by_layer)
        self.live = list(live)
        self.communication = communication_report
        self.function_name = function_name

    def __str__(self):
        mb = lambda n: f"{n / 2**20:10.3f}"  # noqa: E731
        rows = [f"{'device (MiB)':44s}" + "".join(f"{k:>11s}" for k in KINDS)]
        for device, kinds in self.items():
            rows.append(f"{device:44s}" + "".join(
                " " + mb(kinds[k]) for k in KINDS))
        if self.by_layer:
            rows.append(f"{'layer (MiB per device)':44s}"
                        f"{'activations':>11s}{'gathered':>11s}")
            for layer, kinds in sorted(self.by_layer.items()):
                rows.append(f"{layer[:44]:44s} {mb(kinds['activations'])} "
                            f"{mb(kinds['gathered'])}")
        return "\n".join(rows)

    def plot(self, path):
        """Saves a PNG: bytes by kind per device, and the live bytes of the
        step's tensors over its ops (needs matplotlib)."""
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
            from matplotlib.figure import Figure  # noqa: PLC0415
        except ImportError as error:
            raise ImportError(
                "MemoryReport.plot (memory_report(path=...)) needs "
                "matplotlib: pip install matplotlib.") from error
        figure = Figure(figsize=(10, 4))
        FigureCanvasAgg(figure)
        bars, line = figure.subplots(1, 2)
        devices = list(self)
        bottom = [0.0] * len(devices)
        for kind in KINDS[:-1]:
            heights = [self[d][kind] / 2**20 for d in devices]
            bars.bar(range(len(devices)), heights, bottom=bottom, label=kind)
            bottom = [b + h for b, h in zip(bottom, heights)]
        bars.plot(range(len(devices)), [self[d]["peak"] / 2**20
                                        for d in devices], "k_", ms=20,
                  label="peak")
        bars.set_xticks(range(len(devices)),
                        [d.split("/")[-1] for d in devices], rotation=90)
        bars.set_ylabel("MiB per device")
        bars.legend(fontsize="small")
        line.plot([b / 2**20 for b in self.live])
        line.set_xlabel("op (program order)")
        line.set_ylabel("MiB of live tensors")
        figure.tight_layout()
        figure.savefig(path, format="png")


def memory_report(model, x, y=None, sample_weight=None, path=None):
    """Per-device memory of one training step of a model under a
    `tfpar.ParallelStrategy` (see the module docstring for each kind).

    Compiles and runs one step on the global batch `(x, y)` as `fit` does,
    then puts every variable back. `path` also saves `report.plot(path)`.

    Returns:
        A `MemoryReport`: {device name: {"params", "gradients",
        "optimizer", "other", "activations", "gathered", "peak": bytes}}.
    """
    if isinstance(model, training.StagedModel):
        raise ValueError(
            f"memory_report reads one SPMD program, and {model.name!r} is a "
            "tfpar.PipelineModel, whose step spans one program per stage. "
            "Received: a PipelineModel. Use strategy.memory_per_device() "
            "for its variables, or report the unwrapped model on a mesh "
            "without a pipeline axis.")
    program = communication.keras_program(model, x, y, sample_weight,
                                          "memory_report")
    strategy = model.distribute_strategy
    backward = program.backward_nodes()
    collectives = program.report()
    saved = collectives.saved_activations
    gathered = _saved_gathered(program, backward)
    live = _live_bytes(program)
    transient = max(live, default=0)
    by_layer = collections.defaultdict(lambda: {"activations": 0,
                                                "gathered": 0})
    for kind, tensors in (("activations", saved), ("gathered", gathered)):
        for name, (shape, dtype) in tensors.items():
            by_layer[_layer_scope(name)][kind] += communication._nbytes(  # noqa: SLF001
                shape, dtype)
    activations = sum(v["activations"] for v in by_layer.values())
    gathered_bytes = sum(v["gathered"] for v in by_layer.values())
    # The step's batch blocks, live for the whole step.
    data = [v for v in (x, y, sample_weight) if v is not None]
    batch = sum(tf.convert_to_tensor(t).dtype.size * int(np.prod(np.shape(t)))
                for t in tf.nest.flatten(data)) // strategy.data_parallel_size
    per_device = {}
    mesh_devices = set(strategy.mesh.devices)
    for device, held in strategy.memory_per_device().items():
        if device not in mesh_devices:  # offload's host devices
            per_device[device] = _host_update_memory(held)
            continue
        resident = (held["params"] + held["optimizer"] + held["other"]
                    + batch)
        per_device[device] = {
            "params": held["params"], "gradients": held["params"],
            "optimizer": held["optimizer"], "other": held["other"],
            "activations": activations, "gathered": gathered_bytes,
            "peak": resident + transient}
    report = MemoryReport(per_device, by_layer, live, collectives,
                          program.name)
    if path is not None:
        report.plot(path)
    return report


def _host_update_memory(held):
    """A host device of `offload="optimizer"` (`tfpar.offload`): the
    weights' copy, the gradients moved there (laid out like the weights)
    and the optimizer state, all live in its update (whose temporaries are
    not counted); no activations, no gathered weights."""
    return {"params": held["params"], "gradients": held["params"],
            "optimizer": held["optimizer"], "other": held["other"],
            "activations": 0, "gathered": 0,
            "peak": 2 * held["params"] + held["optimizer"] + held["other"]}


def _layer_scope(tensor_name):
    """"gpt_1/b0_up_1/MatMul:0" -> "gpt_1/b0_up_1" (the op's name scope)."""
    return tensor_name.split(":")[0].rsplit("/", 1)[0]


def _saved_gathered(program, backward):
    """{node output: (shape, dtype)} of forward tensors made from weights by
    an all-gather (not from the batch) that backward ops read."""
    gathers = [key for key in program.order
               if program.nodes[key].op in communication._KINDS  # noqa: SLF001
               and program._purpose(  # noqa: SLF001
                   key, communication._KINDS[program.nodes[key].op])  # noqa: SLF001
               == "all-gather"]
    from_batch = program.batch_dependent_nodes()
    derived = (set(gathers) | program._downstream(gathers)) - backward - from_batch  # noqa: SLF001
    saved = {}
    for key in program.order:
        if key not in backward:
            continue
        for ref in program.nodes[key].input:
            if ref.startswith("^"):
                continue
            hit = program.producer(key, ref)
            hit = hit and program._owner(*hit)  # noqa: SLF001
            if hit is None or hit[0] not in derived:
                continue
            size = _output_size(program.nodes[hit[0]], hit[1])
            if size is not None:
                saved[f"{hit[0][1]}:{hit[1]}"] = size
    return saved


def _output_size(node, index):
    """(shape, dtype) of output `index` of `node`, None if unknown."""
    shapes = communication._output_shapes(node)  # noqa: SLF001
    dtype = communication._output_dtype(node, index)  # noqa: SLF001
    if index >= len(shapes) or shapes[index] is None or dtype is None:
        return None
    if dtype.name in ("resource", "variant"):
        return None
    return shapes[index], dtype


def _live_bytes(program):
    """Bytes of live tensors after each op of `program`, each op run as
    soon as its inputs (data and control) are ready, first ready first
    run; a buffer lives from its producer to its last reader
    (readers of its views included)."""
    position = {key: i for i, key in enumerate(program.order)}
    waits = {key: 0 for key in program.order}
    users = collections.defaultdict(list)  # producer -> dependent ops
    reads = collections.defaultdict(set)   # buffer owner -> reader ops
    for key in program.order:
        node = program.nodes[key]
        producers = set()
        for ref in node.input:
            name = ref.lstrip("^").split(":")[0]
            if (key[0], name) in program.nodes:
                producers.add((key[0], name))
            if ref.startswith("^"):
                continue
            hit = program.producer(key, ref)
            owner = hit and program._owner(*hit)  # noqa: SLF001
            if owner is not None:
                reads[owner].add(key)
        for producer in producers:
            users[producer].append(key)
        waits[key] = len(producers)
    # Run order: as TF's executor, each op as soon as its inputs are ready
    # (first ready, first run; program order among ops ready together).
    ready = collections.deque(k for k in program.order if waits[k] == 0)
    step = {}
    while ready:
        key = ready.popleft()
        step[key] = len(step)
        for user in sorted(users[key], key=position.get):
            waits[user] -= 1
            if waits[user] == 0:
                ready.append(user)
    delta = [0] * (len(step) + 1)
    for key, node in program.nodes.items():
        if key not in step or node.op in _NO_BUFFER or node.op in communication._ALIASES:  # noqa: SLF001
            continue
        for index in range(len(communication._output_shapes(node))):  # noqa: SLF001
            size = _output_size(node, index)
            if size is None:
                continue
            nbytes = communication._nbytes(*size)  # noqa: SLF001
            end = max((step[r] for r in reads.get((key, index), ())
                       if r in step), default=step[key])
            delta[step[key]] += nbytes
            delta[end + 1] -= nbytes
    live, total = [], 0
    for change in delta[:-1]:
        total += change
        live.append(total)
    return live
