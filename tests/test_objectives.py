"""Objectives plugged into the one loop (`toolkit.training.objectives`).

A custom objective trains and logs through `fit` and a real Fabric; causal language modelling
through the objective gives, bit for bit, the step the loop has always taken; and a custom
objective with a frozen reference model built by `Session.build_model` gives on two FSDP processes
what it gives on one.
"""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import fit_on_one_cpu, launch_env, load_script, logged_metrics
from toolkit.models import IGNORE_INDEX
from toolkit.models.config import Config
from toolkit.models.gpt import GPT, init_weights
from toolkit.training.objectives import CausalLM, Objective

REPO = Path(__file__).resolve().parents[1]
SEQ = 12
MICRO = 2
ACCUMULATION = 2
STEPS = 2
LR = 0.5


def _batches(count: int, seed: int, packed: bool = False) -> list[dict]:
    """`count` micro-batches of MICRO sequences; row 0 has a masked prompt, row 1 padding of varying length."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        tokens = torch.randint(0, 64, (MICRO, SEQ + 1), generator=generator)
        labels = tokens[:, 1:].clone()
        labels[0, :3] = IGNORE_INDEX
        labels[1, -(i % 4 + 1):] = IGNORE_INDEX
        batch = {"input_ids": tokens[:, :-1], "labels": labels}
        if packed:
            batch["document_ids"] = torch.tensor([[0] * 5 + [1] * (SEQ - 5), [0] * SEQ])
        out.append(batch)
    return out


def _model() -> GPT:
    torch.manual_seed(0)
    model = GPT(Config.from_name("debug", n_layer=1, n_embd=32, n_head=4, vocab_size=64, block_size=32))
    init_weights(model, 1)
    return model


def _fit(model, objective, train_batches, val_batches, log_dir: Path):
    return fit_on_one_cpu(model, objective, train_batches, val_batches, log_dir, micro=MICRO, accumulation=ACCUMULATION,
                          seq=SEQ, steps=STEPS, lr=LR)


def _sgd_step(model, loss: torch.Tensor) -> None:
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
            p.grad = None


# ------------------------------------------------------------------ a custom objective
class SequenceMeanLoss(Objective):
    """The unit is a sequence: each sequence's mean token cross-entropy, whatever its length."""

    def normaliser(self, batch):
        return torch.tensor(batch["input_ids"].shape[0])

    def loss(self, model, batch):
        per_sequence, targets = _sequence_losses(model, batch)
        return per_sequence.sum(), {"target_tokens": targets.sum().float(), "first_sequence_loss": per_sequence[0].detach()}


def _sequence_losses(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    labels = batch["labels"]
    logits = model(batch["input_ids"])  # (B, T, V)
    token_losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                   reduction="none").view(labels.shape)
    targets = (labels != IGNORE_INDEX).sum(dim=1)
    return token_losses.sum(dim=1) / targets, targets


def test_a_custom_objective_trains_by_its_own_units_and_logs_its_metrics(tmp_path):
    """Each step's gradient is that of the mean over the step's sequences (not over its tokens, nor
    a mean of micro-batch means); train/ and val/ log the loss and every metric, each summed over
    the micro-batches and divided by the summed normaliser."""
    train_batches, val_batches = _batches(STEPS * ACCUMULATION, seed=1), _batches(2, seed=2)
    expected_model = _model()
    trained, rows = _fit(copy.deepcopy(expected_model), SequenceMeanLoss(), train_batches, val_batches, tmp_path)

    expected_logs = {}
    for step in range(STEPS):
        group = train_batches[step * ACCUMULATION:(step + 1) * ACCUMULATION]
        merged = {key: torch.cat([b[key] for b in group]) for key in ("input_ids", "labels")}
        per_sequence, targets = _sequence_losses(expected_model, merged)
        first = torch.stack([_sequence_losses(expected_model, b)[0][0] for b in group])
        expected_logs[step + 1] = {"train/loss": per_sequence.mean().item(), "train/first_sequence_loss": first.sum().item() / 4,
                                   "train/target_tokens": targets.sum().item() / 4}
        _sgd_step(expected_model, per_sequence.mean())
        with torch.no_grad():
            val = {key: torch.cat([b[key] for b in val_batches]) for key in ("input_ids", "labels")}
            val_losses, val_targets = _sequence_losses(expected_model, val)
        expected_logs[step + 1].update({"val/loss": val_losses.mean().item(), "val/target_tokens": val_targets.float().mean().item()})

    for (name, got), (_, want) in zip(trained.named_parameters(), expected_model.named_parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)
    logged = {}
    for row in rows:
        logged.setdefault(int(row["step"]), {}).update({k: float(v) for k, v in row.items() if v and k != "step"})
    for step, expected in expected_logs.items():
        for name, value in expected.items():
            assert logged[step][name] == pytest.approx(value, rel=1e-5), (step, name)
    assert not any("ppl" in name for values in logged.values() for name in values)  # not a token cross-entropy
    # The metrics of a step are the sums over its 2 micro-batches divided by its 4 sequences, exactly.
    assert logged[1]["train/target_tokens"] == sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in train_batches[:2]) / 4


