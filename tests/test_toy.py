"""Tests for qed_ray.toy: the off-policy toy of Sec. 5.2 / Fig. 2."""

import json
import math

import numpy as np
import pydantic
import pytest
import torch

from qed_ray import toy


def test_config_defaults_are_the_papers_setup():
    cfg = toy.ToyConfig()
    assert (cfg.action_low, cfg.action_high) == (-5.0, 5.0)
    assert cfg.modes == (-2.0, 2.0) and cfg.variance == 0.5 and cfg.mode_weights == (0.5, 0.5)
    assert cfg.horizon == 2 and cfg.gamma == 0.9
    assert cfg.buffer_support == (-3.0, 0.0)
    with pytest.raises(pydantic.ValidationError):
        cfg.gamma = 0.5  # frozen


@pytest.mark.parametrize("kwargs, message", [
    ({"buffer_support": (-3.0, 6.0)}, "buffer_support must be an interval inside"),
    ({"mode_weights": (0.7, 0.7)}, "mode_weights must be >= 0 and sum to 1"),
    ({"gamma": 1.5}, "gamma"),
])
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(pydantic.ValidationError, match=message):
        toy.ToyConfig(**kwargs)


def test_reward_is_a_symmetric_bimodal_density():
    a = np.linspace(-20, 20, 400_001)
    r = toy.toy_reward(a)
    assert np.trapezoid(r, a) == pytest.approx(1.0, abs=1e-9)
    np.testing.assert_allclose(toy.toy_reward(-a), r, rtol=1e-12)
    right = a > 0
    assert a[right][np.argmax(r[right])] == pytest.approx(2.0, abs=1e-4)
    assert a[~right][np.argmax(r[~right])] == pytest.approx(-2.0, abs=1e-4)
    assert toy.toy_reward(np.array(2.0)) == pytest.approx(0.5 / math.sqrt(math.pi), rel=1e-6)


def test_buffer_covers_only_the_support_and_is_read_only():
    buf = toy.make_buffer(5000, np.random.default_rng(0))
    assert buf.actions.shape == buf.rewards.shape == buf.steps.shape == (5000,)
    assert buf.actions.min() > -3.0 and buf.actions.max() < 0.0
    assert buf.actions.min() < -2.99 and buf.actions.max() > -0.01  # fills the whole support
    np.testing.assert_array_equal(buf.rewards, toy.toy_reward(buf.actions))
    np.testing.assert_array_equal(buf.steps[:4], [0, 1, 0, 1])
    assert not buf.actions.flags.writeable
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        toy.make_buffer(0, np.random.default_rng(0))


def test_td_targets_on_a_hand_batch():
    cfg = toy.ToyConfig()
    y = toy.td_targets(rewards=torch.tensor([0.1, 0.2]), steps=torch.tensor([0, 1]),
                       next_q=torch.tensor([1.0, 5.0]), next_log_prob=torch.tensor([-1.0, -1.0]),
                       alpha=0.1, cfg=cfg)
    # Step 0 bootstraps with gamma = 0.9: 0.1 + 0.9 * (1.0 + 0.1); step 1 is terminal.
    torch.testing.assert_close(y, torch.tensor([0.1 + 0.9 * 1.1, 0.2]))


class _StepCritic(torch.nn.Module):
    """Stub target critic: Q_1(a, t) = 10 t + 1, Q_2(a, t) = 10 t (min picks Q_2)."""

    def forward(self, actions, steps):
        q = 10.0 * steps.to(actions.dtype)
        return torch.stack([q + 1.0, q])


def test_soft_td_targets_bootstrap_from_step_one_with_policy_actions():
    cfg = toy.ToyConfig()
    actor = toy.ToyActor(cfg)
    batch = (torch.tensor([-1.0, -2.0]), torch.tensor([0.3, 0.4]), torch.tensor([0, 1]))
    y = toy.soft_td_targets(batch, _StepCritic(), actor, 0.15, torch.Generator().manual_seed(7))
    _, logp = actor.sample(2, torch.Generator().manual_seed(7))
    expected = torch.tensor([0.3 + 0.9 * (10.0 - 0.15 * logp[0].item()), 0.4])
    torch.testing.assert_close(y, expected)
    assert not y.requires_grad


def test_actor_density_mass_and_log_prob_agree():
    cfg = toy.ToyConfig(grid_points=4000)
    actor = toy.ToyActor(cfg)
    grid = toy.action_grid(cfg)
    assert grid.min() > -5 and grid.max() < 5 and grid.shape == (4000,)
    assert (actor.density(grid) * 10 / 4000).sum() == pytest.approx(1.0, abs=1e-4)
    assert actor.interval_mass(-5.0, 5.0) == pytest.approx(1.0, abs=1e-15)
    assert actor.interval_mass(-5.0, 0.0) == pytest.approx(0.5, abs=1e-15)  # mu = 0
    assert actor.mean_action() == pytest.approx(0.0, abs=1e-12)
    a, logp = actor.sample(16, torch.Generator().manual_seed(0))
    np.testing.assert_allclose(np.exp(logp.detach().numpy()), actor.density(a.detach().numpy()), rtol=1e-4)


def test_short_run_shapes_finite_and_buffer_unchanged():
    cfg = toy.ToyConfig(snapshot_every=20, grid_points=51, buffer_size=64, batch_size=16)
    buf = toy.make_buffer(64, np.random.default_rng(0), cfg)
    before = {k: getattr(buf, k).copy() for k in ("actions", "rewards", "steps")}
    res = toy.run_toy(cfg, alpha=0.1, seed=0, steps=50, buffer=buf)
    np.testing.assert_array_equal(res["snapshot_steps"], [0, 20, 40, 50])
    assert res["q"].shape == (4, 2, 2, 51) and res["density"].shape == (4, 51)
    for key in ("policy_mean", "mass_support", "mass_left_mode", "mass_right"):
        assert res[key].shape == (4,)
    assert res["critic_loss"].shape == res["actor_loss"].shape == (50,)
    assert all(np.isfinite(v).all() for v in res.values())
    for k, v in before.items():
        np.testing.assert_array_equal(getattr(buf, k), v)
    assert len(buf.actions) == 64


def test_run_is_deterministic_and_validates_alpha():
    cfg = toy.ToyConfig(snapshot_every=10, grid_points=11, buffer_size=32, batch_size=8)
    a, b = (toy.run_toy(cfg, alpha=0.15, seed=3, steps=10) for _ in range(2))
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    with pytest.raises(ValueError, match="alpha must be finite and > 0, got -0.1"):
        toy.run_toy(cfg, alpha=-0.1, seed=0, steps=1)


def test_cli_writes_figures_and_summary(tmp_path, capsys):
    rows = toy.main(["--alphas", "0.1", "0.15", "--seeds", "0", "1", "--steps", "5", "--out", str(tmp_path)])
    assert len(rows) == 4
    for name in ("fig2a_q_landscapes.png", "fig2b_policy_densities.png", "toy_summary.json"):
        assert (tmp_path / name).stat().st_size > 500
    summary = json.loads((tmp_path / "toy_summary.json").read_text())
    assert summary["config"]["horizon"] == 2 and summary["config"]["gamma"] == 0.9
    keys = {"alpha", "seed", "steps", "final_policy_mean", "mass_support", "mass_left_mode", "mass_right",
            "q_max_inside", "q_max_outside", "wall_s"}
    assert [(r["alpha"], r["seed"]) for r in summary["runs"]] == [(0.1, 0), (0.1, 1), (0.15, 0), (0.15, 1)]
    assert all(set(r) == keys for r in summary["runs"])
    assert "mean" in capsys.readouterr().out
