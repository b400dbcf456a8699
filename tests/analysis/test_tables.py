"""The sweep's tables from evaluated groups: every seed used, failed trials counted, ratios to the target-entropy
baseline with intervals, IQM per budget; the typed results' strict-JSON round trip; the files the gather step
writes, with their fixed columns."""

import csv
import json
import math

import numpy as np
import pytest
from folder_helpers import group_result
from kit import GROUP_COLUMNS

from qed_ray.analysis import bootstrap, metrics
from qed_ray.records.layout import SweepDir
from qed_ray.analysis.outputs import write_results
from qed_ray.analysis.results import (Aggregate, Comparison, CriticProxy, FailedTrial, GroupResult, SweepResults,
                                      csv_row)
from qed_ray.spec.sweep import FinalEvalSpec
from qed_ray.analysis.tables import (aggregate, baseline_of, critic_proxy, group_stats, iqm_by_budget,
                                    sweep_results)

FINAL_EVAL = FinalEvalSpec(episodes=2, action_rollouts=2, action_steps=30, curve_episodes=1, bootstrap_reps=200,
                           confidence=0.95, seed=0)


def test_every_seed_is_used_and_failures_are_counted():
    groups = [group_result(t, scores=sc, V=v, action_distance=ad, early_q_gap=e, q1_dispersion=q)
              for t, sc, v, ad, e, q in [("c", [0.9, 0.8], float("nan"), 6.0, 3.0, 6.0),
                                          ("a", [0.1, 0.2, 0.3], 1.0, 5.0, 1.0, 2.0),
                                          ("b", [0.5, 0.6], 3.0, 7.0, 2.0, 4.5)]]
    failed = [FailedTrial("b/sac_ln/te/2", "DivergenceError: non-finite loss/critic"), FailedTrial("gather", "x"),
              FailedTrial("b/sac_ln/qed0.2/0", "did not finish")]
    (row,) = aggregate(groups, FINAL_EVAL, failed)
    assert (row.n_tasks, row.n_seeds, row.n_runs, row.n_failed) == (3, 2, 7, 1)  # qed0.2's failure is not te's
    assert row.iqm == pytest.approx(metrics.iqm(np.array([[0.1, 0.2, 0.3, 0.5, 0.6, 0.9, 0.8]])))  # no cut
    assert row.ci_lower <= row.iqm <= row.ci_upper
    assert row.V_mean == 2.0 and row.V_median == 2.0 and row.action_distance_mean == 6.0
    assert row.V_mean_ci_lower == row.V_mean_ci_upper == 2.0, "D constant off the diagonal: every resample is V"
    assert row.baseline == "" and math.isnan(row.V_ratio)
    # score variance per task (ddof 1), mean over tasks: a 0.01, b 0.005, c 0.005
    assert row.score_var_mean == pytest.approx((0.01 + 0.005 + 0.005) / 3)
    (proxy,) = critic_proxy(groups)
    assert proxy.tasks == ["a", "b", "c"]  # sorted by task whatever the input order
    assert proxy.r_squared == pytest.approx(metrics.r_squared([1.0, 2.0, 3.0], [2.0, 4.5, 6.0]))
    stats = {s.task: s for s in group_stats(groups, FINAL_EVAL, failed)}
    assert stats["b"].n_failed == 1 and stats["a"].n_failed == 0 and stats["a"].n_seeds == 3
    assert (stats["a"].V_ci_lower, stats["a"].V_ci_upper) == (1.0, 1.0)
    assert math.isnan(stats["c"].V_ci_lower) and stats["c"].score_var == pytest.approx(0.005)


def _spread_group(task: str, variant: str, spread: float, n: int, scores) -> GroupResult:
    """A group whose seeds' policies are points spread by ``spread``: D = squared distances (V ~ spread^2)."""
    x = np.random.default_rng(abs(hash((task, n))) % 2**32).normal(size=(n, 3)) * spread
    d = ((x[:, None] - x[None]) ** 2).sum(-1)
    return group_result(task, variant=variant, scores=scores, V=metrics.variability_from_matrix(d), D=d.tolist())


def test_te_over_qed_ratios_with_intervals():
    te = [_spread_group(t, "te", 10.0, 6, [0.2, 0.4, 0.6, 0.3, 0.5, 0.1]) for t in ("a", "b")]
    qed = [_spread_group(t, "qed0.2", 1.0, 6, [0.30, 0.32, 0.34, 0.31, 0.33, 0.35]) for t in ("a", "b")]
    rows = {r.variant: r for r in aggregate(te + qed, FINAL_EVAL)}
    q = rows["qed0.2"]
    assert q.baseline == "te" and rows["te"].baseline == ""
    want = np.mean([g.V for g in te]) / np.mean([g.V for g in qed])
    assert q.V_ratio == pytest.approx(want) and q.V_ratio_ci_lower <= q.V_ratio <= q.V_ratio_ci_upper
    assert q.V_ratio > 20, "10x the spread is ~100x the divergence"
    var_te = np.mean([np.var(g.scores, ddof=1) for g in te])
    var_qed = np.mean([np.var(g.scores, ddof=1) for g in qed])
    assert q.score_var_ratio == pytest.approx(var_te / var_qed) and q.score_var_ratio_ci_lower < q.score_var_ratio
    # the ratio's replicates come from the same draws as each variant's own interval
    reps = [bootstrap.pair_mean_replicates(g.D, 200, bootstrap.rng_for(0, "V", *g.key)) for g in te]
    assert rows["te"].V_mean_ci_upper == pytest.approx(bootstrap.percentile_interval(np.mean(reps, axis=0),
                                                                                     0.95)[1])


