"""`toolkit estimate` against memory that real tensors actually take.

- Parameters, gradients and optimizer state: models built on the meta device (every preset size,
  no memory used), peft's real LoRA injection, real bitsandbytes quantization on CPU, a real AdamW
  step, and a real 2-process FSDP run (tests/scripts/estimate_fsdp.py) whose per-rank shards must
  equal the estimate byte for byte.
- Activations: a real forward pass on CPU under `torch.autograd.graph.saved_tensors_hooks`, which
  sees every tensor autograd keeps for the backward pass; the estimator's op-by-op walk must name
  the same bytes, for every architecture family, precision and LoRA set-up.
- Peak: a real training step in a fresh process (tests/scripts/estimate_peak.py, whose docstring
  describes the RSS method) must be within 25% of the estimated total.

The two subprocesses start together (module fixture `runs`) and overlap with each other.
"""

from __future__ import annotations

import contextlib
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

from toolkit import estimate as est
from toolkit.errors import UserError
from toolkit.estimate import GiB, estimate
from toolkit.models.config import Config
from toolkit.models import gpt
from toolkit.models.gpt import GPT

SCRIPTS = Path(__file__).parent / "scripts"
TIMEOUT = 240
PRESETS = ["pythia-14m", "tiny-llama-1.1b", "llama-3.2-1b", "gemma-2b", "phi-2", "qwen2.5-0.5b"]
FAMILIES = ["debug", "debug-neox", "debug-gemma", "debug-phi", "debug-llama2"]
# The model whose training step is measured (float32): about 10.6M parameters, 1,024 tokens per
# micro-batch, so activations and logits are about 60% of the ~430 MiB peak and the runtime's own
# allocations (a few MiB) are small against it.
PEAK_CONFIG = dict(name="peak", vocab_size=8192, block_size=512, n_layer=8, n_embd=256, n_head=8, intermediate_size=704)
PEAK_BATCH, PEAK_SEQ = 4, 256


def _quiet_estimate(*args, **kwargs) -> dict:
    with contextlib.redirect_stdout(open(os.devnull, "w")):
        return estimate(*args, **kwargs)


# ------------------------------------------------------------------------------------------
# Background runs: a 2-process FSDP step and the peak-memory measurement
# ------------------------------------------------------------------------------------------


