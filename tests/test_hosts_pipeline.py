"""Pipeline stages on different hosts: two processes on this machine, 4
virtual CPUs each, started by `python -m tfpar.launch` (the child,
tests/hosts_pipeline_child.py, calls nothing host-specific).

A `PipelineModel` of `models.host_mlp` whose pipe axis runs along the hosts
(one stage per host) trains with the host-driven step of
`tfpar.pipeline.cross_host` in parity with single-device Keras on the same
weights and data: per-batch losses, final weights, evaluate and predict
within 1e-4 relative (fp32); each host holds only its stage's weights and
optimizer slots; both hosts read back the same weights. An embedding and
Dropout on the other host's stage, integer labels and keras-hub
GPT-2 and Llama (a table read again by the output head on the other host:
a persistent copy there; slow) train in parity too. So do a pipeline on
each host (the data axis first) and, on four processes of 2 virtual CPUs,
stages over two hosts each. What stays refused across hosts is the same
clear error on both hosts.
"""

import ast
import itertools
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.dtensor.python import api as dtensor_api
from tensorflow.experimental import dtensor

import fuzzing
import hub_models
import models
import tfpar
from tfpar.pipeline import cross_host

TESTS = Path(__file__).resolve().parent
CHILD = TESTS / "hosts_pipeline_child.py"
RTOL = 1e-4
# One stage per host (with tensor parallelism inside), and two stages per
# host (moves inside a host and across) with a checkpoint; the rest slow.
DEFAULT = ["pipe2-data2-model2:gpipe:adam", "pipe4-data2:1f1b:adam:ckpt",
           # interleaved: 4 parts alternating between the hosts
           "pipe2-data4:1f1b:sgd:v2"]
# The data axis first: each stage on both hosts (CPU:0, 1 and CPU:4, 5 for
# stage 0), a replica of the pipeline on each host.
DATA_FIRST = "data2-pipe2-model2:gpipe:adam"
# The same with per-host input: each host feeds only its share (its data
# coordinate's rows) of every batch to fit, evaluate and predict.
PER_HOST = "data2-pipe2-model2:1f1b:adam:per_host"
# An embedding lookup on stage 0 (host 0): a sparse gradient, which
# crashed host 1 when it traced that stage's step; an L2 loss and Dropout
# there, whose value and seeds (small tensors) made one host alone compile a
# stage's step again.
TOKENS = "pipe2-data4:1f1b:sgd:tokens"
# Integer labels on the last stage of a mesh without a data axis.
LABELS = "pipe2-model4:1f1b:sgd:labels"
# A Keras mask crossing the hosts (the padding of a mask_zero Embedding on
# host 0, read by attention on host 1).
MASKED = "pipe2-data4:1f1b:sgd:masked"
SLOW = ["pipe2-data4:1f1b:sgd", "pipe2-data2-model2:1f1b:sgd",
        "pipe2-data4:gpipe:adam"]


def launch(workdir, cases, hosts=2, devices=8, timeout=900):
    """Runs the child on `hosts` hosts (`devices` virtual CPUs in all) for
    `cases`; asserts that every host finished."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DTENSOR_", "TFPAR_"))}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS), str(TESTS.parent), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-m", "tfpar.launch", "--hosts", str(hosts),
         "--virtual-cpus", str(devices // hosts), str(CHILD), str(workdir),
         *cases],
        capture_output=True, text=True, timeout=timeout, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    return output


def given(workdir):
    keras.utils.set_random_seed(0)
    weights = models.host_mlp().get_weights()
    deep = models.host_deep_mlp().get_weights()
    x, y = models.mlp_data(n=64)
    labels = np.random.RandomState(1).randint(0, 3, size=64).astype("int32")
    np.savez(workdir / "given.npz", x=x, y=y, labels=labels,
             **{f"w{i}": w for i, w in enumerate(weights)},
             **{f"d{i}": w for i, w in enumerate(deep)})


def plain_model(workdir, case):
    """The case's model on one device, with the given initial weights."""
    data = np.load(workdir / "given.npz")
    if case.startswith("pipe4") or case.endswith(":v2"):
        model = models.host_deep_mlp()
        model.set_weights([data[f"d{i}"] for i in range(10)])
    else:
        model = models.host_mlp()
        model.set_weights([data[f"w{i}"] for i in range(6)])
    return model, data


