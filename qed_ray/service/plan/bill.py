"""The bill of a sweep on one machine: each pack's rate, looked up in the measured tables, its wall time, the order
packs go to Tune, and the schedule with its tail.

A **rate** is a measured cell, or each step that is not one is named: sizes between measured ones linear, past the
largest at its rate; Q packs sharing an unmeasured card as one pack of Q S; an unmeasured precision as fp32; an
unmeasured card from the measured one by FP32 peaks. A shape or agent never measured gives the reason instead.
A pack's **wall time** per decision is ``max(S Q / r_Q, S / r_1 + S c (1 + e) / W)`` (r_Q: the rate with Q packs on
the device, r_1: alone, c: the task's env seconds per decision, e: evaluation decisions per training decision, W:
env workers), plus :data:`PACK_START_S`. The **schedule** puts packs longest first on the first free slot; a node
is held until its last pack ends (the tail).
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from qed_ray.records.codec import load_json
from qed_ray.spec.config import RunSpec
from qed_ray.rl.precision import CUDA_DEFAULT
from qed_ray.service.plan.machines import Machine
from qed_ray.service.packing import Pack
from qed_ray.records.throughput import Throughput

ENV_COSTS_PATH = Path(__file__).parents[3] / "benchmarks" / "env_costs.json"
NODE_START_S = 600.0  # a worker node's start: the autoscaler's launch, the image, Ray (an estimate)
PACK_START_S = 20.0  # a Tune trial's start and end: a Ray worker's imports, the trainer's build, checkpoints


@functools.lru_cache(maxsize=4)
def env_costs(path: Path = ENV_COSTS_PATH) -> dict[str, float]:
    """Env seconds per decision per task (empty when the measurement is missing: env stepping is then free)."""
    if not Path(path).is_file():
        return {}
    return {t: d["ms_per_decision"] / 1000 for t, d in load_json(path)["tasks"].items()}


@dataclass(frozen=True)
class Rate:
    """Seed-decisions per second with Q packs on the device and of one pack alone; the steps not measured."""

    shared: float
    alone: float
    notes: frozenset[str]


def _sized(table: Throughput, agent: str, kind: str, size: int, mode: str, precision: str, shape,
           notes: set[str]) -> float | None:
    """One pack of ``size`` alone: measured, linear between measured sizes, or held past the largest."""
    rate = table.rate(agent, kind, size, 1, mode, precision, shape)
    sizes = table.sizes(agent, kind, mode, precision) if shape == (table.hidden, table.batch) else []
    below, above = [s for s in sizes if s < size], [s for s in sizes if s > size]
    if rate is not None or not below:
        return rate
    lo = table.rate(agent, kind, below[-1], 1, mode, precision)
    if not above:
        notes.add(f"packs past S={below[-1]} at its rate")
        return lo
    notes.add("sizes between measured ones linear")
    return lo + (table.rate(agent, kind, above[0], 1, mode, precision) - lo) * (size - below[-1]) / (above[0] -
                                                                                                   below[-1])


def pack_rate(run: RunSpec, size: int, per_gpu: int, m: Machine, table: Throughput | None,
              peaks: dict[str, float]) -> Rate | str:
    """The rate of a pack of ``size`` members of ``run``'s settings with ``per_gpu`` packs on one card of ``m``
    (``per_gpu`` 0: a CPU pack, by the CPU ``table``); a str (why there is no estimate) where no cell applies."""
    kind = "te" if run.temperature.kind == "fixed" else run.temperature.kind  # a fixed alpha runs te's passes
    shape, agent = (run.agent.hidden, run.agent.batch_size), run.agent.name
    if table is None:
        return f"no {'GPU' if per_gpu else 'CPU'} rate table (benchmarks/{'gpu_bench' if per_gpu else 'cpu_rates'}.py)"
    if not per_gpu:
        rate = table.rate(agent, kind, 1, 1, "off", "fp32", shape) if size == 1 else None
        other = m.name != "this machine" and m.cpus != table.cpus
        return Rate(rate, rate, frozenset([f"CPU rates of the {table.card} ({table.cpus} CPUs)"] if other else [])) \
            if rate else (
            f"{agent}/{kind} hidden {shape[0]}, batch {shape[1]}, S={size} was never measured on the CPU "
            f"({table.card}: packs of one at hidden = batch {sorted({e.hidden for e in table.entries})})")
    mode = {"auto": "graph"}.get(run.train.compile, run.train.compile)
    precision, notes = CUDA_DEFAULT if run.train.precision == "auto" else run.train.precision, set()
    if not table.sizes(agent, kind, mode, precision):
        notes.add(f"{precision} priced as fp32")
        precision = "fp32"
    alone = _sized(table, agent, kind, size, mode, precision, shape, notes)
    shared = table.rate(agent, kind, size, per_gpu, mode, precision, shape) if per_gpu > 1 else alone
    if shared is None and alone is not None:
        shared = _sized(table, agent, kind, size * per_gpu, mode, precision, shape, notes)
        notes.add(f"{per_gpu} packs on a card as one pack of their seeds")
    if alone is None or shared is None:
        return (f"{agent}/{kind} hidden {shape[0]}, batch {shape[1]} ({mode}) was never measured on a GPU "
                f"(the {table.card} table: hidden {table.hidden}, batch {table.batch})")
    scale = 1.0
    if m.card != table.card:
        scale = peaks[m.card] / peaks[table.card]
        notes.add(f"{m.card} extrapolated from the measured {table.card} by FP32 peak "
                  f"({peaks[m.card]:g}/{peaks[table.card]:g})")
    return Rate(shared * scale, alone * scale, frozenset(notes))


def pack_seconds(pack: Pack, rate: Rate, per_gpu: int, env_workers: int) -> float:
    """Expected wall seconds of ``pack`` (the module notes' model)."""
    run, s = pack.trials[0].run, len(pack.trials)
    t = run.train
    evals = t.eval_episodes * t.episode_decisions / t.eval_every_decisions
    env = s * env_costs().get(run.task, 0.0) * (1 + evals) / max(env_workers, 1)
    return PACK_START_S + t.decisions * max(s * max(per_gpu, 1) / rate.shared, s / rate.alone + env)


def longest_first(packs: Sequence[Pack], seconds: Sequence[float]) -> list[Pack]:
    """``packs`` by their expected wall ``seconds``, longest first (ties in their given order)."""
    return [packs[i] for i in sorted(range(len(packs)), key=lambda i: -seconds[i])]


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
