"""How evenly the ranks share each optimizer step of length-grouped instruction batches.

    python benchmarks/rank_balance.py                          # Alpaca demo, 8 ranks
    python benchmarks/rank_balance.py --toolkit-root /path/to/other/checkout   # compare a version

Alpaca (`instruct/alpaca_en_demo.json` from /work/shared/data, 999 records, alpaca prompt style,
Llama-2 tokenizer, max_seq_length 1024) through the toolkit's own `Alpaca` data module; for each
(world size, micro-batch, global batch) every rank's `InstructLoader` plans epoch 0 (seed 1). A
micro-batch costs its padded tokens (rows x longest row). Ranks run their j-th micro-batches in
lockstep (FSDP gathers every layer of each), so a step costs the sum over j of the slowest rank's
j-th micro-batch; DDP synchronises once a step, so there a step costs the busiest rank's total.
Both are given against the ranks' mean (1.000: perfectly even), with how often rank 0 was the
busiest. No training runs: the figures are the loader's plan, exact and independent of the machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SHARED = Path("/work/shared/data")
CASES = [(8, 1, 8), (8, 4, 32), (8, 1, 32), (8, 2, 64), (8, 4, 128)]  # (world, micro, global)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--toolkit-root", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args()
    sys.path.insert(0, str(args.toolkit_root))
    import torch

    from toolkit.data.instruct import Alpaca
    from toolkit.tokenizer import Tokenizer

    data = Alpaca(json_path=SHARED / "instruct/alpaca_en_demo.json", prompt_style="alpaca", val_split_fraction=0)
    data.setup(Tokenizer(SHARED / "tokenizers/llama2"), 1024, "llama-2-7b")
    for world, micro, global_batch in CASES:
        loaders = [data.train_dataloader(micro, rank=r, world_size=world, seed=1, global_batch_size=global_batch)
                   for r in range(world)]
        lengths = loaders[0].samples.lengths
        accumulation = global_batch // (micro * world)
        plans = [loader.batch_indices(0) for loader in loaders]
        steps = len(plans[0]) // accumulation
        lockstep = lockstep_mean = busiest = busiest_mean = 0.0
        rank0_busiest = 0
        for s in range(steps):
            cost = torch.tensor([[float(lengths[plans[r][s * accumulation + j]].max()) * micro
                                  for j in range(accumulation)] for r in range(world)])  # (world, accumulation)
            lockstep += float(cost.max(dim=0).values.sum())
            lockstep_mean += float(cost.mean(dim=0).sum())
            totals = cost.sum(dim=1)
            busiest += float(totals.max())
            busiest_mean += float(totals.mean())
            rank0_busiest += int(totals[0] == totals.max())
        print(f"world {world}, micro-batch {micro}, global batch {global_batch} (accumulation {accumulation}), "
              f"{steps} steps: lockstep / mean {lockstep / lockstep_mean:.3f}, busiest rank / mean "
              f"{busiest / busiest_mean:.3f}, rank 0 the busiest in {rank0_busiest}/{steps} steps")


if __name__ == "__main__":
    main()
