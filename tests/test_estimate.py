"""`toolkit estimate` against memory that real tensors actually take.

- Parameters, gradients and optimizer state: models built on the meta device (every preset size,
  no memory used) under the real precision policy, peft's real LoRA injection, real bitsandbytes
  quantization on CPU, a real AdamW step, and real training steps through the toolkit's own set-up
  (tests/scripts/estimate_memory.py) on one device and on each rank of a 2-process FSDP2 run, whose
  parameter shards, gradients and AdamW state must equal the estimate byte for byte.
- Activations: a real forward pass on CPU under `torch.autograd.graph.saved_tensors_hooks`, which
  sees every tensor autograd keeps for the backward pass; the estimator's recording (the model's
  first blocks on fake tensors, `toolkit.memory.activations`, extrapolated to every block and
  micro-batch) must name the same bytes, for every architecture family, precision and LoRA set-up;
  and in the real training steps below, on one device and on each FSDP2 rank (blocks gathered in bf16).
- Peak: the same real training steps, whose peak of live tensor memory (the CPU allocator's own
  count, method in the script's docstring) must be within a few percent of the estimated total,
  for full fine-tuning and LoRA, bf16-mixed and 32-true, with and without activation checkpointing.

The measuring run (module fixture `runs`) starts before the first test and overlaps with the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from toolkit.errors import UserError
from toolkit.memory import GiB, check_fits, estimate
from toolkit.memory import estimator as est
from toolkit.models import LOSS_CHUNK_BYTES
from toolkit.models.config import Config
from toolkit.models.gpt import GPT, count_parameters
from toolkit.parallel.precision import PRECISIONS, apply_precision_policy, precision_dtypes

SCRIPTS = Path(__file__).parent / "scripts"
TIMEOUT = 300
PRESETS = ["pythia-14m", "tiny-llama-1.1b", "llama-3.2-1b", "gemma-2b", "phi-2", "qwen2.5-0.5b"]
FAMILIES = ["debug", "debug-neox", "debug-gemma", "debug-gemma2", "debug-gemma3", "debug-phi", "debug-llama2",
            "debug-qwen3", "debug-olmo2", "debug-smollm3"]
# The measured model: about 2M parameters, shaped like an LLM (8 blocks, a vocabulary 16x the width,
# a gated MLP 2.7x wide, grouped-query attention). Odd sizes on purpose: FSDP2 pads every dim-0
# shard to the first rank's size. 512 tokens per micro-batch put the peaks at 20-80 MiB, about half
# of it activations, logits and the loss's buffers.
MEASURED_CONFIG = dict(name="measured", vocab_size=2053, block_size=256, n_layer=8, n_embd=128, n_head=4,
                       n_query_groups=2, intermediate_size=345, attn_qkv_bias=True)  # fmt: skip
MEASURED_BATCH, MEASURED_SEQ, MEASURED_LORA_R = 2, 256, 3  # LoRA: finetune_lora's query and value, dropout 0.05
# Set-ups measured (precision:finetune[:checkpointing]): every FSDP one on both ranks; the single-device
# ones split between the two processes, which run them after the FSDP ones, so that both stay busy.
FSDP_SETUPS = ["bf16-mixed:full", "32-true:full", "bf16-mixed:lora", "32-true:lora", "bf16-mixed:full:checkpointing"]
SINGLE_SETUPS = [["bf16-mixed:full", "32-true:lora", "32-true:lora:checkpointing"], ["32-true:full", "bf16-mixed:lora"]]
PEAK_TOLERANCE = 0.04


def _quiet_estimate(*args, **kwargs) -> dict:
    with contextlib.redirect_stdout(open(os.devnull, "w")):
        return estimate(*args, **kwargs)


# ------------------------------------------------------------------------------------------
# Real training steps through the toolkit's set-up: one device, and two FSDP2 processes
# ------------------------------------------------------------------------------------------


def _clean_env() -> dict[str, str]:
    launcher = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE",
                "PL_GLOBAL_SEED")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    return env | {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _start_measuring(out: Path) -> list[subprocess.Popen]:
    """Both ranks of tests/scripts/estimate_memory.py, started by hand (LOCAL_RANK set, as a cluster
    launcher would) so that they import in parallel; Fabric only joins them into one process group."""
    env = _clean_env() | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "NODE_RANK": "0"}
    command = [sys.executable, str(SCRIPTS / "estimate_memory.py"), "--out", str(out), "--devices", "2",
               "--config", json.dumps(MEASURED_CONFIG), "--micro-batch", str(MEASURED_BATCH),
               "--seq", str(MEASURED_SEQ), "--lora-r", str(MEASURED_LORA_R),
               "--fsdp", ",".join(FSDP_SETUPS)]  # fmt: skip
    return [
        subprocess.Popen([*command, "--single", ",".join(SINGLE_SETUPS[rank])], env=env | {"LOCAL_RANK": str(rank)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        for rank in range(2)
    ]  # fmt: skip


def _wait(procs: list[subprocess.Popen], what: str) -> None:
    """Return once every process exited successfully."""
    try:
        for proc in procs:
            try:
                stdout, stderr = proc.communicate(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                _kill(procs)
                stdout, stderr = proc.communicate()
            assert proc.returncode == 0, f"{what}: exit code {proc.returncode}\n{stdout[-3000:]}\n{stderr[-5000:]}"
    finally:
        _kill(procs)


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Runs:
    """The measuring run, started when the module's first test asks for it; read once it is done."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.procs = _start_measuring(out)
        self._ranks: list[dict] | None = None

    def ranks(self) -> list[dict]:
        """Each process's figures: {"FULL_SHARD" or "single": {set-up: figures}}."""
        if self._ranks is None:
            _wait(self.procs, "estimate_memory.py")
            self._ranks = [json.loads((self.out / f"rank{r}.json").read_text()) for r in range(2)]
        return self._ranks

    def measured(self):
        """(column name, world size, rank, set-up, figures) for every measurement."""
        for rank, result in enumerate(self.ranks()):
            for column, setups in result.items():
                for setup, figures in setups.items():
                    yield column, (2 if column == "FULL_SHARD" else 1), rank, setup, figures

    def close(self) -> None:
        _kill(self.procs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    runs = _Runs(tmp_path_factory.mktemp("estimate_runs"))
    yield runs
    runs.close()


@pytest.fixture(scope="module", autouse=True)
def _start_runs_early(request):
    """Start the measuring run with the module's first test when a selected test reads it, so that
    it overlaps with the other tests (the tests that read it come last)."""
    if any("runs" in item.fixturenames for item in request.session.items if item.module is request.module):
        request.getfixturevalue("runs")


# ------------------------------------------------------------------------------------------
# Parameters, gradients and optimizer state
# ------------------------------------------------------------------------------------------


def _meta_model(name: str) -> GPT:
    with torch.device("meta"):
        return GPT(Config.from_name(name))


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("name", PRESETS + FAMILIES)
def test_parameter_specs_match_the_model(name):
    model = _meta_model(name)
    specs = est.parameter_specs(model.config)
    assert [(s.name, s.shape) for s in specs] == [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert sum(s.numel for s in specs) == count_parameters(model.config)  # a tied head counted once


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "32-true"])
def test_single_device_parameter_gradient_optimizer_bytes(name, precision):
    """On the meta device, in the dtypes of the real precision policy; AdamW's rule is checked below."""
    model = _meta_model(name)
    apply_precision_policy(model, precision)  # what Session.build_model does
    params = list(model.parameters())
    result = _quiet_estimate(name, precision=precision, max_seq_length=16)
    single = result["strategies"]["single"]
    assert result["columns"] == ["single"]
    assert single["parameters"] == _bytes(params)
    assert single["gradients"] == _bytes(params)  # a gradient has its parameter's dtype (see below)
    assert single["optimizer_state"] == 2 * _bytes(params)
    assert result["trainable_parameters"] == result["parameters"] == sum(p.numel() for p in params)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_dtypes_follow_the_precision_policy(precision):
    """Trainable (with gradients and AdamW state) and frozen bytes per element, as the toolkit sets them."""
    trainable, frozen = precision_dtypes(precision)
    opts = est.Options(Config.from_name("debug"), precision, None, (), 8, None, 8)
    assert (opts.trainable_bytes, opts.frozen_bytes) == (trainable.itemsize, frozen.itemsize)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adamw_keeps_two_states_like_each_parameter(dtype):
    """The rule the estimator uses, on a real model: one AdamW step, then count its state."""
    torch.manual_seed(0)
    config = Config.from_name("debug", n_layer=2)
    model = GPT(config).to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, config.vocab_size, (1, 8))
    model(ids, ids).backward()
    optimizer.step()
    params = list(model.parameters())
    assert all(p.grad.dtype == p.dtype and p.grad.shape == p.shape for p in params)
    states = [t for s in optimizer.state.values() for t in s.values()]
    big = [t for t in states if t.dim() > 0]
    steps = [t for t in states if t.dim() == 0]
    assert all(t.dtype == dtype for t in big)
    assert _bytes(big) == 2 * _bytes(params)
    assert len(steps) == len(params) and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in steps)
    precision = "32-true" if dtype == torch.float32 else "bf16-true"
    opts = est.Options(config, precision, None, (), 8, None, 8)
    assert est.column_memory(opts, est.make_column("single", 1, 1), 1)["optimizer_state"] == _bytes(big)


