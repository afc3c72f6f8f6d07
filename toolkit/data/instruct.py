"""Instruction-tuning data: (instruction, input, response) records -> padded, label-masked batches.

Datasets are small (thousands to a few hundred thousand records), so `setup` reads, checks and
tokenizes everything once, in memory, on every rank; nothing is written to disk.

Each sample is `BOS? + prompt + response + EOS`, cut to max_seq_length + 1 tokens, then shifted:
input_ids = tokens[:-1], labels = tokens[1:]. Labels of prompt positions are IGNORE_INDEX (unless
mask_prompt is false), so the loss covers the response and EOS only. A sample with no target left
after the cut is dropped (and counted).

Loaders (`InstructLoader`) are our own: deterministic given (seed, epoch), sharded so that every
rank gets the same number of batches per epoch, length-grouped to waste little padding, and
resumable at the exact next batch from `state_dict()` without replaying anything. Batches are
{"input_ids": (B, T), "labels": (B, T)} int64, T = the longest sample of that batch.

The trainer's order of calls, on every rank:

    data.setup(tokenizer, max_seq_length, config)   # config: the model's Config (picks the default prompt style)
    train_loader = data.train_dataloader(micro_batch_size, seed, rank, world_size)
    val_loader = data.val_dataloader(micro_batch_size, rank, world_size)   # None: no validation
    ... save/load train_loader.state_dict() with the checkpoint ...
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional

from toolkit.data.prompts import PromptStyle, resolve_style
from toolkit.errors import UserError
from toolkit.models import IGNORE_INDEX

if TYPE_CHECKING:
    import torch

    from toolkit.models.config import Config
    from toolkit.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Length grouping sorts shuffled buckets of this many global batches (micro_batch_size x world_size
# samples each) by length, then shuffles the batches: similar lengths per batch, random order overall.
BUCKET_BATCHES = 64
# Records per tokenizer call; progress is logged after each when there are several.
_TOKENIZE_CHUNK = 20_000


# ---------------------------------------------------------------------------------------------------
# Reading records


@dataclass(frozen=True)
class Example:
    """One record, as text. `where` locates it in its file for error messages."""

    instruction: str
    input: str
    response: str
    where: str = ""


def _json_type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number" if isinstance(value, (int, float)) else type(value).__name__
    )


def _read_text(path: Path, what: str) -> str:
    if not path.exists():
        raise UserError(f"{what} {path} does not exist; pass a .json or .jsonl file")
    if path.is_dir():
        raise UserError(f"{what} {path} is a folder; pass a .json or .jsonl file")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise UserError(f"{path} is not UTF-8 text (bad byte at offset {err.start}); convert it to UTF-8") from err
    if not text.strip():
        raise UserError(f"{path} is empty; it should hold a JSON array of records or one JSON object per line")
    return text


def read_json_records(path: Path, what: str = "data file") -> list[tuple[str, Any]]:
    """(location, record) for each record of a JSON array or JSON Lines file, in file order.

    The format is told from the content: a file starting with "[" is one JSON array (location
    "record i", counted from 0), one starting with "{" is JSON Lines (location "line n", from 1;
    blank lines are skipped). Any problem is a one-line UserError naming the file and position.
    """
    path = Path(path)
    text = _read_text(path, what)
    first = text.lstrip()[0]
    if first == "{":
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None  # several objects (JSON Lines), or broken: the per-line pass says where
        if isinstance(whole, dict) and len([line for line in text.splitlines() if line.strip()]) > 1:
            lists = [k for k, v in whole.items() if isinstance(v, list)]
            hint = f" (its array field: {', '.join(lists[:3])}; extract it)" if lists else ""
            raise UserError(
                f"{path} holds a single JSON object{hint}; expected a JSON array of records or one JSON object per line"
            )
        records = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append((f"line {lineno}", json.loads(line)))
            except json.JSONDecodeError as err:
                raise UserError(
                    f"{path} line {lineno} is not valid JSON ({err.msg}: column {err.colno}); "
                    "a JSON Lines file holds one JSON object per line"
                ) from err
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise UserError(
                f"{path} is not valid JSON: {err.msg}: line {err.lineno} column {err.colno} (char {err.pos})"
            ) from err
        if not isinstance(data, list):
            raise UserError(
                f"{path} holds a JSON {_json_type(data)}; expected a JSON array of records or one JSON object per line"
            )
        records = [(f"record {i}", record) for i, record in enumerate(data)]
    if not records:
        raise UserError(f"{path} has no records; add some or pass another file")
    return records


def _text_field(path: Path, where: str, record: Any, key: str, option: str, required: bool) -> str:
    if not isinstance(record, dict):
        raise UserError(f"{path} {where} is a JSON {_json_type(record)}; each record must be a JSON object")
    if key not in record or (record[key] is None and not required):
        if not required:
            return ""
        keys = ", ".join(repr(k) for k in list(record)[:8]) or "none"
        raise UserError(f"{path} {where} has no {key!r} field (its fields: {keys}); {option}")
    value = record[key]
    if not isinstance(value, str):
        raise UserError(f"{path} {where}: field {key!r} is a JSON {_json_type(value)}, expected a string")
    return value


# ---------------------------------------------------------------------------------------------------
# Tokenized samples, collate, loader


class TokenizedSamples:
    """Samples stored flat: all tokens in one int32 tensor, with offsets and prompt lengths.

    Sample i is tokens[offsets[i]:offsets[i+1]] (at least 2 tokens); its first `masked[i]` labels
    are ignored. `lengths[i]` is its length as model input (tokens - 1).
    """

    def __init__(self, sequences: list[list[int]], masked: list[int]) -> None:
        import torch

        self.offsets = torch.zeros(len(sequences) + 1, dtype=torch.int64)
        if sequences:
            self.offsets[1:] = torch.tensor([len(s) for s in sequences], dtype=torch.int64).cumsum(0)
        flat = [token for seq in sequences for token in seq]
        self.tokens = torch.tensor(flat, dtype=torch.int32)
        self.masked = torch.tensor(masked, dtype=torch.int64)
        self.lengths = self.offsets[1:] - self.offsets[:-1] - 1

    def __len__(self) -> int:
        return len(self.masked)

    def tokens_of(self, i: int) -> "torch.Tensor":
        return self.tokens[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def subset(self, indices: list[int]) -> "TokenizedSamples":
        return TokenizedSamples([self.tokens_of(i).tolist() for i in indices], [int(self.masked[i]) for i in indices])

    def collate(self, indices: "torch.Tensor | list[int]", pad_id: int) -> dict:
        return collate(self, indices, pad_id)

    def sample_row(self, i: int) -> tuple["torch.Tensor", "torch.Tensor"]:
        """Sample i as model input: (input_ids, labels), int64, `lengths[i]` each (what `collate` writes in its row)."""
        import torch

        seq = self.tokens_of(i).to(torch.int64)
        labels = seq[1:].clone()
        labels[: int(self.masked[i])] = IGNORE_INDEX
        return seq[:-1], labels

    @property
    def checksum(self) -> int:
        """A cheap fingerprint of the sample lengths and masks: a changed dataset changes the batch order."""
        import torch

        weights = torch.arange(1, len(self) + 1, dtype=torch.int64)
        return int(((self.lengths * 31 + self.masked) * weights).sum() % (2**61 - 1))

    @property
    def num_tokens(self) -> int:
        """Input tokens over all samples (no padding)."""
        return int(self.lengths.sum())

    @property
    def num_targets(self) -> int:
        """Labels that count in the loss, over all samples."""
        return int((self.lengths - self.masked).sum())


def collate(samples: TokenizedSamples, indices: "torch.Tensor | list[int]", pad_id: int) -> dict:
    """Samples `indices` -> {"input_ids", "labels"} of shape (B, T), T = their longest input length."""
    import torch

    indices = [int(i) for i in indices]
    width = max(int(samples.lengths[i]) for i in indices)
    input_ids = torch.full((len(indices), width), pad_id, dtype=torch.int64)
    labels = torch.full((len(indices), width), IGNORE_INDEX, dtype=torch.int64)
    for row, i in enumerate(indices):
        seq = samples.tokens_of(i).to(torch.int64)
        n = len(seq) - 1
        input_ids[row, :n] = seq[:-1]
        labels[row, :n] = seq[1:]
        labels[row, : int(samples.masked[i])] = IGNORE_INDEX
    return {"input_ids": input_ids, "labels": labels}


def pack_lengths(lengths: list[int], capacity: int) -> list[list[int]]:
    """Sample indices grouped into packs of at most `capacity` tokens, best fit decreasing.

    Longest first, each sample goes into the open pack it fills best (least room left after it),
    or opens a new one: packs come out nearly full, and no sample is ever split. Ties keep index
    order, so the result depends on the lengths only. A sample longer than `capacity` is an error
    (samples are cut to max_seq_length when tokenized).
    """
    import bisect

    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    packs: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (tokens still free, pack index), ascending
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"sample {i} has {n} tokens, more than a pack holds ({capacity})")
        at = bisect.bisect_left(room, (n, -1))
        if at < len(room):
            free, p = room.pop(at)
        else:
            free, p = capacity, len(packs)
            packs.append([])
        packs[p].append(i)
        if free - n > 0:
            bisect.insort(room, (free - n, p))
    return packs


class PackedSamples:
    """Samples packed into sequences of at most `capacity` tokens; a loader takes each pack as one sample.

    Packing is done once (`pack_lengths`), so the packs are the same every epoch and the loader
    shuffles their order. A packed row is its samples' rows (`sample_row`) one after another, each
    shifted on its own: a sample's first token is never a label (nothing predicts it from the
    sample before), and the labels are those the samples have unpacked. The batch also carries
    `document_ids` (B, T): k for the k-th sample of the row, -1 for padding; the model restarts
    positions and limits attention per sample from them (`GPT.forward`).
    """

    def __init__(self, samples: TokenizedSamples, capacity: int) -> None:
        import torch

        self.samples = samples
        self.capacity = capacity
        self.packs = pack_lengths(samples.lengths.tolist(), capacity)
        self.lengths = torch.tensor([int(samples.lengths[p].sum()) for p in self.packs], dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.packs)

    @property
    def checksum(self) -> int:
        return (self.samples.checksum * 1_000_003 + len(self.packs) * 31 + self.capacity) % (2**61 - 1)

    @property
    def num_tokens(self) -> int:
        return self.samples.num_tokens

    @property
    def num_targets(self) -> int:
        return self.samples.num_targets

    def collate(self, indices: "torch.Tensor | list[int]", pad_id: int) -> dict:
        """Packs `indices` -> {"input_ids", "labels", "document_ids"} (B, T), T = their longest pack."""
        import torch

        indices = [int(i) for i in indices]
        width = max(int(self.lengths[i]) for i in indices)
        input_ids = torch.full((len(indices), width), pad_id, dtype=torch.int64)
        labels = torch.full((len(indices), width), IGNORE_INDEX, dtype=torch.int64)
        document_ids = torch.full((len(indices), width), -1, dtype=torch.int64)
        for row, i in enumerate(indices):
            start = 0
            for doc, sample in enumerate(self.packs[i]):
                ids, targets = self.samples.sample_row(sample)
                end = start + len(ids)
                input_ids[row, start:end] = ids
                labels[row, start:end] = targets
                document_ids[row, start:end] = doc
                start = end
        return {"input_ids": input_ids, "labels": labels, "document_ids": document_ids}


class InstructLoader:
    """Micro-batches of `samples` for one rank; iterate once per epoch.

    Training (shuffle=True): each epoch permutes the samples with seed + epoch, drops the remainder
    that does not fill a global batch of micro_batch_size x world_size samples, and (group_by_length)
    sorts buckets of BUCKET_BATCHES global batches by length before cutting them, then shuffles the
    global batches and puts the one holding the longest sample first (an out-of-memory shows at
    once). Each step's micro-batches are dealt to the ranks a round at a time (`_plan`), so ranks
    step through similar lengths, none always the longest, and all get `len(self)` batches.
    Iterating again continues: after a full pass, the next epoch.

    `state_dict()` gives {"epoch", "batches_consumed", ...}; `load_state_dict` makes the next
    iteration yield exactly the batches an uninterrupted run would have yielded next (the epoch's
    order is recomputed from the seed, no batch is replayed).

    Validation (shuffle=False): every pass yields the same batches from the start. With
    group_by_length, each batch holds samples of similar length and the batches come longest first,
    then in an order that spreads any first k batches over all lengths (`spread_order`): a
    validation that reads k batches measures short and long samples alike. Without it, file order.
    One process keeps a short last batch, several drop the samples that do not fill a global batch.
    """

    # Training batches follow whole optimizer steps of `step_batch_size` samples, cut among the
    # ranks: the global order, and the position in it, do not depend on the number of processes,
    # so a checkpoint resumes exactly on another number of them (see `load_state_dict`).
    world_size_independent = True

    def __init__(
        self,
        samples: TokenizedSamples,
        micro_batch_size: int,
        *,
        shuffle: bool,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        group_by_length: bool = True,
        pad_id: int = 0,
        bucket_batches: int = BUCKET_BATCHES,
        step_batch_size: Optional[int] = None,
    ) -> None:
        if micro_batch_size < 1:
            raise UserError(f"micro_batch_size must be at least 1, got {micro_batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        self.samples = samples
        self.micro_batch_size = micro_batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.group_by_length = group_by_length
        self.pad_id = pad_id
        self.bucket_batches = max(1, bucket_batches)
        # Samples per optimizer step over all ranks (the global batch). Training plans whole steps,
        # so the samples of step k are the same whatever the world size and accumulation.
        self.step_batch_size = step_batch_size or micro_batch_size * world_size
        if self.step_batch_size % (micro_batch_size * world_size):
            raise ValueError("step_batch_size must be a multiple of micro_batch_size x world_size")
        self._epoch = 0
        self._consumed = 0
        self._plan_cache: Optional[tuple[int, list["torch.Tensor"]]] = None

    # ------------------------------------------------------------------ size and order
    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.world_size

    def __len__(self) -> int:
        """Batches per epoch on this rank (the same on every rank)."""
        if self.shuffle:
            return len(self.samples) // self.step_batch_size * self.step_batch_size // self.global_batch
        return _batches_per_epoch(len(self.samples), self.micro_batch_size, self.world_size, self.shuffle)

    def batch_indices(self, epoch: int = 0) -> list["torch.Tensor"]:
        """This rank's micro-batches of epoch `epoch`, as sample indices, in order."""
        if self._plan_cache is None or self._plan_cache[0] != epoch:
            self._plan_cache = (epoch, self._plan(epoch))
        return self._plan_cache[1]

    def _plan(self, epoch: int) -> list["torch.Tensor"]:
        import torch

        n, mb, unit = len(self.samples), self.micro_batch_size, self.global_batch
        lengths = self.samples.lengths
        if not self.shuffle:
            # Validation: one sequence of micro-batches whatever the number of processes; rank r
            # takes micro-batches r, r + world_size, ... (whole rounds only, so that every rank runs
            # as many). The first k micro-batches of every run are then the same samples.
            order = torch.arange(n)
            if not self.group_by_length:
                micro = list(order.split(mb))
            else:
                # Micro-batches of similar lengths (little padding), taken in an order whose every
                # prefix spreads over all lengths: validation reads only its first max_iters.
                # The longest micro-batch stays first, so an out-of-memory shows at once.
                micro = list(torch.sort(lengths, descending=True, stable=True).indices.split(mb))
                micro = [micro[i] for i in spread_order(len(micro))]
            if self.world_size == 1:
                return micro
            rounds = len(micro) // self.world_size
            return [micro[r * self.world_size + self.rank] for r in range(rounds)]

        # Training: whole optimizer steps of `step_batch_size` samples ("units").
        unit = self.step_batch_size
        generator = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(n, generator=generator)[: (n // unit) * unit]
        if self.group_by_length and len(order):
            bucket = unit * self.bucket_batches
            pieces = []
            for start in range(0, len(order), bucket):
                chunk = order[start : start + bucket]
                pieces.append(chunk[torch.sort(lengths[chunk], descending=True, stable=True).indices])
            units = torch.cat(pieces).view(-1, unit)
            units = units[torch.randperm(len(units), generator=generator)]
            longest = int(lengths[units].max(dim=1).values.argmax())
            if longest:
                units[[0, longest]] = units[[longest, 0]]
        else:
            units = order.view(-1, unit)
        # A step's samples are cut into micro-batches in order (sorted units: similar lengths in each,
        # longest first). Ranks run their j-th micro-batches in lockstep (FSDP gathers every layer of
        # each), so micro-step j deals the next `world_size` micro-batches, one per rank: the ranks
        # wait little for each other. They are dealt in snake order, rank 0 first on even micro-steps
        # (counted over the epoch) and last on odd ones, so that no rank always gets the longest and
        # the ranks' totals balance. One process takes them in order, as before.
        W = self.world_size
        mine = []
        for u in units:
            for micro_step in u.view(-1, W, mb):  # (W, mb) each, accumulation of them
                mine.append(micro_step[self.rank if len(mine) % 2 == 0 else W - 1 - self.rank])
        return mine

    # ------------------------------------------------------------------ iteration
    @property
    def epoch(self) -> int:
        """The epoch in progress (or the next one when none is): 0 for the first."""
        return self._epoch

    @property
    def batches_consumed(self) -> int:
        """Batches of the current epoch already handed out on this rank."""
        return self._consumed

    def __iter__(self) -> Iterator[dict]:
        if not self.shuffle:
            for indices in self.batch_indices(0):
                yield self.samples.collate(indices, self.pad_id)
            return
        if len(self) == 0:
            return
        if self._consumed >= len(self):  # a finished epoch (e.g. restored from a checkpoint)
            self._epoch, self._consumed = self._epoch + 1, 0
        epoch = self._epoch
        while self._epoch == epoch and self._consumed < len(self):
            indices = self.batch_indices(epoch)[self._consumed]
            self._consumed += 1  # before yielding: a checkpoint taken while this batch trains skips it
            yield self.samples.collate(indices, self.pad_id)
        if self._epoch == epoch and self._consumed >= len(self):
            self._epoch, self._consumed = epoch + 1, 0

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            "batches_consumed": self._consumed,
            "seed": self.seed,
            "num_samples": len(self.samples),
            "samples_checksum": self.samples.checksum,
            "micro_batch_size": self.micro_batch_size,
            "world_size": self.world_size,
            "step_batch_size": self.step_batch_size,
            "group_by_length": self.group_by_length,
            "bucket_batches": self.bucket_batches,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [k for k in ("epoch", "batches_consumed") if k not in state]
        if missing:
            raise UserError(
                f"the checkpoint's data loader state has no {', '.join(missing)}; it is not from this loader"
            )
        epoch, consumed = int(state["epoch"]), int(state["batches_consumed"])
        mine = self.state_dict()
        changed = [k for k in mine if k not in ("epoch", "batches_consumed") and k in state and state[k] != mine[k]]
        samples_consumed = consumed * self.micro_batch_size * int(state.get("world_size", self.world_size))
        if changed == ["world_size"] and samples_consumed % self.global_batch == 0:
            # Another number of processes, same global order: the same samples consumed, in batches of another size.
            consumed, changed = samples_consumed // self.global_batch, []
        if changed:
            # Another order of batches: the exact position cannot be kept; keep the fraction of the epoch.
            old = dict(mine, **{k: state[k] for k in changed})
            old_len = _batches_per_epoch(int(old["num_samples"]), int(old["micro_batch_size"]), int(old["world_size"]))
            consumed = round(consumed * len(self) / old_len) if old_len else 0
            log.warning(
                "the data loader's %s changed since the checkpoint (%s); resuming at the same fraction of epoch %d "
                "(batch %d of %d), not at the exact next batch",
                ", ".join(changed),
                ", ".join(f"{k}: {state[k]} -> {mine[k]}" for k in changed),
                epoch,
                consumed,
                len(self),
            )
        self._epoch, self._consumed = epoch, max(0, consumed)

    # ------------------------------------------------------------------ statistics
    def padding_fraction(self, epoch: Optional[int] = None) -> float:
        """Padded positions / all positions over this rank's batches of `epoch` (default: current)."""
        lengths = self.samples.lengths
        real = padded = 0
        for indices in self.batch_indices(self._epoch if epoch is None else epoch):
            batch_lengths = lengths[indices]
            real += int(batch_lengths.sum())
            padded += int(batch_lengths.max()) * len(indices)
        return 1.0 - real / padded if padded else 0.0

    def __repr__(self) -> str:
        return (
            f"InstructLoader({len(self.samples)} samples, micro_batch_size={self.micro_batch_size}, "
            f"rank={self.rank}/{self.world_size}, {len(self)} batches per epoch, epoch={self._epoch}, "
            f"batches_consumed={self._consumed})"
        )


def spread_order(n: int) -> list[int]:
    """0..n-1 in bit-reversed (van der Corput) order: every prefix is spread evenly over the range.

    For n = 8: 0 4 2 6 1 5 3 7. Any first k positions are about n / k apart, whatever k is.
    """
    bits = max(1, (n - 1).bit_length())
    reversed_positions = (int(format(i, f"0{bits}b")[::-1], 2) for i in range(1 << bits))
    return [i for i in reversed_positions if i < n]


def _batches_per_epoch(num_samples: int, micro_batch_size: int, world_size: int, shuffle: bool = True) -> int:
    if not shuffle:  # validation: whole rounds of micro-batches, the last one possibly short
        return math.ceil(num_samples / micro_batch_size) // world_size
    return num_samples // (micro_batch_size * world_size)


# ---------------------------------------------------------------------------------------------------
# Data modules


@dataclass(kw_only=True)
class _InstructOptions:
    """Options every instruction dataset has (keyword-only, after the dataset's own fields)."""

    prompt_style: Optional[str] = None
    mask_prompt: bool = True
    val_split_fraction: float = 0.05
    val_path: Optional[Path] = None
    seed: int = 42
    group_by_length: bool = True
    packing: bool = False


class InstructData:
    """Instruction-tuning data. Subclasses are dataclasses chosen with `--data NAME` (Alpaca, JSON).

    Common options (all subclasses):
        prompt_style: a style from `toolkit.data.prompts` (alpaca, chatml, llama-3, llama-2, phi,
            gemma, plain); None picks the model's default.
        mask_prompt: leave the prompt out of the loss.
        val_split_fraction: share of the records held out for validation (0: none). Ignored when
            val_path is set.
        val_path: a separate validation file, in the same format as the training file.
        seed: seed of the train/validation split (the batch order uses the training seed).
        group_by_length: batch samples of similar length together (less padding).
        packing: several samples share one sequence of up to max_seq_length tokens, each attending
            only to itself, with positions restarting at 0 (`PackedSamples`): almost no padding.
            micro_batch_size and global_batch_size then count packed sequences, not samples. The
            loss over the same samples is the same packed or not (tests/test_packing.py).

    Protocol, on every rank: `setup`, then `train_dataloader` and `val_dataloader`.
    """

    # Declared by _InstructOptions on the concrete dataclasses.
    prompt_style: Optional[str]
    mask_prompt: bool
    val_split_fraction: float
    val_path: Optional[Path]
    seed: int
    group_by_length: bool
    packing: bool
    json_path: Path

    _train: Optional[TokenizedSamples] = None
    _val: Optional[TokenizedSamples] = None
    # What the loaders are, and what one of the things they batch is called in messages.
    loader_class = InstructLoader
    unit = "sample"

    # ------------------------------------------------------------------ what subclasses define
    def read_examples(self, path: Path, what: str) -> list[Example]:
        raise NotImplementedError

    def read_records(self, path: Path, what: str) -> list[tuple[str, Any]]:
        """(location, record) of every record of `path`: a JSON array or JSON Lines file here; the
        rows of a dataset split for the Hugging Face modules (`toolkit.data.hf_datasets`)."""
        return read_json_records(path, what)

    # ------------------------------------------------------------------ setup
    def _check_options(self, max_seq_length: int) -> None:
        if max_seq_length < 1:
            raise UserError(f"max_seq_length must be at least 1, got {max_seq_length}")
        if not 0.0 <= self.val_split_fraction < 1.0:
            raise UserError(f"val_split_fraction must be in [0, 1), got {self.val_split_fraction}")

    def setup(self, tokenizer: "Tokenizer", max_seq_length: int, model: "Config | str" = "") -> None:
        """Read, check, split and tokenize the data (every rank; no files written).

        `model`: the Config of the model being tuned (the trainer passes it), or a preset name; its
        name, else its family, picks the prompt style when prompt_style is None.
        """
        self._check_options(max_seq_length)
        style = resolve_style(self.prompt_style, model)
        if tokenizer.eos_id is None:
            raise UserError(
                f"the tokenizer in {tokenizer.directory} has no EOS token; instruction tuning needs one "
                "to teach the model where a response ends"
            )
        start = time.perf_counter()
        train_examples = self.read_examples(Path(self.json_path), "data file")
        if self.val_path is not None:
            val_examples = self.read_examples(Path(self.val_path), "validation file")
        else:
            train_examples, val_examples = self._split(train_examples)
        log.info(
            "instruction data: %d training and %d validation records, prompt style %r%s",
            len(train_examples),
            len(val_examples),
            style.name,
            "" if self.prompt_style is not None else f" (default for {getattr(model, 'name', model)!r})",
        )
        self.style = style
        self.max_seq_length = max_seq_length
        self.pad_id = pad_id_for(tokenizer)
        self._train, train_stats = tokenize_examples(
            train_examples, tokenizer, style, max_seq_length, self.mask_prompt, "training"
        )
        self._val, val_stats = (
            tokenize_examples(val_examples, tokenizer, style, max_seq_length, self.mask_prompt, "validation")
            if val_examples
            else (None, {"dropped": 0, "truncated": 0})
        )
        if len(self._train) == 0:
            raise UserError(
                f"no training sample of {self.json_path} keeps a response token within max_seq_length="
                f"{max_seq_length} ({train_stats['dropped']} dropped: prompt too long); raise max_seq_length"
            )
        if self._val is not None and len(self._val) == 0:
            log.warning("every validation sample was dropped (prompt longer than max_seq_length); no validation")
            self._val = None
        self.stats = {"prompt_style": style.name, **sample_stats(self._train, self._val, train_stats, val_stats)}
        log.info(
            "instruction data ready in %.1f s: %d training samples (%d tokens, %d in the loss, mean length %.0f, "
            "longest %d), %d validation samples; %d truncated and %d dropped (no response token within "
            "max_seq_length=%d)",
            time.perf_counter() - start,
            self.stats["train_samples"],
            self.stats["train_tokens"],
            self.stats["train_target_tokens"],
            self.stats["mean_length"],
            self.stats["max_length"],
            self.stats["val_samples"],
            train_stats["truncated"] + val_stats["truncated"],
            train_stats["dropped"] + val_stats["dropped"],
            max_seq_length,
        )

    def output_tokenizer_dir(self, checkpoint_dir: Path, out_dir: Path) -> Path:
        """Where the run's checkpoints and final model take their tokenizer files from."""
        return Path(checkpoint_dir)

    def _split(self, examples: list[Example]) -> tuple[list[Example], list[Example]]:
        """Hold out val_split_fraction of the records, chosen with `seed` (independent of the tokenizer)."""
        import torch

        n = len(examples)
        n_val = 0 if self.val_split_fraction == 0 else max(1, round(n * self.val_split_fraction))
        if n_val == 0:
            return examples, []
        if n_val >= n:
            raise UserError(
                f"{self.json_path} has {n} record(s): too few to hold out {self.val_split_fraction:.0%} for "
                "validation; add records, pass --data.val_path, or set --data.val_split_fraction 0"
            )
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed)).tolist()
        val = set(perm[:n_val])
        return [e for i, e in enumerate(examples) if i not in val], [e for i, e in enumerate(examples) if i in val]

    # ------------------------------------------------------------------ loaders
    def _require_setup(self) -> TokenizedSamples:
        if self._train is None:
            raise RuntimeError(f"call {type(self).__name__}.setup(tokenizer, max_seq_length, model) first")
        return self._train

    def _batched(self, samples: TokenizedSamples) -> "TokenizedSamples | PackedSamples":
        """What the loader cuts into batches: the samples, or with `packing` their packs."""
        return PackedSamples(samples, self.max_seq_length) if self.packing else samples

    def train_dataloader(
        self, micro_batch_size: int, seed: int, rank: int = 0, world_size: int = 1, global_batch_size: Optional[int] = None
    ) -> InstructLoader:
        """`global_batch_size`: samples (packed sequences with `packing`) per optimizer step over all ranks
        (default micro x world)."""
        samples = self._batched(self._require_setup())
        loader = self.loader_class(
            samples,
            micro_batch_size,
            shuffle=True,
            seed=seed,
            rank=rank,
            world_size=world_size,
            group_by_length=self.group_by_length,
            pad_id=self.pad_id,
            step_batch_size=global_batch_size,
        )
        what = "packed sequence(s)" if self.packing else f"training {self.unit}(s)"
        if len(loader) == 0:
            raise UserError(
                f"{len(samples)} {what} do not fill one batch of micro_batch_size={micro_batch_size} "
                f"on each of {world_size} process(es); lower micro_batch_size or add data"
            )
        self.stats["padding_fraction"] = loader.padding_fraction(0)
        if self.packing:
            self.stats["packed_sequences"] = len(samples)
        log.info(
            "training batches: %d per epoch per process, %.1f%% padding%s",
            len(loader),
            100 * self.stats["padding_fraction"],
            f" ({len(self._train)} samples packed into {len(samples)} sequences of up to {self.max_seq_length} tokens)"
            if self.packing else " (length-grouped)" if self.group_by_length else "",
        )
        return loader

    def val_dataloader(self, micro_batch_size: int, rank: int = 0, world_size: int = 1) -> Optional[InstructLoader]:
        """None when there is no validation data."""
        self._require_setup()
        if self._val is None:
            return None
        loader = self.loader_class(
            self._batched(self._val),
            micro_batch_size,
            shuffle=False,
            rank=rank,
            world_size=world_size,
            group_by_length=self.group_by_length,
            pad_id=self.pad_id,
        )
        if len(loader) == 0:
            log.warning(
                "%d validation %s(s) do not fill one batch of %d on each of %d processes; no validation",
                len(self._val),
                self.unit,
                micro_batch_size,
                world_size,
            )
            return None
        return loader


