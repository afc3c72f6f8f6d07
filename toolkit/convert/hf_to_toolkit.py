"""Hugging Face checkpoint -> toolkit checkpoint, streamed tensor by tensor.

    toolkit convert_from_hf <hf_dir> <out_dir>

Reads `model.safetensors`, a sharded `model.safetensors.index.json`, or (when there is no
safetensors file) `pytorch_model.bin` / `pytorch_model.bin.index.json`. Everything is checked
before a byte is written: every weight name must be known, every shape must match config.json,
nothing may be missing. The output is written into a temporary directory that is renamed into
place at the end (`toolkit.model_dir.atomic_directory`).

Memory: the output safetensors file is written by this module, header first and then one tensor
after the other, so that nothing has to be held in memory at once. A tensor whose bytes are only
renamed (the usual case) is copied from file to file by the kernel (`copy_file_range`) without
passing through this process. A dtype conversion goes ~64 MiB of rows at a time; only GPT-NeoX's
fused query/key/value matrix is materialised whole (one at a time). `.bin` shards are
memory-mapped one at a time.

This module also holds the streaming safetensors reader/writer shared with `toolkit_to_hf`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Literal, Optional, Union

from toolkit.errors import UserError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from toolkit.models.config import Config

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"

# safetensors dtype names and their sizes in bytes; the torch dtypes are looked up lazily.
_DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E5M2": 1,
}
TORCH_DTYPE_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
# --dtype choices
DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def torch_dtype(st_dtype: str) -> "torch.dtype":
    import torch

    return getattr(torch, TORCH_DTYPE_NAMES[st_dtype])


def st_dtype(dtype: "torch.dtype") -> str:
    name = str(dtype).removeprefix("torch.")
    for st, torch_name in TORCH_DTYPE_NAMES.items():
        if torch_name == name:
            return st
    raise UserError(f"Tensors of dtype {name} cannot be stored in safetensors by the toolkit")


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---------------------------------------------------------------------------- reading
@dataclass
class TensorInfo:
    """Where one stored tensor is: a byte range of a safetensors file, or an entry of a .bin file."""

    name: str
    dtype: str  # safetensors name: "BF16", "F32", ...
    shape: tuple[int, ...]
    path: Path
    offset: int = 0  # absolute position of the first byte in a safetensors file
    nbytes: int = 0
    kind: str = "safetensors"  # or "bin"


def read_safetensors_header(path: Path) -> list[TensorInfo]:
    """The tensors of a safetensors file, in file order, without reading their data.

    A file that is damaged or shorter than its header promises is a UserError.
    """
    path = Path(path)
    damaged = f"Cannot read {path}: the file is damaged or incomplete (re-download or re-create it)"
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise UserError(f"{damaged}; it is only {size} bytes long")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > size - 8 or header_len > 100_000_000:
                raise UserError(f"{damaged}; its header is cut off")
            header = json.loads(f.read(header_len))
    except (OSError, ValueError) as err:  # ValueError: the header is not UTF-8 JSON
        raise UserError(f"{damaged}: {err}") from None
    if not isinstance(header, dict):
        raise UserError(f"{damaged}; its header is not a JSON object")
    data_start = 8 + header_len
    infos = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(s) for s in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{damaged}; bad header entry for {name!r}") from None
        if dtype not in _DTYPE_SIZES:
            raise UserError(f"{path}: tensor {name!r} has dtype {dtype}, which the toolkit does not support")
        nbytes = _numel(shape) * _DTYPE_SIZES[dtype]
        if end - begin != nbytes or begin < 0:
            raise UserError(f"{damaged}; tensor {name!r} has inconsistent offsets")
        if data_start + end > size:
            raise UserError(f"{damaged}; it ends before the data of tensor {name!r} (truncated file?)")
        infos.append(TensorInfo(name, dtype, shape, path, data_start + begin, nbytes))
    infos.sort(key=lambda info: info.offset)
    return infos


def _torch_load(path: Path) -> dict:
    import pickle

    import torch

    try:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:
            if "mmap" not in str(err):
                raise
            obj = torch.load(path, map_location="cpu", weights_only=True)  # legacy (non-zip) format
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"Cannot read {path}: {first}. The file is damaged or incomplete.") from None
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise UserError(f"{path} does not hold a state dict")
    return {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}


def read_bin_header(path: Path) -> list[TensorInfo]:
    """The tensors of a PyTorch .bin shard (memory-mapped, so no data is read)."""
    state = _torch_load(path)
    infos = [
        TensorInfo(name, st_dtype(t.dtype), tuple(t.shape), Path(path), 0, t.numel() * t.element_size(), kind="bin")
        for name, t in state.items()
    ]
    del state
    return infos


def _shards_from_index(hf_dir: Path, index_name: str) -> list[Path]:
    index_path = hf_dir / index_name
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise UserError(f"Cannot read {index_path}: {err}") from None
    shards = [hf_dir / name for name in files]
    for shard in shards:
        if not shard.is_file():
            raise UserError(f"{index_path} lists {shard.name}, which is missing from {hf_dir}; download it")
    return shards


def find_hf_weights(hf_dir: Path) -> list[Path]:
    """The weight files of a Hugging Face model directory; safetensors preferred over .bin."""
    hf_dir = Path(hf_dir)
    if (hf_dir / SAFETENSORS_INDEX).is_file():
        return _shards_from_index(hf_dir, SAFETENSORS_INDEX)
    if (hf_dir / SAFETENSORS_SINGLE).is_file():
        return [hf_dir / SAFETENSORS_SINGLE]
    shards = sorted(hf_dir.glob("model-*-of-*.safetensors"))
    if shards:
        return shards
    if (hf_dir / BIN_INDEX).is_file():
        return _shards_from_index(hf_dir, BIN_INDEX)
    if (hf_dir / BIN_SINGLE).is_file():
        return [hf_dir / BIN_SINGLE]
    raise UserError(
        f"No weights in {hf_dir}: expected {SAFETENSORS_SINGLE}, {SAFETENSORS_INDEX}, {BIN_SINGLE} or {BIN_INDEX}"
    )


def read_headers(files: list[Path]) -> list[TensorInfo]:
    infos: list[TensorInfo] = []
    seen: dict[str, Path] = {}
    for path in files:
        reader = read_safetensors_header if path.name.endswith(".safetensors") else read_bin_header
        for info in reader(path):
            if info.name in seen:
                raise UserError(f"Weight {info.name!r} appears twice: in {seen[info.name].name} and {path.name}")
            seen[info.name] = path
            infos.append(info)
    return infos


class TensorReader:
    """Reads stored tensors; keeps source files open and at most one .bin shard mapped."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._bin: tuple[Optional[Path], dict] = (None, {})

    def fd(self, path: Path) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def load(self, info: TensorInfo) -> "torch.Tensor":
        """The tensor itself (a fresh CPU tensor, or a memory-mapped one for .bin)."""
        return self.load_rows(info, 0, info.shape[0] if info.shape else 1)

    def load_rows(self, info: TensorInfo, start: int, stop: int) -> "torch.Tensor":
        """Rows start:stop of the tensor (along the first dimension); all of a 0-d tensor."""
        import torch

        if info.kind == "bin":
            if self._bin[0] != info.path:
                self._bin = (None, {})  # drop the previous shard before mapping the next
                self._bin = (info.path, _torch_load(info.path))
            tensor = self._bin[1][info.name]
            return tensor[start:stop] if info.shape else tensor
        if not info.shape:
            start, stop, row_bytes, shape = 0, 1, info.nbytes, ()
        else:
            row_bytes = info.nbytes // info.shape[0] if info.shape[0] else 0
            shape = (stop - start, *info.shape[1:])
        buffer = torch.empty((stop - start) * row_bytes, dtype=torch.uint8)
        _pread_into(self.fd(info.path), buffer.numpy(), info.offset + start * row_bytes, info.path)
        return buffer.view(torch_dtype(info.dtype)).reshape(shape)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._bin = (None, {})