def _clean_env() -> dict[str, str]:
    launcher = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE",
                "PL_GLOBAL_SEED")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    return env | {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _start(command: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip


def _start_fsdp(out: Path, *args: str) -> list[subprocess.Popen]:
    """Both ranks of tests/scripts/estimate_fsdp.py, started by hand (LOCAL_RANK set, as a cluster
    launcher would) so that they import in parallel; Fabric only joins them into one process group."""
    env = _clean_env() | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "NODE_RANK": "0"}
    command = [sys.executable, str(SCRIPTS / "estimate_fsdp.py"), "--out", str(out), *args]
    return [_start(command, env | {"LOCAL_RANK": str(rank)}) for rank in range(2)]


def _wait(procs: list[subprocess.Popen], what: str) -> str:
    """Rank 0's (or the only process's) stdout, once every process exited successfully."""
    outputs = []
    try:
        for proc in procs:
            try:
                stdout, stderr = proc.communicate(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                _kill(procs)
                stdout, stderr = proc.communicate()
            outputs.append(stdout)
            assert proc.returncode == 0, f"{what}: exit code {proc.returncode}\n{stdout[-3000:]}\n{stderr[-5000:]}"
    finally:
        _kill(procs)
    return outputs[0]


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
    """The FSDP run and the peak measurement, started together so that they overlap."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.fsdp = _start_fsdp(out)
        peak_env = _clean_env() | {"MALLOC_MMAP_THRESHOLD_": "65536"}  # see estimate_peak.py's docstring
        self.peak = _start(
            [sys.executable, str(SCRIPTS / "estimate_peak.py"), "--config", json.dumps(PEAK_CONFIG),
             "--micro-batch", str(PEAK_BATCH), "--seq", str(PEAK_SEQ)], peak_env)  # fmt: skip
        self._results: dict[str, str] = {}

    def result(self, name: str) -> str:
        if name not in self._results:
            self._results[name] = _wait(self.fsdp if name == "fsdp" else [self.peak], name)
        return self._results[name]

    def close(self) -> None:
        _kill([*self.fsdp, self.peak])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    runs = _Runs(tmp_path_factory.mktemp("estimate_runs"))
    yield runs
    runs.close()


def _fsdp_script():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import estimate_fsdp as script
    finally:
        sys.path.remove(str(SCRIPTS))
    return script


def _check_fsdp_ranks(out: Path, setups: list[tuple[str, tuple[str, ...]]]) -> list[dict]:
    """Every rank's measured bytes equal `fsdp_rank_memory` exactly; the column shows the fullest rank."""
    script = _fsdp_script()
    config = Config(**script.CONFIG)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for setup, lora in setups:
        column = est.make_column(setup.split("_lora")[0], 2, 1)
        specs = est.parameter_specs(config, lora, script.LORA_R)
        expected = est.fsdp_rank_memory(specs, column, stored_bytes=4, gather_bytes=2)  # bf16-mixed
        measured = []
        for rank, result in enumerate(ranks):
            m = result[setup]
            assert m["flat_dtypes"] == ["torch.float32"]
            assert all(c == [0, "torch.float32", "cpu"] for c in m["step_counters"])
            measured.append({"parameters": m["parameters"], "gradients": m["flat_gradients"],
                             "optimizer_state": m["optimizer_state"]})  # fmt: skip
            assert measured[-1] == expected[rank if len(expected) > 1 else 0], (setup, rank)
        opts = est.Options(config, "bf16-mixed", "lora" if lora else None, lora, script.LORA_R, None, 16)
        figures = est.column_memory(opts, column, 1)
        for key in ("parameters", "gradients", "optimizer_state"):
            assert figures[key] == max(m[key] for m in measured)
    return ranks


@pytest.mark.xfail(strict=True, reason="known gap (issue 10, item 5): the estimator and tests/scripts/estimate_fsdp.py still model FSDP1; the engine is FSDP2 now")
def test_fsdp_shards_match_a_real_two_process_run(runs):
    """Each rank's flat-parameter shard, flat-gradient shard and AdamW state equal the estimate exactly.

    FSDP pads every tensor to 16 bytes and every unit to the world size; the estimator lays the flat
    parameters out the same way, so there is no tolerance. AdamW's 0-dim `step` counters are on
    the CPU (on a GPU too), so they are not device memory and are not part of the figure.
    """
    runs.result("fsdp")
    _check_fsdp_ranks(runs.out, [("FULL_SHARD", ()), ("NO_SHARD", ())])


@pytest.mark.slow
def test_fsdp_lora_shards_match_a_real_two_process_run(tmp_path):
    """LoRA under FSDP: a block's flat gradient covers its frozen weights too; AdamW only the adapters.

    Slow only because both ranks import peft (about 20 s on 2 cores).
    """
    _wait(_start_fsdp(tmp_path, "--lora"), "fsdp --lora")
    script = _fsdp_script()
    ranks = _check_fsdp_ranks(tmp_path, [("FULL_SHARD_lora", tuple(script.LORA_TARGETS))])
    specs = est.parameter_specs(Config(**script.CONFIG), tuple(script.LORA_TARGETS), script.LORA_R)
    assert sum(r["FULL_SHARD_lora"]["optimizer_state"] for r in ranks) == 2 * 4 * sum(s.numel for s in specs if s.trainable)


def test_estimated_peak_is_within_25_percent_of_measured(runs):
    """Peak of a float32 training step on CPU (method in tests/scripts/estimate_peak.py).

    The estimate is a GPU model (fused attention, foreach AdamW) but every piece it counts also
    exists on CPU in float32: torch's CPU flash-attention kernel saves what the GPU kernels save,
    and the script asks AdamW for foreach. The fused loss (toolkit.models.gpt.linear_cross_entropy_sum)
    is modelled with the CPU rule: in float32 its log-softmax overwrites the logits chunk, one
    buffer instead of two. Measured on the reference machine (2 CPU cores): 386 MiB against 374
    estimated without checkpointing, 238 MiB against 234 with it.
    """
    measured = json.loads(runs.result("peak").strip().splitlines()[-1])
    config = Config(**PEAK_CONFIG)
    opts = est.Options(config, "32-true", None, (), 8, None, PEAK_SEQ, cuda=False)
    figures = est.column_memory(opts, est.make_column("single", 1, 1), PEAK_BATCH)
    # What the process allocated for the model matches exactly.
    for key in ("parameters", "gradients", "optimizer_state"):
        assert measured[key] == figures[key], key
    for peak_key, total_key in (("peak", "total"), ("peak_checkpointed", "total_checkpointed")):
        got = measured[peak_key] - measured["baseline"]
        want = figures[total_key]
        report = f"{peak_key}: measured {got / 2**20:.1f} MiB, estimated {want / 2**20:.1f} MiB"
        print(report)
        assert abs(want - got) <= 0.25 * got, report
    # The estimate's public entry point gives the same figures.
    overrides = {**{k: v for k, v in PEAK_CONFIG.items() if k != "name"}, "n_query_groups": None}
    result = _quiet_estimate("debug", model_overrides=overrides, micro_batch_size=PEAK_BATCH, max_seq_length=PEAK_SEQ,
                             precision="32-true")  # fmt: skip
    # No autocast: the CUDA and CPU rules agree but for the fused loss's float32 log-softmax
    # buffer (one chunk of rows x vocab; here all 1,024 rows), which CUDA does not write in place.
    single = result["strategies"]["single"]
    chunk = PEAK_BATCH * PEAK_SEQ * config.vocab_size * 4
    assert 4 * config.vocab_size * PEAK_BATCH * PEAK_SEQ <= est.LOSS_CHUNK_BYTES
    differ = {"logits_and_loss", "total", "total_checkpointed"}
    assert {k: v for k, v in single.items() if k not in differ} == {k: v for k, v in figures.items() if k not in differ}
    for key in differ:
        assert single[key] == figures[key] + chunk, key


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
    assert sum(s.numel for s in specs) == model.config.num_parameters()


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "32-true"])
def test_single_device_parameter_gradient_optimizer_bytes(name, precision):
    """On the meta device, in the dtype Fabric gives the weights; AdamW's rule is checked below."""
    model = _meta_model(name)
    if precision == "bf16-true":
        model = model.to(torch.bfloat16)  # Fabric converts the module; mixed keeps float32
    params = list(model.parameters())
    result = _quiet_estimate(name, precision=precision, max_seq_length=16)
    single = result["strategies"]["single"]
    assert result["columns"] == ["single"]
    assert single["parameters"] == _bytes(params)
    assert single["gradients"] == _bytes(params)  # a gradient has its parameter's dtype (see below)
    assert single["optimizer_state"] == 2 * _bytes(params)
    assert result["trainable_parameters"] == result["parameters"] == sum(p.numel() for p in params)


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
    # One device, bf16-mixed: Fabric keeps every weight in float32, frozen or not.
    trainable = [p for p in model.parameters() if p.requires_grad]
    result = _quiet_estimate(name, finetune="lora", lora_targets=targets, max_seq_length=16)
    single = result["strategies"]["single"]
    assert result["trainable_parameters"] == sum(p.numel() for p in trainable)
    assert single["parameters"] == _bytes(model.parameters())
    assert single["gradients"] == _bytes(trainable)
    assert single["optimizer_state"] == 2 * _bytes(trainable)


