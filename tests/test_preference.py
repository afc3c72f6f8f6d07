"""Preference objectives (`toolkit.training.preference_objectives`) against TRL 1.16, on a tiny random Llama.

A policy and a reference (the policy before a random step) are Hugging Face models; the toolkit's
copies come from the real converter. TRL computes each loss with its own code on the Hugging Face
models (DPOTrainer._compute_loss for DPO and IPO, CPOTrainer.get_batch_loss_metrics for SimPO,
ORPOTrainer.get_batch_loss_metrics for ORPO, CPOTrainer.cpo_loss for DPO's label smoothing); the
toolkit's objective computes it on the converted models from the toolkit's batch of the same pairs.
The losses, every logged metric and the gradients of every weight (mapped by name) must agree
within 1e-5 in float32. The trainers are made with `__new__` and given the attributes their loss
code reads, because their constructors tokenize a dataset and build a full training set-up.
"""

from __future__ import annotations

import copy
import types
from collections import defaultdict

import pytest
import torch
import transformers

from pair_data import collate_pairs
from toolkit.convert import convert_from_hf
from toolkit.convert.weight_maps import toolkit_to_hf_name
from toolkit.model_dir import load_model
from toolkit.training.preference_objectives import DPO, IPO, ORPO, SimPO
from toolkit.training.reference import FrozenModel

VOCAB = 96
PAD = 0
# (prompt, chosen response, rejected response) token ids; responses end with EOS (1).
PAIRS = [
    ([5, 17, 42, 9], [33, 12, 1], [70, 1]),
    ([8, 60], [21, 22, 23, 24, 1], [44, 45, 46, 1]),
    ([3, 91, 14, 15, 16, 7], [50, 1], [51, 52, 53, 54, 55, 1]),
]
# Chosen sequences of one length (7 tokens), prompts and responses of different lengths: TRL's ORPO
# averages its cross-entropy over a micro-batch's tokens, the toolkit's over each pair's.
ORPO_PAIRS = [
    ([5, 17, 42, 9], [33, 12, 1], [70, 1]),
    ([8, 60], [21, 22, 23, 24, 1], [44, 45, 46, 1]),
    ([3, 91, 14, 15, 16, 7], [1], [51, 52, 53, 54, 55, 1]),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(HF policy, HF reference, toolkit policy, toolkit reference), float32; the policy is the
    reference moved by a random step, so that the rewards are not zero."""
    root = tmp_path_factory.mktemp("preference")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=PAD, eos_token_id=1, bos_token_id=2)
    reference = transformers.LlamaForCausalLM(config).eval()
    policy = copy.deepcopy(reference)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out = []
    for name, hf in (("policy", policy), ("reference", reference)):
        hf.save_pretrained(root / f"hf_{name}")
        convert_from_hf(root / f"hf_{name}", root / name)
        out.append(load_model(root / name))
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(policy, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    add_fused_lm_head(reference)
    return policy, reference, out[0], out[1]


def toolkit_batch(pairs) -> dict:
    return collate_pairs(pairs, list(range(len(pairs))), PAD)


def _padded(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows])


def dpo_inputs(pairs) -> dict:
    """DPOTrainer's collated batch: unshifted ids, attention and completion masks, chosen first."""
    rows = [p + c for p, c, _ in pairs] + [p + r for p, _, r in pairs]
    prompts = [len(p) for p, _, _ in pairs] * 2
    completion = [[0] * n + [1] * (len(r) - n) for r, n in zip(rows, prompts)]
    return {"input_ids": _padded(rows, PAD), "attention_mask": _padded([[1] * len(r) for r in rows], 0),
            "completion_mask": _padded(completion, 0)}


def cpo_batch(pairs) -> dict:
    """CPOTrainer's / ORPOTrainer's batch: chosen_* and rejected_* ids, masks and unshifted labels."""
    batch = {}
    for side, index in (("chosen", 1), ("rejected", 2)):
        rows = [pair[0] + pair[index] for pair in pairs]
        batch[f"{side}_input_ids"] = _padded(rows, PAD)
        batch[f"{side}_attention_mask"] = _padded([[1] * len(r) for r in rows], 0)
        batch[f"{side}_labels"] = _padded([[-100] * len(pair[0]) + pair[index] for pair in pairs], -100)
    return batch


def accelerator():
    from accelerate import Accelerator

    return Accelerator(cpu=True)


def dpo_trainer(policy, reference, loss_type: str, beta: float):
    from trl import DPOTrainer

    trainer = DPOTrainer.__new__(DPOTrainer)
    attributes = dict(
        model=policy, ref_model=reference, accelerator=accelerator(), args=types.SimpleNamespace(gradient_checkpointing_kwargs=None),
        beta=beta, label_smoothing=0.0, loss_types=[loss_type], loss_weights=[1.0], ld_alpha=None, use_weighting=False,
        precompute_ref_logps=False, f_divergence_type="reverse_kl", f_alpha_divergence_coef=0.5, aux_loss_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
    )
    for name, value in attributes.items():
        setattr(trainer, name, value)
    return trainer


def cpo_trainer(cls, **settings):
    trainer = cls.__new__(cls)
    attributes = dict(accelerator=accelerator(), is_encoder_decoder=False, aux_loss_enabled=False, padding_value=PAD,
                      pad_token_id=PAD, alpha=0.0, label_smoothing=0.0, cpo_alpha=0.0)
    attributes.update(settings)
    for name, value in attributes.items():
        setattr(trainer, name, value)
    return trainer


def toolkit_grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters()}


