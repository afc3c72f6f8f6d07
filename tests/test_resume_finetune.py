"""Exact resume for fine-tuning (full and LoRA, across epochs). A 2-process FSDP run killed and
resumed from its sharded checkpoint: tests/test_preemption.py, beside the same run stopped by SIGTERM.

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

from conftest import ASSETS, kill_group_at_step, run_in_process, scale_weights_in_place
from test_resume import _losses, _run

ALPACA = ASSETS / "instruct" / "alpaca_tiny.json"


def _finetune_cmd(command: str, checkpoint: Path, out_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "toolkit", *_finetune_args(command, checkpoint, out_dir, *extra)]


def _finetune_args(command: str, checkpoint: Path, out_dir: Path, *extra: str) -> list[str]:
    return [
        command, str(checkpoint), "--out_dir", str(out_dir),
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


STEPS = 8


@pytest.fixture(scope="module")
def uninterrupted(base, tmp_path_factory):
    """Uninterrupted runs of STEPS steps, each made once when first asked for (in this process; the
    killed and resumed runs are processes): command -> out_dir."""
    root, runs = tmp_path_factory.mktemp("uninterrupted"), {}

    def get(command: str) -> Path:
        if command not in runs:
            run_in_process(_finetune_args(command, base["checkpoint"], root / command, "--train.max_steps", str(STEPS)))
            runs[command] = root / command
        return runs[command]

    return get


@pytest.mark.parametrize("command, killed_in_a_save_first", [
    pytest.param("finetune_full", False, id="finetune_full"),
    pytest.param("finetune_lora", True, id="finetune_lora-killed_in_a_save_first"),
])
def test_finetuning_killed_at_a_random_step_resumes_exactly(base, uninterrupted, tmp_path, command, killed_in_a_save_first):
    """Killed at a random step past a checkpoint and resumed: the uninterrupted run's weights and
    losses. LoRA's run is first killed inside its second save (step 6) and resumed from the first
    (step 3): the adapter-only checkpoint is as crash-safe as a full one."""
    steps = STEPS
    reference, killed = uninterrupted(command), tmp_path / "killed"
    cmd = _finetune_cmd(command, base["checkpoint"], killed, "--train.max_steps", str(steps))
    if killed_in_a_save_first:
        env = dict(os.environ, OMP_NUM_THREADS="1", TOOLKIT_KILL_AT="save:2")
        crashed = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert crashed.returncode == -signal.SIGKILL
        assert sorted(p.name for p in (killed / "checkpoints").iterdir() if not p.name.endswith(".tmp")) == ["step-00000003"]
    k = random.Random(os.getpid()).randint(4, steps - 1)
    output = kill_group_at_step(cmd, k)
    if killed_in_a_save_first:
        assert "Resumed from" in output and "step-00000003" in output
    result = _run(cmd)
    assert "Resumed from" in result.stdout
    _assert_identical(reference, killed)
    ref_losses, resumed = _losses(reference), _losses(killed)
    assert all(resumed[s] == ref_losses[s] for s in range(k, steps + 1)), (k, resumed, ref_losses)
    _assert_checkpoint_holds_what_trains(reference / "checkpoints" / "step-00000006", base["checkpoint"], command)


# Bytes per trainable float32 parameter in a training checkpoint: the weight and AdamW's two moments.
BYTES_PER_TRAINED = 4 + 8
# Everything else in the model + optimizer state: pickled names, optimizer groups and steps.
STATE_OVERHEAD = 16 << 10


def _assert_checkpoint_holds_what_trains(checkpoint: Path, base_checkpoint: Path, command: str) -> None:
    """Size arithmetic on a real save: LoRA's state is its adapters and their AdamW moments, nothing of
    the base; full fine-tuning's is every weight and its moments, as before."""
    from toolkit.model_dir import checkpoint_fingerprint
    from toolkit.models.config import Config
    from toolkit.models.gpt import GPT

    meta = json.loads((checkpoint / "meta.json").read_text())
    state_bytes = (checkpoint / "state.pt").stat().st_size
    with torch.device("meta"):
        model_parameters = sum(p.numel() for p in GPT(Config.from_file(base_checkpoint)).parameters())
    if command == "finetune_full":
        assert "frozen_base" not in meta
        assert state_bytes >= BYTES_PER_TRAINED * model_parameters
        return
    adapters = sum(t.numel() for t in _final_weights(checkpoint.parent.parent).values())
    assert adapters and all(t.dtype == torch.float32 for t in _final_weights(checkpoint.parent.parent).values())
    assert BYTES_PER_TRAINED * adapters <= state_bytes <= BYTES_PER_TRAINED * adapters + STATE_OVERHEAD, (state_bytes, adapters)
    assert state_bytes < 4 * model_parameters / 50  # the float32 base alone would be 50 times more
    saved = torch.load(checkpoint / "state.pt", weights_only=True, mmap=True)
    assert saved["model"] and all("lora_" in name for name in saved["model"])
    assert meta["frozen_base"] == {"checkpoint": str(base_checkpoint.resolve()), "fingerprint": checkpoint_fingerprint(base_checkpoint)}
    # The rest of the folder does not grow with the model: per-rank RNG and data position, meta.json,
    # and the config and tokenizer files copied from the base.
    copied = sum(p.stat().st_size for p in base_checkpoint.iterdir() if p.is_file() and (checkpoint / p.name).exists())
    rest = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file()) - state_bytes - copied
    assert rest < 32 << 10, rest
    # Not a model on its own: converting it is refused in one line that says where the base is.
    from toolkit.convert import convert_pretrained_checkpoint
    from toolkit.errors import UserError

    with pytest.raises(UserError, match="LoRA training checkpoint.*not the base weights"):
        convert_pretrained_checkpoint(checkpoint, checkpoint.parent / "converted")
    assert not (checkpoint.parent / "converted").exists()


