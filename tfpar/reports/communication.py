"""Communication you can check: the collectives of a compiled step.

DTensor turns a step written for global tensors into one per-device SPMD
program and inserts the collectives itself. `communication_report` reads
that program — the function DTensor actually compiled, taken from the
runtime's function library in this process, not re-derived from the model
— and lists every collective with its mesh axes, group size, per-device
shape, dtype and bytes, plus the forward activations the backward pass
keeps, per device.

Bytes, for a collective over a group of n devices (each device's own view):

- all-reduce of a tensor of B bytes (every device contributes and receives
  B): `bytes` = B; a ring all-reduce sends `ring_bytes` = 2(n-1)/n * B per
  device (a reduce-scatter then an all-gather, each (n-1)/n * B).
- all-gather of blocks of B/n bytes into B bytes: `bytes` = B,
  `ring_bytes` = (n-1)/n * B.
- reduce-scatter of B bytes into blocks of B/n: `bytes` = B,
  `ring_bytes` = (n-1)/n * B.
- all-to-all of B bytes: `bytes` = B, `ring_bytes` = (n-1)/n * B (every
  device keeps 1/n and sends the rest).

Megatron-LM's tensor parallelism needs, per transformer layer and step,
2 all-reduces forward and 2 backward of the b*s*h activation
(`megatron_tp_bytes`); tensor-parallel steps compiled by DTensor match it
(tests/test_collectives.py). For sequence parallelism DTensor on TF 2.21
compiles, on CPU (and on GPU without NCCL), an all-gather as an all-reduce
of zero-padded blocks and a reduce-scatter as an all-reduce followed by a
slice. (The environment variable LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2
makes all-gathers real CollectiveGatherV2 ops, but then a relayout that
gathers over two mesh axes at once fails to compile; see
tests/dtensor_sp_collectives_repro.py. tfpar sets it while compiling fsdp
steps on one-axis meshes, where no gather spans two axes, and so does the
report of such a model.) Each report row therefore names both the op that
runs (`kind`) and what DTensor asked for (`purpose`).

The program itself is read by `tfpar.reports.program`; this module turns it
into a `CommunicationReport` (`program_report`).

Example (one Megatron pair: one all-reduce forward; its input is data, so
none backward):

>>> import keras, numpy as np, tfpar
>>> tfpar.use_virtual_cpus(8)
>>> strategy = tfpar.ParallelStrategy(tfpar.Mesh({"model": 8}), rules={
...     r".*up/kernel": (None, "model"), r".*up/bias": ("model",),
...     r".*down/kernel": ("model", None)})
>>> with strategy.scope():
...     model = keras.Sequential([keras.Input((16,)),
...         keras.layers.Dense(64, activation="relu", name="up"),
...         keras.layers.Dense(16, name="down")])
...     model.compile(optimizer="sgd", loss="mse")
>>> x = np.ones((8, 16), "float32")
>>> report = tfpar.communication_report(model, x, x)
>>> report.count(axes=("model",))
1
>>> report.total_bytes()            # the (8, 16) float32 output, once
512
>>> print(report)                   # one row per collective, then totals
"""

import collections
import re

import keras

from tfpar import _compat
from tfpar import experts
from tfpar.reports import program as program_lib

# The name scopes of a dispatching MoE block (`tfpar.experts.moe`) whose
# collectives move tokens or slots (the router's are small reductions).
_EXCHANGE_SCOPES = re.compile(r"/(dispatch|expert_ffn|combine)/")


