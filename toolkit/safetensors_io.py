"""Safetensors files and checkpoints: every read and write of the format in the toolkit goes through here.

    weight_files(dir)              the weights files of a directory: model.safetensors, or the shards
                                   that model.safetensors.index.json names (Hugging Face's layout)
    read_header(path)              names, dtypes, shapes and byte ranges of a file, no data read
    read_tensor / read_rows(info, start, stop) / read_rows_into(info, start, out)
                                   a whole tensor, rows [start, stop) of one, rows into a given tensor
    open_checkpoint(dir)           the same by name over every file of a directory (`SafetensorsReader`)
    load_file / save_file          a whole (small) file, with one-line errors
    SafetensorsStream              one file written a tensor, or rows of one, at a time
    SafetensorsShards              the same over the sharded layout (files of at most 5 GB + index)

Reading goes through the `safetensors` library (`safe_open`, which validates the header and that
the data covers the file exactly, and `get_slice`, which copies only the rows asked for out of a
memory map). Two things it does not do are done here, each for a figure measured by
`benchmarks/safetensors_io.py` (see there, and benchmarks/README.md):

- Writing. `save_file` takes every tensor of the file at once: writing a 1.5 GiB file of 256 MiB
  tensors read one at a time peaked at +1539 MiB with it, +260 MiB (one tensor) with
  `SafetensorsStream`, which writes the header first, then each tensor or rows of it as they come.
- Copying a tensor between files unchanged (`SafetensorsStream.copy`): the kernel copies the byte
  range (`copy_file_range`), so the bytes never enter this process: 1.5 GiB in 0.62 s of CPU and
  +0 MiB, against 0.99 s and +70 MiB through `get_slice` 64 MiB at a time.

Reading rows with `get_slice` measured as fast as `preadv` into the destination (0.22 s against
0.24 s of CPU for a quarter of 1.5 GiB; +22 MiB against +6 MiB), and converting dtypes through it
as fast as the converter's former reused-buffer `preadv` reader (1.39 s against 1.31 s; 1.07 s
against 1.27 s in another run), so both use the library.

Every failure to read is a one-line `UserError`. No pickle is ever loaded. Importing this module
is cheap: torch and safetensors are imported by the functions that use them.
"""

from __future__ import annotations

import json
import os
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, Optional, Sequence

from toolkit.errors import UserError

if TYPE_CHECKING:  # pragma: no cover
    import torch

WEIGHTS_FILENAME = "model.safetensors"
WEIGHTS_INDEX_FILENAME = "model.safetensors.index.json"
# Largest weights file a checkpoint is written in (Hugging Face's default for `save_pretrained`):
# a 70B model in bfloat16 (140 GB) is 28 files, each small enough for the Hub and for a copy to resume.
MAX_SHARD_BYTES = 5 * 10**9

# safetensors dtype names the toolkit reads and writes, with torch's names for them.
TORCH_DTYPE_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1}


def torch_dtype(name: str) -> "torch.dtype":
    """torch's dtype for a safetensors dtype name ("BF16" -> torch.bfloat16)."""
    import torch

    return getattr(torch, TORCH_DTYPE_NAMES[name])


def st_dtype(dtype: "torch.dtype") -> str:
    """The safetensors name of a torch dtype (torch.bfloat16 -> "BF16")."""
    name = str(dtype).removeprefix("torch.")
    for st, torch_name in TORCH_DTYPE_NAMES.items():
        if torch_name == name:
            return st
    raise UserError(f"Tensors of dtype {name} cannot be stored in safetensors by the toolkit")


def numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---------------------------------------------------------------------------- layout
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


def read_index(index_path: Path | str, suffix: str = ".safetensors") -> list[Path]:
    """The files an index (`*.index.json`, Hugging Face's "weight_map") names, in name order.

    An index that cannot be read, that names a file outside its folder or a missing one is a UserError.
    """
    index_path = Path(index_path)
    directory = index_path.parent
    try:
        names = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise UserError(f"Cannot read {index_path}: {err}. The checkpoint is damaged or incomplete.") from None
    files = []
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or not name.endswith(suffix):
            kind = suffix.removeprefix(".")
            raise UserError(f"{index_path} names {name!r}, which is not a {kind} file in {directory}.")
        if not (directory / name).is_file():
            raise UserError(f"{index_path} lists {name}, which is missing: the checkpoint is incomplete.")
        files.append(directory / name)
    return files


