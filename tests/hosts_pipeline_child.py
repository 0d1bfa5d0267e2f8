"""One host of a pipeline across hosts (run by tests/test_hosts_pipeline.py).

    python -m tfpar.launch --hosts 2 --virtual-cpus 4 \
        hosts_pipeline_child.py WORKDIR CASE...

(or 4 hosts of 2 virtual CPUs; 4 of 4 for ":offload"). Each CASE is
"AXES:SCHEDULE:OPTIMIZER[:ckpt|:v2|:offload|:per_host]" (":v2": 2
virtual stages per stage, `host_deep_mlp`; ":offload": the mesh on the
first half of each host's devices, `offload="optimizer"` to the other
half; ":per_host": `per_host_input=True`, host h feeding rows [8h, 8h+8)
of each 16-row global batch, in 8-row batches, to fit, evaluate and
predict; it also writes the error of a 3-row evaluate batch) (or
"AXES:SCHEDULE:adam:hub-NAME", a keras-hub causal LM: `run_hub`, or
"AXES:SCHEDULE:sgd:tokens": `run_tokens`, "AXES:SCHEDULE:sgd:labels":
`run_labels`, or "AXES:SCHEDULE:sgd:masked": `run_masked`), e.g.
"pipe2-data2-model2:gpipe:adam" (the mesh's axes, in order; a
`tfpar.PipelineModel` schedule; "adam" = Adam(0.01), "sgd" = plain SGD,
Keras' defaults). For each case the script (nothing host-specific:
`tfpar.connect_hosts()` reads the launcher's environment) trains
`models.host_mlp` (pipe=2; `host_deep_mlp` for pipe=4, weights "d<i>";
Megatron rules on "model") as a
PipelineModel with 2 micro-batches from WORKDIR/given.npz, batch 16, one
epoch in order, and writes to WORKDIR/CASE-host<I>.npz: per-batch losses,
final weights (`get_weights`), evaluate and predict results, and, per
weight and optimizer slot, the global ids of the devices this host holds
blocks of. With ":ckpt" it then saves a sharded checkpoint, restores it
into a fresh pipeline and trains both one more epoch (`checkpoint`). CASE
"refusals" writes WORKDIR/refusals-host<I>.npz: the errors
of what stays refused across hosts.
"""

import contextlib
import sys

import tfpar

tfpar.connect_hosts(timeout=120)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

import fuzzing  # noqa: E402
import hub_models  # noqa: E402
import models  # noqa: E402


def local_ids(variable):
    """Global ids of this host's devices holding blocks of `variable`."""
    mesh = dtensor.fetch_layout(variable.value).mesh
    return [tfpar.mesh.device_index(name)
            for name in tfpar.mesh.local_device_names(mesh)]


def devices(case, offload=False):
    """The case's mesh devices: all, or with ":offload" the first half of
    each host's (`offload`: the other half, the optimizer's)."""
    count = dtensor.num_global_devices("CPU")
    if not case.endswith(":offload"):
        return [f"CPU:{i}" for i in range(count)]
    half = dtensor.num_local_devices("CPU") // 2
    return [f"CPU:{i}" for i in range(count)
            if (i % (2 * half) >= half) == offload]


def offloaded(case):
    """The strategy's offload options: with ":offload", the optimizer's
    state on the other half of each host's devices."""
    if not case.endswith(":offload"):
        return {}
    return {"offload": "optimizer",
            "offload_devices": devices(case, offload=True)}


def build(case, weights, loss="mse", metrics=("mae",)):
    """The case's strategy and compiled PipelineModel, from `weights`."""
    schedule, optimizer = case.split(":")[1:3]
    shape = models.mesh_shape(case)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(shape, devices=devices(
        case)), rules=(tfpar.LayoutRules(models.HOST_RULES)
                       if "model" in shape else None),
        per_host_input=case.endswith(":per_host"), **offloaded(case))
    interleaved = case.endswith(":v2")
    with strategy.scope():
        model = models.host_mlp() if shape["pipe"] == 2 and not \
            interleaved else models.host_deep_mlp()
        pipe = tfpar.PipelineModel(model, num_microbatches=2,
                                   schedule=schedule,
                                   virtual_stages=2 if interleaved else 1)
        pipe.set_weights(weights)
        pipe.compile(optimizer=keras.optimizers.Adam(0.01)
                     if optimizer == "adam" else keras.optimizers.SGD(),
                     loss=loss, metrics=list(metrics))
    return pipe


