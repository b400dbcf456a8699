"""Shared test settings: headless MuJoCo, one torch thread, Ray auth explicit (Ray 2.60 defaults to token auth)."""

import os

os.environ.setdefault("MUJOCO_GL", "disable")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture
def tiny_run():
    """A RunSpec factory with tiny networks and a short budget (fast on CPU)."""
    from qed_ray.config import RunSpec

    def make(**overrides):
        raw = {
            "task": "cartpole-balance", "seed": 0,
            "agent": {"hidden": 32, "batch_size": 32},
            "temperature": {"kind": "te"},
            "train": {"env_steps": 4000, "eval_every": 2000, "eval_episodes": 1, "warmup_decisions": 200},
        }
        for key, value in overrides.items():
            if isinstance(value, dict):
                raw[key] = {**raw.get(key, {}), **value}
            else:
                raw[key] = value
        return RunSpec.model_validate(raw)

    return make
