"""Experiment trackers: W&B (offline) and MLflow (a local SQLite store) through `--log.loggers`.

One pretraining run is killed at step 3 and resumed to the end; both trackers are then read back
with their own libraries' data (W&B's run files, MLflow's client): the step metrics match the CSV
log, the resolved config is there once, and the killed and resumed starts are one tracker run.
"""

import json
import struct
import sys
from pathlib import Path

import pytest

from conftest import kill_group_at_step, logged_metrics, run_toolkit, tiny_pretrain_args

pytest.importorskip("wandb", reason="install the trackers extra: pip install -e '.[trackers]'")
pytest.importorskip("mlflow", reason="install the trackers extra: pip install -e '.[trackers]'")

STEPS = 6
KILL_AT = 3  # after the checkpoint of step 2


def _cmd(out_dir: Path, db: Path) -> list[str]:
    return [
        *tiny_pretrain_args(out_dir, STEPS),
        "--log.loggers", "[csv, wandb, mlflow]", "--log.offline", "true", "--log.project", "trackers-test",
        "--log.run_name", "tiny", "--log.tags", "[smoke, team=nlp]", "--log.tracking_uri", f"sqlite:///{db}",
        "--resume", "auto",
    ]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("trackers")
    out, db = root / "run", root / "mlflow.db"
    with pytest.MonkeyPatch.context() as patch:  # wandb's settings and caches: in the test's folder, not ~
        for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            patch.setenv(name, str(root / "wandb_home"))
        patch.delenv("WANDB_MODE", raising=False)  # --log.offline must do it alone
        kill_group_at_step([sys.executable, "-m", "toolkit", *_cmd(out, db)], KILL_AT)
        first_ids = json.loads((out / "trackers.json").read_text())
        stdout = run_toolkit(_cmd(out, db))
    assert "Resumed from" in stdout and "Continuing mlflow run" in stdout
    csv_losses = {int(float(r["step"])): float(r["train/loss"]) for r in logged_metrics(out) if r.get("train/loss")}
    return {"out": out, "db": db, "first_ids": first_ids, "ids": json.loads((out / "trackers.json").read_text()),
            "csv_losses": csv_losses}