def checkpoint(workdir, case, pipe, given, out):
    """Saves a sharded checkpoint (every host its blocks), restores it into
    a fresh pipeline of the same layout, and trains both one more epoch:
    the restored one must continue exactly."""
    directory = f"{workdir}/{case.replace(':', '_')}-ckpt"
    tfpar.save_checkpoint(pipe, directory)
    fresh = build(case, [np.zeros_like(w) for w in pipe.get_weights()])
    out["restored_step"] = tfpar.restore_checkpoint(fresh, directory)
    out["restored_predict"] = fresh.predict(given["x"], batch_size=16,
                                            verbose=0)
    for name, model in (("continued", pipe), ("resumed", fresh)):
        losses = models.BatchLosses()
        model.fit(given["x"], given["y"], batch_size=16, epochs=1,
                  shuffle=False, verbose=0, callbacks=[losses])
        out[f"{name}_losses"] = np.array(losses.losses)


@contextlib.contextmanager
def recorded_moves():
    """Records "shape spec" of each value `Bridge.move` moves between
    stage meshes (activations, their gradients, tied weights' sums)."""
    moved = []
    move = tfpar.pipeline.cross_host.Bridge.move

    def recording(self, value, source, target, spec):
        moved.append(f"{value.shape.as_list()} {list(spec)}")
        return move(self, value, source, target, spec)

    tfpar.pipeline.cross_host.Bridge.move = recording
    try:
        yield moved
    finally:
        tfpar.pipeline.cross_host.Bridge.move = move


def run_hub(workdir, case):
    """Case "AXES:SCHEDULE:adam:hub-NAME": keras-hub's causal LM NAME,
    Adam(1e-3)
    (`hub_models`: GPT-2's tied table, read again by its output head, is
    held on the last stage as a persistent copy), `auto_rules` inside the
    stages, from WORKDIR/hub-NAME.npz; per-batch losses, final weights and
    evaluate, the copies' values, which must equal their weights', and
    what training moved between the stages (`recorded_moves`)."""
    name = case.rsplit("hub-", 1)[1]
    given = np.load(f"{workdir}/hub-{name}.npz")
    mesh = tfpar.Mesh(models.mesh_shape(case))
    build = {**hub_models.BUILDERS, **hub_models.RANDOM_BUILDERS}[name]
    strategy = tfpar.ParallelStrategy(mesh, rules=tfpar.auto_rules(
        build, mesh=mesh))
    keras.utils.set_random_seed(1)  # as the test's one device: Dropout
    with strategy.scope():
        pipe = tfpar.PipelineModel(build(), num_microbatches=2,
                                   schedule=case.split(":")[1])
        pipe.set_weights([given[f"w{i}"] for i in range(len(given) - 2)])
        pipe.compile(optimizer=keras.optimizers.Adam(1e-3),
                     loss=hub_models.loss(name))
    x, y = {"token_ids": given["x"],
            "padding_mask": np.ones_like(given["x"])}, given["y"]
    losses = models.BatchLosses()
    with recorded_moves() as moved:
        pipe.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                 callbacks=[losses])
    out = {"losses": np.array(losses.losses), "moved": np.array(moved),
           "evaluate": np.asarray(pipe.evaluate(x, y, batch_size=8,
                                                verbose=0)),
           "copies": np.array([c.variable.path for c in pipe.ties.copies])}
    out.update({f"w{i}": w for i, w in enumerate(pipe.get_weights())})
    for i, copy in enumerate(pipe.ties.copies):
        out[f"copy{i}"] = tfpar.placement.fetch(
            copy.variable.value.read_value())
        out[f"copy{i}_weight"] = tfpar.placement.fetch(
            copy.weight.value.read_value())
    np.savez(f"{workdir}/{case}-host{tfpar.hosts.host_id()}.npz",
             **{k: np.asarray(v) for k, v in out.items()})


