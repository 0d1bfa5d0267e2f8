"""Can pipeline stages live on different hosts with DTensor multi-client?

Plain TF 2.21 + DTensor on CPU (tfpar is imported only for `connect_hosts` /
`use_virtual_cpus`): 2 hosts x 4 virtual CPUs, a full mesh
{"pipe": 2, "data": 4} over global devices 0..7, and one stage mesh per host,
{"data": 4} over devices 0..3 (host 0) and 4..7 (host 1), both built on
BOTH clients.

    python tests/dtensor_cross_host_repro.py          # runs every case
    python tests/dtensor_cross_host_repro.py CASE...  # some of them
    python -m tfpar.launch --hosts 2 --virtual-cpus 4 \
        tests/dtensor_cross_host_repro.py             # one cluster, minus
                                                      # the crashing cases

Without the launcher each case runs in its own 2-host cluster (`python -m
tfpar.launch --hosts 2 --virtual-cpus 4 THIS_FILE --case CASE`) under a
timeout, so a hang or a crash is reported, never inherited; the summary
prints per case and host "works" (with the numbers), the first line of
the error, "CRASH (signal)" or "HANG". REPRO_TRACEBACK=1 adds tracebacks.

Conclusion (TF 2.21, CPU; observed on this machine):

(a) WORKS. A `dtensor.Mesh(dims, global_device_ids=[4..7], local_device_ids=
    [], local_devices=[], global_devices=[/job:worker/replica:0/task:1/
    device:CPU:0..3])` builds on host 0 (ids need only increase by 1, they
    need not start at 0), and the same call with the local lists filled
    builds on host 1.
(b) WORKS, as a no-op on the host that owns none of the mesh's devices:
    eager ops and `tf.function`s (with collectives inside the sub-mesh) on
    the host-0 mesh return at once on host 1 (no hang), and one function
    holding independent work on both sub-meshes runs each host's part.
    Reading the result on the non-owner fails: `dtensor.unpack` raises
    "DTensorUnpack is not supported on a remote mesh."; `dtensor.pack` of
    [] onto a mesh without local devices CRASHES the process (SIGSEGV).
(c) Moving a tensor between the two host sub-meshes:
    - `dtensor.copy_to_mesh` (= `relayout` to the other mesh), eager or in
      a `tf.function`, FAILS on both hosts with "Send and receive hosts don't
      match" (DTensor lowers a cross-mesh copy to DTensorSend/DTensorRecv,
      which must stay on one host). Host-0 mesh -> full mesh
      (`copy_to_mesh` in a function, or eager `relayout`): host 0 gets the
      right value, host 1 CRASHES (SIGSEGV).
    - WORKS: a collective over the FULL 8-device mesh, two ways:
      1. SPMD pipeline, all in one `tf.function`: stage weights stacked on
         a leading axis sharded over "pipe" (W: [2, d, d], layout
         [pipe, -, -]), activations [2, b, d] sharded the same way; every
         stage computes on its own slot (`einsum("pbd,pde->pbe")`, local),
         and the shift to the next stage is `relayout` to replicated
         (all-gather over "pipe", across the hosts) + a constant shift
         matrix + `relayout` back. Forward and `tf.GradientTape` gradients
         match a single-process reference (error ~1e-7). Limits: stages
         must be the same computation on same-shaped weights (repeated
         blocks); `tf.roll` ("does not implement layout propagation") and
         `tf.concat` along the sharded axis ("Concat op SPMD with concat
         dimension in sharded dimension is not supported") fail, hence the
         shift matrix; the all-gather moves 2x the data a send would.
      2. Bridge through the full mesh, host-driven: stage s's work is
         `tf.function`s on its own sub-mesh; to send, the owning host
         `unpack`s its (replicated) components, `pack`s them with a leading
         slot of size 1 onto the full mesh laid out [pipe, ...] (its own
         devices are pipe slot = host id; the other host packs zeros), a
         compiled full-mesh `relayout` to replicated (all-gather over
         "pipe") carries them across, and the receiving host takes slot
         `src` of its components and `pack`s them onto its sub-mesh.
         Backward is the same bridge in reverse carrying the input
         gradient (`tape.gradient(..., output_gradients=...)`). Exact
         match with the reference. Each host must build tensors only on
         its own sub-mesh (pack on the other one crashes), both hosts call
         every bridge in the same order, and a scalar loss needs an
         explicit DTensor `output_gradients` (the default ones is a plain
         tensor: "The op/function Mul got a regular tensor ...").

(d) DTensor numbers the collective groups of the programs each client
    compiles, in order, per client (group_key 0, 1, ...). A function with
    a collective inside the host-0 mesh run by host 0 alone shifts host
    0's numbering, and the next full-mesh collective FAILS on both hosts
    (host 1: "Device ... is joining a group with size2, but that group has
    size 4 (group_key=0)"; host 0 then "tasks are unhealthy"). WORKS: both
    hosts run the function (on host 1 a no-op, as in (b)), then the
    full-mesh collective.

(e) Corollary of (d), not a case of this script: DTensor compiles a
    function again the first time the value of a small replicated int32,
    int64 or float32 input changes (it folds such values into the
    program). The host holding a stage sees its values change, the other
    host's stand-ins never do, so the holder alone compiles the stage's
    step twice and its collective keys drift from the other host's: the
    next program both compile hangs. tfpar passes such inputs as their
    bits (`cross_host.SmallTensorsAsBits`); the recompilation is pinned by
    `tests/test_hosts_pipeline.py::test_dtensor_compiles_again_when_a_
    small_input_changes`.

What tfpar does (tfpar/pipeline/cross_host.py, tests/test_hosts_pipeline.py):
the bridge (2), keeping tfpar's heterogeneous stages, sub-meshes and
schedules. `Mesh` builds a stage's sub-mesh (one host's devices, whole
hosts', or the same devices of several hosts) on every host; the step is
a host-driven loop over the schedule's actions, each F / B a
`tf.function` on its stage's sub-mesh that EVERY host runs (d) --
computed by the hosts holding it, a no-op elsewhere, where values
are stand-ins of the right layout (`call_with_layout(tf.zeros, ...)`:
packing [] crashes, (b)); each cross-host move is the bridge, block by
block over a {"tfpar_hosts", "tfpar_local"} mesh of every device; each
backward recomputes its forward (a tape cannot outlive a `tf.function`);
reads (`get_weights`, logs, predictions) are the holders' values summed
with zeros over every device. The SPMD route (1) fits only models of
identical blocks (GPT-style stacks): a separate "stacked stages" mode,
not today's PipelineModel.
"""

