"""Several hosts (processes) as one cluster of devices: DTensor multi-client.

Every host runs the same program on the same data. Each calls
`connect_hosts` first thing (on CPU after `tfpar.use_virtual_cpus`), then
`tfpar.Mesh(...)` spans the devices of all hosts (global device i is device
i mod L of host i // L, L devices per host), and `ParallelStrategy`, `fit`,
`evaluate`, `predict` and `get_weights` work as on one host: each host feeds
its own devices' blocks of every global batch, which it cuts from the same
host batch (so every host must read the same batches in the same order:
the same files and shuffle seed, or arrays), and every collective spans the
hosts.

Example (two processes; in the second, `host_id=1`):

>>> import tfpar
>>> tfpar.use_virtual_cpus(4)                       # CPU demos and tests
>>> tfpar.connect_hosts(["localhost:23451", "localhost:23452"], host_id=0)
>>> strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}))

Keras `save_weights`/`model.save` gather every weight on every host (a
collective per variable): call them on all hosts, each with its own path.
Not yet across hosts: pipeline stages (a stage's sub-mesh would leave some
hosts without devices: `Mesh` refuses), sharded checkpoints
(`tfpar.save_checkpoint` refuses); tested only with processes on one
machine (`tests/test_hosts.py`).
"""

import os
import re
import socket
import time

import tensorflow as tf
from tensorflow.experimental import dtensor

_ADDRESS = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:\d{1,5}$")
_connected = None  # (addresses, host_id, job_name) once connected


def connect_hosts(addresses, host_id, job_name="worker", timeout=300):
    """Joins this process to a cluster of hosts as host `host_id`.

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
            them; host i listens on addresses[i].
        host_id: this host's index in `addresses`.
        job_name: the TensorFlow job name of the cluster.
        timeout: seconds to wait for all hosts to come up.

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
    if isinstance(addresses, (str, bytes)) or not isinstance(
            addresses, (list, tuple)) or not addresses:
        raise TypeError(
            "connect_hosts(addresses) needs a non-empty list of 'host:port' "
            f"strings, one per host. Received: addresses={addresses!r}")
    bad = [a for a in addresses if not isinstance(a, str)
           or not _ADDRESS.match(a)]
    if bad:
        raise ValueError(
            "connect_hosts(addresses) needs 'host:port' strings (e.g. "
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
    if not isinstance(job_name, str) or not job_name.isidentifier():
        raise ValueError(
            "connect_hosts(job_name) needs an identifier like 'worker'. "
            f"Received: job_name={job_name!r}")
    request = (tuple(addresses), host_id, job_name)
    if _connected is not None:
        if _connected == request:
            return len(addresses)
        raise RuntimeError(
            f"connect_hosts() already joined the cluster {list(_connected[0])} "
            f"as host {_connected[1]}; a process joins one cluster once. "
            f"Received: addresses={list(addresses)!r}, host_id={host_id}")
    if len(addresses) > 1:
        _wait_for_hosts(list(addresses), host_id, timeout)
    os.environ["DTENSOR_JOBS"] = ",".join(addresses)
    os.environ["DTENSOR_CLIENT_ID"] = str(host_id)
    os.environ["DTENSOR_NUM_CLIENTS"] = str(len(addresses))
    os.environ["DTENSOR_JOB_NAME"] = job_name
    # Physical devices only: listing logical ones would initialise TF.
    device_type = "GPU" if tf.config.list_physical_devices("GPU") else "CPU"
    try:
        dtensor.initialize_accelerator_system(device_type)
    except Exception as error:  # noqa: BLE001 (re-raised with a hint)
        for name in ("DTENSOR_JOBS", "DTENSOR_CLIENT_ID",
                     "DTENSOR_NUM_CLIENTS", "DTENSOR_JOB_NAME"):
            os.environ.pop(name, None)
        raise RuntimeError(
            f"connect_hosts() could not set up the cluster {list(addresses)} "
            f"as host {host_id} ({type(error).__name__}: {error}). Call it "
            "first thing in the program (after tfpar.use_virtual_cpus), "
            "before any TensorFlow op, and check that the addresses are "
            "free and reachable.") from error
    _connected = request
    return len(addresses)


def _wait_for_hosts(addresses, host_id, timeout):
    """Returns once this host has reached every other host's port and been
    reached by every other host; raises TimeoutError naming the missing.

    Each host listens on its own port (TF's server binds it afterwards) and
    connects to every other one, sending its id. A host that has both
    reached and heard everyone is done; the others have then reached it
    too, so none waits on a closed port.
    """
    n = len(addresses)
    _, port = addresses[host_id].rsplit(":", 1)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(("", int(port)))
    except OSError as error:
        listener.close()
        raise RuntimeError(
            f"connect_hosts(): host {host_id} cannot listen on "
            f"{addresses[host_id]} ({error}). Choose a free port.") from None
    listener.listen(n)
    listener.settimeout(0.2)
    reached, heard = {host_id}, {host_id}
    deadline = time.monotonic() + timeout
    try:
        while len(reached) < n or len(heard) < n:
            if time.monotonic() > deadline:
                missing = sorted((set(range(n)) - reached) | (set(range(n)) - heard))
                raise TimeoutError(
                    f"connect_hosts(): host {host_id} waited {timeout} s for "
                    f"hosts {missing} ({[addresses[i] for i in missing]}). "
                    "Start the same program on every host, with its own "
                    "host_id and the same addresses.")
            for i in set(range(n)) - reached:
                name, other_port = addresses[i].rsplit(":", 1)
                try:
                    with socket.create_connection((name, int(other_port)),
                                                  timeout=0.5) as connection:
                        connection.sendall(f"tfpar-host {host_id}\n".encode())
                    reached.add(i)
                except OSError:
                    pass
            try:
                connection, _ = listener.accept()
            except (socket.timeout, BlockingIOError):
                continue
            with connection:
                # Read to the sender's close: it, not this port, keeps the
                # closed connection's TIME_WAIT, so TF can bind the port.
                connection.settimeout(2.0)
                message = b""
                try:
                    while chunk := connection.recv(64):
                        message += chunk
                except OSError:
                    continue
            match = re.fullmatch(rb"tfpar-host (\d+)\n", message)
            if match and int(match[1]) < n:
                heard.add(int(match[1]))
    finally:
        listener.close()


def num_hosts():
    """Hosts in the cluster (1 without `connect_hosts`)."""
    return dtensor.num_clients()


def host_id():
    """This host's index (0 without `connect_hosts`)."""
    return dtensor.client_id()