def sample_stats(train, val, train_stats: dict, val_stats: dict) -> dict:
    """What the start-up log and `data.stats` report about tokenized training and validation samples."""
    return {
        "train_samples": len(train),
        "val_samples": len(val) if val is not None else 0,
        "train_tokens": train.num_tokens,
        "train_target_tokens": train.num_targets,
        "max_length": int(train.lengths.max()),
        "mean_length": train.num_tokens / len(train),
        "dropped_train": train_stats["dropped"],
        "dropped_val": val_stats["dropped"],
        "truncated_train": train_stats["truncated"],
        "truncated_val": val_stats["truncated"],
    }


def pad_id_for(tokenizer: "Tokenizer") -> int:
    """The id padding positions hold (never trained: their labels are IGNORE_INDEX): PAD, else EOS, else 0."""
    return next((t for t in (tokenizer.pad_id, tokenizer.eos_id) if t is not None), 0)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def encode_examples(
    examples: list[Example], tokenizer: "Tokenizer", style: PromptStyle, what: str = ""
) -> Iterator[tuple[Example, list[int], int]]:
    """(example, tokens of `BOS? prompt response EOS`, how many of them are prompt) per example, in order.

    The whole text is tokenized at once (so the prompt/response boundary tokenizes as it reads) and
    the prompt alone too: the prompt's tokens are the longest common prefix of the two (a last prompt
    token that merged with the response's first counts as response: the model has to write it).
    """
    eos = tokenizer.eos_id
    chunks = range(0, len(examples), _TOKENIZE_CHUNK)
    for start in chunks:
        part = examples[start : start + _TOKENIZE_CHUNK]
        prompts = tokenizer.encode_batch([style.apply(e.instruction, e.input) for e in part])
        fulls = tokenizer.encode_batch([style.render(e.instruction, e.input, e.response) for e in part])
        for example, prompt, full in zip(part, prompts, fulls):
            if not full or full[-1] != eos:
                full.append(eos)
            yield example, full, common_prefix(prompt, full)
        if len(chunks) > 1:
            log.info("tokenized %s records: %d/%d", what, min(start + _TOKENIZE_CHUNK, len(examples)), len(examples))


