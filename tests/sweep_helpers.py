"""Helpers for the end-to-end sweep tests: tiny specs, running the real CLI, reading the real MLflow store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from qed_ray.layout import SweepDir

ROOT = Path(__file__).resolve().parents[1]


def tiny_spec(tmp_path: Path, name: str, **overrides) -> Path:
    """Writes a very small sweep spec (tiny nets, short training) and returns its path."""
    spec = {
        "name": name, "tasks": ["cartpole-balance"], "seeds": 2,
        "agents": [{"name": "sac_ln", "overrides": {"hidden": 16, "batch_size": 16},
                    "temperatures": [{"kind": "te"}]}],
        "train": {"env_steps": 2000, "eval_every": 1000, "eval_episodes": 1, "warmup_decisions": 100},
        "final_eval": {"episodes": 2, "action_rollouts": 2, "action_steps": 20, "curve_episodes": 1,
                       "bootstrap_reps": 200},
        "resources": {"cpu": 1, "gpu": 0},
        "storage_path": str(tmp_path / "results"),
    }
    spec.update(overrides)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def cli_env(**extra) -> dict:
    """Environment of a sweep or Ray subprocess: Ray token auth with the session's throwaway token (conftest.py),
    headless MuJoCo, no inherited cluster address, tracking server or storage override."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "QED_STORAGE_PATH",
                                                               "RAY_AUTH_TOKEN_PATH")}
    env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.environ["RAY_AUTH_TOKEN"], "MUJOCO_GL": "disable",
                "RAY_USAGE_STATS_ENABLED": "0", **extra})
    return env


def run_sweep_cli(spec: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """Runs ``python -m qed_ray.sweep SPEC`` as a user would."""
    return subprocess.run([sys.executable, "-m", "qed_ray.sweep", str(spec), *args], cwd=ROOT, env=cli_env(),
                          capture_output=True, text=True, timeout=timeout)


def sweep_runs(sweep_dir: Path, experiment: str):
    """All MLflow runs of the sweep in ``sweep_dir`` (SQLite store), via the project's tracker."""
    from qed_ray.tracking import Tracker

    layout = SweepDir(sweep_dir)
    state = json.loads(layout.state_file.read_text())
    tracker = Tracker(f"sqlite:///{layout.mlflow_db}", experiment, state["sweep_id"])
    return tracker, tracker.runs()


def done_markers(sweep_dir: Path) -> list[Path]:
    """The DONE markers of the sweep's finished trials, sorted (none before any trial saved a policy)."""
    layout = SweepDir(sweep_dir)
    if not layout.policies_root.is_dir():
        return []
    return sorted(p for p in (layout.done_marker(t.name) for t in layout.trials()) if p.exists())
