"""toolkit.safetensors_io on its own: headers and byte ranges, row reads, the kernel copy, the sharded layout."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from toolkit.errors import UserError
from toolkit.safetensors_io import (
    SafetensorsShards,
    SafetensorsStream,
    open_checkpoint,
    read_header,
    read_rows,
    read_rows_into,
    weight_files,
)


def tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"w": torch.randn(7, 5, generator=generator).bfloat16(), "ids": torch.arange(6), "scalar": torch.tensor(2.5),
            "empty": torch.zeros(0, 3), "half": torch.randn(4, generator=generator).half()}


def test_header_byte_ranges_hold_the_tensors_and_rows_read_back(tmp_path):
    stored = tensors()
    path = tmp_path / "a.safetensors"
    save_file(stored, str(path))
    data = path.read_bytes()
    infos = read_header(path)
    assert [i.offset for i in infos] == sorted(i.offset for i in infos)  # file order
    for info in infos:
        tensor = stored[info.name]
        assert (info.shape, info.nbytes) == (tuple(tensor.shape), tensor.numel() * tensor.element_size())
        assert data[info.offset:info.offset + info.nbytes] == tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert torch.equal(read_rows(info), tensor)
    w = next(i for i in infos if i.name == "w")
    assert torch.equal(read_rows(w, 2, 5), stored["w"][2:5])
    out = torch.empty(4, 5)  # another dtype: the rows are converted into it, two at a time
    assert read_rows_into(w, 3, out, chunk_bytes=2 * 5 * 4) is out
    assert torch.equal(out, stored["w"][3:7].float())


def test_a_stream_of_writes_rows_and_kernel_copies_equals_save_file(tmp_path):
    stored = tensors()
    save_file(stored, str(tmp_path / "source.safetensors"), metadata={"format": "pt"})
    source = {i.name: i for i in read_header(tmp_path / "source.safetensors")}
    stream = SafetensorsStream(tmp_path / "out.safetensors", {k: (v.dtype, v.shape) for k, v in stored.items()},
                               metadata={"format": "pt"})
    for name in stream.order:
        if name == "w":
            for rows in stored[name].split(3):
                stream.append(name, rows)
        elif name == "ids":
            stream.copy(name, source[name])
        else:
            stream.write(name, stored[name])
    with pytest.raises(ValueError, match="never written"):
        SafetensorsStream(tmp_path / "short.safetensors", {"a": (torch.float32, (2,))}).close()
    stream.close()
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "source.safetensors").read_bytes()


def test_shards_in_a_given_order_read_back_through_the_index(tmp_path):
    stored = {f"t{i}": torch.full((8, 4), float(i)) for i in range(5)}  # 128 bytes each
    order = ["t3", "t0", "t4", "t1", "t2"]
    files = SafetensorsShards(tmp_path, {k: (stored[k].dtype, stored[k].shape) for k in order}, max_shard_bytes=300,
                              keep_order=True)
    assert files.order == order
    for name in files.order:
        files.write(name, stored[name])
    files.close()
    paths = weight_files(tmp_path)
    assert [p.name for p in paths] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [sorted(load_file(str(p))) for p in paths] == [["t0", "t3"], ["t1", "t4"], ["t2"]]
    assert [i.name for i in read_header(paths[0])] == ["t3", "t0"]  # file order, not name order
    checkpoint = open_checkpoint(tmp_path)
    assert all(torch.equal(checkpoint.read(k), v) for k, v in stored.items())
    assert json.loads((tmp_path / "model.safetensors.index.json").read_text())["metadata"]["total_size"] == 5 * 128

    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["t0"] = "/etc/passwd"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match="which is not a safetensors file in"):
        weight_files(tmp_path)
