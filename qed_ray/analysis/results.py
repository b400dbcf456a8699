"""The gather step's typed results and their strict-JSON form (``gather/results.json``, the group cache).

:class:`GroupResult` is what evaluating one (task, agent, variant) group's saved policies gives (expensive: it
rolls policies out); everything else here is computed from group results in :mod:`qed_ray.analysis.tables` (cheap, pure
numpy): :class:`GroupStats` (per-group intervals), :class:`Aggregate` (per agent-variant across tasks),
:class:`BudgetIqm` (IQM at intermediate budgets), :class:`CriticProxy` (App. D). :class:`FailedTrial` is a trial
left out of the tables, with the reason.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from qed_ray.records.codec import JsonRecord, Num, RecordError, load_json, parse
from qed_ray.records.run import EvalRecord
from qed_ray.spec.sweep import FinalEvalSpec

MOST_STATES = 0.5  # a group sat at QED's cap (or hot) when its late share of such states is above this


def missing_numbers(cls: type, row: Any) -> Any:
    """A results row (a dataclass ``cls`` as JSON) with each numeric column it lacks as null (NaN): the row was
    written before that column existed."""
    if not isinstance(row, dict):
        return row
    hints = typing.get_type_hints(cls, include_extras=True)
    return {**{f.name: None for f in dataclasses.fields(cls) if f.name not in row and hints[f.name] == Num}, **row}


class Row(JsonRecord):
    """A table row: ``to_json`` / ``from_json`` through :mod:`qed_ray.records.codec` (:func:`dataclasses.asdict` is its CSV
    row); a numeric column a row written before it existed lacks reads as NaN (:func:`missing_numbers`)."""

    @classmethod
    def from_json(cls, data: Any):
        """Inverse of :meth:`to_json`; raises :class:`~qed_ray.records.codec.RecordError` naming the field."""
        return parse(cls, missing_numbers(cls, data), cls.__name__)


class GroupKey(NamedTuple):
    """One cross-seed group: the seeds of a (task, agent, variant)."""

    task: str
    agent: str
    variant: str

    @property
    def name(self) -> str:
        """``task/agent/variant`` (a trial name without its seed)."""
        return "/".join(self)


@dataclass(frozen=True)
class TrialRecord:
    """What the gather step needs of one finished trial: paths and a small history, never weights."""

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
        """The group this trial is a seed of."""
        return GroupKey(self.task, self.agent, self.variant)


@dataclass(frozen=True)
class GroupResult(JsonRecord):
    """Every evaluated number of one (task, agent, variant); self-contained, so a group is cached alone.

    Shapes (P seeds, ascending; E final-eval episodes): ``returns`` [P][E], ``scores`` [P] (normalised mean
    return), ``D`` [P][P] pairwise symmetric KL, ``action_distance_pairs`` [P][P] pairwise cumulative action
    distance, ``v_curve`` [[env_steps, V]] at the snapshots every seed kept, ``learning_curves``
    {seed: [[env_steps, eval return]]} (training-time evaluations, always tanh(mu)). V, action distance, Q1
    dispersion and the early |Q1 - Q2| are NaN where undefined (one seed, or no critic history). ``policy`` is the
    evaluation policy behind returns, V and the action distance (``mean`` or ``sample``);
    ``other_policies`` holds the same group under each further policy of ``final_eval.policies``.

    Where QED sat (NaN where not logged: other temperature rules, or no ``history.json``): ``alpha_frac_floor`` /
    ``alpha_frac_cap`` are the shares of actor-update states at alpha_TE and at alpha_max over training (mean over
    evaluation intervals, then over seeds), ``*_late`` the same over the intervals ending in the last quarter of the
    budget; ``alpha_frac_hot_late`` the share of late states where alpha was at least
    :data:`~qed_ray.rl.temperature.HOT_RATIO` times alpha_TE, ``alpha_ratio_late`` the late mean of alpha / alpha_TE
    (interval means of both); ``log_std_at_min`` is the share of the final policies' log-std entries within 0.1 of
    ``log_std_min`` on the pooled evaluation states (mean over seeds). ``entropy_late``: the late mean of the
    policy's entropy estimate -log pi(a|s) on actor-update states (every temperature rule).

    ``random_score``: the mean normalised score of a uniform-random policy over the final evaluation's episodes
    from the same eval seeds (:func:`qed_ray.analysis.group_eval.random_score`), the base of the verdict's learning
    floor; every group of a task gets the same value (NaN: gathered before it was measured).

    ``unverified_seeds``: the seeds whose trials never recorded the digest of their files (an MLflow outage at
    their end), so their files were used without a check (:mod:`qed_ray.analysis.group_cache`).
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
    other_policies: dict[str, "GroupResult"] = field(default_factory=dict)
    alpha_frac_floor: Num = math.nan
    alpha_frac_cap: Num = math.nan
    alpha_frac_floor_late: Num = math.nan
    alpha_frac_cap_late: Num = math.nan
    log_std_at_min: Num = math.nan
    unverified_seeds: list[int] = field(default_factory=list)  # used unchecked: no digest recorded (group_cache)
    alpha_frac_hot_late: Num = math.nan
    alpha_ratio_late: Num = math.nan
    entropy_late: Num = math.nan
    random_score: Num = math.nan  # a uniform-random policy's mean normalised score on the task (the learning floor)

    @property
    def key(self) -> GroupKey:
        """(task, agent, variant)."""
        return GroupKey(self.task, self.agent, self.variant)

    @property
    def at_cap(self) -> bool:
        """QED's alpha sat at alpha_max on most actor-update states in the last quarter of training."""
        return self.alpha_frac_cap_late > MOST_STATES

    @property
    def alpha_regime(self) -> str | None:
        """Where QED's alpha sat in the last quarter of training: ``at_cap`` (:attr:`at_cap`: te is compared with
        an almost fixed alpha), ``hot`` (below the cap, but at least HOT_RATIO times alpha_TE on most actor-update
        states: a far hotter policy than te's), else ``ok``; None: no estimate (te and fixed log no QED shares, or
        the trials left no ``history.json``)."""
        if self.at_cap:
            return "at_cap"
        if not math.isfinite(self.alpha_frac_hot_late):
            return None
        return "hot" if self.alpha_frac_hot_late > MOST_STATES else "ok"

    def to_json(self, with_others: bool = True) -> dict:
        """The cache and ``results.json`` entry (strict JSON: NaN as null, seeds of ``learning_curves`` as
        strings); ``with_others`` False leaves ``other_policies`` empty (``results.json`` lists them apart). An
        entry written before ``policy`` existed reads as the ``mean`` policy's, one written before the
        where-QED-sat fields existed reads them as NaN."""
        return super().to_json() if with_others else dataclasses.replace(self, other_policies={}).to_json()


