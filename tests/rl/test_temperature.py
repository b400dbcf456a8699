"""Temperature rules: the expectile, QED's clipping and scaling, gradient isolation (docs/definitions.md, paper Sec. 5.1)."""

import numpy as np
import pytest
import torch

from qed_ray.spec.config import TemperatureSpec
from qed_ray.rl.temperature import (QEDTemperature, TargetEntropyTemperature, expectile, make_temperature,
                                 qed_disagreement, temperature_state)


def brute_force_expectile(x: np.ndarray, tau: float) -> float:
    """argmin_m sum |tau - 1[x < m]| (x - m)^2 on a fine grid, refined once."""
    def loss(m):
        w = np.where(x[None, :] < m[:, None], 1 - tau, tau)
        return (w * (x[None, :] - m[:, None]) ** 2).sum(1)
    grid = np.linspace(x.min(), x.max(), 20001)
    m0 = grid[np.argmin(loss(grid))]
    fine = np.linspace(m0 - 1e-3 * (np.ptp(x) + 1e-12), m0 + 1e-3 * (np.ptp(x) + 1e-12), 20001)
    return float(fine[np.argmin(loss(fine))])


@pytest.mark.parametrize("tau", [0.1, 0.5, 0.7, 0.9, 0.99])
def test_expectile_matches_brute_force(tau):
    rng = np.random.default_rng(int(tau * 100))
    x = rng.exponential(size=(20, 8))
    got = expectile(torch.as_tensor(x), tau).numpy()
    for row, g in zip(x, got):
        assert g == pytest.approx(brute_force_expectile(row, tau), abs=1e-6 * (np.ptp(row) + 1))


def test_expectile_half_is_mean_and_monotone_and_bounded():
    x = torch.randn(100, 8, dtype=torch.float64)
    torch.testing.assert_close(expectile(x, 0.5), x.mean(-1))
    taus = [0.05, 0.3, 0.5, 0.8, 0.9, 0.99]
    vals = torch.stack([expectile(x, t) for t in taus])
    assert torch.all(vals[1:] >= vals[:-1] - 1e-12)
    assert torch.all(vals >= x.min(-1).values - 1e-12) and torch.all(vals <= x.max(-1).values + 1e-12)


def test_expectile_of_constant_and_ties():
    x = torch.tensor([[2.0] * 8, [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    e = expectile(x, 0.9)
    assert e[0] == 2.0
    assert e[1] == pytest.approx(0.9 * 4 / (0.1 * 4 + 0.9 * 4))  # weighted mean with weights 0.1 / 0.9


def bisection_expectile(x: np.ndarray, tau: float) -> np.ndarray:
    """Float64 bisection per row on the expectile's first-order condition (increasing in m): the reference for
    inputs whose expectile falls on a sample, where a grid would only land near it. x: [..., N] -> [...]."""
    lo, hi = x.min(-1), x.max(-1)
    for _ in range(80):
        m = 0.5 * (lo + hi)
        grad = (np.where(x < m[..., None], 1 - tau, tau) * (m[..., None] - x)).sum(-1)
        lo, hi = np.where(grad < 0, m, lo), np.where(grad < 0, hi, m)
    return 0.5 * (lo + hi)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_expectile_on_a_sample_is_that_sample_not_the_mean(dtype):
    # tau 0.7: 0.3 * sum(x_i - 0.7 below) + 0.7 * sum(x_i - 0.7 above) = 0.3 * -4.9 + 0.7 * 2.1 = 0 exactly, so the
    # expectile is the sample 0.7; rounding put both of its brackets' candidates outside (the mean, 0.35, came back).
    x = np.array([-1, -0.8, -0.7, 0.5, 0.6, 0.7, 1.3, 2.2])
    assert bisection_expectile(x, 0.7) == pytest.approx(0.7, abs=1e-12)
    got = float(expectile(torch.tensor(x, dtype=dtype), 0.7))
    assert got == pytest.approx(0.7, abs=1e-6 if dtype == torch.float32 else 1e-12)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-9)])
def test_expectile_matches_bisection_on_quantised_inputs(dtype, tol):
    # On a 0.1 grid the expectile often falls on a sample: before the fix about 1 row in 2000 came back as the mean.
    x = np.round(np.random.default_rng(7).normal(size=(10000, 8)), 1)
    for tau in (0.7, 0.9):
        got = expectile(torch.tensor(x, dtype=dtype), tau).double().numpy()
        want = bisection_expectile(x, tau)
        assert np.abs(got - want).max() <= tol * (1 + np.abs(want).max())
        assert (got >= x.min(-1) - tol).all() and (got <= x.max(-1) + tol).all()


def _qed(k=0.2, action_dim=3, alpha_max=0.2, init_alpha=0.01):
    spec = TemperatureSpec(kind="qed", k=k, alpha_max=alpha_max, init_alpha=init_alpha)
    return QEDTemperature(action_dim, spec)


def _alpha(rule, states, q_pair, action_dim=3, policy=None):
    """QED alpha at ``states`` [B, D] with a policy (default: mu = 0, sigma = 1) and a q_pair(s, a, repeats)."""
    policy = policy or (lambda s: (torch.zeros(s.shape[0], action_dim), torch.zeros(s.shape[0], action_dim)))
    eps = torch.randn(states.shape[0] * rule.n_actions, action_dim, generator=torch.Generator().manual_seed(0))
    delta = qed_disagreement(policy, q_pair, states, eps, rule.n_actions, rule.tau)
    return rule.alpha(temperature_state(rule), states.shape[0], delta)


