"""All distributed set-up lives here: strategy, precision, device mesh, and the batch math.

The model code and the training loop stay free of distributed details. A caller does:

    plan = plan_batches(devices, num_nodes, micro_batch_size, global_batch_size, max_seq_length)
    fabric = build_fabric(devices, num_nodes, precision, dist_args, block_cls=Block, loggers=loggers)
    fabric.launch()          # see "Launching" below
    fabric.print(plan.table())

    with torch.device("meta"):
        model = GPT(config)                     # no memory yet
    apply_precision_policy(model, precision)    # the dtype of every parameter (see precision_dtypes)
    model = setup_model(fabric, model, read_rows)   # shard (FSDP2), then each rank reads its own rows
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), ...))  # created AFTER setup

    for step in range(max_steps):
        for i in range(plan.gradient_accumulation_iters):
            is_accumulating = i < plan.gradient_accumulation_iters - 1
            with fabric.no_backward_sync(model, enabled=is_accumulating):
                loss = model(x, y) / plan.gradient_accumulation_iters
                fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    fabric.save(path, {"model": model, "optimizer": optimizer, "step": step})   # mid-run, resumable
    fabric.load(path, {"model": model, "optimizer": optimizer, "step": 0})     # resume (set up first)
    weights = full_state_dict(fabric, model)    # final export: full tensors on rank 0, {} elsewhere

With more than one device the engine is FSDP2 (`torch.distributed.fsdp.fully_shard`), one unit per
transformer Block and one at the root, on the mesh of `mesh_layout`; see `ShardedStrategy` (built
by `sharded_strategy_class`) for what it changes in Fabric's `ModelParallelStrategy` and why. Under
FSDP `fabric.save` writes `DistributedArgs.state_dict_type`: "sharded" (a directory written by
torch's distributed checkpoint, one file per rank, loadable on another number of devices) or
"full" (one file). Without FSDP it always writes one full file. `--distributed.strategy ddp` keeps
Fabric's DDP for models that fit on one device.

Launching: there is no `launch()` wrapper here; the caller calls `fabric.launch()` right after
`build_fabric`, before doing any real work. When no launcher started the processes (a plain
`toolkit ...` or `python script.py ...` on one machine), `fabric.launch()` re-runs the same command
once per extra local device, with LOCAL_RANK/NODE_RANK/WORLD_SIZE set. When a launcher did start
them (`torchrun`, SLURM, or LOCAL_RANK set by hand), it only joins the process group. For several
machines run the command on each with NODE_RANK, MASTER_ADDR and MASTER_PORT set (or use torchrun).

Importing this module is cheap: torch and lightning are imported inside the functions.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, get_args

from toolkit.errors import PeerFailure, UserError, check_choice
from toolkit.models.param_names import unwrapped_name
from toolkit.training.args import DistributedArgs, ShardingName, StateDictTypeName, StrategyName

if TYPE_CHECKING:
    from lightning import Fabric
    from torch import Tensor, nn

log = logging.getLogger(__name__)


# Precision names Fabric understands that make sense for LLM training (all of them work with FSDP).
PRECISIONS = ("bf16-mixed", "bf16-true", "32-true", "16-mixed", "16-true")
_PRECISION_ALIASES = {"bf16": "bf16-mixed", "32": "32-true", "16": "16-mixed"}


# --------------------------------------------------------------------------------------------
# Resolving devices and precision
# --------------------------------------------------------------------------------------------


def resolve_accelerator(accelerator: str = "auto") -> str:
    """ "auto" -> "cuda" when a GPU is visible, else "cpu"; "gpu" -> "cuda"; others unchanged."""
    accelerator = accelerator.lower()
    if accelerator == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if accelerator == "gpu" else accelerator


def resolve_devices(devices: int | str, accelerator: str) -> int:
    """Devices per node as a number: an int, a numeric string, or "auto"/-1 for all visible ones."""
    if isinstance(devices, str):
        text = devices.strip().lower()
        if text in ("auto", "-1"):
            if accelerator == "cuda":
                import torch

                return max(torch.cuda.device_count(), 1)
            return 1
        try:
            devices = int(text)
        except ValueError:
            raise UserError(f"devices must be a positive number or 'auto', got {devices!r}.") from None
    if isinstance(devices, bool) or not isinstance(devices, int):
        raise UserError(f"devices must be a positive number or 'auto', got {devices!r}.")
    if devices == -1:
        return resolve_devices("auto", accelerator)
    if devices < 1:
        raise UserError(f"devices must be at least 1, got {devices}.")
    return devices


def resolve_precision(precision: str | None, accelerator: str) -> str:
    """The Fabric precision to train with. None means the best the device supports.

    On CUDA that is "bf16-mixed" where the GPU supports bfloat16, else "16-mixed"; on CPU it is
    "bf16-mixed" (measured about 2x faster than float32 on our CPUs). float16 is refused on CPU:
    its kernels are missing or slow there, use bf16-mixed or 32-true instead.
    """
    accelerator = resolve_accelerator(accelerator)
    if precision is None:
        if accelerator == "cpu":
            return "bf16-mixed"
        if accelerator == "cuda":
            import torch

            # Native bfloat16 only (Ampere and later): V100 and T4 emulate it, much slower than float16.
            return "bf16-mixed" if torch.cuda.is_bf16_supported(including_emulation=False) else "16-mixed"
        return "32-true"
    name = _PRECISION_ALIASES.get(str(precision).lower(), str(precision).lower())
    check_choice("precision", precision if name not in PRECISIONS else name, PRECISIONS)
    if accelerator == "cpu" and name.startswith("16-"):
        raise UserError(f"precision {name!r} (float16) is not usable on CPU; use bf16-mixed or 32-true.")
    if accelerator == "cuda" and name.startswith("bf16"):
        import torch

        if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            raise UserError(f"precision {name!r} needs a GPU with bfloat16 support; use 16-mixed or 32-true.")
    return name


# --------------------------------------------------------------------------------------------
# Choosing the strategy
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StrategyPlan:
    """The resolved distributed set-up, before any Fabric object exists (pure, easy to test)."""

    kind: Literal["single", "ddp", "fsdp"]
    accelerator: str  # "cpu", "cuda", ...
    devices: int  # per node
    num_nodes: int
    precision: str
    sharding: ShardingName | None  # FSDP only
    device_mesh: tuple[int, int] | None  # (num_nodes, devices) for HYBRID_SHARD, else None
    activation_checkpointing: bool
    cpu_offload: bool
    state_dict_type: StateDictTypeName
    process_group_backend: str | None  # "gloo" on CPU, "nccl" on CUDA; None for one device
    timeout: int  # seconds a collective waits
    notes: tuple[tuple[int, str], ...] = ()  # (logging level, one-line message) to log on rank 0

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    def describe(self) -> str:
        """One line for the start-up log, e.g. 'strategy: FSDP HYBRID_SHARD, mesh (2 nodes x 4 devices), ...'."""
        if self.kind == "single":
            where = "single device"
        elif self.kind == "ddp":
            where = f"DDP over {self.world_size} processes"
        else:
            where = f"FSDP2 {self.sharding} over {self.world_size} processes, each transformer Block sharded"
            if self.device_mesh is not None:
                where += f", mesh ({self.device_mesh[0]} nodes replicate x {self.device_mesh[1]} devices shard)"
            if self.precision.endswith("-mixed"):
                gather = "bfloat16" if self.precision.startswith("bf16") else "float16"
                where += f", block weights gathered in {gather}, gradients reduced in float32"
        extras = [f"precision {self.precision}", self.accelerator]
        if self.activation_checkpointing:
            extras.append("activation checkpointing")
        if self.cpu_offload:
            extras.append("CPU offload")
        return f"strategy: {where}; " + ", ".join(extras)


def plan_strategy(
    devices: int | str,
    num_nodes: int,
    precision: str | None,
    dist: DistributedArgs,
    accelerator: str = "auto",
) -> StrategyPlan:
    """Validate the arguments and decide strategy, sharding and mesh. Raises UserError."""
    check_choice("distributed.strategy", dist.strategy, get_args(StrategyName))
    check_choice("distributed.sharding", dist.sharding, get_args(ShardingName))
    check_choice("distributed.state_dict_type", dist.state_dict_type, get_args(StateDictTypeName))
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise UserError(f"num_nodes must be at least 1, got {num_nodes!r}.")
    accelerator = resolve_accelerator(accelerator)
    devices = resolve_devices(devices, accelerator)
    precision = resolve_precision(precision, accelerator)
    notes: list[tuple[int, str]] = []

    def plan(kind: Literal["single", "ddp", "fsdp"], **fsdp_fields: Any) -> StrategyPlan:
        fields = dict(sharding=None, device_mesh=None, cpu_offload=False, process_group_backend=None)
        if kind != "single":
            fields["process_group_backend"] = "gloo" if accelerator == "cpu" else "nccl"
        fields.update(fsdp_fields)
        return StrategyPlan(
            kind=kind,
            accelerator=accelerator,
            devices=devices,
            num_nodes=num_nodes,
            precision=precision,
            activation_checkpointing=dist.activation_checkpointing,
            state_dict_type=dist.state_dict_type,
            timeout=dist.timeout,
            notes=tuple(notes),
            **fields,
        )

    if devices * num_nodes == 1:
        if dist.strategy != "auto":
            notes.append((logging.INFO, f"One device in total: training on a single device, not {dist.strategy}."))
        if dist.cpu_offload:
            notes.append((logging.WARNING, "cpu_offload applies to FSDP only (more than one device); ignored."))
        return plan("single")

    if dist.strategy == "ddp":
        if dist.cpu_offload:
            notes.append((logging.WARNING, "cpu_offload applies to FSDP only; ignored with strategy ddp."))
        return plan("ddp")

    sharding: ShardingName = dist.sharding
    mesh: tuple[int, int] | None = None
    if sharding == "HYBRID_SHARD":
        if num_nodes == 1:
            # A single replica: shard over all devices, replicate over one, which is exactly
            # FULL_SHARD (both verified to synchronize). Use the plain strategy, no mesh needed.
            sharding = "FULL_SHARD"
            notes.append((logging.INFO, "HYBRID_SHARD on one node is FULL_SHARD; using FULL_SHARD."))
        elif devices == 1:
            # Nothing to shard within a node: shard over all nodes rather than replicate on each.
            sharding = "FULL_SHARD"
            notes.append(
                (logging.WARNING, "HYBRID_SHARD needs more than one device per node; using FULL_SHARD across all nodes.")
            )
        else:
            # Mesh (replicate over nodes, shard within a node): a rank's shard group is its node.
            # Without an explicit mesh, Fabric's HYBRID_SHARD lets every rank train on its own.
            mesh = (num_nodes, devices)
    cpu_offload = dist.cpu_offload
    if cpu_offload and accelerator == "cpu":
        cpu_offload = False
        notes.append((logging.WARNING, "cpu_offload is ignored when training on CPU (parameters are there already)."))
    return plan("fsdp", sharding=sharding, device_mesh=mesh, cpu_offload=cpu_offload)


# --------------------------------------------------------------------------------------------
# QLoRA: a bitsandbytes-quantized frozen base on more than one device
# --------------------------------------------------------------------------------------------

# Why the quantized base is not sharded (measured with torch 2.13 and bitsandbytes 0.50.2 on gloo by
# benchmarks/fsdp_bitsandbytes.py):
# `fully_shard` turns each weight into a DTensor and, before every forward pass, gathers it into a
# plain `nn.Parameter`. What bitsandbytes keeps on its own parameter classes is then gone:
# `Linear4bit` (float `quant_storage` or not) fails with "quant_state is required" and
# `Linear8bitLt` with "'Parameter' object has no attribute 'CB'". bitsandbytes can restore the
# 4-bit state from its layer (a `Params4bit` created with `module=layer`); with that, a sharded
# NF4 layer with bfloat16 `quant_storage` gave bit-identical outputs and input gradients to one
# process. The 8-bit layer has no such path, and a 4-bit weight cannot be read row by row from the
# checkpoint (its blocks of 64 values and their scales need the whole weight), so every rank would
# quantize every full weight anyway. Until both hold, the base is replicated.
QUANTIZED_BASE_NOT_SHARDED = (
    "FSDP2 gathers each weight into a plain parameter and bitsandbytes' quantization state is lost with it"
)


@dataclass(frozen=True)
class QuantizedBasePlan:
    """How QLoRA spreads over devices: which scheme, with which arguments, and why."""

    scheme: Literal["single", "replicated"]
    dist: DistributedArgs  # the arguments to build the strategy from
    reason: str  # one line for the start-up log

    def describe(self) -> str:
        return f"QLoRA scheme: {self.scheme}; {self.reason}"


def plan_quantized_base(
    devices: int | str, num_nodes: int, dist: DistributedArgs, quantize: str, accelerator: str = "auto"
) -> QuantizedBasePlan:
    """The scheme for a frozen base quantized with bitsandbytes (`--quantize`). Raises UserError.

    One device: the base is quantized on the CPU and moved, as always. More than one: the
    replicated scheme. Every rank builds and quantizes the whole base exactly as one device does
    (the same checkpoint, the same deterministic quantization, so the same bytes everywhere), and
    DDP synchronises what trains, the LoRA adapters: their gradients are averaged over all ranks
    of all nodes after each optimizer step's last micro-batch. The cost is the whole quantized
    base on every device (about 5 GB for 8B in NF4, 35 GB for 70B); adapters, their gradients and
    AdamW state are small. See QUANTIZED_BASE_NOT_SHARDED for why FSDP2 is not used.
    """
    world = resolve_devices(devices, resolve_accelerator(accelerator)) * num_nodes
    if world == 1:
        return QuantizedBasePlan("single", dist, f"one device holds the {quantize} base")
    if dist.strategy == "fsdp":
        raise UserError(
            f"--distributed.strategy fsdp cannot shard a --quantize {quantize} base: {QUANTIZED_BASE_NOT_SHARDED}. "
            "Leave --distributed.strategy auto: each device then holds the whole quantized base and only the "
            "LoRA adapters are synchronised."
        )
    reason = (
        f"each of the {world} processes holds the whole {quantize} base and DDP synchronises only the LoRA "
        f"adapters (the base is not sharded: {QUANTIZED_BASE_NOT_SHARDED})"
    )
    return QuantizedBasePlan("replicated", replace(dist, strategy="ddp"), reason)


def build_fabric(
    devices: int | str,
    num_nodes: int,
    precision: str | None,
    dist: DistributedArgs,
    block_cls: type[nn.Module],
    accelerator: str = "auto",
    loggers: Any = None,
) -> Fabric:
    """A configured (not yet launched) Fabric; call `fabric.launch()` next (see module docstring).

    `block_cls` is the model's repeated transformer block: FSDP wraps (shards) each instance of it
    separately and activation checkpointing, when asked, recomputes each one. Raises UserError on
    invalid arguments.
    """
    plan = plan_strategy(devices, num_nodes, precision, dist, accelerator)
    check_launcher(plan.num_nodes, plan.devices)
    from lightning import Fabric
    from torch import nn

    if not (isinstance(block_cls, type) and issubclass(block_cls, nn.Module)):
        raise TypeError(f"block_cls must be an nn.Module subclass (the transformer block), got {block_cls!r}")

    strategy, plugins, fabric_precision = _make_strategy(plan, block_cls)
    if plan.kind != "fsdp":  # (FSDP writes its files with torch's distributed checkpoint or torch.save)
        plugins = [*plugins, _direct_checkpoint_io()]
    fabric = Fabric(
        accelerator=plan.accelerator,
        devices=plan.devices,
        num_nodes=plan.num_nodes,
        strategy=strategy,
        precision=fabric_precision,
        plugins=plugins,
        loggers=loggers,
    )
    if plan.kind != "single":
        _prepare_failure_handling(plan, fabric)
    if fabric.global_rank == 0:
        for level, message in plan.notes:
            log.log(level, message)
    return fabric


def _direct_checkpoint_io() -> Any:
    """A CheckpointIO plugin that `torch.save`s straight into the file.

    Lightning's default serializes the whole checkpoint into an in-memory buffer first, so that the
    file appears complete or not at all: a second copy of the weights and optimizer state in host
    memory (+3 GiB at 336M parameters, measured; +96 GB for a one-GPU 8B full fine-tune). The
    toolkit's checkpoints are atomic at the folder level (`toolkit.training.checkpoint.save` writes
    into a temporary folder and renames it when complete), so the buffer buys nothing.
    """
    from pathlib import Path

    import torch
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    class DirectCheckpointIO(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
            if storage_options is not None:
                raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            torch.save(checkpoint, path)

    return DirectCheckpointIO()


def _make_strategy(plan: StrategyPlan, block_cls: type[nn.Module]) -> tuple[Any, list, str | None]:
    """(strategy, plugins, precision flag) for `Fabric(...)`."""
    import torch

    if plan.kind == "fsdp":
        strategy = sharded_strategy_class()(plan, block_cls)
        if plan.precision == "16-mixed":
            # Fabric's ModelParallelStrategy accepts no "16-mixed" flag; float16 autocast needs a
            # gradient scaler that understands sharded gradients.
            from lightning.fabric.plugins import MixedPrecision
            from torch.amp import GradScaler

            return strategy, [MixedPrecision("16-mixed", plan.accelerator, scaler=GradScaler(plan.accelerator))], None
        return strategy, [], plan.precision

    if plan.kind == "ddp":
        from lightning.fabric.strategies import DDPStrategy

        cls = _with_block_checkpointing(DDPStrategy, block_cls) if plan.activation_checkpointing else DDPStrategy
        from datetime import timedelta

        return cls(process_group_backend=plan.process_group_backend, timeout=timedelta(seconds=plan.timeout)), [], plan.precision

    if not plan.activation_checkpointing:
        return "auto", [], plan.precision  # Fabric picks the one device
    from lightning.fabric.strategies import SingleDeviceStrategy

    device = torch.device("cuda", 0) if plan.accelerator == "cuda" else torch.device(plan.accelerator)
    return _with_block_checkpointing(SingleDeviceStrategy, block_cls)(device=device), [], plan.precision


def _with_block_checkpointing(base: type, block_cls: type[nn.Module]) -> type:
    """A subclass of the strategy `base` whose `setup_module` checkpoints each block first.

    The single-device and DDP strategies have no activation-checkpointing option, so the torch
    wrapper is applied here, before DDP wraps the model. The wrapper leaves state-dict keys unchanged.
    """

    class BlockCheckpointing(base):  # type: ignore[misc, valid-type]
        def setup_module(self, module: nn.Module) -> nn.Module:
            _checkpoint_blocks(module, block_cls)
            return super().setup_module(module)

    BlockCheckpointing.__name__ = BlockCheckpointing.__qualname__ = f"BlockCheckpointing{base.__name__}"
    return BlockCheckpointing


def _checkpoint_blocks(module: nn.Module, block_cls: type[nn.Module]) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    if any(isinstance(m, CheckpointWrapper) for m in module.modules()):
        return  # already checkpointed (e.g. set up twice)
    apply_activation_checkpointing(
        module, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda m: isinstance(m, block_cls)
    )


# --------------------------------------------------------------------------------------------
# The sharding engine: FSDP2 (`fully_shard`) through Fabric's ModelParallelStrategy
# --------------------------------------------------------------------------------------------


def _model_parallel_strategy() -> type:
    from lightning.fabric.strategies import ModelParallelStrategy

    return ModelParallelStrategy


def mesh_layout(sharding: str, num_nodes: int, devices: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(mesh shape, dimension names) for a sharding name.

        FULL_SHARD, SHARD_GRAD_OP   (world,)             ("shard",)
        HYBRID_SHARD                (nodes, devices)     ("replicate", "shard")   shard within a node
        NO_SHARD                    (world, 1)           ("replicate", "shard")   replicate everything
    """
    world = num_nodes * devices
    if sharding == "HYBRID_SHARD":
        return (num_nodes, devices), ("replicate", "shard")
    if sharding == "NO_SHARD":
        return (world, 1), ("replicate", "shard")
    return (world,), ("shard",)


