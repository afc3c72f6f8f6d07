"""The simulated training step (toolkit.memory.simulation) on real tensors, for tests/test_simulate.py.

Each rank joins a real gloo process group, builds the model as `simulate` does (GPT on meta, LoRA,
precision policy, ShardedStrategy's FSDP2 on the mesh), gives the shards real storage and values,
and runs `toolkit.memory.simulation.tracked_step` (an untracked step, then one optimizer step of
`--micro-batches` micro-batches under FSDPMemTracker): the same code as the simulation, with real
tensors, real collectives and real arithmetic in place of fake ones.

Started by the test as `--world` processes (RANK set, MASTER_ADDR/PORT in the environment). A
set-up is `precision:finetune[:checkpointing]` (finetune: pretrain, full or lora). Each rank writes
`--out/rank{RANK}.json`: {set-up: {"peak": {category: bytes}, "persistent": ..., "sent": bytes}}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from toolkit.models import loss as fused_loss  # noqa: E402
from toolkit.parallel import gloo_collectives  # noqa: E402
from toolkit.models.config import Config  # noqa: E402
from toolkit.args import TrainArgs  # noqa: E402
from toolkit.memory.simulation import _local, adamw, build, fsdp_plan, tracked_step  # noqa: E402
from toolkit.parallel.plan import mesh_layout  # noqa: E402


def measure(setup: str, config: Config, world: int, micro_batch: int, seq: int, micro_batches: int, lora_r: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from toolkit.models.adapters import LoRAArgs

    precision, finetune, *rest = setup.split(":")
    plan = fsdp_plan(world, 1, precision, "FULL_SHARD", rest == ["checkpointing"])
    shape, names = mesh_layout(plan.sharding, 1, world)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    lora = LoRAArgs(r=lora_r) if finetune == "lora" else None
    model, decay = build(config, plan, None if finetune == "pretrain" else finetune, lora, mesh)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(dist.get_rank())
    with torch.no_grad():  # real values (the memory does not depend on them; the arithmetic should stay finite)
        for p in model.parameters():
            local = _local(p)
            local.copy_(torch.randn(local.shape, generator=generator) * 0.02)
    train = TrainArgs()
    optimizer = adamw(model, decay, train)
    ids = torch.randint(0, config.vocab_size, (micro_batch, seq), generator=generator)
    peak, persistent, _, sent, attempts = tracked_step(model, optimizer, plan, train, ids, ids.clone(),
                                                       micro_batches)
    return {"peak": peak, "persistent": persistent, "sent": sent, "attempts": attempts}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--preset", required=True)
    parser.add_argument("--overrides", required=True, help="Config fields to change, as JSON")
    parser.add_argument("--micro-batch", type=int, required=True)
    parser.add_argument("--seq", type=int, required=True)
    parser.add_argument("--micro-batches", type=int, required=True)
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--setups", required=True, help="comma-separated")
    args = parser.parse_args()
    # The fused loss keeps its CPU buffers between calls (toolkit.models.loss._scratch); a GPU, and so the
    # simulation, allocates them at each call: allocate here as there.
    fused_loss.SETTINGS.reuse_scratch = False
    # A GPU, and so the simulation, runs FSDP2's own all-gather and reduce-scatter; gloo's in-place
    # replacements (toolkit.parallel.gloo_collectives) move the same bytes as broadcasts and reduces.
    gloo_collectives.ENABLED = False
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=args.world)
    try:
        config = Config.from_name(args.preset, **json.loads(args.overrides))
        results = {
            setup: measure(setup, config, args.world, args.micro_batch, args.seq, args.micro_batches, args.lora_r)
            for setup in args.setups.split(",")
        }
    finally:
        from toolkit.training.failures import release_process_group

        release_process_group()  # destroys the group and frees what holds its threads
    (args.out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
