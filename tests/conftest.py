"""Every test runs on 8 virtual CPU devices, configured before TF starts."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import tfpar  # noqa: E402

tfpar.use_virtual_cpus(8)


import keras  # noqa: E402
import pytest  # noqa: E402
from keras.src.utils import naming  # noqa: E402

import process_state  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def same_random_state_for_each_module():
    """Module-scoped fixtures (set up before the per-test seed below) start
    from random seed 0 too, and every test file starts Keras' layer-name
    counters afresh: an unnamed layer gets the name it gets when its file
    runs alone. A test asserting auto names failed in CI only, where
    another file in its pytest-xdist worker had made dense layers first."""
    keras.utils.set_random_seed(0)
    naming.reset_uids()


@pytest.fixture(autouse=True)
def same_random_state_whatever_ran_before():
    """Every test starts from Keras' (and numpy's, Python's, TF's) random
    seed 0, so an unseeded build gets the same initial weights whichever
    test files ran before it in its pytest-xdist worker (`--dist loadfile`
    groups files differently from run to run). Found by issue 17's hunt for
    intermittent failures: an unseeded loss-scaling test skipped 3 steps
    instead of 2 for 8 of 68 initial weights, so it failed now and then in
    the full suite and never alone."""
    keras.utils.set_random_seed(0)


@pytest.fixture(autouse=True, scope="module")
def module_leaves_process_state_as_found(request):
    """A test file must leave the process as it found it (Keras config and
    scopes, TF flags, tfpar's hooks, environment): the files after it in
    its pytest-xdist worker vary from run to run, so a leak there is a
    failure elsewhere that passes alone. Fails the file's last test."""
    before = process_state.snapshot()
    yield
    changed = process_state.changes(before, process_state.snapshot())
    assert not changed, (
        f"{request.module.__name__} left process-wide state changed for "
        f"the test files after it: {changed}")


@pytest.fixture
def float64():
    """floatx and the global dtype policy float64 (the policy, once read,
    no longer follows floatx), restored after the test."""
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    yield
    keras.config.set_floatx(floatx)
    keras.config.set_dtype_policy(policy)
