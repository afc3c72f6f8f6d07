"""Fine-tuning end to end on CPU: a tiny Llama converted from a random Hugging Face checkpoint, the
real Llama-2 tokenizer and real Alpaca records; real peft, bitsandbytes and transformers."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ASSETS, logged_val_losses, run_in_process
from toolkit.model_dir import load_model
from toolkit.cli import run

ALPACA = ASSETS / "instruct" / "alpaca_tiny.json"


def _args(command: str, checkpoint: Path, out_dir: Path, *extra: str) -> list[str]:
    return [
        command, str(checkpoint), "--out_dir", str(out_dir),
        "--data", "Alpaca", "--data.json_path", str(ALPACA), "--data.val_split_fraction", "0.1",
        "--precision", "32-true", "--train.micro_batch_size", "4", "--train.global_batch_size", "8",
        "--train.max_seq_length", "128", "--train.max_steps", "12", "--train.warmup_steps", "2",
        "--eval.interval", "12", "--eval.max_iters", "3", "--log.interval", "4", "--log.loggers", "[csv]",
        *extra,
    ]


def test_full_finetuning_lowers_validation_loss(base, tmp_path):
    out = tmp_path / "full"
    assert run(_args("finetune_full", base["checkpoint"], out, "--train.learning_rate", "0.003")) == 0
    first, last = logged_val_losses(out)[0], logged_val_losses(out)[-1]
    assert last < first - 0.5, (first, last)
    tuned = load_file(str(out / "final" / "model.safetensors"))
    original = load_file(str(base["checkpoint"] / "model.safetensors"))
    assert not torch.equal(tuned["blocks.0.mlp.down_proj.weight"], original["blocks.0.mlp.down_proj.weight"])


@pytest.fixture(scope="module")
def lora_run(base) -> dict:
    from toolkit.finetune.lora import finetune_lora
    from toolkit.cli import build_parser

    out = base["root"] / "lora"
    parser = build_parser("finetune_lora", finetune_lora)
    args = _args("finetune_lora", base["checkpoint"], out, "--train.learning_rate", "0.03",
                 "--lora.targets", "[query, value, mlp, head]", "--lora.r", "4", "--lora.alpha", "6.5")[1:]
    init = parser.instantiate(parser.parse_args(args))
    model = finetune_lora(**{k: v for k, v in init.items() if k != "config"})
    return {"out": out, "model": model}


def test_lora_lowers_validation_loss_and_leaves_the_base_bit_identical(base, lora_run):
    first, last = logged_val_losses(lora_run["out"])[0], logged_val_losses(lora_run["out"])[-1]
    assert last < first - 0.3, (first, last)

    original = load_file(str(base["checkpoint"] / "model.safetensors"))
    trained = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
               for k, v in lora_run["model"].state_dict().items() if "lora_" not in k}
    assert set(original) <= set(trained)
    for name, tensor in original.items():
        assert torch.equal(trained[name], tensor), name
    trainable = [n for n, p in lora_run["model"].named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # The adapter files are readable as any new file is (the safetensors library makes them 0600).
    from toolkit.safetensors_io import current_umask

    for name in ("lora_adapter.safetensors", "adapter_model.safetensors"):
        assert (lora_run["out"] / "final" / name).stat().st_mode & 0o777 == 0o666 & ~current_umask(), name


def _adapted_logits(base, lora_run, tokens):
    """Logits of the base model with the saved adapter applied through peft (not merged)."""
    from peft import get_peft_model, set_peft_model_state_dict

    from toolkit.finetune.lora import ADAPTER_FILE, LORA_META
    from toolkit.models.adapters import LoRAArgs

    final = lora_run["out"] / "final"
    meta = json.loads((final / LORA_META).read_text())
    lora = LoRAArgs(**{**meta["lora"], "targets": tuple(meta["lora"]["targets"])})
    model = get_peft_model(load_model(base["checkpoint"]), lora.peft_config()).eval()
    adapters = load_file(str(final / ADAPTER_FILE))
    result = set_peft_model_state_dict(model, {f"base_model.model.{k}": v for k, v in adapters.items()})
    assert not result.unexpected_keys
    with torch.no_grad():
        return model(tokens)


def test_merged_checkpoint_gives_the_logits_of_base_plus_adapter(base, lora_run, tmp_path, capsys):
    tokens = torch.randint(0, 32000, (2, 24), generator=torch.Generator().manual_seed(1))
    expected = _adapted_logits(base, lora_run, tokens)
    merged_dir = tmp_path / "merged"
    assert run(["merge_lora", str(lora_run["out"]), "--out_dir", str(merged_dir)]) == 0
    with torch.no_grad():
        merged = load_model(merged_dir)(tokens)
    torch.testing.assert_close(merged, expected, atol=1e-5, rtol=0)
    # The adapter is not a no-op: the base alone gives other logits.
    with torch.no_grad():
        assert (load_model(base["checkpoint"])(tokens) - expected).abs().max() > 1e-3

    # A base replaced at its path since training (same shapes, other weights) is refused, not merged into.
    from toolkit.finetune.lora import LORA_META
    from toolkit.safetensors_io import load_file, save_file

    replaced = tmp_path / "replaced-base"
    shutil.copytree(base["checkpoint"], replaced)
    weights = load_file(str(replaced / "model.safetensors"))
    save_file({k: v + 0.01 if v.is_floating_point() else v for k, v in weights.items()}, str(replaced / "model.safetensors"))
    moved = tmp_path / "run" / "final"
    shutil.copytree(lora_run["out"] / "final", moved)
    meta = json.loads((moved / LORA_META).read_text())
    assert meta["base_fingerprint"]
    (moved / LORA_META).write_text(json.dumps({**meta, "base_checkpoint": str(replaced)}))
    capsys.readouterr()
    assert run(["merge_lora", str(tmp_path / "run"), "--out_dir", str(tmp_path / "wrong")]) == 1
    assert "with other weights (fingerprint" in capsys.readouterr().err and not (tmp_path / "wrong").exists()
    # Exporting the adapter folder itself says to merge first.
    assert run(["convert_to_hf", str(lora_run["out"] / "final"), str(tmp_path / "export")]) != 0
    assert f"holds a LoRA adapter, not a whole model: merge it into its base first with `toolkit merge_lora {lora_run['out']}`" \
        in capsys.readouterr().err


def test_peft_format_adapter_reproduces_the_logits_in_transformers(base, lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(0, 32000, (2, 24), generator=torch.Generator().manual_seed(2))
    expected = _adapted_logits(base, lora_run, tokens)
    hf_base = AutoModelForCausalLM.from_pretrained(base["hf_dir"], torch_dtype=torch.float32)
    hf_lora = PeftModel.from_pretrained(hf_base, lora_run["out"] / "final").eval()
    with torch.no_grad():
        logits = hf_lora(tokens).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["bnb.nf4", "bnb.int8"])
def test_qlora_trains_on_cpu(base, tmp_path, mode):
    out = tmp_path / mode
    args = _args("finetune_lora", base["checkpoint"], out, "--quantize", mode, "--train.learning_rate", "0.01",
                 "--precision", "bf16-mixed", "--lora.targets", "[query, value, mlp]")
    assert run(args) == 0
    first, last = logged_val_losses(out)[0], logged_val_losses(out)[-1]
    assert last < first, (first, last)
    adapters = load_file(str(out / "final" / "lora_adapter.safetensors"))
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in adapters.items())  # B starts at zero


def _fails_with(args: list[str], capsys, *fragments: str) -> None:
    assert run(args) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    for fragment in fragments:
        assert fragment in err[0], err[0]


def test_bad_input_is_one_clear_line(base, tmp_path, capsys):
    hf_dir = base["hf_dir"]
    _fails_with(_args("finetune_lora", hf_dir, tmp_path / "a"), capsys, "convert_from_hf")
    _fails_with(_args("finetune_full", tmp_path, tmp_path / "b"), capsys, "not a toolkit checkpoint")
    broken = tmp_path / "broken.json"
    broken.write_text('[{"instruction": "a", "output": "b"}, {"instruction": "c", ')
    _fails_with(_args("finetune_lora", base["checkpoint"], tmp_path / "c") + ["--data.json_path", str(broken)], capsys, "broken.json")
    missing = tmp_path / "missing_field.json"
    missing.write_text('[{"instruction": "a", "output": "b"}, {"instruction": "c", "answer": "d"}]')
    _fails_with(_args("finetune_lora", base["checkpoint"], tmp_path / "d") + ["--data.json_path", str(missing)], capsys, "missing_field.json", "output")
    _fails_with(_args("finetune_full", base["checkpoint"], tmp_path / "e", "--quantize", "bnb.nf4"), capsys, "finetune_lora")
    _fails_with(_args("finetune_lora", base["checkpoint"], tmp_path / "f", "--lora.targets", "[querry]"), capsys, "querry", "query")
    assert not any((tmp_path / name).exists() for name in "abcdef")


def test_lora_under_two_fsdp_processes_saves_the_adapter_of_one_process(base, tmp_path):
    """Same global batch (8): one process accumulates 4 micro-batches, two processes 2 each.

    Each rank also reports what is still alive once the command returned: no process group (one
    left for the interpreter's finalization to destroy can abort the process after its work), and
    no module of the sharded model. The one process is this one: what the command left alive is
    what is tracked after it beyond what was alive before it. The two ranks, processes of their own,
    imported neither bitsandbytes nor torchao, which a run without --quantize does not use.
    """
    import gc
    import importlib.util
    import os
    import subprocess
    import sys

    script = Path(__file__).parent / "scripts" / "run_and_count_process_groups.py"
    spec = importlib.util.spec_from_file_location("run_and_count_process_groups", script)
    counting = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(counting)  # its `_alive`, the count each rank of the script reports

    def adapter(out_dir: Path, devices: str) -> dict:
        args = _args("finetune_lora", base["checkpoint"], out_dir, "--train.micro_batch_size", "2", "--train.max_steps", "3",
                     "--train.learning_rate", "0.002", "--lora.dropout", "0.0", "--lora.targets", "[query, value, mlp]",
                     "--eval.initial_validation", "false", "--devices", devices)
        if devices == "1":
            # What earlier tests left alive in this process is held until the count after the
            # command (none of it is freed meanwhile, no id reused); the count is of what is new.
            # As the script's, it includes uncollected cycles.
            gc.collect()
            before = counting._alive_objects()
            run_in_process(args)
            known = [{id(o) for o in objects} for objects in before]
            groups, modules = (sum(id(o) not in ids for o in objects) for objects, ids in zip(counting._alive_objects(), known))
            del before
            reports = [f"rank 0: {groups} process groups, {modules} modules alive"]
        else:
            env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
            result = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env,
                                    timeout=600)
            assert result.returncode == 0, result.stderr[-3000:]
            reports = sorted(line for line in result.stdout.splitlines() if line.startswith("rank "))
            assert [r.split(":")[0] for r in reports] == [f"rank {i}" for i in range(int(devices))], result.stdout[-2000:]
            assert all(r.endswith("quantization libraries imported: none") for r in reports), reports
        for report in reports:
            groups, modules = (int(word) for word in report.split(":")[1].split()[::3][:2])
            assert groups == 0, report
            assert modules < 20, report  # the model has 60; a few (loss, data) may remain
        return load_file(str(out_dir / "final" / "lora_adapter.safetensors"))

    single, sharded = adapter(tmp_path / "one", "1"), adapter(tmp_path / "two", "2")
    assert single.keys() == sharded.keys() and any("lora_B" in k for k in single)
    for name in single:
        torch.testing.assert_close(sharded[name], single[name], atol=1e-5, rtol=0, msg=name)
    # Validation reads the samples one process reads: --eval.max_iters 3 over 2 ranks is 3 batches
    # (not 2 per rank), so the logged validation losses agree.
    one, two = logged_val_losses(tmp_path / "one"), logged_val_losses(tmp_path / "two")
    assert len(one) == len(two) >= 1 and one == pytest.approx(two, rel=1e-5), (one, two)


def test_quantized_layers_keep_passing_gradients_after_an_evaluation_pass():
    """bitsandbytes' CPU inference kernel must not take over after validation (no_grad, eval)."""
    from toolkit.finetune.lora import quantize_linears
    from toolkit.models.config import Config
    from toolkit.models.gpt import GPT, init_weights

    torch.manual_seed(0)
    model = GPT(Config.from_name("debug", n_layer=1, vocab_size=512))
    init_weights(model, 1)
    quantize_linears(model, "bnb.nf4", "bf16-mixed")
    layer = model.blocks[0].mlp.down_proj
    x = torch.randn(2, 8, layer.in_features)

    def input_grad():
        x_ = x.clone().requires_grad_(True)
        layer(x_).float().sum().backward()
        return x_.grad

    before = input_grad()
    model.eval()
    with torch.no_grad():
        model(torch.randint(0, 512, (2, 8)))
    model.train()
    after = input_grad()
    assert before is not None and after is not None
    torch.testing.assert_close(after, before)


def test_adapters_on_fused_projections_have_no_peft_copy_but_are_saved(tmp_path):
    from toolkit.finetune.lora import write_peft_adapter
    from toolkit.models.adapters import LoRAArgs
    from toolkit.models.config import Config

    adapters = {"blocks.0.attn.q_proj.lora_A.weight": torch.zeros(4, 64), "blocks.0.attn.q_proj.lora_B.weight": torch.zeros(64, 4)}
    reason = write_peft_adapter(tmp_path, adapters, LoRAArgs(r=4), Config.from_name("debug-neox"))
    assert "fused" in reason and "merge_lora" in reason
    assert not any(tmp_path.iterdir())  # nothing half-written
    # Phi-3 and Phi-4 fuse query/key/value (qkv_proj) and gate/up (gate_up_proj), as config_hub/finetune/phi-4
    # says: every fused projection is named
    both = {**adapters, **{f"blocks.0.{m}.lora_A.weight": torch.zeros(4, 64)
                           for m in ("mlp.gate_proj", "attn.k_proj", "attn.o_proj", "mlp.up_proj")}}
    reason = write_peft_adapter(tmp_path, both, LoRAArgs(r=4), Config.from_name("phi-4"))
    assert "stores q_proj, gate_proj, k_proj, up_proj fused" in reason  # not o_proj: Hugging Face keeps it alone
    assert not any(tmp_path.iterdir())
    assert write_peft_adapter(tmp_path, adapters, LoRAArgs(r=4), Config.from_name("debug-llama2")) is None
    assert (tmp_path / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("targets", [("query", "head"), ("query",)])
def test_merging_a_head_adapter_into_tied_embeddings_leaves_the_embeddings_alone(tmp_path, targets):
    """With tied embeddings (Llama 3.2, Qwen2.5, Gemma) the head's update must not reach the input embeddings."""
    from peft import get_peft_model, set_peft_model_state_dict
    from safetensors.torch import save_file

    from toolkit.finetune.lora import ADAPTER_FILE, LORA_META, merge_lora
    from toolkit.models.adapters import LoRAArgs
    from toolkit.model_dir import save_checkpoint_files
    from toolkit.models.config import Config
    from toolkit.models.gpt import GPT, init_weights

    config = Config.from_name("debug", n_layer=1, vocab_size=128, tie_embeddings=True)
    torch.manual_seed(0)
    model = GPT(config)
    init_weights(model, config.n_layer)
    base_dir = tmp_path / "base"
    base_dir.mkdir()
    save_checkpoint_files(base_dir, model.state_dict(), config)
    # An adapter as finetune_lora writes it, with non-zero B so that every update is real.
    lora = LoRAArgs(r=2, alpha=4, dropout=0.0, targets=targets)
    peft_model = get_peft_model(load_model(base_dir), lora.peft_config())
    adapters = {k.replace("base_model.model.", "").replace(".default.", "."): torch.randn_like(v) * 0.1
                for k, v in peft_model.state_dict().items() if "lora_" in k}
    set_peft_model_state_dict(peft_model, {f"base_model.model.{k}": v for k, v in adapters.items()})
    adapter_dir = tmp_path / "run" / "final"
    adapter_dir.mkdir(parents=True)
    save_file(adapters, str(adapter_dir / ADAPTER_FILE))
    (adapter_dir / LORA_META).write_text(json.dumps({"base_checkpoint": str(base_dir), "lora": {**vars(lora), "targets": list(targets)}}))

    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = peft_model.eval()(tokens)
    merged_dir = merge_lora(tmp_path / "run")
    merged = load_model(merged_dir)
    torch.testing.assert_close(merged.embed.weight, model.embed.weight, atol=0, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens), expected, atol=1e-5, rtol=0)
    # The head stays tied when no adapter touched it.
    assert merged.config.tie_embeddings == ("head" not in targets)


def test_fine_tuning_counts_real_tokens_not_padding(tmp_path):
    """tokens_seen, tokens/s and MFU of fine-tuning count the samples' tokens, not the padding of their
    batches; where the fused head leaves out the rows without a label (here, on the CPU: the masked
    prompts), MFU counts the head's FLOPs for the labelled rows only."""
    import csv

    from lightning_fabric import Fabric
    from lightning_fabric.loggers import CSVLogger

    from toolkit.data.instruct import Alpaca
    from toolkit.models.config import Config
    from toolkit.models.gpt import GPT, init_weights
    from toolkit.tokenizer import Tokenizer
    from toolkit.args import EvalArgs, LogArgs, TrainArgs
    from toolkit.parallel.batches import plan_batches
    from toolkit.training.loop import LoopHooks, TrainState, fit

    data = Alpaca(json_path=ALPACA, val_split_fraction=0, group_by_length=False)  # unsorted: much padding
    data.setup(Tokenizer(ASSETS / "tokenizers" / "llama2"), 128, "debug")
    loader = data.train_dataloader(4, seed=0)
    steps, accumulation = 3, 2
    batches = loader.batch_indices(0)[: steps * accumulation]
    real = sum(int(data._train.lengths[b].sum()) for b in batches)
    padded = sum(int(data._train.lengths[b].max()) * len(b) for b in batches)
    assert padded > real

    labelled = sum(int((batch["labels"] != -100).sum()) for batch, _ in zip(data.train_dataloader(4, seed=0), batches))
    assert labelled < real

    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true", loggers=CSVLogger(tmp_path, name="log"))
    torch.manual_seed(0)
    model = GPT(Config.from_name("debug", n_layer=1, vocab_size=32000))
    init_weights(model, 1)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    train = TrainArgs(micro_batch_size=4, global_batch_size=8, max_steps=steps, warmup_steps=0)
    plan = plan_batches(1, 1, 4, 8, 128)
    assert plan.gradient_accumulation_iters == accumulation
    flops, head, peak = 1e6, 4e5, 1e12
    hooks = LoopHooks(flops_per_token=flops, head_flops_per_row=head, device_peak_flops=peak)
    state = fit(fabric, model, optimizer, loader, None, plan, TrainState(), train, EvalArgs(final_validation=False),
                LogArgs(interval=steps, loggers=()), hooks, total_steps=steps, tokens_per_step=None)
    assert state.step == steps
    assert state.tokens_seen == real
    fabric.logger.save()
    (row,) = [r for r in csv.DictReader(open(tmp_path / "log" / "version_0" / "metrics.csv")) if r.get("train/mfu")]
    expected = float(row["train/tokens_per_sec"]) * (flops - head * (real - labelled) / real) / peak
    assert float(row["train/mfu"]) == pytest.approx(expected, rel=1e-6)


def test_a_cpu_peak_measured_beside_other_work_rises_to_the_machine_rate_at_the_first_log_steps():
    from toolkit.training.throughput import CpuPeak

    peak = CpuPeak(torch.float32, size=256, seconds=0.02)
    peak.fastest *= 4  # as if start-up had shared the cores: a quarter of the rate
    low = peak.flops
    assert peak.refresh() > 2 * low  # 10 ms more of products: the fastest is the machine's again
    for _ in range(CpuPeak.REFRESHES - 1):
        peak.refresh()
    peak.fastest *= 4
    stale = peak.flops
    assert peak.refresh() == stale  # the refreshes are over: no more products are timed


def test_mfu_counts_head_rows_where_the_fused_head_leaves_out_unlabelled_ones():
    """Which rows an objective sends through the head, and whether the head is the fused one: with
    LoRA on the head (a peft layer) every row's logits are computed, so none are left out."""
    from peft import get_peft_model

    from toolkit.models.adapters import LoRAArgs
    from toolkit.models.config import Config
    from toolkit.models.gpt import GPT
    from toolkit.training.objectives import SFT
    from toolkit.training.preference_objectives import DPO, ORPO
    from toolkit.training.session import _fused_head

    config = Config.from_name("debug", n_layer=1, vocab_size=64)
    assert _fused_head(GPT(config))
    assert not _fused_head(get_peft_model(GPT(config), LoRAArgs(targets=("query", "head")).peft_config()))
    assert _fused_head(get_peft_model(GPT(config), LoRAArgs(targets=("query", "value")).peft_config()))
    # a pair: chosen row (prompt of 3, response of 2, padding of 1), rejected row (prompt 3, response 1, padding 2)
    ignore = -100
    labels = torch.tensor([[ignore, ignore, ignore, 5, 6, ignore], [ignore, ignore, ignore, 7, ignore, ignore]])
    batch = {"input_ids": torch.arange(12).view(2, 6), "labels": labels, "pair_ids": torch.tensor([0])}
    assert int(SFT().head_rows(batch)) == int(DPO().head_rows(batch)) == 3
    assert int(ORPO().head_rows(batch)) == 5 + 1  # the chosen row: every position up to its last target


@pytest.mark.parametrize("precision, dtype", [("16-mixed", "float16"), ("bf16-mixed", "bfloat16"),
                                              ("bf16-true", "bfloat16"), ("32-true", "float32")])
def test_quantized_layers_compute_in_the_dtype_of_the_precision(precision, dtype):
    """QLoRA's 4-bit layers follow the precision: float16 under 16-mixed (V100, T4), not emulated bfloat16."""
    import bitsandbytes as bnb

    from toolkit.finetune.lora import quantize_linears
    from toolkit.models.config import Config
    from toolkit.models.gpt import GPT, init_weights

    torch.manual_seed(0)
    model = GPT(Config.from_name("debug", n_layer=1, vocab_size=512))
    init_weights(model, 1)
    quantize_linears(model, "bnb.nf4", precision)
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and {m.compute_dtype for m in layers} == {getattr(torch, dtype)}


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory) -> Path:
    """A random tiny Gemma 3 (2 local layers with a 16-token window, 1 global; local and global RoPE
    bases, linear scaling on the global layer; Gemma 2's softcaps switched on so that the softcapped
    attention and the softcapped fused loss train too), the Llama-2 tokenizer, converted."""
    import shutil

    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from toolkit.convert import convert_from_hf

    root = tmp_path_factory.mktemp("gemma3")
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=16, sliding_window_pattern=3,
        query_pre_attn_scalar=24, attn_logit_softcapping=20.0, final_logit_softcapping=15.0, bos_token_id=1,
        eos_token_id=2, pad_token_id=0,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    )
    Gemma3ForCausalLM(config).save_pretrained(root / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(ASSETS / "tokenizers" / "llama2" / name, root / "hf" / name)
    convert_from_hf(root / "hf", root / "checkpoint")
    return root / "checkpoint"


@pytest.mark.parametrize("precision", ["32-true", None])
def test_gemma3_lora_under_two_fsdp_processes_equals_one_process(tiny_gemma3, tmp_path, precision):
    """Same global batch (8): one process accumulates 4 micro-batches of 2, two processes 2 each;
    sequences of up to 128 tokens, far past the window. The adapters after 3 steps agree within
    1e-5, in float32 and at the default precision (bf16-mixed on the CPU; measured: identical in
    both). Each lora_B has moved by about 5e-3 (3 Adam steps of 0.002 from zero)."""
    import os
    import subprocess
    import sys

    def adapter(devices: str) -> dict:
        out_dir = tmp_path / devices
        args = _args("finetune_lora", tiny_gemma3, out_dir, "--train.micro_batch_size", "2", "--train.max_steps", "3",
                     "--train.learning_rate", "0.002", "--lora.dropout", "0.0", "--lora.targets", "[query, value, mlp]",
                     "--eval.initial_validation", "false", "--devices", devices)
        if precision is None:  # the default: drop --precision 32-true
            at = args.index("--precision")
            del args[at : at + 2]
        if devices == "1":  # one process: this one
            output = run_in_process(args)
        else:
            env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
            result = subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True, env=env,
                                    timeout=600)
            assert result.returncode == 0, result.stderr[-3000:]
            output = result.stdout + result.stderr
            # the adapters are real beside the meta base when Fabric sets the model up: nothing is moved
            assert "parameters on different devices" not in output
        assert ("bf16-mixed" if precision is None else "32-true") in output
        return load_file(str(out_dir / "final" / "lora_adapter.safetensors"))

    single, sharded = adapter("1"), adapter("2")
    assert single.keys() == sharded.keys() and any("lora_B" in k for k in single)
    assert min(float(v.abs().max()) for k, v in single.items() if "lora_B" in k) > 1e-3  # every adapter trained
    for name in single:
        torch.testing.assert_close(sharded[name].float(), single[name].float(), atol=1e-5, rtol=0, msg=name)
