"""Tokenizer: BOS/EOS resolution on real tokenizers, encoding parity with transformers, BPE training, errors."""

import json
from pathlib import Path

import pytest
import torch

from toolkit.errors import UserError
from toolkit.tokenizer import TOKENIZER_FILES, Tokenizer, train_bpe_tokenizer


@pytest.fixture(scope="module")
def llama2(assets) -> Tokenizer:
    return Tokenizer(assets / "tokenizers" / "llama2")


@pytest.fixture(scope="module")
def neox(assets) -> Tokenizer:
    return Tokenizer(assets / "tokenizers" / "gpt-neox-20b")


def _shakespeare_lines(assets: Path, n: int) -> list[str]:
    return (assets / "tinyshakespeare.txt").read_text().splitlines()[:n]


def test_llama2_special_tokens(llama2):
    assert llama2.vocab_size == 32000
    assert (llama2.bos_id, llama2.eos_id, llama2.pad_id) == (1, 2, 0)
    assert llama2.add_bos is True
    assert llama2.token_to_id("<s>") == 1 and llama2.token_to_id("no-such-token") is None


def test_llama2_encode_adds_bos_once(llama2):
    ids = llama2.encode("Hello world")
    assert ids.dtype == torch.int64 and ids.ndim == 1
    assert ids.tolist() == [1, 15043, 3186]  # the post-processor's BOS is not added a second time
    assert llama2.encode("Hello world", bos=False).tolist() == [15043, 3186]
    assert llama2.encode("Hello world", eos=True).tolist() == [1, 15043, 3186, 2]
    assert llama2.encode("Hello world", max_length=2).tolist() == [1, 15043]
    assert llama2.decode(ids) == "Hello world"
    assert llama2.decode(ids, skip_special_tokens=False).startswith("<s>")


def test_llama2_matches_transformers(llama2, assets):
    transformers = pytest.importorskip("transformers")
    tokenizer_file = assets / "tokenizers" / "llama2" / "tokenizer.json"
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file))
    texts = _shakespeare_lines(assets, 200) + ["héllo 世界 🙂", "  two spaces", "tab\there", ""]
    for text in texts:
        assert llama2.encode(text).tolist() == hf.encode(text), text


def test_neox_falls_back_to_endoftext(neox):
    assert neox.vocab_size == 50277
    assert neox.bos_id == neox.eos_id == 0 == neox.token_to_id("<|endoftext|>")
    assert neox.add_bos is False
    ids = neox.encode("Hello world", eos=True)
    assert ids[0].item() != 0 and ids[-1].item() == 0
    assert neox.decode(ids) == "Hello world"


def test_encode_batch_matches_encode(llama2, neox, assets):
    texts = _shakespeare_lines(assets, 50)
    for tok in (llama2, neox):
        batch = tok.encode_batch(texts, eos=True)
        assert batch == [tok.encode(t, eos=True).tolist() for t in texts]


def test_save_copies_existing_files(llama2, tmp_path):
    llama2.save(tmp_path / "ckpt")
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    assert set(names) <= set(TOKENIZER_FILES)
    copy = Tokenizer(tmp_path / "ckpt")
    assert (copy.bos_id, copy.eos_id, copy.add_bos) == (1, 2, True)
    assert copy.encode("To be, or not to be").tolist() == llama2.encode("To be, or not to be").tolist()


def _bare(tmp_path: Path, source: Path, **configs) -> Path:
    """A folder with a link to a real tokenizer.json and the given config files."""
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").symlink_to(source / "tokenizer.json")
    for name, content in configs.items():
        (folder / f"{name}.json").write_text(json.dumps(content))
    return folder


def test_bare_llama2_uses_post_processor_bos(tmp_path, assets):
    tok = Tokenizer(_bare(tmp_path, assets / "tokenizers" / "llama2"))
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (1, 2, True)
    assert tok.encode("Hi").tolist()[:2] == [1, 6324]


