"""Pretrained checkpoints into a sharded model and back out, one tensor at
a time: keras-hub presets and Hugging Face safetensors checkpoints.

The model is made in the scope of a strategy whose rules were planned
before any weight existed (`tfpar.auto_rules(builder)`), so every split
weight is created split; then:

- `check_checkpoint(model, path)`: every tensor the model will read is in
  the checkpoint with its shape and a float dtype, and the checkpoint's
  config agrees with the model's; otherwise a ValueError naming the
  tensor (or config entry), before any weight changes.
- `deferred_init()`: a model built inside it (in the strategy's scope)
  gets each weight's blocks allocated on their devices and left
  unwritten, for the load to write (no random initial value of a whole
  weight on the host); weights nothing wrote are initialized on exit.
- `load_weights(model, path)`: checks, then loads: a Hugging Face
  directory (config.json + model.safetensors, or sharded with its index)
  through keras-hub's converter for its `model_type`, a keras-hub preset
  directory or a `.weights.h5` file in Keras' dataset names. Each of this
  host's devices gets its block read from the file on its own (h5py
  selections; safetensors byte ranges, through the converter's reshapes
  and transposes, `safetensors_io.source_box`): the host holds the
  sharded state plus about one block, and on several hosts each host
  reads only its own devices' blocks.
- `export_to_transformers(model, path)`: a Hugging Face checkpoint of a
  (sharded) keras-hub model through keras-hub's name maps (the families
  keras-hub exports: Gemma, Llama3, Mistral, Qwen, GPT-2, ...), each
  tensor gathered, converted and written before the next one.

Example (8 virtual CPUs):

>>> build = lambda: keras_hub.models.Llama3Backbone.from_preset(
...     "llama-hf", load_weights=False)
>>> mesh = tfpar.Mesh({"model": 8})
>>> strategy = tfpar.ParallelStrategy(
...     mesh, rules=tfpar.auto_rules(build, mesh=mesh))
>>> with strategy.scope(), tfpar.pretrained.deferred_init():
...     backbone = build()    # every split weight split, blocks unwritten
...     tfpar.pretrained.load_weights(backbone, "llama-hf")
>>> tfpar.pretrained.export_to_transformers(backbone, "llama-hf-tuned")
"""

import contextlib
import ctypes
import importlib
import inspect
import json
import os
import threading

import keras
import numpy as np
import tensorflow as tf

from tfpar import _compat
from tfpar import placement
from tfpar import safetensors_io
from tfpar import variable_creation

_HF_CONFIG = "config.json"
_KERAS_WEIGHTS = "model.weights.h5"


def transformers_backbone(path, **kwargs):
    """The keras-hub backbone a Hugging Face checkpoint directory's
    config.json describes, with fresh weights (`load_weights` then loads
    them): keras-hub's converter's config map, without keras-hub's preset
    loader (which needs the `safetensors` package). As a builder it gives
    rules before any weight exists:

    >>> build = lambda: tfpar.pretrained.transformers_backbone("llama-hf")
    >>> rules = tfpar.auto_rules(build, mesh=mesh)

    Args:
        path: the checkpoint directory.
        **kwargs: backbone arguments overriding the config's (e.g. dtype).
    """
    config = _read_json(os.path.join(path, _HF_CONFIG))
    converter = _converter(config, path)
    return converter.backbone_cls(
        **{**transformers_backbone_config(converter, config), **kwargs})


def transformers_backbone_config(converter, config):
    """keras-hub's backbone arguments for a Hugging Face `config` (with
    `_CONFIG_FIXES`)."""
    if len(inspect.signature(converter.convert_backbone_config).parameters) == 1:
        arguments = converter.convert_backbone_config(config)
    else:
        arguments = converter.convert_backbone_config(
            config, converter.backbone_cls)
    fix = _CONFIG_FIXES.get(config.get("model_type"))
    return fix(config, arguments) if fix else arguments


