"""The precision policy: which dtype every parameter is stored in, for each Fabric precision.

`precision_dtypes` is the one table (trainable, frozen, compute); `apply_precision_policy` casts a
model's parameters by it, cheaply on the meta device, before anything is allocated. The FSDP
strategy gathers and reduces in the dtypes this table gives (see `toolkit.parallel.fsdp`).

Importing this module is cheap: torch is imported inside the functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

# Precision names Fabric understands that make sense for LLM training (all of them work with FSDP).
PRECISIONS = ("bf16-mixed", "bf16-true", "32-true", "16-mixed", "16-true")
PRECISION_ALIASES = {"bf16": "bf16-mixed", "32": "32-true", "16": "16-mixed"}


def precision_dtypes(precision: str) -> tuple[Any, Any]:
    """(dtype of trainable parameters, dtype of frozen parameters) under `precision`.

        precision      trainable (and optimizer state)   frozen (LoRA/QLoRA base)   compute
        32-true        float32                           float32                    float32
        bf16-mixed     float32                           bfloat16                   bfloat16 (autocast)
        16-mixed       float32                           float16                    float16 (autocast)
        bf16-true      bfloat16                          bfloat16                   bfloat16
        16-true        float16                           float16                    float16

    Mixed precision keeps float32 master weights so that updates smaller than bfloat16's
    resolution (about 0.4% of a weight) are not lost; frozen weights never change, so they are
    stored in the compute dtype, which halves their memory.
    """
    import torch

    compute = {"bf16": torch.bfloat16, "16": torch.float16, "32": torch.float32}[precision.split("-")[0]]
    trainable = compute if precision.endswith("-true") else torch.float32
    return trainable, compute


def apply_precision_policy(model: nn.Module, precision: str) -> str:
    """Cast every floating-point parameter to the dtype `precision_dtypes` gives it (cheap on meta).

    Returns one line for the start-up log. Quantized (integer) weights are left alone.
    """
    trainable_dtype, frozen_dtype = precision_dtypes(precision)

    def cast(param):
        if not param.is_floating_point():
            return None
        dtype = trainable_dtype if param.requires_grad else frozen_dtype
        return None if param.dtype == dtype else param.detach().to(dtype)

    replace_parameters(model, cast)
    # a QLoRA base's weights are still 16-bit stand-ins here (on meta), quantized as they are read:
    # their modules name them (`nf4_parameters`, toolkit.parallel.nf4)
    nf4 = {id(getattr(m, name)) for m in model.modules() for name in getattr(m, "nf4_parameters", ())}
    counts: dict[tuple[bool, str], int] = {}
    for p in model.parameters():
        key = (p.requires_grad, "NF4" if id(p) in nf4 else str(p.dtype).removeprefix("torch."))
        counts[key] = counts.get(key, 0) + p.numel()
    parts = [f"{n:,} {'trainable' if t else 'frozen'} in {d}" for (t, d), n in sorted(counts.items(), key=str)]
    return f"precision policy ({precision}): " + ", ".join(parts)


def replace_parameters(model: nn.Module, make: Any) -> None:
    """Replace parameters by `make(old)` (None keeps the old one); shared (tied) parameters stay shared."""
    from torch import nn as _nn

    replaced: dict[int, Any] = {}
    for module in model.modules():
        for leaf, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in replaced:
                new = make(param)
                replaced[id(param)] = param if new is None else _nn.Parameter(new, requires_grad=param.requires_grad)
            module._parameters[leaf] = replaced[id(param)]
