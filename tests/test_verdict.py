"""The claim's verdict (qed_ray/verdict.py): every outcome of both endpoints on synthetic groups built for it, how
a variant and the claim combine them, and what makes a verdict pre-registered or exploratory."""

import copy
import math
from pathlib import Path

import numpy as np
import pytest
from folder_helpers import group_result

from qed_ray import claim
from qed_ray.spec import FinalEvalSpec
from qed_ray.analysis.tables import compare_all, sweep_results
from qed_ray.analysis.verdict import FAIL, NOT_ENOUGH, PASS, Verdict, combine, iqm_outcome, judge, v_ratio_outcome

FE = FinalEvalSpec(bootstrap_reps=400, seed=1)
TASKS = ("cheetah-run", "walker-walk", "hopper-hop")


def _flat(n: int, value: float) -> list[list[float]]:
    return [[0.0 if i == j else value for j in range(n)] for i in range(n)]


def _outlier(n: int, near: float, far: float) -> list[list[float]]:
    """Seeds 0..n-2 close together (``near``), the last seed far from all (``far``): resamples without it are
    near, so the interval of V spans from ``near`` to several times the estimate."""
    return [[0.0 if i == j else far if n - 1 in (i, j) else near for j in range(n)] for i in range(n)]


def _groups(variant: str, d, scores, tasks=TASKS, **kw):
    n = len(scores)
    return [group_result(t, agent="mad_sac", variant=variant, scores=list(scores), V=float(np.mean(
        [d[i][j] for i in range(n) for j in range(n) if i != j])), D=d, seeds=list(range(n)),
        learning_curves={s: [[2000, 1.0]] for s in range(n)}, **kw) for t in tasks]


def _endpoints(te, qed, fe=FE):
    (c,) = compare_all(te + qed, fe)
    v = judge([c], te + qed, fe)
    (row,) = v.variants
    return c, {e.name: e.outcome for e in row.endpoints}, row.outcome


SCORES = [0.6, 0.7, 0.8, 0.9]


def test_v_ratio_pass_fail_and_not_enough_data():
    te_far, qed = _groups("te", _flat(4, 50.0), SCORES), _groups("qed0.2", _flat(4, 1.0), SCORES)
    c, got, variant = _endpoints(te_far, qed)  # every resample: 50 / 1
    assert (c.V_ratio_median, c.V_ratio_median_ci_lower, c.V_ratio_median_ci_upper) == (50.0, 50.0, 50.0)
    assert got == {"V ratio >= 10": PASS, "IQM kept": PASS} and variant == PASS
    c, got, variant = _endpoints(_groups("te", _flat(4, 2.0), SCORES), qed)
    assert c.V_ratio_median_ci_upper == 2.0 and got["V ratio >= 10"] == FAIL and variant == FAIL
    c, got, variant = _endpoints(_groups("te", _outlier(4, 0.5, 200.0), SCORES), qed)
    assert c.V_ratio_median >= 10 and c.V_ratio_median_ci_lower <= 1 < c.V_ratio_median_ci_upper
    assert got["V ratio >= 10"] == NOT_ENOUGH and variant == NOT_ENOUGH


def test_iqm_kept_pass_fail_and_not_enough_data():
    te = _groups("te", _flat(4, 50.0), SCORES)
    _, got, _ = _endpoints(te, _groups("qed0.2", _flat(4, 1.0), [s / 2 for s in SCORES]))
    assert got["IQM kept"] == FAIL, "half the scores in every resample: the ratio is 0.5"
    c, got, _ = _endpoints(te, _groups("qed0.2", _flat(4, 1.0), [0.3, 0.7, 0.8, 1.0]))
    assert c.iqm_ratio_ci_lower < 0.95 <= c.iqm_ratio_ci_upper and got["IQM kept"] == NOT_ENOUGH


@pytest.mark.parametrize("args, want", [
    ((12.0, 2.0, 30.0), PASS), ((12.0, 1.0, 30.0), NOT_ENOUGH), ((9.0, 2.0, 30.0), NOT_ENOUGH),
    ((9.0, 2.0, 9.5), FAIL), ((12.0, 2.0, 9.5), NOT_ENOUGH),  # both rules at once: a percentile interval missing
    ((math.nan, 2.0, 30.0), NOT_ENOUGH), ((12.0, math.nan, math.nan), NOT_ENOUGH)])