@pytest.mark.parametrize("kind", est.QUANTIZE_CHOICES)
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

    from toolkit.finetune.lora import LoRAArgs, quantize_linears

    torch.manual_seed(0)
    config = Config.from_name("debug-phi")
    lora = LoRAArgs(r=4, targets=("query", "value"))  # finetune_lora's defaults otherwise: dropout 0.05
    model = get_peft_model(quantize_linears(GPT(config), kind, compute_dtype=torch.bfloat16), lora.peft_config())
    measured = _saved_bytes(model, config, B=2, T=32, autocast=True)
    assert measured == _traced_bytes(config, "bf16-mixed", ("q_proj", "v_proj"), 4, kind, fsdp=False, B=2, T=32,
                                     dropout=lora.dropout)  # fmt: skip
    # Counted after that forward pass: bitsandbytes converts the 4-bit layers' biases to bf16 in it.
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


# ------------------------------------------------------------------------------------------
# Activations
# ------------------------------------------------------------------------------------------


def _saved_bytes(model, config: Config, B: int, T: int, autocast: bool) -> int:
    """Bytes of every distinct storage autograd saves in a forward pass with the loss, parameters excluded.

    The parameters' storages are taken after the forward pass: bitsandbytes replaces a bias's storage
    during it, and the old address may then hold a saved tensor.
    """
    seen: dict[int, int] = {}

    def pack(t):
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
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(nbytes for ptr, nbytes in seen.items() if ptr not in params)


