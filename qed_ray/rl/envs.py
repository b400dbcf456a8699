"""The dm_control wrapper every agent sees (paper Sec. 6.1, App. B; docs/definitions.md)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from qed_ray.spec import cli_help
from qed_ray.spec.tasks import TASK_SETS, TASKS, check_task  # noqa: F401 - re-exported (the registry lives in spec/)


@dataclass(frozen=True)
class Step:
    """One decision's outcome. ``reward`` is the sum over the repeated control steps."""

    obs: np.ndarray
    reward: float
    terminated: bool
    truncated: bool


class DMCEnv:
    """A dm_control task (``domain-task`` from :data:`TASKS`) with frame skip (paper: 2), flat float32 observations
    and actions in [-1, 1]; ``seed`` seeds the task's RandomState (``task_kwargs={"random": seed}``)."""

    def __init__(self, task: str, seed: int, frame_skip: int = 2):
        from dm_control import suite  # imported lazily: loading MuJoCo is slow and not needed for config checks

        domain, name = check_task(task).split("-", 1)
        self.task = task
        self.frame_skip = frame_skip
        self._env = suite.load(domain, name, task_kwargs={"random": seed})
        spec = self._env.action_spec()
        self._low = spec.minimum.astype(np.float64)
        self._high = spec.maximum.astype(np.float64)
        self._keys = sorted(self._env.observation_spec())
        self.obs_dim = int(sum(int(np.prod(self._env.observation_spec()[k].shape)) for k in self._keys))
        self.action_dim = int(spec.shape[0])
        self._done = True

    def _flatten(self, observation) -> np.ndarray:
        return np.concatenate([np.asarray(observation[k], dtype=np.float32).ravel() for k in self._keys])

    def reset(self) -> np.ndarray:
        """Starts a new episode; returns the first observation, shape (obs_dim,)."""
        self._done = False
        return self._flatten(self._env.reset().observation)

    def step(self, action: np.ndarray) -> Step:
        """Applies ``action`` in [-1, 1]^action_dim for ``frame_skip`` control steps."""
        if self._done:
            raise RuntimeError(f"{self.task}: step() called on a finished episode; call reset() first")
        a = np.clip(np.asarray(action, dtype=np.float64), -1.0, 1.0)
        scaled = self._low + (a + 1.0) * 0.5 * (self._high - self._low)
        reward = 0.0
        for _ in range(self.frame_skip):
            ts = self._env.step(scaled)
            reward += float(ts.reward or 0.0)
            if ts.last():
                break
        # dm_control's suite tasks end only by time limit (discount stays 1): a truncation.
        truncated = bool(ts.last())
        self._done = truncated
        return Step(self._flatten(ts.observation), reward, False, truncated)

    @property
    def physics(self):
        """The MuJoCo physics (for rendering and state-vector reads)."""
        return self._env.physics

    def random_state(self) -> dict:
        """The task RNG state (numpy MT19937) as plain lists, for exact resume at episode boundaries."""
        name, keys, pos, has_gauss, cached = self._env.task.random.get_state()
        return {"name": name, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                "cached": float(cached)}

    def set_random_state(self, state: dict) -> None:
        """Restores :meth:`random_state`; the next ``reset`` then draws the same initial state."""
        self._env.task.random.set_state((state["name"], np.asarray(state["keys"], dtype=np.uint32),
                                         state["pos"], state["has_gauss"], state["cached"]))

    def reseed(self, seed: int) -> None:
        """Reseeds the task RNG as ``task_kwargs={"random": seed}`` seeds a new env, so the next ``reset`` draws
        the initial state a freshly built env of ``seed`` would (an env can be reused instead of rebuilt)."""
        self._env.task.random.seed(seed)

    def close(self) -> None:
        """Frees the MuJoCo physics."""
        self._env.physics.free()


def make_env(task: str, seed: int, frame_skip: int = 2) -> DMCEnv:
    """Builds the wrapped task; the one place envs are constructed."""
    return DMCEnv(task, seed, frame_skip)


def check_all(frame_skip: int = 2) -> list[str]:
    """Loads every task, takes one random decision and returns a report line per task (docker smoke check)."""
    lines = []
    rng = np.random.default_rng(0)
    for task in TASKS:
        t0 = time.perf_counter()
        env = make_env(task, seed=0, frame_skip=frame_skip)
        obs = env.reset()
        step = env.step(rng.uniform(-1, 1, env.action_dim))
        ok = np.all(np.isfinite(obs)) and np.all(np.isfinite(step.obs))
        lines.append(f"{task:18s} obs_dim={env.obs_dim:3d} action_dim={env.action_dim:2d} "
                     f"{'ok' if ok else 'NON-FINITE'} {time.perf_counter() - t0:.2f}s")
        env.close()
        if not ok:
            raise RuntimeError(f"{task}: non-finite observation")
    return lines


def main(argv: list[str] | None = None) -> int:
    """CLI: ``qed-ray envs --check-all`` loads all 18 tasks (the image smoke command)."""
    parser = cli_help.parser("qed-ray envs", __doc__, (
        "qed-ray envs               # list the 18 task names",
        "qed-ray envs --check-all   # load every task and take one step"))
    parser.add_argument("--check-all", action="store_true", help="load every task and take one step")
    args = parser.parse_args(argv)
    if not args.check_all:
        print("\n".join(TASKS))
        return 0
    for line in check_all():
        print(line)
    print(f"all {len(TASKS)} tasks ok")
    return 0
