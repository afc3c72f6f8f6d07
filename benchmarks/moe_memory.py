"""Memory per GPU and FLOPs per token of training the published mixtures of experts, from the estimate.

Qwen3-30B-A3B, Qwen3-235B-A22B, Mixtral 8x7B and gpt-oss-120b, their Configs built here from the
published sizes (the presets come from other branches), pretraining or full fine-tuning (the same
memory) at micro-batch 1 x 4096 tokens, bf16-mixed, FSDP FULL_SHARD over 8 or 64 GPUs (8 per
node), with and without activation checkpointing, without and with expert parallelism. Figures are
GiB per GPU of live tensors (`toolkit estimate`: parameters from the meta model, activations
recorded from the model on fake tensors); the CUDA context, NCCL's buffers and fragmentation come
on top (keep about 5%: the pre-flight's headroom). `--simulate` also runs the real FSDP2 step on
fake tensors and fake ranks for the set-ups named there and prints both peaks.

    python benchmarks/moe_memory.py                                  # the estimate table
    python benchmarks/moe_memory.py --simulate qwen3-30b-a3b:8       # and the simulated step
    python benchmarks/moe_memory.py --simulate qwen3-30b-a3b:8:8     # with expert parallelism 8
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from toolkit.memory import GiB, simulate  # noqa: E402
from toolkit.memory.estimator import Options, column_memory, make_column  # noqa: E402
from toolkit.models.config import Config  # noqa: E402
from toolkit.models.gpt import count_parameters, flops_per_token  # noqa: E402

SEQ = 4096
_QWEN3_MOE = dict(vocab_size=151936, block_size=40960, head_size=128, n_query_groups=4, rope_base=1000000.0,
                  norm_eps=1e-6, qk_norm="head", n_expert=128, n_expert_per_token=8, router_aux_loss_coef=0.001)
MODELS = {
    # published totals / active: 30.5B / 3.3B, 235B / 22B, 46.7B / 12.9B, 116.8B / 5.1B
    "qwen3-30b-a3b": Config(name="qwen3-30b-a3b", n_layer=48, n_embd=2048, n_head=32, intermediate_size=6144,
                            moe_intermediate_size=768, **_QWEN3_MOE),
    "qwen3-235b-a22b": Config(name="qwen3-235b-a22b", n_layer=94, n_embd=4096, n_head=64, intermediate_size=12288,
                              moe_intermediate_size=1536, **_QWEN3_MOE),
    "mixtral-8x7b": Config(name="mixtral-8x7b", vocab_size=32000, block_size=32768, n_layer=32, n_embd=4096, n_head=32,
                           n_query_groups=8, intermediate_size=14336, rope_base=1000000.0, n_expert=8,
                           n_expert_per_token=2, router_aux_loss_coef=0.02),
    "gpt-oss-120b": Config(name="gpt-oss-120b", vocab_size=201088, block_size=131072, n_layer=36, n_embd=2880,
                           n_head=64, n_query_groups=8, head_size=64, intermediate_size=2880, bias=True,
                           mlp="clamped_swiglu", n_expert=128, n_expert_per_token=4, sliding_window=128,
                           layer_types=["local", "global"] * 18, attention_sinks=True, rope_base=150000.0),
}
# (GPUs, expert-parallel degrees shown)
LAYOUTS = {8: (1, 8), 64: (1, 8)}


def peak(config: Config, gpus: int, ep: int, checkpointing: bool) -> float:
    """GiB per GPU at the step's peak, FULL_SHARD over `gpus` (8 per node)."""
    nodes = max(1, gpus // 8)
    opts = Options(config, "bf16-mixed", None, (), 8, None, SEQ, expert_parallel=ep)
    figures = column_memory(opts, make_column("FULL_SHARD", gpus // nodes, nodes), 1)
    return figures["total_checkpointed" if checkpointing else "total"] / GiB


def parts(config: Config, gpus: int, ep: int) -> dict[str, float]:
    nodes = max(1, gpus // 8)
    opts = Options(config, "bf16-mixed", None, (), 8, None, SEQ, expert_parallel=ep)
    f = column_memory(opts, make_column("FULL_SHARD", gpus // nodes, nodes), 1)
    return {k: f[k] / GiB for k in ("parameters", "gradients", "optimizer_state", "activations",
                                    "activations_checkpointed", "logits_and_loss", "buffers")}


def table(names: list[str]) -> None:
    print(f"micro-batch 1 x {SEQ} tokens, bf16-mixed, FULL_SHARD, GiB per GPU (peak; peak with activation checkpointing)\n")
    print("| model | parameters (active) | GFLOP/token | GPUs | expert parallel | P+G+O | activations (ckpt) | gathered & buffers | peak | peak, ckpt |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        config = MODELS[name]
        total, active = count_parameters(config), count_parameters(config, active=True)
        flops = flops_per_token(config, SEQ) / 1e9
        for gpus, degrees in LAYOUTS.items():
            for ep in degrees:
                p = parts(config, gpus, ep)
                pgo = p["parameters"] + p["gradients"] + p["optimizer_state"]
                print(f"| {name} | {total / 1e9:.1f}B ({active / 1e9:.1f}B) | {flops:.1f} | {gpus} | {ep} | {pgo:.1f} | "
                      f"{p['activations']:.1f} ({p['activations_checkpointed']:.1f}) | {p['buffers']:.1f} | "
                      f"{peak(config, gpus, ep, False):.1f} | {peak(config, gpus, ep, True):.1f} |")


def simulated(spec: str) -> None:
    """`name:gpus[:expert_parallel]`: the simulated step beside the estimate (checkpointing on)."""
    name, gpus, *ep = spec.split(":")
    config, gpus, ep = MODELS[name], int(gpus), int(ep[0]) if ep else 1
    nodes = max(1, gpus // 8)
    start = time.perf_counter()
    sim = simulate(config, gpus // nodes, nodes, 1, SEQ, "bf16-mixed", "FULL_SHARD", None, None, True, 2, expert_parallel=ep)
    estimated = peak(config, gpus, ep, True)
    print(f"{name} on {gpus} GPUs, expert parallel {ep}, checkpointing: simulated {sim.peak_total / GiB:.2f} GiB, "
          f"estimated {estimated:.2f} GiB ({100 * (estimated * GiB / sim.peak_total - 1):+.1f}%), "
          f"simulation {time.perf_counter() - start:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--simulate", nargs="*", default=[], help="name:gpus[:expert_parallel], e.g. qwen3-30b-a3b:8 qwen3-30b-a3b:8:8")
    args = parser.parse_args()
    table(args.models)
    for spec in args.simulate:
        simulated(spec)


if __name__ == "__main__":
    main()
