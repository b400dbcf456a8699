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
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, NamedTuple

from qed_ray.codec import from_strict, strict_json  # noqa: F401 - strict_json: the results' writers use it
from qed_ray.spec import FinalEvalSpec

if TYPE_CHECKING:  # qed_ray.analysis.verdict reads these results; imported at call time below
    from qed_ray.analysis.verdict import Verdict


AT_CAP_SHARE = 0.5  # a group "sat at QED's cap" when its late alpha_frac_cap is above this ("most states")


def _numeric_from_json(cls, d: dict, text: tuple[str, ...] = ()):
    # A numeric column added after a file was written reads as NaN (unknown), a text column as its default, so
    # older results.json files load.
    return cls(**{f.name: d.get(f.name, f.default) if f.name in text else from_strict(d.get(f.name))
                  for f in fields(cls)})


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
    history: list[dict] = field(default_factory=list)  # per eval: env_steps, eval/return_mean, q/abs_diff_mean

    @property
    def group(self) -> GroupKey:
        """The group this trial is a seed of."""
        return GroupKey(self.task, self.agent, self.variant)


@dataclass(frozen=True)
class GroupResult:
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
    budget; ``log_std_at_min`` is the share of the final policies' log-std entries within 0.1 of ``log_std_min``
    on the pooled evaluation states (mean over seeds).

    ``unverified_seeds``: the seeds whose trials never recorded the digest of their files (an MLflow outage at
    their end), so their files were used without a check (:mod:`qed_ray.analysis.group_cache`).
    """

    task: str
    agent: str
    variant: str
    seeds: list[int]
    final_env_steps: int
    returns: list[list[float]]
    scores: list[float]
    V: float
    D: list[list[float]]
    action_distance: float
    v_curve: list[list[float]]
    q1_dispersion: float
    early_q_gap: float
    learning_curves: dict[int, list[list[float]]]
    action_distance_pairs: list[list[float]]
    policy: str = "mean"
    other_policies: dict[str, "GroupResult"] = field(default_factory=dict)
    alpha_frac_floor: float = math.nan
    alpha_frac_cap: float = math.nan
    alpha_frac_floor_late: float = math.nan
    alpha_frac_cap_late: float = math.nan
    log_std_at_min: float = math.nan
    unverified_seeds: list[int] = field(default_factory=list)  # used unchecked: no digest recorded (group_cache)

    @property
    def key(self) -> GroupKey:
        """(task, agent, variant)."""
        return GroupKey(self.task, self.agent, self.variant)

    @property
    def at_cap(self) -> bool:
        """QED's alpha sat at alpha_max on most actor-update states in the last quarter of training."""
        return self.alpha_frac_cap_late > AT_CAP_SHARE

    def to_json(self, with_others: bool = True) -> dict:
        """The cache and ``results.json`` entry (strict JSON: NaN as null, seeds of ``learning_curves`` as
        strings); ``with_others`` False leaves ``other_policies`` empty (``results.json`` lists them apart)."""
        d = asdict(dataclasses.replace(self, other_policies={}) if not with_others else self)
        return strict_json(d)

    @classmethod
    def from_json(cls, d: dict) -> "GroupResult":
        """Inverse of :meth:`to_json` (an entry written before ``policy`` existed is the ``mean`` policy's; one
        written before the where-QED-sat fields existed reads them as NaN)."""
        special = ("learning_curves", "policy", "other_policies", "unverified_seeds")
        raw = {f.name: from_strict(d[f.name] if f.default is dataclasses.MISSING else d.get(f.name))
               for f in fields(cls) if f.name not in special}
        curves = {int(seed): from_strict(c) for seed, c in d["learning_curves"].items()}
        others = {p: cls.from_json(g) for p, g in d.get("other_policies", {}).items()}
        return cls(**raw, learning_curves=curves, policy=d.get("policy", "mean"), other_policies=others,
                   unverified_seeds=[int(s) for s in d.get("unverified_seeds", [])])


@dataclass(frozen=True)
class GroupStats:
    """Per-group numbers that depend on the bootstrap settings (a row of ``groups.csv`` beyond the evaluation).

    ``n_failed`` counts the group's trials left out (see :class:`FailedTrial`). Intervals are percentile
    intervals of a bootstrap over the group's seeds (:mod:`qed_ray.analysis.bootstrap`); ``score_var`` is the across-seed
    sample variance (ddof 1) of the normalised scores. ``qed_at_cap``: QED's alpha sat at alpha_max on most
    actor-update states in the last quarter of training (``alpha_frac_cap_late`` > 0.5), so the group compares te
    with an almost fixed alpha.
    """

    task: str
    agent: str
    variant: str
    n_seeds: int
    n_failed: int
    V_ci_lower: float
    V_ci_upper: float
    action_distance_ci_lower: float
    action_distance_ci_upper: float
    score_var: float
    qed_at_cap: bool = False

    def to_json(self) -> dict:
        """The ``results.json`` entry (strict JSON)."""
        return strict_json(asdict(self))

    @classmethod
    def from_json(cls, d: dict) -> "GroupStats":
        """Inverse of :meth:`to_json`."""
        return _numeric_from_json(cls, d, ("task", "agent", "variant", "qed_at_cap"))


