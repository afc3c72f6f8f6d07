"""The key/value cache of one attention layer, for incremental decoding."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn


class KVCache(nn.Module):
    """Keys and values (B, G, max_len, D) of every token decoded so far, one slot per token.

    Every slot is kept, also those a sliding-window layer no longer attends to: the attention mask
    hides them (`toolkit.models.attention.attention_mask`), so decoding past the window stays exact.
    """

    def __init__(self, batch_size: int, n_kv: int, max_len: int, head_size: int, device, dtype) -> None:
        super().__init__()
        shape = (batch_size, n_kv, max_len, head_size)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.left_padding: Optional[torch.Tensor] = None  # (batch_size,), see GPT.set_kv_cache

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache holds {self.k.shape[2]} positions; {end} requested")
        self.k[: k.shape[0], :, start:end] = k.to(self.k.dtype)
        self.v[: v.shape[0], :, start:end] = v.to(self.v.dtype)
        return self.k[: k.shape[0], :, :end], self.v[: v.shape[0], :, :end]
