"""Preference pairs: one prompt, a chosen and a rejected response -> paired, label-masked batches.

The data of preference tuning (DPO, IPO, SimPO, ORPO). Records (a JSON array or JSON Lines; the rows
of a Hugging Face dataset with `HFPreference`) come in the layouts TRL and LLaMA-Factory use, told
apart record by record from what their fields hold:

    text, explicit prompt:            {"prompt": "...", "chosen": "...", "rejected": "..."}
    text, implicit prompt:            {"chosen": "...", "rejected": "..."}
    conversation, explicit prompt:    {"prompt": [messages], "chosen": [messages], "rejected": [messages]}
    conversation, implicit prompt:    {"chosen": [messages], "rejected": [messages]}
    LLaMA-Factory (ShareGPT):         {"conversations": [messages], "chosen": {message}, "rejected": {message}}

Messages are {"role", "content"} or {"from", "value"} (ShareGPT: human, gpt, system), told from the
first one, with everything `Chat` reads besides (tools, tool calls, reasoning). A single message
object stands for a list of one.

- Explicit text prompt: laid out by the prompt style, as instruction data is (`Alpaca`):
  `BOS? style(prompt) response EOS`; the responses hold the answers alone.
- Implicit text prompt: the prompt is what the two texts share from their start, cut back to the
  start of the word where they part; the whitespace before that word starts the responses (TRL's
  rule, which moves back one space). "Human: Sky?\\n\\nAssistant: It is blue." / "... It is green." ->
  prompt "Human: Sky?\\n\\nAssistant: It is", responses " blue." / " green.". When no whitespace
  precedes the first difference, the whole shared prefix is the prompt. The texts are already laid
  out (Anthropic HH-RLHF's "\\n\\nHuman: ... \\n\\nAssistant: ..."), so they are used as they are, with
  no prompt style: `BOS? text EOS`.
- Explicit conversation prompt: `prompt` (or LLaMA-Factory's `conversations`) holds the prompt's
  messages, `chosen` and `rejected` the answers: an assistant message, or several turns that end with
  one. Answers that repeat the prompt's messages first (datasets that store whole conversations
  beside the prompt) have them taken off. A text `prompt` beside conversations is not used: the
  prompt is then what the two conversations share (as TRL does; HuggingFaceH4/ultrafeedback_binarized).
- Implicit conversation prompt: the prompt is the longest run of messages the two conversations share
  from their start; the first message where they part must be an assistant message on both sides.

Conversations are rendered by the chat template and their assistant turns located exactly as `Chat`
does (`toolkit.data.chat`). Trained (labels not IGNORE_INDEX): the assistant turns of the response,
each with its end-of-turn token (<|im_end|>, <|eot_id|>, </s>, ...); with train_reasoning=False, from
the end of a turn's reasoning. Text pairs train the response and EOS. Nothing of the prompt is ever
trained (mask_prompt cannot be false), and the chosen and the rejected sequence of a pair start with
the same prompt tokens.

Length rule (a sequence holds at most max_seq_length + 1 tokens: the model reads max_seq_length of
them after the shift). When the prompt with the longer response does not fit:
 1. the prompt is cut from its start, keeping its end (TRL's "keep_end" for prompts), by the same
    tokens on both sides, just enough for the pair to fit, but it keeps at least its last
    keep_prompt_tokens tokens (default: half of max_seq_length). A BOS token that starts it stays;
 2. a response that is still too long is cut at its end (its end-of-turn or EOS token is then lost).
A pair is counted as truncated; a pair where a side keeps no trained token is dropped (counted, and
the first one named in a warning).

Batches: {"input_ids": (2B, T), "labels": (2B, T), "pair_ids": (B,)} int64. Rows 0..B-1 are the chosen
sequences of the B pairs, rows B..2B-1 the rejected ones in the same order (pair i: rows i and B+i),
right-padded to T = the longest of the 2B rows. input_ids = tokens[:-1], labels = tokens[1:]
(IGNORE_INDEX on the prompt and on padding). pair_ids: each pair's index among the kept pairs of its
split (training or validation), fixed once the data is set up: across epochs, ranks and resumes.
`micro_batch_size` and `global_batch_size` count pairs.

Loaders are `InstructLoader`s over pairs: deterministic, sharded so that every rank gets the same
number of batches, length-grouped by the longer side of each pair, resumable at the exact next
batch. `reference_dataloader` covers every pair of a split once over all ranks (for a pass of a
reference model over the data, whose results pair_ids index).

Bad records stop the run before anything is written, with one line naming the file, the record and
the problem: a missing or wrongly typed field, empty responses, a chosen response equal to the
rejected one, a prompt that one answer repeats and the other does not, or no shared prompt.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Literal, Optional, Union

from toolkit.data.chat import (
    FORMATS, Chat, ChatSamples, Conversation, RecordFormat, SpanStats, encode_conversations, parse_conversation,
    report_span_stats,
)
from toolkit.data.chat_template import ChatTemplate, resolve_chat_template
from toolkit.data.instruct import (
    Example, InstructLoader, _json_type, common_prefix, encode_examples, pad_id_for,
)
from toolkit.data.prompts import PromptStyle, resolve_style
from toolkit.errors import UserError

if TYPE_CHECKING:
    import torch

    from toolkit.models.config import Config
    from toolkit.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Implicit text prompts are already laid out: the prompt and the response are used as they are.
AS_WRITTEN = PromptStyle(name="as written", template="{instruction}")


# ---------------------------------------------------------------------------------------------------
# Reading records


@dataclass(frozen=True)
class PreferencePair:
    """One record: the same prompt with a chosen and a rejected answer.

    Conversation pairs hold two whole conversations (the prompt's messages, then each answer's) and
    how many messages the prompt has. Text pairs hold two Examples (the prompt as the instruction,
    the answer as the response) and whether the prompt is used as written (an implicit prompt) or
    laid out by the prompt style.
    """

    chosen: Union[Conversation, Example]
    rejected: Union[Conversation, Example]
    prompt_messages: int = 0
    as_written: bool = False
    where: str = ""

    @property
    def is_conversation(self) -> bool:
        return isinstance(self.chosen, Conversation)


def shared_text_prompt(chosen: str, rejected: str) -> int:
    """How many leading characters of two texts form their implicit prompt (module docstring): their
    shared prefix cut back to the start of the word where they part, less the whitespace before it."""
    n = len(os.path.commonprefix([chosen, rejected]))
    cut = n
    while cut > 0 and not chosen[cut - 1].isspace():
        cut -= 1
    while cut > 0 and chosen[cut - 1].isspace():
        cut -= 1
    return cut if cut > 0 else n


def _fields(record: dict) -> str:
    return ", ".join(repr(k) for k in list(record)[:8]) or "none"


class _PairReader:
    """Turns records into PreferencePairs for one data module's options (keys, message formats, system prompt)."""

    def __init__(self, data: "Preference", path: Path | str) -> None:
        self.path = path
        self.keys = (data.prompt_key, data.chosen_key, data.rejected_key)
        self.conversation_key = data.conversation_key or FORMATS["sharegpt"].conversation_key
        self.system_prompt = data.system_prompt
        names = ("messages", "sharegpt") if data.format == "auto" else (data.format,)
        self.formats = [data.record_format(name) for name in names]

    def message_format(self, *values: Any) -> RecordFormat:
        """The format whose role key the first message of `values` has (the first format when none has)."""
        for value in values:
            message = value if isinstance(value, dict) else value[0] if isinstance(value, list) and value else None
            if isinstance(message, dict):
                for spec in self.formats:
                    if spec.role_key in message:
                        return spec
                break
        return self.formats[0]

    def __call__(self, record: Any, where: str) -> PreferencePair:
        prompt_key, chosen_key, rejected_key = self.keys
        location = f"{self.path} {where}".strip()

        def bad(problem: str) -> UserError:
            return UserError(f"{location}: {problem}")

        if not isinstance(record, dict):
            raise bad(f"is a JSON {_json_type(record)}; each record must be a JSON object")
        for key in (chosen_key, rejected_key):
            if record.get(key) is None:
                raise bad(f"no {key!r} field (its fields: {_fields(record)}); a preference record has "
                          f"{chosen_key!r} and {rejected_key!r} (name others with --data.chosen_key / --data.rejected_key)")
        chosen, rejected = record[chosen_key], record[rejected_key]
        if isinstance(chosen, str) and isinstance(rejected, str):
            return self.text_pair(record, chosen, rejected, where, bad)
        if isinstance(chosen, (list, dict)) and isinstance(rejected, (list, dict)):
            return self.conversation_pair(record, chosen, rejected, where, bad)
        raise bad(f"{chosen_key!r} is a JSON {_json_type(chosen)} and {rejected_key!r} a JSON {_json_type(rejected)}; "
                  "both must be strings (text) or both messages (arrays of message objects)")

    def text_pair(self, record: dict, chosen: str, rejected: str, where: str, bad) -> PreferencePair:
        prompt_key, chosen_key, rejected_key = self.keys
        if chosen.strip() == rejected.strip():
            raise bad(f"{chosen_key!r} and {rejected_key!r} are the same text; a pair needs two different responses")
        prompt = record.get(prompt_key)
        as_written = prompt is None
        if as_written:
            n = shared_text_prompt(chosen, rejected)
            if n == 0:
                raise bad(f"no {prompt_key!r} field, and {chosen_key!r} and {rejected_key!r} share no start to take as "
                          f"the prompt; give the prompt in a {prompt_key!r} field (or name it with --data.prompt_key)")
            prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        elif not isinstance(prompt, str):
            raise bad(f"{prompt_key!r} is a JSON {_json_type(prompt)}, but {chosen_key!r} and {rejected_key!r} are "
                      "strings; a text pair's prompt is a string")
        elif not prompt.strip():
            raise bad(f"{prompt_key!r} is empty")
        for key, text in ((chosen_key, chosen), (rejected_key, rejected)):
            if not text.strip():
                what = "adds nothing to the prompt the two texts share" if as_written else "is empty"
                raise bad(f"{key!r} {what}: a pair needs two non-empty responses")
        return PreferencePair(Example(prompt, "", chosen, where), Example(prompt, "", rejected, where),
                              as_written=as_written, where=where)

    def conversation_pair(self, record: dict, chosen: Any, rejected: Any, where: str, bad) -> PreferencePair:
        prompt_key, chosen_key, rejected_key = self.keys
        prompt, source = record.get(prompt_key), prompt_key
        if prompt is None and record.get(self.conversation_key) is not None:
            prompt, source = record[self.conversation_key], self.conversation_key
        if isinstance(prompt, str):
            prompt = None  # a text prompt beside conversations: the prompt is what they share (TRL)
        spec = self.message_format(prompt, chosen, rejected)
        tools = record.get("tools")

        def parse(key: str, value: Any, final_role: Optional[str]) -> list[dict[str, Any]]:
            part = {key: [value] if isinstance(value, dict) else value, "tools": tools}
            form = RecordFormat(key, spec.role_key, spec.content_key, spec.roles)
            return list(parse_conversation(part, self.path, f"{where} {key!r}", form, None, final_role).messages)

        chosen_messages = parse(chosen_key, chosen, "assistant")
        rejected_messages = parse(rejected_key, rejected, "assistant")
        if chosen_messages == rejected_messages:
            raise bad(f"{chosen_key!r} and {rejected_key!r} are the same messages; a pair needs two different responses")
        if prompt is None:
            n = common_prefix(chosen_messages, rejected_messages)
            if n == 0:
                raise bad(f"no {prompt_key!r} field, and {chosen_key!r} and {rejected_key!r} differ from their first "
                          f"message: they share no prompt; give it in a {prompt_key!r} field")
            for key, messages in ((chosen_key, chosen_messages), (rejected_key, rejected_messages)):
                if n == len(messages):
                    raise bad(f"{key!r} has no message after the {n} the two conversations share: no response")
                if messages[n]["role"] != "assistant":
                    raise bad(f"the conversations part at message {n}, a {messages[n]['role']!r} message in {key!r}; "
                              "they must share the prompt and part at an assistant turn")
            prompt_messages = chosen_messages[:n]
        elif not isinstance(prompt, (list, dict)):
            raise bad(f"{source!r} is a JSON {_json_type(prompt)}; expected the prompt's messages, as in {chosen_key!r}")
        else:
            prompt_messages = parse(source, prompt, None)
            n = len(prompt_messages)
            repeats = [messages[:n] == prompt_messages for messages in (chosen_messages, rejected_messages)]
            if any(repeats) and not all(repeats):
                key = chosen_key if repeats[0] else rejected_key
                raise bad(f"{key!r} starts with the prompt's messages and the other response does not; "
                          "give both responses with the prompt, or both without")
            if all(repeats):
                for key, messages in ((chosen_key, chosen_messages), (rejected_key, rejected_messages)):
                    if len(messages) == n:
                        raise bad(f"{key!r} holds the prompt's messages and nothing after them: no response")
                chosen_messages, rejected_messages = chosen_messages[n:], rejected_messages[n:]
            for key, messages in ((chosen_key, chosen_messages), (rejected_key, rejected_messages)):
                if messages[0]["role"] != "assistant":
                    raise bad(f"{key!r} starts with a {messages[0]['role']!r} message that is not the prompt's; a "
                              f"response starts with the assistant's answer to the prompt in {source!r}")
            chosen_messages, rejected_messages = prompt_messages + chosen_messages, prompt_messages + rejected_messages
        if self.system_prompt and prompt_messages[0]["role"] != "system":
            system = {"role": "system", "content": self.system_prompt}
            chosen_messages, rejected_messages = [system] + chosen_messages, [system] + rejected_messages
            n += 1
        tools = tools if isinstance(tools, list) else None
        return PreferencePair(Conversation.of(chosen_messages, where, tools),
                              Conversation.of(rejected_messages, where, tools), prompt_messages=n, where=where)


