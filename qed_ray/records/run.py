"""What a seed run records in its run folder, one model per file (:mod:`qed_ray.records.codec`), read back by the trainer,
the service and the gather step alike."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import AfterValidator, ConfigDict, Field

from qed_ray.spec.config import RunSpec
from qed_ray.records.codec import Num, Record, RecordError, parse, read_record, write_record
from qed_ray.records.layout import SweepDir

STATUSES = ("running", "finished", "diverged")


def _has_env_steps(metrics: dict) -> dict:
    steps = metrics.get("env_steps")
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"env_steps must be an integer >= 0 (got {steps!r})")
    return metrics


# One evaluation's metrics by name (``eval/return_mean``, ``alpha/actor_mean``, ...), ``env_steps`` among them;
# counts stay integers, an unknown value (NaN, or ``perf/eta_s`` before it is measured) is NaN.
Metrics = Annotated[dict[str, Union[int, Num]], AfterValidator(_has_env_steps)]


class EvalRecord(Record):
    """One evaluation of a run: env steps, mean deterministic eval return, and two interval means of its updates:
    the actor's alpha and the double-critic gap |Q1 - Q2| (the critic proxy's x, paper App. D). NaN where the
    interval had no update (all warm-up), and ``q_gap_mean`` where a record predates it."""

    env_steps: int = Field(ge=0)
    return_mean: Num
    alpha_mean: Num
    q_gap_mean: Num = math.nan


class HistoryEntry(Record):
    """One evaluation in ``history.json``: its metrics and when they were recorded (ms since the epoch; MLflow
    keeps the time, so logging an entry twice adds nothing)."""

    time_ms: int = Field(ge=0)
    metrics: Metrics

    @property
    def env_steps(self) -> int:
        """The env step of the evaluation."""
        return int(self.metrics["env_steps"])


class DoneRecord(Record):
    """``DONE.json``: a finished trial's final metrics (its last evaluation's, flat) and, under ``files``, the
    SHA-256 of every file the gather step reads of it by its path under the trial's policies folder (what a failed
    check names, believed only when it hashes to the digest the trial signed in MLflow: qed_ray.analysis.checksums;
    absent in a file written before trials listed them). ``checksums``: what qed_ray wrote there before results
    were signed (read, never trusted or used)."""

    model_config = ConfigDict(frozen=True, extra="allow", strict=True)
    __pydantic_extra__: dict[str, Union[int, Num]]

    env_steps: int = Field(ge=0)
    files: dict[str, str] | None = None
    unverified: str | None = None  # why its worker recorded no signed digest (a tracking outage, no key); None: it did
    checksums: dict[str, str] | None = Field(default=None, exclude=True)  # read, never written again

    @property
    def metrics(self) -> dict[str, float]:
        """The final metrics (``env_steps`` among them)."""
        return {"env_steps": self.env_steps, **(self.model_extra or {})}


class DivergedRecord(Record):
    """``DIVERGED.json``: why a trial stopped for good (a NaN/inf, ``DivergenceError: ...``) and at which env step."""

    reason: str
    env_steps: int = Field(ge=0)


RUN_FORMAT = 2  # run.json {"format", "pack", "runs"}; format 1 (qed_ray 0.1) held one run and is not resumed


class RunFile(Record):
    """``run.json``: the validated runs of the pack a run folder trains (format 1, one run of qed_ray 0.1, is not
    resumed)."""

    format: Literal[RUN_FORMAT]
    pack: str
    runs: list[RunSpec]


class Timings(Record):
    """A pack's counters (its seeds act and update in lock-step) and where its time went: ``wall_s`` real time in
    the training loop over every start of the pack, of it ``warmup_s`` in warm-up decisions, ``train_s`` in
    decisions with updates and ``eval_s`` evaluating and reporting (checkpoints, snapshots, logging); ``cpu_s`` the
    CPU time its process and env workers used in that loop. The one declaration of these fields: ``pack.json``, a
    seed's checkpoint progress, ``summary.json`` and the trainer's live counters extend it (a file written before
    the three parts existed lacks them: 0; before ``cpu_s`` did, or a pack resumed from such a file: None)."""

    decisions: int = Field(ge=0)
    updates: int = Field(ge=0)
    wall_s: Num
    warmup_s: Num = 0.0
    train_s: Num = 0.0
    eval_s: Num = 0.0
    cpu_s: float | None = Field(None, ge=0)  # None: not recorded (never 0)


class RunSummary(Timings):
    """A seed run's final figures: the run CLI's ``<trial>/summary.json`` (``reason`` when it diverged); its
    counters are the seed's (up to where it stopped), its timings the pack's."""

    name: str
    task: str
    agent: str
    variant: str
    seed: int = Field(ge=0)
    status: Literal[STATUSES]
    env_steps: int = Field(ge=0)
    pack_size: int = Field(ge=1)
    precision: str
    update_mode: Literal["off", "compile", "graph"] = "off"  # train.compile resolved (summaries before it: eager)
    updates_per_s: Num
    final_eval_return_mean: Num
    final_eval_return_std: Num
    alpha_mean_over_training: Num
    final_alpha: dict[str, Num]
    evals: list[EvalRecord]
    reason: str | None = None


def done_record(metrics: dict, files: dict[str, str] | None, unverified: str | None = None) -> DoneRecord:
    """The ``DONE.json`` of a trial that finished with these final metrics and files and, if its digest was not
    signed, why (raises RecordError if they are not a valid record: a trainer bug, caught before anything is
    written)."""
    return parse(DoneRecord, {**metrics, "files": files, "unverified": unverified}, "DONE.json")


def read_done(layout: SweepDir, name: str) -> DoneRecord:
    """The trial's ``DONE.json``; raises :class:`~qed_ray.records.codec.RecordError` naming the file and the field."""
    return read_record(layout.done_marker(name), DoneRecord)


def read_diverged(layout: SweepDir, name: str) -> DivergedRecord:
    """The trial's ``DIVERGED.json``; raises :class:`~qed_ray.records.codec.RecordError` naming the file and the field."""
    return read_record(layout.diverged_marker(name), DivergedRecord)


def diverged_reason(layout: SweepDir, name: str) -> str:
    """The reason ``DIVERGED.json`` records; for a damaged file, ``diverged`` and what is wrong with the file (the
    trial stays diverged either way: the marker is there)."""
    try:
        return read_diverged(layout, name).reason
    except RecordError as e:
        return f"diverged ({e})"


def read_history(layout: SweepDir, name: str) -> list[HistoryEntry]:
    """The trial's recorded evaluations, oldest first (``[]`` before its first one); raises
    :class:`~qed_ray.records.codec.RecordError` naming the file and the entry for a damaged file."""
    path = layout.history(name)
    if not os.path.lexists(path):
        return []
    return read_record(path, list[HistoryEntry])


def write_history(path: Path, entries: list[HistoryEntry]) -> None:
    """Writes ``history.json`` (atomically, strict JSON)."""
    write_record(path, entries, list[HistoryEntry], indent=None)
