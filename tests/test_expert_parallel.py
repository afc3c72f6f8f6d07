"""Expert parallelism (`--distributed.expert_parallel N`, toolkit.parallel.expert) on CPU processes
(gloo, 127.0.0.1), against one process: a tiny MoE (4 experts, top-2, n_embd 32, 2 layers) made
from debug-llama2 with the Llama-2 tokenizer, float32, one thread per process.

The global batch and its samples do not depend on the number of processes, so after the same
optimizer steps the weights must agree up to the order of additions (within 1e-5, as
test_distributed_train.py). AdamW's update does not change when a gradient is scaled, so the
weights alone would not see an expert gradient N times too large: the optimizer's moments
(exp_avg and exp_avg_sq, saved in each checkpoint) are compared too, each within 1e-4 of its
tensor's largest entry (measured: 2e-6 on 2 and on 4 processes; a factor 2 is 0.5).

NCCL is not exercised here (no GPU): the all-to-alls run on gloo.
"""

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ASSETS, launch_env, logged_metrics, run_in_process
from toolkit.args import DistributedArgs, TrainArgs
from toolkit.errors import UserError
from toolkit.models.config import Config
from toolkit.parallel.plan import expert_mesh_layout, plan_run

STEPS = 3
WEIGHTS = 1e-5  # absolute, on weights of about 0.02
MOMENTS = 1e-4  # relative to each moment tensor's largest entry
TINY_MOE = ("{n_embd: 32, n_head: 4, n_query_groups: 2, intermediate_size: 48, n_expert: 4, n_expert_per_token: 2, "
            "moe_intermediate_size: 24}")
SCRIPT = Path(__file__).parent / "scripts" / "expert_parallel_step.py"


def _pretrain(out: Path, devices: int, expert_parallel: int, *extra: str, model: str = TINY_MOE) -> list[str]:
    return [
        sys.executable, "-m", "toolkit", "pretrain", "debug-llama2", "--model_overrides", model, "--out_dir", str(out),
        "--data", "TextFiles", "--data.train_path", str(ASSETS / "tinyshakespeare.txt"),
        "--data.cache_dir", str(out.parent / "cache"), "--tokenizer_dir", str(ASSETS / "tokenizers" / "llama2"),
        "--precision", "32-true", "--train.micro_batch_size", "2", "--train.global_batch_size", "8",
        "--train.max_seq_length", "32", "--train.max_steps", str(STEPS), "--train.warmup_steps", "1",
        "--train.learning_rate", "0.002", "--train.save_interval", "1", "--train.keep_last", "null",
        "--eval.interval", "1000", "--eval.final_validation", "false", "--log.interval", "1", "--log.loggers", "[csv]",
        "--devices", str(devices), "--distributed.expert_parallel", str(expert_parallel), *extra,
    ]


