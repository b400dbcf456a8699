"""A pack's record in a run folder laid out as a sweep folder (:class:`~qed_ray.layout.SweepDir`): what both the
single-run CLI and a sweep trial write at each evaluation, and how a pack resumes from it (no Ray, no MLflow).

At each evaluation, queued on the trainer's writer thread in this order: each seed's policy snapshot
(``policies/<trial>/<env_steps>/``), the pack checkpoint (``checkpoints/<pack>/<env_steps>/``, the newest two
kept), each seed's history (``policies/<trial>/history.json``) and, at the last evaluation, its ``DONE.json`` with
the SHA-256 of every file the gather step reads of it (:mod:`qed_ray.rl.digests`). A seed that diverged gets its
``DIVERGED.json``. A started, retried or resumed pack restores its newest intact checkpoint (an older one if the
newest is damaged).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Callable

from qed_ray.atomic import TMP_MARK, publish_dir, staging_dir
from qed_ray.codec import write_record
from qed_ray.config import TrainSpec
from qed_ray.layout import PACK_FILE, PackId, SweepDir
from qed_ray.rl.checkpoint import MANIFEST_FILE, CheckpointError, CheckpointVersionError
from qed_ray.rl.digests import inventory
from qed_ray.rl.pack import SeedRun
from qed_ray.rl.trainer import SaveFn, Trainer
from qed_ray.run_records import DivergedRecord, HistoryEntry, done_record, read_history, write_history

KEEP_CHECKPOINTS = 2  # the newest two: a damaged newest one still leaves one to resume from


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


def prune_steps(steps: dict[int, Path], root: Path, keep: int = KEEP_CHECKPOINTS, leftovers: bool = True) -> None:
    """Deletes all but the newest ``keep`` of the checkpoint folders ``steps`` (``{env_steps: folder}``) under
    ``root`` and, with ``leftovers``, the staging folders a crash left there."""
    for step in sorted(steps)[:-keep]:
        shutil.rmtree(steps[step])
    for leftover in root.glob(f".*{TMP_MARK}*") if leftovers else ():
        shutil.rmtree(leftover, ignore_errors=True)


def restore_latest(trainer: Trainer, layout: SweepDir, pack: PackId, log: Callable[[str], None],
                   start_over: bool = True) -> int | None:
    """Restores the pack's newest intact checkpoint; returns its env step, or None if it has none.

    A checkpoint that cannot be used (corrupt ``state.pt``, a damaged or missing replay chunk) is reported and the
    next older one is tried; each restore overwrites everything a failed one may have loaded. When every checkpoint
    was written by an older qed_ray (another format version: its random streams differ, so it cannot continue the
    same run) the pack starts over, saying so; with ``start_over`` False (the run CLI: its user decides) the first
    such checkpoint is refused instead.

    Raises:
        CheckpointError: every checkpoint is damaged (naming each file). CheckpointVersionError: a checkpoint of
            another format, with ``start_over`` False.
    """
    problems, outdated = [], 0
    for step, folder in sorted(layout.pack_checkpoint_steps(pack).items(), reverse=True):
        try:
            trainer.restore(folder)
        except CheckpointError as e:
            if isinstance(e, CheckpointVersionError) and not start_over:
                raise
            problems.append(str(e))
            outdated += isinstance(e, CheckpointVersionError)
            log(f"WARNING {pack.name}: cannot resume from {folder}: {e}")
            continue
        if problems:
            log(f"WARNING {pack.name}: resumed from the older checkpoint at env step {step}")
        return step
    if problems and outdated == len(problems):
        log(f"WARNING {pack.name}: every checkpoint was written by an older qed_ray; starting this pack over")
        return None
    if problems:
        raise CheckpointError(f"{pack.name}: no intact checkpoint: {'; '.join(problems)}")
    return None


def write_done(layout: SweepDir, name: str, metrics: dict) -> None:
    """A finished seed run's ``DONE.json`` (:class:`~qed_ray.run_records.DoneRecord`): its final metrics and the
    SHA-256 of every file the gather step reads of it (:func:`qed_ray.rl.digests.inventory`; what a failed check
    names, never what it trusts)."""
    write_record(layout.done_marker(name), done_record(metrics, inventory(layout, name)))


def final_metrics(run: SeedRun, history: list[HistoryEntry]) -> dict:
    """A finished seed's final metrics: its last history entry, or, if that was not written, what its checkpoint
    kept of the final evaluation."""
    if history and history[-1].env_steps == run.spec.train.env_steps:
        return dict(history[-1].metrics)
    last = run.evals[-1]
    return {"env_steps": last.env_steps, "eval/return_mean": last.return_mean}


class FolderReporter:
    """Records a pack's evaluations in its run folder (module docstring), then calls ``after(metrics)``.

    Args:
        layout: the run folder.
        pack: the pack.
        trainer: its trainer (its runs say which seeds diverged, and why; its writer writes the files).
        keep_every: keep a policy snapshot every n-th evaluation (and the last).
        histories: per seed, the evaluations already recorded (up to the checkpoint this attempt resumed from).
        after: called with ``{pack index: metrics}`` once the evaluation is queued (a sweep reports to Tune and
            MLflow there; the CLI prints).
    """

    def __init__(self, layout: SweepDir, pack: PackId, trainer: Trainer, keep_every: int,
                 histories: list[list[HistoryEntry]],
                 after: Callable[[dict[int, dict]], None] = lambda metrics: None):
        self.layout, self.pack, self.trainer, self.keep_every, self.after = layout, pack, trainer, keep_every, after
        self.histories = [list(h) for h in histories]
        self.names = [r.name for r in trainer.runs]
        template = trainer.agent.template
        self.acting, self.every = tuple(template.acting_modules), tuple(template.modules())

    def __call__(self, metrics: dict[int, dict[str, float]], save: SaveFn) -> None:
        layout, writer, train = self.layout, self.trainer.writer, self.trainer.t
        step = int(next(iter(metrics.values()))["env_steps"])
        modules = snapshot_modules(step, train, self.keep_every, self.acting, self.every)
        for i in metrics if modules is not None else ():
            self._publish(layout.snapshot(self.names[i], step), MANIFEST_FILE,
                          lambda d, i=i: save(d, modules=modules, index=i))
        self._publish(layout.pack_checkpoint(self.pack, step), PACK_FILE, save)
        root = layout.pack_checkpoints(self.pack)
        # Staging folders are left alone here: the next evaluation's may already exist (cleared at the pack's start).
        writer.submit(root, lambda: prune_steps(layout.pack_checkpoint_steps(self.pack), root, leftovers=False))
        for i, m in metrics.items():
            name = self.names[i]
            # The history after the checkpoint: a crash in between re-runs this interval and records it then.
            self.histories[i] = [h for h in self.histories[i] if h.env_steps < step]
            self.histories[i].append(HistoryEntry(time_ms=int(time.time() * 1000), metrics=m))
            writer.submit(layout.history(name), lambda p=layout.history(name), h=list(self.histories[i]):
                          write_history(p, h))
            if step == train.env_steps:  # after the final snapshot and history in the queue: the files it lists are final
                writer.submit(layout.done_marker(name), lambda n=name, m=m: write_done(layout, n, m))
        if step == train.env_steps:
            writer.flush()  # the seeds' ends are on disk before anyone hears of them (Tune may stop the pack then)
        self.after(metrics)

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

    def record_diverged(self) -> list[int]:
        """``DIVERGED.json`` for each seed that diverged and has none yet; returns their pack indices."""
        out = []
        for i, run in enumerate(self.trainer.runs):
            if run.status == "diverged" and not self.layout.diverged_marker(run.name).exists():
                steps = run.stopped_at[0] * self.trainer.t.frame_skip
                write_record(self.layout.diverged_marker(run.name),
                             DivergedRecord(reason=f"DivergenceError: {run.reason}", env_steps=steps))
                out.append(i)
        return out

    def finish(self) -> list[str]:
        """After the trainer returned: ``DONE.json`` for each finished seed whose final evaluation did not write one
        (its worker died between the checkpoint and the marker); returns the finished seeds' names."""
        done = []
        for i, run in enumerate(self.trainer.runs):
            if run.status == "finished":
                if not self.layout.done_marker(run.name).exists():
                    write_done(self.layout, run.name, final_metrics(run, self.histories[i]))
                done.append(run.name)
        return done

    def resume(self, log: Callable[[str], None], start_over: bool = True) -> int | None:
        """Clears a crash's staging folders, restores the newest intact checkpoint and keeps each seed's history up
        to it; returns its env step (None: a fresh start). ``start_over``: as :func:`restore_latest`'s.

        Raises:
            CheckpointError: no checkpoint can be used. RecordError: a damaged ``history.json`` (naming it).
        """
        prune_steps(self.layout.pack_checkpoint_steps(self.pack), self.layout.pack_checkpoints(self.pack))
        resumed = restore_latest(self.trainer, self.layout, self.pack, log, start_over)
        self.histories = [[h for h in read_history(self.layout, n) if resumed is not None and h.env_steps <= resumed]
                          for n in self.names]
        return resumed
