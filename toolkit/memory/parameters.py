"""The parameters of the model as training builds it, read from the model itself.

`parameter_specs` builds `GPT(config)` on the meta device (no memory; well under a second at 70B),
applies peft's LoRA to it for LoRA runs, and lists every parameter in `named_parameters()` order
with its shape, whether it trains, what kind of weight it is and the FSDP unit it belongs to, found
from the module structure as FSDP2 is applied in training (one unit per block; untied, one for
what runs before the blocks (the embedding) and one per module after them (final norm, head); a
tied embedding and head stay in the root). Nothing here lists the model's layers by hand.

Quantized bases are not built: their bytes follow the layouts of bitsandbytes and torchao's NF4
(`quantized_bytes`, held to the real libraries in tests/test_estimate.py).
"""

from __future__ import annotations

import math
from typing import Optional

from toolkit.memory.options import Column, Group, Options, ParamSpec
from toolkit.models.config import Config

_MODELS: dict = {}


def meta_model(config: Config, lora_modules: tuple[str, ...] = (), lora_r: int = 8, lora_dropout: float = 0.0,
               layers: Optional[tuple[int, ...]] = None):  # fmt: skip
    """`GPT(config)` on the meta device, with peft's LoRA on `lora_modules` (only the adapters train),
    as finetune_lora prepares it: module names (`q_proj`), and parameters as "<module>.<parameter>"
    (`experts.gate_up_proj`). Cached: the estimate asks for the same model many times.

    `layers`: only these blocks of it (indices into the config's layers; what they do comes from
    `Block(config, index)`), a fresh model the caller may change (`toolkit.memory.activations`)."""
    import copy

    import torch

    from toolkit.models.gpt import GPT

    key = (repr(config), lora_modules, lora_r, lora_dropout)
    model = _MODELS.get(key) if layers is None else None
    if model is not None:
        return model
    if layers is None:
        with torch.device("meta"):
            model = GPT(config)
    else:
        whole = meta_model(config)
        blocks = whole.blocks
        whole.blocks = torch.nn.ModuleList()
        try:
            model = copy.deepcopy(whole)  # the rest of the model (a tied head stays tied)
        finally:
            whole.blocks = blocks
        model.blocks = torch.nn.ModuleList(copy.deepcopy(blocks[i]) for i in layers)
    if lora_modules:
        from peft import inject_adapter_in_model

        from toolkit.models.expert_adapters import lora_config

        present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        targets = [m for m in lora_modules if m in present]
        # "<module>.<parameter>" names (the experts' weights, `PARAMETER_TARGETS`): peft's LoRA on parameters
        parameters = [m for m in lora_modules if "." in m and any(n.endswith("." + m) for n, _ in model.named_parameters())]
        lora = lora_config(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=lora_dropout, target_modules=targets,
                           target_parameters=parameters or None, bias="none")  # fmt: skip
        with torch.device("meta"):
            model = inject_adapter_in_model(lora, model)
        for name, p in model.named_parameters():
            p.requires_grad_(_is_adapter(name))
    if layers is None:
        if len(_MODELS) > 8:
            _MODELS.clear()
        _MODELS[key] = model
    return model


def _is_adapter(name: str) -> bool:
    return ".lora_" in name or name.startswith("lora_")


_SPECS: dict = {}


def parameter_specs(config: Config, lora_modules: tuple[str, ...] = (), lora_r: int = 8) -> list[ParamSpec]:
    """Every parameter of `GPT(config)` (with peft's adapters on `lora_modules`), in the order
    `named_parameters()` yields them. A tied head is the embedding itself and is not repeated."""
    key = (repr(config), tuple(lora_modules), lora_r)
    specs = _SPECS.get(key)
    if specs is None:
        specs = _SPECS[key] = _read_specs(meta_model(config, tuple(lora_modules), lora_r), bool(lora_modules))
    return specs