def _gpt2_inner_width(config, arguments):
    """keras-hub 0.32 reads a GPT-2's MLP width as 4 * n_embd, ignoring
    `n_inner` (which its own exporter writes): a GPT-2 of another width
    does not load back (tests/keras_hub_gpt2_n_inner_repro.py)."""
    if config.get("n_inner"):
        arguments = {**arguments, "intermediate_dim": config["n_inner"]}
    return arguments


# Upstream bugs of keras-hub 0.32's Hugging Face converters, worked around
# here: the config a checkpoint is read with, and tensors its name maps
# write wrong (each with its reproduction in tests/).
_CONFIG_FIXES = {"gpt2": _gpt2_inner_width}
# Converters casting every tensor to float16 (a float32 checkpoint loads
# rounded): their hooks get `safetensors_io.KeepPrecision` arrays.
_KEEP_PRECISION = frozenset({"mistral"})


@contextlib.contextmanager
def deferred_init():
    """A model built inside the block, in a strategy's scope, is about to
    be loaded: each weight a layer makes from a Keras initializer starts
    as memory each device allocates for its own block and leaves
    unwritten (`placement.unwritten`: no random value of the whole weight
    on the host, no page resident before the load, and on several hosts
    no all-reduce of an initial value), then `load_weights` (or keras-hub's
    `from_preset`, Keras' `load_weights`) writes it block by block. Until
    a weight is assigned its values are undefined: do not read it inside
    the block. When the block ends, every such weight that nothing
    assigned gets its initializer's value as usual (a weight the
    checkpoint lacks is initialized as outside the block). Outside the
    block weights are made as always (training from scratch is
    unchanged).

    >>> with strategy.scope(), tfpar.pretrained.deferred_init():
    ...     backbone = build()        # each device its block, unwritten
    ...     tfpar.pretrained.load_weights(backbone, "llama-hf")
    """
    with variable_creation.deferred_initial_values() as deferred:
        yield
    initialize_unwritten(deferred)


def initialize_unwritten(deferred):
    """Each `variable_creation.DeferredValue` of `deferred` whose variable
    was never assigned (its `writes` count) gets its Keras initializer's
    value, made on the host as a weight's initial value is."""
    for value in deferred:
        variable = value.variable()
        if variable is None or getattr(variable, "writes", 1):
            continue
        with tf.init_scope(), tf.device("CPU:0"):
            variable.assign(value.make())


def load_weights(model, path):
    """Loads the checkpoint at `path` into `model` (made in a strategy's
    scope, ideally with rules from a builder), after `check_checkpoint`.

    Args:
        model: a keras-hub backbone (or a task: its backbone is loaded for
            a Hugging Face checkpoint, the whole task for a Keras one).
        path: a Hugging Face directory (config.json with a "model_type",
            safetensors files), a keras-hub preset directory, or a
            `.weights.h5` file.
    """
    kind = check_checkpoint(model, path)
    _give_back_freed_memory()  # what building the model freed, first
    if kind == "transformers":
        config = _read_json(os.path.join(path, _HF_CONFIG))
        checkpoint = safetensors_io.SafetensorsCheckpoint(
            path, keep_precision=config["model_type"] in _KEEP_PRECISION,
            assign=assign_blocks)
        _converter(config, path).convert_weights(_backbone(model), checkpoint,
                                                 config)
    else:
        _load_keras_weights(model, _weights_file(path))


