"""Chat masks for today's templates, token by token against transformers: Qwen3 (multi-turn, with and
without reasoning, enable_thinking on and off, tool calls), gpt-oss (multi-turn, thinking, tool
calls), a DeepSeek-R1 distill (its generation prompt opens <think>) and Llama 3.1 tool use.

The templates are the published ones (tests/assets/README.md). Their tokenizers are too large to
keep, so each test pairs its template with a small byte-level BPE trained here that holds the
template's control tokens. Expected ids are `apply_chat_template`'s; the expected mask is computed
from transformers' rendering and transformers' own character-to-token map (as it computes
`assistant_masks`), over the characters each assistant message writes: everything after its
generation prompt up to and including the special token that ends the turn. With
train_reasoning=False the reasoning text is left out.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import ASSETS
from toolkit.data.chat import Chat, Conversation, assistant_spans, tokenize_conversations
from toolkit.data.chat_template import resolve_chat_template
from toolkit.errors import UserError
from toolkit.tokenizer import Tokenizer

TEMPLATES = ASSETS / "chat_templates"

# Per template: control tokens (special), other added tokens, the config's BOS/EOS/PAD, and the
# expected trained text of each assistant message as a regex over the rendered conversation: group
# "gen" is what the model writes (the generation prompt ends right before it).
SETUPS = {
    "qwen3": dict(
        special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        added=["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
        config={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        turn=r"<\|im_start\|>assistant\n(?P<gen>.*?<\|im_end\|>)",
    ),
    "gpt-oss": dict(
        special=["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                 "<|constrain|>", "<|return|>", "<|call|>"],
        added=[],
        config={"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"},
        # One assistant message may write an analysis block, then its final or tool-call block.
        turn=(r"(?<=<\|end\|>)<\|start\|>assistant(?P<gen>"
              r"(?:<\|channel\|>analysis<\|message\|>[^<]*<\|end\|><\|start\|>assistant)?"
              r"(?: to=functions\.\w+)?<\|channel\|>(?:final|commentary json)<\|message\|>[^<]*"
              r"(?:<\|end\|>|<\|return\|>))"),
    ),
    "deepseek-r1-distill": dict(
        special=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
        added=["<think>", "</think>"],
        config={"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
        turn=r"<｜Assistant｜>(?P<gen>.*?<｜end▁of▁sentence｜>)",
    ),
    "llama3.1": dict(
        special=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                 "<|eom_id|>", "<|python_tag|>"],
        added=[],
        config={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        turn=r"<\|start_header_id\|>assistant<\|end_header_id\|>\n\n(?P<gen>.*?<\|eot_id\|>)",
    ),
    # GLM-4.5's layout (a template written for these tests): no turn is closed; the model stops on the
    # next turn's tag, which its generation_config.json names among its EOS ids ("stops").
    "glm4.5-style": dict(
        special=["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"],
        added=["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
               "</arg_value>", "<tool_response>", "</tool_response>"],
        config={"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
        stops=["<|endoftext|>", "<|user|>", "<|observation|>"],
    ),
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city."}},
                       "required": ["city"]},
    },
}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}

U1 = {"role": "user", "content": "What is the capital of France?"}
U2 = {"role": "user", "content": "And of Italy?"}
PLAIN = [U1, {"role": "assistant", "content": "Paris."}, U2, {"role": "assistant", "content": "Rome, since 1871."}]


def _reasoning(key: str) -> list[dict]:
    return [U1, {"role": "assistant", "content": "Paris.", key: "France's capital is Paris."}, U2,
            {"role": "assistant", "content": "Rome, since 1871.", key: "Italy's capital is Rome; it has been since 1871."}]


TOOL_USE = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "content": '{"temperature": 21, "sky": "clear"}'},
    {"role": "assistant", "content": "It is 21 degrees and clear in Paris."},
]
# Each case: template, label, messages, tools, template variables.
CASES = [
    ("qwen3", "two turns", PLAIN, None, {}),
    ("qwen3", "two turns, reasoning_content", _reasoning("reasoning_content"), None, {}),
    ("qwen3", "two turns, enable_thinking false", PLAIN, None, {"enable_thinking": False}),
    ("qwen3", "reasoning as a <think> block in the content",
     [U1, {"role": "assistant", "content": "<think>\nFrance's capital.\n</think>\n\nParis."}], None, {}),
    ("qwen3", "tool use", [m for m in TOOL_USE if m["role"] != "system"], [WEATHER_TOOL], {}),
    ("gpt-oss", "two turns", PLAIN, None, {"reasoning_effort": "low"}),
    ("gpt-oss", "two turns, thinking", _reasoning("thinking"), None, {}),
    ("gpt-oss", "tool use with thinking",
     [TOOL_USE[1], {"role": "assistant", "content": None, "thinking": "I should look it up.", "tool_calls": [CALL]},
      TOOL_USE[3], {"role": "assistant", "content": TOOL_USE[4]["content"], "thinking": "Report it."}],
     [WEATHER_TOOL], {}),
    ("deepseek-r1-distill", "one turn", PLAIN[:2], None, {}),
    ("deepseek-r1-distill", "two turns with a system message", [TOOL_USE[0], *PLAIN], None, {}),
    ("llama3.1", "tool use", TOOL_USE, [WEATHER_TOOL], {"date_string": "26 Jul 2024"}),
]


def _corpus() -> str:
    texts = json.dumps([CASES, WEATHER_TOOL], ensure_ascii=False)
    return "\n".join([texts, "You are ChatGPT, a large language model trained by OpenAI. Reasoning: medium "
                      "Knowledge cutoff Current date Valid channels analysis commentary final functions namespace"] * 3)


def _tokenizer_dir(name: str, root: Path) -> Path:
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    setup = SETUPS[name]
    out = root / name
    out.mkdir()
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=len(setup["special"]) + 700, special_tokens=setup["special"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_corpus()], trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in setup["added"]])
    tok.save(str(out / "tokenizer.json"))
    template = (TEMPLATES / name / "chat_template.jinja").read_text(encoding="utf-8")
    config = {**setup["config"], "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template}
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    if "stops" in setup:
        stops = [tok.token_to_id(t) for t in setup["stops"]]
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}), encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reasoning_tokenizers")
    return {name: _tokenizer_dir(name, root) for name in SETUPS}


def _expected_mask(name, hf, messages, tools, variables, train_reasoning) -> tuple[list[int], list[int]]:
    """(ids, mask) from transformers: the rendered text, its tokens, and the characters each
    assistant message writes (SETUPS' regex), mapped to tokens as transformers maps generation blocks."""
    text = hf.apply_chat_template(messages, tools=tools, tokenize=False, **variables)
    encoding = hf(text, add_special_tokens=False)
    ids = encoding["input_ids"]
    turns = list(re.finditer(SETUPS[name]["turn"], text, flags=re.DOTALL))
    assistants = [m for m in messages if m["role"] == "assistant"]
    assert len(turns) == len(assistants), (name, text)
    mask = [0] * len(ids)
    for match, message in zip(turns, assistants):
        start, stop = match.span("gen")
        if name == "qwen3" and variables.get("enable_thinking") is False and message is messages[-1]:
            assert text.startswith("<think>\n\n</think>\n\n", start)  # given by the generation prompt
            start += len("<think>\n\n</think>\n\n")
        reasoning = message.get("reasoning_content") or message.get("thinking")
        if not reasoning and "</think>" in (message.get("content") or ""):
            reasoning = message["content"].split("</think>")[0].split("<think>")[-1].strip()
        if reasoning and not train_reasoning and reasoning in text[start:stop]:
            start = text.index(reasoning, start) + len(reasoning)
        for char in range(start, stop):
            token = encoding.char_to_token(char)
            if token is not None:
                mask[token] = 1
    mask[0] = 0  # the first token is never a label
    return ids, mask


@pytest.mark.parametrize("train_reasoning", [True, False], ids=["reasoning trained", "reply only"])
@pytest.mark.parametrize("name, label, messages, tools, variables", CASES, ids=[f"{c[0]}: {c[1]}" for c in CASES])
def test_ids_and_masks_equal_transformers(name, label, messages, tools, variables, train_reasoning, tokenizer_dirs):
    from transformers import AutoTokenizer

    directory = tokenizer_dirs[name]
    hf = AutoTokenizer.from_pretrained(directory)
    tokenizer = Tokenizer(directory)
    template = resolve_chat_template(tokenizer, variables=variables)
    expected_ids, expected_mask = _expected_mask(name, hf, messages, tools, variables, train_reasoning)
    assert hf.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False, **variables) == expected_ids

    ids, spans, unclosed = assistant_spans(Conversation.of(messages, "test", tools), template, tokenizer,
                                           train_reasoning=train_reasoning)
    assert ids == expected_ids, f"{name} {label}: rendered ids differ from apply_chat_template"
    assert unclosed == 0 and len(spans) == len([m for m in messages if m["role"] == "assistant"])
    mask = [0] * len(ids)
    for start, stop in spans:
        mask[start:stop] = [1] * (stop - start)
    for position, (mine, theirs) in enumerate(zip(mask, expected_mask, strict=True)):
        assert mine == theirs, (
            f"{name} {label}: token {position} {hf.convert_ids_to_tokens(ids[position])!r} is "
            f"{'trained' if mine else 'masked'} here, {'trained' if theirs else 'masked'} by the oracle\n"
            f"{hf.decode(ids[max(0, position - 8): position + 8])!r}"
        )
    # Whatever the oracle says, each assistant message's content is inside its trained span.
    for (start, stop), message in zip(spans, [m for m in messages if m["role"] == "assistant"]):
        written = tokenizer.decode(ids[start:stop], skip_special_tokens=False)
        reply = (message.get("content") or "").split("</think>")[-1].strip()
        assert reply in written, (reply, written)
        for call in message.get("tool_calls", ()):
            assert call["function"]["name"] in written


