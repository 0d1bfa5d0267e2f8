"""One host of a two-host cluster loading a pretrained Llama3 (run by
tests/test_pretrained.py, slow profile).

    python pretrained_hosts_child.py HOST_ID ADDR0,ADDR1 WORKDIR

WORKDIR holds `preset/` and `hf/` (tests/pretrained_child.py `make
small`). Joins the cluster with 4 virtual CPUs (a model=8 mesh over both
hosts), and loads each format with rules from a builder inside
`tfpar.pretrained.deferred_init()`, noting every block read from the file
(safetensors `get_block` boxes, h5py dataset selections). Writes
WORKDIR/host<HOST_ID>_<format>.json: the reads, and for each weight its
spec and this host's device blocks ({location: block, as a list}).
"""

import json
import os
import sys

import tfpar

host_id = int(sys.argv[1])
addresses = sys.argv[2].split(",")
workdir = sys.argv[3]
tfpar.use_virtual_cpus(4)
tfpar.connect_hosts(addresses, host_id, timeout=120)

import h5py  # noqa: E402
import keras_hub  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

from tfpar import placement, safetensors_io  # noqa: E402

reads = []
get_block = safetensors_io.SafetensorsCheckpoint.get_block
h5_read = h5py.Dataset.__getitem__


def noting_get_block(self, name, box):
    reads.append([self.key(name), [list(b) for b in box]])
    return get_block(self, name, box)


def noting_h5_read(self, index):
    if isinstance(index, tuple) and all(isinstance(s, slice) for s in index):
        box = [list(s.indices(n)[:2]) for s, n in zip(index, self.shape)]
    else:  # a whole read (d[()])
        box = [[0, n] for n in self.shape]
    reads.append([self.name.lstrip("/"), box])
    return h5_read(self, index)


def noting_get_tensor(self, name):
    tensor = get_tensor(self, name)
    reads.append([self.key(name), [[0, n] for n in tensor.shape]])
    return tensor


get_tensor = safetensors_io.SafetensorsCheckpoint.get_tensor
safetensors_io.SafetensorsCheckpoint.get_tensor = noting_get_tensor
safetensors_io.SafetensorsCheckpoint.get_block = noting_get_block
h5py.Dataset.__getitem__ = noting_h5_read
mesh = tfpar.Mesh({"model": 8})
for fmt in ("preset", "hf"):
    path = os.path.join(workdir, fmt)

    def build():
        if fmt == "hf":
            return tfpar.pretrained.transformers_backbone(path)
        return keras_hub.models.Llama3Backbone.from_preset(
            path, load_weights=False)

    strategy = tfpar.ParallelStrategy(
        mesh, rules=tfpar.auto_rules(build, mesh=mesh))
    del reads[:]
    with strategy.scope(), tfpar.pretrained.deferred_init():
        backbone = build()
        tfpar.pretrained.load_weights(backbone, path)
    weights = {}
    for weight in backbone.weights:
        spec = tfpar.variables.placement_of(weight).spec
        locations = placement.local_locations(mesh.dtensor_mesh)
        blocks = dtensor.unpack(weight.value.read_value())
        weights[weight.path] = {
            "spec": list(spec), "blocks": [
                [dict(location), block.numpy().tolist()]
                for location, block in zip(locations, blocks)]}
    with open(os.path.join(workdir, f"host{host_id}_{fmt}.json"), "w") as f:
        json.dump({"reads": reads, "weights": weights}, f)
print(f"host {host_id} done", flush=True)
