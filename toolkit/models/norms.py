"""Normalisation layers, computed in float32 and returned in the input's dtype."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from toolkit.models.config import Config


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


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm computed in float32, returned in the input's dtype (as RMSNorm above).

    The input and the weights may differ in dtype: under FSDP with mixed precision a block's
    weights arrive in bfloat16 while the residual stream stays float32.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).to(x.dtype)


def make_norm(config: Config, size: int | None = None) -> nn.Module:
    """The config's norm over `size` features (default: the residual stream's n_embd)."""
    size = config.n_embd if size is None else size
    if config.norm == "layernorm":
        return LayerNorm(size, eps=config.norm_eps)
    return RMSNorm(size, eps=config.norm_eps, unit_offset=config.norm_unit_offset)
