"""Weights tied across pipeline parts: persistent copies (Megatron-LM's).

A layer of an earlier part that a later part calls again (the output head
of a causal LM reusing the input embedding; any shared layer) is a guest
of the later part; its weights are tied, and so is a weight held by
different layers of two parts (`split.Part.shared`, PyTorch-style tying).
The home part (that of its first call, or its first holder) holds and
updates each tied weight. With `mode="persistent"`
(`PipelineModel(tied_weights=...)`'s default), every other stage that
reads it holds a **copy**: a variable on that stage's mesh, laid out as
the weight at home (same spec, so each device holds its block), updated
by that stage's optimizer with its own slots. A step then

1. reads the copy on the later stage (gathered whole over that stage's
   devices, as every guest reads a tied weight: see below) — nothing is
   sent forward;
2. sums the copy's micro-batch gradients on its stage, and at the end of
   the step (`exchange`) sends that sum g_c to the home part, which adds
   it to its own: g = g_home + Σ_c g_c, the gradient one device takes of a
   weight read twice;
3. sends g back to every copy, so the home weight and each copy apply the
   same g with optimizers of the same configuration, step counter
   and (zero-initialised, identically updated) slots, laid out alike:
   elementwise the same floating-point operations, so the copies stay
   bit-equal (tests/test_pipeline_tied.py reads every device's block).

Frozen weights (`frozen_weights`: non-trainable, and no call assigns
them — a backbone frozen by keras-hub's `enable_lora`, the int8 table and
scales of Keras' `quantize`) are read the same way, with no gradient: a
copy that no optimizer updates, filled once and refilled by `sync`.

Two weight-sized moves per step (the copies' summed gradients to the home
part and back), instead of 2m with `mode="per_step"`, where the later
stage holds no copy and receives the weight in every micro-batch forward
(and sends each micro-batch's gradient back): less memory (no copy, no
slots on the later stage), more traffic.

Parts on one stage (interleaved or ZB-V parts, whose meshes are one) read
the home weight itself: no copy, no move.

A guest reads its tied weights whole (replicated over its stage's axes).
Read with the weight's split instead, DTensor (TF 2.21) cannot compile
every head: Llama's untied output head `h @ reverse_embeddings` with the
kernel split over hidden (('model', None), auto_rules' plan) has its
kernel gradient, a batch sum of h^T dy, laid out split over vocab, which
it then cannot re-split over hidden ("EmitAllScatter was passed a
desired_layout ... not more sharded", tests/test_pipeline_nested.py,
llama_gqa on pipe × data × model with Adam). Its gradient is moved laid
out replicated and split as the weight on arrival.

Checkpoints, `get_weights` and `save_weights` see one weight (the copies
are not the model's variables); `set_weights`, `load_weights` and
`tfpar.restore_checkpoint` refill every copy (`sync`).

Example (a model whose layer "shared" is called first and last):

>>> pipe = tfpar.PipelineModel(model, num_microbatches=2,
...                            stage_boundaries=["mid"])  # doctest: +SKIP
>>> [c.variable.path for c in pipe.ties.copies]         # doctest: +SKIP
['tied_copy_on_part_1/shared_kernel', 'tied_copy_on_part_1/shared_bias']
"""

import dataclasses

import keras
import numpy as np
import tensorflow as tf

from tfpar import _compat
from tfpar import collectives
from tfpar import layout as layout_lib
from tfpar import placement
from tfpar.pipeline import split as split_lib

MODES = ("persistent", "per_step")


@dataclasses.dataclass
class TiedCopy:
    """A persistent copy of tied `weight` (updated on part `home`, index
    `index` of its weights) on the mesh of part `holder`, which updates
    `variable` (index `slot` of its `updated` variables). A frozen
    weight's copy (`frozen_weights`) has `index` and `slot` None: no
    optimizer updates it."""

    weight: object
    home: object
    index: int
    holder: object
    slot: int
    variable: object


def check_mode(mode):
    if mode not in MODES:
        raise ValueError(
            f"PipelineModel(tied_weights) must be one of {MODES}: "
            "'persistent' keeps a copy of a weight tied across stages on "
            "each stage that reads it (its gradients summed between them), "
            "'per_step' sends it to the later stage in every micro-batch. "
            f"Received: tied_weights={mode!r}")


