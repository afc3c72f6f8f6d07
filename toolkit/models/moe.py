"""The mixture-of-experts feed-forward layer: a router and grouped experts (Mixtral, Qwen3-MoE,
OLMoE, gpt-oss), and the router's losses.

Shapes: N tokens (B * T) in this call, C n_embd, X experts, K experts per token, I each expert's
hidden width (`Config.moe_intermediate_size`), M = N * K token-expert assignments.

Routing is dropless token choice: every token goes to the K experts its router scores highest, with
no capacity limit, weighted by their softmax probabilities (renormalised over the K when
`Config.router_norm_topk`). The M assignments are sorted by expert, so each expert's tokens are one
contiguous run of rows, and the experts run as two grouped matrix products over those runs
(`torch._grouped_mm`), or one product per expert (`expert_backend("loop")`, the reference and the
fallback where grouped products are missing).

The experts are one module, `GroupedExperts`, whose call takes the sorted rows and the run lengths
and gives one output row per input row, in the same order. That is the seam expert parallelism
(`toolkit.parallel.expert`) plugs into from outside: it replaces the call with one that sends each
run to the rank holding its expert and brings the results back, and nothing here changes.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from toolkit.models.config import Config
from toolkit.models.mlp import gated_activation
from toolkit.models.switch import Switch

# Which kernel runs the experts: "grouped" (torch._grouped_mm: one product per weight for all
# experts), "loop" (a product per expert), None: grouped where torch has it (`_use_grouped`), else loop.
KERNEL = Switch("expert backend", None, (None, "grouped", "loop"))
# On a CPU a 16-bit matrix product runs through oneDNN, which compiles a kernel for each shape it
# meets and keeps the last 1,024. Every expert's run of rows is a product of its own height, and
# routing changes the heights at every step, so unpadded a CPU keeps compiling: a third of a small
# Qwen3-MoE step in bf16 (benchmarks/README.md, "MoE step against LitGPT"). Runs padded with zero
# rows to a multiple of RUN_ROWS meet a few dozen heights, whose kernels stay compiled.
RUN_ROWS = 32
# Whether grouped products on a CPU pad the runs (`_pads_runs`); off where fake tensors on the CPU
# stand for a GPU's step, whose grouped kernels take runs of any height.
PADDED_RUNS = Switch("padded expert runs", True, (True, False))
# Whether MoE layers keep what they routed (`MoE.router_stats`); `router_stats_off` clears it for
# forward passes whose routing no loss reads.
RECORDING = Switch("router recording", True, (True, False))


class CountedTokens:
    """(N,) bool, the tokens of the forward pass under way that the router losses count (None: all);
    padding is routed as every token but counted by none of the losses nor the load (transformers
    counts it out alike through `attention_mask`). Set from outside the model (`counting_only`)."""

    value: Optional[torch.Tensor] = None


COUNTED = CountedTokens()


@contextmanager
def counting_only(tokens: Optional[torch.Tensor]) -> Iterator[None]:
    """Inside the `with` block, MoE layers count only `tokens` (B, T) bool in their `router_stats`."""
    saved, COUNTED.value = COUNTED.value, None if tokens is None else tokens.reshape(-1)
    try:
        yield
    finally:
        COUNTED.value = saved


def as_recomputed():
    """The context of a checkpointed block's recomputation, made when its forward pass runs (entered
    in the backward pass): routing again keeps no `router_stats`, and counts the tokens the forward
    pass counted, so that it saves the router terms' weights the forward pass saved."""
    return _recomputing(COUNTED.value)


@contextmanager
def _recomputing(counted: Optional[torch.Tensor]) -> Iterator[None]:
    with router_stats_off():
        saved, COUNTED.value = COUNTED.value, counted
        try:
            yield
        finally:
            COUNTED.value = saved


def expert_backend(name: Optional[str]):
    """Inside the `with` block, experts run through `name` ("grouped", "loop"; None: chosen by device)."""
    return KERNEL.use(name)


def expert_runs_as_on_a_gpu():
    """Inside the `with` block, grouped products on a CPU leave the experts' runs unpadded, as a GPU
    computes them (see RUN_ROWS): for fake tensors on the CPU that stand for a GPU's step."""
    return PADDED_RUNS.use(False)


