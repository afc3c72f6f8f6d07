"""Causal self-attention, and the one function that says which keys each query sees.

Shapes: B batch, T queries in this call, S keys (cached ones included), H query heads, G key/value
heads (query groups), D head size.

Which keys a query sees is said in one place, `key_mask`: causal, a query's sliding window, a KV
cache's earlier slots and left padding. Scores become outputs in one place, `attend`, which picks
the kernel: plain causal attention is one SDPA call; a sliding window, a softcap or attention
sinks never build a (T, S) mask but run block-sparse (flex_attention on CUDA; chunks of queries
against the keys they reach elsewhere, `windowed_attention` and `chunked_attention`). Packed
samples (`document_segments`) are attended one sample at a time (`segment_attention`), each as a
sequence of its length, so windows, softcaps and sinks compose with packing.

Under torch.compile the per-sample loop runs eagerly between two compiled graphs (projections and
rotary embedding before it, the output projection after it): traced, its Python loop over sample
lengths would be guarded on, and every new packing layout would compile again.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor  # imported by torch itself

from toolkit.models.config import Config
from toolkit.models.kv_cache import KVCache
from toolkit.models.norms import make_norm
from toolkit.models.rope import apply_rope
from toolkit.models.switch import Switch


def key_mask(
    q_start: int, n_queries: int, k_start: int, n_keys: int, device, window: Optional[int] = None,
    left_padding: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Which keys each query sees: queries at slots [q_start, q_start + n_queries), keys at slots
    [k_start, k_start + n_keys); boolean (n_queries, n_keys), or (B, 1, n_queries, n_keys) with padding.

    Query q sees key slot s when s <= q (causal), q - s < window (its last `window` tokens, itself
    included), and s >= left_padding[b] (not its row's padding; a padding query sees itself only,
    as a query that sees nothing would give NaN).
    """
    key = torch.arange(k_start, k_start + n_keys, device=device)[None, :]  # (1, n_keys)
    query = torch.arange(q_start, q_start + n_queries, device=device)[:, None]  # (n_queries, 1)
    mask = key <= query
    if window is not None:
        mask = mask & (key > query - window)
    if left_padding is not None:
        real = key >= left_padding[:, None, None]  # (B, 1, n_keys)
        mask = (mask & real | (key == query))[:, None]  # (B, 1, n_queries, n_keys)
    return mask


def attention_mask(
    T: int, S: int, device, window: Optional[int] = None, left_padding: Optional[torch.Tensor] = None
) -> tuple[Optional[torch.Tensor], bool]:
    """(mask, is_causal) for SDPA: T queries, the last T of S key slots (query i is slot S - T + i).

    Where plain causal attention says all of it (no padding, no earlier slots, no key beyond a
    window), the mask is None and `is_causal` says whether queries see only earlier keys (T > 1)
    or every key (one query at the last slot). Otherwise the mask is `key_mask`'s.
    """
    start = S - T
    if left_padding is None and (start == 0 or T == 1) and (window is None or S <= window):
        # A branch, not `T > 1` itself: compiled with dynamic shapes that is a symbolic bool, which SDPA refuses.
        return None, True if T > 1 else False  # noqa: SIM210
    return key_mask(start, T, 0, S, device, window, left_padding), False


# ---------------------------------------------------------------------------- one attention call
# Which kernel runs a window, a softcap or sinks: "flex" (flex_attention, compiled: block-sparse, the
# softcap as a score_mod, the sinks through its log-sum-exp), "chunked" (the chunked paths below,
# over SDPA or, with a softcap or sinks, plain products), or None: flex on CUDA, chunked elsewhere
# (torch 2.13's flex_attention has no backward pass on the CPU). See `attention_backend` and
# benchmarks/README.md (Attention windows).
KERNEL = Switch("attention backend", None, (None, "flex", "chunked"))
# Queries per SDPA call of a sliding-window layer: each call sees chunk + window - 1 keys.
WINDOW_CHUNK = 256
# Queries per chunk of `chunked_attention`, fewer where their float32 scores (batch x heads x queries
# x keys) would pass SCORE_CHUNK_BYTES. Measured at T=8192 (benchmarks/attention_window.py): 128
# rows against 256 to 1024 was 14-55% faster with a 1024-token window and 8-28% without.
SCORE_CHUNK_ROWS = 128
SCORE_CHUNK_BYTES = 16 << 20


