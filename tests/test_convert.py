"""Hugging Face <-> toolkit conversion, proven against transformers with tiny random models.

Every family: a random transformers model (float32) is saved with `save_pretrained`, converted,
and must give the same logits in the toolkit model (<= 1e-4); converted back, every tensor must be
bit-identical to the original, and transformers must load the export and give the same logits.
Nothing is downloaded: the models are built from configs, the tokenizers come from tests/assets.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from conftest import ASSETS

from toolkit.convert import config_from_hf, config_to_hf, convert_from_hf, convert_pretrained_checkpoint, convert_to_hf
from toolkit.errors import UserError
from toolkit.model_dir import load_model, load_state_dict
from toolkit.models.config import Config
from toolkit.models.presets import PRESETS

REPO = Path(__file__).resolve().parents[1]
TOKENIZERS = ASSETS / "tokenizers"

SMALL = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
             max_position_embeddings=128, initializer_range=0.05)

LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}


def hf_model(kind: str, **overrides):
    """A random transformers model in eval mode, with non-trivial norms and biases."""
    T = transformers
    families = {
        # grouped-query attention + Llama-3.1 RoPE scaling
        "llama": (T.LlamaConfig, T.LlamaForCausalLM, dict(num_key_value_heads=2, rope_theta=500000.0,
                                                         rope_scaling=LLAMA31_ROPE)),
        "llama-tied": (T.LlamaConfig, T.LlamaForCausalLM, dict(num_key_value_heads=1, tie_word_embeddings=True)),
        "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(num_key_value_heads=2, sliding_window=None)),
        "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, dict(num_key_value_heads=2, tie_word_embeddings=True,
                                                          rope_theta=1000000.0)),
        "gemma": (T.GemmaConfig, T.GemmaForCausalLM, dict(num_key_value_heads=1, head_dim=32)),
        "phi": (T.PhiConfig, T.PhiForCausalLM, dict(partial_rotary_factor=0.5)),
        "gpt_neox": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM, dict(rotary_pct=0.25, use_parallel_residual=True)),
        "gpt_neox-sequential": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM, dict(rotary_pct=0.5, use_parallel_residual=False)),
    }
    config_cls, model_cls, extra = families[kind]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**SMALL, **extra, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)  # norms and biases away from their 1/0 init
    return model


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def logits_hf(model, ids):
    with torch.no_grad():
        return model(ids).logits


def logits_toolkit(model, ids):
    with torch.no_grad():
        return model(ids)


FAMILIES = ["llama", "llama-tied", "mistral", "qwen2", "gemma", "phi", "gpt_neox", "gpt_neox-sequential"]


@pytest.mark.parametrize("kind", FAMILIES)
def test_round_trip_matches_transformers(kind, tmp_path):
    model = hf_model(kind)
    hf_dir, toolkit_dir, export_dir = tmp_path / "hf", tmp_path / "toolkit", tmp_path / "export"
    model.save_pretrained(hf_dir)
    original = read_safetensors_dir(hf_dir)

    convert_from_hf(hf_dir, toolkit_dir)
    config = Config.from_file(toolkit_dir)
    assert config.family == kind.split("-")[0]
    ids = torch.randint(0, SMALL["vocab_size"], (2, 19), generator=torch.Generator().manual_seed(1))
    expected = logits_hf(model, ids)
    assert expected.abs().max() > 0.5  # not degenerate
    ours = logits_toolkit(load_model(toolkit_dir), ids)
    assert (ours - expected).abs().max().item() <= 1e-4

    # Small shards force the sharded layout (and a fused GPT-NeoX tensor split across no shard boundary).
    convert_to_hf(toolkit_dir, export_dir, max_shard_size="40KB")
    assert (export_dir / "model.safetensors.index.json").is_file()
    index = json.loads((export_dir / "model.safetensors.index.json").read_text())
    exported = read_safetensors_dir(export_dir)
    assert set(index["weight_map"]) == set(exported)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in exported.values())
    assert set(exported) == set(original)  # a tied head is not duplicated
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(export_dir).eval()
    assert type(reloaded) is type(model)
    assert (logits_hf(reloaded, ids) - expected).abs().max().item() <= 1e-4


def test_a_sharded_toolkit_checkpoint_reads_as_its_single_file(tmp_path):
    """convert_from_hf beyond --max_shard_size writes Hugging Face's sharded layout; every reader of a
    toolkit checkpoint (weights, rows, fingerprint, export to Hugging Face) sees the same weights."""
    from toolkit.errors import UserError
    from toolkit.model_dir import checkpoint_fingerprint, checkpoint_row_reader
    from toolkit.safetensors_io import weight_files

    model = hf_model("llama-tied")
    hf_dir, single, sharded = tmp_path / "hf", tmp_path / "single", tmp_path / "sharded"
    model.save_pretrained(hf_dir)
    convert_from_hf(hf_dir, single)
    convert_from_hf(hf_dir, sharded, max_shard_size="40KB")
    assert [f.name for f in weight_files(single)] == ["model.safetensors"]
    files = weight_files(sharded)
    assert len(files) >= 3 and files[0].name == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (sharded / "model.safetensors").exists()
    assert all(f.stat().st_size <= 40_000 + 1_000 for f in files if len(read_safetensors_dir_file(f)) > 1)

    expected = load_state_dict(single)
    loaded = load_state_dict(sharded)
    assert set(loaded) == set(expected) and "lm_head.weight" in loaded  # the tied head, restored
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    ids = torch.randint(0, SMALL["vocab_size"], (1, 11), generator=torch.Generator().manual_seed(2))
    assert (logits_toolkit(load_model(sharded), ids) - logits_hf(model, ids)).abs().max().item() <= 1e-4
    read_rows = checkpoint_row_reader(sharded)
    for name in ("embed.weight", "lm_head.weight", "blocks.1.mlp.down_proj.weight"):
        assert torch.equal(read_rows(name, 3, 9), expected[name][3:9]), name
        out = torch.empty_like(expected[name][2:7])
        assert torch.equal(read_rows(name, 2, 7, out=out), expected[name][2:7]), name

    # The fingerprint covers every shard: the same in a copy, another when one shard's bytes change.
    fingerprint = checkpoint_fingerprint(sharded)
    shutil.copytree(sharded, tmp_path / "copy")
    assert checkpoint_fingerprint(tmp_path / "copy") == fingerprint
    last = tmp_path / "copy" / files[-1].name
    data = bytearray(last.read_bytes())
    data[-5] ^= 0xFF
    last.write_bytes(bytes(data))
    assert checkpoint_fingerprint(tmp_path / "copy") != fingerprint

    convert_to_hf(single, tmp_path / "from_single")
    convert_to_hf(sharded, tmp_path / "from_sharded")
    assert (tmp_path / "from_sharded" / "model.safetensors").read_bytes() == \
        (tmp_path / "from_single" / "model.safetensors").read_bytes()

    # A shard missing, or an index naming a file outside the folder: one line, nothing read.
    files[1].unlink()
    with pytest.raises(UserError, match="missing: the checkpoint is incomplete"):
        load_state_dict(sharded)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    index["weight_map"]["embed.weight"] = "../single/model.safetensors"
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match="not a safetensors file in"):
        checkpoint_row_reader(sharded)


def test_checkpoint_files_written_from_memory_take_the_same_layout(tmp_path):
    """`save_checkpoint_files` (convert_pretrained_checkpoint, merge_lora): one model.safetensors equal
    to `save_file`, or shards and an index beyond the shard size, read back as the same weights."""
    from safetensors.torch import save_file

    from toolkit.model_dir import save_checkpoint_files
    from toolkit.safetensors_io import weight_files

    model = hf_model("llama")
    model.save_pretrained(tmp_path / "hf")
    convert_from_hf(tmp_path / "hf", tmp_path / "toolkit")
    state, config = load_state_dict(tmp_path / "toolkit"), Config.from_file(tmp_path / "toolkit")
    for name, limit in (("one", 10**9), ("sharded", 30_000)):
        (tmp_path / name).mkdir()
        save_checkpoint_files(tmp_path / name, state, config, max_shard_bytes=limit)
        loaded = load_state_dict(tmp_path / name)
        assert set(loaded) == set(state) and all(torch.equal(loaded[k], state[k]) for k in state)
    assert len(weight_files(tmp_path / "sharded")) >= 3
    save_file(state, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "one" / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def read_safetensors_dir_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def test_bin_shards_and_dtype(tmp_path):
    """pytorch_model-0000N-of-0000M.bin with its index (the pre-safetensors layout), converted to bfloat16."""
    model = hf_model("gpt_neox")
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)
    state = read_safetensors_dir(hf_dir)
    (hf_dir / "model.safetensors").unlink()
    names = sorted(state)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for i, part in enumerate(halves, start=1):
        file = f"pytorch_model-{i:05d}-of-00002.bin"
        torch.save({n: state[n] for n in part}, hf_dir / file)
        weight_map.update({n: file for n in part})
    (hf_dir / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    convert_from_hf(hf_dir, tmp_path / "toolkit", dtype="bfloat16")
    ours = load_state_dict(tmp_path / "toolkit")
    assert all(t.dtype == torch.bfloat16 for t in ours.values())
    convert_to_hf(tmp_path / "toolkit", tmp_path / "export")
    exported = read_safetensors_dir(tmp_path / "export")
    assert set(exported) == set(state)
    for name, tensor in state.items():
        assert torch.equal(exported[name], tensor.to(torch.bfloat16)), name
    assert json.loads((tmp_path / "export" / "config.json").read_text())["dtype"] == "bfloat16"


def test_dtype_conversion_in_row_chunks(tmp_path, monkeypatch):
    """A conversion to another dtype goes a slice of rows at a time; the slices must tile exactly."""
    from toolkit.convert import hf_to_toolkit

    monkeypatch.setattr(hf_to_toolkit, "_CHUNK_BYTES", 1000)  # a few rows per slice, odd boundaries
    model = hf_model("qwen2")
    model.save_pretrained(tmp_path / "hf")
    convert_from_hf(tmp_path / "hf", tmp_path / "toolkit", dtype="float16")
    ours = load_state_dict(tmp_path / "toolkit")
    theirs = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert len(theirs) == len(ours) - 1  # + the restored tied head
    convert_to_hf(tmp_path / "toolkit", tmp_path / "export")
    exported = read_safetensors_dir(tmp_path / "export")
    for name, tensor in theirs.items():
        assert exported[name].dtype == torch.float16 and torch.equal(exported[name], tensor.to(torch.float16)), name


def test_copy_without_copy_file_range(tmp_path, monkeypatch):
    """Where the kernel cannot copy between the files (other file system...), bytes go through a buffer."""
    def refuse(*args, **kwargs):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", refuse, raising=False)
    model = hf_model("llama")
    model.save_pretrained(tmp_path / "hf")
    convert_from_hf(tmp_path / "hf", tmp_path / "toolkit")
    convert_to_hf(tmp_path / "toolkit", tmp_path / "export")
    original, exported = read_safetensors_dir(tmp_path / "hf"), read_safetensors_dir(tmp_path / "export")
    assert set(original) == set(exported) and all(torch.equal(original[k], exported[k]) for k in original)


def test_lm_head_present_in_tied_checkpoint(tmp_path):
    """Some tied checkpoints store lm_head.weight anyway: it is accepted and stored once."""
    model = hf_model("llama-tied")
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)
    state = read_safetensors_dir(hf_dir)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    from safetensors.torch import save_file

    save_file(state, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    convert_from_hf(hf_dir, tmp_path / "toolkit")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "toolkit" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    ids = torch.arange(12)[None]
    ours = logits_toolkit(load_model(tmp_path / "toolkit"), ids)
    assert (ours - logits_hf(model, ids)).abs().max().item() <= 1e-4

    # A stored head that differs from the embeddings: transformers does not tie it (it warns), so
    # the conversion keeps it too, and the logits are transformers'.
    state["lm_head.weight"] = torch.randn_like(state["lm_head.weight"]) * 0.02
    save_file(state, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    convert_from_hf(hf_dir, tmp_path / "untied")
    untied = load_model(tmp_path / "untied")
    assert untied.config.tie_embeddings is False
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert not torch.equal(reference.lm_head.weight, reference.model.embed_tokens.weight)
    assert (logits_toolkit(untied, ids) - logits_hf(reference, ids)).abs().max().item() <= 1e-4
    convert_to_hf(tmp_path / "untied", tmp_path / "export")
    assert torch.equal(read_safetensors_dir(tmp_path / "export")["lm_head.weight"], state["lm_head.weight"])


# ---------------------------------------------------------------------------- configs
def test_weight_maps_invert_exactly():
    from toolkit.convert.weight_maps import (
        WEIGHT_MAPS, ExpertPart, expert_parts, hf_to_toolkit_name, toolkit_to_hf_name,
    )

    for family, table in WEIGHT_MAPS.items():
        for hf_template, target in table.items():
            hf_name = hf_template.replace("{l}", "17")
            if isinstance(target, ExpertPart):  # a part of an expert tensor: found among that tensor's parts
                part = hf_to_toolkit_name(family, hf_name.replace("{e}", "5"))
                assert part.target == target.target.replace("{l}", "17")
                assert part.expert == (5 if "{e}" in hf_template else None)
                assert (hf_name, dataclasses.replace(target, target=part.target)) in expert_parts(family, part.target)
                continue
            toolkit = hf_to_toolkit_name(family, hf_name)
            parts = toolkit if isinstance(toolkit, tuple) else (toolkit,)
            assert parts == tuple(t.replace("{l}", "17") for t in (target if isinstance(target, tuple) else (target,)))
            for index, name in enumerate(parts):
                assert toolkit_to_hf_name(family, name) == (hf_name, index, len(parts))


def test_every_preset_survives_config_round_trip():
    for preset in PRESETS:
        config = Config.from_name(preset["name"])
        back = config_from_hf(json.loads(json.dumps(config_to_hf(config))))
        assert back.to_dict() | {"name": "", "hf_repo_id": ""} == config.to_dict() | {"name": "", "hf_repo_id": ""}, preset["name"]
        assert back.name == preset["name"] or back.name in {p["name"] for p in PRESETS}


def test_published_configs_name_their_preset():
    # Llama-3.2-1B's config.json as published (transformers 4.x layout)
    llama32 = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 2048,
        "intermediate_size": 8192, "max_position_embeddings": 131072, "num_attention_heads": 32,
        "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "head_dim": 64,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "vocab_size": 128256, "attention_bias": False,
        "mlp_bias": False, "torch_dtype": "bfloat16",
    }
    config = config_from_hf(llama32)
    assert (config.name, config.hf_repo_id) == ("llama-3.2-1b", "meta-llama/Llama-3.2-1B")
    # the same in the transformers 5 layout
    v5 = {k: v for k, v in llama32.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = {**llama32["rope_scaling"], "rope_theta": 500000.0}
    assert config_from_hf(v5).name == "llama-3.2-1b"
    # Pythia-160m (GPT-NeoX, legacy rotary_pct / rotary_emb_base)
    pythia = {
        "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_act": "gelu", "hidden_size": 768,
        "intermediate_size": 3072, "layer_norm_eps": 1e-05, "max_position_embeddings": 2048,
        "num_attention_heads": 12, "num_hidden_layers": 12, "rotary_emb_base": 10000, "rotary_pct": 0.25,
        "tie_word_embeddings": False, "use_parallel_residual": True, "vocab_size": 50304,
    }
    assert config_from_hf(pythia).name == "pythia-160m"
    assert config_from_hf(pythia, model_name="my-pythia").name == "my-pythia"
    custom = config_from_hf({**pythia, "num_hidden_layers": 3}, default_name="mine")
    assert custom.name == "mine" and custom.n_layer == 3


# Published config.json files (transformers 4.x layout), each naming its preset when read.
_PUBLISHED_DENSE = {
    "mistral-7b": {  # mistralai/Mistral-7B-v0.1: a 4096-token window on every layer of a 32k context
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
        "sliding_window": 4096, "tie_word_embeddings": False, "vocab_size": 32000,
    },
    "qwen3-8b": {  # Qwen/Qwen3-8B
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960,
        "max_window_layers": 36, "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936,
    },
    "olmo-2-32b": {  # allenai/OLMo-2-0325-32B
        "architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "attention_bias": False, "hidden_act": "silu",
        "hidden_size": 5120, "intermediate_size": 27648, "max_position_embeddings": 4096, "num_attention_heads": 40,
        "num_hidden_layers": 64, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 500000, "tie_word_embeddings": False, "vocab_size": 100352,
    },
    "smollm3-3b": {  # HuggingFaceTB/SmolLM3-3B: 0 in no_rope_layers marks a layer without RoPE
        "architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "attention_bias": False, "mlp_bias": False,
        "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 11008, "max_position_embeddings": 65536,
        "num_attention_heads": 16, "num_hidden_layers": 36, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 5000000.0, "sliding_window": None, "use_sliding_window": False,
        "no_rope_layer_interval": 4, "no_rope_layers": [1, 1, 1, 0] * 9, "max_window_layers": 28,
        "layer_types": ["full_attention"] * 36, "tie_word_embeddings": True, "vocab_size": 128256,
    },
}


@pytest.mark.parametrize("name", _PUBLISHED_DENSE)
def test_published_dense_configs_name_their_preset(name):
    config = config_from_hf(_PUBLISHED_DENSE[name])
    assert config.name == name
    if name == "mistral-7b":  # the window is computed, the context is not cut to it
        assert (config.block_size, config.sliding_window, config.layer_types) == (32768, 4096, None)
    if name == "smollm3-3b":
        assert config.no_rope_layers == [3, 7, 11, 15, 19, 23, 27, 31, 35]
        # without the list, every no_rope_layer_interval-th layer is NoPE
        without = {k: v for k, v in _PUBLISHED_DENSE[name].items() if k != "no_rope_layers"}
        assert config_from_hf(without).name == name


def test_qwen_windows_start_at_max_window_layers():
    """transformers' Qwen2/Qwen3 with use_sliding_window window the layers from max_window_layers on."""
    qwen3 = {**_PUBLISHED_DENSE["qwen3-8b"], "num_hidden_layers": 4, "use_sliding_window": True,
             "sliding_window": 1024, "max_window_layers": 2}
    config = config_from_hf(qwen3)
    assert (config.sliding_window, config.layer_types) == (1024, ["global", "global", "local", "local"])
    every = config_from_hf({**qwen3, "max_window_layers": 0})
    assert (every.sliding_window, every.layer_types) == (1024, None)
    assert config_from_hf({**qwen3, "use_sliding_window": False}).sliding_window is None
    # the transformers 5 layout lists the layers itself
    listed = {**qwen3, "layer_types": ["sliding_attention", "full_attention"] * 2}
    assert config_from_hf(listed).layer_types == ["local", "global", "local", "global"]


