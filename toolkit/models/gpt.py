"""One decoder-only transformer for every supported family, driven by `Config` fields only.

Single-device code: nothing here knows about Fabric, FSDP or precision plugins. Those are applied
from outside (`toolkit.training.distributed`).

Shapes: B batch, T tokens in this call, L cached tokens, E n_embd, H query heads, G key/value heads
(query groups), D head size, V vocabulary.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from toolkit.models.config import Config

IGNORE_INDEX = -100  # label value excluded from the loss (prompt tokens, padding)


class GPT(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm_f = make_norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=config.lm_head_bias)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rope = RotaryEmbedding(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        input_pos: Optional[int] = None,
    ) -> torch.Tensor:
        """Logits (B, T, V); with `labels` (B, T), the summed cross-entropy over labelled tokens.

        The loss is a sum, not a mean, so that the training loop can normalise by the number of
        target tokens across micro-batches and ranks. `input_pos` is the position of the first
        token when a KV cache is in use (see `set_kv_cache`).
        """
        B, T = input_ids.shape
        start = 0 if input_pos is None else input_pos
        if start + T > self.config.block_size:
            raise ValueError(f"Sequence of {start + T} tokens exceeds the context of {self.config.block_size}")
        x = self.embed(input_ids)  # (B, T, E)
        if self.config.scale_embeddings:
            x = x * torch.tensor(self.config.n_embd**0.5, dtype=x.dtype)
        cos, sin = self.rope(start, T, x.device)  # (T, rope_n_elem) each, float32
        for block in self.blocks:
            x = block(x, cos, sin, input_pos)
        x = self.norm_f(x)
        if labels is None:
            return self.lm_head(x)
        return cross_entropy_sum(self.lm_head(x), labels)

    # ------------------------------------------------------------------ KV cache
    def set_kv_cache(self, batch_size: int, max_seq_length: int, device=None, dtype=None) -> None:
        """Allocate a key/value cache per block for incremental decoding up to `max_seq_length`."""
        if max_seq_length > self.config.block_size:
            raise ValueError(f"max_seq_length {max_seq_length} exceeds the context of {self.config.block_size}")
        weight = self.lm_head.weight
        device = device or weight.device
        dtype = dtype or weight.dtype
        for block in self.blocks:
            block.attn.kv_cache = KVCache(batch_size, self.config.kv_heads, max_seq_length, self.config.head_size, device, dtype)

    def clear_kv_cache(self) -> None:
        for block in self.blocks:
            block.attn.kv_cache = None


class Block(nn.Module):
    """One transformer layer. Sequential residual (Llama):

        x = x + attn(norm_1(x));  x = x + mlp(norm_2(x))

    Parallel residual (GPT-NeoX; Phi-2 with one shared norm):

        x = x + attn(norm_1(x)) + mlp(norm_2(x))
    """

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.norm_1 = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.norm_2 = None if config.shared_attention_norm else make_norm(config)
        self.mlp = make_mlp(config)
        self.parallel_residual = config.parallel_residual

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: Optional[int]) -> torch.Tensor:
        h = self.norm_1(x)
        attn_out = self.attn(h, cos, sin, input_pos)
        if self.parallel_residual:
            mlp_in = h if self.norm_2 is None else self.norm_2(x)
            return x + attn_out + self.mlp(mlp_in)
        x = x + attn_out
        return x + self.mlp(self.norm_2(x))


class CausalSelfAttention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        D, H, G, E = config.head_size, config.n_head, config.kv_heads, config.n_embd
        self.q_proj = nn.Linear(E, H * D, bias=config.attn_qkv_bias)
        self.k_proj = nn.Linear(E, G * D, bias=config.attn_qkv_bias)
        self.v_proj = nn.Linear(E, G * D, bias=config.attn_qkv_bias)
        self.o_proj = nn.Linear(H * D, E, bias=config.bias)
        self.n_head, self.n_kv, self.head_size = H, G, D
        self.rope_n_elem = config.rope_n_elem
        self.kv_cache: Optional[KVCache] = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: Optional[int]) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_size).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_size).transpose(1, 2)  # (B, G, T, D)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_size).transpose(1, 2)  # (B, G, T, D)
        q = apply_rope(q, cos, sin, self.rope_n_elem)
        k = apply_rope(k, cos, sin, self.rope_n_elem)

        mask = None
        is_causal = T > 1
        if self.kv_cache is not None:
            start = 0 if input_pos is None else input_pos
            k, v = self.kv_cache.update(start, k, v)  # (B, G, start + T, D)
            if start > 0 and T > 1:
                # query i sits at position start + i and sees keys 0 .. start + i
                key_pos = torch.arange(start + T, device=x.device)
                query_pos = torch.arange(start, start + T, device=x.device)
                mask = key_pos[None, :] <= query_pos[:, None]  # (T, start + T)
                is_causal = False
            elif T == 1:
                is_causal = False  # one new token sees every cached key
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=self.n_kv != self.n_head
        )  # (B, H, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_size))


class KVCache(nn.Module):
    def __init__(self, batch_size: int, n_kv: int, max_len: int, head_size: int, device, dtype) -> None:
        super().__init__()
        shape = (batch_size, n_kv, max_len, head_size)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache holds {self.k.shape[2]} positions; {end} requested")
        self.k[: k.shape[0], :, start:end] = k.to(self.k.dtype)
        self.v[: v.shape[0], :, start:end] = v.to(self.v.dtype)
        return self.k[: k.shape[0], :, :end], self.v[: v.shape[0], :, :end]


# ---------------------------------------------------------------------------- MLPs
class GeluMLP(nn.Module):
    """fc_out(gelu(fc_in(x))): GPT-NeoX, Phi-2."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.fc_in = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.fc_out = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)
        self.approximate = config.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x), approximate=self.approximate))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (Llama, Mistral, Qwen2) with silu, GeGLU (Gemma) with gelu."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.up_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)
        self.use_gelu = config.mlp == "geglu"
        self.approximate = config.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        gate = F.gelu(gate, approximate=self.approximate) if self.use_gelu else F.silu(gate)
        return self.down_proj(gate * self.up_proj(x))


