"""Argument groups shared by every entry point (`--train.*`, `--eval.*`, `--log.*`, `--distributed.*`).

They are plain typed dataclasses: jsonargparse turns them into CLI options and YAML sections, so a
misspelled option is an error, never a silent default.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal, Optional, get_args

from toolkit.errors import UserError


@dataclass
class TrainArgs:
    """Optimisation and stopping. Batch sizes count sequences; steps count optimizer steps."""

    global_batch_size: int = 16  # sequences per optimizer step, over all devices and nodes
    micro_batch_size: int = 4  # sequences per forward/backward on one device
    max_seq_length: Optional[int] = None  # tokens per sequence; None: the model's context (pretraining: min(context, 2048))
    max_steps: Optional[int] = None  # stop after this many optimizer steps
    max_tokens: Optional[int] = None  # stop before the step that would exceed this many input tokens
    max_time: Optional[str] = None  # the step that starts after this long is the last: "90s", "45m", "2h", "1d2h", "HH:MM:SS"
    epochs: Optional[int] = None  # passes over the data (fine-tuning); pretraining streams until another limit
    learning_rate: float = 3e-4
    min_lr: float = 3e-5  # cosine decay ends here
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    warmup_steps: int = 100  # linear warmup from 0
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    max_norm: Optional[float] = 1.0  # gradient clipping by global norm; None disables
    save_interval: Optional[int] = 1000  # optimizer steps between checkpoints; None: only the final one
    keep_last: Optional[int] = 2  # training checkpoints to keep; None keeps all
    # torch.compile each transformer block (CPU and GPU). null (auto): GPU runs of 100 steps or more;
    # eager on a CPU, where it was measured no faster. See tutorials/compile.md.
    compile: Optional[bool] = None
    # Mixture-of-experts models: coefficients of the router's load-balancing loss and z-loss, added
    # to every objective's (tutorials/moe.md). None: the model config's (its family's own).
    router_aux_loss_coef: Optional[float] = None
    router_z_loss_coef: Optional[float] = None
    # Balance each MoE layer on its own (the mean of the layers' load-balancing losses) instead of
    # over all layers' assignments pooled, as transformers defines it: pooled, layers that favour
    # different experts cancel out. For pretraining from scratch.
    router_aux_loss_per_layer: bool = False

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise UserError(f"--train.{name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_steps", "max_tokens", "epochs", "save_interval", "keep_last", "max_seq_length"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"--train.{name} must be at least 1, got {value}")
        # Checked here, before any process starts, rather than by torch in the middle of set-up.
        if not 0 < self.learning_rate < math.inf:
            raise UserError(f"--train.learning_rate must be positive, got {self.learning_rate}")
        if not 0 <= self.min_lr <= self.learning_rate:
            raise UserError(
                f"--train.min_lr must be between 0 and --train.learning_rate ({self.learning_rate}), got {self.min_lr}"
            )
        if self.warmup_steps < 0:
            raise UserError(f"--train.warmup_steps must be 0 or more, got {self.warmup_steps}")
        if not 0 <= self.weight_decay < math.inf:
            raise UserError(f"--train.weight_decay must be 0 or more, got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise UserError(f"--train.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.max_norm is not None and not 0 < self.max_norm < math.inf:
            raise UserError(f"--train.max_norm must be positive (or null to disable clipping), got {self.max_norm}")
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < math.inf:
                raise UserError(f"--train.{name} must be 0 or more (and finite), got {value}")
        if self.max_time is not None and not parse_duration(self.max_time) > 0:
            raise UserError(f"--train.max_time must be a positive duration, got {self.max_time!r}")

    def sequence_length(self, config) -> int:
        """max_seq_length, defaulting to the model's context capped at 2048; longer than the context is an error."""
        length = self.max_seq_length or min(config.block_size, 2048)
        if length > config.block_size:
            raise UserError(
                f"--train.max_seq_length {length} is larger than the context of {config.name} "
                f"({config.block_size} tokens); use at most {config.block_size}."
            )
        return length

    @property
    def max_seconds(self) -> Optional[float]:
        return None if self.max_time is None else parse_duration(self.max_time)


@dataclass
class EvalArgs:
    """Periodic validation."""

    interval: int = 100  # optimizer steps between validations
    # validation micro-batches in all, over every device (each runs its share); all of them if the set is smaller
    max_iters: int = 50
    initial_validation: bool = False  # validate before the first step
    final_validation: bool = True

    def __post_init__(self) -> None:
        for name in ("interval", "max_iters"):
            if getattr(self, name) < 1:
                raise UserError(f"--eval.{name} must be at least 1, got {getattr(self, name)}")


LoggerName = Literal["csv", "tensorboard", "wandb", "mlflow"]


