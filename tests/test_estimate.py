"""tfpar.estimate and tfpar.Cluster.preset (issue 35): the roofline cost
model against the development set of published training runs
(`benchmarks/planner_published.py`), never above peak, a trillion-parameter
GPT read from a builder in seconds."""

import dataclasses
import os
import pathlib
import re
import sys
import threading
import time

import keras
import keras_hub
import pytest

import tfpar
from tfpar.planner import estimator, hardware, profile, roofline
from tfpar.planner import search
from tfpar.planner.transformer import transformer_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.append(os.path.join(ROOT, "benchmarks"))
from gpt import build_gpt  # noqa: E402
import planner_heldout  # noqa: E402
import planner_published  # noqa: E402
import recompute_memory  # noqa: E402

PRESETS = ("a100-40gb", "a100-80gb", "h100-sxm", "h200", "tpu-v4", "tpu-v5p")


def gpt_builder(dim, heads, layers, vocab=51200, seq_len=2048):
    def build():
        keras.config.set_dtype_policy("mixed_bfloat16")
        try:
            return build_gpt(vocab=vocab, seq_len=seq_len, dim=dim,
                             heads=heads, layers=layers)
        finally:
            keras.config.set_dtype_policy("float32")
    return build


@pytest.mark.parametrize("name", PRESETS)
def test_every_documented_preset_exists_with_its_platform_host(name):
    cluster = tfpar.Cluster.preset(name, num_hosts=2)
    per_host = 4 if name.startswith("tpu") else 8
    assert cluster.devices_per_host == per_host
    assert cluster.num_devices == 2 * per_host
    assert cluster.hardware is hardware.PRESETS[name]
    hw = hardware.PRESETS[name]
    assert cluster.device_flops == hw.peak("bfloat16") * hw.gemm
    # documented: named in Cluster.preset's docstring and hardware's table
    assert f'"{name}"' in tfpar.Cluster.preset.__doc__
    assert tfpar.Cluster.preset(name, devices_per_host=2).devices_per_host == 2


def test_an_unknown_preset_names_the_known_ones():
    with pytest.raises(ValueError, match="a100-80gb.*tpu-v5p"):
        tfpar.Cluster.preset("a100")


def test_the_development_set_is_estimated_within_the_issue_bounds():
    errors = planner_published.errors()
    mae, worst = planner_published.summary(errors)
    assert len(errors) >= 30
    assert len(errors) + len(planner_published.LEFT_OUT) == 35
    assert mae <= 0.10, errors
    assert worst <= 0.25, errors


def test_the_docs_quote_the_figures_the_benchmarks_compute():
    """README and docs/status.md quote the development set's and the
    held-out set's counts and errors, and the pairs ordered: each equals
    what the benchmark scripts compute today (a stale figure fails)."""
    dev = planner_published.errors()
    held = planner_heldout.errors()
    dev_mae, dev_worst = planner_published.summary(dev)
    held_mae, held_worst = planner_published.summary(held)
    agree, total, _ = planner_heldout.pair_agreement()
    root = pathlib.Path(__file__).resolve().parents[1]
    status = " ".join((root / "docs" / "status.md").read_text().split())
    readme = " ".join((root / "README.md").read_text().split())
    dev_text = (rf"{len(dev)} published GPT runs (on \S+ )?within "
                rf"{dev_mae:.1%} mean")
    held_text = rf"{len(held)} held-out runs within {held_mae:.1%}"
    for text in (dev_text, held_text):
        text = text.replace(".", r"\.")
        assert re.search(text, status) and re.search(text, readme), text
    assert f"(worst {dev_worst:.1%})" in status
    assert f"(worst {held_worst:.1%})" in status
    assert f"reproduced for {agree} of {total} published pairs" in status


def test_no_published_configuration_runs_above_peak():
    for row in planner_published.ROWS:
        _, _, executed, peak = planner_published.estimate_row(row)
        assert 0 < executed <= peak, row


@pytest.mark.parametrize("row", [r for r in planner_published.ROWS
                                 if r.startswith("N21-T1")])
def test_narayanan_table1_published_configuration_within_25_percent(row):
    estimated, published, _, _ = planner_published.estimate_row(row)
    assert abs(estimated / published - 1) <= 0.25


def test_the_fit_reproduces_the_preset_constants():
    constants = planner_published.fit(list(planner_published.ROWS))
    for name, (gemm, half) in constants.items():
        assert (hardware.PRESETS[name].gemm,
                hardware.PRESETS[name].gemm_half) == (gemm, half)


def test_the_link_fit_reproduces_jean_zays_figure_from_development_rows():
    """BLOOM's cluster's inter-node efficiency is fitted on the development
    set's S5 rows alone (`fit_links`), the value the held-out BLOOM rows
    use; with S5 left out it falls back to the preset's InfiniBand 0.9."""
    rows = list(planner_published.ROWS)
    for source, (field, _) in planner_published.LINK_GRID.items():
        fitted = planner_published.fit_links(rows)[source][field]
        assert fitted == planner_published.LINKS[source][field]
        assert planner_heldout.LINKS["BL"][field] == fitted
        others = [r for r in rows if planner_published.ROWS[r][0] != source]
        assert field not in planner_published.fit_links(others)[source]


def test_trillion_parameter_gpt_from_a_builder_in_seconds():
    start = time.perf_counter()
    e = tfpar.estimate(
        gpt_builder(25600, 160, 128), 3072,
        cluster=tfpar.Cluster.preset("a100-80gb", num_hosts=384),
        axes={"data": 6, "pipe": 64, "model": 8}, recompute="full")
    seconds = time.perf_counter() - start
    assert seconds < 30
    assert e.step_time_s == pytest.approx(sum(e.breakdown.values()))
    assert e.executed_flops / e.step_time_s <= 312e12
    assert 60 < e.step_time_s < 150  # published (Narayanan): 102.6 s


