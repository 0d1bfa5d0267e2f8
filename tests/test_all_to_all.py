"""`tfpar.collectives.all_to_all` and `split_along`: values, gradients and
the bytes of the compiled step.

On Mesh({"data": 2, "expert": 4}) a (4, 8, 8, 3) tensor is cut to each
device's block along dimension 1 (`split_along`: a slice), its split moved
to dimension 2 (`all_to_all`), multiplied by a weight and summed. The
moved tensor must equal the input and the gradient the weight, exactly
(a relayout only moves data). The compiled step must hold one collective
over `expert` per move (forward and its reverse in the backward pass),
each of the block with the concatenated dimension whole: 2 x 8 x 2 x 3
float32 values after the data split — n = 4 times the block a true
all-to-all sends (see the primitive's docstring).
"""

import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tfpar import collectives, placement
from tfpar.reports import program as program_lib

SHAPE = (4, 8, 8, 3)


@pytest.fixture(scope="module")
def strategy():
    return tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "expert": 4}))


def moved_and_gradient(strategy, x, w, concat_dim=1, split_dim=2):
    def step(x, w):
        with tf.GradientTape() as tape:
            tape.watch(x)
            local = collectives.split_along(x, concat_dim, "expert", "data")
            moved = collectives.all_to_all(local, split_dim=split_dim,
                                           concat_dim=concat_dim,
                                           mesh_axis="expert",
                                           batch_axis="data")
            loss = tf.reduce_sum(moved * w)
        whole = strategy.extended.replicate(moved)
        return whole, strategy.extended.replicate(tape.gradient(loss, x))

    traced = tf.function(lambda x, w: strategy.run(step, args=(x, w)))
    spec = ("data",) + (None,) * (x.ndim - 1)
    x, w = (placement.put(v, spec, strategy.mesh) for v in (x, w))
    moved, grad = traced(x, w)
    return traced, (x, w), placement.fetch(moved), placement.fetch(grad)


def test_all_to_all_moves_values_and_gradients_and_its_bytes(strategy):
    rng = np.random.RandomState(0)
    x = rng.normal(size=SHAPE).astype("float32")
    w = rng.normal(size=SHAPE).astype("float32")
    traced, placed, moved, grad = moved_and_gradient(strategy, x, w)
    np.testing.assert_array_equal(moved, x)
    np.testing.assert_array_equal(grad, w)
    name = traced.get_concrete_function(*placed).name
    name = name.decode() if isinstance(name, bytes) else name
    program = program_lib.program_for_traced(name)
    over_expert = [c for c in program.collectives(program.backward_nodes())
                   if c.axes == ("expert",)]
    # Forward: all_to_all's gather (split_along is a slice). Backward: the
    # reverse all_to_all's gather; its slice and split_along's gather back
    # to whole cancel (DTensor folds the chain of relayouts).
    block = 2 * 8 * 2 * 3 * 4  # (batch/data, 8, 8/expert, 3) float32
    assert [(c.purpose, c.group_size, c.bytes) for c in over_expert] == [
        ("all-gather", 4, 4 * block)] * 2, over_expert
    # Nothing else moves but the test's own gathers of its two results
    # (the gradient first gathered over data: its layout is [data, ...]).
    assert [c.axes for c in program.collectives(set())
            if c.axes != ("expert",)] == [("data",), ("data", "expert")]


@pytest.mark.slow  # 10 compiled steps, ~6 s
@pytest.mark.parametrize("shape, concat_dim, split_dim", [
    ((8, 12), 0, 1), ((8, 12), 1, 0),
    ((4, 8, 12), 1, 2), ((4, 8, 12), 2, 1), ((4, 8, 12), 0, 2),
    ((4, 8, 4, 12), 1, 3), ((4, 8, 4, 12), 3, 2),
    ((4, 4, 8, 4, 8), 1, 4), ((4, 4, 8, 4, 8), 4, 2), ((4, 4, 8, 4, 8), 2, 3),
])
def test_all_to_all_is_exact_for_every_rank_and_pair(strategy, shape,
                                                     concat_dim, split_dim):
    """Ranks 2-5, moves with and without dimension 0 (the ones DTensor's
    all-to-all gets wrong on ranks 4 and 5 among them: see
    tests/dtensor_all_to_all_ranks_repro.py): the moved tensor equals the
    input and the gradient the weight, exactly, on random data."""
    rng = np.random.RandomState(len(shape))
    x = rng.normal(size=shape).astype("float32")
    w = rng.normal(size=shape).astype("float32")
    _, _, moved, grad = moved_and_gradient(strategy, x, w, concat_dim,
                                           split_dim)
    np.testing.assert_array_equal(moved, x)
    np.testing.assert_array_equal(grad, w)


def test_all_to_all_refuses_a_dimension_the_axis_does_not_divide(strategy):
    def step(x):
        return collectives.all_to_all(x, split_dim=2, concat_dim=1,
                                      mesh_axis="expert", batch_axis="data")

    x = placement.put(np.zeros((4, 8, 6, 3), "float32"),
                      ("data", None, None, None), strategy.mesh)
    with pytest.raises(ValueError, match=r"split_dim=2 .*does not divide"):
        tf.function(lambda x: strategy.run(step, args=(x,)))(x)


def test_outside_a_step_nothing_moves():
    x = tf.ones((2, 4))
    assert collectives.all_to_all(x, 1, 0, "expert") is x
    assert collectives.split_along(x, 1, "expert") is x
