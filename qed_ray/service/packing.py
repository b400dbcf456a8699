"""Which seed runs of a sweep train together: its packs, and their membership, fixed once formed (docs/design.md,
"Packs")."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from pydantic import Field, model_validator

from qed_ray.records.codec import Record, dump, parse
from qed_ray.spec.config import RunSpec
from qed_ray.records.layout import PackId, SweepDir, member_dirs
from qed_ray.rl.pack import shared_settings
from qed_ray.spec.sweep import SweepSpec, Trial


@dataclass(frozen=True)
class Pack:
    """One pack: its id and its seed runs, in pack (seed) order."""

    id: PackId
    trials: tuple[Trial, ...]

    @property
    def name(self) -> str:
        return self.id.name

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.trials]

    @property
    def env_steps(self) -> int:
        return sum(t.run.train.env_steps for t in self.trials)


class SeedTrial(Record):

    name: str
    run: RunSpec


class TuneTrial(Record):
    """A Tune trial's config ``{"pack": {"name", "trials": [{"name", "run"}, ...]}}``: the pack's name and its seed
    runs, parsed once where a config is read (:meth:`of`)."""

    name: str
    trials: list[SeedTrial] = Field(min_length=1)

    @model_validator(mode="after")
    def _is_a_pack(self) -> "TuneTrial":
        if PackId.of(self.names).name != self.name:
            raise ValueError(f"name: {self.name!r} is not the pack of its trials ({PackId.of(self.names).name!r})")
        return self

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.trials]

    @property
    def id(self) -> PackId:
        return PackId.of(self.names)

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> "TuneTrial":
        return parse(cls, config.get("pack"), "Tune trial config: pack", ValueError)

    @classmethod
    def from_pack(cls, pack: "Pack") -> "TuneTrial":
        return cls(name=pack.name, trials=[SeedTrial(name=t.name, run=t.run) for t in pack.trials])

    def param(self) -> dict:
        return dump(self)


def group_of(name: str) -> str:
    """``task/agent/variant`` of a trial name: the seed runs that may share a pack (``pack.by: variant``)."""
    return name.rsplit("/", 1)[0]


def pack_group(trial: Trial, by: str) -> str:
    """The runs ``trial`` may share a pack with: its :func:`group_of` (``by`` variant), or (``by`` shape) every run
    with the same task, agent, temperature kind, network shape and other shared settings."""
    if by == "variant":
        return group_of(trial.name)
    return json.dumps(shared_settings(trial.run), sort_keys=True, default=str)


def form_packs(spec: SweepSpec, recorded: Mapping[str, Sequence[str]] | None = None,
               size: int | None = None) -> list[Pack]:
    """The spec's packs: the ``recorded`` ones (``{pack name: trial names}``, kept as they are, less the trials the
    spec no longer has), then the trials in none, per :func:`pack_group` variant by variant in grid order and each in
    seed order, in chunks of ``size`` (default ``spec.pack.seeds``); ordered by their first trial."""
    trials = spec.trials()
    by_name, order = {t.name: t for t in trials}, {}
    for t in trials:
        order.setdefault(group_of(t.name), len(order))
    packs, taken = [], set()
    for names in (recorded or {}).values():
        members = [by_name[n] for n in names if n in by_name]
        if members:
            packs.append(_pack(members))
            taken.update(t.name for t in members)
    groups: dict[str, list[Trial]] = {}
    for t in trials:
        if t.name not in taken:
            groups.setdefault(pack_group(t, spec.pack.by), []).append(t)
    size = size or spec.pack.seeds
    for members in groups.values():
        members = sorted(members, key=lambda t: (order[group_of(t.name)], t.run.seed))
        packs += [_pack(members[i:i + size]) for i in range(0, len(members), size)]
    return sorted(packs, key=lambda p: (order[group_of(p.names[0])], p.trials[0].run.seed))


def split(packs: Sequence[Pack], size: int) -> list[Pack]:
    """Each of ``packs`` cut in order into packs of ``size`` (the last of each may be smaller): what
    :func:`form_packs` forms at ``size`` from its packs at a size no group exceeds, in another order."""
    return [_pack(p.trials[i:i + size]) for p in packs for i in range(0, len(p.trials), size)]


def _pack(members: Sequence[Trial]) -> Pack:
    return Pack(PackId.of([t.name for t in members]), tuple(members))


def pack_records(packs: Sequence[Pack]) -> dict[str, list[str]]:
    return {p.name: p.names for p in packs}


def pack_of(packs: Sequence[Pack]) -> dict[str, Pack]:
    return {n: p for p in packs for n in p.names}


def pack_state(layout: SweepDir, pack: Pack) -> str:
    """``pending`` while any of its seed runs is (to train or resume), else ``ended`` (each is done or diverged)."""
    return "pending" if any(layout.trial_state(n) == "pending" for n in pack.names) else "ended"


def pack_started(layout: SweepDir, pack_id: PackId) -> bool:
    """Whether the pack left anything in the folder (a Tune folder, a checkpoint, a seed's policy or replay folder)."""
    if layout.pack_dirs(pack_id) or layout.pack_checkpoints(pack_id).exists():
        return True
    return any(p.exists() for n in pack_id.trials for p in (layout.policies(n), layout.replay(n)))


def seed_checkpoint(layout: SweepDir, pack_id: PackId, name: str) -> Path | None:
    """Seed run ``name``'s folder (``seed_<seed>/``) in the newest complete pack checkpoint, or None before one."""
    steps = layout.pack_checkpoint_steps(pack_id)
    if not steps:
        return None
    return steps[max(steps)] / member_dirs(pack_id.trials, pack_id.seeds)[pack_id.trials.index(name)]
