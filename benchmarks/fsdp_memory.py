"""Per-rank host memory of FSDP2 training on CPU processes: model set-up and training, 1/2/4 ranks.

    python benchmarks/fsdp_memory.py --devices 1 2 4 --results benchmarks/results/fsdp-memory.json

For each entry point and each number of processes N it runs, one after the other:

    pretrain       `toolkit pretrain` of a 336 M-parameter Llama shape from random weights (each
                   rank draws its own rows of every parameter) on a small generated text;
    finetune       `toolkit finetune_full` of the same shape from a bfloat16 Hugging Face checkpoint
                   built here with random weights and converted with `toolkit convert_from_hf`
                   (each rank reads its own rows of every weight, memory-mapped) on generated
                   Alpaca records;
    overhead       each of the two again with a 4 M-parameter model of the same family (2 layers,
                   width 64, the same 32,000-token vocabulary): what a rank costs whatever the
                   model (Python, torch, Lightning, the process group, data, logging).

Every run is the toolkit's own command line with `--devices N --distributed.sharding FULL_SHARD`,
micro batch 1, global batch N (one micro-batch per rank per step), a short sequence and a few steps,
OMP_NUM_THREADS=1. With N = 1 the toolkit trains on a single device (no FSDP): that is the baseline.

How it measures. The script finds the rank processes (rank 0 is the command it started; Fabric
starts ranks 1..N-1 as its children with LOCAL_RANK set) and reads /proc/<pid>/status:

- set-up peak: VmHWM (the kernel's exact high-water mark of the resident set) when rank 0 prints
  "Model set-up took ..." (after an all-gather, so every rank has finished setting up). The toolkit
  resets VmHWM to the current RSS when set-up begins, so the figure is the peak from the start of
  `Session.build_model` to its end, in absolute terms (the RSS the process already had included);
  the toolkit's own figure (growth over the RSS at the start) is recorded next to it;
- training peak: the script then resets VmHWM (writing 5 to /proc/<pid>/clear_refs) and reads it
  again when the last step's line arrives: the peak over optimizer creation and every step;
- checkpoint and export peaks: the same between the last step and "Saved checkpoint", and between
  that and "Saved the final model" (the export gathers full weights on rank 0);
- RssAnon and RssFile are polled every 50 ms per phase (their split shows memory-mapped file pages);
- parameters + gradients + optimizer state per rank: each rank's file of the sharded training
  checkpoint written after the last step (`__<rank>_0.distcp`, or `state.pt` with one process) holds
  that rank's parameters and AdamW state (12 bytes per float32 parameter); gradients add the same
  4 bytes per parameter as the parameters, so parameters + gradients + optimizer state = 4/3 of the
  file. The same figure is also computed from the model's shapes (FSDP2 splits dim 0 of every
  parameter in ceil(rows / N) row chunks) as a check.

The fixed overhead of a rank is the set-up (training) peak of the small model's run at the same N,
less that model's own float32 size / N. The goals (issue 10) are checked per rank:

    set-up peak   <=  float32 size of the model / N  +  fixed set-up overhead
    parameters + gradients + optimizer state at N  ==  the same at N = 1, divided by N

The results JSON holds every run (per rank, per phase), the goals and a projection to 8B and 70B
models on 8 ranks per node; a table is printed. The parent process never imports torch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the toolkit's config code (no torch)

from train_throughput import TOOLKIT_STEP, _busy_cpu_seconds, machine_info, toolkit_command  # noqa: E402

from toolkit.convert.hf_to_toolkit import expected_shapes  # noqa: E402
from toolkit.models.config import Config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TOKENIZER = REPO.parent / "shared" / "data" / "tokenizers" / "llama2"
GiB, MiB = 2**30, 2**20

# The measured model: a Llama shape of 336 M parameters (24 blocks of width 1024, grouped-query
# attention with 4 key/value heads, SwiGLU 2816, untied 32,000-token embedding and head).
PRESET = "tiny-llama-1.1b"
MODEL_OVERRIDES = {"n_layer": 24, "n_embd": 1024, "n_head": 16, "n_query_groups": 4, "intermediate_size": 2816}
# The small model whose runs give the fixed overhead: same family and vocabulary, 4.2 M parameters.
OVERHEAD_OVERRIDES = {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_query_groups": 2, "intermediate_size": 176}

# Projection targets: a preset, and Llama-3.1-70B's published shape (no 70B preset exists).
PROJECTIONS = {
    "llama-3.1-8b": Config.from_name("llama-3.1-8b"),
    "llama-3.1-70b shape": Config.from_name(
        "llama-3.1-8b", n_layer=80, n_embd=8192, n_head=64, n_query_groups=8, intermediate_size=28672
    ),
}
PROJECTION_RANKS = 8

SETUP_LINE = re.compile(r"^Model set-up took ([0-9., ]+) GiB of host memory per rank")
PARAMS_LINE = re.compile(r"^Model \S+: ([0-9,]+) parameters")
SAVED_CHECKPOINT = re.compile(r"^Saved checkpoint ")
SAVED_FINAL = re.compile(r"^Saved the final model ")
STATUS_FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")


# ------------------------------------------------------------------------------------------------
# Reading the rank processes' memory


def read_status(pid: int) -> Optional[dict[str, int]]:
    """VmRSS, RssAnon, RssFile and VmHWM of a process, in bytes; None once it has gone."""
    values = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key = line.split(":", 1)[0]
            if key in STATUS_FIELDS:
                values[key] = int(line.split()[1]) * 1024  # the kernel reports kB
    except (FileNotFoundError, ProcessLookupError):
        return None
    return values


def reset_peak(pid: int) -> None:
    """Reset the process's VmHWM to its current RSS (Linux: "5" into clear_refs)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except (FileNotFoundError, ProcessLookupError):
        pass


