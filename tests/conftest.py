"""Shared test helpers: the real data files the tests read (tests/assets, see the README there), the
tiny checkpoints built from them, and running the real CLI in several processes on 127.0.0.1."""

import csv
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# Under pytest-xdist (the README's test command runs two workers, one per core) each worker computes
# on one thread: two workers of two threads each would oversubscribe the cores. Set before torch is
# imported, so that the processes a test starts inherit it too.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    # inductor compiles in this process instead of starting a pool of worker processes, each of
    # which imports torch again (about 2 s of CPU apiece, 10 for the compile tests' fixture alone)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # also where a plugin imported torch before this file

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


@pytest.fixture(scope="session")
def bf16_base(base, tmp_path_factory) -> Path:
    """The session's tiny random Llama, saved by transformers in bfloat16 and converted."""
    from transformers import LlamaForCausalLM

    from toolkit.convert import convert_from_hf
    from toolkit.model_dir import stored_dtype

    root = tmp_path_factory.mktemp("bf16")
    hf_dir = root / "hf"
    LlamaForCausalLM.from_pretrained(base["hf_dir"], dtype=torch.bfloat16).save_pretrained(hf_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(base["hf_dir"] / name, hf_dir / name)
    checkpoint = root / "checkpoint"
    convert_from_hf(hf_dir, checkpoint)
    assert stored_dtype(checkpoint) == "bfloat16"
    return checkpoint


def scale_weights_in_place(path: Path, factor: float) -> None:
    """Every floating-point weight of a safetensors file times `factor`, written over its own bytes:
    header, layout and size stay as they were (a fine-tuned sibling of the same model)."""
    import struct

    data = bytearray(path.read_bytes())
    length = struct.unpack("<Q", data[:8])[0]
    layout = json.loads(data[8:8 + length])
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    for name, entry in layout.items():
        if name == "__metadata__" or entry["dtype"] not in dtypes:
            continue
        start, stop = (8 + length + offset for offset in entry["data_offsets"])
        tensor = torch.frombuffer(bytes(data[start:stop]), dtype=dtypes[entry["dtype"]]) * factor
        data[start:stop] = tensor.view(torch.uint8).numpy().tobytes()
    path.write_bytes(bytes(data))


@pytest.fixture(scope="session")
def sums(tmp_path_factory) -> Path:
    """64 short instruction records ("Add 3 and 4." -> "7"), generated."""
    path = tmp_path_factory.mktemp("data") / "sums.json"
    records = [{"instruction": f"Add {a} and {b}.", "input": "", "output": str(a + b)} for a in range(8) for b in range(8)]
    path.write_text(json.dumps(records))
    return path


# ------------------------------------------------------------------ the CLI in real processes
REPO = _REPO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env() -> dict:
    """One thread per process (runs are then bit-reproducible on CPU), rendezvous on 127.0.0.1."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env.pop("LOCAL_RANK", None)
    return env


def run_toolkit(args: list[str]) -> str:
    """`toolkit <args>` in a subprocess (it launches its own extra processes for --devices N); its stdout."""
    result = subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True, env=launch_env(),
                            timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def load_script(path: Path):
    """A tests/scripts program imported as a module, to call its one-process entry in this process:
    no interpreter to start and nothing to import again (several ranks need processes of their own)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"test_script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_as_group(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)` in a session
    of its own: past `timeout` the whole process group (a launcher and the ranks it started) is
    killed, not its first process alone, so a run that hangs leaves no ranks behind to hold the
    cores for the rest of the suite. TimeoutExpired is raised as subprocess.run raises it."""
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                               **kwargs)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(process.pid)
        process.communicate()
        raise
    return subprocess.CompletedProcess(cmd, process.returncode, out, err)


def kill_group(pid: int) -> None:
    """SIGKILL to the process group led by `pid` (started with start_new_session=True), if any of it is left."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def torchrun_nodes(args: list[str], nodes: int, per_node: int) -> list[str]:
    """`toolkit <args>` under torchrun, as `nodes` machines of `per_node` processes; each node's output."""
    port, env = free_port(), launch_env()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc_per_node={per_node}",
             f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}", "-m", "toolkit", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
        )
        for node in range(nodes)
    ]
    outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out[-5000:]
    return outputs


# A byte-level BPE of 512 tokens trained on tinyshakespeare (`toolkit.tokenizer.train_bpe_tokenizer`,
# tests/assets/README.md), and the model vocabulary to go with it. The multi-process pretraining
# tests use them: with GPT-NeoX's 50,304 tokens, the embedding and head were 98% of debug-neox, and
# every FSDP gather, AdamW step and checkpoint of those runs moved them (0.4 s a step, 0.07 s now).
SMALL_VOCAB = ["--tokenizer_dir", str(ASSETS / "tokenizers" / "shakespeare-bpe-512"), "--model_overrides", "{vocab_size: 512}"]


