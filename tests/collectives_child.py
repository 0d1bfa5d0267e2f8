"""Counts the collectives DTensor puts in tfpar's compiled steps, twice.

Run as a script with TF_DUMP_GRAPH_PREFIX set (TF reads it once, at start):
trains and predicts with a Megatron MLP of two column -> row pairs on
Mesh({"model": 8}) and prints one JSON line with {step: {op: count}}:

- "dump": read from the SPMD-expanded functions TF dumped to files
  (DTensor names them "..__func_..");
- "capture": read in this process by `tfpar.communication.capture()`
  around `fit` and `predict`;
- "report": from `tfpar.communication_report(model, x, y)`, which compiles
  its own copy of the training step.

The parent test checks that all three agree: the in-process reader sees
what TF itself dumps.
"""

import collections
import json
import os
import re
import sys
from pathlib import Path

import tfpar

tfpar.use_virtual_cpus(8)

import keras  # noqa: E402
import numpy as np  # noqa: E402

RULES = {r".*up\d/kernel": (None, "model"), r".*up\d/bias": ("model",),
         r".*down\d/kernel": ("model", None)}


def counts_of(report):
    return dict(collections.Counter(c.op for c in report.collectives))


def main():
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"model": 8}), rules=RULES)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu", name="up0"),
            keras.layers.Dense(16, name="down0"),
            keras.layers.Dense(32, activation="relu", name="up1"),
            keras.layers.Dense(16, name="down1"),
        ])
        model.compile(optimizer="sgd", loss="mse")
    x = np.ones((8, 16), "float32")
    with tfpar.communication.capture() as trained:
        model.fit(x, x, batch_size=8, epochs=1, verbose=0)
    with tfpar.communication.capture() as predicted:
        model.predict(x, batch_size=8, verbose=0)
    expanded = sorted(
        (int(re.search(r"_in_replica_(\d+)__func", p.name).group(1)), p)
        for p in Path(os.environ["TF_DUMP_GRAPH_PREFIX"]).glob(
            "__inference__in_replica_*__func_*.0000.main.initial.pbtxt")
        if "_partition_" not in p.name)
    # fit traced its step first, predict second.
    dumped = {
        phase: dict(collections.Counter(
            re.findall(r'op: "(Collective\w+)"', path.read_text())))
        for phase, (_, path) in zip(("train", "predict"), expanded)
    }
    captured = {"train": counts_of(trained.train_report()),
                "predict": counts_of(predicted.reports()[0])}
    report = {"train": counts_of(tfpar.communication_report(model, x, x))}
    print(json.dumps({"dump": dumped, "capture": captured, "report": report}))


if __name__ == "__main__":
    sys.exit(main())
