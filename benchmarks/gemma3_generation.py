"""Prefill and decode tokens per second for a Gemma 3 shape, the toolkit beside transformers.

    OMP_NUM_THREADS=1 python benchmarks/gemma3_generation.py                      # gemma-3-270m shape
    OMP_NUM_THREADS=1 python benchmarks/gemma3_generation.py --prompt 1024 --new 32 --repeats 1

The `gemma-3-270m` preset's shape (18 layers, 15 local with a 512-token window and 3 global,
640 wide, 4 query heads and 1 key/value head of 256, vocabulary 262144), random weights, float32,
batch 1, on the CPU. Prefill: one forward pass of a --prompt token prompt into an empty KV cache
(the prompt is longer than the window, so local layers attend to their window only). Decode:
--new tokens one at a time, greedy, each a forward pass of one token through the cache (the
toolkit's KV cache, as `toolkit.sampling.generate_tokens` runs it; transformers' default cache, as
`generate` runs it, without `generate`'s own bookkeeping). Prefill and decode are timed apart.
Each figure is the median of --repeats, the two tools alternating which goes first. Weights
differ between the two (both random): the work does not depend on their values.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from toolkit.convert import config_to_hf  # noqa: E402
from toolkit.models.config import Config  # noqa: E402
from toolkit.models.gpt import GPT, init_weights  # noqa: E402


def toolkit_run(model, prompt: torch.Tensor, new: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds for `new` tokens): the prompt into an empty KV cache, then one
    token at a time, greedy, as `toolkit.sampling.generate_tokens` runs them."""
    with torch.no_grad():
        model.set_kv_cache(1, prompt.numel() + new)
        t0 = time.perf_counter()
        logits = model(prompt[None], input_pos=0, logits_to_keep=1)[0, -1]
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        for position in range(prompt.numel(), prompt.numel() + new):
            logits = model(logits.argmax().view(1, 1), input_pos=position)[0, -1]
        decode = time.perf_counter() - t0
        model.clear_kv_cache()
    return prefill, decode


def transformers_run(model, prompt: torch.Tensor, new: int) -> tuple[float, float]:
    """The same with transformers' model and its default cache (what `generate` runs, without its
    bookkeeping around the forward passes)."""
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(prompt[None], use_cache=True, logits_to_keep=1)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        cache, logits = out.past_key_values, out.logits[0, -1]
        for _ in range(new):
            out = model(logits.argmax().view(1, 1), past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[0, -1]
        decode = time.perf_counter() - t0
    return prefill, decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no_transformers", action="store_true")
    args = parser.parse_args()
    import transformers

    config = Config.from_name(args.model)
    print(f"{config.name}: torch {torch.__version__}, transformers {transformers.__version__}, threads "
          f"{os.environ.get('OMP_NUM_THREADS', 'default')}, prompt {args.prompt}, new {args.new}, float32; "
          "load average %.2f %.2f %.2f" % os.getloadavg(), flush=True)
    torch.manual_seed(0)
    ours = GPT(config).eval()
    init_weights(ours, config.n_layer, seed=0)
    tools = {"toolkit": (ours, toolkit_run)}
    if not args.no_transformers:
        hf_config = transformers.AutoConfig.for_model(**config_to_hf(config))
        theirs = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
        tools["transformers"] = (theirs, transformers_run)
    prompt = torch.randint(0, config.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(1))
    for model, run in tools.values():  # warm-up
        run(model, prompt[:64], 4)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in tools}
    for repeat in range(args.repeats):
        order = list(tools) if repeat % 2 == 0 else list(tools)[::-1]
        for name in order:
            model, run = tools[name]
            results[name].append(run(model, prompt, args.new))
            prefill, decode = results[name][-1]
            print(f"{name}: prefill {args.prompt / prefill:.0f} tokens/s, decode {args.new / decode:.1f} tokens/s", flush=True)
    print("load average %.2f %.2f %.2f" % os.getloadavg())
    print("\n| tool | prefill tokens/s | decode tokens/s |")
    print("| --- | --- | --- |")
    for name, runs in results.items():
        prefill = statistics.median(args.prompt / p for p, _ in runs)
        decode = statistics.median(args.new / d for _, d in runs)
        print(f"| {name} | {prefill:.0f} | {decode:.1f} |")


if __name__ == "__main__":
    main()
