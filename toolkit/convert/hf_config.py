"""Hugging Face `config.json` <-> toolkit `Config`.

`config_from_hf` reads the fields that the supported families (`ARCHITECTURES`) use, in both the
transformers 5.x layout (`rope_parameters`, `layer_types`) and the older one (`rope_theta`,
`rope_scaling`, `rotary_pct`, `partial_rotary_factor`, `max_window_layers`), and refuses anything
the toolkit model cannot reproduce exactly (RoPE scalings other than llama3, YaRN and LongRoPE, biases on some projections only,
layer kinds other than full and sliding-window attention...). `config_to_hf` writes a
config.json that transformers loads with its built-in classes (no remote code), in a form both
transformers 4.x and 5.x read.

Pure Python: importing this module does not import torch or transformers.
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional

from toolkit.errors import UserError
from toolkit.models.config import Config

# Hugging Face architecture class -> toolkit family, and the model_type each one has.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "PhiForCausalLM": "phi",
    "GPTNeoXForCausalLM": "gpt_neox",
    "Qwen3ForCausalLM": "qwen3",
    "Olmo2ForCausalLM": "olmo2",
    "SmolLM3ForCausalLM": "smollm3",
    "Phi3ForCausalLM": "phi3",
    "GptOssForCausalLM": "gpt_oss",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
}
HF_ARCHITECTURE: dict[str, str] = {family: arch for arch, family in ARCHITECTURES.items()}
# family -> model_type in config.json (the family's own name but where noted)
MODEL_TYPES: dict[str, str] = {family: family for family in HF_ARCHITECTURE}
MODEL_TYPES["gemma3"] = "gemma3_text"  # Gemma 3's text-only model ("gemma3" is the multimodal one)
FAMILY_OF_MODEL_TYPE: dict[str, str] = {model_type: family for family, model_type in MODEL_TYPES.items()}

# Families whose published checkpoints still name their first, remote implementation in auto_map
# although transformers has a native class for them, which it uses (auto_map is read only with
# trust_remote_code): Phi-3 and Phi-4.
_AUTO_MAP_OF_NATIVE_CLASS = ("phi3",)

# transformers activation name -> (toolkit mlp kind for the family's MLP, gelu approximation)
_GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}

# Fields that do not describe the network's computation, ignored when matching a preset.
_IDENTITY_FIELDS = ("name", "hf_repo_id")


def supported_architectures() -> str:
    return ", ".join(f"{arch} ({family})" for arch, family in ARCHITECTURES.items())


# Fields of config.json whose type is checked before anything reads them: a null or a list where a
# number belongs is one line, not a TypeError from deep inside the conversion.
_WHOLE_NUMBER_FIELDS = (
    "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size",
    "max_position_embeddings", "num_key_value_heads", "head_dim", "moe_intermediate_size", "num_experts",
    "num_local_experts", "num_experts_per_tok", "sliding_window", "decoder_sparse_step",
)
_NUMBER_FIELDS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "rope_theta", "partial_rotary_factor")
_FLAG_FIELDS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "norm_topk_prob", "use_bidirectional_attention")
# Fields that may be null in a valid config.json (transformers reads null as "not used").
_NULLABLE_FIELDS = ("sliding_window", "head_dim", "rope_theta", "partial_rotary_factor")


def _check_field_types(hf_config: dict[str, Any]) -> None:
    for key, value in hf_config.items():
        if value is None and key in _NULLABLE_FIELDS:
            continue
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key in _WHOLE_NUMBER_FIELDS and not (is_number and float(value).is_integer()):
            raise UserError(f"config.json: {key} must be a whole number, got {json.dumps(value)}")
        if key in _NUMBER_FIELDS and not is_number:
            raise UserError(f"config.json: {key} must be a number, got {json.dumps(value)}")
        if key in _FLAG_FIELDS and value is not None and not isinstance(value, bool):  # (null: unset)
            raise UserError(f"config.json: {key} must be true or false, got {json.dumps(value)}")
    architectures = hf_config.get("architectures")
    if architectures is not None and not (
        isinstance(architectures, str) or (isinstance(architectures, list) and all(isinstance(a, str) for a in architectures))
    ):
        raise UserError(f"config.json: architectures must be a list of class names, got {json.dumps(architectures)}")
    if hf_config.get("is_causal") is False or hf_config.get("use_bidirectional_attention"):
        raise UserError("config.json asks for bidirectional attention (is_causal false or use_bidirectional_attention), "
                        "which is not supported: the toolkit's attention is causal")


def detect_family(hf_config: dict[str, Any]) -> str:
    """The toolkit family of a config.json, from `model_type`, else `architectures`."""
    _check_field_types(hf_config)
    model_type = hf_config.get("model_type")
    architectures = hf_config.get("architectures") or []
    if isinstance(architectures, str):
        architectures = [architectures]
    if model_type in FAMILY_OF_MODEL_TYPE:
        family = FAMILY_OF_MODEL_TYPE[model_type]
    elif model_type is None and architectures and architectures[0] in ARCHITECTURES:
        family = ARCHITECTURES[architectures[0]]
    else:
        shown = architectures[0] if architectures else model_type
        raise UserError(
            f"Unsupported architecture {shown!r} (model_type {model_type!r}) in config.json; "
            f"supported: {supported_architectures()}"
        )
    for arch in architectures:
        if arch.endswith("ForCausalLM") and ARCHITECTURES.get(arch) not in (None, family):
            raise UserError(f"config.json says model_type {model_type!r} but architecture {arch!r}; fix config.json")
    return family


def _flag(hf_config: dict[str, Any], key: str, default: bool) -> bool:
    """A true/false field of config.json; absent or null: `default`."""
    value = hf_config.get(key)
    return default if value is None else bool(value)


def _require(hf_config: dict[str, Any], key: str) -> Any:
    if hf_config.get(key) is None:
        raise UserError(f"config.json lacks {key!r}, which a {hf_config.get('model_type')} model needs")
    return hf_config[key]


def _gelu_approximate(act: str, family: str) -> str:
    if family == "gemma" and act == "gelu":
        # Gemma's first releases wrote "gelu" but meant the tanh approximation (transformers agrees).
        return "tanh"
    if act not in _GELU:
        raise UserError(f"Unsupported activation {act!r} for a {family} model; supported: {', '.join(_GELU)}")
    return _GELU[act]


def _rope(hf_config: dict[str, Any], family: str) -> tuple[float, Optional[dict[str, float]], float]:
    """(rope_base, rope_scaling, rotary_percentage) from either config layout."""
    params = hf_config.get("rope_parameters") or {}
    legacy = hf_config.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(legacy, dict):
        raise UserError("config.json: rope_parameters / rope_scaling must be JSON objects")
    if params and not any(k in params for k in ("rope_type", "rope_theta", "type")):
        raise UserError(f"config.json: per-layer rope_parameters ({', '.join(params)}) are not supported")
    merged = {**legacy, **params}
    theta = merged.get("rope_theta", hf_config.get("rope_theta", hf_config.get("rotary_emb_base", 10000.0)))
    default_partial = {"gpt_neox": 0.25, "phi": 0.5}.get(family, 1.0)
    partial = merged.get(
        "partial_rotary_factor",
        hf_config.get("partial_rotary_factor", hf_config.get("rotary_pct", default_partial)),
    )
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if family == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # Phi-3's first releases wrote "su"; transformers' Phi3Config reads both as LongRoPE
    scaling = None
    if rope_type in _SCALING_READERS:
        refusal = _scaling_refusal(rope_type, family)
        if refusal:
            raise UserError(f"Unsupported RoPE scaling {rope_type!r} for a {family} model in config.json: {refusal}")
        scaling = {"rope_type": rope_type, **_SCALING_READERS[rope_type](merged, hf_config, family)}
    elif family == "phi3" and rope_type not in ("default", None):
        raise UserError(f"Unsupported RoPE scaling {rope_type!r} for a phi3 model in config.json; "
                        "transformers' Phi3 reads default and longrope only")
    elif rope_type == "llama3":
        try:
            scaling = {
                "factor": float(merged["factor"]),
                "low_freq_factor": float(merged["low_freq_factor"]),
                "high_freq_factor": float(merged["high_freq_factor"]),
                "original_max_seq_len": int(merged["original_max_position_embeddings"]),
            }
        except KeyError as err:
            raise UserError(f"config.json: llama3 RoPE scaling lacks {err.args[0]!r}") from None
    elif rope_type == "linear":
        if "factor" not in merged:
            raise UserError("config.json: linear RoPE scaling lacks 'factor'")
        scaling = {"rope_type": "linear", "factor": float(merged["factor"])}
    elif rope_type not in ("default", None):
        raise UserError(
            f"Unsupported RoPE scaling {rope_type!r} in config.json; "
            f"supported: default, llama3, linear, {', '.join(_SCALING_READERS)}"
        )
    return float(theta), scaling, float(partial)


# ---------------------------------------------------------------------------- YaRN and LongRoPE
# The values transformers 5 (`_compute_yarn_parameters`, `_compute_longrope_parameters`) derives
# when config.json leaves them out are computed here and stored in the toolkit config, so that it
# describes the model by itself and the export writes them out.
def _scaling_refusal(kind: str, family: str) -> Optional[str]:
    """Why `family`'s transformers class does not read RoPE scaling `kind` as the toolkit computes it, or None."""
    if kind == "longrope":
        return None if family == "phi3" else (
            "LongRoPE is supported for Phi-3 models only (transformers' other classes keep the keys of "
            "short-frequency positions in their cache past the switch, which the toolkit does not reproduce)")
    if family == "phi3":
        return "transformers' Phi3 reads a yarn type as longrope" if kind == "yarn" else (
            "transformers' Phi3 reads default and longrope only")
    if family in ("phi", "gpt_neox"):
        return "the toolkit writes it for Llama-like families only"
    return None