_SHARDED_STRATEGY: list = []


def sharded_strategy_class() -> type:
    """`ShardedStrategy`, built on first use so that importing this module stays cheap (the CLI
    imports it to read the option types, and the class subclasses a Lightning class)."""
    if not _SHARDED_STRATEGY:
        _SHARDED_STRATEGY.append(_build_sharded_strategy_class())
    return _SHARDED_STRATEGY[0]


def _build_sharded_strategy_class() -> type:
    from contextlib import contextmanager

    import torch
    from lightning.fabric.strategies.parallel import ParallelStrategy
    from lightning.fabric.strategies.strategy import _BackwardSyncControl

    base = _model_parallel_strategy()

    class ShardedStrategy(base):  # type: ignore[misc, valid-type]
        """FSDP2 per transformer Block and at the root, on our own mesh, through Fabric.

        Fabric's `ModelParallelStrategy` (Lightning 2.6) brings what we want from Fabric: process
        launch, `fabric.save`/`fabric.load` through torch's distributed checkpoint (a sharded
        checkpoint reshards on load), precision plugins and collectives. Three things are changed:

        - The mesh. Fabric builds ("data_parallel", "tensor_parallel") for tensor parallelism; we
          build the 1-D or 2-D data-parallel mesh of `mesh_layout`, so HYBRID_SHARD really shards
          within a node and replicates across nodes.
        - Materialization. Fabric re-initialises meta-device parameters with `reset_parameters`
          after sharding; here `setup_module` only shards, and `setup_model` below fills each
          rank's shards from the checkpoint (or the initialiser) so that no rank holds a full copy.
        - Gradient accumulation. Fabric's `no_backward_sync` turns off FSDP2's reduce-scatter, which
          keeps a full unsharded gradient per rank until the last micro-batch. We keep the
          reduce-scatter on every micro-batch (gradients accumulate in the shards) and defer only
          the cross-replica all-reduce of HYBRID_SHARD/NO_SHARD to the last micro-batch.

        Parameters are stored in the dtypes of `apply_precision_policy`. Under "*-mixed" each block
        gathers its weights in the compute dtype (the root, which holds the embedding, keeps its
        stored dtype); gradients are reduced in float32 except under "*-true" precision, where
        everything is in that dtype.
        """

        def __init__(self, plan: StrategyPlan, block_cls: type[nn.Module]) -> None:
            from datetime import timedelta

            super().__init__(
                parallelize_fn=self._shard,
                save_distributed_checkpoint=plan.state_dict_type == "sharded",
                process_group_backend=plan.process_group_backend,
                timeout=timedelta(seconds=plan.timeout),
            )
            self.plan = plan
            self.block_cls = block_cls
            self._backward_sync_control = _DeferCrossReplicaReduce()

        @property
        def sharding(self) -> str:
            return self.plan.sharding or "FULL_SHARD"

        @property
        def state_dict_type(self) -> str:
            return "sharded" if self._save_distributed_checkpoint else "full"

        def setup_environment(self) -> None:
            from torch.distributed.device_mesh import init_device_mesh

            ParallelStrategy.setup_environment(self)  # the accelerator; not the parent's own mesh
            self._setup_distributed()
            shape, names = mesh_layout(self.sharding, self.num_nodes, self.world_size // self.num_nodes)
            self._device_mesh = init_device_mesh(self.root_device.type, shape, mesh_dim_names=names)

        @property
        def distributed_sampler_kwargs(self) -> dict[str, Any]:
            # Every rank reads its own part of the data, whatever the mesh.
            return {"num_replicas": self.world_size, "rank": self.global_rank}

        def setup_module(self, module: nn.Module) -> nn.Module:
            return self._shard(module, self.device_mesh)

        def _shard(self, module: nn.Module, mesh: Any) -> nn.Module:
            from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

            if self.plan.activation_checkpointing:
                _checkpoint_blocks(module, self.block_cls)
            precision = self.plan.precision
            compute_dtype = precision_dtypes(precision)[1]
            reduce_dtype = None if precision.endswith("-true") and precision != "32-true" else torch.float32
            offload = CPUOffloadPolicy() if self.plan.cpu_offload else OffloadPolicy()
            # Blocks: under "*-mixed" the float32 weights are cast to the compute dtype before the
            # all-gather, so the gathered copy is 16-bit and autocast has nothing to cast (left to
            # autocast, it would keep a 16-bit copy of every block's weights until the backward
            # pass: a whole model's worth per rank). Inputs are not cast: the residual stream
            # stays in the dtype the single-device model uses.
            block_policy = MixedPrecisionPolicy(
                param_dtype=compute_dtype if precision.endswith("-mixed") else None,
                reduce_dtype=reduce_dtype, cast_forward_inputs=False,
            )
            for unit in _block_units(module, self.block_cls):
                fully_shard(unit, mesh=mesh, mp_policy=block_policy, offload_policy=offload,
                            reshard_after_forward=self.sharding != "SHARD_GRAD_OP")
            # The root: embeddings, final norm and head, in their stored dtypes (the embedding's
            # output starts the residual stream). FSDP2's default keeps the root gathered from
            # its forward pass to its backward pass, which begins with the head.
            fully_shard(module, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce_dtype),
                        offload_policy=offload)
            return module

    class _DeferCrossReplicaReduce(_BackwardSyncControl):
        def no_backward_sync(self, module: nn.Module, enabled: bool):
            return _requires_all_reduce(module, not enabled)

    @contextmanager
    def _requires_all_reduce(module: nn.Module, required: bool):
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in module.modules() if isinstance(m, FSDPModule)]
        for unit in units:
            unit.set_requires_all_reduce(required, recurse=False)
        try:
            yield
        finally:
            for unit in units:
                unit.set_requires_all_reduce(True, recurse=False)

    return ShardedStrategy


