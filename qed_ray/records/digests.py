"""What a trial records about the files the gather step reads of it, and the signature that makes the record its own."""

from __future__ import annotations

import hashlib
import hmac
import json  # canonical JSON to hash (the codec parses; nothing is parsed here)
from dataclasses import dataclass, field
from pathlib import Path

from qed_ray.records import file_reads
from qed_ray.records.codec import RecordError
from qed_ray.records.layout import MANIFEST_FILE, STATE_FILE, SweepDir
from qed_ray.records.run import read_done

SIGNATURE_VERSION = "qed_ray results v1"  # the first line of every signed message (another version: another key use)


@dataclass(frozen=True)
class Recorded:
    """What a trial recorded at its end: the digest of its files, its HMAC, and the id of the key that made it."""

    digest: str
    mac: str
    key_id: str


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file's bytes, hex; a file that is not a regular file of the trial's folder, or too large, raises
    RecordError naming it (:mod:`qed_ray.records.file_reads`)."""
    return file_reads.file_sha256(path, RecordError)


def inventory(layout: SweepDir, name: str) -> dict[str, str]:
    """``{path relative to the trial's policies folder: SHA-256}`` of every file the gather step reads of the trial:
    each complete snapshot's ``state.pt`` and ``manifest.json`` and, if it exists, ``history.json``."""
    root = layout.policies(name)
    files = {}
    for folder in layout.snapshots(name).values():
        files.update(snapshot_files(root, folder))
    history = layout.history(name)
    if history.is_file():
        files[history.relative_to(root).as_posix()] = file_sha256(history)
    return files


def digest(files: dict[str, str]) -> str:
    """SHA-256 of an :func:`inventory` (canonical JSON: sorted keys, no spaces)."""
    return hashlib.sha256(json.dumps(files, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def key_id(key: bytes) -> str:
    """A short public name of a results key (16 hex digits of a hash of it; reveals nothing usable of the key)."""
    return hashlib.sha256(b"qed_ray results key id\n" + key).hexdigest()[:16]


def sign(key: bytes, *parts: str) -> str:
    """HMAC-SHA256 under ``key`` of the :data:`SIGNATURE_VERSION` line and ``parts``, one per line (hex)."""
    message = "\n".join((SIGNATURE_VERSION, *parts)).encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def trial_signature(key: bytes, sweep_id: str, trial: str, files_digest: str) -> str:
    """The HMAC of one trial's digest: bound to its sweep and its name, so a record cannot move to another trial."""
    return sign(key, "trial", sweep_id, trial, files_digest)


def record(key: bytes, sweep_id: str, trial: str, files: dict[str, str]) -> Recorded:
    """What a finished trial records: the digest of its :func:`inventory`, signed."""
    d = digest(files)
    return Recorded(d, trial_signature(key, sweep_id, trial, d), key_id(key))


def signed(key: bytes, sweep_id: str, trial: str, recorded: Recorded) -> bool:
    """Whether ``recorded`` carries this key's signature of its digest for this sweep's trial (constant time)."""
    return hmac.compare_digest(recorded.mac, trial_signature(key, sweep_id, trial, recorded.digest))


def snapshot_files(root: Path, folder: Path, source: Path | None = None) -> dict[str, str]:
    """The :func:`inventory` entries of one snapshot ``folder`` (its ``state.pt`` and ``manifest.json``, by their
    path under the trial's policies folder ``root``), hashed from ``source`` (its staging folder) if given."""
    return {(folder / f).relative_to(root).as_posix(): file_sha256((source or folder) / f)
            for f in (STATE_FILE, MANIFEST_FILE)}


def differences(actual: dict[str, str], written: dict[str, str]) -> list[str]:
    """Each file of :func:`inventory` ``actual`` that is not the one its worker wrote (``written``), as
    ``path: why``; empty when they agree."""
    out = []
    for path in sorted(set(actual) | set(written)):
        if path not in written:
            out.append(f"{path}: not written by its worker (planted)")
        elif path not in actual:
            out.append(f"{path}: written by its worker, now missing")
        elif actual[path] != written[path]:
            out.append(f"{path}: not the file its worker wrote (replaced)")
    return out


@dataclass(frozen=True)
class Signer:
    """Signs, with the user's results key, the list of files a pack's checkpoint records of each seed (what a
    later start may sign of the seed when it finishes it: never more than its worker wrote)."""

    key: bytes = field(repr=False)
    sweep_id: str

    def checkpoint(self, trial: str, env_steps: int, files: dict[str, str]) -> str:
        """The HMAC of the files a checkpoint at ``env_steps`` records of ``trial``."""
        return sign(self.key, "checkpoint files", self.sweep_id, trial, str(env_steps), digest(files))

    def checks(self, trial: str, env_steps: int, files: dict[str, str], mac: str | None) -> bool:
        """Whether ``mac`` is this key's :meth:`checkpoint` signature of ``files`` (constant time)."""
        return mac is not None and hmac.compare_digest(mac, self.checkpoint(trial, env_steps, files))


def unverified_reason(layout: SweepDir, name: str) -> str:
    """Why finished trial ``name`` has no signed digest in MLflow, as its ``DONE.json`` says (raises RecordError
    for a damaged one)."""
    done = read_done(layout, name)
    if done.unverified is not None:
        return done.unverified
    if done.files is None:
        return "trained by a qed_ray from before signed digests"
    return ("no reason in its DONE.json (an older qed_ray's end cut off before its digest, or the digest deleted "
            "from the tracking store)")


def unverified_reasons(layout: SweepDir, names: list[str]) -> dict[str, str]:
    """:func:`unverified_reason` of each trial of ``names`` (a damaged ``DONE.json`` says so)."""
    out = {}
    for name in names:
        try:
            out[name] = unverified_reason(layout, name)
        except RecordError as e:
            out[name] = f"no reason: {e}"
    return out


def listed_files(layout: SweepDir, name: str) -> dict[str, str] | None:
    """The file list the trial left in its ``DONE.json`` (None: none, or a damaged ``DONE.json``)."""
    try:
        return read_done(layout, name).files
    except RecordError:
        return None
