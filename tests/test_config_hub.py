"""Every YAML recipe under config_hub/ parses and instantiates against the entry point that runs it.

The folder decides the entry point: pretrain/*.yaml -> `toolkit pretrain`, finetune/<model>/full.yaml
-> `toolkit finetune_full`, finetune/<model>/{lora,qlora}.yaml -> `toolkit finetune_lora`. Parsing
goes through the CLI's own parser, so a misspelled key, a wrong type or an unknown data class_path
fails here. Then the cheap checks a run would do before it starts: the model exists, the batch
splits over the devices, the sequence fits the context, and the memory pre-flight (on the meta
device and fake tensors) accepts the step at the peak the recipe's header quotes. Nothing reads data
or weights (data modules only store their paths until a run sets them up).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from toolkit.cli import COMMANDS, _load, build_parser

CONFIG_HUB = Path(__file__).resolve().parents[1] / "config_hub"

FINETUNE_MODELS = (
    "tiny-llama-1.1b", "llama-2-7b", "llama-3-8b", "llama-3.1-8b", "llama-3.2-1b", "mistral-7b",
    "qwen2.5-0.5b", "qwen2.5-7b", "gemma-2b", "phi-2", "pythia-160m",
    "qwen3-8b", "olmo-2-7b", "gemma-3-12b", "phi-4", "smollm3-3b",
)
# Mixtures of experts: the recipes that fit each model's size (tutorials/moe.md).
MOE_RECIPES = {
    "qwen3-30b-a3b": ("full", "lora", "qlora"), "qwen3-235b-a22b": ("lora", "qlora"),
    "mixtral-8x7b": ("lora", "qlora"), "gpt-oss-20b": ("lora",), "gpt-oss-120b": ("lora",),
    "olmoe-1b-7b": ("full", "lora"),
}
EXPECTED = {
    *(f"finetune/{model}/{kind}.yaml" for model, kinds in MOE_RECIPES.items() for kind in kinds),
    "pretrain/debug.yaml",
    "pretrain/debug-moe.yaml",
    "pretrain/tinyllama.yaml",
    "pretrain/pythia-160m.yaml",
    *(f"finetune/{model}/{kind}.yaml" for model in FINETUNE_MODELS for kind in ("full", "lora", "qlora")),
    "finetune/qwen2.5-0.5b/chat_lora.yaml",
    "finetune/qwen2.5-0.5b/dpo_lora.yaml",
    "finetune/llama-3.1-70b/dpo_qlora.yaml",
}
# Placeholder positional arguments for a YAML that leaves them to the command line.
POSITIONAL = {"pretrain": ["model_name", "debug"], "finetune_full": ["checkpoint_dir", "checkpoints/x"],
              "finetune_lora": ["checkpoint_dir", "checkpoints/x"]}


def entry_point(relative: str) -> str:
    parts = Path(relative).parts
    if parts[0] == "pretrain" and len(parts) == 2:
        return "pretrain"
    if parts[0] == "finetune" and len(parts) == 3:
        return {"full.yaml": "finetune_full", "lora.yaml": "finetune_lora", "qlora.yaml": "finetune_lora",
                "chat_lora.yaml": "finetune_lora", "dpo_lora.yaml": "finetune_lora", "dpo_qlora.yaml": "finetune_lora"}[parts[2]]
    raise AssertionError(f"config_hub/{relative}: no entry point for this location; add it to entry_point()")


def all_yamls() -> list[str]:
    return sorted(str(p.relative_to(CONFIG_HUB)) for p in CONFIG_HUB.rglob("*.yaml"))


_PARSERS: dict[str, object] = {}


def parse(relative: str):
    """(entry point name, raw YAML dict, instantiated arguments) for one recipe."""
    name = entry_point(relative)
    if name not in _PARSERS:
        _PARSERS[name] = build_parser(name, _load(COMMANDS[name][0]))
    parser = _PARSERS[name]
    path = CONFIG_HUB / relative
    raw = yaml.safe_load(path.read_text())
    key, placeholder = POSITIONAL[name]
    argv = ["--config", str(path)] + ([] if key in raw else [placeholder])
    cfg = parser.parse_args(argv)
    return name, raw, parser.instantiate(cfg)


def recipe_model(name: str, relative: str, args: dict):
    """The model config a recipe trains: pretraining's preset and overrides, or the preset its
    fine-tuning folder is named after."""
    from toolkit.models.config import Config

    if name == "pretrain":
        return Config.from_name(args["model_name"], **(args["model_overrides"] or {}))
    return Config.from_name(Path(relative).parts[1])


def recipe_plan(args: dict, config):
    """The plan a run makes before it starts (devices, strategy, QLoRA scheme, batch split); recipes
    that name a precision are GPU recipes."""
    from toolkit.parallel.plan import plan_run

    train = args["train"]
    accelerator = "cuda" if args["precision"] else "cpu"
    return plan_run(args["devices"], args["num_nodes"], args["precision"], args["distributed"], train,
                    train.sequence_length(config), quantize=args.get("quantize"), accelerator=accelerator)


def test_the_expected_recipes_exist():
    missing = sorted(EXPECTED - set(all_yamls()))
    assert not missing, f"missing recipes: {missing}"


@pytest.mark.parametrize("relative", all_yamls())
def test_recipe_parses_and_is_consistent(relative):
    from toolkit.models.presets import find_preset

    name, raw, args = parse(relative)
    config = recipe_model(name, relative, args)
    if name == "pretrain":
        assert args["data"] is not None, "a pretraining recipe names its data"
        assert args["tokenizer_dir"] is not None or args["train_tokenizer_vocab"], "no tokenizer"
    else:
        model = Path(relative).parts[1]  # the folder is named after a preset
        assert find_preset(model)["name"] == model
        checkpoint = str(args["checkpoint_dir"])
        assert "checkpoint_dir" in raw, "fine-tuning recipes name the checkpoint `toolkit download` writes"
        assert checkpoint == f"checkpoints/{config.hf_repo_id}", checkpoint
        data = args["data"]
        preference = Path(relative).name.startswith("dpo_")
        if relative.endswith("chat_lora.yaml"):  # conversations in the model's chat template
            assert type(data).__name__ == "Chat" and str(data.json_path) == "data/chat/conversations.jsonl"
            assert data.prompt_style is None  # refused by Chat: the template lays conversations out
        elif preference:  # preference pairs under DPO, against the base with its adapters switched off
            assert type(data).__name__ == "Preference" and str(data.json_path) == "data/preference/pairs.jsonl"
            assert type(args["objective"]).__name__ == "DPO" and not args["objective"].precompute_reference
        else:
            assert type(data).__name__ == "Alpaca" and str(data.json_path) == "data/alpaca/alpaca_data_cleaned.json"
        qlora = relative.endswith("qlora.yaml")
        assert (args.get("quantize") is not None) == qlora
        if qlora:
            # One device with bitsandbytes; torchao's NF4 where FSDP2 shards the base (the 70B's DPO
            # recipe) or where the experts are most of it (bnb.* quantizes linear layers only).
            assert args["quantize"] == ("nf4" if preference or config.is_moe else "bnb.nf4")
            if args["quantize"].startswith("bnb."):
                assert args["devices"] * args["num_nodes"] == 1
            assert "head" not in args["lora"].targets  # refused with --quantize
        if name == "finetune_lora" and config.family == "gpt_neox":
            # Hugging Face fuses GPT-NeoX's query/key/value: adapters on them have no peft export,
            # and the run would fail when it writes the final adapter.
            assert not {"query", "key", "value"} & set(args["lora"].targets)

    train = args["train"]
    assert train.sequence_length(config) <= config.block_size
    assert recipe_plan(args, config).batches.global_batch_size == train.global_batch_size
    if name == "pretrain":
        assert train.max_steps or train.max_tokens or train.max_time, "a pretraining recipe needs a stopping rule"
    # The command in the header comment runs this very file.
    assert f"--config config_hub/{relative}" in (CONFIG_HUB / relative).read_text()


def test_the_moe_quick_start_model_exports_as_mixtral():
    """The debug-moe recipe's model is Mixtral's layout: its config goes to a transformers
    MixtralConfig and back unchanged (the weights' round trip is Mixtral's, tested in test_moe.py)."""
    from transformers import MixtralConfig

    from toolkit.convert.hf_config import config_from_hf, config_to_hf
    from toolkit.models.config import Config

    recipe = yaml.safe_load((CONFIG_HUB / "pretrain" / "debug-moe.yaml").read_text())
    config = Config.from_name(recipe["model_name"], **recipe["model_overrides"])
    hf = config_to_hf(config)
    assert hf["architectures"] == ["MixtralForCausalLM"]
    MixtralConfig(**hf)  # transformers accepts it
    back = config_from_hf(hf, default_name=config.name)
    # the z-loss coefficient is a training setting; every layer is a mixture, so no dense width is used
    assert back.replace(router_z_loss_coef=config.router_z_loss_coef, intermediate_size=config.intermediate_size) == config


def recipe_preflight(relative: str, device_bytes: int) -> str:
    """The line training's memory pre-flight prints for this recipe on a device of `device_bytes`
    (raises UserError when the step does not fit): the recipe's plan, adapters and objective."""
    from toolkit.memory import check_run_fits

    name, _, args = parse(relative)
    config = recipe_model(name, relative, args)
    finetune = {"pretrain": None, "finetune_full": "full", "finetune_lora": "lora"}[name]
    objective = args.get("objective")
    profile = objective.memory_profile(finetune == "lora") if objective is not None else {}
    return check_run_fits(device_bytes, config, recipe_plan(args, config), finetune, args.get("lora"), **profile)


