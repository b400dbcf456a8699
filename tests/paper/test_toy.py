"""Tests for qed_ray.paper.toy and qed_ray.paper.toy_learner: the off-policy toy of Sec. 5.2 / Fig. 2."""

import json
import math
import re

import numpy as np
import pydantic
import pytest
import torch

from qed_ray.paper import toy, toy_learner


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
    ({"horizon_mode": "episodic"}, "(?s)horizon_mode.*'step_terminal', 'state_terminal' or 'state_bootstrap'"),
    ({"reward_scale": 0.0}, "reward_scale"),
    ({"depth": 0}, "depth"),
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
    scaled = toy.ToyConfig(reward_scale=2.0)  # the sum of the two Gaussian densities
    np.testing.assert_allclose(toy.toy_reward(a, scaled), 2 * r, rtol=1e-12)


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


@pytest.mark.parametrize("mode, step0, step1", [
    # Step 0 bootstraps with gamma = 0.9: 0.1 + 0.9 * (1.0 + 0.1); step 1 is terminal unless the time limit
    # is bootstrapped (state_bootstrap): 0.2 + 0.9 * (5.0 + 0.1).
    ("step_terminal", 0.1 + 0.9 * 1.1, 0.2),
    ("state_terminal", 0.1 + 0.9 * 1.1, 0.2),
    ("state_bootstrap", 0.1 + 0.9 * 1.1, 0.2 + 0.9 * 5.1),
])
def test_td_targets_on_a_hand_batch(mode, step0, step1):
    cfg = toy.ToyConfig(horizon_mode=mode)
    y = toy_learner.td_targets(rewards=torch.tensor([0.1, 0.2]), steps=torch.tensor([0, 1]),
                               next_q=torch.tensor([1.0, 5.0]), next_log_prob=torch.tensor([-1.0, -1.0]),
                               alpha=0.1, cfg=cfg)
    torch.testing.assert_close(y, torch.tensor([step0, step1]))


def test_critic_input_has_the_step_only_in_step_terminal_mode():
    gens = [torch.Generator().manual_seed(0)]
    a, t = torch.tensor([[-5.0, 0.0, 2.5]]), torch.tensor([[0, 1, 1]])
    with_step = toy_learner.ToyCritics(toy.ToyConfig(), gens)
    torch.testing.assert_close(with_step.features(a, t), torch.tensor([[[-1.0, 1, 0], [0.0, 0, 1], [0.5, 0, 1]]]))
    for mode in ("state_terminal", "state_bootstrap"):
        critics = toy_learner.ToyCritics(toy.ToyConfig(horizon_mode=mode), gens)
        torch.testing.assert_close(critics.features(a, t), torch.tensor([[[-1.0], [0.0], [0.5]]]))
        # One state: the step changes nothing.
        torch.testing.assert_close(critics(a, t), critics(a, torch.zeros_like(t)))


def test_critics_have_the_configured_shape_and_linear_init():
    cfg = toy.ToyConfig(hidden=8, depth=3, layer_norm=True)
    critics = toy_learner.ToyCritics(cfg, [torch.Generator().manual_seed(s) for s in (0, 1, 2)])
    assert [tuple(w.shape) for w in critics.weights] == [(3, 2, 3, 8), (3, 2, 8, 8), (3, 2, 8, 8), (3, 2, 8, 1)]
    for w, b in zip(critics.weights, critics.biases):
        bound = 1 / math.sqrt(w.shape[2])  # torch.nn.Linear's default init range
        assert w.abs().max() <= bound and b.abs().max() <= bound
    assert not torch.equal(critics.weights[0][0, 0], critics.weights[0][0, 1])  # twin critics differ
    assert not torch.equal(critics.weights[0][0], critics.weights[0][1])  # runs differ
    q = critics(torch.zeros(3, 5), torch.zeros(3, 5, dtype=torch.long))
    assert q.shape == (3, 2, 5) and torch.isfinite(q).all()


def _hand_critics(cfg: toy.ToyConfig, offsets: tuple[float, float]) -> toy_learner.ToyCritics:
    """Real critics with hand-set weights (depth 1, width 1): ``Q_j(a, t) = 10 t + offsets[j]``."""
    critics = toy_learner.ToyCritics(cfg, [torch.Generator().manual_seed(0)])
    with torch.no_grad():
        for w, b in zip(critics.weights, critics.biases):
            w.zero_()
            b.zero_()
        critics.weights[0][0, :, 2, 0] = 10.0  # input 2 = one_hot(t)[1]; ReLU(10 * 1[t = 1])
        critics.weights[1][0, :, 0, 0] = 1.0
        critics.biases[1][0, :, 0, 0] = torch.tensor(offsets)
    return critics


