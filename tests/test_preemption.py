"""Preemption: SIGTERM or SIGUSR1 makes a run stop after the current optimizer step, every rank
agreeing, write a checkpoint, end its tracker runs as killed and exit with 128 + the signal's
number; `--resume auto` then continues bit-identically (single-threaded CPU runs). (A crash,
SIGKILL to every process, resuming from the last periodic sharded save is tested in
tests/test_resume_reshard.py and tests/test_qlora_distributed.py.)"""

import os
import re
import signal
import subprocess
import sys
import threading
import time
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


def test_two_processes_stopped_by_sigterm_resume_exactly_from_their_sharded_checkpoint(tmp_path):
    """SIGTERM to rank 0 of two processes (each accumulating two micro-batches a step): both stop
    after the same step, save it (sharded) and exit with 143. Resumed, the run ends with the
    uninterrupted run's weights bit for bit. (Tracker runs ended as killed: the SIGUSR1 test below;
    MLflow's SQLite set-up costs seconds a run.)"""
    reference = tmp_path / "reference"
    run_toolkit(_cmd(reference, None, "--devices", "2"))

    out = tmp_path / "preempted"
    stopped = _signal_at_step(_cmd(out, None, "--devices", "2"), SIGNAL_AFTER, signal.SIGTERM)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert "SIGTERM received: stopping to save" in stopped.stdout
    # Only rank 0 was signalled; both ranks stopped after the same step and saved it (no periodic
    # save before: --train.save_interval 100).
    (saved,) = _steps_saved(out)
    assert SIGNAL_AFTER <= saved <= SIGNAL_AFTER + 2, saved
    checkpoint = out / "checkpoints" / f"step-{saved:08d}"
    assert f"stopped by SIGTERM: checkpoint {checkpoint}" in stopped.stderr
    assert (checkpoint / "state").is_dir()  # sharded
    assert not (out / "final").exists()

    resumed = run_toolkit(_cmd(out, None, "--devices", "2"))
    assert f"Resumed from {checkpoint}" in resumed
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
    # A forked child (a data loader's worker) writes no signals into the parent's watch.
    stop = StopSignals().install()
    try:
        child = os.fork()
        if child == 0:
            os._exit(0 if signal.set_wakeup_fd(-1) == -1 else 1)
        assert os.waitpid(child, 0)[1] == 0
    finally:
        stop.restore()
    # The watch of a stuck main thread ends with it: the wakeup descriptor is given back, its thread ends.
    assert signal.set_wakeup_fd(-1) == -1
    deadline = time.monotonic() + 5
    while any(t.name == "toolkit-stop-watch" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name == "toolkit-stop-watch" for t in threading.enumerate())