@pytest.mark.parametrize("variant, variants, want", [
    ("qed0.2", ["te", "qed0.2"], "te"), ("fixed0.1", ["fixed0.1", "te"], "te"), ("te", ["te", "qed0.2"], ""),
    ("qed0.2+hidden=512", ["te", "te+hidden=512", "qed0.2+hidden=512"], "te+hidden=512"),
    ("qed0.2+hidden=512", ["te", "qed0.2+hidden=512"], ""), ("qed0.2", ["te+init_alpha=1", "qed0.2"], ""),
    ("not a label", ["te"], ""),
])
def test_the_baseline_is_the_te_variant_with_the_same_other_settings(variant, variants, want):
    assert baseline_of(group_result(variant=variant), variants) == want


def test_iqm_at_the_shared_budgets():
    curves = {"a": {0: [[1000, 100.0], [2000, 300.0]], 1: [[1000, 200.0], [2000, 500.0]]},
              "b": {0: [[1000, 0.0], [2000, 900.0]], 1: [[1000, 50.0], [2000, 800.0], [3000, 1.0]]}}
    groups = [group_result(t, learning_curves=c) for t, c in curves.items()]
    rows = iqm_by_budget(groups, FINAL_EVAL)
    assert [(r.env_steps, r.n_tasks, r.n_runs) for r in rows] == [(1000, 2, 4), (2000, 2, 4)]  # 3000: one run only
    assert rows[0].iqm == pytest.approx(metrics.iqm(np.array([[0.1, 0.0], [0.2, 0.05]])))
    assert rows[1].iqm == pytest.approx(metrics.iqm(np.array([[0.3, 0.9], [0.5, 0.8]])))
    assert all(r.ci_lower <= r.iqm <= r.ci_upper for r in rows)
    long = group_result("a", learning_curves={s: [[1000 * k, 10.0 * k] for k in range(1, 51)] for s in (0, 1)})
    steps = [r.env_steps for r in iqm_by_budget([long], FINAL_EVAL)]
    assert len(steps) == 20 and steps[0] == 1000 and steps[-1] == 50_000, "evenly thinned, the last kept"


def _strict_loads(text: str):
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")
    return json.loads(text, parse_constant=refuse)


GROUP_KEYS = ["task", "agent", "variant", "seeds", "final_env_steps", "returns", "scores", "V", "D",
              "action_distance", "v_curve", "q1_dispersion", "early_q_gap", "learning_curves", "action_distance_pairs",
              "policy", "other_policies", "alpha_frac_floor", "alpha_frac_cap", "alpha_frac_floor_late",
              "alpha_frac_cap_late", "log_std_at_min", "unverified_seeds", "alpha_frac_hot_late", "alpha_ratio_late",
              "entropy_late", "random_score"]
AGGREGATE_KEYS = ["agent", "variant", "n_tasks", "n_seeds", "iqm", "ci_lower", "ci_upper", "ci_width", "mean_score",
                  "V_mean", "V_median", "action_distance_mean", "n_runs", "n_failed", "V_mean_ci_lower",
                  "V_mean_ci_upper", "action_distance_ci_lower", "action_distance_ci_upper", "score_var_mean",
                  "score_var_ci_lower", "score_var_ci_upper", "baseline", "V_ratio", "V_ratio_ci_lower",
                  "V_ratio_ci_upper", "score_var_ratio", "score_var_ratio_ci_lower", "score_var_ratio_ci_upper",
                  "mean_score_ci_lower", "mean_score_ci_upper", "ratio_ci", "alpha_frac_floor_late",
                  "alpha_frac_cap_late", "log_std_at_min", "n_tasks_at_cap", "alpha_ratio_late", "n_tasks_hot"]


