"""Reading torch's distributed checkpoints (the sharded `state/` folders of FSDP runs) without
running code from them.

A distributed checkpoint keeps two kinds of pickled data beside its tensors:
- `.metadata`: torch 2.13's `FileSystemReader.read_metadata` reads it with a plain `pickle.load`;
- every non-tensor entry (counters, optimizer hyperparameters): `DefaultLoadPlanner.load_bytes`
  reads it with `torch.load(..., weights_only=False)`.
Either can run arbitrary code when the folder comes from elsewhere (`--resume <dir>`,
`convert_pretrained_checkpoint`). `check_distributed_checkpoint` reads both first with restricted
unpicklers: the metadata may hold only the checkpoint's own metadata classes, paths, sizes, dtypes
and layouts; each entry only what `torch.load(weights_only=True)` admits (plain Python values and
tensors). Anything else is refused in one line before torch reads the folder. Every reader of a
distributed checkpoint in the toolkit calls it first (`SafeFileSystemReader` does so itself).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

from toolkit.errors import UserError

METADATA_FILE = ".metadata"

# (module, name) the metadata of torch 2.13's distributed checkpoint is built from: its own
# dataclasses, the file layout, and the torch scalars they describe tensors with.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                 "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a lookup of a layout by name
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch":
            import torch

            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def read_metadata(folder: Path) -> Any:
    """The checkpoint's `Metadata`, unpickled with only its own classes admitted. Raises UserError."""
    path = Path(folder) / METADATA_FILE
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise UserError(f"{folder} is not a distributed checkpoint: it has no {METADATA_FILE} file.") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, TypeError, ValueError) as err:
        raise UserError(f"Refusing to read the checkpoint {folder}: its {METADATA_FILE} {_reason(err)}.") from None


def check_distributed_checkpoint(folder: Path) -> Any:
    """Refuse (UserError, one line) a distributed checkpoint whose metadata or non-tensor entries
    would run code when torch reads them; return its metadata otherwise. Reads only the metadata
    and the entries' bytes (counters and hyperparameters: a few KiB), never the tensors."""
    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    folder = Path(folder)
    metadata = read_metadata(folder)
    entries = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise UserError(f"Refusing to read the checkpoint {folder}: its {METADATA_FILE} is not a checkpoint's metadata.")
    byte_entries = {fqn for fqn, item in entries.items() if isinstance(item, BytesStorageMetadata)}
    for index, info in storage.items():
        if getattr(index, "fqn", None) not in byte_entries:
            continue
        if getattr(info, "transform_descriptors", None):
            raise UserError(f"Refusing to read the checkpoint {folder}: entry {index.fqn} is stored transformed.")
        relative = Path(str(info.relative_path))
        if relative.is_absolute() or ".." in relative.parts:
            raise UserError(f"Refusing to read the checkpoint {folder}: entry {index.fqn} points outside the folder.")
        try:
            with open(folder / relative, "rb") as f:
                f.seek(int(info.offset))
                data = f.read(int(info.length))
            torch.load(io.BytesIO(data), weights_only=True)
        except OSError as err:
            raise UserError(f"Cannot read the checkpoint {folder}: entry {index.fqn}: {err.strerror or err}.") from None
        except Exception as err:  # torch.load's refusal (UnpicklingError) or a damaged entry
            raise UserError(f"Refusing to read the checkpoint {folder}: entry {index.fqn} {_reason(err)}.") from None
    return metadata


def _reason(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if isinstance(err, pickle.UnpicklingError) or "weights_only" in str(err) or "Unsupported global" in str(err):
        return f"holds something other than checkpoint data ({text[:200]})"
    return f"is damaged ({text[:200]})"


def safe_file_system_reader(folder: Path):
    """torch's `FileSystemReader` for `folder`, checked first with `check_distributed_checkpoint`, whose
    `read_metadata` returns the restricted read instead of unpickling the file again."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    metadata = check_distributed_checkpoint(folder)

    class _CheckedReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _CheckedReader(folder)
