"""MLflow runs of a sweep (parent, group, trial and re-analysis runs) and their artifacts, found by their tags and
driven through an explicit ``MlflowClient`` (never MLflow's process-global active run): docs/design.md, resume item 7.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from mlflow.entities import Metric, Param, RunStatus
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

from qed_ray.records.layout import SweepDir
from qed_ray.records.digests import Recorded
from qed_ray.records.run import HistoryEntry
from qed_ray.service.mlflow.mlflow_view import SHARED_VIEW_TAG, group_view_state, view_key
from qed_ray.service.mlflow.relink import follow_move, own_store
from qed_ray.service.mlflow.tracking_uri import default_tracking_uri  # noqa: F401 - API (defined MLflow-free)

from qed_ray.service.mlflow.tags import (DIGEST_TAG, GROUP_TAG, KEY_ID_TAG, MAC_TAG, NODES_TAG,  # noqa: F401 - API
                                  PACK_SIZE_TAG, PACK_TAG, REANALYSIS_TAG, REASON_TAG, ROLE_TAG, SWEEP_TAG, TRIAL_TAG,
                                  UNVERIFIED_TAG, run_name, trial_tags)
# MLflow 3's UI opens an experiment on its GenAI overview ("Traces") unless this tag says it holds training runs;
# the values are the UI's ExperimentKind enum (mlflow/server/js: CUSTOM_MODEL_DEVELOPMENT).
EXPERIMENT_KIND_TAG, TRAINING_KIND = "mlflow.experimentKind", "custom_model_development"
STEP_KEY = "eval/return_mean"  # logged at every evaluation: its last step is how far a run's metrics got
MAX_PARAM_LEN = 6000
# Runs per search call. MLflow answers at most max_results runs per call (50,000 at most) while a sweep may hold
# 100,000 trials (qed_ray.spec.sweep.MAX_TRIALS): every search of a sweep's runs follows the page tokens to the end.
SEARCH_PAGE = 10_000
LOCAL_SCHEMES = ("sqlite:", "file:")
_BAD_KEY_CHARS = re.compile(r"[^\w.\- :]")  # MLflow metric names: alphanumerics, _ - . space : and /


def metric_key(*parts: str) -> str:
    """A metric name from parts joined by ``/``; characters MLflow refuses (``+``, ``=`` of variant labels) -> ``_``."""
    return "/".join(_BAD_KEY_CHARS.sub("_", str(p)) for p in parts)


def artifact_location(uri: str, layout: SweepDir) -> str | None:
    """Where a new experiment keeps artifacts: the sweep folder for a local store (``sqlite:``/``file:``), else
    None, so that a tracking server decides (its proxied artifact store) and clients never write to local disk."""
    return str(layout.mlartifacts) if uri.startswith(LOCAL_SCHEMES) else None


def limit_http_retries(max_retries: int = 2, timeout_s: int = 20) -> None:
    """Bounds how long one MLflow HTTP call may block this process (unless the user set these variables): MLflow's
    defaults (7 retries, 120 s timeouts) would stall training for minutes per call while a server is down."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(max_retries))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(timeout_s))


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
    """MLflow access for one sweep. ``artifact_location`` is a new experiment's artifact root; an existing experiment
    of the sweep folder's own store whose root lies in another folder (the folder was moved or copied) is relinked
    first (:mod:`qed_ray.service.mlflow.relink`)."""

    def __init__(self, uri: str, experiment: str, sweep_id: str, artifact_location: str | None = None,
                 page_size: int = SEARCH_PAGE):
        self.uri, self.experiment, self.sweep_id, self.page_size = uri, experiment, sweep_id, page_size
        # A new SQLite store announces its schema set-up at INFO on stderr: routine, not worth a user's attention.
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            self.experiment_id = self.client.create_experiment(experiment, artifact_location=artifact_location)
        else:
            self.experiment_id = exp.experiment_id
            if artifact_location is not None and exp.artifact_location != artifact_location:
                _follow_move(uri, Path(artifact_location), sweep_id)

    def mark_training_experiment(self) -> None:
        """Tags the experiment so the MLflow UI opens on its runs, not on an empty GenAI overview."""
        self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND_TAG, TRAINING_KIND)

    def share_group_view(self, parent_id: str) -> None:
        """Stores the sweep's group view on the experiment as an MLflow 3 shared view, which the UI applies in any
        browser when its address carries ``viewStateShareKey`` (:func:`.mlflow_view.runs_page`)."""
        self.client.set_experiment_tag(self.experiment_id, f"{SHARED_VIEW_TAG}{view_key(self.sweep_id)}",
                                       json.dumps(group_view_state(parent_id)))

    # ---- runs ------------------------------------------------------------------------------------
    def _find(self, filter_string: str):
        runs = self.client.search_runs([self.experiment_id], filter_string=filter_string, max_results=2,
                                       order_by=["attributes.start_time ASC"])
        return runs[0] if runs else None

    def reopen(self, run) -> str:
        self.client.update_run(run.info.run_id, status="RUNNING")
        if REASON_TAG in run.data.tags:
            self.client.delete_tag(run.info.run_id, REASON_TAG)
        return run.info.run_id

    def parent_run(self, name: str, params: Mapping[str, Any], tags: Mapping[str, str]) -> str:
        run = self._find(f"tags.`{SWEEP_TAG}` = '{self.sweep_id}' and tags.`{ROLE_TAG}` = 'sweep'")
        if run is not None:
            return self.reopen(run)
        run = self.client.create_run(self.experiment_id, run_name=name,
                                     tags={SWEEP_TAG: self.sweep_id, ROLE_TAG: "sweep", **tags})
        self._log_params(run.info.run_id, params)
        return run.info.run_id

    def trial_runs(self) -> dict[str, Any]:
        runs = search_all_runs(self.client, [self.experiment_id], f"tags.`{SWEEP_TAG}` = '{self.sweep_id}' and "
                                                                  f"tags.`{ROLE_TAG}` = 'trial'", self.page_size)
        return {r.data.tags[TRIAL_TAG]: r for r in runs if TRIAL_TAG in r.data.tags}

    def trial_run(self, parent_id: str, trial: str, params: Mapping[str, Any],
                  tags: Mapping[str, Any] | None = None) -> str:
        """Finds (and reopens) or creates the child run of ``trial``; its :func:`trial_tags` and ``tags`` (a pack's)
        are set on it either way (a run an older version created gets them when it is reopened)."""
        tags = {**trial_tags(trial), **{k: str(v) for k, v in (tags or {}).items()}}
        return self._child(parent_id, f"tags.`{TRIAL_TAG}` = '{trial}'",
                           {TRIAL_TAG: trial, ROLE_TAG: "trial", **tags}, params)

    def reanalysis_run(self, parent_id: str, settings: str, params: Mapping[str, Any]) -> str:
        """Finds (and reopens) or creates the child run of a re-analysis with ``settings``: one run per settings."""
        return self._child(parent_id, f"tags.`{ROLE_TAG}` = 'reanalysis' and tags.`{REANALYSIS_TAG}` = '{settings}'",
                           {ROLE_TAG: "reanalysis", REANALYSIS_TAG: settings,
                            MLFLOW_RUN_NAME: f"reanalysis {settings}"}, params)

    def group_run(self, parent_id: str, tags: Mapping[str, str]) -> str:
        """Finds (and reopens) or creates the run of one group under ``parent_id`` (the sweep's or a re-analysis's)."""
        return self._child(parent_id, f"tags.`{ROLE_TAG}` = 'group' and tags.`{GROUP_TAG}` = '{tags[GROUP_TAG]}' and "
                                      f"tags.`{MLFLOW_PARENT_RUN_ID}` = '{parent_id}'",
                           {ROLE_TAG: "group", **tags}, {})

    def adopt(self, parent_id: str, runs: Sequence) -> None:
        """Makes ``parent_id`` the parent of ``runs``: MLflow nests runs by the ``mlflow.parentRunId`` tag alone."""
        for run in runs:
            if run.data.tags.get(MLFLOW_PARENT_RUN_ID) != parent_id:
                self.client.set_tag(run.info.run_id, MLFLOW_PARENT_RUN_ID, parent_id)

    def _child(self, parent_id: str, match: str, tags: Mapping[str, str], params: Mapping[str, Any]) -> str:
        run = self._find(f"tags.`{SWEEP_TAG}` = '{self.sweep_id}' and {match}")
        if run is not None:
            if any(run.data.tags.get(k) != v for k, v in tags.items()):
                self.set_tags(run.info.run_id, tags)
            return self.reopen(run)
        run = self.client.create_run(self.experiment_id, run_name=tags[MLFLOW_RUN_NAME], tags={
            SWEEP_TAG: self.sweep_id, MLFLOW_PARENT_RUN_ID: parent_id, **tags})
        self._log_params(run.info.run_id, params)
        return run.info.run_id

    def _log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        flat = [Param(k, str(v)[:MAX_PARAM_LEN]) for k, v in flatten(params).items()]
        for i in range(0, len(flat), 100):  # MLflow caps a batch at 100 params
            self.client.log_batch(run_id, params=flat[i:i + 100])

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int) -> None:
        """One batched call; ``step`` is env steps (every x-axis counts env steps: docs/definitions.md)."""
        ts = int(time.time() * 1000)
        batch = [Metric(k, float(v), ts, int(step)) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(run_id, metrics=batch[i:i + 1000])

    def log_history(self, run_id: str, entries: Sequence[HistoryEntry], after_step: int) -> int:
        """Logs the history entries past ``after_step`` in batches of whole evaluations; returns the last step now
        logged. Each point keeps the time it was recorded, so logging it again adds nothing (MLflow drops a metric
        identical in key, step, time and value)."""
        todo = sorted((e for e in entries if e.env_steps > after_step), key=lambda e: e.env_steps)
        batch: list[Metric] = []
        for entry in todo:
            metrics = [Metric(k, float(v), entry.time_ms, entry.env_steps) for k, v in entry.metrics.items()]
            if batch and len(batch) + len(metrics) > 1000:  # MLflow's cap per batch
                self.client.log_batch(run_id, metrics=batch)
                batch = []
            batch += metrics
        if batch:
            self.client.log_batch(run_id, metrics=batch)
        return todo[-1].env_steps if todo else after_step

    def last_step(self, run_id: str, key: str = STEP_KEY) -> int:
        history = self.client.get_metric_history(run_id, key)
        return max((m.step for m in history), default=-1)

    def tags(self, run_id: str) -> dict[str, str]:
        return dict(self.client.get_run(run_id).data.tags)

    def set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        for k, v in tags.items():
            self.client.set_tag(run_id, k, str(v))

    def end_run(self, run_id: str, failed_reason: str | None = None, killed: bool = False) -> None:
        """Ends FINISHED, FAILED with the reason as a tag, or KILLED (stopped before the end, to be resumed)."""
        if failed_reason is not None:
            self.client.set_tag(run_id, REASON_TAG, failed_reason[:5000])
        status = RunStatus.FAILED if failed_reason is not None else RunStatus.KILLED if killed else RunStatus.FINISHED
        self.client.set_terminated(run_id, status=RunStatus.to_string(status))

    # ---- artifacts -------------------------------------------------------------------------------
    def log_artifact(self, run_id: str, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), artifact_path)

    def log_artifacts(self, run_id: str, directory: str | os.PathLike, artifact_path: str | None = None) -> None:
        self.client.log_artifacts(run_id, str(directory), artifact_path)

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self.client.log_text(run_id, text, artifact_file)

    def recorded_digests(self) -> dict[str, Recorded]:
        return _digests(self.runs())

    def runs(self) -> list:
        return search_all_runs(self.client, [self.experiment_id], f"tags.`{SWEEP_TAG}` = '{self.sweep_id}'",
                               self.page_size)


