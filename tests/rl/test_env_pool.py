"""The pack's envs on real dm_control physics: workers give the same bits as in-process stepping, and reseeded envs
start where fresh ones do (the rollout engine on a pool: tests/rl/test_evaluate.py)."""

import numpy as np
import pytest

from qed_ray.rl.env_pool import EnvPool, EnvWorkerError
from qed_ray.rl.envs import make_env
from qed_ray.rl.evaluate import eval_seeds

TASK, FRAME_SKIP = "cartpole-balance", 10  # 100 decisions per episode


def _trace(workers: int) -> list[np.ndarray]:
    out = []
    with EnvPool(TASK, [0, 1, 2], FRAME_SKIP, workers) as pool:
        rng = np.random.default_rng(0)
        out.append(pool.reset([0, 1, 2]))
        for t in range(12):
            idx = [0, 1, 2] if t < 6 else [2, 0]  # any subset, in any order
            step = pool.step(idx, rng.uniform(-1, 1, (len(idx), 1)).astype(np.float32))
            out += [step.obs, step.reward, step.truncated]
        state = pool.random_state(1)
        pool.reseed([1], [42])
        out.append(pool.reset([1]))
        pool.set_random_state(1, state)
        out.append(pool.reset([1]))
        for _ in range(100):  # a whole episode: 1000 control steps at frame skip 10
            last = pool.step([1], np.zeros((1, 1), np.float32))
        assert last.truncated.tolist() == [True] and last.terminated.tolist() == [False]
        # an env whose episode is over refuses to step; a worker's error comes back with its traceback
        with pytest.raises(EnvWorkerError if workers else RuntimeError, match="step.. called on a finished episode"):
            pool.step([1], np.zeros((1, 1), np.float32))
    return out


def test_env_workers_give_the_same_bits_as_stepping_in_process():
    local, workers = _trace(0), _trace(2)
    assert len(local) == len(workers) == 39
    for a, b in zip(local, workers):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    fresh = make_env(TASK, 42, FRAME_SKIP)
    assert np.array_equal(local[-2][0], fresh.reset())  # reseeded to 42: a fresh env's first observation
    fresh.close()


def test_env_workers_report_the_cpu_time_they_used():
    """The trainer's process_time() does not see its env workers; each reports its own, summed (none: 0.0)."""
    with EnvPool(TASK, [0, 1], FRAME_SKIP, 0) as pool:
        assert pool.workers_cpu_s() == 0.0
    with EnvPool(TASK, [0, 1], FRAME_SKIP, 2) as pool:
        before = pool.workers_cpu_s()
        pool.reset([0, 1])
        for _ in range(50):  # 1,000 control steps of physics per env
            pool.step([0, 1], np.zeros((2, 1), np.float32))
        after = pool.workers_cpu_s()
        assert 0 < before < after, "each worker's own process_time(), from its start (imports, envs) on"


def test_a_reseeded_env_starts_exactly_where_a_fresh_one_does():
    reused = make_env(TASK, 5, FRAME_SKIP)
    for seed in eval_seeds(3):
        reused.reseed(seed)
        obs = reused.reset()
        fresh = make_env(TASK, seed, FRAME_SKIP)
        assert np.array_equal(obs, fresh.reset())
        assert np.array_equal(reused.physics.get_state(), fresh.physics.get_state())
        for _ in range(30):  # and the episode is the same episode
            a, b = reused.step(np.array([0.3], np.float32)), fresh.step(np.array([0.3], np.float32))
            assert np.array_equal(a.obs, b.obs) and a.reward == b.reward
        fresh.close()
    reused.close()
