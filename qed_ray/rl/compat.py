"""Readers of what older releases of qed_ray left on disk, in one place (each says which release wrote it).

qed_ray 0.1 trained a sweep's trials one per Tune trial unless ``pack.seeds`` > 1: such a trial kept its full
checkpoints in ``checkpoints/<trial>/<env_steps>/`` (one seed's checkpoint: ``state.pt`` and ``manifest.json``) and
its Tune folders in ``tune/<start>/<trial>/``. Every run is a pack now (a single seed is a pack of one), so a
started sweep of that release resumes by adopting each such checkpoint as the checkpoint of the trial's pack of
one (:func:`adopt_trial_checkpoints`): the seed's folder moves unchanged into the pack checkpoint's
``seed_<seed>/`` and the pack's counters are written beside it from the seed's manifest.
"""

from __future__ import annotations

import os
from pathlib import Path

from qed_ray.atomic import write_json
from qed_ray.rl.checkpoint import MANIFEST_FILE, CheckpointError, read_manifest
from qed_ray.layout import PACK_FILE, PackId, SweepDir, seed_dir, trial_dirname
from qed_ray.rl.pack import PACK_FORMAT

CHECKPOINTS = "checkpoints"


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
        CheckpointError: a checkpoint whose manifest cannot be read (naming it).
    """
    if len(pack.seeds) != 1:
        return 0
    (name,) = pack.trials
    old = legacy_checkpoints(layout, name)
    if not old.is_dir() or layout.pack_checkpoints(pack).exists():
        return 0
    moved = 0
    for step_dir in sorted(d for d in old.iterdir() if d.name.isdigit() and (d / MANIFEST_FILE).exists()):
        manifest = read_manifest(step_dir)
        target = layout.pack_checkpoint(pack, int(manifest["env_steps"]))
        target.mkdir(parents=True)
        seed_folder = target / seed_dir(pack.seeds[0])
        os.rename(step_dir, seed_folder)
        write_json(seed_folder / MANIFEST_FILE, {**manifest, "pack": pack.name, "pack_size": 1, "pack_index": 0},
                   indent=1)
        write_json(target / PACK_FILE, _pack_json(pack, name, manifest, budget), indent=1)
        moved += 1
    return moved


def _pack_json(pack: PackId, name: str, manifest: dict, budget: int) -> dict:
    progress = manifest.get("progress")
    if not isinstance(progress, dict):
        raise CheckpointError(f"{name}: its checkpoint at {manifest.get('env_steps')} env steps has no progress")
    steps = int(manifest["env_steps"])
    return {"format": PACK_FORMAT, "pack": pack.name, "names": [name], "seeds": list(pack.seeds), "pack_size": 1,
            "env_steps": steps, "decisions": progress["decisions"], "updates": progress["updates"],
            "wall_s": progress["wall_s"], **{k: progress.get(k, 0.0) for k in ("warmup_s", "train_s", "eval_s")},
            "status": ["finished" if steps >= budget else "running"], "reasons": [None], "stopped_at": [None]}