def one_device(workdir, case):
    """The single-device run the child's pipeline must match: (per-batch
    losses, weights, evaluate, predict, the next epoch's losses)."""
    model, data = plain_model(workdir, case)
    model.compile(optimizer=keras.optimizers.Adam(0.01)
                  if case.split(":")[2] == "adam" else keras.optimizers.SGD(),
                  loss="mse", metrics=["mae"])
    results = []
    for _ in range(2):
        losses = models.BatchLosses()
        model.fit(data["x"], data["y"], batch_size=16, epochs=1,
                  shuffle=False, verbose=0, callbacks=[losses])
        results.append(losses.losses)
        if len(results) == 1:
            results += [model.get_weights(), model.evaluate(
                data["x"], data["y"], batch_size=16, verbose=0),
                model.predict(data["x"], batch_size=16, verbose=0)]
    return results


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("hosts_pipeline")
    given(workdir)
    tokens_given(workdir)
    masked_given(workdir)
    launch(workdir, DEFAULT + [DATA_FIRST, PER_HOST, TOKENS, LABELS,
                               MASKED, "refusals"])
    return workdir


def tokens_data():
    rng = np.random.RandomState(0)
    return (rng.randint(0, 16, size=(32, 6)).astype("int32"),
            (rng.uniform(size=(32, 3)) > 0.5).astype("float32"))


def tokens_given(workdir):
    keras.utils.set_random_seed(0)
    x, y = tokens_data()
    np.savez(workdir / "tokens.npz", x=x, y=y, **{
        f"w{i}": w for i, w in enumerate(
            models.host_token_mlp().get_weights())})


def masked_given(workdir):
    keras.utils.set_random_seed(0)
    x, y = models.padded_tokens()
    np.savez(workdir / "masked.npz", x=x, y=y, **{
        f"w{i}": w for i, w in enumerate(
            models.masked_attention().get_weights())})


def test_a_keras_mask_crosses_the_hosts(default_run):
    check_masked(default_run, 2)


def check_masked(workdir, hosts):
    """The mask of host 0's mask_zero Embedding reaches host 1's attention
    (it was refused): per-batch losses and weights after one epoch of SGD
    as one device's (attention's key bias, whose true gradient is zero, to
    float32's own noise: `fuzzing.assert_parity` against float64), and
    predictions. Without the mask, attention would attend to padding."""
    given = np.load(workdir / "masked.npz")
    weights = [given[f"w{i}"] for i in range(len(given) - 2)]
    x, y = given["x"], given["y"]
    single = models.masked_attention()
    want = fuzzing.train(single, x, y, weights, models.BatchLosses(),
                         keras.optimizers.SGD(0.1))
    exact = fuzzing.train_in_float64(models.masked_attention, x, y, weights,
                                     keras.optimizers.SGD(0.1))
    predicted = single.predict(x, batch_size=16, verbose=0)
    for h in range(hosts):
        host = np.load(workdir / f"{MASKED}-host{h}.npz")
        got = [host[f"w{i}"] for i in range(len(weights))]
        fuzzing.assert_parity(want[0], host["losses"], want[1], got,
                              exact=exact)
        assert models.relative_error(predicted, host["predict"]) < RTOL


def tokens_on_one_device(workdir, accumulation):
    keras.utils.set_random_seed(1)  # as the child: the Dropout's seeds
    return models.fit_tokens(models.host_token_mlp(),
                             np.load(workdir / "tokens.npz"), accumulation)


def test_an_embedding_a_regularizer_and_dropout_on_the_other_hosts_stage(
        default_run):
    check_tokens(default_run, 2)


