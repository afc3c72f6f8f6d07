"""`toolkit estimate`: how much memory one device needs to train a model, before you start.

The estimate is arithmetic on the model config; nothing is allocated and torch is not imported.
For every strategy it splits the memory of one device into:

    parameters        the (sharded) stored weights, in the dtypes of the precision policy
    gradients         one gradient per trainable weight, in the trainable dtype (under FSDP, a shard)
    optimizer state   AdamW: exp_avg and exp_avg_sq per trainable weight, in the trainable dtype
    activations       what autograd saves in the forward pass for the backward pass, derived op by op
                      from `toolkit.models.gpt` (see `_Tracer`), with and without checkpointing
    logits and loss   the head and the loss. A plain head takes the fused loss
                      (`linear_cross_entropy_sum`): it keeps the loss's gradients with respect to the
                      head's input (tokens x E, compute dtype) and trainable weight and bias (float32),
                      and holds its input and one chunk of logits (at most LOSS_CHUNK_BYTES of float32
                      rows, with their float32 softmax, and under 16-bit compute on CUDA a float32
                      copy that softmax makes, a 16-bit softmax and a piece of the 16-bit weight
                      gradient) in the forward pass, or the outgoing gradients in the backward pass
                      (in the dtypes of the head's input and weight). A LoRA head takes the plain
                      loss: the float32 log-softmax it keeps, plus the two (tokens x vocab) float32
                      gradients its backward creates
    weight copies     bf16 copies of float32 weights that autocast makes, whole (not shards): on
                      one device and with DDP, of every linear weight that trains; none under FSDP,
                      which gathers every weight in the compute dtype
    buffers           FSDP's gathered (unsharded) weights, all-gather outputs, unsharded gradients
                      and reduce-scatter inputs; DDP's gradient buckets; a quantized base's
                      dequantized weight (bitsandbytes, torchao NF4): the most of them alive at one
                      moment, and the dequantized weight
    step scratch      AdamW (foreach, the default on GPUs) makes one temporary as large as one state

These do not all exist at once. The peak is parameters + gradients + optimizer state + the largest
of what is alive besides them at the moments of a step at which it can peak (`step_moments`, by
category): FSDP gathering the embedding, block 0 and the last block in the forward pass; the loss
in the forward pass (every activation, the loss's chunk buffers, every weight copy: autocast caches
them until the forward pass ends); the loss's backward pass; the head's gradient reduced; a block's
backward pass (the widest activation gradients in flight, `_Tracer.mlp`; a quantized base's
dequantized weight while a block computes); the embedding's (or a tied root's) gradient reduced;
and AdamW's step. Gradients are counted throughout because with gradient accumulation they are
alive through every micro-batch (without it they grow while activations shrink, so this is an
upper bound). Under FSDP the moments follow torch 2.13's
`fully_shard` (`fsdp_moments`); the simulation (`toolkit.simulate`, tests/test_simulate.py) runs
the real step and holds them to it category by category.

What is assumed, and where it comes from:
- Precision: the toolkit's one policy (`toolkit.parallel.precision.precision_dtypes`). Under
  "*-mixed" and "32-true", trainable weights, their gradients and AdamW state are float32 and frozen
  weights (the LoRA and QLoRA base) are stored in the compute dtype (bf16 under "bf16-mixed");
  under "*-true" everything is 16-bit. "*-mixed" computes under autocast in 16 bits. On one
  device and with DDP weights are used as they are stored, so autocast copies every float32 weight
  a linear layer uses; under FSDP every unit (each block, the embedding, the final norm, the head)
  casts its float32 shards to the compute dtype before the all-gather (its gradients come out
  16-bit and are reduced in float32), and the embedding's output is cast back to its stored dtype
  (`Options.gathered_bytes`). The residual stream stays float32. AdamW's `step` counters (one 0-dim
  float32 tensor per parameter) live on the CPU and are not counted.
- Attention runs in a fused kernel (flash or memory-efficient SDPA, as on GPUs and in torch's CPU
  flash kernel): it keeps the output and a float32 log-sum-exp per query, never the T x T matrix.
  The math fallback (used with explicit masks; possibly also for float32 with grouped-query
  attention on GPUs, where no fused kernel takes both) would add B x heads x T x T per layer.
- Autocast rules are CUDA's: linear layers and SDPA run in 16 bits; the loss runs in float32, and
  the model's norms compute in float32 themselves (`norms.LayerNorm`, `norms.RMSNorm`). Each linear layer casts its float32 input separately (casts of activations are not
  cached); weight casts are cached for the whole forward pass.
- LoRA (peft, as `toolkit finetune_lora` applies it): only the adapters train (float32 under
  "*-mixed"); the frozen base is 16-bit, so autocast has nothing to copy but the adapters (under
  FSDP nothing: the adapters are gathered in 16 bits). A frozen
  linear layer does not keep its input. Adapter dropout (finetune_lora's default 0.05) keeps a
  one-byte mask per input element. Frozen parameters have no gradient, under FSDP too.
- QLoRA (bitsandbytes): the linear layers of the blocks are quantized (embedding, norms and head are
  not, and are stored in the compute dtype): 4-bit = half a byte per weight + a float32 absmax per
  64 weights (double quantization: one byte per 64, plus a float32 per 256 of those); int8 = one
  byte per weight + a float32 scale per row. No LoRA head, as in finetune_lora. On more than one
  device finetune_lora replicates a bitsandbytes base and synchronises only the adapters with DDP
  (`toolkit.parallel.plan.plan_quantized_base`), so that is the one column shown: the whole
  quantized base on every device, and DDP's bucket copy of the adapters' gradients.
- QLoRA with torchao's NF4 (`--quantize nf4`, `toolkit.training.nf4`): half a byte per weight, an
  int8 scale per 64 and a 16-bit factor per 16384, a 16-bit mean per weight. On more than one
  device FSDP2 shards it like every frozen weight (the FSDP columns): each rank stores the NF4
  bytes of its own rows (no padding: finetune_lora refuses shapes that do not split into whole
  groups of 16384 values, and so does the estimate), and gathers a block's NF4 bytes, not 16-bit
  weights, for its forward and backward passes. `linear_nf4` keeps no input; it dequantizes the
  whole weight in every forward and backward call, with torchao's unfused ops: two int64 code
  tensors and three tensors of the compute dtype, all of the weight's size, alive at once
  (`nf4_dequant_bytes`, measured in tests/test_estimate.py), one weight at a time.
- CPU offload (`--distributed.cpu_offload`, FSDP columns only, as training): the sharded
  parameters, their gradients and AdamW state live in host memory (counted apart, `host_offload`;
  the optimizer step runs on the CPU); the device holds what a step gathers and computes.
- FSDP (torch 2.13 FSDP2 `fully_shard`, one unit per Block, one each for the embedding, the final
  norm and the head (a tied embedding and head stay in the root), on the mesh of `toolkit.parallel.plan.mesh_layout`): every parameter is
  split along dim 0 and each rank's shard is padded to ceil(rows / shard group) rows; a gradient
  shard is as large (a view into the unit's padded reduce-scatter output) and exists only for
  trainable parameters; AdamW's state follows the unpadded local shard. Gradients accumulate in
  the shards (reduce-scatter every micro-batch; HYBRID_SHARD's cross-node all-reduce waits for the
  last one in a buffer of the same size). What FSDP holds beside the shards, and when, is in
  `fsdp_moments`. Transient buffers are counted in the order the step runs them (gloo, on CPU,
  stages each all-gather once more); on GPUs the caching allocator and communication streams add
  some on top.
- DDP keeps a second copy of the gradients in its communication buckets.
- The loss (`GPT.head_loss`): a plain `nn.Linear` head goes through the fused
  `linear_cross_entropy_sum`, which computes the loss's gradients in the forward pass in chunks and
  keeps only them (no autocast weight copy of the head). Every label is assumed to count: on CPU,
  ignored rows would be skipped (and their indices kept); on GPUs they are computed and weighted
  by 0. On CPU the chunk buffers are kept between calls (module-level scratch); on GPUs (and on
  fake tensors) they are freed after the forward pass. A LoRA head (target "head") takes the plain
  cross_entropy_sum.
- Whose rules (`Options.device`): CUDA's by default; the tests use the CPU's ("cpu", real runs) and
  those of fake tensors on the CPU ("fake", `toolkit.simulate`). They differ in what dropout keeps
  (a one-byte mask on CUDA, a scaled copy on CPU), in the float32 copy softmax makes of 16-bit
  logits (CUDA only: on CPU the loss widens them into its own float32 buffer), in the
  loss's buffers kept between calls (real CPU runs) and in gloo's staging of all-gathers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional, get_args

from toolkit.errors import UserError, check_choice
from toolkit.models import LOSS_CHUNK_BYTES
from toolkit.models.config import CONFIG_FILENAME, Config
from toolkit.args import QUANTIZE_CHOICES, QuantizeName, ShardingName, StrategyName

GiB = 1024**3

# LoRA target name -> the linear layers (last name component) it adapts
LORA_TARGETS: dict[str, tuple[str, ...]] = {
    "query": ("q_proj",),
    "key": ("k_proj",),
    "value": ("v_proj",),
    "projection": ("o_proj",),
    "mlp": ("fc_in", "fc_out", "gate_proj", "up_proj", "down_proj"),
    "head": ("lm_head",),
}
# Strategy columns, cheapest communication first: the order the recommendation tries them in.
COLUMN_ORDER = ("single", "DDP", "NO_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "FULL_SHARD")


# --------------------------------------------------------------------------------------------
# The parameters, module by module
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor of the model as built (after LoRA injection), in registration order."""

    name: str  # as in GPT.named_parameters() (peft's wrapping included)
    shape: tuple[int, ...]
    unit: int  # FSDP unit: the block index, or -1 for the root (embedding, final norm, head)
    trainable: bool
    kind: Literal["embedding", "linear", "bias", "norm", "lora"]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def parameter_specs(
    config: Config, lora_modules: tuple[str, ...] = (), lora_r: int = 8, trainable: bool = True
) -> list[ParamSpec]:
    """Every parameter of `GPT(config)`, in the order `named_parameters()` yields them.

    `lora_modules` names the linear layers (q_proj, lm_head, ...) that peft wraps with adapters;
    with adapters, only they are trainable. A tied head is the embedding itself and is not repeated.
    """
    lora = bool(lora_modules)
    specs: list[ParamSpec] = []

    def add(name: str, shape: tuple[int, ...], unit: int, kind: str) -> None:
        specs.append(ParamSpec(name, shape, unit, trainable and not lora, kind))  # type: ignore[arg-type]

    def linear(prefix: str, n_in: int, n_out: int, bias: bool, unit: int) -> None:
        leaf = prefix.rsplit(".", 1)[-1]
        if leaf in lora_modules:
            # peft's lora.Linear: base_layer first, then the adapters (no bias on the adapters)
            add(f"{prefix}.base_layer.weight", (n_out, n_in), unit, "linear")
            if bias:
                add(f"{prefix}.base_layer.bias", (n_out,), unit, "bias")
            specs.append(ParamSpec(f"{prefix}.lora_A.default.weight", (lora_r, n_in), unit, trainable, "lora"))
            specs.append(ParamSpec(f"{prefix}.lora_B.default.weight", (n_out, lora_r), unit, trainable, "lora"))
        else:
            add(f"{prefix}.weight", (n_out, n_in), unit, "linear")
            if bias:
                add(f"{prefix}.bias", (n_out,), unit, "bias")

    def norm(prefix: str, unit: int) -> None:
        add(f"{prefix}.weight", (config.n_embd,), unit, "norm")
        if config.norm == "layernorm":
            add(f"{prefix}.bias", (config.n_embd,), unit, "norm")

    c = config
    E, D, H, G, F = c.n_embd, c.head_size, c.n_head, c.kv_heads, c.intermediate_size
    add("embed.weight", (c.vocab_size, E), -1, "embedding")
    for i in range(c.n_layer):
        p = f"blocks.{i}"
        norm(f"{p}.norm_1", i)
        linear(f"{p}.attn.q_proj", E, H * D, c.attn_qkv_bias, i)
        linear(f"{p}.attn.k_proj", E, G * D, c.attn_qkv_bias, i)
        linear(f"{p}.attn.v_proj", E, G * D, c.attn_qkv_bias, i)
        linear(f"{p}.attn.o_proj", H * D, E, c.bias, i)
        if not c.shared_attention_norm:
            norm(f"{p}.norm_2", i)
        if c.mlp == "gelu":
            linear(f"{p}.mlp.fc_in", E, F, c.bias, i)
            linear(f"{p}.mlp.fc_out", F, E, c.bias, i)
        else:
            linear(f"{p}.mlp.gate_proj", E, F, c.bias, i)
            linear(f"{p}.mlp.up_proj", E, F, c.bias, i)
            linear(f"{p}.mlp.down_proj", F, E, c.bias, i)
    norm("norm_f", -1)
    if c.tie_embeddings and "lm_head" not in lora_modules:
        if c.lm_head_bias:
            add("lm_head.bias", (c.vocab_size,), -1, "bias")
    elif c.tie_embeddings:
        # peft wraps the head; its base weight is still the embedding (not repeated)
        specs.append(ParamSpec("lm_head.lora_A.default.weight", (lora_r, E), -1, trainable, "lora"))
        specs.append(ParamSpec("lm_head.lora_B.default.weight", (c.vocab_size, lora_r), -1, trainable, "lora"))
        if c.lm_head_bias:
            specs.insert(-2, ParamSpec("lm_head.base_layer.bias", (c.vocab_size,), -1, False, "bias"))
    else:
        linear("lm_head", E, c.vocab_size, c.lm_head_bias, -1)
    return specs


