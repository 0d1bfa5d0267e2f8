"""Several hosts (processes) as one cluster of devices: DTensor multi-client.

Every host runs the same program on the same data (or, with
`ParallelStrategy(per_host_input=True)`, on its own share of it). Each calls
`connect_hosts` first thing (on CPU after `tfpar.use_virtual_cpus`), then
`tfpar.Mesh(...)` spans the devices of all hosts (global device i is device
i mod L of host i // L, L devices per host), and `ParallelStrategy`, `fit`,
`evaluate`, `predict` and `get_weights` work as on one host: every
collective spans the hosts, and each host feeds its own devices' blocks of
every global batch, which it cuts from its own copy of that batch.

So every host must read the same batches in the same order: the same
arrays or files, and, when shuffling (Keras' `fit` shuffles arrays by
default), the same seed: call `keras.utils.set_random_seed(s)` with one `s`
on every host. Initial weights need no seed: tfpar gives every host host
0's initial values (one collective per new variable), and values assigned
from the host (`set_weights`, `load_weights`, `variable.assign(array)`)
likewise: such assignments are collectives, make them on every host.

Calls that read weights back (`get_weights`, `numpy()`, `save_weights`,
`model.save`) are collectives too: make them on every host, in the same
order (a call on host 0 alone waits forever for the others); each host
then writes its own file. `tfpar.save_checkpoint` / `restore_checkpoint`
also run on every host, with one directory all hosts see: each host
writes its own devices' blocks, host 0 the manifest.

Example (two processes; in the second, `host_id=1`):

>>> import tfpar
>>> tfpar.use_virtual_cpus(4)                       # CPU demos and tests
>>> tfpar.connect_hosts(["localhost:23451", "localhost:23452"], host_id=0)
>>> strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}))

Pipeline stages may live on different hosts (with the pipe axis first,
along the hosts, each stage's sub-mesh is one host's devices or whole
hosts'; with the data axis first, every host holds a part of every stage)
and `PipelineModel` trains with a host-driven step
(`tfpar.pipeline.cross_host`). A mesh may also use the same local
devices of every host (e.g. CPU:0-3 of each, the rest for
`offload_devices`: each host keeps its blocks' optimizer state on its own
CPUs, `tfpar.offload`; each stage's on its own hosts'). Not across
hosts: other meshes over a subset or a reordering of the devices (`Mesh`
refuses them on every host);
`visualize_layout` and `summary` show this host's devices only. Host names or IPv4 addresses only
(no IPv6). Tested only with processes on one machine (`tests/test_hosts.py`).
"""

import json
import os
import re
import time

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import _compat
from tfpar import host_auth
from tfpar import host_watch
from tfpar import mesh
from tfpar.host_watch import LOST_HOST_EXIT_CODE  # noqa: F401 (public)

_ADDRESS = re.compile(r"^[A-Za-z0-9_.\-]+:(\d{1,5})$")
_connected = None  # (addresses, host_id, job_name) once connected


