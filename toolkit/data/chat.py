"""Chat data: multi-turn conversations, laid out by the model's own chat template, loss on assistant turns.

Records (a JSON array or JSON Lines, one conversation each) come in two formats, told apart from
the first record or chosen with `format`:

    messages:  {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
    sharegpt:  {"conversations": [{"from": "system"|"human"|"gpt", "value": "..."}, ...]}

A conversation is rendered with the chat template (`toolkit.data.chat_template`: the checkpoint's
own, or a named one) and tokenized as `transformers` `apply_chat_template` tokenizes it, so the
model trains on exactly the tokens it is later prompted with.

How the loss mask is found (exact for any template, no `{% generation %}` markers needed)
------------------------------------------------------------------------------------------
For a conversation m_0 .. m_{n-1}, the full text is rendered once and tokenized: ids(full). For
each assistant message m_i, two prefixes are rendered and tokenized on their own:

    prompt_i = render(m_0 .. m_{i-1}, add_generation_prompt=True)   what a model is given to answer m_i
    turn_i   = render(m_0 .. m_i)                                    the conversation up to m_i's end

`start_i` is the length of the common prefix of ids(prompt_i) and ids(full), `end_i` that of
ids(turn_i) and ids(full) (for the last message, len(ids(full))). Tokens start_i .. end_i-1 are what
the template writes for m_i beyond the prompt: the content, the end-of-turn token, and separators
such as the newline after ChatML's <|im_end|>. The trained span stops at the last special token of
that range (a control token of the tokenizer, or EOS: <|im_end|>, <|eot_id|>, <end_of_turn>, </s>),
so separators that the template writes between turns are not trained. A template that closes turns
with no special token gets the whole range trained (and a warning: nothing teaches the model to
stop). Everything else (system, user turns, the assistant header of the generation prompt) has its
labels set to IGNORE_INDEX. With mask_prompt=False every token is trained.

Comparing token ids, not characters, keeps this exact whatever the tokenizer merges: when the last
token of a prompt merges with the first of the answer, start_i falls on the merged token, which is
trained (the model has to produce it). The method needs a template that renders a conversation's
beginning the same whether or not more turns follow ("prefix-stable"); a prompt whose tokens are
not a prefix of the full conversation (apart from such a merged last token) is an error that
names the record. Costs: 2 renders and tokenizations per assistant turn, done once at setup.

Length rule. A sample ends at the last trained token of its last assistant turn. When that is more
than max_seq_length + 1 tokens, the sample is cut after the last assistant turn that ends within
the limit (whole turns only: no turn is cut in the middle), and counted as truncated. A
conversation whose first assistant turn does not end within the limit is dropped (and counted,
with a warning naming the first one).

Batches come from the instruction loader (`toolkit.data.instruct.InstructLoader`): length-grouped,
sharded over ranks, resumable at the exact next batch. Packing several conversations into one
sequence is not offered: it needs attention that stops at conversation borders, which the model does
not take as input.

Bad records stop the run before anything is written, with one line naming the file, the record and
the problem: no messages, an unknown role, empty content, no final assistant turn, or a conversation
the template refuses to render.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional

from toolkit.data.chat_template import ChatTemplate, TemplateRenderError, resolve_chat_template, write_tokenizer_files
from toolkit.data.instruct import (
    IGNORE_INDEX, InstructData, TokenizedSamples, _InstructOptions, _json_type, pad_id_for, sample_stats,
)
from toolkit.errors import UserError

if TYPE_CHECKING:
    import torch

    from toolkit.tokenizer import Tokenizer

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class RecordFormat:
    """Where a format keeps its messages, and what its role names mean."""

    conversation_key: str
    role_key: str
    content_key: str
    roles: dict[str, str]


FORMATS: dict[str, RecordFormat] = {
    "messages": RecordFormat("messages", "role", "content", {"system": "system", "user": "user", "assistant": "assistant"}),
    "sharegpt": RecordFormat(
        "conversations", "from", "value",
        {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"},
    ),
}

# Conversations per batch of renders handed to the tokenizer's batch encoder.
_CHUNK = 2_000


@dataclass(frozen=True)
class Conversation:
    """One record: (role, content) pairs with roles among ROLES. `where` locates it for messages."""

    messages: tuple[tuple[str, str], ...]
    where: str = ""

    def as_dicts(self) -> list[dict[str, str]]:
        """The messages as a chat template (and transformers' apply_chat_template) takes them."""
        return [{"role": role, "content": content} for role, content in self.messages]


# ---------------------------------------------------------------------------------------------------
# Reading records


def detect_format(record: Any, path: Path, where: str) -> str:
    """The format of a record: "messages" or "sharegpt", from the field that holds its messages."""
    if isinstance(record, dict):
        for name, spec in FORMATS.items():
            if isinstance(record.get(spec.conversation_key), list):
                return name
    fields = ", ".join(repr(k) for k in list(record)[:8]) if isinstance(record, dict) else _json_type(record)
    raise UserError(
        f"{f'{path} {where}'.strip()} has neither a 'messages' nor a 'conversations' array (found: {fields}); "
        "set --data.format and --data.conversation_key"
    )


def parse_conversation(
    record: Any, path: Path, where: str, spec: RecordFormat, system_prompt: Optional[str] = None,
    final_role: str = "assistant",
) -> Conversation:
    """Check one record and turn it into a Conversation; any problem is one UserError line.

    `final_role`: the role the last message must have (training data ends with the assistant turn
    the model learns; a prompt for `generate` ends with the user message to answer).
    """

    def bad(problem: str) -> UserError:
        return UserError(f"{f'{path} {where}'.strip()}: {problem}")

    if not isinstance(record, dict):
        raise bad(f"is a JSON {_json_type(record)}; each record must be a JSON object")
    if spec.conversation_key not in record:
        fields = ", ".join(repr(k) for k in list(record)[:8]) or "none"
        raise bad(f"no messages: there is no {spec.conversation_key!r} field (its fields: {fields}); "
                  "set --data.conversation_key")
    raw = record[spec.conversation_key]
    if not isinstance(raw, list):
        raise bad(f"no messages: {spec.conversation_key!r} is a JSON {_json_type(raw)}, expected an array of messages")
    if not raw:
        raise bad(f"no messages: {spec.conversation_key!r} is empty")
    messages = []
    for index, message in enumerate(raw):
        if not isinstance(message, dict):
            raise bad(f"message {index} is a JSON {_json_type(message)}; expected an object with "
                      f"{spec.role_key!r} and {spec.content_key!r}")
        for key, option in ((spec.role_key, "role_key"), (spec.content_key, "content_key")):
            if key not in message:
                fields = ", ".join(repr(k) for k in list(message)[:8]) or "none"
                raise bad(f"message {index} has no {key!r} field (its fields: {fields}); set --data.{option}")
        name = message[spec.role_key]
        role = spec.roles.get(name) if isinstance(name, str) else None
        if role is None:
            known = ", ".join(sorted(spec.roles))
            raise bad(f"message {index} has an unknown role {name!r} (known: {known}); map it with "
                      f"--data.role_names '{{\"{name}\": \"assistant\"}}'")
        content = message[spec.content_key]
        if not isinstance(content, str):
            raise bad(f"message {index} ({role}): {spec.content_key!r} is a JSON {_json_type(content)}, expected a string")
        if not content.strip():
            raise bad(f"message {index} ({role}) has empty content")
        messages.append((role, content))
    if messages[-1][0] != final_role:
        why = "the turn the model learns to write" if final_role == "assistant" else "the message to answer"
        raise bad(f"the last message's role is {messages[-1][0]!r}; a conversation must end with {final_role!r} ({why})")
    if system_prompt and messages[0][0] != "system":
        messages.insert(0, ("system", system_prompt))
    return Conversation(tuple(messages), where)


# ---------------------------------------------------------------------------------------------------
# Tokenized samples with a per-token loss mask


class ChatSamples(TokenizedSamples):
    """TokenizedSamples whose trained tokens are any set of positions, not a prefix-masked tail.

    `trained[offsets[i] + t]` says whether token t of sample i is a target (t >= 1: it is the label
    at input position t - 1). `masked[i]` counts sample i's ignored labels, so the statistics and the
    fingerprint of the base class hold.
    """

    def __init__(self, sequences: list[list[int]], trained: list[list[bool]]) -> None:
        import torch

        masked = [len(seq) - 1 - sum(flags[1:]) for seq, flags in zip(sequences, trained)]
        super().__init__(sequences, masked)
        self.trained = torch.tensor([flag for flags in trained for flag in flags], dtype=torch.bool)

    def trained_of(self, i: int) -> "torch.Tensor":
        return self.trained[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def subset(self, indices: list[int]) -> "ChatSamples":
        return ChatSamples([self.tokens_of(i).tolist() for i in indices], [self.trained_of(i).tolist() for i in indices])

    def collate(self, indices, pad_id: int) -> dict:
        """Samples `indices` -> {"input_ids", "labels"} (B, T); labels of untrained tokens are IGNORE_INDEX."""
        import torch

        indices = [int(i) for i in indices]
        width = max(int(self.lengths[i]) for i in indices)
        input_ids = torch.full((len(indices), width), pad_id, dtype=torch.int64)
        labels = torch.full((len(indices), width), IGNORE_INDEX, dtype=torch.int64)
        for row, i in enumerate(indices):
            seq = self.tokens_of(i).to(torch.int64)
            n = len(seq) - 1
            input_ids[row, :n] = seq[:-1]
            labels[row, :n] = torch.where(self.trained_of(i)[1:], seq[1:], IGNORE_INDEX)
        return {"input_ids": input_ids, "labels": labels}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def assistant_spans(
    conversation: Conversation, template: ChatTemplate, tokenizer: "Tokenizer", path: Path | str = ""
) -> tuple[list[int], list[tuple[int, int]], int]:
    """(ids of the whole conversation, [(start, stop)] trained span per assistant turn, turns without a special end).

    One conversation at a time; `tokenize_conversations` does the same over batches.
    """
    texts = conversation_texts(conversation, template, path)
    return spans_from_ids(conversation, tokenizer.encode_batch(texts, bos=False), tokenizer.special_ids, path)


def conversation_texts(conversation: Conversation, template: ChatTemplate, path: Path | str = "") -> list[str]:
    """[full, prompt_i, turn_i for each assistant turn but the last (whose turn_i is the full text)]."""
    messages = conversation.as_dicts()
    assistants = [i for i, (role, _) in enumerate(conversation.messages) if role == "assistant"]
    where = f"{path} {conversation.where}".strip()
    try:
        texts = [template.render(messages)]
        for i in assistants:
            texts.append(template.render(messages[:i], add_generation_prompt=True))
            if i != len(messages) - 1:
                texts.append(template.render(messages[: i + 1]))
    except TemplateRenderError as err:
        raise UserError(f"{where}: the chat template ({template.origin}) fails to render it: {err}") from None
    return texts


def spans_from_ids(
    conversation: Conversation, ids: list[list[int]], special_ids: frozenset[int], path: Path | str = ""
) -> tuple[list[int], list[tuple[int, int]], int]:
    """The trained span of each assistant turn, from the token ids of `conversation_texts`."""
    full, rest = ids[0], iter(ids[1:])
    where = f"{path} {conversation.where}".strip()
    spans, unclosed = [], 0
    last = len(conversation.messages) - 1
    for i, (role, _) in enumerate(conversation.messages):
        if role != "assistant":
            continue
        prompt = next(rest)
        turn = full if i == last else next(rest)
        start = _common_prefix(prompt, full)
        if start < len(prompt) - 1:
            raise UserError(
                f"{where}: the chat template renders the conversation before message {i} differently when later "
                f"turns follow (tokens differ from position {start} of {len(prompt)}), so its assistant tokens "
                "cannot be told apart exactly; use a template that keeps earlier turns as they are "
                "(--data.chat_template)"
            )
        stop = len(full) if i == last else _common_prefix(turn, full)
        if stop <= start:
            raise UserError(f"{where}: the chat template writes nothing for assistant message {i}")
        closing = [t for t in range(start, stop) if full[t] in special_ids]
        if closing:
            stop = closing[-1] + 1
        else:
            unclosed += 1
        spans.append((max(start, 1), stop))  # token 0 is never a label
    if 0 < unclosed < len(spans):
        # Some turns end with a special token and others not: the template renders a turn differently
        # when it is the conversation's last (e.g. adds or strips a reasoning block), so the end of
        # the other turns cannot be found from prefixes.
        raise UserError(
            f"{where}: the chat template renders an assistant turn differently when it is the last message, so "
            "the end of its other turns cannot be told apart exactly; use a template that keeps earlier turns "
            "as they are (--data.chat_template)"
        )
    return full, spans, unclosed


def tokenize_conversations(
    conversations: list[Conversation],
    tokenizer: "Tokenizer",
    template: ChatTemplate,
    max_seq_length: int,
    mask_prompt: bool,
    path: Path | str = "",
    what: str = "",
) -> tuple[ChatSamples, dict[str, int]]:
    """Render, tokenize and mask every conversation; cut long ones at turn boundaries (module docstring)."""
    limit = max_seq_length + 1
    special_ids = tokenizer.special_ids
    sequences: list[list[int]] = []
    trained: list[list[bool]] = []
    stats = {"dropped": 0, "truncated": 0, "unclosed_turns": 0}
    first_dropped = ""
    chunks = range(0, len(conversations), _CHUNK)
    for start in chunks:
        part = conversations[start : start + _CHUNK]
        texts = [conversation_texts(c, template, path) for c in part]
        flat = tokenizer.encode_batch([t for group in texts for t in group], bos=False)
        offset = 0
        for conversation, group in zip(part, texts):
            ids = flat[offset : offset + len(group)]
            offset += len(group)
            full, spans, unclosed = spans_from_ids(conversation, ids, special_ids, path)
            stats["unclosed_turns"] += unclosed
            kept = [span for span in spans if span[1] <= limit]  # spans grow: a prefix of the turns
            end = kept[-1][1] if kept else 0
            flags = [False] * end
            if mask_prompt:
                for a, b in kept:
                    flags[a:b] = [True] * (b - a)
            else:
                flags[1:] = [True] * (end - 1)
            if not any(flags):
                stats["dropped"] += 1
                first_dropped = first_dropped or conversation.where
                continue
            if len(kept) < len(spans):
                stats["truncated"] += 1
            sequences.append(full[:end])
            trained.append(flags)
        if len(chunks) > 1:
            log.info("tokenized %s conversations: %d/%d", what, min(start + _CHUNK, len(conversations)), len(conversations))
    if stats["dropped"]:
        log.warning(
            "dropped %d of %d %s conversations (the first: %s): their first assistant turn does not end within "
            "max_seq_length=%d tokens",
            stats["dropped"], len(conversations), what, first_dropped or "?", max_seq_length,
        )
    if stats["unclosed_turns"]:
        log.warning(
            "%d assistant turns of the %s data end with no special token in this chat template (%s): the whole "
            "turn is trained, and nothing teaches the model where to stop; prefer a template that closes turns "
            "with an end-of-turn or EOS token",
            stats["unclosed_turns"], what, template.origin,
        )
    return ChatSamples(sequences, trained), stats


# ---------------------------------------------------------------------------------------------------
# The data module


@dataclass
class Chat(InstructData, _InstructOptions):
    """Multi-turn conversations rendered with the model's chat template; loss on assistant turns.

    Args:
        json_path: the file: a JSON array of conversations, or one conversation per line (JSON Lines).
        format: "messages" ({"messages": [{"role", "content"}]}), "sharegpt" ({"conversations":
            [{"from", "value"}]}), or "auto": told from the first record.
        conversation_key: field holding the list of messages (default: the format's).
        role_key: field of a message holding its role (default: "role" or "from").
        content_key: field of a message holding its text (default: "content" or "value").
        role_names: extra role names of the data and what they mean, e.g. {"bot": "assistant"}; the
            format's own names (user, human, gpt, ...) are always known.
        system_prompt: a system message for conversations that have none.
        chat_template: a built-in template (chatml, llama-3, llama-2, gemma, zephyr) or a .jinja file.
            Default: the checkpoint's own; when it has none, the built-in one for the model. A template
            that is not the checkpoint's is written into the output's tokenizer_config.json.
        template_variables: extra variables for the template, e.g. {"date_string": "26 Jul 2024"} for
            Llama 3's system header (otherwise the date of the run).

    Shared options (see `InstructData`): mask_prompt (true: loss on assistant turns only; false: on
    every token), val_split_fraction, val_path, seed, group_by_length. prompt_style does
    not apply: the chat template lays the conversation out.
    """

    json_path: Path
    format: Literal["auto", "messages", "sharegpt"] = "auto"
    conversation_key: Optional[str] = None
    role_key: Optional[str] = None
    content_key: Optional[str] = None
    role_names: Optional[dict[str, str]] = None
    system_prompt: Optional[str] = None
    chat_template: Optional[str] = None
    template_variables: Optional[dict[str, str]] = None

    def record_format(self, name: str) -> RecordFormat:
        """The format `name` with this module's key and role-name options applied."""
        spec = FORMATS[name]
        extra = dict(self.role_names or {})
        for data_name, role in extra.items():
            if role not in ROLES:
                raise UserError(f"--data.role_names maps {data_name!r} to {role!r}; map roles to one of {', '.join(ROLES)}")
        return RecordFormat(
            self.conversation_key or spec.conversation_key,
            self.role_key or spec.role_key,
            self.content_key or spec.content_key,
            {**spec.roles, **extra},
        )

    def read_conversations(self, path: Path, what: str) -> list[Conversation]:
        records = self.read_records(path, what)
        name = self.format
        if name == "auto":
            if self.conversation_key is not None:
                raise UserError(
                    "--data.conversation_key needs --data.format messages or sharegpt (their role and content keys differ)"
                )
            name = detect_format(records[0][1], path, records[0][0])
        spec = self.record_format(name)
        return [parse_conversation(record, path, where, spec, self.system_prompt) for where, record in records]

    def setup(self, tokenizer: "Tokenizer", max_seq_length: int, model_name: Any = "") -> None:
        """Read, check, split, render and tokenize the conversations (every rank; no files written)."""
        self._check_options(max_seq_length)
        if self.prompt_style is not None:
            raise UserError(
                "--data.prompt_style does not apply to Chat data: the chat template lays conversations out; "
                "choose one with --data.chat_template"
            )
        start = time.perf_counter()
        template = resolve_chat_template(tokenizer, self.chat_template, model_name, self.template_variables)
        train = self.read_conversations(Path(self.json_path), "data file")
        if self.val_path is not None:
            val = self.read_conversations(Path(self.val_path), "validation file")
        else:
            train, val = self._split(train)
        log.info("chat data: %d training and %d validation conversations, chat template: %s",
                 len(train), len(val), template.origin)
        self.template = template
        self.tokenizer_dir = Path(tokenizer.directory)
        self.max_seq_length = max_seq_length
        self.pad_id = pad_id_for(tokenizer)
        self._train, train_stats = tokenize_conversations(
            train, tokenizer, template, max_seq_length, self.mask_prompt, self.json_path, "training"
        )
        no_val = {"dropped": 0, "truncated": 0, "unclosed_turns": 0}
        self._val, val_stats = (
            tokenize_conversations(val, tokenizer, template, max_seq_length, self.mask_prompt,
                                   self.val_path or self.json_path, "validation")
            if val else (None, no_val)
        )
        if len(self._train) == 0:
            raise UserError(
                f"no conversation of {self.json_path} has an assistant turn that ends within max_seq_length="
                f"{max_seq_length} ({train_stats['dropped']} dropped); raise --train.max_seq_length"
            )
        if self._val is not None and len(self._val) == 0:
            log.warning("every validation conversation was dropped (longer than max_seq_length); no validation")
            self._val = None
        self.stats = {"chat_template": template.origin, **sample_stats(self._train, self._val, train_stats, val_stats)}
        log.info(
            "chat data ready in %.1f s: %d training samples (%d tokens, %d in the loss, mean length %.0f, longest %d), "
            "%d validation samples; %d cut at a turn boundary and %d dropped (max_seq_length=%d)",
            time.perf_counter() - start, self.stats["train_samples"], self.stats["train_tokens"],
            self.stats["train_target_tokens"], self.stats["mean_length"], self.stats["max_length"],
            self.stats["val_samples"], train_stats["truncated"] + val_stats["truncated"],
            train_stats["dropped"] + val_stats["dropped"], max_seq_length,
        )

    def output_tokenizer_dir(self, checkpoint_dir: Path, out_dir: Path) -> Path:
        """The checkpoint's tokenizer folder, or `<out_dir>/tokenizer` with the chat template written in."""
        self._require_setup()
        if self.template.from_checkpoint:
            return Path(checkpoint_dir)
        return write_tokenizer_files(self.tokenizer_dir, Path(out_dir) / "tokenizer", self.template)


__all__ = [
    "Chat",
    "ChatSamples",
    "Conversation",
    "FORMATS",
    "assistant_spans",
    "parse_conversation",
    "tokenize_conversations",
]