import argparse
import os
import signal
import subprocess
import sys
import traceback

CASES = {}
CRASHING = {"b_pack_remote", "c_copy_to_full_mesh_function",
            "c_relayout_to_full_mesh_eager"}  # host 1: SIGSEGV
HOST_TIMEOUT = 150  # seconds per 2-host case (TF start-up ~15 s each)


def case(function):
    CASES[function.__name__] = function
    return function


def say(*words):
    print("RESULT", *words, flush=True)


# --- the cases (run on each host) ------------------------------------------


def setup():
    """Joins the cluster; (tf, np, dtensor, host, meshes)."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import tfpar  # noqa: PLC0415 (connect_hosts / use_virtual_cpus only)

    tfpar.connect_hosts(timeout=120)
    import numpy as np  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415
    from tensorflow.experimental import dtensor  # noqa: PLC0415

    host, per_host = dtensor.client_id(), dtensor.num_local_devices("CPU")
    job = dtensor.job_name()

    def spec(i):
        return (f"/job:{job}/replica:0/task:{i // per_host}/device:CPU:"
                f"{i % per_host}")

    def mesh(dims, ids):
        """A mesh over global device `ids` (consecutive), valid on every
        host: its local lists hold this host's devices, maybe none."""
        ids = list(ids)
        local = [i for i in ids if i // per_host == host]
        return dtensor.Mesh(
            [name for name, _ in dims],
            np.array(ids).reshape([size for _, size in dims]), local,
            [spec(i) for i in local], global_devices=[spec(i) for i in ids])

    meshes = {"full": mesh([("pipe", 2), ("data", 4)], range(8)),
              0: mesh([("data", 4)], range(0, 4)),
              1: mesh([("data", 4)], range(4, 8))}
    return tf, np, dtensor, host, meshes


def reference(tf, x, w0, w1):
    """Single-process loss and weight gradients of the 2-stage model
    loss = sum(tanh(tanh(x @ w0) @ w1) ** 2)."""
    ws = [tf.Variable(w0), tf.Variable(w1)]
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.tanh(tf.tanh(x @ ws[0]) @ ws[1]) ** 2)
    return float(loss), [g.numpy() for g in tape.gradient(loss, ws)]


