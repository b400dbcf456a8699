"""The sweep's tables from evaluated groups (pure numpy; cheap, so they are recomputed whenever a group lands)."""

from __future__ import annotations

import math
from collections import Counter
from typing import Sequence

import numpy as np

from qed_ray.analysis import bootstrap, comparisons, evidence, metrics, profiles
from qed_ray.analysis.comparisons import group_value as _value
from qed_ray.analysis.results import (Aggregate, BudgetIqm, Comparison, CriticProxy, FailedTrial, GroupKey, GroupResult,
                             GroupStats, Interval, SweepResults)
from qed_ray.spec.sweep import FinalEvalSpec

NAN = math.nan
MAX_BUDGETS = 20  # budgets per variant in iqm_by_budget (a 2M-step run evaluates 100 times)
WHERE_QED_SAT = ("alpha_frac_floor", "alpha_frac_cap", "alpha_frac_floor_late", "alpha_frac_cap_late",
                 "log_std_at_min")
HOW_HOT = ("alpha_frac_hot_late", "alpha_ratio_late", "entropy_late")  # groups.csv's columns after n_unverified


def _by_agent_variant(groups: Sequence[GroupResult]) -> dict[tuple[str, str], list[GroupResult]]:
    """Groups per (agent, variant), keys sorted, groups sorted by task."""
    out: dict[tuple[str, str], list[GroupResult]] = {}
    for g in sorted(groups, key=lambda g: (g.agent, g.variant, g.task)):
        out.setdefault((g.agent, g.variant), []).append(g)
    return out


def failed_counts(failed: Sequence[FailedTrial]) -> Counter:
    """How many trials of each group were left out."""
    return Counter(f.group for f in failed if f.group is not None)


def _mean_with_ci(stat: str, gs: Sequence[GroupResult], reps: comparisons.Replicates
                  ) -> tuple[float, float, float]:
    """Mean over the tasks where ``stat`` is defined, with its stratified interval."""
    use = [g for g in gs if math.isfinite(_value(stat, g)) and reps.get(stat, g) is not None]
    if not use:
        return NAN, NAN, NAN
    point = float(np.mean([_value(stat, g) for g in use]))
    rep = bootstrap.stratified_mean_replicates([reps.get(stat, g) for g in use])
    return (point, *bootstrap.percentile_interval(rep, reps.fe.confidence))


def baseline_of(g: GroupResult, variants: Sequence[str]) -> str:
    """``g``'s te baseline (:attr:`GroupResult.baseline`) if it is among ``variants`` ("" if not, and for a
    baseline itself)."""
    return g.baseline if not g.is_baseline and g.baseline in variants else ""


def compare_all(groups: Sequence[GroupResult], final_eval: FinalEvalSpec,
                reps: comparisons.Replicates | None = None) -> list[Comparison]:
    """Every (agent, variant) with a target-entropy baseline against it (:func:`qed_ray.analysis.comparisons.compare`)."""
    reps, by_av, out = reps or comparisons.Replicates(final_eval), _by_agent_variant(groups), []
    for (agent, variant), gs in by_av.items():
        base = baseline_of(gs[0], [v for a, v in by_av if a == agent])
        c = comparisons.compare(by_av[(agent, base)], gs, final_eval, reps.get) if base else None
        out += [c] if c is not None else []
    return out


def _where_qed_sat(gs: Sequence[GroupResult]) -> dict:
    """The groups' late alpha fractions and log-std share, each a mean over the tasks that logged it."""
    def mean(name):
        v = np.array([getattr(g, name) for g in gs], dtype=float)
        return float(v[np.isfinite(v)].mean()) if np.isfinite(v).any() else NAN
    return {**{n: mean(n) for n in ("alpha_frac_floor_late", "alpha_frac_cap_late", "log_std_at_min",
                                    "alpha_ratio_late")},
            "n_tasks_at_cap": sum(g.alpha_regime == "at_cap" for g in gs),
            "n_tasks_hot": sum(g.alpha_regime == "hot" for g in gs)}


