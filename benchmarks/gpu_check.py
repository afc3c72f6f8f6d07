"""The first GPU hour, prepared: every path no GPU has run yet, measured in one go, into one JSON.

    timeout 540 python benchmarks/gpu_check.py --out $OUT/gpu_check.json     # one H100, at most 8 minutes
    python benchmarks/gpu_check.py --dry --out /tmp/gpu_check.json            # the same code on the CPU, tiny sizes

Each check is a function below, run in a process of its own with its own time limit: a check that
fails, crashes or runs out of time is recorded as such and the next one still runs. The JSON is
rewritten after every check, so whatever finished is kept if the whole command is killed. One line
is printed per check with its time. Nothing is downloaded: models are built from presets with
random weights, data is random tokens.

    fused_loss            the fused head + cross-entropy (`linear_cross_entropy_sum`, its CUDA
                          branch) against `cross_entropy_sum` of the full logits, bfloat16 and
                          float32: loss and gradient differences, peak memory of each
    attention_kernels     a sliding-window, softcapped attention layer through each kernel the
                          toolkit could use: time, memory, agreement
    attention_sinks       gpt-oss's attention sinks through both kernels that take them
    moe_experts           one Qwen3-30B-A3B-shaped MoE layer: grouped products against one product
                          per expert, time and agreement
    moe_step_litgpt       a whole optimizer step of small Qwen3-MoE and Mixtral shapes, the toolkit
                          against LitGPT 0.5.13 (benchmarks/litgpt_step.py; LitGPT from gpu_wheels.sh)
    fp16_mixed            "16-mixed" trains a small model a few steps on one batch: the GradScaler
                          path (loss finite and falling, the scale it ended with)
    nccl_paths            FSDP on a 1-process NCCL group: the streamed final export (`stream_weights`)
                          byte for byte against the gathered export, and an RNG save/restore round
                          trip, also from a checkpoint written on a host with more GPUs
    cpu_offload_nf4       LoRA under FSDP with `cpu_offload`: on the process group `plan_strategy`
                          makes for offload (cuda:nccl,cpu:gloo) with one process, and with an NF4
                          base (torchao) as rank 0 of 2 on a fake group (see the check for why)
    memory                simulated (`simulate`, fake tensors) against real peak memory
                          (`torch.cuda.max_memory_allocated`) of the same step, three set-ups
    throughput_eager      bf16-mixed tokens/s and MFU of tiny-llama-1.1b on synthetic data, eager
    throughput_compiled   the same with compiled blocks (benchmarks/train_throughput.py, reused)

`--one_process` runs all checks in one process instead (no limit per check; the tests' dry run).
`--dry` runs every check's code on the CPU with tiny shapes (debug presets, one or two steps),
gloo where NCCL would be used, and writes the same JSON with "device": "cpu", "dry": true; a
test runs it so that this script cannot rot. What a CPU cannot do has a stand-in there, recorded
in each check's figures: peak memory is the growth of the process's peak RSS (VmHWM) instead of
`torch.cuda.max_memory_allocated` (so dry-mode memory ratios mean nothing), and "16-mixed" is
"bf16-mixed" (the toolkit refuses float16 on a CPU).

The parent process never imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[1]
RESULT_TAG = "CHECK_RESULT "
GiB = 2**30


def simulate(**kwargs: Any) -> Any:
    """The memory simulation (`simulate(config, devices, ...)`): the one place that names its module."""
    from toolkit.memory import simulate as run

    return run(**kwargs)


# ------------------------------------------------------------------------------------------------
# The checks: each takes a Context and returns a dict of figures (raising CheckFailed, with what it
# had measured, when an expectation does not hold).


class CheckFailed(Exception):
    def __init__(self, message: str, figures: dict) -> None:
        super().__init__(message)
        self.figures = figures


class Context:
    def __init__(self, device: str, dry: bool, work: Path) -> None:
        self.device, self.dry, self.work = device, dry, work
        work.mkdir(parents=True, exist_ok=True)

    def pick(self, gpu: Any, dry: Any) -> Any:
        """The size to use: `gpu` on the GPU, `dry` in the CPU dry run."""
        return dry if self.dry else gpu


CHECKS: dict[str, tuple[Callable[[Context], dict], int]] = {}  # name -> (function, seconds on an H100)


def check(name: str, budget: int) -> Callable:
    def register(fn: Callable[[Context], dict]) -> Callable[[Context], dict]:
        CHECKS[name] = (fn, budget)
        return fn

    return register


class PeakMemory:
    """Peak memory of what runs inside the block, in bytes, above what was allocated before it.

    On CUDA: `torch.cuda.max_memory_allocated` (live tensors of the caching allocator), and the
    reserved peak beside it. On the CPU (dry run) the stand-in is the growth of the process's peak
    RSS (VmHWM) over its RSS at the start: everything the process touched, not tensors alone.
    """

    def __init__(self, device: str, absolute: bool = False) -> None:
        self.device, self.absolute = device, absolute  # absolute: the peak itself, not its growth
        self.figures: dict = {}

    def __enter__(self) -> "PeakMemory":
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = 0 if self.absolute else torch.cuda.memory_allocated()
        else:
            import gc

            from toolkit.training.model_setup import release_freed_host_memory, start_host_memory_window

            # What earlier work in this process freed goes back to the system first: kept by the C
            # heap, the block would reuse it without growing the RSS (checks in one process).
            gc.collect()
            release_freed_host_memory()
            self.start = start_host_memory_window()
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            self.figures = {"peak_bytes": torch.cuda.max_memory_allocated() - self.before,
                            "reserved_peak_bytes": torch.cuda.max_memory_reserved(),
                            "source": "torch.cuda.max_memory_allocated" + ("" if self.absolute else " minus the memory before")}
        else:
            from toolkit.training.model_setup import host_memory_growth

            self.figures = {"peak_bytes": host_memory_growth(self.start),
                            "source": "CPU stand-in: growth of peak RSS (VmHWM)"}

    @property
    def bytes(self) -> int:
        return self.figures["peak_bytes"]


def _fsdp_world1_plan(device: str, precision: str, cpu_offload: bool = False):
    """The plan of one rank of an FSDP FULL_SHARD group of one process.

    `plan_strategy` trains one device without FSDP; these checks want FSDP's paths on the one GPU,
    so the plan of two devices is made for one. On the GPU it keeps the backend `plan_strategy`
    gives ("nccl", or "cuda:nccl,cpu:gloo" with offload); in the dry run gloo stands in for NCCL.
    """
    from dataclasses import replace

    from toolkit.args import DistributedArgs
    from toolkit.parallel.plan import plan_strategy

    plan = replace(plan_strategy(2, 1, precision, DistributedArgs(strategy="fsdp", sharding="FULL_SHARD",
                                                                  cpu_offload=cpu_offload), accelerator="cuda"),
                   devices=1)
    if device == "cpu":  # the GPU's plan on a CPU process: gloo in nccl's place (cpu_offload kept)
        plan = replace(plan, accelerator="cpu", process_group_backend="gloo")
    return plan


def _random_reader(model, config, seed: int = 0):
    """`read_rows` of the initialiser (as a pretraining run from random weights reads them)."""
    from toolkit.models.gpt import init_specs, initial_value

    specs = init_specs(model, config.n_layer)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    return lambda name, start=0, stop=None, out=None, inner=None: initial_value(specs[name], shapes[name], seed, name,
                                                                                 start, stop, out=out, inner=inner)


def _fixed_batch(config, batch: int, seq: int, device):
    import torch

    generator = torch.Generator().manual_seed(1234)
    block = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=generator).to(device)
    return block[:, :-1], block[:, 1:]


@check("fused_loss", budget=40)
def fused_loss(ctx: Context) -> dict:
    """The fused head + loss against the plain one on the full logits (tiny-llama's head on the GPU)."""
    import torch

    from toolkit.models import IGNORE_INDEX
    from toolkit.models.loss import cross_entropy_sum, linear_cross_entropy_sum

    rows, embd, vocab = ctx.pick((4 * 2048, 2048, 32000), (64, 32, 512))
    figures: dict = {"rows": rows, "n_embd": embd, "vocab": vocab, "device": ctx.device}
    # Largest difference relative to the largest reference value: bfloat16 within 5% (a few of its
    # rounding steps, 0.8% each), float32 within 1e-4. A wrong gradient (a missing row, a skipped
    # scale) is off by far more.
    tolerances = {"bfloat16": 5e-2, "float32": 1e-4}
    generator = torch.Generator().manual_seed(0)
    for name, tol in tolerances.items():
        dtype = getattr(torch, name)
        hidden = torch.randn(rows, embd, generator=generator).to(ctx.device, dtype)
        weight = (torch.randn(vocab, embd, generator=generator) * 0.02).to(ctx.device, dtype)
        labels = torch.randint(0, vocab, (rows,), generator=generator)
        labels[::7] = IGNORE_INDEX  # some ignored rows, as padding and masked prompts give
        labels = labels.to(ctx.device)
        results = {}
        for kind in ("reference", "fused"):
            h = hidden.clone().requires_grad_(True)
            w = weight.clone().requires_grad_(True)
            with PeakMemory(ctx.device) as peak:
                if kind == "reference":
                    loss = cross_entropy_sum(torch.nn.functional.linear(h, w), labels)
                else:
                    loss = linear_cross_entropy_sum(h, w, None, labels)
                loss.backward()
            results[kind] = (loss.detach().float(), h.grad.float(), w.grad.float(), peak.figures)
        ref, fused = results["reference"], results["fused"]

        def rel(a, b) -> float:
            return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

        entry = {
            "loss_reference": float(ref[0]), "loss_fused": float(fused[0]),
            "loss_rel_diff": rel(fused[0], ref[0]),
            "grad_hidden_max_abs_diff": float((fused[1] - ref[1]).abs().max()),
            "grad_hidden_rel_diff": rel(fused[1], ref[1]),
            "grad_weight_max_abs_diff": float((fused[2] - ref[2]).abs().max()),
            "grad_weight_rel_diff": rel(fused[2], ref[2]),
            "peak_bytes_reference": ref[3]["peak_bytes"], "peak_bytes_fused": fused[3]["peak_bytes"],
            "peak_source": ref[3]["source"], "tolerance": tol,
        }
        entry["agrees"] = all(entry[k] <= tol for k in ("loss_rel_diff", "grad_hidden_rel_diff", "grad_weight_rel_diff"))
        figures[name] = entry
    if not all(figures[name]["agrees"] for name in tolerances):
        raise CheckFailed("the fused loss differs from the reference beyond tolerance", figures)
    return figures


@check("attention_kernels", budget=60)
def attention_kernels(ctx: Context) -> dict:
    """A sliding-window, softcapped attention layer's forward + backward through each kernel the
    model can pick (`toolkit.models.attention.attend`): flex_attention (the CUDA choice; compiled,
    block-sparse), the chunked paths (the CPU choice) and a dense (T, T)-mask reference; outputs and
    q/k/v gradients against the reference, time and peak memory of each. The dry run has no flex
    (torch has no flex_attention backward on the CPU)."""
    import time

    import torch

    from toolkit.models.attention import attend, attention_backend, key_mask

    B, H, G, T, D, window, cap = ctx.pick((1, 8, 2, 8192, 128, 1024, 50.0), (1, 4, 2, 96, 16, 24, 5.0))
    dtype = torch.bfloat16 if ctx.device == "cuda" else torch.float32
    figures: dict = {"shape": {"B": B, "H": H, "G": G, "T": T, "D": D, "window": window, "softcap": cap},
                     "dtype": str(dtype).replace("torch.", ""), "device": ctx.device}
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(B, n, T, D, generator=generator).to(ctx.device, dtype) for n in (H, G, G)]

    def dense(q, k, v):
        scores = (q.float() @ k.float().repeat_interleave(H // G, 1).transpose(-1, -2)) / D**0.5
        scores = cap * torch.tanh(scores / cap)
        scores = scores.masked_fill(~key_mask(0, T, 0, T, q.device, window), float("-inf"))
        return (scores.softmax(-1) @ v.float().repeat_interleave(H // G, 1)).to(q.dtype)

    def run(kind):
        q, k, v = (t.clone().requires_grad_(True) for t in inputs)
        grad = torch.ones(B, H, T, D, device=ctx.device, dtype=dtype)
        timings = []
        for _ in range(1 if ctx.dry else 3):  # the first flex call compiles: the last is the timing
            for t in (q, k, v):
                t.grad = None
            with PeakMemory(ctx.device) as peak:
                if ctx.device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                if kind == "dense":
                    out = dense(q, k, v)
                else:
                    with attention_backend(kind):
                        out = attend(q, k, v, window=window, softcap=cap)
                out.backward(grad)
                if ctx.device == "cuda":
                    torch.cuda.synchronize()
                timings.append(time.perf_counter() - start)
        return out.detach().float(), [t.grad.float() for t in (q, k, v)], timings, peak.figures

    kinds = ("dense", "chunked") if ctx.device != "cuda" else ("dense", "chunked", "flex")
    results = {kind: run(kind) for kind in kinds}
    reference = results["dense"]
    tolerance = 5e-2 if dtype == torch.bfloat16 else 1e-4  # relative to the largest reference value

    def rel(a, b) -> float:
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    for kind, (out, grads, timings, peak) in results.items():
        entry = {"seconds_first": timings[0], "seconds": timings[-1], "peak_bytes": peak["peak_bytes"],
                 "peak_source": peak["source"]}
        if kind != "dense":
            entry["out_rel_diff"] = rel(out, reference[0])
            entry["grad_rel_diff"] = max(rel(g, r) for g, r in zip(grads, reference[1]))
            entry["agrees"] = entry["out_rel_diff"] <= tolerance and entry["grad_rel_diff"] <= tolerance
        figures[kind] = entry
    figures["tolerance"] = tolerance
    if not all(figures[kind]["agrees"] for kind in kinds if kind != "dense"):
        raise CheckFailed("an attention kernel differs from the dense reference beyond tolerance", figures)
    return figures


@check("attention_sinks", budget=120)
def attention_sinks(ctx: Context) -> dict:
    """gpt-oss's attention sinks (a learned logit per head in every query's softmax) through the
    kernels the model picks: on the GPU flex_attention differentiated through its log-sum-exp, against
    the chunked path and a dense reference with a sink column; causal, a 128-token window and packed
    documents (`segment_attention`), bf16 and float32. Outputs and q/k/v/sink gradients, relative to
    the largest reference value. The dry run has no flex (no flex_attention backward on the CPU)."""
    import torch

    from toolkit.models.attention import attend, attention_backend, key_mask, segment_attention

    B, H, G, T, D, window = ctx.pick((2, 8, 2, 2048, 64, 128), (2, 4, 2, 48, 16, 12))
    generator = torch.Generator().manual_seed(0)
    base = [torch.randn(B, n, T, D, generator=generator) for n in (H, G, G)]
    sink_values = torch.randn(H, generator=generator) * 2 + 1
    upstream = torch.randn(B, H, T, D, generator=generator)
    packed = torch.tensor([[T // 3, T - T // 3], [T, 0]])

    def dense(q, k, v, sinks, win, segments):
        k, v = (t.repeat_interleave(H // G, 1) for t in (k, v))
        mask = key_mask(0, T, 0, T, q.device, win)
        if segments is not None:
            doc = torch.repeat_interleave(torch.arange(segments.shape[1]).expand_as(segments).reshape(-1),
                                          segments.reshape(-1)).view(B, T).to(q.device)
            mask = mask & (doc[:, None, :, None] == doc[:, None, None, :])
        scores = (q @ k.transpose(-1, -2) / D**0.5).masked_fill(~mask, float("-inf"))
        scores = torch.cat([scores, sinks.view(1, H, 1, 1).expand(B, H, T, 1)], dim=-1)
        return scores.softmax(-1)[..., :-1] @ v

    kinds = ("chunked", "flex") if ctx.device == "cuda" else ("chunked",)
    dtypes = (torch.float32, torch.bfloat16) if ctx.device == "cuda" else (torch.float32,)
    figures: dict = {"shape": {"B": B, "H": H, "G": G, "T": T, "D": D, "window": window}, "device": ctx.device, "cases": {}}

    def rel(a, b) -> float:
        return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))

    for dtype in dtypes:
        for win in (None, window):
            for segments in (None, packed):
                name = f"{str(dtype).replace('torch.', '')} window={win} packed={segments is not None}"
                results = {}
                for kind in ("dense",) + kinds:
                    leaves = [t.to(ctx.device, torch.float64 if kind == "dense" else dtype).requires_grad_(True)
                              for t in (*base, sink_values)]
                    q, k, v, sinks = leaves
                    if kind == "dense":
                        out = dense(q, k, v, sinks, win, segments)
                    else:
                        with attention_backend(kind):
                            out = (attend(q, k, v, None, win, None, None, sinks) if segments is None
                                   else segment_attention(q, k, v, segments, None, win, None, sinks))
                    grads = torch.autograd.grad((out.float() * upstream.to(ctx.device)).sum(), leaves)
                    results[kind] = (out.detach(), *grads)
                tolerance = 1e-4 if dtype == torch.float32 else 5e-2
                entry = {}
                for kind in kinds:
                    diffs = [rel(a, b) for a, b in zip(results[kind], results["dense"])]
                    entry[kind] = dict(zip(("out", "dq", "dk", "dv", "dsinks"), diffs))
                    entry[kind]["agrees"] = max(diffs) <= tolerance
                figures["cases"][name] = entry
    if not all(e[kind]["agrees"] for e in figures["cases"].values() for kind in kinds):
        raise CheckFailed("attention with sinks differs from the dense reference beyond tolerance", figures)
    return figures


@check("moe_experts", budget=40)
def moe_experts(ctx: Context) -> dict:
    """One mixture-of-experts layer of Qwen3-30B-A3B's shape (2048 wide, 128 experts of 768, top-8)
    over 8,192 tokens in bf16, forward + backward, with its experts as grouped products
    (`torch._grouped_mm`, the default on compute capability 9.0+) and as one product per expert:
    outputs and gradients against each other, time and peak memory of each."""
    import time

    import torch

    from toolkit.models.config import Config
    from toolkit.models.moe import MoE, expert_backend

    C, X, K, I, N = ctx.pick((2048, 128, 8, 768, 8192), (64, 8, 2, 32, 96))
    config = Config(name="moe-layer", n_layer=1, n_embd=C, n_head=8, intermediate_size=I, n_expert=X, n_expert_per_token=K)
    torch.manual_seed(0)
    layer = MoE(config)
    for weight in (layer.router.weight, layer.experts.gate_up_proj, layer.experts.down_proj):
        torch.nn.init.normal_(weight, std=0.02)
    layer.to(ctx.device, torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, N, C, generator=generator).to(ctx.device, torch.bfloat16)
    upstream = torch.randn(1, N, C, generator=generator).to(ctx.device, torch.bfloat16)
    figures: dict = {"shape": {"n_embd": C, "experts": X, "per_token": K, "expert_width": I, "tokens": N},
                     "dtype": "bfloat16", "device": ctx.device}
    results = {}
    for backend in ("grouped", "loop"):
        timings = []
        for _ in range(1 if ctx.dry else 3):
            layer.zero_grad(set_to_none=True)
            inputs = x.clone().requires_grad_(True)
            with expert_backend(backend), PeakMemory(ctx.device) as peak:
                if ctx.device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                out = layer(inputs)
                out.backward(upstream)
                if ctx.device == "cuda":
                    torch.cuda.synchronize()
                timings.append(time.perf_counter() - start)
        grads = [inputs.grad] + [p.grad for p in (layer.router.weight, layer.experts.gate_up_proj, layer.experts.down_proj)]
        results[backend] = [out.detach()] + [g.detach().clone() for g in grads]
        figures[backend] = {"seconds_first": timings[0], "seconds": timings[-1], **peak.figures}

    def rel(a, b) -> float:
        return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))

    diffs = [rel(a, b) for a, b in zip(results["grouped"], results["loop"])]
    figures["grouped_vs_loop"] = dict(zip(("out", "dx", "drouter", "dgate_up", "ddown"), diffs))
    figures["agrees"] = max(diffs) <= 5e-2
    figures["speedup"] = figures["loop"]["seconds"] / max(figures["grouped"]["seconds"], 1e-9)
    if not figures["agrees"]:
        raise CheckFailed("grouped experts differ from looped experts beyond tolerance", figures)
    return figures


@check("moe_step_litgpt", budget=120)
def moe_step_litgpt(ctx: Context) -> dict:
    """benchmarks/litgpt_step.py on the GPU: a whole optimizer step of the small Qwen3-MoE (with the
    real model's 128 experts) and Mixtral shapes (bf16 weights, 2 x 512 tokens), the toolkit against
    LitGPT 0.5.13, fresh processes
    alternating pair by pair (the issue's goal: at least 3x). LitGPT comes from benchmarks/gpu_wheels.sh;
    where it is not installed (the dry run) the toolkit's runs alone."""
    import importlib.util

    litgpt = importlib.util.find_spec("litgpt") is not None
    figures: dict = {"litgpt_installed": litgpt, "device": ctx.device}
    for shape, pairs in ctx.pick((("qwen3-moe-128", 2), ("mixtral", 2)), (("mixtral", 1),)):
        results = ctx.work / f"litgpt_step_{shape}.json"
        command = [sys.executable, str(REPO / "benchmarks" / "litgpt_step.py"), "--shape", shape, "--dtype", "bfloat16",
                   "--device", ctx.device, "--pairs", str(pairs), "--tools", "toolkit,litgpt" if litgpt else "toolkit",
                   "--litgpt_python", sys.executable, "--out", str(results),
                   *ctx.pick(("--warmup", "3", "--steps", "10"), ("--warmup", "0", "--steps", "1", "--seq_len", "32"))]
        run = subprocess.run(command, capture_output=True, text=True)
        if run.returncode != 0:
            raise CheckFailed(f"litgpt_step.py --shape {shape} exited with {run.returncode}: "
                              + (run.stdout + run.stderr).strip().splitlines()[-1], {**figures, "command": " ".join(command)})
        summary = json.loads(results.read_text())["summary"]
        figures[shape] = {k: v for k, v in summary.items() if k != "load_average"}
        figures[shape]["command"] = " ".join(command[1:])
    return figures


@check("fp16_mixed", budget=40)
def fp16_mixed(ctx: Context) -> dict:
    """A few optimizer steps of a small model under "16-mixed" (the GradScaler path) on one batch."""
    import torch

    from toolkit.args import DistributedArgs
    from toolkit.models.config import Config
    from toolkit.models.gpt import GPT, Block, init_weights
    from toolkit.parallel.plan import plan_strategy
    from toolkit.training.fabric import build_fabric
    from toolkit.training.loop import optimizer_step

    precision = ctx.pick("16-mixed", "bf16-mixed")  # the toolkit refuses float16 on a CPU
    config = Config.from_name("debug", n_layer=ctx.pick(6, 2))
    batch, seq, steps = ctx.pick((8, 256, 20), (2, 32, 4))
    fabric = build_fabric(plan_strategy(1, 1, precision, DistributedArgs(), accelerator=ctx.device), block_cls=Block)
    fabric.launch()
    fabric.seed_everything(0)
    with fabric.init_module(empty_init=False):
        model = GPT(config)
    init_weights(model, config.n_layer, seed=0)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=2e-3))
    x, y = _fixed_batch(config, batch, seq, fabric.device)
    scaler = getattr(fabric._precision, "scaler", None)
    losses, norms = [], []
    for _ in range(steps):
        loss = model(x, labels=y) / y.numel()
        fabric.backward(loss)
        norm = optimizer_step(fabric, model, optimizer, max_norm=1.0)
        losses.append(float(loss))
        norms.append(float(norm))
    figures = {
        "precision": precision, "stand_in": None if precision == "16-mixed" else "bf16-mixed: no float16 on a CPU",
        "scaler": type(scaler).__name__ if scaler is not None else None,
        "final_scale": float(scaler.get_scale()) if scaler is not None else None,
        "steps": steps, "losses": [round(v, 4) for v in losses], "grad_norms": [round(v, 4) for v in norms],
    }
    figures["finite"] = all(map(lambda v: v == v and abs(v) != float("inf"), losses))
    figures["falls"] = losses[-1] < losses[0]
    if precision == "16-mixed" and scaler is None:
        raise CheckFailed("16-mixed trained without a GradScaler", figures)
    if not (figures["finite"] and figures["falls"]):
        raise CheckFailed("the loss is not finite or does not fall", figures)
    return figures


@check("nccl_paths", budget=50)
def nccl_paths(ctx: Context) -> dict:
    """The streamed export and RNG save/restore on a 1-process FSDP group (NCCL on the GPU)."""
    import random

    import torch

    from toolkit.model_dir import save_checkpoint_files
    from toolkit.models.config import Config
    from toolkit.models.gpt import GPT, Block
    from toolkit.parallel.precision import apply_precision_policy
    from toolkit.training.checkpoint import rng_state, set_rng_state
    from toolkit.training.checkpoint_io import full_state_dict, stream_weights
    from toolkit.training.fabric import build_fabric
    from toolkit.training.model_setup import setup_model

    plan = _fsdp_world1_plan(ctx.device, "bf16-mixed")
    fabric = build_fabric(plan, block_cls=Block)
    fabric.launch()
    figures: dict = {"backend": plan.process_group_backend, "world_size": fabric.world_size,
                     "torch_backend": torch.distributed.get_backend()}
    config = Config.from_name(ctx.pick("pythia-160m", "debug"), n_layer=ctx.pick(4, 2))
    with torch.device("meta"):
        model = GPT(config)
    apply_precision_policy(model, plan.precision)
    model = setup_model(fabric, model, _random_reader(model, config))
    streamed, gathered = ctx.work / "streamed", ctx.work / "gathered"
    streamed.mkdir()
    gathered.mkdir()
    start = time.perf_counter()
    error = stream_weights(fabric, model, streamed, config, torch.bfloat16)
    figures["export_seconds"] = round(time.perf_counter() - start, 2)
    if error is not None:
        raise CheckFailed(f"stream_weights failed: {error}", figures)
    state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in full_state_dict(fabric, model).items()}
    save_checkpoint_files(gathered, state, config)
    a, b = (streamed / "model.safetensors").read_bytes(), (gathered / "model.safetensors").read_bytes()
    figures.update(export_bytes=len(a), export_identical=a == b)

    # RNG: a round trip on this rank, then a state saved by an older checkpoint holding every
    # visible GPU's state (8), restored on this host (the current device's entry is used).
    def draw() -> list:
        values = [torch.rand(3).tolist(), random.random()]
        if ctx.device == "cuda":
            values.append(torch.rand(3, device="cuda").tolist())
        return values

    path = ctx.work / "rng.pt"
    torch.save(rng_state(), path)
    first = draw()
    set_rng_state(torch.load(path, weights_only=False))
    figures["rng_round_trip"] = draw() == first
    older = torch.load(path, weights_only=False)
    if "cuda" in older:
        older["cuda"] = [older["cuda"]] * 8
    set_rng_state(older)
    figures["rng_from_more_gpus"] = draw() == first
    figures["rng_saved_cuda_state"] = "cuda" in rng_state()
    from toolkit.training.failures import release_process_group

    release_process_group()  # destroys the group and frees what holds its threads
    if not (figures["export_identical"] and figures["rng_round_trip"] and figures["rng_from_more_gpus"]):
        raise CheckFailed("an export or RNG round trip differs", figures)
    return figures


@check("cpu_offload_nf4", budget=75)
def cpu_offload_nf4(ctx: Context) -> dict:
    """LoRA under FSDP with `cpu_offload`, a few steps with clipping: trains, stays offloaded, device peak.

    Two runs, because torch 2.13's FSDP2 cannot gather an NF4 weight in a group of one process (for
    one rank it skips the all-gather and keeps only the first of the NF4 tensor's three all-gather
    inputs: "not enough values to unpack"), and training never shards on one device:

    one_rank_group   the offload plan's real process group (cuda:nccl,cpu:gloo; gloo in the dry run)
                     with one process, the clipping's norm all-reduced on the CPU: LoRA over a
                     16-bit base
    nf4_two_ranks    rank 0 of 2 on torch's fake process group, the NF4 base (torchao) sharded and
                     offloaded. FSDP's gathers and reduce-scatters are emulated (`_copy_peer_comms`):
                     the other rank is taken to hold the same shard, so every buffer of a 2-GPU rank
                     is really allocated and the values stay finite; no NCCL or gloo runs here
    nf4_one_rank     the NF4 base on the one-process group: whether it runs, or its error
    """
    figures = {"one_rank_group": _offload_run(ctx, nf4=False)}
    figures["nf4_two_ranks"] = _offload_run(ctx, nf4=True, fake_peer=True)
    # The limitation itself, recorded (not a failure of the check): a torch that fixes it shows here.
    try:
        figures["nf4_one_rank"] = {"runs": True, **_offload_run(ctx, nf4=True)}
    except Exception as error:
        figures["nf4_one_rank"] = {"runs": False, "error": f"{type(error).__name__}: {error}".splitlines()[0]}
    bad = [name for name in ("one_rank_group", "nf4_two_ranks")
           if not (figures[name]["finite"] and figures[name]["offloaded"])]
    if bad or not figures["nf4_two_ranks"]["nf4_weights"]:
        raise CheckFailed(f"not offloaded, no NF4 weight, or a loss that is not finite: {bad}", figures)
    return figures


def _offload_run(ctx: Context, nf4: bool, fake_peer: bool = False) -> dict:
    import torch

    from toolkit.args import TrainArgs
    from toolkit.finetune.lora import init_adapters
    from toolkit.models.adapters import LoRAArgs
    from toolkit.models.config import Config
    from toolkit.models.gpt import GPT, Block
    from toolkit.optim import decay_names, make_adamw
    from toolkit.parallel.precision import apply_precision_policy, precision_dtypes
    from toolkit.training.fabric import build_fabric
    from toolkit.training.loop import optimizer_step
    from toolkit.training.model_setup import setup_model
    from toolkit.parallel.nf4 import check_nf4_shardable, is_nf4, quantize_blocks_nf4

    from dataclasses import replace

    from peft import get_peft_model

    plan = _fsdp_world1_plan(ctx.device, "bf16-mixed", cpu_offload=True)
    saved_env = dict(os.environ)
    if fake_peer:
        # Rank 0 of 2 on a fake group: Lightning joins a process group that exists and, with
        # LOCAL_RANK set, starts no second process. Two nodes of one device each, so that Fabric
        # asks for one GPU only; the mesh is the same (FULL_SHARD over the 2 ranks).
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        plan = replace(plan, num_nodes=2)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        os.environ.update(LOCAL_RANK="0", NODE_RANK="0", RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT="29555")
    try:
        fabric = build_fabric(plan, block_cls=Block)
        fabric.launch()
        # tiny-llama's widths (2048, MLP 5632) with 4 of its 22 layers: the figure is per layer.
        # (the dry run's debug model twice as wide: NF4 splits a weight over 2 ranks in whole blocks of scales)
        config = Config.from_name(ctx.pick("tiny-llama-1.1b", "debug"), n_layer=ctx.pick(4, 2), n_embd=ctx.pick(2048, 512))
        batch, seq, steps = ctx.pick((2, 1024, 4), (2, 32, 2))
        with torch.device("meta"):
            model = GPT(config)
        if nf4:
            check_nf4_shardable(model, plan.world_size)
        read_rows = _random_reader(model, config)  # by the plain model's names, as Session reads them
        if nf4:
            quantize_blocks_nf4(model, precision_dtypes(plan.precision)[1], plan.shard_device(fabric.device))
        model = get_peft_model(model, LoRAArgs(dropout=0.0).peft_config())
        init_adapters(model, 0)
        apply_precision_policy(model, plan.precision)
        with PeakMemory(ctx.device) as setup_peak:
            model = setup_model(fabric, model, read_rows)
        if fake_peer:
            _copy_peer_comms(model)
        optimizer = fabric.setup_optimizers(make_adamw(model, decay_names(model), TrainArgs(learning_rate=1e-3)))
        x, y = _fixed_batch(config, batch, seq, fabric.device)
        losses = []
        with PeakMemory(ctx.device) as step_peak:
            for _ in range(steps):
                loss = model(x, labels=y) / y.numel()
                fabric.backward(loss)
                optimizer_step(fabric, model, optimizer, max_norm=1.0)
                losses.append(float(loss))

        from torch.distributed.fsdp import FSDPModule

        def param_groups(state):  # torch 2.13 keeps a list of groups, older ones a group or None
            groups = getattr(state, "_fsdp_param_groups", None)
            return groups if groups is not None else [g for g in [getattr(state, "_fsdp_param_group", None)] if g]

        fsdp_params = [p for unit in model.modules() if isinstance(unit, FSDPModule)
                       for group in param_groups(unit._get_fsdp_state()) for p in group.fsdp_params]
        local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        return {
            "backend": "fake (emulated peer)" if fake_peer else plan.process_group_backend,
            "world_size": fabric.world_size, "model": f"{config.name} with {config.n_layer} layers",
            "batch": batch, "seq": seq, "steps": steps, "losses": [round(v, 4) for v in losses],
            "finite": all(v == v and abs(v) != float("inf") for v in losses),
            "nf4_weights": sum(1 for t in local if is_nf4(t)),
            "offloaded": bool(fsdp_params) and all(p.offload_to_cpu for p in fsdp_params),
            "parameters_on_cpu": all(t.device.type == "cpu" for t in local),
            "setup_peak_bytes": setup_peak.bytes, "step_peak_bytes": step_peak.bytes,
            "peak_source": step_peak.figures["source"],
        }
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            from toolkit.training.failures import release_process_group

            release_process_group()  # destroys the group and frees what holds its threads
        os.environ.clear()
        os.environ.update(saved_env)


def _copy_peer_comms(model) -> None:
    """FSDP's collectives on a fake 2-rank group, emulated: the peer holds what this rank holds.

    The all-gather copies this rank's slot into the peer's (a fake group leaves it as allocated,
    whatever the memory held); the reduce-scatter keeps this rank's rows of the full gradient.
    Every buffer is allocated as FSDP allocates it; only the values differ from a real 2-rank run.
    """
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    class PeerAllGather(AllGather):
        def allocate(self, size, *, dtype, device):
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            for slot in output_tensor.chunk(group.size()):
                if slot.data_ptr() != input_tensor.data_ptr():
                    slot.copy_(input_tensor)
            return None

    class PeerReduceScatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            output_tensor.copy_(input_tensor.chunk(group.size())[group.rank()])
            return None

    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.set_custom_all_gather(PeerAllGather())
            unit.set_custom_reduce_scatter(PeerReduceScatter())


# Three set-ups of the memory check: (name, finetune, activation checkpointing).
MEMORY_SETUPS = (("pretrain", None, False), ("lora", "lora", False), ("pretrain_checkpointing", None, True))


@check("memory", budget=100)
def memory(ctx: Context) -> dict:
    """Simulated against real peak memory of rank 0 of a 2-process FSDP FULL_SHARD step.

    The simulation runs the training step on fake tensors and a fake process group of 2 ranks. The
    real step is the same code on real tensors on the one GPU, with torch's fake process group of 2
    ranks in place of NCCL: collectives move no data, but every buffer (the rank's shards, the
    gathered weights, the reduce-scatter inputs) is really allocated, so the device's peak is that
    of rank 0 of a 2-GPU run. The step is `toolkit.memory.simulation.tracked_step`'s: one untracked step,
    then one of 2 micro-batches (no_backward_sync, clipping, the fused AdamW) measured.
    """
    config_name = ctx.pick("tiny-llama-1.1b", "debug")
    micro_batch, seq = ctx.pick((1, 2048), (1, 32))
    figures: dict = {"model": config_name, "micro_batch": micro_batch, "seq": seq, "world_size": 2,
                     "micro_batches": 2, "precision": "bf16-mixed", "sharding": "FULL_SHARD"}
    from toolkit.models.config import Config

    config = Config.from_name(config_name, n_layer=ctx.pick(22, 2))
    failures = []
    for name, finetune, checkpointing in MEMORY_SETUPS:
        # The real step first: its peak is recorded even when the simulation of it fails.
        real = _real_step_peak(ctx.device, config, finetune, checkpointing, micro_batch, seq)
        figures[name] = {
            "real_peak_bytes": real["peak_bytes"], "real_peak_gib": round(real["peak_bytes"] / GiB, 3),
            "real_reserved_peak_bytes": real.get("reserved_peak_bytes"), "real_source": real["source"],
            "real_allocated_before_bytes": real.get("allocated_before_bytes"),  # should be 0
        }
        start = time.perf_counter()
        try:
            sim = simulate(config=config, devices=2, micro_batch_size=micro_batch, max_seq_length=seq,
                           precision="bf16-mixed", sharding="FULL_SHARD", finetune=finetune,
                           activation_checkpointing=checkpointing, micro_batches=2)
        except Exception as error:
            figures[name]["simulation_error"] = f"{type(error).__name__}: {error}"
            failures.append(name)
            continue
        figures[name].update({
            "simulated_peak_bytes": sim.peak_total, "simulated_peak_gib": round(sim.peak_total / GiB, 3),
            "real_over_simulated": round(real["peak_bytes"] / sim.peak_total, 4) if sim.peak_total else None,
            "simulated_at_peak_gib": {k: round(v / GiB, 3) for k, v in sim.peak.items()},
            "simulation_seconds": round(time.perf_counter() - start, 1),
        })
    if failures:
        raise CheckFailed(f"the simulation failed for {failures} (see simulation_error)", figures)
    return figures


def _real_step_peak(device: str, config, finetune: Optional[str], checkpointing: bool, micro_batch: int, seq: int) -> dict:
    """Peak memory of rank 0's real training step, as the simulation builds and runs it (see `memory`)."""
    from contextlib import nullcontext

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from toolkit.args import DistributedArgs, TrainArgs
    from toolkit.models.adapters import LoRAArgs
    from toolkit.models.gpt import GPT, Block
    from toolkit.models.loss import loss_settings
    from toolkit.optim import decay_names, make_adamw
    from toolkit.parallel.fsdp import shard_model
    from toolkit.parallel.plan import mesh_layout, plan_strategy
    from toolkit.parallel.precision import apply_precision_policy
    from toolkit.training.fabric import sharded_strategy_class

    plan = plan_strategy(2, 1, "bf16-mixed", DistributedArgs(strategy="fsdp", sharding="FULL_SHARD",
                                                             activation_checkpointing=checkpointing), accelerator=device)
    import gc

    gc.collect()  # nothing of the previous set-up may count in this one's peak
    if device == "cuda":
        torch.cuda.empty_cache()
        left_over = torch.cuda.memory_allocated()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        shape, names = mesh_layout(plan.sharding, 1, 2)
        mesh = init_device_mesh(device, shape, mesh_dim_names=names)
        with torch.device("meta"):
            model = GPT(config)
        if finetune == "lora":
            from peft import get_peft_model

            model = get_peft_model(model, LoRAArgs().peft_config())
        apply_precision_policy(model, plan.precision)
        decay = decay_names(model)
        strategy = sharded_strategy_class()(plan, Block)
        shard_model(model, mesh, plan, Block)
        model.to_empty(device=device)
        generator = torch.Generator(device=device).manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                local.normal_(0.0, 0.02, generator=generator)
        train = TrainArgs()
        optimizer = make_adamw(model, decay, train)
        x = torch.randint(0, config.vocab_size, (micro_batch, seq), device=device, generator=generator)
        sync = strategy._backward_sync_control  # what Fabric's no_backward_sync uses in training
        autocast = torch.autocast(device, dtype=torch.bfloat16) if plan.precision.endswith("-mixed") else nullcontext()

        def step(micro_batches: int) -> None:
            for i in range(micro_batches):
                with sync.no_backward_sync(model, enabled=i < micro_batches - 1):
                    with autocast:
                        loss = model(x, labels=x)
                    (loss * 0.5).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), train.max_norm, error_if_nonfinite=False)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        # As the simulation: every fused-loss buffer allocated at each call, every row computed.
        with loss_settings(reuse_scratch=False, skip_ignored=False):
            step(1)  # AdamW's state and FSDP's gathered storages exist before the measured step
            with PeakMemory(device, absolute=True) as peak:
                step(2)
        return {**peak.figures, "allocated_before_bytes": left_over} if device == "cuda" else peak.figures
    finally:
        from toolkit.training.failures import release_process_group

        release_process_group()  # destroys the group and frees what holds its threads