def _preadv(fd: int, view: memoryview, offset: int) -> int:
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    os.lseek(fd, offset, os.SEEK_SET)  # pragma: no cover - platforms without preadv
    return os.readv(fd, [view])


def _pread_into(fd: int, array, offset: int, path: Path) -> None:
    """Fill `array` (any writable buffer) with the file's bytes from `offset`, without a copy."""
    view = memoryview(array).cast("B")
    done = 0
    while done < len(view):
        n = _preadv(fd, view[done:], offset + done)
        if n <= 0:
            raise UserError(f"Cannot read {path}: the file ended early (truncated?)")
        done += n


# ---------------------------------------------------------------------------- writing
@dataclass
class OutTensor:
    """One tensor of an output safetensors file and how to produce its bytes.

    Exactly one of `source` or `make` is set. `source`: a stored tensor, copied by the kernel when
    it is a safetensors byte range of the same dtype, else converted a slice of rows at a time.
    `make`: a function that builds the whole tensor (fused tensors).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    source: Optional[TensorInfo] = None
    make: Optional[Callable[[], "torch.Tensor"]] = None

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * _DTYPE_SIZES[self.dtype]


def _header(tensors: list[OutTensor], metadata: Optional[dict[str, str]]) -> bytes:
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)  # data starts 8-byte aligned, as safetensors itself writes
    return struct.pack("<Q", len(raw)) + raw


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


_COPY_CHUNK = 1 << 30


def _copy_range(src_fd: int, dst_fd: int, src_offset: int, dst_offset: int, count: int) -> None:
    """Copy bytes between files in the kernel when it can (copy_file_range), else through a buffer."""
    done = 0
    if hasattr(os, "copy_file_range"):
        try:
            while done < count:
                n = os.copy_file_range(
                    src_fd, dst_fd, min(count - done, _COPY_CHUNK), src_offset + done, dst_offset + done
                )
                if n <= 0:
                    break
                done += n
        except OSError:
            pass  # other file system, unsupported by the kernel...: fall back below
    buffer = bytearray(min(count - done, 64 << 20))
    view = memoryview(buffer)
    while done < count:
        n = _preadv(src_fd, view[: min(len(buffer), count - done)], src_offset + done)
        if n <= 0:
            raise OSError("source file ended early")
        _pwrite_all(dst_fd, view[:n], dst_offset + done)
        done += n


def tensor_bytes(tensor: "torch.Tensor"):
    """A buffer over the tensor's bytes (no copy when it is already contiguous on the CPU)."""
    import torch

    tensor = tensor.detach().to("cpu").contiguous().reshape(-1)
    return tensor.view(torch.uint8).numpy() if tensor.numel() else b""


