"""Where metrics go: CSV, TensorBoard, Weights & Biases and MLflow, through Fabric loggers.

`--log.loggers [csv, tensorboard, wandb, mlflow]` picks any combination: Fabric's CSV and TensorBoard
loggers, and the toolkit's W&B and MLflow loggers (`tracker_loggers`). The loggers are made on every
rank, but they create their run and write only on global rank 0.

A tracker run (W&B, MLflow) is one per training run, not one per start: its id is kept in
`<out_dir>/trackers.json`, and a start that resumes from a checkpoint of that folder passes it back
(W&B `id` + `resume="allow"`, MLflow `run_id`), so a killed and resumed run stays one run with one
history. CSV and TensorBoard write one `version_N` folder per start instead (a resume never
overwrites what the run it continues wrote).

The whole resolved configuration (every argument of the command, the model config and the batch
plan) is logged as hyperparameters: W&B's run config and TensorBoard's hparams at every start (the
values of the latest start win), MLflow's parameters once, when its run is created.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from toolkit.errors import UserError

TRACKERS_FILE = "trackers.json"
DEFAULT_PROJECT = "toolkit"

# logger name -> (module it needs, pip requirement that provides it)
_NEEDS = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow-skinny")}


def check_available(loggers: Sequence[str]) -> None:
    """A tracker whose package is missing fails before any process starts, in one line."""
    for name in loggers:
        if name in _NEEDS and importlib.util.find_spec(_NEEDS[name][0]) is None:
            raise UserError(
                f"--log.loggers {name} needs the {_NEEDS[name][1]} package: pip install 'toolkit[trackers]' "
                f"(or pip install {_NEEDS[name][1]}), or leave {name} out of --log.loggers."
            )


def mlflow_tracking_uri(log, out_dir: Path) -> str:
    """--log.tracking_uri, else MLFLOW_TRACKING_URI, else a SQLite store in the run's folder (offline).

    A file store (`file:...` or a plain path) is refused in one line unless MLFLOW_ALLOW_FILE_STORE
    is true: MLflow 3 itself refuses it, with a long traceback, when the run starts.
    """
    uri = log.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri and _is_file_store(uri) and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("1", "true", "yes"):
        where = "--log.tracking_uri" if log.tracking_uri else "MLFLOW_TRACKING_URI"
        raise UserError(
            f"{where} {uri} is an MLflow file store, which MLflow 3 no longer writes to: use a database, e.g. "
            f"--log.tracking_uri sqlite:///{(Path(out_dir) / 'logs' / 'mlflow.db').resolve()} (`mlflow migrate-filestore` "
            "moves old runs), a tracking server (http://...), or set MLFLOW_ALLOW_FILE_STORE=true to keep the file store."
        )
    return uri or f"sqlite:///{(Path(out_dir) / 'logs' / 'mlflow.db').resolve()}"


def _is_file_store(uri: str) -> bool:
    """`file:` URIs and plain paths (no scheme, or a Windows drive letter) are MLflow's file store."""
    scheme, sep, _ = uri.partition(":")
    return scheme.lower() == "file" or not sep or len(scheme) == 1


def wandb_dir(out_dir: Path) -> str:
    """Where W&B writes its run folders: WANDB_DIR when the user sets it (W&B's own convention), else
    `<out_dir>/logs` (a `wandb/` folder is created inside)."""
    return os.environ.get("WANDB_DIR") or str(Path(out_dir) / "logs")


def read_tracker_ids(out_dir: Path) -> dict:
    """The tracker runs `<out_dir>/trackers.json` records ({} when there is none or it is unreadable)."""
    path = Path(out_dir) / TRACKERS_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def make_loggers(out_dir: Path, log, continue_runs: bool) -> list:
    """The loggers `log.loggers` names. `continue_runs`: this start resumes from a checkpoint of
    `out_dir`, so W&B and MLflow continue the tracker runs recorded there."""
    from lightning_fabric.loggers import CSVLogger, TensorBoardLogger

    check_available(log.loggers)
    out_dir = Path(out_dir)
    previous = read_tracker_ids(out_dir) if continue_runs else {}
    name = log.run_name or out_dir.resolve().name
    loggers: list = []
    # Each start (fresh or resumed) logs into its own version_N folder, so a resume never
    # overwrites the metrics of the run it continues.
    if "csv" in log.loggers:
        loggers.append(CSVLogger(root_dir=str(out_dir / "logs"), name="csv"))
    if "tensorboard" in log.loggers:
        loggers.append(TensorBoardLogger(root_dir=str(out_dir / "logs"), name="tensorboard"))
    if "wandb" in log.loggers:
        from toolkit.training.tracker_loggers import WandbRunLogger

        loggers.append(WandbRunLogger(
            name=os.environ.get("WANDB_NAME") or name,
            project=log.project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
            save_dir=wandb_dir(out_dir),
            run_id=previous.get("wandb", {}).get("id"),  # None: a new run
            tags=list(log.tags) or None,
            offline=log.offline,  # otherwise wandb reads WANDB_MODE itself
        ))
    if "mlflow" in log.loggers:
        from toolkit.training.tracker_loggers import MLflowRunLogger

        uri = mlflow_tracking_uri(log, out_dir)
        recorded = previous.get("mlflow", {}).get("tracking_uri")
        if recorded and recorded != uri:
            if log.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"):
                raise UserError(
                    f"This run's MLflow run {previous['mlflow'].get('run_id')} is in the tracking store {recorded}, not "
                    f"{uri}: pass --log.tracking_uri {recorded} to continue it, or start a new --out_dir."
                )
            uri = recorded  # a resumed start logs where its run is, as it did when no store was named
        _check_server_reachable(uri)
        try:
            loggers.append(MLflowRunLogger(
                experiment_name=log.project or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_PROJECT,
                run_name=name,
                tracking_uri=uri,
                tags=_mlflow_tags(log.tags) or None,
                run_id=previous.get("mlflow", {}).get("run_id"),
            ))
        except Exception as error:  # MlflowException and the store's own errors: one line, not its traceback
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise UserError(f"MLflow cannot use the tracking store {uri}: {reason[:300]}") from None
    return loggers


