"""Measure what training steps really allocate, per process, for tests/test_estimate.py.

Every set-up goes through the toolkit's own code, as the training commands do: `build_fabric`
(FSDP2 `fully_shard` over the processes, or one device), `Session.build_model` (the precision
policy, sharding on the meta device, each rank filling its own rows; for LoRA, peft's
`get_peft_model` and `init_adapters` first, as finetune_lora), `Session.build_optimizer` (AdamW)
and `fabric.backward`.

A set-up is `precision:finetune[:checkpointing]`, e.g. `bf16-mixed:lora` or
`32-true:full:checkpointing`. For each, the script takes one step (forward, backward, AdamW step)
and then MEASURED_STEPS more without zero_grad, so that they run with gradients and optimizer state
in place, as every micro-batch after the first does. It records:

- the bytes of the rank's parameter shards, gradient storage and AdamW state, from the tensors;
- what autograd saves in the first step's forward pass (`saved_tensors_hooks`; not with
  checkpointing), with the weights as the forward pass sees them (under FSDP with "*-mixed", each
  block gathered in the compute dtype);
- the peak of live tensor memory in a measured step, from `torch.profiler` (profile_memory=True),
  which records every allocation and free of the CPU allocator with its address: the count
  `torch.cuda.max_memory_allocated` keeps on a GPU. A measured step starts from the storages that
  live between steps, found from the tensors themselves (parameters, gradients, AdamW state and
  the fused loss's chunk buffers, kept between calls: `toolkit.models.loss._scratch`); then every
  allocation adds and every free subtracts. Only threads the profiler follows record, and gloo's
  worker thread frees a collective's buffer itself when it still holds it after the training
  thread let go (it waits for a core, at random): an address handed out again counts as freed,
  and the figure is the smaller of the measured steps' peaks.

The loss's chunk buffers are dropped before each set-up, so that each one starts as a fresh run.

With `--devices 2` the test starts both ranks (LOCAL_RANK set by hand, as a cluster launcher
would) and Fabric joins them into one gloo process group; both run the `--fsdp` set-ups, then
each runs its own `--single` set-ups on one device. Each process writes
`--out/rank{LOCAL_RANK}.json`: {"FULL_SHARD" or "single": {set-up: figures}}.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from toolkit.finetune.lora import init_adapters  # noqa: E402
from toolkit.models.adapters import LoRAArgs  # noqa: E402
from toolkit.models import loss as fused_loss  # noqa: E402
from toolkit.models.config import Config  # noqa: E402
from toolkit.models.gpt import Block  # noqa: E402
from toolkit.args import DistributedArgs, EvalArgs, LogArgs, TrainArgs  # noqa: E402
from toolkit.training.session import Session  # noqa: E402
from toolkit.parallel.plan import plan_run  # noqa: E402
from toolkit.training.fabric import build_fabric  # noqa: E402

MARK = "measured step"
MEASURED_STEPS = 3


def step_peaks(prof, between_steps: dict[int, int]) -> list[int]:
    """The peak of live tensor bytes in each step marked MARK.

    From the profiler's allocation records (address, +bytes) and frees (address, -bytes), in time
    order. Each step starts from `between_steps` (address -> bytes of the storages alive between
    steps); an address handed out again counts as freed (its free happened on a thread the
    profiler does not follow).
    """
    from torch._C._profiler import _EventType

    events, steps, stack = [], [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
        elif node.name == MARK:
            steps.append((node.start_time_ns, node.end_time_ns))
        stack.extend(node.children)
    events.sort()
    peaks = []
    for start, end in sorted(steps):
        sizes = dict(between_steps)  # address -> bytes of the live allocation there
        live = peak = sum(sizes.values())
        first, last = bisect.bisect_left(events, (start,)), bisect.bisect_right(events, (end, math.inf))
        for _, ptr, nbytes in events[first:last]:
            live -= sizes.pop(ptr, 0)  # a free, or an address given out again
            if nbytes > 0:
                sizes[ptr] = nbytes
                live += nbytes
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def storages(tensors) -> dict[int, int]:
    """{address: bytes} of the distinct storages under `tensors` (FSDP2's shards and gradients are views)."""
    found = {}
    for t in tensors:
        storage = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
        found[storage.data_ptr()] = storage.nbytes()
    return found


def forward_saving(model, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The loss of one forward pass, and the bytes of the distinct storages autograd saved in it, the
    model's parameters excluded (under FSDP, the gathered ones registered while their unit runs)."""
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        params = {p.untyped_storage().data_ptr() for p in model.parameters() if not hasattr(p, "to_local")}
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, ids)
    return loss, sum(seen.values())


def add_lora(lora: LoRAArgs):
    """What finetune_lora does to the model before the precision policy: peft's adapters, initialised."""

    def prepare(model):
        from peft import get_peft_model

        model = get_peft_model(model, lora.peft_config())
        init_adapters(model, seed=0)
        return model

    return prepare


def measure(devices: int, setup: str, config: Config, micro_batch: int, seq: int, lora_r: int, out_dir: Path) -> dict:
    precision, finetune, *rest = setup.split(":")
    dist = DistributedArgs(sharding="FULL_SHARD", activation_checkpointing=rest == ["checkpointing"])
    train = TrainArgs(micro_batch_size=micro_batch, global_batch_size=micro_batch * devices, max_seq_length=seq)
    run_plan = plan_run(devices, 1, precision, dist, train, seq, accelerator="cpu")
    fabric = build_fabric(run_plan.strategy, block_cls=Block)
    fabric.launch()
    session = Session(kind=f"finetune_{finetune}", fabric=fabric, out_dir=out_dir, config=config, train=train,
                      eval=EvalArgs(), log=LogArgs(), plan=run_plan.batches, run_plan=run_plan, seed=0, resume=False,
                      precision=precision)  # fmt: skip
    prepare = add_lora(LoRAArgs(r=lora_r)) if finetune == "lora" else None  # finetune_lora's defaults otherwise
    fused_loss._SCRATCH.clear()
    model = session.build_model("random", prepare)
    optimizer = session.build_optimizer(model)
    generator = torch.Generator().manual_seed(fabric.global_rank)
    ids = torch.randint(0, config.vocab_size, (micro_batch, seq), generator=generator)
    if rest == ["checkpointing"]:  # checkpointed blocks save their inputs through the hooks, then recompute
        loss, saved = model(ids, ids), None
    else:
        loss, saved = forward_saving(model, ids)
    fabric.backward(loss)
    optimizer.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(MEASURED_STEPS):
            with torch.profiler.record_function(MARK):
                fabric.backward(model(ids, ids))
                optimizer.step()
    params = list(model.parameters())
    states = [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    alive = {  # what lives between steps, as allocated
        "parameters": storages(params),
        "gradients": storages(p.grad for p in params if p.grad is not None),
        "optimizer_state": storages(t for t in states if t.dim() > 0),
        "loss_buffers": storages(fused_loss._SCRATCH.values()),
    }
    figures = {key: sum(found.values()) for key, found in alive.items()}
    figures["step_counters"] = sorted({f"{t.dim()} {t.dtype} {t.device}" for t in states if t.dim() == 0})
    figures["dtypes"] = sorted({f"{p.requires_grad} {p.dtype}" for p in params})
    figures["peak"] = min(step_peaks(prof, {ptr: n for found in alive.values() for ptr, n in found.items()}))
    figures["saved"] = saved
    return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, required=True, help="processes of the FSDP set-ups")
    parser.add_argument("--config", required=True, help="model config as JSON")
    parser.add_argument("--micro-batch", type=int, required=True)
    parser.add_argument("--seq", type=int, required=True)
    parser.add_argument("--lora-r", type=int, required=True)
    parser.add_argument("--fsdp", default="", help="set-ups to run on all --devices processes (comma-separated)")
    parser.add_argument("--single", default="", help="set-ups to run on one device, in this process alone")
    args = parser.parse_args()
    config = Config(**json.loads(args.config))
    results: dict[str, dict] = {"FULL_SHARD": {}, "single": {}}
    for column, devices, setups in (("FULL_SHARD", args.devices, args.fsdp), ("single", 1, args.single)):
        for setup in filter(None, setups.split(",")):
            results[column][setup] = measure(devices, setup, config, args.micro_batch, args.seq, args.lora_r, args.out)
    (args.out / f"rank{os.environ.get('LOCAL_RANK', '0')}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
