"""Whole-run peak resident memory per process of a small pretraining run on 1, 2 and 4 processes.

    python benchmarks/whole_run_peak.py                       # pythia-160m, 32-true, 1 2 4 processes
    python benchmarks/whole_run_peak.py --devices 1 2 --seq 256 --results /tmp/peak.json

Each run is `toolkit pretrain pythia-160m --precision 32-true` from random weights on a generated
text (micro-batch 1, sequence 128, 2 optimizer steps, FULL_SHARD over the processes, a checkpoint
and the final export included), OMP_NUM_THREADS=1. Small models show what does not fall with N
best: pythia-160m keeps 48% of its weights in the embedding and the head.

How it measures: the rank processes are found and their memory read as in `fsdp_memory.py` (whose
`RankedRun` this script drives): each phase (set-up, training, checkpoint, export) ends at a line of
rank 0's log, where every rank's VmHWM (the kernel's exact high-water mark of its resident set) is
read and reset. A rank's whole-run peak is the largest of its phase peaks; the process's start-up
(imports) comes before set-up and is below the set-up peak. The figure per N is the largest rank's,
and the ratio is that over the one-process run's peak.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_memory import RankedRun, generate_text  # noqa: E402
from train_throughput import machine_info, toolkit_command  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MiB = 2**20


def measure(args, devices: int) -> dict:
    out_dir = args.work_dir / f"run-{devices}"
    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    text = generate_text(args.work_dir / "data" / "corpus.txt")
    command = toolkit_command(args) + [
        "pretrain", args.model, "--tokenizer_dir", str(args.tokenizer),
        "--data", "TextFiles", "--data.train_path", str(text), "--data.cache_dir", str(args.work_dir / "data" / f"cache-{devices}"),
        "--out_dir", str(out_dir), "--devices", str(devices), "--distributed.sharding", "FULL_SHARD",
        "--precision", args.precision, "--train.micro_batch_size", "1", "--train.global_batch_size", str(devices),
        "--train.max_seq_length", str(args.seq), "--train.max_steps", str(args.steps), "--train.warmup_steps", "1",
        "--train.save_interval", str(args.steps), "--eval.initial_validation", "false", "--eval.final_validation", "false",
        "--eval.interval", "100000", "--log.interval", "1", "--log.loggers", "[csv]",
    ]  # fmt: skip
    run = RankedRun(f"{args.model}-{devices}", command, args.work_dir / "logs" / f"{devices}.log", devices, args.steps,
                    {"OMP_NUM_THREADS": str(args.threads)}).run()  # fmt: skip
    per_rank = [max(phase[rank] for phase in run["peak_bytes"].values()) for rank in range(devices)]
    run["whole_run_peak_bytes"] = per_rank
    run["phase_of_peak"] = [max(run["peak_bytes"], key=lambda p: run["peak_bytes"][p][rank]) for rank in range(devices)]
    return run


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="pythia-160m")
    p.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--precision", default="32-true")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokenizer", type=Path, default=REPO.parent / "shared" / "data" / "tokenizers" / "gpt-neox-20b")
    p.add_argument("--work_dir", type=Path, default=Path("/tmp/whole-run-peak"))
    p.add_argument("--results", type=Path, default=None, help="JSON file (default: <work_dir>/results.json)")
    args = p.parse_args(argv)
    if 1 not in args.devices:
        p.error("--devices must include 1: the ratios are against one process")
    args.work_dir = args.work_dir.resolve()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    runs = {n: measure(args, n) for n in args.devices}
    one = max(runs[1]["whole_run_peak_bytes"])
    print(f"{args.model}, {args.precision}, micro-batch 1, sequence {args.seq}, {args.steps} steps, export included")
    print("| processes | peak per process (MiB, by rank) | largest / one process | phase of the largest |")
    print("| ---: | --- | ---: | --- |")
    for n, run in runs.items():
        peaks = run["whole_run_peak_bytes"]
        largest = max(range(n), key=lambda r: peaks[r])
        print(f"| {n} | {', '.join(f'{b / MiB:,.0f}' for b in peaks)} | {max(peaks) / one:.2f}x | {run['phase_of_peak'][largest]} (rank {largest}) |")
    results = {"machine": machine_info(), "load_after": os.getloadavg(), "args": {k: str(v) for k, v in vars(args).items()},
               "runs": {str(n): r for n, r in runs.items()}}  # fmt: skip
    (args.results or args.work_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
