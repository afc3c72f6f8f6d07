"""Batch math, defined once: how a global batch splits over devices, nodes and accumulation steps.

Pure arithmetic with no distributed content: `plan_batches` is called once at start-up, before
any process starts, and its `BatchPlan` is handed to the training loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.errors import UserError


@dataclass(frozen=True)
class BatchPlan:
    """How a global batch is split: over devices, nodes and gradient-accumulation steps.

    global_batch_size = devices * num_nodes * micro_batch_size * gradient_accumulation_iters,
    counted in sequences of max_seq_length tokens.
    """

    devices: int
    num_nodes: int
    micro_batch_size: int
    global_batch_size: int
    max_seq_length: int
    gradient_accumulation_iters: int

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step (at most: sequences may be padded or packed shorter)."""
        return self.global_batch_size * self.max_seq_length

    def table(self) -> str:
        """A human-readable summary printed at start-up."""
        rows = [
            ("devices per node", f"{self.devices}"),
            ("nodes", f"{self.num_nodes}"),
            ("micro batch (per device)", f"{self.micro_batch_size}"),
            ("gradient accumulation steps", f"{self.gradient_accumulation_iters}"),
            (
                "global batch (sequences)",
                f"{self.global_batch_size} = {self.devices} x {self.num_nodes} x "
                f"{self.micro_batch_size} x {self.gradient_accumulation_iters}",
            ),
            ("sequence length", f"{self.max_seq_length}"),
            ("tokens per optimizer step", f"{self.tokens_per_step:,}"),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(["Batch plan"] + [f"  {name:<{width}}  {value}" for name, value in rows])


def plan_batches(
    devices: int, num_nodes: int, micro_batch_size: int, global_batch_size: int, max_seq_length: int
) -> BatchPlan:
    """Resolve the accumulation steps; raise UserError (never round) if the batch does not split."""
    for name, value in (
        ("devices", devices),
        ("num_nodes", num_nodes),
        ("micro_batch_size", micro_batch_size),
        ("global_batch_size", global_batch_size),
        ("max_seq_length", max_seq_length),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{name} must be a positive integer, got {value!r}.")
    world_size = devices * num_nodes
    per_iter = world_size * micro_batch_size  # sequences per accumulation step, all ranks together
    if global_batch_size % per_iter:
        raise UserError(_indivisible_message(devices, num_nodes, micro_batch_size, global_batch_size))
    return BatchPlan(
        devices=devices,
        num_nodes=num_nodes,
        micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size,
        max_seq_length=max_seq_length,
        gradient_accumulation_iters=global_batch_size // per_iter,
    )


def _indivisible_message(devices: int, num_nodes: int, micro: int, global_batch: int) -> str:
    world_size = devices * num_nodes
    per_iter = world_size * micro
    below = (global_batch // per_iter) * per_iter
    above = below + per_iter
    options = [str(n) for n in (below, above) if n > 0]
    message = (
        f"global_batch_size {global_batch} is not a multiple of devices x nodes x micro_batch_size "
        f"= {devices} x {num_nodes} x {micro} = {per_iter}. Use global_batch_size "
        + " or ".join(options)
    )
    # The largest smaller micro batch that divides the global batch (accumulating more steps).
    if global_batch % world_size == 0:
        per_rank = global_batch // world_size
        fits = [m for m in range(min(micro, per_rank), 0, -1) if per_rank % m == 0]
        if fits:
            message += f", or micro_batch_size {fits[0]}"
    return message + "."
