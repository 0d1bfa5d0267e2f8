"""Saving, restoring and finding checkpoints; every step agreed by all hosts.

`save_checkpoint` writes each device's blocks (`blocks`) into a temporary
directory, the manifest last (`manifest`), and publishes it (`directory`:
atomic renames, the pointer as commit marker, stale temporaries and
`max_to_keep`); `restore_checkpoint` checks the manifest, the model's
variables (`keys`) and every block file before the first variable changes,
then restores one variable at a time. Across hosts each phase runs on every
host and is agreed on (`_agreed`): a failure anywhere raises everywhere.
Host 0 chooses the checkpoint to restore; every host restores that one.
"""

import json
import numbers
import os
import shutil

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import _compat
from tfpar import placement
from tfpar import training
from tfpar.checkpoint import blocks
from tfpar.checkpoint import directory as root
from tfpar.checkpoint import files
from tfpar.checkpoint import keys
from tfpar.checkpoint import manifest as manifest_lib

latest_checkpoint = root.latest_checkpoint


def save_checkpoint(model, directory, optimizer=True, step=None,
                    max_to_keep=None):
    """Saves `model` (and its optimizer state) as `directory/ckpt-<step>/`.

    Every device's block of a sharded variable is written from that device
    (one `.npy` per distinct block); replicated variables are written once.
    The files go to `ckpt-<step>.tmp-<pid>/`, are fsync'ed, the manifest
    (with its own CRC-32) is written last, the directory is renamed
    atomically to `ckpt-<step>`, and only then is the `checkpoint` pointer
    file replaced. Re-saving an existing step commits the new directory
    through the pointer before the old one is moved away. A crash at any
    point leaves the previous checkpoints intact and `latest_checkpoint`
    pointing at a complete one. Leftover temporaries of saves whose process
    is gone are deleted first.

    Example:

    >>> path = save_checkpoint(model, "/tmp/run", max_to_keep=3)
    >>> os.path.basename(path)   # step = model.optimizer.iterations
    'ckpt-0'

    Args:
        model: a Keras model, under a `tfpar.ParallelStrategy` or not.
        directory: the checkpoint root (created if needed).
        optimizer: also save `model.optimizer.variables` (the optimizer is
            built first if it is not yet).
        step: an int >= 0 for the directory name; defaults to
            `model.optimizer.iterations`.
        max_to_keep: None (keep all) or an int >= 1: after the save, only
            this checkpoint and the `max_to_keep - 1` others with the
            highest steps are kept.

    Returns:
        The path of the complete checkpoint directory.

    Raises:
        ValueError: `step` or `max_to_keep` out of range or not an int, no
            optimizer to save or to take the step from, two variables with
            the same key, hosts whose records of the variables differ.
    """
    if max_to_keep is not None:
        _nonnegative_int(max_to_keep, "save_checkpoint", "max_to_keep",
                         minimum=1)
    if step is not None:
        _nonnegative_int(step, "save_checkpoint", "step")
    entries = keys.entries(model, optimizer)
    step = _checkpoint_step(model, step)
    directory = os.fspath(directory)
    # Several hosts (`tfpar.connect_hosts`, a directory they all see): each
    # writes the blocks its devices own into host 0's temporary directory,
    # then host 0 merges their records and publishes. Every step is agreed
    # on by all hosts, so a failure anywhere raises everywhere and nothing
    # is published.
    hosts, host = dtensor.num_clients(), dtensor.client_id()
    tag = int(placement.same_on_every_host(np.array(os.getpid(), np.int64)))
    tmp = os.path.join(directory, f"ckpt-{step}.tmp-{tag}")

    def create():
        os.makedirs(directory, exist_ok=True)
        if host == 0:
            root.remove_stale(directory)
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

    def publish():  # host 0: the manifest, then the renames
        if host != 0:
            return
        try:
            _write_manifest(tmp, step, model, records, hosts)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        # A failed publish leaves the directories for inspection.
        root.publish(directory, step, tmp)
        if max_to_keep is not None:
            root.keep_newest(directory, max_to_keep, step)

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
    return os.path.join(directory, f"ckpt-{step}")


