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

Checksums are computed in parallel: at a save each rank hashes the files it wrote (its `rank-<r>.pt`
and its shard files; rank 0 the rest) and rank 0 gathers the digests into meta.json. On resume the
files are split among the ranks by size, each rank checks its share, and all ranks agree on the
verdict. No rank reads the whole checkpoint.

A checkpoint of a run with a frozen base (LoRA, QLoRA) holds only what trains: in `state.pt` or
`state/` the trainable parameters (the adapters) and their optimizer state, nothing of the base.
meta.json records which base it belongs to, `"frozen_base": {"checkpoint": <path>, "fingerprint":
...}` (`toolkit.model_dir.checkpoint_fingerprint`, cheap at any size); on resume the base is set up
from the run's `checkpoint_dir` as at the start, and `check_frozen_base` refuses one whose
fingerprint differs. Such a checkpoint is 12 bytes per trainable float32 parameter (weight and
AdamW's two moments) and a small overhead per tensor: a Llama-3.1-70B-shaped LoRA of r 8 on query
and value, 16.4M parameters, makes about 197 MB; the bfloat16 base it no longer holds is about
141 GB (tests/test_resume_finetune.py and tests/test_qlora_distributed.py check the bytes of real saves).

A checkpoint resumes on another number of processes (resharding) when the data loader says its
position does not depend on it (`loader.world_size_independent`, true for TextFiles and instruction
data): model and optimizer are resharded (`checkpoint_io.load_resharded`), the data position and the
per-rank counters are converted, and rank r takes the RNG state of saved rank r mod N.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any, Optional, Union

import torch

from toolkit.checkpoint_files import META, check_files, file_digest, read_meta
from toolkit.errors import UserError

CHECKPOINT_DIR = "checkpoints"


def checkpoint_root(out_dir: Path) -> Path:
    return Path(out_dir) / CHECKPOINT_DIR


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def list_checkpoints(out_dir: Path) -> list[Path]:
    """Completed checkpoint folders, the most recently written first (temporary folders of
    interrupted saves excluded).

    Written order, not step order: a run resumed from an older checkpoint while newer ones exist
    writes a new branch of history, and its checkpoints come first although their steps are lower,
    so `--resume auto` continues the branch that was last run, never the abandoned one. Each
    checkpoint's meta.json holds its place in that order (`sequence`); checkpoints of earlier
    versions, without one, come after, by step.
    """
    root = checkpoint_root(out_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and not p.name.endswith(".tmp")]
    return sorted(found, key=lambda p: (_sequence(p), p.name), reverse=True)


def _sequence(checkpoint: Path) -> int:
    meta = read_meta(checkpoint)
    value = meta.get("sequence") if isinstance(meta, dict) else None
    return value if isinstance(value, int) else -1


def saved_seconds(checkpoint: Path) -> Optional[float]:
    """How long writing `checkpoint` took (meta.json's `save_seconds`), or None when it does not say."""
    meta = read_meta(Path(checkpoint))
    value = meta.get("save_seconds") if isinstance(meta, dict) else None
    return float(value) if isinstance(value, (int, float)) else None


def _parent_name(parent: Optional[Path], final: Path) -> Optional[str]:
    """The name meta.json records for `parent`: only a checkpoint in the same folder (a run resumed
    from another run's checkpoint starts a history of its own)."""
    if parent is None or parent.name == final.name or Path(parent).resolve().parent != final.parent.resolve():
        return None
    return parent.name


def abandoned_after(checkpoint: Path, out_dir: Path) -> list[str]:
    """Names of the checkpoints in `out_dir` with a later step than `checkpoint`: resuming from it
    leaves them on another branch of history."""
    step = _step_of(checkpoint)
    return sorted(c.name for c in list_checkpoints(out_dir) if step is not None and (_step_of(c) or -1) > step)


def _step_of(checkpoint: Path) -> Optional[int]:
    match = re.fullmatch(r"step-(\d+)", Path(checkpoint).name)
    return int(match.group(1)) if match else None


def history(checkpoint: Path) -> list[Path]:
    """`checkpoint` and the checkpoints it follows, newest first, along the `parent` links in their
    meta.json (a run's own previous save, or the checkpoint it resumed from), while they exist."""
    chain, seen = [], set()
    current: Optional[Path] = checkpoint
    while current is not None and current.is_dir() and current.name not in seen:
        chain.append(current)
        seen.add(current.name)
        meta = read_meta(current) or {}
        parent, expected = meta.get("parent"), meta.get("parent_sequence")
        current = current.parent / parent if isinstance(parent, str) and "/" not in parent else None
        if current is not None and isinstance(expected, int) and _sequence(current) != expected:
            current = None  # that step was saved again since, on another branch: not this one's parent
    return chain


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != META)