def _original_max(merged: dict[str, Any], hf_config: dict[str, Any], family: str) -> int:
    """original_max_position_embeddings as transformers resolves it: a top-level key wins (Phi3Config
    always has one, 4096 by default), then the scaling's own, then max_position_embeddings."""
    top = hf_config.get("original_max_position_embeddings", 4096 if family == "phi3" else None)
    if top is not None:
        return int(top)
    return int(merged.get("original_max_position_embeddings") or _require(hf_config, "max_position_embeddings"))


def _scaling_factor(merged: dict[str, Any], hf_config: dict[str, Any], original: int) -> float:
    factor = merged.get("factor")
    return float(_require(hf_config, "max_position_embeddings")) / original if factor is None else float(factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_from_hf(merged: dict[str, Any], hf_config: dict[str, Any], family: str) -> dict[str, Any]:
    if "factor" not in merged:
        raise UserError("config.json: yarn RoPE scaling lacks 'factor'")
    original = _original_max(merged, hf_config, family)
    factor = _scaling_factor(merged, hf_config, original)
    attention_factor = merged.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = merged.get("mscale"), merged.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    return {
        "factor": factor,
        "original_max_seq_len": original,
        "beta_fast": float(merged.get("beta_fast") or 32),  # `or`: transformers reads 0 as unset too
        "beta_slow": float(merged.get("beta_slow") or 1),
        "attention_factor": float(attention_factor),
        "truncate": bool(merged.get("truncate", True)),
    }


def _longrope_from_hf(merged: dict[str, Any], hf_config: dict[str, Any], family: str) -> dict[str, Any]:
    factors = {}
    for key in ("short_factor", "long_factor"):
        values = merged.get(key)
        if not isinstance(values, list) or not all(isinstance(v, (int, float)) for v in values):
            raise UserError(f"config.json: longrope RoPE scaling needs {key!r}, a list of numbers")
        factors[key] = [float(v) for v in values]
    original = _original_max(merged, hf_config, family)
    attention_factor = merged.get("attention_factor")
    if attention_factor is None:
        factor = _scaling_factor(merged, hf_config, original)
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {**factors, "original_max_seq_len": original, "attention_factor": float(attention_factor)}


_SCALING_READERS = {"yarn": _yarn_from_hf, "longrope": _longrope_from_hf}


def _rope_scaling_to_hf(config: Config) -> dict[str, Any]:
    """The `rope_parameters` entries of the toolkit's rope_scaling (rope_theta and the partial factor aside)."""
    keys, kind = config.rope_scaling, config.rope_scaling_type
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(keys["factor"])}
    if kind == "yarn":
        return {
            "rope_type": "yarn", "factor": float(keys["factor"]),
            "original_max_position_embeddings": int(keys["original_max_seq_len"]),
            "beta_fast": float(keys["beta_fast"]), "beta_slow": float(keys["beta_slow"]),
            "attention_factor": float(keys["attention_factor"]), "truncate": bool(keys["truncate"]),
        }
    if kind == "longrope":
        return {
            "rope_type": "longrope",
            "short_factor": list(keys["short_factor"]), "long_factor": list(keys["long_factor"]),
            "original_max_position_embeddings": int(keys["original_max_seq_len"]),
            "attention_factor": float(keys["attention_factor"]),
        }
    return {
        "rope_type": "llama3",
        "factor": float(keys["factor"]),
        "low_freq_factor": float(keys["low_freq_factor"]),
        "high_freq_factor": float(keys["high_freq_factor"]),
        "original_max_position_embeddings": int(keys["original_max_seq_len"]),
    }


# The families whose RMSNorm scales by (1 + weight) and whose embeddings are scaled
_GEMMAS = ("gemma", "gemma2", "gemma3")
# config.json layer type -> Config.layer_types entry
_LAYER_TYPES = {"full_attention": "global", "sliding_attention": "local"}