def test_a_builder_is_read_as_its_transformer_dimensions():
    model = profile.build_without_weights(gpt_builder(2304, 24, 24))
    profiled = profile.profile_model(model)
    shape = estimator.transformer_of(profiled)
    assert (shape.layers, shape.hidden, shape.heads, shape.seq, shape.vocab,
            shape.ffn_width) == (24, 2304, 24, 2048, 51200, 4 * 2304)
    assert not shape.tied and shape.position_embedding and not shape.dropout
    assert shape.num_params() == pytest.approx(
        profiled.num_params, rel=1e-3)


def test_recomputation_and_schedules_order_the_step_times():
    gpt = roofline.Transformer(layers=96, hidden=12288, heads=96, seq=2048,
                               vocab=51200)
    hw = hardware.PRESETS["a100-80gb"]

    def step(**kw):
        cfg = roofline.Parallel(pipe=8, model=8, **kw)
        return roofline.step_time(gpt, cfg, hw, 64)

    none, selective, full = (step(recompute=r) for r in roofline.RECOMPUTE)
    assert none["total"] < selective["total"] < full["total"]
    assert selective["recompute"] < 0.2 * full["recompute"]
    interleaved = step(recompute="full", virtual_stages=3)
    assert interleaved["bubble"] == pytest.approx(full["bubble"] / 3, rel=0.01)
    memory = [sum(roofline.memory(gpt, roofline.Parallel(
        pipe=8, model=8, recompute=r), 64).values())
        for r in roofline.RECOMPUTE]
    assert memory[0] > memory[1] > memory[2]


def test_bad_configurations_are_refused_before_costing():
    cluster = tfpar.Cluster.preset("h100-sxm")
    build = gpt_builder(64, 4, 2, vocab=128, seq_len=16)
    with pytest.raises(ValueError, match="uses 4 devices; the cluster has 8"):
        tfpar.estimate(build, 8, cluster=cluster, axes={"data": 4})
    with pytest.raises(ValueError, match=(
            "expert parallelism of 2, but the model has no "
            "mixture-of-experts layer")):
        tfpar.estimate(build, 8, cluster=cluster,
                       axes={"data": 4, "expert": 2})
    with pytest.raises(ValueError, match=(
            "context=8 does not divide the sequence length 12")):
        tfpar.estimate(gpt_builder(64, 4, 2, vocab=128, seq_len=12), 8,
                       cluster=cluster, axes={"context": 8})
    with pytest.raises(ValueError, match=r"capacity_factor\) must be None"):
        tfpar.estimate(build, 8, cluster=cluster, axes={"data": 8},
                       capacity_factor=0)
    with pytest.raises(ValueError, match="recompute"):
        tfpar.estimate(build, 8, cluster=cluster, axes={"data": 8},
                       recompute="attention")
    with pytest.raises(ValueError, match="num_microbatches=3"):
        tfpar.estimate(build, 8, cluster=cluster, axes={"data": 8},
                       num_microbatches=3)
    e = tfpar.estimate(build, 16, cluster=cluster, axes={"data": 8},
                       num_microbatches=2, fsdp=True)
    assert e.step_time_s > 0 and e.memory_per_device["optimizer"] > 0


def test_interleaved_configurations_are_checked_as_the_planner_builds_them():
    cluster = tfpar.Cluster.preset("h100-sxm")
    build = gpt_builder(64, 4, 4, vocab=128, seq_len=16)  # 4 blocks
    axes = {"data": 4, "pipe": 2}
    with pytest.raises(ValueError, match="virtual_stages >= 2"):
        tfpar.estimate(build, 8, cluster=cluster, axes=axes,
                       schedule="interleaved")
    with pytest.raises(ValueError, match="num_microbatches=1. Use a multip"):
        tfpar.estimate(build, 8, cluster=cluster, axes=axes,
                       num_microbatches=1, virtual_stages=2)
    with pytest.raises(ValueError, match="4 blocks do not split into"):
        tfpar.estimate(build, 8, cluster=cluster, axes=axes,
                       virtual_stages=4)
    with pytest.raises(ValueError, match="needs axes with 'pipe' > 1"):
        tfpar.estimate(build, 8, cluster=cluster, axes={"data": 8},
                       virtual_stages=2)
    with pytest.raises(ValueError, match="virtual_stages"):
        tfpar.estimate(build, 8, cluster=cluster, axes=axes,
                       virtual_stages=1.5)
    e = tfpar.estimate(build, 8, cluster=cluster, axes=axes,
                       virtual_stages=2)
    assert e.step_time_s > 0


def test_a_keras_hub_gemma_is_read_with_heads_wider_than_its_width():
    """Gemma's heads are not hidden / heads wide (7B: 16 × 256 at 3072)
    and its query kernel is (heads, hidden, head width): read from the
    kernel's einsum equation, the shape holds the model's parameters and
    `tfpar.estimate` costs it (it could not find a token table of width
    4, the heads, before)."""
    import keras_hub  # noqa: PLC0415 (installed; slow to import)

    def build():
        return keras_hub.models.GemmaBackbone(
            vocabulary_size=1000, num_layers=2, num_query_heads=4,
            num_key_value_heads=1, hidden_dim=128, intermediate_dim=512,
            head_dim=64)
    profiled = profile.profile_model(profile.build_without_weights(build),
                                     sequence_length=64)
    shape = estimator.transformer_of(profiled)
    assert (shape.hidden, shape.heads, shape.kv_heads, shape.head_dim,
            shape.attention_width, shape.ffn_width, shape.gated) == (
                128, 4, 1, 64, 256, 256, True)
    assert shape.num_params() == pytest.approx(profiled.num_params, rel=1e-2)
    e = tfpar.estimate(build, 8, cluster=tfpar.Cluster.preset("a100-80gb"),
                       axes={"data": 4, "model": 2}, sequence_length=64)
    assert e.step_time_s > 0 and e.memory_per_device["activations"] > 0


