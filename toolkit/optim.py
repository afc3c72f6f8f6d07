"""The training optimizer, shared by training and the memory simulation (which must build the same one).

AdamW over the trainable parameters; weight decay is decided by shape: matrices decay, vectors
(norms, biases) do not.
"""

from __future__ import annotations

import torch

from toolkit.args import TrainArgs
from toolkit.models.param_names import unwrapped_name

# Devices with torch's fused AdamW kernel.
FUSED_DEVICES = ("cpu", "cuda", "xpu", "mps")


def decay_names(model) -> set[str]:
    """Weight decay is decided by the parameters' shapes: matrices decay, vectors do not."""
    return {unwrapped_name(n) for n, p in model.named_parameters() if p.ndim >= 2}


def make_adamw(model, decay: set[str], train: TrainArgs) -> torch.optim.AdamW:
    """The training AdamW over `model`'s trainable parameters; `decay`: names from `decay_names`
    (of the model before or after sharding: the same).

    Fused where torch has the kernel (CPU, CUDA, XPU, MPS): one kernel updates each parameter and
    its two states in place. The foreach implementation (torch's default on CUDA) makes
    temporaries as large as one state over all parameters at once, and on this project's CPUs took
    4-5x as long per step. The simulation (`toolkit.memory.simulation`) builds this same optimizer.
    """
    named = [(unwrapped_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": train.weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    fused = all(p.device.type in FUSED_DEVICES and p.is_floating_point() for _, p in named) or None
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=train.learning_rate, betas=(train.beta1, train.beta2), fused=fused
    )