def _local_rope(hf_config: dict[str, Any], family: str) -> tuple[dict[str, Any], Optional[float]]:
    """(config.json with the global layers' RoPE keys in place of per-layer-type ones, the local
    layers' base or None).

    transformers 5 writes RoPE per layer type ({"full_attention": {...}, "sliding_attention": {...}},
    Gemma 3); older files write `rope_local_base_freq` beside the global keys. The local layers must
    rotate without scaling (`Config.rope_local_base`): anything else is refused.
    """
    params = hf_config.get("rope_parameters")
    if isinstance(params, dict) and set(params) & set(_LAYER_TYPES):
        unknown = sorted(set(params) - set(_LAYER_TYPES))
        if unknown:
            raise UserError(f"config.json: rope_parameters for layer type {unknown[0]!r} is not supported")
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default" or set(local) - {"rope_type", "rope_theta"}:
            raise UserError(
                f"config.json: rope_parameters.sliding_attention {local!r} is not supported (local layers "
                "rotate without scaling)"
            )
        default_local = 10000.0 if family == "gemma3" else None
        base = local.get("rope_theta", default_local)
        return {**hf_config, "rope_parameters": params.get("full_attention") or {}}, None if base is None else float(base)
    if "rope_local_base_freq" in hf_config:
        return hf_config, float(hf_config["rope_local_base_freq"])
    return hf_config, (10000.0 if family == "gemma3" else None)


def _gemma_2_3(hf_config: dict[str, Any], family: str) -> dict[str, Any]:
    """Gemma 2 and Gemma 3 (text): norms before and after attention and MLP with (1 + w) scales,
    scaled embeddings, GeGLU, local and global layers, softcaps (Gemma 2), QK norm per head (Gemma 3),
    queries scaled by query_pre_attn_scalar."""
    act = hf_config.get("hidden_activation") or hf_config.get("hidden_act") or "gelu_pytorch_tanh"
    if hf_config.get("attention_bias"):
        raise UserError(f"config.json: {family} with attention_bias is not supported")
    if hf_config.get("use_bidirectional_attention"):
        raise UserError("config.json: use_bidirectional_attention is not supported (the toolkit's attention is causal)")
    scalar = hf_config.get("query_pre_attn_scalar", 256)
    if not isinstance(scalar, (int, float)) or isinstance(scalar, bool) or int(scalar) != scalar:
        raise UserError(f"config.json: query_pre_attn_scalar must be a whole number, got {scalar!r}")
    n_layer = int(_require(hf_config, "num_hidden_layers"))
    layer_types = hf_config.get("layer_types")
    if layer_types is None:  # the pattern transformers derives: every `period`-th layer global
        period = 2 if family == "gemma2" else int(hf_config.get("sliding_window_pattern", 6))
        layer_types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n_layer)]
    unknown = [t for t in layer_types if t not in _LAYER_TYPES]
    if unknown:
        raise UserError(f"config.json: layer_types entry {unknown[0]!r} is not supported; supported: {', '.join(_LAYER_TYPES)}")
    values: dict[str, Any] = dict(
        norm="rmsnorm", norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)), norm_unit_offset=True,
        norm_position="sandwich", mlp="geglu", gelu_approximate=_gelu_approximate(act, family), scale_embeddings=True,
        query_pre_attn_scalar=int(scalar), layer_types=[_LAYER_TYPES[t] for t in layer_types],
        sliding_window=None if hf_config.get("sliding_window") is None else int(hf_config["sliding_window"]),
    )
    for ours, theirs in (("attn_logit_softcap", "attn_logit_softcapping"), ("final_logit_softcap", "final_logit_softcapping")):
        cap = hf_config.get(theirs, 50.0 if theirs == "attn_logit_softcapping" else 30.0) if family == "gemma2" else hf_config.get(theirs)
        values[ours] = None if cap is None else float(cap)
    if family == "gemma3":
        values["qk_norm"] = "head"
    return values


def config_from_hf(
    hf_config: dict[str, Any], model_name: Optional[str] = None, default_name: str = "custom"
) -> Config:
    """The toolkit `Config` described by a Hugging Face config.json (as a dict).

    The name is, in order: the preset whose sizes match exactly (`model_name`, if given and a
    preset, must match); else `model_name`; else `default_name`. A config that the toolkit model
    cannot reproduce exactly is a UserError.
    """
    family = detect_family(hf_config)
    if hf_config.get("auto_map") and family not in _AUTO_MAP_OF_NATIVE_CLASS:
        raise UserError(
            "config.json asks for custom code (auto_map); the toolkit converts only models that "
            f"transformers supports natively: {supported_architectures()}"
        )
    n_embd = int(_require(hf_config, "hidden_size"))
    n_head = int(_require(hf_config, "num_attention_heads"))
    if family == "gpt_oss":
        hf_config = _gpt_oss_rope_defaults(hf_config)
    hf_config, rope_local_base = _local_rope(hf_config, family)
    rope_base, rope_scaling, rotary_percentage = _rope(hf_config, family)
    values: dict[str, Any] = dict(
        family=family,
        vocab_size=int(_require(hf_config, "vocab_size")),
        block_size=int(_require(hf_config, "max_position_embeddings")),
        n_layer=int(_require(hf_config, "num_hidden_layers")),
        n_embd=n_embd,
        n_head=n_head,
        n_query_groups=int(hf_config.get("num_key_value_heads") or n_head),
        head_size=int(hf_config.get("head_dim") or n_embd // n_head),
        intermediate_size=int(_require(hf_config, "intermediate_size")),
        rope_base=rope_base,
        rope_scaling=rope_scaling,
        rotary_percentage=rotary_percentage,
        tie_embeddings=_flag(hf_config, "tie_word_embeddings", family in _GEMMAS),
    )
    act = hf_config.get("hidden_activation") or hf_config.get("hidden_act") or "silu"

    if family in ("llama", "mistral", "qwen2"):
        if act != "silu":
            raise UserError(f"Unsupported activation {act!r} for a {family} model; only 'silu' is supported")
        values.update(norm="rmsnorm", norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)), mlp="swiglu")
        attention_bias = bool(hf_config.get("attention_bias", False))
        mlp_bias = bool(hf_config.get("mlp_bias", False))
        if family == "qwen2":
            if attention_bias or mlp_bias:
                raise UserError("config.json: Qwen2 with attention_bias/mlp_bias is not supported")
            values.update(bias=False, attn_qkv_bias=True)
        else:
            if attention_bias != mlp_bias:
                raise UserError(
                    f"config.json: attention_bias={attention_bias} with mlp_bias={mlp_bias} is not supported "
                    "(the toolkit puts biases on all block projections or none)"
                )
            values.update(bias=attention_bias)
    elif family == "gemma":
        values.update(
            norm="rmsnorm", norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)), norm_unit_offset=True,
            mlp="geglu", gelu_approximate=_gelu_approximate(act, family), scale_embeddings=True,
        )
        if hf_config.get("attention_bias"):
            raise UserError("config.json: Gemma with attention_bias is not supported")
    elif family in ("gemma2", "gemma3"):
        values.update(_gemma_2_3(hf_config, family))
    elif family == "phi":
        if hf_config.get("qk_layernorm"):
            raise UserError("config.json: Phi with qk_layernorm is not supported")
        values.update(
            norm="layernorm", norm_eps=float(hf_config.get("layer_norm_eps", 1e-5)), mlp="gelu",
            gelu_approximate=_gelu_approximate(act, family), bias=True, lm_head_bias=True,
            parallel_residual=True, shared_attention_norm=True,
        )
    elif family in ("qwen3", "olmo2", "smollm3"):
        values.update(_read_dense_family(hf_config, family, act))
    elif family == "phi3":
        values.update(_phi3_from_hf(hf_config, act, values["block_size"]))
    elif family == "gpt_oss":
        values.update(_gpt_oss_from_hf(hf_config, values))
    elif family in _MOE_DEFAULTS:
        values.update(_read_moe_family(hf_config, family, act, values))
    elif family == "gpt_neox":
        if not hf_config.get("attention_bias", True):
            raise UserError("config.json: GPT-NeoX with attention_bias=false is not supported")
        values.update(
            norm="layernorm", norm_eps=float(hf_config.get("layer_norm_eps", 1e-5)), mlp="gelu",
            gelu_approximate=_gelu_approximate(act or "gelu", family), bias=True,
            parallel_residual=bool(hf_config.get("use_parallel_residual", True)),
        )
    values.update(_read_layers(hf_config, family, values["n_layer"]))
    has_local = values.get("sliding_window") is not None and "local" in (values.get("layer_types") or ["local"])
    if has_local and rope_local_base is not None and (rope_local_base != rope_base or rope_scaling is not None):
        values["rope_local_base"] = rope_local_base  # local layers rotate otherwise than global ones
    config = Config.from_dict({"name": default_name, **values})
    return _name(config, model_name, default_name, hf_config.get("_name_or_path") or "")


