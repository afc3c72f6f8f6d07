"""Chat data: multi-turn conversations, laid out by the model's own chat template, loss on assistant turns.

Records (a JSON array or JSON Lines, one conversation each) come in two formats, told apart from
the first record or chosen with `format`:

    messages:  {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...]}
    sharegpt:  {"conversations": [{"from": "system"|"human"|"gpt"|"tool", "value": "..."}, ...]}

A record may also carry "tools" (function definitions, passed to the template), and its messages
what the template reads besides: assistant "tool_calls" ([{"function": {"name", "arguments"}}];
the content may then be empty), reasoning ("reasoning_content", "thinking" or "reasoning"),
"name", "tool_call_id".

A conversation is rendered with the chat template (`toolkit.data.chat_template`: the checkpoint's
own, or a named one) and tokenized as `transformers` `apply_chat_template` tokenizes it, so the
model trains on exactly the tokens it is later prompted with.

How the loss mask is found (exact for any template, no `{% generation %}` markers needed)
------------------------------------------------------------------------------------------
The whole conversation is rendered once and tokenized with character offsets: ids(full). Each
assistant message m_i is then located inside that one rendering, so templates that render history
differently from the last turn (Qwen3 drops earlier <think> blocks, gpt-oss closes earlier turns
with <|end|> and the last with <|return|>, DeepSeek-R1 prompts with "<think>\n") train exactly
what the full rendering holds:

- start_i: where ids(prompt_i) stops agreeing with ids(full), prompt_i = render(m_0 .. m_{i-1},
  add_generation_prompt=True). The generation prompt's header is not trained; a token merging the
  header's end with the answer's start is (the model has to write it).
- the message's parts are searched for, in order, after start_i and before the next assistant
  message starts: its reasoning (`reasoning_content`, `thinking`, or a leading <think> block of the
  content; optional: templates drop it from earlier turns), its reply (the content, stripped), each
  tool call's name and arguments. **The reply and every tool call name must be found**, or the record
  is refused with one line: no message is ever trained with part of it silently missing.
- stop_i: just after the first special token that follows those parts and does not open a turn
  (the openers are the special tokens of the generation prompt: <|im_start|>, <|start|>, ...):
  <|im_end|>, <|eot_id|>, <|end|>, <|return|>, </s>. Separators after it are not trained. A template
  that closes turns with no special token gets the turn trained up to its last part (and a warning:
  nothing teaches the model to stop); one that closes only the last turn is refused.
- Turns that end with the next turn's opening tag (GLM-4.5: an assistant turn ends where `<|user|>` or
  `<|observation|>` begins, and the conversation's last turn ends with nothing): an earlier turn is
  trained through that tag, as any closing token. When the model's generation_config.json names the
  tag among its `eos_token_id`s (generation stops on it), the last assistant turn gets it too: the
  tag the template writes after such a turn when the conversation goes on (`next_turn_stops`: the
  user tag after a reply, the tool tag after tool calls) is appended to the sample and trained, so the
  model learns to stop there. Without such a generation config a single turn is trained with no stop
  (and the warning above) and a longer conversation is refused.

Trained: tokens start_i .. stop_i-1 of each assistant message; with train_reasoning=False, from the
end of its reasoning. Everything else (system, user and tool messages, headers) has its labels set
to IGNORE_INDEX; with mask_prompt=False every token is trained. The reasoning of the last assistant
message must be rendered when it is trained (a template that strips it, like DeepSeek-R1's, is
refused unless train_reasoning=False). Costs: 1 + 2 renders per assistant message, once at setup.

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

import bisect
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Literal, Optional

from toolkit.data.chat_template import (
    REASONING_KEYS, ChatTemplate, TemplateRenderError, resolve_chat_template, write_tokenizer_files,
)
from toolkit.data.instruct import (
    IGNORE_INDEX, InstructData, TokenizedSamples, _InstructOptions, _json_type, common_prefix, pad_id_for, sample_stats,
)
from toolkit.errors import UserError, closest

if TYPE_CHECKING:
    import torch

    from toolkit.models.config import Config
    from toolkit.tokenizer import Tokenizer

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class RecordFormat:
    """Where a format keeps its messages, and what its role names mean."""

    conversation_key: str
    role_key: str
    content_key: str
    roles: dict[str, str]


FORMATS: dict[str, RecordFormat] = {
    "messages": RecordFormat(
        "messages", "role", "content", {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
    ),
    "sharegpt": RecordFormat(
        "conversations", "from", "value",
        {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "tool": "tool"},
    ),
}

# Conversations per batch of renders handed to the tokenizer's batch encoder.
_CHUNK = 2_000


@dataclass(frozen=True)
class Conversation:
    """One record: its messages as the chat template takes them, and the tools it may call.

    Each message is a dict with "role" (one of ROLES) and "content", plus what the record's message
    carried besides (`tool_calls`, `reasoning_content` / `thinking`, `name`, `tool_call_id`, ...).
    `where` locates the record for messages.
    """

    messages: tuple[dict[str, Any], ...]
    where: str = ""
    tools: Optional[tuple[Any, ...]] = None

    @classmethod
    def of(cls, messages: list[dict[str, Any]], where: str = "", tools: Optional[list] = None) -> "Conversation":
        return cls(tuple(dict(m) for m in messages), where, None if tools is None else tuple(tools))

    def as_dicts(self) -> list[dict[str, Any]]:
        """The messages as a chat template (and transformers' apply_chat_template) takes them."""
        return [dict(m) for m in self.messages]

    @property
    def roles(self) -> list[str]:
        return [m["role"] for m in self.messages]


def split_reasoning(message: dict[str, Any]) -> tuple[str, str]:
    """(reasoning, reply) of an assistant message: the reasoning from `reasoning_content`, `thinking` or `reasoning`,
    else from a `<think>...</think>` block at the start of the content (read the way Qwen3's and
    DeepSeek-R1's templates read it); the reply is the content without that block."""
    content = message.get("content") or ""
    for key in REASONING_KEYS:
        if isinstance(message.get(key), str):
            return message[key], content
    if "</think>" in content:
        head, _, reply = content.partition("</think>")
        return head.split("<think>")[-1], reply
    return "", content


def _tool_call_parts(call: Any) -> tuple[Any, Any]:
    """(name, arguments) of a tool call, in OpenAI's {"function": {...}} form or flat {"name", "arguments"}."""
    if isinstance(call, dict) and isinstance(call.get("function"), dict):
        call = call["function"]
    if not isinstance(call, dict):
        return None, None
    return call.get("name"), call.get("arguments")


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
    final_role: Optional[str] = "assistant", options: bool = True,
) -> Conversation:
    """Check one record and turn it into a Conversation; any problem is one UserError line.

    `final_role`: the role the last message must have (training data ends with the assistant turn
    the model learns; a prompt for `generate` ends with the user message to answer); None: any.
    `options`: whether `--data.*` options can rename fields and roles (training data); without them
    (`generate --messages`) the messages ask for the standard names.
    """

    def bad(problem: str) -> UserError:
        return UserError(f"{f'{path} {where}'.strip()}: {problem}")

    def rename(option: str) -> str:
        return f"set --data.{option}" if options else "use that name"

    if not isinstance(record, dict):
        raise bad(f"is a JSON {_json_type(record)}; each record must be a JSON object")
    if spec.conversation_key not in record:
        fields = ", ".join(repr(k) for k in list(record)[:8]) or "none"
        raise bad(f"no messages: there is no {spec.conversation_key!r} field (its fields: {fields}); "
                  f"{rename('conversation_key')}")
    raw = record[spec.conversation_key]
    if not isinstance(raw, list):
        raise bad(f"no messages: {spec.conversation_key!r} is a JSON {_json_type(raw)}, expected an array of messages")
    if not raw:
        raise bad(f"no messages: {spec.conversation_key!r} is empty")
    tools = record.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise bad(f"'tools' is a JSON {_json_type(tools)}; expected an array of tool (function) definitions")
    messages: list[dict[str, Any]] = []
    for index, message in enumerate(raw):
        if not isinstance(message, dict):
            raise bad(f"message {index} is a JSON {_json_type(message)}; expected an object with "
                      f"{spec.role_key!r} and {spec.content_key!r}")
        if spec.role_key not in message:
            fields = ", ".join(repr(k) for k in list(message)[:8]) or "none"
            raise bad(f"message {index} has no {spec.role_key!r} field (its fields: {fields}); {rename('role_key')}")
        name = message[spec.role_key]
        role = spec.roles.get(name) if isinstance(name, str) else None
        if role is None:
            known = ", ".join(sorted(spec.roles))
            near = closest(name, list(spec.roles)) if isinstance(name, str) else []
            if options:
                target = spec.roles[near[0]] if near else "assistant"
                hint = f"map it with --data.role_names '{{\"{name}\": \"{target}\"}}'"
            else:
                hint = f"use one of those{f' (did you mean {near[0]!r}?)' if near else ''}"
            raise bad(f"message {index} has an unknown role {name!r} (known: {known}); {hint}")
        calls = message.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list) or not calls:
                raise bad(f"message {index} ({role}): 'tool_calls' must be a non-empty array on an assistant message")
            for number, call in enumerate(calls):
                call_name, arguments = _tool_call_parts(call)
                if not isinstance(call_name, str) or not call_name or not isinstance(arguments, (str, dict)):
                    raise bad(f"message {index} (assistant): tool call {number} needs a 'name' and 'arguments' "
                              "(an object or a JSON string), alone or under 'function'")
        if spec.content_key not in message and not calls:
            fields = ", ".join(repr(k) for k in list(message)[:8]) or "none"
            raise bad(f"message {index} has no {spec.content_key!r} field (its fields: {fields}); {rename('content_key')}")
        content = message.get(spec.content_key)
        if calls and content is None:
            pass  # a message that only calls tools
        elif not isinstance(content, str):
            raise bad(f"message {index} ({role}): {spec.content_key!r} is a JSON {_json_type(content)}, expected a string")
        elif not content.strip() and not calls:
            raise bad(f"message {index} ({role}) has empty content")
        for key in REASONING_KEYS:
            if key in message and message[key] is not None and not isinstance(message[key], str):
                raise bad(f"message {index} ({role}): {key!r} is a JSON {_json_type(message[key])}, expected a string")
        extra = {k: v for k, v in message.items() if k not in (spec.role_key, spec.content_key)}
        messages.append({"role": role, "content": content, **extra})  # rendered as `template_messages` says
    if final_role is not None and messages[-1]["role"] != final_role:
        why = "the turn the model learns to write" if final_role == "assistant" else "the message to answer"
        raise bad(f"the last message's role is {messages[-1]['role']!r}; a conversation must end with {final_role!r} ({why})")
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return Conversation.of(messages, where, tools)


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

    def sample_row(self, i: int) -> tuple["torch.Tensor", "torch.Tensor"]:
        """Sample i as model input: (input_ids, labels), int64; labels of untrained tokens are IGNORE_INDEX."""
        import torch

        seq = self.tokens_of(i).to(torch.int64)
        return seq[:-1], torch.where(self.trained_of(i)[1:], seq[1:], IGNORE_INDEX)

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


