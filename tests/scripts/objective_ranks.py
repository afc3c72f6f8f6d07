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
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # session_ranks, beside this file

from session_ranks import STEPS, shares, start_session  # noqa: E402
from toolkit.models import IGNORE_INDEX  # noqa: E402
from toolkit.models.config import Config  # noqa: E402
from toolkit.models.gpt import GPT  # noqa: E402
from toolkit.training.loop import validate  # noqa: E402
from toolkit.training.objectives import Objective  # noqa: E402

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


def run(out_dir: Path, devices: int) -> None:
    """Train and report on `devices` processes (this one and, past one device, those Fabric starts)."""
    session = start_session(out_dir, devices, CONFIG)
    fabric, train = session.fabric, session.train
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

    train_data, val_data = shares(session, CONFIG.vocab_size)
    session.fit(model, optimizer, train_data, val_data, total_steps=STEPS, tokens_per_step=None,
                objective=LossAboveReference(reference))
    session.export_final(model)
    # Validation's forward passes have no backward pass: what they gathered is freed after them.
    validate(fabric, model, val_data, max_iters=2)
    sharded_after_validation = all(hasattr(p, "placements") for p in model.parameters())

    trained_ids = {id(p) for group in adamw.param_groups for p in group["params"]}
    with torch.device("meta"):
        matrices = sum(p.ndim >= 2 for p in GPT(CONFIG).parameters())
    decay_group = [g for g in adamw.param_groups if g["weight_decay"] > 0]
    report = {
        "rank": fabric.global_rank,
        "reference_frozen": all(not p.requires_grad and p.grad is None for p in reference.parameters()),
        "reference_in_eval_mode": not reference.training,
        "reference_outside_the_optimizer": not any(id(p) in trained_ids for p in reference.parameters()),
        "sharded_alike": sharded_alike,
        # After its forward passes the reference holds its shards only, nothing gathered.
        "reference_sharded_after_fit": all(hasattr(p, "placements") for p in reference.parameters()),
        "sharded": any(hasattr(p, "placements") for p in model.parameters()),
        "sharded_after_validation": sharded_after_validation,
        "decayed_parameters": len(decay_group[0]["params"]) if decay_group else 0,
        "matrices": matrices,
    }
    (out_dir / f"report-{fabric.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    run(Path(sys.argv[1]), int(sys.argv[2]))
