"""Helpers for the end-to-end sweep tests: tiny specs, running the real CLI, reading the real MLflow store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kit import free_port, sweep_file
from qed_ray.records.layout import SweepDir

ROOT = Path(__file__).resolve().parents[1]


# The tiny sweeps' training: 2,000 env steps, an evaluation (and checkpoint) every 1,000, a decision every 10 env
# steps (200 decisions and 180 updates a seed: every path of a trial, at a fifth of frame skip 2's compute).
TINY_TRAIN = {"env_steps": 2000, "eval_every": 1000, "eval_episodes": 1, "warmup_decisions": 20, "frame_skip": 10}


# The tiny sweeps over kit's sweep: batches of 16, TINY_TRAIN, a small final evaluation, no GPU.
TINY_SWEEP = {"agents": [{"name": "sac_ln", "overrides": {"hidden": 16, "batch_size": 16},
                          "temperatures": [{"kind": "te"}]}],
              "train": TINY_TRAIN,
              "final_eval": {"episodes": 2, "action_rollouts": 2, "action_steps": 20, "curve_episodes": 1,
                             "bootstrap_reps": 200},
              "resources": {"cpu": 1, "gpu": 0}}


def tiny_spec(tmp_path: Path, name: str, **overrides) -> Path:
    """Writes a very small sweep spec (tiny nets, short training) to ``tmp_path/<name>.yaml`` and returns its path."""
    return sweep_file(tmp_path / f"{name}.yaml", TINY_SWEEP, {"name": name, "storage_path": str(tmp_path / "results")},
                      **overrides)


def cli_env(**extra) -> dict:
    """Environment of a sweep or Ray subprocess: Ray token auth with the session's throwaway token (conftest.py),
    headless MuJoCo, no inherited cluster address, tracking server or storage override."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "QED_STORAGE_PATH",
                                                               "RAY_AUTH_TOKEN_PATH")}
    env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.environ["RAY_AUTH_TOKEN"], "MUJOCO_GL": "disable",
                "RAY_USAGE_STATS_ENABLED": "0", **extra})
    return env


def run_sweep_cli(spec: Path, *args: str, timeout: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs ``python -m qed_ray.service.sweep SPEC`` as a user would (``env``: a whole environment, default :func:`cli_env`)."""
    return subprocess.run([sys.executable, "-m", "qed_ray.sweep", str(spec), *args], cwd=ROOT, env=env or cli_env(),
                          capture_output=True, text=True, timeout=timeout)


def start_sweep(spec: Path, log: Path, env: dict | None = None) -> subprocess.Popen:
    """Starts ``python -m qed_ray.sweep SPEC`` in its own session (so a signal can reach its whole process group, as
    Ctrl-C in a terminal does), output to ``log``."""
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "qed_ray.sweep", str(spec)], cwd=ROOT, env=env or cli_env(),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(condition, timeout: float, what: str, poll_s: float = 0.2, alive: subprocess.Popen | None = None):
    """Polls ``condition()`` until it returns something truthy (returned); fails naming ``what`` on timeout or when
    the ``alive`` process ended first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        assert alive is None or alive.poll() is None, f"the process ended (rc {alive.returncode}) before: {what}"
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for: {what}")


class MlflowServer:
    """A real ``mlflow server`` on localhost (SQLite backend and proxied artifacts under ``root``, or the backend
    store ``store_uri``) that a test can stop and start again, on the same port or a new one, keeping its store.
    Its process group is its own."""

    def __init__(self, root: Path, store_uri: str | None = None):
        self.root, self.port, self.proc = root, None, None
        self.store_uri = store_uri or f"sqlite:///{root / 'store.db'}"
        root.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def artifacts(self) -> Path:
        """Where the server stores artifacts (clients upload through it)."""
        return self.root / "artifacts"

    def start(self, port: int | None = None) -> "MlflowServer":
        """Starts the server (on ``port``, else a free one) and waits for its health endpoint."""
        self.port = port or free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        env["MLFLOW_BACKEND_STORE_URI"] = self.store_uri
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # no job runner: starts several seconds sooner
        with open(self.root / "server.log", "a") as log:
            self.proc = subprocess.Popen([str(Path(sys.executable).with_name("mlflow")), "server", "--host",
                                          "127.0.0.1", "--port", str(self.port), "--workers", "1",
                                          "--artifacts-destination", str(self.artifacts)],
                                         env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(self._healthy, 180, f"mlflow server on port {self.port}", poll_s=0.5, alive=self.proc)
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                return response.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        """Stops the server and everything in its process group (SIGTERM, then SIGKILL for whatever is left)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # workers that outlived the server
        except ProcessLookupError:
            pass
        self.proc.wait()


@dataclass(frozen=True)
class RestRun:
    """A run as MLflow's REST API lists it (``runs/search``): its tags and its metrics' latest values as dicts."""

    id: str
    name: str
    status: str
    tags: dict[str, str]
    metrics: dict[str, float]


def rest(url: str, endpoint: str, body: dict | None = None) -> dict:
    """One call of the MLflow REST API of the server at ``url`` in plain HTTP, as the UI or any HTTP client makes
    it: ``GET /api/2.0/mlflow/<endpoint>`` without ``body``, a JSON ``POST`` with it."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}/api/2.0/mlflow/{endpoint}", data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def rest_experiment(url: str, name: str) -> tuple[str, dict[str, str]]:
    """The id and tags of the experiment named ``name`` (``GET experiments/get-by-name``)."""
    exp = rest(url, "experiments/get-by-name?" + urllib.parse.urlencode({"experiment_name": name}))["experiment"]
    return exp["experiment_id"], {t["key"]: t["value"] for t in exp.get("tags", [])}


def rest_runs(url: str, experiment: str, filter_string: str = "") -> list[RestRun]:
    """The runs of the experiment named ``experiment`` that ``filter_string`` selects (``POST runs/search``, page
    by page)."""
    body, runs = {"experiment_ids": [rest_experiment(url, experiment)[0]], "filter": filter_string,
                  "max_results": 1000}, []
    while True:
        page = rest(url, "runs/search", body)
        runs += [RestRun(r["info"]["run_id"], r["info"]["run_name"], r["info"]["status"],
                         {t["key"]: t["value"] for t in r["data"].get("tags", [])},
                         {m["key"]: m["value"] for m in r["data"].get("metrics", [])}) for r in page.get("runs", [])]
        if not page.get("next_page_token"):
            return runs
        body["page_token"] = page["next_page_token"]


def sweep_runs(sweep_dir: Path, experiment: str, uri: str | None = None):
    """All MLflow runs of the sweep in ``sweep_dir`` (its SQLite store, or the tracking server at ``uri``), via the
    project's tracker."""
    from qed_ray.service.mlflow.tracking import Tracker

    layout = SweepDir(sweep_dir)
    state = json.loads(layout.state_file.read_text())
    tracker = Tracker(uri or f"sqlite:///{layout.mlflow_db}", experiment, state["sweep_id"])
    return tracker, tracker.runs()


def done_markers(sweep_dir: Path) -> list[Path]:
    """The DONE markers of the sweep's finished trials, sorted (none before any trial saved a policy)."""
    layout = SweepDir(sweep_dir)
    if not layout.policies_root.is_dir():
        return []
    return sorted(p for p in (layout.done_marker(t.name) for t in layout.trials()) if p.exists())
