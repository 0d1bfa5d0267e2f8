"""Sharded, reshardable, crash-safe checkpoints (issue 5, items 2-4).

A checkpoint is a directory of `.npy` block files plus a `manifest.json`:

    directory/
      checkpoint                  pointer: {"latest": "ckpt-12", "step": 12}
      ckpt-8/                     an older complete checkpoint
      ckpt-12/
        manifest.json             written last: the directory is complete
        v0000_mlp_up_kernel.b0.npy ... one file per distinct block
      ckpt-16.tmp-4242/           a save that never finished: ignored

Saving never assembles a sharded variable anywhere: each device's block is
read from that device's own component (`dtensor.unpack`) and written to its
own file; devices holding the same block (replicas) write it once. Restoring
works onto any mesh and layout: every device's target block is cut out of the
saved blocks that overlap it (memory-mapped, so only the needed slices are
read), then the blocks are packed onto the mesh.

Variable keys (stable across meshes, optimizer names and rebuilds):

* model weights (`model.weights`, kind "params"): `variable.path`, e.g.
  "mlp/up/kernel";
* optimizer slots (kind "optimizer"): "<weight path>:<slot>", e.g.
  "mlp/up/kernel:momentum". Keras names a slot
  `<weight path with "/" -> "_">_<slot>` (`add_variable_from_reference`);
  the slot is attributed to the trainable weight with the *longest* such
  prefix whose shape equals the slot's shape, so the key does not depend on
  the optimizer's name ("adam/..." vs "adam_1/...") or on the position of
  the slot in `optimizer.variables`;
* other optimizer variables (kind "optimizer"): their name, e.g.
  "iteration", "learning_rate".

Example:

>>> import keras, tfpar
>>> from tfpar import checkpoint
>>> tfpar.use_virtual_cpus(8)
>>> strategy = tfpar.ParallelStrategy(
...     tfpar.Mesh({"model": 8}), rules={r".*up/kernel": (None, "model")})
>>> with strategy.scope():
...     model = keras.Sequential([keras.Input((4,)),
...                               keras.layers.Dense(16, name="up")])
...     model.compile(optimizer="adam", loss="mse")
>>> path = checkpoint.save_checkpoint(model, "/tmp/run", step=0)
>>> checkpoint.latest_checkpoint("/tmp/run") == path
True
>>> checkpoint.restore_checkpoint(model, "/tmp/run")   # any mesh works
0
"""

import json
import os
import re
import shutil
import time

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import _compat
from tfpar import layout as layout_lib
from tfpar import placement

FORMAT = "tfpar-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
POINTER = "checkpoint"
_CKPT_DIR = re.compile(r"ckpt-(\d+)")


# -- public API --------------------------------------------------------------


def save_checkpoint(model, directory, optimizer=True, step=None):
    """Saves `model` (and its optimizer state) as `directory/ckpt-<step>/`.

    Every device's block of a sharded variable is written from that device
    (one `.npy` per distinct block); replicated variables are written once.
    The files go to `ckpt-<step>.tmp-<pid>/`, are fsync'ed, the manifest is
    written last, the directory is renamed atomically to `ckpt-<step>`, and
    only then is the `checkpoint` pointer file replaced. A crash at any
    point leaves the previous checkpoints intact and `latest_checkpoint`
    pointing at a complete one.

    Example:

    >>> path = save_checkpoint(model, "/tmp/run")  # step = iterations
    >>> os.path.basename(path)
    'ckpt-0'

    Args:
        model: a Keras model, under a `tfpar.ParallelStrategy` or not.
        directory: the checkpoint root (created if needed).
        optimizer: also save `model.optimizer.variables` (the optimizer is
            built first if it is not yet).
        step: int for the directory name; defaults to
            `model.optimizer.iterations`.

    Returns:
        The path of the complete checkpoint directory.

    Raises:
        ValueError: no optimizer to save or to take the step from, or two
            variables with the same key.
    """
    entries = _entries(model, optimizer)
    if step is None:
        if getattr(model, "optimizer", None) is None:
            raise ValueError(
                "save_checkpoint(step=None) takes the step from "
                "model.optimizer.iterations, but the model has no optimizer. "
                "Pass step=<int>.")
        step = int(_host_value(_compat.backing_variable(
            model.optimizer._iterations)))  # noqa: SLF001 (raw counter)
    step = int(step)
    if step < 0:
        raise ValueError(f"save_checkpoint(step) must be >= 0. Received: {step}")
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    name = f"ckpt-{step}"
    final = os.path.join(directory, name)
    tmp = os.path.join(directory, f"{name}.tmp-{os.getpid()}")
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    try:
        records = [_save_variable(n, kind, key, variable, tmp)
                   for n, (kind, key, variable) in enumerate(entries)]
        manifest = _manifest_header(step, model)
        manifest["variables"] = records
        _write_file(os.path.join(tmp, MANIFEST),
                    json.dumps(manifest, indent=1).encode())
        _fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # Publish: an atomic rename makes the complete directory appear at once.
    # Re-saving a step moves the old directory aside first (rename cannot
    # replace a non-empty directory).
    old = None
    if os.path.exists(final):
        old = os.path.join(directory, f"{name}.old-{os.getpid()}")
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _write_file(os.path.join(directory, POINTER),
                json.dumps({"latest": name, "step": step}).encode(),
                atomic=True)
    _fsync_dir(directory)
    return final


