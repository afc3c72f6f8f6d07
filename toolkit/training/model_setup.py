"""Model set-up: a model built on the meta device gets its real values, sharded or not.

`setup_model` shards the meta model (under FSDP) and then fills each rank's own rows of every
parameter from a `ReadRows` function (the checkpoint, memory-mapped, or the initialiser), so no
rank ever holds the whole model. `materialize` does the same for one device. NF4 weights
(`toolkit.parallel.nf4`) are quantized one weight at a time as their rows are read, on N devices
and on one, so no process holds the 16-bit base. The host-memory helpers measure what the set-up
cost.

Importing this module is cheap: torch and lightning are imported inside the functions.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable

from toolkit.models.param_names import unwrapped_name
from toolkit.parallel.nf4 import is_nf4
from toolkit.parallel.precision import replace_parameters
from toolkit.training.fabric import is_fsdp

if TYPE_CHECKING:
    from lightning_fabric import Fabric
    from torch import Tensor, nn

# Where the initial values of a model's parameters come from: `read_rows(name, start, stop, out=None)`
# returns rows [start, stop) (dim 0) of the full parameter `name` (toolkit name, no wrapper
# prefixes), in any dtype; `stop=None` means to the last row. With `out` (a tensor of that shape, in
# any dtype) it writes the rows into `out` and returns it, so that a rank's shard is filled without
# a second copy of it. FSDP2 shards every parameter along dim 0, except expert weights that it
# splits along dim 1 (`toolkit.parallel.fsdp.expert_shard_dim`): for those it is called with
# `inner=(first, last)` as well, and returns only rows [first, last) of dim 1 of each row read.
ReadRows = Callable[..., "Tensor"]


def setup_model(fabric: Fabric, model: nn.Module, read_rows: ReadRows) -> Any:
    """Set up a model built on the meta device and fill its parameters from `read_rows`.

    Parameters that are already real (not meta) keep their values: LoRA adapters are initialised
    before this call. Without FSDP the full tensors are filled in and then Fabric moves the model.
    Under FSDP the model is sharded first, still on the meta device; then each rank allocates and
    reads only its own rows of each parameter, so no rank ever holds the whole model.

    Buffers have no `read_rows`: real ones keep their values, and a buffer still on the meta device
    is refused (RuntimeError naming it) rather than left holding whatever memory `to_empty` gave it.

    Returns Fabric's wrapped model.
    """
    import torch

    _refuse_meta_buffers(model)
    if not is_fsdp(fabric):
        materialize(model, read_rows, policy_applied=True)
        module = fabric.setup_module(model)
        return module
    preset = {unwrapped_name(n): p.detach().clone() for n, p in model.named_parameters() if not p.is_meta}
    buffers = {unwrapped_name(n): b.detach().clone() for n, b in model.named_buffers()}
    with warnings.catch_warnings():
        # LoRA adapters are real beside the meta base: Fabric warns that it will move them all, which
        # under FSDP2 it does not (`to_empty` below allocates every shard, `fill_shards` fills them)
        warnings.filterwarnings("ignore", message=r"The model passed to `Fabric.setup\(\)` has .* on different devices")
        module = fabric.setup_module(model)
    inner = module.module if hasattr(module, "module") else module
    # Every parameter and buffer: allocated, not initialised. Offloaded shards on the host, the
    # buffers (RoPE tables) where the forward pass runs.
    plan = getattr(fabric.strategy, "plan", None)
    storage = torch.device(plan.shard_device(fabric.device)) if plan is not None else fabric.device
    inner.to_empty(device=storage)
    if storage != fabric.device:
        _move_buffers(inner, fabric.device)
    with torch.no_grad():
        for name, buffer in inner.named_buffers():
            buffer.copy_(buffers[unwrapped_name(name)])
    fill_shards(inner, read_rows, preset)
    return module


def fill_shards(model: nn.Module, read_rows: ReadRows, preset: dict | None = None) -> None:
    """Fill each parameter of a sharded model (allocated by `to_empty`, not initialised) with this
    rank's part of its value: `preset[name]` (whole tensors, e.g. LoRA adapters made before
    sharding) or else `read_rows`. A DTensor's part is the rows of dim 0 its placements give this
    rank, and of dim 1 for expert weights split along it (`inner`); NF4 weights are quantized from
    their rows (`_fill_nf4_rows`, a collective)."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    preset = preset or {}
    expert_shapes = _expert_weight_shapes(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            name = unwrapped_name(name)
            inner: dict = {}  # the rows of dim 1 this rank holds, when they are not all of them
            if isinstance(param, DTensor):
                local = param.to_local()
                shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
                assert all(o == 0 for o in offset[2:]) and tuple(shape[2:]) == tuple(param.shape[2:]), name
                start, stop = offset[0], offset[0] + shape[0]
                if param.dim() > 1 and shape[1] != param.shape[1]:
                    inner = {"inner": (offset[1], offset[1] + shape[1])}
            else:
                local, start, stop = param, 0, None
            if is_nf4(local):
                assert not inner, name  # NF4 weights are split along dim 0 only (`expert_placement`)
                _fill_nf4_rows(local, param, name, start, stop, read_rows, expert_shapes.get(name))
                continue
            if local.numel() == 0:
                continue
            full = preset.get(name)
            if full is not None:
                part = full[start:stop]
                if inner:
                    part = part[:, slice(*inner["inner"])]
                local.copy_(part.reshape(local.shape))
            else:
                read_rows(name, start, stop, out=local, **inner)


def _move_buffers(model: nn.Module, device: Any) -> None:
    """Move every buffer of `model` to `device`; a buffer shared by several modules stays shared."""
    moved: dict[int, Any] = {}
    for module in model.modules():
        for key, buffer in module._buffers.items():
            if buffer is not None:
                if id(buffer) not in moved:
                    moved[id(buffer)] = buffer.to(device)
                module._buffers[key] = moved[id(buffer)]


def _expert_weight_shapes(model: nn.Module) -> dict[str, tuple[int, int, int]]:
    """(X, out, in) of every mixture's 3-D expert weight, by parameter name (toolkit name)."""
    from toolkit.models.moe import GroupedExperts

    shapes = {}
    for module_name, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            for leaf, _ in module.named_parameters(recurse=False):
                if leaf in ("gate_up_proj", "down_proj"):
                    shapes[unwrapped_name(f"{module_name}.{leaf}")] = module.weight_shape(leaf)
    return shapes


def read_expert_rows(read_rows: ReadRows, name: str, start: int, stop: int, out_features: int) -> Tensor:
    """Rows [start, stop) of the expert weight `name` (X, out, in) seen as (X * out, in): a run of
    whole experts read as such, an expert cut by `start` or `stop` through `inner` (its rows of dim 1)."""
    import torch

    pieces = []
    row = start
    while row < stop:
        expert, first = divmod(row, out_features)
        if first == 0 and stop - row >= out_features:  # whole experts up to the last whole one
            last_expert = expert + (stop - row) // out_features
            pieces.append(read_rows(name, expert, last_expert).flatten(0, 1))
            row = last_expert * out_features
        else:
            last = min(out_features, first + stop - row)
            pieces.append(read_rows(name, expert, expert + 1, inner=(first, last)).flatten(0, 1))
            row += last - first
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _fill_nf4_rows(local, param, name: str, start: int, stop: int, read_rows: ReadRows,
                   expert_shape: tuple[int, int, int] | None = None) -> None:  # fmt: skip
    """Quantize this rank's rows of an NF4 weight into its shard `local` (toolkit.parallel.nf4).

    The rows are read in the checkpoint's dtype, one weight at a time: no rank holds more than its
    own rows of one weight unquantized. The one number that spans the whole weight, the mean of the
    block absmaxes, is summed over the ranks that hold its other rows (a collective: every rank of
    the shard group fills its weights in the same order).
    """
    import torch
    import torch.distributed as dist

    from toolkit.parallel.nf4 import BLOCK, block_absmax_sum, nf4_from_rows

    if expert_shape is not None:  # stored (X, out, in), kept as NF4 (X * out, in)
        stop = param.shape[0] if stop is None else stop
        rows = read_expert_rows(read_rows, name, start, stop, expert_shape[1]).to(local.device)
    else:
        rows = read_rows(name, start, stop).to(local.device)
    total = block_absmax_sum(rows, local.dtype)
    shard_dims = [i for i, p in enumerate(param.placements) if p.is_shard()]
    for dim in shard_dims:
        dist.all_reduce(total, group=param.device_mesh.get_group(dim))
    quantized = nf4_from_rows(rows, local.dtype, total, param.numel() // BLOCK)
    del rows
    # Inner tensor by inner tensor, in place: torchao's `copy_` re-quantizes when the block counts
    # differ (a shard keeps the block count of the whole weight), and FSDP holds views of `local`
    # that share its inner tensors. The mean and the level table are real already
    # (`quantize_blocks_nf4` made them on this device; `to_empty` allocates only the sharded ones).
    with torch.no_grad():
        for inner in local.__tensor_flatten__()[0]:
            getattr(local, inner).copy_(getattr(quantized, inner))
    del quantized
    if local.device.type == "cpu":
        release_freed_host_memory()


def _refuse_meta_buffers(model: nn.Module) -> None:
    """Raise if a buffer is on the meta device: set-up fills parameters only, so it would hold garbage."""
    meta = [unwrapped_name(name) for name, buffer in model.named_buffers() if buffer.is_meta]
    if meta:
        raise RuntimeError(
            f"buffer(s) {', '.join(meta)} on the meta device: model set-up fills parameters only, so they would "
            "hold uninitialised memory; create buffers on a real device (`device=` in register_buffer) or in forward."
        )


def materialize(model: nn.Module, read_rows: ReadRows, policy_applied: bool = False) -> None:
    """Give every parameter still on the meta device its full value from `read_rows` (one device).

    Before the precision policy (`policy_applied` False) a value keeps the dtype it is stored in, and
    the policy casts only what it must; after it, each value takes its meta parameter's dtype, which
    the policy chose (the model was prepared on the meta device: nf4).

    An NF4 weight still on the meta device (`quantize_blocks_nf4` on a meta model) is read whole in
    the checkpoint's dtype, quantized on the device that holds its level table (where this process
    trains: on the GPU when there is one), and let go before the next weight is read: the 16-bit
    base is never held, only one weight of it at a time.
    """
    names = {}
    for name, param in model.named_parameters(remove_duplicate=True):
        names[id(param)] = unwrapped_name(name)

    def fill(param):
        if not param.is_meta:
            return None
        if is_nf4(param):
            return _quantize_nf4_weight(param, read_rows(names[id(param)], 0, None).reshape(param.shape))
        value = read_rows(names[id(param)], 0, None)
        return value.to(param.dtype) if policy_applied else value

    replace_parameters(model, fill)


def _quantize_nf4_weight(meta_weight, rows: Tensor):
    """The NF4Tensor of a whole weight `rows`, in `meta_weight`'s dtype, on the device of its level table."""
    from toolkit.parallel.nf4 import nf4_quantize

    quantized = nf4_quantize(rows.to(meta_weight.nf4.device), meta_weight.dtype)
    del rows
    if quantized.device.type == "cpu":
        release_freed_host_memory()
    return quantized


def release_freed_host_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's `malloc_trim`; elsewhere nothing).

    Quantizing a weight on the CPU frees tens of MiB of temporaries; glibc keeps freed heap memory
    for reuse, and weight after weight it did not reuse it: on one process, a 1 GB bf16 checkpoint
    grew the set-up's peak RSS by 0.5-1 GiB beyond the NF4 model (measured by
    benchmarks/qlora_startup_memory.py), that much memory resident though free. Trimmed after each
    weight, the peak is the model plus one weight's temporaries.
    """
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc
        pass


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
