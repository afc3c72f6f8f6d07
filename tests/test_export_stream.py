"""The final export streams: gathered, converted and written one tensor at a time, byte for byte
what the former whole-model export wrote (2 FSDP processes on gloo), and a safetensors file written
piece by piece equal to `safetensors.torch.save_file` of the same tensors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import launch_env
from toolkit.model_dir import SafetensorsStream

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


# (tied, export dtype, n_layer n_embd vocab chunk bytes): the default messages hold whole shards;
# the third run sends a row per message, and its odd vocabulary gives shards of 49 and 48 rows.
@pytest.mark.parametrize("tied, dtype, shape", [("untied", "bfloat16", []), ("tied", "none", []),
                                                ("untied", "bfloat16", ["2", "32", "97", "64"])])
def test_streamed_export_on_two_processes_equals_the_former_export_byte_for_byte(tmp_path, tied, dtype, shape):
    env = launch_env()
    result = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), tied, dtype, *shape], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    streamed = (tmp_path / "streamed" / "model.safetensors").read_bytes()
    assert len(streamed) > 50_000  # the model: 40k parameters
    assert streamed == (tmp_path / "former" / "model.safetensors").read_bytes()
    assert json.loads((tmp_path / "memory.json").read_text())["rank0_growth"]["streamed"] >= 0
