"""The in-place gloo collectives against gloo's own, on 4 processes, and their host memory.

    MASTER_ADDR=127.0.0.1 MASTER_PORT=... python tests/scripts/gloo_collectives.py OUT_DIR

Spawns 4 gloo processes. Each checks, on the whole group and on a subgroup of ranks {1, 3} (where
a rank's place in the group is not its global rank), that `InPlaceAllGather` and
`InPlaceReduceScatter` give what `all_gather_single` and `reduce_scatter_single` give (SUM and AVG,
float32 and bfloat16): equal on two ranks and for the all-gather, within the rounding of the
additions' other order on four). Then, on one 64 MiB float32 buffer, how far each way raises the
process's high-water mark over its resident memory before the call. Last, the backward pass of an
FSDP2 unit of one 128 MiB embedding with the in-place collectives: its high-water mark, and its
sharded gradient against the average of every rank's dense one. Rank 0 writes OUT_DIR/result.json.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from toolkit.parallel.gloo_collectives import InPlaceAllGather, InPlaceReduceScatter  # noqa: E402

WORLD = 4
MiB = 2**20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _growth(call) -> int:
    """Bytes by which `call()` raises the high-water mark above the resident set before it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    call()
    return _status("VmHWM") - before


def _equal_to_gloos_own(group: dist.ProcessGroup, ranks: list[int]) -> list[str]:
    failures = []
    n, rank = len(ranks), group.rank()
    generator = torch.Generator().manual_seed(1234)
    for dtype in (torch.float32, torch.bfloat16):
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            full = torch.randn(n * 1000, generator=generator).to(dtype) * (rank + 1)
            expected = torch.empty(1000, dtype=dtype)
            dist.reduce_scatter_single(expected, full.clone(), op=op, group=group)
            got = torch.full((1000,), float("nan"), dtype=dtype)
            InPlaceReduceScatter()(got, full.clone(), group, op)
            # Two addends sum the same in any order: equal. More are added in another order than
            # gloo's: within one rounding of the dtype per addition.
            tolerance = 0 if n == 2 else (n - 1) * torch.finfo(dtype).eps
            try:
                torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance * 4 * n)
            except AssertionError:
                failures.append(f"reduce-scatter {dtype} {op} on ranks {ranks}: max diff {(got - expected).abs().max()}")
        shard = torch.randn(777, generator=generator).to(dtype) + rank
        expected = torch.empty(n * 777, dtype=dtype)
        dist.all_gather_single(expected, shard, group=group)
        output = torch.full((n * 777,), float("nan"), dtype=dtype)
        mine = output[rank * 777 : (rank + 1) * 777]
        mine.copy_(shard)  # FSDP2's copy-in: this rank's shard already sits in its slot
        InPlaceAllGather()(output, mine, group)
        if not torch.equal(output, expected):
            failures.append(f"all-gather {dtype} on ranks {ranks}")
    return failures


