"""Chat data: rendering parity with transformers' apply_chat_template on real templates, exact
assistant-only masks, record errors, formats, truncation at turn boundaries, and the loader."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import pytest
import torch

from conftest import ASSETS, data_from_cli
from toolkit.data.chat import Chat, Conversation, assistant_spans
from toolkit.data.chat_template import CHAT_TEMPLATES, resolve_chat_template
from toolkit.data.instruct import IGNORE_INDEX, InstructData
from toolkit.errors import UserError
from toolkit.tokenizer import Tokenizer

TEMPLATES = ASSETS / "chat_templates"
LLAMA2 = ASSETS / "tokenizers" / "llama2"
FASTCHAT = ASSETS / "instruct" / "fastchat_dummy_conversation.json"
DATE = "26 Jul 2024"  # Llama 3.2's header shows the date; fixed so both sides render the same text

SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one line."}
CONVERSATIONS = {
    "two turns": [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome, since 1871."},
    ],
    "three turns, odd text": [
        {"role": "user", "content": "  Write {{ x }} in Jinja, then a list:\n- a\n- b  "},
        {"role": "assistant", "content": "`{{ x }}` prints x.\n\n1. a\n2. b\n"},
        {"role": "user", "content": "Grüße auf Deutsch? 👋"},
        {"role": "assistant", "content": "Viele Grüße! 👋 Ça va?"},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "  Done.  "},
    ],
    "one turn": [
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "Hi!"},
    ],
}

# Each real template, patched with transformers' {% generation %} markers around what the masks
# should cover (assistant content + end-of-turn token): transformers then computes the expected
# mask itself (return_assistant_tokens_mask), independently of the toolkit's prefix method.
PATCHES = {
    "qwen2.5": (
        r"{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}",
        r"{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\n' }}{% generation %}"
        r"{{- message.content + '<|im_end|>' }}{% endgeneration %}{{- '\n' }}"
        r"{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}{%- endif %}",
    ),
    "llama3.2": (
        r"{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}",
        r"{%- if message['role'] == 'assistant' %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
        r"{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
        r"{%- else %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
        r" + '<|eot_id|>' }}{%- endif %}",
    ),
    "gemma": (  # this template's string literals hold real line breaks, not "\\n"
        "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}",
        "{% if role == 'model' %}{{ '<start_of_turn>model\n' }}{% generation %}{{ message['content'] | trim"
        " + '<end_of_turn>' }}{% endgeneration %}{{ '\n' }}{% else %}{{ '<start_of_turn>' + role + '\n'"
        " + message['content'] | trim + '<end_of_turn>\n' }}{% endif %}",
    ),
    "llama2-chat": (
        r"{{ ' '  + content.strip() + ' ' + eos_token }}",
        r"{% generation %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endgeneration %}",
    ),
    "mistral-v0.2": (
        r"{{ message['content'] + eos_token}}",
        r"{% generation %}{{ message['content'] + eos_token}}{% endgeneration %}",
    ),
}
# What each template needs: its config file, whether it accepts a system message, the tokenizer.
SETUPS = {
    "qwen2.5": ("qwen2.5/tokenizer_config.json", True, "small"),
    "llama3.2": ("llama3.2/tokenizer_config.json", True, "small"),
    "gemma": ("gemma/tokenizer_config.json", False, "small"),  # raises on a system role
    "llama2-chat": ("llama2-chat/llama2.json", True, "llama2"),  # <<SYS>> folded into the first [INST]
    "mistral-v0.2": ("mistral-v0.2/tokenizer_config.json", False, "llama2"),
}


def _corpus() -> str:
    texts = [m["content"] for conv in CONVERSATIONS.values() for m in conv] + [SYSTEM["content"]]
    texts += ["system user assistant model Cutting Knowledge Date Today", "You are Qwen, created by Alibaba Cloud."]
    return "\n".join(texts * 3)


def _make_tokenizer_dir(name: str, root: Path) -> Path:
    """A folder that both the toolkit and transformers load: tokenizer.json, tokenizer_config.json.

    Templates whose repositories' tokenizer.json is not kept get a small byte-level BPE tokenizer
    trained here that holds the template's special tokens (from its added_tokens_decoder).
    """
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    config_file, _, kind = SETUPS[name]
    real = json.loads((TEMPLATES / config_file).read_text())
    out = root / name
    out.mkdir()
    if kind == "small":
        added = sorted(((int(i), t) for i, t in real["added_tokens_decoder"].items()), key=lambda pair: pair[0])
        specials = [t["content"] for _, t in added if t["special"]]
        tok = RustTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=len(specials) + 600, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator([_corpus()], trainer)
        tok.save(str(out / "tokenizer.json"))
        config = {k: real.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token") if real.get(k) in specials}
    else:
        (out / "tokenizer.json").write_bytes((LLAMA2 / "tokenizer.json").read_bytes())
        llama2 = json.loads((LLAMA2 / "tokenizer_config.json").read_text())
        config = {k: llama2[k] for k in ("bos_token", "eos_token", "unk_token")}
    config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=real["chat_template"])
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat_tokenizers")
    return {name: _make_tokenizer_dir(name, root) for name in SETUPS}


def _cases(name: str) -> list[tuple[str, list[dict]]]:
    cases = list(CONVERSATIONS.items())
    if SETUPS[name][1]:
        cases += [(f"{label} + system", [SYSTEM, *conv]) for label, conv in CONVERSATIONS.items()]
    return cases


def _conversation(messages: list[dict]) -> Conversation:
    return Conversation.of(messages, "test")


def _mask(length: int, spans: list[tuple[int, int]]) -> list[int]:
    mask = [0] * length
    for start, stop in spans:
        mask[start:stop] = [1] * (stop - start)
    return mask


@pytest.mark.parametrize("name", list(SETUPS))
def test_rendered_ids_and_assistant_masks_equal_transformers(name, tokenizer_dirs):
    from transformers import AutoTokenizer

    directory = tokenizer_dirs[name]
    hf = AutoTokenizer.from_pretrained(directory)
    tokenizer = Tokenizer(directory)
    variables = {"date_string": DATE} if name == "llama3.2" else {}
    template = resolve_chat_template(tokenizer, variables=variables)
    assert template.from_checkpoint and template.source == hf.chat_template
    original, patched_part = PATCHES[name]
    assert original in hf.chat_template
    patched = hf.chat_template.replace(original, patched_part)
    eot = {"qwen2.5": "<|im_end|>", "llama3.2": "<|eot_id|>", "gemma": "<end_of_turn>"}.get(name, "</s>")
    eot_id = tokenizer.token_to_id(eot)

    for label, messages in _cases(name):
        expected = hf.apply_chat_template(messages, tokenize=True, return_dict=False, **variables)
        oracle = hf.apply_chat_template(messages, chat_template=patched, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True, **variables)
        assert oracle["input_ids"] == expected, f"{name} {label}: the patch changed the rendering"
        ids, spans, unclosed = assistant_spans(_conversation(messages), template, tokenizer)
        assert ids == expected, f"{name} {label}: rendered ids differ from apply_chat_template"
        assert unclosed == 0
        assert len(spans) == sum(m["role"] == "assistant" for m in messages)
        mask = _mask(len(ids), spans)
        for position, (mine, theirs) in enumerate(zip(mask, oracle["assistant_masks"], strict=True)):
            assert mine == theirs, (
                f"{name} {label}: token {position} {hf.convert_ids_to_tokens(ids[position])!r} is "
                f"{'trained' if mine else 'masked'} here, {'trained' if theirs else 'masked'} by transformers"
            )
        # Directly: each span is the assistant's text followed by its end-of-turn token. Template text
        # before it is trained only inside a token that merged with the answer's first characters
        # (Llama-2's tokenizer reads "[/INST]`{{" as "...", "]`", "{{"): the model has to write it.
        answers = [m["content"].strip() for m in messages if m["role"] == "assistant"]
        for (start, stop), answer in zip(spans, answers):
            assert ids[stop - 1] == eot_id
            text = tokenizer.decode(ids[start : stop - 1]).strip()
            assert text.endswith(answer), (text, answer)
            prefix = text[: len(text) - len(answer)]
            assert not prefix or prefix in tokenizer.decode(ids[start : start + 1]), (prefix, text)


def test_a_template_without_generation_prompt_support_trains_what_follows_the_prompt(tokenizer_dirs):
    """Llama-2's template ignores add_generation_prompt: the trained span starts right after "[/INST]"."""
    tokenizer = Tokenizer(tokenizer_dirs["llama2-chat"])
    template = resolve_chat_template(tokenizer)
    ids, spans, _ = assistant_spans(_conversation(CONVERSATIONS["one turn"]), template, tokenizer)
    (start, stop), = spans
    assert tokenizer.decode(ids[:start]).endswith("[/INST]")
    assert stop == len(ids) and ids[-1] == tokenizer.eos_id
    assert tokenizer.decode(ids[start:stop], skip_special_tokens=False) == "Hi! </s>"


