"""Pretraining a tiny mixture of experts through `Session`, on 1 or 2 FSDP processes (CPU, gloo).

Usage: moe_ranks.py OUT_DIR DEVICES CHECKPOINTING [EXPERTS]. Used by tests/test_moe_training.py,
which compares the two: the same global batch of 4 sequences per step (one process accumulates 4
micro-batches of 1, two processes 2 each) must give the same weights and the same logged losses and
router metrics. Validation has one batch, fewer than the ranks: the second rank runs the first
rank's only to keep in step with it, and reduces the same router metrics (zeros). The experts' 3-D weights
are sharded by FSDP2 along the experts (4, the default), or, 3 of them over 2 processes, along each
expert's rows (`expert_shard_dim`); the script prints "expert weights split along dim(s) [...]".
The router losses of each rank's micro-batches join its gradient before FSDP reduces it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # session_ranks, beside this file

from session_ranks import STEPS, shares, start_session  # noqa: E402
from toolkit.models.config import Config  # noqa: E402

CONFIG = Config(name="tiny-moe", vocab_size=128, block_size=32, n_layer=2, n_embd=32, n_head=4, n_query_groups=2,
                intermediate_size=48, n_expert=4, n_expert_per_token=2, moe_intermediate_size=24,
                router_aux_loss_coef=0.3, router_z_loss_coef=0.05)


def run(out_dir: Path, devices: int, checkpointing: bool, experts: int = 4) -> None:
    """Train on `devices` processes (this one and, past one device, those Fabric starts)."""
    session = start_session(out_dir, devices, CONFIG.replace(n_expert=experts), checkpointing)
    model = session.build_model("random")
    dims = sorted({p.dim for name, param in model.named_parameters() if "experts" in name
                   for p in getattr(param, "placements", ()) if p.is_shard()})
    session.fabric.print(f"expert weights split along dim(s) {dims}")
    # SGD: its update is proportional to the gradient, so a wrong weight of the router terms shows.
    optimizer = session.fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=session.train.learning_rate))
    train_data, val_data = shares(session, CONFIG.vocab_size, val_sequences=1)
    session.fit(model, optimizer, train_data, val_data, total_steps=STEPS, tokens_per_step=None)
    session.export_final(model)


if __name__ == "__main__":
    run(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "true", *(int(a) for a in sys.argv[4:]))
