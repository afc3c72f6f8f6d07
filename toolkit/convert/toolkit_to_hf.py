"""Toolkit checkpoint -> Hugging Face model directory, streamed tensor by tensor.

    toolkit convert_to_hf <checkpoint_dir> <out_dir>

The result loads with `AutoModelForCausalLM.from_pretrained(out_dir)` and
`AutoTokenizer.from_pretrained(out_dir)` and nothing else (no remote code):

    config.json                          transformers' built-in class for the family
    generation_config.json               BOS/EOS ids (copied when the checkpoint has one)
    model.safetensors                    or model-0000N-of-0000M.safetensors + model.safetensors.index.json
    tokenizer.json, tokenizer_config.json, special_tokens_map.json, tokenizer.model
    chat_template.jinja                  when the checkpoint has one (else the template, if any, is
                                         the "chat_template" of tokenizer_config.json)

Every tensor is stored once (a tied output head is not duplicated). tokenizer_config.json names
`PreTrainedTokenizerFast`, so that transformers encodes with tokenizer.json exactly as the toolkit
did; a model-specific class (e.g. transformers 5's `LlamaTokenizer`) may rebuild the tokenizer and
split some inputs differently.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from toolkit.convert.hf_to_toolkit import (
    OutTensor,
    Progress,
    TensorReader,
    check_dirs,
    expected_shapes,
    read_headers,
    refuse_existing,
    shape_mismatch,
    parse_size,
    write_weight_files,
)
from toolkit.errors import UserError
from toolkit.safetensors_io import TORCH_DTYPE_NAMES, TensorInfo

def plan_to_hf(infos: list[TensorInfo], config, reader: TensorReader) -> list[OutTensor]:
    """The Hugging Face tensors to write, in model order; any mismatch is a UserError naming the key."""
    from toolkit.convert import weight_maps

    family = config.family
    expected = expected_shapes(config)
    stored = {info.name: info for info in infos}
    if config.tie_embeddings and "lm_head.weight" in stored:
        stored.pop("lm_head.weight")  # the same values as the embedding; stored once
    position = {name: i for i, name in enumerate(expected)}
    for name, info in sorted(stored.items(), key=lambda item: position.get(item[0], -1)):  # first error in model order
        if name not in expected:
            raise UserError(f"Unexpected weight {name!r} in {info.path}: the model_config.json has no such parameter")
        if info.shape != expected[name]:
            raise shape_mismatch(name, info.shape, expected[name], "model_config.json")
    missing = [name for name in expected if name not in stored]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UserError(f"The checkpoint lacks weight {missing[0]!r}{more}, which model_config.json implies")

    planned: dict[str, OutTensor] = {}
    for name in expected:
        parts = weight_maps.expert_parts(family, name)
        if parts:
            for out in _expert_tensors(stored[name], parts, reader):
                planned[out.name] = out
            continue
        hf_name, _, n_parts = weight_maps.toolkit_to_hf_name(family, name)
        if n_parts == 1:
            info = stored[name]
            planned[hf_name] = OutTensor(hf_name, info.dtype, info.shape, source=info)
            continue
        if hf_name in planned:
            continue
        # A fused tensor: gather its parts, in the order the map lists them.
        part_names = weight_maps.hf_to_toolkit_name(family, hf_name)
        parts = [stored[p] for p in part_names]
        dtypes = {p.dtype for p in parts}
        if len(dtypes) != 1:
            raise UserError(f"Cannot fuse {', '.join(part_names)} into {hf_name!r}: they have different dtypes")
        shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])

        def make(parts: list[TensorInfo] = parts):
            return weight_maps.fuse([reader.load(p) for p in parts], family, config.head_size)

        planned[hf_name] = OutTensor(hf_name, parts[0].dtype, shape, make=make)
    return list(planned.values())


def _expert_tensors(info: TensorInfo, parts: list, reader: TensorReader) -> list[OutTensor]:
    """The Hugging Face tensors of a toolkit expert tensor (X, R, ...): for the parts held per expert
    (`{e}` in the name), expert 0's, then expert 1's...; each read from that expert's rows alone."""
    from toolkit.convert import weight_maps

    n_expert = info.shape[0]
    out: list[OutTensor] = []
    last: dict[str, Any] = {}  # the expert whose rows were read last, and those rows

    def expert_rows(e: int):
        if last.get("expert") != e:
            last.clear()
            last.update(expert=e, rows=reader.load_rows(info, e, e + 1)[0])
        return last["rows"]

    for hf_name, part in parts:
        if "{e}" in hf_name:
            continue
        shape = weight_maps.hf_expert_shape(part, info.shape)

        def rows(part=part):
            for e in range(n_expert):
                yield weight_maps.expert_rows_to_hf(part, expert_rows(e))[None]

        out.append(OutTensor(hf_name, info.dtype, shape, rows=rows))
    for e in range(n_expert):
        for hf_name, part in parts:
            if "{e}" not in hf_name:
                continue
            one = dataclasses.replace(part, expert=e)
            shape = weight_maps.hf_expert_shape(one, info.shape)
            out.append(OutTensor(hf_name.replace("{e}", str(e)), info.dtype, shape,
                                 make=lambda e=e, one=one: weight_maps.expert_rows_to_hf(one, expert_rows(e))))
    return out