def _every_page(search: Callable, page_size: int) -> list:
    found, token = [], None
    while True:
        page = search(max_results=page_size, page_token=token)
        found.extend(page)
        token = page.token
        if not token:
            return found


def search_all_runs(client: MlflowClient, experiment_ids: list[str], filter_string: str,
                    page_size: int = SEARCH_PAGE) -> list:
    return _every_page(lambda **page: client.search_runs(experiment_ids, filter_string=filter_string, **page),
                       page_size)


def _follow_move(uri: str, artifact_location: Path, sweep_id: str) -> None:
    layout = SweepDir(artifact_location.parent)
    if layout.mlartifacts == artifact_location and own_store(uri, layout):
        follow_move(layout, sweep_id)


def pack_tags(pack: str, size: int) -> dict[str, str]:
    """The run tags of a seed run trained in a pack: the pack's name and size."""
    return {PACK_TAG: pack, PACK_SIZE_TAG: str(size)}


def digest_tags(recorded: Recorded) -> dict[str, str]:
    """The run tags by which a trial's worker records the signed digest of its files (set by the worker alone)."""
    return {DIGEST_TAG: recorded.digest, MAC_TAG: recorded.mac, KEY_ID_TAG: recorded.key_id}


def _digests(runs) -> dict[str, Recorded]:
    out = {}
    for r in runs:
        tags = r.data.tags
        if TRIAL_TAG in tags and all(t in tags for t in (DIGEST_TAG, MAC_TAG, KEY_ID_TAG)):
            out[tags[TRIAL_TAG]] = Recorded(tags[DIGEST_TAG], tags[MAC_TAG], tags[KEY_ID_TAG])
    return out


