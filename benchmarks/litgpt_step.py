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
    OMP_NUM_THREADS=1 python benchmarks/litgpt_step.py --part moe --shape qwen3-moe --pairs 5   # one MoE layer alone
    python benchmarks/litgpt_step.py --device cuda --litgpt_python python3 --shape qwen3-moe   # on a GPU (gpu_check.py)

`--part moe` times one MoE layer's forward and backward instead of a step, both tools' layers given
the same weights (`build_moe_layer`), new random rows at each step. `--device cuda` runs on a GPU
(both tools' AdamW fused there); `--tools toolkit` runs the toolkit alone where LitGPT is missing.

`--autocast` keeps the weights in float32 and runs forward and loss under `torch.autocast` in
`--dtype` (bf16-mixed, both tools' default training precision); without it every weight is in
`--dtype` (bf16-true or 32-true).

The shapes (`SHAPES`), sequences of `--seq_len` tokens (512), 2 per micro-batch:
- qwen3-moe: Qwen3-30B-A3B scaled down: 4 layers, 512 wide, 8 heads of 64 (2 key/value groups), QK
  norm, 64 experts of width 192 with 8 per token, renormalised (its norm_topk_prob); vocabulary 32,000.
- qwen3-moe-128: the same with Qwen3-30B-A3B's own count of experts, 128 (each 4x narrower than its
  2,048-wide model's 768, as the model is).
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
    "qwen3-moe-128": dict(vocab_size=32000, block_size=512, n_layer=4, n_embd=512, n_head=8, n_query_groups=2,
                          head_size=64, intermediate_size=192, n_expert=128, n_expert_per_token=8, norm_eps=1e-6,
                          qk_norm=True),
    "mixtral": dict(vocab_size=32000, block_size=512, n_layer=4, n_embd=256, n_head=4, n_query_groups=2,
                    intermediate_size=512, n_expert=8, n_expert_per_token=2, norm_eps=1e-5, qk_norm=False),
    "gemma3-small": dict(vocab_size=50304, block_size=512),  # the rest: the two config files below
}
MOE_SHAPES = ("qwen3-moe", "qwen3-moe-128", "mixtral")
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
    config = moe_config(tool, shape_name, block_size)
    if tool == "litgpt":
        from litgpt.model import GPT
        from litgpt.utils import chunked_cross_entropy

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
        from toolkit.models.gpt import GPT, init_weights

        model = GPT(config)
        init_weights(model, config.n_layer, seed=0)
        model.to(dtype)

        def loss_fn(ids, targets):
            return model(ids, labels=targets) / targets.numel()
    return model, loss_fn


def moe_config(tool: str, shape_name: str, block_size: int):
    """The MoE shape `shape_name` as `tool`'s Config."""
    shape = dict(SHAPES[shape_name], block_size=block_size)
    qk_norm = shape.pop("qk_norm")
    if tool == "litgpt":
        from litgpt.model import Config

        return Config(name=shape_name, padded_vocab_size=shape.pop("vocab_size"), bias=False, norm_class_name="RMSNorm",
                      mlp_class_name="LLaMAMoE", rotary_percentage=1.0, parallel_residual=False, norm_qk=qk_norm,
                      moe_intermediate_size=shape["intermediate_size"], **shape)
    sys.path.insert(0, str(REPO))
    from toolkit.models.config import Config

    # the family names the weight map for conversion only; the computation is the fields'
    return Config(name=shape_name, moe_intermediate_size=shape["intermediate_size"], qk_norm="head" if qk_norm else None,
                  **shape)


def build_moe_layer(tool: str, shape_name: str, dtype, block_size: int):
    """One MoE layer of the shape in `tool` (LitGPT's `LLaMAMoE`, the toolkit's `MoE`), both holding
    the same weights: the router's and each expert's gate, up and down projections drawn from one
    seeded generator (N(0, 0.02), the down projections scaled as residual projections)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    shape = SHAPES[shape_name]
    X, C, I = shape["n_expert"], shape["n_embd"], shape["intermediate_size"]
    router = torch.randn(X, C, generator=generator) * 0.02
    gate_up = torch.randn(X, 2 * I, C, generator=generator) * 0.02  # rows [0, I) gate, [I, 2I) up
    down = torch.randn(X, C, I, generator=generator) * 0.02 / (2 * shape["n_layer"]) ** 0.5
    config = moe_config(tool, shape_name, block_size)
    with torch.no_grad():
        if tool == "litgpt":
            from litgpt.model import LLaMAMoE

            layer = LLaMAMoE(config)
            layer.gate.weight.copy_(router)
            for e, expert in enumerate(layer.experts):
                expert.fc_1.weight.copy_(gate_up[e, :I])
                expert.fc_2.weight.copy_(gate_up[e, I:])
                expert.proj.weight.copy_(down[e])
        else:
            from toolkit.models.moe import MoE

            layer = MoE(config)
            layer.router.weight.copy_(router)
            layer.experts.gate_up_proj.copy_(gate_up)
            layer.experts.down_proj.copy_(down)
    return layer.to(dtype)


def measure_moe_layer(tool: str, shape_name: str, dtype_name: str, steps: int, warmup: int, micro_batch: int,
                      seq_len: int, device: str = "cpu") -> dict:
    """Forward and backward of one MoE layer (`build_moe_layer`) on the same random rows in both
    tools, new at each step (gradients of the weights and of the rows), no optimizer; the first
    output's sum and absolute sum, to check that both tools compute the same."""
    import torch

    dtype = getattr(torch, dtype_name)
    layer = build_moe_layer(tool, shape_name, dtype, seq_len).to(device)
    generator = torch.Generator().manual_seed(1)
    C = SHAPES[shape_name]["n_embd"]
    times = []
    for step in range(warmup + steps):
        # new rows at each step, as training routes new tokens: the experts' runs change height
        x = torch.randn(micro_batch, seq_len, C, generator=generator).to(device, dtype).requires_grad_()
        grad = torch.randn(micro_batch, seq_len, C, generator=generator).to(device, dtype)
        start = clock(device)
        out = layer(x)
        out.backward(grad)
        if step >= warmup:
            times.append(clock(device) - start)
        if step == 0:
            sums = [float(out.float().sum()), float(out.float().abs().sum())]
        layer.zero_grad(set_to_none=True)
    return {"tool": tool, "dtype": dtype_name, "autocast": False, "device": device, "median_step_s": statistics.median(times),
            "steps_s": times, "parameters": sum(p.numel() for p in layer.parameters()), **peak_memory(device),
            "output_sums": sums}


def measure(tool: str, shape_name: str, dtype_name: str, steps: int, warmup: int, micro_batch: int,
            autocast: bool, seq_len: int, device: str = "cpu") -> dict:
    import contextlib

    import torch

    dtype = getattr(torch, dtype_name)
    model, loss_fn = build(tool, shape_name, torch.float32 if autocast else dtype, seq_len)
    model.to(device)
    precision = contextlib.nullcontext if not autocast else (lambda: torch.autocast(device, dtype=dtype))
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
        tokens = torch.randint(0, shape["vocab_size"], (micro_batch, T + 1), generator=generator).to(device)
        start = clock(device)
        with precision():
            loss = loss_fn(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= warmup:
            times.append(clock(device) - start)
    parameters = sum(p.numel() for p in model.parameters())
    return {"tool": tool, "dtype": dtype_name, "autocast": autocast, "device": device, "median_step_s": statistics.median(times),
            "steps_s": times, "parameters": parameters, **peak_memory(device), "loss": float(loss)}


def clock(device: str) -> float:
    """Seconds, once the device has done what it was given."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
    return time.perf_counter()


def peak_memory(device: str) -> dict:
    """The process's peak resident memory; on a GPU also the peak of allocated device memory."""
    peak = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if device == "cuda":
        import torch

        peak["peak_device_bytes"] = torch.cuda.max_memory_allocated()
    return peak


def model_device(model):
    return next(model.parameters()).device


def run_one(tool: str, args) -> dict:
    python = str(args.litgpt_python) if tool == "litgpt" else sys.executable
    cmd = [python, __file__, "--worker", tool, "--shape", args.shape, "--dtype", args.dtype, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--micro_batch", str(args.micro_batch), "--seq_len", str(args.seq_len),
           "--part", args.part, "--device", args.device] + (["--autocast"] if args.autocast else [])
    out = subprocess.run(cmd, capture_output=True, text=True, cwd="/tmp" if tool == "litgpt" else REPO)
    if out.returncode:
        raise SystemExit(f"{tool} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def agreement(result: dict) -> str:
    """For `--part moe`: how far apart the two tools' outputs are (relative, sum of absolute values)."""
    if "output_sums" not in result["toolkit"] or "litgpt" not in result:
        return ""
    ours, theirs = result["toolkit"]["output_sums"][1], result["litgpt"]["output_sums"][1]
    return f"; outputs' absolute sums differ by {abs(ours - theirs) / abs(theirs):.1e} relative"


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
    p.add_argument("--part", default="step", choices=["step", "moe"],
                   help="step: a whole optimizer step; moe: forward and backward of one MoE layer alone (MoE shapes)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--tools", default="toolkit,litgpt", choices=["toolkit,litgpt", "toolkit"],
                   help="toolkit: the toolkit's runs alone (where LitGPT is not installed)")
    p.add_argument("--litgpt_python", type=Path, default=LITGPT_PYTHON,
                   help="the Python that has LitGPT 0.5.13 (default: $LITGPT_PYTHON or /tmp/litgpt-venv/bin/python)")
    p.add_argument("--worker", choices=["toolkit", "litgpt"], help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help="write every run and the summary as JSON here")
    args = p.parse_args()
    if args.part == "moe" and args.shape not in MOE_SHAPES:
        p.error(f"--part moe takes an MoE shape: {', '.join(MOE_SHAPES)}")
    if args.worker and args.part == "moe":
        print(json.dumps(measure_moe_layer(args.worker, args.shape, args.dtype, args.steps, args.warmup, args.micro_batch,
                                           args.seq_len, args.device)))
        return
    if args.worker:
        print(json.dumps(measure(args.worker, args.shape, args.dtype, args.steps, args.warmup, args.micro_batch, args.autocast,
                                 args.seq_len, args.device)))
        return
    tools = args.tools.split(",")
    runs, ratios = [], []
    for pair in range(args.pairs):
        order = tools if pair % 2 == 0 else tools[::-1]
        result = {tool: run_one(tool, args) for tool in order}
        runs.append(result)
        line = ", ".join(f"{tool} {result[tool]['median_step_s']:.3f} s" for tool in tools)
        if "litgpt" in result:
            ratios.append(result["litgpt"]["median_step_s"] / result["toolkit"]["median_step_s"])
            line += f", LitGPT / toolkit {ratios[-1]:.2f}"
        memory = "peak_device_bytes" if args.device == "cuda" else "peak_rss_bytes"
        line += "; peak " + ("device memory " if args.device == "cuda" else "RSS ")
        line += ", ".join(f"{tool} {result[tool][memory] / 2**20:.0f} MiB" for tool in tools)
        print(f"pair {pair}: {line}{agreement(result)}", flush=True)
    summary = {
        "part": args.part, "device": args.device, "dtype": args.dtype, "autocast": args.autocast, "shape": args.shape,
        "sizes": SHAPES[args.shape], "micro_batch": args.micro_batch, "seq_len": args.seq_len, "steps": args.steps,
        **{f"{tool}_median_s": statistics.median(r[tool]["median_step_s"] for r in runs) for tool in tools},
        "speedup_median_of_pairs": statistics.median(ratios) if ratios else None, "speedups": ratios,
        "parameters": {tool: runs[0][tool]["parameters"] for tool in tools},
        "load_average": os.getloadavg(),
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))

if __name__ == "__main__":
    main()
