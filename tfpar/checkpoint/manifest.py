"""The checkpoint's manifest: its fields, its own checksum, its checks.

`manifest.json` names the format, its version, the step, the saving mesh
and, per variable, its blocks (file, index, CRC-32 of the file). Since
format version 3 the manifest carries `manifest_crc32`, the CRC-32 of its
own canonical JSON (every other field, keys sorted, no spaces): an edited
or damaged manifest is refused, so an edit cannot turn a check off (e.g.
`format_version: 1`, which has no block checksums). Older formats (1: no
block checksums, 2: no manifest checksum) are read only when asked for
(`restore_checkpoint(..., allow_older_format=True)`).

Every malformed manifest is a ValueError naming the file: invalid JSON,
`NaN`/`Infinity`, JSON nested too deep, numbers out of range, fields of the
wrong type, blocks outside the variable, overlapping or not tiling it.
"""

import json
import math
import os
import time
import zlib

import keras
import numpy as np
import tensorflow as tf

from tfpar.checkpoint import files

FORMAT = "tfpar-checkpoint"
# Version 2 added the per-file "crc32", version 3 the manifest's own
# "manifest_crc32". Versions 1 and 2 are read only with allow_older_format.
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
_CHECKSUM = "manifest_crc32"


def header(step, mesh_shape):
    """The manifest's fields before its "variables": format, step, time,
    library versions and the saving mesh's {axis: size} (None: no mesh)."""
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "step": step,
        "created": time.time(),
        "versions": {"tfpar": files.tfpar_version(),
                     "tensorflow": tf.__version__,
                     "keras": keras.__version__, "numpy": np.__version__},
        "mesh": mesh_shape,
    }


def _canonical(manifest):
    """The bytes the manifest checksum covers: every field but the checksum,
    keys sorted, no whitespace (what json re-reads identically)."""
    body = {k: v for k, v in manifest.items() if k != _CHECKSUM}
    return json.dumps(body, sort_keys=True, separators=(",", ":"),
                      allow_nan=False).encode()


def encode(manifest):
    """The file's bytes: `manifest` with its `manifest_crc32` added.

    Example:

    >>> data = encode(dict(header(4, None), variables=[]))
    >>> decode(data, "manifest.json")["step"]
    4
    """
    sealed = dict(manifest)
    sealed[_CHECKSUM] = zlib.crc32(_canonical(manifest))
    return json.dumps(sealed, indent=1, allow_nan=False).encode()


def _no_constants(name):
    raise ValueError(f"{name} is not a JSON number a manifest may hold")


def parse_json(data, file):
    """JSON `data` (bytes) or ValueError naming `file`: not JSON, NaN or
    Infinity, nesting too deep for the parser (RecursionError)."""
    try:
        return json.loads(data, parse_constant=_no_constants)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        reason = ("JSON nested too deeply" if isinstance(error, RecursionError)
                  else f"not valid JSON: {error}")
        raise ValueError(f"Checkpoint file {file!r} is damaged ({reason}). "
                         "No variable was changed.") from None


def read(path, allow_older_format=False):
    """The checked manifest of the checkpoint directory `path`.

    Raises FileNotFoundError if there is none, ValueError for every damaged,
    edited or malformed one (and for formats 1 and 2 unless
    `allow_older_format`), naming the file.
    """
    file = os.path.join(path, files.MANIFEST)
    with files.open_regular(file, "Checkpoint manifest") as f:
        data = f.read()
    return decode(data, file, allow_older_format)


def decode(data, file, allow_older_format=False):
    """The checked manifest from its bytes (see `read`)."""
    manifest = parse_json(data, file)
    version = (manifest.get("format_version") if isinstance(manifest, dict)
               else None)
    # (A manifest carrying a checksum has it checked first, in _problem.)
    if (version in READABLE_VERSIONS and type(version) is int
            and version < FORMAT_VERSION and not allow_older_format
            and manifest.get("format") == FORMAT
            and _CHECKSUM not in manifest):
        raise ValueError(
            f"Checkpoint manifest {file!r} is in the older format_version "
            f"{version} (no {'block or ' if version < 2 else ''}manifest "
            "checksums), which is read only when asked for: if it really was "
            "written by an older tfpar, restore it with "
            "restore_checkpoint(..., allow_older_format=True). (A format "
            f"{FORMAT_VERSION} manifest edited to say so is damaged: copy the "
            "checkpoint again.) No variable was changed.")
    try:
        problem = _problem(manifest, allow_older_format)
    except (KeyError, TypeError, ValueError, OverflowError, AttributeError,
            RecursionError) as error:
        problem = f"a variable entry is malformed ({error!r})"
    if problem:
        raise ValueError(f"Checkpoint manifest {file!r} is damaged: "
                         f"{problem}. No variable was changed.")
    return manifest


