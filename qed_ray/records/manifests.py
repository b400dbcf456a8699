"""The JSON records of checkpoints and policy snapshots, one model per file (:mod:`qed_ray.records.codec`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from qed_ray.records.codec import Num, Record, RecordError
from qed_ray.spec.config import MAX_SEED, RunSpec
from qed_ray.records.layout import PACK_FORMAT
from qed_ray.records.run import STATUSES, EvalRecord, Timings

MAX_WORD128 = 2**128 - 1  # PCG64's state and increment are 128-bit words
SHA256_HEX = r"^[0-9a-f]{64}$"


class CheckpointError(RecordError):
    """A checkpoint that cannot be used: names the file and the problem."""


class CheckpointVersionError(CheckpointError):
    """A checkpoint written by another version of qed_ray (its ``format_version`` differs)."""


class Pcg64Words(Record):
    """A PCG64 generator's 128-bit state and increment."""

    state: int = Field(ge=0, le=MAX_WORD128)
    inc: int = Field(ge=0, le=MAX_WORD128)


class Pcg64State(Record):
    """A numpy ``Generator``'s ``bit_generator.state`` (the warm-up actions' and the replay sampler's streams)."""

    bit_generator: Literal["PCG64"]
    state: Pcg64Words
    has_uint32: int = Field(ge=0, le=1)
    uinteger: int = Field(ge=0, le=2**32 - 1)


class Mt19937State(Record):
    """A dm_control task's MT19937 state (:meth:`qed_ray.rl.envs.DMCEnv.random_state`)."""

    name: Literal["MT19937"]
    keys: list[int] = Field(min_length=624, max_length=624)
    pos: int = Field(ge=0, le=624)
    has_gauss: int = Field(ge=0, le=1)
    cached: float

    @model_validator(mode="after")
    def _keys_are_words(self) -> "Mt19937State":
        if any(not 0 <= k <= 2**32 - 1 for k in self.keys):
            raise ValueError("keys: each must be a 32-bit word (0 .. 2**32 - 1)")
        return self


class RngStates(Record):
    """A seed's random streams in its checkpoint: warm-up actions, replay sampler, training env."""

    warmup: Pcg64State
    replay: Pcg64State
    env: Mt19937State


class ReplayInfo(Record):
    """How many transitions the seed's replay held, and whether its chunks live outside the checkpoint."""

    added: int = Field(ge=0)
    external: bool


class SeedProgress(Timings):
    """A seed's counters, episodes and evaluation history in its checkpoint. (The timings are the pack's, in
    ``pack.json``; a single-seed checkpoint of qed_ray 0.1, adopted into its pack of one, kept them here.)"""

    episodes: int = Field(ge=0)
    evals: list[EvalRecord]


class Manifest(Record):
    """A checkpoint's or policy snapshot's ``manifest.json`` (see the module notes); the parts one kind of
    checkpoint lacks are None (a resume asks for them with :meth:`require`)."""

    task: str = Field(min_length=1)
    agent: str = Field(min_length=1)
    variant: str = Field(min_length=1)
    seed: int = Field(ge=0, le=MAX_SEED)
    obs_dim: int = Field(ge=1, le=1_000_000)
    action_dim: int = Field(ge=1, le=1_000_000)
    env_steps: int = Field(ge=0)
    format_version: int
    versions: dict[str, str]
    state_sha256: str = Field(pattern=SHA256_HEX)
    run: RunSpec | None = None
    policy_only: bool = False
    modules: list[str] | None = None
    evals: list[EvalRecord] = Field(default_factory=list)  # a snapshot's evaluation history (format 1: none)
    wall_s: Num = math.nan  # a snapshot's wall time so far (format 1: unknown)
    cpu_s: float | None = Field(None, ge=0)  # and CPU time so far (Timings.cpu_s; None: not recorded)
    progress: SeedProgress | None = None
    rng: RngStates | None = None
    replay: ReplayInfo | None = None
    pack: str | None = None
    pack_size: int | None = Field(None, ge=1)
    pack_index: int | None = Field(None, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _old_target_alpha(cls, data: Any) -> Any:
        """A run as it was trained before ``temperature.target_alpha`` defaulted to ``floor``: a QED run written
        before the field existed used alpha(s') in the target (``qed``); older releases wrote ``qed`` into the run
        of every kind, where it never applied (te and fixed refuse it today), so it is dropped there."""
        temperature = data.get("run", {}).get("temperature") if isinstance(data, dict) and isinstance(
            data.get("run"), dict) else None
        if not isinstance(temperature, dict):
            return data
        if temperature.get("kind") == "qed":
            temperature = {"target_alpha": "qed", **temperature}
        elif temperature.get("target_alpha") == "qed":
            temperature = {k: v for k, v in temperature.items() if k != "target_alpha"}
        return {**data, "run": {**data["run"], "temperature": temperature}}

    def require(self, path: Path, *names: str) -> tuple[Any, ...]:
        """The named parts, which the use at hand needs; raises CheckpointError naming the file and the first
        missing part."""
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            kind = "a policy snapshot" if self.policy_only else "this manifest"
            raise CheckpointError(f"{path}: {missing[0]}: missing ({kind} cannot be used here)")
        return tuple(getattr(self, n) for n in names)


class PackRecord(Timings):
    """A pack checkpoint's ``pack.json``: the pack, its shared counters and timings, and each seed's status (written
    last, so its presence marks a complete checkpoint)."""

    format: Literal[PACK_FORMAT]
    pack: str = Field(min_length=1)
    names: list[str]
    seeds: list[int]
    pack_size: int = Field(ge=1)
    env_steps: int = Field(ge=0)
    status: list[Literal[STATUSES]]
    reasons: list[str | None]
    stopped_at: list[Annotated[list[int], Field(min_length=2, max_length=2)] | None]  # (decisions, updates)

    @model_validator(mode="after")
    def _one_entry_per_seed(self) -> "PackRecord":
        for name in ("names", "seeds", "status", "reasons", "stopped_at"):
            if len(getattr(self, name)) != self.pack_size:
                raise ValueError(f"{name}: {len(getattr(self, name))} entries for a pack of {self.pack_size} seeds")
        return self
