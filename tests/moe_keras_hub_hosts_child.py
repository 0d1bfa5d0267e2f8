"""One host of a two-host cluster (run by tests/test_moe_keras_hub_hosts.py).

    python moe_keras_hub_hosts_child.py HOST_ID ADDR0,ADDR1 WORKDIR

Joins the cluster with 4 virtual CPUs (8 devices in all) and trains what
tests/test_moe_keras_hub.py trains on one host: keras-hub's Mixtral
(automatic rules, its blocks dispatching automatically) on data=2 x
expert=4 with SGD, the mesh spanning both hosts. Writes the per-batch
losses and final weights to WORKDIR/host<HOST_ID>.npz.
"""

import sys

import tfpar

host_id = int(sys.argv[1])
addresses = sys.argv[2].split(",")
workdir = sys.argv[3]
tfpar.use_virtual_cpus(4)
tfpar.connect_hosts(addresses, host_id, timeout=120)

import numpy as np  # noqa: E402

import test_moe_keras_hub as hub_test  # noqa: E402

model, losses, strategy, _ = hub_test.train(
    "mixtral", "sgd", hub_test.MESHES["2x4"])
hub_test.check_banks_split("mixtral", model, strategy)
np.savez(f"{workdir}/host{host_id}.npz", losses=np.asarray(losses),
         **{f"w{i}": np.asarray(w.numpy(), "float32")
            for i, w in enumerate(model.weights)})
print(f"host {host_id} done", flush=True)
