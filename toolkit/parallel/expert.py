"""Expert parallelism (`--distributed.expert_parallel N`), applied to a model from outside.

Each MoE layer's X experts are split over the N ranks of an expert-parallel group: rank j of the
group keeps experts [j * X/N, (j + 1) * X/N), and the layer's tokens travel to the experts they
were routed to and back. Nothing in the model changes: `toolkit.models.moe.MoE` sorts its M
token-expert rows by expert and calls `experts(rows (M, C), counts (X,))`; here that call is
replaced, on each rank, by

    counts (X,) --all-to-all--> rows each group rank sends me, per my local expert (N, X/N)
    rows (M, C) --all-to-all--> the rows of my X/N experts from every group rank, by sender
    regroup by local expert -> the local grouped experts (X/N of them) -> back in arrival order
    --all-to-all back--> (M, C) in the order the layer sorted them

all-to-all's backward is the reverse all-to-all (`_AllToAll`), so gradients reach the experts
from every rank's tokens and reach each rank's tokens from every expert.

The mesh. The experts' mesh splits the data-parallel mesh's innermost dimension (the ranks of one
node under HYBRID_SHARD, `toolkit.parallel.plan.expert_mesh_layout`):

    FULL_SHARD, 4 ranks, N = 2      ("expert_shard", "expert")           (2, 2)
    HYBRID_SHARD, 2 nodes x 4, N=2  ("replicate", "expert_shard", "expert")  (2, 2, 2)

         expert ->   0        1               rank = expert_shard * N + expert
    expert_shard 0   r0       r1              r0, r1: one all-to-all group, experts [0, X/2) on r0
    expert_shard 1   r2       r3              r0, r2: hold the same experts; FSDP shards them there

Each expert weight is a DTensor placed Shard(0) on "expert" (so torch's distributed checkpoint
stores it by expert rows, and a checkpoint reshards across expert-parallel sizes); FSDP2
(`fully_shard`, one unit per experts module) shards it further over the ranks holding the same
experts ("expert_shard", replicated over "replicate" under HYBRID_SHARD), while the rest of the
model (attention, norms, router, embedding, head) is sharded over all ranks as without expert
parallelism (`toolkit.parallel.fsdp.shard_model`).

Gradients. The loop scales each rank's loss so that the mean of the ranks' gradients is the step's
gradient (`toolkit.training.objectives`), and FSDP2 averages a dense weight's gradient over all W
ranks. An expert's gradient on its rank already sums what the N ranks of its group sent it, and
FSDP2 averages it over the W / N ranks holding that expert only: N times too large. So the local
expert weights enter the computation through `_ScaleGradient` (identity forward, gradient / N):
N processes train as one process does, on any backend, with FSDP2's own reduction.
(`set_gradient_divide_factor(W)` would say the same, but with the sum-then-divide reduction gloo
needs, torch 2.13 divides twice when the ranks holding an expert are one.)
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from toolkit.models.moe import GroupedExperts, LowRankUpdate
from toolkit.models.switch import Switch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

EXPERT_DIM = "expert"  # the mesh dimension of an all-to-all group
# Whether the all-to-alls are sized as balanced routing would size them (`balanced_exchange`).
BALANCED = Switch("balanced expert exchange", False, (False, True))


def balanced_exchange():
    """Inside the `with` block, expert parallelism's all-to-alls move the rows balanced routing
    would: each rank sends every rank of its group an equal share of its routed rows, and gets as
    many from each. For fake tensors (the memory simulation), whose routed counts have no values
    to size the exchange by; the estimate assumes balanced routing too."""
    return BALANCED.use(True)


class _AllToAll(torch.autograd.Function):
    """Rows (sum(send), ...) -> rows (sum(receive), ...): send[j] rows to group rank j, receive[j]
    rows from it, in group-rank order. Its backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, send: list[int], receive: list[int], group: Any) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, group
        return _all_to_all(rows, send, receive, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _all_to_all(grad, ctx.receive, ctx.send, ctx.group), None, None, None


def _all_to_all(rows: torch.Tensor, send: list[int], receive: list[int], group: Any) -> torch.Tensor:
    out = rows.new_empty((sum(receive), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=receive, input_split_sizes=send, group=group)
    return out


class _ScaleGradient(torch.autograd.Function):
    """x -> x; its gradient is multiplied by `factor`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad * ctx.factor, None


@contextmanager
def _local_weights(module: nn.Module, gradient_factor: float) -> Iterator[None]:
    """Inside the block, `module`'s DTensor parameters read as their local tensors (this rank's
    experts, gathered by FSDP), so that its own forward computes on plain tensors. Gradients flow
    to the DTensor parameters through `to_local`, multiplied by `gradient_factor`. (Not
    `torch.func.functional_call`: it calls the module, whose FSDP hooks would run a second time.)"""
    from torch.distributed.tensor import DTensor

    saved = dict(module._parameters)
    try:
        for name, param in saved.items():
            if isinstance(param, DTensor):
                module._parameters[name] = _ScaleGradient.apply(param.to_local(), gradient_factor)  # type: ignore[assignment]
        yield
    finally:
        module._parameters.update(saved)


def expert_parallel_forward(experts: GroupedExperts, group: Any, rows: torch.Tensor, counts: torch.Tensor,
                            low_rank: Optional[dict[str, LowRankUpdate]] = None) -> torch.Tensor:  # fmt: skip
    """`GroupedExperts.forward` over an all-to-all group: rows (M, C) sorted by expert, counts (X,)
    rows per expert -> (M, C), row i computed by its expert wherever that expert lives.

    `low_rank` (LoRA on the experts) holds every expert's factors, whole on every rank (the adapters
    are sharded with the dense weights, not by expert); each rank applies its own experts' rows of
    them. Their gradients need no scaling: the rank holding an expert computes its factors' gradient
    for the rows its whole group sent, the other ranks add zeros, and FSDP2 averages over all W ranks.
    """
    n = group.size()
    local = counts.numel() // n  # L experts per rank
    if low_rank:
        mine = slice(group.rank() * local, (group.rank() + 1) * local)
        low_rank = {name: LowRankUpdate(u.A[mine], u.B[mine], u.scale) for name, u in low_rank.items()}
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)  # [j * L + e]: rows rank j sends my expert e
    received = received.view(n, local)
    # Rows to each group rank, rows from each (one host sync: all-to-all takes its sizes as lists).
    if BALANCED.value:
        rows_sent = rows.shape[0]
        send = [rows_sent // n + (j < rows_sent % n) for j in range(n)]
        receive = [rows_sent // n + (group.rank() < rows_sent % n)] * n
    else:
        send, receive = torch.stack([counts.view(n, local).sum(dim=1), received.sum(dim=1)]).tolist()
    arrived = _AllToAll.apply(rows, send, receive, group)  # (R, C), by (sender, local expert)
    # Regroup by (local expert, sender): each local expert's rows become one contiguous run.
    runs = torch.arange(n * local, device=counts.device)  # run j * L + e: sender j, local expert e
    run_of_row = torch.repeat_interleave(runs, received.reshape(-1), output_size=arrived.shape[0])
    order = ((run_of_row % local) * n + run_of_row // local).argsort(stable=True)
    if arrived.shape[0]:
        with _local_weights(experts, 1.0 / n):  # see the module's docstring, Gradients
            out = GroupedExperts.forward(experts, arrived[order], received.sum(dim=0), low_rank)  # (R, C)
        # Arrival order again, in the dtype the rows came in: every rank sends the same dtype back.
        out = out[order.argsort()].to(arrived.dtype)
    else:
        # No row for this rank's experts: nothing to compute (one product per expert would leave no
        # graph). The backward pass must still reach the all-to-all above: the group's other ranks run it,
        # and the adapters' factors, whose gradients every rank reduces (zeros here).
        out = arrived * 0
        for update in (low_rank or {}).values():
            out = out + (update.A.sum() + update.B.sum()).to(out.dtype) * 0
    return _AllToAll.apply(out, receive, send, group)  # (M, C), the layer's order


def expert_units(model: nn.Module) -> list[GroupedExperts]:
    """The experts modules of every MoE layer of `model`, in order (inside peft's adapters on them, if any)."""
    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


def distribute_experts(experts: GroupedExperts, mesh: DeviceMesh) -> None:
    """Keep only this rank's experts of each weight, as a DTensor placed Shard(0) on the 1-D
    expert-parallel `mesh`; on the meta device (a model before set-up) nothing is allocated."""
    from torch.distributed.tensor import DTensor, Shard

    n, rank = mesh.size(), mesh.get_local_rank()
    for name, param in list(experts.named_parameters(recurse=False)):
        if isinstance(param, DTensor):
            continue
        rows = param.shape[0] // n
        local = param.detach().narrow(0, rank * rows, rows)
        local = local if param.is_meta else local.clone()
        value = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride())
        experts.register_parameter(name, nn.Parameter(value, requires_grad=param.requires_grad))