def tokenize_examples(
    examples: list[Example],
    tokenizer: "Tokenizer",
    style: PromptStyle,
    max_seq_length: int,
    mask_prompt: bool,
    what: str = "",
) -> tuple[TokenizedSamples, dict[str, int]]:
    """Tokenize to `BOS? prompt response EOS` (`encode_examples`), cut to max_seq_length + 1 tokens;
    drop target-less samples."""
    limit = max_seq_length + 1
    sequences: list[list[int]] = []
    masked: list[int] = []
    dropped = truncated = 0
    first_dropped = ""
    for example, full, n_prompt in encode_examples(examples, tokenizer, style, what):
        if len(full) > limit:
            truncated += 1
            full = full[:limit]
        n_masked = min(max(n_prompt - 1, 0), len(full) - 1) if mask_prompt else 0
        if len(full) < 2 or len(full) - 1 - n_masked <= 0:
            dropped += 1
            first_dropped = first_dropped or example.where
            continue
        sequences.append(full)
        masked.append(n_masked)
    if dropped:
        log.warning(
            "dropped %d of %d %s samples (the first: %s): no response token fits in max_seq_length=%d",
            dropped,
            len(examples),
            what,
            first_dropped or "?",
            max_seq_length,
        )
    return TokenizedSamples(sequences, masked), {"dropped": dropped, "truncated": truncated}


