"""The one training loop, shared by pretraining, full fine-tuning and LoRA.

Entry points differ only in how they build the model, which parameters train and what they save;
they pass those differences in. The loop knows nothing about FSDP: Fabric hides it.

One optimizer step = `plan.gradient_accumulation_iters` micro-batches per rank. What is minimised
comes from an objective (`toolkit.training.objectives`; causal language modelling by default): the
loss of a step is the sum of its losses over every micro-batch of every rank, divided by its units
(target tokens for causal LM) over all of them, so padding and prompt masking never change how
samples are weighted. The loop never calls the model or reads a batch's keys except through it.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from toolkit.args import EvalArgs, LogArgs, TrainArgs
from toolkit.errors import UserError
from toolkit.parallel.fsdp import release_gathered
from toolkit.training.objectives import CausalLM, Objective, ObjectiveOutput


@dataclass
class TrainState:
    """Counters that, with model, optimizer and data position, make a run resumable."""

    step: int = 0  # optimizer steps taken
    micro_step: int = 0  # micro-batches consumed per rank
    tokens_seen: int = 0  # input tokens over all ranks (padding excluded)
    epoch: int = 0  # completed passes over the training data
    epoch_batches: int = 0  # micro-batches consumed per rank in the current pass
    best_val_loss: float = float("inf")
    train_seconds: float = 0.0  # wall time spent training, summed over resumed runs

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LoopHooks:
    """What an entry point plugs into the loop."""

    # Called with the state at every save point; writes a resumable training checkpoint.
    save_checkpoint: Optional[Callable[[TrainState], None]] = None
    # FLOPs per trained token for MFU (see toolkit.models.gpt.flops_per_token).
    flops_per_token: Optional[float] = None
    # Set where the fused head and loss leave out rows without a label (on a CPU): the head's share
    # of flops_per_token (`head_flops_per_row`), which MFU then counts for labelled rows only.
    head_flops_per_row: Optional[float] = None
    # Peak FLOP/s of one device, for MFU: a figure, or one measured on this CPU that the loop
    # refreshes at its first log steps (`toolkit.training.throughput.CpuPeak`); None: no MFU.
    device_peak_flops: Optional[Any] = None
    # Seconds spent compiling so far (`toolkit.parallel.compile.compile_seconds`); the time compiled
    # within a logged window is left out of its step time and throughput and logged as
    # train/compile_seconds; the first compilation is also printed.
    compile_seconds: Optional[Callable[[], float]] = None
    # The preemption signals this process received (`toolkit.training.preemption.StopSignals`): the
    # ranks agree in each step's all-reduce and stop after that step; the loop sets `stop.agreed`.
    stop: Optional[Any] = None
    # The model's vocabulary: the first step's token ids are checked against it (data tokenized with
    # another, larger tokenizer would otherwise end in an IndexError inside the embedding).
    vocab_size: Optional[int] = None


def lr_at(step: int, args: TrainArgs, total_steps: Optional[int]) -> float:
    """Linear warmup for `warmup_steps`, then cosine decay to `min_lr` on the last step.

    Steps count from 0: warmup step s runs at (s + 1) / warmup_steps of the peak, so the peak is
    reached on step warmup_steps - 1 (step 0 without warmup) and the decay runs from there to step
    total_steps - 1, which runs at `min_lr` (a run that ends within its warmup, or on the step of its
    peak, ends there instead). Without a known number of steps (only --train.max_time), the rate
    stays flat after warmup.
    """
    if args.warmup_steps and step < args.warmup_steps:
        return args.learning_rate * (step + 1) / args.warmup_steps
    if args.lr_schedule == "constant" or not total_steps:
        return args.learning_rate
    peak_step = max(args.warmup_steps - 1, 0)
    progress = min(1.0, (step - peak_step) / max(1, total_steps - 1 - peak_step))
    return args.min_lr + 0.5 * (args.learning_rate - args.min_lr) * (1 + math.cos(math.pi * progress))


def fit(
    fabric,
    model,
    optimizer,
    train_loader: Iterable[dict],
    val_loader: Optional[Iterable[dict]],
    plan,
    state: TrainState,
    train: TrainArgs,
    eval: EvalArgs,
    log: LogArgs,
    hooks: LoopHooks,
    total_steps: Optional[int],
    tokens_per_step: Optional[int] = None,
    objective: Optional[Objective] = None,
) -> TrainState:
    """Train until max_steps, max_tokens, max_time or the data (epochs) runs out; returns the final state.

    `total_steps` is the step count the schedule decays over (None if only a time limit is known).
    `tokens_per_step` is the input tokens per optimizer step over all ranks when every batch has
    the same shape (pretraining); None makes the loop count the batches' real (non-padding) tokens
    (`objective.real_tokens`). `objective`: what is minimised and logged; None is `CausalLM()`.
    """
    objective = objective if objective is not None else CausalLM()
    accumulation = plan.gradient_accumulation_iters
    world_size = fabric.world_size
    max_seconds = train.max_seconds
    step_limit = _step_limit(train, tokens_per_step, total_steps)
    batches = _micro_batches(train_loader, state, train.epochs)

    if eval.initial_validation and val_loader is not None and state.step == 0:
        _run_validation(fabric, model, val_loader, eval, state, objective)

    running = _Sums(fabric.device)  # the objective's sums since the last log
    window_start, window_steps, window_tokens = time.perf_counter(), 0, 0
    compiled_before = hooks.compile_seconds() if hooks.compile_seconds else 0.0
    compile_reported = False
    run_start = time.perf_counter() - state.train_seconds
    # This start's pace, compilation left out: what the time-left estimate extrapolates.
    start_step, start_seconds, compiled_this_start = state.step, state.train_seconds, 0.0
    stop_reason = None
    ids_checked = hooks.vocab_size is None
    model.train()

    while True:
        stop_reason = _limit_reached(state, train, step_limit)
        if stop_reason:
            break
        # Rank 0's clock decides for every rank. It is read as the step starts and travels in the
        # step's all-reduce: past max_time, this step (whose data is already taken) is the last.
        out_of_time = max_seconds is not None and fabric.global_rank == 0 and time.perf_counter() - run_start >= max_seconds
        # A preemption signal (SIGTERM, SIGUSR1) received so far: it travels the same way.
        signalled = hooks.stop.received if hooks.stop is not None else None
        if hooks.stop is not None:
            hooks.stop.step_started()
        group = _take(batches, accumulation)
        if group is None and world_size == 1:
            stop_reason = f"end of data after {state.epoch} epoch(s)"
            break
        group = [fabric.to_device(b) for b in group or []]
        if not ids_checked:  # the first step of each start (one host sync)
            _check_token_ids(group, hooks.vocab_size)
            ids_checked = True
        # The objective's units (target tokens) of this optimizer step over every micro-batch and
        # rank: the loss divisor, known before any backward pass.
        zero = torch.zeros((), dtype=torch.long, device=fabric.device)
        units = sum((objective.normaliser(b) for b in group), zero)
        # Input tokens without padding (throughput, tokens_seen), unless every batch has the same shape.
        real_tokens = sum((objective.real_tokens(b) for b in group), zero) if tokens_per_step is None else zero
        global_units, global_real_tokens = units, None
        if world_size > 1:
            # The step's one all-reduce and its one host sync, before the step's work is queued. Ranks
            # read their own data and may run out at different steps (a weighted StreamMix, sharded
            # per rank, can end one step earlier on one rank), so it carries, summed over ranks:
            # the loss divisor, the real tokens, the ranks with no whole step left, rank 0's time flag.
            # Counts are integers; a float normaliser (weights) makes them all float64, exact to 2**53.
            dtype = torch.float64 if units.is_floating_point() else torch.long
            flags = [real_tokens, zero + int(group == []), zero + int(out_of_time),
                     zero + int(signalled == "SIGTERM"), zero + int(signalled == "SIGUSR1")]
            counts = torch.stack([units.to(dtype)] + [f.to(dtype) for f in flags])
            torch.distributed.all_reduce(counts)  # not fabric.all_reduce: it adds a barrier
            global_units = counts[0]
            _, global_real_tokens, ranks_out_of_data, ranks_out_of_time, terms, usr1s = (int(c) for c in counts.tolist())
            out_of_time = ranks_out_of_time > 0
            signalled = "SIGTERM" if terms else "SIGUSR1" if usr1s else None
            if ranks_out_of_data:
                stop_reason = f"end of data after {state.epoch} epoch(s) on {ranks_out_of_data} of {world_size} ranks"
                break
        # Ranks' gradients are averaged by the strategy (divided by world_size): undo that here.
        scale = (world_size / _divisor(global_units)).float()

        lr = lr_at(state.step, train, total_steps)
        for group_ in optimizer.param_groups:
            group_["lr"] = lr
        for i, batch in enumerate(group):
            accumulating = i < accumulation - 1
            with fabric.no_backward_sync(model, enabled=accumulating):
                output = objective(model, batch)
                fabric.backward(output.trained_sum * scale)
            running.add(output)
            if hooks.head_flops_per_row is not None:
                running.add_head_rows(batch, objective)
            state.micro_step += 1
        optimizer_step(fabric, model, optimizer, train.max_norm)
        state.step += 1
        if tokens_per_step is not None:
            step_tokens = tokens_per_step
        else:  # one process: read after the step's work is queued
            step_tokens = global_real_tokens if global_real_tokens is not None else int(real_tokens.item())
        state.tokens_seen += step_tokens
        window_steps += 1
        window_tokens += step_tokens

        state.train_seconds = time.perf_counter() - run_start
        if state.step % log.interval == 0:
            elapsed = time.perf_counter() - window_start
            compiling = 0.0
            if hooks.compile_seconds:
                compiled_now = hooks.compile_seconds()
                compiling, compiled_before = compiled_now - compiled_before, compiled_now
                compiled_this_start += compiling
                if compiling > 0 and not compile_reported:  # later ones (validation's graph): in the metrics only
                    fabric.print(f"torch.compile: {compiling:.1f} s compiling up to step {state.step}, left out of the step times")
                    compile_reported = True
            seconds_per_step = (state.train_seconds - start_seconds - compiled_this_start) / (state.step - start_step)
            _log_step(fabric, state, lr, running, max(elapsed - compiling, 1e-3), window_steps,
                      window_tokens, hooks, step_limit or total_steps, max_seconds, compiling, seconds_per_step)
            running = _Sums(fabric.device)
            window_start, window_steps, window_tokens = time.perf_counter(), 0, 0

        if val_loader is not None and eval.interval and state.step % eval.interval == 0:
            _run_validation(fabric, model, val_loader, eval, state, objective)
        if hooks.save_checkpoint is not None and train.save_interval and state.step % train.save_interval == 0:
            hooks.save_checkpoint(state)
        if world_size == 1 and hooks.stop is not None:
            signalled = hooks.stop.received  # one process needs no agreement: this step is the last
        if signalled is not None and hooks.stop is not None:
            hooks.stop.received = hooks.stop.received or signalled  # a rank that was not signalled itself
            hooks.stop.agreed = True
            stop_reason = f"{signalled} received: stopping to save"
            break
        if out_of_time:
            stop_reason = f"reached max_time={train.max_time}"
            break

    state.train_seconds = time.perf_counter() - run_start
    fabric.print(f"Stopped: {stop_reason}. {state.step} optimizer steps, {state.tokens_seen:,} tokens, {state.train_seconds:.1f} s.")
    if eval.final_validation and val_loader is not None and state.step > 0 and not (eval.interval and state.step % eval.interval == 0):
        _run_validation(fabric, model, val_loader, eval, state, objective)
    return state


# ---------------------------------------------------------------------------- helpers
def optimizer_step(fabric, model, optimizer, max_norm: Optional[float]) -> Optional[torch.Tensor]:
    """Clip the gradients to `max_norm` (none when None), step, and free the gradients.

    Returns the total gradient norm before clipping (None without clipping). Under FSDP the norm
    is all-reduced over the mesh where the gradients are: on the CPU when they are offloaded
    (`--distributed.cpu_offload`), so the process group needs a CPU backend (see `plan_strategy`).
    """
    norm = None
    if max_norm is not None:
        norm = fabric.clip_gradients(model, optimizer, max_norm=max_norm, error_if_nonfinite=False)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def _step_limit(train: TrainArgs, tokens_per_step: Optional[int], total_steps: Optional[int]) -> Optional[int]:
    limits = [train.max_steps] if train.max_steps else []
    if train.max_tokens and tokens_per_step:
        limits.append(train.max_tokens // tokens_per_step)
    return min(limits) if limits else None


def _limit_reached(state: TrainState, train: TrainArgs, step_limit) -> Optional[str]:
    """Why to stop before the next step by steps or tokens (the same on every rank), or None."""
    if step_limit is not None and state.step >= step_limit:
        by_tokens = train.max_tokens and (not train.max_steps or step_limit < train.max_steps)
        return f"reached {step_limit} steps" + (f" (the last whole step within max_tokens={train.max_tokens:,})" if by_tokens else "")
    if train.max_tokens and state.tokens_seen >= train.max_tokens:
        return f"reached max_tokens={train.max_tokens:,}"
    return None


def _micro_batches(loader: Iterable[dict], state: TrainState, epochs: Optional[int]) -> Iterator[dict]:
    """Micro-batches over successive epochs; `state.epoch` counts completed passes.

    The epoch is counted as complete when its last batch is handed out (known from len(loader)),
    not when the loader next raises StopIteration: a checkpoint taken right after the last batch
    then records the finished epoch, matching the loader's own position.
    """
    per_epoch = _length(loader)
    empty_passes = 0
    while epochs is None or state.epoch < epochs:
        yielded = False
        for batch in loader:
            yielded = True
            state.epoch_batches += 1
            if per_epoch is not None and state.epoch_batches >= per_epoch:
                state.epoch += 1
                state.epoch_batches = 0
            yield batch
            if epochs is not None and state.epoch >= epochs:
                return
        if state.epoch_batches:  # the pass ended before len(loader) batches
            state.epoch += 1
            state.epoch_batches = 0
        # A loader restored exactly at the end of an epoch may yield nothing once; twice means no data.
        empty_passes = 0 if yielded else empty_passes + 1
        if empty_passes >= 2:
            return


def _length(loader) -> Optional[int]:
    """Batches per epoch, or None where the loader cannot tell (a weighted mix of streams)."""
    try:
        return len(loader)
    except TypeError:
        return None


def _take(batches: Iterator[dict], n: int) -> Optional[list[dict]]:
    group = []
    for batch in batches:
        group.append(batch)
        if len(group) == n:
            return group
    return None  # not enough data left for a whole optimizer step


def _divisor(count: torch.Tensor) -> torch.Tensor:
    """`count`, or 1 where it is 0: a step or window without units has a loss sum of 0 too."""
    return count.clamp(min=1) if not count.is_floating_point() else torch.where(count > 0, count, torch.ones_like(count))


def _check_token_ids(group: list[dict], vocab_size: int) -> None:
    """Refuse token ids past the model's vocabulary in these batches (any `*input_ids` tensor)."""
    for batch in group:
        for key, value in batch.items():
            if key.endswith("input_ids") and isinstance(value, torch.Tensor) and value.numel():
                largest = int(value.max())
                if largest >= vocab_size:
                    raise UserError(
                        f"The training data holds token id {largest}, past the model's vocabulary ({vocab_size} tokens): "
                        "it was tokenized with another tokenizer. Prepare it again with the model's tokenizer."
                    )