def _special_tokens(checkpoint_dir: Path) -> dict[str, Any]:
    """BOS/EOS/PAD ids and tokens, from the checkpoint's tokenizer files (empty when it has none)."""
    if not (checkpoint_dir / "tokenizer.json").is_file():
        generation = checkpoint_dir / "generation_config.json"
        try:
            values = json.loads(generation.read_text()) if generation.is_file() else {}
        except (OSError, ValueError) as err:
            raise UserError(f"Cannot read {generation}: {err}") from None
        ids = {k: values[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if isinstance(values.get(k), int)}
        return ids
    from tokenizers import Tokenizer as RustTokenizer

    from toolkit.tokenizer import Tokenizer

    tok = Tokenizer(checkpoint_dir)  # a broken tokenizer is a UserError here, before anything is written
    vocab = RustTokenizer.from_file(str(checkpoint_dir / "tokenizer.json"))
    found: dict[str, Any] = {}
    for kind in ("bos", "eos", "pad"):
        token_id = getattr(tok, f"{kind}_id")
        if token_id is not None:
            found[f"{kind}_token_id"] = token_id
            token = vocab.id_to_token(token_id)
            if token is not None:
                found[f"{kind}_token"] = token
    return found


def _write_tokenizer_files(checkpoint_dir: Path, out: Path, special: dict[str, Any]) -> None:
    for name in ("tokenizer.json", "special_tokens_map.json", "tokenizer.model", "chat_template.jinja"):
        if (checkpoint_dir / name).is_file():
            shutil.copyfile(checkpoint_dir / name, out / name)
    config_path = checkpoint_dir / "tokenizer_config.json"
    if not (checkpoint_dir / "tokenizer.json").is_file():
        if config_path.is_file():
            shutil.copyfile(config_path, out / "tokenizer_config.json")
        return
    tok_config: dict[str, Any] = {}
    if config_path.is_file():
        try:
            tok_config = json.loads(config_path.read_text())
        except (OSError, ValueError) as err:
            raise UserError(f"Cannot read {config_path}: {err}") from None
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config.pop("auto_map", None)
    for kind in ("bos", "eos"):
        if tok_config.get(f"{kind}_token") is None and f"{kind}_token" in special:
            tok_config[f"{kind}_token"] = special[f"{kind}_token"]
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")


def convert_to_hf(
    checkpoint_dir: Path,
    out_dir: Path,
    max_shard_size: str = "2GB",
    overwrite: bool = False,
) -> Path:
    """Export a toolkit checkpoint as a Hugging Face model directory (safetensors, no remote code).

    Args:
        checkpoint_dir: A toolkit checkpoint: model.safetensors (or its shards and index),
            model_config.json, tokenizer files.
        out_dir: Directory to create; `AutoModelForCausalLM.from_pretrained(out_dir)` loads it.
        max_shard_size: Largest weight file, like "2GB" (10^9 bytes) or "1GiB"; bigger models are
            split into model-0000N-of-0000M.safetensors with model.safetensors.index.json.
        overwrite: Replace `out_dir` if it already holds files.

    Returns:
        out_dir.
    """
    from toolkit.model_dir import atomic_directory, require_checkpoint_dir
    from toolkit.safetensors_io import weight_files
    from toolkit.convert.hf_config import config_to_hf
    from toolkit.models.config import Config

    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    check_dirs(checkpoint_dir, out_dir, "Checkpoint directory")
    limit = parse_size(max_shard_size)
    refuse_existing(out_dir, overwrite)
    require_checkpoint_dir(checkpoint_dir)
    config = Config.from_file(checkpoint_dir)
    infos = read_headers(weight_files(checkpoint_dir))
    counts = Counter(i.dtype for i in infos if i.dtype in ("F32", "F16", "BF16"))
    dtype = TORCH_DTYPE_NAMES[counts.most_common(1)[0][0]] if counts else None
    hf_config = config_to_hf(config, dtype=dtype)
    special = _special_tokens(checkpoint_dir)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in special:
            hf_config[key] = special[key]
    # No pad token: say so. Left out, transformers takes its class's default (SmolLM3's 128004), which
    # a smaller vocabulary refuses to load and any other makes a padding row that never trains.
    hf_config.setdefault("pad_token_id", None)
    if not (checkpoint_dir / "tokenizer.json").is_file():
        print(f"Warning: {checkpoint_dir} has no tokenizer.json; the export will have no tokenizer.", file=sys.stderr)
    if config.router_z_loss_coef and "router_z_loss_coef" not in hf_config:
        print(f"Note: router_z_loss_coef {config.router_z_loss_coef:g} (a training setting) has no field in Hugging "
              f"Face's {hf_config.get('model_type', config.family)} config and is left out; pass "
              "--train.router_z_loss_coef to train the export with it again.")

    reader = TensorReader()
    try:
        planned = plan_to_hf(infos, config, reader)
        with atomic_directory(out_dir, overwrite=overwrite, inputs=(checkpoint_dir,)) as tmp:
            progress = Progress(sum(t.nbytes for t in planned), f"{checkpoint_dir.name} -> Hugging Face")
            try:
                write_weight_files(tmp, planned, limit, reader, progress)
            finally:
                progress.close()
            (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
            if (checkpoint_dir / "generation_config.json").is_file():
                shutil.copyfile(checkpoint_dir / "generation_config.json", tmp / "generation_config.json")
            else:
                generation = {k: special[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in special}
                (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
            _write_tokenizer_files(checkpoint_dir, tmp, special)
    finally:
        reader.close()
    return out_dir
