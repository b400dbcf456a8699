"""Sweep specs: one YAML describes a task x agent x setting x seed grid, validated once and expanded to trials.

Any field of an agent's ``overrides``, of a ``temperatures`` entry or of ``train`` may be a list: each list is a
grid axis and the trials are the product of all axes (``k: [0.1, 0.2]``, ``hidden: [256, 512]``,
``mad: {proportion_real: [0.5, 0.95]}``). Errors name the field, the value and what is allowed; every problem of a
spec is reported at once, and nothing is started before the whole spec is valid.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from qed_ray.config import AGENT_SPECS, MAX_SEED, AgentBase, Frozen, RunSpec, TemperatureSpec, TrainSpec, \
    format_validation_error
from qed_ray.naming import identity, variant_label
from qed_ray.tasks import TASK_SETS, TASKS

MAX_SEEDS = 10_000  # per sweep; far above the paper's 10, far below what exhausts memory while expanding
MAX_TRIALS = 100_000  # a grid past this is a typo (it would take longer to schedule than to notice)


class SpecError(ValueError):
    """An invalid sweep spec; the message is one line per problem, each naming its field."""


@dataclass(frozen=True)
class Trial:
    """One trial of a sweep: its name ``task/agent/variant/seed`` (variant includes the sweep's axes) and run."""

    name: str
    run: RunSpec

    @property
    def variant(self) -> str:
        """The variant part of the name."""
        return self.name.split("/")[2]


def grid_axes(raw: dict, prefix: str = "") -> dict[str, list]:
    """``{dotted.path: values}`` of the list-valued leaves of a (nested) mapping: the grid axes it declares."""
    out: dict[str, list] = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            out.update(grid_axes(value, f"{prefix}{key}."))
        elif isinstance(value, list):
            out[f"{prefix}{key}"] = value
    return out


def grid_size(raw: dict) -> int:
    """Number of combinations :func:`expand_grid` yields (computed without expanding)."""
    return math.prod(len(v) for v in grid_axes(raw).values())


def expand_grid(raw: dict) -> list[dict]:
    """The product of the mapping's axes: one concrete nested mapping per combination, in axis order."""
    axes = grid_axes(raw)
    out = []
    for combo in itertools.product(*axes.values()):
        concrete = json.loads(json.dumps(raw))
        for path, value in zip(axes, combo):
            *parents, leaf = path.split(".")
            node = concrete
            for key in parents:
                node = node[key]
            node[leaf] = value
        out.append(concrete)
    return out


def _train_spec(raw: dict) -> TrainSpec:
    spec = TrainSpec.model_validate(raw)
    problem = spec.budget_problem()
    if problem:
        raise ValueError(problem)
    return spec


def _validate_grid(raw: dict, model, what: str) -> list:
    """Validates every combination of ``raw``'s axes with ``model``; raises one ValueError listing every problem."""
    if not isinstance(raw, dict):
        raise ValueError(f"expected a mapping of {what} settings")
    if any(not v for v in grid_axes(raw).values()):
        raise ValueError(f"{next(k for k, v in grid_axes(raw).items() if not v)}: an empty list gives no trials")
    if grid_size(raw) > MAX_TRIALS:
        raise ValueError(f"{' x '.join(grid_axes(raw))}: {grid_size(raw):,} combinations (at most {MAX_TRIALS:,})")
    specs, problems = [], []
    for concrete in expand_grid(raw):
        try:
            specs.append(model(concrete))
        except ValidationError as e:
            problems.extend(format_validation_error(e).splitlines())
        except ValueError as e:  # a check beyond the model's own (a budget that trains nothing)
            problems.append(str(e))
    if problems:
        raise ValueError("\n".join(dict.fromkeys(problems)))
    return specs


class AgentEntry(Frozen):
    """An agent of the grid: its setting overrides and its temperature variants (lists are grid axes)."""

    name: str = Field(description="base agent")
    overrides: dict[str, Any] = Field(default_factory=dict, description="agent settings (lists are axes)")
    temperatures: list[dict[str, Any]] = Field(min_length=1, description="temperature rules (lists are axes)")
    tasks: list[str] | None = Field(None, min_length=1, description="the sweep's tasks this entry runs on (none: "
                                                                    "all of them), e.g. controls on a subset")

    @field_validator("name")
    @classmethod
    def _registered(cls, v: str) -> str:
        if v not in AGENT_SPECS:
            raise ValueError(f"unknown agent {v!r}; implemented agents: {', '.join(AGENT_SPECS)}")
        return v

    @field_validator("overrides")
    @classmethod
    def _check_overrides(cls, v: dict, info: ValidationInfo) -> dict:
        if "name" in v:
            raise ValueError("name: give the agent's name as the entry's 'name', not in its overrides")
        if "name" in info.data:  # else the name itself is the reported problem
            _validate_grid(v, AGENT_SPECS[info.data["name"]].model_validate, "agent")
        return v

    @field_validator("temperatures")
    @classmethod
    def _check_temperatures(cls, v: list[dict]) -> list[dict]:
        problems = []
        for j, entry in enumerate(v):
            try:
                _validate_grid(entry, TemperatureSpec.model_validate, "temperature")
            except ValueError as e:
                problems.extend(f"{j}.{line}" if _names_field(line) else f"{j}: {line}" for line in str(e).splitlines())
        if problems:
            raise ValueError("\n".join(problems))
        return v

    def agent_specs(self) -> list[AgentBase]:
        """One validated agent spec per combination of the overrides' axes."""
        return [AGENT_SPECS[self.name].model_validate(c) for c in expand_grid(self.overrides)]

    def temperature_specs(self) -> list[TemperatureSpec]:
        """Every temperature variant, entries in order, each entry's axes expanded."""
        return [TemperatureSpec.model_validate(c) for entry in self.temperatures for c in expand_grid(entry)]

    def size(self) -> int:
        """Agent combinations x temperature variants (without expanding)."""
        return grid_size(self.overrides) * sum(grid_size(t) for t in self.temperatures)


def _names_field(line: str) -> bool:
    head, sep, _ = line.partition(": ")
    return bool(sep) and re.fullmatch(r"[\w.]+", head) is not None


EVAL_POLICIES = ("mean", "sample")


class FinalEvalSpec(Frozen):
    """Cross-seed evaluation of finished trials (paper Sec. 6.1-6.2, App. E)."""

    policies: tuple[Literal["mean", "sample"], ...] = Field(
        ("mean",), description="evaluation policies: 'mean' acts with tanh(mu), 'sample' draws from the policy "
                               "with noise shared across seeds per eval episode; the first gives the main tables "
                               "and figures, each other one its own set (gather/policy_<name>/)")
    episodes: int = Field(20, ge=1, le=10_000, description="eval rollouts per policy (states pooled for V)")
    action_rollouts: int = Field(20, ge=1, le=10_000, description="trajectories for the action distance")
    action_steps: int = Field(100, ge=1, le=500, description="decisions per action-distance trajectory")
    curve_episodes: int = Field(2, ge=1, le=10_000, description="episodes per seed for V at intermediate snapshots")
    keep_every: int = Field(1, ge=1, le=10**6, description="keep a policy snapshot every n-th evaluation")
    bootstrap_reps: int = Field(2000, ge=100, le=10**6, description="stratified bootstrap resamples")
    confidence: float = Field(0.95, gt=0, lt=1, description="confidence level of the intervals")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="bootstrap RNG seed")
    proxy_window: int = Field(15, ge=1, le=10_000, description="critic proxy (App. D): the first n evaluations "
                                                               "whose |Q1 - Q2| make its x")

    @field_validator("policies", mode="before")
    @classmethod
    def _policy_list(cls, v: Any) -> Any:
        # YAML and JSON give a list (or one name); the frozen model keeps a tuple, so it stays hashable.
        if isinstance(v, str):
            v = [v]
        if isinstance(v, list):
            v = tuple(v)
        if isinstance(v, tuple):
            if not v:
                raise ValueError(f"need at least one of {', '.join(EVAL_POLICIES)}")
            if len(set(v)) != len(v):
                raise ValueError(f"{list(v)} names a policy twice")
        return v


