"""Hugging Face datasets as training data (--data HFInstruct / HFChat / HFText).

The same records, written by `datasets` itself as Parquet and as a `save_to_disk` folder (built
here, from the repository's assets), give exactly the batches the JSON modules give; a Parquet text
column fills the litdata cache and pretrains; bad input is one line.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ASSETS, REPO, data_from_cli, launch_env
from toolkit.data import Alpaca, Chat, HFChat, HFInstruct
from toolkit.errors import UserError
from toolkit.tokenizer import Tokenizer

datasets = pytest.importorskip("datasets", reason="install the hf-datasets extra: pip install -e '.[hf-datasets]'")

LLAMA2 = ASSETS / "tokenizers" / "llama2"
MAX_SEQ = 96


@pytest.fixture(scope="module", autouse=True)
def hf_home(tmp_path_factory):
    """`datasets` keeps its Arrow cache under HF_HOME: here, a folder of the test, not the user's cache."""
    home = tmp_path_factory.mktemp("hf_home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HOME", str(home))  # for the subprocesses
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")  # read once, at import
        yield home


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(LLAMA2)


@pytest.fixture(scope="module")
def alpaca(tmp_path_factory) -> dict:
    """40 Alpaca records as JSON, as Parquet with other column names, and as a save_to_disk DatasetDict."""
    root = tmp_path_factory.mktemp("hf_alpaca")
    records = [{k: r[k] for k in ("instruction", "input", "output")}
               for r in json.loads((ASSETS / "instruct" / "alpaca_tiny.json").read_text())[:40]]
    (root / "data.json").write_text(json.dumps(records))
    renamed = [{"question": r["instruction"], "context": r["input"], "answer": r["output"], "id": i}
               for i, r in enumerate(records)]
    datasets.Dataset.from_list(renamed).to_parquet(str(root / "data.parquet"))
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list(records),
        "test": datasets.Dataset.from_list(records[:8]),
    }).save_to_disk(str(root / "saved"))
    return {"root": root, "records": records}


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    """30 ShareGPT conversations as JSON, and their messages in a column named dialog (Parquet, save_to_disk)."""
    root = tmp_path_factory.mktemp("hf_chat")
    records = json.loads((ASSETS / "instruct" / "fastchat_dummy_conversation.json").read_text())[:30]
    (root / "data.json").write_text(json.dumps(records))
    table = datasets.Dataset.from_list([{"id": r["id"], "dialog": r["conversations"]} for r in records])
    table.to_parquet(str(root / "data.parquet"))
    table.save_to_disk(str(root / "saved"))
    return root


def _batches(data, tokenizer, n_val: bool = True) -> list[dict]:
    data.setup(tokenizer, MAX_SEQ, "")
    loaders = [data.train_dataloader(2, seed=3, global_batch_size=4)]
    if n_val:
        loaders.append(data.val_dataloader(2))
    return [batch for loader in loaders for batch in loader]


def _assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["labels"], y["labels"])


def test_alpaca_from_parquet_and_save_to_disk_gives_the_batches_of_the_same_json(alpaca, tokenizer):
    root = alpaca["root"]
    reference = _batches(Alpaca(json_path=root / "data.json", prompt_style="alpaca"), tokenizer)
    parquet = data_from_cli([
        "--data", "HFInstruct", "--data.path", str(root / "data.parquet"), "--data.prompt_style", "alpaca",
        "--data.columns", "{instruction: question, input: context, output: answer}",
    ])
    _assert_same(reference, _batches(parquet, tokenizer))
    saved = HFInstruct(path=str(root / "saved"), split="train", prompt_style="alpaca")
    _assert_same(reference, _batches(saved, tokenizer))
    # Streaming reads the same rows.
    streamed = HFInstruct(path=str(root / "saved"), streaming=True, prompt_style="alpaca")
    _assert_same(reference, _batches(streamed, tokenizer))


def test_val_split_and_max_records(alpaca, tokenizer):
    root = alpaca["root"]
    data = HFInstruct(path=str(root / "saved"), val_split="test", max_records=20, prompt_style="alpaca")
    data.setup(tokenizer, MAX_SEQ, "")
    stats = data.stats  # (a record whose prompt fills MAX_SEQ is dropped, and counted)
    assert stats["train_samples"] + stats["dropped_train"] == 20, "max_records, none held out for validation"
    assert stats["val_samples"] + stats["dropped_val"] == 8


