"""Each variant against its target-entropy baseline (the paper's claim: QED cuts the divergence between seeds by one
to two orders of magnitude at equal returns, Sec. 6.1): the te/variant ratios of V, the action distance and the
across-seed return variance, each summarised over tasks three ways (median and geometric mean of the per-task
ratios, ratio of the task means), and the IQM ratio variant/te, each with a percentile interval over seeds."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from qed_ray.analysis import bootstrap, metrics, profiles
from qed_ray.analysis.results import Comparison, GroupKey, GroupResult, Interval
from qed_ray.spec.sweep import FinalEvalSpec

STATS = ("V", "action_distance", "score_var")
Unpaired = Callable[[str, GroupResult], "np.ndarray | None"]  # (statistic, group) -> (R,) replicates or None


class Replicates:
    """Bootstrap replicates per group and statistic, drawn once from streams keyed by (statistic, group), so a
    group's interval and every ratio that uses it come from the same draws."""

    def __init__(self, final_eval: FinalEvalSpec):
        self.fe = final_eval
        self.cache: dict[tuple[str, GroupKey], np.ndarray | None] = {}

    def get(self, stat: str, g: GroupResult) -> np.ndarray | None:
        """(R,) replicates of ``V``, ``action_distance`` or ``score_var`` for group ``g`` (None: undefined)."""
        key = (stat, g.key)
        if key not in self.cache:
            self.cache[key] = self._draw(stat, g)
        return self.cache[key]

    def _draw(self, stat: str, g: GroupResult) -> np.ndarray | None:
        if len(g.seeds) < 2:
            return None
        rng = bootstrap.rng_for(self.fe.seed, stat, *g.key)
        if stat == "score_var":
            return bootstrap.seed_replicates(g.scores, bootstrap.across_seed_variance, self.fe.bootstrap_reps, rng)
        matrix = g.D if stat == "V" else g.action_distance_pairs
        if not np.all(np.isfinite(matrix)):
            return None
        return bootstrap.pair_mean_replicates(matrix, self.fe.bootstrap_reps, rng)


def group_value(stat: str, g: GroupResult) -> float:
    """A group's ``V``, ``action_distance`` or ``score_var`` (across-seed variance, ddof 1; NaN with one seed)."""
    if stat == "score_var":
        return float(bootstrap.across_seed_variance(np.asarray(g.scores))) if len(g.seeds) > 1 else math.nan
    return float(getattr(g, stat))


def _pair_matrix(stat: str, g: GroupResult) -> np.ndarray | None:
    m = np.asarray(g.D if stat == "V" else g.action_distance_pairs, dtype=np.float64)
    return m if len(g.seeds) > 1 and np.all(np.isfinite(m)) else None


def _paired(g: GroupResult, counts: np.ndarray) -> dict:
    """(R,) replicates of every statistic of ``g`` and its (R, I) resampled scores, from shared draw counts."""
    out = {stat: None if (m := _pair_matrix(stat, g)) is None else bootstrap.pair_mean(m, counts)
           for stat in ("V", "action_distance")}
    out["score_var"] = bootstrap.count_variance(g.scores, counts) if len(g.seeds) > 1 else None
    out["scores"] = bootstrap.resample(g.scores, counts)
    return out


def _apart(g: GroupResult, fe: FinalEvalSpec, unpaired: Unpaired) -> dict:
    """The same from ``g``'s own draws (its group intervals' streams; the scores from a stream of their own)."""
    out = {stat: unpaired(stat, g) for stat in STATS}
    rng = bootstrap.rng_for(fe.seed, "scores", *g.key)
    n = len(g.scores)
    out["scores"] = np.asarray(g.scores, dtype=np.float64)[rng.integers(0, n, size=(fe.bootstrap_reps, n))]
    return out


def task_draws(pairs, fe: FinalEvalSpec, unpaired: Unpaired) -> list[tuple[dict, dict, bool]]:
    """Per task (baseline, variant): both sides' replicates and whether they were paired."""
    out = []
    for b, t in pairs:
        if b.seeds == t.seeds:  # one stream per (task, agent, seeds): every variant of the task draws alike
            rng = bootstrap.rng_for(fe.seed, "paired", b.task, b.agent, *map(str, b.seeds))
            counts = bootstrap.joint_counts(len(b.seeds), fe.bootstrap_reps, rng)
            out.append((_paired(b, counts), _paired(t, counts), True))
        else:
            out.append((_apart(b, fe, unpaired), _apart(t, fe, unpaired), False))
    return out


