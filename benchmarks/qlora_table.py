"""Per-GPU memory of QLoRA with a sharded NF4 base: Llama-3.1-8B and -70B on 1, 2, 4 and 8 GPUs.

The analytic estimator (`toolkit estimate --finetune lora --quantize nf4`, `toolkit/memory/`)
for the set-up `toolkit finetune_lora --quantize nf4` runs: torchao's NF4 base sharded by FSDP2
(FULL_SHARD, finetune_lora's default on one node), the toolkit's LoRA defaults (r 8, alpha 16,
dropout 0.05, on query and value; float32 adapters and AdamW state), bf16-mixed, micro-batch 1, at
sequence 2048 and 8192, with and without activation checkpointing and CPU offload
(`--distributed.cpu_offload true`: the shards, gradients and AdamW state in host memory; FSDP only,
so not on one GPU). The simulation (`toolkit.memory.simulate`, fake tensors) does not run torchao's NF4
tensor, so these are the estimator's figures; on a GPU the CUDA context, NCCL's buffers and the
caching allocator's fragmentation come on top.

    python benchmarks/qlora_table.py                 # the markdown table of tutorials/finetune_lora.md
    python benchmarks/qlora_table.py --budget-gib 22 # bold: what fits below 22 GiB (the default)

The model on the meta device and fake tensors only: nothing is allocated, a few seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from toolkit.memory import GiB, estimate  # noqa: E402

MODELS = ("llama-3.1-8b", "llama-3.1-70b")
GPUS = (1, 2, 4, 8)
SEQUENCES = (2048, 8192)
# (column heading, activation checkpointing, CPU offload)
SETTINGS = (("peak", False, False), ("checkpointing", True, False),
            ("offload", False, True), ("checkpointing + offload", True, True))  # fmt: skip


def figures(model: str, gpus: int, seq: int, offload: bool) -> dict:
    """The estimator's column for the set-up finetune_lora runs (quiet: the estimate prints its table)."""
    with contextlib.redirect_stdout(io.StringIO()):
        result = estimate(model, devices=gpus, finetune="lora", quantize="nf4", max_seq_length=seq,
                          micro_batch_size=1, precision="bf16-mixed", cpu_offload=offload)  # fmt: skip
    (column,) = result["columns"]  # one column: single, or FULL_SHARD
    return result["strategies"][column]


def table(budget_gib: float) -> str:
    budget = budget_gib * GiB
    lines = [
        "| model | sequence | GPUs | base per GPU | " + " | ".join(name for name, _, _ in SETTINGS)
        + " | host per rank, offload |",
        "|---|---|---|---|" + "---|" * len(SETTINGS) + "---|",
    ]
    for model in MODELS:
        for seq in SEQUENCES:
            for gpus in GPUS:
                stored = figures(model, gpus, seq, offload=False)
                cells = []
                for _, checkpointing, offload in SETTINGS:
                    if offload and gpus == 1:
                        cells.append("n/a")
                        continue
                    figs = figures(model, gpus, seq, offload)
                    peak = figs["total_checkpointed" if checkpointing else "total"]
                    cell = f"{peak / GiB:.2f}"
                    cells.append(f"**{cell}**" if peak <= budget else cell)
                host = "n/a" if gpus == 1 else f"{figures(model, gpus, seq, offload=True)['host_offload'] / GiB:.2f}"
                lines.append(f"| {model} | {seq} | {gpus} | {stored['parameters'] / GiB:.2f} | " + " | ".join(cells)
                             + f" | {host} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-gib", type=float, default=22.0, help="peaks at or below it are printed in bold")
    args = parser.parse_args(argv)
    print(table(args.budget_gib))
    print()
    print(f"GiB per GPU (peak of a training step); bold: at most {args.budget_gib:g} GiB. 'base per GPU': the stored "
          "NF4 block weights and bf16 embedding, norms and head of one GPU (its shard).")


if __name__ == "__main__":
    main()
