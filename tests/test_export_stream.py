"""The final export streams: gathered, converted and written one tensor at a time, byte for byte
what the former whole-model export wrote (2 FSDP processes on gloo), or, beyond the shard size, in
Hugging Face's sharded layout; and a safetensors file written piece by piece equal to
`safetensors.torch.save_file` of the same tensors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import launch_env
from toolkit.safetensors_io import SafetensorsShards, SafetensorsStream

SCRIPT = Path(__file__).parent / "scripts" / "export_stream.py"


def test_a_safetensors_file_written_rows_at_a_time_equals_save_file(tmp_path):
    tensors = {"a": torch.randn(5, 3).bfloat16(), "b": torch.arange(4), "c": torch.randn(2, 2, 2)}
    save_file(tensors, str(tmp_path / "ref.safetensors"))
    stream = SafetensorsStream(tmp_path / "rows.safetensors", {k: (v.dtype, v.shape) for k, v in tensors.items()})
    for name in stream.order:
        for rows in tensors[name].split(2):  # pieces of 2 rows (the last one shorter)
            stream.append(name, rows)
    with pytest.raises(ValueError, match="do not continue"):
        SafetensorsStream(tmp_path / "bad.safetensors", {"a": (torch.bfloat16, (5, 3))}).append("a", torch.zeros(6, 3).bfloat16())
    stream.close()
    assert (tmp_path / "rows.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_a_streamed_safetensors_file_equals_save_file(tmp_path):
    tensors = {"blocks.10.w": torch.randn(3, 4).bfloat16(), "blocks.2.w": torch.randn(2, 2), "ids": torch.arange(3),
               "half": torch.randn(5).half(), "mask": torch.ones(2, dtype=torch.bool), "scalar": torch.tensor(3.0),
               "empty": torch.zeros(0, 4)}
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    stream = SafetensorsStream(tmp_path / "streamed.safetensors", {k: (v.dtype, v.shape) for k, v in tensors.items()},
                               metadata={"format": "pt"})
    with pytest.raises(ValueError, match="expected"):
        stream.write("not-next", torch.zeros(1))
    for name in stream.order:
        stream.write(name, tensors[name])
    stream.close()
    assert (tmp_path / "streamed.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


# (tied, export dtype, n_layer n_embd vocab chunk bytes [shard bytes]): the default messages hold
# whole shards; the third run sends a row per message, and its odd vocabulary gives shards of 49 and
# 48 rows; the fourth writes files of at most 12 kB (Hugging Face's sharded layout).
EXPORT_CASES = [("untied", "bfloat16", []), ("tied", "none", []), ("untied", "bfloat16", ["2", "32", "97", "64"]),
                ("tied", "bfloat16", ["2", "32", "96", "256", "12000"])]


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> Path:
    """Every case of EXPORT_CASES exported by one pair of FSDP processes, case i in case-i/."""
    root = tmp_path_factory.mktemp("export_stream")
    cases = [":".join([tied, dtype, *shape]) for tied, dtype, shape in EXPORT_CASES]
    result = subprocess.run([sys.executable, str(SCRIPT), str(root), "--cases", *cases], env=launch_env(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return root


@pytest.mark.parametrize("case", range(len(EXPORT_CASES)), ids=["-".join([t, d, f"shape{i}"]) for i, (t, d, _) in enumerate(EXPORT_CASES)])
def test_streamed_export_on_two_processes_equals_the_former_export_byte_for_byte(exports, tmp_path, case):
    shape = EXPORT_CASES[case][2]
    out = exports / f"case-{case}"
    former = (out / "former" / "model.safetensors").read_bytes()
    assert len(former) > 20_000  # the model: 40k parameters
    assert json.loads((out / "memory.json").read_text())["rank0_growth"]["streamed"] >= 0
    if len(shape) < 5:
        assert (out / "streamed" / "model.safetensors").read_bytes() == former
        assert not (out / "streamed" / "model.safetensors.index.json").exists()
        return
    # Sharded: each file is `save_file` of its tensors, the index names each tensor's file, and
    # together they hold the former file's tensors exactly.
    files = sorted((out / "streamed").glob("*.safetensors"))
    assert len(files) >= 3 and not (out / "streamed" / "model.safetensors").exists()
    index = json.loads((out / "streamed" / "model.safetensors.index.json").read_text())
    expected = load_file(str(out / "former" / "model.safetensors"))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values())
    streamed = {}
    for file in files:
        assert file.name == f"model-{files.index(file) + 1:05d}-of-{len(files):05d}.safetensors"
        tensors = load_file(str(file))
        assert len(tensors) == 1 or file.stat().st_size <= 12_000 + 2_000  # + the header
        assert all(index["weight_map"][name] == file.name for name in tensors)
        save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
        assert file.read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
        streamed.update(tensors)
    assert set(streamed) == set(expected) == set(index["weight_map"])
    assert all(torch.equal(streamed[k], expected[k]) for k in expected)


def test_sharded_safetensors_files_group_consecutive_tensors_in_model_order(tmp_path):
    tensors = {"embed": torch.randn(8, 4), "b.0": torch.randn(3, 4).bfloat16(), "b.1": torch.randn(3, 4).bfloat16(),
               "head": torch.randn(10, 4), "norm": torch.randn(4)}
    sizes = {k: v.numel() * v.element_size() for k, v in tensors.items()}  # 128, 24, 24, 160, 16
    shards = SafetensorsShards(tmp_path, {k: (v.dtype, v.shape) for k, v in tensors.items()}, max_shard_bytes=150)
    # embed + b.0 (152) would pass 150; b.0 + b.1 fit; head alone is over the limit; norm follows it.
    assert shards.filenames == [f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4)]
    assert shards.order == ["embed", "b.0", "b.1", "head", "norm"]
    with pytest.raises(ValueError, match="out of order"):
        shards.write("head", tensors["head"])
    for name in shards.order:
        shards.write(name, tensors[name])
    shards.close()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index == {"metadata": {"total_size": sum(sizes.values())},
                     "weight_map": {"b.0": shards.filenames[1], "b.1": shards.filenames[1], "embed": shards.filenames[0],
                                    "head": shards.filenames[2], "norm": shards.filenames[3]}}
    single = SafetensorsShards(tmp_path / "one", {k: (v.dtype, v.shape) for k, v in tensors.items()},
                               metadata={"format": "pt"})
    (tmp_path / "one").mkdir()
    for name in single.order:
        single.write(name, tensors[name])
    with pytest.raises(ValueError, match="never written"):
        SafetensorsShards(tmp_path / "none", {"a": (torch.float32, (1,))}).close()
    single.close()
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    assert [p.name for p in (tmp_path / "one").iterdir()] == ["model.safetensors"]
    assert (tmp_path / "one" / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