# ---------------------------------------------------------------------------------------------------
# The data module: formats, batches, length rule, errors


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _sharegpt(messages: list[dict]) -> dict:
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    return {"id": "x", "conversations": [{"from": names[m["role"]], "value": m["content"]} for m in messages]}


@pytest.fixture(scope="module")
def qwen(tokenizer_dirs) -> Tokenizer:
    return Tokenizer(tokenizer_dirs["qwen2.5"])


def test_messages_and_sharegpt_files_give_the_same_batches_with_exact_labels(qwen, tmp_path):
    conversations = [[SYSTEM, *conv] for conv in CONVERSATIONS.values()] * 4
    messages = _write_jsonl(tmp_path / "messages.jsonl", [{"messages": conv} for conv in conversations])
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([_sharegpt(conv) for conv in conversations]))
    modules = []
    for path in (messages, sharegpt):
        data = Chat(json_path=path, val_split_fraction=0.25)
        data.setup(qwen, max_seq_length=512, model="qwen2.5-0.5b")
        modules.append(data)
    a, b = (list(d.train_dataloader(micro_batch_size=2, seed=3)) for d in modules)
    assert len(a) == len(b) == 4
    for batch_a, batch_b in zip(a, b):
        assert torch.equal(batch_a["input_ids"], batch_b["input_ids"]) and torch.equal(batch_a["labels"], batch_b["labels"])

    template = modules[0].template
    expected = {}
    for conv in conversations:
        ids, spans, _ = assistant_spans(_conversation(conv), template, qwen)
        expected[tuple(ids[: spans[-1][1]])] = _mask(spans[-1][1], spans)
    for batch in a:
        for inputs, labels in zip(batch["input_ids"], batch["labels"]):
            n = int((labels != IGNORE_INDEX).nonzero().max()) + 1  # the sample's last label
            tokens = inputs[:n].tolist() + [int(labels[n - 1])]
            mask = expected[tuple(tokens)]  # the sample ends at its last trained token
            want = [t if m else IGNORE_INDEX for t, m in zip(tokens[1:], mask[1:])]
            assert labels[:n].tolist() == want
            assert (labels[n:] == IGNORE_INDEX).all()
    # Only assistant text and <|im_end|> are targets: no header, no system, no user token.
    targets = torch.cat([batch["labels"][batch["labels"] != IGNORE_INDEX] for batch in a])
    assert qwen.token_to_id("<|im_start|>") not in targets.tolist()
    assert (targets == qwen.token_to_id("<|im_end|>")).sum() > 0
    assert modules[0].stats["val_samples"] == 3


