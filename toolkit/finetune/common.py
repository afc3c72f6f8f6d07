"""What full and LoRA fine-tuning share: loading the base checkpoint, instruction data, the loop.

Each entry point passes in only what differs: how the model is prepared before sharding (LoRA
injection, quantization), whether the base stays frozen (then checkpoints keep only what trains),
and what the final export writes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from toolkit.data.instruct import InstructData
from toolkit.errors import UserError
from toolkit.args import DistributedArgs, EvalArgs, LogArgs, TrainArgs, check_seed

if TYPE_CHECKING:
    from toolkit.training.objectives import Objective

# Defaults that suit fine-tuning rather than pretraining: one epoch, short warmup.
FINETUNE_TRAIN = TrainArgs(
    global_batch_size=16, micro_batch_size=1, learning_rate=2e-5, min_lr=0.0, warmup_steps=10,
    save_interval=100, weight_decay=0.0, beta2=0.95,
)
FINETUNE_EVAL = EvalArgs(interval=100, max_iters=100, initial_validation=True)


def run_finetune(
    kind: str,
    checkpoint_dir: Path,
    out_dir: Path,
    data: InstructData,
    train: TrainArgs,
    eval: EvalArgs,
    log: LogArgs,
    distributed: DistributedArgs,
    devices: Union[int, str],
    num_nodes: int,
    precision: Optional[str],
    seed: int,
    resume: Union[bool, str, Path],
    prepare_model: Optional[Callable] = None,
    frozen_base: bool = False,
    prepare_on_meta: bool = False,
    export: Optional[Callable] = None,
    check_args: Optional[Callable] = None,
    export_dtype: Optional[str] = None,
    hparams: Optional[dict] = None,
    lora: Optional[Any] = None,
    quantize: Optional[str] = None,
    objective: Optional[Objective] = None,
):
    """Fine-tune the model in `checkpoint_dir` on instruction data; returns (session, model).
    The run plan (`plan_run`: devices, precision, strategy, batches, the `quantize` scheme) is made
    here, once; `check_args(config, run_plan, meta_model)` and `prepare_model(model, run_plan)` read
    it. The model is built on the meta device once, here: check_args reads its shapes, the session
    fills it.
    `lora`: LoRA's adapters, for the memory pre-flight.
    `frozen_base`: the weights of `checkpoint_dir` stay frozen (LoRA): training checkpoints hold only
    what trains, and a resume is refused if `checkpoint_dir` is not the base they were trained on.
    `prepare_on_meta`: `prepare_model` works on the meta model (nf4 quantizes each weight as it is read).
    `objective`: what the loop minimises (`toolkit.training.objectives`,
    `toolkit.training.preference_objectives`);
    None is `SFT()`. Its `prepare` runs once the model is built, before the loop (a preference loss
    chooses its reference there: the base with the adapters off when `frozen_base`, else a frozen
    copy of `checkpoint_dir`, or log-probabilities precomputed with either).
    """
    from toolkit.model_dir import export_dtype as resolve_export_dtype
    from toolkit.model_dir import check_weights_match, require_checkpoint_dir
    from toolkit.models.config import Config
    from toolkit.parallel.plan import plan_run
    from toolkit.tokenizer import Tokenizer, check_tokenizer_fits
    from toolkit.training.objectives import SFT, ObjectiveSetup
    from toolkit.training.session import Session
    from toolkit.training.trackers import plain

    check_seed(seed)
    checkpoint_dir = require_checkpoint_dir(checkpoint_dir)
    config = Config.from_file(checkpoint_dir)
    dtype = resolve_export_dtype(export_dtype, checkpoint_dir)
    tokenizer = Tokenizer(checkpoint_dir)
    check_tokenizer_fits(tokenizer, config.vocab_size, str(checkpoint_dir))
    max_seq_length = train.sequence_length(config)
    run_plan = plan_run(devices, num_nodes, precision, distributed, train, max_seq_length, quantize, model=config)
    import torch

    from toolkit.models.gpt import GPT

    with torch.device("meta"):  # no memory: what check_args reads shapes from, and what build_model fills
        meta_model = GPT(config)
    check_weights_match(checkpoint_dir, meta_model)
    if check_args is not None:
        check_args(config, run_plan, meta_model)
    # Read and tokenize the data before any process starts or anything is written: bad records fail here.
    data.setup(tokenizer, max_seq_length, config)
    if not (train.max_steps or train.max_tokens or train.max_time or train.epochs):
        train = dataclasses.replace(train, epochs=1)

    hparams = dict(hparams or {}, train=plain(train))  # with the epochs default resolved
    objective = objective if objective is not None else SFT()
    with Session.start(
        kind=kind, out_dir=out_dir, config=config, train=train, eval=eval, log=log, run_plan=run_plan, seed=seed,
        resume=resume, hparams=hparams, lora=lora, frozen_base=checkpoint_dir if frozen_base else None,
        objective=objective,
    ) as session:
        session.export_dtype = dtype
        fabric = session.fabric
        with session.remove_output_on_error():
            # Chat data whose template is not the checkpoint's writes it into <out_dir>/tokenizer.
            session.tokenizer_dir = data.output_tokenizer_dir(checkpoint_dir, out_dir)
            train_loader = data.train_dataloader(
                train.micro_batch_size, seed, fabric.global_rank, fabric.world_size, global_batch_size=train.global_batch_size
            )
            val_loader = data.val_dataloader(train.micro_batch_size, fabric.global_rank, fabric.world_size)
            steps_per_epoch = len(train_loader) // session.plan.gradient_accumulation_iters
            if steps_per_epoch == 0:
                raise UserError(
                    f"The training data gives {len(train_loader)} micro-batches per device per epoch, fewer than one "
                    f"optimizer step needs ({session.plan.gradient_accumulation_iters}); lower --train.global_batch_size."
                )
        stats = data.stats
        fabric.print(
            f"Data: {stats.get('train_samples', '?')} training samples"
            + (f" packed into {stats['packed_sequences']} sequences" if "packed_sequences" in stats else "")
            + f", {steps_per_epoch} optimizer steps per epoch, "
            f"padding {100 * stats.get('padding_fraction', 0.0):.1f}% of batch tokens"
        )
        prepare = None if prepare_model is None else (lambda model: prepare_model(model, run_plan))
        with session.remove_output_on_error():
            model = session.build_model(weights=checkpoint_dir, prepare=prepare, prepare_on_meta=prepare_on_meta,
                                        meta_model=meta_model)
            optimizer = session.build_optimizer(model)
            objective.prepare(ObjectiveSetup(
                fabric=fabric, model=model, train_loader=train_loader, val_loader=val_loader, out_dir=session.out_dir,
                precision=session.precision, micro_batch_size=train.micro_batch_size, frozen_base=frozen_base,
                build_frozen_copy=lambda: session.build_model(weights=checkpoint_dir, frozen=True),
                base_fingerprint=_fingerprint(session, checkpoint_dir),
            ))
        limits = [s for s in (train.max_steps, train.epochs and train.epochs * steps_per_epoch) if s]
        total_steps = min(limits) if limits else None
        session.fit(model, optimizer, train_loader, val_loader, total_steps=total_steps, tokens_per_step=None,
                    objective=objective)
        if export is not None:
            export(session, model)
        else:
            session.export_final(model)
        return session, model


def _fingerprint(session, checkpoint_dir: Path) -> str:
    """The starting checkpoint's fingerprint: the frozen base's, already taken, or taken now (1 MiB read)."""
    if session.frozen_base is not None:
        return session.frozen_base["fingerprint"]
    from toolkit.model_dir import checkpoint_fingerprint

    return checkpoint_fingerprint(checkpoint_dir)
