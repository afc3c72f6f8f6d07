"""The output head's losses: summed cross-entropy and per-token log-probabilities of the labels.

Both come plain (from logits) and fused with the head's matrix product (`linear_*`, from the last
hidden states and the head's weight), which computes the (rows, V) logits a chunk of rows at a
time and never holds the (B * T, V) float32 logits. Labels equal to IGNORE_INDEX count for nothing.

How the fused functions run on the host is set from outside the model (`loss_settings`): the memory
simulation (`toolkit.memory.simulation`) runs them on fake tensors, which have no values to find ignored rows
by and must not be kept in scratch buffers.
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from toolkit.models import IGNORE_INDEX, LOSS_CHUNK_BYTES


@dataclasses.dataclass
class LossSettings:
    # Keep the fused loss's CPU chunk buffers between calls (`_scratch`). Off: allocate them at each
    # call, as on a GPU.
    reuse_scratch: bool = True
    # Default of the fused functions' `skip_ignored`, which also lets them read values on the host
    # (`_Chunks.softmax`); None: on a CPU (on a GPU, reading them makes the host wait for the
    # device). False where tensors have no values (fake tensors).
    skip_ignored: Optional[bool] = None


SETTINGS = LossSettings()


@contextmanager
def loss_settings(**changes) -> Iterator[LossSettings]:
    """`SETTINGS` with `changes` (fields of LossSettings) inside the block, as they were after it."""
    saved = dataclasses.replace(SETTINGS)
    for name, value in changes.items():
        if not hasattr(SETTINGS, name):
            raise TypeError(f"LossSettings has no field {name!r}")
        setattr(SETTINGS, name, value)
    try:
        yield SETTINGS
    finally:
        for f in dataclasses.fields(SETTINGS):
            setattr(SETTINGS, f.name, getattr(saved, f.name))


# ---------------------------------------------------------------------------- from logits
def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy in float32; labels equal to IGNORE_INDEX do not count."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def label_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits) (..., V), in float32, at each label (...); 0 where the label is IGNORE_INDEX."""
    valid = labels != IGNORE_INDEX
    picked = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.masked_fill(~valid, 0).unsqueeze(-1))
    return picked.squeeze(-1).masked_fill(~valid, 0.0)


# ---------------------------------------------------------------------------- fused with the head
def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    labels: torch.Tensor,
    chunk_rows: Optional[int] = None,
    skip_ignored: Optional[bool] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """`cross_entropy_sum(F.linear(hidden, weight, bias), labels)` without the full logits.

    hidden (..., E), weight (V, E), bias (V,) or None, labels (...). The rows are processed in
    chunks of `chunk_rows` (default: LOSS_CHUNK_BYTES of float32 logits). For each chunk the
    forward pass computes the logits, their float32 softmax, the loss, and at once the gradient
    of the loss with respect to `hidden`, `weight` and `bias` (softmax minus one-hot, pushed
    through the head). Only those gradients are kept for the backward pass, which scales them by
    the incoming gradient. Next to the plain computation this drops the (B * T, V) float32 logits,
    log-probabilities and their gradients from memory, and the same matrix products are done.
    Beside the kept gradients nothing of the head's size is made: the weight's 16-bit gradient is
    added up a piece of vocabulary rows at a time, and its scaled copy written chunk by chunk.

    Rows whose label is IGNORE_INDEX are left out before the head when `skip_ignored` (default:
    `SETTINGS.skip_ignored`, on a CPU unless set), so padding and masked prompts cost nothing;
    otherwise they are computed and weighted by 0, because finding them would make the host wait
    for the device.
    Under autocast the products run in the autocast dtype, as `nn.Linear` would; the softmax and
    the sums are float32.

    `softcap` c: the loss of the logits c * tanh(logits / c) (Gemma 2's final softcap), capped chunk
    by chunk; the gradient goes through the cap with the chunk's float32 tanh, one more chunk buffer.
    """
    hidden, labels, dtype, chunk_rows, skip_ignored = _prepare(hidden, weight, labels, chunk_rows, skip_ignored)
    # Under no_grad (validation) the Function still reports that its inputs require grad: ask here.
    want_grad = torch.is_grad_enabled()
    return _LinearCrossEntropySum.apply(hidden, weight, bias, labels, dtype, chunk_rows, skip_ignored, want_grad,
                                        softcap)


