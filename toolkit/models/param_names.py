"""Parameter names as `GPT` defines them, whatever wraps the model.

Fabric (`_forward_module.`), FSDP (`_fsdp_wrapped_module.`), activation checkpointing
(`_checkpoint_wrapped_module.`), torch.compile (`_orig_mod.`), peft (`base_model.model.`) and DDP
(a leading `module.`) each insert a part into the keys of `named_parameters()` and `state_dict()`.
Code that matches weights by name (weight decay groups, checkpoint conversion, adapter export)
compares the names without those parts. A weight that peft's LoRA layer wraps
(`q_proj.base_layer.weight`, or `experts.base_layer.base_layer.gate_up_proj` under the two nested
wrappers of adapters on two of its parameters) keeps the name it had before (`q_proj.weight`).
"""

from __future__ import annotations

# Inserted anywhere in a name (wrappers can nest, e.g. an FSDP unit inside a compiled module).
_WRAPPER_PARTS = (
    "_forward_module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.", "base_model.model.",
)
# Only ever at the front; `module.` is also the tail of the parts above, so it is removed last.
_LEADING_PREFIX = "module."


def unwrapped_name(name: str) -> str:
    """`name` without the parts that wrappers insert: `_forward_module._orig_mod.blocks.0.x` -> `blocks.0.x`.

    An adapter's own weights keep peft's `.base_layer.` parts: two adapters on two parameters of one
    module (`experts.base_layer.lora_A...` and `experts.lora_A...`) differ only there."""
    name = without_wrappers(name)
    if ".lora_" in name:
        return name
    while ".base_layer." in name:  # one per nested LoRA layer
        name = name.replace(".base_layer.", ".")
    return name


def without_wrappers(name: str) -> str:
    """`name` without the wrappers' parts but peft's `.base_layer.`, which tells nested LoRA layers apart."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    while name.startswith(_LEADING_PREFIX):
        name = name[len(_LEADING_PREFIX):]
    return name