def make_mlp(config: Config) -> nn.Module:
    return GeluMLP(config) if config.mlp == "gelu" else GatedMLP(config)


# ---------------------------------------------------------------------------- norms
class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32; with `unit_offset` the scale is (1 + weight)."""

    def __init__(self, size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps
        self.unit_offset = unit_offset
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight) if self.unit_offset else nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)


def make_norm(config: Config) -> nn.Module:
    if config.norm == "layernorm":
        return nn.LayerNorm(config.n_embd, eps=config.norm_eps)
    return RMSNorm(config.n_embd, eps=config.norm_eps, unit_offset=config.norm_unit_offset)


# ---------------------------------------------------------------------------- rotary embedding
class RotaryEmbedding:
    """cos/sin tables for rotary position embedding, computed in float32 and cached per device.

    A plain object, not a module: the tables are derived from the config, so they are neither
    parameters nor checkpointed buffers, and meta-device or sharded initialisation never touches them.
    """

    def __init__(self, config: Config) -> None:
        self.dim = config.rope_n_elem
        self.base = config.rope_base
        self.scaling = config.rope_scaling
        self._cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def inverse_frequencies(self, device) -> torch.Tensor:
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.int64).float() / self.dim))
        if self.scaling is not None:
            inv_freq = llama3_scale_frequencies(inv_freq, **self.scaling)
        return inv_freq  # (dim / 2,)

    def __call__(self, start: int, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        device = torch.device(device)
        cos, sin = self._cache.get(device, (None, None))
        if cos is None or cos.shape[0] < start + length:
            n = max(start + length, 2 * (0 if cos is None else cos.shape[0]))
            positions = torch.arange(n, device=device, dtype=torch.int64).float()
            freqs = torch.outer(positions, self.inverse_frequencies(device))  # (n, dim / 2)
            emb = torch.cat((freqs, freqs), dim=-1)  # (n, dim): halves layout, as rotate_half expects
            cos, sin = emb.cos(), emb.sin()
            self._cache[device] = (cos, sin)
        return cos[start : start + length], sin[start : start + length]


def llama3_scale_frequencies(
    inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float, original_max_seq_len: float
) -> torch.Tensor:
    """Llama-3.1 RoPE scaling: slow frequencies divided by `factor`, fast ones kept, a smooth ramp between."""
    low_freq_wavelen = original_max_seq_len / low_freq_factor
    high_freq_wavelen = original_max_seq_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_seq_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_elem: int) -> torch.Tensor:
    """Rotate the first `n_elem` dimensions of each head of x (B, heads, T, D); the rest pass through."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if n_elem == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, keep = x[..., :n_elem], x[..., n_elem:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, keep), dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# ---------------------------------------------------------------------------- loss and init
def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy in float32; labels equal to IGNORE_INDEX do not count."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


@torch.no_grad()
def init_weights(model: nn.Module, n_layer: int, std: float = 0.02) -> None:
    """Initialisation for pretraining from scratch.

    Linear and embedding weights ~ N(0, std); the projections that write into the residual stream
    (attention output, MLP output) use std / sqrt(2 * n_layer) so the residual's variance does not
    grow with depth. Biases start at zero, norms at identity.
    """
    residual_std = std / math.sqrt(2 * n_layer)
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            leaf = name.rsplit(".", 1)[-1]
            nn.init.normal_(module.weight, mean=0.0, std=residual_std if leaf in ("o_proj", "fc_out", "down_proj") else std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.LayerNorm, RMSNorm)):
            module.reset_parameters()
