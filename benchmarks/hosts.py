"""Two (or four) hosts vs one host on the same mesh: step time and the
bytes each host sends per step.

Run it with

    python benchmarks/hosts.py             # width 512, 20 timed steps
    python benchmarks/hosts.py --quick     # width 128, 5 timed steps
    python benchmarks/hosts.py --meshes data8,data2xmodel4,pipe --help
    python benchmarks/hosts.py --meshes pipe --hosts 4
    python benchmarks/hosts.py --failures  # detect a dead host, restart

It trains one MLP (Input(W) -> 4 x Dense(W, relu) -> Dense(8); Megatron
rules on a model axis: the 1st and 3rd Dense column-parallel, the 2nd and
4th row-parallel) with Adam on batch 64, on each mesh twice, each in fresh
processes: 1 host x 8 virtual CPUs (one process) and 2 hosts x 4 virtual
CPUs (`python -m tfpar.launch --hosts 2 --virtual-cpus 4`; `--hosts 4`:
4 x 2). Meshes:

- data8: {"data": 8}, a `ParallelStrategy` step over both hosts (DTensor
  multi-client: one SPMD program, collectives across the hosts);
- data2xmodel4: {"data": 2, "model": 4}, the same;
- pipe: {"pipe": 2, "data": 2, "model": 2}, a `tfpar.PipelineModel` (2
  stages, 4 micro-batches, 1F1B). On one host the pipeline's
  one-`tf.function` step (`tfpar.pipeline.runner`); on two, stage s on
  host s and the host-driven step of `tfpar.pipeline.cross_host` (each
  backward recomputes its forward; each stage-to-stage move an all-gather
  over the hosts). With `--hosts 4` each stage spans two hosts (its data
  axis across them);
- pipe-data-first: {"data": 2, "pipe": 2, "model": 2}, the same pipeline
  with a whole pipeline on each host (every move inside a host; the
  gradients' all-reduce over data across them).

Each run does 3 untimed steps (compilation), then `--steps` timed
`train_on_batch` calls (each returns the loss: the host waits for the
step); the median is shown. Bytes sent per host per step: for data8 and
data2xmodel4 what the host's devices (8 / hosts) send in the step's collectives
(ring: 2(n-1)/n of each all-reduce's message per device, from
`tfpar.communication_report` on one host; the same program runs on two,
and how much of it crosses between the hosts depends on DTensor's ring
order, not measured); for pipe what this host's devices put into the
bridge's all-gathers (`cross_host.Bridge`: each device's block of every
activation and gradient crossing the hosts, or zeros when the other host
sends, times the other hosts; the stages' own collectives are the same on
one host and not counted). Both hosts are processes on this one machine
(loopback gRPC, CPUs shared): the ratio shows the cost of multi-client
DTensor, of the host-driven step and of gRPC, not of a network.

`--failures` times a lost host instead: tests/launch_child.py (the MLP on
data=8 over both hosts, 4 epochs, Keras BackupAndRestore) under
`python -m tfpar.launch --max-restarts 1 --grace 60`, host 1 SIGKILLed
after epoch 2; from the launcher's output as it arrives: seconds from host
1's death to host 0's exit (the heartbeat timeout, `--heartbeat`, bounds
it), and from the restart to both hosts done (TF start-up, compilation,
the restore and the last 2 epochs).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


MESHES = {"data8": {"data": 8}, "data2xmodel4": {"data": 2, "model": 4},
          "pipe": {"pipe": 2, "data": 2, "model": 2},
          "pipe-data-first": {"data": 2, "pipe": 2, "model": 2}}


def worker(width, steps, mesh_name):
    """One host's run; prints a JSON line of its results."""
    import tfpar  # noqa: PLC0415

    if tfpar.connect_hosts(timeout=120) == 1:
        tfpar.use_virtual_cpus(8)
    import keras  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from tfpar.pipeline import cross_host  # noqa: PLC0415

    axes = MESHES[mesh_name]
    rules = tfpar.LayoutRules({r".*d[02]/kernel": (None, "model"),
                               r".*d[02]/bias": ("model",),
                               r".*d[13]/kernel": ("model", None)}
                              if "model" in axes else {})
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes), rules=rules)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((width,))] + [
            keras.layers.Dense(width, activation="relu", name=f"d{i}")
            for i in range(4)] + [keras.layers.Dense(8, name="head")])
        if "pipe" in axes:
            model = tfpar.PipelineModel(model, num_microbatches=4,
                                        stage_boundaries=["d2"])
        model.compile(optimizer="adam", loss="mse")
    rng = np.random.RandomState(0)
    x = rng.normal(size=(64, width)).astype("float32")
    y = rng.normal(size=(64, 8)).astype("float32")
    sent_per_step = None
    if "pipe" not in axes and tfpar.hosts.num_hosts() == 1:
        report = tfpar.communication_report(model, x, y)
        sent_per_step = report.total_ring_bytes()  # per device
    for _ in range(3):
        model.train_on_batch(x, y)
    sent = cross_host.Bridge.total_bytes_sent
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        model.train_on_batch(x, y)
        seconds.append(time.perf_counter() - start)
    if "pipe" in axes:
        sent_per_step = (cross_host.Bridge.total_bytes_sent - sent) / steps
    print("RESULT " + json.dumps({
        "host": tfpar.hosts.host_id(), "hosts": tfpar.hosts.num_hosts(),
        "step_s": float(np.median(seconds)),
        "bytes_per_step": sent_per_step}), flush=True)


