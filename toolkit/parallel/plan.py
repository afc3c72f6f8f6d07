"""The run plan: every decision about devices, precision, sharding, batches and a quantized base,
made once, before any process starts, into one typed object.

    plan = plan_run(devices, num_nodes, precision, distributed, train, max_seq_length, quantize)
    plan.strategy   StrategyPlan: accelerator, devices, nodes, precision, FSDP/DDP/single, sharding, mesh,
                    expert parallelism and the experts' mesh
    plan.batches    BatchPlan: micro-batch, global batch, gradient accumulation, tokens per step
    plan.quantized  QuantizedBasePlan (QLoRA) or None

The session builds Fabric from it (`toolkit.training.fabric`), the model is sharded by
`toolkit.parallel.fsdp` from it, the memory check (`toolkit.memory`) and the loop read it. Every
rule lives here once: HYBRID_SHARD on one node or one device per node is FULL_SHARD
(`effective_sharding`), the mesh of each sharding (`mesh_layout`) and of the experts under expert
parallelism (`expert_mesh_layout`, `check_expert_parallel`), the scheme of a quantized base.

Pure and cheap to import: no torch or Lightning at import time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, Optional, get_args

from toolkit.args import DistributedArgs, ShardingName, StateDictTypeName, StrategyName, TrainArgs
from toolkit.errors import UserError, check_choice
from toolkit.parallel.batches import BatchPlan, plan_batches
from toolkit.parallel.precision import PRECISION_ALIASES, PRECISIONS

if TYPE_CHECKING:
    from toolkit.models.config import Config

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


def resolve_devices(devices: "int | str", accelerator: str) -> int:
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


def resolve_precision(precision: Optional[str], accelerator: str) -> str:
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
    sharding: Optional[ShardingName]  # FSDP only
    activation_checkpointing: bool
    cpu_offload: bool
    state_dict_type: StateDictTypeName
    # "gloo" on CPU, "nccl" on CUDA, "cuda:nccl,cpu:gloo" on CUDA with cpu_offload; None for one device
    process_group_backend: str | None
    timeout: int  # seconds a collective waits
    notes: tuple[tuple[int, str], ...] = ()  # (logging level, one-line message) to log on rank 0
    expert_parallel: int = 1  # processes each MoE layer's experts are split over (FSDP only)

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    @property
    def mesh(self) -> tuple[tuple[int, ...], tuple[str, ...]] | None:
        """(shape, dimension names) of the FSDP device mesh (see `mesh_layout`); None without FSDP."""
        return mesh_layout(self.sharding, self.num_nodes, self.devices) if self.kind == "fsdp" else None

    @property
    def expert_mesh(self) -> tuple[tuple[int, ...], tuple[str, ...]] | None:
        """(shape, dimension names) of the experts' mesh (`expert_mesh_layout`); None without
        expert parallelism."""
        if self.kind != "fsdp" or self.expert_parallel == 1:
            return None
        return expert_mesh_layout(self.sharding, self.num_nodes, self.devices, self.expert_parallel)

    def shard_device(self, device: Any) -> Any:
        """Where this rank's parameter shards are allocated: the host when they are offloaded (FSDP2
        refuses offloaded shards that live anywhere else), else `device`, where the rank trains."""
        return "cpu" if self.cpu_offload else device

    def describe(self, nf4_base: bool = False) -> str:
        """One line for the start-up log, e.g. 'strategy: FSDP HYBRID_SHARD, mesh (2 nodes x 4 devices), ...'.
        `nf4_base`: the frozen base is torchao's NF4 (gathered as NF4 bytes, not in the compute dtype)."""
        if self.kind == "single":
            where = "single device"
        elif self.kind == "ddp":
            where = f"DDP over {self.world_size} processes"
        else:
            where = f"FSDP2 {self.sharding} over {self.world_size} processes, each transformer Block sharded"
            if self.sharding == "HYBRID_SHARD":
                where += f", mesh ({self.num_nodes} nodes replicate x {self.devices} devices shard)"
            if self.expert_mesh is not None:
                shape, _ = self.expert_mesh
                replicas = shape[0] if len(shape) == 3 else 1
                where += (f", experts split over groups of {self.expert_parallel} (expert parallel, all-to-all), "
                          f"each expert's weights sharded over {shape[-2]} process(es)")
                if replicas > 1:
                    where += f", replicated {replicas} times"
            if self.precision.endswith("-mixed"):
                gather = "bfloat16" if self.precision.startswith("bf16") else "float16"
                what = "the NF4 base gathered as NF4, the other block weights" if nf4_base else "block weights"
                where += f", {what} gathered in {gather}, gradients reduced in float32"
        extras = [f"precision {self.precision}", self.accelerator]
        if self.activation_checkpointing:
            extras.append("activation checkpointing")
        if self.cpu_offload:
            extras.append("CPU offload")
        return f"strategy: {where}; " + ", ".join(extras)


