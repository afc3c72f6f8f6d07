"""`toolkit pretrain`: train a model from scratch on streamed token data."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional, Union

from toolkit.data.streams import PretrainData
from toolkit.errors import UserError
from toolkit.models.config import Config
from toolkit.tokenizer import MIN_BPE_VOCAB
from toolkit.args import DistributedArgs, EvalArgs, LogArgs, TrainArgs, check_seed
from toolkit.training.failures import run_on_rank_zero

NO_DATA_HELP = (
    "No training data given. For text, pass --data TextFiles --data.train_path <file or folder of .txt/.jsonl>; "
    "for pre-optimized litdata streams (local folders or s3:// URLs), pass "
    "--config config_hub/pretrain/tinyllama.yaml --data.train_streams '[<stream>, ...]'."
)


def pretrain(
    model_name: str,
    out_dir: Path = Path("out/pretrain"),
    data: Optional[PretrainData] = None,
    tokenizer_dir: Optional[Path] = None,
    train_tokenizer_vocab: Optional[int] = None,
    model_overrides: Optional[dict[str, Any]] = None,
    train: TrainArgs = TrainArgs(),
    eval: EvalArgs = EvalArgs(),
    log: LogArgs = LogArgs(),
    distributed: DistributedArgs = DistributedArgs(),
    devices: Union[int, str] = 1,
    num_nodes: int = 1,
    precision: Optional[str] = None,
    seed: int = 42,
    resume: Union[bool, str, Path] = False,
    initial_checkpoint_dir: Optional[Path] = None,
    export_dtype: Optional[Literal["bfloat16", "float16", "float32"]] = None,
) -> None:
    """Pretrain a model from randomly initialised weights.

    Args:
        model_name: A preset name, alias or Hugging Face repo id (see `toolkit list`).
        out_dir: Where logs, training checkpoints and the final model (`<out_dir>/final`) go.
        data: The training data: `TextFiles` (text or JSON Lines, tokenized once and cached) or
            `StreamMix` (pre-optimized litdata streams, local or s3://).
        tokenizer_dir: A folder with a Hugging Face `tokenizer.json`.
        train_tokenizer_vocab: Without --tokenizer_dir, train a byte-level BPE tokenizer of this many
            tokens on the training text first (used by the offline quick start).
        model_overrides: Config fields to change, e.g. '{n_layer: 2, vocab_size: 50304}'.
        train: Optimisation and stopping (see `TrainArgs`).
        eval: Validation cadence.
        log: Logging cadence and destinations.
        distributed: Sharding options, used when devices x num_nodes > 1.
        devices: Devices per node ("auto" for all).
        num_nodes: Number of nodes.
        precision: bf16-mixed, bf16-true, 16-mixed or 32-true; default: the best the device supports.
        seed: Random seed for initialisation and data order.
        resume: false; "auto" to continue from the newest checkpoint in out_dir if there is one; true
            to require one; or the path of a training checkpoint.
        initial_checkpoint_dir: Start from the weights of this toolkit checkpoint instead of random
            ones (continued pretraining; also how a run moves to another number of devices: export
            with `convert_pretrained_checkpoint`, then start here). Its model config is used.
        export_dtype: dtype of the weights in `<out_dir>/final`; default: the dtype of
            --initial_checkpoint_dir's weights, or the dtype trained in (float32 master weights
            under mixed precision).
    """
    from toolkit.parallel.plan import plan_run
    from toolkit.training.objectives import CausalLM
    from toolkit.training.session import Session
    from toolkit.training.trackers import run_config

    hparams = run_config(pretrain, locals())
    check_seed(seed)
    if initial_checkpoint_dir is not None:
        import torch

        from toolkit.model_dir import check_weights_match, require_checkpoint_dir
        from toolkit.models.gpt import GPT

        if model_overrides:
            raise UserError(f"--model_overrides cannot change the model of --initial_checkpoint_dir {initial_checkpoint_dir}: "
                            "its weights fix it; drop one of them.")
        config = Config.from_file(require_checkpoint_dir(initial_checkpoint_dir))
        _check_model_name_fits(model_name, config, initial_checkpoint_dir)
        with torch.device("meta"):
            check_weights_match(initial_checkpoint_dir, GPT(config))
    else:
        config = Config.from_name(model_name, **(model_overrides or {}))
    if data is None:
        raise UserError(NO_DATA_HELP)
    if tokenizer_dir is None and train_tokenizer_vocab is None:
        raise UserError("Pass --tokenizer_dir <folder with tokenizer.json>, or --train_tokenizer_vocab N to train one on the data.")
    if tokenizer_dir is None and train_tokenizer_vocab < MIN_BPE_VOCAB:
        raise UserError(f"--train_tokenizer_vocab must be at least {MIN_BPE_VOCAB} (every byte and one special token), got {train_tokenizer_vocab}")
    max_seq_length = train.sequence_length(config)

    if tokenizer_dir is not None:
        from toolkit.tokenizer import Tokenizer

        Tokenizer(tokenizer_dir)  # an unreadable tokenizer fails here, before anything is written

    run_plan = plan_run(devices, num_nodes, precision, distributed, train, max_seq_length, model=config)
    tokens_per_step = run_plan.batches.tokens_per_step
    if train.max_tokens and train.max_tokens < tokens_per_step:
        # Not one whole step fits: the run would train nothing and export its initialisation.
        raise UserError(
            f"--train.max_tokens {train.max_tokens:,} is less than one optimizer step ({tokens_per_step:,} tokens = "
            f"global batch {train.global_batch_size} x {max_seq_length}); raise it, or lower --train.global_batch_size."
        )
    with Session.start(
        kind="pretrain", out_dir=out_dir, config=config, train=train, eval=eval, log=log, run_plan=run_plan,
        seed=seed, resume=resume, hparams=hparams,
    ) as session:
        fabric = session.fabric
        block_size = max_seq_length + 1  # inputs and their next-token targets
        with session.remove_output_on_error():
            tokenizer = session.prepare_tokenizer(tokenizer_dir, train_tokenizer_vocab, data)
            if tokenizer.vocab_size > config.vocab_size:
                raise UserError(
                    f"The tokenizer has {tokenizer.vocab_size} tokens but {config.name} only {config.vocab_size}: "
                    f"pass --model_overrides '{{vocab_size: {tokenizer.vocab_size}}}' or a matching model."
                )
            run_on_rank_zero(fabric, lambda: data.prepare(tokenizer, block_size, session.out_dir))
            if fabric.global_rank != 0:
                data.connect(tokenizer, block_size, session.out_dir)
            rank, world_size = fabric.global_rank, fabric.world_size
            train_loader = data.train_dataloader(train.micro_batch_size, block_size, seed=seed, rank=rank, world_size=world_size)
            val_loader = data.val_dataloader(train.micro_batch_size, block_size, rank=rank, world_size=world_size)

        from toolkit.model_dir import export_dtype as resolve_export_dtype

        session.export_dtype = resolve_export_dtype(export_dtype, initial_checkpoint_dir)
        with session.remove_output_on_error():
            model = session.build_model(weights=initial_checkpoint_dir if initial_checkpoint_dir is not None else "random")
            optimizer = session.build_optimizer(model)
        total_steps = None
        if train.max_steps or train.max_tokens:
            total_steps = min(s for s in (train.max_steps, (train.max_tokens or 0) // tokens_per_step or None) if s)
        session.fit(model, optimizer, train_loader, val_loader, total_steps=total_steps, tokens_per_step=tokens_per_step,
                    objective=CausalLM())
        session.export_final(model)


def _check_model_name_fits(model_name: str, config: Config, checkpoint_dir: Path) -> None:
    """The model trained from --initial_checkpoint_dir is the checkpoint's: a preset named beside it
    with another architecture is refused rather than silently replaced (a name that is not a
    preset, or the checkpoint's own, is taken as a label)."""
    import dataclasses

    try:
        named = Config.from_name(model_name)
    except UserError:  # not a preset
        return
    label = ("name", "hf_repo_id")
    if dataclasses.replace(named, **{k: getattr(config, k) for k in label}) != config:
        raise UserError(f"{model_name} is not the model of --initial_checkpoint_dir {checkpoint_dir} ({config.name}, "
                        f"{config.n_layer} layers of {config.n_embd}): name that model, or leave out the checkpoint.")
