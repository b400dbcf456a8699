"""One group's way from finished trials to a (cached) evaluation; Ray-free, shared by the live gather actor, the
re-analysis command and ``--status``.

A group's evaluation depends on its seeds' final policies, the final-evaluation settings that change rollouts
or per-group numbers, and on the analysis code. The cache key is the SHA-256 of exactly those:
:data:`ANALYSIS_VERSION`, the group, each seed's final ``state.pt`` SHA-256 as its trial recorded it, the
:data:`EVAL_FIELDS` of ``final_eval`` and, where they differ from their defaults, its :data:`OPTIONAL_EVAL_FIELDS`
(the evaluation policies and the critic-proxy window: keys written before they existed stay valid). The bootstrap
settings only change the tables, which are recomputed from cached groups. A restarted driver finds every unchanged
group under ``gather/cache/<key>.json`` and evaluates nothing again; a retrained seed, another
``final_eval.episodes`` or another evaluation policy is another key.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict

from qed_ray.analysis.checksums import verify
from qed_ray.analysis.group_eval import evaluate_group, trial_record
from qed_ray.analysis.results import FailedTrial, GroupKey, GroupResult, TrialRecord
from qed_ray.codec import RecordError, read_record, write_record
from qed_ray.layout import SweepDir, TrialId
from qed_ray.rl.checkpoint import SNAPSHOT_FORMATS, CheckpointError, read_manifest
from qed_ray.rl.digests import Recorded
from qed_ray.spec import FinalEvalSpec

# Bump whenever evaluate_group gives other numbers for the same policies and settings (3: where QED sat).
ANALYSIS_VERSION = 3
EVAL_FIELDS = ("episodes", "action_rollouts", "action_steps", "curve_episodes")
OPTIONAL_EVAL_FIELDS = ("policies", "proxy_window")


def cache_key(group: GroupKey, policies: dict[int, str], final_eval: FinalEvalSpec) -> str:
    """The hex key of a group's evaluation: version, group, ``{seed: final state.pt SHA-256}``, eval settings."""
    settings = {f: getattr(final_eval, f) for f in EVAL_FIELDS}
    settings.update({f: getattr(final_eval, f) for f in OPTIONAL_EVAL_FIELDS
                     if getattr(final_eval, f) != FinalEvalSpec.model_fields[f].default})
    payload = {"analysis_version": ANALYSIS_VERSION, "group": list(group),
               "policies": {str(seed): sha for seed, sha in sorted(policies.items())}, "final_eval": settings}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


class CacheEntry(BaseModel):
    """``gather/cache/<key>.json``: one group's evaluation under its key and the analysis version that made it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str
    analysis_version: int
    group: GroupResult


def read_entry(layout: SweepDir, key: str, group: GroupKey | None = None) -> GroupResult | None:
    """The cached evaluation under ``key`` (None: none cached); raises :class:`~qed_ray.codec.RecordError` naming
    the file and the field for a damaged entry, or one of another key, analysis version or group."""
    path = layout.cached_group(key)
    if not os.path.lexists(path):
        return None
    entry = read_record(path, CacheEntry)
    for name, have, want in (("key", entry.key, key), ("analysis_version", entry.analysis_version, ANALYSIS_VERSION),
                             ("group", entry.group.key, group or entry.group.key)):
        if have != want:
            raise RecordError(f"{path}: {name}: {have!r}, not this entry's {want!r}")
    return entry.group


def load(layout: SweepDir, key: str, group: GroupKey | None = None,
         log: Callable[[str], Any] = print) -> GroupResult | None:
    """The cached evaluation of ``group`` under ``key``, or None (none, or a damaged or foreign entry: ``log``
    names it, and the group is evaluated again and the entry rewritten)."""
    try:
        return read_entry(layout, key, group)
    except RecordError as e:
        log(f"WARNING: {e}; evaluating the group again")
        return None


def store(layout: SweepDir, key: str, result: GroupResult, log: Callable[[str], Any] = print) -> None:
    """Writes the evaluation under ``key`` (atomically and durably: a reader never sees half a file). A place that
    cannot take it (a folder or a dangling link where the entry belongs) is named in ``log`` and left as it is: the
    result is used all the same and the group is evaluated again next time."""
    path = layout.cached_group(key)
    try:
        if os.path.lexists(path) and not path.is_file():
            raise IsADirectoryError(f"{'a folder' if path.is_dir() else 'a dangling symbolic link'} is in its place")
        write_record(path, CacheEntry(key=key, analysis_version=ANALYSIS_VERSION, group=result), indent=None)
    except OSError as e:
        log(f"WARNING: {path}: cannot be written ({e}); the group is evaluated again next time")


def plan_groups(names: list[str]) -> dict[GroupKey, list[str]]:
    """Trial names ``task/agent/variant/seed`` per group, groups and names sorted."""
    out: dict[GroupKey, list[str]] = {}
    for name in sorted(names):
        t = TrialId.from_name(name)
        out.setdefault(GroupKey(t.task, t.agent, t.variant), []).append(name)
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class GroupJob:
    """A group ready to evaluate: the finished seeds' records, what they recorded, the cache key, and the seeds
    left out with their reasons. ``recorded`` None: snapshots are not checked (re-analysis ``--no-verify``)."""

    group: GroupKey
    records: list[TrialRecord]
    recorded: dict[str, Recorded] | None
    key: str
    excluded: list[FailedTrial] = field(default_factory=list)


def prepare(layout: SweepDir, group: GroupKey, finished: list[str], recorded: dict[str, Recorded] | None,
            final_eval: FinalEvalSpec) -> GroupJob:
    """Reads the finished trials' records from their snapshots; a trial without a usable final snapshot or, when
    checking, without a recorded checksum is left out with the reason."""
    records, excluded = [], []
    for name in sorted(finished):
        try:
            record = trial_record(layout, name)
        except (OSError, ValueError, CheckpointError) as e:
            excluded.append(FailedTrial(name, str(e)))
            continue
        if recorded is not None and name not in recorded:
            excluded.append(FailedTrial(name, "no policy checksum recorded in MLflow at the trial's end, so its "
                                              "snapshots cannot be checked"))
            continue
        records.append(record)
    policies = {r.seed: recorded[r.name].policy_sha256 if recorded is not None
                else read_manifest(r.policies[max(r.policies)], SNAPSHOT_FORMATS).state_sha256 for r in records}
    return GroupJob(group, records, recorded, cache_key(group, policies, final_eval), excluded)


def evaluate(job: GroupJob, final_eval: FinalEvalSpec, device: str = "cpu") -> GroupResult:
    """Checks every snapshot against what its trial recorded (unless unchecked), then evaluates the group.

    Raises:
        TamperedSnapshotError: a snapshot differs from its recorded checksum (the message names the file).
    """
    if job.recorded is not None:
        for record in job.records:
            verify(record, job.recorded[record.name])
    return evaluate_group(job.records, final_eval, device)