def _block_units(module: nn.Module, block_cls: type[nn.Module]) -> list[nn.Module]:
    """Each transformer block, or its activation-checkpointing wrapper when it has one."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    units, wrapped = [], set()
    for m in module.modules():
        if isinstance(m, CheckpointWrapper) and isinstance(m._checkpoint_wrapped_module, block_cls):
            units.append(m)
            wrapped.add(id(m._checkpoint_wrapped_module))
    units += [m for m in module.modules() if isinstance(m, block_cls) and id(m) not in wrapped]
    return units


def is_fsdp(fabric: Fabric) -> bool:
    return bool(_SHARDED_STRATEGY) and isinstance(fabric.strategy, _SHARDED_STRATEGY[0])


# --------------------------------------------------------------------------------------------
# Precision policy and model set-up
# --------------------------------------------------------------------------------------------


def precision_dtypes(precision: str) -> tuple[Any, Any]:
    """(dtype of trainable parameters, dtype of frozen parameters) under `precision`.

        precision      trainable (and optimizer state)   frozen (LoRA/QLoRA base)   compute
        32-true        float32                           float32                    float32
        bf16-mixed     float32                           bfloat16                   bfloat16 (autocast)
        16-mixed       float32                           float16                    float16 (autocast)
        bf16-true      bfloat16                          bfloat16                   bfloat16
        16-true        float16                           float16                    float16

    Mixed precision keeps float32 master weights so that updates smaller than bfloat16's
    resolution (about 0.4% of a weight) are not lost; frozen weights never change, so they are
    stored in the compute dtype, which halves their memory.
    """
    import torch

    compute = {"bf16": torch.bfloat16, "16": torch.float16, "32": torch.float32}[precision.split("-")[0]]
    trainable = compute if precision.endswith("-true") else torch.float32
    return trainable, compute


def apply_precision_policy(model: nn.Module, precision: str) -> str:
    """Cast every floating-point parameter to the dtype `precision_dtypes` gives it (cheap on meta).

    Returns one line for the start-up log. Quantized (integer) weights are left alone.
    """
    trainable_dtype, frozen_dtype = precision_dtypes(precision)

    def cast(param):
        if not param.is_floating_point():
            return None
        dtype = trainable_dtype if param.requires_grad else frozen_dtype
        return None if param.dtype == dtype else param.detach().to(dtype)

    _replace_parameters(model, cast)
    counts: dict[tuple[bool, Any], int] = {}
    for p in model.parameters():
        counts[(p.requires_grad, p.dtype)] = counts.get((p.requires_grad, p.dtype), 0) + p.numel()
    parts = [f"{n:,} {'trainable' if t else 'frozen'} in {str(d).removeprefix('torch.')}" for (t, d), n in sorted(counts.items(), key=str)]
    return f"precision policy ({precision}): " + ", ".join(parts)


def _replace_parameters(model: nn.Module, make: Any) -> None:
    """Replace parameters by `make(old)` (None keeps the old one); shared (tied) parameters stay shared."""
    from torch import nn as _nn

    replaced: dict[int, Any] = {}
    for module in model.modules():
        for leaf, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in replaced:
                new = make(param)
                replaced[id(param)] = param if new is None else _nn.Parameter(new, requires_grad=param.requires_grad)
            module._parameters[leaf] = replaced[id(param)]


# Where the initial values of a model's parameters come from: `read_rows(name, start, stop, out=None)`
# returns rows [start, stop) (dim 0) of the full parameter `name` (toolkit name, no wrapper
# prefixes), in any dtype; `stop=None` means to the last row. With `out` (a tensor of that shape, in
# any dtype) it writes the rows into `out` and returns it, so that a rank's shard is filled without
# a second copy of it. FSDP2 shards every parameter along dim 0.
ReadRows = Callable[..., "Tensor"]


def setup_model(fabric: Fabric, model: nn.Module, read_rows: ReadRows) -> Any:
    """Set up a model built on the meta device and fill its parameters from `read_rows`.

    Parameters that are already real (not meta) keep their values: LoRA adapters are initialised
    before this call. Without FSDP the full tensors are filled in and then Fabric moves the model.
    Under FSDP the model is sharded first, still on the meta device; then each rank allocates and
    reads only its own rows of each parameter, so no rank ever holds the whole model.

    Returns Fabric's wrapped model.
    """
    import torch

    if not is_fsdp(fabric):
        materialize(model, read_rows)
        module = fabric.setup_module(model)
        return module
    preset = {unwrapped_name(n): p.detach().clone() for n, p in model.named_parameters() if not p.is_meta}
    module = fabric.setup_module(model)
    inner = module.module if hasattr(module, "module") else module
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    inner.to_empty(device=fabric.device)
    with torch.no_grad():
        for name, param in inner.named_parameters():
            name = unwrapped_name(name)
            if isinstance(param, DTensor):
                local = param.to_local()
                shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
                assert all(o == 0 for o in offset[1:]) and tuple(shape[1:]) == tuple(param.shape[1:]), name
                start, stop = offset[0], offset[0] + shape[0]
            else:
                local, start, stop = param, 0, None
            if local.numel() == 0:
                continue
            full = preset.get(name)
            if full is not None:
                local.copy_(full[start:stop].reshape(local.shape))
            else:
                read_rows(name, start, stop, out=local)
    return module


def materialize(model: nn.Module, read_rows: ReadRows) -> None:
    """Give every parameter still on the meta device its full value from `read_rows` (one device)."""
    names = {}
    for name, param in model.named_parameters(remove_duplicate=True):
        names[id(param)] = unwrapped_name(name)

    def fill(param):
        if not param.is_meta:
            return None
        # Kept in the dtype it is stored in: the precision policy, applied next, casts only what it must.
        return read_rows(names[id(param)], 0, None)

    _replace_parameters(model, fill)


def start_host_memory_window() -> int:
    """Reset this process's peak-RSS mark (Linux) and return its current RSS in bytes."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # "5" resets the peak resident set size (VmHWM) to the current RSS
    except OSError:
        pass
    return _status_bytes("VmRSS")