def test_custom_keys_role_names_and_a_default_system_prompt(qwen, tmp_path):
    records = [{"dialog": [{"speaker": "me", "text": "Say hi."}, {"speaker": "bot", "text": "Hi!"}]}] * 4
    path = _write_jsonl(tmp_path / "custom.jsonl", records)
    data = Chat(json_path=path, format="messages", conversation_key="dialog", role_key="speaker", content_key="text",
                role_names={"me": "user", "bot": "assistant"}, system_prompt="Be brief.", val_split_fraction=0)
    conversations = data.read_conversations(path, "data file")
    assert conversations[0].as_dicts() == [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]
    data.setup(qwen, max_seq_length=256)
    batch = next(iter(data.train_dataloader(micro_batch_size=1, seed=0)))
    text = qwen.decode(batch["input_ids"][0], skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    with pytest.raises(UserError, match="map roles to one of system, user, assistant"):
        Chat(json_path=path, format="messages", conversation_key="dialog", role_key="speaker", content_key="text",
             role_names={"me": "human"}).read_conversations(path, "data file")


def test_mask_prompt_false_trains_every_token(qwen, tmp_path):
    path = _write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS["two turns"]}] * 2)
    data = Chat(json_path=path, mask_prompt=False, val_split_fraction=0)
    data.setup(qwen, max_seq_length=512)
    batch = next(iter(data.train_dataloader(micro_batch_size=1, seed=0)))
    assert torch.equal(batch["labels"][0, :-1], batch["input_ids"][0, 1:])
    assert data.stats["train_target_tokens"] == data.stats["train_tokens"]


