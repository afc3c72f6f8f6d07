"""`toolkit pretrain` end to end on one device: real Fabric, real litdata, real tokenizers."""

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.cli import run

from conftest import ASSETS, logged_metrics, logged_val_losses

NEOX_TOKENIZER = ASSETS / "tokenizers" / "gpt-neox-20b"
SHAKESPEARE = ASSETS / "tinyshakespeare.txt"


def _pretrain_args(out_dir: Path, *extra: str) -> list[str]:
    return [
        "pretrain", "debug-neox", "--out_dir", str(out_dir),
        "--data", "TextFiles", "--data.train_path", str(SHAKESPEARE),
        "--tokenizer_dir", str(NEOX_TOKENIZER),
        "--train.micro_batch_size", "4", "--train.global_batch_size", "8", "--train.max_seq_length", "64",
        "--train.learning_rate", "0.01", "--train.min_lr", "0.001", "--train.warmup_steps", "2",
        "--train.save_interval", "1000",
        "--eval.max_iters", "4", "--log.interval", "1", "--log.loggers", "[csv]",
        *extra,
    ]


def test_pretraining_on_shakespeare_lowers_validation_loss_and_stops_exactly(tmp_path, capsys):
    out = tmp_path / "run"
    assert run(_pretrain_args(out, "--train.max_steps", "25", "--eval.interval", "25", "--eval.initial_validation", "true")) == 0

    val = logged_val_losses(out)
    assert len(val) == 2
    assert val[-1] < val[0] - 1.0, val  # from ~10.8 (uniform over 50k tokens) to well below

    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 25
    assert summary["tokens_seen"] == 25 * 8 * 64
    # The final checkpoint is self-contained: generate reads it with its own tokenizer.
    final = out / "final"
    assert {"model.safetensors", "model_config.json", "tokenizer.json"} <= {p.name for p in final.iterdir()}
    assert run(["generate", str(final), "--prompt", "ROMEO:", "--max_new_tokens", "5", "--temperature", "0"]) == 0
    assert run(["generate", str(final), "--prompt", "Name a king.", "--prompt_style", "alpaca", "--max_new_tokens", "3"]) == 0

    # Continued pretraining starts from those weights: its first validation is the trained model's.
    again = tmp_path / "continued"
    assert run(_pretrain_args(again, "--initial_checkpoint_dir", str(final), "--train.max_steps", "1",
                              "--eval.initial_validation", "true", "--eval.final_validation", "false")) == 0
    first_val = logged_val_losses(again)[0]
    assert abs(first_val - val[-1]) < 1e-3, (first_val, val[-1])
    # Another preset named beside the checkpoint is refused, not silently replaced by the checkpoint's model.
    capsys.readouterr()
    other = _pretrain_args(tmp_path / "other", "--initial_checkpoint_dir", str(final), "--train.max_steps", "1")
    other[1] = "pythia-14m"
    assert run(other) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pythia-14m is not the model of --initial_checkpoint_dir" in err[0], err
    assert not (tmp_path / "other").exists()


def _step_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]


def test_max_tokens_stops_before_exceeding_the_budget(tmp_path, capsys):
    out = tmp_path / "run"
    tokens_per_step = 8 * 64
    budget = 3 * tokens_per_step + 100  # not a whole number of steps: 3 steps fit, a 4th would exceed
    assert run(_pretrain_args(out, "--train.max_tokens", str(budget), "--eval.final_validation", "false")) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 3
    assert summary["tokens_seen"] == 3 * tokens_per_step <= budget
    # The run knows its length: every step line says how long it has run and about how long is left.
    lines = _step_lines(capsys)
    assert [line.split(" |")[0] for line in lines] == ["step 1/3", "step 2/3", "step 3/3"]
    assert all(re.search(r"\| \d+:\d\d elapsed, \d+:\d\d left$", line) for line in lines), lines
    assert lines[-1].endswith(", 0:00 left")
    # Two warmup steps reach the peak, and the cosine decay ends at min_lr on the last step.
    rates = [float(row["train/lr"]) for row in logged_metrics(out) if row.get("train/lr")]
    assert rates == pytest.approx([0.005, 0.01, 0.001], rel=1e-9), rates