def test_hand_critics_compute_their_formula():
    cfg = toy.ToyConfig(hidden=1, depth=1)
    q = _hand_critics(cfg, (1.0, 0.0))(torch.tensor([[-1.0, 3.0]]), torch.tensor([[0, 1]]))
    torch.testing.assert_close(q, torch.tensor([[[1.0, 11.0], [0.0, 10.0]]]))


def test_soft_td_targets_bootstrap_from_step_one_with_policy_actions():
    cfg = toy.ToyConfig(hidden=1, depth=1)
    actor = toy_learner.ToyActor(cfg, 1)
    batch = (torch.tensor([[-1.0, -2.0]]), torch.tensor([[0.3, 0.4]]), torch.tensor([[0, 1]]))
    alpha = torch.tensor([[0.15]])
    y = toy_learner.soft_td_targets(batch, _hand_critics(cfg, (1.0, 0.0)), actor, alpha,
                                    [torch.Generator().manual_seed(7)])
    _, logp = actor.sample(2, [torch.Generator().manual_seed(7)])
    # Step 0 bootstraps from min_j Q_j(a', 1) = 10 (critic 2) minus alpha log pi(a'); step 1 is terminal.
    expected = torch.tensor([[0.3 + 0.9 * (10.0 - 0.15 * logp[0, 0].item()), 0.4]])
    torch.testing.assert_close(y, expected)
    assert not y.requires_grad


def test_actor_density_mass_and_log_prob_agree():
    cfg = toy.ToyConfig(grid_points=4000)
    actor = toy_learner.ToyActor(cfg, 2)
    with torch.no_grad():
        actor.mu[1] = 0.4
    grid = toy.action_grid(cfg)
    assert grid.min() > -5 and grid.max() < 5 and grid.shape == (4000,)
    np.testing.assert_allclose((actor.density(grid) * 10 / 4000).sum(axis=1), [1.0, 1.0], atol=1e-4)
    np.testing.assert_allclose(actor.interval_mass(-5.0, 5.0), [1.0, 1.0], atol=1e-15)
    # mu = 0: half the mass below 0; mu = 0.4, sigma = 1: Phi(-0.4).
    np.testing.assert_allclose(actor.interval_mass(-5.0, 0.0), [0.5, 0.5 * math.erfc(0.4 / math.sqrt(2))],
                               atol=1e-15)
    assert actor.mean_action()[0] == pytest.approx(0.0, abs=1e-12) and actor.mean_action()[1] > 0
    a, logp = actor.sample(16, [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)])
    assert a.shape == logp.shape == (2, 16)
    for r in range(2):
        np.testing.assert_allclose(np.exp(logp[r].detach().numpy()),
                                   actor.density(a[r].detach().numpy())[r], rtol=1e-4)


def test_actor_starts_at_the_configured_mean_and_log_std():
    actor = toy_learner.ToyActor(toy.ToyConfig(init_mean=-0.3, init_log_std=-1.5), 3)
    np.testing.assert_allclose(actor.stats()[0], [-0.3] * 3, rtol=1e-6)
    np.testing.assert_allclose(actor.stats()[1], [math.exp(-1.5)] * 3, rtol=1e-6)


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


def test_run_is_deterministic_and_independent_of_the_batch():
    cfg = toy.ToyConfig(snapshot_every=10, grid_points=11, buffer_size=32, batch_size=8)
    a, b = (toy.run_toy(cfg, alpha=0.15, seed=3, steps=10) for _ in range(2))
    batched = toy.run_toys(cfg, alphas=[0.1, 0.15, 0.15], seeds=[3, 3, 4], steps=10)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
        # a run does not see its batch mates (another batch shape may round the last bit otherwise)
        np.testing.assert_allclose(a[key], batched[1][key], rtol=1e-6, atol=1e-9)
    assert not np.array_equal(batched[0]["q"], batched[1]["q"])  # alpha enters the targets
    assert not np.array_equal(batched[1]["q"], batched[2]["q"])  # the seed changes init and data


@pytest.mark.parametrize("kwargs, message", [
    ({"alphas": [-0.1], "seeds": [0]}, "alpha must be finite and > 0, got -0.1"),
    ({"alphas": [0.1, 0.15], "seeds": [0]}, "alphas and seeds must be non-empty and of equal length, got 2 and 1"),
    ({"alphas": [0.1], "seeds": [0], "steps": 1.5}, "steps must be an integer >= 0, got 1.5"),
])
def test_run_toys_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        toy.run_toys(toy.ToyConfig(), **{"steps": 1, **kwargs})


def test_leaves_support_needs_the_mass_off_the_data_and_the_mean_outside():
    cfg = toy.ToyConfig()
    assert toy.leaves_support({"mass_support": 0.3, "final_policy_mean": 0.6}, cfg)
    assert toy.leaves_support({"mass_support": 0.3, "final_policy_mean": -3.6}, cfg)
    assert not toy.leaves_support({"mass_support": 0.26, "final_policy_mean": 0.0}, cfg)  # broad, centred at 0
    assert not toy.leaves_support({"mass_support": 0.5, "final_policy_mean": 1.0}, cfg)
    assert toy.stays_on_support({"mass_support": 0.5}) and not toy.stays_on_support({"mass_support": 0.49})


