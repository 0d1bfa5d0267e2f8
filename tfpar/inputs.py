"""Feeding global batches to the mesh.

A global batch is cut along its batch dimension into one block per
coordinate of the data axis; each device receives only its block (a DTensor
sharded over the data axis). A batch the data axis does not divide is handed
whole to every device instead: the step then computes the same global
result, it only does not split that batch. Training accepts one only as the
last, partial batch of an epoch (the global batch size is the user's
choice); evaluate and predict accept any batch size, as Keras does.
"""

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import context_parallel
from tfpar import layout as layout_lib
from tfpar import placement


class InputPlacer:
    """Places host batches on the mesh, split along the data axis.

    With `per_host=True` (several hosts, `ParallelStrategy(per_host_input=
    True)`) every batch a host hands over is *its share* of the global
    batch: the rows of the data coordinates its devices hold. Host h of H
    then holds coordinates [h D/H, (h+1) D/H) of the data axis (size D),
    and the global batch is host 0's rows, then host 1's, and so on.
    """

    def __init__(self, mesh, data_axis, per_host=False, context=None):
        self.mesh = mesh
        self._data_axis = data_axis
        self._data_size = mesh.axis_size(data_axis)
        self.per_host = per_host
        # Splits sequences over the context axis (None: no such axis).
        self.context = context
        if per_host:
            self._first_block, self._local_blocks = _host_blocks(
                mesh, data_axis)

    @property
    def blocks_per_host(self):
        """How many coordinates of the data axis each host's share holds
        (per-host input only)."""
        return self._local_blocks

    def splits_evenly(self, batch, batch_dim=0):
        """Whether the data axis divides every tensor's batch dimension
        (per host: this host's share of the data axis divides its rows)."""
        blocks = self._local_blocks if self.per_host else self._data_size
        return all(
            t is None
            or (
                t.shape.rank > batch_dim
                and t.shape[batch_dim] % blocks == 0
            )
            for t in tf.nest.flatten(batch)
        )

    def check_batch_size(self, batch):
        """Raises ValueError unless the data axis divides `batch`."""
        if self.splits_evenly(batch):
            return
        leaves = [t for t in tf.nest.flatten(batch) if t is not None]
        scalars = [t for t in leaves if not t.shape.rank]
        if scalars:
            raise ValueError(
                "ParallelStrategy feeds batched inputs: every input needs a "
                "batch dimension. Received: an input of shape "
                f"{scalars[0].shape} in a batch. Batch the dataset "
                "(dataset.batch(global_batch_size)) or give arrays with a "
                "leading batch dimension."
            )
        size = next(t.shape[0] for t in leaves
                    if t.shape[0] % self._data_size)
        raise ValueError(
            f"The global batch size {size} is not divisible by the data axis "
            f"{self._data_axis!r} of size {self._data_size} (mesh "
            f"{self.mesh!r}). Received: batch_size={size}. Use a batch size "
            f"that is a multiple of {self._data_size}."
        )

    def place(self, batch, batch_dim=0):
        """DTensors for the host tensors in `batch` (None stays None)."""
        if self.per_host:
            return self._place_share(batch, batch_dim)
        split = self._data_size > 1 and self.splits_evenly(batch, batch_dim)
        if self.context is not None:
            batch = self.context.reorder_batch(batch, batch_dim + 1)

        def put(tensor):
            if tensor is None:
                return None
            if not isinstance(tensor, (tf.Tensor, tf.Variable)):
                if isinstance(tensor, (tf.SparseTensor, tf.RaggedTensor)):
                    raise TypeError(
                        "ParallelStrategy feeds dense tensors only. Received "
                        f"an input of type {type(tensor).__name__}; make it "
                        "dense in the dataset (e.g. tf.sparse.to_dense)."
                    )
                tensor = tf.convert_to_tensor(tensor)
            spec = [None] * tensor.shape.rank
            if split:
                spec[batch_dim] = self._data_axis
            if self.context is not None and tensor.shape.rank > batch_dim + 1:
                spec[batch_dim + 1] = self.context.axis
            return placement.put(tensor, tuple(spec), self.mesh)

        return tf.nest.map_structure(put, batch)

    def _place_share(self, batch, batch_dim):
        """The global batch whose rows of this host's data coordinates are
        `batch`: each local device gets its coordinate's block of them."""
        if not self.splits_evenly(batch, batch_dim):
            rows = next(t.shape[batch_dim] for t in tf.nest.flatten(batch)
                        if t is not None and t.shape.rank > batch_dim
                        and t.shape[batch_dim] % self._local_blocks)
            raise ValueError(
                f"With per_host_input=True each host feeds {self._local_blocks}"
                f" block(s) of the data axis {self._data_axis!r}, so its "
                f"batch must divide by {self._local_blocks}. Received: a "
                f"batch of {rows} rows on host {dtensor.client_id()}. Use a "
                "per-host batch size that is a multiple of "
                f"{self._local_blocks} (and drop_remainder=True in "
                "dataset.batch).")
        dmesh = self.mesh.dtensor_mesh

        def put(tensor):
            if tensor is None:
                return None
            array = np.asarray(tensor)
            block = array.shape[batch_dim] // self._local_blocks
            spec = [dtensor.UNSHARDED] * array.ndim
            spec[batch_dim] = self._data_axis
            components = []
            for location in dmesh.local_device_locations():
                start = (location[self._data_axis] - self._first_block) * block
                index = [slice(None)] * array.ndim
                index[batch_dim] = slice(start, start + block)
                components.append(tf.constant(array[tuple(index)]))
            return dtensor.pack(components, dtensor.Layout(spec, dmesh))

        return tf.nest.map_structure(put, host_batch(batch))

    def agree_on_batch_count(self, dataset):
        """Per host: checks that every host's dataset has as many batches
        (one collective). Keras stops each host after its own count, so
        hosts with different counts would wait for each other forever; a
        count tf.data cannot tell (-2) is left to the per-step check."""
        if not self.per_host or dtensor.num_clients() == 1:
            return
        counts = _value_of_every_host(int(dataset.cardinality()))
        known = {int(c) for c in counts if c >= 0}
        if len(known) > 1:
            described = ", ".join(f"host {h}: {n} batches"
                                  for h, n in enumerate(counts))
            raise ValueError(
                "With per_host_input=True every host must feed a batch of "
                "the same size at every step, but the hosts' datasets have "
                f"different numbers of batches: {described}. Give every "
                "host the same number of samples and the same per-host "
                "batch size.")

    def agree_on_batch(self, batch, step):
        """Per host: checks that every host has a batch of the same size at
        this step (a collective each step; a host whose data ended early
        would otherwise leave the others waiting in the step's all-reduce).
        Returns `batch`."""
        if not self.per_host or dtensor.num_clients() == 1:
            return batch
        leaves = [t for t in tf.nest.flatten(batch) if t is not None]
        sizes = _value_of_every_host(-1 if batch is None else
                                     np.shape(leaves[0])[0] if leaves else 0)
        if len(set(sizes.tolist())) > 1:
            described = ", ".join(
                f"host {h}: {'no batch (its data ended)' if n < 0 else n}"
                for h, n in enumerate(sizes))
            raise ValueError(
                "With per_host_input=True every host must feed a batch of "
                f"the same size at every step. At step {step} the hosts "
                f"disagree: {described}. Give every host the same number of "
                "samples and the same per-host batch size (e.g. "
                "dataset.shard(num_hosts, host_id).batch(b, "
                "drop_remainder=True) on every host).")
        return batch

    def host_batch_of(self, batch):
        """`batch` as host tensors (`host_batch`); per host, a DTensor this
        placer placed (Keras' predict loop reads batches through the
        distributed dataset's iterator, which places them) back as this
        host's share: the blocks of its data coordinates, from its own
        devices, in order."""
        batch = host_batch(batch)
        if not self.per_host:
            return batch

        def share(tensor):
            if tensor is None or not dtensor.is_dtensor(tensor):
                return tensor
            layout = dtensor.fetch_layout(tensor)
            axis = layout_lib.spec_of(layout).index(self._data_axis)
            blocks = {}
            for component, location in zip(
                    dtensor.unpack(tensor),
                    layout.mesh.local_device_locations()):
                blocks.setdefault(location[self._data_axis], component)
            return tf.concat([blocks[c] for c in sorted(blocks)], axis)

        return tf.nest.map_structure(share, batch)

    def restore(self, outputs):
        """Predictions (host arrays) in the order the inputs were given:
        undoes the context axis' load-balance reordering, if any."""
        if self.context is None:
            return outputs
        return self.context.restore(outputs)

    def place_arrays(self, structure):
        """Like `place`, for host arrays only (Python values, symbolic
        KerasTensors and DTensors pass through)."""
        from keras import KerasTensor  # noqa: PLC0415

        def is_host_array(x):
            return (
                isinstance(x, np.ndarray)
                or (isinstance(x, tf.Tensor) and not isinstance(x, KerasTensor)
                    and not dtensor.is_dtensor(x))
            )

        leaves = tf.nest.flatten(structure)
        arrays = [x for x in leaves if is_host_array(x)]
        if not arrays:
            return structure
        placed = iter(tf.nest.flatten(self.place(
            [tf.convert_to_tensor(x) for x in arrays])))
        return tf.nest.pack_sequence_as(
            structure, [next(placed) if is_host_array(x) else x for x in leaves])


