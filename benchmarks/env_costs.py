"""Benchmark: CPU milliseconds per decision of each of the 18 dm_control tasks (frame skip 2), one env, one core.

A decision = ``frame_skip`` physics control steps with a uniform random action, observation flattened, episode
reset at its end (the reset's cost is spread over the episode's decisions). This is the env work a pack's loop
does per seed per decision (evaluation adds ``eval_episodes x 500 / (eval_every / frame_skip)`` decisions per
training decision on top; ``benchmarks/grid_hours.py`` counts that). Writes ``benchmarks/env_costs.json``
(committed; the measuring machine and its load are recorded, since shared CPUs are noisy).

Run: ``MUJOCO_GL=disable nice -n 10 .venv/bin/python benchmarks/env_costs.py [--decisions 1000]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from qed_ray.rl.envs import make_env
from qed_ray.spec.tasks import TASKS


def cost_ms(task: str, decisions: int, frame_skip: int) -> tuple[float, int, int]:
    """(ms per decision, obs dim, action dim) over ``decisions`` random-action decisions after one untimed episode start."""
    env = make_env(task, 0, frame_skip)
    rng = np.random.default_rng(0)
    obs = env.reset()
    t0 = time.perf_counter()
    for _ in range(decisions):
        step = env.step(rng.uniform(-1, 1, env.action_dim).astype(np.float32))
        if step.terminated or step.truncated:
            env.reset()
    ms = (time.perf_counter() - t0) * 1000 / decisions
    env.close()
    return ms, int(obs.shape[0]), env.action_dim


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decisions", type=int, default=1000)
    p.add_argument("--frame-skip", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("env_costs.json"))
    args = p.parse_args()
    tasks = {}
    for task in TASKS:
        ms, obs, act = cost_ms(task, args.decisions, args.frame_skip)
        tasks[task] = {"ms_per_decision": round(ms, 4), "obs_dim": obs, "action_dim": act}
        print(f"{task:18s} {ms:7.3f} ms/decision  obs {obs}", flush=True)
    out = {"frame_skip": args.frame_skip, "decisions": args.decisions, "machine": platform.processor() or
           platform.machine(), "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "tasks": tasks}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"mean {np.mean([t['ms_per_decision'] for t in tasks.values()]):.3f} ms/decision; wrote {args.out}")


if __name__ == "__main__":
    main()