def _sweep_runs(uri: str, filter_string: str, page_size: int = SEARCH_PAGE) -> tuple[MlflowClient, list]:
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
    client = MlflowClient(tracking_uri=uri)
    # Every experiment: MLflow lists 1,000 a call unless told otherwise.
    ids = [e.experiment_id for e in _every_page(client.search_experiments, page_size)]
    return client, search_all_runs(client, ids, filter_string, page_size) if ids else []


def sweep_digests(uri: str, sweep_id: str, page_size: int = SEARCH_PAGE) -> dict[str, Recorded]:
    return _digests(_sweep_runs(uri, f"tags.`{SWEEP_TAG}` = '{sweep_id}'", page_size)[1])


def open_sweep(uri: str, sweep_id: str) -> tuple[Tracker, Any] | None:
    """The tracker of the experiment that holds sweep ``sweep_id``'s parent run, and that run (None if the store
    at ``uri`` has none); for a re-analysis, which knows the folder but not the experiment."""
    client, runs = _sweep_runs(uri, f"tags.`{SWEEP_TAG}` = '{sweep_id}' and tags.`{ROLE_TAG}` = 'sweep'")
    if not runs:
        return None
    experiment = client.get_experiment(runs[0].info.experiment_id).name
    return Tracker(uri, experiment, sweep_id), runs[0]


