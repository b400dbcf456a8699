"""Seeds by looks (qed_ray/analysis/spending.py, sequential.py): the levels per look against published boundaries
and an independent integration, and what an adaptive sweep decides after each look on synthetic groups built for
each case (a clear effect, the margin, a variant frozen while te grows, te below its floor)."""

import numpy as np
import pytest
from pydantic import ValidationError
from scipy import stats
from test_verdict import FE, SCORES, _flat, _groups, _record

from qed_ray.spec import claim
from qed_ray.analysis.evidence import judge
from qed_ray.analysis.sequential import GROW, TE_UNLEARNED, next_look
from qed_ray.analysis.spending import boundaries, nominal_levels, spent
from qed_ray.analysis.tables import compare_all
from qed_ray.analysis.verdict import EXPLORATORY, FAIL, NOT_ENOUGH, PASS, decision_level, look_levels

ADAPTIVE = {"start": 4, "step": 2, "max_seeds": 8}  # looks at 4, 6 and 8 seeds


# ---- the levels ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rule, fractions, want", [
    # Lan-DeMets O'Brien-Fleming-type and Pocock-type spending, one-sided alpha 0.025, equal looks: the upper
    # boundaries gsDesign prints (sfLDOF, sfLDPocock) to four decimals.
    ("obrien_fleming", [0.5, 1], [2.9626, 1.9686]),
    ("obrien_fleming", [1 / 3, 2 / 3, 1], [3.7103, 2.5114, 1.9930]),
    ("obrien_fleming", [0.25, 0.5, 0.75, 1], [4.3326, 2.9631, 2.3590, 2.0141]),
    ("pocock", [0.5, 1], [2.1570, 2.2010]),
])
def test_boundaries_are_the_published_ones(rule, fractions, want):
    assert boundaries(fractions, 0.025, rule) == pytest.approx(want, abs=6e-5)


@pytest.mark.parametrize("rule", ["obrien_fleming", "pocock"])
def test_each_look_spends_exactly_its_share_by_an_independent_integration(rule):
    """Genz's multivariate-normal integration (scipy) of the crossing probabilities, with the correlation
    sqrt(t_j / t_k) of the looks' statistics: look k spends A(t_k) - A(t_{k-1}), nothing more."""
    t = np.array([0.5, 0.75, 1.0])
    c = boundaries(t, 0.01, rule)
    cov = np.sqrt(np.minimum.outer(t, t) / np.maximum.outer(t, t))
    crossed = [1 - stats.multivariate_normal(np.zeros(k), cov[:k, :k], maxpts=10**7, abseps=1e-10,
                                             releps=1e-10).cdf(c[:k])
               for k in (1, 2, 3)]
    assert crossed == pytest.approx(list(spent(t, 0.01, rule)), abs=2e-7)


def test_look_levels_spend_the_bonferroni_share_and_one_look_is_the_fixed_design():
    endpoints = claim.Endpoints()  # decision_confidence 0.96: one-sided 2% over the claim, 1% per variant of 2
    a = claim.AdaptiveSpec(**ADAPTIVE)
    levels = look_levels(endpoints, a, 2)
    assert levels == pytest.approx([1 - 2 * stats.norm.sf(z) for z in boundaries([0.5, 0.75, 1.0], 0.01,
                                                                                   "obrien_fleming")], abs=1e-12)
    assert levels[0] > levels[1] > levels[2] > decision_level(endpoints, 2) == 0.98, "OBF: strict early"
    assert nominal_levels([1.0], 0.01, "obrien_fleming") == pytest.approx([0.98], abs=1e-12)
    assert nominal_levels([1.0], 0.01, "pocock") == pytest.approx([0.98], abs=1e-12)


def test_adaptive_blocks_are_validated_naming_the_field():
    with pytest.raises(ValidationError, match="max_seeds: 9 must be start .4. plus a whole number"):
        claim.AdaptiveSpec(start=4, step=2, max_seeds=9)
    with pytest.raises(ValidationError, match="start"):
        claim.AdaptiveSpec(start=2, step=2, max_seeds=8)
    raw = _record(adaptive=ADAPTIVE)["block"]
    with pytest.raises(ValidationError, match="adaptive.max_seeds: 8, but seeds is 4"):
        claim.ClaimBlock.model_validate({**raw, "seeds": 4})
    assert claim.AdaptiveSpec(**ADAPTIVE).looks() == [4, 6, 8]


