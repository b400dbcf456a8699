"""te/QED comparisons (qed_ray/comparisons.py): the paired bootstrap equals a naive paired loop on the same draws,
the three summaries over tasks on hand-made cases, unpaired and partly paired comparisons, the aggregates' ratio."""

import math
import statistics

import numpy as np
import pytest
from folder_helpers import group_result
from scipy.stats import trim_mean

from qed_ray.analysis import bootstrap, metrics
from qed_ray.spec.sweep import FinalEvalSpec
from qed_ray.analysis.tables import aggregate, compare_all

FE = FinalEvalSpec(bootstrap_reps=300, confidence=0.9, seed=3)


def _group(task, variant, seeds, rng, spread):
    """A group whose seeds' policies are points spread by ``spread`` (D: squared distances)."""
    n = len(seeds)
    x = rng.normal(size=(n, 2)) * spread
    d = ((x[:, None] - x[None]) ** 2).sum(-1)
    ad = np.sqrt(d) + 0.1 * (1 - np.eye(n))
    return group_result(task, variant=variant, scores=rng.uniform(0.2, 0.9, n).tolist(),
                        V=metrics.variability_from_matrix(d), D=d.tolist(), action_distance=bootstrap.pair_mean(ad),
                        action_distance_pairs=ad.tolist(), seeds=list(seeds),
                        learning_curves={s: [[2000, 1.0]] for s in seeds})


def _naive_replicate(g, drawn: list[int]) -> dict:
    """A resample's statistics by explicit loops over the drawn positions (pairs of distinct seeds only)."""
    pos = [(a, b) for a in range(len(drawn)) for b in range(len(drawn)) if drawn[a] != drawn[b]]
    out = {name: sum(np.asarray(m)[drawn[a], drawn[b]] for a, b in pos) / len(pos)
           for name, m in (("V", g.D), ("action_distance", g.action_distance_pairs))}
    out["score_var"] = statistics.variance([g.scores[i] for i in drawn])
    out["scores"] = [g.scores[i] for i in drawn]
    return out


def test_paired_bootstrap_equals_a_naive_paired_loop_on_the_same_draws():
    rng = np.random.default_rng(0)
    seeds = {"a": [0, 1, 2, 3], "b": [0, 1, 2], "c": [0, 1, 2, 3, 4]}
    te = [_group(t, "te", s, rng, 3.0) for t, s in seeds.items()]
    qed = [_group(t, "qed0.2", s, rng, 1.0) for t, s in seeds.items()]
    (c,) = [c for c in compare_all(te + qed, FE)]
    assert (c.pairing, c.n_tasks, c.n_paired_tasks, c.n_seeds) == ("paired", 3, 3, 3)

    reps = {stat: ([], []) for stat in ("V", "action_distance", "score_var")}
    iqm = []
    for g_te, g_qed in zip(te, qed):  # the same draws: one stream per (task, agent, seeds)
        counts = bootstrap.joint_counts(len(g_te.seeds), FE.bootstrap_reps, bootstrap.rng_for(
            FE.seed, "paired", g_te.task, "sac_ln", *map(str, g_te.seeds)))
        draws = [[i for i in range(len(row)) for _ in range(row[i])] for row in counts]
        per = [(_naive_replicate(g_te, d), _naive_replicate(g_qed, d)) for d in draws]
        for stat, (b, t) in reps.items():
            b.append([p[0][stat] for p in per])
            t.append([p[1][stat] for p in per])
        iqm.append(per)
    for stat, (b, t) in reps.items():
        b, t = np.array(b).T, np.array(t).T  # (R, K)
        ratios = b / t
        naive = {"median": [statistics.median(r) for r in ratios],
                 "geomean": [math.exp(statistics.fmean(math.log(x) for x in r)) for r in ratios],
                 "means": [statistics.fmean(rb) / statistics.fmean(rt) for rb, rt in zip(b, t)]}
        for name, values in naive.items():
            lo, hi = np.percentile(values, [5, 95])
            assert getattr(c, f"{stat}_ratio_{name}").lower == pytest.approx(lo, rel=1e-12)
            assert getattr(c, f"{stat}_ratio_{name}").upper == pytest.approx(hi, rel=1e-12)
    pooled = [[sum((per[r][side]["scores"] for per in iqm), []) for r in range(FE.bootstrap_reps)] for side in (0, 1)]
    ratio = [trim_mean(q, 0.25) / trim_mean(b, 0.25) for b, q in zip(*pooled)]
    want = tuple(np.percentile(ratio, [5, 95]))
    assert (c.iqm_ratio.lower, c.iqm_ratio.upper) == pytest.approx(want, rel=1e-12)
    pooled_te, pooled_qed = (np.concatenate([g.scores for g in gs])[None] for gs in (te, qed))
    assert c.iqm_ratio.value == pytest.approx(metrics.iqm(pooled_qed) / metrics.iqm(pooled_te))


