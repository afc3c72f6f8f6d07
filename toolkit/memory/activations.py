"""What a micro-batch's forward pass leaves for the backward pass, recorded from the real model.

`record` runs the model's own code on fake tensors (shapes and dtypes, no memory): `GPT` with its
first block and one block of each kind after it (`layer_slots`: the first block may see an input
that needs no gradient, under LoRA; from the second on, blocks of a kind save alike), peft's LoRA layers (dropout included) when
asked, the parameters in the dtypes the forward pass sees (as stored, or as FSDP gathers them under
"*-mixed"; the embedding's output cast back to its stored dtype as FSDP's output policy does),
autocast for "*-mixed", and the loss. `torch.autograd.graph.saved_tensors_hooks` sees every tensor
autograd keeps; they are counted once per storage, parameters left out, and attributed to the
block that saved them, or to the rest of the model (the token ids, rotary tables every block shares,
the final norm, the loss's kept gradients). A dispatch mode beside it names autocast's copies of
weights (a cast whose input is a parameter) and dropout's noise (what `bernoulli_` fills). The
forward pass stops at the head; the gradient of the head's input then runs back through the blocks,
and the most the last recorded block's backward pass holds beyond what it saved, at any moment, is
recorded too. The head and the loss (`GPT.head_loss`) run apart, on one and on two rows. Recorded at one and two sequences per micro-batch; everything saved is
affine in the micro-batch (weight copies and rotary tables do not grow with it).

What is not recorded, and why (each is a rule below, held to the real thing by a test):
- Dropout on CUDA keeps a one-byte mask per element (the fused kernel); the CPU's kernel, which
  fake tensors on the CPU follow, keeps a scaled copy of the input's dtype. With CUDA's rules the
  recorded noise is counted at one byte per element.
- Quantized layers (bitsandbytes, torchao's NF4) need real data: a stand-in keeps what each keeps
  (`_QuantizedStandIn`), and the dequantized weight is `nf4_dequant_bytes` or one 16-bit weight.
- The loss's transient buffers (the chunks of logits, softmax's float32 copy on CUDA, the casts;
  `loss_transients`): on fake tensors they are freed as on a GPU, but what a GPU's kernels allocate
  inside softmax is not visible on the CPU, and a real CPU run keeps them between calls.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Optional

from toolkit.memory.options import Mode, Options
from toolkit.models import LOSS_CHUNK_BYTES


@dataclass
class Activations:
    """Activation bytes of one micro-batch on one device."""

    blocks: list[int]  # saved by each block
    block_inputs: list[int]  # each block's input, what a checkpointed block keeps
    head: int  # saved outside the blocks: token ids, rotary tables, final norm, the loss's gradients
    # (fused) or head input, log-softmax and labels (LoRA head)
    loss_saved: int  # the part of `head` the loss saved: gone after the loss's backward pass
    loss_forward: int  # the loss's transients at their largest in the forward pass (fused: the chunk
    # buffers, the float32 copy softmax makes of 16-bit logits on CUDA, the casts; LoRA head: the logits)
    loss_backward: int  # and in its backward pass: the outgoing gradients (LoRA head: the two float32
    # (tokens x vocab) gradients)
    loss_kept: int  # the fused loss's chunk buffers that stay allocated between calls (real CPU runs)
    hidden_grad: int  # the gradient the loss's backward pass hands on (tokens x n_embd)
    backward_in_flight: int  # the most a block's backward pass holds beyond what it saved (recorded)
    weight_copies: int  # autocast's bf16 copies of float32 weights, all of them
    block_weight_copies: list[int]  # those of each block (what a checkpointed block re-creates)
    dequant_scratch: int  # a quantized block weight dequantized (bitsandbytes, torchao NF4): the largest, one at a time
    head_input: int = 0  # the final norm's output, alive from the final norm through the loss
    # expert parallelism: one MoE layer's all-to-all send and receive buffers of its routed rows,
    # beside what it saves, while it computes (`toolkit.memory.estimator.micro_batch_activations`)
    all_to_all: int = 0
    # `backward_in_flight` with the block's weights' gradients as they are made (FSDP takes them
    # when the block's backward pass ends; one device and DDP hold them all step)
    backward_grads_in_flight: int = 0
    # the most a block's forward pass holds, its output included: what it has saved so far and
    # what it computes with (a mixture of experts combines its routed rows in transients as large
    # as what it saves), autocast's weight copies apart (recorded)
    forward_in_flight: int = 0

    @property
    def stored(self) -> int:
        return sum(self.blocks)

    @property
    def checkpointed(self) -> int:
        # every block's input, plus one block's activations while it is recomputed
        return sum(self.block_inputs) + max(self.blocks)

    @property
    def logits(self) -> int:
        return self.head + max(self.loss_forward, self.loss_kept + self.loss_backward)

    def copies_in_backward(self, checkpointed: bool) -> int:
        """Weight copies alive in the backward pass. Without checkpointing the graph keeps every one;
        with it the forward's copies go with autocast's cache at the end of the forward pass, and
        each block's recomputation makes its own again."""
        if not checkpointed:
            return self.weight_copies
        blocks = sum(self.block_weight_copies)
        return self.weight_copies - blocks + max(self.block_weight_copies, default=0)


