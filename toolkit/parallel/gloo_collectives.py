"""FSDP2's all-gather and reduce-scatter on CPU process groups (gloo), done in place.

FSDP2 lays its communication buffers out one slot per rank: the all-gather output is
[world_size x shard] with this rank's shard already copied into its slot, and the reduce-scatter
input is [world_size x shard] of gradients that FSDP2 drops once the shard is reduced. gloo's own
collectives (torch 2.13) add a whole buffer on top: its all-gather gathers into a temporary and
copies out, and its reduce-scatter clones its input. Measured on this machine with one 147 MiB
buffer (pythia-160m's embedding in float32), `python benchmarks/gloo_collectives.py`:

    processes  collective       gloo's own                 in place (this module)
    2          all-gather       +147 MiB, 125 ms           +0 MiB, 46 ms
    2          reduce-scatter   +149 MiB, 163 ms           +2 MiB, 146 ms
    4          all-gather       +147 MiB, 207 ms           +0 MiB, 100 ms
    4          reduce-scatter   +149 MiB, 355 ms           +0 MiB, 208 ms

That extra buffer is the size of the largest unit whatever the number of processes: on CPU it is
what kept small models' per-process peak from falling with N. Done in place (each rank sends
about one buffer's worth per collective, as gloo's ring does, and it is faster above):

    all-gather       each rank broadcasts its own slot of the output to the others
    reduce-scatter   slot r is reduced onto rank r inside the input (a scratch buffer), and this
                     rank's slot is copied to the output

NCCL needs none of this (its collectives work in the buffers they are given); `use_in_place_collectives`
installs these only on units whose shard group is a gloo group.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter


class _PlainAlloc:
    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


def _slots(flat: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """`flat` ([world_size * shard]) as world_size contiguous views of one shard each."""
    return list(flat.view(world_size, -1).unbind(0))


class InPlaceAllGather(_PlainAlloc, AllGather):
    """All-gather into FSDP2's output buffer without a second one: one broadcast per slot."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        # `input_tensor` is this rank's slot of `output_tensor` (FSDP2's copy-in); it is sent as is.
        # The broadcasts complete before returning: FSDP2 waits only when given a Work.
        for source, slot in enumerate(_slots(output_tensor, group.size())):
            dist.broadcast(slot, group=group, group_src=source)
        return None


class InPlaceReduceScatter(ReduceScatter):
    """Reduce-scatter inside FSDP2's input buffer (its scratch): one reduce per slot, onto its rank.

    It also frees the unsharded gradients FSDP2 copied into that buffer. FSDP2 (torch 2.13,
    `foreach_reduce`) drops its list of them after the copy-in, but a loop variable of that
    function still refers to the last one until the function returns: for a unit of one weight
    (the embedding, the head) the whole unsharded gradient stays alive while the output is
    allocated and filled beside the reduce-scatter buffer (pythia-160m's embedding on 4 processes:
    the end of the backward pass peaked one output, 37 MiB, higher). Each gradient whose memory
    nothing else shares is released once it has been copied in.
    """

    def __init__(self) -> None:
        self._next_is_input = True  # FSDP2 allocates the input, then the output, of each reduction
        self._copied_in: list[torch.Tensor] = []

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self._next_is_input:
            # Called by `foreach_reduce` just before it copies its `unsharded_grads` in.
            caller = sys._getframe(1)
            grads = caller.f_locals.get("unsharded_grads") if caller.f_code.co_name == "foreach_reduce" else None
            self._copied_in = [g for g in grads or () if isinstance(g, torch.Tensor)]
        self._next_is_input = not self._next_is_input
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> None:
        self._next_is_input = True
        # The copy-in is done (FSDP2 calls this after it): the gradients are no longer read.
        for grad in self._copied_in:
            storage = grad.untyped_storage()
            if torch._C._storage_Use_Count(storage._cdata) == 2:  # this gradient and `storage` only
                storage.resize_(0)
        self._copied_in = []
        slots = _slots(input_tensor, group.size())
        for destination, slot in enumerate(slots):
            # gloo may use the non-destination ranks' slot as scratch: the input is not read again.
            dist.reduce(slot, op=op, group=group, group_dst=destination)
        output_tensor.copy_(slots[group.rank()])
        # FSDP2 keeps the input alive until the next unit's reduction so that a GPU's allocator
        # does not reuse it while the collective's stream may still read it; here the reduces are
        # done, and nothing reads it again: its memory goes now (a whole unit's gradient, through
        # the next block's backward pass or, after the embedding's, the optimizer step).
        input_tensor.untyped_storage().resize_(0)
        return None


# False: FSDP2's own collectives on gloo too (tests/scripts/simulate_real.py compares a real CPU step
# with the simulated GPU one, collective by collective).
ENABLED = True


def use_in_place_collectives(unit: Any, group: dist.ProcessGroup) -> bool:
    """Install the in-place collectives on FSDP2 `unit` when `group`, its shard group, is gloo's
    (CPU training); returns whether it did. Other backends (NCCL, the simulation's fake group)
    keep FSDP2's own."""
    if not ENABLED or group.size() < 2 or dist.get_backend(group) != "gloo":
        return False
    unit.set_custom_all_gather(InPlaceAllGather())
    unit.set_custom_reduce_scatter(InPlaceReduceScatter())
    return True