@pytest.mark.parametrize(
    "family, changes, message",
    [
        ("qwen3-8b", dict(attention_bias=True), "Qwen3 with attention_bias is not supported"),
        ("qwen3-8b", dict(use_sliding_window=True, sliding_window=64, layer_types=["chunked_attention"] * 36),
         "layer_types entry 'chunked_attention' is not supported"),
        ("qwen3-8b", dict(layer_types=["sliding_attention"] * 36), "use_sliding_window is false"),
        ("olmo-2-32b", dict(attention_bias=True), "OLMo 2 with attention_bias is not supported"),
        ("olmo-2-32b", dict(hidden_act="gelu"), "Unsupported activation 'gelu' for a olmo2 model"),
        ("smollm3-3b", dict(no_rope_layers=[1, 2] * 18), "no_rope_layers must list 1 \\(RoPE\\) or 0"),
        ("smollm3-3b", dict(attention_bias=True), "attention_bias=True with mlp_bias=False"),
        ("mistral-7b", dict(layer_types=["full_attention", "sliding_attention"] * 16),
         "layer_types on a Mistral model is not supported"),
    ],
)
def test_dense_configs_the_toolkit_cannot_reproduce_are_refused(family, changes, message):
    with pytest.raises(UserError, match=message) as err:
        config_from_hf({**_PUBLISHED_DENSE[family], **changes})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "name, overrides, message",
    [
        ("mistral-7b", dict(layer_types=["local", "global"] * 16), "mistral windows every layer"),
        ("qwen3-0.6b", dict(no_rope_layers=[0]), "no_rope_layers=\\[0\\], but qwen3 rotates every layer"),
        ("olmo-2-1b", dict(sliding_window=8), "olmo2 has no sliding-window attention"),
        ("olmo-2-1b", dict(norm_position="pre"), "norm_position='pre', but olmo2 needs 'post'"),
        ("qwen3-0.6b", dict(qk_norm=None), "qk_norm=None, but qwen3 needs 'head'"),
        ("llama-3.2-1b", dict(qk_norm="head"), "qk_norm='head', but llama needs None"),
    ],
)
def test_export_refuses_what_the_family_cannot_express(name, overrides, message):
    with pytest.raises(UserError, match=message) as err:
        config_to_hf(Config.from_name(name, **overrides))
    assert "\n" not in str(err.value)