# ---------------------------------------------------------------------------- Qwen3, OLMo 2, SmolLM3
def _read_dense_family(hf_config: dict[str, Any], family: str, act: str) -> dict[str, Any]:
    """The fields of a Qwen3, OLMo 2 or SmolLM3 config.json beside the shared sizes and RoPE."""
    if act != "silu":
        raise UserError(f"Unsupported activation {act!r} for a {family} model; only 'silu' is supported")
    values: dict[str, Any] = dict(norm="rmsnorm", mlp="swiglu")
    attention_bias = bool(hf_config.get("attention_bias", False))
    if family == "qwen3":
        if attention_bias:
            # bias on q, k, v and o but none in the MLP: the toolkit has no such combination
            raise UserError("config.json: Qwen3 with attention_bias is not supported")
        values.update(norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)), qk_norm="head")
    elif family == "olmo2":
        if attention_bias:
            raise UserError("config.json: OLMo 2 with attention_bias is not supported")
        values.update(norm_eps=float(hf_config.get("rms_norm_eps", 1e-5)), qk_norm="projection",
                      norm_position="post")
    else:  # smollm3
        mlp_bias = bool(hf_config.get("mlp_bias", False))
        if attention_bias != mlp_bias:
            raise UserError(
                f"config.json: attention_bias={attention_bias} with mlp_bias={mlp_bias} is not supported "
                "(the toolkit puts biases on all block projections or none)"
            )
        values.update(norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)), bias=attention_bias,
                      tie_embeddings=_flag(hf_config, "tie_word_embeddings", True))
        params = hf_config.get("rope_parameters") or {}
        if "rope_theta" not in hf_config and "rope_theta" not in params:
            values["rope_base"] = 2000000.0  # SmolLM3Config's default base
    return values


# ---------------------------------------------------------------------------- Mixtral, Qwen3-MoE, OLMoE
# The values transformers' config class of each family takes where config.json leaves a key out.
_MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.001, rms_norm_eps=1e-5,
                    rope_theta=1000000.0),
    "qwen3_moe": dict(num_experts=128, num_experts_per_tok=8, router_aux_loss_coef=0.001, rms_norm_eps=1e-6,
                      moe_intermediate_size=768, norm_topk_prob=False, decoder_sparse_step=1),
    "olmoe": dict(num_experts=64, num_experts_per_tok=8, router_aux_loss_coef=0.01, rms_norm_eps=1e-5,
                  norm_topk_prob=False),
}
# The key config.json names the number of experts with (transformers reads the other too)
_EXPERTS_KEY = {"mixtral": "num_local_experts", "qwen3_moe": "num_experts", "olmoe": "num_experts"}


def _n_expert(hf_config: dict[str, Any], family: str) -> int:
    names = ("num_local_experts", "num_experts")
    given = {hf_config[k] for k in names if hf_config.get(k) is not None}
    if len(given) > 1:
        raise UserError(f"config.json: num_local_experts and num_experts differ ({sorted(given)})")
    key = _EXPERTS_KEY[family]
    value = given.pop() if given else _MOE_DEFAULTS[family][key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def _read_moe_family(hf_config: dict[str, Any], family: str, act: str, values: dict[str, Any]) -> dict[str, Any]:
    """The fields of a Mixtral, Qwen3-MoE or OLMoE config.json beside the shared sizes and RoPE.

    Mixtral: Mistral's layer, every MLP a mixture of experts of width intermediate_size, top-k
    weights renormalised. Qwen3-MoE: Qwen3's layer (per-head QK norm); experts of
    moe_intermediate_size in the layers that neither `mlp_only_layers` lists nor
    `decoder_sparse_step` skips (layer i is sparse when (i + 1) % step == 0), the others Qwen3's
    dense MLP of intermediate_size; `norm_topk_prob` renormalises. OLMoE: Llama's pre-norm layer with
    QK norms over the whole projections, every MLP a mixture, `norm_topk_prob` as Qwen3-MoE's.
    """
    defaults = _MOE_DEFAULTS[family]
    if act != "silu":
        raise UserError(f"Unsupported activation {act!r} for a {family} model; only 'silu' is supported")
    if family != "mixtral" and hf_config.get("attention_bias"):  # transformers' Mixtral has no biases
        raise UserError(f"config.json: {family} with attention_bias is not supported")
    if hf_config.get("router_jitter_noise"):
        raise UserError("config.json: router_jitter_noise (noise on the router's input in training) is not supported")
    if hf_config.get("shared_expert_intermediate_size"):
        raise UserError("config.json: shared experts (shared_expert_intermediate_size) are not supported")
    n_layer, n_expert = values["n_layer"], _n_expert(hf_config, family)
    top_k = _count(hf_config, "num_experts_per_tok", defaults["num_experts_per_tok"], minimum=1)
    out: dict[str, Any] = dict(
        norm="rmsnorm", mlp="swiglu", norm_eps=float(hf_config.get("rms_norm_eps", defaults["rms_norm_eps"])),
        n_expert=n_expert, n_expert_per_token=top_k,
        router_aux_loss_coef=float(hf_config.get("router_aux_loss_coef", defaults["router_aux_loss_coef"])),
        # transformers' Mixtral always renormalises (and reads no norm_topk_prob)
        router_norm_topk=family == "mixtral" or bool(hf_config.get("norm_topk_prob", defaults["norm_topk_prob"])),
    )
    if family == "mixtral":
        params = hf_config.get("rope_parameters") or {}
        if "rope_theta" not in hf_config and "rope_theta" not in params:
            out["rope_base"] = defaults["rope_theta"]  # MixtralConfig's default base
    elif family == "qwen3_moe":
        step = _count(hf_config, "decoder_sparse_step", defaults["decoder_sparse_step"], minimum=1)
        dense = hf_config.get("mlp_only_layers") or []
        if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in dense):
            raise UserError(f"config.json: mlp_only_layers must be a list of layer indices, got {dense!r}")
        sparse = [i for i in range(n_layer) if i not in dense and (i + 1) % step == 0]
        out.update(qk_norm="head", moe_intermediate_size=_count(hf_config, "moe_intermediate_size",
                                                               defaults["moe_intermediate_size"], minimum=1),
                   moe_layers=None if len(sparse) == n_layer else sparse)
    else:  # olmoe
        if hf_config.get("clip_qkv") is not None:
            raise UserError("config.json: OLMoE with clip_qkv (queries, keys and values clamped) is not supported")
        if values["head_size"] * values["n_head"] != values["n_embd"]:
            raise UserError("config.json: OLMoE with head_dim other than hidden_size / num_attention_heads "
                            "is not supported")
        out.update(qk_norm="projection")
    return out


