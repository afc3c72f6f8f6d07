"""Regional compilation (`--train.compile`): compiled blocks give eager's numbers on one and two processes
(FSDP2 with activation checkpointing), resume exactly across a kill, compile once for every length of
fine-tuning batch (LoRA with peft), and fall back to eager with one line when the compiler is broken.

Real torch.compile (inductor, the system C++ compiler) throughout. Runs are single-threaded
(OMP_NUM_THREADS=1). Compiled code may reorder floating-point sums (fused kernels), so compiled and
eager runs are compared within TOLERANCE; compiled runs compared with compiled runs must be equal.
The two-process, kill-and-resume and LoRA command tests are marked slow: `pytest -m slow tests/test_compile.py`.
"""

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ASSETS, REPO, kill_group_at_step, launch_env, logged_metrics, run_in_process, tiny_pretrain_args

STEPS = 6
# Relative difference allowed between compiled and eager losses (measured: below 1e-6 in float32). A
# wrong gradient or a skipped block changes them by far more than 1e-3.
TOLERANCE = 1e-5
# Weights: AdamW divides each update by the gradient's own magnitude, so an element whose gradient is
# rounding noise (the key bias, to which attention is invariant; a rarely seen token's embedding)
# moves by up to the learning rate per step in either run (measured: 2 of 3.2M embedding entries off
# by 3e-4). So every element must agree within TOLERANCE except at most OUTLIERS per tensor, and those
# within Adam's bound. A wrong gradient or a skipped block moves most elements of some tensor.
LR = 0.002
OUTLIERS = 10


def _pretrain_args(out_dir: Path, *extra: str) -> list[str]:
    return [
        *tiny_pretrain_args(out_dir, STEPS), "--train.learning_rate", str(LR),
        "--train.keep_last", "3", "--log.interval", "1", "--log.loggers", "[csv]", "--resume", "auto", *extra,
    ]


def _pretrain_cmd(out_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "toolkit", *_pretrain_args(out_dir, *extra)]


