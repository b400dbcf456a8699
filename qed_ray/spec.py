"""Sweep specs: one YAML describes a task x agent x temperature x seed grid (validated once, expanded to RunSpecs).

Errors name the field, the value and what is allowed; nothing is started before the whole spec is valid.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from qed_ray.config import AgentSpec, Frozen, RunSpec, TemperatureSpec, TrainSpec, format_validation_error
from qed_ray.envs import TASK_SETS, TASKS

AGENT_MODULES = {"sac_ln": "qed_ray.agents.sac_ln", "mad_sac": "qed_ray.agents.mad_sac"}


class SpecError(ValueError):
    """An invalid sweep spec; the message is one line per problem, each naming its field."""


class VariantSpec(Frozen):
    """A temperature rule with lists where a sweep varies a value (``k: [0.1, 0.2]``, ``alpha: [0.05, 0.1]``)."""

    kind: Literal["te", "fixed", "qed"]
    alpha: float | list[float] | None = None
    k: float | list[float] | None = None
    n_actions: int = 8
    tau: float = 0.9
    alpha_max: float = 0.2
    init_alpha: float = 0.1
    lr: float = 3e-4

    def expand(self) -> list[TemperatureSpec]:
        """One TemperatureSpec per listed value (validated by TemperatureSpec itself)."""
        base = self.model_dump(exclude={"alpha", "k"})
        key = {"fixed": "alpha", "qed": "k"}.get(self.kind)
        if key is None:
            return [TemperatureSpec(**base)]
        values = getattr(self, key)
        values = values if isinstance(values, list) else [values]
        return [TemperatureSpec(**base, **{key: v}) for v in values]


class AgentEntry(Frozen):
    """An agent of the grid: its overrides (AgentSpec fields) and its temperature variants."""

    name: str
    overrides: dict[str, Any] = Field(default_factory=dict)
    temperatures: list[VariantSpec] = Field(min_length=1)

    @field_validator("name")
    @classmethod
    def _implemented(cls, v: str) -> str:
        if v not in AGENT_MODULES:
            raise ValueError(f"unknown agent {v!r}; implemented agents: {', '.join(AGENT_MODULES)}")
        if importlib.util.find_spec(AGENT_MODULES[v]) is None:
            raise ValueError(f"agent {v!r} is not implemented in this version (module {AGENT_MODULES[v]} missing)")
        return v

    def agent_spec(self) -> AgentSpec:
        """The validated AgentSpec (name + overrides)."""
        return AgentSpec.model_validate({**self.overrides, "name": self.name})


class FinalEvalSpec(Frozen):
    """Cross-seed evaluation of finished trials (paper Sec. 6.1-6.2, App. C)."""

    episodes: int = Field(20, ge=1, description="eval rollouts per policy (states pooled for V)")
    action_rollouts: int = Field(20, ge=1, description="trajectories for the action distance")
    action_steps: int = Field(100, ge=1, le=500, description="decisions per action-distance trajectory")
    curve_episodes: int = Field(2, ge=1, description="episodes per seed for V at intermediate checkpoints")
    keep_every: int = Field(1, ge=1, description="keep a policy snapshot every n-th evaluation (for V over steps)")
    bootstrap_reps: int = Field(2000, ge=100)
    confidence: float = Field(0.95, gt=0, lt=1)
    seed: int = 0


class ResourcesSpec(Frozen):
    """Ray resources per trial (fractional GPUs let ~10 seeds share one GPU)."""

    cpu: float = Field(1.0, gt=0)
    gpu: float = Field(0.0, ge=0, le=1, description="GPU fraction per trial, in [0, 1]")

    @field_validator("gpu")
    @classmethod
    def _divides_one(cls, v: float) -> float:
        # A trial never spans GPUs; fractions that do not divide 1 strand capacity (ray#5902).
        if 0 < v < 1 and abs(round(1 / v) - 1 / v) > 1e-6:
            raise ValueError(f"{v} does not divide 1 (use e.g. 0.5, 0.25, 0.1)")
        return v


class TrackingSpec(Frozen):
    """MLflow: URI (default: SQLite in the sweep folder; ``MLFLOW_TRACKING_URI`` overrides) and experiment."""

    uri: str | None = None
    experiment: str | None = Field(None, description="default: the sweep name")


class SweepSpec(Frozen):
    """A whole sweep, as written in ``sweeps/*.yaml``."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    tasks: list[str] | str
    seeds: int | list[int]
    agents: list[AgentEntry] = Field(min_length=1)
    train: dict[str, Any] = Field(default_factory=dict, description="TrainSpec fields shared by all trials")
    final_eval: FinalEvalSpec = FinalEvalSpec()
    resources: ResourcesSpec = ResourcesSpec()
    max_retries: int = Field(2, ge=0)
    max_concurrent_trials: int | None = Field(None, ge=1)
    storage_path: str = Field("results", description="sweep output root (QED_STORAGE_PATH overrides)")
    tracking: TrackingSpec = TrackingSpec()

    @field_validator("tasks")
    @classmethod
    def _tasks(cls, v: list[str] | str) -> list[str]:
        if isinstance(v, str):
            if v not in TASK_SETS:
                raise ValueError(f"unknown task set {v!r}; task sets: {', '.join(TASK_SETS)} (or a list of tasks)")
            return list(TASK_SETS[v])
        bad = [t for t in v if t not in TASKS]
        if bad:
            raise ValueError(f"unknown task(s) {bad}; valid tasks: {', '.join(TASKS)}")
        if len(set(v)) != len(v) or not v:
            raise ValueError("must be a non-empty list without duplicates")
        return v

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, v: int | list[int]) -> list[int]:
        seeds = list(range(v)) if isinstance(v, int) else v
        if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
            raise ValueError(f"{v!r}: need a count >= 1 or a list of distinct seeds >= 0")
        return seeds

    @model_validator(mode="after")
    def _check_train(self) -> "SweepSpec":
        self.train_spec()
        for i, a in enumerate(self.agents):
            try:
                a.agent_spec()
            except ValidationError as e:
                raise ValueError(format_validation_error(e, prefix=f"agents.{i}.overrides.")) from None
            for j, t in enumerate(a.temperatures):
                try:
                    t.expand()
                except ValidationError as e:
                    raise ValueError(format_validation_error(e, prefix=f"agents.{i}.temperatures.{j}.")) from None
        return self

    def train_spec(self) -> TrainSpec:
        """The shared TrainSpec (validated; errors are prefixed ``train.``)."""
        try:
            return TrainSpec.model_validate(self.train)
        except ValidationError as e:
            raise ValueError(format_validation_error(e, prefix="train.")) from None

    def runs(self) -> list[RunSpec]:
        """The expanded grid, ordered task, agent, variant, seed (deterministic)."""
        train = self.train_spec()
        out = []
        for task in self.tasks:
            for entry in self.agents:
                agent = entry.agent_spec()
                temps = [t for v in entry.temperatures for t in v.expand()]
                for temp in temps:
                    for seed in self.seeds:
                        out.append(RunSpec(task=task, seed=seed, agent=agent, temperature=temp, train=train))
        names = [r.name for r in out]
        if len(set(names)) != len(names):
            raise SpecError("agents: two entries expand to the same trial name (duplicate agent/variant)")
        return out

    def fingerprint(self) -> str:
        """Hash of the grid (restoring a sweep with a different grid is refused)."""
        payload = json.dumps([r.model_dump(mode="json") for r in self.runs()], sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def load_spec(path: str | Path) -> SweepSpec:
    """Reads and validates a sweep YAML; raises :class:`SpecError` with one line per problem."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as e:
        raise SpecError(f"{path}: cannot be read ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: invalid YAML ({e})") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: expected a mapping at the top level")
    try:
        return SweepSpec.model_validate(raw)
    except ValidationError as e:
        raise SpecError(f"{path}: {format_validation_error(e)}") from None
