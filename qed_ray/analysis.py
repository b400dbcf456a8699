"""Cross-seed evaluation of finished trials and the sweep's tables (Ray-free; the gather actor runs these).

Per (task, agent, variant) group (:class:`GroupResult`): final scores, inter-run variability V on the states
pooled from every seed's own evaluation rollouts (paper App. E), cumulative pairwise action distance over 100-step
rollouts from shared seeds (Sec. 6.2), V at intermediate policy snapshots (App. E, curves as in App. F), and the
critic-proxy quantities (App. D). Per (agent, variant) across tasks (:class:`Aggregate`): IQM with a stratified
bootstrap CI, CI width, mean/median V. Results are typed and round-trip through strict JSON (``results.json``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field, fields
from typing import NamedTuple, Sequence

import numpy as np

from qed_ray import metrics
from qed_ray.agents import load_policy
from qed_ray.evaluate import eval_seeds, rollout_many
from qed_ray.spec import FinalEvalSpec

EARLY_INTERVALS = 15  # App. D: "the early-training interval (first 15 rollouts)"


def strict_json(x):
    """NaN/inf -> None, dict keys -> str, tuples -> lists, recursively (``json.dumps`` then writes strict JSON)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): strict_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict_json(v) for v in x]
    return x


def _from_strict(x):
    """Inverse of :func:`strict_json` for numbers: None -> NaN, recursively (every result value is numeric)."""
    if x is None:
        return math.nan
    if isinstance(x, list):
        return [_from_strict(v) for v in x]
    return x


class GroupKey(NamedTuple):
    """One cross-seed group: the seeds of a (task, agent, variant)."""

    task: str
    agent: str
    variant: str


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
    """Every per-group number of one (task, agent, variant); self-contained, so a group can be cached alone.

    Shapes (P seeds, ascending; E final-eval episodes): ``returns`` [P][E], ``scores`` [P] (normalised mean
    return), ``D`` [P][P] pairwise symmetric KL, ``v_curve`` [[env_steps, V]] at the snapshots every seed kept,
    ``learning_curves`` {seed: [[env_steps, eval return]]}. V, action distance, Q1 dispersion and the early
    |Q1 - Q2| are NaN where undefined (one seed, or no critic history).
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

    @property
    def key(self) -> GroupKey:
        """(task, agent, variant)."""
        return GroupKey(self.task, self.agent, self.variant)

    def to_json(self) -> dict:
        """The ``results.json`` entry (strict JSON: NaN as null, seeds of ``learning_curves`` as strings)."""
        return strict_json(asdict(self))

    @classmethod
    def from_json(cls, d: dict) -> "GroupResult":
        """Inverse of :meth:`to_json`."""
        raw = {f.name: _from_strict(d[f.name]) for f in fields(cls) if f.name != "learning_curves"}
        curves = {int(seed): _from_strict(c) for seed, c in d["learning_curves"].items()}
        return cls(**raw, learning_curves=curves)


@dataclass(frozen=True)
class Aggregate:
    """One (agent, variant) across tasks: IQM of scores with its stratified-bootstrap CI, V and action distance."""

    agent: str
    variant: str
    n_tasks: int
    n_seeds: int
    iqm: float
    ci_lower: float
    ci_upper: float
    ci_width: float
    mean_score: float
    V_mean: float
    V_median: float
    action_distance_mean: float

    def headline(self) -> dict[str, float]:
        """The numbers the summary table and the sweep's MLflow parent run show."""
        return {"iqm": self.iqm, "ci_lower": self.ci_lower, "ci_upper": self.ci_upper, "ci_width": self.ci_width,
                "V_mean": self.V_mean, "V_median": self.V_median, "action_distance_mean": self.action_distance_mean}

    def to_json(self) -> dict:
        """The ``results.json`` entry (strict JSON); :func:`dataclasses.asdict` is the CSV row."""
        return strict_json(asdict(self))

    @classmethod
    def from_json(cls, d: dict) -> "Aggregate":
        """Inverse of :meth:`to_json`."""
        return cls(**{f.name: _from_strict(d[f.name]) for f in fields(cls)})


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
        return cls(**{f.name: _from_strict(d[f.name]) if f.name != "tasks" else d["tasks"] for f in fields(cls)})


@dataclass(frozen=True)
class FailedTrial:
    """A trial (or the gather step) that did not finish, with the last line of its error."""

    name: str
    error: str