def _inject_lora(model, targets: tuple[str, ...], r: int, dropout: float = 0.0):
    from peft import LoraConfig, inject_adapter_in_model

    leaves = sorted({leaf for t in targets for leaf in est.LORA_TARGETS[t]})
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    config = LoraConfig(r=r, target_modules=[leaf for leaf in leaves if leaf in present], lora_dropout=dropout)
    model = inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


@pytest.mark.parametrize("name", ["pythia-14m", "tiny-llama-1.1b", "gemma-2b", "phi-2"])
@pytest.mark.parametrize("targets", [("query", "value"), ("query", "key", "value", "projection", "mlp", "head")])
def test_lora_parameters_match_peft(name, targets):
    """peft's real LoRA injection (on the meta device): the same tensors, in the same order."""
    model = _inject_lora(_meta_model(name), targets, r=8)
    leaves = tuple(sorted({leaf for t in targets for leaf in est.LORA_TARGETS[t]}))
    specs = est.parameter_specs(model.config, leaves, 8)
    assert [(s.name, s.shape, s.trainable) for s in specs] == [
        (n, tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()
    ]
    # One device, bf16-mixed: float32 adapters, the frozen base in bf16.
    apply_precision_policy(model, "bf16-mixed")
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {p.dtype for p in trainable} == {torch.float32}
    result = _quiet_estimate(name, finetune="lora", lora_targets=targets, max_seq_length=16)
    single = result["strategies"]["single"]
    assert result["trainable_parameters"] == sum(p.numel() for p in trainable)
    assert single["parameters"] == _bytes(model.parameters())
    assert single["gradients"] == _bytes(trainable)
    assert single["optimizer_state"] == 2 * _bytes(trainable)


@pytest.mark.parametrize("kind", [k for k in est.QUANTIZE_CHOICES if k.startswith("bnb.")])
@pytest.mark.parametrize("shape", [(300, 256), (64, 100), (1408, 513)])
def test_quantized_bytes_match_bitsandbytes(kind, shape):
    import bitsandbytes.functional as F

    weight = torch.randn(shape, dtype=torch.bfloat16)
    if kind == "bnb.int8":
        data, row_scale, _ = F.int8_vectorwise_quant(weight.float())
        tensors = [data, row_scale]
    else:
        dq = kind.endswith("-dq")
        data, state = F.quantize_4bit(weight, blocksize=64, quant_type=kind[4:7], compress_statistics=dq)
        tensors = [data, state.absmax, state.code]
        if state.nested:
            tensors += [state.state2.absmax, state.state2.code, state.offset]
    assert est.quantized_bytes(shape, kind) == _bytes(tensors)


@pytest.mark.parametrize("kind", ["bnb.nf4", "bnb.fp4-dq"])
def test_qlora_model_bytes_match(kind):
    """QLoRA built by `toolkit finetune_lora`'s own code (bitsandbytes on CPU, then peft): its bytes,
    and what autograd saves in a bf16-mixed forward pass (float32 frozen weights, as Fabric keeps them)."""
    from peft import get_peft_model

    from toolkit.finetune.lora import quantize_linears
    from toolkit.models.adapters import LoRAArgs

    torch.manual_seed(0)
    config = Config.from_name("debug-phi")
    lora = LoRAArgs(r=4, targets=("query", "value"))  # finetune_lora's defaults otherwise: dropout 0.05
    model = get_peft_model(quantize_linears(GPT(config), kind, "bf16-mixed"), lora.peft_config())
    apply_precision_policy(model, "bf16-mixed")  # as Session.build_model: the frozen rest in bf16
    measured = _saved_bytes(model, config, B=2, T=32, autocast=True)
    assert measured == _traced_bytes(config, "bf16-mixed", ("q_proj", "v_proj"), 4, kind, B=2, T=32,
                                     dropout=lora.dropout)  # fmt: skip
    # Counted after that forward pass (bitsandbytes may convert a 4-bit layer's bias in it).
    stored = 0
    for p in model.parameters():
        stored += p.numel() * p.element_size()
        state = getattr(p, "quant_state", None)
        if state is not None:
            stored += _bytes([state.absmax, state.code])
            if state.nested:
                stored += _bytes([state.state2.absmax, state.state2.code, state.offset])
    result = _quiet_estimate("debug-phi", finetune="lora", lora_r=4, quantize=kind, max_seq_length=32, micro_batch_size=2)
    assert result["strategies"]["single"]["parameters"] == stored


def test_qlora_on_many_devices_is_the_replicated_scheme_finetune_lora_runs():
    """finetune_lora replicates the quantized base and synchronises the adapters with DDP
    (`plan_quantized_base`): every device holds what one device holds, plus DDP's gradient buckets."""
    kwargs = dict(finetune="lora", quantize="bnb.nf4", max_seq_length=512)
    one = _quiet_estimate("llama-3.1-8b", **kwargs)
    many = _quiet_estimate("llama-3.1-8b", devices=2, num_nodes=2, **kwargs)
    assert many["columns"] == ["DDP"] and any("every device holds the whole quantized base" in n for n in many["notes"])
    single, ddp = one["strategies"]["single"], many["strategies"]["DDP"]
    for key in ("parameters", "gradients", "optimizer_state", "activations", "weight_copies", "logits_and_loss"):
        assert ddp[key] == single[key], key
    assert ddp["buffers"] == single["buffers"] + single["gradients"]  # DDP's bucket copy of the adapters' gradients
    assert 4.5 * GiB < ddp["parameters"] < 6 * GiB  # an 8B base in NF4: about 5 GB on each device
    assert _quiet_estimate("llama-3.1-8b", devices=8, strategy="ddp", **kwargs)["columns"] == ["DDP"]


# torchao NF4 (`--quantize nf4`): a Llama-shaped model whose every block weight is whole NF4 groups
# (16384 values) on 1 and on 2 shards.
NF4_CONFIG = dict(name="nf4-tiny", vocab_size=512, block_size=64, n_layer=2, n_embd=128, n_head=4, n_query_groups=2,
                  head_size=64, intermediate_size=256)  # fmt: skip


def _allocation_peak(fn) -> int:
    """The peak of bytes the CPU allocator hands out while `fn` runs, above what was live before it
    (torch.profiler's allocation records, in time order: +bytes per allocation, -bytes per free)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nf4_dequantization_scratch_matches_torchao(dtype):
    """`linear_nf4` dequantizes the whole weight in forward and backward: the estimator's scratch
    (two int64 code tensors and three of the compute dtype, per weight) against the allocator's peak
    of a real forward and backward pass (the few small tensors beside it: within 1%)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

    from toolkit.parallel.nf4 import nf4_quantize

    out_features, in_features = 1024, 2048
    weight = nf4_quantize(torch.randn(out_features, in_features, dtype=dtype), dtype)
    x = torch.randn(2, in_features, dtype=dtype, requires_grad=True)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            y = linear_nf4(x, weight)
        y.sum().backward()

    measured = _allocation_peak(step)
    expected = est.nf4_dequant_bytes(out_features * in_features, dtype.itemsize)
    assert expected <= measured <= 1.01 * expected, (measured, expected)


def test_nf4_qlora_model_bytes_and_saved_tensors_match():
    """QLoRA with torchao's NF4 built by finetune_lora's own code (`quantize_blocks_nf4`, then peft):
    its stored bytes (NF4 blocks, bf16 rest, float32 adapters) and what autograd saves in a
    bf16-mixed forward pass (LinearNF4 keeps only its weight) equal the estimate."""
    from peft import get_peft_model

    from toolkit.models.adapters import LoRAArgs
    from toolkit.parallel.nf4 import is_nf4, nf4_storage_bytes, quantize_blocks_nf4

    torch.manual_seed(0)
    config = Config(**NF4_CONFIG)
    lora = LoRAArgs(r=4, targets=("query", "value"))
    model = GPT(config)
    quantize_blocks_nf4(model, torch.bfloat16)
    model = get_peft_model(model, lora.peft_config())
    apply_precision_policy(model, "bf16-mixed")
    nf4 = [p for p in model.parameters() if is_nf4(p)]
    assert len(nf4) == 7 * config.n_layer
    stored = sum(nf4_storage_bytes(p) for p in nf4) + sum(p.numel() * p.element_size() for p in model.parameters()
                                                          if not is_nf4(p))  # fmt: skip
    overrides = {k: v for k, v in NF4_CONFIG.items() if k != "name"}
    result = _quiet_estimate("debug", model_overrides=overrides, finetune="lora", lora_r=4, quantize="nf4",
                             max_seq_length=32, micro_batch_size=2)  # fmt: skip
    assert result["strategies"]["single"]["parameters"] == stored
    measured = _saved_bytes(model, config, B=2, T=32, autocast=True)
    assert measured == _traced_bytes(config, "bf16-mixed", ("q_proj", "v_proj"), 4, "nf4", B=2, T=32,
                                     dropout=lora.dropout)  # fmt: skip


def test_nf4_on_many_devices_is_sharded():
    """finetune_lora shards an nf4 base with FSDP2: the NF4 bytes per device fall as 1/N, the
    gathered block is NF4 bytes, shapes that do not split are refused, DDP is refused."""
    kwargs = dict(finetune="lora", quantize="nf4", max_seq_length=2048, activation_checkpointing=True)
    one = _quiet_estimate("llama-3.1-70b", **kwargs)["strategies"]["single"]
    specs = est.parameter_specs(Config.from_name("llama-3.1-70b"), ("q_proj", "v_proj"), 8)
    opts = est.Options(Config.from_name("llama-3.1-70b"), "bf16-mixed", "lora", ("q_proj", "v_proj"), 8, "nf4", 2048)
    whole = est.fsdp_rank_memory(specs, est.make_column("single", 1, 1), opts)[0]["quantized_base"]
    assert 32 * GiB < whole < 34 * GiB  # 0.516 bytes per weight of the blocks
    for n in (2, 4, 8):
        result = _quiet_estimate("llama-3.1-70b", devices=n, **kwargs)
        assert result["columns"] == ["FULL_SHARD"]  # HYBRID_SHARD on one node is FULL_SHARD
        figures = result["strategies"]["FULL_SHARD"]
        ranks = est.fsdp_rank_memory(specs, est.make_column("FULL_SHARD", n, 1), opts)
        # each rank: its rows' NF4 bytes, plus the 2-byte mean of each of the 560 weights
        assert all(whole / n <= r["quantized_base"] <= whole / n + 2 * 560 for r in ranks)
        assert figures["parameters"] < one["parameters"] / n + 0.01 * GiB
        assert figures["optimizer_state"] * n == pytest.approx(one["optimizer_state"], rel=0.01)
    # A 70B block gathered in NF4 (0.4 GiB), not bf16 (1.6 GiB): the buffers beside the dequantized
    # weight (the 28672 x 8192 MLP weight, 14 bytes per weight) and the gathered head.
    two = _quiet_estimate("llama-3.1-70b", devices=2, **kwargs)["strategies"]["FULL_SHARD"]
    dequant = est.nf4_dequant_bytes(28672 * 8192, 2)
    assert one["buffers"] == dequant
    assert 2 * GiB < two["buffers"] - dequant < 4 * GiB
    with pytest.raises(UserError, match="nf4 shards the base with FSDP"):
        _quiet_estimate("llama-3.1-8b", devices=2, strategy="ddp", **kwargs)
    with pytest.raises(UserError, match=r"cannot split blocks\.0\.attn\.k_proj \(64 x 256\) over 2 shards"):
        _quiet_estimate("debug", devices=2, finetune="lora", quantize="nf4")
    with pytest.raises(UserError, match=r"cannot quantize blocks\.0\.attn\.k_proj \(32 x 256\): NF4 takes whole groups"):
        _quiet_estimate("debug", finetune="lora", quantize="nf4", model_overrides={"n_query_groups": 1, "head_size": 32, "n_head": 8})


def test_cpu_offload_moves_the_shards_to_the_host():
    kwargs = dict(finetune="lora", quantize="nf4", max_seq_length=2048, devices=2, sharding="FULL_SHARD")
    on_device = _quiet_estimate("llama-3.1-8b", **kwargs)["strategies"]["FULL_SHARD"]
    result = _quiet_estimate("llama-3.1-8b", cpu_offload=True, **kwargs)
    offloaded = result["strategies"]["FULL_SHARD"]
    persistent = ("parameters", "gradients", "optimizer_state")
    assert all(offloaded[k] == 0 for k in persistent)
    assert offloaded["host_offload"] == sum(on_device[k] for k in persistent)
    for key in ("total", "total_checkpointed"):  # the step's other memory stays on the device
        assert offloaded[key] == on_device[key] - sum(on_device[k] for k in persistent)
    assert any("CPU offload" in note for note in result["notes"])
    one = _quiet_estimate("llama-3.1-8b", **{**kwargs, "devices": 1, "sharding": None}, cpu_offload=True)
    assert one["strategies"]["single"]["host_offload"] == 0 and any("ignored" in n for n in one["notes"])


def test_70b_qlora_on_two_24gb_gpus():
    """The goal of QLoRA with a sharded base: Llama-3.1-70B, sequence 2048, micro batch 1, on two
    24 GB GPUs, below 22 GiB per GPU, with the settings the tutorial gives (activation
    checkpointing, CPU offload); the recommendation and the start-up pre-flight agree."""
    from toolkit.models.adapters import LoRAArgs

    kwargs = dict(finetune="lora", quantize="nf4", devices=2, max_seq_length=2048, micro_batch_size=1)
    result = _quiet_estimate("llama-3.1-70b", activation_checkpointing=True, cpu_offload=True,
                             memory_budget_gb=22, **kwargs)  # fmt: skip
    peak = result["strategies"]["FULL_SHARD"]["total_checkpointed"]
    assert peak < 22 * GiB
    rec = result["recommendation"]
    assert rec["fits"] and rec["strategy"] == "FULL_SHARD" and "--distributed.cpu_offload true" in rec["options"]
    config = Config.from_name("llama-3.1-70b")
    line = check_fits(24 * 10**9, config, 2, 1, 1, 2048, "bf16-mixed", "FULL_SHARD", True, finetune="lora",
                     lora=LoRAArgs(), quantize="nf4", cpu_offload=True)  # fmt: skip
    assert line.endswith("fits."), line
    # finetune_lora's adapters (r 8 on query and value, dropout 0.05) are the estimate's defaults.
    assert abs(float(re.search(r"about ([\d.]+) GiB", line).group(1)) * GiB - peak) <= 0.05 * GiB
    # Without offload each GPU stores its half of the base (18.4 GiB): the recommendation says what helps.
    rec = _quiet_estimate("llama-3.1-70b", memory_budget_gb=22, **kwargs)["recommendation"]
    assert not rec["fits"] and "--distributed.cpu_offload true" in rec["message"]


# ------------------------------------------------------------------------------------------
# Activations
# ------------------------------------------------------------------------------------------


def _saved_bytes(model, config: Config, B: int, T: int, autocast: bool) -> int:
    """Bytes of every distinct storage autograd saves in a forward pass with the loss, parameters excluded.

    The parameters' storages are taken after the forward pass: bitsandbytes replaces a bias's storage
    during it, and the old address may then hold a saved tensor.
    """
    seen: dict[int, int] = {}

    from toolkit.parallel.nf4 import is_nf4

    def pack(t):
        if is_nf4(t):  # torchao's LinearNF4 keeps its weight, a parameter
            return t
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (B, T), generator=gen)
    labels = torch.randint(0, config.vocab_size, (B, T), generator=gen)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        loss = model(ids, labels)
    assert loss.requires_grad
    params = {p.untyped_storage().data_ptr() for p in model.parameters() if not is_nf4(p)}
    return sum(nbytes for ptr, nbytes in seen.items() if ptr not in params)


