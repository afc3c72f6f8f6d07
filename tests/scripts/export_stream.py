"""The final export on N gloo processes under FSDP: streamed (`stream_weights`) and the former way.

    python tests/scripts/export_stream.py OUT_DIR TIED EXPORT_DTYPE [N_LAYER N_EMBD VOCAB [CHUNK_BYTES [SHARD_BYTES]]]
    python tests/scripts/export_stream.py OUT_DIR --cases CASE [CASE ...]

Started once; Fabric's launcher starts the other rank. With `--cases`, each CASE is the arguments
after OUT_DIR joined by ":" (`untied:bfloat16:2:32:97:64`) and case i writes into OUT_DIR/case-i/:
several exports for the price of one pair of processes. A tiny GPT is set up sharded with random
weights; then rank 0 writes OUT_DIR/streamed/ through `Session.export_final`'s streaming path
(model.safetensors, or shards of at most SHARD_BYTES and their index) and
OUT_DIR/former/model.safetensors as the export did before (the whole model
gathered on rank 0 with `full_state_dict`, converted, `save_checkpoint_files`). Rank 0's host peak
(growth of VmHWM over the RSS before each export) goes to OUT_DIR/memory.json. CHUNK_BYTES sets
`checkpoint_io.EXPORT_CHUNK_BYTES`, the largest message of rows sent to rank 0.
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import torch  # noqa: E402

from toolkit.model_dir import save_checkpoint_files  # noqa: E402
from toolkit.models.config import Config  # noqa: E402
from toolkit.models.gpt import GPT, Block  # noqa: E402
from toolkit.args import DistributedArgs  # noqa: E402
from toolkit.training import checkpoint_io  # noqa: E402
from toolkit.training.checkpoint_io import full_state_dict, stream_weights  # noqa: E402
from toolkit.training.model_setup import host_memory_growth, setup_model, start_host_memory_window  # noqa: E402
from toolkit.parallel.precision import apply_precision_policy  # noqa: E402
from toolkit.parallel.plan import plan_strategy  # noqa: E402
from toolkit.training.fabric import build_fabric  # noqa: E402


DEFAULT_CHUNK_BYTES = checkpoint_io.EXPORT_CHUNK_BYTES


def export_case(fabric, out: Path, args: list[str]) -> None:
    """Both exports of one case (`args`: TIED EXPORT_DTYPE [N_LAYER N_EMBD VOCAB [CHUNK_BYTES [SHARD_BYTES]]])."""
    tied, dtype_name = args[0] == "tied", args[1]
    n_layer, n_embd, vocab = (int(x) for x in args[2:5]) if len(args) > 2 else (2, 32, 96)
    checkpoint_io.EXPORT_CHUNK_BYTES = int(args[5]) if len(args) > 5 else DEFAULT_CHUNK_BYTES
    shard_bytes = int(args[6]) if len(args) > 6 else None
    dtype = None if dtype_name == "none" else getattr(torch, dtype_name)
    config = Config(name="export", vocab_size=vocab, block_size=16, n_layer=n_layer, n_embd=n_embd,
                    n_head=4, tie_embeddings=tied, bias=True, lm_head_bias=not tied)
    with torch.device("meta"):
        model = GPT(config)
    apply_precision_policy(model, "32-true")

    shapes = {name: p.shape for name, p in model.named_parameters()}

    def read_rows(name, start, stop, out=None):
        # Different values per weight, the same whatever the sharding.
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        return out.copy_(torch.randn(shapes[name], generator=gen)[start:stop].reshape(out.shape))

    model = setup_model(fabric, model, read_rows)
    memory = {}
    for kind in ("streamed", "former"):
        target = out / kind
        if fabric.global_rank == 0:
            target.mkdir(parents=True, exist_ok=True)
        fabric.barrier()
        start = start_host_memory_window()
        if kind == "streamed":
            error = stream_weights(fabric, model, target if fabric.global_rank == 0 else None, config, dtype, shard_bytes)
            assert error is None, error
        else:
            state = full_state_dict(fabric, model)
            if fabric.global_rank == 0:
                if dtype is not None:
                    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
                save_checkpoint_files(target, state, config)
            del state
        memory[kind] = host_memory_growth(start)
        fabric.barrier()
    if fabric.global_rank == 0:
        fp32 = sum(p.numel() for p in model.parameters()) * 4
        largest = max(p.numel() for p in model.parameters()) * 4
        (out / "memory.json").write_text(json.dumps({"rank0_growth": memory, "model_float32_bytes": fp32,
                                                     "largest_float32_bytes": largest,
                                                     "chunk_bytes": checkpoint_io.EXPORT_CHUNK_BYTES}))


def main() -> None:
    out = Path(sys.argv[1])
    if sys.argv[2] == "--cases":
        cases = [(out / f"case-{i}", case.split(":")) for i, case in enumerate(sys.argv[3:])]
    else:
        cases = [(out, sys.argv[2:])]
    fabric = build_fabric(plan_strategy(2, 1, "32-true", DistributedArgs(), "cpu"), block_cls=Block)
    fabric.launch()
    for case_dir, args in cases:
        export_case(fabric, case_dir, args)
    from toolkit.training.failures import release_process_group

    release_process_group()  # destroys the group and frees what holds its threads


if __name__ == "__main__":
    main()