@dataclass(frozen=True)
class Aggregate:
    """One (agent, variant) across tasks: IQM and mean score with their stratified-bootstrap CIs, V, action
    distance, variance.

    The first twelve fields are the original ``aggregates.csv`` columns; the rest were added after them. Ratios
    are ``baseline / this`` over the tasks both have (NaN for the baseline itself or without one), so a ratio of
    100 means 100 times less divergence (or return variance) than the baseline; they are the ratio of task means
    of the variant's :class:`Comparison`, whose interval ``ratio_ci`` names (``paired`` over seeds, ``unpaired``,
    or paired on some tasks). ``alpha_frac_*_late`` and ``log_std_at_min`` are the groups' means over tasks,
    ``n_tasks_at_cap`` counts the groups flagged ``qed_at_cap``.
    """

    agent: str
    variant: str
    n_tasks: int
    n_seeds: int  # the smallest seed count over tasks (every seed is used; see n_runs)
    iqm: float
    ci_lower: float
    ci_upper: float
    ci_width: float
    mean_score: float
    V_mean: float
    V_median: float
    action_distance_mean: float
    n_runs: int
    n_failed: int
    V_mean_ci_lower: float
    V_mean_ci_upper: float
    action_distance_ci_lower: float
    action_distance_ci_upper: float
    score_var_mean: float
    score_var_ci_lower: float
    score_var_ci_upper: float
    baseline: str
    V_ratio: float
    V_ratio_ci_lower: float
    V_ratio_ci_upper: float
    score_var_ratio: float
    score_var_ratio_ci_lower: float
    score_var_ratio_ci_upper: float
    mean_score_ci_lower: float = math.nan
    mean_score_ci_upper: float = math.nan
    ratio_ci: str = ""
    alpha_frac_floor_late: float = math.nan
    alpha_frac_cap_late: float = math.nan
    log_std_at_min: float = math.nan
    n_tasks_at_cap: int = 0

    def headline(self) -> dict[str, float]:
        """The numbers the summary table and the sweep's MLflow parent run show."""
        return {k: getattr(self, k) for k in (
            "iqm", "ci_lower", "ci_upper", "ci_width", "V_mean", "V_median", "action_distance_mean", "n_runs",
            "n_failed", "V_mean_ci_lower", "V_mean_ci_upper", "V_ratio", "score_var_mean", "score_var_ratio",
            "alpha_frac_floor_late", "alpha_frac_cap_late", "log_std_at_min", "n_tasks_at_cap")}

    def to_json(self) -> dict:
        """The ``results.json`` entry (strict JSON); :func:`dataclasses.asdict` is the CSV row."""
        return strict_json(asdict(self))

    @classmethod
    def from_json(cls, d: dict) -> "Aggregate":
        """Inverse of :meth:`to_json`."""
        return _numeric_from_json(cls, d, ("agent", "variant", "baseline", "ratio_ci"))


