"""Memory of a pack from counted bytes: its host and GPU bytes (the plan's fit, :mod:`qed_ray.service.plan.dry_plan`).

Per member, on its device: its **state** (every tensor of the agent the spec builds, Adam's two moments per
trainable parameter), counted; its update's **working set**, ``GRAD_FACTOR x`` trainable bytes (gradients, the fused
optimiser's temporaries) plus per batch row 4 bytes x (a W + q n_actions W_critic), W the layer widths of the
learned networks summed, W_critic the critic's (QED's n_actions actions per state pass through it), (a, q) per
agent (:data:`ROW_FACTORS`); on a GPU the networks' bytes are ``pool + slope x`` that (:data:`GPU_FIT`: CUDA graphs
keep their intermediates, the allocator rounds). The factors are fitted to measured peaks and checked by
``benchmarks/bench_memory.py`` (within 20%: the CPU's; the GPU table's for packs of 10 and more). The **replay** at
capacity, S x capacity x row bytes, lives on the GPU when it fits in ``GPU_REPLAY_SHARE`` of the pack's share of
the card. Host memory adds the process, the envs and env workers and a checkpoint's copy of the state (estimates).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

from qed_ray.spec.config import RunSpec
from qed_ray.spec.replay_memory import GIB, replay_bytes, replay_capacity
from qed_ray.rl.replay import GPU_REPLAY_SHARE
from qed_ray.spec.tasks import TASK_DIMS

GRAD_FACTOR = 2.3
ROW_FACTORS = {"sac_ln": (1.44, 0.49), "mad_sac": (2.4, 0.0)}  # (a, q) of the module notes
PROCESS_BYTES = {"cpu": int(0.6 * GIB), "cuda": int(2.5 * GIB)}  # Python, torch, Ray, MLflow, dm_control (+CUDA)
GPU_FIT = {"sac_ln": (2.1, int(0.91 * GIB)), "mad_sac": (1.25, int(1.13 * GIB))}  # (slope, pool)
CUDA_CONTEXT_BYTES = int(0.6 * GIB)  # GPU memory outside torch's allocator: context, cuBLAS workspace
ENV_BYTES, ENV_WORKER_BYTES = 12 * 2**20, 300 * 2**20  # one dm_control env; one env worker process
HOST_USABLE = 0.9  # share of a node's RAM for packs: the OS and Ray's own processes, Ray's memory monitor at 95%


@dataclass(frozen=True)
class Counted:
    """One member's counted bytes (state, trainable parameters), layer widths, QED's actions per state."""

    state: int
    trainable: int
    width: int
    critic_width: int
    n_actions: int
    agent: str

    def working(self, batch: int) -> int:
        """The update's working set at ``batch`` rows (the module notes' formula)."""
        a, q = ROW_FACTORS[self.agent]
        return int(GRAD_FACTOR * self.trainable + 4 * batch * (a * self.width + q * self.n_actions * self.critic_width))


def counted(run: RunSpec) -> Counted:
    """:class:`Counted` of ``run``'s agent on its task (the same for every seed, task of its size and k)."""
    qed = run.temperature.kind == "qed"
    return _counted(run.agent.model_dump_json(), run.temperature.n_actions if qed else 0, *TASK_DIMS[run.task])


@functools.lru_cache(maxsize=64)
def _counted(agent_json: str, n_actions: int, obs: int, act: int) -> Counted:
    import torch

    from qed_ray.spec.config import AgentSpec, TemperatureSpec
    from qed_ray.records.codec import adapter
    from qed_ray.rl.agents import make_packed_agent

    with torch.random.fork_rng(devices=[]):
        agent = make_packed_agent(adapter(AgentSpec).validate_json(agent_json), TemperatureSpec(kind="te"), obs, act,
                                  torch.device("cpu"), [0])
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    trainable = nbytes(p for o in agent.opts.values() for g in o.param_groups for p in g["params"])
    widths = {m: sum(v.shape[1] for k, v in sd.items() if k.endswith("weight") and v.ndim >= 2)
              for m, sd in agent.state.items() if not m.endswith("_target")}
    return Counted(nbytes(t for sd in agent.state.values() for t in sd.values()) + 2 * trainable, trainable,
                   sum(widths.values()), widths.get("critic", 0), n_actions, agent.name)


@dataclass(frozen=True)
class PackMemory:
    """A pack's bytes: its replay and where it lives, the tensors on the device that trains it (replay included
    when there), and its whole host and GPU memory (0 for a CPU pack)."""

    replay: int
    replay_on: str
    tensors: int
    host: int
    gpu: int


def pack_memory(runs: Sequence[RunSpec], env_workers: int, gpu_share: float, gpu_bytes: int) -> PackMemory:
    """The memory of the pack of ``runs`` with ``env_workers`` env worker processes and ``gpu_share`` of a card of
    ``gpu_bytes`` (``gpu_share`` 0: on the CPU)."""
    run, s = runs[0], len(runs)
    c, t = counted(run), run.train
    replay = replay_bytes(s, replay_capacity(t), *TASK_DIMS[run.task])
    around = s * (1 + t.eval_episodes) * ENV_BYTES + env_workers * ENV_WORKER_BYTES + s * c.state
    nets = s * (c.state + c.working(run.agent.batch_size))
    if not gpu_share:
        return PackMemory(replay, "host", nets + replay, PROCESS_BYTES["cpu"] + nets + replay + around, 0)
    on_gpu = replay <= GPU_REPLAY_SHARE * gpu_share * gpu_bytes
    slope, pool = GPU_FIT[run.agent.name]
    tensors = pool + int(slope * nets) + (replay if on_gpu else 0)
    host = PROCESS_BYTES["cuda"] + around + (0 if on_gpu else replay)
    return PackMemory(replay, "gpu" if on_gpu else "host", tensors, host, tensors + CUDA_CONTEXT_BYTES)
