"""The memory of a pack (the dry run's memory lines): the estimate against a small pack's measured peak on the CPU,
the fit on the shipped worker nodes, the node a pack needs and the most members that fit, and the task sizes."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from qed_ray.config import RunSpec
from qed_ray.rl.agents import make_packed_agent
from qed_ray.rl.replay import Replay, replay_bytes
from qed_ray.rl.update import PackUpdater
from qed_ray.service.memory import (NODE_TYPES, AllocationPeak, fit_problem, largest_fit, needed_node,
                                    pack_memory)
from qed_ray.tasks import TASK_DIMS, TASKS

ROOT = Path(__file__).resolve().parents[2]
# A world model of 64 units (not the kit's tiny one): the memory model is checked at a size where it shows.
MAD_64 = {"latent_dim": 64, "encoder_hidden": 64, "model_hidden": 64, "num_bins": 51, "vmin": -50.0, "vmax": 50.0}


def _runs(agent: str, members: int = 3, batch: int = 256, capacity: int = 20_000, **train) -> list[RunSpec]:
    spec = {"name": agent, "hidden": 128, "batch_size": batch, **({"mad": MAD_64} if agent == "mad_sac" else {})}
    return [RunSpec.model_validate({"task": "cheetah-run", "seed": i % 2, "agent": spec,
                                    "temperature": {"kind": "qed", "k": (0.1, 0.2, 0.4)[i % 3]},
                                    "train": {"replay_capacity": capacity, **train}}) for i in range(members)]


def _measured_peak(runs: list[RunSpec]) -> int:
    """Peak bytes of every tensor a pack creates: agent, replay at capacity, three updates (on the CPU)."""
    run, cpu = runs[0], torch.device("cpu")
    obs, act = TASK_DIMS[run.task]
    batch, capacity, on = run.agent.batch_size, run.train.replay_capacity, np.ones(len(runs), bool)
    with AllocationPeak() as peak:
        agent = make_packed_agent(run.agent, [r.temperature for r in runs], obs, act, cpu, [r.seed for r in runs])
        replay = Replay(capacity, obs, act, [np.random.default_rng(i) for i in range(len(runs))], cpu)
        replay.storage.normal_()  # at capacity: every row written
        replay.storage[..., replay.columns["terminated"]] = 0.0
        replay.added[:] = capacity
        update = PackUpdater(agent, replay, None, "off", batch)
        for _ in range(3):
            update(replay.indices(batch, on), agent.noise(batch, on))
    return peak.peak


@pytest.mark.parametrize("agent", ["sac_ln", "mad_sac"])
def test_the_estimate_matches_a_small_packs_measured_peak_on_the_cpu_within_20_percent(agent):
    runs = _runs(agent)
    estimate, measured = pack_memory(runs, 0, 0.0, None), _measured_peak(runs)
    assert estimate.replay == replay_bytes(3, 20_000, 17, 6) and estimate.replay_on == "host"
    assert abs(estimate.tensors - measured) <= 0.2 * measured, (estimate.tensors / 2**20, measured / 2**20)
    assert estimate.replay < 0.5 * measured, "the networks and the update's working set are what is tested"
    assert estimate.host > estimate.tensors and estimate.gpu == 0


def test_the_replay_moves_to_the_host_past_half_the_packs_share_and_a_pack_too_large_is_named():
    g5, h100 = NODE_TYPES["g5.4xlarge"], NODE_TYPES["a3-highgpu-1g"]
    cheetah = _runs("sac_ln", 30, capacity=1_000_000)
    on_gpu = pack_memory(cheetah, 3, 0.5, g5)  # 30 x 168 MB = 4.7 GiB <= half of its 11.25 GiB share: on the card
    assert on_gpu.replay_on == "gpu" and on_gpu.tensors > on_gpu.replay and on_gpu.gpu > on_gpu.tensors
    large = [r.model_copy(update={"task": "quadruped-run"}) for r in cheetah]
    moved = pack_memory(large, 3, 0.5, g5)  # 30 x 680 MB = 19 GiB: host memory
    assert moved.replay_on == "host" and moved.host > moved.replay and moved.tensors < moved.replay
    assert pack_memory(large, 3, 0.5, h100).replay_on == "gpu"
    assert fit_problem(moved, g5, 4, 0.5) is None and needed_node(cheetah, 3, 4, 0.5) == "g2-standard-16"
    # 100 members of 1M-row quadruped replay: no host of 64 GiB holds two such packs; the most that fit is named.
    huge = [r.model_copy(update={"task": "quadruped-run"}) for r in _runs("sac_ln", 100, capacity=1_000_000)]
    assert "host memory > 90% of g5.4xlarge's 64.0 GiB" in fit_problem(pack_memory(huge, 3, 0.5, g5), g5, 4, 0.5)
    most = largest_fit(huge, 3, 4, 0.5, g5)
    assert 0 < most < 100
    assert fit_problem(pack_memory(huge[:most], 3, 0.5, g5), g5, 4, 0.5) is None
    assert fit_problem(pack_memory(huge[:most + 1], 3, 0.5, g5), g5, 4, 0.5) is not None
    assert needed_node(huge, 3, 4, 0.5) == "a3-highgpu-1g"  # 234 GB of RAM (and the replay on its 80 GB card)


def test_task_sizes_are_the_envs_sizes():
    measured = json.loads((ROOT / "benchmarks" / "env_costs.json").read_text())["tasks"]
    assert set(TASK_DIMS) == set(TASKS) == set(measured)
    assert {t: (d["obs_dim"], d["action_dim"]) for t, d in measured.items()} == TASK_DIMS
    from qed_ray.rl.envs import make_env

    env = make_env("walker-walk", 0)
    assert (env.obs_dim, env.action_dim) == TASK_DIMS["walker-walk"]
