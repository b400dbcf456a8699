"""Memory of a pack from counted bytes: host and GPU bytes, and whether it fits a machine (the plan's fit).

Per member (one seed run of the pack), on the device that trains it:

- **state**: every tensor of the agent the spec builds (online and target networks, buffers, the temperature) and
  Adam's two moments per trainable parameter, counted;
- **update working set**, by formula: ``GRAD_FACTOR x trainable bytes`` (gradients and the fused optimiser's
  temporaries) plus, per batch row, 4 bytes x (a W + q n_actions W_critic), W the layer widths of the learned
  networks summed (one activation per unit per layer), W_critic the critic's (QED's n_actions policy actions per
  state pass through it); (a, q) per agent (:data:`ROW_FACTORS`: MAD-SAC's peak is its model step, where QED's
  passes are not alive), fitted to and checked against measured peaks (``benchmarks/bench_memory.py``: within
  20% on the CPU; the GPU table's peaks beside them, for information);
- **replay at capacity**: S x capacity x row bytes (:func:`~qed_ray.replay_memory.replay_bytes`), on the GPU when
  it fits in :data:`~qed_ray.rl.replay.GPU_REPLAY_SHARE` of the pack's share of the card, else on the host.

On a GPU the networks' bytes are ``pool + slope x`` the CPU's (:data:`GPU_FIT` per agent: a CUDA graph keeps its
intermediates, the allocator rounds; fitted to the GPU table's measured peaks, checked by the same benchmark for
packs of 10 and more) and the CUDA context lies outside the allocator.
Host memory adds the pack's process, its envs and env worker processes and the checkpoint's host copy of the
state. Those are estimates (:data:`PROCESS_BYTES` and the others).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

from qed_ray.config import RunSpec
from qed_ray.replay_memory import GIB, replay_bytes, replay_capacity
from qed_ray.rl.replay import GPU_REPLAY_SHARE
from qed_ray.tasks import TASK_DIMS

GRAD_FACTOR = 2.3
ROW_FACTORS = {"sac_ln": (1.44, 0.49), "mad_sac": (2.4, 0.0)}  # (a, q) of the module notes
PROCESS_BYTES = {"cpu": int(0.6 * GIB), "cuda": int(2.5 * GIB)}  # Python, torch, Ray, MLflow, dm_control (+CUDA)
GPU_FIT = {"sac_ln": (2.1, int(0.91 * GIB)), "mad_sac": (1.25, int(1.13 * GIB))}  # (slope, pool)
CUDA_CONTEXT_BYTES = int(0.6 * GIB)  # GPU memory outside torch's allocator: context, cuBLAS workspace
ENV_BYTES, ENV_WORKER_BYTES = 12 * 2**20, 300 * 2**20  # one dm_control env; one env worker process
HOST_USABLE = 0.9  # share of a node's RAM for packs: the OS and Ray's own processes, Ray's memory monitor at 95%


@dataclass(frozen=True)
class Counted:
    """One member's counted bytes (state, trainable parameters) and layer widths (all learned networks, critic)."""

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

    from qed_ray.config import AgentSpec, TemperatureSpec
    from qed_ray.codec import adapter
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


def gib(nbytes: float) -> str:
    """``12.3 GiB`` (``0.41 GiB`` below 1)."""
    value = nbytes / GIB
    return f"{value:.2f} GiB" if value < 1 else f"{value:.1f} GiB" if value < 100 else f"{math.ceil(value)} GiB"
