"""One home and one name per concept: module file names, parameter names under wrappers, tokenizer files."""

import json
from collections import Counter
from pathlib import Path

import torch

from toolkit.models.config import Config
from toolkit.models.gpt import GPT
from toolkit.models.param_names import unwrapped_name

PACKAGE = Path(__file__).resolve().parents[1] / "toolkit"


def test_no_two_modules_share_a_file_name():
    # `from toolkit... import checkpoint` must say which checkpoint it means.
    names = Counter(p.name for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")
    assert [name for name, count in names.items() if count > 1] == []


def test_unwrapped_name_undoes_every_wrapper():
    from lightning_fabric import Fabric
    from peft import LoraConfig, get_peft_model
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = GPT(Config.from_name("debug"))
    plain = [name for name, _ in model.named_parameters()]
    model.blocks[0] = checkpoint_wrapper(model.blocks[0])
    wrapped = torch.nn.DataParallel(torch.compile(model))  # "module." then "_orig_mod."
    wrapped = Fabric(accelerator="cpu", devices=1).setup_module(wrapped)  # "_forward_module."
    names = [name for name, _ in wrapped.named_parameters()]
    assert all(a != b for a, b in zip(names, plain))  # the wrappers did rename every parameter
    assert [unwrapped_name(n) for n in names] == plain

    peft_model = get_peft_model(GPT(Config.from_name("debug")), LoraConfig(r=2, target_modules=["q_proj"]))
    base = [unwrapped_name(n) for n, _ in peft_model.named_parameters() if "lora_" not in n]
    assert [n.replace(".base_layer.", ".") for n in base] == plain


def test_every_tokenizer_file_travels_with_a_checkpoint(tmp_path):
    """Conversion, model directories, training checkpoints and download copy one list of files."""
    from toolkit.convert.hf_to_toolkit import copy_tokenizer_files
    from toolkit.download import select_files
    from toolkit.model_dir import save_checkpoint_files
    from toolkit.tokenizer import TOKENIZER_FILES

    source = tmp_path / "source"
    source.mkdir()
    for name in TOKENIZER_FILES:
        (source / name).write_text(json.dumps({"file": name}))
    config = Config.from_name("debug")
    model_dir = tmp_path / "model_dir"
    model_dir.mkdir()
    save_checkpoint_files(model_dir, GPT(config).state_dict(), config, tokenizer_dir=source)
    converted = tmp_path / "converted"
    converted.mkdir()
    assert set(copy_tokenizer_files(source, converted)) == set(TOKENIZER_FILES)
    for name in TOKENIZER_FILES:  # tokenizer.model among them: `convert_to_hf` hands it on
        assert (model_dir / name).read_text() == (source / name).read_text()
    listing = ["config.json", "model.safetensors", *TOKENIZER_FILES, "README.md"]
    assert set(select_files(listing)) == {"config.json", "model.safetensors", *TOKENIZER_FILES}