def _throughput(ctx: Context, compiled: bool) -> dict:
    """benchmarks/train_throughput.py's synthetic mode: tokens/s and MFU of tiny-llama-1.1b, bf16-mixed."""
    preset = ctx.pick("tiny-llama-1.1b", "debug")
    micro, global_batch, seq = ctx.pick((4, 16, 2048), (1, 1, 32))
    warmup, steps = ctx.pick((2, 5), (1, 1))
    work = ctx.work / "train_throughput"
    results = work / "results.json"
    command = [
        sys.executable, str(REPO / "benchmarks" / "train_throughput.py"), "pretrain", "--tool", "toolkit",
        "--data", "synthetic", "--preset", preset, "--precision", "bf16-mixed", "--device", ctx.device,
        "--micro_batch", str(micro), "--global_batch", str(global_batch), "--seq", str(seq),
        "--warmup", str(warmup), "--steps", str(steps), "--compile", "true" if compiled else "false",
        "--work_dir", str(work), "--results", str(results),
    ]
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        raise CheckFailed(f"train_throughput.py exited with {run.returncode}: "
                          + (run.stdout + run.stderr).strip().splitlines()[-1], {"command": " ".join(command)})
    synthetic = json.loads(results.read_text())["synthetic"]
    keep = ("model", "precision", "device", "micro_batch", "global_batch", "seq", "steps", "warmup_steps",
            "seconds_per_step", "real_tokens_per_sec", "mfu", "flops_per_token", "device_peak_flops",
            "cuda_max_allocated_gib", "peak_rss_mib", "parameters")
    figures = {k: synthetic.get(k) for k in keep}
    figures["compiled"] = compiled
    log = Path(synthetic["log"]).read_text()
    figures["compiled_blocks"] = "transformer blocks compiled separately" in log
    if compiled and not figures["compiled_blocks"]:
        raise CheckFailed("the blocks were not compiled (see the log line of torch.compile)", figures)
    return figures


