"""The bill of a sweep: each pack's expected wall time, the order packs go to Tune (longest first), and the GPU-hours
(CPU-hours) with the scheduling tail and the wall clock on a cluster's workers (the dry run's plan lines).

**A pack's rate** (seed-decisions per second of the card, acting and one update per decision, no envs) comes from
the measured throughput table (:mod:`qed_ray.service.throughput`) and is scaled, each step stated in the plan, where
a cell was not measured:

- sharing a card (``1 / resources.gpu`` packs): measured, or scaled from the measured sharing of
  :data:`~qed_ray.service.throughput.SHARE_CELL`, or else the card runs Q packs of S seeds at most as fast as one
  pack of Q S seeds ("as one pack of Q S");
- pack size S: linear between measured sizes; past the largest, its seed-decisions per second are held (no further
  gain: the S = 30 cell is owed to a GPU run);
- precision: a cell at ``train.precision`` where measured, else the fp32 one (an upper bound on the time);
- network shape: a shape other than the table's (:data:`REF_HIDDEN`, :data:`REF_BATCH`, default agent settings)
  by its FLOPs per update (:func:`update_flops`, counted on the CPU);
- card: the table's card to another (:data:`~qed_ray.service.memory.NODE_TYPES`) by their FP32 peaks.

**A pack's wall time** (the model of ``benchmarks/grid_hours.py``): per decision,
``t = max(S Q / r_Q, S / r_1 + S c (1 + e) / W)``, r_Q the card's rate with Q packs on it, r_1 one pack alone, c the
task's env seconds per decision (``benchmarks/env_costs.json``, :data:`ENV_COSTS_PATH`), e the evaluation decisions
per training decision and W the pack's env workers (at least 1). A CPU pack (``resources.gpu`` 0) is timed by its
env stepping alone, which then gives no more than a lower bound.

**The schedule**: packs go to Tune longest first and each starts on the first free slot (a node runs
:func:`~qed_ray.service.memory.packs_per_node` packs); a node is held until its last pack ends, so the GPU-hours
count each node's idle tail; the wall clock adds one node start (:data:`STARTUP_S`).
"""

from __future__ import annotations

import functools
import heapq
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from qed_ray.records.codec import adapter, load_json
from qed_ray.config import AgentSpec, RunSpec, TemperatureSpec, agent_spec
from qed_ray.rl.agents import make_packed_agent
from qed_ray.rl.precision import CUDA_DEFAULT
from qed_ray.rl.replay import Replay
from qed_ray.rl.update import PackUpdater
from qed_ray.service.memory import NODE_TYPES, NodeType, one_thread
from qed_ray.service.packing import Pack
from qed_ray.service.throughput import SHARE_CELL, Throughput
from qed_ray.tasks import TASK_DIMS

ENV_COSTS_PATH = Path(__file__).parents[2] / "benchmarks" / "env_costs.json"
STARTUP_S = 600.0  # a worker node's start: the autoscaler's launch, the image, Ray (an estimate)
REF_HIDDEN, REF_BATCH = 512, 512  # the shape of gpu_bench.py's cells (the table's "hidden" and "batch")
# The shipped clusters: their config, their GPU worker type and how many of those the autoscaler may start.
CLUSTERS: dict[str, tuple[str, str, int]] = {"aws": ("cluster/aws.yaml", "g5.4xlarge", 8),
                                             "gcp": ("cluster/gcp.yaml", "g2-standard-16", 8)}
UPDATE_MODES = {"auto": "graph", "graph": "graph", "compile": "compile", "off": "off"}  # on a GPU, by train.compile


@functools.lru_cache(maxsize=4)
def env_costs(path: Path = ENV_COSTS_PATH) -> dict[str, float]:
    """Env seconds per decision per task (empty when the measurement is missing: env stepping is then free)."""
    if not Path(path).is_file():
        return {}
    return {t: d["ms_per_decision"] / 1000 for t, d in load_json(path)["tasks"].items()}


def update_flops(run: RunSpec, hidden: int | None = None, batch: int | None = None) -> float:
    """FLOPs of one update of one member of ``run``'s agent (or of its name's defaults at ``hidden``/``batch``),
    counted on the CPU at 16 rows and scaled to the batch (every matmul of an update has a batch axis)."""
    agent = run.agent if hidden is None else agent_spec(name=run.agent.name, hidden=hidden, batch_size=batch)
    temperature = {**run.temperature.shared(), **({"k": 0.2} if run.temperature.kind == "qed" else {}),
                   **({"alpha": 0.1} if run.temperature.kind == "fixed" else {})}  # its scalars cost nothing
    return _flops(agent.model_dump_json(), json.dumps(temperature, sort_keys=True), *TASK_DIMS["cheetah-run"]) * \
        agent.batch_size / 16


@functools.lru_cache(maxsize=64)
def _flops(agent_json: str, temperature_json: str, obs: int, act: int) -> float:
    agent = adapter(AgentSpec).validate_json(agent_json)
    with torch.random.fork_rng(devices=[]), one_thread():
        packed = make_packed_agent(agent, TemperatureSpec.model_validate_json(temperature_json), obs, act,
                                   torch.device("cpu"), [0])
        replay = Replay(32, obs, act, [np.random.default_rng(0)], torch.device("cpu"))
        replay.storage.normal_()
        replay.storage[..., replay.columns["terminated"]] = 0.0
        replay.added[:] = 32
        on = np.ones(1, bool)
        update = PackUpdater(packed, replay, None, "off", 16)
        with FlopCounterMode(display=False) as counter:
            update(replay.indices(16, on), packed.noise(16, on))
    return float(counter.get_total_flops())


