"""Heartbeats between hosts: a dead or stopped host is an error, not a hang.

Once running, a TensorFlow collective has no timeout: a host killed in the
middle of training leaves every other host waiting in its next all-reduce
forever (and such a process ignores SIGTERM). `tfpar.connect_hosts` starts a
`Watch` on every host. Each host answers pings on a port of its own (sent
to the others in the connection handshake) and pings every other host once
a second. A host that has not answered for `timeout` seconds is lost:
killed (its port refuses), stopped by SIGSTOP or hung (the kernel still
accepts the connection, but nobody answers), or unreachable. The watching
host then prints an error naming it and exits with `LOST_HOST_EXIT_CODE`
— the main thread may be blocked inside TF's C++ collective, where no
Python exception can reach it. What was published before stays intact:
tfpar's checkpoints publish by an atomic rename.

A host that leaves tells the others ("bye": they stop watching it), or,
when it ends with an uncaught exception, that it failed ("fail"): they exit
with the error naming it at once instead of waiting in a collective.

Example (what `connect_hosts` does; ports from the handshake):

>>> watch = Watch(["localhost:23451", "localhost:23452"], 0, timeout=60)
>>> watch.start({1: 40123})
"""

import atexit
import os
import re
import socket
import sys
import threading
import time

LOST_HOST_EXIT_CODE = 70  # EX_SOFTWARE
INTERVAL = 1.0  # seconds between pings


class Watch:
    """Answers pings and watches the other hosts (see the module docstring).

    Args:
        addresses: every host's "host:port" (for the peers' host names).
        host_id: this host's index.
        timeout: seconds without an answer after which a host is lost.
    """

    def __init__(self, addresses, host_id, timeout):
        self.addresses = list(addresses)
        self.host_id = host_id
        self.timeout = float(timeout)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("", 0))
        self._listener.listen(len(addresses))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._peers = {}  # host id -> (host name, heartbeat port)
        self._last_answer = {}
        self._departed = set()
        self._state = b"alive"  # what this host answers

    def start(self, heartbeat_ports):
        """Watches the hosts {id: heartbeat port}; returns at once."""
        now = time.monotonic()
        for other, port in heartbeat_ports.items():
            self._peers[other] = (self.addresses[other].rsplit(":", 1)[0], port)
            self._last_answer[other] = now
        threading.Thread(target=self._answer, daemon=True,
                         name="tfpar-heartbeat-answer").start()
        threading.Thread(target=self._ping, daemon=True,
                         name="tfpar-heartbeat-ping").start()
        previous_hook = sys.excepthook

        def failed(kind, error, traceback):
            previous_hook(kind, error, traceback)
            lost = _lost_task(error, self.host_id)
            if lost is not None:  # TF noticed first: the same verdict
                self._lose(lost, "was lost: TensorFlow's collective with it "
                           "failed (killed, stopped or unreachable)")
            self._state = b"fail"
            self._tell_others(b"fail")

        sys.excepthook = failed
        atexit.register(self.close, tell=True)

    def close(self, tell=False):
        if tell and self._state == b"alive":
            self._state = b"bye"
            self._tell_others(b"bye")
        self._stop.set()
        try:
            self._listener.close()
        except OSError:
            pass

    # -- the two threads ------------------------------------------------------

    def _answer(self):
        """Answers each ping with this host's state; records departures."""
        while not self._stop.is_set():
            try:
                connection, _ = self._listener.accept()
            except OSError:
                continue
            with connection:
                try:
                    connection.settimeout(2.0)
                    message = connection.recv(64)
                    if message.startswith((b"bye ", b"fail ")):
                        word, sender = message.split()
                        self._heard_departure(int(sender), word)
                    else:
                        connection.sendall(self._state)
                except (OSError, ValueError):
                    pass

    def _ping(self):
        while not self._stop.wait(INTERVAL):
            for other in sorted(set(self._peers) - self._departed):
                answer = self._send(other, b"ping")
                now = time.monotonic()
                if answer == b"alive":
                    self._last_answer[other] = now
                elif answer in (b"bye", b"fail"):
                    self._heard_departure(other, answer)
                elif now - self._last_answer[other] > self.timeout:
                    self._lose(other, f"has not answered for "
                               f"{now - self._last_answer[other]:.0f} s "
                               "(killed, stopped or unreachable)")

    # -- helpers --------------------------------------------------------------

    def _send(self, other, message):
        """Sends `message` to host `other`; its answer, or None."""
        name, port = self._peers[other]
        try:
            with socket.create_connection((name, port), timeout=2.0) as sock:
                sock.settimeout(2.0)
                sock.sendall(message)
                sock.shutdown(socket.SHUT_WR)
                return sock.recv(16)
        except OSError:
            return None

    def _tell_others(self, word):
        for other in sorted(set(self._peers) - self._departed):
            self._send(other, word + f" {self.host_id}".encode())

    def _heard_departure(self, other, word):
        self._departed.add(other)
        if word == b"fail":
            self._lose(other, "ended with an error")

    def _lose(self, other, why):
        if self._stop.is_set() or self._state != b"alive":
            return  # this host is leaving itself
        sys.stderr.write(
            f"\ntfpar: host {other} ({self.addresses[other]}) {why}. Host "
            f"{self.host_id} cannot finish the collectives it shares with "
            f"it and exits with status {LOST_HOST_EXIT_CODE}. Restart every "
            "host (tfpar.launch --max-restarts does) and resume from the "
            "last checkpoint (keras.callbacks.BackupAndRestore or "
            "tfpar.save_checkpoint). Heartbeat timeout: "
            f"{self.timeout:g} s (connect_hosts(heartbeat_timeout=...) or "
            "TFPAR_HEARTBEAT_TIMEOUT).\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(LOST_HOST_EXIT_CODE)  # noqa: SLF001 (main may be in C++)


def _lost_task(error, host_id):
    """The host TF's coordination service reported dead in `error`, or None.

    TF's own heartbeats (every host reports to host 0's coordination
    service) may notice a dead host before ours do; the collective then
    fails with "The following tasks are unhealthy (stopped sending
    heartbeats): /job:worker/replica:0/task:1 ...", and a collective
    whose peer was killed fails at once with "Collective ops is aborted
    by: recvmsg:Connection reset by peer ... from remote target
    /job:worker/replica:0/task:1" (both UnavailableError).
    """
    text = str(error)
    if type(error).__name__ not in ("UnavailableError", "AbortedError"):
        return None
    tasks = [int(t) for t in re.findall(r"/job:\w+/replica:\d+/task:(\d+)",
                                        text)]
    return next((t for t in tasks if t != host_id), None)
