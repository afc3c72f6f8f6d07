"""Training throughput and memory of the toolkit, side by side with an installed LitGPT.

    python benchmarks/train_throughput.py pretrain --tool both          # pythia-14m pretraining
    python benchmarks/train_throughput.py lora --tool both              # LoRA fine-tuning
    python benchmarks/train_throughput.py help --tool both              # `toolkit --help` vs `litgpt --help`
    python benchmarks/train_throughput.py all --tool both --results benchmarks/results/latest.json

    # no data files, no litdata: random tokens through the toolkit's GPT and training loop (GPU)
    python benchmarks/train_throughput.py pretrain --data synthetic --preset tiny-llama-1.1b \\
        --precision bf16-mixed --device cuda --micro_batch 4 --global_batch 16 --seq 2048

Every run is a fresh training process started from this script (the tools' own command lines,
`toolkit pretrain`, `litgpt pretrain`, ...), and "paired" means both tools run one after the other
in the same invocation, with the same model, batch, sequence length, precision and data. For each
run the script records:

- time per optimizer step: the child's stdout is read line by line and every step's log line is
  timestamped on arrival (both tools print one line per optimizer step and flush it, after the
  step's optimizer update). The first --warmup steps (start-up, torch.compile, allocator warm-up)
  are left out; the figure is the time from the end of step `warmup` to the end of step
  `warmup + steps`, divided by `steps`. The same clock for both tools, everything included (data
  loading, optimizer, logging);
- real tokens per second: tokens of the model inputs that are not padding, over the same steps.
  Both tools' runs log their own: the toolkit "train/tokens_per_step" (real tokens of each optimizer
  step, over all ranks) and LitGPT the running count of non-padding input tokens ("tokens") in their
  metrics.csv. The script reads those; it never recomputes a tool's batches. Pretraining has no
  padding, and the toolkit's logged count is checked to be global_batch x seq per step;
- peak memory: the high-water mark of the training process's resident set (VmHWM in
  /proc/<pid>/status, polled every 50 ms; it only grows, so polling cannot miss the training peak).
  Data-loader worker processes are separate and not included. On CUDA the synthetic mode also
  reports torch.cuda.max_memory_allocated.

- interference: the CPU time all other processes on the machine used while the run lasted
  (/proc/stat minus the run's own CPU time from wait4), so a figure taken on a busy shared machine
  shows as such.

The results go to a JSON file: every run, the per-tool medians over --repeat pairs, and the ratios
(throughput toolkit / LitGPT, step time LitGPT / toolkit: above 1 the toolkit is faster; peak memory
toolkit / LitGPT: below 1 the toolkit uses less), with the goals they are checked against; a table is
printed. See benchmarks/README.md for how to install LitGPT next to the project and the latest figures.

The parent process never imports torch, so it takes nothing from the measured runs.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SHARED = REPO.parent / "shared" / "data"
DEFAULT_LITGPT = os.environ.get("LITGPT", "/tmp/litgpt-venv/bin/litgpt")

TOOLKIT_STEP = re.compile(r"^step (\d+)(?:/\d+)? \|")
LITGPT_STEP = re.compile(r"iter (\d+) step (\d+) \|.*\(step\)")

# The goals of issue 24 (paired on this machine): pretraining throughput 1.5x LitGPT, LoRA real tokens/s 4x.
GOALS = {"pretrain_tokens_per_sec": 1.5, "lora_real_tokens_per_sec": 4.0, "toolkit_help_seconds": 1.0}


# ------------------------------------------------------------------------------------------------
# Running one training process


class Run:
    """A child process whose step lines are timestamped and whose VmHWM is polled."""

    def __init__(self, name: str, command: list[str], log_path: Path, step_pattern: re.Pattern, env=None, cwd=None):
        self.name, self.command, self.log_path, self.step_pattern = name, command, log_path, step_pattern
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.cwd = cwd
        self.step_times: dict[int, float] = {}
        self.peak_rss_kib = 0
        self.returncode: Optional[int] = None
        self.expected_steps: Optional[int] = None  # a failure after this step's log line is tolerated
        self.error: Optional[str] = None

    def _poll_memory(self, pid: int, done: threading.Event) -> None:
        status = Path(f"/proc/{pid}/status")
        while not done.is_set():
            try:
                for line in status.read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        self.peak_rss_kib = max(self.peak_rss_kib, int(line.split()[1]))
                        break
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                return
            done.wait(0.05)

    def run(self) -> "Run":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        load_before = os.getloadavg()
        busy_before = _busy_cpu_seconds()
        start = time.perf_counter()
        with open(self.log_path, "w") as log:
            log.write("$ " + " ".join(self.command) + "\n")
            proc = subprocess.Popen(
                self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                env=self.env, cwd=self.cwd,
            )
            done = threading.Event()
            poller = threading.Thread(target=self._poll_memory, args=(proc.pid, done), daemon=True)
            poller.start()
            for line in proc.stdout:
                now = time.perf_counter()
                log.write(f"[{now - start:9.3f}] {line}")
                match = self.step_pattern.search(line)
                if match:
                    self.step_times[int(match.group(match.lastindex))] = now
            # wait4 gives the CPU time of the process and of its waited-for children (loader workers)
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = self.returncode = os.waitstatus_to_exitcode(status)
            done.set()
            poller.join()
        self.wall_seconds = time.perf_counter() - start
        busy_after = _busy_cpu_seconds()
        own = usage.ru_utime + usage.ru_stime
        self.load = {
            "before": load_before, "after": os.getloadavg(),  # load averages: they include this run itself
            "cpu_seconds_of_run": round(own, 1),
            # CPU time every other process on the machine used while this run lasted: the interference
            "cpu_seconds_of_others": round(max(0.0, busy_after - busy_before - own), 1),
            "wall_seconds": round(self.wall_seconds, 1),
        }
        if self.returncode != 0:
            tail = "".join(self.log_path.read_text().splitlines(keepends=True)[-25:])
            if self.expected_steps and self.expected_steps in self.step_times:
                # Training finished; what failed came after it (e.g. exporting the result). The
                # measurement stands, and the failure is recorded with it.
                self.error = tail.strip().splitlines()[-1]
                print(f"  warning: {self.name} exited with {self.returncode} after its last step: {self.error}", flush=True)
            else:
                raise SystemExit(f"{self.name} failed (exit {self.returncode}); log {self.log_path}:\n{tail}")
        return self

    def step_seconds(self, warmup: int, steps: int) -> list[float]:
        """Duration of each measured step (end of the previous step's line to the end of its own)."""
        self.window(warmup, steps)  # checks that the lines are there
        return [self.step_times[k] - self.step_times[k - 1] for k in range(warmup + 1, warmup + steps + 1)]

    def window(self, warmup: int, steps: int) -> float:
        """Seconds from the end of step `warmup` to the end of step `warmup + steps`."""
        first, last = warmup, warmup + steps
        if first == 0:
            raise SystemExit("--warmup must be at least 1 (the first step includes start-up)")
        missing = [s for s in (first, last) if s not in self.step_times]
        if missing:
            raise SystemExit(f"{self.name}: no log line for step(s) {missing}; see {self.log_path}")
        return self.step_times[last] - self.step_times[first]


def _busy_cpu_seconds() -> float:
    """CPU time (all cores) the machine spent outside idle and iowait since boot, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    guest = sum(fields[8:10]) if len(fields) > 9 else 0  # already counted in user and nice
    return (sum(fields) - idle - guest) / os.sysconf("SC_CLK_TCK")


def toolkit_command(args) -> list[str]:
    script = Path(sys.executable).parent / "toolkit"
    return [str(script)] if script.exists() else [sys.executable, "-m", "toolkit"]


def litgpt_command(args) -> list[str]:
    if not Path(args.litgpt).exists():
        raise SystemExit(
            f"LitGPT not found at {args.litgpt}: install it in its own virtual environment (see "
            "benchmarks/README.md) and pass --litgpt <venv>/bin/litgpt, or use --tool toolkit."
        )
    return [args.litgpt]


def litgpt_python(args) -> str:
    return str(Path(args.litgpt).parent / "python")


# ------------------------------------------------------------------------------------------------
# Data and checkpoints shared by the runs


def prepare_text(args) -> Path:
    """A folder holding only the text file: LitGPT writes its token streams next to the text."""
    folder = args.work_dir / "text"
    source = args.shared / "tinyshakespeare.txt"
    if not source.is_file():
        raise SystemExit(f"{source} not found: pass --shared <folder with tinyshakespeare.txt, tokenizers/, instruct/>")
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / source.name
    if not target.exists():
        shutil.copyfile(source, target)
    return folder


BUILD_HF = r"""
import json, shutil, sys
from pathlib import Path
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
from toolkit.convert.hf_config import config_to_hf
from toolkit.models.config import Config

out, tokenizer_dir, preset = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
hf = config_to_hf(Config.from_name(preset), dtype="float32")
hf.update(bos_token_id=0, eos_token_id=0)
torch.manual_seed(0)
model = GPTNeoXForCausalLM(GPTNeoXConfig(**{k: v for k, v in hf.items() if k != "architectures"}))
model.save_pretrained(out, safe_serialization=True)
for f in tokenizer_dir.iterdir():
    if f.is_file():
        shutil.copyfile(f, out / f.name)
if not (out / "tokenizer_config.json").exists():
    (out / "tokenizer_config.json").write_text(sys.argv[4])
print(sum(p.numel() for p in model.parameters()), "parameters")
"""


def prepare_checkpoints(args, tools: list[str]) -> dict[str, Path]:
    """A random Hugging Face GPT-NeoX with the preset's shape, converted by each tool's converter."""
    root = args.work_dir / f"checkpoints-{args.model}"
    hf_dir = root / "hf"
    tokenizer_dir = args.shared / "tokenizers" / "gpt-neox-20b"
    if not (hf_dir / "config.json").exists():
        tmp = root / "hf.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run([sys.executable, "-c", BUILD_HF, str(tmp), str(tokenizer_dir), args.model,
                        json.dumps(NEOX_TOKENIZER_CONFIG)], check=True)
        tmp.rename(hf_dir)
    out = {}
    if "toolkit" in tools:
        tk = root / "toolkit"
        if not (tk / "model_config.json").exists():
            shutil.rmtree(tk, ignore_errors=True)
            subprocess.run(toolkit_command(args) + ["convert_from_hf", str(hf_dir), str(tk)], check=True)
        out["toolkit"] = tk
    if "litgpt" in tools:
        lg = root / "litgpt" / args.model  # LitGPT converts in place and wants the model name
        if not (lg / "lit_model.pth").exists():
            shutil.rmtree(lg, ignore_errors=True)
            shutil.copytree(hf_dir, lg)
            subprocess.run(litgpt_command(args) + ["convert_to_litgpt", str(lg), "--model_name", args.model], check=True)
        out["litgpt"] = lg
    return out


# ------------------------------------------------------------------------------------------------
# Command lines: the same configuration for both tools


def fresh_dir(args, name: str) -> Path:
    path = args.work_dir / "runs" / name
    shutil.rmtree(path, ignore_errors=True)
    return path


# What the Pythia repositories' tokenizer_config.json says; the shared tokenizer folder has only
# tokenizer.json, and LitGPT's TextFiles refuses a tokenizer without a known BOS token.
NEOX_TOKENIZER_CONFIG = {
    "tokenizer_class": "GPTNeoXTokenizer", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
    "unk_token": "<|endoftext|>", "add_prefix_space": False,
}


def litgpt_tokenizer_dir(args) -> Path:
    folder = args.work_dir / "tokenizer-litgpt"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(args.shared / "tokenizers" / "gpt-neox-20b" / "tokenizer.json", folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(NEOX_TOKENIZER_CONFIG))
    return folder


def pretrain_command(args, tool: str, total_steps: int, tag: str) -> tuple[list[str], Path, re.Pattern]:
    """(command line, output folder, step-line pattern) of one pretraining run of `tool`."""
    text = prepare_text(args)
    tokenizer = args.shared / "tokenizers" / "gpt-neox-20b"
    m, g, seq = args.micro_batch, args.global_batch, args.seq
    out = fresh_dir(args, f"{tool}-pretrain-{tag}")
    if tool == "litgpt":
        model = ["--config", str(args.litgpt_model_config)] if args.litgpt_model_config else [args.model]
        return litgpt_command(args) + [
            "pretrain", *model, "--out_dir", str(out),
            "--data", "TextFiles", "--data.train_data_path", str(text), "--data.val_data_path", str(text),
            "--tokenizer_dir", str(litgpt_tokenizer_dir(args)),
            "--train.micro_batch_size", str(m), "--train.global_batch_size", str(g), "--train.max_seq_length", str(seq),
            "--train.max_tokens", str(total_steps * g * seq), "--train.lr_warmup_steps", "10",
            "--train.save_interval", "null", "--eval.interval", "100000", "--eval.final_validation", "false",
            "--logger_name", "csv", "--precision", args.precision, "--devices", "1",
        ], out, LITGPT_STEP
    cmd = toolkit_command(args) + [
        "pretrain", args.model, "--out_dir", str(out),
        "--data", "TextFiles", "--data.train_path", str(text / "tinyshakespeare.txt"),
        "--data.cache_dir", str(args.work_dir / "toolkit-cache"), "--tokenizer_dir", str(tokenizer),
        "--train.micro_batch_size", str(m), "--train.global_batch_size", str(g), "--train.max_seq_length", str(seq),
        "--train.max_steps", str(total_steps), "--train.warmup_steps", "10", "--train.save_interval", "null",
        "--eval.interval", "100000", "--eval.final_validation", "false",
        "--log.interval", "1", "--log.loggers", "[csv]", "--precision", args.precision, "--devices", "1",
    ]
    cmd += ["--train.compile", args.compile]
    if args.model_overrides:
        cmd += ["--model_overrides", args.model_overrides]
    return cmd, out, TOOLKIT_STEP


def lora_command(args, tool: str, total_steps: int, tag: str, checkpoint: Path) -> tuple[list[str], Path, re.Pattern]:
    """(command line, output folder, step-line pattern) of one LoRA run of `tool`."""
    data = args.shared / "instruct" / "alpaca_en_demo.json"
    m, g, seq = args.micro_batch, args.global_batch, args.seq
    mask = "true" if args.mask_prompt else "false"
    out = fresh_dir(args, f"{tool}-lora-{tag}")
    if tool == "litgpt":
        return litgpt_command(args) + [
            "finetune_lora", str(checkpoint), "--out_dir", str(out),
            "--data", "JSON", "--data.json_path", str(data), "--data.prompt_style", "alpaca",
            "--data.mask_prompt", mask, "--data.val_split_fraction", "0.05",
            "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.05",
            "--lora_query", "true", "--lora_key", "false", "--lora_value", "true", "--lora_projection", "false",
            "--lora_mlp", "false", "--lora_head", "false",
            "--train.micro_batch_size", str(m), "--train.global_batch_size", str(g), "--train.max_seq_length", str(seq),
            "--train.max_steps", str(total_steps), "--train.save_interval", "null", "--train.epochs", "100",
            "--eval.interval", "100000", "--eval.initial_validation", "false", "--eval.final_validation", "false",
            "--logger_name", "csv", "--precision", args.precision, "--devices", "1", "--seed", str(args.seed),
        ], out, LITGPT_STEP
    cmd = toolkit_command(args) + [
        "finetune_lora", str(checkpoint), "--out_dir", str(out),
        "--data", "Alpaca", "--data.json_path", str(data), "--data.prompt_style", "alpaca",
        "--data.mask_prompt", mask, "--data.val_split_fraction", "0.05",
        "--lora.r", "8", "--lora.alpha", "16", "--lora.dropout", "0.05", "--lora.targets", "[query, value]",
        "--train.micro_batch_size", str(m), "--train.global_batch_size", str(g), "--train.max_seq_length", str(seq),
        "--train.max_steps", str(total_steps), "--train.save_interval", "null",
        "--eval.interval", "100000", "--eval.initial_validation", "false", "--eval.final_validation", "false",
        "--log.interval", "1", "--log.loggers", "[csv]", "--precision", args.precision, "--devices", "1",
        "--seed", str(args.seed),
    ]
    cmd += ["--train.compile", args.compile]
    if args.model_overrides:
        cmd += ["--model_overrides", args.model_overrides]
    return cmd, out, TOOLKIT_STEP


# ------------------------------------------------------------------------------------------------
# Real-token counts for LoRA


def litgpt_lora_tokens(out_dir: Path, accumulation: int, warmup: int, steps: int) -> int:
    """Non-padding input tokens of optimizer steps warmup+1 .. warmup+steps, from LitGPT's metrics.csv."""
    files = sorted(out_dir.glob("logs/csv/**/metrics.csv"))
    if not files:
        raise SystemExit(f"no metrics.csv under {out_dir}/logs/csv")
    cumulative = {}
    with open(files[-1]) as f:
        for row in csv.DictReader(f):
            if row.get("iter") and row.get("tokens"):
                cumulative[int(float(row["iter"]))] = int(float(row["tokens"]))
    first, last = warmup * accumulation, (warmup + steps) * accumulation
    return cumulative[last] - cumulative[first]


def toolkit_logged_tokens(out_dir: Path, warmup: int, steps: int) -> int:
    """Real (non-padding) input tokens of optimizer steps warmup+1 .. warmup+steps, as the run logged
    them itself ("train/tokens_per_step", every step with --log.interval 1)."""
    files = sorted(out_dir.glob("logs/csv/**/metrics.csv"))
    if not files:
        raise SystemExit(f"no metrics.csv under {out_dir}/logs/csv")
    per_step = {}
    with open(files[-1]) as f:
        for row in csv.DictReader(f):
            if row.get("train/tokens_per_step"):
                per_step[int(float(row["step"]))] = float(row["train/tokens_per_step"])
    wanted = range(warmup + 1, warmup + steps + 1)
    missing = [s for s in wanted if s not in per_step]
    if missing:
        raise SystemExit(f"the toolkit run in {out_dir} logged no train/tokens_per_step for steps {missing[:5]}")
    return int(round(sum(per_step[s] for s in wanted)))


# ------------------------------------------------------------------------------------------------
# Modes


def measure(args, mode: str, tool: str, spec, tag: str, checkpoints=None) -> dict:
    command, out_dir, pattern = spec
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    run = Run(f"{tool} {mode}", command, args.work_dir / "logs" / f"{tool}-{mode}-{tag}.log", pattern, env=env)
    run.expected_steps = args.warmup + args.steps
    run.run()
    seconds = run.window(args.warmup, args.steps)
    per_step = run.step_seconds(args.warmup, args.steps)
    accumulation = args.global_batch // args.micro_batch
    result = {
        "tool": tool, "mode": mode, "steps": args.steps, "warmup_steps": args.warmup,
        "seconds": round(seconds, 3), "seconds_per_step": round(seconds / args.steps, 4),
        "median_step_seconds": round(statistics.median(per_step), 4), "step_seconds": [round(x, 3) for x in per_step],
        "peak_rss_mib": round(run.peak_rss_kib / 1024, 1), "wall_seconds": round(run.wall_seconds, 1),
        "load": run.load, "log": str(run.log_path), "command": " ".join(command),
    }
    if run.error:
        result["exit_code"], result["error_after_training"] = run.returncode, run.error
    if tool == "toolkit":
        result.update(real_tokens=toolkit_logged_tokens(out_dir, args.warmup, args.steps))
    if mode == "pretrain":
        tokens = args.steps * args.global_batch * args.seq
        if tool == "toolkit" and result["real_tokens"] != tokens:
            raise SystemExit(f"the toolkit logged {result['real_tokens']} tokens for {args.steps} steps, not {tokens}")
        result.update(real_tokens=tokens, padded_tokens=tokens)
        # Every step has the same tokens: the median step is the figure least moved by other load.
        result["median_step_tokens_per_sec"] = round(args.global_batch * args.seq / result["median_step_seconds"], 1)
    elif tool == "litgpt":
        result.update(real_tokens=litgpt_lora_tokens(out_dir, accumulation, args.warmup, args.steps))
    result["real_tokens_per_sec"] = round(result["real_tokens"] / seconds, 1)
    if result.get("padded_tokens"):
        result["tokens_per_sec_with_padding"] = round(result["padded_tokens"] / seconds, 1)
    print(
        f"  {tool:8s} {mode:8s} {result['seconds_per_step']:7.3f} s/step  {result['real_tokens_per_sec']:9,.0f} real tok/s"
        f"  peak RSS {result['peak_rss_mib']:7.0f} MiB  (other processes: {run.load['cpu_seconds_of_others']:.0f} CPU s "
        f"in {run.wall_seconds:.0f} s)",
        flush=True,
    )
    return result


def run_training(args, mode: str) -> dict:
    tools = args.tools
    checkpoints = prepare_checkpoints(args, tools) if mode == "lora" else None
    total = args.warmup + args.steps
    runs: dict[str, list[dict]] = {t: [] for t in tools}
    if mode == "pretrain" and args.prepare:
        # One short run per tool first, so that tokenizing the text into each tool's cache is not measured.
        for tool in tools:
            command, _, pattern = pretrain_command(args, tool, 1, "prepare")
            Run(f"{tool} prepare", command, args.work_dir / "logs" / f"{tool}-prepare.log", pattern).run()
    for r in range(args.repeat):
        order = tools if r % 2 == 0 else list(reversed(tools))  # alternate who goes first
        for tool in order:
            if mode == "pretrain":
                spec = pretrain_command(args, tool, total, str(r))
            else:
                spec = lora_command(args, tool, total, str(r), checkpoints[tool])
            runs[tool].append(measure(args, mode, tool, spec, str(r), checkpoints))
    summary = {"runs": runs}
    for tool in tools:
        keys = ["seconds_per_step", "median_step_seconds", "real_tokens_per_sec", "peak_rss_mib"]
        keys += ["median_step_tokens_per_sec"] if mode == "pretrain" else []
        summary[tool] = {key: statistics.median(run[key] for run in runs[tool]) for key in keys}
        if all("tokens_per_sec_with_padding" in run for run in runs[tool]):
            summary[tool]["tokens_per_sec_with_padding"] = statistics.median(run["tokens_per_sec_with_padding"] for run in runs[tool])
    if len(tools) == 2:
        tk, lg = summary["toolkit"], summary["litgpt"]
        summary["ratios"] = {
            "real_tokens_per_sec": round(tk["real_tokens_per_sec"] / lg["real_tokens_per_sec"], 3),
            "step_time_speedup": round(lg["seconds_per_step"] / tk["seconds_per_step"], 3),
            "peak_rss": round(tk["peak_rss_mib"] / lg["peak_rss_mib"], 3),
            # each pair's own ratio (the tools ran back to back under about the same load)
            "per_pair_real_tokens_per_sec": [round(a["real_tokens_per_sec"] / b["real_tokens_per_sec"], 3)
                                             for a, b in zip(runs["toolkit"], runs["litgpt"])],
        }
        if mode == "pretrain":
            summary["ratios"]["median_step_tokens_per_sec"] = round(
                tk["median_step_tokens_per_sec"] / lg["median_step_tokens_per_sec"], 3)
    return summary


def time_help(args) -> dict:
    """Median wall time of `<tool> --help` (and `<tool> pretrain --help`), alternating the tools.

    `--help` runs --help_repeat times per tool, `pretrain --help` (which loads the subcommand's
    module and its argument parser) min(5, --help_repeat) times.
    """
    tools = ["toolkit"] + (["litgpt"] if "litgpt" in args.tools else [])
    base = {"toolkit": toolkit_command(args), "litgpt": litgpt_command(args) if "litgpt" in tools else None}
    result: dict = {}
    for label, extra, repeat in (("--help", ["--help"], args.help_repeat),
                                 ("pretrain --help", ["pretrain", "--help"], min(5, args.help_repeat))):
        times: dict[str, list[float]] = {t: [] for t in tools}
        for tool in tools:  # one untimed run each: the first run also warms the page cache
            subprocess.run(base[tool] + extra, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        for _ in range(repeat):
            for tool in tools:
                start = time.perf_counter()
                subprocess.run(base[tool] + extra, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
                times[tool].append(time.perf_counter() - start)
        for tool, values in times.items():
            entry = {"median_seconds": round(statistics.median(values), 4), "runs": [round(x, 4) for x in values]}
            if label == "--help":
                result[tool] = entry
            else:
                result.setdefault("subcommand", {})[tool] = entry
            print(f"  {tool:8s} {label:16s} {entry['median_seconds']:.3f} s (median of {repeat})", flush=True)
    if "litgpt" in result:
        result["ratio_litgpt_over_toolkit"] = round(result["litgpt"]["median_seconds"] / result["toolkit"]["median_seconds"], 1)
    return result


# ------------------------------------------------------------------------------------------------
# Synthetic data: the toolkit's GPT and training loop on random tokens (no litdata, no jsonargparse)


def run_synthetic(args) -> dict:
    total = args.warmup + args.steps
    command = [
        sys.executable, str(Path(__file__).resolve()), "_synthetic_worker", "--preset", args.model,
        "--precision", args.precision, "--device", args.device, "--micro_batch", str(args.micro_batch),
        "--global_batch", str(args.global_batch), "--seq", str(args.seq), "--steps", str(total),
        "--seed", str(args.seed),
    ] + (["--compile"] if args.compile == "true" else []) + (["--peak_flops", str(args.peak_flops)] if args.peak_flops else [])
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    run = Run("toolkit synthetic", command, args.work_dir / "logs" / f"toolkit-synthetic-{args.model}.log", TOOLKIT_STEP, env=env).run()
    seconds = run.window(args.warmup, args.steps)
    info = {}
    for line in run.log_path.read_text().splitlines():
        if "SYNTHETIC_RESULT " in line:
            info = json.loads(line.split("SYNTHETIC_RESULT ", 1)[1])
    tokens = args.steps * args.global_batch * args.seq
    tokens_per_sec = tokens / seconds
    result = {
        "tool": "toolkit", "mode": "pretrain", "data": "synthetic", "model": args.model, "precision": args.precision,
        "device": info.get("device_name"), "micro_batch": args.micro_batch, "global_batch": args.global_batch,
        "seq": args.seq, "steps": args.steps, "warmup_steps": args.warmup, "seconds": round(seconds, 3),
        "seconds_per_step": round(seconds / args.steps, 4), "real_tokens_per_sec": round(tokens_per_sec, 1),
        "peak_rss_mib": round(run.peak_rss_kib / 1024, 1), "log": str(run.log_path), "load": run.load, **info,
    }
    if info.get("flops_per_token") and info.get("device_peak_flops"):
        result["mfu"] = round(info["flops_per_token"] * tokens_per_sec / info["device_peak_flops"], 4)
    mfu = f"  MFU {100 * result['mfu']:.1f}%" if "mfu" in result else ""
    gpu = f"  peak CUDA memory {info['cuda_max_allocated_gib']:.1f} GiB" if info.get("cuda_max_allocated_gib") else ""
    print(f"  toolkit synthetic {args.model} {args.precision}: {result['seconds_per_step']:.3f} s/step, "
          f"{tokens_per_sec:,.0f} tok/s{mfu}{gpu}, peak RSS {result['peak_rss_mib']:.0f} MiB", flush=True)
    return result


def synthetic_worker(argv: list[str]) -> None:
    """One process: build Fabric, the model and AdamW as `toolkit pretrain` does, then run `fit` on random tokens."""
    p = argparse.ArgumentParser()
    p.add_argument("--preset", required=True)
    p.add_argument("--precision", default="32-true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--micro_batch", type=int, default=4)
    p.add_argument("--global_batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--peak_flops", type=float, default=None)
    a = p.parse_args(argv)

    import torch

    from toolkit.models.config import Config
    from toolkit.models.gpt import GPT, Block, flops_per_token, init_weights
    from toolkit.args import DistributedArgs, EvalArgs, LogArgs, TrainArgs
    from toolkit.parallel.batches import plan_batches
    from toolkit.training.loop import LoopHooks, TrainState, fit
    from toolkit.parallel.plan import plan_strategy
    from toolkit.training.fabric import build_fabric
    from toolkit.training.throughput import device_peak_flops

    config = Config.from_name(a.preset)
    fabric = build_fabric(plan_strategy(1, 1, a.precision, DistributedArgs(), accelerator=a.device), block_cls=Block)
    fabric.launch()
    fabric.seed_everything(a.seed)
    plan = plan_batches(1, 1, a.micro_batch, a.global_batch, a.seq)
    with fabric.init_module(empty_init=False):
        model = GPT(config)
    init_weights(model, config.n_layer)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    model = fabric.setup_module(model)
    if a.compile:  # as training runs compile: each block in place (toolkit.parallel.compile)
        from toolkit.models.gpt import Block
        from toolkit.parallel.compile import compile_blocks

        compile_blocks(model, Block, fabric.device, dynamic=False, print_fn=print)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=3e-4, betas=(0.9, 0.95))
    optimizer = fabric.setup_optimizers(optimizer)

    class Tokens:
        """An endless stream of random token blocks (fixed seed); batches are made on the device."""

        def __iter__(self):
            generator = torch.Generator(device=fabric.device).manual_seed(a.seed)
            while True:
                block = torch.randint(0, config.vocab_size, (a.micro_batch, a.seq + 1), device=fabric.device,
                                      generator=generator)
                yield {"input_ids": block[:, :-1], "labels": block[:, 1:]}

    train = TrainArgs(micro_batch_size=a.micro_batch, global_batch_size=a.global_batch, max_seq_length=a.seq,
                      max_steps=a.steps, warmup_steps=2, save_interval=None)
    peak = device_peak_flops(fabric.device, fabric._precision, a.peak_flops)
    hooks = LoopHooks(flops_per_token=flops_per_token(config, a.seq), device_peak_flops=peak)
    if fabric.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    fit(fabric, model, optimizer, Tokens(), None, plan, TrainState(), train, EvalArgs(final_validation=False),
        LogArgs(interval=1, loggers=()), hooks, total_steps=a.steps, tokens_per_step=plan.tokens_per_step)
    info = {
        "device_name": torch.cuda.get_device_name(fabric.device) if fabric.device.type == "cuda" else platform.processor() or "cpu",
        "parameters": sum(p.numel() for p in model.parameters()),
        "flops_per_token": flops_per_token(config, a.seq), "device_peak_flops": getattr(peak, "flops", peak),  # a CPU's measured (CpuPeak): its best figure
        "torch": torch.__version__,
    }
    if fabric.device.type == "cuda":
        info["cuda_max_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    print("SYNTHETIC_RESULT " + json.dumps(info), flush=True)


# ------------------------------------------------------------------------------------------------
# Report


def print_table(results: dict) -> None:
    rows = []
    for mode in ("pretrain", "lora"):
        summary = results.get(mode)
        if not summary:
            continue
        for key, label, fmt in (("real_tokens_per_sec", "real tokens/s", "{:,.0f}"),
                                ("median_step_tokens_per_sec", "tokens/s of the median step", "{:,.0f}"),
                                ("tokens_per_sec_with_padding", "tokens/s incl. padding", "{:,.0f}"),
                                ("seconds_per_step", "s per optimizer step", "{:.3f}"),
                                ("median_step_seconds", "median s per step", "{:.3f}"),
                                ("peak_rss_mib", "peak RSS (MiB)", "{:,.0f}")):
            tk = summary.get("toolkit", {}).get(key)
            lg = summary.get("litgpt", {}).get(key)
            if (tk is None and lg is None) or (mode == "lora" and key == "median_step_seconds"):
                continue  # LoRA steps hold different tokens in each tool: their median step says little
            ratio = ""
            if tk and lg:
                ratio = f"{(lg / tk if 'seconds' in key else tk / lg):.2f}x"
            rows.append((mode, label, fmt.format(tk) if tk is not None else "-", fmt.format(lg) if lg is not None else "-", ratio))
    if "help" in results:
        h = results["help"]
        lg = h.get("litgpt", {}).get("median_seconds")
        tk = h.get("toolkit", {}).get("median_seconds")
        rows.append(("--help", "seconds", f"{tk:.3f}" if tk else "-", f"{lg:.3f}" if lg else "-",
                     f"{lg / tk:.0f}x faster" if lg and tk else ""))
        sub = h.get("subcommand", {})
        tk, lg = sub.get("toolkit", {}).get("median_seconds"), sub.get("litgpt", {}).get("median_seconds")
        if tk:
            rows.append(("pretrain --help", "seconds", f"{tk:.3f}", f"{lg:.3f}" if lg else "-",
                         f"{lg / tk:.2f}x" if lg else ""))
    if not rows:
        return
    widths = [max(len(r[i]) for r in rows + [("mode", "figure", "toolkit", "litgpt", "ratio")]) for i in range(5)]
    header = ("mode", "figure", "toolkit", "litgpt", "ratio")
    print()
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))


def goals(results: dict) -> dict:
    out = {}
    if "ratios" in results.get("pretrain", {}):
        r = results["pretrain"]["ratios"]
        out["pretrain_throughput_ratio"] = {"value": r["real_tokens_per_sec"], "goal": f">= {GOALS['pretrain_tokens_per_sec']}",
                                            "met": r["real_tokens_per_sec"] >= GOALS["pretrain_tokens_per_sec"]}
        out["pretrain_peak_rss_ratio"] = {"value": r["peak_rss"], "goal": "<= 1.0", "met": r["peak_rss"] <= 1.0}
    if "ratios" in results.get("lora", {}):
        r = results["lora"]["ratios"]
        out["lora_real_token_throughput_ratio"] = {"value": r["real_tokens_per_sec"], "goal": f">= {GOALS['lora_real_tokens_per_sec']}",
                                                   "met": r["real_tokens_per_sec"] >= GOALS["lora_real_tokens_per_sec"]}
        out["lora_peak_rss_ratio"] = {"value": r["peak_rss"], "goal": "<= 1.0", "met": r["peak_rss"] <= 1.0}
    if "help" in results:
        s = results["help"]["toolkit"]["median_seconds"]
        out["toolkit_help_seconds"] = {"value": s, "goal": "< 1.0", "met": s < GOALS["toolkit_help_seconds"]}
    return out


def machine_info() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        info["cpu"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
        info["memory_gib"] = round(int(next(line.split()[1] for line in open("/proc/meminfo") if line.startswith("MemTotal"))) / 2**20, 1)
    except (OSError, StopIteration):
        pass
    # This interpreter's environment: the installed versions from package metadata (importing torch
    # and Lightning only to print them would cost a process and seconds of CPU per call).
    from importlib.metadata import version

    info["toolkit_env"] = f"torch {version('torch')} lightning-fabric {version('lightning-fabric')}"
    return info


def parse_args(argv: list[str]):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["pretrain", "lora", "help", "all"])
    p.add_argument("--tool", choices=["toolkit", "litgpt", "both"], default="both")
    p.add_argument("--data", choices=["files", "synthetic"], default="files",
                   help="files: the shared text/instruction files; synthetic: random tokens, toolkit only, in one "
                        "process with the toolkit's loop (no litdata; for GPUs)")
    p.add_argument("--model", "--preset", dest="model", default="pythia-14m")
    p.add_argument("--model_overrides", default=None,
                   help="pretrain: the toolkit's --model_overrides (JSON), a shape beside the preset's")
    p.add_argument("--litgpt_model_config", type=Path, default=None,
                   help="pretrain: a `litgpt pretrain --config` YAML whose model_config replaces the model name "
                        "for LitGPT: the same shape as the toolkit's preset with --model_overrides")
    p.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, bf16-true (the same for both tools)")
    p.add_argument("--device", default="cpu", help="synthetic mode only: cpu or cuda")
    p.add_argument("--micro_batch", type=int, default=4)
    p.add_argument("--global_batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--warmup", type=int, default=2, help="optimizer steps left out of the measurement")
    p.add_argument("--steps", type=int, default=None, help="measured optimizer steps (default: 8 pretrain, 30 lora)")
    p.add_argument("--repeat", type=int, default=1, help="paired runs (the order alternates); medians are reported")
    p.add_argument("--help_repeat", type=int, default=10)
    p.add_argument("--mask_prompt", type=lambda s: s.lower() in ("1", "true", "yes"), default=True,
                   help="LoRA: leave the prompt out of the loss (both tools); default true")
    p.add_argument("--compile", choices=["true", "false"], default="true",
                   help="the toolkit's --train.compile: true (compiled blocks) or false (eager, the CPU default)")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the training processes")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--peak_flops", type=float, default=None, help="synthetic mode: device peak FLOP/s for MFU")
    p.add_argument("--no_prepare", dest="prepare", action="store_false",
                   help="pretrain: skip the unmeasured first run that fills both tools' token caches")
    p.add_argument("--shared", type=Path, default=DEFAULT_SHARED, help="folder with tinyshakespeare.txt, tokenizers/, instruct/")
    p.add_argument("--litgpt", default=DEFAULT_LITGPT, help="the litgpt executable (in its own virtual environment)")
    p.add_argument("--work_dir", type=Path, default=Path("/tmp/toolkit-train-bench"))
    p.add_argument("--results", type=Path, default=None, help="JSON file for the results (default: <work_dir>/results.json)")
    args = p.parse_args(argv)
    args.tools = ["toolkit", "litgpt"] if args.tool == "both" else [args.tool]
    args.work_dir = args.work_dir.resolve()
    args.shared = args.shared.resolve()
    if args.global_batch % args.micro_batch:
        p.error("--global_batch must be a multiple of --micro_batch")
    if args.data == "synthetic" and (args.tool != "toolkit" or args.mode not in ("pretrain",)):
        p.error("--data synthetic runs the toolkit's pretraining only: pass pretrain --tool toolkit")
    if args.device != "cpu" and args.data != "synthetic":
        p.error("--device applies to --data synthetic (the command-line runs pick the device themselves)")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_synthetic_worker":
        return synthetic_worker(argv[1:])
    args = parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "command": "python benchmarks/train_throughput.py " + " ".join(argv),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine_info(),
        "config": {"model": args.model, "model_overrides": args.model_overrides,
                   "litgpt_model_config": str(args.litgpt_model_config or ""), "precision": args.precision,
                   "micro_batch": args.micro_batch,
                   "global_batch": args.global_batch, "seq": args.seq, "warmup_steps": args.warmup,
                   "repeat": args.repeat, "compile": args.compile, "mask_prompt": args.mask_prompt},
    }
    if "litgpt" in args.tools:
        out = subprocess.run([litgpt_python(args), "-c", "from importlib.metadata import version as v; "
                              "print('litgpt', v('litgpt'), 'torch', v('torch'), 'lightning', v('lightning'))"],
                             capture_output=True, text=True)
        results["machine"]["litgpt_env"] = out.stdout.strip()
    modes = ["pretrain", "lora", "help"] if args.mode == "all" else [args.mode]
    for mode in modes:
        print(f"{mode}:", flush=True)
        if mode == "help":
            results["help"] = time_help(args)
            continue
        steps_given = args.steps
        if steps_given is None:
            args.steps = 8 if mode == "pretrain" else 30
        results["config"][f"{mode}_steps"] = args.steps
        if args.data == "synthetic":
            results["synthetic"] = run_synthetic(args)
        else:
            results[mode] = run_training(args, mode)
        args.steps = steps_given
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    results["goals"] = goals(results)
    path = args.results or args.work_dir / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    for name, goal in results["goals"].items():
        print(f"  {name}: {goal['value']} (goal {goal['goal']}): {'met' if goal['met'] else 'NOT met'}")
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
