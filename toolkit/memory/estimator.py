"""`toolkit estimate`: how much memory one device needs to train a model, before you start.

For every strategy the memory of one device is split into:

    parameters        the (sharded) stored weights, in the dtypes of the precision policy
    gradients         one gradient per trainable weight, in the trainable dtype (under FSDP, a shard)
    optimizer state   AdamW: exp_avg and exp_avg_sq per trainable weight, in the trainable dtype
    activations       what autograd saves in the forward pass for the backward pass, with and
                      without checkpointing
    logits and loss   what the head and the loss keep, and their transient buffers
    weight copies     autocast's 16-bit copies of float32 weights (one device, DDP)
    buffers           FSDP's gathered weights, all-gather outputs, unsharded gradients and
                      reduce-scatter inputs; DDP's gradient buckets; a quantized base's dequantized weight

Parameters come from the model built on the meta device (`toolkit.memory.parameters`), saved
activations from the model's own forward and backward passes on fake tensors
(`toolkit.memory.activations`): nothing here repeats the model's structure. These do not all exist
at once: the peak is parameters + gradients + optimizer state + the largest of what is alive beside
them at the moments of a step at which it can peak (`toolkit.memory.moments`). Gradients are
counted throughout (alive through every micro-batch under gradient accumulation).

Assumptions (the toolkit's own set-up): the precision policy of `precision_dtypes` (trainable
weights, their gradients and AdamW state float32 under "*-mixed" and "32-true", frozen weights in
the compute dtype; "*-true" all 16-bit); attention in a fused kernel (no T x T matrix); FSDP2 as
`shard_model` applies it (one unit per block, the embedding, the final norm and the head; a tied
embedding and head in the root), each parameter split along dim 0 and padded to equal shards
(expert weights whose experts do not split evenly: along dim 1, `expert_shard_dim`);
DDP's bucket copy of the gradients; QLoRA as finetune_lora runs it (bitsandbytes replicated with
DDP, torchao's NF4 sharded by FSDP2); CPU offload moves shards, gradients and AdamW state to the
host. Whose kernels (`Options.device`): CUDA's by default; the tests use the CPU's ("cpu", real
runs) and those of fake tensors on the CPU ("fake", the simulation).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, Optional, get_args

from toolkit.args import QUANTIZE_CHOICES, DistributedArgs, QuantizeName, ShardingName, StrategyName
from toolkit.errors import UserError, check_choice
from toolkit.memory.activations import Activations, activations
from toolkit.memory.moments import Moment, step_moments, strategy_moments
from toolkit.memory.options import COLUMN_ORDER, GiB, Column, Options, make_column
from toolkit.memory.parameters import (
    ParamSpec,
    fsdp_rank_memory,
    nf4_dequant_bytes,
    nf4_unshardable,
    parameter_specs,
    run_specs,
    quantized_bytes,
    quantized_names,
)
from toolkit.models.config import CONFIG_FILENAME, Config
from toolkit.models.gpt import count_parameters, flops_per_token

# The preference objectives (`toolkit.training.preference_objectives`, which this package does not import) and
# whether each keeps a reference model (its `uses_reference`; tests/test_preference_memory.py holds them equal).
PREFERENCE_REFERENCE = {"dpo": True, "ipo": True, "simpo": False, "orpo": False}
ObjectiveName = Literal["sft", "dpo", "ipo", "simpo", "orpo"]
from toolkit.models.adapters import PARAMETER_TARGETS, TARGETS, LoRAArgs

LORA_TARGETS = {**TARGETS, **PARAMETER_TARGETS}
from toolkit.parallel.plan import QUANTIZED_BASE_NOT_SHARDED, effective_sharding, plan_quantized_base
from toolkit.parallel.precision import PRECISION_ALIASES, PRECISIONS


# --------------------------------------------------------------------------------------------
# One strategy column
# --------------------------------------------------------------------------------------------


def column_memory(opts: Options, column: Column, micro_batch_size: int) -> dict[str, int]:
    """Bytes per device of every component for one strategy. The totals are the parameters,
    gradients and optimizer state plus the largest moment of `step_moments`."""
    specs = run_specs(opts)
    quantized = quantized_names(opts, specs)

    def stored(s: ParamSpec) -> int:
        if s.name in quantized:
            return quantized_bytes(s.shape, opts.quantize)  # type: ignore[arg-type]
        return s.numel * opts.param_bytes(s)

    out: dict[str, int] = {}
    if column.kind != "fsdp":
        out["parameters"] = sum(stored(s) for s in specs)
        out["gradients"] = sum(s.numel * opts.trainable_bytes for s in specs if s.trainable)
        out["optimizer_state"] = 2 * out["gradients"]
    else:
        ranks = fsdp_rank_memory(specs, column, opts)
        out["parameters"] = ranks[0]["parameters"]
        out["gradients"] = ranks[0]["gradients"]
        out["optimizer_state"] = max(r["optimizer_state"] for r in ranks)  # the fullest rank
    # The reference model of full fine-tuning under DPO / IPO: every weight again, frozen (the
    # compute dtype), sharded like the trained model; its forward pass runs under no_grad.
    out["reference_model"] = reference_copy_bytes(opts, column, specs) if opts.frozen_copy else 0
    out["host_offload"] = 0
    if column.kind == "fsdp" and opts.cpu_offload:
        # CPUOffloadPolicy: the shards, their gradients and AdamW state are host memory, and the
        # step runs there. Each unit's shards are copied to the device for its all-gather (the
        # all-gather inputs of `fsdp_moments`) and its reduced gradients copied back.
        out["host_offload"] = out["parameters"] + out["gradients"] + out["optimizer_state"]
        out["host_offload"] += out["reference_model"]
        for key in ("parameters", "gradients", "optimizer_state", "reference_model"):
            out[key] = 0
    # A preference objective's micro-batch of pairs is twice as many rows (chosen and rejected).
    act = micro_batch_activations(opts, column, micro_batch_size * opts.rows_per_sample, specs, quantized)
    out["activations"] = act.stored
    out["activations_checkpointed"] = act.checkpointed
    out["logits_and_loss"] = act.logits
    out["weight_copies"] = act.weight_copies
    # the most the strategy holds at one moment (gradients on their way to be reduced included)
    out["buffers"] = max(sum(m.values()) for m in strategy_moments(specs, column, opts).values()) + act.dequant_scratch
    persistent = out["parameters"] + out["gradients"] + out["optimizer_state"] + out["reference_model"]
    for key, checkpointed in (("total", False), ("total_checkpointed", True)):
        moments = step_moments(opts, column, act, checkpointed, specs)
        out[key] = persistent + max(sum(m.values()) for m in moments.values())
    return out


def reference_copy_bytes(opts: Options, column: Column, specs: list[ParamSpec]) -> int:
    """Bytes on one device of a frozen copy of the model's weights (no adapters), sharded as the
    trained model is: what `Session.build_model(frozen=True)` builds beside it."""
    from dataclasses import replace

    frozen = [replace(s, trainable=False) for s in run_specs(replace(opts, lora_modules=()))]
    if column.kind != "fsdp":
        return sum(s.numel * opts.frozen_bytes for s in frozen)
    plain = replace(opts, quantize=None)  # the copy is never quantized (full fine-tuning)
    return fsdp_rank_memory(frozen, column, plain)[0]["parameters"]


def peak_moment(opts: Options, column: Column, micro_batch_size: int, checkpointed: bool) -> tuple[str, Moment]:
    """The moment of `step_moments` at which the step peaks, and what is alive then by category."""
    specs = run_specs(opts)
    act = micro_batch_activations(opts, column, micro_batch_size * opts.rows_per_sample, specs, quantized_names(opts, specs))
    moments = step_moments(opts, column, act, checkpointed, specs)
    return max(moments.items(), key=lambda item: sum(item[1].values()))


def micro_batch_activations(opts: Options, column: Column, micro_batch_size: int, specs: list[ParamSpec],
                            quantized: set[str]) -> Activations:  # fmt: skip
    """What a micro-batch of `micro_batch_size` rows leaves for the backward pass on one device
    (`toolkit.memory.activations`), with the weights as the column's strategy shows them to the
    forward pass (`Options.gathered_bytes`), and the largest quantized weight dequantized.

    With expert parallelism, the routed rows are taken as balanced over the ranks: each rank's
    experts compute on as many rows as they would without it (what they save is the recording's),
    their backward pass makes the weight gradients of its own experts only (`Recording.grads_in_flight`),
    and one MoE layer's all-to-alls hold a send and a receive buffer of those rows, in the hidden
    states' dtype, beside them (`Activations.all_to_all`). A router that sends more of the tokens
    to one rank's experts puts more rows there (`router/load_max` in the training log says how
    many more)."""
    largest = max((s.numel for s in specs if s.name in quantized), default=0)
    if opts.quantize == "nf4":
        # torchao's `linear_nf4` dequantizes the whole weight in every call (`nf4_dequant_bytes`)
        scratch = nf4_dequant_bytes(largest, opts.compute_bytes)
    else:  # bitsandbytes dequantizes the weight into the compute dtype
        scratch = largest * opts.compute_bytes
    act = activations(opts, column.kind == "fsdp", micro_batch_size, scratch)
    c = opts.config
    if opts.expert_parallel > 1 and c.is_moe:
        tokens = micro_batch_size * opts.max_seq_length
        hidden_bytes = act.block_inputs[-1] // (tokens * c.n_embd)  # the residual stream's dtype
        act = replace(act, all_to_all=2 * tokens * c.n_expert_per_token * c.n_embd * hidden_bytes)
    return act


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


def estimate(
    model_name: str,
    devices: int = 1,
    num_nodes: int = 1,
    micro_batch_size: int = 1,
    max_seq_length: Optional[int] = None,
    precision: str = "bf16-mixed",
    strategy: StrategyName = "auto",
    sharding: Optional[ShardingName] = None,
    finetune: Optional[Literal["lora", "full"]] = None,
    lora_r: int = 8,
    lora_targets: tuple[str, ...] = ("query", "value"),
    lora_dropout: float = 0.05,
    quantize: Optional[QuantizeName] = None,
    activation_checkpointing: Optional[bool] = None,
    memory_budget_gb: Optional[float] = None,
    model_overrides: Optional[dict[str, Any]] = None,
    simulate: bool = False,
    cpu_offload: bool = False,
    objective: ObjectiveName = "sft",
    precompute_reference: bool = False,
    expert_parallel: int = 1,
) -> dict[str, Any]:
    """Estimate the memory per device of a training step, for each distributed strategy.

    Prints a table (rows: memory components, columns: strategies) and, with --memory_budget_gb, the
    cheapest set-up that fits. Figures are GiB (1024^3 bytes) per device. `toolkit estimate --recipe
    FILE` takes the settings of a training recipe (config_hub/ or your own; the model from its
    checkpoint_dir or model_name) and any option after it overrides them.

    Args:
        model_name: A preset name, alias or Hugging Face repo id, or a checkpoint directory.
        devices: Devices per node.
        num_nodes: Number of nodes.
        micro_batch_size: Sequences per forward/backward on one device.
        max_seq_length: Tokens per sequence; default: min(the model's context, 2048), as pretrain.
        precision: bf16-mixed, bf16-true, 16-mixed, 16-true or 32-true.
        strategy: "auto": FSDP (every sharding) and DDP side by side when there is more than one
            device; "fsdp" or "ddp" to show only those. One device in total is always "single".
        sharding: Show only this FSDP sharding strategy (default: all of them).
        finetune: None (pretraining) or "full": every weight trains; "lora": only the adapters.
        lora_r: LoRA rank.
        lora_targets: Layers that get adapters: query, key, value, projection, mlp, head; experts (a mixture
            of experts' weights; with lora_dropout 0).
        lora_dropout: Dropout on the adapters' input (finetune_lora's default 0.05; 0 saves a mask per input).
        quantize: Quantization of the frozen linear weights (QLoRA; needs finetune lora): nf4
            (torchao, sharded by FSDP2 on several devices) or bnb.* (bitsandbytes, replicated).
        activation_checkpointing: Recompute each block in the backward pass (true), store its
            activations (false), or show both (default).
        memory_budget_gb: Memory per device in GiB; recommends the cheapest configuration that fits.
        model_overrides: Config fields to change, e.g. '{n_layer: 2}'.
        simulate: Also run the real training step (FSDP2, LoRA, precision, AdamW) on fake tensors
            and devices x num_nodes fake ranks, and print each rank's peak by category and the
            bytes it sends per step (`toolkit.memory.simulation`; up to a minute for 70B). For the FSDP
            sharding given (default HYBRID_SHARD); not for QLoRA (quantized weights need real data).
        cpu_offload: FSDP's CPU offload (--distributed.cpu_offload): the shards, gradients and AdamW
            state of each device live in host memory (shown apart); FSDP columns only.
        objective: sft, or a preference loss (dpo, ipo, simpo, orpo; fine-tuning only): its
            micro-batch of pairs is twice as many rows, and full fine-tuning under dpo or ipo keeps
            a frozen copy of the model as its reference (LoRA's reference is its own base).
        precompute_reference: dpo, ipo: the reference's log-probabilities computed before training,
            so that no reference model is alive while training (--objective.precompute_reference).
        expert_parallel: A mixture of experts' experts split over this many ranks of each FSDP shard
            group (--distributed.expert_parallel): each rank keeps n_expert / N experts of every MoE
            layer, sharded over the shard group / N ranks, and gathers only those; tokens travel to
            their experts' ranks and back by all-to-all (balanced routing assumed). N divides the
            experts and the shard group (the devices, or the devices per node under HYBRID_SHARD).
    """
    opts, columns, notes, chosen_ckpt = _resolve(
        model_name, devices, num_nodes, micro_batch_size, max_seq_length, precision, strategy, sharding, finetune,
        lora_r, lora_targets, lora_dropout, quantize, activation_checkpointing, memory_budget_gb, model_overrides,
        cpu_offload, objective, precompute_reference, expert_parallel,
    )  # fmt: skip
    c = opts.config
    specs = parameter_specs(c, opts.lora_modules, opts.lora_r)
    result: dict[str, Any] = {
        "model": c.name,
        "parameters": sum(s.numel for s in specs),
        "trainable_parameters": sum(s.numel for s in specs if s.trainable),
        "precision": opts.precision,
        "micro_batch_size": micro_batch_size,
        "max_seq_length": opts.max_seq_length,
        "devices": devices,
        "num_nodes": num_nodes,
        "finetune": finetune,
        "quantize": quantize,
        "lora_dropout": opts.lora_dropout,
        "activation_checkpointing": activation_checkpointing,
        "cpu_offload": opts.cpu_offload,
        "objective": objective,
        "expert_parallel": opts.expert_parallel,
        # per token: the weights it computes with (of a mixture of experts, its K experts) and the
        # training FLOPs (what MFU counts, `toolkit.models.gpt.flops_per_token`)
        "experts": c.n_expert,
        "active_parameters": count_parameters(c, active=True),
        "flops_per_token": flops_per_token(c, opts.max_seq_length,
                                           sum(s.numel for s in specs if s.trainable) / sum(s.numel for s in specs)),
        "columns": [col.name for col in columns],
        "strategies": {col.name: column_memory(opts, col, micro_batch_size) for col in columns},
        "notes": notes,
        "recommendation": None,
    }
    if opts.cpu_offload:
        host = max(figures["host_offload"] for figures in result["strategies"].values())
        notes.append(f"CPU offload: each device's parameter shards, gradients and AdamW state ({host / GiB:.2f} GiB "
                     "at most, shown as 0 above) live in host memory, and the optimizer step runs on the CPU.")
    if memory_budget_gb is not None:
        result["recommendation"] = recommend(
            opts, columns, micro_batch_size, memory_budget_gb, chosen_ckpt, devices, num_nodes
        )
    print(format_table(result))
    if simulate:
        result["simulation"] = _simulate(opts, devices, num_nodes, micro_batch_size, sharding, lora_r, lora_targets,
                                         lora_dropout, bool(activation_checkpointing))
    return result


def _simulate(opts: "Options", devices, num_nodes, micro_batch_size, sharding, lora_r, lora_targets, lora_dropout,
              checkpointing: bool):  # fmt: skip
    """Run `toolkit.memory.simulation` for the set-up, print its table; None (with a note) where it cannot run."""
    if opts.quantize is not None:
        print(f"note: {opts.quantize} cannot be simulated (quantized weights need real data): the figures above "
              "are the analytic estimate.")
        return None
    if devices * num_nodes == 1:
        print("note: the simulation runs FSDP over more than one device; for one device the analytic figures stand.")
        return None
    if opts.precision == "32-true" and opts.config.is_moe:
        print("note: a mixture of experts cannot be simulated in 32-true (torch's fake grouped products take bf16 "
              "only): the figures above are the analytic estimate.")
        return None
    from toolkit.memory.simulation import simulate

    lora = None
    if opts.finetune == "lora":
        lora = LoRAArgs(r=lora_r, alpha=2 * lora_r, dropout=lora_dropout, targets=tuple(lora_targets))
    result = simulate(
        opts.config, devices, num_nodes, micro_batch_size, opts.max_seq_length, opts.precision,
        sharding or "HYBRID_SHARD", opts.finetune, lora, checkpointing, pairs=opts.pairs, frozen_copy=opts.frozen_copy,
        expert_parallel=opts.expert_parallel,
    )
    print()
    print(result.table())
    return result


def _resolve(
    model_name, devices, num_nodes, micro_batch_size, max_seq_length, precision, strategy, sharding, finetune,
    lora_r, lora_targets, lora_dropout, quantize, activation_checkpointing, memory_budget_gb, model_overrides,
    cpu_offload=False, objective="sft", precompute_reference=False, expert_parallel=1,
):  # fmt: skip
    """Validate the arguments (UserError) and decide the columns to show."""
    for name, value in (("devices", devices), ("num_nodes", num_nodes), ("micro_batch_size", micro_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{name} must be a positive whole number, got {value!r}.")
    overrides = dict(model_overrides or {})
    if (Path(model_name) / CONFIG_FILENAME).is_file():  # a checkpoint directory
        config = Config.from_file(model_name)
        config = config.replace(**overrides) if overrides else config
    else:
        config = Config.from_name(model_name, **overrides)
    if max_seq_length is None:
        max_seq_length = min(config.block_size, 2048)
    if isinstance(max_seq_length, bool) or not isinstance(max_seq_length, int) or max_seq_length < 1:
        raise UserError(f"max_seq_length must be a positive whole number, got {max_seq_length!r}.")
    if max_seq_length > config.block_size:
        raise UserError(
            f"max_seq_length {max_seq_length} is larger than the context of {config.name} "
            f"({config.block_size} tokens); use at most {config.block_size}."
        )
    name = PRECISION_ALIASES.get(str(precision).lower(), str(precision).lower())
    check_choice("precision", precision if name not in PRECISIONS else name, PRECISIONS)
    check_choice("strategy", strategy, get_args(StrategyName))
    if sharding is not None:
        check_choice("sharding", sharding, get_args(ShardingName))
        if strategy == "ddp":
            raise UserError("sharding applies to FSDP; leave it out with strategy ddp, or use strategy fsdp.")
    if finetune not in (None, "lora", "full"):
        raise UserError(f"Unknown finetune {finetune!r}; choose lora or full (or leave it out for pretraining).")
    if quantize is not None:
        check_choice("quantize", quantize, QUANTIZE_CHOICES)
    if quantize is not None and finetune != "lora":
        raise UserError("quantize applies to frozen weights: use it with finetune lora (QLoRA).")
    lora_modules: tuple[str, ...] = ()
    if finetune == "lora":
        if isinstance(lora_r, bool) or not isinstance(lora_r, int) or lora_r < 1:
            raise UserError(f"lora_r must be a positive whole number, got {lora_r!r}.")
        if isinstance(lora_targets, str):
            lora_targets = (lora_targets,)
        if not lora_targets:
            raise UserError(f"lora_targets is empty; choose from {', '.join(LORA_TARGETS)}.")
        for target in lora_targets:
            check_choice("lora target", target, tuple(LORA_TARGETS))
        if quantize is not None and "head" in lora_targets:
            raise UserError("lora target head cannot be combined with quantize: the head is not quantized; drop 'head'.")
        if isinstance(lora_dropout, bool) or not isinstance(lora_dropout, (int, float)) or not 0 <= lora_dropout < 1:
            raise UserError(f"lora_dropout must be in [0, 1), got {lora_dropout!r}.")
        if any(t in PARAMETER_TARGETS for t in lora_targets):
            if not config.is_moe:
                raise UserError(f"lora target experts: {config.name} has no mixture of experts; drop 'experts'.")
            if lora_dropout:
                raise UserError(f"lora target experts needs lora_dropout 0 (got {lora_dropout}), as finetune_lora does.")
        leaves = {leaf for t in lora_targets for leaf in LORA_TARGETS[t]}
        lora_modules = tuple(sorted(leaves))
    if memory_budget_gb is not None and (isinstance(memory_budget_gb, bool) or not memory_budget_gb > 0):
        raise UserError(f"memory_budget_gb must be a positive number of GiB, got {memory_budget_gb!r}.")
    if activation_checkpointing not in (None, True, False):
        raise UserError(
            f"activation_checkpointing must be true, false or left out, got {activation_checkpointing!r}."
        )
    if cpu_offload not in (True, False):
        raise UserError(f"cpu_offload must be true or false, got {cpu_offload!r}.")
    check_choice("objective", objective, tuple(PREFERENCE_REFERENCE) + ("sft",))
    if objective != "sft" and finetune is None:
        raise UserError(f"objective {objective} is a fine-tuning objective: pass finetune lora or full.")
    if precompute_reference and not PREFERENCE_REFERENCE.get(objective, False):
        raise UserError(f"precompute_reference applies to dpo and ipo (a reference model); {objective} has none.")

    notes: list[str] = []
    world = devices * num_nodes
    columns: list[Column] = []
    if world == 1:
        columns.append(make_column("single", 1, 1))
        if strategy != "auto" or sharding is not None:
            notes.append("One device in total: a single device is used whatever the strategy.")
    else:
        if quantize is not None:
            # The scheme training plans for this base (`plan_quantized_base`): nf4 sharded by FSDP2,
            # bitsandbytes replicated with DDP; what it refuses is refused here with its words.
            plan_quantized_base(devices, num_nodes, DistributedArgs(strategy=strategy, sharding=sharding or "HYBRID_SHARD"),
                                quantize, accelerator="cpu")
        if quantize == "nf4":
            notes.append(f"QLoRA nf4 on {world} devices runs as finetune_lora runs it: FSDP2 shards the NF4 base "
                         "like every frozen weight, so its bytes per device fall as 1/N.")
        if quantize is not None and quantize != "nf4":
            if sharding is not None:  # a sharding column was asked for a base that is never sharded
                raise UserError(
                    f"quantize cannot be combined with FSDP sharding: {QUANTIZED_BASE_NOT_SHARDED}. Leave strategy "
                    "and sharding out: finetune_lora then replicates the quantized base and synchronises the adapters."
                )
            columns.append(make_column("DDP", devices, num_nodes))
            notes.append(
                f"QLoRA on {world} devices runs as finetune_lora runs it: every device holds the whole quantized base "
                "and DDP synchronises only the LoRA adapters (the DDP column)."
            )
        else:
            if strategy == "ddp":
                columns.append(make_column("DDP", devices, num_nodes))
            else:
                wanted = [sharding] if sharding else ["NO_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "FULL_SHARD"]
                if quantize == "nf4" and not sharding:
                    # QLoRA shards its base to fit: finetune_lora's default sharding (HYBRID_SHARD, which
                    # is FULL_SHARD on one node) and FULL_SHARD; NO_SHARD and SHARD_GRAD_OP keep every
                    # device's whole base (on the device, or in host memory with CPU offload).
                    wanted = ["HYBRID_SHARD", "FULL_SHARD"]
                for s in wanted:
                    if effective_sharding(s, num_nodes, devices)[0] != s:
                        why = "one node" if num_nodes == 1 else "one device per node"
                        notes.append(f"HYBRID_SHARD with {why} runs as FULL_SHARD (see toolkit.parallel.plan.effective_sharding).")
                        if sharding:
                            columns.append(make_column("FULL_SHARD", devices, num_nodes))
                        continue
                    columns.append(make_column(s, devices, num_nodes))
                if strategy == "auto" and sharding is None and quantize is None:
                    columns.append(make_column("DDP", devices, num_nodes))
    if quantize == "nf4":
        for col in columns:
            weight = nf4_unshardable(config, col.shard_size)
            if weight is not None and col.shard_size == 1:
                raise UserError(f"quantize nf4 cannot quantize {weight}: NF4 takes whole groups of 16384 values; "
                                "quantize bnb.nf4 (dense models) or none.")
            if weight is not None:
                raise UserError(
                    f"quantize nf4 cannot split {weight} over {col.shard_size} shards ({col.name}): each needs "
                    "whole groups of 16384 values; use fewer devices or quantize bnb.nf4."
                )
    if cpu_offload and not any(col.kind == "fsdp" for col in columns):
        notes.append("cpu_offload applies to FSDP only (more than one device, not DDP): ignored.")
    if quantize is not None and expert_parallel != 1:
        raise UserError(f"expert_parallel {expert_parallel} is not available with a quantized base (quantize "
                        f"{quantize}), as in training: drop one of them.")
    columns = _expert_parallel_columns(config, expert_parallel, columns, world, notes)
    columns.sort(key=lambda col: COLUMN_ORDER.index(col.name))
    frozen_copy = finetune == "full" and PREFERENCE_REFERENCE.get(objective, False) and not precompute_reference
    if objective != "sft":
        reference = ("a frozen copy of the model, sharded like it (the 'reference model' row)" if frozen_copy
                     else "the base with the adapters switched off (no copy)" if finetune == "lora" and PREFERENCE_REFERENCE[objective]
                     else "log-probabilities computed before training (no model)" if precompute_reference
                     else "none: the loss is reference-free")
        notes.append(f"{objective}: a micro-batch of {micro_batch_size} pair(s) is {2 * micro_batch_size} rows (chosen "
                     f"and rejected) in one forward pass; reference: {reference}.")
    opts = Options(config, name, finetune, lora_modules, lora_r, quantize, max_seq_length,
                   lora_dropout=float(lora_dropout) if finetune == "lora" else 0.0, cpu_offload=cpu_offload,
                   pairs=objective != "sft", frozen_copy=frozen_copy, expert_parallel=expert_parallel)  # fmt: skip
    return opts, columns, notes, activation_checkpointing


def _expert_parallel_columns(config: Config, n: Any, columns: list[Column], world: int, notes: list[str]) -> list[Column]:
    """The columns expert parallelism over `n` ranks can run in (UserError where none): FSDP with a
    shard group that `n` divides, for a mixture of experts whose experts `n` divides."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UserError(f"expert_parallel must be a positive whole number, got {n!r}.")
    if n == 1:
        return columns
    if not config.is_moe:
        raise UserError(f"expert_parallel applies to a mixture of experts; {config.name} has no experts (leave it at 1).")
    if config.n_expert % n:
        raise UserError(f"expert_parallel {n} must divide the {config.n_expert} experts of {config.name}.")
    if world == 1:
        raise UserError(f"expert_parallel {n} needs more than one device.")
    if world % n:
        raise UserError(f"expert_parallel {n} must divide the number of devices ({world}).")
    kept = [col for col in columns if col.kind == "fsdp" and col.shard_size % n == 0]
    if not kept:
        raise UserError(f"expert_parallel runs under FSDP sharding whose shard group {n} divides (FULL_SHARD, "
                        "HYBRID_SHARD with the devices of a node, SHARD_GRAD_OP); not DDP or NO_SHARD.")
    if len(kept) < len(columns):
        dropped = ", ".join(col.name for col in columns if col not in kept)
        notes.append(f"expert_parallel {n}: {dropped} left out (expert parallelism runs under FSDP, over ranks of "
                     "one shard group).")
    notes.append(f"expert_parallel {n}: each rank keeps {config.n_expert // n} of the {config.n_expert} experts of "
                 "every MoE layer and gathers only those; routed rows taken as balanced over the ranks.")
    return kept


# --------------------------------------------------------------------------------------------
# Recommendation
# --------------------------------------------------------------------------------------------


def _max_micro_batch(opts: Options, column: Column, checkpointing: bool, budget: int) -> tuple[int, dict]:
    """The largest micro batch that fits in `budget` bytes (0 if not even one), and its figures."""
    key = "total_checkpointed" if checkpointing else "total"
    one = column_memory(opts, column, 1)
    if one[key] > budget:
        return 0, one
    two = column_memory(opts, column, 2)
    per_sample = two[key] - one[key]
    if per_sample <= 0:
        # The peak at one and two is a moment the micro-batch does not change (a large tied
        # embedding's gradient reduced at short sequences): double, then halve the step, up to 4096.
        fits, step = 2, 2
        while fits < 4096 and column_memory(opts, column, fits + step)[key] <= budget:
            fits, step = fits + step, step * 2
        while step > 1:
            step //= 2
            if fits + step <= 4096 and column_memory(opts, column, fits + step)[key] <= budget:
                fits += step
        return fits, column_memory(opts, column, fits)
    m = 1 + (budget - one[key]) // per_sample
    while m > 1 and column_memory(opts, column, m)[key] > budget:
        m -= 1
    return m, column_memory(opts, column, m)


def recommend(opts: Options, columns: list[Column], micro_batch_size: int, budget_gb: float,
              checkpointing: Optional[bool], devices: int, num_nodes: int) -> dict[str, Any]:  # fmt: skip
    """The cheapest set-up that fits `budget_gb` GiB per device.

    Without activation checkpointing first (it costs about a third more compute): the cheapest
    strategy (communication) that fits the requested micro batch, else the strategy that fits the
    largest micro batch. Checkpointing only when nothing fits without it.
    """
    budget = int(budget_gb * GiB)
    choices = [False, True] if checkpointing is None else [checkpointing]
    for ckpt in choices:
        fits = [(col, *_max_micro_batch(opts, col, ckpt, budget)) for col in columns]
        fits = [(col, m, fig) for col, m, fig in fits if m >= 1]
        if not fits:
            continue
        enough = [f for f in fits if f[1] >= micro_batch_size]
        col, m, _ = enough[0] if enough else max(fits, key=lambda f: f[1])  # max() keeps the first of ties
        m = min(m, 4096)
        pow2 = 1 << (m.bit_length() - 1)
        micro = micro_batch_size if enough else pow2
        fig = column_memory(opts, col, micro)
        total = fig["total_checkpointed" if ckpt else "total"]
        return {
            "fits": True,
            "strategy": col.name,
            "activation_checkpointing": ckpt,
            "micro_batch_size": micro,
            "max_micro_batch_size": m,
            "total": total,
            "budget": budget,
            "options": _training_options(col, micro, ckpt, opts.cpu_offload, opts.expert_parallel),
            "message": (
                f"Fits in {budget_gb:g} GiB per device: {_describe(col)}, micro batch {micro}"
                f"{'' if micro == m else f' (up to {m} fits)'}, activation checkpointing "
                f"{'on' if ckpt else 'off'}: {total / GiB:.2f} GiB.\n"
                f"Training options: {_training_options(col, micro, ckpt, opts.cpu_offload, opts.expert_parallel)}"
            ),
        }
    # Nothing fits: say by how much and what would help.
    best = min(columns, key=lambda col: column_memory(opts, col, 1)["total_checkpointed"])
    need = column_memory(opts, best, 1)["total_checkpointed"]
    hints = []
    spread = _expert_parallel_that_fits(opts, best, budget)
    if spread is not None:
        n, total = spread
        hints.append(f"expert parallelism (--expert_parallel {n}, in training --distributed.expert_parallel {n}: "
                     f"{total / GiB:.2f} GiB with {_describe(best)}, micro batch 1, activation checkpointing)")
    if opts.finetune != "lora":
        hints.append("fine-tune with LoRA (--finetune lora)")
    elif opts.quantize is None:
        hints.append("quantize the frozen weights (--quantize nf4)")
    more = _devices_needed(opts, budget)
    if more and more > devices * num_nodes:
        hints.append(f"more devices (FULL_SHARD fits on {more} devices in total, micro batch 1, checkpointing)")
    fig = column_memory(opts, best, 1)
    sequence = fig["activations_checkpointed"] + fig["logits_and_loss"]
    if more is None or sequence > budget / 4:
        hints.append(
            f"a shorter --max_seq_length (one sequence's activations and logits alone take {sequence / GiB:.2f} GiB)"
        )
    if opts.quantize in (None, "nf4") and devices * num_nodes > 1 and not opts.cpu_offload:
        hints.append(
            "CPU offload of FSDP parameters, gradients and optimizer state (--distributed.cpu_offload true; slow)"
        )
    return {
        "fits": False,
        "strategy": best.name,
        "activation_checkpointing": True,
        "micro_batch_size": 1,
        "total": need,
        "budget": budget,
        "message": (
            f"Does not fit in {budget_gb:g} GiB per device: the smallest set-up here ({_describe(best)}, "
            f"micro batch 1, activation checkpointing) needs {need / GiB:.2f} GiB. Try: " + "; ".join(hints) + "."
        ),
    }


def _expert_parallel_that_fits(opts: Options, col: Column, budget: int) -> Optional[tuple[int, int]]:
    """(N, bytes) for the smallest expert-parallel degree above the run's that makes `col` fit at
    micro batch 1 with checkpointing: N divides the experts and the shard group (FSDP), and is a
    multiple of the run's degree. None if there is none (or no mixture of experts, or a quantized
    base: training refuses expert parallelism with one)."""
    if not opts.config.is_moe or col.kind != "fsdp" or opts.quantize is not None:
        return None
    for n in range(opts.expert_parallel + 1, col.shard_size + 1):
        if opts.config.n_expert % n or col.shard_size % n or n % opts.expert_parallel:
            continue
        total = column_memory(replace(opts, expert_parallel=n), col, 1)["total_checkpointed"]
        if total <= budget:
            return n, total
    return None


def _devices_needed(opts: Options, budget: int) -> Optional[int]:
    if opts.quantize not in (None, "nf4"):  # bitsandbytes: replicated, more devices do not help
        return None
    world = 2
    while world <= 8192:
        if opts.quantize == "nf4" and nf4_unshardable(opts.config, world):
            return None
        if world % opts.expert_parallel == 0 and column_memory(opts, make_column("FULL_SHARD", world, 1), 1)["total_checkpointed"] <= budget:
            return world
        world *= 2
    return None


def _describe(col: Column) -> str:
    return {"single": "one device", "ddp": "DDP"}.get(col.kind, f"FSDP {col.name}")


def _training_options(col: Column, micro_batch_size: int, checkpointing: bool, cpu_offload: bool = False,
                      expert_parallel: int = 1) -> str:  # fmt: skip
    """The same set-up as options of the training commands."""
    options = []
    if col.kind == "ddp":
        options.append("--distributed.strategy ddp")
    elif col.kind == "fsdp":
        options.append(f"--distributed.sharding {col.name}")
        if cpu_offload:
            options.append("--distributed.cpu_offload true")
        if expert_parallel > 1:
            options.append(f"--distributed.expert_parallel {expert_parallel}")
    options.append(f"--train.micro_batch_size {micro_batch_size}")
    options.append(f"--distributed.activation_checkpointing {'true' if checkpointing else 'false'}")
    return " ".join(options)


# --------------------------------------------------------------------------------------------
# Printing
# --------------------------------------------------------------------------------------------

_ROWS = [
    ("parameters", "parameters", None),
    ("gradients", "gradients", None),
    ("optimizer_state", "optimizer state (AdamW)", None),
    ("activations", "activations", False),
    ("activations_checkpointed", "activations, checkpointed", True),
    ("logits_and_loss", "logits and loss", None),
    ("weight_copies", "autocast weight copies", None),
    ("buffers", "FSDP/DDP/quantization buffers", None),
    ("reference_model", "reference model (frozen copy)", None),
    ("total", "peak", False),
    ("total_checkpointed", "peak, checkpointed", True),
]


def format_table(result: dict[str, Any]) -> str:
    cols = result["columns"]
    figures = result["strategies"]
    ckpt = result["activation_checkpointing"]
    rows = [(key, label) for key, label, when in _ROWS if when is None or ckpt is None or when == ckpt]
    rows = [(key, label) for key, label in rows if key != "reference_model" or any(figures[c][key] for c in cols)]
    biggest = max(figures[c][k] for c in cols for k, _ in rows)
    unit, scale = ("GiB", GiB) if biggest >= GiB else ("MiB", 1024**2)
    width = max(len(label) for _, label in rows) + 2
    cell = max(11, *(len(c) + 2 for c in cols))
    rows_per_sample = 1 if result.get("objective", "sft") == "sft" else 2
    tokens = result["micro_batch_size"] * rows_per_sample * result["max_seq_length"]
    what = {None: "pretraining", "full": "full fine-tuning", "lora": "LoRA"}[result["finetune"]]
    if result["quantize"]:
        what = f"QLoRA ({result['quantize']})"
    if rows_per_sample == 2:
        what += f", {result['objective'].upper()} on pairs"
    if result.get("expert_parallel", 1) > 1:
        what += f", expert parallel {result['expert_parallel']}"
    lines = [
        f"{result['model']}: {result['parameters']:,} parameters ({result['trainable_parameters']:,} trainable), "
        f"{what}, {result['precision']}",
        f"micro batch {result['micro_batch_size']}{' pair(s) x 2 rows' if rows_per_sample == 2 else ''} x "
        f"{result['max_seq_length']} tokens = {tokens:,} tokens per device, "
        f"{result['devices']} device(s) x {result['num_nodes']} node(s). Memory per device, {unit}:",
        *([f"mixture of experts: {result['active_parameters']:,} parameters active per token; "
           f"{result['flops_per_token'] / 1e9:.2f} GFLOP per trained token (what MFU counts)"]
          if result.get("experts") else []),
        "",
        "".ljust(width) + "".join(c.rjust(cell) for c in cols),
    ]
    for key, label in rows:
        if key in ("total", "total_checkpointed"):
            lines.append("-" * (width + cell * len(cols)))
        lines.append(label.ljust(width) + "".join(f"{figures[c][key] / scale:.2f}".rjust(cell) for c in cols))
    lines.append("")
    lines.append(
        "peak = parameters + gradients + optimizer state + the most of the other rows alive at one moment of the step"
    )
    for note in result["notes"]:
        lines.append(f"note: {note}")
    if result["recommendation"]:
        lines.append(result["recommendation"]["message"])
    return "\n".join(lines)

