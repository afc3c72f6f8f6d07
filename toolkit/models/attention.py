"""Causal self-attention, and the one function that says which keys each query sees.

Shapes: B batch, T queries in this call, S keys (cached ones included), H query heads, G key/value
heads (query groups), D head size.

Every mask comes from `attention_mask`: causal, a query's sliding window, a KV cache's earlier
slots and left padding. Packed samples (`document_segments`) are attended one sample at a time
(`segment_attention`), each with the mask `attention_mask` gives a sequence of its length, so
windows compose with packing. Scores become outputs in one place, `attend`.

Under torch.compile the per-sample loop runs eagerly between two compiled graphs (projections and
rotary embedding before it, the output projection after it): traced, its Python loop over sample
lengths would be guarded on, and every new packing layout would compile again.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from toolkit.models.config import Config
from toolkit.models.kv_cache import KVCache
from toolkit.models.rope import apply_rope


def attention_mask(
    T: int, S: int, device, window: Optional[int] = None, left_padding: Optional[torch.Tensor] = None
) -> tuple[Optional[torch.Tensor], bool]:
    """(mask, is_causal) for `attend`: T queries, the last T of S key slots (query i is slot S - T + i).

    Query q sees key slot s when s <= q (causal), q - s < window (its last `window` tokens, itself
    included), and s >= left_padding[b] (not its row's padding; a padding query sees itself only,
    as a query that sees nothing would give NaN). Where plain causal attention says all of it
    (no padding, no earlier slots, no key beyond a window), the mask is None and `is_causal` says
    whether queries see only earlier keys (T > 1) or every key (one query at the last slot).
    Otherwise the mask is boolean (T, S), or (B, 1, T, S) with padding.
    """
    start = S - T
    if left_padding is None and (start == 0 or T == 1) and (window is None or S <= window):
        # A branch, not `T > 1` itself: compiled with dynamic shapes that is a symbolic bool, which SDPA refuses.
        return None, True if T > 1 else False  # noqa: SIM210
    key = torch.arange(S, device=device)[None, :]  # (1, S)
    query = torch.arange(start, S, device=device)[:, None]  # (T, 1)
    mask = key <= query  # (T, S)
    if window is not None:
        mask = mask & (key > query - window)
    if left_padding is not None:
        real = key >= left_padding[:, None, None]  # (B, 1, S)
        mask = (mask & real | (key == query))[:, None]  # (B, 1, T, S)
    return mask, False


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], is_causal: bool
) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) where `mask`) v: q (B, H, T, D), k and v (B, G, S, D) -> (B, H, T, D).

    The place for attention sinks (a learned logit per head joining every query's softmax as one
    more key whose value is zero): with log Z the log-sum-exp of a query's scores, its output
    becomes y * sigmoid(log Z - sink). SDPA does not return log Z, so a sink-carrying layer would
    pass its sinks here and compute the scores itself (or through a kernel that returns them).
    """
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=k.shape[1] != q.shape[1]
    )


class CausalSelfAttention(nn.Module):
    def __init__(self, config: Config, layer_index: int) -> None:
        super().__init__()
        D, H, G, E = config.head_size, config.n_head, config.kv_heads, config.n_embd
        self.q_proj = nn.Linear(E, H * D, bias=config.attn_qkv_bias)
        self.k_proj = nn.Linear(E, G * D, bias=config.attn_qkv_bias)
        self.v_proj = nn.Linear(E, G * D, bias=config.attn_qkv_bias)
        self.o_proj = nn.Linear(H * D, E, bias=config.bias)
        self.n_head, self.n_kv, self.head_size = H, G, D
        layer = config.layer(layer_index)
        self.window = layer.window
        self.rope_n_elem = config.rope_n_elem if layer.rope else 0
        self.kv_cache: Optional[KVCache] = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: Optional[int],
        segments: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """`segments` (B, R): per row, the lengths of its packed samples (summing to T, then zeros; see
        `document_segments`); each attends only to itself."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_size).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_size).transpose(1, 2)  # (B, G, T, D)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_size).transpose(1, 2)  # (B, G, T, D)
        if self.rope_n_elem:
            q = apply_rope(q, cos, sin, self.rope_n_elem)
            k = apply_rope(k, cos, sin, self.rope_n_elem)

        if segments is not None:
            per_sample = torch.compiler.disable(segment_attention) if torch.compiler.is_compiling() else segment_attention
            y = per_sample(q, k, v, segments, window=self.window)  # (B, H, T, D)
        else:
            padding = None
            if self.kv_cache is not None:
                start = 0 if input_pos is None else input_pos
                k, v = self.kv_cache.update(start, k, v)  # (B, G, start + T, D)
                padding = None if self.kv_cache.left_padding is None else self.kv_cache.left_padding[:B]
            mask, is_causal = attention_mask(T, k.shape[2], x.device, self.window, padding)
            y = attend(q, k, v, mask, is_causal)  # (B, H, T, D)
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
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor, window: Optional[int] = None
) -> torch.Tensor:
    """Causal attention within each segment of each row: q (B, H, T, D), k and v (B, G, T, D) -> (B, H, T, D).
    `segments` (B, R): each row's segment lengths, then zeros (`document_segments`).

    Each sample of n tokens gets the mask of a sequence of n tokens (`attention_mask`, with the
    layer's `window`).

    One SDPA call per sample, the CPU form of a variable-length ("varlen") kernel: a sample
    of n tokens costs n^2 / 2, never the T^2 of a block-diagonal mask over the whole row.
    Measured on CPU (benchmarks/packing.py --attention, figures in benchmarks/README.md): at T=2048
    with 8 samples per row, one call per sample took 189 ms forward + backward, SDPA with a boolean
    block-diagonal mask 1320 ms, plain causal SDPA over the row 812 ms; flex_attention has no
    backward on CPU in torch 2.13. On a GPU a varlen kernel would replace this loop.
    """
    rows = []
    for b, row in enumerate(segments.tolist()):
        lengths = [n for n in row if n]
        qs, ks, vs = (t[b : b + 1].split(lengths, dim=2) for t in (q, k, v))
        parts = []
        for qi, ki, vi in zip(qs, ks, vs):
            n = qi.shape[2]
            parts.append(attend(qi, ki, vi, *attention_mask(n, n, q.device, window)))
        rows.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])
    return torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]
