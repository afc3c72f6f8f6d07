"""The simulated training step (toolkit.memory.simulation) at the real shapes of Llama-3.1-8B and -70B.

Each simulation runs the toolkit's own set-up (GPT on meta, the precision policy, ShardedStrategy's
FSDP2 sharding on the real mesh, the training AdamW) on fake tensors and a fake process group, and
destroys the group afterwards. Figures are bytes of live tensors on one rank.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.errors import UserError
from toolkit.memory import check_fits, simulate
from toolkit.memory.estimator import Options, column_memory, make_column, peak_moment
from toolkit.memory.simulation import CATEGORIES
from toolkit.models.config import Config

PERSISTENT = ("Sharded Param", "Sharded Grad", "OptState")
ANALYTIC = {"Sharded Param": "parameters", "Sharded Grad": "gradients", "OptState": "optimizer_state"}


@pytest.fixture(scope="module")
def step_8b():
    """Pretraining Llama-3.1-8B on 8 ranks (FULL_SHARD), micro-batch 1 x 2048, bf16-mixed, one micro-batch."""
    return simulate(Config.from_name("llama-3.1-8b"), 8, 1, sharding="FULL_SHARD", micro_batches=1)


@pytest.mark.parametrize(
    "name, layouts",
    [
        # 8 -> 64 ranks, and HYBRID over 2 nodes, which shards over the 8 ranks of a node only
        ("llama-3.1-8b", [("FULL_SHARD", 8, 1), ("HYBRID_SHARD", 8, 2), ("FULL_SHARD", 8, 8)]),
        ("llama-3.1-70b", [("FULL_SHARD", 8, 1), ("FULL_SHARD", 8, 8)]),
        pytest.param("llama-3.1-8b", [("FULL_SHARD", 8, 1), ("FULL_SHARD", 16, 1), ("HYBRID_SHARD", 8, 8),
                                      ("FULL_SHARD", 8, 64)], marks=pytest.mark.slow, id="8b-full-grid"),
        pytest.param("llama-3.1-70b", [("FULL_SHARD", 8, 1), ("HYBRID_SHARD", 8, 8), ("FULL_SHARD", 8, 2),
                                       ("FULL_SHARD", 8, 64)], marks=pytest.mark.slow, id="70b-full-grid"),
    ],
)
def test_params_grads_optimizer_fall_as_one_over_the_shard_group(name, layouts):
    config = Config.from_name(name)
    per_element = []
    for sharding, devices, nodes in layouts:
        sim = simulate(config, devices, nodes, sharding=sharding, forward=False)
        group = devices if sharding == "HYBRID_SHARD" else devices * nodes
        assert sim.shard_size == group
        # float32 parameter + gradient + two AdamW states = 16 bytes per weight, over the shard group
        per_element.append(sim.params_grads_optimizer * group)
        # the analytic estimator's shards match per category (padding to equal shards included)
        figures = column_memory(Options(config, "bf16-mixed", None, (), 8, None, 2048), make_column(sharding, devices, nodes), 1)
        for key, column in ANALYTIC.items():
            assert sim.persistent[key] == pytest.approx(figures[column], rel=0.01), (sharding, devices, nodes, key)
    full = per_element[0]
    assert full == pytest.approx(16 * 8.03e9 if name.endswith("8b") else 16 * 70.55e9, rel=0.01)
    for value in per_element[1:]:
        assert value == pytest.approx(full, rel=0.01)  # times the group, constant: it falls as 1/N


def _holds_to_the_analytic_peak(sim, opts: Options, column, checkpointed: bool, micro_batches: int) -> str:
    """The simulated peak against the analytic one (`peak_moment`, with the rules of fake tensors on
    the CPU, `Options.device`), category by category and in total; returns the analytic moment.

    The analytic model counts the gradient shards throughout (alive under gradient accumulation);
    with one micro-batch they exist only from the backward pass on, and the totals are compared
    without them. What the analytic model leaves out is a few MiB: the token ids and the rotary
    tables."""
    name, moment = peak_moment(opts, column, 1, checkpointed)
    figures = column_memory(opts, column, 1)
    gradients = figures["gradients"] if micro_batches > 1 else 0
    assert sim.peak.get("Sharded Grad", 0) == gradients
    assert sim.peak["Sharded Param"] == figures["parameters"]
    assert sim.peak.get("OptState", 0) == pytest.approx(figures["optimizer_state"], rel=0.01)
    for key, label in CATEGORIES.items():
        if key not in PERSISTENT + ("Inputs", "Buffer"):
            assert sim.peak.get(key, 0) == pytest.approx(moment.get(label, 0), rel=0.01, abs=4 * 2**20), (name, label)
    total = figures["total_checkpointed" if checkpointed else "total"] - figures["gradients"] + gradients
    assert sim.peak_total == pytest.approx(total, rel=0.01)
    return name


def test_simulated_step_matches_the_analytic_estimate(step_8b):
    """Measured: every category and the total within 0.05% (4 MiB of 30 GiB)."""
    opts = Options(Config.from_name("llama-3.1-8b"), "bf16-mixed", None, (), 8, None, 2048, device="fake")
    # The peak is the loss's backward pass: sharded parameters 3.74 + optimizer state 7.48 +
    # activations 16.86 (every block's saved tensors 14.82, the loss's kept gradients 2.0, the
    # token ids and the final norm's) + the gradients the loss's backward pass writes 1.01 (the
    # head's weight gradient in bf16 0.98, the hidden one) + the (final norm, head) unit gathered
    # in bf16 0.98 = 30.06 GiB. It had been the loss's forward pass (30.39 GiB) while the head's
    # flat all-gather output (0.98) stayed alive through the loss; the output units' forward
    # pre-hook (`fsdp._free_flat_gather_output`) frees it after the copy-out.
    # The analytic walk sees the head as gathered (bf16): before, it saw it as stored (float32) and
    # counted a bf16 cast of it that the gathered head does not need, 12% too many activations. The
    # peak had been in the loss's backward pass (32.0 GiB), where the fused loss wrote its float32
    # weight gradient scaled in float32 beside the kept one before casting it (2 GB of waste, fixed
    # in toolkit.models.loss._scaled; its 16-bit product, 1 GB, is now added up in pieces too).
    assert _holds_to_the_analytic_peak(step_8b, opts, make_column("FULL_SHARD", 8, 1), False, 1) == "loss backward"
    # At the peak, of the edges only the (final norm, head) unit is gathered, in bf16 like a block
    # (0.98 GiB); the embedding was released after its forward pass.
    head = 2 * (128256 * 4096 + 4096)
    assert step_8b.peak["Unsharded Param"] == pytest.approx(head, rel=0.01)
    # Bytes sent, each (N-1)/N of the full tensor: every unit gathered in bf16 (blocks for the
    # forward pass and again for the backward pass; the embedding once: its gradient does not need
    # its weight, so it is not gathered for the backward pass; the head once: it stays gathered
    # from its forward to its backward pass) and float32 gradients reduce-scattered.
    embedding = 2 * 128256 * 4096
    blocks = 8.03e9 - 2 * 128256 * 4096
    gathered = embedding + head + 2 * 2 * blocks
    reduced = 4 * 8.03e9
    assert step_8b.sent_bytes == pytest.approx((gathered + reduced) * 7 / 8, rel=0.02)


@pytest.mark.parametrize(
    "name, seq, moment",
    [
        # Llama-3.1-8B's blocks, 4 of them: the peak is the head's gathering (2.52 GiB simulated,
        # 2.52 analytic), its copy and its flat all-gather output (0.98 GiB each) beside the
        # checkpointed blocks' inputs and the final norm's output, just before the output units'
        # hook frees the flat output (without the hook both stayed through the loss's forward
        # pass, then the peak).
        ("llama-3.1-8b", 2048, "head gathered"),
        # Gemma-2B (its 256000 x 2048 embedding tied to the head, in the root unit; small blocks),
        # 512 tokens: the peak is block 0's gathering, when the root's flat all-gather output is
        # still alive beside the root's copies and block 0's flat output and copies (FSDP frees a
        # unit's flat output after the next unit's copy-out).
        ("gemma-2b", 512, "block 0 gathered"),
    ],
)
def test_simulated_lora_step_matches_the_analytic_estimate(name, seq, moment):
    """LoRA (finetune_lora's defaults: r 8 on query and value, dropout 0.05) with activation
    checkpointing, 8 ranks FULL_SHARD, 4 blocks, two micro-batches (a few seconds each; in the
    first forward pass of a tracked step FSDPMemTracker counted Gemma's block 0 copies as
    activations, torch 2.13, so the peak is taken where the second one puts it). Measured: every
    category and the total within 0.1%.
    The analytic total had been 9% low for 8B LoRA with checkpointing (6.04 vs 6.62 GiB) when
    the root unit held embedding, final norm and head: the moment of a unit gathered beside the
    previous unit's flat output was not modelled; `fsdp_moments` now has it for every unit."""
    from toolkit.models.adapters import LoRAArgs

    config = Config.from_name(name, n_layer=4)
    lora = LoRAArgs()
    sim = simulate(config, 8, 1, 1, seq, sharding="FULL_SHARD", finetune="lora", lora=lora,
                   activation_checkpointing=True, micro_batches=2)  # fmt: skip
    opts = Options(config, "bf16-mixed", "lora", tuple(lora.module_names()), lora.r, None, seq, device="fake",
                   lora_dropout=lora.dropout)  # fmt: skip
    assert _holds_to_the_analytic_peak(sim, opts, make_column("FULL_SHARD", 8, 1), True, 2) == moment
    # The pre-flight checks LoRA runs with their adapters, by CUDA's rules (a one-byte dropout mask,
    # softmax's float32 copy of the bfloat16 logits: +2% here for 8B): it accepts a device 5% larger
    # than the simulated peak needs, and refuses one 5% smaller.
    for scale, fits in ((1.05, True), (0.95, False)):
        device = int(sim.peak_total * scale / 0.95)
        if fits:
            assert "fits." in check_fits(device, config, 8, 1, 1, seq, "bf16-mixed", "FULL_SHARD", True, "lora", lora)
        else:
            with pytest.raises(UserError, match="does not fit"):
                check_fits(device, config, 8, 1, 1, seq, "bf16-mixed", "FULL_SHARD", True, "lora", lora)


def first_blocks(name: str, n_layer: int) -> Config:
    """Preset `name` cut to its first `n_layer` blocks, its per-layer lists (local layers, NoPE
    layers) cut with it."""
    config = Config.from_name(name)
    changes: dict = {"n_layer": n_layer}
    if config.layer_types is not None:
        changes["layer_types"] = config.layer_types[:n_layer]
    if config.no_rope_layers is not None:
        changes["no_rope_layers"] = [i for i in config.no_rope_layers if i < n_layer] or None
    return config.replace(**changes)


# The smallest preset of every family, with 3 blocks and 512 tokens: seconds each. 3 give the first,
# a middle and the last block their own moments of the step, and the estimate stands the third for
# the second (`layer_slots`: from the second block on, blocks of one kind are recorded once). Four
# keep a fourth block: Gemma-2 alternates local and global layers (its fourth is the second global
# one), SmolLM3's fourth is its first NoPE layer, and Mistral-7B's and Phi-3's pretraining estimates
# are the least close (large blocks beside 512 tokens): +1.9% and +2.3% with 4 blocks, +2.2% and
# +2.7% with 3, too near the 3% bound.
FAMILY_SMALLEST = ["tiny-llama-1.1b", "mistral-7b", "qwen2.5-0.5b", "gemma-2b", "gemma-2-2b", "gemma-3-270m", "phi-2",
                   "pythia-14m", "qwen3-0.6b", "olmo-2-1b", "smollm3-3b", "phi-3-mini-4k-instruct"]
FAMILY_BLOCKS = {"gemma-2-2b": 4, "smollm3-3b": 4, "mistral-7b": 4, "phi-3-mini-4k-instruct": 4}  # others: 3


@pytest.mark.parametrize("setting", ["pretrain", "lora", "checkpointing"])
@pytest.mark.parametrize("name", FAMILY_SMALLEST)
def test_estimate_is_within_3_percent_of_the_simulated_step(name, setting):
    """The estimate (parameters from the meta model, activations recorded from the model on fake
    tensors, the moments of `toolkit.memory.moments`) against the real step simulated on 8 fake
    ranks, FULL_SHARD, bf16-mixed, two micro-batches: pretraining, LoRA (finetune_lora's adapters),
    and pretraining with activation checkpointing. Measured: within 0.3% but Mistral-7B's and
    Phi-3's pretraining (+1.9%, +2.3%: their blocks are large beside 512 tokens, and the moment a
    block's backward pass ends is an upper bound of what FSDP holds then)."""
    from toolkit.models.adapters import LoRAArgs

    config = first_blocks(name, FAMILY_BLOCKS.get(name, 3))
    lora = LoRAArgs() if setting == "lora" else None
    checkpointing = setting == "checkpointing"
    sim = simulate(config, 8, 1, 1, 512, "bf16-mixed", "FULL_SHARD", "lora" if lora else None, lora, checkpointing, 2)
    opts = Options(config, "bf16-mixed", "lora" if lora else None, tuple(lora.module_names()) if lora else (), 8, None,
                   512, device="fake", lora_dropout=lora.dropout if lora else 0.0)  # fmt: skip
    figures = column_memory(opts, make_column("FULL_SHARD", 8, 1), 1)
    estimated = figures["total_checkpointed" if checkpointing else "total"]
    assert sim.peak_total > figures["parameters"] + figures["optimizer_state"]  # the step ran
    assert estimated == pytest.approx(sim.peak_total, rel=0.03), (estimated / 2**20, sim.peak_total / 2**20)


def test_preflight_checks_lora_and_says_what_it_does_with_quantize():
    """LoRA runs with their adapters; a quantized base by the analytic figure, since fake tensors
    cannot run the 4-bit kernels (held to real bitsandbytes layers and torchao's NF4 in
    tests/test_estimate.py): replicated (bnb.*) or sharded by FSDP (nf4)."""
    from toolkit.models.adapters import LoRAArgs

    eighty, config, lora = 80 * 10**9, Config.from_name("llama-3.1-70b"), LoRAArgs()
    # 70B LoRA on one GPU: the bf16 base alone is 141 GB. Nothing fits; the way out is named.
    with pytest.raises(UserError, match=r"does not fit\. no sharding.* or a quantized base \(--quantize nf4\)"):
        check_fits(eighty, config, 1, 1, 1, 2048, "bf16-mixed", "single", True, "lora", lora)
    # On 8 GPUs (FULL_SHARD) the LoRA figure is the estimator's LoRA column: it fits (23.7 GiB).
    line = check_fits(eighty, config, 8, 1, 1, 2048, "bf16-mixed", "FULL_SHARD", True, "lora", lora)
    opts = Options(config, "bf16-mixed", "lora", tuple(lora.module_names()), lora.r, None, 2048, lora_dropout=lora.dropout)
    lora_total = column_memory(opts, make_column("FULL_SHARD", 8, 1), 1)["total_checkpointed"]
    assert f"about {lora_total / 2**30:.1f} GiB" in line and line.endswith("fits.")
    # QLoRA on one GPU and replicated on two (bnb.nf4): the quantized base (37 GB) fits.
    for devices, layout in ((1, "single"), (2, "DDP")):
        assert "fits." in check_fits(eighty, config, devices, 1, 1, 2048, "bf16-mixed", layout, True, "lora", lora, "bnb.nf4")
    # An nf4 base sharded by FSDP: the estimator's nf4 column (NF4 shards, gathered NF4 blocks,
    # the dequantized weight), below the bf16 base's figure.
    line = check_fits(eighty, config, 8, 1, 1, 2048, "bf16-mixed", "FULL_SHARD", True, "lora", lora, "nf4")
    opts = Options(config, "bf16-mixed", "lora", tuple(lora.module_names()), lora.r, "nf4", 2048, lora_dropout=lora.dropout)
    nf4_total = column_memory(opts, make_column("FULL_SHARD", 8, 1), 1)["total_checkpointed"]
    assert f"about {nf4_total / 2**30:.1f} GiB" in line and line.endswith("fits.") and nf4_total < lora_total
    # On two 24 GB GPUs each stores half the NF4 base: the refusal names CPU offload, which fits.
    with pytest.raises(UserError, match=r"does not fit\. --distributed\.cpu_offload true fits"):
        check_fits(24 * 10**9, config, 2, 1, 1, 2048, "bf16-mixed", "FULL_SHARD", True, "lora", lora, "nf4")
    line = check_fits(24 * 10**9, config, 2, 1, 1, 2048, "bf16-mixed", "FULL_SHARD", True, "lora", lora, "nf4",
                     cpu_offload=True)  # fmt: skip
    assert line.endswith("fits.")


def test_preflight_refuses_what_the_simulation_says_does_not_fit(step_8b):
    eighty = 80 * 10**9
    config = Config.from_name("llama-3.1-8b")
    # 8B pretraining on 2 ranks: 64 GB of float32 parameters, gradients and AdamW per rank before
    # any activation: the simulation's peak is far above 80 GB. Checkpointed activations fit beside them.
    two = simulate(config, 2, 1, sharding="FULL_SHARD", forward=False)
    assert two.params_grads_optimizer + step_8b.peak["Activation"] > eighty
    checkpointing = r"[0-9.]+ GiB per device .* does not fit\. --distributed\.activation_checkpointing true fits"
    with pytest.raises(UserError, match=checkpointing) as refused:
        check_fits(eighty, config, 2, 1, 1, 2048, "bf16-mixed", "FULL_SHARD", False)
    assert "\n" not in str(refused.value)
    # 64 GB hold less than those three: only CPU offload (all three in host memory) makes it fit.
    assert two.params_grads_optimizer > 64 * 10**9
    with pytest.raises(UserError, match=r"does not fit\. --distributed\.cpu_offload true fits"):
        check_fits(64 * 10**9, config, 2, 1, 1, 2048, "bf16-mixed", "FULL_SHARD", False)
    # On 8 ranks the simulated peak is about 30 GiB: accepted.
    assert step_8b.peak_total < eighty
    assert "fits." in check_fits(eighty, config, 8, 1, 1, 2048, "bf16-mixed", "FULL_SHARD", False)


def test_preflight_names_full_shard_when_hybrid_does_not_fit():
    config = Config.from_name("llama-3.1-70b")
    with pytest.raises(UserError, match="--distributed.sharding FULL_SHARD"):
        # 70B full fine-tune, HYBRID over 4 nodes of 8: each node holds a whole 70B state / 8
        check_fits(80 * 10**9, config, 8, 4, 1, 2048, "bf16-mixed", "HYBRID_SHARD", True, finetune="full")


def test_the_run_plan_preflight_is_the_preflight_of_its_settings():
    """Training hands the pre-flight its run plan (`check_run_fits`): the same verdict as the
    settings it holds, HYBRID_SHARD over nodes included, and the QLoRA scheme's quantized base."""
    from toolkit.args import DistributedArgs, TrainArgs
    from toolkit.memory import check_run_fits
    from toolkit.parallel.plan import plan_run

    config = Config.from_name("llama-3.1-70b")
    train = TrainArgs(micro_batch_size=1, global_batch_size=32)
    plan = plan_run(8, 4, "bf16-mixed", DistributedArgs(activation_checkpointing=True), train, 2048, accelerator="cuda")
    with pytest.raises(UserError, match="--distributed.sharding FULL_SHARD"):
        check_run_fits(80 * 10**9, config, plan, finetune="full")

    def verdict(check, *args, **kwargs) -> str:
        try:
            return check(*args, **kwargs)
        except UserError as refusal:
            return str(refusal)

    for checkpointing in (False, True):
        lora_plan = plan_run(2, 1, "bf16-mixed", DistributedArgs(activation_checkpointing=checkpointing),
                             TrainArgs(micro_batch_size=1, global_batch_size=2), 2048, quantize="nf4", accelerator="cuda")
        line = verdict(check_run_fits, 24 * 10**9, config, lora_plan, finetune="lora")
        assert line == verdict(check_fits, 24 * 10**9, config, 2, 1, 1, 2048, "bf16-mixed", "FULL_SHARD", checkpointing,
                               finetune="lora", quantize="nf4")
        assert "memory pre-flight: about" in line


def test_simulate_leaves_no_process_group_behind():
    import torch.distributed as dist

    simulate(Config.from_name("llama-3.1-8b", n_layer=1), 4, 1, forward=False)
    assert not dist.is_initialized()


# ------------------------------------------------------------------------------------------
# The simulation proven: the same step on real tensors, 2 gloo processes
# ------------------------------------------------------------------------------------------

# A Llama-3.1 block at a size that runs for real in a second; the vocabulary (2053) is odd, so the
# shards of the root unit are uneven (rank 0 holds the larger one, as the simulation's rank 0).
REAL_OVERRIDES = dict(n_layer=4, n_embd=128, n_head=4, n_query_groups=2, intermediate_size=352, vocab_size=2053,
                      block_size=256)  # fmt: skip
REAL_BATCH, REAL_SEQ, REAL_MICRO_BATCHES, REAL_LORA_R = 2, 256, 2, 4
REAL_SETUPS = ["bf16-mixed:pretrain", "32-true:full", "bf16-mixed:lora", "bf16-mixed:full:checkpointing"]


class _RealRun:
    """tests/scripts/simulate_real.py on 2 gloo processes: `tracked_step` with real tensors."""

    def __init__(self, out: Path) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
        env |= {"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONWARNINGS": "ignore"}
        command = [sys.executable, str(Path(__file__).parent / "scripts" / "simulate_real.py"), "--out", str(out),
                   "--world", "2", "--preset", "llama-3.1-8b", "--overrides", json.dumps(REAL_OVERRIDES),
                   "--micro-batch", str(REAL_BATCH), "--seq", str(REAL_SEQ), "--micro-batches", str(REAL_MICRO_BATCHES),
                   "--lora-r", str(REAL_LORA_R), "--setups", ",".join(REAL_SETUPS)]  # fmt: skip
        self.out = out
        self.procs = [subprocess.Popen(command, env=env | {"RANK": str(r)}, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True) for r in range(2)]  # fmt: skip
        self._result: dict | None = None

    def result(self) -> dict:
        """Rank 0's figures by set-up, once both processes ended."""
        if self._result is None:
            try:
                outputs = [proc.communicate(timeout=300)[0] for proc in self.procs]
            finally:
                self.close()
            for proc, output in zip(self.procs, outputs):
                assert proc.returncode == 0, output[-4000:]
            self._result = json.loads((self.out / "rank0.json").read_text())
        return self._result

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    run = _RealRun(tmp_path_factory.mktemp("simulate_real"))
    yield run
    run.close()


@pytest.fixture(scope="module", autouse=True)
def _start_real_run_early(request):
    """Start the real run with the module's first test when a selected test reads it: it runs on
    the second core while the simulations run on the first (its tests come last)."""
    if any("real_run" in item.fixturenames for item in request.session.items if item.module is request.module):
        request.getfixturevalue("real_run")


@pytest.mark.parametrize("setup", REAL_SETUPS)
def test_simulated_peak_matches_the_real_step(real_run, setup):
    """The simulation's rank 0 against the real rank 0, same model, set-up and step, tracked by the
    same FSDPMemTracker. Tolerance: 0.1% of the peak (measured: equal but for 4 KiB of 20-40 MiB
    in activations; every other category, and the bytes sent, equal to the byte)."""
    from toolkit.models.adapters import LoRAArgs

    precision, finetune, *rest = setup.split(":")
    sim = simulate(
        Config.from_name("llama-3.1-8b", **REAL_OVERRIDES), 2, 1, REAL_BATCH, REAL_SEQ, precision, "FULL_SHARD",
        None if finetune == "pretrain" else finetune, LoRAArgs(r=REAL_LORA_R) if finetune == "lora" else None,
        rest == ["checkpointing"], REAL_MICRO_BATCHES,
    )  # fmt: skip
    real = real_run.result()[setup]
    peak = dict(real["peak"])
    assert peak["Total"] > 15 * 2**20  # the step did run: activations, gathered blocks, the loss
    # Beside busy processes (1 real run in 4 beside two CPU-bound ones), the real peak can fall at
    # a moment when the flat all-gather buffer of the embedding or head (same size) is still alive:
    # +1,051,648 bytes of "All Gather" and 8 KiB less activation in float32. The simulation's
    # synchronous fake collectives never take that order. Only that one buffer is taken out; every
    # figure must then match as always.
    padded_vocab = -(-REAL_OVERRIDES["vocab_size"] // 2) * 2
    if peak.get("All Gather", 0) in {padded_vocab * REAL_OVERRIDES["n_embd"] * size for size in (2, 4)}:
        peak["Total"] -= peak.pop("All Gather")
    assert sim.peak_total == pytest.approx(peak["Total"], rel=1e-3)
    for key in CATEGORIES:
        assert sim.peak.get(key, 0) == pytest.approx(peak.get(key, 0), rel=1e-3, abs=8192), key
    assert sim.persistent == real["persistent"]
    assert sim.sent_bytes == real["sent"]


def test_the_heads_flat_gather_output_is_freed_before_the_loss():
    """FSDP2 keeps a unit's flat all-gather output in the forward pass until the next unit gathers
    (so that the next gather overlaps the copy-out). After the head nothing gathers until the
    backward pass, so without `fsdp._free_flat_gather_output` a second copy of the gathered head
    would stay alive through the loss (a synchronous gather on 2 fake ranks, as NCCL's default)."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from toolkit.models.gpt import GPT, Block
    from toolkit.args import DistributedArgs
    from toolkit.models.loss import loss_settings
    from toolkit.parallel.fsdp import shard_model
    from toolkit.parallel.plan import plan_strategy

    config = Config(name="edges", vocab_size=96, block_size=16, n_layer=2, n_embd=32, n_head=4)
    plan = plan_strategy(2, 1, "32-true", DistributedArgs(strategy="fsdp", sharding="FULL_SHARD"), accelerator="cpu")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with torch.device("meta"):
            model = GPT(config)
        shard_model(model, init_device_mesh("cpu", (2,)), plan, Block)
        group = model.lm_head._get_fsdp_state()._fsdp_param_group
        seen = {}
        model.lm_head.register_forward_hook(lambda m, a, out: seen.update(kept=group.comm_ctx.all_gather_state))
        with FakeTensorMode(allow_non_fake_inputs=True), loss_settings(reuse_scratch=False, skip_ignored=False):
            model.to_empty(device="cpu")
            ids = torch.zeros(1, 8, dtype=torch.long)
            model(ids, labels=ids)
    finally:
        dist.destroy_process_group()
    assert "kept" in seen and seen["kept"] is None



def test_the_simulation_does_not_count_dtensor_sharding_propagation():
    """DTensor works out an op's output shape by running the op once more on fake tensors of its
    global shapes (then caches it). Under the simulation's fake mode the tracker counted those fake
    global copies: torch 2.11 caches none for the optimizer step, and every tracked step of
    tiny-llama was implausible, 4 fake copies of the full parameters counted as optimizer state
    (seen on an H100 with torch 2.11; 2.13 hits its cache there). Here a propagation runs inside
    the tracker on purpose: it must leave the peak where it was."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from toolkit.memory.simulation import _tracker_class

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        with FakeTensorMode():
            model = fully_shard(nn.Linear(8, 8), mesh=mesh)
            shape, stride = (4096, 1024), (1024, 1)  # 16 MiB in float32, globally
            spec = DTensorSpec(mesh, (Shard(0),), tensor_meta=TensorMeta(torch.Size(shape), stride, torch.float32))
            schema = OpSchema(torch.ops.aten.add.Tensor, (spec, spec), {})
            tracker = _tracker_class()(model)
            with tracker:
                before = tracker.get_tracker_snapshot("peak")
                DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_non_cached(schema)
                after = tracker.get_tracker_snapshot("peak")
        assert after == before
    finally:
        dist.destroy_process_group()

