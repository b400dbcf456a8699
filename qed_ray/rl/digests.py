"""What a trial records about its policy snapshots at its end: the SHA-256 of its final ``state.pt`` and a digest of
every snapshot it kept (:func:`recorded_values`), written into its ``DONE.json`` (under :data:`DONE_KEY`) and, by
the service, into its MLflow run, against which the gather step checks the snapshots
(:mod:`qed_ray.analysis.checksums`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from qed_ray.layout import SweepDir
from qed_ray.rl.checkpoint import SNAPSHOT_FORMATS, read_manifest


DONE_KEY = "checksums"  # DONE.json: the final metrics and, under this key, the checksums to record


@dataclass(frozen=True)
class Recorded:
    """What a trial recorded at its end: its final ``state.pt`` SHA-256 and the digest of all its snapshots."""

    policy_sha256: str
    snapshots_sha256: str


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
    return {step: read_manifest(path, SNAPSHOT_FORMATS)["state_sha256"] for step, path in snapshots.items()}


def recorded_values(layout: SweepDir, name: str) -> Recorded:
    """What a finished trial records about its own snapshots (from the manifests it has just written)."""
    checksums = manifest_checksums(layout, name)
    if not checksums:
        raise FileNotFoundError(f"{layout.policies(name)}: no complete policy snapshot to record")
    return Recorded(checksums[max(checksums)], digest(checksums))


def done_checksums(layout: SweepDir, name: str) -> Recorded:
    """What a finished trial records: the values it wrote into its ``DONE.json`` at its end, or, for a trial that
    finished before ``DONE.json`` kept them, the values its snapshot manifests state."""
    stored = json.loads(layout.done_marker(name).read_text()).get(DONE_KEY)
    if isinstance(stored, dict) and {"policy_sha256", "snapshots_sha256"} <= set(stored):
        return Recorded(str(stored["policy_sha256"]), str(stored["snapshots_sha256"]))
    return recorded_values(layout, name)
