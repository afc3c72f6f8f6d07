"""Measure the peak memory of one training step on CPU, for tests/test_estimate.py.

Method: the test starts this script in a fresh process with glibc's mmap threshold fixed at 64 KiB
(MALLOC_MMAP_THRESHOLD_), so every tensor larger than that gets its own mapping that goes back to
the OS when freed, and the resident set size (RSS) follows the live tensors closely. The script

1. imports torch and runs a tiny training step, so libraries, kernels and thread pools are loaded:
   its RSS is then the runtime baseline;
2. builds the model (float32, as `--precision 32-true`) and takes one step (forward, backward,
   AdamW with foreach=True as on GPUs), so that gradients and optimizer state exist: the steady
   state of training with gradient accumulation, which the estimate models. (Fabric's single-device
   strategy in 32-true only moves and wraps the module, allocating nothing; the script does without
   it to save the seconds of importing Lightning);
3. resets the kernel's RSS high-water mark (writing 5 to /proc/self/clear_refs) and takes a second
   step; the new high-water mark (VmHWM) minus the baseline is the step's peak;
4. wraps every block in activation checkpointing and measures a third step the same way.

It prints one JSON line: the baseline, the peak, and the exact bytes of parameters, gradients and
optimizer state it allocated.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True, help="model config as JSON")
    parser.add_argument("--micro-batch", type=int, required=True)
    parser.add_argument("--seq", type=int, required=True)
    args = parser.parse_args()

    import torch

    from toolkit.models.config import Config
    from toolkit.models.gpt import GPT, Block
    from toolkit.training.distributed import _checkpoint_blocks  # what training applies per block

    config = Config(**json.loads(args.config))

    def step(model, optimizer, ids) -> None:
        model(ids, ids).backward()
        optimizer.step()  # no zero_grad: gradients stay, as between accumulated micro-batches

    # 1. runtime baseline: the same code path on a tiny model
    tiny = Config.from_name("debug")
    model = GPT(tiny)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    step(model, optimizer, torch.randint(0, tiny.vocab_size, (1, 16)))
    _checkpoint_blocks(model, Block)  # loads the checkpointing code too
    step(model, optimizer, torch.randint(0, tiny.vocab_size, (1, 16)))
    del model, optimizer
    baseline = rss_kib("VmRSS")

    # 2. the model, one step to create gradients and optimizer state
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    ids = torch.randint(0, config.vocab_size, (args.micro_batch, args.seq))
    step(model, optimizer, ids)
    before = rss_kib("VmRSS")

    # 3. the measured step
    Path("/proc/self/clear_refs").write_text("5")
    step(model, optimizer, ids)
    peak = rss_kib("VmHWM")

    # 4. the same with activation checkpointing of every block (what the single-device strategy
    # applies with --distributed.activation_checkpointing true)
    _checkpoint_blocks(model, Block)
    Path("/proc/self/clear_refs").write_text("5")
    step(model, optimizer, ids)
    peak_checkpointed = rss_kib("VmHWM")

    params = list(model.parameters())
    states = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    print(json.dumps({
        "baseline": baseline * 1024,
        "steady": before * 1024,
        "peak": peak * 1024,
        "peak_checkpointed": peak_checkpointed * 1024,
        "parameters": sum(p.numel() * p.element_size() for p in params),
        "gradients": sum(p.grad.numel() * p.grad.element_size() for p in params),
        "optimizer_state": sum(t.numel() * t.element_size() for t in states),
        "threads": torch.get_num_threads(),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
