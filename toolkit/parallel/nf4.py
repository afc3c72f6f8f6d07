"""NF4 (4-bit NormalFloat, QLoRA's format) frozen weights with torchao's `NF4Tensor`, quantized rows at a time.

`--quantize nf4` stores the frozen Linear weights of the blocks as torchao `NF4Tensor`s, used through
`linear_nf4` (dequantize to the input's dtype, then `F.linear`). torchao's tensor subclass knows how
FSDP2 shards and gathers it, so the 4-bit base is sharded like every other frozen weight.

A mixture of experts' 3-D weights (X, out, in) are stored as 2-D NF4Tensors (X * out, in), every
expert's rows one after another (torchao's NF4 shards and gathers 2-D tensors only): the same values
in the same order, so the same NF4 bytes. FSDP2 splits those rows, so a shard may end inside an
expert: Mixtral's 8 experts split over 16 or 64 ranks as evenly as its dense weights. `NF4Experts`
dequantizes a layer's experts for each product and again in its backward pass.
The router stays as it is: a small matrix whose rounding would move tokens to other experts.

The format (torchao's, QLoRA's defaults):

    weight (out, in), flattened  ->  blocks of BLOCK = 64 values, each scaled by its absmax
    absmax per block - mean      ->  int8, in groups of SCALER_BLOCK = 256 blocks, each with a factor
    values / absmax              ->  nearest of the 16 NF4 levels, two 4-bit codes per byte

Only the mean of the block absmaxes spans the whole weight. `nf4_from_rows` quantizes a range of
rows given that mean's parts (the sum of all block absmaxes, and their number), so a rank that reads
only its own rows (`toolkit.training.model_setup.setup_model`) produces exactly the bytes that
quantizing the whole weight and cutting out those rows gives: the same numbers on 1 and N devices.
A range must start and end on a group of SCALER_BLOCK blocks (ROW_ALIGN values), which
`check_nf4_shardable` checks before anything is built.

Importing this module is cheap: torch and torchao are imported inside the functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from toolkit.errors import UserError

if TYPE_CHECKING:
    from torch import Tensor

BLOCK = 64  # values per absmax scale
SCALER_BLOCK = 256  # scales per int8 group (double quantization)
ROW_ALIGN = BLOCK * SCALER_BLOCK  # values per group: a shard must hold whole groups
# The 16 NormalFloat levels (QLoRA's; torchao's `NF4Tensor.from_tensor` uses the same table).
NF4_LEVELS = (-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
              0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0)
# bytes per value: a 4-bit code, an int8 scale per 64 values, a scale factor (4 bytes at most) per 16384
BYTES_PER_VALUE = 0.5 + 1 / BLOCK + 4 / ROW_ALIGN


def is_nf4(tensor: Any) -> bool:
    """True for torchao's NF4Tensor (checked by name: no torchao import for ordinary tensors)."""
    return type(tensor).__name__ == "NF4Tensor"


def nf4_storage_bytes(tensor: Any) -> int:
    """Bytes an NF4Tensor really holds: its codes, scales, factors and mean (not its 16-entry table)."""
    parts = (tensor.quantized_data, tensor.quantized_scalers, tensor.quantization_factor, tensor.scaler_mean)
    return sum(p.numel() * p.element_size() for p in parts)


def block_absmax_sum(rows: Tensor, dtype: Any) -> Tensor:
    """Sum (float64) of the absmax of each block of BLOCK values of `rows`, taken in `dtype`."""
    import torch

    return rows.to(dtype).reshape(-1, BLOCK).abs().amax(dim=1).to(torch.float64).sum()


