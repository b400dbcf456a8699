"""MAD-SAC: HL-Gauss support, world-model modules, the mixed critic batch, update contract, exact resume."""

import io
import json
import math

import numpy as np
import pytest
import torch

from kit import ACT, OBS, TINY_MAD, batch_of, spec_of
from oracles.single_seed import single_update

from qed_ray.rl.agents.base import params_of
from qed_ray.rl.agents.mad_sac import MODEL_METRIC_KEYS, MadSAC, split_sizes
from qed_ray.spec.config import MadSpec, TemperatureSpec
from qed_ray.rl.hlgauss import HLGauss, cross_entropy
from qed_ray.rl.world_model import Dynamics, HLGaussCritic, SimNorm

# The kit's tiny world model, at MAD-SAC's default HL-Gauss support and 32 units (these tests read the default
# support's clipping and need critics that differ visibly after one update).
AT_DEFAULT_SUPPORT = {**{k: MadSpec.model_fields[k].default for k in ("num_bins", "vmin", "vmax")},
                      "encoder_hidden": 32, "model_hidden": 32}


def make_agent(temperature=None, batch_size=32, seed=0, **mad):
    spec = spec_of("mad_sac", {**AT_DEFAULT_SUPPORT, **mad}, hidden=32, batch_size=batch_size)
    return MadSAC(spec, temperature or TemperatureSpec(), OBS, ACT, torch.device("cpu"), seed)


def make_batch(batch_size=32, seed=1):
    return batch_of(seed, batch_size)