def host_memory_growth(start: int) -> int:
    """Peak RSS since `start_host_memory_window` above the RSS it started from, in bytes."""
    return max(_status_bytes("VmHWM") - start, 0)


def _status_bytes(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # not Linux: the lifetime peak


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------


def full_state_dict(fabric: Fabric, model: nn.Module, rank0_only: bool = True) -> dict[str, Tensor]:
    """The model's complete (unsharded) weights, as CPU tensors with the model's own key names.

    A collective call: every rank must call it. With `rank0_only` the other ranks get `{}`, which
    saves memory; with `rank0_only=False` every rank gets the full dict. This is what the final
    export writes, whatever `state_dict_type` mid-run checkpoints use. Without FSDP on CPU the
    tensors share memory with the live parameters (no copy is made).
    """
    from lightning.fabric.wrappers import _FabricModule, _unwrap_compiled, _unwrap_objects

    if is_fsdp(fabric):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        root = _unwrap_objects(model)
        # cpu_offload with full_state_dict gathers one tensor at a time onto rank 0's CPU only.
        state = get_model_state_dict(root, options=StateDictOptions(full_state_dict=True, cpu_offload=rank0_only))
    else:
        # The user's module, without DDP or torch.compile wrappers (no "module."/"_orig_mod." in keys).
        module = _unwrap_compiled(model)[0]
        if isinstance(module, _FabricModule):
            module = _unwrap_compiled(module._original_module)[0]
        state = module.state_dict()
    if rank0_only and fabric.global_rank != 0:
        return {}
    return {unwrapped_name(k): v.detach().cpu() for k, v in state.items()}


def gather_objects(fabric: Fabric, obj: Any) -> list[Any]:
    """`obj` of every rank, in rank order, on every rank. For small picklable things (digests, messages)."""
    if fabric.world_size == 1:
        return [obj]
    import torch.distributed as dist

    gathered: list[Any] = [None] * fabric.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def load_resharded(fabric: Fabric, path: Any, model: Any, optimizer: Any, strict: bool = True) -> dict[str, Any]:
    """Load a `fabric.save` checkpoint written by another number of processes; return its other entries.

    `path` is what `fabric.save` wrote: a folder of torch's distributed checkpoint (FSDP, sharded),
    or one file (one process, or FSDP with state_dict_type "full"). Every process, sharded or
    not, reads what it needs through torch's state-dict API, which names parameters and optimizer
    state by parameter name rather than by position:

        folder -> FSDP or one process   each rank reads the pieces of the saved shards that
                                        overlap its own shard (the distributed checkpoint reshards)
        file   -> FSDP or one process   each rank memory-maps the file and keeps its own rows

    A file written by one process keys the optimizer state by position (0, 1, ...). The optimizer
    is built the same way on every run, so position i of group g is the i-th parameter of group g
    now: that gives each state its parameter name. Fabric's own conversion assumes the optimizer
    holds `model.parameters()` in order, which ours (decay and no-decay groups) does not.
    """
    from pathlib import Path

    import torch
    import torch.distributed.checkpoint as dcp
    from lightning.fabric.wrappers import _unwrap_objects
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    path = Path(path)
    root, optim = _unwrap_objects(model), _unwrap_objects(optimizer)
    if path.is_dir():
        # Model first, then the optimizer (whose state is created at its parameters' current shards).
        model_state = {"model": get_model_state_dict(root)}
        dcp.load(model_state, checkpoint_id=path)
        set_model_state_dict(root, model_state["model"], options=StateDictOptions(strict=strict))
        optim_state = {"optimizer": get_optimizer_state_dict(root, optim)}
        dcp.load(optim_state, checkpoint_id=path)
        set_optimizer_state_dict(root, optim, optim_state["optimizer"])
        from lightning.fabric.utilities.load import _METADATA_FILENAME  # "meta.pt": what is not model or optimizer

        return torch.load(path / _METADATA_FILENAME, weights_only=True)

    checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=True)
    full = StateDictOptions(full_state_dict=True, strict=strict)
    set_model_state_dict(root, checkpoint.pop("model"), options=full)
    saved = checkpoint.pop("optimizer")
    if any(isinstance(key, int) for key in saved["state"]):
        names = get_optimizer_state_dict(root, optim)["param_groups"]  # the same groups, parameters named
        if [len(g["params"]) for g in names] != [len(g["params"]) for g in saved["param_groups"]]:
            raise ValueError(f"{path}: the optimizer's parameter groups differ from the checkpoint's")
        name_of = {i: n for now, then in zip(names, saved["param_groups"]) for i, n in zip(then["params"], now["params"])}
        saved = {
            "state": {name_of[i]: s for i, s in saved["state"].items()},
            "param_groups": [dict(g, params=[name_of[i] for i in g["params"]]) for g in saved["param_groups"]],
        }
    set_optimizer_state_dict(root, optim, saved, options=full)
    return checkpoint