def assign_blocks(variable, read, read_block=None):
    """`variable` = the host array `read()` makes: a weight of a tfpar
    strategy gets a value laid out as it is (each device only its block),
    assigned as is; others their own assign. Given `read_block(index)`
    (the block `index`, a tuple of slices, read alone), each of this
    host's devices gets its block read from the file on its own
    (`placement.put_blocks`: the whole tensor is never on the host, and a
    host reads only its devices' blocks); else the whole array is read,
    put in blocks (`placement.put`) and freed before the assign. (Keras'
    assign converts the whole array to a tensor first: three more copies
    of the largest tensor at the peak of a load.)"""
    backing = _compat.backing_variable(variable)
    place = getattr(backing, "placement", None)
    if place is None or place.mesh is None:
        variable.assign(read())
        return
    if read_block is not None:
        value = placement.put_blocks(read_block, tuple(backing.shape),
                                     place.spec, place.mesh, backing.dtype)
        backing.assign(value)
        del value
        if backing.dtype.size * backing.shape.num_elements() >= _TRIM_BYTES:
            _give_back_freed_memory()
        return
    array = read()
    if tuple(array.shape) != tuple(backing.shape):
        raise ValueError(
            f"Weight {variable.path!r} has shape {tuple(backing.shape)}; the "
            f"checkpoint's value has {tuple(array.shape)}.")
    value = placement.put(array, place.spec, place.mesh, dtype=backing.dtype)
    large = array.nbytes >= _TRIM_BYTES
    del array
    backing.assign(value)
    del value
    if large:
        _give_back_freed_memory()


# After a tensor of at least this many bytes, freed heap memory goes back
# to the system: glibc keeps what a load frees for reuse, and a load's
# reads and blocks of every size leave the heap fragmented (measured on
# the 150M-parameter Llama3: 0.12 GB of 0.59 GB held at the end).
_TRIM_BYTES = 1 << 20


