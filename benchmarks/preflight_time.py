"""Time of the start-up memory pre-flight (`toolkit.memory.check_fits`) at Llama-3.1-70B.

Each case runs in a fresh process, as a training start does: the first call pays for building the
model on the meta device (every parameter) and recording its blocks and loss on fake tensors; a
second call with other settings reuses both. With `--after-lightning` the process imports Lightning
first, as a training run has before the pre-flight (it imports torch._dynamo, which the meta
device's initialisers would otherwise import on first use). Results in benchmarks/README.md.

    python benchmarks/preflight_time.py [--after-lightning]
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
    "pretraining, FULL_SHARD on 8": dict(finetune=None, checkpointing=False),
    "full fine-tuning, checkpointing, FULL_SHARD on 8": dict(finetune="full", checkpointing=True),
    "LoRA, checkpointing, FULL_SHARD on 8": dict(finetune="lora", checkpointing=True),
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

config = Config.from_name("llama-3.1-70b")
lora = LoRAArgs() if {lora} else None
times = []
for micro in (1, 2):
    start = time.perf_counter()
    try:
        check_fits(80 * 10**9, config, 8, 1, micro, 2048, "bf16-mixed", "FULL_SHARD", {checkpointing},
                   finetune={finetune!r}, lora=lora)
    except UserError:
        pass
    times.append(time.perf_counter() - start)
print(json.dumps(times))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--after-lightning", action="store_true")
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    load = os.getloadavg()[0]
    for name, case in CASES.items():
        code = CHILD.format(root=str(ROOT), lightning=args.after_lightning, lora=case["finetune"] == "lora",
                            checkpointing=case["checkpointing"], finetune=case["finetune"])  # fmt: skip
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        first, second = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{name:50s} first call {first:5.2f} s, another micro-batch {second:5.2f} s")
    print(f"load average at the start: {load:.1f}")


if __name__ == "__main__":
    main()
