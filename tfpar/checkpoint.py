"""Sharded, reshardable, crash-safe checkpoints (issue 5, items 2-4).

A checkpoint is a directory of `.npy` block files plus a `manifest.json`:

    directory/
      checkpoint                  pointer: {"latest": "ckpt-12", "step": 12}
      ckpt-8/                     an older complete checkpoint
      ckpt-12/
        manifest.json             written last: the directory is complete;
                                  per block: file, index, crc32
        v0000_mlp_up_kernel.b0.npy ... one file per distinct block
      ckpt-16.tmp-4242/           a save that never finished: ignored

Saving never assembles a sharded variable anywhere: each device's block is
read from that device's own component (`dtensor.unpack`) and written to its
own file; devices holding the same block (replicas) write it once. The
manifest records the CRC-32 of every file's bytes, computed from memory while
the file is written. Restoring works onto any mesh and layout: first the
manifest, the model's variables and every block file are checked (header,
size, CRC-32 of all bytes, streamed in chunks), so a damaged checkpoint
raises a ValueError naming the file and leaves the model untouched. Then,
one variable at a time, every device's target block is cut out of the saved
blocks that overlap it (memory-mapped, so only the needed slices are read),
the blocks are packed onto the mesh and the variable is assigned: restoring
needs extra memory for one variable, not for the whole model.

Across several hosts (`tfpar.connect_hosts`) every host saves into the same
directory (which all must see): each writes the blocks its own devices own
(a block several devices hold is written by the lowest-numbered one, file
`<stem>.b<device>.npy`), host 0 merges the hosts' records into the
manifest and publishes; every step is agreed on, so a failure on any host
raises on all and publishes nothing.

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
import tokenize
import zlib

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import _compat
from tfpar import layout as layout_lib
from tfpar import placement
from tfpar import training

FORMAT = "tfpar-checkpoint"
# Version 2 added the per-file "crc32"; version 1 checkpoints (no checksums)
# are still read, without the checksum check.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
POINTER = "checkpoint"
_CKPT_DIR = re.compile(r"ckpt-(\d+)")
_CHUNK = 1 << 22        # bytes per write / checksum read: 4 MiB
_MAX_STEM = 96          # characters of the variable key kept in file names


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
    step = _checkpoint_step(model, step)
    directory = os.fspath(directory)
    name = f"ckpt-{step}"
    final = os.path.join(directory, name)
    # Several hosts (`tfpar.connect_hosts`, a directory they all see): each
    # writes the blocks its devices own into host 0's temporary directory,
    # then host 0 merges their records and publishes. Every step is agreed
    # on by all hosts, so a failure anywhere raises everywhere and nothing
    # is published.
    hosts, host = dtensor.num_clients(), dtensor.client_id()
    tag = int(placement.same_on_every_host(np.array(os.getpid(), np.int64)))
    tmp = os.path.join(directory, f"{name}.tmp-{tag}")

    def create():
        os.makedirs(directory, exist_ok=True)
        if host == 0:
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
            os.makedirs(tmp)

    def write_blocks():
        records = [_save_variable(n, kind, key, variable, tmp)
                   for n, (kind, key, variable) in enumerate(entries)]
        if hosts > 1:
            _write_file(os.path.join(tmp, f"host{host}.json"),
                        json.dumps(records).encode())
        return records

    def publish():  # host 0: the manifest, then the rename
        if host != 0:
            return
        try:
            manifest = _manifest_header(step, model)
            manifest["variables"] = (_merge_host_records(tmp, hosts)
                                     if hosts > 1 else records)
            _write_file(os.path.join(tmp, MANIFEST),
                        json.dumps(manifest, indent=1).encode())
            _fsync_dir(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        # A failed publish leaves both directories for inspection.
        _publish(directory, name, final, tmp, step)

    _agreed(create, "save_checkpoint failed on another host while creating "
            f"{tmp!r}; nothing was written (see that host's error).")
    try:
        records = _agreed(
            write_blocks, "save_checkpoint failed on another host while "
            "writing blocks; nothing was published (see that host's error).")
    except BaseException:
        if host == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _agreed(publish, "save_checkpoint: host 0 failed to publish the "
            "checkpoint (see its error); the previous checkpoint is still "
            "the latest.")
    return final


def _checkpoint_step(model, step):
    """`step` as an int >= 0; None: the optimizer's iterations."""
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
    return step


