"""A model directory: the toolkit's inference checkpoint, which `generate`, fine-tuning and export read.

(Resumable training state is a different thing and lives in `toolkit.training.checkpoint`.)

    <dir>/model.safetensors     weights, toolkit names (a tied output head is stored once)
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
from typing import Iterator, Mapping, Optional

from toolkit.errors import UserError
from toolkit.models.config import CONFIG_FILENAME, Config

WEIGHTS_FILENAME = "model.safetensors"


def is_checkpoint_dir(path: Path | str) -> bool:
    path = Path(path)
    return (path / CONFIG_FILENAME).is_file() and (path / WEIGHTS_FILENAME).is_file()


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
            f"{path} is not a toolkit checkpoint (expected {CONFIG_FILENAME} and {WEIGHTS_FILENAME}): "
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
    directory: Path, state_dict: Mapping, config: Config, tokenizer_dir: Optional[Path] = None, weights: bool = True
) -> None:
    """Write weights, config and tokenizer files into an existing directory (see `atomic_directory`)."""
    from safetensors.torch import save_file

    from toolkit.tokenizer import TOKENIZER_FILES

    if weights:
        save_file(weights_for_saving(state_dict, config), str(directory / WEIGHTS_FILENAME), metadata={"format": "pt"})
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

    path = Path(checkpoint_dir) / WEIGHTS_FILENAME
    try:
        state_dict = load_file(str(path), device=device)
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
    path = checkpoint_dir / WEIGHTS_FILENAME
    try:
        with safe_open(str(path), framework="pt") as handle:
            keys = set(handle.keys())
    except (SafetensorError, OSError) as err:
        raise UserError(f"Cannot read {path}: {err}. The file is damaged or incomplete.") from None
    tied = Config.from_file(checkpoint_dir).tie_embeddings

    def read_rows(name: str, start: int = 0, stop: Optional[int] = None, out=None):
        key = "embed.weight" if tied and name == "lm_head.weight" and name not in keys else name
        if key not in keys:
            raise UserError(f"{path} has no weight {name!r}: the checkpoint does not match its {CONFIG_FILENAME}.")
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

    It covers the safetensors header of `model.safetensors` (every name, dtype, shape and offset,
    and its metadata), the file's size, and 256 samples of 4 KiB spread evenly over the weights'
    bytes. Two checkpoints of one architecture (a base and its instruction-tuned sibling) have the
    same header and size; their bytes differ nearly everywhere, so the samples tell them apart. A
    copy of the checkpoint in another folder has the same fingerprint. Reads 1 MiB, whatever the size.
    """
    import hashlib
    import struct

    path = Path(checkpoint_dir) / WEIGHTS_FILENAME
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            length_bytes = f.read(8)
            header_length = struct.unpack("<Q", length_bytes)[0] if len(length_bytes) == 8 else 0
            digest.update(struct.pack("<Q", size) + length_bytes + f.read(min(header_length, size)))
            data_start = 8 + header_length
            span = max(size - data_start - FINGERPRINT_SAMPLE_BYTES, 0)
            for i in range(FINGERPRINT_SAMPLES):
                f.seek(data_start + span * i // max(FINGERPRINT_SAMPLES - 1, 1))
                digest.update(f.read(FINGERPRINT_SAMPLE_BYTES))
    except OSError as err:
        raise UserError(f"Cannot read {path}: {err.strerror or err}.") from None
    return digest.hexdigest()[:16]


_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
EXPORT_DTYPES = ("bfloat16", "float16", "float32")


def stored_dtype(checkpoint_dir: Path | str) -> str:
    """The floating-point dtype a checkpoint's weights are stored in (e.g. "bfloat16"), from the header."""
    from safetensors import safe_open

    with safe_open(str(Path(checkpoint_dir) / WEIGHTS_FILENAME), framework="pt") as handle:
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
