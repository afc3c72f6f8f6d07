"""The files of a training checkpoint against its `meta.json`: what `toolkit.training.checkpoint`
writes as a save's last step (size and sha256 of every file) and checks before resuming, and what
`convert_pretrained_checkpoint` checks before converting. Standard library only, so that the
conversion layer can use it without the training loop."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, Optional

META = "meta.json"
MISSING_META = "meta.json is missing or unreadable (the save did not finish)"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_digest(path: Path) -> dict:
    return {"size": path.stat().st_size, "sha256": sha256_of(path)}


def read_meta(checkpoint: Path) -> Optional[dict]:
    try:
        meta = json.loads((Path(checkpoint) / META).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return meta if isinstance(meta, dict) else None


def check_file(checkpoint: Path, rel: str, expected: dict) -> Optional[str]:
    """None if `checkpoint/rel` has the size and sha256 `expected` records, else what is wrong."""
    path = Path(checkpoint) / rel
    if not path.is_file():
        return f"{rel} is missing"
    if path.stat().st_size != expected["size"]:
        return f"{rel} is truncated ({path.stat().st_size} of {expected['size']} bytes)"
    if sha256_of(path) != expected["sha256"]:
        return f"{rel} is corrupted (checksum mismatch)"
    return None


def check_files(checkpoint: Path, names: Optional[Iterable[str]] = None) -> Optional[str]:
    """None if the files `names` (default: every file meta.json lists) match it, else the first problem."""
    meta = read_meta(checkpoint)
    if meta is None:
        return MISSING_META
    files = meta.get("files", {})
    for rel in sorted(files if names is None else names):
        problem = check_file(checkpoint, rel, files[rel])
        if problem is not None:
            return problem
    return None
