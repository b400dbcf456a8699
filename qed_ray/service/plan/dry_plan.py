"""The plan of ``--dry-run``, one block per machine (docs/spec.md, The plan): each pack's memory from counted bytes,
its rate from the measured tables (each step that is not a measured cell named), its wall time, the schedule with
its tail, the pack size that fits (the model: docs/design.md, Cost)."""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from qed_ray.records.codec import load_json
from qed_ray.records.throughput import Throughput
from qed_ray.rl.precision import CUDA_DEFAULT
from qed_ray.rl.replay import GPU_REPLAY_SHARE
from qed_ray.service.packing import Pack, form_packs, split
from qed_ray.service.plan.machines import Machine, PriceTable, per_node, placement_problem
from qed_ray.spec.config import AgentSpec, RunSpec, TemperatureSpec
from qed_ray.spec.console import show_bytes as gib
from qed_ray.spec.replay_memory import GIB, MAX_PACK_REPLAY_BYTES, replay_bytes, replay_capacity
from qed_ray.spec.sweep import SweepSpec
from qed_ray.spec.tasks import TASK_DIMS

ENV_COSTS_PATH = Path(__file__).parents[3] / "benchmarks" / "env_costs.json"
NODE_START_S = 600.0  # a worker node's start: the autoscaler's launch, the image, Ray (an estimate)
PACK_START_S = 5.0  # a trial's start and end on a reused worker (2.2 s a pack, smoke sweep) + a worker's first start
GRAD_FACTOR = 2.3
ROW_FACTORS = {"sac_ln": (1.44, 0.49), "mad_sac": (2.4, 0.0)}  # (a, q)
PROCESS_BYTES = {"cpu": int(0.6 * GIB), "cuda": int(2.5 * GIB)}  # Python, torch, Ray, MLflow, dm_control (+CUDA)
GPU_FIT = {"sac_ln": (2.1, int(0.91 * GIB)), "mad_sac": (1.25, int(1.13 * GIB))}  # (slope, pool)
CUDA_CONTEXT_BYTES = int(0.6 * GIB)  # GPU memory outside torch's allocator: context, cuBLAS workspace
ENV_BYTES, ENV_WORKER_BYTES = 12 * 2**20, 300 * 2**20  # one dm_control env; one env worker process
HOST_USABLE = 0.9  # share of a node's RAM for packs: the OS and Ray's own processes, Ray's memory monitor at 95%
LEGEND = ("legend: packs of S (auto): the largest pack that fits a node and keeps every node busy; with the tail: "
          "node-hours, each node held until its last pack ends; spot: that price, plus the work an interruption "
          "loses (since the last checkpoint)")


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
    if rate is not None or not sizes or size <= sizes[0]:
        return rate
    notes.add(f"packs past S={sizes[-1]} at its rate" if size >= sizes[-1] else "sizes between measured ones linear")
    return float(np.interp(size, sizes, [table.rate(agent, kind, s, 1, mode, precision) for s in sizes]))


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
        if rate is None:
            return (f"{agent}/{kind} hidden {shape[0]}, batch {shape[1]}, S={size} was never measured on the CPU "
                    f"({table.card}: packs of one at hidden = batch {sorted({e.hidden for e in table.entries})})")
        other = m.name != "this machine" and m.cpus != table.cpus
        return Rate(rate, rate, frozenset([f"CPU rates of the {table.card} ({table.cpus} CPUs)"] if other else []))
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
    """Expected wall seconds of ``pack`` (docs/design.md, Cost)."""
    run, s = pack.trials[0].run, len(pack.trials)
    t = run.train
    evals = t.eval_episodes * t.episode_decisions / t.eval_every_decisions
    env = s * env_costs().get(run.task, 0.0) * (1 + evals) / max(env_workers, 1)
    return PACK_START_S + t.decisions * max(s * max(per_gpu, 1) / rate.shared, s / rate.alone + env)


@dataclass(frozen=True)
class Schedule:
    """When the last pack ends, the node-hours held, and the packs' own slot-hours over ``per_node`` (no tail)."""

    makespan_s: float
    node_hours: float
    busy_hours: float


