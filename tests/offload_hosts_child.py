"""One host of a two-host cluster training with offload (run by
tests/test_offload_hosts.py).

    python -m tfpar.launch --hosts 2 --virtual-cpus 8 \
        offload_hosts_child.py WORKDIR CONFIG...

Joins the cluster (from the environment `tfpar.launch` sets) with 8
virtual CPUs per host (16 in all, by global name
host h's CPU:k is CPU:8h+k): the mesh is CPU:0-3 of every host (global
CPU:0-3 and CPU:8-11), the offload devices CPU:4-7 of every host (global
CPU:4-7 and CPU:12-15). For each CONFIG ("data8", "tp": data=2 x model=4
with Megatron rules, "fsdp": data=8 fsdp) it trains `models.host_mlp` from
the parent's weights on the parent's data without and with
`offload="optimizer"` and writes to WORKDIR/host<HOST_ID>.npz: per-batch
losses, final weights, evaluate and predict of both runs, the devices this
host holds the offloaded optimizer's variables on, both memory reports,
and, from a sharded checkpoint of the offloaded model (both hosts write
WORKDIR/ckpt_<CONFIG>), a model without offload restored from it (its
predictions and optimizer variables next to the offloaded ones), and the
way back: that model's checkpoint restored into a model with offload, and
one more epoch of each; and the errors of what offload refuses across
hosts. A CONFIG "master_<config>" (e.g. "master_fsdp") instead trains
<config> under mixed_bfloat16 without offload, with "optimizer" and with
"optimizer+master" (`master_case`). A CONFIG "pipe_<optimizer>" trains
`models.host_mlp` as a `PipelineModel` whose two stages live on different
hosts (pipe=2 x data=2 on PIPE_MESH, offload to PIPE_HOST;
"pipe_plain_<optimizer>" without offload: `pipe_case`).
"""

import sys

import tfpar

tfpar.connect_hosts(timeout=120)
workdir, configs = sys.argv[1], sys.argv[2:]
host_id = tfpar.hosts.host_id()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

import models  # noqa: E402

MESH = [f"CPU:{8 * h + k}" for h in range(2) for k in range(4)]
HOST = [f"CPU:{8 * h + k}" for h in range(2) for k in range(4, 8)]
# A pipeline whose stages live on different hosts: pipe=2 x data=2, stage
# 0 on host 0's CPU:0,1, stage 1 on host 1's; each stage's state on CPU:4,5
# of its host.
PIPE_MESH = ["CPU:0", "CPU:1", "CPU:8", "CPU:9"]
PIPE_HOST = ["CPU:4", "CPU:5", "CPU:12", "CPU:13"]
SCHEDULES = {"adam": "1f1b", "sgdm": "gpipe", "sgd": "1f1b"}
AXES = {"data8": ({"data": 8}, None, False),
        "tp": ({"data": 2, "model": 4}, models.HOST_RULES, False),
        "fsdp": ({"data": 8}, None, True)}


def strategy_for(config, offload):
    """`config`'s strategy, offloading (`offload`: None, "optimizer" or
    "optimizer+master") to this host's CPU:4-7."""
    axes, rules, fsdp = AXES[config]
    options = {"offload": offload, "offload_devices": HOST} if (
        offload) else {}
    return tfpar.ParallelStrategy(
        tfpar.Mesh(axes, devices=MESH),
        rules=None if rules is None else tfpar.LayoutRules(rules),
        fsdp=fsdp, **options)


def train(config, offload, given):
    strategy = strategy_for(config, offload)
    with strategy.scope():
        model = models.host_mlp()
        losses, weights, evaluated, predicted = models.train_host_mlp(
            model, given["x"], given["y"], [given[f"w{i}"] for i in range(6)])
    out = {"losses": losses, "evaluate": evaluated, "predict": predicted,
           "memory": repr(strategy.memory_per_device())}
    out.update({f"w{i}": w for i, w in enumerate(weights)})
    return model, out


def slot_devices(model):
    """The devices of this host's blocks of every optimizer variable."""
    return sorted({block.device for v in model.optimizer.variables
                   for block in dtensor.unpack(v.value.read_value())})


