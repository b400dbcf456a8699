"""Benchmark: the full per-task final evaluation on CPU, phase by phase.

For one task and one method: ``--policies`` seeds' policies (freshly initialised SAC-LN agents at the default
256 width, as one pack: their cost equals a trained agent's) are rolled out in lock-step on the gather step's pool of
envs (:class:`qed_ray.analysis.group_eval.GroupEnvs`, one batched policy call per step) for ``--episodes`` episodes of 500
decisions from the shared eval seeds; the visited states are pooled; every
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

from qed_ray.analysis import metrics
from qed_ray.rl.agents import make_packed_agent
from qed_ray.analysis.group_eval import GroupEnvs
from qed_ray.spec.config import SacLnSpec, TemperatureSpec
from qed_ray.rl.envs import make_env
from qed_ray.rl.evaluate import eval_seeds


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


def build_pack(task: str, n: int, hidden: int):
    """A pack of ``n`` SAC-LN agents (seeds 0..n-1), default architecture unless ``hidden`` overrides the width."""
    env = make_env(task, 0)
    dims = env.obs_dim, env.action_dim
    env.close()
    return make_packed_agent(SacLnSpec(hidden=hidden), TemperatureSpec(), *dims, torch.device("cpu"), range(n))


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
    with timer.phase("build agents and envs"):
        pack = build_pack(args.task, args.policies, args.hidden)
        envs = GroupEnvs(args.task, args.policies, args.episodes, 2)
    with timer.phase("eval rollouts (lock-step, chunked)"):
        rolls = envs.rollouts(pack, "mean", seeds, max_decisions=args.decisions)
    with timer.phase("pool states"):
        pooled = metrics.pool_states([rolls.pooled_obs(p) for p in range(pack.n)])
    with timer.phase(f"policy (mu, sigma) at {len(pooled):,d} pooled states"):
        mus, sigmas = pack.distribution(np.repeat(pooled[None], pack.n, axis=0))
    with timer.phase("inter-run variability V"):
        v = metrics.inter_run_variability(mus, sigmas)
    with timer.phase(f"action-distance rollouts ({args.distance_steps} decisions)"):
        actions = envs.rollouts(pack, "mean", seeds, max_decisions=args.distance_steps).actions  # (P, T, L, A)
    with timer.phase("cumulative action distance"):
        distance = metrics.cumulative_action_distance(actions)
    envs.close()
    wall, cpu = timer.total()
    print(f"  {'total':<44} {wall:8.2f} s wall {cpu:8.2f} s CPU")
    mean_return = float(rolls.returns.mean())
    print(f"V = {v:.6g} over {mus.shape[1]:,d} states, action dim {mus.shape[2]}; cumulative action distance "
          f"= {distance:.6g}; mean eval return {mean_return:.2f}")
    prefix = rolls.actions[:, :, :args.distance_steps]
    # Rollouts are deterministic and share seeds, so the short rollouts repeat the full ones' first steps.
    same = prefix.shape == actions.shape and np.array_equal(prefix, actions)
    print(f"first {args.distance_steps} actions of the full eval rollouts identical to the action-distance "
          f"rollouts: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
