"""Device blocks: what each device saves, and resharding on restore.

Saving: every device's block of a variable is copied from that device's own
component (`dtensor.unpack`, never the whole variable) and written once per
distinct block, by the lowest-numbered device holding it. Restoring onto any
mesh and layout: each device's target block is cut out of the saved blocks
overlapping it (memory-mapped, so only the needed slices are read) and the
blocks are packed onto the mesh. The block math is `placement.block_ranges`.
"""

import os
import re

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import _compat
from tfpar import layout as layout_lib
from tfpar import placement
from tfpar.checkpoint import files

_MAX_STEM = 96          # characters of the variable key kept in file names


def _layout_of(backing):
    """(spec, {axis: size}, dtensor layout) of a variable; plain ones are one
    unsharded block."""
    if isinstance(backing, _compat.DVariable):
        layout = dtensor.fetch_layout(backing)
        return (layout_lib.spec_of(layout), layout_lib.axis_sizes_of(layout),
                layout)
    return (None,) * len(backing.shape), {}, None


def host_value(backing):
    """A replicated/plain variable's value from one device (no gather)."""
    value = backing.read_value()
    if dtensor.is_dtensor(value) and dtensor.num_clients() > 1:
        return placement.fetch(value)  # maybe another host's (a collective)
    if dtensor.is_dtensor(value):
        value = dtensor.unpack(value)[0]
    return value.numpy()


def save_variable(n, kind, key, variable, tmp):
    backing = _compat.backing_variable(variable)
    # offload="optimizer+master": the float32 master on the host devices,
    # laid out like the devices' compute-dtype copy (`tfpar.offload.master`).
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
        crc = files.write_npy(os.path.join(tmp, file), array)
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


def assemble(variable, record, opened):
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