def test_gpt_oss_earlier_turns_train_their_reply_and_end_of_turn(tokenizer_dirs):
    """The gpt-oss case that failed: a turn closed by <|end|> in the conversation (<|return|> when last)
    was cut back to its header. Each turn now trains its reply and its own end token."""
    tokenizer = Tokenizer(tokenizer_dirs["gpt-oss"])
    template = resolve_chat_template(tokenizer)
    ids, spans, _ = assistant_spans(Conversation.of(PLAIN, "test"), template, tokenizer)
    texts = [tokenizer.decode(ids[a:b], skip_special_tokens=False) for a, b in spans]
    assert texts == ["<|channel|>final<|message|>Paris.<|end|>",
                     "<|channel|>final<|message|>Rome, since 1871.<|return|>"]


def test_deepseek_r1_reasoning_the_template_drops_is_refused_unless_only_the_reply_is_trained(tokenizer_dirs, tmp_path):
    """The R1-distill template strips a <think> block from every assistant turn, the last included:
    training its reasoning is impossible, which is one line; train_reasoning=False trains the reply."""
    tokenizer = Tokenizer(tokenizer_dirs["deepseek-r1-distill"])
    record = {"messages": [U1, {"role": "assistant", "content": "<think>\nIt is Paris.\n</think>\n\nParis."}]}
    path = tmp_path / "r1.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(UserError, match=r"line 1: the chat template does not render the reasoning of the last "
                                        r"assistant message \(1\).*--data.train_reasoning false") as caught:
        Chat(json_path=path, val_split_fraction=0).setup(tokenizer, max_seq_length=128)
    assert "\n" not in str(caught.value)
    data = Chat(json_path=path, val_split_fraction=0, train_reasoning=False)
    data.setup(tokenizer, max_seq_length=128)
    batch = next(iter(data.train_dataloader(micro_batch_size=1, seed=0)))
    targets = batch["labels"][batch["labels"] >= 0].tolist()
    # The template writes what follows </think> ("\n\nParis."); the reasoning is in neither input nor loss.
    assert tokenizer.decode(targets, skip_special_tokens=False) == "\n\nParis.<｜end▁of▁sentence｜>"