def _agreed(function, failed_elsewhere):
    """`function()`'s result, agreed on by every host: if it raised on any
    host it raises on all of them, its own error where it failed and
    RuntimeError(failed_elsewhere) on the others, so that none is left
    waiting in a collective. One host: just `function()`; several: a
    collective after it."""
    error, result = None, None
    try:
        result = function()
    except BaseException as caught:  # noqa: BLE001 (agreed on, re-raised)
        error = caught
    if int(placement.sum_over_hosts(np.int64(error is not None))):
        raise error or RuntimeError(failed_elsewhere)
    return result


def _merge_host_records(tmp, hosts):
    """Host 0: every variable's record with the blocks of all hosts (each
    host wrote the blocks its devices own; the other fields agree)."""
    parts = []
    for h in range(hosts):
        part = os.path.join(tmp, f"host{h}.json")
        with open(part, "rb") as f:
            parts.append(json.loads(f.read()))
        os.remove(part)
    merged = parts[0]
    for other in parts[1:]:
        for record, more in zip(merged, other):
            record["blocks"] += more["blocks"]
    return merged


def _publish(directory, name, final, tmp, step):
    """Renames the complete `tmp` to `final`, then points `checkpoint` at
    it (each step fsync'ed)."""
    # An atomic rename makes the complete directory appear at once.
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
    `data=8` or into a single-device model.

    Everything is checked before the first variable changes: names, shapes,
    dtypes, the manifest, and every block file's header, size and CRC-32
    (streamed in 4 MiB chunks). A missing, truncated or bit-flipped file
    raises a ValueError and no weight is modified. Only then are the
    variables read and assigned one at a time, so the extra host/device
    memory is that of one variable, not of a second copy of the model.

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
            damaged manifest, a block file that is missing, truncated, of
            the wrong shape/dtype or whose CRC-32 differs from the
            manifest's. The message names them.
        RuntimeError: reading or assigning failed after the checks passed
            (a file changed or vanished while the restore ran, out of
            memory): the message says how many variables were already
            restored; restore again.
    """
    # Across hosts each phase is agreed on (`_agreed`): a host whose files
    # fail raises on every host, none waits in a collective for it.
    path, manifest = _agreed(
        lambda: _locate(directory),
        _restore_failed_elsewhere("reading the checkpoint"))
    saved = {(r["kind"], r["key"]): r for r in manifest["variables"]}
    if optimizer:
        _build_optimizer(model)
    entries = _entries(model, optimizer)
    targets = {(kind, key): variable for kind, key, variable in entries}
    _agreed(lambda: _check_fit(path, manifest, saved, targets, model,
                               optimizer),
            _restore_failed_elsewhere("checking the checkpoint"))
    # 3. Only now change the model, one variable at a time: its blocks are
    #    memory-mapped (one variable's files open at a time; each map holds
    #    a file descriptor and a model has thousands of blocks), its target
    #    value is packed onto the mesh and assigned, then dropped.
    _agreed(lambda: _assign_all(path, saved, targets, model, optimizer),
            _restore_failed_elsewhere("restoring"))
    return int(manifest["step"])


def _restore_failed_elsewhere(what):
    return (f"restore_checkpoint failed on another host while {what} (see "
            "that host's error); restore again on every host.")


def _locate(directory):
    """(checkpoint path, its manifest) for a root or a ckpt-<step> dir."""
    directory = os.fspath(directory)
    if os.path.isfile(os.path.join(directory, MANIFEST)):
        path = directory
    else:
        path = latest_checkpoint(directory)
        if path is None:
            raise FileNotFoundError(
                f"No complete checkpoint in {directory!r} (no 'checkpoint' "
                "pointer and no ckpt-<step>/manifest.json).")
    return path, _read_manifest(path)


def _check_fit(path, manifest, saved, targets, model, optimizer):
    """Raises ValueError unless the checkpoint fits the model and every
    block file is intact; reads files, changes nothing."""
    kinds = ("params", "optimizer") if optimizer else ("params",)
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

    # 2. Every block file against the manifest: present, header shape and
    #    dtype, size, and (format 2) CRC-32 of all its bytes. Files are
    #    streamed and closed again: memory and open files stay bounded.
    checksums = int(manifest["format_version"]) >= 2
    for ident, variable in targets.items():
        for block in saved[ident]["blocks"]:
            _verify_block(path, saved[ident], block, checksums)


def _assign_all(path, saved, targets, model, optimizer):
    """Assigns every target from its saved blocks (after `_check_fit`)."""
    done = 0
    try:
        for ident, variable in targets.items():
            value = _assemble(variable, saved[ident],
                              _open_blocks(path, saved[ident]))
            _compat.backing_variable(variable).assign(value)
            del value
            done += 1
        if isinstance(model, training.StagedModel):
            # PipelineModel: counters of every part's optimizer, and the
            # persistent copies of tied weights (and their slots).
            if optimizer:
                model.sync_stage_optimizers(iterations=True)
            model.sync_tied_copies(optimizer=optimizer)
    except Exception as error:
        if done == 0:
            raise
        raise RuntimeError(
            f"Restoring {path!r} failed at {ident[1]!r} after {done} of "
            f"{len(targets)} variables were restored: {error}. Every file "
            "had passed its checks, so it changed or vanished during the "
            "restore, or memory ran out. The model is partly restored: "
            "restore it again.") from error


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
        # A tfpar.PipelineModel has one optimizer per stage: the slots of
        # all of them, the counters of the main one (the others mirror it),
        # so its checkpoints are those of the plain model.
        staged = isinstance(model, training.StagedModel)
        # The slots of tied weights' copies mirror the weights' own.
        mirrors = {id(v) for v in model.tied_copy_state()} if staged else ()
        for stage_opt in (model.stage_optimizers if staged else None) or [opt]:
            for variable in stage_opt.variables:
                key = _optimizer_key(variable, trainable)
                if id(variable) in mirrors:
                    continue
                if stage_opt is opt or ":" in key:
                    entries.append(("optimizer", key, variable))
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
    if isinstance(model, training.StagedModel):
        model.stage_optimizers  # noqa: B018 (builds each stage's optimizer)
        return
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
        return (layout_lib.spec_of(layout), layout_lib.axis_sizes_of(layout),
                layout)
    return (None,) * len(backing.shape), {}, None


def _host_value(backing):
    """A replicated/plain variable's value from one device (no gather)."""
    value = backing.read_value()
    if dtensor.is_dtensor(value) and dtensor.num_clients() > 1:
        return placement.fetch(value)  # maybe another host's (a collective)
    if dtensor.is_dtensor(value):
        value = dtensor.unpack(value)[0]
    return value.numpy()


