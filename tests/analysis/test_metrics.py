"""Tests for qed_ray.analysis.metrics: hand-computed cases, invariants and independent references."""

import numpy as np
import pytest
import scipy.stats

from qed_ray.analysis import bootstrap, metrics


def _random_gaussians(rng, shape):
    """Random means and positive stds of the given shape."""
    return rng.normal(size=shape), np.exp(rng.uniform(-2.0, 1.0, size=shape))


# --------------------------------------------------------------------------- symmetric KL


def test_symmetric_kl_matches_torch_both_directions():
    torch = pytest.importorskip("torch")
    from torch.distributions import Independent, Normal, kl_divergence

    rng = np.random.default_rng(0)
    mu_p, s_p = _random_gaussians(rng, (64, 6))
    mu_q, s_q = _random_gaussians(rng, (64, 6))

    def dist(mu, s):
        return Independent(Normal(torch.tensor(mu), torch.tensor(s)), 1)

    p, q = dist(mu_p, s_p), dist(mu_q, s_q)
    expected = (0.5 * (kl_divergence(p, q) + kl_divergence(q, p))).numpy()
    got = metrics.symmetric_kl(mu_p, s_p, mu_q, s_q)
    assert got.shape == (64,) and got.dtype == np.float64
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=0)


def test_symmetric_kl_hand_case():
    # Dim 0: unit stds, means 0 vs 3 -> 0.25 * 9 * (1 + 1) = 4.5.
    # Dim 1: equal means, stds 1 vs 2 -> 0.25 * (1/4 + 4 - 2) = 0.5625.
    got = metrics.symmetric_kl([0.0, 5.0], [1.0, 1.0], [3.0, 5.0], [1.0, 2.0])
    assert got.shape == ()
    assert float(got) == 4.5 + 0.5625


def test_symmetric_kl_symmetric_zero_and_nonnegative():
    rng = np.random.default_rng(1)
    mu_p, s_p = _random_gaussians(rng, (5, 7, 4))
    mu_q, s_q = _random_gaussians(rng, (5, 7, 4))
    forward = metrics.symmetric_kl(mu_p, s_p, mu_q, s_q)
    np.testing.assert_array_equal(forward, metrics.symmetric_kl(mu_q, s_q, mu_p, s_p))
    assert np.all(forward >= 0.0) and forward.shape == (5, 7)
    np.testing.assert_array_equal(metrics.symmetric_kl(mu_p, s_p, mu_p, s_p), np.zeros((5, 7)))
    # Nearly identical inputs: cancellation must never produce a negative value.
    near = metrics.symmetric_kl(mu_p, s_p, mu_p * (1 + 1e-15), s_p * (1 + 1e-15))
    assert np.all(near >= 0.0)


def test_symmetric_kl_floors_tiny_sigma():
    tiny = metrics.symmetric_kl([0.0], [1e-12], [0.0], [1e-9])
    assert float(tiny) == 0.0  # both floored to SIGMA_FLOOR -> identical
    expected = 0.25 * (1.0 / metrics.SIGMA_FLOOR**2) * 2  # d = 1, both stds at the floor
    np.testing.assert_allclose(metrics.symmetric_kl([0.0], [1e-9], [1.0], [1e-9]), expected, rtol=1e-12)


# --------------------------------------------------------------------------- divergence and V


def test_variability_hand_built_three_policies():
    # 1-D Gaussians, unit stds, means 0, 1, 2 on both of 2 states: sym KL = d^2 / 2, so
    # D(0,1) = D(1,2) = 0.5, D(0,2) = 2.0; V = (0.5 + 0.5 + 2.0) * 2 / 6 = 1.0.
    mus = np.array([[[0.0], [0.0]], [[1.0], [1.0]], [[2.0], [2.0]]])
    sigmas = np.ones_like(mus)
    expected_d = np.array([[0.0, 0.5, 2.0], [0.5, 0.0, 0.5], [2.0, 0.5, 0.0]])
    np.testing.assert_array_equal(metrics.pairwise_policy_divergence(mus, sigmas), expected_d)
    assert metrics.inter_run_variability(mus, sigmas) == 1.0
    assert metrics.variability_from_matrix(expected_d) == 1.0


