"""The model configuration: one serializable dataclass that describes every supported architecture.

The GPT module reads only these fields; it never looks at a model's name. Validation and derived
fields (head size, rotary dimensions, query groups) are computed here, in one place.

This module does not import torch, so that `toolkit list` and `toolkit --help` stay fast.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, NamedTuple, Optional, Union, get_args, get_origin, get_type_hints

from toolkit.errors import UserError, did_you_mean

CONFIG_FILENAME = "model_config.json"

# RoPE frequency scalings: type name -> the keys its `rope_scaling` mapping holds beside "rope_type".
# Each has one function in toolkit.models.rope (`ROPE_SCALINGS`, same names; a test keeps the two in
# step). Listed here, free of torch, so that a config is checked when it is read.
ROPE_SCALING_KEYS: dict[str, tuple[str, ...]] = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_seq_len"),
    # YaRN and LongRoPE (Phi-3): see toolkit.models.rope for what each key does.
    "yarn": ("factor", "original_max_seq_len", "beta_fast", "beta_slow", "attention_factor", "truncate"),
    "longrope": ("short_factor", "long_factor", "original_max_seq_len", "attention_factor"),
    "linear": ("factor",),
}
# A `rope_scaling` without "rope_type" is Llama-3.1's (the only kind before the key existed).
DEFAULT_ROPE_SCALING = "llama3"
LAYER_TYPES = ("global", "local")


class LayerSpec(NamedTuple):
    """What one layer does differently from the others (`Config.layer(i)`)."""

    window: Optional[int]  # tokens each query attends to, itself included; None: every earlier token
    rope: bool  # whether queries and keys are rotated
    moe: bool = False  # whether its feed-forward part is a mixture of experts (else the dense MLP)


@dataclass
class Config:
    name: str = ""
    # Hugging Face repository the preset mirrors ("" for presets that exist only here).
    hf_repo_id: str = ""
    # Architecture family: selects the weight-name map for Hugging Face conversion.
    family: Literal["llama", "mistral", "qwen2", "gemma", "gemma2", "gemma3", "phi", "gpt_neox",
                    "qwen3", "olmo2", "smollm3", "phi3", "mixtral", "qwen3_moe", "olmoe", "gpt_oss"] = "llama"

    # --- sizes
    vocab_size: int = 32000  # rows of the embedding and of the output head
    block_size: int = 4096  # longest context the model supports
    n_layer: int = 16
    n_embd: int = 4096  # width of the residual stream
    n_head: int = 32  # query heads
    # Key/value heads. n_head: multi-head; 1: multi-query; in between: grouped-query attention,
    # where each group of n_head // n_query_groups query heads shares one key/value head:
    #   q heads: q0 q1 | q2 q3 | q4 q5 | q6 q7
    #   kv heads:  kv0  |  kv1  |  kv2  |  kv3      (n_head=8, n_query_groups=4)
    n_query_groups: Optional[int] = None  # None: same as n_head
    head_size: Optional[int] = None  # None: n_embd // n_head
    intermediate_size: Optional[int] = None  # MLP hidden width; None: 4 * n_embd

    # --- layers
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_eps: float = 1e-5
    # Gemma's RMSNorm scales by (1 + weight), so its weights are stored centred on zero.
    norm_unit_offset: bool = False
    # gelu: fc_in -> GELU -> fc_out; swiglu: down(silu(gate) * up); geglu: down(gelu(gate) * up);
    # clamped_swiglu (gpt-oss's experts): gate clamped to <= limit, up to [-limit, limit], then
    # down((up + 1) * gate * sigmoid(alpha * gate)) with `swiglu_limit` and `swiglu_alpha`
    mlp: Literal["gelu", "swiglu", "geglu", "clamped_swiglu"] = "swiglu"
    gelu_approximate: Literal["none", "tanh"] = "none"
    bias: bool = False  # bias on every linear layer of the blocks
    attn_qkv_bias: Optional[bool] = None  # bias on query/key/value only (Qwen2); None: same as `bias`
    lm_head_bias: bool = False
    # Parallel residual: x + attn(norm_1(x)) + mlp(norm_2(x)) instead of two sequential residuals.
    parallel_residual: bool = False
    # With a parallel residual, attention and MLP read the same normalized input (Phi-2).
    shared_attention_norm: bool = False
    tie_embeddings: bool = False  # the output head reuses the embedding matrix
    # Multiply token embeddings by sqrt(n_embd) (Gemma).
    scale_embeddings: bool = False
    # Where each block normalises around its attention and its MLP:
    #   "pre"       x = x + attn(norm_1(x))                     (Llama and most others)
    #   "post"      x = x + post_attn_norm(attn(x))             (OLMo 2)
    #   "sandwich"  x = x + post_attn_norm(attn(norm_1(x)))     (Gemma 2 and 3)
    # and the same around the MLP with norm_2 and post_mlp_norm.
    norm_position: Literal["pre", "post", "sandwich"] = "pre"
    # RMSNorm of queries and keys before the rotary embedding: "head" normalises each head's D
    # values (Qwen3, Gemma 3: weights of size D), "projection" the whole H * D (or G * D) projection
    # (OLMo 2). Same eps and unit offset as the other norms.
    qk_norm: Optional[Literal["head", "projection"]] = None

    # --- rotary position embedding
    rotary_percentage: float = 1.0  # fraction of each head's dimensions that rotate (0.25 for Pythia)
    rope_base: float = 10000.0
    # Frequency scaling: {"rope_type": one of ROPE_SCALING_KEYS, and that type's keys}; without
    # "rope_type", Llama-3.1's: {"factor", "low_freq_factor", "high_freq_factor",
    # "original_max_seq_len"}. None for plain RoPE.
    rope_scaling: Optional[dict[str, Any]] = None
    # Layers (0-based indices) whose attention uses no rotary embedding at all (SmolLM3's NoPE layers).
    no_rope_layers: Optional[list[int]] = None

    # --- attention span, per layer
    # Tokens a query of a "local" layer attends to, itself included (Mistral, Gemma 2/3). None: no
    # layer is local.
    sliding_window: Optional[int] = None
    # Per layer, "global" (every earlier token) or "local" (the last `sliding_window` tokens).
    # None: every layer local when sliding_window is set (Mistral), else every layer global.
    layer_types: Optional[list[str]] = None

    # --- softcapping, attention scale and local RoPE (Gemma 2 and 3)
    # Attention scores (after scaling) become cap * tanh(scores / cap) before the softmax. None: no cap.
    attn_logit_softcap: Optional[float] = None
    # The output logits become cap * tanh(logits / cap) (the fused loss applies it chunk by chunk).
    final_logit_softcap: Optional[float] = None
    # Scores are q k^T / sqrt(query_pre_attn_scalar) instead of q k^T / sqrt(head_size). None: head_size.
    query_pre_attn_scalar: Optional[int] = None
    # RoPE base of the local (sliding-window) layers, which then rotate without `rope_scaling`; the
    # global layers keep `rope_base` and `rope_scaling` (Gemma 3: 10000 local, 1e6 global with
    # linear scaling). None: local layers rotate as global ones.
    rope_local_base: Optional[float] = None

    # --- mixture of experts (Mixtral, Qwen3-MoE, OLMoE, gpt-oss)
    # Experts per MoE layer; 0: a dense model. Each token goes to the `n_expert_per_token` experts
    # its router scores highest (dropless token choice), weighted by their softmax probabilities,
    # renormalised over the chosen ones when `router_norm_topk`.
    n_expert: int = 0
    n_expert_per_token: int = 0
    moe_intermediate_size: Optional[int] = None  # each expert's hidden width; None: intermediate_size
    # Layers (0-based) whose feed-forward part is the mixture; the others keep the dense MLP of
    # `intermediate_size` (Qwen3-MoE's `mlp_only_layers`, `decoder_sparse_step`). None: every layer.
    moe_layers: Optional[list[int]] = None
    router_norm_topk: bool = True
    # Coefficients of the router's losses as the family trains them: the load-balancing loss
    # (`toolkit.models.moe.router_losses`) and the router z-loss (mean squared log-sum-exp of the
    # router's logits). The training objective reads them; `--model_overrides` changes them.
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    # mlp "clamped_swiglu" (gpt-oss): the clamp and the sigmoid's slope.
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    # A learned logit per head that joins each query's softmax as one more key whose value is zero,
    # so a query can attend to "nothing" (gpt-oss's attention sinks; weights `attn.sinks`, (H,)).
    attention_sinks: bool = False

    # --- derived in __post_init__; not meant to be set
    rope_n_elem: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._check_types()
        problems = []
        for name in ("vocab_size", "block_size", "n_layer", "n_embd", "n_head", "head_size", "intermediate_size",
                     "norm_eps", "rope_base", "attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar",
                     "rope_local_base"):
            value = getattr(self, name)
            if value is not None and not value > 0:  # None: derived below
                problems.append(f"{name} must be positive, got {value}")
        if problems:
            raise UserError(f"Invalid model config {self.name!r}: " + "; ".join(problems))
        if self.n_query_groups is None:
            self.n_query_groups = self.n_head
        if self.head_size is None:
            if self.n_embd % self.n_head:
                raise UserError(
                    f"Invalid model config {self.name!r}: n_embd={self.n_embd} is not divisible by "
                    f"n_head={self.n_head}; set head_size explicitly"
                )
            self.head_size = self.n_embd // self.n_head
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.n_embd
        if self.attn_qkv_bias is None:
            self.attn_qkv_bias = self.bias
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        if self.n_query_groups <= 0 or self.n_head % self.n_query_groups:
            raise UserError(
                f"Invalid model config {self.name!r}: n_head={self.n_head} must be a multiple of "
                f"n_query_groups={self.n_query_groups}"
            )
        if not 0.0 < self.rotary_percentage <= 1.0:
            raise UserError(f"Invalid model config {self.name!r}: rotary_percentage must be in (0, 1]")
        self.rope_n_elem = int(self.rotary_percentage * self.head_size)
        if self.rope_n_elem % 2:
            raise UserError(
                f"Invalid model config {self.name!r}: rotary dimensions "
                f"({self.rotary_percentage} x head_size {self.head_size}) must be even"
            )
        if self.shared_attention_norm and not self.parallel_residual:
            raise UserError(f"Invalid model config {self.name!r}: shared_attention_norm needs parallel_residual")
        if self.parallel_residual and self.norm_position != "pre":
            raise UserError(f"Invalid model config {self.name!r}: parallel_residual needs norm_position 'pre'")
        if self.qk_norm is not None and self.norm != "rmsnorm":
            raise UserError(f"Invalid model config {self.name!r}: qk_norm needs norm 'rmsnorm'")
        if self.rope_scaling is not None:
            kind = self.rope_scaling_type
            if not isinstance(kind, str) or kind not in ROPE_SCALING_KEYS:
                raise UserError(
                    f"Invalid model config {self.name!r}: rope_scaling's rope_type {kind!r} is not one of "
                    f"{tuple(ROPE_SCALING_KEYS)}"
                )
            missing = set(ROPE_SCALING_KEYS[kind]) - set(self.rope_scaling)
            if missing:
                raise UserError(f"Invalid model config {self.name!r}: rope_scaling lacks {sorted(missing)}")
            self._check_rope_factor_lists()
        self._check_layers()
        self._check_experts()
        for name, allowed in (("norm", ("rmsnorm", "layernorm")), ("mlp", ("gelu", "swiglu", "geglu", "clamped_swiglu"))):
            if getattr(self, name) not in allowed:
                raise UserError(f"Invalid model config {self.name!r}: {name} must be one of {allowed}")

    def _check_rope_factor_lists(self) -> None:
        """LongRoPE's factor lists hold one number per rotated frequency (rope_n_elem / 2)."""
        for key in ("short_factor", "long_factor"):
            if key not in self.rope_scaling:
                continue
            factors = self.rope_scaling[key]
            if (not isinstance(factors, list) or len(factors) != self.rope_n_elem // 2
                    or not all(isinstance(f, (int, float)) and not isinstance(f, bool) and f > 0 for f in factors)):
                raise UserError(
                    f"Invalid model config {self.name!r}: rope_scaling's {key} must be a list of "
                    f"{self.rope_n_elem // 2} positive numbers (one per rotated frequency)"
                )

    def _check_layers(self) -> None:
        """sliding_window, layer_types and no_rope_layers describe n_layer layers consistently."""
        problems = []
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            problems.append(f"sliding_window must be a positive integer, got {window!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.n_layer:
                problems.append(f"layer_types has {len(self.layer_types)} entries for n_layer={self.n_layer}")
            wrong = [t for t in self.layer_types if t not in LAYER_TYPES]
            if wrong:
                problems.append(f"layer_types entries must be one of {LAYER_TYPES}, got {wrong[0]!r}")
            elif "local" in self.layer_types and window is None:
                problems.append("layer_types has local layers but sliding_window is not set")
        if not problems and self.rope_local_base is not None and not any(self.layer(i).window for i in range(self.n_layer)):
            problems.append("rope_local_base is set but no layer is local (sliding_window, layer_types)")
        if self.no_rope_layers is not None:
            wrong = [i for i in self.no_rope_layers if isinstance(i, bool) or not isinstance(i, int)
                     or not 0 <= i < self.n_layer]
            if wrong:
                problems.append(f"no_rope_layers entries must be layer indices in [0, {self.n_layer}), got {wrong[0]!r}")
            elif len(set(self.no_rope_layers)) != len(self.no_rope_layers):
                problems.append("no_rope_layers lists a layer twice")
        if problems:
            raise UserError(f"Invalid model config {self.name!r}: " + "; ".join(problems))

    def _check_experts(self) -> None:
        """The mixture-of-experts fields describe a router that can choose, over layers that exist."""
        problems = []
        if self.n_expert < 0 or self.n_expert_per_token < 0:
            problems.append("n_expert and n_expert_per_token must not be negative")
        elif self.n_expert == 0:
            if self.n_expert_per_token or self.moe_layers is not None:
                problems.append("n_expert_per_token and moe_layers need n_expert > 0")
        else:
            if not 1 <= self.n_expert_per_token <= self.n_expert:
                problems.append(f"n_expert_per_token must be in [1, n_expert={self.n_expert}], got {self.n_expert_per_token}")
            if self.mlp == "gelu":
                problems.append("experts are gated (mlp swiglu, geglu or clamped_swiglu), not gelu")
            if self.moe_layers is not None:
                wrong = [i for i in self.moe_layers if isinstance(i, bool) or not isinstance(i, int)
                         or not 0 <= i < self.n_layer]
                if wrong:
                    problems.append(f"moe_layers entries must be layer indices in [0, {self.n_layer}), got {wrong[0]!r}")
                elif len(set(self.moe_layers)) != len(self.moe_layers):
                    problems.append("moe_layers lists a layer twice")
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must not be negative")
        if self.moe_intermediate_size is not None and self.moe_intermediate_size <= 0:
            problems.append(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}")
        if self.mlp == "clamped_swiglu" and not (self.swiglu_limit > 0 and self.swiglu_alpha > 0):
            problems.append("swiglu_limit and swiglu_alpha must be positive")
        if problems:
            raise UserError(f"Invalid model config {self.name!r}: " + "; ".join(problems))

    def _check_types(self) -> None:
        """Every field holds a value of its annotated type (a JSON file or --model_overrides may not)."""
        hints = get_type_hints(type(self))
        for f in fields(self):
            if not f.init:
                continue
            value, hint = getattr(self, f.name), hints[f.name]
            if value is None and type(None) in get_args(hint):
                continue
            base = next((a for a in get_args(hint) if a is not type(None)), hint) if get_origin(hint) is Union else hint
            if get_origin(base) is Literal:
                if value not in get_args(base):
                    raise UserError(f"Invalid model config {self.name!r}: {f.name} must be one of {get_args(base)}, got {value!r}")
                continue
            expected = get_origin(base) or base
            if expected is float and isinstance(value, int) and not isinstance(value, bool):
                setattr(self, f.name, float(value))  # 10000 for 10000.0
                continue
            if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
                kind = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a mapping",
                        list: "a list"}
                raise UserError(
                    f"Invalid model config {self.name!r}: {f.name} must be {kind.get(expected, expected.__name__)}, got {value!r}"
                )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_name(cls, name: str, /, **overrides: Any) -> "Config":
        """A preset by name, alias or Hugging Face repo id (case-insensitive), with fields overridden."""
        from toolkit.models.presets import find_preset

        preset = find_preset(name)
        if "n_layer" in overrides:
            preset = resize_layer_lists(preset, overrides["n_layer"], keep=set(overrides))
        return cls.from_dict({**preset, **overrides})

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "Config":
        known = {f.name for f in fields(cls) if f.init}
        unknown = [k for k in values if k not in known and k != "aliases"]
        if unknown:
            raise UserError(
                f"Unknown model config field {unknown[0]!r}.{did_you_mean(unknown[0], known)}"
            )
        return cls(**{k: v for k, v in values.items() if k in known})

    @classmethod
    def from_file(cls, path: Path | str) -> "Config":
        path = Path(path)
        if path.is_dir():
            path = path / CONFIG_FILENAME
        try:
            values = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(f"No model config at {path}: is this a toolkit checkpoint directory?") from None
        except (OSError, json.JSONDecodeError) as err:
            raise UserError(f"Cannot read model config {path}: {err}") from None
        return cls.from_dict(values)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    def save(self, directory: Path | str) -> Path:
        path = Path(directory) / CONFIG_FILENAME
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    def replace(self, **changes: Any) -> "Config":
        return self.from_dict({**self.to_dict(), **changes})

    # ------------------------------------------------------------------ derived per layer
    @property
    def rope_scaling_type(self) -> Optional[str]:
        """The key of `rope_scaling` in ROPE_SCALING_KEYS (None without scaling)."""
        if self.rope_scaling is None:
            return None
        return self.rope_scaling.get("rope_type", DEFAULT_ROPE_SCALING)

    def layer(self, index: int) -> LayerSpec:
        """What layer `index` (0-based) does: its attention span and whether it rotates."""
        if self.layer_types is None:
            local = self.sliding_window is not None
        else:
            local = self.layer_types[index] == "local"
        rope = self.no_rope_layers is None or index not in self.no_rope_layers
        moe = self.n_expert > 0 and (self.moe_layers is None or index in self.moe_layers)
        return LayerSpec(window=self.sliding_window if local else None, rope=rope, moe=moe)

    # ------------------------------------------------------------------ derived sizes
    @property
    def is_moe(self) -> bool:
        """Some layer's feed-forward part is a mixture of experts."""
        return any(self.layer(i).moe for i in range(self.n_layer))

    @property
    def kv_heads(self) -> int:
        return self.n_query_groups  # type: ignore[return-value]


