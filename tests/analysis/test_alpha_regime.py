"""Where QED's alpha sat, from the rule's own alphas to the tables: the late shares at the floor, at the cap and
"hot" (at least HOT_RATIO x alpha_TE), the late alpha / alpha_TE and the entropy gap to te, and each group's
``alpha_regime`` in groups.csv, the summary and the aggregates."""

import csv
import math

import pytest
import torch
from folder_helpers import group_result

from qed_ray.analysis import report
from qed_ray.analysis.group_eval import _interval_values, interval_diagnostics
from qed_ray.analysis.results import TrialRecord
from qed_ray.analysis.tables import group_rows, sweep_results
from qed_ray.spec.config import HOT_RATIO, TemperatureSpec
from qed_ray.records.layout import SweepDir
from qed_ray.rl.temperature import alpha_stat_names, alpha_stats, make_temperature, temperature_state
from qed_ray.analysis.outputs import write_results
from qed_ray.spec.sweep import FinalEvalSpec

FINAL_EVAL = FinalEvalSpec(episodes=2, action_rollouts=2, action_steps=30, curve_episodes=1, bootstrap_reps=200,
                           confidence=0.95, seed=0)
ALPHA_TE, K, A, B = 0.01, 0.2, 2, 64
STEPS = (500, 1000, 1500, 2000)  # evaluation intervals of a 2,000-step budget: the last quarter is 2,000 alone


def interval_metrics(times: float, entropy: float) -> dict[str, float]:
    """One interval's mean update metrics of a QED agent (alpha_TE 0.01, cap 0.2) whose every actor state has the
    disagreement that puts alpha at ``times`` x alpha_TE, through the real rule and its statistics."""
    rule = make_temperature(TemperatureSpec(kind="qed", k=K, alpha_max=0.2, init_alpha=ALPHA_TE), A)
    state = temperature_state(rule)
    delta = torch.full((B,), times * ALPHA_TE * K * A)  # alpha = Delta / (k d), above the floor, below the cap
    alpha = rule.alpha(state, B, delta)
    stats = dict(zip(alpha_stat_names(rule, "alpha/actor"), (float(x) for x in alpha_stats(alpha, rule, state))))
    return {**stats, "alpha/te": float(rule.floor(state)), "policy/entropy": entropy}


def qed_group(task: str, times: float, entropy: float, variant: str = "qed0.2"):
    records = [TrialRecord(f"{task}/sac_ln/{variant}/{s}", task, "sac_ln", variant, s, 2, {2000: "x"},
                           diagnostics={step: _interval_values(interval_metrics(times, entropy)) for step in STEPS})
               for s in (0, 1)]
    return group_result(task, variant=variant, **interval_diagnostics(records, 2000))


def te_group(task: str, entropy: float):
    metrics = {"alpha/actor_mean": ALPHA_TE, "alpha/te": ALPHA_TE, "policy/entropy": entropy}  # te logs no shares
    records = [TrialRecord(f"{task}/sac_ln/te/{s}", task, "sac_ln", "te", s, 2, {2000: "x"},
                           diagnostics={step: _interval_values(metrics) for step in STEPS}) for s in (0, 1)]
    return group_result(task, **interval_diagnostics(records, 2000))


def test_the_rule_puts_alpha_where_the_test_says():
    hot, warm = interval_metrics(9.0, 0.0), interval_metrics(1.5, 0.0)
    assert hot["alpha/actor_mean"] == pytest.approx(0.09) and warm["alpha/actor_mean"] == pytest.approx(0.015)
    assert (hot["alpha/actor_frac_hot"], hot["alpha/actor_frac_cap"], hot["alpha/actor_frac_floor"]) == (1, 0, 0)
    assert (warm["alpha/actor_frac_hot"], warm["alpha/actor_frac_cap"], warm["alpha/actor_frac_floor"]) == (0, 0, 0)
    assert HOT_RATIO == 5.0


