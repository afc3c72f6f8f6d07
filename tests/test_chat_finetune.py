"""Chat fine-tuning end to end on CPU: LoRA on 500 real multi-turn conversations (FastChat's ShareGPT
sample) with a tiny Llama and the real Llama-2 tokenizer; the template travels into the adapter, the
merged model and the Hugging Face export, where transformers renders the tokens the model trained on;
`generate` answers through the same template, one-shot and interactively."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ASSETS, logged_val_losses
from toolkit.cli import run
from toolkit.data.chat import Chat, assistant_spans, parse_conversation
from toolkit.data.chat_template import CHAT_TEMPLATES, checkpoint_template, resolve_chat_template
from toolkit.tokenizer import Tokenizer

FASTCHAT = ASSETS / "instruct" / "fastchat_dummy_conversation.json"


def _args(command: str, checkpoint: Path, out_dir: Path, *extra: str) -> list[str]:
    return [
        command, str(checkpoint), "--out_dir", str(out_dir),
        "--data", "Chat", "--data.json_path", str(FASTCHAT), "--data.val_split_fraction", "0.1",
        "--data.chat_template", "llama-2",
        "--precision", "32-true", "--train.micro_batch_size", "4", "--train.global_batch_size", "8",
        "--train.max_seq_length", "256", "--train.max_steps", "10", "--train.warmup_steps", "2",
        "--eval.interval", "5", "--eval.max_iters", "4", "--log.interval", "5", "--log.loggers", "[csv]",
        *extra,
    ]


@pytest.fixture(scope="module")
def chat_run(base) -> dict:
    out = base["root"] / "chat_lora"
    args = _args("finetune_lora", base["checkpoint"], out, "--train.learning_rate", "0.02",
                 "--lora.targets", "[query, value, mlp, head]", "--lora.r", "4", "--lora.alpha", "8")
    assert run(args) == 0
    merged = base["root"] / "chat_merged"
    assert run(["merge_lora", str(out), "--out_dir", str(merged)]) == 0
    return {"out": out, "merged": merged}


def test_lora_on_conversations_lowers_the_validation_loss_on_assistant_tokens(chat_run):
    losses = logged_val_losses(chat_run["out"])
    assert len(losses) == 3, losses  # before training, after 5 and after 10 steps
    assert losses[-1] < losses[0] - 1.0, losses
    adapters = load_file(str(chat_run["out"] / "final" / "lora_adapter.safetensors"))
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in adapters.items())


def test_the_template_travels_into_the_export_and_transformers_renders_the_trained_tokens(chat_run, base, tmp_path):
    from transformers import AutoTokenizer

    from toolkit.generate_chat import prompt_ids

    # The base checkpoint has no template; the one trained with is written into every output.
    assert checkpoint_template(base["checkpoint"]) is None
    for folder in (chat_run["out"] / "final", chat_run["merged"]):
        assert checkpoint_template(folder)[0] == CHAT_TEMPLATES["llama-2"], folder
    export = tmp_path / "hf"
    assert run(["convert_to_hf", str(chat_run["merged"]), str(export)]) == 0
    hf = AutoTokenizer.from_pretrained(export)

    # The training samples, as the data module made them, against apply_chat_template on the export.
    tokenizer = Tokenizer(base["checkpoint"])
    data = Chat(json_path=FASTCHAT, chat_template="llama-2", val_split_fraction=0)
    records = json.loads(FASTCHAT.read_text())[:40]
    template = resolve_chat_template(tokenizer, "llama-2")
    spec = data.record_format("sharegpt")
    for i, record in enumerate(records):
        conversation = parse_conversation(record, FASTCHAT, f"record {i}", spec)
        messages = conversation.as_dicts()
        ids, spans, _ = assistant_spans(conversation, template, tokenizer)
        assert hf.apply_chat_template(messages, tokenize=True, return_dict=False) == ids, i
        # The prompt generate builds for the last turn is transformers' too.
        prompt = hf.apply_chat_template(messages[:-1], tokenize=True, return_dict=False, add_generation_prompt=True)
        assert prompt_ids(template, tokenizer, messages[:-1]) == prompt
        assert ids[: spans[-1][0]] == prompt  # and the last trained span starts right after it


def _generate(args: list[str], capsys, stdin: str = "", monkeypatch=None) -> list[str]:
    if monkeypatch is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    capsys.readouterr()
    assert run(["generate", *args]) == 0
    return capsys.readouterr().out.splitlines()


def test_generate_answers_a_conversation_and_chats_with_the_same_history(base, chat_run, tmp_path, capsys, monkeypatch):
    # The untrained base (random weights) writes long greedy replies; it has no template: name one.
    checkpoint = str(base["checkpoint"])
    common = ["--max_new_tokens", "8", "--temperature", "0", "--chat_template", "llama-2"]
    lines = _generate([checkpoint, "--chat", "true", *common], capsys, "Who are you?\n\nWhat can you do?\n/exit\n",
                      monkeypatch)
    replies = [line.split("assistant> ", 1)[1] for line in lines if "assistant> " in line]
    assert len(replies) == 2 and all(replies), lines

    # One-shot answers to the same histories give the same greedy replies: the session keeps the
    # whole conversation as its prompt.
    def one_shot(messages, *extra: str) -> str:
        path = tmp_path / "messages.json"
        path.write_text(json.dumps(messages))
        return _generate([checkpoint, "--messages", str(path), *common, *extra], capsys)[0]

    first = [{"role": "user", "content": "Who are you?"}]
    assert one_shot(first) == replies[0]
    second = first + [{"role": "assistant", "content": replies[0]}, {"role": "user", "content": "What can you do?"}]
    assert one_shot(second) == replies[1]
    assert one_shot(second, "--system", "Be brief.") != replies[1]  # the system message is in the prompt
    # A ShareGPT record works as a prompt too; a prompt must end with the user's message.
    assert one_shot({"conversations": [{"from": "human", "value": "Who are you?"}]}) == replies[0]
    path = tmp_path / "ends_with_assistant.json"
    path.write_text(json.dumps(second[:2]))
    assert run(["generate", checkpoint, "--messages", str(path)]) == 1
    assert "must end with 'user'" in capsys.readouterr().err
    # generate has no --data options: an unknown role asks for a known one
    path.write_text(json.dumps([{"role": "usr", "content": "Who are you?"}]))
    assert run(["generate", checkpoint, "--messages", str(path)]) == 1
    err = capsys.readouterr().err
    assert "unknown role 'usr'" in err and "use one of those (did you mean 'user'?)" in err and "--data." not in err, err

    # The fine-tuned model needs no --chat_template: it carries the one it was trained with.
    lines = _generate([str(chat_run["merged"]), "--chat", "true", "--max_new_tokens", "4"], capsys, "Hi\n", monkeypatch)
    assert str(chat_run["merged"] / "tokenizer_config.json") in lines[0]


def test_bad_chat_records_stop_the_run_with_one_line_and_no_output(base, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    bad.write_text("\n".join(json.dumps(r) for r in [good, good, {"messages": [{"role": "bot", "content": "x"}]}]))
    out = tmp_path / "run"
    args = _args("finetune_lora", base["checkpoint"], out) + ["--data.json_path", str(bad)]
    capsys.readouterr()
    assert run(args) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.jsonl line 3: message 0 has an unknown role 'bot'" in err[0], err
    assert not out.exists()


def test_full_finetuning_on_conversations_at_the_default_precision(base, tmp_path):
    """finetune_full takes Chat data too; no --precision: the default for the device (bf16 on CPU)."""
    out = tmp_path / "full"
    args = [a for a in _args("finetune_full", base["checkpoint"], out, "--train.max_steps", "2",
                             "--eval.initial_validation", "false") if a not in ("--precision", "32-true")]
    assert run(args) == 0
    assert checkpoint_template(out / "final")[0] == CHAT_TEMPLATES["llama-2"]
    assert (out / "final" / "model.safetensors").is_file()


@pytest.mark.slow  # 30 s on 2 cores; test_finetune.py runs the same loader under FSDP with Alpaca data
def test_lora_on_conversations_under_two_fsdp_processes_equals_one_process(base, tmp_path):
    """Same global batch (8): one process accumulates 2 micro-batches of 4, two processes 1 each.

    Every rank renders and tokenizes the conversations itself and writes the template into
    <out_dir>/tokenizer: the ranks must agree on every sample for the adapters to match.
    """

    def adapter(out_dir: Path, devices: str) -> dict:
        args = _args("finetune_lora", base["checkpoint"], out_dir, "--train.max_steps", "2", "--train.learning_rate",
                     "0.002", "--lora.dropout", "0.0", "--lora.targets", "[query, value]",
                     "--eval.initial_validation", "false", "--devices", devices)
        env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
        result = subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True, env=env,
                                timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        assert checkpoint_template(out_dir / "final")[0] == CHAT_TEMPLATES["llama-2"]
        return load_file(str(out_dir / "final" / "lora_adapter.safetensors"))

    single, sharded = adapter(tmp_path / "one", "1"), adapter(tmp_path / "two", "2")
    assert single.keys() == sharded.keys() and any("lora_B" in k for k in single)
    for name in single:
        torch.testing.assert_close(sharded[name], single[name], atol=1e-5, rtol=0, msg=name)


def test_a_chat_template_jinja_file_survives_conversion_both_ways(base, tmp_path):
    """transformers 5 saves a tokenizer's template as chat_template.jinja: convert_from_hf keeps it,
    training reads it, convert_to_hf hands it on, and transformers loads it from the export."""
    import shutil

    from transformers import AutoTokenizer

    from toolkit.convert import convert_from_hf

    hf_dir = tmp_path / "hf"
    shutil.copytree(base["hf_dir"], hf_dir)
    (hf_dir / "chat_template.jinja").write_text(CHAT_TEMPLATES["zephyr"])
    checkpoint = tmp_path / "checkpoint"
    convert_from_hf(hf_dir, checkpoint)
    template = resolve_chat_template(Tokenizer(checkpoint))
    assert template.from_checkpoint and template.source == CHAT_TEMPLATES["zephyr"]
    assert run(["convert_to_hf", str(checkpoint), str(tmp_path / "export")]) == 0
    assert AutoTokenizer.from_pretrained(tmp_path / "export").chat_template == CHAT_TEMPLATES["zephyr"]
