"""The one rollout engine on a real task: P policies x E episodes in lock-step on a pool's envs (one policy call per
step), against a manual loop on fresh envs: determinism, shared starts, returns, recorded obs, actions and physics
states, chunked episodes, the sampling policy's shared noise, and the pack's distributions."""

import numpy as np
import pytest
import torch

from qed_ray.rl.agents import make_packed_agent
from qed_ray.spec.config import SacLnSpec, TemperatureSpec
from qed_ray.rl.env_pool import EnvPool
from qed_ray.rl.envs import make_env
from qed_ray.rl.evaluate import (EVAL_SEED_BASE, SamplingPolicy, episode_noise, eval_policy, eval_seeds,
                              rollout_in_chunks, rollout_lockstep)

TASK = "cartpole-balance"  # obs_dim 5, action_dim 1, physics state (qpos 2, qvel 2)
OBS_DIM, ACTION_DIM = 5, 1
SHORT = 50  # decisions per episode in most tests


@pytest.fixture(scope="module")
def pack():
    """Two small SAC-LN policies that differ only in their initialisation seed, as one pack."""
    return make_packed_agent(SacLnSpec(hidden=32, batch_size=32), TemperatureSpec(), OBS_DIM, ACTION_DIM,
                             torch.device("cpu"), [0, 1])


@pytest.fixture(scope="module")
def pool():
    """Four envs (2 policies x 2 episodes) built once with unrelated seeds: every rollout reseeds them."""
    with EnvPool(TASK, [7, 7, 7, 9], 2) as p:
        yield p


INDEX = np.array([[0, 1], [2, 3]])


def _manual(policy, seeds: list[int], steps: int, frame_skip: int = 2):
    """The same policy calls on freshly built envs (env [p, e] of seed ``seeds[e]``), stepped one by one:
    (obs, actions, physics states [P, E, L, ...], returns [P, E])."""
    envs = [[make_env(TASK, s, frame_skip) for s in seeds] for _ in range(2)]
    obs = np.stack([[env.reset() for env in row] for row in envs])
    kept, returns = ([], [], []), np.zeros((2, len(seeds)))
    for _ in range(steps):
        actions = policy(obs)
        kept[0].append(obs.copy()), kept[1].append(actions)
        kept[2].append(np.stack([[env.physics.get_state().copy() for env in row] for row in envs]))
        for p, row in enumerate(envs):
            for e, env in enumerate(row):
                step = env.step(actions[p, e])
                returns[p, e] += step.reward
                obs[p, e] = step.obs
    for env in (env for row in envs for env in row):
        env.close()
    return *(np.stack(k, 2) for k in kept), returns


def test_lockstep_rollouts_equal_a_manual_loop_on_fresh_envs(pack, pool):
    seeds = [5, 6]
    got = rollout_lockstep(pack.act_deterministic, pool, INDEX, seeds, max_decisions=SHORT, record_physics=True)
    assert got.returns.shape == (2, 2) and got.obs.shape == (2, 2, SHORT, OBS_DIM)
    assert got.actions.shape == (2, 2, SHORT, ACTION_DIM) and got.physics_states.shape == (2, 2, SHORT, 4)
    obs, actions, physics, returns = _manual(pack.act_deterministic, seeds, SHORT)
    for name, want in (("obs", obs), ("actions", actions), ("physics_states", physics), ("returns", returns)):
        np.testing.assert_array_equal(getattr(got, name), want, err_msg=name)
    # every policy's episode e starts from the same state; the policies then act differently
    np.testing.assert_array_equal(got.obs[0, :, 0], got.obs[1, :, 0])
    assert not np.array_equal(got.obs[0, 0, 0], got.obs[0, 1, 0])
    assert not np.array_equal(got.actions[0, :, 0], got.actions[1, :, 0])
    again = rollout_lockstep(pack.act_deterministic, pool, INDEX, seeds, max_decisions=SHORT, record=True)
    np.testing.assert_array_equal(again.obs, got.obs)  # the same envs serve every rollout, exactly
    assert again.physics_states is None
    np.testing.assert_array_equal(got.pooled_obs(1)[:SHORT], got.obs[1, 0])
    assert got.pooled_obs(1).shape == (2 * SHORT, OBS_DIM)


