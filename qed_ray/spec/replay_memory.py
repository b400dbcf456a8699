"""Replay memory before anything is built: bytes per trial and per pack, from the task's sizes, and the caps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from qed_ray.spec.console import show_bytes
from qed_ray.spec.tasks import TASK_DIMS

FLOAT_BYTES = 4
GIB = 2**30
# A seed's replay and a pack's (its seeds' rings in one tensor, on the GPU or in host memory). Paper-scale runs are
# far below (quadruped, 2M env steps at frame skip 2: 0.6 GiB per seed, 6.3 GiB for a pack of 10); past these a
# run needs train.replay_capacity, the paper's FIFO bound, rather than a bigger machine.
MAX_TRIAL_REPLAY_BYTES = 16 * GIB
MAX_PACK_REPLAY_BYTES = 64 * GIB


def row_width(obs_dim: int, action_dim: int) -> int:
    """D: floats per stored transition (``obs | action | reward | next_obs | terminated``)."""
    return 2 * obs_dim + action_dim + 2


def replay_bytes(seeds: int, capacity: int, obs_dim: int, action_dim: int) -> int:
    """Bytes of a pack's replay storage: S x capacity x D float32 (cheetah-run 17/6, 1M: 168 MB per seed)."""
    return seeds * capacity * row_width(obs_dim, action_dim) * FLOAT_BYTES


def replay_capacity(train) -> int:
    """Transitions a seed's replay holds (``train``: a TrainSpec): its ``replay_capacity``, else every decision."""
    return train.replay_capacity or train.decisions


@dataclass(frozen=True)
class ReplayNeed:
    """The replay of one task at one train setting: per seed, and for a pack of ``seeds``."""

    task: str
    capacity: int  # transitions per seed
    width: int  # floats per transition
    seeds: int  # seeds of the largest pack

    @property
    def per_trial(self) -> int:
        return self.capacity * self.width * FLOAT_BYTES

    @property
    def per_pack(self) -> int:
        return self.seeds * self.per_trial

    def describe(self) -> str:
        return f"{self.task}: {self.capacity:,} transitions x {self.width} floats"


def replay_needs(cases: Iterable[tuple[str, object]], pack_seeds: int) -> list[ReplayNeed]:
    """The distinct replay sizes of ``(task, TrainSpec)`` cases in packs of up to ``pack_seeds``, largest first."""
    needs = {ReplayNeed(task, replay_capacity(train), row_width(*TASK_DIMS[task]), pack_seeds)
             for task, train in cases}
    return sorted(needs, key=lambda n: (-n.per_trial, n.task))


def replay_problems(needs: list[ReplayNeed], pack_field: str = "pack.seeds") -> list[str]:
    """The cap the largest need passes (a trial's, else a pack's) as one line with the estimate and the way out,
    naming ``train.env_steps`` or ``pack_field`` (the run CLI's ``--seeds``); empty when every replay fits."""
    if not needs:
        return []
    top = needs[0]
    fix = "lower train.env_steps, or set train.replay_capacity to at most {:,} transitions per seed"
    if top.per_trial > MAX_TRIAL_REPLAY_BYTES:
        fits = MAX_TRIAL_REPLAY_BYTES // (top.width * FLOAT_BYTES)
        return [f"train.env_steps: a trial's replay would hold {show_bytes(top.per_trial)} ({top.describe()}), "
                f"over the {show_bytes(MAX_TRIAL_REPLAY_BYTES)} a trial may hold; {fix.format(fits)}"]
    if top.per_pack > MAX_PACK_REPLAY_BYTES:
        fits = MAX_PACK_REPLAY_BYTES // (top.seeds * top.width * FLOAT_BYTES)
        return [f"{pack_field}: a pack's replay would hold {show_bytes(top.per_pack)} ({top.seeds} seeds x "
                f"{top.describe()}), over the {show_bytes(MAX_PACK_REPLAY_BYTES)} a pack may hold; pack fewer "
                f"seeds, or {fix.format(fits)}"]
    return []


def replay_line(needs: list[ReplayNeed]) -> str:
    """One line for ``--dry-run``: the largest replay per trial and per pack, against the caps."""
    if not needs:
        return "replay: none"
    top = needs[0]
    return (f"replay: up to {show_bytes(top.per_trial)} per trial ({top.describe()}), {show_bytes(top.per_pack)} "
            f"per pack of {top.seeds}; caps {show_bytes(MAX_TRIAL_REPLAY_BYTES)} per trial, "
            f"{show_bytes(MAX_PACK_REPLAY_BYTES)} per pack")