class CommunicationReport:
    """The collectives and saved activations of one compiled step.

    Attributes:
        collectives: list of `tfpar.reports.program.Collective`, in
            program order.
        saved_activation_bytes: bytes, per device, of the distinct forward
            tensors that backward ops read (what a training step keeps alive
            between its forward and backward passes; weights and inputs
            excluded; views such as reshapes counted once).
        saved_activations: {node name: (per-device shape, dtype)} of them.
        function_name: the expanded function the figures come from.
    """

    def __init__(self, collectives, saved_activations, forward_shapes,
                 function_name):
        self.collectives = list(collectives)
        self.saved_activations = dict(saved_activations)
        self._forward_shapes = forward_shapes
        self.function_name = function_name

    @property
    def saved_activation_bytes(self):
        return sum(program_lib.nbytes(shape, dtype)
                   for shape, dtype in self.saved_activations.values())

    def select(self, kind=None, purpose=None, axes=None, phase=None,
               spans=None):
        """The collectives matching every filter given.

        Args:
            kind: "all-reduce", "all-gather", "reduce-scatter", "all-to-all".
            purpose: what DTensor asked for (see
                `tfpar.reports.program.Collective`).
            axes: exactly these mesh axes, e.g. ("model",).
            spans: a mesh axis the group includes (possibly with others).
            phase: "forward" or "backward".
        """
        if axes is not None:
            axes = tuple(axes)
        return [c for c in self.collectives
                if (kind is None or c.kind == kind)
                and (purpose is None or c.purpose == purpose)
                and (axes is None or c.axes == axes)
                and (spans is None or spans in (c.axes or ()))
                and (phase is None or c.phase == phase)]

    def count(self, **filters):
        """How many collectives match `filters` (see `select`)."""
        return len(self.select(**filters))

    def total_bytes(self, **filters):
        """Sum of `bytes` of the collectives matching `filters`."""
        return sum(c.bytes for c in self.select(**filters))

    def total_ring_bytes(self, **filters):
        """Sum of `ring_bytes` (sent per device) matching `filters`."""
        return sum(c.ring_bytes for c in self.select(**filters))

    def forward_shapes(self, pattern):
        """{node name: per-device shape} of the model's forward ops (those
        computed from the batch; DTensor's own nodes left out) whose name
        matches the regex `pattern` (re.search), e.g. r"b0_ln2_1/"."""
        regex = re.compile(pattern)
        return {name: shape for name, shape in self._forward_shapes.items()
                if regex.search(name)}

    def expert_exchanges(self, axis, tokens, hidden, num_experts, top_k,
                         capacity_factor=None, group_tokens=None,
                         dtype_bytes=4):
        """The collectives over `axis` (the expert axis, or the data axis
        carrying experts) inside dispatching MoE blocks, each next to the
        formula `moe_exchange_bytes(tokens, hidden, num_experts, top_k,
        capacity_factor, group_tokens, dtype_bytes)`, `tokens` being the
        tokens a device holds. `print()` the result for a table.

        >>> ex = report.expert_exchanges("expert", tokens=32, hidden=32,
        ...                              num_experts=8, top_k=2)
        >>> [row.multiplier for row in ex.rows]

        Returns:
            `ExpertExchanges(rows, formula_bytes, formula)`.
        """
        formula = moe_exchange_bytes(tokens, hidden, num_experts, top_k,
                                     capacity_factor, group_tokens,
                                     dtype_bytes)
        rows = [ExpertExchange(c, formula, c.bytes / formula)
                for c in self.select(spans=axis)
                if _EXCHANGE_SCOPES.search(c.name)]
        slots = formula // (dtype_bytes * hidden * top_k)
        spelled = (f"{tokens} tokens x {hidden} hidden x top_k {top_k} x "
                   f"capacity factor {slots / tokens:g}"
                   f"{' (dropless)' if capacity_factor is None else ''} x "
                   f"{dtype_bytes} B = {formula} B per device")
        return ExpertExchanges(rows, formula, spelled)

    def __str__(self):
        rows = [f"{'phase':8s} {'kind':14s} {'purpose':14s} {'axes':10s} "
                f"{'n':>2s} {'shape':18s} {'dtype':8s} {'bytes':>10s} "
                f"{'ring B/dev':>10s}"]
        for c in self.collectives:
            axes = ",".join(c.axes) if c.axes else "?"
            rows.append(
                f"{c.phase:8s} {c.kind:14s} {c.purpose:14s} {axes:10s} "
                f"{c.group_size:2d} {str(list(c.shape)):18s} "
                f"{c.dtype.name:8s} {c.bytes:10d} {c.ring_bytes:10.0f}")
        rows.append(
            f"total: {len(self.collectives)} collectives, "
            f"{self.total_bytes()} bytes, {self.total_ring_bytes():.0f} sent "
            f"per device (ring); saved activations "
            f"{self.saved_activation_bytes} bytes per device")
        return "\n".join(rows)

    def __repr__(self):
        return (f"<CommunicationReport {len(self.collectives)} collectives, "
                f"{self.total_bytes()} bytes>")