class _Sums:
    """An objective's loss, normaliser and metric sums over micro-batches, kept on the device (no
    host sync) until `means`, which adds them up over ranks and divides by the normaliser."""

    def __init__(self, device: torch.device) -> None:
        self.loss = torch.zeros((), device=device)
        self.normaliser = torch.zeros((), dtype=torch.long, device=device)
        self.metrics: dict[str, torch.Tensor] = {}
        # Rows the output head computed (`add_head_rows`); summed over ranks by `means`.
        self.head_rows = torch.zeros((), dtype=torch.long, device=device)
        self.summed_head_rows = 0.0

    def add_head_rows(self, batch: dict, objective: Objective) -> None:
        """Count the rows the fused head computes for `batch` where it leaves out unlabelled ones
        (`Objective.head_rows`; an objective that computes every row's logits: its real tokens)."""
        rows = objective.head_rows(batch)
        self.head_rows += rows if rows is not None else objective.real_tokens(batch)

    def add(self, output: ObjectiveOutput, counted: bool = True) -> None:
        """Add `output`'s sums; not `counted` (a batch run only so that the ranks run as many): only its
        metric names and its normaliser's dtype, with zeros, so that every rank reduces the same
        tensors in `means`."""
        if not counted:
            self.normaliser = self.normaliser + torch.zeros_like(output.normaliser)  # its dtype (long or float)
            for name, value in output.metrics.items():
                self.metrics.setdefault(name, torch.zeros_like(value.detach().float()))
            return
        self.loss += output.loss_sum.detach().float()
        self.normaliser = self.normaliser + output.normaliser.detach()  # a float normaliser makes it float
        for name, value in output.metrics.items():
            value = value.detach().float()
            self.metrics[name] = self.metrics[name] + value if name in self.metrics else value.clone()

    def means(self, fabric) -> dict[str, float]:
        """{"loss": ..., **metrics}, each summed over the ranks and divided by the summed normaliser."""
        loss, normaliser = self.loss.clone(), self.normaliser.clone()
        names = sorted(self.metrics)  # every rank adds the same names: the objective returns them always (`add`)
        metrics = torch.stack([self.metrics[n] for n in names]) if names else None
        # The loss travels with the head's row count, in float64: exact for counts up to 2**53
        # (float32 on Apple's MPS, which has no float64).
        wide = torch.float32 if loss.device.type == "mps" else torch.float64
        loss_and_rows = torch.stack([loss.to(wide), self.head_rows.to(wide)])
        if fabric.world_size > 1:
            loss_and_rows = fabric.all_reduce(loss_and_rows, reduce_op="sum")
            normaliser = fabric.all_reduce(normaliser, reduce_op="sum")
            if metrics is not None:
                metrics = fabric.all_reduce(metrics, reduce_op="sum")
        loss, head_rows = loss_and_rows[0].float(), loss_and_rows[1]
        divisor = _divisor(normaliser)
        values = torch.cat([(loss / divisor).reshape(1).to(wide)]
                           + ([(metrics / divisor).to(wide)] if metrics is not None else []) + [head_rows.reshape(1)])
        *means, self.summed_head_rows = values.tolist()  # the one host-device sync
        return dict(zip(["loss", *names], means))