def test_resolution_order(tmp_path, assets):
    neox_dir = assets / "tokenizers" / "gpt-neox-20b"
    # tokenizer_config (dict form) beats generation_config, which beats config.json; EOS lists give the first.
    folder = _bare(
        tmp_path,
        neox_dir,
        tokenizer_config={"bos_token": {"content": "<|padding|>"}, "add_bos_token": True},
        generation_config={"bos_token_id": 5, "eos_token_id": [7, 8]},
        config={"eos_token_id": 9, "pad_token_id": 3},
    )
    tok = Tokenizer(folder)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.add_bos) == (1, 7, 3, True)
    assert tok.stop_ids == {7, 8}  # generation stops at every listed EOS
    assert tok.encode("x").tolist()[0] == 1


def test_missing_directory(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        Tokenizer(tmp_path / "nope")


def test_directory_without_tokenizer_json(tmp_path):
    with pytest.raises(UserError, match="expected tokenizer.json from a Hugging Face model; pass --tokenizer_dir"):
        Tokenizer(tmp_path)


def test_corrupt_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    with pytest.raises(UserError, match="cannot load .*tokenizer.json") as info:
        Tokenizer(tmp_path)
    assert "\n" not in str(info.value)


def test_corrupt_tokenizer_config(tmp_path, assets):
    folder = _bare(tmp_path, assets / "tokenizers" / "gpt-neox-20b")
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(UserError, match="tokenizer_config.json"):
        Tokenizer(folder)


@pytest.fixture(scope="module")
def shakespeare_slice(tmp_path_factory, assets) -> Path:
    path = tmp_path_factory.mktemp("text") / "slice.txt"
    path.write_text((assets / "tinyshakespeare.txt").read_text()[:100_000])
    return path


def test_train_bpe_round_trip(tmp_path, shakespeare_slice):
    tok = train_bpe_tokenizer([shakespeare_slice], vocab_size=600, out_dir=tmp_path / "tok")
    assert tok.vocab_size == 600
    assert tok.bos_id == tok.eos_id == tok.token_to_id("<|endoftext|>")
    assert tok.add_bos is False
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert config["bos_token"] == config["eos_token"] == "<|endoftext|>"
    text = shakespeare_slice.read_text()[:5000] + "\nUnseen: naïve café ☕\n"
    ids = tok.encode(text, eos=True)
    assert ids[-1].item() == tok.eos_id
    assert len(ids) < len(text.encode()) / 2  # merges were learned
    assert tok.decode(ids) == text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]  # no temp folder left behind


def test_train_bpe_is_deterministic_and_replaces(tmp_path, shakespeare_slice):
    train_bpe_tokenizer([shakespeare_slice], vocab_size=400, out_dir=tmp_path / "a")
    train_bpe_tokenizer([shakespeare_slice], vocab_size=400, out_dir=tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    # Training again into an existing tokenizer folder replaces it.
    tok = train_bpe_tokenizer([shakespeare_slice], vocab_size=300, out_dir=tmp_path / "a")
    assert tok.vocab_size == 300 and Tokenizer(tmp_path / "a").vocab_size == 300
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_train_bpe_bad_input(tmp_path, shakespeare_slice):
    out = tmp_path / "out"
    with pytest.raises(UserError, match="at least 257"):
        train_bpe_tokenizer([shakespeare_slice], vocab_size=100, out_dir=out)
    with pytest.raises(UserError, match="does not exist"):
        train_bpe_tokenizer([tmp_path / "missing.txt"], vocab_size=300, out_dir=out)
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"\x00\x01\x02" * 100)
    with pytest.raises(UserError, match="weights.bin"):
        train_bpe_tokenizer([binary], vocab_size=300, out_dir=out)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9 ol\u00e9".encode("latin-1"))
    with pytest.raises(UserError, match="latin1.txt is not UTF-8"):
        train_bpe_tokenizer([latin1], vocab_size=300, out_dir=out)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    with pytest.raises(UserError, match="no text"):
        train_bpe_tokenizer([empty], vocab_size=300, out_dir=out)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "model.safetensors").write_bytes(b"x")
    with pytest.raises(UserError, match="already holds other files"):
        train_bpe_tokenizer([shakespeare_slice], vocab_size=300, out_dir=busy)
    assert not out.exists()
