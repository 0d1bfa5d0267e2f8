"""The datasets of Keras' `.weights.h5` files, for tests that compare
saved presets (tests/test_pretrained.py and its fresh-process child)."""

import h5py
import numpy as np


def h5_datasets(path):
    """{name: array} of every dataset of the HDF5 file at `path`."""
    found = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, item: found.__setitem__(name, item[()])
                     if isinstance(item, h5py.Dataset) else None)
    return found


def same_datasets(a, b):
    """Whether two .weights.h5 files hold the same datasets, equal."""
    first, second = h5_datasets(a), h5_datasets(b)
    return first.keys() == second.keys() and all(
        np.array_equal(first[k], second[k]) for k in first)
