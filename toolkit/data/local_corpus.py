"""A corpus that is on every machine that runs the toolkit: the Python standard library's source.

The CPU quick start pretrains on it so that it works offline, on a fresh machine, with nothing to
download. It is real text (code and English docstrings), so the loss falls the way it does on a
real corpus, and samples look recognisably like Python after a few minutes.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from toolkit.data.streams import PretrainData, TextFiles
from toolkit.errors import UserError

# Skipped: tests (huge, repetitive), vendored packages and generated tables.
_SKIP_PARTS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "ensurepip", "__pycache__", "encodings"}


@dataclass
class PythonStdlib(PretrainData):
    """The .py files of this Python's standard library, up to `max_megabytes`, as pretraining text.

    Args:
        max_megabytes: How much source to take, in sorted path order.
        val_fraction: Share of the text held out for validation.
    """

    max_megabytes: float = 4.0
    val_fraction: float = 0.05

    def __post_init__(self) -> None:
        if self.max_megabytes <= 0:
            raise UserError("--data.max_megabytes must be positive")
        if not 0.0 < self.val_fraction < 1.0:
            raise UserError(f"--data.val_fraction must be between 0 and 1, got {self.val_fraction}")
        self._text: Optional[TextFiles] = None

    def source_files(self) -> list[Path]:
        root = Path(sysconfig.get_paths()["stdlib"])
        budget = int(self.max_megabytes * 1e6)
        chosen, total = [], 0
        for path in sorted(root.rglob("*.py")):
            if _SKIP_PARTS.intersection(path.relative_to(root).parts):
                continue
            size = path.stat().st_size
            if total + size > budget:
                break
            chosen.append(path)
            total += size
        if not chosen:
            raise UserError(f"No Python sources found under {root}; pass --data TextFiles --data.train_path <text>.")
        return chosen

    def corpus_dir(self, work_dir: Path) -> Path:
        """A folder of .txt copies (the loaders read .txt and .jsonl), named by what it holds."""
        files = self.source_files()
        digest = hashlib.sha256("\n".join(f"{p}:{p.stat().st_size}" for p in files).encode()).hexdigest()[:12]
        return Path(work_dir) / "corpus" / f"python-stdlib-{digest}"

    def corpus_files(self, work_dir: Path) -> list[Path]:
        target = self.corpus_dir(work_dir)
        if not target.is_dir():
            staging = target.with_name(target.name + f".tmp-{os.getpid()}")
            staging.mkdir(parents=True, exist_ok=True)
            root = Path(sysconfig.get_paths()["stdlib"])
            for i, path in enumerate(self.source_files()):
                name = f"{i:05d}-" + "-".join(path.relative_to(root).with_suffix(".txt").parts)
                text = path.read_text(encoding="utf-8", errors="replace")
                (staging / name).write_text(text, encoding="utf-8")
            os.rename(staging, target)
        return sorted(target.glob("*.txt"))

    def _text_files(self, work_dir: Path) -> TextFiles:
        if self._text is None:
            self.corpus_files(work_dir)
            self._text = TextFiles(train_path=self.corpus_dir(work_dir), val_fraction=self.val_fraction)
        return self._text

    def connect(self, tokenizer, block_size: int, work_dir: Path) -> None:
        self._text_files(work_dir).connect(tokenizer, block_size, work_dir)

    def prepare(self, tokenizer, block_size: int, work_dir: Path) -> None:
        self._text_files(work_dir).prepare(tokenizer, block_size, work_dir)

    def train_dataloader(self, micro_batch_size: int, block_size: int, seed: int, num_workers: int = 0, rank: int = 0, world_size: int = 1):
        return self._text.train_dataloader(micro_batch_size, block_size, seed, num_workers, rank, world_size)

    def val_dataloader(self, micro_batch_size: int, block_size: int, num_workers: int = 0, rank: int = 0, world_size: int = 1):
        return self._text.val_dataloader(micro_batch_size, block_size, num_workers, rank, world_size)
