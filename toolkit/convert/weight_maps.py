"""Weight names, Hugging Face <-> toolkit, as data: one table per architecture family.

Each table maps a Hugging Face parameter name to a toolkit parameter name. `{l}` stands for the
layer index and is the only placeholder. A value that is a tuple names several toolkit tensors that
Hugging Face stores fused in one tensor (GPT-NeoX's `query_key_value`, Phi-3's `qkv_proj` and
`gate_up_proj`); `FUSED` says how the rows are laid out. `REARRANGED` names the tensors whose values
Hugging Face arranges otherwise (gpt-oss's experts), `QUANTIZED_PARTS` the quantized forms read at
conversion (gpt-oss's MXFP4). The reverse direction (toolkit -> Hugging Face) is derived by
inverting the same tables, so the two directions can never disagree.

A table lists every name the family *can* have (biases included); which names a given model really
has is decided by its `Config` (the toolkit model built on the meta device is the reference).

Pure Python: importing this module does not import torch.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Optional, Union

from toolkit.errors import UserError

Target = Union[str, tuple[str, ...]]

# Llama, Mistral, Qwen2 and Gemma share their layout. Qwen2 adds q/k/v biases, Llama may have
# `attention_bias`/`mlp_bias`; Gemma stores its RMSNorm weights centred on zero, which the toolkit
# model also does (`norm_unit_offset`), so the values are copied unchanged.
LLAMA: dict[str, Target] = {
    "model.embed_tokens.weight": "embed.weight",
    "model.layers.{l}.input_layernorm.weight": "blocks.{l}.norm_1.weight",
    "model.layers.{l}.self_attn.q_proj.weight": "blocks.{l}.attn.q_proj.weight",
    "model.layers.{l}.self_attn.q_proj.bias": "blocks.{l}.attn.q_proj.bias",
    "model.layers.{l}.self_attn.k_proj.weight": "blocks.{l}.attn.k_proj.weight",
    "model.layers.{l}.self_attn.k_proj.bias": "blocks.{l}.attn.k_proj.bias",
    "model.layers.{l}.self_attn.v_proj.weight": "blocks.{l}.attn.v_proj.weight",
    "model.layers.{l}.self_attn.v_proj.bias": "blocks.{l}.attn.v_proj.bias",
    "model.layers.{l}.self_attn.o_proj.weight": "blocks.{l}.attn.o_proj.weight",
    "model.layers.{l}.self_attn.o_proj.bias": "blocks.{l}.attn.o_proj.bias",
    "model.layers.{l}.post_attention_layernorm.weight": "blocks.{l}.norm_2.weight",
    "model.layers.{l}.mlp.gate_proj.weight": "blocks.{l}.mlp.gate_proj.weight",
    "model.layers.{l}.mlp.gate_proj.bias": "blocks.{l}.mlp.gate_proj.bias",
    "model.layers.{l}.mlp.up_proj.weight": "blocks.{l}.mlp.up_proj.weight",
    "model.layers.{l}.mlp.up_proj.bias": "blocks.{l}.mlp.up_proj.bias",
    "model.layers.{l}.mlp.down_proj.weight": "blocks.{l}.mlp.down_proj.weight",
    "model.layers.{l}.mlp.down_proj.bias": "blocks.{l}.mlp.down_proj.bias",
    "model.norm.weight": "norm_f.weight",
    "lm_head.weight": "lm_head.weight",
}

# Gemma 2 and Gemma 3 (text): a norm before and after attention and before and after the MLP
# (`norm_position` "sandwich"), stored centred on zero as Gemma's; Gemma 3 adds per-head QK norms.
GEMMA2: dict[str, Target] = {
    "model.embed_tokens.weight": "embed.weight",
    "model.layers.{l}.input_layernorm.weight": "blocks.{l}.norm_1.weight",
    "model.layers.{l}.self_attn.q_proj.weight": "blocks.{l}.attn.q_proj.weight",
    "model.layers.{l}.self_attn.k_proj.weight": "blocks.{l}.attn.k_proj.weight",
    "model.layers.{l}.self_attn.v_proj.weight": "blocks.{l}.attn.v_proj.weight",
    "model.layers.{l}.self_attn.o_proj.weight": "blocks.{l}.attn.o_proj.weight",
    "model.layers.{l}.post_attention_layernorm.weight": "blocks.{l}.post_attn_norm.weight",
    "model.layers.{l}.pre_feedforward_layernorm.weight": "blocks.{l}.norm_2.weight",
    "model.layers.{l}.mlp.gate_proj.weight": "blocks.{l}.mlp.gate_proj.weight",
    "model.layers.{l}.mlp.up_proj.weight": "blocks.{l}.mlp.up_proj.weight",
    "model.layers.{l}.mlp.down_proj.weight": "blocks.{l}.mlp.down_proj.weight",
    "model.layers.{l}.post_feedforward_layernorm.weight": "blocks.{l}.post_mlp_norm.weight",
    "model.norm.weight": "norm_f.weight",
    "lm_head.weight": "lm_head.weight",
}
GEMMA3: dict[str, Target] = {
    **GEMMA2,
    "model.layers.{l}.self_attn.q_norm.weight": "blocks.{l}.attn.q_norm.weight",
    "model.layers.{l}.self_attn.k_norm.weight": "blocks.{l}.attn.k_norm.weight",
}

# transformers' native `PhiForCausalLM` (Phi-1.5, Phi-2): one LayerNorm per block shared by the
# attention and the MLP (parallel residual), biases everywhere, an output head with a bias.
PHI: dict[str, Target] = {
    "model.embed_tokens.weight": "embed.weight",
    "model.layers.{l}.input_layernorm.weight": "blocks.{l}.norm_1.weight",
    "model.layers.{l}.input_layernorm.bias": "blocks.{l}.norm_1.bias",
    "model.layers.{l}.self_attn.q_proj.weight": "blocks.{l}.attn.q_proj.weight",
    "model.layers.{l}.self_attn.q_proj.bias": "blocks.{l}.attn.q_proj.bias",
    "model.layers.{l}.self_attn.k_proj.weight": "blocks.{l}.attn.k_proj.weight",
    "model.layers.{l}.self_attn.k_proj.bias": "blocks.{l}.attn.k_proj.bias",
    "model.layers.{l}.self_attn.v_proj.weight": "blocks.{l}.attn.v_proj.weight",
    "model.layers.{l}.self_attn.v_proj.bias": "blocks.{l}.attn.v_proj.bias",
    "model.layers.{l}.self_attn.dense.weight": "blocks.{l}.attn.o_proj.weight",
    "model.layers.{l}.self_attn.dense.bias": "blocks.{l}.attn.o_proj.bias",
    "model.layers.{l}.mlp.fc1.weight": "blocks.{l}.mlp.fc_in.weight",
    "model.layers.{l}.mlp.fc1.bias": "blocks.{l}.mlp.fc_in.bias",
    "model.layers.{l}.mlp.fc2.weight": "blocks.{l}.mlp.fc_out.weight",
    "model.layers.{l}.mlp.fc2.bias": "blocks.{l}.mlp.fc_out.bias",
    "model.final_layernorm.weight": "norm_f.weight",
    "model.final_layernorm.bias": "norm_f.bias",
    "lm_head.weight": "lm_head.weight",
    "lm_head.bias": "lm_head.bias",
}

# GPT-NeoX (Pythia). Query, key and value live in one fused matrix; see FUSED for its row layout.
GPT_NEOX: dict[str, Target] = {
    "gpt_neox.embed_in.weight": "embed.weight",
    "gpt_neox.layers.{l}.input_layernorm.weight": "blocks.{l}.norm_1.weight",
    "gpt_neox.layers.{l}.input_layernorm.bias": "blocks.{l}.norm_1.bias",
    "gpt_neox.layers.{l}.attention.query_key_value.weight": (
        "blocks.{l}.attn.q_proj.weight",
        "blocks.{l}.attn.k_proj.weight",
        "blocks.{l}.attn.v_proj.weight",
    ),
    "gpt_neox.layers.{l}.attention.query_key_value.bias": (
        "blocks.{l}.attn.q_proj.bias",
        "blocks.{l}.attn.k_proj.bias",
        "blocks.{l}.attn.v_proj.bias",
    ),
    "gpt_neox.layers.{l}.attention.dense.weight": "blocks.{l}.attn.o_proj.weight",
    "gpt_neox.layers.{l}.attention.dense.bias": "blocks.{l}.attn.o_proj.bias",
    "gpt_neox.layers.{l}.post_attention_layernorm.weight": "blocks.{l}.norm_2.weight",
    "gpt_neox.layers.{l}.post_attention_layernorm.bias": "blocks.{l}.norm_2.bias",
    "gpt_neox.layers.{l}.mlp.dense_h_to_4h.weight": "blocks.{l}.mlp.fc_in.weight",
    "gpt_neox.layers.{l}.mlp.dense_h_to_4h.bias": "blocks.{l}.mlp.fc_in.bias",
    "gpt_neox.layers.{l}.mlp.dense_4h_to_h.weight": "blocks.{l}.mlp.fc_out.weight",
    "gpt_neox.layers.{l}.mlp.dense_4h_to_h.bias": "blocks.{l}.mlp.fc_out.bias",
    "gpt_neox.final_layer_norm.weight": "norm_f.weight",
    "gpt_neox.final_layer_norm.bias": "norm_f.bias",
    "embed_out.weight": "lm_head.weight",
}

# Qwen3: Llama's layout and a per-head RMSNorm of queries and keys (weights of size head_dim).
_QK_NORMS: dict[str, Target] = {
    "model.layers.{l}.self_attn.q_norm.weight": "blocks.{l}.attn.q_norm.weight",
    "model.layers.{l}.self_attn.k_norm.weight": "blocks.{l}.attn.k_norm.weight",
}
QWEN3: dict[str, Target] = {**LLAMA, **_QK_NORMS}

# OLMo 2: no norm before attention or MLP; its `post_attention_layernorm` normalises the attention's
# output (in Llama the same name is the norm before the MLP) and `post_feedforward_layernorm` the
# MLP's. QK norm over the whole projection (weights of size H * D and G * D).
OLMO2: dict[str, Target] = {
    **{hf: tk for hf, tk in LLAMA.items() if "layernorm" not in hf},
    **_QK_NORMS,
    "model.layers.{l}.post_attention_layernorm.weight": "blocks.{l}.post_attn_norm.weight",
    "model.layers.{l}.post_feedforward_layernorm.weight": "blocks.{l}.post_mlp_norm.weight",
}

# transformers' `Phi3ForCausalLM` (Phi-3, Phi-3.5, Phi-4, Phi-4-mini): Llama's layer with query, key
# and value fused in `qkv_proj` and the MLP's gate and up projections in `gate_up_proj` (FUSED
# "concat": the parts' rows one after the other, q (H*D), k (G*D), v (G*D); gate, then up).
PHI3: dict[str, Target] = {
    "model.embed_tokens.weight": "embed.weight",
    "model.layers.{l}.input_layernorm.weight": "blocks.{l}.norm_1.weight",
    "model.layers.{l}.self_attn.qkv_proj.weight": (
        "blocks.{l}.attn.q_proj.weight",
        "blocks.{l}.attn.k_proj.weight",
        "blocks.{l}.attn.v_proj.weight",
    ),
    "model.layers.{l}.self_attn.o_proj.weight": "blocks.{l}.attn.o_proj.weight",
    "model.layers.{l}.post_attention_layernorm.weight": "blocks.{l}.norm_2.weight",
    "model.layers.{l}.mlp.gate_up_proj.weight": ("blocks.{l}.mlp.gate_proj.weight", "blocks.{l}.mlp.up_proj.weight"),
    "model.layers.{l}.mlp.down_proj.weight": "blocks.{l}.mlp.down_proj.weight",
    "model.norm.weight": "norm_f.weight",
    "lm_head.weight": "lm_head.weight",
}

# gpt-oss: Llama's names with biases on every attention projection, a sink logit per head, and
# every MLP a mixture of experts: a router with a bias, the experts' weights and biases one tensor
# per layer each, in transformers' layout (see REARRANGED).
GPT_OSS: dict[str, Target] = {
    **{hf: tk for hf, tk in LLAMA.items() if ".mlp." not in hf and hf != "lm_head.bias"},
    "model.layers.{l}.self_attn.sinks": "blocks.{l}.attn.sinks",
    "model.layers.{l}.mlp.router.weight": "blocks.{l}.mlp.router.weight",
    "model.layers.{l}.mlp.router.bias": "blocks.{l}.mlp.router.bias",
    "model.layers.{l}.mlp.experts.gate_up_proj": "blocks.{l}.mlp.experts.gate_up_proj",
    "model.layers.{l}.mlp.experts.gate_up_proj_bias": "blocks.{l}.mlp.experts.gate_up_bias",
    "model.layers.{l}.mlp.experts.down_proj": "blocks.{l}.mlp.experts.down_proj",
    "model.layers.{l}.mlp.experts.down_proj_bias": "blocks.{l}.mlp.experts.down_bias",
}

WEIGHT_MAPS: dict[str, dict[str, Target]] = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "gemma": LLAMA,
    "gemma2": GEMMA2,
    "gemma3": GEMMA3,
    "phi": PHI,
    "gpt_neox": GPT_NEOX,
    "qwen3": QWEN3,
    "olmo2": OLMO2,
    "smollm3": LLAMA,  # Llama's names; its NoPE layers have no weights of their own
    "phi3": PHI3,
    "gpt_oss": GPT_OSS,
}

# Row layout of each family's fused tensors:
#   "per_head"  [head, (q, k, v), head_size]: head 0's query rows, its key rows, its value rows, then
#               head 1's, and so on (GPT-NeoX; parts of equal size)
#   "concat"    the parts one after the other, of any sizes (Phi-3's [q; k; v] under grouped-query
#               attention, and [gate; up])
FUSED: dict[str, str] = {"gpt_neox": "per_head", "phi3": "concat"}

# Tensors whose values Hugging Face keeps in another arrangement than the toolkit (values move, none
# changes), by family and toolkit template: the steps that take the toolkit tensor to Hugging Face's.
#   "interleave"  the two halves of each expert's rows (gate, then up) alternate: gate 0, up 0,
#                 gate 1, up 1, ... (the rows of a (X, 2I, C) weight, the values of a (X, 2I) bias)
#   "transpose"   each expert's matrix transposed: (X, R, C) -> (X, C, R), as `x @ W` reads it
# gpt-oss (transformers' GptOssExperts): gate_up_proj (X, C, 2I) with gate and up interleaved,
# gate_up_proj_bias (X, 2I) interleaved, down_proj (X, I, C); the toolkit's are (X, 2I, C) gate then
# up, (X, 2I), (X, C, I).
REARRANGED: dict[str, dict[str, tuple[str, ...]]] = {
    "gpt_oss": {
        "blocks.{l}.mlp.experts.gate_up_proj": ("interleave", "transpose"),
        "blocks.{l}.mlp.experts.gate_up_bias": ("interleave",),
        "blocks.{l}.mlp.experts.down_proj": ("transpose",),
    },
}

# Quantized forms Hugging Face checkpoints store a tensor in, read (dequantized) but never written:
# name suffix of each stored part -> the format. gpt-oss's published checkpoints hold their experts'
# weights as MXFP4 (`gate_up_proj_blocks` and `gate_up_proj_scales` for `gate_up_proj`; see
# `toolkit.convert.mxfp4`).
QUANTIZED_PARTS: dict[str, dict[str, tuple[str, ...]]] = {"gpt_oss": {"mxfp4": ("_blocks", "_scales")}}

# Buffers that some Hugging Face checkpoints carry but that are not weights (recomputed from the
# config by both implementations). Matched against the end of the name.
IGNORED_SUFFIXES: tuple[str, ...] = (
    "rotary_emb.inv_freq",
    "rotary_emb.original_inv_freq",
    ".attention.bias",  # GPT-NeoX causal mask (old checkpoints)
    ".attention.masked_bias",
    "embed_tokens.embed_scale",
)

_LAYER = re.compile(r"\.(\d+)\.")


def _template(name: str) -> tuple[str, Optional[str]]:
    """("model.layers.{l}.x", "3") for "model.layers.3.x"; (name, None) when there is no index."""
    match = _LAYER.search(name)
    if match is None:
        return name, None
    return name[: match.start()] + ".{l}." + name[match.end() :], match.group(1)


def _fill(template: str, layer: Optional[str]) -> str:
    return template if layer is None else template.replace("{l}", layer)


def is_ignored(hf_name: str) -> bool:
    return hf_name.endswith(IGNORED_SUFFIXES)


def weight_map(family: str) -> dict[str, Target]:
    try:
        return WEIGHT_MAPS[family]
    except KeyError:
        raise UserError(
            f"No weight map for model family {family!r}; supported families: {', '.join(WEIGHT_MAPS)}"
        ) from None


def hf_to_toolkit_name(family: str, hf_name: str) -> Target:
    """The toolkit name(s) for a Hugging Face weight name. Unknown names are a UserError."""
    template, layer = _template(hf_name)
    target = weight_map(family).get(template)
    if target is None:
        raise UserError(
            f"Unexpected weight {hf_name!r} in a {family} checkpoint: it has no toolkit equivalent "
            "(is the config.json architecture right?)"
        )
    if isinstance(target, tuple):
        return tuple(_fill(t, layer) for t in target)
    return _fill(target, layer)


@lru_cache(maxsize=None)
def reverse_map(family: str) -> dict[str, tuple[str, int, int]]:
    """Toolkit template -> (HF template, index within the fused tensor, number of parts).

    Derived from the family's table; a plain (unfused) tensor has index 0 of 1 part.
    """
    reverse: dict[str, tuple[str, int, int]] = {}
    for hf_template, target in weight_map(family).items():
        parts = target if isinstance(target, tuple) else (target,)
        for index, toolkit_template in enumerate(parts):
            if toolkit_template in reverse:
                raise AssertionError(f"{toolkit_template} appears twice in the {family} weight map")
            reverse[toolkit_template] = (hf_template, index, len(parts))
    return reverse


def toolkit_to_hf_name(family: str, toolkit_name: str) -> tuple[str, int, int]:
    """(HF name, index within the fused tensor, number of fused parts) for a toolkit weight name."""
    template, layer = _template(toolkit_name)
    entry = reverse_map(family).get(template)
    if entry is None:
        raise UserError(f"Toolkit weight {toolkit_name!r} has no Hugging Face equivalent for family {family!r}")
    hf_template, index, parts = entry
    return _fill(hf_template, layer), index, parts


# ---------------------------------------------------------------------------- rearranged tensors
def rearrangement(family: str, toolkit_name: str) -> tuple[str, ...]:
    """The steps (see REARRANGED) from the toolkit tensor to Hugging Face's; () for a plain copy."""
    return REARRANGED.get(family, {}).get(_template(toolkit_name)[0], ())


