"""Keras works under ParallelStrategy as on one device (data=2 x model=4).

Each test runs the same calls on a single-device twin built from the same
initial weights and compares the results.
"""

import contextlib

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import tfpar

import models

RTOL = 1e-4


def mlp():
    return keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(32, activation="relu", name="up"),
         keras.layers.Dense(16, name="down"), keras.layers.Dense(3, name="out")],
        name="mlp")


RULES = {r".*up/kernel": (None, "model"), r".*up/bias": ("model",),
         r".*down/kernel": ("model", None)}
STRATEGY = None


def strategy():
    global STRATEGY
    if STRATEGY is None:
        STRATEGY = tfpar.ParallelStrategy(
            tfpar.Mesh({"data": 2, "model": 4}), rules=RULES)
    return STRATEGY


def twins(**compile_kwargs):
    """(single-device model, tfpar model) with equal weights, compiled alike."""
    keras.utils.set_random_seed(1)
    single = mlp()
    with strategy().scope():
        parallel = mlp()
        parallel.set_weights(single.get_weights())
    for model in (single, parallel):
        model.compile(
            optimizer=keras.optimizers.Adam(0.01), loss="mse",
            metrics=["mae", keras.metrics.RootMeanSquaredError(name="rmse")],
            **compile_kwargs)
    return single, parallel


def data(n=100, seed=0):
    return models.mlp_data(n, seed)


def assert_weights_close(a, b):
    for wa, wb in zip(a.get_weights(), b.get_weights()):
        assert models.relative_error(wa, wb) < RTOL


