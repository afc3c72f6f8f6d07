"""Packing (--data.packing) against length-grouped batches: padding fraction and real tokens per second.

    python benchmarks/packing.py                    # Alpaca and ShareGPT from /work/shared/data
    python benchmarks/packing.py --attention        # the attention paths for packed rows, alone
    python benchmarks/packing.py --compile          # packed rows through compiled blocks, new layouts

Training data: Alpaca (`instruct/alpaca_en_demo.json`, 999 records, alpaca prompt style) and
ShareGPT conversations (`instruct/fastchat_dummy_conversation.json`, 500, llama-2 chat template),
tokenized with the Llama-2 tokenizer through the toolkit's own data modules (`Alpaca`, `Chat`).

For each data set the script builds the loader twice from the same samples: length-grouped
(`group_by_length`, the default) and packed (`packing`). It reports
- padding fraction: padded positions / all positions over one epoch's batches (the loader's own
  `padding_fraction`, the figure the training log prints);
- real tokens/s: input tokens that are not padding, per second of training steps (forward with the
  summed loss, backward, AdamW step; full fine-tuning of the tiny `debug-llama2` model (block_size raised to max_seq_length), float32,
  on CPU), over the first --batches micro-batches after one warm-up batch. The two runs of a pair
  follow each other, their order alternating between repeats; the median of the repeats is shown.
The machine's load average is printed before and after: on a shared machine it says how far the
timings can be trusted.

--attention times one attention layer's forward + backward over rows of T tokens holding 8
samples: causal SDPA over the whole row (what unpacked rows cost), SDPA with a block-diagonal
boolean mask, one causal SDPA call per sample (what `GPT.forward` does with document_ids), and
flex_attention with a block mask (compiled; forward only: torch 2.13 has no flex backward on CPU).

--compile trains `debug-llama2` (full fine-tuning, float32) on --layouts packed batches of 4 rows
of 512 tokens, each batch a packing layout not seen before (2 to 9 samples per row, cut at random),
eager and with compiled blocks (dynamic shapes, as fine-tuning compiles), and reports each step's
time, the graphs compiled so far and the compile seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from toolkit.data.chat import Chat  # noqa: E402
from toolkit.data.instruct import Alpaca  # noqa: E402
from toolkit.models.attention import segment_attention  # noqa: E402
from toolkit.models.config import Config  # noqa: E402
from toolkit.models.gpt import GPT  # noqa: E402
from toolkit.tokenizer import Tokenizer  # noqa: E402
from toolkit.training.objectives import CausalLM, tokens_before_padding  # noqa: E402

SHARED = Path("/work/shared/data")


def load() -> str:
    return "load average %.2f %.2f %.2f" % os.getloadavg()


def data_module(name: str, packing: bool, tokenizer: Tokenizer, max_seq_length: int):
    if name == "alpaca":
        data = Alpaca(json_path=SHARED / "instruct/alpaca_en_demo.json", prompt_style="alpaca", val_split_fraction=0,
                      packing=packing)
    else:
        data = Chat(json_path=SHARED / "instruct/fastchat_dummy_conversation.json", chat_template="llama-2",
                    val_split_fraction=0, packing=packing)
    data.setup(tokenizer, max_seq_length, "llama-2-7b")
    return data


def train_rate(loader, n_batches: int, block_size: int, seed: int = 0) -> tuple[float, int, int]:
    """(real tokens/s, real tokens, padded positions) over n_batches training steps after one warm-up step."""
    torch.manual_seed(seed)
    model = GPT(Config.from_name("debug-llama2", block_size=block_size)).float().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = iter(loader)
    real = positions = 0
    start = None
    for i in range(n_batches + 1):
        batch = next(batches)
        if i == 1:
            start = time.perf_counter()
        loss = CausalLM()(model, batch).loss_sum
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= 1:
            real += int(tokens_before_padding(batch["labels"]))
            positions += batch["input_ids"].numel()
    return real / (time.perf_counter() - start), real, positions


def bench_data(args, tokenizer: Tokenizer) -> None:
    for name in args.data:
        modules = {packing: data_module(name, packing, tokenizer, args.max_seq_length) for packing in (False, True)}
        stats = modules[False].stats
        packed_rows = modules[True].train_dataloader(args.micro_batch_size, seed=1).samples
        # Length-grouped batches of as many samples as the packed batches hold on average: the same
        # tokens per step, so neither side gains from a larger batch.
        matched = max(1, round(args.micro_batch_size * len(modules[True]._train) / len(packed_rows)))
        runs = {
            f"grouped, {args.micro_batch_size} samples": (False, args.micro_batch_size),
            f"grouped, {matched} samples": (False, matched),
            f"packed, {args.micro_batch_size} rows": (True, args.micro_batch_size),
        }
        print(f"\n{name}: {stats['train_samples']} samples, mean length {stats['mean_length']:.0f}, longest "
              f"{stats['max_length']}, max_seq_length {args.max_seq_length}; {len(packed_rows)} packed sequences, "
              f"{stats['train_samples'] / len(packed_rows):.1f} samples each")
        rates = {run: [] for run in runs}
        for repeat in range(args.repeat):
            for run in (list(runs) if repeat % 2 == 0 else list(runs)[::-1]):
                packing, micro_batch_size = runs[run]
                loader = modules[packing].train_dataloader(micro_batch_size, seed=1 + repeat)
                rate, real, positions = train_rate(loader, min(args.batches, len(loader) - 1), args.max_seq_length)
                rates[run].append(rate)
                print(f"  repeat {repeat} {run:22s}: {rate:8.0f} real tokens/s ({real} real of {positions} positions) "
                      f"| {load()}")
        for run, (packing, micro_batch_size) in runs.items():
            loader = modules[packing].train_dataloader(micro_batch_size, seed=1)
            print(f"  {run:22s}: {len(loader):4d} batches/epoch, padding {100 * loader.padding_fraction(0):5.1f}%, "
                  f"median {statistics.median(rates[run]):8.0f} real tokens/s")


def time_ms(fn, n: int = 3) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e3


def bench_attention() -> None:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, H, D, docs = 2, 8, 64, 8
    compiled = torch.compile(flex_attention)
    for T in (512, 1024, 2048):
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, T, D, requires_grad=True) for _ in range(3))
        doc = (torch.arange(T) // (T // docs))[None].expand(B, T)
        causal = torch.arange(T)[:, None] >= torch.arange(T)[None]
        mask = ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]  # (B, 1, T, T)
        segments = torch.full((B, docs), T // docs)
        block_mask = create_block_mask(lambda b, h, qi, ki: (doc[b, qi] == doc[b, ki]) & (qi >= ki), B, None, T, T,
                                       device="cpu")
        reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).detach()
        per_sample = segment_attention(q, k, v, segments).detach()
        flex = compiled(q.detach(), k.detach(), v.detach(), block_mask=block_mask)
        row = {
            "causal row": time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()),
            "bool mask": time_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()),
            "per sample": time_ms(lambda: segment_attention(q, k, v, segments).sum().backward()),
            "flex fwd only": time_ms(lambda: compiled(q.detach(), k.detach(), v.detach(), block_mask=block_mask)),
            "bool mask fwd only": time_ms(
                lambda: F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), attn_mask=mask)),
        }
        diff = max(float((per_sample - reference).abs().max()), float((flex - reference).abs().max()))
        print(f"T={T:5d}: " + " | ".join(f"{k} {v:7.1f} ms" for k, v in row.items()) + f" | max diff {diff:.1e}")


def bench_compile(n_layouts: int) -> None:
    from torch._dynamo.utils import counters

    from toolkit.models.gpt import Block
    from toolkit.parallel.compile import compile_blocks, compile_seconds

    B, T = 4, 512
    generator = torch.Generator().manual_seed(0)
    batches = []
    for i in range(n_layouts):
        document_ids = torch.zeros(B, T, dtype=torch.int64)
        for row in range(B):
            for cut in torch.randperm(T - 1, generator=generator)[: 1 + (i + row) % 8] + 1:
                document_ids[row, cut:] += 1
        batches.append((torch.randint(0, 32000, (B, T), generator=generator), document_ids))
    for compiled in (False, True):
        torch.manual_seed(0)
        model = GPT(Config.from_name("debug-llama2", block_size=T)).float().train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if compiled:
            compile_blocks(model, Block, torch.device("cpu"), dynamic=True, print_fn=print)
        counters.clear()
        times = []
        for ids, document_ids in batches:
            start = time.perf_counter()
            model(ids, labels=ids, document_ids=document_ids).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
        graphs = counters["stats"]["unique_graphs"]
        print(f"{'compiled' if compiled else 'eager':8s}: step s " + " ".join(f"{t:.2f}" for t in times)
              + f" | graphs {graphs}, compiling {compile_seconds():.0f} s, median of the last 4 steps "
              f"{statistics.median(times[-4:]):.3f} s | {load()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", nargs="+", default=["alpaca", "sharegpt"], choices=["alpaca", "sharegpt"])
    parser.add_argument("--max_seq_length", type=int, default=1024)
    parser.add_argument("--micro_batch_size", type=int, default=4)
    parser.add_argument("--batches", type=int, default=20, help="timed training steps per run")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--attention", action="store_true", help="time the attention paths only")
    parser.add_argument("--compile", action="store_true", help="packed batches of new layouts through compiled blocks")
    parser.add_argument("--layouts", type=int, default=12, help="--compile: batches, each a new packing layout")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {load()}")
    if args.attention:
        bench_attention()
    elif args.compile:
        bench_compile(args.layouts)
    else:
        bench_data(args, Tokenizer(SHARED / "tokenizers/llama2"))
    print(f"done | {load()}")


if __name__ == "__main__":
    main()
