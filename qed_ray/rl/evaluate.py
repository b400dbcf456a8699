"""Evaluation rollouts (paper Sec. 6.1-6.2, App. E): one engine, P policies x E episodes in lock-step on a pool's
envs, one batched policy call per step (:func:`rollout_lockstep`), from the same initial states for every policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import numpy as np

from qed_ray.rl.env_pool import EnvPool

PolicyFn = Callable[[np.ndarray], np.ndarray]  # obs [P, E, O] -> actions [P, E, A]
DistributionFn = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]  # obs [P, E, O] -> (mu, sigma) [P, E, A]
EvalPolicy = Literal["mean", "sample"]

EVAL_SEED_BASE = 1_000_000  # eval env seeds never collide with training seeds (0..N)
EVAL_NOISE_KEY = 0xE7A1  # keys the sampling noise of an episode apart from the env's own use of its seed


def eval_seeds(n: int, base: int = EVAL_SEED_BASE) -> list[int]:
    """The shared env seeds of ``n`` evaluation episodes (identical for every training seed)."""
    return [base + i for i in range(n)]


def episode_noise(seed: int) -> np.random.Generator:
    """The standard-normal stream of the evaluation episode with env seed ``seed``; the same for every policy."""
    return np.random.default_rng([EVAL_NOISE_KEY, seed])


class SamplingPolicy:
    """Acts with policy samples a = tanh(mu(s) + sigma(s) eps), eps [A] per decision from :func:`episode_noise` of
    the episode's env seed: the same for every policy (docs/definitions.md, "evaluation policy"). ``distribution``:
    observations [P, E, O] -> pre-tanh (mu, sigma) [P, E, A] (a pack's)."""

    def __init__(self, distribution: DistributionFn):
        self.distribution = distribution
        self.rngs: list[np.random.Generator] | None = None

    def start_episodes(self, seeds: Sequence[int]) -> None:
        """Restarts the noise at the streams of the episodes with env seeds ``seeds``, before their first step."""
        self.rngs = [episode_noise(s) for s in seeds]

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        if self.rngs is None:
            raise RuntimeError("SamplingPolicy: start_episodes(seeds) was not called before the first action")
        mu, sigma = self.distribution(obs)
        eps = np.stack([rng.standard_normal(mu.shape[-1]) for rng in self.rngs])  # [E, A], shared by the P policies
        return np.tanh(mu + sigma * eps).astype(np.float32)


def eval_policy(pack, kind: EvalPolicy) -> PolicyFn:
    """The evaluation policy ``kind`` of a pack: ``mean``, tanh(mu), or ``sample`` (:class:`SamplingPolicy`)."""
    if kind == "mean":
        return pack.act_deterministic
    if kind == "sample":
        return SamplingPolicy(pack.distribution)
    raise ValueError(f"final_eval.policies: {kind!r} is not one of 'mean', 'sample'")


@dataclass
class Rollouts:
    """Evaluation episodes of P policies x E episodes, L decisions each (all but the returns only when recorded)."""

    returns: np.ndarray  # [P, E] sums of rewards over the rolled-out decisions; NaN rows for inactive policies
    obs: np.ndarray | None = None  # [P, E, L, O] where the policies acted
    actions: np.ndarray | None = None  # [P, E, L, A]
    physics_states: np.ndarray | None = None  # [P, E, L, Q] MuJoCo state vectors (qpos, qvel, act) before each action

    def pooled_obs(self, p: int) -> np.ndarray:
        """[E * L, O] every observation policy ``p`` visited."""
        return self.obs[p].reshape(-1, self.obs.shape[-1])


def rollout_lockstep(policy: PolicyFn, pool: EnvPool, env_index: np.ndarray, seeds: Sequence[int],
                     active: np.ndarray | None = None, max_decisions: int | None = None, record: bool = False,
                     record_physics: bool = False) -> Rollouts:
    """Episodes of P policies x E seeds, all in lock-step on the pool's envs ``env_index`` [P, E], one policy call
    per step; returns [P, E] in the order of ``seeds``.

    Env ``env_index[p, e]`` is reseeded to ``seeds[e]`` and reset, which draws exactly the initial state a freshly
    built env of that seed draws (:meth:`DMCEnv.reseed`), so every policy's episode e starts from the same state.
    ``policy``: observations [P, E, O] -> actions [P, E, A] (rows of inactive policies and finished episodes hold
    stale observations, their actions ignored); one with ``start_episodes(seeds)`` is told the env seeds first.
    ``active`` [P]: the policies rolled out (default all); ``record`` keeps observations and actions,
    ``record_physics`` the physics states too.
    """
    n_pol, n_ep = env_index.shape
    active = np.ones(n_pol, bool) if active is None else np.asarray(active, bool)
    live = env_index[active].ravel()
    pool.reseed(live, list(seeds) * int(active.sum()))
    if hasattr(policy, "start_episodes"):
        policy.start_episodes(seeds)
    obs = np.zeros((n_pol, n_ep, pool.obs_dim), np.float32)
    obs[active] = pool.reset(live).reshape(-1, n_ep, pool.obs_dim)
    returns = np.zeros((n_pol, n_ep))
    returns[~active] = np.nan
    running = np.repeat(active[:, None], n_ep, axis=1)
    record = record or record_physics
    kept: dict[str, list] = {"obs": [], "actions": [], "physics": []}
    decisions = 0
    while running.any() and (max_decisions is None or decisions < max_decisions):
        actions = np.asarray(policy(obs))
        if record_physics:
            kept["physics"].append(pool.physics_states(env_index.ravel()).reshape(n_pol, n_ep, -1))
        if record:
            kept["obs"].append(obs.copy()), kept["actions"].append(actions.copy())
        step = pool.step(env_index[running], actions[running])
        returns[running] += step.reward
        obs[running] = step.obs
        running[running.copy()] = ~(step.terminated | step.truncated)
        decisions += 1
    if not record:
        return Rollouts(returns)
    # dm_control episodes end only at their time limit, so every recorded episode has the same length.
    return Rollouts(returns, np.stack(kept["obs"], 2), np.stack(kept["actions"], 2),
                    np.stack(kept["physics"], 2) if record_physics else None)


def rollout_in_chunks(policy: PolicyFn, pool: EnvPool, env_index: np.ndarray, seeds: Sequence[int],
                      max_decisions: int | None = None, record_physics: bool = False) -> Rollouts:
    """:func:`rollout_lockstep` of P policies over any number of episodes, recorded: the pool's E columns
    (``env_index`` [P, E]) run them E at a time, so a pool of bounded size serves every rollout of an evaluation;
    returns [P, len(seeds)]."""
    width = env_index.shape[1]
    parts = [rollout_lockstep(policy, pool, env_index[:, :len(chunk)], chunk, max_decisions=max_decisions,
                              record=True, record_physics=record_physics)
             for chunk in (list(seeds[i:i + width]) for i in range(0, len(seeds), width))]
    joined = {k: np.concatenate([getattr(r, k) for r in parts], axis=1) if getattr(parts[0], k) is not None
              else None for k in ("returns", "obs", "actions", "physics_states")}
    return Rollouts(**joined)
