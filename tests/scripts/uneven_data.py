"""Two ranks whose data ends at different steps go through the real training loop (`fit`).

Used by tests/test_distributed_failures.py through two_rank_loops.py, which calls `main` of both
scripts in one launch with `--devices 2` (Fabric's launcher re-runs it for rank 1). Rank 0 has
data for 3 optimizer steps, rank 1 for 2, as when a weighted StreamMix, sharded per rank, runs out
on one rank first. Every rank prints the step it stopped at.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from toolkit.args import EvalArgs, LogArgs, TrainArgs  # noqa: E402
from toolkit.training.loop import LoopHooks, TrainState, fit  # noqa: E402
from two_rank_ddp import start_two_rank_ddp  # noqa: E402  (this folder)

SEQ = 8
ACCUMULATION = 2


def main() -> None:
    fabric, config, model, optimizer, plan = start_two_rank_ddp(SEQ, ACCUMULATION, timeout=30)
    steps_of_data = 3 if fabric.global_rank == 0 else 2
    generator = torch.Generator().manual_seed(fabric.global_rank)
    batches = []
    for _ in range(steps_of_data * ACCUMULATION):
        tokens = torch.randint(0, config.vocab_size, (1, SEQ + 1), generator=generator)
        batches.append({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]})
    train = TrainArgs(global_batch_size=2 * ACCUMULATION, micro_batch_size=1, max_seq_length=SEQ, epochs=1,
                      warmup_steps=0, save_interval=None)
    state = fit(fabric, model, optimizer, batches, None, plan, TrainState(), train, EvalArgs(interval=1000),
                LogArgs(interval=1, loggers=()), LoopHooks(), total_steps=None)
    print(f"rank {fabric.global_rank} stopped at step {state.step}", flush=True)


if __name__ == "__main__":
    main()