def restored_without_offload(config, model, given):
    """A model without offload restored from `model`'s checkpoint: its
    predictions and slots, and the offloaded model's slots."""
    directory = f"{workdir}/ckpt_{config}"
    tfpar.save_checkpoint(model, directory)
    with strategy_for(config, None).scope():
        restored = models.host_mlp()
        restored.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse",
                         metrics=["mae"])
    step = tfpar.restore_checkpoint(restored, directory)
    out = {"restored_step": step,
           "restored_predict": restored.predict(given["x"], verbose=0)}
    for name, source in (("offload", model), ("restored", restored)):
        # Every optimizer variable (the slots, iterations, learning rate),
        # in the optimizer's order (the same in both).
        for i, v in enumerate(source.optimizer.variables):
            out[f"{name}_opt{i}"] = v.numpy()
    # And back: the restored model's checkpoint (no offload) into a model
    # with offload; one more epoch of each from there.
    tfpar.save_checkpoint(restored, f"{directory}_back")
    with strategy_for(config, "optimizer").scope():
        back = models.host_mlp()
        back.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse",
                     metrics=["mae"])
    tfpar.restore_checkpoint(back, f"{directory}_back")
    for name, source in (("restored", restored), ("back", back)):
        out[f"{name}_more_losses"] = source.fit(
            given["x"], given["y"], batch_size=32, shuffle=False,
            verbose=0).history["loss"]
        out[f"{name}_more_predict"] = source.predict(given["x"], verbose=0)
    return out


def master_case(config, given):
    """Under mixed_bfloat16, `config` without offload, with "optimizer"
    and with "optimizer+master" (the runs of `train`, keys
    "master_<config>_<run>_..."); where "+master" keeps the devices' and
    the masters' blocks and the slots on this host; its sharded
    checkpoint restored without offload (weights and optimizer variables
    next to the saving model's) and back into "+master"."""
    keras.config.set_dtype_policy("mixed_bfloat16")
    out, key = {}, f"master_{config}"
    for run, offload in (("plain", None), ("optimizer", "optimizer"),
                         ("master", "optimizer+master")):
        model, found = train(config, offload, given)
        out.update({f"{key}_{run}_{k}": v for k, v in found.items()})
    trainable = [tfpar._compat.backing_variable(w)  # noqa: SLF001
                 for w in model.trainable_weights]
    out[f"{key}_device_blocks"] = sorted({
        (b.dtype.name, b.device) for w in trainable
        for b in dtensor.unpack(w.read_value())})
    out[f"{key}_master_blocks"] = sorted({
        (b.dtype.name, b.device) for w in trainable
        for b in dtensor.unpack(w.master.read_value())})
    out[f"{key}_slot_devices"] = slot_devices(model)
    directory = f"{workdir}/ckpt_{key}"
    tfpar.save_checkpoint(model, directory)
    restored = {}
    for run, offload, source in (("restored", None, directory),
                                 ("back", "optimizer+master",
                                  f"{directory}_plain")):
        with strategy_for(config, offload).scope():
            restored[run] = models.host_mlp()
            restored[run].compile(optimizer=keras.optimizers.Adam(0.01),
                                  loss="mse", metrics=["mae"])
        out[f"{key}_{run}_step"] = tfpar.restore_checkpoint(restored[run],
                                                            source)
        if offload is None:
            tfpar.save_checkpoint(restored[run], f"{directory}_plain")
    for run, source in (("saved", model), *restored.items()):
        out.update({f"{key}_{run}_w{i}": w
                    for i, w in enumerate(source.get_weights())})
        out.update({f"{key}_{run}_opt{i}": v.numpy()
                    for i, v in enumerate(source.optimizer.variables)})
    keras.config.set_dtype_policy("float32")
    return out


def pipe_strategy(offload):
    """pipe=2 x data=2 across the hosts, offloading (`offload`: None,
    "optimizer" or "optimizer+master") to each stage's host's CPU:4,5."""
    options = {"offload": offload, "offload_devices": PIPE_HOST} if (
        offload) else {}
    return tfpar.ParallelStrategy(
        tfpar.Mesh({"pipe": 2, "data": 2}, devices=PIPE_MESH), **options)


def pipe_model(strategy, name, build=models.host_mlp):
    """`build()` as a PipelineModel of 2 micro-batches (schedule by
    optimizer `name`) under `strategy`."""
    with strategy.scope():
        return tfpar.PipelineModel(build(), num_microbatches=2,
                                   schedule=SCHEDULES[name])


def held(pipe):
    """Per weight (by path), and per part the list of its optimizer's
    variables, the devices of this host's blocks of it ([] for another
    host's stage)."""
    def devices(v):
        if not dtensor.fetch_layout(v.value).mesh.local_device_ids():
            return []
        return [block.device for block in dtensor.unpack(v.value.read_value())]

    return {"weights": {w.path: devices(w) for w in pipe.weights},
            "parts": [[devices(v) for v in optimizer.variables]
                      for optimizer in pipe.stage_optimizers]}


