"""The training optimizer, shared by training and the memory simulation (which must build the same one).

AdamW over the trainable parameters; weight decay is decided by shape: matrices decay, vectors
(norms, biases) do not.
"""

from __future__ import annotations

from typing import Optional

import torch

from toolkit.args import TrainArgs
from toolkit.models.param_names import unwrapped_name


def decay_names(model) -> set[str]:
    """Weight decay is decided by the parameters' shapes: matrices decay, vectors do not."""
    return {unwrapped_name(n) for n, p in model.named_parameters() if p.ndim >= 2}


def make_adamw(model, decay: set[str], train: TrainArgs, foreach: Optional[bool] = None) -> torch.optim.AdamW:
    """The training AdamW over `model`'s trainable parameters; `decay`: names from `decay_names`
    (of the model before or after sharding: the same). `foreach` None is torch's choice (on for CUDA tensors); the
    simulation (`toolkit.memory.simulation`) passes True to count the GPU's step temporaries on the CPU."""
    named = [(unwrapped_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": train.weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=train.learning_rate, betas=(train.beta1, train.beta2), foreach=foreach
    )
