"""What a pack is: S runs of one (task, agent, variant) that differ only in seed, trained together.

The pack's name and validation, what it keeps per seed (:class:`SeedRun`), and the layout of a pack checkpoint:
``pack.json`` (the pack, its shared counters and each seed's status; written last, so its presence marks a
complete checkpoint) and one ``seed_<seed>/`` folder per seed in the single-seed checkpoint layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from qed_ray.checkpoint import CheckpointError, read_json
from qed_ray.config import RunSpec
from qed_ray.layout import PACK_FILE, PackId, seed_dir  # noqa: F401 - PACK_FILE, seed_dir: part of a pack's layout
from qed_ray.trainer import EvalRecord

PACK_FORMAT = 1


def pack_name(specs: Sequence[RunSpec]) -> str:
    """``task/agent/variant/pack0-9`` (consecutive seeds) or ``task/agent/variant/pack0+3+7``
    (:class:`~qed_ray.layout.PackId`; a sweep names its packs from its trial names, whose variants hold its axes)."""
    return PackId(specs[0].task, specs[0].agent.name, specs[0].variant, tuple(s.seed for s in specs)).name


def check_pack(specs: Sequence[RunSpec]) -> None:
    """Raises ValueError unless the runs differ only in their (distinct) seeds."""
    if not specs:
        raise ValueError("pack: no runs")
    seeds = [s.seed for s in specs]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"pack.seeds: {seeds} repeats a seed")
    base = specs[0].model_dump(exclude={"seed"})
    for s in specs[1:]:
        other = s.model_dump(exclude={"seed"})
        if other != base:
            diff = sorted(k for k in base if base[k] != other[k])
            raise ValueError(f"pack: run of seed {s.seed} differs from seed {seeds[0]}'s in {', '.join(diff)}; a "
                             f"pack holds the seeds of one task, agent and variant")


def read_pack(directory: Path, seeds: Sequence[int]) -> dict:
    """Reads a pack checkpoint's pack.json and checks it is the pack of ``seeds`` (in this order).

    Raises:
        CheckpointError: missing, corrupt, another format, other seeds or another pack size.
    """
    path = Path(directory) / PACK_FILE
    pack = read_json(path, "a pack checkpoint", PACK_FILE)
    for key, value in {"format": PACK_FORMAT, "seeds": list(seeds), "pack_size": len(seeds)}.items():
        if pack.get(key) != value:
            raise CheckpointError(f"{path}: mismatched {key}: checkpoint has {pack.get(key)!r}, this pack needs "
                                  f"{value!r} (resume a pack with the seeds and pack size it was written with)")
    return pack


@dataclass
class SeedRun:
    """What a pack keeps per seed besides its slices of the agent and the replay."""

    spec: RunSpec
    name: str
    warmup_rng: np.random.Generator
    status: str = "running"  # then "finished" or "diverged"
    reason: str | None = None
    stopped_at: tuple[int, int] | None = None  # (decisions, updates) when it diverged
    episodes: int = 0
    ep_return: float = 0.0
    evals: list[EvalRecord] = field(default_factory=list)
    train_returns: list = field(default_factory=list)
    last_metrics: dict = field(default_factory=dict)
    saved: tuple[dict, dict] | None = None  # (state, manifest) of its last checkpoint, kept once it diverges