def run(hosts, width, steps, mesh_name):
    """Results of every host of one configuration."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DTENSOR_", "TFPAR_"))}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    command = [os.path.abspath(__file__), "--worker", "--width", str(width),
               "--steps", str(steps), "--meshes", mesh_name]
    if hosts > 1:
        command = ["-m", "tfpar.launch", "--hosts", str(hosts),
                   "--virtual-cpus", str(8 // hosts)] + command
    result = subprocess.run([sys.executable] + command, env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=1800)
    found = [json.loads(line.split("RESULT ", 1)[1])
             for line in result.stdout.splitlines() if "RESULT " in line]
    if result.returncode or len(found) != hosts:
        raise RuntimeError(f"{hosts}-host run failed:\n"
                           f"{(result.stdout + result.stderr)[-4000:]}")
    return sorted(found, key=lambda r: r["host"])


def failures(heartbeat):
    """(seconds to detect the dead host, seconds to restart and finish)."""
    import numpy as np  # noqa: PLC0415

    tests = os.path.join(ROOT, "tests")
    sys.path.insert(0, tests)
    import models  # noqa: PLC0415

    workdir = tempfile.mkdtemp(prefix="tfpar-failures-")
    weights = models.host_mlp().get_weights()
    x, y = models.mlp_data(n=96)
    np.savez(os.path.join(workdir, "given.npz"), x=x, y=y,
             **{f"w{i}": w for i, w in enumerate(weights)})
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DTENSOR_", "TFPAR_"))}
    env.update(HEARTBEAT=str(heartbeat), PYTHONPATH=os.pathsep.join(
        [tests, ROOT, env.get("PYTHONPATH", "")]))
    process = subprocess.Popen(
        [sys.executable, "-m", "tfpar.launch", "--hosts", "2",
         "--virtual-cpus", "4", "--max-restarts", "1", "--grace", "60",
         os.path.join(tests, "launch_child.py"), "kill", workdir],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    seen = {}
    marks = {"died": "host 1 exited with status -9",
             "noticed": "host 0 exited with status",
             "restart": "restarting all 2 hosts",
             "done0": "host 0 attempt 1 done", "done1": "host 1 attempt 1 done"}
    for line in process.stdout:
        for key, text in marks.items():
            if text in line and key not in seen:
                seen[key] = time.monotonic()
    if process.wait() or len(seen) != len(marks):
        raise RuntimeError(f"the failure run did not go as planned: {seen}")
    return (seen["noticed"] - seen["died"],
            max(seen["done0"], seen["done1"]) - seen["restart"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--meshes", default="data8,data2xmodel4,pipe",
                        help=f"comma-separated, of {sorted(MESHES)}")
    parser.add_argument("--hosts", type=int, default=2, choices=(2, 4),
                        help="hosts of 8 / hosts virtual CPUs each")
    parser.add_argument("--quick", action="store_true",
                        help="width 128, 5 timed steps")
    parser.add_argument("--failures", action="store_true",
                        help="time a dead host's detection and the restart")
    parser.add_argument("--heartbeat", type=float, default=15,
                        help="with --failures: connect_hosts' heartbeat "
                             "timeout (seconds)")
    parser.add_argument("--worker", action="store_true",
                        help="(internal) one host's run")
    options = parser.parse_args()
    if options.quick:
        options.width, options.steps = 128, 5
    if options.worker:
        worker(options.width, options.steps, options.meshes)
        return
    if options.failures:
        detect, resume = failures(options.heartbeat)
        print(f"host 1 SIGKILLed after epoch 2 (heartbeat timeout "
              f"{options.heartbeat:g} s): host 0 exited {detect:.1f} s later; "
              f"restart to both hosts done (start-up, restore, 2 epochs): "
              f"{resume:.1f} s")
        return
    print(f"MLP width {options.width}, batch 64, Adam; median of "
          f"{options.steps} steps (pipe: 4 micro-batches, 1F1B)")
    hosts = options.hosts
    for name in options.meshes.split(","):
        one = run(1, options.width, options.steps, name)[0]
        several = run(hosts, options.width, options.steps, name)
        print(f"{name}: 1 host x 8 CPUs {one['step_s'] * 1e3:8.1f} ms/step")
        for r in several:
            sent = r["bytes_per_step"]
            if sent is None:  # the same program: a host's devices' bytes
                sent = one["bytes_per_step"] * 8 // hosts
            print(f"  {hosts} hosts x {8 // hosts} CPUs, host {r['host']}: "
                  f"{r['step_s'] * 1e3:8.1f} ms/step "
                  f"({r['step_s'] / one['step_s']:.2f}x), "
                  f"{sent / 1e6:.3f} MB sent per step")


if __name__ == "__main__":
    main()
