"""Train a tiny block model with `toolkit.training.fabric` and `toolkit.parallel` and write what came out.

Used by tests/test_distributed_setup.py, both as a script (one process per rank, started by
Fabric's own launcher, torchrun, or the test setting LOCAL_RANK/NODE_RANK itself) and as a module
(the test imports `train` for the single-process reference). Every rank writes to --out:

    weights_rank{R}.safetensors   full weights after training, as this rank's replica holds them
    result_rank{R}.json           per-micro-batch losses and what set-up was actually used

With `--run OPTIONS` (repeated) one launch trains several set-ups in turn on the same processes,
each into --out/run{i}: the start-up of the processes is paid once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from toolkit.args import DistributedArgs  # noqa: E402
from toolkit.parallel.batches import BatchPlan, plan_batches  # noqa: E402
from toolkit.parallel.plan import plan_strategy  # noqa: E402
from toolkit.training.fabric import build_fabric, is_fsdp  # noqa: E402

WIDTH = 16  # hidden size
FEATURES = 4  # input/output features per position
SEQ = 3  # positions per sample
LR = 1e-2


class TinyBlock(nn.Module):
    """Stands in for a transformer block: pre-norm residual MLP. (B, T, WIDTH) -> same."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class TinyModel(nn.Module):
    """(B, SEQ, FEATURES) -> (B, SEQ, FEATURES) through three TinyBlocks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, WIDTH)
        self.blocks = nn.ModuleList(TinyBlock() for _ in range(3))
        self.out = nn.Linear(WIDTH, FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same (inputs, targets) for optimizer step `step` in every process: (size, SEQ, FEATURES)."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size, SEQ, FEATURES, generator=gen)
    return x, torch.sin(x.flip(-1)) + 0.1 * torch.randn(size, SEQ, FEATURES, generator=gen)


def train(fabric, plan: BatchPlan, steps: int, seed: int = 0):
    """`steps` AdamW steps with gradient accumulation; returns (model, optimizer, losses).

    losses maps "step/j" to the loss of micro-batch j of the global batch; this rank computes
    micro-batches j = i * world_size + rank for accumulation iteration i.
    """
    torch.manual_seed(seed)  # identical initial weights on every rank
    model = fabric.setup_module(TinyModel())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1))
    losses = {}
    for step in range(steps):
        losses.update(train_step(fabric, plan, model, optimizer, step))
    return model, optimizer, losses


def train_step(fabric, plan: BatchPlan, model, optimizer, step: int) -> dict[str, float]:
    x, y = global_batch(step, plan.global_batch_size)  # (G, SEQ, FEATURES) each, same on all ranks
    m, accum = plan.micro_batch_size, plan.gradient_accumulation_iters
    # micro-batch j is x[j*m:(j+1)*m]: (m, SEQ, FEATURES); the ranks take turns through the G/m of them
    losses = {}
    for i in range(accum):
        j = i * plan.world_size + fabric.global_rank
        is_accumulating = i < accum - 1
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            loss = nn.functional.mse_loss(model(x[j * m : (j + 1) * m]), y[j * m : (j + 1) * m])
            fabric.backward(loss / accum)
        losses[f"{step}/{j}"] = loss.item()
        if is_accumulating and is_fsdp(fabric):
            ACCUMULATION["sharded_grads"] = _grads_are_sharded(model)
    optimizer.step()
    optimizer.zero_grad()
    return losses


ACCUMULATION: dict = {}  # what the gradients looked like between micro-batches of one step


def _grads_are_sharded(model) -> bool:
    """After a micro-batch that is not the last of its step, no rank holds a full gradient: each
    gradient is this rank's shard (FSDP2 reduce-scattered it). Under HYBRID_SHARD the shards wait,
    summed, in FSDP2's partial-reduce buffer for the deferred all-reduce across nodes."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not all(isinstance(g, DTensor) and g.to_local().numel() < g.numel() for g in grads):
        return False
    waiting = [
        m._get_fsdp_state()._fsdp_param_group._partial_reduce_output
        for m in model.modules()
        if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group is not None
    ]
    waiting_numel = sum(t.numel() for t in waiting if t is not None)
    total = sum(p.numel() for p in model.parameters())
    return bool(grads) or 0 < waiting_numel < total