# keras-hub's decoder-only language models, widths that no two of hidden
# (32), MLP (48), vocabulary (256) and sequence (16) share (the reader
# tells the MLP's width from the others).
_M = keras_hub.models
_DECODER = dict(vocabulary_size=256, num_layers=2, hidden_dim=32,
                intermediate_dim=48)
HUB_DECODERS = {
    "gpt_neox": lambda: _M.GPTNeoXBackbone(  # fused query_key_value
        num_heads=4, max_sequence_length=16, **_DECODER),
    "smollm3": lambda: _M.SmolLM3Backbone(  # q_proj, num_attention_heads
        vocabulary_size=256, hidden_dim=32, intermediate_dim=48,
        num_layers=2, num_attention_heads=4, num_key_value_heads=2,
        attention_bias=False, attention_dropout=0.0,
        rope_layer_enabled_list=[True, False],
        layer_types=["attention", "attention"], mlp_bias=False,
        layer_norm_epsilon=1e-6, max_position_embeddings=16,
        rope_theta=10000.0, partial_rotary_factor=1.0),
    "opt": lambda: _M.OPTBackbone(num_heads=4, max_sequence_length=16,
                                  **_DECODER),
    "bloom": lambda: _M.BloomBackbone(num_heads=4, **_DECODER),
    "falcon": lambda: _M.FalconBackbone(num_attention_heads=4, **_DECODER),
    "phi3": lambda: _M.Phi3Backbone(num_query_heads=4, num_key_value_heads=4,
                                    **_DECODER),
    "qwen2": lambda: _M.Qwen2Backbone(num_query_heads=4,
                                      num_key_value_heads=2, **_DECODER),
    "qwen3": lambda: _M.Qwen3Backbone(num_query_heads=4,
                                      num_key_value_heads=2, head_dim=16,
                                      **_DECODER),
    "gemma3": lambda: _M.Gemma3Backbone(
        image_size=None, num_query_heads=4, num_key_value_heads=2,
        head_dim=16, **_DECODER),
    "mistral": lambda: _M.MistralBackbone(
        num_query_heads=4, num_key_value_heads=2, sliding_window=16,
        **_DECODER),
    "qwen3_moe": lambda: _M.Qwen3MoeBackbone(
        num_query_heads=4, num_key_value_heads=2, head_dim=16,
        moe_intermediate_dim=48, num_experts=4, top_k=2, **_DECODER),
    "gpt_oss": lambda: _M.GptOssBackbone(
        num_query_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, top_k=2, **_DECODER),
}


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=[] if name in ("gpt_neox", "smollm3")
                 else pytest.mark.slow)
    for name in HUB_DECODERS])
def test_keras_hub_decoders_are_read_with_their_parameters(name):
    """Every keras-hub decoder family's shape (mixture-of-experts ones
    with their experts) holds its parameters (within 2%: norms and biases
    it does not name) and `tfpar.estimate` costs it.
    SmolLM3's `q_proj` was not taken for a query (no attention found);
    Qwen3's and Gemma 3's heads (4 × 16 at width 32) were read as 4 × 8;
    GPT-NeoX's fused query-key-value kernel holds the query in a third."""
    build = HUB_DECODERS[name]
    profiled = profile.profile_model(profile.build_without_weights(build),
                                     sequence_length=16)
    shape = estimator.transformer_of(profiled)
    assert (shape.hidden, shape.heads, shape.ffn_width) == (32, 4, 48)
    assert shape.num_params() == pytest.approx(profiled.num_params, rel=0.02)
    e = tfpar.estimate(build, 8, cluster=tfpar.Cluster.preset("a100-80gb"),
                       axes={"data": 4, "model": 2}, sequence_length=16)
    assert e.step_time_s > 0


def test_a_keras_hub_llama_is_read_with_grouped_heads_and_a_gated_mlp():
    import keras_hub  # noqa: PLC0415 (installed; slow to import)

    def build():
        return keras_hub.models.LlamaBackbone(
            vocabulary_size=1000, num_layers=2, num_query_heads=8,
            num_key_value_heads=2, hidden_dim=256, intermediate_dim=688)
    profiled = profile.profile_model(profile.build_without_weights(build),
                                     sequence_length=128)
    shape = estimator.transformer_of(profiled)
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads,
            shape.ffn_width, shape.gated, shape.seq) == (
                2, 256, 8, 2, 688, True, 128)
    assert shape.num_params() == pytest.approx(profiled.num_params, rel=1e-2)


def test_plan_on_a_preset_is_costed_by_the_roofline_and_beats_the_paper():
    """Narayanan's 1.7B row: tfpar.plan on the preset A100 cluster chooses
    a configuration whose roofline estimate is at most the published
    configuration's (t=1, p=1, data 32, full recomputation)."""
    build = gpt_builder(2304, 24, 24)
    cluster = tfpar.Cluster.preset("a100-80gb", num_hosts=4)
    plan = tfpar.plan(build, 512, cluster=cluster)
    published = tfpar.estimate(build, 512, cluster=cluster,
                               axes={"data": 32}, recompute="full")
    chosen = plan.estimate
    assert chosen.executed_flops > 0  # costed by the roofline
    assert chosen.step_time_s == pytest.approx(sum(chosen.breakdown.values()))
    assert chosen.step_time_s <= published.step_time_s
    assert "memory_bound" in plan.explain()