def write_safetensors(
    path: Path,
    tensors: list[OutTensor],
    reader: TensorReader,
    progress: Optional["Progress"] = None,
    metadata: Optional[dict[str, str]] = None,
) -> None:
    """Write a safetensors file, header first, then each tensor in turn (never all in memory)."""
    header = _header(tensors, metadata)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _pwrite_all(fd, header, 0)
        offset = len(header)
        for t in tensors:
            if t.source is not None and t.source.kind == "safetensors" and t.source.dtype == t.dtype:
                _copy_range(reader.fd(t.source.path), fd, t.source.offset, offset, t.nbytes)
            elif t.source is not None:
                _write_converted(fd, offset, t, reader)
            else:
                assert t.make is not None
                tensor = t.make()
                if tuple(tensor.shape) != t.shape or st_dtype(tensor.dtype) != t.dtype:
                    made = f"{tuple(tensor.shape)} {tensor.dtype}"
                    raise AssertionError(f"{t.name}: made {made}, planned {t.shape} {t.dtype}")
                _pwrite_all(fd, tensor_bytes(tensor), offset)
                del tensor
            offset += t.nbytes
            if progress is not None:
                progress.update(t.nbytes)
    finally:
        os.close(fd)


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: Union[int, str]) -> int:
    """Bytes in "2GB" (10^9), "1.5GiB" (2^30), "500MB" or a plain number of bytes."""
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(size))
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise UserError(f"Cannot read size {size!r}; write it like 2GB, 500MB or 1GiB")
        value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise UserError(f"Size {size!r} must be positive")
    return value


