"""What a pack is: S >= 1 runs of one (task, agent, variant) that differ only in seed, trained together (a single
run is a pack of one); or, a pack by shape, runs of one task, agent, temperature kind and network shape that also
differ in the temperature's member scalars (:data:`~qed_ray.spec.config.TemperatureSpec.MEMBER_FIELDS`: QED's k, ...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
from pydantic import ConfigDict

from qed_ray.records.codec import read_record
from qed_ray.spec.config import RunSpec, TrainSpec
from qed_ray.records.layout import PACK_FILE, PackId
from qed_ray.records.manifests import CheckpointError, Manifest, PackRecord
from qed_ray.records.run import EvalRecord, Timings


def remaining_s(train: TrainSpec, decisions: int, evals_done: int, warmup_s_per_decision: float | None,
                train_s_per_decision: float | None, eval_s_per_eval: float | None) -> float | None:
    """Seconds left to finish a run: its warm-up, training and evaluation decisions at their measured costs (one
    overall rate would be wrong both ways: warm-up decisions have no updates, an evaluation is whole episodes).
    Before the first evaluation its cost is that many episodes at the warm-up cost per decision (stepping the physics
    dominates both); None while a needed cost is still unmeasured."""
    warm_left = max(0, train.warmup_decisions - decisions)
    train_left = train.decisions - max(decisions, train.warmup_decisions)
    evals_left = train.decisions // train.eval_every_decisions - evals_done
    if eval_s_per_eval is None and warmup_s_per_decision is not None:
        eval_s_per_eval = train.eval_episodes * train.episode_decisions * warmup_s_per_decision
    parts = [(warm_left, warmup_s_per_decision), (train_left, train_s_per_decision), (evals_left, eval_s_per_eval)]
    if any(n > 0 and cost is None for n, cost in parts):
        return None
    return float(sum(n * cost for n, cost in parts if n > 0))


class Progress(Timings):
    """The pack's live counters and timings, written into ``pack.json``; with each seed's :class:`SeedRun` what makes
    a resumed pack continue exactly."""

    model_config = ConfigDict(frozen=False)

    @classmethod
    def start(cls) -> "Progress":
        return cls(decisions=0, updates=0, wall_s=0.0, cpu_s=0.0)

    @classmethod
    def of(cls, pack: PackRecord) -> "Progress":
        return cls(**pack.model_dump(include=set(Timings.model_fields)))


def pack_name(specs: Sequence[RunSpec]) -> str:
    """``task/agent/variant/pack0-9`` (consecutive seeds) or ``task/agent/variant/pack0+3+7`` (a sweep names its
    packs from its trial names, whose variants hold its axes)."""
    return PackId.of([s.name for s in specs]).name


def shared_settings(spec: RunSpec) -> dict:
    """A run's settings that every member of its pack shares, flat (``agent.hidden``): all but the seed and the
    temperature's member scalars."""
    out: dict = {}

    def flat(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                flat(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = value
    flat("", {**spec.model_dump(exclude={"seed", "temperature"}), "temperature": spec.temperature.shared()})
    return out


def check_pack(specs: Sequence[RunSpec]) -> None:
    """Raises ValueError unless the runs may train as one pack: distinct runs that differ only in their seeds and in
    the temperature's member scalars (one task, agent, temperature kind and network shape); the error names the
    first setting that differs."""
    if not specs:
        raise ValueError("pack: no runs")
    seeds = [s.seed for s in specs]
    if len({(s.variant, s.seed) for s in specs}) != len(specs):
        raise ValueError(f"pack.seeds: {seeds} repeats a seed")
    base = shared_settings(specs[0])
    for s in specs[1:]:
        other = shared_settings(s)
        diff = [k for k in {**base, **other} if base.get(k) != other.get(k)]
        if diff:
            members = ", ".join(f"temperature.{f}" for f in s.temperature.MEMBER_FIELDS)
            raise ValueError(f"{diff[0]}: run {s.name} differs from {specs[0].name} in {', '.join(diff)}; a pack "
                             f"holds runs of one task, agent, temperature kind and network shape, which differ only "
                             f"in seed and {members}")


def sampler_seeds(specs: Sequence[RunSpec]) -> list[int]:
    """Per run of a pack, the seed its replay sampler is derived from: its own, or, with ``train.shared_indices``, the
    first seed (in pack order) of its variant (the runs whose settings other than the seed are equal).

    The samplers of one variant's seeds then start in one state and draw the same ring positions at every update
    (their rings always hold equally many transitions: dm_control episodes end only at the time limit, every
    seed stores each decision, ``holdout_fraction`` is refused with the option, and a stopped seed draws nothing),
    as MAD-TD's multi-seed trainer draws one index set for all seeds (paper App. C ran its seeds together in that
    code). Each seed still keeps, checkpoints and resumes its own generator. Other variants stay apart, and the
    first seed samples as it would alone: te and QED packs of the same seeds draw alike, as their seed runs do
    without the option (the pairing of docs/claim.md).
    """
    first: dict[str, int] = {}
    out = []
    for spec in specs:
        variant = json.dumps(spec.model_dump(mode="json", exclude={"seed"}), sort_keys=True)
        out.append(first.setdefault(variant, spec.seed) if spec.train.shared_indices else spec.seed)
    return out


def read_pack(directory: Path, seeds: Sequence[int]) -> PackRecord:
    """A pack checkpoint's pack.json, checked to be the pack of ``seeds`` (in this order); CheckpointError names
    the field otherwise."""
    path = Path(directory) / PACK_FILE
    pack = read_record(path, PackRecord, CheckpointError)
    for key, value in {"seeds": list(seeds), "pack_size": len(seeds)}.items():
        if getattr(pack, key) != value:
            raise CheckpointError(f"{path}: mismatched {key}: checkpoint has {getattr(pack, key)!r}, this pack needs "
                                  f"{value!r} (resume a pack with the seeds and pack size it was written with)")
    return pack


@dataclass
class PackState:
    """The trainer's resumable state besides the agent's tensors, the replay and the envs' streams (``resumed_from``
    None: a fresh start); the trainer owns it, :class:`~qed_ray.rl.pack_checkpoint.PackCheckpoints` writes it."""

    name: str
    runs: list[SeedRun]
    train: TrainSpec
    progress: Progress = field(default_factory=Progress.start)
    resumed_from: int | None = None
    active: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.active = np.ones(len(self.runs), bool)

    @property
    def n(self) -> int:
        return len(self.runs)

    @property
    def env_steps(self) -> int:
        return self.progress.decisions * self.train.frame_skip

    def status(self, run: SeedRun) -> str:
        """``running``, ``diverged``, or ``finished`` once the budget is done (also in the final checkpoint)."""
        return "finished" if run.status == "running" and self.progress.decisions >= self.train.decisions else run.status

    def stop(self, i: int, reason: str | None, at: tuple[int, int]) -> None:
        """Seed ``i`` diverged (``reason``) at ``at`` = (decisions, updates): it trains no more."""
        run = self.runs[i]
        run.status, run.reason, run.stopped_at = "diverged", reason, tuple(at)
        self.active[i] = False


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
    saved: tuple[dict, Manifest] | None = None  # (state, manifest) of its last checkpoint, kept once it diverges
