"""Running one pack into a folder (the pack counterpart of :mod:`qed_ray.train`'s single-run CLI).

``python -m qed_ray.pack_run --task cartpole-balance --seeds 0 1 2 --env-steps 20000 --out DIR`` trains the seeds
as one pack. DIR is laid out as a sweep folder (:class:`~qed_ray.layout.SweepDir`), so every seed's files sit
where a sweep puts a single-seed trial's: ``policies/<trial>/<env_steps>/`` (policy snapshots) and
``policies/<trial>/DONE.json``, ``replay/<trial>/``, and ``<trial>/metrics.jsonl`` and ``<trial>/summary.json``;
the pack checkpoint is ``checkpoint/`` (replaced atomically at each evaluation, by the writer thread). Running the
same command again resumes from it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Callable, Sequence

from pydantic import ValidationError

from qed_ray.atomic import replace_dir, write_json
from qed_ray.checkpoint import CheckpointError
from qed_ray.config import RunSpec, TrainSpec, format_validation_error
from qed_ray.flags import add_run_flags
from qed_ray.layout import SweepDir, trial_dirname
from qed_ray.pack import PACK_FILE, check_pack
from qed_ray.packed_trainer import PackSaveFn, build_packed_trainer
from qed_ray.spec import SpecError
from qed_ray.writer import BackgroundWriter


def snapshot_modules(env_steps: int, train: TrainSpec, acting: Sequence[str], every: Sequence[str]) -> tuple[str, ...]:
    """Modules of the policy snapshot at an evaluation: the acting ones (enough to act and to compare seeds,
    paper App. E), and every module at the final evaluation (the critic-proxy analysis reads the final critics,
    paper App. D)."""
    return tuple(every) if env_steps >= train.env_steps else tuple(acting)


def seed_run_dir(layout: SweepDir, name: str) -> Path:
    """A seed's own folder in a pack run's output, ``<trial>/`` (``metrics.jsonl``, ``summary.json``); a sweep keeps
    these in Tune's per-start folders and MLflow instead."""
    return layout.root / trial_dirname(name)


class PackDirReporter:
    """Per seed: a policy snapshot, a ``metrics.jsonl`` line, ``DONE.json`` at the end; and the pack checkpoint.

    Args:
        layout: the output folder.
        names: per seed, its trial name.
        train: the pack's training settings.
        acting, every: the agent's acting and all module names (see :func:`snapshot_modules`).
        writer: the writer thread the trainer uses (the checkpoint's replacement is queued after its write).
    """

    def __init__(self, layout: SweepDir, names: Sequence[str], train: TrainSpec, acting: Sequence[str],
                 every: Sequence[str], writer: BackgroundWriter):
        self.layout, self.names, self.train, self.writer = layout, list(names), train, writer
        self.acting, self.every = tuple(acting), tuple(every)

    def __call__(self, metrics: dict[int, dict[str, float]], save: PackSaveFn) -> None:
        for i, m in metrics.items():
            step = int(m["env_steps"])
            save(self.layout.snapshot(self.names[i], step), modules=snapshot_modules(step, self.train, self.acting,
                                                                                    self.every), index=i)
        staging = Path(tempfile.mkdtemp(prefix=".checkpoint-", dir=self.layout.root))
        save(staging)
        ckpt = self.layout.root / "checkpoint"
        self.writer.submit(ckpt, lambda: replace_dir(staging, ckpt))  # after the write: the queue is in order
        for i, m in metrics.items():
            folder = seed_run_dir(self.layout, self.names[i])
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / "metrics.jsonl", "a") as f:
                f.write(json.dumps(m) + "\n")
            if int(m["env_steps"]) >= self.train.env_steps:
                self.writer.submit(self.layout.done_marker(self.names[i]),
                                   lambda d=self.layout.done_marker(self.names[i]), m=m: write_json(d, m))


def run_pack(specs: Sequence[RunSpec], out: Path, names: Sequence[str] | None = None, env_workers: int = 0,
             log: Callable[[str], None] = print) -> list[dict]:
    """Trains the pack ``specs`` in ``out`` (resuming from ``out/checkpoint``); writes each seed's summary.json
    and returns the summaries."""
    layout = SweepDir(Path(out).resolve())
    layout.root.mkdir(parents=True, exist_ok=True)
    names = list(names or [s.name for s in specs])
    writer = BackgroundWriter()
    reporter = None
    trainer = build_packed_trainer(specs, lambda metrics, save: reporter(metrics, save),
                                   [layout.replay(n) for n in names], names, env_workers, log, writer)
    t = trainer.agent.template
    reporter = PackDirReporter(layout, names, specs[0].train, t.acting_modules, tuple(t.modules()), writer)
    try:
        ckpt = layout.root / "checkpoint"
        if (ckpt / PACK_FILE).exists():
            pack = trainer.restore(ckpt)
            log(f"resumed pack {pack['pack']} from {ckpt} at env step {pack['env_steps']:,d}")
        summaries = trainer.run()
    finally:
        trainer.close()
        writer.close()
    for name, summary in zip(names, summaries):
        write_json(seed_run_dir(layout, name) / "summary.json", summary)
    return summaries


def main(argv: list[str] | None = None) -> int:
    """Entry point; exit code 0 when every seed finished, 1 when some diverged, 2 on bad input."""
    from qed_ray.train import spec_from_args  # the single-run CLI's flag handling, shared

    p = argparse.ArgumentParser(prog="python -m qed_ray.pack_run", description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, help="YAML file with RunSpec settings (flags given override it)")
    p.add_argument("--out", type=Path, required=True, help="output folder (laid out as a sweep folder)")
    p.add_argument("--seeds", type=int, nargs="+", required=True, help="the pack's seeds (each its own run)")
    p.add_argument("--env-workers", type=int, default=0, help="env worker processes (0: step envs in-process)")
    flags = add_run_flags(p)
    args = p.parse_args(argv)
    try:
        base = spec_from_args(args, flags)
        specs = [RunSpec.model_validate({**base.model_dump(mode="json"), "seed": s}) for s in args.seeds]
        check_pack(specs)
        if args.env_workers < 0:
            raise SpecError(f"--env-workers: {args.env_workers} must be >= 0")
    except ValidationError as e:
        return _errors(format_validation_error(e))
    except (SpecError, ValueError) as e:
        return _errors(str(e))
    try:
        summaries = run_pack(specs, args.out, env_workers=args.env_workers)
    except CheckpointError as e:
        return _errors(str(e))
    print(json.dumps([{k: v for k, v in s.items() if k != "evals"} for s in summaries], indent=1))
    return 0 if all(s["status"] == "finished" for s in summaries) else 1


def _errors(text: str) -> int:
    for line in text.splitlines():
        print(f"error: {line}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
