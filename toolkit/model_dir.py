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
from typing import Iterable, Iterator, Mapping, Optional

from toolkit.errors import UserError
from toolkit.models.config import CONFIG_FILENAME, Config
from toolkit.safetensors_io import (
    MAX_SHARD_BYTES,
    WEIGHTS_FILENAME,
    WEIGHTS_INDEX_FILENAME,
    SafetensorsShards,
    load_file,
    open_checkpoint,
    raw_header,
    read_header,
    weight_files,
)


def is_checkpoint_dir(path: Path | str) -> bool:
    path = Path(path)
    weights = (path / WEIGHTS_FILENAME).is_file() or (path / WEIGHTS_INDEX_FILENAME).is_file()
    return (path / CONFIG_FILENAME).is_file() and weights


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
    if (path / "lora.json").is_file() and not is_checkpoint_dir(path):
        run = path.parent if path.name == "final" else path
        raise UserError(
            f"{path} holds a LoRA adapter, not a whole model: merge it into its base first with "
            f"`toolkit merge_lora {run}` and use the merged folder (`python -m extensions.lm_eval` takes the adapter as it is)."
        )
    if not is_checkpoint_dir(path):
        raise UserError(
            f"{path} is not a toolkit checkpoint (expected {CONFIG_FILENAME} and {WEIGHTS_FILENAME} or "
            f"{WEIGHTS_INDEX_FILENAME}): "
            "use the `final` folder of a training run, or `toolkit convert_from_hf` for a Hugging Face model."
        )
    return path


@contextmanager
def atomic_directory(out_dir: Path | str, overwrite: bool = False, inputs: Iterable[Path | str] = ()) -> Iterator[Path]:
    """Yield a temporary directory next to `out_dir`; on success it replaces `out_dir` in one rename.

    On failure the temporary directory is removed and `out_dir` is left as it was. An `out_dir`
    that is or holds one of `inputs` (what the result is made from) is refused: replacing it would
    delete them.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():  # never replaced, even with overwrite: it is not a checkpoint
        raise UserError(f"{out_dir} is a file, not a folder; move it away or choose another directory.")
    if out_dir.exists():
        folder = out_dir.resolve()
        for source in inputs:
            resolved = Path(source).resolve()
            if resolved == folder or folder in resolved.parents:
                raise UserError(f"{out_dir} holds the input {source}: replacing it would delete that; choose another directory.")
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
    state_dict = {}
    for path in weight_files(checkpoint_dir):
        state_dict.update(load_file(path, device=device))
    config = Config.from_file(checkpoint_dir)
    if config.tie_embeddings and "lm_head.weight" not in state_dict and "embed.weight" in state_dict:
        state_dict["lm_head.weight"] = state_dict["embed.weight"]
    return state_dict


# Rows copied into a shard per mapping of the checkpoint file (see `checkpoint_row_reader`).
READ_CHUNK_BYTES = 16 << 20


def check_weights_match(checkpoint_dir: Path | str, model) -> None:
    """Refuse, before anything is read, a checkpoint whose weights are not those `model` (built on
    the meta device from its model_config.json) has: one missing, one of another shape, or one the
    model has no place for (a config edited by hand, weights of another size). Reads the headers."""
    checkpoint_dir = Path(checkpoint_dir)
    stored = open_checkpoint(checkpoint_dir).infos
    tied = Config.from_file(checkpoint_dir).tie_embeddings
    expected = {name: tuple(param.shape) for name, param in model.named_parameters()}
    for name, shape in expected.items():
        key = "embed.weight" if tied and name == "lm_head.weight" and name not in stored else name
        if key not in stored:
            raise UserError(f"{checkpoint_dir} has no weight {name!r}: the checkpoint does not match its {CONFIG_FILENAME}.")
        if tuple(stored[key].shape) != shape:
            raise UserError(
                f"{checkpoint_dir}: weight {name!r} is {' x '.join(map(str, stored[key].shape))}, but its "
                f"{CONFIG_FILENAME} implies {' x '.join(map(str, shape))}: the weights and the config do not match."
            )
    extra = sorted(set(stored) - set(expected) - ({"lm_head.weight"} if tied else set()))
    if extra:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise UserError(f"{checkpoint_dir} holds weight {extra[0]!r}{more}, which its {CONFIG_FILENAME} has no place "
                        "for: the weights and the config do not match.")


def checkpoint_row_reader(checkpoint_dir: Path | str):
    """`read_rows(name, start, stop, out=None, inner=None)`: rows [start, stop) of weight `name` (of
    each, rows `inner` of dim 1), read memory-mapped (see `toolkit.training.model_setup.ReadRows`).

    Only the requested rows are read from disk, so each rank of a sharded run touches only its own
    part of the file. A tied output head reads the embedding.
    """
    checkpoint_dir = require_checkpoint_dir(checkpoint_dir)
    stored = open_checkpoint(checkpoint_dir)
    tied = Config.from_file(checkpoint_dir).tie_embeddings

    def read(name: str, start: int = 0, stop: Optional[int] = None, out=None, inner: Optional[tuple[int, int]] = None):
        key = "embed.weight" if tied and name == "lm_head.weight" and name not in stored else name
        if key not in stored:
            raise UserError(f"{checkpoint_dir} has no weight {name!r}: the checkpoint does not match its {CONFIG_FILENAME}.")
        # Into `out` (a rank's shard) the rows are copied a few MiB at a time, each through a mapping
        # of its own, so that no more than that is mapped at once.
        if out is None:
            return stored.read_rows(key, start, stop, inner)
        return stored.read_rows_into(key, start, out, READ_CHUNK_BYTES, inner)

    return read


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
                header = raw_header(f)  # the 8-byte length, then the header, as stored
                header_length = struct.unpack("<Q", header[:8])[0] if len(header) >= 8 else 0
                digest.update(struct.pack("<Q", size) + header)
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


_FLOAT_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
EXPORT_DTYPES = ("bfloat16", "float16", "float32")


def stored_dtype(checkpoint_dir: Path | str) -> str:
    """The floating-point dtype a checkpoint's weights are stored in (e.g. "bfloat16"), from the header."""
    for info in sorted(read_header(weight_files(checkpoint_dir)[0]), key=lambda info: info.name):
        if info.dtype in _FLOAT_DTYPES:
            return _FLOAT_DTYPES[info.dtype]
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
