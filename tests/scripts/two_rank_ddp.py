"""The set-up the two-rank loop scripts share (uneven_data.py, count_syncs.py): debug-neox under DDP
on 2 gloo processes, 32-true, SGD, micro-batch 1 of `seq` tokens with `accumulation` micro-batches per
optimizer step. Imported by a script that has put the repository root on sys.path."""

from __future__ import annotations

import torch

from toolkit.models.config import Config
from toolkit.models.gpt import GPT, Block
from toolkit.args import DistributedArgs
from toolkit.parallel.batches import plan_batches
from toolkit.parallel.plan import plan_strategy
from toolkit.training.fabric import build_fabric


def start_two_rank_ddp(seq: int, accumulation: int, timeout: int):
    """(fabric, config, model, optimizer, batch plan), launched: each of the 2 processes returns its own."""
    strategy = plan_strategy(2, 1, "32-true", DistributedArgs(strategy="ddp", timeout=timeout), accelerator="cpu")
    fabric = build_fabric(strategy, block_cls=Block)
    fabric.launch()
    config = Config.from_name("debug-neox")
    torch.manual_seed(0)
    model = fabric.setup_module(GPT(config))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.01))
    plan = plan_batches(2, 1, 1, 2 * accumulation, seq)
    return fabric, config, model, optimizer, plan