# ------------------------------------------------------------------ W&B's run file, read back
def _wandb_records(path: Path):
    """The protobuf records of a W&B transaction log (`run-<id>.wandb`): a 7-byte header, then 32 KiB
    blocks of chunks (crc32, length, type: full/first/middle/last), as wandb-core writes them."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room left in the block for a chunk header: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:  # zero padding at the end of a file
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def _wandb_starts(out: Path) -> list[dict]:
    """Per start (offline run folder, in order): run id, name, project, tags, history rows and config."""
    starts = []
    for folder in sorted((out / "logs" / "wandb").glob("offline-run-*")):
        log_file = next(folder.glob("run-*.wandb"))
        start = {"file_id": log_file.stem[len("run-"):], "history": [], "config": {}}
        for record in _wandb_records(log_file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run = record.run
                start.update(id=run.run_id, name=run.display_name, project=run.project, tags=list(run.tags))
            elif kind == "history":
                start["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                         for item in record.history.item})
            elif kind == "config":
                start["config"].update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                        for item in record.config.update})
        starts.append(start)
    return starts


def test_wandb_offline_run_holds_the_step_metrics_and_the_config_and_continues_after_a_kill(run):
    starts = _wandb_starts(run["out"])
    assert len(starts) == 2, "one offline folder per start"
    run_id = run["first_ids"]["wandb"]["id"]
    # The killed start's wandb service died with it before writing its records (only the file header
    # is left); its file still names the run, which the resumed start continued.
    assert [s["file_id"] for s in starts] == [run_id, run_id], "the resumed start continues the same W&B run"
    assert run["ids"]["wandb"]["id"] == run_id
    resumed = starts[1]
    assert resumed["id"] == run_id and resumed["name"] == "tiny" and resumed["project"] == "trackers-test"
    assert resumed["tags"] == ["smoke", "team=nlp"]
    # The resolved config, nested as given.
    config = resumed["config"]
    assert config["command"] == "pretrain"
    assert config["train"]["max_steps"] == STEPS and config["train"]["micro_batch_size"] == 2
    assert config["data"]["class"] == "TextFiles" and config["data"]["train_path"].endswith("tinyshakespeare.txt")
    assert config["model_config"]["name"] == "debug-neox" and config["batch_plan"]["gradient_accumulation_iters"] == 2
    assert config["log"]["loggers"] == ["csv", "wandb", "mlflow"]
    # The resumed start logged every step from the checkpoint on, equal to the CSV log.
    losses = {row["trainer/global_step"]: row["train/loss"] for row in resumed["history"] if "train/loss" in row}
    assert sorted(losses) == list(range(KILL_AT, STEPS + 1))
    assert all(losses[s] == pytest.approx(run["csv_losses"][s], rel=1e-6) for s in losses)


def test_mlflow_killed_and_resumed_run_is_one_run_with_the_metrics_and_the_params(run):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run['db']}")
    experiment = client.get_experiment_by_name("trackers-test")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, "the resumed start continues the run instead of starting another"
    mlrun = runs[0]
    assert mlrun.info.run_id == run["first_ids"]["mlflow"]["run_id"] == run["ids"]["mlflow"]["run_id"]
    assert mlrun.info.run_name == "tiny" and mlrun.info.status == "FINISHED"
    assert mlrun.data.tags["team"] == "nlp" and "smoke" in mlrun.data.tags
    params = mlrun.data.params
    assert params["command"] == "pretrain" and params["train/max_steps"] == str(STEPS)
    assert params["data/class"] == "TextFiles" and params["model_config/name"] == "debug-neox"
    history = client.get_metric_history(mlrun.info.run_id, "train/loss")
    steps = sorted({m.step for m in history})
    assert steps == list(range(1, STEPS + 1)), "steps before the kill and after the resume, in one run"
    last = {m.step: m.value for m in sorted(history, key=lambda m: m.timestamp)}  # the resumed value wins
    assert all(last[s] == pytest.approx(run["csv_losses"][s], rel=1e-6) for s in range(KILL_AT, STEPS + 1))


# ------------------------------------------------------------------ a start that crashes
def test_a_run_that_crashes_mid_training_ends_its_mlflow_run_failed(run):
    """The first checkpoint (step 2) cannot be written (a file stands where the checkpoint folder
    goes): the start raises after two logged steps. Its MLflow run is FAILED, not left RUNNING, and
    the error that ends the command is still the original one. (In this process, with the module
    run's store and tokenized data: a new SQLite store alone takes seconds to create.)"""
    from mlflow.tracking import MlflowClient

    from toolkit.cli import run as toolkit

    out, db = run["out"].parent / "crashed", run["db"]
    out.mkdir()
    (out / "checkpoints").write_text("a file, not a folder\n")
    with pytest.raises(NotADirectoryError, match="checkpoints"):
        toolkit([
            *tiny_pretrain_args(out, STEPS), "--log.loggers", "[mlflow]", "--log.interval", "1",
            "--log.project", "crash-test", "--log.tracking_uri", f"sqlite:///{db}",
            "--resume", "auto",  # (a fresh run refuses a folder that holds "checkpoints")
        ])
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    (mlrun,) = client.search_runs([client.get_experiment_by_name("crash-test").experiment_id])
    assert mlrun.info.status == "FAILED" and mlrun.info.end_time is not None
    # It crashed in mid-run: steps 1 and 2 were trained and logged, the save after step 2 failed.
    assert sorted(m.step for m in client.get_metric_history(mlrun.info.run_id, "train/loss")) == [1, 2]


# ------------------------------------------------------------------ where the trackers write
def test_an_mlflow_file_store_is_refused_in_one_line_before_anything_starts(tmp_path, monkeypatch):
    from toolkit.args import LogArgs
    from toolkit.errors import UserError
    from toolkit.training.trackers import make_loggers

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(UserError, match="MLFLOW_TRACKING_URI file:.* is an MLflow file store") as error:
        make_loggers(tmp_path / "run", LogArgs(loggers=("mlflow",)), continue_runs=False)
    assert "\n" not in str(error.value) and "sqlite:///" in str(error.value)
    assert not (tmp_path / "mlruns").exists()
    # With MLflow's own opt-out the file store is the user's choice: no refusal from us.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    (logger,) = make_loggers(tmp_path / "run", LogArgs(loggers=("mlflow",)), continue_runs=False)
    assert logger.tracking_uri.startswith("file:")


def test_an_unreachable_server_and_a_resume_in_another_store_are_one_line(tmp_path, monkeypatch):
    """A tracking server that refuses connections: MLflow's client retried for minutes, then a
    traceback. A resumed run whose MLflow run is in another store than the one now named: 'Run not
    found' and a stray database; unnamed, the resumed start logs where its run is."""
    import json
    import socket

    from toolkit.args import LogArgs
    from toolkit.errors import UserError
    from toolkit.training.trackers import TRACKERS_FILE, make_loggers

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(UserError, match=f"MLflow cannot reach the tracking server http://127.0.0.1:{port}/ "):
        make_loggers(tmp_path / "run", LogArgs(loggers=("mlflow",), tracking_uri=f"http://127.0.0.1:{port}/"), continue_runs=False)

    run_dir = tmp_path / "resumed"
    run_dir.mkdir()
    recorded = f"sqlite:///{tmp_path / 'first.db'}"
    (run_dir / TRACKERS_FILE).write_text(json.dumps({"mlflow": {"run_id": "abc", "experiment_id": "1", "tracking_uri": recorded}}))
    other = f"sqlite:///{tmp_path / 'other.db'}"
    with pytest.raises(UserError, match=f"is in the tracking store {recorded}, not {other}: pass --log.tracking_uri {recorded}"):
        make_loggers(run_dir, LogArgs(loggers=("mlflow",), tracking_uri=other), continue_runs=True)
    assert not (tmp_path / "other.db").exists()
    (logger,) = make_loggers(run_dir, LogArgs(loggers=("mlflow",)), continue_runs=True)
    assert logger.tracking_uri == recorded


def test_the_cli_says_one_line_for_a_file_store(tmp_path, monkeypatch):
    import os
    import subprocess

    env = {**os.environ, "MLFLOW_TRACKING_URI": f"file:{tmp_path / 'mlruns'}", "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_ALLOW_FILE_STORE", None)
    out = subprocess.run([sys.executable, "-m", "toolkit", *tiny_pretrain_args(tmp_path / "run", 1), "--log.loggers", "[mlflow]"],
                         capture_output=True, text=True, env=env, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode != 0
    assert out.stderr.strip().count("\n") == 0 and "is an MLflow file store" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_wandb_writes_under_wandb_dir_when_it_is_set(tmp_path, monkeypatch):
    from toolkit.args import LogArgs
    from toolkit.training.trackers import make_loggers

    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    (logger,) = make_loggers(tmp_path / "run", LogArgs(loggers=("wandb",), offline=True), continue_runs=False)
    assert logger.save_dir == str(tmp_path / "elsewhere")
    monkeypatch.delenv("WANDB_DIR")
    (logger,) = make_loggers(tmp_path / "run", LogArgs(loggers=("wandb",), offline=True), continue_runs=False)
    assert logger.save_dir == str(tmp_path / "run" / "logs")


def test_a_run_whose_final_export_fails_is_not_marked_successful(run):
    """Success is declared when the session ends, after `final/` is written: a final export that
    cannot be written (a file stands where the folder goes) leaves the MLflow run FAILED."""
    from mlflow.tracking import MlflowClient

    from toolkit.cli import run as toolkit

    out, db = run["out"].parent / "export_fails", run["db"]
    out.mkdir()
    (out / "final").write_text("a file, not a folder\n")
    code = toolkit([
        *tiny_pretrain_args(out, 2), "--log.loggers", "[mlflow]", "--log.project", "export-fails",
        "--log.tracking_uri", f"sqlite:///{db}", "--resume", "auto",  # (a fresh run refuses a folder holding "final")
    ])
    assert code == 1
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    (mlrun,) = client.search_runs([client.get_experiment_by_name("export-fails").experiment_id])
    assert mlrun.info.status == "FAILED"
    assert (out / "checkpoints" / "step-00000002").is_dir()  # the training itself finished and saved
