"""Batched generation of the lm_eval extension against lm-evaluation-harness's Hugging Face backend.

One random Llama (the extension tests' shape unless told otherwise) is written in Hugging Face
format and converted to a toolkit checkpoint; both backends then answer the same generate_until
requests (LAMBADA contexts from tests/assets, greedy, stop at '.', max_gen_toks tokens) with the
same batch size. Repeats alternate which backend runs first; each prints its wall-clock seconds,
and the answers of the two are compared (they must be identical).

    python benchmarks/lm_eval_generation.py --repeats 5 --batch_size 8
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--max_gen_toks", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from transformers import LlamaConfig, LlamaForCausalLM

    from extensions.lm_eval.model import ToolkitLM
    from toolkit.convert import convert_from_hf

    torch.set_num_threads(args.threads)
    tokenizer = REPO / "tests" / "assets" / "tokenizers" / "llama2"
    texts = [json.loads(line)["text"] for line in (REPO / "tests/assets/eval/lambada_test.jsonl").read_text().splitlines()]
    # 80 contexts: each document without its last word, and its first half.
    contexts = [" ".join(t.split(" ")[:-1]) for t in texts] + [" ".join(t.split(" ")[: len(t.split(" ")) // 2]) for t in texts]
    kwargs = {"until": ["."], "max_gen_toks": args.max_gen_toks, "do_sample": False}
    requests = [Instance(request_type="generate_until", doc={}, arguments=(c, dict(kwargs)), idx=i) for i, c in enumerate(contexts)]

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=32000, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.block_size, bos_token_id=1, eos_token_id=2,
        )
        LlamaForCausalLM(config).save_pretrained(root / "hf")
        for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(tokenizer / file, root / "hf" / file)
        convert_from_hf(root / "hf", root / "toolkit")
        backends = {
            "toolkit": ToolkitLM(root / "toolkit", device="cpu", precision="32-true", batch_size=args.batch_size),
            "harness-hf": HFLM(pretrained=str(root / "hf"), device="cpu", dtype="float32", batch_size=args.batch_size),
        }
        seconds = {name: [] for name in backends}
        answers = {}
        for repeat in range(args.repeats):
            order = list(backends) if repeat % 2 == 0 else list(backends)[::-1]
            for name in order:
                start = time.perf_counter()
                answers[name] = backends[name].generate_until(requests, disable_tqdm=True)
                seconds[name].append(time.perf_counter() - start)
            print(f"repeat {repeat}: " + ", ".join(f"{n} {seconds[n][-1]:.2f} s" for n in backends), flush=True)
        same = sum(a == b for a, b in zip(answers["toolkit"], answers["harness-hf"]))
        print(f"{len(requests)} generations, batch {args.batch_size}, max_gen_toks {args.max_gen_toks}, {args.threads} thread(s), "
              f"load average {os.getloadavg()[0]:.1f}")
        for name, values in seconds.items():
            print(f"  {name:10s} median {statistics.median(values):.2f} s  (min {min(values):.2f}, max {max(values):.2f})")
        print(f"  identical answers: {same}/{len(requests)}")


if __name__ == "__main__":
    main()