# ---- the decisions on synthetic groups --------------------------------------------------------------------
def _look(te, *variants, look: int, before=None):
    groups = te + [g for v in variants for g in v]
    record = _record(seeds=8, adaptive=ADAPTIVE)
    verdict = judge(compare_all(groups, FE), groups, FE, record)
    return verdict, next_look(verdict, claim.AdaptiveSpec(**ADAPTIVE), look, before)


MARGIN = [0.90, 1.0, 0.92, 0.99, 0.91, 0.98, 0.93, 1.0]  # QED's score over te's, seed by seed: IQM ratio ~0.95


def _margin(n: int, variant: str = "qed0.4"):
    return _groups(variant, _flat(n, 1.0), [s * f for s, f in zip(np.resize(SCORES, n), MARGIN)])


def _te(n: int):
    return _groups("te", _flat(n, 50.0), list(np.resize(SCORES, n)))


def test_a_clear_effect_decides_at_the_first_look():
    verdict, look = _look(_te(4), _groups("qed0.2", _flat(4, 1.0), SCORES), _groups("qed0.4", _flat(4, 1.0), SCORES),
                          look=1)
    level = look_levels(claim.Endpoints(), claim.AdaptiveSpec(**ADAPTIVE), 2)[0]
    assert [(v.look, v.level, v.outcome) for v in verdict.variants] == [(1, level, PASS), (1, level, PASS)]
    assert [(v.decision, v.decided_at, v.seeds) for v in look.variants] == [(PASS, 1, 4), (PASS, 1, 4)]
    assert look.claim == PASS and look.next_seeds == {} and look.ended == "the claim is decided (pass)"


def test_a_margin_case_grows_to_the_maximum():
    before = None
    for k, n in enumerate([4, 6, 8], start=1):
        verdict, before = _look(_te(n), _margin(n, "qed0.2"), _margin(n), look=k, before=before)
        iqm = verdict.variants[0].endpoints[1]
        assert iqm.lower < 0.95 <= iqm.upper, f"look {k}: the IQM interval straddles the margin"
        if k < 3:
            assert [v.decision for v in before.variants] == [GROW, GROW] and before.claim == NOT_ENOUGH
            assert before.next_seeds == {"te": n + 2, "qed0.2": n + 2, "qed0.4": n + 2}
    assert [(v.decision, v.decided_at, v.seeds) for v in before.variants] == [(NOT_ENOUGH, 3, 8)] * 2
    assert before.next_seeds == {} and before.ended == "the last registered look (8 seeds)"


def test_a_decided_variant_is_frozen_while_te_grows_for_another():
    collapsed = _groups("qed0.2", _flat(4, 1.0), [0.3, 0.35, 0.4, 0.45])  # half of te's: guards and IQM fail
    _, first = _look(_te(4), collapsed, _margin(4), look=1)
    assert [(v.variant, v.decision, v.decided_at) for v in first.variants] == [("qed0.2", FAIL, 1),
                                                                              ("qed0.4", GROW, None)]
    assert first.claim == NOT_ENOUGH and first.next_seeds == {"te": 6, "qed0.2": 4, "qed0.4": 6}
    verdict, second = _look(_te(6), collapsed, _margin(6), look=2, before=first)
    assert verdict.variants[0].outcome == EXPLORATORY, "4 seeds against te's 6 is no registered look"
    frozen = second.variants[0]
    assert (frozen.decision, frozen.decided_at, frozen.seeds, frozen.outcome) == (FAIL, 1, 4, None)
    assert second.variants[1].decision == GROW and second.next_seeds == {"te": 8, "qed0.2": 4, "qed0.4": 8}


def test_te_below_its_learning_floor_ends_growth_as_not_enough_data():
    te = _groups("te", _flat(4, 50.0), [0.2, 0.25, 0.3, 0.22], random_score=0.5)  # floor 0.55
    qed = _groups("qed0.2", _flat(4, 1.0), [0.2, 0.25, 0.3, 0.22], random_score=0.5)
    _, look = _look(te, qed, _groups("qed0.4", _flat(4, 1.0), [0.2, 0.25, 0.3, 0.22], random_score=0.5), look=1)
    assert look.te_below_floor == ["cheetah-run", "hopper-hop", "walker-walk"]
    assert [(v.decision, v.decided_at) for v in look.variants] == [(TE_UNLEARNED, 1)] * 2
    assert look.next_seeds == {} and look.claim == NOT_ENOUGH
    assert look.ended.startswith("te's mean score is below its learning floor on cheetah-run")
