"""Distributed set-up: batch math, precision/strategy choices, and real multi-process training.

The multi-process tests start real processes (gloo on 127.0.0.1) running tests/scripts/dist_train.py,
launched three ways: Fabric's own launcher, torchrun, and LOCAL_RANK/NODE_RANK set by hand (which
is how two "nodes" are simulated on one machine). Each compares the gathered weights of every rank
with a single process that reaches the same global batch by gradient accumulation.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.errors import UserError
from toolkit.args import DistributedArgs
from toolkit.parallel.batches import plan_batches
from toolkit.parallel.plan import plan_strategy, resolve_precision

SCRIPT = Path(__file__).parent / "scripts" / "dist_train.py"
OFFLOAD_SCRIPT = Path(__file__).parent / "scripts" / "cpu_offload_step.py"
TIMEOUT = 180  # seconds per multi-process run; they take ~10 s


# ------------------------------------------------------------------------------------------
# Batch math
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "devices, nodes, micro, global_batch, seq, accum",
    [
        (1, 1, 4, 4, 128, 1),
        (1, 1, 2, 16, 512, 8),
        (2, 1, 4, 32, 2048, 4),
        (8, 4, 1, 512, 4096, 16),
        (4, 2, 3, 24, 100, 1),
    ],
)
def test_plan_batches_resolves_accumulation(devices, nodes, micro, global_batch, seq, accum):
    plan = plan_batches(devices, nodes, micro, global_batch, seq)
    assert plan.gradient_accumulation_iters == accum
    assert plan.world_size == devices * nodes
    assert plan.tokens_per_step == global_batch * seq
    assert devices * nodes * micro * accum == global_batch
    table = plan.table()
    lines = dict(line.strip().split("  ", 1) for line in table.splitlines()[1:])
    lines = {k.strip(): v.strip() for k, v in lines.items()}
    assert lines["devices per node"] == str(devices)
    assert lines["nodes"] == str(nodes)
    assert lines["micro batch (per device)"] == str(micro)
    assert lines["gradient accumulation steps"] == str(accum)
    assert lines["global batch (sequences)"] == f"{global_batch} = {devices} x {nodes} x {micro} x {accum}"
    assert lines["tokens per optimizer step"] == f"{global_batch * seq:,}"


@pytest.mark.parametrize(
    "devices, nodes, micro, global_batch, suggestion",
    [
        # 2 x 1 x 4 = 8 sequences per accumulation step; 20 = 10 per rank, which micro 2 divides
        (2, 1, 4, 20, "2 x 1 x 4 = 8. Use global_batch_size 16 or 24, or micro_batch_size 2."),
        # 8 x 4 = 32 is more than 16, so nothing below; 2 per rank -> micro 2
        (8, 1, 4, 16, "8 x 1 x 4 = 32. Use global_batch_size 32, or micro_batch_size 2."),
        # 7 sequences cannot be split over 2 ranks: no micro batch size helps
        (2, 1, 1, 7, "2 x 1 x 1 = 2. Use global_batch_size 6 or 8."),
        # 2 x 3 x 5 = 30; 36 = 6 per rank -> micro 3
        (2, 3, 5, 36, "2 x 3 x 5 = 30. Use global_batch_size 30 or 60, or micro_batch_size 3."),
    ],
)
def test_plan_batches_indivisible_suggests_fixes(devices, nodes, micro, global_batch, suggestion):
    with pytest.raises(UserError) as info:
        plan_batches(devices, nodes, micro, global_batch, 256)
    message = str(info.value)
    assert message == (
        f"global_batch_size {global_batch} is not a multiple of devices x nodes x micro_batch_size = {suggestion}"
    )


@pytest.mark.parametrize("field", ["devices", "num_nodes", "micro_batch_size", "global_batch_size", "max_seq_length"])
def test_plan_batches_rejects_non_positive(field):
    args = dict(devices=1, num_nodes=1, micro_batch_size=1, global_batch_size=1, max_seq_length=1)
    args[field] = 0
    with pytest.raises(UserError, match=field):
        plan_batches(**args)


# ------------------------------------------------------------------------------------------
# Precision and strategy choices (no processes)
# ------------------------------------------------------------------------------------------


def test_resolve_precision():
    assert resolve_precision(None, "cpu") == "bf16-mixed"
    assert resolve_precision("32-true", "cpu") == "32-true"
    assert resolve_precision("bf16-true", "cpu") == "bf16-true"
    assert resolve_precision("bf16", "cpu") == "bf16-mixed"
    for half in ("16-mixed", "16-true"):
        with pytest.raises(UserError, match="bf16-mixed or 32-true"):
            resolve_precision(half, "cpu")
    with pytest.raises(UserError, match="choose one of .*bf16-mixed.*Did you mean"):
        resolve_precision("bf16-mixd", "cpu")


@pytest.mark.parametrize("native", [False, True], ids=["T4-or-V100", "Ampere-or-later"])
def test_the_default_on_a_gpu_is_bf16_only_where_the_gpu_computes_in_it(monkeypatch, native):
    """Pre-Ampere GPUs (V100, T4) emulate bfloat16: slow. They train in float16 by default.

    This machine has no GPU, so torch's two device queries answer as the named GPU's would
    (`is_bf16_supported()` counts emulation unless including_emulation=False).
    """
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native or including_emulation)
    assert resolve_precision(None, "cuda") == ("bf16-mixed" if native else "16-mixed")
    assert resolve_precision("16-mixed", "cuda") == "16-mixed"


def test_invalid_names_and_counts_are_user_errors():
    with pytest.raises(UserError, match="FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, NO_SHARD.*Did you mean: FULL_SHARD"):
        plan_strategy(2, 1, None, DistributedArgs(sharding="FULL_SHARDING"), "cpu")  # type: ignore[arg-type]
    with pytest.raises(UserError, match="auto, fsdp, ddp"):
        plan_strategy(2, 1, None, DistributedArgs(strategy="deepspeed"), "cpu")  # type: ignore[arg-type]
    with pytest.raises(UserError, match="full, sharded"):
        plan_strategy(2, 1, None, DistributedArgs(state_dict_type="torch"), "cpu")  # type: ignore[arg-type]
    with pytest.raises(UserError, match="devices must be at least 1"):
        plan_strategy(0, 1, None, DistributedArgs(), "cpu")
    with pytest.raises(UserError, match="devices must be a positive number"):
        plan_strategy("two", 1, None, DistributedArgs(), "cpu")
    with pytest.raises(UserError, match="num_nodes must be at least 1"):
        plan_strategy(1, 0, None, DistributedArgs(), "cpu")
    for timeout in (0, -5):  # gloo and NCCL would fail every collective at once, blaming a peer
        with pytest.raises(UserError, match=f"--distributed.timeout must be a whole number of seconds, at least 1, got {timeout}"):
            plan_strategy(2, 1, None, DistributedArgs(timeout=timeout), "cpu")


def test_plan_strategy_choices():
    single = plan_strategy(1, 1, None, DistributedArgs(strategy="fsdp", cpu_offload=True), "cpu")
    assert (single.kind, single.precision, single.process_group_backend) == ("single", "bf16-mixed", None)
    assert single.mesh is None

    one_node = plan_strategy("2", 1, "32-true", DistributedArgs(), "cpu")  # default HYBRID_SHARD
    assert (one_node.kind, one_node.sharding, one_node.mesh) == ("fsdp", "FULL_SHARD", ((2,), ("shard",)))
    assert one_node.process_group_backend == "gloo"

    hybrid = plan_strategy(4, 2, None, DistributedArgs(sharding="HYBRID_SHARD"), "cpu")
    assert (hybrid.sharding, hybrid.mesh, hybrid.world_size) == ("HYBRID_SHARD", ((2, 4), ("replicate", "shard")), 8)

    one_per_node = plan_strategy(1, 4, None, DistributedArgs(sharding="HYBRID_SHARD"), "cpu")
    assert (one_per_node.sharding, one_per_node.mesh) == ("FULL_SHARD", ((4,), ("shard",)))
    assert any(level == logging.WARNING and "FULL_SHARD" in text for level, text in one_per_node.notes)

    for sharding in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        assert plan_strategy(2, 2, None, DistributedArgs(sharding=sharding), "cpu").sharding == sharding

    ddp = plan_strategy(2, 1, None, DistributedArgs(strategy="ddp"), "cpu")
    assert (ddp.kind, ddp.sharding, ddp.process_group_backend) == ("ddp", None, "gloo")

    offload = plan_strategy(2, 1, None, DistributedArgs(cpu_offload=True), "cpu")
    assert offload.cpu_offload is False and any("cpu_offload" in text for _, text in offload.notes)


def test_cpu_offload_on_gpus_uses_a_process_group_with_a_cpu_backend():
    """Offloaded gradients are clipped on the CPU: a plain "nccl" group has no backend for them and
    crashed at the first optimizer step; the group must map cpu to gloo (cuda stays on nccl)."""
    offload = plan_strategy(2, 1, "32-true", DistributedArgs(cpu_offload=True), "cuda")
    assert offload.cpu_offload and offload.process_group_backend == "cuda:nccl,cpu:gloo"
    plain = plan_strategy(2, 1, "32-true", DistributedArgs(), "cuda")
    assert plain.process_group_backend == "nccl"
    # torch parses the string into one backend per device type, the CPU's included.
    from torch.distributed.distributed_c10d import BackendConfig

    assert BackendConfig(offload.process_group_backend).get_device_backend_map() == {"cuda": "nccl", "cpu": "gloo"}
    assert "cpu" not in BackendConfig(plain.process_group_backend).get_device_backend_map()


def test_offloaded_shards_are_allocated_on_the_host_and_buffers_on_the_device():
    """FSDP2 refuses offloaded shards that live on the GPU ("FSDP parameters should be materialized
    on CPU", seen at the first forward pass of `finetune_lora --distributed.cpu_offload true` on an
    H100): `setup_model` allocates them where the plan says, and moves the buffers (RoPE tables) back
    to the training device. A CPU has one device, so the meta device stands in for the GPU here."""
    import torch
    from torch import nn

    from toolkit.training.model_setup import _move_buffers

    offload = plan_strategy(2, 1, "bf16-mixed", DistributedArgs(cpu_offload=True), "cuda")
    plain = plan_strategy(2, 1, "bf16-mixed", DistributedArgs(), "cuda")
    assert offload.shard_device("cuda:0") == "cpu" and plain.shard_device("cuda:0") == "cuda:0"

    shared = torch.arange(4.0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0].register_buffer("cos", shared, persistent=False)
    model[1].register_buffer("cos", shared, persistent=False)
    _move_buffers(model, torch.device("meta"))
    assert model[0].cos.is_meta and model[0].cos is model[1].cos  # still one tensor, not one per module
    assert model[0].weight.device.type == "cpu"  # parameters stay where they were allocated


def test_cpu_offload_clips_and_steps_on_the_toolkits_process_group(tmp_path):
    """An offloaded GPU run emulated on 2 CPU processes (tests/scripts/cpu_offload_step.py says how):
    the process group built from the offload plan carries the clipping of the offloaded (CPU)
    gradients, and two clipped AdamW steps give the weights of the same run without offload. The
    group offloading had before (plain "nccl": no CPU backend) fails at that clipping, as it did
    on GPUs, after FSDP's own collectives (on the stand-in for the device's backend) worked."""
    import torch
    from safetensors.torch import load_file

    ports = ",".join(str(_free_port()) for _ in range(3))
    _run_by_hand(tmp_path, num_nodes=1, devices=2, args=["--ports", ports], script=OFFLOAD_SCRIPT)
    for rank in range(2):
        runs = json.loads((tmp_path / f"result_rank{rank}.json").read_text())
        reference, offload, old_group = runs["reference"], runs["offload"], runs["old_group"]
        assert offload["failed_at"] is None, f"{offload['backend']}: {offload['failed_at']}: {offload['error']}"
        assert (offload["backend"], offload["cpu_offload"], offload["offloaded"]) == ("cuda:gloo,cpu:gloo", True, True)
        # Clipping really scaled the gradients (the norms are above the script's MAX_NORM = 0.5).
        assert offload["grad_norms"] == reference["grad_norms"] and min(offload["grad_norms"]) > 0.5
        expected = load_file(str(tmp_path / f"weights_reference_rank{rank}.safetensors"))
        actual = load_file(str(tmp_path / f"weights_offload_rank{rank}.safetensors"))
        assert actual.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(actual[name], tensor), name
        # The emulation reproduces the crash: forward and backward pass, the clipping does not.
        assert (old_group["backend"], old_group["offloaded"]) == ("cuda:gloo", True)
        assert old_group["failed_at"] == "clipping and optimizer step"
        assert old_group["error"] == "No backend type associated with device type cpu"


def test_build_fabric_configures_fsdp_strategy(monkeypatch):
    from lightning_fabric.plugins import MixedPrecision
    from lightning_fabric.strategies import ModelParallelStrategy

    from toolkit.parallel.plan import mesh_layout
    from toolkit.training.fabric import build_fabric, is_fsdp

    def build(devices, nodes, precision, dist, block):
        return build_fabric(plan_strategy(devices, nodes, precision, dist, "cpu"), block_cls=block)

    block = _script().TinyBlock
    dist = DistributedArgs(sharding="SHARD_GRAD_OP", activation_checkpointing=True, state_dict_type="full", timeout=42)
    fabric = build(2, 1, None, dist, block)  # not launched
    strategy = fabric.strategy
    assert is_fsdp(fabric) and isinstance(strategy, ModelParallelStrategy)  # FSDP2 through Fabric
    assert strategy.sharding == "SHARD_GRAD_OP" and strategy.plan.activation_checkpointing
    assert strategy.state_dict_type == "full"
    assert strategy._process_group_backend == "gloo"
    assert strategy._timeout.total_seconds() == 42
    assert isinstance(strategy.precision, MixedPrecision) and strategy.precision.precision == "bf16-mixed"
    assert strategy.precision.device == "cpu"  # CPU autocast, not CUDA's
    assert fabric.world_size == 2

    # Two nodes need a launcher's environment (the pre-flight check refuses without one).
    for name, value in (("NODE_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    hybrid = build(2, 2, "32-true", DistributedArgs(sharding="HYBRID_SHARD"), block)
    assert hybrid.strategy.sharding == "HYBRID_SHARD"
    assert mesh_layout("HYBRID_SHARD", 2, 2) == ((2, 2), ("replicate", "shard"))
    assert mesh_layout("FULL_SHARD", 2, 2) == ((4,), ("shard",))
    assert mesh_layout("NO_SHARD", 1, 4) == ((4, 1), ("replicate", "shard"))

    from lightning_fabric.strategies import DDPStrategy, SingleDeviceStrategy

    ddp = build(2, 1, "32-true", DistributedArgs(strategy="ddp"), block)
    assert isinstance(ddp.strategy, DDPStrategy) and ddp.strategy._process_group_backend == "gloo"
    single = build(1, 1, "32-true", DistributedArgs(), block)
    assert isinstance(single.strategy, SingleDeviceStrategy)


def test_single_device_activation_checkpointing_gives_same_losses():
    plain_weights, plain_losses, _ = _reference(micro=2, global_batch=4, steps=2)
    ckpt_weights, ckpt_losses, checkpointed = _reference(micro=2, global_batch=4, steps=2, checkpointing=True)
    assert checkpointed == 3  # each TinyBlock
    assert ckpt_losses == pytest.approx(plain_losses, abs=1e-6)
    _assert_weights_close(ckpt_weights, plain_weights)


# ------------------------------------------------------------------------------------------
# Real multi-process training
# ------------------------------------------------------------------------------------------


# The set-ups started by Fabric's own launcher (the command re-runs itself for rank 1), trained in
# turn by one launch of two processes (tests/scripts/dist_train.py --run): each test below checks
# its own run's folder.
LAUNCHER_RUNS = {
    "FULL_SHARD": "--sharding FULL_SHARD --check-saves",
    "SHARD_GRAD_OP": "--sharding SHARD_GRAD_OP",
    "NO_SHARD": "--sharding NO_SHARD",
    "ddp": "--strategy ddp",
}


@pytest.fixture(scope="module")
def launcher_runs(tmp_path_factory) -> dict[str, Path]:
    """name in LAUNCHER_RUNS -> the folder its two ranks wrote to."""
    out = tmp_path_factory.mktemp("launcher_runs")
    _run([sys.executable, str(SCRIPT), "--out", str(out), "--devices", "2",
          *(f"--run={options}" for options in LAUNCHER_RUNS.values())])  # fmt: skip
    return {name: out / f"run{i}" for i, name in enumerate(LAUNCHER_RUNS)}


def test_fsdp_full_shard_matches_single_process_and_saves(launcher_runs):
    """Fabric's own launcher; full and sharded saves."""
    results = _check_against_reference(launcher_runs["FULL_SHARD"], world_size=2, micro=2, global_batch=8)
    for result in results:
        assert (result["sharding"], result["mesh"], result["fsdp_units"]) == ("FULL_SHARD", [2], 6)  # 3 blocks, input, output, root
        # Accumulation keeps only each rank's shard of the gradients (no full gradient per rank).
        assert result["sharded_grads_while_accumulating"] is True
        saves = result["saves"]
        assert saves["is_file_full"] and saves["is_dir_sharded"]
        for kind in ("full", "sharded"):
            assert saves[kind] == {"same_weights": True, "step": 3, "same_next_step": True}, kind