ExpertExchange = collections.namedtuple(
    "ExpertExchange", "collective formula_bytes multiplier")
ExpertExchange.__doc__ = """One collective of an MoE block's exchange:
the `Collective`, the formula's bytes (`moe_exchange_bytes`) and
`multiplier` = its bytes / the formula's."""


class ExpertExchanges(collections.namedtuple(
        "ExpertExchanges", "rows formula_bytes formula")):
    """The exchanges of MoE blocks in a compiled step next to the formula
    (`CommunicationReport.expert_exchanges`). What the multiplier means:

    - experts on the data axis (`expert_axis="data"`): forward, two
      exchanges of the dispatched slots per block (to the experts and
      back); DTensor 2.21 compiles each as an all-gather (tfpar keeps its
      all-to-all relayout off), whose message is every device's slots:
      multiplier n, the axis size, where a true all-to-all would send
      (n-1)/n of the formula per device.
    - a separate expert axis: no slot is exchanged (the axis' devices hold
      the same tokens); forward, one all-reduce of the block's output,
      tokens x hidden: multiplier 1 / (top_k x capacity factor); backward,
      the input gradient's all-reduce (same size) and an all-gather of the
      combine weights' gradient [tokens, experts, capacity].
    """

    def __str__(self):
        lines = [f"formula: {self.formula}",
                 f"{'phase':8s} {'purpose':10s} {'shape':20s} "
                 f"{'bytes':>9s} {'x formula':>9s}  scope"]
        for row in self.rows:
            c = row.collective
            scope = _EXCHANGE_SCOPES.search(c.name).group(1)
            lines.append(f"{c.phase:8s} {c.purpose:10s} "
                         f"{str(list(c.shape)):20s} {c.bytes:9d} "
                         f"{row.multiplier:9.3g}  {scope}")
        return "\n".join(lines)


def moe_exchange_bytes(tokens, hidden, num_experts, top_k,
                       capacity_factor=None, group_tokens=None,
                       dtype_bytes=4):
    """Bytes of the dispatched slots of `tokens` tokens (one device's), the
    message one all-to-all of an MoE block moves per device: tokens x
    hidden x top_k x capacity_factor x dtype_bytes, computed exactly as
    groups x experts x capacity x hidden x dtype_bytes (`experts.capacity`:
    the capacity is rounded up; dropless, capacity_factor=None, has a
    slot per expert for each of a group's tokens: an effective factor of
    experts / top_k).

    >>> moe_exchange_bytes(64, 16, num_experts=8, top_k=2,
    ...                    capacity_factor=1.0)
    8192

    Args:
        tokens: tokens per device; group_tokens: tokens of a dispatch
            group (default: `tokens`, one group), a divisor of `tokens`.
    """
    group = tokens if group_tokens is None else group_tokens
    if tokens % group:
        raise ValueError(
            f"moe_exchange_bytes: group_tokens={group_tokens} does not "
            f"divide tokens={tokens}. Pass the sequence length (or the "
            "dispatch_experts group_size).")
    slots = experts.capacity(group, num_experts, top_k, capacity_factor)
    return tokens // group * num_experts * slots * hidden * dtype_bytes