def test_long_conversations_are_cut_at_turn_boundaries_or_dropped(qwen, tmp_path, caplog):
    long = [SYSTEM, *CONVERSATIONS["three turns, odd text"]]
    template = resolve_chat_template(qwen)
    ids, spans, _ = assistant_spans(_conversation(long), template, qwen)
    second_turn_end = spans[1][1]
    path = _write_jsonl(tmp_path / "long.jsonl", [{"messages": long}, {"messages": long[:3]}])
    # Room for two whole turns, not three: the sample keeps two and ends at the second <|im_end|>.
    data = Chat(json_path=path, val_split_fraction=0)
    data.setup(qwen, max_seq_length=second_turn_end - 1 + 2)
    lengths = sorted(int(n) for n in data._train.lengths)
    assert lengths == [spans[0][1] - 1, second_turn_end - 1]
    assert data.stats["truncated_train"] == 1 and data.stats["dropped_train"] == 0
    # No room for the first turn: dropped, with a warning naming the first dropped record.
    caplog.set_level(logging.WARNING)
    data = Chat(json_path=path, val_split_fraction=0)
    with pytest.raises(UserError, match="no conversation .* has an assistant turn that ends within"):
        data.setup(qwen, max_seq_length=spans[0][1] - 3)
    assert "line 1" in caplog.text and "dropped 2 of 2" in caplog.text


@pytest.mark.parametrize(
    "record, problem",
    [
        ({"messages": []}, "line 2: no messages: 'messages' is empty"),
        ({"messages": "hi"}, "line 2: no messages: 'messages' is a JSON string"),
        ({"text": "hi"}, "line 2: no messages: there is no 'messages' field"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "line 2: message 0 has an unknown role 'bot'"),
        ({"messages": [{"role": "usr", "content": "x"}]},
         r"""message 0 has an unknown role 'usr' \(known: .*\); map it with --data.role_names '{"usr": "user"}'"""),
        ({"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "x"}]},
         r"line 2: message 0 \(user\) has empty content"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]},
         r"line 2: message 1 \(assistant\) has empty content"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                       {"role": "user", "content": "c"}]}, "line 2: the last message's role is 'user'; a conversation must end with 'assistant'"),
        ({"messages": [{"role": "user", "content": ["a"]}]}, r"line 2: message 0 \(user\): 'content' is a JSON array"),
        ({"messages": [{"role": "user"}]}, "line 2: message 0 has no 'content' field"),
        ({"messages": ["hi"]}, "line 2: message 0 is a JSON string"),
    ],
)
def test_bad_records_are_one_line_naming_record_and_problem(qwen, tmp_path, record, problem):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"messages": CONVERSATIONS["one turn"]}, record])
    with pytest.raises(UserError, match=problem) as caught:
        Chat(json_path=path, format="messages").setup(qwen, max_seq_length=128)
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)


