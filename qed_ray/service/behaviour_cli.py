"""``qed-ray visualize SWEEP_DIR --task ...``: the behaviour figure of a finished sweep (paper Fig. 1), drawn
by :mod:`qed_ray.analysis.behaviour`, and its upload to the sweep's MLflow parent run."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from qed_ray.spec import cli_help
from qed_ray.analysis.behaviour import (COLORMAP, RenderError, configure_rendering, frame_steps, run,
                                        select_snapshots)
from qed_ray.records.layout import SweepDir
from qed_ray.records.checkpoint import CheckpointError
from qed_ray.records.sweep import sweep_id as read_sweep_id
from qed_ray.service.mlflow.tracking_uri import default_tracking_uri, given_uri


def log_to_mlflow(paths: Sequence[Path], sweep_dir: Path, uri: str | None, experiment: str) -> str:
    """Uploads ``paths`` under ``behaviour/`` of the sweep's MLflow parent run; returns the run id."""
    from qed_ray.service.mlflow.tracking import ROLE_TAG, Tracker, artifact_location  # MLflow: for the upload alone

    sweep_id = read_sweep_id(SweepDir(sweep_dir))  # SpecError (a ValueError) names a missing or damaged sweep.json
    uri = uri or default_tracking_uri(sweep_dir)
    layout = SweepDir(Path(sweep_dir).resolve())
    tracker = Tracker(uri, experiment, sweep_id, artifact_location(uri, layout))  # relinks a moved folder's store
    # Look the parent up instead of Tracker.parent_run, which would mark a finished sweep RUNNING again.
    parents = [r for r in tracker.runs() if r.data.tags.get(ROLE_TAG) == "sweep"]
    if not parents:
        raise LookupError(f"--experiment: no parent run of sweep {sweep_id} in experiment {experiment!r} at {uri}; "
                          f"pass --tracking-uri / --experiment, or --no-mlflow")
    run_id = min(parents, key=lambda r: r.info.start_time).info.run_id
    for path in paths:
        tracker.log_artifact(run_id, path, "behaviour")
    return run_id


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if int(text) < low:
            raise argparse.ArgumentTypeError(f"need an integer >= {low}, got {text}")
        return int(text)
    return parse


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = cli_help.parser("qed-ray visualize", "the behaviour figure of a finished sweep (paper Fig. 1)", (
        "qed-ray visualize results/smoke --task cartpole-balance   # te and QED seeds side by side",
        "qed-ray visualize results/dmc18 --task cheetah-run --variants te qed0.2 --no-mlflow"))
    p.add_argument("sweep_dir", type=Path, help="a finished sweep folder (holds policies/ and sweep.json)")
    p.add_argument("--task", required=True, help="task of the figure, e.g. cheetah-run")
    p.add_argument("--agent", default="sac_ln", help="agent name (default sac_ln)")
    p.add_argument("--variants", nargs="+", help="temperature variants (default: all of the task's, te first)")
    p.add_argument("--steps", type=_int_at_least(1), default=25, help="decisions per rollout (paper: 25)")
    p.add_argument("--frames", type=_int_at_least(1), default=6, help="evenly spaced frames per seed in the PNG")
    p.add_argument("--seed", type=_int_at_least(0), default=0, help="env seed of the shared initial state")
    p.add_argument("--size", type=_int_at_least(16), default=96, help="frame height and width in pixels")
    p.add_argument("--out", type=Path, help="output folder (default <sweep_dir>/gather/behaviour)")
    p.add_argument("--no-mlflow", action="store_true", help="do not log the outputs to the sweep's MLflow run")
    p.add_argument("--tracking-uri", help="MLflow URI (default $MLFLOW_TRACKING_URI, else sweep_dir/mlflow.db)")
    p.add_argument("--experiment", help="MLflow experiment (default: the sweep folder's name)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Returns 0, or 2 with a one-line error on bad input or a missing renderer."""
    args = parse_args(argv)
    t0 = time.perf_counter()
    try:
        selected = select_snapshots(args.sweep_dir, args.task, args.agent, args.variants)
        shown = frame_steps(args.steps, args.frames)
        uri = None if args.no_mlflow else given_uri(args.tracking_uri)  # refused before any rollout, not after
        backend = configure_rendering(os.environ)  # before the rollouts import dm_control
        import torch

        torch.set_num_threads(1)  # batch-1 rollouts: more threads only add overhead
        meta = {"task": args.task, "agent": args.agent, "env_seed": args.seed, "steps": args.steps,
                "frame_steps": shown.tolist(), "size": args.size, "gl_backend": backend, "colormap": COLORMAP}
        paths = run(args, selected, shown, meta)
        if not args.no_mlflow:
            sweep_dir = args.sweep_dir.resolve()
            run_id = log_to_mlflow(paths, sweep_dir, uri, args.experiment or sweep_dir.name)
            print(f"logged {len(paths)} files to MLflow run {run_id} under behaviour/")
    except (ValueError, FileNotFoundError, LookupError, CheckpointError, RenderError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(map(str, paths)) + f"\ndone in {time.perf_counter() - t0:.1f}s (MUJOCO_GL={backend})")
    return 0
