"""One training step of a tiny MoE GPT with expert parallelism on 4 gloo processes, against one process.

    MASTER_ADDR=127.0.0.1 MASTER_PORT=... python tests/scripts/expert_parallel_step.py OUT_DIR

Spawns 4 processes. For each layout below every rank builds the same model (`init_weights`, one
seed), keeps a plain copy as the one-process reference, and shards the other as training does
(`plan_strategy` with the model, the meshes of `StrategyPlan.mesh` and `.expert_mesh`,
`shard_model`). Then one forward and backward pass on its quarter of a global batch, its loss
scaled as the loop scales it (summed over its tokens, times world size, over the batch's tokens),
against the reference on the whole batch:

    full_shard   FULL_SHARD, expert_parallel 2: experts split over pairs and FSDP-sharded over the
                 other pair (an _StridedShard layout); grouped products (`expert_backend("grouped")`,
                 which float32 weights do not choose by themselves)
    hybrid       HYBRID_SHARD as 2 nodes x 2 devices, expert_parallel 2, activation checkpointing
                 (the all-to-alls run again in the recomputation)
    uneven       FULL_SHARD, expert_parallel 2, 2 experts (top-1): one expert per pair, which FSDP
                 splits along dim 1 over the other pair (`expert_shard_dim`); grouped products
    uneven_rows  as uneven, 33 wide: down_proj (1 local expert, 33 rows) cannot split along dim 1,
                 so FSDP splits it along dim 0 and pads one rank's shard to nothing (_StridedShard);
                 one product per expert (grouped products need rows of a multiple of 16 bytes)
    columns      FULL_SHARD, no expert parallelism, 2 experts (top-1) over 4 ranks: the blocks'
                 expert weights split along dim 1, the rest along dim 0
    hybrid_columns  HYBRID_SHARD as 2 nodes x 2 devices, no expert parallelism, 3 experts: split
                 along dim 1 within a node, replicated across nodes
    columns_lora as columns, with LoRA on attention and on the (frozen, dim-1-split) experts
    lora         FULL_SHARD, expert_parallel 2, LoRA on attention and on the experts (each rank
                 applies its own experts' rows of the factors): experts frozen, the adapters'
                 gradients cross the all-to-all backward
    lora_ep4     as lora with expert_parallel 4: one expert (and its rows of the factors) per rank,
                 every token's rows sent to two other ranks and back
    lora_idle    as lora, with the routing of idle below: a rank without rows still gives its
                 experts' factors (zero) gradients, which every rank reduces
    idle         FULL_SHARD, expert_parallel 2, every token routed to experts 0 and 1 (a hook on
                 the routers' logits): the second rank of each pair receives no row at all; the
                 experts run one product per expert (`expert_backend("loop")`, where CUDA has no
                 grouped product), which computes nothing for no row

For each: the summed loss over ranks, every gradient gathered whole (`full_tensor`), the clipped
norm of `toolkit.parallel.expert.clip_grad_norm` against torch's on the reference, whether each
shard holds the part (rows of dim 0, and of dim 1 where split) that model set-up fills
(`compute_local_shape_and_global_offset`), each expert weight sent to rank 0 piece by piece as the
final export sends it (`checkpoint_io._row_layout`, `_send_rows_to_rank_zero`), and (without LoRA)
that a copy sharded on the meta device and filled by `model_setup.fill_shards`, from a safetensors
file of the reference's weights and from the initialiser, holds the reference's values. Rank 0
writes OUT_DIR/result.json.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

WORLD = 4
BATCH, SEQ, VOCAB = 8, 16, 64
LAYOUTS = {
    "full_shard": dict(sharding="FULL_SHARD", nodes=1, experts=4, top_k=2, backend="grouped"),
    "hybrid": dict(sharding="HYBRID_SHARD", nodes=2, experts=4, top_k=2, checkpointing=True),
    "uneven": dict(sharding="FULL_SHARD", nodes=1, experts=2, top_k=1, backend="grouped"),
    "uneven_rows": dict(sharding="FULL_SHARD", nodes=1, experts=2, top_k=1, backend="loop", width=33),
    "columns": dict(sharding="FULL_SHARD", nodes=1, experts=2, top_k=1, backend="grouped", expert_parallel=1),
    "hybrid_columns": dict(sharding="HYBRID_SHARD", nodes=2, experts=3, top_k=2, expert_parallel=1),
    "columns_lora": dict(sharding="FULL_SHARD", nodes=1, experts=2, top_k=1, lora=True, expert_parallel=1),
    "lora": dict(sharding="FULL_SHARD", nodes=1, experts=4, top_k=2, lora=True),
    "lora_ep4": dict(sharding="FULL_SHARD", nodes=1, experts=4, top_k=2, lora=True, expert_parallel=4),
    "idle": dict(sharding="FULL_SHARD", nodes=1, experts=4, top_k=2, idle=True, backend="loop"),
    "lora_idle": dict(sharding="FULL_SHARD", nodes=1, experts=4, top_k=2, lora=True, idle=True, backend="loop"),
}


def tiny_moe(experts: int, top_k: int, width: int = 32):
    from toolkit.models.config import Config

    return Config(name="tiny-moe", vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_embd=width, n_head=4, head_size=8,
                  n_query_groups=2, intermediate_size=48, n_expert=experts, n_expert_per_token=top_k,
                  moe_intermediate_size=24)


def build(config, lora: bool):
    from toolkit.models.gpt import GPT, init_weights

    model = GPT(config)
    init_weights(model, config.n_layer, seed=0)
    if lora:
        from peft import get_peft_model

        from toolkit.models.adapters import LoRAArgs

        model = get_peft_model(model, LoRAArgs(r=4, dropout=0.0, targets=("query", "value", "projection", "experts")).peft_config())
        with torch.no_grad():  # B starts at zero, which would leave A without a gradient
            g = torch.Generator().manual_seed(1)
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def one_layout(rank: int, name: str, spec: dict, out: Path) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from toolkit.args import DistributedArgs
    from toolkit.models.gpt import Block
    from toolkit.models.moe import expert_backend
    from toolkit.models.param_names import without_wrappers
    from toolkit.parallel.expert import clip_grad_norm
    from toolkit.parallel.fsdp import shard_model
    from toolkit.parallel.plan import plan_strategy
    from toolkit.training.checkpoint_io import _row_layout, _send_rows_to_rank_zero

    config = tiny_moe(spec["experts"], spec["top_k"], spec.get("width", 32))
    devices = WORLD // spec["nodes"]
    plan = plan_strategy(devices, spec["nodes"], "32-true", DistributedArgs(
        sharding=spec["sharding"], expert_parallel=spec.get("expert_parallel", 2),
        activation_checkpointing=spec.get("checkpointing", False)),
        accelerator="cpu", model=config)
    model = build(config, spec.get("lora", False))
    if spec.get("idle"):
        from toolkit.models.moe import moe_layers

        favour = torch.tensor([20.0, 20.0, -20.0, -20.0])
        for layer in moe_layers(model):
            layer.router.register_forward_hook(lambda module, args, logits: logits + favour)
    reference = copy.deepcopy(model)
    shape, names = plan.mesh
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    expert_mesh = None
    if plan.expert_mesh is not None:
        shape, names = plan.expert_mesh
        expert_mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    shard_model(model, mesh, plan, Block, expert_mesh=expert_mesh)

    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    per = BATCH // WORLD
    mine = ids[rank * per:(rank + 1) * per]
    with expert_backend(spec.get("backend")):
        loss = model(mine, labels=mine) * WORLD / ids.numel()
        loss.backward()
        reference_loss = reference(ids, labels=ids) / ids.numel()
        reference_loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)

    result: dict = {"describe": plan.describe(), "loss": [total.item() / WORLD, reference_loss.item()]}
    # Names without wrapper segments (activation checkpointing, peft's base_model.model), peft's
    # base_layer kept: it tells the adapters of the experts' two weights apart.
    ref_params = {without_wrappers(n): p for n, p in reference.named_parameters()}
    named = [(without_wrappers(n), p) for n, p in model.named_parameters()]
    grads, rows_filled, exported, expert_dims = {}, {}, {}, {}
    for pname, param in named:
        ref = ref_params[pname]
        if param.grad is not None or ref.grad is not None:
            grad = param.grad.full_tensor() if param.grad is not None else torch.zeros_like(ref)
            expected = ref.grad if ref.grad is not None else torch.zeros_like(ref)
            grads[pname] = [(grad - expected).abs().max().item(), expected.abs().max().item()]
        if isinstance(param, DTensor):
            rows_filled[pname] = bool(torch.equal(param.to_local().detach(), _part(ref.detach(), param)))
        if "experts" in pname and ".lora_" not in pname:
            expert_dims[pname] = sorted({p.dim for p in param.placements if p.is_shard()})
            layout = _row_layout(param)
            parts: list = []
            if layout is not None:
                _send_rows_to_rank_zero(param, layout, torch.float32, lambda rows, inner: parts.append(rows))
            exported[pname] = layout is not None and (rank != 0 or torch.equal(torch.cat([t.flatten() for t in parts]),
                                                                                  ref.detach().flatten()))
    trained = [(n, p) for n, p in named if p.requires_grad]
    norm = clip_grad_norm([p for _, p in trained], max_norm=0.01)
    reference_norm = torch.nn.utils.clip_grad_norm_([p for p in reference.parameters() if p.requires_grad], 0.01)
    clipped = [(p.grad.full_tensor() - ref_params[n].grad).abs().max().item() for n, p in trained
               if p.grad is not None and ref_params[n].grad is not None]
    # Experts 2 and 3 (the second rank of each pair) got no token when "idle": no gradient at all.
    expert_grads = [ref_params[n].grad for n, _ in named if "experts" in n]
    result["unrouted_grad"] = max((g[2:].abs().max().item() for g in expert_grads if g is not None and len(g) > 2),
                                  default=None)
    result.update(grads=grads, rows_filled=rows_filled, exported=exported, norm=[norm.item(), reference_norm.item()],
                  clipped_worst=max(clipped), expert_dims=expert_dims)
    if not spec.get("lora"):
        result["set_up"] = set_up_from_files(rank, name, config, reference, out, plan, mesh, expert_mesh)
    return result


def _part(full: torch.Tensor, param) -> torch.Tensor:
    """This rank's part of `full` as `param` (a DTensor) holds it."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def set_up_from_files(rank: int, name: str, config, reference, out: Path, plan, mesh, expert_mesh) -> dict:
    """{"checkpoint", "initialiser"}: whether a copy of the model sharded on the meta device and
    filled by `fill_shards` holds, on every parameter, this rank's part of the reference's values,
    read from a safetensors file (`SafetensorsReader`, as a checkpoint is read) or drawn."""
    from safetensors.torch import save_file

    from toolkit.models.gpt import GPT, Block, init_specs, initial_value
    from toolkit.models.param_names import unwrapped_name
    from toolkit.parallel.fsdp import shard_model
    from toolkit.safetensors_io import SafetensorsReader
    from toolkit.training.model_setup import fill_shards

    path = out / f"{name}.safetensors"
    if rank == 0:
        save_file({n: p.detach().contiguous() for n, p in reference.named_parameters()}, str(path))
    dist.barrier()
    stored = SafetensorsReader([path])
    specs = init_specs(reference, config.n_layer)
    shapes = {n: tuple(p.shape) for n, p in reference.named_parameters()}
    readers = {
        "checkpoint": lambda n, start=0, stop=None, out=None, inner=None: stored.read_rows_into(n, start, out, 1 << 10, inner),
        "initialiser": lambda n, start=0, stop=None, out=None, inner=None: initial_value(specs[n], shapes[n], 0, n, start,
                                                                                        stop, out=out, inner=inner),
    }
    expected = dict(reference.named_parameters())
    found = {}
    for source, read_rows in readers.items():
        with torch.device("meta"):
            model = GPT(config)
        shard_model(model, mesh, plan, Block, expert_mesh=expert_mesh)
        model.to_empty(device="cpu")
        fill_shards(model, read_rows)
        found[source] = all(torch.equal(p.to_local(), _part(expected[unwrapped_name(n)].detach(), p))
                            for n, p in model.named_parameters())
    return found


def worker(rank: int, out: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    results = {name: one_layout(rank, name, spec, Path(out)) for name, spec in LAYOUTS.items()}
    if rank == 0:
        (Path(out) / "result.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    from toolkit.training.failures import release_process_group

    release_process_group()  # destroys the group and frees what holds its threads


if __name__ == "__main__":
    mp.spawn(worker, args=(sys.argv[1],), nprocs=WORLD)
