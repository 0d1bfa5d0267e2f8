"""Moving values between the host and a mesh.

`put(value, spec, mesh)` cuts a host array into the blocks `spec` asks for
and hands each device only its own block (no device ever holds the whole
value unless the spec replicates it). `fetch(dtensor)` assembles a host numpy
array from the blocks. Both work on eager values only.
"""

import functools

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import layout as layout_lib
from tfpar.mesh import Mesh


def block_index(shape, spec, axis_sizes, location):
    """The numpy index of the block the device at `location` holds.

    `location` maps each mesh axis to the device's coordinate along it and
    `axis_sizes` each axis to its size. For a dimension of size n split over
    an axis of size k, coordinate c holds rows [c * n/k, (c+1) * n/k).
    """
    index = []
    for size, axis in zip(shape, spec):
        k = axis_sizes[axis] if axis is not None else 1
        if k == 1:
            index.append(slice(None))
        else:
            c = location[axis]
            block = size // k
            index.append(slice(c * block, (c + 1) * block))
    return tuple(index)


def block_ranges(shape, spec, axis_sizes, location):
    """((start, stop) per dimension) of the block the device at `location`
    holds: the ranges of `block_index`, with whole dimensions as (0, n)."""
    index = block_index(shape, spec, axis_sizes, location)
    return tuple(s.indices(size)[:2] for s, size in zip(index, shape))


def put(value, spec, mesh, dtype=None):
    """A DTensor on `mesh` laid out by `spec`, built from a host value.

    The host value is cut with numpy (cheap views, no TF op per block) and
    each device receives only its block; devices that hold the same block
    share one host copy of it.
    """
    if dtensor.is_dtensor(value):
        return relayout(value, spec, mesh)
    if isinstance(value, (tf.Tensor, tf.Variable)):
        array = value.numpy()
    else:
        array = np.asarray(value)
    if dtype is not None:
        dtype = tf.as_dtype(dtype)
        if array.dtype != dtype.as_numpy_dtype:
            array = array.astype(dtype.as_numpy_dtype)
    return put_blocks(array.__getitem__, array.shape, spec, mesh,
                      array.dtype)


def put_blocks(read_block, shape, spec, mesh, dtype):
    """A DTensor of `shape` on `mesh` laid out by `spec`, each of this
    host's devices given `read_block(index)`, the host array of its block
    (`index`: a tuple of slices, `block_index`), cast to `dtype`: the
    value is never whole on the host unless a device holds it whole, and
    a host reads only its own devices' blocks (one read per distinct
    block). `put` is `put_blocks(array.__getitem__, ...)`.

    >>> put_blocks(lambda index: np.ones((8, 4))[index], (8, 4),
    ...            ("model", None), mesh, np.float32)
    """
    dtype = (dtype.as_numpy_dtype if isinstance(dtype, tf.dtypes.DType)
             else np.dtype(dtype))
    layout = layout_lib.to_dtensor_layout(spec, mesh)
    if not layout.mesh.local_device_ids():
        return stand_in(layout, shape, dtype)
    if layout.is_fully_replicated():
        whole = tuple(slice(0, n) for n in shape)
        return dtensor.copy_to_mesh(
            tf.constant(np.asarray(read_block(whole), dtype)), layout)
    blocks = {}
    components = []
    for device, location in zip(layout.mesh.local_devices(),
                                local_locations(mesh.dtensor_mesh)):
        index = block_index(shape, spec, mesh.shape, location)
        key = block_ranges(shape, spec, mesh.shape, location)
        if key not in blocks:  # made on its device: packing copies none
            with tf.device(device):
                blocks[key] = tf.constant(np.asarray(read_block(index), dtype))
        components.append(blocks[key])
    return dtensor.pack(components, layout)


