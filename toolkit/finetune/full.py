"""`toolkit finetune_full`: update every weight of a pretrained checkpoint on instruction data."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional, Union

from toolkit.data.instruct import InstructData
from toolkit.training.objectives import Objective
from toolkit.training.preference_objectives import PreferenceObjective  # noqa: F401  (its losses are --objective choices)
from toolkit.finetune.common import FINETUNE_EVAL, FINETUNE_TRAIN, run_finetune
from toolkit.args import DistributedArgs, EvalArgs, LogArgs, TrainArgs


def finetune_full(
    checkpoint_dir: Path,
    out_dir: Path = Path("out/finetune/full"),
    data: Optional[InstructData] = None,
    objective: Optional[Objective] = None,
    train: TrainArgs = FINETUNE_TRAIN,
    eval: EvalArgs = FINETUNE_EVAL,
    log: LogArgs = LogArgs(),
    distributed: DistributedArgs = DistributedArgs(),
    devices: Union[int, str] = 1,
    num_nodes: int = 1,
    precision: Optional[str] = None,
    seed: int = 1337,
    resume: Union[bool, str, Path] = False,
    quantize: Optional[str] = None,
    export_dtype: Optional[Literal["bfloat16", "float16", "float32"]] = None,
):
    """Fine-tune all weights of a model.

    Args:
        checkpoint_dir: A toolkit checkpoint (from `toolkit convert_from_hf`, `download` or pretraining).
        out_dir: Where logs, training checkpoints and the fine-tuned model (`<out_dir>/final`) go.
        data: Instruction data: `Alpaca`, `JSON` (records with configurable field names), or `Chat`
            (multi-turn conversations in the model's chat template).
        objective: What to minimise: sft (the default: the response tokens' cross-entropy) on
            instruction data; on preference pairs (--data Preference or HFPreference) dpo or ipo
            (against a reference model: a frozen copy of the checkpoint, sharded like the model; or --objective.precompute_reference true), or the
            reference-free simpo and orpo. Their options: --objective.beta and so on (see
            tutorials/preference.md).
        train: Optimisation and stopping (default: one epoch).
        eval: Validation cadence.
        log: Logging cadence and destinations.
        distributed: Sharding options, used when devices x num_nodes > 1.
        devices: Devices per node ("auto" for all).
        num_nodes: Number of nodes.
        precision: bf16-mixed, bf16-true, 16-mixed or 32-true; default: the best the device supports.
        seed: Random seed for data order.
        resume: false; "auto", true, or a training checkpoint path (see `toolkit pretrain --help`).
        quantize: Not supported here: quantized weights cannot be trained. Use `finetune_lora --quantize`.
        export_dtype: dtype of the weights in `<out_dir>/final`; default: the dtype the checkpoint is
            stored in (a bfloat16 model comes out bfloat16). Training keeps float32 master weights
            under mixed precision either way.
    """
    from toolkit.errors import UserError
    from toolkit.training.trackers import run_config

    hparams = run_config(finetune_full, locals())
    if quantize is not None:
        raise UserError(
            f"--quantize {quantize} needs frozen base weights, but full fine-tuning trains every weight: "
            f"use `toolkit finetune_lora {checkpoint_dir} --quantize {quantize}` (QLoRA)."
        )
    if data is None:
        raise UserError("No training data given: pass --data Alpaca --data.json_path <file.json> (or --data JSON ...).")
    _, model = run_finetune(
        "finetune_full", checkpoint_dir, out_dir, data, train, eval, log, distributed, devices, num_nodes,
        precision, seed, resume, export_dtype=export_dtype, hparams=hparams, objective=objective,
    )
    return model
