"""tfpar.plan on paper: the GPT models of Narayanan et al. 2021 on the GPU
clusters they were trained on, next to the published plans.

"Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (arXiv:2104.04473), Table 1: sequence 2048, vocabulary 51200,
DGX A100 hosts of 8 GPUs (80 GB), `mixed_bfloat16`, Adam. Each row builds
the GPT of `examples/gpt.py` without allocating a weight and plans it for
`Cluster(gpus // 8, 8, 80e9, 312e12, 300e9, 25e9)` (peak bf16 FLOP/s,
NVLink 300 GB/s per direction, 8 × 200 Gb/s InfiniBand per host = 25 GB/s
per GPU). Printed per row: the published tensor size t, pipeline size p
(data = GPUs / (t·p)) and TFLOP/s per GPU; tfpar's plan, its predicted
model TFLOP/s per GPU (6 · parameter-FLOPs per token, recomputation not
counted, at peak FLOP/s: an upper bound), its memory per device, whether
the published mesh is feasible and how much slower it is predicted, and
the planning seconds.

    python benchmarks/planner_paper.py [--rows 1.7B,39.1B,1T]
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import tfpar  # noqa: E402

# name: (hidden, heads, layers, GPUs, batch, published t, p, TFLOP/s/GPU)
ROWS = {
    "1.7B": (2304, 24, 24, 32, 512, 1, 1, 137),
    "3.6B": (3072, 32, 30, 64, 512, 2, 1, 138),
    "7.5B": (4096, 32, 36, 128, 512, 4, 1, 142),
    "18.4B": (6144, 48, 40, 256, 1024, 8, 1, 135),
    "39.1B": (8192, 64, 48, 512, 1536, 8, 2, 138),
    "76.1B": (10240, 80, 60, 1024, 1792, 8, 4, 140),
    "145.6B": (12288, 96, 80, 1536, 2304, 8, 8, 148),
    "310.1B": (16384, 128, 96, 1920, 2160, 8, 16, 155),
    "529.6B": (20480, 128, 105, 2520, 2520, 8, 35, 163),
    "1T": (25600, 160, 128, 3072, 3072, 8, 64, 163),
}


def a100_cluster(gpus):
    """Narayanan et al. 2021's hardware: DGX A100 hosts of 8 GPUs (80 GB,
    312 TFLOP/s bf16), NVLink 300 GB/s per direction, 8 × 200 Gb/s
    InfiniBand per host (25 GB/s per GPU)."""
    return tfpar.Cluster(num_hosts=gpus // 8, devices_per_host=8,
                         device_memory=80e9, device_flops=312e12,
                         intra_host_bandwidth=300e9,
                         inter_host_bandwidth=25e9)


def paper_gpt(dim, heads, layers):
    """A builder of the paper's GPT (mixed_bfloat16) for `tfpar.plan`."""
    import keras  # noqa: PLC0415
    from gpt import build_gpt  # noqa: PLC0415

    def build():
        keras.config.set_dtype_policy("mixed_bfloat16")
        try:
            return build_gpt(vocab=51200, seq_len=2048, dim=dim, heads=heads,
                             layers=layers)
        finally:
            keras.config.set_dtype_policy("float32")
    return build


def row(name):
    dim, heads, layers, gpus, batch, t, p, tflops = ROWS[name]
    start = time.perf_counter()
    try:
        plan = tfpar.plan(paper_gpt(dim, heads, layers), batch,
                          cluster=a100_cluster(gpus))
    except ValueError as e:
        return (f"| {name} | {gpus} | {t}, {p} ({gpus // (t * p)}) | {tflops} "
                f"| no plan fits: {str(e).split(': the smallest')[-1][:160]} "
                f"| – | – | – | {time.perf_counter() - start:.0f} |")
    seconds = time.perf_counter() - start
    e = plan.estimate
    tokens = batch * 2048
    model_flops = 6 * plan.info["num_params"] * tokens
    achieved = model_flops / e.step_time_s / gpus / 1e12
    published = {"data": gpus // (t * p), "pipe": p, "model": t}
    same = [c for c in plan.candidates if c.rejected is None
            and c.axes == published]
    versus = (f"feasible, {same[0].estimate.step_time_s / e.step_time_s - 1:+.0%}"
              if same else "not feasible")
    return (f"| {name} | {gpus} | {t}, {p} ({published['data']}) | {tflops} | "
            f"{plan.candidates[0].label} | {achieved:.0f} | "
            f"{e.total_memory / 1e9:.1f} GB | {versus} | {seconds:.0f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS),
                        help=f"comma-separated of {', '.join(ROWS)}")
    args = parser.parse_args()
    tfpar.use_virtual_cpus(1)
    print("| model | GPUs | published t, p (data) | published TFLOP/s/GPU | "
          "tfpar plan | tfpar est. TFLOP/s/GPU | tfpar memory/GPU | "
          "published mesh in tfpar's search | planning s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.rows.split(","):
        print(row(name), flush=True)


if __name__ == "__main__":
    main()
