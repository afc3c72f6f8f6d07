"""FSDP2 applied to a model from outside: one `fully_shard` unit per transformer block (after
activation checkpointing, when asked), one per edge (the embedding; the final norm and head), then
the root, with the precision policies of the run's precision.

Every parameter is split along dim 0, except a mixture's expert weights when their experts do not
split evenly over the shard group (`expert_shard_dim`): those are split along dim 1.

Training reaches it through Fabric's strategy (`toolkit.training.fabric.ShardedStrategy.setup_module`);
the memory simulation (`toolkit.memory`) calls `shard_model` directly on a fake process group.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterator

from toolkit.parallel.precision import precision_dtypes

if TYPE_CHECKING:
    from torch import nn

    from toolkit.parallel.plan import StrategyPlan


def checkpoint_blocks(module: nn.Module, block_cls: type[nn.Module]) -> None:
    """Each `block_cls` recomputed in the backward pass (torch's non-reentrant checkpoint). The
    recomputation routes again without keeping a mixture of experts' router stats: the loss has
    read them in the forward pass, and kept they would hold the router's logits past the step."""
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    from toolkit.models.moe import as_recomputed

    if any(isinstance(m, CheckpointWrapper) for m in module.modules()):
        return  # already checkpointed (e.g. set up twice)
    apply_activation_checkpointing(
        module, checkpoint_wrapper_fn=partial(checkpoint_wrapper, context_fn=lambda: (nullcontext(), as_recomputed())),
        check_fn=lambda m: isinstance(m, block_cls),
    )


def shard_model(module: nn.Module, mesh: Any, plan: StrategyPlan, block_cls: type[nn.Module],
                expert_mesh: Any = None) -> nn.Module:
    """`module` sharded in place with FSDP2 on `mesh` as training shards it: one unit per `block_cls`
    (checkpointed when the plan asks), one per edge (the embedding; the final norm and head), then
    the root. With `expert_mesh` (expert parallelism, `StrategyPlan.expert_mesh`) each MoE layer's
    experts are split over its "expert" dimension and are a unit of their own over the others
    (`toolkit.parallel.expert`), first. `ShardedStrategy.setup_module` calls it; so does the
    simulation (`toolkit.memory.simulation`), on a fake process group."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if plan.activation_checkpointing:
        checkpoint_blocks(module, block_cls)
    precision = plan.precision
    compute_dtype = precision_dtypes(precision)[1]
    reduce_dtype = None if precision.endswith("-true") and precision != "32-true" else torch.float32
    # Pinned host memory makes the copies to and from the accelerator asynchronous, and needs one
    # (a CPU build of torch refuses it): plan_strategy never offloads on the CPU, but the test that
    # emulates an offloaded GPU run on CPU processes shards with this plan.
    offload = CPUOffloadPolicy(pin_memory=plan.accelerator != "cpu") if plan.cpu_offload else OffloadPolicy()
    # Blocks: under "*-mixed" the float32 weights are cast to the compute dtype before the
    # all-gather, so the gathered copy is 16-bit and autocast has nothing to cast (left to
    # autocast, it would keep a 16-bit copy of every block's weights until the backward
    # pass: a whole model's worth per rank). Inputs are not cast: the residual stream
    # stays in the dtype the single-device model uses.
    block_policy = MixedPrecisionPolicy(
        param_dtype=compute_dtype if precision.endswith("-mixed") else None,
        reduce_dtype=reduce_dtype, cast_forward_inputs=False,
    )
    expert_units = []
    if expert_mesh is not None:
        from toolkit.parallel.expert import shard_experts

        expert_units = shard_experts(module, expert_mesh, placement=expert_placement, mp_policy=block_policy,
                                     offload_policy=offload,
                                     reshard_after_forward=(plan.sharding or "FULL_SHARD") != "SHARD_GRAD_OP")
    for unit in block_units(module, block_cls):
        fully_shard(unit, mesh=mesh, mp_policy=block_policy, offload_policy=offload,
                    reshard_after_forward=(plan.sharding or "FULL_SHARD") != "SHARD_GRAD_OP",
                    shard_placement_fn=expert_placement(unit, shard_size(mesh, "shard")))
    # The edges: what runs before the blocks (the embedding) and after them (final norm and
    # head) are units of their own, gathered in the compute dtype like the blocks. The
    # embedding is freed after its forward pass and gathered again at the very end of the
    # backward pass; the head is gathered from the end of the forward pass to the start of
    # the backward pass, and its gradient is reduce-scattered right there instead of being
    # held, in full and in float32, through every block's backward pass. The embedding's
    # output is cast back to its stored dtype: the residual stream keeps the dtype the
    # single-device model gives it (float32 under "*-mixed" for trained embeddings).
    edges = edge_units(module, block_cls)
    if edges is not None and not edges.tied:
        # One unit per module (not one per list: FSDPMemTracker, which the simulation uses,
        # cannot follow a unit of several modules; the final norm's own gather is a few KiB).
        for part in edges.input:
            fully_shard(part, mesh=mesh, offload_policy=offload,
                        mp_policy=replace(block_policy, output_dtype=_output_dtype([part], block_policy)),
                        reshard_after_forward=(plan.sharding or "FULL_SHARD") != "SHARD_GRAD_OP")
            if isinstance(part, torch.nn.Embedding):
                # An embedding's gradient needs the token ids, not the weight: it is not gathered
                # again for the backward pass (a whole embedding, twice during gloo's gather).
                part.set_unshard_in_backward(False)
        for part in edges.output:
            fully_shard(part, mesh=mesh, mp_policy=block_policy, offload_policy=offload, reshard_after_forward=False)
            part.register_forward_pre_hook(_free_flat_gather_output)
    root_policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    if edges is not None and edges.tied:
        # A tied embedding and head share one matrix: it stays in one unit, the root, and is
        # gathered once (in the compute dtype) for forward and backward.
        root_policy = block_policy
        _cast_outputs_to_stored_dtype(edges.input, block_policy)
    # The root: whatever is left (nothing, for an untied GPT). It starts and ends each step.
    fully_shard(module, mesh=mesh, mp_policy=root_policy, offload_policy=offload)
    if mesh.device_type == "cpu":
        # gloo's all-gather and reduce-scatter add a whole buffer of the unit's size (the largest
        # is the embedding or head, whatever N): toolkit.parallel.gloo_collectives works in place.
        from torch.distributed.fsdp import FSDPModule

        from toolkit.parallel.expert import expert_shard_group
        from toolkit.parallel.gloo_collectives import use_in_place_collectives

        shard_group = mesh.get_group("shard") if mesh.mesh_dim_names else mesh.get_group()
        experts = {id(unit) for unit in expert_units}
        for unit in module.modules():
            if isinstance(unit, FSDPModule):
                group = expert_shard_group(expert_mesh) if id(unit) in experts else shard_group
                use_in_place_collectives(unit, group)
    return module


def expert_shard_dim(shape: tuple[int, ...], shards: int) -> int:
    """The dimension along which FSDP2 splits an expert tensor of `shape` (X experts first, then each
    expert's output rows) over `shards` ranks: dim 0 when the experts split evenly, else dim 1 when
    it does (FSDP2 takes only even splits on other dims), else dim 0.

    Dim 0 would pad every rank's shard to ceil(X / shards) whole experts: Mixtral's 8 experts over
    16 ranks leave each rank one expert, twice its share; over 64 ranks, 8 times. Split along dim 1,
    each rank holds 1/shards of every expert. The cost: gathering and reduce-scattering such a
    weight copies it once more (FSDP2 interleaves the ranks' pieces)."""
    if shards <= 1 or len(shape) < 2 or shape[0] % shards == 0 or shape[1] % shards:
        return 0
    return 1


def expert_placement(unit: nn.Module, shards: int) -> Any:
    """`fully_shard`'s `shard_placement_fn` for `unit`: Shard(`expert_shard_dim`) for the expert
    weights of the MoE layers inside it (their local experts, under expert parallelism), None (dim
    0) for every other parameter. NF4 experts (QLoRA), stored (X * out, in), split along their rows,
    dim 0, as every NF4 weight (torchao shards NF4Tensors along dim 0 only)."""
    from torch.distributed.tensor import DTensor, Shard

    from toolkit.models.moe import GroupedExperts
    from toolkit.parallel.nf4 import is_nf4

    experts = {id(p) for m in unit.modules() if isinstance(m, GroupedExperts) for p in m.parameters(recurse=False)}

    def placement(param: Any) -> Any:
        if id(param) not in experts:
            return None
        local = param.to_local() if isinstance(param, DTensor) else param
        if is_nf4(local):
            return None
        dim = expert_shard_dim(tuple(local.shape), shards)
        return Shard(dim) if dim else None

    return placement


def shard_size(mesh: Any, name: str) -> int:
    """Ranks of `mesh` that FSDP2 shards over: its dimension `name` when it has several, else all."""
    return mesh[name].size() if mesh.ndim > 1 else mesh.size()


def _free_flat_gather_output(module: nn.Module, args: Any) -> None:
    """Forward pre-hook of the output units, run after FSDP2's own (which gathers the weights).

    In the forward pass FSDP2 (torch 2.13, `FSDPParamGroup.wait_for_unshard`) keeps a unit's flat
    all-gather output alive after copying it into the parameters, until the next unit gathers, so
    that the next all-gather overlaps the copy. After the output units nothing is gathered until
    the backward pass, so the head's flat output (a second copy of the gathered head: 0.98 GiB in
    bf16 at Llama-3.1-8B's vocabulary, 147 MiB for pythia-160m in float32) would stay alive through
    the loss, the step's peak. It is freed here, after the gather streams wait for the copy, as
    FSDP2 itself does in the backward pass."""
    group = module._get_fsdp_state()._fsdp_param_group
    saved = group.comm_ctx.all_gather_state if group is not None else None
    if saved is not None:
        group._wait_all_gather_streams_on_event(saved.event)
        group.comm_ctx.all_gather_state = None


@dataclass(frozen=True)
class EdgeUnits:
    """The model's parts outside the repeated blocks: `input` runs before them, `output` after."""

    input: list  # modules, e.g. [embed]
    output: list  # e.g. [norm_f, lm_head]
    tied: bool  # input and output share a parameter (tied embedding and head)


def edge_units(module: nn.Module, block_cls: type[nn.Module]) -> EdgeUnits | None:
    """The children registered before and after the list of blocks, in the module that holds it.

    For `GPT`: input [embed], output [norm_f, lm_head] (the order of `__init__`, which is the order
    of `forward`). Children without parameters are left out. None when no child is a list of
    blocks, or one side is empty: the model is then sharded as blocks plus the root.
    """
    from torch import nn as _nn

    def is_block(m: nn.Module) -> bool:
        inner = getattr(m, "_checkpoint_wrapped_module", m)
        return isinstance(inner, block_cls)

    for parent in module.modules():
        children = list(parent.named_children())
        index = next((i for i, (_, c) in enumerate(children)
                      if isinstance(c, _nn.ModuleList) and len(c) and all(is_block(b) for b in c)), None)
        if index is None:
            continue
        before = [c for _, c in children[:index] if any(True for _ in c.parameters())]
        after = [c for _, c in children[index + 1:] if any(True for _ in c.parameters())]
        if not before or not after:
            return None
        shared = {id(p) for m in before for p in m.parameters()} & {id(p) for m in after for p in m.parameters()}
        return EdgeUnits(before, after, tied=bool(shared))
    return None


def _output_dtype(modules: list, policy: Any) -> Any:
    """The dtype the input unit's outputs are cast back to: its stored dtype where the policy gathers
    in another one (float32 embeddings gathered in bfloat16 under "*-mixed"), else None."""
    stored = next((p.dtype for m in modules for p in m.parameters() if p.is_floating_point()), None)
    return stored if policy.param_dtype is not None and stored != policy.param_dtype else None


def _cast_outputs_to_stored_dtype(modules: list, policy: Any) -> None:
    """What `output_dtype` does for a unit of its own, for input modules that stay in the root."""
    dtype = _output_dtype(modules, policy)
    if dtype is None:
        return
    for m in modules:
        m.register_forward_hook(lambda _m, _args, out: out.to(dtype) if out.is_floating_point() else out)


def block_units(module: nn.Module, block_cls: type[nn.Module]) -> list[nn.Module]:
    """Each transformer block, or its activation-checkpointing wrapper when it has one."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    units, wrapped = [], set()
    for m in module.modules():
        if isinstance(m, CheckpointWrapper) and isinstance(m._checkpoint_wrapped_module, block_cls):
            units.append(m)
            wrapped.add(id(m._checkpoint_wrapped_module))
    units += [m for m in module.modules() if isinstance(m, block_cls) and id(m) not in wrapped]
    return units


@contextmanager
def cross_replica_reduce_deferred(module: nn.Module, deferred: bool) -> Iterator[None]:
    """Gradient accumulation under the sharded strategy: every micro-batch's gradients are
    reduce-scattered into the shards, and only the all-reduce across replicas (HYBRID_SHARD,
    NO_SHARD) waits for the last micro-batch. FSDP2's own way, turning gradient sync off, keeps a
    whole unsharded gradient per rank until then. Training (`toolkit.training.fabric`'s
    `no_backward_sync`) and the memory simulation both accumulate through this."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_requires_all_reduce(not deferred, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_requires_all_reduce(True, recurse=False)


def release_gathered(module: nn.Module) -> None:
    """Free every unit's gathered weights (FSDP2; nothing on one device), e.g. after a forward pass
    under no_grad.

    Some units stay gathered from their forward pass until their backward pass reshards them (the
    final norm and head, the root, every unit under SHARD_GRAD_OP). A forward pass that has no
    backward pass (a preference loss's reference pass through the trained model, with its adapters
    switched off) would leave them gathered through the training forward pass that follows: the
    head, whole on every rank, beside every block's activations, or under SHARD_GRAD_OP the whole
    model. The next forward pass gathers them again."""
    from torch.distributed.fsdp import FSDPModule

    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def reshard_after_every_forward(module: Any) -> None:
    """Under FSDP2, free each unit's gathered weights right after its forward pass (else nothing).

    Training keeps some units gathered from their forward pass to their backward pass, which
    reshards them: the final norm and head, the root (which holds a tied embedding and head), every
    unit under SHARD_GRAD_OP. A model that only runs forward passes (a frozen reference model) has
    no backward pass, and would hold those weights gathered, whole on every rank, for good.
    """
    from torch.distributed.fsdp import FSDPModule

    inner = module.module if hasattr(module, "module") else module
    if isinstance(inner, FSDPModule):
        inner.set_reshard_after_forward(True)  # recurses into every unit
