"""A thin wrapper around a Hugging Face `tokenizer.json` (the Rust `tokenizers` library).

`Tokenizer` works out BOS/EOS/PAD ids from the files that sit next to `tokenizer.json` and adds the
special tokens itself, so `encode` never depends on (or doubles) what the post-processor would add.
`train_bpe_tokenizer` makes a small byte-level BPE tokenizer from local text, for runs with no download.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional

from toolkit.errors import UserError
from toolkit.safetensors_io import current_umask

if TYPE_CHECKING:
    import torch

# The files that travel with a tokenizer (the one list: checkpoints, conversion and download all use
# it). `Tokenizer` reads tokenizer.json and takes BOS/EOS/PAD from the config files and
# generation_config.json; tokenizer.model (SentencePiece) is not read here but is kept so that an
# export to Hugging Face hands it on.
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "tokenizer.model",
    "chat_template.jinja",  # transformers 5 keeps the chat template here (toolkit.data.chat_template)
)

# Special token of the tokenizers made by `train_bpe_tokenizer` (and GPT-2/GPT-NeoX): BOS and EOS at once.
ENDOFTEXT = "<|endoftext|>"
# The smallest vocabulary `train_bpe_tokenizer` makes: every byte plus ENDOFTEXT.
MIN_BPE_VOCAB = 256 + 1
# Last-resort names when no config file names BOS/EOS (a folder with only tokenizer.json).
_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", ENDOFTEXT)
_EOS_NAMES = ("</s>", "<|end_of_text|>", "<eos>", ENDOFTEXT)


def _read_json(path: Path) -> Optional[dict]:
    """The JSON object in `path`, or None when the file is absent. A broken file is a UserError."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"cannot read {path}: {err}; fix or delete that file") from err
    if not isinstance(data, dict):
        raise UserError(f"{path} should hold a JSON object, found {type(data).__name__}; fix or delete that file")
    return data


