"""A pack's record in a run folder laid out as a sweep folder (:class:`~qed_ray.records.layout.SweepDir`): what both the
single-run CLI and a sweep trial write at each evaluation, and how a pack resumes from it (no Ray, no MLflow;
docs/design.md, "Data flow" and "Resume" item 9)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Callable

from qed_ray.records.atomic import TMP_MARK, publish_dir, staging_dir
from qed_ray.records.codec import Record, read_record, write_record
from qed_ray.spec.config import TrainSpec
from qed_ray.records.layout import PACK_FILE, PackId, SweepDir
from qed_ray.records.checkpoint import MANIFEST_FILE, CheckpointError, CheckpointVersionError
from qed_ray.records.digests import Signer, differences, file_sha256, inventory, snapshot_files
from qed_ray.rl.pack import SeedRun
from qed_ray.rl.trainer import SaveFn, Trainer
from qed_ray.records.run import DivergedRecord, HistoryEntry, done_record, read_history, write_history

KEEP_CHECKPOINTS = 2  # the newest two: a damaged newest one still leaves one to resume from


def snapshot_modules(env_steps: int, train: TrainSpec, keep_every: int, acting: tuple[str, ...],
                     every: tuple[str, ...]) -> tuple[str, ...] | None:
    """Modules of the policy snapshot kept at the evaluation at ``env_steps`` (None: none): every ``keep_every``-th
    the ``acting`` ones, enough to act and to compare seeds (V over training, paper App. E); the final one
    ``every`` module, since the critic-proxy analysis reads the final critics (paper App. D)."""
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

    A checkpoint that cannot be used is reported and the next older one tried (each restore overwrites what a
    failed one loaded); none intact raises CheckpointError naming each. When every one is of an older format (its
    random streams differ, so it cannot continue the same run) the pack starts over, saying so; with ``start_over``
    False (the run CLI: its user decides) the first such one raises CheckpointVersionError instead.
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


FILES_FILE = "files.json"  # in a pack checkpoint: the files its worker wrote of each seed, signed in a sweep


class CheckpointFiles(Record):
    """A pack checkpoint's ``files.json``: per seed, the files (path under its policies folder: SHA-256) its worker
    wrote up to this checkpoint and, in a sweep, their HMAC under the results key (design.md, "Trusting results")."""

    files: dict[str, dict[str, str]]
    macs: dict[str, str] | None = None


def write_done(layout: SweepDir, name: str, metrics: dict, files: dict[str, str] | None,
               unverified: str | None = None) -> None:
    """A finished seed run's ``DONE.json`` (:class:`~qed_ray.records.run.DoneRecord`): its final metrics, the
    SHA-256 of every file its worker wrote that the gather step reads (what a failed check names, never what it
    trusts) and, if its digest was not signed, why."""
    write_record(layout.done_marker(name), done_record(metrics, files, unverified))


def final_metrics(run: SeedRun, history: list[HistoryEntry]) -> dict:
    """A finished seed's final metrics: its last history entry, or, if that was not written, what its checkpoint
    kept of the final evaluation."""
    if history and history[-1].env_steps == run.spec.train.env_steps:
        return dict(history[-1].metrics)
    last = run.evals[-1]
    return {"env_steps": last.env_steps, "eval/return_mean": last.return_mean}


# How a finished seed's end is recorded: given its pack index, the files its worker wrote (None: an older checkpoint
# recorded none) and the differences on disk, it signs what it may and returns why nothing was signed (None: signed).
Finisher = Callable[[int, "dict[str, str] | None", "list[str]"], "str | None"]


class FolderReporter:
    """Records a pack's evaluations in its run folder (docs/design.md, "Data flow"), then calls ``after(metrics)``
    (a sweep reports to Tune and MLflow there; the CLI prints). ``histories``: per seed, the evaluations already
    recorded; ``signer`` signs each checkpoint's ``files.json`` (None: unsigned, the run CLI)."""

    def __init__(self, layout: SweepDir, pack: PackId, trainer: Trainer, keep_every: int,
                 histories: list[list[HistoryEntry]],
                 after: Callable[[dict[int, dict]], None] = lambda metrics: None, signer: Signer | None = None):
        self.layout, self.pack, self.trainer, self.keep_every, self.after = layout, pack, trainer, keep_every, after
        self.histories = [list(h) for h in histories]
        self.names = [r.name for r in trainer.runs]
        self.signer = signer
        # Per seed, the files its worker wrote (from this attempt's writes and the checkpoint it resumed from);
        # None: its checkpoint, written by an older qed_ray, records none. Touched by the writer thread only.
        self.written: list[dict[str, str] | None] = [{} for _ in self.names]
        template = trainer.agent.template
        self.acting, self.every = tuple(template.acting_modules), tuple(template.modules())

    def __call__(self, metrics: dict[int, dict[str, float]], save: SaveFn) -> None:
        layout, writer, train = self.layout, self.trainer.writer, self.trainer.t
        step = int(next(iter(metrics.values()))["env_steps"])
        modules = snapshot_modules(step, train, self.keep_every, self.acting, self.every)
        for i in metrics if modules is not None else ():
            self._publish(layout.snapshot(self.names[i], step), MANIFEST_FILE,
                          lambda d, i=i: save(d, modules=modules, index=i), i)
        for i, m in metrics.items():
            name = self.names[i]
            # Before the checkpoint, whose files.json lists it: a crash before the checkpoint lands re-runs this
            # interval from the one before and records it again.
            self.histories[i] = [h for h in self.histories[i] if h.env_steps < step]
            self.histories[i].append(HistoryEntry(time_ms=int(time.time() * 1000), metrics=m))
            writer.submit(layout.history(name), lambda i=i, h=list(self.histories[i]): self._write_history(i, h))
        self._publish(layout.pack_checkpoint(self.pack, step), PACK_FILE, save, files_at=step)
        root = layout.pack_checkpoints(self.pack)
        # Staging folders are left alone here: the next evaluation's may already exist (cleared at the pack's start).
        writer.submit(root, lambda: prune_steps(layout.pack_checkpoint_steps(self.pack), root, leftovers=False))
        if step == train.env_steps:
            writer.flush()  # the seeds' ends are on disk before anyone hears of them (Tune may stop the pack then)
        self.after(metrics)

    def _write_history(self, i: int, entries: list[HistoryEntry]) -> None:
        path = self.layout.history(self.names[i])
        write_history(path, entries)
        if self.written[i] is not None:
            self.written[i][path.relative_to(self.layout.policies(self.names[i])).as_posix()] = file_sha256(path)

    def _publish(self, folder: Path, marker: str, write: Callable[[Path], object], seed: int | None = None,
                 files_at: int | None = None) -> None:
        """Queues ``write(staging)`` and then the staging folder's atomic move into ``folder`` (only if the write
        completed: ``marker`` is written last); a snapshot of ``seed`` is added to the files its worker wrote, a
        checkpoint at env step ``files_at`` gets its ``files.json`` before the move."""
        staging = staging_dir(folder)

        def publish() -> None:
            if not (staging / marker).exists():  # the write failed; its error reaches the training thread
                shutil.rmtree(staging, ignore_errors=True)
                return
            if files_at is not None:
                write_record(staging / FILES_FILE, self._files_record(files_at))
            if seed is not None and self.written[seed] is not None:  # hashed as written, before anyone else sees it
                self.written[seed].update(snapshot_files(self.layout.policies(self.names[seed]), folder, staging))
            publish_dir(staging, folder)

        write(staging)
        self.trainer.writer.submit(folder, publish)

    def _files_record(self, step: int) -> CheckpointFiles:
        files = {n: dict(w) for n, w in zip(self.names, self.written) if w is not None}
        macs = None if self.signer is None else {n: self.signer.checkpoint(n, step, f) for n, f in files.items()}
        return CheckpointFiles(files=files, macs=macs)

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

    def finish(self, finisher: Finisher = lambda i, files, differences: None) -> list[str]:
        """After the trainer returned, each finished seed without a ``DONE.json`` (docs/design.md, "Resume" item 9):
        ``finisher`` signs what its worker wrote (a file only found on disk is named, never signed), then its
        ``DONE.json`` is written. Returns the seeds finished here."""
        done = []
        for i, run in enumerate(self.trainer.runs):
            if run.status != "finished" or os.path.lexists(self.layout.done_marker(run.name)):
                continue
            written = self.written[i]
            changed = differences(inventory(self.layout, run.name), written) if written is not None else []
            for line in changed:
                self.trainer.log(f"WARNING {run.name}: {self.layout.policies(run.name) / line}; not signed")
            unverified = finisher(i, written, changed)
            write_done(self.layout, run.name, final_metrics(run, self.histories[i]), written, unverified)
            done.append(run.name)
        return done

    def resume(self, log: Callable[[str], None], start_over: bool = True) -> int | None:
        """Clears a crash's staging folders, restores the newest intact checkpoint (:func:`restore_latest`) and keeps
        each seed's history up to it and the files its worker wrote (its ``files.json``, refused when damaged or not
        signed by this sweep's key); returns its env step (None: a fresh start)."""
        prune_steps(self.layout.pack_checkpoint_steps(self.pack), self.layout.pack_checkpoints(self.pack))
        resumed = restore_latest(self.trainer, self.layout, self.pack, log, start_over)
        self.histories = [[h for h in read_history(self.layout, n) if resumed is not None and h.env_steps <= resumed]
                          for n in self.names]
        self.written = [{} for _ in self.names] if resumed is None else self._written_at(resumed)
        return resumed

    def _written_at(self, step: int) -> list[dict[str, str] | None]:
        """The files the checkpoint at ``step`` says its worker wrote of each seed. A checkpoint of an older qed_ray
        has no ``files.json``: a seed it left unfinished vouches for its files on disk up to ``step`` (an unfinished
        trial's files are not covered, docs/design.md), a finished one for none (None)."""
        path = self.layout.pack_checkpoint(self.pack, step) / FILES_FILE
        if not os.path.lexists(path):
            return [None if self.trainer.state.status(r) == "finished" else
                    {p: h for p, h in inventory(self.layout, n).items() if _step_of(p) <= step}
                    for n, r in zip(self.names, self.trainer.runs)]
        record = read_record(path, CheckpointFiles, CheckpointError)
        out = []
        for n in self.names:
            files = record.files.get(n)
            if files is None:
                raise CheckpointError(f"{path}: files.{n}: missing")
            if self.signer is not None and not self.signer.checks(n, step, files, (record.macs or {}).get(n)):
                raise CheckpointError(f"{path}: macs.{n}: not this sweep's signature of its files (edited since it "
                                      f"was written); refusing to resume from it")
            out.append(dict(files))
        return out


def _step_of(path: str) -> int:
    """The env step of ``0000001000/state.pt`` under a policies folder; -1 for ``history.json``."""
    head = path.split("/", 1)[0]
    return int(head) if head.isdigit() else -1
