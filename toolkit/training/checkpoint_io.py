"""Checkpoint I/O under every strategy: what `toolkit.training.checkpoint` reads and writes with.

- `direct_checkpoint_io`: the CheckpointIO plugin of the one-device and DDP strategies (no
  in-memory copy of the file).
- `stream_weights`: the final export, each weight's rows sent to rank 0 and written a message at a time.
- `full_state_dict`: the complete weights on rank 0 (small things only: the whole model at once).
- `load_resharded`: a `fabric.save` checkpoint written by another number of processes.
- `save_trainable`: what trains, without the frozen weights (LoRA), in the layout `load_resharded` reads.
- `gather_objects`: small per-rank facts (digests) on every rank.

Importing this module is cheap: torch and lightning are imported inside the functions.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

from toolkit.models.param_names import unwrapped_name

if TYPE_CHECKING:
    from lightning_fabric import Fabric
    from torch import Tensor, nn


def direct_checkpoint_io() -> Any:
    """A CheckpointIO plugin that `torch.save`s straight into the file.

    Lightning's default serializes the whole checkpoint into an in-memory buffer first, so that the
    file appears complete or not at all: a second copy of the weights and optimizer state in host
    memory (+3 GiB at 336M parameters, measured; +96 GB for a one-GPU 8B full fine-tune). The
    toolkit's checkpoints are atomic at the folder level (`toolkit.training.checkpoint.save` writes
    into a temporary folder and renames it when complete), so the buffer buys nothing.
    """
    from pathlib import Path

    import torch
    from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO

    class DirectCheckpointIO(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
            if storage_options is not None:
                raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            torch.save(checkpoint, path)

    return DirectCheckpointIO()


def full_state_dict(fabric: Fabric, model: nn.Module, keep: Any = None) -> dict[str, Tensor]:
    """The model's complete (unsharded) weights on rank 0, as CPU tensors with the model's own key names.

    A collective call: every rank must call it; the other ranks get `{}` (a whole model on every
    rank would not fit where FSDP is needed). `keep(name)` (toolkit names) picks the weights to
    gather: under FSDP only those are gathered, one at a time (LoRA's adapters, not the frozen
    base). Without FSDP on CPU the tensors share memory with the live parameters (no copy is made).
    The final export does not come here: it streams (`stream_weights`).
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    root = _user_module(model)
    if isinstance(root, FSDPModule) and keep is None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # cpu_offload with full_state_dict gathers one tensor at a time onto rank 0's CPU only.
        state = get_model_state_dict(root, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = {}
        for key, value in root.state_dict().items():
            if keep is not None and not keep(unwrapped_name(key)):
                continue
            if isinstance(value, DTensor):
                value = value.full_tensor()  # collective: every rank takes part, in the same order
                if fabric.global_rank != 0:
                    continue
            state[key] = value
    if fabric.global_rank != 0:
        return {}
    return {unwrapped_name(k): v.detach().cpu() for k, v in state.items()}


def _user_module(model: Any) -> Any:
    """The FSDP root, or the user's module without DDP or torch.compile wrappers (no "module."/"_orig_mod.")."""
    from lightning_fabric.wrappers import _FabricModule, _unwrap_compiled, _unwrap_objects
    from torch.distributed.fsdp import FSDPModule

    root = _unwrap_objects(model)
    if isinstance(root, FSDPModule):
        return root
    module = _unwrap_compiled(model)[0]
    if isinstance(module, _FabricModule):
        module = _unwrap_compiled(module._original_module)[0]
    return module


# The final export moves a weight's rows to rank 0 in messages of at most this many bytes (in the
# export dtype): rank 0's host memory grows by about two of them (the one received, the one of its
# own rows being converted), whatever the size of the model or of its largest weight.
EXPORT_CHUNK_BYTES = 64 * 2**20


def stream_weights(fabric: Fabric, model: nn.Module, directory: Any, config: Any, dtype: Any = None,
                   max_shard_bytes: int | None = None) -> BaseException | None:
    """Write the model's complete weights into the folder `directory` (on rank 0), rows at a time.

    The weights go into `model.safetensors`, or, beyond `max_shard_bytes` (default
    `toolkit.safetensors_io.MAX_SHARD_BYTES`), into Hugging Face's sharded layout
    (`model-0000K-of-0000N.safetensors` + `model.safetensors.index.json`; see
    `toolkit.safetensors_io.SafetensorsShards`). A collective call. For each weight, in the order of
    the files: under FSDP every rank holding a shard of it in rank 0's shard group (FSDP2 splits
    dim 0 in `torch.chunk` order, or dim 1 of some expert weights) converts its
    rows to `dtype` (floating-point weights; None keeps their dtype) a message at a time and sends
    them to rank 0, which appends them to the file in order (`SafetensorsStream.append`). Rank 0's
    host memory therefore grows by about two messages (`EXPORT_CHUNK_BYTES`), whatever the size of
    the model; no rank gathers a whole weight. An expert weight FSDP2 split along dim 1 goes as each
    rank's rows of dim 1 of each expert, in the file's order (`_row_layout`). Weights that are not
    sharded, and any other sharding, take the plain path: the whole weight is gathered, converted
    and written.
    A single file is byte for byte what `toolkit.model_dir.save_checkpoint_files` writes for the same
    weights (a tied head is stored once). Other ranks pass `directory=None`.

    A failure to write on rank 0 (a full disk) does not stop it from taking part in the transfers
    that follow, so that no rank waits forever: it is returned (None when all went well) for the
    caller to raise once every rank is through.
    """
    import torch
    from torch.distributed.tensor import DTensor

    from toolkit.safetensors_io import MAX_SHARD_BYTES, SafetensorsShards

    root = _user_module(model)
    # Under FSDP the state dict holds each rank's shards (DTensors), with the full shapes.
    state = {}
    for key, value in root.state_dict().items():
        name = unwrapped_name(key)
        if config.tie_embeddings and name == "lm_head.weight":
            continue  # the tied head is the embedding, stored once
        state[name] = value

    def export_dtype(t: Tensor) -> Any:
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    specs = {name: (export_dtype(t), tuple(t.shape)) for name, t in state.items()}
    writing = fabric.global_rank == 0
    error: BaseException | None = None
    stream = None
    if writing:
        try:
            stream = SafetensorsShards(directory, specs, max_shard_bytes or MAX_SHARD_BYTES, metadata={"format": "pt"})
        except Exception as err:  # reported after the transfers, so that no rank waits for rank 0 forever
            error = err
        order = stream.order if stream is not None else sorted(specs)
    # Every rank goes through the weights in the same order: rank 0 sends the file's order to the others.
    order = fabric.broadcast(order if writing else None, src=0) if fabric.world_size > 1 else order
    # Rows go to rank 0 only if every rank's shards are pieces of rows (`_row_layout`; one collective, here).
    layouts = {name: _row_layout(t) for name, t in state.items() if isinstance(t, DTensor)}
    by_rows = fabric.world_size > 1 and all(layout is not None for layout in layouts.values())
    if fabric.world_size > 1:
        flag = torch.tensor([0 if by_rows else 1], dtype=torch.int32, device=fabric.device)
        torch.distributed.all_reduce(flag)
        by_rows = flag.item() == 0

    def write(method: str, name: str, tensor: Tensor, *how: Any) -> None:
        nonlocal error
        if writing and error is None:
            try:
                with torch.no_grad():
                    getattr(stream, method)(name, tensor, *how)
            except Exception as err:  # keep taking part in the transfers; reported at the end
                error = err

    for name in order:
        tensor = state[name]
        out_dtype = specs[name][0]
        if isinstance(tensor, DTensor) and by_rows and tensor.numel():
            _send_rows_to_rank_zero(tensor, layouts[name], out_dtype,
                                    lambda rows, inner: write("append", name, rows, inner))
            continue
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()  # collective: every rank takes part
        if writing:
            write("write", name, tensor.detach().to("cpu").to(out_dtype))
        del tensor
    if stream is not None:
        try:
            stream.close()
        except (OSError, ValueError) as err:
            error = error or err
    return error


def _row_layout(tensor: Any) -> Any:
    """How rank 0's replica of `tensor` (a DTensor) tiles its rows, or None when it does not.

    Returns (runs, unit shape): `runs` lists, in the order of the tensor's bytes, (global rank, local
    expert) pieces, each `unit shape` rows long. Split along dim 0 only (FSDP2's Shard(0); under
    expert parallelism the experts' Shard(0) with FSDP2's _StridedShard(0) over it), each rank's
    whole shard is one piece of rows of dim 0 (local expert None). An expert weight split along dim
    1 as well (`toolkit.parallel.fsdp.expert_shard_dim`) is tiled by rows of dim 1, the tensor read
    as (X * out, ...): each piece is one local expert's rows of dim 1 on a rank. Replicated mesh
    dims are taken at rank 0's coordinates. None for any other layout, or a tensor subclass (NF4,
    whose bytes are not its rows)."""
    import torch
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = tensor.placements
    split = {i for i, p in enumerate(placements) if isinstance(p, (Shard, _StridedShard))}
    if not split or any(placements[i].dim not in (0, 1) for i in split):
        return None
    if any(placements[i].dim == 1 and type(placements[i]) is not Shard for i in split):
        return None
    if not all(isinstance(p, Replicate) for i, p in enumerate(placements) if i not in split):
        return None
    local = tensor.to_local()
    if type(local) is not torch.Tensor:  # a tensor subclass (NF4): its bytes are not its rows
        return None
    ranks = tensor.device_mesh.mesh
    zero = (ranks == 0).nonzero()
    if len(zero) != 1:
        return None
    box = tuple(tensor.shape[:2]) if any(placements[i].dim == 1 for i in split) else tuple(tensor.shape[:1])
    runs = _replica_runs(box, tuple(ranks.shape), tuple(placements), tuple(zero[0].tolist()))
    if runs is None:
        return None
    coordinate = tuple(tensor.device_mesh.get_coordinate())
    if tuple(local.shape[:len(box)]) != tuple(count for _, count in _shard_box(box, tuple(ranks.shape), tuple(placements), coordinate)):
        return None
    return [(int(ranks[c]), expert) for c, expert in runs], tuple(tensor.shape[len(box):])


@functools.lru_cache(maxsize=256)
def _replica_runs(box: tuple, mesh_shape: tuple, placements: tuple, base: tuple) -> Any:
    """[(mesh coordinate, local expert or None)] of the pieces of the replica holding mesh
    coordinate `base` (its coordinates on the replicated dims, any on the split ones) of a tensor
    whose first dims are `box` ((rows,), or (X, out) when dim 1 is split), in the order of the
    tensor's bytes; None when they do not tile it. Cached: a model's weights share a few shapes."""
    import itertools

    split = [d for d, p in enumerate(placements) if not p.is_replicate()]
    pieces = []  # (first unit, units, coordinate, local expert)
    for coordinate in itertools.product(*(range(size) if d in split else [base[d]] for d, size in enumerate(mesh_shape))):
        parts = _shard_box(box, mesh_shape, placements, coordinate)
        if len(box) == 1:
            pieces.append((parts[0][0], parts[0][1], coordinate, None))
            continue
        (first_expert, experts), (first_row, rows) = parts
        pieces += [((first_expert + e) * box[1] + first_row, rows, coordinate, e) for e in range(experts)]
    pieces.sort(key=lambda piece: (piece[0], piece[1]))
    end = 0
    for first, count, _, _ in pieces:
        if count and first != end:
            return None
        end += count
    return [(coordinate, expert) for _, count, coordinate, expert in pieces if count] if end == math.prod(box) else None


@functools.lru_cache(maxsize=4096)
def _shard_box(box: tuple, mesh_shape: tuple, placements: tuple, coordinate: tuple) -> tuple:
    """((first, count) per dim of `box`) of the shard at mesh `coordinate` split by `placements`."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    shape, offset = _compute_local_shape_and_global_offset(box, mesh_shape, list(coordinate), placements)
    return tuple(zip(offset, shape))


def _send_rows_to_rank_zero(tensor: Any, layout: Any, out_dtype: Any, write_rows: Any) -> None:
    """Every piece of `tensor` in rank 0's replica (`_row_layout`), in order, converted to
    `out_dtype` in messages of at most EXPORT_CHUNK_BYTES, to rank 0, which hands each to
    `write_rows(rows, inner)`: rows of dim 0, or (`inner` True) of dim 1 for a weight split along it."""
    import torch
    import torch.distributed as dist

    runs, unit = layout
    me = dist.get_rank()
    if me != 0 and all(sender != me for sender, _ in runs):
        return  # another replica (HSDP): rank 0's own group holds every row
    local = tensor.to_local().detach()
    row_bytes = max(1, math.prod(unit) * torch.empty((), dtype=out_dtype).element_size())
    step = max(1, EXPORT_CHUNK_BYTES // row_bytes)
    for sender, expert in runs:
        if me not in (0, sender):
            continue
        piece = local if expert is None else local[expert]  # (count, *unit)
        count = _piece_rows(tensor, len(unit), sender) if me == 0 and sender != 0 else piece.shape[0]
        for start in range(0, count, step):
            stop = min(start + step, count)
            if sender == me == 0:
                write_rows(piece[start:stop].to(out_dtype), expert is not None)
            elif me == 0:
                rows = torch.empty((stop - start, *unit), dtype=out_dtype, device=local.device)
                dist.recv(rows, src=sender)
                write_rows(rows, expert is not None)
                del rows
            else:
                dist.send(piece[start:stop].to(out_dtype).contiguous(), dst=0)


def _piece_rows(tensor: Any, unit_dims: int, sender: int) -> int:
    """Rows of each piece rank `sender` sends, its last `unit_dims` dims whole (rank 0 does not hold
    it: computed from the mesh)."""
    ranks = tensor.device_mesh.mesh
    coordinate = tuple((ranks == sender).nonzero()[0].tolist())
    box = tuple(tensor.shape[:tensor.dim() - unit_dims])
    parts = _shard_box(box, tuple(ranks.shape), tuple(tensor.placements), coordinate)
    return parts[-1][1]


def gather_objects(fabric: Fabric, obj: Any) -> list[Any]:
    """`obj` of every rank, in rank order, on every rank. For small picklable things (digests, messages)."""
    if fabric.world_size == 1:
        return [obj]
    import torch.distributed as dist

    gathered: list[Any] = [None] * fabric.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def save_trainable(fabric: Fabric, path: Any, model: Any, optimizer: Any, other: dict[str, Any], sharded: bool) -> None:
    """Write the trainable parameters, the optimizer's state and `other` to `path` (collective call).

    Frozen parameters (LoRA's base, NF4 or not) are left out before anything is gathered or copied:
    under FSDP torch's state-dict API skips them (`ignore_frozen_params`); otherwise the trainable
    parameters are taken as they are (`_trainable_parameters`). The layout is that of
    `fabric.save`, which `load_resharded` reads on any number of processes:

        sharded (FSDP)   `path/`: torch's distributed checkpoint ("model", "optimizer"), each rank
                         writing its own shards, and `path/meta.pt` with `other` (rank 0)
        otherwise        the file `path` (rank 0): {"model", "optimizer", **other}; under FSDP
                         only the trainable parameters and their state are gathered to rank 0

    Tensors are keyed by parameter name; optimizer state too.
    """
    from pathlib import Path

    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import FSDPModule

    path = Path(path)
    root, optim = _user_module(model), _unwrap_optimizer(optimizer)
    fsdp = isinstance(root, FSDPModule)
    # Under FSDP the state goes to the CPU (gathered to rank 0's CPU in the one-file format); one
    # process or DDP keeps its tensors where they are: there is nothing to gather.
    options = StateDictOptions(full_state_dict=fsdp and not sharded, cpu_offload=fsdp, ignore_frozen_params=True)
    if fsdp:
        weights = get_model_state_dict(root, options=options)
    else:
        weights = {name: param.detach() for name, param in _trainable_parameters(root).items()}
    state = {"model": weights, "optimizer": get_optimizer_state_dict(root, optim, options=options)}
    if sharded:
        import torch.distributed.checkpoint as dcp
        from lightning_fabric.utilities.load import _METADATA_FILENAME

        dcp.save(state, checkpoint_id=path)
        if fabric.global_rank == 0:
            torch.save(other, path / _METADATA_FILENAME)
    elif fabric.global_rank == 0:
        torch.save({**state, **other}, path)


def saved_trainable_shapes(path: Any) -> dict[str, tuple[int, ...]]:
    """{parameter name: full shape} of the model in a checkpoint of `save_trainable`, read without the tensors."""
    from pathlib import Path

    import torch

    path = Path(path)
    if path.is_dir():
        from toolkit.distributed_checkpoint import read_metadata

        metadata = read_metadata(path).state_dict_metadata  # unpickled with only the checkpoint's own classes
        return {key.removeprefix("model."): tuple(value.size) for key, value in metadata.items()
                if key.startswith("model.") and hasattr(value, "size")}
    checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=True)
    return {name: tuple(tensor.shape) for name, tensor in checkpoint["model"].items()}


def trainable_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """{parameter name, as `save_trainable` names it: full shape} of what trains in `model` (nothing is gathered)."""
    return {name: tuple(param.shape) for name, param in _trainable_parameters(_user_module(model)).items()}


def _trainable_parameters(root: Any) -> dict[str, Any]:
    """{name: parameter} of the trainable parameters, named as torch's state-dict API names them (no
    wrapper segments such as torch.compile's `_orig_mod`). A DTensor's shape is the full one.

    Read off the parameters, not `state_dict()`: bitsandbytes layers add state-dict entries that name
    no attribute (an 8-bit layer's `SCB`), which the state-dict API cannot name."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    found = {}
    for name, param in root.named_parameters():
        if param.requires_grad:
            for fqn in _get_fqns(root, name):
                found[fqn] = param
    return found


def _unwrap_optimizer(optimizer: Any) -> Any:
    from lightning_fabric.wrappers import _unwrap_objects

    return _unwrap_objects(optimizer)


def load_resharded(fabric: Fabric, path: Any, model: Any, optimizer: Any, strict: bool = True,
                   trainable_only: bool = False) -> dict[str, Any]:
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

    `trainable_only`: a checkpoint of `save_trainable` (on any number of processes, this one's
    too): only the trainable parameters are read; the frozen ones keep the values the model was
    set up with.
    """
    from pathlib import Path

    import torch
    import torch.distributed.checkpoint as dcp
    from lightning_fabric.wrappers import _unwrap_objects
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    path = Path(path)
    root, optim = _unwrap_objects(model), _unwrap_objects(optimizer)
    from torch.distributed.fsdp import FSDPModule

    if path.is_dir():
        from toolkit.distributed_checkpoint import safe_file_system_reader

        # Model first, then the optimizer (whose state is created at its parameters' current shards).
        model_state = {"model": get_model_state_dict(root, options=StateDictOptions(ignore_frozen_params=trainable_only))}
        dcp.load(model_state, storage_reader=safe_file_system_reader(path))
        set_model_state_dict(root, model_state["model"], options=StateDictOptions(strict=strict))
        optim_state = {"optimizer": get_optimizer_state_dict(root, optim)}
        dcp.load(optim_state, storage_reader=safe_file_system_reader(path))
        set_optimizer_state_dict(root, optim, optim_state["optimizer"])
        from lightning_fabric.utilities.load import _METADATA_FILENAME  # "meta.pt": what is not model or optimizer

        return torch.load(path / _METADATA_FILENAME, weights_only=True)

    checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=True)
    # Full tensors in the file: under FSDP each rank keeps its own rows of them. Without FSDP, a
    # checkpoint of what trains is loaded into those parameters only (full_state_dict would have
    # every other parameter loaded into itself, which a bitsandbytes layer does not survive).
    full = StateDictOptions(full_state_dict=not trainable_only or isinstance(root, FSDPModule), strict=strict)
    set_model_state_dict(root, checkpoint.pop("model"), options=full)
    saved = checkpoint.pop("optimizer")
    if any(isinstance(key, int) for key in saved["state"]):
        names = get_optimizer_state_dict(root, optim)["param_groups"]  # the same groups, parameters named
        if [len(g["params"]) for g in names] != [len(g["params"]) for g in saved["param_groups"]]:
            from toolkit.errors import UserError

            raise UserError(
                f"{path}: the run's trainable parameters or optimizer groups differ from the checkpoint's; "
                "resume with the settings it was saved with (model, LoRA targets, --quantize), or start a new --out_dir."
            )
        name_of = {i: n for now, then in zip(names, saved["param_groups"]) for i, n in zip(then["params"], now["params"])}
        saved = {
            "state": {name_of[i]: s for i, s in saved["state"].items()},
            "param_groups": [dict(g, params=[name_of[i] for i in g["params"]]) for g in saved["param_groups"]],
        }
    set_optimizer_state_dict(root, optim, saved, options=full)
    return checkpoint
