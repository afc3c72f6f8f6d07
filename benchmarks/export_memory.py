"""Rank 0's host peak during the final export, streamed against the former whole-model gather.

    python benchmarks/export_memory.py --results benchmarks/results/export-memory.json

Runs tests/scripts/export_stream.py on 2 FSDP processes (gloo, CPU) with a GPT of 16 layers, width
512 and an 8,192-token vocabulary (58 M parameters, 234 MB in float32), exporting in bfloat16.
Each export is measured as the growth of rank 0's peak resident set (VmHWM, reset just before)
over its resident set before the export:

    former     `full_state_dict` gathers every weight onto rank 0's CPU in float32, the export
               dtype makes a second copy, then `save_file` writes it;
    streamed   `stream_weights`: each weight's rows go to rank 0 in messages of at most
               --chunk_bytes (`EXPORT_CHUNK_BYTES`) in the export dtype, converted by their
               owner; rank 0 appends each to the file and frees it.

The bound of the streamed export is set by the message size alone, not by the model or its largest
weight: the message rank 0 receives and the one of its own rows it converts (two messages); there is
no write buffer (the bytes go from the tensor to the file). Both files are compared byte for byte.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {"n_layer": 16, "n_embd": 512, "vocab": 8192}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=None, help="write the figures here as JSON")
    parser.add_argument("--chunk_bytes", type=int, default=2**20, help="largest message of rows (EXPORT_CHUNK_BYTES)")
    parser.add_argument("--shard_bytes", type=int, default=None,
                        help="largest weights file (default: safetensors_io.MAX_SHARD_BYTES, 5 GB: one file here)")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PYTHONPATH=str(ROOT))
    env.pop("LOCAL_RANK", None)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / "export_stream.py"), tmp, "untied", "bfloat16",
                        *(str(SHAPE[k]) for k in ("n_layer", "n_embd", "vocab")), str(args.chunk_bytes),
                        *([str(args.shard_bytes)] if args.shard_bytes else [])], env=env, check=True,
                       stdout=subprocess.DEVNULL)
        figures = json.loads((Path(tmp) / "memory.json").read_text())
        streamed_files = sorted((Path(tmp) / "streamed").glob("*.safetensors"))
        former = Path(tmp) / "former" / "model.safetensors"
        if len(streamed_files) == 1:
            same = streamed_files[0].read_bytes() == former.read_bytes()
        else:  # shards: the same tensors, each equal (each file is `save_file` of its own tensors)
            from safetensors.torch import load_file
            import torch

            streamed = {k: v for f in streamed_files for k, v in load_file(str(f)).items()}
            expected = load_file(str(former))
            same = set(streamed) == set(expected) and all(torch.equal(streamed[k], expected[k]) for k in expected)
    largest = figures["largest_float32_bytes"]
    bound = 2 * args.chunk_bytes  # the message received + the one of rank 0's own rows being converted
    result = {"shape": SHAPE, "processes": 2, "export_dtype": "bfloat16", "model_float32_bytes": figures["model_float32_bytes"],
              "largest_weight_float32_bytes": largest, "chunk_bytes": args.chunk_bytes, "bound_bytes": bound,
              "rank0_peak_growth_bytes": figures["rank0_growth"], "weight_files": len(streamed_files),
              "shard_bytes": args.shard_bytes, "byte_for_byte_equal" if len(streamed_files) == 1 else "tensors_equal": same}
    mib = 2**20
    print(f"model {figures['model_float32_bytes'] / mib:.0f} MiB in float32, largest weight {largest / mib:.1f} MiB; "
          f"bound {bound / mib:.1f} MiB (two messages of {args.chunk_bytes / mib:.1f} MiB)")
    for kind, growth in figures["rank0_growth"].items():
        print(f"{kind:>9}: rank 0 host peak +{growth / mib:.1f} MiB")
    print(f"{len(streamed_files)} weights file(s); " + (f"equal byte for byte: {same}" if len(streamed_files) == 1
                                                          else f"tensors equal to the former file's: {same}"))
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