# Phi-3 configs as published (transformers 4.x layout; the first releases name their remote code in
# auto_map, which transformers' native Phi3 replaces).
_PHI3_COMMON = {
    "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_act": "silu", "attention_bias": False,
    "auto_map": {"AutoConfig": "configuration_phi3.Phi3Config",
                 "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"},
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1,
    "eos_token_id": 32000, "pad_token_id": 32000, "torch_dtype": "bfloat16",
}
_PHI3_MINI = {**_PHI3_COMMON, "hidden_size": 3072, "intermediate_size": 8192, "num_attention_heads": 32,
              "num_hidden_layers": 32, "num_key_value_heads": 32, "vocab_size": 32064,
              "original_max_position_embeddings": 4096}


def _published_phi3() -> dict[str, dict]:
    from toolkit.models import presets

    return {
        "phi-3-mini-4k-instruct": {**_PHI3_MINI, "max_position_embeddings": 4096, "rope_scaling": None,
                                   "sliding_window": 2047},
        "phi-3.5-mini-instruct": {**_PHI3_MINI, "max_position_embeddings": 131072, "sliding_window": 262144,
                                  "rope_scaling": {"type": "longrope", "long_factor": presets._PHI35_MINI_LONG,
                                                   "short_factor": presets._PHI35_MINI_SHORT}},
        "phi-4": {**_PHI3_COMMON, "auto_map": {}, "hidden_size": 5120, "intermediate_size": 17920,
                  "max_position_embeddings": 16384, "num_attention_heads": 40, "num_hidden_layers": 40,
                  "num_key_value_heads": 10, "original_max_position_embeddings": 16384, "rope_scaling": None,
                  "rope_theta": 250000, "sliding_window": None, "vocab_size": 100352, "pad_token_id": 100257},
        "phi-4-mini-instruct": {
            **_PHI3_COMMON, "hidden_size": 3072, "intermediate_size": 8192, "max_position_embeddings": 131072,
            "num_attention_heads": 24, "num_hidden_layers": 32, "num_key_value_heads": 8,
            "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75, "sliding_window": 262144,
            "tie_word_embeddings": True, "vocab_size": 200064, "lm_head_bias": False, "mlp_bias": False,
            "pad_token_id": 199999, "rope_scaling": {"type": "longrope", "long_factor": presets._PHI4_MINI_LONG,
                                                     "short_factor": [1.0] * 48}},
    }