def _log_step(fabric, state, lr, running: _Sums, elapsed, window_steps, window_tokens, hooks, step_limit,
              max_seconds=None, compile_seconds=0.0, seconds_per_step=None):
    """Log the window of steps since the last log. `running`: the objective's sums over its
    micro-batches; `window_tokens`: real (non-padding) input tokens of its steps over all ranks;
    `elapsed`: its wall time, compilation left out; `seconds_per_step`: this start's mean (validation
    and checkpoints in, compilation out), for the time left."""
    means = running.means(fabric)  # at log steps only
    loss = means.pop("loss")
    tokens_per_sec = window_tokens / max(elapsed, 1e-9)
    metrics = {
        "train/loss": loss,
        "train/lr": lr,
        "train/tokens_seen": state.tokens_seen,
        "train/tokens_per_sec": tokens_per_sec,  # real (non-padding) input tokens, over all ranks
        "train/tokens_per_step": window_tokens / max(window_steps, 1),  # the same, per optimizer step
        "train/step_seconds": elapsed / max(window_steps, 1),
        "train/epoch": state.epoch,
        **{f"train/{name}": value for name, value in means.items()},
    }
    if compile_seconds:
        metrics["train/compile_seconds"] = compile_seconds
    line = f"step {state.step}" + (f"/{step_limit}" if step_limit else "")
    line += f" | loss {loss:.4f}" + "".join(f" | {name} {value:.4f}" for name, value in means.items())
    line += f" | lr {lr:.2e} | {tokens_per_sec:,.0f} tok/s | {elapsed / max(window_steps, 1):.2f} s/step"
    peak = hooks.device_peak_flops
    if peak is not None and not isinstance(peak, (int, float)):
        peak = peak.refresh()  # before the window's figure: the machine's rate as best measured yet
    if hooks.flops_per_token and peak:
        flops = hooks.flops_per_token * window_tokens
        if hooks.head_flops_per_row is not None:  # the head computed the labelled rows only
            flops -= hooks.head_flops_per_row * max(0.0, window_tokens - running.summed_head_rows)
        mfu = flops / max(elapsed, 1e-9) / (peak * fabric.world_size)
        metrics["train/mfu"] = mfu
        line += f" | MFU {100 * mfu:.1f}%"
    line += f" | {_duration(state.train_seconds)} elapsed" + _time_left(state, step_limit, max_seconds, seconds_per_step)
    fabric.log_dict(metrics, step=state.step)
    fabric.print(line)


