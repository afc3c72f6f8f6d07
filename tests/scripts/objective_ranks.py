"""A custom objective with a frozen reference model, through `Session`, on 1 or 2 FSDP processes (CPU, gloo).

Usage: objective_ranks.py OUT_DIR DEVICES. Used by tests/test_objectives.py, which compares the two:
the same global batch of 4 sequences per step (one process accumulates 4 micro-batches of 1, two
processes 2 each) must give the same weights and the same logged losses and metrics.

The objective counts sequences, not tokens: each sequence's mean token cross-entropy, minus that of
a second model built by `Session.build_model(frozen=True)` beside the trained one (as a preference
loss's reference model would be). Every rank writes `report-<rank>.json` on how the two models were built.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from toolkit.models import IGNORE_INDEX  # noqa: E402
from toolkit.models.config import Config  # noqa: E402
from toolkit.models.gpt import GPT, Block  # noqa: E402
from toolkit.args import DistributedArgs, EvalArgs, LogArgs, TrainArgs  # noqa: E402
from toolkit.training.objectives import Objective  # noqa: E402
from toolkit.training.session import Session  # noqa: E402
from toolkit.parallel.plan import plan_run  # noqa: E402
from toolkit.training.fabric import build_fabric  # noqa: E402
from toolkit.training.trackers import make_loggers  # noqa: E402

SEQ = 16
GLOBAL_BATCH = 4
STEPS = 3
CONFIG = Config.from_name("debug-neox", vocab_size=128)


def sequence_losses(model, batch: dict) -> torch.Tensor:
    """(B,) each sequence's mean cross-entropy over its target tokens."""
    logits = model(batch["input_ids"])  # (B, T, V)
    labels = batch["labels"]
    token_losses = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                                   reduction="none").view(labels.shape)  # (B, T), 0 where ignored
    return token_losses.sum(dim=1) / (labels != IGNORE_INDEX).sum(dim=1).clamp(min=1)


class LossAboveReference(Objective):
    """Per sequence: the trained model's mean token loss minus the frozen reference's (no gradient)."""

    def __init__(self, reference) -> None:
        self.reference = reference

    def normaliser(self, batch: dict) -> torch.Tensor:
        # The sequences, counted in float: the loop's path for weighted units (all-reduced in float64).
        ids = batch["input_ids"]
        return torch.full((), float(ids.shape[0]), device=ids.device)

    def loss(self, model, batch: dict):
        trained = sequence_losses(model, batch)
        with torch.no_grad():
            reference = sequence_losses(self.reference, batch)
        return (trained - reference).sum(), {"reference_loss": reference.sum(), "model_loss": trained.detach().sum()}


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


def run(out_dir: Path, devices: int) -> None:
    """Train and report on `devices` processes (this one and, past one device, those Fabric starts)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    log = LogArgs(interval=1, loggers=("csv",))
    train = TrainArgs(micro_batch_size=1, global_batch_size=GLOBAL_BATCH, max_seq_length=SEQ, max_steps=STEPS,
                      learning_rate=0.5, warmup_steps=0, max_norm=None, save_interval=None)
    run_plan = plan_run(devices, 1, "32-true", DistributedArgs(sharding="FULL_SHARD", timeout=120), train, SEQ, accelerator="cpu")
    fabric = build_fabric(run_plan.strategy, block_cls=Block, loggers=make_loggers(out_dir, log, False))
    fabric.launch()
    session = Session(kind="pretrain", fabric=fabric, out_dir=out_dir, config=CONFIG, train=train,
                      eval=EvalArgs(interval=2, max_iters=4), log=log, plan=run_plan.batches, run_plan=run_plan,
                      seed=0, resume=False, precision="32-true")
    model = session.build_model("random")
    reference = session.build_model("random", frozen=True)
    adamw = session.build_optimizer(model)  # its weight decay groups are checked below
    # Trained with SGD: its update is proportional to the gradient, so a wrong loss scale shows
    # (Adam's hardly moves: it divides by the gradient's own magnitude).
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=train.learning_rate))
    sharded_alike = all(
        a_name == b_name and type(a) is type(b) and a.shape == b.shape
        and getattr(a, "placements", None) == getattr(b, "placements", None)
        for (a_name, a), (b_name, b) in zip(model.named_parameters(), reference.named_parameters())
    )

    # Every rank's share of the same global order: rank r takes sequences r, r + world, r + 2 * world, ...
    rank, world = fabric.global_rank, fabric.world_size
    train_data = sequences(STEPS * GLOBAL_BATCH, seed=1)[rank::world]
    val_data = sequences(4, seed=2)[rank::world]
    session.fit(model, optimizer, train_data, val_data, total_steps=STEPS, tokens_per_step=None,
                objective=LossAboveReference(reference))
    session.export_final(model)

    trained_ids = {id(p) for group in adamw.param_groups for p in group["params"]}
    with torch.device("meta"):
        matrices = sum(p.ndim >= 2 for p in GPT(CONFIG).parameters())
    decay_group = [g for g in adamw.param_groups if g["weight_decay"] > 0]
    report = {
        "rank": rank,
        "reference_frozen": all(not p.requires_grad and p.grad is None for p in reference.parameters()),
        "reference_in_eval_mode": not reference.training,
        "reference_outside_the_optimizer": not any(id(p) in trained_ids for p in reference.parameters()),
        "sharded_alike": sharded_alike,
        # After its forward passes the reference holds its shards only, nothing gathered.
        "reference_sharded_after_fit": all(hasattr(p, "placements") for p in reference.parameters()),
        "sharded": any(hasattr(p, "placements") for p in model.parameters()),
        "decayed_parameters": len(decay_group[0]["params"]) if decay_group else 0,
        "matrices": matrices,
    }
    (out_dir / f"report-{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    run(Path(sys.argv[1]), int(sys.argv[2]))