def test_chat_from_parquet_and_save_to_disk_gives_the_batches_of_the_same_json(chats, tokenizer):
    reference = _batches(Chat(json_path=chats / "data.json", chat_template="llama-2"), tokenizer)
    for path in (chats / "data.parquet", chats / "saved"):
        data = data_from_cli([
            "--data", "HFChat", "--data.path", str(path), "--data.columns", "{conversations: dialog}",
            "--data.chat_template", "llama-2",
        ])
        _assert_same(reference, _batches(data, tokenizer))


def test_bad_input_is_one_line(alpaca, chats, tokenizer, tmp_path):
    root = alpaca["root"]
    cases = [
        (HFInstruct(path=str(root / "data.parquet")), "has no column 'instruction', 'output' (its columns: question, context, answer, id)"),
        (HFInstruct(path=str(root / "saved"), split="validation"), "has no split 'validation' (its splits: train, test); set --data.split"),
        (HFInstruct(path=str(root / "saved"), val_split="validation"), "has no split 'validation' (its splits: train, test); set --data.val_split"),
        # One file, or one saved Dataset, is the training split: validating on it would use the training rows.
        (HFInstruct(path=str(root / "data.parquet"), val_split="test", columns={"instruction": "question", "input": "context", "output": "answer"}),
         "holds one split, which trains; --data.val_split test would validate on those same rows"),
        (HFChat(path=str(chats / "saved"), val_split="test", columns={"conversations": "dialog"}),
         "holds one split, which trains; --data.val_split test would validate on those same rows"),
        (HFInstruct(path=str(tmp_path / "missing.parquet")), "missing.parquet does not exist"),
        (HFChat(path=str(chats / "saved")), "has no column 'messages' or 'conversations'"),
    ]
    for data, expected in cases:
        with pytest.raises(UserError) as error:
            data.setup(tokenizer, MAX_SEQ, "llama-2")
        assert expected in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(UserError, match="maps 'prompt', which this data does not read"):
        HFInstruct(path=str(root / "data.parquet"), columns={"prompt": "question"})


def test_offline_hub_dataset_not_in_the_cache_fails_in_one_line(base, tmp_path):
    env = dict(launch_env(), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"),
               PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-m", "toolkit", "finetune_lora", str(base["checkpoint"]), "--out_dir", str(tmp_path / "out"),
         "--data", "HFInstruct", "--data.path", "toolkit-tests/not-a-dataset"],
        capture_output=True, text=True, env=env, timeout=300, cwd=REPO,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "cannot load the dataset toolkit-tests/not-a-dataset" in errors[0], result.stderr[-2000:]
    assert "offline (HF_HUB_OFFLINE=1)" in errors[0] and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_pretraining_from_a_parquet_text_column_fills_the_litdata_cache_and_trains(tmp_path):
    text = (ASSETS / "tinyshakespeare.txt").read_text()
    paragraphs = [p for p in text.split("\n\n") if p.strip()][:400]
    datasets.Dataset.from_dict({"content": paragraphs, "n": list(range(len(paragraphs)))}).to_parquet(
        str(tmp_path / "corpus.parquet"))
    out, cache = tmp_path / "run", tmp_path / "cache"
    result = subprocess.run(
        [sys.executable, "-m", "toolkit", "pretrain", "debug-neox", "--out_dir", str(out),
         "--data", "HFText", "--data.path", str(tmp_path / "corpus.parquet"), "--data.columns", "{text: content}",
         "--data.cache_dir", str(cache), "--data.num_workers", "2",
         "--tokenizer_dir", str(ASSETS / "tokenizers" / "gpt-neox-20b"), "--precision", "32-true",
         "--train.micro_batch_size", "2", "--train.global_batch_size", "2", "--train.max_seq_length", "32",
         "--train.max_steps", "2", "--eval.max_iters", "2", "--log.loggers", "[csv]"],
        capture_output=True, text=True, env=dict(launch_env(), PYTHONPATH=str(REPO)), timeout=300, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 2/2" in result.stdout and (out / "final" / "model.safetensors").is_file()
    exported = list((cache / "hf-text").glob("corpus-train-*.jsonl"))
    assert len(exported) == 1
    assert [json.loads(line)["text"] for line in exported[0].read_text().splitlines()] == paragraphs
    entries = [p for p in cache.iterdir() if p.name != "hf-text" and not p.name.startswith(".")]
    assert len(entries) == 1 and (entries[0] / "train" / "index.json").is_file() and (entries[0] / "val" / "index.json").is_file()
    meta = json.loads((entries[0] / "meta.json").read_text())
    assert meta["train_tokens"] > 1000