# --------------------------------------------------------------------------------------------
# The recording
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Head:
    """What the loss sees (for its transients, `loss_transients`)."""

    fused: bool  # the toolkit's head and its fused loss (else peft's LoRA head and the plain loss)
    per_token: bool  # each label's log-probability (`linear_label_log_probs`), not the summed loss
    hidden_bytes: int  # bytes per element of the head's input
    hidden_grad: bool
    compute_bytes: int  # the products' dtype: autocast's, else the weight's
    weight_bytes: int
    weight_grad: bool
    bias_bytes: int  # 0: no bias
    bias_grad: bool
    logits_bytes: int  # a LoRA head's output
    logits_grad: bool  # and whether it needs a gradient
    hidden_saved: bool  # the head's input is among what the head saves
    softcap: bool = False  # the fused loss caps its logits (Config.final_logit_softcap): one more chunk buffer


@dataclass(frozen=True)
class Recording:
    """What one forward pass of `micro_batch` sequences saved, block by block (the blocks of `layer_slots`)."""

    blocks: tuple[int, ...]  # of the blocks recorded (`layer_slots`)
    block_inputs: tuple[int, ...]
    block_copies: tuple[int, ...]
    outside: int  # saved outside the blocks, before the head
    outside_copies: int  # weight copies outside the blocks (the head's included)
    head_copies: int  # the head's
    loss_fixed: int  # what the head and loss save: loss_fixed + loss_per_row x rows
    loss_per_row: int
    hidden: int  # the final norm's output (bytes)
    head: _Head
    in_flight: int  # the most the last recorded block's backward pass holds beyond what it saved
    in_flight_grads: int = 0  # and with the block's weights' gradients as they are made
    forward_peak: int = 0  # the most the last recorded block's forward pass holds: what it saved so far and its transients
    # a mixture of experts: (all but the experts' weight gradients, those gradients) alive after each
    # event of that backward pass (`_Recorder.in_flight_with_experts`)
    in_flight_expert_trace: tuple[tuple[int, int], ...] = ()

    def grads_in_flight(self, expert_parallel: int = 1) -> int:
        """`in_flight_grads` on a rank that makes the weight gradients of 1 / `expert_parallel` of
        the experts (its own, under expert parallelism)."""
        if expert_parallel == 1 or not self.in_flight_expert_trace:
            return self.in_flight_grads
        return max(rest + experts // expert_parallel for rest, experts in self.in_flight_expert_trace)


_RECORDINGS: dict = {}


def record(opts: "Options", gathered: bool, micro_batch: int) -> Recording:
    """One forward and backward pass of the model's recorded blocks (`layer_slots`) on fake tensors (cached).

    `gathered`: the weights as FSDP gathers them (in the compute dtype under "*-mixed"), else as stored."""
    mode = opts.mode()
    key = (repr(opts.config), opts.precision, opts.lora_modules, opts.lora_r, opts.lora_dropout > 0, opts.quantize,
           opts.max_seq_length, mode.cuda, gathered and opts.autocast, opts.pairs, micro_batch)  # fmt: skip
    found = _RECORDINGS.get(key)
    if found is None:
        if len(_RECORDINGS) > 64:
            _RECORDINGS.clear()
        head = _RECORDINGS.get(key[:-1])  # the head's part does not depend on the micro-batch
        found = _RECORDINGS[key] = _record(opts, mode, gathered and opts.autocast, micro_batch, head)
        _RECORDINGS[key[:-1]] = found
    return found


def _record(opts: "Options", mode: Mode, gathered: bool, micro_batch: int, known: Optional[Recording]) -> Recording:
    """`record`; the head's part is taken from `known` when given."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from toolkit.memory.parameters import _units, meta_model
    from toolkit.models.gpt import Block, OutputHead
    from toolkit.parallel.precision import precision_dtypes

    # A fresh model each time (the dtypes and the quantized stand-ins below change it), with the first
    # block and one block of each kind after it (`layer_slots`).
    _, chosen = layer_slots(opts.config)
    model = meta_model(opts.config, opts.lora_modules, opts.lora_r, opts.lora_dropout, layers=chosen)
    trainable, compute = precision_dtypes(opts.precision.replace("16-", "bf16-", 1) if opts.precision.startswith("16-")
                                          else opts.precision)  # same sizes: the CPU's autocast is bfloat16's  # fmt: skip
    if opts.quantize:
        _stand_in_quantized(model, Block, opts.quantize)
    replaced: dict[int, Any] = {}  # old parameter -> new one (a tied embedding and head share it)
    with torch.no_grad():
        for module in model.modules():
            for leaf, p in list(module.named_parameters(recurse=False)):
                if id(p) not in replaced:
                    stored = trainable if p.requires_grad else compute
                    seen = compute if gathered else stored
                    replaced[id(p)] = p if p.dtype == seen else torch.nn.Parameter(p.to(seen), p.requires_grad)
                setattr(module, leaf, replaced[id(p)])
    blocks, edges = _units(model, Block)
    if gathered and edges is not None:
        # FSDP casts the input edge's output back to its stored dtype (its output policy)
        for module in edges[0]:
            dtype = trainable if any(p.requires_grad for p in module.parameters()) else compute
            if dtype != compute:
                module.register_forward_hook(lambda _m, _a, out, dtype=dtype: out.to(dtype))
    head_module = edges[1][-1] if edges is not None else model.lm_head
    model.train()
    autocast = torch.autocast("cpu", dtype=compute) if mode.autocast else _Nothing()
    with FakeTensorMode(allow_non_fake_inputs=True), on_fake_tensors(mode.real_cpu):
        model.to_empty(device="cpu")
        recorder = _Recorder(model, blocks, head_module, mode.cuda)
        ids = torch.zeros(micro_batch, opts.max_seq_length, dtype=torch.long)
        # Up to the head: the model's forward pass stops where the head is called (`_AtTheHead`);
        # then the gradient of the head's input runs back through the blocks.
        with recorder:
            try:
                with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t), autocast:
                    model(ids, labels=ids)
                raise RuntimeError("the model's forward pass did not call its head")
            except _AtTheHead as stop:
                h = stop.hidden
            recorder.forward_done()
            if h.requires_grad:
                h.backward(torch.ones_like(h))
        in_flight, in_flight_grads, expert_trace = recorder.in_flight_with_experts()
        before_head = (recorder.outside, recorder.outside_copies)
        if known is not None:
            return replace(known, blocks=tuple(recorder.blocks), block_inputs=tuple(recorder.inputs),
                           block_copies=tuple(recorder.copies), outside=before_head[0],
                           outside_copies=before_head[1] + known.head_copies, hidden=h.numel() * h.element_size(),
                           in_flight=in_flight, in_flight_grads=in_flight_grads, in_flight_expert_trace=expert_trace,
                           forward_peak=recorder.forward_peak)  # fmt: skip
        # The head and the loss (`GPT.head_loss`), on one and on two rows: what they keep is affine
        # in the rows (a chunked loss over thousands of rows costs seconds on fake tensors).
        loss_saved = []
        for rows in (1, 2):
            recorder.outside = recorder.outside_copies = 0
            recorder.seen, recorder.keep = set(), []  # freed storages' keys may come back
            x = torch.zeros(1, rows, h.shape[-1], dtype=h.dtype).requires_grad_(h.requires_grad)
            with recorder, torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t), autocast:
                model.head_loss(x, torch.zeros(1, rows, dtype=torch.long), per_token=opts.pairs)
            loss_saved.append(recorder.outside)
            loss_copies, hidden_saved = recorder.outside_copies, recorder.key(x) in recorder.seen
    weight, bias = recorder.head_weights
    head = _Head(
        fused=isinstance(head_module, OutputHead), per_token=opts.pairs, hidden_bytes=h.element_size(), hidden_grad=h.requires_grad,
        compute_bytes=compute.itemsize if mode.autocast else weight.element_size(),
        weight_bytes=weight.element_size(), weight_grad=weight.requires_grad,
        bias_bytes=0 if bias is None else bias.element_size(), bias_grad=bias is not None and bias.requires_grad,
        logits_bytes=recorder.logits_bytes, logits_grad=recorder.logits_grad, hidden_saved=hidden_saved,
        softcap=opts.config.final_logit_softcap is not None,
    )  # fmt: skip
    per_row = loss_saved[1] - loss_saved[0]
    return Recording(tuple(recorder.blocks), tuple(recorder.inputs), tuple(recorder.copies), before_head[0],
                     before_head[1] + loss_copies, loss_copies, loss_saved[0] - per_row, per_row,
                     h.numel() * h.element_size(), head, in_flight, in_flight_grads, recorder.forward_peak, expert_trace)  # fmt: skip


@contextmanager
def on_fake_tensors(real_cpu: bool = False):
    """What the layers do differently for the recording and the simulation, whose fake tensors have
    no values and stand for a step on a GPU, or on real CPU tensors (`real_cpu`, `Mode.real_cpu`):
    the fused loss computes every row (no values to find ignored rows by) and allocates its chunk
    buffers at each call (kept as its scratch buffers, fake tensors would outlive the recording);
    the experts' runs are padded on a real CPU only (`toolkit.models.moe.RUN_ROWS`); expert
    parallelism's all-to-alls move the rows of balanced routing (`balanced_exchange`)."""
    from contextlib import nullcontext

    from toolkit.models.loss import loss_settings
    from toolkit.models.moe import expert_runs_as_on_a_gpu
    from toolkit.parallel.expert import balanced_exchange

    runs = nullcontext() if real_cpu else expert_runs_as_on_a_gpu()
    with loss_settings(reuse_scratch=False, skip_ignored=False), runs, balanced_exchange():
        yield


def layer_slots(config) -> tuple[list[int], tuple[int, ...]]:
    """(for each layer, the recorded block that stands for it; the layers recorded): the first layer,
    whose input may need no gradient (a frozen embedding), and the first layer after it of each kind
    (`Config.layer`: attention span, rotation). From the second layer on, what a block saves depends
    only on its kind: its input's dtype and need of a gradient are the same for every block."""
    chosen, slot_of_kind = [0], {}
    slots = [0]
    for i in range(1, config.n_layer):
        kind = config.layer(i)
        if kind not in slot_of_kind:
            slot_of_kind[kind] = len(chosen)
            chosen.append(i)
        slots.append(slot_of_kind[kind])
    return slots, tuple(chosen)


class _AtTheHead(Exception):
    """Stops the recorded forward pass where the head is called; carries the head's input."""

    def __init__(self, hidden) -> None:
        super().__init__()
        self.hidden = hidden


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _dispatch_mode_class():
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Watch(TorchDispatchMode):
        """Names the storages of autocast's weight copies and of dropout's noise, and, in the backward
        pass of the watched block, every new storage with its size (freed ones through weak references)."""

        def __init__(self, recorder: "_Recorder") -> None:
            super().__init__()
            self.r = recorder

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            import torch

            if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
                out = grouped_mm_output(*args, **(kwargs or {}))
            else:
                out = func(*args, **(kwargs or {}))
            r = self.r
            name = func._overloadpacket.__name__
            # Both kept alive here: a freed storage's key may come back for another tensor.
            if (name == "_to_copy" and isinstance(args[0], torch.Tensor) and r.key(args[0]) in r.params
                    and out.element_size() < args[0].element_size()):  # autocast's 16-bit copy of a weight
                r.weight_copies[r.key(out)] = out
            elif name == "bernoulli_":
                r.noise[r.key(args[0])] = args[0]
            if r.watching or r.forward_watching:
                inputs = {r.key(t) for t in flat_tensors(list(args) + list((kwargs or {}).values()))}
                for t in flat_tensors(out):
                    if r.key(t) not in inputs:  # a new storage (not an in-place op's, not a view's)
                        if r.watching:
                            r.allocated(t)
                        elif r.key(t) not in r.weight_copies:  # those are counted apart
                            r.forward_allocated(t)
            return out

    return _Watch


def grouped_mm_output(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """The output `torch._grouped_mm` would make, for fake tensors of any dtype: torch's meta kernel
    (2.13) is CUDA's and refuses all but bfloat16, while the CPU's kernel multiplies float32 (a 32-true
    mixture of experts). Shapes by the meta kernel's rule; the inputs' dtype, as the CPU's kernel gives.
    What autograd saves is decided above this, by the op's own derivative: the recording stays exact."""
    if mat_a.dim() == 2 and mat_b.dim() == 2:  # groups along the shared dimension (a weight's gradient)
        shape = (offs.shape[0], mat_a.shape[0], mat_b.shape[1])
    elif mat_a.dim() == 2:  # rows in groups, one matrix per group
        shape = (mat_a.shape[0], mat_b.shape[-1])
    elif mat_b.dim() == 2:
        shape = (mat_a.shape[1], mat_b.shape[1])
    else:
        shape = (mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1])
    return mat_a.new_empty(shape, dtype=out_dtype or mat_a.dtype)


def flat_tensors(x) -> list:
    """The tensors in `x`: a tensor, or lists and tuples of them, nested (an op's arguments or outputs)."""
    import torch

    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in flat_tensors(item)]
    return []


