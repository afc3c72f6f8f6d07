"""Objectives: what the one training loop minimises, given the model and a batch.

An objective turns (model, batch) into a loss summed over its *units* (target tokens for causal
language modelling; pairs for a preference loss), the number of those units, and metrics summed
over the same units. The loop (`toolkit.training.loop`) never calls the model nor reads a batch's
keys itself; it only adds up what the objective returns:

- Gradients. Before a step's backward passes the loop asks `normaliser(batch)` of every
  micro-batch of the step, adds them up over micro-batches and ranks (the step's one all-reduce)
  and backpropagates `(loss_sum + penalty_sum) * world_size / total` for each micro-batch (the strategy averages
  gradients over ranks; the factor world_size undoes that). The step's gradient is then that of
  (the loss summed over every unit of the step) / (its units), whatever the split into
  micro-batches and ranks: N processes give what one process gives at the same global batch, and
  a resumed run what an uninterrupted one gives.
- Logs. `train/loss` is the sum of `loss_sum` over the micro-batches and ranks since the last log
  divided by the sum of their normalisers; each metric `m` is logged as `train/m` the same way
  (its sums over micro-batches and ranks, divided by the summed normaliser). Validation logs
  `val/loss` and `val/m` over its batches alike, and `val/ppl` = exp(val/loss) for objectives whose
  loss is a mean token cross-entropy (`reports_perplexity`).

A mixture-of-experts model trains every objective with its router's losses (`WithRouterLosses`,
which `Session.fit` wraps around the objective): the load-balancing loss and the router z-loss of
each micro-batch, times their coefficients and its normaliser, join the gradient through
`ObjectiveOutput.penalty_sum`, so the step's gradient is that of (the loss summed over its units
plus each micro-batch's router terms weighted by its units) / (its units); on one micro-batch,
transformers' `loss + router_aux_loss_coef * aux_loss`. The logged loss stays the objective's own
(val/ppl its exp); the router terms and the experts' load are metrics (`router/...`).

Adding an objective: subclass `Objective`, implement `normaliser` and `loss` (and `real_tokens`
if batches are padded or hold no `input_ids`; `prepare` if it sets something up once before
training, such as a preference loss's reference model), and pass an instance to `Session.fit`
(or `fit`). See tutorials/objectives.md. The preference objectives (DPO, IPO, SimPO, ORPO) are in
`toolkit.training.preference_objectives`.
"""

from __future__ import annotations

import dataclasses
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional

import torch

from toolkit.errors import UserError
from toolkit.models import IGNORE_INDEX


# Metric names the loop gives its own values (train/loss, val/loss, val/ppl).
RESERVED_METRICS = ("loss", "ppl")


@dataclass
class ObjectiveOutput:
    """What an objective gives for one micro-batch; every tensor is 0-dim."""

    loss_sum: torch.Tensor  # the loss summed over this micro-batch's units (carries the graph)
    normaliser: torch.Tensor  # how many units: an integer count (or a float total weight)
    # name -> a sum over the same units, detached or not; logged as train/<name> and val/<name>
    # divided by the summed normaliser. "loss" and "ppl" are taken.
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    # Summed over the same units, trained with the loss but logged apart (a mixture of experts'
    # router losses, `WithRouterLosses`): the gradient is that of loss_sum + penalty_sum.
    penalty_sum: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        for name, value in self.metrics.items():
            if name in RESERVED_METRICS:
                raise UserError(f"An objective's metric may not be named {name!r}: the loop logs {' and '.join(RESERVED_METRICS)} "
                                "itself (the loss over the normaliser, its exp); rename it")
            if not isinstance(value, torch.Tensor):
                raise UserError(f"The objective's metric {name!r} is a {type(value).__name__}; metrics are tensors "
                                "(a sum over the micro-batch's units, as loss_sum is)")

    @property
    def trained_sum(self) -> torch.Tensor:
        """What the loop backpropagates (scaled): the loss and the penalty."""
        return self.loss_sum if self.penalty_sum is None else self.loss_sum + self.penalty_sum


