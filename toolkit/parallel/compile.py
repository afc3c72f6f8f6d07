"""Regional compilation: each transformer block compiled on its own, in place, after set-up.

    model = setup_model(fabric, model, read_rows)   # shards (FSDP2), wraps for checkpointing
    compile_blocks(model, Block, dynamic=...)       # then each unit gets torch.compile

Each Block (inside its activation-checkpointing wrapper when it has one) is compiled with
`nn.Module.compile`, which compiles the module's call in place: the module keeps its class, its FSDP2
hooks and its state-dict keys, and FSDP2's all-gather/reshard hooks (on the block, or on its wrapper,
as `fully_shard` sees it) run eagerly around the compiled forward (dynamo does not trace them).
The block, not its checkpointing wrapper: packed rows attend one sample at a time outside the graph
(a graph break, see `toolkit.models.attention`), and dynamo runs a checkpointed region with a graph
break in it wholly eagerly; inside an eager checkpoint the compiled block is recomputed as it is. Every block has the same code and
the same shapes, and dynamo treats parameters as inputs, so all blocks share one compiled graph: a
model compiles once whatever its depth. The embedding, final norm and the fused loss stay eager
(the loss computes its gradients in the forward pass; see `GPT.head_loss`).

This is the order torchtitan uses (activation checkpointing, compile per block, FSDP per block),
except that torchtitan compiles the checkpointing wrapper; compiling after `fully_shard` instead of
before gives the same modules here, because `.compile()` changes only how the module is called.

Shapes: pretraining batches all have one shape (static, the fastest code). Fine-tuning batches are
padded to their longest sample, so they are compiled with `dynamic=True` (the sequence and batch
dimensions are symbolic): one graph for every length instead of one per length.

Failures: a compiler that is missing or broken (no C++ compiler for inductor on CPU, no Triton on
GPU) is found before training by compiling a small probe, forward and backward, on the training
device. It then prints one line and trains eagerly.

Importing this module is cheap: torch is imported inside the functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from torch import nn

# The `--train.compile null` (auto) rule, from measurements (tutorials/compile.md, "Does it win?"):
# - runs of fewer than AUTO_MIN_STEPS optimizer steps stay eager: compiling costs a fixed time (15-20 s
#   for pythia-14m's block on our CPUs) that a test or a smoke run of a few steps never earns back;
# - on a CPU nothing is compiled: with pythia-14m (micro-batch 4, one thread) compiled blocks were no
#   faster in float32 pretraining (1.26-1.28 s/step both), between 10% slower and 5% faster under
#   "bf16-mixed" (the CPU default) depending on the load, and no faster for LoRA's variable-length
#   batches (0.56 / 0.55 s/step bf16, 0.71 / 0.70 float32);
# - on a GPU long runs are compiled (torchtitan's finding, not measured here: we have no GPU).
AUTO_MIN_STEPS = 100


def should_compile(
    choice: Optional[bool], total_steps: Optional[int], device_type: str, precision: str, variable_lengths: bool
) -> tuple[bool, str]:
    """(compile?, why) for `--train.compile`: true or false as given; None (auto) by the rule above."""
    if choice is not None:
        return bool(choice), f"--train.compile {str(bool(choice)).lower()}"
    if total_steps is not None and total_steps < AUTO_MIN_STEPS:
        return False, f"auto: a run of {total_steps} steps does not repay compiling (fewer than {AUTO_MIN_STEPS})"
    if device_type == "cpu":
        return False, "auto: on a CPU compiled blocks were measured no faster"
    return True, "auto"


def compile_blocks(model: nn.Module, block_cls: type, device, dynamic: bool, print_fn: Callable[[str], None]) -> int:
    """Compile every transformer block of `model` in place; returns how many were compiled.

    0 when the compiler does not work on `device` (one line is printed; the model stays eager).
    """
    problem = compiler_problem(device)
    if problem is not None:
        print_fn(f"torch.compile is unavailable here ({problem}); training eagerly.")
        return 0
    import warnings

    # Under expert parallelism a block's experts are an FSDP unit of their own inside it: dynamo
    # cannot trace DTensor's C helper in their hooks and runs them eagerly (an expected graph
    # break), which it would report on every rank.
    warnings.filterwarnings("ignore", message=r"Dynamo does not know how to trace the builtin `torch\._C\._DTensor_compute")
    blocks = [m for m in model.modules() if isinstance(m, block_cls)]
    for block in blocks:
        block.compile(dynamic=True if dynamic else None)
    shapes = "dynamic shapes" if dynamic else "static shapes"
    print_fn(f"torch.compile: {len(blocks)} transformer blocks compiled separately ({shapes}); "
             "the first step compiles, its time is reported once and left out of the step times.")
    return len(blocks)


def compiler_problem(device) -> Optional[str]:
    """None when torch.compile's default backend compiles a forward and backward pass on `device`;
    otherwise the first line of the error.

    The probe's inputs are drawn from no random generator: it runs after a resumed run has restored
    its RNG state, and a draw here would shift every later dropout mask (LoRA dropout) off the
    uninterrupted run's.
    """
    import torch

    def probe(x, w):
        return torch.nn.functional.gelu(x @ w).sum()

    try:
        x = torch.linspace(-1.0, 1.0, 32, device=device).reshape(4, 8)
        w = torch.linspace(1.0, -1.0, 64, device=device).reshape(8, 8).requires_grad_()
        torch.compile(probe, fullgraph=True)(x, w).backward()
    except Exception as error:  # any failure of the toolchain means: train eagerly
        text = str(error).strip().splitlines()
        return f"{type(error).__name__}: {text[0][:200] if text else ''}"
    finally:
        import torch._dynamo

        torch._dynamo.reset()  # the probe's graph is not the model's: keep compile counters clean
    return None


# Top-level phases of torch's compile-time records: a frame's compilation (tracing and its
# forward code) and the backward code, which AOTAutograd compiles at the first backward pass.
_COMPILE_PHASES = ("_compile.compile_inner", "backward._backward_impl")


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (0.0 when nothing was compiled)."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0.0
    metrics = utils.compilation_time_metrics
    return float(sum(sum(metrics.get(phase, ())) for phase in _COMPILE_PHASES))