@dataclass(frozen=True)
class Comparison:
    """One variant against its target-entropy ``baseline`` over the tasks both have (``comparisons.csv``).

    For V, the action distance and the across-seed return variance: the per-task ratio baseline / variant summarised
    over tasks three ways (``*_median``, ``*_geomean`` of the per-task ratios, ``*_means`` = ratio of the task
    means), each with its percentile interval (``_ci_lower``, ``_ci_upper``); ``iqm_ratio`` is IQM(variant) /
    IQM(baseline) over the same tasks. ``pairing``: ``paired`` when on every task both groups have the same seeds
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
    V_ratio_median: float
    V_ratio_median_ci_lower: float
    V_ratio_median_ci_upper: float
    V_ratio_geomean: float
    V_ratio_geomean_ci_lower: float
    V_ratio_geomean_ci_upper: float
    V_ratio_means: float
    V_ratio_means_ci_lower: float
    V_ratio_means_ci_upper: float
    action_distance_ratio_median: float
    action_distance_ratio_median_ci_lower: float
    action_distance_ratio_median_ci_upper: float
    action_distance_ratio_geomean: float
    action_distance_ratio_geomean_ci_lower: float
    action_distance_ratio_geomean_ci_upper: float
    action_distance_ratio_means: float
    action_distance_ratio_means_ci_lower: float
    action_distance_ratio_means_ci_upper: float
    score_var_ratio_median: float
    score_var_ratio_median_ci_lower: float
    score_var_ratio_median_ci_upper: float
    score_var_ratio_geomean: float
    score_var_ratio_geomean_ci_lower: float
    score_var_ratio_geomean_ci_upper: float
    score_var_ratio_means: float
    score_var_ratio_means_ci_lower: float
    score_var_ratio_means_ci_upper: float
    iqm_ratio: float
    iqm_ratio_ci_lower: float
    iqm_ratio_ci_upper: float

    def to_json(self) -> dict:
        """The ``results.json`` entry (strict JSON); :meth:`csv_row` is the CSV row."""
        return strict_json(asdict(self))

    def csv_row(self) -> dict:
        """The ``comparisons.csv`` row: the fields, ``tasks`` joined by ``;``."""
        return {**asdict(self), "tasks": ";".join(self.tasks)}

    @classmethod
    def from_json(cls, d: dict) -> "Comparison":
        """Inverse of :meth:`to_json`."""
        return _numeric_from_json(cls, d, ("agent", "variant", "baseline", "pairing", "tasks"))


@dataclass(frozen=True)
class BudgetIqm:
    """IQM of the training-time evaluation returns / 1000 at one env-step budget (sample efficiency, App. F)."""

    agent: str
    variant: str
    env_steps: int
    n_tasks: int
    n_runs: int
    iqm: float
    ci_lower: float
    ci_upper: float

    def to_json(self) -> dict:
        """The ``results.json`` entry (strict JSON)."""
        return strict_json(asdict(self))

    @classmethod
    def from_json(cls, d: dict) -> "BudgetIqm":
        """Inverse of :meth:`to_json`."""
        return _numeric_from_json(cls, d, ("agent", "variant"))


@dataclass(frozen=True)
class CriticProxy:
    """App. D for one (agent, variant): early |Q1 - Q2| vs final cross-seed Q1 dispersion per task, and R^2."""

    agent: str
    variant: str
    tasks: list[str]
    early_q_gap: list[float]
    q1_dispersion: list[float]
    r_squared: float  # NaN with fewer than 3 tasks or no spread

    def to_json(self) -> dict:
        """The ``results.json`` entry (strict JSON)."""
        return strict_json(asdict(self))

    @classmethod
    def from_json(cls, d: dict) -> "CriticProxy":
        """Inverse of :meth:`to_json`."""
        return _numeric_from_json(cls, d, ("agent", "variant", "tasks"))


@dataclass(frozen=True)
class FailedTrial:
    """A trial left out of the tables (failed for good, diverged, unfinished, or refused by the gather step), or
    ``gather`` itself, with the last line of the error."""

    name: str
    error: str

    @property
    def group(self) -> GroupKey | None:
        """The trial's group (None for an entry that is not a trial name ``task/agent/variant/seed``)."""
        parts = self.name.split("/")
        return GroupKey(*parts[:3]) if len(parts) == 4 else None


@dataclass(frozen=True)
class SweepResults:
    """Everything the gather step computes for a sweep (``results.json``), under the evaluation policy ``policy``
    (the first of ``final_eval.policies``); ``other_policies`` holds the same tables under each further one.
    ``comparisons``: each variant against its te baseline; ``verdict``: the claim's endpoints judged on them
    (:mod:`qed_ray.analysis.verdict`; None without a te and a QED variant)."""

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

    def to_json(self) -> dict:
        """``results.json`` (strict JSON); each group once, under the policy whose tables it is in."""
        return {"sweep": self.sweep, "final_eval": self.final_eval.model_dump(mode="json"),
                "aggregates": [a.to_json() for a in self.aggregates],
                "groups": [g.to_json(with_others=False) for g in self.groups],
                "critic_proxy": [c.to_json() for c in self.critic_proxy],
                "failed_trials": [asdict(f) for f in self.failed_trials], "n_trials": self.n_trials,
                "group_stats": [s.to_json() for s in self.group_stats],
                "iqm_by_budget": [b.to_json() for b in self.iqm_by_budget], "policy": self.policy,
                "other_policies": {p: r.to_json() for p, r in self.other_policies.items()},
                "comparisons": [c.to_json() for c in self.comparisons],
                "verdict": self.verdict.to_json() if self.verdict is not None else None}

    @classmethod
    def from_json(cls, d: dict) -> "SweepResults":
        """Inverse of :meth:`to_json`."""
        from qed_ray.analysis.verdict import Verdict

        return cls(d["sweep"], FinalEvalSpec.model_validate(d["final_eval"]),
                   [Aggregate.from_json(a) for a in d["aggregates"]], [GroupResult.from_json(g) for g in d["groups"]],
                   [CriticProxy.from_json(c) for c in d["critic_proxy"]],
                   [FailedTrial(**f) for f in d["failed_trials"]], d["n_trials"],
                   [GroupStats.from_json(s) for s in d["group_stats"]],
                   [BudgetIqm.from_json(b) for b in d["iqm_by_budget"]], d.get("policy", "mean"),
                   {p: cls.from_json(r) for p, r in d.get("other_policies", {}).items()},
                   [Comparison.from_json(c) for c in d.get("comparisons", [])],
                   Verdict.from_json(d["verdict"]) if d.get("verdict") else None)
