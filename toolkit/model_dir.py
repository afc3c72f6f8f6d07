"""A model directory: the toolkit's inference checkpoint, which `generate`, fine-tuning and export read.

(Resumable training state is a different thing and lives in `toolkit.training.checkpoint`.)

    <dir>/model.safetensors     weights, toolkit names (a tied output head is stored once), or,
                                for a model over MAX_SHARD_BYTES, Hugging Face's sharded layout:
    <dir>/model-0000K-of-0000N.safetensors + model.safetensors.index.json
    <dir>/model_config.json     `Config` fields
    <dir>/tokenizer.json ...    tokenizer files, so the directory is self-contained

Directories are written atomically: into a temporary sibling that is renamed into place at the
end, so an interrupted write never leaves a directory that looks complete.
"""

from __future__ import annotations

import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Optional

from toolkit.errors import UserError
from toolkit.models.config import CONFIG_FILENAME, Config

WEIGHTS_FILENAME = "model.safetensors"
WEIGHTS_INDEX_FILENAME = "model.safetensors.index.json"
# Largest weights file a checkpoint is written in (Hugging Face's default for `save_pretrained`):
# a 70B model in bfloat16 (140 GB) is 28 files, each small enough for the Hub and for a copy to resume.
MAX_SHARD_BYTES = 5 * 10**9


def shard_filename(index: int, count: int) -> str:
    """The name of weights file `index` (from 1) of `count`, as Hugging Face names them."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def shard_groups(items: Iterable[tuple[Any, int]], max_shard_bytes: int) -> list[list[Any]]:
    """(item, bytes) pairs, in order, as consecutive groups of at most `max_shard_bytes` bytes (an
    item bigger than that gets a group of its own): what goes into each weights file."""
    groups: list[list[Any]] = [[]]
    size = 0
    for item, nbytes in items:
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += nbytes
    return groups


def is_checkpoint_dir(path: Path | str) -> bool:
    path = Path(path)
    weights = (path / WEIGHTS_FILENAME).is_file() or (path / WEIGHTS_INDEX_FILENAME).is_file()
    return (path / CONFIG_FILENAME).is_file() and weights


def weight_files(checkpoint_dir: Path | str) -> list[Path]:
    """The weights files of a checkpoint: its shards in order when it has an index, else model.safetensors.

    An index that cannot be read, names a file outside the directory or a missing one is a UserError.
    """
    import json

    checkpoint_dir = Path(checkpoint_dir)
    index_path = checkpoint_dir / WEIGHTS_INDEX_FILENAME
    if not index_path.is_file():
        return [checkpoint_dir / WEIGHTS_FILENAME]
    try:
        names = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise UserError(f"Cannot read {index_path}: {err}. The checkpoint is damaged or incomplete.") from None
    files = []
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or not name.endswith(".safetensors"):
            raise UserError(f"{index_path} names {name!r}, which is not a safetensors file in {checkpoint_dir}.")
        if not (checkpoint_dir / name).is_file():
            raise UserError(f"{index_path} lists {name}, which is missing: the checkpoint is incomplete.")
        files.append(checkpoint_dir / name)
    return files


def require_checkpoint_dir(path: Path | str) -> Path:
    """The path, or a one-line error that says what a checkpoint directory is and how to get one."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"Checkpoint directory {path} does not exist.")
    if (path / "config.json").is_file() and not (path / CONFIG_FILENAME).is_file():
        raise UserError(
            f"{path} is a Hugging Face model, not a toolkit checkpoint: convert it first with "
            f"`toolkit convert_from_hf {path} <out_dir>`."
        )
    if not is_checkpoint_dir(path):
        raise UserError(
            f"{path} is not a toolkit checkpoint (expected {CONFIG_FILENAME} and {WEIGHTS_FILENAME} or "
            f"{WEIGHTS_INDEX_FILENAME}): "
            "use the `final` folder of a training run, or `toolkit convert_from_hf` for a Hugging Face model."
        )
    return path