def compare_grads(toolkit_model, hf_model) -> None:
    hf = dict(hf_model.named_parameters())
    for name, grad in toolkit_grads(toolkit_model).items():
        hf_name, _, parts = toolkit_to_hf_name("llama", name)
        assert parts == 1
        torch.testing.assert_close(grad, hf[hf_name].grad, atol=1e-5, rtol=1e-5, msg=name)


def _zero(*models) -> None:
    for model in models:
        model.zero_grad(set_to_none=True)
        model.train()  # no dropout in these models: the mode only tells train from validation


def _toolkit_loss(objective, policy, reference, pairs):
    if objective.uses_reference:
        objective.reference = FrozenModel(reference, "the reference")
    batch = toolkit_batch(pairs)
    output = objective(policy, batch)
    pairs_count = int(output.normaliser)
    loss = output.loss_sum / pairs_count
    loss.backward()
    return loss.detach(), {name: (value / pairs_count).item() for name, value in output.metrics.items()}


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_and_ipo_equal_trl_dpo_trainer(models, loss_type):
    hf_policy, hf_reference, policy, reference = models
    _zero(hf_policy, policy)
    beta = 0.3
    trainer = dpo_trainer(hf_policy, hf_reference, loss_type, beta)
    trl_loss = trainer._compute_loss(hf_policy, dpo_inputs(PAIRS), return_outputs=False)
    trl_loss.backward()
    objective = DPO(beta=beta) if loss_type == "sigmoid" else IPO(beta=beta)
    loss, metrics = _toolkit_loss(objective, policy, reference, PAIRS)

    torch.testing.assert_close(loss, trl_loss.detach(), atol=1e-5, rtol=1e-5)
    logged = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected"):
        assert metrics[name] == pytest.approx(logged[name], rel=1e-5, abs=1e-5), name
    assert 0 < metrics["rewards/accuracies"] < 1 or metrics["rewards/margins"] != 0
    compare_grads(policy, hf_policy)


def test_dpo_label_smoothing_equals_trl_conservative_sigmoid(models):
    """TRL 1.16's DPOTrainer has no label smoothing in its sigmoid loss; its CPOTrainer.cpo_loss
    ("sigmoid") is the conservative loss, fed here the DPO log-ratios of the toolkit models."""
    from trl.experimental.cpo import CPOTrainer

    _, _, policy, reference = models
    beta, smoothing = 0.5, 0.2
    _zero(policy)
    batch = toolkit_batch(PAIRS)
    per_token = policy(batch["input_ids"], labels=batch["labels"], per_token=True).sum(-1)
    with torch.no_grad():
        ref = reference(batch["input_ids"], labels=batch["labels"], per_token=True).sum(-1)
    ratios = (per_token - ref).chunk(2)
    trainer = cpo_trainer(CPOTrainer, beta=beta, label_smoothing=smoothing, loss_type="sigmoid")
    trl_losses, _, _ = trainer.cpo_loss(*ratios)
    trl_loss = trl_losses.mean()
    trl_loss.backward()
    expected = toolkit_grads(policy)
    _zero(policy)
    loss, _ = _toolkit_loss(DPO(beta=beta, label_smoothing=smoothing), policy, reference, PAIRS)
    torch.testing.assert_close(loss, trl_loss.detach(), atol=1e-5, rtol=1e-5)
    unsmoothed = -torch.nn.functional.logsigmoid(beta * (ratios[0] - ratios[1])).mean()
    assert abs(loss.item() - unsmoothed.item()) > 1e-3  # the smoothing is in the comparison
    for name, grad in toolkit_grads(policy).items():
        torch.testing.assert_close(grad, expected[name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("kind", ["simpo", "orpo"])
def test_simpo_and_orpo_equal_trl(models, kind):
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    hf_model, _, policy, _ = models  # called without fused_lm_head, the patched forward gives logits
    _zero(hf_model, policy)
    if kind == "simpo":
        pairs, objective = PAIRS, SimPO(beta=2.0, gamma=0.7, label_smoothing=0.1)
        trainer = cpo_trainer(CPOTrainer, beta=2.0, simpo_gamma=0.7, label_smoothing=0.1, loss_type="simpo")
    else:
        pairs, objective = ORPO_PAIRS, ORPO(beta=0.25)
        trainer = cpo_trainer(ORPOTrainer, beta=0.25)
    trl_loss, trl_metrics = trainer.get_batch_loss_metrics(hf_model, cpo_batch(pairs))
    trl_loss.backward()
    loss, metrics = _toolkit_loss(objective, policy, None, pairs)

    torch.testing.assert_close(loss, trl_loss.detach(), atol=1e-5, rtol=1e-5)
    names = ["rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected"]
    if kind == "orpo":
        names += ["nll_loss", "log_odds_ratio", "log_odds_chosen"]
    for name in names:
        assert metrics[name] == pytest.approx(float(trl_metrics[name]), rel=1e-5, abs=1e-5), name
    compare_grads(policy, hf_model)