def _run(cmd: list[str]) -> str:
    result = subprocess.run(cmd, capture_output=True, text=True, env=launch_env(), timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _checkpoint(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step-{step:08d}"


def _assert_same_weights(reference: Path, out: Path) -> None:
    a, b = load_file(str(reference / "final" / "model.safetensors")), load_file(str(out / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=WEIGHTS, rtol=0, msg=name)


def _moments(checkpoint: Path) -> dict[str, dict[str, torch.Tensor]]:
    """{parameter name: {"exp_avg", "exp_avg_sq"}} of a training checkpoint, sharded or not."""
    if (checkpoint / "state").is_dir():  # several processes: torch's distributed checkpoint, keyed by name
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(checkpoint / "state", Path(tmp) / "state.pt")
            return torch.load(Path(tmp) / "state.pt", weights_only=True)["optimizer"]["state"]
    # One process: keyed by position in the optimizer's groups, which training builds this way.
    from toolkit.models.gpt import GPT
    from toolkit.optim import decay_names, make_adamw

    with torch.device("meta"):
        model = GPT(Config.from_file(checkpoint))
    name = {id(p): n for n, p in model.named_parameters()}
    order = [name[id(p)] for group in make_adamw(model, decay_names(model), TrainArgs()).param_groups for p in group["params"]]
    saved = torch.load(checkpoint / "state.pt", weights_only=True)["optimizer"]["state"]
    return {order[i]: state for i, state in saved.items()}


def _assert_same_moments(reference: Path, checkpoint: Path) -> None:
    a, b = _moments(reference), _moments(checkpoint)
    assert a.keys() == b.keys() and any("experts" in name for name in a)
    for name in a:
        for moment in ("exp_avg", "exp_avg_sq"):
            expected = a[name][moment]
            torch.testing.assert_close(b[name][moment], expected, rtol=0, atol=MOMENTS * expected.abs().max().item(),
                                       msg=f"{name} {moment}")


def _train_losses(out: Path) -> list[float]:
    return [float(row["train/loss"]) for row in logged_metrics(out) if row.get("train/loss")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """One process, and two with expert_parallel 2 (a checkpoint at every step, all kept)."""
    root = tmp_path_factory.mktemp("expert_parallel")
    one, two = root / "one", root / "two"
    run_in_process(_pretrain(one, 1, 1)[3:])
    return {"root": root, "one": one, "two": two, "two_stdout": _run(_pretrain(two, 2, 2))}


def test_two_processes_with_expert_parallel_2_train_as_one_process(runs):
    one, two = runs["one"], runs["two"]
    assert "experts split over groups of 2 (expert parallel, all-to-all)" in runs["two_stdout"]
    _assert_same_weights(one, two)
    exported = load_file(str(two / "final" / "model.safetensors"))
    assert exported["blocks.1.mlp.experts.gate_up_proj"].shape == (4, 48, 32)  # every expert, gathered
    assert exported["blocks.1.mlp.experts.down_proj"].shape == (4, 32, 24)
    losses = _train_losses(one)
    assert len(losses) == STEPS
    torch.testing.assert_close(torch.tensor(_train_losses(two)), torch.tensor(losses), atol=1e-5, rtol=0)
    _assert_same_moments(_checkpoint(one, STEPS), _checkpoint(two, STEPS))


def test_an_expert_parallel_training_checkpoint_converts_to_the_exported_model(runs, tmp_path):
    from toolkit.cli import run

    assert run(["convert_pretrained_checkpoint", str(_checkpoint(runs["two"], STEPS)), str(tmp_path / "model")]) == 0
    converted = load_file(str(tmp_path / "model" / "model.safetensors"))
    exported = load_file(str(runs["two"] / "final" / "model.safetensors"))
    assert converted.keys() == exported.keys()
    for name in exported:
        assert torch.equal(converted[name], exported[name]), name


def test_an_expert_parallel_checkpoint_resumes_on_one_process(runs):
    out = runs["root"] / "two-to-one"
    shutil.copytree(runs["two"], out)
    stdout = _run(_pretrain(out, 1, 1, "--resume", str(_checkpoint(out, 2))))
    assert "Resharded step-00000002: saved by 2 process(es), resuming on 1" in stdout
    _assert_same_weights(runs["one"], out)


def test_an_expert_parallel_checkpoint_resumes_on_four_processes_with_expert_parallel_4(runs):
    """The last two steps on 4 processes, one expert each: weights and moments as one process's."""
    out = runs["root"] / "two-to-four"
    shutil.copytree(runs["two"], out)
    stdout = _run(_pretrain(out, 4, 4, "--resume", str(_checkpoint(out, 1))))
    assert "Resharded step-00000001: saved by 2 process(es), resuming on 4" in stdout
    assert "experts split over groups of 4" in stdout
    _assert_same_weights(runs["one"], out)
    _assert_same_moments(_checkpoint(runs["one"], STEPS), _checkpoint(out, STEPS))


@pytest.mark.slow  # 50-60 s in CI: two processes compiling, like the slow two-process tests of test_compile.py
def test_compiled_blocks_with_expert_parallel_2_train_as_eager_ones(runs):
    """`--train.compile true` with expert parallelism: each block compiled, the experts' own FSDP unit
    and their all-to-alls inside it (dynamo runs what it cannot trace eagerly). The weights and
    losses of the eager two-process run, within the tolerance of one process against two."""
    out = runs["root"] / "two-compiled"
    stdout = _run(_pretrain(out, 2, 2, "--train.compile", "true"))
    assert "transformer blocks compiled separately" in stdout
    _assert_same_weights(runs["two"], out)
    torch.testing.assert_close(torch.tensor(_train_losses(out)), torch.tensor(_train_losses(runs["two"])), atol=1e-5, rtol=0)


def test_experts_split_inside_each_expert_resume_on_one_process(tmp_path):
    """3 experts over 2 FSDP processes (no expert parallelism) are split along each expert's rows
    (`expert_shard_dim`): the checkpoint of step 1, resumed on one process, ends where the two
    processes ended, weights and AdamW's moments; the export holds every expert, as does the last
    checkpoint converted."""
    three = TINY_MOE.replace("n_expert: 4", "n_expert: 3")
    two, resumed = tmp_path / "two", tmp_path / "resumed"
    _run(_pretrain(two, 2, 1, model=three))
    shutil.copytree(two, resumed)
    stdout = _run(_pretrain(resumed, 1, 1, "--resume", str(_checkpoint(resumed, 1)), model=three))
    assert "Resharded step-00000001: saved by 2 process(es), resuming on 1" in stdout
    _assert_same_weights(two, resumed)
    _assert_same_moments(_checkpoint(two, STEPS), _checkpoint(resumed, STEPS))
    exported = load_file(str(two / "final" / "model.safetensors"))
    assert exported["blocks.1.mlp.experts.gate_up_proj"].shape == (3, 48, 32)
    from toolkit.cli import run

    assert run(["convert_pretrained_checkpoint", str(_checkpoint(two, STEPS)), str(tmp_path / "model")]) == 0
    converted = load_file(str(tmp_path / "model" / "model.safetensors"))
    assert converted.keys() == exported.keys()
    for name in exported:
        assert torch.equal(converted[name], exported[name]), name


def _finetune_lora(base: Path, out: Path, devices: int, expert_parallel: int) -> list[str]:
    return [
        sys.executable, "-m", "toolkit", "finetune_lora", str(base), "--out_dir", str(out),
        "--data", "Alpaca", "--data.json_path", str(ASSETS / "instruct" / "alpaca_tiny.json"),
        "--data.val_split_fraction", "0.1", "--precision", "32-true", "--train.micro_batch_size", "2",
        "--train.global_batch_size", "8", "--train.max_seq_length", "64", "--train.max_steps", str(STEPS),
        "--train.warmup_steps", "1", "--train.learning_rate", "0.01", "--eval.interval", "1000",
        "--eval.final_validation", "false", "--log.interval", "1", "--log.loggers", "[csv]",
        "--lora.dropout", "0", "--lora.targets", "[query, value, projection, experts]",
        "--devices", str(devices), "--distributed.expert_parallel", str(expert_parallel),
    ]


def test_lora_on_attention_and_experts_with_expert_parallel_2_trains_as_one_process(runs):
    """The experts are frozen under adapters of their own, of which each rank applies its experts'
    rows; the adapters' gradients of the first layer cross both MoE layers' all-to-alls backwards.
    The adapter the two processes write equals the one process's, every factor trained."""
    base = runs["one"] / "final"
    one, two = runs["root"] / "lora-one", runs["root"] / "lora-two"
    run_in_process(_finetune_lora(base, one, 1, 1)[3:])
    _run(_finetune_lora(base, two, 2, 2))
    a = load_file(str(one / "final" / "lora_adapter.safetensors"))
    b = load_file(str(two / "final" / "lora_adapter.safetensors"))
    assert a.keys() == b.keys() and any("blocks.0.attn" in name for name in a)
    assert {f"blocks.{i}.mlp.experts.{w}.lora_{f}.weight" for i in (0, 1) for w in ("gate_up_proj", "down_proj")
            for f in "AB"} <= a.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=WEIGHTS, rtol=0, msg=name)
        if "lora_B" in name:
            assert a[name].abs().max() > 1e-3, name
    torch.testing.assert_close(torch.tensor(_train_losses(two)), torch.tensor(_train_losses(one)), atol=1e-5, rtol=0)


def test_one_step_on_four_processes_equals_one_process_in_every_layout(tmp_path):
    """tests/scripts/expert_parallel_step.py: every gradient, the loss, the clipped norm, the part
    each shard holds, the experts' export and the set-up's fill from a file and from the
    initialiser, on FULL_SHARD with the experts also FSDP-sharded, HYBRID_SHARD over two simulated
    nodes with activation checkpointing, one expert per pair (split along dim 1 over the other
    pair; or, 33 rows, along dim 0 with an empty shard), 2 experts over 4 ranks without expert
    parallelism (split along dim 1; with LoRA too), 3 experts split along dim 1 within each of two
    simulated nodes,
    LoRA on attention and on the frozen experts (expert parallel 2 and 4), and ranks whose experts
    get no token (with and without adapters on them)."""
    result = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], env=launch_env(), capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    import json

    report = json.loads((tmp_path / "result.json").read_text())
    assert report.keys() == {"full_shard", "hybrid", "uneven", "uneven_rows", "columns", "hybrid_columns", "columns_lora",
                             "lora", "lora_ep4", "idle", "lora_idle"}
    for layout, found in report.items():
        loss, reference = found["loss"]
        assert abs(loss - reference) < 1e-6, layout
        for name, (difference, largest) in found["grads"].items():
            assert difference <= 1e-6 * max(largest, 1e-3), (layout, name, difference, largest)
        norm, reference = found["norm"]
        assert abs(norm - reference) < 1e-6 * reference, layout
        assert found["clipped_worst"] < 1e-8, layout
        assert found["rows_filled"] and all(found["rows_filled"].values()), (layout, found["rows_filled"])
        assert len(found["exported"]) == 4 and all(found["exported"].values()), (layout, found["exported"])
        # Experts split along dim 1 where they do not split evenly over the ranks sharding them.
        dims = [0, 1] if layout == "uneven" else [1] if "columns" in layout else [0]
        if layout == "uneven_rows":  # 48 rows of gate_up_proj split in two; 33 of down_proj cannot be
            dims = {name: [0, 1] if "gate_up" in name else [0] for name in found["expert_dims"]}
            assert found["expert_dims"] == dims, found["expert_dims"]
        else:
            assert all(d == dims for d in found["expert_dims"].values()), (layout, found["expert_dims"])
        if "lora" not in layout:
            assert found["set_up"] == {"checkpoint": True, "initialiser": True}, layout
    assert report["idle"]["unrouted_grad"] == 0 and report["full_shard"]["unrouted_grad"] > 0
    for layout in ("lora", "lora_ep4", "lora_idle"):
        grads = report[layout]["grads"]
        assert any("attn" in name and "lora_A" in name for name in grads)
        for weight in (".experts.base_layer.lora_A", ".experts.lora_B"):  # gate_up_proj's A, down_proj's B
            assert sum(weight in name for name in grads) == 2, (layout, weight, sorted(grads))  # both layers
        assert not any("experts" in name and ".lora_" not in name for name in grads)  # the experts: frozen
        assert all(largest > 0 for name, (_, largest) in grads.items() if ".lora_" in name), layout
    assert "each expert's weights sharded over 2 process(es)" in report["full_shard"]["describe"]
    assert "experts split over groups of 4" in report["lora_ep4"]["describe"]
    assert "replicated 2 times" in report["hybrid"]["describe"]


# ------------------------------------------------------------------ the plan: meshes and refusals


def _moe(**overrides) -> Config:
    values = dict(name="tiny-moe", vocab_size=64, block_size=32, n_layer=2, n_embd=32, n_head=4, n_query_groups=2,
                  intermediate_size=48, n_expert=8, n_expert_per_token=2, moe_intermediate_size=24)
    return Config(**{**values, **overrides})


def _plan(devices: int, nodes: int = 1, model: Config = None, quantize=None, **distributed):
    return plan_run(devices, nodes, "32-true", DistributedArgs(**distributed), TrainArgs(global_batch_size=16, micro_batch_size=1),
                    64, quantize=quantize, accelerator="cpu", model=model if model is not None else _moe())


def test_the_experts_mesh_splits_the_innermost_data_parallel_dimension():
    assert expert_mesh_layout("FULL_SHARD", 1, 8, 4) == ((2, 4), ("expert_shard", "expert"))
    assert expert_mesh_layout("HYBRID_SHARD", 2, 4, 2) == ((2, 2, 2), ("replicate", "expert_shard", "expert"))
    assert _plan(4, expert_parallel=2).strategy.expert_mesh == ((2, 2), ("expert_shard", "expert"))
    assert _plan(4).strategy.expert_mesh is None  # expert_parallel 1: no second mesh
    spanning = _plan(2, nodes=2, expert_parallel=4, sharding="FULL_SHARD").strategy
    assert spanning.expert_mesh == ((1, 4), ("expert_shard", "expert"))
    assert any("span nodes" in line for _, line in spanning.notes)


@pytest.mark.parametrize("setting, fragments", [
    (dict(devices=4, expert_parallel=3), ["must divide the 8 experts of tiny-moe and the 4 process(es)", "use 1 or 2 or 4"]),
    (dict(devices=2, expert_parallel=4), ["the 2 process(es) (devices 2 x nodes 1)", "use 1 or 2."]),
    (dict(devices=4, model=_moe(n_expert=6), expert_parallel=4), ["the 6 experts", "use 1 or 2."]),
    (dict(devices=1, expert_parallel=2), ["the 1 process(es)", "use 1."]),
    (dict(devices=2, nodes=2, expert_parallel=4, sharding="HYBRID_SHARD"),
     ["with HYBRID_SHARD across 2 nodes, the 2 devices of one node", "use 1 or 2, or --distributed.sharding FULL_SHARD"]),
    (dict(devices=4, model=Config.from_name("debug-llama2"), expert_parallel=2),
     ["debug-llama2 is dense (no MoE layer)", "use --distributed.expert_parallel 1"]),
    (dict(devices=2, expert_parallel=2, strategy="ddp"), ["shards the experts with FSDP: drop --distributed.strategy ddp"]),
    (dict(devices=4, expert_parallel=2, sharding="NO_SHARD"), ["NO_SHARD shards nothing: use FULL_SHARD, HYBRID_SHARD"]),
    (dict(devices=2, expert_parallel=2, quantize="nf4"), ["not available with a quantized base (--quantize nf4)"]),
    (dict(devices=2, expert_parallel=0), ["must be a positive whole number, got 0"]),
])
def test_settings_that_cannot_work_are_refused_in_one_line_naming_what_would(setting, fragments):
    with pytest.raises(UserError) as error:
        _plan(**setting)
    message = str(error.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_the_command_refuses_expert_parallelism_on_a_dense_model_before_anything_starts(tmp_path, capsys):
    from toolkit.cli import run

    out = tmp_path / "dense"
    args = ["pretrain", "debug-llama2", "--out_dir", str(out), "--data", "TextFiles",
            "--data.train_path", str(ASSETS / "tinyshakespeare.txt"), "--tokenizer_dir", str(ASSETS / "tokenizers" / "llama2"),
            "--devices", "2", "--distributed.expert_parallel", "2"]
    assert run(args) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is dense (no MoE layer)" in err[0], err
    assert not out.exists()
