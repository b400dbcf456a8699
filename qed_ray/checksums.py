"""Policy checksums recorded outside the shared folder, and the gather step's check of every snapshot it uses.

A snapshot's ``manifest.json`` holds the SHA-256 of its ``state.pt``, but both sit on the same shared folder: the
manifest catches corruption, not someone who rewrites both. So at its end a trial records, in its MLflow run
(another trust domain when MLflow is a server, see ``cluster/README.md``), the SHA-256 of its final snapshot's
``state.pt`` and a digest of every snapshot it kept (:func:`recorded_values`). Before using a trial's snapshots
the gather step hashes the files again and compares (:func:`verify`); a mismatch refuses the group and names the
file.

The trial also writes the same values into its ``DONE.json`` (under :data:`DONE_KEY`) before it tries MLflow: the
tracking server may be down when the trial ends, and the driver then records them from there when it answers
(:func:`done_checksums`). They are fixed at the trial's end either way; what the gather step trusts is only ever
the value in MLflow.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from qed_ray.checkpoint import MANIFEST_FILE, SNAPSHOT_FORMATS, STATE_FILE, read_manifest
from qed_ray.layout import SweepDir
from qed_ray.results import TrialRecord


DONE_KEY = "checksums"  # DONE.json: the final metrics and, under this key, the checksums to record


class TamperedSnapshotError(RuntimeError):
    """A policy snapshot differs from what its trial recorded at its end; the message names the file."""


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


def verify(record: TrialRecord, recorded: Recorded) -> None:
    """Hashes every snapshot file the record uses and compares with what its trial recorded.

    Raises:
        TamperedSnapshotError: naming the final ``state.pt`` that differs, an intermediate one whose file differs
            from its manifest, or the trial's snapshot folder when the set of snapshots differs.
    """
    final = max(record.policies)
    final_state = Path(record.policies[final]) / STATE_FILE
    actual = {step: file_sha256(Path(path) / STATE_FILE) for step, path in record.policies.items()}
    if actual[final] != recorded.policy_sha256:
        raise TamperedSnapshotError(
            f"{final_state}: SHA-256 {actual[final][:16]}... is not the {recorded.policy_sha256[:16]}... its trial "
            f"recorded in MLflow when it finished (replaced or damaged after training); refusing it")
    if digest(actual) == recorded.snapshots_sha256:
        return
    for step, path in sorted(record.policies.items()):
        stated = read_manifest(path, SNAPSHOT_FORMATS).get("state_sha256")
        if stated != actual[step]:
            raise TamperedSnapshotError(f"{Path(path) / STATE_FILE}: SHA-256 differs from its {MANIFEST_FILE}")
    folder = Path(record.policies[final]).parent
    raise TamperedSnapshotError(
        f"{folder}: the snapshots' SHA-256 digest is not the one the trial recorded in MLflow when it finished "
        f"(a snapshot was replaced, added or removed since); refusing them")