@check("throughput_eager", budget=80)
def throughput_eager(ctx: Context) -> dict:
    return _throughput(ctx, compiled=False)


@check("throughput_compiled", budget=150)
def throughput_compiled(ctx: Context) -> dict:
    return _throughput(ctx, compiled=True)


# ------------------------------------------------------------------------------------------------
# Running the checks


def child(argv: list[str]) -> None:
    """The named checks in this process, one after the other; each one's result is a line starting
    with RESULT_TAG (with its name)."""
    p = argparse.ArgumentParser()
    p.add_argument("names", nargs="+", choices=list(CHECKS))
    p.add_argument("--device", required=True)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--dry", action="store_true")
    a = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    for name in a.names:
        start = time.perf_counter()
        result: dict = {"name": name, "status": "ok", "figures": {}, "error": None}
        try:
            result["figures"] = CHECKS[name][0](Context(a.device, a.dry, a.work / name))
        except CheckFailed as failure:
            result.update(status="failed", figures=failure.figures, error=str(failure))
        except BaseException as error:  # recorded; the parent goes on with the next check
            traceback.print_exc()
            first_line = (str(error).strip().splitlines() or [""])[0]
            result.update(status="failed", error=f"{type(error).__name__}: {first_line}")
        result["seconds"] = round(time.perf_counter() - start, 1)
        print(RESULT_TAG + json.dumps(result, default=str), flush=True)