def test_a_template_that_refuses_a_conversation_names_the_record(tokenizer_dirs, tmp_path):
    gemma = Tokenizer(tokenizer_dirs["gemma"])
    records = [{"messages": CONVERSATIONS["one turn"]}, {"messages": [SYSTEM, *CONVERSATIONS["one turn"]]}]
    path = tmp_path / "gemma.json"
    path.write_text(json.dumps(records))
    with pytest.raises(UserError, match=r"record 1: the chat template .* fails to render it: System role not supported"):
        Chat(json_path=path, val_split_fraction=0).setup(gemma, max_seq_length=128)


# Templates that lose an assistant message or close turns only when last: refused with the line and the cause.
_REWRITING = (  # drops every assistant turn but the last: earlier prompts are not prefixes of the whole text
    "{%- for m in messages -%}{%- if m['role'] != 'assistant' or loop.last -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
_LAST_ONLY = (  # the last assistant turn gets a marker the others lose (as reasoning templates do with <think>)
    "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] -}}"
    "{%- if m['role'] != 'assistant' or loop.last -%}{{- '<|im_end|>' -}}{%- endif -%}{{- '\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@pytest.mark.parametrize(
    "template, message",
    [
        (_REWRITING, "line 1: assistant message 1's content is not in its turn as the chat template renders"),
        (_LAST_ONLY, "line 1: the chat template renders an assistant turn differently when it is the last"),
    ],
    ids=["rewrites earlier turns", "renders the last turn differently"],
)
def test_a_template_that_renders_a_turn_by_what_follows_is_refused(qwen, tmp_path, template, message):
    template_file = tmp_path / "template.jinja"
    template_file.write_text(template)
    path = _write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS["two turns"]}])
    with pytest.raises(UserError, match=message):
        Chat(json_path=path, val_split_fraction=0, chat_template=str(template_file)).setup(qwen, max_seq_length=128)