def unwritten(spec, mesh, shape, dtype):
    """Memory for a value of `shape` laid out by `spec` on `mesh`, each of
    this host's devices allocating its own block on itself and writing
    nothing (TF's `Empty`, init=False): its values are undefined until
    assigned, and no page of it is resident until then. No host array of
    the whole value, no message between hosts: weights about to be loaded
    (`tfpar.pretrained.deferred_init`).

    >>> value = unwritten(("model", None), mesh, (16, 4), tf.float32)
    """
    layout = layout_lib.to_dtensor_layout(spec, mesh)
    if not layout.mesh.local_device_ids():
        return stand_in(layout, shape, dtype)
    components = []
    for device, location in zip(layout.mesh.local_devices(),
                                local_locations(mesh.dtensor_mesh)):
        index = block_index(shape, spec, mesh.shape, location)
        with tf.device(device):
            components.append(tf.raw_ops.Empty(init=False, dtype=dtype, shape=
                [len(range(*s.indices(n))) for s, n in zip(index, shape)]))
    return dtensor.pack(components, layout)


def stand_in(layout, shape, dtype):
    """A value laid out by `layout` on another host's mesh (a pipeline
    stage across hosts, its offload devices): this host holds none of it,
    and packing [] there crashes DTensor; zeros of the right layout that
    this host never reads keep every host's programs in step."""
    return dtensor.call_with_layout(tf.zeros, layout, shape=shape,
                                    dtype=dtype)


def same_on_every_host(value):
    """Host 0's copy of a host value, on every host (`tfpar.connect_hosts`;
    one host: `value` itself). A collective: every host calls it, in the
    same order. Used for initial weights and values assigned from the host,
    which each host computes on its own (e.g. from unseeded initializers).

    Device 0 (on host 0) contributes the value, every other device zeros,
    and an all-reduce adds them up: exact (adding zeros changes nothing).
    Numbers only; other values (strings) stay as given.
    """
    if dtensor.num_clients() == 1 or dtensor.is_dtensor(value):
        return value
    array = value.numpy() if isinstance(value, (tf.Tensor, tf.Variable)) \
        else np.asarray(value)
    if array.dtype.kind not in "biuf" and not _is_float(array.dtype):
        return value
    return _sum_over_devices(array, lambda device, first_local: device == 0)


def _is_float(dtype):
    """float16/32/64 and ml_dtypes' bfloat16/float8 (numpy kind "V")."""
    return dtype.kind == "f" or dtype.name.startswith(("bfloat16", "float8"))


def sum_over_hosts(value):
    """The sum over hosts of each host's numeric `value` (one host: the
    value). A collective, like `same_on_every_host`."""
    array = np.asarray(value)
    if dtensor.num_clients() == 1:
        return array
    return _sum_over_devices(
        array, lambda device, first_local: device == first_local)


def _sum_over_devices(array, contributes):
    """All-reduce over every device of the cluster: `array` from the
    devices `contributes(global id, this host's first id)` picks, zeros
    from the others; the result cast back to `array`'s dtype."""
    # Adding zeros is exact in any float type: floats keep theirs (no extra
    # memory), float8 goes through float32, integers and bools int64.
    wide = (np.int64 if not _is_float(array.dtype) else
            np.float32 if array.dtype.name.startswith("float8") else
            array.dtype)
    everything = _all_devices_mesh()
    local = everything.local_device_ids()
    zeros = tf.constant(np.zeros((1,) + array.shape, wide))
    components = [
        tf.constant(array.astype(wide)[None]) if contributes(i, local[0])
        else zeros for i in local]
    stacked = dtensor.pack(components, dtensor.Layout(
        ["tfpar_devices"] + [dtensor.UNSHARDED] * array.ndim, everything))
    total = tf.reduce_sum(stacked, axis=0)
    return dtensor.unpack(total)[0].numpy().astype(array.dtype)


@functools.lru_cache(maxsize=1)
def _all_devices_mesh():
    """A 1-D DTensor mesh "tfpar_devices" over every device of the cluster."""
    return Mesh({"tfpar_devices": dtensor.num_global_devices(
        dtensor.preferred_device_type())}).dtensor_mesh


def relayout(value, spec, mesh):
    """`value` (a DTensor on `mesh`, or a tensor in a DTensor function)
    relaid out to `spec`."""
    target = layout_lib.to_dtensor_layout(spec, mesh)
    if tf.executing_eagerly() and dtensor.fetch_layout(value) == target:
        return value
    return dtensor.relayout(value, target)  # in a graph: free if it matches