def rank_processes(root: int) -> dict[int, int]:
    """{rank: pid}: the started process is rank 0; Fabric's launcher starts the other ranks as its
    children, each with LOCAL_RANK in its environment (forked helpers, such as tokenizer workers,
    inherit rank 0's start-up environment, which has none)."""
    ranks = {0: root}
    try:
        children = []
        for task in Path(f"/proc/{root}/task").iterdir():
            children += [int(c) for c in (task / "children").read_text().split()]
        for pid in children:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            local = [e.split(b"=", 1)[1] for e in env if e.startswith(b"LOCAL_RANK=")]
            if local:
                ranks[int(local[0])] = pid
    except (FileNotFoundError, ProcessLookupError):
        pass
    return ranks


class RankedRun:
    """One toolkit command on N processes: its log lines timestamped, its ranks' memory per phase.

    Phases end at rank 0's log lines: "setup" at "Model set-up took", "train" at the last step's
    line, "checkpoint" at "Saved checkpoint", "export" at "Saved the final model". At each end the
    ranks' VmHWM is read (the phase's exact peak) and reset for the next phase.
    """

    def __init__(self, name: str, command: list[str], log_path: Path, world_size: int, steps: int, env: dict):
        self.name, self.command, self.log_path = name, command, log_path
        self.world_size, self.steps = world_size, steps
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
        self.pids: dict[int, int] = {}
        self.phase = "setup"
        self.peaks: dict[str, dict[int, int]] = {}  # phase -> rank -> VmHWM at the phase's end
        self.sampled: dict[str, dict[int, dict[str, int]]] = {}  # phase -> rank -> max of each field
        self.times: dict[str, float] = {}
        self.toolkit_setup_growth: list[float] = []
        self.parameters: Optional[int] = None
        self.lock = threading.Lock()

    def _poll(self, root: int, done: threading.Event) -> None:
        while not done.is_set():
            if len(self.pids) < self.world_size:
                self.pids = rank_processes(root)
            with self.lock:
                for rank, pid in self.pids.items():
                    status = read_status(pid)
                    if status is None:
                        continue
                    seen = self.sampled.setdefault(self.phase, {}).setdefault(rank, {})
                    for key in ("VmRSS", "RssAnon", "RssFile"):
                        seen[key] = max(seen.get(key, 0), status.get(key, 0))
            done.wait(0.05)

    def _end_phase(self, phase: str, following: str, now: float) -> None:
        with self.lock:
            if len(self.pids) < self.world_size:
                self.pids = rank_processes(self.pids.get(0, 0))
            if len(self.pids) != self.world_size:
                raise SystemExit(f"{self.name}: found rank processes {sorted(self.pids)} of {self.world_size}")
            self.peaks[phase] = {rank: (read_status(pid) or {}).get("VmHWM", 0) for rank, pid in self.pids.items()}
            for pid in self.pids.values():
                reset_peak(pid)
            self.times[phase] = now
            self.phase = following

    def run(self) -> dict:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        busy_before, load_before = _busy_cpu_seconds(), os.getloadavg()
        start = time.perf_counter()
        with open(self.log_path, "w") as log:
            log.write("$ " + " ".join(self.command) + "\n")
            proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    bufsize=1, env=self.env)
            self.pids = {0: proc.pid}
            done = threading.Event()
            poller = threading.Thread(target=self._poll, args=(proc.pid, done), daemon=True)
            poller.start()
            for line in proc.stdout:
                now = time.perf_counter() - start
                log.write(f"[{now:8.2f}] {line}")
                if match := PARAMS_LINE.match(line):
                    self.parameters = int(match.group(1).replace(",", ""))
                elif match := SETUP_LINE.match(line):
                    self.toolkit_setup_growth = [float(x) for x in match.group(1).split(",")]
                    self._end_phase("setup", "train", now)
                elif (match := TOOLKIT_STEP.match(line)) and int(match.group(1)) == self.steps:
                    self._end_phase("train", "checkpoint", now)
                elif SAVED_CHECKPOINT.match(line) and self.phase == "checkpoint":
                    self._end_phase("checkpoint", "export", now)
                elif SAVED_FINAL.match(line):
                    self._end_phase("export", "exit", now)
            _, status, usage = os.wait4(proc.pid, 0)
            returncode = os.waitstatus_to_exitcode(status)
            done.set()
            poller.join()
        wall = time.perf_counter() - start
        if returncode != 0 or "export" not in self.peaks:
            tail = "".join(self.log_path.read_text().splitlines(keepends=True)[-25:])
            raise SystemExit(f"{self.name} failed (exit {returncode}); log {self.log_path}:\n{tail}")
        own = usage.ru_utime + usage.ru_stime  # rank 0 and the ranks it waited for
        return {
            "name": self.name, "command": " ".join(self.command), "log": str(self.log_path),
            "world_size": self.world_size, "parameters": self.parameters,
            "peak_bytes": {phase: [peaks[r] for r in sorted(peaks)] for phase, peaks in self.peaks.items()},
            "sampled_max_bytes": {phase: {key: [ranks[r].get(key, 0) for r in sorted(ranks)] for key in ("VmRSS", "RssAnon", "RssFile")}
                                  for phase, ranks in self.sampled.items()},
            "toolkit_setup_growth_gib": self.toolkit_setup_growth,
            "phase_end_seconds": {k: round(v, 1) for k, v in self.times.items()},
            "load": {"before": load_before, "after": os.getloadavg(), "wall_seconds": round(wall, 1),
                     "cpu_seconds_of_run": round(own, 1),
                     "cpu_seconds_of_others": round(max(0.0, _busy_cpu_seconds() - busy_before - own), 1)},
        }


