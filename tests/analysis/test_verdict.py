"""The claim's verdict (qed_ray/analysis/verdict.py, evidence.py): every outcome on synthetic groups built for it,
each decided by an interval (never a point estimate) at the Bonferroni-adjusted level, the learning floors and the
per-task guards, the design floor (exploratory: not judged) and how a variant and the claim combine outcomes."""

import copy
import math
from pathlib import Path

import numpy as np
import pytest
from folder_helpers import group_result

from qed_ray.spec import claim
from qed_ray.analysis import bootstrap
from qed_ray.analysis.tables import compare_all, sweep_results
from qed_ray.analysis.evidence import judge
from qed_ray.analysis.results import Verdict
from qed_ray.analysis.verdict import (EXPLORATORY, FAIL, NOT_ENOUGH, NOT_ENOUGH_SEEDS, PASS, combine, decision_level,
                                      format_verdict, guard_outcome, interval_outcome)
from qed_ray.spec.sweep import FinalEvalSpec

FE = FinalEvalSpec(bootstrap_reps=400, seed=1)
TASKS = ("cheetah-run", "walker-walk", "hopper-hop")
SCORES = [0.6, 0.7, 0.8, 0.9]


def _flat(n: int, value: float) -> list[list[float]]:
    return [[0.0 if i == j else value for j in range(n)] for i in range(n)]


def _outlier(n: int, near: float, far: float) -> list[list[float]]:
    """Seeds 0..n-2 close together (``near``), the last seed far from all (``far``): resamples without it are
    near, so the interval of V spans from ``near`` to several times the estimate."""
    return [[0.0 if i == j else far if n - 1 in (i, j) else near for j in range(n)] for i in range(n)]


def _groups(variant: str, d, scores, tasks=TASKS, random_score=0.0, **kw):
    """One group per task; ``scores`` one list for every task, or a dict task -> list."""
    out = []
    for t in tasks:
        s = list(scores[t] if isinstance(scores, dict) else scores)
        n = len(s)
        out.append(group_result(t, agent="mad_sac", variant=variant, scores=s, V=float(np.mean(
            [d[i][j] for i in range(n) for j in range(n) if i != j])), D=d, seeds=list(range(n)),
            learning_curves={k: [[2000, 1.0]] for k in range(n)}, random_score=random_score, **kw))
    return out


def _record(**changes) -> dict:
    """docs/claim.md's record with the design shrunk to these synthetic groups (so their verdict is judged)."""
    _, raw = claim.read_block(Path(__file__).resolve().parents[2] / "docs" / "claim.md")
    raw = copy.deepcopy(raw)
    raw.update({"tasks": list(TASKS), "seeds": 4, "env_steps": 2000, "final_episodes": 20,
                "final_policies": ["mean"], "bootstrap_reps": 400, **changes})
    return {"file": "docs/claim.md", "sha256": claim.block_sha256(raw), "block": raw}


def _judge(te, *variants, record=None, fe=FE):
    groups = te + [g for v in variants for g in v]
    return judge(compare_all(groups, fe), groups, fe, _record() if record is None else record)


def _one(te, qed, **kw):
    (row,) = _judge(te, qed, **kw).variants
    return row, {e.name: e.outcome for e in row.endpoints}, [g.outcome for g in row.guards]


def test_both_endpoints_and_every_guard_pass_on_a_clear_effect():
    row, ends, guards = _one(_groups("te", _flat(4, 50.0), SCORES), _groups("qed0.2", _flat(4, 1.0), SCORES))
    assert row.scope == [] and row.level == 0.96, "one judged variant: no correction"
    assert ends == {"V ratio >= 10": PASS, "IQM kept": PASS} and guards == [PASS] * 3 and row.outcome == PASS
    v = row.endpoints[0]
    assert (v.estimate, v.lower, v.upper) == (50.0, 50.0, 50.0)


