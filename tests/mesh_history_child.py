"""A planned pipeline that compiles in a fresh process and not after
another mesh was used (run by tests/test_plans_train.py).

    python mesh_history_child.py fresh|after_another_mesh

Trains keras-hub GPT-2 (tests/hub_models.py) as a PipelineModel of one
micro-batch on data 2 × pipe 2 × model 2 with vocab-parallel rules and
fsdp (a `tfpar.plan` candidate), after first building a model under a
data=8 strategy with "after_another_mesh". Prints "trained" or the
error on one line.
"""

import sys

import tfpar

tfpar.use_virtual_cpus(8)

import keras  # noqa: E402

import hub_models  # noqa: E402

x, y = hub_models.data("gpt2", batch=8)
if sys.argv[1] == "after_another_mesh":
    with tfpar.ParallelStrategy(tfpar.Mesh({"data": 8})).scope():
        hub_models.build("gpt2")
mesh = tfpar.Mesh({"data": 2, "pipe": 2, "model": 2})
strategy = tfpar.ParallelStrategy(mesh, fsdp=True, rules=tfpar.auto_rules(
    lambda: hub_models.build("gpt2"), axis_size=2, vocab_parallel=True))
with strategy.scope():
    model = tfpar.PipelineModel(hub_models.build("gpt2"), num_microbatches=1)
    model.compile(optimizer="sgd", loss=hub_models.loss("gpt2"))
try:
    model.fit(x, y, batch_size=8, verbose=0)
    print("trained")
except ValueError as error:
    print(" ".join(str(error).split()))
