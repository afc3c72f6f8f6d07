"""`toolkit pretrain` under FSDP on CPU processes (gloo, 127.0.0.1), measured against one process.

Every distributed run uses the same global batch as the single-process reference (which reaches it
by gradient accumulation), so after the same number of optimizer steps the weights must agree.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ASSETS, SMALL_VOCAB, run_in_process

STEPS = 3
TOLERANCE = 1e-5
# Adam divides each update by the gradient's own magnitude, so a gradient that is pure rounding
# noise (the key bias: attention is invariant to it) moves by up to the learning rate in either
# run. A modest rate keeps that well inside the tolerance without hiding real differences: a
# missing gradient sync or a wrong loss scale moves weights by ~1e-3.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    env.pop("LOCAL_RANK", None)
    return env


def _pretrain_args(out_dir: Path, cache: Path, *extra: str) -> list[str]:
    return [
        "pretrain", "debug-neox", "--out_dir", str(out_dir),
        "--data", "TextFiles", "--data.train_path", str(ASSETS / "tinyshakespeare.txt"), "--data.cache_dir", str(cache),
        *SMALL_VOCAB,
        "--precision", "32-true", "--train.micro_batch_size", "2", "--train.global_batch_size", "8",
        "--train.max_seq_length", "32", "--train.max_steps", str(STEPS), "--train.warmup_steps", "1",
        "--train.learning_rate", "0.002", "--train.save_interval", str(STEPS),
        "--eval.interval", "1000", "--eval.max_iters", "2", "--log.interval", "1", "--log.loggers", "[csv]",
        *extra,
    ]


def _toolkit(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(_env(), MASTER_PORT=str(_free_port()))
    result = subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True, env=env, timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def _torchrun_nodes(args: list[str], nodes: int, per_node: int, timeout: int = 600) -> list[str]:
    """Simulate `nodes` machines on 127.0.0.1: one torchrun per node, as a cluster launches them."""
    port = _free_port()
    procs = []
    for node_rank in range(nodes):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc_per_node={per_node}",
            f"--node_rank={node_rank}", "--master_addr=127.0.0.1", f"--master_port={port}",
            "-m", "toolkit", *args,
        ]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env()))
    outputs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=timeout)
        outputs.append(out)
        assert proc.returncode == 0, out[-5000:]
    return outputs


def _weights(out_dir: Path) -> dict:
    return load_file(str(out_dir / "final" / "model.safetensors"))


def _assert_close_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=TOLERANCE, rtol=0, msg=name)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dist")


@pytest.fixture(scope="module")
def reference(workdir) -> dict:
    """One process reaching the global batch of 8 with 4 accumulation steps of 2 sequences."""
    out = workdir / "single"
    stdout = run_in_process(_pretrain_args(out, workdir / "cache"))
    assert "gradient accumulation" in stdout.lower() or "accumulation" in stdout.lower()
    return _weights(out)


# The two-process runs (--devices 2 on one node), each made once for the tests below: each checkpoint
# format from one of them. HYBRID_SHARD (the default) on one node is planned as FULL_SHARD over the
# two processes (tests/test_distributed_setup.py::test_plan_strategy_choices), so both formats
# come out of the same engine, and each sharding is still run and compared with one process.
TWO_PROCESS_RUNS = {"FULL_SHARD": "sharded", "HYBRID_SHARD": "full"}  # sharding -> state_dict_type


@pytest.fixture(scope="module")
def two_processes(workdir):
    """sharding -> (out_dir, stdout) of its two-process run, made when first asked for."""
    runs = {}

    def get(sharding: str) -> tuple[Path, str]:
        if sharding not in runs:
            state_dict_type = TWO_PROCESS_RUNS[sharding]
            out = workdir / f"two-{sharding}-{state_dict_type}"
            result = _toolkit(_pretrain_args(out, workdir / "cache", "--devices", "2", "--distributed.sharding", sharding,
                                             "--distributed.state_dict_type", state_dict_type))
            runs[sharding] = out, result.stdout
        return runs[sharding]

    return get


def _saved_state(checkpoint: Path, state_dict_type: str) -> Path:
    """Where a training checkpoint of `state_dict_type` keeps its state: a folder of shards or one file."""
    return checkpoint / ("state" if state_dict_type == "sharded" else "state.pt")


@pytest.mark.parametrize("sharding", list(TWO_PROCESS_RUNS))
def test_two_processes_match_one_process(reference, two_processes, sharding):
    out, stdout = two_processes(sharding)
    assert "accumulation" in stdout
    _assert_close_weights(_weights(out), reference)
    # the mid-run checkpoint, in the format asked for: a folder of shards or one file
    state_dict_type = TWO_PROCESS_RUNS[sharding]
    saved = _saved_state(out / "checkpoints" / f"step-{STEPS:08d}", state_dict_type)
    assert saved.is_dir() if state_dict_type == "sharded" else saved.is_file()


def test_two_nodes_of_two_processes_with_hybrid_shard_match_one_process(workdir, reference):
    out = workdir / "nodes-2x2"
    args = _pretrain_args(out, workdir / "cache", "--num_nodes", "2", "--devices", "2", "--distributed.sharding", "HYBRID_SHARD")
    outputs = _torchrun_nodes(args, nodes=2, per_node=2)
    assert "HYBRID_SHARD" in outputs[0]
    _assert_close_weights(_weights(out), reference)


def test_one_process_per_node_falls_back_to_full_shard_and_stays_in_sync(workdir, reference):
    out = workdir / "nodes-2x1"
    args = _pretrain_args(out, workdir / "cache", "--num_nodes", "2", "--devices", "1", "--distributed.sharding", "HYBRID_SHARD")
    outputs = _torchrun_nodes(args, nodes=2, per_node=1)
    assert "FULL_SHARD" in "".join(outputs)  # the fallback is said in the log
    _assert_close_weights(_weights(out), reference)


def test_activation_checkpointing_gives_the_same_result(workdir, reference):
    out = workdir / "checkpointing"
    run_in_process(_pretrain_args(out, workdir / "cache", "--distributed.activation_checkpointing", "true"))
    _assert_close_weights(_weights(out), reference)


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_checkpoints_of_a_two_process_run_load_into_one_process(two_processes, state_dict_type, tmp_path):
    from toolkit.model_dir import load_model
    from toolkit.convert import convert_pretrained_checkpoint

    (sharding,) = (name for name, kind in TWO_PROCESS_RUNS.items() if kind == state_dict_type)
    out, _ = two_processes(sharding)
    training_checkpoint = out / "checkpoints" / f"step-{STEPS:08d}"
    assert _saved_state(training_checkpoint, state_dict_type).exists()
    inference = tmp_path / "inference"
    convert_pretrained_checkpoint(training_checkpoint, inference)
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(load_model(inference)(tokens), load_model(out / "final")(tokens), atol=1e-6, rtol=0)
