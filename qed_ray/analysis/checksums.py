"""Policy checksums recorded outside the shared folder, and the gather step's check of every snapshot it uses.

A snapshot's ``manifest.json`` holds the SHA-256 of its ``state.pt``, but both sit on the same shared folder: the
manifest catches corruption, not someone who rewrites both. So at its end a trial records, in its MLflow run
(another trust domain when MLflow is a server, see ``cluster/README.md``), the SHA-256 of its final snapshot's
``state.pt`` and a digest of every snapshot it kept (:func:`qed_ray.rl.digests.recorded_values`). Before using a trial's snapshots
the gather step hashes the files again and compares (:func:`verify`); a mismatch refuses the group and names the
file.

The trial also writes the same values into its ``DONE.json`` before it tries MLflow: the
tracking server may be down when the trial ends, and the driver then records them from there when it answers
(:func:`qed_ray.rl.digests.done_checksums`). They are fixed at the trial's end either way; what the gather step trusts is only ever
the value in MLflow.
"""

from __future__ import annotations

from pathlib import Path

from qed_ray.analysis.results import TrialRecord
from qed_ray.layout import MANIFEST_FILE, STATE_FILE
from qed_ray.rl.checkpoint import SNAPSHOT_FORMATS, read_manifest
from qed_ray.rl.digests import Recorded, digest, file_sha256


class TamperedSnapshotError(RuntimeError):
    """A policy snapshot differs from what its trial recorded at its end; the message names the file."""


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
        stated = read_manifest(path, SNAPSHOT_FORMATS).state_sha256
        if stated != actual[step]:
            raise TamperedSnapshotError(f"{Path(path) / STATE_FILE}: SHA-256 differs from its {MANIFEST_FILE}")
    folder = Path(record.policies[final]).parent
    raise TamperedSnapshotError(
        f"{folder}: the snapshots' SHA-256 digest is not the one the trial recorded in MLflow when it finished "
        f"(a snapshot was replaced, added or removed since); refusing them")
