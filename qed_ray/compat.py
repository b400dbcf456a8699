"""Readers of what older releases of qed_ray left on disk, in one place (each says which release wrote it); every
other reader reads today's records only (:mod:`qed_ray.records.codec`).

- Fields added to a record after files were written read as their model's default there: an evaluation's
  ``q_gap_mean`` (NaN), ``pack.json``'s timings (0), a policy snapshot's evaluation history and wall time (none),
  ``DONE.json``'s file list (none: a failed check cannot name the file), a numeric column
  of ``results.json`` (NaN, :func:`missing_numbers`). ``DONE.json``'s ``checksums`` (qed_ray before signed
  digests: unsigned, so read and never used).
- Checkpoint format 1 (qed_ray 0.1, before agents drew one noise block per update): its policy snapshots still
  load for evaluation, their run settings and module weights renamed to today's (:func:`format1_snapshot`,
  :func:`format1_state`); resuming from them is refused by the run CLI (a sweep starts such a pack over, saying so).
- qed_ray 0.1 trained a sweep's trials one per Tune trial unless ``pack.seeds`` > 1: such a trial kept its full
checkpoints in ``checkpoints/<trial>/<env_steps>/`` (one seed's checkpoint: ``state.pt`` and ``manifest.json``) and
its Tune folders in ``tune/<start>/<trial>/``. Every run is a pack now (a single seed is a pack of one), so a
started sweep of that release resumes by adopting each such checkpoint as the checkpoint of the trial's pack of
one (:func:`adopt_trial_checkpoints`): the seed's folder moves unchanged into the pack checkpoint's
``seed_<seed>/`` and the pack's counters are written beside it from the seed's manifest.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field

from qed_ray.records.codec import Num, Record, read_record, write_record
from qed_ray.records.run import Timings
from qed_ray.records.layout import MANIFEST_FILE, PACK_FILE, PACK_FORMAT, PackId, SweepDir, seed_dir, trial_dirname

CHECKPOINTS = "checkpoints"
# Module weights of format 1 are laid out as today's except QED's log alpha_TE, which was a submodule's parameter.
FORMAT1_RENAMES = {"temperature": {"te.log_alpha": "log_alpha"}}


def format1_snapshot(manifest: dict) -> dict:
    """A format-1 snapshot manifest as today's reads it: every agent carried (and ignored) ``mad`` settings then;
    only MAD-SAC has them now."""
    run = manifest.get("run")
    if not isinstance(run, dict) or not isinstance(run.get("agent", {}), dict):
        return manifest
    agent = dict(run.get("agent", {}))
    if agent.get("name", "sac_ln") != "mad_sac":
        agent.pop("mad", None)
    return {**manifest, "run": {**run, "agent": agent}}


def format1_state(state: dict) -> dict:
    """Module states of a format-1 snapshot with the parameter names of today's modules."""
    out = dict(state)
    for module, renames in FORMAT1_RENAMES.items():
        if module in out:
            out[module] = {renames.get(n, n): v for n, v in out[module].items()}
    return out


def missing_numbers(cls: type, row: Any) -> Any:
    """A results row (a dataclass ``cls`` as JSON) with each numeric column it lacks as null (NaN): the row was
    written before that column existed."""
    if not isinstance(row, dict):
        return row
    hints = typing.get_type_hints(cls, include_extras=True)
    return {**{f.name: None for f in dataclasses.fields(cls) if f.name not in row and hints[f.name] == Num}, **row}


class _LegacyProgress(Timings):
    model_config = ConfigDict(frozen=True, extra="allow", strict=True)


class _LegacyCheckpoint(Record):
    """What adopting a qed_ray 0.1 single-seed checkpoint reads of its manifest (the rest is read on resume)."""

    model_config = ConfigDict(frozen=True, extra="allow", strict=True)

    env_steps: int = Field(ge=0)
    progress: _LegacyProgress