# ---------------------------------------------------------------------------------------------------
# Tokenized pairs


Side = tuple[list[int], list[bool]]  # a sequence's tokens, and which of them are trained


def fit_pair(
    chosen: Side, rejected: Side, limit: int, keep_prompt: int, bos_id: Optional[int]
) -> tuple[Optional[tuple[Side, Side]], bool]:
    """The pair within `limit` tokens a side, by the length rule (module docstring): ((chosen, rejected)
    or None when a side keeps no trained token, whether it was cut)."""
    if any(True not in flags for _, flags in (chosen, rejected)):
        return None, False
    over = max(len(chosen[0]), len(rejected[0])) - limit
    if over <= 0:
        return (chosen, rejected), False
    # The prompt: the tokens both sides share before either's first trained token.
    first = [flags.index(True) for _, flags in (chosen, rejected)]
    shared = common_prefix(chosen[0][: first[0]], rejected[0][: first[1]])
    head = 1 if bos_id is not None and shared and chosen[0][0] == bos_id else 0
    cut = max(0, min(over, shared - max(head, min(keep_prompt, shared))))
    fitted = []
    for tokens, flags in (chosen, rejected):
        tokens = (tokens[:head] + tokens[head + cut :])[:limit]
        flags = [False] + (flags[:head] + flags[head + cut :])[1:limit]  # token 0 is never a label
        if True not in flags:
            return None, True
        end = len(flags) - flags[::-1].index(True)  # a side ends at its last trained token
        fitted.append((tokens[:end], flags[:end]))
    return (fitted[0], fitted[1]), True


