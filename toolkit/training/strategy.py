"""The distributed strategy: devices, precision, mesh, and the Fabric object that trains on them.

A caller plans once and passes the plan on:

    strategy = plan_strategy(devices, num_nodes, precision, dist_args)      # pure: validates, decides
    batches = plan_batches(strategy.devices, num_nodes, micro, global_batch, max_seq_length)
    fabric = build_fabric(strategy, block_cls=Block, loggers=loggers)      # checks the launcher first
    fabric.launch()          # see "Launching" below

    with torch.device("meta"):
        model = GPT(config)                     # no memory yet
    apply_precision_policy(model, strategy.precision)   # toolkit.training.precision
    model = setup_model(fabric, model, read_rows)       # toolkit.training.model_setup: shard, then fill
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), ...))  # created AFTER setup

With more than one device the engine is FSDP2 (`torch.distributed.fsdp.fully_shard`), one unit per
transformer Block, one for the embedding, one for the final norm and head (`edge_units`; a tied
embedding and head stay in the root unit), and the root, on the mesh of `StrategyPlan.mesh`; see `ShardedStrategy`
(built by `sharded_strategy_class`) for what it changes in Fabric's `ModelParallelStrategy` and
why. Under FSDP `fabric.save` writes `DistributedArgs.state_dict_type`: "sharded" (a directory
written by torch's distributed checkpoint, one file per rank, loadable on another number of
devices) or "full" (one file). Without FSDP it always writes one full file. `--distributed.strategy
ddp` keeps Fabric's DDP for models that fit on one device.

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
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, get_args

from toolkit.errors import UserError, check_choice
from toolkit.training.args import DistributedArgs, ShardingName, StateDictTypeName, StrategyName
from toolkit.training.checkpoint_io import direct_checkpoint_io
from toolkit.training.failures import check_launcher, prepare_failure_handling
from toolkit.training.precision import PRECISION_ALIASES, PRECISIONS, precision_dtypes

if TYPE_CHECKING:
    from lightning import Fabric
    from torch import nn

log = logging.getLogger(__name__)

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
    name = PRECISION_ALIASES.get(str(precision).lower(), str(precision).lower())
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
    activation_checkpointing: bool
    cpu_offload: bool
    state_dict_type: StateDictTypeName
    # "gloo" on CPU, "nccl" on CUDA, "cuda:nccl,cpu:gloo" on CUDA with cpu_offload; None for one device
    process_group_backend: str | None
    timeout: int  # seconds a collective waits
    notes: tuple[tuple[int, str], ...] = ()  # (logging level, one-line message) to log on rank 0

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    @property
    def mesh(self) -> tuple[tuple[int, ...], tuple[str, ...]] | None:
        """(shape, dimension names) of the FSDP device mesh (see `mesh_layout`); None without FSDP."""
        return mesh_layout(self.sharding, self.num_nodes, self.devices) if self.kind == "fsdp" else None

    def describe(self) -> str:
        """One line for the start-up log, e.g. 'strategy: FSDP HYBRID_SHARD, mesh (2 nodes x 4 devices), ...'."""
        if self.kind == "single":
            where = "single device"
        elif self.kind == "ddp":
            where = f"DDP over {self.world_size} processes"
        else:
            where = f"FSDP2 {self.sharding} over {self.world_size} processes, each transformer Block sharded"
            if self.sharding == "HYBRID_SHARD":
                where += f", mesh ({self.num_nodes} nodes replicate x {self.devices} devices shard)"
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
        fields = dict(sharding=None, cpu_offload=False, process_group_backend=None)
        if kind != "single":
            fields["process_group_backend"] = "gloo" if accelerator == "cpu" else "nccl"
        fields.update(fsdp_fields)
        if fields["cpu_offload"]:
            # Offloaded gradients stay on the CPU, and gradient clipping (on by default) all-reduces
            # their norm there: NCCL has no CPU tensors, so the group needs gloo for the CPU too.
            fields["process_group_backend"] = f"{accelerator}:nccl,cpu:gloo"
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
        # Otherwise the mesh replicates over nodes and shards within a node (`mesh_layout`): a
        # rank's shard group is its node.
    cpu_offload = dist.cpu_offload
    if cpu_offload and accelerator == "cpu":
        cpu_offload = False
        notes.append((logging.WARNING, "cpu_offload is ignored when training on CPU (parameters are there already)."))
    return plan("fsdp", sharding=sharding, cpu_offload=cpu_offload)


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

    scheme: Literal["single", "replicated", "sharded"]
    dist: DistributedArgs  # the arguments to build the strategy from
    reason: str  # one line for the start-up log

    def describe(self) -> str:
        return f"QLoRA scheme: {self.scheme}; {self.reason}"


def plan_quantized_base(
    devices: int | str, num_nodes: int, dist: DistributedArgs, quantize: str, accelerator: str = "auto"
) -> QuantizedBasePlan:
    """The scheme for a quantized frozen base (`--quantize`). Raises UserError.

    One device: the base is quantized on the CPU and moved, as always. More than one, with `nf4`
    (torchao's NF4Tensor): sharded, by FSDP2 like every frozen weight. More than
    one, with bitsandbytes (`bnb.*`): the replicated scheme. Every rank builds and quantizes the whole base exactly as one device does
    (the same checkpoint, the same deterministic quantization, so the same bytes everywhere), and
    DDP synchronises what trains, the LoRA adapters: their gradients are averaged over all ranks
    of all nodes after each optimizer step's last micro-batch. The cost is the whole quantized
    base on every device (about 5 GB for 8B in NF4, 35 GB for 70B); adapters, their gradients and
    AdamW state are small. See QUANTIZED_BASE_NOT_SHARDED for why FSDP2 does not shard bitsandbytes.
    """
    world = resolve_devices(devices, resolve_accelerator(accelerator)) * num_nodes
    if world == 1:
        return QuantizedBasePlan("single", dist, f"one device holds the {quantize} base")
    if quantize == "nf4":
        # torchao's NF4Tensor shards and gathers under FSDP2 (toolkit.training.nf4): the FSDP path.
        if dist.strategy == "ddp":
            raise UserError("--quantize nf4 shards the base with FSDP: drop --distributed.strategy ddp "
                            "(or use --quantize bnb.nf4, which replicates it).")
        # Checkpoints hold only what trains (`checkpoint_io.save_trainable`): no NF4 weight is in them,
        # so either --distributed.state_dict_type works and reshards.
        return QuantizedBasePlan("sharded", replace(dist, strategy="fsdp"),
                                 f"the nf4 base is sharded by FSDP2 over the {world} processes like every frozen weight")
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


def build_fabric(plan: StrategyPlan, block_cls: type[nn.Module], loggers: Any = None) -> Fabric:
    """A configured (not yet launched) Fabric for `plan` (of `plan_strategy`); call `fabric.launch()` next.

    `block_cls` is the model's repeated transformer block: FSDP wraps (shards) each instance of it
    separately and activation checkpointing, when asked, recomputes each one. A multi-node plan
    that no launcher started is refused (UserError) before Lightning is imported.
    """
    if not isinstance(plan, StrategyPlan):
        raise TypeError(f"build_fabric takes the StrategyPlan of plan_strategy(...), got {plan!r}")
    check_launcher(plan.num_nodes, plan.devices)
    from lightning import Fabric
    from torch import nn

    if not (isinstance(block_cls, type) and issubclass(block_cls, nn.Module)):
        raise TypeError(f"block_cls must be an nn.Module subclass (the transformer block), got {block_cls!r}")

    strategy, plugins, fabric_precision = _make_strategy(plan, block_cls)
    if plan.kind != "fsdp":  # (FSDP writes its files with torch's distributed checkpoint or torch.save)
        plugins = [*plugins, direct_checkpoint_io()]
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
        prepare_failure_handling(plan, fabric)
    if fabric.global_rank == 0:
        for level, message in plan.notes:
            log.log(level, message)
    return fabric


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

    from lightning.fabric.strategies.parallel import ParallelStrategy
    from lightning.fabric.strategies.strategy import _BackwardSyncControl

    from lightning.fabric.strategies import ModelParallelStrategy

    class ShardedStrategy(ModelParallelStrategy):
        """FSDP2 per transformer Block and at the root, on our own mesh, through Fabric.

        Fabric's `ModelParallelStrategy` (Lightning 2.6) brings what we want from Fabric: process
        launch, `fabric.save`/`fabric.load` through torch's distributed checkpoint (a sharded
        checkpoint reshards on load), precision plugins and collectives. Three things are changed:

        - The mesh. Fabric builds ("data_parallel", "tensor_parallel") for tensor parallelism; we
          build the 1-D or 2-D data-parallel mesh of `StrategyPlan.mesh`, so HYBRID_SHARD really shards
          within a node and replicates across nodes.
        - Materialization. Fabric re-initialises meta-device parameters with `reset_parameters`
          after sharding; here `setup_module` only shards, and `setup_model` below fills each
          rank's shards from the checkpoint (or the initialiser) so that no rank holds a full copy.
        - Gradient accumulation. Fabric's `no_backward_sync` turns off FSDP2's reduce-scatter, which
          keeps a full unsharded gradient per rank until the last micro-batch. We keep the
          reduce-scatter on every micro-batch (gradients accumulate in the shards) and defer only
          the cross-replica all-reduce of HYBRID_SHARD/NO_SHARD to the last micro-batch.

        Parameters are stored in the dtypes of `apply_precision_policy`. Under "*-mixed" every unit
        gathers its weights in the compute dtype (the embedding's output is cast back to its
        stored dtype, so the residual stream is what one device has); gradients are reduced in float32 except under "*-true" precision, where
        everything is in that dtype.
        """

        def __init__(self, plan: StrategyPlan, block_cls: type[nn.Module]) -> None:
            from datetime import timedelta

            super().__init__(
                parallelize_fn=None,  # the parent's `setup_module` calls it; ours replaces that method
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
            shape, names = self.plan.mesh
            self._device_mesh = init_device_mesh(self.root_device.type, shape, mesh_dim_names=names)

        def setup_module(self, module: nn.Module) -> nn.Module:
            return shard_model(module, self.device_mesh, self.plan, self.block_cls)

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


def shard_model(module: nn.Module, mesh: Any, plan: StrategyPlan, block_cls: type[nn.Module]) -> nn.Module:
    """`module` sharded in place with FSDP2 on `mesh` as training shards it: one unit per `block_cls`
    (checkpointed when the plan asks), one per edge (the embedding; the final norm and head), then
    the root. `ShardedStrategy.setup_module` calls it; so does the simulation (`toolkit.simulate`),
    on a fake process group."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if plan.activation_checkpointing:
        _checkpoint_blocks(module, block_cls)
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
    for unit in _block_units(module, block_cls):
        fully_shard(unit, mesh=mesh, mp_policy=block_policy, offload_policy=offload,
                    reshard_after_forward=(plan.sharding or "FULL_SHARD") != "SHARD_GRAD_OP")
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
        # is the embedding or head, whatever N): toolkit.training.gloo_collectives works in place.
        from torch.distributed.fsdp import FSDPModule

        from toolkit.training.gloo_collectives import use_in_place_collectives

        shard_group = mesh.get_group("shard") if mesh.mesh_dim_names else mesh.get_group()
        for unit in module.modules():
            if isinstance(unit, FSDPModule):
                use_in_place_collectives(unit, shard_group)
    return module


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