@dataclass(frozen=True)
class SweepResults:
    """Everything the gather step computes for a sweep (``results.json``)."""

    sweep: str
    final_eval: FinalEvalSpec
    aggregates: list[Aggregate]
    groups: list[GroupResult]
    critic_proxy: list[CriticProxy]
    failed_trials: list[FailedTrial]
    n_trials: int

    def to_json(self) -> dict:
        """``results.json`` (strict JSON)."""
        return {"sweep": self.sweep, "final_eval": self.final_eval.model_dump(),
                "aggregates": [a.to_json() for a in self.aggregates], "groups": [g.to_json() for g in self.groups],
                "critic_proxy": [c.to_json() for c in self.critic_proxy],
                "failed_trials": [asdict(f) for f in self.failed_trials], "n_trials": self.n_trials}

    @classmethod
    def from_json(cls, d: dict) -> "SweepResults":
        """Inverse of :meth:`to_json`."""
        return cls(d["sweep"], FinalEvalSpec.model_validate(d["final_eval"]),
                   [Aggregate.from_json(a) for a in d["aggregates"]], [GroupResult.from_json(g) for g in d["groups"]],
                   [CriticProxy.from_json(c) for c in d["critic_proxy"]],
                   [FailedTrial(**f) for f in d["failed_trials"]], d["n_trials"])


def _policies(records: list[TrialRecord], step: int, device: str):
    return [load_policy(r.policies[step], device)[0] for r in records]


def variability(agents, task: str, episodes: int, frame_skip: int) -> tuple[float, np.ndarray, list]:
    """V and the pairwise matrix D on the states of every agent's own eval rollouts (pooled), and the rollouts."""
    rolls = rollout_many([a.act_batch for a in agents], task, eval_seeds(episodes), frame_skip=frame_skip)
    pooled = metrics.pool_states([r.pooled_obs() for r in rolls])
    dists = [a.policy_distribution(pooled) for a in agents]
    mus, sigmas = np.stack([d[0] for d in dists]), np.stack([d[1] for d in dists])
    if len(agents) < 2:
        return math.nan, np.zeros((1, 1)), rolls
    d = metrics.pairwise_policy_divergence(mus, sigmas)
    return metrics.variability_from_matrix(d), d, rolls


def action_rollouts(agents, rolls: list, task: str, n: int, steps: int, frame_skip: int) -> np.ndarray:
    """Actions [P, T, L, A] of every agent from the same ``n`` initial states for ``steps`` decisions (Sec. 6.2).

    Deterministic policies from the shared eval seeds repeat the eval episodes exactly, so when the eval
    rollouts cover them their first ``steps`` actions are reused instead of rolling out again.
    """
    if n <= rolls[0].actions.shape[0] and steps <= rolls[0].actions.shape[1]:
        return np.stack([r.actions[:n, :steps] for r in rolls])
    act = rollout_many([a.act_batch for a in agents], task, eval_seeds(n), max_decisions=steps,
                       frame_skip=frame_skip)
    return np.stack([r.actions for r in act])


def q1_dispersion(agents, pooled: np.ndarray) -> float:
    """Mean over seed pairs of |mean_s Q1_i(s, pi_i(s)) - mean_s Q1_j(s, pi_j(s))| (App. D, cross-seed Q1)."""
    means = [float(a.q_values(pooled, a.act_batch(pooled))[0].mean()) for a in agents]
    pairs = list(itertools.combinations(means, 2))
    return float(np.mean([abs(x - y) for x, y in pairs])) if pairs else math.nan


def _early_q_gap(records: Sequence[TrialRecord]) -> float:
    """Mean within-run |Q1 - Q2| over each seed's first :data:`EARLY_INTERVALS` evaluations, then over seeds."""
    early = [np.mean([h["q/abs_diff_mean"] for h in r.history[:EARLY_INTERVALS] if "q/abs_diff_mean" in h])
             for r in records if any("q/abs_diff_mean" in h for h in r.history)]
    return float(np.mean(early)) if early else math.nan


def evaluate_group(records: Sequence[TrialRecord], final_eval: FinalEvalSpec, device: str = "cpu") -> GroupResult:
    """All per-group numbers of one (task, agent, variant) from its seeds' records (any order)."""
    records = sorted(records, key=lambda r: r.seed)
    task, fs = records[0].task, records[0].frame_skip
    final_step = max(records[0].policies)
    agents = _policies(records, final_step, device)
    v, d, rolls = variability(agents, task, final_eval.episodes, fs)
    actions = action_rollouts(agents, rolls, task, final_eval.action_rollouts, final_eval.action_steps, fs)
    pooled = metrics.pool_states([r.pooled_obs() for r in rolls])
    common = sorted(set.intersection(*(set(r.policies) for r in records)))
    curve = []
    for step in common:
        if step == final_step:
            curve.append([step, v])
        elif len(records) > 1:
            curve.append([step, variability(_policies(records, step, device), task, final_eval.curve_episodes,
                                            fs)[0]])
    returns = [r.returns.tolist() for r in rolls]
    return GroupResult(
        task=task, agent=records[0].agent, variant=records[0].variant, seeds=[r.seed for r in records],
        final_env_steps=final_step, returns=returns,
        scores=metrics.normalized_score([np.mean(x) for x in returns]).tolist(), V=v, D=d.tolist(),
        action_distance=metrics.cumulative_action_distance(actions) if len(agents) > 1 else math.nan,
        v_curve=curve, q1_dispersion=q1_dispersion(agents, pooled), early_q_gap=_early_q_gap(records),
        learning_curves={r.seed: [[h["env_steps"], h["eval/return_mean"]] for h in r.history
                                  if "eval/return_mean" in h] for r in records})


