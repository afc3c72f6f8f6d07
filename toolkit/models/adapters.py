"""LoRA adapters on the toolkit's model: which modules each user-facing target covers, and the
settings peft builds its LoRA layers from. Shared by finetune_lora, merging and the memory estimate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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