# --------------------------------------------------------------------------------------------
# Failing together: one message from every process, in seconds, instead of a hang
# --------------------------------------------------------------------------------------------

# Environment variables that tell Fabric where a process stands when no launcher (torchrun,
# SLURM, ...) set it up: without them every node of a multi-node run thinks it is node 0.
_MANUAL_LAUNCH_VARIABLES = ("NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
# Set by a process that will start its node's other ranks itself (Fabric's launcher), so that
# those ranks can tell that their parent is rank 0 of the node, and notice when it is gone.
_LAUNCHER_PID_VARIABLE = "TOOLKIT_LAUNCHER_PID"
# How often the watch threads look at their processes, and how long a process whose peer died
# is given to stop on its own (with its own message) before it is stopped.
_WATCH_SECONDS = 0.5
_GRACE_SECONDS = 10.0


@dataclass
class _FailureContext:
    """What the messages about a failed peer need to know about the run (set by build_fabric)."""

    timeout: int = 0
    num_nodes: int = 1
    devices: int = 1
    peer_failures: list = None  # one line per dead local rank, found by the watch threads

    def __post_init__(self) -> None:
        self.peer_failures = []


_FAILURE_CONTEXT = _FailureContext()


def _launcher_environment() -> Optional[str]:
    """The name of the launcher that set up this process's environment, or None.

    The same tests as Lightning's cluster environments (TorchElasticEnvironment, SLURMEnvironment,
    LSFEnvironment `detect()`), made on the environment variables directly: importing Lightning
    takes seconds, and this check runs before anything else.
    """
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # torch.distributed.is_torchelastic_launched()
        return "torchrun"
    if "SLURM_NTASKS" in os.environ and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return "SLURM"  # started by srun (an interactive allocation is not a launcher)
    if all(v in os.environ for v in ("LSB_JOBID", "LSB_DJOB_RANKFILE", "JSM_NAMESPACE_LOCAL_RANK", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_RANK")):
        return "LSF"
    if all(os.environ.get(v) for v in _MANUAL_LAUNCH_VARIABLES):
        return "NODE_RANK/MASTER_ADDR/MASTER_PORT"
    return None


def check_launcher(num_nodes: int, devices: int) -> None:
    """Refuse to start a multi-node run that nothing launched, before any process starts.

    Without torchrun, SLURM (or LSF) or NODE_RANK, MASTER_ADDR and MASTER_PORT, every
    node would claim ranks 0..devices-1 and wait on its own random port: a silent hang. One node
    needs nothing: Fabric starts the local processes itself.
    """
    if num_nodes <= 1 or _launcher_environment() is not None:
        return
    missing = [v for v in _MANUAL_LAUNCH_VARIABLES if not os.environ.get(v)]
    raise UserError(
        f"--num_nodes {num_nodes} needs a launcher that tells each process where it stands, and none was found "
        f"(no torchrun or SLURM environment; {', '.join(missing)} not set). Start the same command on every node, "
        f"either with torchrun: `torchrun --nnodes {num_nodes} --nproc-per-node {devices} --node-rank <0..{num_nodes - 1}> "
        f"--master-addr <address of node 0> --master-port 29500 -m toolkit <command and options>`, or under SLURM: "
        f"`srun --nodes {num_nodes} --ntasks-per-node {devices} toolkit <command and options>`, or by setting "
        f"NODE_RANK (0..{num_nodes - 1}), MASTER_ADDR (node 0's address) and MASTER_PORT (a free port on node 0) "
        "on every node. See tutorials/distributed.md."
    )


def _prepare_failure_handling(plan: StrategyPlan, fabric: Fabric) -> None:
    """Make a failed or vanished process stop the others with a message (see `explain_peer_failure`).

    Called by build_fabric, before `fabric.launch()`. In the process that will start the node's
    other ranks (Fabric's launcher), Lightning's child-process observer is replaced by
    `_watch_local_ranks`; in a rank that process started, a thread watches that it is still there.
    """
    _FAILURE_CONTEXT.timeout, _FAILURE_CONTEXT.num_nodes, _FAILURE_CONTEXT.devices = plan.timeout, plan.num_nodes, plan.devices
    _FAILURE_CONTEXT.peer_failures.clear()
    if plan.process_group_backend == "nccl" and os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "0":
        log.warning(
            "TORCH_NCCL_ASYNC_ERROR_HANDLING=0: a collective that times out will not stop this process, so a dead "
            "rank hangs the job; unset it to let --distributed.timeout end the run."
        )
    launched_by = os.environ.get(_LAUNCHER_PID_VARIABLE)
    if not fabric.strategy.cluster_environment.creates_processes_externally:
        # This process will start the node's other ranks (Fabric's _SubprocessScriptLauncher).
        os.environ[_LAUNCHER_PID_VARIABLE] = str(os.getpid())
        import lightning.fabric.strategies.launchers.subprocess_script as subprocess_script

        # Workaround for Lightning 2.6: its `_ChildProcessObserver` SIGKILLs every process of the
        # node within 5 s of a child exiting non-zero, including rank 0 while it prints the same
        # error or removes what it half-wrote, and says why only at INFO level, which is not shown.
        subprocess_script._launch_process_observer = _watch_local_ranks
    elif launched_by is not None and launched_by == str(os.getppid()):
        threading.Thread(target=_watch_launcher, args=(int(launched_by),), daemon=True, name="toolkit-launcher-watch").start()


def _watch_local_ranks(children: list) -> None:
    """Replaces Lightning's observer of the ranks this process started (see `_prepare_failure_handling`)."""
    threading.Thread(target=_watch_children, args=(children,), daemon=True, name="toolkit-rank-watch").start()


def _watch_children(children: list) -> None:
    """Rank 0 of a node: notice a local rank that died, name it, and stop the node if it hangs.

    A dead rank makes the others fail in their next collective (gloo at once; NCCL when the
    collective times out). This process is given `_GRACE_SECONDS` to stop by itself with its own
    message (`explain_peer_failure` names the dead rank); if it is still running then (stuck in a
    collective), the message is printed here and every process of the node is stopped.
    """
    node_rank = int(os.environ.get("NODE_RANK", "0"))
    per_node = len(children) + 1
    while True:
        time.sleep(_WATCH_SECONDS)
        codes = [child.poll() for child in children]
        if all(code == 0 for code in codes):
            return  # every rank finished cleanly
        failed = [(i, child, code) for i, (child, code) in enumerate(zip(children, codes)) if code not in (None, 0)]
        if failed:
            break
    for i, child, code in failed:
        _FAILURE_CONTEXT.peer_failures.append(_describe_exit(node_rank * per_node + i + 1, child.pid, code))
    time.sleep(min(_GRACE_SECONDS, max(_FAILURE_CONTEXT.timeout, 1)))
    _stop_now(f"{_FAILURE_CONTEXT.peer_failures[0]}; stopping the other processes.", children)


def _watch_launcher(launcher_pid: int) -> None:
    """A rank started by Fabric's launcher: notice that the launching process (local rank 0) is gone.

    Its death closes the connections of the other ranks (gloo) or leaves them waiting in a
    collective (NCCL); if this process has not stopped by itself within the grace period, it stops.
    """
    while os.getppid() == launcher_pid:
        time.sleep(_WATCH_SECONDS)
    _FAILURE_CONTEXT.peer_failures.append(_describe_launcher_gone(launcher_pid))
    time.sleep(min(_GRACE_SECONDS, max(_FAILURE_CONTEXT.timeout, 1)))
    _stop_now(f"{_FAILURE_CONTEXT.peer_failures[0]}; stopping.", [])


def _describe_exit(rank: int, pid: int, code: int) -> str:
    if code < 0:
        import signal

        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
        cause = " (the kernel's out-of-memory killer sends SIGKILL; see `dmesg`)" if name == "SIGKILL" else ""
        return f"rank {rank} (process {pid}) was killed by {name}{cause}"
    return f"rank {rank} (process {pid}) exited with code {code} (its own message is above)"


def _describe_launcher_gone(pid: int) -> str:
    node_rank = int(os.environ.get("NODE_RANK", "0"))
    return f"rank {node_rank * _FAILURE_CONTEXT.devices} (process {pid}, which started this node's other ranks) is gone: killed, or out of memory"


def _stop_now(message: str, children: list) -> None:
    """Print `message` as this process's one line, stop `children` and exit at once (from any thread)."""
    import signal

    sys.stderr.write(f"toolkit: error: {message}\n")
    sys.stderr.flush()
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGKILL)  # SIGTERM does not end a process stuck in a collective
    os._exit(1)


def release_process_group() -> None:
    """Tear the process group down after a run that ended normally (every rank calls it).

    Left to the interpreter's exit, torch's communication threads (and the TCP store that rank 0
    hosts) can be destroyed while still running: once in a few hundred CPU runs the process then
    ended with SIGABRT ("terminate called without an active exception") after all its work.
    """
    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def run_on_rank_zero(fabric: Fabric, work: Callable[[], Any]) -> Any:
    """Run `work()` on global rank 0 while the others wait; every rank learns how it went.

    Use it for work only rank 0 does (preparing data, training a tokenizer, writing the final
    model) instead of `if rank == 0: work()` followed by a barrier, which strands the other ranks
    at the barrier (until the timeout) when rank 0 fails. A UserError on rank 0 is raised on every
    rank with the same message, so all of them exit non-zero with the same one line. Any other
    exception keeps its traceback on rank 0 and is a one-line `PeerFailure` on the others.

    Returns what `work` returned on rank 0, None on the other ranks. A collective call.
    """
    if fabric.world_size == 1:
        return work()
    result, outcome, raised = None, None, None
    if fabric.global_rank == 0:
        try:
            result = work()
        except UserError as error:
            outcome, raised = ("user", str(error)), error
        except Exception as error:
            outcome, raised = ("crash", f"{type(error).__name__}: {error}".splitlines()[0]), error
    outcome = fabric.broadcast(outcome, src=0)  # also the barrier that the others wait at
    if raised is not None:
        raise raised
    if outcome is not None:
        kind, message = outcome
        if kind == "user":
            raise UserError(message)
        raise PeerFailure(f"rank 0 failed ({message}); its traceback is above")
    return result


def explain_peer_failure(error: BaseException) -> Optional[str]:
    """One line for an error that a failed or vanished process caused in this one, or None.

    Such errors come out of a collective: with gloo at once (the connection closes), with NCCL
    after --distributed.timeout; at start-up, out of the rendezvous. The line names the dead rank
    when this node's watch threads saw it die, and says what to do otherwise. In the process that
    started the node's other ranks, those still running are stopped before it exits.
    """
    if isinstance(error, PeerFailure):
        return str(error)
    import torch.distributed as dist

    text = str(error)
    is_distributed = isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError) and re.search(r"gloo|NCCL|Connection (closed|reset) by peer|Broken pipe|Timed out", text)
    )
    if not is_distributed:
        return None
    detail = _first_line(text)
    context = _FAILURE_CONTEXT
    if isinstance(error, dist.DistStoreError) or "clients joined" in text or "TCPStore" in text:
        address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        return (
            f"the processes did not all meet at {address} (MASTER_ADDR:MASTER_PORT) within --distributed.timeout="
            f"{context.timeout} s ({detail}). Start the same command on all {context.num_nodes} node(s) with the same "
            f"MASTER_ADDR and MASTER_PORT and NODE_RANK 0..{context.num_nodes - 1}, and check that every node can reach "
            "node 0 on that port."
        )
    # Give this node's watch threads time to see which local process died.
    deadline = time.monotonic() + 4 * _WATCH_SECONDS
    while not context.peer_failures and time.monotonic() < deadline:
        time.sleep(_WATCH_SECONDS / 5)
    if context.peer_failures:
        return f"{context.peer_failures[0]}; stopping."
    if re.search(r"timed out|timeout", text, re.IGNORECASE):
        return (
            f"a collective waited longer than --distributed.timeout={context.timeout} s for another process ({detail}); "
            "that process is stuck or gone: look for its message, or raise the timeout if rank 0 was still working alone."
        )
    return (
        f"lost contact with another process in a collective ({detail}): it failed or was killed; "
        "its own message, or its launcher's, says which."
    )