def _read_only_weights():
    """{a Keras layer's `call`: the names of the weights it reads and never
    assigns} (Keras 3.15's sources); any such layer's LoRA factors and
    int8/int4 quantization constants too."""
    layers = keras.layers
    kernel = {"kernel", "bias"}
    return {layers.Embedding.call: {"embeddings"},
            layers.ReversibleEmbedding.call: {"embeddings",
                                              "reverse_embeddings"},
            layers.Dense.call: kernel, layers.EinsumDense.call: kernel,
            layers.LayerNormalization.call: {"gamma", "beta"},
            layers.RMSNormalization.call: {"scale"}}


def _never_assigned(weight, layer, read_only):
    """Whether `layer`'s calls never assign `weight`: a weight of its own
    (by name) that its class's `call` only reads (`read_only`:
    `_read_only_weights()`); not under float8, whose calls update their
    scales and amax histories."""
    names = read_only.get(type(layer).call)
    if names is None or getattr(layer, "quantization_mode", None) == "float8":
        return False
    name = weight.path.rsplit("/", 1)[-1]
    return name in names or name in layout_lib.QUANTIZATION_CONSTANTS or (
        name in layout_lib.LORA_FACTORS)


def frozen_weights(parts):
    """{id: index in `parts` of the first part holding it} of the
    non-trainable variables that no call of a layer holding them assigns
    (`_never_assigned`): weights frozen by the user
    (keras-hub's `enable_lora` freezes the backbone) or made by Keras'
    int8/int4 `quantize`. A later stage may read them as tied weights are
    read, with no gradient. Other non-trainable variables are state (a
    BatchNormalization's moving mean, a counter): refused by
    `check_ties`."""
    read_only, holders, first = _read_only_weights(), {}, {}
    for k, part in enumerate(parts):
        for layer in part.layers:
            for w in split_lib.weights_of(layer):
                if not w.trainable:
                    holders.setdefault(id(w), []).append((w, layer))
                    first.setdefault(id(w), k)
    return {key: first[key] for key, held in holders.items()
            if all(_never_assigned(w, layer, read_only)
                   for w, layer in held)}


def check_ties(parts, unit):
    """Raises where a tie cannot be honoured: state (a non-trainable
    variable which calls may update: not one of `frozen_weights`) read on
    two parts (`unit`: "stage" or "part"), through a layer called on both
    or held by layers of both."""
    frozen = frozen_weights(parts)
    for part in parts:
        state = [w for w in part.shared
                 if not w.trainable and id(w) not in frozen]
        if state:
            holders = [layer.name for layer in part.layers if any(
                w is v for w in state for v in split_lib.weights_of(layer))]
            raise ValueError(
                f"Variable(s) {[w.path for w in state]} are held by "
                f"layer(s) {holders} of {unit} {part.index} and by a layer "
                f"of an earlier {unit}, and are state that calls update: a "
                "tie cannot keep state in step on two stages (only "
                f"trainable weights are tied). Keep those layers in one "
                f"{unit} (stage_boundaries).")
        for guest in part.guests:
            state = [v.path for v in getattr(guest, "variables", [])
                     if not v.trainable and id(v) not in frozen]
            if state:
                raise ValueError(
                    f"Layer {guest.name!r} is called on {unit} "
                    f"{part.index} and on an earlier {unit}, and has "
                    f"state {state} that a call updates: a tie cannot "
                    "keep it in step on two stages (only weights are "
                    f"read on the later stage). Keep its calls in one "
                    f"{unit} (stage_boundaries).")


