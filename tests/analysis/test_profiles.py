"""Performance profiles and the probability of improvement against rliable (a dev extra): the same numbers on the
same matrices, the bands and intervals equal on the same resamples and within Monte-Carlo tolerance of rliable's own
bootstrap."""

import numpy as np
import pytest
from folder_helpers import group_result

from qed_ray.analysis import bootstrap, profiles
from qed_ray.analysis.comparisons import compare
from qed_ray.analysis.tables import sweep_results
from qed_ray.spec.sweep import FinalEvalSpec

rly = pytest.importorskip("rliable.library")
rly_metrics = pytest.importorskip("rliable.metrics")

FE = FinalEvalSpec(episodes=2, action_rollouts=2, action_steps=30, curve_episodes=1, bootstrap_reps=300,
                   confidence=0.95, seed=4)


def rliable_draws(fn, *args, seed: int):
    """rliable draws from the global numpy RNG: seed it, then restore it."""
    saved = np.random.get_state()
    np.random.seed(seed)
    try:
        return fn(*args)
    finally:
        np.random.set_state(saved)


def matrices(rng, n=5, k=4, ties=False):
    """Two (n, k) score matrices; with ``ties`` on a coarse grid, so runs tie within and across them."""
    x, y = rng.uniform(size=(n, k)), rng.uniform(size=(n, k)) * 0.9
    return (np.round(x, 1), np.round(y, 1)) if ties else (x, y)


@pytest.mark.parametrize("ties", [False, True])
def test_probability_of_improvement_is_rliables(ties):
    rng = np.random.default_rng(1)
    for _ in range(20):
        x, y = matrices(rng, n=int(rng.integers(2, 8)), ties=ties)
        y = y[: int(rng.integers(2, y.shape[0] + 1))]  # other run counts too
        ours = profiles.mean_probability_of_improvement(list(x.T), list(y.T))
        assert ours == pytest.approx(rly_metrics.probability_of_improvement(x, y), abs=1e-12)
    same = np.array([[0.1, 0.5], [0.3, 0.5]])
    assert profiles.mean_probability_of_improvement(list(same.T), list(same.T)) == 0.5 == \
        rly_metrics.probability_of_improvement(same, same)


def _groups(x, y, seeds_y=None):
    tasks = [f"t{k}" for k in range(x.shape[1])]
    te = [group_result(t, scores=tuple(x[:, k])) for k, t in enumerate(tasks)]
    qed = [group_result(t, variant="qed0.2", scores=tuple(y[:, k]), seeds=seeds_y or list(range(len(y))))
           for k, t in enumerate(tasks)]
    return te, qed


def test_paired_interval_is_rliables_metric_on_the_same_resamples():
    x, y = matrices(np.random.default_rng(2), ties=True)
    te, qed = _groups(x, y)
    c = compare(te, qed, FE, lambda stat, g: None)
    assert c.pairing == "paired"
    assert c.prob_improvement.value == pytest.approx(rly_metrics.probability_of_improvement(y, x), abs=1e-12)
    # The comparison's draws, rebuilt: per task one stream of joint seed counts for both variants.
    reps = []
    per_task = []
    for k, g in enumerate(te):
        rng = bootstrap.rng_for(FE.seed, "paired", g.task, g.agent, *map(str, g.seeds))
        counts = bootstrap.joint_counts(len(g.seeds), FE.bootstrap_reps, rng)
        per_task.append((bootstrap.resample(y[:, k], counts), bootstrap.resample(x[:, k], counts)))
    for r in range(FE.bootstrap_reps):
        reps.append(rly_metrics.probability_of_improvement(np.stack([t[0][r] for t in per_task], 1),
                                                           np.stack([t[1][r] for t in per_task], 1)))
    lo, hi = np.percentile(reps, [2.5, 97.5])
    assert (c.prob_improvement.lower, c.prob_improvement.upper) == pytest.approx((lo, hi), abs=1e-12)


def test_unpaired_interval_is_rliables_within_monte_carlo_tolerance():
    x, y = matrices(np.random.default_rng(3), n=8, k=3)
    te, qed = _groups(x, y, seeds_y=list(range(10, 18)))
    fe = FE.model_copy(update={"bootstrap_reps": 4000})
    c = compare(te, qed, fe, lambda stat, g: None)
    assert c.pairing == "unpaired"
    # rliable's independent stratified bootstrap (its RNG) with the metric shown equal to its own above (scipy's
    # Mann-Whitney U per resample and task would take half a minute here).
    point, ci = rliable_draws(lambda: rly.get_interval_estimates(
        {"p": [y, x]}, lambda a, b: np.array([profiles.mean_probability_of_improvement(list(a.T), list(b.T))]),
        reps=4000), seed=0)
    assert c.prob_improvement.value == pytest.approx(point["p"][0], abs=1e-12)
    np.testing.assert_allclose([c.prob_improvement.lower, c.prob_improvement.upper], ci["p"][:, 0], atol=0.02)


def test_performance_profile_is_rliables_on_the_same_resamples_and_within_tolerance_of_its_own():
    x, _ = matrices(np.random.default_rng(5), n=6, k=4, ties=True)
    te, _ = _groups(x, x)
    (p,) = sweep_results("s", FE, te, [], 24).performance_profiles
    taus = np.asarray(profiles.TAUS)
    assert (p.n_tasks, p.n_runs, len(p.taus)) == (4, 24, 101) and p.taus[:3] == [0.0, 0.01, 0.02]
    point, _ = rly.create_performance_profile({"te": x}, taus, reps=2)
    np.testing.assert_array_equal(p.fraction, point["te"])
    # The same resamples through rliable's profile function (run_score_deviation over the resampled matrix).
    per_task = list(x.T)
    idx = profiles.resample_indices(per_task, FE.bootstrap_reps, bootstrap.rng_for(FE.seed, "profile", "sac_ln", "te"))
    theirs = np.stack([rly.score_distributions(np.stack([t[i[r]] for t, i in zip(per_task, idx)], 1), taus)
                       for r in range(FE.bootstrap_reps)])
    lo, hi = np.percentile(theirs, [2.5, 97.5], axis=0)
    np.testing.assert_allclose(p.ci_lower, lo, atol=1e-12)
    np.testing.assert_allclose(p.ci_upper, hi, atol=1e-12)
    # rliable's own bootstrap (its RNG): the band within Monte-Carlo tolerance.
    fe = FE.model_copy(update={"bootstrap_reps": 2000})
    (big,) = sweep_results("s", fe, te, [], 24).performance_profiles
    _, ci = rliable_draws(lambda: rly.create_performance_profile({"te": x}, taus, reps=2000), seed=1)
    np.testing.assert_allclose(big.ci_lower, ci["te"][0], atol=0.05)
    np.testing.assert_allclose(big.ci_upper, ci["te"][1], atol=0.05)


def test_unequal_seed_counts_keep_each_tasks_count():
    per_task = [np.array([0.2, 0.8]), np.array([0.1, 0.5, 0.9])]
    assert profiles.score_profile(per_task, [0.0, 0.5, 0.85]).tolist() == [1.0, 0.4, 0.2]
    idx = profiles.resample_indices(per_task, 50, np.random.default_rng(0))
    assert [i.shape for i in idx] == [(50, 2), (50, 3)]
    reps = profiles.profile_replicates(per_task, idx, [0.0, 0.5])
    want = [np.mean(np.concatenate([t[i[r]] for t, i in zip(per_task, idx)]) > 0.5) for r in range(50)]
    np.testing.assert_allclose(reps[:, 1], want, atol=1e-12) and np.testing.assert_array_equal(reps[:, 0], 1.0)
