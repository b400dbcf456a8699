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

import yaml
from pydantic import ValidationError

from qed_ray.checkpoint import MANIFEST_FILE, CheckpointError, replace_dir
from qed_ray.config import RunSpec, format_validation_error
from qed_ray.envs import TASKS
from qed_ray.trainer import DivergenceError, build_trainer


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
        eta = (self.total - steps) / m["perf/env_steps_per_s"]  # at the last interval's speed
        alpha = m.get("alpha/actor_mean", float("nan"))
        print(f"[{steps:>9,d}/{self.total:,d} env steps] eval return {m['eval/return_mean']:7.1f} "
              f"± {m['eval/return_std']:5.1f}  alpha {alpha:.4f}  {m['perf/updates_per_s']:6.1f} upd/s  "
              f"ETA {eta / 60:5.1f} min", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags; every RunSpec field that matters has one."""
    p = argparse.ArgumentParser(prog="python -m qed_ray.train", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", type=Path, help="YAML file with a RunSpec (flags given override it)")
    p.add_argument("--task", help=f"dm_control task, one of: {', '.join(TASKS)}")
    p.add_argument("--agent", choices=["sac_ln", "mad_sac"], help="base agent (default sac_ln)")
    p.add_argument("--temperature", choices=["te", "fixed", "qed"], help="temperature rule (default te)")
    p.add_argument("--alpha", type=float, help="fixed temperature value (--temperature fixed)")
    p.add_argument("--k", type=float, help="QED scale k (--temperature qed)")
    p.add_argument("--n-actions", type=int, help="QED policy samples per state (default 8)")
    p.add_argument("--tau", type=float, help="QED expectile level (default 0.9)")
    p.add_argument("--alpha-max", type=float, help="QED upper clip (default 0.2)")
    p.add_argument("--init-alpha", type=float, help="initial alpha_TE (default 0.1)")
    p.add_argument("--seed", type=int, help="run seed (default 0)")
    p.add_argument("--env-steps", type=int, help="budget in control steps (frame skip 2: decisions x 2)")
    p.add_argument("--eval-every", type=int, help="env steps between evaluations/checkpoints (multiple of 1000)")
    p.add_argument("--eval-episodes", type=int, help="deterministic evaluation episodes")
    p.add_argument("--warmup-decisions", type=int, help="uniform-random decisions before updates")
    p.add_argument("--hidden", type=int, help="hidden width (default 512)")
    p.add_argument("--depth", type=int, help="hidden layers (default 2)")
    p.add_argument("--batch-size", type=int, help="batch size (default 512)")
    p.add_argument("--utd", type=int, help="updates per decision (default 1)")
    p.add_argument("--actor-lr", type=float)
    p.add_argument("--critic-lr", type=float)
    p.add_argument("--polyak", type=float, help="target update rate (default 0.01)")
    p.add_argument("--gamma", type=float, help="discount (default 0.99)")
    p.add_argument("--grad-clip", type=float, help="global gradient-norm clip (default 20)")
    p.add_argument("--proportion-real", type=float, help="MAD-SAC real share of critic batches (default 0.5)")
    p.add_argument("--model-every", type=int, help="MAD-SAC model step every n updates (default 1)")
    p.add_argument("--device", help="auto | cpu | cuda | cuda:N (default auto)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default 1)")
    p.add_argument("--out", type=Path, required=True, help="run folder: checkpoint, metrics.jsonl, summary.json")
    return p.parse_args(argv)


FLAG_PATHS = {
    "task": ("task",), "seed": ("seed",), "agent": ("agent", "name"), "temperature": ("temperature", "kind"),
    "alpha": ("temperature", "alpha"), "k": ("temperature", "k"), "n_actions": ("temperature", "n_actions"),
    "tau": ("temperature", "tau"), "alpha_max": ("temperature", "alpha_max"),
    "init_alpha": ("temperature", "init_alpha"), "env_steps": ("train", "env_steps"),
    "eval_every": ("train", "eval_every"), "eval_episodes": ("train", "eval_episodes"),
    "warmup_decisions": ("train", "warmup_decisions"), "hidden": ("agent", "hidden"), "depth": ("agent", "depth"),
    "batch_size": ("agent", "batch_size"), "utd": ("agent", "utd"), "actor_lr": ("agent", "actor_lr"),
    "critic_lr": ("agent", "critic_lr"), "polyak": ("agent", "polyak"), "gamma": ("agent", "gamma"),
    "grad_clip": ("agent", "grad_clip"), "proportion_real": ("agent", "mad", "proportion_real"),
    "model_every": ("agent", "mad", "model_every"), "device": ("train", "device"), "threads": ("train", "threads"),
}


def spec_from_args(args: argparse.Namespace) -> RunSpec:
    """Merges ``--config`` YAML and flags into one validated RunSpec (raises ValidationError)."""
    raw: dict = yaml.safe_load(args.config.read_text()) if args.config else {}
    for flag, path in FLAG_PATHS.items():
        value = getattr(args, flag)
        if value is None:
            continue
        node = raw
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    if "task" not in raw:
        raise SystemExit("error: --task is required (or a 'task' in --config)")
    return RunSpec.model_validate(raw)


def run(spec: RunSpec, out: Path) -> dict:
    """Trains ``spec`` in ``out`` (resuming from ``out/checkpoint``) and writes ``out/summary.json``."""
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.json").write_text(spec.model_dump_json(indent=1))
    trainer = build_trainer(spec, DirReporter(out, spec.train.env_steps), replay_dir=out / "replay",
                            log=lambda line: print(line, file=sys.stderr) if "WARNING" in line else None)
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
    args = parse_args(argv)
    try:
        spec = spec_from_args(args)
    except ValidationError as e:
        print(f"error: {format_validation_error(e)}", file=sys.stderr)
        return 2
    except (yaml.YAMLError, OSError) as e:
        print(f"error: --config: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("MUJOCO_GL", "disable")
    try:
        summary = run(spec, args.out)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in summary.items() if k != "evals"}, indent=1))
    return 0 if summary["status"] == "finished" else 1


if __name__ == "__main__":
    sys.exit(main())
