"""The dm_control layer: every task loads and obeys the wrapper contract (docs/definitions.md, Environment)."""

import numpy as np
import pytest

from qed_ray.rl.envs import TASKS, check_task, make_env


def test_registry_is_the_papers_18_tasks():
    assert len(TASKS) == 18 and len(set(TASKS)) == 18
    assert {"cheetah-run", "hopper-hop", "quadruped-run", "finger-turn_hard", "walker-walk"} <= set(TASKS)


def test_unknown_task_lists_valid_names():
    with pytest.raises(ValueError) as e:
        check_task("cheetah-fly")
    assert "cheetah-fly" in str(e.value) and "cheetah-run" in str(e.value) and "walker-walk" in str(e.value)


def _episode(task: str, seed: int, actions: np.ndarray):
    env = make_env(task, seed)
    obs = [env.reset()]
    rewards, trunc = [], []
    for a in actions:
        step = env.step(a)
        obs.append(step.obs)
        rewards.append(step.reward)
        trunc.append(step.truncated)
        assert not step.terminated  # time limits are truncations
        if step.truncated:
            break
    env.close()
    return env, np.stack(obs), np.asarray(rewards), np.asarray(trunc)


@pytest.mark.parametrize("task", TASKS)
def test_task_contract(task):
    env = make_env(task, seed=3)
    rng = np.random.default_rng(0)
    actions = rng.uniform(-1, 1, (600, env.action_dim))
    env.close()
    env, obs, rewards, trunc = _episode(task, 3, actions)
    assert obs.dtype == np.float32 and obs.shape == (501, env.obs_dim)
    assert np.all(np.isfinite(obs))
    assert len(rewards) == 500, "500 decisions per episode at frame skip 2"
    assert trunc[-1] and not trunc[:-1].any()
    assert np.all(rewards >= 0.0) and np.all(rewards <= 2.0), "per-decision reward is a sum of two [0,1] rewards"
    _, obs2, rewards2, _ = _episode(task, 3, actions[:50])
    np.testing.assert_array_equal(obs2, obs[:51])
    np.testing.assert_array_equal(rewards2, rewards[:50])


def test_frame_skip_sums_two_control_rewards():
    from dm_control import suite

    raw = suite.load("cartpole", "balance", task_kwargs={"random": 7})
    raw.reset()
    a = np.array([0.3])
    expected = sum(raw.step(a).reward for _ in range(2))
    env = make_env("cartpole-balance", 7)
    env.reset()
    assert env.step(a).reward == pytest.approx(expected, abs=1e-12)


def test_actions_are_mapped_from_unit_box_and_seeds_differ():
    env = make_env("cheetah-run", 0)
    assert np.all(env._low == -1) and np.all(env._high == 1)
    o0 = env.reset()
    o1 = make_env("cheetah-run", 1).reset()
    assert not np.array_equal(o0, o1)


def test_env_random_state_roundtrip_reproduces_next_episode():
    env = make_env("walker-walk", 5)
    env.reset()
    state = env.random_state()
    first = env.reset()
    env.set_random_state(state)
    np.testing.assert_array_equal(env.reset(), first)