def test_the_held_out_set_is_within_the_issue_bounds():
    """Published runs not in the development set (Megatron-Core H100 with
    tensor/pipeline parallelism, llm-foundry FSDP on A100/H100, BLOOM's
    topology benchmarks, MaxText's FSDP and tensor parallelism on TPU
    v5p, its FSDP on TPU v4): mean absolute error <= 15%, none off by
    more than 35%, with the development set's constants."""
    errors = planner_heldout.errors()
    mae, worst = planner_published.summary(errors)
    assert len(errors) >= 40
    assert {planner_heldout.ROWS[r][0] for r in errors} == {
        "MC", "LF", "BL", "MX"}
    assert {planner_heldout.ROWS[r][1] for r in errors} == {
        "a100-40gb", "a100-80gb", "h100-sxm", "tpu-v4", "tpu-v5p"}
    assert mae <= 0.15, errors
    assert worst <= 0.35, errors


def test_held_out_pairs_of_fsdp_configurations_are_ordered_as_published():
    """llm-foundry: two configurations of one MPT size on one GPU type whose
    published tokens/s per GPU differ by >= 10%: the faster one is
    estimated faster."""
    pairs = [p for p in planner_heldout.pairs()
             if planner_heldout.ROWS[p[0]][0] == "LF"]
    _, _, wrong = planner_heldout.pair_agreement()
    assert len(pairs) >= 5
    assert not [p for p in wrong if p in pairs]


@pytest.mark.xfail(strict=True, reason=(
    "known shortfall: the roofline orders 42 of BLOOM's 49 pairs (34 "
    "before the runtimes' rank order, 28 before Jean Zay's Omni-Path "
    "efficiency was fitted on the development rows). Each of the 7 left "
    "has a tensor 8, micro-batch 4 run (data 6, 8 or 4), estimated 10-14% "
    "too slow: at t=8 micro-batch 4 ran ~10% faster per sample than 2, "
    "~17-20 ms per block and micro-batch that no hardware term gives: "
    "GEMM rows 4096 -> 8192 gain 1.5%, and a fixed cost that size makes "
    "Megatron's t=8 development rows (Narayanan, Korthikanti) 70-140% too "
    "slow (5 ms already 43%). Also tried (docs/benchmarks.md, held-out "
    "set): wave quantization (49 of 54, development worst 27.7%), BLOOM's "
    "CUDA_LAUNCH_BLOCKING=1 at its own measured cost (49-51), the bubble "
    "of unbalanced stages (46)"))
def test_every_held_out_pair_is_ordered_as_published():
    agree, total, _ = planner_heldout.pair_agreement()
    assert agree == total


def test_megatron_rank_order_gives_a_data_group_its_hosts_ports():
    """Megatron-LM and DeepSpeed put the pipe axis outermost
    (`pipe_outermost`): with t=4 on 8-GPU hosts a data group has two
    members per host and uses two ports, half the exposed reduction of
    tfpar's data-outermost order (members t·p apart, one per host); and
    neighbouring stages, t·d apart, leave the host where tfpar's (t
    apart) stay in it."""
    gpt = roofline.Transformer(layers=48, hidden=4096, heads=32, seq=2048,
                               vocab=51200)
    hw = hardware.PRESETS["a100-80gb"]

    def parts(**axes):
        return [roofline.step_time(gpt, roofline.Parallel(
            **axes, pipe_outermost=outermost), hw, 512)
            for outermost in (False, True)]

    tfpar_order, megatron_order = parts(data=8, pipe=4, model=4,
                                        grad_overlap=False)
    assert tfpar_order["data"] / megatron_order["data"] == pytest.approx(
        2, rel=0.05)
    assert tfpar_order["pipe"] == megatron_order["pipe"]
    tfpar_order, megatron_order = parts(data=4, pipe=2, model=2)
    assert megatron_order["pipe"] > 3 * tfpar_order["pipe"]
    assert megatron_order["data"] < tfpar_order["data"] / 3


