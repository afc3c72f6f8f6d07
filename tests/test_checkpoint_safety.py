"""A sharded training checkpoint from elsewhere cannot run code: torch's distributed checkpoint
unpickles its `.metadata` with plain `pickle.load` and its non-tensor entries with
`torch.load(weights_only=False)`; the toolkit reads both with restricted unpicklers first
(`toolkit.distributed_checkpoint`) and refuses anything else in one line, before torch reads it."""

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from toolkit.distributed_checkpoint import check_distributed_checkpoint
from toolkit.errors import UserError
from toolkit.models.config import Config

REPO = Path(__file__).resolve().parents[1]


class Payload:
    """Unpickling this creates `marker`: the proof that code from the checkpoint ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def sharded_training_checkpoint(root: Path, train_state: dict) -> Path:
    """A training checkpoint folder as an FSDP run writes it: model_config.json and state/ (one process)."""
    config = Config.from_name("debug-neox")
    root.mkdir(parents=True)
    config.save(root)
    from toolkit.models.gpt import GPT

    model = GPT(config)
    state = {"model": model.state_dict(), "train_state": train_state}
    dcp.save(state, checkpoint_id=root / "state", no_dist=True)
    return root


def test_a_clean_checkpoint_passes_and_reads_its_entries(tmp_path):
    folder = sharded_training_checkpoint(tmp_path / "run", {"step": 3, "lr": 1e-3, "name": "x", "betas": (0.9, 0.95)})
    metadata = check_distributed_checkpoint(folder / "state")
    assert "model.embed.weight" in metadata.state_dict_metadata
    assert "train_state.step" in metadata.state_dict_metadata


def test_a_payload_in_the_metadata_is_refused_and_never_runs(tmp_path):
    folder = sharded_training_checkpoint(tmp_path / "run", {"step": 3})
    marker = tmp_path / "ran"
    (folder / "state" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(UserError, match=r"\.metadata holds something other than checkpoint data") as error:
        check_distributed_checkpoint(folder / "state")
    assert "\n" not in str(error.value)
    assert not marker.exists()


def test_a_payload_in_an_entry_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "ran"
    folder = sharded_training_checkpoint(tmp_path / "run", {"step": 3, "note": Payload(marker)})
    assert not marker.exists()  # saving pickles it, nothing runs
    with pytest.raises(UserError, match=r"entry train_state.note holds something other than checkpoint data"):
        check_distributed_checkpoint(folder / "state")
    assert not marker.exists()


def test_convert_pretrained_checkpoint_refuses_it_in_one_line(tmp_path):
    folder = sharded_training_checkpoint(tmp_path / "run", {"step": 3})
    marker = tmp_path / "ran"
    (folder / "state" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "toolkit", "convert_pretrained_checkpoint", str(folder), str(tmp_path / "out")],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert out.returncode != 0
    assert out.stderr.strip().count("\n") == 0, out.stderr
    assert "Refusing to read the checkpoint" in out.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_convert_pretrained_checkpoint_still_reads_a_clean_sharded_checkpoint(tmp_path):
    from toolkit.convert import convert_pretrained_checkpoint
    from toolkit.model_dir import load_model

    folder = sharded_training_checkpoint(tmp_path / "run", {"step": 3})
    out = convert_pretrained_checkpoint(folder, tmp_path / "out")
    from toolkit.models.gpt import GPT

    reference = GPT(Config.from_name("debug-neox"))
    state = dict(dcp_state(folder / "state"))
    loaded = load_model(out).state_dict()
    assert set(loaded) == set(reference.state_dict())
    assert all(torch.equal(loaded[k], state[f"model.{k}"]) for k in loaded if f"model.{k}" in state)


def dcp_state(folder: Path) -> dict:
    """Every tensor of a one-process distributed checkpoint, read the plain way (for comparison)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    out: dict = {}
    _load_state_dict(out, storage_reader=dcp.FileSystemReader(folder), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    flat = {}
    for top, value in out.items():
        if isinstance(value, dict):
            flat.update({f"{top}.{k}": v for k, v in value.items() if isinstance(v, torch.Tensor)})
    return flat