def _traced_bytes(config, precision, lora, r, quantize, B, T, dropout=0.0) -> int:
    """The estimator's saved bytes (blocks + outside them + autocast weight copies), CPU rules, one
    device: recorded from the model's first blocks on fake tensors and extrapolated to every block."""
    opts = est.Options(config, precision, "lora" if lora else None, lora, r, quantize, T, device="cpu",
                       lora_dropout=dropout)  # fmt: skip
    specs = est.parameter_specs(config, lora, r)
    act = est.micro_batch_activations(opts, est.make_column("single", 1, 1), B, specs, est.quantized_names(opts, specs))
    return act.stored + act.head + act.weight_copies


# The weights as the precision policy stores them (the forward pass sees the same under FSDP2,
# which gathers without a cast):
#   32-true     float32 weights, no autocast
#   bf16-true   every weight in bf16
#   bf16-mixed  trainable weights in float32 (autocast copies them), frozen ones (LoRA base) in bf16
ALL_LINEARS = tuple(leaf for leaves in est.LORA_TARGETS.values() for leaf in leaves)
ACTIVATION_CASES = [
    (name, precision, lora, dropout)
    for name in FAMILIES
    for precision in ("32-true", "bf16-true", "bf16-mixed")
    for lora in ((), ("q_proj", "v_proj"), ALL_LINEARS)
    for dropout in ((0.0, 0.05) if lora == ("q_proj", "v_proj") else (0.0,))  # finetune_lora's default dropout
]