def test_seventy_billion_lora_checkpoint_by_size_arithmetic():
    """What the LoRA checkpoint of a Llama-3.1-70B-shaped model holds, from the model itself (meta
    device, peft's own adapters) and the bytes measured on real saves: 12 per trainable parameter
    (above), and at most 1 KiB per stored tensor in one file (tests/test_qlora_distributed.py)."""
    from peft import get_peft_model

    from toolkit.models.adapters import LoRAArgs
    from toolkit.models.config import Config
    from toolkit.models.gpt import GPT

    config = Config.from_name("llama-3.1-70b")
    with torch.device("meta"):
        model = get_peft_model(GPT(config), LoRAArgs(r=8, targets=("query", "value")).peft_config())
    trainable = [p for p in model.parameters() if p.requires_grad]
    adapters = sum(p.numel() for p in trainable)
    base = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    # Per block: q_proj 8 x 8192 + 8192 x 8, v_proj 8 x 8192 + 1024 x 8 (8 key-value heads of 128).
    assert adapters == 80 * (8 * 8192 + 8192 * 8 + 8 * 8192 + 1024 * 8) == 16_384_000 and len(trainable) == 320
    payload = BYTES_PER_TRAINED * adapters
    most = payload + STATE_OVERHEAD + 1024 * 3 * len(trainable)  # a weight and two moments per tensor
    assert 196_600_000 < payload < most < 197_700_000  # about 197 MB per save
    assert 140e9 < 2 * base < 142e9  # the bfloat16 base, which a save does not hold: about 141 GB


def test_the_base_fingerprint_tells_same_shaped_weights_apart(base, tmp_path):
    """A copy has the base's fingerprint; the same architecture with other weights (an instruction-tuned
    sibling: every header byte and the size equal) has another."""
    import shutil

    from toolkit.model_dir import checkpoint_fingerprint

    copy, sibling = tmp_path / "copy", tmp_path / "sibling"
    shutil.copytree(base["checkpoint"], copy)
    shutil.copytree(base["checkpoint"], sibling)
    scale_weights_in_place(sibling / "model.safetensors", 1.001)
    original = (base["checkpoint"] / "model.safetensors").read_bytes()
    changed = (sibling / "model.safetensors").read_bytes()
    header = 8 + int.from_bytes(original[:8], "little")
    assert len(changed) == len(original) and changed[:header] == original[:header] and changed != original
    assert checkpoint_fingerprint(copy) == checkpoint_fingerprint(base["checkpoint"])
    assert checkpoint_fingerprint(sibling) != checkpoint_fingerprint(base["checkpoint"])


def test_resuming_in_the_second_epoch_continues_that_epoch(base, tmp_path):
    # 90 training records in micro-batches of 4: about 11 optimizer steps per epoch, so step 15 is in the second.
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    args = ("finetune_lora", base["checkpoint"])
    run_in_process(_finetune_args(*args, reference, "--train.epochs", "2"))  # uninterrupted, in this process
    cmd = lambda out: _finetune_cmd(*args, out, "--train.epochs", "2")  # noqa: E731
    kill_group_at_step(cmd(killed), 15)
    result = _run(cmd(killed))
    assert "Resumed from" in result.stdout and "epoch 1" in result.stdout
    _assert_identical(reference, killed)
    summaries = [json.loads((out / "summary.json").read_text()) for out in (reference, killed)]
    assert summaries[0]["epoch"] == summaries[1]["epoch"] == 2
    assert summaries[0]["step"] == summaries[1]["step"] > 15
    ref_losses, resumed = _losses(reference), _losses(killed)
    assert all(resumed[s] == ref_losses[s] for s in range(15, summaries[0]["step"] + 1))
