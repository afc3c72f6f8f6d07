"""Instruction data: prompt styles, tokenization and masking, file errors, and the resumable loader."""

import json
import math
import logging
from pathlib import Path

import pytest
import torch
from conftest import ASSETS, data_from_cli

from toolkit.data.instruct import (
    IGNORE_INDEX,
    JSON,
    Alpaca,
    Example,
    InstructData,
    InstructLoader,
    TokenizedSamples,
    read_json_records,
    tokenize_examples,
)
from toolkit.data.prompts import DEFAULT_STYLES, STYLES, default_style_for, get_style, resolve_style
from toolkit.errors import UserError
from toolkit.models import gpt, loss
from toolkit.models.config import Config
from toolkit.models.presets import PRESETS
from toolkit.tokenizer import Tokenizer

INSTRUCT = ASSETS / "instruct"
TINY = INSTRUCT / "alpaca_tiny.json"
DEMO = INSTRUCT / "alpaca_en_demo.json"
SEED_TASKS = INSTRUCT / "alpaca_seed_tasks.jsonl"


@pytest.fixture(scope="module")
def llama2() -> Tokenizer:
    return Tokenizer(ASSETS / "tokenizers" / "llama2")


@pytest.fixture(scope="module")
def neox() -> Tokenizer:
    return Tokenizer(ASSETS / "tokenizers" / "gpt-neox-20b")


@pytest.fixture(scope="module")
def tiny(llama2) -> Alpaca:
    data = Alpaca(json_path=TINY, prompt_style="alpaca")
    data.setup(llama2, max_seq_length=512, model="llama-2-7b")
    return data


def _targets(labels: torch.Tensor) -> list[int]:
    return labels[labels != IGNORE_INDEX].tolist()


# ---------------------------------------------------------------------------------------------------
# Prompt styles