def test_hot_fires_at_nine_times_alpha_te_below_the_cap_and_not_at_one_and_a_half(tmp_path):
    groups = [qed_group("a", 9.0, entropy=1.5), qed_group("b", 1.5, entropy=-1.0), te_group("a", -2.0),
              te_group("b", -2.5)]
    hot, warm, te_a, _ = groups
    assert (hot.alpha_regime, warm.alpha_regime, te_a.alpha_regime) == ("hot", "ok", None)
    assert (hot.alpha_frac_hot_late, hot.alpha_frac_cap_late, hot.alpha_frac_floor_late) == (1.0, 0.0, 0.0)
    assert hot.alpha_ratio_late == pytest.approx(9.0) and warm.alpha_ratio_late == pytest.approx(1.5)
    assert math.isnan(te_a.alpha_ratio_late) and math.isnan(te_a.alpha_frac_hot_late), "te: no estimate"
    assert te_a.entropy_late == -2.0

    results = sweep_results("s", FINAL_EVAL, groups, [], 8)
    stats = {(s.task, s.variant): s for s in results.group_stats}
    assert stats[("a", "qed0.2")].alpha_regime == "hot" and stats[("b", "qed0.2")].alpha_regime == "ok"
    assert stats[("a", "qed0.2")].entropy_gap_late == pytest.approx(3.5)
    assert stats[("b", "qed0.2")].entropy_gap_late == pytest.approx(1.5)
    assert stats[("a", "te")].alpha_regime is None and math.isnan(stats[("a", "te")].entropy_gap_late)
    agg = {a.variant: a for a in results.aggregates}
    assert (agg["qed0.2"].n_tasks_hot, agg["qed0.2"].n_tasks_at_cap, agg["te"].n_tasks_hot) == (1, 0, 0)
    assert agg["qed0.2"].alpha_ratio_late == pytest.approx(5.25)

    layout = SweepDir(tmp_path)
    write_results(results, layout)
    with open(layout.groups_csv) as f:
        rows = {(r["task"], r["variant"]): r for r in csv.DictReader(f)}
    assert rows[("a", "qed0.2")]["alpha_regime"] == "hot" and rows[("b", "qed0.2")]["alpha_regime"] == "ok"
    assert rows[("a", "te")]["alpha_regime"] == "", "no estimate: an empty cell, never 'ok'"
    assert float(rows[("a", "qed0.2")]["alpha_ratio_late"]) == pytest.approx(9.0)
    assert [r["alpha_regime"] for r in group_rows(groups, results.group_stats)] == ["hot", None, "ok", None]

    text = report.summary(results)
    assert "QED HOT (alpha >= 5 x alpha_TE) on 1 of 2 tasks" in text
    assert ("    a: alpha / alpha_TE 9, at least 5 x alpha_TE on 100% of states, at the cap on 0%; policy entropy "
            "minus te's +3.5 nats: HOT") in text
    assert "    b: alpha / alpha_TE 1.5, at least 5 x alpha_TE on 0% of states" in text and "+1.5 nats: ok" in text


def test_at_the_cap_is_at_cap_not_hot():
    g = group_result("a", variant="qed0.2", alpha_frac_cap_late=0.9, alpha_frac_hot_late=0.95)
    assert g.alpha_regime == "at_cap"
    old = group_result("a", variant="qed0.2", alpha_frac_cap_late=0.1)  # written before the hot share existed
    assert old.alpha_regime is None, "no estimate, never 'ok'"


def test_each_group_run_is_tagged_with_its_regime_and_a_group_without_one_reads_no_estimate():
    """The group runs' tags (qed_ray.service.mlflow.tags.group_tags on each group's view): the rule at 100, 9 and 1.5 x
    alpha_TE (cap 0.2 = 20 x alpha_TE) puts QED at its cap, hot and ok; te has no estimate, and says so."""
    from qed_ray.analysis.group_view import group_view
    from qed_ray.service.mlflow.tags import group_tags

    groups = [qed_group("capped", 100.0, 0.0), qed_group("hot", 9.0, 0.0), qed_group("ok", 1.5, 0.0),
              te_group("ok", 0.0)]
    tags = {g.task + "/" + g.variant: group_tags(*g.key, group_view(g, groups, FINAL_EVAL).alpha_regime)
            for g in groups}
    assert {k: t["alpha_regime"] for k, t in tags.items()} == {
        "capped/qed0.2": "at_cap", "hot/qed0.2": "hot", "ok/qed0.2": "ok", "ok/te": "no estimate"}
    assert tags["ok/te"] == {"qed.task": "ok", "qed.agent": "sac_ln", "qed.variant": "te", "qed.group": "ok/sac_ln/te",
                             "mlflow.runName": "ok te sac_ln", "alpha_regime": "no estimate"}
