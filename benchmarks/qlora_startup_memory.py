"""Start-up host memory of QLoRA with `--quantize nf4`, per rank, on 1 and 2 processes.

Issue 21 asks that start-up peak host memory per rank stay below the rank's share of the quantized
base plus a fixed chunk, and that no rank ever hold the bf16 base. This builds a Llama-shaped
toolkit checkpoint with a few hundred MB of random bf16 weights in a temporary folder (16 blocks of
width 1024, grouped-query attention with 4 key/value heads, SwiGLU 4096, untied 32,000-token
embedding and head: 486 MiB of bf16 block weights, 617 MiB in all), and runs the real
`toolkit finetune_lora <checkpoint> --quantize nf4 --devices N` (one optimizer step of a 128-token micro-batch,
OMP_NUM_THREADS=1, gloo on CPU) for each N.

What is measured, from inside each rank (`Session.build_model`): the growth of the peak resident
set (VmHWM, reset to the current RSS when set-up begins, so after imports, process start, data
loading) over the RSS at that moment, up to the end of set-up (model built, quantized, sharded);
each rank's figure is all-gathered and printed by rank 0 ("Model set-up took ... GiB of host
memory per rank"). On CPU the model lives in host memory, so the growth includes what the rank
keeps (its shard of the model). It is compared with:

- the rank's share of the stored model: its NF4 bytes (printed by the run, "NF4 base bytes per
  rank") plus its shard of the bf16 embedding, norms and head and of the float32 adapters (the
  estimator's per-rank parameter bytes, `toolkit.memory.parameters.fsdp_rank_memory`, which the tests hold
  to the real NF4 bytes);
- the bf16 base: what a rank that read the whole checkpoint before quantizing would hold.

growth - share is the start-up's own chunk: one weight's rows in bf16 (the rank's rows under FSDP)
with torchao's quantization temporaries (a scaled copy, the codes, and its 16-way nearest-level
search over chunks of up to 2^20 values: about 70 bytes per value of the chunk, so up to ~75 MiB
whatever the model), plus allocator and library slack.

    python benchmarks/qlora_startup_memory.py                      # 1 and 2 processes
    python benchmarks/qlora_startup_memory.py --devices 2 --layers 32
    python benchmarks/qlora_startup_memory.py --toolkit-root /path/to/other/checkout   # compare a version

A few minutes on 2 CPU cores (quantization on the CPU is the slow part).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from toolkit.models.config import Config  # noqa: E402

TOKENIZER = REPO / "tests" / "assets" / "tokenizers" / "llama2"
MiB, GiB = 2**20, 2**30
SETUP_LINE = re.compile(r"^Model set-up took ([0-9., ]+) GiB of host memory per rank", re.M)
NF4_LINE = re.compile(r"^NF4 base bytes per rank: ([0-9, ]+)$", re.M)
LORA_TARGETS = ("query", "value")  # finetune_lora's default


def model_config(layers: int) -> Config:
    return Config(name="qlora-startup", vocab_size=32000, block_size=256, n_layer=layers, n_embd=1024, n_head=16,
                  n_query_groups=4, intermediate_size=4096)  # fmt: skip


def write_checkpoint(config: Config, folder: Path) -> dict[str, int]:
    """A toolkit checkpoint of random bf16 weights (the Llama-2 tokenizer of the test assets); its sizes."""
    import torch
    from safetensors.torch import save_file

    from toolkit.memory.parameters import parameter_specs

    folder.mkdir(parents=True)
    config.save(folder)
    generator = torch.Generator().manual_seed(0)
    specs = parameter_specs(config)
    weights = {s.name: (torch.randn(s.shape, generator=generator) * 0.02).to(torch.bfloat16) for s in specs}
    save_file(weights, str(folder / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TOKENIZER / name, folder / name)
    blocks = [s for s in specs if s.kind == "linear" and s.unit >= 0]
    return {
        "bf16_base": sum(2 * s.numel for s in specs),
        "bf16_blocks": sum(2 * s.numel for s in blocks),
        "largest_weight": max(s.numel for s in blocks),
    }


def write_data(path: Path) -> None:
    records = [{"instruction": f"Add {a} and {b}.", "input": "", "output": str(a + b)} for a in range(8) for b in range(8)]
    path.write_text(json.dumps(records))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(root: Path, checkpoint: Path, data: Path, out_dir: Path, devices: int) -> str:
    command = [
        sys.executable, "-m", "toolkit", "finetune_lora", str(checkpoint), "--out_dir", str(out_dir),
        "--quantize", "nf4", "--devices", str(devices), "--precision", "bf16-mixed",
        "--data", "Alpaca", "--data.json_path", str(data), "--data.val_split_fraction", "0.125",
        "--train.micro_batch_size", "1", "--train.global_batch_size", str(devices), "--train.max_seq_length", "128",
        "--train.max_steps", "1", "--train.save_interval", "null",
        "--eval.initial_validation", "false", "--eval.final_validation", "false", "--eval.interval", "100",
        "--log.loggers", "[csv]",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               PYTHONPATH=str(root), PYTHONWARNINGS="ignore")  # fmt: skip
    env.pop("LOCAL_RANK", None)
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        raise SystemExit(f"the run on {devices} process(es) failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result.stdout


def shares(config: Config, devices: int) -> list[int]:
    """Each rank's stored parameter bytes (NF4 blocks, bf16 rest, float32 adapters), as the estimator counts them."""
    from toolkit.memory import estimator as est

    modules = tuple(sorted({leaf for t in LORA_TARGETS for leaf in est.LORA_TARGETS[t]}))
    opts = est.Options(config, "bf16-mixed", "lora", modules, 8, "nf4", 128)
    specs = est.parameter_specs(config, modules, 8)
    column = est.make_column("single", 1, 1) if devices == 1 else est.make_column("FULL_SHARD", devices, 1)
    return [r["parameters"] for r in est.fsdp_rank_memory(specs, column, opts)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--toolkit-root", type=Path, default=REPO, help="the checkout whose toolkit runs")
    args = parser.parse_args(argv)

    config = model_config(args.layers)
    rows = []
    with tempfile.TemporaryDirectory(prefix="qlora-startup-") as tmp:
        sizes = write_checkpoint(config, Path(tmp) / "checkpoint")
        write_data(Path(tmp) / "data.json")
        print(f"model: {args.layers} blocks, bf16 base {sizes['bf16_base'] / MiB:.0f} MiB "
              f"(block weights {sizes['bf16_blocks'] / MiB:.0f} MiB, largest weight "
              f"{2 * sizes['largest_weight'] / MiB:.0f} MiB); toolkit from {args.toolkit_root}", flush=True)
        for devices in args.devices:
            log = run(args.toolkit_root, Path(tmp) / "checkpoint", Path(tmp) / "data.json", Path(tmp) / f"run-{devices}",
                      devices)  # fmt: skip
            growth = [float(g) * GiB for g in SETUP_LINE.search(log).group(1).split(",")]
            nf4 = [int(b) for b in NF4_LINE.search(log).group(1).split(",")]
            for rank, (grown, share, nf4_bytes) in enumerate(zip(growth, shares(config, devices), nf4)):
                rows.append((devices, rank, grown, nf4_bytes, share, sizes["bf16_base"]))
                print(f"{devices} process(es), rank {rank}: set-up grew the peak RSS by {grown / MiB:.0f} MiB; "
                      f"its share {share / MiB:.0f} MiB (NF4 {nf4_bytes / MiB:.0f} MiB)", flush=True)
    print()
    print("| processes | rank | peak RSS growth in set-up | rank's share of the stored model (NF4 part) | growth - share "
          "| bf16 base |")
    print("|---|---|---|---|---|---|")
    for devices, rank, grown, nf4_bytes, share, bf16 in rows:
        print(f"| {devices} | {rank} | {grown / MiB:.0f} MiB | {share / MiB:.0f} MiB ({nf4_bytes / MiB:.0f} MiB) | "
              f"{(grown - share) / MiB:.0f} MiB | {bf16 / MiB:.0f} MiB |")
    print("\nMiB = 2^20 bytes; the growth is read at 1 MiB resolution (the run prints GiB to 3 decimals).")


if __name__ == "__main__":
    main()