@pytest.mark.parametrize("name", ["phi-3-mini-4k-instruct", "phi-3.5-mini-instruct", "phi-4", "phi-4-mini-instruct"])
def test_published_phi3_configs_name_their_preset_and_transformers_derives_the_same_rope(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from toolkit.models.rope import RotaryEmbedding

    published = _published_phi3()[name]
    config = config_from_hf(published)
    assert config.name == name
    hf = transformers.Phi3Config(**published)
    window = hf.sliding_window  # one at least as long as the context changes nothing
    assert config.sliding_window == (window if window and window < hf.max_position_embeddings else None)
    if hf.rope_parameters["rope_type"] == "longrope":  # the attention factor and both sets of frequencies, bit for bit
        short, attention_factor = ROPE_INIT_FUNCTIONS["longrope"](hf, None)
        long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, None, seq_len=hf.original_max_position_embeddings + 1)
        rope = RotaryEmbedding(config)
        assert config.rope_scaling["attention_factor"] == attention_factor > 1
        assert torch.equal(rope.inverse_frequencies("cpu"), short)
        assert torch.equal(rope.inverse_frequencies("cpu", long=True), long)
        assert rope.switch_length == hf.original_max_position_embeddings


_LLAMA_SMALL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                "intermediate_size": 96, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 96,
                "max_position_embeddings": 128}


