"""Per-rank memory of expert parallelism on CPU processes: one process, two with plain FSDP, two
with `--distributed.expert_parallel 2`, on a small Qwen3-MoE-like shape.

    python benchmarks/expert_parallel.py --results benchmarks/results/expert-parallel.json

The shape is the qwen3-30b-a3b preset at a CPU's size: 4 layers of width 512 (48 of 2048), 8 query
heads of 64 over 2 key/value heads (32 of 128 over 4) with per-head QK norm, every layer a mixture
of 64 experts (128) of hidden width 256 (768) with 8 per token, an untied 32,000-token embedding
and head (the Llama-2 tokenizer of tests/assets; 151,936): 136 M parameters, 101 M of them in experts.

Each run is the toolkit's own `pretrain` command (32-true, micro-batch 1, global batch = processes,
256 tokens, a few steps, a checkpoint and the export at the end), measured per rank process by
`fsdp_memory.RankedRun`: the high-water mark of its resident memory (VmHWM) over model set-up,
over optimizer creation and every training step, over the checkpoint and over the export. The
parameter bytes per rank are read from its file of the training checkpoint (float32 parameters
and AdamW's two moments: a third of it is the parameters).

On two processes every rank holds half of every weight with or without expert parallelism (FSDP
shards what expert parallelism does not split); what expert parallelism removes is the gather:
without it, each MoE layer's forward and backward gathers all 64 experts' weights (25 M parameters,
101 MB in float32) and their unsharded gradients on every rank; with it, each rank gathers only
its 32 experts (here they are not sharded further: two ranks, two experts groups) and computes the
tokens of both ranks that chose them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fsdp_memory, train_throughput
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the toolkit's config code (no torch)

from fsdp_memory import RankedRun, checkpoint_rank_files, generate_text  # noqa: E402

from toolkit.models.config import Config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PRESET = "qwen3-30b-a3b"
SHAPE = {"vocab_size": 32000, "block_size": 4096, "n_layer": 4, "n_embd": 512, "n_head": 8, "n_query_groups": 2,
         "head_size": 64, "n_expert": 64, "moe_intermediate_size": 256}
RUNS = [  # (name, processes, expert_parallel)
    ("one process", 1, 1),
    ("2 processes, FSDP", 2, 1),
    ("2 processes, expert_parallel 2", 2, 2),
]
GiB, MiB = 2**30, 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=None, help="write every figure to this JSON file")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each process")
    parser.add_argument("--tokenizer", type=Path, default=REPO / "tests" / "assets" / "tokenizers" / "llama2")
    parser.add_argument("--work_dir", type=Path, default=None, help="default: a temporary folder, removed at the end")
    args = parser.parse_args()

    config = Config.from_name(PRESET, **SHAPE)
    experts = 3 * config.n_expert * config.moe_intermediate_size * config.n_embd * config.n_layer
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="expert-parallel-"))
    try:
        text = generate_text(work / "data" / "corpus.txt")
        results = []
        for name, devices, expert_parallel in RUNS:
            out = work / "runs" / f"{devices}-ep{expert_parallel}"
            shutil.rmtree(out, ignore_errors=True)
            command = [
                sys.executable, "-m", "toolkit", "pretrain", PRESET, "--model_overrides", json.dumps(SHAPE),
                "--tokenizer_dir", str(args.tokenizer), "--data", "TextFiles", "--data.train_path", str(text),
                "--data.cache_dir", str(work / "data" / "cache"), "--out_dir", str(out),
                "--devices", str(devices), "--distributed.sharding", "FULL_SHARD",
                "--distributed.expert_parallel", str(expert_parallel), "--precision", "32-true",
                "--train.micro_batch_size", "1", "--train.global_batch_size", str(devices),
                "--train.max_seq_length", str(args.seq), "--train.max_steps", str(args.steps), "--train.warmup_steps", "1",
                "--train.save_interval", "null", "--eval.initial_validation", "false", "--eval.final_validation", "false",
                "--eval.interval", "100000", "--log.interval", "1", "--log.loggers", "[csv]",
            ]
            print(f"  {name} ...", flush=True)
            env = {"OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO)}
            run = RankedRun(name, command, work / "logs" / f"{out.name}.log", devices, args.steps, env).run()
            files = checkpoint_rank_files(out, devices)
            run.update(devices=devices, expert_parallel=expert_parallel, checkpoint_rank_file_bytes=files,
                       parameter_bytes_per_rank=[f // 3 for f in files])
            results.append(run)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)

    summary = {"shape": {"preset": PRESET, **SHAPE}, "parameters": results[0]["parameters"],
               "expert_parameters": experts, "runs": results}
    print(f"\n{PRESET} with {json.dumps(SHAPE)}: {results[0]['parameters']:,} parameters, {experts:,} in experts")
    print("| run | parameter bytes per rank | set-up peak | training peak | checkpoint peak | export peak |")
    print("|---|---|---|---|---|---|")
    for run in results:
        peaks = run["peak_bytes"]

        def per_rank(values: list[int]) -> str:
            return " / ".join(f"{v / GiB:.2f}" for v in values) + " GiB"

        params = " / ".join(f"{b / MiB:.0f}" for b in run["parameter_bytes_per_rank"]) + " MiB"
        print(f"| {run['name']} | {params} | {per_rank(peaks['setup'])} | {per_rank(peaks['train'])} | "
              f"{per_rank(peaks['checkpoint'])} | {per_rank(peaks['export'])} |")
    loads = [run["load"]["before"][0] for run in results]
    print(f"load average before each run: {', '.join(f'{x:.1f}' for x in loads)}")
    if args.results is not None:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
