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


@register_mlp("swiglu", "geglu")
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
    return MLP_KINDS[config.mlp](config)