class DistributedBatches:
    """`strategy.experimental_distribute_dataset(dataset)`: global batches.

    Iterating yields each batch of `dataset` placed on the mesh: split over
    the data axis when it divides the batch, else whole on every device.
    Keras' training loop reads host batches (`next_host_batch(check=True)`),
    where the first batch fixes the batch size: the data axis must divide
    it unless it is the only batch.
    """

    def __init__(self, dataset, placer):
        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(
                "ParallelStrategy.experimental_distribute_dataset needs a "
                f"batched tf.data.Dataset. Received: {type(dataset).__name__}"
            )
        self._dataset = dataset
        self._placer = placer
        placer.agree_on_batch_count(dataset)

    @property
    def element_spec(self):
        return self._dataset.element_spec

    def __iter__(self):
        dataset = self._dataset
        if self._placer.mesh.device_type == "CPU":
            # The devices compute on the host's cores; tf.data's autotuner
            # then competes with them and makes every other epoch ~50%
            # slower on 2 cores (benchmarks/step_time.py). Fixed defaults
            # are steadier there. GPU/TPU meshes keep the autotuner.
            options = tf.data.Options()
            options.autotune.enabled = False
            dataset = dataset.with_options(options)
        return BatchIterator(iter(dataset), self._placer)


class BatchIterator:
    """Iterates global batches; `next_host_batch` skips the placement."""

    def __init__(self, host_iterator, placer):
        self._host_iterator = host_iterator
        self._placer = placer
        self._lookahead = None
        self._started = False
        self._step = 0

    def __iter__(self):
        return self

    def __next__(self):
        return self._placer.place(self.next_host_batch())

    def get_next(self):
        return next(self)

    def next_host_batch(self, check=False):
        """The next global batch as host tensors (Keras' `Optional`
        stand-ins for missing entries become None). With `check` (training),
        a first batch the data axis does not divide is a ValueError unless
        it is the only one."""
        if not self._started:
            self._started = True
            batch = self._read()
            if batch is None:
                raise StopIteration
            self._lookahead = self._read()
            if check and self._lookahead is not None:
                self._placer.check_batch_size(batch)
            return batch
        if self._lookahead is not None:
            batch, self._lookahead = self._lookahead, None
            return batch
        batch = self._read()
        if batch is None:
            raise StopIteration
        return batch

    def _read(self):
        """The next host batch or None at the end (hosts agreeing on it
        under per-host input)."""
        batch = host_batch(next(self._host_iterator, None))
        self._step += 1
        return self._placer.agree_on_batch(batch, self._step)


