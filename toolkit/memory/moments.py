"""The moments of a training step at which memory can peak, and what is alive at each, by category.

The FSDP part follows torch 2.13's `fully_shard` as `toolkit.parallel.fsdp.shard_model`
applies it (`fsdp_moments`); the simulation (`toolkit.memory.simulation`) runs the real step and
tests/test_simulate.py holds the two to each other category by category.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from toolkit.memory.parameters import (ParamSpec, padded_shard_numel, quantized_bytes, quantized_names, shard_bytes,
                                       split_inside)

if TYPE_CHECKING:
    from toolkit.memory.activations import Activations
    from toolkit.memory.options import Column, Options

# What one device holds at a moment of the step besides parameters, gradients and optimizer state,
# by category. The FSDP categories are those of torch's FSDPMemTracker, whose figures
# `toolkit.memory.simulation` reports (`simulate.CATEGORIES` names them the same way), so that the
# two can be held to each other category by category (tests/test_simulate.py).
ACTIVATIONS = "activations"  # made in the forward pass: what autograd saves, the loss's forward buffers, autocast's copies
TEMPORARIES = "temporaries"  # made in the backward pass or the optimizer step
GATHERED = "unsharded parameters"
ALL_GATHER = "all-gather buffers"
UNSHARDED_GRADS = "unsharded gradients"
REDUCE_SCATTER = "reduce-scatter buffers"
BUCKETS = "DDP gradient buckets"
DEQUANTIZED = "dequantized weight"  # a quantized weight dequantized for a block's compute, one at a time
Moment = dict[str, int]


def fsdp_moments(specs: list[ParamSpec], column: "Column", opts: "Options") -> dict[str, Moment]:
    """What FSDP2 holds beside the shards on one rank, by category, at each moment of a step at which
    the step can peak, in the order torch 2.13's `fully_shard` runs. Activations are added by
    `step_moments`. The units are those of `toolkit.parallel.fsdp.shard_model`: one per block;
    untied, one for the embedding, one for the final norm and one for the head; tied, the shared
    matrix with the final norm in the root.

    - Gathering: under "*-mixed" each unit's float32 shards are cast to the compute dtype and
      all-gathered into one flat output (gloo, on CPU, stages it twice); each parameter's copy is
      then cut from it ("copy-out"). An NF4 weight (`--quantize nf4`) is gathered as its NF4 bytes,
      not cast. Under CPU offload each shard is first copied to the device. In the forward pass a
      unit's flat output is freed after the next unit's copy-out; the output units' (the final
      norm's and the head's) right after their own, by the toolkit's forward pre-hook
      (`toolkit.parallel.fsdp._free_flat_gather_output`), so none is alive at the loss but a
      tied root's last block's (freed when the forward pass ends); in the backward pass right
      after the unit's own copy-out.
    - Blocks and the embedding are released after their forward pass (not under SHARD_GRAD_OP) and
      gathered again for their backward pass, each prefetched when the unit after it starts its
      backward pass: the last block when the final norm does, the embedding when block 0 does.
      The final norm and the head stay gathered from their forward pass through their backward
      pass. A tied root stays gathered all step. NO_SHARD gathers by copying the shard.
    - Reducing: after a unit's backward pass its gathered copies are released, then its unsharded
      gradients (in the gathered dtype) are copied into a reduce-scatter input padded to the shard
      group, in the reduction dtype (the trainable dtype), which FSDP keeps until the next unit
      reduces. A tied root's gradients stay unsharded until the end of the backward pass.
    """
    W = column.shard_size
    gloo = opts.device == "cpu"
    units: dict[int, list[ParamSpec]] = {}
    for s in specs:
        units.setdefault(s.unit, []).append(s)
    blocks = [members for unit, members in sorted(units.items()) if unit >= 0]
    quantized = quantized_names(opts, specs)
    edges = units.get(-1, [])
    tied = not any(s.group == "input" for s in edges)  # the embedding in the root, with the head it is tied to

    def gathered(s: ParamSpec) -> int:
        """`s` gathered whole: an NF4 weight as its NF4 bytes (torchao's NF4Tensor all-gathers its
        codes, scales and factors as they are stored), any other in `Options.gathered_bytes`,
        padded to the shard group."""
        if s.name in quantized:
            return quantized_bytes(s.shape, opts.quantize)  # type: ignore[arg-type]
        group = s.shard_group(W)  # experts split over expert-parallel ranks: this rank's, over W / N
        return padded_shard_numel(s, group) * group * opts.gathered_bytes(s, column)

    def copies(members: list[ParamSpec]) -> int:
        return sum(gathered(s) for s in members)

    def split(s: ParamSpec) -> bool:
        return split_inside(s, s.shard_group(W), quantized)

    def copy_out(members: list[ParamSpec]) -> int:
        """The temporaries of a copy-out: a weight split along dim 1 is cut from the flat output
        into a temporary of its gathered size, then interleaved into its copy (torch 2.13)."""
        return sum(gathered(s) for s in members if split(s))

    def interleaved_grads(members: list[ParamSpec]) -> int:
        """The copies a reduction makes of the gradients of weights split along dim 1 (their
        pieces put rank by rank before the reduce-scatter's copy-in)."""
        return sum(s.numel * opts.gathered_bytes(s, column) for s in members if s.trainable and split(s))

    def flat(members: list[ParamSpec]) -> int:
        return sum(gathered(s) for s in members if s.shard_group(W) > 1)

    def sent(members: list[ParamSpec]) -> int:
        """The all-gather's inputs made for it: the shards stored in another dtype than the one they
        are gathered in (float32 under "*-mixed"), cast to it (a frozen 16-bit or NF4 shard is sent
        as stored); under CPU offload every shard copied to the device first."""
        cast = sum(gathered(s) // s.shard_group(W) for s in members
                   if s.name not in quantized and opts.gathered_bytes(s, column) != opts.param_bytes(s))  # fmt: skip
        return cast + (sum(shard_bytes(s, s.shard_group(W), opts, quantized) for s in members) if opts.cpu_offload else 0)

    def in_flight(members: list[ParamSpec]) -> int:
        """An all-gather before its copy-out: its flat output (twice under gloo) and its inputs (`sent`)."""
        return (2 if gloo else 1) * flat(members) + sent(members) if W > 1 else copies(members)

    def grads(members: list[ParamSpec]) -> int:
        return sum(s.numel * opts.gathered_bytes(s, column) for s in members if s.trainable)

    def reduce_input(members: list[ParamSpec]) -> int:
        return sum(padded_shard_numel(s, s.shard_group(W)) * s.shard_group(W) * opts.trainable_bytes
                   for s in members if s.trainable)

    def larger(*moments: Moment) -> Moment:
        return max(moments, key=lambda m: sum(m.values()))

    def reduced_last(members: list[ParamSpec]) -> list[ParamSpec]:
        """What of a unit is reduce-scattered last in its backward pass: under expert parallelism a
        block's experts are a unit of their own (`toolkit.parallel.expert`), reduced before the
        rest of the block (attention, norms, router), whose reduce-scatter input replaces theirs."""
        dense = [s for s in members if s.expert_parallel == 1]
        return dense if len(dense) < len(members) else members

    def experts_of(members: list[ParamSpec]) -> list[ParamSpec]:
        return [s for s in members if s.expert_parallel > 1]

    def gather(unit: list[ParamSpec], before: list[ParamSpec], held: int) -> Moment:
        """`unit` gathered in the forward pass while the flat output of the unit `before` is alive."""
        if W == 1:
            return {GATHERED: held + copies(unit)}
        return larger({GATHERED: held, ALL_GATHER: flat(before) + in_flight(unit)},
                      {GATHERED: held + copies(unit), ALL_GATHER: flat(before) + flat(unit) + copy_out(unit)})  # fmt: skip

    keep_all = column.name == "SHARD_GRAD_OP"  # every unit stays gathered from its forward to its backward pass
    # the root: a tied matrix, the final norm (and a head bias, LoRA adapters of the head)
    root = [s for s in edges if s.group == "root"]
    embed = [s for s in edges if s.group == "input"]
    head = [s for s in edges if s.group == "head"]
    norm = [s for s in edges if s.group == "output"]
    output = norm + head
    block = max(blocks, key=copies, default=[])
    first, last = (blocks[0], blocks[-1]) if blocks else ([], [])
    held_root = copies(root)
    every_unit = copies(embed) + sum(copies(m) for m in blocks) if keep_all else 0  # SHARD_GRAD_OP, at the loss
    root_grads = grads(root)  # tied: the head's gradient, held unsharded through the blocks' backward passes
    m: dict[str, Moment] = {}
    if embed:
        m["embedding gathered"] = gather(embed, [], 0)
    m["block 0 gathered"] = gather(first, root or embed, held_root + (copies(embed) if keep_all else 0))
    m["last block gathered"] = gather(last, blocks[-2] if len(blocks) > 1 else root or embed,
                                      held_root + (every_unit - copies(last) if keep_all else 0))  # fmt: skip
    # its forward pass: gathered, the flat output of the block before it freed by its copy-out
    m["last block forward"] = {GATHERED: held_root + (every_unit if keep_all else copies(last)), ALL_GATHER: flat(last)}
    at_loss = held_root + copies(output) + every_unit
    if head:  # the head gathered after the final norm, whose flat output its hook freed
        m["head gathered"] = gather(head, [], at_loss - copies(head))
    m["loss forward"] = {GATHERED: at_loss, ALL_GATHER: 0 if output else flat(last)}
    if tied:  # the root's backward pass starts with the loss's: the last block is prefetched
        if keep_all:
            m["loss backward"] = {GATHERED: at_loss}
        else:
            m["loss backward"] = {GATHERED: at_loss + (0 if W > 1 else copies(last)), ALL_GATHER: flat(last)}
    else:
        m["loss backward"] = {GATHERED: at_loss}
        # the head released, its gradients reduced; then the last block prefetched beside its input
        rest = at_loss - copies(head)
        prefetch = 0 if keep_all else in_flight(last)
        m["head reduced"] = larger({GATHERED: rest, UNSHARDED_GRADS: grads(head), REDUCE_SCATTER: reduce_input(head)},
                                   {GATHERED: rest, ALL_GATHER: prefetch, REDUCE_SCATTER: reduce_input(head)})  # fmt: skip
    # A block's backward pass: its copies, the unit before it prefetched (its flat output) and the
    # reduce-scatter input of the unit after it (the last block's: the final norm's, a few KiB; the
    # head's went when the final norm reduced). A tied root's gradient is a temporary until the end.
    # (SHARD_GRAD_OP: every unit gathered but those whose backward pass is done.)
    held = held_root + (every_unit - copies(block) if keep_all else 0)
    done = copies(block) if keep_all else 0  # SHARD_GRAD_OP: the last block, released

    def backward(prefetched: list[ParamSpec], previous: list[ParamSpec], released: int) -> Moment:
        return {GATHERED: held + copies(block) - released, TEMPORARIES: root_grads,
                ALL_GATHER: 0 if keep_all else flat(prefetched), REDUCE_SCATTER: reduce_input(reduced_last(previous))}  # fmt: skip

    m["last block backward"] = backward(block, norm, 0)
    m["block backward"] = backward(block, block, done)
    # The end of its backward pass: the gradients autograd made for its weights, not yet taken by FSDP.
    m["block backward end"] = backward(block, block, done)
    m["block backward end"][TEMPORARIES] += grads(block)
    # Its end, the larger of: released, its gradients copied into its reduce-scatter input beside the
    # prefetched unit's flat output; and the next block's turn (its copy-out, then the prefetch of the
    # one after it), beside this block's reduce-scatter input.
    last_reduced = reduced_last(block)
    end = {GATHERED: held - done, TEMPORARIES: root_grads,
           UNSHARDED_GRADS: grads(last_reduced) + interleaved_grads(last_reduced),
           ALL_GATHER: 0 if keep_all else flat(block), REDUCE_SCATTER: reduce_input(last_reduced)}  # fmt: skip
    turn = {GATHERED: held + copies(block), TEMPORARIES: root_grads, ALL_GATHER: in_flight(block),
            REDUCE_SCATTER: reduce_input(last_reduced)}  # fmt: skip
    copied_out = dict(turn, **{ALL_GATHER: flat(block) + copy_out(block)})
    m["block reduced"] = end if keep_all else larger(end, turn, copied_out)
    if experts_of(block):  # the experts' own unit reduced, beside the rest of the block's gradients to come
        experts = experts_of(block)
        m["block experts reduced"] = {GATHERED: held + copies(block) - done, TEMPORARIES: root_grads,
                                      UNSHARDED_GRADS: grads(experts) + interleaved_grads(experts),
                                      REDUCE_SCATTER: reduce_input(experts)}  # fmt: skip
    if embed:  # the embedding is not gathered for its backward pass (set_unshard_in_backward(False))
        m["block 0 backward"] = backward([], block, every_unit - copies(embed) - copies(block) if keep_all else 0)
        m["block 0 backward end"] = dict(m["block 0 backward"])
        m["block 0 backward end"][TEMPORARIES] += grads(block)
        m["embedding reduced"] = larger(
            {GATHERED: copies(embed) if keep_all else 0, TEMPORARIES: grads(embed), REDUCE_SCATTER: reduce_input(first)},
            {UNSHARDED_GRADS: grads(embed), REDUCE_SCATTER: reduce_input(embed)},
        )
    else:  # the embedding's gradient is added to the head's (a third tensor), then the root is reduced
        m["root reduced"] = larger(
            {GATHERED: held_root, TEMPORARIES: 3 * root_grads, REDUCE_SCATTER: reduce_input(first)},
            {UNSHARDED_GRADS: root_grads, REDUCE_SCATTER: reduce_input(root)},
        )
    return {name: {k: v for k, v in moment.items() if v} for name, moment in m.items()}


def strategy_moments(specs: list[ParamSpec], column: "Column", opts: "Options") -> dict[str, Moment]:
    """What the strategy holds beside parameters, gradients and optimizer state at each moment:
    under FSDP, `fsdp_moments`; with DDP its buckets, as large as the gradients, all step."""
    if column.kind == "fsdp":
        return fsdp_moments(specs, column, opts)
    buckets = sum(s.numel * opts.trainable_bytes for s in specs if s.trainable) if column.kind == "ddp" else 0
    return {name: {BUCKETS: buckets} for name in ("last block forward", "loss forward", "loss backward", "last block backward")}


# The moments of `step_moments` at which a block computes (a quantized base's weight dequantized).
BLOCK_COMPUTE = ("block 0 gathered", "last block gathered", "last block backward", "block backward",
                 "block backward end", "block 0 backward", "block 0 backward end")


def step_moments(opts: "Options", column: "Column", act: "Activations", checkpointed: bool,
                 specs: list[ParamSpec]) -> dict[str, Moment]:  # fmt: skip
    """Everything alive on one device beside parameters, gradients and optimizer state, by category,
    at each moment of a step at which it can peak (`column_memory`'s total is the largest).

    Activations: in the forward pass a checkpointed block keeps only its input; in the backward
    pass it is recomputed (its activations and weight copies made again, temporaries then) beside
    the most its backward pass holds beyond what it saved (`Activations.backward_in_flight`,
    recorded), and under expert parallelism a MoE layer's all-to-all buffers (`Activations.all_to_all`).
    The loss's saved gradients go with its backward pass, the last
    block's activations (or input) with its own. The strategy's part is `strategy_moments`. A
    quantized base's dequantized weight (`Activations.dequant_scratch`) exists while a block
    computes: in its forward pass (counted at its gathering) and its backward pass.
    """
    saved_forward = sum(act.block_inputs) if checkpointed else act.stored
    saved_backward = sum(act.block_inputs) if checkpointed else act.stored
    copies = act.copies_in_backward(checkpointed)
    # FSDP holds a block's weights' gradients unsharded until its backward pass ends
    in_flight = (act.backward_grads_in_flight if column.kind == "fsdp" else act.backward_in_flight) + act.all_to_all
    if checkpointed:  # a block recomputed (its forward pass, transients and all), then its backward pass
        in_flight = max(act.forward_in_flight, max(act.blocks) + in_flight)
    last_block = act.block_inputs[-1] if checkpointed else act.blocks[-1]  # what the last block keeps
    activations: dict[str, Moment] = {
        # the head gathered beside the final norm's output (FSDP, untied head)
        "head gathered": {ACTIVATIONS: saved_forward + act.head - act.loss_saved + act.head_input + act.loss_kept
                          + act.weight_copies},
        "loss forward": {ACTIVATIONS: saved_forward + act.head + act.loss_forward + act.weight_copies},
        "loss backward": {ACTIVATIONS: saved_backward + act.head + act.loss_kept + copies,
                          TEMPORARIES: act.loss_backward},
        "head reduced": {ACTIVATIONS: saved_backward + act.head - act.loss_saved + act.loss_kept + copies,
                         TEMPORARIES: act.hidden_grad},
        # the last block's backward pass, with every block's activations (or inputs) still there
        "last block backward": {ACTIVATIONS: saved_backward + act.loss_kept + copies,
                                TEMPORARIES: in_flight},
        # the block before it (the reduce-scatter input of the last one alive), and each one's end
        "block backward": {ACTIVATIONS: saved_backward - last_block + act.loss_kept + copies,
                           TEMPORARIES: in_flight},
        "block reduced": {ACTIVATIONS: saved_backward - last_block + act.loss_kept + copies,
                          TEMPORARIES: act.hidden_grad},
        # the end of a block's backward pass: its activations gone but its input's, the gradient
        # arriving and the one leaving (its weights' gradients are the strategy's part)
        "block backward end": {ACTIVATIONS: saved_backward - last_block + act.loss_kept + copies,
                               TEMPORARIES: 2 * act.hidden_grad},
        "block 0 backward end": {ACTIVATIONS: act.block_inputs[0] + act.loss_kept, TEMPORARIES: 2 * act.hidden_grad},
        # block 0's backward pass: only its own activations are left
        "block 0 backward": {ACTIVATIONS: (act.block_inputs[0] if checkpointed else act.blocks[0]) + act.loss_kept,
                             TEMPORARIES: in_flight},
        "block 0 gathered": {ACTIVATIONS: act.block_inputs[0]},
        "last block gathered": {ACTIVATIONS: saved_forward - (act.block_inputs[-1] if checkpointed else act.blocks[-1])
                                + act.block_inputs[-1]},
        # in its forward pass, at the most it holds (`Activations.forward_in_flight`); checkpointed, what
        # it saves is freed as its forward pass goes: less than that
        "last block forward": {ACTIVATIONS: saved_forward - (act.block_inputs[-1] if checkpointed else act.blocks[-1])
                               + act.forward_in_flight + act.weight_copies, TEMPORARIES: act.all_to_all},
    }  # fmt: skip
    moments: dict[str, Moment] = {}
    for name, held in strategy_moments(specs, column, opts).items():
        moment = dict(activations.get(name, {}))
        for key, value in held.items():
            moment[key] = moment.get(key, 0) + value
        if name in BLOCK_COMPUTE:
            moment[DEQUANTIZED] = act.dequant_scratch
        moments[name] = {k: v for k, v in moment.items() if v}
    moments["optimizer step"] = {}  # AdamW's fused step updates in place (`toolkit.optim`): nothing more
    return moments
