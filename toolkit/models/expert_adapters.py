"""LoRA on a mixture of experts' 3-D weights, computed from its two factors.

peft adapts a parameter (`LoraConfig.target_parameters`) with `ParamWrapper`, which forms the
updated weight W + scale * B @ A in every forward pass and computes with it. For the experts that
tensor is as large as all the layer's experts (X, out, in): kept for the backward pass in every
layer (one layer's at a time under activation checkpointing), and its gradient, of the same size,
is computed only to reach A and B.

`FactoredExpertLoRA` is the same peft layer (its parameters, state-dict names, merging, switching
off, peft's saved format) with one change: in the forward pass it hands its factors to the experts
(`GroupedExperts(..., low_rank=...)`), which apply them to the rows, through an (M, r)
intermediate (`toolkit.models.moe.low_rank_product`). `lora_config` registers it for
`GroupedExperts` with peft's custom-module hook, so that `get_peft_model` makes it.

Importing this module imports peft (seconds): it is imported only where adapters are made.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from peft.tuners.lora import ParamWrapper

from toolkit.models.moe import GroupedExperts, LowRankUpdate


class FactoredExpertLoRA(ParamWrapper):
    """peft's LoRA on one 3-D weight of `GroupedExperts`, applied as factors, not as W + dW.

    peft's layout of the factors: lora_A (r * X, in), expert e's rows at [e * r, (e + 1) * r);
    lora_B (out, r * X), expert e's columns at e + X * [0, r). (`ParamWrapper.get_delta_factors`
    reads them so too.) With one active adapter, not merged, the forward pass passes them on;
    otherwise it is peft's own (several active adapters, merged weights, adapters switched off).
    """

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        # From the experts' shape, not the stored tensor's: NF4 experts (QLoRA) are stored 2-D,
        # (X * out, in). Given as peft reads a 3-D weight, (X, in, out), before it swaps the two.
        experts = self.get_base_layer()
        if not isinstance(experts, GroupedExperts):
            return super()._get_in_out_features(module)
        self.num_experts, out_features, in_features = experts.weight_shape(self.parameter_name)
        self._param_ndim = 3
        return out_features, in_features

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        active = [name for name in self.active_adapters if name in self.lora_A]
        # peft swaps in/out for a 3-D weight stored (X, out, in), as GroupedExperts stores it
        if self.disable_adapters or self.merged or len(active) != 1 or not self._did_swap_in_out_features:
            return super().forward(x, *args, **kwargs)
        name = active[0]
        X = self.num_experts
        A = self.lora_A[name].weight.reshape(X, -1, self.in_features)  # (X, r, in)
        B = self.lora_B[name].weight.reshape(self.out_features, -1, X).permute(2, 0, 1)  # (X, out, r), a view
        low_rank = {**(kwargs.pop("low_rank", None) or {}), self.parameter_name: LowRankUpdate(A, B, self.scaling[name])}
        return self.base_layer(x, *args, low_rank=low_rank, **kwargs)


# peft tells its parameter wrappers from other LoRA layers by class name (tuners_utils, peft 0.21), to
# nest the wrappers of one module's several parameters: this one is such a wrapper.
FactoredExpertLoRA.__name__ = ParamWrapper.__name__


def lora_config(**settings: Any):
    """peft's `LoraConfig(**settings)`, whose adapters on the experts' weights are `FactoredExpertLoRA`."""
    from peft import LoraConfig

    config = LoraConfig(**settings)
    config._register_custom_module({GroupedExperts: FactoredExpertLoRA})
    return config