@dataclass
class SpanStats:
    """What locating the assistant spans of some conversations found, for the run's log."""

    unclosed_turns: int = 0  # turns the template ends with no special token
    reasoning_not_rendered: int = 0  # messages whose reasoning the template leaves out (earlier turns)


def assistant_spans(
    conversation: Conversation, template: ChatTemplate, tokenizer: "Tokenizer", path: Path | str = "",
    train_reasoning: bool = True,
) -> tuple[list[int], list[tuple[int, int]], int]:
    """(ids of the whole conversation, [(start, stop)] trained span per assistant message, turns without a special end).

    One conversation at a time; `tokenize_conversations` does the same over batches. The ids end with
    the stop token appended after the last turn where the template writes none (`next_turn_stops`).
    """
    texts = conversation_texts(conversation, template, path)
    stats = SpanStats()
    ids, spans = spans_from_encodings(conversation, texts, _encode(tokenizer, texts), tokenizer.special_ids, path,
                                      train_reasoning, stats, next_turn_stops(template, tokenizer))
    return ids, spans, stats.unclosed_turns


# Probe conversations for `next_turn_stops`: a reply, and a tool call, each followed by a next turn.
_PROBE_TOOL = {"type": "function", "function": {"name": "probe", "description": "A probe.",
                                                 "parameters": {"type": "object", "properties": {}}}}