def state_of(prefix, pipe):
    """Every weight and stage optimizer variable of `pipe`, as host arrays
    (collectives: every host calls this in the same order)."""
    out = {f"{prefix}_w{i}": w for i, w in enumerate(pipe.get_weights())}
    variables = [v for optimizer in pipe.stage_optimizers
                 for v in optimizer.variables]
    out.update({f"{prefix}_opt{i}": v.numpy()
                for i, v in enumerate(variables)})
    return out


def pipe_checkpoints(pipe, given):
    """The offloaded `pipe`'s sharded checkpoint (each host writes its
    stage's blocks, the slots from its CPUs) restored into the pipeline
    without offload, whose memory report is the "before"; that one's
    checkpoint restored back into an offloaded pipeline; the weights and
    optimizer variables of all three."""
    directory = f"{workdir}/ckpt_pipe"
    tfpar.save_checkpoint(pipe, directory)
    out = state_of("saved", pipe)
    for run, offload, source in (("restored", None, directory),
                                 ("back", "optimizer", f"{directory}_plain")):
        strategy, restored, out[f"{run}_step"] = restored_pipeline(
            offload, source, given)
        out.update(state_of(run, restored))
        if offload is None:
            out["plain_memory"] = repr(strategy.memory_per_device())
            tfpar.save_checkpoint(restored, f"{directory}_plain")
    return out


def restored_pipeline(offload, directory, given):
    """(strategy, pipeline, step): a compiled Adam pipeline across the
    hosts (`offload` as `pipe_strategy`) from zero weights, restored from
    the sharded checkpoint in `directory`."""
    strategy = pipe_strategy(offload)
    pipe = pipe_model(strategy, "adam")
    with strategy.scope():
        pipe.set_weights([np.zeros_like(given[f"w{i}"]) for i in range(6)])
        pipe.compile(optimizer=models.HOST_OPTIMIZERS["adam"](), loss="mse",
                     metrics=["mae"])
    return strategy, pipe, tfpar.restore_checkpoint(pipe, directory)


def pipe_resume_case(given):
    """The checkpoint "pipe_adam" saved with offload (run that config
    first) restored into the pipeline without offload and into one with
    offload, and one more epoch of each (batch 32): losses and weights,
    keys "pipe_resume_<run>_..."."""
    out = {}
    for run, offload in (("plain", None), ("offload", "optimizer")):
        _, pipe, _ = restored_pipeline(offload, f"{workdir}/ckpt_pipe", given)
        losses = models.BatchLosses()
        pipe.fit(given["x"], given["y"], batch_size=32, shuffle=False,
                 verbose=0, callbacks=[losses])
        out[f"pipe_resume_{run}_losses"] = np.array(losses.losses)
        out.update({f"pipe_resume_{run}_w{i}": w
                    for i, w in enumerate(pipe.get_weights())})
    return out


def pipe_case(config, given):
    """"pipe_<optimizer>" trains `models.host_mlp` as a pipeline across the
    hosts with offload="optimizer" ("pipe_plain_<optimizer>": without
    offload): losses, weights, evaluate, predict, memory report, where
    this host holds blocks; "pipe_adam" also `pipe_checkpoints`. Keys
    "<config>_..."."""
    name = config.rsplit("_", 1)[1]
    strategy = pipe_strategy(None if "_plain_" in config else "optimizer")
    pipe = pipe_model(strategy, name)
    with strategy.scope():
        losses, weights, evaluated, predicted = models.train_host_mlp(
            pipe, given["x"], given["y"], [given[f"w{i}"] for i in range(6)],
            name)
    out = {"losses": losses, "evaluate": evaluated, "predict": predicted,
           "memory": repr(strategy.memory_per_device()),
           "held": repr(held(pipe))}
    out.update({f"w{i}": w for i, w in enumerate(weights)})
    if config == "pipe_adam":
        out.update(pipe_checkpoints(pipe, given))
    return {f"{config}_{k}": v for k, v in out.items()}