def _verify_together(fabric, checkpoint: Path) -> Optional[str]:
    """None if every file matches meta.json, else what is wrong. Collective: the files are split among
    the ranks by size, each checks its share, and every rank gets the same answer."""
    from toolkit.training.checkpoint_io import gather_objects

    meta = read_meta(checkpoint)
    mine = _shares(meta.get("files", {}), fabric.world_size)[fabric.global_rank] if meta is not None else None
    problems = sorted(p for p in gather_objects(fabric, check_files(checkpoint, mine)) if p is not None)
    return problems[0] if problems else None


def _shares(files: dict[str, dict], world_size: int) -> list[list[str]]:
    """Files per rank for verification, largest first, each to the rank with the fewest bytes so far."""
    shares: list[list[str]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for rel in sorted(files, key=lambda r: (-int(files[r]["size"]), r)):
        rank = loads.index(min(loads))
        shares[rank].append(rel)
        loads[rank] += int(files[rel]["size"])
    return [sorted(share) for share in shares]


# Files whose writer is known from the name: `rank-<r>.pt` (ours) and torch's distributed checkpoint
# shards `__<r>_<i>.distcp`. Anything else (state.pt, .metadata, meta.pt, configs) rank 0 writes.
_WRITER_PATTERNS = (re.compile(r"rank-(\d+)\.pt"), re.compile(r"__(\d+)_\d+\.distcp"))


def _writer_rank(rel: str) -> int:
    name = Path(rel).name
    for pattern in _WRITER_PATTERNS:
        match = pattern.fullmatch(name)
        if match:
            return int(match.group(1))
    return 0


def rng_state() -> dict[str, Any]:
    """This rank's RNG states. On GPUs only the state of this rank's own device is kept: a rank
    draws on no other, and a checkpoint must resume on a host that shows fewer GPUs (8 -> 4)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device's
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        if isinstance(saved, (list, tuple)):
            # Older checkpoints kept every visible device's state; this rank's device is the current one.
            current = torch.cuda.current_device()
            saved = saved[current] if current < len(saved) else saved[0]
        torch.cuda.set_rng_state(saved)  # the current device's


def save(
    fabric, out_dir: Path, model, optimizer, loader, train_state: dict, run_shape: dict, config,
    keep_last: Optional[int], frozen_base: Optional[dict] = None, tokenizer_dir: Optional[Path] = None,
    parent: Optional[Path] = None, resumed_from: Optional[Path] = None,
) -> Path:
    """Write one checkpoint atomically (collective: every rank calls it). Returns its folder.

    `parent`: the checkpoint this one follows in the run's history (the run's previous save, or the
    checkpoint it resumed from). `keep_last` prunes along that history only: the newest
    `keep_last` of it are kept, and so is `resumed_from`; checkpoints on another branch (newer ones
    left behind by resuming from an older checkpoint) are never deleted, and no longer chosen by
    `--resume auto` (`list_checkpoints`). A checkpoint of the same step on that branch is replaced.

    `frozen_base` ({"checkpoint": path, "fingerprint": ...}): the run trains on a frozen base read
    from that checkpoint (LoRA), so only the trainable parameters and the optimizer state are
    written (`checkpoint_io.save_trainable`, sharded or not), and the base is recorded in meta.json.
    """
    start = time.perf_counter()
    step = train_state["step"]
    root = checkpoint_root(out_dir)
    final = root / step_dir_name(step)
    tmp = root / (step_dir_name(step) + ".tmp")
    # Rank-0 work runs through run_on_rank_zero: if it fails (a full disk), every rank stops with
    # its message instead of waiting at a barrier.
    from toolkit.training.checkpoint_io import gather_objects
    from toolkit.training.failures import run_on_rank_zero

    def start_folder() -> None:
        for leftover in root.glob("step-*.tmp") if root.is_dir() else []:
            shutil.rmtree(leftover, ignore_errors=True)  # from a save that was interrupted
        tmp.mkdir(parents=True)

    run_on_rank_zero(fabric, start_folder)

    sharded = _is_sharded(fabric)
    state_path = tmp / ("state" if sharded else "state.pt")
    if frozen_base is not None:
        from toolkit.training.checkpoint_io import save_trainable

        save_trainable(fabric, state_path, model, optimizer, {"train_state": train_state}, sharded)
    else:
        fabric.save(state_path, {"model": model, "optimizer": optimizer, "train_state": train_state})
    # Every rank's own RNG and data position (loaders differ per rank).
    extras = {"rng": rng_state(), "loader": loader.state_dict() if hasattr(loader, "state_dict") else None}
    torch.save(extras, tmp / f"rank-{fabric.global_rank}.pt")
    _fault_point("save")
    fabric.barrier()

    def add_model_files() -> None:
        config.save(tmp)
        if tokenizer_dir is not None:  # so that convert_pretrained_checkpoint gives a usable model on its own
            from toolkit.tokenizer import TOKENIZER_FILES

            for name in TOKENIZER_FILES:
                if (Path(tokenizer_dir) / name).is_file():
                    shutil.copy2(Path(tokenizer_dir) / name, tmp / name)

    run_on_rank_zero(fabric, add_model_files)
    # Each rank hashes the files it wrote (still in its page cache); rank 0 collects the digests.
    mine = {}
    for p in _files(tmp):
        rel = str(p.relative_to(tmp))
        if _writer_rank(rel) == fabric.global_rank:
            mine[rel] = file_digest(p)
    gathered = gather_objects(fabric, mine)

    def complete() -> None:
        files = {rel: digest for digests in gathered for rel, digest in digests.items()}
        for p in _files(tmp):  # a file no rank claimed (a writer rank beyond this world): hash it here
            files.setdefault(str(p.relative_to(tmp)), file_digest(p))
        sequence = 1 + max((_sequence(c) for c in list_checkpoints(out_dir)), default=0)
        parent_name = _parent_name(parent, final)
        parent_sequence = _sequence(parent) if parent_name is not None else None
        if parent is not None and parent_name is None and Path(parent).name == final.name and final.exists():
            # The same step saved again (a finished run started once more): it replaces itself, so it
            # keeps that checkpoint's place in the history, or the older ones would never be pruned.
            replaced = read_meta(final) or {}
            parent_name, parent_sequence = replaced.get("parent"), replaced.get("parent_sequence")
        meta = {"step": step, "train_state": train_state, "run": run_shape, "sharded": sharded,
                "world_size_independent": _world_size_independent(loader), "sequence": sequence,
                "parent": parent_name, "parent_sequence": parent_sequence,
                "save_seconds": round(time.perf_counter() - start, 3),  # all of the save but this file's rename
                "files": dict(sorted(files.items()))}
        if frozen_base is not None:
            meta["frozen_base"] = frozen_base
        _write_atomically(tmp / META, json.dumps(meta, indent=2, default=str))
        if final.exists():  # a re-save of the same step (e.g. the end of a resumed, finished run)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        if keep_last:
            keep = {resumed_from.name} if resumed_from is not None else set()
            for old in history(final)[keep_last:]:
                if old.name not in keep:
                    shutil.rmtree(old, ignore_errors=True)

    run_on_rank_zero(fabric, complete)
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
    """The checkpoint to resume from, or None for a fresh start; verified by all ranks together."""
    if resume in (False, "false", "False", None):
        return None
    if resume in (True, "true", "True", "auto"):
        # Rank 0 lists, so that every rank walks the same candidates.
        candidates = fabric.broadcast([str(p) for p in list_checkpoints(out_dir)] if fabric.global_rank == 0 else None, src=0)
        problems = []
        for candidate in candidates:
            problem = _verify_together(fabric, Path(candidate))
            if problem is None:
                return Path(candidate)
            problems.append(f"{Path(candidate).name}: {problem}")
            if candidate != candidates[-1]:
                fabric.print(f"Checkpoint {candidate} is not usable: {problem}. Falling back to the previous one.")
        if problems:
            # A fresh start here would write its checkpoints over theirs: the user decides.
            raise UserError(
                f"--resume {resume}: none of the {len(problems)} checkpoint(s) in {checkpoint_root(out_dir)} is usable "
                f"({'; '.join(problems)}); nothing was changed. Resume from a good copy with --resume <path>, "
                "or move them away (or use a new --out_dir) to start fresh."
            )
        if resume == "auto":
            return None
        raise UserError(f"--resume true but {checkpoint_root(out_dir)} holds no checkpoint; use --resume auto to start fresh.")
    if not str(resume).strip():
        raise UserError("--resume takes auto, true, false or a checkpoint folder (<out_dir>/checkpoints/step-N), got ''.")
    path = Path(resume)
    is_dir, newest = fabric.broadcast((path.is_dir(), _newest_in_run(path)) if fabric.global_rank == 0 else None, src=0)
    if newest is not None:
        raise UserError(f"Cannot resume from {resume}: it is a run's --out_dir, not one of its checkpoints; give one "
                        f"(its newest is {newest}), or --out_dir {resume} --resume auto for the newest usable one.")
    problem = _verify_together(fabric, path) if is_dir else f"{path} is not a checkpoint folder"
    if problem is not None:
        raise UserError(f"Cannot resume from {resume}: {problem}.")
    return path


def _newest_in_run(path: Path) -> Optional[str]:
    """The newest checkpoint of `path` if it is a run's output folder (with no meta.json of its own), else None."""
    if not path.is_dir() or (path / META).exists():
        return None
    found = list_checkpoints(path)
    return str(found[0]) if found else None


