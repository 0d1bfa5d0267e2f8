"""A step DTensor cannot compile fails at once with tfpar's explained
error, however large the step.

Found 2026-12-06: Keras' RandomElasticTransform on data=8 seemed to hang
(no end after ten minutes). Its step had failed to compile in seconds;
DTensor's error carries the whole step's program (a million characters),
and TF's `error_interpolation.parse_message` reads its "{{node ...}}" tags
with a pattern that costs the square of the text after the last tag.
`tfpar.compile_errors` patches it to read up to the last tag (the same
result); the step now fails in seconds naming the op.
"""

import subprocess
import sys
import textwrap

import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import tfpar
from tfpar import _compat
from tfpar import compile_errors

PIECES = ["{{node Foo}}", "{{function_node a/b-c_1}}", "{{node x.y}}", "{{",
          "}}", "{{not a tag}}", "{{node }}", " ", "node", "x", "\n", "{", "}"]


def _tf_parse_message():
    module = _compat.tf_python_module("framework.error_interpolation")
    return getattr(module.parse_message, "__wrapped__", module.parse_message)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=40))
def test_error_tags_are_read_as_tf_reads_them(pieces):
    """Tags, tag-like text and text after the last tag: TF's result."""
    message = "".join(pieces)
    original = _tf_parse_message()
    patched = compile_errors._error_tags_read_to_the_last(original, None)
    assert patched(message) == original(message)


def test_tf_reads_only_up_to_the_last_tag_once_a_strategy_exists():
    """With the strategy's patches installed, TF's own `parse_message`
    hands its pattern only the text up to the last tag: none of a million
    characters of DTensor program without a tag (TF's pattern alone took
    hours on it), and the text up to "{{node B}}" of a tagged one."""
    tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}))  # installs the patches
    module = _compat.tf_python_module("framework.error_interpolation")
    assert module.parse_message.__wrapped__ is _tf_parse_message()
    read = []

    def tf_pattern(text):
        read.append(text)
        return _tf_parse_message()(text)

    parse = compile_errors._error_tags_read_to_the_last(tf_pattern, None)
    program = '"func.func"() ({ %1 = "tf.Reshape" }} {{ x' * 25_000
    assert parse(program) == (program, [], [])
    tagged = "a {{node A}} b {{function_node B}}" + program
    assert parse(tagged) == ("a {{node A}} b " + program, [
        ("function_node", "B")], [("node", "A")])
    assert read == ["", "a {{node A}} b {{function_node B}}"]


CHILD = textwrap.dedent("""
    import numpy as np, keras, tfpar
    tfpar.use_virtual_cpus(8)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}))
    with strategy.scope():
        x = keras.Input((8, 8, 3))
        h = keras.layers.RandomElasticTransform(seed=1, value_range=(-3, 3))(x)
        model = keras.Model(x, keras.layers.Dense(3)(
            keras.layers.Flatten()(h)))
        model.compile("sgd", "mse")
    try:
        model.fit(np.ones((16, 8, 8, 3)), np.ones((16, 3)), batch_size=16,
                  verbose=0)
    except ValueError as error:
        print("ERROR", str(error).splitlines()[0])
""")


@pytest.mark.slow  # a child process importing TF, and the compile: ~15 s
def test_a_step_that_does_not_compile_fails_at_once_naming_the_op():
    """RandomElasticTransform's step on data=8 (DTensor: a Reshape of a
    shape unknown when traced) raises tfpar's explained error within
    minutes; before, reading DTensor's error did not end in ten."""
    result = subprocess.run([sys.executable, "-c", CHILD],
                            capture_output=True, text=True, timeout=300)
    assert "ERROR DTensor could not compile the train step" in result.stdout \
        and "tf.Reshape" in result.stdout, result.stdout + result.stderr[-2000:]
