"""Feed-forward layers, one class per kind, found by `Config.mlp` through `MLP_KINDS`.

A new kind (a mixture of experts, say) is a class taking the `Config`, registered under the name
that `Config.mlp` gives it: `make_mlp` reads the registry and nothing else changes.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from toolkit.models.config import Config

# Config.mlp -> the module class built from the Config
MLP_KINDS: dict[str, type[nn.Module]] = {}


def register_mlp(*names: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Class decorator: `Config.mlp` values in `names` build this class."""

    def register(cls: type[nn.Module]) -> type[nn.Module]:
        for name in names:
            if name in MLP_KINDS:
                raise ValueError(f"MLP kind {name!r} is registered twice ({MLP_KINDS[name].__name__}, {cls.__name__})")
            MLP_KINDS[name] = cls
        return cls

    return register


@register_mlp("gelu")
class GeluMLP(nn.Module):
    """fc_out(gelu(fc_in(x))): GPT-NeoX, Phi-2."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.fc_in = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.fc_out = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)
        self.approximate = config.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x), approximate=self.approximate))


def gated_activation(gate: torch.Tensor, up: torch.Tensor, config: Config) -> torch.Tensor:
    """The gated hidden activation of `config.mlp`: silu(gate) * up (swiglu), gelu(gate) * up (geglu),
    or gpt-oss's clamped form (up + 1) * gate * sigmoid(alpha * gate) with gate <= limit and
    up in [-limit, limit]."""
    if config.mlp == "swiglu":
        return F.silu(gate) * up
    if config.mlp == "geglu":
        return F.gelu(gate, approximate=config.gelu_approximate) * up
    if config.mlp == "clamped_swiglu":
        limit = config.swiglu_limit
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * config.swiglu_alpha))
    raise ValueError(f"mlp {config.mlp!r} is not gated")


@register_mlp("swiglu", "geglu", "clamped_swiglu")
class GatedMLP(nn.Module):
    """down(act(gate(x), up(x))): SwiGLU (Llama, Mistral, Qwen2) with silu, GeGLU (Gemma) with gelu
    (`gated_activation`)."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.up_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)
        self.config = config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_activation(self.gate_proj(x), self.up_proj(x), self.config))


def make_mlp(config: Config) -> nn.Module:
    """The dense feed-forward layer of `config` (a mixture of experts is `toolkit.models.moe.MoE`)."""
    return MLP_KINDS[config.mlp](config)