def check_compatible(checkpoint: Path, run_shape: dict) -> None:
    """Refuse to resume a run whose model or batch differs, saying what differs.

    The world size may differ: `load` reshards (or refuses, when the data position cannot follow).
    """
    saved = json.loads((checkpoint / META).read_text())["run"]
    different = []
    for key, value in run_shape.items():
        old = saved.get(key)
        if old == value or key == "world_size" or key not in saved:  # not recorded by older checkpoints
            continue
        if isinstance(old, dict) and isinstance(value, dict):  # the model config, the objective: name the fields
            fields = sorted(k for k in set(old) | set(value) if old.get(k) != value.get(k))
            different += [f"{key} {k}: checkpoint has {old.get(k)!r}, this run {value.get(k)!r}" for k in fields]
        else:
            different.append(f"{key}: checkpoint has {old!r}, this run {value!r}")
    if different:
        raise UserError(f"Cannot resume from {checkpoint}: " + "; ".join(different) + ". Start a new --out_dir or restore the settings.")


def _world_size_independent(loader) -> bool:
    """Whether the loader's sample order and saved position are the same for any number of processes."""
    return bool(getattr(loader, "world_size_independent", False))


# TrainState counters kept per rank: micro-batches, which a rank takes world_size times fewer of.
_PER_RANK_COUNTERS = ("micro_step", "epoch_batches")


