"""QLoRA on several processes and simulated nodes, on CPU: bitsandbytes (replicated base) and
torchao nf4 (base sharded by FSDP2; the tests named test_nf4_*, on a wider tiny Llama).

On more than one device the toolkit replicates the quantized base and synchronises only the LoRA
adapters (`toolkit.parallel.plan.plan_quantized_base` says why FSDP2 does not shard it).
These runs check the result numerically: the adapter of two processes, and of torchrun's 2 nodes x
2 processes, equals one process's at the same global batch, and a multi-process run killed in the
middle and resumed ends with the weights of the uninterrupted run. Real bitsandbytes, real peft,
real DDP on gloo; the base is the session's tiny Llama saved in bfloat16, as published models are.
"""

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import (REPO, kill_group_at_step, launch_env, run_in_process, run_toolkit, scale_weights_in_place,
                      torchrun_nodes)
from toolkit.memory import estimator as est
from toolkit.cli import run
from toolkit.errors import UserError
from toolkit.models.config import Config
from toolkit.args import DistributedArgs
from toolkit.parallel.plan import plan_quantized_base

STEPS = 6
# Each micro-batch is computed the same way in every run (the same quantized bytes, the same
# kernels); only the order in which the float32 adapter gradients are summed may differ (over ranks
# instead of over accumulation steps). Under 32-true that stays at float32 rounding. Under
# bf16-mixed the adapters compute in bfloat16, so a float32 master weight one bit apart can round to
# another bfloat16 value, and Adam carries that on: nf4 on 2 processes against 1, measured on a CPU
# with AMX-BF16, differed by 4.7e-10 after one step and by up to 2.3e-5 after six. A missing
# synchronisation or a wrong loss scale moves the adapters by about 1e-3.
TOLERANCE = {"32-true": 1e-6, "bf16-mixed": 1e-4}
# nf4 runs the default precision (bf16-mixed), int8 runs 32-true: both precisions, no extra runs.
PRECISION = {"bnb.nf4": "bf16-mixed", "bnb.int8": "32-true", "nf4": "bf16-mixed"}


def _args(base: Path, data: Path, out_dir: Path, mode: str, *extra: str) -> list[str]:
    return [
        "finetune_lora", str(base), "--out_dir", str(out_dir), "--quantize", mode, "--precision", PRECISION[mode],
        "--data", "Alpaca", "--data.json_path", str(data), "--data.val_split_fraction", "0.125",
        "--train.micro_batch_size", "2", "--train.global_batch_size", "8", "--train.max_seq_length", "64",
        "--train.max_steps", str(STEPS), "--train.warmup_steps", "1", "--train.save_interval", "2",
        "--train.learning_rate", "0.002", "--lora.dropout", "0.0", "--lora.targets", "[query, value, mlp]",
        "--eval.initial_validation", "false", "--eval.final_validation", "false", "--eval.interval", "100",
        "--log.interval", "1", "--log.loggers", "[csv]", "--resume", "auto", *extra,
    ]


def _adapter(out_dir: Path) -> dict:
    return load_file(str(out_dir / "final" / "lora_adapter.safetensors"))


def _assert_same_adapter(out_dir: Path, reference: dict, what: str, mode: str) -> None:
    tolerance = TOLERANCE[PRECISION[mode]]
    adapter = _adapter(out_dir)
    assert adapter.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(adapter[name], reference[name], atol=tolerance, rtol=0, msg=f"{what}: {name}")


