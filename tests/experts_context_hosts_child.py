"""One host of a two-host cluster (run by tests/test_experts_context_hosts.py).

    python experts_context_hosts_child.py HOST_ID ADDR0,ADDR1 WORKDIR

Joins the cluster with 4 virtual CPUs (8 devices in all) and trains, with
meshes spanning both hosts, what tests/test_moe_layer.py and
tests/test_context_parallel.py train on one host: the MixtureOfExperts
model on data=2 × expert=4 and on data=8 with the experts on the data
axis, and the causal transformer on data=2 × context=4. Writes the
per-batch losses and final weights to WORKDIR/host<HOST_ID>.npz.
"""

import sys

import tfpar

host_id = int(sys.argv[1])
addresses = sys.argv[2].split(",")
workdir = sys.argv[3]
tfpar.use_virtual_cpus(4)
tfpar.connect_hosts(addresses, host_id, timeout=120)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import context_models  # noqa: E402
import test_context_parallel as context_test  # noqa: E402
import test_moe_layer as moe_test  # noqa: E402

results = {}
for name, strategy in (
        ("expert_axis", tfpar.ParallelStrategy(
            tfpar.Mesh({"data": 2, "expert": 4}))),
        ("experts_on_data", tfpar.ParallelStrategy(
            tfpar.Mesh({"data": 8}), expert_axis="data"))):
    losses, weights, _, _ = moe_test.train(strategy, num_experts=8)
    results[f"{name}_losses"] = np.asarray(losses)
    results[f"{name}_weights"] = np.concatenate(
        [w.ravel() for w in weights.values()])

x, y = context_models.corpus(context_test.N, seq_len=context_test.SEQ)
keras.utils.set_random_seed(0)
initial = context_models.causal_transformer(**context_test.CONFIG).get_weights()
model, losses = context_test.train(
    tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "context": 4})), initial,
    x, y)
results["context_losses"] = np.asarray(losses)
np.savez(f"{workdir}/host{host_id}.npz", **results)
print(f"host {host_id} done", flush=True)
