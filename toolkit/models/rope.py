"""Rotary position embedding: the cos/sin tables, their application, and frequency scalings.

A scaling is one function per kind in `ROPE_SCALINGS`, keyed by the "rope_type" of
`Config.rope_scaling` (`Config.rope_scaling_type`): inverse frequencies (dim / 2,) and that kind's
keys in, scaled inverse frequencies out. A new kind ("linear"...) is one function registered with
`register_rope_scaling`, and its keys in `toolkit.models.config.ROPE_SCALING_KEYS`.

A scaling may also return (inverse frequencies, magnitude): cos and sin are then multiplied by
the magnitude, so every query-key product by its square (YaRN's and LongRoPE's attention factor).
It may ask, with keyword-only parameters, for `base` (the rotary base, `Config.rope_base`) and
`long`: a scaling taking `long` has two sets of frequencies, the long one for any sequence longer
than its `original_max_seq_len` (LongRoPE), and `RotaryEmbedding` picks the set by the length of
the sequence as transformers does (see there).
"""

from __future__ import annotations

import inspect
import math
from typing import Callable, Optional, Sequence, Union

import torch

from toolkit.models.config import ROPE_SCALING_KEYS, Config

ScaleFrequencies = Callable[..., Union[torch.Tensor, tuple[torch.Tensor, float]]]
# rope_type -> fn(inv_freq, **keys) -> scaled inv_freq, or (scaled inv_freq, magnitude of cos and sin)
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


