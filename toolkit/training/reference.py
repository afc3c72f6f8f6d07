"""The reference model of DPO and IPO: where the reference's log-probabilities of a pair come from.

    AdaptersOff   LoRA / QLoRA: the trained model itself with its adapters switched off (peft's
                  `disable_adapter`), under no_grad: the frozen base, no second copy in memory
    FrozenModel   full fine-tuning: a frozen copy of the starting weights, built and sharded like
                  the trained model (`Session.build_model(frozen=True)`), under no_grad
    Precomputed   either of the above run once before training over every training and validation
                  pair, stored beside the run in `<out_dir>/reference_logps.safetensors` (tensors
                  "train" and "val", (pairs, 2): row = pair id, columns chosen and rejected), and
                  looked up by the batch's `pair_ids`; a resumed run reads the file again

Each gives `log_probs(model, batch)`: (2B,) float32, the summed log-probabilities of the batch's
chosen rows then its rejected rows, without gradient.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from toolkit.errors import UserError
from toolkit.models.adapters import adapters_switched_off
from toolkit.models.moe import router_stats_off
from toolkit.parallel.fsdp import release_gathered
from toolkit.training.objectives import ObjectiveSetup

REFERENCE_FILE = "reference_logps.safetensors"


class Reference:
    """Where a batch's reference log-probabilities come from (`model`: the trained model, as the loop calls it)."""

    def log_probs(self, model, batch: dict[str, Any]) -> torch.Tensor:
        """(2B,) float32: the chosen rows', then the rejected rows' summed log-probabilities."""
        raise NotImplementedError

    def describe(self) -> str:
        """What the reference is, for the log."""
        raise NotImplementedError


def _summed_log_probs(model, batch: dict[str, Any]) -> torch.Tensor:
    # A mixture of experts' router stats are the policy's: the reference's routing adds no router loss.
    with router_stats_off():
        return model(batch["input_ids"], labels=batch["labels"], per_token=True).sum(-1)


class AdaptersOff(Reference):
    """The trained (peft) model with every adapter switched off: its frozen base. Under FSDP the
    units this pass leaves gathered are freed after it (`release_gathered`)."""

    def log_probs(self, model, batch):
        with torch.no_grad(), adapters_switched_off(model):
            values = _summed_log_probs(model, batch)
        release_gathered(model)
        return values

    def describe(self) -> str:
        return "the base model, with the LoRA adapters switched off (no second copy)"


class FrozenModel(Reference):
    """A model that does not train: a frozen copy, or the trained model before its first step."""

    def __init__(self, model, what: str) -> None:
        self.model, self.what = model, what

    def log_probs(self, model, batch):
        with torch.no_grad():
            return _summed_log_probs(self.model, batch)

    def describe(self) -> str:
        return self.what


class Precomputed(Reference):
    """Stored log-probabilities, looked up by pair id: the training table while the model trains,
    the validation table while it is evaluated (`model.training`, which the loop sets)."""

    def __init__(self, tables: dict[str, torch.Tensor], path: Path) -> None:
        self.tables, self.path = tables, path

    def log_probs(self, model, batch):
        split = "train" if model.training else "val"
        table = self.tables.get(split)
        if table is None:
            raise RuntimeError(f"no precomputed reference log-probabilities for the {split} pairs")
        pair_ids = batch["pair_ids"]
        rows = table[pair_ids.to(table.device)].to(pair_ids.device)  # (B, 2)
        return torch.cat([rows[:, 0], rows[:, 1]])

    def describe(self) -> str:
        return f"log-probabilities precomputed once, in {self.path}"


def choose_reference(setup: ObjectiveSetup, precompute: bool) -> Reference:
    """The run's reference (see the module's docstring); says which on rank 0."""
    fabric = setup.fabric
    live: Reference
    if setup.frozen_base:
        live = AdaptersOff()
    elif precompute:  # before any step (and before a resumed run loads its checkpoint) the model is the reference
        live = FrozenModel(setup.model, "the model's starting weights")
    else:
        live = FrozenModel(setup.build_frozen_copy(), "a frozen copy of the starting weights, sharded like the trained model")
    if not precompute:
        fabric.print(f"Reference: {live.describe()}.")
        return live
    reference = precomputed_reference(setup, live)
    fabric.print(f"Reference: {reference.describe()}.")
    return reference


