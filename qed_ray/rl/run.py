"""The run CLI: one seed, or several seeds of one configuration trained together as a pack.

The folder it writes, resume and what it refuses: docs/running.md and docs/results.md ("Single-run folder").
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from qed_ray.records.atomic import fsync_file, write_text
from qed_ray.records.codec import RecordError, dump, load_json, parse, read_lines, read_record, write_record
from qed_ray.spec import cli_help
from qed_ray.spec.config import RunSpec, TrainSpec
from qed_ray.spec.field_hints import format_validation_error
from qed_ray.spec.flags import Flag, add_run_flags, settings_from_args
from qed_ray.records.layout import PackId, SweepDir, trial_dirname
from qed_ray.records.checkpoint import RESUMABLE_CHANGES
from qed_ray.spec.naming import identity, identity_changes, show_setting
from qed_ray.rl.pack import check_pack, pack_name
from qed_ray.records.run import RUN_FORMAT, Metrics, RunFile, RunSummary, read_done
from qed_ray.spec.sweep import SpecError, load_yaml
from qed_ray.spec.replay_memory import replay_needs, replay_problems

if TYPE_CHECKING:  # torch comes with the trainer: imported by a run, not by --help or a refused flag
    from qed_ray.rl.run_folder import FolderReporter

RUN_FILE, METRICS_FILE, SUMMARY_FILE = "run.json", "metrics.jsonl", "summary.json"
HEARTBEAT_S = 15.0  # seconds between progress lines before and between evaluations
SWEEP_FILES = ("sweep.json", "sweep.lock")


def format_eta(seconds: float | None) -> str:
    """``12.3 min`` (warm-up, training and evaluation time left), or a note while a cost is still unmeasured."""
    if seconds is None or seconds != seconds:
        return "after the first updates"
    return f"{seconds / 60:.1f} min"


class RunLog:
    """The CLI's side of each evaluation: a ``metrics.jsonl`` line per seed and a progress line (and one between
    evaluations, :meth:`heartbeat`)."""

    def __init__(self, out: Path, names: list[str], total_env_steps: int):
        self.out, self.names, self.total = out, names, total_env_steps

    def metrics_file(self, name: str) -> Path:
        return self.out / trial_dirname(name) / METRICS_FILE

    def __call__(self, metrics: dict[int, dict]) -> None:
        for i, m in metrics.items():
            path = self.metrics_file(self.names[i])
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(json.dumps(dump(m, Metrics), allow_nan=False) + "\n")
            fsync_file(path)
            alpha = m.get("alpha/actor_mean", float("nan"))
            seed = f"seed {self.names[i].rsplit('/', 1)[1]}: " if len(self.names) > 1 else ""
            print(f"[{int(m['env_steps']):>9,d}/{self.total:,d} env steps] {seed}eval return "
                  f"{m['eval/return_mean']:7.1f} ± {m['eval/return_std']:5.1f}  alpha {alpha:.4f}  "
                  f"{m['perf/updates_per_s']:6.1f} upd/s  ETA {format_eta(m.get('perf/eta_s'))}", flush=True)

    def heartbeat(self, h: dict) -> None:
        """A progress line between evaluations (the trainer calls it at the start and every ``heartbeat_s``)."""
        phase = "warm-up (uniform random actions)" if h["warmup"] else "training"
        print(f"[{h['env_steps']:>9,d}/{h['total_env_steps']:,d} env steps] {phase}, "
              f"{h['wall_s'] / 60:.1f} min so far, ETA {format_eta(h['eta_s'])}", flush=True)

    def trim(self, name: str, env_steps: int) -> None:
        """Drops ``metrics.jsonl`` lines past ``env_steps`` (written before a crash; the resumed run writes them
        again). Raises RecordError naming the file and the line of a damaged one (nothing is dropped then)."""
        path = self.metrics_file(name)
        if os.path.lexists(path):
            kept = [m for m in read_lines(path, Metrics) if m["env_steps"] <= env_steps]
            write_text(path, "".join(json.dumps(dump(m, Metrics), allow_nan=False) + "\n" for m in kept))


EXAMPLES = (
    "qed-ray run --task cartpole-balance --temperature qed --k 0.2 --seed 0 --env-steps 20000 "
    "--out runs/cp-qed   # one seed; the same command resumes it",
    "qed-ray run --task cheetah-run --agent mad_sac --seeds 0 1 2 --env-workers 3 --env-steps 100000 "
    "--out runs/ch-mad   # three seeds as one pack")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[Flag]]:
    """Command-line flags: one per RunSpec setting, help and defaults read from the models."""
    p = cli_help.parser("qed-ray run", __doc__, EXAMPLES)
    p.add_argument("--config", type=Path, help="YAML file with RunSpec settings (flags given override it)")
    p.add_argument("--out", type=Path, required=True, help="run folder (laid out as a sweep folder)")
    p.add_argument("--seeds", type=int, nargs="+", help="several seeds trained together as one pack (instead of "
                                                        "--seed)")
    p.add_argument("--env-workers", type=int, default=0, help="env worker processes (0: step the envs in-process)")
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
    _evaluate_at_the_end(raw)
    try:
        spec = RunSpec.model_validate(raw)
    except ValidationError as e:
        raise SpecError("\n".join(line + (EVERY_HINT if EVERY_PROBLEM in line else "")
                                   for line in format_validation_error(e).splitlines())) from None
    if spec.train.budget_problem():
        raise SpecError(f"train.{spec.train.budget_problem()} (--warmup-decisions, --env-steps)")
    if "env_steps" not in raw.get("train", {}):
        print(f"note: --env-steps not given: training for the default {spec.train.env_steps:,} env steps "
              f"(the paper's budget)", flush=True)
    return spec


EVERY_PROBLEM = " must be a multiple of eval_every ("  # TrainSpec's refusal of a budget evaluations do not divide
EVERY_HINT = "; give --eval-every, a multiple of 1000 env steps that divides --env-steps"


def _evaluate_at_the_end(raw: dict) -> None:
    """A budget below the default ``eval_every`` and no ``eval_every`` given: one evaluation (and checkpoint), at the
    end, said in a note (a short test run needs no second flag)."""
    train = raw.get("train") if isinstance(raw.get("train"), dict) else {}
    steps, default = train.get("env_steps"), TrainSpec.model_fields["eval_every"].default
    if isinstance(steps, int) and 0 < steps < default and "eval_every" not in train:
        train["eval_every"] = steps
        print(f"note: --env-steps {steps:,} is below the default eval_every ({default:,}): evaluating once, at the "
              f"end (--eval-every N evaluates every N env steps)", flush=True)


def specs_from_args(args: argparse.Namespace, flags: list[Flag]) -> list[RunSpec]:
    """The runs of the pack: ``--seeds``, or the one ``--seed`` (raises SpecError, ValidationError)."""
    base = spec_from_args(args, flags)
    if args.seeds is None:
        if base.train.shared_indices:
            raise SpecError("train.shared_indices (--shared-indices): a run of one seed shares its replay positions "
                            "with no other; train several seeds as one pack with --seeds")
        specs = [base]
    elif args.seed is not None:
        raise SpecError("--seeds: give either --seed or --seeds, not both")
    else:
        specs = [RunSpec.model_validate({**base.model_dump(mode="json"), "seed": s}) for s in args.seeds]
    try:
        check_pack(specs)
    except ValueError as e:
        raise SpecError(f"--seeds: {e}") from None
    if args.env_workers < 0:
        raise SpecError(f"--env-workers: {args.env_workers} must be >= 0")
    if args.env_workers > len(specs):  # more workers than envs would idle (bounded as pack.env_workers is)
        raise SpecError(f"--env-workers: {args.env_workers} workers for the {len(specs)} training "
                        f"env{'s' if len(specs) > 1 else ''}; allowed 0 to {len(specs)} (one per --seeds)")
    return specs


def check_resources(specs: list[RunSpec]) -> None:
    """Refuses, before anything is written, a pack whose replay passes its cap (:mod:`qed_ray.spec.replay_memory`) or a
    ``--device`` this process does not have (raises SpecError)."""
    problems = replay_problems(replay_needs([(specs[0].task, specs[0].train)], len(specs)), pack_field="--seeds")
    if problems:
        raise SpecError("\n".join(problems))
    from qed_ray.rl.trainer import DeviceError, resolve_device

    try:
        resolve_device(specs[0].train.device)
    except DeviceError as e:
        raise SpecError(str(e)) from None


def check_out_dir(out: Path) -> RunFile | None:
    """Refuses an ``--out`` this CLI must not write into (before anything is written); returns its ``run.json``
    (SpecError; RecordError naming the file and the field of a damaged ``run.json``)."""
    if out.exists() and not out.is_dir():
        raise SpecError(f"--out: {out} is a file, not a folder")
    if not out.is_dir() or not any(out.iterdir()):
        return None
    sweep = [f for f in SWEEP_FILES if (out / f).exists()]
    if sweep:
        raise SpecError(f"--out: {out} is a sweep folder (it holds {sweep[0]}); refusing to write into it (give a new "
                        f"or empty folder; a sweep is resumed with python -m qed_ray.sweep)")
    if not os.path.lexists(out / RUN_FILE):  # a dangling link is a damaged run.json, named when read
        raise SpecError(f"--out: {out} is not empty and holds no {RUN_FILE}, so it is not a run folder of this CLI; "
                        f"refusing to write into it (give a new or empty folder)")
    return read_run_file(out)


def read_run_file(out: Path) -> RunFile:
    """The run folder's ``run.json``; raises RecordError naming the file and the field (SpecError for one of qed_ray
    0.1, which this release does not resume)."""
    raw = load_json(out / RUN_FILE)
    if isinstance(raw, dict) and raw.get("format", 1) == 1:
        raise SpecError(f"--out: {out} is a run folder of run format 1 (format 1: a single-seed run of qed_ray 0.1, "
                        f"with checkpoint/ and metrics.jsonl) that this release cannot resume; finish it with the "
                        f"release that wrote it, or give a new --out")
    return parse(RunFile, raw, out / RUN_FILE)


def check_resume(prior: RunFile, specs: list[RunSpec], out: Path) -> None:
    """Refuses to resume a run folder of other runs, naming each changed setting (a larger budget is fine)."""
    before = prior.runs
    if [r.seed for r in before] != [s.seed for s in specs]:
        raise SpecError(f"--seeds: {out} holds the pack of seeds {[r.seed for r in before]}, this run gives "
                        f"{[s.seed for s in specs]}; a pack resumes with its own seeds (or give another --out)")
    old, new = (json.loads(json.dumps(identity(r))) for r in (before[0], specs[0]))
    lines = [f"{k}: the run in {out} was trained with {show_setting(a)}, this run gives {show_setting(b)}; resuming "
             f"would continue a different run (use the same settings, or another --out)"
             for k, (a, b) in identity_changes(old, new, ignore=RESUMABLE_CHANGES).items()]
    layout = SweepDir(out)
    trained = max(layout.pack_checkpoint_steps(PackId.of([s.name for s in specs])), default=0)
    if specs[0].train.env_steps < trained:
        lines.append(f"train.env_steps: {specs[0].train.env_steps:,} is below the {trained:,} env steps the run in "
                     f"{out} already trained")
    if lines:
        raise SpecError("\n".join(lines))


def run(specs: list[RunSpec], out: Path, env_workers: int = 0) -> list[RunSummary]:
    """Trains the pack ``specs`` in ``out`` (resuming from its newest checkpoint) and writes each seed's
    ``summary.json``; returns the summaries. Raises SpecError for an ``out`` not ours or of other settings,
    RecordError (CheckpointError among them) for a damaged file of the run folder."""
    out = out.resolve()
    prior = check_out_dir(out)
    if prior is not None:
        check_resume(prior, specs, out)
    layout, names = SweepDir(out), [s.name for s in specs]
    pack = PackId.of(names)
    # A larger --env-steps continues a finished run: its end is no longer the end (its DONE.json goes once the
    # run has resumed, so a refused resume changes nothing).
    extended = [n for n in names if layout.trial_state(n) == "done" and read_done(layout, n).env_steps
                < specs[0].train.env_steps]
    if prior is not None and not extended and all(layout.trial_state(n) != "pending" for n in names) \
            and all(os.path.lexists(out / trial_dirname(n) / SUMMARY_FILE) for n in names):
        print(f"{pack.name} already finished in {out}; its summaries:", flush=True)
        return [read_record(out / trial_dirname(n) / SUMMARY_FILE, RunSummary) for n in names]
    out.mkdir(parents=True, exist_ok=True)
    run_file = RunFile(format=RUN_FORMAT, pack=pack_name(specs), runs=specs)
    if prior is None:  # a new folder is marked as this CLI's run before anything else lands in it (a Ctrl-C then)
        write_record(out / RUN_FILE, run_file)
    from qed_ray.rl.run_folder import FolderReporter
    from qed_ray.rl.trainer import build_trainer

    log = RunLog(out, names, specs[0].train.env_steps)
    trainer = build_trainer(specs, lambda metrics, save: folder(metrics, save), [layout.replay(n) for n in names],
                            names, env_workers, log=lambda line: print(line, file=sys.stderr) if "WARNING" in line
                            or "stopped" in line else None, heartbeat=log.heartbeat, heartbeat_s=HEARTBEAT_S)
    folder = FolderReporter(layout, pack, trainer, 1, [[] for _ in names], log)
    stopped = False
    try:
        _resume(folder, log)
        write_record(out / RUN_FILE, run_file)  # a resumed run's settings once it has resumed
        for name in extended:
            layout.done_marker(name).unlink()
        trainer.run()
    except KeyboardInterrupt:
        stopped = True
    finally:
        trainer.close()  # also lands the checkpoint writes in flight
    if stopped:
        raise RunStopped(trainer.state.env_steps, specs[0].train,
                         max(layout.pack_checkpoint_steps(pack), default=0))
    folder.record_diverged()
    folder.finish()
    summaries = trainer.summaries()
    for name, summary in zip(names, summaries):
        write_record(out / trial_dirname(name) / SUMMARY_FILE, summary)
    return summaries


class RunStopped(Exception):
    """Ctrl-C during training: how far the run got and the checkpoint the same command resumes from."""

    def __init__(self, reached: int, train: TrainSpec, checkpoint: int):
        super().__init__(reached)
        self.reached, self.train, self.checkpoint = reached, train, checkpoint

    def line(self) -> str:
        head = f"stopped (Ctrl-C) at env step {self.reached:,} of {self.train.env_steps:,}"
        if self.checkpoint:
            return f"{head}; run the same command to resume from its checkpoint at env step {self.checkpoint:,}"
        return (f"{head}, before its first checkpoint (at env step {self.train.eval_every:,}); run the same command "
                f"to start it again")


def _stop_once(signum, frame) -> None:
    """The CLI's SIGINT handler: the first Ctrl-C stops the run (KeyboardInterrupt); later ones are ignored while
    the checkpoint writes in flight finish, so nothing is cut off midway."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _resume(folder: FolderReporter, log: RunLog) -> None:
    """Restores the newest intact checkpoint (if any) and trims the seeds' ``metrics.jsonl`` to it."""
    # Checkpoints of an older format are refused, never replaced: the message says how to start over.
    resumed = folder.resume(lambda line: print(line, file=sys.stderr, flush=True), start_over=False)
    for name in log.names:
        log.trim(name, resumed or 0)
    if resumed is not None:
        print(f"resumed {folder.pack.name} from its checkpoint at env step {resumed:,d}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point; exit code 0 every seed finished, 1 a seed diverged, 2 bad input, 130 stopped by Ctrl-C (one line
    says how far it got and what the same command resumes from)."""
    args, flags = parse_args(argv)
    try:
        specs = specs_from_args(args, flags)
        check_resources(specs)
    except ValidationError as e:
        return _errors(format_validation_error(e))
    except SpecError as e:
        return _errors(str(e))
    os.environ.setdefault("MUJOCO_GL", "disable")
    previous = signal.signal(signal.SIGINT, _stop_once)
    try:
        summaries = run(specs, args.out, args.env_workers)
    except (RecordError, SpecError) as e:  # CheckpointError is a RecordError
        return _errors(str(e))
    except RunStopped as e:
        print(e.line(), file=sys.stderr, flush=True)
        return 130
    except KeyboardInterrupt:
        print("stopped (Ctrl-C) before training started; run the same command to start it", file=sys.stderr,
              flush=True)
        return 130
    finally:
        signal.signal(signal.SIGINT, previous)
    shown = [{k: v for k, v in dump(s).items() if k != "evals"} for s in summaries]
    print(json.dumps(shown[0] if len(shown) == 1 else shown, indent=1))
    for s in summaries:
        if s.status != "finished":
            print(f"{s.name} stopped: {s.reason or s.status}", file=sys.stderr, flush=True)
    return 0 if all(s.status == "finished" for s in summaries) else 1


def _errors(text: str) -> int:
    for line in text.splitlines():
        print(f"error: {line}", file=sys.stderr)
    return 2