def _save_variable(n, kind, key, variable, tmp):
    backing = _compat.backing_variable(variable)
    # offload="optimizer+master": the float32 master on the host devices,
    # laid out like the devices' compute-dtype copy (`tfpar.offload_master`).
    backing = getattr(backing, "master", backing)
    shape = tuple(backing.shape)
    spec, axis_sizes, layout = _layout_of(backing)
    # File names: "v<n>_" keeps them unique; the key's tail only informs
    # (cut so that a deeply nested path stays under the 255-byte limit).
    stem = f"v{n:04d}_" + re.sub(r"[^A-Za-z0-9_.-]+", "_", key)[-_MAX_STEM:]
    blocks = []
    if layout is None:
        components = [backing.read_value()]
        locations = [{}]
        device_ids = [0]
        # A plain variable: each host has its own copy; host 0 writes it.
        owners = None if dtensor.client_id() == 0 else {}
    else:
        # One component per local device, in `local_device_locations` order
        # (none on another host's pipeline stage). Only that device's block
        # is copied to the host: never the variable.
        device_ids = layout.mesh.local_device_ids()
        components = dtensor.unpack(backing.read_value()) if device_ids \
            else []
        locations = placement.local_locations(layout.mesh)
        owners = _block_owners(shape, spec, axis_sizes, layout.mesh)

    for component, location, device in zip(components, locations,
                                           device_ids):
        # Block math: along a dimension of size n split over an axis of size
        # k, the device at coordinate c holds [c*n/k, (c+1)*n/k);
        # replicated dimensions are whole [0, n).
        box = placement.block_ranges(shape, spec, axis_sizes, location)
        ranges = [list(r) for r in box]
        # Replicas share one block: the device with the lowest id writes it
        # (on whichever host it is).
        if owners is not None and owners.get(box) != device:
            continue
        file = f"{stem}.b{device}.npy"
        array = component.numpy()
        expected = tuple(b - a for a, b in ranges)
        if array.shape != expected:  # a layout we do not understand
            raise RuntimeError(
                f"Block of {key!r} on device {location} has shape "
                f"{array.shape}, expected {expected} for spec {spec}.")
        crc = _write_npy(os.path.join(tmp, file), array)
        blocks.append({"file": file, "index": ranges, "crc32": crc})
    return {"kind": kind, "key": key, "path": variable.path,
            "shape": list(shape), "dtype": tf.as_dtype(backing.dtype).name,
            "spec": list(spec), "blocks": blocks}


