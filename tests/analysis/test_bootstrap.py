"""Bootstrap intervals over seeds (qed_ray/bootstrap.py): hand-computed pair means, self-pairs left out, V's
interval contains V and shrinks with more seeds, the ragged IQM interval matches the rectangular one."""

import numpy as np
import pytest

from qed_ray.analysis import bootstrap, metrics

D3 = np.array([[0.0, 1.0, 2.0], [1.0, 0.0, 4.0], [2.0, 4.0, 0.0]])


def test_pair_mean_hand_cases():
    assert bootstrap.pair_mean(D3) == pytest.approx(7 / 3)  # (1 + 2 + 4) * 2 ordered pairs / 6
    counts = np.array([[1, 1, 1], [2, 1, 0], [1, 0, 2], [0, 3, 0]])
    # [2, 1, 0]: draws (0, 0, 1): the two (0, 1) pairs in both orders, 2*1*D01*2 / (9 - 5) = 1
    # [1, 0, 2]: draws (0, 2, 2): 1*2*D02*2 / (9 - 5) = 2; [0, 3, 0]: one seed three times: no pair at all
    with np.errstate(invalid="ignore"):
        got = bootstrap.pair_mean(D3, counts)
    assert got[:3] == pytest.approx([7 / 3, 1.0, 2.0]) and np.isnan(got[3])


def test_diagonal_is_never_used():
    noisy = D3 + np.diag([5.0, 6.0, 7.0])
    counts = bootstrap.seed_counts(3, 50, np.random.default_rng(0), min_distinct=2)
    assert bootstrap.pair_mean(noisy) == bootstrap.pair_mean(D3)
    np.testing.assert_array_equal(bootstrap.pair_mean(noisy, counts), bootstrap.pair_mean(D3, counts))


def test_resamples_of_a_single_seed_are_drawn_again():
    counts = bootstrap.seed_counts(2, 1000, np.random.default_rng(1), min_distinct=2)
    assert (counts == 1).all(), "with 2 seeds the only resample with a pair is both seeds once"
    counts = bootstrap.seed_counts(3, 5000, np.random.default_rng(2), min_distinct=2)
    assert (np.count_nonzero(counts, axis=1) >= 2).all() and (counts.sum(axis=1) == 3).all()
    reps = bootstrap.pair_mean_replicates(D3, 5000, np.random.default_rng(2))
    assert np.isfinite(reps).all() and reps.min() >= 1.0 and reps.max() <= 4.0
    with pytest.raises(ValueError, match="n_seeds: 1 seeds cannot give 2 distinct draws"):
        bootstrap.seed_counts(1, 10, np.random.default_rng(0), min_distinct=2)


def _divergences(n_seeds: int, rng) -> np.ndarray:
    """A realistic D: seeds' policies as random points, D = squared distance (symmetric, 0 diagonal)."""
    x = rng.normal(size=(n_seeds, 4))
    return ((x[:, None] - x[None]) ** 2).sum(-1)


def test_v_interval_contains_v_and_shrinks_with_more_seeds():
    widths = {}
    for n in (5, 20, 80):
        d = _divergences(n, np.random.default_rng(n))
        v, lo, hi = bootstrap.pair_mean_interval(d, 2000, 0.95, np.random.default_rng(0))
        assert v == pytest.approx(metrics.variability_from_matrix(d)) and lo <= v <= hi
        widths[n] = hi - lo
    assert widths[5] > widths[20] > widths[80] > 0
    assert widths[5] / widths[80] > 2.5  # ~ sqrt(80 / 5) = 4 for a mean over seeds


def test_two_seeds_give_the_single_pair_as_interval():
    d = np.array([[0.0, 0.3], [0.3, 0.0]])
    assert bootstrap.pair_mean_interval(d, 200, 0.9, np.random.default_rng(0)) == (0.3, 0.3, 0.3)


def test_variance_and_percentiles():
    assert bootstrap.across_seed_variance(np.array([[1.0, 2.0, 3.0], [2.0, 2.0, 2.0]])).tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="at least 2 seeds"):
        bootstrap.across_seed_variance(np.array([1.0]))
    lo, hi = bootstrap.percentile_interval([np.nan, *range(101)], 0.9)
    assert (lo, hi) == pytest.approx((5.0, 95.0))
    assert all(np.isnan(bootstrap.percentile_interval([np.nan], 0.9)))


def test_iqm_interval_equal_counts_is_rliables_estimate():
    scores = np.random.default_rng(3).uniform(size=(5, 4))
    got = bootstrap.iqm_interval([scores[:, t] for t in range(4)], 500, 0.95, 7)
    assert got == bootstrap.interval_estimate(scores, metrics.iqm, 500, 0.95, 7)


def test_iqm_interval_keeps_every_seed_of_unequal_tasks():
    per_task = [np.array([0.1, 0.1]), np.array([0.9, 0.9, 0.9])]  # constant within each task
    got = bootstrap.iqm_interval(per_task, 300, 0.95, 0)
    pooled = metrics.iqm(np.array([[0.1, 0.1, 0.9, 0.9, 0.9]]))
    assert got["point"] == pooled == pytest.approx(0.9 * 2 / 3 + 0.1 / 3)  # all 5 runs, no cut to 2 seeds
    assert got["lower"] == got["upper"] == pytest.approx(pooled), "resamples stay within each task"


def test_streams_are_reproducible_and_independent():
    a = bootstrap.rng_for(0, "V", "cheetah-run").integers(0, 1 << 30, 4)
    assert (a == bootstrap.rng_for(0, "V", "cheetah-run").integers(0, 1 << 30, 4)).all()
    assert (a != bootstrap.rng_for(0, "V", "walker-walk").integers(0, 1 << 30, 4)).any()


def test_pairwise_action_distance_matches_the_cumulative_distance():
    actions = np.random.default_rng(4).normal(size=(3, 2, 5, 2))
    m = metrics.pairwise_action_distance(actions)
    assert np.allclose(m, m.T) and (np.diag(m) == 0).all()
    assert m[0, 2] == pytest.approx(np.mean([np.linalg.norm(actions[0, t] - actions[2, t], axis=-1).sum()
                                             for t in range(2)]))
    assert bootstrap.pair_mean(m) == pytest.approx(metrics.cumulative_action_distance(actions))
