"""Hugging Face safetensors files read and written one tensor at a time,
with numpy only (the `safetensors` package is not needed).

A safetensors file is an 8-byte little-endian header length N, a JSON
header of N bytes ({name: {"dtype", "shape", "data_offsets": [begin,
end]}}, offsets counted from the end of the header) and the tensors'
bytes, C order. A checkpoint is one `model.safetensors` or several
`model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`
({"weight_map": {name: file}}).

`SafetensorsCheckpoint(directory)` reads one tensor (`get_tensor`) or one
block of rows (`get_slice`) at a time, into memory of its own (no mapping:
a mapped file's pages count as the process's resident memory); it has the
interface keras-hub's converters call (`port_weight`, `get_tensor`), so a
converter loads a checkpoint into a sharded model one tensor at a time.
`write_checkpoint(directory, entries, max_shard_bytes)` writes tensors
produced one at a time.

>>> ckpt = SafetensorsCheckpoint("llama-hf")
>>> ckpt.shape("model.norm.weight"), ckpt.get_tensor("model.norm.weight")
"""

import json
import os
import struct

import ml_dtypes
import numpy as np

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
          "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_CODES = {np.dtype(v): k for k, v in DTYPES.items()}


def dtype_code(dtype):
    """The safetensors code of a numpy/TF/Keras dtype ("float32" -> "F32")."""
    dtype = np.dtype(ml_dtypes.bfloat16 if str(dtype) == "bfloat16" else dtype)
    if dtype not in _CODES:
        raise ValueError(f"safetensors has no dtype for {dtype}.")
    return _CODES[dtype]