def _first_line(text: str) -> str:
    """The informative part of a torch.distributed error: its first line, without gloo's source location."""
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    line = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", line)
    return line[:200]


# --------------------------------------------------------------------------------------------
# Batch math (defined once, here)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchPlan:
    """How a global batch is split: over devices, nodes and gradient-accumulation steps.

    global_batch_size = devices * num_nodes * micro_batch_size * gradient_accumulation_iters,
    counted in sequences of max_seq_length tokens.
    """

    devices: int
    num_nodes: int
    micro_batch_size: int
    global_batch_size: int
    max_seq_length: int
    gradient_accumulation_iters: int

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step (at most: sequences may be padded or packed shorter)."""
        return self.global_batch_size * self.max_seq_length

    def table(self) -> str:
        """A human-readable summary printed at start-up."""
        rows = [
            ("devices per node", f"{self.devices}"),
            ("nodes", f"{self.num_nodes}"),
            ("micro batch (per device)", f"{self.micro_batch_size}"),
            ("gradient accumulation steps", f"{self.gradient_accumulation_iters}"),
            (
                "global batch (sequences)",
                f"{self.global_batch_size} = {self.devices} x {self.num_nodes} x "
                f"{self.micro_batch_size} x {self.gradient_accumulation_iters}",
            ),
            ("sequence length", f"{self.max_seq_length}"),
            ("tokens per optimizer step", f"{self.tokens_per_step:,}"),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(["Batch plan"] + [f"  {name:<{width}}  {value}" for name, value in rows])


def plan_batches(
    devices: int, num_nodes: int, micro_batch_size: int, global_batch_size: int, max_seq_length: int
) -> BatchPlan:
    """Resolve the accumulation steps; raise UserError (never round) if the batch does not split."""
    for name, value in (
        ("devices", devices),
        ("num_nodes", num_nodes),
        ("micro_batch_size", micro_batch_size),
        ("global_batch_size", global_batch_size),
        ("max_seq_length", max_seq_length),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{name} must be a positive integer, got {value!r}.")
    world_size = devices * num_nodes
    per_iter = world_size * micro_batch_size  # sequences per accumulation step, all ranks together
    if global_batch_size % per_iter:
        raise UserError(_indivisible_message(devices, num_nodes, micro_batch_size, global_batch_size))
    return BatchPlan(
        devices=devices,
        num_nodes=num_nodes,
        micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size,
        max_seq_length=max_seq_length,
        gradient_accumulation_iters=global_batch_size // per_iter,
    )


def _indivisible_message(devices: int, num_nodes: int, micro: int, global_batch: int) -> str:
    world_size = devices * num_nodes
    per_iter = world_size * micro
    below = (global_batch // per_iter) * per_iter
    above = below + per_iter
    options = [str(n) for n in (below, above) if n > 0]
    message = (
        f"global_batch_size {global_batch} is not a multiple of devices x nodes x micro_batch_size "
        f"= {devices} x {num_nodes} x {micro} = {per_iter}. Use global_batch_size "
        + " or ".join(options)
    )
    # The largest smaller micro batch that divides the global batch (accumulating more steps).
    if global_batch % world_size == 0:
        per_rank = global_batch // world_size
        fits = [m for m in range(min(micro, per_rank), 0, -1) if per_rank % m == 0]
        if fits:
            message += f", or micro_batch_size {fits[0]}"
    return message + "."


__all__ = [
    "BatchPlan",
    "DistributedArgs",
    "PRECISIONS",
    "QuantizedBasePlan",
    "StrategyPlan",
    "build_fabric",
    "check_launcher",
    "explain_peer_failure",
    "full_state_dict",
    "is_fsdp",
    "plan_batches",
    "plan_quantized_base",
    "plan_strategy",
    "resolve_accelerator",
    "resolve_devices",
    "resolve_precision",
    "run_on_rank_zero",
]