def _by_agent_variant(groups: Sequence[GroupResult]) -> dict[tuple[str, str], list[GroupResult]]:
    """Groups per (agent, variant), keys sorted, groups sorted by task."""
    out: dict[tuple[str, str], list[GroupResult]] = {}
    for g in sorted(groups, key=lambda g: (g.agent, g.variant, g.task)):
        out.setdefault((g.agent, g.variant), []).append(g)
    return out


def aggregate(groups: Sequence[GroupResult], final_eval: FinalEvalSpec) -> list[Aggregate]:
    """Per (agent, variant) across tasks: IQM + stratified bootstrap CI of scores, CI width, V mean/median."""
    out = []
    for (agent, variant), gs in _by_agent_variant(groups).items():
        n = min(len(g.scores) for g in gs)  # a rectangular (seeds x tasks) matrix: drop extra seeds
        scores = np.array([g.scores[:n] for g in gs]).T
        est = metrics.interval_estimate(scores, metrics.iqm, reps=final_eval.bootstrap_reps,
                                        confidence=final_eval.confidence, seed=final_eval.seed)
        vs = np.array([g.V for g in gs], dtype=float)
        dist = np.array([g.action_distance for g in gs], dtype=float)
        finite_v = vs[np.isfinite(vs)]
        out.append(Aggregate(
            agent=agent, variant=variant, n_tasks=len(gs), n_seeds=n,
            iqm=est["point"], ci_lower=est["lower"], ci_upper=est["upper"], ci_width=est["width"],
            mean_score=float(scores.mean()),
            V_mean=float(finite_v.mean()) if finite_v.size else math.nan,
            V_median=float(np.median(finite_v)) if finite_v.size else math.nan,
            action_distance_mean=float(np.nanmean(dist)) if np.isfinite(dist).any() else math.nan))
    return out


def critic_proxy(groups: Sequence[GroupResult]) -> list[CriticProxy]:
    """App. D per (agent, variant): early |Q1 - Q2| vs final cross-seed Q1 dispersion across tasks, with R^2."""
    out = []
    for (agent, variant), gs in _by_agent_variant(groups).items():
        pts = [g for g in gs if math.isfinite(g.early_q_gap) and math.isfinite(g.q1_dispersion)]
        x = np.array([g.early_q_gap for g in pts])
        y = np.array([g.q1_dispersion for g in pts])
        r2 = math.nan
        if len(pts) >= 3 and np.ptp(x) > 0 and np.ptp(y) > 0:
            r2 = metrics.r_squared(x, y)
        out.append(CriticProxy(agent, variant, [g.task for g in pts], x.tolist(), y.tolist(), r2))
    return out


def group_rows(groups: Sequence[GroupResult]) -> list[dict]:
    """Flat per-group table rows (``groups.csv``)."""
    return [{"task": g.task, "agent": g.agent, "variant": g.variant, "n_seeds": len(g.seeds),
             "mean_return": float(np.mean([np.mean(r) for r in g.returns])),
             "std_return_across_seeds": float(np.std([np.mean(r) for r in g.returns])),
             "V": g.V, "action_distance": g.action_distance, "q1_dispersion": g.q1_dispersion,
             "early_q_gap": g.early_q_gap} for g in groups]


def main(argv: list[str] | None = None) -> int:
    """``python -m qed_ray.analysis SWEEP_DIR``: the critic-proxy table (App. D) of a gathered sweep.

    Reads ``SWEEP_DIR/gather/results.json``, prints per agent-variant the early within-run |Q1 - Q2| and the final
    cross-seed Q1 dispersion per task with the R^2 of the line through them, and redraws the scatter plot.
    """
    import argparse
    import json
    import sys
    from pathlib import Path

    from qed_ray import plots
    from qed_ray.layout import SweepDir

    p = argparse.ArgumentParser(prog="python -m qed_ray.analysis", description=main.__doc__.splitlines()[0])
    p.add_argument("sweep_dir", type=Path, help="a finished sweep folder (with gather/results.json)")
    args = p.parse_args(argv)
    layout = SweepDir(args.sweep_dir)
    if not layout.results_json.exists():
        print(f"error: sweep_dir: {layout.results_json} not found (run the sweep to its gather step first)",
              file=sys.stderr)
        return 2
    groups = [GroupResult.from_json(g) for g in json.loads(layout.results_json.read_text())["groups"]]
    proxy = critic_proxy(groups)
    for row in proxy:
        print(f"{row.agent} {row.variant}: R^2 = {row.r_squared:.3f} over {len(row.tasks)} tasks")
        for task, x, y in zip(row.tasks, row.early_q_gap, row.q1_dispersion):
            print(f"  {task:18s} early |Q1-Q2| {x:9.4f}   final cross-seed Q1 dispersion {y:9.4f}")
    layout.figures.mkdir(parents=True, exist_ok=True)
    print(f"figure: {plots.critic_proxy(proxy, layout.figures / 'critic_proxy.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