def legacy_checkpoints(layout: SweepDir, name: str) -> Path:
    """``checkpoints/<trial>/``: where a qed_ray 0.1 trial trained outside a pack kept its checkpoints."""
    return layout.root / CHECKPOINTS / trial_dirname(name)


def legacy_trial_started(layout: SweepDir, name: str) -> bool:
    """Whether a qed_ray 0.1 trial trained outside a pack left a checkpoint or a Tune folder."""
    tune = layout.tune_root
    in_tune = tune.is_dir() and any((d / trial_dirname(name)).is_dir() for d in tune.iterdir())
    return in_tune or legacy_checkpoints(layout, name).exists()


def adopt_trial_checkpoints(layout: SweepDir, pack: PackId, budget: int) -> int:
    """Turns the qed_ray 0.1 checkpoints of a pack of one's trial into checkpoints of the pack; returns how many.

    Each complete ``checkpoints/<trial>/<env_steps>/`` becomes ``checkpoints/<pack>/<env_steps>/seed_<seed>/``
    (moved, not copied: its ``state.pt`` and digest stay as written) with a ``pack.json`` of the counters its
    manifest holds; the manifest gains the seed's place in the pack. Incomplete step folders are left where they
    are. Nothing happens when the pack has checkpoints of its own.

    Args:
        layout: the sweep folder.
        pack: a pack (only a pack of one seed can have such checkpoints).
        budget: the trial's ``train.env_steps`` (a checkpoint at it is the finished run's).

    Raises:
        RecordError: a checkpoint whose manifest cannot be read (naming it and the field).
    """
    if len(pack.seeds) != 1:
        return 0
    (name,) = pack.trials
    old = legacy_checkpoints(layout, name)
    if not old.is_dir() or layout.pack_checkpoints(pack).exists():
        return 0
    moved = 0
    for step_dir in sorted(d for d in old.iterdir() if d.name.isdigit() and os.path.lexists(d / MANIFEST_FILE)):
        legacy = read_record(step_dir / MANIFEST_FILE, _LegacyCheckpoint)
        target = layout.pack_checkpoint(pack, legacy.env_steps)
        target.mkdir(parents=True)
        seed_folder = target / seed_dir(pack.seeds[0])
        os.rename(step_dir, seed_folder)
        write_record(seed_folder / MANIFEST_FILE, {**legacy.model_dump(), "pack": pack.name, "pack_size": 1,
                                                   "pack_index": 0}, dict)
        write_record(target / PACK_FILE, _pack_json(pack, name, legacy, budget), dict)
        moved += 1
    return moved


def _pack_json(pack: PackId, name: str, legacy: _LegacyCheckpoint, budget: int) -> dict:
    """The ``pack.json`` (:class:`qed_ray.records.manifests.PackRecord`) of a pack of one adopting this checkpoint."""
    p, steps = legacy.progress, legacy.env_steps
    return {"format": PACK_FORMAT, "pack": pack.name, "names": [name], "seeds": list(pack.seeds), "pack_size": 1,
            "env_steps": steps, "decisions": p.decisions, "updates": p.updates, "wall_s": p.wall_s,
            "warmup_s": p.warmup_s, "train_s": p.train_s, "eval_s": p.eval_s,
            "status": ["finished" if steps >= budget else "running"], "reasons": [None], "stopped_at": [None]}


def old_default_target_alpha(recorded: dict) -> str | None:
    """The refusal of a sweep.json of format < 3 (its trials' identities ``recorded``), written before
    ``temperature.target_alpha`` defaulted to ``floor``, that holds QED trials: their names were given under the old
    default (``qed0.2`` then meant target_alpha: qed), so today's names would mean another setting (None: no QED
    trial)."""
    qed = [n for n, i in recorded.items() if i.get("temperature.kind") == "qed"]
    if not qed:
        return None
    return (f"temperature.target_alpha: this sweep.json predates the default target_alpha: floor (paper App. C), and "
            f"its {len(qed)} QED trial(s) (e.g. {qed[0]}) were named under the old default qed, so their names now "
            f"mean another setting: finish them with the release that started them, or start over with --fresh or "
            f"another name")
