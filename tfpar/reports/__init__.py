"""Reports of a model under a strategy: what each device holds, what the
compiled step communicates, where values live.

- `program`: the compiled-program reader every step report is written on —
  the per-device programs DTensor expanded a step into, their nodes,
  collectives, shapes and bytes;
- `communication`: `communication_report`, the collectives and saved
  activations of one compiled step (`capture` for the steps `fit` compiles);
- `buffers`: `MemoryReport` and the accounting of a program's buffers that
  both memory reports share;
- `memory`: `memory_report`, per-device memory of one training step;
- `pipeline_memory`: the same for a `PipelineModel`, one program per stage;
- `visualize`: `visualize_layout` and `summary`, from the variables' layouts.

The reports sit on top of the house: they may import the strategy and
`pipeline/`, and nothing below imports them (`tfpar/__init__.py` publishes
them; `tfpar.communication`, `tfpar.memory` and `tfpar.visualize` are their
old import paths).
"""