def _moe_to_hf(config: Config) -> dict[str, Any]:
    """The config.json fields of a Mixtral, Qwen3-MoE or OLMoE model beside the shared sizes (see
    `_read_moe_family`). The router's z-loss coefficient, a training setting transformers does not
    have, is not written."""
    family = config.family
    qk_norm = {"mixtral": None, "qwen3_moe": "head", "olmoe": "projection"}[family]
    _check(config, family, norm="rmsnorm", mlp="swiglu", bias=False, attn_qkv_bias=False, lm_head_bias=False,
           parallel_residual=False, norm_position="pre", qk_norm=qk_norm)
    if config.n_expert == 0:
        raise _unsupported(config, f"n_expert=0, but {family} is a mixture of experts")
    dense = [i for i in range(config.n_layer) if not config.layer(i).moe]
    hf: dict[str, Any] = {
        "num_key_value_heads": config.n_query_groups,
        "rms_norm_eps": config.norm_eps,
        "hidden_act": "silu",
        _EXPERTS_KEY[family]: config.n_expert,
        "num_experts_per_tok": config.n_expert_per_token,
        "router_aux_loss_coef": config.router_aux_loss_coef,
        "output_router_logits": False,
    }
    if family != "qwen3_moe":
        if dense:
            raise _unsupported(config, f"moe_layers={config.moe_layers!r}, but every {family} layer is a "
                                       "mixture of experts")
        hf["intermediate_size"] = config.moe_intermediate_size  # the experts' width; there is no dense MLP
    if family == "mixtral":
        _check(config, family, router_norm_topk=True)
        hf.update(head_dim=config.head_size, router_jitter_noise=0.0)
    elif family == "qwen3_moe":
        hf.update(head_dim=config.head_size, attention_bias=False, moe_intermediate_size=config.moe_intermediate_size,
                  norm_topk_prob=config.router_norm_topk, decoder_sparse_step=1, mlp_only_layers=dense)
    else:
        if config.head_size * config.n_head != config.n_embd:
            raise _unsupported(config, "OLMoE needs head_size * n_head == n_embd")
        hf.update(attention_bias=False, norm_topk_prob=config.router_norm_topk, clip_qkv=None)
    return hf


# ---------------------------------------------------------------------------- per-layer spans, NoPE
# config.json `layer_types` entries -> toolkit layer types
_HF_LAYER_TYPES = {"full_attention": "global", "sliding_attention": "local"}
_TOOLKIT_LAYER_TYPES = {v: k for k, v in _HF_LAYER_TYPES.items()}


def _hf_layer_types(hf_config: dict[str, Any], n_layer: int) -> Optional[list[str]]:
    """config.json's `layer_types` as toolkit types, or None where it has none."""
    listed = hf_config.get("layer_types")
    if listed is None:
        return None
    if not isinstance(listed, list) or len(listed) != n_layer:
        raise UserError(f"config.json: layer_types must list one entry per layer ({n_layer})")
    unknown = [t for t in listed if t not in _HF_LAYER_TYPES]
    if unknown:
        raise UserError(
            f"config.json: layer_types entry {unknown[0]!r} is not supported; supported: {', '.join(_HF_LAYER_TYPES)}"
        )
    return [_HF_LAYER_TYPES[t] for t in listed]


def _count(hf_config: dict[str, Any], key: str, default: int, minimum: int = 0) -> int:
    value = hf_config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserError(f"config.json: {key} must be an integer of at least {minimum}, got {value!r}")
    return value


def _read_layers(hf_config: dict[str, Any], family: str, n_layer: int) -> dict[str, Any]:
    """sliding_window, layer_types and no_rope_layers, as transformers' class of the family reads them.

    Mistral: a window on every layer. Qwen2 and Qwen3: with `use_sliding_window`, the layers from
    `max_window_layers` on (unless `layer_types` lists them). SmolLM3: `no_rope_layers` holds one
    entry per layer, 1 for a layer that rotates and 0 for a NoPE layer (else every
    `no_rope_layer_interval`-th layer is NoPE), and with `use_sliding_window` the layers that
    `layer_types` marks as sliding. Written in one form: no layer_types when all layers are alike.
    """
    window = hf_config.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise UserError(f"config.json: sliding_window must be a positive integer or null, got {window!r}")
    listed = _hf_layer_types(hf_config, n_layer)
    values: dict[str, Any] = {}
    if family in ("mistral", "mixtral"):
        # transformers' Mistral and Mixtral apply sliding_window to every layer and ignore layer_types
        if listed is not None and listed != ["local" if window else "global"] * n_layer:
            raise UserError(
                f"config.json: layer_types on a {family.capitalize()} model is not supported "
                f"({family.capitalize()} windows every layer)"
            )
        local = [window is not None] * n_layer
    elif family == "qwen3_moe":
        # transformers' Qwen3-MoE windows every layer with use_sliding_window (max_window_layers unread)
        local = [window is not None and bool(hf_config.get("use_sliding_window", False))] * n_layer
    elif family in ("qwen2", "qwen3"):
        if not hf_config.get("use_sliding_window", False):
            window = None
        if listed is None:
            first = _count(hf_config, "max_window_layers", 28)
            listed = ["local" if window is not None and i >= first else "global" for i in range(n_layer)]
        if window is None and "local" in listed:
            raise UserError("config.json: layer_types has sliding_attention layers but use_sliding_window is false")
        local = [t == "local" for t in listed]
    elif family == "smollm3":
        rope = hf_config.get("no_rope_layers")
        if rope is None:
            interval = _count(hf_config, "no_rope_layer_interval", 4, minimum=1)
            rope = [int((i + 1) % interval != 0) for i in range(n_layer)]
        if not isinstance(rope, list) or len(rope) < n_layer or any(r not in (0, 1) for r in rope[:n_layer]):
            raise UserError(
                f"config.json: no_rope_layers must list 1 (RoPE) or 0 (no RoPE) for each of {n_layer} layers"
            )
        values["no_rope_layers"] = [i for i in range(n_layer) if not rope[i]] or None
        if not (hf_config.get("use_sliding_window", False) and window is not None):
            window = None
        if listed is None:
            listed = ["local" if window is not None and not rope[i] else "global" for i in range(n_layer)]
        local = [window is not None and t == "local" for t in listed]
    elif family == "gpt_oss":
        # GptOssConfig: a 128-token window, layers alternating sliding and full from the first
        if "sliding_window" not in hf_config:
            window = _GPT_OSS_DEFAULTS["sliding_window"]
        if listed is None:
            listed = ["local" if i % 2 == 0 else "global" for i in range(n_layer)]
        local = [window is not None and t == "local" for t in listed]
    else:
        return values
    if any(local):
        values["sliding_window"] = int(window)
        if not all(local):
            values["layer_types"] = ["local" if is_local else "global" for is_local in local]
    return values