def _check_server_reachable(uri: str, seconds: float = 5.0) -> None:
    """An http(s) tracking server that does not accept a connection within `seconds` is one line:
    MLflow's client retries each request for minutes before its own traceback."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        socket.create_connection((parts.hostname, port), timeout=seconds).close()
    except (OSError, ValueError) as error:
        reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
        raise UserError(f"MLflow cannot reach the tracking server {uri} ({reason}); start it, or pass another "
                        "--log.tracking_uri (without one, runs are logged to a database in the run's folder).") from None


def _mlflow_tags(tags: Sequence[str]) -> dict[str, str]:
    """"team=nlp" -> {"team": "nlp"}; a plain "baseline" -> {"baseline": ""}."""
    out = {}
    for tag in tags:
        key, _, value = tag.partition("=")
        out[key] = value
    return out


def start_tracker_runs(fabric, out_dir: Path, hparams: dict, continue_runs: bool) -> None:
    """On global rank 0: create the tracker runs, log `hparams` once per tracker run, record the runs' ids.

    TensorBoard gets the hyperparameters at every start (one version folder per start), and so
    does W&B (an update of the run's config: a killed start may never have written its config to
    disk, and a resumed start may legitimately change e.g. max_steps). MLflow gets them only when
    its run is created: it writes them at once, and refuses to change a parameter's value later.
    """
    if fabric.global_rank != 0:
        return
    (Path(out_dir) / "logs").mkdir(parents=True, exist_ok=True)  # the MLflow SQLite default lives there
    previous = read_tracker_ids(out_dir) if continue_runs else {}
    record = dict(previous)
    for logger in fabric.loggers:
        kind = tracker_kind(logger)
        # Fabric's CSVLogger takes no hyperparameters (run_args.json holds the essentials beside it).
        # MLflow parameters are written once, when the run is created, and cannot change afterwards.
        if type(logger).__name__ != "CSVLogger" and not (kind == "mlflow" and kind in previous):
            logger.log_hyperparams(hparams)
        if kind == "wandb":
            run = logger.experiment
            record["wandb"] = {"id": run.id, "project": run.project, "name": run.name, "dir": str(logger.save_dir)}
        elif kind == "mlflow":
            if kind in previous:  # the start that left it ended it FAILED or KILLED (or left it RUNNING)
                logger.experiment.update_run(logger.run_id, status="RUNNING")
            record["mlflow"] = {
                "run_id": logger.run_id, "experiment_id": logger.experiment_id, "tracking_uri": logger.tracking_uri,
            }
        if kind is not None:
            run_id = record[kind].get("id") or record[kind].get("run_id")
            fabric.print(f"{'Continuing' if kind in previous else 'Logging to'} {kind} run {run_id}")
    if record and record != previous:
        path = Path(out_dir) / TRACKERS_FILE
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, path)


# How a start of the training run ended, as the loggers' `finalize` takes it.
RUN_ENDS = ("success", "failed", "killed")


def finish_tracker_runs(fabric, status: str = "success") -> None:
    """Flush every logger; end the tracker runs with `status` (one of RUN_ENDS): MLflow's run
    is FINISHED, FAILED or KILLED, the W&B run ends with exit code 0 or 1 (its files are complete
    only then). Every rank calls it; the tracker loggers act on global rank 0."""
    if status not in RUN_ENDS:
        raise ValueError(f"status must be one of {RUN_ENDS}, got {status!r}")
    for logger in fabric.loggers:
        logger.finalize(status)


def tracker_kind(logger) -> Optional[str]:
    name = type(logger).__name__
    return {"WandbRunLogger": "wandb", "MLflowRunLogger": "mlflow"}.get(name)


# ---------------------------------------------------------------------------------------------------
# The resolved configuration, as plain JSON-able values


def run_config(function: Callable, arguments: dict[str, Any]) -> dict[str, Any]:
    """`function`'s arguments taken from `arguments` (an entry point's `locals()`), as plain values.

    Dataclasses (TrainArgs, a data module, ...) become dicts, a data module with its class name
    under "class"; paths become strings.
    """
    import inspect

    names = inspect.signature(function).parameters
    return {name: plain(arguments[name]) for name in names if name in arguments}


def plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init and not f.name.startswith("_")}
        return {"class": type(value).__name__, **fields} if _is_chosen_class(value) else fields
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _is_chosen_class(value: Any) -> bool:
    """A data module or an objective: one of several classes, chosen by name (`--data Alpaca`)."""
    return type(value).__module__.startswith(
        ("toolkit.data", "toolkit.training.objectives", "toolkit.training.preference_objectives")
    )