def test_v_ratio_rules(args, want):
    assert v_ratio_outcome(*args) == want


@pytest.mark.parametrize("lower, upper, want", [(0.95, 1.1, PASS), (0.94, 1.1, NOT_ENOUGH), (0.8, 0.949, FAIL),
                                                (math.nan, 1.0, NOT_ENOUGH)])
def test_iqm_rules(lower, upper, want):
    assert iqm_outcome(lower, upper) == want


def test_variants_and_the_claim_combine_their_outcomes():
    assert combine([PASS, PASS], any_pass=False) == PASS and combine([PASS, NOT_ENOUGH], any_pass=False) == NOT_ENOUGH
    assert combine([NOT_ENOUGH, FAIL], any_pass=False) == FAIL
    assert combine([FAIL, PASS], any_pass=True) == PASS and combine([FAIL, FAIL], any_pass=True) == FAIL
    assert combine([FAIL, NOT_ENOUGH], any_pass=True) == NOT_ENOUGH and combine([], any_pass=True) == NOT_ENOUGH


def _record(**changes) -> dict:
    _, raw = claim.read_block(Path(__file__).resolve().parents[1] / "docs" / "claim.md")
    raw = copy.deepcopy(raw)
    raw.update(changes)
    return {"file": "docs/claim.md", "sha256": claim.block_sha256(raw), "block": raw}


def test_pre_registered_only_on_the_design_and_judged_over_its_variants():
    rec = _record(bootstrap_reps=200, tasks=list(TASKS), seeds=4, env_steps=2000)
    te, qed = _groups("te", _flat(4, 50.0), SCORES), _groups("qed0.2", _flat(4, 1.0), SCORES)
    other = _groups("qed0.3", _flat(4, 40.0), SCORES)
    fixed = _groups("fixed0.2", _flat(4, 1.0), SCORES)
    fe = FinalEvalSpec(bootstrap_reps=200, seed=1)
    v = judge(compare_all(te + qed + other + fixed, fe), te + qed + other + fixed, fe, rec)
    assert [r.variant for r in v.variants] == ["qed0.2", "qed0.3"], "controls (fixed alpha) are never judged"
    registered, extra = v.variants
    assert registered.scope == [] and registered.outcome == PASS and extra.outcome == FAIL
    assert "not among the pre-registered" in extra.scope[0]
    assert v.outcome == PASS and v.judged_over == "the pre-registered variants" and v.claim_file == "docs/claim.md"

    pilot = _groups("qed0.2", _flat(3, 1.0), SCORES[:3], tasks=TASKS[:2], final_env_steps=500)
    te3 = _groups("te", _flat(3, 50.0), SCORES[:3], final_env_steps=500)
    v = judge(compare_all(te3 + pilot, fe), te3 + pilot, fe, _record(**{**rec["block"], "pilot_env_steps": 500}))
    (row,) = v.variants
    assert row.scope == ["tasks: 2 of the 3 pre-registered", "seeds: 3 on some task (pre-registered 4)",
                         "pilot at 500 env steps: read through the V curves only (docs/claim.md)"]
    assert v.judged_over == "every QED variant (exploratory)"
    assert judge(compare_all(te + fixed, fe), te + fixed, fe) is None, "no QED variant: no verdict"


def test_a_group_at_its_cap_is_counted_and_the_verdict_round_trips():
    te = _groups("te", _flat(4, 50.0), SCORES)
    qed = [g.__class__(**{**g.__dict__, "alpha_frac_cap_late": cap}) for g, cap in
           zip(_groups("qed0.2", _flat(4, 1.0), SCORES), (0.9, 0.5, math.nan))]
    results = sweep_results("s", FE, te + qed, [], 24)
    (row,) = results.verdict.variants
    assert row.n_tasks_at_cap == 1, "above half the states only; NaN (not logged) is not at the cap"
    assert [s.qed_at_cap for s in results.group_stats if s.variant == "qed0.2"] == [True, False, False]
    back = Verdict.from_json(results.verdict.to_json())
    assert back == results.verdict
