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

from tfpar import placement


class InputPlacer:
    """Places host batches on the mesh, split along the data axis."""

    def __init__(self, mesh, data_axis):
        self.mesh = mesh
        self._data_axis = data_axis
        self._data_size = mesh.axis_size(data_axis)

    def splits_evenly(self, batch, batch_dim=0):
        """Whether the data axis divides every tensor's batch dimension."""
        return all(
            t is None
            or (
                t.shape.rank > batch_dim
                and t.shape[batch_dim] % self._data_size == 0
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
        split = self._data_size > 1 and self.splits_evenly(batch, batch_dim)

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
            return placement.put(tensor, tuple(spec), self.mesh)

        return tf.nest.map_structure(put, batch)

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
            batch = _host(next(self._host_iterator))
            self._lookahead = _host(next(self._host_iterator, None))
            if check and self._lookahead is not None:
                self._placer.check_batch_size(batch)
            return batch
        if self._lookahead is not None:
            batch, self._lookahead = self._lookahead, None
            return batch
        return _host(next(self._host_iterator))


def _host(batch):
    if batch is None:
        return None
    return tf.nest.map_structure(
        lambda t: None if isinstance(t, tf.experimental.Optional) else t,
        batch)
