"""Two hosts as one mesh, on this machine: two processes of 4 virtual CPUs.

    python examples/hosts.py [--epochs 2]
        starts both hosts here (free local ports) and prints their output;
    python examples/hosts.py --host-id I --addresses HOST0:PORT,HOST1:PORT
        is what each machine of a real cluster runs (same addresses, its own
        I); on real machines drop the virtual CPUs (--virtual-cpus 0).

Each host joins the cluster (`tfpar.connect_hosts`), trains a Megatron MLP
on Mesh({"data": 2, "model": 4}) spanning both hosts (the data axis splits
the batch between the hosts, the model axis splits the weights inside
each), prints which of its devices hold which block of a split kernel and,
on host 0, the largest difference to the same training on one device.
"""

import argparse
import os
import socket
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

RULES = {r".*up/kernel": (None, "model"), r".*up/bias": ("model",),
         r".*down/kernel": ("model", None)}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter,
                    argparse.RawDescriptionHelpFormatter):
    """--help shows each option's default and keeps the epilog's lines."""


def launch(epochs):
    """Starts hosts 0 and 1 of a two-host cluster on free local ports."""
    sockets = [socket.socket() for _ in range(2)]
    for s in sockets:
        s.bind(("localhost", 0))
    addresses = ",".join(f"localhost:{s.getsockname()[1]}" for s in sockets)
    for s in sockets:
        s.close()
    processes = [subprocess.Popen(
        [sys.executable, __file__, "--host-id", str(i), "--addresses",
         addresses, "--epochs", str(epochs)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)]
    # A host whose peer died waits in a collective and ignores SIGTERM.
    while any(p.poll() is None for p in processes):
        if any(p.poll() not in (None, 0) for p in processes):
            for process in processes:
                process.kill()
        time.sleep(0.5)
    for i, process in enumerate(processes):
        print(f"----- host {i} (exit code {process.returncode}) -----")
        print(process.stdout.read().strip())
    return max(p.returncode for p in processes)


def build():
    import keras  # noqa: PLC0415

    return keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(64, activation="relu", name="up"),
        keras.layers.Dense(16, activation="relu", name="down"),
        keras.layers.Dense(1, name="head")], name="mlp")


def host(host_id, addresses, epochs, virtual_cpus):
    import tfpar  # noqa: PLC0415
    if virtual_cpus:
        tfpar.use_virtual_cpus(virtual_cpus)
    tfpar.connect_hosts(addresses, host_id)
    import keras  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from tensorflow.experimental import dtensor  # noqa: PLC0415

    # Every host must feed the same batches: the same data, no shuffling
    # (or one keras.utils.set_random_seed on all hosts).
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 16)).astype("float32")
    y = (x[:, :4].sum(1, keepdims=True) - x[:, 4:5] ** 2).astype("float32")
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}),
                                      rules=tfpar.LayoutRules(RULES))
    with strategy.scope():
        model = build()  # initial weights: host 0's, on every host
        model.compile(optimizer="adam", loss="mse")
    initial = model.get_weights()  # a collective: every host calls it
    history = model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False,
                        verbose=0)
    print(f"host {host_id} of {tfpar.hosts.num_hosts()}, mesh "
          f"{strategy.mesh}: losses per epoch "
          f"{[round(v, 5) for v in history.history['loss']]}")
    kernel = model.get_layer("up").kernel
    blocks = dtensor.unpack(kernel.value.read_value())
    names = tfpar.mesh.local_device_names(
        dtensor.fetch_layout(kernel.value).mesh)
    print(f"host {host_id} holds these blocks of up/kernel "
          f"{tuple(kernel.shape)}: "
          + ", ".join(f"{d} {tuple(b.shape)}" for d, b in zip(names, blocks)))
    trained = model.get_weights()
    if host_id == 0:  # the same training on one device, from one weights
        single = build()
        single.set_weights(initial)
        single.compile(optimizer="adam", loss="mse")
        single.fit(x, y, batch_size=32, epochs=epochs, shuffle=False,
                   verbose=0)
        worst = max(float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-12))
                    for a, b in zip(single.get_weights(), trained))
        print(f"largest relative weight difference to one device: "
              f"{worst:.2e}")
    return 0


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=HelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--epochs", type=int, default=2, help="epochs")
    parser.add_argument("--host-id", type=int, default=None,
                        help="run one host (None: start both here)")
    parser.add_argument("--addresses", default=None,
                        help="HOST:PORT of every host, comma-separated")
    parser.add_argument("--virtual-cpus", type=int, default=4,
                        help="virtual CPUs per host (0: the real devices)")
    args = parser.parse_args()
    if args.host_id is None:
        return launch(args.epochs)
    if not args.addresses:
        parser.error("--host-id needs --addresses")
    return host(args.host_id, args.addresses.split(","), args.epochs,
                args.virtual_cpus)


if __name__ == "__main__":
    sys.exit(main())