@dataclass
class ObjectiveSetup:
    """What a fine-tuning entry point gives `Objective.prepare`, once, before training."""

    fabric: Any
    model: Any  # the trained model as Fabric set it up (sharded under FSDP), still at its starting weights
    train_loader: Any
    val_loader: Any  # None: no validation
    out_dir: Path
    precision: str  # the run's Fabric precision
    micro_batch_size: int
    # The trained weights are adapters over a frozen base (LoRA): the model with its adapters
    # switched off is the starting model.
    frozen_base: bool
    # Another copy of the starting weights, frozen and sharded like `model` (`Session.build_model(frozen=True)`).
    build_frozen_copy: Callable[[], Any]
    base_fingerprint: str  # identifies the starting checkpoint (`toolkit.model_dir.checkpoint_fingerprint`)


class Objective(ABC):
    """Base class of the objectives the loop trains and validates with.

    Subclasses implement `normaliser(batch)`, computed from the batch alone (the loop needs the
    whole step's count before any backward pass), and `loss(model, batch)`. Calling the objective
    returns both in one `ObjectiveOutput`, so the count the loss is divided by is always the one
    it was summed over.
    """

    # The loss is a mean token cross-entropy: validation also reports exp(loss) as val/ppl.
    reports_perplexity: ClassVar[bool] = False

    @abstractmethod
    def normaliser(self, batch: dict[str, Any]) -> torch.Tensor:
        """The units this micro-batch's loss is summed over (0-dim, on the batch's device).

        A count known on the host is made with `torch.full` on the device, not `torch.tensor`
        (a copy from host memory, which waits for the GPU's queued work)."""

    @abstractmethod
    def loss(self, model, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss summed over the units, metrics summed over them) for one micro-batch."""

    def real_tokens(self, batch: dict[str, Any]) -> torch.Tensor:
        """Input tokens the step computes on, padding left out (0-dim long): throughput, tokens_seen
        and MFU count these. Here every token of `input_ids`; override for padded batches."""
        ids = batch["input_ids"]
        return torch.full((), ids.numel(), dtype=torch.long, device=ids.device)

    def head_rows(self, batch: dict[str, Any]) -> Optional[torch.Tensor]:
        """How many rows of `batch` this objective sends through the model's fused output head
        (`GPT.head_loss`), which leaves out rows without a label on a CPU: MFU counts the head's
        FLOPs for these only. None (here): the objective computes logits for every input token
        (through `model(input_ids)`, as a custom loss does)."""
        return None

    def memory_profile(self, frozen_base: bool) -> dict[str, bool]:
        """What this objective adds to a training step's memory, as `toolkit.memory.check_run_fits`
        takes it: {"pairs": each sample is two rows with per-token log-probabilities, "frozen_copy":
        a frozen copy of the model lives beside it}. `frozen_base`: the run trains adapters (LoRA).
        Nothing here."""
        return {}

    def prepare(self, setup: ObjectiveSetup) -> None:
        """Set up what the objective needs beside the trained model, once, before the loop starts (and
        before a resumed run loads its checkpoint): check that the data fits it, build or compute a
        reference. Every rank calls it; collectives are allowed. Nothing to do here."""

    def record(self) -> dict[str, Any]:
        """What a resumed run must share with the run it continues: the objective's name and its
        numeric settings (a DPO beta, a loss coefficient). Switches that leave the loss unchanged
        (where a reference is computed) are free to change."""
        numbers = {}
        if dataclasses.is_dataclass(self):
            numbers = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                       if isinstance(getattr(self, f.name), (int, float)) and not isinstance(getattr(self, f.name), bool)}
        return {"name": type(self).__name__, **numbers}

    def __call__(self, model, batch: dict[str, Any]) -> ObjectiveOutput:
        loss_sum, metrics = self.loss(model, batch)
        return ObjectiveOutput(loss_sum=loss_sum, normaliser=self.normaliser(batch), metrics=metrics)


@dataclass
class CausalLM(Objective):
    """Next-token cross-entropy, normalised by target tokens (labels that are not IGNORE_INDEX).

    Batches: {"input_ids": (B, T), "labels": (B, T)} and, for packed rows (`--data.packing`),
    "document_ids" (B, T). Padding and masked prompts carry IGNORE_INDEX labels, so they weigh
    nothing. The model's fused head returns the summed loss without materialising the logits.
    """

    reports_perplexity = True

    def normaliser(self, batch: dict[str, Any]) -> torch.Tensor:
        return (batch["labels"] != IGNORE_INDEX).sum()

    def loss(self, model, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if "document_ids" in batch:
            return model(batch["input_ids"], labels=batch["labels"], document_ids=batch["document_ids"]), {}
        return model(batch["input_ids"], labels=batch["labels"]), {}

    def real_tokens(self, batch: dict[str, Any]) -> torch.Tensor:
        return tokens_before_padding(batch["labels"])

    def head_rows(self, batch: dict[str, Any]) -> torch.Tensor:
        return (batch["labels"] != IGNORE_INDEX).sum()

    def prepare(self, setup: ObjectiveSetup) -> None:
        batch = peek_batch(setup.train_loader)
        if batch is not None and "pair_ids" in batch:
            raise UserError(
                "The data gives preference pairs (chosen and rejected responses), which supervised fine-tuning would "
                "train on alike: choose a preference objective (--objective dpo, ipo, simpo or orpo), or instruction data."
            )


@dataclass
class SFT(CausalLM):
    """Supervised fine-tuning (`--objective sft`, the fine-tuning default): `CausalLM` on the responses."""


class WithRouterLosses(Objective):
    """`objective` on a mixture-of-experts model, with its router's losses (the module's docstring).

    For each micro-batch of n units (the objective's normaliser), over every MoE layer the model
    routed through in the objective's forward pass (`toolkit.models.moe.router_losses`):

        penalty_sum = n * (aux_coef * load-balancing loss + z_coef * z-loss)
        metrics     router/aux_loss, router/z_loss: n * each loss
                    router/load_min, router/load_max, router/load_cv: n * `load_summary` of the
                    experts' load (assignments per expert over an even share: 1.0 is balanced)

    so each is logged as the unit-weighted mean over the micro-batches (of every rank) since the
    last log, like the loss. `per_layer`: the load-balancing loss is each layer's own, averaged
    (`router_losses`). The stats are cleared before the objective runs and once read, so no
    micro-batch sees another's; forward passes that must not count (a preference loss's reference,
    a checkpointed block's recomputation: `as_recomputed`) route under `router_stats_off`. Padding (the tokens after
    each row's last label, `real_tokens`) is routed as every token but counted by none of the router
    terms, as transformers leaves it out through `attention_mask`.
    """

    def __init__(self, objective: Objective, aux_coef: float, z_coef: float, per_layer: bool = False,
                 aux_chosen: bool = True) -> None:
        """`aux_chosen`: the run gave `aux_coef` (False: it is the model config's)."""
        if aux_coef < 0 or z_coef < 0:
            raise UserError(f"Router loss coefficients must not be negative, got aux {aux_coef} and z {z_coef}")
        self.objective, self.aux_coef, self.z_coef = objective, float(aux_coef), float(z_coef)
        self.per_layer, self.aux_chosen = bool(per_layer), bool(aux_chosen)
        self.reports_perplexity = objective.reports_perplexity  # type: ignore[misc]
        self._layers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def normaliser(self, batch: dict[str, Any]) -> torch.Tensor:
        return self.objective.normaliser(batch)

    def loss(self, model, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.objective.loss(model, batch)

    def real_tokens(self, batch: dict[str, Any]) -> torch.Tensor:
        return self.objective.real_tokens(batch)

    def head_rows(self, batch: dict[str, Any]) -> Optional[torch.Tensor]:
        return self.objective.head_rows(batch)

    def memory_profile(self, frozen_base: bool) -> dict[str, bool]:
        return self.objective.memory_profile(frozen_base)

    def prepare(self, setup: ObjectiveSetup) -> None:
        self.objective.prepare(setup)

    def describe(self) -> str:
        balance = "load balancing per layer" if self.per_layer else "load balancing"
        line = (f"router losses: {balance} x {self.aux_coef:g}, z-loss x {self.z_coef:g} "
                "(--train.router_aux_loss_coef, --train.router_z_loss_coef, --train.router_aux_loss_per_layer)")
        if self.aux_coef == 0 and not self.aux_chosen:
            # a dense preset given experts through --model_overrides has no coefficient of its own
            line += ("; with no load-balancing loss the router may send most tokens to a few experts "
                     "(watch router/load_cv; Mixtral, Qwen3-MoE and OLMoE train with 0.001 to 0.02)")
        return line

    def __call__(self, model, batch: dict[str, Any]) -> ObjectiveOutput:
        from toolkit.models.moe import clear_router_stats, counting_only, load_summary, router_losses

        layers = self._moe_layers(model)
        clear_router_stats(layers)  # nothing routed before this micro-batch counts
        with counting_only(real_tokens(batch["labels"]) if "labels" in batch else None):
            output = self.objective(model, batch)
        losses = router_losses(layers, self.per_layer)
        clear_router_stats(layers)
        if losses is None:
            raise RuntimeError(f"{type(self.objective).__name__} ran no MoE layer of the model: no router losses")
        units = output.normaliser.to(losses.aux.dtype)
        penalty = None
        if self.aux_coef or self.z_coef:
            penalty = units * (self.aux_coef * losses.aux + self.z_coef * losses.z)
        load = load_summary(losses.load)
        metrics = {
            **output.metrics,
            "router/aux_loss": units * losses.aux.detach(),
            "router/z_loss": units * losses.z.detach(),
            **{f"router/load_{name}": units * value for name, value in load.items()},
        }
        return ObjectiveOutput(loss_sum=output.loss_sum, normaliser=output.normaliser, metrics=metrics,
                               penalty_sum=_add(output.penalty_sum, penalty))

    def _moe_layers(self, model) -> list:
        layers = self._layers.get(model)
        if layers is None:
            from toolkit.models.moe import moe_layers

            layers = self._layers[model] = moe_layers(model)
        return layers


def with_router_losses(objective: Optional[Objective], config: Any, train: Any) -> Objective:
    """`objective` (None: `CausalLM()`) as a run of `config` trains it: with its router's losses
    (`WithRouterLosses`) when some layer is a mixture of experts, each coefficient
    `train.router_*_loss_coef` where given, else the config's, balanced per layer where
    `train.router_aux_loss_per_layer` says so."""
    objective = objective if objective is not None else CausalLM()
    if not config.is_moe:
        return objective
    aux, z = train.router_aux_loss_coef, train.router_z_loss_coef
    return WithRouterLosses(objective, config.router_aux_loss_coef if aux is None else aux,
                            config.router_z_loss_coef if z is None else z, train.router_aux_loss_per_layer,
                            aux_chosen=aux is not None)


def _add(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return b if a is None else a if b is None else a + b


def peek_batch(loader: Any) -> Optional[dict[str, Any]]:
    """The batch of the loader's first sample, without moving the loader; None for a loader that
    cannot make one (the instruction and preference loaders can: they hold `samples` and `pad_id`)."""
    samples = getattr(loader, "samples", None)
    if samples is None or not hasattr(samples, "collate") or not len(samples):
        return None
    return samples.collate([0], getattr(loader, "pad_id", 0))


def tokens_before_padding(labels: torch.Tensor) -> torch.Tensor:
    """(B, T) labels -> tokens before the padding, summed over the rows (a 0-dim long tensor).

    A sample's last label is a target (its EOS, or the last response token when cut), and padding
    only follows it: a row's real tokens end at its last label that is not IGNORE_INDEX (in a
    packed row, its last sample's).
    """
    return _real_lengths(labels).sum()


def real_tokens(labels: torch.Tensor) -> torch.Tensor:
    """(B, T) labels -> (B, T) bool: the tokens before each row's padding (`tokens_before_padding`)."""
    positions = torch.arange(labels.shape[1], device=labels.device)
    return positions < _real_lengths(labels)[:, None]


def _real_lengths(labels: torch.Tensor) -> torch.Tensor:
    """(B,): 1 + the index of each row's last label that is not IGNORE_INDEX (0: none)."""
    counted = labels != IGNORE_INDEX
    length = labels.shape[1] - counted.flip(1).int().argmax(dim=1)
    return torch.where(counted.any(dim=1), length, 0)
