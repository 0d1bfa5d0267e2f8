"""Bad input gets a clear Python error before any training step."""

import re

import keras
import numpy as np
import pytest

import tfpar


def mlp(name="mlp"):
    return keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(12, name="up"),
         keras.layers.Dense(4, name="down")],
        name=name,
    )


def compiled_under(strategy):
    with strategy.scope():
        model = mlp()
        model.compile(optimizer="sgd", loss="mse")
    return model


X = np.ones((32, 8), "float32")
Y = np.ones((32, 4), "float32")


def test_non_mesh_is_rejected():
    with pytest.raises(TypeError, match=r"needs a tfpar.Mesh.*Received: mesh=\{'data': 8\}"):
        tfpar.ParallelStrategy({"data": 8})


def test_non_mapping_rules_are_rejected():
    with pytest.raises(TypeError, match=r"needs a mapping.*Received: mapping=\['up'\]"):
        tfpar.LayoutRules(["up"])


def test_bad_spec_is_rejected():
    with pytest.raises(TypeError, match=r"Layout rule '.\*up/kernel' needs a spec.*Received: 'model'"):
        tfpar.LayoutRules({r".*up/kernel": "model"})


def test_bad_regex_is_rejected():
    with pytest.raises(ValueError, match=r"'up\[' is not a valid regex"):
        tfpar.LayoutRules({"up[": (None,)})


def test_rule_naming_missing_axis():
    with pytest.raises(ValueError, match=r"names mesh axis 'tensor'.*mesh axes \('data', 'model'\)"):
        tfpar.ParallelStrategy(
            tfpar.Mesh({"data": 2, "model": 4}),
            rules={r".*up/kernel": (None, "tensor")},
        )


def test_spec_length_must_match_rank():
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"model": 8}), rules={r".*up/kernel": ("model",)})
    with pytest.raises(ValueError, match=r"spec \('model',\) with 1 entries, but variable 'mlp/up/kernel' has rank 2"):
        compiled_under(strategy)


def test_sharded_dimension_must_divide():
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"model": 8}), rules={r".*up/kernel": (None, "model")})
    with pytest.raises(ValueError, match=r"'mlp/up/kernel' has dimension 1 of size 12, which mesh axis 'model' of size 8 does not divide"):
        compiled_under(strategy)


def test_variable_matched_by_two_rules_names_both():
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"model": 8}),
        rules={r".*/kernel": (None, None), r".*up/.*": (None, "model")})
    with pytest.raises(ValueError, match=r"'mlp/up/kernel' is matched by 2 layout rules: \['.\*/kernel', '.\*up/.\*'\]"):
        compiled_under(strategy)


def test_rule_that_matched_nothing_is_reported_at_compile():
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"data": 2, "model": 4}),
        rules={r".*down/kernel": ("model", None), r".*upp/bias": ("model",)})
    with strategy.scope():
        model = mlp()  # building is fine: more models may come
        with pytest.raises(ValueError) as error:
            model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    message = str(error.value)
    # Nearest weight paths first; only the model's weights, no optimizer or
    # metric state.
    assert re.search(r"\['.\*upp/bias'\] matched no variable.*nearest "
                     r"first: \['mlp/up/bias', ", message), message
    assert "mlp/down/kernel" in message
    assert "iteration" not in message and "total" not in message
    assert "in user code" not in message  # not from inside a traced step


def test_rule_that_matched_nothing_is_reported_when_only_predict_runs():
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"data": 2, "model": 4}),
        rules={r".*up/kernel": (None, "model"), r".*dwn/kernel": ("model", None)})
    with strategy.scope():
        model = mlp()
    with pytest.raises(ValueError, match=r"\['.\*dwn/kernel'\] matched no "
                       r"variable.*nearest first: \['mlp/down/kernel', ") as error:
        model.predict(X, verbose=0)
    assert "in user code" not in str(error.value)


def test_global_batch_not_divisible_by_data_axis():
    model = compiled_under(tfpar.ParallelStrategy(tfpar.Mesh({"data": 8})))
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=r"global batch size 12 is not divisible by the data axis 'data' of size 8.*multiple of 8"):
        model.fit(X, Y, batch_size=12, epochs=1, verbose=0)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_data_axis_must_be_a_name():
    with pytest.raises(TypeError, match="Received: data_axis=0"):
        tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}), data_axis=0)


def test_rules_reused_by_a_second_strategy_are_checked_again():
    rules = tfpar.LayoutRules({r".*up/kernel": (None, "model"),
                               r".*upp/bias": ("model",)})
    first = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}), rules=rules)
    second = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}), rules=rules)
    for strategy in (first, second):
        with pytest.raises(ValueError, match=r"'.\*upp/bias'\] matched no variable"):
            compiled_under(strategy)


def test_apply_rules_changes_nothing_when_a_rule_is_bad():
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}))
    with strategy.scope():
        model = mlp()
    before = strategy.placements("params")
    with pytest.raises(ValueError, match=r"\['nothing'\] matched no weight "
                       r"of model 'mlp' \(its weights, nearest first: \["):
        strategy.apply_rules(model, {r".*up/kernel": (None, "model"),
                                     "nothing": (None,)})
    assert strategy.placements("params") == before


def test_unbatched_input_is_a_clear_error():
    import tensorflow as tf  # noqa: PLC0415

    model = compiled_under(tfpar.ParallelStrategy(tfpar.Mesh({"data": 8})))
    dataset = tf.data.Dataset.from_tensor_slices(X).map(lambda x: (x[0], x[:4]))
    # Keras' own shape check speaks first, before any step.
    with pytest.raises(ValueError, match=r"Expected shape \(None, 8\), but input has incompatible shape \(\)"):
        model.fit(dataset, epochs=1, verbose=0)
    placer = tfpar.strategy.inputs.InputPlacer(tfpar.Mesh({"data": 8}), "data")
    with pytest.raises(ValueError, match="every input needs a batch dimension"):
        placer.check_batch_size((tf.constant(1.0), tf.ones((8, 2))))