class PairSamples:
    """N tokenized pairs, as the loaders take them: pair i is side i (chosen) and side N + i (rejected) of `sides`.

    `lengths[i]`: the longer side of pair i as model input (what length grouping sorts by).
    """

    def __init__(self, sides: ChatSamples) -> None:
        import torch

        self.sides = sides
        n = len(sides) // 2
        self.lengths = torch.maximum(sides.lengths[:n], sides.lengths[n:])

    def __len__(self) -> int:
        return len(self.lengths)

    def rows(self, i: int) -> tuple[tuple["torch.Tensor", "torch.Tensor"], tuple["torch.Tensor", "torch.Tensor"]]:
        """Pair i as model input: ((input_ids, labels) chosen, (input_ids, labels) rejected)."""
        return self.sides.sample_row(i), self.sides.sample_row(len(self) + i)

    def collate(self, indices: "torch.Tensor | list[int]", pad_id: int) -> dict:
        """Pairs `indices` -> {"input_ids", "labels"} (2B, T): chosen rows, then rejected rows; "pair_ids" (B,)."""
        import torch

        indices = [int(i) for i in indices]
        batch = self.sides.collate(indices + [len(self) + i for i in indices], pad_id)
        batch["pair_ids"] = torch.tensor(indices, dtype=torch.int64)
        return batch

    @property
    def checksum(self) -> int:
        return self.sides.checksum

    @property
    def num_tokens(self) -> int:
        return self.sides.num_tokens

    @property
    def num_targets(self) -> int:
        return self.sides.num_targets