def nf4_from_rows(rows: Tensor, dtype: Any, absmax_sum: Tensor, n_blocks_total: int):
    """An NF4Tensor of `rows` (a row range of a weight) in `dtype`, with the mean of the whole weight's
    block absmaxes given by its parts (`absmax_sum` over all `n_blocks_total` blocks)."""
    import torch
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, SubclassTensorArgs

    rows = rows.to(dtype).contiguous()
    n_blocks = rows.numel() // BLOCK
    mean = (absmax_sum / n_blocks_total).to(device=rows.device, dtype=dtype)
    scalers = rows.reshape(n_blocks, BLOCK).abs().amax(dim=1) - mean  # (n_blocks,)
    groups = scalers.view(n_blocks // SCALER_BLOCK, SCALER_BLOCK)
    factor = 256 / (2 * groups.abs().amax(dim=1))  # (n_groups,), as torchao computes it
    quantized_scalers = (groups * factor.unsqueeze(-1)).round().clamp(-128, 127).flatten().to(torch.int8)
    levels = torch.tensor(NF4_LEVELS, device=rows.device, dtype=dtype)
    codes = NF4Tensor.convert_to_norm_float_weight(rows, n_blocks, BLOCK, levels)
    meta = SubclassTensorArgs(rows.size(), rows.stride(), 0, dtype, rows.device, False)
    return NF4Tensor(meta, BLOCK, n_blocks, SCALER_BLOCK, quantized_scalers, factor.contiguous(), mean, codes, levels)


def nf4_quantize(weight: Tensor, dtype: Any):
    """The NF4Tensor of a whole weight (on the meta device: an empty one of the right layout)."""
    return nf4_from_rows(weight, dtype, block_absmax_sum(weight, dtype), weight.numel() // BLOCK)


def _nf4_classes() -> tuple[type, type]:
    import torch
    import torch.nn as nn
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

    from toolkit.models.moe import GroupedExperts, expert_product

    class NF4Linear(nn.Linear):
        """A frozen Linear whose weight is an NF4Tensor (an nn.Linear, so that peft wraps it with LoRA)."""

        nf4_parameters = ("weight",)  # stored in NF4 once filled (`apply_precision_policy` counts them so)

        def forward(self, x):
            out = linear_nf4(x, self.weight)  # dequantized to x's dtype; autocast then computes in its dtype
            return out if self.bias is None else out + self.bias

    class NF4ExpertProduct(torch.autograd.Function):
        """x (M, in) sorted by expert times the NF4 experts `weight` (X * out, in) -> (M, out).

        Only the NF4 weight is kept for the backward pass, which dequantizes it again for the input's
        gradient (the weight gets none), as `linear_nf4` does: a layer's dequantized experts live
        for one product, not from the forward pass to the backward pass."""

        @staticmethod
        def forward(ctx, x, weight, counts, grouped):
            ctx.save_for_backward(counts)
            ctx.weight, ctx.grouped = weight, grouped
            return expert_product(x, _dequantized(weight, x.dtype, counts.numel()), counts, grouped)

        @staticmethod
        def backward(ctx, grad):
            (counts,) = ctx.saved_tensors
            weight = _dequantized(ctx.weight, grad.dtype, counts.numel())  # (X, out, in)
            # each run of rows times its expert's (out, in) matrix untransposed: (M, out) -> (M, in)
            return expert_product(grad, weight.transpose(-2, -1), counts, ctx.grouped), None, None, None

    def _dequantized(weight, dtype, experts: int):
        """The NF4 experts (X * out, in) as (X, out, in) in `dtype`."""
        dense = weight.to(dtype)
        return dense.view(experts, -1, dense.shape[1])

    class NF4Experts(GroupedExperts):
        """Frozen experts whose weights are NF4Tensors (X * out, in), expert after expert."""

        nf4_parameters = ("gate_up_proj", "down_proj")  # the biases stay in 16 bits

        def product(self, x, weight, counts, grouped):
            return NF4ExpertProduct.apply(x, weight, counts, grouped)

    return NF4Linear, NF4Experts


_CLASSES: list = []


def nf4_linear_class() -> type:
    if not _CLASSES:
        _CLASSES.extend(_nf4_classes())
    return _CLASSES[0]


def nf4_experts_class() -> type:
    nf4_linear_class()
    return _CLASSES[1]


def quantize_blocks_nf4(model, dtype: Any, device: Any = "cpu") -> None:
    """Replace every Linear inside the blocks by an NF4Linear holding its weight in NF4 (`dtype` to
    compute), and every mixture of experts' experts by NF4Experts; a router stays as it is.

    On the meta device (how finetune_lora builds it) the NF4 weights are empty, filled later weight
    by weight as they are read (`toolkit.training.model_setup.setup_model`: each rank's own rows
    under FSDP; whole weights on one device), except for two small tensors FSDP does not shard and
    `to_empty` does not allocate: the mean and the 16-level table, made here on `device` (where the
    rank trains; one device quantizes there) and filled in place later. With real weights they are
    quantized here.
    """
    import torch
    import torch.nn as nn

    from toolkit.models.moe import GroupedExperts, MoE

    linear_cls, experts_cls = nf4_linear_class(), nf4_experts_class()

    def nf4_parameter(weight):
        # experts (X, out, in) as (X * out, in): the same values in the same order
        quantized = nf4_quantize(weight.detach().flatten(0, -2), dtype)
        if quantized.is_meta:
            quantized.scaler_mean = torch.zeros((), dtype=dtype, device=device)
            quantized.nf4 = torch.zeros(len(NF4_LEVELS), dtype=dtype, device=device)
        return nn.Parameter(quantized, requires_grad=False)

    def frozen(param):
        return nn.Parameter(param.detach().to(dtype), requires_grad=False)

    for block in model.blocks:
        for parent in list(block.modules()):
            for child_name, child in list(parent.named_children()):
                if isinstance(child, GroupedExperts) and not isinstance(child, experts_cls):
                    with torch.device("meta"):
                        experts = experts_cls(child.config)
                    for name, param in child.named_parameters(recurse=False):  # 3-D weights; biases (X, out) stay
                        setattr(experts, name, nf4_parameter(param) if param.ndim == 3 else frozen(param))
                    setattr(parent, child_name, experts)
                elif isinstance(child, nn.Linear) and not isinstance(child, linear_cls) and not isinstance(parent, MoE):
                    layer = linear_cls(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
                    layer.weight = nf4_parameter(child.weight)
                    if child.bias is not None:
                        layer.bias = frozen(child.bias)
                    setattr(parent, child_name, layer)


def check_nf4_shardable(model, shards: int) -> None:
    """Raise UserError unless every weight `quantize_blocks_nf4` quantizes splits into `shards` row
    ranges of whole groups: a block Linear's (out, in) rows, a mixture's experts' (X * out, in) rows.
    With one shard: unless each weight is made of whole groups."""
    import torch.nn as nn

    from toolkit.models.moe import GroupedExperts, MoE

    groups = f"whole groups of {ROW_ALIGN} values (NF4's {SCALER_BLOCK} blocks of {BLOCK})"

    def refuse(weight: str, shape: str, experts: bool) -> None:
        if shards == 1:
            instead = "train the experts in 16 bits (no --quantize)" if experts else "use bnb.nf4"
            raise UserError(f"--quantize nf4 cannot quantize {weight} ({shape}): NF4 takes {groups}; {instead}.")
        raise UserError(f"--quantize nf4 cannot split {weight} ({shape}) over {shards} shards: each needs whole rows "
                        f"making {groups}; use fewer devices{'' if experts else ' or bnb.nf4'}.")

    routers = {id(m.router) for m in model.modules() if isinstance(m, MoE)}
    for name, module in model.named_modules():
        if not name.startswith("blocks."):
            continue
        if isinstance(module, GroupedExperts):
            for leaf, p in module.named_parameters(recurse=False):
                rows = p.shape[0] * p.shape[1] if p.ndim == 3 else 0
                if rows and (rows % shards or (rows // shards) * p.shape[2] % ROW_ALIGN):
                    refuse(f"{name}.{leaf}", f"{p.shape[0]} experts of {p.shape[1]} x {p.shape[2]}", experts=True)
        elif isinstance(module, nn.Linear) and id(module) not in routers:
            out, inp = module.weight.shape
            if out % shards or (out // shards) * inp % ROW_ALIGN:
                refuse(name, f"{out} x {inp}", experts=False)
