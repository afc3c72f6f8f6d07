"""Run the toolkit's real training step at real scale on fake devices: memory per rank, bytes sent.

`simulate(...)` builds the model exactly as training does and runs one optimizer step on fake
tensors (shapes and dtypes, no memory, no values) and a fake process group of the requested size:

    toolkit.models.gpt.GPT on the meta device   the same model code (and its fused loss)
    peft LoRA (`LoRAArgs.peft_config`)          when fine-tuning with LoRA
    apply_precision_policy                      the dtype of every parameter
    strategy.shard_model                        FSDP2 per Block and at the root, its precision
                                                policies, activation checkpointing, on the mesh
                                                of `mesh_layout` (HYBRID_SHARD: nodes x devices);
                                                under expert parallelism the experts split over
                                                their own mesh first (`shard_experts`)
    make_adamw                                  the training AdamW (fused)
    the loop's micro-batches                    the cross-replica all-reduce deferred to the last
                                                one (as ShardedStrategy's `no_backward_sync`), loss
                                                scaled, gradient clipping, step, zero_grad

torch's `FSDPMemTracker` records every tensor by category (sharded/unsharded parameters and
gradients, optimizer state, activations, temporaries, all-gather and reduce-scatter buffers) and
the moment of the peak, and counts the collectives it sees (`_tracker_class`).

What differs from a GPU run, and why:
- Fake tensors live on the CPU device (a CPU build of torch cannot make CUDA tensors, fake or not):
  autocast follows the CPU's op lists (linear layers and attention in 16 bits there too), and
  attention is the CPU's flash kernel (it keeps a float32 log-sum-exp per query, as CUDA's does).
  The fused loss sees fake tensors and takes its GPU path (every row computed, no kept scratch).
- Memory is counted as live tensor bytes: the CUDA caching allocator's fragmentation, NCCL's
  own buffers and the CUDA context (about 0.5-1 GiB) come on top.
- bitsandbytes layers need real data: QLoRA cannot be simulated (`toolkit estimate` falls back
  to the analytic figure).
- Routed counts have no values: under expert parallelism the all-to-alls move the rows of
  balanced routing (`toolkit.parallel.expert.balanced_exchange`); a router that favours some
  ranks' experts puts more rows there.

The fake process group is global state in torch.distributed: `simulate` creates it, refuses to
run while another process group exists, and destroys it before returning.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Optional

from toolkit.args import DistributedArgs, TrainArgs
from toolkit.errors import UserError
from toolkit.memory import moments as est
from toolkit.memory.options import GiB

# FSDPMemTracker's categories (torch 2.13, `_FSDPRefType` values) -> our names, in table order. Those
# of what is alive beside the shards are the estimate's (`toolkit.memory.moments.step_moments`).
CATEGORIES = {
    "Sharded Param": "sharded parameters",
    "Sharded Grad": "sharded gradients",
    "OptState": "optimizer state",
    "Reference Param": "reference model shards",
    "Unsharded Param": est.GATHERED,
    "Unsharded Grad": est.UNSHARDED_GRADS,
    "All Gather": est.ALL_GATHER,
    "Reduce Scatter": est.REDUCE_SCATTER,
    "Activation": est.ACTIVATIONS,
    "Temp": est.TEMPORARIES,
    "Buffer": "module buffers",
    "Inputs": "inputs",
}


@dataclass
class Simulation:
    """What one rank holds and sends during one optimizer step (bytes)."""

    world_size: int
    shard_size: int  # ranks each parameter is sharded over
    precision: str
    peak: dict[str, int]  # category -> bytes at the moment of the peak
    peak_total: int
    persistent: dict[str, int]  # after the step, before zero_grad: sharded parameters, gradients, optimizer state
    comm: dict[str, tuple[int, int]]  # collective -> (calls, bytes of the tensors it moved)
    sent_bytes: int  # bytes this rank sends per optimizer step (ring algorithms)
    seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def params_grads_optimizer(self) -> int:
        return sum(self.persistent.values())

    def table(self) -> str:
        """The figures in GiB, or in MiB for a step under 1 GiB (as `toolkit estimate`'s table)."""
        unit, scale = ("GiB", GiB) if self.peak_total >= GiB else ("MiB", 1024**2)
        lines = [f"simulated on {self.world_size} fake ranks (shard group {self.shard_size}), {self.precision}, "
                 f"{self.seconds:.1f} s. Memory of one rank at its peak, {unit}:"]
        width = max(len(v) for v in CATEGORIES.values()) + 2
        for key, label in CATEGORIES.items():
            if self.peak.get(key):
                lines.append(f"  {label.ljust(width)}{self.peak[key] / scale:10.2f}")
        lines.append(f"  {'peak (live tensors)'.ljust(width)}{self.peak_total / scale:10.2f}")
        lines.append(
            "after the step: sharded parameters {:.2f}, gradients {:.2f}, optimizer state {:.2f} {}".format(
                *(self.persistent[k] / scale for k in ("Sharded Param", "Sharded Grad", "OptState")), unit
            )
        )
        lines.append(f"sent per rank per optimizer step: {self.sent_bytes / scale:.2f} {unit}")
        for name, (calls, size) in sorted(self.comm.items()):
            lines.append(f"  {name:<20}{calls:6d} calls {size / scale:10.2f} {unit} of tensors")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def simulate(
    config: Any,
    devices: int,
    num_nodes: int = 1,
    micro_batch_size: int = 1,
    max_seq_length: int = 2048,
    precision: str = "bf16-mixed",
    sharding: str = "HYBRID_SHARD",
    finetune: Optional[str] = None,
    lora: Any = None,
    activation_checkpointing: bool = False,
    micro_batches: int = 2,
    forward: bool = True,
    train: Optional[TrainArgs] = None,
    pairs: bool = False,
    frozen_copy: bool = False,
    expert_parallel: int = 1,
) -> Simulation:
    """One optimizer step of training `config` on devices x num_nodes fake ranks (rank 0's view).

    `finetune` None or "full" trains every weight; "lora" trains the adapters of `lora` (a
    `toolkit.models.adapters.LoRAArgs`, default LoRAArgs()). `micro_batches` is the gradient
    accumulation per step (2: gradients are alive through a forward pass, as whenever the global
    batch is larger than one micro-batch per rank). `forward=False` only shards the model and
    creates the optimizer state (seconds, for the persistent figures). `train` gives the
    optimizer's hyperparameters and clipping (default TrainArgs()).

    `pairs`: a preference objective's step: each micro-batch is `micro_batch_size` pairs, twice
    as many rows, whose per-token log-probabilities (`per_token=True`) are summed into the loss
    after the reference's forward pass under no_grad: LoRA's own base with the adapters switched
    off, or with `frozen_copy` a frozen copy of the model built and sharded like it (full
    fine-tuning, `Session.build_model(frozen=True)`); reference-free or precomputed: none.

    `expert_parallel` N: each MoE layer's experts split over groups of N ranks as training splits
    them (`toolkit.parallel.expert`), their all-to-alls sized for balanced routing (the counts of
    fake tensors have no values; `balanced_exchange`).
    """
    import torch.distributed as dist

    from toolkit.parallel.plan import mesh_layout

    if finetune not in (None, "full", "lora"):
        raise UserError(f"finetune must be lora or full (or left out for pretraining), got {finetune!r}.")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise UserError(f"micro_batches must be a positive whole number, got {micro_batches!r}.")
    if max_seq_length > config.block_size:
        raise UserError(f"max_seq_length {max_seq_length} is larger than the context of {config.name} ({config.block_size}).")
    if precision.startswith("16-"):
        raise UserError(f"precision {precision} (float16) cannot be simulated on a CPU build; simulate bf16-mixed or bf16-true.")
    if precision == "32-true" and config.is_moe:
        # The estimate's recording gives them their shapes (`toolkit.memory.activations.grouped_mm_output`);
        # here torch's FSDPMemTracker must see every op as torch runs it.
        raise UserError("a mixture of experts cannot be simulated in 32-true: torch's fake kernel of grouped products "
                        "takes bf16 only; simulate bf16-mixed or bf16-true (the estimate covers 32-true).")
    plan = fsdp_plan(devices, num_nodes, precision, sharding, activation_checkpointing, expert_parallel, config)
    if plan.kind != "fsdp":
        raise UserError("simulate runs FSDP on more than one device in total; use the estimate for one device.")
    if dist.is_initialized():
        raise UserError("simulate needs its own (fake) process group, but one is already initialised in this process.")
    train = train or TrainArgs()
    notes = [n for _, n in plan.notes]
    start = time.perf_counter()

    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.world_size)
    try:
        shape, names = mesh_layout(plan.sharding, plan.num_nodes, plan.devices)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        expert_mesh = None
        if plan.expert_mesh is not None:
            expert_mesh = init_device_mesh("cpu", plan.expert_mesh[0], mesh_dim_names=plan.expert_mesh[1])
        model, decay = build(config, plan, finetune, lora, mesh, expert_mesh=expert_mesh)
        copy = build(config, plan, None, None, mesh, frozen=True, expert_mesh=expert_mesh)[0] if frozen_copy else None
        result = _run(model, decay, plan, train, micro_batch_size * (2 if pairs else 1), max_seq_length, micro_batches,
                      forward, pairs, copy, adapters_off=pairs and finetune == "lora")
    finally:
        dist.destroy_process_group()
    peak, persistent, comm, sent, attempts, copy_bytes = result
    if copy_bytes:  # alive through the whole step, made before the tracker started: added as they are
        peak = dict(peak, **{"Reference Param": copy_bytes, "Total": peak.get("Total", 0) + copy_bytes})
    if attempts > 1:
        notes.append(f"the step was tracked {attempts} times: FSDPMemTracker's count of the first was implausible (`_plausible`)")
    return Simulation(
        world_size=plan.world_size, shard_size=shape[names.index("shard")], precision=plan.precision,
        peak=peak, peak_total=peak.get("Total", 0), persistent=persistent, comm=comm, sent_bytes=sent,
        seconds=time.perf_counter() - start, notes=notes,
    )