def _problem(manifest, allow_older_format):
    """What is wrong with a parsed manifest, or None."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return f"it is not a {FORMAT} manifest"
    version = manifest.get("format_version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        return (f"format_version {version!r} is not one of "
                f"{READABLE_VERSIONS} that this tfpar reads (written by "
                f"tfpar {_writer(manifest)}; use that version to restore it)")
    # Whatever version it claims: a manifest that carries a checksum is
    # checked (an edit of format_version cannot skip it).
    if version >= 3 or _CHECKSUM in manifest:
        recorded = manifest.get(_CHECKSUM)
        if recorded != zlib.crc32(_canonical(manifest)):
            return (f"its {_CHECKSUM} ({recorded!r}) does not match its "
                    "contents: the manifest was edited or damaged after it "
                    "was written. Copy the checkpoint again from a good source "
                    "or restore an older one")
    if version < FORMAT_VERSION and not allow_older_format:
        return (f"format_version {version} is read only with "
                "restore_checkpoint(..., allow_older_format=True)")
    step = manifest["step"]
    if type(step) is not int or step < 0:
        return f"its step {step!r} is not an integer >= 0"
    if not isinstance(manifest["variables"], list):
        return "its 'variables' is not a list"
    for record in manifest["variables"]:
        check_record(record, version >= 2)
    return None


def _writer(manifest):
    versions = manifest.get("versions") if isinstance(manifest, dict) else None
    return versions.get("tfpar") if isinstance(versions, dict) else None


def _ints(values, what):
    """`values` as a list of Python ints (bools and floats refused)."""
    if not isinstance(values, list) or any(type(v) is not int
                                           for v in values):
        raise ValueError(f"{what} {values!r} is not a list of integers")
    return values


def check_record(record, checksums):
    """Blocks must lie inside the variable, not overlap, and tile it; with
    `checksums` each must carry a CRC-32 (an int in [0, 2**32))."""
    if not isinstance(record, dict):
        raise ValueError(f"variable entry {record!r} is not an object")
    shape = _ints(record["shape"], "shape")
    if any(n < 0 for n in shape):
        raise ValueError(f"shape {shape} has a negative dimension")
    tf.as_dtype(record["dtype"])  # raises TypeError for an unknown dtype
    if record["kind"] not in ("params", "optimizer") or not isinstance(
            record["key"], str):
        raise ValueError(f"bad kind/key {record['kind']!r}/{record['key']!r}")
    if not isinstance(record["blocks"], list):
        raise ValueError(f"blocks of {record['key']!r} are not a list")
    volume, boxes = 0, []
    for block in record["blocks"]:
        box = _check_block(block, shape, record["key"], checksums)
        for other in boxes:
            if all(a < d and c < b for (a, b), (c, d) in zip(box, other)):
                raise ValueError(f"blocks of {record['key']!r} overlap")
        boxes.append(box)
        volume += math.prod(b - a for a, b in box)
    if volume != math.prod(shape):
        raise ValueError(f"blocks of {record['key']!r} do not cover its "
                         f"shape {shape}")


def _check_block(block, shape, key, checksums):
    """One block's [(start, stop)] box, checked against the variable."""
    name = block["file"]
    if not isinstance(name, str) or os.sep in name or name in ("", ".", ".."):
        raise ValueError(f"bad block file name {name!r}")
    if checksums and not (type(block.get("crc32")) is int
                          and 0 <= block["crc32"] < 2**32):
        raise ValueError(f"block {name} has no valid crc32 "
                         f"(got {block.get('crc32')!r})")
    if not isinstance(block["index"], list):
        raise ValueError(f"block {name} index {block['index']!r} is not a list")
    box = [tuple(_ints(pair, f"block {name} range")) for pair in block["index"]]
    # Empty boxes (a == b) only arise in zero-size variables; they add no
    # volume, so "no overlap and volumes sum to the variable's" still means
    # the blocks tile it.
    if len(box) != len(shape) or any(
            len(pair) != 2 or not 0 <= pair[0] <= pair[1] <= n
            for pair, n in zip(box, shape)):
        raise ValueError(f"block {name} index {block['index']} is outside "
                         f"shape {shape} of {key!r}")
    return box
