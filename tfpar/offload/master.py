"""`offload="optimizer+master"`: under mixed precision the devices hold
each weight in the compute dtype only; its float32 master lives with the
optimizer's slots on the host devices (`tfpar.offload`).

Under a mixed policy (`mixed_bfloat16`, `mixed_float16`) Keras keeps each
weight in float32 and casts it in every layer call, so the forward and
backward only ever see c = cast(w, compute dtype), and the gradient of a
cast is the cast of the gradient. With "+master" each such weight's
device storage is a `ComputeCopy` holding c itself (2 bytes a parameter,
not 4); the host copy `tfpar.offload` already keeps for its update
(`Offload.mirror`) is the float32 master w. After each host update the
host casts w to the compute dtype and the blocks of c move back
(`ComputeCopy.sync`); the host update casts each gradient to float32
first. So a step computes what `offload="optimizer"` computes: measured
bit-identical on data=8, data=8 fsdp and data=2 x model=4
(tests/test_offload_master.py).

A `PipelineModel`'s parts each have their own `Offload` (`tfpar.offload`):
each stage's devices hold c of its weights, each part's masters and slots
live on the host devices of its stage's devices. A part sums its
micro-batches' gradients of c in float32 (`ModelPart.add_gradient`), as
the gradient of a float32 weight's cast is summed without "+master"
(summed in bfloat16 instead, a 1F1B pipeline's weights were 0.27 relative
from "optimizer" after 4 steps). A weight tied across stages keeps its
persistent copy (`tfpar.pipeline.tied`) in the compute dtype too, with its
own master on the copy's stage's hosts, refilled from the weight's float32
master. 1F1B, GPipe, ZB-H1, interleaved stages, tied weights and loss
scaling are bit-identical to "optimizer" and to no offload
(tests/test_offload_master_pipeline.py).

Across hosts (`tfpar.connect_hosts`, "spread" meshes as for
`offload="optimizer"`) nothing changes: each host casts and moves its own
blocks (tests/test_offload_hosts.py), also in a pipeline whose stages
live on different hosts (`tfpar.offload.OffloadCrossHostRunner`).

What a user reads is the master: `get_weights`, `weight.numpy()`,
`save_weights` and `tfpar.save_checkpoint` give float32 w (a checkpoint
saved with "+master" restores without offload and back); `assign`,
`set_weights`, `load_weights` and `restore_checkpoint` write w whole on
the host and c from it. (Keras' TF Variable would cast the value to the
storage dtype first: `MASTER_PATCHES`, installed on use.)
A tensor or an expression of the weight (`keras.ops.convert_to_tensor(w)`,
`kernel * 0.5` in a callback) is c, in the compute dtype: Keras computes
in the dtype of the tf.Variable; write `kernel.numpy() * 0.5` for the
float32 value. A train_step assigning a weight writes c too (the step has
no master), which then reaches the master (`Offload.pull_weights`).

Weights kept float32 on the devices: those of a layer computing in
float32 (e.g. a `dtype="float32"` head) and any non-trainable or
non-float weight.

Example (8 virtual CPUs: the mesh on CPU:0-3, the host CPU:4-7):

>>> import keras, numpy as np, tfpar
>>> tfpar.use_virtual_cpus(8)
>>> keras.config.set_dtype_policy("mixed_bfloat16")
>>> strategy = tfpar.ParallelStrategy(
...     tfpar.Mesh({"data": 4}, devices=[f"CPU:{i}" for i in range(4)]),
...     offload="optimizer+master",
...     offload_devices=[f"CPU:{i}" for i in range(4, 8)])
>>> with strategy.scope():
...     model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(16)])
...     model.compile(optimizer="sgd", loss="mse")
>>> x = np.ones((64, 16), "float32")
>>> history = model.fit(x, x, batch_size=16, verbose=0)
>>> memory = strategy.memory_per_device()
>>> memory["CPU:0"]["params"], memory["CPU:4"]["params"]  # 272 parameters
(544, 1088)
>>> model.get_weights()[0].dtype
dtype('float32')
>>> keras.config.set_dtype_policy("float32")
"""

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import _compat
from tfpar import layout as layout_lib
from tfpar import variables

OPTION = "optimizer+master"


# Keras' TF Variable casts every value it assigns to its tf.Variable's
# dtype (`_direct_assign`). Under `offload="optimizer+master"` a weight's
# tf.Variable is its compute-dtype copy (`tfpar.offload.master`), which
# takes the float32 value whole into its host master and stores the cast;
# the Keras cast would round the master first (installed by
# `install`).
def _master_direct_assign(original, _):
    def direct_assign(self, value):
        if getattr(self._value, "master", None) is not None:  # noqa: SLF001
            return self._value.assign(value)  # noqa: SLF001
        return original(self, value)

    return direct_assign


MASTER_PATCHES = (
    _compat.Patch("master_assign", lambda: _compat.keras_tf_core().Variable,
                  "_direct_assign", _master_direct_assign),
)