# ------------------------------------------------------------------------------------------------
# Inputs: text, instruction records, a converted bfloat16 checkpoint


WORDS = (
    "the of and to in is was that for on with as by at from his her they this which were had are be "
    "river stone light market winter garden letter window morning village engine harbour forest "
    "quiet early strong narrow bright heavy gentle distant ancient open walked carried opened found "
    "watched built wrote heard followed remembered across under through before after between"
).split()


def generate_text(path: Path, lines: int = 4000) -> Path:
    """A deterministic pseudo-English corpus (about 250 KB): enough tokens for a few steps and a
    validation split, and no file from outside the repository other than the tokenizer."""
    if path.is_file():
        return path
    import random

    rng = random.Random(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for _ in range(lines):
            f.write(" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 18))).capitalize() + ".\n")
    return path


def generate_alpaca(path: Path, records: int = 256) -> Path:
    """Alpaca records ({"instruction", "input", "output"}) of simple arithmetic, generated."""
    if path.is_file():
        return path
    import random

    rng = random.Random(0)
    rows = []
    for _ in range(records):
        a, b = rng.randint(1, 999), rng.randint(1, 999)
        rows.append({"instruction": "Add the two numbers.", "input": f"{a} and {b}", "output": f"{a} + {b} = {a + b}."})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1))
    return path


