"""The Fabric object a run trains with, built from its plan (`toolkit.parallel.plan`).

    fabric = build_fabric(plan.strategy, block_cls=Block, loggers=loggers)   # checks the launcher first
    fabric.launch()          # see "Launching" below

With more than one device the engine is FSDP2 through `ShardedStrategy` (built by
`sharded_strategy_class`), whose `setup_module` shards with `toolkit.parallel.fsdp.shard_model`.
Under FSDP `fabric.save` writes `DistributedArgs.state_dict_type`: "sharded" (a directory written
by torch's distributed checkpoint, one file per rank, loadable on another number of devices) or
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
from typing import TYPE_CHECKING, Any

from toolkit.parallel.fsdp import checkpoint_blocks, cross_replica_reduce_deferred, shard_model
from toolkit.parallel.plan import StrategyPlan
from toolkit.training.checkpoint_io import direct_checkpoint_io
from toolkit.training.failures import check_launcher, prepare_failure_handling

if TYPE_CHECKING:
    from lightning_fabric import Fabric
    from torch import nn

log = logging.getLogger(__name__)


def build_fabric(plan: StrategyPlan, block_cls: type[nn.Module], loggers: Any = None) -> Fabric:
    """A configured (not yet launched) Fabric for `plan` (of `plan_strategy`); call `fabric.launch()` next.

    `block_cls` is the model's repeated transformer block: FSDP wraps (shards) each instance of it
    separately and activation checkpointing, when asked, recomputes each one. A multi-node plan
    that no launcher started is refused (UserError) before Lightning is imported.
    """
    if not isinstance(plan, StrategyPlan):
        raise TypeError(f"build_fabric takes the StrategyPlan of plan_strategy(...), got {plan!r}")
    check_launcher(plan.num_nodes, plan.devices)
    from lightning_fabric import Fabric
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
            from lightning_fabric.plugins import MixedPrecision
            from torch.amp import GradScaler

            return strategy, [MixedPrecision("16-mixed", plan.accelerator, scaler=GradScaler(plan.accelerator))], None
        return strategy, [], plan.precision

    if plan.kind == "ddp":
        from lightning_fabric.strategies import DDPStrategy

        cls = _with_block_checkpointing(DDPStrategy, block_cls) if plan.activation_checkpointing else DDPStrategy
        from datetime import timedelta

        return cls(process_group_backend=plan.process_group_backend, timeout=timedelta(seconds=plan.timeout)), [], plan.precision

    if not plan.activation_checkpointing:
        return "auto", [], plan.precision  # Fabric picks the one device
    from lightning_fabric.strategies import SingleDeviceStrategy

    device = torch.device("cuda", 0) if plan.accelerator == "cuda" else torch.device(plan.accelerator)
    return _with_block_checkpointing(SingleDeviceStrategy, block_cls)(device=device), [], plan.precision


def _with_block_checkpointing(base: type, block_cls: type[nn.Module]) -> type:
    """A subclass of the strategy `base` whose `setup_module` checkpoints each block first.

    The single-device and DDP strategies have no activation-checkpointing option, so the torch
    wrapper is applied here, before DDP wraps the model. The wrapper leaves state-dict keys unchanged.
    """

    class BlockCheckpointing(base):  # type: ignore[misc, valid-type]
        def setup_module(self, module: nn.Module) -> nn.Module:
            checkpoint_blocks(module, block_cls)
            return super().setup_module(module)

    BlockCheckpointing.__name__ = BlockCheckpointing.__qualname__ = f"BlockCheckpointing{base.__name__}"
    return BlockCheckpointing



_SHARDED_STRATEGY: list = []


def sharded_strategy_class() -> type:
    """`ShardedStrategy`, built on first use so that importing this module stays cheap (the CLI
    imports it to read the option types, and the class subclasses a Lightning class)."""
    if not _SHARDED_STRATEGY:
        _SHARDED_STRATEGY.append(_build_sharded_strategy_class())
    return _SHARDED_STRATEGY[0]


def _build_sharded_strategy_class() -> type:
    from lightning_fabric.strategies import ModelParallelStrategy
    from lightning_fabric.strategies.parallel import ParallelStrategy
    from lightning_fabric.strategies.strategy import _BackwardSyncControl

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

        With expert parallelism (`StrategyPlan.expert_mesh`) a second mesh holds the experts
        (`toolkit.parallel.expert`), and gradient clipping adds up the norms of both meshes'
        gradients (torch's own clipping cannot mix DTensors of two meshes).

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
            self.expert_mesh = None  # the experts' mesh under expert parallelism (`setup_environment`)
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
            self.expert_mesh = None
            if self.plan.expert_mesh is not None:
                shape, names = self.plan.expert_mesh
                self.expert_mesh = init_device_mesh(self.root_device.type, shape, mesh_dim_names=names)

        def setup_module(self, module: nn.Module) -> nn.Module:
            return shard_model(module, self.device_mesh, self.plan, self.block_cls, expert_mesh=self.expert_mesh)

        def clip_gradients_norm(self, module: nn.Module, optimizer: Any, max_norm: float, norm_type: float = 2.0,
                                error_if_nonfinite: bool = True) -> Any:
            if self.plan.expert_mesh is None:
                return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
            from toolkit.parallel.expert import clip_grad_norm

            self.precision.unscale_gradients(optimizer)
            return clip_grad_norm(self.precision.main_params(optimizer), max_norm, norm_type, error_if_nonfinite)

    class _DeferCrossReplicaReduce(_BackwardSyncControl):
        def no_backward_sync(self, module: nn.Module, enabled: bool):
            return cross_replica_reduce_deferred(module, deferred=enabled)

    return ShardedStrategy


def is_fsdp(fabric: Fabric) -> bool:
    return bool(_SHARDED_STRATEGY) and isinstance(fabric.strategy, _SHARDED_STRATEGY[0])