@dataclass(frozen=True)
class GroupStats(Row):
    """Per-group numbers that depend on the bootstrap settings (a row of ``groups.csv`` beyond the evaluation).

    ``n_failed`` counts the group's trials left out (see :class:`FailedTrial`). Intervals are percentile
    intervals of a bootstrap over the group's seeds (:mod:`qed_ray.analysis.bootstrap`); ``score_var`` is the across-seed
    sample variance (ddof 1) of the normalised scores. ``qed_at_cap``: QED's alpha sat at alpha_max on most
    actor-update states in the last quarter of training (``alpha_frac_cap_late`` > 0.5), so the group compares te
    with an almost fixed alpha. ``alpha_regime``: :attr:`GroupResult.alpha_regime`. ``entropy_gap_late``: the
    group's ``entropy_late`` minus its te baseline's on the same task (NaN: te itself, or no baseline).
    """

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
    entropy_gap_late: Num = math.nan



@dataclass(frozen=True)
class Aggregate(Row):
    """One (agent, variant) across tasks: IQM and mean score with their stratified-bootstrap CIs, V, action
    distance, variance.

    The first twelve fields are the original ``aggregates.csv`` columns; the rest were added after them. Ratios
    are ``baseline / this`` over the tasks both have (NaN for the baseline itself or without one), so a ratio of
    100 means 100 times less divergence (or return variance) than the baseline; they are the ratio of task means
    of the variant's :class:`Comparison`, whose interval ``ratio_ci`` names (``paired`` over seeds, ``unpaired``,
    or paired on some tasks). ``alpha_frac_*_late``, ``alpha_ratio_late`` and ``log_std_at_min`` are the groups'
    means over tasks, ``n_tasks_at_cap`` and ``n_tasks_hot`` count the groups whose ``alpha_regime`` is
    ``at_cap`` and ``hot``.
    """

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
    mean_score_ci_lower: Num = math.nan
    mean_score_ci_upper: Num = math.nan
    ratio_ci: str = ""
    alpha_frac_floor_late: Num = math.nan
    alpha_frac_cap_late: Num = math.nan
    log_std_at_min: Num = math.nan
    n_tasks_at_cap: int = 0
    alpha_ratio_late: Num = math.nan
    n_tasks_hot: int = 0

    def headline(self) -> dict[str, float]:
        """The numbers the summary table and the sweep's MLflow parent run show."""
        return {k: getattr(self, k) for k in (
            "iqm", "ci_lower", "ci_upper", "ci_width", "V_mean", "V_median", "action_distance_mean", "n_runs",
            "n_failed", "V_mean_ci_lower", "V_mean_ci_upper", "V_ratio", "score_var_mean", "score_var_ratio",
            "alpha_frac_floor_late", "alpha_frac_cap_late", "log_std_at_min", "n_tasks_at_cap", "alpha_ratio_late",
            "n_tasks_hot")}