def assert_logs_close(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert models.relative_error(a[key], b[key]) < RTOL, key


def test_fit_with_partial_last_batch_validation_and_callbacks(tmp_path):
    """100 samples, batch 32, data=2: the last batch has 4 samples."""
    x, y = data()
    xv, yv = data(40, seed=1)
    histories, batch_logs = [], []
    for model in twins():
        losses = models.BatchLosses()
        history = model.fit(
            x, y, batch_size=32, epochs=3, shuffle=False, verbose=0,
            validation_data=(xv, yv), callbacks=[losses])
        histories.append(history.history)
        batch_logs.append(losses.losses)
    assert len(batch_logs[1]) == 3 * 4  # 4 batches per epoch, none dropped
    assert models.relative_error(batch_logs[0], batch_logs[1]) < RTOL
    assert_logs_close(histories[0], histories[1])


def test_partial_batch_not_divisible_by_data_axis_matches():
    """A last batch of 3 samples (data=2 does not divide it) is exact too."""
    x, y = data(35)
    single, parallel = twins()
    for model in (single, parallel):
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(single, parallel)


def test_evaluate_predict_and_on_batch_methods():
    x, y = data()
    single, parallel = twins()
    assert_logs_close(
        single.evaluate(x, y, batch_size=32, verbose=0, return_dict=True),
        parallel.evaluate(x, y, batch_size=32, verbose=0, return_dict=True))
    a = single.predict(x, batch_size=32, verbose=0)
    b = parallel.predict(x, batch_size=32, verbose=0)
    assert b.shape == (100, 3) and models.relative_error(a, b) < RTOL
    for _ in range(2):
        assert_logs_close(
            single.train_on_batch(x[:32], y[:32], return_dict=True),
            parallel.train_on_batch(x[:32], y[:32], return_dict=True))
    assert_logs_close(
        single.test_on_batch(x[:32], y[:32], return_dict=True),
        parallel.test_on_batch(x[:32], y[:32], return_dict=True))
    assert models.relative_error(single.predict_on_batch(x[:8]),
                                 parallel.predict_on_batch(x[:8])) < RTOL
    assert_weights_close(single, parallel)


@pytest.mark.parametrize("steps_per_execution", [
    pytest.param(3, marks=pytest.mark.slow), 4])  # 4: 6 batches, not a multiple
def test_steps_per_execution_and_tf_data(steps_per_execution):
    """k steps run per call; the epoch length need not be a multiple of k."""
    x, y = data(96)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    single, parallel = twins(steps_per_execution=steps_per_execution)
    results = []
    for model in (single, parallel):
        logs = models.BatchLosses()
        model.fit(dataset, epochs=2, verbose=0, callbacks=[logs])
        results.append(logs.losses)
    # Keras calls batch callbacks once per execution of k steps.
    assert len(results[1]) == len(results[0]) == 2 * -(-6 // steps_per_execution)
    assert models.relative_error(results[0], results[1]) < RTOL
    assert_weights_close(single, parallel)


def test_early_stopping_history_and_custom_callback():
    x, y = data()
    seen = []

    class Recorder(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append((epoch, round(logs["loss"], 4)))

    single, parallel = twins()
    histories = []
    for model in (single, parallel):
        seen.clear()
        stop = keras.callbacks.EarlyStopping(monitor="loss", patience=0,
                                             min_delta=10.0)
        history = model.fit(x, y, batch_size=20, epochs=5, verbose=0,
                            shuffle=False, callbacks=[stop, Recorder()])
        histories.append((history.history, list(seen)))
    (h0, seen0), (h1, seen1) = histories
    assert len(h1["loss"]) == len(h0["loss"]) < 5  # stopped early, alike
    assert [e for e, _ in seen1] == [e for e, _ in seen0]
    assert_logs_close(h0, h1)


def test_get_set_and_save_load_weights(tmp_path):
    x, y = data()
    single, parallel = twins()
    parallel.fit(x, y, batch_size=20, epochs=1, verbose=0)
    path = str(tmp_path / "p.weights.h5")
    parallel.save_weights(path)
    trained = parallel.get_weights()
    # Load the file into a single-device model: same values.
    single.load_weights(path)
    for a, b in zip(trained, single.get_weights()):
        np.testing.assert_array_equal(a, b)
    # Scramble, then load back into the sharded model.
    parallel.set_weights([np.zeros_like(w) for w in trained])
    assert all(not w.any() for w in parallel.get_weights())
    parallel.load_weights(path)
    for a, b in zip(trained, parallel.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert models.relative_error(single.predict(x, verbose=0),
                                 parallel.predict(x, verbose=0)) < RTOL


def test_summary_lists_layers_and_parameter_count():
    _, parallel = twins()
    lines = []
    parallel.summary(print_fn=lambda line, **kwargs: lines.append(line))
    text = "\n".join(lines)
    assert "up (Dense)" in text and "down (Dense)" in text
    assert "Total params: 1,123" in text  # 16*32+32 + 32*16+16 + 16*3+3


def test_eager_model_call_on_host_arrays():
    """model(x) eagerly: host input in, replicated output back."""
    x, _ = data(6)
    single, parallel = twins()
    for rows in (x, x[:5]):  # 5 rows: the data axis (2) does not divide it
        expected = single(rows).numpy()
        got = parallel(rows, training=False)
        assert models.relative_error(expected, got.numpy()) < RTOL


def test_eager_call_of_causal_attention_matches_one_device():
    """`model(x)` eagerly through `MultiHeadAttention(use_causal_mask=True)`
    on data=8: Keras' causal mask is a host tensor DTensor refused to mix
    with the logits (an UnimplementedError); it equals one device's."""
    def build():
        keras.utils.set_random_seed(0)
        x = keras.Input((6, 8))
        attention = keras.layers.MultiHeadAttention(2, 4)
        return keras.Model(x, attention(x, x, use_causal_mask=True))

    x = np.random.default_rng(0).normal(size=(16, 6, 8)).astype("float32")
    single = build()
    with tfpar.ParallelStrategy(tfpar.Mesh({"data": 8})).scope():
        parallel = build()
    parallel.set_weights(single.get_weights())
    got = parallel(x).numpy()
    assert models.relative_error(single(x).numpy(), got) < RTOL


def test_submodel_built_outside_the_scope_runs_on_the_mesh():
    """keras.Model(model.inputs, model.get_layer(...).output) made after the
    scope was left still predicts and evaluates on the mesh."""
    x, _ = data(20)
    single, parallel = twins()
    models_ = [keras.Model(m.inputs, m.get_layer("down").output)
               for m in (single, parallel)]
    expected, got = (m.predict(x, batch_size=4, verbose=0) for m in models_)
    assert models.relative_error(expected, got) < RTOL
    for m in models_:
        m.compile(loss="mse")
    target = np.zeros((20, 16), "float32")
    assert models.relative_error(
        models_[0].evaluate(x, target, batch_size=4, verbose=0),
        models_[1].evaluate(x, target, batch_size=4, verbose=0)) < RTOL


def test_generator_input_with_missing_sample_weights():
    """Keras turns a None in a generator batch into an Optional stand-in."""
    x, y = data(64)

    def batches():
        for i in range(0, 64, 16):
            yield x[i:i + 16], y[i:i + 16], None

    single, parallel = twins()
    for model in (single, parallel):
        model.fit(batches(), epochs=1, steps_per_epoch=4, verbose=0)
    assert_weights_close(single, parallel)


def test_run_eagerly_training_is_a_clear_error():
    x, y = data(32)
    with strategy().scope():
        model = mlp()
        model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    with pytest.raises(ValueError, match=r"run_eagerly=True\) cannot train"):
        model.fit(x, y, batch_size=16, verbose=0)


def test_strategy_run_eagerly_and_in_tf_function():
    """Custom loops: strategy.run on host arrays or placed batches."""
    loop = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}))
    with loop.scope():
        scale = tf.Variable(2.0)
    x = np.arange(16, dtype="float32").reshape(8, 2)

    def step(batch):
        return tf.reduce_sum(batch) * scale

    assert float(loop.run(step, args=(x,))) == 2 * x.sum()
    batches = loop.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(x).batch(4))
    traced = tf.function(lambda b: loop.run(step, args=(b,)))
    assert [float(traced(b)) for b in batches] == [2 * x[:4].sum(), 2 * x[4:].sum()]