@pytest.mark.parametrize("name, precision, lora, dropout", ACTIVATION_CASES)
def test_activations_equal_what_autograd_saves(name, precision, lora, dropout):
    """Exact: the recording on fake tensors names every byte autograd keeps on real ones, and nothing else.

    CPU kernels differ from CUDA's in what dropout keeps (a scaled copy, not a one-byte mask), so
    the comparison uses the estimator's CPU rules (`device="cpu"`).
    """
    config = Config.from_name(name)
    with torch.device("meta"):
        present = {n.rsplit(".", 1)[-1] for n, _ in GPT(config).named_modules()}
    _assert_recorded_equals_saved(config, precision, tuple(sorted(leaf for leaf in lora if leaf in present)), dropout)


def _assert_recorded_equals_saved(config: Config, precision: str, lora: tuple, dropout: float) -> None:
    """What autograd saves in a real forward pass of `config` (with LoRA r=4 on `lora`, only the
    adapters training, as finetune_lora) equals the estimator's recording, at 2 x 32 tokens. `lora`
    names modules (`q_proj`) and parameters (`experts.gate_up_proj`)."""
    torch.manual_seed(0)
    model = GPT(config)
    if lora:
        from peft import inject_adapter_in_model

        from toolkit.models.expert_adapters import lora_config

        modules, parameters = [n for n in lora if "." not in n], [n for n in lora if "." in n]
        model = inject_adapter_in_model(lora_config(r=4, target_modules=modules, target_parameters=parameters or None,
                                                    lora_dropout=dropout), model)
        for n, p in model.named_parameters():
            p.requires_grad_("lora_" in n)
    apply_precision_policy(model, precision)
    measured = _saved_bytes(model, config, B=2, T=32, autocast=precision.endswith("mixed"))
    assert measured == _traced_bytes(config, precision, lora, 4, None, B=2, T=32, dropout=dropout), lora


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_activations_of_layers_of_different_kinds_equal_what_autograd_saves(precision):
    """Layers that differ (a sliding window on some, no rotation on one): the estimate records one
    block of each kind; every block's bytes must still add up to what autograd keeps."""
    config = Config.from_name("debug", n_layer=5, sliding_window=16, no_rope_layers=[3],
                              layer_types=["local", "global", "local", "global", "global"])  # fmt: skip
    for lora, dropout in (((), 0.0), (("q_proj", "v_proj"), 0.05)):
        _assert_recorded_equals_saved(config, precision, lora, dropout)