def snapshot(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# ---- HL-Gauss -----------------------------------------------------------------------------------------
def test_hlgauss_support_matches_mad_defaults():
    hl = HLGauss(-300, 300, 151, 0.75)
    assert hl.width == 4.0 and hl.sigma == 3.0
    assert hl.centres[0] == -300 and hl.centres[75] == 0 and hl.centres[-1] == 300
    assert hl.edges[0] == -302 and hl.edges[-1] == 302 and hl.edges.shape == (152,)
    # Centre-bin mass of N(0, 3) inside [-2, 2], renormalised by the mass inside [-302, 302].
    centre = math.erf(2 / (3 * math.sqrt(2)))
    assert hl.encode(torch.tensor([0.0]))[0, 75].item() == pytest.approx(centre, abs=1e-6)
    prior = hl.zero_prior()
    assert prior[75].item() == pytest.approx(17 * centre, abs=1e-5)  # the "+8.4" of docs/mad_sac.md (zero prior)
    assert prior[74].item() == pytest.approx(prior[76].item()) == pytest.approx(3.9056, abs=1e-4)


def test_hlgauss_encoding_sums_to_one_and_decodes_back():
    hl = HLGauss(-300, 300, 151, 0.75)
    interior = torch.tensor([-290.0, -150.3, -0.7, 0.0, 1.0, 2.0, 3.7, 123.4, 290.0])
    probs = hl.encode(interior)
    assert probs.shape == (9, 151) and bool((probs >= 0).all())
    torch.testing.assert_close(probs.sum(-1), torch.ones(9), rtol=0, atol=1e-6)
    torch.testing.assert_close(hl.decode(probs.log()), interior, rtol=0, atol=1e-3)
    # At the edges, truncation pulls the mean inwards by 0.37 bin (a fixed, known bias).
    edges = torch.tensor([-300.0, -299.0, 297.0, 299.9, 300.0])
    err = hl.decode(hl.encode(edges).log()) - edges
    torch.testing.assert_close(err, torch.tensor([1.4752, 0.9901, -0.3570, -1.4216, -1.4752]), rtol=0, atol=1e-3)
    assert float(err.abs().max()) < 0.4 * hl.width


def test_hlgauss_clips_targets_at_the_support_edges():
    hl = HLGauss(-300, 300, 151, 0.75)
    torch.testing.assert_close(hl.encode(torch.tensor([500.0, -1e6])), hl.encode(torch.tensor([300.0, -300.0])),
                               rtol=0, atol=0)
    y = torch.tensor([-300.5, -300.0, 0.0, 300.0, 1e4])
    assert hl.clip_fraction(y).item() == pytest.approx(0.4)


def test_hlgauss_loss_is_the_bin_averaged_cross_entropy():
    hl = HLGauss(-10, 10, 21, 0.75)
    logits = torch.randn(4, 21, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([-9.0, -1.5, 0.0, 7.25])
    manual = -(hl.encode(y) * torch.log_softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(hl.loss(logits, y), manual / 21)
    torch.testing.assert_close(hl.loss(logits, y, reduction="sum"), manual)
    with pytest.raises(ValueError, match="reduction: 'max'"):
        cross_entropy(logits, hl.encode(y), "max")


@pytest.mark.parametrize("kwargs, message", [
    ({"vmin": 1.0, "vmax": 1.0, "num_bins": 5}, "vmin/vmax: need vmin < vmax, got vmin=1.0, vmax=1.0"),
    ({"vmin": 0.0, "vmax": 1.0, "num_bins": 1}, "num_bins: 1"),
    ({"vmin": 0.0, "vmax": 1.0, "num_bins": 5, "sigma_ratio": 0.0}, "sigma_ratio: 0.0 must be > 0"),
])
def test_hlgauss_rejects_bad_support(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HLGauss(**kwargs)


def test_zero_prior_gives_near_zero_q_at_init():
    torch.manual_seed(0)
    critic = HLGaussCritic(64, 6, 64, 2, "mish", HLGauss(-300, 300, 151, 0.75))
    z = SimNorm(8)(3 * torch.randn(1000, 64))
    a = torch.rand(1000, 6) * 2 - 1
    with torch.no_grad():
        q1, q2 = critic.values(z, a)
        l1, _ = critic(z, a)
    assert float(q1.abs().max()) < 1.0 and float(q2.abs().max()) < 1.0
    assert float(critic.hl.decode(l1 - critic.prior).abs().max()) > 5.0  # without the prior: spread over ±300


# ---- world model ------------------------------------------------------------------------------------------
def test_simnorm_groups_are_simplices():
    x = 5 * torch.randn(7, 32)
    sn = SimNorm(8)
    p = sn(x)
    torch.testing.assert_close(p.view(7, 4, 8).sum(-1), torch.ones(7, 4))
    torch.testing.assert_close(sn.log_prob(x).exp(), p)
    with pytest.raises(ValueError, match="last dim 30 is not a multiple of group 8"):
        sn(torch.randn(2, 30))


def test_dynamics_outputs_probs_and_matching_log_probs():
    dyn = Dynamics(16, ACT, 32, 2, 8, "mish")
    probs, logp = dyn(SimNorm(8)(torch.randn(3, 16)), torch.zeros(3, ACT))
    assert probs.shape == logp.shape == (3, 16)
    torch.testing.assert_close(probs.view(3, 2, 8).sum(-1), torch.ones(3, 2))
    torch.testing.assert_close(logp.exp(), probs)


# ---- critic batch -------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch_size, proportion, expected", [(512, 0.5, (256, 256)), (512, 0.95, (486, 26)),
                                                              (512, 1.0, (512, 0)), (33, 0.5, (16, 17))])
def test_split_sizes(batch_size, proportion, expected):
    assert split_sizes(batch_size, proportion) == expected


def test_split_sizes_rejects_an_empty_real_share():
    with pytest.raises(ValueError, match=r"agent.mad.proportion_real: 0.001 x agent.batch_size 512"):
        split_sizes(512, 0.001)


@pytest.mark.parametrize("proportion, n_real", [(0.5, 256), (0.95, 486)])
def test_critic_batch_model_rows_use_real_states_and_policy_samples(proportion, n_real):
    agent = make_agent(batch_size=512, proportion_real=proportion)
    batch = make_batch(512)
    g = torch.Generator().manual_seed(3)
    eps_model, eps = torch.randn(512 - n_real, ACT, generator=g), torch.randn(512, ACT, generator=g)
    cb = agent.fn.critic_batch(agent.params(), params_of(agent.critic_target), batch, eps_model, eps,
                               torch.zeros(0, ACT))
    assert int(cb["is_model"].sum()) == 512 - n_real and not bool(cb["is_model"][:n_real].any())
    with torch.no_grad():
        z = agent.encoder(batch["obs"])
        a_m = agent.actor.sample(z[n_real:], eps_model)[0]
        torch.testing.assert_close(cb["z"], z, rtol=0, atol=1e-6)  # same rows, batched with s'
        torch.testing.assert_close(cb["a"][:n_real], batch["action"][:n_real], rtol=0, atol=0)
        torch.testing.assert_close(cb["a"][n_real:], a_m, rtol=0, atol=1e-6)
        # Rebuild the soft targets by hand: model rows bootstrap from the model's (z'_m, r_m).
        z_next = torch.cat([agent.encoder(batch["next_obs"][:n_real]), agent.dynamics(z[n_real:], a_m)[0]])
        r = torch.cat([batch["reward"][:n_real], agent.reward(z[n_real:], a_m)])
        a2, logp2 = agent.actor.sample(z_next, eps)
        tq1, tq2 = agent.critic_target.values(z_next, a2)
        y = r + 0.99 * (torch.minimum(tq1, tq2) - agent.temperature.log_alpha.exp() * logp2)
    torch.testing.assert_close(cb["y"], y, rtol=0, atol=1e-5)
    assert not cb["y"].requires_grad


# ---- update contract -----------------------------------------------------------------------------------
REQUIRED_KEYS = ("loss/critic", "loss/actor", "loss/alpha", "loss/model_reward", "loss/model_latent_ce",
                 "loss/model_value_aware", "loss/model_encoder_critic", "policy/entropy", "q/mean_real",
                 "q/mean_model", "q/abs_diff_mean", "q/abs_diff_max", "q/target_mean", "mad/target_clip_frac",
                 "mad/model_reward_mse", "alpha/te", "alpha/actor_mean", "alpha/actor_min", "alpha/actor_max",
                 "alpha/target_mean", "alpha/target_min", "alpha/target_max")


@pytest.mark.parametrize("temperature", [TemperatureSpec(), TemperatureSpec(kind="qed", k=0.2),
                                         TemperatureSpec(kind="fixed", alpha=0.05)])
def test_update_moves_exactly_the_trained_parameters(temperature):
    agent = make_agent(temperature)
    before = {k: snapshot(m) for k, m in agent.modules().items()}
    vector = single_update(agent, make_batch())
    assert vector.shape == (len(agent.metric_layout.names),) and not vector.requires_grad
    assert bool(torch.isfinite(vector).all())
    metrics = agent.metric_layout.as_dict(vector)
    assert set(REQUIRED_KEYS) <= set(metrics)
    if temperature.kind == "qed":
        assert {"alpha/actor_frac_floor", "alpha/actor_frac_cap", "alpha/target_frac_cap"} <= set(metrics)
    for name in ("encoder", "dynamics", "reward", "critic", "actor"):
        after = agent.modules()[name].state_dict()
        for key, old in before[name].items():
            moved = not torch.equal(old, after[key])
            is_buffer = key.startswith("hl.") or key == "prior"
            assert moved != is_buffer, f"{name}.{key} moved={moved}"
    rate = agent.spec.polyak
    online, target = agent.critic.state_dict(), agent.critic_target.state_dict()
    for key, old in before["critic_target"].items():
        torch.testing.assert_close(target[key], torch.lerp(old, online[key], rate), rtol=0, atol=0)
        torch.testing.assert_close(target[key], (1 - rate) * old + rate * online[key], rtol=1e-6, atol=1e-7)
    temp_after = agent.temperature.state_dict()
    if temperature.kind == "fixed":
        assert list(agent.temperature.parameters()) == [] and agent.alpha_opt is None
        assert torch.equal(temp_after["value"], before["temperature"]["value"])
        assert metrics["alpha/actor_mean"].item() == pytest.approx(0.05)
    else:
        assert not torch.equal(temp_after["log_alpha"], before["temperature"]["log_alpha"])
    assert all(p.grad is None for p in agent.critic_target.parameters())


def test_model_step_runs_every_model_every_th_update():
    agent = make_agent(model_every=2)
    batch = make_batch()
    layout = agent.metric_layout
    first = layout.as_dict(single_update(agent, batch))
    frozen = {k: snapshot(agent.modules()[k]) for k in ("encoder", "dynamics", "reward")}
    critic = snapshot(agent.critic)
    second = layout.as_dict(single_update(agent, batch))
    for name, old in frozen.items():
        assert all(torch.equal(v, agent.modules()[name].state_dict()[k]) for k, v in old.items()), name
    assert not torch.equal(critic["q1.0.weight"], agent.critic.state_dict()["q1.0.weight"])
    for key in MODEL_METRIC_KEYS:
        assert torch.equal(first[key], second[key]), key
    single_update(agent, batch)
    assert not torch.equal(frozen["encoder"]["net.0.weight"], agent.encoder.state_dict()["net.0.weight"])
    assert agent.updates == 3


def test_target_actor_critic_option_trains_the_actor_against_the_target_critic():
    agent = make_agent(actor_critic="target", model_every=2)
    single_update(agent, make_batch())  # online and target critics now differ; the next update skips the model step
    probe = make_agent(actor_critic="target", model_every=2, seed=5)
    probe.load_state_dict(agent.state_dict())  # the state before the second update
    batch = make_batch(seed=2)
    noise = torch.randn(agent.noise_rows(32), ACT, generator=torch.Generator().manual_seed(4))
    metrics = agent.metric_layout.as_dict(single_update(agent, batch, noise))
    n_real = 16
    eps_actor = noise.split(agent.fn.noise_sizes(32))[5]
    with torch.no_grad():  # the actor step reads the encoder, actor and target critic as they were
        z = probe.encoder(batch["obs"][:n_real])
        a, logp = probe.actor.sample(z, eps_actor)
        q1, q2 = probe.critic_target.values(z, a)
        o1, o2 = probe.critic.values(z, a)
    floor = probe.temperature.log_alpha.exp().detach()
    expected = (floor * logp - torch.minimum(q1, q2)).mean()
    with_online = (floor * logp - torch.minimum(o1, o2)).mean()
    assert metrics["loss/actor"].item() == pytest.approx(expected.item(), abs=1e-6)
    assert abs(expected.item() - with_online.item()) > 1e-4


def test_acting_and_analysis_methods_read_the_encoded_observation():
    from qed_ray.rl.agents.packed import PackedAgent

    agent = make_agent()
    pack = PackedAgent([agent])  # a pack of one: what acts and is evaluated
    obs = np.random.default_rng(0).normal(size=(4, OBS)).astype(np.float32)
    with torch.no_grad():
        z = agent.encoder(torch.from_numpy(obs))
        mu, log_std = agent.actor(z)
        q1, q2 = agent.critic.values(z, torch.zeros(4, ACT))
    np.testing.assert_allclose(pack.act_deterministic(obs[None])[0], torch.tanh(mu).numpy(), rtol=1e-6, atol=1e-7)
    m, s = pack.distribution(obs[None])
    assert m.dtype == s.dtype == np.float64 and m.shape == (1, 4, ACT)
    np.testing.assert_allclose(s[0], log_std.exp().double().numpy(), rtol=1e-6)
    aq1, aq2 = pack.q_values(obs[None], np.zeros((1, 4, ACT), np.float32))
    np.testing.assert_allclose(aq1[0], q1.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(aq2[0], q2.numpy(), rtol=1e-6, atol=1e-6)
    assert pack.act(obs[:1], np.ones(1, bool)).shape == (1, ACT)


def test_report_warnings_fires_above_the_clip_threshold():
    agent = make_agent(clip_warn_fraction=0.02)
    assert agent.report_warnings({"mad/target_clip_frac": 0.02}) == []
    assert agent.report_warnings({}) == []
    (line,) = agent.report_warnings({"mad/target_clip_frac": 0.25})
    assert "0.2500 > agent.mad.clip_warn_fraction 0.02" in line and "[-300, 300]" in line


def test_checkpoint_round_trip_gives_identical_actions_and_updates():
    agent = make_agent(TemperatureSpec(kind="qed", k=0.2), model_every=2)
    batch = make_batch()
    single_update(agent, batch)
    buf = io.BytesIO()
    torch.save(agent.state_dict(), buf)
    buf.seek(0)
    fresh = make_agent(TemperatureSpec(kind="qed", k=0.2), model_every=2, seed=99)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert fresh.updates == 1
    obs = torch.linspace(-1, 1, OBS)[None]
    assert torch.equal(fresh.mode_with(fresh.params(), obs), agent.mode_with(agent.params(), obs))
    assert torch.equal(fresh.sample_with(fresh.params(), obs, fresh.noise(1)),
                       agent.sample_with(agent.params(), obs, agent.noise(1)))
    m1, m2 = single_update(agent, batch), single_update(fresh, batch)  # model step skipped on both (update 2 of model_every 2)
    assert torch.equal(m1, m2)
    for name, mod in agent.modules().items():
        other = fresh.modules()[name].state_dict()
        assert all(torch.equal(v, other[k]) for k, v in mod.state_dict().items()), name


# ---- real runs: resume is exact ----------------------------------------------------------------------------
def _flat_tensors(state, prefix=""):
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, dict):
        for k, v in state.items():
            yield from _flat_tensors(v, f"{prefix}/{k}")


@pytest.mark.parametrize("temperature", [{"kind": "te"}, {"kind": "qed", "k": 0.2}])
def test_resumed_run_matches_a_straight_run(tiny_run, tmp_path, temperature):
    from qed_ray.records.codec import dump
    from qed_ray.records.layout import PackId, SweepDir, seed_dir, trial_dirname
    from qed_ray.rl.run import run

    agent = {"name": "mad_sac", "hidden": 16, "batch_size": 16,
             "mad": {**TINY_MAD, "model_every": 3}}
    fast = {"frame_skip": 10, "eval_every": 1000, "warmup_decisions": 50}  # 100 decisions per 1000 env steps
    spec = tiny_run(agent=agent, temperature=temperature, train={**fast, "env_steps": 2000})
    (straight,) = map(dump, run([spec], tmp_path / "a"))  # as summary.json holds them
    run([tiny_run(agent=agent, temperature=temperature, train={**fast, "env_steps": 1000})], tmp_path / "b")
    (resumed,) = map(dump, run([spec], tmp_path / "b"))
    assert straight["status"] == resumed["status"] == "finished"
    assert straight["final_eval_return_mean"] == resumed["final_eval_return_mean"]
    assert straight["evals"] == resumed["evals"] and len(straight["evals"]) == 2
    assert straight["updates"] == resumed["updates"] == 200 - 50
    folder = trial_dirname(spec.name)
    last = [json.loads((tmp_path / d / folder / "metrics.jsonl").read_text().splitlines()[-1]) for d in "ab"]
    learned = [k for k in last[0] if k.startswith(("loss/", "q/", "alpha/", "mad/"))]
    assert "loss/model_latent_ce" in learned and all(last[0][k] == last[1][k] for k in learned)
    final = SweepDir(tmp_path / "x").pack_checkpoint(PackId.of([spec.name]), 2000).relative_to(tmp_path / "x")
    states = [dict(_flat_tensors(torch.load(tmp_path / d / final / seed_dir(0) / "state.pt", weights_only=True)))
              for d in "ab"]
    assert states[0].keys() == states[1].keys() and "/updates" in states[0]
    assert int(states[0]["/updates"]) == 150
    assert all(torch.equal(v, states[1][k]) for k, v in states[0].items())
