"""benchmarks/verdict_power.py: its masked statistics against numpy on exact inputs, and the degenerate scenarios
never passing through the verdict's own rules (a few experiments; the table itself is docs/claim.md's)."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from qed_ray.analysis.verdict import PASS
from qed_ray.spec.claim import Endpoints

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def power():
    spec = importlib.util.spec_from_file_location("verdict_power", ROOT / "benchmarks" / "verdict_power.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["verdict_power"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_masked_median_and_iqm_are_numpys_on_the_kept_entries(power):
    x = np.array([[5.0, 1.0, 3.0, 2.0, 4.0, 9.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    keep = np.array([[True, True, True, True, False, False], [False] * 6])
    med = power.masked_median(x, keep)
    assert med[0] == np.median([5.0, 1.0, 3.0, 2.0]) == 2.5 and np.isnan(med[1])
    rng = np.random.default_rng(0)
    y, k = rng.random((4, 23)), rng.random((4, 23)) < 0.7
    want = [stats.trim_mean(row[m], 0.25) for row, m in zip(y, k)]
    np.testing.assert_allclose(power.masked_iqm(y, k), want, rtol=1e-12)


def test_degenerate_scenarios_never_pass(power):
    endpoints = Endpoints()
    for sc in power.SCENARIOS:
        if sc.name.startswith("D"):
            claim, variants = power.decide(sc, np.random.default_rng(1), 8, 100, endpoints)
            assert claim.shape == (8,) and variants.shape == (8, 2)
            assert not (claim == PASS).any() and not (variants == PASS).any(), sc.name
    d1 = next(sc for sc in power.SCENARIOS if sc.name.startswith("D1"))
    claim, _ = power.decide(d1, np.random.default_rng(1), 8, 100, endpoints)
    assert (claim == "not enough data").all(), "neither arm learned: nothing is judged"


def test_the_adaptive_design_never_passes_a_degenerate_scenario_and_counts_its_seeds(power):
    """Seeds by looks (10, then 15): the degenerate scenarios never pass at any look; neither arm learned ends
    growth at the first look (te below its floor), using 10 seeds of each of te and the two variants."""
    from qed_ray.spec.claim import AdaptiveSpec

    adaptive, endpoints = AdaptiveSpec(start=10, step=5, max_seeds=15), Endpoints()
    power.SEEDS = 15
    try:
        for sc in power.SCENARIOS:
            if sc.name.startswith("D"):
                claim, variants, stop, runs = power.decide_adaptive(sc, np.random.default_rng(1), 6, 100, endpoints,
                                                                     adaptive)
                assert not (claim == PASS).any() and not (variants == PASS).any(), sc.name
                assert set(stop) <= {1, 2} and ((runs >= 30) & (runs <= 45)).all(), sc.name
        d1 = next(sc for sc in power.SCENARIOS if sc.name.startswith("D1"))
        claim, variants, stop, runs = power.decide_adaptive(d1, np.random.default_rng(1), 6, 100, endpoints, adaptive)
        assert (claim == "not enough data").all() and (stop == 1).all() and (runs == 30).all()
    finally:
        power.SEEDS = power.registered_design().seeds
