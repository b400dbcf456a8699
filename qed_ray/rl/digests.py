"""What a trial records about its policy snapshots at its end: the SHA-256 of its final ``state.pt`` and a digest of
every snapshot it kept (:func:`recorded_values`, a :class:`~qed_ray.run_records.Recorded`), written into its
``DONE.json`` (:class:`~qed_ray.run_records.DoneRecord`'s ``checksums``) and, by
the service, into its MLflow run, against which the gather step checks the snapshots
(:mod:`qed_ray.analysis.checksums`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from qed_ray.layout import SweepDir
from qed_ray.rl.checkpoint import SNAPSHOT_FORMATS, read_manifest
from qed_ray.run_records import Recorded, read_done


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file's bytes, hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def digest(checksums: dict[int, str]) -> str:
    """SHA-256 over ``"<env_steps> <state.pt sha256>"`` lines of a trial's snapshots, in step order."""
    lines = "".join(f"{step} {sha}\n" for step, sha in sorted(checksums.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def manifest_checksums(layout: SweepDir, name: str) -> dict[int, str]:
    """``{env_steps: state.pt SHA-256}`` of the trial's snapshots as their manifests state them."""
    snapshots = layout.snapshots(name)
    return {step: read_manifest(path, SNAPSHOT_FORMATS).state_sha256 for step, path in snapshots.items()}


def recorded_values(layout: SweepDir, name: str) -> Recorded:
    """What a finished trial records about its own snapshots (from the manifests it has just written)."""
    checksums = manifest_checksums(layout, name)
    if not checksums:
        raise FileNotFoundError(f"{layout.policies(name)}: no complete policy snapshot to record")
    return Recorded(policy_sha256=checksums[max(checksums)], snapshots_sha256=digest(checksums))


def done_checksums(layout: SweepDir, name: str) -> Recorded:
    """What a finished trial records: the values it wrote into its ``DONE.json`` at its end, or, for a trial that
    finished before ``DONE.json`` kept them, the values its snapshot manifests state. Raises RecordError naming a
    damaged ``DONE.json``."""
    stored = read_done(layout, name).checksums
    return stored if stored is not None else recorded_values(layout, name)