@pytest.mark.parametrize("sharding, mesh", [("SHARD_GRAD_OP", [2]), ("NO_SHARD", [2, 1])])
def test_other_shardings_match_single_process(launcher_runs, sharding, mesh):
    for result in _check_against_reference(launcher_runs[sharding], world_size=2, micro=2, global_batch=8):
        assert (result["sharding"], result["mesh"]) == (sharding, mesh)


def test_fsdp_hybrid_on_one_node_with_activation_checkpointing(tmp_path):
    """torchrun; HYBRID_SHARD on one node runs as FULL_SHARD; checkpointing leaves losses unchanged."""
    port = _free_port()
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
          "--master_port", str(port), str(SCRIPT), "--out", str(tmp_path), "--devices", "2",
          "--sharding", "HYBRID_SHARD", "--activation-checkpointing"])  # fmt: skip
    results = _check_against_reference(tmp_path, world_size=2, micro=2, global_batch=8)
    for result in results:
        assert result["sharding"] == "FULL_SHARD"
        assert result["checkpointed_blocks"] == 3


def test_hybrid_with_one_device_per_node_falls_back_to_full_shard(tmp_path):
    """Two simulated nodes with one process each (NODE_RANK/LOCAL_RANK set by hand)."""
    logs = _run_by_hand(tmp_path, num_nodes=2, devices=1, args=["--sharding", "HYBRID_SHARD"])
    results = _check_against_reference(tmp_path, world_size=2, micro=2, global_batch=8)
    for result in results:
        assert (result["sharding"], result["mesh"]) == ("FULL_SHARD", [2])
    warnings = [line for line in logs[0].splitlines() if "using FULL_SHARD across all nodes" in line]
    assert len(warnings) == 1  # one line, from rank 0 only
    assert "using FULL_SHARD" not in logs[1]


