"""Resuming on another number of processes (resharding), and checksums verified by all ranks together.

A run killed after some steps on N CPU processes (gloo, 127.0.0.1) and resumed on M must end with
the weights of an uninterrupted run: the global batch and its samples do not depend on the number
of processes, so only the summation order differs (32-true: within 1e-5). The learning rate is
modest because Adam turns pure rounding noise in a gradient into an update of up to the learning
rate (see test_distributed_train.py): at 0.002, four processes already drift 1.2e-5 from one in
lm_head after 4 steps, resumed or not, and at 0.001 one rarely seen embedding entry (whose gradient
sits near AdamW's eps) differed by 1.8e-5 while every other weight agreed to 7e-7. A resharding
mistake moves many weights by about the learning rate (3e-4 here). Single-threaded (OMP_NUM_THREADS=1), see test_resume.py.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ASSETS, SMALL_VOCAB, kill_group_at_step, launch_env, run_in_process

STEPS = 4
KILL_AT = 3  # a checkpoint at every step: those of steps 1 and 2 exist by then, 3 may or may not
TOLERANCE = 1e-5
TOKENIZER = ASSETS / "tokenizers" / "shakespeare-bpe-512"  # conftest.SMALL_VOCAB


def _cmd(out_dir: Path, devices: int, *data: str) -> list[str]:
    return [sys.executable, "-m", "toolkit", *_args(out_dir, devices, *data)]


def _args(out_dir: Path, devices: int, *data: str) -> list[str]:
    data = data or ("--data", "TextFiles", "--data.train_path", str(ASSETS / "tinyshakespeare.txt"),
                    "--data.cache_dir", str(out_dir.parent / "cache"))
    return [
        "pretrain", "debug-neox", "--out_dir", str(out_dir), *data,
        *SMALL_VOCAB, "--devices", str(devices),
        "--precision", "32-true", "--train.micro_batch_size", "2", "--train.global_batch_size", "8",
        "--train.max_seq_length", "32", "--train.max_steps", str(STEPS), "--train.save_interval", "1",
        "--train.warmup_steps", "1", "--train.learning_rate", "0.0003",
        "--eval.interval", "1000", "--eval.final_validation", "false", "--log.interval", "1",
        "--log.loggers", "[csv]", "--resume", "auto",
    ]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, env=launch_env(), timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def _assert_close_to(reference: Path, out: Path) -> None:
    a, b = load_file(str(reference / "final" / "model.safetensors")), load_file(str(out / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=TOLERANCE, rtol=0, msg=name)


def _damage(path: Path) -> None:
    """Flip bytes in the middle of a file, keeping its size: only the checksum can tell."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """An uninterrupted one-process run (in this process), and a two-process run killed at step KILL_AT."""
    root = tmp_path_factory.mktemp("reshard")
    run_in_process(_args(root / "reference", 1))
    kill_group_at_step(_cmd(root / "two", 2), KILL_AT)
    assert (_checkpoints(root / "two")[-1] / "state" / "__1_0.distcp").is_file()  # sharded
    return {"root": root, "reference": root / "reference", "two": root / "two"}


def _checkpoints(out: Path) -> list[Path]:
    """Completed checkpoints, oldest first (the kill may land before or after the save of step KILL_AT)."""
    found = sorted(p for p in (out / "checkpoints").iterdir() if not p.name.endswith(".tmp"))
    assert len(found) == 2, found  # keep_last
    return found


def test_two_processes_killed_then_resumed_on_one_past_a_damaged_shard(runs):
    out = runs["root"] / "two-to-one"
    shutil.copytree(runs["two"], out)
    previous, newest = _checkpoints(out)
    _damage(newest / "state" / "__1_0.distcp")
    result = _run(_cmd(out, 1))
    assert f"{newest.name} is not usable: state/__1_0.distcp is corrupted (checksum mismatch)" in result.stdout
    assert f"Resharded {previous.name}: saved by 2 process(es), resuming on 1" in result.stdout
    step = int(previous.name.split("-")[1])
    assert f"num_samples_yielded={8 * step}" in result.stdout  # global blocks: steps x global batch
    _assert_close_to(runs["reference"], out)


def test_one_process_killed_then_resumed_on_two_which_verify_together(runs):
    """rank-0.pt is small, so rank 1 checks it (rank 0 takes state.pt): its finding reaches every rank."""
    out = runs["root"] / "one-to-two"
    kill_group_at_step(_cmd(out, 1), KILL_AT)
    previous, newest = _checkpoints(out)
    _damage(newest / "rank-0.pt")
    result = _run(_cmd(out, 2))
    assert f"{newest.name} is not usable: rank-0.pt is corrupted (checksum mismatch)" in result.stdout
    assert f"Resharded {previous.name}: saved by 1 process(es), resuming on 2" in result.stdout
    _assert_close_to(runs["reference"], out)


@pytest.mark.slow  # four processes: about a minute on 2 busy cores
def test_two_processes_resumed_on_four(runs):
    out = runs["root"] / "two-to-four"
    shutil.copytree(runs["two"], out)
    newest = _checkpoints(out)[-1]
    result = _run(_cmd(out, 4))
    assert f"Resharded {newest.name}: saved by 2 process(es), resuming on 4" in result.stdout
    _assert_close_to(runs["reference"], out)


def test_a_per_process_data_position_refuses_another_number_of_processes(tmp_path):
    """StreamMix: litdata shards the streams per process, so the position cannot be mapped."""
    from toolkit.data.streams import optimize_text_to_stream
    from toolkit.tokenizer import Tokenizer

    stream = optimize_text_to_stream(ASSETS / "tinyshakespeare.txt", Tokenizer(TOKENIZER), tmp_path / "stream")
    out = tmp_path / "mix"
    data = ("--data", "StreamMix", "--data.train_streams", f"[{stream}]")
    args = _args(out, 1, *data)
    args[args.index("--train.max_steps") + 1] = "2"
    run_in_process(args)  # the one-process run that saves, in this process: the refusal is a process's
    saved = sorted(p.relative_to(out) for p in (out / "checkpoints").rglob("*"))
    result = subprocess.run(_cmd(out, 2, *data), capture_output=True, text=True, env=launch_env(), timeout=600)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if "Cannot resume" in line]
    assert lines and "saved by 1" in lines[0] and "Resume on 1 process(es)" in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert sorted(p.relative_to(out) for p in (out / "checkpoints").rglob("*")) == saved  # nothing written


# ------------------------------------------------------------------ data positions, in one process


def test_text_files_position_moves_between_two_processes_and_one(tmp_path):
    """Each rank of two keeps its rows of global micro-batches; the position carries over both ways."""
    from toolkit.data.streams import TextFiles
    from toolkit.tokenizer import Tokenizer

    data = TextFiles(train_path=ASSETS / "tinyshakespeare.txt", cache_dir=tmp_path / "cache")
    data.prepare(Tokenizer(TOKENIZER), 33, tmp_path)

    def loaders(world: int) -> list:
        return [data.train_dataloader(2, 33, seed=7, rank=r, world_size=world) for r in range(world)]

    one = iter(loaders(1)[0])
    reference = [next(one)["input_ids"] for _ in range(12)]  # micro-batches of 2 rows
    two = loaders(2)
    rows = [[next(it)["input_ids"] for _ in range(3)] for it in map(iter, two)]
    for j in range(3):  # global micro-batch j = rank 0's rows, then rank 1's
        assert torch.equal(torch.cat([rows[0][j], rows[1][j]]), torch.cat(reference[2 * j : 2 * j + 2]))

    resumed = loaders(1)[0]
    resumed.load_state_dict(two[1].state_dict())  # 2 -> 1
    it = iter(resumed)
    assert all(torch.equal(next(it)["input_ids"], reference[j]) for j in range(6, 10))
    again = loaders(2)  # 1 -> 2, from the one-process loader at micro-batch 10
    for loader in again:
        loader.load_state_dict(resumed.state_dict())
    rank0, rank1 = (next(iter(loader))["input_ids"] for loader in again)
    assert torch.equal(torch.cat([rank0, rank1]), torch.cat(reference[10:12]))


def test_instruction_position_moves_between_world_sizes_exactly():
    from toolkit.data.instruct import InstructLoader, TokenizedSamples

    g = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 100, (int(n),), generator=g).tolist() for n in torch.randint(4, 30, (70,), generator=g)]
    samples = TokenizedSamples(sequences, [1] * len(sequences))

    def loader(rank: int, world: int) -> InstructLoader:
        return InstructLoader(samples, 2, shuffle=True, seed=3, rank=rank, world_size=world, step_batch_size=8)

    def step_samples(loaders: list, steps: int) -> list[set]:
        """The sample indices of each of the next `steps` optimizer steps (8 samples, all ranks together)."""
        its = [iter(x) for x in loaders]
        accumulation = 8 // (2 * len(loaders))
        out = []
        for _ in range(steps):
            rows = [next(it)["input_ids"] for it in its for _ in range(accumulation)]
            out.append(sorted(tuple(r[r != 0].tolist()) for batch in rows for r in batch))
        return out

    whole = step_samples([loader(0, 1)], 8)  # 8 steps = one epoch of 64 samples (70 // 8 * 8)
    for saved_world, resumed_world in ((2, 1), (1, 2), (2, 4), (4, 2)):
        first = [loader(r, saved_world) for r in range(saved_world)]
        assert step_samples(first, 3) == whole[:3]
        then = [loader(r, resumed_world) for r in range(resumed_world)]
        for x in then:
            x.load_state_dict(first[0].state_dict())
        assert step_samples(then, 5) == whole[3:], (saved_world, resumed_world)


class _EmulatedCudaRng:
    """torch.cuda's RNG functions on a host that shows `visible` GPUs, this rank on `current`.

    Each device holds its own state; naming a device that is not visible raises as CUDA does.
    Only torch.cuda is replaced (availability, device count and the RNG get/set functions)."""

    def __init__(self, monkeypatch, visible: int, current: int) -> None:
        import torch.cuda.random as cuda_random

        self.visible, self.current = visible, current
        self.states = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(visible)}
        self.set_calls: list[int] = []
        for module in (torch.cuda, cuda_random):
            monkeypatch.setattr(module, "get_rng_state", self.get, raising=False)
            monkeypatch.setattr(module, "set_rng_state", self.set, raising=False)
            monkeypatch.setattr(module, "device_count", lambda: visible, raising=False)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: current)

    def _index(self, device) -> int:
        index = self.current if device in ("cuda", None) else int(str(device).removeprefix("cuda:"))
        if index >= self.visible:
            raise IndexError(f"CUDA device {index} is not visible ({self.visible} devices)")
        return index

    def get(self, device="cuda"):
        return self.states[self._index(device)].clone()

    def set(self, state, device="cuda"):
        index = self._index(device)
        self.set_calls.append(index)
        self.states[index] = state.clone()


def test_cuda_rng_state_is_this_devices_and_resumes_on_a_host_with_fewer_gpus(monkeypatch):
    """Saved on rank 5 of an 8-GPU host, resumed as rank 1 of a 4-GPU host (the 8 -> 4 reshard)."""
    from toolkit.training.checkpoint import rng_state, set_rng_state

    on_eight = _EmulatedCudaRng(monkeypatch, visible=8, current=5)
    saved = rng_state()
    assert torch.is_tensor(saved["cuda"]) and torch.equal(saved["cuda"], on_eight.states[5])  # one state, not 8

    on_four = _EmulatedCudaRng(monkeypatch, visible=4, current=1)
    set_rng_state(saved)
    assert on_four.set_calls == [1] and torch.equal(on_four.states[1], on_eight.states[5])

    # A checkpoint of the former format: every visible device's state, 8 of them.
    on_four = _EmulatedCudaRng(monkeypatch, visible=4, current=1)
    old = dict(saved, cuda=[torch.full((16,), 100 + i, dtype=torch.uint8) for i in range(8)])
    set_rng_state(old)
    assert on_four.set_calls == [1] and torch.equal(on_four.states[1], old["cuda"][1])
