"""LoRA on the experts: peft's updated weight (W + dW) against the toolkit's factored product.

    OMP_NUM_THREADS=1 python benchmarks/expert_lora.py                 # bf16 and float32, 5 rounds
    OMP_NUM_THREADS=2 python benchmarks/expert_lora.py --threads 2 --dtypes bf16

`--lora.targets experts` adapts each expert's weights with a rank-r update. peft's LoRA on a
parameter (`ParamWrapper`) forms W + scale * B @ A, as large as all the layer's experts, in every
forward pass, keeps it for the backward pass, and computes its gradient to reach A and B. The
toolkit's `FactoredExpertLoRA` (the same peft layer otherwise) applies the factors to the rows
instead: two more grouped products through an (M, r) intermediate.

The model is the one of `moe_experts.py` (Qwen3-MoE's layout, n_embd 512, 4 layers, 32 experts of
width 384, top-4, 1,024 tokens, micro-batch 1) in the dtype asked ("bf16": every weight bf16, as
bf16-true), with rank-8 adapters on the experts and on the query and value projections. A step is
one forward pass with the loss and its backward pass. Per variant: the median step time over the
rounds (paired and alternating as in `moe_experts.py`), and what the forward pass keeps for the
backward pass: the bytes of the tensors autograd saves, each storage counted once, parameters
left out. The two variants' losses and adapter gradients are checked against each other first.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from moe_experts import batch_streams, model_and_batch, paired_rounds, start  # noqa: E402  (the same model, command line, timing)

VARIANTS = ("peft", "factored")
SETTINGS = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                target_parameters=["experts.gate_up_proj", "experts.down_proj"], bias="none")


def adapted_models(args, dtype):
    """The same model and adapters twice: with peft's ParamWrapper, and with FactoredExpertLoRA."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    from toolkit.models.expert_adapters import lora_config

    base, ids = model_and_batch(args, dtype)
    models = {"peft": get_peft_model(copy.deepcopy(base), LoraConfig(**SETTINGS)),
              "factored": get_peft_model(base, lora_config(**SETTINGS))}
    with torch.no_grad():
        generator = torch.Generator().manual_seed(2)
        adapters = {n: p for n, p in models["peft"].named_parameters() if p.requires_grad}
        for name, p in adapters.items():
            p.normal_(0, 0.02, generator=generator)
        for name, p in models["factored"].named_parameters():
            if p.requires_grad:
                p.copy_(adapters[name])
    return models, ids


def step(model, batches) -> float:
    ids = next(batches)
    start = time.perf_counter()
    model(ids, labels=ids).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def saved_bytes(model, ids) -> int:
    """Bytes the forward pass keeps for the backward pass: saved tensors' storages, each once, not parameters."""
    import torch

    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, labels=ids)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def agreement(models, ids) -> tuple[float, float]:
    """Relative difference of the losses, and the largest of the adapter gradients'."""
    import torch

    losses, grads = {}, {}
    for name, model in models.items():
        loss = model(ids, labels=ids)
        loss.backward()
        losses[name] = loss.item()
        grads[name] = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.requires_grad])
        model.zero_grad(set_to_none=True)
    loss_diff = abs(losses["peft"] - losses["factored"]) / abs(losses["peft"])
    grad_diff = float((grads["peft"] - grads["factored"]).abs().max() / grads["peft"].abs().max())
    return loss_diff, grad_diff


def main() -> None:
    args = start(__doc__, ["bf16", "float32"], ", rank-8 adapters on the experts, query and value")
    import torch

    print("| dtype | peft (W + dW) | factored | peft / factored (median of rounds) | saved for backward: peft | "
          "factored | loss, gradients: max rel. difference |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in args.dtypes:
        dtype = {"float32": torch.float32, "bf16": torch.bfloat16}[name]
        models, ids = adapted_models(args, dtype)
        loss_diff, grad_diff = agreement(models, ids)
        saved = {variant: saved_bytes(models[variant], ids) for variant in VARIANTS}
        streams = batch_streams(args, ids, VARIANTS)
        times, rounds = paired_rounds({v: partial(step, models[v], streams[v]) for v in VARIANTS}, args.rounds, args.repeats)
        ratios = [medians["peft"] / medians["factored"] for medians in rounds]
        p, f = times["peft"], times["factored"]
        print(f"| {name} | {1000 * statistics.median(p):.0f} ms ({1000 * min(p):.0f} - {1000 * max(p):.0f}) | "
              f"{1000 * statistics.median(f):.0f} ms ({1000 * min(f):.0f} - {1000 * max(f):.0f}) | "
              f"{statistics.median(ratios):.2f}x ({min(ratios):.2f} - {max(ratios):.2f}) | "
              f"{saved['peft'] / 2**20:.0f} MiB | {saved['factored'] / 2**20:.0f} MiB | {loss_diff:.1e}, {grad_diff:.1e} |",
              flush=True)
    print("load average %.2f %.2f %.2f" % os.getloadavg())


if __name__ == "__main__":
    main()
