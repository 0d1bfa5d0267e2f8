"""Starts one training script as N hosts on this machine (torchrun-style).

    python -m tfpar.launch --hosts 2 --virtual-cpus 4 train.py --epochs 3
    python -m tfpar.launch --hosts 2 --max-restarts 1 train.py

Each host is a process running `train.py ARGS` with the cluster in its
environment: `TFPAR_HOSTS` (every host's "localhost:port"), `TFPAR_HOST_ID`,
`TFPAR_VIRTUAL_CPUS` (with `--virtual-cpus`), `TFPAR_RESTART` (0 for the
first attempt) and `TFPAR_JOB_SECRET` (a fresh random secret for the job,
which authenticates tfpar's messages between hosts: `tfpar.host_auth`;
one already in the launcher's environment is passed on instead). The script calls `tfpar.connect_hosts()` with no arguments,
which reads them — and runs unchanged alone (no variables: one host) or on a
real cluster, where the scheduler's job script sets the same variables (see
the README: Slurm and Kubernetes examples), or DTensor's `DTENSOR_JOBS` /
`DTENSOR_CLIENT_ID`, or `TF_CONFIG`.

Every line a host prints is prefixed with `[host I]`. When a host fails
(non-zero exit; a host that loses another exits with
`tfpar.hosts.LOST_HOST_EXIT_CODE`), the launcher stops the others, and
with `--max-restarts R` starts the whole group again, up to R times, on
new ports: a script that resumes from its last checkpoint (Keras'
`BackupAndRestore`, or `tfpar.restore_checkpoint`) then continues where
the failed attempt left off. The launcher's exit status is 0 when an
attempt succeeded, else the failing host's status.

SIGTERM or SIGINT to the launcher (a scheduler's preemption, Ctrl-C) is
forwarded to every host, once; the hosts get `--signal-grace` seconds to
save and exit (`tfpar.PreemptionCheckpoint` saves all hosts at one step),
then are killed; no restart follows, and the launcher exits with 128 + the
signal's number. Hosts run in their own process group, so a terminal's
Ctrl-C reaches them only through the launcher. A launcher killed outright
(SIGKILL) takes its hosts with it (Linux: PR_SET_PDEATHSIG).
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from tfpar.host_auth import new_secret


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m tfpar.launch",
        description="Run a training script as several hosts on this "
                    "machine (each a process with the cluster in its "
                    "environment).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--hosts", type=int, default=2,
                        help="number of hosts (processes)")
    parser.add_argument("--virtual-cpus", type=int, default=None,
                        help="logical CPU devices per host (sets "
                             "TFPAR_VIRTUAL_CPUS)")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="times to restart the whole group after a "
                             "host fails")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds the other hosts get to exit after a "
                             "failure before they are killed")
    parser.add_argument("--signal-grace", type=float, default=60.0,
                        help="seconds the hosts get to save and exit after "
                             "the launcher forwards them SIGTERM/SIGINT")
    parser.add_argument("script", help="the Python script every host runs")
    parser.add_argument("args", nargs=argparse.REMAINDER,
                        help="arguments for the script")
    options = parser.parse_args(argv)
    for name in ("hosts", "virtual_cpus"):
        value = getattr(options, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} needs a positive "
                         f"integer. Received: {value}")
    if options.max_restarts < 0:
        parser.error("--max-restarts needs an integer >= 0. Received: "
                     f"{options.max_restarts}")
    if not os.path.isfile(options.script):
        parser.error(f"no such script: {options.script!r}")
    options.secret = os.environ.get("TFPAR_JOB_SECRET") or new_secret()
    status = 0
    for attempt in range(options.max_restarts + 1):
        if _signalled:
            break
        if attempt:
            print(f"[launch] restarting all {options.hosts} hosts (restart "
                  f"{attempt} of {options.max_restarts})", flush=True)
        status = run_group(options, attempt)
        if status == 0 and not _signalled:
            return 0
    return 128 + _signalled[0] if _signalled else status


def run_group(options, attempt):
    """Runs one attempt of every host; 0, or the first failing status."""
    ports = free_ports(options.hosts)
    environment = {k: v for k, v in os.environ.items()
                   if not k.startswith(("DTENSOR_", "TFPAR_"))
                   and k != "TF_CONFIG"}
    environment["TFPAR_HOSTS"] = ",".join(f"localhost:{p}" for p in ports)
    environment["TFPAR_RESTART"] = str(attempt)
    environment["TFPAR_JOB_SECRET"] = options.secret
    if options.virtual_cpus:
        environment["TFPAR_VIRTUAL_CPUS"] = str(options.virtual_cpus)
    processes, printers = [], []
    for host in range(options.hosts):
        process = subprocess.Popen(
            [sys.executable, options.script, *options.args],
            env={**environment, "TFPAR_HOST_ID": str(host)},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            bufsize=1, preexec_fn=_die_with_launcher)
        printer = threading.Thread(target=_prefix, args=(process, host))
        printer.start()
        processes.append(process)
        printers.append(printer)
    forward = _forwarding(processes)
    try:
        status = _wait(processes, options.grace, options.signal_grace)
    finally:
        for number, previous in forward.items():
            signal.signal(number, previous)
    for printer in printers:
        printer.join()
    return status


_signalled = []  # the signal the launcher received (forwarded to hosts)
_signalled_at = []


def _forwarding(processes):
    """Installs SIGTERM/SIGINT handlers that forward the signal to every
    running host, once; returns the previous handlers."""
    def forward(number, _frame):
        if _signalled:
            return  # forwarded already; the grace period runs
        _signalled.append(number)
        _signalled_at.append(time.monotonic())
        print(f"[launch] received {signal.Signals(number).name}: forwarded "
              "to every host", flush=True)
        for process in processes:
            if process.poll() is None:
                process.send_signal(number)

    return {number: signal.signal(number, forward)
            for number in (signal.SIGTERM, signal.SIGINT)}


def _wait(processes, grace, signal_grace=60.0):
    """Waits for all; after the first failure gives the others `grace`
    seconds (after a forwarded signal, `signal_grace`), then kills them (a
    host stuck in a collective ignores SIGTERM). The first failing exit
    status, else 0."""
    failed_at, status, reported, killed = None, 0, set(), set()
    while len(reported) < len(processes):
        if _signalled_at and time.monotonic() - _signalled_at[0] > (
                signal_grace):
            failed_at, grace = _signalled_at[0], signal_grace
        for host, process in enumerate(processes):
            code = process.poll()
            if code is None or host in reported:
                continue
            reported.add(host)
            if code != 0:
                print(f"[launch] host {host} exited with status {code}",
                      flush=True)
                if failed_at is None:
                    failed_at, status = time.monotonic(), code
        if failed_at is not None and time.monotonic() - failed_at > grace:
            _kill_running(processes, grace, killed)
        time.sleep(0.1)
    return status


def _kill_running(processes, grace, killed):
    """Kills every host still running, naming each once (`killed`: the
    hosts named already): a host that outlived its grace period is why
    it left no result."""
    for host, process in enumerate(processes):
        if process.poll() is not None:
            continue
        if host not in killed:
            killed.add(host)
            print(f"[launch] host {host} did not exit within {grace:g} s: "
                  "killed", flush=True)
        process.send_signal(signal.SIGCONT)  # a stopped host
        process.kill()


def _die_with_launcher():
    """In the child: its own process group (a terminal's Ctrl-C reaches it
    through the launcher only), and SIGKILL when the launcher dies (Linux),
    so hosts stuck in a collective do not outlive a launcher that was
    killed."""
    os.setpgrp()
    try:
        import ctypes  # noqa: PLC0415

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the launcher's own cleanup must do


def _prefix(process, host):
    for line in process.stdout:
        sys.stdout.write(f"[host {host}] {line}")
        sys.stdout.flush()


def free_ports(n):
    """`n` ports free on localhost now (the OS picks them)."""
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


if __name__ == "__main__":
    sys.exit(main())