def weight_files(directory: Path | str) -> list[Path]:
    """The weights files of a directory: its shards in order when it has an index, else model.safetensors."""
    directory = Path(directory)
    if (directory / WEIGHTS_INDEX_FILENAME).is_file():
        return read_index(directory / WEIGHTS_INDEX_FILENAME)
    return [directory / WEIGHTS_FILENAME]


# ---------------------------------------------------------------------------- reading
@dataclass(frozen=True)
class TensorInfo:
    """Where one stored tensor is: `nbytes` bytes from byte `offset` of the file `path`.

    `kind` is "safetensors", or "bin" for an entry of a PyTorch .bin file (the converter's; offset 0).
    """

    name: str
    dtype: str  # safetensors name: "BF16", "F32", ...
    shape: tuple[int, ...]
    path: Path
    offset: int = 0
    nbytes: int = 0
    kind: str = "safetensors"


def _damaged(path: Path) -> str:
    return f"Cannot read {path}: the file is damaged or incomplete (re-download or re-create it)"


def raw_header(file: Any) -> bytes:
    """The first 8 bytes of an open safetensors file (the header's length) and the header after them,
    as stored; no more than the file holds, and nothing checked (see `read_header`)."""
    size = os.fstat(file.fileno()).st_size
    file.seek(0)
    length = file.read(8)
    header_length = struct.unpack("<Q", length)[0] if len(length) == 8 else 0
    return length + file.read(min(header_length, size))


def read_header(path: Path | str) -> list[TensorInfo]:
    """The tensors of a safetensors file, in file order, without reading their data.

    The library checks the header (JSON, dtypes, shapes, offsets that tile the data) and that the
    file is as long as the header says; whatever it refuses is a one-line UserError.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
        with safe_open(str(path), framework="pt") as handle:
            entries = [(name, handle.get_slice(name)) for name in handle.offset_keys()]
            entries = [(name, s.get_dtype(), tuple(s.get_shape())) for name, s in entries]
    except SafetensorError as err:
        reason = str(err).strip().splitlines()[0]
        if "unknown variant" in reason:  # a dtype safetensors itself does not know
            reason = "a dtype safetensors does not know: " + reason.split("unknown variant", 1)[1].split(",")[0].strip()
        raise UserError(f"{_damaged(path)}: {reason}") from None
    except OSError as err:
        raise UserError(f"{_damaged(path)}: {err}") from None
    # The library has checked that the tensors tile the data in `offset_keys` order.
    offset = 8 + struct.unpack("<Q", head)[0]
    infos = []
    for name, dtype, shape in entries:
        if dtype not in DTYPE_SIZES:
            raise UserError(f"{path}: tensor {name!r} has dtype {dtype}, which the toolkit does not support")
        nbytes = numel(shape) * DTYPE_SIZES[dtype]
        infos.append(TensorInfo(name, dtype, shape, path, offset, nbytes))
        offset += nbytes
    return infos


def read_headers(files: Sequence[Path]) -> dict[str, TensorInfo]:
    """{name: where it is} over several files, in file order; a name in two files is a UserError."""
    found: dict[str, TensorInfo] = {}
    for path in files:
        for info in read_header(path):
            if info.name in found:
                raise UserError(f"Weight {info.name!r} appears twice: in {found[info.name].path.name} and {Path(path).name}")
            found[info.name] = info
    return found


@contextmanager
def _opened(info: TensorInfo) -> Iterator[Any]:
    """`safe_open` on the file of `info`; a file changed or cut short since its header was read is a UserError."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(info.path), framework="pt") as handle:
            yield handle
    except (SafetensorError, OSError) as err:
        raise UserError(f"{_damaged(info.path)}: {str(err).strip().splitlines()[0]}") from None


def read_tensor(info: TensorInfo) -> "torch.Tensor":
    """The whole tensor, a fresh CPU tensor."""
    with _opened(info) as handle:
        return handle.get_tensor(info.name)


