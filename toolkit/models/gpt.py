"""One decoder-only transformer for every supported family, driven by `Config` fields only.

Single-device code: nothing here knows about Fabric, FSDP or precision plugins. Those are applied
from outside (`toolkit.parallel.fsdp`, `toolkit.training.fabric`).

Shapes: B batch, T tokens in this call, L cached tokens, E n_embd, H query heads, G key/value heads
(query groups), D head size, V vocabulary.
"""

from __future__ import annotations

import math
import zlib
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from toolkit.models import IGNORE_INDEX
from toolkit.models.config import Config



class GPT(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm_f = make_norm(config)
        self.lm_head = OutputHead(config.n_embd, config.vocab_size, bias=config.lm_head_bias)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rope = RotaryEmbedding(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        input_pos: Optional[int] = None,
        logits_to_keep: int = 0,
        document_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Logits (B, T, V); with `labels` (B, T), the summed cross-entropy over labelled tokens.

        The loss is a sum, not a mean, so that the training loop can normalise by the number of
        target tokens across micro-batches and ranks. `input_pos` is the position of the first
        token when a KV cache is in use (see `set_kv_cache`). `logits_to_keep` > 0: logits of the last
        that many positions only (B, logits_to_keep, V), as when a prompt fills the cache and only
        its last position predicts (the head over every position costs B * T * V).

        `document_ids` (B, T): packed rows (see `toolkit.data.instruct.PackedSamples`). Each run of
        equal ids in a row is one sample: its positions restart at 0 and its tokens attend only
        within it (see `document_segments`). Without it (or with one id per row) every row is one
        sequence, computed exactly as before.
        """
        B, T = input_ids.shape
        start = 0 if input_pos is None else input_pos
        if start + T > self.config.block_size:
            raise ValueError(f"Sequence of {start + T} tokens exceeds the context of {self.config.block_size}")
        x = self.embed(input_ids)  # (B, T, E)
        if self.config.scale_embeddings:
            x = x * torch.tensor(self.config.n_embd**0.5, dtype=x.dtype)
        cache = self.blocks[0].attn.kv_cache
        segments = None
        if document_ids is not None:
            if document_ids.shape != input_ids.shape:
                raise ValueError(f"document_ids {tuple(document_ids.shape)} must have the shape of input_ids {(B, T)}")
            if cache is not None:
                raise ValueError("document_ids (packed samples) are for training; clear the KV cache first")
            positions, segments = document_segments(document_ids)
            if all(len(row) == 1 for row in segments):
                segments = None  # one sample per row: the plain causal path
            cos, sin = self.rope.at(positions, x.device)  # (B, 1, T, rope_n_elem) each
        elif cache is not None and cache.left_padding is not None:
            # A row's first real token is at position 0 whatever padding precedes it (padding: 0)
            positions = torch.arange(start, start + T, device=x.device)[None] - cache.left_padding[:B, None]  # (B, T)
            cos, sin = self.rope.at(positions.clamp(min=0), x.device)  # (B, 1, T, rope_n_elem) each
        else:
            cos, sin = self.rope(start, T, x.device)  # (T, rope_n_elem) each, float32
        for block in self.blocks:
            x = block(x, cos, sin, input_pos, segments)
        x = self.norm_f(x)
        if labels is None:
            return self.lm_head(x[:, -logits_to_keep:] if logits_to_keep else x)
        return self.head_loss(x, labels)

    def head_loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy of `lm_head(x)` against `labels`, equal to `cross_entropy_sum(lm_head(x), labels)`.

        The toolkit's own head (`OutputHead`, also once FSDP has wrapped it) computes it fused,
        through its forward pass, so that hooks on the head (FSDP's gather) run. Anything else in
        its place (a peft LoRA layer, a quantized layer) takes the plain path.
        """
        head = self.lm_head
        if isinstance(head, OutputHead):
            return head(x, labels)
        return cross_entropy_sum(head(x), labels)

    # ------------------------------------------------------------------ KV cache
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
    `linear_cross_entropy_sum`, which never holds the whole (B * T, V) float32 logits; under
    torch.compile it runs eagerly, outside the graph. The loss is computed inside the head's
    forward pass so that whatever wraps the head as a module (FSDP gathers its weight in a hook
    before the call) sees the call.
    """

    def forward(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        if labels is None:
            return super().forward(x)
        if _compiling():
            return _outside_compile(linear_cross_entropy_sum)(x, self.weight, self.bias, labels)
        return linear_cross_entropy_sum(x, self.weight, self.bias, labels)


class Block(nn.Module):
    """One transformer layer. Sequential residual (Llama):

        x = x + attn(norm_1(x));  x = x + mlp(norm_2(x))

    Parallel residual (GPT-NeoX; Phi-2 with one shared norm):

        x = x + attn(norm_1(x)) + mlp(norm_2(x))
    """

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.norm_1 = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.norm_2 = None if config.shared_attention_norm else make_norm(config)
        self.mlp = make_mlp(config)
        self.parallel_residual = config.parallel_residual

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: Optional[int],
        segments: Optional[list[list[int]]] = None,
    ) -> torch.Tensor:
        h = self.norm_1(x)
        attn_out = self.attn(h, cos, sin, input_pos, segments)
        if self.parallel_residual:
            mlp_in = h if self.norm_2 is None else self.norm_2(x)
            return x + attn_out + self.mlp(mlp_in)
        x = x + attn_out
        return x + self.mlp(self.norm_2(x))


class CausalSelfAttention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        D, H, G, E = config.head_size, config.n_head, config.kv_heads, config.n_embd
        self.q_proj = nn.Linear(E, H * D, bias=config.attn_qkv_bias)
        self.k_proj = nn.Linear(E, G * D, bias=config.attn_qkv_bias)
        self.v_proj = nn.Linear(E, G * D, bias=config.attn_qkv_bias)
        self.o_proj = nn.Linear(H * D, E, bias=config.bias)
        self.n_head, self.n_kv, self.head_size = H, G, D
        self.rope_n_elem = config.rope_n_elem
        self.kv_cache: Optional[KVCache] = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: Optional[int],
        segments: Optional[list[list[int]]] = None,
    ) -> torch.Tensor:
        """`segments`: per row, the lengths of its packed samples (summing to T); each attends only to itself."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_size).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_size).transpose(1, 2)  # (B, G, T, D)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_size).transpose(1, 2)  # (B, G, T, D)
        q = apply_rope(q, cos, sin, self.rope_n_elem)
        k = apply_rope(k, cos, sin, self.rope_n_elem)

        if segments is not None:
            y = segment_attention(q, k, v, segments, self.n_kv != self.n_head)  # (B, H, T, D)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_size))
        mask = None
        # A branch, not `T > 1` itself: compiled with dynamic shapes that is a symbolic bool, which SDPA refuses.
        is_causal = True if T > 1 else False  # noqa: SIM210
        if self.kv_cache is not None:
            start = 0 if input_pos is None else input_pos
            k, v = self.kv_cache.update(start, k, v)  # (B, G, start + T, D)
            padding = self.kv_cache.left_padding
            if padding is not None:
                # query i (slot start + i) sees slots up to its own, except the row's padding; a
                # padding query sees itself only (a query that sees nothing would give NaN)
                key_pos = torch.arange(start + T, device=x.device)[None, None, :]  # (1, 1, S)
                query_pos = torch.arange(start, start + T, device=x.device)[None, :, None]  # (1, T, 1)
                real = key_pos >= padding[:B, None, None]  # (B, 1, S)
                mask = ((key_pos <= query_pos) & real | (key_pos == query_pos))[:, None]  # (B, 1, T, S)
                is_causal = False
            elif start > 0 and T > 1:
                # query i sits at position start + i and sees keys 0 .. start + i
                key_pos = torch.arange(start + T, device=x.device)
                query_pos = torch.arange(start, start + T, device=x.device)
                mask = key_pos[None, :] <= query_pos[:, None]  # (T, start + T)
                is_causal = False
            elif T == 1:
                is_causal = False  # one new token sees every cached key
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=self.n_kv != self.n_head
        )  # (B, H, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_size))


def document_segments(document_ids: torch.Tensor) -> tuple[torch.Tensor, list[list[int]]]:
    """Positions (B, T) restarting at 0 where a row's document id changes, and each row's run lengths.

    document_ids [[0, 0, 0, 1, 1, -1]] -> positions [[0, 1, 2, 0, 1, 0]], segments [[3, 2, 1]].
    The run lengths are host integers (one device sync per forward on a GPU, not one per layer).
    """
    B, T = document_ids.shape
    index = torch.arange(T, device=document_ids.device).expand(B, T)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.where(starts, index, 0).cummax(dim=1).values  # index of the token's segment start
    positions = index - first
    segments = []
    for row in starts.cpu():
        bounds = row.nonzero().squeeze(1).tolist() + [T]
        segments.append([b - a for a, b in zip(bounds, bounds[1:])])
    return positions, segments


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[list[int]], gqa: bool
) -> torch.Tensor:
    """Causal attention within each segment of each row: q (B, H, T, D), k and v (B, G, T, D) -> (B, H, T, D).

    One causal SDPA call per sample, the CPU form of a variable-length ("varlen") kernel: a sample
    of n tokens costs n^2 / 2, never the T^2 of a block-diagonal mask over the whole row.
    Measured on CPU (benchmarks/packing.py --attention, figures in benchmarks/README.md): at T=2048
    with 8 samples per row, one call per sample took 189 ms forward + backward, SDPA with a boolean
    block-diagonal mask 1320 ms, plain causal SDPA over the row 812 ms; flex_attention has no
    backward on CPU in torch 2.13. On a GPU a varlen kernel would replace this loop.
    """
    rows = []
    for b, lengths in enumerate(segments):
        qs, ks, vs = (t[b : b + 1].split(lengths, dim=2) for t in (q, k, v))
        parts = [
            F.scaled_dot_product_attention(qi, ki, vi, is_causal=qi.shape[2] > 1, enable_gqa=gqa)
            for qi, ki, vi in zip(qs, ks, vs)
        ]
        rows.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])
    return torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]


