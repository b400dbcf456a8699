"""The worker side of a sweep trial: what runs inside a Ray Tune worker.

The driver (``sweep.py``) hands every trial a frozen :class:`TrialContext` through ``tune.with_parameters`` (given
again by the driver on every start, never read back from saved state) and the trial's own config
``{"trial": {"name", "run"}}`` through Tune's param space. :func:`train_trial` validates it once, builds the run
with :func:`~qed_ray.trainer.build_trainer` and reports each evaluation through :class:`TuneReporter`.

The sweep folder is the record, not Tune: each evaluation writes, each atomically and in this order, the policy
snapshot, the full checkpoint (``checkpoints/<trial>/<env_steps>/``, the newest two kept), the metrics history
and, at the last one, ``DONE.json`` (with the policy checksums the trial records, see below); then it reports to
Tune and mirrors the history to MLflow. A started,
retried or resumed trial restores its newest intact checkpoint from that folder (an older one if the newest is
damaged), so a fresh Tuner at every driver start needs no Tune state.

Failures: a :class:`~qed_ray.trainer.DivergenceError` is final (``DIVERGED.json``, the run FAILED with the reason,
and the trial returns normally so that Tune does not retry a deterministic continuation); any other exception
propagates, and Tune retries the trial from its newest checkpoint (``max_retries``); MLflow problems never fail a
trial (:class:`~qed_ray.tracking.TrialRun`).

Packs (``pack.seeds`` > 1): :func:`train_pack` trains the seed runs of one (task, agent, variant) as one Tune trial
with :class:`~qed_ray.packed_trainer.PackedTrainer`. Per seed, outward, nothing changes: the same policy snapshots,
history, ``DONE.json``, ``DIVERGED.json``, replay folder and MLflow run (tagged ``qed.pack`` and ``qed.pack_size``)
as an unpacked trial; the pack's checkpoint, ``checkpoints/<pack>/<env_steps>/``, holds ``pack.json`` and one
single-seed checkpoint per seed (each loads into the single-seed trainer). A seed that diverges stops alone (its
``DIVERGED.json``, its run FAILED); the pack goes on with the others and returns when they are all done.

Checksums: at its end a trial records in its MLflow run the SHA-256 of its final ``state.pt`` and the digest of
all its snapshots (:mod:`qed_ray.checksums`), which the gather step checks the snapshots against. The same values
go into ``DONE.json`` first, so that when MLflow cannot be reached before the trial returns, the driver records
them in the run when it can (:func:`qed_ray.sweep_state.sync_runs`, at the end of this start or at the next one).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import ray
from pydantic import Field
from ray import tune

from qed_ray.atomic import TMP_MARK, atomic_dir, publish_dir, staging_dir, write_json
from qed_ray.checkpoint import MANIFEST_FILE, CheckpointError, CheckpointVersionError
from qed_ray.checksums import DONE_KEY, done_checksums, recorded_values
from qed_ray.config import Frozen, RunSpec, TrainSpec
from qed_ray.layout import PACK_FILE, PackId, SweepDir
from qed_ray.pack import SeedRun
from qed_ray.packed_trainer import PackedTrainer, PackSaveFn, build_packed_trainer
from qed_ray.replay import prune_chunks
from qed_ray.tracking import TrialRun, checksum_tags, limit_http_retries, pack_tags
from qed_ray.trainer import DivergenceError, SaveFn, Trainer, build_trainer

KEEP_CHECKPOINTS = 2  # the newest two: a damaged newest one still leaves one to resume from


class TrialContext(Frozen):
    """What every trial of a sweep shares, set by the driver (the same on every start of a trial)."""

    sweep_id: str = Field(min_length=1, description="the sweep's stable id (sweep.json)")
    sweep_dir: Path = Field(strict=False, description="absolute sweep folder (a shared mount on a cluster)")
    tracking_uri: str = Field(min_length=1, description="MLflow tracking URI reachable from every node")
    experiment: str = Field(min_length=1, description="MLflow experiment")
    parent_run_id: str = Field(min_length=1, description="the sweep's MLflow parent run")
    keep_every: int = Field(1, ge=1, description="keep a policy snapshot every n-th evaluation (and the last)")
    gpu_fraction: float = Field(0.0, ge=0, le=1, description="this trial's GPU share (caps its GPU memory)")
    keep_replay: bool = Field(False, description="keep a finished trial's replay chunks (else they are deleted)")
    mlflow_timeout_s: float = Field(300.0, ge=0, le=86400, description="how long a finishing trial waits for "
                                                                       "an unreachable MLflow")
    env_workers: int = Field(0, ge=0, description="env worker processes per pack (pack.env_workers)")

    @property
    def layout(self) -> SweepDir:
        """The sweep folder."""
        return SweepDir(self.sweep_dir)


def snapshot_modules(env_steps: int, train: TrainSpec, keep_every: int, acting: tuple[str, ...],
                     every: tuple[str, ...]) -> tuple[str, ...] | None:
    """Modules of the policy snapshot kept at the evaluation at ``env_steps``; None: this evaluation keeps none.

    Every ``keep_every``-th evaluation keeps the ``acting`` modules, enough to act and to compare seeds (V over
    training, paper App. E); the final one keeps ``every`` module, since the critic-proxy analysis reads the final
    critics (paper App. D).
    """
    if env_steps >= train.env_steps:
        return every
    if (env_steps // train.eval_every) % keep_every == 0:
        return acting  # MAD-SAC: ~1 MB instead of 18 MB per snapshot
    return None


class TuneReporter:
    """Persists each evaluation in the sweep folder, reports it to Tune, then mirrors the history to MLflow.

    Args:
        name: the trial name.
        spec: the trial's run.
        context: the sweep's context.
        run: the trial's MLflow run (best-effort).
        acting_modules, all_modules: the agent's module names (see :func:`snapshot_modules`).
        history: the evaluations already recorded (up to the checkpoint this attempt resumed from).
    """

    def __init__(self, name: str, spec: RunSpec, context: TrialContext, run: TrialRun,
                 acting_modules: tuple[str, ...], all_modules: tuple[str, ...], history: list[dict]):
        self.name, self.spec, self.context, self.run = name, spec, context, run
        self.acting_modules, self.all_modules = tuple(acting_modules), tuple(all_modules)
        self.history = list(history)

    def __call__(self, metrics: dict, save: SaveFn) -> None:
        step = int(metrics["env_steps"])
        layout, name = self.context.layout, self.name
        modules = snapshot_modules(step, self.spec.train, self.context.keep_every, self.acting_modules,
                                   self.all_modules)
        if modules is not None:
            with atomic_dir(layout.snapshot(name, step)) as d:
                save(d, modules=modules)
        with atomic_dir(layout.checkpoint(name, step)) as d:
            save(d)
        prune_checkpoints(layout, name)
        # The history after the checkpoint: a crash in between re-runs this interval and records it then.
        self.history = [h for h in self.history if history_step(h) < step]
        self.history.append({"time_ms": int(time.time() * 1000), "metrics": metrics})
        write_json(layout.history(name), self.history)
        if step == self.spec.train.env_steps:
            # The final snapshot is in place: its checksums are fixed now, before anything can touch the folder.
            recorded = recorded_values(layout, name)
            write_json(layout.done_marker(name), {**metrics, DONE_KEY: asdict(recorded)})
        tune.report(metrics)
        self.run.sync(self.history)


def history_step(entry: dict) -> int:
    """The env step of one history entry ``{"time_ms", "metrics"}``."""
    return int(entry["metrics"]["env_steps"])


def prune_checkpoints(layout: SweepDir, name: str, keep: int = KEEP_CHECKPOINTS) -> None:
    """Deletes all but the newest ``keep`` full checkpoints of the trial, and staging folders a crash left."""
    prune_steps(layout.checkpoint_steps(name), layout.checkpoints(name), keep)


def prune_steps(steps: dict[int, Path], root: Path, keep: int = KEEP_CHECKPOINTS, leftovers: bool = True) -> None:
    """Deletes all but the newest ``keep`` of the checkpoint folders ``steps`` (``{env_steps: folder}``) under
    ``root`` and, with ``leftovers``, the staging folders a crash left there."""
    for step in sorted(steps)[:-keep]:
        shutil.rmtree(steps[step])
    for leftover in root.glob(f".*{TMP_MARK}*") if leftovers else ():
        shutil.rmtree(leftover, ignore_errors=True)


def restore_latest(trainer: Trainer | PackedTrainer, layout: SweepDir, name: str, log: Callable[[str], None],
                   steps: dict[int, Path] | None = None) -> int | None:
    """Restores the trial's newest intact full checkpoint (of ``steps``, default the trial's); returns its env step,
    or None if it has none.

    A checkpoint that cannot be used (corrupt ``state.pt``, a damaged or missing replay chunk) is reported and the
    next older one is tried; each restore overwrites everything a failed one may have loaded. When every checkpoint
    was written by an older qed_ray (another format version: its random streams differ, so it cannot continue the
    same run) the trial starts over, saying so.

    Raises:
        CheckpointError: every checkpoint is damaged (naming each file).
    """
    problems, outdated = [], 0
    steps = layout.checkpoint_steps(name) if steps is None else steps
    for step, folder in sorted(steps.items(), reverse=True):
        try:
            trainer.restore(folder)
        except CheckpointError as e:
            problems.append(str(e))
            outdated += isinstance(e, CheckpointVersionError)
            log(f"WARNING {name}: cannot resume from {folder}: {e}")
            continue
        if problems:
            log(f"WARNING {name}: resumed from the older checkpoint at env step {step}")
        return step
    if problems and outdated == len(problems):
        log(f"WARNING {name}: every checkpoint was written by an older qed_ray; starting this trial over")
        return None
    if problems:
        raise CheckpointError(f"{name}: no intact checkpoint: {'; '.join(problems)}")
    return None


def train_trial(config: dict, context: TrialContext) -> None:
    """Tune function trainable; the Ray boundary is crossed once, here (config -> RunSpec).

    Args:
        config: this trial's Tune config, ``{"trial": {"name": trial name, "run": RunSpec dump}}``.
        context: the sweep's context (bound by the driver with ``tune.with_parameters``).
    """
    spec, name = RunSpec.model_validate(config["trial"]["run"]), config["trial"]["name"]
    layout = context.layout
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731 - the worker's log
    limit_http_retries()
    run = TrialRun(context.tracking_uri, context.experiment, context.sweep_id, context.parent_run_id, name,
                   spec.model_dump(mode="json"), node_id=ray.get_runtime_context().get_node_id(), log=log)
    if layout.trial_state(name) == "done":
        # Finished before its worker could return (killed while closing its run): report, never re-train.
        done = json.loads(layout.done_marker(name).read_text())
        tune.report({k: v for k, v in done.items() if k != DONE_KEY})
        run.finish(layout.read_history(name), tags=checksum_tags(done_checksums(layout, name)),
                   timeout_s=context.mlflow_timeout_s)
        return
    _limit_gpu_memory(context.gpu_fraction)
    # The reporter needs the agent's module names, so it is made right after the trainer that builds the agent.
    trainer = build_trainer(spec, lambda metrics, save: reporter(metrics, save), layout.replay(name), log=log)
    resumed = restore_latest(trainer, layout, name, log)
    history = [h for h in layout.read_history(name) if resumed is not None and history_step(h) <= resumed]
    agent = trainer.agent
    reporter = TuneReporter(name, spec, context, run, agent.acting_modules, tuple(agent.modules()), history)
    run.sync(history, tags={} if resumed is None else {"qed.resumed_from_env_step": resumed})
    try:
        summary = trainer.run()
    except DivergenceError as e:
        reason = f"DivergenceError: {e}"
        write_json(layout.diverged_marker(name), {"reason": reason, "env_steps": trainer.p.decisions
                                                  * spec.train.frame_skip})
        log(f"{name}: {reason}; the trial is final (a deterministic continuation would diverge again)")
        run.finish(reporter.history, failed_reason=reason, timeout_s=context.mlflow_timeout_s)
        return
    except Exception as e:  # noqa: BLE001 - note it on the run (best-effort), then let Tune retry the trial
        run.sync(reporter.history, tags={"qed.last_error": f"{type(e).__name__}: {e}"[:5000]})
        raise
    # The checksums go with the run's end; if MLflow stays down they wait in DONE.json for the driver.
    run.finish(reporter.history, tags={"qed.status": summary["status"], **checksum_tags(done_checksums(layout, name))},
               timeout_s=context.mlflow_timeout_s)
    if not context.keep_replay:
        prune_chunks(layout.replay(name))  # resume never needs them after DONE.json, the gather step never reads them


def _limit_gpu_memory(fraction: float) -> None:
    """Fractional GPUs are a scheduling fiction (no isolation): cap this trial's share of GPU memory."""
    import torch

    if 0 < fraction < 1 and torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(fraction)


