"""The checkpoint's files: `.npy` blocks with their CRC-32, reading safely.

Everything here reads or writes bytes and knows nothing of models or
meshes: the block files (one `.npy` per distinct device block, written with
its CRC-32 computed on the fly, fsync'ed), opening a saved block
memory-mapped after checking header, size and checksum, and reading only
regular files (`open_regular`: a FIFO or a device in a checkpoint's place
is refused, never waited on). The manifest is `checkpoint.manifest`; names
and layout of a checkpoint directory are in `tfpar.checkpoint`'s docstring.
"""

import importlib.metadata
import os
import stat
import tokenize
import zlib

import numpy as np
import tensorflow as tf

MANIFEST = "manifest.json"
POINTER = "checkpoint"
_CHUNK = 1 << 22        # bytes per write / checksum read: 4 MiB


def tfpar_version():
    """tfpar's version from the installed package's metadata, recorded in
    every manifest (read back only to name the writer in an error);
    "unknown (not installed)" when tfpar runs from a source tree that was
    never installed (`pip install -e .` gives it metadata)."""
    try:
        return importlib.metadata.version("tfpar")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def write_npy(path, array):
    """Writes one `.npy` block file, fsyncs it and returns its CRC-32.

    The checksum covers every byte of the file (header and data) and is
    computed from memory while writing, chunk by chunk: no re-read and no
    copy of the block (CRC-32 is chained, crc(a + b) = crc32(b, crc(a))).
    Tests patch this function to crash.

    Example:

    >>> crc = write_npy("/tmp/b.npy", np.arange(4.0))
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
    with open_regular(file) as f:
        buffer = bytearray(min(_CHUNK, max(os.fstat(f.fileno()).st_size, 1)))
        view = memoryview(buffer)
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return crc


def open_regular(path, what="Checkpoint file"):
    """`path` opened for binary reading, only if it is a regular file.

    The file is opened non-blocking first (opening a FIFO for reading would
    otherwise wait for a writer forever), checked with `fstat`, then set
    back to blocking reads. Raises FileNotFoundError if it is missing and
    ValueError naming it if it is a FIFO, a device, a socket or a
    directory.

    Example:

    >>> with open_regular("/tmp/run/ckpt-4/manifest.json") as f:
    ...     data = f.read()
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(
                f"{what} {path!r} is not a regular file ({_kind(mode)}); a "
                "checkpoint holds only regular files. Replace it with the "
                "file from a good copy of the checkpoint. No variable was "
                "changed.")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def _kind(mode):
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR,
                       "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR,
                       "a directory")):
        if test(mode):
            return name
    return f"file mode {stat.filemode(mode)}"


def write_file(path, data, atomic=False):
    """Writes `data` to `path` and fsyncs it; `atomic`: through a temporary
    file renamed over `path`, so readers see the old or the new bytes."""
    target = path
    if atomic:
        path = f"{path}.tmp-{os.getpid()}"
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if atomic:
        os.replace(path, target)


def fsync_dir(path):
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


def load_block(path, record, block):
    """(box, memory-mapped array) of one saved block, checked: the file
    exists, its header parses, its size fits the header, and shape and dtype
    are the manifest's."""
    dtype = np.dtype(tf.as_dtype(record["dtype"]).as_numpy_dtype)
    file = os.path.join(path, block["file"])
    box = [(int(a), int(b)) for a, b in block["index"]]
    expected = tuple(b - a for a, b in box)
    try:
        # Only a regular file is handed to numpy (a FIFO would block it);
        # a file that is not one raises its own ValueError here.
        open_regular(file, f"Checkpoint block file (of {record['key']!r})"
                     ).close()
    except FileNotFoundError:
        raise ValueError(
            f"Checkpoint block file {file!r} (of {record['key']!r}) is "
            "missing. No variable was changed.") from None
    except OSError as error:
        raise ValueError(
            f"Checkpoint block file {file!r} (of {record['key']!r}) cannot "
            f"be read: {error}. No variable was changed.") from None
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


def verify_block(path, record, block, checksums):
    """Checks one block file (see `load_block`) and, with `checksums`, that
    the CRC-32 of its bytes is the one recorded when it was written. The
    file is streamed, not kept: nothing stays mapped or open."""
    load_block(path, record, block)   # the map is closed when dropped
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


def open_blocks(path, record):
    """[(box, memory-mapped array)] of a variable's saved blocks, checked
    (exists, readable, shape and dtype as the manifest says)."""
    return [load_block(path, record, block) for block in record["blocks"]]
