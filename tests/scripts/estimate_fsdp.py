"""Measure what FSDP really allocates per rank, for tests/test_estimate.py.

The test starts both ranks (LOCAL_RANK set by hand); Fabric joins them into one gloo process group.
For each set-up (FULL_SHARD and NO_SHARD; with --lora also FULL_SHARD with peft LoRA adapters) every
rank builds the toolkit's GPT, lets Fabric shard it (one FSDP unit per Block, as in training), takes
one AdamW step, and writes to --out/rank{R}.json the bytes it holds: its flat-parameter shards, its
gradient storage and its optimizer state.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from toolkit.models.config import Config  # noqa: E402
from toolkit.models.gpt import GPT, Block  # noqa: E402
from toolkit.training.distributed import DistributedArgs, build_fabric  # noqa: E402

# Odd sizes on purpose: FSDP pads every tensor to 16 bytes and every unit to the world size.
CONFIG = dict(name="estimate-fsdp", vocab_size=1001, block_size=64, n_layer=2, n_embd=36, n_head=6,
              n_query_groups=2, intermediate_size=50, attn_qkv_bias=True)  # fmt: skip
LORA_TARGETS = ["q_proj", "v_proj"]
LORA_R = 4


def measure(fabric, sharding: str, lora: bool) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    fabric.strategy.sharding_strategy = ShardingStrategy[sharding]  # test only: several set-ups in one launch
    torch.manual_seed(0)
    model = GPT(Config(**CONFIG))
    if lora:
        from peft import LoraConfig, inject_adapter_in_model

        model = inject_adapter_in_model(LoraConfig(r=LORA_R, target_modules=LORA_TARGETS, lora_dropout=0.0), model)
        for name, p in model.named_parameters():
            p.requires_grad_("lora_" in name)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3))
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(fabric.global_rank))
    fabric.backward(model(ids, ids))
    optimizer.step()

    flat_params = [m._handle.flat_param for m in model.modules() if isinstance(m, FSDP) and m._handle is not None]
    grads = {}
    for p in model.parameters():
        if p.grad is not None:  # views into the unit's flat gradient shard: count each storage once
            storage = p.grad.untyped_storage()
            grads[storage.data_ptr()] = storage.nbytes()
    states = [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    return {
        "parameters": sum(f.numel() * f.element_size() for f in flat_params),
        "flat_dtypes": sorted({str(f.dtype) for f in flat_params}),
        "gradients": sum(grads.values()),
        "flat_gradients": sum(f.grad.numel() * f.grad.element_size() for f in flat_params if f.grad is not None),
        "optimizer_state": sum(t.numel() * t.element_size() for t in states if t.dim() > 0),
        "step_counters": [[t.dim(), str(t.dtype), str(t.device)] for t in states if t.dim() == 0],
        "trainable_local": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--lora", action="store_true", help="also measure LoRA (imports peft: slower)")
    args = parser.parse_args()
    dist = DistributedArgs(sharding="FULL_SHARD")
    fabric = build_fabric(2, 1, args.precision, dist, block_cls=Block, accelerator="cpu")
    fabric.launch()
    result = {
        "FULL_SHARD": measure(fabric, "FULL_SHARD", lora=False),
        "NO_SHARD": measure(fabric, "NO_SHARD", lora=False),
    }
    if args.lora:
        result["FULL_SHARD_lora"] = measure(fabric, "FULL_SHARD", lora=True)
    (args.out / f"rank{fabric.global_rank}.json").write_text(json.dumps(result))
    fabric.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
