"""Preference objectives on the one loop: DPO, IPO (against a reference model), SimPO and ORPO (reference-free).

Batches (`--data Preference` / `HFPreference`) hold B pairs in 2B rows, one forward pass for both:

    input_ids (2B, T) int64   rows 0..B-1 the chosen sequences, rows B..2B-1 the rejected ones, same pair order
    labels    (2B, T) int64   shifted targets; IGNORE_INDEX on the prompt and the padding
    pair_ids  (B,)    int64   each pair's index in its split (train or val), the same in every epoch and run

The unit is a pair: `loss` returns the per-pair losses summed, `normaliser` the number of pairs, so
every pair weighs the same whatever the split into micro-batches and ranks (the loop divides by the
step's pairs). A sequence's log-probability is the sum over its response tokens of the float32
log-probability of each label, from the model's fused head (`GPT.forward(per_token=True)`).

Metrics, each a sum over pairs (the loop logs the mean per pair as train/<name> and val/<name>),
with TRL's names and meanings: rewards/chosen, rewards/rejected, rewards/margins (chosen - rejected),
rewards/accuracies (the chosen reward is the larger), logps/chosen and logps/rejected (the policy's
log-probabilities as the loss uses them: summed for DPO and IPO, per token for SimPO and ORPO).

The reference of DPO and IPO (`toolkit.training.reference`) is chosen in `prepare`: the base model
with the LoRA adapters switched off, a frozen copy sharded like the trained model (full
fine-tuning), or log-probabilities computed once before training (`precompute_reference`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
import torch.nn.functional as F

from toolkit.errors import UserError
from toolkit.models import IGNORE_INDEX
from toolkit.training.objectives import Objective, ObjectiveSetup, peek_batch, tokens_before_padding

PAIR_KEYS = ("input_ids", "labels", "pair_ids")


@dataclass
class PairLogProbs:
    """The policy's view of a micro-batch's B pairs, each (B,) float32."""

    chosen: torch.Tensor  # summed log-probabilities of the chosen responses
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor  # response tokens (labels that count) of each chosen sequence
    rejected_tokens: torch.Tensor
    chosen_nll: Optional[torch.Tensor] = None  # ORPO: each chosen sequence's mean token cross-entropy


def sequence_log_probs(model, batch: dict[str, Any], labels: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(2B, T) float32 log-probability of each label, 0 where it is IGNORE_INDEX; one forward pass."""
    return model(batch["input_ids"], labels=batch["labels"] if labels is None else labels, per_token=True)


