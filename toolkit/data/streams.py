"""Pretraining data: text tokenized once into litdata token streams, read back in fixed-length blocks.

Every loader yields {"input_ids": (B, T), "labels": (B, T)} int64 with T = block_size - 1 and
labels[:, i] == input_ids[:, i + 1] in the source stream. Loaders are plain litdata
`StreamingDataLoader`s, so their `state_dict()` / `load_state_dict()` resume mid-epoch.

- `TextFiles`: local .txt / .jsonl files, tokenized into a cache on first use and reused afterwards.
- `StreamMix`: streams optimized beforehand (local folders or s3://... URLs), mixed by weight.

torch and litdata are imported inside functions so that importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import multiprocessing
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

from toolkit.errors import UserError
from toolkit.safetensors_io import current_umask

if TYPE_CHECKING:
    import torch
    from litdata import StreamingDataLoader, StreamingDataset

    from toolkit.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Bump when the on-disk layout or the way text becomes tokens changes: old caches then stop matching.
_CACHE_VERSION = 1
# .txt files are cut into pieces of about this many bytes (at blank lines when possible). Pieces are
# what the validation split holds out; they are grouped into larger work items for litdata.
_PIECE_BYTES = 4096
# Bytes of text per litdata work item (one item -> one token tensor).
_ITEM_BYTES = 1 << 20
# How litdata starts its workers. fork: they inherit the imported modules (spawn re-imports torch
# per worker, seconds each); fork is safe on Linux only.
_START_METHOD = "fork" if sys.platform == "linux" else "spawn"
# Size of the .bin chunks litdata writes. TokensLoader never reads a block across two chunks, so each
# chunk loses fewer than block_size tokens at its end: keep chunks large.
_CHUNK_BYTES = 64 * 1024 * 1024
# Token dtype on disk (a torch dtype name); 4 bytes fit every vocabulary. Loaders return int64.
_TOKEN_DTYPE = "int32"
_TEXT_SUFFIXES = (".txt", ".jsonl")


# ---------------------------------------------------------------------------------------------------
# Base class and loaders


class PretrainData:
    """Where pretraining tokens come from. Subclasses are dataclasses chosen by jsonargparse.

    Protocol: `prepare` on global rank 0 (tokenizes if needed), a barrier, then `connect` on every
    other rank (cheap: finds what rank 0 prepared), then the dataloaders on every rank.
    """

    def connect(self, tokenizer: "Tokenizer", block_size: int, work_dir: Path) -> None:
        """Locate the prepared data without building anything. Safe to call on every rank."""

    def prepare(self, tokenizer: "Tokenizer", block_size: int, work_dir: Path) -> None:
        """Tokenize if needed (global rank 0 only). block_size = max_seq_length + 1."""
        self.connect(tokenizer, block_size, work_dir)

    def train_dataloader(
        self, micro_batch_size: int, block_size: int, seed: int, num_workers: int = 0, rank: int = 0, world_size: int = 1
    ) -> "StreamingDataLoader":
        """This rank's micro-batches. `rank`/`world_size` are the data-parallel position."""
        raise NotImplementedError

    def val_dataloader(
        self, micro_batch_size: int, block_size: int, num_workers: int = 0, rank: int = 0, world_size: int = 1
    ) -> Optional["StreamingDataLoader"]:
        raise NotImplementedError

    def corpus_files(self, work_dir: Path) -> list[Path]:
        """Plain-text files holding the training text, e.g. to train a tokenizer on."""
        raise UserError(f"{type(self).__name__} has no local text to train a tokenizer on; pass --tokenizer_dir")