def data(np):
    rng = np.random.RandomState(0)
    return (rng.randn(8, 3).astype("float32"),
            rng.randn(3, 3).astype("float32"),
            rng.randn(3, 3).astype("float32"))


@case
def a_meshes():
    """(a) the host-0 and host-1 sub-meshes (and the full mesh) on both."""
    _, _, _, host, meshes = setup()
    say(f"works: host {host} built all meshes; local ids: host-0 mesh "
        f"{meshes[0].local_device_ids()}, host-1 mesh "
        f"{meshes[1].local_device_ids()}, full {meshes['full'].local_device_ids()}")


@case
def b_eager():
    """(b) eager ops on the host-0 mesh, then unpack, on both hosts."""
    tf, _, dtensor, host, meshes = setup()
    x = dtensor.call_with_layout(tf.ones, dtensor.Layout.replicated(
        meshes[0], 2), shape=[8, 3])
    y = tf.reduce_sum(x * 2.0)
    parts = dtensor.unpack(y)  # raises on host 1
    say(f"works: sum on host-0 mesh = {float(parts[0])}")


@case
def b_function():
    """(b) a tf.function with a collective inside the host-0 mesh."""
    tf, _, dtensor, host, meshes = setup()
    m0 = meshes[0]
    x = dtensor.call_with_layout(tf.ones, dtensor.Layout.replicated(m0, 2),
                                 shape=[8, 3])

    @tf.function
    def f(x):  # batch-split then a full reduction: an all-reduce over "data"
        return tf.reduce_sum(dtensor.relayout(
            x, dtensor.Layout.batch_sharded(m0, "data", 2)) * 2.0)

    y = f(x)
    if meshes[0].local_device_ids():
        say(f"works: function on host-0 mesh = {float(dtensor.unpack(y)[0])}")
    else:
        say("works: returned at once (no-op) on the host owning none of "
            "the mesh")


@case
def b_mixed_function():
    """(b) one tf.function with independent work on both sub-meshes."""
    tf, _, dtensor, host, meshes = setup()
    xs = [dtensor.call_with_layout(tf.ones, dtensor.Layout.batch_sharded(
        meshes[s], "data", 2), shape=[8, 3]) for s in (0, 1)]

    @tf.function
    def f(a, b):
        return tf.reduce_sum(a * 2.0), tf.reduce_sum(b * 3.0)

    out = f(*xs)
    say(f"works: this host's part = {float(dtensor.unpack(out[host])[0])} "
        f"(expected {48.0 if host == 0 else 72.0})")


@case
def b_pack_remote():
    """dtensor.pack of [] onto the mesh owned by the other host."""
    tf, _, dtensor, host, meshes = setup()
    other = meshes[1 - host]
    dtensor.pack([], dtensor.Layout.replicated(other, 2))
    say("works: pack([]) onto the other host's mesh")


def _on_m0(tf, dtensor, meshes):
    return dtensor.call_with_layout(tf.ones, dtensor.Layout.replicated(
        meshes[0], 2), shape=[8, 3])