def _nonnegative_int(value, function, argument, minimum=0):
    """`value` as an int >= `minimum`, else a ValueError naming it."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
            or int(value) < minimum):
        raise ValueError(
            f"{function}({argument}) must be an integer >= {minimum}. "
            f"Received: {argument}={value!r} ({type(value).__name__}). "
            f"Pass a Python int, e.g. {argument}={max(minimum, 1)}.")
    return int(value)


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
    return _nonnegative_int(step, "save_checkpoint", "step")


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
    manifest = manifest_lib.header(step,
                                   None if mesh is None else mesh.shape)
    manifest["variables"] = (_merge_host_records(tmp, hosts) if hosts > 1
                             else records)
    files.write_file(os.path.join(tmp, files.MANIFEST),
                     manifest_lib.encode(manifest))
    files.fsync_dir(tmp)


def _merge_host_records(tmp, hosts):
    """Host 0: every variable's record with the blocks of all hosts (each
    host wrote the blocks its devices own). The hosts' records must name
    the same variables, in the same order, with the same shape, dtype and
    layout; the merged blocks must tile every variable."""
    parts = []
    for h in range(hosts):
        part = os.path.join(tmp, f"host{h}.json")
        with files.open_regular(part, "Host record file") as f:
            parts.append(manifest_lib.parse_json(f.read(), part))
        os.remove(part)
    merged = parts[0]
    for h, other in enumerate(parts[1:], start=1):
        _check_same_records(merged, other, h)
        for record, more in zip(merged, other):
            record["blocks"] += more["blocks"]
    for record in merged:
        manifest_lib.check_record(record, checksums=True)
    return merged


def _check_same_records(first, other, host):
    """ValueError unless host `host`'s records describe host 0's variables."""
    fields = ("kind", "key", "shape", "dtype", "spec")
    described = [[r.get(k) for k in fields] for r in first]
    theirs = [[r.get(k) for k in fields] for r in other]
    if described != theirs:
        differ = [a[1] for a, b in zip(described, theirs) if a != b][:5]
        raise ValueError(
            f"save_checkpoint: host {host} saved {len(theirs)} variables and "
            f"host 0 {len(described)}; they differ at {differ or 'the end'}. "
            "Every host must build the same model (same layers, names and "
            "order) under the same strategy. Nothing was published.")


def restore_checkpoint(model, directory, optimizer=True, step=None,
                       allow_older_format=False):
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
        step: None (the latest) or an int >= 0: restore `ckpt-<step>`.
        allow_older_format: also read manifests of format versions 1 and 2
            (written by older tfpar: no manifest checksum, version 1 no
            block checksums either). Off by default, so that an edited
            manifest cannot turn the checks off.

    Across hosts, host 0 chooses the checkpoint (the latest as it sees the
    directory, or `step`) and every host restores that one, identified by
    the CRC-32 of its manifest; a host that cannot see it raises, and so do
    all the others.

    Returns:
        The step of the restored checkpoint.

    Raises:
        FileNotFoundError: no complete checkpoint in `directory` (or not
            the one host 0 chose).
        ValueError: `step` not an int >= 0, missing, extra or mismatched (shape/dtype) variables, a
            damaged manifest, a block file that is missing, truncated, of
            the wrong shape/dtype or whose CRC-32 differs from the
            manifest's. The message names them.
        RuntimeError: reading or assigning failed after the checks passed
            (a file changed or vanished while the restore ran, out of
            memory): the message says how many variables were already
            restored; restore again.
    """
    if step is not None:
        step = _nonnegative_int(step, "restore_checkpoint", "step")
    # Across hosts each phase is agreed on (`_agreed`): a host whose files
    # fail raises on every host, none waits in a collective for it.
    path, manifest = _choose_on_host0(os.fspath(directory), step,
                                      allow_older_format)
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


def _choose_on_host0(directory, step, allow_older_format):
    """(path, manifest) of the checkpoint host 0 chooses, on every host.

    Host 0 locates it; its step and the CRC-32 of its manifest's bytes go
    to every host (a collective), and each other host restores the
    checkpoint of that step whose manifest has the same bytes."""
    failed = _restore_failed_elsewhere("reading the checkpoint")
    if dtensor.num_clients() == 1:
        return _agreed(
            lambda: _locate(directory, step, allow_older_format), failed)
    host = dtensor.client_id()

    def on_host0():
        if host != 0:
            return None, None, [0, 0]
        path, manifest = _locate(directory, step, allow_older_format)
        return path, manifest, [manifest["step"], root.manifest_crc32(path)]

    path, manifest, choice = _agreed(on_host0, failed)
    chosen_step, crc = (int(v) for v in placement.same_on_every_host(
        np.array(choice, np.int64)))
    if host == 0:
        _agreed(lambda: None, failed)
        return path, manifest
    return _agreed(lambda: _find_chosen(directory, chosen_step, crc,
                                        allow_older_format), failed)


def _locate(directory, step, allow_older_format):
    """(checkpoint path, its manifest) for a root or a ckpt-<step> dir."""
    if os.path.lexists(os.path.join(directory, files.MANIFEST)):
        path = directory
    elif step is not None:
        there = os.path.isdir(directory)
        found = root.candidates(directory, step) if there else []
        if not found:
            saved = sorted(root.complete_steps(directory)) if there else []
            raise FileNotFoundError(
                f"No complete checkpoint of step {step} in {directory!r} "
                f"(no ckpt-{step}/manifest.json). Saved steps: {saved}.")
        path = found[0]
    else:
        path = latest_checkpoint(directory)
        if path is None:
            raise FileNotFoundError(
                f"No complete checkpoint in {directory!r} (no 'checkpoint' "
                "pointer and no ckpt-<step>/manifest.json).")
    manifest = manifest_lib.read(path, allow_older_format)
    if step is not None and manifest["step"] != step:
        raise ValueError(
            f"restore_checkpoint(step={step}): checkpoint {path!r} holds "
            f"step {manifest['step']}. Pass its root directory instead.")
    return path, manifest


def _find_chosen(directory, step, crc, allow_older_format):
    """A host but 0: the checkpoint of `step` whose manifest's CRC-32 is
    `crc` (host 0's choice) in `directory` as this host sees it."""
    if os.path.lexists(os.path.join(directory, files.MANIFEST)):
        found = [directory]
    else:
        found = root.candidates(directory, step) if os.path.isdir(
            directory) else []
    for path in found:
        if root.manifest_crc32(path) == crc:
            return path, manifest_lib.read(path, allow_older_format)
    seen = latest_checkpoint(directory) if os.path.isdir(directory) else None
    raise FileNotFoundError(
        f"No complete checkpoint of step {step} as host 0 chose it "
        f"(manifest CRC-32 {crc:#010x}) in {directory!r} as host "
        f"{dtensor.client_id()} sees it: "
        + (f"its ckpt-{step} has a different manifest"
           if found else f"the latest here is {seen!r}")
        + ". Every host must see the same checkpoint directory (a shared "
        "file system, fully synced) before restoring.")


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
    checksums = manifest["format_version"] >= 2
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