def check_tokens(workdir, hosts):
    """Stage 0 (host 0) looks up an embedding, adds an L2 loss and applies
    Dropout: host 1 traces that stage's step without reading the lookup's
    sparse gradient (reading it crashed host 1); the L2 loss is stage 0's
    objective and its value reaches the last stage's loss; each backward
    recomputes its forward with the seeds that forward drew; and an
    evaluate after training runs (it hung: the seeds and the carried loss,
    small tensors, made one host alone compile a stage's step again, which
    put the hosts' collectives out of step). Weights, each epoch's loss
    (SGD 0.1, two epochs of batch 16 in 2 micro-batches) and evaluate as
    Keras' gradient accumulation over 2 steps on one device (one Dropout
    mask per micro-batch, as a pipeline on one host draws:
    tests/test_pipeline_microbatch_layers.py); other masks (the whole
    batch's) would not match."""
    weights, evaluated, losses = tokens_on_one_device(workdir, 2)
    for h in range(hosts):
        host = np.load(workdir / f"{TOKENS}-host{h}.npz")
        for i, want in enumerate(weights):
            assert models.relative_error(want, host[f"w{i}"]) < RTOL
        assert models.relative_error(evaluated, host["evaluate"]) < RTOL
        assert models.relative_error(losses, host["losses"]) < RTOL
    whole, *_ = tokens_on_one_device(workdir, 1)
    assert max(models.relative_error(a, host[f"w{i}"])
               for i, a in enumerate(whole)) > 1e-3


def stage_ids(axes, index):
    """Global device ids of pipeline stage `index` of a mesh over every
    device in order with `axes` (as `tfpar.Mesh.submesh` picks them)."""
    grid = np.arange(int(np.prod(list(axes.values())))).reshape(
        tuple(axes.values()))
    return [int(i) for i in np.take(grid, index, axis=list(axes).index(
        "pipe")).ravel()]


def test_every_pipeline_layout_across_hosts_moves_each_block_to_its_device():
    """Every mesh of pipe × data × model (pipe ≥ 2, every order) over 2 or
    4 hosts of 1, 2 or 4 devices: each stage's sub-mesh is one `Mesh`
    accepts across hosts (so no such pipeline layout is refused by its
    shape), and a bridge move between any two stages
    (`cross_host.slot_plan`) gives each receiving device exactly the block
    of the sending device at its mesh position, no two blocks of a host in
    one slot. (With 3 devices per host a stage can hold 2 devices of one
    host and 1 of another: `Mesh` refuses that across hosts.)"""
    assert tfpar.mesh.cluster_mesh_kind([0, 2, 4], 3, 6) is None
    kinds = set()
    for hosts, per_host in itertools.product((2, 4), (1, 2, 4)):
        total = hosts * per_host
        for pipe, data in itertools.product(range(2, total + 1), repeat=2):
            if total % (pipe * data):
                continue
            sizes = {"pipe": pipe, "data": data, "model": total // (
                pipe * data)}
            for order in itertools.permutations(sizes):
                axes = {name: sizes[name] for name in order}
                assert tfpar.mesh.cluster_mesh_kind(
                    list(range(total)), per_host, total) == "whole"
                stages = [stage_ids(axes, k) for k in range(pipe)]
                for ids in stages:
                    kind = tfpar.mesh.cluster_mesh_kind(ids, per_host,
                                                        total)
                    assert kind is not None, (hosts, per_host, axes, ids)
                    kinds.add(kind)
                for source, target in itertools.product(stages, repeat=2):
                    plan = cross_host.slot_plan(source, target, per_host)
                    for sent_from, sent_to in zip(source, target):
                        assert plan[sent_from // per_host][
                            sent_to % per_host] == sent_from
    assert kinds == {"global", "spread"}