@dataclass(frozen=True)
class Comparison(Row):
    """One variant against its target-entropy ``baseline`` over the tasks both have (``comparisons.csv``).

    For V, the action distance and the across-seed return variance: the per-task ratio baseline / variant summarised
    over tasks three ways (``*_median``, ``*_geomean`` of the per-task ratios, ``*_means`` = ratio of the task
    means), each with its percentile interval (``_ci_lower``, ``_ci_upper``); ``iqm_ratio`` is IQM(variant) /
    IQM(baseline) over the same tasks; ``prob_improvement`` the probability that a run of the variant scores above
    one of the baseline on the same task, mean over tasks (:mod:`qed_ray.analysis.profiles`), from the same
    resamples as the IQM ratio. ``pairing``: ``paired`` when on every task both groups have the same seeds
    (resampled jointly, :mod:`qed_ray.analysis.bootstrap`), ``unpaired`` when on none (resampled apart), else ``paired on
    k of K tasks``. ``n_tasks_V``: tasks where both define V (two seeds or more). ``n_seeds`` and ``env_steps``:
    the smallest seed count and final budget among the compared groups.
    """

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
    V_ratio_median: Num
    V_ratio_median_ci_lower: Num
    V_ratio_median_ci_upper: Num
    V_ratio_geomean: Num
    V_ratio_geomean_ci_lower: Num
    V_ratio_geomean_ci_upper: Num
    V_ratio_means: Num
    V_ratio_means_ci_lower: Num
    V_ratio_means_ci_upper: Num
    action_distance_ratio_median: Num
    action_distance_ratio_median_ci_lower: Num
    action_distance_ratio_median_ci_upper: Num
    action_distance_ratio_geomean: Num
    action_distance_ratio_geomean_ci_lower: Num
    action_distance_ratio_geomean_ci_upper: Num
    action_distance_ratio_means: Num
    action_distance_ratio_means_ci_lower: Num
    action_distance_ratio_means_ci_upper: Num
    score_var_ratio_median: Num
    score_var_ratio_median_ci_lower: Num
    score_var_ratio_median_ci_upper: Num
    score_var_ratio_geomean: Num
    score_var_ratio_geomean_ci_lower: Num
    score_var_ratio_geomean_ci_upper: Num
    score_var_ratio_means: Num
    score_var_ratio_means_ci_lower: Num
    score_var_ratio_means_ci_upper: Num
    iqm_ratio: Num
    iqm_ratio_ci_lower: Num
    iqm_ratio_ci_upper: Num
    prob_improvement: Num = math.nan
    prob_improvement_ci_lower: Num = math.nan
    prob_improvement_ci_upper: Num = math.nan

    def csv_row(self) -> dict:
        """The ``comparisons.csv`` row: the fields, ``tasks`` joined by ``;``."""
        return {**asdict(self), "tasks": ";".join(self.tasks)}


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class PerformanceProfile(Row):
    """One (agent, variant)'s performance profile (rliable's score distribution, :mod:`qed_ray.analysis.profiles`):
    at each threshold ``taus[t]`` on the normalised score, the share of its ``n_runs`` runs over ``n_tasks`` tasks
    scoring above it (``fraction``), with the stratified-bootstrap percentile band (``ci_lower``, ``ci_upper``)."""

    agent: str
    variant: str
    n_tasks: int
    n_runs: int
    taus: list[Num]
    fraction: list[Num]
    ci_lower: list[Num]
    ci_upper: list[Num]


