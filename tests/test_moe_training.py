"""Training a mixture of experts: the router's losses on the objective plug.

A step of the one loop on a tiny MoE equals, in its weights, a hand computation of transformers'
definition (the mean token cross-entropy + coef x `load_balancing_loss_func` + z-coef x z-loss, each
micro-batch weighted by its target tokens); the logged loss stays the cross-entropy and the router
terms and the experts' load are metrics, in the CSV log and the console line of `toolkit pretrain`,
for training and validation; the coefficients come from the config unless `--train.*` overrides
them; a preference loss's reference pass and a checkpointed block's recomputation add nothing and
leave nothing behind; two FSDP processes train what one process trains.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from conftest import ASSETS, fit_on_one_cpu, launch_env, load_script, logged_metrics
from toolkit.args import TrainArgs
from toolkit.cli import run
from toolkit.errors import UserError
from toolkit.models import IGNORE_INDEX
from toolkit.models.config import Config
from toolkit.models.gpt import GPT, Block, init_weights
from toolkit.models.moe import moe_layers
from toolkit.training.objectives import CausalLM, WithRouterLosses, with_router_losses

SEQ, MICRO, ACCUMULATION, STEPS, LR = 12, 2, 2, 2, 0.5
AUX, Z = 0.3, 0.05  # large, so that a missing or misweighted router term shows in the weights
METRICS = ("router/aux_loss", "router/z_loss", "router/load_min", "router/load_max", "router/load_cv")


def tiny_moe(**overrides) -> Config:
    values = dict(name="tiny-moe", vocab_size=64, block_size=32, n_layer=3, n_embd=32, n_head=4, n_query_groups=2,
                  intermediate_size=48, n_expert=6, n_expert_per_token=2, moe_intermediate_size=24, moe_layers=[0, 2],
                  router_aux_loss_coef=0.01, router_z_loss_coef=0.001)
    return Config(**{**values, **overrides})


def _model() -> GPT:
    config = tiny_moe()
    model = GPT(config)
    init_weights(model, config.n_layer, seed=7)
    generator = torch.Generator().manual_seed(8)
    with torch.no_grad():  # a router far from uniform: large, uneven router terms
        for layer in moe_layers(model):
            layer.router.weight.normal_(0, 0.5, generator=generator)
    return model


def _batches(count: int, seed: int) -> list[dict]:
    """Micro-batches whose target tokens differ (a masked prompt, padding of varying length)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        tokens = torch.randint(0, 64, (MICRO, SEQ + 1), generator=generator)
        labels = tokens[:, 1:].clone()
        labels[0, : 2 + i] = IGNORE_INDEX
        labels[1, -(i % 3 + 1):] = IGNORE_INDEX
        out.append({"input_ids": tokens[:, :-1], "labels": labels})
    return out


def _fit(model, objective, train_batches, val_batches, log_dir: Path):
    return fit_on_one_cpu(model, objective, train_batches, val_batches, log_dir, micro=MICRO, accumulation=ACCUMULATION,
                          seq=SEQ, steps=STEPS, lr=LR)


def _padding_mask(labels: torch.Tensor) -> torch.Tensor:
    """(B, T) 1 for each row's tokens up to its last label, 0 after them (the padding), as a
    right-padded batch's attention_mask is in transformers."""
    mask = torch.zeros(labels.shape, dtype=torch.long)
    for row, row_labels in enumerate(labels):
        labelled = (row_labels != IGNORE_INDEX).nonzero()
        if labelled.numel():
            mask[row, : int(labelled.max()) + 1] = 1
    return mask


