"""Shared test helpers: the real data files the tests read (tests/assets, see the README there)."""

import shutil
import sys
from pathlib import Path

import pytest
import torch

# Let `pytest` run from a plain checkout (the package need not be installed).
_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

# Everything a test reads lives in the repository: a clone passes its tests with nothing beside it.
ASSETS = Path(__file__).resolve().parent / "assets"


@pytest.fixture(scope="session")
def assets() -> Path:
    # A missing assets folder is a broken checkout, not a reason to skip: fail loudly.
    assert ASSETS.is_dir(), f"test assets not found at {ASSETS}"
    return ASSETS


@pytest.fixture(scope="session")
def base(tmp_path_factory) -> dict:
    """A random tiny Llama in Hugging Face format with the Llama-2 tokenizer, and its toolkit conversion."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.convert import convert_from_hf

    root = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    hf_config = LlamaConfig(
        vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
    )
    hf_dir = root / "hf"
    LlamaForCausalLM(hf_config).save_pretrained(hf_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(ASSETS / "tokenizers" / "llama2" / name, hf_dir / name)
    checkpoint = root / "base"
    convert_from_hf(hf_dir, checkpoint)
    return {"root": root, "hf_dir": hf_dir, "checkpoint": checkpoint}
