"""Chat mode of `toolkit generate`: replies laid out by the checkpoint's chat template.

    toolkit generate <checkpoint> --messages conversation.json    one reply to a conversation
    toolkit generate <checkpoint> --chat true                     an interactive multi-turn session

The prompt is the conversation rendered with `add_generation_prompt=True`, by the same template and
the same rendering as fine-tuning (`toolkit.data.chat_template`), so a model is prompted exactly as it
was trained. Generation stops at EOS or at the template's end-of-turn token (found by rendering a
probe conversation and taking the special token that closes its assistant turn).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from toolkit.data.chat import FORMATS, Conversation, assistant_spans, detect_format, parse_conversation
from toolkit.data.chat_template import ChatTemplate, TemplateRenderError
from toolkit.errors import UserError

if TYPE_CHECKING:

    from toolkit.tokenizer import Tokenizer

EXIT_COMMANDS = ("/exit", "/quit")
RESET_COMMAND = "/reset"


def read_messages(path: Path, system: Optional[str] = None) -> list[dict[str, str]]:
    """A conversation to answer, from a JSON file: an array of {"role", "content"} messages, or one
    record of the chat data formats ({"messages": [...]} or ShareGPT's {"conversations": [...]}).
    It must end with a user message."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--messages {path} does not exist; pass a JSON file with the conversation to answer")
    try:
        record = json.loads(path.read_text(encoding="utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"--messages {path} is not valid JSON ({err})") from None
    if isinstance(record, list):
        record = {"messages": record}
    spec = FORMATS[detect_format(record, path, "")]
    conversation = parse_conversation(record, path, "", spec, system, final_role="user", options=False)
    return conversation.as_dicts()


def end_of_turn_ids(template: ChatTemplate, tokenizer: "Tokenizer") -> set[int]:
    """The tokenizer's stop ids (EOS, generation_config.json's eos_token_id) and the special token
    that closes an assistant turn in this template (if it has one)."""
    stops = tokenizer.stop_ids
    probe = Conversation.of([{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."}], "probe")
    try:
        ids, spans, unclosed = assistant_spans(probe, template, tokenizer)
    except UserError:  # a template with stricter rules (e.g. a required system message): EOS only
        return stops
    if not unclosed:
        stops.add(ids[spans[-1][1] - 1])
    return stops


def prompt_ids(template: ChatTemplate, tokenizer: "Tokenizer", messages: list[dict[str, str]]) -> list[int]:
    """The tokens that prompt a reply to `messages`: rendered with the generation prompt, no BOS added."""
    try:
        text = template.render(messages, add_generation_prompt=True)
    except TemplateRenderError as err:
        raise UserError(f"the chat template ({template.origin}) fails to render the conversation: {err}") from None
    return tokenizer.encode_batch([text], bos=False)[0]


class ChatSession:
    """A model, its tokenizer and template, and the sampling settings: replies to conversations."""

    def __init__(self, model, tokenizer: "Tokenizer", template: ChatTemplate, device, max_new_tokens: int,
                 temperature: float, top_k: Optional[int], top_p: Optional[float], generator) -> None:
        self.model, self.tokenizer, self.template, self.device = model, tokenizer, template, device
        self.max_new_tokens, self.temperature, self.top_k, self.top_p = max_new_tokens, temperature, top_k, top_p
        self.generator = generator
        self.stop_ids = end_of_turn_ids(template, tokenizer)

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return prompt_ids(self.template, self.tokenizer, messages)

    def fits(self, prompt: list[int]) -> bool:
        return 0 < len(prompt) < self.model.config.block_size

    def reply(self, prompt: list[int]) -> tuple[str, int, float]:
        """(text of the reply, tokens generated, seconds) for a prompt from `prompt_ids`."""
        import torch

        from toolkit.sampling import generate_tokens

        encoded = torch.tensor(prompt, dtype=torch.int64, device=self.device)
        start = time.perf_counter()
        out = generate_tokens(self.model, encoded, self.max_new_tokens, self.temperature, self.top_k, self.top_p,
                              self.stop_ids, self.generator)
        seconds = time.perf_counter() - start
        new = out[len(prompt):].tolist()
        generated = len(new)
        if new and new[-1] in self.stop_ids:
            new = new[:-1]
        return self.tokenizer.decode(new).strip(), generated, seconds


def answer_messages(session: ChatSession, messages: list[dict[str, str]], num_samples: int) -> list[str]:
    """One reply (per sample) to a conversation from `read_messages`, printed."""
    prompt = session.prompt_ids(messages)
    if not session.fits(prompt):
        context = session.model.config.block_size
        raise UserError(f"the conversation is {len(prompt)} tokens; the model's context is {context}")
    replies = []
    for _ in range(num_samples):
        text, generated, seconds = session.reply(prompt)
        replies.append(text)
        print(text, flush=True)
        print(f"\n[{generated} tokens in {seconds:.2f} s: {generated / seconds:.1f} tokens/s]", flush=True)
    return replies


def interactive(session: ChatSession, system: Optional[str], read=input) -> list[str]:
    """Read user turns from `read` (stdin), answer each with the whole conversation so far as the prompt.

    /reset starts a new conversation; /exit, /quit or end of input ends the session. When the
    conversation outgrows the model's context, its oldest exchanges are dropped (the system message stays).
    """
    print(f"Chat template: {session.template.origin}. {RESET_COMMAND} starts over; {EXIT_COMMANDS[0]} or Ctrl-D ends.",
          flush=True)
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    replies = []
    while True:
        try:
            line = read("user> ")
        except EOFError:
            break
        if line.strip() in EXIT_COMMANDS:
            break
        if line.strip() == RESET_COMMAND:
            messages = list(start)
            print("[new conversation]", flush=True)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        prompt = session.prompt_ids(messages)
        while not session.fits(prompt) and len(messages) > len(start) + 1:
            del messages[len(start) : len(start) + 2]  # the oldest user turn and its reply
            print("[the conversation outgrew the context: dropped its oldest exchange]", flush=True)
            prompt = session.prompt_ids(messages)
        if not session.fits(prompt):
            print(f"[this message alone is {len(prompt)} tokens; the context is {session.model.config.block_size}]",
                  flush=True)
            messages.pop()
            continue
        text, _, _ = session.reply(prompt)
        print(f"assistant> {text}", flush=True)
        messages.append({"role": "assistant", "content": text or " "})
        replies.append(text)
    return replies
