"""Compatibility fixes for third-party code, kept in one place so they are easy to find and drop.

Everything here works around a limitation of a specific Lightning/torch version. Each workaround
names the versions it was measured on (Lightning 2.6.6, torch 2.13) and why it is needed; when an
upgrade fixes one, delete it here and nowhere else.

`CPUCapableFSDPStrategy` (and its precision plugin) is Lightning Fabric's FSDP made usable on CPU
with the gloo backend, which is how the toolkit runs and tests real sharded training without a
GPU. On CUDA both behave exactly like the stock classes: every override below only changes
something when the root device is the CPU.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Callable

import torch
from lightning.fabric.plugins.precision.fsdp import FSDPPrecision
from lightning.fabric.strategies import FSDPStrategy
from torch import nn
from torch.optim import Optimizer


class CPUCapableFSDPStrategy(FSDPStrategy):
    """Fabric's `FSDPStrategy`, fixed so that it also runs on CPU with the gloo backend.

    Workaround 1 (Lightning 2.6.6), by being a subclass at all: Fabric's connector refuses FSDP
    unless the accelerator is CUDA, but it only checks strategies given as a string or whose class
    is *exactly* `FSDPStrategy` (`type(strategy) is FSDPStrategy`). A subclass instance passes.
    Workarounds 2 to 4 are the overrides below.
    """

    @property
    def _on_cpu(self) -> bool:
        return self.root_device.type == "cpu"

    # Workaround 2 (Lightning 2.6.6, torch 2.13): Lightning passes `device_id=root_device.index` to
    # FSDP, which is None for `torch.device("cpu")`. Given no device id and parameters on CPU, FSDP
    # looks for "the current accelerator" and raises on a CPU-only machine. Passing the CPU device
    # itself makes FSDP compute on CPU.
    def setup_module(self, module: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        if not self._on_cpu or _has_fsdp(module):
            # The stock path on CUDA. A module already wrapped inside `fabric.init_module()` was
            # wrapped by `module_sharded_context` below, which passed the CPU device already.
            return super().setup_module(module)
        module = FSDP(
            module,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=self.root_device,
            **self._fsdp_kwargs,
        )
        # Activation checkpointing goes on after wrapping, as in the stock strategy.
        if self._activation_checkpointing_kwargs:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                apply_activation_checkpointing,
                checkpoint_wrapper,
            )

            apply_activation_checkpointing(
                module, checkpoint_wrapper_fn=checkpoint_wrapper, **self._activation_checkpointing_kwargs
            )
        return module

    def module_sharded_context(self) -> AbstractContextManager:
        # Workaround 2 again, for models created inside `fabric.init_module()`.
        if not self._on_cpu:
            return super().module_sharded_context()
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import enable_wrap

        return enable_wrap(
            wrapper_cls=FSDP,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=self.root_device,
            **self._fsdp_kwargs,
        )

    # Workaround 3 (Lightning 2.6.6): a `device_mesh=(replicas, shard_size)` tuple is turned into a
    # DeviceMesh with the device type hard-coded to "cuda", which fails on a CPU-only machine. Build
    # it on the root device's type instead (and name the two dimensions, for readable errors).
    def setup_environment(self) -> None:
        mesh_shape = self._fsdp_kwargs.get("device_mesh")
        if not isinstance(mesh_shape, tuple):
            super().setup_environment()
            return
        del self._fsdp_kwargs["device_mesh"]
        super().setup_environment()  # initializes the default process group
        from torch.distributed.device_mesh import init_device_mesh

        self._fsdp_kwargs["device_mesh"] = init_device_mesh(
            self.root_device.type, mesh_shape, mesh_dim_names=("replicate", "shard")
        )

    # Workaround 4 (Lightning 2.6.6, torch 2.13): the stock full-state-dict save gathers with
    # `FullStateDictConfig(offload_to_cpu=True)`. When the parameters already live on CPU, FSDP's
    # "copy the unsharded flat parameter to CPU" returns the very same storage, which FSDP then
    # frees: the process segfaults. On CPU we gather without offloading (the tensors are on CPU
    # anyway) and write Lightning's file layout (one `torch.save` dict), so `fabric.load` reads it.
    # Sharded saves and all loads work unchanged.
    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        if not self._on_cpu or self._state_dict_type != "full":
            super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
            return
        if storage_options is not None:
            raise TypeError("FSDP checkpoints take no `storage_options`.")
        from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        path = Path(self.broadcast(path))  # every rank agrees on rank 0's path
        if path.is_dir():
            raise IsADirectoryError(f"The checkpoint path exists and is a directory: {path}")
        wrapped = [obj for obj in state.values() if isinstance(obj, nn.Module) and _has_fsdp(obj)]
        if len(wrapped) != 1:
            raise ValueError(f"A full FSDP checkpoint needs exactly one FSDP model in `state`, found {len(wrapped)}.")
        model = wrapped[0]
        full_state: dict[str, Any] = {}
        with FSDP.state_dict_type(
            model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
            FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),
        ):
            # These are collective calls: every rank converts every entry, in the same order.
            for key, obj in state.items():
                if isinstance(obj, nn.Module):
                    value = obj.state_dict()
                elif isinstance(obj, Optimizer):
                    value = FSDP.optim_state_dict(model, obj)
                elif hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
                    value = obj.state_dict()
                else:
                    value = obj
                if filter and key in filter and isinstance(value, dict):
                    value = {k: v for k, v in value.items() if filter[key](k, v)}
                full_state[key] = value
        if self.global_rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(full_state, path)


class CPUCapableFSDPPrecision(FSDPPrecision):
    """Fabric's `FSDPPrecision` with autocast on the right device type.

    Workaround 5 (Lightning 2.6.6): `FSDPPrecision.forward_context` hard-codes
    `torch.autocast("cuda")` for the mixed modes. On CPU, torch disables that autocast with a
    warning, so "bf16-mixed" would run norms and softmax in plain bf16 instead of the float32 that
    autocast keeps them in. Use CPU autocast there. (float16 is refused on CPU before we get here.)
    """

    def __init__(self, precision: str, device_type: str = "cpu") -> None:
        super().__init__(precision)  # type: ignore[arg-type]
        self._device_type = device_type

    def forward_context(self) -> AbstractContextManager:
        if self._device_type == "cpu" and self.precision == "bf16-mixed":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return super().forward_context()


def _has_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return any(isinstance(m, FSDP) for m in module.modules())