def test_hybrid_on_two_nodes_shards_within_and_replicates_across(tmp_path):
    """Two simulated nodes x two processes: a (2, 2) mesh, and all four ranks end up identical."""
    _run_by_hand(tmp_path, num_nodes=2, devices=2, args=["--sharding", "HYBRID_SHARD", "--micro-batch", "1"])
    results = _check_against_reference(tmp_path, world_size=4, micro=1, global_batch=8)
    for result in results:
        assert (result["sharding"], result["mesh"]) == ("HYBRID_SHARD", [2, 2])
        assert result["sharded_grads_while_accumulating"] is True  # all-reduce across nodes deferred, shards kept


def test_ddp_matches_single_process(launcher_runs):
    results = _check_against_reference(launcher_runs["ddp"], world_size=2, micro=2, global_batch=8)
    assert all(result["strategy"] == "DDPStrategy" for result in results)


# ------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _script():
    """tests/scripts/dist_train.py as a module (for the tiny model and the reference run)."""
    spec = importlib.util.spec_from_file_location("dist_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def _reference(micro: int, global_batch: int, steps: int = 3, checkpointing: bool = False):
    """One process, one device, float32: (weights, losses, number of checkpointed blocks)."""
    from toolkit.training.checkpoint_io import full_state_dict
    from toolkit.training.fabric import build_fabric

    script = _script()
    dist = DistributedArgs(activation_checkpointing=checkpointing)
    fabric = build_fabric(plan_strategy(1, 1, "32-true", dist, "cpu"), block_cls=script.TinyBlock)
    plan = plan_batches(1, 1, micro, global_batch, script.SEQ)
    model, _, losses = script.train(fabric, plan, steps)
    return full_state_dict(fabric, model), losses, script.describe(fabric, model)["checkpointed_blocks"]


def _check_against_reference(out: Path, world_size: int, micro: int, global_batch: int) -> list[dict]:
    """Every rank's gathered weights equal the single-process run; so do the per-micro-batch losses."""
    from safetensors.torch import load_file

    ref_weights, ref_losses, _ = _reference(micro, global_batch)
    results, losses = [], {}
    for rank in range(world_size):
        _assert_weights_close(load_file(str(out / f"weights_rank{rank}.safetensors")), ref_weights)
        result = json.loads((out / f"result_rank{rank}.json").read_text())
        assert result["world_size"] == world_size
        losses.update(result["losses"])
        results.append(result)
    assert losses.keys() == ref_losses.keys()
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    return results


def _assert_weights_close(actual: dict, expected: dict) -> None:
    import torch

    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert actual[name].dtype == torch.float32
        torch.testing.assert_close(actual[name], tensor, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


def _clean_env() -> dict[str, str]:
    """This environment without any launcher/cluster variables that would confuse Fabric."""
    launcher_vars = {"LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                     "LOCAL_WORLD_SIZE", "PL_GLOBAL_SEED"}  # fmt: skip
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in launcher_vars and not k.startswith(("SLURM_", "TORCHELASTIC_", "LSB_", "OMPI_", "PMI_"))
    }
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONWARNINGS"] = "ignore"  # torch's FSDP deprecation chatter; failures still show tracebacks
    return env


def _run(command: list[str]) -> None:
    """Run a launcher command; on timeout kill its whole process group (it started the ranks)."""
    proc = subprocess.Popen(
        command, env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{stdout[-3000:]}\n{stderr[-5000:]}"


def _run_by_hand(out: Path, num_nodes: int, devices: int, args: list[str], script: Path = SCRIPT) -> list[str]:
    """Start every rank of `script` ourselves, as a cluster scheduler would; returns each rank's output."""
    env = _clean_env() | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    procs = []
    for node in range(num_nodes):
        for local in range(devices):
            log = open(out / f"log_node{node}_local{local}.txt", "w+")
            command = [sys.executable, str(script), "--out", str(out), "--devices", str(devices),
                       "--num-nodes", str(num_nodes), *args]  # fmt: skip
            rank_env = env | {"NODE_RANK": str(node), "LOCAL_RANK": str(local)}
            procs.append((subprocess.Popen(command, env=rank_env, stdout=log, stderr=subprocess.STDOUT), log))
    outputs = []
    try:
        for proc, log in procs:
            proc.wait(timeout=TIMEOUT)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.seek(0)
            outputs.append(log.read())
            log.close()
    for (proc, _), output in zip(procs, outputs):
        assert proc.returncode == 0, f"exit code {proc.returncode}\n{output[-5000:]}"
    return outputs


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_one_process_checkpoint_save_streams_to_the_file(tmp_path, checkpointing):
    """A one-device save must not hold a second, serialized copy of the state in memory (Lightning's
    default CheckpointIO buffers the whole file before writing it). Measured: peak RSS growth."""
    import torch

    from toolkit.training.model_setup import host_memory_growth, start_host_memory_window
    from toolkit.training.fabric import build_fabric

    script = _script()
    dist = DistributedArgs(activation_checkpointing=checkpointing)
    fabric = build_fabric(plan_strategy(1, 1, "32-true", dist, "cpu"), block_cls=script.TinyBlock)
    state = {"weights": torch.randn(32, 1 << 20)}  # 128 MiB
    size = state["weights"].numel() * 4
    start = start_host_memory_window()
    fabric.save(tmp_path / "state.pt", state)
    growth = host_memory_growth(start)
    assert growth < 0.25 * size, f"saving {size / 2**20:.0f} MiB grew the peak RSS by {growth / 2**20:.0f} MiB"
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    assert torch.equal(loaded["weights"], state["weights"])


_BUFFER_SETUP = r"""
import dataclasses, json, sys
import torch
from torch import nn
from toolkit.args import DistributedArgs
from toolkit.training.model_setup import setup_model
from toolkit.parallel.plan import plan_strategy
from toolkit.training.fabric import build_fabric, is_fsdp

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((64, 1024), 7.0, device="cpu"))  # a real buffer
        if sys.argv[1] == "meta":
            self.register_buffer("table", torch.zeros(8))  # built under torch.device("meta") below

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))

# FSDP (ShardedStrategy) on one gloo process: a two-device plan run on one.
plan = dataclasses.replace(plan_strategy(2, 1, "32-true", DistributedArgs(), "cpu"), devices=1)
fabric = build_fabric(plan, block_cls=Block)
fabric.launch()
assert is_fsdp(fabric)
with torch.device("meta"):
    model = Model()
def read_rows(name, start, stop, out=None):
    return out.fill_(1.0)
try:
    model = setup_model(fabric, model, read_rows)
    scales = [b.scale for b in model.module.blocks] if hasattr(model, "module") else [b.scale for b in model.blocks]
    print(json.dumps({"scale_is_seven": all(bool((s == 7.0).all()) for s in scales)}))
except RuntimeError as error:
    print(json.dumps({"error": str(error)}))
"""


_RUN_CASES = r"""
import contextlib, io, json, sys
import torch
for name, argument in json.loads(sys.argv[1]):
    sys.argv = ["-c", argument]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(CASES[name], {"__name__": "__main__"})
    print(json.dumps({"case": [name, argument], "outcome": json.loads(printed.getvalue().strip().splitlines()[-1])}))
torch.distributed.destroy_process_group()
"""


@pytest.fixture(scope="module")
def one_process_fsdp() -> dict[tuple[str, str], dict]:
    """The one-process FSDP set-ups below (a two-device plan run on one gloo process), run in turn in
    one subprocess, so that torch and Lightning are imported once: (case, argument) -> what it printed.
    Each case builds its own Fabric object and model; the first launch makes the process group and the
    later ones reuse it."""
    cases = [("buffers", "real"), ("buffers", "meta"), ("edges", "untied"), ("edges", "tied")]
    code = f"CASES = {dict(buffers=_BUFFER_SETUP, edges=_EDGE_UNITS)!r}\n" + _RUN_CASES
    result = subprocess.run([sys.executable, "-c", code, json.dumps(cases)],
                            env=_clean_env() | {"PYTHONPATH": str(Path(__file__).parents[1])},
                            capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    outcomes = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"case"')]
    assert [tuple(o["case"]) for o in outcomes] == cases, result.stdout[-2000:]
    return {tuple(o["case"]): o["outcome"] for o in outcomes}


@pytest.mark.parametrize("kind", ["real", "meta"])
def test_fsdp_setup_keeps_real_buffers_and_refuses_meta_buffers(one_process_fsdp, kind):
    """`to_empty` gives every buffer uninitialised memory: set-up must refill it or say why it cannot."""
    outcome = one_process_fsdp["buffers", kind]
    if kind == "real":
        assert outcome == {"scale_is_seven": True}
    else:
        assert "blocks.0.table" in outcome["error"] and "meta device" in outcome["error"]


def test_ranks_draw_their_own_dropout_masks_from_equal_initial_weights(tmp_path):
    """Two ranks set up by Session: same initial weights (base and LoRA adapters), different LoRA
    dropout masks on the same input (one seed for all ranks repeated every mask on every rank)."""
    env = _clean_env() | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    result = subprocess.run([sys.executable, str(SCRIPT.parent / "rank_seeds.py"), str(tmp_path / "run"), str(tmp_path)],
                            env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)}
    assert reports[0]["lora_params"] > 0
    assert reports[0]["digest"] == reports[1]["digest"]  # every weight, adapters included
    masks = [reports[rank]["mask"] for rank in (0, 1)]
    assert len(masks[0]) > 100 and 0.3 < sum(masks[0]) / len(masks[0]) < 0.7  # dropout 0.5 really drew
    differing = sum(a != b for a, b in zip(*masks)) / len(masks[0])
    assert differing > 0.3, f"only {differing:.0%} of the mask differs between ranks"


_EDGE_UNITS = r"""
import dataclasses, json, sys
import torch
from toolkit.models.config import Config
from toolkit.models.gpt import GPT, Block
from toolkit.args import DistributedArgs
from toolkit.training.model_setup import setup_model
from toolkit.parallel.precision import apply_precision_policy
from toolkit.parallel.plan import plan_strategy
from toolkit.training.fabric import build_fabric

tied = sys.argv[1] == "tied"
config = Config(name="edges", vocab_size=96, block_size=16, n_layer=2, n_embd=32, n_head=4, tie_embeddings=tied)
# FSDP (ShardedStrategy) on one gloo process: a two-device plan run on one.
plan = dataclasses.replace(plan_strategy(2, 1, "bf16-mixed", DistributedArgs(), "cpu"), devices=1)
fabric = build_fabric(plan, block_cls=Block)
fabric.launch()
with torch.device("meta"):
    model = GPT(config)
apply_precision_policy(model, plan.precision)
model = setup_model(fabric, model, lambda name, start, stop, out=None: out.normal_(0, 0.02))
from torch.distributed.fsdp import FSDPModule
gpt = model.module
def state(m):
    return m._get_fsdp_state() if isinstance(m, FSDPModule) else None
gathered = {}
embed_out = {}
gpt.embed.register_forward_hook(lambda m, a, out: embed_out.update(dtype=str(out.dtype)))
def record(name, m):
    m.register_forward_pre_hook(lambda mod, args: gathered.update({name: str(mod.weight.dtype)}))
record("embed", gpt.embed); record("lm_head", gpt.lm_head)
ids = torch.randint(0, 96, (2, 8))
with fabric.autocast():
    loss = model(ids, labels=ids)
fabric.backward(loss)
root = state(gpt)
print(json.dumps({
    "embed_unit": state(gpt.embed) is not None and state(gpt.embed) is not root,
    # each edge module is a unit of its own (final norm and head separately), none of them the root
    "head_unit": len({id(state(m)) for m in (gpt.embed, gpt.norm_f, gpt.lm_head, gpt)} - {id(None)}) == 4,
    "still_tied": gpt.lm_head.weight is gpt.embed.weight,
    "gathered": gathered, "embed_output": embed_out["dtype"],
    "grads": sorted({str(p.grad.dtype) for p in gpt.parameters()}),
    "loss_finite": bool(torch.isfinite(loss)),
}))
"""


@pytest.mark.parametrize("tied", [False, True])
def test_embedding_and_head_are_their_own_units_gathered_in_the_compute_dtype(one_process_fsdp, tied):
    """The root unit no longer holds embedding + norm + head in float32 from forward to the end of
    backward: the embedding, the final norm and the head are separate FSDP units gathered in bf16 under
    bf16-mixed; the embedding's output stays float32 (the residual stream of one device). A tied
    embedding and head keep one matrix, in the root, gathered once in bf16."""
    outcome = one_process_fsdp["edges", "tied" if tied else "untied"]
    assert outcome["loss_finite"] and outcome["grads"] == ["torch.float32"]  # float32 master gradients
    assert outcome["gathered"] == {"embed": "torch.bfloat16", "lm_head": "torch.bfloat16"}
    assert outcome["embed_output"] == "torch.float32"
    if tied:
        assert outcome["still_tied"] and not outcome["embed_unit"] and not outcome["head_unit"]
    else:
        assert outcome["embed_unit"] and outcome["head_unit"] and not outcome["still_tied"]


# ------------------------------------------------------------------ the run plan
def test_the_run_plan_resolves_devices_and_precision_once(monkeypatch):
    """plan_run decides everything a run needs (strategy, QLoRA scheme, batches) resolving devices and
    precision exactly once: no later step resolves them again and gets another answer."""
    from toolkit.args import TrainArgs
    from toolkit.parallel import plan as planning

    calls = {"devices": 0, "precision": 0}
    resolve_devices, resolve_precision = planning.resolve_devices, planning.resolve_precision

    def count_devices(*args, **kwargs):
        calls["devices"] += 1
        return resolve_devices(*args, **kwargs)

    def count_precision(*args, **kwargs):
        calls["precision"] += 1
        return resolve_precision(*args, **kwargs)

    monkeypatch.setattr(planning, "resolve_devices", count_devices)
    monkeypatch.setattr(planning, "resolve_precision", count_precision)
    train = TrainArgs(global_batch_size=16, micro_batch_size=2)
    plan = planning.plan_run("2", 2, None, DistributedArgs(), train, 128, quantize="nf4", accelerator="cpu")
    assert calls == {"devices": 1, "precision": 1}
    assert plan.precision == "bf16-mixed" and plan.world_size == 4
    assert plan.strategy.kind == "fsdp" and plan.strategy.sharding == "HYBRID_SHARD" and plan.shard_size == 2
    assert plan.quantized.scheme == "sharded"
    assert plan.batches.gradient_accumulation_iters == 2 and plan.batches.tokens_per_step == 16 * 128


@pytest.mark.parametrize(
    "quantize, devices, nodes, kind, scheme, shard_size",
    [(None, 1, 1, "single", None, 1), ("bnb.nf4", 2, 1, "ddp", "replicated", 1), ("nf4", 2, 1, "fsdp", "sharded", 2),
     (None, 4, 1, "fsdp", None, 4), (None, 1, 3, "fsdp", None, 3)],
)
def test_the_run_plan_picks_the_strategy_a_quantized_base_allows(quantize, devices, nodes, kind, scheme, shard_size):
    from toolkit.args import TrainArgs
    from toolkit.parallel.plan import plan_run

    train = TrainArgs(global_batch_size=12, micro_batch_size=1)
    plan = plan_run(devices, nodes, "32-true", DistributedArgs(), train, 64, quantize=quantize, accelerator="cpu")
    assert plan.strategy.kind == kind and plan.shard_size == shard_size
    assert (plan.quantized.scheme if plan.quantized else None) == scheme
    assert plan.quantize == quantize
    lines = plan.describe()
    assert ("QLoRA scheme" in lines) == (quantize is not None) and "Batch plan" in lines


def test_an_nf4_base_is_not_planned_on_no_shard():
    from toolkit.args import TrainArgs
    from toolkit.parallel.plan import plan_run

    train = TrainArgs(global_batch_size=4, micro_batch_size=1)
    with pytest.raises(UserError, match="NO_SHARD shards nothing"):
        plan_run(2, 1, "32-true", DistributedArgs(sharding="NO_SHARD"), train, 64, quantize="nf4", accelerator="cpu")
    assert plan_run(1, 1, "32-true", DistributedArgs(sharding="NO_SHARD"), train, 64, quantize="nf4",
                    accelerator="cpu").quantized.scheme == "single"


def test_the_run_plan_refuses_a_batch_that_does_not_split():
    from toolkit.args import TrainArgs
    from toolkit.parallel.plan import plan_run

    with pytest.raises(UserError, match="global_batch_size 10 is not a multiple"):
        plan_run(4, 1, "32-true", DistributedArgs(), TrainArgs(global_batch_size=10, micro_batch_size=1), 64, accelerator="cpu")