def test_slices_cost_groups_that_span_them_on_the_data_center_network():
    """`Cluster.preset("tpu-v5p", num_hosts=32, num_slices=2)`: 128 chips
    in two slices of 64. A group inside a slice keeps ICI; a group over
    both runs hierarchically (`hardware.across_slices`: a ring in each
    slice, then one over the slices at Google's 50 Gb/s per chip), and a
    group of one chip per slice is the data-center link itself. The
    α-β `Cluster.link` and the roofline's `link` agree on that shape; a
    pipeline whose stages sit in two slices sends at the data-center
    rate; with one slice nothing changes."""
    hw = hardware.PRESETS["tpu-v5p"]
    two = tfpar.Cluster.preset("tpu-v5p", num_hosts=32, num_slices=2)
    one = tfpar.Cluster.preset("tpu-v5p", num_hosts=32)
    assert (two.devices_per_slice, two.slice_bandwidth) == (64, 50e9 / 8)
    dcn = (hw.dcn_latency, hw.dcn_bandwidth * hw.network_inter)
    assert roofline.link(two, hw, 64, 1) == roofline.link(one, hw, 64, 1)
    assert roofline.link(two, hw, 2, 64) == pytest.approx(dcn)
    ici = roofline.link(one, hw, 64, 1)
    assert roofline.link(two, hw, 128, 1) == pytest.approx(
        hardware.across_slices(128, 64, ici, dcn))
    # The same seconds as the two rings run one after the other.
    nbytes = 1e9
    assert roofline.ring("all-reduce", nbytes, 128, roofline.link(
        two, hw, 128, 1)) == pytest.approx(
            roofline.ring("all-reduce", nbytes, 64, ici)
            + roofline.ring("all-reduce", nbytes / 64, 2, dcn))
    assert two.link(128, 1) == pytest.approx(hardware.across_slices(
        128, 64, two.link(64, 1), (two.slice_latency, two.slice_bandwidth)))
    gpt = roofline.Transformer(layers=16, hidden=4096, heads=32, seq=2048,
                               vocab=32000)

    def step(cluster, **axes):
        return roofline.step_time(gpt, roofline.Parallel(**axes), hw, 256,
                                  cluster)

    data = dict(data=32, model=4, grad_overlap=False)
    assert step(two, **data)["data"] > step(one, **data)["data"]
    assert step(two, **data)["compute"] == step(one, **data)["compute"]
    pipe = dict(data=16, pipe=2, model=4, pipe_outermost=True)  # slice s
    assert step(two, **pipe)["pipe"] > 3 * step(one, **pipe)["pipe"]
    estimate = tfpar.estimate(gpt_builder(1024, 16, 4, seq_len=512), 64,
                              cluster=tfpar.Cluster.preset(
                                  "tpu-v5p", num_hosts=4, num_slices=2),
                              axes={"data": 16}, fsdp=True)
    assert estimate.step_time_s > tfpar.estimate(
        gpt_builder(1024, 16, 4, seq_len=512), 64,
        cluster=tfpar.Cluster.preset("tpu-v5p", num_hosts=4),
        axes={"data": 16}, fsdp=True).step_time_s


def test_slices_are_refused_where_they_do_not_apply():
    with pytest.raises(ValueError, match=r"slices are a TPU pod's"):
        tfpar.Cluster.preset("a100-80gb", num_hosts=2, num_slices=2)
    with pytest.raises(ValueError, match=r"does not publish for tpu-v4\. "
                       r"Pass slice_bandwidth="):
        tfpar.Cluster.preset("tpu-v4", num_hosts=2, num_slices=2)
    assert tfpar.Cluster.preset("tpu-v4", num_hosts=2, num_slices=2,
                                slice_bandwidth=6e9).slice_bandwidth == 6e9
    with pytest.raises(ValueError, match=r"num_slices=1 has none"):
        tfpar.Cluster.preset("tpu-v4", num_hosts=2, slice_bandwidth=6e9)
    with pytest.raises(ValueError, match=r"num_slices\) must divide "
                       r"num_hosts \(3\)"):
        tfpar.Cluster.preset("tpu-v5p", num_hosts=3, num_slices=2)
    with pytest.raises(ValueError, match=r"needs slice_bandwidth"):
        tfpar.Cluster(num_hosts=2, devices_per_host=4, device_memory=1e9,
                      device_flops=1e12, intra_host_bandwidth=1e9,
                      inter_host_bandwidth=1e9, num_slices=2)


def test_the_order_of_estimates_axes_is_the_meshs():
    """`tfpar.estimate(axes)` lays devices out in the dict's order, as
    `tfpar.Mesh` does: on 8-GPU hosts with t=2, p=2, "pipe" before "data"
    puts four members of each data group on a host (two with data
    first): about half the gradient reduction, and stage neighbours on
    other hosts (in one with data first)."""
    def estimate(axes):
        return tfpar.estimate(
            gpt_builder(1024, 16, 4, seq_len=512), 64,
            cluster=tfpar.Cluster.preset("a100-80gb", num_hosts=4),
            axes=axes, num_microbatches=4).breakdown

    data_first = estimate({"data": 8, "pipe": 2, "model": 2})
    pipe_first = estimate({"pipe": 2, "data": 8, "model": 2})
    # Twice the ports; the ring's latency steps do not shrink.
    assert 1.5 < data_first["data"] / pipe_first["data"] <= 2
    assert pipe_first["pipe"] > 2 * data_first["pipe"]
    assert estimate({"model": 2, "data": 8, "pipe": 2}) == data_first


def test_full_recomputation_keeps_one_input_per_block():
    """tfpar recomputes each transformer block as one call
    (`tfpar.recompute_spans`), so examples/gpt.py (one Keras layer per op)
    keeps each block's input alone, as a keras-hub block (one layer) and
    Megatron-LM do; `tfpar.estimate`'s activations under recompute="full"
    are Korthikanti's 2·s·b·h per block."""
    def hub_gpt2():
        return keras_hub.models.GPT2CausalLM(keras_hub.models.GPT2Backbone(
            vocabulary_size=512, num_layers=4, num_heads=8, hidden_dim=256,
            intermediate_dim=1024, max_sequence_length=128),
            preprocessor=None)

    def read(build):
        return transformer_of(profile.profile_model(
            profile.build_without_weights(build), 128))

    per_op = gpt_builder(256, 8, 4, vocab=512, seq_len=128)
    gpt = read(per_op)
    assert (gpt.kept_hidden, gpt.kept_wide) == (1, 0)
    blocks = read(hub_gpt2)
    assert (blocks.kept_hidden, blocks.kept_wide) == (1, 0)

    def activations(recompute):
        return tfpar.estimate(
            per_op, 16, cluster=tfpar.Cluster.preset("a100-80gb"),
            axes={"data": 2, "model": 4}, recompute=recompute
        ).memory_per_device["activations"]

    cfg = roofline.Parallel(data=2, model=4, recompute="full", microbatch=8)
    sbh = roofline.tokens(gpt, cfg) * gpt.hidden * gpt.compute_bytes / 2
    # 2 per block, and the final norm's and the head's inputs, 2 each.
    assert activations("full") == pytest.approx((2 * gpt.layers + 4) * sbh)
    assert activations("full") < activations(None)