def quantized_bytes(shape: tuple[int, ...], quantize: str) -> int:
    """Bytes stored for one quantized weight of `shape` (data + quantization state): bitsandbytes'
    layouts for "bnb.*", torchao's NF4Tensor for "nf4" (two 4-bit values per byte, one int8 scale
    per block of 64, one bfloat16 factor per 256 of those scales, a 2-byte mean: about 0.516 bytes
    per weight, toolkit.training.nf4)."""
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


def quantized_names(opts: "Options", specs: list["ParamSpec"]) -> set[str]:
    """The parameters stored quantized: the linear weights of the blocks (not embedding, norms, head)."""
    return {s.name for s in specs if opts.quantize and s.kind == "linear" and s.unit >= 0}


def nf4_unshardable(config: Config, shards: int) -> Optional[str]:
    """The first block linear weight (toolkit name, shape) that does not split into `shards` row
    ranges of whole NF4 groups (`toolkit.training.nf4.check_nf4_shardable`'s rule), or None."""
    from toolkit.training.nf4 import ROW_ALIGN  # no torch import

    for s in parameter_specs(config):
        if s.kind == "linear" and s.unit >= 0:
            out, inp = s.shape
            if out % shards or (out // shards) * inp % ROW_ALIGN:
                return f"{s.name.removesuffix('.weight')} ({out} x {inp})"
    return None


# --------------------------------------------------------------------------------------------
# Activations: a symbolic walk through GPT.forward that tracks what autograd saves
# --------------------------------------------------------------------------------------------


@dataclass
class _T:
    """A tensor in the walk: its element count, bytes per element, and whether it requires grad."""

    numel: int
    b: int  # bytes per element
    rg: bool
    id: int = 0


@dataclass(frozen=True)
class _Weight:
    """How a weight looks to the forward pass."""

    b: int  # bytes per element as the forward pass sees it (as stored, or as FSDP gathers it: `Options.gathered_bytes`)
    trainable: bool
    numel: int
    quant: Optional[str] = None  # bitsandbytes kind for quantized linear weights
    key: str = ""  # identifies the tensor (a tied head and the embedding share one)
    stored: int = 0  # bytes per element as stored (0: b); the embedding's output is in this dtype


@dataclass(frozen=True)
class Mode:
    """The precision rules of the forward pass."""

    autocast: bool  # *-mixed: matmuls in 16 bits under torch.autocast
    compute: int  # bytes of the compute dtype
    device: Literal["cuda", "cpu", "fake"] = "cuda"  # whose rules: see `Options.device`
    lora_dropout: bool = False  # adapters apply dropout to their input
    float16: bool = False  # the 16-bit compute dtype is float16 (not bfloat16)

    @property
    def cuda(self) -> bool:
        """CUDA's kernels (dropout keeps a bool mask); else the CPU's, fake tensors included."""
        return self.device == "cuda"

    @property
    def real_cpu(self) -> bool:
        """Real CPU tensors: the fused loss keeps its chunk buffers between calls
        (`toolkit.models.loss._scratch`), and a cast on writing goes through a temporary."""
        return self.device == "cpu"


class _Tracer:
    """Follows `GPT.forward` op by op and records each tensor autograd saves (deduplicated).

    Each op below mirrors one line of the model (toolkit/models/gpt.py and its layers) and saves
    exactly what the op's backward formula needs: e.g. `a * b` keeps `b` only if `a` requires grad;
    a linear layer keeps its input only if its weight trains; SDPA keeps q, k, v, the output and a
    float32 log-sum-exp.
    """

    def __init__(
        self, config: Config, mode: Mode, weights: dict[str, _Weight], lora: dict[str, tuple[_Weight, _Weight]],
        B: int, T: int,
    ) -> None:  # fmt: skip
        self.c, self.mode, self.w, self.lora = config, mode, weights, lora
        self.B, self.T, self.n = B, T, B * T
        self.saved: dict[int, int] = {}
        self.weight_copies: dict[str, int] = {}
        self.dequant_scratch = 0
        self._ids = 0
        self._rope_cache: Optional[tuple[_T, _T]] = None
        # Gradients in flight in a block's backward pass, beyond what it saved (see `mlp`).
        self.backward_in_flight = 0

    def new(self, numel: int, b: int, rg: bool) -> _T:
        self._ids += 1
        return _T(numel, b, rg, self._ids)

    def save(self, t: _T) -> None:
        self.saved[t.id] = t.numel * t.b

    def saved_bytes(self) -> int:
        return sum(self.saved.values())

    # ------------------------------------------------------------------ ops
    def cast(self, x: _T, b: int) -> _T:
        """x.to(dtype): the same tensor when the dtype matches; saves nothing."""
        return x if x.b == b else self.new(x.numel, b, x.rg)

    def linear(self, x: _T, name: str, n_out: int) -> _T:
        w = self.w[f"{name}.weight"]
        n_in = x.numel // self.n
        adapters = self.lora.get(name)
        ac = self.mode.autocast
        if w.quant == "nf4":
            # torchao's LinearNF4 keeps only its NF4 weight; it dequantizes the whole weight to the
            # input's dtype (`nf4_dequant_bytes`) and computes in 16 bits under autocast.
            self.dequant_scratch = max(self.dequant_scratch, nf4_dequant_bytes(w.numel, self.mode.compute))
            out_b = 2 if ac else x.b
        elif w.quant == "bnb.int8":
            if x.rg:
                self.save(x)  # MatMul8bitLt keeps its input
            self.dequant_scratch = max(self.dequant_scratch, w.numel * self.mode.compute)
            out_b = x.b
        elif w.quant:
            self.cast(x, self.mode.compute)  # Linear4bit casts to its compute dtype; MatMul4Bit keeps no input
            self.dequant_scratch = max(self.dequant_scratch, w.numel * self.mode.compute)
            out_b = x.b
        else:
            xc = self.cast(x, 2) if ac else x  # autocast casts each call's input anew
            if ac and w.b != 2 and x.rg:
                self.weight_copies[w.key] = w.numel * 2  # cached cast, kept by the graph for x's gradient
            if w.trainable:
                self.save(xc)
            out_b = 2 if ac else max(x.b, w.b)
        out = self.new(self.n * n_out, out_b, x.rg or w.trainable or adapters is not None)
        if adapters is not None:
            a_w, b_w = adapters
            xl = self.cast(x, a_w.b)  # peft casts the input to the adapter's dtype
            if self.mode.lora_dropout:
                if xl.rg:  # dropout keeps its mask: bool on CUDA; the CPU kernel keeps a scaled copy
                    self.save(self.new(xl.numel, 1 if self.mode.cuda else xl.b, False))
                xl = self.new(xl.numel, xl.b, xl.rg)
            xla = self.cast(xl, 2) if ac else xl
            if ac and a_w.b != 2 and xla.rg:
                self.weight_copies[a_w.key] = a_w.numel * 2
            if ac and b_w.b != 2:
                self.weight_copies[b_w.key] = b_w.numel * 2  # lora_A's output always needs a gradient
            self.save(xla)  # lora_A's weight gradient needs its input
            r = a_w.numel // n_in
            a = self.new(self.n * r, 2 if ac else a_w.b, True)
            self.save(a)  # lora_B's weight gradient needs its input
        return out

    def norm(self, x: _T, prefix: str) -> _T:
        c, n, E = self.c, self.n, self.c.n_embd
        w = self.w[f"{prefix}.weight"]
        if c.norm == "layernorm":
            # norms.LayerNorm: F.layer_norm(x.float(), weight.float(), bias.float()), returned in x's dtype
            xf = self.cast(x, 4)
            rg = xf.rg or w.trainable
            if rg:
                self.save(xf)
                self.save(self.new(2 * n, 4, False))  # mean and rstd
                for p in (w, self.w.get(f"{prefix}.bias")):  # the float32 weight and bias (copies if 16-bit)
                    if p is not None and p.b != 4:
                        self.save(self.new(p.numel, 4, False))
            return self.cast(self.new(n * E, 4, rg), x.b)
        # RMSNorm: x.float(); x * rsqrt(mean(x^2) + eps); then the weight
        xf = self.cast(x, 4)
        if xf.rg:
            self.save(xf)  # pow and the multiplication by rsqrt keep it
            self.save(self.new(n, 4, True))  # rsqrt's result, kept by its backward and the product
        y = self.new(n * E, 4, xf.rg)
        if c.norm_unit_offset:
            if w.trainable:
                self.save(y)  # y * (1 + weight): the weight's gradient needs y
            if y.rg:
                self.save(self.new(E, 4, False))  # and y's gradient needs (1 + weight) in float32
            return self.cast(self.new(n * E, 4, y.rg or w.trainable), x.b)
        y = self.cast(y, x.b)
        if w.trainable:
            self.save(y)  # weight * y
        return self.new(n * E, max(w.b, x.b), y.rg or w.trainable)

    def rope(self, x: _T) -> _T:
        """apply_rope: multiplications by cos/sin keep cos/sin (cast to x's dtype) only."""
        rope = self.T * self.c.rope_n_elem
        if x.rg:
            if x.b == 4:  # float32: the shared cos/sin tables themselves, once for the model
                if self._rope_cache is None:
                    self._rope_cache = (self.new(rope, 4, False), self.new(rope, 4, False))
                    for t in self._rope_cache:
                        self.save(t)
            else:  # each call casts cos and sin to x's dtype
                self.save(self.new(rope, x.b, False))
                self.save(self.new(rope, x.b, False))
        return self.new(x.numel, x.b, x.rg)

    def attention(self, h: _T, prefix: str) -> _T:
        c, n = self.c, self.n
        D, H, G = c.head_size, c.n_head, c.kv_heads
        q = self.rope(self.linear(h, f"{prefix}.q_proj", H * D))
        k = self.rope(self.linear(h, f"{prefix}.k_proj", G * D))
        v = self.linear(h, f"{prefix}.v_proj", G * D)
        if self.mode.autocast:  # SDPA runs in 16 bits: float32 inputs (QLoRA layers' outputs) are cast
            q, k, v = (self.cast(t, 2) for t in (q, k, v))
        rg = q.rg or k.rg or v.rg
        y = self.new(n * H * D, q.b, rg)
        if rg:
            for t in (q, k, v, y):
                self.save(t)
            self.save(self.new(n * H, 4, False))  # log-sum-exp per query and head
        # SDPA lays its output out like q. With full rotary, q keeps q_proj's (B, T, H, D) layout and
        # y.transpose(1, 2).reshape() is a view; partial rotary builds q with torch.cat in (B, H, T, D)
        # layout, so the reshape copies.
        if c.rope_n_elem < D:
            y = self.new(y.numel, y.b, y.rg)
        return self.linear(y, f"{prefix}.o_proj", c.n_embd)

    def mlp(self, h: _T, prefix: str) -> _T:
        """The MLP; also the widest gradients of the backward pass: beside the incoming gradient
        (tokens x n_embd), the gated product's two gradients (gelu: the input gradient beside the
        output gradient), each tokens x intermediate_size."""
        c = self.c
        if c.mlp == "gelu":
            a = self.linear(h, f"{prefix}.fc_in", c.intermediate_size)
            if a.rg:
                self.save(a)  # gelu keeps its input
            out = self.linear(self.new(a.numel, a.b, a.rg), f"{prefix}.fc_out", c.n_embd)
            widest = a.numel * a.b if a.rg else 0
        else:
            gate = self.linear(h, f"{prefix}.gate_proj", c.intermediate_size)
            if gate.rg:
                self.save(gate)  # silu / gelu keeps its input
            act = self.new(gate.numel, gate.b, gate.rg)
            up = self.linear(h, f"{prefix}.up_proj", c.intermediate_size)
            if up.rg:
                self.save(act)
            if act.rg:
                self.save(up)
            prod = self.new(up.numel, max(act.b, up.b), act.rg or up.rg)
            out = self.linear(prod, f"{prefix}.down_proj", c.n_embd)
            widest = (act.numel * act.b if act.rg else 0) + (up.numel * up.b if up.rg else 0)
        if out.rg:
            self.backward_in_flight = max(self.backward_in_flight, widest + out.numel * out.b)
        return out

    def block(self, x: _T, i: int) -> _T:
        p, n, E = f"blocks.{i}", self.n, self.c.n_embd
        h = self.norm(x, f"{p}.norm_1")
        attn = self.attention(h, f"{p}.attn")
        if self.c.parallel_residual:
            m = self.mlp(h if self.c.shared_attention_norm else self.norm(x, f"{p}.norm_2"), f"{p}.mlp")
            return self.new(n * E, max(x.b, attn.b, m.b), x.rg or attn.rg or m.rg)
        x2 = self.new(n * E, max(x.b, attn.b), x.rg or attn.rg)
        m = self.mlp(self.norm(x2, f"{p}.norm_2"), f"{p}.mlp")
        return self.new(n * E, max(x2.b, m.b), x2.rg or m.rg)


@dataclass
class Activations:
    """Activation bytes of one micro-batch on one device."""

    blocks: list[int]  # saved by each block
    block_inputs: list[int]  # each block's input, what a checkpointed block keeps
    head: int  # saved outside the blocks: token ids, final norm, the loss's gradients (fused) or
    # head input, log-softmax and labels (LoRA head)
    loss_saved: int  # the part of `head` the loss saved: gone after the loss's backward pass
    loss_forward: int  # the loss's transients at their largest in the forward pass (fused: the chunk
    # buffers, the float32 copy softmax makes of 16-bit logits on CUDA, the casts; LoRA head: the logits)
    loss_backward: int  # and in its backward pass: the outgoing gradients (LoRA head: the two float32
    # (tokens x vocab) gradients)
    loss_kept: int  # the fused loss's chunk buffers that stay allocated between calls (real CPU runs)
    hidden_grad: int  # the gradient the loss's backward pass hands on (tokens x n_embd)
    backward_in_flight: int  # gradients in flight in a block's backward pass (see _Tracer.mlp)
    weight_copies: int  # autocast's bf16 copies of float32 weights, all of them
    block_weight_copies: list[int]  # those of each block (what a checkpointed block re-creates)
    dequant_scratch: int  # a quantized block weight dequantized (bitsandbytes, torchao NF4): the largest, one at a time
    head_input: int = 0  # the final norm's output, alive from the final norm through the loss

    @property
    def stored(self) -> int:
        return sum(self.blocks)

    @property
    def checkpointed(self) -> int:
        # every block's input, plus one block's activations while it is recomputed
        return sum(self.block_inputs) + max(self.blocks)

    @property
    def logits(self) -> int:
        return self.head + max(self.loss_forward, self.loss_kept + self.loss_backward)

    def copies_in_backward(self, checkpointed: bool) -> int:
        """Weight copies alive in the backward pass. Without checkpointing the graph keeps every one;
        with it the forward's copies go with autocast's cache at the end of the forward pass, and
        each block's recomputation makes its own again."""
        if not checkpointed:
            return self.weight_copies
        blocks = sum(self.block_weight_copies)
        return self.weight_copies - blocks + max(self.block_weight_copies, default=0)


def trace_activations(
    config: Config, mode: Mode, weights: dict[str, _Weight], lora: dict, B: int, T: int
) -> Activations:
    """What one forward pass of a micro-batch of B sequences of T tokens leaves for the backward pass."""
    tr = _Tracer(config, mode, weights, lora, B, T)
    n, E, V = B * T, config.n_embd, config.vocab_size
    emb = weights["embed.weight"]
    if emb.trainable:
        tr.save(tr.new(n, 8, False))  # the embedding's backward keeps the token ids
    # The lookup (no autocast) gives the gathered dtype; FSDP casts it back to the stored one.
    x = tr.new(n * E, emb.stored or emb.b, emb.trainable)
    if config.scale_embeddings:
        if x.rg:
            tr.save(tr.new(1, x.b, False))  # x * sqrt(n_embd) keeps the scalar
        x = tr.new(x.numel, x.b, x.rg)
    blocks, inputs, block_copies = [], [], []
    for i in range(config.n_layer):
        before, copies_before = tr.saved_bytes(), sum(tr.weight_copies.values())
        inputs.append(x.numel * x.b)
        x = tr.block(x, i)
        blocks.append(tr.saved_bytes() - before)
        block_copies.append(sum(tr.weight_copies.values()) - copies_before)
    h = tr.norm(x, "norm_f")
    before_loss = tr.saved_bytes()
    if "lm_head" in lora:  # a peft LoRA head: GPT.head_loss takes the plain cross_entropy_sum(lm_head(x))
        logits = tr.linear(h, "lm_head", V)
        tr.cast(logits, 4)  # cross_entropy_sum: .float()
        lsm = tr.new(n * V, 4, logits.rg)
        if lsm.rg:
            tr.save(lsm)  # log_softmax keeps its result
            tr.save(tr.new(n, 8, False))  # nll_loss keeps the labels
            tr.save(tr.new(1, 4, False))  # and the total weight
        forward = n * V * (logits.b + (4 if logits.b != 4 else 0))  # the logits and their float32 copy
        forward += 0 if h.id in tr.saved else h.numel * h.b  # the head's input, alive through the loss
        loss = (forward, 2 * n * V * 4 if lsm.rg else 0, 0)  # backward: two float32 (tokens x vocab) gradients
    else:
        loss = _fused_loss(tr, h, weights["lm_head.weight"], weights.get("lm_head.bias"))
    head = tr.saved_bytes() - sum(blocks)  # everything outside the blocks, token ids included
    loss_saved = tr.saved_bytes() - before_loss
    hidden_grad = h.numel * h.b if h.rg else 0  # what the loss's backward pass hands to the final norm
    return Activations(blocks, inputs, head, loss_saved, *loss, hidden_grad, tr.backward_in_flight,
                       sum(tr.weight_copies.values()), block_copies, tr.dequant_scratch, h.numel * h.b)  # fmt: skip


def _fused_loss(tr: _Tracer, h: _T, w: _Weight, bias: Optional[_Weight]) -> tuple[int, int, int]:
    """`linear_cross_entropy_sum(h, lm_head.weight, lm_head.bias, labels)` (a plain nn.Linear head).

    Saves the loss's gradients, computed in the forward pass: grad_h (tokens x E, compute dtype)
    if h needs a gradient, grad_w (V x E float32) if the head weight trains, grad_b (V float32) if
    the bias trains. `rows` (the non-ignored rows) is not counted: every label is assumed to count
    (on GPUs it is never kept). Returns the loss's transient bytes (forward, backward, kept): the
    forward pass's chunk buffers with the casts and products beside them; the gradients its
    backward pass creates; and the chunk buffers that stay allocated after the call (real CPU runs
    only, see `toolkit.models.loss._scratch`). Weights are not autocast-cached: no weight copy.
    """
    c, mode, n = tr.c, tr.mode, tr.n
    E, V = c.n_embd, c.vocab_size
    cdt = mode.compute if mode.autocast else w.b  # the products' dtype; softmax and sums float32
    need_h, need_w = h.rg, w.trainable
    need_b = bias is not None and bias.trainable
    if need_h:
        tr.save(tr.new(n * E, cdt, False))  # grad_h
    if need_w:
        tr.save(tr.new(V * E, 4, False))  # grad_w
    if need_b:
        tr.save(tr.new(V, 4, False))  # grad_b
    need_grad = need_h or need_w or need_b
    if not need_grad:
        return 0, 0, 0
    hidden_input = h.numel * h.b  # alive through the forward pass, not saved
    # Forward: equal chunks of at most LOSS_CHUNK_BYTES of float32 logits (toolkit.models.loss).
    chunk = max(1, LOSS_CHUNK_BYTES // (4 * V))
    chunk = -(-n // -(-n // chunk))
    rows = chunk * V
    in_place = cdt == 4 and not mode.cuda  # CPU float32: softmax writes over the logits
    logits = rows * cdt
    probs = 0 if in_place else rows * 4
    # On CUDA softmax(..., dtype=float32) first copies bfloat16 logits to float32 (float16 it widens
    # as it reads); on CPU (fake tensors included) the loss copies them into `probs` itself.
    widened = rows * 4 if cdt != 4 and mode.cuda and not mode.float16 else 0
    softmax_16 = rows * cdt if cdt != 4 else 0  # the softmax cast back to the compute dtype
    casts = (n * E * cdt if h.b != cdt else 0) + (V * E * cdt if w.b != cdt else 0)  # h.to(dtype), weight.to(dtype)
    # grad.t() @ hc in 16 bits, added to the float32 grad_w a piece of vocabulary rows at a time
    vocab_rows = max(1, LOSS_CHUNK_BYTES // (4 * E))
    product = min(V, vocab_rows) * E * cdt if need_w and cdt != 4 else 0
    # The float32 copy lives during softmax only; the 16-bit softmax and the product come after it.
    if not mode.real_cpu:  # buffers allocated per call (the 16-bit softmax per chunk) and freed after it
        kept = 0
        forward = hidden_input + logits + probs + casts + max(widened, softmax_16 + product)
    else:  # one buffer per kind, kept between calls (the 16-bit softmax's buffer exists already)
        kept = logits + probs + softmax_16
        forward = hidden_input + kept + casts + max(widened, product)
    # Backward: the hidden's gradient scaled in the compute dtype, then cast to the hidden's dtype;
    # then the weight's and the bias's, scaled in float32 and written into their own dtypes
    # (`loss._scaled`; a real CPU run casts through one chunk of float32 rows), or, for float32
    # ones, scaled in place in the kept gradients (nothing new).
    def scaled(numel: int, row: int, b: int) -> int:
        if b == 4:
            return 0
        through = min(numel // row, max(1, LOSS_CHUNK_BYTES // (4 * row))) * row * 4 if mode.real_cpu else 0
        return numel * b + through

    hidden = n * E * h.b if need_h else 0
    hidden_product = n * E * cdt if need_h and h.b != cdt else 0  # freed once cast
    weight = scaled(V * E, E, w.b) if need_w else 0
    bias_grad = scaled(V, 1, bias.b) if need_b else 0  # type: ignore[union-attr]
    backward = hidden + max(hidden_product, weight + bias_grad)
    return forward, backward, kept


# --------------------------------------------------------------------------------------------
# FSDP2 shards: every parameter split along dim 0
# --------------------------------------------------------------------------------------------


def shard_rows(rows: int, shards: int) -> list[int]:
    """Rows of each rank's dim-0 shard of a tensor with `rows` rows, as FSDP2 splits it (torch.chunk:
    ceil(rows / shards) rows each, the last ranks fewer or none)."""
    chunk = -(-rows // shards)
    return [max(0, min(chunk, rows - r * chunk)) for r in range(shards)]


def padded_shard_numel(s: ParamSpec, shards: int) -> int:
    """Elements FSDP2 allocates for one rank's shard of `s`: every rank pads its shard to the first
    rank's ceil(rows / shards) rows, so that the all-gather and the reduce-scatter are even."""
    rows = s.shape[0]
    return -(-rows // shards) * (s.numel // rows)


def shard_bytes(s: ParamSpec, shards: int, opts: "Options", quantized: set[str]) -> int:
    """Bytes of one rank's shard of `s` as stored: its padded rows in `Options.param_bytes`; for a
    quantized (NF4) weight, the NF4 bytes of its rows / `shards` rows (not padded: finetune_lora
    and the estimate refuse shapes that do not split into whole NF4 groups, `nf4_unshardable`)."""
    if s.name in quantized:
        return quantized_bytes((s.shape[0] // shards, *s.shape[1:]), opts.quantize)  # type: ignore[arg-type]
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
        shard = shard_bytes(s, W, opts, quantized)
        params += shard
        if s.name in quantized:
            quantized_base += shard
        if s.trainable:
            grads += padded_shard_numel(s, W) * opts.trainable_bytes
            row = s.numel // s.shape[0]
            for r, rows in enumerate(shard_rows(s.shape[0], W)):
                states[r] += 2 * rows * row * opts.trainable_bytes
    return [{"parameters": params, "gradients": grads, "optimizer_state": n, "quantized_base": quantized_base}
            for n in states]


# What one device holds at a moment of the step besides parameters, gradients and optimizer state,
# by category. The FSDP categories are those of torch's FSDPMemTracker, whose figures
# `toolkit.simulate` reports (`toolkit.simulate.CATEGORIES` names them the same way), so that the
# two can be held to each other category by category (tests/test_simulate.py).
ACTIVATIONS = "activations"  # made in the forward pass: what autograd saves, the loss's forward buffers, autocast's copies
TEMPORARIES = "temporaries"  # made in the backward pass or the optimizer step
GATHERED = "unsharded parameters"
ALL_GATHER = "all-gather buffers"
UNSHARDED_GRADS = "unsharded gradients"
REDUCE_SCATTER = "reduce-scatter buffers"
BUCKETS = "DDP gradient buckets"
DEQUANTIZED = "dequantized weight"  # a quantized weight dequantized for a block's compute, one at a time
Moment = dict[str, int]


def fsdp_moments(specs: list[ParamSpec], column: "Column", opts: "Options") -> dict[str, Moment]:
    """What FSDP2 holds beside the shards on one rank, by category, at each moment of a step at which
    the step can peak, in the order torch 2.13's `fully_shard` runs. Activations are added by
    `step_moments`. The units are those of `toolkit.parallel.fsdp.shard_model`: one per block;
    untied, one for the embedding, one for the final norm and one for the head; tied, the shared
    matrix with the final norm in the root.

    - Gathering: under "*-mixed" each unit's float32 shards are cast to the compute dtype and
      all-gathered into one flat output (gloo, on CPU, stages it twice); each parameter's copy is
      then cut from it ("copy-out"). An NF4 weight (`--quantize nf4`) is gathered as its NF4 bytes,
      not cast. Under CPU offload each shard is first copied to the device. In the forward pass a
      unit's flat output is freed after the next unit's copy-out; the output units' (the final
      norm's and the head's) right after their own, by the toolkit's forward pre-hook
      (`toolkit.parallel.fsdp._free_flat_gather_output`), so none is alive at the loss but a
      tied root's last block's (freed when the forward pass ends); in the backward pass right
      after the unit's own copy-out.
    - Blocks and the embedding are released after their forward pass (not under SHARD_GRAD_OP) and
      gathered again for their backward pass, each prefetched when the unit after it starts its
      backward pass: the last block when the final norm does, the embedding when block 0 does.
      The final norm and the head stay gathered from their forward pass through their backward
      pass. A tied root stays gathered all step. NO_SHARD gathers by copying the shard.
    - Reducing: after a unit's backward pass its gathered copies are released, then its unsharded
      gradients (in the gathered dtype) are copied into a reduce-scatter input padded to the shard
      group, in the reduction dtype (the trainable dtype), which FSDP keeps until the next unit
      reduces. A tied root's gradients stay unsharded until the end of the backward pass.
    """
    W = column.shard_size
    gloo = opts.device == "cpu"
    units: dict[int, list[ParamSpec]] = {}
    for s in specs:
        units.setdefault(s.unit, []).append(s)
    blocks = [members for unit, members in sorted(units.items()) if unit >= 0]
    quantized = quantized_names(opts, specs)
    edges = units.get(-1, [])
    tied = opts.config.tie_embeddings

    def gathered(s: ParamSpec) -> int:
        """`s` gathered whole: an NF4 weight as its NF4 bytes (torchao's NF4Tensor all-gathers its
        codes, scales and factors as they are stored), any other in `Options.gathered_bytes`,
        padded to the shard group."""
        if s.name in quantized:
            return quantized_bytes(s.shape, opts.quantize)  # type: ignore[arg-type]
        return padded_shard_numel(s, W) * W * opts.gathered_bytes(s, column)

    def copies(members: list[ParamSpec]) -> int:
        return sum(gathered(s) for s in members)

    def flat(members: list[ParamSpec]) -> int:
        return copies(members) if W > 1 else 0

    def sent(members: list[ParamSpec]) -> int:
        """The all-gather's inputs made for it: the shards stored in another dtype than the one they
        are gathered in (float32 under "*-mixed"), cast to it (a frozen 16-bit or NF4 shard is sent
        as stored); under CPU offload every shard copied to the device first."""
        cast = sum(gathered(s) // W for s in members
                   if s.name not in quantized and opts.gathered_bytes(s, column) != opts.param_bytes(s))  # fmt: skip
        return cast + (sum(shard_bytes(s, W, opts, quantized) for s in members) if opts.cpu_offload else 0)

    def in_flight(members: list[ParamSpec]) -> int:
        """An all-gather before its copy-out: its flat output (twice under gloo) and its inputs (`sent`)."""
        return (2 if gloo else 1) * flat(members) + sent(members) if W > 1 else copies(members)

    def grads(members: list[ParamSpec]) -> int:
        return sum(s.numel * opts.gathered_bytes(s, column) for s in members if s.trainable)

    def reduce_input(members: list[ParamSpec]) -> int:
        return sum(padded_shard_numel(s, W) * W * opts.trainable_bytes for s in members if s.trainable)

    def larger(*moments: Moment) -> Moment:
        return max(moments, key=lambda m: sum(m.values()))

    def gather(unit: list[ParamSpec], before: list[ParamSpec], held: int) -> Moment:
        """`unit` gathered in the forward pass while the flat output of the unit `before` is alive."""
        if W == 1:
            return {GATHERED: held + copies(unit)}
        return larger({GATHERED: held, ALL_GATHER: flat(before) + in_flight(unit)},
                      {GATHERED: held + copies(unit), ALL_GATHER: flat(before) + flat(unit)})  # fmt: skip

    keep_all = column.name == "SHARD_GRAD_OP"  # every unit stays gathered from its forward to its backward pass
    if tied:  # the root: the shared matrix, the final norm (and a head bias, LoRA adapters of the head)
        root, embed, output = edges, [], []
    else:
        root = []
        embed = [s for s in edges if s.name == "embed.weight"]
        output = [s for s in edges if s.name != "embed.weight"]  # the final norm and the head
    head = [s for s in output if s.name.startswith("lm_head.")]
    norm = [s for s in output if not s.name.startswith("lm_head.")]
    block = max(blocks, key=copies, default=[])
    first, last = (blocks[0], blocks[-1]) if blocks else ([], [])
    held_root = copies(root)
    every_unit = copies(embed) + sum(copies(m) for m in blocks) if keep_all else 0  # SHARD_GRAD_OP, at the loss
    root_grads = grads(root)  # tied: the head's gradient, held unsharded through the blocks' backward passes
    m: dict[str, Moment] = {}
    if embed:
        m["embedding gathered"] = gather(embed, [], 0)
    m["block 0 gathered"] = gather(first, root or embed, held_root + (copies(embed) if keep_all else 0))
    m["last block gathered"] = gather(last, blocks[-2] if len(blocks) > 1 else root or embed,
                                      held_root + (every_unit - copies(last) if keep_all else 0))  # fmt: skip
    at_loss = held_root + copies(output) + every_unit
    if head:  # the head gathered after the final norm, whose flat output its hook freed
        m["head gathered"] = gather(head, [], at_loss - copies(head))
    m["loss forward"] = {GATHERED: at_loss, ALL_GATHER: 0 if output else flat(last)}
    if tied:  # the root's backward pass starts with the loss's: the last block is prefetched
        if keep_all:
            m["loss backward"] = {GATHERED: at_loss}
        else:
            m["loss backward"] = {GATHERED: at_loss + (0 if W > 1 else copies(last)), ALL_GATHER: flat(last)}
    else:
        m["loss backward"] = {GATHERED: at_loss}
        # the head released, its gradients reduced; then the last block prefetched beside its input
        rest = at_loss - copies(head)
        prefetch = 0 if keep_all else in_flight(last)
        m["head reduced"] = larger({GATHERED: rest, UNSHARDED_GRADS: grads(head), REDUCE_SCATTER: reduce_input(head)},
                                   {GATHERED: rest, ALL_GATHER: prefetch, REDUCE_SCATTER: reduce_input(head)})  # fmt: skip
    # A block's backward pass: its copies, the unit before it prefetched (its flat output) and the
    # reduce-scatter input of the unit after it (the last block's: the final norm's, a few KiB; the
    # head's went when the final norm reduced). A tied root's gradient is a temporary until the end.
    # (SHARD_GRAD_OP: every unit gathered but those whose backward pass is done.)
    held = held_root + (every_unit - copies(block) if keep_all else 0)
    done = copies(block) if keep_all else 0  # SHARD_GRAD_OP: the last block, released

    def backward(prefetched: list[ParamSpec], previous: list[ParamSpec], released: int) -> Moment:
        return {GATHERED: held + copies(block) - released, TEMPORARIES: root_grads,
                ALL_GATHER: 0 if keep_all else flat(prefetched), REDUCE_SCATTER: reduce_input(previous)}  # fmt: skip

    m["last block backward"] = backward(block, norm, 0)
    m["block backward"] = backward(block, block, done)
    # The end of its backward pass: the gradients autograd made for its weights, not yet taken by FSDP.
    m["block backward end"] = backward(block, block, done)
    m["block backward end"][TEMPORARIES] += grads(block)
    # Its end, the larger of: released, its gradients copied into its reduce-scatter input beside the
    # prefetched unit's flat output; and the next block's turn (its copy-out, then the prefetch of the
    # one after it), beside this block's reduce-scatter input.
    end = {GATHERED: held - done, TEMPORARIES: root_grads, UNSHARDED_GRADS: grads(block),
           ALL_GATHER: 0 if keep_all else flat(block), REDUCE_SCATTER: reduce_input(block)}  # fmt: skip
    turn = {GATHERED: held + copies(block), TEMPORARIES: root_grads, ALL_GATHER: in_flight(block),
            REDUCE_SCATTER: reduce_input(block)}  # fmt: skip
    m["block reduced"] = end if keep_all else larger(end, turn)
    if embed:  # the embedding is not gathered for its backward pass (set_unshard_in_backward(False))
        m["block 0 backward"] = backward([], block, every_unit - copies(embed) - copies(block) if keep_all else 0)
        m["block 0 backward end"] = dict(m["block 0 backward"])
        m["block 0 backward end"][TEMPORARIES] += grads(block)
        m["embedding reduced"] = larger(
            {GATHERED: copies(embed) if keep_all else 0, TEMPORARIES: grads(embed), REDUCE_SCATTER: reduce_input(first)},
            {UNSHARDED_GRADS: grads(embed), REDUCE_SCATTER: reduce_input(embed)},
        )
    else:  # the embedding's gradient is added to the head's (a third tensor), then the root is reduced
        m["root reduced"] = larger(
            {GATHERED: held_root, TEMPORARIES: 3 * root_grads, REDUCE_SCATTER: reduce_input(first)},
            {UNSHARDED_GRADS: root_grads, REDUCE_SCATTER: reduce_input(root)},
        )
    return {name: {k: v for k, v in moment.items() if v} for name, moment in m.items()}


def strategy_moments(specs: list[ParamSpec], column: "Column", opts: "Options") -> dict[str, Moment]:
    """What the strategy holds beside parameters, gradients and optimizer state at each moment:
    under FSDP, `fsdp_moments`; with DDP its buckets, as large as the gradients, all step."""
    if column.kind == "fsdp":
        return fsdp_moments(specs, column, opts)
    buckets = sum(s.numel * opts.trainable_bytes for s in specs if s.trainable) if column.kind == "ddp" else 0
    return {name: {BUCKETS: buckets} for name in ("loss forward", "loss backward", "last block backward")}


# The moments of `step_moments` at which a block computes (a quantized base's weight dequantized).
BLOCK_COMPUTE = ("block 0 gathered", "last block gathered", "last block backward", "block backward",
                 "block backward end", "block 0 backward", "block 0 backward end")


def step_moments(opts: "Options", column: "Column", act: "Activations", checkpointed: bool,
                 specs: list[ParamSpec], step_scratch: int) -> dict[str, Moment]:  # fmt: skip
    """Everything alive on one device beside parameters, gradients and optimizer state, by category,
    at each moment of a step at which it can peak (`column_memory`'s total is the largest).

    Activations: in the forward pass a checkpointed block keeps only its input; in the backward
    pass it is recomputed (its activations and weight copies made again, temporaries then) beside
    the widest gradients in flight. The loss's saved gradients go with its backward pass, the last
    block's activations (or input) with its own. The strategy's part is `strategy_moments`. A
    quantized base's dequantized weight (`Activations.dequant_scratch`) exists while a block
    computes: in its forward pass (counted at its gathering) and its backward pass.
    """
    saved_forward = sum(act.block_inputs) if checkpointed else act.stored
    saved_backward = sum(act.block_inputs) if checkpointed else act.stored
    copies = act.copies_in_backward(checkpointed)
    recomputed = max(act.blocks) if checkpointed else 0  # one block's activations, again
    last_block = act.block_inputs[-1] if checkpointed else act.blocks[-1]  # what the last block keeps
    activations: dict[str, Moment] = {
        # the head gathered beside the final norm's output (FSDP, untied head)
        "head gathered": {ACTIVATIONS: saved_forward + act.head - act.loss_saved + act.head_input + act.loss_kept
                          + act.weight_copies},
        "loss forward": {ACTIVATIONS: saved_forward + act.head + act.loss_forward + act.weight_copies},
        "loss backward": {ACTIVATIONS: saved_backward + act.head + act.loss_kept + copies,
                          TEMPORARIES: act.loss_backward},
        "head reduced": {ACTIVATIONS: saved_backward + act.head - act.loss_saved + act.loss_kept + copies,
                         TEMPORARIES: act.hidden_grad},
        # the last block's backward pass, with every block's activations (or inputs) still there
        "last block backward": {ACTIVATIONS: saved_backward + act.loss_kept + copies,
                                TEMPORARIES: recomputed + act.backward_in_flight},
        # the block before it (the reduce-scatter input of the last one alive), and each one's end
        "block backward": {ACTIVATIONS: saved_backward - last_block + act.loss_kept + copies,
                           TEMPORARIES: recomputed + act.backward_in_flight},
        "block reduced": {ACTIVATIONS: saved_backward - last_block + act.loss_kept + copies,
                          TEMPORARIES: act.hidden_grad},
        # the end of a block's backward pass: its activations gone but its input's, the gradient
        # arriving and the one leaving (its weights' gradients are the strategy's part)
        "block backward end": {ACTIVATIONS: saved_backward - last_block + act.loss_kept + copies,
                               TEMPORARIES: 2 * act.hidden_grad},
        "block 0 backward end": {ACTIVATIONS: act.block_inputs[0] + act.loss_kept, TEMPORARIES: 2 * act.hidden_grad},
        # block 0's backward pass: only its own activations are left
        "block 0 backward": {ACTIVATIONS: (act.block_inputs[0] if checkpointed else act.blocks[0]) + act.loss_kept,
                             TEMPORARIES: (act.blocks[0] if checkpointed else 0) + act.backward_in_flight},
        "block 0 gathered": {ACTIVATIONS: act.block_inputs[0]},
        "last block gathered": {ACTIVATIONS: saved_forward - (act.block_inputs[-1] if checkpointed else act.blocks[-1])
                                + act.block_inputs[-1]},
    }  # fmt: skip
    moments: dict[str, Moment] = {}
    for name, held in strategy_moments(specs, column, opts).items():
        moment = dict(activations.get(name, {}))
        for key, value in held.items():
            moment[key] = moment.get(key, 0) + value
        if name in BLOCK_COMPUTE:
            moment[DEQUANTIZED] = act.dequant_scratch
        moments[name] = {k: v for k, v in moment.items() if v}
    moments["optimizer step"] = {TEMPORARIES: step_scratch}  # AdamW's foreach temporaries
    return moments


# --------------------------------------------------------------------------------------------
# One strategy column
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    name: str  # "single", "DDP" or an FSDP sharding strategy
    kind: Literal["single", "ddp", "fsdp"]
    shard_size: int  # devices each FSDP unit is sharded over (1 = replicated)


def make_column(name: str, devices: int, num_nodes: int) -> Column:
    """The column for "single", "DDP" or an FSDP sharding on devices x num_nodes."""
    if name == "single":
        return Column(name, "single", 1)
    if name == "DDP":
        return Column(name, "ddp", 1)
    from toolkit.parallel.plan import mesh_layout  # the mesh training builds (no torch import)

    shape, dims = mesh_layout(name, num_nodes, devices)
    return Column(name, "fsdp", shape[dims.index("shard")])


@dataclass
class Options:
    """What is being trained, and how (everything but the strategy and the micro batch)."""

    config: Config
    precision: str
    finetune: Optional[str]
    lora_modules: tuple[str, ...]
    lora_r: int
    quantize: Optional[str]
    max_seq_length: int
    # Whose rules: "cuda" (a GPU run); "cpu" (a real CPU run: the CPU's kernels, the fused loss's
    # buffers kept between calls, gloo's staging of all-gathers; the tests' real runs); "fake"
    # (the CPU's kernels on fake tensors, allocating as on a GPU: `toolkit.simulate`).
    device: Literal["cuda", "cpu", "fake"] = "cuda"
    lora_dropout: float = 0.0
    cpu_offload: bool = False  # FSDP's CPUOffloadPolicy: shards, gradients and AdamW state in host memory

    @property
    def compute_bytes(self) -> int:
        return 4 if self.precision == "32-true" else 2

    @property
    def trainable_bytes(self) -> int:
        """Bytes per element of a trainable weight, its gradient and its AdamW state (float32 but
        under "*-true" 16-bit precision); also of the gradient reduction under FSDP."""
        return self.compute_bytes if self.precision.endswith("-true") else 4

    @property
    def frozen_bytes(self) -> int:
        """Bytes per element of a frozen weight: stored in the compute dtype."""
        return self.compute_bytes

    def param_bytes(self, s: ParamSpec) -> int:
        return self.trainable_bytes if s.trainable else self.frozen_bytes

    def gathered_bytes(self, s: ParamSpec, column: "Column") -> int:
        """Bytes per element of `s` as the forward and backward passes see it: as stored, but under
        FSDP with "*-mixed" every unit (blocks, embedding, final norm, head) casts its float32
        shards to the compute dtype before the all-gather (the MixedPrecisionPolicy of
        toolkit.parallel.fsdp.shard_model). The embedding's output is cast back to its stored
        dtype (`_Weight.stored`)."""
        if column.kind == "fsdp" and self.autocast:
            return self.compute_bytes
        return self.param_bytes(s)

    @property
    def autocast(self) -> bool:
        return self.precision.endswith("-mixed")

    def mode(self) -> "Mode":
        """The precision and kernel rules of the forward pass."""
        return Mode(self.autocast, self.compute_bytes, self.device, self.lora_dropout > 0, self.precision.startswith("16-"))


def column_memory(opts: Options, column: Column, micro_batch_size: int) -> dict[str, int]:
    """Bytes per device of every component for one strategy. The totals are the parameters,
    gradients and optimizer state plus the largest moment of `step_moments`."""
    c = opts.config
    specs = parameter_specs(c, opts.lora_modules, opts.lora_r)
    quantized = quantized_names(opts, specs)

    def stored(s: ParamSpec) -> int:
        if s.name in quantized:
            return quantized_bytes(s.shape, opts.quantize)  # type: ignore[arg-type]
        return s.numel * opts.param_bytes(s)

    out: dict[str, int] = {}
    if column.kind != "fsdp":
        out["parameters"] = sum(stored(s) for s in specs)
        out["gradients"] = sum(s.numel * opts.trainable_bytes for s in specs if s.trainable)
        out["optimizer_state"] = 2 * out["gradients"]
        out["step_scratch"] = out["gradients"]
    else:
        ranks = fsdp_rank_memory(specs, column, opts)
        out["parameters"] = ranks[0]["parameters"]
        out["gradients"] = ranks[0]["gradients"]
        out["optimizer_state"] = max(r["optimizer_state"] for r in ranks)  # the fullest rank
        out["step_scratch"] = out["optimizer_state"] // 2
    out["host_offload"] = 0
    if column.kind == "fsdp" and opts.cpu_offload:
        # CPUOffloadPolicy: the shards, their gradients and AdamW state are host memory, and the
        # step runs there. Each unit's shards are copied to the device for its all-gather (the
        # all-gather inputs of `fsdp_moments`) and its reduced gradients copied back.
        out["host_offload"] = out["parameters"] + out["gradients"] + out["optimizer_state"] + out["step_scratch"]
        for key in ("parameters", "gradients", "optimizer_state", "step_scratch"):
            out[key] = 0
    act = activations(opts, column, micro_batch_size, specs, quantized)
    out["activations"] = act.stored
    out["activations_checkpointed"] = act.checkpointed
    out["logits_and_loss"] = act.logits
    out["weight_copies"] = act.weight_copies
    # the most the strategy holds at one moment (gradients on their way to be reduced included)
    out["buffers"] = max(sum(m.values()) for m in strategy_moments(specs, column, opts).values()) + act.dequant_scratch
    persistent = out["parameters"] + out["gradients"] + out["optimizer_state"]
    for key, checkpointed in (("total", False), ("total_checkpointed", True)):
        moments = step_moments(opts, column, act, checkpointed, specs, out["step_scratch"])
        out[key] = persistent + max(sum(m.values()) for m in moments.values())
    return out


def peak_moment(opts: Options, column: Column, micro_batch_size: int, checkpointed: bool) -> tuple[str, Moment]:
    """The moment of `step_moments` at which the step peaks, and what is alive then by category."""
    specs = parameter_specs(opts.config, opts.lora_modules, opts.lora_r)
    quantized = {s.name for s in specs if opts.quantize and s.kind == "linear" and s.unit >= 0}
    act = activations(opts, column, micro_batch_size, specs, quantized)
    scratch = column_memory(opts, column, micro_batch_size)["step_scratch"]
    moments = step_moments(opts, column, act, checkpointed, specs, scratch)
    return max(moments.items(), key=lambda item: sum(item[1].values()))


def activations(opts: Options, column: Column, micro_batch_size: int, specs: list[ParamSpec],
                quantized: set[str]) -> "Activations":  # fmt: skip
    """What a micro-batch's forward pass leaves for the backward pass on one device (`trace_activations`)."""
    c = opts.config
    weights, lora = forward_weights(opts, specs, quantized, column)
    mode = opts.mode()
    act1 = trace_activations(c, mode, weights, lora, 1, opts.max_seq_length)
    if micro_batch_size == 1:
        return act1
    act2 = trace_activations(c, mode, weights, lora, 2, opts.max_seq_length)
    act = _extrapolate(act1, act2, micro_batch_size)
    if micro_batch_size > 2:  # the fused loss's chunks are not affine in the batch size
        full = trace_activations(c, mode, weights, lora, micro_batch_size, opts.max_seq_length)
        act.loss_forward, act.loss_backward, act.loss_kept = full.loss_forward, full.loss_backward, full.loss_kept
    return act


def _extrapolate(a1: Activations, a2: Activations, B: int) -> Activations:
    """Activations are affine in the batch size (cos/sin tables depend on T only)."""

    def f(x1: int, x2: int) -> int:
        return x1 + (x2 - x1) * (B - 1)

    return Activations(
        [f(x, y) for x, y in zip(a1.blocks, a2.blocks)],
        [f(x, y) for x, y in zip(a1.block_inputs, a2.block_inputs)],
        f(a1.head, a2.head),
        f(a1.loss_saved, a2.loss_saved),
        f(a1.loss_forward, a2.loss_forward),
        f(a1.loss_backward, a2.loss_backward),
        f(a1.loss_kept, a2.loss_kept),
        f(a1.hidden_grad, a2.hidden_grad),
        f(a1.backward_in_flight, a2.backward_in_flight),
        a1.weight_copies,
        a1.block_weight_copies,
        a1.dequant_scratch,
        f(a1.head_input, a2.head_input),
    )


def forward_weights(opts: Options, specs: list[ParamSpec], quantized: set[str], column: Optional[Column] = None):
    """How each weight looks to the forward pass, keyed by parameter name (the module's view).

    On one device and with DDP (`column` None or not FSDP) every weight is used in the dtype it is
    stored in: trainable float32 weights under "*-mixed" are cast by autocast. Under FSDP with
    "*-mixed" every weight (adapters included) arrives in the compute dtype
    (`Options.gathered_bytes`), so autocast has nothing to cast.
    """
    weights: dict[str, _Weight] = {}
    adapters: dict[str, dict[str, _Weight]] = {}
    for s in specs:
        b = opts.param_bytes(s) if column is None else opts.gathered_bytes(s, column)
        w = _Weight(b, s.trainable, s.numel, opts.quantize if s.name in quantized else None, s.name, opts.param_bytes(s))
        name = s.name.replace(".base_layer.", ".")
        if s.kind == "lora":
            module, which = s.name.split(".lora_")
            adapters.setdefault(module, {})[which[0]] = w
        else:
            weights[name] = w
    if opts.config.tie_embeddings:
        weights["lm_head.weight"] = weights["embed.weight"]
    lora = {m: (ab["A"], ab["B"]) for m, ab in adapters.items()}
    return weights, lora


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


def estimate(
    model_name: str,
    devices: int = 1,
    num_nodes: int = 1,
    micro_batch_size: int = 1,
    max_seq_length: Optional[int] = None,
    precision: str = "bf16-mixed",
    strategy: StrategyName = "auto",
    sharding: Optional[ShardingName] = None,
    finetune: Optional[Literal["lora", "full"]] = None,
    lora_r: int = 8,
    lora_targets: tuple[str, ...] = ("query", "value"),
    lora_dropout: float = 0.05,
    quantize: Optional[QuantizeName] = None,
    activation_checkpointing: Optional[bool] = None,
    memory_budget_gb: Optional[float] = None,
    model_overrides: Optional[dict[str, Any]] = None,
    simulate: bool = False,
    cpu_offload: bool = False,
) -> dict[str, Any]:
    """Estimate the memory per device of a training step, for each distributed strategy.

    Prints a table (rows: memory components, columns: strategies) and, with --memory_budget_gb, the
    cheapest set-up that fits. Figures are GiB (1024^3 bytes) per device.

    Args:
        model_name: A preset name, alias or Hugging Face repo id, or a checkpoint directory.
        devices: Devices per node.
        num_nodes: Number of nodes.
        micro_batch_size: Sequences per forward/backward on one device.
        max_seq_length: Tokens per sequence; default: min(the model's context, 2048), as pretrain.
        precision: bf16-mixed, bf16-true, 16-mixed, 16-true or 32-true.
        strategy: "auto": FSDP (every sharding) and DDP side by side when there is more than one
            device; "fsdp" or "ddp" to show only those. One device in total is always "single".
        sharding: Show only this FSDP sharding strategy (default: all of them).
        finetune: None (pretraining) or "full": every weight trains; "lora": only the adapters.
        lora_r: LoRA rank.
        lora_targets: Layers that get adapters: query, key, value, projection, mlp, head.
        lora_dropout: Dropout on the adapters' input (finetune_lora's default 0.05; 0 saves a mask per input).
        quantize: Quantization of the frozen linear weights (QLoRA; needs finetune lora): nf4
            (torchao, sharded by FSDP2 on several devices) or bnb.* (bitsandbytes, replicated).
        activation_checkpointing: Recompute each block in the backward pass (true), store its
            activations (false), or show both (default).
        memory_budget_gb: Memory per device in GiB; recommends the cheapest configuration that fits.
        model_overrides: Config fields to change, e.g. '{n_layer: 2}'.
        simulate: Also run the real training step (FSDP2, LoRA, precision, AdamW) on fake tensors
            and devices x num_nodes fake ranks, and print each rank's peak by category and the
            bytes it sends per step (`toolkit.simulate`; up to a minute for 70B). For the FSDP
            sharding given (default HYBRID_SHARD); not for QLoRA (quantized weights need real data).
        cpu_offload: FSDP's CPU offload (--distributed.cpu_offload): the shards, gradients and AdamW
            state of each device live in host memory (shown apart); FSDP columns only.
    """
    opts, columns, notes, chosen_ckpt = _resolve(
        model_name, devices, num_nodes, micro_batch_size, max_seq_length, precision, strategy, sharding, finetune,
        lora_r, lora_targets, lora_dropout, quantize, activation_checkpointing, memory_budget_gb, model_overrides,
        cpu_offload,
    )  # fmt: skip
    c = opts.config
    specs = parameter_specs(c, opts.lora_modules, opts.lora_r)
    result: dict[str, Any] = {
        "model": c.name,
        "parameters": sum(s.numel for s in specs),
        "trainable_parameters": sum(s.numel for s in specs if s.trainable),
        "precision": opts.precision,
        "micro_batch_size": micro_batch_size,
        "max_seq_length": opts.max_seq_length,
        "devices": devices,
        "num_nodes": num_nodes,
        "finetune": finetune,
        "quantize": quantize,
        "lora_dropout": opts.lora_dropout,
        "activation_checkpointing": activation_checkpointing,
        "cpu_offload": opts.cpu_offload,
        "columns": [col.name for col in columns],
        "strategies": {col.name: column_memory(opts, col, micro_batch_size) for col in columns},
        "notes": notes,
        "recommendation": None,
    }
    if opts.cpu_offload:
        host = max(figures["host_offload"] for figures in result["strategies"].values())
        notes.append(f"CPU offload: each device's parameter shards, gradients and AdamW state ({host / GiB:.2f} GiB "
                     "at most, shown as 0 above) live in host memory, and the optimizer step runs on the CPU.")
    if memory_budget_gb is not None:
        result["recommendation"] = recommend(
            opts, columns, micro_batch_size, memory_budget_gb, chosen_ckpt, devices, num_nodes
        )
    print(format_table(result))
    if simulate:
        result["simulation"] = _simulate(opts, devices, num_nodes, micro_batch_size, sharding, lora_r, lora_targets,
                                         lora_dropout, bool(activation_checkpointing))
    return result


def _simulate(opts: "Options", devices, num_nodes, micro_batch_size, sharding, lora_r, lora_targets, lora_dropout,
              checkpointing: bool):  # fmt: skip
    """Run `toolkit.simulate` for the set-up, print its table; None (with a note) where it cannot run."""
    if opts.quantize is not None:
        print(f"note: {opts.quantize} cannot be simulated (quantized weights need real data): the figures above "
              "are the analytic estimate.")
        return None
    if devices * num_nodes == 1:
        print("note: the simulation runs FSDP over more than one device; for one device the analytic figures stand.")
        return None
    from toolkit.simulate import simulate

    lora = None
    if opts.finetune == "lora":
        from toolkit.models.adapters import LoRAArgs

        lora = LoRAArgs(r=lora_r, alpha=2 * lora_r, dropout=lora_dropout, targets=tuple(lora_targets))
    result = simulate(
        opts.config, devices, num_nodes, micro_batch_size, opts.max_seq_length, opts.precision,
        sharding or "HYBRID_SHARD", opts.finetune, lora, checkpointing,
    )
    print()
    print(result.table())
    return result


def _resolve(
    model_name, devices, num_nodes, micro_batch_size, max_seq_length, precision, strategy, sharding, finetune,
    lora_r, lora_targets, lora_dropout, quantize, activation_checkpointing, memory_budget_gb, model_overrides,
    cpu_offload=False,
):  # fmt: skip
    """Validate the arguments (UserError) and decide the columns to show."""
    from toolkit.parallel.precision import PRECISION_ALIASES, PRECISIONS

    for name, value in (("devices", devices), ("num_nodes", num_nodes), ("micro_batch_size", micro_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{name} must be a positive whole number, got {value!r}.")
    overrides = dict(model_overrides or {})
    if (Path(model_name) / CONFIG_FILENAME).is_file():  # a checkpoint directory
        config = Config.from_file(model_name)
        config = config.replace(**overrides) if overrides else config
    else:
        config = Config.from_name(model_name, **overrides)
    if max_seq_length is None:
        max_seq_length = min(config.block_size, 2048)
    if isinstance(max_seq_length, bool) or not isinstance(max_seq_length, int) or max_seq_length < 1:
        raise UserError(f"max_seq_length must be a positive whole number, got {max_seq_length!r}.")
    if max_seq_length > config.block_size:
        raise UserError(
            f"max_seq_length {max_seq_length} is larger than the context of {config.name} "
            f"({config.block_size} tokens); use at most {config.block_size}."
        )
    name = PRECISION_ALIASES.get(str(precision).lower(), str(precision).lower())
    check_choice("precision", precision if name not in PRECISIONS else name, PRECISIONS)
    check_choice("strategy", strategy, get_args(StrategyName))
    if sharding is not None:
        check_choice("sharding", sharding, get_args(ShardingName))
        if strategy == "ddp":
            raise UserError("sharding applies to FSDP; leave it out with strategy ddp, or use strategy fsdp.")
    if finetune not in (None, "lora", "full"):
        raise UserError(f"Unknown finetune {finetune!r}; choose lora or full (or leave it out for pretraining).")
    if quantize is not None:
        check_choice("quantize", quantize, QUANTIZE_CHOICES)
    if quantize is not None and finetune != "lora":
        raise UserError("quantize applies to frozen weights: use it with finetune lora (QLoRA).")
    lora_modules: tuple[str, ...] = ()
    if finetune == "lora":
        if isinstance(lora_r, bool) or not isinstance(lora_r, int) or lora_r < 1:
            raise UserError(f"lora_r must be a positive whole number, got {lora_r!r}.")
        if isinstance(lora_targets, str):
            lora_targets = (lora_targets,)
        if not lora_targets:
            raise UserError(f"lora_targets is empty; choose from {', '.join(LORA_TARGETS)}.")
        for target in lora_targets:
            check_choice("lora target", target, tuple(LORA_TARGETS))
        if quantize is not None and "head" in lora_targets:
            raise UserError("lora target head cannot be combined with quantize: the head is not quantized; drop 'head'.")
        if isinstance(lora_dropout, bool) or not isinstance(lora_dropout, (int, float)) or not 0 <= lora_dropout < 1:
            raise UserError(f"lora_dropout must be in [0, 1), got {lora_dropout!r}.")
        leaves = {leaf for t in lora_targets for leaf in LORA_TARGETS[t]}
        lora_modules = tuple(sorted(leaves))
    if memory_budget_gb is not None and (isinstance(memory_budget_gb, bool) or not memory_budget_gb > 0):
        raise UserError(f"memory_budget_gb must be a positive number of GiB, got {memory_budget_gb!r}.")
    if activation_checkpointing not in (None, True, False):
        raise UserError(
            f"activation_checkpointing must be true, false or left out, got {activation_checkpointing!r}."
        )
    if cpu_offload not in (True, False):
        raise UserError(f"cpu_offload must be true or false, got {cpu_offload!r}.")

    notes: list[str] = []
    world = devices * num_nodes
    columns: list[Column] = []
    if world == 1:
        columns.append(make_column("single", 1, 1))
        if strategy != "auto" or sharding is not None:
            notes.append("One device in total: a single device is used whatever the strategy.")
    else:
        if quantize == "nf4":
            # finetune_lora shards torchao's NF4 base with FSDP2 (`plan_quantized_base`), never DDP.
            if strategy == "ddp":
                raise UserError("quantize nf4 shards the base with FSDP: leave strategy out (or use quantize "
                                "bnb.nf4, which DDP replicates).")
            notes.append(f"QLoRA nf4 on {world} devices runs as finetune_lora runs it: FSDP2 shards the NF4 base "
                         "like every frozen weight, so its bytes per device fall as 1/N.")
        if quantize is not None and quantize != "nf4":
            from toolkit.parallel.plan import QUANTIZED_BASE_NOT_SHARDED

            if strategy == "fsdp" or sharding is not None:
                raise UserError(
                    f"quantize cannot be combined with FSDP sharding: {QUANTIZED_BASE_NOT_SHARDED}. Leave strategy "
                    "and sharding out: finetune_lora then replicates the quantized base and synchronises the adapters."
                )
            columns.append(make_column("DDP", devices, num_nodes))
            notes.append(
                f"QLoRA on {world} devices runs as finetune_lora runs it: every device holds the whole quantized base "
                "and DDP synchronises only the LoRA adapters (the DDP column)."
            )
        else:
            if strategy == "ddp":
                columns.append(make_column("DDP", devices, num_nodes))
            else:
                wanted = [sharding] if sharding else ["NO_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "FULL_SHARD"]
                if quantize == "nf4" and not sharding:
                    # QLoRA shards its base to fit: finetune_lora's default sharding (HYBRID_SHARD, which
                    # is FULL_SHARD on one node) and FULL_SHARD; NO_SHARD and SHARD_GRAD_OP keep every
                    # device's whole base (on the device, or in host memory with CPU offload).
                    wanted = ["HYBRID_SHARD", "FULL_SHARD"]
                for s in wanted:
                    if s == "HYBRID_SHARD" and (num_nodes == 1 or devices == 1):
                        why = "one node" if num_nodes == 1 else "one device per node"
                        notes.append(f"HYBRID_SHARD with {why} runs as FULL_SHARD (see toolkit.parallel.plan.effective_sharding).")
                        if sharding:
                            columns.append(make_column("FULL_SHARD", devices, num_nodes))
                        continue
                    columns.append(make_column(s, devices, num_nodes))
                if strategy == "auto" and sharding is None and quantize is None:
                    columns.append(make_column("DDP", devices, num_nodes))
        if quantize == "nf4":
            for col in columns:
                weight = nf4_unshardable(config, col.shard_size)
                if weight is not None:
                    raise UserError(
                        f"quantize nf4 cannot split {weight} over {col.shard_size} shards ({col.name}): each needs "
                        "whole groups of 16384 values; use fewer devices or quantize bnb.nf4."
                    )
    if cpu_offload and not any(col.kind == "fsdp" for col in columns):
        notes.append("cpu_offload applies to FSDP only (more than one device, not DDP): ignored.")
    columns.sort(key=lambda col: COLUMN_ORDER.index(col.name))
    opts = Options(config, name, finetune, lora_modules, lora_r, quantize, max_seq_length,
                   lora_dropout=float(lora_dropout) if finetune == "lora" else 0.0, cpu_offload=cpu_offload)  # fmt: skip
    return opts, columns, notes, activation_checkpointing


# --------------------------------------------------------------------------------------------
# Recommendation
# --------------------------------------------------------------------------------------------


def _max_micro_batch(opts: Options, column: Column, checkpointing: bool, budget: int) -> tuple[int, dict]:
    """The largest micro batch that fits in `budget` bytes (0 if not even one), and its figures."""
    key = "total_checkpointed" if checkpointing else "total"
    one = column_memory(opts, column, 1)
    if one[key] > budget:
        return 0, one
    two = column_memory(opts, column, 2)
    per_sample = two[key] - one[key]
    if per_sample <= 0:
        return 1 << 20, one
    m = 1 + (budget - one[key]) // per_sample
    while m > 1 and column_memory(opts, column, m)[key] > budget:
        m -= 1
    return m, column_memory(opts, column, m)


def recommend(opts: Options, columns: list[Column], micro_batch_size: int, budget_gb: float,
              checkpointing: Optional[bool], devices: int, num_nodes: int) -> dict[str, Any]:  # fmt: skip
    """The cheapest set-up that fits `budget_gb` GiB per device.

    Without activation checkpointing first (it costs about a third more compute): the cheapest
    strategy (communication) that fits the requested micro batch, else the strategy that fits the
    largest micro batch. Checkpointing only when nothing fits without it.
    """
    budget = int(budget_gb * GiB)
    choices = [False, True] if checkpointing is None else [checkpointing]
    for ckpt in choices:
        fits = [(col, *_max_micro_batch(opts, col, ckpt, budget)) for col in columns]
        fits = [(col, m, fig) for col, m, fig in fits if m >= 1]
        if not fits:
            continue
        enough = [f for f in fits if f[1] >= micro_batch_size]
        col, m, _ = enough[0] if enough else max(fits, key=lambda f: f[1])  # max() keeps the first of ties
        m = min(m, 4096)
        pow2 = 1 << (m.bit_length() - 1)
        micro = micro_batch_size if enough else pow2
        fig = column_memory(opts, col, micro)
        total = fig["total_checkpointed" if ckpt else "total"]
        return {
            "fits": True,
            "strategy": col.name,
            "activation_checkpointing": ckpt,
            "micro_batch_size": micro,
            "max_micro_batch_size": m,
            "total": total,
            "budget": budget,
            "options": _training_options(col, micro, ckpt, opts.cpu_offload),
            "message": (
                f"Fits in {budget_gb:g} GiB per device: {_describe(col)}, micro batch {micro}"
                f"{'' if micro == m else f' (up to {m} fits)'}, activation checkpointing "
                f"{'on' if ckpt else 'off'}: {total / GiB:.2f} GiB.\n"
                f"Training options: {_training_options(col, micro, ckpt, opts.cpu_offload)}"
            ),
        }
    # Nothing fits: say by how much and what would help.
    best = min(columns, key=lambda col: column_memory(opts, col, 1)["total_checkpointed"])
    need = column_memory(opts, best, 1)["total_checkpointed"]
    hints = []
    if opts.finetune != "lora":
        hints.append("fine-tune with LoRA (--finetune lora)")
    elif opts.quantize is None:
        hints.append("quantize the frozen weights (--quantize nf4)")
    more = _devices_needed(opts, budget)
    if more and more > devices * num_nodes:
        hints.append(f"more devices (FULL_SHARD fits on {more} devices in total, micro batch 1, checkpointing)")
    fig = column_memory(opts, best, 1)
    sequence = fig["activations_checkpointed"] + fig["logits_and_loss"]
    if more is None or sequence > budget / 4:
        hints.append(
            f"a shorter --max_seq_length (one sequence's activations and logits alone take {sequence / GiB:.2f} GiB)"
        )
    if opts.quantize in (None, "nf4") and devices * num_nodes > 1 and not opts.cpu_offload:
        hints.append(
            "CPU offload of FSDP parameters, gradients and optimizer state (--distributed.cpu_offload true; slow)"
        )
    return {
        "fits": False,
        "strategy": best.name,
        "activation_checkpointing": True,
        "micro_batch_size": 1,
        "total": need,
        "budget": budget,
        "message": (
            f"Does not fit in {budget_gb:g} GiB per device: the smallest set-up here ({_describe(best)}, "
            f"micro batch 1, activation checkpointing) needs {need / GiB:.2f} GiB. Try: " + "; ".join(hints) + "."
        ),
    }


def _devices_needed(opts: Options, budget: int) -> Optional[int]:
    if opts.quantize not in (None, "nf4"):  # bitsandbytes: replicated, more devices do not help
        return None
    world = 2
    while world <= 8192:
        if opts.quantize == "nf4" and nf4_unshardable(opts.config, world):
            return None
        if column_memory(opts, make_column("FULL_SHARD", world, 1), 1)["total_checkpointed"] <= budget:
            return world
        world *= 2
    return None


def _describe(col: Column) -> str:
    return {"single": "one device", "ddp": "DDP"}.get(col.kind, f"FSDP {col.name}")


def _training_options(col: Column, micro_batch_size: int, checkpointing: bool, cpu_offload: bool = False) -> str:
    """The same set-up as options of the training commands."""
    options = []
    if col.kind == "ddp":
        options.append("--distributed.strategy ddp")
    elif col.kind == "fsdp":
        options.append(f"--distributed.sharding {col.name}")
        if cpu_offload:
            options.append("--distributed.cpu_offload true")
    options.append(f"--train.micro_batch_size {micro_batch_size}")
    options.append(f"--distributed.activation_checkpointing {'true' if checkpointing else 'false'}")
    return " ".join(options)


# --------------------------------------------------------------------------------------------
# Printing
# --------------------------------------------------------------------------------------------

_ROWS = [
    ("parameters", "parameters", None),
    ("gradients", "gradients", None),
    ("optimizer_state", "optimizer state (AdamW)", None),
    ("activations", "activations", False),
    ("activations_checkpointed", "activations, checkpointed", True),
    ("logits_and_loss", "logits and loss", None),
    ("weight_copies", "autocast weight copies", None),
    ("buffers", "FSDP/DDP/quantization buffers", None),
    ("step_scratch", "optimizer step scratch", None),
    ("total", "peak", False),
    ("total_checkpointed", "peak, checkpointed", True),
]


def format_table(result: dict[str, Any]) -> str:
    cols = result["columns"]
    figures = result["strategies"]
    ckpt = result["activation_checkpointing"]
    rows = [(key, label) for key, label, when in _ROWS if when is None or ckpt is None or when == ckpt]
    biggest = max(figures[c][k] for c in cols for k, _ in rows)
    unit, scale = ("GiB", GiB) if biggest >= GiB else ("MiB", 1024**2)
    width = max(len(label) for _, label in rows) + 2
    cell = max(11, *(len(c) + 2 for c in cols))
    tokens = result["micro_batch_size"] * result["max_seq_length"]
    what = {None: "pretraining", "full": "full fine-tuning", "lora": "LoRA"}[result["finetune"]]
    if result["quantize"]:
        what = f"QLoRA ({result['quantize']})"
    lines = [
        f"{result['model']}: {result['parameters']:,} parameters ({result['trainable_parameters']:,} trainable), "
        f"{what}, {result['precision']}",
        f"micro batch {result['micro_batch_size']} x {result['max_seq_length']} tokens = {tokens:,} tokens per device, "
        f"{result['devices']} device(s) x {result['num_nodes']} node(s). Memory per device, {unit}:",
        "",
        "".ljust(width) + "".join(c.rjust(cell) for c in cols),
    ]
    for key, label in rows:
        if key in ("total", "total_checkpointed"):
            lines.append("-" * (width + cell * len(cols)))
        lines.append(label.ljust(width) + "".join(f"{figures[c][key] / scale:.2f}".rjust(cell) for c in cols))
    lines.append("")
    lines.append(
        "peak = parameters + gradients + optimizer state + the most of the other rows alive at one moment of the step"
    )
    for note in result["notes"]:
        lines.append(f"note: {note}")
    if result["recommendation"]:
        lines.append(result["recommendation"]["message"])
    return "\n".join(lines)