class _Recorder:
    """Attributes every saved storage to the block saving it or to the rest of the model."""

    def __init__(self, model, blocks: list, head_module, cuda: bool) -> None:
        self.cuda = cuda
        self.params = {self.key(p) for p in model.parameters()}
        self.model = model
        self.weight_copies: dict[int, Any] = {}  # storage key -> tensor
        self.noise: dict[int, Any] = {}
        self.seen: set[int] = set()
        self.keep: list = []  # the saved tensors, alive (their storages' keys stay unique)
        self.blocks = [0] * len(blocks)
        self.copies = [0] * len(blocks)
        self.inputs = [0] * len(blocks)
        self.saved_by: list[set[int]] = [set() for _ in blocks]
        self.outside = self.outside_copies = 0
        self.current: Optional[int] = None
        self.shared: set[int] = set()
        self.stop_at_head = True
        self.head_weights: tuple = (None, None)
        self.logits_bytes = 0
        self.logits_grad = False
        self.watching = False
        # the watched block's forward pass: bytes of the storages it made that are alive, and their most
        self.forward_watching = False
        self.forward_live = self.forward_peak = 0
        self.events: list[tuple[int, int]] = []  # (number, bytes) in the watched backward pass: + made, - freed
        self.alive: dict[int, int] = {}  # number -> storage key of what was made there and is still alive
        self.handles: list = []
        self._mode = _dispatch_mode_class()(self)
        self.watched = len(blocks) - 1
        for index, block in enumerate(blocks):
            self.handles.append(block.register_forward_pre_hook(self._block_start(index)))
            self.handles.append(block.register_forward_hook(self._block_end(index)))
        self.handles.append(head_module.register_forward_pre_hook(self._head_start))
        self.handles.append(head_module.register_forward_hook(self._head_end))

    @staticmethod
    def key(t) -> int:
        return t.untyped_storage()._cdata

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        return False

    # -------------------------------------------------------------- forward
    def pack(self, t):
        key = self.key(t)
        if key in self.params or key in self.seen:
            return t
        self.seen.add(key)
        self.keep.append(t)
        nbytes = t.untyped_storage().nbytes()
        if self.cuda and key in self.noise:
            nbytes //= t.element_size()  # CUDA's dropout keeps a one-byte mask per element
        copy = key in self.weight_copies
        if self.current is not None and key not in self.shared:
            self.saved_by[self.current].add(key)
            if copy:
                self.copies[self.current] += nbytes
            else:
                self.blocks[self.current] += nbytes
        elif copy:
            self.outside_copies += nbytes
        else:
            self.outside += nbytes
        return t

    def _block_start(self, index: int):
        def hook(_module, args):
            self.current = index
            x, *rest = args
            self.inputs[index] = x.numel() * x.element_size()
            self.shared = {self.key(a) for a in rest if hasattr(a, "untyped_storage")}
            if index == self.watched and x.requires_grad:
                x.register_hook(self._watch_end)
            if index == self.watched:
                self.forward_watching, self.forward_live = True, 0

        return hook

    def _block_end(self, index: int):
        def hook(_module, _args, out):
            self.current = None
            self.shared = set()
            if index == self.watched:
                self.forward_watching = False
            if index == self.watched and out.requires_grad:
                out.register_hook(self._watch_start)

        return hook

    def _head_start(self, module, args):
        self.head_weights = (module.weight, getattr(module, "bias", None))
        if self.stop_at_head:
            raise _AtTheHead(args[0])

    def _head_end(self, _module, _args, out):
        if hasattr(out, "dim") and out.dim() > 0:  # a LoRA head's logits (the fused head returns the loss)
            self.logits_bytes, self.logits_grad = out.element_size(), out.requires_grad

    def forward_done(self) -> None:
        """The blocks recorded: their hooks go (the head's stays, without stopping the head)."""
        for handle in self.handles[:-2]:
            handle.remove()
        self.stop_at_head = False

    # -------------------------------------------------------------- the watched block's backward pass
    def _watch_start(self, grad):
        self.watching = True
        self.allocated(grad)  # the gradient arriving: alive until the block's backward pass consumes it
        for t in self.keep:  # what the block saved: freed as its backward pass goes
            if self.key(t) in self.saved_by[self.watched]:
                self._on_free(t)
        self.keep = [t for t in self.keep if self.key(t) not in self.saved_by[self.watched]]

    def _watch_end(self, grad):
        self.watching = False

    def forward_allocated(self, t) -> None:
        """A storage made in the watched block's forward pass: + its bytes now, - when it is freed
        within it (what it saves stays: `keep` holds it)."""
        nbytes = t.untyped_storage().nbytes()
        self.forward_live += nbytes
        self.forward_peak = max(self.forward_peak, self.forward_live)

        def freed() -> None:
            if self.forward_watching:
                self.forward_live -= nbytes

        weakref.finalize(t.untyped_storage(), freed)

    def allocated(self, t) -> None:
        """A storage made in the watched backward pass: + its bytes now, - when it is freed."""
        number = len(self.events)
        self.events.append((number, t.untyped_storage().nbytes()))
        self.alive[number] = self.key(t)
        self._on_free(t, number)

    def _on_free(self, t, number: Optional[int] = None) -> None:
        """When `t`'s storage is freed during the watched backward pass: - its bytes. Events are
        numbered, not keyed by storage: a freed storage's key may come back for another one."""
        nbytes, events, alive = t.untyped_storage().nbytes(), self.events, self.alive
        number = len(events) + 10**9 if number is None else number  # a saved tensor: only its free counts

        def freed() -> None:
            alive.pop(number, None)
            if self.watching:
                events.append((number, -nbytes))

        weakref.finalize(t.untyped_storage(), freed)

    def in_flight(self) -> tuple[int, int]:
        """The most that was alive beyond the block's saved tensors in its backward pass: what it
        made less what of its saved it freed; without its weights' gradients (the storages still
        alive as .grad: the gradients a single device or DDP keep all step), and with them as they
        are made (FSDP's unsharded gradients, which it takes only when the block's backward pass
        ends: a mixture of experts makes its experts' large gradients first, while most of the
        block's activations are still there)."""
        peak, peak_grads, _ = self.in_flight_with_experts()
        return peak, peak_grads

    def in_flight_with_experts(self) -> tuple[int, int, tuple[tuple[int, int], ...]]:
        """`in_flight`, and after each event of the backward pass with gradients (a, b): the bytes
        alive but the experts' weight gradients, and those gradients (a rank under expert
        parallelism makes those of its own experts only: a + b / N)."""
        from toolkit.models.moe import GroupedExperts

        grads = {self.key(p.grad) for p in self.model.parameters() if p.grad is not None}
        expert_grads = {self.key(p.grad) for m in self.model.modules() if isinstance(m, GroupedExperts)
                        for p in m.parameters(recurse=False) if p.grad is not None}
        kept_as_grads = {number for number, key in self.alive.items() if key in grads}
        of_experts = {number for number, key in self.alive.items() if key in expert_grads}
        live = peak = live_grads = peak_grads = live_experts = 0
        trace = []
        for number, nbytes in self.events:
            live_grads += nbytes
            peak_grads = max(peak_grads, live_grads)
            if number in of_experts:
                live_experts += nbytes
            if expert_grads:
                trace.append((live_grads - live_experts, live_experts))
            if number not in kept_as_grads:
                live += nbytes
                peak = max(peak, live)
        return peak, peak_grads, tuple(trace)


