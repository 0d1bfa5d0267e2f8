"""A model part: one chunk of layers on one stage's mesh, with its state.

`tfpar.PipelineModel` cuts a model into parts (`tfpar.pipeline.split`): one
per stage, or v per stage when interleaved (part k on stage k mod p). A
`ModelPart` owns what PyTorch `pipelining`'s stage owns: its layers and
their weights, its mesh, its optimizer, and per micro-batch in flight the
forward's tape and the values the backward needs. It runs

- `forward(i, ...)`: its layers on micro-batch i under a `GradientTape`;
- `backward(i, token)`: the vector-Jacobian product of its outputs with the
  gradients arriving from the next part (`receive_gradients`), giving its
  inputs' gradients (what the previous part waits for) and adding its
  weights' gradients to the step's sums;
- the zero-bubble split of that backward (`backward_input`, then later
  `backward_weight`): two products over the one forward (a persistent
  tape). `backward_input` gives the inputs' gradients and those of the
  outputs of every layer called once; `backward_weight` the weight
  gradients of such a layer from its own outputs' gradients alone,
  dL/dw_l = (dy_l/dw_l)^T dL/dy_l (no backward through the part again).
  Weights the part reads in several calls (a layer called twice, a weight
  shared by two layers) and tied weights get theirs from the part's whole
  product (a call's output may depend on the weight through an earlier
  call, which the per-layer product would count twice).

A layer of an earlier part that this part calls again (a tied output head)
is a guest: `tfpar.pipeline.tied.TiedWeights` says where its weights are
read (a persistent copy on this part's stage, held in `copies` and updated
by this part's optimizer) and where their gradients go, so every copy
applies the one gradient summed over every part that reads them.

Example (the parts of a pipeline, see `tfpar.PipelineModel`):

>>> [(part.index, part.mesh.devices[0]) for part in pipe.parts]
... # doctest: +SKIP
[(0, 'CPU:0'), (1, 'CPU:4')]
"""

import contextlib
import dataclasses

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import _compat
from tfpar import collectives
from tfpar import keras_graph
from tfpar import recompute
from tfpar.pipeline import ordering
from tfpar.pipeline import split as split_lib
from tfpar.pipeline.tied import accumulate


@dataclasses.dataclass
class _InFlight:
    """What the backward of one micro-batch needs from its forward."""

    tape: tf.GradientTape
    watched: list         # inputs (None: no gradient, e.g. data, integers)
    outputs: list
    objective: object     # the part's scaled loss, or None
    layer_outputs: dict   # split backward: id(layer) -> outputs per call
    guests: list          # (tied weight, its value read here)


