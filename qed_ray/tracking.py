"""Everything MLflow (the only module that imports it): sweep parent runs, trial child runs, artifacts.

Run identity is deterministic: a sweep's parent run carries the tag ``qed.sweep_id`` and a trial's run the tags
``qed.sweep_id`` + ``qed.trial``; re-opening a sweep or retrying/restoring a trial finds and continues the same run
instead of creating a duplicate (``shared/research/ray_mlflow.md`` §2.2). Runs are driven through an explicit
``MlflowClient`` and run ids, never through MLflow's process-global active run.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Mapping

from mlflow.entities import Metric, Param, RunStatus
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

from qed_ray.checksums import Recorded
from qed_ray.layout import SweepDir

SWEEP_TAG = "qed.sweep_id"
TRIAL_TAG = "qed.trial"
ROLE_TAG = "qed.role"
REASON_TAG = "qed.failure_reason"
POLICY_SHA_TAG = "qed.policy_sha256"  # the final snapshot's state.pt SHA-256, set by the trial at its end
SNAPSHOTS_SHA_TAG = "qed.snapshots_sha256"  # the digest of all its snapshots (qed_ray.checksums)
# MLflow 3's UI opens an experiment on its GenAI overview ("Traces") unless this tag says it holds training runs;
# the values are the UI's ExperimentKind enum (mlflow/server/js: CUSTOM_MODEL_DEVELOPMENT).
EXPERIMENT_KIND_TAG, TRAINING_KIND = "mlflow.experimentKind", "custom_model_development"
MAX_PARAM_LEN = 6000
_BAD_KEY_CHARS = re.compile(r"[^\w.\- :]")  # MLflow metric names: alphanumerics, _ - . space : and /


def metric_key(*parts: str) -> str:
    """A metric name from parts joined by ``/``; characters MLflow refuses (``+``, ``=`` of variant labels) -> ``_``."""
    return "/".join(_BAD_KEY_CHARS.sub("_", str(p)) for p in parts)


def default_tracking_uri(sweep_dir: Path) -> str:
    """``sqlite:////abs/<sweep_dir>/mlflow.db`` (4 slashes: absolute; relative URIs break inside Ray trials)."""
    return f"sqlite:///{SweepDir(Path(sweep_dir).resolve()).mlflow_db}"


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dict -> ``{"a.b": v}``."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