def read_header(path):
    """(header {name: entry}, where the data starts) of one file."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


class SafetensorsCheckpoint:
    """The tensors of a safetensors checkpoint directory (one file, or
    sharded with an index), read one at a time; keras-hub's converters'
    loader interface (`port_weight`, `get_tensor`) on top.

    Args:
        directory: holds `model.safetensors` or `model.safetensors.index.json`
            and the files it names.
    """

    def __init__(self, directory, keep_precision=False, assign=None):
        self.directory = directory
        self.keep_precision = keep_precision
        self._assign = assign or (
            lambda variable, read, read_block: variable.assign(read()))
        index = os.path.join(directory, INDEX_FILE)
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif os.path.exists(os.path.join(directory, SINGLE_FILE)):
            files = [SINGLE_FILE]
        else:
            raise ValueError(
                f"{directory!r} holds neither {SINGLE_FILE} nor {INDEX_FILE}: "
                "not a Hugging Face safetensors checkpoint.")
        self._entries = {}  # name -> (file path, entry, data start)
        for name in files:
            path = os.path.join(directory, name)
            header, start = read_header(path)
            for key, entry in header.items():
                self._entries[key] = (path, entry, start)
        self._prefix = ""

    def keys(self):
        return list(self._entries)

    def key(self, name):
        """The stored name of `name`, allowing a common prefix ("model.")
        on either side, as keras-hub's loader does; KeyError if absent."""
        for candidate in (name, self._prefix + name):
            if candidate in self._entries:
                return candidate
        for stored in self._entries:
            if stored.endswith("." + name):
                self._prefix = stored[:-len(name)]
                return stored
        raise KeyError(name)

    def shape(self, name):
        return tuple(self._entries[self.key(name)][1]["shape"])

    def dtype(self, name):
        return np.dtype(DTYPES[self._entries[self.key(name)][1]["dtype"]])

    def get_tensor(self, name):
        """The whole tensor `name`, read from its file (its bytes only)."""
        path, entry, start = self._entries[self.key(name)]
        begin, end = entry["data_offsets"]
        dtype = np.dtype(DTYPES[entry["dtype"]])
        array = np.fromfile(path, dtype=dtype, count=(end - begin)
                            // dtype.itemsize, offset=start + begin)
        return array.reshape(entry["shape"])

    def get_slice(self, name, rows):
        """Rows `rows` (a slice of the first dimension) of tensor `name`:
        only their bytes are read (a host reads its devices' blocks)."""
        path, entry, start = self._entries[self.key(name)]
        shape, dtype = entry["shape"], np.dtype(DTYPES[entry["dtype"]])
        first, stop, _ = rows.indices(shape[0])
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        offset = start + entry["data_offsets"][0] + first * row_bytes
        array = np.fromfile(path, dtype=dtype, count=(stop - first)
                            * row_bytes // dtype.itemsize, offset=offset)
        return array.reshape([stop - first] + list(shape[1:]))

    def get_block(self, name, box):
        """The sub-array `box` ((start, stop) per dimension) of tensor
        `name`, reading only its bytes: one read when it spans whole rows
        of the first dimension, else one read per first-dimension row
        (the span of the second dimension's range; the rest cut in
        memory)."""
        path, entry, start = self._entries[self.key(name)]
        shape, dtype = entry["shape"], np.dtype(DTYPES[entry["dtype"]])
        box = [tuple(b) for b in box]
        if all(b == (0, n) for b, n in zip(box[1:], shape[1:])):
            return self.get_slice(name, slice(*box[0]))
        row = int(np.prod(shape[1:], dtype=np.int64))
        inner = int(np.prod(shape[2:], dtype=np.int64))
        (first, stop), (low, high) = box[0], box[1]
        base = start + entry["data_offsets"][0]
        rows = [np.fromfile(path, dtype=dtype, count=(high - low) * inner,
                            offset=base + (r * row + low * inner) * dtype.itemsize)
                for r in range(first, stop)]
        block = np.stack(rows).reshape([stop - first, high - low] + shape[2:])
        return block[(slice(None), slice(None)) + tuple(
            slice(*b) for b in box[2:])]

    def port_weight(self, keras_variable, hf_weight_key, hook_fn=None):
        """keras-hub's loader call: tensor `hf_weight_key`, through
        `hook_fn(tensor, keras shape)`, assigned to `keras_variable` by
        the `assign(variable, read, read_block)` given (default: its own
        assign of `read()`): `read()` makes the whole array, so that the
        assign holds its only reference and can free it early;
        `read_block(index)` the block `index` of it reading only that
        block's bytes where the hook's transposes and reshapes map it to
        one box of the tensor (`source_box`), else cut from one whole
        read."""
        keras_shape = list(keras_variable.shape)

        def read():
            tensor = self.get_tensor(hf_weight_key)
            if self.keep_precision:
                tensor = tensor.view(KeepPrecision)
            if hook_fn is not None:
                tensor = hook_fn(tensor, keras_shape)
            return np.asarray(tensor)

        whole = []

        def read_block(index):
            box = source_box(self.shape(hf_weight_key), hook_fn, keras_shape,
                             index)
            if box is None:  # one whole read, cut for every block
                whole[:] = whole or [read()]
                return whole[0][index]
            tensor = self.get_block(hf_weight_key, box)
            if self.keep_precision:
                tensor = tensor.view(KeepPrecision)
            if hook_fn is not None:
                tensor = hook_fn(tensor, _block_shape(keras_shape, index))
            return np.asarray(tensor)

        self._assign(keras_variable, read, read_block)


def _block_shape(shape, index):
    return [len(range(*s.indices(n))) for s, n in zip(index, shape)]


def _probe(shape, axis):
    """An array of `shape` whose every element is its index along `axis`,
    taking the memory of that axis only (zero strides elsewhere)."""
    along = np.arange(shape[axis]).reshape(
        [-1 if i == axis else 1 for i in range(len(shape))])
    # KeepPrecision: a hook's cast to float16 keeps the indices exact.
    return np.broadcast_to(along, shape).view(KeepPrecision)


def source_box(shape, hook, keras_shape, index):
    """The box ((start, stop) per dimension) of a checkpoint tensor of
    `shape` that `hook(tensor, keras_shape)` turns into block `index` of
    the weight, when exactly that box, put through `hook(box, block
    shape)`, makes the block (checked on index probes: `_probe` put
    through both); None when no box does (then the whole tensor is read).
    No hook: the box is the block."""
    box_shape = _block_shape(keras_shape, index)
    if hook is None:
        return tuple(s.indices(n)[:2] for s, n in zip(index, shape))
    box = []
    try:
        probes = [np.asarray(hook(_probe(shape, axis), keras_shape))
                  for axis in range(len(shape))]
        for axis, probe in enumerate(probes):
            part = probe[index]
            box.append((int(part.min()), int(part.max()) + 1))
        if int(np.prod([b - a for a, b in box])) != int(np.prod(box_shape)):
            return None
        cut = tuple(slice(a, b) for a, b in box)
        for axis, probe in enumerate(probes):
            mapped = hook(_probe(shape, axis)[cut] - box[axis][0], box_shape)
            if not np.array_equal(mapped, probe[index] - box[axis][0]):
                return None
    except (ValueError, TypeError):
        return None
    return tuple(box)


class KeepPrecision(np.ndarray):
    """An array whose `astype(float16)` keeps its own float dtype: handed
    to a converter hook that casts every tensor to float16 (keras-hub 0.32's
    Mistral converter), so a float32 checkpoint loads exactly, not rounded
    (tests/keras_hub_mistral_float16_repro.py). The variable's assign casts
    to the variable's own dtype."""

    def astype(self, dtype, *args, **kwargs):
        if np.dtype(dtype) == np.float16 and self.dtype != np.float16:
            return self
        return super().astype(dtype, *args, **kwargs)


def write_checkpoint(directory, entries, max_shard_bytes=None):
    """Writes `entries` [(name, shape, dtype, produce)] as a safetensors
    checkpoint, each tensor made by `produce()` when its turn comes and
    written before the next is made; sharded files with an index when the
    total passes `max_shard_bytes`. Returns the files written."""
    os.makedirs(directory, exist_ok=True)
    shards, size = [[]], 0
    for entry in entries:
        nbytes = int(np.prod(entry[1], dtype=np.int64)) * np.dtype(
            ml_dtypes.bfloat16 if str(entry[2]) == "bfloat16"
            else entry[2]).itemsize
        if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((entry, nbytes))
        size += nbytes
    if len(shards) == 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                 for i in range(len(shards))]
    for name, shard in zip(names, shards):
        _write_file(os.path.join(directory, name), shard)
    if len(shards) > 1:
        weight_map = {entry[0]: name for name, shard in zip(names, shards)
                      for entry, _ in shard}
        total = sum(n for shard in shards for _, n in shard)
        with open(os.path.join(directory, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total},
                       "weight_map": weight_map}, f, indent=2)
    return names


def _write_file(path, shard):
    """One safetensors file of [((name, shape, dtype, produce), bytes)]."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for (name, shape, dtype, _), nbytes in shard:
        header[name] = {"dtype": dtype_code(dtype), "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for (name, shape, dtype, produce), nbytes in shard:
            array = np.ascontiguousarray(produce())
            if tuple(array.shape) != tuple(shape) or array.nbytes != nbytes:
                raise ValueError(
                    f"Tensor {name!r} was announced as {tuple(shape)} "
                    f"{dtype} but made {array.shape} {array.dtype}.")
            array.tofile(f)  # its bytes, C order, without a copy