def test_activations_scale_with_the_micro_batch():
    config = Config.from_name("tiny-llama-1.1b")
    opts = est.Options(config, "bf16-mixed", None, (), 8, None, 2048)
    column = est.make_column("FULL_SHARD", 8, 1)
    one, four = (est.column_memory(opts, column, b) for b in (1, 4))
    for key in ("parameters", "gradients", "optimizer_state", "buffers", "weight_copies"):
        assert one[key] == four[key]
    assert four["activations"] == pytest.approx(4 * one["activations"], rel=0.01)  # cos/sin tables depend on T only
    # logits and loss: the fused loss keeps grad_h (tokens x E, bf16) and the head weight's float32
    # gradient (V x E, whatever the batch), and computes the logits in chunks of at most
    # LOSS_CHUNK_BYTES of float32: never the (tokens x vocab) float32 logits.
    V, E = config.vocab_size, config.n_embd
    grad_w = 4 * V * E
    for b, fig in ((1, one), (4, four)):
        tokens = b * 2048
        assert fig["logits_and_loss"] - grad_w >= 2 * tokens * E  # grad_h
        assert fig["logits_and_loss"] < grad_w + 2 * tokens * E + 3 * LOSS_CHUNK_BYTES + 3 * grad_w
    # Checkpointing keeps each block's input: (tokens x E) float32 under bf16-mixed, where the
    # embedding (a trainable float32 weight, gathered as it is stored) starts a float32 residual stream.
    assert one["activations_checkpointed"] < one["activations"] / 5
    # A LoRA head takes the plain path: float32 log-softmax kept, plus two float32 (tokens x vocab) gradients
    lora = est.Options(config, "bf16-mixed", "lora", ("lm_head",), 8, None, 2048)
    assert est.column_memory(lora, column, 1)["logits_and_loss"] >= 12 * 2048 * V


# ------------------------------------------------------------------------------------------
# The command: columns, table, recommendation, validation
# ------------------------------------------------------------------------------------------