def latest_checkpoint(directory):
    """The path of the latest complete checkpoint in `directory`, or None.

    The `checkpoint` pointer file names it; if the pointer is missing,
    unreadable or names a directory that does not exist, the complete
    `ckpt-<step>` directory (one holding a manifest) with the highest step is
    returned. Unfinished `ckpt-<step>.tmp-<pid>` directories never count.

    Example:

    >>> latest_checkpoint("/tmp/run")
    '/tmp/run/ckpt-12'
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return None
    try:
        with open(os.path.join(directory, POINTER), "rb") as f:
            name = json.loads(f.read())["latest"]
        if _CKPT_DIR.fullmatch(name) and os.path.isfile(
                os.path.join(directory, name, MANIFEST)):
            return os.path.join(directory, name)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    steps = []
    for name in os.listdir(directory):
        match = _CKPT_DIR.fullmatch(name)
        if match and os.path.isfile(os.path.join(directory, name, MANIFEST)):
            steps.append((int(match[1]), name))
    return os.path.join(directory, max(steps)[1]) if steps else None


def restore_checkpoint(model, directory, optimizer=True):
    """Restores `model` (and its optimizer) from a checkpoint, on any mesh.

    For every variable and every device, the block the variable's layout
    gives that device is assembled from the saved blocks overlapping it, so
    a checkpoint written on `model=8` restores onto `data=2 x model=4`, onto
    `data=8` or into a single-device model. Everything is checked and read
    before the first variable changes: on any error no weight is modified.

    Example:

    >>> with strategy.scope():                # any mesh, any rules
    ...     model = build_model()
    ...     model.compile(optimizer="adam", loss="mse")
    >>> step = restore_checkpoint(model, "/tmp/run")

    Args:
        model: a built Keras model with the checkpoint's variables.
        directory: a checkpoint root (its latest checkpoint is used) or one
            `ckpt-<step>` directory.
        optimizer: also restore `model.optimizer`'s state (it is built under
            the model's strategy first if needed).

    Returns:
        The step of the restored checkpoint.

    Raises:
        FileNotFoundError: no complete checkpoint in `directory`.
        ValueError: missing, extra or mismatched (shape/dtype) variables, a
            damaged manifest, a block file that is missing, truncated or of
            the wrong shape/dtype. The message names them.
    """
    directory = os.fspath(directory)
    if os.path.isfile(os.path.join(directory, MANIFEST)):
        path = directory
    else:
        path = latest_checkpoint(directory)
        if path is None:
            raise FileNotFoundError(
                f"No complete checkpoint in {directory!r} (no 'checkpoint' "
                "pointer and no ckpt-<step>/manifest.json).")
    manifest = _read_manifest(path)
    saved = {(r["kind"], r["key"]): r for r in manifest["variables"]}
    kinds = ("params", "optimizer") if optimizer else ("params",)
    if optimizer:
        _build_optimizer(model)
    entries = _entries(model, optimizer)
    targets = {(kind, key): variable for kind, key, variable in entries}

    # 1. Names, shapes and dtypes, before touching any file or weight.
    missing = [ident for ident in targets if ident not in saved]
    extra = [ident for ident in saved
             if ident[0] in kinds and ident not in targets]
    mismatched = []
    for ident, variable in targets.items():
        record = saved.get(ident)
        if record is None:
            continue
        shape = tuple(variable.shape)
        dtype = tf.as_dtype(variable.dtype).name
        if tuple(record["shape"]) != shape or record["dtype"] != dtype:
            mismatched.append(
                f"{ident[1]!r} (checkpoint {tuple(record['shape'])} "
                f"{record['dtype']}, model {shape} {dtype})")
    if missing or extra or mismatched:
        problems = []
        if missing:
            problems.append(f"missing from the checkpoint: {_names(missing)}")
        if extra:
            problems.append(
                f"in the checkpoint but not in the model: {_names(extra)}")
        if mismatched:
            problems.append(f"shape/dtype differ: {', '.join(mismatched)}")
        raise ValueError(
            f"Checkpoint {path!r} does not fit model {model.name!r}; "
            + "; ".join(problems) + ". No variable was changed.")

    # 2. Open every block file and check it against the manifest.
    opened = {ident: _open_blocks(path, saved[ident]) for ident in targets}
    # 3. Read and stage every target value (on the mesh, not yet assigned).
    staged = [(variable, _assemble(variable, saved[ident], opened[ident]))
              for ident, variable in targets.items()]
    # 4. Only now change the model.
    for variable, value in staged:
        _compat.backing_variable(variable).assign(value)
    return int(manifest["step"])


def _names(idents):
    """'weights [...], optimizer variables [...]' for (kind, key) pairs."""
    params = [key for kind, key in idents if kind == "params"]
    others = [key for kind, key in idents if kind != "params"]
    return ", ".join(f"{label} {keys}" for label, keys in
                     (("weights", params), ("optimizer variables", others))
                     if keys)


# -- which variables, under which keys -----------------------------------------


def _entries(model, optimizer):
    """[(kind, key, keras variable)] of everything a checkpoint holds."""
    entries = [("params", v.path, v) for v in model.weights]
    if optimizer:
        opt = getattr(model, "optimizer", None)
        if opt is None:
            raise ValueError(
                f"Model {model.name!r} has no optimizer (not compiled). "
                "Compile it, or pass optimizer=False to save/restore the "
                "weights only.")
        _build_optimizer(model)
        trainable = list(model.trainable_variables)
        for variable in opt.variables:
            entries.append(("optimizer", _optimizer_key(variable, trainable),
                            variable))
    seen, duplicates = set(), []
    for kind, key, _ in entries:
        if (kind, key) in seen:
            duplicates.append(key)
        seen.add((kind, key))
    if duplicates:
        raise ValueError(
            f"Variables of model {model.name!r} share the checkpoint key(s) "
            f"{duplicates}. Give the layers unique names.")
    return entries


def _optimizer_key(variable, trainable):
    """"<weight path>:<slot>" for a slot, else the variable's name."""
    name = variable.name
    best = None
    for weight in trainable:
        prefix = weight.path.replace("/", "_") + "_"
        if (name.startswith(prefix) and len(name) > len(prefix)
                and tuple(weight.shape) == tuple(variable.shape)
                and (best is None or len(prefix) > len(best[0]))):
            best = (prefix, weight.path)
    if best is None:
        return name
    return f"{best[1]}:{name[len(best[0]):]}"