def test_template_choice_and_the_template_written_into_the_output(qwen, tmp_path):
    from toolkit.data.chat_template import checkpoint_template

    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((qwen.directory / "tokenizer.json").read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    tokenizer = Tokenizer(folder)
    # No template in the folder: the built-in one for the model's default style (qwen -> chatml).
    template = resolve_chat_template(tokenizer, model="qwen2.5-0.5b")
    assert template.source == CHAT_TEMPLATES["chatml"] and not template.from_checkpoint
    assert resolve_chat_template(tokenizer, model="pythia-160m").source == CHAT_TEMPLATES["zephyr"]
    with pytest.raises(UserError, match="unknown chat template 'chatlm'.*Did you mean: chatml"):
        resolve_chat_template(tokenizer, "chatlm")

    path = _write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS["two turns"]}] * 2)
    data = Chat(json_path=path, val_split_fraction=0)
    data.setup(tokenizer, max_seq_length=256, model="qwen2.5-0.5b")
    out = data.output_tokenizer_dir(folder, tmp_path / "run")
    assert out == tmp_path / "run" / "tokenizer"
    assert checkpoint_template(out)[0] == CHAT_TEMPLATES["chatml"]
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"
    assert (out / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    # The written folder now carries the template: a run on it uses it as the checkpoint's own.
    again = Chat(json_path=path, val_split_fraction=0)
    again.setup(Tokenizer(out), max_seq_length=256, model="pythia-160m")
    assert again.template.from_checkpoint and again.output_tokenizer_dir(out, tmp_path / "run2") == out
    assert torch.equal(again._train.tokens, data._train.tokens)

    # chat_template.jinja (how transformers 5 saves a template) wins over tokenizer_config.json.
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATES["zephyr"])
    assert resolve_chat_template(Tokenizer(out)).source == CHAT_TEMPLATES["zephyr"]

    # A JSON file given as the template is read for its "chat_template", never used as the text of
    # one (a tokenizer_config.json rendered 628 tokens of JSON into every conversation).
    gemma_config = ASSETS / "chat_templates" / "gemma" / "tokenizer_config.json"
    from_json = resolve_chat_template(tokenizer, str(gemma_config))
    assert from_json.source == json.loads(gemma_config.read_text())["chat_template"]
    (tmp_path / "other.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(UserError, match=r'other.json holds no "chat_template"'):
        resolve_chat_template(tokenizer, str(tmp_path / "other.json"))


def test_the_cli_builds_chat_data():
    args = ["--data", "Chat", "--data.json_path", str(FASTCHAT), "--data.chat_template", "llama-2",
            "--data.role_names", '{"bot": "assistant"}', "--data.mask_prompt", "false"]
    data = data_from_cli(args)
    assert isinstance(data, Chat) and data.chat_template == "llama-2" and data.role_names == {"bot": "assistant"}
    assert data.mask_prompt is False and data.format == "auto"


def test_prompt_style_is_refused(qwen):
    with pytest.raises(UserError, match="prompt_style does not apply to Chat data"):
        Chat(json_path=FASTCHAT, prompt_style="alpaca").setup(qwen, max_seq_length=64)


def test_chat_batches_resume_at_the_exact_next_batch(tokenizer_dirs):
    """The instruction loader with per-token chat masks: k batches, state_dict, a new loader, the rest."""
    tokenizer = Tokenizer(tokenizer_dirs["llama2-chat"])
    data = Chat(json_path=FASTCHAT, val_split_fraction=0.1)
    data.setup(tokenizer, max_seq_length=256)
    assert data.stats["train_samples"] == 450 and data.stats["val_samples"] == 50
    assert 0 < data.stats["train_target_tokens"] < data.stats["train_tokens"]
    whole = list(data.train_dataloader(micro_batch_size=4, seed=7))
    loader = data.train_dataloader(micro_batch_size=4, seed=7)
    head = [batch for _, batch in zip(range(9), loader)]
    resumed = data.train_dataloader(micro_batch_size=4, seed=7)
    resumed.load_state_dict(loader.state_dict())
    rest = list(resumed)
    assert len(head) + len(rest) == len(whole)
    for got, want in zip(head + rest, whole):
        assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["labels"], want["labels"])


def test_generation_stops_at_the_template_end_of_turn_token(tokenizer_dirs):
    from toolkit.generate_chat import end_of_turn_ids

    for name, token in (("qwen2.5", "<|im_end|>"), ("llama3.2", "<|eot_id|>"), ("gemma", "<end_of_turn>"),
                        ("llama2-chat", "</s>")):
        tokenizer = Tokenizer(tokenizer_dirs[name])
        stops = end_of_turn_ids(resolve_chat_template(tokenizer), tokenizer)
        assert stops == {tokenizer.token_to_id(token), tokenizer.eos_id}, name


