"""Memory of a pack: its host and GPU bytes, whether it fits a node type, and which node it needs (the dry run's
memory lines).

Per member (one seed run of the pack), on the device that trains it:

- **networks and optimiser state**: every tensor of the agent (online and target networks, the temperature, Adam's
  two moments), counted from the agent the spec builds;
- **update working set**: what one update allocates at its peak (gradients, activations kept for the backward,
  QED's [B N, H] passes). Measured, not modelled: one update of the member's agent runs on the CPU at two small
  batch sizes (:data:`PROBE_BATCHES`) under :class:`AllocationPeak`, and the peak is extrapolated linearly in the
  batch to ``agent.batch_size`` (every tensor of an update has a batch axis, or its size does not depend on the
  batch). A CUDA graph's private pool holds the same peak;
- **replay at capacity**: S x capacity x row bytes (:func:`~qed_ray.rl.replay.replay_bytes`), on the GPU when it
  fits in :data:`~qed_ray.rl.replay.GPU_REPLAY_SHARE` of the pack's share of the card, else in host memory (as
  :func:`~qed_ray.rl.replay.replay_device` places it).

Host memory adds the pack's process (:data:`PROCESS_BYTES`), its envs and env worker processes (:data:`ENV_BYTES`,
:data:`ENV_WORKER_BYTES`) and the host copy of every member's state a checkpoint writes; GPU memory adds the CUDA
context (:data:`CUDA_CONTEXT_BYTES`). Those four are estimates (measured on this project's CPU machine where
named); the rest is counted or measured per spec.

A node type (:data:`NODE_TYPES`, the shipped cluster configs' workers and an H100 one) holds
``min(cpus // trial CPUs, gpus / resources.gpu)`` packs; a pack fits it when that many packs' host memory fits in
:data:`HOST_USABLE` of its RAM, its GPU bytes (allocator part) in its share of the card, and the packs sharing a
card in the card.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import weakref
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from qed_ray.config import RunSpec
from qed_ray.rl.agents import make_packed_agent
from qed_ray.rl.replay import GPU_REPLAY_SHARE, Replay, replay_bytes
from qed_ray.rl.update import PackUpdater
from qed_ray.tasks import TASK_DIMS

GIB = 2**30
PROBE_BATCHES = (8, 16)
# A pack's own process (Python, torch, Ray, MLflow and dm_control imported: 0.4 GiB measured on the CPU machine;
# with CUDA, the CUDA libraries' host memory on top, an estimate).
PROCESS_BYTES = {"cpu": int(0.6 * GIB), "cuda": int(2.5 * GIB)}
CUDA_CONTEXT_BYTES = int(0.6 * GIB)  # GPU memory outside torch's allocator: context, cuBLAS workspace (estimate)
ENV_BYTES = 12 * 2**20  # one dm_control env (7.1 and 12.6 MiB measured for quadruped-run and cheetah-run)
ENV_WORKER_BYTES = 300 * 2**20  # one env worker process: Python, numpy, dm_control (estimate)
HOST_USABLE = 0.9  # share of a node's RAM for packs: the OS and Ray's own processes, Ray's memory monitor at 95%
# On a GPU the update runs as a CUDA graph (or compiled) with the caching allocator's rounding and cuBLAS's
# workspaces: its working set is this much larger than the CPU probe's. From the one GPU cell measured in a fresh
# process (gpu_bench.py: SAC-LN QED, S = 10, 996 MiB peak): (996 - 113 state - 17 replay) / 604 probed = 1.43.
GRAPH_FACTOR = 1.45


@dataclass(frozen=True)
class NodeType:
    """A worker node type: its card (GPU memory as ``nvidia-smi`` reports it), RAM, CPUs, GPUs, and the card's FP32
    peak (what prices a card that was not measured, :mod:`qed_ray.service.bill`)."""

    name: str
    card: str
    gpu_bytes: int
    host_bytes: int
    cpus: int
    gpus: int
    fp32_tflops: float


# The shipped cluster configs' GPU workers (cluster/aws.yaml, cluster/gcp.yaml) and a one-H100 node. FP32 peaks:
# A10G 35.0 TFLOP/s (AWS's A10 variant, higher CUDA-core clocks than the A10's 31.2), L4 30.3 (NVIDIA L4
# datasheet), H100 SXM 66.9 (132 SMs x 128 lanes x 2 x 1.98 GHz).
NODE_TYPES: dict[str, NodeType] = {n.name: n for n in (
    NodeType("g5.4xlarge", "NVIDIA A10G", int(22.5 * GIB), 64 * GIB, 16, 1, 35.0),
    NodeType("g2-standard-16", "NVIDIA L4", int(22.5 * GIB), 64 * 10**9, 16, 1, 30.3),
    NodeType("a3-highgpu-1g", "NVIDIA H100 80GB HBM3", int(79.6 * GIB), 234 * 10**9, 26, 1, 66.9),
)}


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one CPU thread inside: a probe's small matmuls run ten times faster so on a loaded machine (no
    threads competing for the cores) and no slower on an idle one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class AllocationPeak(TorchDispatchMode):
    """Bytes of the tensor storages created inside (on any device) that are alive at once, at their peak: the
    CPU's counterpart of ``torch.cuda.max_memory_allocated`` for the code run inside. ``trace`` holds the live
    bytes after each operation."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.trace: list[int] = []
        self._seen: set[tuple[str, int]] = set()

    def _free(self, key: tuple[str, int], nbytes: int) -> None:
        self.live -= nbytes
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = (str(t.device), storage.data_ptr())
                if key[1] and key not in self._seen:
                    self._seen.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, storage.nbytes())
        self.trace.append(self.live)
        return out


