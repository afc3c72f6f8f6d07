"""What every entry point does around the training loop, written once.

A `Session` owns the Fabric object, the output directory, the batch plan and the logs. Entry points
(pretrain, finetune_full, finetune_lora) use it to build the model and optimizer, run `fit` and
export the result; each keeps only what is really different about it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch

from toolkit.errors import Preempted, UserError, caused_by_interrupt
from toolkit.models.config import Config
from toolkit.args import EvalArgs, LogArgs, TrainArgs
from toolkit.parallel.plan import RunPlan
from toolkit.training.failures import add_exit_action, clear_exit_actions, run_on_rank_zero
from toolkit.training.host_memory import return_large_frees_to_the_system
from toolkit.optim import decay_names, make_adamw
from toolkit.training.loop import LoopHooks, TrainState, fit
from toolkit.training.preemption import StopSignals
from toolkit.training.trackers import finish_tracker_runs, make_loggers, plain, start_tracker_runs, tracker_kind
from toolkit.training.fabric import build_fabric

if TYPE_CHECKING:
    from toolkit.tokenizer import Tokenizer
    from toolkit.training.objectives import Objective

RUN_MARKERS = ("final", "checkpoints", "logs", "run_args.json")

logger = logging.getLogger(__name__)


def check_out_dir(out_dir: Path, resume: Union[bool, str, Path]) -> None:
    """Refuse to start a fresh run in a directory that holds another run (nothing is overwritten)."""
    if resume is not False and resume not in ("false", "False"):
        return
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out_dir {out_dir} is a file; choose a directory.")
    found = [m for m in RUN_MARKERS if (out_dir / m).exists()]
    if found:
        raise UserError(
            f"--out_dir {out_dir} already holds a run ({', '.join(found)}); choose a new --out_dir, "
            "or pass --resume auto to continue it."
        )


@dataclass
class Session:
    """One start of a training run. Entry points use it as a context manager around everything
    after `Session.start`: a start that raises ends its tracker runs (W&B, MLflow) as failed, or
    killed on Ctrl-C, instead of leaving them running; `fit` ends them as finished."""

    kind: str
    fabric: Any
    out_dir: Path
    config: Config
    train: TrainArgs
    eval: EvalArgs
    log: LogArgs
    plan: Any  # the BatchPlan (run_plan.batches), which the loop reads
    run_plan: RunPlan
    seed: int
    resume: Union[bool, str, Path]
    tokenizer_dir: Optional[Path] = None
    created_out_dir: bool = False
    # The checkpoint whose weights stay frozen (LoRA) and its fingerprint, {"checkpoint", "fingerprint"};
    # training checkpoints then hold only what trains. None: every weight trains and is saved.
    frozen_base: Optional[dict] = None
    # The verified checkpoint this start resumes from (None: a fresh run), found before anything is read or written.
    resume_from: Optional[Path] = None
    precision: str = "32-true"  # the resolved Fabric precision
    # dtype of the exported model's floating-point weights; None keeps the trained dtype.
    export_dtype: Optional[torch.dtype] = None
    trackers_finished: bool = False  # the tracker runs have been ended (finish_trackers)
    # SIGTERM / SIGUSR1 handling while the run lives (`toolkit.training.preemption`); None: not installed.
    stop_signals: Optional[StopSignals] = None

    @classmethod
    def start(
        cls, kind: str, out_dir: Path, config: Config, train: TrainArgs, eval: EvalArgs, log: LogArgs,
        run_plan: RunPlan, seed: int, resume: Union[bool, str, Path], hparams: Optional[dict] = None,
        lora: Any = None, frozen_base: Optional[Path] = None, objective: Optional[Objective] = None,
    ) -> "Session":
        """Validate what can be validated before any process starts, then launch Fabric.

        `run_plan`: the run's devices, precision, strategy, batches and quantized base, resolved
        once by the entry point (`toolkit.parallel.plan.plan_run`); every process (the launched
        ones re-run the command) plans the same and uses that plan throughout.
        `hparams`: the command's resolved arguments (`trackers.run_config`), logged as
        hyperparameters with the model config and the batch plan. `lora` (LoRAArgs): finetune_lora's
        adapters, for the memory pre-flight (`check_fits_device`).
        `frozen_base`: the checkpoint whose weights the run keeps frozen (LoRA); its training
        checkpoints then hold only what trains, and a resume onto another base is refused here,
        before anything is read or written. `objective`: what the run minimises, for the pre-flight
        (`Objective.memory_profile`: a preference loss's pairs and reference model).
        """
        from toolkit.models.gpt import Block

        from toolkit.training.checkpoint import list_checkpoints

        out_dir = Path(out_dir)
        check_out_dir(out_dir, resume)
        if resume in (True, "true", "True") and not list_checkpoints(out_dir):
            raise UserError(f"--resume true but {out_dir / 'checkpoints'} holds no checkpoint; use --resume auto to start fresh.")
        strategy, plan = run_plan.strategy, run_plan.batches
        if run_plan.preflight and strategy.accelerator == "cuda" and torch.cuda.is_available():
            profile = objective.memory_profile(frozen_base is not None) if objective is not None else {}
            check_fits_device(kind, config, run_plan, lora, **profile)
        created_out_dir = not out_dir.exists()
        # A start that resumes from a checkpoint of out_dir continues its W&B / MLflow runs.
        continue_runs = resume not in (False, "false", "False") and (
            bool(list_checkpoints(out_dir)) or resume not in (True, "true", "True", "auto")
        )
        # Every rank runs this (the launched ones re-run the command): freed step buffers of a few
        # MiB go back to the system instead of staying in glibc's heap (host_memory.py, measured).
        return_large_frees_to_the_system()
        # build_fabric checks the launcher of a multi-node run first, before Lightning is imported.
        fabric = build_fabric(strategy, block_cls=Block, loggers=make_loggers(out_dir, log, continue_runs))
        fabric.launch()
        fabric.print(run_plan.describe())
        from toolkit.training.checkpoint import find_resume_checkpoint

        resume_from = find_resume_checkpoint(fabric, out_dir, resume)
        base_record = _frozen_base_record(fabric, frozen_base, resume_from) if frozen_base is not None else None
        run_on_rank_zero(fabric, lambda: _make_out_dir(out_dir))
        all_hparams = {"command": kind, **(hparams or {}), "model_config": config.to_dict(), "batch_plan": plain(plan)}
        start_tracker_runs(fabric, out_dir, all_hparams, continue_runs)
        fabric.seed_everything(rank_seed(seed, fabric.global_rank))
        session = cls(kind=kind, fabric=fabric, out_dir=out_dir, config=config, train=train, eval=eval, log=log,
                      plan=plan, run_plan=run_plan, seed=seed, resume=resume, created_out_dir=created_out_dir,
                      precision=strategy.precision, frozen_base=base_record, resume_from=resume_from)
        # From here every way out ends the tracker runs: an error or a signal through __exit__, the
        # watchdogs (which end a stuck process with os._exit) through this action.
        session.stop_signals = StopSignals().install()
        add_exit_action(session.finish_trackers)
        return session

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        """A start that ends without an error ends its tracker runs as successful: only now, after
        the entry point wrote what it exports (`final/`), not when the loop ends."""
        try:
            if error is None:
                self.finish_trackers("success")
            else:
                self.finish_trackers_after(error)
        finally:
            if self.stop_signals is not None:
                self.stop_signals.restore()
            clear_exit_actions()
        return False  # the error goes on, as it was

    def finish_trackers(self, status: str) -> None:
        """End the tracker runs once, with `status`: "success", "failed" or "killed" (every rank)."""
        if self.trackers_finished:
            return
        self.trackers_finished = True
        finish_tracker_runs(self.fabric, status)

    def finish_trackers_after(self, error: BaseException) -> None:
        """End the tracker runs of a start that `error` stops: killed for Ctrl-C, else failed. A
        tracker that cannot be reached is logged and left; `error` stays the one that is reported."""
        status = "killed" if isinstance(error, (KeyboardInterrupt, Preempted)) or caused_by_interrupt(error) else "failed"
        try:
            self.finish_trackers(status)
        except Exception as failure:
            reason = f"{type(failure).__name__}: {failure}".splitlines()[0]
            logger.warning("Could not mark the tracker runs %s: %s", status, reason)

    @contextmanager
    def remove_output_on_error(self):
        """Bad input found while preparing (data, tokenizer) leaves no output behind.

        A directory this run created is removed again; one that existed before is left as it was
        (apart from caches, which are written atomically and are safe to keep). The tracker runs are
        ended first: the default MLflow store lives in that directory.
        """
        try:
            yield
        except UserError as error:
            self.finish_trackers_after(error)
            if self.created_out_dir and self.fabric.global_rank == 0:
                shutil.rmtree(self.out_dir, ignore_errors=True)
            raise

    def _check_not_past_the_limits(self, resume_from: Path) -> None:
        """Refuse a checkpoint already past --train.max_steps or --train.max_tokens: the run would stop
        at once, say it reached a limit it passed long ago, and save over its newest checkpoint
        and final model. A finished run started again is not past them: it saves its last step
        again and stops. (Fine-tuning's last step may overshoot max_tokens, its steps being of
        different lengths: there only max_steps is checked.)"""
        from toolkit.checkpoint_files import read_meta

        saved = (read_meta(resume_from) or {}).get("train_state", {})
        step, tokens = saved.get("step", 0), saved.get("tokens_seen", 0)
        if self.train.max_steps and step > self.train.max_steps:
            raise UserError(f"{resume_from} is at step {step:,}, past --train.max_steps {self.train.max_steps:,}: "
                            "raise it to train on, or pass another --out_dir for a new run.")
        if self.kind == "pretrain" and self.train.max_tokens and tokens > self.train.max_tokens:
            raise UserError(f"{resume_from} has seen {tokens:,} tokens, past --train.max_tokens {self.train.max_tokens:,}: "
                            "raise it to train on, or pass another --out_dir for a new run.")

    # ------------------------------------------------------------------ tokenizer
    def prepare_tokenizer(self, tokenizer_dir: Optional[Path], train_vocab: Optional[int], data) -> "Tokenizer":
        from toolkit.tokenizer import Tokenizer, train_bpe_tokenizer

        if tokenizer_dir is not None:
            self.tokenizer_dir = Path(tokenizer_dir)
            return Tokenizer(tokenizer_dir)
        target = self.out_dir / "tokenizer"

        def train_tokenizer() -> None:
            if not (target / "tokenizer.json").is_file():
                files = data.corpus_files(self.out_dir)
                self.fabric.print(f"Training a {train_vocab}-token BPE tokenizer on {len(files)} file(s) ...")
                train_bpe_tokenizer(files, train_vocab, target)

        run_on_rank_zero(self.fabric, train_tokenizer)
        self.tokenizer_dir = target
        return Tokenizer(target)

    # ------------------------------------------------------------------ model and optimizer
    def build_model(self, weights: Union[str, Path] = "random", prepare: Optional[Callable] = None,
                    prepare_on_meta: bool = False, frozen: bool = False, meta_model: Optional[Any] = None):
        """The model set up by Fabric (sharded when distributed).

        `weights` is "random" (pretraining) or a toolkit checkpoint directory. The model is built
        on the meta device. On one device its full weights are filled in before `prepare(model)`
        (LoRA injection, freezing, quantization), unless `prepare_on_meta` says `prepare` works on
        the meta model (torchao NF4: the weights are then quantized one at a time as they are
        read, `toolkit.training.model_setup.materialize`); under FSDP `prepare` always runs on the
        meta model, the model is sharded, and each rank then reads only its own rows of each
        weight (memory-mapped from the checkpoint, or drawn from per-parameter generators, which
        give the same model whatever the world size). The precision policy (`precision_dtypes`) is
        applied before anything is allocated.

        `frozen`: no parameter trains and the model is left in eval mode, e.g. the reference model
        of a preference objective, built and sharded like the trained one beside it (each unit
        freed after its forward pass: it has no backward pass). Building a second model changes
        nothing of the first.

        `meta_model`: the model already built on the meta device for this config (an entry point
        that checked its shapes before launch), used instead of building it again.
        """
        from toolkit.models.gpt import GPT
        from toolkit.parallel.fsdp import reshard_after_every_forward
        from toolkit.parallel.precision import apply_precision_policy
        from toolkit.training.fabric import is_fsdp
        from toolkit.training.model_setup import (
            host_memory_growth, materialize, setup_model, start_host_memory_window,
        )

        memory_start = start_host_memory_window()
        model = meta_model
        if model is None:
            with torch.device("meta"):
                model = GPT(self.config)
        read_rows = self._weight_reader(model, weights)
        if not is_fsdp(self.fabric) and not prepare_on_meta:
            materialize(model, read_rows)  # bitsandbytes quantization (QLoRA) needs real weights before `prepare`
        if prepare is not None:
            model = prepare(model) or model
        if frozen:
            model.requires_grad_(False)
        policy = apply_precision_policy(model, self.precision)
        total = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.fabric.print(f"Model {self.config.name}: {total:,} parameters, {trainable:,} trainable; {policy}")
        model = setup_model(self.fabric, model, read_rows)
        if frozen:
            reshard_after_every_forward(model)
            model.eval()
        self._report_setup_memory(host_memory_growth(memory_start))
        return model

    def _weight_reader(self, model, weights: Union[str, Path]):
        if str(weights) != "random":
            from toolkit.model_dir import checkpoint_row_reader

            return checkpoint_row_reader(Path(weights))
        from toolkit.models.gpt import init_specs, initial_value

        specs = init_specs(model, self.config.n_layer)
        shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        seed = self.seed

        def read_rows(name: str, start: int = 0, stop: Optional[int] = None, out=None, inner=None):
            # Only these rows are drawn; they have the same values under any sharding.
            return initial_value(specs[name], shapes[name], seed, name, start, stop, out=out, inner=inner)

        return read_rows

    def _report_setup_memory(self, setup_bytes: int) -> None:
        """Host memory each rank's model set-up took (growth of its peak RSS), on rank 0's log."""
        from toolkit.training.checkpoint_io import gather_objects

        # (not fabric.all_gather: its torch call warns "deprecated" on every rank of every run)
        per_rank = gather_objects(self.fabric, setup_bytes)
        gib = ", ".join(f"{b / 2**30:.3f}" for b in per_rank)
        self.fabric.print(f"Model set-up took {gib} GiB of host memory per rank (peak RSS growth)")

    def build_optimizer(self, model):
        """AdamW over `model`'s trainable parameters; weight decay on matrices only (not on norms,
        biases or other vectors). Sharding keeps each parameter's global shape (FSDP2's DTensors),
        so the set-up model's shapes decide as the unsharded model's would."""
        return self.fabric.setup_optimizers(make_adamw(model, decay_names(model), self.train))

    # ------------------------------------------------------------------ training
    def run_shape(self) -> dict:
        """What a resumed run must share with the checkpoint it continues."""
        return {
            "kind": self.kind, "model": self.config.to_dict(), "global_batch_size": self.plan.global_batch_size,
            "micro_batch_size": self.plan.micro_batch_size, "max_seq_length": self.plan.max_seq_length,
            "world_size": self.fabric.world_size,
            "seed": self.seed,  # the data order: a resumed position means nothing in another shuffle
        }

    def fit(self, model, optimizer, train_loader, val_loader, total_steps: Optional[int], tokens_per_step: Optional[int],
            objective: Optional[Objective] = None) -> TrainState:
        """Resume if asked, run the loop, save a training checkpoint at every interval and at the end.

        `objective`: what the loop minimises and logs (`toolkit.training.objectives`); None is `CausalLM()`."""
        from toolkit.models.gpt import flops_per_token, head_flops_per_row
        from toolkit.models.loss import skips_ignored_rows
        from toolkit.training import checkpoint
        from toolkit.parallel.compile import compile_blocks, compile_seconds, should_compile
        from toolkit.training.objectives import CausalLM, WithRouterLosses, with_router_losses
        from toolkit.training.throughput import device_peak_flops

        # MFU is logged and printed by global rank 0 only: the others skip the CPU's measurement
        peak = (device_peak_flops(self.fabric.device, self.fabric._precision, self.log.device_peak_flops)
                if self.fabric.global_rank == 0 else None)
        state = TrainState()
        run_shape = self.run_shape()
        run_shape["objective"] = (objective or CausalLM()).record()
        resume_from = self.resume_from
        if resume_from is not None:
            with self.remove_output_on_error():  # a refused resume into a new --out_dir leaves nothing
                checkpoint.check_compatible(resume_from, run_shape)
                self._check_not_past_the_limits(resume_from)
            state = TrainState(**checkpoint.load(self.fabric, resume_from, model, optimizer, train_loader))
            position = train_loader.state_dict() if hasattr(train_loader, "state_dict") else {}
            self.fabric.print(
                f"Resumed from {resume_from}: step {state.step}, {state.tokens_seen:,} tokens seen, "
                f"epoch {state.epoch}, {state.micro_step} micro-batches consumed per rank"
                + (f", loader position {_describe_position(position)}" if position else "")
            )
            abandoned = checkpoint.abandoned_after(resume_from, self.out_dir)
            if abandoned:
                self.fabric.print(
                    f"Note: {', '.join(abandoned)} in {self.out_dir} came later than {resume_from.name}; they are kept, "
                    "but this run's saves start a new branch, which --resume auto continues from now on."
                )
        elif self.resume not in (False, "false", "False"):
            self.fabric.print(f"No checkpoint in {self.out_dir / checkpoint.CHECKPOINT_DIR}: starting a fresh run.")
        self._write_run_args()

        saved_steps = set()
        history = {"last": resume_from}  # the checkpoint the next save follows

        def save(current: TrainState) -> None:
            # A rank may wait a long while for a peer that writes a large shard: no stuck-call stop meanwhile.
            with self.stop_signals.patient() if self.stop_signals is not None else nullcontext():
                history["last"] = checkpoint.save(
                    self.fabric, self.out_dir, model, optimizer, train_loader, current.to_dict(), run_shape,
                    self.config, self.train.keep_last, frozen_base=self.frozen_base, tokenizer_dir=self.tokenizer_dir,
                    parent=history["last"], resumed_from=resume_from,
                )
            saved_steps.add(current.step)

        compiled = 0
        # Variable-length batches (fine-tuning: tokens_per_step is None) get dynamic shapes.
        variable_lengths = tokens_per_step is None
        wanted, why = should_compile(self.train.compile, total_steps, self.fabric.device.type, self.precision,
                                     variable_lengths)
        if wanted:
            from toolkit.models.gpt import Block

            compiled = compile_blocks(model, Block, self.fabric.device, dynamic=variable_lengths, print_fn=self.fabric.print)
        elif self.train.compile is None:
            self.fabric.print(f"torch.compile: off ({why}); --train.compile true forces it")
        objective = with_router_losses(objective, self.config, self.train)
        if isinstance(objective, WithRouterLosses):
            self.fabric.print(f"Mixture of experts: {objective.describe()}.")
        hooks = LoopHooks(
            save_checkpoint=save,
            flops_per_token=flops_per_token(self.config, self.plan.max_seq_length, _trainable_fraction(model)),
            head_flops_per_row=(head_flops_per_row(self.config, _trainable_fraction(model))
                                if skips_ignored_rows(self.fabric.device.type) and _fused_head(model) else None),
            device_peak_flops=peak,
            compile_seconds=compile_seconds if compiled else None,
            stop=self.stop_signals,
            vocab_size=self.config.vocab_size,
        )
        stop = self.stop_signals
        if stop is not None:
            self.fabric.print(_preemption_line(resume_from))
            stop.deferring = True  # in the loop a signal only raises the flag the ranks agree on
        try:
            self.state = fit(
                self.fabric, model, optimizer, train_loader, val_loader, self.plan, state,
                self.train, self.eval, self.log, hooks, total_steps=total_steps, tokens_per_step=tokens_per_step,
                objective=objective,
            )
            if self.state.step not in saved_steps and self.state.step > 0:
                save(self.state)
        finally:
            if stop is not None:
                stop.deferring = False
        for log in self.fabric.loggers:  # metrics on disk now; the tracker runs end with the session
            if tracker_kind(log) is None:
                log.save()
        if stop is not None and stop.agreed:
            # Every rank has saved; rank 0 ends the tracker runs before any process exits.
            self.finish_trackers("killed")
            self.fabric.barrier()
            raise Preempted(stop.received or "SIGTERM", f"checkpoint {history['last']} written after optimizer step "
                            f"{self.state.step}; continue with --resume auto")
        if self.fabric.global_rank == 0:
            (self.out_dir / "summary.json").write_text(json.dumps(self.state.to_dict(), indent=2) + "\n")
        return self.state

    def _write_run_args(self) -> None:
        if self.fabric.global_rank == 0:
            args = {"kind": self.kind, "model": self.config.to_dict(), "train": asdict(self.train),
                    "plan": asdict(self.plan), "seed": self.seed}
            (self.out_dir / "run_args.json").write_text(json.dumps(args, indent=2, default=str))

    # ------------------------------------------------------------------ export
    def export_final(self, model, name: str = "final") -> Path:
        """Write `<out_dir>/<name>`: full weights as safetensors (in files of at most 5 GB, indexed
        as Hugging Face does, beyond that size), config and tokenizer files (collective).

        Each weight's rows are converted to `export_dtype` by the rank that holds them and written
        by rank 0 a message at a time (`checkpoint_io.stream_weights`): no rank ever holds the whole
        model, nor a whole weight. The folder appears
        complete or not at all (`atomic_directory`); a failed export leaves a former one as it was.
        """
        from contextlib import ExitStack

        from toolkit.model_dir import atomic_directory, save_checkpoint_files
        from toolkit.training.checkpoint_io import stream_weights

        start = time.perf_counter()
        target = self.out_dir / name
        with ExitStack() as stack:
            tmp = run_on_rank_zero(self.fabric, lambda: stack.enter_context(atomic_directory(target, overwrite=True)))
            error = stream_weights(self.fabric, model, tmp, self.config, self.export_dtype)

            def finish() -> None:
                if error is not None:
                    raise UserError(f"Cannot write the final model to {target}: {error}")
                save_checkpoint_files(tmp, {}, self.config, self.tokenizer_dir, weights=False)

            run_on_rank_zero(self.fabric, finish)
        self.fabric.print(f"Saved the final model to {target} in {time.perf_counter() - start:.1f} s")
        return target


def _frozen_base_record(fabric, frozen_base: Path, resume_from: Optional[Path]) -> dict:
    """{"checkpoint", "fingerprint"} of the run's frozen base; refuses (every rank, one line) to resume
    `resume_from` if it was trained on another base. Each rank fingerprints the base it will read
    (on several nodes, each its own copy): 1 MiB read, whatever the model's size."""
    from toolkit.model_dir import checkpoint_fingerprint
    from toolkit.training.checkpoint import check_frozen_base
    from toolkit.training.failures import check_on_every_rank

    record: dict = {}

    def check() -> None:
        record.update(checkpoint=str(Path(frozen_base).resolve()), fingerprint=checkpoint_fingerprint(frozen_base))
        if resume_from is not None:
            check_frozen_base(resume_from, record)

    check_on_every_rank(fabric, check)
    return record