def run_checks(names: list[str], args, timeout: float, work: Path) -> dict[str, dict]:
    """Run the checks `names` in a process of their own (a new session, so a timeout kills its
    children too); name -> entry. A check without a result (a crash, the time limit) is recorded as
    failed or timed out, with the log's last lines."""
    log_path = work / (f"{names[0]}.log" if len(names) == 1 else "checks.log")
    command = [sys.executable, str(Path(__file__).resolve()), "_child", *names, "--device", args.device,
               "--work", str(work)] + (["--dry"] if args.dry else [])
    # The checkout first, then whatever PYTHONPATH already held (packages carried to a bare machine).
    path = os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            timed_out = True
    seconds = time.perf_counter() - start
    text = log_path.read_text(errors="replace")
    results = [json.loads(line[len(RESULT_TAG):]) for line in text.splitlines() if line.startswith(RESULT_TAG)]
    by_name = {result.pop("name"): result for result in results}
    entries = {}
    for name in names:
        entry = by_name.get(name)
        if entry is None:
            entry = {"status": "timeout" if timed_out else "failed", "figures": {}, "seconds": 0.0,
                     "error": f"no result after {seconds:.0f} s (limit {timeout:.0f} s)" if timed_out
                     else f"exit code {proc.returncode} without a result"}
        if entry["status"] != "ok":
            entry["log_tail"] = text.splitlines()[-15:]
        if len(names) == 1:
            entry["seconds"] = round(seconds, 1)  # the process's start-up included
        entry.update(limit_seconds=round(timeout, 1), log=str(log_path))
        entries[name] = entry
    return entries