@pytest.mark.parametrize("hf_config, message", [
    ({**_PHI3_MINI, "max_position_embeddings": 4096, "hidden_act": "gelu_new"}, "activation 'gelu_new' for a phi3"),
    ({**_PHI3_MINI, "max_position_embeddings": 4096,
      "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
     "'llama3' for a phi3 model"),
    ({**_PHI3_MINI, "max_position_embeddings": 131072, "rope_scaling": {"type": "su", "short_factor": [1.0] * 48}},
     "longrope RoPE scaling needs 'long_factor'"),
    ({**_PHI3_MINI, "max_position_embeddings": 131072,
      "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 47, "long_factor": [2.0] * 47}},
     "short_factor must be a list of 48 positive numbers"),
    ({**_LLAMA_SMALL, "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}},
     "LongRoPE is supported for Phi-3 models only"),
    ({**_LLAMA_SMALL, "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 32}}, "lacks 'factor'"),
    ({**_LLAMA_SMALL, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "Unsupported RoPE scaling 'dynamic'"),
])
def test_rope_scalings_and_phi3_configs_the_toolkit_cannot_reproduce_are_refused_in_one_line(hf_config, message):
    with pytest.raises(UserError, match=message) as err:
        config_from_hf(hf_config)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name, scaling, message", [
    ("debug", {"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16,
               "original_max_seq_len": 128, "attention_factor": 1.1}, "LongRoPE is supported for Phi-3 models only"),
    ("phi-3-mini-4k-instruct", {"rope_type": "yarn", "factor": 4.0, "original_max_seq_len": 1024, "beta_fast": 32.0,
                                "beta_slow": 1.0, "attention_factor": 1.1, "truncate": True},
     "reads a yarn type as longrope"),
])
def test_export_refuses_a_rope_scaling_the_family_does_not_read(name, scaling, message):
    with pytest.raises(UserError, match=message):
        config_to_hf(Config.from_name(name, rope_scaling=scaling))


def test_exported_config_loads_without_remote_code(tmp_path):
    for name in ("llama-3.1-8b", "qwen2.5-0.5b", "gemma-2b", "phi-2", "pythia-160m", "mistral-7b", "qwen3-8b",
                 "olmo-2-7b", "smollm3-3b", "phi-3-mini-4k-instruct", "phi-4-mini-instruct"):
        config = Config.from_name(name)
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config_to_hf(config)))
        hf = transformers.AutoConfig.from_pretrained(tmp_path / name)
        assert hf.num_hidden_layers == config.n_layer and hf.vocab_size == config.vocab_size
        assert hf.rope_parameters["rope_theta"] == config.rope_base
        if config.rope_scaling:
            key = "long_factor" if config.rope_scaling_type == "longrope" else "factor"
            assert hf.rope_parameters[key] == config.rope_scaling[key]
        if config.family in ("mistral", "qwen2", "qwen3", "smollm3"):
            assert hf.sliding_window == config.sliding_window
        if config.family == "smollm3":
            assert [i for i, rope in enumerate(hf.no_rope_layers) if not rope] == config.no_rope_layers


def test_a_model_without_a_pad_token_exports_one_transformers_loads(tmp_path):
    """No pad token in the checkpoint: the export says pad_token_id null. Left out, transformers
    took SmolLM3's class default (128004), outside this vocabulary: the export did not load."""
    from toolkit.convert import convert_from_hf, convert_to_hf

    config = transformers.SmolLM3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, pad_token_id=None,
                                        bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    transformers.SmolLM3ForCausalLM(config).save_pretrained(tmp_path / "hf")
    convert_from_hf(tmp_path / "hf", tmp_path / "toolkit")
    convert_to_hf(tmp_path / "toolkit", tmp_path / "export")
    assert json.loads((tmp_path / "export" / "config.json").read_text())["pad_token_id"] is None
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert exported.config.pad_token_id is None and exported.model.embed_tokens.padding_idx is None


# ---------------------------------------------------------------------------- tokenizers
@pytest.mark.parametrize("tokenizer", ["llama2", "gpt-neox-20b"])
def test_tokenizer_round_trip(tokenizer, tmp_path):
    from tokenizers import Tokenizer as RustTokenizer

    from toolkit.tokenizer import Tokenizer

    src = TOKENIZERS / tokenizer
    rust = RustTokenizer.from_file(str(src / "tokenizer.json"))
    kind = "llama" if tokenizer == "llama2" else "gpt_neox"
    model = hf_model(kind, vocab_size=rust.get_vocab_size())
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)
    for file in src.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens")):
            shutil.copyfile(file, hf_dir / file.name)
    convert_from_hf(hf_dir, tmp_path / "toolkit")
    convert_to_hf(tmp_path / "toolkit", tmp_path / "export")

    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    ours = Tokenizer(tmp_path / "toolkit")
    texts = ["Hello world!", "  two leading spaces\nand a newline\ttab", "ünïcödé 日本語 🤗 emoji",
             "<s> special </s> tokens <|endoftext|>", "", "x" * 300 + " numbers 1234567890"]
    for text in texts:
        hf_ids = auto(text)["input_ids"]
        assert hf_ids == rust.encode(text).ids, text
        assert hf_ids == ours.encode(text).tolist(), text
    generation = json.loads((tmp_path / "export" / "generation_config.json").read_text())
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"] == ours.eos_id
    assert auto.eos_token_id == ours.eos_id
    ids = torch.tensor([auto("Hello world")["input_ids"]])
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert torch.equal(logits_hf(reloaded, ids), logits_hf(model, ids))


# ---------------------------------------------------------------------------- memory
_CHILD = textwrap.dedent(
    """
    import gc, json, resource, sys
    from pathlib import Path
    import torch, safetensors, tokenizers  # noqa: F401  (imported before the baseline)
    from toolkit.convert import hf_to_toolkit, toolkit_to_hf  # noqa: F401
    from toolkit.models import gpt  # noqa: F401
    from toolkit.models.config import Config
    from toolkit.convert import convert_from_hf, convert_to_hf
    # the modules a model on the meta device loads (torch._dynamo...), loaded before the baseline:
    # what is measured is the tensors' memory, not one-time imports
    hf_to_toolkit.expected_shapes(Config(n_layer=1, n_embd=8, n_head=1, vocab_size=8))

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    direction, src, dst = sys.argv[1:4]
    gc.collect()
    try:
        # ru_maxrss also counts the peak of the process image that exec replaced (with vfork,
        # the parent's) and the import-time peak; reset the high-water mark to the RSS of now.
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base, peak = status("VmRSS"), lambda: status("VmHWM")
    except OSError:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if direction == "from_hf":
        convert_from_hf(Path(src), Path(dst))
    elif direction == "from_hf_bf16":  # every tensor is materialised and converted
        convert_from_hf(Path(src), Path(dst), dtype="bfloat16")
    else:
        convert_to_hf(Path(src), Path(dst), max_shard_size="16MB")
    print(json.dumps({"base": base, "peak": peak()}))
    """
)


def _peak_in_child(*args: str) -> int:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result["peak"] - result["base"]


def test_sharded_conversion_streams(tmp_path):
    """A ~70 MB sharded checkpoint converts, both ways, in a fraction of its size in extra memory."""
    model = hf_model("llama", vocab_size=16384, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                     intermediate_size=1408, num_key_value_heads=4)
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir, max_shard_size="20MB")
    shards = sorted(hf_dir.glob("model-*.safetensors"))
    assert len(shards) >= 3
    largest_shard = max(s.stat().st_size for s in shards)
    del model

    used = _peak_in_child("from_hf", str(hf_dir), str(tmp_path / "toolkit"))
    output = (tmp_path / "toolkit" / "model.safetensors").stat().st_size
    largest_tensor = 16384 * 512 * 4
    print(f"from_hf: +{used / 2**20:.1f} MiB (largest shard {largest_shard / 2**20:.1f} MiB, output {output / 2**20:.1f} MiB)")
    assert used < 1.5 * (largest_shard + output)
    assert used < 2 * largest_tensor + 48 * 2**20  # streaming: nothing near the whole model is held

    used = _peak_in_child("to_hf", str(tmp_path / "toolkit"), str(tmp_path / "export"))
    print(f"to_hf: +{used / 2**20:.1f} MiB")
    assert used < 2 * largest_tensor + 48 * 2**20

    used = _peak_in_child("from_hf_bf16", str(hf_dir), str(tmp_path / "bf16"))
    print(f"from_hf to bfloat16: +{used / 2**20:.1f} MiB")
    assert used < 2 * largest_tensor + 48 * 2**20
    original, exported = read_safetensors_dir(hf_dir), read_safetensors_dir(tmp_path / "export")
    assert len(list((tmp_path / "export").glob("model-*.safetensors"))) >= 4
    assert set(original) == set(exported)
    assert all(torch.equal(original[k], exported[k]) for k in original)


