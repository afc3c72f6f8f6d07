"""Time and memory of checkpoint conversion at Llama-3.2-1B size, against a plain streaming copy.

    python benchmarks/convert_benchmark.py --work_dir /tmp/convert-bench

Builds (once) a random-weight bfloat16 Hugging Face checkpoint with the shapes of Llama-3.2-1B
(1.24 B parameters, tied embeddings, 5 safetensors shards, ~2.3 GiB), then runs each command in a
fresh subprocess and reports wall time and the subprocess's peak resident memory (VmHWM, which
includes the Python/torch imports):

    copy (mmap)         a plain streaming copy: every tensor read with safetensors' `safe_open`
                        (memory-mapped, the default) and appended to one output safetensors file;
                        the reference ("x copy") for the conversions
    copy (pread)        the same with `safe_open(backend="pread")`: one tensor in memory at a time
    cp                  the shard files copied byte for byte (no tensor is looked at)
    convert_from_hf     Hugging Face -> toolkit checkpoint
    convert_to_hf       toolkit checkpoint -> Hugging Face (2 GB shards)
    from_hf --dtype float32
                        convert_from_hf converting every tensor (4.6 GiB written): the path that
                        materialises tensors, ~64 MiB of rows at a time

The inputs stay in the page cache (the machine has enough memory), so every row reads from a warm
cache. Before each run the script calls sync, so no run pays for the previous one's writes; "wall"
stops when the command exits (its output may still be in the page cache) and "+sync" is the time
the following sync took to put that output on disk. Commands run round robin, --repeat times.
Needs about 3 x 2.3 GiB of free disk in --work_dir.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

BUILD = r"""
import json, sys, torch
from pathlib import Path
from safetensors.torch import save_file
from toolkit.convert.hf_config import config_to_hf
from toolkit.models.config import Config
from toolkit.convert import weight_maps
from toolkit.convert.hf_to_toolkit import expected_shapes

out = Path(sys.argv[1])
out.mkdir(parents=True)
config = Config.from_name("llama-3.2-1b")
hf = config_to_hf(config, dtype="bfloat16")
hf.update(bos_token_id=128000, eos_token_id=128001)
(out / "config.json").write_text(json.dumps(hf, indent=2))
(out / "generation_config.json").write_text(json.dumps({"bos_token_id": 128000, "eos_token_id": 128001}))
shapes = {weight_maps.toolkit_to_hf_name("llama", n)[0]: s for n, s in expected_shapes(config).items()}
names = list(shapes)
sizes = {n: 2 * torch.Size(shapes[n]).numel() for n in names}
target = sum(sizes.values()) / 5
groups, current, size = [], [], 0
for n in names:
    if current and size + sizes[n] > target and len(groups) < 4:
        groups.append(current); current, size = [], 0
    current.append(n); size += sizes[n]
groups.append(current)
gen = torch.Generator().manual_seed(0)
weight_map = {}
for i, group in enumerate(groups, start=1):
    file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
    tensors = {}
    for n in group:
        t = torch.empty(shapes[n], dtype=torch.float32)
        t.normal_(0.0, 0.02, generator=gen) if len(shapes[n]) > 1 else t.fill_(1.0)
        tensors[n] = t.to(torch.bfloat16)
        del t
    save_file(tensors, str(out / file), metadata={"format": "pt"})
    weight_map.update({n: file for n in group})
    del tensors