@dataclass(frozen=True, eq=False)
class MemberMemory:
    """One member's bytes: its state (networks, buffers, optimiser moments) and its update's live bytes after each
    operation, ``fixed + per_row x batch`` ([T] each), whose maximum is the working set."""

    state: int
    fixed: np.ndarray
    per_row: np.ndarray

    def working(self, batch: int) -> int:
        """The update's working set at ``batch`` rows: its largest live bytes."""
        return int(np.max(self.fixed + self.per_row * batch))


def member_memory(run: RunSpec, obs_dim: int, action_dim: int) -> MemberMemory:
    """:class:`MemberMemory` of ``run``'s agent (see the module notes); the same for every run with its shared
    settings and dims, whatever its task, seed or member scalars (measured once per process)."""
    temperature = {**run.temperature.shared(), **({"k": 0.2} if run.temperature.kind == "qed" else {}),
                   **({"alpha": 0.1} if run.temperature.kind == "fixed" else {})}
    # Only the agent and the temperature shape the probe (train settings do not: it runs one update on the CPU).
    canonical = {"agent": run.agent.model_dump(mode="json"), "task": "cheetah-run", "temperature": temperature}
    return _member_memory(json.dumps(canonical, sort_keys=True), obs_dim, action_dim)


@functools.lru_cache(maxsize=64)
def _member_memory(run_json: str, obs_dim: int, action_dim: int) -> MemberMemory:
    run = RunSpec.model_validate_json(run_json)
    cpu, traces, on, rows = torch.device("cpu"), [], np.ones(1, bool), 2 * max(PROBE_BATCHES)
    with torch.random.fork_rng(devices=[]), one_thread():
        agent = make_packed_agent(run.agent, run.temperature, obs_dim, action_dim, cpu, [0])
        replay = Replay(rows, obs_dim, action_dim, [np.random.default_rng(0)], cpu)
        replay.storage.normal_()
        replay.storage[..., replay.columns["terminated"]] = 0.0
        replay.added[:] = rows
        for i, batch in enumerate(PROBE_BATCHES):
            update = PackUpdater(agent, replay, None, "off", batch)
            if i == 0:
                update(replay.indices(batch, on), agent.noise(batch, on))  # the first step creates Adam's moments
            with AllocationPeak() as probe:
                update(replay.indices(batch, on), agent.noise(batch, on))
            traces.append(np.asarray(probe.trace, dtype=np.float64))
    state = sum(t.numel() * t.element_size() for t in agent.tensors().values())
    return MemberMemory(state, *_extrapolate(*traces))