def _time_left(state: TrainState, step_limit: Optional[int], max_seconds: Optional[float],
               seconds_per_step: Optional[float]) -> str:
    """", 12:05 left" when the run's length is known: from the mean time per step of this start
    (validation and checkpoints included, compilation not: it happens once), or the time limit,
    whichever ends first; "" otherwise."""
    estimates = []
    if step_limit and seconds_per_step is not None:
        estimates.append(max(seconds_per_step, 0.0) * max(0, step_limit - state.step))
    if max_seconds is not None:
        estimates.append(max(0.0, max_seconds - state.train_seconds))
    return f", {_duration(min(estimates))} left" if estimates else ""


def _duration(seconds: float) -> str:
    """h:mm:ss, or m:ss under an hour."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


@torch.no_grad()
def validate(fabric, model, loader: Iterable[dict], max_iters: int, objective: Optional[Objective] = None) -> dict[str, float]:
    """The objective's mean loss and metrics over at most `max_iters` micro-batches in all:
    {"loss": ..., "ppl": ... (objectives whose loss is a token cross-entropy), **metrics}.

    The validation samples, and so the loss, are those of one process running `max_iters`: a
    loader's global order does not depend on the number of processes, and rank r's i-th batch is
    batch i * world_size + r of that order. Under FSDP every rank must run as many forward passes:
    each runs as many as the rank with the most batches (at most ceil(max_iters / world_size)); a
    rank whose loader has ended runs its last batch again (one with no batch at all, rank 0's
    first), and such a pass, or one beyond `max_iters`, is left out of the sums. `objective` None is `CausalLM()`. Under FSDP every unit
    holds only its shards afterwards.
    """
    objective = objective if objective is not None else CausalLM()
    was_training = model.training
    model.eval()
    sums = _Sums(fabric.device)
    length = _length(loader)
    per_rank = -(-max_iters // fabric.world_size)
    mine = per_rank if length is None else min(per_rank, length)
    n_batches = mine
    batches = iter(loader)
    batch = None  # the batch a rank whose loader has ended runs again
    if fabric.world_size > 1:
        import torch.distributed as dist

        counts = torch.tensor([mine, -mine], device=fabric.device)  # (most, -fewest) over the ranks
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        n_batches, fewest = int(counts[0].item()), -int(counts[1].item())
        if fewest == 0 and n_batches > 0:
            # Fewer validation batches than ranks: a rank with none runs rank 0's first one, uncounted.
            first = next(batches) if fabric.global_rank == 0 else None
            batch = fabric.broadcast(first, src=0)
            if first is not None:
                batches = itertools.chain([first], batches)
    for i in range(n_batches):
        fresh = next(batches, None) if i < mine else None
        if fresh is None and fabric.world_size == 1:
            break  # one process: nothing to keep in step with
        if fresh is None and batch is None:  # a loader of unknown length (a mix of streams) that gave none
            raise RuntimeError(f"the validation loader of rank {fabric.global_rank} gave no batch")
        batch = fresh if fresh is not None else batch
        output = objective(model, fabric.to_device(batch))
        sums.add(output, counted=fresh is not None and i * fabric.world_size + fabric.global_rank < max_iters)
    # Forward passes without a backward pass leave the units that wait for one gathered (the final
    # norm and head, the root, every unit under SHARD_GRAD_OP): freed here, not held through the
    # training forward pass that follows.
    release_gathered(model)
    model.train(was_training)
    means = sums.means(fabric)
    if objective.reports_perplexity:
        loss = means.pop("loss")
        means = {"loss": loss, "ppl": math.exp(min(loss, 50.0)), **means}
    return means


def _run_validation(fabric, model, loader, eval: EvalArgs, state: TrainState, objective: Objective) -> None:
    start = time.perf_counter()
    means = validate(fabric, model, loader, eval.max_iters, objective)
    state.best_val_loss = min(state.best_val_loss, means["loss"])
    fabric.log_dict({f"val/{name}": value for name, value in means.items()}, step=state.step)
    described = " | ".join(f"{name} {value:.{2 if name == 'ppl' else 4}f}" for name, value in means.items())
    fabric.print(f"validation at step {state.step}: {described} | {time.perf_counter() - start:.1f} s")
