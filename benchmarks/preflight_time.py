"""Time of the start-up memory pre-flight (`toolkit.memory.check_fits`) at Llama-3.1-70B, and at
gpt-oss-120b (`--model gpt-oss-120b`: config_hub's LoRA recipe, 2 x 2048 tokens, expert parallel 8;
its sinks run through chunked attention, recorded on fake tensors).

Each case runs in a fresh process, as a training start does: the first call pays for building the
model on the meta device (every parameter) and recording its blocks and loss on fake tensors; a
second call with other settings reuses both. With `--after-lightning` the process imports Lightning
first, as a training run has before the pre-flight (it imports torch._dynamo, which the meta
device's initialisers would otherwise import on first use). `--root` times another checkout of the
toolkit (e.g. a `git worktree` of an older commit) with this script. Results in benchmarks/README.md.

    python benchmarks/preflight_time.py [--after-lightning] [--model gpt-oss-120b] [--root DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "llama-3.1-70b": {
        "pretraining, FULL_SHARD on 8": dict(finetune=None, checkpointing=False),
        "full fine-tuning, checkpointing, FULL_SHARD on 8": dict(finetune="full", checkpointing=True),
        "LoRA, checkpointing, FULL_SHARD on 8": dict(finetune="lora", checkpointing=True),
    },
    # config_hub/finetune/gpt-oss-120b/lora.yaml: micro-batches 2 (the recipe's) then 1
    "gpt-oss-120b": {
        "LoRA on attention and experts, checkpointing, FULL_SHARD on 8, expert parallel 8": dict(
            finetune="lora", checkpointing=True, expert_parallel=8, micro=(2, 1), lora_args=dict(
                r=16, alpha=32, dropout=0.0, targets=("query", "key", "value", "projection", "experts"))),
    },
}

CHILD = """
import json, sys, time
sys.path.insert(0, {root!r})
if {lightning}:
    import lightning_fabric  # noqa: F401
if {lora}:
    import peft  # noqa: F401  (finetune_lora has imported it)
from toolkit.errors import UserError
from toolkit.memory import check_fits
from toolkit.models.config import Config
from toolkit.models.adapters import LoRAArgs

config = Config.from_name({model!r})
lora = LoRAArgs(**{lora_args!r}) if {lora} else None
times = []
for micro in {micro!r}:
    start = time.perf_counter()
    try:
        check_fits(80 * 10**9, config, 8, 1, micro, 2048, "bf16-mixed", "FULL_SHARD", {checkpointing},
                   finetune={finetune!r}, lora=lora, expert_parallel={expert_parallel!r})
    except UserError:
        pass
    times.append(time.perf_counter() - start)
print(json.dumps(times))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--after-lightning", action="store_true")
    parser.add_argument("--model", choices=list(CASES), default="llama-3.1-70b")
    parser.add_argument("--root", type=Path, default=ROOT, help="the toolkit checkout to time (default: this one)")
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    load = os.getloadavg()[0]
    for name, case in CASES[args.model].items():
        code = CHILD.format(root=str(args.root.resolve()), lightning=args.after_lightning, model=args.model,
                            lora=case["finetune"] == "lora", checkpointing=case["checkpointing"],
                            finetune=case["finetune"], lora_args=case.get("lora_args", {}),
                            expert_parallel=case.get("expert_parallel", 1), micro=case.get("micro", (1, 2)))  # fmt: skip
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        first, second = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{name:50s} first call {first:5.2f} s, another micro-batch {second:5.2f} s")
    print(f"load average at the start: {load:.1f}")


if __name__ == "__main__":
    main()