def test_typed_results_round_trip_through_strict_json():
    single = group_result("d", scores=(0.25,), V=math.nan, action_distance=math.nan, early_q_gap=math.nan,
                          v_curve=[[2000, math.nan]])
    qed = group_result("a", variant="qed0.2", V=0.5, alpha_frac_cap_late=0.75, alpha_frac_cap=0.5)
    groups = [group_result("a"), single, qed]
    results = sweep_results("s", FINAL_EVAL, groups, [FailedTrial("x/y/z/0", "boom")], 3)
    text = json.dumps(results.to_json(), indent=1)
    raw = _strict_loads(text)  # NaN is written as null
    assert list(raw) == ["sweep", "final_eval", "aggregates", "groups", "critic_proxy", "failed_trials", "n_trials",
                         "group_stats", "iqm_by_budget", "policy", "other_policies", "comparisons", "verdict",
                         "performance_profiles"]
    assert [list(g) for g in raw["groups"]] == [GROUP_KEYS] * 3 and list(raw["aggregates"][0]) == AGGREGATE_KEYS
    assert raw["groups"][0]["alpha_frac_cap_late"] == 0.75 and raw["groups"][1]["alpha_frac_cap_late"] is None
    (comparison,) = raw["comparisons"]
    assert (comparison["variant"], comparison["baseline"], comparison["pairing"]) == ("qed0.2", "te", "paired")
    assert raw["verdict"]["variants"][0]["n_tasks_at_cap"] == 1
    assert list(raw["critic_proxy"][0]) == ["agent", "variant", "tasks", "early_q_gap", "q1_dispersion", "r_squared"]
    assert raw["groups"][2]["V"] is None and raw["groups"][2]["v_curve"] == [[2000, None]]
    assert raw["groups"][0]["learning_curves"] == {"0": [[1000, 10.0], [2000, 20.0]], "1": [[1000, 10.0], [2000, 20.0]]}
    assert raw["failed_trials"] == [{"name": "x/y/z/0", "error": "boom"}] and raw["final_eval"]["bootstrap_reps"] == 200

    back = SweepResults.from_json(raw)
    assert back.to_json() == results.to_json()  # exact, and stable under a second round trip
    assert back.final_eval == FINAL_EVAL and back.failed_trials == [FailedTrial("x/y/z/0", "boom")]
    assert back.groups[0] == qed and back.groups[1] == groups[0]  # sorted by key; equal field by field
    assert math.isnan(back.groups[2].V) and math.isnan(back.groups[2].v_curve[0][1])
    assert list(back.groups[0].learning_curves) == [0, 1]  # seeds are ints again
    assert isinstance(back.critic_proxy[0], CriticProxy) and back.iqm_by_budget == results.iqm_by_budget
    agg = results.aggregates[0]
    assert Aggregate.from_json(agg.to_json()).to_json() == agg.to_json()
    assert GroupResult.from_json(groups[0].to_json()) == groups[0]
    old = {k: v for k, v in groups[0].to_json().items() if not k.startswith(("alpha_frac", "log_std"))}
    assert math.isnan(GroupResult.from_json(old).alpha_frac_cap), "an entry written before these fields loads"
    # a comparison written flat (x, x_ci_lower, x_ci_upper: results.json before Interval), without P(this > te)
    (c,) = results.comparisons
    flat = {k: v for k, v in csv_row(c).items() if not k.startswith("prob_improvement")}
    older = Comparison.from_json({**flat, "tasks": flat["tasks"].split(";")})
    assert older.V_ratio_median == c.V_ratio_median and math.isnan(older.prob_improvement.value)


def test_gather_writes_results_and_tables_with_fixed_columns(tmp_path):
    groups = [group_result(t, variant=v, scores=(0.1 * i, 0.2 * i), early_q_gap=float(i), q1_dispersion=2.0 * i)
              for v in ("te", "qed0.2") for i, t in enumerate(("a", "b", "c"), start=1)]
    results = sweep_results("s", FINAL_EVAL, groups, [], 12)
    layout = SweepDir(tmp_path)
    write_results(results, layout)
    assert _strict_loads(layout.results_json.read_text()) == results.to_json()
    with open(layout.aggregates_csv) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == AGGREGATE_KEYS and [(r["agent"], r["variant"]) for r in rows] == [
        ("sac_ln", "qed0.2"), ("sac_ln", "te")]
    assert float(rows[1]["iqm"]) == results.aggregates[1].iqm and rows[0]["baseline"] == "te"
    with open(layout.groups_csv) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == GROUP_COLUMNS  # the first ten columns as before, additions after them
    # rows sorted by task, agent, variant; task b: scores 0.2 and 0.4, i.e. mean returns 200 and 400 per seed
    assert len(rows) == 6 and rows[2]["task"] == "b" and float(rows[2]["mean_return"]) == pytest.approx(300.0)
    assert float(rows[2]["std_return_across_seeds"]) == pytest.approx(100.0)
    with open(layout.budgets_csv) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["agent", "variant", "env_steps", "n_tasks", "n_runs", "iqm", "ci_lower", "ci_upper"]
    figures = sorted(p.name for p in layout.figures.iterdir())
    names = ["action_distance", "ci_width", "critic_proxy", "iqm_over_env_steps", "learning_curves",
             "mean_return_vs_kl", "pareto_kl_vs_iqm", "performance_profiles", "probability_of_improvement",
             "v_over_env_steps"]
    assert figures == sorted(f"{n}.{ext}" for n in names for ext in ("png", "svg"))
    svg = (layout.figures / "ci_width.svg").read_text()
    assert "<svg" in svg and "3 tasks x 2 seeds (12 runs; 0 trials left out)" in svg  # the caption, as text
    assert "Uncertainty of the IQM" in svg and "Return variance across seeds" not in svg