class _QuantizedStandIn:
    """Placeholder; replaced at first use by `_quantized_stand_in_class`."""


def _quantized_stand_in_class():
    import torch
    from torch import nn

    class _KeepsWhatQuantizedKeeps(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, keeps_input, out_dtype):
            ctx.weight, ctx.x_dtype = weight, x.dtype  # the weight: a parameter, not counted
            if keeps_input:
                ctx.save_for_backward(x)
            return (x.to(weight.dtype) @ weight.t()).to(out_dtype)

        @staticmethod
        def backward(ctx, grad):
            return (grad.to(ctx.weight.dtype) @ ctx.weight).to(ctx.x_dtype), None, None, None

    class QuantizedStandIn(nn.Module):
        """A quantized frozen linear layer as autograd sees it (its kernels need real data): bitsandbytes'
        int8 matmul keeps its input, its 4-bit matmul and torchao's NF4 keep nothing but the weight.
        bitsandbytes returns the input's dtype; NF4 computes in 16 bits under autocast."""

        def __init__(self, linear: nn.Linear, quantize: str) -> None:
            super().__init__()
            self.weight = nn.Parameter(linear.weight.detach(), requires_grad=False)
            self.quantize = quantize

        def forward(self, x):
            autocast = torch.is_autocast_enabled("cpu")
            out_dtype = torch.get_autocast_dtype("cpu") if self.quantize == "nf4" and autocast else x.dtype
            return _KeepsWhatQuantizedKeeps.apply(x, self.weight, self.quantize == "bnb.int8" and x.requires_grad,
                                                 out_dtype)  # fmt: skip

    return QuantizedStandIn