# ---- packs (pack.seeds > 1): one Tune trial trains the seed runs of one (task, agent, variant) ----------------
class PackTuneReporter:
    """A pack's evaluations: per seed what :class:`TuneReporter` records for a trial, written by the pack's writer
    thread in this order: each seed's policy snapshot, the pack checkpoint (``checkpoints/<pack>/<env_steps>/``:
    ``pack.json`` and one single-seed checkpoint per seed; the newest two kept), each seed's history and, at the
    last evaluation, its ``DONE.json``. Then it reports to Tune (the seeds' env steps together, ``seed_env_steps``)
    and mirrors each seed's history to its MLflow run. A seed that diverged gets its ``DIVERGED.json`` and its run
    FAILED at the next evaluation (or the pack's end), while the others go on.

    Args:
        pack: the pack.
        trainer: the pack's trainer (its runs say which seeds diverged, and why).
        context: the sweep's context.
        runs: per seed, its MLflow run.
        histories: per seed, the evaluations already recorded (up to the checkpoint this attempt resumed from).
    """

    def __init__(self, pack: PackId, trainer: PackedTrainer, context: TrialContext, runs: list[TrialRun],
                 histories: list[list[dict]]):
        self.pack, self.trainer, self.context, self.runs = pack, trainer, context, runs
        self.histories = [list(h) for h in histories]
        self.names = [r.name for r in trainer.runs]
        template = trainer.agent.template
        self.acting, self.every = tuple(template.acting_modules), tuple(template.modules())

    def __call__(self, metrics: dict[int, dict[str, float]], save: PackSaveFn) -> None:
        layout, writer, train = self.context.layout, self.trainer.writer, self.trainer.t
        step = int(next(iter(metrics.values()))["env_steps"])
        modules = snapshot_modules(step, train, self.context.keep_every, self.acting, self.every)
        for i in metrics if modules is not None else ():
            self._publish(layout.snapshot(self.names[i], step), MANIFEST_FILE,
                          lambda d, i=i: save(d, modules=modules, index=i))
        self._publish(layout.pack_checkpoint(self.pack, step), PACK_FILE, save)
        root = layout.pack_checkpoints(self.pack)
        # Staging folders are left alone here: the next evaluation's may already exist (cleared at the pack's start).
        writer.submit(root, lambda: prune_steps(layout.pack_checkpoint_steps(self.pack), root, leftovers=False))
        for i, m in metrics.items():
            name = self.names[i]
            self.histories[i] = [h for h in self.histories[i] if history_step(h) < step]
            self.histories[i].append({"time_ms": int(time.time() * 1000), "metrics": m})
            writer.submit(layout.history(name), lambda p=layout.history(name), h=list(self.histories[i]):
                          write_json(p, h))
            if step == train.env_steps:  # after the final snapshot in the queue: its checksums are fixed by then
                writer.submit(layout.done_marker(name), lambda n=name, m=m: write_done(layout, n, m))
        if step == train.env_steps:
            writer.flush()  # the seeds' ends are on disk before Tune hears of them (it may stop the pack then)
        seed_steps = sum(m["env_steps"] for m in metrics.values()) + sum(
            r.stopped_at[0] * train.frame_skip for r in self.trainer.runs if r.stopped_at is not None)
        tune.report({"env_steps": step, "seed_env_steps": seed_steps, "seeds_running": len(metrics),
                     "eval/return_mean": float(sum(m["eval/return_mean"] for m in metrics.values()) / len(metrics))})
        for i in metrics:
            self.runs[i].sync(self.histories[i])
        self.record_diverged(timeout_s=0)

    def _publish(self, folder: Path, marker: str, write: Callable[[Path], object]) -> None:
        """Queues ``write(staging)`` and then the staging folder's atomic move into ``folder`` (only if the write
        completed: ``marker`` is written last)."""
        staging = staging_dir(folder)

        def publish() -> None:
            if not (staging / marker).exists():  # the write failed; its error reaches the training thread
                shutil.rmtree(staging, ignore_errors=True)
                return
            publish_dir(staging, folder)

        write(staging)
        self.trainer.writer.submit(folder, publish)

    def record_diverged(self, timeout_s: float) -> None:
        """``DIVERGED.json`` and a FAILED run (with the reason) for each seed that diverged and has none yet."""
        layout, frame_skip = self.context.layout, self.trainer.t.frame_skip
        for i, run in enumerate(self.trainer.runs):
            if run.status != "diverged" or layout.diverged_marker(run.name).exists():
                continue
            reason = f"DivergenceError: {run.reason}"
            marker = {"reason": reason, "env_steps": run.stopped_at[0] * frame_skip}
            write_json(layout.diverged_marker(run.name), marker)
            self.runs[i].finish(self.histories[i], failed_reason=reason, timeout_s=timeout_s)