def load(fabric, checkpoint: Path, model, optimizer, loader) -> dict:
    """Restore model, optimizer, this rank's RNG and loader position; returns the saved counters.

    A checkpoint written by another number of processes is resharded (see the module docstring),
    or refused with a UserError before anything is loaded when the data position cannot be mapped.
    A checkpoint of what trains (a frozen base's) is read by `checkpoint_io.load_resharded` on any
    number of processes: only the trainable parameters and the optimizer state are loaded.
    """
    meta = json.loads((checkpoint / META).read_text())
    state_path = checkpoint / ("state" if meta["sharded"] else "state.pt")
    trainable_only = "frozen_base" in meta
    strict = not (trainable_only or meta.get("filtered", False))  # "filtered": LoRA checkpoints of earlier versions
    saved_world = int(meta["run"].get("world_size", fabric.world_size))
    world = fabric.world_size
    if saved_world != world and not (meta.get("world_size_independent") and _world_size_independent(loader)):
        raise UserError(
            f"Cannot resume {checkpoint} on {world} process(es): it was saved by {saved_world}, and its data "
            "position is kept per process (as with StreamMix, whose streams litdata shards per process), so it "
            f"cannot continue exactly on another number. Resume on {saved_world} process(es), or start a new --out_dir."
        )
    if meta["sharded"]:
        from toolkit.distributed_checkpoint import check_distributed_checkpoint

        # torch unpickles the folder's metadata and non-tensor entries: checked first, on every rank.
        check_distributed_checkpoint(state_path)
    if trainable_only:
        _check_trainable(checkpoint, state_path, model)
    if saved_world == world and not trainable_only:
        state = {"model": model, "optimizer": optimizer, "train_state": {}}
        fabric.load(state_path, state, strict=strict, weights_only=True)
        train_state = state["train_state"]
        extras = torch.load(checkpoint / f"rank-{fabric.global_rank}.pt", weights_only=True)
    else:
        from toolkit.training.checkpoint_io import load_resharded

        loaded = load_resharded(fabric, state_path, model, optimizer, strict=strict, trainable_only=trainable_only)
        train_state = dict(loaded["train_state"])
        for key in _PER_RANK_COUNTERS:
            train_state[key] = train_state[key] * saved_world // world
        # Every saved rank holds the same loader position (global order); RNG states are per rank.
        extras = torch.load(checkpoint / f"rank-{fabric.global_rank % saved_world}.pt", weights_only=True)
        if saved_world != world:
            fabric.print(
                f"Resharded {checkpoint.name}: saved by {saved_world} process(es), resuming on {world}; model, "
                "optimizer and data position carried over (rank r continues with the RNG state of saved rank r "
                f"mod {saved_world})."
            )
    set_rng_state(extras["rng"])
    if extras["loader"] is not None and hasattr(loader, "load_state_dict"):
        loader.load_state_dict(extras["loader"])
    return train_state


