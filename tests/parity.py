"""Checks every family's parity tests make against `transformers` (tests/test_families.py,
test_moe_families.py, test_gpt_oss.py): greedy generation through the toolkit's KV cache, packed rows,
and the round trip of a converted checkpoint. Each takes the tensors to compare and raises
AssertionError naming `label`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file

from toolkit.convert import config_from_hf, convert_to_hf
from toolkit.models.config import Config
from toolkit.sampling import generate_tokens


def safetensors_in(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors files, by name."""
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def assert_greedy_generation_equals(hf, ours, prompt: torch.Tensor, new_tokens: int, label: str = "") -> torch.Tensor:
    """`ours` through its KV cache picks the same `new_tokens` greedy tokens after `prompt` (1-D) as
    `hf.generate`; returns them with the prompt. The new tokens must vary (at least 8 distinct, the
    last 16 not one token repeated): a tiny random model that settles into one token early would
    leave most of the comparison to a fixed point that any cache bug reaches too."""
    with torch.no_grad():
        expected = hf.generate(prompt[None], max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                               pad_token_id=0)[0]
    got = generate_tokens(ours, prompt, max_new_tokens=new_tokens, temperature=0.0, top_k=None)
    assert got.numel() == prompt.numel() + new_tokens
    assert torch.equal(got, expected), label
    new = got[prompt.numel():]
    assert new.unique().numel() >= 8 and new[-16:].unique().numel() > 1, (
        f"{label}: the greedy tokens settle ({new.tolist()}); choose another prompt")
    return got


def assert_packed_row_equals_samples_alone(ours, first: torch.Tensor, second: torch.Tensor, label: str = "") -> None:
    """Two samples (1-D) packed in one row, told apart by document ids, get the logits each gets alone."""
    row = torch.cat([first, second])[None]
    documents = torch.cat([torch.zeros_like(first), torch.ones_like(second)])[None]
    with torch.no_grad():
        packed = ours(row, document_ids=documents)[0]
        alone = torch.cat([ours(first[None])[0], ours(second[None])[0]])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5, msg=label)


def assert_round_trip(hf, root: Path, ids: torch.Tensor, label: str = "", **load_kwargs) -> None:
    """root/toolkit (converted from root/hf, saved by `hf`) exports to root/export bit for bit as
    root/hf; `from_pretrained` loads the export as `hf`'s classes, with `hf`'s logits on `ids`; the
    exported config.json reads back as the same toolkit config."""
    export = root / "export"
    convert_to_hf(root / "toolkit", export)
    original, exported = safetensors_in(root / "hf"), safetensors_in(export)
    assert set(exported) == set(original)
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), (label, key)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(export, **load_kwargs).eval()
    assert type(reloaded) is type(hf) and type(reloaded.config) is type(hf.config)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf(ids).logits), label
    config = Config.from_file(root / "toolkit")
    assert config_from_hf(json.loads((export / "config.json").read_text())).replace(name=config.name) == config