@pytest.mark.parametrize("dtype", ["int64", "int32", "float32"])
def test_dtensor_compiles_again_when_a_small_input_changes(dtype):
    """Why stage functions take small tensors as bits (`cross_host.
    SmallTensorsAsBits`): DTensor (TF 2.21) compiles a function again the
    first time the value of a small replicated int64 (a seed), int32 (a
    label) or float32 (a loss) input changes — on the host holding the
    stage, not on one passing a stand-in — but never for their bits; the
    function computes the same."""
    mesh = tfpar.Mesh({"data": 8}).dtensor_mesh
    whole = dtensor.Layout.replicated(mesh, 1)
    ones = dtensor.call_with_layout(tf.ones, whole, shape=[8])

    def misses():
        return dtensor_api._dtensor_device()._get_stats()[
            "function_manager.miss"]

    def counted(function, compiled):
        def call(*args, **kwargs):
            before = misses()
            result = function(*args, **kwargs)
            compiled.append(misses() - before)
            return result
        return call

    def scaled(x, small):
        return x * tf.cast(small[0], tf.float32)

    def scaled_from_bits(*args, encoded=()):
        return scaled(*cross_host.from_bits(encoded, args))

    seeds = [dtensor.copy_to_mesh(tf.constant([v, 7], dtype), whole)
             for v in range(3)]
    plain, as_bits = [], []
    function = counted(tf.function(scaled), plain)
    for seed in seeds:
        function(ones, seed)
    stage = cross_host.SmallTensorsAsBits(
        counted(tf.function(scaled_from_bits), as_bits))
    for seed in seeds:
        np.testing.assert_array_equal(stage(ones, seed), scaled(ones, seed))
    assert plain == [1, 1, 0]
    assert as_bits == [1, 0, 0]


def test_integer_labels_on_a_mesh_without_a_data_axis(default_run):
    check_labels(default_run, 2)


