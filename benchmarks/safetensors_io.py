"""Where `toolkit/safetensors_io.py` reads and writes with the `safetensors` library and where it does not.

    python benchmarks/safetensors_io.py                   # 1.5 GiB checkpoint in /tmp, removed after
    python benchmarks/safetensors_io.py --gib 0.5 --repeat 1

A random float32 checkpoint (tensors of 256 MiB, 65536 x 1024) is written into a temporary folder;
then each way of doing four jobs runs in a fresh process, which reports its wall time and its peak
resident memory above what it held after its imports (VmHWM after resetting it; file pages mapped
by safe_open count, as they do for the tests' memory bounds and for a rank's memory limit). The
page cache is warm (the file was just written, or read by the previous run): the figures compare
the work done in this process, not the disk.

    copy      every tensor into a new file, unchanged: the kernel (`copy_file_range`, what
              `SafetensorsStream.copy` does) / `get_slice` 64 MiB of rows at a time, appended
    convert   every tensor into a new file as bfloat16, 64 MiB of source rows at a time: `get_slice`
              rows then `.to()` (`read_rows`, what `convert_from_hf --dtype` does) / `preadv` into
              a reused buffer, converted into another reused buffer (the converter's former reader)
    rows      rows [N/4, N/2) of every tensor (a rank's shard of 4) into a preallocated tensor:
              `get_slice` 16 MiB at a time (`SafetensorsReader.read_rows_into`) / `preadv` straight
              into the tensor's memory
    write     every tensor, read one at a time, into a new file: `SafetensorsStream` (the toolkit) /
              `save_file` of them all (what the library offers: it takes the whole dict)

Results (2 CPU cores shared with other work, AMD EPYC, Python 3.11, torch 2.13 CPU, safetensors
0.8.0; 1.5 GiB; median of 5 runs each way, the ways alternating; load average 6.6 before, 6.2
after; wall time is noisy under that load, CPU time of the process less so):

    case     way        wall      cpu     peak
    copy     kernel     2.13 s   0.62 s     +0 MiB   <- SafetensorsStream.copy
    copy     get_slice  3.81 s   0.99 s    +70 MiB
    convert  get_slice  3.63 s   1.39 s   +102 MiB   <- convert_from_hf --dtype
    convert  preadv     3.47 s   1.31 s   +100 MiB
    rows     get_slice  0.55 s   0.22 s    +22 MiB   <- checkpoint_row_reader
    rows     preadv     0.56 s   0.24 s     +6 MiB
    write    stream     1.84 s   0.75 s   +260 MiB   <- SafetensorsStream
    write    save_file  1.70 s   0.84 s  +1539 MiB

What they decided: the kernel copy stays (no bytes in the process, less CPU); conversion and row
reads go through `get_slice` (the converter's own reader was no faster: an earlier run at load
4.8 gave 1.07 s CPU for get_slice against 1.27 s for preadv); writing stays our own (`save_file`
holds the whole file: +1539 MiB against one tensor, +260 MiB).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROWS, COLS = 65536, 1024  # one float32 tensor: 256 MiB
CHUNK = 64 << 20


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _pread_into(fd: int, tensor, offset: int) -> None:
    """Fill a contiguous CPU tensor with the file's bytes from `offset` (no copy through Python)."""
    view = memoryview(tensor.numpy()).cast("B")
    done = 0
    while done < len(view):
        done += os.preadv(fd, [view[done:]], offset + done)


def make_checkpoint(path: Path, gib: float) -> None:
    import torch

    from toolkit.safetensors_io import SafetensorsStream

    count = max(1, round(gib * 4))
    specs = {f"w{i}": (torch.float32, (ROWS, COLS)) for i in range(count)}
    stream = SafetensorsStream(path, specs, metadata={"format": "pt"})
    generator = torch.Generator().manual_seed(0)
    for name in stream.order:
        stream.write(name, torch.randn(ROWS, COLS, generator=generator))
    stream.close()