class KVCache(nn.Module):
    def __init__(self, batch_size: int, n_kv: int, max_len: int, head_size: int, device, dtype) -> None:
        super().__init__()
        shape = (batch_size, n_kv, max_len, head_size)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.left_padding: Optional[torch.Tensor] = None  # (batch_size,), see GPT.set_kv_cache

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache holds {self.k.shape[2]} positions; {end} requested")
        self.k[: k.shape[0], :, start:end] = k.to(self.k.dtype)
        self.v[: v.shape[0], :, start:end] = v.to(self.v.dtype)
        return self.k[: k.shape[0], :, :end], self.v[: v.shape[0], :, :end]


# ---------------------------------------------------------------------------- MLPs
class GeluMLP(nn.Module):
    """fc_out(gelu(fc_in(x))): GPT-NeoX, Phi-2."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.fc_in = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.fc_out = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)
        self.approximate = config.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x), approximate=self.approximate))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (Llama, Mistral, Qwen2) with silu, GeGLU (Gemma) with gelu."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.up_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)
        self.use_gelu = config.mlp == "geglu"
        self.approximate = config.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        gate = F.gelu(gate, approximate=self.approximate) if self.use_gelu else F.silu(gate)
        return self.down_proj(gate * self.up_proj(x))


def make_mlp(config: Config) -> nn.Module:
    return GeluMLP(config) if config.mlp == "gelu" else GatedMLP(config)


# ---------------------------------------------------------------------------- norms
class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32; with `unit_offset` the scale is (1 + weight)."""

    def __init__(self, size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps
        self.unit_offset = unit_offset
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight) if self.unit_offset else nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm computed in float32, returned in the input's dtype (as RMSNorm above).

    The input and the weights may differ in dtype: under FSDP with mixed precision a block's
    weights arrive in bfloat16 while the residual stream stays float32.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).to(x.dtype)


