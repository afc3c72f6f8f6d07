"""Per-GPU peak memory and bytes sent per step at 8-512 GPUs, from the simulated training step.

Runs `toolkit.memory.simulate` (the toolkit's real FSDP2 training step on fake tensors and a fake
process group) for Llama-3.1-8B, Llama-3.1-70B and a 405B shape (Llama-3.1-70B's config with 126
layers, n_embd 16384, 128 heads, 8 KV heads, intermediate 53248, vocabulary 128256), for pretraining,
full fine-tuning and LoRA (toolkit defaults: r 8 on query and value), at 8, 16, 64 and 512 GPUs of 8
per node, HYBRID_SHARD (shard within a node, replicate across nodes) and FULL_SHARD (shard over all
GPUs; on one node of 8 both are the same and one row is shown). Micro-batch 1 of 2048 tokens,
bf16-mixed, activation checkpointing on, two micro-batches per optimizer step (so that gradients
are alive during a forward pass, as whenever the global batch is larger than one micro-batch per
GPU). The categories are at the moment of the peak (P+G+O: sharded parameters, gradients, AdamW
state; gathered params: unsharded parameters and all-gather outputs); "P+G+O after step" is the
persistent state after the optimizer step. Figures are GiB of live tensors on rank 0; the CUDA context, NCCL's buffers and the caching
allocator's fragmentation come on top.

    python benchmarks/simulate_scale.py --out benchmarks/results/simulate_scale.jsonl
    python benchmarks/simulate_scale.py --models 8b --modes lora --gpus 8 64   # a part of the grid
    python benchmarks/simulate_scale.py --table benchmarks/results/simulate_scale.jsonl   # print only
    python benchmarks/simulate_scale.py --table benchmarks/results/simulate_scale.jsonl --compact   # oom.md's

Rows record the AdamW they were taken with ("adamw": "fused"); rows without it were taken with the
foreach AdamW the toolkit used before 2026-11-26 and are marked † in the table.

Each simulation is appended to --out as one JSON line as soon as it ends (a run that is stopped
keeps what it did, and a rerun skips the rows already there); the table is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

GiB = 1024**3
MODELS = {
    "8b": ("llama-3.1-8b", {}),
    "70b": ("llama-3.1-70b", {}),
    "405b": ("llama-3.1-70b", dict(name="llama-3.1-405b-shape", n_layer=126, n_embd=16384, n_head=128,
                                   n_query_groups=8, intermediate_size=53248, vocab_size=128256)),
}  # fmt: skip
MODES = {"pretrain": None, "full": "full", "lora": "lora"}
# (column label, FSDP category names summed into it)
COLUMNS = [
    ("P+G+O", ("Sharded Param", "Sharded Grad", "OptState")),
    ("gathered params", ("Unsharded Param", "All Gather")),
    ("activations", ("Activation", "Inputs")),
    ("other", ("Unsharded Grad", "Reduce Scatter", "Temp", "Buffer")),
]


def layouts(gpus: list[int]) -> list[tuple[str, int, int]]:
    """(sharding, devices per node, nodes), 8 GPUs per node; one row at one node."""
    rows = []
    for n in gpus:
        nodes = max(1, n // 8)
        devices = n // nodes
        rows += [("FULL_SHARD", devices, nodes)] if nodes == 1 else [("HYBRID_SHARD", devices, nodes), ("FULL_SHARD", devices, nodes)]
    return rows


def run(args) -> None:
    from toolkit.models.config import Config
    from toolkit.memory import simulate

    done = set()
    if args.out.exists():
        done = {tuple(r["key"]) for r in map(json.loads, args.out.read_text().splitlines())}
    for model in args.models:
        preset, overrides = MODELS[model]
        config = Config.from_name(preset, **overrides)
        for mode in args.modes:
            for sharding, devices, nodes in layouts(args.gpus):
                key = [model, mode, sharding, devices * nodes]
                if tuple(key) in done:
                    continue
                start = time.perf_counter()
                sim = simulate(config, devices, nodes, 1, 2048, "bf16-mixed", sharding, MODES[mode], None,
                               activation_checkpointing=True, micro_batches=2)  # fmt: skip
                row = {"key": key, "peak": sim.peak, "peak_total": sim.peak_total, "persistent": sim.persistent,
                       "sent": sim.sent_bytes, "shard_size": sim.shard_size, "seconds": time.perf_counter() - start,
                       "adamw": "fused"}  # fmt: skip
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{key}: {sim.peak_total / GiB:.1f} GiB, {row['seconds']:.0f} s", flush=True)


def table(path: Path) -> str:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    order = {m: i for i, m in enumerate(MODELS)} | {m: i for i, m in enumerate(MODES)}
    rows.sort(key=lambda r: (order[r["key"][0]], order[r["key"][1]], r["key"][3], r["key"][2] != "HYBRID_SHARD"))
    head = ["model", "training", "GPUs", "sharding", "peak"] + [c for c, _ in COLUMNS] + ["P+G+O after step", "sent/step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        model, mode, sharding, gpus = r["key"]
        mark = "" if r.get("adamw") == "fused" else " †"  # taken with the foreach AdamW (before 2026-11-26)
        cells = [model, mode, str(gpus), "HYBRID" if sharding == "HYBRID_SHARD" else "FULL",
                 f"**{r['peak_total'] / GiB:.1f}**{mark}"]
        cells += [f"{sum(r['peak'].get(k, 0) for k in keys) / GiB:.1f}" for _, keys in COLUMNS]
        cells.append(f"{sum(r['persistent'].values()) / GiB:.1f}")
        cells.append(f"{r['sent'] / GiB:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compact_table(path: Path) -> str:
    """Peaks only, HYBRID beside FULL_SHARD, pretraining and LoRA (full fine-tuning's peaks are
    pretraining's): the table of tutorials/oom.md."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    peaks = {tuple(r["key"]): f"{r['peak_total'] / GiB:.1f}" + ("" if r.get("adamw") == "fused" else " †") for r in rows}
    lines = ["| model | training | GPUs | HYBRID | FULL_SHARD |", "|---|---|---|---|---|"]
    for model in MODELS:
        for mode in ("pretrain", "lora"):
            for gpus in sorted({k[3] for k in peaks if k[:2] == (model, mode)}):
                hybrid = peaks.get((model, mode, "HYBRID_SHARD", gpus))
                full = peaks.get((model, mode, "FULL_SHARD", gpus))
                cells = ["(one node)" if gpus <= 8 else (hybrid or ""), full or ""]
                lines.append(f"| {model} | {mode} | {gpus} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/simulate_scale.jsonl"))
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--gpus", nargs="+", type=int, default=[8, 16, 64, 512])
    parser.add_argument("--table", type=Path, help="only print the table of this results file")
    parser.add_argument("--compact", action="store_true", help="peaks only, HYBRID beside FULL_SHARD (tutorials/oom.md)")
    args = parser.parse_args()
    if args.table is None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        run(args)
    print((compact_table if args.compact else table)(args.table or args.out))


if __name__ == "__main__":
    main()
