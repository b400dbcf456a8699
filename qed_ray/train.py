"""Single-run CLI (the run's objects are built by :func:`qed_ray.trainer.build_trainer`).

``python -m qed_ray.train --task cartpole-balance --agent sac_ln --temperature qed --k 0.2 --seed 0
--env-steps 20000 --out DIR`` trains, checkpointing into ``DIR/checkpoint`` at every evaluation; running it
again with the same DIR resumes from that checkpoint (the same settings, or a larger ``--env-steps``; anything
else is refused naming the setting). ``DIR/summary.json`` holds the final figures; a finished run is reported,
never re-trained. The CLI writes only into a new or empty folder or one of its own run folders (``run.json``), and
replaces only its own checkpoint folder.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pydantic import ValidationError

from qed_ray.atomic import atomic_dir, fsync_file, recover_dir, write_json, write_text
from qed_ray.checkpoint import MANIFEST_FILE, CheckpointError, read_manifest
from qed_ray.config import RunSpec, format_validation_error
from qed_ray.flags import Flag, add_run_flags, settings_from_args
from qed_ray.naming import EXECUTION_SETTINGS, identity, identity_changes, show_setting
from qed_ray.spec import SpecError, load_yaml
from qed_ray.trainer import DivergenceError, build_trainer

RUN_FILE, METRICS_FILE, SUMMARY_FILE, CHECKPOINT_DIR = "run.json", "metrics.jsonl", "summary.json", "checkpoint"
RESUMABLE_CHANGES = EXECUTION_SETTINGS | {"train.env_steps"}  # a resume may extend the budget
HEARTBEAT_S = 15.0  # seconds between progress lines before and between evaluations


class DirReporter:
    """CLI reporter: ``metrics.jsonl``, then one checkpoint folder (atomically replaced), and a progress line.

    The metrics line goes first: after a crash between the two, the resumed run drops lines past its checkpoint
    (:func:`trim_metrics`) and writes them again, so each evaluation appears once.
    """

    def __init__(self, out: Path, total_env_steps: int):
        self.out, self.total = out, total_env_steps

    def __call__(self, metrics: dict[str, float], save) -> None:
        with open(self.out / METRICS_FILE, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        fsync_file(self.out / METRICS_FILE)
        with atomic_dir(self.out / CHECKPOINT_DIR) as staging:
            save(staging)
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


def check_out_dir(out: Path) -> None:
    """Refuses an ``--out`` this CLI must not write into or replace parts of (before anything is written)."""
    if out.exists() and not out.is_dir():
        raise SpecError(f"--out: {out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / RUN_FILE).exists():
        raise SpecError(f"--out: {out} is not empty and holds no {RUN_FILE}, so it is not a run folder of this CLI; "
                        f"refusing to write into it (give a new or empty folder)")
    ckpt = out / CHECKPOINT_DIR
    if ckpt.exists() and not (ckpt / MANIFEST_FILE).exists():
        raise SpecError(f"--out: {ckpt} exists but holds no {MANIFEST_FILE}, so it is not a checkpoint of this CLI; "
                        f"refusing to replace it (move it away, or give another --out)")


def check_resume(manifest: dict, spec: RunSpec, ckpt: Path) -> None:
    """Refuses to resume a checkpoint of a different run, naming each changed setting (a larger budget is fine)."""
    try:
        before = identity(RunSpec.model_validate(manifest["run"]))
    except (KeyError, ValidationError) as e:
        raise CheckpointError(f"{ckpt / MANIFEST_FILE}: its run settings no longer validate ({e})") from None
    changes = identity_changes(json.loads(json.dumps(before)), json.loads(json.dumps(identity(spec))),
                               ignore=RESUMABLE_CHANGES)
    lines = [f"{k}: the checkpoint in {ckpt} was trained with {show_setting(old)}, this run gives {show_setting(new)}; "
             f"resuming would continue a different run (use the same settings, or another --out)"
             for k, (old, new) in changes.items()]
    if spec.train.env_steps < manifest["env_steps"]:
        lines.append(f"train.env_steps: {spec.train.env_steps:,} is below the {manifest['env_steps']:,} env steps "
                     f"the checkpoint in {ckpt} already trained")
    if lines:
        raise SpecError("\n".join(lines))


def trim_metrics(out: Path, env_steps: int) -> dict:
    """Drops ``metrics.jsonl`` lines past ``env_steps`` (written before a crash, re-run now); returns the last kept."""
    path = out / METRICS_FILE
    if not path.exists():
        return {}
    kept = [m for m in (json.loads(line) for line in path.read_text().splitlines() if line.strip())
            if m["env_steps"] <= env_steps]
    write_text(path, "".join(json.dumps(m) + "\n" for m in kept))
    return kept[-1] if kept else {}


def run(spec: RunSpec, out: Path) -> dict:
    """Trains ``spec`` in ``out`` (resuming from ``out/checkpoint``) and writes ``out/summary.json``.

    Raises:
        SpecError: ``out`` is not ours to write, or its checkpoint belongs to a run with other settings.
        CheckpointError: the checkpoint cannot be used.
    """
    out = out.resolve()
    check_out_dir(out)
    ckpt = out / CHECKPOINT_DIR
    recover_dir(ckpt)  # a crash inside replace_dir leaves the previous checkpoint set aside
    prior = read_manifest(ckpt) if (ckpt / MANIFEST_FILE).exists() else None
    if prior is not None:
        check_resume(prior, spec, ckpt)
        if prior["env_steps"] >= spec.train.env_steps and (out / SUMMARY_FILE).exists():
            print(f"{spec.name} already finished in {out} ({prior['env_steps']:,} env steps); its summary:",
                  flush=True)
            return json.loads((out / SUMMARY_FILE).read_text())
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / RUN_FILE, spec.model_dump_json(indent=1))
    reporter = DirReporter(out, spec.train.env_steps)
    trainer = build_trainer(spec, reporter, replay_dir=out / "replay",
                            log=lambda line: print(line, file=sys.stderr) if "WARNING" in line else None,
                            heartbeat=reporter.heartbeat, heartbeat_s=HEARTBEAT_S)
    if prior is not None:
        m = trainer.restore(ckpt)
        trainer.last_metrics = trim_metrics(out, m["env_steps"])
        print(f"resumed {spec.name} from {ckpt} at env step {m['env_steps']:,d}", flush=True)
    status, reason = "finished", None
    try:
        summary = trainer.run()
    except DivergenceError as e:
        status, reason = "diverged", str(e)
        summary = {**trainer.summary(), "status": status, "reason": reason}
    write_json(out / SUMMARY_FILE, summary, indent=1)
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
    except (CheckpointError, SpecError) as e:
        _errors(str(e))
        return 2
    print(json.dumps({k: v for k, v in summary.items() if k != "evals"}, indent=1))
    return 0 if summary["status"] == "finished" else 1


def _errors(text: str) -> None:
    for line in text.splitlines():
        print(f"error: {line}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