def test_an_interval_straddling_the_v_threshold_does_not_pass():
    assert interval_outcome(12.0, 4.45, 26.1, 10) == NOT_ENOUGH, "the point estimate above 10 does not decide"
    row, ends, _ = _one(_groups("te", _outlier(4, 0.5, 200.0), SCORES), _groups("qed0.2", _flat(4, 1.0), SCORES))
    v = row.endpoints[0]
    assert v.estimate >= 10 and v.lower < 10 <= v.upper
    assert ends["V ratio >= 10"] == NOT_ENOUGH and row.outcome == NOT_ENOUGH
    row, ends, _ = _one(_groups("te", _flat(4, 2.0), SCORES), _groups("qed0.2", _flat(4, 1.0), SCORES))
    assert ends["V ratio >= 10"] == FAIL and row.outcome == FAIL, "upper end 2 < 10"


def test_neither_arm_above_its_floor_is_not_enough_data_named_per_task():
    te = _groups("te", _flat(4, 50.0), [0.02, 0.02, 0.03, 0.01], random_score=0.01)
    qed = _groups("qed0.2", _flat(4, 0.5), [0.03, 0.02, 0.03, 0.02], random_score=0.01)
    row, ends, guards = _one(te, qed)
    assert guards == [NOT_ENOUGH] * 3 and row.outcome == NOT_ENOUGH, "QED's noise above te's is no pass"
    assert ends == {"V ratio >= 10": NOT_ENOUGH, "IQM kept": NOT_ENOUGH}, "no task admitted: NaN"
    g = row.guards[0]
    assert g.floor == pytest.approx(0.01 + 0.1 * 0.99) and g.reason.startswith(
        "te did not clear its learning floor: mean score 0.02, lower end")


def test_qed_untrained_with_te_learned_fails():
    row, ends, guards = _one(_groups("te", _flat(4, 50.0), SCORES),
                             _groups("qed0.2", _flat(4, 0.01), [0.001, 0.002, 0.001, 0.0]))
    assert guards == [FAIL] * 3 and row.outcome == FAIL
    assert "qed0.2 below its learning floor while te cleared it" in row.guards[0].reason


def _collapse(task: str, te_there: list[float]):
    """Four tasks, QED collapsed to ~0.01 on ``task`` only (te scores ``te_there`` there), V cut 50-fold."""
    tasks = (*TASKS, "finger-spin")
    te_scores = {t: te_there if t == task else SCORES for t in tasks}
    qed_scores = {**te_scores, task: [0.01, 0.012, 0.011, 0.013]}
    te, qed = _groups("te", _flat(4, 50.0), te_scores, tasks), _groups("qed0.2", _flat(4, 1.0), qed_scores, tasks)
    row, ends, guards = _one(te, qed, record=_record(tasks=list(tasks)))
    return row, ends, dict(zip(sorted(tasks), guards))


def test_qed_collapsed_on_the_weakest_task_only_fails_whatever_the_pooled_iqm():
    row, ends, guards = _collapse("hopper-hop", [0.3, 0.32, 0.34, 0.36])
    assert ends["IQM kept"] == PASS and row.endpoints[1].estimate == 1.0, "the pooled IQM trims hopper-hop away"
    assert guards == {"cheetah-run": PASS, "finger-spin": PASS, "hopper-hop": FAIL, "walker-walk": PASS}
    assert row.outcome == FAIL and "3 of 4 tasks" in row.endpoints[0].rule, "V median over the guarded tasks"


def test_qed_collapsed_on_the_strongest_task_only_fails():
    row, _, guards = _collapse("walker-walk", [0.93, 0.95, 0.96, 0.97])
    assert guards["walker-walk"] == FAIL and row.outcome == FAIL


