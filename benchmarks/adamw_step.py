"""One AdamW step over a model's weights, by torch's three implementations: fused (the toolkit's,
`toolkit.optim.make_adamw`), foreach (torch's default on CUDA) and the per-tensor loop (torch's
default on a CPU, and LitGPT's there).

The model is a toolkit preset (default: the small Gemma 3 shape of `litgpt_step.py`) with random
gradients; each implementation takes one untimed step (its state is created), then `--steps` timed
ones, in this process, in the order given, twice over.

    OMP_NUM_THREADS=1 python benchmarks/adamw_step.py
    OMP_NUM_THREADS=1 python benchmarks/adamw_step.py --model pythia-160m --steps 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def build(model_name: str):
    if model_name == "gemma3-small":
        import litgpt_step

        return litgpt_step.build("toolkit", "gemma3-small", torch.float32, 512)[0]
    from toolkit.models.config import Config
    from toolkit.models.gpt import GPT

    return GPT(Config.from_name(model_name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-small", help="gemma3-small or a toolkit preset")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    from toolkit.args import TrainArgs
    from toolkit.optim import decay_names, make_adamw

    torch.manual_seed(0)
    model = build(args.model)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    makers = {
        "fused": lambda: make_adamw(model, decay_names(model), TrainArgs(learning_rate=1e-4)),
        "foreach": lambda: torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True),
        "loop": lambda: torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False),
    }
    seconds: dict[str, list[float]] = {name: [] for name in makers}
    for _ in range(2):
        for name, make in makers.items():
            optimizer = make()
            optimizer.step()
            for _ in range(args.steps):
                start = time.perf_counter()
                optimizer.step()
                seconds[name].append(time.perf_counter() - start)
    result = {
        "model": args.model,
        "parameters": sum(p.numel() for p in model.parameters()),
        "threads": torch.get_num_threads(),
        "median_step_s": {name: statistics.median(times) for name, times in seconds.items()},
        "steps_s": seconds,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
