"""Attention sinks through the CUDA path: compiled flex_attention (Triton) differentiated through its
log-sum-exp, against the chunked path (`chunked_attention`) on the same GPU (checked on the CPU against a dense
reference by tests/test_attention.py).

Run on a machine with a CUDA GPU: `python tests/scripts/gpu_attention_sinks.py`. Prints one line per
case with the largest differences of the output and of the gradients of q, k, v and the sinks, and
exits non-zero if one is past its tolerance. Cases: causal, a 128-token window, packed documents
(through `segment_attention`), float32 and bfloat16, grouped-query heads.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from toolkit.models.attention import attend, attention_backend, segment_attention  # noqa: E402


def case(dtype, window, segments, T=512, B=2, H=8, G=2, D=64) -> bool:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, T, D, device="cuda", generator=g, dtype=dtype).requires_grad_()
    k = torch.randn(B, G, T, D, device="cuda", generator=g, dtype=dtype).requires_grad_()
    v = torch.randn(B, G, T, D, device="cuda", generator=g, dtype=dtype).requires_grad_()
    sinks = (torch.randn(H, device="cuda", generator=g) * 2 + 1).requires_grad_()
    upstream = torch.randn(B, H, T, D, device="cuda", generator=g, dtype=dtype)
    results = {}
    for backend in ("flex", "chunked"):
        with attention_backend(backend):
            if segments is None:
                out = attend(q, k, v, None, window, None, None, sinks)
            else:
                out = segment_attention(q, k, v, segments, None, window, None, sinks)
        grads = torch.autograd.grad((out.float() * upstream.float()).sum(), (q, k, v, sinks))
        results[backend] = (out, *grads)
    tolerance = 2e-4 if dtype == torch.float32 else 3e-2
    diffs = [(a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1.0)
             for a, b in zip(results["flex"], results["chunked"])]
    ok = all(d <= tolerance for d in diffs)
    names = ("out", "dq", "dk", "dv", "dsinks")
    shown = ", ".join(f"{n} {d:.2e}" for n, d in zip(names, diffs))
    print(f"{'ok ' if ok else 'BAD'} {str(dtype):15} window={window} packed={segments is not None}: {shown}")
    return ok


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    packed = torch.tensor([[200, 312], [512, 0]])
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        for window in (None, 128):
            for segments in (None, packed):
                ok &= case(dtype, window, segments)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