@case
def c_copy_to_mesh_eager():
    """(c) dtensor.copy_to_mesh host-0 mesh -> host-1 mesh, eager."""
    tf, _, dtensor, host, meshes = setup()
    y = dtensor.copy_to_mesh(_on_m0(tf, dtensor, meshes),
                             dtensor.Layout.replicated(meshes[1], 2))
    if host == 1:
        say(f"works: sum on host 1 = {float(tf.reduce_sum(dtensor.unpack(y)[0]))}")
    else:
        say("works: returned")


@case
def c_copy_to_mesh_function():
    """(c) copy_to_mesh host-0 mesh -> host-1 mesh inside a tf.function."""
    tf, _, dtensor, host, meshes = setup()

    @tf.function
    def f(x):
        return tf.reduce_sum(dtensor.copy_to_mesh(
            x * 3.0, dtensor.Layout.replicated(meshes[1], 2)))

    y = f(_on_m0(tf, dtensor, meshes))
    say("works" + (f": {float(dtensor.unpack(y)[0])}" if host == 1 else ""))


@case
def c_copy_to_full_mesh_function():
    """(c) copy_to_mesh host-0 mesh -> the full 8-device mesh (function)."""
    tf, _, dtensor, host, meshes = setup()

    @tf.function
    def f(x):
        return tf.reduce_sum(dtensor.copy_to_mesh(
            x, dtensor.Layout.replicated(meshes["full"], 2)))

    y = f(_on_m0(tf, dtensor, meshes))
    say(f"works: {float(dtensor.unpack(y)[0])}")


@case
def c_relayout_to_full_mesh_eager():
    """(c) dtensor.relayout host-0 mesh -> full mesh, eager."""
    tf, _, dtensor, host, meshes = setup()
    y = dtensor.relayout(_on_m0(tf, dtensor, meshes),
                         dtensor.Layout.replicated(meshes["full"], 2))
    say(f"works: {float(tf.reduce_sum(dtensor.unpack(y)[0]))}")


@case
def c_spmd_full_mesh():
    """(c) SPMD pipeline on the full mesh, one tf.function, fwd + bwd.

    Forward + backward against the single-process reference."""
    tf, np, dtensor, host, meshes = setup()
    full = meshes["full"]
    x, w0, w1 = data(np)
    by_stage = dtensor.Layout(["pipe", "unsharded", "unsharded"], full)
    everywhere = dtensor.Layout.replicated(full, 3)

    def put(array, layout):
        return dtensor.relayout(dtensor.copy_to_mesh(
            tf.constant(array), dtensor.Layout.replicated(
                full, array.ndim)), layout)

    w = dtensor.DVariable(put(np.stack([w0, w1]), by_stage))
    slots = put(np.stack([x, np.zeros_like(x)]), by_stage)  # stage 0's input
    # next[q] = this[q - 1]: tf.roll / tf.concat on the sharded axis fail.
    shift = put(np.array([[0, 0], [1, 0]], "float32"),
                dtensor.Layout.replicated(full, 2))

    def stages(h):  # every stage on its own slot: local to its host
        return tf.tanh(tf.einsum("pbd,pde->pbe", h, w))

    @tf.function
    def step(slots):
        with tf.GradientTape() as tape:
            h = stages(slots)
            # stage 0 -> stage 1: all-gather over "pipe" (across the hosts)
            h = dtensor.relayout(tf.einsum(
                "qp,pbd->qbd", shift, dtensor.relayout(h, everywhere)),
                by_stage)
            out = dtensor.relayout(stages(h), everywhere)[1]
            loss = tf.reduce_sum(out ** 2)
        return loss, dtensor.relayout(tape.gradient(loss, w), everywhere)

    loss, grads = step(slots)
    loss = float(dtensor.unpack(loss)[0])
    grads = dtensor.unpack(grads)[0].numpy()
    ref_loss, ref_grads = reference(tf, x, w0, w1)
    error = max(abs(grads[s] - ref_grads[s]).max() for s in (0, 1))
    ok = abs(loss - ref_loss) < 1e-4 and error < 1e-4
    say(f"{'works' if ok else 'WRONG'}: loss {loss:.6f} (reference "
        f"{ref_loss:.6f}), max weight-gradient error {error:.2e}")


