"""Sharded, reshardable, crash-safe checkpoints (issue 5, items 2-4).

A checkpoint is a directory of `.npy` block files plus a `manifest.json`:

    directory/
      checkpoint                  pointer: {"latest": "ckpt-12", "step": 12}
                                  (the commit marker of a re-saved step)
      ckpt-8/                     an older complete checkpoint
      ckpt-12/
        manifest.json             written last: the directory is complete;
                                  per block: file, index, crc32; its own
                                  manifest_crc32
        v0000_mlp_up_kernel.b0.npy ... one file per distinct block
      ckpt-16.tmp-4242/           a save that never finished: ignored, and
                                  deleted by the next save once pid 4242
                                  is gone

Saving never assembles a sharded variable anywhere: each device's block is
read from that device's own component (`dtensor.unpack`) and written to its
own file; devices holding the same block (replicas) write it once. The
manifest records the CRC-32 of every file's bytes, computed from memory while
the file is written. Restoring works onto any mesh and layout: first the
manifest (its own CRC-32, every field), the model's variables and every
block file are checked (regular file, header, size, CRC-32 of all bytes,
streamed in chunks), so a damaged checkpoint raises a ValueError naming
the file and leaves the model untouched. Then,
one variable at a time, every device's target block is cut out of the saved
blocks that overlap it (memory-mapped, so only the needed slices are read),
the blocks are packed onto the mesh and the variable is assigned: restoring
needs extra memory for one variable, not for the whole model.

Across several hosts (`tfpar.connect_hosts`) every host saves into the same
directory (which all must see): each writes the blocks its own devices own
(a block several devices hold is written by the lowest-numbered one, file
`<stem>.b<device>.npy`), host 0 merges the hosts' records into the
manifest (after checking that the hosts' records name the same variables)
and publishes; every step is agreed on, so a failure on any host raises on
all and publishes nothing. On restore host 0 chooses the checkpoint and
every host restores that one (or all raise).

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

The package: `api` (save, restore; every step agreed on by all hosts),
`directory` (publishing, the pointer, latest, stale temporaries,
`max_to_keep`), `keys` (which variables, under which keys), `blocks` (each
device's block on save, resharding on restore), `manifest` (its fields,
checksum and checks), `files` (the `.npy` block files, CRC-32, fsync,
regular files only).
"""

from tfpar.checkpoint.api import (
    latest_checkpoint,
    restore_checkpoint,
    save_checkpoint,
)
from tfpar.checkpoint.files import MANIFEST, POINTER
from tfpar.checkpoint.manifest import (
    FORMAT,
    FORMAT_VERSION,
    READABLE_VERSIONS,
)

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "POINTER",
    "READABLE_VERSIONS",
    "latest_checkpoint",
    "restore_checkpoint",
    "save_checkpoint",
]