@dataclass
class JSON(InstructData, _InstructOptions):
    """Records from a JSON array or JSON Lines file, with configurable field names.

    Args:
        json_path: the file: a JSON array of objects, or one JSON object per line.
        prompt_key: field holding the instruction.
        input_key: field holding the optional input (a record may lack it or hold null: no input);
            None: records have no input.
        response_key: field holding the response.
    """

    json_path: Path
    prompt_key: str = "instruction"
    input_key: Optional[str] = "input"
    response_key: str = "output"

    def _hint(self, role: str) -> str:
        return f"set --data.{role}_key to the field that holds the {role}"

    def read_examples(self, path: Path, what: str) -> list[Example]:
        examples = []
        seen_input = False
        records = self.read_records(path, what)
        for where, record in records:
            instruction = _text_field(path, where, record, self.prompt_key, self._hint("prompt"), True)
            response = _text_field(path, where, record, self.response_key, self._hint("response"), True)
            text_input = ""
            if self.input_key is not None:
                seen_input = seen_input or self.input_key in record
                text_input = _text_field(path, where, record, self.input_key, self._hint("input"), False)
            examples.append(Example(instruction, text_input, response, where))
        if self.input_key is not None and not seen_input:
            keys = ", ".join(repr(k) for k in list(records[0][1])[:8])
            raise UserError(
                f"no record of {path} has the input field {self.input_key!r} (record fields: {keys}); "
                f"{self._hint('input')}, or pass --data.input_key null"
            )
        return examples