def write_weight_files(
    directory: Path,
    tensors: list[OutTensor],
    max_shard_bytes: int,
    reader: TensorReader,
    progress: Optional["Progress"] = None,
) -> None:
    """`directory/model.safetensors`, or, for tensors over `max_shard_bytes` in all, consecutive groups
    of at most that many bytes (a bigger tensor gets a file of its own) in
    `model-0000K-of-0000N.safetensors` with Hugging Face's `model.safetensors.index.json`.

    Both Hugging Face and the toolkit read this layout."""
    from toolkit.model_dir import WEIGHTS_FILENAME, WEIGHTS_INDEX_FILENAME, shard_filename, shard_groups

    groups = shard_groups(((t, t.nbytes) for t in tensors), max_shard_bytes)
    if len(groups) == 1:
        write_safetensors(directory / WEIGHTS_FILENAME, groups[0], reader, progress, {"format": "pt"})
        return
    weight_map = {}
    for i, group in enumerate(groups, start=1):
        name = shard_filename(i, len(groups))
        write_safetensors(directory / name, group, reader, progress, {"format": "pt"})
        weight_map.update({t.name: name for t in group})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / WEIGHTS_INDEX_FILENAME).write_text(json.dumps(index, indent=2) + "\n")


_CHUNK_BYTES = 64 << 20