def test_one_policy_call_per_step_inactive_rows_and_full_episodes(pack, pool):
    calls = []

    def policy(obs):
        calls.append(obs.shape)
        return pack.act_deterministic(obs)

    full = rollout_lockstep(policy, pool, INDEX, eval_seeds(2))
    assert calls == [(2, 2, OBS_DIM)] * 500, "one call per decision for all policies x episodes, 500 decisions"
    assert full.obs is None and 0 < full.returns.min() and full.returns.max() <= 2 * 500
    stopped = rollout_lockstep(pack.act_deterministic, pool, INDEX, eval_seeds(2), active=np.array([False, True]))
    assert np.isnan(stopped.returns[0]).all() and np.array_equal(stopped.returns[1], full.returns[1])


def test_chunked_episodes_equal_one_pass(pack, pool):
    seeds = eval_seeds(5)
    with EnvPool(TASK, [0] * 10, 2) as wide:
        once = rollout_lockstep(pack.act_deterministic, wide, np.arange(10).reshape(2, 5), seeds, max_decisions=20,
                                record=True)
    chunked = rollout_in_chunks(pack.act_deterministic, pool, INDEX, seeds, max_decisions=20)  # 2 + 2 + 1 episodes
    for field in ("returns", "obs", "actions"):  # other batch shapes round the last bits of a forward differently
        np.testing.assert_allclose(getattr(chunked, field), getattr(once, field), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(chunked.obs[:, :, 0], once.obs[:, :, 0])  # the same initial states


def test_sampling_policy_draws_each_episodes_noise_for_every_policy(pack, pool):
    seeds = [3, 4]
    policy = eval_policy(pack, "sample")
    assert isinstance(policy, SamplingPolicy)
    with pytest.raises(RuntimeError, match="start_episodes"):
        policy(np.zeros((2, 2, OBS_DIM), np.float32))
    got = rollout_lockstep(policy, pool, INDEX, seeds, max_decisions=10, record=True)
    rngs = [episode_noise(s) for s in seeds]

    def by_hand(obs):  # every episode's stream, one draw [A] per decision, shared by both policies
        mu, sigma = pack.distribution(obs)
        eps = np.stack([rng.standard_normal(ACTION_DIM) for rng in rngs])
        return np.tanh(mu + sigma * eps).astype(np.float32)

    np.testing.assert_array_equal(got.actions, _manual(by_hand, seeds, 10)[1])
    assert not np.array_equal(got.actions[:, 0], got.actions[:, 1]), "episodes get different noise"


def test_eval_seeds_are_deterministic_and_disjoint_from_training_seeds():
    assert eval_seeds(4) == [1_000_000, 1_000_001, 1_000_002, 1_000_003]
    assert eval_seeds(20)[:4] == eval_seeds(4)  # more episodes extend, never reshuffle, the seed list
    assert len(set(eval_seeds(20))) == 20 and set(eval_seeds(20)).isdisjoint(range(1000))
    assert EVAL_SEED_BASE == 1_000_000 and eval_seeds(2, base=10) == [10, 11] and eval_seeds(0) == []


def test_full_episode_length_follows_frame_skip(pack):
    for frame_skip, length in ((2, 500), (4, 250)):
        with EnvPool(TASK, [0, 0], frame_skip) as p:
            got = rollout_lockstep(pack.act_deterministic, p, np.array([[0], [1]]), [0], record=True)
        assert got.obs.shape == (2, 1, length, OBS_DIM)


def test_pack_distribution_and_q_values(pack, pool):
    states = rollout_lockstep(pack.act_deterministic, pool, INDEX, [1, 2], max_decisions=SHORT,
                              record=True).pooled_obs(0)
    both = np.stack([states, states])
    mu, sigma = pack.distribution(both)
    assert mu.shape == sigma.shape == (2, 2 * SHORT, ACTION_DIM) and mu.dtype == sigma.dtype == np.float64
    assert np.all(np.isfinite(mu)) and np.all(sigma > 0)
    # log-std is bounded to [log_std_min, log_std_max] = [-5, 2]; the deterministic action is tanh(mu)
    assert np.all(sigma >= np.exp(-5.0) * (1 - 1e-6)) and np.all(sigma <= np.exp(2.0) * (1 + 1e-6))
    np.testing.assert_allclose(pack.act_deterministic(both), np.tanh(mu), rtol=1e-5, atol=1e-6)
    q1, q2 = pack.q_values(both, pack.act_deterministic(both))
    assert q1.shape == q2.shape == (2, 2 * SHORT) and not np.array_equal(q1[0], q1[1])
    template = pack.template  # seed 0's slice is the template's own critic
    x = torch.as_tensor(states)
    with torch.no_grad():
        want = template.fn.q_pair(dict(template.critic.named_parameters()), x,
                                  torch.as_tensor(pack.act_deterministic(both)[0]))[0].numpy()
    np.testing.assert_allclose(q1[0], want, rtol=1e-5, atol=1e-6)
