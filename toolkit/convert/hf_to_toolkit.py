"""Hugging Face checkpoint -> toolkit checkpoint, streamed tensor by tensor.

    toolkit convert_from_hf <hf_dir> <out_dir>

Reads `model.safetensors`, a sharded `model.safetensors.index.json`, or (when there is no
safetensors file) `pytorch_model.bin` / `pytorch_model.bin.index.json`. Everything is checked
before a byte is written: every weight name must be known, every shape must match config.json,
nothing may be missing. The output is written into a temporary directory that is renamed into
place at the end (`toolkit.model_dir.atomic_directory`).

Memory: the output is written header first and then one tensor after the other
(`toolkit.safetensors_io.SafetensorsShards`), so that nothing has to be held in memory at once. A
tensor whose bytes are only renamed (the usual case) is copied from file to file by the kernel
(`copy_file_range`) without passing through this process. A dtype conversion goes ~64 MiB of rows
at a time; only a fused tensor (GPT-NeoX's query/key/value, Phi-3's qkv_proj and gate_up_proj) is
materialised whole (one at a time). An expert tensor of a mixture of experts, (X, 2I, C), is put
together from its Hugging Face parts (one tensor per expert and projection in the hub's layout,
or one per layer as gpt-oss's, MXFP4-quantized ones dequantized then) one expert at a time, so
that one expert's weights are in memory, not a layer's.
`.bin` shards are memory-mapped one at a time.

The plan and writer here (`OutTensor`, `write_weight_files`) are shared with `toolkit_to_hf`.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Literal, Optional, Union

from toolkit.errors import UserError
from toolkit.safetensors_io import (
    DTYPE_SIZES,
    SafetensorsShards,
    TensorInfo,
    numel,
    read_header,
    read_index,
    read_rows,
    st_dtype,
    torch_dtype,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from toolkit.models.config import Config

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"

# --dtype choices
DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


# ---------------------------------------------------------------------------- reading
def _torch_load(path: Path) -> dict:
    """The tensors of a PyTorch .bin file, memory-mapped (torch's weights-only loader: no code runs)."""
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


def find_hf_weights(hf_dir: Path) -> list[Path]:
    """The weight files of a Hugging Face model directory; safetensors preferred over .bin."""
    hf_dir = Path(hf_dir)
    if (hf_dir / SAFETENSORS_INDEX).is_file():
        return read_index(hf_dir / SAFETENSORS_INDEX)
    if (hf_dir / SAFETENSORS_SINGLE).is_file():
        return [hf_dir / SAFETENSORS_SINGLE]
    shards = sorted(hf_dir.glob("model-*-of-*.safetensors"))
    if shards:
        return shards
    if (hf_dir / BIN_INDEX).is_file():
        return read_index(hf_dir / BIN_INDEX, suffix=".bin")
    if (hf_dir / BIN_SINGLE).is_file():
        return [hf_dir / BIN_SINGLE]
    raise UserError(
        f"No weights in {hf_dir}: expected {SAFETENSORS_SINGLE}, {SAFETENSORS_INDEX}, {BIN_SINGLE} or {BIN_INDEX}"
    )


def read_headers(files: list[Path]) -> list[TensorInfo]:
    """The tensors of safetensors or .bin files, in file order; a name in two files is a UserError."""
    infos: list[TensorInfo] = []
    seen: dict[str, Path] = {}
    for path in files:
        for info in read_header(path) if path.name.endswith(".safetensors") else read_bin_header(path):
            if info.name in seen:
                raise UserError(f"Weight {info.name!r} appears twice: in {seen[info.name].name} and {path.name}")
            seen[info.name] = path
            infos.append(info)
    return infos


class TensorReader:
    """Reads source tensors: safetensors through `toolkit.safetensors_io`, .bin shards mapped one at a time."""

    def __init__(self) -> None:
        self._bin: tuple[Optional[Path], dict] = (None, {})

    def load(self, info: TensorInfo) -> "torch.Tensor":
        """The tensor itself (a fresh CPU tensor, or a memory-mapped one for .bin)."""
        return self.load_rows(info, 0, info.shape[0] if info.shape else 1)

    def load_rows(self, info: TensorInfo, start: int, stop: int) -> "torch.Tensor":
        """Rows start:stop of the tensor (along the first dimension); all of a 0-d tensor."""
        if info.kind == "safetensors":
            return read_rows(info, start, stop)
        if self._bin[0] != info.path:
            self._bin = (None, {})  # drop the previous shard before mapping the next
            self._bin = (info.path, _torch_load(info.path))
        tensor = self._bin[1][info.name]
        return tensor[start:stop] if info.shape else tensor

    def close(self) -> None:
        self._bin = (None, {})


# ---------------------------------------------------------------------------- writing
@dataclass
class OutTensor:
    """One tensor of an output safetensors file and how to produce its bytes.

    Exactly one of `source`, `make` or `rows` is set. `source`: a stored tensor, copied by the kernel
    when it is a safetensors byte range of the same dtype, else converted a slice of rows at a time.
    `make`: a function that builds the whole tensor (fused tensors). `rows`: a function that yields
    the tensor's consecutive dim-0 slices (an expert tensor, one expert at a time).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    source: Optional[TensorInfo] = None
    make: Optional[Callable[[], "torch.Tensor"]] = None
    rows: Optional[Callable[[], Iterator["torch.Tensor"]]] = None

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * DTYPE_SIZES[self.dtype]


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


# Source rows converted to another dtype per read (see `write_weight_files`).
_CHUNK_BYTES = 64 << 20


def write_weight_files(
    directory: Path,
    tensors: list[OutTensor],
    max_shard_bytes: int,
    reader: TensorReader,
    progress: Optional["Progress"] = None,
) -> None:
    """`directory/model.safetensors`, or, for tensors over `max_shard_bytes` in all, consecutive groups
    of at most that many bytes (a bigger tensor gets a file of its own) in
    `model-0000K-of-0000N.safetensors` with Hugging Face's `model.safetensors.index.json`; the
    tensors in the order of `tensors` (`toolkit.safetensors_io.SafetensorsShards`).

    Each tensor is written in turn, never all in memory: a stored tensor of the same dtype is
    copied by the kernel, one of another dtype is converted `_CHUNK_BYTES` of source rows at a
    time, a made one (fused) is built whole, an expert tensor one expert at a time. Both Hugging
    Face and the toolkit read this layout."""
    specs = {t.name: (torch_dtype(t.dtype), t.shape) for t in tensors}
    files = SafetensorsShards(directory, specs, max_shard_bytes, metadata={"format": "pt"}, keep_order=True)
    by_name = {t.name: t for t in tensors}
    try:
        for name in files.order:
            t = by_name[name]
            if t.rows is not None:
                for chunk in t.rows():
                    files.append(name, chunk)
                    del chunk
            elif t.source is not None and t.source.kind == "safetensors" and t.source.dtype == t.dtype:
                files.copy(name, t.source)
            elif t.source is not None and t.nbytes and t.shape:
                rows = t.shape[0]
                step = max(1, min(rows, _CHUNK_BYTES // max(1, t.source.nbytes // rows)))
                for start in range(0, rows, step):
                    chunk = reader.load_rows(t.source, start, min(rows, start + step))
                    files.append(name, chunk.to(specs[name][0]))
                    del chunk
            else:
                tensor = reader.load(t.source).to(specs[name][0]) if t.source is not None else t.make()  # type: ignore[misc]
                if tuple(tensor.shape) != t.shape or st_dtype(tensor.dtype) != t.dtype:
                    made = f"{tuple(tensor.shape)} {tensor.dtype}"
                    raise AssertionError(f"{t.name}: made {made}, planned {t.shape} {t.dtype}")
                files.write(name, tensor)
                del tensor
            if progress is not None:
                progress.update(t.nbytes)
    except BaseException:
        files.discard()
        raise
    files.close()


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

    Read off the model built on the meta device (no memory; about a second for a 70B, once per
    conversion), so that the converters check against the model itself, never a second description
    of it. A tied output head is left out: it is the embedding.
    """
    import torch

    from toolkit.models.gpt import GPT

    with torch.device("meta"):
        model = GPT(config)
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
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
    # expert tensor -> its parts: (part, stored or quantized tensor)
    experts: dict[str, list[tuple[weight_maps.ExpertPart, Union[TensorInfo, QuantizedTensor]]]] = {}
    embed_shape = (config.vocab_size, config.n_embd)

    def out_dtype(src: str) -> str:
        return DTYPES[dtype] if dtype is not None and src in ("F32", "F16", "BF16") else src

    # quantized tensors are dequantized to bfloat16 unless --dtype says otherwise
    quantized = _quantized_sources(infos, family, DTYPES[dtype or "bfloat16"])
    for info in infos:
        if weight_maps.is_ignored(info.name):
            continue
        held = weight_maps.quantized_stem(family, info.name)
        if held is not None:
            if quantized[held[0]].blocks is not info:
                continue  # planned once, at its blocks
            info = quantized[held[0]]  # from here on the tensor its stem names, dequantized
        target = weight_maps.hf_to_toolkit_name(family, info.name)
        if isinstance(info, QuantizedTensor) and not isinstance(target, weight_maps.ExpertPart):
            raise UserError(f"Weight {info.blocks.name!r} is stored quantized ({info.format}), which the toolkit "
                            "reads for expert tensors only")
        if isinstance(target, weight_maps.ExpertPart):
            names: tuple[str, ...] = (target.target,)
        else:
            names = target if isinstance(target, tuple) else (target,)
        for name in names:
            if name not in expected and not (name == "lm_head.weight" and config.tie_embeddings):
                raise UserError(
                    f"Weight {info.name!r} (toolkit {name!r}) is not part of a model with this config.json "
                    f"({config.family}, bias={config.bias}, attn_qkv_bias={config.attn_qkv_bias}); check config.json"
                )
            if name in planned and not (isinstance(target, weight_maps.ExpertPart) and name in experts):
                raise UserError(f"Weight {info.name!r} maps to {name!r}, which another weight already provides")
        if isinstance(target, weight_maps.ExpertPart):
            name = target.target
            want = weight_maps.hf_expert_shape(target, expected[name])
            if info.shape != want:
                raise shape_mismatch(info.name, info.shape, want, "config.json")
            if target.expert is not None and target.expert >= config.n_expert:
                raise UserError(f"Weight {info.name!r} is expert {target.expert}, but config.json has "
                                f"{config.n_expert} experts")
            if name not in experts:
                experts[name] = []
                planned[name] = OutTensor(name, out_dtype(info.dtype), expected[name],
                                          rows=lambda name=name: _expert_rows(planned[name], experts[name], reader))
            elif out_dtype(info.dtype) != planned[name].dtype:
                raise UserError(f"Weight {info.name!r} is {info.dtype}, other parts of {name!r} are not; "
                                "convert with --dtype to store them as one")
            experts[name].append((target, info))
            continue
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
    for name, parts in experts.items():
        _check_expert_cover(name, parts, expected[name], family)
    missing = [name for name in expected if name not in planned]
    if missing:
        # A missing expert tensor is named in the layout the checkpoint's other experts are stored in.
        fused = False
        if any(weight_maps.expert_parts(family, n) for n in missing):
            stored_names = {info.name for info in infos}
            wholes = (weight_maps.hf_whole_expert_tensor(family, n) for n in expected)
            fused = any(whole is not None and whole[0] in stored_names for whole in wholes)
        hf_names = [_hf_name_of(family, n, fused) for n in missing]
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UserError(f"The checkpoint lacks weight {hf_names[0]!r}{more}, which config.json implies")
    return list(planned.values())


def _stored_head_is_the_embedding(infos: list, config: Config, reader: "TensorReader", rows: int = 4096) -> bool:
    """Whether a tied model's stored head (if it stores one) equals its embeddings, compared
    `rows` rows at a time; True when the head is not stored."""
    import torch

    from toolkit.convert import weight_maps

    head = embed = None
    for info in infos:
        if weight_maps.is_ignored(info.name) or weight_maps.quantized_stem(config.family, info.name) is not None:
            continue
        target = weight_maps.hf_to_toolkit_name(config.family, info.name)
        if target == "lm_head.weight":
            head = info
        elif target == "embed.weight":
            embed = info
    if head is None or embed is None:
        return True
    if head.shape != embed.shape:
        return False
    for start in range(0, head.shape[0], rows):
        stop = min(start + rows, head.shape[0])
        if not torch.equal(reader.load_rows(head, start, stop), reader.load_rows(embed, start, stop)):
            return False
    return True


@dataclass(frozen=True)
class QuantizedTensor:
    """A Hugging Face tensor stored quantized (`weight_maps.QUANTIZED_PARTS`; MXFP4 blocks and scales,
    see `toolkit.convert.mxfp4`), read as the tensor its stem names: `name` that name, `shape` and
    `dtype` those it has dequantized. Read like a stored tensor, a slice of dim 0 (an expert) at a time."""

    name: str
    format: str
    blocks: TensorInfo
    scales: TensorInfo
    shape: tuple[int, ...]
    dtype: str

    def load_rows(self, reader: TensorReader, start: int, stop: int) -> "torch.Tensor":
        """Rows start:stop of the dequantized tensor (of the blocks and scales: the same rows)."""
        from toolkit.convert import mxfp4

        return mxfp4.dequantize(reader.load_rows(self.blocks, start, stop), reader.load_rows(self.scales, start, stop),
                                torch_dtype(self.dtype))

    def load(self, reader: TensorReader) -> "torch.Tensor":
        return self.load_rows(reader, 0, self.blocks.shape[0])


def _quantized_sources(infos: list[TensorInfo], family: str, dtype: str) -> dict[str, QuantizedTensor]:
    """Stem name -> the quantized tensor its stored parts hold, dequantized to `dtype`; a part without
    the others, or parts that are not of their format, are a UserError naming them."""
    from toolkit.convert import mxfp4, weight_maps

    found: dict[str, dict[int, TensorInfo]] = {}
    formats: dict[str, str] = {}
    for info in infos:
        held = weight_maps.quantized_stem(family, info.name)
        if held is not None:
            stem, fmt, index = held
            found.setdefault(stem, {})[index] = info
            formats[stem] = fmt
    sources = {}
    for stem, parts in found.items():
        suffixes = weight_maps.QUANTIZED_PARTS[family][formats[stem]]
        absent = [stem + suffix for i, suffix in enumerate(suffixes) if i not in parts]
        if absent:
            raise UserError(f"The checkpoint has {next(iter(parts.values())).name!r} but lacks {absent[0]!r} "
                            f"({formats[stem]} weights come in {' and '.join(suffixes)} parts)")
        blocks, scales = parts[0], parts[1]  # the one format there is: mxfp4
        if blocks.dtype != "U8" or scales.dtype != "U8" or len(blocks.shape) < 3 \
                or blocks.shape[-1] != mxfp4.GROUP // 2 or blocks.shape[:-1] != scales.shape:
            raise UserError(f"{blocks.name!r} {format_shape(blocks.shape)} {blocks.dtype} and {scales.name!r} "
                            f"{format_shape(scales.shape)} {scales.dtype} are not MXFP4 blocks and scales (uint8, "
                            "(..., rows, groups, 16) and (..., rows, groups))")
        sources[stem] = QuantizedTensor(stem, formats[stem], blocks, scales, mxfp4.dequantized_shape(blocks.shape),
                                        dtype)
    return sources


def _hf_name_of(family: str, name: str, fused: bool = False) -> str:
    """The Hugging Face name of a toolkit tensor, for messages (an expert tensor: its first part's,
    or with `fused` the tensor holding every expert, where the family has one)."""
    from toolkit.convert import weight_maps

    whole = weight_maps.hf_whole_expert_tensor(family, name) if fused else None
    if whole is not None:
        return whole[0]
    parts = weight_maps.expert_parts(family, name)
    if parts:
        return parts[0][0].replace("{e}", "0")
    return weight_maps.toolkit_to_hf_name(family, name)[0]


def _check_expert_cover(name: str, parts: list, shape: tuple[int, ...], family: str) -> None:
    """The parts of an expert tensor (X, R, ...) cover each expert's R rows exactly once."""
    from toolkit.convert import weight_maps

    n_expert, rows = shape[0], shape[1]
    spans: list[list[tuple[int, int, str]]] = [[] for _ in range(n_expert)]
    for part, info in parts:
        size = rows if part.block is None else rows // part.blocks
        start = 0 if part.block is None else part.block * size
        for e in range(n_expert) if part.expert is None else (part.expert,):
            spans[e].append((start, start + size, info.name))
    for e, found in enumerate(spans):
        end = 0
        for start, stop, hf_name in sorted(found):
            if start < end:
                raise UserError(f"Weight {hf_name!r} maps to rows of {name!r} (expert {e}) that another weight "
                                "already provides")
            if start > end:
                break
            end = stop
        if end < rows:
            lacking = [hf.replace("{e}", str(e)) for hf, _ in weight_maps.expert_parts(family, name)]
            held = {hf_name for *_, hf_name in found}
            absent = next((hf for hf in lacking if hf not in held), f"rows {end}: of expert {e} of {name}")
            raise UserError(f"The checkpoint lacks weight {absent!r}, which config.json implies")


def _expert_rows(out: OutTensor, parts: list, reader: TensorReader) -> Iterator["torch.Tensor"]:
    """An expert tensor (X, R, ...) from its Hugging Face parts, one expert's (1, R, ...) at a time:
    only that expert's parts are read (rows e of a tensor holding all experts)."""
    import torch

    from toolkit.convert import weight_maps

    n_expert, rows = out.shape[0], out.shape[1]
    own: dict[int, list] = {}
    shared = []
    for part, info in parts:
        (shared if part.expert is None else own.setdefault(part.expert, [])).append((part, info))
    for e in range(n_expert):
        expert = torch.empty(out.shape[1:], dtype=torch_dtype(out.dtype))
        for part, info in [*shared, *own.get(e, [])]:
            if isinstance(info, QuantizedTensor):  # dequantized, expert e's rows alone
                piece = info.load(reader) if part.expert is not None else info.load_rows(reader, e, e + 1)[0]
            else:
                piece = reader.load(info) if part.expert is not None else reader.load_rows(info, e, e + 1)[0]
            start = 0 if part.block is None else part.block * (rows // part.blocks)
            held = weight_maps.expert_rows_from_hf(part, piece)
            expert[start : start + held.shape[0]] = held  # converts the dtype where it differs
            del piece, held
        yield expert[None]


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
        infos = read_headers(files)
        if config.tie_embeddings and not _stored_head_is_the_embedding(infos, config, reader):
            # As transformers loads it: a stored head that differs from the embeddings is not tied to them.
            config = replace(config, tie_embeddings=False)
            print(f"Note: config.json ties the output head to the embeddings, but {hf_dir} stores a different "
                  "lm_head.weight; as in transformers, the head is kept separate (tie_embeddings false).")
        planned = plan_from_hf(infos, config, reader, dtype)
        with atomic_directory(out_dir, overwrite=overwrite, inputs=(hf_dir,)) as tmp:
            progress = Progress(sum(t.nbytes for t in planned), f"{default_name or hf_dir.name} -> toolkit")
            try:
                write_weight_files(tmp, planned, limit, reader, progress)
            finally:
                progress.close()
            config.save(tmp)
            copy_tokenizer_files(hf_dir, tmp)
    finally:
        reader.close()
    _note_tokenizer(out_dir, config)
    return out_dir


def _note_tokenizer(checkpoint_dir: Path, config: Config) -> None:
    """Say, at conversion, what would stop `generate` and fine-tuning later: no tokenizer, or one with
    more tokens than the model has embeddings."""
    from toolkit.tokenizer import Tokenizer, check_tokenizer_fits

    if not (checkpoint_dir / "tokenizer.json").is_file():
        print(f"Note: {checkpoint_dir} has no tokenizer.json (the source had none); add the model's tokenizer "
              "files to it before generating or fine-tuning.")
        return
    try:
        check_tokenizer_fits(Tokenizer(checkpoint_dir), config.vocab_size, str(checkpoint_dir))
    except UserError as problem:
        print(f"Note: {problem} Generation and fine-tuning refuse it until then.")