BUILD_HF = r"""
import json, shutil, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from toolkit.convert import weight_maps
from toolkit.convert.hf_config import config_to_hf
from toolkit.convert.hf_to_toolkit import expected_shapes
from toolkit.models.config import Config

out, tokenizer_dir, preset, overrides = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
out.mkdir(parents=True)
config = Config.from_name(preset, **overrides)
hf = config_to_hf(config, dtype="bfloat16")
hf.update(bos_token_id=1, eos_token_id=2)
(out / "config.json").write_text(json.dumps(hf, indent=2))
generator = torch.Generator().manual_seed(0)
tensors = {}
for name, shape in expected_shapes(config).items():
    value = torch.empty(shape).normal_(0.0, 0.02, generator=generator) if len(shape) > 1 else torch.ones(shape)
    tensors[weight_maps.toolkit_to_hf_name(config.family, name)[0]] = value.to(torch.bfloat16)
save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
for f in tokenizer_dir.iterdir():
    if f.is_file():
        shutil.copyfile(f, out / f.name)
"""


def prepare_checkpoint(args, overrides: dict) -> Path:
    """A bfloat16 Hugging Face Llama with random weights, converted by `toolkit convert_from_hf`
    (built once per model shape and kept in the work folder)."""
    shape = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    root = args.work_dir / "checkpoints" / shape
    converted = root / "toolkit"
    if (converted / "model_config.json").is_file():
        return converted
    shutil.rmtree(root, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(args.threads)}
    subprocess.run([sys.executable, "-c", BUILD_HF, str(root / "hf"), str(args.tokenizer), PRESET, json.dumps(overrides)],
                   check=True, env=env)
    subprocess.run(toolkit_command(args) + ["convert_from_hf", str(root / "hf"), str(converted)], check=True, env=env)
    shutil.rmtree(root / "hf")  # only the converted checkpoint is read by the runs
    return converted


# ------------------------------------------------------------------------------------------------
# The runs


def common_options(args, devices: int, out_dir: Path, precision: str) -> list[str]:
    return [
        "--out_dir", str(out_dir), "--devices", str(devices), "--distributed.sharding", "FULL_SHARD",
        "--precision", precision, "--train.micro_batch_size", "1", "--train.global_batch_size", str(devices),
        "--train.max_seq_length", str(args.seq), "--train.max_steps", str(args.steps),
        "--train.save_interval", "null", "--eval.initial_validation", "false", "--eval.final_validation", "false",
        "--eval.interval", "100000", "--log.interval", "1", "--log.loggers", "[csv]",
    ]


def run_command(args, mode: str, devices: int, overrides: dict, out_dir: Path) -> tuple[list[str], str]:
    if mode == "pretrain":
        text = generate_text(args.work_dir / "data" / "corpus.txt")
        return toolkit_command(args) + [
            "pretrain", PRESET, "--model_overrides", json.dumps(overrides), "--tokenizer_dir", str(args.tokenizer),
            "--data", "TextFiles", "--data.train_path", str(text), "--data.cache_dir", str(args.work_dir / "data" / "cache"),
            "--train.warmup_steps", "1",
        ] + common_options(args, devices, out_dir, args.pretrain_precision), args.pretrain_precision
    records = generate_alpaca(args.work_dir / "data" / "alpaca.json")
    checkpoint = prepare_checkpoint(args, overrides)
    return toolkit_command(args) + [
        "finetune_full", str(checkpoint), "--data", "Alpaca", "--data.json_path", str(records),
    ] + common_options(args, devices, out_dir, args.finetune_precision), args.finetune_precision


def checkpoint_rank_files(out_dir: Path, world_size: int) -> list[int]:
    """Bytes of each rank's file in the last training checkpoint (parameters + optimizer state)."""
    step = sorted((out_dir / "checkpoints").glob("step-*"))[-1]
    if world_size == 1:
        return [(step / "state.pt").stat().st_size]
    return [(step / "state" / f"__{rank}_0.distcp").stat().st_size for rank in range(world_size)]


