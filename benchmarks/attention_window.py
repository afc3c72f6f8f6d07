"""Sliding-window and softcapped attention: forward + backward time and peak memory, one layer.

    OMP_NUM_THREADS=1 python benchmarks/attention_window.py                 # T=8192, window 1024
    OMP_NUM_THREADS=1 python benchmarks/attention_window.py --tokens 2048 --window 256 --rounds 1

One attention call, q (1, H, T, D) against k, v (1, G, T, D), float32, on the CPU, forward and
backward (the sum of the output as the loss). Each variant runs in a process of its own: one
warm-up call, then --repeats timed calls; --rounds such processes per variant, every variant once
per round (in alternating order), so that the shared machine's drift spreads over all; the median
over all timed calls is shown with its range. Peak memory is the growth of the process's peak RSS
over what it held once the inputs existed (the warm-up call reaches the peak), the largest of the
rounds.

Variants, all against the same inputs:
- causal           full causal attention, SDPA is_causal: what a window has to beat;
- window-mask      SDPA with a boolean (T, T) sliding-window mask (what the toolkit did before, and
                   what a mask built per layer costs: every (query, key) pair is computed);
- window-chunk-R   `toolkit.models.attention.windowed_attention`: one SDPA call per R queries
                   against the R + window - 1 keys they reach (R = 256 is the default);
- softcap-dense    softcapped scores the plain way (scores, tanh, mask, softmax, @ v, autograd):
                   what eager transformers and LitGPT do for Gemma 2; full causal and windowed;
- softcap-chunked  `chunked_attention` (chunks of queries, log-sum-exp kept, scores recomputed
                   in the backward pass); full causal and windowed;
- flex-*           compiled flex_attention with a block mask (and the softcap as a score_mod),
                   forward only: torch 2.13 has no flex backward pass on the CPU. Its first call
                   compiles; that time is shown apart.
Every variant's output is checked against SDPA with the dense mask (or the dense softcap) first.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = [
    "causal", "window-mask", "window-chunk-128", "window-chunk-256", "window-chunk-512", "window-chunk-1024",
    "softcap-dense-causal", "softcap-chunked-causal", "softcap-dense-window", "softcap-chunked-window",
    "flex-window", "flex-softcap-window",
]
SOFTCAP = 50.0


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_variant(name: str, T: int, window: int, H: int, G: int, D: int, repeats: int) -> dict:
    import torch
    import torch.nn.functional as F

    from toolkit.models.attention import chunked_attention, key_mask, windowed_attention

    torch.manual_seed(0)
    q = torch.randn(1, H, T, D, requires_grad=True)
    k = torch.randn(1, G, T, D, requires_grad=True)
    v = torch.randn(1, G, T, D, requires_grad=True)
    scale = D**-0.5
    windowed = "window" in name

    def dense_softcap(q, k, v):
        n = q.shape[2]
        mask = key_mask(0, n, 0, n, q.device, window if windowed else None)
        k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)
        scores = torch.tanh(q @ k.transpose(-1, -2) * scale / SOFTCAP) * SOFTCAP
        return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v

    def mask_sdpa(q, k, v):
        n = q.shape[2]
        mask = key_mask(0, n, 0, n, q.device, window)  # built per call, as a layer would
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=G != H)

    forward_only = name.startswith("flex")
    if name == "causal":
        fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=G != H)  # noqa: E731
    elif name == "window-mask":
        fn = mask_sdpa
    elif name.startswith("window-chunk-"):
        rows = int(name.rsplit("-", 1)[1])
        fn = lambda q, k, v: windowed_attention(q, k, v, None, window, rows=rows)  # noqa: E731
    elif name.startswith("softcap-dense"):
        fn = dense_softcap
    elif name.startswith("softcap-chunked"):
        fn = lambda q, k, v: chunked_attention(q, k, v, None, SOFTCAP, window if windowed else None)  # noqa: E731
    else:
        from toolkit.models.attention import attention_backend, flex_attend

        compiled = torch.compile(lambda q, k, v: flex_attend(q, k, v, None, window, SOFTCAP if "softcap" in name else None))

        def fn(q, k, v):
            with attention_backend("flex"):
                return compiled(q, k, v)

    def call():
        if forward_only:
            with torch.no_grad():
                fn(q.detach(), k.detach(), v.detach())
        else:
            fn(q, k, v).sum().backward()
            q.grad = k.grad = v.grad = None

    start_rss = rss_bytes()
    t0 = time.perf_counter()
    call()  # warm-up (compiles flex)
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # then correctness, on the first 2048 tokens (a problem of its own), against the dense computation
    reference_fn = dense_softcap if "softcap" in name else (mask_sdpa if windowed else None)
    error = None
    if reference_fn is not None and reference_fn is not fn:
        with torch.no_grad():
            qs, ks, vs = (t[:, :, : min(T, 2048)].detach() for t in (q, k, v))
            error = float((fn(qs, ks, vs) - reference_fn(qs, ks, vs)).abs().max())

    return dict(name=name, ms=1000 * statistics.median(times), first_ms=1000 * first,
                peak_mib=max(0, peak - start_rss) / 2**20, max_error=error, forward_only=forward_only)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--kv_heads", type=int, default=1)
    parser.add_argument("--head_size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1, help="timed calls per process, after one warm-up")
    parser.add_argument("--rounds", type=int, default=3, help="processes per variant, the variants taking turns")
    parser.add_argument("--only", default="", help="comma-separated variants (default: all)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = (args.tokens, args.window, args.heads, args.kv_heads, args.head_size, args.repeats)
    if args.child:
        print("RESULT " + json.dumps(run_variant(args.child, *shape)))
        return
    import torch

    print(f"torch {torch.__version__}, threads {os.environ.get('OMP_NUM_THREADS', 'default')}, "
          f"T={args.tokens}, window={args.window}, heads {args.heads} (kv {args.kv_heads}) x {args.head_size}, "
          f"float32; load average %.2f %.2f %.2f" % os.getloadavg(), flush=True)
    names = args.only.split(",") if args.only else VARIANTS
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for round_ in range(args.rounds):  # every variant once per round: the machine's drift spreads over all
        for name in names if round_ % 2 == 0 else names[::-1]:
            cmd = [sys.executable, __file__, "--child", name, "--tokens", str(args.tokens), "--window", str(args.window),
                   "--heads", str(args.heads), "--kv_heads", str(args.kv_heads), "--head_size", str(args.head_size),
                   "--repeats", str(args.repeats)]
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
            if line is None:
                print(f"{name}: failed\n{out.stderr[-2000:]}", flush=True)
                continue
            runs[name].append(json.loads(line[len("RESULT "):]))
            print(f"round {round_ + 1}: " + json.dumps(runs[name][-1]), flush=True)
    rows = [dict(r[0], ms=statistics.median(x["ms"] for x in r), peak_mib=max(x["peak_mib"] for x in r),
                 spread=(min(x["ms"] for x in r), max(x["ms"] for x in r))) for r in runs.values() if r]
    print("load average %.2f %.2f %.2f" % os.getloadavg())
    causal = next((r["ms"] for r in rows if r["name"] == "causal"), None)
    print(f"\nmedian of {args.rounds} rounds ({args.repeats} timed call(s) each after a warm-up)")
    print("| variant | forward + backward | min - max | vs causal | peak memory growth | first call | max abs error |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        what = "forward only" if r["forward_only"] else ""
        ratio = f"{r['ms'] / causal:.2f}x" if causal and not r["forward_only"] else ""
        err = "" if r["max_error"] is None else f"{r['max_error']:.1e}"
        low, high = r["spread"]
        print(f"| {r['name']} | {r['ms']:.0f} ms {what} | {low:.0f} - {high:.0f} | {ratio} | {r['peak_mib']:.0f} MiB | "
              f"{r['first_ms']:.0f} ms | {err} |")


if __name__ == "__main__":
    main()