class ResourcesSpec(Frozen):
    """Ray resources per Tune trial: a seed run, or a pack of them (``pack.seeds`` > 1; its env workers add one CPU
    each, :meth:`SweepSpec.trial_resources`). Fractional GPUs let several trials share one GPU."""

    cpu: float = Field(1.0, ge=0.01, le=1024, description="CPUs per trial (pack), env workers not counted")
    gpu: float = Field(0.0, ge=0, le=1, description="GPU fraction per trial (pack), in [0, 1]")

    @field_validator("gpu")
    @classmethod
    def _divides_one(cls, v: float) -> float:
        # A trial never spans GPUs; fractions that do not divide 1 strand capacity (ray#5902), and Ray cannot
        # represent shares finer than 1e-4.
        if 0 < v < 0.01:
            raise ValueError(f"{v} is too small to be useful (at least 0.01, i.e. 100 trials per GPU)")
        if 0 < v < 1 and abs(round(1 / v) - 1 / v) > 1e-6:
            raise ValueError(f"{v} does not divide 1 (use e.g. 0.5, 0.25, 0.1)")
        return v


MAX_PACK = 1000  # seeds per pack; the paper trains 10


class PackSpec(Frozen):
    """How many seed runs of one (task, agent, variant) one Tune trial trains together (paper App. C trains all 10
    seeds of a run on one GPU at once), and on how many env worker processes their envs step.

    ``seeds: 1`` (the default) is the unpacked sweep: one Tune trial per seed run, as before packs existed.
    """

    seeds: int = Field(1, ge=1, le=MAX_PACK, description="seed runs per pack (Tune trial); 1: unpacked")
    env_workers: int = Field(0, ge=0, le=MAX_PACK, description="env worker processes per pack (0: the pack's own "
                                                               "process steps its envs); each asks for one more CPU")

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(cls.model_fields))
            if unknown:
                raise ValueError(f"{unknown[0]}: not a pack field; pack takes seeds (1 to {MAX_PACK}) and env_workers "
                                 f"(0 to pack.seeds)")
        return data

    @model_validator(mode="after")
    def _workers(self) -> "PackSpec":
        if self.seeds == 1 and self.env_workers:
            raise ValueError(f"env_workers: {self.env_workers} env workers, but with seeds 1 trials run unpacked "
                             f"(one env each, stepped in the trial's process): set env_workers 0, or seeds > 1")
        if self.env_workers > self.seeds:
            raise ValueError(f"env_workers: {self.env_workers} workers for the {self.seeds} training envs of a pack; "
                             f"allowed 0 to {self.seeds} (pack.seeds)")
        return self