def effective_sharding(sharding: str, num_nodes: int, devices: int) -> tuple[str, Optional[tuple[int, str]]]:
    """The sharding a run really uses, and the (logging level, line) that says why when it differs.

    HYBRID_SHARD shards within a node and replicates across nodes (`mesh_layout`). On one node
    that is exactly FULL_SHARD (a single replica; both verified to synchronize), so the plain 1-D
    mesh is used; with one device per node there is nothing to shard within a node, so the run
    shards over all nodes rather than replicate on each. The one place this rule lives.
    """
    if sharding != "HYBRID_SHARD":
        return sharding, None
    if num_nodes == 1:
        return "FULL_SHARD", (logging.INFO, "HYBRID_SHARD on one node is FULL_SHARD; using FULL_SHARD.")
    if devices == 1:
        return "FULL_SHARD", (
            logging.WARNING, "HYBRID_SHARD needs more than one device per node; using FULL_SHARD across all nodes."
        )
    return sharding, None


def plan_strategy(
    devices: "int | str",
    num_nodes: int,
    precision: Optional[str],
    dist: DistributedArgs,
    accelerator: str = "auto",
    model: Optional[Config] = None,
) -> StrategyPlan:
    """Validate the arguments and decide strategy, sharding and mesh. Raises UserError.
    `model`: the model trained, for the checks of expert parallelism (`check_expert_parallel`)."""
    _check_nodes(num_nodes)
    accelerator = resolve_accelerator(accelerator)
    return _decide_strategy(resolve_devices(devices, accelerator), num_nodes, resolve_precision(precision, accelerator),
                            dist, accelerator, model)


def _check_nodes(num_nodes: Any) -> None:
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise UserError(f"num_nodes must be at least 1, got {num_nodes!r}.")


def _decide_strategy(devices: int, num_nodes: int, precision: str, dist: DistributedArgs, accelerator: str,
                     model: Optional[Config] = None) -> StrategyPlan:
    """`plan_strategy` on resolved devices, precision and accelerator."""
    check_choice("distributed.strategy", dist.strategy, get_args(StrategyName))
    check_choice("distributed.sharding", dist.sharding, get_args(ShardingName))
    check_choice("distributed.state_dict_type", dist.state_dict_type, get_args(StateDictTypeName))
    if isinstance(dist.timeout, bool) or not isinstance(dist.timeout, int) or dist.timeout < 1:
        raise UserError(f"--distributed.timeout must be a whole number of seconds, at least 1, got {dist.timeout!r}.")
    notes: list[tuple[int, str]] = []
    note = check_expert_parallel(dist, devices, num_nodes, model)
    if note is not None:
        notes.append(note)

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
            expert_parallel=dist.expert_parallel,
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

    sharding, note = effective_sharding(dist.sharding, num_nodes, devices)
    if note is not None:
        notes.append(note)
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
    devices: "int | str", num_nodes: int, dist: DistributedArgs, quantize: str, accelerator: str = "auto"
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
    return _quantized_scheme(resolve_devices(devices, resolve_accelerator(accelerator)) * num_nodes, dist, quantize)


