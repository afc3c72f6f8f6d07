"""Preemption: SIGTERM or SIGUSR1 makes a run stop after the current optimizer step, every rank
agreeing, write a checkpoint, end its tracker runs as killed and exit with 128 + the signal's
number; `--resume auto` then continues bit-identically (single-threaded CPU runs). A crash
(SIGKILL to every process) between two periodic saves resumes from the last one as exactly."""

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

from conftest import REPO, kill_group_at_step, launch_env, run_toolkit, tiny_pretrain_args

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


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted two-process run of STEPS steps (CSV only), where every stopped and resumed
    two-process run below must end. The runs beside it share its tokenized-data cache."""
    out = tmp_path_factory.mktemp("preemption") / "reference"
    run_toolkit(_cmd(out, None, "--devices", "2"))
    return out


def _assert_same_weights(reference: Path, out: Path, atol: Optional[float] = None) -> None:
    a, b = load_file(str(reference / "final" / "model.safetensors")), load_file(str(out / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and a
    for name in a:
        if atol is None:
            assert torch.equal(a[name], b[name]), name
        else:
            torch.testing.assert_close(b[name], a[name], atol=atol, rtol=0, msg=name)


def _signal_at_step(cmd: list[str], step: int, signum: int) -> subprocess.CompletedProcess:
    """Run `cmd`, send `signum` to its first process (rank 0, which started the others) once it
    reports `step`, and wait for it to end."""
    process = subprocess.Popen([sys.executable, "-m", "toolkit", *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=launch_env(), start_new_session=True, cwd=REPO)
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if line.startswith(f"step {step}/"):
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


def test_sigterm_on_two_processes_saves_stops_and_resumes_exactly(reference):
    pytest.importorskip("mlflow")
    out, db = reference.parent / "preempted", reference.parent / "preempted.db"
    stopped = _signal_at_step(_cmd(out, db, "--devices", "2"), SIGNAL_AFTER, signal.SIGTERM)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert "SIGTERM received: stopping to save" in stopped.stdout
    # Only rank 0 was signalled; both ranks stopped after the same step and saved it (no periodic
    # save before: --train.save_interval 100).
    (saved,) = _steps_saved(out)
    assert SIGNAL_AFTER <= saved <= SIGNAL_AFTER + 2, saved
    assert f"stopped by SIGTERM: checkpoint {out / 'checkpoints' / f'step-{saved:08d}'}" in stopped.stderr
    assert not (out / "final").exists()
    assert _mlflow_status(db) == "KILLED"

    resumed = run_toolkit(_cmd(out, db, "--devices", "2"))
    assert f"Resumed from {out / 'checkpoints' / f'step-{saved:08d}'}" in resumed
    assert _mlflow_status(db) == "FINISHED"
    _assert_same_weights(reference, out)


def test_two_fsdp_processes_killed_and_resumed_from_a_sharded_checkpoint(reference):
    """The whole process group (launcher and its worker) killed at a random step past the first
    periodic save, as a crashed node would be: the resumed run reads the sharded checkpoint."""
    killed = reference.parent / "killed"
    args = _cmd(killed, None, "--devices", "2", "--distributed.state_dict_type", "sharded", "--train.save_interval", "2")
    k = random.Random(os.getpid()).randint(3, STEPS - 1)
    kill_group_at_step([sys.executable, "-m", "toolkit", *args], k)
    saved = [p for p in (killed / "checkpoints").glob("step-*") if not p.name.endswith(".tmp")]
    assert saved and all((p / "state").is_dir() for p in saved), saved  # sharded
    assert "Resumed from" in run_toolkit(args)
    _assert_same_weights(reference, killed, atol=1e-6)


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
