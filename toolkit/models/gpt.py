"""One decoder-only transformer for every supported family, driven by `Config` fields only.

Single-device code: nothing here knows about Fabric, FSDP or precision plugins. Those are applied
from outside (`toolkit.parallel.fsdp`, `toolkit.training.fabric`).

The layers live beside this file, one kind each: `attention` (CausalSelfAttention and its masks),
`kv_cache`, `mlp` (a registry of MLP kinds), `norms`, `rope` (with a registry of frequency
scalings) and `loss` (the fused head losses). What differs between layers of one model (a sliding
window, no rotary embedding) is config data: `Block(config, i)` reads `config.layer(i)`.

Shapes: B batch, T tokens in this call, L cached tokens, E n_embd, H query heads, G key/value heads
(query groups), D head size, V vocabulary.
"""

from __future__ import annotations

import math
import zlib
from typing import Optional

import torch
import torch.nn as nn

from toolkit.models.attention import CausalSelfAttention, document_segments
from toolkit.models.config import Config
from toolkit.models.kv_cache import KVCache
from toolkit.models.loss import cross_entropy_sum, label_log_probs, linear_cross_entropy_sum, linear_label_log_probs
from toolkit.models.mlp import make_mlp
from toolkit.models.moe import GroupedExperts, MoE
from toolkit.models.norms import RMSNorm, make_norm
from toolkit.models.rope import RotaryEmbedding


