"""The precision policy on real (bfloat16) checkpoints: float32 master weights where training
happens, frozen weights in the compute dtype, the checkpoint's dtype on export, and LoRA on a bf16
base under FSDP2 (one process, two processes, and two simulated nodes under HYBRID_SHARD).

The bf16 checkpoint is what every published model looks like: a random `transformers` Llama saved
in bfloat16 and converted with the real converter.
"""

import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_in_process, run_toolkit, torchrun_nodes
from toolkit.cli import run


def _args(command: str, checkpoint: Path, out_dir: Path, data: Path, *extra: str) -> list[str]:
    return [
        command, str(checkpoint), "--out_dir", str(out_dir),
        "--data", "Alpaca", "--data.json_path", str(data), "--data.val_split_fraction", "0.125",
        "--train.micro_batch_size", "2", "--train.global_batch_size", "8", "--train.max_seq_length", "64",
        "--train.max_steps", "3", "--train.warmup_steps", "1", "--train.save_interval", "3",
        "--eval.initial_validation", "false", "--eval.interval", "100", "--eval.max_iters", "2",
        "--log.interval", "1", "--log.loggers", "[csv]", *extra,
    ]


# LoRA on a bf16 base under the default precision (bf16-mixed): every micro-batch is computed the
# same way in every run (autocast on the same stored weights); only the order in which float32
# gradients are summed may differ (across ranks instead of across accumulation steps). Measured on
# gloo with this model: the adapters are bit-identical. The tolerance allows for summation order on
# other backends; a missing synchronization or a wrong loss scale changes adapters by ~1e-3.
LORA_TOLERANCE = 1e-6


def test_lora_on_a_bf16_base_equals_one_process_on_two_processes_and_two_nodes(bf16_base, sums, tmp_path):
    def args(out: Path, *extra: str) -> list[str]:
        return _args("finetune_lora", bf16_base, out, sums, "--lora.dropout", "0.0", "--lora.targets", "[query, value, mlp]",
                     "--train.learning_rate", "0.002", *extra)

    log = run_in_process(args(tmp_path / "one"))
    assert "precision policy (bf16-mixed)" in log and "frozen in bfloat16" in log and "trainable in float32" in log
    single = load_file(str(tmp_path / "one" / "final" / "lora_adapter.safetensors"))
    assert single and all(t.dtype == torch.float32 for t in single.values())

    two_log = run_toolkit(args(tmp_path / "two", "--devices", "2"))  # FSDP2 FULL_SHARD, Fabric's own launcher
    # --eval.max_iters 2 counts micro-batches over all ranks: both runs validate the same 4 samples.
    val = [re.search(r"validation at step 3: loss (\S+)", text).group(1) for text in (log, two_log)]
    assert float(val[1]) == pytest.approx(float(val[0]), abs=2e-4), val
    outputs = torchrun_nodes(args(tmp_path / "nodes", "--num_nodes", "2", "--devices", "2"), nodes=2, per_node=2)
    assert "FSDP2 HYBRID_SHARD" in outputs[0] and "mesh (2 nodes replicate x 2 devices shard)" in outputs[0]
    for run_dir in ("two", "nodes"):
        adapter = load_file(str(tmp_path / run_dir / "final" / "lora_adapter.safetensors"))
        assert adapter.keys() == single.keys()
        for name in single:
            torch.testing.assert_close(adapter[name], single[name], atol=LORA_TOLERANCE, rtol=0, msg=f"{run_dir}: {name}")
    # The adapters did train (B starts at zero).
    assert max(single[k].abs().max().item() for k in single if "lora_B" in k) > 1e-3


@pytest.fixture(scope="module")
def full_one(bf16_base, sums, tmp_path_factory) -> Path:
    """Full fine-tuning of the bf16 checkpoint on one process at the default precision, 3 steps, in
    this process: its output folder (the step-3 checkpoint holds the float32 master weights)."""
    out = tmp_path_factory.mktemp("full-one") / "full"
    run_in_process(_args("finetune_full", bf16_base, out, sums, "--train.learning_rate", "0.001"))
    return out


def _master_weights(out: Path) -> dict:
    return torch.load(out / "checkpoints" / "step-00000003" / "state.pt", weights_only=True)