class Tracker:
    """MLflow access for one sweep.

    Args:
        uri: tracking URI (``sqlite:////abs/mlflow.db`` or ``http://host:5000``).
        experiment: experiment name (created on first use with ``artifact_location``).
        sweep_id: the sweep's stable identity.
        artifact_location: absolute artifact root for a new experiment (ignored for an existing one).
    """

    def __init__(self, uri: str, experiment: str, sweep_id: str, artifact_location: str | None = None):
        self.uri, self.sweep_id = uri, sweep_id
        # A new SQLite store announces its schema set-up at INFO on stderr: routine, not worth a user's attention.
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            self.experiment_id = self.client.create_experiment(experiment, artifact_location=artifact_location)
        else:
            self.experiment_id = exp.experiment_id

    def mark_training_experiment(self) -> None:
        """Tags the experiment so the MLflow UI opens on its runs, not on an empty GenAI overview."""
        self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND_TAG, TRAINING_KIND)

    # ---- runs ------------------------------------------------------------------------------------
    def _find(self, filter_string: str):
        runs = self.client.search_runs([self.experiment_id], filter_string=filter_string, max_results=2,
                                       order_by=["attributes.start_time ASC"])
        return runs[0] if runs else None

    def parent_run(self, name: str, params: Mapping[str, Any], tags: Mapping[str, str]) -> str:
        """Finds or creates the sweep's parent run; returns its id (status set to RUNNING)."""
        run = self._find(f"tags.`{SWEEP_TAG}` = '{self.sweep_id}' and tags.`{ROLE_TAG}` = 'sweep'")
        if run is not None:
            self.client.update_run(run.info.run_id, status="RUNNING")
            return run.info.run_id
        run = self.client.create_run(self.experiment_id, run_name=name,
                                     tags={SWEEP_TAG: self.sweep_id, ROLE_TAG: "sweep", **tags})
        self._log_params(run.info.run_id, params)
        return run.info.run_id

    def close_failed_trial(self, trial: str, reason: str) -> None:
        """Marks a trial's run FAILED with ``reason`` unless it finished (a worker killed with its node cannot)."""
        run = self._find(f"tags.`{SWEEP_TAG}` = '{self.sweep_id}' and tags.`{TRIAL_TAG}` = '{trial}'")
        if run is not None and run.info.status != "FINISHED":
            self.end_run(run.info.run_id, failed_reason=reason)

    def trial_run(self, parent_id: str, trial: str, params: Mapping[str, Any]) -> str:
        """Finds or creates the child run of ``trial`` (so a retried or restored trial continues its own run)."""
        run = self._find(f"tags.`{SWEEP_TAG}` = '{self.sweep_id}' and tags.`{TRIAL_TAG}` = '{trial}'")
        if run is not None:
            self.client.update_run(run.info.run_id, status="RUNNING")
            return run.info.run_id
        run = self.client.create_run(self.experiment_id, run_name=trial, tags={
            SWEEP_TAG: self.sweep_id, TRIAL_TAG: trial, ROLE_TAG: "trial", MLFLOW_PARENT_RUN_ID: parent_id,
            MLFLOW_RUN_NAME: trial})
        self._log_params(run.info.run_id, params)
        return run.info.run_id

    def _log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        flat = [Param(k, str(v)[:MAX_PARAM_LEN]) for k, v in flatten(params).items()]
        for i in range(0, len(flat), 100):  # MLflow caps a batch at 100 params
            self.client.log_batch(run_id, params=flat[i:i + 100])

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int) -> None:
        """One batched call; ``step`` is env steps (DESIGN.md: every x-axis counts env steps)."""
        ts = int(time.time() * 1000)
        batch = [Metric(k, float(v), ts, int(step)) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(run_id, metrics=batch[i:i + 1000])

    def last_step(self, run_id: str, key: str) -> int:
        """Largest step logged for ``key`` in the run (-1 if none)."""
        history = self.client.get_metric_history(run_id, key)
        return max((m.step for m in history), default=-1)

    def tags(self, run_id: str) -> dict[str, str]:
        """The run's tags."""
        return dict(self.client.get_run(run_id).data.tags)

    def set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        """Sets string tags."""
        for k, v in tags.items():
            self.client.set_tag(run_id, k, str(v))

    def end_run(self, run_id: str, failed_reason: str | None = None) -> None:
        """Ends FINISHED, or FAILED with the reason as a tag (never left RUNNING)."""
        if failed_reason is not None:
            self.client.set_tag(run_id, REASON_TAG, failed_reason[:5000])
        status = RunStatus.to_string(RunStatus.FAILED if failed_reason is not None else RunStatus.FINISHED)
        self.client.set_terminated(run_id, status=status)

    # ---- artifacts -------------------------------------------------------------------------------
    def log_artifact(self, run_id: str, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Uploads a file."""
        self.client.log_artifact(run_id, str(path), artifact_path)

    def log_artifacts(self, run_id: str, directory: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Uploads a folder's files."""
        self.client.log_artifacts(run_id, str(directory), artifact_path)

    def log_figure(self, run_id: str, figure, name: str) -> None:
        """Logs a matplotlib figure as an image artifact."""
        self.client.log_figure(run_id, figure, name)

    def record_checksums(self, run_id: str, recorded: Recorded) -> None:
        """Records a finished trial's policy checksums in its run (what the gather step checks snapshots against)."""
        self.set_tags(run_id, {POLICY_SHA_TAG: recorded.policy_sha256, SNAPSHOTS_SHA_TAG: recorded.snapshots_sha256})

    def recorded_checksums(self) -> dict[str, Recorded]:
        """``{trial name: Recorded}`` of this sweep's trial runs that recorded their checksums."""
        return _checksums(self.runs())

    # ---- queries (tests, summaries) --------------------------------------------------------------
    def runs(self) -> list:
        """Every run of this sweep (parent and children)."""
        return self.client.search_runs([self.experiment_id], filter_string=f"tags.`{SWEEP_TAG}` = '{self.sweep_id}'",
                                       max_results=50000)


def _checksums(runs) -> dict[str, Recorded]:
    out = {}
    for r in runs:
        tags = r.data.tags
        if TRIAL_TAG in tags and POLICY_SHA_TAG in tags and SNAPSHOTS_SHA_TAG in tags:
            out[tags[TRIAL_TAG]] = Recorded(tags[POLICY_SHA_TAG], tags[SNAPSHOTS_SHA_TAG])
    return out


def sweep_checksums(uri: str, sweep_id: str) -> dict[str, Recorded]:
    """The recorded checksums of sweep ``sweep_id``'s trials in any experiment of the store at ``uri``."""
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
    client = MlflowClient(tracking_uri=uri)
    ids = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(ids, filter_string=f"tags.`{SWEEP_TAG}` = '{sweep_id}'", max_results=50000) if ids else []
    return _checksums(runs)


def ui_command(uri: str, experiment_id: str | None = None) -> str:
    """The command that opens the MLflow UI on ``uri``, and the address of the experiment's runs.

    MLflow 3.17's UI shows an experiment as its GenAI switch says (remembered per browser, GenAI by default), not
    as the experiment's kind tag says; ``?workflowType=machine_learning`` opens it on its training runs.
    """
    page = f"/#/experiments/{experiment_id}?workflowType=machine_learning" if experiment_id else ""
    if uri.startswith("sqlite:"):
        return (f"{sys.executable} -m mlflow ui --backend-store-uri {uri} --port 5000   "
                f"# then open http://127.0.0.1:5000{page}")
    return f"open {uri.rstrip('/')}{page} in a browser (MLflow tracking server)"