def _ratio_fields(stat: str, pairs, draws, confidence: float) -> tuple[dict[str, Interval], int]:
    """``{<stat>_ratio_<summary>: Interval}`` over the tasks where both sides define ``stat``, and their count."""
    use = [k for k, ((b, t), (db, dt, _)) in enumerate(zip(pairs, draws))
           if db[stat] is not None and dt[stat] is not None
           and all(math.isfinite(group_value(stat, g)) for g in (b, t))]
    if not use:
        return {f"{stat}_ratio_{name}": Interval() for name in metrics.RATIO_SUMMARIES}, 0
    point = metrics.ratio_summaries([group_value(stat, pairs[k][0]) for k in use],
                                    [group_value(stat, pairs[k][1]) for k in use])
    ci = bootstrap.ratio_intervals(np.stack([draws[k][0][stat] for k in use], axis=1),
                                   np.stack([draws[k][1][stat] for k in use], axis=1), confidence)
    return {f"{stat}_ratio_{name}": Interval(float(point[name]), *ci[name]) for name in metrics.RATIO_SUMMARIES}, \
        len(use)


def compare(base: Sequence[GroupResult], this: Sequence[GroupResult], fe: FinalEvalSpec,
            unpaired: Unpaired) -> Comparison | None:
    """``this`` variant's groups against its baseline's over the tasks both have (None when they share none).

    Args:
        base, this: the two variants' groups (any order), at most one per task each.
        fe: the bootstrap settings (``bootstrap_reps``, ``confidence``, ``seed``).
        unpaired: the (R,) replicates of a statistic from a group's own draws (the streams behind its group
            intervals), used on tasks whose seeds differ between the two; None where undefined.
    """
    by_task = {g.task: g for g in this}
    pairs = [(b, by_task[b.task]) for b in sorted(base, key=lambda g: g.task) if b.task in by_task]
    if not pairs:
        return None
    draws = task_draws(pairs, fe, unpaired)
    fields, n_v = {}, 0
    for stat in STATS:
        got, n = _ratio_fields(stat, pairs, draws, fe.confidence)
        fields.update(got)
        n_v = n if stat == "V" else n_v
    pooled = [np.concatenate([np.asarray(p[side].scores, dtype=np.float64) for p in pairs])[None, :] for side in (0, 1)]
    base_iqm = metrics.iqm(pooled[0])
    iqm_reps = bootstrap.iqm_ratio_replicates([d[0]["scores"] for d in draws], [d[1]["scores"] for d in draws])
    lo, hi = bootstrap.percentile_interval(iqm_reps, fe.confidence)
    # P(variant > te): rliable's definition, its interval from the same (paired where possible) resamples
    poi = profiles.mean_probability_of_improvement([p[1].scores for p in pairs], [p[0].scores for p in pairs])
    poi_reps = profiles.mean_probability_of_improvement([d[1]["scores"] for d in draws],
                                                        [d[0]["scores"] for d in draws])
    poi_lo, poi_hi = bootstrap.percentile_interval(poi_reps, fe.confidence)
    n_paired = sum(d[2] for d in draws)
    pairing = ("paired" if n_paired == len(pairs) else "unpaired" if n_paired == 0
               else f"paired on {n_paired} of {len(pairs)} tasks")
    groups = [g for p in pairs for g in p]
    b0, t0 = pairs[0]
    return Comparison(
        agent=t0.agent, variant=t0.variant, baseline=b0.variant, pairing=pairing, tasks=[b.task for b, _ in pairs],
        n_tasks=len(pairs), n_tasks_V=n_v, n_paired_tasks=n_paired, n_seeds=min(len(g.seeds) for g in groups),
        env_steps=min(g.final_env_steps for g in groups), **fields,
        iqm_ratio=Interval(metrics.iqm(pooled[1]) / base_iqm if base_iqm > 0 else math.nan, lo, hi),
        prob_improvement=Interval(float(poi), poi_lo, poi_hi))
