"""Benchmark: decisions/s of SAC-LN (target entropy and QED) next to stable-baselines3 SAC, same sizes and env.

All runs use 256x256 networks, batch 256, one gradient step per decision (UTD 1), one torch thread, CPU, on
cheetah-run through the same dm_control wrapper (frame skip 2, 500-decision episodes ending in truncation).
SB3 and our ``te`` run use the target-entropy temperature; our ``qed`` run uses QED (k 0.2, 8 samples per state),
which SB3 does not have, ``floor`` the same with ``temperature.target_alpha: floor`` (QED at actor updates only). Each does ``--warmup`` uniform-random decisions, then is timed over ``--timed``
decisions that each carry one update. Runs alternate (ours te, ours qed, SB3, ours te, ...) so that load from
other processes on a shared machine hits all alike; the medians and the ratios are printed.

Ours is timed by the real :class:`qed_ray.rl.trainer.Trainer` loop, a single run being a pack of one: its heartbeat
(every 100 decisions) stamps the clocks from the end of the warm-up to the last heartbeat before the one evaluation
at the end, so no evaluation falls in the window; SB3 by a callback fired at the end of the warm-up and the return
of ``learn``. Decisions per CPU second (process time) are printed too: on a shared machine they show the cost with
other load factored out. ``--only`` picks implementations, so the script can time an older qed_ray too (put first
on ``PYTHONPATH``; its single-seed trainer is built through the same heartbeat).
Known model differences (kept: they are each library's defaults): ours has LayerNorm critics, Mish
activations and a global-norm gradient clip; SB3 uses ReLU, no LayerNorm and no clip.

Needs the ``bench`` extra: ``.venv/bin/pip install -e '.[bench]'``.
Run: ``MUJOCO_GL=disable .venv/bin/python benchmarks/bench_speed_sac.py [--repeats 2]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

from qed_ray.spec.config import RunSpec
from qed_ray.rl.envs import make_env

HIDDEN, BATCH, FRAME_SKIP = 256, 256, 2
DECISIONS_PER_EVAL_UNIT = 500  # eval_every must be whole episodes: 1000 env steps = 500 decisions


def make_gym_env(task: str, seed: int):
    """Our DMCEnv behind the gymnasium API (Box spaces, truncation at the 500-decision time limit).

    gymnasium is imported here, not at module level, so the module imports without the bench extra.
    """
    import gymnasium as gym

    class DMCGymEnv(gym.Env):
        """Minimal adapter: ``reset(seed=...)`` rebuilds the task with that seed, as DMCEnv seeds at build."""

        metadata = {"render_modes": []}

        def __init__(self):
            self._seed = seed
            self._env = make_env(task, seed, FRAME_SKIP)
            self.observation_space = gym.spaces.Box(-np.inf, np.inf, (self._env.obs_dim,), np.float32)
            self.action_space = gym.spaces.Box(-1.0, 1.0, (self._env.action_dim,), np.float32)

        def reset(self, *, seed: int | None = None, options: dict | None = None):
            super().reset(seed=seed)
            if seed is not None and seed != self._seed:
                self._env.close()
                self._seed, self._env = seed, make_env(task, seed, FRAME_SKIP)
            return self._env.reset(), {}

        def step(self, action):
            s = self._env.step(action)
            return s.obs, s.reward, s.terminated, s.truncated, {}

        def close(self):
            self._env.close()

    return DMCGymEnv()


def _build(spec: RunSpec, heartbeat):
    """The trainer of one run with a heartbeat every 100 decisions: a pack of one, or (an older qed_ray on the
    path) its single-seed trainer."""
    import inspect

    from qed_ray.rl.trainer import build_trainer

    quiet = {"log": lambda line: None, "heartbeat": heartbeat, "heartbeat_s": 0.0}
    if "specs" in inspect.signature(build_trainer).parameters:
        return build_trainer([spec], lambda metrics, save: None, None, **quiet)
    return build_trainer(spec, lambda metrics, save: None, None, **quiet)


def time_ours(task: str, seed: int, warmup: int, timed: int, temperature: dict, compile_mode: str = "off",
              skip: int = 0) -> dict:
    """Runs the SAC-LN trainer with ``temperature`` and ``train.compile: compile_mode``; returns decisions per wall
    second and per CPU second between the heartbeat ``skip`` decisions after the end of the warm-up (a compile
    falls before it) and the last heartbeat before the final evaluation (``timed`` - ``skip`` - 100 decisions, each
    with one update), the update count, and the wall seconds of those first ``skip`` decisions."""
    if (warmup + timed) % DECISIONS_PER_EVAL_UNIT or warmup % 100 or skip % 100 or timed <= 100 + skip:
        raise SystemExit(f"--warmup + --timed must be a multiple of {DECISIONS_PER_EVAL_UNIT} decisions, --warmup "
                         f"and --skip of 100, and --timed over 100 + --skip")
    spec = RunSpec.model_validate({
        "task": task, "seed": seed, "agent": {"name": "sac_ln", "hidden": HIDDEN, "batch_size": BATCH, "utd": 1},
        "temperature": temperature,
        "train": {"env_steps": (warmup + timed) * FRAME_SKIP, "eval_every": (warmup + timed) * FRAME_SKIP,
                  "eval_episodes": 1, "warmup_decisions": warmup, "device": "cpu", "threads": 1,
                  "frame_skip": FRAME_SKIP, "compile": compile_mode}})
    stamps: dict[int, tuple[float, float]] = {}
    trainer = _build(spec, lambda h: stamps.__setitem__(h["env_steps"] // FRAME_SKIP,
                                                        (time.perf_counter(), time.process_time())))
    trainer.run()
    end = max(stamps)
    (w0, c0), (w1, c1) = stamps[warmup + skip], stamps[end]
    n = end - warmup - skip
    updates = trainer.progress.updates
    return {"per_wall_s": n / (w1 - w0), "per_cpu_s": n / (c1 - c0), "updates": updates, "wall_s": w1 - w0,
            "skipped_wall_s": w0 - stamps[warmup][0]}


def time_sb3(task: str, seed: int, warmup: int, timed: int) -> dict:
    """Runs stable-baselines3 SAC with matching sizes; same return fields as :func:`time_ours`."""
    from stable_baselines3 import SAC
    from stable_baselines3.common.callbacks import BaseCallback

    class WarmupEndTimer(BaseCallback):
        """Stamps the clocks and update count when the last warm-up decision has been taken."""

        def _on_step(self) -> bool:
            if self.num_timesteps == warmup:
                self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
                self.updates0 = self.model._n_updates
            return True

    model = SAC("MlpPolicy", make_gym_env(task, seed), learning_rate=3e-4, buffer_size=warmup + timed + 1000,
                learning_starts=warmup, batch_size=BATCH, tau=0.01, gamma=0.99, train_freq=1, gradient_steps=1,
                ent_coef="auto_0.1", target_entropy="auto", policy_kwargs={"net_arch": [HIDDEN, HIDDEN]},
                device="cpu", seed=seed, verbose=0)
    timer = WarmupEndTimer()
    model.learn(total_timesteps=warmup + timed, callback=timer, progress_bar=False)
    wall, cpu = time.perf_counter() - timer.wall0, time.process_time() - timer.cpu0
    return {"per_wall_s": timed / wall, "per_cpu_s": timed / cpu, "updates": model._n_updates - timer.updates0,
            "wall_s": wall}


def print_versions() -> None:
    """Library versions, thread count and machine facts that the numbers depend on."""
    import dm_control  # noqa: F401  (version via importlib.metadata below)
    import gymnasium
    import mujoco
    import stable_baselines3
    from importlib.metadata import version

    print(f"python {platform.python_version()}, torch {torch.__version__}, stable-baselines3 "
          f"{stable_baselines3.__version__}, gymnasium {gymnasium.__version__}, mujoco {mujoco.__version__}, "
          f"dm_control {version('dm_control')}, numpy {np.__version__}")
    print(f"torch threads {torch.get_num_threads()}, cpu cores {os.cpu_count()}, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main(argv: list[str] | None = None) -> int:
    """Alternates the two implementations ``--repeats`` times and prints a table, medians and the ratio."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="cheetah-run")
    p.add_argument("--warmup", type=int, default=1000, help="uniform-random decisions before updates")
    p.add_argument("--timed", type=int, default=3000, help="timed decisions, one update each")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", nargs="+", choices=["te", "qed", "floor", "sb3"], default=["te", "qed", "floor", "sb3"],
                   help="implementations to time (floor: QED with temperature.target_alpha floor; sb3 needs the "
                        "bench extra)")
    p.add_argument("--compile", default="off", choices=["off", "compile", "auto"],
                   help="ours: train.compile (compile: the first updates compile; time them apart with --skip)")
    p.add_argument("--skip", type=int, default=0, help="ours: decisions after the warm-up left out of the window")
    args = p.parse_args(argv)
    os.environ.setdefault("MUJOCO_GL", "disable")
    torch.set_num_threads(1)
    print_versions() if "sb3" in args.only else print(f"torch {torch.__version__}, qed_ray from "
                                                        f"{os.path.dirname(sys.modules['qed_ray.spec.config'].__file__)}")
    print(f"{args.task}: {HIDDEN}x{HIDDEN}, batch {BATCH}, UTD 1, frame skip {FRAME_SKIP}; "
          f"{args.warmup} warm-up + {args.timed} timed decisions")
    temps = {"te": {"kind": "te"}, "qed": {"kind": "qed", "k": 0.2},
             "floor": {"kind": "qed", "k": 0.2, "target_alpha": "floor"}}
    runs = {f"qed_ray SAC-LN {k}": (lambda *a, t=t: time_ours(*a, t, args.compile, args.skip))
            for k, t in temps.items() if k in args.only}
    if "sb3" in args.only:
        runs["SB3 SAC"] = time_sb3
    rows: dict[str, list[dict]] = {name: [] for name in runs}
    print(f"ours: train.compile {args.compile}, window from {args.skip} decisions after the warm-up")
    print(f"{'implementation':<20} {'run':>3} {'decisions/s':>11} {'per CPU s':>9} {'updates':>7} {'timed s':>8} "
          f"{'skipped s':>9} {'load':>5}")
    t0 = time.perf_counter()
    for r in range(args.repeats):
        for name, fn in runs.items():
            row = fn(args.task, args.seed, args.warmup, args.timed)
            rows[name].append(row)
            print(f"{name:<20} {r + 1:>3} {row['per_wall_s']:>11.1f} {row['per_cpu_s']:>9.1f} {row['updates']:>7d} "
                  f"{row['wall_s']:>8.1f} {row.get('skipped_wall_s', 0.0):>9.1f} {os.getloadavg()[0]:>5.2f}",
                  flush=True)
    for key, label in (("per_wall_s", "decisions per wall second"), ("per_cpu_s", "decisions per CPU second")):
        medians = {name: statistics.median(row[key] for row in v) for name, v in rows.items()}
        print(f"median {label}: " + ", ".join(f"{name} {m:.1f}" for name, m in medians.items()))
    print(f"torch threads at end {torch.get_num_threads()}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}, total wall time {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
