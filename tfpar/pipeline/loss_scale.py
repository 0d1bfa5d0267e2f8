"""One overflow decision for every part of a pipeline under loss scaling.

A `PipelineModel` compiled with a `keras.optimizers.LossScaleOptimizer`
gives each part its own copy of it (`stage_optimizers`), and the step
scales the loss by the last part's scale. One device's LossScaleOptimizer
checks every gradient at once: when any is inf or NaN it skips the whole
step and halves the scale. Per part, a part whose own gradients are finite
would apply its step while another skips, and the scales (all starting at
`initial_scale`) would drift apart, so a part would unscale by another
scale than the loss was scaled by.

So after the step's last backward each part's gradients are checked on
its own mesh (a replicated boolean), the flags are gathered on the last
part and combined, and the verdict goes back to every part, each of whose
gradients is multiplied by 1 (all finite everywhere: unchanged, exactly)
or by NaN (some part overflowed): every part's optimizer then skips or
applies together, and their scales stay equal. Under
`offload="optimizer"` the same gradients go to each part's host update.
Across hosts (`tfpar.pipeline.cross_host`) the host-driven step does the
same with its own functions: `all_finite` per part, the flags moved to
the last part through its bridge, `factor_of` there, the factor moved
back and each part's gradients multiplied by it (`times`).

Example (a pipeline's step calls it; nothing to do by hand):

>>> import keras
>>> from tfpar.pipeline import loss_scale
>>> loss_scale.applies_to(keras.optimizers.Adam())
False
"""

import keras
import tensorflow as tf

from tfpar import collectives


def applies_to(optimizer):
    """Whether `optimizer` scales the loss (a `LossScaleOptimizer`)."""
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def _values(gradient):
    return gradient.values if isinstance(gradient, tf.IndexedSlices) \
        else gradient


def all_finite(gradients):
    """1.0 when every gradient is finite, else 0.0 (a replicated scalar on
    the gradients' mesh)."""
    checks = [tf.reduce_all(tf.math.is_finite(_values(g)))
              for g in gradients if g is not None]
    if not checks:
        return tf.constant(1.0)
    return tf.cast(tf.reduce_all(tf.stack(checks)), tf.float32)


def factor_of(flags):
    """1.0 when every flag (`all_finite`, one per part) is 1, else NaN: the
    factor every part's gradients are multiplied by (NaN makes each
    part's LossScaleOptimizer skip the step)."""
    verdict = tf.reduce_min(tf.stack(flags))
    return tf.where(verdict > 0.5, 1.0, float("nan"))


def times(gradient, factor):
    """`gradient` times the scalar `factor` (an IndexedSlices' rows); as
    given when either is None."""
    if gradient is None or factor is None:
        return gradient
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(
            gradient.values * tf.cast(factor, gradient.values.dtype),
            gradient.indices, gradient.dense_shape)
    return gradient * tf.cast(factor, gradient.dtype)


def skip_together(parts, optimizer):
    """In a traced pipeline step, after the last backward: every part's
    `gradient_sums` made non-finite when any part's are (see the module);
    nothing unless `optimizer` is a LossScaleOptimizer and there are
    several parts."""
    if not applies_to(optimizer) or len(parts) < 2:
        return
    meshes = [part.mesh for part in parts]
    last = len(parts) - 1
    flags = []
    for part in parts:
        with part.on_mesh():
            flags.append(collectives.move_to_mesh(
                all_finite(part.gradient_sums), part.mesh, meshes[last], (),
                f"loss_scale_check_{part.index}"))
    with parts[last].on_mesh():
        factor = factor_of(flags)
    for part in parts:
        with part.on_mesh():
            mine = collectives.move_to_mesh(factor, meshes[last], part.mesh,
                                            (), f"loss_scale_verdict_"
                                            f"{part.index}")
            part.gradient_sums = [times(g, mine)
                                  for g in part.gradient_sums]
