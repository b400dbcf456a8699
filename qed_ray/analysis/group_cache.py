"""One group's way from finished trials to a (cached) evaluation; Ray-free, shared by the live gather actor, the
re-analysis command and ``--status``. The cache key: docs/results.md, "Cache"; the checks of every seed and entry
before use, and unverified seeds: docs/design.md, "Trusting results"."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict

from qed_ray.analysis.checksums import TamperedSnapshotError, Verifier, verify
from qed_ray.analysis.group_eval import evaluate_group, trial_record
from qed_ray.analysis.results import FailedTrial, GroupKey, GroupResult, TrialRecord
from qed_ray.records.codec import RecordError, dump, read_record, write_record
from qed_ray.records.layout import SweepDir, TrialId
from qed_ray.records.checkpoint import SNAPSHOT_FORMATS, CheckpointError, read_manifest
from qed_ray.records.digests import sign
from qed_ray.spec.sweep import FinalEvalSpec

# Bump whenever evaluate_group gives other numbers for the same policies and settings (3: where QED sat; 4: the
# random policy's score, the verdict's learning floor).
ANALYSIS_VERSION = 4
EVAL_FIELDS = ("episodes", "action_rollouts", "action_steps", "curve_episodes")
OPTIONAL_EVAL_FIELDS = ("policies", "proxy_window")  # keyed only off their defaults: older keys stay valid


def cache_key(group: GroupKey, policies: dict[int, str], final_eval: FinalEvalSpec) -> str:
    """The hex key of a group's evaluation: version, group, ``{seed: final state.pt SHA-256}``, eval settings."""
    settings = {f: getattr(final_eval, f) for f in EVAL_FIELDS}
    settings.update({f: getattr(final_eval, f) for f in OPTIONAL_EVAL_FIELDS
                     if getattr(final_eval, f) != FinalEvalSpec.model_fields[f].default})
    payload = {"analysis_version": ANALYSIS_VERSION, "group": list(group),
               "policies": {str(seed): sha for seed, sha in sorted(policies.items())}, "final_eval": settings}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


class TamperedCacheError(RuntimeError):
    """A cache entry whose content does not carry the results key's signature (edited since); names the file."""


class CacheEntry(BaseModel):
    """``gather/cache/<key>.json``: one group's evaluation under its key and analysis version; ``mac``, the HMAC of the
    rest under the user's results key (None: written before entries were signed)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str
    analysis_version: int
    group: GroupResult
    mac: str | None = None


def _entry_signature(signing_key: bytes, entry: CacheEntry) -> str:
    content = {k: v for k, v in dump(entry).items() if k != "mac"}
    return sign(signing_key, "group cache", json.dumps(content, sort_keys=True, separators=(",", ":")))


def read_entry(layout: SweepDir, key: str, group: GroupKey | None = None,
               signing_key: bytes | None = None) -> GroupResult | None:
    """The cached evaluation under ``key`` (None: none cached or, with a ``signing_key``, one written before entries
    were signed; ``signing_key`` None: the signature is not checked, as by ``--status`` without a results key).
    Raises RecordError on a damaged entry or one of another key, analysis version or group, TamperedCacheError on a
    signature that does not match (each naming the file)."""
    path = layout.cached_group(key)
    if not os.path.lexists(path):
        return None
    entry = read_record(path, CacheEntry)
    for name, have, want in (("key", entry.key, key), ("analysis_version", entry.analysis_version, ANALYSIS_VERSION),
                             ("group", entry.group.key, group or entry.group.key)):
        if have != want:
            raise RecordError(f"{path}: {name}: {have!r}, not this entry's {want!r}")
    if signing_key is None:
        return entry.group
    if entry.mac is None:
        return None
    if not hmac.compare_digest(entry.mac, _entry_signature(signing_key, entry)):
        raise TamperedCacheError(f"{path}: this cached group's content does not carry the results key's signature "
                                 f"(edited since it was evaluated, or cached under another user's key); refusing "
                                 f"it (delete the file to evaluate the group again)")
    return entry.group


def load(layout: SweepDir, key: str, signing_key: bytes | None, group: GroupKey | None = None,
         log: Callable[[str], Any] = print) -> GroupResult | None:
    """:func:`read_entry`, or None where the entry is damaged or foreign (``log`` names it; the group is evaluated again
    and the entry rewritten). Raises TamperedCacheError as :func:`read_entry`."""
    try:
        return read_entry(layout, key, group, signing_key)
    except RecordError as e:
        log(f"WARNING: {e}; evaluating the group again")
        return None


def store(layout: SweepDir, key: str, result: GroupResult, signing_key: bytes,
          log: Callable[[str], Any] = print) -> None:
    """Writes the evaluation under ``key`` with its signature, atomically and durably. A place that cannot take it (a
    folder or a dangling link) is named in ``log`` and left: the result is used all the same."""
    path = layout.cached_group(key)
    entry = CacheEntry(key=key, analysis_version=ANALYSIS_VERSION, group=result)
    try:
        if os.path.lexists(path) and not path.is_file():
            raise IsADirectoryError(f"{'a folder' if path.is_dir() else 'a dangling symbolic link'} is in its place")
        write_record(path, entry.model_copy(update={"mac": _entry_signature(signing_key, entry)}), indent=None)
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
    """A group ready to evaluate: the finished seeds' records, the cache key, the seeds left out with their reasons, and
    how they are checked. ``verifier`` None: nothing is checked (re-analysis ``--no-verify``, ``--status``), so every
    seed is unverified; ``signing_key`` None: the cache is neither read nor written."""

    group: GroupKey
    records: list[TrialRecord]
    key: str
    layout: SweepDir
    verifier: Verifier | None = None
    signing_key: bytes | None = field(default=None, repr=False)
    excluded: list[FailedTrial] = field(default_factory=list)

    @property
    def unverified_seeds(self) -> list[int]:
        """The seeds whose trials left no record in MLflow (all of them when unchecked)."""
        recorded = self.verifier.recorded if self.verifier is not None else {}
        return sorted(r.seed for r in self.records if r.name not in recorded)


def prepare(layout: SweepDir, group: GroupKey, finished: list[str], verifier: Verifier | None,
            final_eval: FinalEvalSpec, signing_key: bytes | None = None) -> GroupJob:
    """Reads the finished trials' records from their snapshots; a trial without a usable final snapshot is left out with
    the reason (the file that differs from its signed digest, when that is why). ``signing_key`` defaults to the
    verifier's."""
    records, finals, excluded = [], {}, []
    for name in sorted(finished):
        try:
            record = trial_record(layout, name)
            finals[record.seed] = read_manifest(record.policies[max(record.policies)], SNAPSHOT_FORMATS).state_sha256
        except (OSError, ValueError, KeyError, TypeError, CheckpointError) as e:
            excluded.append(FailedTrial(name, _tampered(layout, name, verifier) or str(e)))
            continue
        records.append(record)
    if signing_key is None and verifier is not None:
        signing_key = verifier.key
    return GroupJob(group, records, cache_key(group, finals, final_eval), layout, verifier, signing_key, excluded)