def _preemption_line(resume_from: Optional[Path]) -> str:
    """What a preemption signal does, and the grace time it needs as far as it is known yet."""
    line = ("SIGTERM or SIGUSR1 stops this run after the current optimizer step (on several processes at most "
            "the next), with a checkpoint; allow two steps and one save of grace")
    from toolkit.training.checkpoint import saved_seconds

    seconds = saved_seconds(resume_from) if resume_from is not None else None
    return line + (f" (the last save took {seconds:.1f} s)." if seconds is not None else ".")


def rank_seed(seed: int, rank: int) -> int:
    """The seed of `rank`'s global RNG: `seed` on rank 0 (one process runs as before), another on each other rank.

    Only what must differ per rank draws from it: dropout masks (LoRA dropout), which would otherwise
    repeat on every rank. What must be equal on every rank has its own generators, seeded with
    `seed` alone: initial weights (`initial_value`, `init_adapters`) and the data order.
    """
    return (seed + rank * 1_000_003) % 2**32


def check_fits_device(kind: str, config: Config, run_plan: RunPlan, lora: Any = None, pairs: bool = False,
                      frozen_copy: bool = False) -> None:
    """Stop before any weight is read when a step will not fit in GPU 0's memory (see
    `toolkit.memory.check_fits`). finetune_lora passes its adapters (`lora`), a preference objective
    its pairs and reference (`Objective.memory_profile`); the plan says everything else (sharding,
    checkpointing, CPU offload, the quantized base)."""
    if kind not in ("pretrain", "finetune_full", "finetune_lora"):
        return
    from toolkit.memory import check_run_fits

    finetune = {"pretrain": None, "finetune_lora": "lora"}.get(kind, "full")
    line = check_run_fits(torch.cuda.get_device_properties(0).total_memory, config, run_plan, finetune, lora,
                          pairs=pairs, frozen_copy=frozen_copy)
    print_before_launch(line)


