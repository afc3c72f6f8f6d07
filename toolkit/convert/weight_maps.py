"""Weight names, Hugging Face <-> toolkit, as data: one table per architecture family.

Each table maps a Hugging Face parameter name to a toolkit parameter name. `{l}` stands for the
layer index, `{e}` for the expert index of a mixture of experts. A value that is a tuple names
several toolkit tensors that Hugging Face stores fused in one tensor (GPT-NeoX's `query_key_value`,
Phi-3's `qkv_proj` and `gate_up_proj`); `FUSED` says how the rows are laid out. A value that is an
`ExpertPart` names the toolkit expert tensor (X experts stacked on dim 0) that the Hugging Face
tensor is a part of, and which part. The reverse direction (toolkit -> Hugging Face) is derived by
inverting the same tables, so the two directions can never disagree; `ALTERNATIVE_NAMES` lists the
other layouts a family's checkpoints come in, and `QUANTIZED_PARTS` the quantized forms (gpt-oss's
MXFP4), read but never written.

A table lists every name the family *can* have (biases included); which names a given model really
has is decided by its `Config` (the toolkit model built on the meta device is the reference).

Pure Python: importing this module does not import torch.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Union

from toolkit.errors import UserError


@dataclass(frozen=True)
class ExpertPart:
    """A Hugging Face tensor that holds part of a toolkit expert tensor: a weight of
    `GroupedExperts`, (X, R, C), or its bias, (X, R). Each expert's R rows are `blocks` equal
    blocks one after the other (gate_up_proj: the gate projection's I rows, then the up
    projection's I rows, blocks=2; down_proj: blocks=1).

    The Hugging Face tensor holds one expert's part when its name has `{e}` (filled in, `expert`
    says which), else all X experts' stacked on dim 0 (`expert` None). Per expert it holds:

      block=None   all R rows, the blocks one after the other, or with `interleaved` alternating
                   row by row (gate row 0, up row 0, gate row 1, ...)
      block=b      the rows of block b only
      transposed   each expert's matrix stored (C, rows), as `x @ W` reads it, instead of
                   (rows, C) like an nn.Linear weight (a bias, 1-D per expert, is never transposed)

    For example, a per-expert checkpoint (Mixtral's hub files):
        model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight (I, C)  block=0, blocks=2
        model.layers.{l}.block_sparse_moe.experts.{e}.w3.weight (I, C)  block=1, blocks=2
        model.layers.{l}.block_sparse_moe.experts.{e}.w2.weight (C, I)  (all of down_proj's rows)
    and one tensor for all experts, transposed and interleaved (gpt-oss):
        model.layers.{l}.mlp.experts.gate_up_proj (X, C, 2I)  blocks=2, interleaved, transposed
    The layout transformers 5 keeps in memory, (X, 2I, C) with gate then up, is the toolkit's own:
    a plain name in the tables.
    """

    target: str  # the toolkit tensor's name (template)
    block: Optional[int] = None
    blocks: int = 1
    interleaved: bool = False
    transposed: bool = False
    expert: Optional[int] = None  # set by `hf_to_toolkit_name` for a one-expert name; None in the tables

    def __post_init__(self) -> None:
        if self.blocks < 1 or (self.block is not None and not 0 <= self.block < self.blocks):
            raise AssertionError(f"ExpertPart block {self.block} of {self.blocks}")
        if self.interleaved and (self.block is not None or self.blocks < 2):
            raise AssertionError("ExpertPart: interleaved describes all of several blocks")


Target = Union[str, tuple[str, ...], ExpertPart]

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

# ---------------------------------------------------------------------------- mixtures of experts
_ROUTER = "blocks.{l}.mlp.router.weight"


def _per_expert(prefix: str, gate: str, up: str, down: str) -> dict[str, Target]:
    """The layout of the hub checkpoints of Mixtral, Qwen3-MoE and OLMoE: each expert's gate, up and
    down projections as nn.Linear weights of their own under `prefix.{e}`."""
    experts = "blocks.{l}.mlp.experts."
    return {
        f"{prefix}.{{e}}.{gate}.weight": ExpertPart(experts + "gate_up_proj", block=0, blocks=2),
        f"{prefix}.{{e}}.{up}.weight": ExpertPart(experts + "gate_up_proj", block=1, blocks=2),
        f"{prefix}.{{e}}.{down}.weight": ExpertPart(experts + "down_proj"),
    }


_NO_BIAS_NO_MLP = {hf: tk for hf, tk in LLAMA.items() if ".mlp." not in hf and not hf.endswith(".bias")}

# Mixtral: Llama's attention and norms; every layer's MLP is the mixture (w1 gate, w3 up, w2 down).
MIXTRAL: dict[str, Target] = {
    **_NO_BIAS_NO_MLP,
    "model.layers.{l}.block_sparse_moe.gate.weight": _ROUTER,
    **_per_expert("model.layers.{l}.block_sparse_moe.experts", "w1", "w3", "w2"),
}
# Qwen3-MoE: Qwen3's layer (per-head QK norms) with the mixture, or with Qwen3's dense MLP in the
# layers `mlp_only_layers` / `decoder_sparse_step` leave dense (the toolkit's `moe_layers`).
QWEN3_MOE: dict[str, Target] = {
    **{hf: tk for hf, tk in QWEN3.items() if not hf.endswith(".bias")},
    "model.layers.{l}.mlp.gate.weight": _ROUTER,
    **_per_expert("model.layers.{l}.mlp.experts", "gate_proj", "up_proj", "down_proj"),
}
# OLMoE: Llama's pre-norm layer with QK norms over the whole projections (weights of H * D and
# G * D), every layer a mixture.
OLMOE: dict[str, Target] = {
    **_NO_BIAS_NO_MLP,
    **_QK_NORMS,
    "model.layers.{l}.mlp.gate.weight": _ROUTER,
    **_per_expert("model.layers.{l}.mlp.experts", "gate_proj", "up_proj", "down_proj"),
}

# gpt-oss: Llama's names with biases on every attention projection, a sink logit per head, and
# every MLP a mixture of experts: a router with a bias, the experts' weights and biases one tensor
# per layer each, in transformers' layout: gate_up_proj (X, C, 2I) with the gate's and the up
# projection's columns alternating, gate_up_proj_bias (X, 2I) alternating too, down_proj (X, I, C);
# down_proj_bias (X, C) is the toolkit's own.
GPT_OSS: dict[str, Target] = {
    **{hf: tk for hf, tk in LLAMA.items() if ".mlp." not in hf and hf != "lm_head.bias"},
    "model.layers.{l}.self_attn.sinks": "blocks.{l}.attn.sinks",
    "model.layers.{l}.mlp.router.weight": _ROUTER,
    "model.layers.{l}.mlp.router.bias": "blocks.{l}.mlp.router.bias",
    "model.layers.{l}.mlp.experts.gate_up_proj": ExpertPart("blocks.{l}.mlp.experts.gate_up_proj", blocks=2,
                                                            interleaved=True, transposed=True),
    "model.layers.{l}.mlp.experts.gate_up_proj_bias": ExpertPart("blocks.{l}.mlp.experts.gate_up_bias", blocks=2,
                                                                 interleaved=True),
    "model.layers.{l}.mlp.experts.down_proj": ExpertPart("blocks.{l}.mlp.experts.down_proj", transposed=True),
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
    "mixtral": MIXTRAL,
    "qwen3_moe": QWEN3_MOE,
    "olmoe": OLMOE,
    "gpt_oss": GPT_OSS,
}

# Other names a family's checkpoints may use for the same tensors: read, never written (the export
# writes the family's table above, the layout of its hub checkpoints, which transformers 5.23 loads
# and also writes itself: `save_pretrained` turns its fused expert tensors back into per-expert
# ones unless `save_original_format=False`). With that option, transformers 5 saves its in-memory
# layout: one (X, 2I, C) gate_up_proj (gate rows, then up rows) and one (X, C, I) down_proj per
# layer, the toolkit's own, and Mixtral's router as `mlp.gate` (its `block_sparse_moe` renamed).
_TRANSFORMERS_EXPERTS: dict[str, Target] = {
    "model.layers.{l}.mlp.experts.gate_up_proj": "blocks.{l}.mlp.experts.gate_up_proj",
    "model.layers.{l}.mlp.experts.down_proj": "blocks.{l}.mlp.experts.down_proj",
}
ALTERNATIVE_NAMES: dict[str, dict[str, Target]] = {
    "mixtral": {**_TRANSFORMERS_EXPERTS, "model.layers.{l}.mlp.gate.weight": _ROUTER},
    "qwen3_moe": _TRANSFORMERS_EXPERTS,
    "olmoe": _TRANSFORMERS_EXPERTS,
}

# Row layout of each family's fused tensors:
#   "per_head"  [head, (q, k, v), head_size]: head 0's query rows, its key rows, its value rows, then
#               head 1's, and so on (GPT-NeoX; parts of equal size)
#   "concat"    the parts one after the other, of any sizes (Phi-3's [q; k; v] under grouped-query
#               attention, and [gate; up])
FUSED: dict[str, str] = {"gpt_neox": "per_head", "phi3": "concat"}

# Quantized forms Hugging Face checkpoints store a tensor in, read (dequantized) but never written:
# name suffix of each stored part -> the format. gpt-oss's published checkpoints hold their experts'
# weights as MXFP4 (`gate_up_proj_blocks` and `gate_up_proj_scales` for `gate_up_proj`; see
# `toolkit.convert.mxfp4`). Dequantized, such a tensor is the one its stem names in the table (an
# expert tensor's `ExpertPart`), read one expert at a time.
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

_INDEX = re.compile(r"\.(\d+)\.")


def _template(name: str) -> tuple[str, Optional[str], Optional[str]]:
    """("model.layers.{l}.experts.{e}.x", "3", "5") for "model.layers.3.experts.5.x": the first index
    is the layer's, a second one an expert's; None for an index the name does not have."""
    indices = []
    for placeholder in ("{l}", "{e}"):
        match = _INDEX.search(name)
        if match is None:
            break
        indices.append(match.group(1))
        name = name[: match.start()] + f".{placeholder}." + name[match.end() :]
    indices += [None] * (2 - len(indices))
    return name, indices[0], indices[1]


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
    """The toolkit name(s) for a Hugging Face weight name, of the family's table or its alternative
    names. An `ExpertPart` comes with its toolkit name and expert index filled in. Unknown names are
    a UserError."""
    template, layer, expert = _template(hf_name)
    target = weight_map(family).get(template) or ALTERNATIVE_NAMES.get(family, {}).get(template)
    if target is None:
        raise UserError(
            f"Unexpected weight {hf_name!r} in a {family} checkpoint: it has no toolkit equivalent "
            "(is the config.json architecture right?)"
        )
    if isinstance(target, ExpertPart):
        return dataclasses.replace(target, target=_fill(target.target, layer),
                                   expert=None if expert is None else int(expert))
    if isinstance(target, tuple):
        return tuple(_fill(t, layer) for t in target)
    return _fill(target, layer)


@lru_cache(maxsize=None)
def reverse_map(family: str) -> dict[str, tuple[str, int, int]]:
    """Toolkit template -> (HF template, index within the fused tensor, number of parts).

    Derived from the family's table; a plain (unfused) tensor has index 0 of 1 part. Expert tensors
    stored in parts are in `expert_reverse_map` instead.
    """
    reverse: dict[str, tuple[str, int, int]] = {}
    for hf_template, target in weight_map(family).items():
        if isinstance(target, ExpertPart):
            continue
        parts = target if isinstance(target, tuple) else (target,)
        for index, toolkit_template in enumerate(parts):
            if toolkit_template in reverse:
                raise AssertionError(f"{toolkit_template} appears twice in the {family} weight map")
            reverse[toolkit_template] = (hf_template, index, len(parts))
    return reverse


@lru_cache(maxsize=None)
def expert_reverse_map(family: str) -> dict[str, tuple[tuple[str, ExpertPart], ...]]:
    """Toolkit template -> its parts in the family's table: (HF template, ExpertPart), in table order."""
    reverse: dict[str, list[tuple[str, ExpertPart]]] = {}
    for hf_template, target in weight_map(family).items():
        if isinstance(target, ExpertPart):
            reverse.setdefault(target.target, []).append((hf_template, target))
    clash = set(reverse) & set(reverse_map(family))
    if clash:
        raise AssertionError(f"{sorted(clash)[0]} is both a plain and an expert tensor in the {family} weight map")
    return {name: tuple(parts) for name, parts in reverse.items()}


def toolkit_to_hf_name(family: str, toolkit_name: str) -> tuple[str, int, int]:
    """(HF name, index within the fused tensor, number of fused parts) for a toolkit weight name."""
    template, layer, _ = _template(toolkit_name)
    entry = reverse_map(family).get(template)
    if entry is None:
        if template in expert_reverse_map(family):
            raise UserError(f"Toolkit weight {toolkit_name!r} is stored in parts, per expert, in a {family} "
                            "Hugging Face checkpoint (see `expert_parts`)")
        raise UserError(f"Toolkit weight {toolkit_name!r} has no Hugging Face equivalent for family {family!r}")
    hf_template, index, parts = entry
    return _fill(hf_template, layer), index, parts


def expert_parts(family: str, toolkit_name: str) -> list[tuple[str, ExpertPart]]:
    """The Hugging Face tensors a toolkit expert tensor is written as: (name, part), the layer filled
    in and, for one expert's parts, `{e}` left for the caller; [] for a tensor that is not one."""
    template, layer, _ = _template(toolkit_name)
    return [(_fill(hf, layer), dataclasses.replace(part, target=toolkit_name))
            for hf, part in expert_reverse_map(family).get(template, ())]


def hf_whole_expert_tensor(family: str, toolkit_name: str) -> Optional[tuple[str, Optional[ExpertPart]]]:
    """The Hugging Face tensor that holds all X experts of a toolkit expert tensor in one, as
    transformers 5 keeps it in memory: (its name, None) when its layout is the toolkit's (Qwen3-MoE,
    Mixtral and OLMoE, through `ALTERNATIVE_NAMES`), (its name, its `ExpertPart`) when the table
    stores it whole in another layout (gpt-oss: transposed, gate and up interleaved); None when the
    family keeps no such tensor (peft's adapters on a parameter need one to attach to)."""
    template, layer, _ = _template(toolkit_name)
    for hf_template, target in ALTERNATIVE_NAMES.get(family, {}).items():
        if target == template:
            return _fill(hf_template, layer), None
    for hf_template, part in expert_reverse_map(family).get(template, ()):
        if "{e}" not in hf_template and part.block is None:
            return _fill(hf_template, layer), dataclasses.replace(part, target=toolkit_name)
    return None


# ---------------------------------------------------------------------------- expert tensors
def hf_expert_shape(part: ExpertPart, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the Hugging Face tensor `part` of a toolkit expert tensor of `shape` (X, R, *C)."""
    n_expert, rows, *rest = shape
    if part.block is not None:
        rows //= part.blocks
    one = (*rest, rows) if part.transposed and rest else (rows, *rest)
    return one if part.expert is not None else (n_expert, *one)


def expert_rows_from_hf(part: ExpertPart, tensor):
    """One expert's Hugging Face tensor of `part` -> the toolkit rows it holds: (R, *C), or with
    `block` that block's (R / blocks, *C). A view where no data moves."""
    if part.transposed and tensor.dim() == 2:
        tensor = tensor.transpose(0, 1)
    if part.interleaved:  # rows (i, block) -> (block, i)
        rows, rest = tensor.shape[0], tuple(tensor.shape[1:])
        tensor = tensor.reshape(rows // part.blocks, part.blocks, *rest).transpose(0, 1).reshape(rows, *rest)
    return tensor


def expert_rows_to_hf(part: ExpertPart, rows):
    """The inverse of `expert_rows_from_hf`: one expert's toolkit rows (R, *C) -> its Hugging Face
    tensor of `part`, a new contiguous tensor."""
    if part.block is not None:
        size = rows.shape[0] // part.blocks
        rows = rows[part.block * size : (part.block + 1) * size]
    if part.interleaved:  # rows (block, i) -> (i, block)
        total, rest = rows.shape[0], tuple(rows.shape[1:])
        rows = rows.reshape(part.blocks, total // part.blocks, *rest).transpose(0, 1).reshape(total, *rest)
    if part.transposed and rows.dim() == 2:
        rows = rows.transpose(0, 1)
    return rows.contiguous()


# ---------------------------------------------------------------------------- quantized tensors
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