def aggregate(groups: Sequence[GroupResult], final_eval: FinalEvalSpec, failed: Sequence[FailedTrial] = (),
              comps: Sequence[Comparison] | None = None) -> list[Aggregate]:
    """Per (agent, variant) across tasks: IQM and mean score + CI over every seed, V / action distance / return
    variance with intervals, ratios to the target-entropy baseline (the ratio of task means of the variant's
    comparison: ``comps``, computed here when None), where QED sat, seed and failure counts."""
    fe, reps, n_failed = final_eval, comparisons.Replicates(final_eval), failed_counts(failed)
    by_av = _by_agent_variant(groups)
    by_variant = {(c.agent, c.variant): c for c in (compare_all(groups, fe, reps) if comps is None else comps)}
    out = []
    for (agent, variant), gs in by_av.items():
        est = bootstrap.iqm_interval([g.scores for g in gs], fe.bootstrap_reps, fe.confidence, fe.seed)
        mean = bootstrap.mean_interval([g.scores for g in gs], fe.bootstrap_reps, fe.confidence, fe.seed)
        vs = np.array([g.V for g in gs], dtype=float)
        finite_v = vs[np.isfinite(vs)]
        dist = np.array([g.action_distance for g in gs], dtype=float)
        _, v_lo, v_hi = _mean_with_ci("V", gs, reps)
        _, ad_lo, ad_hi = _mean_with_ci("action_distance", gs, reps)
        var, var_lo, var_hi = _mean_with_ci("score_var", gs, reps)
        c = by_variant.get((agent, variant))
        v_ratio, var_ratio = (c.V_ratio_means, c.score_var_ratio_means) if c else (Interval(), Interval())
        failed_here = sum(n for k, n in n_failed.items() if (k.agent, k.variant) == (agent, variant))
        out.append(Aggregate(
            agent=agent, variant=variant, n_tasks=len(gs), n_seeds=min(len(g.scores) for g in gs),
            iqm=est["point"], ci_lower=est["lower"], ci_upper=est["upper"], ci_width=est["width"],
            mean_score=float(np.mean(np.concatenate([g.scores for g in gs]))),
            V_mean=float(finite_v.mean()) if finite_v.size else NAN,
            V_median=float(np.median(finite_v)) if finite_v.size else NAN,
            action_distance_mean=float(np.nanmean(dist)) if np.isfinite(dist).any() else NAN,
            n_runs=sum(len(g.scores) for g in gs), n_failed=failed_here,
            V_mean_ci_lower=v_lo, V_mean_ci_upper=v_hi,
            action_distance_ci_lower=ad_lo, action_distance_ci_upper=ad_hi,
            score_var_mean=var, score_var_ci_lower=var_lo, score_var_ci_upper=var_hi,
            baseline=c.baseline if c else "",
            V_ratio=v_ratio.value, V_ratio_ci_lower=v_ratio.lower, V_ratio_ci_upper=v_ratio.upper,
            score_var_ratio=var_ratio.value, score_var_ratio_ci_lower=var_ratio.lower,
            score_var_ratio_ci_upper=var_ratio.upper, mean_score_ci_lower=mean["lower"],
            mean_score_ci_upper=mean["upper"], ratio_ci=c.pairing if c else "", **_where_qed_sat(gs)))
    return out


def _entropy_gaps(groups: Sequence[GroupResult]) -> dict[GroupKey, float]:
    """Per group, its late policy entropy minus its te baseline's on the same task (:func:`baseline_of`; NaN
    without one)."""
    by_key = {g.key: g for g in groups}
    variants: dict[str, list[str]] = {}
    for g in groups:
        variants.setdefault(g.agent, []).append(g.variant)
    out = {}
    for g in groups:
        base = by_key.get(GroupKey(g.task, g.agent, baseline_of(g, variants[g.agent])))
        out[g.key] = g.entropy_late - base.entropy_late if base is not None and base is not g else NAN
    return out


def group_stats(groups: Sequence[GroupResult], final_eval: FinalEvalSpec,
                failed: Sequence[FailedTrial] = ()) -> list[GroupStats]:
    """Per group: the seed-bootstrap intervals of V and the action distance, the score variance, the counts,
    where QED's alpha sat and the entropy gap to te."""
    reps, n_failed, gaps = comparisons.Replicates(final_eval), failed_counts(failed), _entropy_gaps(groups)
    out = []
    for g in sorted(groups, key=lambda g: g.key):
        ci = {}
        for stat in ("V", "action_distance"):
            r = reps.get(stat, g)
            ci[stat] = bootstrap.percentile_interval(r, final_eval.confidence) if r is not None else (NAN, NAN)
        out.append(GroupStats(g.task, g.agent, g.variant, len(g.seeds), n_failed.get(g.key, 0), *ci["V"],
                              *ci["action_distance"], _value("score_var", g), g.at_cap, g.alpha_regime,
                              gaps[g.key]))
    return out


def iqm_by_budget(groups: Sequence[GroupResult], final_eval: FinalEvalSpec) -> list[BudgetIqm]:
    """Per (agent, variant): IQM + CI of the training-time eval return / 1000 at the env-step counts every run of
    it evaluated at (App. F's learning curves as one number per budget): at most :data:`MAX_BUDGETS` of them,
    evenly spaced, the last always included (each costs a bootstrap)."""
    fe, out = final_eval, []
    for (agent, variant), gs in _by_agent_variant(groups).items():
        curves = {(g.task, seed): {int(s): r for s, r in g.learning_curves[seed]} for g in gs for seed in g.seeds
                  if seed in g.learning_curves}
        if not curves or len(curves) < sum(len(g.seeds) for g in gs):
            continue  # a run without its history: no budget is shared by every run
        shared = sorted(set.intersection(*(set(c) for c in curves.values())))
        picks = sorted({shared[round(i)] for i in np.linspace(0, len(shared) - 1, min(len(shared), MAX_BUDGETS))})
        for step in picks:
            per_task = [metrics.normalized_score([curves[(g.task, seed)][step] for seed in g.seeds]) for g in gs]
            est = bootstrap.iqm_interval(per_task, fe.bootstrap_reps, fe.confidence, fe.seed)
            out.append(BudgetIqm(agent, variant, step, len(gs), sum(len(t) for t in per_task), est["point"],
                                 est["lower"], est["upper"]))
    return out


