"""A model built outside `strategy.scope()` and compiled inside it.

`compile` moves its weights onto the mesh (laid out by the rules, as if it
had been built in the scope) and binds the model to the strategy; training
is in parity with one device.
"""

import keras
import numpy as np
import pytest
from tensorflow.experimental import dtensor

import tfpar
import models

def test_compile_in_scope_moves_weights_built_outside_onto_the_mesh():
    keras.utils.set_random_seed(0)
    reference = models.host_mlp()
    weights = reference.get_weights()
    reference.compile(optimizer="sgd", loss="mse")
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}),
                                      rules=models.HOST_RULES)
    model = models.host_mlp()  # outside the scope
    model.set_weights(weights)
    with strategy.scope():
        model.compile(optimizer="sgd", loss="mse")
    kernel = model.get_layer("up0").kernel.value
    assert dtensor.is_dtensor(kernel)
    assert [b.shape.as_list() for b in dtensor.unpack(kernel.read_value())] == [[16, 8]] * 8
    assert ("mlp/up0/kernel", (None, "model"), (16, 8)) in strategy.placements()

    x, y = models.mlp_data()
    expected = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                             verbose=0).history["loss"]
    got = model.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                    verbose=0).history["loss"]  # outside the scope
    np.testing.assert_allclose(got, expected, rtol=1e-4)
    for a, b in zip(reference.get_weights(), model.get_weights()):
        assert models.relative_error(a, b) < 1e-4
    np.testing.assert_allclose(model.predict(x, verbose=0),
                               reference.predict(x, verbose=0), rtol=1e-4,
                               atol=1e-6)


def test_weights_on_another_strategys_mesh_are_refused_at_compile():
    first = tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}))
    second = tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}))
    with first.scope():
        inner = models.host_mlp()
    # Built outside any scope from layers whose weights live on `first`.
    model = keras.Model(inner.inputs, inner.outputs, name="mlp")
    with second.scope(), pytest.raises(
            ValueError, match=r"weights of model 'mlp' were created outside "
            r"this strategy's scope.*another strategy's mesh.*'mlp/up0/kernel'"
            r".*Build the model inside `with strategy.scope\(\):`"):
        model.compile(optimizer="sgd", loss="mse")


def test_an_optimizer_made_outside_the_scope_is_rebuilt_under_it():
    """`compile` in the scope rebuilds an unbuilt optimizer made outside it
    from its config (`tfpar.strategy.adopt_optimizer`): the same training
    as one device; a built one is refused, naming the fix."""
    keras.utils.set_random_seed(0)
    reference = models.host_mlp()
    weights = reference.get_weights()
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}),
                                      rules=models.HOST_RULES)
    outside = keras.optimizers.Adam(0.01)
    with strategy.scope():
        model = models.host_mlp()
        model.set_weights(weights)
        model.compile(optimizer=outside, loss="mse")
    assert model.optimizer is not outside
    assert model.optimizer.get_config() == outside.get_config()
    x, y = models.mlp_data()
    expected = reference.fit(x, y, batch_size=16, epochs=1, shuffle=False,
                             verbose=0).history["loss"]
    got = model.fit(x, y, batch_size=16, epochs=1, shuffle=False,
                    verbose=0).history["loss"]
    np.testing.assert_allclose(got, expected, rtol=1e-4)
    for a, b in zip(reference.get_weights(), model.get_weights()):
        assert models.relative_error(a, b) < 1e-4
    built = keras.optimizers.Adam(0.01)
    built.build([keras.Variable(np.ones(3, "float32"))])
    with strategy.scope(), pytest.raises(ValueError, match=(
            r"The optimizer 'adam\w*' was created and built outside the "
            r"strategy's scope\. Received: an optimizer bound to "
            r"_DefaultDistributionStrategy\. Create it inside")):
        models.host_mlp().compile(optimizer=built, loss="mse")