@contextmanager
def atomic_directory(out_dir: Path | str, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory next to `out_dir`; on success it replaces `out_dir` in one rename.

    On failure the temporary directory is removed and `out_dir` is left as it was.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise UserError(f"{out_dir} already exists and is not empty; choose another directory or pass --overwrite true.")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if out_dir.exists():
            old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out_dir, old)
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def weights_for_saving(state_dict: Mapping, config: Config) -> dict:
    """Contiguous CPU tensors with the tied head dropped (safetensors stores each tensor once)."""
    out = {}
    for name, tensor in state_dict.items():
        if config.tie_embeddings and name == "lm_head.weight":
            continue
        out[name] = tensor.detach().to("cpu").contiguous()
    return out


class SafetensorsStream:
    """A safetensors file written one tensor at a time, equal byte for byte to `save_file` of them all.

    `specs` maps each name to (torch dtype, shape). The header (names, dtypes, shapes, offsets) is
    written first; then `write(name, tensor)` appends each tensor's bytes in the order of `order`,
    which is the order `save_file` lays them out in. Only the tensor being written is in memory:
    the file's bytes are not collected in a buffer.
    """

    def __init__(self, path: Path | str, specs: Mapping[str, tuple], metadata: Optional[dict] = None) -> None:
        self.order, header = _safetensors_header(specs, metadata)
        self._specs = {name: (dtype, tuple(shape)) for name, (dtype, shape) in specs.items()}
        self._next = 0
        self._appended = 0  # bytes of the tensor `order[_next]` written by `append` so far
        self._file = open(path, "wb")
        self._file.write(header)

    def append(self, name: str, rows) -> None:
        """Write the next rows (dim 0) of the tensor `name`, in order; the tensor is done when all
        its bytes are written. Lets a tensor be written from pieces that never exist together."""
        import torch

        expected = self.order[self._next] if self._next < len(self.order) else None
        if name != expected:
            raise ValueError(f"safetensors stream: got {name!r}, expected {expected!r} next")
        dtype, shape = self._specs[name]
        total = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        data = rows.detach().to("cpu").contiguous().reshape(-1)
        if rows.dtype != dtype or tuple(rows.shape[1:]) != shape[1:] or self._appended + data.numel() * data.element_size() > total:
            raise ValueError(f"safetensors stream: rows {rows.dtype} {tuple(rows.shape)} do not continue {name} ({dtype} {shape})")
        if data.numel():
            self._file.write(data.view(torch.uint8).numpy().data)
        self._appended += data.numel() * data.element_size()
        if self._appended == total:
            self._next, self._appended = self._next + 1, 0

    def write(self, name: str, tensor) -> None:
        import torch

        expected = self.order[self._next] if self._next < len(self.order) else None
        if name != expected or self._appended:
            raise ValueError(f"safetensors stream: got {name!r}, expected {expected!r} next")
        dtype, shape = self._specs[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"safetensors stream: {name} is {tensor.dtype} {tuple(tensor.shape)}, the header says {dtype} {shape}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        if data.numel():
            self._file.write(data.view(torch.uint8).numpy().data)
        self._next += 1

    def close(self) -> None:
        if self._next != len(self.order):
            self._file.close()
            raise ValueError(f"safetensors stream: {len(self.order) - self._next} tensor(s) never written")
        self._file.close()


class SafetensorsShards:
    """A checkpoint's weights written one tensor (or rows of one) at a time, into `directory`.

    `specs` maps each name to (torch dtype, shape), in model order. Up to `max_shard_bytes` of them
    this is one `model.safetensors`, byte for byte `save_file` of them all; beyond, consecutive
    tensors (in model order) are grouped into files of at most `max_shard_bytes` (a larger tensor gets
    a file of its own), named and indexed as Hugging Face does (`model-0000K-of-0000N.safetensors`,
    `model.safetensors.index.json`), each file byte for byte `save_file` of its tensors. The tensors
    come in `order`: file by file, each in safetensors' own order. One file is open at a time, and
    nothing is buffered: memory holds only the tensor or rows being written.
    """

    def __init__(self, directory: Path | str, specs: Mapping[str, tuple], max_shard_bytes: int = MAX_SHARD_BYTES,
                 metadata: Optional[dict] = None) -> None:
        import torch

        self.directory, self.metadata = Path(directory), metadata
        nbytes = {name: torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                  for name, (dtype, shape) in specs.items()}
        groups = [{name: (specs[name][0], tuple(specs[name][1])) for name in names}
                  for names in shard_groups(nbytes.items(), max_shard_bytes)]
        self.total_bytes = sum(nbytes.values())
        count = len(groups)
        self.filenames = [WEIGHTS_FILENAME] if count == 1 else [shard_filename(i, count) for i in range(1, count + 1)]
        self._groups = groups
        self._orders = [_safetensors_header(group, metadata)[0] for group in groups]
        self.order = [name for order in self._orders for name in order]
        self._file_of = {name: i for i, order in enumerate(self._orders) for name in order}
        self._stream: Optional[SafetensorsStream] = None
        self._current = -1

    def _stream_for(self, name: str) -> SafetensorsStream:
        index = self._file_of.get(name, self._current)
        if index != self._current:
            if index != self._current + 1:
                raise ValueError(f"safetensors shards: got {name!r} out of order")
            if self._stream is not None:
                self._stream.close()
            self._current = index
            self._stream = SafetensorsStream(self.directory / self.filenames[index], self._groups[index], self.metadata)
        if self._stream is None:
            raise ValueError(f"safetensors shards: got {name!r}, expected {self.order[0]!r} first")
        return self._stream

    def append(self, name: str, rows) -> None:
        """Rows (dim 0) of `name`, in order (see `SafetensorsStream.append`)."""
        self._stream_for(name).append(name, rows)

    def write(self, name: str, tensor) -> None:
        self._stream_for(name).write(name, tensor)

    def close(self) -> None:
        """Closes the last file (every tensor must have been written) and writes the index, if sharded."""
        import json

        if self._current != len(self._groups) - 1 or self._stream is None:
            raise ValueError(f"safetensors shards: {len(self._groups) - self._current - 1} file(s) never written")
        self._stream.close()
        if len(self.filenames) > 1:
            weight_map = {name: self.filenames[i] for name, i in sorted(self._file_of.items())}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.directory / WEIGHTS_INDEX_FILENAME).write_text(json.dumps(index, indent=2) + "\n")


