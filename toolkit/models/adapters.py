"""LoRA adapters on the toolkit's model: which modules each user-facing target covers, the
settings peft builds its LoRA layers from, and the model with its adapters switched off (a
preference loss's reference). Shared by finetune_lora, merging, the preference reference and the
memory estimate.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

from toolkit.errors import UserError, did_you_mean

# User-facing target names -> the toolkit module names they cover. A mixture of experts' router
# (`mlp.router`) is in none: a low-rank change to it moves tokens to experts that were never trained
# on them, and the top-k choice makes that change jump rather than grow smoothly with training.
TARGETS = {
    "query": ("q_proj",),
    "key": ("k_proj",),
    "value": ("v_proj",),
    "projection": ("o_proj",),
    "mlp": ("gate_proj", "up_proj", "down_proj", "fc_in", "fc_out"),
    "head": ("lm_head",),
}
# Targets that are parameters rather than modules: "<module>.<parameter>", adapted by peft's LoRA on
# parameters (`LoraConfig.target_parameters`, as `toolkit.models.expert_adapters.FactoredExpertLoRA`).
# A mixture of experts' 3-D weights (X, out, in) get one rank-r update per expert, applied to the
# rows from its factors: the updated weight is never formed. Listed in the order the experts module
# registers them, which is the order peft wraps them in (`peft_parameter_paths`).
PARAMETER_TARGETS = {
    "experts": ("experts.gate_up_proj", "experts.down_proj"),
}


@dataclass
class LoRAArgs:
    """The adapters: rank, scale, dropout and which projections get them."""

    r: int = 8  # rank of the update B @ A
    alpha: float = 16  # the update is scaled by alpha / r
    dropout: float = 0.05
    # any of: query, key, value, projection, mlp, head, experts (a mixture of experts' weights)
    targets: tuple[str, ...] = ("query", "value")

    def __post_init__(self) -> None:
        if self.r < 1:
            raise UserError(f"--lora.r must be at least 1, got {self.r}")
        if not self.alpha > 0:
            raise UserError(f"--lora.alpha must be positive, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"--lora.dropout must be in [0, 1), got {self.dropout}")
        valid = {**TARGETS, **PARAMETER_TARGETS}
        for target in self.targets:
            if target not in valid:
                raise UserError(f"Unknown LoRA target {target!r}.{did_you_mean(target, valid)} Valid: {', '.join(valid)}.")
        if not self.targets:
            raise UserError("--lora.targets is empty: name at least one of " + ", ".join(valid))
        if self.parameter_names() and self.dropout:
            raise UserError(
                f"--lora.targets experts needs --lora.dropout 0 (got {self.dropout}): peft's LoRA on parameters, "
                "the experts' adapters, has no dropout."
            )

    def module_names(self) -> list[str]:
        return sorted({name for target in self.targets for name in TARGETS.get(target, ())})

    def parameter_names(self) -> list[str]:
        return [name for target in PARAMETER_TARGETS if target in self.targets for name in PARAMETER_TARGETS[target]]

    def peft_config(self, module_names: Optional[list[str]] = None, parameter_names: Optional[list[str]] = None):
        """peft's LoraConfig for these adapters; the names default to the toolkit model's (an export
        passes those of the Hugging Face model)."""
        from toolkit.models.expert_adapters import lora_config

        modules = self.module_names() if module_names is None else module_names
        parameters = self.parameter_names() if parameter_names is None else parameter_names
        return lora_config(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=modules,
                           target_parameters=parameters or None, bias="none")


def peft_parameter_paths(module_path: str, parameters: list[str]) -> dict[str, str]:
    """Where peft puts the adapters of `parameters` (names, in the order the module registers them)
    of the module at `module_path`: each parameter gets its own wrapper, the first one wrapped
    innermost (peft 0.21 wraps them in the module's parameter order), so with two the first one's
    adapter sits at `<module_path>.base_layer` and the second's at `<module_path>`."""
    n = len(parameters)
    return {name: module_path + ".base_layer" * (n - 1 - i) for i, name in enumerate(parameters)}


def adapter_module_names(model) -> dict[str, str]:
    """For every LoRA layer of a peft `model`: its path without wrapper prefixes (peft's nesting of
    wrappers, `.base_layer`, kept) -> the toolkit name its adapter is saved under: the adapted
    module's (`blocks.0.attn.q_proj`) or, for an adapter on a parameter, the parameter's
    (`blocks.0.mlp.experts.gate_up_proj`)."""
    from peft.tuners.lora import LoraLayer

    from toolkit.models.param_names import unwrapped_name, without_wrappers

    names = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            path = without_wrappers(name)
            toolkit = unwrapped_name(path + ".")[:-1]
            parameter = getattr(module, "parameter_name", None)
            names[path] = toolkit if parameter is None else f"{toolkit}.{parameter}"
    return names


@contextmanager
def adapters_switched_off(model) -> Iterator[None]:
    """`model` (a peft model, also inside Fabric's wrapper or sharded by FSDP2) computes with every
    adapter switched off, as its frozen base, inside the block.

    peft's `disable_adapter` also marks the adapters as needing no gradient while they are off
    (peft 0.21, `BaseTunerLayer.enable_adapters`). FSDP2 takes each unit's gradient-reduction dtype
    from the parameters that need a gradient when the model first runs (torch 2.13,
    `FSDPParamGroup._init_mp_dtypes`): a first forward pass with the adapters off (a reference pass,
    or validation before training) made it reduce the adapters' bf16 gradients without casting them
    to their float32 shards, and the backward pass failed. So the parameters that trained before
    are marked so again inside the block (under no_grad, nothing else changes)."""
    from peft import PeftModel

    peft_model = next((m for m in model.modules() if isinstance(m, PeftModel)), None)
    if peft_model is None:
        raise RuntimeError("the model has no LoRA adapters to switch off")
    trained = [p for p in model.parameters() if p.requires_grad]
    with peft_model.disable_adapter():
        for p in trained:
            p.requires_grad_(True)
        yield
