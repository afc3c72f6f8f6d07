"""The command line: a misspelled option is named, and a value out of range is refused in one line
before anything starts or is written."""

from pathlib import Path

import pytest
from conftest import ASSETS, REPO

from toolkit.cli import run

NEOX = ASSETS / "tokenizers" / "gpt-neox-20b"
ALPACA = ASSETS / "instruct" / "alpaca_tiny.json"


def _one_error_line(capsys, argv: list[str]) -> str:
    assert run(argv) != 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture
def text(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("hello world\n" * 50)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny random model directory with the NeoX tokenizer."""
    import torch

    from toolkit.model_dir import save_checkpoint_files
    from toolkit.models.config import Config
    from toolkit.models.gpt import GPT

    config = Config.from_name("debug-neox", n_layer=1)
    path = tmp_path_factory.mktemp("checkpoint")
    torch.manual_seed(0)
    save_checkpoint_files(path, GPT(config).state_dict(), config, tokenizer_dir=NEOX)
    return path


def test_a_misspelled_option_is_named_and_not_a_valid_one(capsys, text):
    pretrain = ["pretrain", "pythia-14m", "--data", "TextFiles", "--data.train_path", str(text)]
    line = _one_error_line(capsys, [*pretrain, "--train.micro_batchsize", "2"])
    assert "Unknown option --train.micro_batchsize." in line and "Did you mean: --train.micro_batch_size" in line
    assert "--data.train_path" not in line
    # An option of the class chosen with --data: suggestions come from that class.
    line = _one_error_line(capsys, [*pretrain, "--data.val_fractio", "0.1"])
    assert "Unknown option --data.val_fractio for TextFiles" in line and "--data.val_fraction" in line
    # A valid option given before its class.
    line = _one_error_line(capsys, ["pretrain", "pythia-14m", "--data.train_path", str(text), "--data", "TextFiles"])
    assert "--data.train_path needs its class first" in line and "TextFiles" in line
    line = _one_error_line(capsys, ["finetune_lora", "x", "--lora.rr", "4"])
    assert "Unknown option --lora.rr." in line and "--lora.r" in line
    # A misspelled class name: the classes the option takes, and the nearest.
    line = _one_error_line(capsys, ["finetune_lora", "x", "--objective", "dpoo"])
    assert line.startswith("toolkit finetune_lora: error: Unknown --objective 'dpoo'; choose one of: "), line
    # (subclasses other tests of this process define may be listed too)
    assert all(f" {name}," in line for name in ("DPO", "IPO", "ORPO", "SFT", "SimPO")) and "Did you mean: DPO" in line, line
    line = _one_error_line(capsys, ["finetune_lora", "x", "--data=alpacaa"])
    assert "Unknown --data 'alpacaa'" in line and "Did you mean: Alpaca?" in line, line


def test_nan_and_infinity_on_the_command_line_are_named_as_not_finite(capsys, text):
    """jsonargparse refuses them as "Expected a <class 'float'>", as if they were not numbers; YAML's
    .nan and .inf reach the settings' own checks (the table below)."""
    pretrain = ["pretrain", "pythia-14m", "--data", "TextFiles", "--data.train_path", str(text)]
    line = _one_error_line(capsys, [*pretrain, "--train.learning_rate", "nan"])
    assert "--train.learning_rate must be a finite number, got nan." in line
    line = _one_error_line(capsys, [*pretrain, "--train.router_aux_loss_coef=inf"])  # Optional[float]
    assert "--train.router_aux_loss_coef must be a finite number, got inf." in line
    line = _one_error_line(capsys, [*pretrain, "--train.learning_rate", "fast"])  # not a number: as before
    assert "finite" not in line and "train.learning_rate" in line


def test_there_is_no_ignore_index_option(capsys, checkpoint):
    """The model and the loop skip the labels -100 only, so the data cannot be told to write another value."""
    args = ["finetune_full", str(checkpoint), "--data", "Alpaca", "--data.json_path", str(ALPACA), "--data.ignore_index", "-1"]
    assert "Unknown option --data.ignore_index for Alpaca" in _one_error_line(capsys, args)


@pytest.mark.parametrize(
    "option, value, fragment",
    [
        ("--train.learning_rate", "-0.001", "--train.learning_rate must be positive"),
        ("--train.min_lr", "-1e-5", "--train.min_lr must be between 0 and --train.learning_rate"),
        ("--train.min_lr", "0.1", "--train.min_lr must be between 0 and --train.learning_rate"),
        ("--train.warmup_steps", "-3", "--train.warmup_steps must be 0 or more"),
        ("--train.weight_decay", "-0.1", "--train.weight_decay must be 0 or more"),
        ("--train.beta1", "1.5", "--train.beta1 must be in [0, 1)"),
        ("--train.beta2", "-0.1", "--train.beta2 must be in [0, 1)"),
        ("--train.max_norm", "-1", "--train.max_norm must be positive"),
        ("--train.learning_rate", ".inf", "--train.learning_rate must be positive, got inf"),  # YAML's infinity
        ("--train.weight_decay", ".nan", "--train.weight_decay must be 0 or more, got nan"),
        ("--train.router_aux_loss_coef", ".inf", "--train.router_aux_loss_coef must be 0 or more (and finite), got inf"),
        ("--train.max_time", "0s", "--train.max_time must be a positive duration"),
        ("--eval.interval", "0", "--eval.interval must be at least 1"),
        ("--eval.max_iters", "0", "--eval.max_iters must be at least 1"),
        ("--log.interval", "0", "--log.interval must be at least 1"),
        ("--log.device_peak_flops", "-5", "--log.device_peak_flops must be positive"),
        ("--seed", "-1", "--seed must be between 0 and 4294967295"),
        ("--data.val_fraction", "0", "val_fraction must be between 0 and 1"),
        ("--model_overrides", "{norm_eps: -1.0}", "norm_eps must be positive"),
        ("--model_overrides", "{rope_base: 0}", "rope_base must be positive"),
        ("--train.router_aux_loss_coef", "0.1", "--train.router_aux_loss_coef set the losses of a mixture of experts' "
         "router, and debug-neox is dense (no MoE layer): drop them."),
        ("--train.router_aux_loss_per_layer", "true", "--train.router_aux_loss_per_layer set the losses"),
    ],
)
def test_pretraining_values_out_of_range_are_refused_up_front(capsys, tmp_path, text, option, value, fragment):
    out = tmp_path / "out"
    args = ["pretrain", "debug-neox", "--data", "TextFiles", "--data.train_path", str(text), "--tokenizer_dir", str(NEOX),
            "--out_dir", str(out), "--train.max_steps", "1", f"{option}={value}"]
    assert fragment in _one_error_line(capsys, args)
    assert not out.exists()


def test_training_a_tokenizer_too_small_is_refused_up_front(capsys, tmp_path, text):
    out = tmp_path / "out"
    args = ["pretrain", "debug", "--data", "TextFiles", "--data.train_path", str(text), "--train_tokenizer_vocab", "100",
            "--out_dir", str(out)]
    assert "--train_tokenizer_vocab must be at least 257" in _one_error_line(capsys, args)
    assert not out.exists()


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--lora.alpha", "0"], "--lora.alpha must be positive"),
        (["--lora.dropout", "1.5"], "--lora.dropout must be in [0, 1)"),
        (["--seed", "-7"], "--seed must be between 0"),
        (["--train.learning_rate", "0"], "--train.learning_rate must be positive"),
    ],
)
def test_finetuning_values_out_of_range_are_refused_up_front(capsys, tmp_path, checkpoint, extra, fragment):
    out = tmp_path / "out"
    args = ["finetune_lora", str(checkpoint), "--data", "Alpaca", "--data.json_path", str(ALPACA), "--out_dir", str(out), *extra]
    assert fragment in _one_error_line(capsys, args)
    assert not out.exists()


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--temperature", "-1"], "--temperature must be 0 (greedy) or more"),
        (["--top_k", "0"], "--top_k must be at least 1"),
        (["--top_p", "1.5"], "--top_p must be in (0, 1]"),
        (["--num_samples", "0"], "--num_samples must be at least 1"),
        (["--seed", str(2**40)], "--seed must be between 0"),
    ],
)
def test_sampling_values_out_of_range_are_refused(capsys, checkpoint, extra, fragment):
    assert fragment in _one_error_line(capsys, ["generate", str(checkpoint), "--prompt", "a", *extra])