def schedule(seconds: Sequence[float], nodes: int, per_node: int) -> Schedule:
    """Packs of ``seconds`` longest first on ``nodes`` x ``per_node`` slots; a node is held until its last pack ends."""
    free = [(0.0, i) for i in range(max(nodes, 1) * per_node)]  # (when a slot is free, the slot): sorted, a heap
    for s in sorted(seconds, reverse=True):
        start, slot = heapq.heappop(free)
        heapq.heappush(free, (start + s, slot))
    ends = [t for t, _ in sorted(free, key=lambda f: f[1])]  # each slot's last pack's end, in slot order
    node_end = [max(ends[n * per_node:(n + 1) * per_node]) for n in range(max(nodes, 1))]
    return Schedule(max(ends, default=0.0), sum(node_end) / 3600, sum(seconds) / per_node / 3600)


@dataclass(frozen=True)
class Counted:
    """One member's counted bytes (with Adam's moments), its learned networks' widths (all, the critic's), QED's n."""

    state: int
    trainable: int
    width: int
    critic_width: int
    n_actions: int
    agent: str

    def working(self, batch: int) -> int:
        a, q = ROW_FACTORS[self.agent]
        return int(GRAD_FACTOR * self.trainable + 4 * batch * (a * self.width + q * self.n_actions * self.critic_width))


def counted(run: RunSpec) -> Counted:
    """:class:`Counted` of ``run``'s agent on its task (the same for every seed, task of its size and k)."""
    qed = run.temperature.kind == "qed"
    return _counted(run.agent, run.temperature.n_actions if qed else 0, *TASK_DIMS[run.task])


@functools.lru_cache(maxsize=64)
def _counted(agent_spec: AgentSpec, n_actions: int, obs: int, act: int) -> Counted:
    import torch

    from qed_ray.rl.agents import make_packed_agent

    with torch.random.fork_rng(devices=[]):
        agent = make_packed_agent(agent_spec, TemperatureSpec(kind="te"), obs, act, torch.device("cpu"), [0])
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    trainable = nbytes(p for o in agent.opts.values() for g in o.param_groups for p in g["params"])
    widths = {m: sum(v.shape[1] for k, v in sd.items() if k.endswith("weight") and v.ndim >= 2)
              for m, sd in agent.state.items() if not m.endswith("_target")}
    return Counted(nbytes(t for sd in agent.state.values() for t in sd.values()) + 2 * trainable, trainable,
                   sum(widths.values()), widths.get("critic", 0), n_actions, agent.name)


@dataclass(frozen=True)
class PackMemory:
    """A pack's replay and where it lives, its tensors on its training device, its host and GPU memory (0 on a CPU)."""

    replay: int
    replay_on: str
    tensors: int
    host: int
    gpu: int


def pack_memory(runs: Sequence[RunSpec], env_workers: int, gpu_share: float, gpu_bytes: int) -> PackMemory:
    """``runs`` as a pack with ``env_workers`` env worker processes on ``gpu_share`` of a card (0: on the CPU)."""
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


@dataclass(frozen=True)
class Tables:
    """The measured rates (GPU, CPU) and the prices with the cards' FP32 peaks (None: no ``cluster/``)."""

    gpu: Throughput | None
    cpu: Throughput | None
    prices: PriceTable | None


def fit_problem(spec: SweepSpec, pack: Pack, m: Machine) -> str | None:
    """Why ``pack`` does not fit a node of ``m`` next to the others there, or None."""
    gpu, n = spec.resources.gpu, per_node(spec, m)
    mem = pack_memory([t.run for t in pack.trials], min(spec.pack.env_workers, len(pack.trials)), gpu, m.gpu_bytes)
    if mem.replay > MAX_PACK_REPLAY_BYTES:
        return f"its replay {gib(mem.replay)} > the {gib(MAX_PACK_REPLAY_BYTES)} a pack may hold"
    if n * mem.host > HOST_USABLE * m.host_bytes:
        return f"{n} x {gib(mem.host)} host memory > {HOST_USABLE:.0%} of {m.node}'s {gib(m.host_bytes)}"
    if gpu and round(1 / gpu) * mem.gpu > m.gpu_bytes:
        k = next((k for k in (10, 8, 5, 4, 2, 1) if k * mem.gpu <= m.gpu_bytes and k < round(1 / gpu)), 0)
        return (f"{round(1 / gpu)} x {gib(mem.gpu)} GPU memory > the {m.card}'s {gib(m.gpu_bytes)}"
                + (f"; fix: resources.gpu: {1 / k:g} ({k} packs per card)" if k else ""))
    return None