def check_labels(workdir, hosts):
    """Integer labels (batches of 8 per micro-batch: small) on the last
    stage, tensor-parallel on model=4 (collectives in its step): weights
    after one epoch and evaluates at batch 16 and at 8 (compiled after
    training: they hung when host 1 alone had compiled the last stage's
    backward twice) as one device's."""
    model, data = plain_model(workdir, LABELS)
    model.compile(optimizer=keras.optimizers.SGD(),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    model.fit(data["x"], data["labels"], batch_size=16, epochs=1,
              shuffle=False, verbose=0)
    evaluated = [model.evaluate(data["x"], data["labels"], batch_size=size,
                                verbose=0) for size in (16, 8)]
    for h in range(hosts):
        host = np.load(workdir / f"{LABELS}-host{h}.npz")
        for i, want in enumerate(model.get_weights()):
            assert models.relative_error(want, host[f"w{i}"]) < RTOL
        assert models.relative_error(evaluated, host["evaluate"]) < RTOL


def check_case(workdir, case, hosts=2):
    *reference, _ = one_device(workdir, case)
    losses, weights = reference[:2]
    results = [np.load(workdir / f"{case}-host{h}.npz")
               for h in range(hosts)]
    assert len(losses) == 4  # 64 samples, batch 16
    for result in results:
        models.assert_trained_like(reference, result, RTOL)
    # One program: every host reports the same losses and reads back the
    # same weights.
    for result in results[1:]:
        np.testing.assert_array_equal(results[0]["losses"],
                                      result["losses"])
        for i in range(len(weights)):
            np.testing.assert_array_equal(results[0][f"w{i}"],
                                          result[f"w{i}"])
    return results


@pytest.mark.parametrize("case", DEFAULT + [DATA_FIRST])
def test_stages_on_two_hosts_train_in_parity_with_one_device(default_run,
                                                             case):
    check_case(default_run, case)


def test_each_host_feeds_only_its_share_to_a_pipeline_on_each_host(
        default_run):
    """Per-host input (`PER_HOST`): host h feeds rows [8h, 8h+8) of each
    16-row batch to fit, evaluate and predict; the losses, weights and
    evaluate equal one device's on the whole batches, and predict returns
    the whole batches' predictions in order on both hosts. A host batch
    that does not split into 2 micro-batches is the same clear error on
    both hosts."""
    results = check_case(default_run, PER_HOST)
    check_held(default_run, PER_HOST, {"up0": 0, "down0": 1, "head": 1})
    uneven = [str(result["uneven"]) for result in results]
    assert uneven[0] == uneven[1].replace("host 1", "host 0")
    assert "each host's batch of a pipeline splits into num_microbatches " \
        "(2) micro-batches of its 1 block(s) of the data axis, so it must " \
        "divide by 2. Received: a batch of 3 rows on host 0" in uneven[0]


def check_held(workdir, case, stage_of):
    """Each weight and slot of stage s (`stage_of` a layer name) of `case`
    (its hosts' results in `workdir`) has blocks on stage s's devices
    only: on each host, those of its own devices (8 devices over the
    hosts, in order), none on the other hosts."""
    shape = models.mesh_shape(case)
    grid = np.arange(8).reshape(tuple(shape.values()))
    held = [ast.literal_eval(str(np.load(workdir / f"{case}-host{h}.npz")[
        "held"])) for h in range(len(list(workdir.glob(f"{case}-host*"))))]
    per_host = 8 // len(held)
    slots = [p for p in held[0] if p.startswith("adam")]  # adam_1/...
    assert len(slots) == 2 * len(held[0]) // 3  # momentum, velocity each
    for path in held[0]:
        stage = next(s for name, s in stage_of.items() if name in path)
        devices = np.take(grid, stage, axis=list(shape).index("pipe"))
        for h, on_host in enumerate(held):
            assert on_host[path] == sorted(
                int(d) for d in devices.ravel() if d // per_host == h), (
                    h, path)


def test_each_host_holds_only_its_stages_weights_and_slots(default_run):
    """Stage 0 (up0) on host 0's devices 0..3, stage 1 (down0, head) on
    host 1's 4..7 (split_report's cut); pipe=4: two stages per host. The
    other host holds no block of them, Adam's slots likewise."""
    check_held(default_run, DEFAULT[0], {"up0": 0, "down0": 1, "head": 1})
    check_held(default_run, DEFAULT[1],
               {"up0": 0, "down0": 1, "up1": 2, "down1": 3, "head": 3})
    check_held(default_run, DATA_FIRST, {"up0": 0, "down0": 1, "head": 1})


def test_what_stays_refused_is_the_same_clear_error_on_both_hosts(
        default_run):
    hosts = [np.load(default_run / f"refusals-host{h}.npz") for h in (0, 1)]
    for key in ("zero_bubble", "tied_per_step", "per_host", "timeline",
                "reordered"):
        assert str(hosts[0][key]) == str(hosts[1][key])
    assert "does not support schedule='zb-h1'" in str(hosts[0]["zero_bubble"])
    assert "Use schedule='gpipe' or '1f1b'" in str(hosts[0]["zero_bubble"])
    assert "does not support tied_weights='per_step'" in str(
        hosts[0]["tied_per_step"])
    assert "Use tied_weights='persistent' (the default)" in str(
        hosts[0]["tied_per_step"])
    assert "Received: record_timeline=True" in str(hosts[0]["timeline"])
    # Per-host input: the pipe axis along the hosts gives each host every
    # data coordinate (the strategy refuses it, naming host 1 on both).
    assert "per_host_input=True needs each host to hold its own range" in \
        str(hosts[0]["per_host"])
    assert "host 1 holding data coordinates [0, 1, 2, 3]" in str(
        hosts[0]["per_host"])
    message = str(hosts[0]["reordered"])
    assert "list the devices in increasing order" in message
    assert "devices=[CPU:7, CPU:6, CPU:5, CPU:4])" in message  # stage 0


def test_two_stages_per_host_and_their_checkpoint(default_run):
    """pipe=4 × data=2: stages 0, 1 on host 0 and 2, 3 on host 1 (moves
    inside a host and across). The sharded checkpoint (each host wrote its
    stages' blocks) restores into a fresh pipeline of the same layout
    (predictions equal), which then trains on exactly as the original does
    and as one device's second epoch does; and restores into plain Keras
    on one device here."""
    case = DEFAULT[1]
    files = check_checkpoint(default_run, case, 2)
    # up0 on stage 0 (devices 0, 1: replicated, device 0 writes), up1 on
    # stage 2 (host 1's devices 4, 5: device 4 writes).
    assert [f for f in files if "_up0_kernel.b" in f] == [
        "v0000_deep_mlp_up0_kernel.b0.npy"]
    assert [f for f in files if "_up1_kernel.b" in f] == [
        "v0004_deep_mlp_up1_kernel.b4.npy"]


def check_checkpoint(workdir, case, hosts):
    """Case `case` (":ckpt") trained in parity on `hosts` hosts; its
    sharded checkpoint (each host wrote its stages' blocks) restores into
    a fresh pipeline of the same layout (predictions equal), which then
    trains on exactly as the original does and as one device's second
    epoch does; and restores into plain Keras on one device here. Returns
    the checkpoint's file names."""
    *_, predicted, second_epoch = one_device(workdir, case)
    for host in check_case(workdir, case, hosts):
        assert int(host["restored_step"]) == 4
        assert models.relative_error(predicted,
                                     host["restored_predict"]) < RTOL
        assert models.relative_error(second_epoch,
                                     host["continued_losses"]) < RTOL
        assert models.relative_error(second_epoch,
                                     host["resumed_losses"]) < RTOL
    directory = workdir / f"{case.replace(':', '_')}-ckpt"
    plain, data = plain_model(workdir, case)
    tfpar.restore_checkpoint(plain, directory, optimizer=False)
    assert models.relative_error(predicted, plain.predict(
        data["x"], batch_size=16, verbose=0)) < RTOL
    return sorted(p.name for p in (directory / "ckpt-4").iterdir())


# Stages over several hosts (4 hosts × 2 devices, the pipe axis first):
# stage 0 on hosts 0 and 1, stage 1 on hosts 2 and 3, as Megatron-LM lays
# out a pipeline with more hosts than stages (here data, or model, across
# a stage's hosts). Moves go from two hosts to two others.
SPANNING = ["pipe2-data2-model2:1f1b:adam:ckpt", TOKENS,
            # the data axis first: stage 0 on hosts 0 and 2, stage 1 on
            # hosts 1 and 3 (a pipeline over each pair of hosts)
            DATA_FIRST]
# Per-host input to a whole pipeline on each of 4 hosts (its 2 devices).
PER_HOST_4 = "data4-pipe2:gpipe:sgd:per_host"
SPANNING_SLOW = ["pipe2-data4:1f1b:sgd:v2", LABELS, MASKED, PER_HOST_4]


@pytest.fixture(scope="module")
def spanning_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("hosts_pipeline_spanning")
    given(workdir)
    tokens_given(workdir)
    launch(workdir, SPANNING, hosts=4)
    return workdir


def test_stages_over_two_hosts_each_train_and_checkpoint(spanning_run):
    """pipe=2 × data=2 × model=2 on 4 hosts: stage s on hosts 2s and 2s+1
    (data across them, model inside each). Losses, weights, evaluate and
    predict as one device's, every host reading back the same; each host
    holds only its own devices' blocks of its stage's weights and Adam
    slots; the sharded checkpoint restores and trains on exactly."""
    case = SPANNING[0]
    files = check_checkpoint(spanning_run, case, 4)
    check_held(spanning_run, case, {"up0": 0, "down0": 1, "head": 1})
    # down0's kernel (row-parallel over model) is written by its first
    # replica (data 0): devices 4 and 5, both on host 2.
    assert [f for f in files if "down0_kernel.b" in f] == [
        "v0002_mlp_down0_kernel.b4.npy",
        "v0002_mlp_down0_kernel.b5.npy"]


def test_stages_over_two_hosts_that_are_not_neighbours(spanning_run):
    """`DATA_FIRST` on 4 hosts × 2: each stage on two hosts that are not
    neighbours (stage 0 on hosts 0 and 2), in parity with one device,
    each host holding only its own devices' blocks."""
    check_case(spanning_run, DATA_FIRST, 4)
    check_held(spanning_run, DATA_FIRST, {"up0": 0, "down0": 1, "head": 1})


def test_dropout_and_a_regularizer_on_a_stage_over_two_hosts(spanning_run):
    """`TOKENS` on 4 hosts (its data axis across each stage's two hosts):
    as on two hosts, Keras' gradient accumulation on one device."""
    check_tokens(spanning_run, 4)


@pytest.mark.slow
def test_more_stages_over_two_hosts_each(tmp_path):
    """Interleaved stages, integer labels on model=4 across two hosts (its
    collectives span them) and a Keras mask, on 4 hosts; and per-host
    input to a pipeline on each host."""
    given(tmp_path)
    masked_given(tmp_path)
    launch(tmp_path, SPANNING_SLOW, hosts=4)
    check_case(tmp_path, SPANNING_SLOW[0], 4)
    check_case(tmp_path, PER_HOST_4, 4)
    check_labels(tmp_path, 4)
    check_masked(tmp_path, 4)


@pytest.mark.slow
def test_offload_of_stages_over_two_hosts_each(tmp_path):
    """`offload="optimizer"` with pipe=2 × data=4 on CPU:0, 1 of each of 4
    hosts (4 CPUs each; stage s on hosts 2s and 2s+1), the optimizer's
    state on CPU:2, 3 of each: in parity with one device; each host holds
    its stage's weights on its CPU:0, 1 and their Adam slots on its
    CPU:2, 3."""
    case = "pipe2-data4:1f1b:adam:offload"
    given(tmp_path)
    launch(tmp_path, [case], hosts=4, devices=16)
    check_case(tmp_path, case, 4)
    for h in range(4):
        held = ast.literal_eval(str(np.load(tmp_path / f"{case}-host{h}.npz")
                                    ["held"]))
        for path, devices in held.items():
            stage = 0 if "up0" in path else 1
            mine = [4 * h + (2 if path.startswith("adam") else 0) + k
                    for k in (0, 1)]
            assert devices == (mine if stage == h // 2 else []), (h, path)


@pytest.mark.slow
def test_other_schedules_and_optimizers_in_parity(tmp_path):
    given(tmp_path)
    launch(tmp_path, SLOW)
    for case in SLOW:
        check_case(tmp_path, case)


# keras-hub causal LMs across the hosts: the token embedding (stage 0, host
# 0) is read again by the output head (stage 1, host 1), held there as a
# persistent copy whose gradient sum crosses the hosts once per step (GPT-2:
# the tied table; Llama: its ReversibleEmbedding's two tables); its lookup's
# sparse gradient stays on host 0.
HUB_AXES = "pipe2-data2-model2:1f1b:adam"
# A key bias's true gradient is zero (softmax ignores a shift): both runs
# hold rounding noise there, amplified by Adam (tests/test_pipeline_nested).
ZERO_GRADIENT = "/key/bias"


CONTEXT_AXES = "pipe2-data2-context2:1f1b:adam"


@pytest.mark.parametrize("name,hosts,axes", [
    pytest.param("gpt2", 2, HUB_AXES, marks=pytest.mark.slow),
    pytest.param("llama_gqa", 2, HUB_AXES, marks=pytest.mark.slow),
    pytest.param("gpt2", 4, HUB_AXES, marks=pytest.mark.slow),
    ("gpt2", 2, CONTEXT_AXES)])
def test_a_keras_hub_lm_with_tied_weights_trains_across_two_hosts(
        tmp_path, name, hosts, axes):
    """A keras-hub causal LM pipelined on pipe 2 (one stage per host; on 4
    hosts one stage per two) × data 2 × model 2 (or × context 2: its
    sequences split over the context axis) with auto_rules: per-batch
    losses and weights as one device's (Adam 1e-3, 2 steps of batch 8),
    each copy on the last stage equal bit for bit to its weight on the
    first after training. Every activation and gradient the stages send
    each other is laid out as the strategy lays out a step's: its batch
    over data, its sequence over context (`microbatch_spec`)."""
    keras.utils.set_random_seed(0)
    model = hub_models.build(name)
    weights = model.get_weights()
    x, y = hub_models.data(name, batch=16)
    np.savez(tmp_path / f"hub-{name}.npz", x=x["token_ids"], y=y,
             **{f"w{i}": w for i, w in enumerate(weights)})
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=hub_models.loss(name))
    losses = models.BatchLosses()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[losses])
    # the loss (keras-hub's compile adds an accuracy the pipeline's lacks)
    evaluated = model.evaluate(x, y, batch_size=8, verbose=0)[0]
    case = f"{axes}:hub-{name}"
    launch(tmp_path, [case], hosts=hosts)
    sequence = "'context'" if "context" in axes else "None"
    paths = [w.path for w in model.weights]
    table = model.get_layer("token_embedding")
    for host in [np.load(tmp_path / f"{case}-host{h}.npz")
                 for h in range(hosts)]:
        assert len(host["losses"]) == 2
        assert models.relative_error(losses.losses, host["losses"]) < RTOL
        assert models.relative_error(evaluated, host["evaluate"]) < RTOL
        for i, (path, want) in enumerate(zip(paths, model.get_weights())):
            got = host[f"w{i}"]
            if path.endswith(ZERO_GRADIENT):
                assert np.abs(want - got).max() < RTOL, path
            else:
                assert models.relative_error(want, got) < RTOL, path
        assert [str(p) for p in host["copies"]] == [
            "tied_copy_on_part_1/" + w.path.replace("/", "_")
            for w in table.weights]
        for i in range(len(table.weights)):
            np.testing.assert_array_equal(host[f"copy{i}"],
                                          host[f"copy{i}_weight"])
        sent = [m for m in map(str, host["moved"])
                if m.startswith(f"[4, {x['token_ids'].shape[1]}, ")]
        assert sent and all(m.endswith(f"['data', {sequence}, None]")
                            for m in sent), host["moved"]


