"""Resumable, crash-safe training checkpoints.

    <out_dir>/checkpoints/step-00000100/
        state.pt  or  state/     model + optimizer (+ counters): one file, or a sharded folder under FSDP
        rank-<r>.pt              per rank: RNG states and the data loader's position
        model_config.json        so the checkpoint converts to an inference checkpoint on its own
        meta.json                written last: step, run shape, and the size and sha256 of every file

A checkpoint is written into `.step-XXXXXXXX.tmp` next to its final name and renamed when complete,
so a crash (or SIGKILL) mid-save leaves the previous checkpoints untouched; leftovers are removed
by the next save. On resume, every file is checked against meta.json: a truncated or corrupted
newest checkpoint is reported and the previous one is used.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from toolkit.errors import UserError

CHECKPOINT_DIR = "checkpoints"
META = "meta.json"


def checkpoint_root(out_dir: Path) -> Path:
    return Path(out_dir) / CHECKPOINT_DIR


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def list_checkpoints(out_dir: Path) -> list[Path]:
    """Completed checkpoint folders, newest first (temporary folders of interrupted saves excluded)."""
    root = checkpoint_root(out_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and not p.name.endswith(".tmp")]
    return sorted(found, key=lambda p: p.name, reverse=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != META)


def verify(checkpoint: Path) -> Optional[str]:
    """None if every file matches meta.json, else what is wrong."""
    meta_path = checkpoint / META
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError):
        return "meta.json is missing or unreadable (the save did not finish)"
    for rel, expected in meta.get("files", {}).items():
        path = checkpoint / rel
        if not path.is_file():
            return f"{rel} is missing"
        if path.stat().st_size != expected["size"]:
            return f"{rel} is truncated ({path.stat().st_size} of {expected['size']} bytes)"
        if _sha256(path) != expected["sha256"]:
            return f"{rel} is corrupted (checksum mismatch)"
    return None


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(
    fabric, out_dir: Path, model, optimizer, loader, train_state: dict, run_shape: dict, config,
    keep_last: Optional[int], model_filter: Optional[Callable[[str], bool]] = None, tokenizer_dir: Optional[Path] = None,
) -> Path:
    """Write one checkpoint atomically (collective: every rank calls it). Returns its folder.

    `model_filter(name)` keeps only some weights (LoRA keeps its adapters; the frozen base is
    already on disk). Sharded FSDP checkpoints cannot be filtered and keep everything.
    """
    start = time.perf_counter()
    step = train_state["step"]
    root = checkpoint_root(out_dir)
    final = root / step_dir_name(step)
    tmp = root / (step_dir_name(step) + ".tmp")
    if fabric.global_rank == 0:
        for leftover in root.glob("step-*.tmp") if root.is_dir() else []:
            shutil.rmtree(leftover, ignore_errors=True)  # from a save that was interrupted
        tmp.mkdir(parents=True)
    fabric.barrier()

    sharded = _is_sharded(fabric)
    state_path = tmp / ("state" if sharded else "state.pt")
    filter = {"model": lambda name, _: model_filter(name)} if model_filter is not None and not sharded else None
    fabric.save(state_path, {"model": model, "optimizer": optimizer, "train_state": train_state}, filter=filter)
    # Every rank's own RNG and data position (loaders differ per rank).
    extras = {"rng": rng_state(), "loader": loader.state_dict() if hasattr(loader, "state_dict") else None}
    torch.save(extras, tmp / f"rank-{fabric.global_rank}.pt")
    _fault_point("save")
    fabric.barrier()

    if fabric.global_rank == 0:
        config.save(tmp)
        if tokenizer_dir is not None:  # so that convert_pretrained_checkpoint gives a usable model on its own
            from toolkit.tokenizer import TOKENIZER_FILES

            for name in TOKENIZER_FILES:
                if (Path(tokenizer_dir) / name).is_file():
                    shutil.copy2(Path(tokenizer_dir) / name, tmp / name)
        files = {str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in _files(tmp)}
        meta = {"step": step, "train_state": train_state, "run": run_shape, "sharded": sharded,
                "filtered": filter is not None, "files": files}
        _write_atomically(tmp / META, json.dumps(meta, indent=2, default=str))
        if final.exists():  # a re-save of the same step (e.g. the end of a resumed, finished run)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        if keep_last:
            for old in list_checkpoints(out_dir)[keep_last:]:
                shutil.rmtree(old, ignore_errors=True)
    fabric.barrier()
    seconds = time.perf_counter() - start
    fabric.print(f"Saved checkpoint {final} in {seconds:.2f} s")
    fabric.log_dict({"checkpoint/save_seconds": seconds}, step=step)
    return final


_FAULT_COUNTS: dict[str, int] = {}


def _fault_point(name: str) -> None:
    """Crash tests: TOOLKIT_KILL_AT=save (or save:N, the N-th save of this process) kills the
    process with SIGKILL half-way through a save.

    Nothing but the crash-safety tests sets the variable; it exists so they can kill a run at a
    precise point instead of hoping a timer lands inside a save.
    """
    target = os.environ.get("TOOLKIT_KILL_AT", "")
    point, _, nth = target.partition(":")
    if point != name:
        return
    _FAULT_COUNTS[name] = _FAULT_COUNTS.get(name, 0) + 1
    if _FAULT_COUNTS[name] == int(nth or 1):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_sharded(fabric) -> bool:
    return getattr(fabric.strategy, "state_dict_type", "full") == "sharded" and fabric.world_size > 1


def find_resume_checkpoint(fabric, out_dir: Path, resume: Union[bool, str, Path]) -> Optional[Path]:
    """The checkpoint to resume from, or None for a fresh start; checked on rank 0, agreed by all."""
    if resume in (False, "false", "False", None):
        return None
    chosen: Optional[str] = None
    if fabric.global_rank == 0:
        if resume in (True, "true", "True", "auto"):
            for candidate in list_checkpoints(out_dir):
                problem = verify(candidate)
                if problem is None:
                    chosen = str(candidate)
                    break
                fabric.print(f"Checkpoint {candidate} is not usable: {problem}. Falling back to the previous one.")
            if chosen is None and resume != "auto":
                chosen = "!none"
        else:
            path = Path(resume)
            problem = verify(path) if path.is_dir() else f"{path} is not a checkpoint folder"
            chosen = str(path) if problem is None else f"!{problem}"
    chosen = fabric.broadcast(chosen, src=0)
    if chosen == "!none":
        raise UserError(f"--resume true but {checkpoint_root(out_dir)} holds no usable checkpoint; use --resume auto to start fresh.")
    if chosen is not None and chosen.startswith("!"):
        raise UserError(f"Cannot resume from {resume}: {chosen[1:]}.")
    return Path(chosen) if chosen else None


def check_compatible(checkpoint: Path, run_shape: dict) -> None:
    """Refuse to resume a run whose model, global batch or world size differs, saying what differs."""
    saved = json.loads((checkpoint / META).read_text())["run"]
    different = []
    for key, value in run_shape.items():
        old = saved.get(key)
        if old == value:
            continue
        if isinstance(old, dict) and isinstance(value, dict):  # the model config: name the fields
            fields = sorted(k for k in set(old) | set(value) if old.get(k) != value.get(k))
            different += [f"model {k}: checkpoint has {old.get(k)!r}, this run {value.get(k)!r}" for k in fields]
        else:
            different.append(f"{key}: checkpoint has {old!r}, this run {value!r}")
    if different:
        raise UserError(f"Cannot resume from {checkpoint}: " + "; ".join(different) + ". Start a new --out_dir or restore the settings.")


def load(fabric, checkpoint: Path, model, optimizer, loader) -> dict:
    """Restore model, optimizer, this rank's RNG and loader position; returns the saved counters."""
    meta = json.loads((checkpoint / META).read_text())
    state_path = checkpoint / ("state" if meta["sharded"] else "state.pt")
    state = {"model": model, "optimizer": optimizer, "train_state": {}}
    fabric.load(state_path, state, strict=not meta.get("filtered", False), weights_only=True)
    extras = torch.load(checkpoint / f"rank-{fabric.global_rank}.pt", weights_only=True)
    set_rng_state(extras["rng"])
    if extras["loader"] is not None and hasattr(loader, "load_state_dict"):
        loader.load_state_dict(extras["loader"])
    return state["train_state"]