class GPT(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm_f = make_norm(config)
        self.lm_head = OutputHead(config.n_embd, config.vocab_size, bias=config.lm_head_bias)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rope = RotaryEmbedding(config)
        # local layers' own tables (Config.rope_local_base), else they share the global ones
        self.rope_local = RotaryEmbedding(config, local=True) if config.rope_local_base is not None else None

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        input_pos: Optional[int] = None,
        logits_to_keep: int = 0,
        document_ids: Optional[torch.Tensor] = None,
        per_token: bool = False,
    ) -> torch.Tensor:
        """Logits (B, T, V); with `labels` (B, T), the summed cross-entropy over labelled tokens.

        With `labels` and `per_token`: the float32 log-probability (B, T) of each label instead,
        0 where the label is IGNORE_INDEX (a sequence's log-probability is `.sum(-1)`), computed
        through the fused head (`linear_label_log_probs`) as the loss is.

        The loss is a sum, not a mean, so that the training loop can normalise by the number of
        target tokens across micro-batches and ranks. `input_pos` is the position of the first
        token when a KV cache is in use (see `set_kv_cache`). `logits_to_keep` > 0: logits of the last
        that many positions only (B, logits_to_keep, V), as when a prompt fills the cache and only
        its last position predicts (the head over every position costs B * T * V).

        `document_ids` (B, T): packed rows (see `toolkit.data.instruct.PackedSamples`). Each run of
        equal ids in a row is one sample: its positions restart at 0 and its tokens attend only
        within it (see `document_segments`). Without it (or with one id per row) every row is one
        sequence, computed exactly as before. A layer with a sliding window (`Config.layer`) lets each
        query see its last `window` tokens only, within its sample and through the KV cache alike.
        """
        B, T = input_ids.shape
        if per_token and labels is None:
            raise ValueError("per_token gives the log-probabilities of labels: pass labels")
        start = 0 if input_pos is None else input_pos
        if start + T > self.config.block_size:
            raise ValueError(f"Sequence of {start + T} tokens exceeds the context of {self.config.block_size}")
        x = self.embed(input_ids)  # (B, T, E)
        if self.config.scale_embeddings:
            x = x * torch.tensor(self.config.n_embd**0.5, dtype=x.dtype)
        cache = self.blocks[0].attn.kv_cache
        if cache is not None and start > 0 and self.rope.switch_length is not None:
            self._check_cached_frequencies(cache, start, T, B)
        segments = None
        if document_ids is not None:
            if document_ids.shape != input_ids.shape:
                raise ValueError(f"document_ids {tuple(document_ids.shape)} must have the shape of input_ids {(B, T)}")
            if cache is not None:
                raise ValueError("document_ids (packed samples) are for training; clear the KV cache first")
            positions, segments = document_segments(document_ids)
        elif cache is not None and cache.left_padding is not None:
            # A row's first real token is at position 0 whatever padding precedes it (padding: 0)
            positions = torch.arange(start, start + T, device=x.device)[None] - cache.left_padding[:B, None]  # (B, T)
            positions = positions.clamp(min=0)
        else:
            positions = None
        tables = {"global": self._rope_tables(self.rope, positions, start, T, x.device, segments)}
        if self.rope_local is not None:
            tables["local"] = self._rope_tables(self.rope_local, positions, start, T, x.device, segments)
        if segments is not None and segments.shape[1] == 1:
            segments = None  # one sample per row: the plain causal path
        for block in self.blocks:
            x = block(x, *tables[block.attn.rope_kind], input_pos, segments)
        x = self.norm_f(x)
        if labels is None:
            return softcap(self.lm_head(x[:, -logits_to_keep:] if logits_to_keep else x), self.config.final_logit_softcap)
        return self.head_loss(x, labels, per_token)

    @staticmethod
    def _rope_tables(
        rope: RotaryEmbedding, positions: Optional[torch.Tensor], start: int, T: int, device,
        segments: Optional[torch.Tensor] = None,
    ):
        """cos, sin: (T, rope_n_elem) each for positions start..start + T - 1, or (B, 1, T, rope_n_elem)
        at each row's `positions` (B, T) (of packed samples: `segments` (B, R)); float32."""
        return rope(start, T, device) if positions is None else rope.at(positions, device, segments)

    def head_loss(self, x: torch.Tensor, labels: torch.Tensor, per_token: bool = False) -> torch.Tensor:
        """Summed cross-entropy of `lm_head(x)` against `labels`, equal to `cross_entropy_sum(lm_head(x), labels)`;
        with `per_token`, the log-probability of each label, equal to `label_log_probs(lm_head(x), labels)`.

        The toolkit's own head (`OutputHead`, also once FSDP has wrapped it) computes it fused,
        through its forward pass, so that hooks on the head (FSDP's gather) run. Anything else in
        its place (a peft LoRA layer, a quantized layer) takes the plain path.
        """
        head, cap = self.lm_head, self.config.final_logit_softcap
        if isinstance(head, OutputHead):
            return head(x, labels, per_token, softcap=cap)
        return (label_log_probs if per_token else cross_entropy_sum)(softcap(head(x), cap), labels)

    # ------------------------------------------------------------------ KV cache
    def _check_cached_frequencies(self, cache: KVCache, start: int, T: int, B: int) -> None:
        """Refuse to extend a cache across LongRoPE's switch: its keys were rotated by the other tables.

        Left-padded rows count from their first real token, the longest row deciding (`RotaryEmbedding.at`).
        """
        shift = 0 if cache.left_padding is None else int(cache.left_padding[:B].min())
        if not self.rope.same_frequencies(start - shift, start + T - shift):
            raise ValueError(
                f"The rotary frequencies change past {self.rope.switch_length} tokens (LongRoPE), so the KV "
                f"cache of {start - shift} tokens cannot be extended to {start + T - shift}: run the whole "
                "sequence again from position 0"
            )

    def set_kv_cache(
        self, batch_size: int, max_seq_length: int, device=None, dtype=None, left_padding: Optional[torch.Tensor] = None
    ) -> None:
        """Allocate a key/value cache per block for incremental decoding up to `max_seq_length`.

        `left_padding` (B,): the number of padding tokens each row of a left-padded batch starts
        with. No position attends to a row's padding, and the row's first real token is at
        position 0 (as Hugging Face derives position ids from the attention mask), so each row
        gets the outputs it gets alone. Cache slot s of row b then holds position s - padding[b].
        """
        if max_seq_length > self.config.block_size:
            raise ValueError(f"max_seq_length {max_seq_length} exceeds the context of {self.config.block_size}")
        weight = self.lm_head.weight
        device = device or weight.device
        dtype = dtype or weight.dtype
        for block in self.blocks:
            block.attn.kv_cache = KVCache(batch_size, self.config.kv_heads, max_seq_length, self.config.head_size, device, dtype)
            if left_padding is not None:
                block.attn.kv_cache.left_padding = left_padding.to(device=device, dtype=torch.long)

    def clear_kv_cache(self) -> None:
        for block in self.blocks:
            block.attn.kv_cache = None

    def select_kv_cache_rows(self, rows: torch.Tensor) -> None:
        """Row i of every block's cache becomes a copy of row `rows[i]` (R,).

        Lets one prompt, run once, continue in several rows: fill rows 0..P-1 with P prompts, then
        give each continuation the row of its prompt (beam search reorders rows the same way).
        """
        for block in self.blocks:
            cache = block.attn.kv_cache
            cache.k[: rows.numel()] = cache.k[rows]
            cache.v[: rows.numel()] = cache.v[rows]
            if cache.left_padding is not None:
                cache.left_padding = torch.cat([cache.left_padding[rows], cache.left_padding[rows.numel():]])