class TiedWeights:
    """The weights of layers that a later part calls again (guests), where
    each is held and how it is read and updated (see the module doc)."""

    def __init__(self, parts, registry, mode="persistent"):
        check_mode(mode)
        self.mode = mode
        self._parts = parts
        self._meshes = [part.mesh for part in parts]
        # Where each weight is updated: (part, index in its weights); a
        # frozen one lives with its first holder: (part, None).
        self._home = {id(w): (part, j) for part in parts
                      for j, w in enumerate(part.weights)}
        frozen = frozen_weights([part.graph for part in parts])
        for key, k in frozen.items():
            self._home.setdefault(key, (parts[k], None))
        self._reads = {id(part): _guest_weights(part.graph, frozen)
                       for part in parts}
        self._specs = {id(w): registry.placement_of(w).spec
                       for part in parts for w in self._reads[id(part)]}
        self.copies = []
        self._copy_of = {}  # (id(weight), id(mesh)) -> TiedCopy
        if mode == "persistent":
            self._make_copies(registry)

    # -- the copies ---------------------------------------------------------

    def _make_copies(self, registry):
        """One copy per tied weight and stage mesh other than its home's,
        held by the first part on that mesh that reads it; the part's
        optimizer updates the copy of a trainable weight (`slot`: its index
        in `part.updated`), none that of a frozen one (`slot` None)."""
        for part in self._parts:
            for w in self._reads[id(part)]:
                home, j = self._home[id(w)]
                key = (id(w), id(part.mesh))
                if part.mesh is home.mesh or key in self._copy_of:
                    continue
                copy = TiedCopy(w, home, j, part,
                                len(part.updated) if w.trainable else None,
                                _new_copy(registry, w, part))
                if w.trainable:
                    part.copies.append(copy.variable)
                self._copy_of[key] = copy
                self.copies.append(copy)

    def copy_state(self):
        """The copies and their optimizer slots (variables that mirror
        others: checkpoints skip them)."""
        state = []
        for copy in self.copies:
            state.append(copy.variable)
            state += [s for _, s in _slot_pairs(copy)]
        return state

    def sync(self, optimizer=True):
        """Eagerly refills each copy (and, with `optimizer`, its slots
        where both optimizers are built) from the weight it mirrors."""
        for copy in self.copies:
            pairs = [(copy.weight, copy.variable)]
            if optimizer:
                pairs += _slot_pairs(copy)
            for source, target in pairs:
                backing = _compat.backing_variable(target)
                place = backing.placement
                # Under "+master" a weight's host value is its float32
                # master (`numpy()`), its tensor the compute-dtype copy.
                dtype = getattr(backing, "master", backing).dtype
                backing.assign(placement.put(
                    _compat.backing_variable(source).numpy(),
                    place.spec, place.mesh, dtype=dtype))

    # -- traced, in a step ----------------------------------------------------

    def values_on(self, part, watch=None):
        """(weight, value on `part`) of its guests' weights, each read whole
        (`watch`ed for its gradient): the persistent copy on this mesh; the
        home weight itself on the home's mesh; else (per_step) the home
        weight moved here."""
        pairs = []
        for w in self._reads[id(part)]:
            home = self._home[id(w)][0]
            copy = self._copy_of.get((id(w), id(part.mesh)))
            if copy is not None:
                value = placement.relayout(
                    tf.convert_to_tensor(copy.variable.value),
                    layout_lib.replicated_spec(len(w.shape)), part.mesh)
            else:
                with home.on_mesh():
                    value = tf.convert_to_tensor(w.value)
                value = collectives.send_tied(
                    value, home.index, part.index, self._meshes,
                    (None,) * len(w.shape), "weight")
            if watch is not None and w.trainable:
                watch(value)
            pairs.append((w, value))
        return pairs

    def add_gradient(self, part, weight, gradient):
        """Adds `part`'s gradient of `weight` to the step's sum of the
        variable that is updated with it: its copy on this mesh, else the
        weight at home (moved there when per_step)."""
        if gradient is None:  # unconnected
            return
        home, j = self._home[id(weight)]
        copy = self._copy_of.get((id(weight), id(part.mesh)))
        if copy is not None:
            copy.holder.add_gradient(copy.slot, gradient)
            return
        if home.mesh is not part.mesh:
            gradient = self._send(gradient, weight, part, home, "grad")
        home.add_gradient(j, gradient)

    def _send(self, gradient, weight, source, target, what):
        """A gradient of `weight` moved from part `source` to `target`:
        dense laid out as the weight; sparse (an embedding lookup's
        IndexedSlices) as its rows and their indices, whole."""
        def move(tensor, spec):
            return collectives.send_tied(tensor, source.index, target.index,
                                         self._meshes, spec, what)

        if isinstance(gradient, tf.IndexedSlices):
            values, indices = gradient.values, gradient.indices
            return tf.IndexedSlices(
                move(values, (None,) * values.shape.rank),
                move(indices, (None,)), gradient.dense_shape)
        return move(tf.convert_to_tensor(gradient), self._specs[id(weight)])

    def trained_copies(self):
        """The copies of each trained tied weight, one list per weight (in
        the order the copies were made: the same on every host); frozen
        weights' copies take no gradient."""
        by_weight = {}
        for copy in self.copies:
            if copy.slot is not None:
                by_weight.setdefault(id(copy.weight), []).append(copy)
        return list(by_weight.values())

    def spec_of(self, weight):
        """The layout spec of tied `weight` at home (and of its copies)."""
        return self._specs[id(weight)]

    def exchange(self):
        """After the step's last backward: each tied weight's gradient summed
        over its home and its copies, g = g_home + Σ_c g_c (each copy's sum
        moved home), then g moved to every copy; home and copies apply that
        one g (sparse when every term is an embedding lookup's rows: a
        sparse update differs from a dense one in Keras' optimizers, and
        one device gives sparse rows then too; dense otherwise)."""
        for copies in self.trained_copies():
            w, home, j = copies[0].weight, copies[0].home, copies[0].index
            total = home.gradient_sums[j]
            for copy in copies:
                g = copy.holder.gradient_sums[copy.slot]
                if g is not None:
                    with home.on_mesh():
                        total = accumulate(total, self._send(
                            g, w, copy.holder, home, "grad"))
            if total is None:
                continue  # no micro-batch reached it: zeros everywhere
            home.gradient_sums[j] = total
            for copy in copies:
                with copy.holder.on_mesh():
                    copy.holder.gradient_sums[copy.slot] = self._send(
                        total, w, home, copy.holder, "sum")


