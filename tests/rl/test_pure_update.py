"""The pure-function update: same maths as before, noise layout, vmap over seeds, the exact QED rewrite, TF32,
the metric vector, and a training core that imports without dm_control, Ray or MLflow."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from qed_ray.rl.agents import make_agent
from qed_ray.rl.agents.base import params_of
from qed_ray.spec.config import AgentBase, MadSpec, SacLnSpec, TemperatureSpec
from qed_ray.spec.config import agent_spec as make_agent_spec
from qed_ray.rl.update_metrics import MetricAccumulator, MetricLayout
from kit import ACT, B, OBS, QED, TEMPERATURES, batch_of, spec_of
from oracles.reference_update import OldMadSAC, OldSACLN
from oracles.single_seed import single_update

def agent_spec(name: str, **mad) -> AgentBase:
    return spec_of(name, mad)


def float64_agent(name: str, temperature: TemperatureSpec, seed: int = 0, **mad):
    agent = make_agent(agent_spec(name, **mad), temperature, OBS, ACT, torch.device("cpu"), seed)
    for module in agent.modules().values():
        module.double()  # in place: the optimisers keep the same parameter objects
    return agent


# ---- the pure update equals the previous implementation ---------------------------------------------------
@pytest.mark.parametrize("name, kind, mad", [
    ("sac_ln", "te", {}), ("sac_ln", "fixed", {}), ("sac_ln", "qed", {}),
    ("mad_sac", "te", {}), ("mad_sac", "fixed", {}), ("mad_sac", "qed", {}),
    ("mad_sac", "qed", {"model_every": 2, "actor_critic": "target", "proportion_real": 0.75}),
])
def test_pure_update_equals_the_previous_maths_for_the_same_noise(name, kind, mad):
    temperature = TEMPERATURES[kind]
    new, old_modules = float64_agent(name, temperature, **mad), float64_agent(name, temperature, **mad)
    old = (OldSACLN if name == "sac_ln" else OldMadSAC)(old_modules, temperature.lr)
    for k, m in new.modules().items():  # identical initialisation from the same seed
        assert all(torch.equal(v, old_modules.modules()[k].state_dict()[n]) for n, v in m.state_dict().items())
    init = {k: {n: v.detach().clone() for n, v in new.modules()[k].named_parameters()} for k in ("actor", "critic")}
    g = torch.Generator().manual_seed(7)
    for step in range(10):
        batch = batch_of(100 + step, dtype=torch.float64)
        noise = torch.randn(new.noise_rows(B), ACT, generator=g, dtype=torch.float64)
        got = new.metric_layout.as_dict(single_update(new, batch, noise))
        want = old.update(batch, noise) if name == "sac_ln" else old.update(batch, noise, new.fn.noise_sizes(B))
        assert set(want) <= set(got), sorted(set(want) - set(got))
        for key, value in want.items():
            torch.testing.assert_close(got[key], value.to(torch.float64), rtol=1e-6, atol=1e-9, msg=key)
    if name == "mad_sac":
        assert new.updates == old.updates == 10
    for k, m in new.modules().items():
        other = old_modules.modules()[k].state_dict()
        for n, v in m.state_dict().items():
            torch.testing.assert_close(v, other[n], rtol=1e-6, atol=1e-6, msg=f"{k}.{n}")
    for k, before in init.items():  # and the networks did learn
        assert all(not torch.equal(v, dict(new.modules()[k].named_parameters())[n]) for n, v in before.items()), k


# ---- where QED sat: the shares compare alpha with the floor it was clipped at -----------------------------------
@pytest.mark.parametrize("name", ["sac_ln", "mad_sac"])
@pytest.mark.parametrize("where, k, want", [
    # k = 1000: Delta / (k d) is far below alpha_TE on every state, so alpha = alpha_TE (the floor) everywhere.
    ("floor", 1000.0, {"floor": 1.0, "cap": 0.0, "hot": 0.0}),
    # k = 1e-6: Delta / (k d) is far above alpha_max = 0.5 = 25 alpha_TE, so alpha = alpha_max everywhere.
    ("cap", 1e-6, {"floor": 0.0, "cap": 1.0, "hot": 1.0}),
])
def test_floor_and_cap_shares_of_states_put_there_by_construction(name, where, k, want):
    from qed_ray.rl.agents.packed import PackedAgent

    # target_alpha: qed, so the TD target's alpha(s') is QED's too and its shares are tested beside the actor's
    temperature = TemperatureSpec(**{**QED, "k": k, "alpha_max": 0.5, "init_alpha": 0.02, "target_alpha": "qed"})
    single = make_agent(agent_spec(name), temperature, OBS, ACT, "cpu", 0)
    pack = PackedAgent([make_agent(agent_spec(name), temperature, OBS, ACT, "cpu", s) for s in (1, 2)])
    on = np.ones(2, bool)
    for step in range(4):
        before = single.temperature.floor(single.params()["temperature"]).item()
        rows = [single.metric_layout.as_dict(single_update(single, batch_of(step)))]
        batch = {k: torch.stack([v, v]) for k, v in batch_of(step).items()}
        rows += [pack.metric_layout.as_dict(m) for m in pack.update(batch, pack.noise(B, on))]
        # alpha_TE falls at every step here (the fresh policy's entropy is above -action_dim): compared with the
        # floor after the step, no state would read "at the floor". alpha/te is the alpha_TE the update used.
        assert single.temperature.floor(single.params()["temperature"]).item() < before
        assert rows[0]["alpha/te"].item() == pytest.approx(before, rel=1e-6)
        for m in rows:
            for prefix in ("alpha/actor", "alpha/target"):
                got = {s: m[f"{prefix}_frac_{s}"].item() for s in want}
                assert got == want, (step, prefix, got)


def test_mad_noise_layout_reserves_model_rows_every_update():
    agent = make_agent(agent_spec("mad_sac", proportion_real=0.75), TEMPERATURES["qed"], OBS, ACT, "cpu", 0)
    # model a' (B), model QED (B N), model actions (n_model), a' (B), QED (B N), actor a (n_real), QED (n_real N)
    assert agent.fn.noise_sizes(B) == (16, 64, 4, 16, 64, 12, 48) and agent.noise_rows(B) == 224
    te = make_agent(agent_spec("mad_sac"), TEMPERATURES["te"], OBS, ACT, "cpu", 0)
    assert te.fn.noise_sizes(B) == (16, 0, 8, 16, 0, 8, 0)
    sac = make_agent(agent_spec("sac_ln"), TEMPERATURES["qed"], OBS, ACT, "cpu", 0)
    assert sac.fn.noise_sizes(B) == (16, 64, 16, 64) and sac.noise_rows(B) == B * (2 + 2 * 4)


@pytest.mark.parametrize("name", ["sac_ln", "mad_sac"])
def test_update_and_act_draw_one_block_each_from_the_agents_generator(name):
    from qed_ray.rl.agents.packed import PackedAgent

    a = PackedAgent([make_agent(agent_spec(name, model_every=2), TEMPERATURES["qed"], OBS, ACT, "cpu", 3)])
    b = make_agent(agent_spec(name, model_every=2), TEMPERATURES["qed"], OBS, ACT, "cpu", 3)
    g = torch.Generator().manual_seed(3)  # the seed's generator is seeded with the run seed
    obs, on = batch_of(0)["obs"][:1].numpy(), np.ones(1, bool)
    for step in range(3):
        batch = batch_of(step)
        got = a.update({k: v[None] for k, v in batch.items()}, a.noise(B, on))[0]
        torch.testing.assert_close(got, single_update(b, batch, torch.randn(b.noise_rows(B), ACT, generator=g)),
                                   rtol=1e-5, atol=1e-6)
        action = a.act(obs, on)[0]
        with torch.no_grad():
            want = b.sample_with(b.params(), torch.from_numpy(obs), torch.randn(1, ACT, generator=g))[0]
        np.testing.assert_allclose(action, want.numpy(), rtol=1e-5, atol=1e-6)
    assert torch.equal(a.generators[0].get_state(), g.get_state()), "one block per update, one draw per act"


# ---- vmap over a leading seed axis ------------------------------------------------------------------------
def per_seed_losses(agent):
    """A pure function (params, target, batch, noise) -> (sum of the phase losses, metrics) over ``agent.fn``:
    what a packed update vmaps, phase by phase."""
    fn = agent.fn

    def sac_ln(params, target, batch, noise):
        eps_next, eps_qed_next, eps_a, eps_qed = noise.split(fn.noise_sizes(B))
        critic_loss, metrics = fn.critic_loss(params, target, batch, eps_next, eps_qed_next)
        actor_loss, logp, alpha = fn.actor_loss(params["actor"], params["critic"], params["temperature"],
                                                batch["obs"], eps_a, eps_qed)
        alpha_loss = agent.temperature.loss(params["temperature"], logp)
        return critic_loss + actor_loss + alpha_loss, torch.cat([metrics, alpha])

    def mad_sac(params, target, batch, noise):
        e_mt, e_mq, e_model, e_t, e_tq, e_a, e_aq = noise.split(fn.noise_sizes(B))
        model = fn.model_losses(params, target, batch, e_mt, e_mq)
        critic_loss, metrics, z_real = fn.critic_loss(params, target, batch, e_model, e_t, e_tq)
        actor_loss, logp, alpha = fn.actor_loss(params["actor"], params["critic"], params["temperature"],
                                                z_real, e_a, e_aq)
        alpha_loss = agent.temperature.loss(params["temperature"], logp)
        return model.sum() + critic_loss + actor_loss + alpha_loss, torch.cat([metrics, model, alpha])

    return sac_ln if agent.name == "sac_ln" else mad_sac


def stack(trees):
    if isinstance(trees[0], dict):
        return {k: stack([t[k] for t in trees]) for k in trees[0]}
    return torch.stack([t.detach() for t in trees])


@pytest.mark.parametrize("name", ["sac_ln", "mad_sac"])
@pytest.mark.parametrize("kind", ["te", "qed"])
def test_per_seed_losses_vmap_over_stacked_seeds(name, kind):
    seeds = [0, 1]
    agents = [make_agent(agent_spec(name), TEMPERATURES[kind], OBS, ACT, "cpu", s) for s in seeds]
    batches = [batch_of(10 + s) for s in seeds]
    noises = [torch.randn(a.noise_rows(B), ACT, generator=torch.Generator().manual_seed(20 + s))
              for s, a in zip(seeds, agents)]
    single = []
    for agent, batch, noise in zip(agents, batches, noises):
        params = agent.params()
        loss, metrics = per_seed_losses(agent)(params, params_of(agent.critic_target), batch, noise)
        grads = torch.autograd.grad(loss, [params["actor"]["net.0.weight"], params["critic"]["q1.0.weight"]])
        single.append((loss.detach(), metrics, grads))
    stacked = stack([a.params() for a in agents])
    leaves = [stacked["actor"]["net.0.weight"].requires_grad_(), stacked["critic"]["q1.0.weight"].requires_grad_()]
    target = stack([params_of(a.critic_target) for a in agents])
    losses, metrics = torch.func.vmap(per_seed_losses(agents[0]), randomness="error")(
        stacked, target, stack(batches), stack(noises))
    assert losses.shape == (2,)
    grads = torch.autograd.grad(losses.sum(), leaves)  # the sum: each seed's gradient is exactly its own
    for s, (loss, m, g) in enumerate(single):
        torch.testing.assert_close(losses[s], loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(metrics[s], m, rtol=1e-5, atol=1e-6)
        for got, want in zip(grads, g):
            torch.testing.assert_close(got[s], want, rtol=1e-4, atol=1e-6)


def test_vmap_refuses_a_random_draw_inside_the_loss():
    with pytest.raises(RuntimeError, match="randomness"):
        torch.func.vmap(lambda x: x + torch.randn(()), randomness="error")(torch.zeros(2))


# ---- the exact QED rewrite ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["sac_ln", "mad_sac"])
def test_qed_rewrite_gives_the_straightforward_alpha(name):
    temperature = TemperatureSpec(kind="qed", k=0.1, n_actions=8, alpha_max=1e6, init_alpha=1e-8)
    extra = {"mad": MadSpec(latent_dim=64, encoder_hidden=64, model_hidden=64)} if name == "mad_sac" else {}
    spec = make_agent_spec(name=name, hidden=64, batch_size=64, **extra)
    agent = make_agent(spec, temperature, 17, 6, "cpu", 0)
    params = agent.params()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        states = agent.encode_with(params, torch.randn(64, 17, generator=g))
    eps = torch.randn(64 * 8, 6, generator=g)
    args = (params["temperature"], params["actor"], params["critic"], states, eps)
    fast, slow = agent.fn.alpha(*args, share_state_terms=True), agent.fn.alpha(*args, share_state_terms=False)
    assert bool((slow > 1e-6).all())  # above the floor: the comparison reads the disagreement itself
    rel = ((fast - slow).abs() / slow).max().item()
    assert rel < 1e-5, rel


def test_qed_rewrite_saves_exactly_the_per_state_flops():
    from torch.utils.flop_counter import FlopCounterMode

    o, a, h, b, n = 5, 2, 16, 4, 3
    temperature = TemperatureSpec(kind="qed", k=0.1, n_actions=n)
    agent = make_agent(SacLnSpec(hidden=h, batch_size=b), temperature, o, a, "cpu", 0)
    p = agent.params()
    states, eps = torch.randn(b, o), torch.randn(b * n, a)
    counts = []
    for share in (False, True):
        with FlopCounterMode(display=False) as counter:
            agent.fn.alpha(p["temperature"], p["actor"], p["critic"], states, eps, share_state_terms=share)
        counts.append(counter.get_total_flops())
    actor_per_row = 2 * (o * h + h * h + h * 2 * a)  # the actor's three Linear layers
    critic_state_term = 2 * o * h  # each head's first-layer state term, per row
    assert counts[0] - counts[1] == (b * n - b) * (actor_per_row + 2 * critic_state_term)


# ---- metric vector -------------------------------------------------------------------------------------------
def test_metric_accumulator_keeps_means_maxima_and_minima():
    layout = MetricLayout(("loss/a", "q/gap_max", "alpha/x_min", "q/b"))
    acc = MetricAccumulator(layout, torch.device("cpu"))
    assert acc.means() == {} and acc.non_finite(("loss/",)) == []
    acc.add(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    acc.add(torch.tensor([3.0, -1.0, 5.0, 0.5]))
    acc.add(torch.tensor([5.0, 7.0, -2.0, 1.5]))
    assert acc.count == 3 and acc.non_finite(("loss/", "q/")) == []
    assert acc.means() == {"loss/a": 3.0, "q/gap_max": 7.0, "alpha/x_min": -2.0, "q/b": 2.0}
    assert acc.count == 0 and acc.means() == {}
    acc.add(torch.tensor([float("nan"), 1.0, 1.0, float("inf")]))
    acc.add(torch.tensor([1.0, 1.0, 1.0, 1.0]))
    assert acc.non_finite(("loss/", "q/")) == ["loss/a", "q/b"] and acc.non_finite(("alpha/",)) == []
    with pytest.raises(ValueError, match=r"duplicated \['q/b'\]"):
        MetricLayout(("q/b", "q/b"))
    with pytest.raises(KeyError, match="'q/c' is not one of loss/a"):
        layout.index("q/c")


@pytest.mark.parametrize("name, kind, expected", [
    ("sac_ln", "te", ("loss/critic", "q/mean", "q/abs_diff_mean", "q/abs_diff_max", "q/target_mean",
                      "alpha/target_mean", "alpha/target_min", "alpha/target_max", "grad/critic_norm",
                      "loss/actor", "grad/actor_norm", "policy/entropy", "loss/alpha", "alpha/te",
                      "alpha/actor_mean", "alpha/actor_min", "alpha/actor_max")),
    ("mad_sac", "qed", ("loss/critic", "q/mean", "q/mean_real", "q/mean_model", "q/abs_diff_mean",
                        "q/abs_diff_max", "q/target_mean", "q/target_std", "mad/target_clip_frac",
                        "mad/model_reward_mse", "alpha/target_mean", "alpha/target_min", "alpha/target_max",
                        "alpha/target_frac_floor", "alpha/target_frac_cap", "alpha/target_frac_hot",
                        "grad/critic_norm", "loss/actor", "grad/actor_norm", "policy/entropy", "loss/alpha",
                        "alpha/te", "alpha/actor_mean", "alpha/actor_min", "alpha/actor_max",
                        "alpha/actor_frac_floor", "alpha/actor_frac_cap", "alpha/actor_frac_hot",
                        "loss/model_reward", "loss/model_latent_ce", "loss/model_value_aware",
                        "loss/model_encoder_critic", "grad/encoder_norm", "grad/model_norm")),
])
def test_each_agent_declares_its_metric_columns(name, kind, expected):
    agent = make_agent(agent_spec(name), TEMPERATURES[kind], OBS, ACT, "cpu", 0)
    assert agent.metric_layout.names == expected
    assert single_update(agent, batch_of(0)).shape == (len(expected),)


# ---- one interface ----------------------------------------------------------------------------------------
def test_registry_builds_agents_that_implement_the_protocol():
    from qed_ray.rl.agents import AGENTS
    from qed_ray.rl.agents.base import Agent

    assert list(AGENTS) == ["sac_ln", "mad_sac"]
    for name, acting in (("sac_ln", ("actor",)), ("mad_sac", ("encoder", "actor"))):
        agent = make_agent(agent_spec(name), TEMPERATURES["te"], OBS, ACT, "cpu", 0)
        assert isinstance(agent, Agent) and type(agent) is AGENTS[name] and agent.name == name
        assert agent.acting_modules == acting and set(acting) <= set(agent.modules())
        assert agent.report_warnings({"mad/target_clip_frac": 0.0}) == []
    with pytest.raises(ValueError, match="agent.name: unknown agent 'ppo'; allowed: sac_ln, mad_sac"):
        make_agent(SacLnSpec.model_construct(name="ppo"), TEMPERATURES["te"], OBS, ACT, "cpu", 0)


# ---- the training core needs only torch, numpy and pydantic ----------------------------------------------
def test_training_core_imports_and_updates_with_dm_control_ray_and_mlflow_blocked():
    code = textwrap.dedent("""
        import importlib, importlib.abc, sys
        BLOCKED = ("dm_control", "mujoco", "ray", "mlflow")
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"{name} is blocked")
        sys.meta_path.insert(0, Block())
        for m in ("qed_ray.rl.agents", "qed_ray.rl.agents.base", "qed_ray.rl.agents.sac_ln", "qed_ray.rl.agents.mad_sac",
                  "qed_ray.rl.temperature", "qed_ray.rl.networks", "qed_ray.rl.hlgauss", "qed_ray.rl.world_model",
                  "qed_ray.rl.replay", "qed_ray.rl.update_metrics", "qed_ray.records.checkpoint", "qed_ray.spec.config",
                  "qed_ray.rl.trainer", "qed_ray.rl.agents.learner", "qed_ray.rl.agents.packed", "qed_ray.rl.pack",
                  "qed_ray.rl.pack_checkpoint", "qed_ray.rl.update", "qed_ray.records.writer", "qed_ray.rl.env_pool",
                  "qed_ray.rl.evaluate", "qed_ray.rl.run_folder", "qed_ray.rl.precision", "qed_ray.records.digests"):
            importlib.import_module(m)
        import numpy as np, torch
        from qed_ray.rl.agents import make_agent
        from qed_ray.spec.config import MadSpec, TemperatureSpec, agent_spec
        from qed_ray.rl.agents import make_packed_agent
        from qed_ray.rl.replay import Replay
        replay = Replay(64, 3, 1, [np.random.default_rng(0)], torch.device("cpu"))
        on = np.ones(1, bool)
        for i in range(64):
            replay.add(np.full((1, 3), i, np.float32), np.zeros((1, 1), np.float32), np.ones(1),
                       np.ones((1, 3), np.float32), np.zeros(1, bool), on)
        for name in ("sac_ln", "mad_sac"):
            extra = {"mad": MadSpec(latent_dim=8, encoder_hidden=8, model_hidden=8)} if name == "mad_sac" else {}
            spec = agent_spec(name=name, hidden=8, batch_size=8, **extra)
            pack = make_packed_agent(spec, TemperatureSpec(kind="qed", k=0.2), 3, 1, torch.device("cpu"), [0])
            assert torch.isfinite(pack.update(replay.sample(8, on), pack.noise(8, on))).all()
        print("loaded:", sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "loaded: []"