def _teacher_and_student():
    """keras.distillation.Distiller of a 64-wide teacher into a 32-wide
    student (both the module's MLP shape), logits and hidden features."""
    def network(width, seed, name):
        keras.utils.set_random_seed(seed)
        inputs = keras.Input((16,))
        hidden = keras.layers.Dense(width, activation="gelu", name="up")(inputs)
        hidden = keras.layers.Dense(16, name="down")(hidden)
        return keras.Model(inputs, keras.layers.Dense(3, name="out")(hidden),
                           name=name)

    return keras.distillation.Distiller(
        teacher=network(64, 1, "teacher"), student=network(32, 2, "student"),
        distillation_losses=[
            keras.distillation.LogitsDistillation(temperature=2.0),
            keras.distillation.FeatureDistillation(
                loss="mse", teacher_layer_name="down",
                student_layer_name="down")])


@pytest.mark.filterwarnings("ignore:tfpar.auto_rules keeps")
def test_distiller_trains_the_student_as_one_device():
    """Keras' knowledge distillation with both models split by rules: the
    student trains as on one device (Adam, default), the frozen teacher is
    untouched, and each student kernel holds only its block."""
    x, y = data(64)
    y = (np.abs(y[:, 0]) * 3 % 3).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    single = _teacher_and_student()
    mesh = strategy().mesh
    with strategy().scope():
        parallel = _teacher_and_student()
        for model in (parallel.teacher, parallel.student):
            strategy().apply_rules(model, tfpar.auto_rules(model, mesh=mesh))
    teacher = [w.copy() for w in single.teacher.get_weights()]
    for model in (single, parallel):
        model.compile(optimizer="adam", loss=loss)
    logs = [model.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                      verbose=0).history for model in (single, parallel)]
    assert_logs_close(*logs)
    assert_weights_close(single.student, parallel.student)
    for before, after in zip(teacher, parallel.teacher.get_weights()):
        np.testing.assert_array_equal(before, after)
    up = parallel.student.get_layer("up").kernel
    models.assert_one_block_per_device(up, (None, "model"))


def test_class_weight_validation_split_and_weighted_metrics():
    """Keras turns `class_weight` into sample weights and holds out the
    last quarter for validation: logs and weights as one device's."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype("float32")
    y = rng.integers(0, 3, 64)
    pair = twins()
    runs = []
    for model in pair:
        model.compile(optimizer="adam", metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True), weighted_metrics=["accuracy"])
        runs.append(model.fit(
            x, y, batch_size=16, epochs=2, class_weight={0: 1, 1: 3, 2: 0.5},
            validation_split=0.25, shuffle=False, verbose=0).history)
    assert_logs_close(*runs)
    assert "val_weighted_accuracy" in runs[1]
    assert_weights_close(*pair)


@pytest.mark.slow
def test_a_keras_hub_task_with_its_preprocessor_trains_on_strings():
    """GPT2CausalLM with its tokenizer and preprocessor: `fit` on raw
    strings (tokenized in the input pipeline), then `generate` on a
    string, on data 2 × model 4 as on one device."""
    vocabulary = {"<|endoftext|>": 0, "a": 1, "b": 2, "c": 3, "Ġ": 4,
                  "Ġa": 5, "Ġb": 6, "ab": 7, "Ġc": 8}
    texts = ["a b c ab", "b a c", "ab ab a", "c c b a", "a", "b b b",
             "c a b", "ab c"] * 2
    mesh = tfpar.Mesh({"data": 2, "model": 4})
    strategy = tfpar.ParallelStrategy(mesh)
    runs = []
    for scope in (None, strategy):
        with scope.scope() if scope else contextlib.nullcontext():
            keras.utils.set_random_seed(1)
            tokenizer = keras_hub.models.GPT2Tokenizer(
                vocabulary=vocabulary, merges=["Ġ a", "Ġ b", "a b", "Ġ c"])
            lm = keras_hub.models.GPT2CausalLM(
                keras_hub.models.GPT2Backbone(
                    vocabulary_size=9, num_layers=1, num_heads=4,
                    hidden_dim=16, intermediate_dim=32,
                    max_sequence_length=8, dropout=0.0),
                preprocessor=keras_hub.models.GPT2CausalLMPreprocessor(
                    tokenizer, sequence_length=8))
            if scope:
                scope.apply_rules(lm, tfpar.auto_rules(lm, mesh=mesh))
            lm.compile(optimizer="sgd")
        history = lm.fit(texts, batch_size=8, epochs=2, shuffle=False,
                         verbose=0).history
        runs.append((history, lm, lm.generate(["a b"], max_length=8)))
    (one, single, text), (many, parallel, parallel_text) = runs
    assert_logs_close(one, many)
    assert text == parallel_text
    for a, b in zip(single.weights, parallel.weights):
        # softmax ignores the key bias: its gradient is rounding noise
        if not a.path.endswith("key/bias"):
            assert models.relative_error(a, b) < RTOL, a.path
    query = parallel.backbone.get_layer("transformer_layer_0")
    models.assert_one_block_per_device(
        query._self_attention_layer._query_dense.kernel, (None, "model", None))