def _phi3_from_hf(hf_config: dict[str, Any], act: str, block_size: int) -> dict[str, Any]:
    """Phi-3's layer is Llama's (RMSNorm, SwiGLU, no biases: transformers' Phi3 has none, whatever
    attention_bias says) with fused projections (weight_maps.PHI3). Its `sliding_window` is applied
    to every layer; a window at least as long as the context changes nothing and is dropped."""
    if act != "silu":
        raise UserError(f"Unsupported activation {act!r} for a phi3 model; only 'silu' is supported")
    window = hf_config.get("sliding_window")
    return dict(
        norm="rmsnorm", norm_eps=float(hf_config.get("rms_norm_eps", 1e-5)), mlp="swiglu", bias=False,
        sliding_window=int(window) if window is not None and window < block_size else None,
    )


# ---------------------------------------------------------------------------- gpt-oss
# GptOssConfig's values where config.json leaves a key out (its defaults are gpt-oss-120b's sizes).
_GPT_OSS_DEFAULTS: dict[str, Any] = dict(
    num_local_experts=128, num_experts_per_tok=4, rms_norm_eps=1e-5, router_aux_loss_coef=0.001,
    swiglu_limit=7.0, swiglu_alpha=1.702, sliding_window=128, rope_theta=150000.0,
    rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
)


def _gpt_oss_rope_defaults(hf_config: dict[str, Any]) -> dict[str, Any]:
    """config.json with GptOssConfig's RoPE where it says none: YaRN (factor 32 over 4096 tokens,
    not truncated) when it has neither rope_parameters nor rope_scaling, base 150000 (its
    `default_theta`) when no rope_theta is given."""
    params = hf_config.get("rope_parameters") or hf_config.get("rope_scaling")
    if not params:
        params = dict(_GPT_OSS_DEFAULTS["rope_parameters"])
        hf_config = {**hf_config, "rope_parameters": params}
    layouts = [p for p in (hf_config.get("rope_parameters"), hf_config.get("rope_scaling")) if isinstance(p, dict)]
    if hf_config.get("rope_theta") is None and all(p.get("rope_theta") is None for p in layouts):
        hf_config = {**hf_config, "rope_theta": _GPT_OSS_DEFAULTS["rope_theta"]}
    return hf_config