PEAK = re.compile(r"puts the peak at ([0-9.]+) GiB")
GPU_SIZE = re.compile(r"([0-9]+) GB")


@pytest.mark.parametrize("relative", [r for r in all_yamls() if not Path(r).name.startswith("debug")])
def test_recipe_header_states_the_preflight_peak(relative):
    """The peak a recipe's header quotes is the one the start-up pre-flight prints for it (one
    decimal), and the step fits the GPU the header names (80 GB unless it names another size): a
    change to the estimate or to the recipe that moves the figure fails here until the header says
    so. The quick-start recipes (debug*) run on a CPU with a few MB and quote none."""
    header = "\n".join(line for line in (CONFIG_HUB / relative).read_text().splitlines() if line.startswith("#"))
    quoted = PEAK.findall(header)
    assert len(quoted) == 1, f"config_hub/{relative}: the header quotes the peak once ('puts the peak at N GiB')"
    sizes = {int(size) for size in GPU_SIZE.findall(header)}
    assert len(sizes) <= 1, f"config_hub/{relative} names GPUs of several sizes: {sorted(sizes)}"
    device_bytes = (sizes.pop() if sizes else 80) * 10**9
    line = recipe_preflight(relative, device_bytes)  # raises when the step does not fit
    figure = re.search(r"about ([0-9.]+) GiB", line).group(1)
    assert quoted[0] == figure, f"config_hub/{relative}: the header says {quoted[0]} GiB, the pre-flight {figure} GiB"


