"""One load of a pretrained Llama3 backbone in a fresh process (run by
tests/test_pretrained.py and benchmarks/pretrained.py), measuring the
process's peak resident memory during the load.

    python pretrained_child.py make SIZE DIR        # preset + HF checkpoint
    python pretrained_child.py load SIZE DIR FORMAT ROUTE MESH OUT.json

SIZE: a key of `SIZES`. `make` writes DIR/preset (keras-hub
`save_to_preset`) and DIR/hf (`tfpar.pretrained.export_to_transformers`
from one device, sharded in two files with an index), and DIR/weights.npz
(the weights, for the loader to compare with). `load` loads FORMAT
("preset" or "hf") under a strategy on MESH ("model=8", "data=2,model=4";
a part "fsdp" for `fsdp=True`: "data=8,fsdp", "data=2,model=4,fsdp") by
ROUTE:

- "rules": rules from a builder (`tfpar.auto_rules(lambda: ...
  from_preset(path, load_weights=False))`), the model built in the scope
  of `ParallelStrategy(mesh, rules=...)` and of
  `tfpar.pretrained.deferred_init()` (every split weight created split, as
  zeros each device makes), then `tfpar.pretrained.load_weights`;
- "rules_random": the same without `deferred_init` (the build draws every
  weight's random initial value on the host first: the route before);
- "from_preset": the same rules, then keras-hub's `from_preset` in the
  scope and in `deferred_init()` (Keras' `load_weights` assigns each
  whole tensor);
- "naive": `from_preset` in the scope of a strategy without rules, then
  `apply_rules(model, auto_rules(model))` (today's route);

and writes OUT.json: the resident set before the load and its peak
during it (Linux VmHWM, reset right before the load), the checkpoint's
bytes, tfpar's largest per-device bytes, the load's seconds, whether
the weights equal the saved ones, the loss of one training step, and
(preset, "rules") whether the sharded model's exported preset equals the
original.
"""

import contextlib
import json
import os
import sys
import time

import tfpar

tfpar.use_virtual_cpus(8)

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

from h5_files import same_datasets  # noqa: E402

SIZES = {
    # name: Llama3Backbone arguments (untied embeddings: an lm head of its own)
    "small": dict(vocabulary_size=512, num_layers=2, num_query_heads=8,
                  num_key_value_heads=8, hidden_dim=128, intermediate_dim=256),
    "40m": dict(vocabulary_size=16000, num_layers=6, num_query_heads=8,
                num_key_value_heads=8, hidden_dim=512, intermediate_dim=1536),
    # ~150M parameters, 0.6 GB in float32: the size.
    "150m": dict(vocabulary_size=32000, num_layers=14, num_query_heads=8,
                 num_key_value_heads=8, hidden_dim=768,
                 intermediate_dim=2048),
}


def rss_bytes(field="VmRSS"):
    """This process's resident set (or its peak, "VmHWM"), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak():
    """Linux: the peak resident set (VmHWM) starts again from now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def make(size, directory):
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.Llama3Backbone(**SIZES[size])
    backbone.save_to_preset(os.path.join(directory, "preset"))
    tfpar.pretrained.export_to_transformers(
        backbone, os.path.join(directory, "hf"),
        max_shard_bytes=backbone.count_params() * 4 // 2 + 1)
    np.savez(os.path.join(directory, "weights.npz"),
             *[w.numpy() for w in backbone.weights])


def checkpoint_bytes(path):
    return sum(os.path.getsize(os.path.join(path, name))
               for name in os.listdir(path)
               if name.endswith((".h5", ".safetensors")))


def parse_mesh(text):
    """("data=2,model=4,fsdp") -> (tfpar.Mesh({"data": 2, "model": 4}),
    True): mesh axes as name=size, and "fsdp" for `fsdp=True`."""
    parts = text.split(",")
    fsdp = "fsdp" in parts
    axes = {}
    for part in parts:
        if part == "fsdp":
            continue
        axis, sep, size = part.partition("=")
        if not sep or not size.isdigit():
            raise ValueError(
                f"MESH {text!r}: each part is axis=size or 'fsdp', got "
                f"{part!r}; e.g. 'data=2,model=4' or 'data=8,fsdp'.")
        axes[axis] = int(size)
    return tfpar.Mesh(axes), fsdp


def load(size, directory, fmt, route, mesh_text, out):
    path = os.path.join(directory, fmt)
    mesh, fsdp = parse_mesh(mesh_text)
    def build():
        if fmt == "hf":  # keras-hub's from_preset(hf) needs `safetensors`
            return tfpar.pretrained.transformers_backbone(path)
        return keras_hub.models.Llama3Backbone.from_preset(
            path, load_weights=False)
    rules = (tfpar.auto_rules(build, mesh=mesh) if route != "naive"
             else None)
    strategy = tfpar.ParallelStrategy(mesh, rules=rules, fsdp=fsdp)
    before = rss_bytes()
    reset_peak()
    start = time.perf_counter()
    with strategy.scope(), (tfpar.pretrained.deferred_init()
                            if route in ("rules", "from_preset")
                            else contextlib.nullcontext()):
        if route in ("rules", "rules_random"):  # tfpar's loader, in blocks
            backbone = build()
            tfpar.pretrained.load_weights(backbone, path)
        else:  # keras-hub's from_preset (HF: needs `safetensors`)
            backbone = keras_hub.models.Llama3Backbone.from_preset(path)
        if route == "naive":
            strategy.apply_rules(backbone, tfpar.auto_rules(backbone,
                                                            mesh=mesh))
    seconds = time.perf_counter() - start
    peak = rss_bytes("VmHWM")
    saved = np.load(os.path.join(directory, "weights.npz"))
    equal = all(np.array_equal(saved[f"arr_{i}"], w.numpy())
                for i, w in enumerate(backbone.weights))
    per_device = max(sum(kinds.values()) for kinds in
                     strategy.memory_per_device().values())
    result = {"size": size, "format": fmt, "route": route, "mesh": mesh_text,
              "rss_before": before, "rss_peak": peak,
              "growth": peak - before, "checkpoint_bytes":
              checkpoint_bytes(path), "per_device_bytes": per_device,
              "load_s": seconds, "weights_equal": bool(equal)}
    if fmt == "preset" and route == "rules":
        exported = os.path.join(directory, "exported")
        backbone.save_to_preset(exported)
        result["export_equal"] = same_datasets(
            os.path.join(exported, "model.weights.h5"),
            os.path.join(path, "model.weights.h5"))
    result["step_loss"] = train_step(strategy, backbone)
    with open(out, "w") as f:
        json.dump(result, f)


def train_step(strategy, backbone):
    """The loss of one SGD step on a small batch (finite: the step ran)."""
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(0, 64, (8, 8)).astype("int32"),
         "padding_mask": np.ones((8, 8), "int32")}
    y = rng.normal(size=(8, 8, backbone.hidden_dim)).astype("float32")
    with strategy.scope():
        backbone.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    history = backbone.fit(x, y, batch_size=8, epochs=1, verbose=0)
    return float(history.history["loss"][0])


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2], sys.argv[3])
    else:
        load(*sys.argv[2:8])
