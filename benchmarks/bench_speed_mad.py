"""Benchmark: decisions/s of MAD-SAC next to SAC-LN at the defaults (batch 512, width 512, UTD 1).

One decision = policy sample (``act``) + env step + replay insert + one sampled batch + one ``update``, the
trainer's steady-state work per decision at UTD 1. The replay is first filled with uniform-random decisions on
the real task, then each agent runs ``--warmup-updates`` untimed decisions and ``--updates`` timed ones.
Run: ``MUJOCO_GL=disable python benchmarks/bench_speed_mad.py [--task cheetah-run] [--updates 200]``.
Prints, per agent, decisions/s, updates/s (update time only) and the per-part cost, then the MAD/SAC ratio.
"""

import argparse
import os
import time

import numpy as np
import torch

from qed_ray.agents import make_agent
from qed_ray.config import TemperatureSpec, agent_spec
from qed_ray.envs import make_env
from qed_ray.replay import ReplayBuffer


def fill_replay(env, n: int, seed: int) -> tuple[ReplayBuffer, np.ndarray]:
    """Replay with ``n`` uniform-random decisions of ``env``; returns it and the current observation."""
    rng = np.random.default_rng(seed)
    replay = ReplayBuffer(n + 100_000, env.obs_dim, env.action_dim, np.random.default_rng(seed + 1))
    obs = env.reset()
    for _ in range(n):
        action = rng.uniform(-1, 1, env.action_dim).astype(np.float32)
        obs = _step(env, replay, obs, action)
    return replay, obs


def _step(env, replay: ReplayBuffer, obs: np.ndarray, action: np.ndarray) -> np.ndarray:
    """One env step stored in replay; returns the next observation (a fresh one after a time limit)."""
    step = env.step(action)
    replay.add(obs, action, step.reward, step.obs, step.terminated)
    return env.reset() if step.terminated or step.truncated else step.obs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_agent(agent, env, replay: ReplayBuffer, obs: np.ndarray, n: int, batch_size: int,
              device: torch.device) -> dict[str, float]:
    """``n`` decisions of act + env step + update; returns seconds spent in each part."""
    parts = {"act": 0.0, "env": 0.0, "update": 0.0}
    metrics = {}
    for _ in range(n):
        t0 = time.perf_counter()
        action = agent.act(obs, deterministic=False)
        t1 = time.perf_counter()
        obs = _step(env, replay, obs, action)
        t2 = time.perf_counter()
        metrics = agent.update(replay.sample(batch_size, device))
        _sync(device)
        t3 = time.perf_counter()
        parts["act"] += t1 - t0
        parts["env"] += t2 - t1
        parts["update"] += t3 - t2
    float(metrics["loss/critic"])  # the update returns lazy tensors: force the last one
    return parts


def bench(name: str, args: argparse.Namespace, device: torch.device) -> float:
    """Times one agent; prints its line and returns its decisions/s."""
    env = make_env(args.task, seed=0)
    replay, obs = fill_replay(env, args.buffer, seed=0)
    spec = agent_spec(name=name, hidden=args.hidden, batch_size=args.batch)
    temp = TemperatureSpec(kind=args.temperature, k=0.2 if args.temperature == "qed" else None)
    agent = make_agent(spec, temp, env.obs_dim, env.action_dim, device, seed=0)
    run_agent(agent, env, replay, obs, args.warmup_updates, args.batch, device)
    parts = run_agent(agent, env, replay, obs, args.updates, args.batch, device)
    total = sum(parts.values())
    n = args.updates
    print(f"{name:8s} {args.task} batch {args.batch} width {args.hidden} temp {args.temperature} "
          f"({device}, {torch.get_num_threads()} thread(s)): {n / total:7.2f} decisions/s, "
          f"{n / parts['update']:7.2f} updates/s | per decision: update {1e3 * parts['update'] / n:8.2f} ms, "
          f"act {1e3 * parts['act'] / n:6.3f} ms, env {1e3 * parts['env'] / n:6.3f} ms", flush=True)
    return n / total


def main() -> None:
    """Parses flags, benchmarks SAC-LN then MAD-SAC, prints the ratio."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="cheetah-run")
    p.add_argument("--updates", type=int, default=200, help="timed decisions (= updates at UTD 1) per agent")
    p.add_argument("--warmup-updates", type=int, default=10, help="untimed decisions first (allocations, caches)")
    p.add_argument("--buffer", type=int, default=5000, help="uniform-random decisions put in replay first")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--temperature", choices=["te", "qed"], default="te")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    os.environ.setdefault("MUJOCO_GL", "disable")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sac = bench("sac_ln", args, device)
    mad = bench("mad_sac", args, device)
    print(f"MAD-SAC / SAC-LN decisions/s: {mad / sac:.3f} (MAD-SAC is {sac / mad:.2f}x slower per decision)")


if __name__ == "__main__":
    main()