def _run(cmd: list[str], **env: str) -> str:
    result = subprocess.run(cmd, capture_output=True, text=True, env=dict(launch_env(), **env), timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _losses(out_dir: Path) -> dict[int, float]:
    return {int(float(r["step"])): float(r["train/loss"]) for r in logged_metrics(out_dir) if r.get("train/loss")}


def _weights(out_dir: Path) -> dict:
    return load_file(str(out_dir / "final" / "model.safetensors"))


def _assert_close_runs(a: Path, b: Path) -> None:
    la, lb = _losses(a), _losses(b)
    assert sorted(la) == sorted(lb) == list(range(1, STEPS + 1))
    for step in la:
        assert la[step] == pytest.approx(lb[step], rel=TOLERANCE), (step, la, lb)
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        difference = (wa[name] - wb[name]).abs()
        assert int((difference > TOLERANCE).sum()) <= OUTLIERS, (name, difference.max().item())
        assert difference.max() <= 2 * LR * STEPS, name


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """An eager run and a compiled run of the same STEPS steps, one process each (this one)."""
    root = tmp_path_factory.mktemp("compile")
    eager, compiled = root / "eager", root / "compiled"
    run_in_process(_pretrain_args(eager, "--train.compile", "false"))
    out = run_in_process(_pretrain_args(compiled, "--train.compile", "true"))
    return {"root": root, "eager": eager, "compiled": compiled, "compiled_stdout": out}


def test_compiled_blocks_match_eager_on_one_process(runs):
    out = runs["compiled_stdout"]
    assert "2 transformer blocks compiled separately" in out
    assert out.count("s compiling up to step") == 1  # the compile time, printed once
    compile_rows = [r for r in logged_metrics(runs["compiled"]) if r.get("train/compile_seconds")]
    assert len(compile_rows) == 1 and float(compile_rows[0]["train/compile_seconds"]) > 0
    # The time left is extrapolated from the steps' pace, not from the compilation (seconds here,
    # against steps of a few hundredths): no step line says more than the compilation took, where
    # the compilation's pace would say it times the steps left (5 after the first).
    step_lines = [line for line in out.splitlines() if line.startswith("step ")]
    left = [re.search(r"(\d+):(\d\d) left$", line) for line in step_lines]
    assert len(step_lines) == STEPS and all(left), step_lines
    compiled_for = float(compile_rows[0]["train/compile_seconds"])
    assert all(60 * int(m[1]) + int(m[2]) <= max(1.0, compiled_for) for m in left), (compiled_for, step_lines)
    # Each step logs its real input tokens (here every token is real: micro 2 x 2 accumulation x 32).
    assert [float(r["train/tokens_per_step"]) for r in logged_metrics(runs["compiled"]) if r.get("train/loss")] == [128.0] * STEPS
    _assert_close_runs(runs["compiled"], runs["eager"])


@pytest.mark.slow  # about 20 s each with a warm inductor cache; the default run stays within budget
def test_compiled_blocks_under_fsdp_with_checkpointing_match_eager_on_two_processes(runs):
    out = runs["root"] / "fsdp"
    log = _run(_pretrain_cmd(out, "--train.compile", "true", "--devices", "2",
                             "--distributed.activation_checkpointing", "true"))
    assert "FSDP2" in log and "compiled separately" in log
    _assert_close_runs(out, runs["eager"])


@pytest.mark.slow  # about 20 s each with a warm inductor cache; the default run stays within budget
def test_a_compiled_run_killed_and_resumed_matches_the_uninterrupted_one(runs):
    out = runs["root"] / "killed"
    k = random.Random(os.getpid()).randint(3, STEPS - 1)  # past the first checkpoint (step 2)
    kill_group_at_step(_pretrain_cmd(out, "--train.compile", "true"), k)
    log = _run(_pretrain_cmd(out, "--train.compile", "true"))
    assert "Resumed from" in log
    reference, resumed = _weights(runs["compiled"]), _weights(out)
    for name in reference:
        assert torch.equal(reference[name], resumed[name]), name
    ref_losses, losses = _losses(runs["compiled"]), _losses(out)
    assert all(losses[s] == ref_losses[s] for s in range(k, STEPS + 1)), (k, losses, ref_losses)


def test_a_broken_compiler_falls_back_to_eager_with_one_line(runs, tmp_path):
    out = runs["root"] / "no-compiler"
    # No C++ compiler for inductor; an empty cache so that no kernel compiled earlier is reused.
    log = _run(_pretrain_cmd(out, "--train.compile", "true"), CXX="/nonexistent/c++",
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    assert log.count("torch.compile is unavailable here") == 1
    assert "compiled separately" not in log
    for step, loss in _losses(runs["eager"]).items():
        assert _losses(out)[step] == loss  # eager again: bit-identical


def test_lora_blocks_stop_recompiling_once_batch_lengths_vary():
    """peft LoRA inside compiled blocks with dynamic shapes: after a first few batches, batches of new
    lengths compile nothing more; losses and adapter gradients are eager's (dropout 0: compiled code
    draws other random numbers than eager)."""
    from peft import get_peft_model
    from torch._dynamo.utils import counters

    from toolkit.models.adapters import LoRAArgs
    from toolkit.models.config import Config
    from toolkit.models.gpt import GPT, Block
    from toolkit.parallel.compile import compile_blocks

    config = Config.from_name("debug-neox")
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(get_peft_model(GPT(config), LoRAArgs(dropout=0.0, targets=("query", "value", "mlp")).peft_config()))
    eager, compiled = models
    for name, p in compiled.named_parameters():  # LoRA B starts at zero: give it values so that it matters
        if "lora_B" in name:
            p.data.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
            dict(eager.named_parameters())[name].data.copy_(p.data)
    assert compile_blocks(compiled, Block, torch.device("cpu"), dynamic=True, print_fn=print) == config.n_layer
    counters.clear()
    generator = torch.Generator().manual_seed(1)

    def train_on(shapes):
        for batch, length in shapes:
            ids = torch.randint(0, config.vocab_size, (batch, length), generator=generator)
            losses = []
            for model in (eager, compiled):
                model.zero_grad(set_to_none=True)
                loss = model(ids, labels=ids)
                loss.backward()
                losses.append(loss.detach())
            torch.testing.assert_close(losses[1], losses[0], rtol=TOLERANCE, atol=0)
            grads = [{n: p.grad for n, p in m.named_parameters() if p.requires_grad} for m in (eager, compiled)]
            for name in grads[0]:
                torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6, msg=name)
        return counters["stats"]["unique_graphs"]

    # The first block's input needs no gradient (the embedding is frozen), the others' do; a batch of
    # one row is specialised (size 1): so a few graphs at first, then none for any new length.
    first = train_on([(2, 17), (2, 23), (1, 9), (1, 14), (2, 40)])
    assert 1 <= first <= 8, dict(counters["stats"])
    assert train_on([(2, 31), (1, 55), (2, 12), (2, 61), (1, 33), (2, 47)]) == first, dict(counters["stats"])


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_rows_compile_once_for_every_packing_layout(checkpointing):
    """Packed rows (document_ids) through compiled blocks: after the first few batches, ten more
    batches, each a packing layout not seen before (rows, length, samples per row), compile nothing
    (dynamo's recompile limit is 8); losses and gradients are eager's. With activation checkpointing
    too, where a graph break inside the checkpointed region would leave the whole block eager."""
    from torch._dynamo.utils import counters
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    from toolkit.models.config import Config
    from toolkit.models.gpt import GPT, Block
    from toolkit.parallel.compile import compile_blocks

    config = Config.from_name("debug-neox")
    torch.manual_seed(0)
    eager = GPT(config)
    compiled = GPT(config)
    compiled.load_state_dict(eager.state_dict())
    if checkpointing:
        apply_activation_checkpointing(compiled, checkpoint_wrapper_fn=checkpoint_wrapper,
                                       check_fn=lambda m: isinstance(m, Block))
    assert compile_blocks(compiled, Block, torch.device("cpu"), dynamic=True, print_fn=print) == config.n_layer
    counters.clear()
    generator = torch.Generator().manual_seed(1)

    def train_on(layouts):
        for rows, length, samples in layouts:
            ids = torch.randint(0, config.vocab_size, (rows, length), generator=generator)
            document_ids = torch.zeros(rows, length, dtype=torch.int64)
            for r in range(rows):  # samples[r] samples, cut at random places
                for cut in torch.randperm(length - 1, generator=generator)[: samples[r] - 1] + 1:
                    document_ids[r, cut:] += 1
            grads = []
            for model in (eager, compiled):
                model.zero_grad(set_to_none=True)
                loss = model(ids, labels=ids, document_ids=document_ids)
                loss.backward()
                grads.append([loss.detach()] + [p.grad for p in model.parameters()])  # the same order in both
            for i, (got, want) in enumerate(zip(grads[1], grads[0])):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=f"loss and gradients, item {i}")
        return counters["stats"]["unique_graphs"]

    first = train_on([(2, 24, (2, 3)), (3, 31, (4, 1, 2))])
    assert 1 <= first <= 8, dict(counters["stats"])
    new_layouts = [(2 + i % 3, 20 + 5 * i, tuple(2 + (i + r) % 6 for r in range(2 + i % 3))) for i in range(10)]
    assert train_on(new_layouts) == first, dict(counters["stats"])


