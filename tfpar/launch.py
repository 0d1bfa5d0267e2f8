"""Starts one training script as N hosts on this machine (torchrun-style).

    python -m tfpar.launch --hosts 2 --virtual-cpus 4 train.py --epochs 3
    python -m tfpar.launch --hosts 2 --max-restarts 1 train.py

Each host is a process running `train.py ARGS` with the cluster in its
environment: `TFPAR_HOSTS` (every host's "localhost:port"), `TFPAR_HOST_ID`,
`TFPAR_VIRTUAL_CPUS` (with `--virtual-cpus`) and `TFPAR_RESTART` (0 for the
first attempt). The script calls `tfpar.connect_hosts()` with no arguments,
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
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time


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
    status = 0
    for attempt in range(options.max_restarts + 1):
        if attempt:
            print(f"[launch] restarting all {options.hosts} hosts (restart "
                  f"{attempt} of {options.max_restarts})", flush=True)
        status = run_group(options, attempt)
        if status == 0:
            return 0
    return status


def run_group(options, attempt):
    """Runs one attempt of every host; 0, or the first failing status."""
    ports = free_ports(options.hosts)
    environment = {k: v for k, v in os.environ.items()
                   if not k.startswith(("DTENSOR_", "TFPAR_"))
                   and k != "TF_CONFIG"}
    environment["TFPAR_HOSTS"] = ",".join(f"localhost:{p}" for p in ports)
    environment["TFPAR_RESTART"] = str(attempt)
    if options.virtual_cpus:
        environment["TFPAR_VIRTUAL_CPUS"] = str(options.virtual_cpus)
    processes, printers = [], []
    for host in range(options.hosts):
        process = subprocess.Popen(
            [sys.executable, options.script, *options.args],
            env={**environment, "TFPAR_HOST_ID": str(host)},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            bufsize=1)
        printer = threading.Thread(target=_prefix, args=(process, host))
        printer.start()
        processes.append(process)
        printers.append(printer)
    status = _wait(processes, options.grace)
    for printer in printers:
        printer.join()
    return status


def _wait(processes, grace):
    """Waits for all; after the first failure gives the others `grace`
    seconds, then kills them (a host stuck in a collective ignores
    SIGTERM). The first failing exit status, else 0."""
    failed_at, status, reported = None, 0, set()
    while len(reported) < len(processes):
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
            for process in processes:
                if process.poll() is None:
                    process.send_signal(signal.SIGCONT)  # a stopped host
                    process.kill()
        time.sleep(0.1)
    return status


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