def _block_owners(shape, spec, axis_sizes, dmesh):
    """{block ranges: the lowest global id of the devices holding it}, over
    every device of the mesh (global ids in row-major mesh order)."""
    owners = {}
    ids = np.ravel(dmesh.global_device_ids())
    for position in range(dmesh.size):
        coords = np.unravel_index(position, tuple(dmesh.shape()))
        location = dict(zip(dmesh.dim_names, (int(c) for c in coords)))
        owners.setdefault(
            placement.block_ranges(shape, spec, axis_sizes, location),
            int(ids[position]))
    return owners


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
    """Writes one `.npy` block file, fsyncs it and returns its CRC-32.

    The checksum covers every byte of the file (header and data) and is
    computed from memory while writing, chunk by chunk: no re-read and no
    copy of the block (CRC-32 is chained, crc(a + b) = crc32(b, crc(a))).
    Tests patch this function to crash.

    Example:

    >>> crc = _write_npy("/tmp/b.npy", np.arange(4.0))
    >>> crc == zlib.crc32(open("/tmp/b.npy", "rb").read())
    True
    """
    array = np.require(array, requirements="C")
    header = np.lib.format.header_data_from_array_1_0(array)
    with open(path, "wb") as f:
        writer = _Crc32Writer(f)
        try:
            np.lib.format.write_array_header_1_0(writer, header)
        except ValueError:  # header over 64 KiB: format 2.0 (as np.save)
            np.lib.format.write_array_header_2_0(writer, header)
        # Raw bytes of the block in C order; a view, never a copy (also for
        # dtypes numpy cannot name, e.g. bfloat16, stored as void "V2").
        data = array.reshape(-1).view(np.uint8)
        for start in range(0, data.size, _CHUNK):
            writer.write(data[start:start + _CHUNK])
        f.flush()
        os.fsync(f.fileno())
    return writer.crc


class _Crc32Writer:
    """A write-only file wrapper that keeps the CRC-32 of what it wrote."""

    def __init__(self, file):
        self.file, self.crc = file, 0

    def write(self, data):
        self.crc = zlib.crc32(data, self.crc)
        return self.file.write(data)


def _file_crc32(file):
    """CRC-32 of a file's bytes, read in `_CHUNK` pieces into one buffer."""
    crc = 0
    with open(file, "rb", buffering=0) as f:
        buffer = bytearray(min(_CHUNK, max(os.fstat(f.fileno()).st_size, 1)))
        view = memoryview(buffer)
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return crc


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
    elif manifest.get("format_version") not in READABLE_VERSIONS:
        problem = (f"format_version {manifest.get('format_version')!r} is "
                   f"not one of {READABLE_VERSIONS} that this tfpar reads "
                   "(written by tfpar "
                   f"{manifest.get('versions', {}).get('tfpar')}; use that "
                   "version to restore it)")
    else:
        try:
            int(manifest["step"])
            for record in manifest["variables"]:
                _check_record(record, manifest["format_version"] >= 2)
        except (KeyError, TypeError, ValueError) as error:
            problem = f"a variable entry is malformed ({error})"
    if problem:
        raise ValueError(f"Checkpoint manifest {file!r} is damaged: {problem}. "
                         "No variable was changed.")
    return manifest