def token_text(value: Any) -> Optional[str]:
    """A token given as "<s>" or as {"content": "<s>", ...} (both appear in tokenizer_config.json)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _first_id(value: Any) -> Optional[int]:
    """An id given as 2 or [2, 32000] (generation_config.json lists several EOS ids): the first."""
    if isinstance(value, list):
        value = value[0] if value else None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return None


class Tokenizer:
    """Encodes text to 1-D int64 id tensors and back, from `<directory>/tokenizer.json`.

    BOS/EOS/PAD come, in order, from tokenizer_config.json (or special_tokens_map.json), then
    generation_config.json, then config.json. When none names them: BOS is the token the
    post-processor prepends, else the first of <s>, <|begin_of_text|>, <bos>, <|endoftext|> in the
    vocabulary; EOS the first of </s>, <|end_of_text|>, <eos>, <|endoftext|>. `add_bos` is
    tokenizer_config.json's `add_bos_token`, else whether the post-processor prepends BOS.
    """

    def __init__(self, directory: Path | str) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        directory = Path(directory)
        if not directory.exists():
            raise UserError(
                f"tokenizer directory {directory} does not exist; "
                "pass --tokenizer_dir with a folder holding tokenizer.json"
            )
        if not directory.is_dir():
            raise UserError(
                f"{directory} is a file, not a folder; pass --tokenizer_dir with the folder that holds tokenizer.json"
            )
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise UserError(
                f"no tokenizer.json in {directory}: "
                "expected tokenizer.json from a Hugging Face model; pass --tokenizer_dir"
            )
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as err:  # the Rust library raises a bare Exception for any parse error
            message = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise UserError(
                f"cannot load {path} (corrupt or unsupported: {message}); re-download it from the model's repository"
            ) from err

        self.directory = directory
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)

        config = _read_json(directory / "tokenizer_config.json") or {}
        special_map = _read_json(directory / "special_tokens_map.json") or {}
        generation = _read_json(directory / "generation_config.json") or {}
        model_config = _read_json(directory / "config.json") or {}

        def resolve(name: str) -> Optional[int]:
            for source in (config, special_map):
                token = token_text(source.get(f"{name}_token"))
                if token is not None and self._tok.token_to_id(token) is not None:
                    return self._tok.token_to_id(token)
            for source in (generation, model_config):
                token_id = _first_id(source.get(f"{name}_token_id"))
                if token_id is not None and 0 <= token_id < self.vocab_size:
                    return token_id
            return None

        prepended = self._post_processor_prefix()
        self.bos_id: Optional[int] = resolve("bos")
        if self.bos_id is None:
            self.bos_id = prepended if prepended is not None else self._first_known(_BOS_NAMES)
        self.eos_id: Optional[int] = resolve("eos")
        if self.eos_id is None:
            self.eos_id = self._first_known(_EOS_NAMES)
        self.pad_id: Optional[int] = resolve("pad")
        # Every id generation_config.json names as eos_token_id (GLM-4.5 names three: <|endoftext|>,
        # and <|user|> and <|observation|>, the tags its assistant turns end with): generation stops on each.
        listed = generation.get("eos_token_id")
        listed = listed if isinstance(listed, list) else [listed]
        self.generation_stop_ids: tuple[int, ...] = tuple(
            i for i in listed if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.vocab_size
        )

        add_bos = config.get("add_bos_token")
        if isinstance(add_bos, bool):
            self.add_bos: bool = add_bos and self.bos_id is not None
        else:
            self.add_bos = self.bos_id is not None and prepended == self.bos_id

    @property
    def stop_ids(self) -> set[int]:
        """The ids generation stops at: EOS and every id generation_config.json names as eos_token_id
        (Llama 3's instruct models: <|end_of_text|>, <|eom_id|> and <|eot_id|>)."""
        return ({self.eos_id} - {None}) | set(self.generation_stop_ids)

    def _post_processor_prefix(self) -> Optional[int]:
        """The id the tokenizer's post-processor puts before the text (llama2: <s>), if any."""
        # Ask the tokenizer rather than parse post_processor JSON (Template, Sequence, Roberta... differ).
        with_special = self._tok.encode("a", add_special_tokens=True).ids
        without = self._tok.encode("a", add_special_tokens=False).ids
        if with_special and with_special[1 : 1 + len(without)] == without and len(with_special) > len(without):
            return with_special[0]
        return None

    def _first_known(self, names: tuple[str, ...]) -> Optional[int]:
        for name in names:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        return None

    def __repr__(self) -> str:
        return (
            f"Tokenizer({str(self.directory)!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, pad_id={self.pad_id}, add_bos={self.add_bos})"
        )

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> Optional[str]:
        return self._tok.id_to_token(token_id)

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special (control tokens such as <|im_end|>), and EOS."""
        ids = {i for i, token in self._tok.get_added_tokens_decoder().items() if token.special}
        return frozenset(ids | ({self.eos_id} if self.eos_id is not None else set()))

    def _specials(self, bos: Optional[bool], eos: bool) -> tuple[list[int], list[int]]:
        use_bos = self.add_bos if bos is None else bos
        if use_bos and self.bos_id is None:
            raise UserError(f"the tokenizer in {self.directory} has no BOS token, so it cannot prepend one")
        if eos and self.eos_id is None:
            raise UserError(f"the tokenizer in {self.directory} has no EOS token, so it cannot append one")
        return ([self.bos_id] if use_bos else []), ([self.eos_id] if eos else [])

    def encode(self, text: str, bos: Optional[bool] = None, eos: bool = False, max_length: int = -1) -> torch.Tensor:
        """Ids of `text`, shape (n,), int64. bos=None prepends BOS when `self.add_bos`; max_length > 0 truncates."""
        import torch

        head, tail = self._specials(bos, eos)
        ids = head + self._tok.encode(text, add_special_tokens=False).ids + tail
        if max_length > 0:
            ids = ids[:max_length]
        return torch.tensor(ids, dtype=torch.int64)

    def encode_batch(self, texts: list[str], bos: Optional[bool] = None, eos: bool = False) -> list[list[int]]:
        """Ids of many texts at once, through the parallel Rust batch encoder (no offsets computed)."""
        head, tail = self._specials(bos, eos)
        encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        return [head + enc.ids + tail for enc in encodings]

    def encode_batch_offsets(self, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """(ids, character offsets) of many texts, no special tokens added: offsets[t] = (start, end)
        of token t in its text, as the Rust tokenizer reports them."""
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [(enc.ids, enc.offsets) for enc in encodings]

    def decode(self, ids: "torch.Tensor | Iterable[int]", skip_special_tokens: bool = True) -> str:
        if hasattr(ids, "tolist"):  # a tensor or numpy array, any shape
            ids = ids.reshape(-1).tolist()
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, out_dir: Path | str) -> None:
        """Copy the tokenizer files that exist into `out_dir`, so a checkpoint folder is self-contained."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            src = self.directory / name
            dst = out_dir / name
            if not src.is_file() or (dst.exists() and os.path.samefile(src, dst)):
                continue
            shutil.copyfile(src, dst)


def _check_text_file(path: Path) -> bool:
    """Raise UserError unless `path` is a UTF-8 text file; return whether it has any non-blank text."""
    import codecs

    if not path.is_file():
        raise UserError(f"text file {path} does not exist; pass existing UTF-8 text files")
    decoder = codecs.getincrementaldecoder("utf-8")()
    has_text = False
    offset = 0
    with open(path, "rb") as handle:
        while True:
            block = handle.read(1 << 20)
            if b"\x00" in block:
                raise UserError(f"{path} looks binary (it has NUL bytes); pass UTF-8 text files")
            try:
                text = decoder.decode(block, final=not block)
            except UnicodeDecodeError as err:
                raise UserError(
                    f"{path} is not UTF-8 text (bad byte at offset {offset + err.start}); convert it to UTF-8"
                ) from err
            has_text = has_text or bool(text.strip())
            if not block:
                return has_text
            offset += len(block)


def check_tokenizer_fits(tokenizer: "Tokenizer", vocab_size: int, model: str) -> None:
    """Refuse a tokenizer with more tokens than the model has embeddings: its ids past the last row
    would fail inside the model (an IndexError) on the first text that uses them."""
    if tokenizer.vocab_size > vocab_size:
        raise UserError(
            f"The tokenizer in {tokenizer.directory} has {tokenizer.vocab_size} tokens but {model} only "
            f"{vocab_size} embeddings: ids from {vocab_size} on have none. Use the tokenizer the model was trained with."
        )


def train_bpe_tokenizer(text_files: list[Path], vocab_size: int, out_dir: Path) -> Tokenizer:
    """Train a byte-level BPE tokenizer on local text and write it to `out_dir`.

    Writes tokenizer.json and tokenizer_config.json ("<|endoftext|>" is BOS and EOS, add_bos_token
    false as in GPT-2: document boundaries get one EOS). The result depends only on the input text.
    `out_dir` is replaced atomically (built beside it, then renamed); an existing `out_dir` may only
    hold tokenizer files.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    text_files = [Path(p) for p in text_files]
    out_dir = Path(out_dir)
    if not text_files:
        raise UserError("no text files given to train the tokenizer on; pass at least one UTF-8 text file")
    if vocab_size < MIN_BPE_VOCAB:
        raise UserError(f"vocab_size {vocab_size} is too small for byte-level BPE; use at least {MIN_BPE_VOCAB}")
    if not any([_check_text_file(path) for path in text_files]):
        raise UserError(f"no text to train on in {', '.join(map(str, text_files))}; pass files with text")
    if out_dir.exists():
        if not out_dir.is_dir():
            raise UserError(f"{out_dir} is a file; pass a folder for the tokenizer")
        strangers = sorted(p.name for p in out_dir.iterdir() if p.name not in TOKENIZER_FILES)
        if strangers:
            raise UserError(
                f"{out_dir} already holds other files ({', '.join(strangers[:3])}); choose an empty or new folder"
            )

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[ENDOFTEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Training reads the files itself (in Rust); read them in a fixed order for a deterministic result.
    tok.train([str(p) for p in text_files], trainer)

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": ENDOFTEXT,
        "eos_token": ENDOFTEXT,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    os.chmod(staging, 0o777 & ~current_umask())  # mkdtemp makes 0700; give the final folder normal permissions
    try:
        tok.save(str(staging / "tokenizer.json"))
        (staging / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        if out_dir.exists():
            # Swap: move the old folder aside, the new one in, then drop the old one.
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.rename(out_dir, old / "tokenizer")
            os.rename(staging, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return Tokenizer(out_dir)