def _by_state(f):
    """A q_pair whose value depends on the state only, at every one of the ``repeats`` actions per state."""
    return lambda s, a, r: tuple(v.repeat_interleave(r, 0) for v in f(s))


def test_qed_equals_floor_when_critics_agree():
    t = _qed()
    s = torch.randn(16, 5)
    a = _alpha(t, s, _by_state(lambda x: (x.sum(-1), x.sum(-1))))
    torch.testing.assert_close(a, torch.full((16,), 0.01))


def test_qed_equals_alpha_max_when_critics_disagree_hugely():
    t = _qed()
    s = torch.randn(16, 5)
    a = _alpha(t, s, _by_state(lambda x: (x.sum(-1) + 1e6, x.sum(-1))))
    torch.testing.assert_close(a, torch.full((16,), 0.2))


@pytest.mark.parametrize("k,action_dim", [(0.1, 1), (0.2, 3), (0.4, 6)])
def test_qed_scales_as_one_over_k_times_action_dim(k, action_dim):
    t = _qed(k=k, action_dim=action_dim, alpha_max=10.0, init_alpha=1e-6)
    gap = torch.linspace(0.01, 0.5, 16)
    s = gap[:, None].expand(16, 5).contiguous()
    # constant gap per state over all N samples: the expectile is the gap itself
    a = _alpha(t, s, _by_state(lambda x: (x[:, 0], torch.zeros(x.shape[0]))), action_dim)
    torch.testing.assert_close(a, gap / (k * action_dim))


def test_qed_floor_wins_over_cap():
    t = _qed(init_alpha=0.5, alpha_max=0.2)
    a = _alpha(t, torch.randn(4, 5), _by_state(lambda x: (x.sum(-1) + 100, x.sum(-1))))
    torch.testing.assert_close(a, torch.full((4,), 0.5))


@pytest.mark.parametrize("share", [True, False])
def test_qed_reads_n_policy_samples_per_state_in_state_major_order(share):
    t = _qed()
    b, n, action_dim = 3, t.n_actions, 2
    states = torch.arange(b, dtype=torch.float64)[:, None] * torch.ones(1, 4, dtype=torch.float64)
    mu, log_std = torch.full((b, action_dim), 0.1, dtype=torch.float64), torch.full((b, action_dim), -1.0,
                                                                                     dtype=torch.float64)
    eps = torch.randn(b * n, action_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    seen = {}

    def policy(s):
        seen["policy_rows"] = s.shape[0]
        return mu[:1].expand(s.shape[0], -1), log_std[:1].expand(s.shape[0], -1)

    def q_pair(s, a, r):
        seen["states"], seen["actions"], seen["repeats"] = s.shape[0], a, r
        q1 = a[:, 0] * 10  # |Q1 - Q2| = 10 |a_0|: Delta is the expectile of the first action component
        return q1, torch.zeros_like(q1)

    delta = qed_disagreement(policy, q_pair, states, eps, n, 0.9, share_state_terms=share)
    assert seen["policy_rows"] == (b if share else b * n) and seen["states"] == (b if share else b * n)
    assert seen["repeats"] == (n if share else 1)
    actions = torch.tanh(0.1 + np.exp(-1.0) * eps)
    torch.testing.assert_close(seen["actions"], actions, rtol=1e-15, atol=1e-15)
    for i in range(b):  # state i's samples are rows i*n .. i*n+n-1
        torch.testing.assert_close(delta[i], expectile(10 * actions[i * n:(i + 1) * n, 0].abs(), 0.9))


def test_no_gradient_reaches_critics_or_actor_through_alpha():
    t = _qed()
    critic = torch.nn.Linear(5 + 3, 2)
    actor = torch.nn.Linear(5, 6)
    s = torch.randn(8, 5)
    a = _alpha(t, s, lambda x, u, r: critic(torch.cat([x.repeat_interleave(r, 0), u], -1)).unbind(-1),
               policy=lambda x: actor(x).chunk(2, -1))
    assert not a.requires_grad
    assert all(p.grad is None for p in critic.parameters()) and all(p.grad is None for p in actor.parameters())


def test_target_entropy_loss_pushes_alpha_toward_target():
    t = TargetEntropyTemperature(action_dim=2, init_alpha=0.1)
    opt = torch.optim.SGD(t.parameters(), lr=0.1)
    # entropy above target (-log pi = 5 > -2): alpha should decrease
    loss = t.loss(temperature_state(t), torch.full((10,), -5.0))
    loss.backward()
    opt.step()
    assert t.floor(temperature_state(t)) < 0.1
    assert t.target_entropy == -2.0


def test_fixed_and_factory():
    f = make_temperature(TemperatureSpec(kind="fixed", alpha=0.3), 4)
    torch.testing.assert_close(f.alpha(temperature_state(f), 3), torch.full((3,), 0.3))
    assert list(f.parameters()) == [] and f.n_actions == 0
    assert f.loss(temperature_state(f), torch.randn(5)).item() == 0.0
    te = make_temperature(TemperatureSpec(kind="te", init_alpha=0.25), 4)
    assert isinstance(te, TargetEntropyTemperature) and te.n_actions == 0
    torch.testing.assert_close(te.alpha(temperature_state(te), 2), torch.full((2,), 0.25))
    qed = make_temperature(TemperatureSpec(kind="qed", k=0.2, n_actions=6), 4)
    assert qed.n_actions == 6 and list(dict(qed.named_parameters())) == ["log_alpha"]
    with pytest.raises(ValueError, match="needs the disagreement"):
        qed.alpha(temperature_state(qed), 2)