def _build_optimizer(model):
    opt = getattr(model, "optimizer", None)
    if opt is not None and not opt.built:
        with model.distribute_strategy.scope():
            opt.build(model.trainable_variables)


# -- saving ------------------------------------------------------------------


def _layout_of(backing):
    """(spec, {axis: size}, dtensor layout) of a variable; plain ones are one
    unsharded block."""
    if isinstance(backing, _compat.DVariable):
        layout = dtensor.fetch_layout(backing)
        dmesh = layout.mesh
        if dmesh.num_local_devices() != dmesh.size:
            raise RuntimeError(
                "tfpar checkpoints support single-client meshes only; "
                f"mesh {dmesh} spans several hosts.")
        return (layout_lib.spec_of(layout),
                dict(zip(dmesh.dim_names, dmesh.shape())), layout)
    return (None,) * len(backing.shape), {}, None


def _host_value(backing):
    """A replicated/plain variable's value from one device (no gather)."""
    value = backing.read_value()
    if dtensor.is_dtensor(value):
        value = dtensor.unpack(value)[0]
    return value.numpy()


def _save_variable(n, kind, key, variable, tmp):
    backing = _compat.backing_variable(variable)
    shape = tuple(backing.shape)
    spec, axis_sizes, layout = _layout_of(backing)
    stem = f"v{n:04d}_" + re.sub(r"[^A-Za-z0-9_.-]+", "_", key)
    blocks = []
    if layout is None:
        components = [backing.read_value()]
        locations = [{}]
    else:
        # One component per local device, in `local_device_locations` order.
        # Only that device's block is copied to the host: never the variable.
        components = dtensor.unpack(backing.read_value())
        locations = layout.mesh.local_device_locations()
    seen = set()
    for component, location in zip(components, locations):
        # Block math: along a dimension of size n split over an axis of size
        # k, the device at coordinate c holds [c*n/k, (c+1)*n/k);
        # replicated dimensions are whole [0, n). Replicas share one block.
        index = placement.block_index(shape, spec, axis_sizes, location)
        ranges = [list(s.indices(size)[:2]) for s, size in zip(index, shape)]
        block_key = tuple(map(tuple, ranges))
        if block_key in seen:
            continue
        seen.add(block_key)
        file = f"{stem}.b{len(blocks)}.npy"
        array = component.numpy()
        expected = tuple(b - a for a, b in ranges)
        if array.shape != expected:  # a layout we do not understand
            raise RuntimeError(
                f"Block of {key!r} on device {location} has shape "
                f"{array.shape}, expected {expected} for spec {spec}.")
        _write_npy(os.path.join(tmp, file), array)
        blocks.append({"file": file, "index": ranges})
    return {"kind": kind, "key": key, "path": variable.path,
            "shape": list(shape), "dtype": tf.as_dtype(backing.dtype).name,
            "spec": list(spec), "blocks": blocks}


