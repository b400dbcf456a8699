"""The plan of ``--dry-run``, one block per machine (this one, then every shipped cluster): the pack size (``auto``:
the largest that fits a node with its headroom and keeps every node busy), packs per node, the largest pack's
memory, the device-hours with the tail, the wall clock and the money; or "not runnable as shipped" with the reason
and the fix and no wall clock; "no estimate" with the reason where a rate was never measured (never 0)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from qed_ray.spec.replay_memory import MAX_PACK_REPLAY_BYTES, show_bytes as gib
from qed_ray.service.plan.bill import NODE_START_S, Rate, longest_first, pack_rate, pack_seconds, schedule
from qed_ray.service.plan.machines import Machine, PriceTable, per_node, placement_problem
from qed_ray.service.plan.memory import HOST_USABLE, pack_memory
from qed_ray.service.packing import Pack, form_packs, split
from qed_ray.records.throughput import Throughput
from qed_ray.spec.sweep import SweepSpec
from qed_ray.spec.tasks import TASK_DIMS

LEGEND = ("legend: packs of S (auto): the largest pack that fits a node and keeps every node busy; with the tail: "
          "node-hours, each node held until its last pack ends; spot: that price, plus the work an interruption "
          "loses (since the last checkpoint)")


@dataclass(frozen=True)
class Tables:
    """The measured rates (GPU, CPU) and the prices with the cards' FP32 peaks (None: no ``cluster/``)."""

    gpu: Throughput | None
    cpu: Throughput | None
    prices: PriceTable | None


def fit_problem(spec: SweepSpec, pack: Pack, m: Machine) -> str | None:
    """Why ``pack`` does not fit a node of ``m`` next to the others there, or None."""
    runs, gpu, n = [t.run for t in pack.trials], spec.resources.gpu, per_node(spec, m)
    mem = pack_memory(runs, min(spec.pack.env_workers, len(runs)), gpu, m.gpu_bytes)
    if mem.replay > MAX_PACK_REPLAY_BYTES:
        return f"its replay {gib(mem.replay)} > the {gib(MAX_PACK_REPLAY_BYTES)} a pack may hold"
    if n * mem.host > HOST_USABLE * m.host_bytes:
        return f"{n} x {gib(mem.host)} host memory > {HOST_USABLE:.0%} of {m.node}'s {gib(m.host_bytes)}"
    if gpu and round(1 / gpu) * mem.gpu > m.gpu_bytes:
        k = next((k for k in (10, 8, 5, 4, 2, 1) if k * mem.gpu <= m.gpu_bytes and k < round(1 / gpu)), 0)
        return (f"{round(1 / gpu)} x {gib(mem.gpu)} GPU memory > the {m.card}'s {gib(m.gpu_bytes)}"
                + (f"; fix: resources.gpu: {1 / k:g} ({k} packs per card)" if k else ""))
    return None


def _largest(packs: Sequence[Pack]) -> list[Pack]:
    """The pack with the largest task of each shape (agent/variants, members): the ones whose fit decides."""
    rows: dict[tuple, Pack] = {}
    for p in packs:
        key = (p.id.agent, p.id.variant, len(p.trials))
        if key not in rows or sum(TASK_DIMS[p.id.task]) > sum(TASK_DIMS[rows[key].id.task]):
            rows[key] = p
    return list(rows.values())


def _misfit(spec: SweepSpec, packs: Sequence[Pack], m: Machine) -> str | None:  # the first shape that does not fit
    return next((f"{p.id.agent}/{p.id.variant} S={len(p.trials)}: {why}" for p in _largest(packs)
                 for why in [fit_problem(spec, p, m)] if why), None)