def test_max_time_stops_at_a_step_boundary(tmp_path, capsys):
    out = tmp_path / "run"
    assert run(_pretrain_args(out, "--train.max_time", "1s", "--train.max_steps", "10000", "--eval.final_validation", "false")) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert 1 <= summary["step"] < 10000
    assert summary["train_seconds"] >= 1.0
    assert all(re.search(r"\| \d+:\d\d elapsed, 0:0[01] left$", line) for line in _step_lines(capsys))


def _toolkit(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def _assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    error_lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(error_lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in error_lines[0], error_lines[0]


def _toolkit_in_process(capfd, *args: str) -> subprocess.CompletedProcess:
    """`toolkit *args` through the CLI's own entry (`run`) in this process, its output captured at
    the file descriptors: the same exit code and lines as the command, without a start-up each."""
    capfd.readouterr()
    code = run(list(args))
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["toolkit", *args], code, out, err)


def test_bad_input_gets_one_clear_line(tmp_path, capfd):
    """Every refusal before any process starts (end to end as a command: the next test)."""
    _toolkit = functools.partial(_toolkit_in_process, capfd)
    text = tmp_path / "corpus.txt"
    text.write_text("hello world\n" * 50)
    base = ["--tokenizer_dir", str(NEOX_TOKENIZER), "--out_dir", str(tmp_path / "out")]

    _assert_one_line_error(_toolkit("pretrain", "pythia-14n", "--data", "TextFiles", "--data.train_path", str(text), *base), "Did you mean", "pythia-14m")
    _assert_one_line_error(_toolkit("pretrain", "debug-neox", "--data", "TextFiles", "--data.train_path", str(tmp_path / "missing.txt"), *base), "missing.txt")
    empty = tmp_path / "empty"
    empty.mkdir()
    _assert_one_line_error(_toolkit("pretrain", "debug-neox", "--data", "TextFiles", "--data.train_path", str(empty), *base), "empty")
    binary = tmp_path / "weights.txt"
    binary.write_bytes(bytes(range(256)) * 40)
    _assert_one_line_error(_toolkit("pretrain", "debug-neox", "--data", "TextFiles", "--data.train_path", str(binary), *base), "weights.txt")
    bad_tokenizer = tmp_path / "tok"
    bad_tokenizer.mkdir()
    (bad_tokenizer / "tokenizer.json").write_text("{not json")
    _assert_one_line_error(
        _toolkit("pretrain", "debug-neox", "--data", "TextFiles", "--data.train_path", str(text), "--tokenizer_dir", str(bad_tokenizer), "--out_dir", str(tmp_path / "o2")),
        "tokenizer",
    )
    _assert_one_line_error(
        _toolkit("pretrain", "debug-neox", "--data", "TextFiles", "--data.train_path", str(text), "--train.max_seq_length", "4096", *base),
        "max_seq_length", "512",
    )
    _assert_one_line_error(
        _toolkit("pretrain", "debug-neox", "--data", "TextFiles", "--data.train_path", str(text), "--train.max_tokens", "1000",
                 "--train.global_batch_size", "4", "--train.micro_batch_size", "2", "--train.max_seq_length", "512", *base),
        "max_tokens 1,000 is less than one optimizer step (2,048 tokens",
    )
    _assert_one_line_error(_toolkit("pretrain", "debug-neox", "--train.micro_batch_sise", "2", *base), "micro_batch_size")
    _assert_one_line_error(_toolkit("pretrian"), "pretrain")
    _assert_one_line_error(_toolkit("pretrain", "debug-neox", *base), "--data")
    assert not (tmp_path / "out").exists()  # nothing was written by any of the failures


def test_an_output_directory_holding_another_run_is_refused(tmp_path):
    out = tmp_path / "out"
    (out / "final").mkdir(parents=True)
    (out / "final" / "model.safetensors").write_bytes(b"precious")
    text = tmp_path / "corpus.txt"
    text.write_text("hello world\n" * 50)
    result = _toolkit("pretrain", "debug-neox", "--data", "TextFiles", "--data.train_path", str(text), "--tokenizer_dir", str(NEOX_TOKENIZER), "--out_dir", str(out))
    _assert_one_line_error(result, "already holds a run", "--resume")
    assert (out / "final" / "model.safetensors").read_bytes() == b"precious"


def test_toolkit_help_lists_commands_without_importing_torch():
    code = "import sys; from toolkit.cli import run; run(['--help']); assert 'torch' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "pretrain" in result.stdout and "generate" in result.stdout


REPO = Path(__file__).resolve().parents[1]


def test_the_tinyllama_recipe_trains_on_locally_optimized_streams(tmp_path, capsys):
    """The real recipe (StreamMix of litdata streams) with local streams and a shrunken model."""
    from toolkit.data.streams import optimize_text_to_stream
    from toolkit.tokenizer import Tokenizer

    tokenizer = Tokenizer(ASSETS / "tokenizers" / "llama2")  # TinyLlama uses the Llama-2 tokenizer
    prose = optimize_text_to_stream(ASSETS / "tinyshakespeare.txt", tokenizer, tmp_path / "streams" / "prose")
    web = optimize_text_to_stream(ASSETS / "pretrain" / "c4_demo.jsonl", tokenizer, tmp_path / "streams" / "web")
    val = optimize_text_to_stream(ASSETS / "pretrain" / "tinystories_train_head_197k.txt", tokenizer, tmp_path / "streams" / "val")
    out = tmp_path / "run"
    args = [
        "pretrain", "--config", str(REPO / "config_hub" / "pretrain" / "tinyllama.yaml"),
        "--out_dir", str(out), "--tokenizer_dir", str(ASSETS / "tokenizers" / "llama2"),
        "--data.train_streams", f"[{prose}, {web}]", "--data.val_stream", str(val),
        "--devices", "1", "--precision", "32-true",
        "--model_overrides", "{n_layer: 2, n_embd: 64, n_head: 4, n_query_groups: 2, intermediate_size: 128}",
        "--train.micro_batch_size", "2", "--train.global_batch_size", "4", "--train.max_seq_length", "64",
        "--train.max_steps", "3", "--train.warmup_steps", "1", "--eval.interval", "3", "--eval.max_iters", "2",
        "--log.loggers", "[csv]", "--log.interval", "1",
    ]
    assert run(args) == 0
    assert json.loads((out / "summary.json").read_text())["step"] == 3
    losses = [float(r["train/loss"]) for r in logged_metrics(out) if r.get("train/loss")]
    assert losses and all(0 < x < 20 for x in losses)

    # The same streams under a model of 512 tokens (its own tokenizer fits it): the streams' Llama-2
    # ids are past its vocabulary, which ended in an IndexError inside the embedding.
    small = ["--tokenizer_dir", str(ASSETS / "tokenizers" / "shakespeare-bpe-512"), "--out_dir", str(tmp_path / "small"),
             "--model_overrides", "{n_layer: 1, n_embd: 64, n_head: 4, n_query_groups: 2, intermediate_size: 128, vocab_size: 512}"]
    assert run([*args, *small]) == 1
    assert "The training data holds token id" in capsys.readouterr().err


def test_the_tinyllama_recipe_without_streams_says_what_to_pass(tmp_path):
    result = _toolkit("pretrain", "--config", str(REPO / "config_hub" / "pretrain" / "tinyllama.yaml"),
                      "--out_dir", str(tmp_path / "out"), "--tokenizer_dir", str(ASSETS / "tokenizers" / "llama2"),
                      "--devices", "1", cwd=tmp_path)
    _assert_one_line_error(result, "data/slimpajama/train", "optimize_text_to_stream")
    assert not (tmp_path / "out").exists()