def test_generation_also_stops_at_every_eos_id_of_generation_config(tokenizer_dirs, tmp_path):
    """Llama 3.1's instruct checkpoints list <|end_of_text|>, <|eom_id|> and <|eot_id|> as
    eos_token_id in generation_config.json: chat generation stops at each of them, beside the
    template's own end of turn."""
    import shutil

    from toolkit.generate_chat import end_of_turn_ids

    folder = tmp_path / "llama3.2"
    shutil.copytree(tokenizer_dirs["llama3.2"], folder)
    listed = [Tokenizer(folder).token_to_id(token) for token in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")]
    assert None not in listed
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": listed}))
    tokenizer = Tokenizer(folder)
    assert end_of_turn_ids(resolve_chat_template(tokenizer), tokenizer) == set(listed) | {tokenizer.eos_id}


# ---------------------------------------------------------------------------------------------------
# Typed template variables, from the command line, YAML and `generate`


def test_template_variables_are_typed_from_the_command_line_and_yaml(tmp_path):
    from jsonargparse import ArgumentParser

    value = ('{"enable_thinking": false, "depth": 3, "effort": "high", "names": ["a"], "extra": {"k": 1.5}, '
             '"text": "3", "answer": "no"}')
    data = data_from_cli(["--data", "Chat", "--data.json_path", str(FASTCHAT), "--data.template_variables", value])
    # Values as written: strings that look like numbers or YAML booleans stay strings.
    assert data.template_variables == {"enable_thinking": False, "depth": 3, "effort": "high", "names": ["a"],
                                       "extra": {"k": 1.5}, "text": "3", "answer": "no"}
    config = tmp_path / "config.yaml"
    config.write_text(f"data:\n  class_path: Chat\n  init_args:\n    json_path: {FASTCHAT}\n"
                      "    template_variables:\n      enable_thinking: false\n      reasoning_effort: high\n")

    def finetune(data: Optional[InstructData] = None) -> None:
        """Stand-in for a fine-tuning entry point."""

    parser = ArgumentParser(exit_on_error=False)
    parser.add_function_arguments(finetune)
    parser.add_argument("--config", action="config")
    data = parser.instantiate(parser.parse_args(["--config", str(config)])).data
    assert data.template_variables == {"enable_thinking": False, "reasoning_effort": "high"}


def test_a_boolean_variable_reaches_the_template_as_a_boolean_and_a_quoted_one_is_refused(qwen, tmp_path):
    template_file = tmp_path / "t.jinja"
    template_file.write_text(
        "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
        "{%- if flag is false -%}{{- 'OFF' -}}{%- elif flag -%}{{- 'ON' -}}{%- endif -%}{%- endif -%}"
    )
    messages = [{"role": "user", "content": "hi"}]
    off = resolve_chat_template(qwen, str(template_file), variables={"flag": False})
    assert off.render(messages, add_generation_prompt=True).endswith("assistant\nOFF")
    with pytest.raises(UserError, match=r"flag is the string 'false', which a template reads as true; write the "
                                        r"boolean without quotes") as caught:
        resolve_chat_template(qwen, str(template_file), variables={"flag": "false"})
    assert "\n" not in str(caught.value)
    with pytest.raises(UserError, match="'messages' comes from each conversation"):
        resolve_chat_template(qwen, str(template_file), variables={"messages": []})


def test_generate_passes_typed_template_variables(base, tmp_path, capsys):
    """`generate --messages` with --template_variables from the command line: a template that refuses
    to render unless `flag` is the boolean false renders, and a quoted "false" is one line."""
    from toolkit.cli import run

    template_file = tmp_path / "strict.jinja"
    template_file.write_text(
        "{%- if flag is not false -%}{{- raise_exception('flag must be the boolean false') -}}{%- endif -%}"
        + CHAT_TEMPLATES["zephyr"]
    )
    conversation = tmp_path / "c.json"
    conversation.write_text(json.dumps([{"role": "user", "content": "Hi"}]))
    common = ["generate", str(base["checkpoint"]), "--messages", str(conversation), "--chat_template",
              str(template_file), "--max_new_tokens", "2", "--temperature", "0"]
    assert run([*common, "--template_variables", '{"flag": false}']) == 0
    assert "tokens/s" in capsys.readouterr().out
    assert run([*common, "--template_variables", '{"flag": "false"}']) != 0
    err = capsys.readouterr().err
    assert "--template_variables: flag is the string 'false'" in err
    assert run(common) != 0
    assert "flag must be the boolean false" in capsys.readouterr().err


def test_generate_imports_go_one_way():
    """generate -> generate_chat -> sampling: neither of the last two imports the entry point."""
    import ast

    root = Path(__file__).resolve().parents[1] / "toolkit"
    for name in ("generate_chat.py", "sampling.py"):
        tree = ast.parse((root / name).read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        assert "toolkit.generate" not in imported, name