# ------------------------------------------------------------------ causal LM, as the loop always trained it
@pytest.mark.parametrize("packed", [False, True])
def test_causal_lm_through_the_objective_is_the_step_the_loop_always_took(tmp_path, packed):
    """Bit for bit: each micro-batch's summed token loss times 1 / (the step's target tokens),
    backpropagated; train/loss = the step's summed loss / its target tokens; val/loss and val/ppl."""
    train_batches, val_batches = _batches(STEPS * ACCUMULATION, seed=3, packed=packed), _batches(2, seed=4, packed=packed)
    expected_model = _model()
    trained, rows = _fit(copy.deepcopy(expected_model), CausalLM(), train_batches, val_batches, tmp_path)

    def loss_sum(model, batch):
        extra = {"document_ids": batch["document_ids"]} if packed else {}
        return model(batch["input_ids"], labels=batch["labels"], **extra)

    expected_train, expected_val = [], []
    for step in range(STEPS):
        group = train_batches[step * ACCUMULATION:(step + 1) * ACCUMULATION]
        targets = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in group)
        scale = 1 / torch.tensor(targets)
        total = torch.zeros(())
        for batch in group:
            summed = loss_sum(expected_model, batch)
            (summed * scale).backward()
            total += summed.detach()
        with torch.no_grad():
            for p in expected_model.parameters():
                p -= LR * p.grad
                p.grad = None
        expected_train.append((total / targets).item())
        with torch.no_grad():
            val_sum = sum(loss_sum(expected_model, b) for b in val_batches)
            expected_val.append((val_sum / sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in val_batches)).item())

    for (name, got), (_, want) in zip(trained.named_parameters(), expected_model.named_parameters()):
        assert torch.equal(got, want), name
    train_losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    val_losses = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    val_ppl = [float(r["val/ppl"]) for r in rows if r.get("val/ppl")]
    assert train_losses == pytest.approx(expected_train, rel=1e-6)
    assert val_losses == pytest.approx(expected_val, rel=1e-6)
    assert val_ppl == pytest.approx([torch.tensor(v).exp().item() for v in expected_val], rel=1e-5)


# ------------------------------------------------------------------ N processes, a frozen reference model
def _run_ranks(out_dir: Path, devices: int) -> list[dict]:
    script = REPO / "tests" / "scripts" / "objective_ranks.py"
    if devices == 1:
        load_script(script).run(out_dir, 1)
    else:
        result = subprocess.run([sys.executable, str(script), str(out_dir), str(devices)], capture_output=True, text=True,
                                env=launch_env(), timeout=300)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return [json.loads((out_dir / f"report-{rank}.json").read_text()) for rank in range(devices)]


