"""Trains, evaluates and predicts with verbose=1 (tests/test_quiet_logs.py
reads what it prints): `python quiet_logs_child.py MODELS` trains MODELS
models (each traces its own steps: before tfpar's fix, two models made TF
warn about retracing), with inference batch sizes the data axis does not
divide, then prints the user's own warnings."""

import logging
import sys
import warnings

import tfpar

tfpar.use_virtual_cpus(8)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

strategy = tfpar.ParallelStrategy(
    tfpar.Mesh({"data": 2, "model": 4}),
    rules={r".*up/kernel": (None, "model"), r".*up/bias": ("model",),
           r".*down/kernel": ("model", None)})
x = np.random.RandomState(0).rand(40, 16).astype("float32")
y = x[:, :4]
for _ in range(int(sys.argv[1])):
    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)),
                                  keras.layers.Dense(32, name="up"),
                                  keras.layers.Dense(4, name="down")])
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    model.fit(x, y, batch_size=8, epochs=1, verbose=1, validation_split=0.2)
    for n in (1, 7, 33):
        model.predict(x[:n], verbose=1)
        model.evaluate(x[:n], y[:n], verbose=1)
warnings.warn("the user's own warning")
tf.get_logger().warning("the user's own TF log warning")
logging.getLogger("user").error("the user's own error")
print("DONE")
