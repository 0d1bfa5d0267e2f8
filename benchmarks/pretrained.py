"""Loading a pretrained Llama3 backbone into shards: peak host memory,
per-device bytes and load time, by route and mesh.

Run it with

    python benchmarks/pretrained.py                 # ~148M parameters, 0.59 GB
    python benchmarks/pretrained.py --size 40m      # ~40M parameters
    python benchmarks/pretrained.py --only fsdp     # the fsdp=True rows only
    python benchmarks/pretrained.py --help

It writes a keras-hub preset (`save_to_preset`) and a Hugging Face
checkpoint (`tfpar.pretrained.export_to_transformers`, sharded with an
index) of a random Llama3Backbone (tests/pretrained_child.py `SIZES`), then
loads each in a fresh process per route and mesh (8 virtual CPUs), the
process's peak resident set (Linux VmHWM) reset right before the load:

- "rules": rules from a builder (`tfpar.auto_rules(lambda:
  from_preset(path, load_weights=False))`), the model built in the scope
  of `ParallelStrategy(mesh, rules=...)` and of
  `tfpar.pretrained.deferred_init()` (each device's blocks allocated
  unwritten), then `tfpar.pretrained.load_weights` (each device's block
  read from the file on its own);
- "rules_random": the same without `deferred_init` (every weight's random
  initial value drawn on the host first: the route before);
- "from_preset": the same rules and `deferred_init`, then keras-hub's
  `from_preset` in the scope (Keras' `load_weights` assigns each whole
  tensor; preset only: keras-hub's HF route needs the `safetensors`
  package);
- "naive": `from_preset` under a strategy without rules, then
  `apply_rules(model, auto_rules(model))` (the route before issue 37).

A mesh "data=8,fsdp" is `ParallelStrategy(tfpar.Mesh({"data": 8}),
fsdp=True)` (every trainable weight also split over the data axis; on
data=8 `auto_rules` splits nothing more), "data=2,model=4,fsdp" the same
over the rules' model splits.

Printed per run: peak growth / checkpoint bytes, tfpar's largest per-device
bytes / checkpoint bytes, load seconds. Every run also checks the weights
equal the saved ones and runs one training step.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "..", "tests", "pretrained_child.py")
RUNS = [("preset", "naive", "model=8"), ("preset", "from_preset", "model=8"),
        ("preset", "rules_random", "model=8"),
        ("preset", "rules", "model=8"), ("preset", "rules", "data=2,model=4"),
        ("hf", "rules_random", "model=8"),
        ("hf", "rules", "model=8"), ("hf", "rules", "data=2,model=4"),
        # fsdp=True: every trainable weight also split over the data axis
        ("preset", "naive", "data=8,fsdp"),
        ("preset", "rules", "data=8,fsdp"),
        ("preset", "rules", "data=2,model=4,fsdp"),
        ("hf", "rules", "data=8,fsdp"), ("hf", "rules", "data=2,model=4,fsdp")]


def child(*args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.join(HERE, ".."), os.path.join(HERE, "..", "tests")])}
    result = subprocess.run([sys.executable, CHILD, *args], env=env,
                            capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="150m",
                        help="a key of tests/pretrained_child.py SIZES")
    parser.add_argument("--only", default=None, metavar="TEXT",
                        help="run only the rows whose 'format route mesh' "
                        "contains TEXT, e.g. --only fsdp")
    args = parser.parse_args()
    runs = [run for run in RUNS
            if args.only is None or args.only in " ".join(run)]
    if not runs:
        parser.error(f"--only {args.only!r} matches no run; the runs are "
                     + "; ".join(" ".join(run) for run in RUNS))
    with tempfile.TemporaryDirectory() as directory:
        child("make", args.size, directory)
        print(f"{'format':7} {'route':12} {'mesh':21} {'peak growth':>12} "
              f"{'per device':>11} {'load s':>7}")
        for fmt, route, mesh in runs:
            out = os.path.join(directory, "result.json")
            child("load", args.size, directory, fmt, route, mesh, out)
            with open(out) as f:
                r = json.load(f)
            assert r["weights_equal"], r
            size = r["checkpoint_bytes"]
            print(f"{fmt:7} {route:12} {mesh:21} "
                  f"{r['growth'] / size:11.2f}x {r['per_device_bytes'] / size:10.3f}x "
                  f"{r['load_s']:7.1f}", flush=True)
        print(f"checkpoint: {size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
