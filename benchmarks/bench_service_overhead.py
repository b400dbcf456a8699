"""Overhead of the sweep service: wall time of a sweep vs the sum of its trials' training run bare.

Bare = the same RunSpecs trained one after another in this process with ``build_trainer`` and a no-op reporter
(no Ray, no MLflow, no checkpoints, no gather). The sweep is the real CLI (embedded Ray, SQLite MLflow, gather).
The sweep runs trials concurrently (``resources.cpu`` per trial), so a ratio below 1 is possible on >1 core;
the script also prints the ratio against bare time divided by the sweep's concurrency.

Usage: MUJOCO_GL=disable .venv/bin/python benchmarks/bench_service_overhead.py [sweeps/smoke.yaml]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from qed_ray.spec.sweep import load_spec
from qed_ray.rl.trainer import build_trainer


def bare_seconds(spec_path: Path) -> tuple[float, int]:
    """Trains every trial of the spec bare, one after another; returns (seconds, number of trials)."""
    torch.set_num_threads(1)
    runs = load_spec(spec_path).runs()
    t0 = time.perf_counter()
    for run in runs:
        trainer = build_trainer([run], lambda metrics, save: None, None, log=lambda s: None)
        trainer.run()
        trainer.close()
        print(f"  bare {run.name}: done at {time.perf_counter() - t0:.1f} s", flush=True)
    return time.perf_counter() - t0, len(runs)


def sweep_seconds(spec_path: Path, storage: Path) -> float:
    """Wall time of ``python -m qed_ray.sweep`` on a fresh storage folder."""
    # Ray's token auth stays on, as on a cluster: the embedded Ray of the sweep keeps its token private.
    env = {**os.environ, "QED_STORAGE_PATH": str(storage), "MUJOCO_GL": "disable"}
    env.pop("RAY_ADDRESS", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "qed_ray.sweep", str(spec_path)], env=env, capture_output=True,
                          text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"sweep failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return wall


def main() -> None:
    spec_path = Path(sys.argv[1] if len(sys.argv) > 1 else "sweeps/smoke.yaml")
    spec = yaml.safe_load(spec_path.read_text())
    concurrency = max(1, int((os.cpu_count() or 1) // spec.get("resources", {}).get("cpu", 1)))
    bare, n = bare_seconds(spec_path)
    with tempfile.TemporaryDirectory() as storage:
        wall = sweep_seconds(spec_path, Path(storage))
    print(f"\nspec {spec_path}: {n} trials, {os.cpu_count()} CPUs (sweep concurrency {concurrency})")
    print(f"bare training, sum over trials (serial):  {bare:8.1f} s")
    print(f"sweep wall time (Ray + MLflow + gather):   {wall:8.1f} s")
    print(f"ratio sweep wall / bare sum:               {wall / bare:8.2f}")
    print(f"ratio sweep wall / (bare sum / {concurrency}):        {wall / (bare / concurrency):8.2f}")


if __name__ == "__main__":
    main()