@pytest.mark.slow
def test_keras_hub_gpt2_with_dropout_trains_across_two_hosts(tmp_path):
    """keras-hub GPT-2 with its Dropout (0.1; every block's attention,
    residual and embedding dropout on both hosts' stages) pipelined as
    above: weights and evaluate as Keras' gradient accumulation over the
    2 micro-batches on one device, Keras seeded alike (Adam 1e-3, 2 steps
    of batch 8)."""
    name = "gpt2_dropout"
    weights = hub_models.build(name).get_weights()
    x, y = hub_models.data(name, batch=16)
    np.savez(tmp_path / f"hub-{name}.npz", x=x["token_ids"], y=y,
             **{f"w{i}": w for i, w in enumerate(weights)})

    def one_device(accumulation):
        keras.utils.set_random_seed(1)  # as the child
        model = hub_models.RANDOM_BUILDERS[name]()
        model.set_weights(weights)
        model.compile(optimizer=keras.optimizers.Adam(
            1e-3, gradient_accumulation_steps=accumulation or None),
            loss=hub_models.loss(name))
        model.fit(x, y, batch_size=8 // max(accumulation, 1), epochs=1,
                  shuffle=False, verbose=0)
        return model

    whole = one_device(0).get_weights()  # one mask per batch of 8
    model = one_device(2)
    # the loss (keras-hub's compile adds an accuracy the pipeline's lacks)
    evaluated = model.evaluate(x, y, batch_size=8, verbose=0)[0]
    case = f"{HUB_AXES}:hub-{name}"
    launch(tmp_path, [case])
    for h in (0, 1):
        host = np.load(tmp_path / f"{case}-host{h}.npz")
        assert models.relative_error(evaluated, host["evaluate"]) < RTOL
        for i, (variable, want) in enumerate(zip(model.weights,
                                                 model.get_weights())):
            got = host[f"w{i}"]
            if variable.path.endswith(ZERO_GRADIENT):
                assert np.abs(want - got).max() < RTOL, variable.path
            else:
                assert models.relative_error(want, got) < RTOL, \
                    variable.path
    assert max(models.relative_error(a, host[f"w{i}"])
               for i, a in enumerate(whole)) > 1e-3  # masks matter