def test_output_cut_short_by_its_reader_is_no_traceback():
    import subprocess
    import sys

    # `true` exits without reading: every write of the listing meets a closed pipe
    result = subprocess.run(f"{sys.executable} -m toolkit list | true", shell=True, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr


def test_environment_defaults_fill_in_and_keep_what_the_user_set():
    from toolkit.cli import set_environment_defaults

    fresh: dict = {}
    set_environment_defaults(fresh)
    assert fresh == {"TOKENIZERS_PARALLELISM": "false", "LRU_CACHE_CAPACITY": "16"}
    chosen = {"LRU_CACHE_CAPACITY": "1024"}
    set_environment_defaults(chosen)
    assert chosen["LRU_CACHE_CAPACITY"] == "1024" and chosen["TOKENIZERS_PARALLELISM"] == "false"


def test_the_process_ends_with_its_code_after_threads_exit_handlers_and_buffered_output(tmp_path):
    """`end_process` skips only the interpreter's module teardown: a thread still writing finishes,
    the atexit handlers run, output still in the buffers is written, and the exit code is the command's."""
    import subprocess
    import sys

    marker = tmp_path / "written"
    code = (
        "import atexit, sys, threading, time\n"
        "from toolkit.cli import end_process\n"
        f"def late(): time.sleep(0.3); open({str(marker)!r}, 'w').write('thread')\n"
        "threading.Thread(target=late).start()\n"
        "atexit.register(lambda: sys.stdout.write('atexit ran\\n'))\n"
        "sys.stdout.write('buffered')\n"  # no newline, into a pipe: stays in the buffer until flushed
        "sys.stderr.write('error line')\n"
        "end_process(3)\n"
        "sys.stdout.write('never')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 3
    assert result.stdout == "bufferedatexit ran\n" and result.stderr == "error line"
    assert marker.read_text() == "thread"


def test_the_process_ends_with_an_idle_thread_pool_alive():
    """Inductor compiles on a thread pool whose idle workers stop only when the interpreter's
    thread-shutdown hooks tell them to: a compiled run with a cold cache hung after its work when
    `end_process` joined the threads first. A pool that has run a task and sits idle must not keep
    the process alive."""
    import subprocess
    import sys

    code = (
        "from concurrent.futures import ThreadPoolExecutor\n"
        "from toolkit.cli import end_process\n"
        "pool = ThreadPoolExecutor(2)\n"
        "print(pool.submit(sum, [1, 2]).result())\n"
        "end_process(0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout == "3\n", result.stderr[-2000:]


def test_importing_peft_through_the_cli_prints_no_import_noise():
    """peft imports torchao and bitsandbytes when they are installed; their import-time warnings
    (kernels for other hardware, an optional package, pytree notices) are not printed by a LoRA run."""
    import subprocess
    import sys

    code = ("from toolkit.cli import _show_toolkit_logs; _show_toolkit_logs(); import peft, sys; "
            "assert 'torchao' in sys.modules and 'bitsandbytes' in sys.modules")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    for noise in ("Failed to load", "is an Enum subclass"):
        assert noise not in result.stderr, result.stderr[-2000:]


def test_list_groups_the_presets_by_family(capsys):
    from toolkit.models.presets import PRESETS, find_preset

    assert run(["list", "--hf", "true"]) == 0
    groups: dict[str, list[str]] = {}
    for line in capsys.readouterr().out.splitlines():
        if line and not line.startswith(" "):
            assert line not in groups, f"group {line!r} printed twice"
            title = line
            groups[title] = []
        elif line:
            groups[title].append(line.split()[0])
    listed = [name for names in groups.values() for name in names]
    assert sorted(listed) == sorted(p["name"] for p in PRESETS)  # each preset once
    families = []
    for title, names in groups.items():
        presets = [find_preset(n) for n in names]
        if all(p.get("hf_repo_id") for p in presets):  # a family group: one family
            kinds = {p.get("family", "llama") for p in presets}
            assert len(kinds) == 1, title
            families += kinds
        else:  # the tiny models mirror no repository
            assert not any(p.get("hf_repo_id") for p in presets), title
    assert len(families) == len(set(families))  # no family split over two groups
    assert groups["Qwen3"] == ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b"]
    assert groups["OLMo 2"] == ["olmo-2-1b", "olmo-2-7b", "olmo-2-13b", "olmo-2-32b"]


def test_a_checkpoint_given_before_the_recipe_wins_over_the_recipes(capsys, tmp_path):
    """`toolkit finetune_lora CKPT --config recipe.yaml`: the recipe names its own checkpoint_dir, and
    jsonargparse lets a file override what comes before it; the positional argument is the user's
    choice wherever it stands. An option before --config is still overridden by the file."""
    recipe = Path(__file__).resolve().parents[1] / "config_hub" / "finetune" / "qwen3-30b-a3b" / "lora.yaml"
    mine = tmp_path / "my-checkpoint"
    for argv in (["finetune_lora", str(mine), "--config", str(recipe)],
                 ["finetune_lora", str(mine), f"--config={recipe}", "--devices", "1"],
                 ["finetune_lora", "--config", str(recipe), str(mine)],
                 ["finetune_lora", "--devices", "1", str(mine), "--config", str(recipe)]):
        line = _one_error_line(capsys, argv)
        assert str(mine) in line and "Qwen3-30B-A3B" not in line, line
    # an option before the file: the file's value (8 devices) wins, as documented
    from toolkit.cli import positional_after_config

    assert positional_after_config(["ckpt", "--devices", "2", "--config", "r.yaml", "--lr", "1"]) == [
        "--devices", "2", "--config", "r.yaml", "ckpt", "--lr", "1"]
    # two positionals (convert_from_hf IN OUT) keep their order
    assert positional_after_config(["in", "out", "--config=c.yaml", "--dtype", "bf16"]) == [
        "--config=c.yaml", "in", "out", "--dtype", "bf16"]
    assert positional_after_config(["in", "out"]) == ["in", "out"]
    # after the last of several files, each of which overrides what precedes it
    assert positional_after_config(["ckpt", "--config", "a.yaml", "--x", "1", "--config", "b.yaml"]) == [
        "--config", "a.yaml", "--x", "1", "--config", "b.yaml", "ckpt"]
    # a positional among the options before the file, told from the options' values
    assert positional_after_config(["--devices", "2", "ckpt", "--seed", "-1", "--config", "r.yaml", "--x", "1"]) == [
        "--devices", "2", "--seed", "-1", "--config", "r.yaml", "ckpt", "--x", "1"]
    assert positional_after_config(["--devices=2", "ckpt", "--config", "r.yaml"]) == ["--devices=2", "--config", "r.yaml", "ckpt"]
    assert positional_after_config(["--devices", "2", "--config", "r.yaml", "ckpt"]) == [
        "--devices", "2", "--config", "r.yaml", "ckpt"]


def test_print_config_shows_what_follows_the_recipe(tmp_path, capsys):
    """--print_config anywhere shows the whole line's configuration: the checkpoint and options given
    around a recipe included (jsonargparse alone prints on reaching a --config after it)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("checkpoint_dir: checkpoints/from/recipe\nseed: 3\n")
    mine = tmp_path / "mine"
    for argv in (["finetune_lora", "--print_config", str(mine), "--config", str(recipe), "--seed", "77"],
                 ["finetune_lora", str(mine), "--config", str(recipe), "--print_config", "--seed", "77"]):
        assert run(argv) == 0
        printed = capsys.readouterr().out
        assert f"checkpoint_dir: {mine}" in printed and "seed: 77" in printed, printed


def test_model_overrides_on_the_line_add_to_the_recipes(tmp_path, capsys):
    """The MoE recipe's overrides (family, experts, router) stay when the line changes one key; later
    keys win in line order, and null clears the recipe's."""
    import yaml

    recipe = REPO / "config_hub" / "pretrain" / "debug-moe.yaml"
    assert run(["pretrain", "--config", str(recipe), "--model_overrides", "{n_expert_per_token: 1, n_layer: 2}",
                "--model_overrides={n_layer: 3, norm_eps: 1e-5}", "--print_config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)["model_overrides"]
    # (1e-5 stays a number: YAML 1.1, PyYAML's, reads it as text)
    assert printed == {"family": "mixtral", "n_expert": 8, "n_expert_per_token": 1, "moe_intermediate_size": 256,
                       "router_aux_loss_coef": 0.01, "router_z_loss_coef": 0.001, "n_layer": 3, "norm_eps": 1e-5}, printed
    # An option before the file is overridden by the file's keys, not dropped.
    assert run(["pretrain", "--model_overrides", "{n_layer: 2, n_expert: 4}", "--config", str(recipe), "--print_config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)["model_overrides"]
    assert printed["n_layer"] == 2 and printed["n_expert"] == 8, printed
    assert run(["pretrain", "--config", str(recipe), "--model_overrides", "null", "--print_config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["model_overrides"] is None


def test_ctrl_c_raised_again_by_a_checkpoint_save_reads_as_interrupted(capsys):
    """Ctrl-C inside torch's distributed checkpoint save reaches the command as a CheckpointException
    holding each rank's failure, a KeyboardInterrupt among them (a user audit saw 227 lines of
    tracebacks and exit code 1): it is reported as an interruption, exit code 130. Other errors
    are not."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from toolkit.cli import run_function
    from toolkit.errors import caused_by_interrupt

    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as interrupt:
        failures = {0: _wrap_exception(interrupt), 1: _wrap_exception(RuntimeError("unexpected pos 704 vs 598"))}

    def save(text: str = "") -> None:
        raise CheckpointException("write", failures)

    assert run_function("toolkit save", save, []) == 130
    assert capsys.readouterr().err.strip() == "toolkit save: interrupted"
    try:
        raise RuntimeError("the writer's error") from KeyboardInterrupt()
    except RuntimeError as chained:
        assert caused_by_interrupt(chained)
    assert not caused_by_interrupt(CheckpointException("write", {1: _wrap_exception(RuntimeError("disk full"))}))
    assert not caused_by_interrupt(RuntimeError("disk full"))


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_before_any_work(capsys, tmp_path):
    """NeoX's 50,277 tokens beside a 512-row embedding: ids past row 511 ended in an IndexError
    traceback mid-run (after fine-tuning had written its out_dir). generate and fine-tuning refuse it
    up front; conversion says so."""

    from toolkit.model_dir import save_checkpoint_files
    from toolkit.models.config import Config
    from toolkit.models.gpt import GPT

    config = Config.from_name("debug-neox", n_layer=1, vocab_size=512)
    small = tmp_path / "small"
    small.mkdir()
    save_checkpoint_files(small, GPT(config).state_dict(), config, tokenizer_dir=NEOX)
    expected = f"The tokenizer in {small} has 50277 tokens but {small} only 512 embeddings"
    line = _one_error_line(capsys, ["generate", str(small), "--prompt", "Hello"])
    assert expected in line, line
    data = tmp_path / "data.json"
    data.write_text('[{"instruction": "Say hi.", "output": "Hi."}]')
    line = _one_error_line(capsys, ["finetune_full", str(small), "--out_dir", str(tmp_path / "out"),
                                    "--data", "JSON", "--data.json_path", str(data)])
    assert expected in line, line
    assert not (tmp_path / "out").exists()