def read_rows(info: TensorInfo, start: int = 0, stop: Optional[int] = None,
              inner: Optional[tuple[int, int]] = None) -> "torch.Tensor":
    """Rows [start, stop) (dim 0) of the tensor, a fresh CPU tensor; all of a 0-d tensor. With
    `inner=(first, last)`, only rows [first, last) of dim 1 of each (a rank's part of every expert).

    The file is mapped for this read only: the pages it touched leave the process's resident set
    with the mapping, instead of adding up to the size of the file over many reads.
    """
    if not info.shape:
        return read_tensor(info)
    with _opened(info) as handle:
        stored = handle.get_slice(info.name)
        return stored[start:stop] if inner is None else stored[start:stop, inner[0]:inner[1]]


def read_rows_into(info: TensorInfo, start: int, out: "torch.Tensor", chunk_bytes: int = 16 << 20,
                   inner: Optional[tuple[int, int]] = None) -> "torch.Tensor":
    """Rows [start, start + len(out)) of the tensor (of each, rows `inner` of dim 1, as `read_rows`)
    copied into `out`, `chunk_bytes` at a time, so that no more than that is mapped or allocated at
    once (a rank's shard of a weight). Returns `out`."""
    rows = out.view(out.shape[0] if out.dim() else 1, -1)
    step = max(1, chunk_bytes // max(rows.shape[1] * out.element_size(), 1))
    for first in range(0, rows.shape[0], step):
        last = min(first + step, rows.shape[0])
        chunk = read_rows(info, start + first, start + last, inner)
        rows[first:last].copy_(chunk.reshape(last - first, -1))
        del chunk
    return out


class SafetensorsReader:
    """The tensors of one or more safetensors files (a checkpoint's shards), read by name; `infos`
    maps each name to where it is."""

    def __init__(self, files: Sequence[Path | str]) -> None:
        self.infos = read_headers([Path(f) for f in files])

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def read(self, name: str) -> "torch.Tensor":
        return read_tensor(self.infos[name])

    def read_rows(self, name: str, start: int = 0, stop: Optional[int] = None,
                  inner: Optional[tuple[int, int]] = None) -> "torch.Tensor":
        return read_rows(self.infos[name], start, stop, inner)

    def read_rows_into(self, name: str, start: int, out: "torch.Tensor", chunk_bytes: int = 16 << 20,
                       inner: Optional[tuple[int, int]] = None) -> "torch.Tensor":
        return read_rows_into(self.infos[name], start, out, chunk_bytes, inner)


def open_checkpoint(directory: Path | str) -> SafetensorsReader:
    """The weights of a directory in either layout (model.safetensors, or an index and its shards)."""
    return SafetensorsReader(weight_files(directory))


def load_file(path: Path | str, device: str = "cpu") -> dict[str, "torch.Tensor"]:
    """Every tensor of a safetensors file (small files: all of it is in memory)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file as load

    try:
        return load(str(path), device=device)
    except (SafetensorError, OSError) as err:
        raise UserError(f"{_damaged(Path(path))}: {str(err).strip().splitlines()[0]}") from None


def save_file(tensors: Mapping[str, "torch.Tensor"], path: Path | str, metadata: Optional[dict[str, str]] = None) -> None:
    """Write small tensors (adapters) into one file with the library; big ones go through `SafetensorsStream`.
    The file gets the permissions of any new file (the library creates it readable by its owner only)."""
    from safetensors.torch import save_file as save

    save({name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~current_umask())


def current_umask() -> int:
    """The process's umask: from /proc on Linux; elsewhere by setting it and setting it back, which
    leaves an instant in which another thread's new file would get no mask."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# ---------------------------------------------------------------------------- writing
def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _pread_all(fd: int, view: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise UserError(f"Cannot read {path}: the file ended early (truncated?)")
        done += n


_COPY_CHUNK = 1 << 30


def copy_range(src: Path, src_offset: int, dst_fd: int, dst_offset: int, count: int) -> None:
    """Copy `count` bytes between files in the kernel when it can (copy_file_range), else through a
    64 MiB buffer (another file system, an old kernel)."""
    src_fd = os.open(src, os.O_RDONLY)
    try:
        done = 0
        if hasattr(os, "copy_file_range"):
            try:
                while done < count:
                    n = os.copy_file_range(src_fd, dst_fd, min(count - done, _COPY_CHUNK),
                                           src_offset + done, dst_offset + done)
                    if n <= 0:
                        break
                    done += n
            except OSError:
                pass  # fall back below
        buffer = memoryview(bytearray(min(count - done, 64 << 20)))
        while done < count:
            n = min(len(buffer), count - done)
            _pread_all(src_fd, buffer[:n], src_offset + done, src)
            _pwrite_all(dst_fd, buffer[:n], dst_offset + done)
            done += n
    finally:
        os.close(src_fd)


def _nbytes(dtype: "torch.dtype", shape: Sequence[int]) -> int:
    return numel(shape) * dtype.itemsize


def safetensors_order(specs: Mapping[str, tuple]) -> list[str]:
    """The order `safetensors.torch.save_file` lays these tensors out in (by dtype, then name), read
    off a file of one-element stand-ins with the same names and dtypes, so that it follows the
    installed version."""
    import torch
    from safetensors.torch import save

    stand_ins = save({name: torch.zeros(1, dtype=dtype) for name, (dtype, _) in specs.items()})
    length = struct.unpack("<Q", stand_ins[:8])[0]
    layout = json.loads(stand_ins[8:8 + length])
    layout.pop("__metadata__", None)
    return list(layout)  # stand-ins' offsets grow with this order


def _header(specs: Mapping[str, tuple], order: Sequence[str], metadata: Optional[dict]) -> bytes:
    """The header bytes of a file holding `specs` in `order` (as safetensors writes it: compact JSON,
    padded with spaces so that the data starts 8-byte aligned)."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for name in order:
        dtype, shape = specs[name]
        size = _nbytes(dtype, shape)
        header[name] = {"dtype": st_dtype(dtype), "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class SafetensorsStream:
    """A safetensors file written one tensor at a time: by default equal byte for byte to `save_file`
    of them all.

    `specs` maps each name to (torch dtype, shape). The header is written first; then each tensor's
    bytes follow in `order` (default: the order `save_file` lays them out in), each given whole
    (`write`), in rows (`append`), or copied from another file (`copy`). Only the tensor or rows
    being written are in memory: nothing is buffered.
    """

    def __init__(self, path: Path | str, specs: Mapping[str, tuple], metadata: Optional[dict] = None,
                 order: Optional[Sequence[str]] = None) -> None:
        self._specs = {name: (dtype, tuple(shape)) for name, (dtype, shape) in specs.items()}
        self.order = list(order) if order is not None else safetensors_order(self._specs)
        header = _header(self._specs, self.order, metadata)
        self._next = 0
        self._appended = 0  # bytes of the tensor `order[_next]` written so far
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._offset = len(header)
        _pwrite_all(self._fd, header, 0)

    def _expect(self, name: str, whole: bool) -> tuple:
        expected = self.order[self._next] if self._next < len(self.order) else None
        if name != expected or (whole and self._appended):
            raise ValueError(f"safetensors stream: got {name!r}, expected {expected!r} next")
        return self._specs[name]

    def _put(self, tensor: "torch.Tensor") -> int:
        import torch

        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        if data.numel():
            _pwrite_all(self._fd, data.view(torch.uint8).numpy(), self._offset)
        size = data.numel() * data.element_size()
        self._offset += size
        return size

    def append(self, name: str, rows: "torch.Tensor", inner: bool = False) -> None:
        """Write the next rows (dim 0; with `inner`, of dim 1, the tensor read as (shape[0] *
        shape[1], ...)) of the tensor `name`, in order; the tensor is done when all its bytes are
        written. Lets a tensor be written from pieces that never exist together."""
        dtype, shape = self._expect(name, whole=False)
        total = _nbytes(dtype, shape)
        size = rows.numel() * rows.element_size()
        row_shape = shape[2:] if inner else shape[1:]
        if rows.dtype != dtype or tuple(rows.shape[1:]) != row_shape or self._appended + size > total:
            raise ValueError(f"safetensors stream: rows {rows.dtype} {tuple(rows.shape)} do not continue {name} ({dtype} {shape})")
        self._appended += self._put(rows)
        if self._appended == total:
            self._next, self._appended = self._next + 1, 0

    def write(self, name: str, tensor: "torch.Tensor") -> None:
        dtype, shape = self._expect(name, whole=True)
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"safetensors stream: {name} is {tensor.dtype} {tuple(tensor.shape)}, the header says {dtype} {shape}")
        self._put(tensor)
        self._next += 1

    def copy(self, name: str, source: TensorInfo) -> None:
        """Write `name` as the bytes of a stored tensor of the same dtype and size, copied by the kernel."""
        dtype, shape = self._expect(name, whole=True)
        if source.kind != "safetensors" or source.dtype != st_dtype(dtype) or source.nbytes != _nbytes(dtype, shape):
            raise ValueError(f"safetensors stream: {source.name} ({source.dtype} {source.shape}) is not {name} ({dtype} {shape})")
        copy_range(source.path, source.offset, self._fd, self._offset, source.nbytes)
        self._offset += source.nbytes
        self._next += 1

    def discard(self) -> None:
        """Close the file, written or not (after a failure; the caller removes it)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def close(self) -> None:
        self.discard()
        if self._next != len(self.order):
            raise ValueError(f"safetensors stream: {len(self.order) - self._next} tensor(s) never written")


class SafetensorsShards:
    """A checkpoint's weights written one tensor (or rows of one) at a time, into `directory`.

    `specs` maps each name to (torch dtype, shape), in model order. Up to `max_shard_bytes` of them
    this is one `model.safetensors`; beyond, consecutive tensors (in model order) are grouped into
    files of at most `max_shard_bytes` (a larger tensor gets a file of its own), named and indexed as
    Hugging Face does (`model-0000K-of-0000N.safetensors`, `model.safetensors.index.json`). Within a
    file the tensors come in `save_file`'s order, so that each file is byte for byte `save_file` of
    its tensors, or, with `keep_order`, in the order of `specs`. The tensors are written in `order`:
    file by file. One file is open at a time, and nothing is buffered.
    """

    def __init__(self, directory: Path | str, specs: Mapping[str, tuple], max_shard_bytes: int = MAX_SHARD_BYTES,
                 metadata: Optional[dict] = None, keep_order: bool = False) -> None:
        self.directory, self.metadata = Path(directory), metadata
        nbytes = {name: _nbytes(dtype, shape) for name, (dtype, shape) in specs.items()}
        groups = [{name: (specs[name][0], tuple(specs[name][1])) for name in names}
                  for names in shard_groups(nbytes.items(), max_shard_bytes)]
        self.total_bytes = sum(nbytes.values())
        count = len(groups)
        self.filenames = [WEIGHTS_FILENAME] if count == 1 else [shard_filename(i, count) for i in range(1, count + 1)]
        self._groups = groups
        self._orders = [list(group) if keep_order else safetensors_order(group) for group in groups]
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
            self._stream = SafetensorsStream(self.directory / self.filenames[index], self._groups[index],
                                             self.metadata, order=self._orders[index])
        if self._stream is None:
            raise ValueError(f"safetensors shards: got {name!r}, expected {self.order[0]!r} first")
        return self._stream

    def append(self, name: str, rows: "torch.Tensor", inner: bool = False) -> None:
        """Rows (dim 0, or with `inner` of dim 1) of `name`, in order (see `SafetensorsStream.append`)."""
        self._stream_for(name).append(name, rows, inner)

    def write(self, name: str, tensor: "torch.Tensor") -> None:
        self._stream_for(name).write(name, tensor)

    def copy(self, name: str, source: TensorInfo) -> None:
        self._stream_for(name).copy(name, source)

    def discard(self) -> None:
        """Close the open file, written or not (after a failure; the caller removes the folder)."""
        if self._stream is not None:
            self._stream.discard()

    def close(self) -> None:
        """Closes the last file (every tensor must have been written) and writes the index, if sharded."""
        if self._current != len(self._groups) - 1 or self._stream is None:
            raise ValueError(f"safetensors shards: {len(self._groups) - self._current - 1} file(s) never written")
        self._stream.close()
        if len(self.filenames) > 1:
            weight_map = {name: self.filenames[i] for name, i in sorted(self._file_of.items())}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.directory / WEIGHTS_INDEX_FILENAME).write_text(json.dumps(index, indent=2) + "\n")
