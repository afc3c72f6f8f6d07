"""Hugging Face `config.json` <-> toolkit `Config`.

`config_from_hf` reads the fields that the supported families use, in both the transformers
5.x layout (`rope_parameters`) and the older one (`rope_theta`, `rope_scaling`, `rotary_pct`,
`partial_rotary_factor`), and refuses anything the toolkit model cannot reproduce exactly (other
RoPE scalings, biases on some projections only, QK layer norm...). `config_to_hf` writes a
config.json that transformers loads with its built-in classes (no remote code), in a form both
transformers 4.x and 5.x read.

Pure Python: importing this module does not import torch or transformers.
"""

from __future__ import annotations

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
    "PhiForCausalLM": "phi",
    "GPTNeoXForCausalLM": "gpt_neox",
    "Phi3ForCausalLM": "phi3",
}
HF_ARCHITECTURE: dict[str, str] = {family: arch for arch, family in ARCHITECTURES.items()}
MODEL_TYPES: dict[str, str] = {family: family for family in HF_ARCHITECTURE}

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


def detect_family(hf_config: dict[str, Any]) -> str:
    """The toolkit family of a config.json, from `model_type`, else `architectures`."""
    model_type = hf_config.get("model_type")
    architectures = hf_config.get("architectures") or []
    if isinstance(architectures, str):
        architectures = [architectures]
    if model_type in MODEL_TYPES:
        family = MODEL_TYPES[model_type]
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


def _require(hf_config: dict[str, Any], key: str) -> Any:
    if key not in hf_config:
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
    elif rope_type not in ("default", None):
        raise UserError(
            f"Unsupported RoPE scaling {rope_type!r} in config.json; "
            f"supported: default, llama3, {', '.join(_SCALING_READERS)}"
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


def _block_size(hf_config: dict[str, Any], family: str) -> int:
    block = int(_require(hf_config, "max_position_embeddings"))
    window = hf_config.get("sliding_window")
    uses_window = family == "mistral" or (family == "qwen2" and hf_config.get("use_sliding_window"))
    if uses_window and window and window < block:
        # The toolkit model has no sliding-window attention; within one window the two agree.
        block = int(window)
    return block


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
    rope_base, rope_scaling, rotary_percentage = _rope(hf_config, family)
    values: dict[str, Any] = dict(
        family=family,
        vocab_size=int(_require(hf_config, "vocab_size")),
        block_size=_block_size(hf_config, family),
        n_layer=int(_require(hf_config, "num_hidden_layers")),
        n_embd=n_embd,
        n_head=n_head,
        n_query_groups=int(hf_config.get("num_key_value_heads") or n_head),
        head_size=int(hf_config.get("head_dim") or n_embd // n_head),
        intermediate_size=int(_require(hf_config, "intermediate_size")),
        rope_base=rope_base,
        rope_scaling=rope_scaling,
        rotary_percentage=rotary_percentage,
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", family == "gemma")),
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
    elif family == "phi":
        if hf_config.get("qk_layernorm"):
            raise UserError("config.json: Phi with qk_layernorm is not supported")
        values.update(
            norm="layernorm", norm_eps=float(hf_config.get("layer_norm_eps", 1e-5)), mlp="gelu",
            gelu_approximate=_gelu_approximate(act, family), bias=True, lm_head_bias=True,
            parallel_residual=True, shared_attention_norm=True,
        )
    elif family == "phi3":
        values.update(_phi3_from_hf(hf_config, act, values["block_size"]))
    elif family == "gpt_neox":
        if not hf_config.get("attention_bias", True):
            raise UserError("config.json: GPT-NeoX with attention_bias=false is not supported")
        values.update(
            norm="layernorm", norm_eps=float(hf_config.get("layer_norm_eps", 1e-5)), mlp="gelu",
            gelu_approximate=_gelu_approximate(act or "gelu", family), bias=True,
            parallel_residual=bool(hf_config.get("use_parallel_residual", True)),
        )
    config = Config.from_dict({"name": default_name, **values})
    return _name(config, model_name, default_name, hf_config.get("_name_or_path") or "")


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
        sliding_window=config.sliding_window,
        # transformers' Phi3 takes LongRoPE's switch length from here (4096 when absent)
        original_max_position_embeddings=int(scaling.get("original_max_seq_len", config.block_size)),
        # Phi3Config's defaults (1, 32000, 32000) are Phi-3-mini's; the export's tokenizer sets its own
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
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
    _check(config, family, scale_embeddings=family == "gemma", norm_unit_offset=family == "gemma")
    # Per-layer attention spans and NoPE layers have no export yet: refused, never silently dropped.
    _check(config, family, layer_types=None, no_rope_layers=None)
    if family != "phi3":  # Phi-3's window is written with the rest of its config (`_phi3_to_hf`)
        _check(config, family, sliding_window=None)
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
            hf.update(use_sliding_window=False, sliding_window=None)
        elif family == "mistral":
            _check(config, family, bias=False, attn_qkv_bias=False)
            hf.update(sliding_window=None)
        else:
            _check(config, family, bias=False, attn_qkv_bias=False)
            hf.update(hidden_activation="gelu_pytorch_tanh")
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
    elif family == "phi3":
        hf.update(_phi3_to_hf(config))
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
    hf.update(_rope_fields(config))
    if dtype is not None:
        hf["dtype"] = dtype
    return hf