@dataclass
class LogArgs:
    """Where metrics go: a progress line, and any of CSV and TensorBoard files under <out_dir>/logs,
    Weights & Biases and MLflow (see `toolkit.training.trackers`)."""

    interval: int = 1  # optimizer steps between log lines (the only points where the loop syncs with the device)
    loggers: tuple[LoggerName, ...] = ("csv", "tensorboard")
    device_peak_flops: Optional[float] = None  # for MFU on devices without a known peak (CPU), FLOP/s
    # W&B project / MLflow experiment; default: WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME, else "toolkit"
    project: Optional[str] = None
    run_name: Optional[str] = None  # W&B / MLflow run name; default: WANDB_NAME (W&B), else the out_dir's name
    tags: tuple[str, ...] = ()  # W&B tags; MLflow tags ("key=value", or a plain name with an empty value)
    offline: bool = False  # W&B only: write the run locally (`wandb sync` uploads it later); WANDB_MODE=offline does the same
    # MLflow store; default: MLFLOW_TRACKING_URI, else sqlite:///<out_dir>/logs/mlflow.db
    tracking_uri: Optional[str] = None

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise UserError(f"--log.interval must be at least 1, got {self.interval}")
        if self.device_peak_flops is not None and not self.device_peak_flops > 0:
            raise UserError(f"--log.device_peak_flops must be positive, got {self.device_peak_flops}")
        if len(set(self.loggers)) != len(self.loggers):
            raise UserError(f"--log.loggers names a logger twice: {list(self.loggers)}")


# torch and numpy take seeds in this range; Lightning raises a ValueError outside it.
MAX_SEED = 2**32 - 1


def check_seed(seed: int) -> None:
    if not 0 <= seed <= MAX_SEED:
        raise UserError(f"--seed must be between 0 and {MAX_SEED}, got {seed}")


_DURATION_UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_duration(text: str) -> float:
    """Seconds in "90", "90s", "1h30m", "2d" or "HH:MM:SS"/"DD:HH:MM:SS"."""
    text = str(text).strip()
    try:
        if ":" in text:
            parts = [float(p) for p in text.split(":")]
            if len(parts) > 4:
                raise ValueError
            seconds = 0.0
            for part, unit in zip(reversed(parts), (1, 60, 3600, 86400)):
                seconds += part * unit
            return seconds
        if re.fullmatch(r"\d+(\.\d+)?", text):
            return float(text)
        matches = re.fullmatch(r"((\d+(\.\d+)?)[dhms])+", text)
        if not matches:
            raise ValueError
        return sum(float(n) * _DURATION_UNITS[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([dhms])", text))
    except ValueError:
        raise UserError(f"Cannot read the duration {text!r}: use e.g. 90s, 45m, 2h, 1d2h or 01:30:00") from None


# Storage of a frozen base (QLoRA): "nf4" is torchao's NF4Tensor (sharded by FSDP2 on several devices);
# "bnb.*" are bitsandbytes' 4-bit NF4 or FP4 (-dq also quantizes the scales) and int8 (replicated).
QuantizeName = Literal["nf4", "bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq", "bnb.int8"]
QUANTIZE_CHOICES: tuple[str, ...] = get_args(QuantizeName)

StrategyName = Literal["auto", "fsdp", "ddp"]
ShardingName = Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"]
StateDictTypeName = Literal["full", "sharded"]


@dataclass
class DistributedArgs:
    """How to spread training over devices and machines (`--distributed.<field>` on the CLI).

    Args:
        strategy: "auto" uses FSDP when there is more than one device in total (devices x nodes)
            and a single device otherwise; "fsdp" and "ddp" force that strategy when there is more
            than one device. With one device in total the single-device strategy is always used.
        sharding: FSDP sharding. FULL_SHARD shards parameters, gradients and optimizer state over
            all devices; SHARD_GRAD_OP keeps full parameters between forward and backward;
            HYBRID_SHARD shards within each machine and replicates across machines (on one
            machine it is FULL_SHARD; with one device per machine it falls back to FULL_SHARD);
            NO_SHARD replicates everything, like DDP. FSDP2 (`fully_shard`) in every case.
            Ignored unless FSDP is used.
        activation_checkpointing: recompute each transformer block's activations in the backward
            pass instead of storing them: less memory, about a third more compute.
        cpu_offload: keep FSDP parameters and gradients in CPU memory between uses (CUDA only; on
            CPU they are there already and this is ignored).
        state_dict_type: format of mid-run FSDP checkpoints: "sharded" writes one file per rank
            (torch's distributed checkpoint: fast, and it reshards when loaded on another number
            of devices), "full" gathers everything into a single file on rank 0. The final
            exported model is always full.
        preflight: on a GPU, compare the expected peak memory per device with the device's memory
            before any weight is read, and stop with the settings that would fit if it does not.
        timeout: seconds a collective (a barrier, a gradient reduction) waits for the other
            processes before the run fails. Rank 0 prepares data alone while the others wait, so
            this must outlast the first tokenization of a large corpus.
        expert_parallel: split each mixture-of-experts layer's experts over groups of this many
            processes (expert parallelism): each holds 1/N of the experts and tokens travel to
            their experts and back (all-to-all). N must divide the experts and the processes
            (devices x nodes); the experts are also sharded (FSDP) over the processes that hold
            the same ones. 1: every process computes every expert, as without experts.
    """

    strategy: StrategyName = "auto"
    sharding: ShardingName = "HYBRID_SHARD"
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    state_dict_type: StateDictTypeName = "sharded"
    timeout: int = 3600
    preflight: bool = True
    expert_parallel: int = 1