def machine(args) -> dict:
    probe = ("import json, platform, torch; c = torch.cuda.is_available(); print(json.dumps({'torch': torch.__version__, "
             "'cuda_available': c, 'gpu': torch.cuda.get_device_name(0) if c else None, "
             "'gpu_memory_gib': round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if c else None, "
             "'cuda': torch.version.cuda, 'python': platform.python_version(), 'cpus': __import__('os').cpu_count()}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return {"probe_error": (out.stderr.strip().splitlines() or ["no output"])[-1]}


def write(path: Path, results: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    tmp.replace(path)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_child":
        child(argv[1:])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the JSON file to write (rewritten after every check)")
    p.add_argument("--dry", action="store_true", help="every check's code on the CPU with tiny sizes, gloo for NCCL")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for all checks (default 480 on a GPU, 300 dry); a check gets at most what is left")
    p.add_argument("--limit", type=float, default=None,
                   help="seconds each check may take (default: its own budget on a GPU, the whole budget dry)")
    p.add_argument("--only", default=None, help="comma-separated check names (default: all, in order)")
    p.add_argument("--work_dir", type=Path, default=None, help="logs and scratch files (default: a new temporary folder)")
    p.add_argument("--one_process", action="store_true",
                   help="all checks in one process, within the budget: no limit per check, and a crash loses the "
                        "checks after it, but one interpreter start-up (the tests' dry run)")
    args = p.parse_args(argv)
    args.device = "cpu" if args.dry else "cuda"
    names = list(CHECKS) if args.only is None else [n.strip() for n in args.only.split(",")]
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        p.error(f"unknown check(s) {unknown}; the checks are {list(CHECKS)}")
    budget = args.budget if args.budget is not None else (300.0 if args.dry else 480.0)
    deadline = time.perf_counter() + budget
    work = (args.work_dir or Path(tempfile.mkdtemp(prefix="gpu_check-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": args.device, "dry": args.dry, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                     "budget_seconds": budget, "work_dir": str(work), "machine": machine(args), "checks": {}}
    write(args.out, results)
    if not args.dry and not results["machine"].get("cuda_available"):
        print(f"no CUDA device visible ({results['machine']}); use --dry on a CPU", flush=True)
        results["error"] = "no CUDA device"
        write(args.out, results)
        return 2
    print(f"gpu_check on {results['machine'].get('gpu') or 'cpu'} (dry: {args.dry}), {budget:.0f} s for "
          f"{len(names)} checks; results: {args.out}", flush=True)

    def record(name: str, entry: dict) -> None:
        results["checks"][name] = entry
        write(args.out, results)
        why = f"  {entry['error']}" if entry.get("error") else ""
        print(f"{name:<22} {entry['status']:<8} {entry['seconds']:6.1f} s{why}", flush=True)

    if args.one_process:
        for name, entry in run_checks(names, args, budget, work).items():
            record(name, entry)
    else:
        for name in names:
            left = deadline - time.perf_counter()
            own = args.limit if args.limit is not None else (left if args.dry else CHECKS[name][1])
            if left < 10:
                record(name, {"status": "skipped", "figures": {}, "error": f"{left:.0f} s left of the budget",
                              "seconds": 0.0})
            else:
                record(name, run_checks([name], args, min(own, left), work)[name])
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    write(args.out, results)
    ok = sum(e["status"] == "ok" for e in results["checks"].values())
    print(f"{ok}/{len(names)} checks ok; results: {args.out}", flush=True)
    return 0 if ok == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
