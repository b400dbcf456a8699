"""Checkpoints: agent tensors in ``state.pt`` plus a JSON ``manifest.json``."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from qed_ray.records.atomic import atomic_file
from qed_ray.records.codec import dump, load_json, parse, write_record
from qed_ray.records.file_reads import file_sha256, open_regular
from qed_ray.records.layout import MANIFEST_FILE, STATE_FILE
from qed_ray.records.manifests import CheckpointError, CheckpointVersionError, Manifest
from qed_ray.spec.config import RunSpec
from qed_ray.spec.naming import EXECUTION_SETTINGS, identity, identity_changes, show_setting

if TYPE_CHECKING:
    import torch

# 2: agents draw one noise block per update (the random streams changed), temperature state is ``log_alpha``,
# metrics are one vector. A checkpoint of another version cannot continue the same run exactly.
FORMAT_VERSION = 2
# Policy snapshots only feed evaluation: their module weights load from format 1 too (agents.load_policy upgrades
# the few renamed parameters), so every reader of a snapshot accepts these; resuming needs FORMAT_VERSION.
SNAPSHOT_FORMATS = (1, FORMAT_VERSION)
RESUMABLE_CHANGES = EXECUTION_SETTINGS | {"train.env_steps"}  # a resume may extend the budget


def package_versions() -> dict[str, str]:
    """Versions of the packages a checkpoint depends on."""
    out = {"python": platform.python_version()}
    for name in ("qed_ray", "torch", "numpy", "dm_control", "mujoco", "ray", "mlflow"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def new_manifest(**fields) -> Manifest:
    """A manifest to write with this version's format and package versions (``state.pt``'s SHA-256 is set when it
    is written); raises ValueError naming a field that is not valid."""
    return Manifest(**fields, format_version=FORMAT_VERSION, versions=package_versions(), state_sha256="0" * 64)


def save_checkpoint(directory: str | os.PathLike, agent_state: dict, manifest: Manifest) -> Path:
    """Writes ``state.pt`` and ``manifest.json`` into ``directory`` (created if needed): ``manifest``'s given fields
    (:func:`new_manifest`, or a manifest read back and written again unchanged) with this version's format, the
    package versions and ``state.pt``'s SHA-256; returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state_path = directory / STATE_FILE
    with atomic_file(state_path) as tmp:
        import torch  # here, not at import: --status reads manifests without loading torch

        torch.save(agent_state, tmp)
    checked = manifest.model_copy(update={"format_version": FORMAT_VERSION, "versions": package_versions(),
                                          "state_sha256": file_sha256(state_path, CheckpointError)})
    write_manifest(directory / MANIFEST_FILE, checked)  # the manifest last: it marks a complete checkpoint
    return directory


def write_manifest(path: Path, manifest: Manifest) -> None:
    """Writes ``manifest.json``: the fields the manifest was given (a snapshot holds no counters, say)."""
    given = manifest.model_fields_set | {"format_version", "versions", "state_sha256"}
    write_record(path, {k: v for k, v in dump(manifest).items() if k in given}, dict)


def read_manifest(directory: str | os.PathLike, formats: tuple[int, ...] = (FORMAT_VERSION,)) -> Manifest:
    """``manifest.json`` of one of ``formats`` (resuming needs :data:`FORMAT_VERSION`, a policy snapshot's weights
    also load from format 1); raises :class:`CheckpointError` naming the file and the field."""
    path = Path(directory) / MANIFEST_FILE
    raw = load_json(path, CheckpointError)
    version = raw.get("format_version") if isinstance(raw, dict) else None
    if version not in formats:
        raise CheckpointVersionError(version_message(path, version))
    return parse(Manifest, format1_snapshot(raw) if version == 1 else raw, path, CheckpointError)


def format1_snapshot(manifest: dict) -> dict:
    """A format-1 snapshot manifest (qed_ray 0.1) as today's reads it: every agent carried (and ignored) ``mad``
    settings then; only MAD-SAC has them now."""
    run = manifest.get("run")
    if not isinstance(run, dict) or not isinstance(run.get("agent", {}), dict):
        return manifest
    agent = dict(run.get("agent", {}))
    if agent.get("name", "sac_ln") != "mad_sac":
        agent.pop("mad", None)
    return {**manifest, "run": {**run, "agent": agent}}


def version_message(path: Path, version) -> str:
    """Why a checkpoint of format ``version`` is refused, and what to do."""
    if isinstance(version, int) and version < FORMAT_VERSION:
        return (f"{path}: written by an older version of qed_ray (checkpoint format {version}; this version reads "
                f"format {FORMAT_VERSION}, whose agents draw their random numbers differently), so the run cannot "
                f"continue exactly from it. Start the run again: remove its checkpoint and replay folders (the CLI's "
                f"--out DIR/checkpoint and DIR/replay) or use a new --out folder, or finish it with the qed_ray "
                f"version that wrote it")
    return (f"{path}: checkpoint format {version!r} is not the format {FORMAT_VERSION} this version of qed_ray "
            f"reads (written by a newer or unknown version); resume it with the qed_ray version that wrote it")


def load_checkpoint(directory: str | os.PathLike, expect: dict | None = None,
                    map_location: str | torch.device = "cpu",
                    formats: tuple[int, ...] = (FORMAT_VERSION,), run: RunSpec | None = None) -> tuple[dict, Manifest]:
    """``(agent_state, manifest)`` after integrity and identity checks: the manifest's fields must be ``expect``'s,
    and with ``run`` (the run resuming it) its settings the checkpoint's (:func:`check_settings`), which then decide
    instead of the variant label (a label written under older defaults names the same settings).

    Raises:
        CheckpointError: missing or corrupt files, another format (:class:`CheckpointVersionError`), or a mismatch.
    """
    directory = Path(directory)
    manifest = read_manifest(directory, formats)
    if run is not None and manifest.run is not None:
        check_settings(directory / MANIFEST_FILE, manifest.run, run)
        expect = {k: v for k, v in (expect or {}).items() if k != "variant"}
    for key, want in (expect or {}).items():
        if getattr(manifest, key) != want:
            raise CheckpointError(f"{directory / MANIFEST_FILE}: mismatched {key}: checkpoint has "
                                  f"{getattr(manifest, key)!r}, this run needs {want!r}")
    state_path = directory / STATE_FILE
    if not state_path.exists():
        raise CheckpointError(f"{state_path}: missing")
    if file_sha256(state_path, CheckpointError) != manifest.state_sha256:
        raise CheckpointError(f"{state_path}: corrupt (SHA-256 differs from the manifest)")
    import torch

    try:
        with open_regular(state_path, "snapshot", CheckpointError) as f:
            state = torch.load(f, map_location=map_location, weights_only=True)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the same thing to the user
        raise CheckpointError(f"{state_path}: cannot be loaded ({type(e).__name__}: {e})") from e
    return state, manifest


def check_settings(path: Path, trained: RunSpec, run: RunSpec) -> None:
    """Refuses to resume a checkpoint ``trained`` with other settings than ``run`` (execution settings and a larger
    budget aside), naming the first such setting and both values."""
    changed = identity_changes(*(dump(identity(r)) for r in (trained, run)), ignore=RESUMABLE_CHANGES)
    for key, (had, want) in list(changed.items())[:1]:
        raise CheckpointError(f"{path}: mismatched {key}: checkpoint has {show_setting(had)}, this run needs "
                              f"{show_setting(want)}")