@register_rope_scaling("yarn")
def yarn_scale_frequencies(
    inv_freq: torch.Tensor, factor: float, original_max_seq_len: int, beta_fast: float, beta_slow: float,
    attention_factor: float, truncate: bool, *, base: float,
) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies that turn fewer than `beta_slow` times over `original_max_seq_len` tokens are
    divided by `factor` (interpolated), those turning more than `beta_fast` times are kept
    (extrapolated), with a linear ramp over the dimensions between; cos and sin scale by
    `attention_factor`. The ramp's ends are whole dimensions with `truncate` (floor / ceil), as
    transformers' `_compute_yarn_parameters` computes them."""
    dim = 2 * inv_freq.numel()

    def dimension_turning(rotations: float) -> float:
        # the (fractional) dimension whose frequency turns `rotations` times over the original length
        return dim * math.log(original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension_turning(beta_fast), dimension_turning(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-dimension ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(inv_freq.device)
    extrapolate = 1 - ramp  # (dim / 2,): 1 where a frequency is kept, 0 where it is divided by factor
    interpolated = 1.0 / (factor * _wavelength_factors(base, dim, inv_freq.device))
    return interpolated * (1 - extrapolate) + inv_freq * extrapolate, attention_factor


@register_rope_scaling("longrope")
def longrope_scale_frequencies(
    inv_freq: torch.Tensor, short_factor: Sequence[float], long_factor: Sequence[float], original_max_seq_len: int,
    attention_factor: float, *, base: float, long: bool,
) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): each frequency divided by its own factor, from `long_factor` for sequences
    longer than `original_max_seq_len`, else from `short_factor`; cos and sin scale by
    `attention_factor` either way."""
    factors = torch.tensor(long_factor if long else short_factor, dtype=torch.float32, device=inv_freq.device)
    return 1.0 / (factors * _wavelength_factors(base, 2 * inv_freq.numel(), inv_freq.device)), attention_factor


def _wavelength_factors(base: float, dim: int, device) -> torch.Tensor:
    """base^(2i / dim) (dim / 2,), float32: 1 / the unscaled frequencies. Scalings that divide them
    by factors start from these, as transformers does, so that the float32 results agree bit for bit
    (1 / (f * p) and (1 / p) / f may differ in the last bit)."""
    return base ** (torch.arange(0, dim, 2, device=device, dtype=torch.int64).float() / dim)


class RotaryEmbedding:
    """cos/sin tables for rotary position embedding, computed in float32 and cached per device.

    A plain object, not a module: the tables are derived from the config, so they are neither
    parameters nor checkpointed buffers, and meta-device or sharded initialisation never touches them.

    LongRoPE (a scaling taking `long`) has two sets of frequencies. As in transformers
    (`dynamic_rope_update`), a sequence longer than `switch_length` tokens takes the long set at
    every position, a shorter one the short set: a table depends on the length of the sequence, not
    only on the position. `__call__(start, length)` is a sequence of start + length tokens; `at`
    takes the largest position + 1 of the batch (transformers' rule for a batch of rows), or, given
    the packed samples (`segments`), each sample's own length, so that a sample gets what it gets
    alone. A KV cache filled with one set cannot continue with the other (`same_frequencies`).
    """

    def __init__(self, config: Config, local: bool = False) -> None:
        """`local`: the tables of the local layers when they have their own base (`Config.rope_local_base`):
        that base, no frequency scaling."""
        self.dim = config.rope_n_elem
        self.base = config.rope_local_base if local else config.rope_base
        self.scaling = None if local else config.rope_scaling_type
        # the scaling's own keys (Config has checked that they are there)
        self.scaling_keys = {} if local else {k: v for k, v in (config.rope_scaling or {}).items() if k != "rope_type"}
        asks = inspect.signature(ROPE_SCALINGS[self.scaling]).parameters if self.scaling is not None else {}
        self._takes_base = "base" in asks
        # Sequences longer than this take the long frequencies (None: one set for every length)
        self.switch_length: Optional[int] = int(self.scaling_keys["original_max_seq_len"]) if "long" in asks else None
        self._cache: dict[tuple[torch.device, bool], tuple[torch.Tensor, torch.Tensor]] = {}

    def is_long(self, length: int) -> bool:
        """Whether a sequence of `length` tokens takes the long frequencies."""
        return self.switch_length is not None and length > self.switch_length

    def same_frequencies(self, length: int, other: int) -> bool:
        """Whether sequences of these two lengths are rotated by the same tables."""
        return self.is_long(length) == self.is_long(other)

    def _scaled(self, device, long: bool) -> tuple[torch.Tensor, float]:
        """(inverse frequencies (dim / 2,), magnitude of cos and sin)."""
        inv_freq = 1.0 / _wavelength_factors(self.base, self.dim, device)
        if self.scaling is None:
            return inv_freq, 1.0
        asked = {"base": self.base} if self._takes_base else {}
        if self.switch_length is not None:
            asked["long"] = long
        scaled = ROPE_SCALINGS[self.scaling](inv_freq, **self.scaling_keys, **asked)
        return scaled if isinstance(scaled, tuple) else (scaled, 1.0)

    def inverse_frequencies(self, device, long: bool = False) -> torch.Tensor:
        return self._scaled(device, long)[0]  # (dim / 2,)

    def _table(self, n: int, device: torch.device, long: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (at least n, dim) of one set of frequencies."""
        cos, sin = self._cache.get((device, long), (None, None))
        if cos is None or cos.shape[0] < n:
            n = max(n, 2 * (0 if cos is None else cos.shape[0]))
            inv_freq, magnitude = self._scaled(device, long)
            positions = torch.arange(n, device=device, dtype=torch.int64).float()
            freqs = torch.outer(positions, inv_freq)  # (n, dim / 2)
            emb = torch.cat((freqs, freqs), dim=-1)  # (n, dim): halves layout, as rotate_half expects
            cos, sin = emb.cos(), emb.sin()
            if magnitude != 1.0:
                cos, sin = cos * magnitude, sin * magnitude
            self._cache[(device, long)] = (cos, sin)
        return cos, sin

    def __call__(self, start: int, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (length, dim) at positions start..start + length - 1 of a sequence of start + length tokens."""
        cos, sin = self._table(start + length, torch.device(device), self.is_long(start + length))
        return cos[start : start + length], sin[start : start + length]

    def at(
        self, positions: torch.Tensor, device, segments: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (B, 1, T, dim) at the positions (B, T) of each row; `segments` (B, R): each row's
        packed samples' lengths, then zeros (see `toolkit.models.attention.document_segments`)."""
        device = torch.device(device)
        n = int(positions.max()) + 1
        if self.switch_length is None or segments is None:
            cos, sin = self._table(n, device, self.is_long(n))
            return cos[positions][:, None], sin[positions][:, None]
        lengths = segments[segments > 0]  # each sample's length, row by row
        long = torch.repeat_interleave(lengths > self.switch_length, lengths).view(positions.shape).to(device)
        (short_cos, short_sin), (long_cos, long_sin) = (self._table(n, device, kind) for kind in (False, True))
        cos = torch.where(long[..., None], long_cos[positions], short_cos[positions])
        sin = torch.where(long[..., None], long_sin[positions], short_sin[positions])
        return cos[:, None], sin[:, None]


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