def test_prompt_styles_render_as_expected():
    alpaca = get_style("alpaca")
    assert alpaca.apply("Say hi.") == (
        "Below is an instruction that describes a task. Write a response that appropriately completes the request."
        "\n\n### Instruction:\nSay hi.\n\n### Response:\n"
    )
    with_input = alpaca.apply("Translate.", "Bonjour")
    assert "paired with an input" in with_input
    assert with_input.endswith("### Instruction:\nTranslate.\n\n### Input:\nBonjour\n\n### Response:\n")
    assert get_style("chatml").apply("Hi") == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert get_style("chatml").render("Hi", "", "Hello").endswith("assistant\nHello<|im_end|>")
    assert get_style("llama-3").apply("Hi") == (
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert get_style("llama-3").stop_strings == ("<|eot_id|>",)
    assert get_style("llama-2").apply("Hi") == "[INST] Hi [/INST]"
    assert get_style("llama-2").render("Hi", "", "Hello") == "[INST] Hi [/INST] Hello"
    assert get_style("phi").apply("Hi") == "Instruct: Hi\nOutput:"
    assert get_style("gemma").apply("Hi") == "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert get_style("plain").apply("Hi") == "Hi\n"
    # Chat styles put the input after the instruction, in the same user turn.
    assert get_style("chatml").apply("Translate.", "Bonjour") == (
        "<|im_start|>user\nTranslate.\n\nBonjour<|im_end|>\n<|im_start|>assistant\n"
    )
    assert get_style("plain").apply("Translate.", "Bonjour") == "Translate.\n\nBonjour\n"
    # Braces in the text are data, not template fields.
    assert get_style("plain").apply("Use {input} and {x}") == "Use {input} and {x}\n"


def test_unknown_prompt_style_suggests_close_names(llama2):
    with pytest.raises(UserError, match="llama-3") as info:
        get_style("llama3")
    assert "\n" not in str(info.value)
    with pytest.raises(UserError, match="chatml"):
        Alpaca(json_path=TINY, prompt_style="chat-ml").setup(llama2, 64, "debug")


@pytest.mark.parametrize(
    "model, style",
    [
        ("llama-3-8b", "llama-3"),
        ("llama-3.1-8b", "llama-3"),
        ("meta-llama/Llama-3.2-1B", "llama-3"),  # an HF repo id resolves to the preset
        ("llama-2-7b", "llama-2"),
        ("mistral-7b", "llama-2"),
        ("qwen2.5-0.5b", "chatml"),
        ("gemma-2b", "gemma"),
        ("phi-2", "phi"),
        ("phi-3-mini-4k-instruct", "phi-3"),
        ("microsoft/Phi-3.5-mini-instruct", "phi-3"),
        ("phi-4", "phi-4"),
        ("phi-4-mini-instruct", "phi-4-mini"),
        (Config(name="custom", family="phi3"), "phi-3"),
        (Config(name="phi4-custom", family="phi3"), "phi-3"),  # the family, not Phi-2's "phi" prefix
        (Config(name="phi-4-reasoning", family="phi3"), "phi-4"),  # a prefix of the family's own presets
        (Config(name="phi-4-mini-custom", family="phi3"), "phi-4-mini"),
        (Config(name="llama-3-custom"), "llama-3"),  # a family with no style of its own: the prefix
        ("pythia-160m", "alpaca"),
        ("tiny-llama", "alpaca"),
        ("debug", "alpaca"),
        ("debug-gemma", "alpaca"),
        ("my-own-model", "alpaca"),
        (Config(name="llama-3-8b"), "llama-3"),
        (Config(name="custom", family="gemma"), "gemma"),
        (Config(name="custom", family="qwen2"), "chatml"),
        ("Qwen/Qwen3-8B", "chatml"),
        ("smollm3-3b", "chatml"),
        ("olmo-2-7b", "tulu"),
        (Config(name="custom", family="olmo2"), "tulu"),
        ("llama-3.3-70b", "llama-3"),
        (Config(name="custom", family="qwen3"), "chatml"),
        ("olmoe-1b-7b-instruct", "tulu"),
        (Config(name="custom", family="olmoe"), "tulu"),
        ("openai/gpt-oss-20b", "harmony"),
        (Config(name="custom", family="gpt_oss"), "harmony"),
        ("qwen3-30b-a3b", "chatml"),
        ("mixtral-8x7b-instruct", "llama-2"),
    ],
)
def test_default_style_per_preset(model, style):
    assert default_style_for(model) == style


def test_harmony_style_renders_as_gpt_oss_chat_template_without_its_date():
    """The harmony style's text for one instruction and response is what gpt-oss's own chat template
    (rendered by transformers) makes of that user turn and a final answer, less its "Current date" line."""
    import re

    from transformers.utils.chat_template_utils import render_jinja_template

    template = (ASSETS / "chat_templates" / "gpt-oss" / "chat_template.jinja").read_text()
    style = get_style("harmony")
    for instruction, input, response in [("Name a colour.", "", "Red."), ("Sum these.", "2 and {3}", "5")]:
        user = f"{instruction}\n\n{input}" if input else instruction
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": response}]
        (rendered,), _ = render_jinja_template(conversations=[messages], chat_template=template)
        undated, removed = re.subn(r"Current date: [0-9-]+\n", "", rendered)
        assert removed == 1
        assert style.render(instruction, input, response) == undated
        assert undated.startswith(style.apply(instruction, input)) and style.stop_strings == ("<|return|>",)


def test_every_preset_has_a_registered_default_style():
    assert {style for _, style in DEFAULT_STYLES} <= set(STYLES)
    for preset in PRESETS:
        assert default_style_for(preset["name"]) in STYLES
    assert resolve_style(None, "phi-2").name == "phi"
    assert resolve_style("plain", "phi-2").name == "plain"


# ---------------------------------------------------------------------------------------------------
# Tokenization, masking, truncation


def test_samples_are_bos_prompt_response_eos_with_prompt_masked(tiny, llama2):
    assert IGNORE_INDEX == loss.IGNORE_INDEX
    records = json.loads(TINY.read_text())
    style = get_style("alpaca")
    loader = tiny.train_dataloader(micro_batch_size=4, seed=0)
    batch = next(iter(loader))
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.int64
    assert batch["input_ids"].shape == batch["labels"].shape and batch["input_ids"].shape[0] == 4
    by_prompt = {llama2.decode(llama2.encode(style.apply(r["instruction"], r["input"]))): r for r in records}
    for input_ids, labels in zip(batch["input_ids"], batch["labels"]):
        n = int((labels != IGNORE_INDEX).nonzero().max()) + 1  # the sample's length (EOS is its last label)
        first = int((labels != IGNORE_INDEX).nonzero().min())
        assert input_ids[0] == llama2.bos_id
        assert labels[n - 1] == llama2.eos_id
        assert (labels[:first] == IGNORE_INDEX).all() and (labels[first:n] != IGNORE_INDEX).all()
        # Every target is the next input token; padding has pad inputs and ignored labels.
        assert torch.equal(labels[first : n - 1], input_ids[first + 1 : n])
        assert (input_ids[n:] == tiny.pad_id).all() and (labels[n:] == IGNORE_INDEX).all()
        # The masked part is exactly the prompt; the targets are the response.
        record = by_prompt[llama2.decode(input_ids[: first + 1])]
        assert llama2.decode(_targets(labels)) == record["output"].strip()


def test_mask_prompt_false_trains_on_every_token(llama2):
    data = Alpaca(json_path=TINY, mask_prompt=False, val_split_fraction=0)
    data.setup(llama2, 512, "debug")
    assert data.val_dataloader(4) is None
    batch = next(iter(data.train_dataloader(4, seed=0)))
    for input_ids, labels in zip(batch["input_ids"], batch["labels"]):
        n = int((labels != IGNORE_INDEX).sum())
        assert (labels[:n] != IGNORE_INDEX).all()
        assert torch.equal(labels[: n - 1], input_ids[1:n])
    assert data.stats["train_target_tokens"] == data.stats["train_tokens"]


def test_truncation_and_dropping_prompts_that_fill_the_context(llama2, caplog):
    max_seq_length = 60
    records = json.loads(TINY.read_text())
    style = get_style("alpaca")
    prompt_lengths = [len(llama2.encode(style.apply(r["instruction"], r["input"]))) for r in records]
    expected_dropped = sum(n >= max_seq_length + 1 for n in prompt_lengths)
    assert 0 < expected_dropped < len(records)
    data = Alpaca(json_path=TINY, prompt_style="alpaca", val_split_fraction=0)
    with caplog.at_level(logging.INFO, logger="toolkit"):
        data.setup(llama2, max_seq_length, "debug")
    assert data.stats["dropped_train"] == expected_dropped
    assert data.stats["train_samples"] == len(records) - expected_dropped
    assert data.stats["truncated_train"] > expected_dropped  # cut responses are kept
    assert data.stats["max_length"] == max_seq_length
    assert f"dropped {expected_dropped} of 100 training samples (the first: record " in caplog.text
    loader = data.train_dataloader(8, seed=0)
    for batch in loader:
        assert batch["input_ids"].shape[1] <= max_seq_length
        assert ((batch["labels"] != IGNORE_INDEX).sum(dim=1) > 0).all()


def test_no_sample_left_is_a_user_error(llama2):
    with pytest.raises(UserError, match=r"alpaca_tiny\.json.*max_seq_length=8"):
        Alpaca(json_path=TINY).setup(llama2, 8, "debug")


def test_prompt_boundary_merged_by_the_tokenizer_masks_only_the_common_prefix(neox):
    # "Output:" + " 1" tokenizes as "Output", ":", " 1" with byte-level BPE: the space goes to the response.
    example = Example("Count.", "", "1 2 3")
    samples, _ = tokenize_examples([example], neox, get_style("phi"), 64, mask_prompt=True)
    full = samples.tokens_of(0).tolist()
    prompt = neox.encode(get_style("phi").apply("Count."), bos=False).tolist()
    assert full[: len(prompt)] == prompt and full[-1] == neox.eos_id
    assert int(samples.masked[0]) == len(prompt) - 1
    assert neox.decode(full[len(prompt) :]) == " 1 2 3"
    # llama-3 markup with a tokenizer that lacks its special tokens: "\n\n" merges differently.
    samples, _ = tokenize_examples([example], neox, get_style("llama-3"), 128, mask_prompt=True)
    full = samples.tokens_of(0).tolist()
    masked = int(samples.masked[0])
    assert neox.decode(full[masked + 1 :]).endswith("1 2 3<|eot_id|>")
    assert "1" not in neox.decode(full[: masked + 1])


def test_generic_json_with_custom_keys_on_jsonl(neox):
    lines = SEED_TASKS.read_text().splitlines()
    data = JSON(json_path=SEED_TASKS, prompt_key="instruction", input_key=None, response_key="name",
                prompt_style="plain", val_split_fraction=0)
    data.setup(neox, 256, "pythia-160m")
    assert data.stats["train_samples"] == len(lines) == 175
    assert data.stats["val_samples"] == 0 and data.val_dataloader(4) is None
    names = {json.loads(line)["name"] for line in lines}
    batch = next(iter(data.train_dataloader(4, seed=3)))
    for labels in batch["labels"]:
        targets = _targets(labels)
        assert targets[-1] == neox.eos_id
        assert neox.decode(targets[:-1]) in names


def test_alpaca_reads_json_lines_the_same_as_json(tmp_path, llama2):
    jsonl = tmp_path / "tiny.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in json.loads(TINY.read_text())))
    a, b = Alpaca(json_path=TINY), Alpaca(json_path=jsonl)
    for data in (a, b):
        data.setup(llama2, 256, "llama-2-7b")
    assert torch.equal(a._train.tokens, b._train.tokens) and torch.equal(a._val.tokens, b._val.tokens)
    assert a.stats["prompt_style"] == "llama-2"


def test_validation_split_and_val_path(tmp_path, llama2, neox):
    records = json.loads(TINY.read_text())
    split = Alpaca(json_path=TINY, val_split_fraction=0.1)
    train, val = split._split(split.read_examples(TINY, "data file"))
    assert len(val) == 10 and len(train) == 90
    assert {e.instruction for e in train}.isdisjoint({e.instruction for e in val})
    # The split depends on the seed only, not on the tokenizer.
    again = Alpaca(json_path=TINY, val_split_fraction=0.1)
    assert again._split(again.read_examples(TINY, "data file"))[1] == val
    other = Alpaca(json_path=TINY, val_split_fraction=0.1, seed=7)
    assert other._split(other.read_examples(TINY, "data file"))[1] != val

    val_file = tmp_path / "val.json"
    val_file.write_text(json.dumps(records[:7]))
    data = Alpaca(json_path=TINY, val_path=val_file, val_split_fraction=0.5)
    data.setup(neox, 256, "pythia-160m")
    assert data.stats["train_samples"] == 100 and data.stats["val_samples"] == 7
    val_loader = data.val_dataloader(micro_batch_size=2)
    assert len(val_loader) == 4  # one process keeps the short last batch
    passes = [[b["input_ids"] for b in val_loader] for _ in range(2)]
    assert sum(len(b) for b in passes[0]) == 7
    assert all(torch.equal(x, y) for x, y in zip(*passes))  # every pass is the same

    with pytest.raises(UserError, match="val_split_fraction"):
        Alpaca(json_path=TINY, val_split_fraction=1.0).setup(neox, 64, "debug")


# ---------------------------------------------------------------------------------------------------
# File errors: one line, naming the file and the record


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _error(data: InstructData, tokenizer: Tokenizer) -> str:
    with pytest.raises(UserError) as info:
        data.setup(tokenizer, 64, "debug")
    message = str(info.value)
    assert "\n" not in message
    return message


def test_malformed_json_reports_the_position(tmp_path, neox):
    text = '[\n  {"instruction": "a", "output": "b"},\n  {"instruction": "c" "output": 1}\n]'
    path = _write(tmp_path, "broken.json", text)
    message = _error(Alpaca(json_path=path), neox)
    assert "broken.json" in message and "line 3 column" in message
    path = _write(tmp_path, "broken.jsonl", '{"instruction": "a", "output": "b"}\n\n{"instruction": "c", \n')
    message = _error(Alpaca(json_path=path), neox)
    assert "broken.jsonl line 3" in message and "not valid JSON" in message


def test_missing_field_names_field_record_and_keys(tmp_path, neox):
    records = [{"instruction": "a", "input": "", "output": "b"}] * 3 + [{"instruction": "c", "response": "d"}]
    path = _write(tmp_path, "missing.json", json.dumps(records))
    message = _error(Alpaca(json_path=path), neox)
    assert "missing.json record 3" in message and "'output'" in message and "'instruction', 'response'" in message
    message = _error(JSON(json_path=path, response_key="answer"), neox)
    assert "missing.json record 0" in message and "'answer'" in message and "--data.response_key" in message
    lines = "".join(json.dumps(r) + "\n" for r in records)
    message = _error(Alpaca(json_path=_write(tmp_path, "missing.jsonl", lines)), neox)
    assert "missing.jsonl line 4" in message and "'output'" in message
    # An input field that no record has is a misspelled key, not "no inputs".
    path = _write(tmp_path, "no_context.json", json.dumps(records[:3]))
    message = _error(JSON(json_path=path, input_key="context"), neox)
    assert "no_context.json" in message and "'context'" in message and "--data.input_key" in message


def test_non_string_field_and_non_object_record(tmp_path, neox):
    records = [{"instruction": "a", "input": "", "output": "b"}, {"instruction": "c", "input": "", "output": 5}]
    message = _error(Alpaca(json_path=_write(tmp_path, "number.json", json.dumps(records))), neox)
    assert "number.json record 1" in message and "'output'" in message and "number" in message
    message = _error(Alpaca(json_path=_write(tmp_path, "list.json", json.dumps([records[0], ["x"]]))), neox)
    assert "list.json record 1" in message and "array" in message
    # A null or absent input is no input.
    ok = [{"instruction": "a", "input": None, "output": "b"}, {"instruction": "c", "output": "d"}]
    data = Alpaca(json_path=_write(tmp_path, "ok.json", json.dumps(ok)), val_split_fraction=0)
    data.setup(neox, 64, "debug")
    assert data.stats["train_samples"] == 2


def test_empty_and_wrongly_shaped_files(tmp_path, neox):
    assert "empty.json is empty" in _error(Alpaca(json_path=_write(tmp_path, "empty.json", " \n")), neox)
    assert "none.json has no records" in _error(Alpaca(json_path=_write(tmp_path, "none.json", "[]")), neox)
    message = _error(Alpaca(json_path=_write(tmp_path, "obj.json", '{\n "data": [],\n "v": 1\n}')), neox)
    assert "obj.json holds a single JSON object" in message and "data" in message
    message = _error(Alpaca(json_path=tmp_path / "absent.json"), neox)
    assert "absent.json does not exist" in message
    (tmp_path / "bin.json").write_bytes(b'[{"instruction": "\xff"}]')
    assert "bin.json is not UTF-8" in _error(Alpaca(json_path=tmp_path / "bin.json"), neox)
    assert [where for where, _ in read_json_records(SEED_TASKS)][:2] == ["line 1", "line 2"]


# ---------------------------------------------------------------------------------------------------
# The loader: determinism, exact resume, ranks, padding


def _indices(batch_list):
    return [b.tolist() for b in batch_list]


def _run(loader: InstructLoader, n: int) -> list[dict]:
    """The next `n` batches, over epochs, the way the training loop iterates (a new pass per epoch)."""
    out = []
    while len(out) < n:
        for batch in loader:
            out.append(batch)
            if len(out) == n:
                break
    return out


def _same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["labels"], y["labels"]) for x, y in zip(a, b)
    )


