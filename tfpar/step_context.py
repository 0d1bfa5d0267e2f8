"""Where a thread is in a step: the one place tfpar asks it.

Three things, all per thread, all read from below the strategy (variables,
collectives, recomputation, the patches of Keras) without importing it:

- the SPMD replica context: a `ParallelStrategy` runs a step as one SPMD
  program, entered with `ReplicaScope(strategy)` (its scope and the single
  `SPMDReplicaContext`); `in_spmd_step()` says whether the code runs inside
  one, and `step_extended()` gives that strategy's `extended`;
- the recomputation stacks (`pushed`, `stack`): the checkpointed calls
  running, the seeds a recomputation replays, and the scalar a variable
  read adds while a layer is recomputed (`recompute_dependency`);
- the layout-free draw flag (`layout_free_draw`, `layout_free`): a seed is
  being drawn for numbers laid out whole on every device.

What is read through `step_extended()` (duck-typed: the `ParallelExtended`
of `tfpar.strategy`): `replicate(value)` (a tensor laid out whole on every
device of the stage being traced), `registry.placement_mesh` (that stage's
`tfpar.Mesh`, None while the weights wait on the host), `dims.model_axes`
and `mesh`.

Example:

>>> from tfpar import step_context
>>> step_context.in_spmd_step(), step_context.recompute_dependency()
(False, None)
>>> with step_context.layout_free_draw():
...     step_context.layout_free()
True
"""

import contextlib
import threading

import tensorflow as tf


class SPMDReplicaContext(tf.distribute.ReplicaContext):
    """The single replica of an SPMD program: reductions are identities."""

    def __init__(self, strategy):
        super().__init__(strategy, replica_id_in_sync_group=0)

    def all_reduce(self, reduce_op, value, options=None):
        return value

    def all_gather(self, value, axis, options=None):
        return value


class ReplicaScope:
    """`with strategy.scope(), SPMDReplicaContext(strategy):` as one."""

    def __init__(self, strategy):
        self._scope = strategy.scope()
        self._context = SPMDReplicaContext(strategy)

    def __enter__(self):
        self._scope.__enter__()
        self._context.__enter__()

    def __exit__(self, *exc):
        self._context.__exit__(*exc)
        self._scope.__exit__(*exc)


def in_spmd_step():
    """Whether the code runs inside a tfpar SPMD step (a traced step)."""
    return isinstance(tf.distribute.get_replica_context(), SPMDReplicaContext)


def step_extended():
    """The `extended` of the strategy whose SPMD step runs now, or None."""
    context = tf.distribute.get_replica_context()
    if isinstance(context, SPMDReplicaContext):
        return context.strategy.extended
    return None


def replicate_in_step():
    """In a step, the function laying a tensor out whole on every device of
    the stage being traced (`extended.replicate`); None elsewhere."""
    extended = step_extended()
    return None if extended is None else extended.replicate


def step_mesh():
    """In a step, the `tfpar.Mesh` its weights live on (the whole mesh, or
    the pipeline stage being traced; None between a pipeline's parts);
    None outside a step."""
    extended = step_extended()
    return None if extended is None else extended.registry.placement_mesh


# -- recomputation (tfpar/recompute.py) --------------------------------------

_RECOMPUTING = threading.local()


def stack(name):
    """This thread's stack `name` ("checkpoints", "seeds", "dependencies",
    "layout_free"): a list, innermost last."""
    return _RECOMPUTING.__dict__.setdefault(name, [])


@contextlib.contextmanager
def pushed(name, value):
    """`value` on top of this thread's stack `name` inside the block."""
    values = stack(name)
    values.append(value)
    try:
        yield value
    finally:
        values.pop()


class Seeds:
    """The Keras random seeds a call drew (a frame of stack "seeds":
    `recompute.next_seed` appends each seed drawn), handed out again in the
    same order when it runs again (`replaying`): a recomputation of
    `keras.RematScope`, the backward of a pipeline stage on another host
    (`tfpar.pipeline.cross_host`), so Dropout applies the same mask twice."""

    def __init__(self, values=(), replaying=False):
        self.values = list(values)
        self.replaying = replaying


def layout_free_draw():
    """A context for drawing a seed whose random numbers do not depend on
    how DTensor lays the tensor out (the one-device Dropout of
    `tfpar.spmd_patches` draws them whole on every device): replaying it in
    a recomputation gives the forward pass's mask on any mesh, so it is not
    refused."""
    return pushed("layout_free", True)


def layout_free():
    """Whether a layout-free seed is being drawn (`layout_free_draw`)."""
    return bool(stack("layout_free"))


def recompute_dependency():
    """While a layer is recomputed in the backward pass (see
    `tfpar.recompute.recompute`): a scalar 0.0 computed from the upstream
    gradient. A variable read that must run again there adds it to its
    value. None at any other time."""
    dependencies = stack("dependencies")
    return dependencies[-1] if dependencies else None