def _gpt_oss_from_hf(hf_config: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss: Llama's pre-norm layer with biases on every attention projection and attention sinks;
    every MLP a mixture of `intermediate_size`-wide experts with biases and the clamped SwiGLU. Its
    router (with a bias) takes the softmax of the top-k logits: the top-k of the full softmax
    renormalised (`router_norm_topk`). `hidden_act` is not read by transformers' GptOss."""
    defaults = _GPT_OSS_DEFAULTS
    if not hf_config.get("attention_bias", True):
        raise UserError("config.json: gpt_oss with attention_bias=false is not supported (the toolkit's gpt-oss "
                        "has biases on every projection)")
    n_expert = _count(hf_config, "num_local_experts", defaults["num_local_experts"], minimum=1)
    top_k = _count(hf_config, "num_experts_per_tok", defaults["num_experts_per_tok"], minimum=1)
    if top_k > n_expert:
        raise UserError(f"config.json: num_experts_per_tok={top_k} exceeds num_local_experts={n_expert}")
    return dict(
        norm="rmsnorm", norm_eps=float(hf_config.get("rms_norm_eps", defaults["rms_norm_eps"])),
        mlp="clamped_swiglu", bias=True, attention_sinks=True,
        n_expert=n_expert, n_expert_per_token=top_k, moe_intermediate_size=values["intermediate_size"],
        router_norm_topk=True,
        router_aux_loss_coef=float(hf_config.get("router_aux_loss_coef", defaults["router_aux_loss_coef"])),
        swiglu_limit=float(hf_config.get("swiglu_limit", defaults["swiglu_limit"])),
        swiglu_alpha=float(hf_config.get("swiglu_alpha", defaults["swiglu_alpha"])),
    )


def _gpt_oss_to_hf(config: Config) -> dict[str, Any]:
    """config.json fields of a gpt-oss model beside the shared sizes (see `_gpt_oss_from_hf`)."""
    _check(config, "gpt_oss", norm="rmsnorm", mlp="clamped_swiglu", bias=True, attn_qkv_bias=True,
           lm_head_bias=False, parallel_residual=False, norm_position="pre", qk_norm=None, attention_sinks=True,
           router_norm_topk=True)
    if not all(config.layer(i).moe for i in range(config.n_layer)):
        raise _unsupported(config, "every gpt_oss layer is a mixture of experts (n_expert > 0, moe_layers None)")
    return dict(
        num_key_value_heads=config.n_query_groups,
        head_dim=config.head_size,
        rms_norm_eps=config.norm_eps,
        hidden_act="silu",
        attention_bias=True,
        intermediate_size=config.moe_intermediate_size,  # the experts' width; there is no dense MLP
        num_local_experts=config.n_expert,
        num_experts_per_tok=config.n_expert_per_token,
        router_aux_loss_coef=config.router_aux_loss_coef,
        output_router_logits=False,
        swiglu_limit=config.swiglu_limit,
        swiglu_alpha=config.swiglu_alpha,
    )


def _comparable(config: Config) -> dict[str, Any]:
    return {k: v for k, v in config.to_dict().items() if k not in _IDENTITY_FIELDS}


def matching_presets(config: Config) -> list[dict[str, Any]]:
    from toolkit.models.presets import PRESETS

    wanted = _comparable(config)
    found = []
    for preset in PRESETS:
        fields = {k: v for k, v in preset.items() if k not in ("aliases", "expected_params")}
        if _comparable(Config.from_dict(fields)) == wanted:
            found.append(fields)
    return found


def _name(config: Config, model_name: Optional[str], default_name: str, name_or_path: str) -> Config:
    from toolkit.models.presets import find_preset

    if model_name:
        try:
            preset = find_preset(model_name)
        except UserError:
            preset = None
        if preset is not None:
            expected = _comparable(Config.from_dict(preset))
            actual = _comparable(config)
            differing = [k for k in expected if expected[k] != actual[k]]
            if differing:
                shown = ", ".join(f"{k}={actual[k]!r} (preset: {expected[k]!r})" for k in differing[:4])
                raise UserError(
                    f"config.json does not match preset {preset['name']!r}: {shown}; "
                    "drop --model_name to use the checkpoint's own config"
                )
            return config.replace(name=preset["name"], hf_repo_id=preset.get("hf_repo_id", ""))
        return config.replace(name=model_name, hf_repo_id=model_name if "/" in model_name else "")
    matches = matching_presets(config)
    if matches:
        preferred = [p for p in matches if p.get("hf_repo_id") and p["hf_repo_id"] in (name_or_path, default_name)]
        preset = (preferred or matches)[0]
        return config.replace(name=preset["name"], hf_repo_id=preset.get("hf_repo_id", ""))
    return config.replace(name=default_name, hf_repo_id=default_name if "/" in default_name else "")


# ---------------------------------------------------------------------------- toolkit -> HF
def _unsupported(config: Config, why: str) -> UserError:
    return UserError(f"Cannot export {config.name!r} ({config.family}) to Hugging Face: {why}")


def _check(config: Config, family: str, **expected: Any) -> None:
    for key, value in expected.items():
        if getattr(config, key) != value:
            raise _unsupported(config, f"{key}={getattr(config, key)!r}, but {family} needs {value!r}")


def _rope_fields(config: Config) -> dict[str, Any]:
    """RoPE settings in both layouts: `rope_parameters` (transformers 5) and the legacy keys (4.x)."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_base}
    legacy: dict[str, Any] = {"rope_theta": config.rope_base}
    if config.rope_scaling is not None:
        scaling = _rope_scaling_to_hf(config)
        params.update(scaling)
        legacy["rope_scaling"] = dict(scaling)
    if config.rotary_percentage != 1.0:
        params["partial_rotary_factor"] = config.rotary_percentage
        legacy["partial_rotary_factor"] = config.rotary_percentage
    return {"rope_parameters": params, **legacy}


def _phi3_to_hf(config: Config) -> dict[str, Any]:
    _check(config, "phi3", norm="rmsnorm", mlp="swiglu", bias=False, attn_qkv_bias=False, lm_head_bias=False,
           parallel_residual=False, norm_position="pre", qk_norm=None)
    if config.head_size * config.n_head != config.n_embd:
        raise _unsupported(config, "Phi-3 needs head_size * n_head == n_embd")
    scaling = config.rope_scaling or {}
    return dict(
        num_key_value_heads=config.n_query_groups,
        rms_norm_eps=config.norm_eps,
        hidden_act="silu",
        # transformers' Phi3 takes LongRoPE's switch length from here (4096 when absent)
        original_max_position_embeddings=int(scaling.get("original_max_seq_len", config.block_size)),
        # Phi3Config's defaults (1, 32000, 32000) are Phi-3-mini's; the export's tokenizer sets its own
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


def _layer_type_rope_fields(config: Config) -> dict[str, Any]:
    """RoPE per layer type (`Config.rope_local_base`): transformers 5's `rope_parameters` by layer
    type, and Gemma 3's legacy keys (`rope_theta`, `rope_local_base_freq`, `rope_scaling`) for 4.x."""
    if config.rotary_percentage != 1.0:
        raise _unsupported(config, "rope_local_base with partial rotation (rotary_percentage) has no config.json form")
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_base}
    legacy: dict[str, Any] = {"rope_theta": config.rope_base, "rope_local_base_freq": config.rope_local_base}
    if config.rope_scaling is not None:
        full.update(_rope_scaling_to_hf(config))
        legacy["rope_scaling"] = _rope_scaling_to_hf(config)
    local = {"rope_type": "default", "rope_theta": config.rope_local_base}
    return {"rope_parameters": {"full_attention": full, "sliding_attention": local}, **legacy}


def _gemma_2_3_to_hf(config: Config) -> dict[str, Any]:
    """config.json keys of Gemma 2 and Gemma 3 (text) beside the shared ones."""
    family = config.family
    _check(config, family, norm="rmsnorm", mlp="geglu", norm_position="sandwich", bias=False, attn_qkv_bias=False,
           lm_head_bias=False, parallel_residual=False, qk_norm="head" if family == "gemma3" else None)
    if config.rope_local_base is not None and family != "gemma3":
        raise _unsupported(config, "rope_local_base (a RoPE base of local layers) is Gemma 3's")
    return dict(
        num_key_value_heads=config.n_query_groups,
        head_dim=config.head_size,
        rms_norm_eps=config.norm_eps,
        hidden_activation="gelu_pytorch_tanh" if config.gelu_approximate == "tanh" else "gelu",
        query_pre_attn_scalar=config.head_size if config.query_pre_attn_scalar is None else config.query_pre_attn_scalar,
        attn_logit_softcapping=config.attn_logit_softcap,
        final_logit_softcapping=config.final_logit_softcap,
        attention_bias=False,
    )