index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
(out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
print(f"{len(groups)} shards, {sum(sizes.values()) / 2**30:.2f} GiB, {sum(torch.Size(s).numel() for s in shapes.values()) / 1e9:.3f} B params")
"""

# Each command prints its own peak RSS as the last line (VmHWM: this process only; ru_maxrss
# would also count the peak of the process image that exec replaced).
PEAK = r"""
def _peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
"""

STREAM_COPY = PEAK + r"""
import json, os, struct, sys
from pathlib import Path
import torch
from safetensors import safe_open
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
dst.mkdir()
shards = sorted(src.glob("*.safetensors"))
entries, header, offset = [], {}, 0
for shard in shards:
    with safe_open(str(shard), "pt") as f:
        for name in f.keys():
            s = f.get_slice(name)
            n = torch.Size(s.get_shape()).numel() * 2
            header[name] = {"dtype": s.get_dtype(), "shape": s.get_shape(), "data_offsets": [offset, offset + n]}
            entries.append((shard, name)); offset += n
raw = json.dumps(header).encode(); raw += b" " * (-(len(raw) + 8) % 8)
with open(dst / "model.safetensors", "wb") as out:
    out.write(struct.pack("<Q", len(raw)) + raw)
    current = None
    for shard, name in entries:
        if current is None or current[0] != shard:
            current = (shard, safe_open(str(shard), "pt", backend=BACKEND))
        t = current[1].get_tensor(name)
        out.write(t.reshape(-1).view(torch.uint8).numpy())
        del t
print(_peak())
"""

COMMANDS = {
    "copy (mmap)": 'BACKEND = "mmap"' + STREAM_COPY,
    "copy (pread)": 'BACKEND = "pread"' + STREAM_COPY,
    "cp": PEAK + r"""
import shutil, sys
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
dst.mkdir()
for f in sorted(src.glob("*.safetensors")):
    shutil.copyfile(f, dst / f.name)
print(_peak())
""",
    "convert_from_hf": PEAK + r"""
import sys
from toolkit.convert import convert_from_hf
convert_from_hf(sys.argv[1], sys.argv[2])
print(_peak())
""",
    "from_hf --dtype float32": PEAK + r"""
import sys
from toolkit.convert import convert_from_hf
convert_from_hf(sys.argv[1], sys.argv[2], dtype="float32")
print(_peak())
""",
    "convert_to_hf": PEAK + r"""
import sys
from toolkit.convert import convert_to_hf
convert_to_hf(sys.argv[1], sys.argv[2])
print(_peak())
""",
}


def run(code: str, *args: str) -> tuple[float, int]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TQDM_DISABLE": "1"}
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if out.returncode:
        sys.exit(f"command failed:\n{out.stderr[-3000:]}")
    return wall, int(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work_dir", type=Path, default=Path("/tmp/convert-bench"))
    parser.add_argument("--repeat", type=int, default=3, help="runs per command; the median is reported")
    args = parser.parse_args()

    hf_dir = args.work_dir / "hf"
    if not (hf_dir / "model.safetensors.index.json").is_file():
        shutil.rmtree(hf_dir, ignore_errors=True)
        print(f"building {hf_dir} ...", flush=True)
        out = subprocess.run([sys.executable, "-c", BUILD, str(hf_dir)], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
        if out.returncode:
            sys.exit(out.stderr[-3000:])
        print(out.stdout.strip())
    size = sum(f.stat().st_size for f in hf_dir.glob("*.safetensors"))
    toolkit_dir = args.work_dir / "toolkit"
    if not (toolkit_dir / "model.safetensors").is_file():
        shutil.rmtree(toolkit_dir, ignore_errors=True)
        run(COMMANDS["convert_from_hf"], str(hf_dir), str(toolkit_dir))

    jobs = [
        ("copy (mmap)", hf_dir),
        ("copy (pread)", hf_dir),
        ("cp", hf_dir),
        ("convert_from_hf", hf_dir),
        ("convert_to_hf", toolkit_dir),
        ("from_hf --dtype float32", hf_dir),
    ]
    walls: dict[str, list[float]] = {name: [] for name, _ in jobs}
    syncs: dict[str, list[float]] = {name: [] for name, _ in jobs}
    peaks: dict[str, list[int]] = {name: [] for name, _ in jobs}
    dst = args.work_dir / "out"
    for _ in range(args.repeat):
        for name, src in jobs:  # round robin, so that no command always runs after the same one
            shutil.rmtree(dst, ignore_errors=True)
            os.sync()  # start every run with no dirty pages waiting to be written
            time.sleep(1)
            wall, peak = run(COMMANDS[name], str(src), str(dst))
            start = time.perf_counter()
            os.sync()  # how long until the output is on disk
            syncs[name].append(time.perf_counter() - start)
            walls[name].append(wall)
            peaks[name].append(peak)
    shutil.rmtree(dst, ignore_errors=True)
    results = {
        name: (statistics.median(walls[name]), max(peaks[name]), walls[name], statistics.median(syncs[name]))
        for name, _ in jobs
    }

    base_wall = results["copy (mmap)"][0]
    memory = next((line.split()[1] for line in open("/proc/meminfo") if line.startswith("MemTotal")), "0")
    print(f"\nmachine: {os.cpu_count()} CPUs, {int(memory) / 2**20:.0f} GiB memory, Python {sys.version.split()[0]}")
    print(f"checkpoint: {size / 2**30:.2f} GiB bfloat16, {len(list(hf_dir.glob('*.safetensors')))} shards; "
          f"median of {args.repeat} runs, each in a fresh process; peak RSS includes imports")
    print(f"{'command':<24} {'wall s':>7} {'x copy':>7} {'+sync s':>8} {'peak RSS GiB':>13}   runs (s)")
    for name, (wall, peak, runs, sync) in results.items():
        shown = ", ".join(f"{w:.1f}" for w in runs)
        print(f"{name:<24} {wall:7.2f} {wall / base_wall:7.2f} {sync:8.2f} {peak / 2**30:13.2f}   {shown}")
    print(json.dumps({k: {"wall_s": round(v[0], 2), "sync_s": round(v[3], 2), "peak_rss_gib": round(v[1] / 2**30, 3)}
                      for k, v in results.items()}))

if __name__ == "__main__":
    main()
