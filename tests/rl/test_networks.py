"""Actor log-prob, Polyak averaging, critic shapes."""

import math

import numpy as np
import pytest
import torch

import torch.nn.functional as F

from qed_ray.rl.networks import (Mish, TanhGaussianActor, TwinCritic, activation, make_adam, mish, mish_exp_form,
                                 mish_exp_form_backward, polyak_lerp_, tanh_log_det_jacobian)


def test_stable_tanh_correction_matches_naive_formula():
    u = torch.linspace(-5, 5, 101, dtype=torch.float64)
    torch.testing.assert_close(tanh_log_det_jacobian(u), torch.log(1 - torch.tanh(u) ** 2))
    assert torch.isfinite(tanh_log_det_jacobian(torch.tensor([50.0, -50.0]))).all()


def test_log_prob_matches_monte_carlo_density():
    torch.manual_seed(0)
    actor = TanhGaussianActor(3, 1, 16, 1, "mish", -5.0, 2.0)
    x = torch.randn(1, 3)
    g = torch.Generator().manual_seed(1)
    n = 400_000
    with torch.no_grad():
        a, logp = actor.sample(x.expand(n, 3), torch.randn(n, 1, generator=g))
    a = a[:, 0].numpy()
    # histogram density estimate at the sampled points' bins vs exp(log_prob) of points in the bin
    hist, edges = np.histogram(a, bins=40, range=(a.min(), a.max()), density=True)
    idx = np.clip(np.digitize(a, edges) - 1, 0, 39)
    dens = np.exp(logp.numpy())
    for b in range(40):
        sel = idx == b
        if sel.sum() > 5000:
            assert dens[sel].mean() == pytest.approx(hist[b], rel=0.05)


def test_log_prob_is_gaussian_minus_jacobian_exactly():
    actor = TanhGaussianActor(2, 2, 8, 1, "relu", -5.0, 2.0)
    x = torch.randn(5, 2)
    g = torch.Generator().manual_seed(3)
    eps = torch.randn(5, 2, generator=g)
    a, logp = actor.sample(x, eps)
    mu, log_std = actor(x)
    torch.testing.assert_close(a, torch.tanh(mu + log_std.exp() * eps), rtol=0, atol=0)
    u = torch.atanh(a.clamp(-1 + 1e-6, 1 - 1e-6))
    ref = torch.distributions.Normal(mu, log_std.exp()).log_prob(u).sum(-1) - torch.log(1 - a ** 2).sum(-1)
    torch.testing.assert_close(logp, ref, rtol=1e-3, atol=1e-3)


def test_log_std_is_bounded_and_mode_is_tanh_mu():
    actor = TanhGaussianActor(4, 3, 8, 1, "mish", -5.0, 2.0)
    with torch.no_grad():
        for p in actor.parameters():
            p.mul_(100)
    mu, log_std = actor(torch.randn(64, 4))
    assert log_std.min() >= -5.0 and log_std.max() <= 2.0
    torch.testing.assert_close(actor.mode(torch.ones(1, 4)), torch.tanh(actor(torch.ones(1, 4))[0]))


def test_polyak_moves_targets_by_the_rate():
    online, target = TwinCritic(3, 2, 8, 2, "mish"), TwinCritic(3, 2, 8, 2, "mish")
    before = [p.detach().clone() for p in target.parameters()]
    polyak_lerp_(list(target.parameters()), list(online.parameters()), 0.01)
    for b, t, o in zip(before, target.parameters(), online.parameters()):
        torch.testing.assert_close(t, 0.99 * b + 0.01 * o)


def test_twin_critic_has_layernorm_and_independent_heads():
    c = TwinCritic(3, 2, 8, 2, "mish")
    assert sum(isinstance(m, torch.nn.LayerNorm) for m in c.modules()) == 4
    q1, q2 = c(torch.randn(6, 3), torch.randn(6, 2))
    assert q1.shape == (6,) and q2.shape == (6,) and not torch.allclose(q1, q2)
    assert math.isfinite(float(q1.detach().sum()))


@pytest.mark.parametrize("repeats", [1, 4])
def test_split_first_layer_equals_the_concatenated_input(repeats):
    torch.manual_seed(0)
    c = TwinCritic(5, 3, 16, 2, "mish").double()
    x, a = torch.randn(7, 5, dtype=torch.float64), torch.randn(7 * repeats, 3, dtype=torch.float64)
    got = c(x, a, repeats)
    xa = torch.cat([x.repeat_interleave(repeats, 0), a], -1)
    want = c.q1(xa).squeeze(-1), c.q2(xa).squeeze(-1)
    for g, w in zip(got, want):
        assert g.shape == (7 * repeats,)
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_make_adam_uses_the_fused_step_on_cpu():
    opt = make_adam(torch.nn.Linear(2, 2).parameters(), 1e-3, torch.device("cpu"))
    assert opt.defaults["fused"] is True and opt.defaults["capturable"] is False and opt.defaults["lr"] == 1e-3


def mish_inputs(dtype=torch.float32) -> torch.Tensor:
    """A wide range, the ends (±30, past the exponent clamp), the small (±1e-4) and a large batch."""
    edges = torch.tensor([-30.0, -20.0, -1e-4, 0.0, 1e-4, 19.9, 20.0, 20.1, 30.0, -100.0, 100.0], dtype=dtype)
    grid = torch.linspace(-30, 30, 60_001, dtype=dtype)
    batch = torch.randn(2048, 256, generator=torch.Generator().manual_seed(0), dtype=dtype).mul(4).flatten()
    return torch.cat([edges, grid, batch])


def assert_mish_matches_aten(fn) -> None:
    """Forward and backward (with a random upstream gradient) of ``fn`` against ``aten::mish`` within 3e-6."""
    x = mish_inputs()
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = F.mish(xa), fn(xb)
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(yb, ya, rtol=0, atol=3e-6)
    torch.testing.assert_close(xb.grad, xa.grad, rtol=0, atol=3e-6)
    assert torch.equal(yb[x > 20], x[x > 20]) and torch.isfinite(xb.grad).all()


def test_fast_mish_equals_aten_mish_eager():
    """The formula and its closed-form backward (what the compiled Mish computes) and the eager module."""
    x = mish_inputs()
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(mish_exp_form(x), F.mish(x), rtol=0, atol=3e-6)
    torch.testing.assert_close(mish_exp_form_backward(x, g), torch.ops.aten.mish_backward(g, x), rtol=0, atol=3e-6)
    assert torch.equal(mish_exp_form(x)[x > 20], x[x > 20])
    assert_mish_matches_aten(mish)
    assert isinstance(activation("mish"), Mish) and mish(torch.zeros(1, dtype=torch.float64)).dtype == torch.float64


def test_fast_mish_equals_aten_mish_under_vmap():
    """The packs map every per-seed function over a seed axis (torch.func.vmap)."""
    assert mish_inputs().numel() % 4 == 0
    assert_mish_matches_aten(lambda x: torch.func.vmap(mish)(x.view(4, -1)).flatten())


@pytest.mark.torch_only
def test_fast_mish_equals_aten_mish_compiled():
    """Compiled (inductor fuses the formula and its backward): the same values within 3e-6."""
    torch._dynamo.reset()
    assert_mish_matches_aten(torch.compile(mish, dynamic=False))
