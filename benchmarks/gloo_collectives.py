"""gloo's own all-gather and reduce-scatter against the in-place ones FSDP2 uses on CPU
(`toolkit.parallel.gloo_collectives`): time per call and growth of each process's peak memory.

    python benchmarks/gloo_collectives.py                    # 2 and 4 processes, 147 MiB buffer
    python benchmarks/gloo_collectives.py --processes 4 --mib 27

The default buffer is pythia-160m's embedding in float32 (50,304 x 768), FSDP2's largest unit in
`benchmarks/whole_run_peak.py`. Each way runs once to warm up, then three times; OMP_NUM_THREADS=1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from toolkit.parallel.gloo_collectives import InPlaceAllGather, InPlaceReduceScatter  # noqa: E402

MiB = 2**20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _run(rank: int, world: int, numel: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group, shard = dist.group.WORLD, numel // world
    ways = {
        # FSDP2 gives both ways the shard as a view of its slot of the output
        "all-gather, gloo": lambda buf, out: dist.all_gather_single(buf, buf[rank * shard:(rank + 1) * shard]),
        "all-gather, in place": lambda buf, out: InPlaceAllGather()(buf, buf[rank * shard:(rank + 1) * shard], group),
        "reduce-scatter, gloo": lambda buf, out: dist.reduce_scatter_single(out, buf, op=dist.ReduceOp.AVG),
        "reduce-scatter, in place": lambda buf, out: InPlaceReduceScatter()(out, buf, group, dist.ReduceOp.AVG),
    }
    for name, call in ways.items():
        call(torch.ones(numel), torch.empty(shard))
        seconds, growth = [], []
        for _ in range(3):
            buf, out = torch.ones(numel), torch.zeros(shard)  # both written: resident before the call
            dist.barrier()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS
            before, start = _status("VmRSS"), time.perf_counter()
            call(buf, out)
            seconds.append(time.perf_counter() - start)
            growth.append(_status("VmHWM") - before)
        if rank == 0:
            print(f"| {world} | {name} | {min(seconds) * 1000:.0f} | {max(0, max(growth)) / MiB:.0f} |", flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--mib", type=float, default=50304 * 768 * 4 / MiB, help="buffer size (whole, all ranks' slots)")
    args = p.parse_args()
    numel = int(args.mib * MiB / 4) // 4 * 4  # float32, divisible by 1, 2 and 4 processes
    print(f"buffer {numel * 4 / MiB:.0f} MiB float32, gloo on 127.0.0.1, OMP_NUM_THREADS=1")
    print("| processes | collective | ms per call (best of 3) | peak growth per process (MiB) |")
    print("| ---: | --- | ---: | ---: |")
    for world in args.processes:
        mp.spawn(_run, args=(world, numel, 29600 + world), nprocs=world)


if __name__ == "__main__":
    main()