# Fields that say something per layer: a list of n_layer entries, or a list of layer indices.
PER_LAYER_LISTS = ("layer_types",)
LAYER_INDEX_LISTS = ("no_rope_layers", "moe_layers")


def _period(pattern: list) -> int:
    """The shortest p with pattern[i] == pattern[i % p] for every i."""
    return next(p for p in range(1, len(pattern) + 1) if all(v == pattern[i % p] for i, v in enumerate(pattern)))


def resize_layer_lists(values: dict[str, Any], n_layer: Any, keep: set[str]) -> dict[str, Any]:
    """`values` with its per-layer fields fitted to `n_layer` layers, so that `--model_overrides
    '{n_layer: 4}'` gives a smaller model of the same kind: each per-layer pattern (Gemma's five local
    layers and one global, SmolLM3's NoPE every fourth layer, Qwen3-MoE's dense layers) is repeated or
    cut at its period. A pattern that does not repeat within the preset is cut, never invented: a
    deeper model with one is refused, naming the field to set. Fields in `keep` (overridden too) are
    left as given."""
    if isinstance(n_layer, bool) or not isinstance(n_layer, int) or n_layer < 1:
        return values  # Config's own checks name the problem
    values = dict(values)
    old = values.get("n_layer")
    for name in PER_LAYER_LISTS + LAYER_INDEX_LISTS:
        entries = values.get(name)
        if name in keep or entries is None or not isinstance(old, int) or old == n_layer:
            continue
        pattern = entries if name in PER_LAYER_LISTS else [i in entries for i in range(old)]
        period = _period(pattern)
        if n_layer > old and period == len(pattern) and len(pattern) > 1:
            raise UserError(
                f"--model_overrides sets n_layer={n_layer}, but the preset's {name} ({len(pattern)} layers) has no "
                f"repeating pattern to extend: set {name} too"
            )
        fitted = [pattern[i % period] for i in range(n_layer)]
        values[name] = fitted if name in PER_LAYER_LISTS else [i for i, chosen in enumerate(fitted) if chosen]
    return values
