"""The start-up pre-flight: does a training step fit in the device's memory?

Training calls `check_fits` once, before any weight is read (`check_fits_device` in
`toolkit.training.session`); nothing here imports training.
"""

from __future__ import annotations

from typing import Any, Optional

from toolkit.errors import UserError
from toolkit.memory.estimator import column_memory
from toolkit.memory.options import GiB, Options, make_column
from toolkit.models.adapters import LoRAArgs
from toolkit.parallel.plan import effective_sharding


def check_fits(
    device_bytes: int, config: Any, devices: int, num_nodes: int, micro_batch_size: int, max_seq_length: int,
    precision: str, sharding: str, activation_checkpointing: bool, finetune: Optional[str] = None,
    lora: Any = None, quantize: Optional[str] = None, headroom: float = 0.95, cpu_offload: bool = False,
    pairs: bool = False, frozen_copy: bool = False, expert_parallel: int = 1,
) -> str:
    """Refuse (UserError, one line) a training set-up whose per-device peak exceeds `headroom` x
    `device_bytes`; return the line saying it fits otherwise.

    `sharding`: the FSDP sharding, or "single" / "DDP". `finetune`: None (pretraining), "full", or
    "lora" with the adapters of `lora` (a `toolkit.models.adapters.LoRAArgs`; default LoRAArgs()).
    Uses the estimate (`toolkit.memory.estimator.column_memory`; tests hold it to the simulation),
    because a simulated 70B step takes most of a minute. At Llama-3.1-70B on 8 GPUs it takes
    0.6 s in a training process (the model built on meta, its blocks and loss recorded on fake
    tensors), 0.2 s for each further set-up it tries; a process that has not yet imported
    torch._dynamo (Lightning has, in training) pays 2-3 s more for that import, which fake tensors
    need (benchmarks/preflight_time.py, 2 shared CPU cores at load 3.4). The refusal names the
    estimate and the nearest settings that fit: FULL_SHARD instead of HYBRID_SHARD, activation
    checkpointing, a smaller micro-batch (tried in that order, and combined), and last FSDP's CPU
    offload. `cpu_offload` is the run's (FSDP only: ignored on one device and with DDP, as training
    ignores it).

    `quantize` (QLoRA): fake tensors cannot run the 4-bit kernels, so the figure for the quantized
    base is the analytic one in any case: its bytes (per rank for an nf4 base, which FSDP shards;
    the whole bnb.* base, which every device holds) and one dequantized weight at a time, held to
    real bitsandbytes layers and torchao's NF4 in tests/test_estimate.py.

    `pairs`, `frozen_copy`: a preference objective's micro-batch of pairs (two rows each) and a
    frozen copy of the model as its reference (`toolkit.memory.options.Options`).

    `expert_parallel`: a mixture of experts' experts split over this many ranks of the shard group
    (`Options.expert_parallel`). For a mixture of experts under FSDP the refusal also tries each
    larger degree that divides the experts and the shard group, before any other change (it gathers
    fewer experts per block and sends tokens instead of weights: no slower, unlike the others).
    """
    lora_modules: tuple[str, ...] = ()
    lora_dropout = 0.0
    if finetune == "lora":
        lora = lora or LoRAArgs()
        lora_modules, lora_dropout = (*lora.module_names(), *lora.parameter_names()), float(lora.dropout)
    world = devices * num_nodes
    shard = sharding if world > 1 else "single"
    if shard not in ("single", "DDP"):
        shard = effective_sharding(shard, num_nodes, devices)[0]
    sharded = shard not in ("single", "DDP")

    def options(offload: bool, ep: int) -> Options:
        return Options(config, precision, finetune, lora_modules, lora.r if lora_modules else 8, quantize,
                       max_seq_length, lora_dropout=lora_dropout, cpu_offload=offload and sharded, pairs=pairs,
                       frozen_copy=frozen_copy, expert_parallel=ep)  # fmt: skip

    budget = int(device_bytes * headroom)

    def need(shard: str, ckpt: bool, micro: int, offload: bool = cpu_offload, ep: int = expert_parallel) -> int:
        figures = column_memory(options(offload, ep), make_column(shard, devices, num_nodes), micro)
        return figures["total_checkpointed" if ckpt else "total"]

    def degrees(shard: str) -> list[int]:
        """The expert-parallel degrees to try with `shard`: the run's, and each larger one that divides
        the experts and the shard group (a mixture of experts under FSDP)."""
        group = make_column(shard, devices, num_nodes).shard_size if sharded else 1
        larger = [n for n in range(expert_parallel + 1, group + 1)
                  if config.is_moe and quantize is None  # training refuses expert parallelism on a quantized base
                  and config.n_expert % n == 0 and group % n == 0 and n % expert_parallel == 0]
        return [expert_parallel] + larger

    wanted = need(shard, activation_checkpointing, micro_batch_size)
    line = (f"memory pre-flight: about {wanted / GiB:.1f} GiB per device at the peak of a step "
            f"(estimate) of {device_bytes / GiB:.1f} GiB")
    if wanted <= budget:
        return line + ": fits."
    # (offload turned on, sharding changed, checkpointing turned on, micro-batch lowered, expert
    # parallelism raised): the fewest changes first, the costliest avoided first
    tries = []
    shards = [shard] + (["FULL_SHARD"] if shard == "HYBRID_SHARD" else [])
    for offload in sorted({cpu_offload, cpu_offload or sharded}):
        for s in shards:
            for ep in degrees(s):
                for ckpt in sorted({activation_checkpointing, True}):
                    micro = micro_batch_size
                    while micro >= 1:
                        if (offload, s, ep, ckpt, micro) != (cpu_offload, shard, expert_parallel, activation_checkpointing,
                                                             micro_batch_size):
                            total = need(s, ckpt, micro, offload, ep)
                            if total <= budget:
                                tries.append((offload != cpu_offload, s != shard, ckpt != activation_checkpointing,
                                              micro_batch_size - micro, ep, offload, s, ckpt, micro, total))  # fmt: skip
                                break
                        micro //= 2
    if tries:
        *_, ep, offload, s, ckpt, micro, total = min(tries)
        changes = []
        if ep != expert_parallel:
            changes.append(f"--distributed.expert_parallel {ep}")
        if s != shard:
            changes.append(f"--distributed.sharding {s}")
        if ckpt != activation_checkpointing:
            changes.append("--distributed.activation_checkpointing true")
        if micro != micro_batch_size:
            changes.append(f"--train.micro_batch_size {micro}")
        if offload != cpu_offload:
            changes.append("--distributed.cpu_offload true")
        advice = f"{' '.join(changes)} fits ({total / GiB:.1f} GiB)"
    else:
        instead = {None: "LoRA", "full": "LoRA"}.get(finetune, "a quantized base (--quantize nf4)" if quantize is None else None)
        advice = ("no sharding, checkpointing, micro-batch or CPU offload setting fits: use more devices"
                  + (f" or {instead}" if instead else "") + " (see `toolkit estimate`)")
    raise UserError(f"{line}: does not fit. {advice}; or skip this check with --distributed.preflight false.")


def check_run_fits(device_bytes: int, config: Any, run_plan: Any, finetune: Optional[str] = None, lora: Any = None,
                   pairs: bool = False, frozen_copy: bool = False) -> str:
    """`check_fits` for a run's plan (`toolkit.parallel.plan.RunPlan`): the one call training makes.
    The plan says the devices, precision, strategy and sharding, checkpointing, CPU offload, expert
    parallelism, batch and the quantized base; `finetune` and `lora` say what trains, `pairs` and
    `frozen_copy` what the objective adds (`Objective.memory_profile`)."""
    strategy, batches = run_plan.strategy, run_plan.batches
    sharding = strategy.sharding if strategy.kind == "fsdp" else ("single" if strategy.kind == "single" else "DDP")
    return check_fits(
        device_bytes, config, strategy.devices, strategy.num_nodes, batches.micro_batch_size, batches.max_seq_length,
        strategy.precision, sharding, strategy.activation_checkpointing, finetune=finetune, lora=lora,
        quantize=run_plan.quantize, cpu_offload=strategy.cpu_offload, pairs=pairs, frozen_copy=frozen_copy,
        expert_parallel=strategy.expert_parallel,
    )