def test_full_finetuning_of_a_bf16_checkpoint_keeps_float32_master_weights_and_exports_bf16(bf16_base, sums, full_one,
                                                                                           tmp_path):
    out = full_one
    state = _master_weights(out)
    weights = state["model"]
    assert weights and all(t.dtype == torch.float32 for t in weights.values())
    moments = [v for s in state["optimizer"]["state"].values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    assert moments and all(t.dtype == torch.float32 for t in moments)
    exported = load_file(str(out / "final" / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in exported.values())
    # The export is the master weights rounded once, not weights that trained in bf16.
    name = "blocks.0.mlp.down_proj.weight"
    assert torch.equal(exported[name], weights[name].to(torch.bfloat16))

    out32 = tmp_path / "full-f32"
    assert run(_args("finetune_full", bf16_base, out32, sums, "--train.max_steps", "1", "--train.save_interval", "null",
                     "--export_dtype", "float32")) == 0
    assert all(t.dtype == torch.float32 for t in load_file(str(out32 / "final" / "model.safetensors")).values())


# Full fine-tuning under bf16-mixed on two processes: each block's float32 weights are cast to bf16
# before FSDP gathers them (no whole-model bf16 copy per rank), so the trainable norm weights enter
# the forward pass rounded to bf16, where one process multiplies by their float32 value. Measured
# here: per tensor, the mean difference from one process is about 0.2% of the mean update (3e-6 of
# 1.7e-3 after 3 AdamW steps); a rank that misses its peers' gradients differs by the update itself.
FULL_RELATIVE_TOLERANCE = 0.02


def test_full_finetuning_under_bf16_mixed_on_two_processes_follows_one_process(bf16_base, sums, full_one, tmp_path):
    # One process: the float32 master weights after step 3, which its float32 export would hold.
    single_weights = _master_weights(full_one)["model"]
    log = run_toolkit(_args("finetune_full", bf16_base, tmp_path / "two", sums, "--train.learning_rate", "0.001",
                            "--export_dtype", "float32", "--devices", "2"))
    finals = {"one": single_weights, "two": load_file(str(tmp_path / "two" / "final" / "model.safetensors"))}
    assert "block weights gathered in bfloat16, gradients reduced in float32" in log
    base = load_file(str(bf16_base / "model.safetensors"))
    assert finals["one"].keys() == finals["two"].keys() == base.keys()
    for name, single in finals["one"].items():
        update = (single - base[name].float()).abs().mean()
        difference = (finals["two"][name] - single).abs().mean()
        assert update > 0 and difference <= FULL_RELATIVE_TOLERANCE * update, (name, difference.item(), update.item())


@pytest.fixture(scope="module")
def qwen3_bf16_base(tmp_path_factory) -> Path:
    """A random tiny Qwen3 (per-head QK norm, tied head) saved by transformers in bfloat16 with the
    Llama-2 tokenizer, and its toolkit conversion."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from conftest import ASSETS
    from toolkit.convert import convert_from_hf

    root = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=None)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)  # QK norms away from their init
    model.to(torch.bfloat16).save_pretrained(root / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(ASSETS / "tokenizers" / "llama2" / name, root / "hf" / name)
    convert_from_hf(root / "hf", root / "checkpoint")
    return root / "checkpoint"


# A full fine-tune of Qwen3 on two FSDP processes against one, at the default precision (the
# tolerance of the Llama test above, for the same reason) and in float32, where only the order of
# summing float32 gradients differs (the distributed pretraining tests' 1e-5).
@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_full_finetuning_of_qwen3_on_two_processes_follows_one_process(qwen3_bf16_base, sums, tmp_path, precision):
    finals = {}
    for tag, extra, runner in (("one", (), run_in_process), ("two", ("--devices", "2"), run_toolkit)):
        runner(_args("finetune_full", qwen3_bf16_base, tmp_path / tag, sums, "--train.learning_rate", "0.001",
                     "--precision", precision, "--export_dtype", "float32", *extra))
        finals[tag] = load_file(str(tmp_path / tag / "final" / "model.safetensors"))
    base = load_file(str(qwen3_bf16_base / "model.safetensors"))
    assert "blocks.0.attn.q_norm.weight" in base
    for name, single in finals["one"].items():
        update = (single - base[name].float()).abs().mean()
        assert update > 0, name
        if precision == "32-true":
            torch.testing.assert_close(finals["two"][name], single, atol=1e-5, rtol=0, msg=name)
        else:
            difference = (finals["two"][name] - single).abs().mean()
            assert difference <= FULL_RELATIVE_TOLERANCE * update, (name, difference.item(), update.item())


def test_single_device_lora_holds_its_frozen_base_in_bf16(bf16_base, sums, tmp_path):
    from toolkit.cli import build_parser
    from toolkit.finetune.lora import finetune_lora

    parser = build_parser("finetune_lora", finetune_lora)
    init = parser.instantiate(parser.parse_args(_args("finetune_lora", bf16_base, tmp_path / "lora", sums, "--train.max_steps", "1")[1:]))
    model = finetune_lora(**{k: v for k, v in init.items() if k != "config"})
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    trainable = {p.dtype for p in model.parameters() if p.requires_grad}
    assert frozen == {torch.bfloat16} and trainable == {torch.float32}

    # Measured: the host memory the model's set-up takes, bf16-mixed against 32-true, on a model whose
    # weights (not Python and library overhead) dominate: 17M parameters, 67 MB in float32.
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.convert import convert_from_hf

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    hf_dir = tmp_path / "hf-wide"
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(hf_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(bf16_base / name, hf_dir / name)
    wide = tmp_path / "wide"
    convert_from_hf(hf_dir, wide)

    def setup_gib(precision: str) -> float:
        log = run_toolkit(_args("finetune_lora", wide, tmp_path / f"wide-{precision}", sums, "--train.max_steps", "1",
                             "--train.save_interval", "null", "--precision", precision))
        return float(re.search(r"set-up took ([\d.]+) GiB", log).group(1))

    bf16, fp32 = setup_gib("bf16-mixed"), setup_gib("32-true")
    assert fp32 > 0.05  # the float32 copy of the base really was measured
    assert bf16 < 0.7 * fp32, (bf16, fp32)