def router_stats_off():
    """Inside the `with` block, MoE layers route without keeping `router_stats`: a preference loss's
    reference pass (the trained model with its adapters off must not replace the policy's stats), a
    checkpointed block's recomputation in the backward pass (its stats would outlive the step,
    holding the router's logits through their graph)."""
    return RECORDING.use(False)


def _use_grouped(weight: torch.Tensor) -> bool:
    """Grouped products where torch has them for the weights: on the CPU eagerly in any dtype, compiled
    in bf16 only (the shape function that compiled blocks trace takes bf16 alone); on CUDA in bf16 on
    compute capability 9.0+. The dtype is autocast's where it is on."""
    if KERNEL.value is not None:
        return KERNEL.value == "grouped"
    if not hasattr(torch, "_grouped_mm"):
        return False
    device = weight.device.type
    dtype = torch.get_autocast_dtype(device) if device != "meta" and torch.is_autocast_enabled(device) else weight.dtype
    if device == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(weight.device)[0] >= 9
    return device in ("cpu", "meta") and (dtype == torch.bfloat16 or not torch.compiler.is_compiling())


def _as_linear_computes(*tensors: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
    """The tensors in the dtype a Linear layer would compute them in: autocast's where it is on for
    their device (autocast casts `F.linear`'s operands but leaves `_grouped_mm` alone), else as they
    are. Under "*-mixed" the rows arrive in float32 (the residual stream's dtype) and the weights
    in float32 (one device) or 16 bits (gathered by FSDP): both are cast, as a Linear's would be."""
    device = next(t for t in tensors if t is not None).device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(None if t is None else t.to(dtype) for t in tensors)


class GroupedExperts(nn.Module):
    """X gated MLPs held as 3-D weights, one matrix per expert stacked on dim 0, each shaped like an
    `nn.Linear` weight (out, in):

        gate_up_proj (X, 2I, C): rows [0, I) the gate projection, [I, 2I) the up projection
        down_proj    (X, C, I)
        gate_up_bias (X, 2I), down_bias (X, C): with `Config.bias` only (gpt-oss)

    `forward(x, counts, low_rank)`: x (M, C) rows sorted by expert, counts (X,) rows per expert ->
    (M, C), row i computed by the expert it belongs to; `low_rank` maps a weight's name to an update
    of it (`LowRankUpdate`, LoRA's adapters), added without forming the updated weight.
    """

    def __init__(self, config: Config) -> None:
        super().__init__()
        X, C, I = config.n_expert, config.n_embd, config.moe_intermediate_size
        self.config = config
        self.hidden = I
        self.gate_up_proj = nn.Parameter(torch.empty(X, 2 * I, C))
        self.down_proj = nn.Parameter(torch.empty(X, C, I))
        self.gate_up_bias = nn.Parameter(torch.empty(X, 2 * I)) if config.bias else None
        self.down_bias = nn.Parameter(torch.empty(X, C)) if config.bias else None

    def forward(self, x: torch.Tensor, counts: torch.Tensor,
                low_rank: Optional[dict[str, LowRankUpdate]] = None) -> torch.Tensor:  # fmt: skip
        grouped = _use_grouped(self.gate_up_proj)
        low_rank = low_rank or {}
        experts = None  # (M,) each row's expert, for the biases
        if self.gate_up_bias is not None:
            experts = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts, output_size=x.shape[0])
        h = self.product(x, self.gate_up_proj, counts, grouped)  # (M, 2I)
        if "gate_up_proj" in low_rank:
            h = h + low_rank_product(x, low_rank["gate_up_proj"], counts).to(h.dtype)
        if self.gate_up_bias is not None:
            h = h + self.gate_up_bias[experts]
        h = gated_activation(h[:, : self.hidden], h[:, self.hidden :], self.config).contiguous()  # (M, I)
        y = self.product(h, self.down_proj, counts, grouped)  # (M, C)
        if "down_proj" in low_rank:
            y = y + low_rank_product(h, low_rank["down_proj"], counts).to(y.dtype)
        if self.down_bias is not None:
            y = y + self.down_bias[experts]
        return y

    def weight_shape(self, name: str) -> tuple[int, int, int]:
        """(X, out, in) of the weight `name` ("gate_up_proj", "down_proj"), however it is stored (a
        subclass may hold it otherwise: NF4 holds the experts as (X * out, in))."""
        X, C, I = self.config.n_expert, self.config.n_embd, self.hidden
        return {"gate_up_proj": (X, 2 * I, C), "down_proj": (X, C, I)}[name]

    def product(self, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, grouped: bool) -> torch.Tensor:
        """x (M, in) sorted by expert, weight (X, out, in) -> (M, out). The seam a subclass that stores
        the weights otherwise (`toolkit.parallel.nf4`'s 4-bit experts) changes."""
        return expert_product(x, weight, counts, grouped)