@dataclass(frozen=True)
class CriticProxy(Row):
    """App. D for one (agent, variant): early |Q1 - Q2| vs final cross-seed Q1 dispersion per task, and R^2."""

    agent: str
    variant: str
    tasks: list[str]
    early_q_gap: list[Num]
    q1_dispersion: list[Num]
    r_squared: Num  # NaN with fewer than 3 tasks or no spread


@dataclass(frozen=True)
class FailedTrial(JsonRecord):
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
@dataclass(frozen=True)
class EndpointResult(JsonRecord):
    """One endpoint of one variant: its estimate and interval (at the variant's ``level``), rule and outcome."""

    name: str
    outcome: str
    estimate: Num
    lower: Num
    upper: Num
    rule: str


@dataclass(frozen=True)
class TaskGuard(JsonRecord):
    """One task's guard: the learning floor (from a random policy's score), te's and QED's mean scores with the
    ends that decide, QED's mean over te's with its interval, the outcome and why; ``alpha_regime`` is the QED
    group's (None: no estimate)."""

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


@dataclass(frozen=True)
class VariantVerdict(JsonRecord):
    """One QED variant against its te baseline; ``scope`` lists its departures from the registered design (empty:
    judged), ``level`` is the two-sided level of its deciding intervals (NaN: none drawn); ``look``: the registered
    look (1-based) its seeds make it, under an adaptive design (None: a fixed design)."""

    agent: str
    variant: str
    baseline: str
    outcome: str
    pairing: str
    n_tasks: int
    n_tasks_at_cap: int
    scope: list[str]
    endpoints: list[EndpointResult]
    level: Num = math.nan
    guards: list[TaskGuard] = field(default_factory=list)
    look: int | None = None


@dataclass(frozen=True)
class Verdict(JsonRecord):
    """The claim's verdict: per variant and overall (``claim_file`` None: measured against the registered design
    with its thresholds)."""

    claim_file: str | None
    claim_sha256: str | None
    outcome: str
    judged_over: str
    variants: list[VariantVerdict] = field(default_factory=list)  # as JSON: gather/verdict.json
    correction: str = ""


@dataclass(frozen=True)
class SweepResults(JsonRecord):
    """Everything the gather step computes for a sweep (``results.json``), under the evaluation policy ``policy``
    (the first of ``final_eval.policies``); ``other_policies`` holds the same tables under each further one.
    ``comparisons``: each variant against its te baseline; ``verdict``: the claim's endpoints judged on them
    (:mod:`qed_ray.analysis.verdict`; None without a te and a QED variant); ``performance_profiles``: one per
    (agent, variant)."""

    sweep: str
    final_eval: FinalEvalSpec
    aggregates: list[Aggregate]
    groups: list[GroupResult]
    critic_proxy: list[CriticProxy]
    failed_trials: list[FailedTrial]
    n_trials: int
    group_stats: list[GroupStats] = field(default_factory=list)
    iqm_by_budget: list[BudgetIqm] = field(default_factory=list)
    policy: str = "mean"
    other_policies: dict[str, "SweepResults"] = field(default_factory=dict)
    comparisons: list[Comparison] = field(default_factory=list)
    verdict: Verdict | None = None
    performance_profiles: list[PerformanceProfile] = field(default_factory=list)

    def to_json(self) -> dict:
        """``results.json`` (strict JSON); each group once, under the policy whose tables it is in."""
        return super(SweepResults, dataclasses.replace(self, groups=[
            dataclasses.replace(g, other_policies={}) for g in self.groups])).to_json()

    @classmethod
    def from_json(cls, data: Any) -> "SweepResults":
        """Inverse of :meth:`to_json` (the rows' numeric columns added since a file was written read as NaN)."""
        return parse(cls, _older_rows(data), cls.__name__)


_ROWS = {"aggregates": Aggregate, "critic_proxy": CriticProxy, "group_stats": GroupStats, "iqm_by_budget": BudgetIqm,
         "comparisons": Comparison, "performance_profiles": PerformanceProfile}


def _older_rows(data: Any) -> Any:
    """``results.json`` with each row's missing numeric columns as null (:func:`missing_numbers`)."""
    if not isinstance(data, dict):
        return data
    out = {**data, **{k: [missing_numbers(row, r) for r in data[k]] for k, row in _ROWS.items()
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
