"""The task registry: the paper's 18 dm_control tasks as ``domain-task`` names (pure data, no MuJoCo import).

Config validation reads it without loading dm_control; :mod:`qed_ray.rl.envs` builds the tasks.
"""

from __future__ import annotations

from qed_ray.hints import near, short_repr

# The 18 tasks of the paper (App. B, Table "18 dm_control tasks"), as ``domain-task``.
TASKS: tuple[str, ...] = (
    "acrobot-swingup", "cartpole-balance", "cartpole-swingup", "cheetah-run", "finger-spin",
    "finger-turn_easy", "finger-turn_hard", "fish-swim", "hopper-hop", "hopper-stand",
    "pendulum-swingup", "quadruped-run", "quadruped-walk", "reacher-easy", "reacher-hard",
    "walker-run", "walker-stand", "walker-walk",
)
TASK_SETS: dict[str, tuple[str, ...]] = {"dmc18": TASKS}


def check_task(task: str) -> str:
    """Returns ``task`` if it is one of :data:`TASKS`, else raises ValueError listing the valid names."""
    if task not in TASKS:
        raise ValueError(f"unknown task {short_repr(task)}{near(task, TASKS)}; valid tasks: {', '.join(TASKS)}")
    return task