def run_specs(opts: "Options") -> list[ParamSpec]:
    """`parameter_specs` of what one rank of the run stores: with expert parallelism over N ranks,
    each expert tensor's rows (experts) divided by N, FSDP sharding that part over shard_size / N."""
    from dataclasses import replace

    specs = parameter_specs(opts.config, opts.lora_modules, opts.lora_r)
    N = opts.expert_parallel
    if N == 1:
        return specs
    return [replace(s, shape=(s.shape[0] // N, *s.shape[1:]), expert_parallel=N) if s.kind == "experts" else s
            for s in specs]


def _read_specs(model, lora: bool) -> list[ParamSpec]:
    from torch import nn

    from toolkit.models.gpt import Block
    from toolkit.models.moe import GroupedExperts

    blocks, edges = _units(model, Block)
    group_of: dict[int, tuple[int, Group]] = {}
    for index, block in enumerate(blocks):
        for p in block.parameters():
            group_of.setdefault(id(p), (index, "block"))
    if edges is not None and not edges[2]:
        before, after, _ = edges
        for module in before:
            for p in module.parameters():
                group_of.setdefault(id(p), (-1, "input"))
        for i, module in enumerate(after):
            for p in module.parameters():
                group_of.setdefault(id(p), (-1, "head" if i == len(after) - 1 else "output"))
    from toolkit.models.moe import MoE

    routers = {id(m.router) for m in model.modules() if isinstance(m, MoE)}
    kind_of: dict[int, str] = {}
    for module in model.modules():
        for leaf, p in module.named_parameters(recurse=False):
            if isinstance(module, nn.Embedding):
                kind_of.setdefault(id(p), "embedding")
            elif isinstance(module, nn.Linear) and id(module) in routers:
                kind_of.setdefault(id(p), "router" if leaf == "weight" else "bias")
            elif isinstance(module, GroupedExperts):
                kind_of.setdefault(id(p), "experts")
            elif isinstance(module, nn.Linear):
                kind_of.setdefault(id(p), "linear" if leaf == "weight" else "bias")
            else:
                kind_of.setdefault(id(p), "norm")
    specs = []
    for name, p in model.named_parameters():
        adapter = lora and _is_adapter(name)
        unit, group = group_of.get(id(p), (-1, "root"))
        specs.append(ParamSpec(name, tuple(p.shape), unit, p.requires_grad, "lora" if adapter else kind_of[id(p)],
                               group))  # type: ignore[arg-type]  # fmt: skip
    return specs


def _units(model, block_cls):
    """(the blocks in order, (input modules, output modules, tied) or None): FSDP2's units as
    `shard_model` forms them (`edge_units`)."""
    from toolkit.parallel.fsdp import edge_units

    blocks = [m for m in model.modules() if isinstance(m, block_cls)]
    edges = edge_units(model, block_cls)
    return blocks, None if edges is None else (edges.input, edges.output, edges.tied)


# --------------------------------------------------------------------------------------------
# Quantized weights: the layouts of bitsandbytes and torchao's NF4 (not built: they need real data)
# --------------------------------------------------------------------------------------------


def quantized_bytes(shape: tuple[int, ...], quantize: str) -> int:
    """Bytes stored for one quantized weight of `shape` (data + quantization state): bitsandbytes'
    layouts for "bnb.*", torchao's NF4Tensor for "nf4" (two 4-bit values per byte, one int8 scale
    per block of 64, one bfloat16 factor per 256 of those scales, a 2-byte mean: about 0.516 bytes
    per weight, toolkit.parallel.nf4)."""
    numel = math.prod(shape)
    if quantize == "nf4":
        scalers = -(-numel // 64)
        return -(-numel // 2) + scalers + 2 * -(-scalers // 256) + 2
    if quantize == "bnb.int8":
        return numel + 4 * shape[0]  # int8 weight + float32 scale per output row (SCB)
    blocks = -(-numel // 64)  # one absmax per block of 64 weights
    packed = -(-numel // 2)  # two 4-bit values per byte
    code = 16 * 4  # the 16-entry float32 code book (quant_map)
    if quantize.endswith("-dq"):
        # absmax quantized to one byte per block; per 256 of those a float32 absmax; a 256-entry
        # float32 code book and a float32 offset for the nested quantization
        return packed + blocks + 4 * -(-blocks // 256) + 256 * 4 + 4 + code
    return packed + 4 * blocks + code


def nf4_dequant_bytes(numel: int, compute_bytes: int) -> int:
    """The transient peak of torchao's `NF4Tensor.get_original_weight` (every `linear_nf4` call, forward
    and backward): the high and low 4-bit codes as two int64 tensors of numel / 2 each, beside the
    looked-up values, the scaled values and their interleaved result, each of numel / 2 or numel
    values of the compute dtype: 8 + 3 x compute bytes per weight (14 under bf16)."""
    return numel * (8 + 3 * compute_bytes)


def quantized_names(opts: "Options", specs: list[ParamSpec]) -> set[str]:
    """The parameters stored quantized: the linear weights of the blocks, a mixture's experts
    included (not embedding, norms, head, nor a mixture's router)."""
    return {s.name for s in specs if opts.quantize and is_quantizable(s)}


def is_quantizable(s: ParamSpec) -> bool:
    """A block's linear weight, or a mixture's 3-D expert weights (X linear weights; not their biases)."""
    return s.unit >= 0 and (s.kind == "linear" or (s.kind == "experts" and len(s.shape) == 3))


def nf4_unshardable(config: Config, shards: int) -> Optional[str]:
    """The first block linear weight (toolkit name, shape) that does not split into `shards` row
    ranges of whole NF4 groups (`toolkit.parallel.nf4.check_nf4_shardable`'s rule: experts (X, out,
    in) as their X * out rows), or None."""
    from toolkit.parallel.nf4 import ROW_ALIGN

    for s in parameter_specs(config):
        if is_quantizable(s):
            per_row = s.shape[-1]
            rows = s.numel // per_row
            if rows % shards or (rows // shards) * per_row % ROW_ALIGN:
                return f"{s.name.removesuffix('.weight')} ({' x '.join(str(n) for n in s.shape)})"
    return None


# --------------------------------------------------------------------------------------------
# FSDP2 shards: every parameter split along dim 0, expert weights along dim 1 where their experts
# do not split evenly (`toolkit.parallel.fsdp.expert_shard_dim`)
# --------------------------------------------------------------------------------------------


def shard_rows(rows: int, shards: int) -> list[int]:
    """Rows of each rank's dim-0 shard of a tensor with `rows` rows, as FSDP2 splits it (torch.chunk:
    ceil(rows / shards) rows each, the last ranks fewer or none)."""
    chunk = -(-rows // shards)
    return [max(0, min(chunk, rows - r * chunk)) for r in range(shards)]


def split_inside(s: ParamSpec, shards: int, quantized: frozenset | set = frozenset()) -> bool:
    """Whether FSDP2 splits `s` along dim 1 over `shards` ranks: a mixture's expert weight whose
    experts do not split evenly and whose dim 1 does (never an NF4 one, `expert_placement`)."""
    from toolkit.parallel.fsdp import expert_shard_dim

    return s.kind == "experts" and s.name not in quantized and expert_shard_dim(s.shape, shards) == 1


def padded_shard_numel(s: ParamSpec, shards: int) -> int:
    """Elements FSDP2 allocates for one rank's shard of `s`: every rank pads its shard to the first
    rank's ceil(rows / shards) rows, so that the all-gather and the reduce-scatter are even (split
    along dim 1, the split is even: numel / shards)."""
    if split_inside(s, shards):
        return s.numel // shards
    rows = s.shape[0]
    return -(-rows // shards) * (s.numel // rows)


def shard_bytes(s: ParamSpec, shards: int, opts: "Options", quantized: set[str]) -> int:
    """Bytes of one rank's shard of `s` as stored: its padded rows in `Options.param_bytes`; for a
    quantized (NF4) weight, the NF4 bytes of its rows / `shards` rows, experts (X, out, in) as X * out
    rows (not padded: finetune_lora and the estimate refuse shapes that do not split into whole NF4
    groups, `nf4_unshardable`)."""
    if s.name in quantized:
        return quantized_bytes((s.numel // s.shape[-1] // shards, s.shape[-1]), opts.quantize)  # type: ignore[arg-type]
    return padded_shard_numel(s, shards) * opts.param_bytes(s)


def fsdp_rank_memory(specs: list[ParamSpec], column: "Column", opts: "Options") -> list[dict[str, int]]:
    """Parameter, gradient and optimizer-state bytes on each rank of one shard group (FSDP2).

    Each parameter's shard is padded to the same size on every rank, in the parameter's own dtype
    (trainable or frozen, `Options.param_bytes`). A trainable parameter's gradient shard has the
    same padded size: a view into the unit's reduce-scatter output, in the trainable dtype. Frozen
    parameters get no gradient. AdamW keeps two states shaped like the unpadded local shard, so
    the first ranks, whose shards are fullest, hold the most. A quantized (NF4) weight's shard is
    the NF4 bytes of its rows / W rows (`quantized_base`: those bytes alone).
    """
    W = column.shard_size
    params = grads = quantized_base = 0
    states = [0] * W
    quantized = quantized_names(opts, specs)
    for s in specs:
        group = s.shard_group(W)  # W, or W / N for experts split over N expert-parallel ranks
        shard = shard_bytes(s, group, opts, quantized)
        params += shard
        if s.name in quantized:
            quantized_base += shard
        if s.trainable:
            grads += padded_shard_numel(s, group) * opts.trainable_bytes
            if split_inside(s, group):  # an even split: numel / group on every rank
                elements_of = [s.numel // group] * group
            else:
                elements_of = [rows * (s.numel // s.shape[0]) for rows in shard_rows(s.shape[0], group)]
            for r in range(W):
                states[r] += 2 * elements_of[r % group] * opts.trainable_bytes
    return [{"parameters": params, "gradients": grads, "optimizer_state": n, "quantized_base": quantized_base}
            for n in states]
