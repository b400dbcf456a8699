"""Evaluation rollouts (paper Sec. 6.1-6.2, App. E).

Policies act with tanh(mu) (the ``mean`` evaluation policy, used for every evaluation during training), or, for
the final evaluation's ``sample`` policy, draw a ~ pi(.|s) with noise from a stream fixed by the episode's env seed
(:class:`SamplingPolicy`), so every seed's policy meets the same noise. Every episode starts from an env built
with its own seed, so several policies rolled out with the same seeds start from identical initial states and can
be compared step by step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal, Sequence

import numpy as np

from qed_ray.envs import make_env

if TYPE_CHECKING:
    from qed_ray.env_pool import EnvPool

PolicyFn = Callable[[np.ndarray], np.ndarray]  # obs [B, O] -> actions [B, A]
DistributionFn = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]  # obs [B, O] -> pre-tanh (mu, sigma) [B, A]
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
    """Acts with a policy sample a = tanh(mu(s) + sigma(s) eps), eps [1, A] per decision from the current episode's
    :func:`episode_noise`: policies rolled out from the same eval seeds see the same noise, step by step, and a
    rollout is reproducible.

    Args:
        distribution: pre-tanh (mu, sigma) [B, A] of observations [B, O] (an agent's ``policy_distribution``).
    """

    def __init__(self, distribution: DistributionFn):
        self.distribution = distribution
        self.rng: np.random.Generator | None = None

    def start_episode(self, seed: int) -> None:
        """Restarts the noise at the stream of the episode with env seed ``seed`` (:func:`rollout_many` calls it)."""
        self.rng = episode_noise(seed)

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        """Actions [B, A] (float32) for observations [B, O]."""
        if self.rng is None:
            raise RuntimeError("SamplingPolicy: start_episode(seed) was not called before the first action")
        mu, sigma = self.distribution(obs)
        return np.tanh(mu + sigma * self.rng.standard_normal(mu.shape)).astype(np.float32)


def eval_policy(agent, kind: EvalPolicy) -> PolicyFn:
    """The evaluation policy ``kind`` of ``agent``: ``mean``, tanh(mu) (``agent.act_batch``), or ``sample``
    (:class:`SamplingPolicy` over ``agent.policy_distribution``)."""
    if kind == "mean":
        return agent.act_batch
    if kind == "sample":
        return SamplingPolicy(agent.policy_distribution)
    raise ValueError(f"final_eval.policies: {kind!r} is not one of 'mean', 'sample'")


@dataclass
class Rollouts:
    """Evaluation episodes of one policy.

    Attributes:
        returns: [E] episode returns (sum of rewards over the rolled-out decisions).
        obs: [E, L, O] observations at which the policy acted.
        actions: [E, L, A] actions taken.
        physics_states: [E, L, P] MuJoCo state vectors (qpos, qvel, act) before each action, if recorded.
    """

    returns: np.ndarray
    obs: np.ndarray
    actions: np.ndarray
    physics_states: np.ndarray | None = None

    def pooled_obs(self) -> np.ndarray:
        """[E * L, O] all visited observations."""
        return self.obs.reshape(-1, self.obs.shape[-1])


def rollout(policy: PolicyFn, task: str, seeds: Sequence[int], max_decisions: int | None = None,
            frame_skip: int = 2, record_physics: bool = False) -> Rollouts:
    """Runs one episode per seed (optionally truncated to ``max_decisions``).

    Args:
        policy: maps observations [B, O] to actions [B, A] (called with B = 1 per step); see :func:`rollout_many`
            for policies with a ``start_episode`` method.
        task: task name.
        seeds: env seeds, one episode each.
        max_decisions: stop each episode after this many decisions (default: the full episode).
        frame_skip: control steps per decision.
        record_physics: also record physics state vectors (for state-spread plots).

    Returns:
        :class:`Rollouts`; all episodes must have equal length.
    """
    return rollout_many([policy], task, seeds, max_decisions, frame_skip, record_physics)[0]


def rollout_many(policies: Sequence[PolicyFn], task: str, seeds: Sequence[int], max_decisions: int | None = None,
                 frame_skip: int = 2, record_physics: bool = False) -> list[Rollouts]:
    """Rolls out every policy from the same seeds, stepping all policies' envs in lock-step.

    Stepping in lock-step lets a batch of policies be queried at once per step and guarantees that policy p's
    episode i starts from the same initial state as every other policy's episode i. A policy with a
    ``start_episode(seed)`` method (:class:`SamplingPolicy`) is told each episode's env seed before its first step.

    Returns:
        one :class:`Rollouts` per policy.
    """
    n_pol = len(policies)
    per_pol = [dict(returns=[], obs=[], actions=[], phys=[]) for _ in range(n_pol)]
    for seed in seeds:
        envs = [make_env(task, seed, frame_skip) for _ in range(n_pol)]
        obs = [env.reset() for env in envs]
        for policy in policies:
            if hasattr(policy, "start_episode"):
                policy.start_episode(seed)
        ep = [dict(ret=0.0, obs=[], act=[], phys=[]) for _ in range(n_pol)]
        done = False
        t = 0
        while not done and (max_decisions is None or t < max_decisions):
            for p in range(n_pol):
                a = np.asarray(policies[p](obs[p][None]))[0]
                if record_physics:
                    ep[p]["phys"].append(envs[p].physics.get_state().copy())
                ep[p]["obs"].append(obs[p])
                ep[p]["act"].append(a)
                step = envs[p].step(a)
                ep[p]["ret"] += step.reward
                obs[p] = step.obs
                done = step.terminated or step.truncated
            t += 1
        for p in range(n_pol):
            per_pol[p]["returns"].append(ep[p]["ret"])
            per_pol[p]["obs"].append(np.stack(ep[p]["obs"]))
            per_pol[p]["actions"].append(np.stack(ep[p]["act"]))
            if record_physics:
                per_pol[p]["phys"].append(np.stack(ep[p]["phys"]))
            envs[p].close()
    return [Rollouts(np.asarray(d["returns"]), np.stack(d["obs"]), np.stack(d["actions"]),
                     np.stack(d["phys"]) if record_physics else None) for d in per_pol]


def rollout_lockstep(policy: Callable[[np.ndarray], np.ndarray], pool: "EnvPool", env_index: np.ndarray,
                     seeds: Sequence[int], active: np.ndarray | None = None) -> np.ndarray:
    """Deterministic episodes of P policies x E seeds, all in lock-step on a pool's envs, one policy call per step.

    Instead of building an env per episode, env ``env_index[p, e]`` is reseeded to ``seeds[e]`` and reset, which
    draws exactly the initial state a freshly built env of that seed draws (:meth:`DMCEnv.reseed`), so every
    policy's episode e starts where :func:`rollout`'s episode e starts.

    Args:
        policy: observations [P, E, O] -> actions [P, E, A] (row p is policy p's; rows of inactive policies and of
            finished episodes hold stale observations and their actions are ignored).
        pool: the envs.
        env_index: [P, E] pool indices of the envs to use.
        seeds: the E episodes' env seeds (:func:`eval_seeds`).
        active: [P] policies to roll out (default: all).

    Returns:
        [P, E] episode returns (sums of rewards, in :func:`rollout`'s order); NaN rows for inactive policies.
    """
    n_pol, n_ep = env_index.shape
    active = np.ones(n_pol, bool) if active is None else np.asarray(active, bool)
    live = env_index[active].ravel()
    pool.reseed(live, list(seeds) * int(active.sum()))
    obs = np.zeros((n_pol, n_ep, pool.obs_dim), np.float32)
    obs[active] = pool.reset(live).reshape(-1, n_ep, pool.obs_dim)
    returns = np.zeros((n_pol, n_ep))
    returns[~active] = np.nan
    running = np.repeat(active[:, None], n_ep, axis=1)
    while running.any():
        actions = np.asarray(policy(obs))
        step = pool.step(env_index[running], actions[running])
        returns[running] += step.reward
        obs[running] = step.obs
        running[running.copy()] = ~(step.terminated | step.truncated)
    return returns
