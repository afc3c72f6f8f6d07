"""Exact resume for fine-tuning (full and LoRA, across epochs) and for a 2-process FSDP run.

Single-threaded (OMP_NUM_THREADS=1) so that two identical runs are bit-identical; see test_resume.py.
"""

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ASSETS, kill_group_at_step
from test_resume import _losses, _run

ALPACA = ASSETS / "instruct" / "alpaca_tiny.json"


def _finetune_cmd(command: str, checkpoint: Path, out_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "toolkit", command, str(checkpoint), "--out_dir", str(out_dir),
        "--data", "Alpaca", "--data.json_path", str(ALPACA), "--data.val_split_fraction", "0.1",
        "--precision", "32-true", "--train.micro_batch_size", "4", "--train.global_batch_size", "8",
        "--train.max_seq_length", "96", "--train.save_interval", "3", "--train.warmup_steps", "2",
        "--train.learning_rate", "0.003", "--eval.interval", "1000", "--eval.initial_validation", "false",
        "--eval.final_validation", "false", "--log.interval", "1", "--log.loggers", "[csv]", "--resume", "auto",
        *extra,
    ]


def _final_weights(out_dir: Path) -> dict:
    final = out_dir / "final"
    name = "lora_adapter.safetensors" if (final / "lora_adapter.safetensors").exists() else "model.safetensors"
    return load_file(str(final / name))


def _assert_identical(a: Path, b: Path) -> None:
    wa, wb = _final_weights(a), _final_weights(b)
    assert wa.keys() == wb.keys() and wa
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


@pytest.mark.parametrize("command", ["finetune_full", "finetune_lora"])
def test_finetuning_killed_at_a_random_step_resumes_exactly(base, tmp_path, command):
    steps = 8
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    _run(_finetune_cmd(command, base["checkpoint"], reference, "--train.max_steps", str(steps)))
    k = random.Random(os.getpid()).randint(4, steps - 1)
    kill_group_at_step(_finetune_cmd(command, base["checkpoint"], killed, "--train.max_steps", str(steps)), k)
    result = _run(_finetune_cmd(command, base["checkpoint"], killed, "--train.max_steps", str(steps)))
    assert "Resumed from" in result.stdout
    _assert_identical(reference, killed)
    ref_losses, resumed = _losses(reference), _losses(killed)
    assert all(resumed[s] == ref_losses[s] for s in range(k, steps + 1)), (k, resumed, ref_losses)


def test_resuming_in_the_second_epoch_continues_that_epoch(base, tmp_path):
    # 90 training records in micro-batches of 4: about 11 optimizer steps per epoch, so step 15 is in the second.
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    cmd = lambda out: _finetune_cmd("finetune_lora", base["checkpoint"], out, "--train.epochs", "2")  # noqa: E731
    _run(cmd(reference))
    kill_group_at_step(cmd(killed), 15)
    result = _run(cmd(killed))
    assert "Resumed from" in result.stdout and "epoch 1" in result.stdout
    _assert_identical(reference, killed)
    summaries = [json.loads((out / "summary.json").read_text()) for out in (reference, killed)]
    assert summaries[0]["epoch"] == summaries[1]["epoch"] == 2
    assert summaries[0]["step"] == summaries[1]["step"] > 15
    ref_losses, resumed = _losses(reference), _losses(killed)
    assert all(resumed[s] == ref_losses[s] for s in range(15, summaries[0]["step"] + 1))


def _pretrain_2proc_cmd(out_dir: Path, steps: int) -> list[str]:
    return [
        sys.executable, "-m", "toolkit", "pretrain", "debug-neox", "--out_dir", str(out_dir),
        "--data", "TextFiles", "--data.train_path", str(ASSETS / "tinyshakespeare.txt"),
        "--data.cache_dir", str(out_dir.parent / "cache"),
        "--tokenizer_dir", str(ASSETS / "tokenizers" / "gpt-neox-20b"),
        "--devices", "2", "--distributed.state_dict_type", "sharded",
        "--precision", "32-true", "--train.micro_batch_size", "2", "--train.global_batch_size", "8",
        "--train.max_seq_length", "32", "--train.max_steps", str(steps), "--train.save_interval", "2",
        "--train.warmup_steps", "1", "--train.learning_rate", "0.002",
        "--eval.interval", "1000", "--eval.final_validation", "false", "--log.interval", "1",
        "--log.loggers", "[csv]", "--resume", "auto",
    ]


def test_two_fsdp_processes_killed_and_resumed_from_a_sharded_checkpoint(tmp_path):
    steps = 6
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    _run(_pretrain_2proc_cmd(reference, steps))
    # Kill the whole process group (launcher and its worker) at step k, as a crashed node would be.
    k = random.Random(os.getpid()).randint(3, steps - 1)
    kill_group_at_step(_pretrain_2proc_cmd(killed, steps), k)
    assert (killed / "checkpoints" / "step-00000002" / "state").is_dir()  # sharded
    result = _run(_pretrain_2proc_cmd(killed, steps))
    assert "Resumed from" in result.stdout
    wa, wb = _final_weights(reference), _final_weights(killed)
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=1e-6, rtol=0, msg=name)


def test_lora_killed_in_the_middle_of_saving_its_adapter_checkpoint(base, tmp_path):
    """The adapter-only (filtered) checkpoint is as crash-safe as a full one."""
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    cmd = lambda out, steps: _finetune_cmd("finetune_lora", base["checkpoint"], out, "--train.max_steps", str(steps))  # noqa: E731
    _run(cmd(reference, 6))
    # The step-3 save completes; the process is killed inside the second one, at step 6.
    env = dict(os.environ, OMP_NUM_THREADS="1", TOOLKIT_KILL_AT="save:2")
    crashed = subprocess.run(cmd(killed, 6), capture_output=True, text=True, env=env, timeout=600)
    assert crashed.returncode == -signal.SIGKILL
    assert sorted(p.name for p in (killed / "checkpoints").iterdir() if not p.name.endswith(".tmp")) == ["step-00000003"]
    result = _run(cmd(killed, 6))
    assert "Resumed from" in result.stdout and "step-00000003" in result.stdout
    _assert_identical(reference, killed)