def expert_product(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, grouped: bool) -> torch.Tensor:
    """x (M, in), rows sorted by expert, counts (X,) rows per expert, weight (X, out, in) -> (M, out):
    each expert's run of rows times its matrix, as one grouped product or one product per expert.
    Under autocast both take its dtype (`_as_linear_computes`), else the rows take the weight's: under
    FSDP's mixed precision the experts are gathered in bf16 while the rows may arrive in float32."""
    x, weight = _as_linear_computes(x, weight)
    x = x.to(weight.dtype)
    if grouped:
        if _pads_runs(x):
            return _padded_grouped_product(x, weight.transpose(-2, -1), counts)
        ends = counts.cumsum(0).to(torch.int32)  # (X,) where each expert's run ends
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=ends)
    # Compiled, the loop runs eagerly: traced, every new pattern of row counts (an expert with none)
    # would compile the rest of the block again, up to dynamo's recompile limit.
    looped = torch.compiler.disable(_looped_product) if torch.compiler.is_compiling() else _looped_product
    return looped(x, weight, counts)


def _looped_product(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`expert_product` as one product per expert with rows (a host sync for the counts)."""
    # unbind, not indexing: the backward of weight[e] would write a zero gradient of the whole
    # (X, ...) tensor per expert, X times; unbind's stacks the X gradients once
    matrices = weight.unbind(0)
    outputs = [F.linear(rows, matrices[e]) for e, rows in enumerate(x.split(counts.tolist(), dim=0)) if rows.shape[0]]
    return torch.cat(outputs) if outputs else x.new_zeros(0, weight.shape[1])


def _pads_runs(x: torch.Tensor) -> bool:
    """Whether grouped products pad each expert's run (`_padded_grouped_product`): 16-bit rows on a
    CPU, unless `expert_runs_as_on_a_gpu` (the memory recording under a GPU's rules, the simulation)."""
    return PADDED_RUNS.value and x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)


def _padded_grouped_product(x: torch.Tensor, weight_t: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x (M, in) sorted by expert, weight_t (X, in, out), counts (X,) -> (M, out), as one grouped
    product over runs padded with zero rows to a multiple of RUN_ROWS. The padded rows are never read
    back, so they add nothing to any gradient. The buffer holds M + X * (RUN_ROWS - 1) rows, a bound
    known without the counts' values: a shape fixed when compiled, and the same on the fake tensors
    of the memory recording (`toolkit.memory.activations`) as in the run. Rows after the last run
    are not computed."""
    M, X = x.shape[0], counts.numel()
    padded = (counts + RUN_ROWS - 1) // RUN_ROWS * RUN_ROWS  # (X,)
    moved = (padded.cumsum(0) - padded) - (counts.cumsum(0) - counts)  # (X,) how far each run moves down
    expert = torch.repeat_interleave(torch.arange(X, device=x.device), counts, output_size=M)  # (M,)
    slots = torch.arange(M, device=x.device) + moved[expert]  # (M,) each row's place among the padded
    rows = x.new_zeros(M + X * (RUN_ROWS - 1), x.shape[1]).index_copy(0, slots, x)
    out = torch._grouped_mm(rows, weight_t, offs=padded.cumsum(0).to(torch.int32))
    return out.index_select(0, slots)


@dataclass(frozen=True)
class LowRankUpdate:
    """A rank-r update of one of the experts' weights (X, out, in): expert e's matrix W_e becomes
    W_e + scale * B_e @ A_e, with A (X, r, in) and B (X, out, r).

    It is applied to the rows, not to the weight (`low_rank_product`): two more grouped products
    through an (M, r) intermediate. W + dW, the size of all the experts, is never formed: nothing
    that size is kept for the backward pass, and a frozen W gets no gradient product of its size."""

    A: torch.Tensor
    B: torch.Tensor
    scale: float


def low_rank_product(x: torch.Tensor, update: LowRankUpdate, counts: torch.Tensor) -> torch.Tensor:
    """x (M, in) sorted by expert, counts (X,) -> (M, out): scale * (x A_e^T) B_e^T for each row's expert e.
    In the rows' dtype (or autocast's), as the experts' own product: adapters kept in float32 over a
    bf16 base (peft's default) would otherwise leave the grouped kernels, which take bf16 alone
    compiled or on a GPU."""
    A, B = update.A.to(x.dtype), update.B.to(x.dtype)
    grouped = _use_grouped(A)
    if grouped:
        # Grouped products take operands whose rows are whole 16-byte units (in bf16 a rank that is
        # a multiple of 8): the rank is padded with zeros, which add nothing and whose gradients
        # are dropped. The copies are also what makes the operands dense: peft stores B with the
        # experts fastest (`FactoredExpertLoRA`), a layout no grouped kernel reads.
        device = A.device.type
        dtype = torch.get_autocast_dtype(device) if device != "meta" and torch.is_autocast_enabled(device) else A.dtype
        unit = max(1, 16 // dtype.itemsize)
        rank = -(-A.shape[1] // unit) * unit
        A, B = grouped_operand(A, 1, rank), grouped_operand(B, 2, rank)
    h = expert_product(x, A, counts, grouped)  # (M, r)
    return expert_product(h * update.scale, B, counts, grouped)


@torch.library.custom_op("toolkit::grouped_operand", mutates_args=())
def grouped_operand(weight: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """A dense copy of `weight` with dimension `dim` padded by zeros to `size`.

    An operator of its own so that compiled code keeps the copy as made: inductor otherwise drops a
    copy that only changes the layout and hands the grouped kernel the strided original."""
    padded = weight.new_zeros(*weight.shape[:dim], size, *weight.shape[dim + 1 :])
    padded.narrow(dim, 0, weight.shape[dim]).copy_(weight)
    return padded


@grouped_operand.register_fake
def _grouped_operand_shape(weight: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    return weight.new_empty(*weight.shape[:dim], size, *weight.shape[dim + 1 :])


def _grouped_operand_context(ctx, inputs, output) -> None:
    weight, dim, _ = inputs
    ctx.dim, ctx.size = dim, weight.shape[dim]


def _grouped_operand_backward(ctx, grad: torch.Tensor):
    return grad.narrow(ctx.dim, 0, ctx.size), None, None


grouped_operand.register_autograd(_grouped_operand_backward, setup_context=_grouped_operand_context)


@dataclass
class RouterStats:
    """What one MoE layer's last call routed; the router losses and the load metrics read it."""

    counts: torch.Tensor  # (X,) float32: assignments per expert (sum N * K), no gradient
    prob_sum: torch.Tensor  # (X,) float32: router probabilities summed over the N tokens
    z_sum: torch.Tensor  # () float32: logsumexp(router logits)^2 summed over the N tokens
    tokens: torch.Tensor  # () float32: N, or the tokens counted (`counting_only`)


class MoE(nn.Module):
    """Router and experts: x (B, T, C) -> (B, T, C), each token the weighted sum of its K experts'
    outputs. Keeps what it routed in `router_stats` for the router losses (`router_losses`)."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.top_k = config.n_expert_per_token
        self.n_expert = config.n_expert
        self.norm_topk = config.router_norm_topk
        self.router = nn.Linear(config.n_embd, config.n_expert, bias=config.bias)
        self.experts = GroupedExperts(config)
        self.router_stats: Optional[RouterStats] = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, C) -> router logits (N, X), probabilities (N, X) float32, the K chosen experts (N, K)
        and their weights (N, K) float32."""
        logits = self.router(x)  # (N, X), in the activations' dtype
        probs = logits.float().softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (N, K) each
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, probs, chosen, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        flat = x.reshape(-1, C)  # (N, C)
        logits, probs, chosen, weights = self.route(flat)
        assignments = chosen.reshape(-1)  # (M,): token n's k-th expert at n * K + k
        order = assignments.argsort(stable=True)  # assignments sorted by expert, tokens in order within one
        # (X,) rows per expert; a shape known before the data (bincount's is not), so the model runs on
        # fake tensors (the memory estimate and simulation)
        counts = assignments.new_zeros(self.n_expert).index_add_(0, assignments, torch.ones_like(assignments))
        token_of_row = order // self.top_k  # (M,)
        y = self.experts(flat[token_of_row], counts)  # (M, C)
        y = y * weights.reshape(-1)[order, None].to(y.dtype)
        out = torch.zeros_like(flat).index_add_(0, token_of_row, y.to(flat.dtype))
        # Computed whether kept or not, each token weighted 1, or 0 where it is not counted (padding,
        # `counting_only`): the same operations either way, so that a checkpointed block's
        # recomputation (outside the `with` block) saves what its forward pass saved.
        counted = COUNTED.value
        if counted is None or counted.shape[0] != flat.shape[0]:
            weight = probs.new_ones(flat.shape[0])  # (N,) float32
        else:
            weight = counted.to(torch.float32)
        z = torch.logsumexp(logits.float(), dim=-1).square()  # (N,)
        stats = RouterStats(
            counts=weight.new_zeros(self.n_expert).index_add_(0, assignments, weight.repeat_interleave(self.top_k)),
            prob_sum=(probs * weight[:, None]).sum(dim=0), z_sum=(z * weight).sum(), tokens=weight.sum(),
        )
        if RECORDING.value:
            self.router_stats = stats
        return out.view(B, T, C)


def moe_layers(model: nn.Module) -> list[MoE]:
    """The model's MoE layers in order (wrapped by FSDP or peft or not)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


@dataclass
class RouterLosses:
    """The router losses of the last forward pass over all MoE layers, and the experts' load."""

    aux: torch.Tensor  # () load-balancing loss, as transformers' `load_balancing_loss_func`
    z: torch.Tensor  # () mean over layers and tokens of logsumexp(logits)^2
    load: torch.Tensor  # (L, X) float32: each layer's assignments per expert, no gradient


def router_losses(layers: list[MoE], per_layer: bool = False) -> Optional[RouterLosses]:
    """The losses of what `layers` routed in their last call; None when none has routed.

    Load balancing (Switch Transformer's, as Mixtral, Qwen3-MoE and OLMoE define it in
    transformers): with f_x the share of all token-expert assignments over the layers that went to
    expert x (summing to K) and P_x its mean router probability over the layers' tokens,

        aux = X * sum_x f_x * P_x

    which is K for a perfectly even router and grows as the load concentrates. Pooled over the
    layers, two layers that send their tokens to different experts balance each other out;
    `per_layer` takes the mean over layers of each layer's own aux instead (K only when every layer
    is even).
    """
    stats = [layer.router_stats for layer in layers if layer.router_stats is not None]
    if not stats:
        return None
    counts = torch.stack([s.counts for s in stats])  # (L, X)
    prob_sums = torch.stack([s.prob_sum for s in stats])  # (L, X)
    if per_layer:
        tokens_per_layer = torch.stack([s.tokens for s in stats])[:, None]  # (L, 1)
        aux = counts.shape[1] * ((counts / tokens_per_layer) * (prob_sums / tokens_per_layer)).sum(dim=1).mean()
    else:
        tokens = sum(s.tokens for s in stats)
        aux = counts.shape[1] * ((counts.sum(dim=0) / tokens) * (prob_sums.sum(dim=0) / tokens)).sum()
    z = torch.stack([s.z_sum for s in stats]).sum() / sum(s.tokens for s in stats)
    return RouterLosses(aux=aux, z=z, load=counts)


def clear_router_stats(layers: list[MoE]) -> None:
    for layer in layers:
        layer.router_stats = None


def load_summary(load: torch.Tensor) -> dict[str, torch.Tensor]:
    """Expert load (L, X) -> min and max of each expert's assignments relative to an even share
    (1.0: balanced), and their coefficient of variation, over every layer and expert."""
    relative = load / load.mean(dim=1, keepdim=True).clamp(min=1e-9)
    return {"min": relative.min(), "max": relative.max(), "cv": relative.std(dim=1, unbiased=False).mean()}