def _read_line(stream, seconds: float) -> str:
    """The next line of a child's pipe, or '' if none comes within `seconds`."""
    import select

    ready, _, _ = select.select([stream], [], [], seconds)
    return stream.readline() if ready else ""


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_a_run_stuck_in_a_collective_stops_on_sigterm_and_says_where(tmp_path):
    """Rank 1 of two is frozen (SIGSTOP) mid-run, so rank 0 waits in a collective that would not
    return before --distributed.timeout (an hour). SIGTERM to rank 0: its handler cannot run inside
    that call, but the watch thread stops it (the patience is 2 s here, through tests/scripts/
    stuck_run.py) with exit code 143 and one line naming the call and the toolkit line that made it,
    stops rank 1 too, and writes no checkpoint."""
    out = tmp_path / "stuck"
    command = [sys.executable, str(REPO / "tests" / "scripts" / "stuck_run.py"),
               *_cmd(out, None, "--devices", "2", "--train.max_steps", "100000")]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=dict(launch_env(), STUCK_SECONDS="2"), start_new_session=True, cwd=REPO)
    try:
        for line in process.stdout:
            if line.startswith("step 3/"):
                break
        (rank_1,) = _children(process.pid)
        os.kill(rank_1, signal.SIGSTOP)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("toolkit: error: rank 0: stopped by SIGTERM after ") and " inside one call: " in last, last
    assert re.search(r", called from \w+ \(toolkit/[\w/]+\.py:\d+\)", last), last
    assert "No checkpoint was written by this stop" in last, last
    deadline = time.monotonic() + 10  # SIGKILL to a stopped process takes effect when the kernel gets to it
    while Path(f"/proc/{rank_1}").exists() and Path(f"/proc/{rank_1}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, f"rank 1 (process {rank_1}) is still there"
        time.sleep(0.1)
    assert _steps_saved(out) == [] and not (out / "final").exists()


@pytest.mark.parametrize("signals", [("SIGTERM", "SIGTERM"), ("SIGINT",)], ids=["second-sigterm", "ctrl-c"])
def test_a_second_signal_or_ctrl_c_stops_a_process_stuck_in_a_collective_at_once(signals):
    """Rank 0 of two gloo processes waits in an all-reduce that rank 1 never joins (gloo runs no
    signal handler while it waits), with 600 s of patience: after SIGTERM it says where it is, and a
    second SIGTERM stops it within seconds (exit 143); Ctrl-C alone does (exit 130)."""
    env = dict(launch_env(), PYTHONPATH=str(REPO))
    port = env["MASTER_PORT"]
    script = str(REPO / "tests" / "scripts" / "stuck_collective.py")
    ranks = [subprocess.Popen([sys.executable, script, "collective", str(rank), port, "600", "1"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for rank in (0, 1)]
    try:
        assert ranks[0].stdout.readline().strip() == "waiting"
        # Into the all-reduce: before it, Ctrl-C's KeyboardInterrupt is raised in Python (and on a
        # busy machine a second may not take the main thread from the print to the wait).
        _wait_until_the_main_thread_sleeps(ranks[0].pid)
        ranks[0].send_signal(getattr(signal, signals[0]))
        if len(signals) > 1:
            report = _read_line(ranks[0].stderr, 30)
            assert report.startswith(f"toolkit: rank 0: {signals[0]} came, and the main thread has been inside one call for"), report
            assert "all_reduce (torch/distributed/distributed_c10d.py:" in report, report
            ranks[0].send_signal(getattr(signal, signals[1]))
        out, err = ranks[0].communicate(timeout=30)
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    assert ranks[0].returncode == 128 + getattr(signal, signals[0]), err
    assert "returned" not in out and "Traceback" not in err
    expected = "stopped by SIGTERM after" if signals[0] == "SIGTERM" else "interrupted while inside one call for"
    assert err.strip().splitlines()[-1].startswith(f"toolkit: error: rank 0: {expected}"), err


def _wait_until_the_main_thread_sleeps(pid: int, settled: float = 1.0, timeout: float = 60.0) -> None:
    """Wait until process `pid`'s main thread has been asleep in the kernel (state S: waiting for
    the all-reduce's peer) for `settled` seconds on end."""
    start = asleep_since = time.monotonic()
    while time.monotonic() - start < timeout:
        state = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        now = time.monotonic()
        if state != "S":
            asleep_since = now
        elif now - asleep_since >= settled:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid}'s main thread never settled into a wait")


def test_a_process_that_makes_progress_through_native_calls_is_not_taken_for_stuck():
    """After SIGTERM, with 2 s of patience, the main thread spends 6 s in native calls made from one
    line (its innermost frame and instruction are the same at every look, as while a checkpoint is
    written file after file), returning to Python between them: it is not stopped, and ends with the
    flag raised."""
    script = str(REPO / "tests" / "scripts" / "stuck_collective.py")
    process = subprocess.Popen([sys.executable, script, "busy", "0", "0", "2", "1"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=dict(launch_env(), PYTHONPATH=str(REPO)))
    try:
        assert process.stdout.readline().strip() == "waiting"
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == 0, err
    assert out.strip() == "returned, SIGTERM received" and err == "", (out, err)


def test_before_the_steps_a_stuck_process_waits_and_a_second_signal_stops_it():
    """A rank waits in a collective before any optimizer step (as for rank 0 preparing data: a wait
    as long as that work): SIGTERM, delivered twice at once (torchrun forwards what srun also sends),
    does not stop it even past the patience; it says where it waits, and a signal a second later stops it."""
    env = dict(launch_env(), PYTHONPATH=str(REPO))
    script = str(REPO / "tests" / "scripts" / "stuck_collective.py")
    ranks = [subprocess.Popen([sys.executable, script, "setup", str(rank), env["MASTER_PORT"], "1", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for rank in (0, 1)]
    try:
        assert ranks[0].stdout.readline().strip() == "waiting"
        time.sleep(1)
        ranks[0].send_signal(signal.SIGTERM)
        ranks[0].send_signal(signal.SIGTERM)
        report = _read_line(ranks[0].stderr, 30)
        assert report.startswith("toolkit: rank 0: SIGTERM came, and the main thread has been inside one call for"), report
        assert "or when it is stopped (a second signal stops it now)" in report, report
        time.sleep(2)  # past the patience (1 s): still waiting
        assert ranks[0].poll() is None
        ranks[0].send_signal(signal.SIGTERM)
        _, err = ranks[0].communicate(timeout=30)
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    assert ranks[0].returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1].startswith("toolkit: error: rank 0: stopped by SIGTERM after"), err