def test_bonferroni_over_two_variants_moves_the_lower_end():
    reps = np.array([0.94] * 15 + [0.951] * 985)  # its 1% quantile is 0.94, its 2% quantile 0.951
    assert decision_level(claim.Endpoints(), 2) == 0.98 and decision_level(claim.Endpoints(), 1) == 0.96
    unadjusted = bootstrap.percentile_interval(reps, decision_level(claim.Endpoints(), 1))
    adjusted = bootstrap.percentile_interval(reps, decision_level(claim.Endpoints(), 2))
    assert (unadjusted[0], adjusted[0]) == (0.951, 0.94)
    assert interval_outcome(1.0, *unadjusted, 0.95) == PASS and interval_outcome(1.0, *adjusted, 0.95) == NOT_ENOUGH
    te = _groups("te", _flat(4, 50.0), SCORES)
    v = _judge(te, _groups("qed0.2", _flat(4, 1.0), SCORES), _groups("qed0.4", _flat(4, 1.0), SCORES))
    assert [r.level for r in v.variants] == [0.98, 0.98] and v.outcome == PASS
    assert v.correction == "bonferroni over 2 variant(s): intervals at 98%"


def test_two_seeds_give_no_interval_and_no_verdict():
    v = _judge(_groups("te", _flat(2, 50.0), SCORES[:2]), _groups("qed0.2", _flat(2, 1.0), SCORES[:2]))
    (row,) = v.variants
    assert [(e.outcome, math.isnan(e.lower), math.isnan(e.upper)) for e in row.endpoints] == [
        (NOT_ENOUGH_SEEDS, True, True)] * 2 and math.isnan(row.level) and row.guards == []
    assert row.outcome == EXPLORATORY and row.scope == ["seeds: 2 on some task (pre-registered 4)"]
    assert v.outcome == EXPLORATORY


@pytest.mark.parametrize("args, want", [
    ((12.0, 10.0, 30.0), PASS), ((12.0, 9.99, 30.0), NOT_ENOUGH), ((5.0, 2.0, 9.5), FAIL),
    ((12.0, 11.0, 9.5), NOT_ENOUGH),  # both rules at once: a percentile interval missing its estimate
    ((math.nan, 12.0, 30.0), NOT_ENOUGH), ((12.0, 12.0, math.nan), NOT_ENOUGH), ((12.0, math.nan, 30.0), NOT_ENOUGH),
    ((5.0, 2.0, math.nan), NOT_ENOUGH), ((5.0, math.nan, 9.0), NOT_ENOUGH)])
def test_interval_rules_and_nan_anywhere(args, want):
    assert interval_outcome(*args, 10) == want


def test_guard_rules():
    assert guard_outcome(0.1, 0.3, 0.5, 0.96, 0.95) == PASS
    assert guard_outcome(0.1, 0.09, 0.5, 0.96, 0.95) == NOT_ENOUGH, "te not shown above its floor"
    assert guard_outcome(math.nan, 0.3, 0.5, 0.96, 0.95) == NOT_ENOUGH, "no random-policy score"
    assert guard_outcome(0.1, 0.3, 0.09, 0.2, 0.95) == FAIL and guard_outcome(0.1, 0.3, 0.5, 0.94, 0.95) == FAIL
    got = guard_outcome(np.array([0.1, 0.1]), np.array([0.3, 0.05]), np.array([0.5, 0.5]), np.array([0.9, 1]), 0.95)
    assert got.tolist() == [FAIL, NOT_ENOUGH], "vectorised for the power tool"


def test_variants_and_the_claim_combine_their_outcomes():
    assert combine([PASS, PASS], any_pass=False) == PASS and combine([PASS, NOT_ENOUGH], any_pass=False) == NOT_ENOUGH
    assert combine([NOT_ENOUGH, FAIL], any_pass=False) == FAIL
    assert combine([FAIL, PASS], any_pass=True) == PASS and combine([FAIL, FAIL], any_pass=True) == FAIL
    assert combine([FAIL, NOT_ENOUGH], any_pass=True) == NOT_ENOUGH and combine([], any_pass=True) == NOT_ENOUGH


