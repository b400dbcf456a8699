"""The gather step's typed results (``gather/results.json``, the CSV tables, the group cache, ``verdict.json``).

:class:`GroupResult` is what evaluating one (task, agent, variant) group's saved policies gives (expensive: it rolls
policies out); the other rows are computed from group results in :mod:`qed_ray.analysis.tables` (cheap, pure numpy).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from qed_ray.records.codec import Num, RecordError, dump, load_json, parse
from qed_ray.records.run import EvalRecord
from qed_ray.spec.naming import split_variant
from qed_ray.spec.sweep import FinalEvalSpec

NAN = math.nan
MOST_STATES = 0.5  # a group sat at QED's cap (or hot) when its late share of such states is above this
CI = {"value": "", "lower": "_ci_lower", "upper": "_ci_upper"}  # an Interval's CSV columns: x, x_ci_lower, x_ci_upper


class Row(BaseModel):
    """A results record: frozen, unknown keys refused, built like the dataclasses it replaced (fields in order, or
    by name); numbers from numpy are taken as Python numbers (lax, unlike the folder's :class:`Record`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, *args: Any, **fields: Any):
        super().__init__(**dict(zip(type(self).model_fields, args)), **fields)

    def to_json(self) -> Any:
        """Strict JSON (NaN as null)."""
        return dump(self)

    @classmethod
    def from_json(cls, data: Any):
        """Inverse of :meth:`to_json`, older shapes read as today's (:func:`older_row`); raises
        :class:`~qed_ray.records.codec.RecordError` naming the field."""
        return parse(cls, older_row(cls, data), cls.__name__)


def _is_num(info) -> bool:
    return info.annotation is float and any(isinstance(m, BeforeValidator) for m in info.metadata)


def older_row(cls: type[Row], row: Any) -> Any:
    """A row as written before its last columns existed, read as today's: a numeric column it lacks as NaN, an
    interval written flat (``x``, ``x_ci_lower``, ``x_ci_upper``) as the :class:`Interval` ``x``."""
    if not isinstance(row, dict):
        return row
    out = dict(row)
    for name, info in cls.model_fields.items():
        if info.annotation is Interval and name in out and not isinstance(out[name], dict):
            out[name] = {part: out.pop(name + suffix, None) for part, suffix in CI.items()}
        elif name not in out and _is_num(info):
            out[name] = None
    return out


def csv_row(record: BaseModel) -> dict[str, Any]:
    """A record's CSV row from its ``model_dump``: every field in order, an :class:`Interval` ``x`` as ``x``,
    ``x_ci_lower``, ``x_ci_upper``, a list joined by ``;``."""
    out: dict[str, Any] = {}
    for name, value in record.model_dump().items():
        if isinstance(value, dict):
            out.update({name + CI[part]: v for part, v in value.items()})
        else:
            out[name] = ";".join(map(str, value)) if isinstance(value, list) else value
    return out


class Interval(Row):
    """A point estimate with its percentile interval (NaN: undefined)."""

    value: Num = NAN
    lower: Num = NAN
    upper: Num = NAN

    def astuple(self) -> tuple[float, float, float]:
        return self.value, self.lower, self.upper


class GroupKey(NamedTuple):
    """One cross-seed group: the seeds of a (task, agent, variant); it alone keys the group's cache entry and
    bootstrap streams."""

    task: str
    agent: str
    variant: str

    @property
    def name(self) -> str:
        """``task/agent/variant`` (a trial name without its seed)."""
        return "/".join(self)


@dataclass(frozen=True)
class TrialRecord:
    """What the gather step needs of one finished trial (in memory, never written): paths and a small history."""

    name: str
    task: str
    agent: str
    variant: str
    seed: int
    frame_skip: int
    policies: dict[int, str]  # env_steps -> policy snapshot folder
    history: list[EvalRecord] = field(default_factory=list)  # the evaluations, as the trainer recorded them
    # env_steps -> the interval's diagnostics (history.json): where QED's alpha sat, the policy's entropy
    diagnostics: dict[int, dict[str, float]] = field(default_factory=dict)

    @property
    def group(self) -> GroupKey:
        return GroupKey(self.task, self.agent, self.variant)


class GroupResult(Row):
    """Every evaluated number of one (task, agent, variant); self-contained, so a group is cached alone.

    Shapes (P seeds, ascending; E final-eval episodes): ``returns`` [P][E], ``scores`` [P], ``D`` and
    ``action_distance_pairs`` [P][P], ``v_curve`` [[env_steps, V]], ``learning_curves`` {seed: [[env_steps, eval
    return]]}; docs/definitions.md defines each number (NaN: undefined or not logged). ``temperature`` (``te``,
    ``fixed``, ``qed``; "" for a label qed_ray did not write) and ``baseline`` (the variant label of its te baseline:
    its own for a te group) are read off the variant once, here, and written nowhere.
    """

    task: str
    agent: str
    variant: str
    seeds: list[int]
    final_env_steps: int
    returns: list[list[Num]]
    scores: list[Num]
    V: Num
    D: list[list[Num]]
    action_distance: Num
    v_curve: list[list[Num]]
    q1_dispersion: Num
    early_q_gap: Num
    learning_curves: dict[int, list[list[Num]]]
    action_distance_pairs: list[list[Num]]
    policy: str = "mean"
    other_policies: dict[str, GroupResult] = {}
    alpha_frac_floor: Num = NAN
    alpha_frac_cap: Num = NAN
    alpha_frac_floor_late: Num = NAN
    alpha_frac_cap_late: Num = NAN
    log_std_at_min: Num = NAN
    unverified_seeds: list[int] = []  # used unchecked: no digest recorded (group_cache)
    alpha_frac_hot_late: Num = NAN
    alpha_ratio_late: Num = NAN
    entropy_late: Num = NAN
    random_score: Num = NAN  # a uniform-random policy's mean normalised score on the task (the learning floor)
    temperature: str = Field("", exclude=True)
    baseline: str = Field("", exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _read_variant(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("variant"), str):
            data = {**data, **dict(zip(("temperature", "baseline"), split_variant(data["variant"])))}
        return data

    @property
    def key(self) -> GroupKey:
        return GroupKey(self.task, self.agent, self.variant)

    @property
    def is_baseline(self) -> bool:
        """A target-entropy group with no other temperature setting: the baseline of its variants."""
        return self.baseline == self.variant

    @property
    def at_cap(self) -> bool:
        """QED's alpha sat at alpha_max on most actor-update states in the last quarter of training."""
        return self.alpha_frac_cap_late > MOST_STATES

    @property
    def alpha_regime(self) -> str | None:
        """Where QED's alpha sat late in training: ``at_cap``, ``hot`` (below the cap but at least HOT_RATIO times
        alpha_TE on most states), else ``ok``; None: no estimate (te and fixed log no QED shares)."""
        if self.at_cap:
            return "at_cap"
        if not math.isfinite(self.alpha_frac_hot_late):
            return None
        return "hot" if self.alpha_frac_hot_late > MOST_STATES else "ok"

    def to_json(self, with_others: bool = True) -> dict:
        """The cache and ``results.json`` entry; ``with_others`` False leaves ``other_policies`` empty."""
        return dump(self if with_others else self.model_copy(update={"other_policies": {}}))


class GroupStats(Row):
    """Per-group numbers that depend on the bootstrap settings (``groups.csv`` beyond the evaluation)."""

    task: str
    agent: str
    variant: str
    n_seeds: int
    n_failed: int
    V_ci_lower: Num
    V_ci_upper: Num
    action_distance_ci_lower: Num
    action_distance_ci_upper: Num
    score_var: Num
    qed_at_cap: bool = False
    alpha_regime: str | None = None
    entropy_gap_late: Num = NAN


class Aggregate(Row):
    """One (agent, variant) across tasks (``aggregates.csv``: the first twelve columns are the original ones).

    Ratios are ``baseline / this`` (the ratio of task means of the variant's :class:`Comparison`; NaN for the
    baseline itself or without one), ``ratio_ci`` names their interval's pairing."""

    agent: str
    variant: str
    n_tasks: int
    n_seeds: int  # the smallest seed count over tasks (every seed is used; see n_runs)
    iqm: Num
    ci_lower: Num
    ci_upper: Num
    ci_width: Num
    mean_score: Num
    V_mean: Num
    V_median: Num
    action_distance_mean: Num
    n_runs: int
    n_failed: int
    V_mean_ci_lower: Num
    V_mean_ci_upper: Num
    action_distance_ci_lower: Num
    action_distance_ci_upper: Num
    score_var_mean: Num
    score_var_ci_lower: Num
    score_var_ci_upper: Num
    baseline: str
    V_ratio: Num
    V_ratio_ci_lower: Num
    V_ratio_ci_upper: Num
    score_var_ratio: Num
    score_var_ratio_ci_lower: Num
    score_var_ratio_ci_upper: Num
    mean_score_ci_lower: Num = NAN
    mean_score_ci_upper: Num = NAN
    ratio_ci: str = ""
    alpha_frac_floor_late: Num = NAN
    alpha_frac_cap_late: Num = NAN
    log_std_at_min: Num = NAN
    n_tasks_at_cap: int = 0
    alpha_ratio_late: Num = NAN
    n_tasks_hot: int = 0

    def headline(self) -> dict[str, float]:
        """The numbers the summary table and the sweep's MLflow parent run show."""
        return {k: getattr(self, k) for k in (
            "iqm", "ci_lower", "ci_upper", "ci_width", "V_mean", "V_median", "action_distance_mean", "n_runs",
            "n_failed", "V_mean_ci_lower", "V_mean_ci_upper", "V_ratio", "score_var_mean", "score_var_ratio",
            "alpha_frac_floor_late", "alpha_frac_cap_late", "log_std_at_min", "n_tasks_at_cap", "alpha_ratio_late",
            "n_tasks_hot")}


class Comparison(Row):
    """One variant against its target-entropy ``baseline`` over the tasks both have (``comparisons.csv``).

    The te / variant ratio of V, the action distance and the across-seed return variance summarised over tasks
    three ways (``_median``, ``_geomean`` of the per-task ratios, ``_means``: ratio of the task means),
    ``iqm_ratio`` = IQM(variant) / IQM(te), ``prob_improvement`` = P(variant > te), each an :class:`Interval`.
    ``pairing``: ``paired``, ``unpaired`` or ``paired on k of K tasks``; ``n_tasks_V``: tasks where both define V;
    ``n_seeds``, ``env_steps``: the smallest among the compared groups."""

    agent: str
    variant: str
    baseline: str
    pairing: str
    tasks: list[str]
    n_tasks: int
    n_tasks_V: int
    n_paired_tasks: int
    n_seeds: int
    env_steps: int
    V_ratio_median: Interval
    V_ratio_geomean: Interval
    V_ratio_means: Interval
    action_distance_ratio_median: Interval
    action_distance_ratio_geomean: Interval
    action_distance_ratio_means: Interval
    score_var_ratio_median: Interval
    score_var_ratio_geomean: Interval
    score_var_ratio_means: Interval
    iqm_ratio: Interval
    prob_improvement: Interval = Interval()


class BudgetIqm(Row):
    """IQM of the training-time evaluation returns / 1000 at one env-step budget (sample efficiency, App. F)."""

    agent: str
    variant: str
    env_steps: int
    n_tasks: int
    n_runs: int
    iqm: Num
    ci_lower: Num
    ci_upper: Num


class PerformanceProfile(Row):
    """One (agent, variant)'s performance profile (rliable's score distribution): at each threshold ``taus[t]``,
    the share of its runs scoring above it (``fraction``) with its stratified-bootstrap band."""

    agent: str
    variant: str
    n_tasks: int
    n_runs: int
    taus: list[Num]
    fraction: list[Num]
    ci_lower: list[Num]
    ci_upper: list[Num]


class CriticProxy(Row):
    """App. D for one (agent, variant): early |Q1 - Q2| vs final cross-seed Q1 dispersion per task, and R^2."""

    agent: str
    variant: str
    tasks: list[str]
    early_q_gap: list[Num]
    q1_dispersion: list[Num]
    r_squared: Num  # NaN with fewer than 3 tasks or no spread


class FailedTrial(Row):
    """A trial left out of the tables (failed for good, diverged, unfinished, or refused by the gather step), or
    ``gather`` itself, with the last line of the error."""

    name: str
    error: str

    @property
    def group(self) -> GroupKey | None:
        """The trial's group (None for an entry that is not a trial name ``task/agent/variant/seed``)."""
        parts = self.name.split("/")
        return GroupKey(*parts[:3]) if len(parts) == 4 else None


# The verdict's records (qed_ray.analysis.verdict judges and fills them; gather/verdict.json holds a Verdict).
class EndpointResult(Row):
    """One endpoint of one variant: its estimate and interval (at the variant's ``level``), rule and outcome."""

    name: str
    outcome: str
    estimate: Num
    lower: Num
    upper: Num
    rule: str


class TaskGuard(Row):
    """One task's guard: the learning floor, te's and QED's mean scores with the ends that decide, QED's mean over
    te's with its interval, the outcome and why; ``alpha_regime`` is the QED group's (None: no estimate)."""

    task: str
    outcome: str
    reason: str
    random_score: Num
    floor: Num
    baseline_mean: Num
    baseline_lower: Num
    variant_mean: Num
    variant_upper: Num
    mean_ratio: Num
    mean_ratio_lower: Num
    mean_ratio_upper: Num
    alpha_regime: str | None = None


class VariantVerdict(Row):
    """One QED variant against its te baseline; ``scope``: its departures from the registered design (empty:
    judged); ``level``: the two-sided level of its deciding intervals (NaN: none drawn); ``look``: the registered
    look its seeds make it (None: a fixed design)."""

    agent: str
    variant: str
    baseline: str
    outcome: str
    pairing: str
    n_tasks: int
    n_tasks_at_cap: int
    scope: list[str]
    endpoints: list[EndpointResult]
    level: Num = NAN
    guards: list[TaskGuard] = []
    look: int | None = None


class Verdict(Row):
    """The claim's verdict, per variant and overall (``claim_file`` None: by the registered design)."""

    claim_file: str | None
    claim_sha256: str | None
    outcome: str
    judged_over: str
    variants: list[VariantVerdict] = []
    correction: str = ""


class SweepResults(Row):
    """Everything the gather step computes for a sweep (``results.json``) under the evaluation policy ``policy``;
    ``other_policies`` holds the same tables under each further one; ``verdict`` None without a te and a QED
    variant."""

    sweep: str
    final_eval: FinalEvalSpec
    aggregates: list[Aggregate]
    groups: list[GroupResult]
    critic_proxy: list[CriticProxy]
    failed_trials: list[FailedTrial]
    n_trials: int
    group_stats: list[GroupStats] = []
    iqm_by_budget: list[BudgetIqm] = []
    policy: str = "mean"
    other_policies: dict[str, SweepResults] = {}
    comparisons: list[Comparison] = []
    verdict: Verdict | None = None
    performance_profiles: list[PerformanceProfile] = []

    def to_json(self) -> dict:
        """``results.json`` (strict JSON); each group once, under the policy whose tables it is in."""
        return dump(self.model_copy(update={"groups": [g.model_copy(update={"other_policies": {}})
                                                       for g in self.groups]}))

    @classmethod
    def from_json(cls, data: Any) -> SweepResults:
        """Inverse of :meth:`to_json` (the rows' older shapes read as today's, :func:`older_row`)."""
        return parse(cls, _older_rows(data), cls.__name__)


_ROWS = {"aggregates": Aggregate, "critic_proxy": CriticProxy, "group_stats": GroupStats, "iqm_by_budget": BudgetIqm,
         "comparisons": Comparison, "performance_profiles": PerformanceProfile}


def _older_rows(data: Any) -> Any:
    if not isinstance(data, dict):
        return data
    out = {**data, **{k: [older_row(row, r) for r in data[k]] for k, row in _ROWS.items()
                      if isinstance(data.get(k), list)}}
    if isinstance(data.get("other_policies"), dict):
        out["other_policies"] = {p: _older_rows(r) for p, r in data["other_policies"].items()}
    return out


def read_results(path: str | os.PathLike) -> SweepResults:
    """``gather/results.json``; raises :class:`~qed_ray.records.codec.RecordError` naming the file and the field."""
    data = load_json(path)
    try:
        return SweepResults.from_json(data)
    except RecordError as e:
        raise RecordError(f"{path}: {str(e).removeprefix('SweepResults: ')}") from None