def test_variability_hand_built_state_dependent():
    # Policy 1 has std 2 on state 0 (0.25 * (4 + 1/4 - 2) = 0.5625) and mean 2 on state 1
    # (0.25 * 4 * 2 = 2.0): D(0,1) = (0.5625 + 2.0) / 2 = 1.28125; V with I = 2 equals D(0,1).
    mus = np.array([[[0.0], [0.0]], [[0.0], [2.0]]])
    sigmas = np.array([[[1.0], [1.0]], [[2.0], [1.0]]])
    assert metrics.inter_run_variability(mus, sigmas) == 1.28125


def test_pairwise_divergence_matches_per_pair_kl_and_is_chunk_invariant():
    rng = np.random.default_rng(2)
    mus, sigmas = _random_gaussians(rng, (4, 37, 3))
    full = metrics.pairwise_policy_divergence(mus, sigmas)
    naive = np.array([[metrics.symmetric_kl(mus[i], sigmas[i], mus[j], sigmas[j]).mean()
                       for j in range(4)] for i in range(4)])
    np.testing.assert_allclose(full, naive, rtol=1e-12)
    np.testing.assert_array_equal(full, full.T)
    np.testing.assert_array_equal(np.diag(full), np.zeros(4))
    for chunk in (1, 12, 100):  # 1 state per chunk, several chunks, uneven last chunk
        np.testing.assert_allclose(
            metrics.pairwise_policy_divergence(mus, sigmas, chunk_elements=chunk), full, rtol=1e-12)
    v = metrics.inter_run_variability(mus, sigmas)
    np.testing.assert_allclose(v, naive[~np.eye(4, dtype=bool)].mean(), rtol=1e-12)


def test_pairwise_divergence_float32_inputs_accumulate_in_float64():
    rng = np.random.default_rng(3)
    mus, sigmas = _random_gaussians(rng, (3, 20, 2))
    mus32, sigmas32 = mus.astype(np.float32), sigmas.astype(np.float32)
    got = metrics.pairwise_policy_divergence(mus32, sigmas32)
    ref = metrics.pairwise_policy_divergence(mus32.astype(np.float64), sigmas32.astype(np.float64))
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, ref)


def test_pool_states_concatenates_and_flattens():
    a = np.arange(12.0).reshape(2, 3, 2)  # 2 episodes x 3 steps x obs_dim 2
    b = np.arange(4.0).reshape(2, 2) + 100
    pooled = metrics.pool_states([a, b])
    assert pooled.shape == (8, 2)
    np.testing.assert_array_equal(pooled[:6], a.reshape(6, 2))
    np.testing.assert_array_equal(pooled[6:], b)


# --------------------------------------------------------------------------- IQM and bootstrap


def test_iqm_hand_cases():
    # 8 entries -> drop int(0.25 * 8) = 2 each end. Sorted 1 1 2 3 4 5 6 9 -> mean(2,3,4,5) = 3.5.
    assert metrics.iqm(np.array([[3, 1], [4, 1], [5, 9], [2, 6]])) == 3.5
    # rliable's metrics_test case: [[1,2],[3,4],[5,6],[7,8]] -> mean(3,4,5,6) = 4.5.
    assert metrics.iqm(np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])) == 4.5
    # 6 entries -> drop int(1.5) = 1 each end: sorted 0 1 10 20 30 1000 -> mean(1,10,20,30) = 15.25.
    assert metrics.iqm(np.array([[0, 10], [1000, 20], [1, 30]])) == 15.25
    assert metrics.iqm(np.array([[7.0]])) == 7.0


def test_iqm_equals_scipy_trim_mean_exactly():
    rng = np.random.default_rng(4)
    for shape in [(10, 18), (3, 5), (7, 1), (1, 9), (50, 18)]:
        x = rng.normal(size=shape)
        assert metrics.iqm(x) == scipy.stats.trim_mean(x, 0.25, axis=None)