def _stand_in_quantized(model, block_cls, quantize: str) -> None:
    """Every frozen linear layer of the blocks replaced by `QuantizedStandIn` (not the adapters)."""
    from torch import nn

    stand_in = _quantized_stand_in_class()
    for block in [m for m in model.modules() if isinstance(m, block_cls)]:
        for name, module in list(block.named_modules()):
            if isinstance(module, nn.Linear) and ".lora_" not in f".{name}" and not module.weight.requires_grad:
                parent_name, _, leaf = name.rpartition(".")
                parent = block.get_submodule(parent_name) if parent_name else block
                setattr(parent, leaf, stand_in(module, quantize))


# --------------------------------------------------------------------------------------------
# From recordings to a micro-batch's activations
# --------------------------------------------------------------------------------------------


def activations(opts: "Options", gathered: bool, micro_batch_size: int, dequant_scratch: int) -> Activations:
    """What a micro-batch's forward pass leaves for the backward pass on one device: recorded at one
    and two sequences, the saved tensors extrapolated (affine in the micro-batch), the loss's
    transients by `loss_transients` at the micro-batch's own size."""
    one = record(opts, gathered, 1)
    two = one if micro_batch_size == 1 else record(opts, gathered, 2)
    B = micro_batch_size

    def f(x1: int, x2: int) -> int:
        return x1 + (x2 - x1) * (B - 1)

    slots, _ = layer_slots(opts.config)

    def per_block(values1: tuple[int, ...], values2: tuple[int, ...]) -> list[int]:
        return [f(values1[slot], values2[slot]) for slot in slots]

    copies = per_block(one.block_copies, one.block_copies)
    tokens = B * opts.max_seq_length
    forward, backward, kept = loss_transients(one.head, opts.mode(), tokens, opts.config.n_embd, opts.config.vocab_size)
    hidden = f(one.hidden, two.hidden)
    loss_saved = one.loss_fixed + one.loss_per_row * tokens
    return Activations(
        blocks=per_block(one.blocks, two.blocks),
        block_inputs=per_block(one.block_inputs, two.block_inputs),
        head=f(one.outside, two.outside) + loss_saved,
        loss_saved=loss_saved,
        loss_forward=forward + (0 if one.head.fused or one.head.hidden_saved else hidden),
        loss_backward=backward,
        loss_kept=kept,
        hidden_grad=hidden if one.head.hidden_grad else 0,
        backward_in_flight=f(one.in_flight, two.in_flight),
        backward_grads_in_flight=f(one.grads_in_flight(opts.expert_parallel), two.grads_in_flight(opts.expert_parallel)),
        forward_in_flight=f(one.forward_peak, two.forward_peak),
        weight_copies=sum(copies) + one.outside_copies,
        block_weight_copies=copies,
        dequant_scratch=dequant_scratch,
        head_input=hidden,
    )


