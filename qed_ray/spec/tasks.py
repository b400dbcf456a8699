"""The task registry: the paper's 18 dm_control tasks as ``domain-task`` names (pure data, no MuJoCo import).

Config validation reads it without loading dm_control; :mod:`qed_ray.rl.envs` builds the tasks.
"""

from __future__ import annotations

from qed_ray.spec.hints import near, short_repr

# The 18 tasks of the paper (App. B, Table "18 dm_control tasks"), as ``domain-task``.
TASKS: tuple[str, ...] = (
    "acrobot-swingup", "cartpole-balance", "cartpole-swingup", "cheetah-run", "finger-spin",
    "finger-turn_easy", "finger-turn_hard", "fish-swim", "hopper-hop", "hopper-stand",
    "pendulum-swingup", "quadruped-run", "quadruped-walk", "reacher-easy", "reacher-hard",
    "walker-run", "walker-stand", "walker-walk",
)
TASK_SETS: dict[str, tuple[str, ...]] = {"dmc18": TASKS}
# (observation size, action size) of each task as the env wrapper flattens them (qed_ray.rl.envs.DMCEnv), so that
# memory can be estimated without building a task (tests check them against the real envs).
TASK_DIMS: dict[str, tuple[int, int]] = {
    "acrobot-swingup": (6, 1), "cartpole-balance": (5, 1), "cartpole-swingup": (5, 1), "cheetah-run": (17, 6),
    "finger-spin": (9, 2), "finger-turn_easy": (12, 2), "finger-turn_hard": (12, 2), "fish-swim": (24, 5),
    "hopper-hop": (15, 4), "hopper-stand": (15, 4), "pendulum-swingup": (3, 1), "quadruped-run": (78, 12),
    "quadruped-walk": (78, 12), "reacher-easy": (6, 2), "reacher-hard": (6, 2), "walker-run": (24, 6),
    "walker-stand": (24, 6), "walker-walk": (24, 6),
}


def check_task(task: str) -> str:
    if task not in TASKS:
        raise ValueError(f"unknown task {short_repr(task)}{near(task, TASKS)}; valid tasks: {', '.join(TASKS)}")
    return task
