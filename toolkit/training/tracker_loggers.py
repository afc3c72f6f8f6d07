"""Fabric loggers for the two experiment trackers, W&B and MLflow, over their own client libraries.

Fabric ships CSV and TensorBoard loggers; the W&B and MLflow loggers Lightning offers live in the
Trainer package, whose import (with torchmetrics, which pulls in scipy and transformers) costs about
2 s of CPU in every process of every run. These two classes hold what the toolkit needs of a
tracker run: create it or continue one by id, log hyperparameters and step metrics from global rank
0, and end it with the status the run ended with ("success", "failed" or "killed").

Both are made on every rank, as Fabric's own loggers are; only global rank 0 creates a run or writes.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any, Optional

from lightning_fabric.loggers.logger import Logger, rank_zero_experiment
from lightning_fabric.utilities.rank_zero import rank_zero_only

# The W&B metric every logged row carries its optimizer step in, declared as the x-axis of all the
# others. W&B's own `step` must only grow, so a run resumed from an older checkpoint could not log
# its steps again; a step metric of our own can. The name is the one Lightning's logger used, so
# runs started with earlier versions of the toolkit continue on the same axis.
WANDB_STEP_METRIC = "trainer/global_step"

# How a start of the training run ended -> MLflow's run status.
MLFLOW_STATUSES = {"success": "FINISHED", "failed": "FAILED", "killed": "KILLED"}


def flatten(params: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"max_steps": 6}} -> {"train/max_steps": 6}; lists and scalars are leaves."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{name}/"))
        else:
            out[name] = value
    return out


class WandbRunLogger(Logger):
    """One W&B run: a new one, or the run `run_id` continued (W&B's resume="allow").

    `offline`: write the run under `save_dir` only (`wandb sync` uploads it later); otherwise W&B's
    own settings decide (WANDB_MODE, the logged-in account).
    """

    def __init__(self, *, project: str, name: str, save_dir: str, run_id: Optional[str] = None,
                 tags: Optional[list[str]] = None, offline: bool = False) -> None:
        self._project, self._name, self._save_dir = project, name, save_dir
        self._run_id, self._tags, self._offline = run_id, tags, offline
        self._run = None

    @property
    def name(self) -> str:
        return self._project

    @property
    def version(self) -> Optional[str]:
        return self._run.id if self._run is not None else self._run_id

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @property
    @rank_zero_experiment
    def experiment(self):
        """The wandb Run, created on first use (global rank 0 only)."""
        if self._run is None:
            import wandb

            os.makedirs(self._save_dir, exist_ok=True)
            settings: dict[str, Any] = {"mode": "offline"} if self._offline else {}
            self._run = wandb.init(project=self._project, name=self._name, dir=self._save_dir, id=self._run_id,
                                   resume="allow", tags=self._tags, **settings)
            self._run.define_metric(WANDB_STEP_METRIC)
            self._run.define_metric("*", step_metric=WANDB_STEP_METRIC, step_sync=True)
        return self._run

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        # A resumed start may change a value (e.g. max_steps): the latest start's values win.
        self.experiment.config.update(params, allow_val_change=True)

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        row = dict(metrics)
        if step is not None:
            row[WANDB_STEP_METRIC] = step
        self.experiment.log(row)

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """Ends the run (its files are complete only then): exit code 0 for "success", else 1."""
        if self._run is not None:
            self._run.finish(exit_code=0 if status == "success" else 1)
            self._run = None


class MLflowRunLogger(Logger):
    """One MLflow run in `experiment_name`: a new one, or the run `run_id` continued.

    The client is made at once on every rank (a tracking store it cannot use fails here, before any
    process starts); the run is created on first use, on global rank 0. Hyperparameters are logged
    flat ("train/max_steps"), as strings of at most MLflow's parameter length.
    """

    def __init__(self, *, experiment_name: str, run_name: str, tracking_uri: str,
                 tags: Optional[dict[str, str]] = None, run_id: Optional[str] = None) -> None:
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri
        self._experiment_name, self._run_name, self._tags = experiment_name, run_name, tags or {}
        self._run_id, self._experiment_id = run_id, None
        self._client = MlflowClient(tracking_uri)

    @property
    def name(self) -> Optional[str]:
        return self.experiment_id

    @property
    def version(self) -> Optional[str]:
        return self.run_id

    @property
    @rank_zero_experiment
    def experiment(self):
        """The MlflowClient, with this logger's experiment and run created (or found) on first use."""
        if self._experiment_id is None:
            if self._run_id is not None:
                self._experiment_id = self._client.get_run(self._run_id).info.experiment_id
            else:
                from mlflow.tracking.context.registry import resolve_tags

                found = self._client.get_experiment_by_name(self._experiment_name)
                self._experiment_id = (found.experiment_id if found is not None
                                       else self._client.create_experiment(self._experiment_name))
                # resolve_tags adds MLflow's usual context: the user, the source, the git commit
                run = self._client.create_run(self._experiment_id, run_name=self._run_name,
                                              tags=resolve_tags(self._tags))
                self._run_id = run.info.run_id
        return self._client

    @property
    def run_id(self) -> Optional[str]:
        self.experiment
        return self._run_id

    @property
    def experiment_id(self) -> Optional[str]:
        self.experiment
        return self._experiment_id

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        entries = [Param(key, str(value)[:MAX_PARAM_VAL_LENGTH]) for key, value in flatten(params).items()]
        for start in range(0, len(entries), 100):  # MLflow takes at most 100 parameters per batch
            self.experiment.log_batch(self.run_id, params=entries[start:start + 100])

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        # MLflow accepts letters, digits and _ / . - and space in a metric's name
        entries = [Metric(re.sub(r"[^A-Za-z0-9_/. -]", "", key), float(value), now, step or 0)
                   for key, value in metrics.items() if not isinstance(value, str)]
        self.experiment.log_batch(self.run_id, metrics=entries)

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """Ends the run FINISHED, FAILED or KILLED for "success", "failed" or "killed"."""
        if self._experiment_id is not None:
            self._client.set_terminated(self._run_id, MLFLOW_STATUSES[status])