@case
def c_bridge():
    """(c) bridge: sub-mesh stages, full-mesh all-gather carries x and dx.

    Stages on their own host's sub-mesh (tf.functions), the activation and
    its gradient carried by a full-mesh all-gather; forward + backward
    against the single-process reference."""
    tf, np, dtensor, host, meshes = setup()
    full = meshes["full"]
    x, w0, w1 = data(np)
    slot_layout = dtensor.Layout(["pipe", "unsharded", "unsharded"], full)
    gather = tf.function(lambda t: dtensor.relayout(
        t, dtensor.Layout.replicated(full, 3)))

    def send(value, src, shape):
        """`value` (replicated on stage `src`'s mesh; None on the other
        host) -> this host's components of it. Both hosts call it."""
        if host == src:
            parts = [tf.expand_dims(c, 0) for c in dtensor.unpack(value)]
        else:
            parts = [tf.zeros([1, *shape])] * len(
                full.local_device_ids())
        whole = gather(dtensor.pack(parts, slot_layout))  # slot = host id
        return [c[src] for c in dtensor.unpack(whole)]

    def put(array, s):
        return dtensor.copy_to_mesh(tf.constant(array), dtensor.Layout(
            ["unsharded"] * array.ndim, meshes[s]))

    def replicated(s, rank):
        return dtensor.Layout.replicated(meshes[s], rank)

    results = {}
    if host == 0:  # stage 0 lives on host 0 only
        v0, x0 = dtensor.DVariable(put(w0, 0)), put(x, 0)
        forward0 = tf.function(lambda x: tf.tanh(x @ v0))

        @tf.function
        def backward0(x, dy):
            with tf.GradientTape() as tape:
                y = tf.tanh(x @ v0)
            return tape.gradient(y, v0, output_gradients=dy)

        y0 = forward0(x0)
    else:
        y0 = None
    received = send(y0, 0, [8, 3])
    if host == 1:  # stage 1 lives on host 1 only
        v1 = dtensor.DVariable(put(w1, 1))

        @tf.function
        def step1(y):
            with tf.GradientTape() as tape:
                tape.watch(y)
                z = tf.tanh(y @ v1)
                loss = tf.reduce_sum(z * z)
            one = dtensor.call_with_layout(tf.ones, replicated(1, 0),
                                           shape=[])
            g, dy = tape.gradient(loss, [v1, y], output_gradients=one)
            return loss, g, dy

        loss, g1, dy = step1(dtensor.pack(received, replicated(1, 2)))
        results = {"loss": float(dtensor.unpack(loss)[0]),
                   1: dtensor.unpack(g1)[0].numpy()}
    else:
        dy = None
    returned = send(dy, 1, [8, 3])
    if host == 0:
        g0 = backward0(x0, dtensor.pack(returned, replicated(0, 2)))
        results[0] = dtensor.unpack(g0)[0].numpy()
    ref_loss, ref_grads = reference(tf, x, w0, w1)
    error = abs(results[host] - ref_grads[host]).max()
    text = f"stage {host} weight-gradient error {error:.2e}"
    ok = error < 1e-4
    if host == 1:
        ok = ok and abs(results["loss"] - ref_loss) < 1e-4
        text = (f"loss {results['loss']:.6f} (reference {ref_loss:.6f}), "
                + text)
    say(f"{'works' if ok else 'WRONG'}: {text}")


