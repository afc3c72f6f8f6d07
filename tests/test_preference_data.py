"""Preference pairs (--data Preference / HFPreference): every record layout parsed and masked (the
labelled tokens decode to the response and its end token, both sides share the prompt's tokens), the
implicit prompt, one-line errors naming the record, the length rule, the batch contract and the
loaders (determinism, sharding, resume), Hugging Face files, and LLaMA-Factory's real file."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from conftest import ASSETS, data_from_cli
from toolkit.data import HFPreference, Preference
from toolkit.data.preference import shared_text_prompt
from toolkit.data.prompts import get_style
from toolkit.errors import UserError
from toolkit.models import IGNORE_INDEX
from toolkit.tokenizer import Tokenizer

LLAMA2 = ASSETS / "tokenizers" / "llama2"
DPO_DEMO = ASSETS / "instruct" / "dpo_en_demo.json"  # LLaMA-Factory's, first 12 pairs

# (prompt, chosen, rejected)
TRIPLES = [
    ("What is the capital of France?", "Paris.", "Lyon, I think."),
    ("Name a primary colour.", "Red.", "Purple is one."),
    ("How many legs has a spider?", "Eight, all of them jointed.", "Six."),
    ("Write {{ x }} in Jinja.", "`{{ x }}` prints x.", "I cannot."),
]


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(LLAMA2)


def _setup(tokenizer, path: Path, max_seq_length: int = 256, **options) -> Preference:
    options = {"chat_template": "zephyr", "val_split_fraction": 0, **options}
    data = Preference(json_path=path, **options)
    data.setup(tokenizer, max_seq_length)
    return data


def _first_label(labels: torch.Tensor) -> int:
    return int((labels != IGNORE_INDEX).nonzero()[0])


def _batches(data: Preference, micro_batch_size: int = 2, seed: int = 3, **loader) -> list[dict]:
    return list(data.train_dataloader(micro_batch_size, seed=seed, **loader))


def _same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x.keys() == y.keys() == {"input_ids", "labels", "pair_ids"}
        assert all(torch.equal(x[k], y[k]) for k in x)


# ---------------------------------------------------------------------------------------------------
# Layouts and masks

CONVERSATION_LAYOUTS = {
    "explicit prompt": lambda p, c, r: {"prompt": [user(p)], "chosen": [assistant(c)], "rejected": [assistant(r)]},
    "implicit prompt": lambda p, c, r: {"chosen": [user(p), assistant(c)], "rejected": [user(p), assistant(r)]},
    "llama-factory": lambda p, c, r: {"conversations": [{"from": "human", "value": p}],
                                      "chosen": {"from": "gpt", "value": c}, "rejected": {"from": "gpt", "value": r}},
    "prompt repeated in the answers": lambda p, c, r: {"prompt": [user(p)], "chosen": [user(p), assistant(c)],
                                                       "rejected": [user(p), assistant(r)]},
    "text prompt beside conversations": lambda p, c, r: {"prompt": p, "chosen": [user(p), assistant(c)],
                                                         "rejected": [user(p), assistant(r)]},
    "single message objects": lambda p, c, r: {"prompt": user(p), "chosen": assistant(c), "rejected": assistant(r)},
}


def _check_pairs(data: Preference, tokenizer: Tokenizer, triples: list, prompt_text, end: str) -> None:
    """Each pair's labelled tokens decode to its response and `end`; both sides share the prompt's
    tokens, which decode to `prompt_text(prompt)`."""
    for batch in _batches(data):
        b = len(batch["pair_ids"])
        assert batch["input_ids"].shape == batch["labels"].shape == (2 * b, batch["input_ids"].shape[1])
        for row, pair in enumerate(batch["pair_ids"].tolist()):
            prompt, chosen, rejected = triples[pair]
            firsts = []
            for side, response in ((row, chosen), (b + row, rejected)):
                labels = batch["labels"][side]
                trained = tokenizer.decode(labels[labels != IGNORE_INDEX], skip_special_tokens=False)
                assert trained.strip() == response + end, (trained, response)
                firsts.append(_first_label(labels))
            n = min(firsts) + 1  # input positions up to the first label are prompt
            assert torch.equal(batch["input_ids"][row, :n], batch["input_ids"][b + row, :n])
            assert tokenizer.decode(batch["input_ids"][row, :n], skip_special_tokens=False).strip() == prompt_text(prompt)


def test_conversation_layouts_give_the_same_batches_with_the_responses_trained(tokenizer, tmp_path):
    records = {name: [make(*t) for t in TRIPLES] for name, make in CONVERSATION_LAYOUTS.items()}
    modules = {name: _setup(tokenizer, _write_jsonl(tmp_path / f"{i}.jsonl", recs))
               for i, (name, recs) in enumerate(records.items())}
    reference = _batches(modules["explicit prompt"])
    for name, data in modules.items():
        _same(_batches(data), reference)
    # zephyr: "<|user|>\n{prompt}</s>\n<|assistant|>\n{answer}</s>\n"; the answer and its </s> are trained.
    _check_pairs(modules["explicit prompt"], tokenizer, TRIPLES, lambda p: f"<|user|>\n{p}</s> \n<|assistant|>", "</s>")
    assert modules["explicit prompt"].stats["train_samples"] == len(TRIPLES)


def test_text_pairs_with_a_prompt_style_and_with_an_implicit_prompt(tokenizer, tmp_path):
    explicit = _write_jsonl(tmp_path / "explicit.jsonl", [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in TRIPLES])
    data = _setup(tokenizer, explicit, prompt_style="alpaca")
    alpaca = get_style("alpaca")
    _check_pairs(data, tokenizer, TRIPLES, lambda p: "<s> " + alpaca.apply(p).strip(), "</s>")
    assert data.template is None, "text pairs render no chat template"

    # Anthropic HH-RLHF's layout: the prompt is the shared start, up to the word where the texts part,
    # without the whitespace before that word; with no whitespace before the difference, the whole shared start.
    for chosen, rejected, prompt in (("A: It is blue.", "A: It is black.", "A: It is"), ("A:\n\nYes", "A:\n\nNo", "A:"),
                                     ("2+2=4", "2+2=5", "2+2="), ("Yes", "No", "")):
        assert chosen[: shared_text_prompt(chosen, rejected)] == prompt
    hh = [{"chosen": f"\n\nHuman: {p}\n\nAssistant: {c}", "rejected": f"\n\nHuman: {p}\n\nAssistant: {r}"}
          for p, c, r in TRIPLES]
    hh.append({"chosen": "\n\nHuman: Sky?\n\nAssistant: It is blue.", "rejected": "\n\nHuman: Sky?\n\nAssistant: It is black."})
    data = _setup(tokenizer, _write_jsonl(tmp_path / "hh.jsonl", hh), prompt_style="alpaca")
    triples = TRIPLES + [("Sky?\n\nAssistant: It is", "blue.", "black.")]
    _check_pairs(data, tokenizer, triples, lambda p: f"<s> \n\nHuman: {p}" + ("" if p.endswith("is") else "\n\nAssistant:"),
                 "</s>")


def test_implicit_multi_turn_prompt_trains_only_the_last_answers(tokenizer, tmp_path):
    history = [user("Hi."), assistant("Hello! How can I help?"), user("Capital of Italy?")]
    records = [{"chosen": [*history, assistant("Rome.")], "rejected": [*history, assistant("Milan.")]}] * 2
    data = _setup(tokenizer, _write_jsonl(tmp_path / "multi.jsonl", records), system_prompt="Be brief.")
    batch = _batches(data)[0]
    for row, answer in ((0, "Rome."), (2, "Milan.")):
        labels = batch["labels"][row]
        assert tokenizer.decode(labels[labels != IGNORE_INDEX], skip_special_tokens=False).strip() == answer + "</s>"
        prompt = tokenizer.decode(batch["input_ids"][row, : _first_label(labels) + 1], skip_special_tokens=False)
        assert prompt.startswith("<|system|>\nBe brief.</s>") and "Hello! How can I help?</s>" in prompt


@pytest.mark.parametrize(
    "record, problem",
    [
        ("hi", "is a JSON string; each record must be a JSON object"),
        ({"prompt": "p", "chosen": "a"}, r"no 'rejected' field \(its fields: 'prompt', 'chosen'\)"),
        ({"prompt": "p", "chosen": "a", "rejected": ["b"]}, "'chosen' is a JSON string and 'rejected' a JSON array"),
        ({"prompt": 3, "chosen": "a", "rejected": "b"}, "'prompt' is a JSON number, but 'chosen' and 'rejected' are strings"),
        ({"prompt": "p", "chosen": "same", "rejected": "same "}, "'chosen' and 'rejected' are the same text"),
        ({"prompt": "p", "chosen": " ", "rejected": "b"}, "'chosen' is empty"),
        ({"prompt": "", "chosen": "a", "rejected": "b"}, "'prompt' is empty"),
        ({"chosen": "Yes.", "rejected": "No."}, "share no start to take as the prompt"),
        ({"chosen": "Answer: ", "rejected": "Answer: yes"}, "'chosen' adds nothing to the prompt"),
        ({"prompt": [user("p")], "chosen": [assistant("a")], "rejected": [assistant("a")]},
         "'chosen' and 'rejected' are the same messages"),
        ({"chosen": [user("p"), assistant("a")], "rejected": [user("q"), assistant("b")]}, "they share no prompt"),
        ({"chosen": [user("p"), assistant("a"), user("q"), assistant("b")],
          "rejected": [user("p"), assistant("a"), user("r"), assistant("c")]},
         "the conversations part at message 2, a 'user' message in 'chosen'"),
        ({"chosen": [user("p"), assistant("a")], "rejected": [user("p"), assistant("a"), user("q"), assistant("b")]},
         "'chosen' has no message after the 2 the two conversations share: no response"),
        ({"prompt": [user("p")], "chosen": [user("p"), assistant("a")], "rejected": [assistant("b")]},
         "'chosen' starts with the prompt's messages and the other response does not"),
        ({"prompt": [user("p")], "chosen": [user("q"), assistant("a")], "rejected": [user("q"), assistant("b")]},
         "'chosen' starts with a 'user' message that is not the prompt's"),
        ({"prompt": [user("p")], "chosen": [assistant("")], "rejected": [assistant("b")]},
         r"line 2 'chosen': message 0 \(assistant\) has empty content"),
        ({"prompt": [user("p")], "chosen": [assistant("a"), user("q")], "rejected": [assistant("b")]},
         r"line 2 'chosen': the last message's role is 'user'"),
        ({"prompt": 5, "chosen": [assistant("a")], "rejected": [assistant("b")]}, "'prompt' is a JSON number; expected the prompt's messages"),
        ({"prompt": [{"role": "bot", "content": "p"}], "chosen": [assistant("a")], "rejected": [assistant("b")]},
         r"line 2 'prompt': message 0 has an unknown role 'bot'"),
    ],
)
def test_bad_records_are_one_line_naming_the_record(tokenizer, tmp_path, record, problem):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}, record])
    data = data_from_cli(["--data", "Preference", "--data.json_path", str(path)])  # as the fine-tuning commands build it
    with pytest.raises(UserError, match=problem) as caught:
        data.setup(tokenizer, max_seq_length=64)
    assert "\n" not in str(caught.value) and f"{path} line 2" in str(caught.value)


def test_options_that_do_not_apply_are_refused(tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}])
    for options, message in (({"mask_prompt": False}, "mask_prompt false does not apply"),
                             ({"packing": True}, "packing does not apply"),
                             ({"keep_prompt_tokens": 64}, "keep_prompt_tokens must be between 0 and max_seq_length - 1")):
        with pytest.raises(UserError, match=message):
            _setup(tokenizer, path, 64, **options)


# ---------------------------------------------------------------------------------------------------
# Length rule


def _sides(data: Preference, pair: int = 0) -> list[tuple[list[int], list[int]]]:
    """(tokens, trained tokens) of each side of a pair (a side ends with its last trained token)."""
    sides = []
    for ids, labels in data._train.rows(pair):
        targets = labels[labels != IGNORE_INDEX].tolist()
        sides.append((ids.tolist() + targets[-1:], targets))
    return sides


def test_long_pairs_lose_the_start_of_their_prompt_then_the_end_of_their_responses(tokenizer, tmp_path):
    words = " ".join(f"word{i}" for i in range(60))
    record = {"prompt": [user(f"Start here. {words} End here: what now?")], "chosen": [assistant("Go on, then stop.")],
              "rejected": [assistant("Stop.")]}
    path = _write_jsonl(tmp_path / "long.jsonl", [record])
    whole = _sides(_setup(tokenizer, path, 1024, chat_template="llama-2"))
    (chosen, chosen_targets), (rejected, rejected_targets) = whole
    assert chosen[0] == tokenizer.bos_id and len(chosen) > len(rejected)
    first = len(chosen) - len(chosen_targets)  # the first trained token: the prompt is tokens[:first]
    assert first == len(rejected) - len(rejected_targets) and chosen[:first] == rejected[:first]

    # 1. Room for the responses and part of the prompt: BOS, then the prompt's last tokens, the responses whole.
    over = 20
    max_seq_length = len(chosen) - 1 - over
    cut = _sides(_setup(tokenizer, path, max_seq_length, chat_template="llama-2"))
    assert len(cut[0][0]) == max_seq_length + 1
    for (tokens, targets), (old_tokens, old_targets) in zip(cut, whole):
        assert targets == old_targets
        assert tokens == old_tokens[:1] + old_tokens[1 + over :]
    assert "End here: what now? [/INST]" in tokenizer.decode(cut[0][0], skip_special_tokens=False)
    assert "Start here" not in tokenizer.decode(cut[0][0])

    # 2. The prompt keeps keep_prompt_tokens (BOS included); the longer response loses its end (and </s>).
    keep = first - 5
    max_seq_length = keep + 3  # room for 4 response tokens
    cut = _sides(_setup(tokenizer, path, max_seq_length, chat_template="llama-2", keep_prompt_tokens=keep))
    (tokens, targets), (rejected_cut, rejected_kept) = cut
    assert tokens == chosen[:1] + chosen[first - keep + 1 : first + 4]
    assert targets == chosen_targets[:4] and tokenizer.eos_id not in targets
    assert rejected_cut[:keep] == tokens[:keep] and rejected_kept == rejected_targets[: len(rejected_kept)]
    assert len(rejected_cut) <= max_seq_length + 1


def test_a_pair_with_no_trained_token_left_is_dropped_and_counted(tokenizer, tmp_path, caplog):
    """With train_reasoning false the reasoning is context: a response cut inside it trains nothing."""
    reasoning = "<think>" + " ".join(f"step{i}" for i in range(40)) + "</think>"
    records = [
        {"prompt": [user("Sum?")], "chosen": [assistant("Four.")], "rejected": [assistant("Five.")]},
        {"prompt": [user("Sum?")], "chosen": [assistant(reasoning + "Four.")], "rejected": [assistant("Five.")]},
    ]
    path = _write_jsonl(tmp_path / "think.jsonl", records)
    caplog.set_level(logging.WARNING)
    data = _setup(tokenizer, path, 48, train_reasoning=False, keep_prompt_tokens=8)
    assert data.stats["train_samples"] == 1 and data.stats["dropped_train"] == 1
    assert "dropped 1 of 2 training pairs (the first: line 2)" in caplog.text


# ---------------------------------------------------------------------------------------------------
# Loaders


@pytest.fixture(scope="module")
def many(tokenizer, tmp_path_factory) -> Preference:
    """24 conversation pairs of varied lengths."""
    records = [{"prompt": [user(f"{p} " + "Please. " * (i % 7))], "chosen": [assistant(c + " Sure." * (i % 5))],
                "rejected": [assistant(r)]} for i, (p, c, r) in enumerate(TRIPLES * 6)]
    path = _write_jsonl(tmp_path_factory.mktemp("pairs") / "many.jsonl", records)
    return _setup(tokenizer, path)


def test_batches_follow_the_contract(many):
    for batch in _batches(many, micro_batch_size=3):
        ids, labels, pair_ids = batch["input_ids"], batch["labels"], batch["pair_ids"]
        b = len(pair_ids)
        assert ids.dtype == labels.dtype == pair_ids.dtype == torch.int64 and ids.shape[0] == 2 * b == 6
        widths = []
        for row, pair in enumerate(pair_ids.tolist()):
            for side, (want_ids, want_labels) in zip((row, b + row), many._train.rows(pair)):
                n = len(want_ids)
                widths.append(n)
                assert torch.equal(ids[side, :n], want_ids) and torch.equal(labels[side, :n], want_labels)
                assert (ids[side, n:] == many.pad_id).all() and (labels[side, n:] == IGNORE_INDEX).all()
        assert ids.shape[1] == max(widths)


def test_loaders_are_deterministic_sharded_and_resume_at_the_exact_batch(many):
    whole = _batches(many, micro_batch_size=2, seed=5)
    _same(whole, _batches(many, micro_batch_size=2, seed=5))
    assert [b["pair_ids"].tolist() for b in whole] != [b["pair_ids"].tolist() for b in _batches(many, 2, seed=6)]
    assert sorted(i for b in whole for i in b["pair_ids"].tolist()) == list(range(24))

    # Two ranks: as many batches each, every pair once per epoch, over two epochs.
    for epoch in range(2):
        loaders = [many.train_dataloader(2, seed=5, rank=r, world_size=2) for r in range(2)]
        for loader in loaders:
            loader.load_state_dict({"epoch": epoch, "batches_consumed": 0})
        seen = [[i for b in loader for i in b["pair_ids"].tolist()] for loader in loaders]
        assert len(seen[0]) == len(seen[1]) == 12 and sorted(seen[0] + seen[1]) == list(range(24))

    loader = many.train_dataloader(2, seed=5)
    head = [batch for _, batch in zip(range(5), loader)]
    resumed = many.train_dataloader(2, seed=5)
    resumed.load_state_dict(loader.state_dict())
    _same(head + list(resumed), whole)

    # Length grouping (by the longer side of each pair) pads less than file order.
    grouped = many.train_dataloader(4, seed=5).padding_fraction(0)
    many.group_by_length = False
    try:
        assert grouped < many.train_dataloader(4, seed=5).padding_fraction(0)
    finally:
        many.group_by_length = True


def test_validation_and_reference_loaders_cover_their_split(tokenizer, many):
    data = Preference(json_path=many.json_path, chat_template="zephyr", val_split_fraction=0.25)
    data.setup(tokenizer, 256)
    assert data.num_pairs("train") == 18 and data.num_pairs("val") == 6
    val = [i for b in data.val_dataloader(2) for i in b["pair_ids"].tolist()]
    assert sorted(val) == list(range(6))
    for split, n in (("train", 18), ("val", 6)):
        loaders = [data.reference_dataloader(split, 4, rank=r, world_size=2) for r in range(2)]
        assert len(loaders[0]) == len(loaders[1])
        assert {i for loader in loaders for b in loader for i in b["pair_ids"].tolist()} == set(range(n))


# ---------------------------------------------------------------------------------------------------
# Hugging Face datasets and the real LLaMA-Factory file


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    datasets = pytest.importorskip("datasets", reason="install the hf-datasets extra: pip install -e '.[hf-datasets]'")
    home = tmp_path_factory.mktemp("hf_home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HOME", str(home))
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
        yield datasets


def test_llama_factory_demo_file_masks_each_chosen_and_rejected_answer(tokenizer):
    records = json.loads(DPO_DEMO.read_text())
    data = data_from_cli(["--data", "Preference", "--data.json_path", str(DPO_DEMO), "--data.chat_template", "llama-2",
                          "--data.val_split_fraction", "0"])
    data.setup(tokenizer, 4096)
    assert data.stats["train_samples"] == len(records) == 12 and data.stats["truncated_train"] == 0
    for i, record in enumerate(records):
        for (ids, labels), answer in zip(data._train.rows(i), (record["chosen"], record["rejected"])):
            trained = tokenizer.decode(labels[labels != IGNORE_INDEX], skip_special_tokens=False)
            assert trained.strip() == answer["value"].strip() + " </s>"  # llama-2: "[/INST] answer </s>"
            prompt = tokenizer.decode(ids[: _first_label(labels) + 1], skip_special_tokens=False)
            assert prompt.rstrip().endswith(record["conversations"][-1]["value"].strip()[-40:] + " [/INST]")


def test_hf_preference_from_parquet_json_and_save_to_disk_gives_the_batches_of_the_same_json(tokenizer, datasets, tmp_path):
    records = json.loads(DPO_DEMO.read_text())
    (tmp_path / "demo.json").write_text(json.dumps(records))
    reference = _setup(tokenizer, tmp_path / "demo.json", 512, chat_template="llama-2")
    table = datasets.Dataset.from_list([{"dialog": r["conversations"], "good": r["chosen"], "bad": r["rejected"]}
                                        for r in records])
    table.to_parquet(str(tmp_path / "demo.parquet"))
    table.to_json(str(tmp_path / "demo.jsonl"))
    datasets.DatasetDict({"train": table, "test": table.select(range(4))}).save_to_disk(str(tmp_path / "saved"))
    for path in ("demo.parquet", "demo.jsonl", "saved"):
        data = data_from_cli(["--data", "HFPreference", "--data.path", str(tmp_path / path), "--data.chat_template",
                              "llama-2", "--data.columns", "{conversations: dialog, chosen: good, rejected: bad}",
                              "--data.val_split_fraction", "0"])
        data.setup(tokenizer, 512)
        _same(_batches(data), _batches(reference))
    # TRL's conversational layout, with a validation split.
    trl = [{"prompt": [user(p)], "chosen": [assistant(c)], "rejected": [assistant(r)]} for p, c, r in TRIPLES]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(trl * 2), "test": datasets.Dataset.from_list(trl)}).save_to_disk(
        str(tmp_path / "trl"))
    data = HFPreference(path=str(tmp_path / "trl"), val_split="test", chat_template="zephyr")
    data.setup(tokenizer, 256)
    assert data.num_pairs("train") == 8 and data.num_pairs("val") == 4
    _check_pairs(data, tokenizer, TRIPLES * 2, lambda p: f"<|user|>\n{p}</s> \n<|assistant|>", "</s>")
    with pytest.raises(UserError, match="has no column 'chosen', 'rejected'"):
        HFPreference(path=str(tmp_path / "demo.parquet")).setup(tokenizer, 256)