_PROBES = {
    "reply": Conversation.of([{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."},
                              {"role": "user", "content": "Bye."}], "probe"),
    "tool_calls": Conversation.of(
        [{"role": "user", "content": "Hello."},
         {"role": "assistant", "content": "",
          "tool_calls": [{"type": "function", "function": {"name": "probe", "arguments": {"x": "1"}}}]},
         {"role": "tool", "content": "2"}], "probe", [_PROBE_TOOL]),
}


def next_turn_stops(template: ChatTemplate, tokenizer: "Tokenizer") -> dict[str, int]:
    """The stop token to train after a conversation's last assistant turn, for templates that end a
    turn only with the next turn's opening tag: {"reply": id, "tool_calls": id} (a turn with tool calls
    is followed by a tool turn). Each is the special token the template writes right after such a
    turn when the conversation goes on, kept only if the model's generation_config.json names it as
    an `eos_token_id` (`Tokenizer.generation_stop_ids`): GLM-4.5 gives {"reply": <|user|>,
    "tool_calls": <|observation|>}. Empty for a template that closes the last turn itself (its own
    end-of-turn token) and for a model whose generation config does not stop on the tag.
    """
    stops = {}
    if not tokenizer.generation_stop_ids:
        return stops
    for kind, probe in _PROBES.items():
        last = Conversation.of(list(probe.messages[:2]), "probe", list(probe.tools) if probe.tools else None)
        going_on, ending = SpanStats(), SpanStats()
        try:
            texts, last_texts = conversation_texts(probe, template), conversation_texts(last, template)
            ids, spans = spans_from_encodings(probe, texts, _encode(tokenizer, texts), tokenizer.special_ids,
                                              stats=going_on)
            spans_from_encodings(last, last_texts, _encode(tokenizer, last_texts), tokenizer.special_ids, stats=ending)
        except UserError:  # a template with stricter rules, or one that renders no tool calls
            continue
        stop = ids[spans[0][1] - 1]
        if not going_on.unclosed_turns and ending.unclosed_turns and stop in tokenizer.generation_stop_ids:
            stops[kind] = stop
    return stops


def conversation_texts(conversation: Conversation, template: ChatTemplate, path: Path | str = "") -> list[Optional[str]]:
    """[full, then per assistant message: prompt_i, history_i].

    prompt_i = render(m_0 .. m_{i-1}, add_generation_prompt=True): what the model is given to write m_i;
    history_i = the same without the generation prompt (None when the template refuses it), to tell
    the tokens that open a turn (the generation prompt's special tokens) from those that close one.
    """
    messages = conversation.as_dicts()
    tools = list(conversation.tools) if conversation.tools is not None else None
    where = f"{path} {conversation.where}".strip()
    try:
        texts: list[Optional[str]] = [template.render(messages, tools=tools)]
        for i, role in enumerate(conversation.roles):
            if role != "assistant":
                continue
            texts.append(template.render(messages[:i], add_generation_prompt=True, tools=tools))
            try:
                texts.append(template.render(messages[:i], tools=tools) if i else None)
            except TemplateRenderError:
                texts.append(None)
    except TemplateRenderError as err:
        raise UserError(f"{where}: the chat template ({template.origin}) fails to render it: {err}") from None
    return texts


def _encode(tokenizer: "Tokenizer", texts: list[Optional[str]]) -> list:
    """Encodings of `conversation_texts`: the full text with offsets, the others ids only (None stays None)."""
    present = [t for t in texts[1:] if t is not None]
    (full,) = tokenizer.encode_batch_offsets([texts[0]])
    others = iter(tokenizer.encode_batch(present, bos=False))
    return [full] + [next(others) if t is not None else None for t in texts[1:]]


def spans_from_encodings(
    conversation: Conversation, texts: list[Optional[str]], encodings: list, special_ids: frozenset[int],
    path: Path | str = "", train_reasoning: bool = True, stats: Optional[SpanStats] = None,
    trailing_stops: Optional[dict[str, int]] = None,
) -> tuple[list[int], list[tuple[int, int]]]:
    """The trained token span of each assistant message inside the whole rendered conversation.

    See the module docstring. `encodings[0]` is (ids, offsets) of the full text; then ids of prompt_i
    and history_i (or None) per assistant message. `trailing_stops` (`next_turn_stops`): the token
    appended to the ids, and trained, after a last assistant turn that the template leaves open.
    """
    stats = stats if stats is not None else SpanStats()
    where = f"{path} {conversation.where}".strip()
    text = texts[0]
    full, offsets = encodings[0]
    starts_char = [s for s, _ in offsets]
    ends_char = [max(e, s + 1) for s, e in offsets]  # no empty token ranges (trimmed offsets)
    assistants = [i for i, role in enumerate(conversation.roles) if role == "assistant"]

    def token_at(char: int) -> int:
        """The first token that ends after `char` (the token holding it)."""
        return bisect.bisect_right(ends_char, char)

    # Pass 1: where each assistant message starts (its generation prompt's tokens end) and what opens a turn.
    starts, openers = [], []
    for k in range(len(assistants)):
        prompt, history = encodings[1 + 2 * k], encodings[2 + 2 * k]
        starts.append(common_prefix(prompt, full))
        header = prompt[common_prefix(prompt, history):] if history is not None else []
        openers.append({t for t in header if t in special_ids})
    spans: list[tuple[int, int]] = []
    closed_flags = []
    previous_end = 0
    for k, i in enumerate(assistants):
        message = conversation.messages[i]
        start = starts[k]
        if start < previous_end or start >= len(full):
            raise UserError(
                f"{where}: the chat template renders the conversation before message {i} differently when later "
                "turns follow, so its assistant tokens cannot be told apart exactly; use a template that keeps "
                "earlier turns as they are (--data.chat_template)"
            )
        start_char = starts_char[start]
        bound_char = starts_char[starts[k + 1]] if k + 1 < len(assistants) and starts[k + 1] < len(full) else len(text)
        reasoning, reply = split_reasoning(message)
        reasoning, reply = reasoning.strip(), reply.strip()

        position = start_char
        reasoning_end = None
        if reasoning:
            found = text.find(reasoning, start_char, bound_char)
            after = found + len(reasoning)
            if found >= 0 and (not reply or text.find(reply, after, bound_char) >= 0):
                reasoning_end, position = after, after
            elif train_reasoning and i == len(conversation.messages) - 1:
                # Templates drop the reasoning of earlier turns (as they do at inference), never of the
                # turn being written, unless they cannot render reasoning at all.
                raise UserError(
                    f"{where}: the chat template does not render the reasoning of the last assistant message "
                    f"({i}), so it cannot be trained; set --data.train_reasoning false to train the reply alone, "
                    "or pass a template that renders reasoning (--data.chat_template)"
                )
            else:
                stats.reasoning_not_rendered += 1
        if reply:
            found = text.find(reply, position, bound_char)
            if found < 0:
                raise UserError(
                    f"{where}: assistant message {i}'s content is not in its turn as the chat template renders the "
                    "conversation: the template drops or rewrites it (e.g. a <think> block it strips, or a turn it renders only when last), so the message cannot "
                    "be trained as given"
                )
            position = found + len(reply)
        for number, call in enumerate(message.get("tool_calls") or ()):
            name, arguments = _tool_call_parts(call)
            found = text.find(name, position, bound_char)
            if found < 0:
                raise UserError(
                    f"{where}: assistant message {i}'s tool call {number} ({name!r}) is not in its turn as the chat "
                    "template renders the conversation; the template does not render tool calls this way (or at "
                    "all): pass a template that does (--data.chat_template)"
                )
            position = found + len(name)
            rendered = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
            found = text.find(rendered, position, bound_char)
            if found >= 0 and not any(t in openers[k] for t in full[token_at(position):token_at(found)]):
                position = found + len(rendered)
        # The turn ends at the first special token after what the message wrote that does not open
        # a turn (<|im_end|>, <|eot_id|>, <|end|>, <|return|>, </s>); none before the next opener: unclosed.
        last = token_at(position - 1) + 1
        stop_limit = starts[k + 1] if k + 1 < len(assistants) else len(full)
        end, closed = last, False
        for t in range(last, stop_limit):
            if full[t] in openers[k]:
                break
            if full[t] in special_ids:
                end, closed = t + 1, True
                break
        kind = "tool_calls" if message.get("tool_calls") else "reply"
        if not closed and trailing_stops and kind in trailing_stops and i == len(conversation.messages) - 1:
            full = full + [trailing_stops[kind]]  # what the model writes to stop (module docstring)
            end, closed = len(full), True
        closed_flags.append(closed)
        first = token_at(reasoning_end - 1) + 1 if (reasoning_end is not None and not train_reasoning) else start
        spans.append((max(first, 1), end))  # token 0 is never a label
        previous_end = end
    unclosed = closed_flags.count(False)
    if 0 < unclosed < len(spans):
        # Some turns end with a special token and others not: the template renders a turn differently
        # when it is the conversation's last (e.g. closes only that one).
        raise UserError(
            f"{where}: the chat template renders an assistant turn differently when it is the last message, so "
            "the end of its other turns cannot be told apart exactly; use a template that keeps earlier turns "
            "as they are (--data.chat_template), or, if the model stops on the tag that opens the next turn, "
            "name that tag's id in eos_token_id of the tokenizer folder's generation_config.json"
        )
    stats.unclosed_turns += unclosed
    return full, spans


def encode_conversations(
    conversations: list[Conversation], tokenizer: "Tokenizer", template: ChatTemplate, path: Path | str = "",
    train_reasoning: bool = True, stats: Optional[SpanStats] = None, what: str = "",
) -> Iterator[tuple[Conversation, list[int], list[tuple[int, int]]]]:
    """(conversation, ids of its whole rendering, trained span of each assistant message) per conversation,
    in order; rendered and tokenized in batches (`assistant_spans` does one at a time)."""
    special_ids = tokenizer.special_ids
    stats = stats if stats is not None else SpanStats()
    trailing_stops = next_turn_stops(template, tokenizer)
    chunks = range(0, len(conversations), _CHUNK)
    for start in chunks:
        part = conversations[start : start + _CHUNK]
        texts = [conversation_texts(c, template, path) for c in part]
        fulls = tokenizer.encode_batch_offsets([group[0] for group in texts])
        rest = iter(tokenizer.encode_batch([t for group in texts for t in group[1:] if t is not None], bos=False))
        for conversation, group, full_encoding in zip(part, texts, fulls):
            encodings = [full_encoding] + [next(rest) if t is not None else None for t in group[1:]]
            full, spans = spans_from_encodings(conversation, group, encodings, special_ids, path, train_reasoning, stats,
                                               trailing_stops)
            yield conversation, full, spans
        if len(chunks) > 1:
            log.info("tokenized %s conversations: %d/%d", what, min(start + _CHUNK, len(conversations)), len(conversations))


def report_span_stats(stats: SpanStats, template: ChatTemplate, what: str) -> None:
    """Log what locating the assistant turns found that the user should know (`SpanStats`)."""
    if stats.reasoning_not_rendered:
        log.info(
            "%d assistant messages of the %s data carry reasoning that the chat template does not render (it keeps "
            "reasoning only in the latest turns): that reasoning is not trained",
            stats.reasoning_not_rendered, what,
        )
    if stats.unclosed_turns:
        log.warning(
            "%d assistant turns of the %s data end with no special token in this chat template (%s): the whole "
            "turn is trained, and nothing teaches the model where to stop; prefer a template that closes turns "
            "with an end-of-turn or EOS token",
            stats.unclosed_turns, what, template.origin,
        )


def tokenize_conversations(
    conversations: list[Conversation],
    tokenizer: "Tokenizer",
    template: ChatTemplate,
    max_seq_length: int,
    mask_prompt: bool,
    path: Path | str = "",
    what: str = "",
    train_reasoning: bool = True,
) -> tuple[ChatSamples, dict[str, int]]:
    """Render, tokenize and mask every conversation; cut long ones at turn boundaries (module docstring)."""
    limit = max_seq_length + 1
    sequences: list[list[int]] = []
    trained: list[list[bool]] = []
    stats = {"dropped": 0, "truncated": 0, "unclosed_turns": 0, "reasoning_not_rendered": 0}
    span_stats = SpanStats()
    first_dropped = ""
    for conversation, full, spans in encode_conversations(conversations, tokenizer, template, path, train_reasoning,
                                                          span_stats, what):
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
    stats["unclosed_turns"] = span_stats.unclosed_turns
    stats["reasoning_not_rendered"] = span_stats.reasoning_not_rendered
    report_span_stats(span_stats, template, what)
    if stats["dropped"]:
        log.warning(
            "dropped %d of %d %s conversations (the first: %s): their first assistant turn does not end within "
            "max_seq_length=%d tokens",
            stats["dropped"], len(conversations), what, first_dropped or "?", max_seq_length,
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
        template_variables: extra variables for the template, typed as JSON/YAML values: e.g.
            {"enable_thinking": false} for Qwen3, {"reasoning_effort": "high"} for gpt-oss,
            {"date_string": "26 Jul 2024"} for Llama 3's system header (otherwise the date of the run).
            A quoted "true"/"false" is refused: a template would read the string "false" as true.
        train_reasoning: whether the reasoning of assistant messages (`reasoning_content`, `thinking`, or
            a leading <think>...</think> block of the content) is trained where the template renders it
            (true), or only the reply after it (false; the reasoning stays in the input).

    Shared options (see `InstructData`): mask_prompt (true: loss on assistant turns only; false: on
    every token), val_split_fraction, val_path, seed, group_by_length, packing. prompt_style does
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
    # A plain dict: jsonargparse keeps JSON/YAML values as written (dict[str, Any] would re-read the
    # strings "3", "no", "false" as a number and booleans).
    template_variables: Optional[dict] = None
    train_reasoning: bool = True

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

    def setup(self, tokenizer: "Tokenizer", max_seq_length: int, model: "Config | str" = "") -> None:
        """Read, check, split, render and tokenize the conversations (every rank; no files written).

        `model`: the Config of the model being tuned, or a preset name; it picks the built-in chat
        template when neither --data.chat_template nor the checkpoint names one."""
        self._check_options(max_seq_length)
        if self.prompt_style is not None:
            raise UserError(
                "--data.prompt_style does not apply to Chat data: the chat template lays conversations out; "
                "choose one with --data.chat_template"
            )
        start = time.perf_counter()
        template = resolve_chat_template(tokenizer, self.chat_template, model, self.template_variables)
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
            train, tokenizer, template, max_seq_length, self.mask_prompt, self.json_path, "training",
            self.train_reasoning,
        )
        no_val = {"dropped": 0, "truncated": 0, "unclosed_turns": 0, "reasoning_not_rendered": 0}
        self._val, val_stats = (
            tokenize_conversations(val, tokenizer, template, max_seq_length, self.mask_prompt,
                                   self.val_path or self.json_path, "validation", self.train_reasoning)
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
    "encode_conversations",
    "parse_conversation",
    "tokenize_conversations",
]