def test_full_recomputation_memory_is_what_the_compiled_step_saves():
    """examples/gpt.py recomputed in full on data=2 x model=4: the
    compiled step's saved activations per device are within 25% of
    `tfpar.estimate`'s (2.36 MB measured, 2.10 estimated on 2026-12-06:
    each block's input, the final norm's and the head's; recomputed layer
    by layer, before blocks were recomputed whole, the step kept 6.56).
    The model and the measurement are benchmarks/recompute_memory.py's."""
    estimate = tfpar.estimate(
        recompute_memory.ops, recompute_memory.BATCH,
        cluster=tfpar.Cluster.preset("a100-80gb"),
        axes={"data": 2, "model": 4}, recompute="full")
    candidate = search.Candidate({"data": 2, "pipe": 1, "model": 4}, False,
                                 "full", 1, "1f1b", None,
                                 vocab_parallel=True)
    saved = recompute_memory.saved_activations(
        candidate, recompute_memory.ops, hub=False)
    assert saved == pytest.approx(
        estimate.memory_per_device["activations"], rel=0.25)


@pytest.mark.parametrize("tied", [True, False])
def test_stage_parameters_sum_to_the_model_with_and_without_a_pipeline(tied):
    """A tied head is the embedding table: counted once on one stage (p=1:
    first and last at once), the stages summing to num_params."""
    model = roofline.Transformer(layers=4, hidden=256, heads=4, seq=128,
                                 vocab=1000, tied=tied)
    assert roofline.stage_params(model, 4, True, True) == model.num_params()
    for p in (2, 4):
        blocks = roofline._stage_blocks(model.layers, p)
        assert sum(roofline.stage_params(model, n, s == 0, s == p - 1)
                   for s, n in enumerate(blocks)) == model.num_params()


def test_fsdp_first_gather_is_one_block_of_the_stage():
    """With fsdp each micro-batch's first gather (nothing hides it) moves
    one block's weights: a stage of 4 blocks of an 8-block model with a
    pipe axis gathers as much as a 4-block model without one."""
    hw = dataclasses.replace(hardware.PRESETS["a100-80gb"],
                             collective_share=0.0)  # what overlaps is free

    def first_gather(layers, pipe):
        model = roofline.Transformer(layers=layers, hidden=1024, heads=16,
                                     seq=2048, vocab=128,
                                     position_embedding=False)
        cfg = roofline.Parallel(data=2, pipe=pipe, microbatch=8, fsdp=True)
        return roofline.step_time(model, cfg, hw, 16 * pipe)["data"] / pipe

    assert first_gather(8, 2) == pytest.approx(first_gather(4, 1), rel=0.01)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_full_recomputation_rebuilds_one_block_of_activations(
        sequence_parallel):
    """Full recomputation's workspace is one block's activations as stored
    without recomputation (Korthikanti: 10 + 24/t + 5as/(ht), 34/t + ...
    with sequence parallelism), here with t = 8."""
    model = roofline.Transformer(layers=8, hidden=1024, heads=16, seq=2048,
                                 vocab=1000)

    def memory(recompute):  # pipe 2, one micro-batch in flight
        cfg = roofline.Parallel(pipe=2, model=8, recompute=recompute,
                                sequence_parallel=sequence_parallel)
        return roofline.memory(model, cfg, 1)
    stored = memory(None)["activations"] / 4  # 4 blocks on the stage
    assert memory("full")["workspace"] == pytest.approx(stored)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_stored_activations_follow_the_attention_and_mlp_widths(
        sequence_parallel):
    """Korthikanti's 24/t (34/t) holds query, key, value and the output
    projection's input at 8/t and the MLP's GeLU input and output at 16/t
    for f = 4h: heads twice as wide add 8/t, a SwiGLU MLP of f = 3.5h
    (gate, up and their product: Megatron-LM's fused SwiGLU) stores
    16/t · 1.5 · 3.5/4, here with t = 4."""
    def per_block(**kw):
        model = roofline.Transformer(layers=4, hidden=1024, heads=16,
                                     seq=2048, vocab=1000, **kw)
        cfg = roofline.Parallel(pipe=2, model=4, flash=True,
                                sequence_parallel=sequence_parallel)
        sbh = roofline.tokens(model, cfg) * model.hidden * 2 / 2
        return roofline.memory(model, cfg, 1)["activations"] / 2 / sbh
    t = 4
    korthikanti = 34 / t if sequence_parallel else 10 + 24 / t
    assert per_block() == pytest.approx(korthikanti)
    assert per_block(key_dim=128) == pytest.approx(korthikanti + 8 / t)
    assert per_block(ffn=3584, gated=True) == pytest.approx(
        korthikanti + 16 / t * (1.5 * 3.5 / 4 - 1))
    # half the blocks gated (Moonshine: plain encoder, gated decoder MLPs)
    assert per_block(ffn=3584, gated=0.5) == pytest.approx(
        korthikanti + 16 / t * (1.25 * 3.5 / 4 - 1))
    # a cross attention per block: another attention's norm input, query
    # input and dropout mask (5, ÷ t under sequence parallelism) and its
    # Q, K, V and output projection's input (8/t)
    cross = (5 / t if sequence_parallel else 5) + 8 / t
    assert per_block(cross_attention=1.0) == pytest.approx(
        korthikanti + cross)


