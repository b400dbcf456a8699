"""The trial options: each changes exactly what it names, in the single and the packed (S=2) update, and the
defaults reproduce the pinned default runs (tests/data/default_digests.json)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from default_digests import all_fingerprints, same
from kit import ACT, B, OBS, QED, batch_of, spec_of
from oracles.single_seed import assert_pack_holds_singles, single_update

from qed_ray.rl.agents import make_agent
from qed_ray.rl.agents.base import params_of
from qed_ray.rl.agents import make_packed_agent
from qed_ray.spec.config import HLGaussSpec, MadSpec, RunSpec, SacLnSpec, TemperatureSpec
from qed_ray.rl.hlgauss import cross_entropy
from qed_ray.rl.networks import squashed_sample
from qed_ray.rl.replay import holdout_draw, keeps_transition

FLOOR = TemperatureSpec(**QED, target_alpha="floor")  # the default (App. C)
TARGET_QED = TemperatureSpec(**QED, target_alpha="qed")  # the ablation: QED alpha(s') in the TD target
HL = {"critic": "hlgauss", "hl": HLGaussSpec(vmin=-5.0, vmax=5.0, num_bins=21)}


def agent_of(name: str, temperature: TemperatureSpec, seed: int = 0, **overrides):
    return make_agent(spec_of(name, **overrides), temperature, OBS, ACT, torch.device("cpu"), seed)


# ---- the defaults: bit for bit what the code before the options computed ---------------------------------
def test_defaults_reproduce_the_pinned_runs():
    want = json.loads((Path(__file__).parents[1] / "data" / "default_digests.json").read_text())
    got = all_fingerprints()
    assert sorted(got) == sorted(want) and all(same(got[k], want[k]) for k in want), {
        k: (got[k]["norm"], want[k]["norm"]) for k in want}


def test_default_specs_keep_their_identity_and_the_options_name_themselves():
    run = RunSpec.model_validate({"task": "cartpole-balance", "temperature": QED})
    assert "critic" not in run.agent.model_dump(exclude_defaults=True) and run.agent.critic_layers == 2
    target = RunSpec.model_validate({"task": "cartpole-balance", "temperature": {**QED, "target_alpha": "qed"}})
    assert run.temperature.target_alpha == "floor" and "target_alpha" not in run.temperature.label
    assert "+target_alpha=qed" in target.temperature.label
    with pytest.raises(ValueError, match="target_alpha"):
        TemperatureSpec(kind="te", target_alpha="qed")  # te has no QED to move out of the target
    with pytest.raises(ValueError, match="hl: applies only to critic 'hlgauss'"):
        SacLnSpec(hl=HLGaussSpec(vmin=-5.0))
    with pytest.raises(ValueError, match="actor_rows"):
        MadSpec(actor_rows="some")


# ---- target_alpha: floor --------------------------------------------------------------------------------
def test_floor_target_puts_alpha_te_in_the_td_target_and_qed_in_the_actor_loss():
    qed, floor = agent_of("sac_ln", TARGET_QED), agent_of("sac_ln", TemperatureSpec(**QED))
    assert qed.fn.noise_sizes(B) == (B, B * 4, B, B * 4) and floor.fn.noise_sizes(B) == (B, 0, B, B * 4)
    batch, g = batch_of(1), torch.Generator().manual_seed(2)
    eps_next, eps_a, eps_qed = (torch.randn(n, ACT, generator=g) for n in (B, B, B * 4))
    params, target_p = floor.params(), params_of(floor.critic_target)
    loss, metrics = floor.fn.critic_loss(params, target_p, batch, eps_next, torch.empty(0, ACT))
    # By hand: y = r + gamma (min_j Qtarg_j(s', a') - alpha_TE log pi(a'|s')), then 0.5 sum_j mean (Q_j - y)^2.
    with torch.no_grad():
        a_next, logp_next = squashed_sample(*floor.actor(batch["next_obs"]), eps_next)
        tq1, tq2 = floor.critic_target(batch["next_obs"], a_next)
        alpha_te = floor.temperature.floor(params["temperature"])
        y = batch["reward"] + 0.99 * (torch.minimum(tq1, tq2) - alpha_te * logp_next)
        q1, q2 = floor.critic(batch["obs"], batch["action"])
    want = 0.5 * ((q1 - y).pow(2).mean() + (q2 - y).pow(2).mean())
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-7)
    stats = dict(zip(floor.metric_layout.names, metrics))
    assert stats["alpha/target_mean"] == pytest.approx(float(alpha_te), rel=1e-6)
    # The actor loss still reads QED's alpha(s): the same as the target-side agent's, and above the floor here.
    got = floor.fn.actor_loss(params["actor"], params["critic"], params["temperature"], batch["obs"], eps_a, eps_qed)
    ref = qed.fn.actor_loss(qed.params()["actor"], qed.params()["critic"], qed.params()["temperature"],
                            batch["obs"], eps_a, eps_qed)
    for x, r in zip(got, ref):
        torch.testing.assert_close(x, r)
    assert (got[2] > alpha_te).any(), "QED's alpha in the actor loss, not the floor"
    # ... while the target-side agent's target alpha is QED's at s' (another loss for the same noise)
    qed_loss, _ = qed.fn.critic_loss(qed.params(), params_of(qed.critic_target), batch, eps_next,
                                     torch.randn(B * 4, ACT, generator=g))
    assert not torch.equal(qed_loss, loss)


def test_floor_target_in_mad_sac_drops_the_qed_rows_at_z_next():
    mad = agent_of("mad_sac", FLOOR, mad={"proportion_real": 0.75})
    # model a' (B), QED(z') 0, model actions (4), a' (B), QED(z') 0, actor (12), QED(z) (12 x 4)
    assert mad.fn.noise_sizes(B) == (16, 0, 4, 16, 0, 12, 48)
    alpha_te = float(mad.temperature.floor(mad.params()["temperature"]))  # before the update's alpha step
    metrics = {k: float(v) for k, v in mad.metric_layout.as_dict(single_update(mad, batch_of(3))).items()}
    assert metrics["alpha/target_mean"] == alpha_te and metrics["alpha/target_max"] == alpha_te
    assert metrics["alpha/actor_max"] > alpha_te, "the actor step still reads QED's alpha(z)"


# ---- MAD-SAC's actor rows ---------------------------------------------------------------------------------
def test_mad_actor_rows_all_feeds_every_critic_row_to_the_actor_step():
    temperature = TARGET_QED  # QED at z' too, so every noise block is in use
    real = agent_of("mad_sac", temperature, mad={"proportion_real": 0.75})
    every = agent_of("mad_sac", temperature, mad={"proportion_real": 0.75, "actor_rows": "all"})
    assert every.fn.noise_sizes(B) == (16, 64, 4, 16, 64, 16, 64) and every.fn.actor_rows(B) == 16
    assert real.fn.actor_rows(B) == 12
    g = torch.Generator().manual_seed(4)
    sizes = real.fn.noise_sizes(B)
    e_model, e_t, e_tq = (torch.randn(n, ACT, generator=g) for n in sizes[2:5])
    args = (batch_of(5), e_model, e_t, e_tq)
    _, _, z_real = real.fn.critic_loss(real.params(), params_of(real.critic_target), *args)
    loss, _, z_all = every.fn.critic_loss(every.params(), params_of(every.critic_target), *args)
    assert z_real.shape == (12, 16) and z_all.shape == (16, 16)
    torch.testing.assert_close(z_all[:12], z_real, rtol=0, atol=0)  # the same latents, four more rows
    # the critic loss itself does not depend on the actor rows
    torch.testing.assert_close(loss, real.fn.critic_loss(real.params(), params_of(real.critic_target), *args)[0])


# ---- SAC-LN with HL-Gauss heads, critic_depth -------------------------------------------------------------
def test_hlgauss_sac_ln_heads_decode_to_finite_q_and_train_by_cross_entropy():
    agent = agent_of("sac_ln", TemperatureSpec(**QED), **HL)
    hl = agent.fn.hl
    assert hl is not None and hl.num_bins == 21 and "q/target_clip_frac" in agent.metric_layout.names
    batch = batch_of(6)
    q1, q2 = agent.fn.q_pair(agent.params()["critic"], batch["obs"], batch["action"])
    assert q1.shape == (B,) and torch.isfinite(q1).all() and torch.isfinite(q2).all()
    assert (q1.abs() < 5.0).all() and (q1 - q2).abs().max() > 0
    target = torch.linspace(-6, 6, B)  # -6, -5.2, 5.2 and 6 fall outside the support [-5, 5]
    loss, d1, d2 = agent.fn.td_loss(agent.params()["critic"], batch["obs"], batch["action"], target)
    l1, l2 = agent.critic(batch["obs"], batch["action"])
    want = cross_entropy(l1, hl.encode(target)).mean() + cross_entropy(l2, hl.encode(target)).mean()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(d1, q1)
    torch.testing.assert_close(d2, q2)
    assert float(hl.clip_fraction(target)) == pytest.approx(4 / B)
    for step in range(5):
        metrics = agent.metric_layout.as_dict(single_update(agent, batch_of(10 + step)))
    assert all(np.isfinite(v) for v in metrics.values())


def test_critic_depth_sets_the_critic_heads_only():
    deep = agent_of("sac_ln", TemperatureSpec(), critic_depth=3)
    lin = lambda m: sum(isinstance(x, torch.nn.Linear) for x in m.modules())  # noqa: E731
    assert lin(deep.actor) == 3 and lin(deep.critic) == 2 * 4  # actor: 2 hidden + head; critic: 3 + head, twice
    mad = agent_of("mad_sac", TemperatureSpec(), critic_depth=1)
    assert lin(mad.critic) == 2 * 2 and lin(mad.actor) == 3


# ---- every loss-changing option in a pack of S=2 seeds equals two single-seed runs --------------------------
@pytest.mark.parametrize("name, temperature, overrides", [
    ("sac_ln", TARGET_QED, {}), ("sac_ln", TemperatureSpec(**QED), HL),
    ("mad_sac", TARGET_QED, {"mad": {"actor_rows": "all", "proportion_real": 0.75}}),
])
def test_packed_update_with_an_option_follows_two_single_seed_runs(name, temperature, overrides):
    seeds = (3, 7)
    singles = [agent_of(name, temperature, s, **{k: dict(v) if k == "mad" else v for k, v in overrides.items()})
               for s in seeds]
    pack = make_packed_agent(spec_of(name, **{k: dict(v) if k == "mad" else v for k, v in overrides.items()}),
                             temperature, OBS, ACT, torch.device("cpu"), seeds)
    on = np.ones(2, bool)
    for step in range(4):
        batch = batch_of(20 + step, lead=(2,))
        metrics = pack.update(batch, pack.noise(B, on))
        for i, single in enumerate(singles):
            want = single_update(single, {k: v[i] for k, v in batch.items()})
            torch.testing.assert_close(metrics[i], want, rtol=1e-5, atol=1e-5)
    assert_pack_holds_singles(pack, singles, rtol=1e-5)


# ---- MAD-TD's held-out share and time-limit masking -------------------------------------------------------
def test_held_out_share_and_time_limit_masking_decide_what_enters_the_replay():
    from qed_ray.spec.config import TrainSpec

    off = TrainSpec()
    assert all(keeps_transition(off, 0, d, truncated=d % 7 == 0) for d in range(200))
    masked = TrainSpec(mask_time_limits=True)
    assert not keeps_transition(masked, 0, 499, truncated=True) and keeps_transition(masked, 0, 498, False)
    held = TrainSpec(holdout_fraction=0.05)
    kept = [keeps_transition(held, 4, d, False) for d in range(20_000)]
    assert 0.94 < np.mean(kept) < 0.96
    # stateless: the same (seed, decision) always gives the same answer; another seed another subset
    assert kept == [keeps_transition(held, 4, d, False) for d in range(20_000)]
    assert kept != [keeps_transition(held, 5, d, False) for d in range(20_000)]
    assert 0.0 <= holdout_draw(4, 0) < 1.0 and holdout_draw(4, 0) == holdout_draw(4, 0)


def test_the_trainer_leaves_held_out_and_time_limit_transitions_out_of_each_seeds_replay():
    from qed_ray.rl.trainer import build_trainer

    train = {"env_steps": 2000, "eval_every": 2000, "eval_episodes": 1, "warmup_decisions": 200, "frame_skip": 10,
             "holdout_fraction": 0.25, "mask_time_limits": True}
    specs = [RunSpec.model_validate({"task": "cartpole-balance", "seed": seed, "agent": {"hidden": 8, "batch_size": 8},
                                     "train": train}) for seed in (0, 1)]
    pack = build_trainer(specs, lambda *a, **k: None, None, log=lambda s: None)
    pack.run()  # 200 decisions = two 100-decision episodes per seed, all before the first update
    pack.close()
    for i, spec in enumerate(specs):
        want = sum(keeps_transition(spec.train, spec.seed, d, truncated=d % 100 == 99) for d in range(200))
        assert int(pack.replay.added[i]) == want and 130 < want < 170


# ---- the shipped ablation spec ------------------------------------------------------------------------------
def test_ablations_spec_crosses_m1_m2_and_m3_with_both_evaluation_policies(capsys):
    from qed_ray.spec.sweep import load_spec
    from qed_ray.service.sweep_cli import main

    root = Path(__file__).parents[2] / "sweeps"
    spec = load_spec(root / "ablations.yaml")
    runs = spec.runs()
    assert len(runs) == 720 and spec.final_eval.policies == ("mean", "sample")
    cells = {(r.agent.critic, r.agent.critic_layers, r.temperature.kind, r.temperature.target_alpha,
              r.train.precision) for r in runs}
    assert cells == {(c, d, k, t, p) for c in ("mse", "hlgauss") for d in (2, 3)
                     for k, t in (("te", "floor"), ("qed", "qed"), ("qed", "floor")) for p in ("fp32", "tf32")}
    assert {r.task for r in runs} == {"cheetah-run", "walker-walk", "hopper-hop"}
    assert all(load_spec(p).final_eval.bootstrap_reps == 50_000 for p in root.glob("*.yaml")), "rliable's default"
    code = main([str(root / "ablations.yaml"), "--dry-run", "--list"])
    out, err = capsys.readouterr()
    # The plan is printed whole either way; a machine without a GPU then refuses the spec's GPU packs for itself.
    import torch

    assert (code, err.splitlines()[-1:]) == ((0, []) if torch.cuda.is_available() else (2, [
        "error: resources.gpu: a pack asks for 0.1 GPU and this machine has none; set resources.gpu: 0 to train on "
        "CPUs, or run on a GPU cluster"]))
    assert "sweep ablations: 720 trials" in out
    assert "qed0.2+target_alpha=qed+critic=hlgauss+critic_depth=3+precision=tf32/9" in out