@dataclass(frozen=True)
class PackRate:
    """Seed-decisions per second of the card holding Q packs (``shared``) and of one pack alone, and the scalings
    used (see the module notes)."""

    shared: float
    alone: float
    notes: frozenset[str]


def _size_rate(table: Throughput, agent: str, kind: str, size: int, mode: str, precision: str,
               notes: set[str]) -> float | None:
    """One pack of ``size`` alone: measured, or linear between measured sizes, or held past the largest."""
    rate = table.decisions_per_s(agent, kind, size, 1, mode, precision)
    if rate is not None:
        return rate
    sizes = sorted(e["seeds"] for e in table.entries if (e["agent"], e["temperature"], e["packs"], e["mode"],
                   e.get("precision", "fp32")) == (agent, kind, 1, mode, precision))
    if not sizes:
        return None
    below, above = [s for s in sizes if s < size], [s for s in sizes if s > size]
    if not below:
        return None
    lo = table.decisions_per_s(agent, kind, below[-1], 1, mode, precision)
    if not above:
        notes.add(f"S={size} at the S={below[-1]} cell's rate")
        return lo
    hi = table.decisions_per_s(agent, kind, above[0], 1, mode, precision)
    notes.add(f"S={size} between S={below[-1]} and S={above[0]}")
    return lo + (hi - lo) * (size - below[-1]) / (above[0] - below[-1])


def pack_rate(table: Throughput, run: RunSpec, size: int, per_gpu: int, node: NodeType | None) -> PackRate | None:
    """The rates of a pack of ``size`` members of ``run``'s settings with ``per_gpu`` packs on one card of ``node``
    (None: the table's card); None when the table has no cell to scale from."""
    mode = UPDATE_MODES[run.train.compile]
    precision = CUDA_DEFAULT if run.train.precision == "auto" else run.train.precision
    kind = "te" if run.temperature.kind == "fixed" else run.temperature.kind  # a fixed alpha runs te's passes
    notes: set[str] = set()
    if not any(e.get("precision", "fp32") == precision and e["agent"] == run.agent.name for e in table.entries):
        notes.add(f"{precision} priced as fp32")
        precision = "fp32"
    alone = _size_rate(table, run.agent.name, kind, size, mode, precision, notes)
    shared = table.shared_rate(run.agent.name, kind, size, per_gpu, mode, precision)
    if shared is not None:
        if shared[1]:
            notes.add(f"sharing scaled from {'/'.join(map(str, SHARE_CELL))}")
        shared_rate = shared[0]
    else:
        whole = _size_rate(table, run.agent.name, kind, size * per_gpu, mode, precision, notes)
        shared_rate = whole if per_gpu > 1 else alone
        if per_gpu > 1 and whole is not None:
            notes.add(f"{per_gpu} packs of S={size} as one pack of S={size * per_gpu}")
    if alone is None or shared_rate is None:
        return None
    scale = 1.0
    if run.agent != agent_spec(name=run.agent.name, hidden=REF_HIDDEN, batch_size=REF_BATCH):
        ratio = update_flops(run, REF_HIDDEN, REF_BATCH) / update_flops(run)
        if abs(ratio - 1) > 0.01:
            scale *= ratio
            notes.add("other shapes by FLOPs per update")
    if node is not None and node.card != table.card:
        ref = next((n for n in NODE_TYPES.values() if n.card == table.card), None)
        if ref is not None:
            scale *= node.fp32_tflops / ref.fp32_tflops
            notes.add(f"{node.card} = {table.card} x {node.fp32_tflops:g}/{ref.fp32_tflops:g} FP32 TFLOP/s")
    return PackRate(shared_rate * scale, alone * scale, frozenset(notes))


def pack_seconds(pack: Pack, rate: PackRate | None, per_gpu: int, env_workers: int) -> float:
    """Expected wall seconds of ``pack`` (the module notes' model; env stepping alone when ``rate`` is None)."""
    run, s = pack.trials[0].run, len(pack.trials)
    t = run.train
    evals = t.eval_episodes * t.episode_decisions / t.eval_every_decisions
    env = s * env_costs().get(run.task, 0.0) * (1 + evals) / max(env_workers, 1)
    if rate is None:
        return t.decisions * env
    return t.decisions * max(s * per_gpu / rate.shared, s / rate.alone + env)


def longest_first(packs: Sequence[Pack], seconds: Sequence[float]) -> list[Pack]:
    """``packs`` by their expected wall ``seconds``, longest first (ties in their given order)."""
    order = sorted(range(len(packs)), key=lambda i: -seconds[i])
    return [packs[i] for i in order]


@dataclass(frozen=True)
class Schedule:
    """Packs run longest first on ``slots`` (``per_node`` per node): when the last ends, and the node-hours held."""

    makespan_s: float
    node_hours: float
    busy_hours: float  # the packs' own slot-hours over per_node: node-hours without any idle tail


def schedule(seconds: Sequence[float], nodes: int, per_node: int) -> Schedule:
    """Longest-first list scheduling of packs of ``seconds`` on ``nodes`` x ``per_node`` slots; a node is held
    until its last pack ends (then the autoscaler lets it go)."""
    free = [(0.0, i) for i in range(max(nodes, 1) * per_node)]
    heapq.heapify(free)
    ends = [0.0] * len(free)
    for s in sorted(seconds, reverse=True):
        start, slot = heapq.heappop(free)
        ends[slot] = start + s
        heapq.heappush(free, (start + s, slot))
    node_end = [max(ends[n * per_node:(n + 1) * per_node]) for n in range(max(nodes, 1))]
    return Schedule(max(ends, default=0.0), sum(node_end) / 3600, sum(seconds) / per_node / 3600)
