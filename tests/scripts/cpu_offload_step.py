"""An offloaded FSDP2 GPU run (`--distributed.cpu_offload`), emulated on CPU processes: one rank of it.

Used by tests/test_distributed_setup.py, which starts 2 processes with LOCAL_RANK set and passes three
free ports. On a GPU, FSDP's own collectives (all-gather of the parameters, reduce-scatter of the
gradients) run on the GPU, on NCCL; with CPU offload the reduced gradient shards are then copied to
the CPU, and the gradient clipping of the loop (`optimizer_step`) all-reduces their norm there, on
whatever backend the process group has for the CPU. A CPU build of torch has no second device type,
so the emulation keeps the two apart like this:

- the process group is built by the toolkit (`build_fabric`, then Fabric's own initialisation) from
  the plan a GPU run gets (`plan_strategy(..., accelerator="cuda")`), with gloo standing in for nccl
  in the cuda slot: "nccl" (cuda only) -> "cuda:gloo", "cuda:nccl,cpu:gloo" -> "cuda:gloo,cpu:gloo";
- FSDP's collectives run on a group of their own (gloo, CPU), standing in for the GPU's NCCL
  communicator, through FSDP2's public hooks for them (`set_custom_all_gather`/`_reduce_scatter`);
- everything else (the clipping's norm, the optimizer, the final gathers) uses the toolkit's group.

Three runs, one after the other in each process, each with its own process group (port):

    reference   the same model and batches on CPU without offload (the CPU plan: plain gloo)
    offload     the offload plan's group: two steps with clipping; the weights must equal the reference
    old_group   the group offloading used before the fix (the plain GPU plan's "nccl"): must fail at clipping

Each rank writes to --out: weights_{run}_rank{R}.safetensors and result_rank{R}.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from toolkit.args import DistributedArgs  # noqa: E402
from toolkit.training.loop import optimizer_step  # noqa: E402
from toolkit.parallel.plan import StrategyPlan, plan_strategy  # noqa: E402
from toolkit.training.fabric import build_fabric  # noqa: E402

_spec = importlib.util.spec_from_file_location("dist_train", Path(__file__).parent / "dist_train.py")
dist_train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dist_train)  # the tiny model and its batches

MAX_NORM = 0.5  # below the tiny model's gradient norms (1.87, then 1.03), so clipping scales both steps
STEPS = 2
MICRO_BATCH = 2  # per rank; the global batch is 2 x 2, one micro-batch per rank and step


def on_cpu(plan: StrategyPlan) -> StrategyPlan:
    """The plan of a GPU run, run on CPU processes: gloo takes nccl's place for the cuda device."""
    from torch.distributed.distributed_c10d import BackendConfig

    backends = BackendConfig(plan.process_group_backend).get_device_backend_map()  # {"cuda": "nccl", ...}
    emulated = ",".join(f"{device}:{'gloo' if name == 'nccl' else name}" for device, name in backends.items())
    return replace(plan, accelerator="cpu", process_group_backend=emulated)


def device_side_comms(model, device_group) -> None:
    """Run FSDP's all-gathers and reduce-scatters on `device_group` (the GPU's NCCL in the emulation)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    class DeviceAllGather(AllGather):
        def allocate(self, size, *, dtype, device):
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):  # group: the mesh's, not used
            return torch.distributed.all_gather_into_tensor(output_tensor, input_tensor, group=device_group,
                                                            async_op=async_op)

    class DeviceReduceScatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            return torch.distributed.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=device_group,
                                                           async_op=async_op)

    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.set_custom_all_gather(DeviceAllGather())
            unit.set_custom_reduce_scatter(DeviceReduceScatter())


def run(plan: StrategyPlan, port: int, emulate_device: bool) -> dict:
    """Two optimizer steps of the tiny model under `plan`, clipped as the loop clips.

    Returns {"weights": this rank's replica of the full weights (None if a stage failed),
    "failed_at": the stage that raised or None, "error": its first line, "grad_norms": [...],
    "offloaded": whether every FSDP parameter lives on the CPU between uses}.
    """
    os.environ["MASTER_PORT"] = str(port)
    fabric = build_fabric(plan, block_cls=dist_train.TinyBlock)
    fabric.launch()  # LOCAL_RANK is set: joins the process group the strategy initialises
    result = {"weights": None, "failed_at": None, "error": None, "grad_norms": [], "offloaded": False}
    try:
        torch.manual_seed(0)  # the same initial weights in every run and on every rank
        model = fabric.setup_module(dist_train.TinyModel())
        if emulate_device:
            device_side_comms(model, torch.distributed.new_group(backend="gloo"))
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=dist_train.LR))
        result["offloaded"] = _offloaded(model)
        rank, world = fabric.global_rank, fabric.world_size
        for step in range(STEPS):
            x, y = dist_train.global_batch(step, MICRO_BATCH * world)
            rows = slice(rank * MICRO_BATCH, (rank + 1) * MICRO_BATCH)
            stage = "forward and backward"
            try:
                loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
                fabric.backward(loss)
                stage = "clipping and optimizer step"
                result["grad_norms"].append(float(optimizer_step(fabric, model, optimizer, MAX_NORM)))
            except RuntimeError as error:
                result["failed_at"], result["error"] = stage, str(error).splitlines()[0]
                return result
        result["weights"] = dist_train.replica_weights(model)
        return result
    finally:
        from toolkit.training.failures import release_process_group

        release_process_group()  # destroys the group and frees what holds its threads


def _offloaded(model) -> bool:
    """Every parameter of every FSDP unit is kept on the CPU (CPUOffloadPolicy), not on the device."""
    from torch.distributed.fsdp import FSDPModule

    params = [p for unit in model.modules() if isinstance(unit, FSDPModule)
              for group in unit._get_fsdp_state()._fsdp_param_groups for p in group.fsdp_params]
    return bool(params) and all(p.offload_to_cpu for p in params)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--ports", type=lambda text: [int(p) for p in text.split(",")], required=True,
                        help="three free ports, one per run")
    args = parser.parse_args()

    def plan(accelerator: str, cpu_offload: bool) -> StrategyPlan:
        return plan_strategy(args.devices, args.num_nodes, "32-true", DistributedArgs(cpu_offload=cpu_offload), accelerator)

    reference = plan("cpu", cpu_offload=False)
    offload = on_cpu(plan("cuda", cpu_offload=True))
    old_group = replace(offload, process_group_backend=on_cpu(plan("cuda", cpu_offload=False)).process_group_backend)
    from safetensors.torch import save_file

    rank = int(os.environ["NODE_RANK"]) * args.devices + int(os.environ["LOCAL_RANK"])
    summary = {}
    for (name, plan, emulate), port in zip(
        [("reference", reference, False), ("offload", offload, True), ("old_group", old_group, True)], args.ports
    ):
        result = run(plan, port, emulate)
        weights = result.pop("weights")
        if weights is not None:
            save_file(weights, str(args.out / f"weights_{name}_rank{rank}.safetensors"))
        summary[name] = {"backend": plan.process_group_backend, "cpu_offload": plan.cpu_offload, **result}
    (args.out / f"result_rank{rank}.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
