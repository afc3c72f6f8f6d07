"""Grouped against looped experts: forward + backward time of a small Qwen3-MoE-shaped model.

    OMP_NUM_THREADS=1 python benchmarks/moe_experts.py                       # float32 and bf16, 5 rounds
    OMP_NUM_THREADS=2 python benchmarks/moe_experts.py --threads 2 --experts 16 --tokens 512

`toolkit.models.moe.GroupedExperts` runs its experts either as two `torch._grouped_mm` products over
the routed rows sorted by expert ("grouped", the default where torch has the kernel), or as one
F.linear pair per expert ("loop", the reference and the fallback). The model: `GPT` with every layer
a mixture of experts in Qwen3-MoE's layout (QK norm, grouped-query attention, top-k renormalised),
n_embd 512, 8 heads (4 KV) of 64, 4 layers, a 2,048-token vocabulary (so that the head stays small
beside the experts), micro-batch 1; trained in the precision asked ("bf16": every weight bf16, as
bf16-true; "float32"). A step is one forward pass with the loss and its backward pass.

Paired and repeated: both backends live in one process on the same model and step through the same
batches, a new one at each step as in training (`--fixed_batch`: one batch throughout, whose routing
never changes, so that on a CPU every shape's oneDNN kernel stays compiled); each round
times `--repeats` steps of one backend after a warm-up step, then the other's, the order
alternating from round to round, so that the shared machine's drift falls on both. The median of
each backend's steps over the rounds, its range, and the median of the per-round ratios are
printed, with the load average before and after. The two backends' losses and gradients are
checked against each other first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

VOCAB = 2048  # small, so that the head stays small beside the experts


def model_and_batch(args, dtype):
    import torch

    from toolkit.models.config import Config
    from toolkit.models.gpt import GPT, init_weights

    config = Config(name="qwen3-moe-bench", vocab_size=VOCAB, block_size=args.tokens, n_layer=args.layers, n_embd=512,
                    n_head=8, n_query_groups=4, head_size=64, qk_norm="head", norm_eps=1e-6, intermediate_size=1536,
                    n_expert=args.experts, n_expert_per_token=args.top_k, moe_intermediate_size=args.expert_size)
    model = GPT(config)
    init_weights(model, config.n_layer, seed=0)
    model.to(dtype)
    ids = torch.randint(0, config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    return model, ids


def batch_streams(args, ids, names) -> dict:
    """For each variant its own iterator over one list of batches, so that every variant steps through
    the same batches in the same order: a new batch at each step (new routing, new heights of the
    experts' runs, as in training), or `ids` at every step with `--fixed_batch`."""
    import itertools

    import torch

    generator = torch.Generator().manual_seed(3)
    count = args.rounds * (args.repeats + 1)  # a warm-up step and the timed ones per round
    batches = [ids] if args.fixed_batch else [torch.randint(0, VOCAB, ids.shape, generator=generator) for _ in range(count)]
    return {name: itertools.cycle(batches) for name in names}


def step(model, batches, backend: str) -> float:
    from toolkit.models.moe import expert_backend

    ids = next(batches)
    start = time.perf_counter()
    with expert_backend(backend):
        loss = model(ids, labels=ids)
        loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def check(model, ids, dtype) -> float:
    """The largest difference between the backends' gradients, relative to the largest gradient."""
    import torch

    from toolkit.models.moe import expert_backend

    grads = {}
    for backend in ("grouped", "loop"):
        with expert_backend(backend):
            model(ids, labels=ids).backward()
        grads[backend] = torch.cat([p.grad.float().flatten() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    return float((grads["grouped"] - grads["loop"]).abs().max() / grads["loop"].abs().max())


def start(doc: str, dtypes: list[str], what: str = "") -> argparse.Namespace:
    """Parse the command line (the model's shape, threads, rounds; shared with expert_lora.py), set
    the threads, print the set-up line, with `what` after the model's sizes."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="*", default=dtypes, choices=["float32", "bf16"])
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (set OMP_NUM_THREADS alike)")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top_k", type=int, default=4)
    parser.add_argument("--expert_size", type=int, default=384, help="moe_intermediate_size")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2, help="timed steps of each variant per round, after a warm-up")
    parser.add_argument("--fixed_batch", action="store_true",
                        help="every step on one batch: the routing never changes (how the figures before 2026-11-27's second set were taken)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s) (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}), "
          f"{args.layers} MoE layers, n_embd 512, {args.experts} experts top-{args.top_k}, expert width "
          f"{args.expert_size}, {args.tokens} tokens{what}; load average %.2f %.2f %.2f" % os.getloadavg(), flush=True)
    return args


def paired_rounds(steps: dict[str, Callable[[], float]], rounds: int, repeats: int
                  ) -> tuple[dict[str, list[float]], list[dict[str, float]]]:  # fmt: skip
    """Time each variant's `steps[name]()` (one step, returns its seconds) `repeats` times after a
    warm-up step, variant after variant, the order reversed every other round so that the shared
    machine's drift falls on all of them. Returns every timed step per variant, and each round's
    median per variant (shared with expert_lora.py)."""
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    medians = []
    for round_ in range(rounds):
        this_round = {}
        for name in names if round_ % 2 == 0 else names[::-1]:
            steps[name]()  # warm-up
            got = [steps[name]() for _ in range(repeats)]
            times[name] += got
            this_round[name] = statistics.median(got)
        medians.append(this_round)
    return times, medians


def main() -> None:
    args = start(__doc__, ["float32", "bf16"])
    import torch

    print("| dtype | grouped | min - max | loop | min - max | loop / grouped (median of rounds) | gradients, max rel. difference |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in args.dtypes:
        dtype = {"float32": torch.float32, "bf16": torch.bfloat16}[name]
        model, ids = model_and_batch(args, dtype)
        difference = check(model, ids, dtype)
        streams = batch_streams(args, ids, ("grouped", "loop"))
        times, rounds = paired_rounds({b: partial(step, model, streams[b], b) for b in ("grouped", "loop")}, args.rounds,
                                      args.repeats)
        ratios = [medians["loop"] / medians["grouped"] for medians in rounds]
        g, lp = times["grouped"], times["loop"]
        print(f"| {name} | {1000 * statistics.median(g):.0f} ms | {1000 * min(g):.0f} - {1000 * max(g):.0f} | "
              f"{1000 * statistics.median(lp):.0f} ms | {1000 * min(lp):.0f} - {1000 * max(lp):.0f} | "
              f"{statistics.median(ratios):.2f}x ({min(ratios):.2f} - {max(ratios):.2f}) | {difference:.1e} |", flush=True)
    print("load average %.2f %.2f %.2f" % os.getloadavg())


if __name__ == "__main__":
    main()