def critic_proxy(groups: Sequence[GroupResult]) -> list[CriticProxy]:
    """App. D per (agent, variant): early |Q1 - Q2| vs final cross-seed Q1 dispersion across tasks, with R^2."""
    out = []
    for (agent, variant), gs in _by_agent_variant(groups).items():
        pts = [g for g in gs if math.isfinite(g.early_q_gap) and math.isfinite(g.q1_dispersion)]
        x = np.array([g.early_q_gap for g in pts])
        y = np.array([g.q1_dispersion for g in pts])
        r2 = NAN
        if len(pts) >= 3 and np.ptp(x) > 0 and np.ptp(y) > 0:
            r2 = metrics.r_squared(x, y)
        out.append(CriticProxy(agent, variant, [g.task for g in pts], x.tolist(), y.tolist(), r2))
    return out


def group_rows(groups: Sequence[GroupResult], stats: Sequence[GroupStats]) -> list[dict]:
    """Flat per-group table rows (``groups.csv``): the original ten columns, then the added ones."""
    by_key = {(s.task, s.agent, s.variant): s for s in stats}
    rows = []
    for g in sorted(groups, key=lambda g: g.key):
        s = by_key[g.key]
        rows.append({"task": g.task, "agent": g.agent, "variant": g.variant, "n_seeds": len(g.seeds),
                     "mean_return": float(np.mean([np.mean(r) for r in g.returns])),
                     "std_return_across_seeds": float(np.std([np.mean(r) for r in g.returns])),
                     "V": g.V, "action_distance": g.action_distance, "q1_dispersion": g.q1_dispersion,
                     "early_q_gap": g.early_q_gap, "n_failed": s.n_failed, "V_ci_lower": s.V_ci_lower,
                     "V_ci_upper": s.V_ci_upper, "action_distance_ci_lower": s.action_distance_ci_lower,
                     "action_distance_ci_upper": s.action_distance_ci_upper, "score_var": s.score_var,
                     **{k: getattr(g, k) for k in WHERE_QED_SAT}, "qed_at_cap": s.qed_at_cap,
                     "n_unverified": len(g.unverified_seeds), **{k: getattr(g, k) for k in HOW_HOT},
                     "entropy_gap_late": s.entropy_gap_late, "alpha_regime": s.alpha_regime})
    return rows


def sweep_results(sweep: str, final_eval: FinalEvalSpec, groups: Sequence[GroupResult],
                  failed: Sequence[FailedTrial], n_trials: int, claim: dict | None = None,
                  judge: bool = True) -> SweepResults:
    """Every table of a sweep from its evaluated groups (any subset: partial results while the sweep runs): under
    the first evaluation policy of ``final_eval.policies``, and under each other one in ``other_policies`` (from
    the groups' own ``other_policies``). ``claim``: the sweep's pre-registration record from ``sweep.json`` (None:
    the verdict applies the default thresholds, :mod:`qed_ray.analysis.verdict`). ``judge`` False: no verdict at
    all (a k search is exploratory by construction, :mod:`qed_ray.spec.search`)."""
    first, *others = final_eval.policies
    others = {p: _tables(sweep, final_eval, [g.other_policies[p] for g in groups if p in g.other_policies], failed,
                         n_trials, p, claim, judge) for p in others}
    return _tables(sweep, final_eval, groups, failed, n_trials, first, claim, judge).model_copy(
        update={"other_policies": others})


def _tables(sweep: str, final_eval: FinalEvalSpec, groups: Sequence[GroupResult], failed: Sequence[FailedTrial],
            n_trials: int, policy: str, claim: dict | None, judge: bool = True) -> SweepResults:
    groups = sorted(groups, key=lambda g: g.key)
    failed = list(failed)
    reps = comparisons.Replicates(final_eval)
    comps = compare_all(groups, final_eval, reps)
    return SweepResults(sweep, final_eval, aggregate(groups, final_eval, failed, comps) if groups else [], groups,
                        critic_proxy(groups), failed, n_trials, group_stats(groups, final_eval, failed),
                        iqm_by_budget(groups, final_eval), policy, comparisons=comps,
                        verdict=evidence.judge(comps, groups, final_eval, claim, reps.get) if judge else None,
                        performance_profiles=profiles.performance_profiles(groups, final_eval))