def _final_metrics(run: SeedRun, history: list[dict]) -> dict:
    """A finished seed's final metrics: its last history entry, or, if that was not written, what its checkpoint
    kept of the final evaluation."""
    if history and history_step(history[-1]) == run.spec.train.env_steps:
        return history[-1]["metrics"]
    last = run.evals[-1]
    return {"env_steps": last.env_steps, "eval/return_mean": last.return_mean}


def write_done(layout: SweepDir, name: str, metrics: dict) -> None:
    """A finished seed run's ``DONE.json``: its final metrics and the policy checksums it records."""
    write_json(layout.done_marker(name), {**metrics, DONE_KEY: asdict(recorded_values(layout, name))})


def train_pack(config: dict, context: TrialContext) -> None:
    """Tune function trainable of a pack; the Ray boundary is crossed once, here (config -> the seeds' RunSpecs).

    Args:
        config: this Tune trial's config, ``{"pack": {"name": pack name, "trials": [{"name", "run"}, ...]}}``.
        context: the sweep's context (bound by the driver with ``tune.with_parameters``).
    """
    trials = config["pack"]["trials"]
    names, specs = [t["name"] for t in trials], [RunSpec.model_validate(t["run"]) for t in trials]
    pack, layout = PackId.of(names), context.layout
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731 - the worker's log
    limit_http_retries()
    # Outside Ray (a test, a local re-run) there is no node to record, and asking would start a Ray instance.
    node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    tags = pack_tags(pack.name, len(names))
    runs = [TrialRun(context.tracking_uri, context.experiment, context.sweep_id, context.parent_run_id, n,
                     s.model_dump(mode="json"), node_id=node, log=log, run_tags=tags) for n, s in zip(names, specs)]
    _limit_gpu_memory(context.gpu_fraction)
    reporter = None
    trainer = build_packed_trainer(specs, lambda metrics, save: reporter(metrics, save),
                                   [layout.replay(n) for n in names], names, context.env_workers, log, pack=pack.name)
    try:
        prune_steps(layout.pack_checkpoint_steps(pack), layout.pack_checkpoints(pack))  # a crash's staging folders
        resumed = restore_latest(trainer, layout, pack.name, log, layout.pack_checkpoint_steps(pack))
        histories = [[h for h in layout.read_history(n) if resumed is not None and history_step(h) <= resumed]
                     for n in names]
        reporter = PackTuneReporter(pack, trainer, context, runs, histories)
        for run, history in zip(runs, histories):
            run.sync(history, tags={} if resumed is None else {"qed.resumed_from_env_step": resumed})
        try:
            summaries = trainer.run()
        except Exception as e:  # noqa: BLE001 - note it on the runs (best-effort), then let Tune retry the pack
            for run, history in zip(runs, reporter.histories):
                run.sync(history, tags={"qed.last_error": f"{type(e).__name__}: {e}"[:5000]})
            raise
    finally:
        trainer.close()
    reporter.record_diverged(timeout_s=context.mlflow_timeout_s)
    for i, (name, summary) in enumerate(zip(names, summaries)):
        if summary["status"] != "finished":
            continue
        if not layout.done_marker(name).exists():  # the worker died after the final checkpoint, before DONE.json
            write_done(layout, name, _final_metrics(trainer.runs[i], reporter.histories[i]))
        runs[i].finish(reporter.histories[i], tags={"qed.status": "finished",
                                                    **checksum_tags(done_checksums(layout, name))},
                       timeout_s=context.mlflow_timeout_s)
        if not context.keep_replay:
            prune_chunks(layout.replay(name))