class ModelPart:
    """Part `layers.index` of a pipeline: its `graph` (the `split.Part`:
    layers, the nodes it runs, the tensors it receives and sends) on
    `mesh`, their trainable `weights`, its `optimizer` (set by the
    `PipelineModel`) and its micro-batches in flight."""

    def __init__(self, layers, mesh, extended, model):
        self.graph = layers
        self.index = layers.index
        self.mesh = mesh
        # Its layers' trainable weights, each once, but those an earlier
        # part holds (tied: read here, updated there).
        tied = {id(w) for w in layers.shared}
        self.weights = list({
            id(w): w for layer in layers.layers
            for w in split_lib.weights_of(layer, trainable=True)
            if id(w) not in tied}.values())
        self.copies = []        # persistent copies of tied weights held here
        self.optimizer = None
        self.ties = None        # TiedWeights, set when all parts exist
        self._extended = extended
        self._model = model     # the PipelineModel: losses of its layers
        self._received = {}     # micro-batch -> (activations, losses so far)
        self._output_gradients = {}
        self._in_flight = {}
        self._owed = {}         # micro-batch -> W products still owed
        self.gradient_sums = []

    @property
    def layers(self):
        return self.graph.layers

    @property
    def updated(self):
        """What the part's optimizer updates: its weights, then the
        persistent copies of tied weights it holds."""
        return self.weights + self.copies

    @contextlib.contextmanager
    def on_mesh(self):
        """Code traced in this context runs on the part's mesh: ops with no
        DTensor input (constants) are placed there, and so are tfpar's own
        relayouts inside layers (`extended.registry.placement_mesh`)."""
        with dtensor.default_mesh(self.mesh.dtensor_mesh), \
                self._extended.registry.placing_on(self.mesh):
            yield

    # -- per step ------------------------------------------------------------

    def start_step(self):
        """Empties the gradient sums (one per `updated` variable, None:
        none)."""
        self.gradient_sums = [None] * len(self.updated)

    def receive(self, i, activations, losses):
        """Micro-batch i's inputs from the previous part, and the losses of
        earlier parts (carried to the last part, without gradient)."""
        self._received[i] = (activations, losses)

    def received(self, i):
        return self._received.pop(i)

    def receive_gradients(self, i, gradients):
        """The gradients of micro-batch i's outputs, from the next part."""
        self._output_gradients[i] = gradients

    def add_gradient(self, j, gradient):
        """Adds a micro-batch's `gradient` of `updated[j]` to the step's
        sum, in the weight's dtype: under offload="optimizer+master" the
        devices hold the weight in its compute dtype and its gradient comes
        in that dtype; the sum is float32, as the gradient of a float32
        weight's cast is (`tfpar.offload.master`)."""
        dtype = tf.as_dtype(self.updated[j].dtype)
        if isinstance(gradient, tf.IndexedSlices):
            gradient = tf.IndexedSlices(tf.cast(gradient.values, dtype),
                                        gradient.indices,
                                        gradient.dense_shape)
        elif gradient.dtype != dtype:
            gradient = tf.cast(gradient, dtype)
        self.gradient_sums[j] = accumulate(self.gradient_sums[j], gradient)

    def apply_gradients(self):
        """One optimizer step on the summed gradients (zeros for a weight
        no micro-batch reached)."""
        grads = [tf.zeros_like(w) if g is None else g
                 for g, w in zip(self.gradient_sums, self.updated)]
        with self.on_mesh():
            self.optimizer.apply(grads, self.updated)

    # -- running the layers ----------------------------------------------------

    def run(self, values, training, layer_outputs=None, guests=()):
        """Runs the part on its input tensors; (outputs, its own losses).
        With a dict `layer_outputs`, also records there, per layer with
        trainable weights (by id), the floating outputs of each call.
        `guests`: (weight, value) pairs read instead of those weights of
        earlier parts (`TiedWeights.values_on`)."""
        graph = self.graph
        tensors = {id(k): v for k, v in zip(graph.inputs, values)}
        guests = list(guests) or self.ties.values_on(self)
        with keras_graph.reading_values(guests, [
                v for layer in graph.layers
                for v in getattr(layer, "variables", [])]):
            self._run_nodes(tensors, training, layer_outputs)
            # Read inside the block: with guests, added losses are its.
            losses = [self._model._aggregate_additional_loss(loss)  # noqa: SLF001
                      for layer in graph.layers
                      for loss in getattr(layer, "losses", [])]
        outputs = [tensors[id(k)] for k in graph.outputs]
        if losses and layer_outputs is not None:
            raise ValueError(inseparable_message(
                self._model.schedule.name,
                [layer.name for layer in graph.layers
                 if getattr(layer, "losses", [])], "add losses in call()"))
        return outputs, (tf.add_n(losses) if losses else None)

    def _run_nodes(self, tensors, training, layer_outputs):
        """Runs the part's nodes (`run`); under `set_recompute(model,
        "full")` its whole blocks each as one recomputed call
        (`recompute.spans_in`), except when recording `layer_outputs`."""
        graph = self.graph
        spans = (recompute.spans_in(self._model.wrapped, graph.nodes,
                                    graph.outputs)
                 if layer_outputs is None else ())
        if spans:
            recompute.run_graph(
                graph.nodes, spans, tensors,
                lambda node, values: node.run(values, training))
            return
        for node in graph.nodes:
            node.run(tensors, training)
            if layer_outputs is not None and \
                    node.operation not in graph.guests and \
                    split_lib.weights_of(node.operation, trainable=True):
                layer_outputs.setdefault(id(node.operation), []).append(
                    [v for v in (tensors[id(k)] for k in node.outputs)
                     if v.dtype.is_floating])

    def forward(self, i, values, objective_of, split_backward):
        """F(k, i): runs micro-batch i under a tape kept for its backward.

        `objective_of(outputs, own_loss)` gives (the scaled objective whose
        gradient the backward takes, or None; the loss to report, or None).
        Returns (outputs, own loss, reported loss)."""
        # Part 0 reads data (no gradient); integer inputs have none either.
        watched = [v if self.index and v.dtype.is_floating else None
                   for v in values]
        # Split backwards run two gradient calls on the tape (B, then W).
        layer_outputs = {} if split_backward else None
        with tf.GradientTape(watch_accessed_variables=True,
                             persistent=split_backward) as tape:
            tape.watch([v for v in watched if v is not None])
            guests = self.ties.values_on(self, watch=tape.watch)
            outputs, own_loss = self.run(values, True, layer_outputs, guests)
            objective, loss = objective_of(outputs, own_loss)
        self._in_flight[i] = _InFlight(tape, watched, outputs, objective,
                                       layer_outputs, guests)
        return outputs, own_loss, loss

    # -- backward ----------------------------------------------------------------

    def _targets_and_seeds(self, i, flight, token):
        """The product's targets and their gradients: the objective (seed
        1) and the outputs whose gradients arrived from the next part."""
        targets, seeds = [], []
        if i in self._output_gradients:
            incoming = ordering.after(self._output_gradients.pop(i), token)
            pairs = [(o, g) for o, g in zip(flight.outputs, incoming)
                     if g is not None]
            targets, seeds = [o for o, _ in pairs], [g for _, g in pairs]
            token = None
        if flight.objective is not None:
            targets.append(flight.objective)
            seeds += ordering.after([tf.ones_like(flight.objective)], token)
        return targets, seeds

    def _input_gradients(self, flight, grads):
        """One gradient per input (None for data and integers; zeros for an
        unconnected one)."""
        sources = [v for v in flight.watched if v is not None]
        given = iter(tf.zeros_like(v) if g is None else g
                     for v, g in zip(sources, grads))
        return [None if v is None else next(given) for v in flight.watched]

    def backward(self, i, token):
        """B(k, i) whole: input and weight gradients in one product.
        Returns (the inputs' gradients, the tensors computed)."""
        flight = self._in_flight.pop(i)
        targets, seeds = self._targets_and_seeds(i, flight, token)
        sources = [v for v in flight.watched if v is not None]
        trained = _trained(flight.guests)
        tied = [w for w, _ in trained]  # updated on their home part
        own = self.weights + [value for _, value in trained]
        # d(targets · seeds)/d(inputs, own): the vector-Jacobian product.
        # Unconnected: None (a weight keeps no gradient, so a tied sparse
        # embedding is not made dense by a zero); inputs' are zeros.
        grads = flight.tape.gradient(targets, sources + _tensors(own),
                                     output_gradients=seeds)
        for w, g in zip(self.weights + tied, grads[len(sources):]):
            self.ties.add_gradient(self, w, g)
        return self._input_gradients(flight, grads), _computed(grads)

    def _separable_layers(self, layer_outputs):
        """Layers (by id) whose weights only their own calls read once."""
        uses = {}
        for key, calls in layer_outputs.items():
            for w in self._weights_of(key):
                uses[id(w)] = uses.get(id(w), 0) + len(calls)
        return [key for key, calls in layer_outputs.items()
                if all(uses[id(w)] == 1 for w in self._weights_of(key))]

    def _weights_of(self, key):
        """The weights of layer `key` that this part updates (not the tied
        weights it shares with an earlier part)."""
        layer = next(x for x in self.layers if id(x) == key)
        mine = {id(w) for w in self.weights}
        return [w for w in split_lib.weights_of(layer, trainable=True)
                if id(w) in mine]

    def backward_input(self, i, token):
        """B(k, i) of a split backward: the gradients of the inputs and of
        the outputs of separable layers (which stand in for their weights);
        `backward_weight` finishes from them. Returns (the inputs'
        gradients, the tensors computed)."""
        flight = self._in_flight.pop(i)
        targets, seeds = self._targets_and_seeds(i, flight, token)
        sources = [v for v in flight.watched if v is not None]
        layers = self._separable_layers(flight.layer_outputs)
        outs = [y for key in layers for y in flight.layer_outputs[key][0]]
        grads = flight.tape.gradient(targets, sources + _tensors(outs),
                                     output_gradients=seeds)
        owed = iter(grads[len(sources):])
        products = []
        for key in layers:
            calls = flight.layer_outputs[key][0]
            weights = self._weights_of(key)
            products.append((weights, weights, calls, [
                tf.zeros_like(y) if g is None else g
                for y, g in zip(calls, [next(owed) for _ in calls])]))
        # The rest: W takes them from the part's whole product.
        simple = {id(w) for key in layers for w in self._weights_of(key)}
        tangled = [w for w in self.weights if id(w) not in simple]
        trained = _trained(flight.guests)
        wholes = tangled + [value for _, value in trained]
        if wholes:
            products.append((tangled + [w for w, _ in trained],
                             wholes, targets, seeds))
        self._owed[i] = (flight.tape, products)
        return self._input_gradients(flight, grads), _computed(grads)

    def backward_weight(self, i, token):
        """W(k, i) of a split backward: each separable layer's weight
        gradients, the vector-Jacobian product of its own outputs with their
        gradients from B (dL/dw = (dy/dw)^T dL/dy); weights read by several
        calls and tied weights, the product of the part's targets with
        their seeds. Returns the gradients computed."""
        tape, products = self._owed.pop(i)
        done = []
        for weights, sources, outputs, seeds in products:
            grads = tape.gradient(
                outputs, _tensors(sources),
                output_gradients=ordering.after(seeds, token))
            for w, g in zip(weights, grads):
                self.ties.add_gradient(self, w, g)
            done += _computed(grads)
        return done


def _trained(guests):
    """The (tied weight, value) pairs of `guests` that take a gradient:
    those of trainable weights (frozen ones are only read)."""
    return [(w, value) for w, value in guests if w.trainable]


def _tensors(sources):
    """Gradient sources with TF dtypes: a Keras weight's tf.Variable (the
    tape's zeros for an unconnected Keras weight fail on its string
    dtype), tensors as they are."""
    return [_compat.backing_variable(v) if hasattr(v, "path") else v
            for v in sources]


def _computed(grads):
    """The gradients computed (dense values), for the ordering token."""
    return [g.values if isinstance(g, tf.IndexedSlices) else g
            for g in grads if g is not None]


def inseparable_message(schedule, layers, why):
    return (
        f"schedule={schedule!r} splits each backward into input and weight "
        "gradients, the weight gradients of a layer computed from its "
        f"outputs' gradients alone; layer(s) {layers} {why}, so their "
        "weight gradients do not flow through their outputs only and cannot "
        "be separated. Received: schedule="
        f"{schedule!r}. Use schedule='1f1b' or 'gpipe', or remove those "
        "losses.")