def test_the_three_summaries_on_hand_made_cases():
    got = metrics.ratio_summaries([100.0, 10.0, 1.0], [1.0, 1.0, 1.0])
    assert got["median"] == 10.0 and got["geomean"] == pytest.approx(10.0) and got["means"] == pytest.approx(37.0)
    got = metrics.ratio_summaries([4.0, 1.0], [1.0, 4.0])  # per-task ratios 4 and 1/4
    assert got["median"] == pytest.approx(2.125) and got["geomean"] == pytest.approx(1.0) and got["means"] == 1.0
    rows = metrics.ratio_summaries([[2.0, 8.0], [3.0, 0.0]], [[1.0, 2.0], [1.0, 1.0]])  # replicates on a lead axis
    assert rows["median"][0] == 3.0 and rows["geomean"][0] == pytest.approx(math.sqrt(8))
    assert all(math.isnan(rows[k][1]) for k in rows), "a statistic of 0 leaves the ratio undefined"


def test_one_dominant_task_swings_the_ratio_of_means_not_the_median():
    rng = np.random.default_rng(1)
    te = [_group(t, "te", range(4), rng, s) for t, s in (("a", 1.0), ("b", 1.0), ("c", 100.0))]
    qed = [_group(t, "qed0.2", range(4), rng, 1.0) for t in ("a", "b", "c")]
    (c,) = compare_all(te + qed, FE)
    per_task = sorted(g.V / q.V for g, q in zip(te, qed))
    assert c.V_ratio_median.value == pytest.approx(per_task[1])
    assert c.V_ratio_means.value > 100 * c.V_ratio_median.value / 10
    assert c.V_ratio_geomean.value == pytest.approx(math.prod(per_task) ** (1 / 3))


def test_variants_that_do_not_share_seeds_keep_the_unpaired_interval():
    rng = np.random.default_rng(2)
    te = [_group(t, "te", [0, 1, 2, 3], rng, 3.0) for t in ("a", "b")]
    partly = [_group("a", "qed0.2", [0, 1, 2], rng, 1.0), _group("b", "qed0.2", [0, 1, 2, 3], rng, 1.0)]
    (c,) = compare_all(te + partly, FE)
    assert (c.pairing, c.n_paired_tasks, c.n_seeds) == ("paired on 1 of 2 tasks", 1, 3)
    apart = [_group(t, "qed0.4", [5, 6, 7], rng, 1.0) for t in ("a", "b")]
    (row,) = [a for a in aggregate(te + apart, FE) if a.variant == "qed0.4"]
    assert row.ratio_ci == "unpaired"
    # unpaired: the ratio of task means divides the replicates behind each variant's own V interval (as before)
    own = [[bootstrap.pair_mean_replicates(g.D, 300, bootstrap.rng_for(3, "V", *g.key)) for g in gs]
           for gs in (te, apart)]
    want = bootstrap.percentile_interval(np.mean(own[0], axis=0) / np.mean(own[1], axis=0), 0.9)
    assert (row.V_ratio_ci_lower, row.V_ratio_ci_upper) == pytest.approx(want, rel=1e-12)
    assert row.V_ratio == pytest.approx(np.mean([g.V for g in te]) / np.mean([g.V for g in apart]))