def _transformers_terms(model, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(summed token cross-entropy, transformers' load-balancing loss, z-loss, expert load (L, X)) of
    one forward pass, from the routers' logits as transformers' Mixtral and Qwen3-MoE collect them;
    the padding counted out by its attention_mask."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    captured = []
    hooks = [layer.router.register_forward_hook(lambda m, i, out: captured.append(out)) for layer in moe_layers(model)]
    try:
        loss_sum = model(batch["input_ids"], labels=batch["labels"])
    finally:
        for hook in hooks:
            hook.remove()
    config = model.config
    mask = _padding_mask(batch["labels"])
    aux = load_balancing_loss_func(tuple(captured), config.n_expert, config.n_expert_per_token, attention_mask=mask)
    real = mask.reshape(-1).bool()
    z = torch.cat([logits[real] for logits in captured]).logsumexp(dim=-1).square().mean()
    chosen = [logits[real].topk(config.n_expert_per_token, dim=-1).indices.flatten() for logits in captured]
    load = torch.stack([torch.bincount(c, minlength=config.n_expert).float() for c in chosen])
    return loss_sum, aux, z, load


def test_a_step_is_cross_entropy_plus_the_router_terms_of_transformers(tmp_path):
    """Each micro-batch backpropagates (its summed cross-entropy + n (AUX aux + Z z)) / the step's
    target tokens, n its own target tokens; train/loss and val/loss are the cross-entropy alone
    (val/ppl its exp), the router metrics their unit-weighted means."""
    train_batches, val_batches = _batches(STEPS * ACCUMULATION, seed=1), _batches(2, seed=2)
    expected = _model()
    trained, rows = _fit(copy.deepcopy(expected), WithRouterLosses(CausalLM(), AUX, Z), train_batches, val_batches, tmp_path)

    expected_logs: dict[int, dict[str, float]] = {}
    for step in range(STEPS):
        group = train_batches[step * ACCUMULATION:(step + 1) * ACCUMULATION]
        units = [int((b["labels"] != IGNORE_INDEX).sum()) for b in group]
        total = sum(units)
        sums = dict.fromkeys(("loss",) + METRICS, 0.0)
        for batch, n in zip(group, units):
            loss_sum, aux, z, load = _transformers_terms(expected, batch)
            ((loss_sum + n * (AUX * aux + Z * z)) / total).backward()
            relative = load / load.mean(dim=1, keepdim=True)
            sums["loss"] += loss_sum.item()
            for name, value in zip(METRICS, (aux, z, relative.min(), relative.max(), relative.std(dim=1, unbiased=False).mean())):
                sums[name] += n * value.item()
        with torch.no_grad():
            for p in expected.parameters():
                p -= LR * p.grad
                p.grad = None
        expected_logs[step + 1] = {f"train/{name}": value / total for name, value in sums.items()}
        with torch.no_grad():
            val_units = [int((b["labels"] != IGNORE_INDEX).sum()) for b in val_batches]
            val = [_transformers_terms(expected, b) for b in val_batches]
        expected_logs[step + 1]["val/loss"] = sum(v[0].item() for v in val) / sum(val_units)
        expected_logs[step + 1]["val/router/aux_loss"] = sum(n * v[1].item() for n, v in zip(val_units, val)) / sum(val_units)

    for (name, got), (_, want) in zip(trained.named_parameters(), expected.named_parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6, msg=name)
    logged: dict[int, dict[str, float]] = {}
    for row in rows:
        logged.setdefault(int(row["step"]), {}).update({k: float(v) for k, v in row.items() if v and k != "step"})
    for step, values in expected_logs.items():
        for name, value in values.items():
            assert logged[step][name] == pytest.approx(value, rel=1e-5), (step, name)
        assert logged[step]["val/ppl"] == pytest.approx(torch.tensor(values["val/loss"]).exp().item(), rel=1e-5)
        assert {f"val/{name}" for name in METRICS} <= set(logged[step])
    for layer in moe_layers(trained):
        assert layer.router_stats is None  # cleared once read


def test_the_router_terms_change_the_step():
    """Without the router terms (coefficients 0) the step differs: the test above can fail."""
    batch = _batches(1, seed=3)[0]
    grads = []
    for objective in (WithRouterLosses(CausalLM(), AUX, Z), WithRouterLosses(CausalLM(), 0.0, 0.0)):
        model = _model()
        output = objective(model, batch)
        output.trained_sum.backward()
        grads.append(moe_layers(model)[0].router.weight.grad.clone())
        assert output.metrics["router/aux_loss"] > 0
    assert not torch.allclose(grads[0], grads[1])


def test_coefficients_come_from_the_config_unless_the_run_overrides_them():
    config = tiny_moe()
    objective = with_router_losses(None, config, TrainArgs())
    assert isinstance(objective, WithRouterLosses) and isinstance(objective.objective, CausalLM)
    assert (objective.aux_coef, objective.z_coef) == (0.01, 0.001)
    objective = with_router_losses(CausalLM(), config, TrainArgs(router_aux_loss_coef=0.5, router_z_loss_coef=0.0))
    assert (objective.aux_coef, objective.z_coef) == (0.5, 0.0)
    assert objective.reports_perplexity
    assert "no load-balancing loss" not in objective.describe()
    # experts given to a dense preset (--model_overrides) bring no coefficient: the start-up line says so
    unbalanced = with_router_losses(None, tiny_moe(router_aux_loss_coef=0.0), TrainArgs())
    assert "load balancing x 0, " in unbalanced.describe() and "no load-balancing loss" in unbalanced.describe()
    # asked for (--train.router_aux_loss_coef 0, as fine-tuning recipes may): no warning
    chosen = with_router_losses(None, config, TrainArgs(router_aux_loss_coef=0.0))
    assert "load balancing x 0, " in chosen.describe() and "no load-balancing loss" not in chosen.describe()
    dense = with_router_losses(None, Config.from_name("debug"), TrainArgs(router_aux_loss_coef=0.5))
    assert type(dense) is CausalLM  # a dense model trains its objective as it is
    with pytest.raises(UserError, match=r"^--train.router_aux_loss_coef must be 0 or more \(and finite\), got -0.1$"):
        TrainArgs(router_aux_loss_coef=-0.1)
    for value in (math.nan, math.inf):  # a loss of nan or inf from the first step
        with pytest.raises(UserError, match=rf"^--train.router_aux_loss_coef must be 0 or more \(and finite\), got {value}$"):
            TrainArgs(router_aux_loss_coef=value)
    with pytest.raises(UserError, match=r"^--train.router_z_loss_coef must be 0 or more \(and finite\), got -1.0$"):
        TrainArgs(router_z_loss_coef=-1.0)


def test_a_checkpointed_recomputation_keeps_no_router_stats():
    """The recomputation in the backward pass routes again: it must not leave stats (holding the
    router's logits through their graph) on the layers, and the gradients are those without checkpointing."""
    from toolkit.parallel.fsdp import checkpoint_blocks

    batch = _batches(1, seed=4)[0]
    grads = []
    for checkpointed in (False, True):
        model = _model()
        if checkpointed:
            checkpoint_blocks(model, Block)
        WithRouterLosses(CausalLM(), AUX, Z)(model, batch).trained_sum.backward()
        assert all(layer.router_stats is None for layer in moe_layers(model))
        grads.append([p.grad.clone() for p in model.parameters()])
    for plain, recomputed in zip(*grads):
        torch.testing.assert_close(plain, recomputed, rtol=1e-6, atol=1e-7)


def test_a_reference_pass_adds_no_router_terms():
    """DPO on a LoRA model whose reference is its own base (adapters off, the same MoE layers):
    the router terms are the policy's routing alone, with their gradient."""
    from peft import LoraConfig, get_peft_model

    from toolkit.models.adapters import adapters_switched_off
    from toolkit.training.preference_objectives import DPO
    from toolkit.training.reference import AdaptersOff

    def lora_model() -> torch.nn.Module:
        torch.manual_seed(0)
        model = get_peft_model(_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.5)  # adapters that change the routing
            p.requires_grad_("lora_" in name)
        return model

    tokens = torch.randint(0, 64, (4, SEQ + 1), generator=torch.Generator().manual_seed(5))
    labels = tokens[:, 1:].clone()
    labels[:, :3] = IGNORE_INDEX
    batch = {"input_ids": tokens[:, :-1], "labels": labels, "pair_ids": torch.arange(2)}
    dpo = DPO()
    dpo.reference = AdaptersOff()
    model = lora_model()
    output = WithRouterLosses(dpo, AUX, Z)(model, batch)
    assert output.penalty_sum.requires_grad
    assert all(layer.router_stats is None for layer in moe_layers(model))
    _, aux, z, _ = _transformers_terms(lora_model(), batch)  # the policy's forward pass alone
    torch.testing.assert_close(output.metrics["router/aux_loss"], 2 * aux.detach())  # 2 pairs
    torch.testing.assert_close(output.penalty_sum, 2 * (AUX * aux + Z * z))
    with torch.no_grad(), adapters_switched_off(model):
        _, base_aux, _, _ = _transformers_terms(model, batch)
    assert not torch.allclose(base_aux, aux)  # the base routes otherwise: a leak would show


# ------------------------------------------------------------------ `toolkit pretrain`
def _pretrain_args(out_dir: Path, *extra: str) -> list[str]:
    return [
        "pretrain", "debug-llama2", "--out_dir", str(out_dir),
        "--model_overrides", "{n_expert: 4, n_expert_per_token: 2, moe_intermediate_size: 32, router_aux_loss_coef: 0.01}",
        "--data", "TextFiles", "--data.train_path", str(ASSETS / "tinyshakespeare.txt"),
        "--tokenizer_dir", str(ASSETS / "tokenizers" / "llama2"),
        "--train.micro_batch_size", "2", "--train.global_batch_size", "4", "--train.max_seq_length", "32",
        "--train.max_steps", "2", "--train.warmup_steps", "0", "--eval.interval", "2", "--eval.max_iters", "2",
        "--log.interval", "1", "--log.loggers", "[csv]", "--precision", "32-true",
        *extra,
    ]


def test_per_layer_balancing_is_the_mean_of_each_layers_own_loss_and_sees_what_pooling_hides():
    """`router_losses(per_layer=True)`: the mean over layers of transformers' load-balancing loss of
    each layer alone, on any routing. Where the first MoE layer sends every token to experts 0 and 1
    and the second to experts 2 and 3 (of 6, top-2), the pooled loss (transformers') is what two
    layers that each spread the tokens evenly over the same four experts would give (3), while per
    layer it is near its maximum, X = 6."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from toolkit.models.moe import router_losses

    model = _model()
    layers = moe_layers(model)
    config = model.config
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(3))

    def losses(favoured=None):
        captured = []

        def hook(layer_index):
            def replace(module, inputs, logits):
                if favoured is not None:  # every token's logits: 8 and 7.9 for the favoured pair, 0 elsewhere
                    first, second = favoured[layer_index]
                    logits = torch.zeros_like(logits)
                    logits[..., first], logits[..., second] = 8.0, 7.9
                captured.append(logits)
                return logits
            return replace

        hooks = [layer.router.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
        try:
            with torch.no_grad():
                model(ids)
        finally:
            for h in hooks:
                h.remove()
        each = [load_balancing_loss_func((logits,), config.n_expert, config.n_expert_per_token) for logits in captured]
        return router_losses(layers), router_losses(layers, per_layer=True), torch.stack(each).mean()

    pooled, per_layer, expected = losses()
    torch.testing.assert_close(per_layer.aux, expected.float(), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(per_layer.aux, pooled.aux)  # the init routes the two layers differently
    torch.testing.assert_close(per_layer.z, pooled.z)
    torch.testing.assert_close(per_layer.load, pooled.load)

    pooled, per_layer, expected = losses(favoured=[(0, 1), (2, 3)])
    torch.testing.assert_close(per_layer.aux, expected.float(), rtol=1e-6, atol=1e-6)
    assert per_layer.aux > 5.9 and abs(pooled.aux - 3.0) < 0.01, (per_layer.aux, pooled.aux)


def test_pretrain_logs_the_router_metrics_and_takes_the_coefficients_given(tmp_path, capsys):
    """The router terms and the experts' load reach the console, the CSV log and TensorBoard (read
    back with TensorBoard's own event reader: the same values as the CSV, at the same steps)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    assert run(_pretrain_args(out, "--train.router_z_loss_coef", "0.002", "--train.router_aux_loss_per_layer", "true",
                              "--log.loggers", "[csv, tensorboard]")) == 0
    printed = capsys.readouterr().out
    assert "Mixture of experts: router losses: load balancing per layer x 0.01, z-loss x 0.002" in printed
    steps = [line for line in printed.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all(f"| {name} " in line for line in steps for name in METRICS)
    assert any(line.startswith("validation at step 2:") and "router/load_cv" in line for line in printed.splitlines())
    rows = logged_metrics(out)
    names = {k for row in rows for k, v in row.items() if v}
    assert {f"{split}/{m}" for split in ("train", "val") for m in METRICS} <= names
    aux = [float(r["train/router/aux_loss"]) for r in rows if r.get("train/router/aux_loss")]
    assert len(aux) == 2 and all(1.9 < a < 4 for a in aux)  # K = 2 when every layer is balanced; at most X = 4
    (events,) = (out / "logs" / "tensorboard").glob("version_*")
    board = EventAccumulator(str(events))
    board.Reload()
    for name in (f"{split}/{m}" for split in ("train", "val") for m in METRICS):
        csv_values = {int(float(r["step"])): float(r[name]) for r in rows if r.get(name)}
        board_values = {event.step: event.value for event in board.Scalars(name)}
        assert board_values.keys() == csv_values.keys() and csv_values, name
        assert all(board_values[step] == pytest.approx(csv_values[step], rel=1e-6) for step in csv_values), name


def test_pretrain_refuses_a_negative_coefficient_in_one_line(tmp_path, capsys):
    assert run(_pretrain_args(tmp_path / "run", "--train.router_aux_loss_coef", "-0.5")) != 0
    err = capsys.readouterr().err.strip()
    assert err.endswith("--train.router_aux_loss_coef must be 0 or more (and finite), got -0.5") and "\n" not in err
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ two FSDP processes
@pytest.mark.parametrize("checkpointing, experts", [(False, 4), (True, 4), (False, 3)])
def test_two_fsdp_processes_train_a_mixture_of_experts_as_one_does(tmp_path, checkpointing, experts):
    """The same global batch on 1 process (4 accumulation steps) and 2 FSDP processes (2 each):
    the same weights, losses and router metrics (tests/scripts/moe_ranks.py). The experts' weights
    are sharded along the experts, or, 3 experts over 2 processes, along each expert's rows (set up
    from the initialiser's rows, trained and exported so); each rank's router terms join its
    gradient before the reduction."""
    import json
    import subprocess
    import sys

    from safetensors.torch import load_file

    script = Path(__file__).parent / "scripts" / "moe_ranks.py"
    outs = [tmp_path / "devices1", tmp_path / "devices2"]
    load_script(script).run(outs[0], 1, checkpointing, experts)
    result = subprocess.run([sys.executable, str(script), str(outs[1]), "2", json.dumps(checkpointing), str(experts)],
                            capture_output=True, text=True, env=launch_env(), timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert f"expert weights split along dim(s) {[0] if experts == 4 else [1]}" in result.stdout
    a, b = (load_file(str(out / "final" / "model.safetensors")) for out in outs)
    assert a.keys() == b.keys() and any("experts.gate_up_proj" in name for name in a)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=0, msg=name)
    names = [f"{split}/{m}" for split in ("train", "val") for m in ("loss",) + METRICS]
    logs = [{(r["step"], n): float(r[n]) for r in logged_metrics(out) for n in names if r.get(n)} for out in outs]
    assert logs[0].keys() == logs[1].keys() and {n for _, n in logs[0]} == set(names)
    for key, value in logs[0].items():
        assert logs[1][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