def size_packs(spec: SweepSpec, whole: Sequence[Pack], m: Machine, fixed: bool) -> tuple[int, list[Pack], str]:
    """``(size, packs, how)`` on ``m``; size 0 with ``how`` the reason and the fix when no size fits. ``whole``:
    the packs at a size no group exceeds (or the recorded ones, with ``fixed``)."""
    if fixed or spec.pack.seeds != "auto":
        size = max(len(p.trials) for p in whole) if fixed else spec.pack.seeds
        packs = list(whole) if fixed else split(whole, size)
        why = _misfit(spec, packs, m)
        if why is None:
            return size, packs, "registered" if fixed else "pack.seeds"
        fits = next((s for s in range(size - 1, 0, -1) if _misfit(spec, split(whole, s), m) is None), 0)
        keep = any(t.shared_indices for t in spec.train_specs()) or fixed
        fix = ("another cluster (this pack size is registered)" if keep else
               f"pack.seeds: {fits} (or auto)" if fits else "a machine with more memory")
        return 0, [], why if "fix:" in why else f"{why}; fix: {fix}"
    if not spec.resources.gpu:  # on CPUs a pack of S costs S packs of one on one core: more keep more cores busy
        return 1, split(whole, 1), "auto: packs of one on CPUs"
    slots, top = m.nodes * per_node(spec, m), max(len(p.trials) for p in whole)
    for size in sorted({-(-top // k) for k in range(1, top + 1)}, reverse=True):  # balanced: 30, 15, 10, 8, ...
        packs = split(whole, size)
        if _misfit(spec, packs, m) is None and (len(packs) >= slots or size == 1):
            return size, packs, "auto"
    why = _misfit(spec, split(whole, 1), m)
    return 0, [], why if "fix:" in why else f"{why}; fix: a machine with more memory"


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
    m = Machine("measured", "measured", table.card, 80 * 2**30, 2**40, 1024, 1, 1)
    priced = price(spec, packs, m, Tables(table, None, None))
    return list(packs) if isinstance(priced, str) else longest_first(packs, priced[0])


def machine_lines(spec: SweepSpec, whole: Sequence[Pack], m: Machine, tables: Tables, fixed: bool,
                  workers: int | None, price_per_hour: float | None) -> list[str]:
    """The plan's block for ``m`` (see the module notes)."""
    m = m if workers is None or m.name == "this machine" else Machine(**{**m.__dict__, "nodes": workers})
    what = f"{m.card}, {gib(m.gpu_bytes)}" if m.card else "no GPU"
    nodes = f"{m.name} ({what}" if m.name == m.node else f"{m.name}: {m.nodes} x {m.node} ({what}"
    head = f"{nodes}; {m.cpus} CPUs, {gib(m.host_bytes)} for packs)"
    problem = placement_problem(spec, m)
    size, packs, how = (0, [], problem) if problem else size_packs(spec, whole, m, fixed)
    if not size:
        return [head, f"  not runnable as shipped: {how}"]
    n, unit = per_node(spec, m), "GPU" if spec.resources.gpu else "CPU"
    big = max(_largest(packs), key=lambda p: pack_memory([t.run for t in p.trials], 0, 0, 0).host)
    mem = pack_memory([t.run for t in big.trials], min(spec.pack.env_workers, size), spec.resources.gpu, m.gpu_bytes)
    out = [head, f"  packs of {size} ({how}): {len(packs):,} packs, {n} per node; largest {big.id.agent}/"
                 f"{big.id.variant} ({big.id.task}): host {gib(mem.host)}"
                 + (f", GPU {gib(mem.gpu)}, replay on the {mem.replay_on}" if spec.resources.gpu else "")]
    priced = price(spec, packs, m, tables)
    if isinstance(priced, str):
        return out + [f"  {unit}-hours and wall clock: no estimate: {priced}"]
    seconds, notes = priced
    s = schedule(seconds, m.nodes, n)
    share = spec.resources.gpu * n if spec.resources.gpu else spec.trial_resources()["cpu"] * n
    start = NODE_START_S if m.name != "this machine" else 0.0
    wall_h = (start + s.makespan_s) / 3600
    out.append(f"  {unit}-hours {s.node_hours * share:,.{2 if s.node_hours < 10 else 0}f} with the tail "
               f"({s.busy_hours * share:,.{2 if s.busy_hours < 10 else 0}f} in packs); wall clock "
               + (f"{wall_h:,.1f} h" if wall_h >= 1 else f"{wall_h * 60:.0f} min")
               + (f" (incl. a {start / 60:.0f}-min node start)" if start else "") + _money(m, s.node_hours, wall_h,
                                                                                         price_per_hour))
    if m.spot and price_per_hour is None:
        t = big.trials[0].run.train
        lost = max(seconds) * t.eval_every_decisions / t.decisions / 3600
        out.append(f"  spot: an interruption loses up to {lost:,.1f} h of a pack's work (a checkpoint every "
                   f"{t.eval_every:,} env steps) and a node start")
    return out + ([f"  rates: {'; '.join(sorted(notes))}"] if notes else [])


def _money(m: Machine, node_hours: float, wall_h: float, price_per_hour: float | None) -> str:
    fixed = m.fixed_per_hour * wall_h
    if price_per_hour is not None:
        return f"; ${node_hours * price_per_hour + fixed:,.0f} at --price-per-hour {price_per_hour:g}"
    if m.on_demand is None:
        return ""
    extra = f" (incl. ${fixed:,.0f} {m.fixed})" if fixed >= 0.5 else ""
    return f"; ${node_hours * m.on_demand + fixed:,.0f} on demand, ${node_hours * m.spot + fixed:,.0f} spot{extra}"


def plan_lines(spec: SweepSpec, machines: Sequence[Machine], tables: Tables, recorded: Mapping | None,
               workers: int | None = None, price_per_hour: float | None = None) -> list[str]:
    """The plan's lines: a block per machine, where the rates and prices come from, and the legend."""
    fixed = bool(recorded)
    whole = form_packs(spec, recorded, size=None if fixed else 10**6)
    out = [line for m in machines for line in machine_lines(spec, whole, m, tables, fixed, workers, price_per_hour)]
    t = tables.cpu if not spec.resources.gpu else tables.gpu
    if t is not None:
        out.append(f"rates: {t.card} ({t.device}{f', {t.cpus} CPUs' if t.cpus else ''}), measured {t.date[:10]}; "
                   f"env stepping from benchmarks/env_costs.json")
    if tables.prices is not None:
        p = tables.prices
        out.append(f"prices: cluster/prices.yaml, as of {p.date}, source: "
                   + "; ".join(p.sources.values()) + " (--price-per-hour overrides)")
    return out + [LEGEND]