def fsdp_plan(devices: int, num_nodes: int, precision: str, sharding: str, activation_checkpointing: bool,
              expert_parallel: int = 1, config: Any = None):
    """The training strategy's plan for FSDP on devices x num_nodes CPU ranks (`plan_strategy`), with
    `expert_parallel` checked against `config` as training checks it."""
    from toolkit.parallel.plan import plan_strategy

    dist_args = DistributedArgs(strategy="fsdp", sharding=sharding, activation_checkpointing=activation_checkpointing,
                                expert_parallel=expert_parallel)
    return plan_strategy(devices, num_nodes, precision, dist_args, accelerator="cpu", model=config)


def build(config, plan, finetune, lora, mesh, frozen: bool = False, expert_mesh: Any = None):
    """The meta model as `Session.build_model` prepares it, sharded as training shards it (the
    experts split over `expert_mesh` under expert parallelism); and the names of the weights that
    decay. `frozen`: no weight trains, and each unit frees its gathered weights after its forward
    pass (a reference model)."""
    import torch

    from toolkit.models.gpt import GPT, Block
    from toolkit.optim import decay_names
    from toolkit.parallel.fsdp import shard_model
    from toolkit.parallel.precision import apply_precision_policy

    with torch.device("meta"):
        model = GPT(config)
    if finetune == "lora":
        from peft import get_peft_model

        from toolkit.models.adapters import LoRAArgs

        model = get_peft_model(model, (lora or LoRAArgs()).peft_config())  # as finetune_lora's `prepare`
    if frozen:
        model.requires_grad_(False)
    apply_precision_policy(model, plan.precision)
    decay = decay_names(model)
    shard_model(model, mesh, plan, Block, expert_mesh=expert_mesh)  # what ShardedStrategy.setup_module does
    if frozen:
        from toolkit.parallel.fsdp import reshard_after_every_forward

        reshard_after_every_forward(model)
        model.eval()
    return model, decay


