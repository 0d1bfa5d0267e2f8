"""Minimal reproduction: DTensor 2.21 cannot lay out TF's stateless gamma,
binomial and Poisson draws at all, not even with every value replicated.

`tf.random.stateless_gamma` (StatelessRandomGammaV3: Keras' TF
`random.gamma` and `random.beta`), `stateless_binomial`
(StatelessRandomBinomial: Keras' `random.binomial`) and `stateless_poisson`
in a `tf.function` on DTensor inputs fail compiling with "'tf.<op>' op does
not implement layout propagation", where `stateless_uniform` (Keras'
uniform, normal, dropout and shuffle draw with it and its kin) compiles.
So Keras' gamma, beta and binomial cannot run in a tfpar step (tfpar
refuses them with a ValueError when the step is traced,
`tfpar.spmd_patches._refused_draw_in_step`).

Run: python tests/dtensor_random_gamma_repro.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfpar  # noqa: E402


def main():
    tfpar.use_virtual_cpus(2)
    import tensorflow as tf  # noqa: PLC0415

    from tfpar import placement  # noqa: PLC0415

    mesh = tfpar.Mesh({"data": 2})
    seed = placement.put(tf.constant([1, 2]), (None,), mesh)
    draws = {
        "stateless_uniform": lambda s: tf.random.stateless_uniform([8], s),
        "stateless_gamma": lambda s: tf.random.stateless_gamma(
            [8], s, alpha=2.0),
        "stateless_binomial": lambda s: tf.random.stateless_binomial(
            [8], s, counts=3.0, probs=0.5),
        "stateless_poisson": lambda s: tf.random.stateless_poisson(
            [8], s, lam=2.0),
    }
    for name, draw in draws.items():
        try:
            placement.fetch(tf.function(draw)(seed))
            print(f"{name}: compiles")
        except tf.errors.OpError as error:
            reason = str(error).split("error: ")[-1].splitlines()[0]
            print(f"{name}: fails: {reason}")


if __name__ == "__main__":
    main()