def _largest(packs: Sequence[Pack], card: float = 0.0) -> list[Pack]:
    """Per shape (agent/variants, members), the pack of the largest task and of the largest whose replay fits card."""
    rows: dict[tuple, Pack] = {}
    for p in sorted(packs, key=lambda p: -sum(TASK_DIMS[p.id.task])):  # the largest task first
        on_card = replay_bytes(len(p.trials), replay_capacity(p.trials[0].run.train), *TASK_DIMS[p.id.task]) <= card
        rows.setdefault((p.id.agent, p.id.variant, len(p.trials), on_card), p)
    return list(rows.values())


def size_packs(spec: SweepSpec, whole: Sequence[Pack], m: Machine, fixed: bool) -> tuple[int, list[Pack], str]:
    """``(size, packs, how)`` on ``m``; size 0 with ``how`` the reason and the fix when no pack can be placed or no
    size fits. ``whole``: the packs at a size no group exceeds (or the recorded ones, with ``fixed``)."""
    if problem := placement_problem(spec, m):
        return 0, [], problem

    def misfit(packs: Sequence[Pack]) -> str | None:  # the first shape that does not fit m
        card = GPU_REPLAY_SHARE * spec.resources.gpu * m.gpu_bytes  # a replay on the card may make a pack the largest
        return next((f"{p.id.agent}/{p.id.variant} S={len(p.trials)}: {why}" for p in _largest(packs, card)
                     for why in [fit_problem(spec, p, m)] if why), None)

    if fixed or spec.pack.seeds != "auto":
        size = max(len(p.trials) for p in whole) if fixed else spec.pack.seeds
        packs = list(whole) if fixed else split(whole, size)
        why = misfit(packs)
        if why is None:
            return size, packs, "registered" if fixed else "pack.seeds"
        fits = next((s for s in range(size - 1, 0, -1) if misfit(split(whole, s)) is None), 0)
        keep = fixed or any(t.shared_indices for t in spec.train_specs())  # the size sets the replay coupling
        fix = ("another cluster (this pack size is registered)" if keep else
               f"pack.seeds: {fits} (or auto)" if fits else "a machine with more memory")
        return 0, [], why if "fix:" in why else f"{why}; fix: {fix}"
    if not spec.resources.gpu:  # measured: S=3 ran 1.4-1.5x the seed-decisions per CPU s at width 64, not at 256
        return 1, split(whole, 1), "auto: the CPU table measures packs of one only"
    slots, top = m.nodes * per_node(spec, m), max(len(p.trials) for p in whole)
    for size in sorted({-(-top // k) for k in range(1, top + 1)}, reverse=True):  # balanced: 30, 15, 10, 8, ...
        packs = split(whole, size)
        why = misfit(packs)
        if why is None and (len(packs) >= slots or size == 1):
            return size, packs, "auto"
    return 0, [], why if "fix:" in why else f"{why}; fix: a machine with more memory"  # why: of packs of one


def price(spec: SweepSpec, packs: Sequence[Pack], m: Machine, tables: Tables) -> tuple[list[float], set[str]] | str:
    """Every pack's wall seconds on ``m`` and the rates' notes; a str (no estimate, why) where a rate is missing."""
    per_gpu = round(1 / spec.resources.gpu) if spec.resources.gpu else 0
    table, peaks = (tables.gpu if per_gpu else tables.cpu), (tables.prices.cards if tables.prices else {})
    seconds, notes = [], set()
    for p in packs:
        rate = pack_rate(p.trials[0].run, len(p.trials), per_gpu, m, table, peaks)
        if not isinstance(rate, Rate):
            return rate
        notes |= rate.notes
        seconds.append(pack_seconds(p, rate, per_gpu, spec.pack.env_workers))
    return seconds, notes


def order_packs(spec: SweepSpec, packs: Sequence[Pack], table: Throughput | None) -> list[Pack]:
    """``packs`` in the order they go to Tune: longest first on the GPU table's card (the longest packs must not
    start last and stretch the tail); CPU sweeps, and packs without a rate, in grid order."""
    if not spec.resources.gpu or table is None:
        return list(packs)
    priced = price(spec, packs, Machine("measured", "measured", table.card, 80 * 2**30, 2**40, 1024, 1, 1),
                   Tables(table, None, None))
    if isinstance(priced, str):
        return list(packs)
    return [p for _, p in sorted(zip(priced[0], packs), key=lambda sp: -sp[0])]  # ties in their given order


def machine_lines(spec: SweepSpec, whole: Sequence[Pack], m: Machine, tables: Tables, fixed: bool,
                  workers: int | None, price_per_hour: float | None) -> list[str]:
    """The plan's block for ``m``: a head line, then the packs, hours and money, or why there are none."""
    here, gpu = m.name == "this machine", spec.resources.gpu
    m = m if workers is None or here else replace(m, nodes=workers)
    where = m.name if m.name == m.node else f"{m.name}: {m.nodes} x {m.node}"
    head = (f"{where} ({f'{m.card}, {gib(m.gpu_bytes)}' if m.card else 'no GPU'}; {m.cpus} CPUs, "
            f"{gib(m.host_bytes)} for packs)")
    size, packs, how = size_packs(spec, whole, m, fixed)
    if not size:
        return [head, f"  not runnable as shipped: {how}"]
    n, unit = per_node(spec, m), "GPU" if gpu else "CPU"
    big = max(_largest(packs), key=lambda p: pack_memory([t.run for t in p.trials], 0, 0, 0).host)
    mem = pack_memory([t.run for t in big.trials], min(spec.pack.env_workers, size), gpu, m.gpu_bytes)
    out = [head, f"  packs of {size} ({how}): {len(packs):,} packs, {n} per node; largest {big.id.agent}/"
                 f"{big.id.variant} ({big.id.task}): host {gib(mem.host)}"
                 + (f", GPU {gib(mem.gpu)}, replay on the {mem.replay_on}" if gpu else "")]
    priced = price(spec, packs, m, tables)
    if isinstance(priced, str):
        return out + [f"  {unit}-hours and wall clock: no estimate: {priced}"]
    seconds, notes = priced
    s, share = schedule(seconds, m.nodes, n), (gpu or spec.trial_resources()["cpu"]) * n
    start = 0.0 if here else NODE_START_S
    wall_h = (start + s.makespan_s) / 3600
    out.append(f"  {unit}-hours {s.node_hours * share:,.{2 if s.node_hours < 10 else 0}f} with the tail "
               f"({s.busy_hours * share:,.{2 if s.busy_hours < 10 else 0}f} in packs); wall clock "
               + (f"{wall_h:,.1f} h" if wall_h >= 1 else f"{wall_h * 60:.{1 if wall_h < 1 / 6 else 0}f} min")
               + (f" (incl. a {start / 60:.0f}-min node start)" if start else "")
               + _money(m, s.node_hours, wall_h, price_per_hour))
    if m.spot and price_per_hour is None:
        t = big.trials[0].run.train
        lost = max(seconds) * t.eval_every_decisions / t.decisions / 3600
        out.append(f"  spot: an interruption loses up to {lost:,.1f} h of a pack's work (a checkpoint every "
                   f"{t.eval_every:,} env steps) and a node start")
    return out + ([f"  rates: {'; '.join(sorted(notes))}"] if notes else [])


def _money(m: Machine, node_hours: float, wall_h: float, price_per_hour: float | None) -> str:
    fixed = m.fixed_per_hour * wall_h
    usd = lambda x: f"${x:,.{2 if x < 10 else 0}f}"  # noqa: E731 - cents under $10: a small bill is not "$0"
    if price_per_hour is not None:
        return f"; {usd(node_hours * price_per_hour + fixed)} at --price-per-hour {price_per_hour:g}"
    if m.on_demand is None:
        return ""
    extra = f" (incl. {usd(fixed)} {m.fixed})" if fixed >= 0.005 else ""
    return f"; {usd(node_hours * m.on_demand + fixed)} on demand, {usd(node_hours * m.spot + fixed)} spot{extra}"


def plan_lines(spec: SweepSpec, machines: Sequence[Machine], tables: Tables, recorded: Mapping | None,
               workers: int | None = None, price_per_hour: float | None = None) -> list[str]:
    """The plan's lines: a block per machine, where the rates and prices come from, and the legend."""
    whole = form_packs(spec, recorded, size=None if recorded else 10**6)
    out = [line for m in machines
           for line in machine_lines(spec, whole, m, tables, bool(recorded), workers, price_per_hour)]
    t = tables.gpu if spec.resources.gpu else tables.cpu
    if t is not None:
        out.append(f"rates: {t.card} ({t.device}{f', {t.cpus} CPUs' if t.cpus else ''}), measured {t.date[:10]}; "
                   f"env stepping from benchmarks/env_costs.json")
    if (p := tables.prices) is not None:  # written down once, never fetched: the reader checks them
        out.append(f"prices: list prices as of {p.date} from cluster/prices.yaml ({'; '.join(p.sources.values())}), "
                   f"not checked since: check them before you rely on them; --price-per-hour overrides them")
    return out + [LEGEND]
