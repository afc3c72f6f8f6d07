"""DPO through the real entry points (finetune_lora, finetune_full) on synthetic pairs (tests/pair_data.py).

- Two FSDP processes with the reference precomputed equal one process with the live reference
  (the base with the LoRA adapters switched off): weights and every logged metric.
- A run stopped after 2 steps and resumed reuses its stored reference log-probabilities (not computed
  again) and ends where the uninterrupted live run ends.
- Full fine-tuning: the frozen copy of the starting weights and the precomputed reference give the same run.
- DPO learns a rule: at least 90% reward accuracy on held-out pairs.
- Bad combinations are one line.

One-device runs happen in this process (`tests/scripts/preference_run.py`'s `run`); the two-process
run in a subprocess, which Fabric relaunches.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ASSETS, REPO, launch_env, load_script, logged_metrics
from pair_data import SyntheticPairs, rule_pairs

SCRIPT = REPO / "tests" / "scripts" / "preference_run.py"
STEPS = 4
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected")


def _in_process(checkpoint: Path, out_dir: Path, kind: str, precompute: bool, steps: int = STEPS) -> None:
    load_script(SCRIPT).run(checkpoint, out_dir, 1, kind, precompute, steps)


def _two_processes(checkpoint: Path, out_dir: Path, kind: str, precompute: bool) -> str:
    result = subprocess.run([sys.executable, str(SCRIPT), str(checkpoint), str(out_dir), "2", kind, str(int(precompute)), str(STEPS)],
                            capture_output=True, text=True, env=launch_env(), timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _weights(out_dir: Path) -> dict[str, torch.Tensor]:
    final = out_dir / "final"
    return load_file(str(final / ("lora_adapter.safetensors" if (final / "lora_adapter.safetensors").exists() else "model.safetensors")))


def _logs(out_dir: Path) -> dict[tuple[int, str], float]:
    """(step, train/<m> or val/<m>) -> value, the last start's value where a resumed run logged a step again."""
    logs = {}
    for row in logged_metrics(out_dir):
        for split in ("train", "val"):
            for metric in METRICS:
                value = row.get(f"{split}/{metric}")
                if value:
                    logs[(int(float(row["step"])), f"{split}/{metric}")] = float(value)
    return logs


