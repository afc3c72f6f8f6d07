"""The model configuration: one serializable dataclass that describes every supported architecture.

The GPT module reads only these fields; it never looks at a model's name. Validation and derived
fields (head size, rotary dimensions, query groups) are computed here, in one place.

This module does not import torch, so that `toolkit list` and `toolkit --help` stay fast.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Optional, Union, get_args, get_origin, get_type_hints

from toolkit.errors import UserError, did_you_mean

CONFIG_FILENAME = "model_config.json"


@dataclass
class Config:
    name: str = ""
    # Hugging Face repository the preset mirrors ("" for presets that exist only here).
    hf_repo_id: str = ""
    # Architecture family: selects the weight-name map for Hugging Face conversion.
    family: Literal["llama", "mistral", "qwen2", "gemma", "phi", "gpt_neox"] = "llama"

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
    # gelu: fc_in -> GELU -> fc_out; swiglu: down(silu(gate) * up); geglu: down(gelu(gate) * up)
    mlp: Literal["gelu", "swiglu", "geglu"] = "swiglu"
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

    # --- rotary position embedding
    rotary_percentage: float = 1.0  # fraction of each head's dimensions that rotate (0.25 for Pythia)
    rope_base: float = 10000.0
    # Llama-3.1 frequency scaling: {"factor", "low_freq_factor", "high_freq_factor",
    # "original_max_seq_len"}; None for plain RoPE.
    rope_scaling: Optional[dict[str, float]] = None

    # --- derived in __post_init__; not meant to be set
    rope_n_elem: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._check_types()
        problems = []
        for name in ("vocab_size", "block_size", "n_layer", "n_embd", "n_head", "head_size", "intermediate_size",
                     "norm_eps", "rope_base"):
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
        if self.rope_scaling is not None:
            missing = {"factor", "low_freq_factor", "high_freq_factor", "original_max_seq_len"} - set(self.rope_scaling)
            if missing:
                raise UserError(f"Invalid model config {self.name!r}: rope_scaling lacks {sorted(missing)}")
        for name, allowed in (("norm", ("rmsnorm", "layernorm")), ("mlp", ("gelu", "swiglu", "geglu"))):
            if getattr(self, name) not in allowed:
                raise UserError(f"Invalid model config {self.name!r}: {name} must be one of {allowed}")

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
                kind = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a mapping"}
                raise UserError(
                    f"Invalid model config {self.name!r}: {f.name} must be {kind.get(expected, expected.__name__)}, got {value!r}"
                )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_name(cls, name: str, /, **overrides: Any) -> "Config":
        """A preset by name, alias or Hugging Face repo id (case-insensitive), with fields overridden."""
        from toolkit.models.presets import find_preset

        preset = find_preset(name)
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

    # ------------------------------------------------------------------ derived sizes
    @property
    def kv_heads(self) -> int:
        return self.n_query_groups  # type: ignore[return-value]

    def num_parameters(self) -> int:
        """Parameter count computed from the config alone (tied embeddings counted once)."""
        e, hs, nh, nkv, ff = self.n_embd, self.head_size, self.n_head, self.n_query_groups, self.intermediate_size
        norm = 2 * e if self.norm == "layernorm" else e
        qkv = e * hs * (nh + 2 * nkv) + (hs * (nh + 2 * nkv) if self.attn_qkv_bias else 0)
        attn_out = hs * nh * e + (e if self.bias else 0)
        if self.mlp == "gelu":
            mlp = e * ff + ff * e + ((ff + e) if self.bias else 0)
        else:
            mlp = 3 * e * ff + ((2 * ff + e) if self.bias else 0)
        norms = norm if self.shared_attention_norm else 2 * norm
        per_block = qkv + attn_out + mlp + norms
        embed = self.vocab_size * e
        head = 0 if self.tie_embeddings else self.vocab_size * e
        head += self.vocab_size if self.lm_head_bias else 0
        return self.n_layer * per_block + embed + head + norm

    def flops_per_token(self, seq_len: int, trainable_fraction: float = 1.0) -> float:
        """Training FLOPs per token: 6 per weight (forward 2, backward 4) plus attention scores.

        With frozen weights (LoRA) the backward pass skips weight gradients, so each frozen
        weight costs 4 instead of 6.
        """
        # Every weight takes part in a matmul except the embedding table (a lookup); a tied head
        # is the same tensor as the table and is a matmul, so it counts once either way.
        weights = self.num_parameters() - (0 if self.tie_embeddings else self.vocab_size * self.n_embd)
        dense = (4 + 2 * trainable_fraction) * weights
        # QK^T and attention x V: 2 matmuls of (T x hs) per head, causal halves them; x3 for fwd+bwd
        attention = 3 * 2 * 2 * self.n_layer * self.n_head * self.head_size * seq_len / 2
        return dense + attention