def test_table_for_tiny_llama_on_eight_devices(capsys):
    result = estimate("tiny-llama-1.1b", devices=8, micro_batch_size=4, max_seq_length=2048)
    out = capsys.readouterr().out
    assert result["columns"] == ["DDP", "NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"]  # HYBRID = FULL on one node
    assert "HYBRID_SHARD with one node runs as FULL_SHARD" in out
    header = next(line for line in out.splitlines() if "FULL_SHARD" in line and "DDP" in line)
    assert header.split() == result["columns"]
    for label in ("parameters", "gradients", "optimizer state (AdamW)", "activations", "activations, checkpointed",
                  "logits and loss", "peak", "peak, checkpointed"):  # fmt: skip
        assert re.search(rf"^{re.escape(label)}\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+$", out, re.M), label
    s = result["strategies"]
    n = result["parameters"]
    assert s["DDP"]["parameters"] == 4 * n
    assert s["NO_SHARD"]["parameters"] == 4 * n  # every parameter whole: nothing to pad
    # FULL_SHARD pads each parameter's shard to ceil(rows / 8) rows
    assert 4 * n / 8 <= s["FULL_SHARD"]["parameters"] == pytest.approx(4 * n / 8, rel=1e-4)
    assert s["FULL_SHARD"]["optimizer_state"] == pytest.approx(8 * n / 8, rel=1e-4)
    assert s["FULL_SHARD"]["total"] < s["SHARD_GRAD_OP"]["total"] < s["NO_SHARD"]["total"] < s["DDP"]["total"]
    for col in s.values():
        assert col["total_checkpointed"] < col["total"]
    # DDP holds float32 weights, which autocast copies to bf16 in the forward pass: every linear
    # weight of the blocks, whole (the head goes through the fused loss, the embedding is a lookup).
    # FSDP under bf16-mixed gathers each block's weights in bf16 already: nothing left to copy.
    block_linears = sum(p.numel for p in est.parameter_specs(Config.from_name("tiny-llama-1.1b"))
                        if p.unit >= 0 and p.kind == "linear")  # fmt: skip
    assert s["DDP"]["weight_copies"] == 2 * block_linears
    assert all(s[name]["weight_copies"] == 0 for name in ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"))
    # one node: HYBRID_SHARD is not a column; on two nodes it is, sharded over the 8 devices of a node
    two = _quiet_estimate("tiny-llama-1.1b", devices=8, num_nodes=2, micro_batch_size=4, max_seq_length=2048)
    assert "HYBRID_SHARD" in two["columns"]
    hybrid = two["strategies"]["HYBRID_SHARD"]
    assert hybrid["parameters"] == s["FULL_SHARD"]["parameters"]
    assert two["strategies"]["FULL_SHARD"]["parameters"] == pytest.approx(hybrid["parameters"] / 2, rel=1e-4)


def test_strategy_and_sharding_select_columns():
    assert _quiet_estimate("pythia-14m", devices=4, strategy="ddp")["columns"] == ["DDP"]
    assert _quiet_estimate("pythia-14m", devices=4, strategy="fsdp")["columns"] == [
        "NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"]  # fmt: skip
    assert _quiet_estimate("pythia-14m", devices=4, sharding="SHARD_GRAD_OP")["columns"] == ["SHARD_GRAD_OP"]
    assert _quiet_estimate("pythia-14m", devices=4, sharding="HYBRID_SHARD")["columns"] == ["FULL_SHARD"]
    assert _quiet_estimate("pythia-14m", devices=2, num_nodes=2, sharding="HYBRID_SHARD")["columns"] == ["HYBRID_SHARD"]
    assert _quiet_estimate("pythia-14m", devices=1, strategy="fsdp")["columns"] == ["single"]


def test_recommendation_prefers_no_checkpointing_then_checkpointing():
    kwargs = dict(devices=8, micro_batch_size=4, max_seq_length=2048)
    table = _quiet_estimate("tiny-llama-1.1b", **kwargs)["strategies"]
    # A budget the plain FULL_SHARD figure fits: no checkpointing, cheapest strategy that fits micro batch 4.
    budget = table["FULL_SHARD"]["total"] / GiB + 0.01
    rec = _quiet_estimate("tiny-llama-1.1b", memory_budget_gb=budget, **kwargs)["recommendation"]
    assert rec["fits"] and rec["activation_checkpointing"] is False
    assert rec["strategy"] == "FULL_SHARD" and rec["micro_batch_size"] == 4 and rec["total"] <= rec["budget"]
    # Generous: DDP (cheapest communication) at micro batch 4; the largest micro batch is reported.
    rec = _quiet_estimate("tiny-llama-1.1b", memory_budget_gb=200, **kwargs)["recommendation"]
    assert (rec["strategy"], rec["activation_checkpointing"], rec["micro_batch_size"]) == ("DDP", False, 4)
    opts = est.Options(Config.from_name("tiny-llama-1.1b"), "bf16-mixed", None, (), 8, None, 2048)
    largest = rec["max_micro_batch_size"]
    ddp = est.make_column("DDP", 8, 1)
    assert est.column_memory(opts, ddp, largest)["total"] <= rec["budget"]
    assert est.column_memory(opts, ddp, largest + 1)["total"] > rec["budget"]
    # Micro batch 4 fits nowhere without checkpointing, 2 does with FULL_SHARD: micro batch 2, no
    # checkpointing (smaller micro batches with gradient accumulation cost less than recomputing).
    full = est.make_column("FULL_SHARD", 8, 1)
    budget = est.column_memory(opts, full, 2)["total"] / GiB + 1e-6
    rec = _quiet_estimate("tiny-llama-1.1b", memory_budget_gb=budget, **kwargs)["recommendation"]
    assert (rec["strategy"], rec["activation_checkpointing"], rec["micro_batch_size"]) == ("FULL_SHARD", False, 2)
    # Not even micro batch 1 without checkpointing: checkpointing, with the largest micro batch.
    budget = est.column_memory(opts, full, 1)["total"] / GiB - 1e-6
    rec = _quiet_estimate("tiny-llama-1.1b", memory_budget_gb=budget, **kwargs)["recommendation"]
    assert rec["fits"] and rec["activation_checkpointing"] is True
    # the least communication that reaches micro batch 4 with checkpointing: SHARD_GRAD_OP, which
    # keeps every block gathered from the forward to the backward pass, in bf16 (2 GiB), where
    # NO_SHARD and DDP hold whole float32 gradients and AdamW state
    order = [est.make_column(name, 8, 1) for name in ("DDP", "NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")]
    reach = [col for col in order if est.column_memory(opts, col, 4)["total_checkpointed"] <= rec["budget"]]
    assert rec["strategy"] == reach[0].name == "SHARD_GRAD_OP" and rec["micro_batch_size"] == 4
    chosen = reach[0]
    assert est.column_memory(opts, chosen, rec["max_micro_batch_size"])["total_checkpointed"] <= rec["budget"]
    assert est.column_memory(opts, chosen, rec["max_micro_batch_size"] + 1)["total_checkpointed"] > rec["budget"]
    # Nothing fits: say so, with what to try.
    rec = _quiet_estimate("tiny-llama-1.1b", memory_budget_gb=3, **kwargs)["recommendation"]
    assert not rec["fits"]
    assert rec["message"].startswith("Does not fit in 3 GiB per device")
    assert "--finetune lora" in rec["message"] and "FULL_SHARD fits on 16 devices" in rec["message"]
    # More devices help down to what no number of devices shards: a block (or the head) gathered in
    # bf16 with its gradients on their way to be reduced, and one sequence's checkpointed
    # activations and logits. (While embedding and head stayed gathered in float32 in the root unit
    # all step, 0.5 GiB more on every device, 1.5 GiB was out of reach at any number of devices.)
    rec = _quiet_estimate("tiny-llama-1.1b", memory_budget_gb=1.5, **kwargs)["recommendation"]
    assert not rec["fits"] and re.search(r"more devices \(FULL_SHARD fits on \d+ devices", rec["message"])
    # One sequence's activations and logits alone exceed 1 GiB: more devices cannot help.
    rec = _quiet_estimate("tiny-llama-1.1b", memory_budget_gb=1, **kwargs)["recommendation"]
    assert "more devices" not in rec["message"] and "a shorter --max_seq_length" in rec["message"]
    rec = _quiet_estimate("tiny-llama-1.1b", finetune="lora", memory_budget_gb=0.5, **kwargs)["recommendation"]
    assert not rec["fits"] and "--quantize nf4" in rec["message"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(model_name="tiny-lama"), "Unknown model 'tiny-lama'.*Did you mean: tiny-llama"),
        (dict(max_seq_length=4096), "larger than the context of tiny-llama-1.1b \\(2048 tokens\\)"),
        (dict(max_seq_length=0), "max_seq_length must be a positive"),
        (dict(micro_batch_size=0), "micro_batch_size must be a positive"),
        (dict(devices=0), "devices must be a positive"),
        (dict(num_nodes=-1), "num_nodes must be a positive"),
        (dict(precision="bf16-mixd"), "Unknown precision 'bf16-mixd'.*Did you mean: bf16-mixed"),
        (dict(strategy="deepspeed"), "Unknown strategy 'deepspeed'"),
        (dict(devices=2, sharding="FULL_SHARDING"), "Unknown sharding.*Did you mean: FULL_SHARD"),
        (dict(devices=2, strategy="ddp", sharding="FULL_SHARD"), "sharding applies to FSDP"),
        (dict(quantize="bnb.nf4"), "use it with finetune lora"),
        (dict(finetune="lora", quantize="bnb.nf8"), "Unknown quantize 'bnb.nf8'.*Did you mean: bnb.nf4"),
        (dict(finetune="lora", devices=2, quantize="bnb.nf4", strategy="fsdp"), "fsdp cannot shard a --quantize bnb.nf4 base"),
        (dict(finetune="lora", devices=2, quantize="bnb.int8", sharding="FULL_SHARD"), "cannot be combined with FSDP"),
        (dict(finetune="lora", quantize="bnb.nf4", lora_targets=("query", "head")), "head cannot be combined"),
        (dict(finetune="lora", lora_dropout=1.0), "lora_dropout must be in"),
        (dict(finetune="lora", lora_targets=("query", "vaule")), "Unknown lora target 'vaule'.*Did you mean: value"),
        (dict(finetune="lora", lora_targets=()), "lora_targets is empty"),
        (dict(finetune="lora", lora_r=0), "lora_r must be a positive"),
        (dict(finetune="qlora"), "Unknown finetune 'qlora'"),
        (dict(memory_budget_gb=0), "memory_budget_gb must be a positive"),
        (dict(model_overrides={"n_layers": 2}), "Unknown model config field 'n_layers'"),
    ],
)
def test_invalid_input_is_a_user_error(kwargs, message):
    kwargs = {"model_name": "tiny-llama-1.1b", **kwargs}
    with pytest.raises(UserError, match=message):
        _quiet_estimate(**kwargs)