# ---------------------------------------------------------------------------- training checkpoints
def _toolkit_model(tmp_path: Path):
    from toolkit.models.gpt import GPT, init_weights

    config = Config.from_name("debug-neox", vocab_size=128, n_layer=1)
    torch.manual_seed(0)
    model = GPT(config)
    init_weights(model, config.n_layer)
    run = tmp_path / "run" / "step-100"
    run.mkdir(parents=True)
    config.save(run)
    shutil.copyfile(TOKENIZERS / "gpt-neox-20b" / "tokenizer.json", run / "tokenizer.json")
    return model, run


def test_convert_pretrained_checkpoint_from_state_pt(tmp_path):
    model, run = _toolkit_model(tmp_path)
    optimizer = torch.optim.AdamW(model.parameters())
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 100}, run / "state.pt")
    out = convert_pretrained_checkpoint(run, tmp_path / "final")
    assert (out / "tokenizer.json").is_file()
    loaded = load_state_dict(out)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_convert_pretrained_checkpoint_from_sharded_folder(tmp_path):
    import torch.distributed.checkpoint as dcp

    model, run = _toolkit_model(tmp_path)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.arange(8)[None]).sum().backward()
    optimizer.step()
    state = {"model": {f"_forward_module.{k}": v for k, v in model.state_dict().items()},
             "optimizer": optimizer.state_dict()}
    dcp.save(state, checkpoint_id=run / "state")
    out = convert_pretrained_checkpoint(run, tmp_path / "final")
    loaded = load_state_dict(out)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded[name], tensor), name