def run_case(case: str, way: str, src: Path, dst: Path) -> dict:
    """One job one way, in this (fresh) process: {"seconds", "peak_mib"}."""
    import torch

    from toolkit.safetensors_io import SafetensorsReader, SafetensorsStream, read_header, read_rows

    infos = read_header(src)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status("VmRSS")
    start, cpu_start = time.perf_counter(), time.process_time()
    if case in ("copy", "convert"):
        out_dtype = torch.float32 if case == "copy" else torch.bfloat16
        stream = SafetensorsStream(dst, {i.name: (out_dtype, i.shape) for i in infos}, order=[i.name for i in infos])
        step = CHUNK // (COLS * 4)
        if way == "kernel":
            for info in infos:
                stream.copy(info.name, info)
        elif way == "get_slice":  # the library: a fresh tensor per slice, out of a fresh mapping
            for info in infos:
                for first in range(0, info.shape[0], step):
                    rows = read_rows(info, first, first + step)
                    stream.append(info.name, rows.to(out_dtype))
                    del rows
        elif way == "preadv":  # the converter's former reader: two reused buffers
            fd = os.open(src, os.O_RDONLY)
            in_buffer = torch.empty(step * COLS * 4, dtype=torch.uint8)
            out_buffer = torch.empty(step * COLS, dtype=out_dtype)
            for info in infos:
                for first in range(0, info.shape[0], step):
                    n = min(step, info.shape[0] - first)
                    _pread_into(fd, in_buffer[: n * COLS * 4], info.offset + first * COLS * 4)
                    out = out_buffer[: n * COLS].view(n, COLS)
                    out.copy_(in_buffer[: n * COLS * 4].view(torch.float32).view(n, COLS))
                    stream.append(info.name, out)
                    del out
            os.close(fd)
        stream.close()
    elif case == "rows":
        reader = SafetensorsReader([src])
        outs = []
        for info in infos:
            first, last = info.shape[0] // 4, info.shape[0] // 2
            out = torch.empty(last - first, COLS)
            if way == "get_slice":
                reader.read_rows_into(info.name, first, out)
            else:
                fd = os.open(src, os.O_RDONLY)
                _pread_into(fd, out, info.offset + first * COLS * 4)
                os.close(fd)
            outs.append(out)
        assert torch.equal(outs[0][:2], reader.read_rows(infos[0].name, ROWS // 4, ROWS // 4 + 2))
        base += sum(o.numel() * 4 for o in outs)  # the shards themselves are the goal, not overhead
    elif case == "write":
        reader = SafetensorsReader([src])
        if way == "stream":
            stream = SafetensorsStream(dst, {i.name: (torch.float32, i.shape) for i in infos}, metadata={"format": "pt"})
            for name in stream.order:
                stream.write(name, reader.read(name))
            stream.close()
        else:
            from safetensors.torch import save_file

            save_file({info.name: reader.read(info.name) for info in infos}, str(dst), metadata={"format": "pt"})
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return {"seconds": seconds, "cpu": cpu, "peak_mib": (_status("VmHWM") - base) / 2**20}


WAYS = {"copy": ("kernel", "get_slice"), "convert": ("get_slice", "preadv"), "rows": ("get_slice", "preadv"),
        "write": ("stream", "save_file")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.5, help="checkpoint size (tensors of 256 MiB)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cases", nargs="*", default=list(WAYS))
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        case, way, src, dst = args.child
        print(json.dumps(run_case(case, way, Path(src), Path(dst))))
        return
    folder = Path(tempfile.mkdtemp(prefix="safetensors_io_bench_", dir="/tmp"))
    try:
        src = folder / "model.safetensors"
        make_checkpoint(src, args.gib)
        print(f"checkpoint: {src.stat().st_size / 2**30:.2f} GiB, load average {os.getloadavg()[0]:.1f}")
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        for case in args.cases:
            results: dict[str, list[dict]] = {way: [] for way in WAYS[case]}
            for repeat in range(args.repeat):
                ways = WAYS[case] if repeat % 2 == 0 else WAYS[case][::-1]
                for way in ways:
                    dst = folder / "out.safetensors"
                    out = subprocess.run([sys.executable, __file__, "--child", case, way, str(src), str(dst)],
                                         env=env, capture_output=True, text=True, check=True)
                    results[way].append(json.loads(out.stdout.strip().splitlines()[-1]))
                    dst.unlink(missing_ok=True)
            for way, runs in results.items():
                seconds = statistics.median(r["seconds"] for r in runs)
                cpu = statistics.median(r["cpu"] for r in runs)
                peak = statistics.median(r["peak_mib"] for r in runs)
                print(f"{case:8s} {way:10s} wall {seconds:6.2f} s  cpu {cpu:6.2f} s  peak +{peak:5.0f} MiB   "
                      f"(median of {len(runs)}; wall {min(r['seconds'] for r in runs):.2f}-{max(r['seconds'] for r in runs):.2f})")
        print(f"load average after: {os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