def _fused_head(model) -> bool:
    """Whether the model's output head is the toolkit's own (`OutputHead`, FSDP-wrapped or not),
    which computes the loss fused and can leave out unlabelled rows; an adapter or a quantized
    layer in its place computes every row (`GPT.head_loss`)."""
    from toolkit.models.gpt import OutputHead

    heads = [module for name, module in model.named_modules() if name.rsplit(".", 1)[-1] == "lm_head"]
    return bool(heads) and all(isinstance(head, OutputHead) for head in heads)


def print_before_launch(line: str) -> None:
    """Print `line` once for the run from code that runs before launch: every process of the run
    gets there (Fabric re-runs the command per local rank, torchrun starts them all), and only the
    first one prints."""
    if os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0":
        print(line)


def _make_out_dir(out_dir: Path) -> None:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"Cannot create --out_dir {out_dir}: {error.strerror}; choose a writable folder.") from error


def _describe_position(position: dict) -> str:
    keys = ("current_epoch", "num_samples_yielded", "epoch", "batches_consumed")
    found = {k: position[k] for k in keys if k in position}
    return ", ".join(f"{k}={v}" for k, v in found.items()) or "restored"


def _trainable_fraction(model) -> float:
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    return sum(p.numel() for p in params if p.requires_grad) / max(total, 1)