def test_compiled_mixture_with_looped_experts_compiles_once_whatever_the_routing():
    """float32 experts compiled run one product per expert (no grouped kernel compiled in float32
    here; a GPU older than sm90 too), whose row counts are data: after the first batches, batches
    routed otherwise (experts with no row) compile nothing more; losses and gradients are eager's."""
    from torch._dynamo.utils import counters

    from toolkit.models.config import Config
    from toolkit.models.gpt import GPT, Block, init_weights
    from toolkit.parallel.compile import compile_blocks

    config = Config.from_name("debug-mixtral")
    eager = GPT(config)
    init_weights(eager, config.n_layer, seed=0)  # the experts start empty (torch.empty)
    compiled = GPT(config)
    compiled.load_state_dict(eager.state_dict())
    assert compile_blocks(compiled, Block, torch.device("cpu"), dynamic=False, print_fn=print) == config.n_layer
    counters.clear()
    generator = torch.Generator().manual_seed(2)

    def train_on(batches: int) -> int:
        for _ in range(batches):
            ids = torch.randint(0, config.vocab_size, (2, 12), generator=generator)  # 48 rows over 8 experts
            grads = []
            for model in (eager, compiled):
                model.zero_grad(set_to_none=True)
                loss = model(ids, labels=ids)
                loss.backward()
                grads.append([loss.detach()] + [p.grad for p in model.parameters()])
            for i, (got, want) in enumerate(zip(grads[1], grads[0])):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=f"loss and gradients, item {i}")
        return counters["stats"]["unique_graphs"]

    first = train_on(2)
    assert 1 <= first <= 8, dict(counters["stats"])
    assert train_on(10) == first, dict(counters["stats"])