@dataclass
class Alpaca(InstructData, _InstructOptions):
    """Alpaca-format records: {"instruction", "input", "output"} (a JSON array or JSON Lines).

    Args:
        json_path: the file, e.g. alpaca_data_cleaned.json. A record may leave out "input".
    """

    json_path: Path

    def read_examples(self, path: Path, what: str) -> list[Example]:
        hint = "Alpaca records have instruction, input and output; for other field names use --data JSON"
        return alpaca_examples(path, self.read_records(path, what), hint)


def alpaca_examples(path: Path | str, records: Iterable[tuple[str, dict]], hint: str) -> list[Example]:
    """Examples from (where, record) pairs with "instruction", "output" and an optional "input";
    `hint` ends the one-line error for a record without them."""
    examples = []
    for where, record in records:
        instruction = _text_field(path, where, record, "instruction", hint, True)
        response = _text_field(path, where, record, "output", hint, True)
        text_input = _text_field(path, where, record, "input", hint, False)
        examples.append(Example(instruction, text_input, response, where))
    return examples


__all__ = [
    "Alpaca",
    "Example",
    "IGNORE_INDEX",
    "InstructData",
    "InstructLoader",
    "JSON",
    "PackedSamples",
    "TokenizedSamples",
    "collate",
    "common_prefix",
    "encode_examples",
    "pack_lengths",
    "pad_id_for",
    "read_json_records",
    "tokenize_examples",
]
