"""tfpar runs without keras-hub (an optional package: the `test` extra).

The strategy's patch groups include keras-hub's layers (context
parallelism's decoders, the MoE blocks, the position table's broadcast);
each owner is looked up with `tfpar._compat.optional_owner`, which gives
`_compat.Absent` when keras-hub is missing. A fresh Python in which
`import keras_hub` fails makes a `ParallelStrategy` on data=2 × model=2 of
virtual CPUs and trains a Keras MLP in parity with one device; before,
making the strategy raised `ModuleNotFoundError: keras_hub.src`.
"""

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import sys
    sys.modules["keras_hub"] = None  # `import keras_hub` raises ImportError
    import tfpar
    tfpar.use_virtual_cpus(4)
    import keras, numpy as np

    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((8,)),
                                 keras.layers.Dense(16, name="up"),
                                 keras.layers.Dense(4, name="down")])

    x = np.random.RandomState(0).normal(size=(16, 8)).astype("float32")
    y = np.random.RandomState(1).normal(size=(16, 4)).astype("float32")
    reference = build()
    reference.compile(optimizer="sgd", loss="mse")
    expected = reference.fit(x, y, batch_size=8, verbose=0).history["loss"]
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 2}),
                                      rules={r".*up/kernel": (None, "model")})
    with strategy.scope():
        model = build()
        model.compile(optimizer="sgd", loss="mse")
    got = model.fit(x, y, batch_size=8, verbose=0).history["loss"]
    assert "keras_hub.src" not in sys.modules
    assert np.allclose(got, expected, rtol=1e-4), (got, expected)
    print("OK", got, expected)
""")


def test_a_strategy_trains_without_keras_hub():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True,
        timeout=600, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2"))
    assert result.returncode == 0 and "OK" in result.stdout, (
        result.stdout[-2000:] + result.stderr[-4000:])