def linear_label_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    labels: torch.Tensor,
    chunk_rows: Optional[int] = None,
    skip_ignored: Optional[bool] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """`label_log_probs(F.linear(hidden, weight, bias), labels)` (...) without the full logits.

    What preference objectives (DPO and the like) need: each token's float32 log-probability of its
    label, 0 where the label is IGNORE_INDEX (a sequence's is `.sum(-1)`), differentiable with
    respect to `hidden`, `weight` and `bias`. Chunked as `linear_cross_entropy_sum`, with the same
    arguments, but the incoming gradient differs per row, so the gradients cannot be made in the
    forward pass: the backward pass computes each chunk's logits and softmax again (three matrix
    products per chunk in all, against two) and keeps nothing of the head's size in between.
    `softcap` as in `linear_cross_entropy_sum`.
    """
    shape = labels.shape
    hidden, labels, dtype, chunk_rows, skip_ignored = _prepare(hidden, weight, labels, chunk_rows, skip_ignored)
    return _LinearLabelLogProbs.apply(hidden, weight, bias, labels, dtype, chunk_rows, skip_ignored, softcap, shape)


def _prepare(hidden, weight, labels, chunk_rows, skip_ignored):
    """Rows (N, E) and labels (N,), the dtype of the products, and the defaults of the options."""
    E = hidden.shape[-1]
    hidden, labels = hidden.reshape(-1, E), labels.reshape(-1)
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type) and weight.is_floating_point():
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = weight.dtype
    if chunk_rows is None:
        chunk_rows = max(1, LOSS_CHUNK_BYTES // (4 * weight.shape[0]))
    if skip_ignored is None:
        skip_ignored = skips_ignored_rows(device_type)
    return hidden, labels, dtype, chunk_rows, skip_ignored


def skips_ignored_rows(device_type: str) -> bool:
    """Whether the fused head and loss leave out rows labelled IGNORE_INDEX by default on this
    device (`SETTINGS.skip_ignored`; unset: on a CPU)."""
    return SETTINGS.skip_ignored if SETTINGS.skip_ignored is not None else device_type == "cpu"


def _select_rows(labels: torch.Tensor, skip_ignored: bool) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(rows, mask): the indices of the labelled rows when skipping the others (None: every row is
    labelled), else the labelled rows' mask (B * T,) to weight the computed rows by."""
    valid = labels != IGNORE_INDEX
    if not skip_ignored:
        return None, valid
    rows = valid.nonzero().squeeze(1)
    return (None if rows.numel() == labels.numel() else rows), None


class _Chunks:
    """The chunked head shared by the fused functions: rows h (n, E) and labels y (n,) in `dtype`.

    One logits buffer and one float32 probabilities buffer serve every chunk (on CPU, every call:
    see _scratch). On CPU softmax writes over its input (each row is read before it is written);
    a 16-bit chunk is widened by a copy first, because the CPU's softmax with a dtype conversion is
    5x slower than a copy and an in-place softmax. `read_values`: the host may read the chunk's
    values (the functions' `skip_ignored`).
    """

    def __init__(self, h, w, b, y, dtype, chunk_rows, softcap=None, read_values=False) -> None:
        n = h.shape[0]
        if n:  # equal chunks: a small last chunk would stream the whole weight for a few rows
            chunk_rows = math.ceil(n / math.ceil(n / chunk_rows))
        self.h, self.w, self.b, self.y, self.dtype, self.chunk_rows = h, w, b, y, dtype, chunk_rows
        self.softcap, self.read_values = softcap, read_values
        self.shape = (min(chunk_rows, n), w.shape[0])
        device = h.device
        self.on_host = device.type == "cpu"
        self.in_place = dtype == torch.float32 and self.on_host
        self.logits_buf = _scratch(self.shape, dtype, device, 0)
        self.probs_buf = self.logits_buf if self.in_place else _scratch(self.shape, torch.float32, device, 1)
        self.vocab_rows = max(1, LOSS_CHUNK_BYTES // (4 * h.shape[1]))
        # a softcap's float32 tanh(logits / cap) of the chunk, for the gradient through the cap
        self.tanh_buf = None if softcap is None else _scratch(self.shape, torch.float32, device, 3)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        n = self.h.shape[0]
        return ((start, min(start + self.chunk_rows, n)) for start in range(0, n, self.chunk_rows))

    def softmax(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's float32 softmax (rows, V) (a scratch buffer) and log-probability of each label (rows,)."""
        hc, yc = self.h[start:end], self.y[start:end]
        logits = self.logits_buf[: end - start]
        if self.b is None:
            torch.mm(hc, self.w.t(), out=logits)
        else:
            torch.addmm(self.b, hc, self.w.t(), out=logits)
        if self.softcap is not None:  # logits = cap * tanh(logits / cap), the tanh kept in float32
            tanh = self.tanh_buf[: end - start]
            torch.div(logits, self.softcap, out=tanh).tanh_()
            torch.mul(tanh, self.softcap, out=logits)
        probs = self.probs_buf[: end - start]
        if self.read_values:
            # On the host the label's own probability gives log p(label), and the rare rows where
            # it underflowed are computed again exactly (`_exact_label_log_probs`): two passes over
            # the chunk fewer than below, about 5% of a small model's step on a CPU.
            if self.in_place:
                torch.softmax(logits, dim=1, out=probs)
            else:
                torch.softmax(probs.copy_(logits), dim=1, out=probs)
            picked = probs.gather(1, yc.unsqueeze(1)).squeeze(1).log()
            low = (picked < _LOWEST_EXACT_LOG_PROB).nonzero().squeeze(1)
            if low.numel():
                picked[low] = self._exact_label_log_probs(start + low)
            return probs, picked
        # log p(label) = (x_label - x_max) - log(sum_j exp(x_j - x_max)), and the largest
        # logit's probability is exp(0) / sum: the sum comes out of the softmax, so no
        # log-softmax pass is needed beside it (that probability is at least 1/V: it never
        # underflows), and no value is read on the host (a GPU would wait for it).
        top = logits.amax(1, keepdim=True)  # (rows, 1)
        shift = (logits.gather(1, yc.unsqueeze(1)).float() - top.float()).squeeze(1)
        if self.in_place:
            torch.softmax(logits, dim=1, out=probs)
        elif self.on_host:
            torch.softmax(probs.copy_(logits), dim=1, out=probs)
        else:
            torch.softmax(logits, dim=1, dtype=torch.float32, out=probs)
        return probs, shift + probs.amax(1).log()

    def _exact_label_log_probs(self, rows: torch.Tensor) -> torch.Tensor:
        """log p(label) (k,) float32 of the chunk rows `rows` (k,), from their logits made again."""
        # the operations of `softmax` on these rows, so that their logits round as the chunk's did
        logits = torch.empty((rows.shape[0], self.w.shape[0]), dtype=self.dtype, device=rows.device)
        if self.b is None:
            torch.mm(self.h[rows], self.w.t(), out=logits)
        else:
            torch.addmm(self.b, self.h[rows], self.w.t(), out=logits)
        if self.softcap is not None:
            tanh = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
            torch.div(logits, self.softcap, out=tanh).tanh_()
            torch.mul(tanh, self.softcap, out=logits)
        logits = logits.float()
        return logits.gather(1, self.y[rows].unsqueeze(1)).squeeze(1) - torch.logsumexp(logits, dim=1)

    def through_softcap(self, grad: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """The float32 gradient of the chunk's capped logits (rows, V) made that of the logits before
        the cap, in place: times 1 - tanh^2 (the chunk's last `softmax` call kept its tanh)."""
        if self.softcap is None:
            return grad
        return grad.mul_(self.tanh_buf[: end - start].square_().neg_().add_(1.0))

    def in_dtype(self, grad: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """A float32 gradient of the chunk's logits in the products' dtype (a scratch buffer)."""
        if self.dtype == torch.float32:
            return grad
        return _scratch(self.shape, self.dtype, grad.device, 2)[: end - start].copy_(grad)

    def add_weight_grad(self, grad_w: torch.Tensor, grad: torch.Tensor, start: int, end: int) -> None:
        """grad_w (V, E) float32 += grad^T h of the chunk (grad in the products' dtype); the first chunk writes it."""
        hc = self.h[start:end]
        if self.dtype != torch.float32:
            # The 16-bit product (V, E) is added to the float32 gradient a piece of
            # vocabulary rows at a time (as many elements as a chunk of logits): whole,
            # it would be a second copy of the head beside grad_w (1 GB for Llama-3).
            # (The product is let go before the next one is made: on a GPU both would be alive.)
            for v in range(0, grad_w.shape[0], self.vocab_rows):
                piece = slice(v, v + self.vocab_rows)
                into = _scratch(tuple(grad_w[piece].shape), self.dtype, hc.device, 4)  # kept on a CPU
                (grad_w[piece].add_ if start else grad_w[piece].copy_)(torch.mm(grad[:, piece].t(), hc, out=into))
                del into
        elif start:
            grad_w.addmm_(grad.t(), hc)
        else:
            torch.mm(grad.t(), hc, out=grad_w)


class _LinearCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, dtype, chunk_rows, skip_ignored, want_grad, softcap):
        n_rows, E = hidden.shape
        need_h, need_w = want_grad and ctx.needs_input_grad[0], want_grad and ctx.needs_input_grad[1]
        need_b = want_grad and bias is not None and ctx.needs_input_grad[2]
        need_grad = need_h or need_w or need_b
        device = hidden.device
        rows, mask = _select_rows(labels, skip_ignored)
        with torch.autocast(device.type, enabled=False):
            h = hidden if rows is None else hidden.index_select(0, rows)
            y = labels if rows is None else labels.index_select(0, rows)
            if mask is not None:
                y = y.masked_fill(~mask, 0)  # any valid class: these rows are weighted by 0 below
            h, w = h.to(dtype), weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
            n = h.shape[0]
            loss = torch.zeros((), dtype=torch.float32, device=device)
            grad_h = torch.empty((n, E), dtype=dtype, device=device) if need_h else None
            grad_w = None
            if need_w:  # the first chunk writes it (no zero-fill), unless there is no chunk at all
                grad_w = (torch.empty if n else torch.zeros)(weight.shape, dtype=torch.float32, device=device)
            grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=device) if need_b else None
            chunks = _Chunks(h, w, b, y, dtype, chunk_rows, softcap, read_values=skip_ignored)
            for start, end in chunks:
                probs, picked = chunks.softmax(start, end)  # log-probability of each label
                if mask is not None:
                    loss -= (picked * mask[start:end]).sum()
                else:
                    loss -= picked.sum()
                if not need_grad:
                    continue
                grad = probs  # d(loss)/d(logits) = softmax - one_hot(label)
                grad.scatter_add_(1, y[start:end].unsqueeze(1), grad.new_full((end - start, 1), -1.0))
                if mask is not None:
                    grad.mul_(mask[start:end].unsqueeze(1))
                grad = chunks.through_softcap(grad, start, end)
                if need_b:
                    grad_b += grad.sum(0)
                grad = chunks.in_dtype(grad, start, end)
                if need_h:
                    torch.mm(grad, w, out=grad_h[start:end])
                if need_w:
                    chunks.add_weight_grad(grad_w, grad, start, end)
        ctx.n_rows, ctx.dtypes = n_rows, (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(grad_h, grad_w, grad_b, rows)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if getattr(ctx, "done", False):  # the kept float32 gradients were scaled in place (below)
            raise RuntimeError("The fused loss's backward pass runs once per forward pass (no retain_graph).")
        ctx.done = True
        grad_h, grad_w, grad_b, rows = ctx.saved_tensors
        h_dtype, w_dtype, b_dtype = ctx.dtypes
        d_hidden = d_weight = d_bias = None
        if grad_h is not None:
            d_hidden = (grad_h * grad_loss).to(h_dtype)
            if rows is not None:
                d_hidden = d_hidden.new_zeros((ctx.n_rows, d_hidden.shape[1])).index_copy_(0, rows, d_hidden)
        # A float32 weight's (and bias's) kept gradient is scaled where it is and handed on: a
        # scaled copy beside it was a second V x E float32 matrix at the peak of a float32 step
        # (the head gathered, its kept gradient and the copy). Nothing else holds it: the forward
        # pass saved it for this backward pass only.
        if grad_w is not None:
            d_weight = grad_w.mul_(grad_loss) if w_dtype == torch.float32 else _scaled(grad_w, grad_loss, w_dtype)
        if grad_b is not None:
            d_bias = grad_b.mul_(grad_loss) if b_dtype == torch.float32 else _scaled(grad_b, grad_loss, b_dtype)
        return d_hidden, d_weight, d_bias, None, None, None, None, None, None


class _LinearLabelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, dtype, chunk_rows, skip_ignored, softcap, shape):
        device = hidden.device
        rows, mask = _select_rows(labels, skip_ignored)
        with torch.autocast(device.type, enabled=False):
            chunks = _chunked(hidden, weight, bias, labels, rows, mask, dtype, chunk_rows, softcap, skip_ignored)
            picked = torch.empty(chunks.h.shape[0], dtype=torch.float32, device=device)
            for start, end in chunks:
                picked[start:end] = chunks.softmax(start, end)[1]
            if mask is not None:
                picked = picked.masked_fill(~mask, 0.0)
            # Made in the labels' shape and filled through a flat view: a view returned from here
            # would be a view to FSDP, which warns that an in-place op on it would skip its hooks.
            out = picked.new_zeros(shape)
            if rows is not None:
                out.view(-1).index_copy_(0, rows, picked)
            else:
                out.view(-1).copy_(picked)
        ctx.dtype, ctx.chunk_rows, ctx.softcap, ctx.read_values = dtype, chunk_rows, softcap, skip_ignored
        ctx.save_for_backward(hidden, weight, bias, labels, rows, mask)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, labels, rows, mask = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        device = hidden.device
        with torch.autocast(device.type, enabled=False):
            chunks = _chunked(hidden, weight, bias, labels, rows, mask, ctx.dtype, ctx.chunk_rows, ctx.softcap,
                              ctx.read_values)
            n, E = chunks.h.shape
            g = grad_out.reshape(-1).float()  # (N,): d(out)/d(log p(label)) of each row
            if mask is not None:
                g = g * mask
            if rows is not None:
                g = g.index_select(0, rows)
            grad_h = torch.empty((n, E), dtype=ctx.dtype, device=device) if need_h else None
            grad_w = (torch.empty if n else torch.zeros)(weight.shape, dtype=torch.float32, device=device) if need_w else None
            grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=device) if need_b else None
            for start, end in chunks:
                grad, _ = chunks.softmax(start, end)
                # d(log p(label))/d(logits) = one_hot(label) - softmax, times the row's incoming gradient
                grad.scatter_add_(1, chunks.y[start:end].unsqueeze(1), grad.new_full((end - start, 1), -1.0))
                grad.mul_(-g[start:end].unsqueeze(1))
                grad = chunks.through_softcap(grad, start, end)
                if need_b:
                    grad_b += grad.sum(0)
                grad = chunks.in_dtype(grad, start, end)
                if need_h:
                    torch.mm(grad, chunks.w, out=grad_h[start:end])
                if need_w:
                    chunks.add_weight_grad(grad_w, grad, start, end)
            d_hidden = None if grad_h is None else grad_h.to(hidden.dtype)
            if d_hidden is not None and rows is not None:
                d_hidden = d_hidden.new_zeros(hidden.shape).index_copy_(0, rows, d_hidden)
            d_weight = None if grad_w is None else grad_w.to(weight.dtype)
            d_bias = None if grad_b is None else grad_b.to(bias.dtype)
        return d_hidden, d_weight, d_bias, None, None, None, None, None, None


def _chunked(hidden, weight, bias, labels, rows, mask, dtype, chunk_rows, softcap=None, read_values=False) -> _Chunks:
    """The labelled rows (all of them, ignored ones pointed at class 0, with `mask`) as `_Chunks`."""
    h = hidden if rows is None else hidden.index_select(0, rows)
    y = labels if rows is None else labels.index_select(0, rows)
    if mask is not None:
        y = y.masked_fill(~mask, 0)  # any valid class: these rows are weighted by 0
    b = None if bias is None else bias.to(dtype)
    return _Chunks(h.to(dtype), weight.to(dtype), b, y, dtype, chunk_rows, softcap, read_values)


def _scaled(grad: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`(grad * scale).to(dtype)` for a float32 gradient kept by the forward pass, written into
    `dtype` LOSS_CHUNK_BYTES of rows at a time.

    Unchunked, the float32 product lives beside the saved gradient and the result: for the head's
    weight (V, E) gathered in 16 bits, a second float32 V x E matrix at the peak of the step (2 GB
    for Llama-3's head). `torch.mul(..., out=)` rounds the float32 product once into `dtype`, as
    `.to` does; CUDA casts as it writes, the CPU through a temporary of one chunk.
    """
    out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
    row_bytes = grad[0].numel() * 4 if grad.dim() > 1 else 4
    rows = max(1, LOSS_CHUNK_BYTES // row_bytes)
    for start in range(0, grad.shape[0], rows):
        torch.mul(grad[start : start + rows], scale, out=out[start : start + rows])
    return out


# Below this log-probability (float32's exp underflows near -87.3; its subnormals lose precision
# from -87.3 on) a label's probability read from the softmax is not exact: its row is made again.
_LOWEST_EXACT_LOG_PROB = -80.0

_SCRATCH: dict = {}


def _scratch(shape: tuple[int, int], dtype: torch.dtype, device: torch.device, slot: int) -> torch.Tensor:
    """A reusable (rows, V) buffer for the fused loss's logits.

    On CPU a fresh buffer of this size (hundreds of MB) is memory-mapped anew at every call, and
    writing it first costs a page fault per 4 KiB (~40% of the time of the matrix product that fills
    it), so the largest buffer asked for is kept and reused (one per dtype and slot, at most
    LOSS_CHUNK_BYTES each) unless `SETTINGS.reuse_scratch` is off. CUDA's caching allocator already
    reuses memory: other devices allocate.
    """
    numel = shape[0] * shape[1]
    if device.type != "cpu" or not SETTINGS.reuse_scratch:
        return torch.empty(shape, dtype=dtype, device=device)
    key = (dtype, slot)
    buffer = _SCRATCH.get(key)
    if buffer is None or buffer.numel() < numel:
        _SCRATCH.pop(key, None)
        buffer = _SCRATCH[key] = torch.empty(numel, dtype=dtype)
    return buffer[:numel].view(shape)
