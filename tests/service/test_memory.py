"""The memory of a pack from counted bytes (qed_ray.service.plan.dry_plan): the counted state against the built agent's
tensors, the working set's formula by hand, where the replay lives, and the task sizes. The formula against
measured peaks is benchmarks/bench_memory.py's (within 20%)."""

import json
from pathlib import Path

import numpy as np
import torch

from qed_ray.spec.config import RunSpec
from qed_ray.rl.agents import make_packed_agent
from qed_ray.rl.replay import GPU_REPLAY_SHARE, Replay, replay_bytes
from qed_ray.rl.update import PackUpdater
from qed_ray.service.plan.dry_plan import GIB, GPU_FIT, GRAD_FACTOR, ROW_FACTORS, counted, pack_memory
from qed_ray.spec.tasks import TASK_DIMS, TASKS

ROOT = Path(__file__).resolve().parents[2]


def _runs(members=3, kind="qed", task="cheetah-run", capacity=20_000, hidden=128, batch=256) -> list[RunSpec]:
    return [RunSpec.model_validate({"task": task, "seed": i, "agent": {"name": "sac_ln", "hidden": hidden,
                                                                        "batch_size": batch},
                                    "temperature": {"kind": kind, **({"k": 0.2} if kind == "qed" else {})},
                                    "train": {"replay_capacity": capacity}}) for i in range(members)]


def test_the_state_is_counted_as_the_built_agent_holds_it_after_an_update():
    run = _runs(1)[0]
    obs, act = TASK_DIMS[run.task]
    agent = make_packed_agent(run.agent, [run.temperature], obs, act, torch.device("cpu"), [0])
    replay = Replay(300, obs, act, [np.random.default_rng(0)], torch.device("cpu"))
    replay.storage.normal_()
    replay.storage[..., replay.columns["terminated"]] = 0.0
    replay.added[:] = 300
    on = np.ones(1, bool)
    PackUpdater(agent, replay, None, "off", 16)(replay.indices(16, on), agent.noise(16, on))  # Adam's moments exist
    c = counted(run)
    assert c.state == sum(t.numel() * t.element_size() for t in agent.tensors().values())
    # Widths by hand: actor 128 + 128 + 12 (mean and log-std), each critic head 128 (linear) + 128 (LayerNorm) twice
    # and 1, the two heads: 2 x 513; the target is not trained (no activations kept).
    assert (c.width, c.critic_width, c.n_actions) == (268 + 2 * 513, 2 * 513, 8)
    a, q = ROW_FACTORS["sac_ln"]
    assert c.working(256) == int(GRAD_FACTOR * c.trainable + 4 * 256 * (a * c.width + q * 8 * c.critic_width))
    walker = counted(_runs(1, task="walker-walk")[0])  # 24 observations, 6 actions: wider inputs, the same widths
    assert counted(_runs(1, kind="te")[0]).n_actions == 0 and walker.width == c.width and walker.state > c.state


def test_a_pack_on_the_cpu_and_on_a_card_with_its_replay_where_it_fits():
    runs = _runs(3)
    c = counted(runs[0])
    cpu = pack_memory(runs, 0, 0.0, 0)
    replay = replay_bytes(3, 20_000, 17, 6)
    assert (cpu.replay, cpu.replay_on, cpu.gpu) == (replay, "host", 0)
    assert cpu.tensors == 3 * (c.state + c.working(256)) + replay and cpu.host > cpu.tensors
    card = int(22.5 * GIB)
    gpu = pack_memory(runs, 3, 0.5, card)
    slope, pool = GPU_FIT["sac_ln"]
    assert gpu.replay_on == "gpu" and gpu.tensors == pool + int(slope * 3 * (c.state + c.working(256))) + replay
    big = _runs(30, task="quadruped-run", capacity=1_000_000)  # 30 x 680 MB = 19 GiB > half a 11.25 GiB share
    moved = pack_memory(big, 3, 0.5, card)
    assert moved.replay > GPU_REPLAY_SHARE * 0.5 * card and moved.replay_on == "host" and moved.host > moved.replay
    assert pack_memory(big, 3, 0.5, 80 * GIB).replay_on == "gpu"


def test_task_sizes_are_the_envs_sizes():
    measured = json.loads((ROOT / "benchmarks" / "env_costs.json").read_text())["tasks"]
    assert set(TASK_DIMS) == set(TASKS) == set(measured)
    assert {t: (d["obs_dim"], d["action_dim"]) for t, d in measured.items()} == TASK_DIMS
    from qed_ray.rl.envs import make_env

    env = make_env("walker-walk", 0)
    assert (env.obs_dim, env.action_dim) == TASK_DIMS["walker-walk"]