class TrackingSpec(Frozen):
    """MLflow: URI (default: SQLite in the sweep folder; ``MLFLOW_TRACKING_URI`` overrides) and experiment."""

    uri: str | None = Field(None, description="tracking URI")
    experiment: str | None = Field(None, max_length=200, description="default: the sweep name")


class SweepSpec(Frozen):
    """A whole sweep, as written in ``sweeps/*.yaml``."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=100)
    tasks: list[str] = Field(description="task names, or a task set name (dmc18)")
    seeds: list[int] = Field(description="a seed count (10 -> 0..9) or a list of seeds")
    agents: list[AgentEntry] = Field(min_length=1)
    train: dict[str, Any] = Field(default_factory=dict, description="TrainSpec settings shared by all trials")
    final_eval: FinalEvalSpec = FinalEvalSpec()
    resources: ResourcesSpec = ResourcesSpec()
    pack: PackSpec = PackSpec()
    max_retries: int = Field(2, ge=0, le=1000)
    max_concurrent_trials: int | None = Field(None, ge=1, le=MAX_TRIALS)
    storage_path: str = Field("results", description="sweep output root (QED_STORAGE_PATH overrides)")
    keep_replay: bool = Field(False, description="keep finished trials' replay chunks (resume and gather never "
                                                 "read them once a trial is done)")
    tracking: TrackingSpec = TrackingSpec()
    claim: str | None = Field(None, min_length=1, description="the pre-registration this sweep tests (a Markdown "
                              "file with one ```yaml claim block, relative to the current folder, e.g. "
                              "docs/claim.md); frozen in sweep.json at the first start (qed_ray.claim)")

    @field_validator("tasks", mode="before")
    @classmethod
    def _tasks(cls, v: Any) -> list[str]:
        if isinstance(v, str):
            if v not in TASK_SETS:
                raise ValueError(f"unknown task set {v!r}; task sets: {', '.join(TASK_SETS)} (or a list of tasks)")
            return list(TASK_SETS[v])
        if not isinstance(v, list) or not v or not all(isinstance(t, str) for t in v):
            raise ValueError(f"need a task set name or a non-empty list of task names (got {v!r})")
        bad = [t for t in v if t not in TASKS]
        if bad:
            raise ValueError(f"unknown task(s) {bad}; valid tasks: {', '.join(TASKS)}")
        if len(set(v)) != len(v):
            raise ValueError(f"duplicate tasks {sorted({t for t in v if v.count(t) > 1})}")
        return v

    @field_validator("seeds", mode="before")
    @classmethod
    def _seeds(cls, v: Any) -> list[int]:
        if isinstance(v, int) and not isinstance(v, bool):
            if not 1 <= v <= MAX_SEEDS:
                raise ValueError(f"a count of {v} seeds; need 1 to {MAX_SEEDS:,} (or a list of seeds)")
            return list(range(v))
        if not isinstance(v, list) or any(isinstance(s, bool) or not isinstance(s, int) for s in v):
            raise ValueError(f"need a seed count or a list of integer seeds (got {v!r})")
        if not v or len(v) > MAX_SEEDS:
            raise ValueError(f"a list of {len(v)} seeds; need 1 to {MAX_SEEDS:,}")
        bad = [s for s in v if not 0 <= s <= MAX_SEED]
        if bad:
            raise ValueError(f"seeds {bad[:5]} are outside 0..{MAX_SEED} (2^32 - 1, the generators' range)")
        if len(set(v)) != len(v):
            raise ValueError(f"duplicate seeds {sorted({s for s in v if v.count(s) > 1})[:5]}")
        return v

    @field_validator("train")
    @classmethod
    def _check_train(cls, v: dict) -> dict:
        _validate_grid(v, _train_spec, "train")
        return v

    @model_validator(mode="after")
    def _check_size(self) -> "SweepSpec":
        for i, entry in enumerate(self.agents):
            bad = [t for t in entry.tasks or [] if t not in self.tasks]
            if bad or len(set(entry.tasks or [])) != len(entry.tasks or []):
                raise ValueError(f"agents.{i}.tasks: {bad or entry.tasks} must be distinct tasks of the sweep's "
                                 f"tasks ({', '.join(self.tasks)})")
        n = len(self.seeds) * grid_size(self.train) * sum(len(a.tasks or self.tasks) * a.size() for a in self.agents)
        if n > MAX_TRIALS:
            raise ValueError(f"seeds: the grid has {n:,} trials (tasks x agents x variants x seeds); at most "
                             f"{MAX_TRIALS:,}")
        names = [t.name for t in self.trials()]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"agents: two entries expand to the same trial {dupes[0]} (a duplicate agent/variant)")
        return self

    def train_specs(self) -> list[TrainSpec]:
        """One TrainSpec per combination of ``train``'s axes."""
        return [TrainSpec.model_validate(c) for c in expand_grid(self.train)]

    @functools.cached_property
    def _trials(self) -> list[Trial]:
        runs = [RunSpec(task=task, seed=seed, agent=agent, temperature=temp, train=train)
                for task in self.tasks for entry in self.agents if entry.tasks is None or task in entry.tasks
                for agent in entry.agent_specs()
                for temp in entry.temperature_specs() for train in self.train_specs() for seed in self.seeds]
        axes = _varying_settings(runs)
        return [Trial(f"{r.task}/{r.agent.name}/{variant_label(r, axes[r.agent.name])}/{r.seed}", r) for r in runs]

    def trials(self) -> list[Trial]:
        """The expanded grid, ordered task, agent, agent settings, variant, train settings, seed (deterministic).

        Variants name the temperature plus every agent/train setting that varies among one agent's trials.
        """
        return list(self._trials)

    def runs(self) -> list[RunSpec]:
        """The runs of :meth:`trials`, in the same order."""
        return [t.run for t in self.trials()]

    def trial_resources(self) -> dict[str, float]:
        """Ray resources of one Tune trial (a pack, or an unpacked seed run): ``resources.cpu`` for the trainer's
        process plus one CPU per env worker (``pack.env_workers``), and ``resources.gpu``."""
        return {"cpu": self.resources.cpu + self.pack.env_workers, "gpu": self.resources.gpu}

    def fingerprint(self) -> str:
        """Hash of the trials' identities (non-default settings only: a new defaulted option never changes it)."""
        payload = json.dumps(sorted(json.dumps(identity(r), sort_keys=True) for r in self.runs()))
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _varying_settings(runs: list[RunSpec]) -> dict[str, set[str]]:
    """Per agent name: the ``agent.*`` / ``train.*`` identity settings that take more than one value."""
    idents: dict[str, list[dict[str, str]]] = {}
    for r in runs:
        idents.setdefault(r.agent.name, []).append(
            {k: json.dumps(v) for k, v in identity(r).items() if k.startswith(("agent.", "train."))})
    out = {}
    for name, rows in idents.items():
        keys = set().union(*rows)
        out[name] = {k for k in keys if len({row.get(k, "<default>") for row in rows}) > 1}
    return out


class _StrictLoader(yaml.SafeLoader):
    """YAML 1.2 numbers (``3e-4`` is a float, not a string) and duplicate keys as errors."""


_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*)?(?:\.\d*)?[eE][-+]?\d+$"), list("-+0123456789."))


def _mapping_without_duplicates(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r} (the last one would win "
                                                               f"silently)", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def load_yaml(path: str | Path) -> Any:
    """Parses a YAML file strictly; raises SpecError with one line for an unreadable, non-UTF-8 or invalid file."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise SpecError(f"{path}: cannot be read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise SpecError(f"{path}: is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: invalid YAML ({' '.join(str(e).split())})") from None


def load_spec(path: str | Path) -> SweepSpec:
    """Reads and validates a sweep YAML; raises :class:`SpecError` with one line per problem."""
    raw = load_yaml(path)
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: expected a mapping at the top level")
    try:
        return SweepSpec.model_validate(raw)
    except ValidationError as e:
        raise SpecError(format_validation_error(e)) from None