def _collective_then_bridge(tf, np, dtensor, host, meshes, everywhere):
    """A function with a collective inside the host-0 mesh (an all-gather
    over "data"), run by host 0 only or (`everywhere`) by both hosts, then
    an all-gather over "pipe" on the full mesh run by both."""
    m0, full = meshes[0], meshes["full"]
    x = dtensor.call_with_layout(tf.ones, dtensor.Layout.batch_sharded(
        m0, "data", 2), shape=[8, 3])
    on_m0 = tf.function(lambda t: tf.reduce_sum(dtensor.relayout(
        t, dtensor.Layout.replicated(m0, 2)) * 2.0))
    if everywhere or host == 0:
        on_m0(x)  # host 1: returns at once, holding nothing
    slots = dtensor.Layout(["pipe", "unsharded"], full)
    parts = [tf.fill([1, 3], float(host + 1))] * len(full.local_device_ids())
    whole = tf.function(lambda t: dtensor.relayout(
        t, dtensor.Layout.replicated(full, 2)))(dtensor.pack(parts, slots))
    got = dtensor.unpack(whole)[0].numpy()[:, 0].tolist()
    say(f"{'works' if got == [1.0, 2.0] else 'WRONG'}: full-mesh gather "
        f"gave {got}")


@case
def d_collective_on_owner_only():
    """(d) a sub-mesh collective on its owner only, then a full-mesh one."""
    _collective_then_bridge(*setup(), everywhere=False)


@case
def d_collective_on_every_host():
    """(d) the same sub-mesh function run by both hosts, then the full one."""
    _collective_then_bridge(*setup(), everywhere=True)


# --- the driver ------------------------------------------------------------


def run_case(name):
    """Runs `name` on 2 hosts; {host: outcome}."""
    command = [sys.executable, "-m", "tfpar.launch", "--hosts", "2",
               "--virtual-cpus", "4", os.path.abspath(__file__),
               "--case", name]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ,
           "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    process = subprocess.Popen(command, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env,
                               start_new_session=True, cwd=root)
    try:
        output, _ = process.communicate(timeout=HOST_TIMEOUT)
        hung = False
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the launcher and its hosts
        output, _ = process.communicate()
        hung = True
    outcomes = {}
    for line in output.splitlines():
        for host in (0, 1):
            prefix = f"[host {host}] "
            if line.startswith(prefix + "RESULT "):
                outcomes[host] = line[len(prefix + "RESULT "):]
        if line.startswith("[launch] host ") and "status -" in line:
            host = int(line.split()[2])
            code = int(line.rsplit("-", 1)[1])
            outcomes.setdefault(
                host, f"CRASH ({signal.Signals(code).name})")
    for host in (0, 1):
        outcomes.setdefault(host, "HANG (killed after "
                            f"{HOST_TIMEOUT} s)" if hung else
                            "no result (killed by the launcher after the "
                            "other host failed)")
    return outcomes


def host_main(name):
    try:
        CASES[name]()
    except Exception as error:  # noqa: BLE001 (reported)
        first = (str(error).strip().splitlines() or [""])[0]
        say(f"ERROR {type(error).__name__}: {first[:300]}")
        if os.environ.get("REPRO_TRACEBACK"):
            traceback.print_exc()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", help="(internal) run one case as a host")
    parser.add_argument("cases", nargs="*", help=f"of {list(CASES)}")
    options = parser.parse_args()
    if options.case:
        host_main(options.case)
        return
    if "TFPAR_HOST_ID" in os.environ:  # under `python -m tfpar.launch`:
        # every case in this one cluster, minus those that kill the process
        # (run without the launcher for them, one cluster per case)
        # (the working routes before the failing copies, which may leave
        # the cluster in a bad state)
        names = options.cases or sorted(
            (c for c in CASES if c not in CRASHING),
            key=lambda c: c.startswith("c_copy"))
        for name in names:
            print(f"{name}: {CASES[name].__doc__.splitlines()[0]}")
            host_main(name)
        return
    for name in options.cases or CASES:
        outcomes = run_case(name)
        print(f"{name}: {CASES[name].__doc__.splitlines()[0]}")
        for host in (0, 1):
            print(f"    host {host}: {outcomes[host]}", flush=True)


if __name__ == "__main__":
    main()