def test_auto_compiles_only_where_it_was_measured_faster():
    from toolkit.parallel.compile import AUTO_MIN_STEPS, should_compile

    long = AUTO_MIN_STEPS
    assert should_compile(None, long, "cuda", "bf16-mixed", variable_lengths=False)[0]  # a long GPU run
    assert should_compile(None, None, "cuda", "bf16-mixed", variable_lengths=True)[0]  # a GPU, no step limit
    assert not should_compile(None, long - 1, "cuda", "bf16-mixed", variable_lengths=False)[0]  # too short
    for precision in ("32-true", "bf16-mixed"):  # a CPU: measured no faster
        for variable in (False, True):
            assert not should_compile(None, None, "cpu", precision, variable_lengths=variable)[0]
    assert should_compile(True, 3, "cpu", "bf16-mixed", variable_lengths=True)[0]  # asked for: always
    assert not should_compile(False, None, "cuda", "bf16-mixed", variable_lengths=False)[0]


@pytest.mark.slow  # about 90 s: two fine-tuning runs, one compiling with dynamic shapes
def test_compiled_lora_fine_tuning_matches_eager_and_logs_its_real_tokens(base, tmp_path):
    """`toolkit finetune_lora` end to end (peft, Alpaca batches of varying lengths, dynamic shapes):
    compiled losses equal eager's, and each step's logged real tokens add up to tokens_seen."""
    from toolkit.cli import run

    def finetune(out: Path, compile_: str) -> Path:
        args = [
            "finetune_lora", str(base["checkpoint"]), "--out_dir", str(out),
            "--data", "Alpaca", "--data.json_path", str(ASSETS / "instruct" / "alpaca_tiny.json"),
            "--data.val_split_fraction", "0.1", "--data.group_by_length", "false", "--precision", "32-true",
            "--train.micro_batch_size", "2", "--train.global_batch_size", "4", "--train.max_seq_length", "128",
            "--train.max_steps", str(STEPS), "--train.warmup_steps", "2", "--train.learning_rate", str(LR),
            "--lora.dropout", "0", "--lora.targets", "[query, value, mlp]", "--eval.interval", "1000",
            "--eval.final_validation", "false", "--log.interval", "1", "--log.loggers", "[csv]",
            "--train.compile", compile_,
        ]
        assert run(args) == 0
        return out

    eager, compiled = finetune(tmp_path / "eager", "false"), finetune(tmp_path / "compiled", "true")
    le, lc = _losses(eager), _losses(compiled)
    assert sorted(le) == sorted(lc) == list(range(1, STEPS + 1))
    for step in le:
        assert lc[step] == pytest.approx(le[step], rel=TOLERANCE), (step, le, lc)
    rows = [r for r in logged_metrics(compiled) if r.get("train/loss")]
    per_step = [float(r["train/tokens_per_step"]) for r in rows]
    assert len(set(per_step)) > 1  # batches of varying real lengths
    assert sum(per_step) == float(rows[-1]["train/tokens_seen"])


def test_the_compiler_probe_leaves_the_random_state_alone():
    """The probe runs after a resume has restored the RNG: a draw there shifted every later LoRA
    dropout mask, so a compiled run with dropout did not resume exactly."""
    import torch

    from toolkit.parallel.compile import compiler_problem

    torch.manual_seed(123)
    before = torch.get_rng_state()
    assert compiler_problem(torch.device("cpu")) is None
    assert torch.equal(torch.get_rng_state(), before)