def _write_converted(fd: int, offset: int, t: OutTensor, reader: TensorReader) -> None:
    """Write `t.source` as `t.dtype`, ~64 MiB of source rows at a time, through two reused buffers."""
    import torch

    source = t.source
    assert source is not None
    rows = source.shape[0] if source.shape else 1
    rest = tuple(source.shape[1:])
    row_bytes_in = max(1, source.nbytes // max(rows, 1))
    row_bytes_out = t.nbytes // max(rows, 1)
    step = max(1, min(rows, _CHUNK_BYTES // row_bytes_in))
    in_dtype, out_dtype = torch_dtype(source.dtype), torch_dtype(t.dtype)
    # Reused buffers: fresh allocations of this size are page-faulted (and zeroed) on every use.
    in_buffer = torch.empty(step * row_bytes_in, dtype=torch.uint8) if source.kind == "safetensors" else None
    out_buffer = torch.empty(step * row_bytes_out, dtype=torch.uint8)
    fd_in = reader.fd(source.path) if source.kind == "safetensors" else -1
    for start in range(0, rows, step):
        n = min(rows, start + step) - start
        shape = (n, *rest) if source.shape else ()
        if in_buffer is not None:
            _pread_into(fd_in, in_buffer[: n * row_bytes_in].numpy(), source.offset + start * row_bytes_in, source.path)
            chunk = in_buffer[: n * row_bytes_in].view(in_dtype).reshape(shape)
        else:
            chunk = reader.load_rows(source, start, start + n)
        out = out_buffer[: n * row_bytes_out].view(out_dtype).reshape(shape)
        out.copy_(chunk)
        _pwrite_all(fd, out_buffer[: n * row_bytes_out].numpy(), offset + start * row_bytes_out)


class Progress:
    """A byte-count progress bar on stderr (tqdm when installed, else a plain line)."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.done = total, desc, 0
        try:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr)
        except ImportError:  # pragma: no cover - tqdm comes with huggingface_hub
            self._bar = None

    def update(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        else:  # pragma: no cover
            print(f"\r{self.desc}: {self.done / 2**30:.2f} / {self.total / 2**30:.2f} GiB", end="", file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:  # pragma: no cover
            print(file=sys.stderr)


# ---------------------------------------------------------------------------- validation
def expected_shapes(config: "Config") -> dict[str, tuple[int, ...]]:
    """Toolkit weight name -> shape for `config`, in the order of `GPT(config).state_dict()`.

    Computed from the config alone (building the model, even on the meta device, costs seconds:
    torch's meta-device initialisation imports torch._dynamo); the tests check it against the
    model for every preset. A tied output head is left out: it is the embedding.
    """
    V, E, D, F = config.vocab_size, config.n_embd, config.head_size, config.intermediate_size
    H, G = config.n_head, config.n_query_groups
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (V, E)}

    def norm(prefix: str) -> None:
        shapes[f"{prefix}.weight"] = (E,)
        if config.norm == "layernorm":
            shapes[f"{prefix}.bias"] = (E,)

    def linear(prefix: str, out_features: int, in_features: int, bias: bool) -> None:
        shapes[f"{prefix}.weight"] = (out_features, in_features)
        if bias:
            shapes[f"{prefix}.bias"] = (out_features,)

    for i in range(config.n_layer):
        block = f"blocks.{i}"
        norm(f"{block}.norm_1")
        linear(f"{block}.attn.q_proj", H * D, E, bool(config.attn_qkv_bias))
        linear(f"{block}.attn.k_proj", G * D, E, bool(config.attn_qkv_bias))
        linear(f"{block}.attn.v_proj", G * D, E, bool(config.attn_qkv_bias))
        linear(f"{block}.attn.o_proj", E, H * D, config.bias)
        if not config.shared_attention_norm:
            norm(f"{block}.norm_2")
        if config.mlp == "gelu":
            linear(f"{block}.mlp.fc_in", F, E, config.bias)
            linear(f"{block}.mlp.fc_out", E, F, config.bias)
        else:
            linear(f"{block}.mlp.gate_proj", F, E, config.bias)
            linear(f"{block}.mlp.up_proj", F, E, config.bias)
            linear(f"{block}.mlp.down_proj", E, F, config.bias)
    norm("norm_f")
    linear("lm_head", V, E, config.lm_head_bias)
    if config.tie_embeddings:
        shapes.pop("lm_head.weight")
    return shapes


def format_shape(shape: Iterable[int]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def shape_mismatch(name: str, stored: Iterable[int], implied: Iterable[int], config_file: str) -> UserError:
    have, want = format_shape(stored), format_shape(implied)
    return UserError(f"Shape mismatch for {name!r}: the checkpoint has {have}, {config_file} implies {want}")


def plan_from_hf(
    infos: list[TensorInfo], config: "Config", reader: TensorReader, dtype: Optional[str]
) -> list[OutTensor]:
    """The toolkit tensors to write, in source order; any mismatch is a UserError naming the key."""
    from toolkit.convert import weight_maps

    family = config.family
    expected = expected_shapes(config)
    planned: dict[str, OutTensor] = {}
    embed_shape = (config.vocab_size, config.n_embd)

    def out_dtype(src: str) -> str:
        return DTYPES[dtype] if dtype is not None and src in ("F32", "F16", "BF16") else src

    for info in infos:
        if weight_maps.is_ignored(info.name):
            continue
        target = weight_maps.hf_to_toolkit_name(family, info.name)
        names = target if isinstance(target, tuple) else (target,)
        for name in names:
            if name not in expected and not (name == "lm_head.weight" and config.tie_embeddings):
                raise UserError(
                    f"Weight {info.name!r} (toolkit {name!r}) is not part of a model with this config.json "
                    f"({config.family}, bias={config.bias}, attn_qkv_bias={config.attn_qkv_bias}); check config.json"
                )
            if name in planned:
                raise UserError(f"Weight {info.name!r} maps to {name!r}, which another weight already provides")
        if isinstance(target, tuple):
            sizes = tuple(expected[n][0] for n in names)
            want = (sum(sizes), *expected[names[0]][1:])
            if info.shape != want:
                raise shape_mismatch(info.name, info.shape, want, "config.json")
            cache: dict[str, list] = {}

            last = len(names) - 1

            def part(i: int, info: TensorInfo = info, sizes: tuple = sizes, cache: dict = cache, last: int = last):
                if "parts" not in cache:
                    fused = reader.load(info)
                    cache["parts"] = [
                        p.contiguous() for p in weight_maps.split_fused(fused, family, sizes, config.head_size)
                    ]
                    del fused
                tensor = cache["parts"][i]
                if i == last:
                    cache.clear()
                return tensor.to(torch_dtype(out_dtype(info.dtype)))

            for i, name in enumerate(names):
                planned[name] = OutTensor(
                    name, out_dtype(info.dtype), expected[name], make=lambda i=i, part=part: part(i)
                )
            continue
        name = names[0]
        want = embed_shape if name == "lm_head.weight" and config.tie_embeddings else expected[name]
        if info.shape != want:
            raise shape_mismatch(info.name, info.shape, want, "config.json")
        if name == "lm_head.weight" and config.tie_embeddings:
            continue  # a tied head is the embedding; it is stored once
        planned[name] = OutTensor(name, out_dtype(info.dtype), info.shape, source=info)
    missing = [name for name in expected if name not in planned]
    if missing:
        hf_names = [weight_maps.toolkit_to_hf_name(family, n)[0] for n in missing]
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UserError(f"The checkpoint lacks weight {hf_names[0]!r}{more}, which config.json implies")
    return list(planned.values())


# ---------------------------------------------------------------------------- entry points
def read_hf_config(hf_dir: Path) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise UserError(f"No config.json in {hf_dir}: is this a Hugging Face model directory?")
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"Cannot read {path}: {err}") from None
    if not isinstance(values, dict):
        raise UserError(f"{path} does not hold a JSON object")
    return values


def copy_tokenizer_files(src_dir: Path, dst_dir: Path) -> list[str]:
    """Copy the tokenizer files that `src_dir` has, so that the checkpoint carries its tokenizer."""
    from toolkit.tokenizer import TOKENIZER_FILES

    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src_dir) / name).is_file():
            shutil.copyfile(Path(src_dir) / name, Path(dst_dir) / name)
            copied.append(name)
    return copied


def refuse_existing(out_dir: Path, overwrite: bool) -> None:
    """A UserError when `out_dir` already holds files and `overwrite` is false (checked before any work)."""
    if out_dir.exists() and out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise UserError(
            f"{out_dir} already exists and is not empty; choose another directory or pass --overwrite true."
        )


def check_dirs(src: Path, out_dir: Path, what: str) -> None:
    if not src.exists():
        raise UserError(f"{what} {src} does not exist")
    if not src.is_dir():
        raise UserError(f"{what} {src} is a file; pass the directory that holds it")
    if out_dir.exists() and out_dir.resolve() == src.resolve():
        raise UserError(f"The output directory must differ from the input directory ({src})")
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"Output {out_dir} is a file; choose a directory")


def convert_from_hf(
    hf_dir: Path,
    out_dir: Path,
    model_name: Optional[str] = None,
    dtype: Optional[Literal["float32", "float16", "bfloat16"]] = None,
    overwrite: bool = False,
    max_shard_size: str = "5GB",
) -> Path:
    """Convert a Hugging Face model directory into a toolkit checkpoint directory.

    Args:
        hf_dir: Directory with config.json and model.safetensors (or its sharded index, or
            pytorch_model.bin files), plus tokenizer files.
        out_dir: Directory to create: model.safetensors, model_config.json, tokenizer files.
        model_name: Preset name to check the config against, or a name for a custom model.
            Default: the matching preset, else the name of `hf_dir`.
        dtype: Store floating-point weights as float32, float16 or bfloat16. Default: as stored.
        overwrite: Replace `out_dir` if it already holds files.
        max_shard_size: Largest weights file, like "5GB" (10^9 bytes) or "4GiB"; bigger models are
            split into model-0000N-of-0000M.safetensors with model.safetensors.index.json.

    Returns:
        out_dir.
    """
    return convert_hf_dir(hf_dir, out_dir, model_name, dtype, overwrite, default_name=None, max_shard_size=max_shard_size)


def convert_hf_dir(
    hf_dir: Path,
    out_dir: Path,
    model_name: Optional[str],
    dtype: Optional[str],
    overwrite: bool,
    default_name: Optional[str],
    max_shard_size: str = "5GB",
) -> Path:
    """`convert_from_hf`, naming a model that matches no preset `default_name` (default: the directory's name)."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    check_dirs(hf_dir, out_dir, "Hugging Face model directory")
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"Unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    limit = parse_size(max_shard_size)
    refuse_existing(out_dir, overwrite)

    from toolkit.model_dir import atomic_directory
    from toolkit.convert.hf_config import config_from_hf

    config = config_from_hf(read_hf_config(hf_dir), model_name, default_name=default_name or hf_dir.resolve().name)
    files = find_hf_weights(hf_dir)
    reader = TensorReader()
    try:
        planned = plan_from_hf(read_headers(files), config, reader, dtype)
        with atomic_directory(out_dir, overwrite=overwrite) as tmp:
            progress = Progress(sum(t.nbytes for t in planned), f"{default_name or hf_dir.name} -> toolkit")
            try:
                write_weight_files(tmp, planned, limit, reader, progress)
            finally:
                progress.close()
            config.save(tmp)
            copy_tokenizer_files(hf_dir, tmp)
    finally:
        reader.close()
    return out_dir