def split_pairs(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(2B, ...) -> (chosen (B, ...), rejected (B, ...))."""
    half = values.shape[0] // 2
    return values[:half], values[half:]


@dataclass
class PreferenceObjective(Objective, ABC):
    """What every preference loss shares: units, the policy's log-probabilities, metrics, the reference.

    Subclasses set `uses_reference` and implement `pair_losses`."""

    beta: float = 0.1
    # DPO and IPO: the reference's log-probabilities computed once before training for every pair
    # and stored beside the run (a resumed run reuses them), instead of a reference model alive in
    # every step. Reference-free losses refuse it.
    precompute_reference: bool = False

    uses_reference: ClassVar[bool] = True

    def __post_init__(self) -> None:
        name = f"--objective {type(self).__name__}"
        if not self.beta > 0:
            raise UserError(f"{name}: beta must be positive, got {self.beta}")
        if self.precompute_reference and not self.uses_reference:
            raise UserError(f"{name} is reference-free: there is no reference to precompute; drop --objective.precompute_reference.")
        self.reference = None  # `toolkit.training.reference.Reference`, chosen by `prepare`

    # ------------------------------------------------------------------ the Objective interface
    def normaliser(self, batch: dict[str, Any]) -> torch.Tensor:
        pair_ids = batch["pair_ids"]
        return torch.full((), pair_ids.shape[0], dtype=torch.long, device=pair_ids.device)

    def real_tokens(self, batch: dict[str, Any]) -> torch.Tensor:
        return tokens_before_padding(batch["labels"])

    def head_rows(self, batch: dict[str, Any]) -> torch.Tensor:
        """The trained model's rows: each pair's response tokens (the reference's are not counted
        in MFU at all)."""
        return (batch["labels"] != IGNORE_INDEX).sum()

    def loss(self, model, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        missing = [key for key in PAIR_KEYS if key not in batch]
        if missing:
            raise UserError(f"--objective {type(self).__name__} trains on preference pairs, but the batches have no "
                            f"{', '.join(missing)}: use --data Preference or HFPreference.")
        policy = self.policy_log_probs(model, batch)
        reference = None
        if self.uses_reference:
            if self.reference is None:
                raise RuntimeError(f"{type(self).__name__} has no reference: call prepare() first")
            reference = split_pairs(self.reference.log_probs(model, batch))
        losses, chosen_rewards, rejected_rewards, logps, extra = self.pair_losses(policy, reference)
        margins = chosen_rewards - rejected_rewards
        metrics = {
            "rewards/chosen": chosen_rewards.sum(),
            "rewards/rejected": rejected_rewards.sum(),
            "rewards/margins": margins.sum(),
            "rewards/accuracies": (margins > 0).float().sum(),
            "logps/chosen": logps[0].detach().sum(),
            "logps/rejected": logps[1].detach().sum(),
            **extra,
        }
        return losses.sum(), metrics

    def memory_profile(self, frozen_base: bool) -> dict[str, bool]:
        # LoRA's reference is its own base; a precomputed one is a table, not a model.
        return {"pairs": True, "frozen_copy": self.uses_reference and not frozen_base and not self.precompute_reference}

    def prepare(self, setup: ObjectiveSetup) -> None:
        batch = peek_batch(setup.train_loader)
        if batch is not None and "pair_ids" not in batch:
            raise UserError(f"--objective {type(self).__name__} trains on preference pairs, but the data gives single "
                            "sequences: use --data Preference or HFPreference (or --objective sft).")
        if self.uses_reference:
            from toolkit.training.reference import choose_reference

            self.reference = choose_reference(setup, self.precompute_reference)

    # ------------------------------------------------------------------ what a loss defines
    def policy_log_probs(self, model, batch: dict[str, Any]) -> PairLogProbs:
        per_token = sequence_log_probs(model, batch)
        tokens = (batch["labels"] != IGNORE_INDEX).sum(-1).float()
        (chosen, rejected), (chosen_tokens, rejected_tokens) = split_pairs(per_token.sum(-1)), split_pairs(tokens)
        return PairLogProbs(chosen, rejected, chosen_tokens, rejected_tokens)

    @abstractmethod
    def pair_losses(self, policy: PairLogProbs, reference: Optional[tuple[torch.Tensor, torch.Tensor]]):
        """(losses (B,), chosen rewards (B,), rejected rewards (B,), (chosen logps, rejected logps) as
        logged, extra metric sums {name: 0-dim}); the rewards detached."""


def sigmoid_loss(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """-log sigmoid(logits), with label smoothing e: the preference is taken as flipped with
    probability e (conservative DPO): -(1 - e) log sigmoid(x) - e log sigmoid(-x)."""
    loss = -F.logsigmoid(logits)
    if label_smoothing:
        loss = (1 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-logits)
    return loss


def _check_smoothing(objective: Any) -> None:
    if not 0 <= objective.label_smoothing < 0.5:
        raise UserError(f"--objective {type(objective).__name__}: label_smoothing must be in [0, 0.5), got {objective.label_smoothing}")


@dataclass
class DPO(PreferenceObjective):
    """Direct Preference Optimization (sigmoid loss), against a reference model.

    Per pair: -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))), pi and ref the summed
    log-probabilities of the responses; rewards beta * (pi - ref). With label_smoothing e > 0 the
    conservative loss -(1 - e) log sigmoid(x) - e log sigmoid(-x), for labels flipped with probability e.

    Args:
        beta: How far the policy may move from the reference (larger: less far).
        label_smoothing: Probability that a pair's preference is wrong, in [0, 0.5).
        precompute_reference: Compute the reference's log-probabilities once before training.
    """

    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_smoothing(self)

    def pair_losses(self, policy, reference):
        chosen_ratio, rejected_ratio = policy.chosen - reference[0], policy.rejected - reference[1]
        losses = sigmoid_loss(self.beta * (chosen_ratio - rejected_ratio), self.label_smoothing)
        rewards = self.beta * chosen_ratio.detach(), self.beta * rejected_ratio.detach()
        return losses, *rewards, (policy.chosen, policy.rejected), {}


@dataclass
class IPO(PreferenceObjective):
    """Identity Preference Optimization, against a reference model.

    Per pair: (h - 1 / (2 beta))^2, h = (pi_c - ref_c) / n_c - (pi_r - ref_r) / n_r with n the
    response tokens (TRL's normalisation by length, which the IPO authors confirmed). Rewards as DPO's.

    Args:
        beta: The regularisation (tau of the IPO paper): the margin aimed at is 1 / (2 beta).
        precompute_reference: Compute the reference's log-probabilities once before training.
    """

    def pair_losses(self, policy, reference):
        chosen_ratio, rejected_ratio = policy.chosen - reference[0], policy.rejected - reference[1]
        h = chosen_ratio / policy.chosen_tokens.clamp(min=1) - rejected_ratio / policy.rejected_tokens.clamp(min=1)
        losses = (h - 1 / (2 * self.beta)) ** 2
        rewards = self.beta * chosen_ratio.detach(), self.beta * rejected_ratio.detach()
        return losses, *rewards, (policy.chosen, policy.rejected), {}


@dataclass
class SimPO(PreferenceObjective):
    """Simple Preference Optimization: reference-free, length-normalised, with a target margin.

    Per pair: -log sigmoid(beta * (pi_c / n_c - pi_r / n_r) - gamma), pi the summed
    log-probabilities and n the response tokens; rewards beta * pi / n (TRL's CPOTrainer with
    loss_type "simpo"). label_smoothing as DPO's.

    Args:
        beta: Scale of the length-normalised reward (the paper uses 2 to 2.5).
        gamma: Target reward margin (TRL's simpo_gamma; the paper's gamma/beta about 0.5).
        label_smoothing: Probability that a pair's preference is wrong, in [0, 0.5).
    """

    beta: float = 2.0
    gamma: float = 1.0
    label_smoothing: float = 0.0

    uses_reference: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_smoothing(self)

    def pair_losses(self, policy, reference):
        chosen, rejected = policy.chosen / policy.chosen_tokens.clamp(min=1), policy.rejected / policy.rejected_tokens.clamp(min=1)
        losses = sigmoid_loss(self.beta * (chosen - rejected) - self.gamma, self.label_smoothing)
        return losses, self.beta * chosen.detach(), self.beta * rejected.detach(), (chosen, rejected), {}


@dataclass
class ORPO(PreferenceObjective):
    """Odds Ratio Preference Optimization: reference-free, supervised loss plus an odds-ratio term.

    Per pair: nll_c - beta * log sigmoid(log odds(p_c) - log odds(p_r)), where p = exp of the mean
    log-probability per response token, odds(p) = p / (1 - p), and nll_c is the chosen sequence's
    mean token cross-entropy over the prompt and the response (as TRL's ORPOTrainer computes it).
    Rewards beta * mean log-probability. Extra metrics: nll_loss, log_odds_ratio (the log sigmoid
    term) and log_odds_chosen (the log odds ratio).

    TRL averages the cross-entropy over the tokens of a whole micro-batch; here each pair's own
    mean, so every pair weighs the same in any split into micro-batches (the same when a
    micro-batch holds one pair, or chosen sequences of one length).

    Args:
        beta: Weight of the odds-ratio term (lambda in the ORPO paper; TRL's beta).
    """

    uses_reference: ClassVar[bool] = False

    def head_rows(self, batch: dict[str, Any]) -> torch.Tensor:
        """The chosen rows' every token after the first (their language-modelling term), the
        rejected rows' responses."""
        labels = batch["labels"]
        chosen_rows = labels.shape[0] // 2
        full = full_sequence_labels(batch["input_ids"][:chosen_rows], labels[:chosen_rows])
        return (full != IGNORE_INDEX).sum() + (labels[chosen_rows:] != IGNORE_INDEX).sum()

    def policy_log_probs(self, model, batch):
        labels = batch["labels"]
        full = full_sequence_labels(batch["input_ids"], labels)
        chosen_rows = labels.shape[0] // 2
        # One forward pass: the chosen rows score every token after the first, the rejected rows their responses.
        per_token = sequence_log_probs(model, batch, torch.cat([full[:chosen_rows], labels[chosen_rows:]]))
        response = labels != IGNORE_INDEX
        tokens = response.sum(-1).float()
        chosen_tokens, rejected_tokens = split_pairs(tokens)
        chosen_per_token, rejected_per_token = split_pairs(per_token)
        chosen_response = (chosen_per_token * response[:chosen_rows]).sum(-1)
        chosen_nll = -chosen_per_token.sum(-1) / (full[:chosen_rows] != IGNORE_INDEX).sum(-1).clamp(min=1)
        return PairLogProbs(chosen_response, rejected_per_token.sum(-1), chosen_tokens, rejected_tokens, chosen_nll)

    def pair_losses(self, policy, reference):
        chosen, rejected = policy.chosen / policy.chosen_tokens.clamp(min=1), policy.rejected / policy.rejected_tokens.clamp(min=1)
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        ratio = F.logsigmoid(log_odds)
        nll = policy.chosen_nll
        losses = nll - self.beta * ratio
        extra = {"nll_loss": nll.detach().sum(), "log_odds_ratio": ratio.detach().sum(), "log_odds_chosen": log_odds.detach().sum()}
        return losses, self.beta * chosen.detach(), self.beta * rejected.detach(), (chosen, rejected), extra


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate on both sides of -log 2 (log1p near 0 probability, expm1 near 1)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def full_sequence_labels(input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(R, T) labels of every token after each row's first, up to its last target: prompt positions
    get their next input token, padding after the last target stays IGNORE_INDEX.

    labels[t] is the target of input_ids[t]: a prompt position t's target is input_ids[t + 1]."""
    counted = labels != IGNORE_INDEX
    T = labels.shape[1]
    last = T - 1 - counted.flip(1).int().argmax(dim=1)  # (R,) position of each row's last target
    positions = torch.arange(T, device=labels.device)
    next_tokens = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)
    before_last = (positions[None] < last[:, None]) & counted.any(dim=1, keepdim=True)
    return torch.where(counted, labels, torch.where(before_last, next_tokens, torch.full_like(labels, IGNORE_INDEX)))