def pipe_master_case(given):
    """Under mixed_bfloat16, the pipeline across hosts without offload,
    with "optimizer" and with "optimizer+master" (Adam, 1F1B; keys
    "pipe_master_<run>_..."), and where "+master" keeps this host's
    stage's device blocks and masters."""
    keras.config.set_dtype_policy("mixed_bfloat16")
    out = {}
    for run, offload in (("plain", None), ("optimizer", "optimizer"),
                         ("master", "optimizer+master")):
        strategy = pipe_strategy(offload)
        pipe = pipe_model(strategy, "adam")
        with strategy.scope():
            found = models.train_host_mlp(
                pipe, given["x"], given["y"],
                [given[f"w{i}"] for i in range(6)])
        for key, value in zip(("losses", "weights", "evaluate", "predict"),
                              found):
            if key == "weights":
                out.update({f"pipe_master_{run}_w{i}": w
                            for i, w in enumerate(value)})
            else:
                out[f"pipe_master_{run}_{key}"] = value
        out[f"pipe_master_{run}_memory"] = repr(strategy.memory_per_device())
    local = [tfpar._compat.backing_variable(w)  # noqa: SLF001
             for w in pipe.trainable_weights
             if dtensor.fetch_layout(w.value).mesh.local_device_ids()]
    out["pipe_master_device_blocks"] = sorted({
        (b.dtype.name, b.device) for w in local
        for b in dtensor.unpack(w.read_value())})
    out["pipe_master_master_blocks"] = sorted({
        (b.dtype.name, b.device) for w in local
        for b in dtensor.unpack(w.master.read_value())})
    keras.config.set_dtype_policy("float32")
    return out


def pipe_loss_scale_case(given):
    """`models.train_loss_scaled` (stage 0's float16 gradients overflow
    at first) on the pipeline across hosts, without and with offload:
    losses, weights "w<i>", each part's step count and scale."""
    out = {}
    for run, offload in (("plain", None), ("offload", "optimizer")):
        pipe = pipe_model(pipe_strategy(offload), "sgdm",
                          models.host_mixed_mlp)
        losses, weights, steps, scales = models.train_loss_scaled(pipe,
                                                                  given)
        key = f"pipe_loss_scale_{run}"
        out.update({f"{key}_losses": losses, f"{key}_steps": steps,
                    f"{key}_scales": scales})
        out.update({f"{key}_w{i}": w for i, w in enumerate(weights)})
    return out


def pipe_tied_case(given):
    """`models.host_tied_mlp` (its "shared" layer on both stages: a copy
    on host 1) as a pipeline across the hosts, Adam, without and with
    offload: losses, weights "w<i>", evaluate, and the copy's value."""
    out = {}
    for run, offload in (("plain", None), ("offload", "optimizer")):
        strategy = pipe_strategy(offload)
        pipe = pipe_model(strategy, "adam", models.host_tied_mlp)
        with strategy.scope():
            losses, weights, evaluated, _ = models.train_host_mlp(
                pipe, given["x"], given["y"],
                [given[f"t{i}"] for i in range(6)], "adam")
        key = f"pipe_tied_{run}"
        out.update({f"{key}_losses": losses, f"{key}_evaluate": evaluated,
                    f"{key}_copy": tfpar.placement.fetch(
                        pipe.ties.copies[0].variable.value.read_value())})
        out.update({f"{key}_w{i}": w for i, w in enumerate(weights)})
    return out


PIPE_CASES = {"pipe_master": pipe_master_case,
              "pipe_tied": pipe_tied_case,
              "pipe_loss_scale": pipe_loss_scale_case,
              "pipe_resume": pipe_resume_case}


def error_of(make):
    """The message of the ValueError `make()` raises ("" if none)."""
    try:
        make()
    except ValueError as error:
        return str(error)
    return ""


def refusals():
    """What offload refuses across hosts, before any variable is made:
    no offload_devices, a host device on another host than its mesh
    device's."""
    mesh = tfpar.Mesh({"data": 8}, devices=MESH)
    return {"no_devices": error_of(lambda: tfpar.ParallelStrategy(
                mesh, offload="optimizer")),
            "other_host": error_of(lambda: tfpar.ParallelStrategy(
                mesh, offload="optimizer",
                offload_devices=HOST[4:] + HOST[:4]))}


def main():
    given = np.load(f"{workdir}/given.npz")
    out = {"host": tfpar.hosts.host_id(), **refusals()}
    for config in configs:
        if config in PIPE_CASES:
            out.update(PIPE_CASES[config](given))
            continue
        if config.startswith("pipe_"):
            out.update(pipe_case(config, given))
            continue
        if config.startswith("master_"):
            out.update(master_case(config[len("master_"):], given))
            continue
        _, plain = train(config, None, given)
        model, offloaded = train(config, "optimizer", given)
        out.update({f"{config}_plain_{k}": v for k, v in plain.items()})
        out.update({f"{config}_offload_{k}": v for k, v in offloaded.items()})
        out[f"{config}_slot_devices"] = slot_devices(model)
        out.update({f"{config}_{k}": v for k, v in restored_without_offload(
            config, model, given).items()})
    np.savez(f"{workdir}/host{host_id}.npz",
             **{k: np.asarray(v) for k, v in out.items()})
    print(f"host {host_id} done", flush=True)


if __name__ == "__main__":
    main()
