"""Hugging Face `config.json` <-> toolkit `Config`.

`config_from_hf` reads the fields that the six supported families use, in both the transformers
5.x layout (`rope_parameters`) and the older one (`rope_theta`, `rope_scaling`, `rotary_pct`,
`partial_rotary_factor`), and refuses anything the toolkit model cannot reproduce exactly (other
RoPE scalings, biases on some projections only, QK layer norm...). `config_to_hf` writes a
config.json that transformers loads with its built-in classes (no remote code), in a form both
transformers 4.x and 5.x read.

Pure Python: importing this module does not import torch or transformers.
"""

from __future__ import annotations

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
}
HF_ARCHITECTURE: dict[str, str] = {family: arch for arch, family in ARCHITECTURES.items()}
# family -> model_type in config.json (the family's own name but where noted)
MODEL_TYPES: dict[str, str] = {family: family for family in HF_ARCHITECTURE}
MODEL_TYPES["gemma3"] = "gemma3_text"  # Gemma 3's text-only model ("gemma3" is the multimodal one)
FAMILY_OF_MODEL_TYPE: dict[str, str] = {model_type: family for family, model_type in MODEL_TYPES.items()}

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
    scaling = None
    if rope_type == "llama3":
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
        raise UserError(f"Unsupported RoPE scaling {rope_type!r} in config.json; supported: default, llama3, linear")
    return float(theta), scaling, float(partial)


def _block_size(hf_config: dict[str, Any], family: str) -> int:
    block = int(_require(hf_config, "max_position_embeddings"))
    window = hf_config.get("sliding_window")
    uses_window = family == "mistral" or (family == "qwen2" and hf_config.get("use_sliding_window"))
    if uses_window and window and window < block:
        # The toolkit model has no sliding-window attention; within one window the two agree.
        block = int(window)
    return block


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
    if hf_config.get("auto_map"):
        raise UserError(
            "config.json asks for custom code (auto_map); the toolkit converts only models that "
            f"transformers supports natively: {supported_architectures()}"
        )
    n_embd = int(_require(hf_config, "hidden_size"))
    n_head = int(_require(hf_config, "num_attention_heads"))
    hf_config, rope_local_base = _local_rope(hf_config, family)
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
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", family in _GEMMAS)),
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
    elif family == "gpt_neox":
        if not hf_config.get("attention_bias", True):
            raise UserError("config.json: GPT-NeoX with attention_bias=false is not supported")
        values.update(
            norm="layernorm", norm_eps=float(hf_config.get("layer_norm_eps", 1e-5)), mlp="gelu",
            gelu_approximate=_gelu_approximate(act or "gelu", family), bias=True,
            parallel_residual=bool(hf_config.get("use_parallel_residual", True)),
        )
    has_local = values.get("sliding_window") is not None and "local" in (values.get("layer_types") or ["local"])
    if has_local and rope_local_base is not None and (rope_local_base != rope_base or rope_scaling is not None):
        values["rope_local_base"] = rope_local_base  # local layers rotate otherwise than global ones
    config = Config.from_dict({"name": default_name, **values})
    return _name(config, model_name, default_name, hf_config.get("_name_or_path") or "")


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


def _rope_scaling_to_hf(config: Config) -> dict[str, Any]:
    if config.rope_scaling_type == "linear":
        return {"rope_type": "linear", "factor": float(config.rope_scaling["factor"])}
    return {
        "rope_type": "llama3",
        "factor": float(config.rope_scaling["factor"]),
        "low_freq_factor": float(config.rope_scaling["low_freq_factor"]),
        "high_freq_factor": float(config.rope_scaling["high_freq_factor"]),
        "original_max_position_embeddings": int(config.rope_scaling["original_max_seq_len"]),
    }


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
        sliding_window=config.sliding_window,
        layer_types=["sliding_attention" if config.layer(i).window else "full_attention" for i in range(config.n_layer)],
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
    # Per-layer attention spans and NoPE layers have no export yet: refused, never silently dropped.
    _check(config, family, no_rope_layers=None)
    if family not in ("gemma2", "gemma3"):
        _check(config, family, sliding_window=None, layer_types=None, attn_logit_softcap=None,
               final_logit_softcap=None, query_pre_attn_scalar=None, rope_local_base=None)
    if config.rope_scaling is not None and family not in ("llama", "mistral", "qwen2", "gemma", "gemma2", "gemma3"):
        raise _unsupported(config, f"{config.rope_scaling_type} RoPE scaling is only supported for Llama-like families")

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