def _tampered(layout: SweepDir, name: str, verifier: Verifier | None) -> str | None:
    """Why a trial's unreadable snapshot fails its check, if it has a record to check it against."""
    if verifier is None or name not in verifier.recorded:
        return None
    try:
        verify(layout, name, verifier)
    except TamperedSnapshotError as e:
        return str(e)
    except OSError:
        return None
    return None


class UnreadableSeedError(RuntimeError):
    """A finished seed of a group cannot be read (a damaged or missing snapshot, naming the file): the group is
    refused, never evaluated without it."""


def _check_readable(job: GroupJob) -> None:
    if job.excluded:
        raise UnreadableSeedError(f"{job.excluded[0].name}: {job.excluded[0].error}; refusing its group rather than "
                                  f"evaluating it without the seed")


def check(job: GroupJob) -> None:
    """Checks that every finished seed could be read (else UnreadableSeedError) and every seed whose trial recorded its
    digest (:func:`~qed_ray.analysis.checksums.verify`, TamperedSnapshotError naming the file)."""
    _check_readable(job)
    if job.verifier is not None:
        for record in job.records:
            if record.name in job.verifier.recorded:
                verify(job.layout, record.name, job.verifier)


def cached(job: GroupJob, log: Callable[[str], Any] = print) -> GroupResult | None:
    """The group's cached evaluation once its seeds pass :func:`check`, carrying this job's unverified seeds; None when
    there is none, it was computed while a seed that can be checked now was unverified, or it is damaged
    (:func:`load`). Raises as :func:`check` and TamperedCacheError."""
    _check_readable(job)
    if job.signing_key is None or not job.records:
        return None
    check(job)
    entry = load(job.layout, job.key, job.signing_key, job.group, log)
    if entry is None or not set(entry.unverified_seeds) <= set(job.unverified_seeds):
        return None
    return entry.model_copy(update={"unverified_seeds": job.unverified_seeds})


def evaluate(job: GroupJob, final_eval: FinalEvalSpec, device: str = "cpu") -> GroupResult:
    """Evaluates the group after :func:`check` (which raises naming the file); the result lists the unverified seeds."""
    check(job)
    result = evaluate_group(job.records, final_eval, device)
    return result.model_copy(update={"unverified_seeds": job.unverified_seeds})