def communication_report(target, *args, **kwargs):
    """Collectives and saved activations of a compiled DTensor step.

    Two forms:

    - `communication_report(model, x, y=None, sample_weight=None)`: a Keras
      model compiled under a `tfpar.ParallelStrategy`. Compiles and runs one
      training step on the global batch `(x, y)` exactly as `fit` builds it
      (`model.train_step` in the strategy's SPMD replica scope), then puts
      every variable it changed back (weights, optimizer state, metrics):
      the model is left as it was. The batch must split over the data axis.
    - `communication_report(function, *args, **kwargs)`: a `tf.function`
      taking DTensors (e.g. a custom loop's step). It is called once.

    Example (see the module docstring for a complete one):

    >>> report = tfpar.communication_report(model, x[:16], y[:16])
    >>> report.count(axes=("model",), phase="backward")
    >>> report.saved_activation_bytes   # per device

    Returns:
        A `CommunicationReport`.
    """
    if hasattr(target, "get_concrete_function"):
        target(*args, **kwargs)
        concrete = target.get_concrete_function(*args, **kwargs)
        return report_for_traced(_compat.traced_function_name(concrete))
    if isinstance(target, keras.Model):
        return program_report(program_lib.keras_program(
            target, *args, caller="communication_report", **kwargs))
    raise TypeError(
        "communication_report needs a Keras model compiled under a "
        "tfpar.ParallelStrategy, or a tf.function. Received: "
        f"{type(target).__name__}. Pass the model (and a batch) or wrap "
        "your step in tf.function."
    )


class capture:  # noqa: N801 (used as a context manager, like a function)
    """Records the DTensor programs compiled inside a `with` block.

    For reading the exact step `fit` compiles (or a custom loop's): every
    traced function that DTensor expands and runs for the first time inside
    the block is recorded.

    Example:

    >>> with tfpar.communication.capture() as programs:
    ...     model.fit(x, y, batch_size=16, epochs=1)
    >>> report = programs.train_report()
    >>> report.count(axes=("model",), phase="forward")
    """

    def __init__(self):
        self._before = None
        self.names = []

    def __enter__(self):
        self._before = set(_compat.runtime_function_names())
        return self

    def __exit__(self, *exc):
        self.names = [
            name for name in _compat.runtime_function_names()
            if name not in self._before and name.startswith("__inference_")
            and "__func_" in name
        ]
        return False

    def reports(self):
        """A `CommunicationReport` per program compiled in the block."""
        return [program_report(program_lib.Program(name))
                for name in self.names]

    def train_report(self):
        """The report of the one compiled program with a backward pass."""
        reports = [r for r in self.reports()
                   if any(c.phase == "backward" for c in r.collectives)
                   or r.saved_activations]
        if len(reports) != 1:
            raise RuntimeError(
                "capture().train_report() needs exactly one training step "
                "compiled inside the block. Received: "
                f"{len(reports)} among {self.names}. Was the step compiled "
                "before the block (then nothing new is compiled), or did "
                "the block train several models?"
            )
        return reports[0]


def megatron_tp_bytes(batch, seq_len, hidden, layers, model_axis,
                      dtype_bytes=4):
    """Megatron-LM's tensor-parallel traffic per step, for comparison.

    Per transformer layer: 2 all-reduces forward (after attention and after
    the MLP) and 2 backward (of their input gradients), each of the b*s*h
    activation. Ring all-reduce: each device sends 2(n-1)/n of it.

    Returns:
        dict(count=4L, bytes=4L*b*s*h*dtype_bytes, ring_bytes=bytes*2(n-1)/n).
    """
    message = batch * seq_len * hidden * dtype_bytes
    count = 4 * layers
    n = model_axis
    return {"count": count, "bytes": count * message,
            "ring_bytes": count * message * 2 * (n - 1) / n}


def report_for_traced(traced_name):
    """The report of the traced function `traced_name`, once DTensor ran it.

    Raises RuntimeError when DTensor has not expanded it (not yet run, or
    not run on a mesh)."""
    return program_report(program_lib.program_for_traced(traced_name))


def program_report(program):
    """The `CommunicationReport` of an expanded `tfpar.reports.program.
    Program`: its collectives, the forward activations its backward pass
    reads, the shapes of its forward ops."""
    backward = program.backward_nodes()
    from_batch = program.batch_dependent_nodes()
    return CommunicationReport(
        program.collectives(backward),
        program.saved_activations(backward, from_batch),
        program.forward_shapes(backward, from_batch), program.name)
