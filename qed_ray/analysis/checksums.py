"""The gather step's check of a trial's files against the digest its worker signed when the trial finished.

What is signed, by whom, and who this holds against: docs/design.md, "Trusting results"."""

from __future__ import annotations

from dataclasses import dataclass, field

from qed_ray.records.layout import STATE_FILE, SweepDir
from qed_ray.records.digests import Recorded, digest, inventory, key_id, listed_files, signed


class TamperedSnapshotError(RuntimeError):
    """A trial's files, or its record in MLflow, differ from what its worker signed at its end; names the file."""


@dataclass(frozen=True)
class Verifier:
    """What the gather step checks a sweep's trials against: the sweep's id, the user's results key, and the records
    the trials' workers left in MLflow (``{trial: Recorded}``; a finished trial missing here is unverified)."""

    sweep_id: str
    key: bytes = field(repr=False)
    recorded: dict[str, Recorded]


def verify(layout: SweepDir, name: str, verifier: Verifier) -> None:
    """Checks trial ``name``'s record (its key and signature) and every file the gather step reads of it; raises
    TamperedSnapshotError naming the file (or the record, or ``DONE.json``'s edited list) that differs."""
    recorded, folder = verifier.recorded[name], layout.policies(name)
    if recorded.key_id != key_id(verifier.key):
        raise TamperedSnapshotError(
            f"{folder}: its trial signed its digest in MLflow with results key {recorded.key_id!r}, not with this "
            f"user's ({key_id(verifier.key)!r}); gather with the key of the user who ran the sweep "
            f"(QED_RESULTS_KEY_FILE names its file); refusing it")
    if not signed(verifier.key, verifier.sweep_id, name, recorded):
        raise TamperedSnapshotError(
            f"{folder}: the digest recorded in its MLflow run does not carry its trial's signature (edited in the "
            f"tracking store); refusing it")
    actual = inventory(layout, name)
    if digest(actual) == recorded.digest:
        return
    listed = listed_files(layout, name)
    if listed is None or digest(listed) != recorded.digest:
        raise TamperedSnapshotError(
            f"{layout.done_marker(name)}: its file list is not the one its trial signed in MLflow when it finished "
            f"(edited since), and the trial's files differ from what it recorded; refusing them")
    for path in sorted(set(actual) | set(listed), key=lambda p: (not p.endswith(STATE_FILE), p)):  # weights first
        if actual.get(path) == listed.get(path):
            continue
        if path not in listed:
            why = "is not among the files its trial recorded when it finished (added since)"
        elif path not in actual:
            why = "is missing, but its trial recorded it when it finished (removed since)"
        else:
            why = (f"has SHA-256 {actual[path][:16]}..., not the {listed[path][:16]}... its trial recorded in MLflow "
                   f"when it finished (replaced or edited since)")
        raise TamperedSnapshotError(f"{folder / path}: {why}; refusing it")
