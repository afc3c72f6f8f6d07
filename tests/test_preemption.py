"""Preemption: SIGTERM or SIGUSR1 makes a run stop after the current optimizer step, every rank
agreeing, write a checkpoint, end its tracker runs as killed and exit with 128 + the signal's
number; `--resume auto` then continues bit-identically (single-threaded CPU runs). A crash
(SIGKILL to every process) between two periodic saves resumes from the last one as exactly: the
two-process test checks both on one run (stopped, resumed, killed, resumed)."""

import importlib.util
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, launch_env, run_toolkit, tiny_pretrain_args

STEPS = 10
SIGNAL_AFTER = 4  # the signal is sent once this step's log line is out


def _cmd(out: Path, db: Optional[Path], *extra: str) -> list[str]:
    """The run; with `db` None it logs to CSV only (a reference for its weights, spared MLflow's
    start-up: creating its SQLite database costs seconds of CPU). A global batch of 8 micro-batches
    of 2: on two processes each accumulates two before the optimizer step."""
    loggers = ["--log.loggers", "[csv]"] if db is None else [
        "--log.loggers", "[csv, mlflow]", "--log.tracking_uri", f"sqlite:///{db}", "--log.project", "preemption"]
    return [
        *tiny_pretrain_args(out, STEPS), "--train.global_batch_size", "8", "--train.save_interval", "100",
        "--train.learning_rate", "0.01", "--log.interval", "1", *loggers, "--resume", "auto", *extra,
    ]


def _assert_same_weights(reference: Path, out: Path) -> None:
    a, b = load_file(str(reference / "final" / "model.safetensors")), load_file(str(out / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _signal_at_step(cmd: list[str], step: int, signum: int, group: bool = False) -> subprocess.CompletedProcess:
    """Run `cmd`, send `signum` to its first process (rank 0, which started the others), or with
    `group` to all its processes, once it reports `step`, and wait for it to end."""
    process = subprocess.Popen([sys.executable, "-m", "toolkit", *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=launch_env(), start_new_session=True, cwd=REPO)
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if line.startswith(f"step {step}/"):
                if group:
                    os.killpg(process.pid, signum)
                else:
                    process.send_signal(signum)
                break
        out, err = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(process.args, process.returncode, "".join(lines) + out, err)


def _steps_saved(out: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*") if not p.name.endswith(".tmp"))


def _mlflow_status(db: Path) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    (run,) = client.search_runs([client.get_experiment_by_name("preemption").experiment_id])
    return run.info.status


def test_two_processes_stopped_by_sigterm_then_killed_resume_exactly_from_sharded_checkpoints(tmp_path):
    """SIGTERM to rank 0 of two processes (each accumulating two micro-batches a step): both stop
    after the same step, save it, end the MLflow run as killed and exit with 143. Resumed with a save
    every 2 steps, the run is then killed outright at a random step past its first save (SIGKILL to
    the launcher and its worker, as a crashed node); resumed again from that sharded checkpoint, it
    ends with the uninterrupted run's weights bit for bit, and the MLflow run finished. Without
    MLflow installed, everything but its run's status is checked."""
    reference = tmp_path / "reference"
    run_toolkit(_cmd(reference, None, "--devices", "2"))

    out = tmp_path / "preempted"
    db = tmp_path / "preempted.db" if importlib.util.find_spec("mlflow") else None
    stopped = _signal_at_step(_cmd(out, db, "--devices", "2"), SIGNAL_AFTER, signal.SIGTERM)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert "SIGTERM received: stopping to save" in stopped.stdout
    # Only rank 0 was signalled; both ranks stopped after the same step and saved it (no periodic
    # save before: --train.save_interval 100).
    (saved,) = _steps_saved(out)
    assert SIGNAL_AFTER <= saved <= SIGNAL_AFTER + 2, saved
    assert f"stopped by SIGTERM: checkpoint {out / 'checkpoints' / f'step-{saved:08d}'}" in stopped.stderr
    assert not (out / "final").exists()
    assert db is None or _mlflow_status(db) == "KILLED"

    resume = _cmd(out, db, "--devices", "2", "--train.save_interval", "2")
    first_save = saved + 2 - saved % 2
    k = random.Random(os.getpid()).randint(first_save + 1, STEPS - 1)
    crashed = _signal_at_step(resume, k, signal.SIGKILL, group=True)
    assert crashed.returncode == -signal.SIGKILL, f"the run ended before step {k}"
    assert f"Resumed from {out / 'checkpoints' / f'step-{saved:08d}'}" in crashed.stdout
    newest = max(_steps_saved(out))
    assert newest >= first_save and (out / "checkpoints" / f"step-{newest:08d}" / "state").is_dir()  # sharded

    resumed = run_toolkit(resume)
    assert f"Resumed from {out / 'checkpoints' / f'step-{newest:08d}'}" in resumed
    assert db is None or _mlflow_status(db) == "FINISHED"
    _assert_same_weights(reference, out)


def test_sigusr1_on_one_process_stops_after_the_step_under_way(tmp_path):
    pytest.importorskip("mlflow")
    out, db = tmp_path / "run", tmp_path / "run.db"
    stopped = _signal_at_step(_cmd(out, db), SIGNAL_AFTER, signal.SIGUSR1)
    assert stopped.returncode == 128 + signal.SIGUSR1, stopped.stderr[-3000:]
    (saved,) = _steps_saved(out)
    assert SIGNAL_AFTER <= saved <= SIGNAL_AFTER + 1, saved
    # one line of the toolkit's own (MLflow logs its database set-up at INFO before it), no traceback
    assert "Traceback" not in stopped.stderr and stopped.stderr.strip().splitlines()[-1].startswith("toolkit pretrain: stopped by SIGUSR1")
    assert _mlflow_status(db) == "KILLED"


def test_outside_the_loop_a_signal_stops_at_once_and_inside_it_only_raises_the_flag():
    from toolkit.errors import Preempted
    from toolkit.training.preemption import StopSignals

    before = signal.getsignal(signal.SIGTERM)
    stop = StopSignals().install()
    try:
        stop.deferring = True
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested() and stop.received == "SIGUSR1"
        stop.deferring = False
        with pytest.raises(Preempted) as error:
            os.kill(os.getpid(), signal.SIGTERM)
        assert error.value.exit_code == 128 + signal.SIGTERM
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) == before