@pytest.fixture(scope="module")
def wide_base(base, tmp_path_factory) -> Path:
    """A tiny random Llama wide enough for torchao's NF4 to shard over 4 ranks (every block weight in
    whole groups of 16384 values per rank: 256 x 256 and 512 x 256), saved in bfloat16 and converted."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.convert import convert_from_hf

    root = tmp_path_factory.mktemp("wide")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(root / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(base["hf_dir"] / name, root / "hf" / name)
    convert_from_hf(root / "hf", root / "checkpoint")
    return root / "checkpoint"


def _base_for(mode: str, bf16_base: Path, wide_base) -> Path:
    return wide_base if mode == "nf4" else bf16_base


@pytest.fixture(scope="module")
def single(bf16_base, sums, tmp_path_factory, request) -> dict:
    """One-process QLoRA runs, one per mode, made when first asked for (in this process): {mode: adapter}."""
    root, runs, logs = tmp_path_factory.mktemp("qlora-one"), {}, {}

    def get(mode: str) -> dict:
        if mode not in runs:
            checkpoint = request.getfixturevalue("wide_base") if mode == "nf4" else bf16_base
            log = run_in_process(_args(checkpoint, sums, root / mode, mode))
            assert "QLoRA scheme: single" in log
            logs[mode] = log
            runs[mode] = _adapter(root / mode)
            # The adapters did train (B starts at zero).
            assert max(v.abs().max().item() for k, v in runs[mode].items() if "lora_B" in k) > 1e-3
        return runs[mode]

    get.logs = logs  # type: ignore[attr-defined]  # {mode: the run's output}
    return get


# nf4 on two processes is also checked, killed and resumed, by the next test: uninterrupted it is slow only.
@pytest.mark.parametrize("mode", [pytest.param("bnb.nf4", marks=pytest.mark.slow), "bnb.int8"])
def test_two_processes_train_the_adapter_of_one_process(bf16_base, sums, single, tmp_path, mode):
    out = tmp_path / "two"
    log = run_toolkit(_args(bf16_base, sums, out, mode, "--devices", "2"))
    assert "QLoRA scheme: replicated; each of the 2 processes holds the whole " + mode in log
    assert "strategy: DDP over 2 processes" in log
    _assert_same_adapter(out, single(mode), "2 processes", mode)

    # The peft-format copy is written by rank 0 as on one device, and merge_lora merges the adapter
    # into the unquantized base: the merged weight is the base plus (alpha / r) B @ A.
    config = json.loads((out / "final" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and set(config["target_modules"]) >= {"q_proj", "v_proj", "down_proj"}
    assert load_file(str(out / "final" / "adapter_model.safetensors"))
    assert run(["merge_lora", str(out)]) == 0
    merged, base, adapter = load_file(str(out / "merged" / "model.safetensors")), load_file(str(bf16_base / "model.safetensors")), _adapter(out)
    name = "blocks.1.attn.q_proj"
    update = (config["lora_alpha"] / config["r"]) * adapter[f"{name}.lora_B.weight"] @ adapter[f"{name}.lora_A.weight"]
    expected = base[f"{name}.weight"].float() + update
    assert update.abs().max() > 1e-4  # the adapter is not a no-op
    torch.testing.assert_close(merged[f"{name}.weight"].float(), expected, atol=1e-2 * expected.abs().max().item(), rtol=0)


def test_two_processes_killed_in_mid_run_resume_to_the_uninterrupted_weights(bf16_base, sums, single, tmp_path):
    mode, out = "bnb.nf4", tmp_path / "killed"
    args = _args(bf16_base, sums, out, mode, "--devices", "2")
    k = random.Random(os.getpid()).randint(3, STEPS - 1)  # past the first checkpoint (step 2)
    kill_group_at_step([sys.executable, "-m", "toolkit", *args], k)
    assert not (out / "final").exists()
    log = run_toolkit(args)
    assert "Resumed from" in log
    # The uninterrupted run: one process, which two uninterrupted processes equal bit for bit (test
    # above). So this checks two things at once: two processes equal one, and resume is exact.
    _assert_same_adapter(out, single(mode), f"2 processes killed at step {k} and resumed", mode)


# About 50 s per mode on 2 busy cores (4 workers and 2 launchers): nf4 runs by default, int8 with -m slow
# (int8 on 2 processes runs by default above).
@pytest.mark.parametrize("mode", ["bnb.nf4", pytest.param("bnb.int8", marks=pytest.mark.slow)])
def test_two_nodes_of_two_processes_train_the_adapter_of_one_process(bf16_base, sums, single, tmp_path, mode):
    out = tmp_path / "nodes"
    outputs = torchrun_nodes(_args(bf16_base, sums, out, mode, "--num_nodes", "2", "--devices", "2"), nodes=2, per_node=2)
    assert "QLoRA scheme: replicated; each of the 4 processes" in outputs[0]
    _assert_same_adapter(out, single(mode), "2 nodes x 2 processes", mode)


def test_the_scheme_is_chosen_by_the_number_of_devices():
    one = plan_quantized_base(1, 1, DistributedArgs(), "bnb.nf4", accelerator="cpu")
    assert one.scheme == "single" and one.dist == DistributedArgs()
    many = plan_quantized_base(2, 2, DistributedArgs(sharding="FULL_SHARD", timeout=60), "bnb.int8", accelerator="cpu")
    assert many.scheme == "replicated" and many.dist.strategy == "ddp" and many.dist.timeout == 60
    assert "4 processes" in many.describe() and "bnb.int8" in many.describe() and "not sharded" in many.describe()
    with pytest.raises(UserError, match="strategy fsdp cannot shard"):
        plan_quantized_base(2, 1, DistributedArgs(strategy="fsdp"), "bnb.nf4", accelerator="cpu")


def test_forcing_fsdp_on_a_quantized_base_is_one_clear_line(bf16_base, sums, tmp_path, capsys):
    out = tmp_path / "fsdp"
    assert run(_args(bf16_base, sums, out, "bnb.nf4", "--devices", "2", "--distributed.strategy", "fsdp")) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot shard" in err[0] and "--distributed.strategy auto" in err[0], err
    assert not out.exists()


def _nf4_bytes(log: str) -> list[int]:
    line = next(line for line in log.splitlines() if line.startswith("NF4 base bytes per rank: "))
    return [int(b) for b in line.split(": ")[1].split(", ")]


# The same quantization on 1 and 2 processes (each rank quantizes its own rows with the whole weight's
# mean: bit-identical bytes), so the adapters match to TOLERANCE (bf16-mixed: see above).
def test_nf4_on_two_processes_is_sharded_and_trains_the_adapter_of_one_process(wide_base, sums, single, tmp_path):
    out = tmp_path / "two"
    log = run_toolkit(_args(wide_base, sums, out, "nf4", "--devices", "2"))
    assert "QLoRA scheme: sharded" in log and "strategy: FSDP2 FULL_SHARD over 2 processes" in log
    _assert_same_adapter(out, single("nf4"), "nf4 on 2 processes", "nf4")

    # The NF4 bytes each rank holds (codes, scales, factors, mean) are half of one process's; the
    # only overhead is the 2-byte mean of each of the 14 weights, held by every rank.
    (whole,), halves = _nf4_bytes(single.logs["nf4"]), _nf4_bytes(log)
    assert len(halves) == 2 and whole > 500_000
    for half in halves:
        assert whole / 2 <= half <= whole / 2 + 14 * 2, (whole, halves)
    # The estimator (`toolkit estimate --quantize nf4`) predicts these bytes exactly, per rank.
    config = Config.from_file(wide_base)
    opts = est.Options(config, "bf16-mixed", "lora", ("down_proj", "gate_proj", "q_proj", "up_proj", "v_proj"), 8,
                       "nf4", 64)  # fmt: skip
    specs = est.parameter_specs(config, opts.lora_modules, opts.lora_r)
    assert [est.fsdp_rank_memory(specs, est.make_column("single", 1, 1), opts)[0]["quantized_base"]] == [whole]
    assert [r["quantized_base"] for r in est.fsdp_rank_memory(specs, est.make_column("FULL_SHARD", 2, 1), opts)] == halves

    # Exports: the peft copy loads on the bf16 base in transformers and changes its output by
    # exactly the adapter; merge_lora merges into the bf16 base.
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    hf_dir = wide_base.parent / "hf"
    tokens = torch.tensor([[1, 319, 3462, 29871, 29941, 322]])
    plain = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    before = plain(tokens).logits
    peft_model = PeftModel.from_pretrained(plain, out / "final")
    after = peft_model(tokens).logits
    assert (after - before).abs().max() > 1e-4  # the adapter is loaded and acts
    merged_hf = peft_model.merge_and_unload()
    torch.testing.assert_close(merged_hf(tokens).logits, after, atol=1e-4, rtol=0)

    assert run(["merge_lora", str(out)]) == 0
    merged, base, adapter = load_file(str(out / "merged" / "model.safetensors")), load_file(str(wide_base / "model.safetensors")), _adapter(out)
    config = json.loads((out / "final" / "adapter_config.json").read_text())
    name = "blocks.1.mlp.down_proj"
    update = (config["lora_alpha"] / config["r"]) * adapter[f"{name}.lora_B.weight"] @ adapter[f"{name}.lora_A.weight"]
    expected = base[f"{name}.weight"].float() + update
    assert update.abs().max() > 1e-4
    torch.testing.assert_close(merged[f"{name}.weight"].float(), expected, atol=1e-2 * expected.abs().max().item(), rtol=0)


# The default format (sharded) runs by default; the one-file format (the adapters gathered on rank 0) with -m slow.
@pytest.mark.parametrize("resume_devices, state_dict_type", [("1", "sharded"), pytest.param("2", "full", marks=pytest.mark.slow)])
def test_nf4_killed_on_two_processes_resumes_to_the_uninterrupted_weights(wide_base, sums, tmp_path, resume_devices,
                                                                          state_dict_type):
    """Killed in mid-run on 2 processes, resumed on `resume_devices`: the checkpoint holds only the
    adapters and their optimizer state and reshards, and the adapter equals the uninterrupted run's
    bit for bit; a base with other weights is refused.

    With one micro-batch per process per step (global batch 4) in 32-true and without clipping, 2
    processes compute what 1 does bit for bit: the same micro-batches, and each step's gradient is
    the sum of the same 2 terms, scaled by powers of 2. So one uninterrupted process is the
    reference for every world size. (Clipping sums the squares of the gradient's shards in another
    order, and under bf16-mixed the final norm and head run in bfloat16 under FSDP but in float32
    on one device: either makes 2 processes differ from 1 by about 1e-8.)"""
    extra = ("--train.global_batch_size", "4", "--precision", "32-true", "--train.max_norm", "null",
             "--distributed.state_dict_type", state_dict_type)
    reference = tmp_path / "one"
    run_in_process(_args(wide_base, sums, reference, "nf4", *extra))
    out = tmp_path / "killed"
    k = random.Random(os.getpid()).randint(3, STEPS - 1)  # past the first checkpoint (step 2)
    kill_group_at_step([sys.executable, "-m", "toolkit", *_args(wide_base, sums, out, "nf4", "--devices", "2", *extra)], k)
    assert not (out / "final").exists()
    _assert_holds_only_the_adapters(out, wide_base, state_dict_type)

    # The same architecture with other weights (same header and size): refused by every rank, in one line.
    sibling = tmp_path / "sibling"
    shutil.copytree(wide_base, sibling)
    scale_weights_in_place(sibling / "model.safetensors", 1.05)
    before = _snapshot(out)
    result = subprocess.run([sys.executable, "-m", "toolkit", *_args(sibling, sums, out, "nf4", "--devices", "2", *extra)],
                            capture_output=True, text=True, env=launch_env(), timeout=600, cwd=REPO)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(lines) == 2 and lines[0] == lines[1], result.stderr[-3000:]  # every rank, the same line
    assert f"it was trained on the base checkpoint {wide_base.resolve()}" in lines[0], lines[0]
    assert f"pass {wide_base.resolve()} (or an exact copy) as checkpoint_dir" in lines[0], lines[0]
    assert "Traceback" not in result.stderr
    assert _snapshot(out) == before  # nothing written

    resume = _args(wide_base, sums, out, "nf4", "--devices", resume_devices, *extra)
    log = run_in_process(resume) if resume_devices == "1" else run_toolkit(resume)
    assert "Resumed from" in log
    expected, resumed = _adapter(reference), _adapter(out)
    assert resumed.keys() == expected.keys()
    for name in expected:
        assert torch.equal(resumed[name], expected[name]), f"2 processes killed at step {k}, resumed on {resume_devices}: {name}"


# Bytes a trainable-only checkpoint holds beyond 12 per adapter parameter (measured: about 350 per
# stored tensor in one file, about 2,070 per piece in torch's distributed checkpoint), with headroom.
ONE_FILE_OVERHEAD_PER_TENSOR, SHARDED_OVERHEAD_PER_PIECE = 1024, 3072


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


def _assert_holds_only_the_adapters(out: Path, base: Path, state_dict_type: str) -> None:
    """Size arithmetic on the real save of 2 FSDP processes: 12 bytes per adapter parameter (float32
    weight and AdamW's two moments) and a small overhead per saved tensor, nothing of the NF4 base.

    The one-file format adds names and zip records, about 350 bytes per stored tensor (21 KB over
    60 here: 20 adapter matrices and their 2 moments each). torch's distributed checkpoint (sharded)
    writes every rank's piece of every tensor as a `torch.save` of its own and lists it in
    `.metadata`: about 2 KiB per piece (289 KB over 140 pieces here: the 60 tensors on each of 2
    ranks, and the 20 optimizer step counts, saved once)."""
    checkpoint = sorted(p for p in (out / "checkpoints").iterdir() if not p.name.endswith(".tmp"))[-1]
    meta = json.loads((checkpoint / "meta.json").read_text())
    assert meta["sharded"] == (state_dict_type == "sharded")
    state = checkpoint / ("state" if meta["sharded"] else "state.pt")
    state_bytes = sum(p.stat().st_size for p in state.rglob("*")) if state.is_dir() else state.stat().st_size
    # r 8 on q, v (256 -> 256), gate and up (256 -> 512) and down (512 -> 256), 2 blocks: A and B each.
    adapters = 2 * (2 * (8 * 256 + 256 * 8) + 2 * (8 * 256 + 512 * 8) + (8 * 512 + 256 * 8))
    tensors = 2 * 5 * 2  # adapter matrices
    overhead = state_bytes - 12 * adapters
    if meta["sharded"]:  # a weight and two moments per matrix per rank, and the step counts (saved once)
        assert 0 <= overhead <= SHARDED_OVERHEAD_PER_PIECE * (tensors * 3 * 2 + tensors), (state_bytes, adapters)
    else:
        assert 0 <= overhead <= ONE_FILE_OVERHEAD_PER_TENSOR * tensors * 3, (state_bytes, adapters)
    assert state_bytes < (base / "model.safetensors").stat().st_size / 20  # the bf16 base, which is not there
    assert meta["frozen_base"]["checkpoint"] == str(base.resolve())


@pytest.mark.slow
def test_nf4_on_two_nodes_of_two_processes_trains_the_adapter_of_one_process(wide_base, sums, single, tmp_path):
    out = tmp_path / "nodes"
    outputs = torchrun_nodes(_args(wide_base, sums, out, "nf4", "--num_nodes", "2", "--devices", "2"), nodes=2, per_node=2)
    assert "QLoRA scheme: sharded" in outputs[0]
    _assert_same_adapter(out, single("nf4"), "nf4 on 2 nodes x 2 processes", "nf4")


def test_nf4_that_cannot_be_split_is_one_clear_line(bf16_base, sums, tmp_path, capsys):
    # The session's narrow model: k_proj is 32 x 64, less than one group of 16384 values.
    assert run(_args(bf16_base, sums, tmp_path / "narrow", "nf4", "--devices", "2")) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--quantize nf4 cannot split blocks.0.attn" in err[0], err


def _meta_model_and_random_checkpoint(config, checkpoint):
    """`GPT(config)` on the meta device, and random bf16 weights for it saved as a toolkit checkpoint
    in `checkpoint` (name -> tensor, also returned)."""
    from safetensors.torch import save_file

    from toolkit.models.gpt import GPT

    with torch.device("meta"):
        model = GPT(config)
    torch.manual_seed(0)
    weights = {name: torch.randn(p.shape).to(torch.bfloat16) for name, p in model.named_parameters()}
    config.save(checkpoint)
    save_file(weights, str(checkpoint / "model.safetensors"))
    return model, weights


def _one_at_a_time_reader(checkpoint, watched):
    """`read_rows` of `checkpoint` that fails if it is asked for a weight while the rows of an
    earlier one that `watched(name)` says to follow are still alive (it keeps weak references
    only), and the names read, in order."""
    import weakref

    from toolkit.model_dir import checkpoint_row_reader

    reader, handed_out, read = checkpoint_row_reader(checkpoint), [], []

    def read_rows(name, start=0, stop=None, out=None):
        held = [n for n, rows in handed_out if rows() is not None]
        assert not held, f"reading {name} while the bf16 rows of {held} are still held"
        rows = reader(name, start, stop, out=out)
        read.append(name)
        if watched(name):
            handed_out.append((name, weakref.ref(rows)))
        return rows

    return read_rows, read


def test_one_device_quantizes_nf4_weights_one_at_a_time(tmp_path):
    """Start-up on one device (one process, as finetune_lora runs it: `prepare` on the meta model,
    then `materialize`): each NF4 weight is read whole from the checkpoint, quantized and let go
    before the next one is read, so no process holds the bf16 base; the bytes are those of
    quantizing the loaded weight. The reader only watches (weak references to what it hands out).
    (Peak host memory on a model large enough to see it: benchmarks/qlora_startup_memory.py.)"""


    from toolkit.training.model_setup import materialize
    from toolkit.parallel.nf4 import is_nf4, nf4_quantize, quantize_blocks_nf4

    config = Config(name="nf4-tiny", vocab_size=512, block_size=64, n_layer=2, n_embd=128, n_head=2,
                    n_query_groups=2, intermediate_size=256)  # fmt: skip
    model, weights = _meta_model_and_random_checkpoint(config, tmp_path)
    quantize_blocks_nf4(model, torch.bfloat16, "cpu")
    nf4_names = {name for name, p in model.named_parameters() if is_nf4(p)}
    assert len(nf4_names) == 7 * config.n_layer

    read_rows, read = _one_at_a_time_reader(tmp_path, lambda name: name in nf4_names)
    materialize(model, read_rows)
    assert nf4_names <= set(read)
    params = dict(model.named_parameters())
    for name in nf4_names:
        expected = nf4_quantize(weights[name], torch.bfloat16)
        assert is_nf4(params[name]) and not params[name].is_meta
        for part in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean"):
            assert torch.equal(getattr(params[name], part), getattr(expected, part)), (name, part)
    torch.testing.assert_close(params["embed.weight"], weights["embed.weight"], atol=0, rtol=0)


@pytest.mark.parametrize("mode", ["bnb.nf4", "bnb.int8"])
def test_bitsandbytes_weights_are_read_and_quantized_one_at_a_time(tmp_path, mode):
    """`--quantize bnb.*` prepares the meta model as nf4 does: each block weight is read whole from
    the checkpoint, quantized and let go before the next one is read, so no process (one of them,
    or each of N, which all hold the whole quantized base) holds the bf16 base; the bytes are those
    of quantizing the loaded model. The reader only watches (weak references to what it hands out)."""


    from toolkit.finetune.lora import quantize_linears
    from toolkit.models.gpt import GPT

    config = Config(name="bnb-tiny", vocab_size=512, block_size=64, n_layer=2, n_embd=128, n_head=2,
                    n_query_groups=2, intermediate_size=256, attn_qkv_bias=True)  # fmt: skip
    model, weights = _meta_model_and_random_checkpoint(config, tmp_path)
    block_linears = {name for name in weights if name.startswith("blocks.") and "norm" not in name}
    # a bias is kept as it is, a weight is quantized: the weights are followed
    read_rows, read = _one_at_a_time_reader(tmp_path, lambda name: name.endswith(".weight"))
    quantize_linears(model, mode, "bf16-mixed", read_rows)
    assert sorted(read) == sorted(block_linears)  # weights and q/k/v biases, nothing else
    loaded = GPT(config)
    loaded.load_state_dict(weights)
    quantize_linears(loaded, mode, "bf16-mixed")
    expected = dict(loaded.named_parameters())
    for name, param in model.named_parameters():
        if name in block_linears:
            assert not param.is_meta and torch.equal(param.data, expected[name].data), name
            state = getattr(param, "quant_state", None)
            if state is not None:
                assert torch.equal(state.absmax, expected[name].quant_state.absmax), name
        else:
            assert param.is_meta, name  # the embedding, norms and head: `materialize` fills them later