def connect_hosts(addresses=None, host_id=None, job_name="worker",
                  timeout=300, heartbeat_timeout=None):
    """Joins this process to a cluster of hosts as host `host_id`.

    With no arguments the cluster comes from the environment, so one script
    runs unchanged under `python -m tfpar.launch`, a scheduler or alone:
    `TFPAR_HOSTS` ("host:port,host:port,...") and `TFPAR_HOST_ID` (set by
    `tfpar.launch`, or by your job script), else DTensor's own
    `DTENSOR_JOBS` and `DTENSOR_CLIENT_ID`, else `TF_CONFIG` (its
    `cluster` "chief" then "worker" addresses, and `task`); with none of
    them set, this is the only host and nothing happens (returns 1).
    `TFPAR_VIRTUAL_CPUS=k` (set by `tfpar.launch --virtual-cpus k`) first
    calls `tfpar.use_virtual_cpus(k)`.

    A host that dies (killed, or stopped: SIGSTOP) would leave the others
    waiting forever inside a collective, as in TF itself. So every host
    also pings every other one each second; one that has not answered for
    `heartbeat_timeout` seconds is lost: each remaining host prints an
    error naming it to stderr and exits with status 70
    (`LOST_HOST_EXIT_CODE`), from inside whatever collective it waits in.
    A host that leaves normally tells the others first (no error); one
    that ends with an uncaught exception tells them too, and they exit
    with the same error naming it. A host seen alive whose heartbeat port
    then refuses connections is lost at once.

    tfpar's own messages (this handshake, the heartbeats) are bound to this
    host's address from `addresses` (127.0.0.1 when all are localhost;
    `TFPAR_BIND_ADDRESS` overrides) and authenticated with the job secret
    `TFPAR_JOB_SECRET` (the same on every host; `tfpar.launch` sets one;
    without it tfpar warns once): see `tfpar.host_auth` and the security
    section of docs/guides/hosts.md. TensorFlow's own server on the same
    port is not protected: trusted, isolated networks only.

    Sets DTensor's multi-client environment (`DTENSOR_JOBS`,
    `DTENSOR_CLIENT_ID`, `DTENSOR_NUM_CLIENTS`, `DTENSOR_JOB_NAME`) and
    initialises it (`tf.experimental.dtensor.initialize_accelerator_system`)
    on this host's GPUs, else its CPUs. Before that every host checks that
    all others are up (a TCP handshake on the same ports; TF's cluster setup
    would otherwise wait forever on host 0 for a host that never comes), so
    it returns once every host has connected: start all of them. Calling it
    again with the same arguments does nothing. (TPU pods: use
    `tfpar.connect_tpu`.)

    Args:
        addresses: "host:port" of every host, the same list on all of
            them; host i listens on addresses[i]. None: from the
            environment (see above).
        host_id: this host's index in `addresses` (None with
            `addresses=None`).
        job_name: the TensorFlow job name of the cluster.
        timeout: seconds to wait for all hosts to come up.
        heartbeat_timeout: seconds of silence after which a host counts as
            lost (default: `TFPAR_HEARTBEAT_TIMEOUT`, else 60).

    Returns:
        The number of hosts.

    Raises:
        ValueError / TypeError: a malformed address list or host id.
        TimeoutError: some host did not come up within `timeout` seconds
            (it names them).
        RuntimeError: TensorFlow was initialised before, or the cluster
            could not be set up; or called again with other arguments.
    """
    global _connected
    if addresses is None and host_id is None:
        found = cluster_from_environment()
        if found is None:
            return 1  # one host: nothing to join
        addresses, host_id = found
    if heartbeat_timeout is None:
        heartbeat_timeout = float(os.environ.get("TFPAR_HEARTBEAT_TIMEOUT",
                                                 60))
    _check_cluster(addresses, host_id, job_name, timeout, heartbeat_timeout)
    request = (tuple(addresses), host_id, job_name)
    if _connected is not None:
        if _connected == request:
            return len(addresses)
        raise RuntimeError(
            f"connect_hosts() already joined the cluster {list(_connected[0])} "
            f"as host {_connected[1]}; a process joins one cluster once. "
            f"Received: addresses={list(addresses)!r}, host_id={host_id}")
    if _compat.tf_initialized():
        # Before the handshake: once it passes, the other hosts wait in
        # TF's cluster setup for this one.
        raise RuntimeError(
            "connect_hosts() must run before TensorFlow initialises (before "
            "any op, model, Mesh or device listing; after "
            "tfpar.use_virtual_cpus is fine). Received: a call after "
            "TensorFlow started. Move it to the top of the program.")
    watch = None
    if len(addresses) > 1:
        watch = host_watch.Watch(list(addresses), host_id, heartbeat_timeout)
        try:
            peers = _wait_for_hosts(list(addresses), host_id, timeout,
                                    heartbeat_port=watch.port)
        except BaseException:
            watch.close()
            raise
    _initialize_dtensor_cluster(addresses, host_id, job_name)
    _connected = request
    if watch is not None:
        watch.start(peers)
    return len(addresses)


