"""Keras' own tf.distribute tests with ParallelStrategy (issue 38, item 7).

Keras 3 ships `keras/src/backend/tensorflow/distribute_test.py` and
`optimizer_distribute_test.py`, written against
`tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])`. Here their test
classes run as they are, with only the strategy swapped for a
`tfpar.ParallelStrategy` on a data=2 mesh (the same two CPU devices; the
tests' `setUp` resets TF's context, which a tfpar process cannot do after
its devices were split, so it is replaced by building the strategy).

Inherited unchanged and passing: the optimizer's config, weight decay,
EMA, clipping, "stateless_apply not supported", variable aggregation.

Rewritten, because they assert MirroredStrategy's per-replica semantics or
types, each with the tfpar equivalent asserted instead:

* single step, golden values, gradient accumulation: MirroredStrategy runs
  the function once per replica (2) and sums the replicas' gradients, so
  Keras' expected values move the variables by twice the host gradient.
  A ParallelStrategy is one SPMD replica (`num_replicas_in_sync == 1`):
  the gradient given is the global one, as in single-device Keras. SGD
  without momentum history is linear in the gradient, so the expected
  values are Keras' with the displacement halved, and they equal
  single-device Keras' run of the same code (asserted too);
* variable creation, `strategy.run` results, the epoch iterator, the seed
  generator, fit with a regularizer: they read `MirroredVariable` /
  `PerReplica` objects (`.values`, one per replica). tfpar's variables are
  DTensor variables and its values global DTensors: the tests assert the
  layout (each device's share, `dtensor.unpack`) and the same numbers;
* variable synchronization: MirroredStrategy resolves "auto" to ON_WRITE on
  the tf.Variable; tfpar keeps AUTO (one replica: no synchronization at
  all); "on_read" is kept as given by both.

The Keras code path fixed for this contract: `optimizer.apply_gradients`
called eagerly in the scope with gradients computed on the host
(`tfpar.strategy._host_gradients_placed`).
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import keras
from keras.src import backend
from keras.src import layers
from keras.src import models
from keras.src import testing
from keras.src.backend.tensorflow import distribute_test as keras_distribute
from keras.src.backend.tensorflow import (
    optimizer_distribute_test as keras_optimizer_distribute)
from keras.src.backend.tensorflow import trainer as tf_trainer
from keras.src.optimizers.sgd import SGD

import tfpar

_STRATEGY = []


def two_device_strategy():
    """ParallelStrategy on CPU:0 and CPU:1 (MirroredStrategy's devices in
    Keras' tests), one per process (its mesh is reused)."""
    if not _STRATEGY:
        _STRATEGY.append(tfpar.ParallelStrategy(
            tfpar.Mesh({"data": 2}, devices=["CPU:0", "CPU:1"])))
    return _STRATEGY[0]


def one_replica(expected, start):
    """Keras' MirroredStrategy value (2 replicas summing the same gradient)
    as one replica moves: start + (expected - start) / 2."""
    start = np.asarray(start, "float64")
    return start + (np.asarray(expected, "float64") - start) / 2


class TestKerasOptimizerDistribute(
        keras_optimizer_distribute.OptimizerDistributeTest):
    """Keras' optimizer tests; test_config, test_weight_decay, test_ema,
    test_clip_norm, test_clip_value, test_stateless_not_supported run as
    Keras wrote them."""

    def setUp(self):
        testing.TestCase.setUp(self)
        self.strategy = two_device_strategy()

    # absl's parameterized copies of Keras' single step (2-replica values).
    test_single_step0 = None
    test_single_step1 = None

    def run_both(self, body):
        """body(strategy) under tfpar and under no strategy (single-device
        Keras); both results, which must agree."""
        ours = body(self.strategy)
        keras.backend.clear_session()
        theirs = body(tf.distribute.get_strategy())
        for a, b in zip(ours, theirs):
            self.assertAllClose(a, b, rtol=1e-6, atol=1e-6)
        return ours

    def test_single_step_one_replica(self):
        def body(strategy):
            with strategy.scope():
                optimizer = SGD(learning_rate=0.5, momentum=0.06)
                variable = tf.Variable([1.0, 2.0, 3.0, 4.0])

                def update():
                    grads = tf.constant([1.0, 6.0, 7.0, 2.0])
                    optimizer.apply_gradients(zip([grads], [variable]))

                strategy.run(update)
            return [variable.numpy()]

        (value,) = self.run_both(body)
        self.assertAllClose(value, one_replica([0.0, -4.0, -4.0, 2.0],
                                               [1.0, 2.0, 3.0, 4.0]),
                            rtol=1e-4, atol=1e-4)
        self.assertAllClose(value, [0.5, -1.0, -0.5, 3.0])

    def test_correctness_with_golden(self):
        # Keras' golden values (2 replicas), first 2 rows.
        golden = np.array([
            [0.9980, 0.9960, 0.9940, 0.9920, 0.9900, 0.9880, 0.9860, 0.9840,
             0.9820, 0.9800],
            [0.9978, 0.9958, 0.9938, 0.9918, 0.9898, 0.9878, 0.9858, 0.9838,
             0.9818, 0.9798]])

        def body(strategy):
            with strategy.scope():
                optimizer = SGD(nesterov=True)
                x = backend.Variable(np.ones([10]))
            seen = []
            strategy.run(lambda: optimizer.apply_gradients(zip(
                [backend.convert_to_tensor(np.arange(0.1, 1.1, 0.1))], [x])))
            for _ in range(5):
                seen.append(np.asarray(x.numpy()))
                strategy.run(lambda: optimizer.apply_gradients(zip(
                    [backend.convert_to_tensor(np.full((10,), 0.01))], [x])))
            return seen

        seen = self.run_both(body)
        self.assertAllClose(seen[0], one_replica(golden[0], 1.0),
                            rtol=5e-4, atol=5e-4)
        self.assertAllClose(seen[1], one_replica(golden[1], 1.0),
                            rtol=5e-4, atol=5e-4)

    def test_gradient_accumulation(self):
        def body(strategy):
            with strategy.scope():
                v = backend.Variable([[1.0, 2.0], [3.0, 4.0]])
                grads = backend.convert_to_tensor([[1.0, 1.0], [2.0, 2.0]])
                optimizer = SGD(learning_rate=1.0,
                                gradient_accumulation_steps=3)
                states = []
                for _ in range(3):
                    strategy.run(lambda: optimizer.apply_gradients(
                        [(grads, v)]))
                    states += [v.numpy(),
                               optimizer._accumulated_gradients[0].numpy(),
                               np.asarray(optimizer._iterations.numpy()),
                               np.asarray(optimizer.iterations.numpy())]
            return states

        states = self.run_both(body)
        accumulated = [[[1.0, 1.0], [2.0, 2.0]], [[2.0, 2.0], [4.0, 4.0]],
                       [[0.0, 0.0], [0.0, 0.0]]]
        for step in range(3):
            v, acc, raw, iterations = states[4 * step: 4 * step + 4]
            self.assertAllClose(acc, accumulated[step])
            self.assertEqual(int(raw), step + 1)
            self.assertEqual(int(iterations), int(step == 2))
        self.assertAllClose(states[0], [[1.0, 2.0], [3.0, 4.0]])
        self.assertAllClose(states[8], one_replica(
            [[-1.0, 0.0], [-1.0, 0.0]], [[1.0, 2.0], [3.0, 4.0]]))


class TestKerasDistribute(keras_distribute.DistributeTest):
    """Keras' tf.distribute tests; test_variable_aggregation runs as
    Keras wrote it."""

    def setUp(self):
        testing.TestCase.setUp(self)

    def test_variable_creation(self):
        strategy = two_device_strategy()
        with strategy.scope():
            dense = layers.Dense(2)
            dense.build([4, 2])
        for weight in (dense.kernel, dense.bias):
            self.assertIsInstance(weight, backend.Variable)
            layout = dtensor.fetch_layout(weight.value)
            self.assertEqual(layout.mesh.dim_names, ["data"])
            self.assertTrue(layout.is_fully_replicated())
            self.assertEqual(
                [c.shape for c in dtensor.unpack(weight.value.read_value())],
                [weight.shape] * 2)

    def test_strategy_run(self):
        strategy = two_device_strategy()
        with strategy.scope():
            inputs = layers.Input(shape=[4])
            dense = layers.Dense(2)
            model = models.Functional(inputs, dense(inputs))
        data = np.concatenate([np.zeros([8, 4]), np.ones([8, 4])]
                              ).astype("float32")

        @tf.function
        def run_fn(batch):
            return model(batch)

        result = strategy.run(run_fn, args=(data,))
        # One global value, its rows split over the data axis.
        self.assertTrue(dtensor.is_dtensor(result))
        self.assertEqual([c.shape for c in dtensor.unpack(result)],
                         [tf.TensorShape([8, 2])] * 2)
        value = tfpar.placement.fetch(result)
        self.assertAllClose(value[:8], np.zeros([8, 2]))
        expected = data[8:] @ dense.kernel.numpy() + dense.bias.numpy()
        self.assertAllClose(value[8:], expected)
        self.assertNotAllClose(value[:8], value[8:])

    def test_epoch_iterator(self):
        x = np.random.random((100, 16))
        y = np.random.random((100, 4))
        sample_weight = np.random.random((100,))
        epoch_iterator = tf_trainer.TFEpochIterator(
            x=x, y=y, sample_weight=sample_weight, batch_size=16,
            shuffle=True, distribute_strategy=two_device_strategy())
        steps_seen = []
        for step, _, data_iterator in epoch_iterator:
            steps_seen.append(step)
            batch = next(data_iterator)
            self.assertEqual(len(batch), 3)
            # Each device holds its 8 rows of the global batch of 16 (the
            # last partial batch: 2 of 4), as each replica's PerReplica
            # value under MirroredStrategy.
            rows = 8 if step < 6 else 2
            for value, width in zip(batch, ([16], [4], [])):
                self.assertTrue(dtensor.is_dtensor(value))
                self.assertEqual([c.shape.as_list() for c in
                                  dtensor.unpack(value)],
                                 [[rows] + width] * 2)
        self.assertEqual(steps_seen, [0, 1, 2, 3, 4, 5, 6])

    def test_variable_synchronization(self):
        with two_device_strategy().scope():
            x = np.random.random((4, 4))
            v1 = backend.Variable(x, dtype="float32")
            self.assertEqual(v1.synchronization, "auto")
            # MirroredStrategy resolves AUTO to ON_WRITE; one SPMD replica
            # keeps it (there is nothing to synchronize).
            self.assertEqual(v1.value.synchronization,
                             tf.VariableSynchronization.AUTO)
            v2 = backend.Variable(x, dtype="float32",
                                  synchronization="on_read")
            self.assertEqual(v2.synchronization, "on_read")
            self.assertEqual(v2.value.synchronization,
                             tf.VariableSynchronization.ON_READ)

    def test_seed_generator(self):
        strategy = two_device_strategy()
        with strategy.scope():
            seed_generator = keras.random.SeedGenerator(42)
            state = strategy.run(lambda: seed_generator.state.value)
            for component in dtensor.unpack(state.read_value()):
                self.assertAllClose(keras.ops.convert_to_numpy(component),
                                    (42, 0))

    def test_correctness_with_fit_and_regularizer(self):
        def train(scope):
            with scope:
                inputs = layers.Input(shape=(1,))
                layer = layers.Dense(
                    1, use_bias=False,
                    kernel_initializer=keras.initializers.Constant(1),
                    kernel_regularizer=keras.regularizers.L1L2(l1=0.01,
                                                               l2=0.01))
                model = models.Model(inputs, layer(inputs))
                model.compile(loss="mse", optimizer="sgd")
                history = model.fit(np.ones((12, 1), "float32"),
                                    np.zeros((12, 1), "float32"),
                                    batch_size=12, epochs=1, verbose=0)
            return history.history["loss"], layer.kernel.numpy()

        expected_loss, expected_kernel = train(
            tf.distribute.get_strategy().scope())
        loss, kernel = train(two_device_strategy().scope())
        self.assertAllClose(loss, expected_loss)
        self.assertAllClose(kernel, expected_kernel)


@pytest.mark.parametrize("rules", [None, {r".*kernel": (None, "model")}])
def test_host_gradients_on_a_sharded_variable(rules):
    """apply_gradients eagerly with host gradients onto a kernel split over
    "model" (data=2 x model=4): Adam's weights and slots equal single-device
    Keras', and each device holds only its block."""
    keras.utils.set_random_seed(0)
    start = np.random.RandomState(0).normal(size=(4, 8)).astype("float32")
    grads = [np.random.RandomState(s).normal(size=(4, 8)).astype("float32")
             for s in (1, 2)]

    def run(strategy):
        with strategy.scope():
            dense = layers.Dense(8, use_bias=False, name="d")
            dense.build((None, 4))
            dense.kernel.assign(start)
            optimizer = keras.optimizers.Adam(0.1)
            for grad in grads:
                strategy.run(lambda g=grad: optimizer.apply_gradients(
                    [(tf.constant(g), dense.kernel)]))
        return dense, optimizer

    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}),
                                      rules=rules)
    dense, optimizer = run(strategy)
    reference, reference_optimizer = run(tf.distribute.get_strategy())
    np.testing.assert_allclose(dense.kernel.numpy(), reference.kernel.numpy(),
                               rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(optimizer.variables,
                            reference_optimizer.variables):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs),
                                   rtol=1e-5, atol=1e-6)
    block = [4, 2] if rules else [4, 8]
    assert [c.shape.as_list() for c in dtensor.unpack(
        dense.kernel.value.read_value())] \
        == [block] * 8
