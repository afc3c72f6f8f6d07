"""Rotary position embedding: the cos/sin tables, their application, and frequency scalings.

A scaling is one function per kind in `ROPE_SCALINGS`, keyed by the "rope_type" of
`Config.rope_scaling` (`Config.rope_scaling_type`): inverse frequencies (dim / 2,) and that kind's
keys in, scaled inverse frequencies out. A new kind ("yarn", "longrope", "linear") is one function
registered with `register_rope_scaling`, and its keys in `toolkit.models.config.ROPE_SCALING_KEYS`.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from toolkit.models.config import ROPE_SCALING_KEYS, Config

ScaleFrequencies = Callable[..., torch.Tensor]
# rope_type -> fn(inv_freq, **keys) -> scaled inv_freq
ROPE_SCALINGS: dict[str, ScaleFrequencies] = {}


def register_rope_scaling(name: str) -> Callable[[ScaleFrequencies], ScaleFrequencies]:
    def register(fn: ScaleFrequencies) -> ScaleFrequencies:
        if name not in ROPE_SCALING_KEYS:
            raise ValueError(f"RoPE scaling {name!r} needs its keys in toolkit.models.config.ROPE_SCALING_KEYS")
        ROPE_SCALINGS[name] = fn
        return fn

    return register


@register_rope_scaling("llama3")
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


@register_rope_scaling("linear")
def linear_scale_frequencies(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Linear ("position interpolation") scaling: every frequency divided by `factor`."""
    return inv_freq / factor


class RotaryEmbedding:
    """cos/sin tables for rotary position embedding, computed in float32 and cached per device.

    A plain object, not a module: the tables are derived from the config, so they are neither
    parameters nor checkpointed buffers, and meta-device or sharded initialisation never touches them.
    """

    def __init__(self, config: Config, local: bool = False) -> None:
        """`local`: the tables of the local layers when they have their own base (`Config.rope_local_base`):
        that base, no frequency scaling."""
        self.dim = config.rope_n_elem
        self.base = config.rope_local_base if local else config.rope_base
        self.scaling = None if local else config.rope_scaling_type
        # the scaling's own keys (Config has checked that they are there)
        self.scaling_keys = {} if local else {k: v for k, v in (config.rope_scaling or {}).items() if k != "rope_type"}
        self._cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def inverse_frequencies(self, device) -> torch.Tensor:
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.int64).float() / self.dim))
        if self.scaling is not None:
            inv_freq = ROPE_SCALINGS[self.scaling](inv_freq, **self.scaling_keys)
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

    def at(self, positions: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (B, 1, T, dim) at the positions (B, T) of each row."""
        cos, sin = self(0, int(positions.max()) + 1, device)
        return cos[positions][:, None], sin[positions][:, None]


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