def test_a_tool_use_file_trains_calls_through_the_data_module(tokenizer_dirs, tmp_path):
    """Records with a tools list, tool_calls and tool messages go through Chat (the JSON-string form of
    arguments too) and train the call as the template writes it."""
    tokenizer = Tokenizer(tokenizer_dirs["qwen3"])
    messages = [dict(m) for m in TOOL_USE]
    messages[2] = {"role": "assistant", "tool_calls": [{"function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Paris"}'}}]}
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps({"messages": messages, "tools": [WEATHER_TOOL]}) + "\n")
    data = Chat(json_path=path, val_split_fraction=0)
    data.setup(tokenizer, max_seq_length=512)
    batch = next(iter(data.train_dataloader(micro_batch_size=1, seed=0)))
    labels = batch["labels"][0]
    trained = tokenizer.decode(labels[labels >= 0].tolist(), skip_special_tokens=False)
    assert trained.count("<|im_end|>") == 2
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in trained
    assert "temperature" not in trained and "Weather in Paris?" not in trained  # tool result, user: not trained


@pytest.mark.parametrize(
    "message, problem",
    [
        ({"role": "assistant", "tool_calls": "get_weather"}, "'tool_calls' must be a non-empty array"),
        ({"role": "assistant", "tool_calls": [{"function": {"name": "x"}}]}, "tool call 0 needs a 'name' and 'arguments'"),
        ({"role": "user", "content": "hi", "tool_calls": [CALL]}, r"message 1 \(user\): 'tool_calls' must be"),
        ({"role": "assistant", "content": "x", "thinking": ["a"]}, r"'thinking' is a JSON array, expected a string"),
    ],
)
def test_bad_tool_and_reasoning_fields_are_one_line(tokenizer_dirs, tmp_path, message, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": [U1, message, {"role": "assistant", "content": "ok"}]}) + "\n")
    with pytest.raises(UserError, match=problem) as caught:
        Chat(json_path=path, val_split_fraction=0).setup(Tokenizer(tokenizer_dirs["qwen3"]), max_seq_length=128)
    assert "\n" not in str(caught.value) and "line 1" in str(caught.value)


GLM = "glm4.5-style"
GLM_CASES = {
    "one turn": PLAIN[:2],
    "two turns": PLAIN,
    "two turns with reasoning": _reasoning("reasoning_content"),
    "tool use": TOOL_USE,
    "ending in a tool call": TOOL_USE[:3],
}


@pytest.mark.parametrize("label", list(GLM_CASES))
def test_turns_that_end_with_the_next_tag_train_it_and_the_last_turn_trains_the_generation_stop(label, tokenizer_dirs):
    """GLM-4.5's layout: every assistant turn is trained from its generation prompt (<|assistant|>) through
    the tag that opens the next turn (<|user|>, or <|observation|> after tool calls); the last turn,
    which the template leaves open, is followed by the tag the template would write next, one of the
    EOS ids of generation_config.json, appended and trained. The rest of the ids are transformers'."""
    from transformers import AutoTokenizer

    messages = GLM_CASES[label]
    directory = tokenizer_dirs[GLM]
    hf = AutoTokenizer.from_pretrained(directory)
    tokenizer = Tokenizer(directory)
    template = resolve_chat_template(tokenizer)
    tools = [WEATHER_TOOL] if any(m.get("tool_calls") for m in messages) else None
    text = hf.apply_chat_template(messages, tools=tools, tokenize=False)
    encoding = hf(text, add_special_tokens=False)
    stop = "<|observation|>" if messages[-1].get("tool_calls") else "<|user|>"
    expected_ids = encoding["input_ids"] + [hf.convert_tokens_to_ids(stop)]
    # Oracle: the characters after each <|assistant|> up to and including the next role tag (the
    # appended stop for the last turn), mapped to tokens by transformers.
    expected_mask = [0] * len(expected_ids)
    for match in re.finditer(r"<\|assistant\|>(?P<gen>.*?(?:<\|user\|>|<\|observation\|>|$))", text, flags=re.DOTALL):
        for char in range(*match.span("gen")):
            token = encoding.char_to_token(char)
            if token is not None:
                expected_mask[token] = 1
    expected_mask[-1] = 1

    ids, spans, unclosed = assistant_spans(Conversation.of(messages, "test", tools), template, tokenizer)
    assert ids == expected_ids and unclosed == 0
    assert len(spans) == len([m for m in messages if m["role"] == "assistant"])
    mask = [0] * len(ids)
    for start, stop_ in spans:
        mask[start:stop_] = [1] * (stop_ - start)
    assert mask == expected_mask, [hf.convert_ids_to_tokens(i) for i, m in zip(ids, mask) if m]
    # The batch path (the data module's) gives the same sequence and mask.
    samples, stats = tokenize_conversations([Conversation.of(messages, "test", tools)], tokenizer, template,
                                            max_seq_length=512, mask_prompt=True)
    assert samples.tokens_of(0).tolist() == ids and samples.trained_of(0).tolist()[1:] == [bool(m) for m in mask[1:]]
    assert stats["unclosed_turns"] == 0


def test_without_a_generation_config_naming_the_tag_the_old_rules_hold(tokenizer_dirs, tmp_path):
    """The same template with no generation_config.json: nothing says the model stops on <|user|>, so a
    single turn is trained with no stop (counted as unclosed, with the warning) and a longer
    conversation is refused in one line that says what would make it trainable."""
    import shutil

    directory = tmp_path / "no-generation-config"
    shutil.copytree(tokenizer_dirs[GLM], directory)
    (directory / "generation_config.json").unlink()
    tokenizer = Tokenizer(directory)
    template = resolve_chat_template(tokenizer)
    ids, spans, unclosed = assistant_spans(Conversation.of(PLAIN[:2], "test"), template, tokenizer)
    assert unclosed == 1 and spans[-1][1] == len(ids) and ids[-1] != tokenizer.token_to_id("<|user|>")
    with pytest.raises(UserError, match="generation_config.json") as caught:
        assistant_spans(Conversation.of(PLAIN, "test"), template, tokenizer)
    assert "\n" not in str(caught.value)
