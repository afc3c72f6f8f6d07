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

# User-facing target names -> the toolkit module names they cover.
TARGETS = {
    "query": ("q_proj",),
    "key": ("k_proj",),
    "value": ("v_proj",),
    "projection": ("o_proj",),
    "mlp": ("gate_proj", "up_proj", "down_proj", "fc_in", "fc_out"),
    "head": ("lm_head",),
}


@dataclass
class LoRAArgs:
    """The adapters: rank, scale, dropout and which projections get them."""

    r: int = 8  # rank of the update B @ A
    alpha: int = 16  # the update is scaled by alpha / r
    dropout: float = 0.05
    targets: tuple[str, ...] = ("query", "value")  # any of: query, key, value, projection, mlp, head

    def __post_init__(self) -> None:
        if self.r < 1:
            raise UserError(f"--lora.r must be at least 1, got {self.r}")
        if not self.alpha > 0:
            raise UserError(f"--lora.alpha must be positive, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"--lora.dropout must be in [0, 1), got {self.dropout}")
        for target in self.targets:
            if target not in TARGETS:
                raise UserError(f"Unknown LoRA target {target!r}.{did_you_mean(target, TARGETS)} Valid: {', '.join(TARGETS)}.")
        if not self.targets:
            raise UserError("--lora.targets is empty: name at least one of " + ", ".join(TARGETS))

    def module_names(self) -> list[str]:
        return sorted({name for target in self.targets for name in TARGETS[target]})

    def peft_config(self, module_names: Optional[list[str]] = None):
        from peft import LoraConfig

        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=module_names or self.module_names(), bias="none")


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