def _manifest_header(step, model):
    import keras  # noqa: PLC0415

    import tfpar  # noqa: PLC0415 (the package imports this module lazily)

    strategy = model.distribute_strategy
    mesh = getattr(strategy, "mesh", None)
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "step": step,
        "created": time.time(),
        "versions": {"tfpar": tfpar.__version__, "tensorflow": tf.__version__,
                     "keras": keras.__version__, "numpy": np.__version__},
        "mesh": mesh.shape if mesh is not None else None,
    }


def _write_npy(path, array):
    """Writes one block file and fsyncs it (tests patch this to crash)."""
    with open(path, "wb") as f:
        np.lib.format.write_array(f, np.require(array, requirements="C"),
                                  allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())


def _write_file(path, data, atomic=False):
    target = path
    if atomic:
        path = f"{path}.tmp-{os.getpid()}"
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if atomic:
        os.replace(path, target)


def _fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- restoring ---------------------------------------------------------------


def _read_manifest(path):
    file = os.path.join(path, MANIFEST)
    try:
        with open(file, "rb") as f:
            manifest = json.loads(f.read())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(
            f"Checkpoint manifest {file!r} is damaged (not valid JSON: "
            f"{error}). No variable was changed.") from None
    problem = None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        problem = f"it is not a {FORMAT} manifest"
    elif manifest.get("format_version") != FORMAT_VERSION:
        problem = (f"format_version {manifest.get('format_version')!r} is "
                   f"not {FORMAT_VERSION} (written by tfpar "
                   f"{manifest.get('versions', {}).get('tfpar')})")
    else:
        try:
            int(manifest["step"])
            for record in manifest["variables"]:
                _check_record(record)
        except (KeyError, TypeError, ValueError) as error:
            problem = f"a variable entry is malformed ({error})"
    if problem:
        raise ValueError(f"Checkpoint manifest {file!r} is damaged: {problem}. "
                         "No variable was changed.")
    return manifest