def test_bootstrap_ci_properties():
    rng = np.random.default_rng(5)
    scores = rng.uniform(size=(10, 6))
    lower, upper = bootstrap.stratified_bootstrap_ci(scores, reps=1000, seed=7)
    assert lower < metrics.iqm(scores) < upper
    assert (lower, upper) == bootstrap.stratified_bootstrap_ci(scores, reps=1000, seed=7)
    assert (lower, upper) != bootstrap.stratified_bootstrap_ci(scores, reps=1000, seed=8)
    # Vectorised IQM path equals applying the statistic rep by rep on the same resamples.
    looped = bootstrap.stratified_bootstrap_ci(scores, lambda m: metrics.iqm(m), reps=1000, seed=7)
    np.testing.assert_allclose(looped, (lower, upper), rtol=1e-12)
    est = bootstrap.interval_estimate(scores, reps=1000, seed=7)
    assert est == {"point": metrics.iqm(scores), "lower": lower, "upper": upper, "width": upper - lower}


def test_bootstrap_ci_shrinks_with_more_runs():
    rng = np.random.default_rng(6)
    few, many = rng.normal(size=(5, 4)), rng.normal(size=(50, 4))
    width_few = bootstrap.ci_width(*bootstrap.stratified_bootstrap_ci(few, reps=2000))
    width_many = bootstrap.ci_width(*bootstrap.stratified_bootstrap_ci(many, reps=2000))
    assert width_many < 0.6 * width_few  # ~1/sqrt(10) expected


def test_bootstrap_resamples_within_tasks_only():
    # Task 0 scores are all 0 and task 1 all 1: any mixing across columns would change the
    # column means, so a within-task resample keeps the per-task mean statistic fixed at 0 and 1.
    scores = np.array([[0.0, 1.0]] * 4)
    for col in (0, 1):
        lo, hi = bootstrap.stratified_bootstrap_ci(scores, lambda m, c=col: m[:, c].mean(), reps=200)
        assert lo == hi == float(col)


def test_iqm_and_ci_match_rliable():
    pytest.importorskip("rliable")
    from rliable import library as rly
    from rliable import metrics as rly_metrics

    rng = np.random.default_rng(8)
    for trial in range(2):
        scores = rng.uniform(size=(10, 18))
        assert metrics.iqm(scores) == rly_metrics.aggregate_iqm(scores)
        reps = 5000
        # rliable's StratifiedBootstrap draws from the global numpy RNG: seed it, then restore it.
        saved = np.random.get_state()
        np.random.seed(trial)
        try:
            _, intervals = rly.get_interval_estimates(
                {"m": scores}, lambda x: np.array([rly_metrics.aggregate_iqm(x)]),
                reps=reps, confidence_interval_size=0.95, method="percentile")
        finally:
            np.random.set_state(saved)
        theirs = intervals["m"][:, 0]
        ours = bootstrap.stratified_bootstrap_ci(scores, reps=reps, seed=trial)
        tolerance = 0.01 * np.ptp(scores)
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=tolerance)


# --------------------------------------------------------------------------- action distance


def test_cumulative_action_distance_matches_naive_loops():
    rng = np.random.default_rng(9)
    actions = rng.uniform(-1, 1, size=(4, 3, 5, 2))
    n_pol, n_traj, n_steps, _ = actions.shape
    total, count = 0.0, 0
    for i in range(n_pol):
        for j in range(i + 1, n_pol):
            for t in range(n_traj):
                total += sum(np.sqrt(np.sum((actions[i, t, step] - actions[j, t, step]) ** 2))
                             for step in range(n_steps))
                count += 1
    np.testing.assert_allclose(metrics.cumulative_action_distance(actions), total / count, rtol=1e-12)


def test_per_step_pairwise_distance_hand_case():
    # 3 policies at one step in 2-D: (0,0), (3,4), (0,4) -> distances 5, 4, 3 -> mean 4.
    x = np.array([[0.0, 0.0], [3.0, 4.0], [0.0, 4.0]]).reshape(3, 1, 1, 2)
    np.testing.assert_array_equal(metrics.per_step_pairwise_distance(x), [[4.0]])
    assert metrics.cumulative_action_distance(np.repeat(x, 3, axis=2)) == 12.0


# --------------------------------------------------------------------------- scores and fits


def test_normalized_score():
    np.testing.assert_array_equal(metrics.normalized_score([0, 500, 1000]), [0.0, 0.5, 1.0])


