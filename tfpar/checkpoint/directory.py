"""The checkpoint root: publishing, the `checkpoint` pointer, cleaning up.

Publishing a save (host 0; see `tfpar.checkpoint` for the layout):

* a new step: the complete `ckpt-N.tmp-<pid>` is renamed to `ckpt-N`, then
  the pointer file `checkpoint` is replaced (each step fsync'ed);
* a step that exists already (rename cannot replace a non-empty
  directory): the pointer is first pointed at the complete temporary
  directory (the commit: from then on it is the latest), then the old
  `ckpt-N` is renamed to `ckpt-N.old-<pid>`, the new one to `ckpt-N`, the
  pointer is pointed at `ckpt-N` and the old one deleted. A crash between
  any two of these leaves the pointer naming a complete checkpoint, or,
  when the pointer names what was just renamed, the complete `ckpt-N`.

`latest_checkpoint` reads the pointer (a `ckpt-N` or a committed
`ckpt-N.tmp-<pid>` holding a manifest), else the complete `ckpt-N` with the
highest step. At the next save, temporaries of saves whose process is gone
(`ckpt-N.tmp-<pid>`, `ckpt-N.old-<pid>` of a dead pid on this machine)
are deleted, never the one the pointer names; `max_to_keep` deletes the
oldest complete checkpoints (renamed to `.old-<pid>` first, so none is ever
seen half deleted).
"""

import json
import os
import re
import shutil
import zlib

from tfpar.checkpoint import files

CKPT_DIR = re.compile(r"ckpt-(\d+)")
_COMMITTED = re.compile(r"ckpt-(\d+)(?:\.tmp-\d+)?")
_LEFTOVER = re.compile(r"ckpt-(\d+)\.(tmp|old)-(\d+)")


def _complete(directory, name):
    """A manifest is there (whatever it is: reading it checks it)."""
    return os.path.lexists(os.path.join(directory, name, files.MANIFEST))


def pointed(directory):
    """The name the pointer file names, if it is a complete checkpoint."""
    try:
        with files.open_regular(os.path.join(directory, files.POINTER),
                                "Checkpoint pointer") as f:
            data = f.read(1 << 16)
        name = json.loads(data)["latest"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None
    if (isinstance(name, str) and _COMMITTED.fullmatch(name)
            and _complete(directory, name)):
        return name
    return None


def complete_steps(directory):
    """{step: name} of the complete `ckpt-<step>` directories."""
    steps = {}
    for name in os.listdir(directory):
        match = CKPT_DIR.fullmatch(name)
        if match and _complete(directory, name):
            steps[int(match[1])] = name
    return steps


def latest_checkpoint(directory):
    """The path of the latest complete checkpoint in `directory`, or None.

    The `checkpoint` pointer file names it; if the pointer is missing,
    unreadable or names a directory that does not exist, the complete
    `ckpt-<step>` directory (one holding a manifest) with the highest step is
    returned. Unfinished `ckpt-<step>.tmp-<pid>` directories never count
    (one the pointer names is complete: a re-save committed it).

    Example:

    >>> latest_checkpoint("/tmp/run")
    '/tmp/run/ckpt-12'
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return None
    name = pointed(directory)
    if name is None:
        steps = complete_steps(directory)
        name = steps[max(steps)] if steps else None
    return None if name is None else os.path.join(directory, name)


def candidates(directory, step):
    """Paths that may hold checkpoint `step` in `directory` as this host
    sees it: the pointer's target if it has that step, then `ckpt-<step>`."""
    found = []
    name = pointed(directory)
    if name is not None and int(_COMMITTED.fullmatch(name)[1]) == step:
        found.append(os.path.join(directory, name))
    if _complete(directory, f"ckpt-{step}"):
        found.append(os.path.join(directory, f"ckpt-{step}"))
    return found


def manifest_crc32(path):
    """CRC-32 of a checkpoint's manifest bytes (which checkpoint it is)."""
    with files.open_regular(os.path.join(path, files.MANIFEST),
                            "Checkpoint manifest") as f:
        return zlib.crc32(f.read())


def _point_at(directory, name, step):
    files.write_file(os.path.join(directory, files.POINTER),
                     json.dumps({"latest": name, "step": step}).encode(),
                     atomic=True)
    files.fsync_dir(directory)


def publish(directory, step, tmp):
    """Host 0: makes the complete `tmp` the checkpoint `ckpt-<step>` and
    the latest (see the module docstring for the order of the steps)."""
    name = f"ckpt-{step}"
    final = os.path.join(directory, name)
    old = None
    if os.path.exists(final):
        # The commit: the pointer names the complete new one before the old
        # one is moved away.
        _point_at(directory, os.path.basename(tmp), step)
        old = os.path.join(directory, f"{name}.old-{os.getpid()}")
        os.rename(final, old)
    os.rename(tmp, final)
    files.fsync_dir(directory)
    _point_at(directory, name, step)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _pid_is_gone(pid):
    """True if no process `pid` runs on this machine."""
    if pid == os.getpid():
        return False   # ours: this process's save in progress
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, OSError):
        return False
    return False


def finish_interrupted(directory):
    """Host 0, before a save: a re-save whose process died after its commit
    (the pointer names its complete `ckpt-N.tmp-<pid>`) is published as
    `ckpt-N` now. Returns the path published, or None."""
    name = pointed(directory)
    match = _LEFTOVER.fullmatch(name or "")
    if match is None or not _pid_is_gone(int(match[3])):
        return None
    return publish(directory, int(match[1]), os.path.join(directory, name))


def remove_stale(directory):
    """Host 0, before a save: deletes `ckpt-N.tmp-<pid>` / `.old-<pid>`
    leftovers of saves whose process is gone, except the one the pointer
    names (see `finish_interrupted`). Returns the names deleted."""
    if not os.path.isdir(directory):
        return []
    finish_interrupted(directory)
    spared = {pointed(directory)}
    removed = []
    for name in sorted(os.listdir(directory)):
        match = _LEFTOVER.fullmatch(name)
        if match and name not in spared and _pid_is_gone(int(match[3])):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
            removed.append(name)
    return removed


def keep_newest(directory, max_to_keep, just_saved):
    """Host 0, after a save: keeps `just_saved` and the `max_to_keep - 1`
    other complete checkpoints with the highest steps; each other one is
    renamed to `.old-<pid>` (atomically out of sight) and deleted. Returns
    the steps deleted."""
    steps = complete_steps(directory)
    others = sorted((s for s in steps if s != just_saved), reverse=True)
    doomed = others[max_to_keep - 1:]
    for step in doomed:
        old = os.path.join(directory, f"ckpt-{step}.old-{os.getpid()}")
        os.rename(os.path.join(directory, steps[step]), old)
        shutil.rmtree(old, ignore_errors=True)
    if doomed:
        files.fsync_dir(directory)
    return doomed
