"""tfpar's own sockets (issue 38): a stranger's forged, replayed,
malformed, oversized and idle connections end nothing.

The fast case attacks the heartbeat server of a `Watch` in this process
(the handshake of `connect_hosts` serves with the same `host_auth.Server`);
the slow case attacks both hosts of a job started by the launcher, whose
training must then finish.
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from test_launch import given_data
from tfpar import host_auth, host_watch

TESTS = Path(__file__).resolve().parent
SECRET = "0123456789abcdef0123456789abcdef"


def exchange(port, line, wait=True):
    """Connects, reads the challenge, sends `line`; the reply (b"" if the
    server closed without one)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        challenge = sock.recv(100)
        assert challenge.startswith(b"tfpar "), challenge
        sock.sendall(line)
        try:
            return sock.recv(100) if wait else b""
        except OSError:
            return b""


def attack(port, peer_id, receiver):
    """Every stranger's message tried on `port`; none may be accepted."""
    replies = [
        exchange(port, f"{peer_id} {receiver} fail 0 ab -\n".encode()),
        exchange(port, f"{peer_id} {receiver} bye 0 ab {'0' * 64}\n".encode()),
        exchange(port, f"99 {receiver} fail 0 ab -\n".encode()),
        exchange(port, f"-1 {receiver} ping 0 ab -\n".encode()),
        exchange(port, b"fail 1\n"), exchange(port, b"\xff\xfe\n"),
        exchange(port, b"x" * 100_000),
    ]
    # A valid message for another challenge (replayed) is refused.
    mac = host_auth._mac(SECRET.encode(), "0" * 32, peer_id, receiver,
                         "fail", 0, "ab")
    replies.append(exchange(
        port, f"{peer_id} {receiver} fail 0 ab {mac}\n".encode()))
    return replies


def idle(port, count, seconds):
    """`count` connections that send nothing for `seconds`."""
    sockets = [socket.create_connection(("127.0.0.1", port))
               for _ in range(count)]
    threading.Timer(seconds, lambda: [s.close() for s in sockets]).start()


def test_a_watch_refuses_strangers_and_keeps_answering(monkeypatch):
    monkeypatch.setenv(host_auth.SECRET_VARIABLE, SECRET)
    monkeypatch.delenv(host_auth.BIND_VARIABLE, raising=False)
    addresses = ["localhost:1", "localhost:2"]
    watches = [host_watch.Watch(addresses, h, timeout=60) for h in (0, 1)]
    hook = sys.excepthook
    try:
        watches[0].start({1: watches[1].port})
        watches[1].start({0: watches[0].port})
        port = watches[0].port
        assert watches[0]._server.address == "127.0.0.1"  # loopback only
        idle(port, 40, 4.0)
        start = time.monotonic()
        replies = attack(port, 1, 0)
        assert all(r == b"" for r in replies), replies
        # The idle connections block nobody: a real peer is answered now.
        assert host_auth.request(addresses, 1, 0, "ping", 0,
                                 port=port) == ("alive", 0)
        assert time.monotonic() - start < 3.0
        assert watches[0].rejected >= len(replies)
        assert watches[0]._departed == {} and watches[0]._state == "alive"
        # Another secret is a stranger too.
        assert host_auth.request(addresses, 1, 0, "fail", 0, port=port,
                                 secret=b"another secret of 16+") is None
        time.sleep(2.5)  # pings flow both ways through all of this
        assert watches[0].progress == {1: 0} and 1 in watches[0]._seen_alive
        # The real peer's "bye" is heard.
        watches[1].close(tell=True)
        assert watches[0].departure(1) == "bye"
    finally:
        for watch in watches:
            watch.close()
        sys.excepthook = hook
        host_watch._current[:] = []


def listening_address(port):
    """The local address of the socket listening on `port` (/proc/net/tcp)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        ip, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            return socket.inet_ntoa(bytes.fromhex(ip)[::-1])
    return None


@pytest.mark.slow  # two TF processes; the in-process case above is fast
def test_strangers_against_a_launched_job_end_nothing(tmp_path):
    workdir = given_data(tmp_path)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DTENSOR_", "TFPAR_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(TESTS.parent)])
    job = subprocess.Popen(
        [sys.executable, "-m", "tfpar.launch", "--hosts", "2",
         "--virtual-cpus", "4", str(TESTS / "launch_child.py"), "attacked",
         str(workdir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=env)
    try:
        ports = []
        deadline = time.monotonic() + 300
        for host in (0, 1):
            path = workdir / f"ports-host{host}.json"
            while not path.exists():
                assert time.monotonic() < deadline and job.poll() is None
                time.sleep(0.5)
            time.sleep(0.2)
            ports.append(json.loads(path.read_text()))
        for host, own in enumerate(ports):
            # Bound as documented: tfpar's port on loopback only.
            assert listening_address(own["heartbeat"]) == "127.0.0.1"
            idle(own["heartbeat"], 30, 5.0)
            replies = attack(own["heartbeat"], 1 - host, host)
            assert all(r == b"" for r in replies), replies
        time.sleep(6)  # past the idle connections
        (workdir / "attacked").write_text("done")
        out, _ = job.communicate(timeout=300)
    finally:
        job.kill()
    assert job.returncode == 0, out[-4000:]
    assert "host 0 attempt 0 done" in out and "host 1 attempt 0 done" in out
    assert "TFPAR_JOB_SECRET is not set" not in out


@pytest.mark.parametrize("addresses,host_id,environ,want", [
    (["localhost:1", "127.0.0.1:2"], 1, {}, "127.0.0.1"),
    (["localhost:1", "10.0.0.2:2"], 1, {}, "10.0.0.2"),
    (["localhost:1", "10.0.0.2:2"], 1,
     {host_auth.BIND_VARIABLE: "10.1.1.1"}, "10.1.1.1"),
])
def test_tfpar_sockets_bind_to_the_hosts_own_address(
        monkeypatch, addresses, host_id, environ, want):
    monkeypatch.delenv(host_auth.BIND_VARIABLE, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert host_auth.bind_address(addresses, host_id) == want


def test_a_short_secret_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(host_auth.SECRET_VARIABLE, "short")
    with pytest.raises(ValueError, match="at least 16 characters.*"
                       "Received: a secret of 5 characters"):
        host_auth.job_secret()