def _traced_bytes(config, precision, lora, r, quantize, fsdp, B, T, dropout=0.0) -> int:
    """The estimator's saved bytes (blocks + outside them + autocast weight copies), CPU rules."""
    opts = est.Options(config, precision, "lora" if lora else None, lora, r, quantize, T, cuda=False,
                       lora_dropout=dropout)  # fmt: skip
    specs = est.parameter_specs(config, lora, r)
    quantized = {s.name for s in specs if quantize and s.kind == "linear" and s.unit >= 0}
    weights, adapters = est.forward_weights(opts, specs, fsdp, quantized)
    mode = est.Mode(opts.autocast, opts.compute_bytes, cuda=False, lora_dropout=dropout > 0)
    act = est.trace_activations(config, mode, weights, adapters, B, T)
    return act.stored + act.head + act.weight_copies


# mode: how the weights look to the forward pass
#   32-true     float32 weights, no autocast
#   bf16-true   the model converted to bf16
#   bf16-mixed  float32 weights under autocast (one device, DDP): autocast copies the weights
#   fsdp-mixed  bf16 weights under autocast: what FSDP's param_dtype gathers for bf16-mixed
# (LoRA under FSDP gathers every weight in bf16 too: the fsdp-mixed case without LoRA covers it.)
ALL_LINEARS = tuple(leaf for leaves in est.LORA_TARGETS.values() for leaf in leaves)
ACTIVATION_CASES = [
    (name, mode, lora, dropout)
    for name in FAMILIES
    for mode in ("32-true", "bf16-true", "bf16-mixed", "fsdp-mixed")
    for lora in ((), ("q_proj", "v_proj"), ALL_LINEARS)
    for dropout in ((0.0, 0.05) if lora == ("q_proj", "v_proj") else (0.0,))  # finetune_lora's default dropout
    if not (mode == "fsdp-mixed" and lora)
]