def attention_backend(name: Optional[str]):
    """Inside the `with` block, windows and softcaps run through `name` ("flex", "chunked"; None: by device)."""
    return KERNEL.use(name)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None, window: Optional[int] = None,
    softcap: Optional[float] = None, left_padding: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """softmax(cap(q k^T * scale) where the query sees the key) v: q (B, H, T, D) at the last T of
    the S key slots of k and v (B, G, S, D) -> (B, H, T, D).

    Which keys a query sees: `key_mask` (causal, the `window`, `left_padding`). `scale` defaults to
    1 / sqrt(D); `softcap` c makes each score c * tanh(score / c). `sinks` (H,): attention sinks, a
    learned logit per head joining every query's softmax as one more key whose value is zero (with
    log Z the log-sum-exp of a query's scores, its output is y * sigmoid(log Z - sink)).

    Plain causal attention is one SDPA call. A window that matters, a softcap or sinks run
    block-sparse, never through a (T, S) mask: on CUDA through flex_attention; elsewhere a window
    alone through one SDPA call per chunk of queries (`windowed_attention`), a softcap or sinks
    through `chunked_attention`. Decoding (T = 1) looks at one window of keys.
    """
    T, S = q.shape[2], k.shape[2]
    window = None if window is not None and window >= S else window  # a window as long as the keys is none
    if window is None and softcap is None and sinks is None:
        mask, is_causal = attention_mask(T, S, q.device, None, left_padding)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
        )
    if _use_flex(q, T, S, left_padding):
        return flex_attend(q, k, v, scale, window, softcap, sinks=sinks)
    if softcap is not None or sinks is not None:
        return chunked_attention(q, k, v, scale, softcap, window, left_padding, sinks=sinks)
    return windowed_attention(q, k, v, scale, window, left_padding)


def _use_flex(q: torch.Tensor, T: int, S: int, left_padding: Optional[torch.Tensor]) -> bool:
    """flex_attention for whole sequences: by default on CUDA when gradients are wanted (training,
    whose sequence length is fixed). Generation and evaluation (no gradients: prompts of every
    length, one token at a time, padded batches) take the chunked paths, which need no compilation;
    compiled flex kernels are specialised to one length and would compile again for each."""
    name = KERNEL.value or ("flex" if q.device.type == "cuda" and torch.is_grad_enabled() else "chunked")
    return name == "flex" and T == S and left_padding is None


def _query_chunks(T: int, S: int, rows: int, window: Optional[int]) -> Iterator[tuple[int, int, int, int]]:
    """(first, end) of each chunk of `rows` queries (0-based among the T) and (lo, hi): the key slots
    it may see (the last T of S slots are the queries'; a window bounds the earliest key)."""
    start = S - T
    for first in range(0, T, rows):
        end = min(first + rows, T)
        lo = 0 if window is None else max(0, start + first - window + 1)
        yield first, end, lo, start + end