class PairLoader(InstructLoader):
    """`InstructLoader` over pairs; its padding counts the 2B rows of each batch."""

    def padding_fraction(self, epoch: Optional[int] = None) -> float:
        sides, n = self.samples.sides.lengths, len(self.samples)
        real = padded = 0
        for indices in self.batch_indices(self._epoch if epoch is None else epoch):
            rows = sides[indices.tolist() + (indices + n).tolist()]
            real += int(rows.sum())
            padded += int(rows.max()) * len(rows)
        return 1.0 - real / padded if padded else 0.0


class ReferenceLoader:
    """Every pair of `samples` once over all ranks, longest first, in batches of `micro_batch_size` pairs.

    Rank r takes batches r, r + world_size, ...; every rank gets ceil(batches / world_size) of them,
    so ranks whose share runs out repeat the last (shortest) batch: its pair_ids are the same, and
    so are its results. For one pass of a reference model whose results pair_ids index.
    """

    def __init__(self, samples: PairSamples, micro_batch_size: int, rank: int, world_size: int, pad_id: int) -> None:
        import torch

        if micro_batch_size < 1:
            raise UserError(f"micro_batch_size must be at least 1, got {micro_batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        self.samples, self.pad_id = samples, pad_id
        batches = list(torch.sort(samples.lengths, descending=True, stable=True).indices.split(micro_batch_size))
        count = math.ceil(len(batches) / world_size)
        self.batches = [batches[min(k * world_size + rank, len(batches) - 1)] for k in range(count)]

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[dict]:
        for indices in self.batches:
            yield self.samples.collate(indices, self.pad_id)


def tokenize_pairs(
    pairs: list[PreferencePair],
    tokenizer: "Tokenizer",
    template: Optional[ChatTemplate],
    style: PromptStyle,
    max_seq_length: int,
    keep_prompt_tokens: int,
    path: Path | str = "",
    what: str = "",
    train_reasoning: bool = True,
) -> tuple[PairSamples, dict[str, int]]:
    """Render, tokenize and mask both sides of every pair; fit them by the length rule (module docstring)."""
    sides: list[Optional[Side]] = [None] * (2 * len(pairs))
    span_stats = SpanStats()
    talks = [i for i, pair in enumerate(pairs) if pair.is_conversation]
    conversations = [side for i in talks for side in (pairs[i].chosen, pairs[i].rejected)]
    encoded = (encode_conversations(conversations, tokenizer, template, path, train_reasoning, span_stats, what)
               if talks else ())
    for k, (conversation, full, spans) in enumerate(encoded):
        pair = pairs[talks[k // 2]]
        # Trained: the assistant turns after the prompt (the prompt's own are context).
        in_prompt = sum(m["role"] == "assistant" for m in conversation.messages[: pair.prompt_messages])
        answer = spans[in_prompt:]
        flags = [False] * answer[-1][1]
        for a, b in answer:
            flags[a:b] = [True] * (b - a)
        sides[2 * talks[k // 2] + k % 2] = (full[: len(flags)], flags)
    for as_written in (False, True):
        texts = [i for i, pair in enumerate(pairs) if not pair.is_conversation and pair.as_written == as_written]
        examples = [side for i in texts for side in (pairs[i].chosen, pairs[i].rejected)]
        layout = AS_WRITTEN if as_written else style
        for k, (_, full, n_prompt) in enumerate(encode_examples(examples, tokenizer, layout, what)):
            first = max(n_prompt, 1)  # the response's tokens and EOS are trained
            sides[2 * texts[k // 2] + k % 2] = (full, [False] * first + [True] * (len(full) - first))

    limit = max_seq_length + 1
    chosen: list[Side] = []
    rejected: list[Side] = []
    stats = {"dropped": 0, "truncated": 0, "unclosed_turns": span_stats.unclosed_turns,
             "reasoning_not_rendered": span_stats.reasoning_not_rendered}
    first_dropped = ""
    for i, pair in enumerate(pairs):
        fitted, cut = fit_pair(sides[2 * i], sides[2 * i + 1], limit, keep_prompt_tokens, tokenizer.bos_id)
        if fitted is None:
            stats["dropped"] += 1
            first_dropped = first_dropped or pair.where
            continue
        stats["truncated"] += cut
        chosen.append(fitted[0])
        rejected.append(fitted[1])
    if talks:
        report_span_stats(span_stats, template, what)
    if stats["dropped"]:
        log.warning(
            "dropped %d of %d %s pairs (the first: %s): a response keeps no trained token within max_seq_length=%d",
            stats["dropped"], len(pairs), what, first_dropped or "?", max_seq_length,
        )
    both = chosen + rejected
    return PairSamples(ChatSamples([tokens for tokens, _ in both], [flags for _, flags in both])), stats


# ---------------------------------------------------------------------------------------------------
# The data modules


@dataclass
class Preference(Chat):
    """Preference pairs (a prompt, a chosen and a rejected response) for DPO, IPO, SimPO and ORPO.

    Args:
        json_path: the file: a JSON array of records, or one record per line (JSON Lines). Layouts
            (see `toolkit.data.preference`): {"prompt", "chosen", "rejected"} as texts or as messages,
            {"chosen", "rejected"} with the prompt implicit (their shared start), and LLaMA-Factory's
            {"conversations", "chosen": {message}, "rejected": {message}}.
        prompt_key: field holding the prompt.
        chosen_key: field holding the preferred response.
        rejected_key: field holding the other response.
        conversation_key: field holding the prompt's messages when a record has no prompt_key field
            (default: "conversations", LLaMA-Factory's).
        keep_prompt_tokens: a prompt too long for its pair is cut from its start, but keeps at least
            its last keep_prompt_tokens tokens; the responses are cut after that. Default: half of
            max_seq_length.
        format: how messages are written: "messages" ({"role", "content"}), "sharegpt" ({"from",
            "value"}), or "auto": told from the first message of each record.
        role_key, content_key, role_names, system_prompt, chat_template, template_variables,
            train_reasoning: as for `Chat`, for conversation pairs.
        prompt_style: the prompt style of text pairs with a prompt field (as for `Alpaca`); default:
            the model's. Text pairs without one are used as written.

    Shared options: val_split_fraction, val_path, seed, group_by_length. mask_prompt must stay true
    (the prompt is never trained) and packing false (the pairs of a batch are rows i and B + i).
    """

    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    keep_prompt_tokens: Optional[int] = None

    loader_class = PairLoader
    unit = "pair"

    def read_pairs(self, path: Path | str, what: str) -> list[PreferencePair]:
        read = _PairReader(self, path)
        return [read(record, where) for where, record in self.read_records(path, what)]

    def setup(self, tokenizer: "Tokenizer", max_seq_length: int, model: "Config | str" = "") -> None:
        """Read, check, split, render and tokenize the pairs (every rank; no files written).

        `model`: the Config of the model being tuned, or a preset name; it picks the built-in chat
        template and the prompt style when they are not given."""
        self._check_options(max_seq_length)
        if not self.mask_prompt:
            raise UserError("--data.mask_prompt false does not apply to preference data: the objectives compare the "
                            "responses' log-probabilities given the prompt, which is never trained")
        if self.packing:
            raise UserError("--data.packing does not apply to preference data: the chosen and the rejected sequence "
                            "of a pair are two rows of one batch")
        keep = self.keep_prompt_tokens if self.keep_prompt_tokens is not None else max_seq_length // 2
        if not 0 <= keep < max_seq_length:
            raise UserError(f"--data.keep_prompt_tokens must be between 0 and max_seq_length - 1 ({max_seq_length - 1}), "
                            f"got {keep}: the responses need room")
        start = time.perf_counter()
        style = resolve_style(self.prompt_style, model)
        train = self.read_pairs(self.json_path, "data file")
        if self.val_path is not None:
            val = self.read_pairs(self.val_path, "validation file")
        else:
            train, val = self._split(train)
        template = None
        if any(pair.is_conversation for pair in train + val):
            template = resolve_chat_template(tokenizer, self.chat_template, model, self.template_variables)
        if tokenizer.eos_id is None and not all(pair.is_conversation for pair in train + val):
            raise UserError(f"the tokenizer in {tokenizer.directory} has no EOS token; text pairs need one to end "
                            "their responses")
        log.info("preference data: %d training and %d validation pairs%s", len(train), len(val),
                 f", chat template: {template.origin}" if template is not None else "")
        self.template = template
        self.tokenizer_dir = Path(tokenizer.directory)
        self.max_seq_length = max_seq_length
        self.pad_id = pad_id_for(tokenizer)
        options = dict(tokenizer=tokenizer, template=template, style=style, max_seq_length=max_seq_length,
                       keep_prompt_tokens=keep, train_reasoning=self.train_reasoning)
        self._train, train_stats = tokenize_pairs(train, path=self.json_path, what="training", **options)
        self._val, val_stats = (
            tokenize_pairs(val, path=self.val_path or self.json_path, what="validation", **options)
            if val else (None, {"dropped": 0, "truncated": 0})
        )
        if len(self._train) == 0:
            raise UserError(f"no pair of {self.json_path} keeps a response token within max_seq_length={max_seq_length} "
                            f"({train_stats['dropped']} dropped); raise --train.max_seq_length")
        if self._val is not None and len(self._val) == 0:
            log.warning("every validation pair was dropped (no response token within max_seq_length); no validation")
            self._val = None
        lengths = self._train.sides.lengths
        self.stats = {
            "chat_template": template.origin if template is not None else None,
            "prompt_style": style.name,
            "train_samples": len(self._train),
            "val_samples": len(self._val) if self._val is not None else 0,
            "train_tokens": self._train.num_tokens,
            "train_target_tokens": self._train.num_targets,
            "max_length": int(lengths.max()),
            "mean_length": float(lengths.float().mean()),
            "dropped_train": train_stats["dropped"],
            "dropped_val": val_stats["dropped"],
            "truncated_train": train_stats["truncated"],
            "truncated_val": val_stats["truncated"],
        }
        log.info(
            "preference data ready in %.1f s: %d training pairs (%d tokens over both sides, %d in the loss, mean "
            "sequence length %.0f, longest %d), %d validation pairs; %d cut and %d dropped (max_seq_length=%d)",
            time.perf_counter() - start, self.stats["train_samples"], self.stats["train_tokens"],
            self.stats["train_target_tokens"], self.stats["mean_length"], self.stats["max_length"],
            self.stats["val_samples"], train_stats["truncated"] + val_stats["truncated"],
            train_stats["dropped"] + val_stats["dropped"], max_seq_length,
        )

    def num_pairs(self, split: Literal["train", "val"] = "train") -> int:
        """How many pairs `split` has (pair_ids run from 0 to this - 1); 0 for no validation."""
        samples = self._require_setup() if split == "train" else self._val
        return len(samples) if samples is not None else 0

    def reference_dataloader(
        self, split: Literal["train", "val"], micro_batch_size: int, rank: int = 0, world_size: int = 1
    ) -> Optional[ReferenceLoader]:
        """Every pair of `split` once over the ranks (`ReferenceLoader`); None when the split has no pairs."""
        samples = self._require_setup() if split == "train" else self._val
        if samples is None:
            return None
        return ReferenceLoader(samples, micro_batch_size, rank, world_size, self.pad_id)

    def output_tokenizer_dir(self, checkpoint_dir: Path, out_dir: Path) -> Path:
        """The checkpoint's tokenizer folder, or `<out_dir>/tokenizer` with the chat template written in
        (when conversations were rendered with a template that is not the checkpoint's)."""
        self._require_setup()
        if self.template is None:
            return Path(checkpoint_dir)
        return super().output_tokenizer_dir(checkpoint_dir, out_dir)


__all__ = [
    "PairLoader",
    "PairSamples",
    "Preference",
    "PreferencePair",
    "ReferenceLoader",
    "fit_pair",
    "shared_text_prompt",
    "tokenize_pairs",
]