def run_tokens(workdir, case):
    """Case "AXES:SCHEDULE:sgd:tokens": `models.host_token_mlp` cut at
    "mid" (an embedding lookup, a regularizer and Dropout on stage 0, host
    0; Keras seeded as the test's one-device run), SGD(0.1), 2
    micro-batches, two epochs of WORKDIR/tokens.npz in order; its final
    weights, evaluate and each epoch's loss."""
    given = np.load(f"{workdir}/tokens.npz")
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(models.mesh_shape(case)))
    keras.utils.set_random_seed(1)
    with strategy.scope():
        pipe = tfpar.PipelineModel(models.host_token_mlp(),
                                   num_microbatches=2,
                                   schedule=case.split(":")[1],
                                   stage_boundaries=["mid"])
        weights, evaluated, losses = models.fit_tokens(pipe, given)
    np.savez(f"{workdir}/{case}-host{tfpar.hosts.host_id()}.npz",
             evaluate=np.asarray(evaluated), losses=np.asarray(losses),
             **{f"w{i}": w for i, w in enumerate(weights)})


def run_labels(workdir, case):
    """Case "AXES:SCHEDULE:sgd:labels": `build`'s pipeline trained on
    integer class labels (sparse cross-entropy of its 3 logits), SGD, one
    epoch of batch 16, then evaluated with batches of 16 and of 8 (a
    new move shape: programs compiled after training); its final weights
    and both evaluates."""
    given = np.load(f"{workdir}/given.npz")
    pipe = build(case, [given[f"w{i}"] for i in range(6)],
                 keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                 metrics=())
    labels = given["labels"]
    pipe.fit(given["x"], labels, batch_size=16, epochs=1, shuffle=False,
             verbose=0)
    np.savez(f"{workdir}/{case}-host{tfpar.hosts.host_id()}.npz",
             evaluate=[pipe.evaluate(given["x"], labels, batch_size=size,
                                     verbose=0) for size in (16, 8)],
             **{f"w{i}": w for i, w in enumerate(pipe.get_weights())})


def run_masked(workdir, case):
    """Case "AXES:SCHEDULE:sgd:masked": `models.masked_attention` cut at
    "attend" (its Keras mask crosses the hosts), one epoch of SGD(0.1)
    from WORKDIR/masked.npz (`fuzzing.train`); per-batch losses, final
    weights and predictions."""
    given = np.load(f"{workdir}/masked.npz")
    with tfpar.ParallelStrategy(tfpar.Mesh(models.mesh_shape(case))).scope():
        pipe = tfpar.PipelineModel(models.masked_attention(),
                                   num_microbatches=2,
                                   schedule=case.split(":")[1],
                                   stage_boundaries=["attend"])
    losses, weights = fuzzing.train(
        pipe, given["x"], given["y"],
        [given[f"w{i}"] for i in range(len(given) - 2)],
        models.BatchLosses(), keras.optimizers.SGD(0.1))
    np.savez(f"{workdir}/{case}-host{tfpar.hosts.host_id()}.npz",
             losses=losses, predict=pipe.predict(given["x"], batch_size=16,
                                                 verbose=0),
             **{f"w{i}": w for i, w in enumerate(weights)})


RUNNERS = {"hub": run_hub, "tokens": run_tokens, "labels": run_labels,
           "masked": run_masked}


