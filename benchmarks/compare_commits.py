"""The benchmark MLP's step time under tfpar at two commits, alternated.

Run it with

    python benchmarks/compare_commits.py A B [C ...] [--pairs 10]
        [--meshes model=8,data=2x4,data=8] [--steps 8] [--rounds 10]
        [--ops-diff] [--json FILE]

A is the reference; B (and C, ...) are compared with it. Each is a commit
(or the word WORKTREE: this checkout's files as they are). Each commit's
`tfpar/` is written into a temporary directory (`git archive`) once; then
the commits are run in turn, A B A B ... (`--pairs` times), each run a
fresh subprocess of this Python (`sys.executable`) with that commit's tree
first on PYTHONPATH. The measurement itself is this file's (`--worker`),
the same for every commit: it trains benchmarks/step_time.py's MLP (batch
256, Adam) on one device and on each mesh, side by side in one process (a
warm-up fit each, then `--rounds` round-robin rounds of one fit of
`--steps` steps each), and reports each mesh's step ÷ one device's: the
median over the rounds of that round's ratio, by the wall clock and by
this process' CPU time (all threads; steadier than the wall clock when
other jobs share the cores).

Printed per mesh: each commit's median step ratio, the ratios of its runs
to the reference's runs of the same pair, and the median of those paired
ratios (the figure to compare: 1.05 = the commit's mesh step is 5% slower,
relative to one device, than the reference's); then each commit's op
count of the compiled train step: the ops of the per-device program
DTensor expanded the traced step into (every function it calls counted
too), and of the traced step before expansion. Both are read the same way
for every commit, through TF's function library only (no tfpar internals):
the DTensor wrappers (`<traced>__func_...`) that appeared during the
mesh's warm-up fit, the one with the most ops being the train step.
`--ops-diff` prints the op types whose counts differ from the reference's.

The host is shared: the load average is printed before and after and with
every run; the commits alternate so that a change of load hits them alike.
A run takes ~25 s on a quiet 2-core host (single step ~23 ms), 60-130 s at
load 10-20.
"""

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MESHES = {  # name -> (axes, fsdp)
    "model=8": ({"model": 8}, False),
    "data=2x4": ({"data": 2, "model": 4}, False),
    "data=8": ({"data": 8}, False),
    "data=8fsdp": ({"data": 8}, True),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("commits", nargs="*", metavar="COMMIT")
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--meshes", default="model=8,data=2x4,data=8",
                        help=f"comma-separated, of {', '.join(MESHES)}")
    parser.add_argument("--steps", type=int, default=8,
                        help="steps per timed fit (default 8)")
    parser.add_argument("--rounds", type=int, default=10,
                        help="timed rounds per run (default 10)")
    parser.add_argument("--ops-diff", action="store_true",
                        help="print the op types whose counts differ")
    parser.add_argument("--json", default=None,
                        help="also write every run's results to this file")
    parser.add_argument("--worker", action="store_true",
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.meshes = args.meshes.split(",")
    unknown = [m for m in args.meshes if m not in MESHES]
    if unknown:
        parser.error(f"unknown meshes {unknown}; known: {list(MESHES)}")
    if not args.worker and len(args.commits) < 2:
        parser.error("give two commits (or more), the reference first")
    return args


# -- the worker: one commit's measurement, in its own process ----------------


def _function_ops(name, seen, counts, library):
    """Adds the op types of library function `name` and of every function
    its nodes call (each function once) to `counts`."""
    from tensorflow.python.eager import context  # noqa: PLC0415

    if name in seen or name not in library:
        return
    seen.add(name)
    fdef = context.context().get_function_def(name)
    for node in fdef.node_def:
        counts[node.op] += 1
        for value in node.attr.values():
            if value.func.name:
                _function_ops(value.func.name, seen, counts, library)
            for func in value.list.func:
                _function_ops(func.name, seen, counts, library)


def _step_ops(new_names, library):
    """(expanded op counts, traced op counts) of the largest DTensor program
    among the library functions `new_names`."""
    best = (collections.Counter(), collections.Counter())
    for name in new_names:
        if "__func_" not in name:
            continue
        expanded = collections.Counter()
        _function_ops(name, set(), expanded, library)
        if sum(expanded.values()) > sum(best[0].values()):
            traced = collections.Counter()
            _function_ops(name.split("__func_")[0], set(), traced, library)
            best = (expanded, traced)
    return best


def _round_ratio(mesh, single):
    """The median over rounds of each round's mesh step ÷ its one-device
    step (timed in the same round: a load that changes between rounds
    cancels out more than in a ratio of medians)."""
    return statistics.median(m / s for m, s in zip(mesh, single))


def worker(args):
    # Imported here, not at the top: the driver runs no TensorFlow, and the
    # worker's tfpar is the commit's tree, first on its PYTHONPATH (after
    # this folder, sys.path[0] when run as a script, which holds step_time).
    import tfpar  # noqa: PLC0415

    tfpar.use_virtual_cpus(8)
    import numpy as np  # noqa: PLC0415
    import step_time  # noqa: PLC0415  (the benchmark MLP)
    from tensorflow.python.eager import context  # noqa: PLC0415

    rng = np.random.RandomState(0)
    x = rng.normal(size=(step_time.BATCH * args.steps, 512)).astype("float32")
    y = rng.randint(0, 10, size=(step_time.BATCH * args.steps,))
    configs = {"single": step_time.KerasConfig(
        "single", lambda: None, (x, y), 1)}
    configs["single"].fit()  # traced before any strategy exists
    ops = {}
    for mesh in args.meshes:
        axes, fsdp = MESHES[mesh]
        before = set(context.context().list_function_names())
        configs[mesh] = step_time.KerasConfig(
            mesh, step_time.tfpar_strategy(axes, fsdp=fsdp), (x, y), 1)
        configs[mesh].fit()  # warm-up: traces and compiles
        library = set(context.context().list_function_names())
        expanded, traced = _step_ops(library - before, library)
        ops[mesh] = {"expanded": sum(expanded.values()),
                     "traced": sum(traced.values()),
                     "expanded_types": dict(expanded),
                     "traced_types": dict(traced)}
    times = {name: [] for name in configs}
    cpu = {name: [] for name in configs}  # this process' CPU s per step
    for _ in range(args.rounds):
        for name, config in configs.items():
            start = time.process_time()
            times[name].append(config.time_step())
            cpu[name].append((time.process_time() - start) / config.steps)
    result = {
        "tfpar": os.path.dirname(tfpar.__file__),
        "single_ms": 1e3 * statistics.median(times["single"]),
        "ms": {m: 1e3 * statistics.median(times[m]) for m in args.meshes},
        "ratio": {m: _round_ratio(times[m], times["single"])
                  for m in args.meshes},
        "cpu_ratio": {m: _round_ratio(cpu[m], cpu["single"])
                      for m in args.meshes},
        "ops": ops,
    }
    print("RESULT " + json.dumps(result), flush=True)


# -- the driver ---------------------------------------------------------------


def export_tree(commit, directory):
    """`tfpar/` of `commit` (or this checkout's, for WORKTREE) in
    `directory`; returns the directory to put on PYTHONPATH."""
    if commit == "WORKTREE":
        return REPO
    archive = subprocess.run(
        ["git", "-C", REPO, "archive", commit, "tfpar"],
        check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", directory], input=archive, check=True)
    return directory


def run_worker(tree, args):
    env = dict(os.environ, PYTHONPATH=tree,
               TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
    command = [sys.executable, os.path.abspath(__file__), "--worker",
               "--meshes", ",".join(args.meshes), "--steps", str(args.steps),
               "--rounds", str(args.rounds)]
    done = subprocess.run(command, env=env, capture_output=True, text=True,
                          cwd=tempfile.gettempdir())
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"worker on {tree} failed:\n{done.stderr[-3000:]}")


def print_ops(args, first):
    print("\nops of the compiled train step (expanded per-device program; "
          "traced step before expansion):")
    reference = args.commits[0]
    for mesh in args.meshes:
        print(f"  {mesh:10s} " + "   ".join(
            f"{c}: {first[c]['ops'][mesh]['expanded']:5d} "
            f"({first[c]['ops'][mesh]['traced']:4d} traced)"
            for c in args.commits))
        for commit in args.commits[1:] if args.ops_diff else ():
            for kind in ("expanded_types", "traced_types"):
                ta = first[reference]["ops"][mesh][kind]
                tb = first[commit]["ops"][mesh][kind]
                diff = sorted((t, ta.get(t, 0), tb.get(t, 0))
                              for t in set(ta) | set(tb)
                              if ta.get(t, 0) != tb.get(t, 0))
                if diff:
                    print(f"    {commit} {kind}: " + ", ".join(
                        f"{t} {ca}->{cb}" for t, ca, cb in diff))


def print_ratios(args, runs):
    reference = args.commits[0]
    print(f"\nstep ÷ one device, medians over {args.pairs} runs; paired "
          f"ratios to {reference} (run i of a commit ÷ run i of {reference}):")
    for mesh in args.meshes:
        for key, label in (("ratio", "wall clock"),
                           ("cpu_ratio", "CPU time")):
            ref = [r[key][mesh] for r in runs[reference]]
            line = f"  {mesh:10s} {label:10s} {reference} " \
                   f"{statistics.median(ref):.2f}"
            for commit in args.commits[1:]:
                mine = [r[key][mesh] for r in runs[commit]]
                paired = [y / x for x, y in zip(ref, mine)]
                line += (f" | {commit} {statistics.median(mine):.2f} paired "
                         f"median {statistics.median(paired):.3f}")
                if key == "ratio":
                    line += f" [{' '.join(f'{p:.2f}' for p in paired)}]"
            print(line)


def main(args):
    print(f"load average at start: {os.getloadavg()}", flush=True)
    runs = {c: [] for c in args.commits}
    with tempfile.TemporaryDirectory() as scratch:
        trees = {}
        for n, commit in enumerate(args.commits):
            os.mkdir(os.path.join(scratch, str(n)))
            trees[commit] = export_tree(commit, os.path.join(scratch, str(n)))
        for pair in range(args.pairs):
            for commit in args.commits:
                start = time.perf_counter()
                runs[commit].append(run_worker(trees[commit], args))
                r = runs[commit][-1]
                print(f"run {pair + 1} {commit}: single "
                      f"{r['single_ms']:.1f} ms, " + ", ".join(
                          f"{m} {r['ms'][m]:.1f} ms ({r['ratio'][m]:.2f})"
                          for m in args.meshes)
                      + f"  [{time.perf_counter() - start:.0f} s, load "
                      f"{os.getloadavg()[0]:.1f}]", flush=True)
    print(f"load average at end:   {os.getloadavg()}")
    print_ratios(args, runs)
    print_ops(args, {c: runs[c][0] for c in args.commits})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.worker:
        worker(arguments)
    else:
        main(arguments)