def _check_record(record, checksums):
    """Blocks must lie inside the variable, not overlap, and tile it; with
    `checksums` each must carry a CRC-32 (an int in [0, 2**32))."""
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
        if checksums and not (isinstance(block.get("crc32"), int)
                              and 0 <= block["crc32"] < 2**32):
            raise ValueError(f"block {block['file']} has no valid crc32 "
                             f"(got {block.get('crc32')!r})")
        box = [(int(a), int(b)) for a, b in block["index"]]
        # Empty boxes (a == b) only arise in zero-size variables; they add
        # no volume, so "no overlap and volumes sum to the variable's" still
        # means the blocks tile it.
        if len(box) != len(shape) or any(
                not 0 <= a <= b <= n for (a, b), n in zip(box, shape)):
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


def _load_block(path, record, block):
    """(box, memory-mapped array) of one saved block, checked: the file
    exists, its header parses, its size fits the header, and shape and dtype
    are the manifest's."""
    dtype = np.dtype(tf.as_dtype(record["dtype"]).as_numpy_dtype)
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
    except (OSError, ValueError, EOFError, tokenize.TokenError) as error:
        # numpy parses the .npy header with Python's tokenizer: a damaged
        # header can also raise its TokenError.
        raise ValueError(
            f"Checkpoint block file {file!r} (of {record['key']!r}) is "
            f"truncated or corrupt: {error}. No variable was changed."
        ) from None
    # .npy cannot name dtypes outside numpy (bfloat16, float8_*): they are
    # stored as raw void items of the same size ("V2") and viewed back.
    if (array.dtype != dtype and array.dtype.kind == dtype.kind == "V"
            and array.dtype.names is None
            and array.dtype.itemsize == dtype.itemsize):
        array = array.view(dtype)
    if array.shape != expected or array.dtype != dtype:
        raise ValueError(
            f"Checkpoint block file {file!r} (of {record['key']!r}) holds "
            f"{array.shape} {array.dtype}, but the manifest says "
            f"{expected} {dtype}. No variable was changed.")
    return box, array


def _verify_block(path, record, block, checksums):
    """Checks one block file (see `_load_block`) and, with `checksums`, that
    the CRC-32 of its bytes is the one recorded when it was written. The
    file is streamed, not kept: nothing stays mapped or open."""
    _load_block(path, record, block)   # the map is closed when dropped
    if not checksums:
        return
    file = os.path.join(path, block["file"])
    try:
        crc = _file_crc32(file)
    except OSError as error:
        raise ValueError(
            f"Checkpoint block file {file!r} (of {record['key']!r}) cannot "
            f"be read: {error}. No variable was changed.") from None
    if crc != block["crc32"]:
        raise ValueError(
            f"Checkpoint block file {file!r} (of {record['key']!r}) is "
            f"corrupt: its CRC-32 is {crc:#010x} but the manifest recorded "
            f"{block['crc32']:#010x} when it was saved, so its bytes changed "
            "on disk or in a copy. Copy the checkpoint again from a good "
            "source, or restore an older one by passing its ckpt-<step> "
            "directory. No variable was changed.")


def _open_blocks(path, record):
    """[(box, memory-mapped array)] of a variable's saved blocks, checked
    (exists, readable, shape and dtype as the manifest says)."""
    return [_load_block(path, record, block) for block in record["blocks"]]


def _cut(target, opened, record):
    """The global slice `target` [(start, stop)] assembled from saved blocks.

    Block math: a saved block covering [a, b) and the target [s, e) overlap
    on [max(a, s), min(b, e)) per dimension; that box is read from the block
    at offset -a and written into the target at offset -s. Only overlapping
    slices of the memory-mapped files are read.

    A target inside one saved block (a ≤ s and e ≤ b in every dimension:
    restoring onto the saved layout, or a finer one) is returned as a view
    of that block's map: the caller's conversion to a tensor is then the
    only copy.
    """
    for box, array in opened:
        if all(a <= s and e <= b for (a, b), (s, e) in zip(box, target)):
            return np.asarray(array[tuple(
                slice(s - a, e - a) for (a, _), (s, e) in zip(box, target))])
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
    if not layout.mesh.local_device_ids():  # another host's stage
        return placement.stand_in(layout, shape, backing.dtype)
    cache, components = {}, []
    for location in placement.local_locations(layout.mesh):
        # The target block of this device (same math as on save, with the
        # target's spec and mesh); devices with equal blocks share one read.
        target = placement.block_ranges(shape, spec, axis_sizes, location)
        if target not in cache:
            cache[target] = tf.constant(_cut(target, opened, record))
        components.append(cache[target])
    return dtensor.pack(components, layout)