def config_to_hf(config: Config, dtype: Optional[str] = None) -> dict[str, Any]:
    """A config.json (as a dict) for transformers' built-in class of `config.family`.

    `dtype` ("bfloat16", "float32"...) is recorded as the weights' dtype. A config that the
    family's transformers class cannot express is a UserError naming the field.
    """
    family = config.family
    if family not in HF_ARCHITECTURE:
        raise _unsupported(config, f"unknown family; supported: {', '.join(HF_ARCHITECTURE)}")
    hf: dict[str, Any] = {
        "architectures": [HF_ARCHITECTURE[family]],
        "model_type": MODEL_TYPES[family],
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.block_size,
        "num_hidden_layers": config.n_layer,
        "hidden_size": config.n_embd,
        "num_attention_heads": config.n_head,
        "intermediate_size": config.intermediate_size,
        "tie_word_embeddings": config.tie_embeddings,
    }
    _check(config, family, scale_embeddings=family in _GEMMAS, norm_unit_offset=family in _GEMMAS)
    if family not in ("qwen3", "olmo2", "smollm3", "phi3", "gemma2", "gemma3", "qwen3_moe", "olmoe"):
        _check(config, family, norm_position="pre", qk_norm=None)
    if family not in _MOE_DEFAULTS and family != "gpt_oss":
        _check(config, family, n_expert=0)
    if family not in ("gemma2", "gemma3"):
        _check(config, family, attn_logit_softcap=None, final_logit_softcap=None, query_pre_attn_scalar=None,
               rope_local_base=None)
    if family != "gpt_oss":
        _check(config, family, attention_sinks=False)
    # Per-layer attention spans and NoPE layers: written where the family has them, else refused.
    hf.update(_layer_fields(config))
    refusal = None if config.rope_scaling is None else _scaling_refusal(config.rope_scaling_type, family)
    if refusal:
        raise _unsupported(config, f"{config.rope_scaling_type} RoPE scaling: {refusal}")

    if family in ("llama", "mistral", "qwen2", "gemma"):
        mlp = "swiglu" if family != "gemma" else "geglu"
        _check(config, family, norm="rmsnorm", mlp=mlp, parallel_residual=False, lm_head_bias=False)
        if family == "gemma" and config.gelu_approximate != "tanh":
            raise _unsupported(config, "Gemma uses the tanh approximation of GELU")
        hf.update(
            num_key_value_heads=config.n_query_groups,
            head_dim=config.head_size,
            rms_norm_eps=config.norm_eps,
            hidden_act="silu" if family != "gemma" else "gelu_pytorch_tanh",
        )
        if family == "llama":
            if config.attn_qkv_bias != config.bias:
                raise _unsupported(config, "Llama has biases on all projections or none (attn_qkv_bias != bias)")
            hf.update(attention_bias=config.bias, mlp_bias=config.bias)
        elif family == "qwen2":
            _check(config, family, bias=False, attn_qkv_bias=True)
        elif family == "mistral":
            _check(config, family, bias=False, attn_qkv_bias=False)
        else:
            _check(config, family, bias=False, attn_qkv_bias=False)
            hf.update(hidden_activation="gelu_pytorch_tanh")
    elif family in ("gemma2", "gemma3"):
        hf.update(_gemma_2_3_to_hf(config))
    elif family == "phi":
        _check(config, family, norm="layernorm", mlp="gelu", bias=True, attn_qkv_bias=True, lm_head_bias=True,
               parallel_residual=True, shared_attention_norm=True)
        if config.head_size * config.n_head != config.n_embd:
            raise _unsupported(config, "Phi needs head_size * n_head == n_embd")
        hf.update(
            num_key_value_heads=config.n_query_groups,
            layer_norm_eps=config.norm_eps,
            hidden_act="gelu_new" if config.gelu_approximate == "tanh" else "gelu",
            qk_layernorm=False,
        )
    elif family in ("qwen3", "olmo2", "smollm3"):
        hf.update(_write_dense_family(config))
    elif family == "phi3":
        hf.update(_phi3_to_hf(config))
    elif family == "gpt_oss":
        hf.update(_gpt_oss_to_hf(config))
    elif family in _MOE_DEFAULTS:
        hf.update(_moe_to_hf(config))
    elif family == "gpt_neox":
        _check(config, family, norm="layernorm", mlp="gelu", bias=True, attn_qkv_bias=True, lm_head_bias=False,
               shared_attention_norm=False)
        if config.n_query_groups != config.n_head:
            raise _unsupported(config, "GPT-NeoX has no grouped-query attention (n_query_groups must equal n_head)")
        if config.head_size * config.n_head != config.n_embd:
            raise _unsupported(config, "GPT-NeoX needs head_size * n_head == n_embd")
        hf.update(
            layer_norm_eps=config.norm_eps,
            hidden_act="gelu_new" if config.gelu_approximate == "tanh" else "gelu",
            use_parallel_residual=config.parallel_residual,
            attention_bias=True,
            rotary_pct=config.rotary_percentage,
            rotary_emb_base=config.rope_base,
        )
    hf.update(_rope_fields(config) if config.rope_local_base is None else _layer_type_rope_fields(config))
    if dtype is not None:
        hf["dtype"] = dtype
    return hf


def _write_dense_family(config: Config) -> dict[str, Any]:
    """The config.json fields of a Qwen3, OLMo 2 or SmolLM3 model beside the shared sizes."""
    family = config.family
    _check(config, family, norm="rmsnorm", mlp="swiglu", parallel_residual=False, lm_head_bias=False)
    if family == "smollm3":
        _check(config, family, norm_position="pre", qk_norm=None)
        if config.attn_qkv_bias != config.bias:
            raise _unsupported(config, "SmolLM3 has biases on all projections or none (attn_qkv_bias != bias)")
    else:
        _check(config, family, bias=False, attn_qkv_bias=False)
        if family == "qwen3":
            _check(config, family, norm_position="pre", qk_norm="head")
        else:
            _check(config, family, norm_position="post", qk_norm="projection")
    hf: dict[str, Any] = dict(
        num_key_value_heads=config.n_query_groups,
        head_dim=config.head_size,
        rms_norm_eps=config.norm_eps,
        hidden_act="silu",
        attention_bias=config.bias,
    )
    if family == "smollm3":
        hf["mlp_bias"] = config.bias
    return hf


def _layer_fields(config: Config) -> dict[str, Any]:
    """sliding_window, layer_types and no_rope_layers for config.json, as `_read_layers` reads them.

    A family whose transformers class cannot express the config's layers is refused, naming the field.
    """
    family, n = config.family, config.n_layer
    local = [config.layer(i).window is not None for i in range(n)]
    window = config.sliding_window if any(local) else None
    hf: dict[str, Any] = {}
    if family == "smollm3":
        hf.update(no_rope_layers=[int(config.layer(i).rope) for i in range(n)])
    elif config.no_rope_layers:
        raise _unsupported(config, f"no_rope_layers={config.no_rope_layers!r}, but {family} rotates every layer")
    if family in ("mistral", "phi3", "mixtral", "qwen3_moe"):
        if any(local) and not all(local):
            raise _unsupported(config, f"layer_types mixes local and global layers, but {family} windows every layer")
        hf.update(sliding_window=window)
        if family == "qwen3_moe":
            hf.update(use_sliding_window=window is not None)
    elif family in ("gemma2", "gemma3", "gpt_oss"):
        hf.update(sliding_window=config.sliding_window,
                  layer_types=[_TOOLKIT_LAYER_TYPES["local" if is_local else "global"] for is_local in local])
    elif family in ("qwen2", "qwen3", "smollm3"):
        types = [_TOOLKIT_LAYER_TYPES["local" if is_local else "global"] for is_local in local]
        hf.update(use_sliding_window=window is not None, sliding_window=window, layer_types=types)
        if family != "smollm3":
            # read by transformers versions without layer_types: the layers from this index on are windowed
            hf["max_window_layers"] = local.index(True) if any(local) else n
    elif any(local):
        why = f"sliding_window={config.sliding_window!r}, but {family} has no sliding-window attention"
        raise _unsupported(config, why)
    return hf