@pytest.mark.parametrize("name, mode, lora, dropout", ACTIVATION_CASES)
def test_activations_equal_what_autograd_saves(name, mode, lora, dropout):
    """Exact: the walk through GPT.forward names every byte autograd keeps, and nothing else.

    CPU autocast differs from CUDA's in one rule the estimator models (CUDA runs layer_norm in
    float32; CPU keeps bf16), so the comparison uses the estimator's CPU rules (`cuda=False`).
    """
    config = Config.from_name(name)
    torch.manual_seed(0)
    model = GPT(config)
    present = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    lora = tuple(sorted(leaf for leaf in lora if leaf in present))
    if lora:
        from peft import LoraConfig, inject_adapter_in_model

        model = inject_adapter_in_model(LoraConfig(r=4, target_modules=list(lora), lora_dropout=dropout), model)
        for n, p in model.named_parameters():
            p.requires_grad_("lora_" in n)
    if mode in ("bf16-true", "fsdp-mixed"):
        model = model.to(torch.bfloat16)  # bf16-mixed keeps every weight in float32, frozen or not
    autocast = mode.endswith("mixed")
    measured = _saved_bytes(model, config, B=2, T=32, autocast=autocast)
    precision = "bf16-mixed" if mode == "fsdp-mixed" else mode
    assert measured == _traced_bytes(config, precision, lora, 4, None, fsdp=mode == "fsdp-mixed", B=2, T=32,
                                     dropout=dropout)  # fmt: skip


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
    assert est.LOSS_CHUNK_BYTES == gpt.LOSS_CHUNK_BYTES
    for b, fig in ((1, one), (4, four)):
        tokens = b * 2048
        assert fig["logits_and_loss"] - grad_w >= 2 * tokens * E  # grad_h
        assert fig["logits_and_loss"] < grad_w + 2 * tokens * E + 3 * est.LOSS_CHUNK_BYTES + 3 * grad_w
    assert one["activations_checkpointed"] < one["activations"] / 10
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
    # NO_SHARD keeps everything too, plus FSDP's padding: at most 7 elements per tensor (16-byte
    # alignment of bf16) and 7 per unit (a multiple of 8 devices)
    padding = s["NO_SHARD"]["parameters"] - 4 * n
    assert 0 <= padding <= 4 * 7 * (len(est.parameter_specs(Config.from_name("tiny-llama-1.1b"))) + 23)
    assert s["FULL_SHARD"]["parameters"] == pytest.approx(4 * n / 8, rel=1e-4)
    assert s["FULL_SHARD"]["optimizer_state"] == pytest.approx(8 * n / 8, rel=1e-4)
    assert s["FULL_SHARD"]["total"] < s["SHARD_GRAD_OP"]["total"] < s["NO_SHARD"]["total"] < s["DDP"]["total"]
    for col in s.values():
        assert col["total_checkpointed"] < col["total"]
    # FSDP gathers bf16 weights, so autocast has no float32 weights to copy; DDP has.
    assert s["FULL_SHARD"]["weight_copies"] == 0 < s["DDP"]["weight_copies"]
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
    # the least communication that reaches micro batch 4 with checkpointing: SHARD_GRAD_OP since the
    # fused loss no longer keeps the logits
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
    # One sequence's activations and logits alone exceed 1 GiB: more devices cannot help.
    rec = _quiet_estimate("tiny-llama-1.1b", memory_budget_gb=1, **kwargs)["recommendation"]
    assert "more devices" not in rec["message"] and "a shorter --max_seq_length" in rec["message"]
    rec = _quiet_estimate("tiny-llama-1.1b", finetune="lora", memory_budget_gb=0.5, **kwargs)["recommendation"]
    assert not rec["fits"] and "--quantize bnb.nf4" in rec["message"]


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
        (dict(finetune="lora", devices=2, quantize="bnb.nf4"), "quantize runs on one device"),
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
    """The `toolkit estimate` subcommand (the CLI table lists toolkit.estimate:estimate)."""
    from toolkit.cli import build_parser

    parser = build_parser("estimate", estimate)
    argv = ["tiny-llama-1.1b", "--devices", "8", "--finetune", "lora", "--lora_targets", "[query,key]",
            "--model_overrides", "{n_layer: 2}", "--activation_checkpointing", "true"]  # fmt: skip
    cfg = parser.parse_args(argv)
    kwargs = {k: v for k, v in parser.instantiate(cfg).items() if k != "config"}
    assert kwargs["lora_targets"] == ("query", "key") and kwargs["model_overrides"] == {"n_layer": 2}
    result = _quiet_estimate(**kwargs)
    assert result["parameters"] == Config.from_name("tiny-llama-1.1b", n_layer=2).num_parameters() + sum(
        8 * (2048 + 2048) + 8 * (2048 + 256) for _ in range(2)
    )
    assert math.isfinite(result["strategies"]["FULL_SHARD"]["total_checkpointed"])