def adamw(model, decay: set[str], train: TrainArgs):
    """The training AdamW (fused: its step makes no temporaries to count)."""
    from toolkit.optim import make_adamw

    return make_adamw(model, decay, train)


def _run(model, decay, plan, train, rows, max_seq_length, micro_batches, forward, pairs=False, copy=None,
         adapters_off=False):
    """The tracked step on fake tensors, and the bytes of the frozen copy's shards (0: none)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from toolkit.memory.activations import on_fake_tensors

    with FakeTensorMode(allow_non_fake_inputs=True), on_fake_tensors():
        model.to_empty(device="cpu")  # each rank's shards (setup_model then reads the rows)
        reference = None
        if copy is not None:
            copy.to_empty(device="cpu")
            reference = lambda x, y: copy(x, labels=y, per_token=True)  # noqa: E731
        elif adapters_off:  # as `toolkit.training.reference.AdaptersOff` runs it
            from toolkit.models.adapters import adapters_switched_off
            from toolkit.parallel.fsdp import release_gathered

            def reference(x, y):
                with adapters_switched_off(model):
                    model(x, labels=y, per_token=True)
                release_gathered(model)
        optimizer = adamw(model, decay, train)
        x = torch.zeros(rows, max_seq_length, dtype=torch.long)
        copy_bytes = _persistent(copy, None)["Sharded Param"] if copy is not None else 0
        return (*tracked_step(model, optimizer, plan, train, x, x.clone(), micro_batches, forward, pairs, reference), copy_bytes)


def tracked_step(model, optimizer, plan, train: TrainArgs, x, y, micro_batches: int, forward: bool = True,
                 pairs: bool = False, reference=None):
    """One untracked step, then one optimizer step under the memory tracker (on fake tensors in
    `simulate`; on real ones in tests/scripts/simulate_real.py, which proves the simulation).
    `pairs`: the loss is the sum of per-token log-probabilities, after the reference's forward pass
    `reference(x, y)` (None: none) under no_grad.
    Returns (peak by category, persistent by category, collectives, bytes sent, attempts)."""
    import torch

    from toolkit.parallel.fsdp import cross_replica_reduce_deferred

    def loss_of(x, y):
        if not pairs:
            return model(x, labels=y)
        if reference is not None:
            with torch.no_grad():
                reference(x, y)
        return model(x, labels=y, per_token=True).sum()

    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if plan.precision.endswith("-mixed") else nullcontext()
    # Gradients on two meshes (the experts' and the rest, under expert parallelism) are clipped as
    # training clips them (`toolkit.training.fabric`).
    clip = torch.nn.utils.clip_grad_norm_
    if plan.expert_mesh is not None:
        from toolkit.parallel.expert import clip_grad_norm as clip
    # One untracked step first, so that the tracked one is a steady-state step: AdamW's state
    # exists, and FSDP2 has allocated the gathered parameters' storages (its first forward and
    # backward do; later gathers resize them. Seen by the tracker, that first allocation was
    # counted as activations that are never freed, torch 2.13). It runs the tracked step's ops
    # (clipping and the fused AdamW step included), so that DTensor has already propagated the
    # shardings of each: the first propagation of a foreach op over hundreds of gradients makes
    # fake tensors that the tracker counted, 13x the optimizer state at 70B (`_plausible` caught
    # it, and the whole step was tracked twice).
    if not forward:  # only the persistent figures: AdamW's state, per tensor (no propagation to pay for)
        _zero_grads(model)
        kernels = [(group.get("fused"), group.get("foreach")) for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["fused"], group["foreach"] = False, False
        optimizer.step()
        for group, (fused, foreach) in zip(optimizer.param_groups, kernels):
            group["fused"], group["foreach"] = fused, foreach
        return {}, _persistent(model, optimizer), {}, 0, 1
    with autocast:
        loss = loss_of(x, y)
    loss.backward()
    if train.max_norm is not None:
        clip(model.parameters(), train.max_norm, error_if_nonfinite=False)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for attempt in range(1, _ATTEMPTS + 1):
        tracker = _tracker_class()(model, optimizer)
        tracker.track_inputs((x, y))
        with tracker:
            for i in range(micro_batches):
                tracker.reset_mod_stats()  # per-module stats only; the peak is kept
                with cross_replica_reduce_deferred(model, i < micro_batches - 1):
                    with autocast:
                        loss = loss_of(x, y)
                    (loss * 0.5).backward()  # the loop scales by world_size / target tokens
            if train.max_norm is not None:
                clip(model.parameters(), train.max_norm, error_if_nonfinite=False)
            optimizer.step()
            now = _snapshot(tracker)
            optimizer.zero_grad(set_to_none=True)
        peak = _snapshot(tracker, "peak")
        if _plausible(peak, now):
            break
    else:
        def gib(snapshot: dict[str, int]) -> str:
            return ", ".join(f"{k} {v / 2**30:.3f}" for k, v in snapshot.items() if v)

        raise RuntimeError(f"FSDPMemTracker's count of the step was implausible in {_ATTEMPTS} attempts "
                           f"(torch {torch.__version__}; GiB at the peak: {gib(peak)}; at the end: {gib(now)})")
    persistent = {k: now.get(k, 0) for k in ("Sharded Param", "Sharded Grad", "OptState")}
    return peak, persistent, dict(tracker.calls), tracker.sent, attempt


_ATTEMPTS = 6


def _plausible(peak: dict[str, int], end: dict[str, int]) -> bool:
    """Whether FSDPMemTracker's peak can be true, given what it counts at the end of the step.

    A guard, since the untracked step runs every op of the tracked one first (`tracked_step`). A
    tracked step on fake tensors that came first was often not (torch 2.13): it counted the fake
    tensors of DTensor's first sharding propagation of the foreach AdamW step as optimizer state
    (13 times the state, where the step's temporaries add at most one state's worth), or those of
    clipping's foreach ops as activations, or it missed FSDP's gathering and counted the gathered
    copies as activations (a peak full of activations without any gathered parameter; a true peak
    without one comes after the activations are gone: the end of the backward pass, the optimizer
    step). Such a count is discarded and the step tracked again.
    """
    if peak.get("OptState", 0) > 2 * end.get("OptState", 0):
        return False
    left = peak.get("Activation", 0) - end.get("Activation", 0)
    return peak.get("Unsharded Param", 0) > 0 or left <= peak.get("Total", 0) // 100


def _persistent(model, optimizer) -> dict[str, int]:
    """Bytes of the storages of the rank's parameter shards (FSDP2 pads them to equal shards, each
    parameter in its own storage), gradients and optimizer state, as the tracker counts them."""
    import torch

    def storages(tensors) -> int:
        return sum(_local(t).untyped_storage().nbytes() for t in tensors)

    params = list(model.parameters())
    states = [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)] if optimizer else []
    return {
        "Sharded Param": storages(params),
        "Sharded Grad": storages(p.grad for p in params if p.grad is not None),
        "OptState": storages(states),
    }


def _snapshot(tracker, kind: str = "current") -> dict[str, int]:
    (snap,) = tracker.get_tracker_snapshot(kind).values()  # one device: the CPU
    return {_key(k): v for k, v in snap.items()}


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _zero_grads(model) -> None:
    import torch

    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)


def _key(k: Any) -> str:
    return getattr(k, "value", str(k))


def _tracker_class():
    """FSDPMemTracker that also counts the c10d collectives it sees: calls, tensor bytes, and the
    bytes this rank sends with ring algorithms (all-gather and reduce-scatter: (n-1)/n of the full
    tensor; all-reduce twice that). One dispatch mode: a second one beside the tracker made it
    lose track of freed all-gather outputs (torch 2.13)."""
    from copy import deepcopy

    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    class _Tracker(FSDPMemTracker):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.calls: dict[str, tuple[int, int]] = {}
            self.sent = 0
            self._in_collective = False

        # DTensor's sharding propagation runs each op it has not cached once more on fake tensors
        # of the op's global shapes, to learn the output's shape: none of that is the rank's
        # memory, but under the simulation's fake mode the tracker counted it. torch 2.11 caches
        # no propagation of the optimizer step, so every tracked step counted 4 fake copies of
        # the full (unsharded) parameters as optimizer state (2.13 had hit its cache by then).
        def __enter__(self) -> Any:
            if self._depth == 0:
                self._in_propagation = False
                self._unpatched = ShardingPropagator._propagate_tensor_meta_non_cached
                tracker, unpatched = self, self._unpatched

                def propagate(prop, op_schema):
                    tracker._in_propagation = True
                    try:
                        return unpatched(prop, op_schema)
                    finally:
                        tracker._in_propagation = False

                ShardingPropagator._propagate_tensor_meta_non_cached = propagate
            return super().__enter__()

        def __exit__(self, *args: Any) -> None:
            super().__exit__(*args)
            if self._depth == 0:
                ShardingPropagator._propagate_tensor_meta_non_cached = self._unpatched

        def _track(self, reftype: Any, t: Any) -> None:
            if not (self._in_collective or self._in_propagation):
                super()._track(reftype, t)

        def _update_peak_stats(self, peak_state: Any) -> None:
            # Only the rank's overall peak is read (`_snapshot`); this keeps it as torch does.
            # torch's version also updates every module's own peak after every op: it walks all
            # tracked modules (thousands at 70B with LoRA), and each weak reference it follows
            # probes its module for an attribute it lacks (an AttributeError raised through the
            # checkpoint wrapper's __getattr__). That was over half of a 70B simulation's time
            # (79 of 149 s under a profiler, torch 2.13).
            for device, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[device] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[device] = deepcopy(snap)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            collective = getattr(func, "namespace", None) == "c10d"
            # What a collective returns under fake tensors is not the buffer it fills (args, which
            # the tracker follows): tracked, it was counted as a never-freed activation.
            self._in_collective = collective
            try:
                out = super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self._in_collective = False
            if out is not NotImplemented and collective:
                name = func._overloadpacket.__name__.strip("_")
                size, factor = _collective_size(name, args)
                if size is not None:
                    calls, total = self.calls.get(name, (0, 0))
                    self.calls[name] = (calls + 1, total + size)
                    self.sent += int(size * factor)
            return out

    return _Tracker


def _collective_size(name: str, args) -> tuple[Optional[int], float]:
    """(bytes of the full tensor, fraction of it one rank sends) of a c10d op, or (None, 0)."""
    import torch
    import torch.distributed as dist

    from toolkit.memory.activations import flat_tensors

    n = 1
    for a in args:
        if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
            n = dist.ProcessGroup.unbox(a).size()
    if n <= 1:
        return None, 0.0
    first = flat_tensors(args[0])
    nbytes = sum(t.numel() * t.element_size() for t in first)
    if name.startswith("allgather"):  # args[0]: the gathered output
        return nbytes, (n - 1) / n
    if name.startswith("reduce_scatter"):  # args[0]: the output shard; the input is n times larger
        return nbytes * n, (n - 1) / n
    if name.startswith("allreduce"):
        return nbytes, 2 * (n - 1) / n
    if name.startswith("broadcast"):
        return nbytes, 1.0
    if name.startswith("alltoall"):  # args[0]: the rows received; a rank keeps 1/n of what it sends
        return nbytes, (n - 1) / n
    return nbytes, 1.0
