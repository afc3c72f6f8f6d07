"""What tests/scripts/objective_ranks.py and moe_ranks.py share: their sequences and a `Session` for
pretraining a tiny model on 1 or 2 FSDP processes (CPU, gloo), the same global batch of GLOBAL_BATCH
sequences per step whatever the number of processes (one process accumulates GLOBAL_BATCH
micro-batches of 1, two processes half as many each)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from toolkit.args import DistributedArgs, EvalArgs, LogArgs, TrainArgs  # noqa: E402
from toolkit.models import IGNORE_INDEX  # noqa: E402
from toolkit.models.config import Config  # noqa: E402
from toolkit.models.gpt import Block  # noqa: E402
from toolkit.parallel.plan import plan_run  # noqa: E402
from toolkit.training.fabric import build_fabric  # noqa: E402
from toolkit.training.session import Session  # noqa: E402
from toolkit.training.trackers import make_loggers  # noqa: E402

SEQ = 16
GLOBAL_BATCH = 4
STEPS = 3


def sequences(count: int, seed: int, vocab_size: int) -> list[dict]:
    """`count` sequences of SEQ tokens, the last (i % 5) * 2 of sequence i padding (labels ignored)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        tokens = torch.randint(0, vocab_size, (1, SEQ + 1), generator=generator)
        labels = tokens[:, 1:].clone()
        padding = (i % 5) * 2
        if padding:
            labels[:, -padding:] = IGNORE_INDEX
        out.append({"input_ids": tokens[:, :-1], "labels": labels})
    return out


def start_session(out_dir: Path, devices: int, config: Config, checkpointing: bool = False) -> Session:
    """A launched pretraining `Session` of STEPS steps at learning rate 0.5 (for SGD, whose update is
    proportional to the gradient, so that a wrongly scaled loss shows), logging every step to CSV,
    validating every 2 steps on at most 4 batches."""
    out_dir.mkdir(parents=True, exist_ok=True)
    log = LogArgs(interval=1, loggers=("csv",))
    train = TrainArgs(micro_batch_size=1, global_batch_size=GLOBAL_BATCH, max_seq_length=SEQ, max_steps=STEPS,
                      learning_rate=0.5, warmup_steps=0, max_norm=None, save_interval=None)
    distributed = DistributedArgs(sharding="FULL_SHARD", timeout=120, activation_checkpointing=checkpointing)
    run_plan = plan_run(devices, 1, "32-true", distributed, train, SEQ, accelerator="cpu")
    fabric = build_fabric(run_plan.strategy, block_cls=Block, loggers=make_loggers(out_dir, log, False))
    fabric.launch()
    return Session(kind="pretrain", fabric=fabric, out_dir=out_dir, config=config, train=train,
                   eval=EvalArgs(interval=2, max_iters=4), log=log, plan=run_plan.batches, run_plan=run_plan,
                   seed=0, resume=False, precision="32-true")


def shares(session: Session, vocab_size: int, val_sequences: int = 3) -> tuple[list[dict], list[dict]]:
    """This rank's training and validation sequences: rank r takes sequences r, r + world, r + 2 * world, ...
    Three validation sequences: on 2 ranks the second has one batch fewer, and runs one again,
    uncounted; with one, the second has none, and runs the first rank's, uncounted."""
    rank, world = session.fabric.global_rank, session.fabric.world_size
    return (sequences(STEPS * GLOBAL_BATCH, 1, vocab_size)[rank::world],
            sequences(val_sequences, 2, vocab_size)[rank::world])