def loss_transients(head: _Head, mode: Mode, n: int, E: int, V: int) -> tuple[int, int, int]:
    """The loss's transient bytes for `n` tokens: (forward, backward, kept between calls).

    A rule, not a recording: a GPU's softmax makes its float32 copy of 16-bit logits inside the
    kernel, and a real CPU run keeps the chunk buffers between calls (`toolkit.models.gpt._scratch`);
    neither shows on fake tensors. Held to real runs (tests/test_estimate.py) and the
    simulation (tests/test_simulate.py).

    The fused loss (`linear_cross_entropy_sum`, a plain head) computes the logits in equal chunks of
    at most LOSS_CHUNK_BYTES of float32 rows, with their float32 softmax, in the forward pass, beside
    the head's input and the casts of input and weight to the products' dtype; its backward pass
    writes the scaled gradients in their own dtypes. A LoRA head (the plain loss) holds the logits and
    their float32 copy in the forward pass and two float32 (tokens x vocab) gradients in the backward.
    """
    if not head.fused:
        forward = n * V * (head.logits_bytes + (4 if head.logits_bytes != 4 else 0))
        return forward, 2 * n * V * 4 if head.logits_grad else 0, 0
    if head.per_token:
        return _per_token_transients(head, mode, n, E, V)
    cdt = head.compute_bytes
    need_h, need_w, need_b = head.hidden_grad, head.weight_grad, head.bias_grad
    if not (need_h or need_w or need_b):
        return 0, 0, 0
    hidden_input = n * E * head.hidden_bytes  # alive through the forward pass, not saved
    chunk = max(1, LOSS_CHUNK_BYTES // (4 * V))
    chunk = -(-n // -(-n // chunk))
    rows = chunk * V
    in_place = cdt == 4 and not mode.cuda  # CPU float32: softmax writes over the logits
    logits = rows * cdt
    probs = 0 if in_place else rows * 4
    if head.softcap:  # the chunk's float32 tanh(logits / cap), for the gradient through the cap
        probs += rows * 4
    # On CUDA softmax(..., dtype=float32) first copies bfloat16 logits to float32 (float16 it widens
    # as it reads); on CPU (fake tensors included) the loss copies them into `probs` itself.
    widened = rows * 4 if cdt != 4 and mode.cuda and not mode.float16 else 0
    softmax_16 = rows * cdt if cdt != 4 else 0  # the softmax cast back to the compute dtype
    casts = (n * E * cdt if head.hidden_bytes != cdt else 0) + (V * E * cdt if head.weight_bytes != cdt else 0)
    # grad.t() @ hc in 16 bits, added to the float32 grad_w a piece of vocabulary rows at a time
    vocab_rows = max(1, LOSS_CHUNK_BYTES // (4 * E))
    product = min(V, vocab_rows) * E * cdt if need_w and cdt != 4 else 0
    if not mode.real_cpu:  # buffers allocated per call (the 16-bit softmax per chunk) and freed after it
        kept = 0
        forward = hidden_input + logits + probs + casts + max(widened, softmax_16 + product)
    else:  # one buffer per kind, kept between calls (the 16-bit softmax's buffer exists already)
        kept = logits + probs + softmax_16
        forward = hidden_input + kept + casts + max(widened, product)

    # Backward: the hidden's gradient scaled in the compute dtype, then cast to the hidden's dtype;
    # then the weight's and the bias's, scaled in float32 and written into their own dtypes
    # (`gpt._scaled`; a real CPU run casts through one chunk of float32 rows), or, for float32
    # ones, scaled in place in the kept gradients (nothing new).
    def scaled(numel: int, row: int, b: int) -> int:
        if b == 4:
            return 0
        through = min(numel // row, max(1, LOSS_CHUNK_BYTES // (4 * row))) * row * 4 if mode.real_cpu else 0
        return numel * b + through

    hidden = n * E * head.hidden_bytes if need_h else 0
    hidden_product = n * E * cdt if need_h and head.hidden_bytes != cdt else 0  # freed once cast
    weight = scaled(V * E, E, head.weight_bytes) if need_w else 0
    bias_grad = scaled(V, 1, head.bias_bytes) if need_b else 0
    return forward, hidden + max(hidden_product, weight + bias_grad), kept


def _per_token_transients(head: _Head, mode: Mode, n: int, E: int, V: int) -> tuple[int, int, int]:
    """`loss_transients` of the fused per-token head (`linear_label_log_probs`, preference objectives).

    It saves its input and labels (recorded) and nothing of the head's size. The forward pass holds
    the chunk buffers (logits, their float32 softmax), the casts of input and weight to the
    products' dtype, and the float32 log-probabilities (a flat copy and the output). The backward
    pass computes each chunk's softmax again in the same buffers, its gradient cast to the products'
    dtype, the hidden's gradient in that dtype and the weight's in float32 (added up a piece of
    vocabulary rows at a time in 16 bits); while the buffers are still there it casts both to
    their parameters' dtypes. A real CPU run keeps the three chunk buffers between calls."""
    cdt = head.compute_bytes
    chunk = max(1, LOSS_CHUNK_BYTES // (4 * V))
    chunk = -(-n // -(-n // chunk))
    rows = chunk * V
    in_place = cdt == 4 and not mode.cuda
    logits, probs = rows * cdt, 0 if in_place else rows * 4
    widened = rows * 4 if cdt != 4 and mode.cuda and not mode.float16 else 0
    casts = (n * E * cdt if head.hidden_bytes != cdt else 0) + (V * E * cdt if head.weight_bytes != cdt else 0)
    need_h, need_w = head.hidden_grad, head.weight_grad
    grads = need_h or need_w or head.bias_grad
    grad_in_dtype = rows * cdt if cdt != 4 and grads else 0  # a chunk's gradient in the products' dtype
    kept = logits + probs + grad_in_dtype if mode.real_cpu else 0
    buffers = 0 if mode.real_cpu else logits + probs
    forward = casts + buffers + widened + 2 * n * 4
    if not grads:
        return forward, 0, kept
    grad_in_dtype = 0 if mode.real_cpu else grad_in_dtype
    product = min(V, max(1, LOSS_CHUNK_BYTES // (4 * E))) * E * cdt if need_w and cdt != 4 else 0
    grad_h = n * E * cdt if need_h else 0
    grad_w = V * E * 4 if need_w else 0
    cast_h = n * E * head.hidden_bytes if need_h and head.hidden_bytes != cdt else 0
    cast_w = V * E * head.weight_bytes if need_w and head.weight_bytes != 4 else 0
    during = casts + buffers + max(widened, grad_in_dtype + product) + grad_h + grad_w
    after = casts + buffers + grad_in_dtype + grad_h + grad_w + cast_h + cast_w
    return forward, max(during, after), kept