def shard_numels(config: Config, world_size: int) -> list[int]:
    """Elements of the model each rank holds: FSDP2 gives rank k rows [k c, (k+1) c) of every
    parameter, c = ceil(rows / N) (the last ranks get fewer, or none)."""
    out = [0] * world_size
    for shape in expected_shapes(config).values():
        rows, row_size = shape[0], math.prod(shape[1:])
        chunk = -(-rows // world_size)
        for rank in range(world_size):
            out[rank] += max(0, min(rows, (rank + 1) * chunk) - rank * chunk) * row_size
    return out


def measure(args, mode: str, devices: int, kind: str) -> dict:
    overrides = args.model_overrides if kind == "model" else OVERHEAD_OVERRIDES
    config = Config.from_name(PRESET, **overrides)
    tag = f"{mode}-{kind}-{devices}"
    out_dir = args.work_dir / "runs" / tag
    shutil.rmtree(out_dir, ignore_errors=True)
    command, precision = run_command(args, mode, devices, overrides, out_dir)
    print(f"  {tag} ...", flush=True)
    result = RankedRun(tag, command, args.work_dir / "logs" / f"{tag}.log", devices, args.steps,
                       env={"OMP_NUM_THREADS": str(args.threads)}).run()
    numels = shard_numels(config, devices)
    files = checkpoint_rank_files(out_dir, devices)
    result.update(
        mode=mode, kind=kind, precision=precision, model_overrides=overrides,
        float32_model_bytes=4 * sum(numels),
        largest_parameter_float32_bytes=4 * max(math.prod(s) for s in expected_shapes(config).values()),
        checkpoint_rank_file_bytes=files,
        # float32 parameters + AdamW's exp_avg and exp_avg_sq are in the file; gradients add 4 bytes/param
        params_grads_optimizer_bytes_from_checkpoint=[round(f * 4 / 3) for f in files],
        params_grads_optimizer_bytes_from_shapes=[16 * n for n in numels],
    )
    if result["parameters"] != sum(numels):
        raise SystemExit(f"{tag}: the run reports {result['parameters']} parameters, the shapes give {sum(numels)}")
    if not args.keep_outputs:
        shutil.rmtree(out_dir, ignore_errors=True)
    peaks = result["peak_bytes"]
    print("    peak GiB per rank: " + "; ".join(f"{p} " + ", ".join(f"{b / GiB:.2f}" for b in peaks[p]) for p in peaks), flush=True)
    return result


# ------------------------------------------------------------------------------------------------
# Goals, projection, table


def analyse(runs: dict) -> dict:
    """Per mode and N: overheads, the set-up goal and the 1/N goal, per rank."""
    out = {}
    for mode in runs:
        base = runs[mode].get(1, {}).get("model")
        out[mode] = {}
        for n, pair in sorted(runs[mode].items()):
            model, small = pair["model"], pair["overhead"]
            full, small_full = model["float32_model_bytes"], small["float32_model_bytes"]
            overhead = {phase: max(small["peak_bytes"][phase]) - small_full / n for phase in ("setup", "train")}
            # Anonymous memory only (polled, so a brief peak can be missed): without the file pages
            # that a memory-mapped checkpoint read leaves in the resident set (clean, reclaimable).
            anon_overhead = max(small["sampled_max_bytes"]["setup"]["RssAnon"]) - small_full / n
            anon = model["sampled_max_bytes"]["setup"]["RssAnon"]
            # training overhead also covers the small model's own gradients and optimizer state
            overhead["train"] -= 3 * small_full / n
            allowed = full / n + overhead["setup"]
            setup = model["peak_bytes"]["setup"]
            pgo = model["params_grads_optimizer_bytes_from_checkpoint"]
            entry = {
                "float32_model_bytes": full,
                "fixed_overhead_bytes": {k: round(v) for k, v in overhead.items()},
                "setup_limit_bytes": round(allowed),
                "setup_peak_bytes": setup,
                "setup_margin_bytes": [round(allowed - s) for s in setup],
                "setup_goal_met": all(s <= allowed for s in setup),
                "setup_above_overhead_over_float32_share": [round((s - overhead["setup"]) / (full / n), 3) for s in setup],
                "setup_anon_sampled_above_overhead_over_float32_share": [round((a - anon_overhead) / (full / n), 3) for a in anon],
                "train_peak_bytes": model["peak_bytes"]["train"],
                "train_peak_minus_overhead_minus_pgo_bytes": [round(t - overhead["train"] - p) for t, p in zip(model["peak_bytes"]["train"], pgo)],
                "params_grads_optimizer_bytes": pgo,
                "checkpoint_file_over_shapes": [round(f / (12 * s / 16), 4) for f, s in zip(model["checkpoint_rank_file_bytes"], model["params_grads_optimizer_bytes_from_shapes"])],
            }
            if base is not None:
                ideal = max(base["params_grads_optimizer_bytes_from_checkpoint"]) / n
                entry["pgo_over_one_process_share"] = [round(p / ideal, 4) for p in pgo]
                entry["pgo_goal_met"] = all(abs(p / ideal - 1) <= 0.01 for p in pgo)
            out[mode][n] = entry
    return out


def projection(analysis: dict, runs: dict) -> dict:
    """Per-rank set-up peak at 8B and 70B on PROJECTION_RANKS ranks, from the measured terms:

        fixed overhead (the largest measured)  +  float32 size / N  +  the measured excess

    where the excess is what the largest-N run needed beyond the first two terms, carried over as
    a multiple of the largest parameter's float32 size (pretraining: each rank draws every full
    tensor before keeping its rows) or of the float32 share / N (fine-tuning: the rows it reads).
    """
    out = {}
    for mode, entries in analysis.items():
        n = max(k for k in entries if k > 1)
        e, model = entries[n], runs[mode][n]["model"]
        overhead = max(v["fixed_overhead_bytes"]["setup"] for v in entries.values())
        excess = max(e["setup_peak_bytes"]) - e["fixed_overhead_bytes"]["setup"] - e["float32_model_bytes"] / n
        per_largest = excess / model["largest_parameter_float32_bytes"]
        per_share = excess / (e["float32_model_bytes"] / n)
        out[mode] = {"from_world_size": n, "fixed_overhead_bytes": round(overhead), "excess_bytes": round(excess),
                     "excess_per_largest_parameter": round(per_largest, 3), "excess_per_float32_share": round(per_share, 3),
                     "models": {}}
        for name, config in PROJECTIONS.items():
            shapes = expected_shapes(config)
            full = 4 * sum(math.prod(s) for s in shapes.values())
            largest = 4 * max(math.prod(s) for s in shapes.values())
            share = full / PROJECTION_RANKS
            extra = per_largest * largest if mode == "pretrain" else per_share * share
            per_rank = overhead + share + max(extra, 0)
            out[mode]["models"][name] = {
                "parameters": full // 4, "float32_bytes": full, "largest_parameter_float32_bytes": largest,
                "ranks": PROJECTION_RANKS, "setup_peak_per_rank_bytes": round(per_rank),
                "setup_peak_per_node_bytes": round(per_rank * PROJECTION_RANKS),
                "params_grads_optimizer_per_rank_bytes": round(4 * full / PROJECTION_RANKS),
            }
    return out


def print_table(results: dict) -> None:
    g = lambda b: f"{b / GiB:.2f}"  # noqa: E731
    for mode, entries in results["analysis"].items():
        first = next(iter(entries.values()))
        print(f"\n{mode} ({results['runs'][mode]['1']['model']['precision'] if '1' in results['runs'][mode] else ''}), "
              f"float32 model {g(first['float32_model_bytes'])} GiB; GiB per rank (rank 0, 1, ...)")
        header = ("N", "fixed set-up overhead", "limit F/N+ovh", "set-up peak", "margin", "(peak-ovh)/(F/N)", "anon: same", "toolkit growth",
                  "train peak", "P+G+O", "P+G+O x N / (P+G+O at 1)", "goals")
        rows = []
        for n, e in entries.items():
            run = results["runs"][mode][str(n)]["model"]
            goals = ("set-up " + ("met" if e["setup_goal_met"] else "NOT met")
                     + ("; 1/N " + ("met" if e.get("pgo_goal_met") else "NOT met") if "pgo_goal_met" in e else ""))
            rows.append((str(n), g(e["fixed_overhead_bytes"]["setup"]), g(e["setup_limit_bytes"]),
                         ", ".join(g(b) for b in e["setup_peak_bytes"]), ", ".join(g(b) for b in e["setup_margin_bytes"]),
                         ", ".join(f"{x:.2f}" for x in e["setup_above_overhead_over_float32_share"]),
                         ", ".join(f"{x:.2f}" for x in e["setup_anon_sampled_above_overhead_over_float32_share"]),
                         ", ".join(f"{x:.2f}" for x in run["toolkit_setup_growth_gib"]),
                         ", ".join(g(b) for b in e["train_peak_bytes"]),
                         ", ".join(g(b) for b in e["params_grads_optimizer_bytes"]),
                         ", ".join(f"{x:.3f}" for x in e.get("pgo_over_one_process_share", [])), goals))
        widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
        print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    print(f"\nprojection, {PROJECTION_RANKS} ranks per node (set-up peak per rank / per node, GiB):")
    for mode, p in results["projection"].items():
        for name, m in p["models"].items():
            print(f"  {mode:<9} {name:<20} {m['parameters'] / 1e9:5.1f} B params: "
                  f"{g(m['setup_peak_per_rank_bytes'])} per rank, {g(m['setup_peak_per_node_bytes'])} per node; "
                  f"P+G+O {g(m['params_grads_optimizer_per_rank_bytes'])} per rank")


def parse_args(argv: list[str]):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4], help="numbers of processes, run in turn")
    p.add_argument("--modes", nargs="+", choices=["pretrain", "finetune"], default=["pretrain", "finetune"])
    p.add_argument("--model_overrides", type=json.loads, default=MODEL_OVERRIDES,
                   help=f"the measured model: {PRESET} with these fields changed (JSON); default: the 336 M shape")
    p.add_argument("--pretrain_precision", default="32-true")
    p.add_argument("--finetune_precision", default="bf16-mixed")
    p.add_argument("--seq", type=int, default=64, help="--train.max_seq_length")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process")
    p.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER, help="a folder with a 32,000-token tokenizer.json")
    p.add_argument("--work_dir", type=Path, default=Path("/tmp/fsdp-memory-bench"))
    p.add_argument("--keep_outputs", action="store_true", help="keep the runs' checkpoints and exported models")
    p.add_argument("--results", type=Path, default=None, help="JSON file (default: <work_dir>/results.json)")
    p.add_argument("--from_results", type=Path, default=None,
                   help="run nothing: recompute the goals, projection and table from this results file's runs")
    args = p.parse_args(argv)
    args.work_dir, args.tokenizer = args.work_dir.resolve(), args.tokenizer.resolve()
    if not (args.tokenizer / "tokenizer.json").is_file():
        p.error(f"{args.tokenizer} has no tokenizer.json: pass --tokenizer <folder>")
    if 1 not in args.devices:
        p.error("--devices must include 1: the 1/N goal is checked against one process")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.from_results is not None:
        results = json.loads(args.from_results.read_text())
        runs = {mode: {int(n): v for n, v in r.items()} for mode, r in results["runs"].items()}
        results["analysis"] = analyse(runs)
        results["projection"] = projection(results["analysis"], runs)
        results = {**results, "runs": results.pop("runs")}  # keep the runs last, as a fresh run writes them
        (args.results or args.from_results).write_text(json.dumps(results, indent=2) + "\n")
        print_table(results)
        return
    args.work_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "command": "python benchmarks/fsdp_memory.py " + " ".join(argv),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine_info(),
        "config": {"preset": PRESET, "model_overrides": args.model_overrides, "overhead_model_overrides": OVERHEAD_OVERRIDES,
                   "devices": args.devices, "sharding": "FULL_SHARD", "seq": args.seq, "steps": args.steps,
                   "micro_batch": 1, "global_batch": "N", "threads": args.threads,
                   "pretrain_precision": args.pretrain_precision, "finetune_precision": args.finetune_precision},
    }
    runs: dict = {}
    for mode in args.modes:
        print(f"{mode}:", flush=True)
        runs[mode] = {}
        for devices in sorted(args.devices):  # one after the other: the machine is shared
            runs[mode][devices] = {kind: measure(args, mode, devices, kind) for kind in ("overhead", "model")}
    results["analysis"] = analyse(runs)
    results["projection"] = projection(results["analysis"], runs)
    results["runs"] = {mode: {str(n): v for n, v in r.items()} for mode, r in runs.items()}
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    path = args.results or args.work_dir / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