def test_sampler_is_deterministic_and_reshuffles_each_epoch(tiny):
    samples = tiny._train
    make = lambda seed: InstructLoader(samples, 4, shuffle=True, seed=seed, pad_id=tiny.pad_id)  # noqa: E731
    a, b = make(1), make(1)
    assert _indices(a.batch_indices(0)) == _indices(b.batch_indices(0))
    assert _indices(a.batch_indices(0)) != _indices(a.batch_indices(1))
    assert _indices(a.batch_indices(0)) != _indices(make(2).batch_indices(0))
    for epoch in range(3):
        flat = [i for batch in a.batch_indices(epoch) for i in batch.tolist()]
        assert len(flat) == len(set(flat)) == len(a) * 4 == (len(samples) // 4) * 4


@pytest.mark.parametrize("k", [0, 5, 23, 24, 30])  # mid-epoch, end of epoch 0, across the boundary
def test_resume_continues_at_the_exact_next_batch(tiny, k):
    samples = tiny._train  # 95 samples: 23 batches of 4 per epoch
    make = lambda: InstructLoader(samples, 4, shuffle=True, seed=5, pad_id=tiny.pad_id)  # noqa: E731
    assert len(make()) == 23
    total = 2 * 23 + 4
    reference = _run(make(), total)

    first = make()
    consumed = _run(first, k)
    state = first.state_dict()
    # After the last batch of epoch 0 the pass has not ended yet: (0, 23); the next pass starts epoch 1.
    expected = (0, 23) if k == 23 else (k // 23, k % 23)
    assert (state["epoch"], state["batches_consumed"]) == expected
    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a round trip through a checkpoint
    rest = _run(resumed, total - k)
    assert _same(consumed + rest, reference)
    assert resumed.epoch == total // 23 and resumed.batches_consumed == total % 23


def test_epoch_counter_and_passes(tiny):
    loader = InstructLoader(tiny._train, 4, shuffle=True, seed=0, pad_id=tiny.pad_id)
    assert (loader.epoch, loader.batches_consumed) == (0, 0)
    first = list(loader)
    assert len(first) == len(loader) == 23
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["batches_consumed"] == 0
    second = list(loader)
    assert loader.epoch == 2 and not _same(first, second)
    # The epoch's order is recomputed from (seed, epoch), not replayed.
    fresh = InstructLoader(tiny._train, 4, shuffle=True, seed=0, pad_id=tiny.pad_id)
    fresh.load_state_dict({"epoch": 1, "batches_consumed": 0})
    assert _same(list(fresh), second)


def test_resume_with_another_batch_size_keeps_the_epoch_fraction(tiny, caplog):
    loader = InstructLoader(tiny._train, 4, shuffle=True, seed=0)
    _run(loader, 10)
    other = InstructLoader(tiny._train, 2, shuffle=True, seed=0)
    with caplog.at_level(logging.WARNING, logger="toolkit"):
        other.load_state_dict(loader.state_dict())
    assert "micro_batch_size" in caplog.text
    assert (other.epoch, other.batches_consumed) == (0, round(10 * 47 / 23))
    # Changed data is noticed too.
    shorter = InstructLoader(tiny._train.subset(list(range(len(tiny._train) - 1))), 4, shuffle=True, seed=0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="toolkit"):
        shorter.load_state_dict(loader.state_dict())
    assert "num_samples" in caplog.text and "samples_checksum" in caplog.text


def test_ranks_get_equal_disjoint_shards(tiny):
    samples = tiny._train
    for group in (True, False):
        ranks = [
            InstructLoader(samples, 3, shuffle=True, seed=9, rank=r, world_size=2, group_by_length=group)
            for r in range(2)
        ]
        assert len(ranks[0]) == len(ranks[1]) == len(samples) // 6
        for epoch in (0, 1):
            shards = [{i for b in r.batch_indices(epoch) for i in b.tolist()} for r in ranks]
            assert shards[0].isdisjoint(shards[1])
            assert len(shards[0]) == len(shards[1]) == len(ranks[0]) * 3
        assert [len(list(r)) for r in ranks] == [len(ranks[0])] * 2
    for group in (True, False):
        # Validation: rank r of W takes micro-batches r, r + W, ... of the one-process sequence, so
        # the first k x W micro-batches of any run are the same samples (and the same batches).
        one = InstructLoader(samples, 4, shuffle=False, group_by_length=group).batch_indices()
        for world in (2, 3):
            val = [InstructLoader(samples, 4, shuffle=False, rank=r, world_size=world, group_by_length=group)
                   for r in range(world)]
            assert all(len(v) == math.ceil(len(samples) / 4) // world for v in val)
            for r, loader in enumerate(val):
                assert [b.tolist() for b in loader.batch_indices()] == [b.tolist() for b in one[r::world][: len(loader)]]
            assert len({i for v in val for b in v.batch_indices() for i in b.tolist()}) == sum(
                b.numel() for v in val for b in v.batch_indices())  # disjoint


@pytest.mark.parametrize("micro_batch_size,step_batch_size", [(2, 32), (2, 8)])  # 4 and 1 micro-batches a step
def test_ranks_share_each_step_evenly(micro_batch_size, step_batch_size):
    """Length-grouped steps on 4 ranks: with 4 micro-batches a step, each rank's tokens in a step
    (padding included, what it costs) are within 15% of every other's; ranks run their micro-batches
    in lockstep, and over the epoch the slowest rank of each micro-step costs at most 10% over the
    ranks' mean; no rank is the busiest in every step. A step holds the samples it holds on one process."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 400, (512,), generator=g)
    samples = TokenizedSamples([[5] * int(n) for n in lengths], [1] * len(lengths))
    world = 4
    accumulation = step_batch_size // (micro_batch_size * world)

    def loader(rank: int, world_size: int) -> InstructLoader:
        return InstructLoader(samples, micro_batch_size, shuffle=True, seed=1, rank=rank, world_size=world_size,
                              step_batch_size=step_batch_size)

    plans = [loader(r, world).batch_indices(0) for r in range(world)]
    one = loader(0, 1).batch_indices(0)
    steps = len(plans[0]) // accumulation
    busiest, lockstep, mean = set(), 0, 0.0
    for step in range(steps):
        mine = [plans[r][step * accumulation : (step + 1) * accumulation] for r in range(world)]
        cost = torch.tensor([[len(b) * int(samples.lengths[b].max()) for b in batches] for batches in mine])
        lockstep += int(cost.max(dim=0).values.sum())  # (world, accumulation) -> the slowest of each micro-step
        mean += float(cost.float().mean(dim=0).sum())
        totals = cost.sum(dim=1)
        if accumulation > 1:
            assert totals.max() <= 1.15 * totals.min(), (step, cost)
        busiest.add(int(totals.argmax()))
        per_step = len(one) // steps
        assert sorted(torch.cat([b for batches in mine for b in batches]).tolist()) == sorted(
            torch.cat(one[step * per_step : (step + 1) * per_step]).tolist())
    assert busiest != {0}
    assert lockstep <= 1.1 * mean, (lockstep, mean)


def test_length_grouping_cuts_padding(llama2, caplog):
    data = Alpaca(json_path=DEMO, prompt_style="alpaca")
    data.setup(llama2, 1024, "debug")
    fractions = {}
    for group in (False, True):
        loader = InstructLoader(data._train, 8, shuffle=True, seed=0, group_by_length=group, pad_id=data.pad_id)
        fractions[group] = sum(loader.padding_fraction(e) for e in range(3)) / 3
        # The measure matches the batches themselves.
        batches = list(loader)
        padded = sum(b["input_ids"].numel() for b in batches)
        real = sum(int((b["labels"] != IGNORE_INDEX).sum()) + int(data._train.masked[i].sum())
                   for b, i in zip(batches, loader.batch_indices(0)))
        assert abs((1 - real / padded) - loader.padding_fraction(0)) < 1e-9
    print(
        f"\nalpaca_en_demo.json, llama2 tokenizer, micro_batch_size 8: padding fraction "
        f"{fractions[False]:.1%} without length grouping, {fractions[True]:.1%} with"
    )
    assert fractions[True] < 0.1 < 0.3 < fractions[False]
    with caplog.at_level(logging.INFO, logger="toolkit"):
        loader = data.train_dataloader(8, seed=0)
    assert "padding (length-grouped)" in caplog.text and 0 < data.stats["padding_fraction"] < 0.1
    # The longest batch comes first, so an out-of-memory shows at the first step.
    widths = [b["input_ids"].shape[1] for b in loader]
    assert widths[0] == max(widths) == data.stats["max_length"]


def test_a_partial_validation_measures_every_length_the_same_way_each_time(llama2):
    """Validation reads its first max_iters batches: those must span short and long samples, not the longest only."""
    data = Alpaca(json_path=DEMO, prompt_style="alpaca", val_split_fraction=0)
    data.setup(llama2, 1024, "debug")
    samples = data._train
    lengths = samples.lengths.float()
    for world_size in (1, 2):
        loaders = [InstructLoader(samples, 4, shuffle=False, rank=r, world_size=world_size) for r in range(world_size)]
        first = [i for loader in loaders for b in loader.batch_indices()[: len(loader) // 4] for i in b.tolist()]
        # A quarter of the batches: their samples are spread over the whole range of lengths.
        assert abs(lengths[first].mean() - lengths.mean()) < 0.15 * lengths.mean()
        assert lengths[first].min() <= lengths.quantile(0.1) and lengths[first].max() == lengths.max()
        for loader in loaders:  # deterministic, batches of similar lengths (little padding)
            batches = [b["input_ids"] for b in loader]
            assert all(torch.equal(a, b["input_ids"]) for a, b in zip(batches, loader))
            assert loader.padding_fraction() < 0.1
        every = [i for loader in loaders for b in loader.batch_indices() for i in b.tolist()]
        expected = len(samples) if world_size == 1 else len(samples) // (4 * world_size) * 4 * world_size
        assert len(set(every)) == len(every) == expected  # each sample once; several processes drop a remainder


def test_loader_misuse(tiny, llama2):
    with pytest.raises(RuntimeError, match="setup"):
        Alpaca(json_path=TINY).train_dataloader(4, seed=0)
    with pytest.raises(UserError, match="micro_batch_size=64"):
        tiny.train_dataloader(64, seed=0, rank=1, world_size=2)
    with pytest.raises(UserError, match="batches_consumed"):
        tiny.train_dataloader(4, seed=0).load_state_dict({"epoch": 1})


def test_cli_chooses_the_dataset_class():
    args = ["--data", "JSON", "--data.json_path", str(SEED_TASKS), "--data.response_key", "name",
            "--data.input_key", "null", "--data.mask_prompt", "false"]
    data = data_from_cli(args)
    assert isinstance(data, JSON) and data.response_key == "name" and data.input_key is None
    assert data.mask_prompt is False and data.json_path == SEED_TASKS
    data = data_from_cli(["--data", "Alpaca", "--data.json_path", str(TINY)])
    assert isinstance(data, Alpaca) and data.prompt_style is None and data.val_split_fraction == 0.05


@pytest.mark.parametrize("style", ["chatml", None])
def test_generate_with_a_prompt_style_stops_at_its_end_of_turn_token(tmp_path, style, capsys):
    """A model that always says <|im_end|>: with --prompt_style chatml the reply ends there, as
    fine-tuning taught it to; without a style it runs to --max_new_tokens."""
    from tokenizers import Tokenizer as HFTokenizer

    from toolkit.generate import generate
    from toolkit.model_dir import save_checkpoint_files
    from toolkit.models.config import Config

    hf = HFTokenizer.from_file(str(ASSETS / "tokenizers" / "gpt-neox-20b" / "tokenizer.json"))
    hf.add_special_tokens(["<|im_end|>"])
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    hf.save(str(tokenizer_dir / "tokenizer.json"))
    end_of_turn = hf.token_to_id("<|im_end|>")
    config = Config.from_name("debug-neox", vocab_size=hf.get_vocab_size(), lm_head_bias=True)
    model = gpt.GPT(config)
    state = {name: torch.zeros_like(p) for name, p in model.state_dict().items()}
    state["lm_head.bias"][end_of_turn] = 10.0  # every position's most likely token
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    save_checkpoint_files(checkpoint, state, config, tokenizer_dir)

    generate(checkpoint, prompt="Say hi.", prompt_style=style, max_new_tokens=5, temperature=0.0)
    assert ("[1 tokens" if style else "[5 tokens") in capsys.readouterr().out  # <|im_end|> decodes to nothing
