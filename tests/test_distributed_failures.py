"""A distributed run that goes wrong stops every process with one line, instead of hanging.

Real processes on CPU (gloo, 127.0.0.1), started the way a user starts them: `toolkit ... --devices N`
(Fabric's launcher starts the other ranks). "Within N seconds" is enforced by the subprocess
timeout, never by asserting a duration.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ASSETS, SMALL_VOCAB, kill_group, run_as_group

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def _pretrain(out_dir: Path, train_path: Path, devices: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "toolkit", "pretrain", "debug-neox", "--out_dir", str(out_dir),
        "--data", "TextFiles", "--data.train_path", str(train_path), "--data.cache_dir", str(out_dir.parent / "cache"),
        *SMALL_VOCAB, "--devices", str(devices),
        "--precision", "32-true", "--train.micro_batch_size", "1", "--train.global_batch_size", str(devices),
        "--train.max_seq_length", "16", "--log.interval", "1", "--log.loggers", "[csv]", "--eval.interval", "100000",
        *extra,
    ]


@pytest.mark.parametrize("devices", [2, 4])
def test_bad_data_on_rank_zero_stops_every_rank_with_one_line(tmp_path, devices):
    """Rank 0 prepares the data alone; a broken JSONL line must reach every rank, not strand them.

    Each rank also reports how many process groups are alive once the command has returned (through
    tests/scripts/run_and_count_process_groups.py): none, as after a run that succeeds. One left to
    the interpreter's finalization can end the process in SIGABRT after its work
    (`toolkit.training.failures.release_process_group`)."""
    data = tmp_path / "corpus.jsonl"
    data.write_text('{"text": "a good line"}\n{"text": broken\n')
    out_dir = tmp_path / "out"
    env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), PYTHONPATH=str(REPO))
    script = REPO / "tests" / "scripts" / "run_and_count_process_groups.py"
    command = [sys.executable, str(script), *_pretrain(out_dir, data, devices, "--train.max_steps", "2")[3:]]
    result = run_as_group(command, env=env, timeout=30 + 15 * devices)  # start-up of N processes on 2 busy cores
    line = f"toolkit pretrain: error: {data}:2 is not valid JSON (Expecting value: column 10); each line must be one JSON object"
    assert result.returncode != 0
    assert result.stderr.count(line) == devices, result.stderr[-3000:]  # every rank, the same line
    assert "Traceback" not in result.stderr + result.stdout
    assert not out_dir.exists()  # the run's folder, created at start, is removed again
    reports = sorted(r for r in result.stdout.splitlines() if r.startswith("rank "))
    assert [r.split(":")[0] for r in reports] == [f"rank {i}" for i in range(devices)], result.stdout[-2000:]
    assert all(": 0 process groups," in r for r in reports), reports


@pytest.mark.parametrize("victim", ["rank 1", "rank 0"])
def test_killed_rank_stops_the_others_with_a_message(tmp_path, victim):
    """SIGKILL (what the out-of-memory killer sends) on one rank mid-run: the other names it and exits."""
    timeout = 20
    cmd = _pretrain(tmp_path / "out", ASSETS / "tinyshakespeare.txt", 2, "--train.max_steps", "100000",
                    "--distributed.timeout", str(timeout))
    env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        for line in proc.stdout:  # wait until training runs
            if line.startswith("step 1"):
                break
        (child,) = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        dead = int(child) if victim == "rank 1" else proc.pid
        os.kill(dead, signal.SIGKILL)
        # Output ends when every process that holds the pipes (rank 0 and rank 1) has exited.
        _, stderr = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc.pid)  # the launcher and whichever rank is left
    assert proc.returncode != 0
    if victim == "rank 1":
        assert f"toolkit pretrain: error: rank 1 (process {dead}) was killed by SIGKILL" in stderr, stderr[-3000:]
    else:
        assert f"toolkit pretrain: error: rank 0 (process {dead}, which started this node's other ranks) is gone" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr


def test_two_nodes_without_a_launcher_fail_before_any_work(tmp_path):
    out_dir = tmp_path / "out"
    cmd = _pretrain(out_dir, ASSETS / "tinyshakespeare.txt", 1, "--num_nodes", "2", "--train.global_batch_size", "2")
    result = run_as_group(cmd, env=_env(), timeout=60)
    assert result.returncode != 0
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("toolkit pretrain: error: --num_nodes 2 needs a launcher"), line
    for needed in ("NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "torchrun --nnodes 2 --nproc-per-node 1", "srun --nodes 2"):
        assert needed in line
    assert not out_dir.exists()


def test_torchrun_with_another_process_count_than_devices_is_refused_by_every_process(tmp_path):
    """torchrun starts 2 processes for a --devices 1 command: each would train alone into the same
    --out_dir. The processes refuse in one line, before any work, suggesting the settings that match."""
    out_dir = tmp_path / "out"
    cmd = _pretrain(out_dir, ASSETS / "tinyshakespeare.txt", 1)
    cmd[:3] = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "toolkit"]
    result = run_as_group(cmd, env=_env(), timeout=120)
    assert result.returncode != 0
    expected = ("toolkit pretrain: error: torchrun started 2 process(es), but this run asks for --devices 1 x --num_nodes 1 = 1: "
                "give the command what was launched (--devices 2 --num_nodes 1), or change torchrun's --nnodes and --nproc-per-node.")
    # Each process that got that far says it (torchrun stops the other one when the first fails), then
    # torchrun prints its own summary of the failure, a ChildFailedError traceback of its code.
    ours = [line for line in result.stderr.splitlines() if line.startswith("toolkit pretrain")]
    assert ours and set(ours) == {expected} and f"{REPO / 'toolkit'}/" not in result.stderr, result.stderr[-3000:]
    assert not out_dir.exists()


def test_rendezvous_that_never_completes_names_address_and_port(tmp_path):
    """Node 0 started, node 1 never: the wait ends at the timeout with the address it waited on."""
    port = _free_port()
    cmd = _pretrain(tmp_path / "out", ASSETS / "tinyshakespeare.txt", 1, "--num_nodes", "2", "--train.global_batch_size", "2",
                    "--distributed.timeout", "3")
    env = _env(NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result = run_as_group(cmd, env=env, timeout=90)
    assert result.returncode != 0
    assert f"toolkit pretrain: error: the processes did not all meet at 127.0.0.1:{port}" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def two_rank_loops() -> subprocess.CompletedProcess:
    """tests/scripts/uneven_data.py and count_syncs.py, run in turn by one launch of two processes
    (tests/scripts/two_rank_loops.py): the two tests below read its output."""
    env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    result = run_as_group([sys.executable, str(REPO / "tests" / "scripts" / "two_rank_loops.py")], env=env, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def test_ranks_agree_on_the_end_of_data(two_rank_loops):
    """Rank 1's data ends a step before rank 0's: both stop after the same step, neither hangs."""
    result = two_rank_loops
    assert "rank 0 stopped at step 2" in result.stdout and "rank 1 stopped at step 2" in result.stdout
    assert "end of data after 1 epoch(s) on 1 of 2 ranks" in result.stdout


def test_a_step_costs_one_all_reduce_and_one_host_sync(two_rank_loops):
    """Two ranks, 3 steps, padded batches (real tokens counted by the loop) and --train.max_time set:
    the token count, the end-of-data flag and the time flag travel in one all-reduce per step (plus
    the one that finds the data ended), with no barrier and no pickled broadcast of a tensor."""
    result = two_rank_loops
    # Each rank's report wherever it starts: another rank's output, written in pieces, can come
    # before it on the same line of the shared pipe.
    decoder = json.JSONDecoder()
    reports = [decoder.raw_decode(result.stdout, m.start())[0] for m in re.finditer(r'\{"rank": ', result.stdout)]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    for report in reports:
        assert report["steps"] == 3
        assert report["tokens_seen"] == report["expected_tokens"]  # padding excluded, both ranks summed
        assert report["calls"] == {"all_reduce": 4, "host_sync": 4}, report["calls"]