def _is_positive_seconds(value):
    return not isinstance(value, bool) and isinstance(
        value, (int, float)) and value > 0


def _check_cluster(addresses, host_id, job_name, timeout, heartbeat_timeout):
    """Raises on a malformed argument of `connect_hosts`."""
    if not _is_positive_seconds(heartbeat_timeout):
        raise ValueError(
            "connect_hosts(heartbeat_timeout) needs a number of seconds > 0. "
            f"Received: heartbeat_timeout={heartbeat_timeout!r}")
    if isinstance(addresses, (str, bytes)) or not isinstance(
            addresses, (list, tuple)) or not addresses:
        raise TypeError(
            "connect_hosts(addresses) needs a non-empty list of 'host:port' "
            f"strings, one per host. Received: addresses={addresses!r}")
    bad = [a for a in addresses if not isinstance(a, str)
           or not _ADDRESS.match(a)
           or not 1 <= int(_ADDRESS.match(a)[1]) <= 65535]
    if bad:
        raise ValueError(
            "connect_hosts(addresses) needs 'host:port' strings: a host name "
            "or IPv4 address and a port in 1..65535 (e.g. "
            f"'10.0.0.2:23451'). Received: {bad[0]!r} in addresses="
            f"{list(addresses)!r}")
    if len(set(addresses)) != len(addresses):
        raise ValueError(
            "connect_hosts(addresses) lists an address twice. Received: "
            f"addresses={list(addresses)!r}")
    if isinstance(host_id, bool) or not isinstance(host_id, int) or not (
            0 <= host_id < len(addresses)):
        raise ValueError(
            f"connect_hosts(host_id) needs an int in [0, {len(addresses)}) "
            f"(this host's index in addresses). Received: host_id={host_id!r}")
    if not _is_positive_seconds(timeout):
        raise ValueError(
            "connect_hosts(timeout) needs a number of seconds > 0. "
            f"Received: timeout={timeout!r}")
    if not isinstance(job_name, str) or not job_name.isidentifier():
        raise ValueError(
            "connect_hosts(job_name) needs an identifier like 'worker'. "
            f"Received: job_name={job_name!r}")


_DTENSOR_CLUSTER_VARIABLES = ("DTENSOR_JOBS", "DTENSOR_CLIENT_ID",
                              "DTENSOR_NUM_CLIENTS", "DTENSOR_JOB_NAME")


def _initialize_dtensor_cluster(addresses, host_id, job_name):
    """Sets DTensor's multi-client environment and initialises it on this
    host's GPUs, else its CPUs (the variables are unset again on failure)."""
    values = (",".join(addresses), str(host_id), str(len(addresses)),
              job_name)
    os.environ.update(zip(_DTENSOR_CLUSTER_VARIABLES, values))
    # Physical devices only: listing logical ones would initialise TF.
    device_type = "GPU" if tf.config.list_physical_devices("GPU") else "CPU"
    try:
        dtensor.initialize_accelerator_system(device_type)
    except Exception as error:  # noqa: BLE001 (re-raised with a hint)
        for name in _DTENSOR_CLUSTER_VARIABLES:
            os.environ.pop(name, None)
        raise RuntimeError(
            f"connect_hosts() could not set up the cluster {list(addresses)} "
            f"as host {host_id} ({type(error).__name__}: {error}). Call it "
            "first thing in the program (after tfpar.use_virtual_cpus), "
            "before any TensorFlow op, and check that the addresses are "
            "free and reachable.") from error