def test_concurrent_builds_leave_the_optimizer_constructor_as_it_was():
    """Two threads building without weights at once (the first finishing
    while the second is inside): BaseOptimizer.__init__ ends as Keras'
    own, and an optimizer made inside either build works."""
    base = keras.src.optimizers.base_optimizer.BaseOptimizer
    original = base.__init__
    inside, built = threading.Event(), []

    def build_after(seconds, signal=None):
        def build():
            if signal is not None:
                signal.set()
            keras.optimizers.Adam()  # its step counter is a variable
            time.sleep(seconds)
            return build_gpt(vocab=128, seq_len=16, dim=64, heads=4,
                             layers=2)
        return lambda: built.append(profile.build_without_weights(build))

    first = threading.Thread(target=build_after(0.2, inside))
    second = threading.Thread(target=build_after(0.5))
    first.start()
    inside.wait(10)
    second.start()
    first.join(30)
    second.join(30)
    assert len(built) == 2
    assert base.__init__ is original


def test_interleaved_end_stages_send_the_wrap_around_too():
    """pipe 2, v = 2: chunks 0..3 on stages 0, 1, 0, 1; each stage sends
    3 times per micro-batch (chunk 1 -> 2 wraps around) against once
    without interleaving."""
    model = roofline.Transformer(layers=8, hidden=1024, heads=16, seq=2048,
                                 vocab=1000)
    hw = hardware.PRESETS["a100-80gb"]

    def pipe(v):
        cfg = roofline.Parallel(data=4, pipe=2, virtual_stages=v,
                                schedule="interleaved" if v > 1 else "1f1b")
        return (roofline.step_time(model, cfg, hw, 16)["pipe"],
                roofline.communication_bytes(model, cfg, 16)["pipe"])
    (seconds, nbytes), (seconds_v, nbytes_v) = pipe(1), pipe(2)
    assert seconds_v == pytest.approx(3 * seconds)
    assert nbytes_v == pytest.approx(3 * nbytes)


@pytest.mark.parametrize("tf32", [False, True])
def test_a_float32_model_is_costed_at_its_peak_with_its_activations(tf32):
    """float32 compute on an A100: GEMMs at the TF32 peak (156 TFLOP/s)
    when TensorFlow allows TF32, else at the fp32 one (19.5), never at
    bf16's 312; activations twice the bf16 model's bytes."""
    half = roofline.Transformer(layers=4, hidden=2048, heads=16, seq=2048,
                                vocab=51200)
    full = dataclasses.replace(half, compute_bytes=4)
    hw = hardware.PRESETS["a100-80gb"]
    cfg = roofline.Parallel(data=8, microbatch=4, tf32=tf32)
    step = roofline.step_time(full, cfg, hw, 32)
    peak = hw.peak_flops["tensorfloat32" if tf32 else "float32"]
    assert step["executed_flops"] / step["compute"] <= peak
    bf16 = roofline.step_time(half, cfg, hw, 32)
    assert bf16["executed_flops"] / bf16["compute"] > peak
    assert roofline.memory(full, cfg, 32)["activations"] == pytest.approx(
        2 * roofline.memory(half, cfg, 32)["activations"])


MOE = roofline.Transformer(layers=4, hidden=1024, heads=16, seq=2048,
                           vocab=32000, ffn=3584, gated=True, dropout=False,
                           tied=False, position_embedding=False, experts=8,
                           top_k=2)


def _expert_ffn_flops(model, cfg):
    """FLOPs of one block's expert GEMMs on one device, forward (the
    router and dispatch einsums left out), from the roofline."""
    dev = roofline._Device(hardware.PRESETS["h100-sxm"])
    time = roofline._Time()
    e, cap = cfg.expert, roofline.capacity(model, cfg)
    rows = e * cap if cfg.expert_on_data else cap
    for n, k in ((2 * model.ffn_width, model.hidden),
                 (model.hidden, model.ffn_width)):
        dev.gemm(time, rows, n / cfg.model, k, count=model.experts / e)
    return time.flops


