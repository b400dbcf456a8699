"""Benchmark: the full per-task final evaluation on CPU, phase by phase.

For one task and one method: ``--policies`` seeds' policies (freshly initialised SAC-LN agents at the default
256 width: their cost equals a trained agent's) are rolled out with :func:`qed_ray.evaluate.rollout_many` for
``--episodes`` episodes of 500 decisions from the shared eval seeds; the visited states are pooled; every
policy's pre-tanh (mu, sigma) is computed at the pooled states and the inter-run variability V is computed;
then the ``--episodes`` x ``--distance-steps`` action-distance rollouts are run and the cumulative action
distance computed. Prints wall and CPU (process) seconds per phase: on a shared machine the CPU column is the
cost with other load factored out.

Run: ``MUJOCO_GL=disable .venv/bin/python benchmarks/bench_eval.py [--task cheetah-run]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import contextmanager

import numpy as np
import torch

from qed_ray import metrics
from qed_ray.agents import make_agent
from qed_ray.config import SacLnSpec, TemperatureSpec
from qed_ray.envs import make_env
from qed_ray.evaluate import eval_seeds, rollout_many


class PhaseTimer:
    """Collects (phase, wall s, CPU s) rows and prints each as it finishes."""

    def __init__(self):
        self.rows: list[tuple[str, float, float]] = []

    @contextmanager
    def phase(self, name: str):
        """Times the body of a ``with`` block under ``name``."""
        wall0, cpu0 = time.perf_counter(), time.process_time()
        yield
        row = (name, time.perf_counter() - wall0, time.process_time() - cpu0)
        self.rows.append(row)
        print(f"  {name:<44} {row[1]:8.2f} s wall {row[2]:8.2f} s CPU", flush=True)

    def total(self) -> tuple[float, float]:
        """Summed (wall, CPU) seconds over all phases."""
        return sum(r[1] for r in self.rows), sum(r[2] for r in self.rows)


def build_agents(task: str, n: int, hidden: int) -> list:
    """``n`` SAC-LN agents (seeds 0..n-1) with the default architecture unless ``hidden`` overrides the width."""
    env = make_env(task, 0)
    dims = env.obs_dim, env.action_dim
    env.close()
    spec = SacLnSpec(hidden=hidden)
    return [make_agent(spec, TemperatureSpec(), *dims, torch.device("cpu"), seed) for seed in range(n)]


def distributions_at(agents: list, states: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Stacked pre-tanh (mu, sigma) of every agent at ``states``: two arrays of shape (I, S, A)."""
    pairs = [agent.policy_distribution(states) for agent in agents]
    return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])


def main(argv: list[str] | None = None) -> int:
    """Runs the phases and prints one line per phase, the totals and the computed V and action distance."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="cheetah-run")
    p.add_argument("--policies", type=int, default=10, help="seeds' policies of one method")
    p.add_argument("--episodes", type=int, default=20, help="eval episodes per policy (shared seeds)")
    p.add_argument("--decisions", type=int, default=None, help="truncate eval episodes (default: full, 500)")
    p.add_argument("--distance-steps", type=int, default=100, help="decisions of the action-distance rollouts")
    p.add_argument("--hidden", type=int, default=256, help="actor width (SAC-LN default 256)")
    args = p.parse_args(argv)
    os.environ.setdefault("MUJOCO_GL", "disable")
    torch.set_num_threads(1)
    print(f"{args.task}: {args.policies} policies x {args.episodes} episodes x "
          f"{args.decisions or 'full (500)'} decisions; action distance {args.episodes} x {args.distance_steps}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} thread, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    timer = PhaseTimer()
    seeds = eval_seeds(args.episodes)
    with timer.phase("build agents"):
        agents = build_agents(args.task, args.policies, args.hidden)
    policies = [agent.act_batch for agent in agents]
    with timer.phase("eval rollouts (rollout_many)"):
        rolls = rollout_many(policies, args.task, seeds, max_decisions=args.decisions)
    with timer.phase("pool states"):
        pooled = metrics.pool_states([r.obs for r in rolls])
    with timer.phase(f"policy (mu, sigma) at {len(pooled):,d} pooled states"):
        mus, sigmas = distributions_at(agents, pooled)
    with timer.phase("inter-run variability V"):
        v = metrics.inter_run_variability(mus, sigmas)
    with timer.phase(f"action-distance rollouts ({args.distance_steps} decisions)"):
        short = rollout_many(policies, args.task, seeds, max_decisions=args.distance_steps)
    with timer.phase("cumulative action distance"):
        actions = np.stack([r.actions for r in short])  # (P, T, L, A)
        distance = metrics.cumulative_action_distance(actions)
    wall, cpu = timer.total()
    print(f"  {'total':<44} {wall:8.2f} s wall {cpu:8.2f} s CPU")
    mean_return = float(np.mean([r.returns.mean() for r in rolls]))
    print(f"V = {v:.6g} over {mus.shape[1]:,d} states, action dim {mus.shape[2]}; cumulative action distance "
          f"= {distance:.6g}; mean eval return {mean_return:.2f}")
    prefix = np.stack([r.actions[:, :args.distance_steps] for r in rolls])
    # Rollouts are deterministic and share seeds, so the short rollouts repeat the full ones' first steps.
    same = prefix.shape == actions.shape and np.array_equal(prefix, actions)
    print(f"first {args.distance_steps} actions of the full eval rollouts identical to the action-distance "
          f"rollouts: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
