"""Evaluation rollouts on a real task: determinism, shared starts, seeds, returns, physics states, distributions."""

import numpy as np
import pytest
import torch

from qed_ray.agents import make_agent
from qed_ray.config import SacLnSpec, TemperatureSpec
from qed_ray.envs import make_env
from qed_ray.evaluate import EVAL_SEED_BASE, eval_seeds, rollout, rollout_many

TASK = "cartpole-balance"  # obs_dim 5, action_dim 1, physics state (qpos 2, qvel 2)
OBS_DIM, ACTION_DIM = 5, 1
SHORT = 50  # decisions per episode in most tests (keeps the file well under 30 s)


def _agent(seed: int):
    """A freshly initialised small SAC-LN agent; different seeds give different policies."""
    spec = SacLnSpec(hidden=32, batch_size=32)
    return make_agent(spec, TemperatureSpec(), OBS_DIM, ACTION_DIM, torch.device("cpu"), seed)


@pytest.fixture(scope="module")
def agents():
    """Two small policies that differ only by their initialisation seed."""
    return [_agent(0), _agent(1)]


def test_same_policy_same_seeds_gives_identical_rollouts(agents):
    first = rollout(agents[0].act_batch, TASK, [3, 4], max_decisions=SHORT)
    second = rollout(agents[0].act_batch, TASK, [3, 4], max_decisions=SHORT)
    assert first.obs.shape == (2, SHORT, OBS_DIM)
    assert first.actions.shape == (2, SHORT, ACTION_DIM)
    assert first.returns.shape == (2,)
    np.testing.assert_array_equal(first.returns, second.returns)
    np.testing.assert_array_equal(first.obs, second.obs)
    np.testing.assert_array_equal(first.actions, second.actions)


def test_rollout_many_shares_initial_states_then_policies_diverge(agents):
    a, b = rollout_many([agents[0].act_batch, agents[1].act_batch], TASK, [7, 8], max_decisions=SHORT)
    # Episode i of every policy starts from the same state; different episodes start from different ones.
    np.testing.assert_array_equal(a.obs[:, 0], b.obs[:, 0])
    assert not np.array_equal(a.obs[0, 0], a.obs[1, 0])
    # Different policies pick different first actions, so the trajectories separate from step 1 on.
    assert not np.array_equal(a.actions[:, 0], b.actions[:, 0])
    assert not np.array_equal(a.obs[:, 1], b.obs[:, 1])
    assert np.abs(a.obs[:, -1] - b.obs[:, -1]).max() > 1e-3
    assert not np.array_equal(a.returns, b.returns)


def test_lock_step_rollout_equals_single_policy_rollout(agents):
    together = rollout_many([agents[0].act_batch, agents[1].act_batch], TASK, [7], max_decisions=SHORT)
    alone = rollout(agents[1].act_batch, TASK, [7], max_decisions=SHORT)
    np.testing.assert_array_equal(together[1].obs, alone.obs)
    np.testing.assert_array_equal(together[1].actions, alone.actions)
    np.testing.assert_array_equal(together[1].returns, alone.returns)


def test_eval_seeds_are_deterministic_and_disjoint_from_training_seeds():
    assert eval_seeds(4) == [1_000_000, 1_000_001, 1_000_002, 1_000_003]
    assert eval_seeds(4) == eval_seeds(4)
    assert eval_seeds(20)[:4] == eval_seeds(4)  # more episodes extend, never reshuffle, the seed list
    assert len(set(eval_seeds(20))) == 20
    assert set(eval_seeds(20)).isdisjoint(range(1000))
    assert EVAL_SEED_BASE == 1_000_000
    assert eval_seeds(2, base=10) == [10, 11]
    assert eval_seeds(0) == []


def test_returns_equal_sum_of_rewards_of_a_manual_loop(agents):
    policy = agents[0].act_batch
    result = rollout(policy, TASK, [5, 6], max_decisions=SHORT)
    for e, seed in enumerate([5, 6]):
        env = make_env(TASK, seed, 2)
        obs, total, rewards = env.reset(), 0.0, []
        for t in range(SHORT):
            np.testing.assert_array_equal(result.obs[e, t], obs)
            action = policy(obs[None])[0]
            np.testing.assert_array_equal(result.actions[e, t], action)
            step = env.step(action)
            rewards.append(step.reward)
            total += step.reward
            obs = step.obs
        env.close()
        assert result.returns[e] == total
        assert result.returns[e] == pytest.approx(sum(rewards), abs=1e-12)
        # cartpole-balance pays at most 1 per control step: 2 per decision at frame skip 2.
        assert 0.0 < result.returns[e] <= 2.0 * SHORT


def test_full_episode_length_follows_frame_skip(agents):
    assert rollout(agents[0].act_batch, TASK, [0]).obs.shape == (1, 500, OBS_DIM)
    assert rollout(agents[0].act_batch, TASK, [0], frame_skip=4).obs.shape == (1, 250, OBS_DIM)


def test_record_physics_gives_state_vectors_of_the_physics_state_size(agents):
    env = make_env(TASK, 9, 2)
    env.reset()
    initial_state = env.physics.get_state().copy()
    state_size = initial_state.size
    env.close()
    assert state_size == 4  # cartpole: qpos (cart, hinge) + qvel
    with_phys = rollout(agents[0].act_batch, TASK, [9, 10], max_decisions=SHORT, record_physics=True)
    assert with_phys.physics_states.shape == (2, SHORT, state_size)
    np.testing.assert_array_equal(with_phys.physics_states[0, 0], initial_state)
    # The state moves between decisions (the pole is simulated, not frozen).
    assert not np.array_equal(with_phys.physics_states[0, 0], with_phys.physics_states[0, 1])
    assert rollout(agents[0].act_batch, TASK, [9], max_decisions=SHORT).physics_states is None


def test_pooled_obs_stacks_episodes_in_order(agents):
    result = rollout(agents[0].act_batch, TASK, [1, 2], max_decisions=SHORT)
    pooled = result.pooled_obs()
    assert pooled.shape == (2 * SHORT, OBS_DIM)
    np.testing.assert_array_equal(pooled[:SHORT], result.obs[0])
    np.testing.assert_array_equal(pooled[SHORT:], result.obs[1])


def test_policy_distribution_has_positive_sigma_and_finite_mu(agents):
    states = rollout(agents[0].act_batch, TASK, [1], max_decisions=SHORT).pooled_obs()
    mu, sigma = agents[1].policy_distribution(states)
    assert mu.shape == sigma.shape == (SHORT, ACTION_DIM)
    assert mu.dtype == sigma.dtype == np.float64
    assert np.all(np.isfinite(mu))
    assert np.all(sigma > 0)
    # log-std is bounded to [log_std_min, log_std_max] = [-5, 2].
    assert np.all(sigma >= np.exp(-5.0) * (1 - 1e-6)) and np.all(sigma <= np.exp(2.0) * (1 + 1e-6))
    # The deterministic action is tanh(mu).
    np.testing.assert_allclose(agents[1].act_batch(states), np.tanh(mu), rtol=1e-5, atol=1e-6)
