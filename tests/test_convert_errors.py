"""Bad input to conversion and download: one clear UserError line, and nothing half-written left.

No network: `download` is exercised against a Hugging Face cache built by hand in a temporary
directory, with HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from conftest import ASSETS

from toolkit.convert import config_from_hf, config_to_hf, convert_from_hf, convert_pretrained_checkpoint, convert_to_hf
from toolkit.download import download, select_files
from toolkit.errors import UserError
from toolkit.models.config import Config

TOKENIZERS = ASSETS / "tokenizers"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny random Llama saved by transformers, with the Pythia tokenizer beside it."""
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    shutil.copyfile(TOKENIZERS / "gpt-neox-20b" / "tokenizer.json", path / "tokenizer.json")
    return path


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def one_line_error(fn, *args, match: str, **kwargs) -> str:
    with pytest.raises(UserError, match=match) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message and message.strip() == message
    return message


def assert_nothing_written(out: Path) -> None:
    assert not out.exists()
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    assert not leftovers, leftovers


def rewrite_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


# ---------------------------------------------------------------------------- convert_from_hf
def test_directory_without_weights(hf_dir, tmp_path):
    bad = copy_of(hf_dir, tmp_path / "bad")
    (bad / "model.safetensors").unlink()
    one_line_error(convert_from_hf, bad, tmp_path / "out", match=r"No weights in .*model\.safetensors")
    assert_nothing_written(tmp_path / "out")


def test_missing_directory_and_missing_config(hf_dir, tmp_path):
    one_line_error(convert_from_hf, tmp_path / "nope", tmp_path / "out", match="does not exist")
    bad = copy_of(hf_dir, tmp_path / "bad")
    (bad / "config.json").unlink()
    one_line_error(convert_from_hf, bad, tmp_path / "out", match="No config.json")
    assert_nothing_written(tmp_path / "out")


def test_unsupported_architecture_lists_supported(hf_dir, tmp_path):
    bad = copy_of(hf_dir, tmp_path / "bad")
    rewrite_config(bad, architectures=["BertForMaskedLM"], model_type="bert")
    message = one_line_error(convert_from_hf, bad, tmp_path / "out", match="Unsupported architecture 'BertForMaskedLM'")
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "GemmaForCausalLM", "PhiForCausalLM",
                 "GPTNeoXForCausalLM", "Phi3ForCausalLM"):
        assert arch in message
    assert_nothing_written(tmp_path / "out")


def test_unsupported_features(hf_dir):
    base = json.loads((hf_dir / "config.json").read_text())
    one_line_error(config_from_hf, {**base, "rope_parameters": {"rope_type": "dynamic", "factor": 4.0}},
                   match="Unsupported RoPE scaling 'dynamic'")
    one_line_error(config_from_hf, {**base, "hidden_act": "relu"}, match="Unsupported activation 'relu'")
    one_line_error(config_from_hf, {**base, "attention_bias": True}, match="attention_bias=True with mlp_bias=False")
    one_line_error(config_from_hf, {**base, "auto_map": {"AutoModel": "x.Y"}}, match="custom code")
    one_line_error(config_from_hf, {k: v for k, v in base.items() if k != "hidden_size"}, match="lacks 'hidden_size'")
    # Values of the wrong type are named, not a TypeError from inside the conversion.
    one_line_error(config_from_hf, {**base, "hidden_size": None}, match="hidden_size must be a whole number, got null")
    one_line_error(config_from_hf, {**base, "num_hidden_layers": [2]}, match=r"num_hidden_layers must be a whole number, got \[2\]")
    one_line_error(config_from_hf, {**base, "rms_norm_eps": "small"}, match='rms_norm_eps must be a number, got "small"')
    one_line_error(config_from_hf, {**base, "tie_word_embeddings": [1]}, match=r"tie_word_embeddings must be true or false")
    one_line_error(config_from_hf, {**base, "architectures": [1]}, match=r"architectures must be a list of class names")
    # Bidirectional attention, however it is asked for (transformers' Llama honours is_causal).
    for flag in ({"is_causal": False}, {"use_bidirectional_attention": True}):
        one_line_error(config_from_hf, {**base, **flag}, match="bidirectional attention .* is not supported")
    assert config_from_hf({**base, "use_bidirectional_attention": None, "sliding_window": None}).n_embd == base["hidden_size"]
    one_line_error(config_from_hf, base, model_name="pythia-14m", match="does not match preset 'pythia-14m'")
    one_line_error(config_to_hf, Config.from_name("debug-neox", n_query_groups=2), match="grouped-query")