def test_expert_placements_cost_the_routed_work_and_exchanges_by_formula():
    """Issue 36 item 5: with capacity_factor=1.25 a device computes
    k·1.25/E of keras-hub's masked expert FLOPs (every expert on every
    token: dropless under static shapes) on data=8 — with the banks over
    the data axis at the same tokens per device, with a separate expert
    axis (data=2 x expert=4, 4x the tokens per device) at the same global
    batch, whose devices repeat the attention; the exchanges' bytes are
    their formulas."""
    hw = hardware.PRESETS["h100-sxm"]
    batch, T, h = 16, MOE.seq, MOE.hidden                   # b = 1
    masked = roofline.Parallel(data=8, microbatch=1)
    folded = roofline.Parallel(data=8, expert=8, expert_on_data=True,
                               microbatch=1, capacity_factor=1.25)
    separate = roofline.Parallel(data=2, expert=4, microbatch=1,
                                 capacity_factor=1.25)
    masked_flops = _expert_ffn_flops(MOE, masked) / MOE.experts  # E·T rows
    bound = MOE.top_k * 1.25 / MOE.experts
    assert _expert_ffn_flops(MOE, folded) / (
        masked_flops * MOE.experts) == pytest.approx(bound)
    # a separate axis: 4x the micro-batches per device (8 vs 2), the same
    # per-device work per step
    per_step = {name: roofline.microbatches(cfg, batch)
                * _expert_ffn_flops(MOE, cfg)
                for name, cfg in (("masked", masked), ("separate", separate))}
    assert per_step["separate"] / per_step["masked"] == pytest.approx(bound)
    steps = {name: roofline.step_time(MOE, cfg, hw, batch)
             for name, cfg in (("masked", masked), ("folded", folded),
                               ("separate", separate))}
    assert steps["folded"]["executed_flops"] < 0.6 * steps["masked"][
        "executed_flops"]
    assert steps["separate"]["executed_flops"] > steps["folded"][
        "executed_flops"]   # attention repeated on the expert axis
    assert steps["masked"]["expert"] == 0 < steps["folded"]["expert"]
    cap = roofline.capacity(MOE, folded)
    assert cap == 1.25 * MOE.top_k * T / MOE.experts        # 640, exact
    # Experts over data: 4 exchanges of the [E, C, h] blocks per block and
    # micro-batch, each an all-gather of the 8 devices' blocks.
    m = batch // 8
    sent = roofline.communication_bytes(MOE, folded, batch)["expert"]
    assert sent == pytest.approx(MOE.layers * m * 4 * 8 * (
        MOE.experts * cap * h * 2))
    assert 8 * MOE.experts * cap * h == 8 * T * h * MOE.top_k * 1.25
    # A separate axis: the combine's all-reduce of T x h forward; backward
    # its gradient's all-reduce (T x h) and the combine weights' gradient
    # (T x E x C, float32) gathered.
    m = batch // 2
    sent = roofline.communication_bytes(MOE, separate, batch)["expert"]
    assert sent == pytest.approx(MOE.layers * m * (
        2 * T * h * 2 + T * MOE.experts * cap * 4))
    # Banks split 8 or 4 ways.
    banks = MOE.layers * MOE.bank_params() * MOE.param_bytes
    params = {name: roofline.memory(MOE, cfg, batch)["params"]
              for name, cfg in (("masked", masked), ("folded", folded),
                                ("separate", separate))}
    assert params["masked"] - params["folded"] == pytest.approx(banks * 7 / 8)
    assert params["masked"] - params["separate"] == pytest.approx(
        banks * 3 / 4)


def test_context_axis_splits_activations_and_gathers_keys_by_formula():
    """Issue 39 item 4: on context=4 a device computes (s/4) x s scores,
    holds at most 0.4x the activations of data=2 alone with the same
    samples per device, and gathers b·s·2·kv·dₕ keys and values per block
    forward (reduce-scattered backward)."""
    llama = dataclasses.replace(MOE, experts=0, top_k=0, kv_heads=4)
    alone = roofline.Parallel(data=2, microbatch=1)
    split = roofline.Parallel(data=2, context=4, microbatch=1)
    acts = {name: roofline.memory(llama, cfg, 2)["activations"]
            for name, cfg in (("alone", alone), ("split", split))}
    assert acts["split"] <= 0.4 * acts["alone"]
    dev = roofline._Device(hardware.PRESETS["h100-sxm"])
    flops = [roofline._attention_core(dev, llama, cfg).flops
             for cfg in (alone, split)]
    assert flops[1] == pytest.approx(flops[0] / 4)
    kv = llama.kv_heads * llama.head_dim
    gathered = llama.seq * 2 * kv * 2            # bytes, b = 1
    sent = roofline.communication_bytes(llama, split, 8)["context"]
    m = 8 // 2                                   # micro-batches of b = 1
    assert sent == pytest.approx(llama.layers * 2 * gathered * m)
    cluster = tfpar.Cluster.preset("h100-sxm")
    e = estimator.estimate_transformer(llama, split, 8, cluster)
    assert e.breakdown["context"] > 0
    assert e.communication_bytes_by_axis["context"] == sent


def test_a_keras_hub_mixtral_is_read_with_its_experts_and_estimated():
    keras_hub = pytest.importorskip("keras_hub")

    def mixtral():
        return keras_hub.models.MixtralBackbone(
            vocabulary_size=32000, num_layers=32, num_query_heads=32,
            num_key_value_heads=8, hidden_dim=4096, intermediate_dim=14336,
            num_experts=8, top_k=2)

    model = profile.build_without_weights(mixtral)
    read = transformer_of(profile.profile_model(model, 4096))
    assert (read.experts, read.top_k, read.ffn, read.gated) == (
        8, 2, 14336, True)
    cluster = tfpar.Cluster.preset("h100-sxm")              # 8 GPUs
    start = time.perf_counter()
    routed = tfpar.estimate(mixtral, 64, cluster=cluster,
                            sequence_length=4096, capacity_factor=1.25,
                            axes={"data": 8}, expert_axis="data",
                            recompute="full")
    separate = tfpar.estimate(mixtral, 64, cluster=cluster,
                              sequence_length=4096, capacity_factor=1.25,
                              axes={"data": 2, "expert": 4},
                              recompute="full")
    assert time.perf_counter() - start < 30
    assert routed.breakdown["expert"] > 0
    # the separate axis repeats attention on its 8 devices
    assert separate.executed_flops > routed.executed_flops
    with pytest.raises(ValueError, match="expert=4 too"):
        tfpar.estimate(mixtral, 64, cluster=cluster, sequence_length=4096,
                       axes={"data": 2, "expert": 4}, expert_axis="data")
    with pytest.raises(ValueError, match=(
            "expert parallelism of 16 does not divide the model's 8")):
        tfpar.estimate(mixtral, 64, cluster=tfpar.Cluster.preset(
            "h100-sxm", num_hosts=2), sequence_length=4096,
            axes={"data": 16}, expert_axis="data")
    # 47B parameters, of which 45B in the banks: split 8 or 4 ways.
    whole = read.num_params() * 4
    assert routed.memory_per_device["params"] < 0.2 * whole
    assert 0.2 * whole < separate.memory_per_device["params"] < 0.3 * whole