def precomputed_reference(setup: ObjectiveSetup, live: Reference) -> Precomputed:
    """The stored reference log-probabilities of every pair of the run's data, computed with `live`
    now unless `<out_dir>/reference_logps.safetensors` holds them for the same starting weights,
    data and precision (a resumed run, or a fresh run in the folder of one that stopped).

    Rank 0 decides and reads the file; the other ranks receive its tables (on several machines
    only rank 0's folder needs to hold it)."""
    from toolkit.safetensors_io import load_file, save_file
    from toolkit.training.failures import run_on_rank_zero

    fabric = setup.fabric
    path = Path(setup.out_dir) / REFERENCE_FILE
    splits = {"train": setup.train_loader, "val": setup.val_loader}
    samples = {name: _enumerable(loader) for name, loader in splits.items() if loader is not None}
    wanted = {"base_fingerprint": setup.base_fingerprint, "precision": setup.precision}
    for name, pairs in samples.items():
        wanted[f"{name}_pairs"] = str(len(pairs))
        wanted[f"{name}_checksum"] = str(getattr(pairs, "checksum", ""))
    stored = _read_metadata(path) if fabric.global_rank == 0 else None
    reuse = fabric.broadcast(stored == wanted, src=0) if fabric.world_size > 1 else stored == wanted
    if reuse:
        tables = {name: torch.zeros(len(pairs), 2, dtype=torch.float32, device=fabric.device) for name, pairs in samples.items()}
        if fabric.global_rank == 0:
            for name, table in load_file(path).items():
                tables[name].copy_(table)
        if fabric.world_size > 1:
            for name in sorted(tables):
                torch.distributed.broadcast(tables[name], src=0)
        fabric.print(f"Reusing the reference log-probabilities in {path} ({_count(wanted)}).")
        return Precomputed(tables, path)
    if stored is not None:
        changed = sorted(k for k in wanted if stored.get(k) != wanted[k])
        fabric.print(f"{path} was computed for another {', '.join(changed)}: computing it again.")
    start = time.perf_counter()
    was_training = setup.model.training
    setup.model.eval()
    try:
        tables = {name: _compute_table(fabric, setup.model, live, pairs, splits[name], setup.micro_batch_size)
                  for name, pairs in samples.items()}
    finally:
        setup.model.train(was_training)

    def write() -> None:
        tmp = path.with_name(path.name + ".tmp")
        save_file(tables, tmp, metadata=wanted)
        os.replace(tmp, path)  # whole or not at all

    run_on_rank_zero(fabric, write)
    fabric.print(f"Computed the reference log-probabilities of {_count(wanted)} in {time.perf_counter() - start:.1f} s "
                 f"with {live.describe()}; stored in {path}.")
    return Precomputed(tables, path)


def _count(metadata: dict[str, str]) -> str:
    counts = [f"{metadata[f'{name}_pairs']} {what} pairs" for name, what in (("train", "training"), ("val", "validation"))
              if f"{name}_pairs" in metadata]
    return " and ".join(counts)


def _enumerable(loader) -> Any:
    """The loader's pairs, addressable by pair id: `samples` with `len` and `collate(indices, pad_id)`."""
    samples = getattr(loader, "samples", None)
    if samples is None or not hasattr(samples, "collate"):
        raise UserError("--objective.precompute_reference needs a data module whose loaders hold their pairs "
                        "(--data Preference or HFPreference).")
    return samples


def _read_metadata(path: Path) -> dict[str, str] | None:
    if not path.is_file():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception:  # a damaged file is computed again
        return None


def _compute_table(fabric, model, live: Reference, samples, loader, micro_batch_size: int) -> torch.Tensor:
    """(pairs, 2) float32 on the device: every pair's reference log-probabilities (chosen, rejected).

    The pairs are cut into micro-batches of consecutive ids; rank r computes micro-batches r,
    r + world, ... Every rank runs as many forward passes (under FSDP each one is collective): a rank
    with none left repeats its first and discards it. One all-reduce (sum) then gives every rank the
    whole table, each entry written by exactly one rank."""
    n, world, rank = len(samples), fabric.world_size, fabric.global_rank
    pad_id = getattr(loader, "pad_id", 0)
    chunks = [list(range(start, min(start + micro_batch_size, n))) for start in range(0, n, micro_batch_size)]
    table = torch.zeros(n, 2, dtype=torch.float32, device=fabric.device)
    for k in range(-(-len(chunks) // world)):
        j = k * world + rank
        indices = chunks[j] if j < len(chunks) else chunks[0]
        batch = fabric.to_device(samples.collate(indices, pad_id))
        values = live.log_probs(model, batch).float()  # (2B,)
        if j < len(chunks):
            chosen, rejected = values.chunk(2)
            table[batch["pair_ids"]] = torch.stack([chosen, rejected], dim=1)
    release_gathered(model)
    if world > 1:
        torch.distributed.all_reduce(table)
    return table