def _check_record(record):
    """Blocks must lie inside the variable, not overlap, and tile it."""
    shape = [int(s) for s in record["shape"]]
    tf.as_dtype(record["dtype"])  # raises TypeError for an unknown dtype
    if record["kind"] not in ("params", "optimizer") or not isinstance(
            record["key"], str):
        raise ValueError(f"bad kind/key {record['kind']!r}/{record['key']!r}")
    volume = 0
    boxes = []
    for block in record["blocks"]:
        if not isinstance(block["file"], str) or os.sep in block["file"]:
            raise ValueError(f"bad block file name {block['file']!r}")
        box = [(int(a), int(b)) for a, b in block["index"]]
        if len(box) != len(shape) or any(
                not 0 <= a < b <= n for (a, b), n in zip(box, shape)):
            raise ValueError(f"block {block['file']} index {box} is outside "
                             f"shape {shape} of {record['key']!r}")
        for other in boxes:
            if all(a < d and c < b for (a, b), (c, d) in zip(box, other)):
                raise ValueError(f"blocks of {record['key']!r} overlap")
        boxes.append(box)
        volume += int(np.prod([b - a for a, b in box]))
    if volume != int(np.prod(shape)):
        raise ValueError(f"blocks of {record['key']!r} do not cover its "
                         f"shape {shape}")


def _open_blocks(path, record):
    """[(box, memory-mapped array)] of a variable's saved blocks, checked
    (exists, readable, shape and dtype as the manifest says)."""
    dtype = tf.as_dtype(record["dtype"]).as_numpy_dtype
    opened = []
    for block in record["blocks"]:
        file = os.path.join(path, block["file"])
        box = [(int(a), int(b)) for a, b in block["index"]]
        expected = tuple(b - a for a, b in box)
        try:
            if int(np.prod(expected)) == 0:
                array = np.load(file, allow_pickle=False)
            else:
                array = np.load(file, mmap_mode="r", allow_pickle=False)
        except FileNotFoundError:
            raise ValueError(
                f"Checkpoint block file {file!r} (of {record['key']!r}) is "
                "missing. No variable was changed.") from None
        except (OSError, ValueError, EOFError) as error:
            raise ValueError(
                f"Checkpoint block file {file!r} (of {record['key']!r}) is "
                f"truncated or corrupt: {error}. No variable was changed."
            ) from None
        if array.shape != expected or array.dtype != dtype:
            raise ValueError(
                f"Checkpoint block file {file!r} (of {record['key']!r}) holds "
                f"{array.shape} {array.dtype}, but the manifest says "
                f"{expected} {np.dtype(dtype)}. No variable was changed.")
        opened.append((box, array))
    return opened


def _cut(target, opened, record):
    """The global slice `target` [(start, stop)] assembled from saved blocks.

    Block math: a saved block covering [a, b) and the target [s, e) overlap
    on [max(a, s), min(b, e)) per dimension; that box is read from the block
    at offset -a and written into the target at offset -s. Only overlapping
    slices of the memory-mapped files are read.
    """
    out = np.empty([e - s for s, e in target],
                   dtype=tf.as_dtype(record["dtype"]).as_numpy_dtype)
    filled = 0
    for box, array in opened:
        inter = [(max(a, s), min(b, e)) for (a, b), (s, e) in zip(box, target)]
        if any(lo >= hi for lo, hi in inter):
            continue
        src = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, box))
        dst = tuple(slice(lo - s, hi - s)
                    for (lo, hi), (s, _) in zip(inter, target))
        out[dst] = array[src]
        filled += int(np.prod([hi - lo for lo, hi in inter]))
    if filled != out.size:  # guarded by _check_record; kept as a safety net
        raise ValueError(f"Saved blocks of {record['key']!r} do not cover "
                         f"{target}.")
    return out


def _assemble(variable, record, opened):
    """The restored value of `variable`: a DTensor packed block by block with
    the variable's own layout, or a host array for a plain variable."""
    backing = _compat.backing_variable(variable)
    shape = tuple(backing.shape)
    spec, axis_sizes, layout = _layout_of(backing)
    if layout is None:
        return _cut([(0, n) for n in shape], opened, record)
    cache, components = {}, []
    for location in layout.mesh.local_device_locations():
        # The target block of this device (same math as on save, with the
        # target's spec and mesh); devices with equal blocks share one read.
        index = placement.block_index(shape, spec, axis_sizes, location)
        target = tuple(tuple(s.indices(n)[:2]) for s, n in zip(index, shape))
        if target not in cache:
            cache[target] = tf.constant(_cut(target, opened, record))
        components.append(cache[target])
    return dtensor.pack(components, layout)