def _extrapolate(small: np.ndarray, large: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(fixed, per_row)`` [T] of the live bytes after each of the update's T operations, from their traces at
    the two :data:`PROBE_BATCHES` (the same operations at both: the update's shapes are static)."""
    if len(small) != len(large):  # a batch-dependent code path: the peaks alone, extrapolated
        small, large = small.max(keepdims=True), large.max(keepdims=True)
    (b1, b2) = PROBE_BATCHES
    per_row = (large - small) / (b2 - b1)
    return small - per_row * b1, per_row


@dataclass(frozen=True)
class PackMemory:
    """A pack's memory on a node type: its members, its replay's bytes and where they live, the bytes of tensors on
    the device that trains it (``tensors``: torch's allocator, replay included when it is there: what
    ``torch.cuda.max_memory_allocated`` measures, and what a per-process memory fraction caps), and its whole host
    and GPU memory (0 for a CPU pack)."""

    members: int
    replay: int
    replay_on: str
    tensors: int
    host: int
    gpu: int


def pack_memory(runs: Sequence[RunSpec], env_workers: int, gpu_share: float, node: NodeType | None) -> PackMemory:
    """The memory of the pack of ``runs`` trained with ``env_workers`` env worker processes and ``gpu_share`` of a
    card of ``node`` (``gpu_share`` 0 or ``node`` None: on the CPU)."""
    run, s = runs[0], len(runs)
    obs, act = TASK_DIMS[run.task]
    m = member_memory(run, obs, act)
    t = run.train
    replay = replay_bytes(s, t.replay_capacity or t.decisions, obs, act)
    envs = s * (1 + t.eval_episodes) * ENV_BYTES + env_workers * ENV_WORKER_BYTES
    around = envs + s * m.state  # envs, env workers, the checkpoint's host copy of every member's state
    if not gpu_share or node is None:
        tensors = s * (m.state + m.working(run.agent.batch_size)) + replay
        return PackMemory(s, replay, "host", tensors, PROCESS_BYTES["cpu"] + tensors + around, 0)
    on_gpu = replay <= GPU_REPLAY_SHARE * gpu_share * node.gpu_bytes
    tensors = s * (m.state + int(GRAPH_FACTOR * m.working(run.agent.batch_size))) + (replay if on_gpu else 0)
    host = PROCESS_BYTES["cuda"] + around + (0 if on_gpu else replay)
    return PackMemory(s, replay, "gpu" if on_gpu else "host", tensors, host, tensors + CUDA_CONTEXT_BYTES)


def packs_per_node(node: NodeType, trial_cpus: float, gpu_share: float) -> int:
    """How many packs a node of ``node`` runs at once: by its CPUs and, for GPU packs, its GPU shares."""
    by_cpu = int(node.cpus // trial_cpus) if trial_cpus else node.cpus
    return min(by_cpu, round(node.gpus / gpu_share)) if gpu_share else by_cpu


def fit_problem(mem: PackMemory, node: NodeType, trial_cpus: float, gpu_share: float) -> str | None:
    """Why a pack of ``mem`` does not fit ``node`` (the first reason), or None."""
    per_node = packs_per_node(node, trial_cpus, gpu_share)
    if per_node < 1:
        return f"needs {trial_cpus:g} CPUs, {node.name} has {node.cpus}"
    if per_node * mem.host > HOST_USABLE * node.host_bytes:
        return (f"{per_node} pack(s) x {gib(mem.host)} host memory > {HOST_USABLE:.0%} of {node.name}'s "
                f"{gib(node.host_bytes)}")
    if gpu_share and mem.tensors > gpu_share * node.gpu_bytes:
        return f"{gib(mem.tensors)} of GPU tensors > its share ({gpu_share:g}) of the {node.card}'s " \
               f"{gib(node.gpu_bytes)}"
    if gpu_share and round(1 / gpu_share) * mem.gpu > node.gpu_bytes:
        return f"{round(1 / gpu_share)} packs x {gib(mem.gpu)} GPU memory > the {node.card}'s {gib(node.gpu_bytes)}"
    return None


def needed_node(runs: Sequence[RunSpec], env_workers: int, trial_cpus: float, gpu_share: float) -> str:
    """The first node type of :data:`NODE_TYPES` (smallest card first) whose packs' memory fits, or ``none of``
    them."""
    for node in sorted(NODE_TYPES.values(), key=lambda n: (n.gpu_bytes, n.host_bytes)):
        if fit_problem(pack_memory(runs, env_workers, gpu_share, node), node, trial_cpus, gpu_share) is None:
            return node.name
    return f"none of {', '.join(NODE_TYPES)}"


def largest_fit(runs: Sequence[RunSpec], env_workers: int, trial_cpus: float, gpu_share: float,
                node: NodeType) -> int:
    """The most members (of ``runs``, in order) a pack may hold and still fit ``node`` (0: not even one)."""
    lo, hi = 0, len(runs)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        mem = pack_memory(runs[:mid], min(env_workers, mid), gpu_share, node)
        lo, hi = (mid, hi) if fit_problem(mem, node, trial_cpus, gpu_share) is None else (lo, mid - 1)
    return lo


def gib(nbytes: float) -> str:
    """``12.3 GiB`` (``0.41 GiB`` below 1)."""
    value = nbytes / GIB
    return f"{value:.2f} GiB" if value < 1 else f"{value:.1f} GiB" if value < 100 else f"{math.ceil(value)} GiB"