def describe(fabric, model) -> dict:
    """What set-up the strategy really used."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    info = {
        "strategy": type(fabric.strategy).__name__,
        "world_size": fabric.world_size,
        "checkpointed_blocks": sum(isinstance(m, CheckpointWrapper) for m in model.modules()),
    }
    if is_fsdp(fabric):
        from torch.distributed.fsdp import FSDPModule

        info["sharding"] = fabric.strategy.sharding
        info["mesh"] = list(fabric.strategy.device_mesh.shape)
        info["fsdp_units"] = sum(isinstance(m, FSDPModule) for m in model.modules())
        info["sharded_grads_while_accumulating"] = ACCUMULATION.get("sharded_grads")
    return info


def replica_weights(model) -> dict[str, torch.Tensor]:
    """This rank's replica of the full weights: its shards gathered over the mesh's shard dimension.

    Test-only (tiny model): every rank gathers, so that the test can check that all replicas agree
    (under HYBRID_SHARD each node holds one). The toolkit's own export gathers on rank 0 only.
    """
    from lightning_fabric.wrappers import _unwrap_objects
    from torch.distributed.tensor import DTensor

    from toolkit.models.param_names import unwrapped_name

    state = _unwrap_objects(model).state_dict()
    return {unwrapped_name(k): (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone() for k, v in state.items()}


def check_saves(fabric, plan: BatchPlan, model, optimizer, out: Path, steps: int) -> dict:
    """fabric.save full and sharded, load each into a fresh model; one more step must match."""
    results = {}
    saved = replica_weights(model)
    for kind in ("full", "sharded"):
        fabric.strategy._save_distributed_checkpoint = kind == "sharded"  # test only: both formats in one run
        path = out / f"ckpt_{kind}"
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": steps})
        torch.manual_seed(123)  # different initial weights, so loading must overwrite them
        model2 = fabric.setup_module(TinyModel())
        optimizer2 = fabric.setup_optimizers(torch.optim.AdamW(model2.parameters(), lr=LR, weight_decay=0.1))
        state = {"model": model2, "optimizer": optimizer2, "step": 0}
        fabric.load(path, state)
        loaded = replica_weights(model2)
        same_weights = all(torch.equal(saved[k], loaded[k]) for k in saved) and saved.keys() == loaded.keys()
        # The optimizer state came back too: one more step from both gives the same weights.
        train_step(fabric, plan, model2, optimizer2, steps)
        results[kind] = {"same_weights": same_weights, "step": state["step"], "after_step": model2}
    # compare the two continuations (full-loaded vs sharded-loaded) with the original continued
    train_step(fabric, plan, model, optimizer, steps)
    reference = replica_weights(model)
    for kind in ("full", "sharded"):
        cont = replica_weights(results[kind].pop("after_step"))
        results[kind]["same_next_step"] = all(torch.allclose(reference[k], cont[k], atol=1e-6) for k in reference)
    results["is_file_full"] = (out / "ckpt_full").is_file()
    results["is_dir_sharded"] = (out / "ckpt_sharded").is_dir()
    return results


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--sharding", default="FULL_SHARD")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--check-saves", action="store_true")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--run", action="append", default=[], metavar="OPTIONS",
                        help="several set-ups in one launch: each --run is a string of the options above that "
                             "override the others for one run, written to --out/run{i}")
    return parser


def run_one(args: argparse.Namespace, out: Path) -> None:
    """One set-up: build the Fabric object, train, and write this rank's files to `out`."""
    dist = DistributedArgs(
        strategy=args.strategy, sharding=args.sharding, activation_checkpointing=args.activation_checkpointing
    )
    strategy = plan_strategy(args.devices, args.num_nodes, args.precision, dist, accelerator="cpu")
    fabric = build_fabric(strategy, block_cls=TinyBlock)
    # The first launch starts the other ranks (Fabric's launcher then sets LOCAL_RANK in this
    # process too) and the process group; a later run's launch reuses both.
    fabric.launch()
    plan = plan_batches(strategy.devices, strategy.num_nodes, args.micro_batch, args.global_batch, SEQ)
    ACCUMULATION.clear()
    model, optimizer, losses = train(fabric, plan, args.steps)

    from safetensors.torch import save_file

    rank = fabric.global_rank
    result = {"losses": losses, **describe(fabric, model)}
    out.mkdir(parents=True, exist_ok=True)
    # Every rank writes its replica's full weights, so the test can check all ranks agree.
    save_file(replica_weights(model), str(out / f"weights_rank{rank}.safetensors"))
    if args.check_saves:
        result["saves"] = check_saves(fabric, plan, model, optimizer, out, args.steps)
    (out / f"result_rank{rank}.json").write_text(json.dumps(result))
    fabric.barrier()  # all files are written before rank 0 (the test's child) exits


def main() -> None:
    import shlex

    parser = _parser()
    argv = sys.argv[1:]
    args = parser.parse_args(argv)
    if not args.run:
        run_one(args, args.out)
    for i, options in enumerate(args.run):
        run_args = parser.parse_args([*argv, *shlex.split(options)])
        run_one(run_args, args.out / f"run{i}")
    from toolkit.training.failures import release_process_group

    release_process_group()  # destroys the group and frees what holds its threads


if __name__ == "__main__":
    main()
