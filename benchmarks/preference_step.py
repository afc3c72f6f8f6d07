"""A DPO step against an SFT step of the same LoRA model, and the live reference against a precomputed one.

    python benchmarks/preference_step.py                      # Pythia 160M's shapes, CPU
    python benchmarks/preference_step.py --results benchmarks/results/preference_step.json

One process, one LoRA model (peft, finetune_lora's adapters: r 8 on query and value, no dropout),
float32 on the CPU, random weights and tokens: each pair is a prompt of `--prompt` tokens and two
responses of `--response` tokens. Per micro-batch of `--pairs` pairs (forward, backward, gradients
freed), through the toolkit's own objectives:

    sft (chosen)      `SFT` on the pairs' chosen sequences: the step supervised fine-tuning takes on the same data
    sft (2 rows)      `SFT` on both sequences of every pair: the same tokens as a DPO step
    dpo, live         `DPO` with the reference of finetune_lora: the same model, adapters switched off, under no_grad
    dpo, precomputed  `DPO` with the reference's log-probabilities looked up (`Precomputed`)
    precompute        the one pass that computes them (per micro-batch of pairs)

Time: the median over `--repeats` rounds (after one untimed round), the kinds in a rotated order each
round. Peak memory: the most bytes of the tensors a step makes alive at once (`peak_bytes`: its
activations, temporaries and gradients, on top of the weights; the process's peak RSS never falls,
so it cannot compare kinds run in one process). The load average is recorded with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from toolkit.models import IGNORE_INDEX  # noqa: E402
from toolkit.models.adapters import LoRAArgs  # noqa: E402
from toolkit.models.config import Config  # noqa: E402
from toolkit.models.gpt import GPT, init_weights  # noqa: E402
from toolkit.models.loss import loss_settings  # noqa: E402
from toolkit.training.objectives import SFT  # noqa: E402
from toolkit.training.preference_objectives import DPO  # noqa: E402
from toolkit.training.reference import AdaptersOff, Precomputed  # noqa: E402


def lora_model(config: Config):
    from peft import get_peft_model

    from toolkit.finetune.lora import init_adapters

    torch.manual_seed(0)
    model = GPT(config)
    init_weights(model, config.n_layer)
    model = get_peft_model(model, LoRAArgs(dropout=0.0).peft_config())
    init_adapters(model, 0)
    return model.train()


def pair_batch(pairs: int, prompt: int, response: int, vocab: int) -> dict:
    generator = torch.Generator().manual_seed(1)
    T = prompt + response
    ids = torch.randint(0, vocab, (2 * pairs, T + 1), generator=generator)
    ids[pairs:, :prompt] = ids[:pairs, :prompt]  # a pair shares its prompt
    labels = ids[:, 1:].clone()
    labels[:, : prompt - 1] = IGNORE_INDEX
    return {"input_ids": ids[:, :-1], "labels": labels, "pair_ids": torch.arange(pairs)}


def step(model, objective, batch) -> None:
    output = objective(model, batch)
    (output.loss_sum / output.normaliser).backward()
    model.zero_grad(set_to_none=True)


def peak_bytes(fn, existing) -> int:
    """The most bytes of tensor storage made by `fn` alive at once (what a step adds to the weights).

    A dispatch mode sees every op, in the backward pass too, the fused loss's included; a storage
    counts from the op that made it until it is freed; the storages of `existing` (the weights, the
    batch) and their views do not. (torch 2.13's MemTracker cannot follow a model with frozen
    weights: it hooks every parameter's gradient.)"""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    from toolkit.memory.activations import flat_tensors

    class LivePeak(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: set[int] = {t.untyped_storage()._cdata for t in existing}
            self.live = self.peak = 0

        def freed(self, key: int, nbytes: int) -> None:
            self.live -= nbytes
            self.seen.discard(key)  # the address may come back for another storage

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in flat_tensors(out):
                storage = t.untyped_storage()
                if storage._cdata not in self.seen:
                    self.seen.add(storage._cdata)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self.freed, storage._cdata, storage.nbytes())
            return out

    tracker = LivePeak()
    with tracker:
        fn()
    return tracker.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="pythia-160m")
    parser.add_argument("--n_layer", type=int, default=12)
    parser.add_argument("--pairs", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=96)
    parser.add_argument("--response", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--results", type=Path)
    args = parser.parse_args()
    # The fused loss's chunk buffers made at each call, as on a GPU (a CPU run keeps them between
    # calls, which would hide them from `peak_bytes`).
    with loss_settings(reuse_scratch=False):
        measure(args)


def measure(args) -> None:
    config = Config.from_name(args.preset, n_layer=args.n_layer)
    model = lora_model(config)
    batch = pair_batch(args.pairs, args.prompt, args.response, config.vocab_size)
    chosen = {"input_ids": batch["input_ids"][: args.pairs], "labels": batch["labels"][: args.pairs]}
    both = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    live = DPO(beta=0.1)
    live.reference = AdaptersOff()
    with torch.no_grad():
        table = AdaptersOff().log_probs(model, batch).view(2, -1).t().contiguous()  # (pairs, 2)
    precomputed = DPO(beta=0.1)
    precomputed.reference = Precomputed({"train": table}, Path("(in memory)"))

    def precompute() -> None:
        with torch.no_grad():
            AdaptersOff().log_probs(model, batch)

    kinds = {
        "sft (chosen)": lambda: step(model, SFT(), chosen),
        "sft (2 rows)": lambda: step(model, SFT(), both),
        "dpo, live": lambda: step(model, live, batch),
        "dpo, precomputed": lambda: step(model, precomputed, batch),
        "precompute": precompute,
    }
    for run in kinds.values():  # untimed: first-call allocations, the fused loss's scratch buffers
        run()
    times: dict[str, list[float]] = {name: [] for name in kinds}
    names = list(kinds)
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            kinds[name]()
            times[name].append(time.perf_counter() - start)
    existing = [*model.parameters(), *model.buffers(), *batch.values(), table]
    peaks = {name: peak_bytes(run, existing) for name, run in kinds.items()}
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = {name: {"seconds": statistics.median(times[name]), "peak_MiB": peaks[name] / 2**20} for name in kinds}
    base = rows["sft (chosen)"]
    print(f"{config.name} with {args.n_layer} blocks ({parameters / 2**20:.0f} MiB of float32 weights), LoRA r 8 on "
          f"query and value, {args.pairs} pairs of {args.prompt} + {args.response} tokens per micro-batch, "
          f"CPU float32, load average {os.getloadavg()[0]:.1f}")
    print(f"{'step':<18}{'s / micro-batch':>16}{'x sft (chosen)':>16}{'peak MiB':>10}{'x sft (chosen)':>16}")
    for name, row in rows.items():
        print(f"{name:<18}{row['seconds']:>16.3f}{row['seconds'] / base['seconds']:>16.2f}"
              f"{row['peak_MiB']:>10.0f}{row['peak_MiB'] / base['peak_MiB']:>16.2f}")
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps({"args": vars(args) | {"results": str(args.results)}, "rows": rows,
                                            "load_average": os.getloadavg()[0]}, indent=2) + "\n")


if __name__ == "__main__":
    main()
