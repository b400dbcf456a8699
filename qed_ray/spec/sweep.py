"""Sweep specs: one YAML describes a task x agent x setting x seed grid, validated once and expanded to trials.

Any field of an agent's ``overrides``, of a ``temperatures`` entry or of ``train`` may be a list: each list is a
grid axis and the trials are the product of all axes (``k: [0.1, 0.2]``, ``hidden: [256, 512]``,
``mad: {proportion_real: [0.5, 0.95]}``). Errors name the field, the value and what is allowed; every problem of a
spec is reported at once, and nothing is started before the whole spec is valid.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, ValidationInfo, field_validator, model_validator

from qed_ray.spec import yaml_input
from qed_ray.spec.claim import AdaptiveSpec
from qed_ray.spec.config import AGENT_SPECS, MAX_SEED, AgentBase, Frozen, RunSpec, TemperatureSpec, TrainSpec
from qed_ray.spec.field_hints import format_validation_error, k_in_words, k_warning
from qed_ray.spec.grid import expand_grid, grid_size, validate_grid
from qed_ray.spec.hints import duplicates, near, short_repr, short_text
from qed_ray.spec.naming import identity, variant_label
from qed_ray.spec.replay_memory import ReplayNeed, replay_needs, replay_problems
from qed_ray.spec.search import SearchSpec, search_problems
from qed_ray.spec.tasks import TASK_SETS, TASKS

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
        return self.name.split("/")[2]


def _train_spec(raw: dict) -> TrainSpec:
    spec = TrainSpec.model_validate(raw)
    problem = spec.budget_problem()
    if problem:
        raise ValueError(problem)
    return spec


class AgentEntry(Frozen):
    """An agent of the grid: its setting overrides and its temperature variants (lists are grid axes)."""

    name: str = Field(description="base agent")
    overrides: dict[str, Any] = Field(default_factory=dict, description="agent settings (lists are axes)")
    temperatures: list[dict[str, Any]] = Field(min_length=1, description="temperature rules (lists are axes)")
    tasks: list[str] | None = Field(None, min_length=1, description="the sweep's tasks this entry runs on (none: "
                                                                    "all of them), e.g. controls on a subset")
    train: dict[str, Any] = Field(default_factory=dict, description="train settings of this entry's trials, over "
                                  "the sweep's train (lists are axes), e.g. a control with shared_indices: true")

    @field_validator("name")
    @classmethod
    def _registered(cls, v: str) -> str:
        if v not in AGENT_SPECS:
            raise ValueError(f"unknown agent {short_repr(v)}{near(v, AGENT_SPECS)}; implemented agents: "
                             f"{', '.join(AGENT_SPECS)}")
        return v

    @field_validator("overrides")
    @classmethod
    def _check_overrides(cls, v: dict, info: ValidationInfo) -> dict:
        if "name" in v:
            raise ValueError("name: give the agent's name as the entry's 'name', not in its overrides")
        if "name" in info.data:  # else the name itself is the reported problem
            validate_grid(v, AGENT_SPECS[info.data["name"]].model_validate, "agent", MAX_TRIALS)
        return v

    @field_validator("temperatures")
    @classmethod
    def _check_temperatures(cls, v: list[dict]) -> list[dict]:
        problems = []
        for j, entry in enumerate(v):
            try:
                validate_grid(entry, TemperatureSpec.model_validate, "temperature", MAX_TRIALS)
            except ValueError as e:
                problems.extend(f"{j}.{line}" if _names_field(line) else f"{j}: {line}" for line in str(e).splitlines())
        if problems:
            raise ValueError("\n".join(problems))
        return v

    def agent_specs(self) -> list[AgentBase]:
        return [AGENT_SPECS[self.name].model_validate(c) for c in expand_grid(self.overrides)]

    def temperature_specs(self) -> list[TemperatureSpec]:
        return [TemperatureSpec.model_validate(c) for entry in self.temperatures for c in expand_grid(entry)]

    def size(self) -> int:
        """Without expanding the grid."""
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
                raise ValueError(f"{short_repr(list(v))} names a policy twice")
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
    """How many seed runs one Tune trial trains together (paper App. C trains all 10 seeds of a run on one GPU at
    once), which runs may share a pack (``by: shape``: QED's three k values as one pack of 30), and on how many env
    worker processes their envs step."""

    seeds: int | Literal["auto"] = Field(1, description="seed runs per pack (Tune trial); 1: packs of one; auto: "
                                         "the largest that fits the machine and keeps every node busy")
    by: Literal["variant", "shape"] = Field(
        "variant", description="which seed runs share a pack: 'variant' (the seeds of one task, agent and variant) "
                               "or 'shape' (one task, agent, temperature kind and network shape: variants that "
                               "differ only in temperature k, alpha, alpha_max or init_alpha train together)")
    env_workers: int = Field(0, ge=0, le=MAX_PACK, description="env worker processes per pack (0: the pack's own "
                                                               "process steps its envs); each asks for one more CPU")

    @field_validator("seeds", mode="before")
    @classmethod
    def _seeds(cls, v: Any) -> Any:
        if v == "auto" or (type(v) is int and 1 <= v <= MAX_PACK):
            return v
        raise ValueError(f"allowed 1 to {MAX_PACK} seeds per pack, or auto (the largest pack that fits the machine; "
                         f"got {short_text(repr(v))})")

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = [k for k in data if k not in cls.model_fields]  # keys of any type
            if unknown:
                raise ValueError(f"{short_text(str(unknown[0]))}: not a pack field; pack takes seeds (1 to "
                                 f"{MAX_PACK} or auto), env_workers (0 to pack.seeds) and by (variant or shape)")
        return data

    @model_validator(mode="after")
    def _workers(self) -> "PackSpec":
        if self.seeds != "auto" and self.env_workers > self.seeds:
            raise ValueError(f"env_workers: {self.env_workers} workers for the {self.seeds} training "
                             f"env{'s' if self.seeds > 1 else ''} of a pack; "
                             f"allowed 0 to {self.seeds} (pack.seeds)")
        return self


class TrackingSpec(Frozen):
    """MLflow: URI (default: SQLite in the sweep folder; ``MLFLOW_TRACKING_URI`` overrides) and experiment."""

    uri: str | None = Field(None, description="tracking URI")
    experiment: str | None = Field(None, max_length=200, description="default: the sweep name")


class SweepSpec(Frozen):
    """A whole sweep, as written in ``sweeps/*.yaml``."""

    _look: tuple[dict[str, int], int] | None = PrivateAttr(None)  # at_look: the trials of one look only
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
                              "docs/claim.md); frozen in sweep.json at the first start (qed_ray.spec.claim)")
    adaptive: AdaptiveSpec | None = Field(None, description="seeds by looks (docs/claim.md); seeds: the maximum's")
    search: SearchSpec | None = Field(None, description="search QED's k (and alpha_max) per task and agent with "
                                      "Optuna, te the reference (qed_ray.spec.search; the 'search' extra)")

    @field_validator("tasks", mode="before")
    @classmethod
    def _tasks(cls, v: Any) -> list[str]:
        if isinstance(v, str):
            if v in TASKS:
                raise ValueError(f"{v!r} is a task, not a task set; give a list of tasks: [{v}]")
            if v not in TASK_SETS:
                raise ValueError(f"unknown task set {short_repr(v)}{near(v, [*TASK_SETS, *TASKS])}; task sets: "
                                 f"{', '.join(TASK_SETS)} (or a list of tasks)")
            return list(TASK_SETS[v])
        if not isinstance(v, list) or not v or not all(isinstance(t, str) for t in v):
            raise ValueError(f"need a task set name or a non-empty list of task names (got {short_repr(v)})")
        bad = list(dict.fromkeys(t for t in v if t not in TASKS))
        if bad:
            raise ValueError(f"unknown task(s) {short_repr(bad)}{near(bad[0], TASKS)}; valid tasks: "
                             f"{', '.join(TASKS)}")
        if duplicates(v):
            raise ValueError(f"duplicate tasks {short_repr(sorted(duplicates(v)))}")
        return v

    @field_validator("seeds", mode="before")
    @classmethod
    def _seeds(cls, v: Any) -> list[int]:
        if isinstance(v, int) and not isinstance(v, bool):
            if not 1 <= v <= MAX_SEEDS:
                raise ValueError(f"a count of {short_repr(v)} seeds; need 1 to {MAX_SEEDS:,} (or a list of seeds)")
            return list(range(v))
        if not isinstance(v, list) or any(isinstance(s, bool) or not isinstance(s, int) for s in v):
            raise ValueError(f"need a seed count or a list of integer seeds (got {short_repr(v)})")
        if not v or len(v) > MAX_SEEDS:
            raise ValueError(f"a list of {len(v)} seeds; need 1 to {MAX_SEEDS:,}")
        bad = [s for s in v if not 0 <= s <= MAX_SEED]
        if bad:
            raise ValueError(f"seeds {short_repr(bad[:5])} are outside 0..{MAX_SEED} (2^32 - 1, the generators' range)")
        if duplicates(v):
            raise ValueError(f"duplicate seeds {sorted(duplicates(v))[:5]}")
        return v

    @field_validator("train")
    @classmethod
    def _check_train(cls, v: dict) -> dict:
        validate_grid(v, _train_spec, "train", MAX_TRIALS)
        return v

    @model_validator(mode="after")
    def _check_entry_train(self) -> "SweepSpec":
        for i, entry in enumerate(self.agents):
            if entry.train:
                try:
                    validate_grid(self.entry_train(entry), _train_spec, "train", MAX_TRIALS)
                except ValueError as e:
                    raise ValueError("\n".join(f"agents.{i}.train.{line}" for line in str(e).splitlines())) from None
        return self

    def entry_train(self, entry: AgentEntry) -> dict[str, Any]:
        return {**self.train, **entry.train}

    @model_validator(mode="after")
    def _check_shared_indices(self) -> "SweepSpec":
        shared = any(t.shared_indices for t in self.train_specs())
        if shared and self.pack.seeds == "auto":
            raise ValueError("pack.seeds: auto, but train.shared_indices: true couples the seeds of a pack (its size "
                             "sets the coupling), so a pack keeps the size the spec registers; set pack.seeds to the "
                             "seeds trained together (the paper's 10)")
        if self.pack.seeds == 1 and shared:
            raise ValueError("train.shared_indices: true makes the seeds of a pack draw the same replay positions, "
                             "but pack.seeds is 1 (packs of one share nothing); set pack.seeds to the seeds trained "
                             "together (the paper's 10)")
        return self

    @model_validator(mode="after")
    def _check_adaptive(self) -> "SweepSpec":
        problem = self.adaptive and self.adaptive.misfit(len(self.seeds), self.pack.seeds, self.pack.by)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _check_search(self) -> "SweepSpec":
        problems = search_problems(self) if self.search is not None else []
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @model_validator(mode="after")
    def _check_size(self) -> "SweepSpec":
        for i, entry in enumerate(self.agents):
            bad = [t for t in entry.tasks or [] if t not in self.tasks]
            if bad or len(set(entry.tasks or [])) != len(entry.tasks or []):
                raise ValueError(f"agents.{i}.tasks: {bad or entry.tasks} must be distinct tasks of the sweep's "
                                 f"tasks ({', '.join(self.tasks)})")
        n = len(self.seeds) * sum(grid_size(self.entry_train(a)) * len(a.tasks or self.tasks) * a.size()
                                  for a in self.agents)
        if n > MAX_TRIALS:
            raise ValueError(f"seeds: the grid has {n:,} trials (tasks x agents x variants x seeds); at most "
                             f"{MAX_TRIALS:,}")
        problems = replay_problems(self.replay_needs()) + self._device_problems()
        if problems:  # before the grid is expanded into trials
            raise ValueError("\n".join(problems))
        dupes = duplicates(t.name for t in self.trials())  # linear: a grid may hold MAX_TRIALS names
        if dupes:
            raise ValueError(f"agents: two entries expand to the same trial {dupes[0]} (a duplicate agent/variant)")
        return self

    def replay_needs(self) -> list[ReplayNeed]:
        """The replay sizes of the grid per seed and per pack, largest first."""
        tasks = dict.fromkeys(t for entry in self.agents for t in entry.tasks or self.tasks)
        # A pack by shape holds several variants' seeds: up to pack.seeds members.
        # auto: sized by the plan to fit its machine, within the pack cap (qed_ray.service.plan.dry_plan)
        size = 1 if self.pack.seeds == "auto" else self.pack.seeds
        members = size if self.pack.by == "shape" else min(size, len(self.seeds))
        return replay_needs([(task, train) for task in tasks for train in self.train_specs()], members)

    def _device_problems(self) -> list[str]:
        # Ray gives a trial the GPU share it asks for and hides every other device: without resources.gpu a trial
        # has no CUDA device (it would fail at its start), and with one it sees its GPU as cuda:0.
        devices = dict.fromkeys(t.device for t in self.train_specs() if t.device.startswith("cuda"))
        if devices and self.resources.gpu == 0:
            return [f"train.device: {next(iter(devices))!r} needs a GPU, but resources.gpu is 0 (the trials run on "
                    f"CPUs); set resources.gpu (1, or 0.5 to share a GPU), or train.device: auto"]
        other = [d for d in devices if d not in ("cuda", "cuda:0")]
        return [f"train.device: {other[0]!r}: a trial sees only the GPU Ray assigns it, as cuda:0; use 'cuda' or "
                f"'auto'"] if other else []

    def train_specs(self) -> list[TrainSpec]:
        """One TrainSpec per combination of ``train``'s axes (and of each entry's own train settings)."""
        return list(dict.fromkeys(t for trains in self._trains for t in trains))

    @functools.cached_property
    def _trains(self) -> list[list[TrainSpec]]:
        return [[TrainSpec.model_validate(c) for c in expand_grid(self.entry_train(e))] for e in self.agents]

    @functools.cached_property
    def _trials(self) -> list[Trial]:
        # A variant's label depends on its settings, never on the task or seed: labelled once per combination of
        # settings, so that a grid at MAX_TRIALS validates in linear time with a small constant.
        combos = [(entry, agent, temp, train) for entry, trains in zip(self.agents, self._trains)
                  for agent in entry.agent_specs() for temp in entry.temperature_specs() for train in trains]
        protos = [RunSpec(task=(entry.tasks or self.tasks)[0], agent=a, temperature=t, train=tr)
                  for entry, a, t, tr in combos]
        axes = _varying_settings(protos)
        labels = [variant_label(r, axes[r.agent.name]) for r in protos]
        # Each run is its combination's validated RunSpec with the task and seed put in: both were checked by
        # this spec's validators (the checks RunSpec makes), so 100,000 runs are not validated field by field again.
        return [Trial(f"{task}/{r.agent.name}/{label}/{seed}", r.model_copy(update={"task": task, "seed": seed}))
                for task in self.tasks for (entry, *_), r, label in zip(combos, protos, labels)
                if entry.tasks is None or task in entry.tasks for seed in self.seeds]

    def trials(self) -> list[Trial]:
        """The expanded grid, ordered task, agent, agent settings, variant, train settings, seed (a spec
        :meth:`at_look`: that look's only)."""
        if self._look is None:
            return list(self._trials)
        seeds, default = self._look
        first = {s: i for i, s in enumerate(self.seeds)}
        return [t for t in self._trials if first[t.run.seed] < seeds.get(t.variant, default)]

    def at_look(self, seeds: dict[str, int], default: int) -> "SweepSpec":
        """This spec at one look (``adaptive``): each variant's first ``seeds[variant]`` seeds (else ``default``)."""
        copy = self.model_copy()
        copy._look = (dict(seeds), default)
        return copy

    def runs(self) -> list[RunSpec]:
        return [t.run for t in self.trials()]

    def sized(self, seeds: int) -> "SweepSpec":
        """This spec with packs of ``seeds`` (``pack.seeds: auto`` resolved; env workers at most ``seeds``)."""
        pack = self.pack.model_copy(update={"seeds": seeds, "env_workers": min(self.pack.env_workers, seeds)})
        return self.model_copy(update={"pack": pack})

    def trial_resources(self) -> dict[str, float]:
        """Ray resources of one Tune trial: ``resources.cpu`` plus one CPU per env worker, and ``resources.gpu``."""
        return {"cpu": self.resources.cpu + self.pack.env_workers, "gpu": self.resources.gpu}

    def warnings(self) -> list[str]:
        """What a valid spec may not mean: each agent's QED k outside the usual range."""
        ks = [(entry.name, k) for entry in self.agents
              for k in dict.fromkeys(t.k for t in entry.temperature_specs() if t.kind == "qed")]
        return [w for w in (k_warning(agent, k) for agent, k in ks) if w]

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


def load_yaml(path: str | Path) -> Any:
    """Parses a YAML file strictly and within its budgets; raises SpecError with one line."""
    try:
        return yaml_input.load(path)
    except yaml_input.YamlInputError as e:
        raise SpecError(str(e)) from None


def load_spec(path: str | Path) -> SweepSpec:
    """Reads and validates a sweep YAML; raises :class:`SpecError` with one line per problem."""
    raw = load_yaml(path)
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: expected a mapping at the top level")
    try:
        return SweepSpec.model_validate(raw)
    except ValidationError as e:
        raise SpecError("\n".join(k_in_words(line, raw) for line in format_validation_error(e).splitlines())) \
            from None