def collate_blocks(blocks: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """B blocks of block_size tokens -> input_ids and labels of shape (B, block_size - 1), int64."""
    import torch

    stacked = torch.stack([b.to(torch.int64) for b in blocks])
    return {"input_ids": stacked[:, :-1].contiguous(), "labels": stacked[:, 1:].contiguous()}


def _check_loader_args(micro_batch_size: int, block_size: int, num_workers: int) -> None:
    if micro_batch_size < 1:
        raise UserError(f"micro_batch_size must be at least 1, got {micro_batch_size}")
    if block_size < 2:
        raise UserError(f"block_size (max_seq_length + 1) must be at least 2, got {block_size}")
    if num_workers < 0:
        raise UserError(f"num_workers must be 0 or more, got {num_workers}")


def _token_dataset(
    input_dir: str, block_size: int, shuffle: bool, seed: int, drop_last: Optional[bool]
) -> "StreamingDataset":
    from litdata import StreamingDataset, TokensLoader

    return StreamingDataset(
        input_dir=input_dir,
        item_loader=TokensLoader(block_size=block_size),
        shuffle=shuffle,
        drop_last=drop_last,
        seed=seed,
    )


class _RankSlice:
    """Collate a global micro-batch of (micro x world_size) blocks and keep this rank's rows."""

    def __init__(self, rank: int, micro_batch_size: int) -> None:
        self.start, self.stop = rank * micro_batch_size, (rank + 1) * micro_batch_size

    def __call__(self, blocks: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return collate_blocks(blocks[self.start : self.stop])


def _global_view(dataset: Any) -> Any:
    """Make every rank read the whole stream, in the same order, as a single process would.

    litdata normally gives each rank its own part of the data, so which blocks form an optimizer
    step depends on the world size. Here every rank iterates the stream as if it were alone and
    keeps its rows of each global micro-batch (`_RankSlice`): the blocks of optimizer step k are
    the same for 1 process with accumulation and for N ranks, so a distributed run reproduces a
    single-process run. Each rank decodes N times the tokens it trains on, which is negligible next
    to the model's compute for token data.

    Workaround for litdata 0.2.76, which has no option for this: it reads the world size from
    `dataset.distributed_env`, detected at construction; we replace it with a one-process view.
    """
    from litdata.utilities.env import _DistributedEnv

    dataset.distributed_env = _DistributedEnv(world_size=1, global_rank=0, num_nodes=1)
    return dataset


_GLOBAL_VIEW_LOADER: Optional[type] = None


def _global_view_loader_class() -> type:
    """A StreamingDataLoader whose `load_state_dict` also sees the one-process view.

    Workaround for litdata 0.2.76: `StreamingDataLoader.load_state_dict` detects the world size
    afresh; seeing 2 ranks against a state saved with the one-process view, it switches to its
    "elastic" resume, which does not continue at the same batch. During the call the detected
    environment is replaced by the one-process view (`_global_view`), so the exact path is taken.
    """
    global _GLOBAL_VIEW_LOADER
    if _GLOBAL_VIEW_LOADER is None:
        import litdata.streaming.dataloader as litdata_dataloader
        from litdata import StreamingDataLoader
        from litdata.utilities.env import _DistributedEnv

        class _OneProcessEnv(_DistributedEnv):
            @classmethod
            def detect(cls) -> _DistributedEnv:
                return _DistributedEnv(world_size=1, global_rank=0, num_nodes=1)

        class GlobalViewStreamingDataLoader(StreamingDataLoader):
            @property
            def world_size_independent(self) -> bool:
                """Whether a saved position resumes exactly on another number of processes (see
                `_at_batch_size`): with one reading worker (the trainer's default) it does."""
                return self.num_workers <= 1

            def load_state_dict(self, obj: dict[str, Any]) -> None:
                saved = obj.get("dataset")
                if isinstance(saved, dict) and "drop_last" in saved and saved["drop_last"] != self.dataset.drop_last:
                    # A state saved before TextFiles kept every block (drop_last True): litdata
                    # refuses a mismatch, and the saved order is drop_last's. Resume in that order.
                    self.dataset.set_drop_last(saved["drop_last"])
                detected = litdata_dataloader._DistributedEnv
                litdata_dataloader._DistributedEnv = _OneProcessEnv
                try:
                    super().load_state_dict(_at_batch_size(obj, self.batch_size))
                finally:
                    litdata_dataloader._DistributedEnv = detected

        _GLOBAL_VIEW_LOADER = GlobalViewStreamingDataLoader
    return _GLOBAL_VIEW_LOADER


def _at_batch_size(state: dict[str, Any], batch_size: int) -> dict[str, Any]:
    """A saved global-view loader state, relabelled as read in global micro-batches of `batch_size`.

    Saved by N processes, the loader read global micro-batches of micro_batch_size x N blocks, and
    its position (`num_samples_yielded`: blocks taken from the one global stream) is the same for
    any N. litdata 0.2.76 would see the other batch size as a changed topology and take its
    "elastic" resume; with one reading worker the batch size only groups the same stream, so the
    state is relabelled and litdata replays the exact position.
    """
    dataset = state.get("dataset")
    if not isinstance(dataset, dict) or int(dataset.get("num_workers", 1)) > 1 or dataset.get("batch_size") == batch_size:
        return state
    return dict(state, dataset=dict(dataset, batch_size=batch_size, initial_batch_size=batch_size))


def _loader(
    dataset: Any, micro_batch_size: int, num_workers: int, drop_last: Optional[bool], rank: int = 0, world_size: int = 1,
    global_view: bool = False,
) -> "StreamingDataLoader":
    """drop_last=None keeps the dataset's own setting (StreamingDataLoader would overwrite it).

    With world_size > 1 (or `global_view`) the dataset must be a `_global_view`: the loader reads
    global micro-batches and each rank keeps its slice; its position then resumes on any number of
    processes.
    """
    from litdata import StreamingDataLoader

    loader_class = _global_view_loader_class() if world_size > 1 or global_view else StreamingDataLoader
    loader = loader_class(
        dataset,
        batch_size=micro_batch_size * world_size,
        num_workers=num_workers,
        drop_last=drop_last,
        collate_fn=_RankSlice(rank, micro_batch_size) if world_size > 1 else collate_blocks,
    )
    if drop_last:
        # litdata's drop_last trims each stream's share to whole batches but is not passed on to
        # torch, so a weighted mix that stops when one stream runs out could end on a short batch.
        # DataLoader refuses to set drop_last after __init__; it is read only when iterating.
        object.__setattr__(loader, "drop_last", True)
    return loader


def _val_loader(
    input_dir: str, micro_batch_size: int, block_size: int, num_workers: int, rank: int = 0, world_size: int = 1
) -> "StreamingDataLoader":
    """In order; under data parallelism every rank reads whole global batches (same count everywhere)."""
    if world_size > 1:
        dataset = _global_view(_token_dataset(input_dir, block_size, shuffle=False, seed=0, drop_last=True))
        return _loader(dataset, micro_batch_size, num_workers, drop_last=True, rank=rank, world_size=world_size)
    dataset = _token_dataset(input_dir, block_size, shuffle=False, seed=0, drop_last=None)
    return _loader(dataset, micro_batch_size, num_workers, drop_last=None)


def _check_not_empty(loader: "StreamingDataLoader", what: str, blocks: Optional[int], micro_batch_size: int) -> None:
    if len(loader) == 0:
        have = f"{blocks} block(s) in all" if blocks is not None else "too few blocks"
        raise UserError(
            f"the {what} data gives no full batch of micro_batch_size={micro_batch_size} on this process "
            f"(it has {have}, shared among processes and loader workers); lower micro_batch_size or "
            "max_seq_length, or add data"
        )


# ---------------------------------------------------------------------------------------------------
# Reading text files into units (a .txt piece or a .jsonl record) without loading them whole


@dataclass(frozen=True)
class _Unit:
    """A byte range of one file that becomes one token run. For .jsonl it is one JSON line."""

    file: int
    start: int
    end: int
    bos: bool  # starts a document
    eos: bool  # ends a document


def _list_text_files(path: Path, what: str) -> list[Path]:
    """`path` itself, or the .txt/.jsonl files under the folder `path` (sorted, hidden ones skipped)."""
    if not path.exists():
        raise UserError(f"{what} {path} does not exist; pass a .txt/.jsonl file or a folder of them")
    if path.is_file():
        return [path]
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file()
        and p.suffix.lower() in _TEXT_SUFFIXES
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if not files:
        raise UserError(f"{what} folder {path} has no .txt or .jsonl files; put your text there or pass a file")
    return files


def _is_jsonl(path: Path) -> bool:
    return path.suffix.lower() == ".jsonl"


def _decode_line(path: Path, line: bytes, lineno: int) -> str:
    if b"\x00" in line:
        raise UserError(f"{path} is not a text file (NUL byte on line {lineno}); pass UTF-8 .txt or .jsonl files")
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(
            f"{path} is not UTF-8 text (bad byte on line {lineno}, column {err.start + 1}); convert it to UTF-8"
        ) from err


def _jsonl_text(path: Path, line: bytes, lineno: int, text_key: str) -> str:
    """The `text_key` string of one JSONL line, or a UserError naming the file and line."""
    raw = _decode_line(path, line, lineno)
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as err:
        raise UserError(f"{path}:{lineno} is not valid JSON ({err.msg}: column {err.colno}); each line must be one JSON object") from err
    if not isinstance(record, dict) or text_key not in record:
        keys = ", ".join(sorted(record)[:5]) if isinstance(record, dict) else type(record).__name__
        raise UserError(
            f"{path}:{lineno} has no {text_key!r} field (found: {keys}); set --data.text_key to the field with the text"
        )
    text = record[text_key]
    if not isinstance(text, str):
        raise UserError(f"{path}:{lineno}: field {text_key!r} is {type(text).__name__}, expected a string")
    return text


def _scan_jsonl(path: Path, index: int, text_key: str) -> list[_Unit]:
    units = []
    offset = 0
    with open(path, "rb") as handle:
        for lineno, line in enumerate(handle, start=1):
            start, offset = offset, offset + len(line)
            if not line.strip():
                continue
            if _jsonl_text(path, line, lineno, text_key).strip():
                units.append(_Unit(index, start, offset, bos=True, eos=True))
    return units


def _scan_txt(path: Path, index: int) -> list[_Unit]:
    """Cut a .txt file into ~_PIECE_BYTES pieces, at blank lines when possible, else at any line end.

    The whole file is one document: BOS on its first piece, EOS on its last.
    """
    bounds = []
    start = offset = 0
    has_text = False
    with open(path, "rb") as handle:
        for lineno, line in enumerate(handle, start=1):
            text = _decode_line(path, line, lineno)  # validates every line
            has_text = has_text or bool(text.strip())
            offset += len(line)
            size = offset - start
            if (size >= _PIECE_BYTES and not line.strip()) or size >= 4 * _PIECE_BYTES:
                bounds.append((start, offset))
                start = offset
    if offset > start:
        bounds.append((start, offset))
    if not has_text:
        return []
    last = len(bounds) - 1
    return [_Unit(index, s, e, bos=i == 0, eos=i == last) for i, (s, e) in enumerate(bounds)]


def _scan(files: list[Path], first_index: int, text_key: str) -> list[_Unit]:
    units = []
    for i, path in enumerate(files, start=first_index):
        units.extend(_scan_jsonl(path, i, text_key) if _is_jsonl(path) else _scan_txt(path, i))
    return units


def _group(units: list[_Unit], num_workers: int) -> list[list[_Unit]]:
    """Consecutive units in work items of about _ITEM_BYTES (smaller when needed to feed every worker)."""
    total = sum(u.end - u.start for u in units)
    target = max(1, min(_ITEM_BYTES, total // max(1, 4 * num_workers)))
    groups: list[list[_Unit]] = []
    current: list[_Unit] = []
    size = 0
    for unit in units:
        current.append(unit)
        size += unit.end - unit.start
        if size >= target:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


class _TokenizeItems:
    """litdata `optimize` fn: one work item (list of units) -> one 1-D token tensor.

    Picklable (it holds paths and ids only); each worker process loads the tokenizer once.
    """

    def __init__(self, files: list[str], tokenizer: "Tokenizer", text_key: str):
        self.files = files
        self.tokenizer_dir = str(tokenizer.directory)
        self.text_key = text_key
        # Documents start with BOS only when the tokenizer wants one (llama: yes, GPT-2/NeoX: no).
        self.bos_id = tokenizer.bos_id if tokenizer.add_bos else None
        self.eos_id = tokenizer.eos_id
        self._tokenizer: Optional["Tokenizer"] = None
        # Bytes of text done, shared with forked workers (see `_ProgressReport`); None when not reported.
        self.progress = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokenizer": None, "progress": None}

    def __call__(self, units: list[tuple[int, int, int, bool, bool]]) -> Iterator[torch.Tensor]:
        import torch

        from toolkit.tokenizer import Tokenizer

        if self._tokenizer is None:
            self._tokenizer = Tokenizer(self.tokenizer_dir)
        texts = []
        for file, start, end, _, _ in units:
            path = Path(self.files[file])
            with open(path, "rb") as handle:
                handle.seek(start)
                raw = handle.read(end - start)
            if _is_jsonl(path):
                texts.append(_jsonl_text(path, raw, 0, self.text_key))
            else:
                texts.append(raw.decode("utf-8"))
        ids: list[int] = []
        for (_, _, _, bos, eos), encoded in zip(units, self._tokenizer.encode_batch(texts, bos=False)):
            if bos and self.bos_id is not None:
                ids.append(self.bos_id)
            ids.extend(encoded)
            if eos and self.eos_id is not None:
                ids.append(self.eos_id)
        if self.progress is not None:
            with self.progress.get_lock():
                self.progress.value += sum(end - start for _, start, end, _, _ in units)
        if ids:
            yield torch.tensor(ids, dtype=getattr(torch, _TOKEN_DTYPE))


class _ProgressReport:
    """One line every `interval` seconds while a long tokenization runs: share done, time left.

    litdata's own output (account banners, per-worker messages, its progress bar) is switched off;
    this is the one progress indication left. Workers add the bytes they finish to a shared
    counter; a thread in the parent reads it. Preparations shorter than `interval` print nothing.
    """

    def __init__(self, fn: _TokenizeItems, total_bytes: int, what: str, interval: float = 10.0):
        self.fn, self.total, self.what, self.interval = fn, max(1, total_bytes), what, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "_ProgressReport":
        # Only forked workers inherit the counter; with spawn (not Linux) no progress is shown.
        if _START_METHOD == "fork":
            self.fn.progress = multiprocessing.get_context("fork").Value("q", 0)
            self._start = time.perf_counter()
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.fn.progress = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            done = self.fn.progress.value
            elapsed = time.perf_counter() - self._start
            left = f", about {elapsed * (self.total - done) / done:.0f} s left" if done else ""
            log.info(
                "tokenizing %s: %d%% of %.1f MB after %.0f s%s",
                self.what, 100 * done // self.total, self.total / 1e6, elapsed, left,
            )


# ---------------------------------------------------------------------------------------------------
# Running litdata.optimize safely


def _optimize_units(
    units: list[_Unit], fn: _TokenizeItems, out_dir: Path, scratch: Path, num_workers: int
) -> None:
    """Tokenize `units` into a litdata token stream at `out_dir` (which must not exist yet).

    litdata keeps working files in one folder shared by every process (/tmp/chunks by default), so
    two preparations at once would corrupt each other: point its caches at `scratch` instead. It
    also sets the global multiprocessing start method and leaves DATA_OPTIMIZER_* variables behind,
    and its Ctrl-C handler, which ends the process with exit code 0 (`os._exit(0)`): a training
    that follows in the same process would stop on Ctrl-C silently, as if it had succeeded, and
    leave its tracker runs running. All three are restored afterwards.

    A write that fails in a worker (a full disk) is one UserError naming the error, never a hang
    (`_worker_failures`); a stream whose chunk files are not all there in full is refused.
    """
    from litdata import TokensLoader, optimize

    groups = _group(units, num_workers)
    inputs = [[(u.file, u.start, u.end, u.bos, u.eos) for u in group] for group in groups]
    total_bytes = sum(u.end - u.start for u in units)
    saved_env = {k: v for k, v in os.environ.items() if k.startswith("DATA_OPTIMIZER_")}
    saved_start_method = multiprocessing.get_start_method(allow_none=True)
    saved_sigint = signal.getsignal(signal.SIGINT)
    os.environ["DATA_OPTIMIZER_CACHE_FOLDER"] = str(scratch / "chunks")
    os.environ["DATA_OPTIMIZER_DATA_CACHE_FOLDER"] = str(scratch / "data")
    try:
        with _ProgressReport(fn, total_bytes, out_dir.name), _worker_failures() as failure:
            try:
                optimize(
                    fn=fn,
                    inputs=inputs,
                    output_dir=str(out_dir),
                    num_workers=max(1, min(num_workers, len(inputs))),
                    chunk_bytes=_CHUNK_BYTES,
                    item_loader=TokensLoader(),
                    keep_data_ordered=True,  # a static slice per worker: the stream does not depend on timing
                    start_method=_START_METHOD,
                    verbose=False,
                )
            except Exception:
                if not failure():
                    raise
            if failure():
                # out_dir is <folder>/<staging>/<split>: name the folder the user chose
                raise UserError(f"tokenizing into {out_dir.parent.parent} failed in a worker: {failure()} "
                                "(is the disk full? free space there, or pass another cache_dir)")
    finally:
        for key in [k for k in os.environ if k.startswith("DATA_OPTIMIZER_")]:
            if key not in saved_env:
                del os.environ[key]
        os.environ.update(saved_env)
        multiprocessing.set_start_method(saved_start_method, force=True)
        if saved_sigint is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, saved_sigint)
        shutil.rmtree(scratch, ignore_errors=True)
    if not (out_dir / "index.json").is_file():
        raise RuntimeError(f"litdata.optimize wrote no index.json into {out_dir}")
    for chunk in json.loads((out_dir / "index.json").read_text())["chunks"]:
        path = out_dir / chunk["filename"]
        if not path.is_file() or path.stat().st_size != chunk["chunk_bytes"]:
            raise UserError(f"litdata.optimize left {path} missing or cut short (is the disk full?); "
                            "free space there and run again")


@contextlib.contextmanager
def _worker_failures() -> Iterator[Any]:
    """While litdata.optimize runs: a worker whose work fails (a chunk that cannot be written: a
    full disk) records the error's one line and stops its helper processes; yields a function that
    returns that line ("" while none failed).

    Workaround for litdata 0.2.76: its worker reports the failure on a queue that the parent reads
    only while items remain, and exits through a join on its file-removing helper process, which
    waits forever for a "done" message that the failed worker never sends. A failure while writing
    the last chunk (at the end of every small stream) therefore hung the parent and the worker for
    good. Forked workers inherit the patch and the shared buffer; with spawn (not Linux) nothing
    changes.
    """
    from litdata.processing.data_processor import BaseWorker

    if _START_METHOD != "fork":
        yield lambda: ""
        return
    message = multiprocessing.get_context("fork").Array("c", 1024)
    loop = BaseWorker._loop

    def loop_or_stop_helpers(worker) -> None:
        try:
            loop(worker)
        except BaseException as error:
            text = " ".join(f"{type(error).__name__}: {error}".split())
            message.value = text.encode()[: len(message) - 1]
            helpers = [worker.remover, *worker.uploaders, *worker.downloaders]
            for helper in helpers:  # SIGKILL: they hold nothing to clean, and SIGTERM runs inherited handlers
                if isinstance(helper, multiprocessing.process.BaseProcess) and helper.is_alive():
                    helper.kill()
            raise

    BaseWorker._loop = loop_or_stop_helpers
    try:
        yield lambda: message.value.decode(errors="replace")
    finally:
        BaseWorker._loop = loop


def _stream_stats(stream_dir: Path, block_size: Optional[int] = None) -> tuple[int, int]:
    """(tokens, blocks of block_size) in a local token stream. TokensLoader counts blocks per chunk."""
    index = json.loads((stream_dir / "index.json").read_text())
    dims = [int(chunk.get("dim") or 0) for chunk in index["chunks"]]
    blocks = sum(d // block_size for d in dims) if block_size else 0
    return sum(dims), blocks


def _check_blocks(stream_dir: Path, block_size: int, what: str, source: str) -> None:
    tokens, blocks = _stream_stats(stream_dir, block_size)
    if blocks < 1:
        raise UserError(
            f"the {what} split of {source} has {tokens} tokens, too few for one block of {block_size} "
            f"(max_seq_length + 1); add text or lower max_seq_length"
        )


def _remove_stale_staging(parent: Path, prefix: str) -> None:
    """Delete staging folders `<prefix>-<host>-<pid>-*` left by dead processes on this host."""
    host = socket.gethostname()
    for path in parent.glob(f"{prefix}-*"):
        match = re.fullmatch(re.escape(prefix) + r"-(.+)-(\d+)-[^-]+", path.name)
        if not match or match.group(1) != host:
            continue
        pid = int(match.group(2))
        try:
            os.kill(pid, 0)
            alive = pid != os.getpid()
        except ProcessLookupError:
            alive = False
        except PermissionError:
            alive = True
        if not alive:
            log.info("removing unfinished data preparation at %s", path)
            shutil.rmtree(path, ignore_errors=True)


def _staging_dir(parent: Path, prefix: str) -> Path:
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}-{socket.gethostname()}-{os.getpid()}-", dir=parent))


def _publish(staging: Path, final: Path) -> bool:
    """Rename `staging` to `final`. False (and `staging` removed) when another process got there first."""
    os.chmod(staging, 0o777 & ~current_umask())  # mkdtemp makes 0700
    try:
        os.rename(staging, final)
        return True
    except OSError:
        if final.exists():
            shutil.rmtree(staging, ignore_errors=True)
            return False
        raise


def _fingerprint(files: list[Path]) -> list[list]:
    """Cheap identity of input files: path, size, modification time."""
    out = []
    for path in files:
        st = path.stat()
        out.append([str(path.resolve()), st.st_size, st.st_mtime_ns])
    return out


def _tokenizer_fingerprint(tokenizer: "Tokenizer") -> dict:
    digest = hashlib.sha256((Path(tokenizer.directory) / "tokenizer.json").read_bytes()).hexdigest()
    return {"tokenizer_json": digest, "bos": tokenizer.bos_id, "eos": tokenizer.eos_id, "add_bos": tokenizer.add_bos}


def _jsonl_as_text(path: Path, text_key: str, root: Path) -> Path:
    """`root/<name>-<key>.txt` with the records' text separated by blank lines; made once, atomically."""
    key = hashlib.sha256(json.dumps([_fingerprint([path]), text_key]).encode()).hexdigest()[:16]
    target = root / f"{_slug(path)}-{key}.txt"
    if target.is_file():
        return target
    texts = []
    with open(path, "rb") as handle:
        for lineno, line in enumerate(handle, start=1):
            if line.strip():
                texts.append(_jsonl_text(path, line, lineno, text_key))  # validates before writing
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=root)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write("\n\n".join(texts) + "\n")
    os.replace(tmp, target)
    return target


def _slug(path: Path) -> str:
    name = re.sub(r"[^A-Za-z0-9_.]+", "_", path.stem or path.name or "data").strip("_.")
    return name[:40] or "data"


def optimize_text_to_stream(
    text_files: list[Path] | Path, tokenizer: "Tokenizer", out_dir: Path, text_key: str = "text", num_workers: int = 1
) -> Path:
    """Tokenize .txt/.jsonl files (or folders of them) into a litdata token stream at `out_dir`.

    The result is what `StreamMix` reads (and what `litdata.optimize(..., item_loader=TokensLoader())`
    writes). `out_dir` must not exist or be empty; it appears only once complete. Returns `out_dir`.
    """
    out_dir = Path(out_dir)
    paths = [text_files] if isinstance(text_files, (str, Path)) else list(text_files)
    if not paths:
        raise UserError("no text files given; pass at least one .txt or .jsonl file")
    files: list[Path] = []
    for p in paths:
        files.extend(_list_text_files(Path(p), "text path"))
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(f"{out_dir} already exists and is not an empty folder; choose a new output folder")
    if num_workers < 1:
        raise UserError(f"num_workers must be at least 1, got {num_workers}")
    units = _scan(files, 0, text_key)
    if not units:
        raise UserError(f"no text in {', '.join(map(str, paths))}; pass files with text")

    fn = _TokenizeItems([str(p.resolve()) for p in files], tokenizer, text_key)
    prefix = f".{out_dir.name}.tmp"
    if out_dir.parent.exists():
        _remove_stale_staging(out_dir.parent, prefix)
    staging = _staging_dir(out_dir.parent, prefix)
    try:
        _optimize_units(units, fn, staging / "stream", staging / "scratch", num_workers)
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        os.rename(staging / "stream", out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


# ---------------------------------------------------------------------------------------------------
# TextFiles


@dataclass
class TextFiles(PretrainData):
    """Local text for pretraining, tokenized once into a cache and reused.

    Args:
        train_path: a .txt or .jsonl file, or a folder of them (searched recursively).
        val_path: the same for validation. When unset, `val_fraction` of the documents (at least one)
            is held out: JSONL records, or ~4 KB pieces of .txt files, picked evenly across the corpus.
        val_fraction: share held out when `val_path` is unset.
        text_key: the field with the text in .jsonl records.
        cache_dir: where tokenized data is kept. Default: `<work_dir>/data_cache` (work_dir is the
            run's output folder). Entries are keyed by the input files (path, size, mtime), the
            tokenizer and the split, so any change tokenizes again; point several runs at one
            cache_dir to share it.
        num_workers: processes for tokenizing.

    A .jsonl record is one document; a .txt file is one document (BOS/EOS only at its start and end).
    Text that contains the tokenizer's EOS string (e.g. "<|endoftext|>") gets the EOS id there.
    """

    train_path: Path
    val_path: Optional[Path] = None
    val_fraction: float = 0.05
    text_key: str = "text"
    cache_dir: Optional[Path] = None
    num_workers: int = 1

    def __post_init__(self) -> None:
        self.train_path = Path(self.train_path)
        self.val_path = Path(self.val_path) if self.val_path is not None else None
        self.cache_dir = Path(self.cache_dir) if self.cache_dir is not None else None
        self._entry: Optional[Path] = None
        self._train_files: list[Path] = []
        self._val_files: list[Path] = []
        self._check_args()  # here, so that a bad value is refused before any process starts

    # -- locating ---------------------------------------------------------------------------------

    def _check_args(self) -> None:
        if self.val_path is None and not 0.0 < self.val_fraction < 1.0:
            raise UserError(f"val_fraction must be between 0 and 1, got {self.val_fraction}")
        if self.num_workers < 1:
            raise UserError(f"data num_workers must be at least 1, got {self.num_workers}")

    def connect(self, tokenizer: "Tokenizer", block_size: int, work_dir: Path) -> None:
        self._check_args()
        self._train_files = _list_text_files(self.train_path, "train_path")
        self._val_files = _list_text_files(self.val_path, "val_path") if self.val_path is not None else []
        key_data = {
            "version": _CACHE_VERSION,
            "train": _fingerprint(self._train_files),
            "val": _fingerprint(self._val_files),
            "val_fraction": None if self._val_files else self.val_fraction,
            "text_key": self.text_key,
            "piece_bytes": _PIECE_BYTES,
            "tokenizer": _tokenizer_fingerprint(tokenizer),
        }
        key = hashlib.sha256(json.dumps(key_data, sort_keys=True).encode()).hexdigest()[:16]
        self._entry = self._cache_root(work_dir) / f"{_slug(self.train_path)}-{key}"

    @property
    def data_dir(self) -> Path:
        """The cache entry (with train/ and val/ token streams) found by `connect`/`prepare`."""
        if self._entry is None:
            raise RuntimeError("call prepare() (global rank 0) or connect() (other ranks) before using the data")
        return self._entry

    def _cache_root(self, work_dir: Path) -> Path:
        return self.cache_dir if self.cache_dir is not None else Path(work_dir) / "data_cache"

    def corpus_files(self, work_dir: Path) -> list[Path]:
        """The training text as plain-text files (to train a tokenizer on): .txt files as they are,
        the records of each .jsonl extracted once into a .txt in the cache folder."""
        self._check_args()
        out = []
        for path in _list_text_files(self.train_path, "train_path"):
            out.append(_jsonl_as_text(path, self.text_key, self._cache_root(work_dir)) if _is_jsonl(path) else path)
        return out

    def _is_complete(self) -> bool:
        entry = self.data_dir
        return all((entry / p).is_file() for p in ("meta.json", "train/index.json", "val/index.json"))

    # -- building ---------------------------------------------------------------------------------

    def prepare(self, tokenizer: "Tokenizer", block_size: int, work_dir: Path) -> None:
        self.connect(tokenizer, block_size, work_dir)
        entry = self.data_dir
        if self._is_complete():
            log.info("reusing tokenized data at %s", entry)
            self._check_blocks(entry, block_size)
            return
        if entry.exists():  # entries appear complete (by rename), so this one was tampered with
            log.warning("removing incomplete tokenized data at %s", entry)
            shutil.rmtree(entry)
        self._build(tokenizer, entry, block_size)

    def _check_blocks(self, root: Path, block_size: int) -> None:
        for split in ("train", "val"):
            _check_blocks(root / split, block_size, split, self._source(split))

    def _source(self, split: str) -> str:
        return str(self.val_path if split == "val" and self.val_path is not None else self.train_path)

    def _split(self) -> tuple[list[_Unit], list[_Unit]]:
        """Validate every file (UTF-8, JSON) and cut the corpus into train and val units."""
        train = _scan(self._train_files, 0, self.text_key)
        if not train:
            raise UserError(f"train_path {self.train_path} has no text; pass files with text")
        if self._val_files:
            val = _scan(self._val_files, len(self._train_files), self.text_key)
            if not val:
                raise UserError(f"val_path {self.val_path} has no text; pass files with text")
            return train, val
        n = len(train)
        if n < 2:
            raise UserError(
                f"train_path {self.train_path} is one short document ({train[0].end - train[0].start} bytes), "
                "too little to hold out validation data; add text or pass --data.val_path"
            )
        n_val = min(n - 1, max(1, round(n * self.val_fraction)))
        # Evenly spaced picks: deterministic, and spread over every file rather than taking its tail.
        picks = {int((i + 0.5) * n / n_val) for i in range(n_val)}
        return [u for i, u in enumerate(train) if i not in picks], [u for i, u in enumerate(train) if i in picks]

    def _build(self, tokenizer: "Tokenizer", entry: Path, block_size: int) -> None:
        started = time.perf_counter()
        train, val = self._split()  # raises on bad input before anything is written
        files = [str(p.resolve()) for p in self._train_files + self._val_files]
        fn = _TokenizeItems(files, tokenizer, self.text_key)
        prefix = f".{entry.name}.tmp"
        if entry.parent.exists():
            _remove_stale_staging(entry.parent, prefix)
        log.info(
            "tokenizing %d file(s) from %s into %s (%d train / %d val units)",
            len(files), self.train_path, entry, len(train), len(val),
        )
        staging = _staging_dir(entry.parent, prefix)
        try:
            _optimize_units(train, fn, staging / "train", staging / "scratch", self.num_workers)
            _optimize_units(val, fn, staging / "val", staging / "scratch", 1)  # small: one worker
            self._check_blocks(staging, block_size)  # too small: raise before anything is published
            meta = {
                "train_path": str(self.train_path),
                "val_path": str(self.val_path) if self.val_path is not None else None,
                "val_fraction": None if self._val_files else self.val_fraction,
                "tokenizer": str(tokenizer.directory),
                "train_tokens": _stream_stats(staging / "train")[0],
                "val_tokens": _stream_stats(staging / "val")[0],
                "seconds": round(time.perf_counter() - started, 2),
            }
            (staging / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            with contextlib.suppress(OSError):
                entry.parent.rmdir()  # only if empty: leave no trace of a failed first preparation
            raise
        if _publish(staging, entry):
            log.info("tokenized data ready at %s (%d train tokens)", entry, meta["train_tokens"])
        else:
            log.info("another process prepared the same data at %s; using it", entry)

    # -- loading ----------------------------------------------------------------------------------

    def train_dataloader(
        self, micro_batch_size: int, block_size: int, seed: int, num_workers: int = 0, rank: int = 0, world_size: int = 1
    ) -> "StreamingDataLoader":
        """Shuffled blocks; with world_size > 1 in the same global order as one process (see `_global_view`).

        litdata shuffles the blocks it keeps, and with its drop_last it keeps whole batches only, so
        the order would depend on the batch size read (micro x world_size): 527 blocks are shuffled
        as 526 by one process and as 524 by two. So litdata keeps every block (one order for any
        world size) and the loader drops the last, incomplete global micro-batch instead."""
        _check_loader_args(micro_batch_size, block_size, num_workers)
        dataset = _global_view(_token_dataset(str(self.data_dir / "train"), block_size, shuffle=True, seed=seed, drop_last=None))
        dataset.set_drop_last(False)
        loader = _loader(
            dataset, micro_batch_size, num_workers, drop_last=None, rank=rank, world_size=world_size, global_view=True
        )
        object.__setattr__(loader, "drop_last", True)  # torch's: read when iterating and by len()
        blocks = _stream_stats(self.data_dir / "train", block_size)[1]
        _check_not_empty(loader, "training", blocks, micro_batch_size * world_size)
        return loader

    def val_dataloader(
        self, micro_batch_size: int, block_size: int, num_workers: int = 0, rank: int = 0, world_size: int = 1
    ) -> "StreamingDataLoader":
        _check_loader_args(micro_batch_size, block_size, num_workers)
        loader = _val_loader(str(self.data_dir / "val"), micro_batch_size, block_size, num_workers, rank, world_size)
        blocks = _stream_stats(self.data_dir / "val", block_size)[1]
        _check_not_empty(loader, "validation", blocks, micro_batch_size * world_size)
        return loader


# ---------------------------------------------------------------------------------------------------
# StreamMix


def _is_remote(url: str) -> bool:
    return "://" in url and not url.startswith("file://")


def _local(url: str) -> str:
    return url[len("file://"):] if url.startswith("file://") else url


def _check_stream(url: str, what: str) -> None:
    if _is_remote(url):
        return  # litdata streams it; checking would need credentials and a round trip
    path = Path(_local(url))
    how = (
        "make one with toolkit.data.streams.optimize_text_to_stream (as TextFiles does) "
        "or litdata.optimize(..., item_loader=TokensLoader())"
    )
    if not path.is_dir():
        raise UserError(f"{what} {url} is not a folder; it should be a tokenized litdata stream: {how}")
    if not (path / "index.json").is_file():
        raise UserError(f"{what} {url} has no index.json, so it is not a litdata stream: {how}")


@dataclass
class StreamMix(PretrainData):
    """Token streams optimized beforehand, mixed by weight.

    Args:
        train_streams: litdata token streams (made with TokensLoader): local folders or URLs such as
            s3://bucket/prefix, which litdata streams directly.
        weights: sampling weight of each stream (normalized). Default: proportional to stream size.
            With weights, an epoch ends when any stream runs out.
        val_stream: a stream for validation; None means no validation data.
        seed: overrides the training seed for shuffling and for picking streams, when set.
    """

    train_streams: list[str]
    weights: Optional[list[float]] = None
    val_stream: Optional[str] = None
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        self.train_streams = [str(s) for s in self.train_streams]
        self.val_stream = str(self.val_stream) if self.val_stream is not None else None

    def connect(self, tokenizer: "Tokenizer", block_size: int, work_dir: Path) -> None:
        if not self.train_streams:
            raise UserError("StreamMix needs at least one entry in train_streams")
        if self.weights is not None:
            if len(self.weights) != len(self.train_streams):
                raise UserError(
                    f"StreamMix has {len(self.train_streams)} train_streams but {len(self.weights)} weights; "
                    "give one weight per stream"
                )
            if any(not math.isfinite(w) or w < 0 for w in self.weights) or sum(self.weights) <= 0:
                raise UserError(f"StreamMix weights must be non-negative with a positive sum, got {self.weights}")

    def prepare(self, tokenizer: "Tokenizer", block_size: int, work_dir: Path) -> None:
        self.connect(tokenizer, block_size, work_dir)
        for url in self.train_streams:
            _check_stream(url, "train stream")
        if self.val_stream is not None:
            _check_stream(self.val_stream, "val stream")

    def train_dataloader(
        self, micro_batch_size: int, block_size: int, seed: int, num_workers: int = 0, rank: int = 0, world_size: int = 1
    ) -> "StreamingDataLoader":
        """litdata shards the streams across ranks itself (each rank downloads only its part), so
        unlike TextFiles the blocks of a step depend on the world size."""
        from litdata import CombinedStreamingDataset

        _check_loader_args(micro_batch_size, block_size, num_workers)
        seed = self.seed if self.seed is not None else seed
        datasets = [
            _token_dataset(_local(url), block_size, shuffle=True, seed=seed, drop_last=True)
            for url in self.train_streams
        ]
        if len(datasets) == 1:
            dataset: Any = datasets[0]
        else:
            if num_workers > 1:
                # Measured with litdata 0.2.76: a CombinedStreamingDataset read by several loader
                # workers does not resume at the same batch from its state_dict; with one it does.
                log.warning("StreamMix: using 1 loader worker instead of %d so that resuming is exact", num_workers)
                num_workers = 1
            # With weights litdata samples streams at random until one is exhausted; without them it
            # walks every stream once, in proportion to their sizes.
            dataset = CombinedStreamingDataset(
                datasets=datasets, seed=seed, weights=self.weights, iterate_over_all=self.weights is None
            )
        return _loader(dataset, micro_batch_size, num_workers, drop_last=True)

    def val_dataloader(
        self, micro_batch_size: int, block_size: int, num_workers: int = 0, rank: int = 0, world_size: int = 1
    ) -> Optional["StreamingDataLoader"]:
        if self.val_stream is None:
            return None
        _check_loader_args(micro_batch_size, block_size, num_workers)
        return _val_loader(_local(self.val_stream), micro_batch_size, block_size, num_workers, rank, world_size)