def test_off_the_design_nothing_is_judged_and_every_departure_is_listed():
    te, qed = _groups("te", _flat(4, 50.0), SCORES), _groups("qed0.2", _flat(4, 1.0), SCORES)
    other = _groups("qed0.3", _flat(4, 40.0), SCORES)
    fixed = _groups("fixed0.2", _flat(4, 1.0), SCORES)
    v = _judge(te, qed, other, fixed)
    assert [r.variant for r in v.variants] == ["qed0.2", "qed0.3"], "controls (fixed alpha) are never judged"
    registered, extra = v.variants
    assert registered.scope == [] and registered.outcome == PASS and registered.level == 0.96
    assert extra.outcome == EXPLORATORY and "not among the pre-registered" in extra.scope[0]
    assert v.outcome == PASS and v.judged_over == "the 1 pre-registered variant(s)"

    fe = FinalEvalSpec(bootstrap_reps=400, seed=1, episodes=5, policies=["sample"])
    v = judge(compare_all(te + qed, fe), te + qed, fe)  # no claim file: the registered design, in full
    (row,) = v.variants
    assert row.scope == [
        "no pre-registration named (spec field claim)", "tasks: 3 of the 6 pre-registered",
        "seeds: 4 on some task (pre-registered 15)",
        "budget: 2,000 env steps (pre-registered 2,000,000)",
        "final evaluation: 5 episodes per seed (pre-registered 20)",
        "evaluation policies: sample (pre-registered mean, sample, the first read by the verdict)",
        "bootstrap: 95% intervals from 400 resamples (pre-registered 95% from 50000)"]
    assert row.outcome == EXPLORATORY and v.outcome == EXPLORATORY
    text = format_verdict(v, 0.95)
    assert "  mad_sac qed0.2 vs te: not judged (exploratory: no pre-registration named (spec field claim); tasks: 3 " \
           "of the 6 pre-registered;" in text
    assert "PASS" not in text and "FAIL" not in text and "the claim: not judged" in text
    assert judge(compare_all(te + fixed, FE), te + fixed, FE) is None, "no QED variant: no verdict"


def test_a_recorded_block_of_older_rules_is_not_judged_and_says_why():
    rec = _record()
    rec["block"]["endpoints"]["v_ratio"] = {"summary": "median", "at_least": 10, "lower_above": 1}
    (row,) = _judge(_groups("te", _flat(4, 50.0), SCORES), _groups("qed0.2", _flat(4, 1.0), SCORES),
                    record=rec).variants
    assert row.outcome == EXPLORATORY and row.scope[0].startswith(
        f"the claim block recorded in sweep.json (sha256 {rec['sha256'][:12]}) does not fit today's rules "
        "(endpoints.v_ratio.at_least: Extra inputs are not permitted): start a new sweep to judge it")


def test_pilot_budget_is_a_departure():
    te3 = _groups("te", _flat(4, 50.0), SCORES, final_env_steps=500)
    pilot = _groups("qed0.2", _flat(4, 1.0), SCORES, final_env_steps=500)
    (row,) = _judge(te3, pilot, record=_record(pilot_env_steps=500)).variants
    assert row.scope == ["pilot at 500 env steps: read through the V curves only (docs/claim.md)"]


def test_where_qed_sat_is_shown_beside_the_outcome_and_the_verdict_round_trips():
    te = _groups("te", _flat(4, 50.0), SCORES)
    qed = [g.__class__(**{**g.__dict__, "alpha_frac_cap_late": cap, "alpha_frac_hot_late": hot}) for g, cap, hot in
           zip(_groups("qed0.2", _flat(4, 1.0), SCORES), (0.9, 0.5, math.nan), (math.nan, 0.9, math.nan))]
    results = sweep_results("s", FE, te + qed, [], 24, _record())
    (row,) = results.verdict.variants
    assert row.n_tasks_at_cap == 1, "above half the states only; NaN (not logged) is not at the cap"
    assert [(g.task, g.alpha_regime) for g in row.guards] == [
        ("cheetah-run", "at_cap"), ("hopper-hop", None), ("walker-walk", "hot")], "the group's flag beside its guard"
    text = format_verdict(results.verdict, 0.95)
    assert "    cheetah-run: guard pass (te learned" in text and "; alpha at_cap)" in text and "; alpha hot)" in text
    assert [s.qed_at_cap for s in results.group_stats if s.variant == "qed0.2"] == [True, False, False]
    assert Verdict.from_json(results.verdict.to_json()) == results.verdict