def tiny_pretrain_args(out_dir: Path, steps: int) -> list[str]:
    """`toolkit pretrain` arguments of the tests' tiny run: debug-neox with a 512-token vocabulary on
    tinyshakespeare, 32-true, micro-batch 2 of 32 tokens, global batch 4, a checkpoint every 2 steps,
    no validation. Tests append what they vary (learning rate, loggers, --resume ...)."""
    return [
        "pretrain", "debug-neox", "--out_dir", str(out_dir),
        "--data", "TextFiles", "--data.train_path", str(ASSETS / "tinyshakespeare.txt"),
        "--data.cache_dir", str(out_dir.parent / "data_cache"), *SMALL_VOCAB,
        "--precision", "32-true", "--train.micro_batch_size", "2", "--train.global_batch_size", "4",
        "--train.max_seq_length", "32", "--train.max_steps", str(steps), "--train.save_interval", "2",
        "--train.warmup_steps", "2", "--eval.interval", "1000", "--eval.final_validation", "false",
    ]


def kill_group_at_step(cmd: list[str], step: int) -> str:
    """Run `cmd` and SIGKILL its whole process group (launcher and workers, as a crashed node) when
    it reports optimizer step `step`; what it wrote until then (stdout and stderr)."""
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=launch_env(),
                               start_new_session=True, cwd=REPO)
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if line.startswith(f"step {step}/"):
                os.killpg(process.pid, signal.SIGKILL)
                break
        process.wait(timeout=600)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == -signal.SIGKILL, f"the run ended before step {step}"
    return "".join(lines)


def logged_metrics(out_dir: Path) -> list[dict]:
    """Every row of a run's CSV log, over the version_N folders of successive (resumed) starts, in order."""
    rows = []
    versions = sorted((Path(out_dir) / "logs" / "csv").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    for version in versions:
        if (version / "metrics.csv").exists():
            with open(version / "metrics.csv") as f:
                rows.extend(csv.DictReader(f))
    return rows


def logged_val_losses(out_dir: Path) -> list[float]:
    """The validation losses a run logged, in order."""
    return [float(row["val/loss"]) for row in logged_metrics(out_dir) if row.get("val/loss")]


def data_from_cli(args: list[str]):
    """The `--data ...` options parsed and instantiated as the fine-tuning commands do (jsonargparse
    chooses the InstructData subclass and fills its fields)."""
    from typing import Optional

    from jsonargparse import ArgumentParser

    from toolkit.data.instruct import InstructData

    def finetune(data: Optional[InstructData] = None) -> None:
        """Stand-in for a fine-tuning entry point."""

    parser = ArgumentParser(exit_on_error=False)
    parser.add_function_arguments(finetune)
    return parser.instantiate(parser.parse_args(args)).data


def fit_on_one_cpu(model, objective, train_batches: list, val_batches: list, log_dir: Path, *, micro: int,
                   accumulation: int, seq: int, steps: int, lr: float):
    """The training loop's `fit` on one CPU process with SGD (an update proportional to the gradient,
    so a wrong loss scale shows), no clipping, a constant rate, validation and a CSV row every step;
    returns the set-up model and the logged rows."""
    from lightning_fabric import Fabric
    from lightning_fabric.loggers import CSVLogger

    from toolkit.args import EvalArgs, LogArgs, TrainArgs
    from toolkit.parallel.batches import plan_batches
    from toolkit.training.loop import LoopHooks, TrainState, fit

    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true", loggers=CSVLogger(log_dir / "logs", name="csv"))
    module = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(module.parameters(), lr=lr))
    train = TrainArgs(micro_batch_size=micro, global_batch_size=micro * accumulation, max_steps=steps,
                      learning_rate=lr, lr_schedule="constant", warmup_steps=0, max_norm=None)
    plan = plan_batches(1, 1, micro, micro * accumulation, seq)
    state = fit(fabric, module, optimizer, train_batches, val_batches, plan, TrainState(), train,
                EvalArgs(interval=1, max_iters=2), LogArgs(interval=1, loggers=()), LoopHooks(),
                total_steps=steps, tokens_per_step=None, objective=objective)
    assert state.step == steps
    fabric.logger.finalize("success")
    return module, logged_metrics(log_dir)


def run_in_process(args: list[str]) -> str:
    """`toolkit <args>` on one device in this process (no interpreter start, no imports to repeat): its
    stdout. On one thread, as run_toolkit's processes compute, so that its numbers equal theirs bit for
    bit whatever this process's thread count; the count is restored afterwards. Not for what is about
    processes (exit codes, stderr lines, signals, several ranks): run_toolkit runs those."""
    import contextlib
    import io

    from toolkit.cli import run

    threads, stdout = torch.get_num_threads(), io.StringIO()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(stdout):
            code = run(args)
    finally:
        torch.set_num_threads(threads)
    assert code == 0, stdout.getvalue()[-3000:]
    return stdout.getvalue()