def _quantized_scheme(world: int, dist: DistributedArgs, quantize: str) -> QuantizedBasePlan:
    """`plan_quantized_base` for a resolved number of processes."""
    if world == 1:
        return QuantizedBasePlan("single", dist, f"one device holds the {quantize} base")
    if quantize == "nf4":
        # torchao's NF4Tensor shards and gathers under FSDP2 (toolkit.parallel.nf4): the FSDP path.
        if dist.strategy == "ddp":
            raise UserError("--quantize nf4 shards the base with FSDP: drop --distributed.strategy ddp "
                            "(or use --quantize bnb.nf4, which replicates it).")
        if dist.sharding == "NO_SHARD":
            # Each shard group is one process: torch 2.13's FSDP2 skips the all-gather of a group of one,
            # which torchao's NF4 tensor cannot follow ("not enough values to unpack").
            raise UserError("--quantize nf4 shards the base with FSDP, and --distributed.sharding NO_SHARD shards "
                            "nothing: use FULL_SHARD or HYBRID_SHARD (or --quantize bnb.nf4, which replicates the base).")
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


def expert_mesh_layout(sharding: str, num_nodes: int, devices: int, expert_parallel: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(mesh shape, dimension names) of the experts under expert parallelism N (`toolkit.parallel.expert`):
    the innermost data-parallel dimension of `mesh_layout` split into ("expert_shard", "expert"),
    so that an all-to-all group ("expert") is N consecutive ranks, within a node when N divides
    the devices of one. FSDP shards each expert over "expert_shard" and replicates it over "replicate".

        FULL_SHARD, SHARD_GRAD_OP   (world/N, N)                ("expert_shard", "expert")
        HYBRID_SHARD                (nodes, devices/N, N)       ("replicate", "expert_shard", "expert")

    (NO_SHARD, whose shard group is one rank, is refused by `check_expert_parallel`.)
    """
    shape, _ = mesh_layout(sharding, num_nodes, devices)
    n = expert_parallel
    if len(shape) == 1:
        return (shape[0] // n, n), ("expert_shard", "expert")
    replicate, shard = shape
    assert shard % n == 0, (sharding, shape, n)
    return (replicate, shard // n, n), ("replicate", "expert_shard", "expert")


def check_expert_parallel(dist: DistributedArgs, devices: int, num_nodes: int, model: Optional[Config]) -> Optional[tuple[int, str]]:
    """Refuse (UserError, one line naming what would work) an expert parallelism the run cannot
    use; return a (logging level, line) note when it works but costs more than it should.

    N = --distributed.expert_parallel must divide the model's experts and the processes (devices x
    nodes), needs a mixture-of-experts model and FSDP, and under HYBRID_SHARD across nodes must
    divide the devices of a node. `model` None (a caller that trains no `Config` model): only
    the processes are checked.
    """
    n, world = dist.expert_parallel, devices * num_nodes
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UserError(f"--distributed.expert_parallel must be a positive whole number, got {n!r}.")
    if n == 1:
        return None
    if model is not None and not model.is_moe:
        raise UserError(f"--distributed.expert_parallel {n} splits the experts of a mixture-of-experts model, and "
                        f"{model.name} is dense (no MoE layer): use --distributed.expert_parallel 1.")
    if dist.strategy == "ddp" and world > 1:
        raise UserError(f"--distributed.expert_parallel {n} shards the experts with FSDP: drop --distributed.strategy ddp "
                        "(or use --distributed.expert_parallel 1).")
    sharding, _ = effective_sharding(dist.sharding, num_nodes, devices)
    if sharding == "NO_SHARD" and world > 1:
        raise UserError(f"--distributed.expert_parallel {n} splits the experts over ranks of one FSDP shard group, and "
                        "NO_SHARD shards nothing: use FULL_SHARD, HYBRID_SHARD or SHARD_GRAD_OP.")
    within_node = sharding == "HYBRID_SHARD"
    experts = model.n_expert if model is not None else None

    def fits(k: int) -> bool:
        return world % k == 0 and (experts is None or experts % k == 0) and (not within_node or devices % k == 0)

    if not fits(n):
        what = f"the {experts} experts of {model.name} and " if model is not None else ""
        what += f"the {world} process(es) (devices {devices} x nodes {num_nodes})"
        if within_node:
            what += f" and, with HYBRID_SHARD across {num_nodes} nodes, the {devices} devices of one node"
        choices = [str(k) for k in range(1, world + 1) if fits(k)]
        alternative = ", or --distributed.sharding FULL_SHARD" if within_node else ""
        raise UserError(f"--distributed.expert_parallel {n} must divide {what}: use {' or '.join(choices)}{alternative}.")
    if num_nodes > 1 and devices % n:
        return (logging.WARNING, f"expert_parallel {n} groups span nodes ({devices} devices per node): every MoE layer "
                                 "exchanges its tokens over the network; a divisor of the devices per node keeps them within one.")
    return None


# --------------------------------------------------------------------------------------------
# The run plan: everything above, resolved once
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunPlan:
    """Every start-up decision of one training run, made once by `plan_run` before any process starts.

    The session builds Fabric from `strategy`, the loop reads `batches`, the memory check reads all
    of it; nothing downstream resolves devices, precision or sharding again.
    """

    strategy: StrategyPlan
    batches: BatchPlan
    quantize: Optional[str] = None  # --quantize of a LoRA run (QLoRA), else None
    quantized: Optional[QuantizedBasePlan] = None  # how the quantized base spreads over the devices
    preflight: bool = True  # check on a GPU that a step fits its memory before any weight is read

    @property
    def precision(self) -> str:
        return self.strategy.precision

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def shard_size(self) -> int:
        """Ranks each sharded weight is split over: the last mesh dimension under FSDP, else 1."""
        mesh = self.strategy.mesh
        return mesh[0][-1] if mesh else 1

    def describe(self) -> str:
        """The start-up lines: strategy, QLoRA scheme (if any), batch table."""
        lines = [self.strategy.describe(nf4_base=self.quantize == "nf4")]
        if self.quantized is not None:
            lines.append(self.quantized.describe())
        return "\n".join(lines + [self.batches.table()])


def plan_run(
    devices: "int | str",
    num_nodes: int,
    precision: Optional[str],
    distributed: DistributedArgs,
    train: TrainArgs,
    max_seq_length: int,
    quantize: Optional[str] = None,
    accelerator: str = "auto",
    model: Optional[Config] = None,
) -> RunPlan:
    """Resolve the accelerator, devices, precision, quantized-base scheme, strategy, mesh and batch
    split of a run, once. Raises UserError (one line) on anything that does not fit together.
    `model`: the config trained, which expert parallelism is checked against."""
    _check_nodes(num_nodes)
    accelerator = resolve_accelerator(accelerator)
    devices = resolve_devices(devices, accelerator)
    precision = resolve_precision(precision, accelerator)
    quantized = None
    router_options = [f"--train.{name}" for name in ("router_aux_loss_coef", "router_z_loss_coef", "router_aux_loss_per_layer")
                      if getattr(train, name) not in (None, False)]
    if model is not None and not model.is_moe and router_options:
        raise UserError(f"{' and '.join(router_options)} set the losses of a mixture of experts' router, and {model.name} "
                        "is dense (no MoE layer): drop them.")
    if quantize is not None and distributed.expert_parallel != 1:
        raise UserError(f"--distributed.expert_parallel {distributed.expert_parallel} is not available with a quantized base "
                        f"(--quantize {quantize}) yet: drop one of them.")
    if quantize is not None:
        # The scheme decides the strategy a quantized base can use (DDP for bitsandbytes, FSDP for nf4).
        quantized = _quantized_scheme(devices * num_nodes, distributed, quantize)
        distributed = quantized.dist
    strategy = _decide_strategy(devices, num_nodes, precision, distributed, accelerator, model)
    batches = plan_batches(strategy.devices, num_nodes, train.micro_batch_size, train.global_batch_size, max_seq_length)
    return RunPlan(strategy=strategy, batches=batches, quantize=quantize, quantized=quantized,
                   preflight=distributed.preflight)
