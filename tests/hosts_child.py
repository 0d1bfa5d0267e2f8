"""One host of a two-host cluster (run by tests/test_hosts.py).

    python hosts_child.py HOST_ID ADDR0,ADDR1 WORKDIR

Joins the cluster with 4 virtual CPUs (8 devices in all), then trains the
MLP of `models.host_mlp` from the parent's initial weights and data under
two strategies spanning both hosts (data=2 × model=4 with Megatron rules;
data=8 with fsdp) and writes what it saw to WORKDIR/host<HOST_ID>.npz:
per-batch losses, final weights, evaluate and predict results, the shapes
of this host's blocks of every weight, the memory report, predictions of
a model reloaded from `save_weights`, a sharded checkpoint of the fsdp
model (both hosts write WORKDIR/ckpt) restored onto data=2 x model=4, the
error of a mesh over a subset of the devices spanning both hosts, and
weights each host initialised or assigned on its own (unseeded), with and
without tfpar.
"""

import sys

import tfpar

host_id = int(sys.argv[1])
addresses = sys.argv[2].split(",")
workdir = sys.argv[3]
tfpar.use_virtual_cpus(4)
tfpar.connect_hosts(addresses, host_id, timeout=120)

import numpy as np  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

import models  # noqa: E402


def run(strategy, given, name):
    with strategy.scope():
        model = models.host_mlp()
        losses, weights, evaluated, predicted = models.train_host_mlp(
            model, given["x"], given["y"],
            [given[f"w{i}"] for i in range(6)])
    blocks = {w.path: [tuple(c.shape) for c in dtensor.unpack(
        w.value.read_value())] for w in model.weights}
    memory = repr(strategy.memory_per_device())  # before a 2nd model exists
    # Keras saving: every host gathers every weight (a collective each),
    # each writes its own file; a fresh model loads it back.
    path = f"{workdir}/{name}_host{host_id}.weights.h5"
    model.save_weights(path)
    with strategy.scope():
        fresh = models.host_mlp()
        fresh.load_weights(path)
    return {"model": model,
            "losses": losses, "weights": weights, "evaluate": evaluated,
            "predict": predicted, "blocks": repr(blocks),
            "memory": memory,
            "reloaded": fresh.predict(given["x"], verbose=0)}


def own_values(strategy):
    """Weights of models no seed makes equal across hosts: plain Keras,
    built under the strategy, and set_weights of this host's own random
    arrays."""
    out = {"plain": models.host_mlp().get_weights()}
    with strategy.scope():
        model = models.host_mlp()
    out["built"] = model.get_weights()
    mine = [np.random.rand(*w.shape).astype("float32") for w in out["built"]]
    model.set_weights(mine)
    out["assigned"] = model.get_weights()
    out["mine"] = mine
    return {f"own_{k}_w{i}": w for k, ws in out.items()
            for i, w in enumerate(ws)}


def main():
    given = np.load(f"{workdir}/given.npz")
    out = {"hosts": tfpar.hosts.num_hosts(), "host": tfpar.hosts.host_id(),
           "mesh_devices": list(tfpar.Mesh({"data": 8}).devices)}
    for name, strategy in (
            ("tp", tfpar.ParallelStrategy(
                tfpar.Mesh({"data": 2, "model": 4}),
                rules=tfpar.LayoutRules(models.HOST_RULES))),
            ("fsdp", tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}),
                                            fsdp=True))):
        if name == "tp":
            out.update(own_values(strategy))
        result = run(strategy, given, name)
        model_for_checkpoint = result.pop("model")  # the fsdp one, last
        if name == "tp":
            tp_strategy = strategy
        for key, value in result.items():
            if key == "weights":
                for i, w in enumerate(value):
                    out[f"{name}_w{i}"] = w
            else:
                out[f"{name}_{key}"] = value
    # Sharded checkpoint of the fsdp model, written by both hosts into one
    # directory, restored onto the data=2 x model=4 mesh (resharding).
    tfpar.save_checkpoint(model_for_checkpoint, f"{workdir}/ckpt")
    with tp_strategy.scope():
        restored = models.host_mlp()
        restored.compile(optimizer="adam", loss="mse")
    out["restored_step"] = tfpar.restore_checkpoint(restored,
                                                    f"{workdir}/ckpt")
    out["restored_predict"] = restored.predict(given["x"], verbose=0)
    # A failure on one host raises on both, and nothing is published: a
    # second save whose block writes fail on host 1 only ...
    real_write = tfpar.checkpoint.files.write_npy

    def full_disk(path, array):
        raise OSError(f"No space left on device: {path}")

    if host_id == 1:
        tfpar.checkpoint.files.write_npy = full_disk
    try:
        tfpar.save_checkpoint(model_for_checkpoint, f"{workdir}/ckpt",
                              step=7)
        out["failed_save"] = ""
    except Exception as error:  # noqa: BLE001
        out["failed_save"] = f"{type(error).__name__}: {error}"
    tfpar.checkpoint.files.write_npy = real_write
    out["latest_after_failed_save"] = tfpar.latest_checkpoint(
        f"{workdir}/ckpt")
    # ... and a restore that finds no checkpoint on host 1 only.
    try:
        tfpar.restore_checkpoint(
            restored, f"{workdir}/ckpt" if host_id == 0 else
            f"{workdir}/nowhere")
        out["failed_restore"] = ""
    except Exception as error:  # noqa: BLE001
        out["failed_restore"] = f"{type(error).__name__}: {error}"
    # Devices of both hosts, but not all of them: refused on every host.
    try:
        tfpar.Mesh({"data": 4}, devices=[f"CPU:{i}" for i in range(2, 6)]
                   ).dtensor_mesh  # noqa: B018
        out["subset_error"] = ""
    except ValueError as error:
        out["subset_error"] = str(error)
    # A strategy on host 0's devices only (host 1 crashed in its first
    # step): refused on every host.
    try:
        tfpar.ParallelStrategy(tfpar.Mesh({"data": 4}, devices=[
            f"CPU:{i}" for i in range(4)]))
        out["one_host_strategy_error"] = ""
    except ValueError as error:
        out["one_host_strategy_error"] = str(error)
    np.savez(f"{workdir}/host{host_id}.npz",
             **{k: np.asarray(v) for k, v in out.items()})
    print(f"host {host_id} done", flush=True)


if __name__ == "__main__":
    main()
