"""Crash-safe, exact resume: a run killed with SIGKILL and resumed ends where an uninterrupted run ends.

All runs are single-threaded (OMP_NUM_THREADS=1): with 2 threads, two identical fresh CPU runs
already differ by about 5e-5 after 40 steps (threaded reductions), with 1 they are bit-identical.
"""

import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import kill_group_at_step, logged_metrics, run_in_process, tiny_pretrain_args

from toolkit.cli import run

STEPS = 8


def _pretrain_args(out_dir: Path, steps: int = STEPS, *extra: str) -> list[str]:
    return [
        *tiny_pretrain_args(out_dir, steps), "--train.learning_rate", "0.01",
        "--train.keep_last", "3", "--log.interval", "1", "--log.loggers", "[csv]", "--resume", "auto", *extra,
    ]


def _pretrain_cmd(out_dir: Path, steps: int = STEPS, *extra: str) -> list[str]:
    return [sys.executable, "-m", "toolkit", *_pretrain_args(out_dir, steps, *extra)]


def _env(**extra: str) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", **extra)


def _run(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, env=_env(**env), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _losses(out_dir: Path) -> dict[int, float]:
    """step -> train loss, the last start's value winning where a resumed run repeated a step."""
    return {int(float(row["step"])): float(row["train/loss"]) for row in logged_metrics(out_dir) if row.get("train/loss")}


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(str(a / "final" / "model.safetensors")), load_file(str(b / "final" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted run of STEPS steps (in this process: the runs compared with it are processes)."""
    out = tmp_path_factory.mktemp("resume") / "reference"
    run_in_process(_pretrain_args(out))
    return out


def test_killed_in_a_save_then_at_a_random_step_resumes_to_the_uninterrupted_end(reference):
    """One run killed twice. Inside its second save (step 4): the first one (step 2) stays, the
    second is only a .tmp leftover. Resumed from step 2, it is killed again at a random step past that
    checkpoint (SIGKILL to its process group) and resumed once more: it ends with the weights, and
    logs the losses from that step on, of the uninterrupted run, and no .tmp is left."""
    out = reference.parent / "killed"
    killed = subprocess.run(_pretrain_cmd(out), capture_output=True, text=True, env=_env(TOOLKIT_KILL_AT="save:2"), timeout=600)
    assert killed.returncode == -signal.SIGKILL
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert "step-00000002" in checkpoints and "step-00000004" not in checkpoints  # only a .tmp leftover

    k = random.Random(os.getpid()).randint(3, STEPS - 1)  # a random step past the first checkpoint
    output = kill_group_at_step(_pretrain_cmd(out), k)
    assert "Resumed from" in output and "step-00000002" in output
    result = _run(_pretrain_cmd(out))
    assert "Resumed from" in result.stdout
    _assert_same_weights(reference, out)
    ref_losses, resumed = _losses(reference), _losses(out)
    assert all(resumed[s] == ref_losses[s] for s in range(k, STEPS + 1)), (k, resumed, ref_losses)
    assert not any(p.name.endswith(".tmp") for p in (out / "checkpoints").iterdir())


def test_a_corrupted_newest_checkpoint_falls_back_to_the_previous_one(reference):
    out = reference.parent / "corrupted"
    shutil.copytree(reference, out)  # a finished run with checkpoints at steps 4, 6 and 8
    newest = out / "checkpoints" / "step-00000008" / "state.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated
    result = _run(_pretrain_cmd(out))
    assert "step-00000008 is not usable: state.pt is truncated" in result.stdout
    assert "Resumed from" in result.stdout and "step-00000006" in result.stdout
    _assert_same_weights(reference, out)


def test_auto_refuses_when_no_checkpoint_is_usable_and_changes_nothing(reference, capsys):
    """Every checkpoint damaged: starting fresh would write new checkpoints over them, so --resume
    auto refuses in one line naming each one's problem, and the folder is left byte for byte."""
    out = reference.parent / "all-damaged"
    shutil.copytree(reference, out)
    for meta in (out / "checkpoints").glob("step-*/meta.json"):
        meta.write_text('{"step": 8, "trunc')
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert run(_pretrain_args(out)) == 1  # (in this process: the refusal comes before any step)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("toolkit pretrain: error: --resume auto: none of the 3 checkpoint(s) in "), line
    assert "step-00000008: meta.json" in line and "nothing was changed" in line, line
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_convert_pretrained_checkpoint_checks_the_files_against_meta_json(reference, tmp_path):
    """Bytes flipped inside state.pt leave a file torch reads without complaint (weights of 1e38):
    the conversion checks every file's sha256 as a resume does, and writes nothing; a .tmp folder
    (an unfinished save) is refused too."""
    from toolkit.convert import convert_pretrained_checkpoint
    from toolkit.errors import UserError

    damaged = tmp_path / "step-00000008"
    shutil.copytree(reference / "checkpoints" / "step-00000008", damaged)
    with open(damaged / "state.pt", "r+b") as f:
        f.seek(f.seek(0, 2) // 2)
        f.write(b"\x7f" * 64)
    with pytest.raises(UserError, match=r"step-00000008 is not usable: state.pt is corrupted \(checksum mismatch\)"):
        convert_pretrained_checkpoint(damaged, tmp_path / "out")
    unfinished = damaged.rename(tmp_path / "step-00000008.tmp")
    with pytest.raises(UserError, match=r"a save that did not finish"):
        convert_pretrained_checkpoint(unfinished, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    converted = convert_pretrained_checkpoint(reference / "checkpoints" / "step-00000008", tmp_path / "out")
    assert (converted / "model.safetensors").is_file() and (converted / "tokenizer.json").is_file()


def test_resuming_with_a_different_global_batch_is_refused(reference):
    out = reference.parent / "changed"
    shutil.copytree(reference, out)
    cmd = _pretrain_cmd(out)
    cmd[cmd.index("--train.global_batch_size") + 1] = "8"
    result = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert result.returncode != 0
    assert "Cannot resume" in result.stderr and "global_batch_size: checkpoint has 4, this run 8" in result.stderr
    assert "Traceback" not in result.stderr


def test_resuming_with_another_seed_is_refused(reference, capsys):
    """The seed orders the data: the saved position (samples yielded) in another shuffle would repeat
    some samples of the epoch and skip others."""
    args = _pretrain_args(reference.parent / "reseeded", STEPS, "--resume", str(reference / "checkpoints" / "step-00000004"),
                          "--seed", "7")
    assert run(args) == 1  # (in this process: the refusal comes before any step)
    err = capsys.readouterr().err
    assert "Cannot resume" in err and "seed: checkpoint has 42, this run 7" in err, err[-2000:]
    assert not (reference.parent / "reseeded").exists()


def test_resume_given_a_run_folder_or_nothing_says_what_it_takes(reference, capsys):
    """Two mistakes a user makes, each answered with what to give instead (in this process: the
    refusal comes before any work)."""

    for value, expected in (
        (str(reference), f"it is a run's --out_dir, not one of its checkpoints; give one (its newest is "
                         f"{reference / 'checkpoints' / 'step-00000008'}), or --out_dir {reference} --resume auto"),
        ("", "--resume takes auto, true, false or a checkpoint folder (<out_dir>/checkpoints/step-N), got ''."),
    ):
        out = reference.parent / "elsewhere"
        assert run(_pretrain_args(out, STEPS, "--resume", value)) == 1
        assert expected in capsys.readouterr().err
        assert not out.exists()


def test_a_run_resumed_with_a_limit_it_has_passed_is_refused_and_changes_nothing(reference, capsys):
    """The 8-step run started again with --train.max_steps 4 or fewer tokens than it has seen: one
    line, nothing saved over (a finished run at exactly its limit is the next test)."""
    before = {p: p.stat().st_mtime_ns for p in reference.rglob("*") if p.is_file()}
    tokens = (reference / "summary.json").read_text()
    for option, value, says in (("--train.max_steps", "4", "is at step 8, past --train.max_steps 4"),
                                ("--train.max_tokens", "300", "has seen 1,024 tokens, past --train.max_tokens 300")):
        args = _pretrain_args(reference, STEPS, option, value)
        assert run(args) == 1
        err = capsys.readouterr().err
        assert f"step-00000008 {says}" in err and "raise it to train on, or pass another --out_dir" in err, err[-2000:]
    assert {p: p.stat().st_mtime_ns for p in reference.rglob("*") if p.is_file()} == before
    assert (reference / "summary.json").read_text() == tokens


def test_resume_true_without_a_checkpoint_is_an_error(tmp_path):
    cmd = _pretrain_cmd(tmp_path / "empty")
    cmd[cmd.index("--resume") + 1] = "true"
    result = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert result.returncode != 0 and "empty/checkpoints holds no checkpoint; use --resume auto" in result.stderr
    assert not (tmp_path / "empty").exists()


def test_a_finished_run_started_again_keeps_pruning_its_history(reference):
    """A finished run started once more saves its last step again: that save keeps the step's place
    in the history, so a longer run afterwards still prunes down to keep_last (3)."""
    out = reference.parent / "again"
    shutil.copytree(reference, out)
    run_in_process(_pretrain_args(out))  # the same 8 steps: starts and stops at once, saving step 8 again
    run_in_process(_pretrain_args(out, 12))
    assert {p.name for p in (out / "checkpoints").iterdir()} == {"step-00000008", "step-00000010", "step-00000012"}


def test_resuming_an_older_checkpoint_prunes_by_history_and_auto_follows_the_new_branch(reference):
    """Resumed from step 4 while steps 6 and 8 exist, with keep_last 1: the checkpoint it resumed from
    and the one it just wrote survive, the abandoned step 8 is left alone, and --resume auto then
    continues the new branch (its step 6), not the abandoned step 8 with the higher number. Resumed
    from that step 8 again, pruning leaves the new branch alone too."""
    out = reference.parent / "branch"
    shutil.copytree(reference, out)
    root = out / "checkpoints"
    assert {p.name for p in root.iterdir()} >= {"step-00000004", "step-00000006", "step-00000008"}
    older = root / "step-00000004"
    result = _run(_pretrain_cmd(out, 6, "--resume", str(older), "--train.keep_last", "1"))
    assert f"Resumed from {older}" in result.stdout
    assert "step-00000006, step-00000008" in result.stdout and "came later than step-00000004" in result.stdout
    names = {p.name for p in root.iterdir()}
    assert {"step-00000004", "step-00000006", "step-00000008"} <= names, names  # nothing it needs was pruned

    resumed = _run(_pretrain_cmd(out, 7, "--train.keep_last", "1"))  # --resume auto
    assert f"Resumed from {root / 'step-00000006'}" in resumed.stdout, resumed.stdout[-2000:]
    assert "Stopped: reached 7 steps" in resumed.stdout
    names = {p.name for p in root.iterdir()}
    # keep_last 1 along this history: step 7 (just written) and step 6 (resumed from) stay, the
    # new branch's older step 4 goes; the abandoned step 8 is never touched.
    assert names == {"step-00000006", "step-00000007", "step-00000008"}, names

    # Back to the abandoned step 8, whose parent was the step 6 that the new branch has since saved
    # again: pruning follows step 8's own history only, so the other branch's step 6 and 7 stay.
    abandoned = root / "step-00000008"
    assert f"Resumed from {abandoned}" in run_in_process(_pretrain_args(out, 10, "--resume", str(abandoned), "--train.keep_last", "1"))
    names = {p.name for p in root.iterdir()}
    assert names == {"step-00000006", "step-00000007", "step-00000008", "step-00000010"}, names