class OutputHead(nn.Linear):
    """The output head: `nn.Linear` (same weights, same names) whose forward also takes `labels`.

    `head(x)` gives the logits (..., V). `head(x, labels)` gives their summed cross-entropy through
    `linear_cross_entropy_sum`, `head(x, labels, per_token=True)` each label's log-probability
    (...) through `linear_label_log_probs`: neither holds the whole (B * T, V) float32 logits;
    under torch.compile they run eagerly, outside the graph. The loss is computed inside the head's
    forward pass so that whatever wraps the head as a module (FSDP gathers its weight in a hook
    before the call) sees the call.
    """

    def forward(
        self, x: torch.Tensor, labels: Optional[torch.Tensor] = None, per_token: bool = False,
        softcap: Optional[float] = None,
    ) -> torch.Tensor:
        """`softcap`: the loss is that of the logits cap * tanh(logits / cap) (`Config.final_logit_softcap`);
        the logits themselves (no labels) are returned uncapped, as the caller caps them."""
        if labels is None:
            return super().forward(x)
        fused = linear_label_log_probs if per_token else linear_cross_entropy_sum
        if _compiling():
            return _outside_compile(fused)(x, self.weight, self.bias, labels, softcap=softcap)
        return fused(x, self.weight, self.bias, labels, softcap=softcap)


class Block(nn.Module):
    """One transformer layer. Sequential residual, norms before each part (Llama):

        x = x + attn(norm_1(x));  x = x + mlp(norm_2(x))

    With `norm_position` "post" the parts read x itself and their outputs are normalised
    (post_attn_norm, post_mlp_norm: OLMo 2); "sandwich" normalises both before and after (Gemma 2/3).
    Parallel residual (GPT-NeoX; Phi-2 with one shared norm):

        x = x + attn(norm_1(x)) + mlp(norm_2(x))
    """

    def __init__(self, config: Config, layer_index: int) -> None:
        super().__init__()
        pre = config.norm_position in ("pre", "sandwich")
        post = config.norm_position in ("post", "sandwich")
        self.norm_1 = make_norm(config) if pre else None
        self.attn = CausalSelfAttention(config, layer_index)
        self.post_attn_norm = make_norm(config) if post else None
        self.norm_2 = make_norm(config) if pre and not config.shared_attention_norm else None
        self.mlp = MoE(config) if config.layer(layer_index).moe else make_mlp(config)
        self.post_mlp_norm = make_norm(config) if post else None
        self.parallel_residual = config.parallel_residual

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: Optional[int],
        segments: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        h = x if self.norm_1 is None else self.norm_1(x)
        attn_out = self.attn(h, cos, sin, input_pos, segments)
        if self.post_attn_norm is not None:
            attn_out = self.post_attn_norm(attn_out)
        if self.parallel_residual:  # norm_position "pre" (Config checks)
            mlp_in = h if self.norm_2 is None else self.norm_2(x)
            return x + attn_out + self.mlp(mlp_in)
        x = x + attn_out
        mlp_out = self.mlp(x if self.norm_2 is None else self.norm_2(x))
        if self.post_mlp_norm is not None:
            mlp_out = self.post_mlp_norm(mlp_out)
        return x + mlp_out


