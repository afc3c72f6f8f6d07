"""Pretraining a tiny mixture of experts through `Session`, on 1 or 2 FSDP processes (CPU, gloo).

Usage: moe_ranks.py OUT_DIR DEVICES CHECKPOINTING. Used by tests/test_moe_training.py, which compares
the two: the same global batch of 4 sequences per step (one process accumulates 4 micro-batches of
1, two processes 2 each) must give the same weights and the same logged losses and router metrics.
The experts' 3-D weights are sharded along the experts by FSDP2 like any weight, and the router
losses of each rank's micro-batches join its gradient before FSDP reduces it.
"""

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
CONFIG = Config(name="tiny-moe", vocab_size=128, block_size=32, n_layer=2, n_embd=32, n_head=4, n_query_groups=2,
                intermediate_size=48, n_expert=4, n_expert_per_token=2, moe_intermediate_size=24,
                router_aux_loss_coef=0.3, router_z_loss_coef=0.05)


def sequences(count: int, seed: int) -> list[dict]:
    """`count` sequences of SEQ tokens, the last (i % 5) * 2 of sequence i padding (labels ignored)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        tokens = torch.randint(0, CONFIG.vocab_size, (1, SEQ + 1), generator=generator)
        labels = tokens[:, 1:].clone()
        padding = (i % 5) * 2
        if padding:
            labels[:, -padding:] = IGNORE_INDEX
        out.append({"input_ids": tokens[:, :-1], "labels": labels})
    return out


def run(out_dir: Path, devices: int, checkpointing: bool) -> None:
    """Train on `devices` processes (this one and, past one device, those Fabric starts)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    log = LogArgs(interval=1, loggers=("csv",))
    train = TrainArgs(micro_batch_size=1, global_batch_size=GLOBAL_BATCH, max_seq_length=SEQ, max_steps=STEPS,
                      learning_rate=0.5, warmup_steps=0, max_norm=None, save_interval=None)
    distributed = DistributedArgs(sharding="FULL_SHARD", timeout=120, activation_checkpointing=checkpointing)
    run_plan = plan_run(devices, 1, "32-true", distributed, train, SEQ, accelerator="cpu")
    fabric = build_fabric(run_plan.strategy, block_cls=Block, loggers=make_loggers(out_dir, log, False))
    fabric.launch()
    session = Session(kind="pretrain", fabric=fabric, out_dir=out_dir, config=CONFIG, train=train,
                      eval=EvalArgs(interval=2, max_iters=4), log=log, plan=run_plan.batches, run_plan=run_plan,
                      seed=0, resume=False, precision="32-true")
    model = session.build_model("random")
    # SGD: its update is proportional to the gradient, so a wrong weight of the router terms shows.
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=train.learning_rate))
    rank, world = fabric.global_rank, fabric.world_size
    train_data = sequences(STEPS * GLOBAL_BATCH, seed=1)[rank::world]
    val_data = sequences(4, seed=2)[rank::world]
    session.fit(model, optimizer, train_data, val_data, total_steps=STEPS, tokens_per_step=None)
    session.export_final(model)


if __name__ == "__main__":
    run(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "true")