def cluster_from_environment():
    """(addresses, host_id) from TFPAR_*, DTENSOR_* or TF_CONFIG, else None.

    Also calls `use_virtual_cpus` when `TFPAR_VIRTUAL_CPUS` is set.
    """
    environ = os.environ
    if "TFPAR_VIRTUAL_CPUS" in environ:
        mesh.use_virtual_cpus(_int_setting("TFPAR_VIRTUAL_CPUS"))
    for hosts_name, id_name in (("TFPAR_HOSTS", "TFPAR_HOST_ID"),
                                ("DTENSOR_JOBS", "DTENSOR_CLIENT_ID")):
        if hosts_name in environ:
            if id_name not in environ:
                raise ValueError(
                    f"{hosts_name} is set ({environ[hosts_name]!r}) but "
                    f"{id_name} is not. Set {id_name} to this host's index "
                    f"in {hosts_name}.")
            return environ[hosts_name].split(","), _int_setting(id_name)
    if "TF_CONFIG" in environ:
        try:
            config = json.loads(environ["TF_CONFIG"])
            cluster = config["cluster"]
            addresses = list(cluster.get("chief", [])) + list(
                cluster.get("worker", []))
            task = config["task"]
            offset = 0 if task["type"] == "chief" else len(
                cluster.get("chief", []))
            return addresses, offset + int(task["index"])
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(
                'TF_CONFIG must be JSON like {"cluster": {"worker": '
                '["host:port", ...]}, "task": {"type": "worker", "index": 0}} '
                f"({type(error).__name__}: {error}). "
                f"Received: TF_CONFIG={environ['TF_CONFIG']!r}") from None
    return None


def _int_setting(name):
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"The environment variable {name} needs an integer. Received: "
            f"{name}={value!r}") from None


def _wait_for_hosts(addresses, host_id, timeout, heartbeat_port=0):
    """Returns once this host has reached every other host's port and been
    reached by every other host; raises TimeoutError naming the missing.

    Each host serves its own cluster port (`host_auth.Server`, on this
    host's address; TF's server binds it afterwards) and sends every other
    one "join <its heartbeat port>" (authenticated, see `host_auth`); a
    host counts as reached when it answers "ok" (else it is asked again).
    A host that has both reached and heard everyone is done; every other
    host has then reached it too, so none waits on a closed port. Returns
    {other host id: its heartbeat port}.
    """
    n = len(addresses)
    heard, reached = {host_id}, {host_id}
    heartbeat_ports = {}

    def joined(sender, word, arg):
        if word != "join" or not 0 < arg < 65536:
            return "no", 0
        heartbeat_ports[sender] = arg
        heard.add(sender)
        return "ok", 0

    server = _serve(addresses, host_id, joined)
    deadline = time.monotonic() + timeout
    try:
        while len(reached) < n or len(heard) < n:
            if time.monotonic() > deadline:
                missing = sorted(set(range(n)) - (reached & heard))
                raise TimeoutError(
                    f"connect_hosts(): host {host_id} waited {timeout} s for "
                    f"hosts {missing} ({[addresses[i] for i in missing]}). "
                    "Start the same program on every host, with its own "
                    f"host_id, the same addresses and the same "
                    f"{host_auth.SECRET_VARIABLE}.")
            reached.update(
                i for i in sorted(set(range(n)) - reached)
                if _reach(addresses, host_id, i, heartbeat_port))
            time.sleep(0.05)
    finally:
        server.close()
    return heartbeat_ports


def _serve(addresses, host_id, handler):
    """A `host_auth.Server` on this host's cluster port."""
    _, port = addresses[host_id].rsplit(":", 1)
    try:
        return host_auth.Server(addresses, host_id, int(port), handler)
    except OSError as error:
        raise RuntimeError(
            f"connect_hosts(): host {host_id} cannot listen on "
            f"{addresses[host_id]} ({error}). Choose a free port.") from None


def _reach(addresses, host_id, other, heartbeat_port):
    """Whether host `other` answered "ok" to this host's join."""
    try:
        answer = host_auth.request(addresses, host_id, other, "join",
                                   heartbeat_port)
    except host_auth.Refused:
        return False
    return answer == ("ok", 0)


def num_hosts():
    """Hosts in the cluster (1 without `connect_hosts`)."""
    return dtensor.num_clients()


def host_id():
    """This host's index (0 without `connect_hosts`)."""
    return dtensor.client_id()