def install():
    """Installs `MASTER_PATCHES` (once; by `check`)."""
    _compat.install_group("offload_master", MASTER_PATCHES, None)


def check():
    """Refuses "+master" where it gains nothing, before training: under a
    float32 policy the device copy would be the master itself (use
    offload="optimizer"). Installs the patches otherwise."""
    policy = keras.config.dtype_policy()
    if policy.compute_dtype == "float32":
        raise ValueError(
            f"ParallelStrategy(offload={OPTION!r}): under the dtype policy "
            f"{policy.name!r} the weights compute in float32, so the "
            "devices' copy would be the float32 master itself and nothing "
            "is saved. Use offload='optimizer', or set a mixed policy "
            "first (keras.config.set_dtype_policy('mixed_bfloat16')). "
            f"Received: offload={OPTION!r}, policy {policy.name!r}.")
    install()


def keeps_compute_copy(weight):
    """Whether the devices hold trainable Keras `weight` in its layer's
    compute dtype (a float32 weight Keras casts to a lower one)."""
    backing = _compat.backing_variable(weight)
    compute = getattr(backing, "compute_dtype", None)
    return (weight.trainable and _compat.keras_autocasts(weight)
            and backing.dtype == tf.float32 and compute is not None
            and tf.as_dtype(compute) in (tf.bfloat16, tf.float16))


def to_compute_copy(registry, weight, master, move):
    """Replaces `weight`'s device storage by a `ComputeCopy` of its host
    `master` (a Keras variable on the host mesh); `move(value, layout)`
    moves blocks (`tfpar.offload.move_blocks`). Returns the copy."""
    backing = _compat.backing_variable(weight)
    dtype = tf.as_dtype(backing.compute_dtype)
    value = move(tf.cast(_compat.backing_variable(master).read_value(),
                         dtype), _layout(backing))
    return variables.replace_storage(
        registry, weight, value, ComputeCopy,
        master=_compat.backing_variable(master), move=move)


def compute_cast(weight, master):
    """In the compiled host update: Keras `master` (the host copy of
    `weight`) cast to the dtype of `weight`'s ComputeCopy, else None."""
    backing = _compat.backing_variable(weight)
    if not isinstance(backing, ComputeCopy):
        return None
    return tf.cast(_compat.backing_variable(master).read_value(),
                   backing.dtype)


def _layout(backing):
    """The DTensor layout of a strategy's variable, from its Placement."""
    return layout_lib.to_dtensor_layout(backing.placement.spec,
                                        backing.placement.mesh)


class ComputeCopy(variables.ShardedVariable):
    """A weight's device storage under "+master": cast(w, compute dtype)
    of its float32 host `master` w (see the module). Reading it in a step
    and any expression of it (`kernel * 0.5`, in a callback too) read the
    compute-dtype blocks; `numpy()` (`get_weights`, saving) is the
    master's value; an eager `assign` (`set_weights`, restoring)
    writes the master whole and then this copy from it (`sync`); an
    assignment inside a compiled function writes this copy only (the
    offload's `pull_weights` then copies it into the master).

    Args:
        master: the master's ShardedVariable on the host mesh.
        move: `move(value, layout)`, the block-by-block move between the
            meshes.
    """

    def __init__(self, *args, master, move, **kwargs):
        self.master = master
        self._move = move
        self.master_writes = 0  # `writes` when this equalled the master
        super().__init__(*args, **kwargs)

    def numpy(self):
        return self.master.numpy()

    def _to_master(self, value):
        """`value` (host, or a DTensor on this copy's mesh) for the master:
        float32, its blocks moved to the host devices."""
        if isinstance(value, tf.Variable):
            value = value.read_value()
        if dtensor.is_dtensor(value) and (
                dtensor.fetch_layout(value).mesh
                == self.placement.mesh.dtensor_mesh):
            value = self._move(tf.cast(value, self.master.dtype),
                               _layout(self.master))
        return value

    def sync(self, cast=None):
        """This copy from the master: `cast` (the master cast to this
        dtype on the host, by the host update) or the cast made here, its
        blocks moved (half the bytes of a float32 move under bfloat16)."""
        if cast is None:
            cast = tf.cast(self.master.read_value(), self.dtype)
        super().assign(self._move(cast, _layout(self)), read_value=False)
        self.master_writes = self.writes

    @tf.autograph.experimental.do_not_convert  # zero-argument super()
    def _write(self, method, value, kwargs):
        if not tf.executing_eagerly():  # a compiled step's own assignment
            return getattr(super(), method)(tf.cast(value, self.dtype),
                                            **kwargs)
        getattr(self.master, method)(self._to_master(value))
        self.sync()
        return self.read_value() if kwargs.get("read_value", True) else None

    def assign(self, value, use_locking=None, name=None, read_value=True):
        return self._write("assign", value, {"read_value": read_value})

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        return self._write("assign_add", delta, {"read_value": read_value})

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        return self._write("assign_sub", delta, {"read_value": read_value})