def make_norm(config: Config) -> nn.Module:
    if config.norm == "layernorm":
        return LayerNorm(config.n_embd, eps=config.norm_eps)
    return RMSNorm(config.n_embd, eps=config.norm_eps, unit_offset=config.norm_unit_offset)


# ---------------------------------------------------------------------------- rotary embedding
class RotaryEmbedding:
    """cos/sin tables for rotary position embedding, computed in float32 and cached per device.

    A plain object, not a module: the tables are derived from the config, so they are neither
    parameters nor checkpointed buffers, and meta-device or sharded initialisation never touches them.
    """

    def __init__(self, config: Config) -> None:
        self.dim = config.rope_n_elem
        self.base = config.rope_base
        self.scaling = config.rope_scaling
        self._cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def inverse_frequencies(self, device) -> torch.Tensor:
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.int64).float() / self.dim))
        if self.scaling is not None:
            inv_freq = llama3_scale_frequencies(inv_freq, **self.scaling)
        return inv_freq  # (dim / 2,)

    def __call__(self, start: int, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        device = torch.device(device)
        cos, sin = self._cache.get(device, (None, None))
        if cos is None or cos.shape[0] < start + length:
            n = max(start + length, 2 * (0 if cos is None else cos.shape[0]))
            positions = torch.arange(n, device=device, dtype=torch.int64).float()
            freqs = torch.outer(positions, self.inverse_frequencies(device))  # (n, dim / 2)
            emb = torch.cat((freqs, freqs), dim=-1)  # (n, dim): halves layout, as rotate_half expects
            cos, sin = emb.cos(), emb.sin()
            self._cache[device] = (cos, sin)
        return cos[start : start + length], sin[start : start + length]

    def at(self, positions: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (B, 1, T, dim) at the positions (B, T) of each row."""
        cos, sin = self(0, int(positions.max()) + 1, device)
        return cos[positions][:, None], sin[positions][:, None]


def llama3_scale_frequencies(
    inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float, original_max_seq_len: float
) -> torch.Tensor:
    """Llama-3.1 RoPE scaling: slow frequencies divided by `factor`, fast ones kept, a smooth ramp between."""
    low_freq_wavelen = original_max_seq_len / low_freq_factor
    high_freq_wavelen = original_max_seq_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_seq_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_elem: int) -> torch.Tensor:
    """Rotate the first `n_elem` dimensions of each head of x (B, heads, T, D); the rest pass through."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if n_elem == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, keep = x[..., :n_elem], x[..., n_elem:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, keep), dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# ---------------------------------------------------------------------------- loss and init
def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy in float32; labels equal to IGNORE_INDEX do not count."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


# The fused loss computes the logits of this many bytes of float32 rows at a time (at least one row).
LOSS_CHUNK_BYTES = 128 * 2**20


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    labels: torch.Tensor,
    chunk_rows: Optional[int] = None,
    skip_ignored: Optional[bool] = None,
) -> torch.Tensor:
    """`cross_entropy_sum(F.linear(hidden, weight, bias), labels)` without the full logits.

    hidden (..., E), weight (V, E), bias (V,) or None, labels (...). The rows are processed in
    chunks of `chunk_rows` (default: LOSS_CHUNK_BYTES of float32 logits). For each chunk the
    forward pass computes the logits, their float32 softmax, the loss, and at once the gradient
    of the loss with respect to `hidden`, `weight` and `bias` (softmax minus one-hot, pushed
    through the head). Only those gradients are kept for the backward pass, which scales them by
    the incoming gradient. Next to the plain computation this drops the (B * T, V) float32 logits,
    log-probabilities and their gradients from memory, and the same matrix products are done.
    Beside the kept gradients nothing of the head's size is made: the weight's 16-bit gradient is
    added up a piece of vocabulary rows at a time, and its scaled copy written chunk by chunk.

    Rows whose label is IGNORE_INDEX are left out before the head when `skip_ignored` (default: on
    CPU), so padding and masked prompts cost nothing; otherwise they are computed and weighted by 0,
    because finding them would make the host wait for the device.
    Under autocast the products run in the autocast dtype, as `nn.Linear` would; the softmax and
    the sums are float32.
    """
    E = hidden.shape[-1]
    hidden, labels = hidden.reshape(-1, E), labels.reshape(-1)
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type) and weight.is_floating_point():
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = weight.dtype
    if chunk_rows is None:
        chunk_rows = max(1, LOSS_CHUNK_BYTES // (4 * weight.shape[0]))
    if skip_ignored is None:
        skip_ignored = _host_cpu(hidden)
    # Under no_grad (validation) the Function still reports that its inputs require grad: ask here.
    want_grad = torch.is_grad_enabled()
    return _LinearCrossEntropySum.apply(hidden, weight, bias, labels, dtype, chunk_rows, skip_ignored, want_grad)


class _LinearCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, dtype, chunk_rows, skip_ignored, want_grad):
        n_rows, E = hidden.shape
        need_h, need_w = want_grad and ctx.needs_input_grad[0], want_grad and ctx.needs_input_grad[1]
        need_b = want_grad and bias is not None and ctx.needs_input_grad[2]
        need_grad = need_h or need_w or need_b
        device = hidden.device
        rows = mask = None
        valid = labels != IGNORE_INDEX
        if skip_ignored:
            rows = valid.nonzero().squeeze(1)
            if rows.numel() == n_rows:
                rows = None
        else:
            mask = valid
        with torch.autocast(device.type, enabled=False):
            h = hidden if rows is None else hidden.index_select(0, rows)
            y = labels if rows is None else labels.index_select(0, rows)
            if mask is not None:
                y = y.masked_fill(~mask, 0)  # any valid class: these rows are weighted by 0 below
            h, w = h.to(dtype), weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
            n = h.shape[0]
            loss = torch.zeros((), dtype=torch.float32, device=device)
            grad_h = torch.empty((n, E), dtype=dtype, device=device) if need_h else None
            grad_w = None
            if need_w:  # the first chunk writes it (no zero-fill), unless there is no chunk at all
                grad_w = (torch.empty if n else torch.zeros)(weight.shape, dtype=torch.float32, device=device)
            grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=device) if need_b else None
            if n:  # equal chunks: a small last chunk would stream the whole weight for a few rows
                chunk_rows = math.ceil(n / math.ceil(n / chunk_rows))
            vocab_rows = max(1, LOSS_CHUNK_BYTES // (4 * E))
            # One logits buffer and one float32 probabilities buffer serve every chunk (on CPU,
            # every call: see _scratch). On CPU softmax writes over its input (each row is read
            # before it is written); a 16-bit chunk is widened by a copy first, because the CPU's
            # softmax with a dtype conversion is 5x slower than a copy and an in-place softmax.
            shape = (min(chunk_rows, n), w.shape[0])
            on_host = device.type == "cpu"
            in_place = dtype == torch.float32 and on_host
            logits_buf = _scratch(shape, dtype, device, 0)
            probs_buf = logits_buf if in_place else _scratch(shape, torch.float32, device, 1)
            for start in range(0, n, chunk_rows):
                end = min(start + chunk_rows, n)
                hc, yc = h[start:end], y[start:end]
                logits = logits_buf[: end - start]
                if b is None:
                    torch.mm(hc, w.t(), out=logits)
                else:
                    torch.addmm(b, hc, w.t(), out=logits)
                # log p(label) = (x_label - x_max) - log(sum_j exp(x_j - x_max)), and the largest
                # logit's probability is exp(0) / sum: the sum comes out of the softmax, so no
                # log-softmax pass is needed beside it (that probability is at least 1/V: it never
                # underflows).
                top = logits.amax(1, keepdim=True)  # (rows, 1)
                shift = (logits.gather(1, yc.unsqueeze(1)).float() - top.float()).squeeze(1)
                probs = probs_buf[: end - start]
                if in_place:
                    torch.softmax(logits, dim=1, out=probs)
                elif on_host:
                    torch.softmax(probs.copy_(logits), dim=1, out=probs)
                else:
                    torch.softmax(logits, dim=1, dtype=torch.float32, out=probs)
                picked = shift + probs.amax(1).log()  # log-probability of each label
                if mask is not None:
                    loss -= (picked * mask[start:end]).sum()
                else:
                    loss -= picked.sum()
                if not need_grad:
                    continue
                grad = probs  # d(loss)/d(logits) = softmax - one_hot(label)
                grad.scatter_add_(1, yc.unsqueeze(1), grad.new_full((end - start, 1), -1.0))
                if mask is not None:
                    grad.mul_(mask[start:end].unsqueeze(1))
                if need_b:
                    grad_b += grad.sum(0)
                if dtype != torch.float32:
                    grad = _scratch(shape, dtype, device, 2)[: end - start].copy_(grad)
                if need_h:
                    torch.mm(grad, w, out=grad_h[start:end])
                if need_w:
                    if dtype != torch.float32:
                        # The 16-bit product (V, E) is added to the float32 gradient a piece of
                        # vocabulary rows at a time (as many elements as a chunk of logits): whole,
                        # it would be a second copy of the head beside grad_w (1 GB for Llama-3).
                        # (One expression: a named product would stay alive beside the next one.)
                        for v in range(0, grad_w.shape[0], vocab_rows):
                            piece = slice(v, v + vocab_rows)
                            (grad_w[piece].add_ if start else grad_w[piece].copy_)(grad[:, piece].t() @ hc)
                    elif start:
                        grad_w.addmm_(grad.t(), hc)
                    else:
                        torch.mm(grad.t(), hc, out=grad_w)
        ctx.n_rows, ctx.dtypes = n_rows, (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(grad_h, grad_w, grad_b, rows)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if getattr(ctx, "done", False):  # the kept float32 gradients were scaled in place (below)
            raise RuntimeError("The fused loss's backward pass runs once per forward pass (no retain_graph).")
        ctx.done = True
        grad_h, grad_w, grad_b, rows = ctx.saved_tensors
        h_dtype, w_dtype, b_dtype = ctx.dtypes
        d_hidden = d_weight = d_bias = None
        if grad_h is not None:
            d_hidden = (grad_h * grad_loss).to(h_dtype)
            if rows is not None:
                d_hidden = d_hidden.new_zeros((ctx.n_rows, d_hidden.shape[1])).index_copy_(0, rows, d_hidden)
        # A float32 weight's (and bias's) kept gradient is scaled where it is and handed on: a
        # scaled copy beside it was a second V x E float32 matrix at the peak of a float32 step
        # (the head gathered, its kept gradient and the copy). Nothing else holds it: the forward
        # pass saved it for this backward pass only.
        if grad_w is not None:
            d_weight = grad_w.mul_(grad_loss) if w_dtype == torch.float32 else _scaled(grad_w, grad_loss, w_dtype)
        if grad_b is not None:
            d_bias = grad_b.mul_(grad_loss) if b_dtype == torch.float32 else _scaled(grad_b, grad_loss, b_dtype)
        return d_hidden, d_weight, d_bias, None, None, None, None, None


def _scaled(grad: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`(grad * scale).to(dtype)` for a float32 gradient kept by the forward pass, written into
    `dtype` LOSS_CHUNK_BYTES of rows at a time.

    Unchunked, the float32 product lives beside the saved gradient and the result: for the head's
    weight (V, E) gathered in 16 bits, a second float32 V x E matrix at the peak of the step (2 GB
    for Llama-3's head). `torch.mul(..., out=)` rounds the float32 product once into `dtype`, as
    `.to` does; CUDA casts as it writes, the CPU through a temporary of one chunk.
    """
    out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
    row_bytes = grad[0].numel() * 4 if grad.dim() > 1 else 4
    rows = max(1, LOSS_CHUNK_BYTES // row_bytes)
    for start in range(0, grad.shape[0], rows):
        torch.mul(grad[start : start + rows], scale, out=out[start : start + rows])
    return out


_SCRATCH: dict = {}
# False: CPU steps allocate the loss's buffers at every call, as on a GPU (tests/scripts/simulate_real.py,
# which compares a real CPU step with the simulated GPU one, turns the reuse off).
REUSE_CPU_SCRATCH = True


def _scratch(shape: tuple[int, int], dtype: torch.dtype, device: torch.device, slot: int) -> torch.Tensor:
    """A reusable (rows, V) buffer for the fused loss's logits.

    On CPU a fresh buffer of this size (hundreds of MB) is memory-mapped anew at every call, and
    writing it first costs a page fault per 4 KiB (~40% of the time of the matrix product that fills
    it), so the largest buffer asked for is kept and reused (one per dtype and slot, at most
    LOSS_CHUNK_BYTES each). CUDA's caching allocator already reuses memory: other devices allocate.
    """
    numel = shape[0] * shape[1]
    if device.type != "cpu" or _faking() or not REUSE_CPU_SCRATCH:
        return torch.empty(shape, dtype=dtype, device=device)
    key = (dtype, slot)
    buffer = _SCRATCH.get(key)
    if buffer is None or buffer.numel() < numel:
        _SCRATCH.pop(key, None)
        buffer = _SCRATCH[key] = torch.empty(numel, dtype=dtype)
    return buffer[:numel].view(shape)


def _faking() -> bool:
    """True under a FakeTensorMode (`toolkit.simulate`): tensors have shapes but no values."""
    from torch._guards import active_fake_mode

    return active_fake_mode() is not None


def _host_cpu(tensor: torch.Tensor) -> bool:
    """A real CPU tensor. Fake tensors (`toolkit.simulate`) take the GPU path: finding ignored rows
    needs values, and keeping scratch buffers between calls would keep fake tensors alive."""
    return tensor.device.type == "cpu" and not _faking()


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
    grow with depth. Biases start at zero, norms at identity.
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
    return specs


def initial_value(
    spec: tuple[str, float], shape: tuple[int, ...], seed: int, name: str, start: int = 0, stop: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Rows [start, stop) (dim 0) of the initial value of parameter `name` (see `init_specs`).

    Returned as a new float32 CPU tensor, or written into `out` (same shape, any dtype and device)
    and `out` returned. Random values are drawn in blocks of whole rows (about INIT_BLOCK_ELEMENTS
    values each), each block from its own generator seeded by `seed`, the name and the block's
    index. A rank that owns a few rows of a weight draws only the blocks that cover them, never the
    full tensor, and gets the values any other sharding would give those rows.
    """
    kind, std = spec
    rows = shape[0] if shape else 1
    stop = rows if stop is None else min(stop, rows)
    part_shape = (max(stop - start, 0), *shape[1:]) if shape else ()
    if out is None:
        out = torch.empty(part_shape)
    if kind in ("zeros", "ones"):
        return out.fill_(0.0 if kind == "zeros" else 1.0)
    flat_rows = out.view(-1, *shape[1:]) if shape else out.view(1)  # () -> (1,) for the one value
    row_numel = math.prod(shape[1:]) if shape else 1
    block_rows = max(1, INIT_BLOCK_ELEMENTS // max(row_numel, 1))
    name_seed = seed * 1_000_003 + zlib.crc32(name.encode())
    for block in range(start // block_rows, -(-stop // block_rows)):
        first, last = block * block_rows, min((block + 1) * block_rows, rows)
        lo, hi = max(start, first), min(stop, last)
        if lo >= hi:
            continue
        generator = torch.Generator().manual_seed((name_seed * 65_537 + block) % 2**63)
        values = torch.empty((last - first, *shape[1:])).normal_(0.0, std, generator=generator)
        flat_rows[lo - start:hi - start].copy_(values[lo - first:hi - first])
    return out