def _assert_same_run(a: Path, b: Path, atol: float = 1e-5) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys() and wa
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=atol, rtol=0, msg=name)
    la, lb = _logs(a), _logs(b)
    assert la.keys() == lb.keys()
    assert {step for step, _ in la} == set(range(STEPS + 1)) and {name for _, name in la} == {f"{s}/{m}" for s in ("train", "val") for m in METRICS}
    for key, value in la.items():
        assert lb[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert la[(STEPS, "train/rewards/margins")] != 0.0  # the policy moved away from the reference


@pytest.fixture(scope="module")
def live_lora(base, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("live_lora") / "run"
    _in_process(base["checkpoint"], out, "lora", precompute=False)
    return out


def test_two_fsdp_processes_with_a_precomputed_reference_equal_one_process_with_the_live_one(base, live_lora, tmp_path):
    stdout = _two_processes(base["checkpoint"], tmp_path / "two", "lora", precompute=True)
    assert "Computed the reference log-probabilities of 24 training pairs and 4 validation pairs" in stdout
    _assert_same_run(live_lora, tmp_path / "two")


def test_a_resumed_run_reuses_its_stored_reference_and_ends_as_the_uninterrupted_run(base, live_lora, tmp_path, capsys):
    out = tmp_path / "resumed"
    _in_process(base["checkpoint"], out, "lora", precompute=True, steps=2)
    assert "Computed the reference log-probabilities" in capsys.readouterr().out
    stored = out / "reference_logps.safetensors"
    written = stored.stat().st_mtime_ns
    _in_process(base["checkpoint"], out, "lora", precompute=True)
    printed = capsys.readouterr().out
    assert "Resumed from" in printed and "Reusing the reference log-probabilities" in printed
    assert "Computed the reference" not in printed and stored.stat().st_mtime_ns == written
    _assert_same_run(live_lora, out)


def test_full_finetuning_with_a_frozen_copy_equals_the_precomputed_reference(base, tmp_path, capsys):
    _in_process(base["checkpoint"], tmp_path / "copy", "full", precompute=False)
    assert "Reference: a frozen copy of the starting weights" in capsys.readouterr().out
    _in_process(base["checkpoint"], tmp_path / "precomputed", "full", precompute=True)
    _assert_same_run(tmp_path / "copy", tmp_path / "precomputed")


def test_dpo_learns_a_rule_and_keeps_it_on_held_out_pairs(base, tmp_path):
    """The chosen response repeats the prompt's last word, the rejected one does not: after 64 steps
    of 8 pairs (512 pairs, seen once) the reward of the chosen response is the larger on at least
    90% of 64 held-out pairs, whose prompts never occur in training."""
    from toolkit.args import EvalArgs, LogArgs, TrainArgs
    from toolkit.finetune.lora import finetune_lora
    from toolkit.models.adapters import LoRAArgs
    from toolkit.training.preference_objectives import DPO

    train = rule_pairs(512, seed=1)
    seen = {tuple(prompt) for prompt, _, _ in train}
    held_out = [pair for pair in rule_pairs(100, seed=2) if tuple(pair[0]) not in seen][:64]
    assert len(held_out) == 64
    steps = 64
    finetune_lora(base["checkpoint"], tmp_path / "run", data=SyntheticPairs(train, held_out), objective=DPO(beta=0.5),
                  lora=LoRAArgs(r=8, alpha=16, dropout=0.0, targets=("query", "value", "projection", "mlp", "head")),
                  train=TrainArgs(micro_batch_size=8, global_batch_size=8, max_seq_length=16, max_steps=steps,
                                  learning_rate=4e-3, warmup_steps=0, weight_decay=0.0, save_interval=None),
                  eval=EvalArgs(interval=steps, max_iters=8, initial_validation=True), log=LogArgs(interval=16, loggers=("csv",)),
                  precision="32-true", seed=1)
    logs = _logs(tmp_path / "run")
    assert logs[(0, "val/rewards/accuracies")] == 0.0  # the policy starts as the reference: every margin 0
    assert logs[(steps, "val/rewards/accuracies")] >= 0.9, logs[(steps, "val/rewards/accuracies")]
    assert logs[(steps, "val/rewards/margins")] > 0.5


def _one_error_line(capsys, argv: list[str]) -> str:
    """The one error line of a refused command (a refusal after the data is read follows its log lines)."""
    from toolkit.cli import run

    assert run(argv) != 0
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("toolkit ")]
    assert len(lines) == 1, lines
    return lines[0]


def test_bad_combinations_are_one_line(base, tmp_path, capsys):
    alpaca = ["--data", "Alpaca", "--data.json_path", str(ASSETS / "instruct" / "alpaca_tiny.json"), "--precision", "32-true",
              "--train.max_steps", "1"]
    start = ["finetune_lora", str(base["checkpoint"]), "--out_dir", str(tmp_path / "a"), *alpaca]
    line = _one_error_line(capsys, start + ["--objective", "simpo", "--objective.precompute_reference", "true"])
    assert "SimPO is reference-free" in line
    assert "beta must be positive" in _one_error_line(capsys, start + ["--objective", "Dpo", "--objective.beta", "0"])
    assert "label_smoothing must be in [0, 0.5)" in _one_error_line(capsys, start + ["--objective=dpo", "--objective.label_smoothing", "0.5"])
    # Instruction data under a preference loss: refused once the loaders exist, leaving nothing behind.
    line = _one_error_line(capsys, ["finetune_full", str(base["checkpoint"]), "--out_dir", str(tmp_path / "b"), *alpaca, "--objective", "orpo"])
    assert "trains on preference pairs" in line and "--data Preference" in line
    assert not (tmp_path / "b").exists()


def test_supervised_fine_tuning_refuses_preference_pairs(base, tmp_path):
    from toolkit.args import TrainArgs
    from toolkit.errors import UserError
    from toolkit.finetune.lora import finetune_lora

    data = SyntheticPairs(rule_pairs(8, seed=1), rule_pairs(2, seed=2))
    with pytest.raises(UserError, match="preference objective"):
        finetune_lora(base["checkpoint"], tmp_path / "sft", data=data, precision="32-true",
                      train=TrainArgs(micro_batch_size=1, global_batch_size=2, max_seq_length=16, max_steps=1))
    assert not (tmp_path / "sft").exists()