def test_r_squared_hand_case_and_linregress():
    # x = 0..3, y = 1,3,2,5: means 1.5, 2.75; Sxx = 5, Sxy = (-1.5)(-1.75) + (-0.5)(0.25)
    # + (0.5)(-0.75) + (1.5)(2.25) = 2.625 - 0.125 - 0.375 + 3.375 = 5.5, Syy = 8.75.
    # slope = 1.1, intercept = 2.75 - 1.65 = 1.1, R^2 = 5.5^2 / (5 * 8.75) = 30.25 / 43.75.
    x, y = [0.0, 1.0, 2.0, 3.0], [1.0, 3.0, 2.0, 5.0]
    np.testing.assert_allclose(metrics.r_squared(x, y), 30.25 / 43.75, rtol=1e-14)
    np.testing.assert_allclose(metrics.linear_fit(x, y), (1.1, 1.1), rtol=1e-14)
    rng = np.random.default_rng(10)
    xr = rng.normal(size=30)
    yr = 2 * xr + rng.normal(size=30)
    ref = scipy.stats.linregress(xr, yr)
    np.testing.assert_allclose(metrics.r_squared(xr, yr), ref.rvalue**2, rtol=1e-12)
    np.testing.assert_allclose(metrics.linear_fit(xr, yr), (ref.slope, ref.intercept), rtol=1e-12)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: metrics.symmetric_kl(np.zeros((10, 6)), np.ones((10, 6)), np.zeros((10, 6)),
                                      np.ones((10, 5))), r"sigma_q: expected shape \(10, 6\) matching mu_p"),
        (lambda: metrics.symmetric_kl([np.nan, 0.0, np.inf, 1.0], np.ones(4), np.zeros(4), np.ones(4)),
         "mu_p: contains 2 non-finite values"),
        (lambda: metrics.symmetric_kl(np.zeros(2), [1.0, -0.1], np.zeros(2), np.ones(2)),
         "sigma_p: contains 1 values <= 0"),
        (lambda: metrics.symmetric_kl(np.zeros(2), np.ones(2), np.zeros(2), [0.0, 1.0]), "sigma_q"),
        (lambda: metrics.pairwise_policy_divergence(np.zeros((2, 3)), np.ones((2, 3))),
         "mus: expected 3 dimensions"),
        (lambda: metrics.pairwise_policy_divergence(np.zeros((2, 3, 1)), np.ones((2, 4, 1))),
         "sigmas: expected shape"),
        (lambda: metrics.pairwise_policy_divergence(np.zeros((2, 3, 1)), -np.ones((2, 3, 1))), "sigmas"),
        (lambda: metrics.pairwise_policy_divergence(np.zeros((2, 3, 1)), np.ones((2, 3, 1)),
                                                    chunk_elements=0), "chunk_elements"),
        (lambda: metrics.inter_run_variability(np.zeros((1, 3, 1)), np.ones((1, 3, 1))), "mus: need at least 2"),
        (lambda: metrics.variability_from_matrix(np.zeros((2, 3))), "divergence"),
        (lambda: metrics.pool_states([np.zeros((3, 4)), np.zeros((2, 5))]), r"per_policy_states\[1\]"),
        (lambda: metrics.pool_states([]), "per_policy_states"),
        (lambda: metrics.iqm(np.zeros(5)), "scores: expected 2 dimensions"),
        (lambda: metrics.iqm([[1.0, np.nan]]), "scores: contains 1 non-finite"),
        (lambda: bootstrap.stratified_bootstrap_ci(np.zeros((3, 2)), confidence=1.5), "confidence"),
        (lambda: bootstrap.stratified_bootstrap_ci(np.zeros((3, 2)), reps=0), "reps"),
        (lambda: bootstrap.ci_width(2.0, 1.0), "upper"),
        (lambda: metrics.cumulative_action_distance(np.zeros((1, 2, 3, 4))), "x: need at least 2"),
        (lambda: metrics.cumulative_action_distance(np.zeros((2, 3, 4))), "x: expected 4 dimensions"),
        (lambda: metrics.normalized_score([1200.0]), "returns"),
        (lambda: metrics.r_squared([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]), "x: all values equal"),
        (lambda: metrics.r_squared([1.0], [1.0]), "x: need at least 2"),
        (lambda: metrics.r_squared([1.0, 2.0], [1.0, 2.0, 3.0]), "y: expected shape"),
        (lambda: metrics.r_squared([1.0, 2.0], [3.0, 3.0]), "y: all values equal"),
    ],
)
def test_bad_inputs_raise_value_error_naming_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()
