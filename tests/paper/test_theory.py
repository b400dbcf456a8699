"""Tests for qed_ray.paper.theory: Theorems 4.1-4.2 (paper Sec. 4, App. A) on finite action sets."""

import math

import numpy as np
import pytest

from qed_ray.paper import theory


def test_log_boltzmann_exact_probabilities_and_huge_values():
    # pi ∝ exp(q / alpha) with q / alpha = (0, log 3) gives (1/4, 3/4).
    lp = theory.log_boltzmann(np.array([[0.0, 2.0 * math.log(3.0)]]), np.array([2.0]))
    np.testing.assert_allclose(np.exp(lp), [[0.25, 0.75]], rtol=1e-15)
    # q / alpha = 1e8 must not overflow.
    lp = theory.log_boltzmann(np.array([1e6, 1e6 - 1e-2]), np.array(1e-2))
    np.testing.assert_allclose(np.exp(lp), [1 / (1 + math.exp(-1)), 1 / (1 + math.e)], rtol=1e-12)


def test_soft_value_is_stable_and_brackets_the_max():
    assert theory.soft_value(np.array([1000.0, 1000.0]), np.array(1.0)) == pytest.approx(1000 + math.log(2), abs=1e-12)
    q = np.array([3.0, 1.0, -2.0])
    assert theory.soft_value(q, np.array(1e-6)) == pytest.approx(3.0, abs=1e-12)
    v = theory.soft_value(q, np.array(0.7))
    assert 3.0 <= v <= 3.0 + 0.7 * math.log(3)
    assert v == pytest.approx(0.7 * math.log(sum(math.exp(x / 0.7) for x in q)), rel=1e-14)


def test_kl_categorical_matches_closed_form():
    p, q = np.array([0.25, 0.75]), np.array([0.5, 0.5])
    expected = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    assert theory.kl_categorical(np.log(p), np.log(q)) == pytest.approx(expected, rel=1e-14)
    assert theory.kl_categorical(np.log(p), np.log(p)) == 0.0


def test_disagreement_temperature_is_eq2():
    q1, q2 = np.array([0.0, 2.0, 1.0]), np.array([1.0, 0.0, 1.0])  # ||q1 - q2||_inf = 2
    assert theory.disagreement_temperature(q1, q2, 4.0, 0.1) == 0.5
    assert theory.disagreement_temperature(q1, q2, 4.0, 1.0) == 1.0


@pytest.mark.parametrize("name, kwargs", [("kappa", {"kappa": 0.0, "alpha_min": 0.1}),
                                          ("alpha_min", {"kappa": 1.0, "alpha_min": -1.0})])
def test_bad_temperature_parameters_name_the_argument(name, kwargs):
    with pytest.raises(ValueError, match=f"{name} must be finite and > 0"):
        theory.disagreement_temperature(np.zeros(2), np.ones(2), **kwargs)


def test_theorem1_holds_on_thousands_of_random_cases():
    res = theory.theorem1_check(4000, np.random.default_rng(0))
    assert res["kl_directed"].shape == (4000,)
    assert set(np.unique(res["n_actions"])) >= {2, 64}
    assert res["worst_directed"] <= 1 + 1e-9
    # The check is not vacuous: some cases come close to the 2 kappa bound.
    assert res["worst_directed"] > 0.5
    # Symmetric KL = (E_p1[d] - E_p2[d]) / 2 with |d| <= kappa, so it is even <= kappa.
    assert res["worst_symmetric"] <= 0.5 + 1e-9


def test_theorem1_fails_with_a_too_small_temperature():
    res = theory.theorem1_check(4000, np.random.default_rng(0), temperature_scale=0.05)
    assert res["worst_directed"] > 1.0
    assert (res["kl_directed"] > res["bound"]).sum() > 100


def test_theorem1_rejects_bad_arguments():
    with pytest.raises(ValueError, match="n_cases must be an integer >= 1, got 0"):
        theory.theorem1_check(0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="temperature_scale"):
        theory.theorem1_check(10, np.random.default_rng(0), temperature_scale=0.0)


def test_optimal_q_on_a_one_state_mdp():
    # Self-loop, r = (1, 0), gamma = 0.5: V* = 1 / (1 - 0.5) = 2, Q* = r + 0.5 * 2.
    mdp = theory.FiniteMDP(np.ones((1, 2, 1)), np.array([[1.0, 0.0]]), 0.5)
    np.testing.assert_allclose(theory.optimal_q(mdp), [[2.0, 1.0]], atol=1e-12)


def test_random_mdp_shapes_and_validation():
    mdp = theory.random_mdp(4, 3, 0.9, np.random.default_rng(1))
    assert mdp.transitions.shape == (4, 3, 4) and mdp.rewards.shape == (4, 3)
    np.testing.assert_allclose(mdp.transitions.sum(-1), 1.0, rtol=1e-12)
    assert mdp.rewards.min() >= 0 and mdp.rewards.max() <= 1
    with pytest.raises(ValueError, match="gamma must be in \\(0, 1\\), got 1.0"):
        theory.random_mdp(4, 3, 1.0, np.random.default_rng(1))


def test_coupled_iteration_with_equal_inits_uses_the_floor():
    mdp = theory.random_mdp(3, 2, 0.8, np.random.default_rng(2))
    q0 = np.random.default_rng(3).standard_normal((3, 2))
    iterates, alphas = theory.coupled_soft_iteration(mdp, q0, q0.copy(), kappa=1.0, alpha_min=0.05, n_iters=5)
    assert iterates.shape == (6, 2, 3, 2) and alphas.shape == (5, 3)
    np.testing.assert_array_equal(alphas, 0.05)
    np.testing.assert_array_equal(iterates[:, 0], iterates[:, 1])
    # One hand-computed soft backup.
    v = 0.05 * np.log(np.exp(q0 / 0.05).sum(axis=1))
    np.testing.assert_allclose(iterates[1, 0], mdp.rewards + 0.8 * mdp.transitions @ v, rtol=1e-12)


def test_theorem2_bound_formula():
    b = theory.theorem2_bound(np.array([2.0]), delta0=3.0, gamma=0.5, alpha_min=0.1, kappa=1.5,
                              n_actions=4, n_iters=1)
    assert b[0, 0] == 2.0
    log4 = math.log(4)
    assert b[1, 0] == pytest.approx(0.5 * 2.0 + 0.5 * 0.1 * log4 + 3.0 * log4 * 0.5 / 1.5, rel=1e-14)


def test_theorem2_and_contraction_hold_on_random_mdps():
    res = theory.theorem2_check(6, np.random.default_rng(0), n_iters=80)
    assert len(res["cases"]) == 6
    assert 0.0 < res["worst_bound"] <= 1.0
    assert 0.0 < res["worst_contraction"] <= 1.0
    for case in res["cases"]:
        # At t = 0 the bound equals the initial error exactly.
        np.testing.assert_array_equal(case["bound"][0], case["err"][0])


def test_cli_prints_ratios_and_writes_plots(tmp_path, capsys):
    worst = theory.main(["--cases", "500", "--mdps", "3", "--iters", "30", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "theorem 1 directed KL / 2kappa: worst" in out and "over 500 cases" in out
    assert worst["theorem 1 directed KL / 2kappa"] <= 1 + 1e-9
    assert worst["theorem 2 ||Q_t - Q*|| / bound"] <= 1.0
    for name in ("theorem1_kl_vs_bound.png", "theorem2_error_curves.png"):
        assert (tmp_path / name).stat().st_size > 1000