def run(workdir, case):
    kind = case.split(":")[-1].split("-")[0]
    if kind in RUNNERS:
        RUNNERS[kind](workdir, case)
        return
    given = np.load(f"{workdir}/given.npz")
    deep = case.startswith("pipe4") or case.endswith(":v2")
    pipe = build(case, [given[f"{'d' if deep else 'w'}{i}"]
                        for i in range(10 if deep else 6)])
    x, y, batch = given["x"], given["y"], 16
    if case.endswith(":per_host"):  # this host's share of every batch
        batch //= dtensor.num_clients()
        mine = np.arange(len(x)) % 16 // batch == tfpar.hosts.host_id()
        x, y = x[mine], y[mine]
    losses = models.BatchLosses()
    pipe.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
             callbacks=[losses])
    out = {"losses": np.array(losses.losses),
           "evaluate": np.array(pipe.evaluate(x, y, batch_size=batch,
                                              verbose=0)),
           "predict": pipe.predict(x, batch_size=batch, verbose=0)}
    if case.endswith(":per_host"):
        try:
            pipe.evaluate(x[:3], y[:3], batch_size=3, verbose=0)
            out["uneven"] = ""
        except ValueError as error:
            out["uneven"] = str(error)
    out.update({f"w{i}": w for i, w in enumerate(pipe.get_weights())})
    held = {w.path: local_ids(w) for w in pipe.weights}
    for optimizer_ in pipe.stage_optimizers:
        held.update({v.path: local_ids(v) for v in optimizer_.variables
                     if "iteration" not in v.path
                     and "learning_rate" not in v.path})
    out["held"] = repr(held)
    out["split"] = pipe.split_report()
    if case.endswith(":ckpt"):
        checkpoint(workdir, case, pipe, given, out)
    host = tfpar.hosts.host_id()
    np.savez(f"{workdir}/{case}-host{host}.npz",
             **{k: np.asarray(v) for k, v in out.items()})


def refused(build, fit=False, axes=(("pipe", 2), ("data", 4)),
            **options):
    """The error of `tfpar.PipelineModel(build(), 2, **options)` on `axes`
    (and, with `fit`, of fitting it; "" if none); `per_host_input` goes to
    the strategy."""
    per_host = options.pop("per_host_input", False)
    try:
        strategy = tfpar.ParallelStrategy(tfpar.Mesh(dict(axes)),
                                          per_host_input=per_host)
        with strategy.scope():
            pipe = tfpar.PipelineModel(build(), num_microbatches=2,
                                       **options)
            pipe.compile(optimizer="sgd", loss="mse")
        if fit:
            pipe.fit(np.zeros((16, 16)), np.zeros((16, 3)), batch_size=16,
                     verbose=0)
    except ValueError as error:
        return str(error)
    return ""


def tied_mlp():
    """Layer "shared" called first and again on the last stage."""
    shared = keras.layers.Dense(16, name="shared")
    x = keras.Input((16,))
    h = keras.layers.Dense(16, name="mid")(shared(x))
    return keras.Model(x, keras.layers.Dense(3, name="out")(shared(h)))


def refusals(workdir):
    """What stays refused across hosts, as each host's error message: a
    zero-bubble schedule, tied weights sent
    in every micro-batch (tied_weights="per_step"), per-host input with
    the pipe axis first (every host holding every data coordinate: the
    strategy's refusal), record_timeline (at fit), and a mesh whose
    devices are not in increasing order."""
    out = {"zero_bubble": refused(models.host_mlp, schedule="zb-h1"),
           "tied_per_step": refused(tied_mlp, tied_weights="per_step"),
           "per_host": refused(models.host_mlp, per_host_input=True),
           "timeline": refused(models.host_mlp, fit=True,
                               record_timeline=True)}
    try:
        tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 2, "data": 4}, devices=[
            f"CPU:{i}" for i in range(7, -1, -1)])).stage_meshes[
            0].dtensor_mesh  # noqa: B018
        out["reordered"] = ""
    except ValueError as error:
        out["reordered"] = str(error)
    np.savez(f"{workdir}/refusals-host{tfpar.hosts.host_id()}.npz", **out)


def main():
    workdir, cases = sys.argv[1], sys.argv[2:]
    for case in cases:
        if case == "refusals":
            refusals(workdir)
        else:
            run(workdir, case)
    print(f"host {tfpar.hosts.host_id()} done", flush=True)


if __name__ == "__main__":
    main()
