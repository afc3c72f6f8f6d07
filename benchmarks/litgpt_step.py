"""One training step, the toolkit against LitGPT 0.5.13, on the same small shape: Qwen3-MoE, Mixtral or Gemma 3.

Each measurement is a fresh process of one tool (LitGPT runs from its own virtual environment: see
"Installing LitGPT next to the project" in benchmarks/README.md). A process builds the model with
random weights, runs warm-up steps, then times `--steps` optimizer steps (forward, loss, backward,
AdamW) on random tokens and prints its median step time and peak RSS. Each tool steps with its own
AdamW: the toolkit's `make_adamw` (fused), LitGPT's as `litgpt pretrain` builds it (fused only on CUDA). The two tools alternate,
pair by pair, so that a change of load on the machine hits both.

    OMP_NUM_THREADS=1 python benchmarks/litgpt_step.py --shape qwen3-moe --pairs 5 --dtype bfloat16
    OMP_NUM_THREADS=1 python benchmarks/litgpt_step.py --shape mixtral --pairs 5 --dtype float32
    OMP_NUM_THREADS=1 python benchmarks/litgpt_step.py --shape gemma3-small --pairs 3 --dtype bfloat16 --autocast

`--autocast` keeps the weights in float32 and runs forward and loss under `torch.autocast` in
`--dtype` (bf16-mixed, both tools' default training precision); without it every weight is in
`--dtype` (bf16-true or 32-true).

The shapes (`SHAPES`), sequences of `--seq_len` tokens (512), 2 per micro-batch:
- qwen3-moe: Qwen3-30B-A3B scaled down: 4 layers, 512 wide, 8 heads of 64 (2 key/value groups), QK
  norm, 64 experts of width 192 with 8 per token, renormalised (its norm_topk_prob); vocabulary 32,000.
- mixtral: 4 layers, 256 wide, 4 heads (2 key/value groups), 8 experts of width 512, 2 per token;
  vocabulary 32,000.
- gemma3-small: the toolkit's `gemma-3-270m` preset with benchmarks/configs/gemma3-small.json over
  it, and LitGPT's Config from benchmarks/configs/gemma3-small-litgpt.yaml: 6 layers (5 local with a
  128-token window, 1 global), 256 wide, 4 heads of 64 (1 key/value group), QK norm, sandwich norms,
  tanh GeGLU of 1,024, vocabulary 50,304, an untied head; each tool's own initialisation.
For the MoE shapes both tools' models compute the same function (LitGPT's router takes the softmax
of the top-k logits, which is the renormalised top-k of the full softmax) with the same parameter
count and the same initial distribution (N(0, 0.02), residual projections scaled), so that both
routers spread tokens alike: the cost of a step on a CPU depends on how evenly tokens are routed.
Both run eagerly; the loss is each tool's own (LitGPT's `chunked_cross_entropy` over its logits,
the toolkit's fused head loss).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {
    "qwen3-moe": dict(vocab_size=32000, block_size=512, n_layer=4, n_embd=512, n_head=8, n_query_groups=2,
                      head_size=64, intermediate_size=192, n_expert=64, n_expert_per_token=8, norm_eps=1e-6, qk_norm=True),
    "mixtral": dict(vocab_size=32000, block_size=512, n_layer=4, n_embd=256, n_head=4, n_query_groups=2,
                    intermediate_size=512, n_expert=8, n_expert_per_token=2, norm_eps=1e-5, qk_norm=False),
    "gemma3-small": dict(vocab_size=50304, block_size=512),  # the rest: the two config files below
}
GEMMA3_TOOLKIT = ("gemma-3-270m", Path(__file__).resolve().parent / "configs" / "gemma3-small.json")
GEMMA3_LITGPT = Path(__file__).resolve().parent / "configs" / "gemma3-small-litgpt.yaml"
REPO = Path(__file__).resolve().parents[1]
LITGPT_PYTHON = Path(os.environ.get("LITGPT_PYTHON", "/tmp/litgpt-venv/bin/python"))


def build_gemma3(tool: str, block_size: int):
    """The gemma3-small shape in `tool`, at its own initialisation, and its loss function."""
    if tool == "litgpt":
        import yaml
        from litgpt.model import GPT, Config
        from litgpt.utils import chunked_cross_entropy

        model = GPT(Config(**{**yaml.safe_load(GEMMA3_LITGPT.read_text())["model_config"], "block_size": block_size}))

        def loss_fn(ids, targets):
            return chunked_cross_entropy(model(ids), targets)
        return model, loss_fn
    sys.path.insert(0, str(REPO))
    from toolkit.models.config import Config
    from toolkit.models.gpt import GPT, init_weights

    preset, overrides = GEMMA3_TOOLKIT
    config = Config.from_name(preset, **{**json.loads(overrides.read_text()), "block_size": block_size})
    model = GPT(config)
    init_weights(model, config.n_layer, seed=0)

    def loss_fn(ids, targets):
        return model(ids, labels=targets) / targets.numel()
    return model, loss_fn


def build(tool: str, shape_name: str, dtype, block_size: int):
    import torch

    torch.manual_seed(0)
    if shape_name == "gemma3-small":
        model, loss_fn = build_gemma3(tool, block_size)
        return model.to(dtype), loss_fn
    shape = dict(SHAPES[shape_name], block_size=block_size)
    qk_norm = shape.pop("qk_norm")
    if tool == "litgpt":
        from litgpt.model import GPT, Config
        from litgpt.utils import chunked_cross_entropy

        config = Config(name=shape_name, padded_vocab_size=shape.pop("vocab_size"), bias=False, norm_class_name="RMSNorm",
                        mlp_class_name="LLaMAMoE", rotary_percentage=1.0, parallel_residual=False, norm_qk=qk_norm,
                        moe_intermediate_size=shape["intermediate_size"], **shape)
        model = GPT(config)
        # the toolkit's initial distribution (`init_weights`: N(0, 0.02), the residual projections
        # scaled by 1 / sqrt(2 n_layer)), so that both routers start alike: LitGPT's default init gives
        # the router larger logits, which route most tokens to few experts, and fewer, larger products
        # cost less on a CPU than the balanced routing a trained router keeps
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() >= 2:
                    residual = name.endswith(".proj.weight")  # attention output, each expert's down projection
                    p.normal_(0.0, 0.02 / (2 * config.n_layer) ** 0.5 if residual else 0.02)
        model.to(dtype)

        def loss_fn(ids, targets):
            return chunked_cross_entropy(model(ids), targets)
    else:
        sys.path.insert(0, str(REPO))
        from toolkit.models.config import Config
        from toolkit.models.gpt import GPT, init_weights

        # the family names the weight map for conversion only; the computation is the fields'
        config = Config(name=shape_name, moe_intermediate_size=shape["intermediate_size"],
                        qk_norm="head" if qk_norm else None, **shape)
        model = GPT(config)
        init_weights(model, config.n_layer, seed=0)
        model.to(dtype)

        def loss_fn(ids, targets):
            return model(ids, labels=targets) / targets.numel()
    return model, loss_fn


def measure(tool: str, shape_name: str, dtype_name: str, steps: int, warmup: int, micro_batch: int,
            autocast: bool, seq_len: int) -> dict:
    import contextlib

    import torch

    dtype = getattr(torch, dtype_name)
    model, loss_fn = build(tool, shape_name, torch.float32 if autocast else dtype, seq_len)
    precision = contextlib.nullcontext if not autocast else (lambda: torch.autocast("cpu", dtype=dtype))
    shape = SHAPES[shape_name]
    if tool == "toolkit":  # the training AdamW (fused)
        from toolkit.args import TrainArgs
        from toolkit.optim import decay_names, make_adamw

        optimizer = make_adamw(model, decay_names(model), TrainArgs(learning_rate=1e-4))
    else:  # as `litgpt pretrain` builds it: fused only on CUDA
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=model_device(model).type == "cuda")
    generator = torch.Generator().manual_seed(1)
    T = seq_len
    times = []
    for step in range(warmup + steps):
        tokens = torch.randint(0, shape["vocab_size"], (micro_batch, T + 1), generator=generator)
        start = time.perf_counter()
        with precision():
            loss = loss_fn(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    parameters = sum(p.numel() for p in model.parameters())
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"tool": tool, "dtype": dtype_name, "autocast": autocast, "median_step_s": statistics.median(times), "steps_s": times,
            "parameters": parameters, "peak_rss_bytes": peak_rss, "loss": float(loss)}


def model_device(model):
    return next(model.parameters()).device


def run_one(tool: str, args) -> dict:
    python = str(LITGPT_PYTHON) if tool == "litgpt" else sys.executable
    cmd = [python, __file__, "--worker", tool, "--shape", args.shape, "--dtype", args.dtype, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--micro_batch", str(args.micro_batch), "--seq_len", str(args.seq_len)] + (["--autocast"] if args.autocast else [])
    out = subprocess.run(cmd, capture_output=True, text=True, cwd="/tmp" if tool == "litgpt" else REPO)
    if out.returncode:
        raise SystemExit(f"{tool} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-moe", choices=sorted(SHAPES))
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--autocast", action="store_true", help="float32 weights, forward and loss under autocast to --dtype")
    p.add_argument("--seq_len", type=int, default=512, help="tokens per sequence (the models' block size)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--micro_batch", type=int, default=2)
    p.add_argument("--worker", choices=["toolkit", "litgpt"], help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help="write every run and the summary as JSON here")
    args = p.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker, args.shape, args.dtype, args.steps, args.warmup, args.micro_batch, args.autocast, args.seq_len)))
        return
    runs, ratios = [], []
    for pair in range(args.pairs):
        order = ("toolkit", "litgpt") if pair % 2 == 0 else ("litgpt", "toolkit")
        result = {tool: run_one(tool, args) for tool in order}
        runs.append(result)
        ratio = result["litgpt"]["median_step_s"] / result["toolkit"]["median_step_s"]
        ratios.append(ratio)
        print(f"pair {pair}: toolkit {result['toolkit']['median_step_s']:.3f} s, litgpt {result['litgpt']['median_step_s']:.3f} s, "
              f"LitGPT / toolkit {ratio:.2f}; peak RSS toolkit {result['toolkit']['peak_rss_bytes'] / 2**20:.0f} MiB, "
              f"litgpt {result['litgpt']['peak_rss_bytes'] / 2**20:.0f} MiB", flush=True)
    summary = {
        "dtype": args.dtype, "autocast": args.autocast, "shape": args.shape, "sizes": SHAPES[args.shape], "micro_batch": args.micro_batch, "seq_len": args.seq_len, "steps": args.steps,
        "toolkit_median_s": statistics.median(r["toolkit"]["median_step_s"] for r in runs),
        "litgpt_median_s": statistics.median(r["litgpt"]["median_step_s"] for r in runs),
        "speedup_median_of_pairs": statistics.median(ratios), "speedups": ratios,
        "parameters": {t: runs[0][t]["parameters"] for t in ("toolkit", "litgpt")},
        "load_average": os.getloadavg(),
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