def test_a_custom_objective_with_a_frozen_reference_gives_on_two_fsdp_processes_what_it_gives_on_one(tmp_path):
    """The same global batch on 1 process (4 accumulation steps) and 2 FSDP processes (2 each): the
    same weights and logged losses and metrics. The reference model `build_model(frozen=True)` builds
    beside the trained one is sharded like it, trains nothing, and holds only its shards after its
    forward passes; weight decay still covers exactly the matrices."""
    one, two = tmp_path / "one", tmp_path / "two"
    reports = _run_ranks(one, 1) + _run_ranks(two, 2)
    assert [r["rank"] for r in reports] == [0, 0, 1]
    for report in reports:
        assert report["reference_frozen"] and report["reference_in_eval_mode"], report
        assert report["reference_outside_the_optimizer"] and report["sharded_alike"], report
        assert report["decayed_parameters"] == report["matrices"], report
    assert [r["sharded"] for r in reports] == [False, True, True]
    # validation frees what its forward passes gathered (the head and final norm wait for a backward pass)
    assert [r["sharded_after_validation"] for r in reports] == [False, True, True]
    assert [r["reference_sharded_after_fit"] for r in reports] == [False, True, True]

    a, b = load_file(str(one / "final" / "model.safetensors")), load_file(str(two / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=0, msg=name)
    names = ("train/loss", "train/model_loss", "train/reference_loss", "val/loss", "val/model_loss", "val/reference_loss")
    logs = []
    for out in (one, two):
        rows = logged_metrics(out)
        logs.append({(r["step"], n): float(r[n]) for r in rows for n in names if r.get(n)})
    assert logs[0].keys() == logs[1].keys() and {n for _, n in logs[0]} == set(names)
    for key, value in logs[0].items():
        assert logs[1][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    # The trained model moved away from the reference: their losses differ after the first step.
    assert logs[0][("2", "train/loss")] != 0.0


def test_resuming_under_another_objective_or_its_settings_is_refused(tmp_path):
    from toolkit.errors import UserError
    from toolkit.training.checkpoint import META, check_compatible
    from toolkit.training.objectives import SFT, CausalLM
    from toolkit.training.preference_objectives import DPO, IPO

    def saved(objective):
        folder = tmp_path / type(objective).__name__
        folder.mkdir(exist_ok=True)
        (folder / META).write_text(json.dumps({"run": {"global_batch_size": 4, "objective": objective.record()}}))
        return folder

    dpo = saved(DPO(beta=0.1))
    check_compatible(dpo, {"global_batch_size": 4, "objective": DPO(beta=0.1, precompute_reference=True).record()})
    with pytest.raises(UserError, match="objective beta: checkpoint has 0.1, this run 0.2"):
        check_compatible(dpo, {"global_batch_size": 4, "objective": DPO(beta=0.2).record()})
    with pytest.raises(UserError, match="objective name: checkpoint has 'DPO', this run 'IPO'"):
        check_compatible(dpo, {"global_batch_size": 4, "objective": IPO().record()})
    with pytest.raises(UserError, match="objective name: checkpoint has 'SFT', this run 'DPO'"):
        check_compatible(saved(SFT()), {"global_batch_size": 4, "objective": DPO().record()})
    # a checkpoint written before objectives were recorded resumes as before
    older = tmp_path / "older"
    older.mkdir()
    (older / META).write_text(json.dumps({"run": {"global_batch_size": 4}}))
    check_compatible(older, {"global_batch_size": 4, "objective": CausalLM().record()})


def test_a_batch_run_only_to_keep_the_ranks_in_step_adds_the_shapes_of_its_sums_not_their_values():
    """Validation with fewer batches than ranks: a rank's uncounted batch adds nothing to the sums but
    its metric names and its normaliser's dtype, so that every rank all-reduces the same tensors."""
    from toolkit.training.loop import _Sums
    from toolkit.training.objectives import ObjectiveOutput

    output = ObjectiveOutput(loss_sum=torch.tensor(3.0), normaliser=torch.tensor(2.5),
                             metrics={"accuracy": torch.tensor(1.0)})
    skipped, counted = _Sums(torch.device("cpu")), _Sums(torch.device("cpu"))
    skipped.add(output, counted=False)
    counted.add(output)
    assert skipped.normaliser.dtype == counted.normaliser.dtype == torch.float32  # a float total weight
    assert skipped.metrics.keys() == counted.metrics.keys() == {"accuracy"}
    assert skipped.loss.item() == skipped.normaliser.item() == skipped.metrics["accuracy"].item() == 0


def test_an_objective_metric_named_like_the_loops_own_or_not_a_tensor_is_refused():
    """A user objective that returned {"loss": n_targets} replaced the logged loss with its count."""
    from toolkit.errors import UserError
    from toolkit.training.objectives import ObjectiveOutput

    loss, n = torch.tensor(3.0), torch.tensor(4)
    for name in ("loss", "ppl"):
        with pytest.raises(UserError, match=f"may not be named '{name}': the loop logs loss and ppl itself"):
            ObjectiveOutput(loss_sum=loss, normaliser=n, metrics={name: torch.tensor(1.0)})
    with pytest.raises(UserError, match="metric 'tokens' is a float; metrics are tensors"):
        ObjectiveOutput(loss_sum=loss, normaliser=n, metrics={"tokens": 4.0})
    assert ObjectiveOutput(loss_sum=loss, normaliser=n, metrics={"tokens": torch.tensor(4.0)}).metrics