class TrialRun:
    """A trial's child run, kept in step with the trial's history on disk (the buffer); nothing here raises: a failed
    call prints one warning per outage and returns False, and the next :meth:`sync` catches up. The run is found or
    created on the first call that reaches the server, its ``qed.node_ids`` tag extended by ``node_id``."""

    def __init__(self, uri: str, experiment: str, sweep_id: str, parent_run_id: str, trial: str,
                 params: Mapping[str, Any], node_id: str | None = None,
                 log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
                 run_tags: Mapping[str, Any] | None = None):
        self.uri, self.experiment, self.sweep_id, self.parent_run_id = uri, experiment, sweep_id, parent_run_id
        self.trial, self.params, self.node_id, self.log = trial, params, node_id, log
        self.run_tags = dict(run_tags or {})
        self.tracker: Tracker | None = None
        self.run_id: str | None = None
        self.logged_up_to = -1
        self.pending_tags: dict[str, str] = {}
        self.down = False

    def _connect(self) -> Tracker:
        if self.tracker is None:
            tracker = Tracker(self.uri, self.experiment, self.sweep_id)
            run_id = tracker.trial_run(self.parent_run_id, self.trial, self.params, self.run_tags)
            if self.node_id:
                seen = tracker.tags(run_id).get(NODES_TAG, "")
                tracker.set_tags(run_id, {NODES_TAG: ",".join(filter(None, [seen, self.node_id]))})
            self.logged_up_to = tracker.last_step(run_id)
            self.tracker, self.run_id = tracker, run_id
        return self.tracker

    def sync(self, history: Sequence[HistoryEntry], tags: Mapping[str, Any] | None = None) -> bool:
        """Logs the history entries MLflow does not have yet and any pending tags; False if MLflow failed."""
        self.pending_tags.update({k: str(v) for k, v in (tags or {}).items()})
        try:
            tracker = self._connect()
            if self.pending_tags:
                tracker.set_tags(self.run_id, self.pending_tags)
                self.pending_tags = {}
            self.logged_up_to = tracker.log_history(self.run_id, history, self.logged_up_to)
        except Exception as e:  # noqa: BLE001 - any failure of the tracking store: keep training, retry later
            if not self.down:
                self.log(f"WARNING: MLflow at {self.uri} failed for {self.trial} ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:300]}); training goes on, metrics are kept and logged "
                         f"when it answers again")
            self.down = True
            return False
        if self.down:
            self.log(f"MLflow at {self.uri} answers again: {self.trial} logged up to env step {self.logged_up_to}")
            self.down = False
        return True

    def tags(self) -> dict[str, str] | None:
        try:
            tracker = self._connect()
            return tracker.tags(self.run_id)
        except Exception:  # noqa: BLE001 - as in sync
            return None

    def finish(self, history: Sequence[HistoryEntry], failed_reason: str | None = None, killed: bool = False,
               tags: Mapping[str, Any] | None = None, timeout_s: float = 300.0, retry_s: float = 5.0) -> bool:
        """Syncs (with ``tags``) and ends the run (FINISHED, FAILED with the reason, or KILLED), retrying for up to
        ``timeout_s``; False if MLflow stayed unreachable (the driver syncs the run again at the sweep's end)."""
        deadline = time.monotonic() + timeout_s
        tags = dict(tags or {})
        while True:
            if self.sync(history, tags):
                try:
                    self.tracker.end_run(self.run_id, failed_reason=failed_reason, killed=killed)
                    return True
                except Exception as e:  # noqa: BLE001 - as in sync
                    self.log(f"WARNING: MLflow could not end the run of {self.trial}: {type(e).__name__}: {e}")
            if time.monotonic() + retry_s > deadline:
                self.log(f"WARNING: gave up ending the MLflow run of {self.trial} after {timeout_s:.0f} s; its "
                         f"metrics are in the sweep folder and are logged at the next sweep start")
                return False
            time.sleep(retry_s)
