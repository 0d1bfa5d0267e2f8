"""Planning speed (issue 14): a trillion-parameter GPT planned from a builder
in seconds and well under 1 GB of host memory, and the by-node trace that
makes it so giving exactly the plans of one trace of the whole model."""

import functools
import os
import sys
import time
import warnings

import keras
import pytest

import tfpar
from tfpar import auto_plan
from tfpar import keras_graph

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.append(os.path.join(ROOT, "benchmarks"))
from gpt import build_gpt  # noqa: E402
from planner_paper import a100_cluster  # noqa: E402
from planner_paper import paper_gpt  # noqa: E402


@pytest.fixture
def whole_model_trace(monkeypatch):
    """Makes auto_rules trace the whole model in one graph (the reference)
    instead of node by node, with no trace cached from before."""
    def use(by_node):
        auto_plan._TRACES.clear()  # noqa: SLF001
        monkeypatch.setattr(keras_graph, "trace_layer_calls", functools.partial(
            _TRACE, by_node=by_node))
    yield use
    auto_plan._TRACES.clear()  # noqa: SLF001


_TRACE = keras_graph.trace_layer_calls


def _rules_and_warnings(model, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rules = tfpar.auto_rules(model, **kwargs)
    return ([(p, repr(s)) for p, s in rules.items()],
            [str(w.message) for w in caught])


def _mixed_gpt():
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        return build_gpt(layers=3, dim=32, heads=4)
    finally:
        keras.config.set_dtype_policy("float32")


def _hub(name):
    import hub_models  # noqa: PLC0415
    return hub_models.build(name)


MODELS = {
    "gpt": lambda: build_gpt(layers=3),
    "gpt_mixed_bfloat16": _mixed_gpt,
    "gpt2_keras_hub": lambda: _hub("gpt2"),
    "llama_gqa_keras_hub": lambda: _hub("llama_gqa"),
    "mistral_keras_hub": lambda: _hub("mistral"),
}


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("name", list(MODELS))
def test_trace_by_node_gives_the_rules_of_the_whole_model_trace(
        name, sequence_parallel, whole_model_trace):
    """auto_rules from the by-node trace (identical blocks traced once) and
    from one trace of the whole model: the same rules and warnings, for
    axis sizes that split everything and for one that leaves grouped-query
    key/value heads whole (llama_gqa: 2 kv heads, axis 4)."""
    model = MODELS[name]()
    for size in (2, 4):
        found = {}
        for by_node in (True, False):
            whole_model_trace(by_node)
            found[by_node] = _rules_and_warnings(
                model, axis_size=size, sequence_parallel=sequence_parallel)
        assert found[True] == found[False]
        assert found[True][0]  # something was split


@pytest.fixture
def traced(monkeypatch):
    """The names of the nodes the by-node trace traces (not reuses), as
    they are traced."""
    names = []
    original = keras_graph._NodeTracer._trace  # noqa: SLF001

    def counting(self, node, distinct):
        names.append(node.operation.name)
        return original(self, node, distinct)

    monkeypatch.setattr(keras_graph._NodeTracer, "_trace", counting)  # noqa: SLF001
    return names


def test_repeated_blocks_are_traced_once(traced):
    """A GPT of 6 blocks: each kind of node is traced once (the first
    block's), not once per node, and a block called differently (without
    the causal mask) is traced on its own."""
    model = build_gpt(layers=6)
    nodes, _, _ = keras_graph.functional_graph(model)
    keras_graph.trace_layer_calls(model, auto_plan._weight_owners(model))  # noqa: SLF001
    assert len(nodes) == 6 * 7 + 7
    assert [n for n in traced if n.startswith("b")] == [
        "b0_ln1", "b0_attn", "b0_up", "b0_down"]  # ln2 repeats ln1
    assert len(traced) < 16

    x = keras.Input((8, 16))
    a = keras.layers.MultiHeadAttention(2, 8, name="causal")(
        x, x, use_causal_mask=True)
    b = keras.layers.MultiHeadAttention(2, 8, name="full")(a, a)
    traced.clear()
    two = keras.Model(x, b)
    keras_graph.trace_layer_calls(two, auto_plan._weight_owners(two))  # noqa: SLF001
    assert traced == ["causal", "full"]


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_blocks_whose_layers_give_no_config_are_traced_once(
        name, traced, whole_model_trace):
    """keras-hub Llama's decoder block cannot give its config (it reads an
    attribute it never set) nor Mixtral's expert block (built from
    objects): such layers are compared by their public plain attributes,
    and the blocks traced once (each was traced on its own: 5 s of a
    32-block Mixtral's 5.3 s profile), with the rules and warnings of one
    trace of the whole model."""
    model = _hub(name)
    keras_graph.trace_layer_calls(model, auto_plan._weight_owners(model))  # noqa: SLF001
    blocks = [n for n in traced if n.startswith("transformer_layer")]
    assert blocks == ["transformer_layer_0"]
    found = {}
    for by_node in (True, False):
        whole_model_trace(by_node)
        found[by_node] = _rules_and_warnings(model, axis_size=2)
    assert found[True] == found[False]


def test_a_block_whose_call_is_hooked_is_traced_on_its_own(traced):
    """A layer whose `call` an instance attribute replaces (as a hook
    does) may compute something else than its twins: its node is traced
    on its own, the others still reuse the first block's trace."""
    model = build_gpt(layers=3)
    hooked = model.get_layer("b1_up")
    plain_call = hooked.call
    hook = hooked.call = lambda *args, **kwargs: plain_call(*args, **kwargs)
    keras_graph.trace_layer_calls(model, auto_plan._weight_owners(model))  # noqa: SLF001
    assert [n for n in traced if n.endswith("_up")] == ["b0_up", "b1_up"]
    assert hooked.__dict__["call"] is hook  # put back after the trace


def test_keras_hub_backbone_is_traced_by_node_inside_its_task_model(traced):
    """keras-hub's GPT-2: the backbone (a functional model nested in the
    task model) is run node by node in place, so its second transformer
    layer reuses the first's trace (Llama's too, whose decoder gives no
    config: the test above)."""
    model = _hub("gpt2")
    keras_graph.trace_layer_calls(model, auto_plan._weight_owners(model))  # noqa: SLF001
    assert [n for n in traced if n.startswith("transformer")] == [
        "transformer_layer_0"]


def test_plans_from_the_by_node_trace_equal_the_whole_model_trace(
        whole_model_trace):
    """tfpar.plan on one GPT (8 devices): every candidate, its estimate
    and the rules are the same from either trace."""
    model, plans = build_gpt(layers=4), {}
    for by_node in (True, False):
        whole_model_trace(by_node)
        plan = tfpar.plan(model, 32,
                          cluster=tfpar.Cluster(2, 4, 1e9, 1e11, 1e10, 1e9))
        plans[by_node] = ([c.to_dict() for c in plan.candidates],
                          [(p, repr(s)) for p, s in plan.rules.items()])
    assert plans[True] == plans[False]


class _TableDeclaredFlat(keras.layers.Layer):
    """A (length, 16) table of the positions of its input, which declares
    its output (None,) — as keras-hub's Moonshine rotary embedding does
    (its declared shape is its 1-D input's, its call makes a 2-D table)."""

    def call(self, x):
        positions = keras.ops.arange(keras.ops.shape(x)[1], dtype="float32")
        return positions[:, None] * keras.ops.ones((16,))

    def compute_output_shape(self, input_shape):
        return (None,)


class _AddTable(keras.layers.Layer):
    """x + table[:length]: a 2-D index, which fails on the declared (None,)
    spec; declares its output shape, so Keras never traces it symbolically."""

    def call(self, x, table):
        return x + table[: keras.ops.shape(x)[1], :]

    def compute_output_shape(self, x_shape, table_shape):
        return x_shape


def test_a_layer_declaring_the_wrong_output_shape_is_traced_whole(
        whole_model_trace):
    """The node trace reads each node's inputs from the shapes Keras
    recorded; where a layer declared a shape its call does not make, the
    node reading it fails there, and the whole model is traced instead:
    the same rules as the whole-model trace (auto_rules failed on
    keras-hub's Moonshine before)."""
    x = keras.Input((8, 16))
    h = _AddTable(name="add")(x, _TableDeclaredFlat(name="table")(x))
    h = keras.layers.Dense(32, activation="relu", name="up")(h)
    h = keras.layers.Dense(16, name="down")(h)
    model = keras.Model(x, keras.layers.Dense(4, name="head")(h))
    found = {}
    for by_node in (True, False):
        whole_model_trace(by_node)
        found[by_node] = _rules_and_warnings(
            model, mesh=tfpar.Mesh({"data": 2, "model": 4}))
    assert found[True] == found[False]
    split = {path.split("/")[0] for path, _ in found[True][0]}
    assert split == {"up", "down"}, found


def _peak_rss_reset():
    """Resets this process' peak resident memory (VmHWM) to its current
    size (Linux: /proc/self/clear_refs) and returns it in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _peak_rss()


def _peak_rss():
    with open("/proc/self/status") as f:
        line = next(l for l in f if l.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def test_trillion_parameter_gpt_is_planned_in_seconds_in_little_memory():
    """Narayanan et al.'s 1 T row (hidden 25600, 160 heads, 128 layers,
    903 graph layers, 3072 A100s, 10 289 candidates) planned from a builder
    in seconds and well under 1 GB, as the issue asks (no weight is
    allocated: they would take 4 TB). Time: measured 6–14 s on this loaded
    2-core host (before the by-node trace 80–130 s, the trace alone 57 s);
    the bound is on this process' CPU seconds, not wall seconds: a full
    suite under load ~25 stretched the same plan to 117 s of wall time
    (14.6 s of CPU time at that load). Memory: a small plan first loads
    what any first plan in a process loads (lazily imported modules and
    kernels), then the peak growth is the trillion-parameter plan's own:
    0.25 GB in a fresh process (2026-12-07: 0.72 GB before each estimate
    held its per-stage memory as arrays, `cost.ByStage`, not a dict per
    stage; 17,997 candidates, pipelines with an expert or context axis
    among them), less after other tests whose freed heap it reuses."""
    tfpar.plan(paper_gpt(1024, 16, 2), 64, cluster=a100_cluster(64))
    before = _peak_rss_reset()
    start, cpu_start = time.perf_counter(), time.process_time()
    plan = tfpar.plan(paper_gpt(25600, 160, 128), 3072,
                      cluster=a100_cluster(3072))
    cpu_seconds = time.process_time() - cpu_start
    growth = _peak_rss() - before
    assert cpu_seconds < 40, (cpu_seconds, time.perf_counter() - start)
    assert growth < 0.4e9, growth
    assert plan.info["num_params"] > 1e12
    assert plan.axes["model"] == 8 and plan.estimate.total_memory <= 80e9