def accumulate(total, gradient):
    """Sum of micro-batch gradients. Sparse ones (embedding lookups) stay
    sparse: their rows are concatenated in micro-batch order, which is
    exactly the IndexedSlices the whole batch gives on one device (Keras'
    optimizers treat sparse and dense gradients differently)."""
    if total is None:
        return gradient
    if isinstance(total, tf.IndexedSlices) and isinstance(
            gradient, tf.IndexedSlices):
        return tf.IndexedSlices(
            tf.concat([total.values, gradient.values], 0),
            tf.concat([total.indices, gradient.indices], 0),
            total.dense_shape)
    return tf.convert_to_tensor(total) + tf.convert_to_tensor(gradient)


def _guest_weights(graph, frozen):
    """The tied weights split part `graph` reads: the trainable and the
    `frozen` weights of the layers it calls as a guest, and those its
    layers share with an earlier part."""
    weights = [w for layer in graph.guests
               for w in split_lib.weights_of(layer)] + list(graph.shared)
    return list({id(w): w for w in weights
                 if w.trainable or id(w) in frozen}.values())


def _new_copy(registry, weight, part):
    """A Keras variable on `part`'s mesh holding `weight`'s value, laid out
    as it (its placement, at path "tied_copy_on_part_<k>/<path with _>"):
    made on the host, then moved by the registry like a stage's weight."""
    place = registry.placement_of(weight)
    with registry.placing_on(None), keras.name_scope(
            f"tied_copy_on_part_{part.index}"):
        variable = keras.Variable(
            np.asarray(placement.fetch(tf.convert_to_tensor(weight.value))),
            dtype=weight.dtype, trainable=weight.trainable,
            name=weight.path.replace("/", "_"))
    backing = _compat.backing_variable(variable)
    backing.placement = place.replace(path=variable.path, mesh=None)
    # Read by the weight's layer: in its compute dtype on the devices under
    # offload="optimizer+master", as the weight (`tfpar.offload.master`).
    backing.compute_dtype = getattr(_compat.backing_variable(weight),
                                    "compute_dtype", None)
    registry.move_to(variable, part.mesh)
    return variable


def _slot_pairs(copy):
    """(home slot, copy slot) of each optimizer slot of the copy: slots are
    named "<variable path with _>_<slot>" (Keras'
    `add_variable_from_reference`)."""
    home_opt, copy_opt = copy.home.optimizer, copy.holder.optimizer
    if home_opt is None or copy_opt is None or not (
            home_opt.built and copy_opt.built):
        return []
    mine = copy.variable.path.replace("/", "_") + "_"
    theirs = copy.weight.path.replace("/", "_") + "_"
    home_slots = {v.name[len(theirs):]: v for v in home_opt.variables
                  if v.name.startswith(theirs)
                  and tuple(v.shape) == tuple(copy.weight.shape)}
    return [(home_slots[v.name[len(mine):]], v) for v in copy_opt.variables
            if v.name.startswith(mine) and v.name[len(mine):] in home_slots]