def hf_shape(shape: tuple[int, ...], steps: tuple[str, ...]) -> tuple[int, ...]:
    """The shape of the Hugging Face tensor of a toolkit tensor of `shape`."""
    return (*shape[:-2], shape[-1], shape[-2]) if "transpose" in steps else shape


def _regroup(tensor, groups: int):
    """The rows (dim -2 of a 3-D tensor, dim -1 of a 2-D bias) read as `groups` consecutive blocks
    become interleaved: row i of block b moves to i * groups + b. With groups = n / 2 the inverse
    of groups = 2 (n rows)."""
    dim = -2 if tensor.dim() == 3 else -1
    # unflatten puts the (groups, rows per group) dims at (dim - 1, dim)
    split = tensor.unflatten(dim, (groups, tensor.shape[dim] // groups))
    return split.transpose(dim - 1, dim).flatten(dim - 1, dim)


def to_hf_arrangement(tensor, steps: tuple[str, ...]):
    """The toolkit tensor -> Hugging Face's arrangement (`steps`, in order): a new contiguous tensor."""
    for step in steps:
        if step == "interleave":  # [gate; up] -> gate 0, up 0, gate 1, up 1, ...
            tensor = _regroup(tensor, 2)
        elif step == "transpose":
            tensor = tensor.transpose(-1, -2)
        else:  # pragma: no cover - a step without its code
            raise AssertionError(step)
    return tensor.contiguous()


def from_hf_arrangement(tensor, steps: tuple[str, ...]):
    """The inverse of `to_hf_arrangement`: Hugging Face's tensor -> the toolkit's, new and contiguous."""
    for step in reversed(steps):
        if step == "interleave":  # gate 0, up 0, gate 1, ... -> [gate; up]
            tensor = _regroup(tensor, tensor.shape[-2 if tensor.dim() == 3 else -1] // 2)
        elif step == "transpose":
            tensor = tensor.transpose(-1, -2)
        else:  # pragma: no cover
            raise AssertionError(step)
    return tensor.contiguous()


def quantized_stem(family: str, hf_name: str) -> Optional[tuple[str, str, int]]:
    """(the name of the tensor it holds part of, the format, which part) for a stored part of a
    quantized tensor (`QUANTIZED_PARTS`) whose stem the family's table names; else None."""
    for fmt, suffixes in QUANTIZED_PARTS.get(family, {}).items():
        for index, suffix in enumerate(suffixes):
            if hf_name.endswith(suffix):
                stem = hf_name[: -len(suffix)]
                if _template(stem)[0] in weight_map(family):
                    return stem, fmt, index
    return None


# ---------------------------------------------------------------------------- fused tensors
def split_fused(tensor, family: str, sizes: tuple[int, ...], head_size: int) -> list:
    """Split a fused tensor into its parts; `sizes` are the parts' row counts. Rows move, values do not."""
    layout = FUSED[family]
    rest = tuple(tensor.shape[1:])
    if layout == "concat":
        return list(tensor.split(list(sizes), dim=0))
    if layout != "per_head":  # pragma: no cover - a layout without its code
        raise AssertionError(layout)
    if len(set(sizes)) != 1 or sizes[0] % head_size:
        raise UserError(f"Cannot split a fused tensor into parts of {sizes} rows with head size {head_size}")
    n_heads = sizes[0] // head_size
    grouped = tensor.reshape(n_heads, len(sizes), head_size, *rest)
    return [grouped[:, i].reshape(sizes[i], *rest) for i in range(len(sizes))]


def fuse(parts: list, family: str, head_size: int):
    """The inverse of `split_fused`: one new tensor."""
    import torch

    layout = FUSED[family]
    if layout == "concat":
        return torch.cat(parts, dim=0)
    if layout != "per_head":  # pragma: no cover
        raise AssertionError(layout)
    rest = tuple(parts[0].shape[1:])
    n_heads = parts[0].shape[0] // head_size
    stacked = torch.stack([p.reshape(n_heads, head_size, *rest) for p in parts], dim=1)
    return stacked.reshape(n_heads * len(parts) * head_size, *rest)