def host_batch(batch):
    """A batch as host tensors: Keras' `Optional` stand-ins for missing
    entries become None, arrays become tensors (tensors, sparse or ragged
    ones included, stay as they are).

    >>> import numpy as np
    >>> host_batch((np.ones(2), None))[0].dtype.name
    'float64'
    """
    return tf.nest.map_structure(
        lambda t: None if t is None or isinstance(t, tf.experimental.Optional)
        else t if tf.is_tensor(t) else tf.convert_to_tensor(t), batch)


def _host_blocks(mesh, data_axis):
    """(first, count): the data coordinates this host's devices hold, which
    per-host input needs to be the same number on every host, in host
    order: host h holds [h * count, (h + 1) * count)."""
    hosts, host = dtensor.num_clients(), dtensor.client_id()
    size = mesh.axis_size(data_axis)
    held = _data_coordinates_of_hosts(mesh, data_axis, hosts)
    count = len(held[host])
    # Checked for every host, so that every host raises alike.
    wrong = [h for h in range(hosts) if held[h] != list(
        range(h * count, (h + 1) * count))]
    if size % hosts or wrong or count * hosts != size:
        host = (wrong or [host])[0]
        coordinates = held[host]
        raise ValueError(
            "per_host_input=True needs each host to hold its own range of "
            f"the data axis {data_axis!r}: {hosts} host(s) and a data axis of "
            f"size {size}, host h holding coordinates [h*{size}//{hosts}, "
            f"(h+1)*{size}//{hosts}). Received: mesh {mesh!r}, host {host} "
            f"holding data coordinates {coordinates}. Make the data axis "
            "the first axis and a multiple of the number of hosts (e.g. "
            "Mesh({'data': hosts * k, 'model': m})), or leave "
            "per_host_input=False (every host reads every global batch).")
    return held[host][0], count


def _data_coordinates_of_hosts(mesh, data_axis, hosts):
    """{host: sorted data coordinates its devices hold} (global device i
    is on host i // L, L devices per host; mesh positions row-major)."""
    if data_axis not in mesh.shape:
        return {h: [0] for h in range(hosts)}
    per_host = dtensor.num_local_devices(mesh.device_type)
    axis = mesh.axis_names.index(data_axis)
    shape = tuple(mesh.shape.values())
    held = {h: set() for h in range(hosts)}
    for position, device in enumerate(mesh.devices):
        owner = int(device.rsplit(":", 1)[1]) // per_host
        held[owner].add(int(np.unravel_index(position, shape)[axis]))
    return {h: sorted(c) for h, c in held.items()}


def _value_of_every_host(value):
    """[host 0's value, host 1's, ...] of an integer each host has: a
    one-hot vector per host (its value at its index), summed over hosts
    (one collective)."""
    mine = np.zeros(dtensor.num_clients(), np.int64)
    mine[dtensor.client_id()] = value
    return placement.sum_over_hosts(mine)
