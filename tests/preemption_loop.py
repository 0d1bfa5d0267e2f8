"""The custom training loop of the `tfpar.on_preemption` tests.

`models.host_mlp` trained with Adam(0.01) by `model.optimizer.apply_gradients`
in a `strategy.run` step (a plain `tf.function` on one device), batch k of
step k being rows [BATCH * (k % n), +BATCH) of the data in order, so a loop
resumed at step s reads what the uninterrupted loop reads from s on.
Used in this process by tests/test_preemption.py and on two hosts by
tests/preemption_loop_child.py.
"""

import keras
import numpy as np
import tensorflow as tf

import models
from tfpar import placement

BATCH = 16


def compiled_mlp(strategy, weights):
    """`models.host_mlp` with `weights`, compiled with Adam (under
    `strategy`'s scope, or on one device when it is None)."""
    scope = strategy.scope() if strategy else tf.init_scope()
    with scope:
        model = models.host_mlp()
        model.set_weights(weights)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def step_function(strategy, model):
    """One training step (inputs, targets) -> loss."""
    def step(inputs, targets):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(inputs, training=True)
                                            - targets))
        grads = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    if strategy is None:
        return tf.function(step)
    return tf.function(lambda x, y: strategy.run(step, args=(x, y)))


def batches(strategy, x, y, start, stop):
    """The batches of steps start, ..., stop - 1 (distributed by
    `strategy`, if any)."""
    dataset = (tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
               .repeat().skip(start).take(stop - start))
    return strategy.experimental_distribute_dataset(dataset) if strategy \
        else dataset


def train(strategy, model, x, y, stop, guard=None, after_step=None):
    """Runs steps guard.start_step (0 without a guard) .. stop - 1, each
    reported to `guard` (the loop stops when it says so); `after_step(k)`
    after step k's update. Returns the losses of the steps run."""
    start = guard.start_step if guard else 0
    run_step = step_function(strategy, model)
    losses = []
    for step, (inputs, targets) in zip(
            range(start, stop), batches(strategy, x, y, start, stop)):
        losses.append(run_step(inputs, targets))
        if after_step is not None:
            after_step(step)
        if guard is not None and guard.step_end():
            break
    return np.array([float(placement.fetch(loss)) for loss in losses])
