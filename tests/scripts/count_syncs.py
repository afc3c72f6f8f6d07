"""Count what one optimizer step costs in collectives and host syncs, through the real loop (`fit`).

Used by tests/test_distributed_failures.py through two_rank_loops.py, which calls `main` of both
scripts in one launch with `--devices 2` (Fabric's launcher re-runs it for rank 1), this one
second. Each rank has data for 3 optimizer steps, with padding (so the loop counts real tokens
itself, as in fine-tuning), and a time limit that is never reached (so the flag is carried).
Every rank prints one JSON line: the calls made inside `fit` and what it counted.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from toolkit.models import IGNORE_INDEX  # noqa: E402
from toolkit.args import EvalArgs, LogArgs, TrainArgs  # noqa: E402
from toolkit.training.loop import LoopHooks, TrainState, fit  # noqa: E402
from two_rank_ddp import start_two_rank_ddp  # noqa: E402  (this folder)

SEQ = 8
ACCUMULATION = 2
STEPS = 3
CALLS: Counter = Counter()


def counted(owner, name: str, key: str) -> None:
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        CALLS[key] += 1
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


def batches_of(rank: int, vocab: int) -> list[dict]:
    """This rank's micro-batches: (1, SEQ) each, the last `rank + i % 3` labels of batch i padding."""
    generator = torch.Generator().manual_seed(rank)
    out = []
    for i in range(STEPS * ACCUMULATION):
        tokens = torch.randint(0, vocab, (1, SEQ + 1), generator=generator)
        labels = tokens[:, 1:].clone()
        padding = (rank + i) % 3
        if padding:
            labels[:, -padding:] = IGNORE_INDEX
        out.append({"input_ids": tokens[:, :-1], "labels": labels})
    return out


def main() -> None:
    fabric, config, model, optimizer, plan = start_two_rank_ddp(SEQ, ACCUMULATION, timeout=60)
    batches = batches_of(fabric.global_rank, config.vocab_size)
    expected_tokens = sum(int((b["labels"] != IGNORE_INDEX).sum()) for r in range(2) for b in batches_of(r, config.vocab_size))
    train = TrainArgs(global_batch_size=2 * ACCUMULATION, micro_batch_size=1, max_seq_length=SEQ, epochs=1,
                      warmup_steps=0, save_interval=None, max_time="1h")
    for name in ("all_reduce", "barrier", "broadcast", "broadcast_object_list", "all_gather", "all_gather_object"):
        counted(dist, name, name)
    for name in ("item", "tolist"):
        counted(torch.Tensor, name, "host_sync")
    state = fit(fabric, model, optimizer, batches, None, plan, TrainState(), train, EvalArgs(interval=1000),
                LogArgs(interval=1000, loggers=()), LoopHooks(), total_steps=None)
    calls = dict(CALLS)
    # One write of the whole line: the ranks share the pipe (print writes the newline apart).
    sys.stdout.flush()
    sys.stdout.write(json.dumps({"rank": fabric.global_rank, "steps": state.step, "tokens_seen": state.tokens_seen,
                                 "expected_tokens": expected_tokens, "calls": calls}) + "\n")
    sys.stdout.flush()
    # Rank 0 (which started rank 1) waits until rank 1 has printed too: on a loaded machine rank 1
    # could still be on its way to its print when rank 0's exit ends the run.
    dist.barrier()


if __name__ == "__main__":
    main()
