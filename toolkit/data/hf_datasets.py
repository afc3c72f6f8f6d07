"""Hugging Face `datasets` as training data: a Hub name, a `save_to_disk` folder, or Parquet/JSON/CSV/Arrow files.

    --data HFInstruct   instruction records, laid out by a prompt style (like `Alpaca`/`JSON`)
    --data HFChat       conversations, laid out by the chat template (like `Chat`)
    --data HFPreference preference pairs: a prompt, a chosen and a rejected response (like `Preference`)
    --data HFText       pretraining text, tokenized into the same litdata cache as `TextFiles`

Every module takes `path` (what `datasets.load_dataset` or `load_from_disk` reads), `split`, the
dataset's config `name`, and `columns`, which maps the fields the module reads to the dataset's
columns: `--data.columns '{instruction: question, output: answer}'`, `'{messages: conversation}'`,
`'{text: content}'`. The rows then go through the same code as the JSON modules: the same prompt
styles, chat templates, masking and loaders for fine-tuning (the same records give the same
batches whichever format they come in), and `TextFiles` for pretraining: the text column is written
once to JSON Lines in the cache folder and tokenized from there in parallel, with progress.

Offline (`HF_HUB_OFFLINE=1` / `HF_DATASETS_OFFLINE=1`), Hub datasets are read from the local cache
(`HF_HOME`); one that is not there fails in one line, as does a missing file, split or column.
`streaming` reads rows as they come instead of preparing the whole dataset first (useful with
`max_records` on a large Hub dataset); `datasets` is imported only when the data is read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

from toolkit.data.chat import Chat
from toolkit.data.instruct import Example, InstructData, _InstructOptions, alpaca_examples
from toolkit.data.preference import Preference
from toolkit.data.streams import PretrainData, TextFiles
from toolkit.errors import UserError

if TYPE_CHECKING:
    from toolkit.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# File suffix -> the `datasets` builder that reads it.
_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv", ".arrow": "arrow"}
# Rows per batch when reading a column out of a dataset.
_READ_BATCH = 1000


def _looks_local(path: str) -> bool:
    return path.startswith(("/", "./", "../", "~")) or Path(path).suffix.lower() in _BUILDERS


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__).rstrip(".")


def load_split(path: str, split: str, name: Optional[str] = None, streaming: bool = False, option: str = "--data.split"):
    """One split of a dataset as a `datasets.Dataset` (or `IterableDataset` when streaming).

    `path`: a `save_to_disk` folder (a DatasetDict's splits, or one Dataset whose split is itself),
    a Parquet/JSON/JSON Lines/CSV/Arrow file (the file is the split), a folder of such files, or a
    Hub name. `option` names the setting that asked for `split` in messages; a single file or
    Dataset is the training split only, so `--data.val_split` on one is refused (it would validate
    on the training rows). Any failure is one UserError line.
    """
    try:
        import datasets
    except ImportError:
        raise UserError("Hugging Face datasets need the datasets package: pip install 'toolkit[hf-datasets]'") from None
    local = Path(path).expanduser()
    what = f"the dataset {path}" + (f" (config {name})" if name else "")
    if not local.exists() and _looks_local(path):
        raise UserError(f"{path} does not exist; pass a Parquet/JSON/CSV file, a save_to_disk folder, or a Hub dataset name")
    try:
        single = local.is_file() or (local.is_dir() and (local / "state.json").is_file())
        if single and option == "--data.val_split":
            raise UserError(
                f"{path} holds one split, which trains; {option} {split} would validate on those same rows. Drop "
                f"{option} to hold out a share of them, or give a save_to_disk folder of a DatasetDict with a {split!r} split"
            )
        if local.is_dir() and ((local / "dataset_dict.json").is_file() or (local / "state.json").is_file()):
            loaded = datasets.load_from_disk(str(local))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise UserError(f"{path} has no split {split!r} (its splits: {', '.join(loaded)}); set {option}")
                loaded = loaded[split]
            return loaded.to_iterable_dataset() if streaming else loaded
        if local.is_file():
            builder = _BUILDERS.get(local.suffix.lower())
            if builder is None:
                raise UserError(f"{path}: cannot tell its format from the suffix; use .parquet, .json, .jsonl, .csv or .arrow")
            return datasets.load_dataset(builder, data_files=str(local), split="train", streaming=streaming)
        return datasets.load_dataset(str(local) if local.is_dir() else path, name, split=split, streaming=streaming)
    except UserError:
        raise
    except Exception as error:  # datasets raises many kinds (FileNotFoundError, ValueError, ConnectionError, ...)
        offline = datasets.config.HF_HUB_OFFLINE
        hint = (
            f"; offline (HF_HUB_OFFLINE=1) a Hub dataset must be in the local cache ({datasets.config.HF_DATASETS_CACHE}): "
            "load it once online, or pass a local file or folder"
            if offline and not local.exists() else ""
        )
        raise UserError(f"cannot load {what}, split {split!r}: {_first_line(error)}{hint}") from error


def _column_names(dataset) -> list[str]:
    names = dataset.column_names
    if names is None:  # a streamed dataset whose features are not known before reading
        names = list(next(iter(dataset), {}).keys())
    return list(names)


def _mapped(columns: Optional[dict[str, str]], fields: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, str]:
    """field -> dataset column; a field not in `columns` is read from the column of its own name."""
    columns = dict(columns or {})
    unknown = sorted(set(columns) - set(fields) - set(optional))
    if unknown:
        raise UserError(
            f"--data.columns maps {', '.join(map(repr, unknown))}, which this data does not read; "
            f"map any of: {', '.join(fields + optional)}"
        )
    return {f: columns.get(f, f) for f in fields + optional}


def rows(
    dataset, mapping: dict[str, str], optional: tuple[str, ...], where: str, max_records: Optional[int],
    need_one: bool = False,
) -> Iterator[dict]:
    """The rows of `dataset` as {field: value} for the fields of `mapping`, checked against its columns.

    Fields in `optional` may be missing; with `need_one`, at least one of them must be there.
    """
    available = _column_names(dataset)
    missing = [f"{c!r}" + (f" (for {f})" if c != f else "") for f, c in mapping.items() if c not in available and f not in optional]
    present = {f: c for f, c in mapping.items() if c in available}
    if need_one and not present:
        missing = [" or ".join(repr(c) for c in mapping.values())]
    if missing:
        raise UserError(
            f"{where} has no column {', '.join(missing)} (its columns: {', '.join(available[:12]) or 'none'}); "
            "map the columns with --data.columns '{field: column}'"
        )
    dataset = dataset.select_columns(sorted(set(present.values())))
    count = 0
    for batch in dataset.iter(batch_size=_READ_BATCH):
        n = len(next(iter(batch.values()))) if batch else 0
        for i in range(n):
            if max_records is not None and count >= max_records:
                return
            count += 1
            yield {f: batch[c][i] for f, c in present.items()}


@dataclass(kw_only=True)
class _HFOptions:
    """Where the rows come from (keyword-only, after the module's own fields)."""

    split: str = "train"
    val_split: Optional[str] = None
    name: Optional[str] = None
    columns: Optional[dict[str, str]] = None
    streaming: bool = False
    max_records: Optional[int] = None


class _HFRecords:
    """Turns the instruction modules' file reading into reading a dataset split.

    `json_path` and `val_path` (which `InstructData`/`Chat` read) are derived: the dataset itself,
    and, when `val_split` is set, the dataset again (read at `val_split`).
    """

    path: str
    split: str
    val_split: Optional[str]
    name: Optional[str]
    columns: Optional[dict[str, str]]
    streaming: bool
    max_records: Optional[int]
    FIELDS: tuple[str, ...] = ()
    OPTIONAL: tuple[str, ...] = ()

    def _derive_paths(self) -> None:
        self.path = str(self.path)
        if self.max_records is not None and self.max_records < 1:
            raise UserError(f"--data.max_records must be at least 1, got {self.max_records}")
        _mapped(self.columns, self.FIELDS, self.OPTIONAL)  # a bad mapping is refused before any process starts
        self.json_path = self.path
        self.val_path = self.path if self.val_split is not None else None

    def read_records(self, path: Path | str, what: str) -> list[tuple[str, Any]]:
        validation = what == "validation file" and self.val_split is not None
        split = self.val_split if validation else self.split
        dataset = load_split(self.path, split, self.name, self.streaming, "--data.val_split" if validation else "--data.split")
        where = f"{self.path} [{split}]"
        records = [
            (f"row {i}", record)
            for i, record in enumerate(rows(dataset, _mapped(self.columns, self.FIELDS, self.OPTIONAL), self.OPTIONAL,
                                            where, self.max_records, need_one=not self.FIELDS))
        ]
        if not records:
            raise UserError(f"{where} has no rows; pass another split or dataset")
        return records


def _derived(default=None):
    """A field the module computes (not an option): excluded from __init__ and the CLI."""
    return field(default=default, init=False, repr=False)


@dataclass
class HFInstruct(_HFRecords, InstructData, _InstructOptions, _HFOptions):
    """Instruction records from a Hugging Face dataset, laid out by a prompt style (as `Alpaca`).

    Args:
        path: a Hub dataset name (e.g. tatsu-lab/alpaca), a `save_to_disk` folder, a Parquet / JSON /
            JSON Lines / CSV / Arrow file (the file is the split), or a folder of such files.
        split: the training split.
        val_split: a split to validate on (e.g. test); default: hold out val_split_fraction of `split`.
        name: the dataset's config name, for Hub datasets that have several.
        columns: the dataset's columns for instruction, input (optional) and output, e.g.
            {instruction: question, output: answer}; unmapped fields are read from columns of their name.
        streaming: read rows as they come instead of preparing the whole split first.
        max_records: read at most this many rows of each split.

    Shared options (see `InstructData`): prompt_style, mask_prompt, val_split_fraction, seed, group_by_length.
    """

    path: str
    json_path: Optional[str] = _derived()
    val_path: Optional[str] = _derived()
    FIELDS = ("instruction", "output")
    OPTIONAL = ("input",)

    def __post_init__(self) -> None:
        self._derive_paths()

    def read_examples(self, path: Path | str, what: str) -> list[Example]:
        hint = "map the dataset's columns with --data.columns '{instruction: <column>, output: <column>}'"
        return alpaca_examples(path, self.read_records(path, what), hint)


@dataclass
class HFChat(_HFRecords, Chat, _HFOptions):
    """Conversations from a Hugging Face dataset, rendered with the chat template (as `Chat`).

    Args:
        path: a Hub dataset name (e.g. HuggingFaceH4/ultrachat_200k), a `save_to_disk` folder, a
            Parquet / JSON / JSON Lines / CSV / Arrow file, or a folder of such files.
        split: the training split (e.g. train_sft).
        val_split: a split to validate on (e.g. test_sft); default: hold out val_split_fraction of `split`.
        name: the dataset's config name.
        columns: the column holding each row's messages, e.g. {messages: conversation} (or
            {conversations: dialog} for ShareGPT-style rows); the role and content keys inside a
            message are --data.role_key / --data.content_key.
        streaming: read rows as they come instead of preparing the whole split first.
        max_records: read at most this many rows of each split.

    Chat's options apply: format, role_key, content_key, role_names, system_prompt, chat_template,
    template_variables, mask_prompt, val_split_fraction, seed, group_by_length.
    """

    path: str = field(kw_only=True)
    json_path: Optional[str] = _derived()
    val_path: Optional[str] = _derived()
    OPTIONAL = ("messages", "conversations")

    def __post_init__(self) -> None:
        self._derive_paths()


@dataclass
class HFPreference(_HFRecords, Preference, _HFOptions):
    """Preference pairs from a Hugging Face dataset (as `Preference`): TRL's layouts
    (prompt / chosen / rejected, as texts or messages, the prompt explicit or implicit) and LLaMA-Factory's.

    Args:
        path: a Hub dataset name (e.g. trl-lib/ultrafeedback_binarized), a `save_to_disk` folder, a
            Parquet / JSON / JSON Lines / CSV / Arrow file, or a folder of such files.
        split: the training split (e.g. train_prefs).
        val_split: a split to validate on (e.g. test_prefs); default: hold out val_split_fraction of `split`.
        name: the dataset's config name.
        columns: the dataset's columns for prompt (optional), chosen, rejected and conversations
            (optional, LLaMA-Factory's prompt), e.g. {prompt: question, chosen: good, rejected: bad};
            unmapped fields are read from columns of their name.
        streaming: read rows as they come instead of preparing the whole split first.
        max_records: read at most this many rows of each split.

    Preference's options apply: keep_prompt_tokens, format, role_key, content_key, role_names,
    system_prompt, chat_template, template_variables, train_reasoning, prompt_style,
    val_split_fraction, seed, group_by_length.
    """

    path: str = field(kw_only=True)
    json_path: Optional[str] = _derived()
    val_path: Optional[str] = _derived()
    FIELDS = ("chosen", "rejected")
    OPTIONAL = ("prompt", "conversations")

    def __post_init__(self) -> None:
        # The fields read are the record keys the module looks for (--data.prompt_key etc. rename them).
        self.FIELDS = (self.chosen_key, self.rejected_key)
        self.OPTIONAL = (self.prompt_key, self.conversation_key or "conversations")
        self._derive_paths()


# ---------------------------------------------------------------------------------------------------
# Pretraining text


@dataclass
class HFText(PretrainData, _HFOptions):
    """Pretraining text from a Hugging Face dataset, tokenized into the same litdata cache as `TextFiles`.

    The text column of each split is written once to JSON Lines under the cache folder (one row,
    one document: BOS/EOS around it), which `TextFiles` then tokenizes in parallel, with progress.

    Args:
        path: a Hub dataset name (e.g. wikitext), a `save_to_disk` folder, a Parquet / JSON / JSON
            Lines / CSV / Arrow file, or a folder of such files.
        split: the training split.
        val_split: a split to validate on; default: hold out val_fraction of the training rows.
        name: the dataset's config name (e.g. wikitext-103-raw-v1).
        columns: the column with the text, e.g. {text: content}; default: "text".
        streaming: read rows as they come (a large Hub corpus: with max_records, only what is read
            is downloaded).
        max_records: read at most this many rows of each split.
        val_fraction: share of the training rows held out when val_split is unset.
        cache_dir: where the text export and the tokenized data are kept (default: <out_dir>/data_cache).
        num_workers: processes for tokenizing.
    """

    path: str
    val_fraction: float = 0.05
    cache_dir: Optional[Path] = None
    num_workers: int = 1

    def __post_init__(self) -> None:
        self.path = str(self.path)
        self.cache_dir = Path(self.cache_dir) if self.cache_dir is not None else None
        if self.max_records is not None and self.max_records < 1:
            raise UserError(f"--data.max_records must be at least 1, got {self.max_records}")
        _mapped(self.columns, ("text",))
        if self.val_split is None and not 0.0 < self.val_fraction < 1.0:
            raise UserError(f"--data.val_fraction must be between 0 and 1, got {self.val_fraction}")
        if self.num_workers < 1:
            raise UserError(f"--data.num_workers must be at least 1, got {self.num_workers}")
        self._text: Optional[TextFiles] = None

    def _cache_root(self, work_dir: Path) -> Path:
        return self.cache_dir if self.cache_dir is not None else Path(work_dir) / "data_cache"

    def _export(self, split: str, work_dir: Path) -> Path:
        """The text column of `split` as `<cache>/hf-<name>-<key>.jsonl`, written once (atomically)."""
        option = "--data.val_split" if split == self.val_split and split != self.split else "--data.split"
        dataset = load_split(self.path, split, self.name, self.streaming, option)
        local = Path(self.path).expanduser()
        identity = {
            "path": str(local.resolve()) if local.exists() else self.path, "name": self.name, "split": split,
            "columns": self.columns, "max_records": self.max_records,
            # A prepared dataset's fingerprint changes with its files; a streamed one has none.
            "fingerprint": getattr(dataset, "_fingerprint", None),
        }
        key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
        slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{local.stem if local.exists() else self.path}-{split}")[:40]
        root = self._cache_root(work_dir) / "hf-text"
        target = root / f"{slug}-{key}.jsonl"
        if target.is_file():
            return target
        root.mkdir(parents=True, exist_ok=True)
        start, count = time.perf_counter(), 0
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=root)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                where = f"{self.path} [{split}]"
                for count, row in enumerate(rows(dataset, _mapped(self.columns, ("text",)), (), where, self.max_records), 1):
                    text = row["text"]
                    if not isinstance(text, str):
                        raise UserError(f"{where} row {count - 1}: the text column holds {type(text).__name__}, expected a string")
                    if text.strip():
                        out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                    if count % 100_000 == 0:
                        log.info("exporting %s: %d rows", where, count)
            if count == 0:
                raise UserError(f"{self.path} [{split}] has no rows; pass another split or dataset")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        log.info("exported %d rows of %s [%s] to %s in %.1f s", count, self.path, split, target, time.perf_counter() - start)
        return target

    def _text_files(self, work_dir: Path) -> TextFiles:
        if self._text is None:
            train = self._export(self.split, work_dir)
            val = self._export(self.val_split, work_dir) if self.val_split is not None else None
            self._text = TextFiles(
                train_path=train, val_path=val, val_fraction=self.val_fraction, text_key="text",
                cache_dir=self._cache_root(work_dir), num_workers=self.num_workers,
            )
        return self._text

    def corpus_files(self, work_dir: Path) -> list[Path]:
        return self._text_files(work_dir).corpus_files(work_dir)

    def connect(self, tokenizer: "Tokenizer", block_size: int, work_dir: Path) -> None:
        self._text_files(work_dir).connect(tokenizer, block_size, work_dir)

    def prepare(self, tokenizer: "Tokenizer", block_size: int, work_dir: Path) -> None:
        self._text_files(work_dir).prepare(tokenizer, block_size, work_dir)

    def train_dataloader(self, micro_batch_size: int, block_size: int, seed: int, num_workers: int = 0, rank: int = 0,
                         world_size: int = 1):
        return self._text.train_dataloader(micro_batch_size, block_size, seed, num_workers, rank, world_size)

    def val_dataloader(self, micro_batch_size: int, block_size: int, num_workers: int = 0, rank: int = 0, world_size: int = 1):
        return self._text.val_dataloader(micro_batch_size, block_size, num_workers, rank, world_size)


__all__ = ["HFChat", "HFInstruct", "HFPreference", "HFText", "load_split"]