@pytest.mark.parametrize("relative", [
    "finetune/qwen3-30b-a3b/lora.yaml",  # expert parallelism, adapters on the experts
    "finetune/mixtral-8x7b/qlora.yaml",  # NF4 base, checkpointing
    "finetune/llama-3.1-70b/dpo_qlora.yaml",  # DPO, CPU offload, 24 GB GPUs
    "finetune/qwen2.5-0.5b/dpo_lora.yaml",  # a CPU recipe (no precision: bf16-mixed)
    "finetune/qwen3-235b-a22b/lora.yaml",  # HYBRID_SHARD over 8 nodes
    "pretrain/pythia-160m.yaml",
])
def test_toolkit_estimate_reads_a_recipe_and_prints_the_peak_its_header_quotes(relative, capsys):
    """`toolkit estimate --recipe FILE` estimates the recipe's step as its run plans it: the peak it
    prints is the one the header quotes (the pre-flight's, tested above)."""
    from toolkit.cli import run

    assert run(["estimate", "--recipe", str(CONFIG_HUB / relative)]) == 0
    # one column (the recipe's sharding) and one peak row (its checkpointing)
    (peak,) = re.findall(r"^peak(?:, checkpointed)? +([0-9.]+)$", capsys.readouterr().out, re.MULTILINE)
    quoted = PEAK.findall((CONFIG_HUB / relative).read_text())[0]
    assert f"{float(peak):.1f}" == quoted, (relative, peak, quoted)


def test_a_recipe_estimate_takes_the_options_after_it_and_refuses_what_is_not_a_recipe(tmp_path, capsys):
    from toolkit.cli import run

    recipe = str(CONFIG_HUB / "finetune" / "qwen3-30b-a3b" / "lora.yaml")
    assert run(["estimate", "--recipe", recipe, "--micro_batch_size", "4", "--memory_budget_gb", "60"]) == 0
    out = capsys.readouterr().out
    assert "micro batch 4 x 2048 tokens" in out and "--train.micro_batch_size 2" in out  # the advice that fits
    (tmp_path / "list.yaml").write_text("- a\n")
    for argv, fragment in ((["--recipe", str(tmp_path / "list.yaml")], "not a recipe"),
                           (["--recipe", str(tmp_path / "none.yaml")], "cannot read it"), (["--recipe"], "needs a file")):
        assert run(["estimate", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert fragment in err and "\n" not in err, err
