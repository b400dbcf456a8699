"""Single-run CLI (the run's objects are built by :func:`qed_ray.trainer.build_trainer`).

``python -m qed_ray.train --task cartpole-balance --agent sac_ln --temperature qed --k 0.2 --seed 0
--env-steps 20000 --out DIR`` trains, checkpointing into ``DIR/checkpoint`` at every evaluation; running it
again with the same DIR resumes from that checkpoint. ``DIR/summary.json`` holds the final figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from pydantic import ValidationError

from qed_ray.checkpoint import MANIFEST_FILE, CheckpointError, replace_dir
from qed_ray.config import RunSpec, format_validation_error
from qed_ray.flags import Flag, add_run_flags, settings_from_args
from qed_ray.spec import SpecError, load_yaml
from qed_ray.trainer import DivergenceError, build_trainer


HEARTBEAT_S = 15.0  # seconds between progress lines before and between evaluations


class DirReporter:
    """CLI reporter: one checkpoint folder (atomically replaced), ``metrics.jsonl`` and a progress line."""

    def __init__(self, out: Path, total_env_steps: int):
        self.out, self.total = out, total_env_steps

    def __call__(self, metrics: dict[str, float], save) -> None:
        staging = Path(tempfile.mkdtemp(prefix=".checkpoint-", dir=self.out))
        try:
            save(staging)
            replace_dir(staging, self.out / "checkpoint")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        self._progress(metrics)

    def _progress(self, m: dict[str, float]) -> None:
        steps = int(m["env_steps"])
        alpha = m.get("alpha/actor_mean", float("nan"))
        print(f"[{steps:>9,d}/{self.total:,d} env steps] eval return {m['eval/return_mean']:7.1f} "
              f"± {m['eval/return_std']:5.1f}  alpha {alpha:.4f}  {m['perf/updates_per_s']:6.1f} upd/s  "
              f"ETA {format_eta(m.get('perf/eta_s'))}", flush=True)

    def heartbeat(self, h: dict) -> None:
        """A progress line between evaluations (the trainer calls it at the start and every ``heartbeat_s``)."""
        phase = "warm-up (uniform random actions)" if h["warmup"] else "training"
        print(f"[{h['env_steps']:>9,d}/{h['total_env_steps']:,d} env steps] {phase}, "
              f"{h['wall_s'] / 60:.1f} min so far, ETA {format_eta(h['eta_s'])}", flush=True)


def format_eta(seconds: float | None) -> str:
    """``12.3 min`` (warm-up, training and evaluation time left), or a note while a cost is still unmeasured."""
    if seconds is None or seconds != seconds:
        return "after the first updates"
    return f"{seconds / 60:.1f} min"


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[Flag]]:
    """Command-line flags: one per RunSpec setting, help and defaults read from the models (:mod:`qed_ray.flags`)."""
    p = argparse.ArgumentParser(prog="python -m qed_ray.train", description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, help="YAML file with RunSpec settings (flags given override it)")
    p.add_argument("--out", type=Path, required=True, help="run folder: checkpoint, metrics.jsonl, summary.json")
    flags = add_run_flags(p)
    return p.parse_args(argv), flags


def spec_from_args(args: argparse.Namespace, flags: list[Flag]) -> RunSpec:
    """Merges ``--config`` YAML and flags into one validated RunSpec (raises SpecError or ValidationError)."""
    raw = load_yaml(args.config) if args.config else {}
    if not isinstance(raw, dict):
        raise SpecError(f"--config: {args.config} does not hold a mapping of RunSpec settings")
    try:
        raw = settings_from_args(args, flags, raw)
    except ValueError as e:
        raise SpecError(str(e)) from None
    if "task" not in raw:
        raise SpecError("task: required (--task, or 'task' in --config)")
    spec = RunSpec.model_validate(raw)
    if spec.train.budget_problem():
        raise SpecError(f"train.{spec.train.budget_problem()}")
    if "env_steps" not in raw.get("train", {}):
        print(f"note: --env-steps not given: training for the default {spec.train.env_steps:,} env steps "
              f"(the paper's budget)", flush=True)
    return spec


def run(spec: RunSpec, out: Path) -> dict:
    """Trains ``spec`` in ``out`` (resuming from ``out/checkpoint``) and writes ``out/summary.json``."""
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.json").write_text(spec.model_dump_json(indent=1))
    reporter = DirReporter(out, spec.train.env_steps)
    trainer = build_trainer(spec, reporter, replay_dir=out / "replay",
                            log=lambda line: print(line, file=sys.stderr) if "WARNING" in line else None,
                            heartbeat=reporter.heartbeat, heartbeat_s=HEARTBEAT_S)
    ckpt = out / "checkpoint"
    if (ckpt / MANIFEST_FILE).exists():
        m = trainer.restore(ckpt)
        print(f"resumed {spec.name} from {ckpt} at env step {m['env_steps']:,d}", flush=True)
    status, reason = "finished", None
    try:
        summary = trainer.run()
    except DivergenceError as e:
        status, reason = "diverged", str(e)
        summary = {**trainer.summary(), "status": status, "reason": reason}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if status != "finished":
        print(f"run stopped: {reason}", file=sys.stderr, flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    """Entry point; exit code 0 finished, 1 diverged, 2 bad input."""
    args, flags = parse_args(argv)
    try:
        spec = spec_from_args(args, flags)
    except ValidationError as e:
        _errors(format_validation_error(e))
        return 2
    except SpecError as e:
        _errors(str(e))
        return 2
    os.environ.setdefault("MUJOCO_GL", "disable")
    try:
        summary = run(spec, args.out)
    except CheckpointError as e:
        _errors(str(e))
        return 2
    print(json.dumps({k: v for k, v in summary.items() if k != "evals"}, indent=1))
    return 0 if summary["status"] == "finished" else 1


def _errors(text: str) -> None:
    for line in text.splitlines():
        print(f"error: {line}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
