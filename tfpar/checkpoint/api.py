"""Saving, restoring and finding checkpoints; every step agreed by all hosts.

`save_checkpoint` writes each device's blocks (`blocks`) into a temporary
directory, the manifest last (`files`), and publishes it by an atomic
rename; `restore_checkpoint` checks the manifest, the model's variables
(`keys`) and every block file before the first variable changes, then
restores one variable at a time. Across hosts each phase runs on every host
and is agreed on (`_agreed`): a failure anywhere raises everywhere.
"""

import json
import os
import re
import shutil

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import _compat
from tfpar import placement
from tfpar import training
from tfpar.checkpoint import blocks
from tfpar.checkpoint import files
from tfpar.checkpoint import keys

_CKPT_DIR = re.compile(r"ckpt-(\d+)")


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
    entries = keys.entries(model, optimizer)
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
        records = [blocks.save_variable(n, kind, key, variable, tmp)
                   for n, (kind, key, variable) in enumerate(entries)]
        if hosts > 1:
            files.write_file(os.path.join(tmp, f"host{host}.json"),
                             json.dumps(records).encode())
        return records

    def publish():  # host 0: the manifest, then the rename
        if host != 0:
            return
        try:
            _write_manifest(tmp, step, model, records, hosts)
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
        step = int(blocks.host_value(_compat.backing_variable(
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


def _write_manifest(tmp, step, model, records, hosts):
    """Host 0: `tmp`'s manifest, with every host's block records, fsync'ed."""
    mesh = getattr(model.distribute_strategy, "mesh", None)
    manifest = files.manifest_header(step,
                                     None if mesh is None else mesh.shape)
    manifest["variables"] = (_merge_host_records(tmp, hosts) if hosts > 1
                             else records)
    files.write_file(os.path.join(tmp, files.MANIFEST),
                     json.dumps(manifest, indent=1).encode())
    files.fsync_dir(tmp)


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
    files.fsync_dir(directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    files.write_file(os.path.join(directory, files.POINTER),
                     json.dumps({"latest": name, "step": step}).encode(),
                     atomic=True)
    files.fsync_dir(directory)


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
        with open(os.path.join(directory, files.POINTER), "rb") as f:
            name = json.loads(f.read())["latest"]
        if _CKPT_DIR.fullmatch(name) and os.path.isfile(
                os.path.join(directory, name, files.MANIFEST)):
            return os.path.join(directory, name)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    steps = []
    for name in os.listdir(directory):
        match = _CKPT_DIR.fullmatch(name)
        if match and os.path.isfile(
                os.path.join(directory, name, files.MANIFEST)):
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
        keys.build_optimizer(model)
    entries = keys.entries(model, optimizer)
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
    if os.path.isfile(os.path.join(directory, files.MANIFEST)):
        path = directory
    else:
        path = latest_checkpoint(directory)
        if path is None:
            raise FileNotFoundError(
                f"No complete checkpoint in {directory!r} (no 'checkpoint' "
                "pointer and no ckpt-<step>/manifest.json).")
    return path, files.read_manifest(path)


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
            files.verify_block(path, saved[ident], block, checksums)


def _assign_all(path, saved, targets, model, optimizer):
    """Assigns every target from its saved blocks (after `_check_fit`)."""
    done = 0
    try:
        for ident, variable in targets.items():
            value = blocks.assemble(variable, saved[ident],
                                    files.open_blocks(path, saved[ident]))
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