def _installed_by_shard_model() -> dict[str, int]:
    """How many FSDP2 units of a tiny GPT sharded as training shards it use which collectives."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from toolkit.models.config import Config
    from toolkit.models.gpt import GPT, Block
    from toolkit.args import DistributedArgs
    from toolkit.parallel.fsdp import shard_model
    from toolkit.parallel.plan import plan_strategy

    plan = plan_strategy(WORLD, 1, "32-true", DistributedArgs(strategy="fsdp", sharding="FULL_SHARD"), accelerator="cpu")
    config = Config(name="tiny", vocab_size=64, block_size=16, n_layer=2, n_embd=32, n_head=4)
    model = shard_model(GPT(config), init_device_mesh("cpu", (WORLD,), mesh_dim_names=("shard",)), plan, Block)
    counts: dict[str, int] = {}
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            for group in unit._get_fsdp_state()._fsdp_param_groups:
                for comm in (group._all_gather_comm, group._reduce_scatter_comm):
                    counts[type(comm).__name__] = counts.get(type(comm).__name__, 0) + 1
    return counts


def _embedding_backward(rank: int) -> dict:
    """A unit of one embedding (VOCAB x WIDTH float32, 128 MiB), sharded over the 4 processes as
    `shard_model` shards the embedding; each rank looks up its own tokens. The backward pass makes
    the dense gradient and FSDP2 copies it into the reduce-scatter buffer (128 MiB); the output
    (this rank's 32 MiB) comes once the gradient is released."""
    from torch.distributed.fsdp import fully_shard

    from toolkit.parallel.gloo_collectives import use_in_place_collectives

    vocab, width, tokens = 32768, 1024, 64
    embedding = torch.nn.Embedding(vocab, width)
    with torch.no_grad():
        embedding.weight.copy_(torch.randn(vocab, width, generator=torch.Generator().manual_seed(0)))
    fully_shard(embedding)
    embedding.set_unshard_in_backward(False)  # as shard_model: the gradient needs the ids only
    installed = use_in_place_collectives(embedding, dist.group.WORLD)
    ids = [torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(10 + r)) for r in range(WORLD)]
    scale = torch.arange(1, width + 1, dtype=torch.float32) / width
    loss = (embedding(ids[rank]) * scale).sum()
    dist.barrier()
    growth = _growth(loss.backward)
    # The reference: every rank's dense gradient (a scaled count of its tokens per row), averaged.
    expected = torch.zeros(vocab, width)
    for r in range(WORLD):
        expected.index_add_(0, ids[r], scale.expand(tokens, width))
    expected /= WORLD
    rows = vocab // WORLD
    grad = embedding.weight.grad.to_local()
    return {"installed": installed, "growth": growth, "gradient_bytes": vocab * width * 4,
            "grad_equal": bool(torch.allclose(grad, expected[rank * rows : (rank + 1) * rows], rtol=0, atol=1e-6))}


def _run(rank: int, out_dir: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    subgroup_ranks = [1, 3]
    subgroups = [dist.new_group([0, 2]), dist.new_group(subgroup_ranks)]
    failures = _equal_to_gloos_own(dist.group.WORLD, list(range(WORLD)))
    if rank in subgroup_ranks:
        failures += _equal_to_gloos_own(subgroups[1], subgroup_ranks)
    elif rank in (0, 2):
        failures += _equal_to_gloos_own(subgroups[0], [0, 2])

    installed = _installed_by_shard_model()

    numel = 64 * MiB // 4
    shard = numel // WORLD
    group = dist.group.WORLD
    growth = {}
    for name, call in [
        ("gloo all-gather", lambda out, inp: dist.all_gather_single(out, inp[rank * shard : (rank + 1) * shard], group=group)),
        ("in-place all-gather", lambda out, inp: InPlaceAllGather()(out, out[rank * shard : (rank + 1) * shard], group)),
        ("gloo reduce-scatter", lambda out, inp: dist.reduce_scatter_single(out[:shard], inp, group=group)),
        ("in-place reduce-scatter", lambda out, inp: InPlaceReduceScatter()(out[:shard], inp, group, dist.ReduceOp.AVG)),
    ]:
        buffer_a, buffer_b = torch.ones(numel), torch.ones(numel)  # written: resident before the call
        dist.barrier()
        growth[name] = _growth(functools.partial(call, buffer_a, buffer_b))
        del buffer_a, buffer_b
    embedding = _embedding_backward(rank)
    results = [None] * WORLD
    dist.all_gather_object(results, {"failures": failures, "growth": growth, "installed": installed,
                                     "embedding": embedding})
    if rank == 0:
        Path(out_dir, "result.json").write_text(json.dumps({"ranks": results, "buffer_bytes": numel * 4}))
    from toolkit.training.failures import release_process_group

    release_process_group()  # destroys the group and frees what holds its threads


if __name__ == "__main__":
    mp.spawn(_run, args=(sys.argv[1],), nprocs=WORLD)