def test_mismatched_shapes(hf_dir, tmp_path):
    bad = copy_of(hf_dir, tmp_path / "bad")
    rewrite_config(bad, intermediate_size=64)
    one_line_error(convert_from_hf, bad, tmp_path / "out", match=r"Shape mismatch for 'model\.layers\.0\.mlp\.(down|gate|up)_proj\.weight': the checkpoint has")
    assert_nothing_written(tmp_path / "out")


def test_unknown_and_missing_keys_are_named(hf_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    state = load_file(str(hf_dir / "model.safetensors"))
    extra = copy_of(hf_dir, tmp_path / "extra")
    save_file({**state, "model.layers.0.self_attn.rotary.foo": torch.zeros(2)}, str(extra / "model.safetensors"))
    one_line_error(convert_from_hf, extra, tmp_path / "out", match=r"Unexpected weight 'model.layers.0.self_attn.rotary.foo'")

    missing = copy_of(hf_dir, tmp_path / "missing")
    save_file({k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}, str(missing / "model.safetensors"))
    one_line_error(convert_from_hf, missing, tmp_path / "out", match=r"lacks weight 'model.layers.1.mlp.up_proj.weight'")

    biased = copy_of(hf_dir, tmp_path / "biased")
    save_file({**state, "model.layers.0.self_attn.q_proj.bias": torch.zeros(32)}, str(biased / "model.safetensors"))
    one_line_error(convert_from_hf, biased, tmp_path / "out", match=r"'model.layers.0.self_attn.q_proj.bias' .* not part")

    ignored = copy_of(hf_dir, tmp_path / "ignored")  # non-weight buffers of old checkpoints are skipped
    save_file({**state, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}, str(ignored / "model.safetensors"))
    convert_from_hf(ignored, tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").is_file()


@pytest.mark.parametrize("keep", [4, 100, -100])
def test_truncated_safetensors(hf_dir, tmp_path, keep):
    bad = copy_of(hf_dir, tmp_path / "bad")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[:keep])
    one_line_error(convert_from_hf, bad, tmp_path / "out", match="damaged or incomplete")
    assert_nothing_written(tmp_path / "out")


def test_truncated_bin(hf_dir, tmp_path):
    from safetensors.torch import load_file

    bad = copy_of(hf_dir, tmp_path / "bad")
    (bad / "model.safetensors").unlink()
    torch.save(load_file(str(hf_dir / "model.safetensors")), bad / "pytorch_model.bin")
    data = (bad / "pytorch_model.bin").read_bytes()
    (bad / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    one_line_error(convert_from_hf, bad, tmp_path / "out", match="damaged or incomplete")
    assert_nothing_written(tmp_path / "out")


def test_missing_shard_named(hf_dir, tmp_path):
    bad = copy_of(hf_dir, tmp_path / "bad")
    (bad / "model.safetensors").rename(bad / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors",
                                            "model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    one_line_error(convert_from_hf, bad, tmp_path / "out", match="model-00002-of-00002.safetensors, which is missing")


def test_existing_output_refused_unless_overwrite(hf_dir, tmp_path):
    out = tmp_path / "out"
    convert_from_hf(hf_dir, out)
    before = (out / "model.safetensors").read_bytes()
    one_line_error(convert_from_hf, hf_dir, out, match="already exists and is not empty.*--overwrite")
    assert (out / "model.safetensors").read_bytes() == before
    convert_from_hf(hf_dir, out, overwrite=True, dtype="float16")
    assert json.loads((out / "model_config.json").read_text())["name"] == "tiny-llama"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary directories left
    one_line_error(convert_from_hf, hf_dir, hf_dir, overwrite=True, match="must differ")
    # An output folder that holds the input: replacing it would delete the input.
    parent = tmp_path / "parent"
    shutil.copytree(hf_dir, parent / "src")
    one_line_error(convert_from_hf, parent / "src", parent, overwrite=True, match="holds the input .*src: replacing it would delete")
    assert (parent / "src" / "config.json").is_file()
    ckpt = parent / "src-toolkit"
    convert_from_hf(parent / "src", ckpt)
    one_line_error(convert_to_hf, ckpt, parent, overwrite=True, match="holds the input")
    assert (ckpt / "model.safetensors").is_file() and (parent / "src" / "config.json").is_file()
    one_line_error(convert_from_hf, hf_dir, tmp_path / "x", dtype="float8", match="Unknown dtype 'float8'")


# ---------------------------------------------------------------------------- convert_to_hf
def test_export_errors(hf_dir, tmp_path):
    one_line_error(convert_to_hf, hf_dir, tmp_path / "out", match="is a Hugging Face model, not a toolkit checkpoint")
    ckpt = tmp_path / "ckpt"
    convert_from_hf(hf_dir, ckpt)
    one_line_error(convert_to_hf, ckpt, tmp_path / "out", max_shard_size="lots", match="Cannot read size 'lots'")

    config = json.loads((ckpt / "model_config.json").read_text())
    (ckpt / "model_config.json").write_text(json.dumps({**config, "n_embd": 64}))
    one_line_error(convert_to_hf, ckpt, tmp_path / "out", match="Shape mismatch for 'embed.weight'")
    (ckpt / "model_config.json").write_text(json.dumps(config))

    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[:-10])
    one_line_error(convert_to_hf, ckpt, tmp_path / "out", match="damaged or incomplete")
    assert_nothing_written(tmp_path / "out")
    (ckpt / "model.safetensors").write_bytes(data)

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    one_line_error(convert_to_hf, ckpt, tmp_path / "full", match="already exists")
    convert_to_hf(ckpt, tmp_path / "full", overwrite=True)
    assert (tmp_path / "full" / "model.safetensors").is_file()


def test_training_checkpoint_errors(tmp_path):
    one_line_error(convert_pretrained_checkpoint, tmp_path / "nope", tmp_path / "out", match="does not exist")
    (tmp_path / "run").mkdir()
    one_line_error(convert_pretrained_checkpoint, tmp_path / "run", tmp_path / "out", match="expected state.pt")
    Config.from_name("debug-neox").save(tmp_path / "run")
    torch.save({"optimizer": {}}, tmp_path / "run" / "state.pt")
    one_line_error(convert_pretrained_checkpoint, tmp_path / "run", tmp_path / "out", match="no 'model' state dict")
    torch.save({"model": {"embed.weight": torch.zeros(3, 3)}}, tmp_path / "run" / "state.pt")
    one_line_error(convert_pretrained_checkpoint, tmp_path / "run", tmp_path / "out", match="Shape mismatch for 'embed.weight'")
    assert_nothing_written(tmp_path / "out")


# ---------------------------------------------------------------------------- download
def test_select_files_prefers_safetensors():
    listing = [".gitattributes", "README.md", "config.json", "generation_config.json", "model-00001-of-00002.safetensors",
               "model-00002-of-00002.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "original/consolidated.00.pth",
               "training_args.bin", "tf_model.h5", "flax_model.msgpack", "tokenizer.model", "model.fp16.safetensors"]
    assert select_files(listing) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
        "config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
        "tokenizer.model",
    ]
    bin_only = ["config.json", "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin",
                "pytorch_model.bin.index.json", "training_args.bin", "tokenizer.json"]
    assert select_files(bin_only) == bin_only[1:4] + ["config.json", "tokenizer.json"]
    one_line_error(select_files, ["config.json", "tf_model.h5"], match="no Hugging Face weights")
    one_line_error(select_files, ["model.safetensors"], match="no config.json")


def _hand_built_cache(cache: Path, repo_id: str, files: Path) -> Path:
    """The Hugging Face cache layout: blobs + a snapshot of symlinks + refs/main."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(files.iterdir())):
        blob = repo / "blobs" / f"{i:040x}"
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_download_offline_from_local_cache(hf_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_TOKEN", "hf_secret_do_not_print")
    cache = tmp_path / "cache"
    _hand_built_cache(cache, "someone/tiny-llama", hf_dir)
    out = download("someone/tiny-llama", tmp_path / "ckpt", cache_dir=cache)
    config = json.loads((out / "model_config.json").read_text())
    assert (config["name"], config["hf_repo_id"]) == ("someone/tiny-llama", "someone/tiny-llama")
    assert (out / "tokenizer.json").is_file() == (hf_dir / "tokenizer.json").is_file()
    assert download("someone/tiny-llama", cache_dir=cache, convert=False).name == "0123456789abcdef0123456789abcdef01234567"

    message = one_line_error(download, "someone/absent", tmp_path / "x", cache_dir=cache, match="is not in .*HF_HUB_OFFLINE=1")
    assert "hf_secret" not in message
    assert_nothing_written(tmp_path / "x")
    one_line_error(download, "someone/tiny-llama", tmp_path / "ckpt", cache_dir=cache, match="already exists")


def test_cli_prints_one_line_and_fails(hf_dir, tmp_path):
    import os
    import subprocess
    import sys

    bad = copy_of(hf_dir, tmp_path / "bad")
    (bad / "model.safetensors").unlink()
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-m", "toolkit", "convert_from_hf", str(bad), str(tmp_path / "out")],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 1
    assert out.stderr.strip().count("\n") == 0 and "No weights in" in out.stderr
    assert_nothing_written(tmp_path / "out")


def _write_raw_safetensors(path: Path, header: dict, data: bytes) -> None:
    import struct

    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize("dtype, match", [("C64", "has dtype C64, which the toolkit does not support"),
                                          ("X9", "damaged or incomplete.*a dtype safetensors does not know: `X9`")])
def test_a_dtype_the_toolkit_cannot_read_is_named(hf_dir, tmp_path, dtype, match):
    from safetensors.torch import load_file

    bad = copy_of(hf_dir, tmp_path / "bad")
    state = load_file(str(hf_dir / "model.safetensors"))
    header, data, offset = {}, b"", 0
    for name, tensor in state.items():
        raw = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensor.shape), "data_offsets": [offset, offset + len(raw)]}
        data, offset = data + raw, offset + len(raw)
    header["model.norm.weight"]["dtype"] = dtype  # 32 float32 values read as 16 of 8 bytes: the same size
    header["model.norm.weight"]["shape"] = [16]
    _write_raw_safetensors(bad / "model.safetensors", header, data)
    one_line_error(convert_from_hf, bad, tmp_path / "out", match=match)
    assert_nothing_written(tmp_path / "out")


def test_an_index_naming_a_file_outside_the_folder_is_refused(hf_dir, tmp_path):
    bad = copy_of(hf_dir, tmp_path / "bad")
    shutil.copyfile(bad / "model.safetensors", tmp_path / "elsewhere.safetensors")
    (bad / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "../elsewhere.safetensors"}}
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    one_line_error(convert_from_hf, bad, tmp_path / "out", match=r"names '\.\./elsewhere\.safetensors', which is not a safetensors file in")
    assert_nothing_written(tmp_path / "out")