def _check_trainable(checkpoint: Path, state_path: Path, model) -> None:
    """Refuse, in one line, a checkpoint whose trainable parameters (names, shapes) are not the model's."""
    from toolkit.training.checkpoint_io import saved_trainable_shapes, trainable_shapes

    saved, now = saved_trainable_shapes(state_path), trainable_shapes(model)
    if saved == now:
        return
    missing, extra = sorted(set(now) - set(saved)), sorted(set(saved) - set(now))
    reshaped = sorted(n for n in set(now) & set(saved) if now[n] != saved[n])
    if reshaped:
        what = f"{reshaped[0]} is {list(saved[reshaped[0]])} there and {list(now[reshaped[0]])} here"
    elif missing:
        what = f"it has no {missing[0]} ({len(missing)} trainable parameter(s) of this run missing)"
    else:
        what = f"it holds {extra[0]}, which does not train in this run ({len(extra)} in all)"
    raise UserError(
        f"Cannot resume from {checkpoint}: its trainable parameters are not this run's ({what}); resume with the "
        "settings it was saved with (--lora.r, --lora.targets, --quantize), or start a new --out_dir."
    )


def check_frozen_base(checkpoint: Path, frozen_base: dict) -> None:
    """Refuse, in one line, to resume a checkpoint that was trained on another frozen base.

    `frozen_base` is this run's ({"checkpoint", "fingerprint"}). A checkpoint without a record
    (full fine-tuning, pretraining, or a LoRA checkpoint of an earlier version) passes.
    """
    saved = (read_meta(checkpoint) or {}).get("frozen_base")
    if saved is None or saved.get("fingerprint") == frozen_base["fingerprint"]:
        return
    raise UserError(
        f"Cannot resume from {checkpoint}: it was trained on the base checkpoint {saved['checkpoint']} (fingerprint "
        f"{saved['fingerprint']}), but {frozen_base['checkpoint']} holds other weights (fingerprint "
        f"{frozen_base['fingerprint']}); pass {saved['checkpoint']} (or an exact copy) as checkpoint_dir, or start "
        "a new --out_dir."
    )
