"""Can FSDP2 (`fully_shard`) shard bitsandbytes layers and still compute what one process computes?

The evidence behind `toolkit.parallel.plan.plan_quantized_base` (why QLoRA on several devices
replicates the quantized base instead of sharding it). Two linear layers are quantized as
`toolkit.finetune.lora.quantize_linears` quantizes them, run forward and backward under bf16
autocast on one process, then sharded with `fully_shard` over two gloo processes and run again on
the same input. For each way of building the layers it prints whether the sharded run fails, and
otherwise the largest difference of its outputs and input gradients from the single process.

    python benchmarks/fsdp_bitsandbytes.py

Measured with torch 2.13.0 (CPU), bitsandbytes 0.50.2:

    nf4, as the toolkit builds it            fails: ValueError: quant_state is required
    nf4, bf16 quant_storage, module=layer    max |output diff| 0.0, max |input-grad diff| 0.0
    int8                                     fails: AttributeError: 'Parameter' object has no attribute 'CB'
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WAYS = {
    "nf4, as the toolkit builds it": dict(mode="nf4", recoverable=False),
    "nf4, bf16 quant_storage, module=layer": dict(mode="nf4", recoverable=True),
    "int8": dict(mode="int8", recoverable=False),
}


def build(mode: str, recoverable: bool) -> nn.Module:
    import bitsandbytes as bnb

    torch.manual_seed(0)
    layers = []
    for linear in (nn.Linear(64, 128), nn.Linear(128, 64)):
        if mode == "int8":
            layer = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, has_fp16_weights=False, device="cpu")
            layer.weight = bnb.nn.Int8Params(linear.weight.data.contiguous(), requires_grad=False, has_fp16_weights=False)
        else:
            storage = torch.bfloat16 if recoverable else torch.uint8
            layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, compute_dtype=torch.bfloat16,
                                      quant_type="nf4", quant_storage=storage, device="cpu")
            # module=layer lets bitsandbytes put the quantization state back on a weight that lost it
            extra = dict(module=layer) if recoverable else {}
            layer.weight = bnb.nn.Params4bit(linear.weight.data.contiguous(), requires_grad=False, quant_type="nf4",
                                             quant_storage=storage, **extra)
            layer.support_avx512bf16_for_cpu = False
        layer.bias = nn.Parameter(linear.bias.data.clone(), requires_grad=False)
        layers.append(layer.to("cpu"))  # .to() quantizes
    return nn.Sequential(layers[0], nn.ReLU(), layers[1])


def forward_backward(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    y.float().sum().backward()
    return y.detach().float(), x.grad


def sharded(rank: int, port: int, results: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    lines = []
    for name, way in WAYS.items():
        reference = forward_backward(build(**way))
        model = build(**way)
        try:
            fully_shard(model[0], mesh=mesh)
            fully_shard(model[2], mesh=mesh)
            fully_shard(model, mesh=mesh)
            y, grad = forward_backward(model)
            lines.append(f"{name:<40} max |output diff| {(y - reference[0]).abs().max().item()}, "
                         f"max |input-grad diff| {(grad - reference[1]).abs().max().item()}")
        except Exception as error:  # the finding is the failure itself
            lines.append(f"{name:<40} fails: {type(error).__name__}: {error}")
    if rank == 0:
        with open(results, "w") as f:
            f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()


def main() -> None:
    import socket

    import bitsandbytes

    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "results.txt")
        mp.spawn(sharded, args=(port, results), nprocs=2)
        print(f"torch {torch.__version__}, bitsandbytes {bitsandbytes.__version__}, 2 gloo processes")
        sys.stdout.write(open(results).read())


if __name__ == "__main__":
    main()
