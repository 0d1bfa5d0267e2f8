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

A host that leaves tells the others ("bye": they stop watching it, and
name it as "exited cleanly" if they then need it), or, when it ends with an
uncaught exception, that it failed ("fail"): they exit with the error
naming it at once instead of waiting in a collective. A host seen alive
whose port then refuses connections has ended: lost at once.

Each answer carries the number of steps the host has begun
(`begin_step`, called by `tfpar.StepWatchdog`): a step that has not
finished after `step_timeout` seconds ends this host, naming the hosts
that have not begun it, and tells the others ("abort") to end too.

Messages go through `tfpar.host_auth`: authenticated with the job secret,
bound to this host's address, one thread per connection.

Example (what `connect_hosts` does; ports from the handshake):

>>> watch = Watch(["localhost:23451", "localhost:23452"], 0, timeout=60)
>>> watch.start({1: 40123})
"""

import atexit
import os
import re
import signal
import sys
import threading
import time

from tfpar import host_auth

LOST_HOST_EXIT_CODE = 70  # EX_SOFTWARE
INTERVAL = 1.0  # seconds between pings
_TELL_TIMEOUT = 5.0  # seconds for a bye, fail, abort or preempt
_current = []  # the Watch of this process, once started


def current():
    """This process's `Watch` (after `connect_hosts` on several hosts), or
    None."""
    return _current[0] if _current else None


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
        self._server = host_auth.Server(self.addresses, host_id, 0,
                                        self._handle)
        self.port = self._server.port
        self._stop = threading.Event()
        self._peers = {}  # host id -> heartbeat port
        self._last_answer = {}
        self._seen_alive = set()
        self._departed = {}  # host id -> "bye" or "fail"
        self._state = "alive"  # what this host answers
        self.progress = {}  # host id -> steps it has begun (its answers)
        self.steps_begun = 0
        self._step_began_at = None
        self.step_timeout = None
        self.on_preempt = None  # called with a peer's preempt argument

    @property
    def rejected(self):
        """Requests refused by this host's heartbeat server."""
        return self._server.rejected

    def start(self, heartbeat_ports):
        """Watches the hosts {id: heartbeat port}; returns at once."""
        now = time.monotonic()
        for other, port in heartbeat_ports.items():
            self._peers[other] = port
            self._last_answer[other] = now
        threading.Thread(target=self._ping, daemon=True,
                         name="tfpar-heartbeat-ping").start()
        threading.Thread(target=self._watch_steps, daemon=True,
                         name="tfpar-step-watchdog").start()
        previous_hook = sys.excepthook

        def failed(kind, error, traceback):
            previous_hook(kind, error, traceback)
            lost = _lost_task(error, self.host_id)
            if lost is not None:  # TF noticed first: the same verdict
                self._lose(lost, "was lost: TensorFlow's collective with it "
                           "failed (killed, stopped or unreachable)")
            self._state = "fail"
            self.tell_others("fail")

        sys.excepthook = failed
        atexit.register(self.close, tell=True)
        _current[:] = [self]

    def close(self, tell=False):
        if self._stop.is_set():
            return
        if tell and self._state == "alive":
            self._state = "bye"
            self.tell_others("bye")
        self._stop.set()
        self._server.close()

    # -- what peers send ------------------------------------------------------

    def _handle(self, sender, word, arg):
        """Answers one authenticated request of host `sender`."""
        if sender not in self._peers:
            return "unknown", 0
        if word in ("bye", "fail"):
            self._heard_departure(sender, word)
        elif word == "preempt" and self.on_preempt is not None:
            self.on_preempt(arg)
        elif word == "abort":
            self._lose(sender, f"ended the job: its step {arg} did not "
                       f"finish within the step timeout")
        return self._state, self.steps_begun

    # -- the two threads ------------------------------------------------------

    def _ping(self):
        while not self._stop.wait(INTERVAL):
            for other in sorted(set(self._peers) - set(self._departed)):
                self._ping_one(other)

    def _ping_one(self, other):
        try:
            answer = self._send(other, "ping")
        except host_auth.Refused:
            if other in self._seen_alive and other not in self._departed:
                self._lose(other, "refuses connections on its heartbeat "
                           "port: its process ended (killed or crashed)")
            answer = None
        now = time.monotonic()
        if answer is None:
            if now - self._last_answer[other] > self.timeout:
                self._lose(other, f"has not answered for "
                           f"{now - self._last_answer[other]:.0f} s "
                           "(killed, stopped or unreachable)")
            return
        state, begun = answer
        self._last_answer[other] = now
        self.progress[other] = begun
        if state == "alive":
            self._seen_alive.add(other)
        elif state in ("bye", "fail"):
            self._heard_departure(other, state)

    # -- the step watchdog ----------------------------------------------------

    def begin_step(self):
        """This host enters its next step (`tfpar.StepWatchdog` calls it)."""
        self.steps_begun += 1
        self._step_began_at = time.monotonic()

    def end_step(self):
        self._step_began_at = None

    def _watch_steps(self):
        while not self._stop.wait(INTERVAL / 2):
            began, timeout = self._step_began_at, self.step_timeout
            if began is None or timeout is None:
                continue
            if time.monotonic() - began > timeout:
                self._step_timed_out(timeout)

    def _step_timed_out(self, timeout):
        step = self.steps_begun
        for other in sorted(set(self._peers) - set(self._departed)):
            self._ping_one(other)  # fresh progress before naming anyone
        missing = [h for h in sorted(self._peers)
                   if h not in self._departed
                   and self.progress.get(h, 0) < step]
        clean = [h for h, word in sorted(self._departed.items())
                 if word == "bye"]
        names = [f"host {h} ({self.addresses[h]}) has not arrived (at step "
                 f"{self.progress.get(h, 0)})" for h in missing]
        names += [f"host {h} ({self.addresses[h]}) exited cleanly"
                  for h in clean]
        if not names:
            names = ["every host arrived: the collective itself hangs"]
        self.tell_others("abort", step)
        self._exit(f"step {step} did not finish within {timeout:g} s: "
                   + "; ".join(names) + ". Every host exits with status "
                   f"{LOST_HOST_EXIT_CODE} (step timeout: tfpar.StepWatchdog"
                   "(timeout=...) or TFPAR_STEP_TIMEOUT)")

    # -- helpers --------------------------------------------------------------

    def _send(self, other, word, arg=0, timeout=host_auth.READ_TIMEOUT):
        """Sends `word arg` to host `other`; its answer (state, steps
        begun), or None. Raises host_auth.Refused."""
        return host_auth.request(self.addresses, self.host_id, other, word,
                                 arg, port=self._peers[other],
                                 timeout=timeout)

    def tell_others(self, word, arg=0):
        """Sends `word arg` to every host still running (and waits for
        each one's answer: it has handled the message)."""
        for other in sorted(set(self._peers) - set(self._departed)):
            # Patient (a loaded peer may take seconds to serve), and once
            # more on silence: this host may exit right after.
            for _ in range(2):
                try:
                    if self._send(other, word, arg, _TELL_TIMEOUT):
                        break
                except host_auth.Refused:
                    break

    def _heard_departure(self, other, word):
        self._departed.setdefault(other, word)
        if word == "fail":
            self._lose(other, "ended with an error")

    def departure(self, other):
        """How host `other` left: "bye" (cleanly), "fail", or None."""
        return self._departed.get(other)

    def _lose(self, other, why):
        if self._stop.is_set() or self._state != "alive":
            return  # this host is leaving itself
        if self._departed.get(other) == "bye":
            why = ("exited cleanly (its program ended) while this host "
                   "still needed it in a collective")
        self._exit(
            f"host {other} ({self.addresses[other]}) {why}. Host "
            f"{self.host_id} cannot finish the collectives it shares with "
            f"it and exits with status {LOST_HOST_EXIT_CODE}. Restart every "
            "host (tfpar.launch --max-restarts does) and resume from the "
            "last checkpoint (keras.callbacks.BackupAndRestore or "
            "tfpar.save_checkpoint). Heartbeat timeout: "
            f"{self.timeout:g} s (connect_hosts(heartbeat_timeout=...) or "
            "TFPAR_HEARTBEAT_TIMEOUT)")

    def _exit(self, message):
        if self._stop.is_set() or self._state != "alive":
            return
        self._state = "fail"
        sys.stderr.write(f"\ntfpar: {message}.\n")
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
