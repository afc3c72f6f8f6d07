"""benchmarks/gpu_check.py --dry: every GPU check's code runs on the CPU (tiny sizes, gloo for NCCL), so
that the script a GPU session runs has not rotted. One run of the whole script, in a subprocess as the
GPU session starts it, with every check in one process (--one_process: one interpreter start-up instead
of ten); about 40 s on 2 CPU cores. The test of time limits runs checks each in a process of its own."""

import json
import subprocess
import sys

import pytest

from conftest import REPO, launch_env

SCRIPT = REPO / "benchmarks" / "gpu_check.py"

# Figures each check must report (beside others), so that the GPU run's JSON has what it is read for.
EXPECTED = {
    "fused_loss": {"rows", "bfloat16", "float32"},
    "attention_kernels": {"shape", "dense", "chunked", "tolerance"},
    "attention_sinks": {"shape", "cases"},
    "moe_experts": {"shape", "grouped", "loop", "grouped_vs_loop", "agrees", "speedup"},
    "moe_step_litgpt": {"litgpt_installed", "mixtral"},
    "fp16_mixed": {"precision", "losses", "finite", "falls", "scaler"},
    "nccl_paths": {"backend", "export_identical", "rng_round_trip", "rng_from_more_gpus"},
    "cpu_offload_nf4": {"one_rank_group", "nf4_two_ranks", "nf4_one_rank"},
    "memory": {"pretrain", "lora", "pretrain_checkpointing"},
    "throughput_eager": {"real_tokens_per_sec", "mfu", "seconds_per_step", "compiled"},
    "throughput_compiled": {"real_tokens_per_sec", "mfu", "seconds_per_step", "compiled", "compiled_blocks"},
}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("gpu_check")
    out = work / "gpu_check.json"
    result = subprocess.run([sys.executable, str(SCRIPT), "--dry", "--one_process", "--out", str(out),
                             "--work_dir", str(work / "work")],
                            capture_output=True, text=True, env=launch_env(), cwd=REPO, timeout=600)
    return result, json.loads(out.read_text())


def test_dry_run_passes_every_check(dry_run):
    result, report = dry_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert report["device"] == "cpu" and report["dry"] is True
    assert list(report["checks"]) == list(EXPECTED)
    for name, expected in EXPECTED.items():
        entry = report["checks"][name]
        assert entry["status"] == "ok", (name, entry.get("error"), entry.get("log_tail"))
        assert expected <= set(entry["figures"]), (name, expected - set(entry["figures"]))
        assert f"{name} " in result.stdout  # one line per check, with its time


def test_dry_run_figures_hold(dry_run):
    checks = {name: entry["figures"] for name, entry in dry_run[1]["checks"].items()}
    for dtype in ("bfloat16", "float32"):
        assert checks["fused_loss"][dtype]["agrees"], checks["fused_loss"][dtype]
    step = checks["moe_step_litgpt"]["mixtral"]  # the toolkit's step (LitGPT is not installed here)
    assert step["toolkit_median_s"] > 0 and step["parameters"]["toolkit"] > 0 and step["device"] == "cpu"
    assert checks["fp16_mixed"]["finite"] and checks["fp16_mixed"]["falls"]
    assert checks["nccl_paths"]["export_identical"] and checks["nccl_paths"]["rng_from_more_gpus"]
    offload = checks["cpu_offload_nf4"]
    assert offload["one_rank_group"]["offloaded"] and offload["nf4_two_ranks"]["offloaded"]
    assert offload["nf4_two_ranks"]["nf4_weights"] > 0 and offload["nf4_two_ranks"]["world_size"] == 2
    for setup in ("pretrain", "lora", "pretrain_checkpointing"):
        figures = checks["memory"][setup]
        assert figures["simulated_peak_bytes"] > 0 and figures["real_peak_bytes"] > 0
    assert checks["throughput_eager"]["real_tokens_per_sec"] > 0 and not checks["throughput_eager"]["compiled_blocks"]
    assert checks["throughput_compiled"]["compiled_blocks"]


def test_without_a_gpu_the_real_run_stops_in_one_line(tmp_path):
    """Without --dry on a machine without a GPU no check starts: the JSON says why, the exit code is 2."""
    out = tmp_path / "gpu_check.json"
    result = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--work_dir", str(tmp_path / "work")],
                            capture_output=True, text=True, env=launch_env(), cwd=REPO, timeout=300)
    report = json.loads(out.read_text())
    if report["machine"].get("cuda_available"):
        pytest.skip("a GPU is visible: the real run is the GPU session's")
    assert result.returncode == 2 and report["error"] == "no CUDA device"


def test_a_check_out_of_time_is_recorded_and_the_next_still_runs(tmp_path):
    """Each check's process is killed at its limit (0.05 s: before torch is even imported); the JSON
    says so for each, and the run exits 1."""
    out = tmp_path / "gpu_check.json"
    result = subprocess.run([sys.executable, str(SCRIPT), "--dry", "--only", "fused_loss,nccl_paths", "--limit", "0.05",
                             "--out", str(out), "--work_dir", str(tmp_path / "work")],
                            capture_output=True, text=True, env=launch_env(), cwd=REPO, timeout=300)
    checks = json.loads(out.read_text())["checks"]
    assert result.returncode == 1
    assert list(checks) == ["fused_loss", "nccl_paths"]
    for entry in checks.values():
        assert entry["status"] == "timeout" and entry["limit_seconds"] == 0.1 and entry["seconds"] < 30, entry