def test_checkpoint_directory_and_small_models(tmp_path, capsys):
    """A checkpoint directory works like its preset; a tiny model's table is in MiB."""
    Config.from_name("debug").save(tmp_path)
    from_dir = estimate(str(tmp_path), max_seq_length=64)
    out = capsys.readouterr().out
    assert "Memory per device, MiB" in out
    assert from_dir["strategies"] == _quiet_estimate("debug", max_seq_length=64)["strategies"]


def test_cli_parses_the_signature():
    """The `toolkit estimate` subcommand (the CLI table lists toolkit.memory.estimator:estimate)."""
    from toolkit.cli import build_parser

    parser = build_parser("estimate", estimate)
    argv = ["tiny-llama-1.1b", "--devices", "8", "--finetune", "lora", "--lora_targets", "[query,key]",
            "--model_overrides", "{n_layer: 2}", "--activation_checkpointing", "true"]  # fmt: skip
    cfg = parser.parse_args(argv)
    kwargs = {k: v for k, v in parser.instantiate(cfg).items() if k != "config"}
    assert kwargs["lora_targets"] == ("query", "key") and kwargs["model_overrides"] == {"n_layer": 2}
    result = _quiet_estimate(**kwargs)
    assert result["parameters"] == count_parameters(Config.from_name("tiny-llama-1.1b", n_layer=2)) + sum(
        8 * (2048 + 2048) + 8 * (2048 + 256) for _ in range(2)
    )
    assert math.isfinite(result["strategies"]["FULL_SHARD"]["total_checkpointed"])


# ------------------------------------------------------------------------------------------
# Real training steps: allocations and peaks (last, so that the run overlaps with the tests above)
# ------------------------------------------------------------------------------------------


def _options(setup: str) -> est.Options:
    """The estimator's options for a measured set-up, with the CPU's rules (as measured)."""
    precision, finetune = setup.split(":")[:2]
    lora = ("q_proj", "v_proj") if finetune == "lora" else ()
    return est.Options(Config(**MEASURED_CONFIG), precision, finetune, lora, MEASURED_LORA_R, None, MEASURED_SEQ,
                       device="cpu", lora_dropout=0.05 if lora else 0.0)  # fmt: skip


def test_parameters_gradients_and_optimizer_state_match_real_runs(runs):
    """Every set-up, on one device and on each FSDP2 rank: the bytes of the parameters (shards),
    gradients and AdamW state equal the estimate exactly, in the dtypes of the precision policy.

    FSDP2 pads each rank's shard of each parameter to ceil(rows / 2) rows, and a gradient shard
    is a view into the unit's padded reduce-scatter output; AdamW's state follows the unpadded
    local shard, so rank 0 (with the extra row) holds more than rank 1 where rows are odd. The
    column shows the fullest rank. AdamW's 0-dim `step` counters are on the CPU (on a GPU too),
    so they are not device memory and are not part of the figure.
    """
    seen = set()
    for column_name, world, rank, setup, measured in runs.measured():
        seen.add((column_name, setup))
        opts = _options(setup)
        specs = est.parameter_specs(opts.config, opts.lora_modules, opts.lora_r)
        column = est.make_column(column_name, world, 1)
        figures = est.column_memory(opts, column, MEASURED_BATCH)
        expected = est.fsdp_rank_memory(specs, column, opts)[rank] if world > 1 else figures
        for key in ("parameters", "gradients", "optimizer_state"):
            assert measured[key] == expected[key], (column_name, rank, setup, key)
        if world > 1:
            for key in ("parameters", "gradients", "optimizer_state"):
                assert figures[key] == max(est.fsdp_rank_memory(specs, column, opts)[r][key] for r in range(world))
        trainable, frozen = precision_dtypes(opts.precision)
        frozen_dtypes = {f"False {frozen}"} if opts.lora_modules else set()
        assert measured["dtypes"] == sorted({f"True {trainable}"} | frozen_dtypes)
        assert measured["step_counters"] == ["0 torch.float32 cpu"]
    assert seen == {("FULL_SHARD", s) for s in FSDP_SETUPS} | {("single", s) for ss in SINGLE_SETUPS for s in ss}
    # The uneven last rows: rank 0 holds more AdamW state than rank 1 in a full fine-tune.
    first, second = (rank["FULL_SHARD"]["32-true:full"]["optimizer_state"] for rank in runs.ranks())
    assert first > second