def test_cli_writes_figures_and_summary(tmp_path, capsys):
    rows = toy.main(["--alphas", "0.1", "0.15", "--seeds", "0", "1", "--steps", "5", "--out", str(tmp_path)])
    assert len(rows) == 4
    for name in ("fig2a_q_landscapes.png", "fig2b_policy_densities.png", "toy_summary.json"):
        assert (tmp_path / name).stat().st_size > 500
    summary = json.loads((tmp_path / "toy_summary.json").read_text())
    assert summary["config"]["horizon"] == 2 and summary["config"]["gamma"] == 0.9
    keys = {"alpha", "seed", "steps", "step", "final_policy_mean", "mass_support", "mass_left_mode", "mass_right",
            "q_max_inside", "q_max_outside", "left"}
    assert [(r["alpha"], r["seed"]) for r in summary["runs"]] == [(0.1, 0), (0.1, 1), (0.15, 0), (0.15, 1)]
    assert all(set(r) == keys for r in summary["runs"])
    assert "mean" in capsys.readouterr().out


def test_maxent_objective_matches_the_density_integral():
    cfg = toy.ToyConfig(grid_points=200_000)
    actor = toy_learner.ToyActor(cfg, 1)
    with torch.no_grad():
        actor.mu[0], actor.raw_log_std[0] = 0.3, -0.2
    mu, sigma = (float(v[0]) for v in actor.stats())
    a = toy.action_grid(cfg)
    p = actor.density(a)[0]
    log_p = np.log(np.where(p > 0, p, 1.0))  # p log p -> 0 where the density underflows
    integral = np.sum(p * (toy.toy_reward(a, cfg) - 0.15 * log_p)) * 10 / len(a)
    assert toy.maxent_objective(mu, sigma, 0.15, cfg) == pytest.approx(integral, abs=1e-5)
    assert toy.maxent_objective(-mu, sigma, 0.15, cfg) == pytest.approx(integral, abs=1e-5)  # symmetric reward


def test_maxent_optimum_sits_on_a_mode_only_at_a_low_temperature():
    """With a perfect critic, alpha / reward_scale decides between one mode and a broad policy centred at 0."""
    mu, log_std = np.linspace(-1.0, 1.0, 201)[:, None], np.linspace(-4.0, 1.0, 126)[None]
    best = {}
    for scale, alpha in ((1.0, 0.1), (2.0, 0.1), (2.0, 0.15)):
        j = toy.maxent_objective(mu, np.exp(log_std), alpha, toy.ToyConfig(reward_scale=scale))
        i = np.unravel_index(j.argmax(), j.shape)
        best[scale, alpha] = 5 * math.tanh(mu[i[0], 0])  # the policy's median action
    assert best[2.0, 0.1] == pytest.approx(-2.0, abs=0.05) or best[2.0, 0.1] == pytest.approx(2.0, abs=0.05)
    assert best[1.0, 0.1] == pytest.approx(0.0, abs=1e-9) and best[2.0, 0.15] == pytest.approx(0.0, abs=1e-9)


def test_cli_overrides_set_the_config_and_bad_ones_name_the_field(tmp_path, capsys):
    toy.main(["--seeds", "0", "--steps", "2", "--out", str(tmp_path),
              "--overrides", '{"horizon_mode": "state_terminal", "hidden": 8}'])
    config = json.loads((tmp_path / "toy_summary.json").read_text())["config"]
    assert config["horizon_mode"] == "state_terminal" and config["hidden"] == 8
    with pytest.raises(SystemExit):
        toy.main(["--out", str(tmp_path), "--overrides", '{"hiden": 8}'])
    assert "hiden" in capsys.readouterr().err


def test_default_toy_drifts_but_stays_on_the_data():
    """The default's documented behaviour (docs/toy.md): both temperatures move onto the data's mode at -2;
    alpha = 0.15 keeps less mass there than 0.1 (a drift), and neither leaves the support."""
    cfg = toy.ToyConfig(snapshot_every=1000)
    low, high = (toy.summarize(r, cfg) for r in toy.run_toys(cfg, alphas=[0.1, 0.15], seeds=[0, 0], steps=1000))
    for s in (low, high):
        assert toy.stays_on_support(s) and not toy.leaves_support(s, cfg)
        assert -2.0 < s["final_policy_mean"] < -1.4  # started at 0, the edge of the data
        assert s["q_max_outside"] < s["q_max_inside"]  # the critic's best value is on the data
    assert low["mass_support"] - high["mass_support"] > 0.05