def softcap(logits: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """cap * tanh(logits / cap) (Gemma 2's final logits); the logits themselves when `cap` is None."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def count_parameters(config: Config, active: bool = False) -> int:
    """Parameters of `GPT(config)`, counted on the model built on the meta device (no memory; a
    70B model in well under a second), a tied head once. `active`: those one token computes with,
    where a mixture of experts counts K of its X experts (Qwen3-30B-A3B: about 3B of 30B)."""
    with torch.device("meta"):
        model = GPT(config)
    total = sum(p.numel() for p in model.parameters())
    if active and config.n_expert:
        idle = 1 - config.n_expert_per_token / config.n_expert
        experts = sum(p.numel() for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters())
        total -= round(experts * idle)
    return total


def flops_per_token(config: Config, seq_len: int, trainable_fraction: float = 1.0) -> float:
    """Training FLOPs per token: 6 per weight of a matrix product (forward 2, backward 4) plus the
    attention scores. With frozen weights (LoRA) the backward pass skips their gradients, so each
    costs 4 instead of 6. The weights are those a token computes with (`count_parameters(active=True)`:
    of a mixture of experts, the K experts it is routed to)."""
    # Every weight takes part in a matrix product except the embedding table (a lookup); a tied
    # head is the same tensor as the table and is a product, so it counts once either way.
    weights = count_parameters(config, active=True) - (0 if config.tie_embeddings else config.vocab_size * config.n_embd)
    dense = (4 + 2 * trainable_fraction) * weights
    # QK^T and attention x V: 2 products of (keys x head size) per head and query, where a query sees
    # T / 2 keys on average (causal), or fewer within a sliding window w < T; x3 for forward + backward
    keys = 0.0
    for i in range(config.n_layer):
        w = config.layer(i).window
        keys += seq_len / 2 if w is None or w >= seq_len else (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len
    attention = 3 * 2 * 2 * config.n_head * config.head_size * keys
    return dense + attention


def head_flops_per_row(config: Config, trainable_fraction: float = 1.0) -> float:
    """The output head's share of `flops_per_token`: one row of logits, forward and backward."""
    return (4 + 2 * trainable_fraction) * config.vocab_size * config.n_embd


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


_EAGER: dict = {}


def _outside_compile(fn):
    """`fn` wrapped so that torch.compile leaves it out of the graph and calls it as it is.

    The fused loss computes its gradients in the forward pass with data-dependent row selection;
    compiled, it would be traced into the graph or replaced by the plain loss. Created on first use
    (inside a compiled region torch._dynamo is loaded already; importing it eagerly would slow every
    start-up).
    """
    wrapped = _EAGER.get(fn)
    if wrapped is None:
        wrapped = _EAGER[fn] = torch.compiler.disable(fn)
    return wrapped


# Random initial values are drawn this many at a time (a block of whole rows): small enough that a
# rank owning a few rows draws little more than them, large enough that seeding costs nothing.
INIT_BLOCK_ELEMENTS = 1 << 20


@torch.no_grad()
def init_weights(model: nn.Module, n_layer: int, std: float = 0.02, seed: Optional[int] = None) -> None:
    """Initialise a (full, single-device) model for pretraining from scratch; see `init_specs`.

    Each parameter draws from its own generator, seeded by `seed` and its name, so the values do
    not depend on the order of initialisation nor on how a distributed run shards the model (a
    sharded run draws only the rows it owns, with the same values). Without `seed`, one is drawn from
    torch's global generator.
    """
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    specs = init_specs(model, n_layer, std)
    for name, param in model.named_parameters():
        param.copy_(initial_value(specs[name], tuple(param.shape), seed, name))


def init_specs(model: nn.Module, n_layer: int, std: float = 0.02) -> dict[str, tuple[str, float]]:
    """How each parameter starts, by name: ("normal", std), ("zeros", 0) or ("ones", 0).

    Linear and embedding weights ~ N(0, std); the projections that write into the residual stream
    (attention output, MLP output) use std / sqrt(2 * n_layer) so the residual's variance does not
    grow with depth. Biases and attention sinks start at zero, norms at identity.
    """
    residual_std = std / math.sqrt(2 * n_layer)
    specs: dict[str, tuple[str, float]] = {}
    for module_name, module in model.named_modules():
        prefix = module_name + "." if module_name else ""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            leaf = module_name.rsplit(".", 1)[-1]
            specs.setdefault(prefix + "weight", ("normal", residual_std if leaf in ("o_proj", "fc_out", "down_proj") else std))
            if getattr(module, "bias", None) is not None:
                specs[prefix + "bias"] = ("zeros", 0.0)
        elif isinstance(module, nn.LayerNorm):
            specs[prefix + "weight"], specs[prefix + "bias"] = ("ones", 0.0), ("zeros", 0.0)
        elif isinstance(module, RMSNorm):
            specs[prefix + "weight"] = ("zeros", 0.0) if module.unit_offset else ("ones", 0.0)
        elif isinstance(module, CausalSelfAttention) and module.sinks is not None:
            specs[prefix + "sinks"] = ("zeros", 0.0)  # a sink starts as one more key of score 0
        elif isinstance(module, GroupedExperts):
            specs[prefix + "gate_up_proj"], specs[prefix + "down_proj"] = ("normal", std), ("normal", residual_std)
            if module.gate_up_bias is not None:
                specs[prefix + "gate_up_bias"], specs[prefix + "down_bias"] = ("zeros", 0.0), ("zeros", 0.0)
    return specs


def initial_value(
    spec: tuple[str, float], shape: tuple[int, ...], seed: int, name: str, start: int = 0, stop: Optional[int] = None,
    out: Optional[torch.Tensor] = None, inner: Optional[tuple[int, int]] = None,
) -> torch.Tensor:
    """Rows [start, stop) (dim 0) of the initial value of parameter `name` (see `init_specs`); with
    `inner=(first, last)`, only rows [first, last) of dim 1 of each (an expert weight split along
    dim 1, `toolkit.parallel.fsdp.expert_shard_dim`).

    Returned as a new float32 CPU tensor, or written into `out` (same shape, any dtype and device)
    and `out` returned. Random values are drawn in blocks of whole rows (about INIT_BLOCK_ELEMENTS
    values each), each block from its own generator seeded by `seed`, the name and the block's
    index; a tensor of 3 or more dims is drawn as rows of its first two dims together (an expert's
    (X, out, in) weight as X * out rows). A rank that owns a few rows of a weight draws only the
    blocks that cover them, never the full tensor, and gets the values any other sharding would
    give those rows.
    """
    kind, std = spec
    rows = shape[0] if shape else 1
    stop = rows if stop is None else min(stop, rows)
    first, last = inner if inner is not None else (0, shape[1] if len(shape) > 1 else 1)
    part_shape = (max(stop - start, 0), *shape[1:]) if shape else ()
    if inner is not None:
        part_shape = (part_shape[0], last - first, *shape[2:])
    if out is None:
        out = torch.empty(part_shape)
    if kind in ("zeros", "ones"):
        return out.fill_(0.0 if kind == "zeros" else 1.0)
    name_seed = seed * 1_000_003 + zlib.crc32(name.encode())
    if len(shape) >= 3:
        drawn = (shape[0] * shape[1], *shape[2:])
        parts = out.view(part_shape[0], part_shape[1], *shape[2:])
        if inner is None:
            _draw_rows(parts.view(-1, *shape[2:]), drawn, start * shape[1], stop * shape[1], std, name_seed)
        for row in range(start, stop) if inner is not None else ():
            _draw_rows(parts[row - start], drawn, row * shape[1] + first, row * shape[1] + last, std, name_seed)
    elif inner is not None:  # (X, out): whole rows drawn, their entries [first, last) kept
        whole = _draw_rows(torch.empty(part_shape[0], shape[1]), shape, start, stop, std, name_seed)
        out.copy_(whole[:, first:last])
    else:
        _draw_rows(out.view(-1, *shape[1:]) if shape else out.view(1), shape or (1,), start, stop, std, name_seed)
    return out


def _draw_rows(out: torch.Tensor, shape: tuple[int, ...], start: int, stop: int, std: float, name_seed: int) -> torch.Tensor:
    """Rows [start, stop) of a tensor of `shape` drawn from N(0, std) block by block (see
    `initial_value`), written into `out` (stop - start rows)."""
    rows = shape[0]
    row_numel = math.prod(shape[1:])
    block_rows = max(1, INIT_BLOCK_ELEMENTS // max(row_numel, 1))
    for block in range(start // block_rows, -(-stop // block_rows)):
        first, last = block * block_rows, min((block + 1) * block_rows, rows)
        lo, hi = max(start, first), min(stop, last)
        if lo >= hi:
            continue
        generator = torch.Generator().manual_seed((name_seed * 65_537 + block) % 2**63)
        values = torch.empty((last - first, *shape[1:])).normal_(0.0, std, generator=generator)
        out[lo - start:hi - start].copy_(values[lo - first:hi - first])
    return out