def windowed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float], window: int,
    left_padding: Optional[torch.Tensor] = None, rows: Optional[int] = None,
) -> torch.Tensor:
    """Sliding-window attention as one SDPA call per chunk of `rows` queries (default WINDOW_CHUNK),
    each against the rows + window - 1 keys it can reach, with that chunk's small mask: T x (rows +
    window) scores in all instead of T x S, and what autograd keeps is the chunks' inputs and
    outputs (SDPA recomputes its scores in its backward pass). Shapes as `attend`."""
    T, S = q.shape[2], k.shape[2]
    gqa = k.shape[1] != q.shape[1]
    parts = []
    for first, end, lo, hi in _query_chunks(T, S, rows or WINDOW_CHUNK, window):
        mask = key_mask(S - T + first, end - first, lo, hi - lo, q.device, window, left_padding)
        parts.append(F.scaled_dot_product_attention(
            q[:, :, first:end], k[:, :, lo:hi], v[:, :, lo:hi], attn_mask=mask, scale=scale, enable_gqa=gqa
        ))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def chunked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float], softcap: Optional[float] = None,
    window: Optional[int] = None, left_padding: Optional[torch.Tensor] = None, rows: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention chunk by chunk of queries, as a flash-attention kernel does it: the forward pass
    keeps each query's log-sum-exp (B, H, T) and its output, never the scores, and the backward
    pass computes each chunk's scores again. For what SDPA cannot do: softcapped scores and
    attention sinks (`sinks` (H,): one more logit per head in every query's softmax, whose value is
    zero). A chunk holds `rows` queries (default: SCORE_CHUNK_ROWS, or as many as SCORE_CHUNK_BYTES
    of float32 scores hold) against the keys it can reach (all earlier ones, or its window). The
    products run in the inputs' dtype, the softmax and its gradient in float32. Shapes as `attend`."""
    B, H, T, D = q.shape
    S = k.shape[2]
    if rows is None:  # a chunk of r queries reaches r + window - 1 keys (or all S)
        reach = S if window is None else min(S, SCORE_CHUNK_ROWS + window)
        rows = min(SCORE_CHUNK_ROWS, max(16, SCORE_CHUNK_BYTES // (4 * B * H * reach)))
    scale = D**-0.5 if scale is None else scale
    if sinks is None:
        sinks = q.new_empty(0)  # autograd.Function takes tensors, not None, for a tensor it may differentiate
    return _ChunkedAttention.apply(q, k, v, sinks, scale, softcap, window, left_padding, rows)


class _ChunkedAttention(torch.autograd.Function):
    """`chunked_attention`. Queries are grouped by their key/value head: q (B, G, H / G, T, D)
    against k, v (B, G, 1, S, D), so grouped-query attention never copies a key.

    With sinks, each query's log-sum-exp takes in its head's sink (lse = log(exp(lse) + exp(sink)))
    and the probabilities of the real keys are exp(score - lse): they sum to less than one, the
    rest going to the sink, whose value is zero. Its gradient is -sum over queries of p_sink * delta
    (delta = sum over keys of probs * d(probs), as for any score whose d(prob) is zero)."""

    @staticmethod
    def _probs(qc, kc, scale, softcap, mask, lse=None, sinks=None):
        """Float32 tanh(scores / cap) (None without a cap) and probabilities (B, G, R, rows, keys) of
        a chunk, with its log-sum-exp (B, G, R, rows), the sinks' logits (G, R, 1) taken in (computed,
        or the forward pass's `lse`). Without `lse` (the forward pass) the tanh is not kept: its
        buffer becomes the probabilities."""
        scores = (qc @ kc.transpose(-1, -2)).float().mul_(scale if softcap is None else scale / softcap)
        tanh = None
        if softcap is not None:
            tanh = scores.tanh_()
            scores = tanh.mul_(softcap) if lse is None else tanh * softcap
        scores = scores.masked_fill_(~mask, float("-inf"))
        if lse is None:
            lse = torch.logsumexp(scores, dim=-1)
            if sinks is not None:
                lse = torch.logaddexp(lse, sinks)
        return tanh, scores.sub_(lse[..., None]).exp_(), lse

    @staticmethod
    def forward(ctx, q, k, v, sinks, scale, softcap, window, left_padding, rows):
        B, H, T, D = q.shape
        G, S = k.shape[1], k.shape[2]
        qg = q.reshape(B, G, H // G, T, D)
        kg, vg = k[:, :, None], v[:, :, None]  # (B, G, 1, S, D)
        sink = sinks.float().view(G, H // G, 1) if sinks.numel() else None  # (G, R, 1): per query head
        out = torch.empty_like(qg)
        lse = torch.empty((B, G, H // G, T), dtype=torch.float32, device=q.device)
        for first, end, lo, hi in _chunks_to_compute(q, T, S, rows, window):
            mask = _chunk_mask(S - T + first, end - first, lo, hi - lo, q.device, window, left_padding)
            _, probs, lse[..., first:end] = _ChunkedAttention._probs(
                qg[..., first:end, :], kg[..., lo:hi, :], scale, softcap, mask, sinks=sink)
            out[..., first:end, :] = probs.to(v.dtype) @ vg[..., lo:hi, :]
        ctx.save_for_backward(q, k, v, sinks, out, lse, left_padding)
        ctx.settings = (scale, softcap, window, rows)
        return out.view(B, H, T, D)

    @staticmethod
    def backward(ctx, grad_out):
        with torch.autocast(grad_out.device.type, enabled=False):  # float32 throughout, whoever calls backward
            return _ChunkedAttention._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        q, k, v, sinks, out, lse, left_padding = ctx.saved_tensors
        scale, softcap, window, rows = ctx.settings
        B, H, T, D = q.shape
        G, S = k.shape[1], k.shape[2]
        qg = q.reshape(B, G, H // G, T, D)
        kg, vg = k[:, :, None], v[:, :, None]
        dout = grad_out.reshape(B, G, H // G, T, D).float()
        delta = (dout * out.float()).sum(-1)  # (B, G, R, T): sum over keys of probs * d(probs)
        dq = torch.empty(qg.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros((B, G, S, D), dtype=torch.float32, device=q.device)
        dv = torch.zeros_like(dk)
        for first, end, lo, hi in _chunks_to_compute(q, T, S, rows, window):
            mask = _chunk_mask(S - T + first, end - first, lo, hi - lo, q.device, window, left_padding)
            qc, kc, vc = qg[..., first:end, :], kg[..., lo:hi, :], vg[..., lo:hi, :]
            tanh, probs, _ = _ChunkedAttention._probs(qc, kc, scale, softcap, mask, lse[..., first:end])
            doc = dout[..., first:end, :]
            dv[:, :, lo:hi] += (probs.transpose(-1, -2) @ doc).sum(2)
            # d(score) = probs * (d(probs) - delta); through cap * tanh(x / cap): * (1 - tanh^2)
            grad = probs.mul_((doc @ vc.float().transpose(-1, -2)).sub_(delta[..., first:end, None]))
            if tanh is not None:
                grad.mul_(tanh.square_().neg_().add_(1.0))
            grad.mul_(scale)
            dq[..., first:end, :] = grad @ kc.float()
            dk[:, :, lo:hi] += (grad.transpose(-1, -2) @ qc.float()).sum(2)
        dsinks = None
        if sinks.numel():  # p_sink (B, G, R, T) = exp(sink - lse); d(sink) = -sum of p_sink * delta
            p_sink = (sinks.float().view(G, H // G, 1) - lse).exp_()
            dsinks = -(p_sink * delta).sum(dim=(0, 3)).view(H).to(sinks.dtype)
        return (dq.view(B, H, T, D).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks,
                None, None, None, None, None)


def _chunks_to_compute(q: torch.Tensor, T: int, S: int, rows: int, window: Optional[int]) -> list[tuple[int, ...]]:
    """`_query_chunks`; on fake tensors (the memory estimate and the simulated step, which compute no
    values) the chunk with the most scores twice, in place of hundreds dispatched one op at a time:
    its buffers are the largest any chunk allocates, and the second pass allocates them while the
    first pass's are still held by the loop's variables, as one chunk's are during the next's. The
    same saved tensors and the loop's peak, or above it by the difference between the largest chunk
    and the one before it (tests/test_attention.py). The pre-flight of config_hub's gpt-oss-120b
    LoRA recipe (2 x 2048 tokens): 13.8 s to 2.0 s on one core (benchmarks/preflight_time.py)."""
    chunks = list(_query_chunks(T, S, rows, window))
    if len(chunks) > 2 and isinstance(q, FakeTensor):
        largest = max(chunks, key=lambda c: (c[1] - c[0]) * (c[3] - c[2]))
        return [largest, largest]
    return chunks


def _chunk_mask(q_start, n_queries, k_start, n_keys, device, window, left_padding) -> torch.Tensor:
    """`key_mask` shaped for scores (B, G, R, rows, keys)."""
    mask = key_mask(q_start, n_queries, k_start, n_keys, device, window, left_padding)
    return mask if mask.dim() == 2 else mask[:, :, None]  # (B, 1, 1, rows, keys)


_BLOCK_MASKS: dict = {}  # (T, window, device) -> flex_attention's BlockMask, without documents
_FLEX: dict = {}  # the compiled flex_attention


def flex_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float], window: Optional[int],
    softcap: Optional[float], document_ids: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """`attend` (T = S, no padding) through flex_attention: the causal mask, the window and the
    documents of a packed row (`document_ids` (B, T)) as a block mask, whose blocks that no query
    sees are skipped (O(T * window) work for a window), and the softcap as a score_mod. Compiled
    (`torch.compile(flex_attention)`; inside a compiled model, traced into its graph).

    `sinks` (H,): the output scaled by sigmoid(lse - sink) with the kernel's log-sum-exp (B, H, T),
    through which gradients flow (torch 2.13's Triton backward takes d(lse); its experimental
    "FLASH" backend, which the toolkit does not ask for, refuses it)."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    B, H, T, D = q.shape

    def sees(b, h, q_idx, kv_idx):
        seen = kv_idx <= q_idx
        if window is not None:
            seen = seen & (q_idx - kv_idx < window)
        if document_ids is not None:
            seen = seen & (document_ids[b, q_idx] == document_ids[b, kv_idx])
        return seen

    def cap(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    compiling = torch.compiler.is_compiling()
    key = (T, window, q.device)
    block_mask = None if document_ids is not None or compiling else _BLOCK_MASKS.get(key)
    if block_mask is None:
        block_mask = create_block_mask(sees, None if document_ids is None else B, None, T, T, device=q.device)
        if document_ids is None and not compiling:
            if len(_BLOCK_MASKS) >= 8:  # a few (length, window) pairs: the layer kinds of the lengths in use
                _BLOCK_MASKS.pop(next(iter(_BLOCK_MASKS)))
            _BLOCK_MASKS[key] = block_mask
    kernel = flex_attention if compiling or q.device.type != "cuda" else _compiled_flex()
    score_mod = None if softcap is None else cap
    if sinks is None:
        return kernel(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=k.shape[1] != H)
    out, aux = kernel(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=k.shape[1] != H,
                      return_aux=AuxRequest(lse=True))
    kept = torch.sigmoid(aux.lse - sinks.float()[:, None])  # (B, H, T): the share of the real keys
    return (out.float() * kept[..., None]).to(out.dtype)


def _compiled_flex():
    fn = _FLEX.get("compiled")
    if fn is None:
        from torch.nn.attention.flex_attention import flex_attention

        fn = _FLEX["compiled"] = torch.compile(flex_attention, dynamic=False)
    return fn


class CausalSelfAttention(nn.Module):
    def __init__(self, config: Config, layer_index: int) -> None:
        super().__init__()
        D, H, G, E = config.head_size, config.n_head, config.kv_heads, config.n_embd
        self.q_proj = nn.Linear(E, H * D, bias=config.attn_qkv_bias)
        self.k_proj = nn.Linear(E, G * D, bias=config.attn_qkv_bias)
        self.v_proj = nn.Linear(E, G * D, bias=config.attn_qkv_bias)
        self.o_proj = nn.Linear(H * D, E, bias=config.bias)
        self.n_head, self.n_kv, self.head_size = H, G, D
        # QK norm: over each head's D values, or over the whole projection (H * D queries, G * D keys)
        self.qk_norm_per_head = config.qk_norm == "head"
        self.q_norm = self.k_norm = None
        if config.qk_norm is not None:
            self.q_norm = make_norm(config, D if self.qk_norm_per_head else H * D)
            self.k_norm = make_norm(config, D if self.qk_norm_per_head else G * D)
        layer = config.layer(layer_index)
        self.window = layer.window
        self.rope_n_elem = config.rope_n_elem if layer.rope else 0
        # which rotary tables the layer's queries and keys rotate by (GPT passes them)
        self.rope_kind = "local" if layer.window is not None and config.rope_local_base is not None else "global"
        self.scale = None if config.query_pre_attn_scalar is None else config.query_pre_attn_scalar**-0.5
        self.softcap = config.attn_logit_softcap
        # (H,) one logit per query head that joins each query's softmax as a key whose value is zero
        self.sinks = nn.Parameter(torch.zeros(H)) if config.attention_sinks else None
        self.kv_cache: Optional[KVCache] = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: Optional[int],
        segments: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """`segments` (B, R): per row, the lengths of its packed samples (summing to T, then zeros; see
        `document_segments`); each attends only to itself."""
        B, T, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)  # (B, T, H * D), (B, T, G * D)
        if self.q_norm is not None and not self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, self.n_head, self.head_size)  # (B, T, H, D)
        k = k.view(B, T, self.n_kv, self.head_size)  # (B, T, G, D)
        if self.q_norm is not None and self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, D), (B, G, T, D)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_size).transpose(1, 2)  # (B, G, T, D)
        if self.rope_n_elem:
            q = apply_rope(q, cos, sin, self.rope_n_elem)
            k = apply_rope(k, cos, sin, self.rope_n_elem)

        if segments is not None:
            per_sample = torch.compiler.disable(segment_attention) if torch.compiler.is_compiling() else segment_attention
            y = per_sample(q, k, v, segments, self.scale, self.window, self.softcap, self.sinks)  # (B, H, T, D)
        else:
            padding = None
            if self.kv_cache is not None:
                start = 0 if input_pos is None else input_pos
                k, v = self.kv_cache.update(start, k, v)  # (B, G, start + T, D)
                padding = None if self.kv_cache.left_padding is None else self.kv_cache.left_padding[:B]
            y = attend(q, k, v, self.scale, self.window, self.softcap, padding, self.sinks)  # (B, H, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_size))


def document_segments(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (B, T) restarting at 0 where a row's document id changes, and each row's run lengths
    (B, R), R the most runs in a row, shorter rows padded with 0.

    document_ids [[0, 0, 0, 1, 1, -1], [0, 0, 0, 0, 0, 0]] -> positions [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]],
    segments [[3, 2, 1], [6, 0, 0]].
    The run lengths are a CPU tensor (one device sync per forward on a GPU, not one per layer), not
    Python lists: compiled blocks guard on a list's contents but on a tensor's shape only.
    """
    B, T = document_ids.shape
    index = torch.arange(T, device=document_ids.device).expand(B, T)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.where(starts, index, 0).cummax(dim=1).values  # index of the token's segment start
    positions = index - first
    runs = []
    for row in starts.cpu():
        bounds = row.nonzero().squeeze(1).tolist() + [T]
        runs.append([b - a for a, b in zip(bounds, bounds[1:])])
    R = max(len(lengths) for lengths in runs)
    return positions, torch.tensor([lengths + [0] * (R - len(lengths)) for lengths in runs], dtype=torch.int64)


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor, scale: Optional[float] = None,
    window: Optional[int] = None, softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention within each segment of each row: q (B, H, T, D), k and v (B, G, T, D) -> (B, H, T, D).
    `segments` (B, R): each row's segment lengths, then zeros (`document_segments`).

    Each sample of n tokens is attended as a sequence of n tokens (`attend`, with the layer's
    `scale`, `window`, `softcap` and `sinks`), so windows, softcaps and sinks compose with packing.

    One call per sample, the CPU form of a variable-length ("varlen") kernel: a sample of n tokens
    costs n^2 / 2, never the T^2 of a block-diagonal mask over the whole row. Measured on CPU
    (benchmarks/packing.py --attention, figures in benchmarks/README.md): at T=2048 with 8 samples
    per row, one call per sample took 189 ms forward + backward, SDPA with a boolean
    block-diagonal mask 1320 ms, plain causal SDPA over the row 812 ms; flex_attention has no
    backward on CPU in torch 2.13. Where `attend` would use flex_attention (CUDA), a row with a
    window, a softcap or sinks is one flex_attention call whose block mask holds the documents.
    """
    T = q.shape[2]
    if (window is not None or softcap is not None or sinks is not None) and _use_flex(q, T, T, None):
        document_ids = torch.repeat_interleave(  # (B, T): the index of each token's sample in its row
            torch.arange(segments.shape[1]).expand_as(segments).reshape(-1), segments.reshape(-1)
        ).view(q.shape[0], T).to(q.device)
        return flex_attend(q, k, v, scale, window, softcap, document_ids, sinks)
    rows = []
    for b, row in enumerate(segments.tolist()):
        lengths = [n for n in row if n]
        qs, ks, vs = (t[b : b + 1].split(lengths, dim=2) for t in (q, k, v))
        parts = [attend(qi, ki, vi, scale, window, softcap, sinks=sinks) for qi, ki, vi in zip(qs, ks, vs)]
        rows.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])
    return torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]