def _traced_in_run(opts: est.Options, column: est.Column, as_stored: bool = False) -> int:
    """The estimator's saved bytes for a measured set-up (CPU rules), with the weights as `column`
    shows them to the forward pass, or as they are stored (as one device stores them)."""
    specs = est.parameter_specs(opts.config, opts.lora_modules, opts.lora_r)
    shown = est.make_column("single", 1, 1) if as_stored else column
    act = est.micro_batch_activations(opts, shown, MEASURED_BATCH, specs, set())
    return act.stored + act.head + act.weight_copies


def test_activations_in_real_runs_equal_what_autograd_saves(runs):
    """Exact, in the real training steps (not checkpointed): under FSDP2 with bf16-mixed each block
    arrives gathered in bf16 and the root (embedding, final norm, head) in float32, so autocast
    copies no weight and the norms meet bf16 weights; the recording, given the weights as FSDP gathers
    them (`Options.gathered_bytes`), names the same bytes. With the weights as stored it would not."""
    checked = set()
    for column_name, world, rank, setup, measured in runs.measured():
        if measured["saved"] is None:
            continue
        opts = _options(setup)
        column = est.make_column(column_name, world, 1)
        assert measured["saved"] == _traced_in_run(opts, column), (column_name, rank, setup)
        if column.kind == "fsdp" and opts.autocast:
            assert measured["saved"] != _traced_in_run(opts, column, as_stored=True)
        checked.add((column_name, setup))
    assert {("FULL_SHARD", "bf16-mixed:full"), ("FULL_SHARD", "bf16-mixed:lora"), ("single", "bf16-mixed:full")} <= checked


def test_estimated_peaks_are_within_4_percent_of_measured(runs):
    """The peak of a training step with gradients and AdamW state in place, on one device and on
    each rank of a 2-process FULL_SHARD run, against the estimated total (CPU rules, see
    `est.Options.device`). Measured on the reference machine (2 CPU cores): every set-up within 2.3%.

    The figures of the steps are deterministic: the measurement counts the allocator's bytes, not
    the process's memory, and the script takes the smallest of three steps' peaks (a gloo artefact
    can add a buffer to one step at random; see the script).
    """
    rows = []
    for column_name, world, rank, setup, measured in runs.measured():
        checkpointed = setup.endswith(":checkpointing")
        figures = est.column_memory(_options(setup), est.make_column(column_name, world, 1), MEASURED_BATCH)
        want, got = figures["total_checkpointed" if checkpointed else "total"], measured["peak"]
        rows.append((f"{column_name} rank {rank} {setup}: measured {got / 2**20:.2f} MiB, estimated "
                     f"{want / 2**20:.2f} MiB ({(want - got) / got:+.1%})", want, got))  # fmt: skip
    print("\n".join(line for line, _, _ in rows))
    for line, want, got in rows:
        assert abs(want - got) <= PEAK_TOLERANCE * got, line
    # The estimate's public entry point gives the figures of its GPU rules for the same set-up.
    overrides = {k: v for k, v in MEASURED_CONFIG.items() if k != "name"}
    result = _quiet_estimate("debug", model_overrides=overrides, devices=2, sharding="FULL_SHARD", finetune="full",
                             micro_batch_size=MEASURED_BATCH, max_seq_length=MEASURED_SEQ)  # fmt: skip
    gpu = dataclasses.replace(_options("bf16-mixed:full"), device="cuda", config=Config.from_name("debug", **overrides))
    column = est.make_column("FULL_SHARD", 2, 1)
    assert result["strategies"]["FULL_SHARD"] == est.column_memory(gpu, column, MEASURED_BATCH)


@pytest.mark.parametrize("shape", [(256, 256), (512, 1024)])
def test_quantized_bytes_match_torchao_nf4(shape):
    from toolkit.parallel.nf4 import nf4_quantize, nf4_storage_bytes

    weight = torch.randn(shape, dtype=torch.bfloat16)
    assert est.quantized_bytes(shape, "nf4") == nf4_storage_bytes(nf4_quantize(weight, torch.bfloat16))


def test_the_largest_micro_batch_where_the_peak_does_not_grow_with_it():
    """Gemma-3-27B on 8 GPUs with checkpointing at 256 tokens: the step's peak at micro-batch 1 and 2
    is the moment the root unit's gradients (the tied embedding's) are reduced, which the
    micro-batch does not change; the recommendation's largest micro-batch is then searched for, not
    taken as unlimited."""
    config = Config.from_name("gemma-3-27b")
    opts, column = est.Options(config, "bf16-mixed", None, (), 8, None, 256), est.make_column("FULL_SHARD", 8, 1)
    budget = 66 * 2**30
    assert est.column_memory(opts, column, 2)["total_checkpointed"] == est.column_memory(opts, column, 1)["total_checkpointed"]
    assert est.peak_moment(opts, column, 2, True)[0] == "root reduced"
    largest, figures = est._max_micro_batch(opts, column, True, budget)
    assert 2 < largest < 64 and figures["total_checkpointed"] <= budget
    assert est.column_memory(opts, column, largest + 1)["total_checkpointed"] > budget


def test_the_table_names_a_mixture_of_experts_only_for_one(capsys):
    """Its active parameters and FLOPs per token are printed for a mixture of experts; a dense model
    prints none, also under LoRA (whose adapters make the total differ from the base's count)."""
    for name, finetune, expected in (("llama-3.2-1b", "lora", False), ("llama-3.2-1b", None, False),
                                     ("qwen3-30b-a3b", None, True)):
        estimate(name, finetune=finetune, max_seq_length=256)
        assert ("mixture of experts:" in capsys.readouterr().out) is expected, (name, finetune)