def shard_experts(model: nn.Module, expert_mesh: DeviceMesh, placement: Optional[Callable[[nn.Module, int], Any]] = None,
                  **fsdp_options: Any) -> list[nn.Module]:  # fmt: skip
    """Apply expert parallelism to every MoE layer of `model` on `expert_mesh` (`expert_mesh_layout`):
    each experts module keeps this rank's experts, calls them through the all-to-all, and becomes
    an FSDP2 unit over the mesh's other dimensions. `placement(unit, shards)` gives the unit's
    `shard_placement_fn` for a shard group of `shards` ranks (`toolkit.parallel.fsdp.expert_placement`);
    `fsdp_options` go to `fully_shard` (precision and offload policies, resharding). Call it before
    the blocks are sharded. Returns the units."""
    from torch.distributed.fsdp import fully_shard

    names = expert_mesh.mesh_dim_names
    ep_mesh = expert_mesh[EXPERT_DIM]
    data_mesh = expert_mesh[tuple(d for d in names if d != EXPERT_DIM)]
    group = ep_mesh.get_group()
    units = []
    for experts in expert_units(model):
        if experts.gate_up_proj.shape[0] % ep_mesh.size():
            raise ValueError(f"{experts.gate_up_proj.shape[0]} experts do not split over {ep_mesh.size()} ranks")
        distribute_experts(experts, ep_mesh)
        experts.forward = partial(expert_parallel_forward, experts, group)  # type: ignore[method-assign]
        shards = expert_mesh.size(names.index("expert_shard"))
        fully_shard(experts, mesh=data_mesh, shard_placement_fn=placement(experts, shards) if placement else None,
                    **fsdp_options)
        # A rank whose experts got no rows still takes part in their gradients' reduction, with zeros.
        experts.set_reduce_scatter_unused_params(True)
        units.append(experts)
    return units