def _safetensors_header(specs: Mapping[str, tuple], metadata: Optional[dict]) -> tuple[list[str], bytes]:
    """(tensor order in the file, the header bytes) that `safetensors.torch.save_file` would write.

    The order (by dtype, then name) is safetensors' own: it is read off a file of one-element
    stand-ins with the same names and dtypes, so that it follows the installed version.
    """
    import json
    import struct

    import torch
    from safetensors.torch import save

    stand_ins = save({name: torch.zeros(1, dtype=dtype) for name, (dtype, _) in specs.items()}, metadata=metadata)
    length = struct.unpack("<Q", stand_ins[:8])[0]
    layout = json.loads(stand_ins[8:8 + length])
    header: dict = {}
    if "__metadata__" in layout:
        header["__metadata__"] = layout.pop("__metadata__")
    order = list(layout)  # stand-ins' offsets grow with this order
    offset = 0
    for name in order:
        dtype, shape = specs[name]
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": layout[name]["dtype"], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes
    return order, struct.pack("<Q", len(text)) + text


def save_checkpoint_files(
    directory: Path, state_dict: Mapping, config: Config, tokenizer_dir: Optional[Path] = None, weights: bool = True,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> None:
    """Write weights, config and tokenizer files into an existing directory (see `atomic_directory`).

    The weights go into `model.safetensors` (byte for byte `safetensors.torch.save_file`), or
    beyond `max_shard_bytes` into Hugging Face's sharded layout (`SafetensorsShards`)."""
    from toolkit.tokenizer import TOKENIZER_FILES

    if weights:
        tensors = weights_for_saving(state_dict, config)
        files = SafetensorsShards(directory, {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()},
                                  max_shard_bytes, metadata={"format": "pt"})
        for name in files.order:
            files.write(name, tensors[name])
        files.close()
    config.save(directory)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.is_file() and not (directory / name).exists():
                shutil.copy2(src, directory / name)


def load_state_dict(checkpoint_dir: Path | str, device: str = "cpu") -> dict:
    """The weights of a checkpoint (safetensors; no pickle is ever loaded), tied head restored."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state_dict = {}
    for path in weight_files(checkpoint_dir):
        try:
            state_dict.update(load_file(str(path), device=device))
        except (SafetensorError, OSError) as err:
            raise UserError(f"Cannot read {path}: {err}. The file is damaged or incomplete.") from None
    config = Config.from_file(checkpoint_dir)
    if config.tie_embeddings and "lm_head.weight" not in state_dict and "embed.weight" in state_dict:
        state_dict["lm_head.weight"] = state_dict["embed.weight"]
    return state_dict


# Rows copied into a shard per mapping of the checkpoint file (see `checkpoint_row_reader`).
READ_CHUNK_BYTES = 16 << 20


def checkpoint_row_reader(checkpoint_dir: Path | str):
    """`read_rows(name, start, stop, out=None)`: rows [start, stop) of weight `name`, read memory-mapped
    (see `toolkit.training.model_setup.ReadRows`).

    Only the requested rows are read from disk, so each rank of a sharded run touches only its own
    part of the file. A tied output head reads the embedding.
    """
    from safetensors import SafetensorError, safe_open

    checkpoint_dir = require_checkpoint_dir(checkpoint_dir)
    file_of: dict[str, Path] = {}  # weight name -> the file that holds it
    for path in weight_files(checkpoint_dir):
        try:
            with safe_open(str(path), framework="pt") as handle:
                file_of.update(dict.fromkeys(handle.keys(), path))
        except (SafetensorError, OSError) as err:
            raise UserError(f"Cannot read {path}: {err}. The file is damaged or incomplete.") from None
    tied = Config.from_file(checkpoint_dir).tie_embeddings

    def read_rows(name: str, start: int = 0, stop: Optional[int] = None, out=None):
        key = "embed.weight" if tied and name == "lm_head.weight" and name not in file_of else name
        if key not in file_of:
            raise UserError(f"{checkpoint_dir} has no weight {name!r}: the checkpoint does not match its {CONFIG_FILENAME}.")
        path = file_of[key]
        # The file is mapped for each read only: the pages it touched leave the process's resident
        # set with the mapping, instead of adding up to the rank's share of the file. Into `out`
        # (a rank's shard) the rows are copied a few MiB at a time, so no more than that is mapped.
        if out is None:
            with safe_open(str(path), framework="pt") as handle:
                return handle.get_slice(key)[start:stop]
        rows = out.view(out.shape[0] if out.dim() else 1, -1)
        step = max(1, READ_CHUNK_BYTES // max(rows.shape[1] * out.element_size(), 1))
        for first in range(0, rows.shape[0], step):
            last = min(first + step, rows.shape[0])
            with safe_open(str(path), framework="pt") as handle:
                chunk = handle.get_slice(key)[start + first:start + last]
            rows[first:last].copy_(chunk.reshape(last - first, -1))
            del chunk
        return out

    return read_rows


# Bytes the fingerprint reads from a weights file, whatever its size: this many evenly spaced samples
# of this many bytes each (1 MiB in all; a 140 GB 70B file costs as much as a 1 MB one).
FINGERPRINT_SAMPLES, FINGERPRINT_SAMPLE_BYTES = 256, 4096


def checkpoint_fingerprint(checkpoint_dir: Path | str) -> str:
    """A short identity of a checkpoint's weights, cheap at any size (sha256, hex, 16 characters).

    It covers the safetensors header of each weights file (every name, dtype, shape and offset, and
    its metadata), each file's size, and 256 samples of 4 KiB spread evenly over the weights' bytes
    of all files, in file order. Two checkpoints of one architecture (a base and its
    instruction-tuned sibling) have the same headers and sizes; their bytes differ nearly everywhere,
    so the samples tell them apart. A copy of the checkpoint in another folder has the same
    fingerprint. Reads 1 MiB, whatever the size.
    """
    import hashlib
    import struct

    digest = hashlib.sha256()
    spans = []  # (file, first byte of its tensor data, bytes of tensor data)
    path = Path(checkpoint_dir)
    try:
        for path in weight_files(checkpoint_dir):
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                length_bytes = f.read(8)
                header_length = struct.unpack("<Q", length_bytes)[0] if len(length_bytes) == 8 else 0
                digest.update(struct.pack("<Q", size) + length_bytes + f.read(min(header_length, size)))
                spans.append((path, 8 + header_length, max(size - 8 - header_length, 0)))
        # Sample positions over the data of all files as one run of bytes (one file: its data).
        span = max(sum(n for _, _, n in spans) - FINGERPRINT_SAMPLE_BYTES, 0)
        positions = [span * i // max(FINGERPRINT_SAMPLES - 1, 1) for i in range(FINGERPRINT_SAMPLES)]
        before = 0
        for path, data_start, data_bytes in spans:
            mine = [p - before for p in positions if before <= p < before + data_bytes]
            if mine:
                with open(path, "rb") as f:
                    for offset in mine:
                        f.seek(data_start + offset)
                        digest.update(f.read(FINGERPRINT_SAMPLE_BYTES))
            before += data_bytes
    except OSError as err:
        raise UserError(f"Cannot read {path}: {err.strerror or err}.") from None
    return digest.hexdigest()[:16]


_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
EXPORT_DTYPES = ("bfloat16", "float16", "float32")


def stored_dtype(checkpoint_dir: Path | str) -> str:
    """The floating-point dtype a checkpoint's weights are stored in (e.g. "bfloat16"), from the header."""
    from safetensors import safe_open

    with safe_open(str(weight_files(checkpoint_dir)[0]), framework="pt") as handle:
        for key in handle.keys():
            dtype = _SAFETENSORS_DTYPES.get(handle.get_slice(key).get_dtype())
            if dtype is not None:
                return dtype
    return "float32"


def export_dtype(choice: Optional[str], checkpoint_dir: Optional[Path]):
    """The torch dtype a run exports in: `choice`, else the dtype of the checkpoint it started from,
    else None (the dtype it trained in)."""
    import torch

    if choice is not None and choice not in EXPORT_DTYPES:
        raise UserError(f"--export_dtype must be one of {', '.join(EXPORT_DTYPES)}, got {choice!r}.")
    name = choice or (stored_dtype(checkpoint_dir) if checkpoint_dir is not None else None)
    return getattr(torch, name) if name else None


def load_model(checkpoint_dir: Path | str, device: str = "cpu", dtype=None):
    """A GPT with the checkpoint's weights, in eval mode."""
    import torch

    from toolkit.models.gpt import GPT

    checkpoint_dir = require_checkpoint_dir(checkpoint_dir)
    config = Config.from_file(checkpoint_dir)
    with torch.device("meta"):
        model = GPT(config)
    state_dict = load_state_dict(checkpoint_dir, device=device)
    try:
        model.load_state_dict(state_dict, strict=True, assign=True)
    except RuntimeError as err:
        first = str(err).strip().splitlines()[0:2]
        raise UserError(f"Weights in {checkpoint_dir} do not match its {CONFIG_FILENAME}: {' '.join(first)}") from None
    if config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()
