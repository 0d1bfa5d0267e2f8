"""What an optimizer costs the planner: slots per weight (memory) and the
sums its update makes of a looked-up table's sparse gradient (data-axis
reductions).

Example:

>>> from tfpar.planner import optimizers
>>> optimizers.optimizer_slots("adam"), optimizers.sparse_gradient_sums("adam")
(2, 2)
"""

import threading

import keras
import numpy as np
import tensorflow as tf

_SLOTS = {"adam": 2, "adamw": 2, "adamax": 2, "nadam": 2, "lamb": 2,
          "lion": 1, "rmsprop": 1, "adagrad": 1, "adadelta": 2, "sgd": 0,
          "ftrl": 2, "adafactor": 0}


def optimizer_slots(optimizer):
    """Slots per weight of `optimizer` (a name or a Keras optimizer)."""
    if isinstance(optimizer, str):
        name = optimizer.lower()
        if name not in _SLOTS:
            raise ValueError(
                f"tfpar.plan does not know optimizer {optimizer!r}. Received: "
                f"optimizer={optimizer!r}; use one of {sorted(_SLOTS)} or "
                "pass a Keras optimizer instance.")
        return _SLOTS[name]
    name = type(optimizer).__name__.lower()
    if name == "sgd":
        return 1 if getattr(optimizer, "momentum", 0) else 0
    if name in _SLOTS:
        return _SLOTS[name]
    raise ValueError(
        f"tfpar.plan does not know optimizer {type(optimizer).__name__}. "
        f"Received: optimizer={optimizer!r}; pass one of {sorted(_SLOTS)} "
        "by name.")


# Ops that sum a sparse gradient's rows (an IndexedSlices: the rows a
# lookup read, per token) into a dense tensor: converting it
# (UnsortedSegmentSum) or scattering it into a variable (tfpar's
# ShardedVariable runs scatters as segment sums, `tfpar/variables.py`).
_ROW_SUMS = ("UnsortedSegmentSum", "ResourceScatterAdd", "ResourceScatterSub",
             "ResourceScatterUpdate")
_SPARSE_SUMS = {}


def sparse_gradient_sums(optimizer):
    """How many sums of a looked-up table's sparse gradient `optimizer`'s
    update makes (a name or a Keras optimizer): on a data axis each is an
    all-reduce of the table's gradient, the batch's rows living on
    different devices. Read from one trace of a fresh copy's update of a
    small table (its `_ROW_SUMS` ops): Keras sums the gradient and, apart,
    each elementwise function of its rows it uses — SGD 1; Adam, AdamW,
    Adamax, Lion, FTRL 2 (g and g²); Nadam 3. 1 (one dense gradient's
    reduction) for an optimizer that cannot be copied or traced so.

    >>> sparse_gradient_sums("adam")
    2
    """
    if isinstance(optimizer, str):
        key, config = optimizer.lower(), None
    else:
        config = optimizer.get_config()
        key = (type(optimizer), repr(sorted(config.items())))
    if key not in _SPARSE_SUMS:
        try:
            _SPARSE_SUMS[key] = _traced_row_sums(
                lambda: keras.optimizers.get(key) if config is None
                else type(optimizer).from_config(config))
        except Exception:  # noqa: BLE001 (documented: counted as dense)
            _SPARSE_SUMS[key] = 1
    return _SPARSE_SUMS[key]


def _traced_row_sums(make_optimizer):
    """The `_ROW_SUMS` ops of `make_optimizer().apply` on an (8, 4) table's
    sparse gradient of 3 rows, made and traced in a thread of its own
    (TensorFlow's strategy scopes are per thread: a plain optimizer and
    variable, whatever scope the caller is in)."""
    found = []

    def count():
        try:
            optimizer = make_optimizer()
            table = keras.Variable(np.zeros((8, 4), "float32"))
            optimizer.build([table])
            shape = tf.constant([8, 4], tf.int64)

            @tf.function(autograph=False)
            def update(values, indices):
                optimizer.apply([tf.IndexedSlices(values, indices, shape)],
                                [table])

            graph = update.get_concrete_function(
                tf.TensorSpec((3, 4)), tf.TensorSpec((3,), tf.int32)).graph
            found.append(sum(op.type in _ROW_SUMS
                             for op in graph.get_operations()))
        except Exception as error:  # noqa: BLE001 (raised in the caller)
            found.append(error)

    worker = threading.Thread(target=count)
    worker.start()
    worker.join()
    if isinstance(found[0], Exception):
        raise found[0]
    return max(1, found[0])