def expert_shard_group(expert_mesh: DeviceMesh) -> Any:
    """The process group over which FSDP2 shards the experts (the ranks holding the same experts)."""
    return expert_mesh.get_group("expert_shard")


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                   error_if_nonfinite: bool = False) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for gradients sharded on different device meshes that each
    span every rank (the experts' and the dense weights'), which torch's own cannot combine.

    Each rank adds up its shards' |g|^p, each divided by the number of ranks holding that same
    shard (the mesh dims it is replicated over), and one all-reduce over all ranks gives the total;
    every rank gets the same norm and scales its shards in place. Returns the norm before clipping.
    """
    import math

    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    world = dist.get_world_size()
    p = float(norm_type)
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    shards = []
    for grad in grads:
        copies = world
        if isinstance(grad, DTensor):
            mesh = grad.device_mesh
            if mesh.size() != world:
                raise ValueError(f"a gradient on a mesh of {mesh.size()} of the {world} ranks")
            copies = math.prod(mesh.size(i) for i, placement in enumerate(grad.placements) if placement.is_replicate())
            grad = grad.to_local()
        shards.append(grad)
        norm = torch.linalg.vector_norm(grad, p, dtype=torch.float32)
        total = torch.maximum(total, norm) if math.isinf(p) else total + norm.pow(p) / copies
    dist.all_reduce(total, op=dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM)
    if not math.isinf(p):
        total = total.pow(1.0 / p)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {p} of the gradients is non-finite, so it cannot be clipped.")
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for shard in shards:
        shard.mul_(scale.to(shard.dtype))
    return total