def _give_back_freed_memory():
    """glibc's `malloc_trim(0)`: the heap's free pages returned to the
    system (resident memory drops); nothing where there is no glibc."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


try:
    _LIBC = ctypes.CDLL(None)
except OSError:  # no C library to load symbols from (not on Linux)
    _LIBC = None


def check_checkpoint(model, path):
    """Raises ValueError, naming the tensor or config entry, when the
    checkpoint at `path` does not fit `model` (a config entry differing
    from the model's, a tensor missing, of another shape or not a float);
    returns its kind ("transformers" or "keras"). Reads headers only (and
    runs the converter's reshapes on zero-stride stand-ins): nothing of
    `model` changes."""
    if not os.path.exists(path):
        raise ValueError(f"No checkpoint at {path!r}.")
    config_file = os.path.join(path, _HF_CONFIG)
    if os.path.isdir(path) and os.path.exists(config_file):
        config = _read_json(config_file)
        if "model_type" in config:
            _check_transformers(model, path, config)
            return "transformers"
        _check_config(model, config.get("config", {}), path)
    _check_keras_weights(model, _weights_file(path))
    return "keras"


def _check_transformers(model, path, config):
    backbone = _backbone(model)
    converter = _converter(config, path)
    expected = transformers_backbone_config(converter, config)
    _check_config(backbone, expected, path)
    recorder = _Recorder(safetensors_io.SafetensorsCheckpoint(path))
    with keras.StatelessScope():  # a converter's own assigns change nothing
        converter.convert_weights(backbone, recorder, config)
    for variable, key, hook in recorder.ported:
        recorder.check(variable, key, hook)


def _check_config(model, expected, path):
    """Every entry of the checkpoint's `expected` config that the model's
    own config has must be equal."""
    actual = model.get_config()
    for name, value in sorted(expected.items()):
        if name in actual and _plain(actual[name]) != _plain(value) and \
                name not in ("name", "trainable", "dtype"):
            raise ValueError(
                f"The checkpoint at {path!r} has {name}={value!r} but model "
                f"{model.name!r} has {name}={actual[name]!r}: build the model "
                "from the checkpoint's config (e.g. "
                "Backbone.from_preset(path, load_weights=False)).")


def _plain(value):
    return json.loads(json.dumps(value, default=str))


class _Recorder:
    """keras-hub's loader interface, recording instead of reading: which
    tensor goes to which variable through which hook; `get_tensor` (used by
    converters that stack tensors) gives a zero-stride stand-in."""

    def __init__(self, checkpoint):
        self.checkpoint = checkpoint
        self.ported = []

    def get_tensor(self, key):
        return self._stand_in(key)

    def port_weight(self, keras_variable, hf_weight_key, hook_fn=None):
        self.ported.append((keras_variable, hf_weight_key, hook_fn))

    def _stand_in(self, key):
        """Zeros of tensor `key`'s shape and dtype taking no memory (numpy
        broadcasting: every stride 0), so a hook's transposes and reshapes
        cost nothing; KeyError -> a ValueError naming the tensor."""
        try:
            shape, dtype = self.checkpoint.shape(key), self.checkpoint.dtype(key)
        except KeyError:
            raise ValueError(
                f"Tensor {key!r} is missing from the checkpoint at "
                f"{self.checkpoint.directory!r} (it holds "
                f"{len(self.checkpoint.keys())} tensors). The checkpoint "
                "is not of this model's family or configuration.") from None
        if dtype.kind != "f" and dtype.name != "bfloat16":
            raise ValueError(
                f"Tensor {key!r} of the checkpoint at "
                f"{self.checkpoint.directory!r} is {dtype}, not a float.")
        return np.broadcast_to(np.zeros((), dtype), shape)

    def check(self, variable, key, hook):
        tensor = self._stand_in(key)
        try:
            if hook is not None:
                tensor = hook(tensor, list(variable.shape))
        except ValueError as error:
            raise ValueError(
                f"Tensor {key!r} {self.checkpoint.shape(key)} of the "
                f"checkpoint does not convert to weight {variable.path!r} "
                f"{tuple(variable.shape)}: {error}") from None
        if tuple(np.shape(tensor)) != tuple(variable.shape):
            raise ValueError(
                f"Tensor {key!r} of the checkpoint has shape "
                f"{self.checkpoint.shape(key)}, which converts to "
                f"{tuple(np.shape(tensor))}, but weight {variable.path!r} has "
                f"shape {tuple(variable.shape)}.")


def _keras_weight_paths(model):
    """{dataset path in a `.weights.h5`: Keras variable} of `model`, by
    Keras' own save walk (`_save_state`) into a store that only records
    (every layer's `save_own_variables` names its variables); None when a
    layer stores anything but its variables (then Keras loads)."""
    saving_lib = _compat.keras_module("saving.saving_lib")

    class Recorder(saving_lib.NpzIOStore):
        def __init__(self):
            self.entries = {}

        def make(self, path, metadata=None):
            return self.entries.setdefault(path, {})

    recorder = Recorder()
    saving_lib._save_state(model, recorder, None, "", set())
    found = {}
    for path, entry in recorder.entries.items():
        for key, variable in entry.items():
            if not isinstance(variable, keras.Variable):
                return None
            found[f"{path}/vars/{key}" if path else f"vars/{key}"] = variable
    return found


def _load_keras_weights(model, weights_file):
    """Each dataset of the file read and put on the devices of its weight
    (`assign_blocks`), one at a time; Keras' own `load_weights` for a
    model whose layers store more than their variables."""
    paths = _keras_weight_paths(model)
    if paths is None:
        model.load_weights(weights_file)
        return
    h5py = importlib.import_module("h5py")
    with h5py.File(weights_file, "r") as f:
        for name, variable in paths.items():
            # h5py reads only a block's selection (a hyperslab).
            dataset = f[name]
            assign_blocks(variable, lambda d=dataset: d[()],
                          dataset.__getitem__)


def _check_keras_weights(model, weights_file):
    """Every weight's dataset (named by Keras' save walk) present with its
    shape; the file's datasets against the model's weights otherwise."""
    paths = _keras_weight_paths(model)
    if paths is None:
        _check_keras_shapes(model, weights_file)
        return
    h5py = importlib.import_module("h5py")
    with h5py.File(weights_file, "r") as f:
        for name, variable in paths.items():
            if name not in f:
                raise ValueError(
                    f"Tensor {name!r} (weight {variable.path!r}) is missing "
                    f"from {weights_file!r}.")
            dataset = f[name]
            if tuple(dataset.shape) != tuple(variable.shape):
                raise ValueError(
                    f"Tensor {name!r} of {weights_file!r} has shape "
                    f"{tuple(dataset.shape)} but weight {variable.path!r} has "
                    f"{tuple(variable.shape)}.")
            if dataset.dtype.kind not in "fiub" and \
                    dataset.dtype.name != "bfloat16":
                raise ValueError(f"Tensor {name!r} of {weights_file!r} is "
                                 f"{dataset.dtype}, not a number.")
        stored = []
        f.visititems(lambda name, item: stored.append(name)
                     if isinstance(item, h5py.Dataset) else None)
    extra = sorted(set(stored) - set(paths))
    if extra:
        raise ValueError(
            f"{weights_file!r} holds {len(extra)} tensors no weight of model "
            f"{model.name!r} takes, e.g. {extra[:5]}: a checkpoint of "
            "another configuration.")


def _check_keras_shapes(model, weights_file):
    """The datasets of a `.weights.h5` file against the model's weights:
    as many, and each weight's shape among them in order of the file's
    layers (Keras reads them by layer, in its own order)."""
    h5py = importlib.import_module("h5py")
    found = []
    with h5py.File(weights_file, "r") as f:
        f.visititems(lambda name, item: found.append((name, item.shape, item.dtype))
                     if isinstance(item, h5py.Dataset) else None)
    shapes = sorted(tuple(w.shape) for w in model.weights)
    stored = sorted(tuple(shape) for _, shape, _ in found)
    if shapes != stored:
        missing = [s for s in set(shapes) if shapes.count(s) > stored.count(s)]
        extra = [(n, tuple(s)) for n, s, _ in found
                 if stored.count(tuple(s)) > shapes.count(tuple(s))]
        raise ValueError(
            f"{weights_file!r} holds {len(found)} tensors and model "
            f"{model.name!r} {len(shapes)} weights, which differ: the file "
            f"lacks weights of shapes {missing} "
            f"(e.g. {_weights_of_shape(model, missing)}) and has {extra[:5]} "
            "that no weight of the model takes.")
    for name, _, dtype in found:
        if dtype.kind not in "fiub" and dtype.name != "bfloat16":
            raise ValueError(f"Tensor {name!r} of {weights_file!r} is "
                             f"{dtype}, not a number.")


def _weights_of_shape(model, shapes):
    return [w.path for w in model.weights if tuple(w.shape) in shapes][:5]


def _weights_file(path):
    if os.path.isdir(path):
        path = os.path.join(path, _KERAS_WEIGHTS)
    if not os.path.exists(path):
        raise ValueError(f"No Keras weights file at {path!r} (a keras-hub "
                         f"preset directory holds {_KERAS_WEIGHTS}).")
    return path


def _backbone(model):
    return getattr(model, "backbone", model)


# Keras' modes whose layers keep their float weights (float8 adds scales
# for the inputs and outputs only); int8 is written dequantized.
_FLOAT_WEIGHT_MODES = (None, "float8")


def _int8_layers(backbone):
    """The layers of `backbone` quantized by Keras' `quantize("int8")`
    (float8 layers keep their float weights); any other quantized layer
    (int4, GPTQ, AWQ, or a kind `_int8_layer_weights` does not know) is
    refused, naming the first."""
    found = []
    for layer in _compat.all_layers(backbone):
        mode = getattr(layer, "quantization_mode", None)
        if mode in _FLOAT_WEIGHT_MODES:
            continue
        if mode != "int8" or not isinstance(layer, (
                keras.layers.Dense, keras.layers.EinsumDense,
                keras.layers.Embedding)):
            raise ValueError(
                f"export_to_transformers(model) writes float weights and "
                f"dequantizes int8 Dense, EinsumDense and Embedding layers; "
                f"layer {layer.path!r} ({type(layer).__name__}) is quantized "
                f"as {mode!r}, which it cannot dequantize. Export the float "
                "model (before `quantize`) or quantize with 'int8'; after "
                "QLoRA, `backbone.save_lora_weights(path)` keeps the "
                "adapters.")
        found.append(layer)
    return found


def _dequantized_weights(layers):
    """{id(stored int8 variable): _Deferred of the float weight it stands
    for} of every int8 layer of `layers` (`_int8_layers`), LoRA merged.

    Keras' int8 (`quantize("int8")`) keeps q = round(w · scale) with one
    scale per output channel of a kernel (Dense: (units,), EinsumDense:
    Keras' reduced layout, `_adjust_scale_for_dequant` brings it back) and
    per row of a table (Embedding: (input_dim,); an untied
    ReversibleEmbedding's output table (output_dim, input_dim): one per
    column), so the float weight is q / scale, plus (alpha / rank) · A @ B
    with LoRA (what the layer computes; the export is the model that was
    trained, with int8's rounding: |error| ≤ max|w| / 254 per channel)."""
    table = {}
    for layer in layers:
        table.update(_int8_layer_weights(layer))
    return table


def _int8_layer_weights(layer):
    """`_dequantized_weights` of one int8 layer."""
    dtype = keras.backend.standardize_dtype(layer.variable_dtype)
    lora = (layer.lora_alpha / layer.lora_rank) if layer.lora_enabled else 0
    if isinstance(layer, keras.layers.Embedding):
        found = {id(layer._embeddings): _dequantize(
            layer._embeddings, layer.embeddings_scale,
            lambda scale: scale[:, None], dtype,
            (layer.lora_embeddings_a, layer.lora_embeddings_b, lora)
            if lora else None)}
        if not getattr(layer, "tie_weights", True):
            found[id(layer.reverse_embeddings)] = _dequantize(
                layer.reverse_embeddings, layer.reverse_embeddings_scale,
                lambda scale: scale[None, :], dtype)
        return found
    if isinstance(layer, keras.layers.EinsumDense):
        def to_kernel(scale):
            return keras.ops.convert_to_numpy(
                layer._adjust_scale_for_dequant(scale))
    else:
        def to_kernel(scale):  # (units,): the kernel's last axis
            return scale
    return {id(layer._kernel): _dequantize(
        layer._kernel, layer.kernel_scale, to_kernel, dtype,
        (layer.lora_kernel_a, layer.lora_kernel_b, lora) if lora else None)}


def _dequantize(stored, scale, to_weight_shape, dtype, lora=None):
    """A _Deferred of stored / to_weight_shape(scale), plus
    (alpha / rank) · A @ B when `lora` (A, B, alpha / rank) is given."""

    def compute(q, s, *factors):
        weight = q.astype("float32") / np.asarray(to_weight_shape(s),
                                                  "float32")
        if factors:
            weight = weight + lora[2] * np.matmul(*factors)
        return weight.astype(tf.dtypes.as_dtype(dtype).as_numpy_dtype)

    inputs = [stored, scale] + (list(lora[:2]) if lora else [])
    return _Deferred(compute, inputs, stored.shape, dtype)


@contextlib.contextmanager
def _lora_unmerged(layers):
    """While keras-hub's map reads them, each int8 layer of `layers` with
    LoRA gives its stored variable (Keras would add the float LoRA product
    to the int8 matrix itself), which `_dequantized_weights` then
    replaces."""
    quantized = [layer for layer in layers if layer.lora_enabled]
    for layer in quantized:
        layer.lora_enabled = False
    try:
        yield
    finally:
        for layer in quantized:
            layer.lora_enabled = True


def _substituted(x, table):
    """(`x` with each stored variable of `table` replaced by its float
    _Deferred, the float dtype or None where nothing was replaced): a
    keras-hub map entry made from int8 weights takes their float dtype."""
    if isinstance(x, (list, tuple)):
        pairs = [_substituted(item, table) for item in x]
        return ([value for value, _ in pairs],
                next((d for _, d in pairs if d is not None), None))
    if isinstance(x, _Deferred):
        inputs, dtype = _substituted(x.inputs, table)
        if dtype is None:
            return x, None
        return _Deferred(x.function, inputs, x.shape, dtype), dtype
    found = table.get(id(x))
    return (x, None) if found is None else (found, found.dtype)


def _read_json(path):
    with open(path) as f:
        return json.load(f)


# keras-hub's converter module of each `model_type` tfpar loads, imported
# alone: keras-hub's table (TransformersPresetLoader) imports every
# converter, and some need the `safetensors` package, which tfpar does not.
_CONVERTERS = {
    "llama": "convert_llama3", "gemma": "convert_gemma",
    "gemma2": "convert_gemma", "mistral": "convert_mistral",
    "qwen2": "convert_qwen", "qwen3": "convert_qwen3",
    "mixtral": "convert_mixtral", "gpt2": "convert_gpt2",
}


def _converter(config, path):
    """keras-hub's converter module for this checkpoint's `model_type`
    (others through keras-hub's own table)."""
    name = _CONVERTERS.get(config["model_type"])
    if name is not None:
        return importlib.import_module(
            f"keras_hub.src.utils.transformers.{name}")
    loader = importlib.import_module(
        "keras_hub.src.utils.transformers.preset_loader")
    return loader.TransformersPresetLoader(path, config).converter


# -- export ------------------------------------------------------------------

def export_to_transformers(model, path, max_shard_bytes=None):
    """Writes `model` (a keras-hub backbone or causal LM, sharded or not)
    as a Hugging Face checkpoint in directory `path`: config.json from
    keras-hub's config map, the tensors from its weight-name map, each
    gathered to the host, converted and written before the next
    (keras-hub's own exporter converts every tensor first).

    A backbone with untied output embeddings (Llama3, Mistral, ...) also
    gets `lm_head.weight`: keras-hub leaves it out of a backbone's export,
    and the checkpoint would not load back.

    A model quantized by Keras' `quantize("int8")` (QLoRA) is written
    dequantized, each LoRA product merged (`_dequantized_weights`);
    float8 as is; int4, GPTQ and AWQ are refused by layer name.

    Args:
        model: a keras-hub Backbone or a task with `.backbone`.
        path: the directory to write (made if missing).
        max_shard_bytes: split the tensors over files of at most this many
            bytes (`model-0000i-of-0000n.safetensors` and an index); None:
            one `model.safetensors`.

    Returns:
        The safetensors file names written.
    """
    backbone = _backbone(model)
    int8 = _int8_layers(backbone)
    dequantized = _dequantized_weights(int8)
    exporter = importlib.import_module(
        "keras_hub.src.utils.transformers.export.hf_exporter")
    kind = type(backbone).__name__
    if kind not in exporter.MODEL_EXPORTERS:
        raise ValueError(
            f"keras-hub exports no {kind} to Hugging Face; it exports "
            f"{sorted(exporter.MODEL_EXPORTERS)}.")
    include_lm_head = model is not backbone or not getattr(
        backbone, "tie_word_embeddings", True)
    with _lora_unmerged(int8):
        tensors = _lazy_weights_map(exporter.MODEL_EXPORTERS[kind],
                                    backbone, include_lm_head)
        if kind in _MAP_FIXES:
            tensors.update(_MAP_FIXES[kind](backbone))
    tensors = {name: _substituted(value, dequantized)[0]
               for name, value in tensors.items()}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, _HF_CONFIG), "w") as f:
        json.dump(exporter.MODEL_CONFIGS[kind](backbone), f, indent=2)
    return safetensors_io.write_checkpoint(
        path, [(name, value.shape, value.dtype, value.compute)
               for name, value in tensors.items()], max_shard_bytes)


class _Deferred:
    """A keras.ops reshape/transpose/concatenate of Keras variables in a
    keras-hub weight map, computed (from the host copy of each variable,
    gathered from its blocks) only when its tensor is written."""

    def __init__(self, function, inputs, shape, dtype):
        self.function, self.inputs = function, inputs
        self.shape, self.dtype = tuple(shape), dtype

    def compute(self):
        return self.function(*[_value(x) for x in self.inputs])


def _value(x):
    """The host value of a weight-map entry: a Keras variable, or a tensor
    a layer computes from its variables (LoRA's merged kernel W + A @ B: a
    DTensor split as W, gathered from its blocks)."""
    if isinstance(x, _Deferred):
        return x.compute()
    if isinstance(x, (list, tuple)):
        return [_value(item) for item in x]
    if isinstance(x, tf.Tensor):
        return placement.fetch(x)
    return np.asarray(keras.ops.convert_to_numpy(x))


def _info(x):
    return tuple(x.shape), keras.backend.standardize_dtype(
        getattr(x, "dtype", "float32"))


class _LazyOps:
    """The keras.ops a keras-hub weight map calls, deferred (`_Deferred`)."""

    @staticmethod
    def reshape(x, newshape):
        shape, dtype = _info(x)
        newshape = list(newshape)
        if -1 in newshape:
            known = int(np.prod([n for n in newshape if n != -1]))
            newshape[newshape.index(-1)] = int(np.prod(shape)) // known
        return _Deferred(lambda a: np.reshape(a, newshape), [x], newshape,
                         dtype)

    @staticmethod
    def transpose(x, axes=None):
        shape, dtype = _info(x)
        axes = list(axes) if axes is not None else list(range(len(shape)))[::-1]
        return _Deferred(lambda a: np.transpose(a, axes),
                         [x], [shape[i] for i in axes], dtype)

    @staticmethod
    def concatenate(xs, axis=0):
        infos = [_info(x) for x in xs]
        shape = list(infos[0][0])
        shape[axis] = sum(s[axis] for s, _ in infos)
        return _Deferred(lambda *a: np.concatenate(a, axis=axis), list(xs),
                         shape, infos[0][1])

    def __getattr__(self, name):
        raise NotImplementedError(
            f"keras-hub's weight map calls keras.ops.{name}, which "
            "tfpar.pretrained.export_to_transformers does not defer yet.")


def _gemma_key_value(backbone):
    """Gemma's key/value projections: keras-hub 0.32's map writes only the
    first key/value head (`kernel[0]`, right for Gemma 2B's one head, wrong
    for Gemma 7B's 16); the kernel (heads, hidden, head_dim) becomes HF's
    (heads * head_dim, hidden): transpose to (heads, head_dim, hidden),
    then merge the first two (tests/keras_hub_gemma_kv_repro.py)."""
    fixed = {}
    for i in range(backbone.num_layers):
        attention = backbone.get_layer(f"decoder_block_{i}").attention
        for name, dense in (("k_proj", attention.key_dense),
                            ("v_proj", attention.value_dense)):
            fixed[f"model.layers.{i}.self_attn.{name}.weight"] = \
                _LazyOps.reshape(_LazyOps.transpose(dense.kernel, (0, 2, 1)),
                                 (-1, backbone.hidden_dim))
    return fixed


_MAP_FIXES = {"GemmaBackbone": _gemma_key_value}


# One weight map is read with its module's `ops` swapped at a time.
_SWAP = threading.Lock()


@contextlib.contextmanager
def _deferred_ops(function):
    """The module of keras-hub's map `function` sees `_LazyOps` as its
    `ops` (`import keras.ops as ops`) inside the block."""
    module = importlib.import_module(function.__module__)
    with _SWAP:
        saved = module.ops
        module.ops = _LazyOps()
        try:
            yield
        finally:
            module.ops = saved


def _lazy_weights_map(function, backbone, include_lm_head):
    """{HF name: _Deferred} of keras-hub's map: nothing computed yet."""
    with _deferred_ops(function):
        weights = function(backbone, include_lm_head=include_lm_head)
    return {name: value if isinstance(value, _Deferred) else _Deferred(
                lambda a: a, [value], _info(value)[0], _info(value)[1])
            for name, value in weights.items()}