def fetch(value):
    """A host numpy array with the global value of DTensor `value`."""
    if not dtensor.is_dtensor(value):
        return np.asarray(value)
    layout = dtensor.fetch_layout(value)
    holders = hosts_of(layout.mesh)
    if dtensor.num_clients() > 1 and len(holders) < dtensor.num_clients():
        return _from_hosts(value, layout, holders)
    return _gathered(value, layout)


def _gathered(value, layout):
    """The global value of `value`, on each host holding devices of its
    mesh (a collective among them when the blocks are spread over hosts)."""
    if layout.is_fully_replicated():
        return dtensor.unpack(value)[0].numpy()
    dmesh = layout.mesh
    if dmesh.num_local_devices() != dmesh.size:
        # Multi-client: the blocks are spread over hosts; gather them first.
        replicated = dtensor.Layout.replicated(dmesh, layout.rank)
        return dtensor.unpack(dtensor.relayout(value, replicated))[0].numpy()
    return _assemble(value, layout)


def _assemble(value, layout):
    """The global value of `value`, from its blocks (all on this host)."""
    dmesh = layout.mesh
    components = dtensor.unpack(value)
    out = np.empty(value.shape.as_list(), dtype=value.dtype.as_numpy_dtype)
    spec = layout_lib.spec_of(layout)
    axis_sizes = dict(zip(dmesh.dim_names, dmesh.shape()))
    for component, loc in zip(components, local_locations(dmesh)):
        out[block_index(out.shape, spec, axis_sizes, loc)] = component.numpy()
    return out


def local_locations(dtensor_mesh):
    """{axis: coordinate} of each of this host's devices of `dtensor_mesh`,
    in its local order: DTensor's `local_device_locations`, which (TF
    2.21) keys mesh positions by device id and so fails on a mesh whose
    ids do not start at 0 (another host's pipeline stage)."""
    positions = {int(i): p for p, i in enumerate(
        np.ravel(dtensor_mesh.global_device_ids()))}
    mapping = dtensor_mesh.unravel_index()  # position -> coordinates
    return [mapping[positions[int(i)]]
            for i in dtensor_mesh.local_device_ids()]


def hosts_of(dtensor_mesh):
    """The hosts holding devices of `dtensor_mesh`, in increasing order
    ((0,) on one host; across hosts a pipeline stage's sub-mesh holds one
    host or several whole ones, a "spread" mesh every host: see
    `tfpar.Mesh._cluster_mesh`, which names the devices of every mesh but
    the cluster's whole one)."""
    if dtensor.num_clients() == 1:
        return (0,)
    devices = dtensor_mesh.global_devices()
    if not devices:  # every device of the cluster, in order
        return tuple(range(dtensor.num_clients()))
    return tuple(sorted({tf.DeviceSpec.from_string(d).task
                         for d in devices}))


def _from_hosts(value, layout, holders):
    """The global value of `value` (on a mesh of the hosts `holders` only)
    on every host: gathered among the holders, then sent from the first
    (see `from_host`). The others run the gather too, on their stand-in:
    every host compiles the same programs in the same order."""
    if dtensor.client_id() in holders:
        array = _gathered(value, layout)
    else:
        if len(holders) > 1 and not layout.is_fully_replicated():
            dtensor.relayout(value, dtensor.Layout.replicated(
                layout.mesh, layout.rank))
        array = np.zeros(value.shape.as_list(),
                         dtype=value.dtype.as_numpy_dtype)
    return from_host(array, holders[0])


def from_host(array, owner):
    """Host `owner`'s numeric `array` on every host (the others pass any
    array of its shape and dtype, e.g. zeros): the owner's first device
    contributes it to an all-reduce over every device, the others add
    zeros (exact). A collective: every host calls it, in the same order."""
    array = np.asarray(array)
    if dtensor.num_clients() == 1:
        return array
    first = owner * dtensor.num_local_devices(
        dtensor.preferred_device_type())
    return _sum_over_devices(array, lambda device, _: device == first)
