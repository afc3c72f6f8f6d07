"""Checkpoint conversion: Hugging Face <-> toolkit, and training checkpoint -> inference checkpoint.

    convert_from_hf(hf_dir, out_dir)                    Hugging Face model dir -> toolkit checkpoint
    convert_to_hf(checkpoint_dir, out_dir)              toolkit checkpoint -> Hugging Face model dir
    convert_pretrained_checkpoint(training_checkpoint, out_dir)
                                                        training state -> toolkit checkpoint
    config_from_hf(hf_config) / config_to_hf(config)    config.json <-> Config

Importing this package is cheap: torch, safetensors and transformers are imported by the
functions that need them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from toolkit.errors import UserError

if TYPE_CHECKING:  # pragma: no cover
    from toolkit.convert.hf_config import config_from_hf, config_to_hf
    from toolkit.convert.hf_to_toolkit import convert_from_hf
    from toolkit.convert.toolkit_to_hf import convert_to_hf

__all__ = ["convert_from_hf", "convert_to_hf", "convert_pretrained_checkpoint", "config_from_hf", "config_to_hf"]

_LAZY = {
    "convert_from_hf": "toolkit.convert.hf_to_toolkit",
    "convert_to_hf": "toolkit.convert.toolkit_to_hf",
    "config_from_hf": "toolkit.convert.hf_config",
    "config_to_hf": "toolkit.convert.hf_config",
}

def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'toolkit.convert' has no attribute {name!r}")


def _refuse_frozen_base_checkpoint(folder: Path) -> None:
    """A LoRA run's training checkpoint holds its adapters, not a model: say so in one line."""
    import json

    try:
        base = json.loads((folder / "meta.json").read_text()).get("frozen_base")
    except (OSError, ValueError, AttributeError):
        return
    if base:
        raise UserError(
            f"{folder} is a LoRA training checkpoint: it holds the adapters and their optimizer state, not the "
            f"base weights (those are in {base['checkpoint']}); merge an adapter with `toolkit merge_lora <run out_dir>` "
            "after training, or resume the run with `--resume`."
        )


def _load_training_model_state(training_checkpoint: Path) -> tuple[dict, Path]:
    """(model state dict, directory holding model_config.json) of a training checkpoint.

    Accepted layouts (the training loop's format; adapt here if it changes):
      <dir>/state.pt      torch.save'd {"model": state_dict, "optimizer": ..., ...}
      <dir>/state/        a torch.distributed.checkpoint folder (Fabric FSDP sharded save) with a
                          top-level "model" entry; only that entry is read
      <file>.pt           like state.pt, with model_config.json beside it
    """
    import torch

    from toolkit.models.param_names import unwrapped_name

    path = Path(training_checkpoint)
    if not path.exists():
        raise UserError(f"Training checkpoint {path} does not exist")
    if path.is_file():
        state_file, folder, config_dir = path, None, path.parent
    elif (path / "state.pt").is_file():
        state_file, folder, config_dir = path / "state.pt", None, path
    elif (path / "state").is_dir():
        state_file, folder, config_dir = None, path / "state", path
    else:
        raise UserError(f"{path} is not a training checkpoint: expected state.pt or a state/ folder in it")
    _refuse_frozen_base_checkpoint(config_dir)
    if path.is_dir():
        from toolkit.checkpoint_files import META, check_files

        if path.name.endswith(".tmp"):
            raise UserError(f"{path} is a save that did not finish (.tmp); convert a checkpoint without the suffix")
        if (path / META).exists():  # a training save: every file's size and sha256, as a resume checks them
            problem = check_files(path)
            if problem is not None:
                raise UserError(f"{path} is not usable: {problem}")

    if state_file is not None:
        try:
            checkpoint = torch.load(state_file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as err:  # torch raises several types for damaged files
            raise UserError(f"Cannot read {state_file}: {str(err).splitlines()[0] if str(err) else err!r}") from None
    else:
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        from toolkit.distributed_checkpoint import safe_file_system_reader

        checkpoint = {}
        reader = safe_file_system_reader(folder)  # refuses, in one line, a folder whose pickles would run code
        try:
            _load_state_dict(
                checkpoint,
                storage_reader=reader,
                planner=_EmptyStateDictLoadPlanner(keys={"model"}),  # skip the optimizer state
                no_dist=True,
            )
        except Exception as err:
            raise UserError(f"Cannot read the sharded checkpoint {folder}: {str(err).splitlines()[0]}") from None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("model"), dict):
        raise UserError(f"{path} holds no 'model' state dict; is it a training checkpoint?")
    state = {unwrapped_name(k): v for k, v in checkpoint["model"].items() if isinstance(v, torch.Tensor)}
    return state, config_dir


def convert_pretrained_checkpoint(training_checkpoint: Path, out_dir: Path, overwrite: bool = False) -> Path:
    """Turn a training checkpoint (weights + optimizer state) into an inference checkpoint.

    Args:
        training_checkpoint: A checkpoint directory written during training (model_config.json,
            tokenizer files, and state.pt or a sharded state/ folder), or a .pt file with
            model_config.json beside it.
        out_dir: Directory to create: model.safetensors, model_config.json, tokenizer files.
        overwrite: Replace `out_dir` if it already holds files.

    Returns:
        out_dir.
    """
    from toolkit.convert.hf_to_toolkit import expected_shapes, refuse_existing, shape_mismatch
    from toolkit.model_dir import atomic_directory, save_checkpoint_files
    from toolkit.models.config import Config

    out_dir = Path(out_dir)
    refuse_existing(out_dir, overwrite)
    state, config_dir = _load_training_model_state(Path(training_checkpoint))
    config = Config.from_file(config_dir)
    expected = expected_shapes(config)
    if config.tie_embeddings:
        state.pop("lm_head.weight", None)
    for name, tensor in state.items():
        if name not in expected:
            raise UserError(f"Unexpected weight {name!r} in {training_checkpoint} for {config.name!r}")
        if tuple(tensor.shape) != expected[name]:
            raise shape_mismatch(name, tuple(tensor.shape), expected[name], "model_config.json")
    missing = [name for name in expected if name not in state]
    if missing:
        raise UserError(f"{training_checkpoint} lacks weight {missing[0]!r} ({len(missing)} missing in all)")
    with atomic_directory(out_dir, overwrite=overwrite, inputs=(training_checkpoint,)) as tmp:
        save_checkpoint_files(tmp, state, config, tokenizer_dir=config_dir)
    return out_dir
