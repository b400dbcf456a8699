"""The dry run's plan (``--dry-run``): one line per pack shape (packs, members, hours per pack, memory per pack and
the node it needs), then the bill on each shipped cluster's card and on the measured one (GPU-hours with the
scheduling tail, the packs' own hours, the wall clock at the worker count), and where each number comes from
(:mod:`qed_ray.service.bill`, :mod:`qed_ray.service.memory`). The order packs go to Tune is :func:`order_packs`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from qed_ray.service.bill import CLUSTERS, STARTUP_S, PackRate, longest_first, pack_rate, pack_seconds, schedule
from qed_ray.service.memory import NODE_TYPES, NodeType, fit_problem, gib, pack_memory, packs_per_node
from qed_ray.service.packing import Pack
from qed_ray.service.throughput import Throughput
from qed_ray.spec import SweepSpec
from qed_ray.tasks import TASK_DIMS


@dataclass(frozen=True)
class Priced:
    """Each pack's rate (None: not priced) and expected wall seconds on one node type."""

    rates: tuple[PackRate | None, ...]
    seconds: tuple[float, ...]


def price(spec: SweepSpec, packs: Sequence[Pack], table: Throughput | None, node: NodeType | None) -> Priced:
    """Every pack's rate and wall seconds on ``node`` (None: the table's card); CPU packs by env stepping."""
    gpu = spec.resources.gpu
    per_gpu = round(1 / gpu) if gpu else 1
    rates = tuple(pack_rate(table, p.trials[0].run, len(p.trials), per_gpu, node) if gpu and table else None
                  for p in packs)
    return Priced(rates, tuple(pack_seconds(p, r, per_gpu, spec.pack.env_workers) for p, r in zip(packs, rates)))


def order_packs(spec: SweepSpec, packs: Sequence[Pack], table: Throughput | None) -> list[Pack]:
    """``packs`` in the order they go to Tune: longest expected wall time first (on the measured card), so that
    the longest packs do not start last and stretch the sweep's tail. CPU sweeps, and GPU ones without a table,
    keep their grid order (an estimate without the updates' cost would not rank them)."""
    if not spec.resources.gpu or table is None:
        return list(packs)
    return longest_first(packs, price(spec, packs, table, None).seconds)


def _shape(pack: Pack) -> str:
    return f"{pack.id.agent}/{pack.id.variant}"


def shape_rows(packs: Sequence[Pack]) -> dict[tuple[str, int], list[int]]:
    """The packs' indices per shape (``agent/variants``, members); the first index is the pack of the largest
    task (the one whose memory a row shows)."""
    rows: dict[tuple[str, int], list[int]] = {}
    for i, p in enumerate(packs):
        rows.setdefault((_shape(p), len(p.trials)), []).append(i)
    size = {i: sum(TASK_DIMS[packs[i].trials[0].run.task]) for i in range(len(packs))}
    return {k: sorted(v, key=lambda i: -size[i]) for k, v in rows.items()}


def shape_lines(spec: SweepSpec, packs: Sequence[Pack], priced: Priced, node: NodeType | None) -> list[str]:
    """One line per pack shape (agent, variants, members), longest first: packs, hours per pack, memory per pack
    (its largest task) and the node it needs."""
    res, gpu = spec.trial_resources(), spec.resources.gpu
    out = []
    for (shape, size), idx in sorted(shape_rows(packs).items(), key=lambda kv: -max(priced.seconds[i] for i in kv[1])):
        hours = sorted(priced.seconds[i] / 3600 for i in idx)
        runs = [t.run for t in packs[idx[0]].trials]
        workers = min(spec.pack.env_workers, size)
        mem = pack_memory(runs, workers, gpu, node)
        span = _span(hours[0], hours[-1])
        where = f"GPU {gib(mem.gpu)}, replay on the {mem.replay_on}" if gpu else f"replay on the {mem.replay_on}"
        fits = [n.name for n in NODE_TYPES.values()
                if fit_problem(pack_memory(runs, workers, gpu, n), n, res["cpu"], gpu) is None] if gpu else []
        out.append(f"  {shape} S={size}: {len(idx)} pack{'s' if len(idx) > 1 else ''}, {span} each; memory per pack "
                   f"({packs[idx[0]].id.task}): host {gib(mem.host)}, {where}"
                   + (f"; fits {', '.join(fits) or 'none of ' + ', '.join(NODE_TYPES)}" if gpu else ""))
    return out


def _span(lo: float, hi: float) -> str:
    """``5.1 h``, ``2.0-3.1 h``, ``12 min``."""
    one = (lambda h: f"{h * 60:.0f}") if hi < 1 else (lambda h: f"{h:.1f}")
    return (one(lo) if one(lo) == one(hi) else f"{one(lo)}-{one(hi)}") + (" min" if hi < 1 else " h")


def misfits(spec: SweepSpec, packs: Sequence[Pack], node: NodeType) -> list[str]:
    """``shape (why)`` for each pack shape whose largest pack does not fit ``node``."""
    res, gpu, out = spec.trial_resources(), spec.resources.gpu, []
    for (shape, size), idx in shape_rows(packs).items():
        workers = min(spec.pack.env_workers, size)
        why = fit_problem(pack_memory([t.run for t in packs[idx[0]].trials], workers, gpu, node), node, res["cpu"],
                          gpu)
        if why:
            out.append(f"{shape} S={size} ({why})")
    return out


def bill_line(spec: SweepSpec, priced: Priced, node: NodeType, workers: int, source: str) -> str:
    """GPU-hours with the tail, the packs' own GPU-hours and the wall clock on ``workers`` nodes of ``node``."""
    per_node = packs_per_node(node, spec.trial_resources()["cpu"], spec.resources.gpu)
    if per_node < 1:
        return f"GPU-hours on the {node.card}: none ({node.name} cannot hold one pack)"
    s = schedule(priced.seconds, workers, per_node)
    return (f"GPU-hours on the {node.card} ({source}: {workers} x {node.name}, {per_node} packs each): "
            f"{s.node_hours * node.gpus:,.0f} with the tail ({s.busy_hours * node.gpus:,.0f} in packs); wall clock "
            f"{(STARTUP_S + s.makespan_s) / 3600:,.1f} h ({STARTUP_S / 60:.0f} min start)")


def plan_lines(spec: SweepSpec, packs: Sequence[Pack], table: Throughput | None, workers: int | None) -> list[str]:
    """The plan's lines (see the module notes); ``workers`` overrides the clusters' ``max_workers``."""
    if not spec.resources.gpu:
        priced = price(spec, packs, None, None)
        per = max(1, int(16 // spec.trial_resources()["cpu"]))
        s = schedule(priced.seconds, workers or 1, per)
        return ["packs by shape, longest first:", *shape_lines(spec, packs, priced, None),
                f"CPU-hours: at least {sum(priced.seconds) / 3600 * spec.trial_resources()['cpu']:,.2f} (env stepping "
                f"only, from benchmarks/env_costs.json: no CPU table of the updates); wall clock at least "
                f"{_span(s.makespan_s / 3600, s.makespan_s / 3600)} on {workers or 1} node(s) of 16 CPUs"]
    if table is None:
        return ["GPU-hours: no GPU measurement yet (qed_ray/data/throughput.json has no GPU table)"]
    aws = NODE_TYPES[CLUSTERS["aws"][1]]
    priced = price(spec, packs, table, aws)
    missing = sorted({_shape(p) + f" S={len(p.trials)}" for p, r in zip(packs, priced.rates) if r is None})
    if missing:
        return [f"GPU-hours: unknown: the throughput table ({table.card}) has no cell to scale from for "
                f"{', '.join(missing)}"]
    out = [f"packs by shape, longest first (hours per pack on the {aws.card}):", *shape_lines(spec, packs, priced, aws)]
    notes: set[str] = set()
    for name, (config, node_name, max_workers) in CLUSTERS.items():
        node = NODE_TYPES[node_name]
        p = priced if node is aws else price(spec, packs, table, node)
        notes |= {n for r in p.rates for n in r.notes}
        out.append(bill_line(spec, p, node, workers or max_workers, "--workers" if workers else config))
        bad = misfits(spec, packs, node)
        if bad:
            out.append(f"  does not fit {node.name}: {'; '.join(bad)}: pack fewer seeds (pack.seeds) or use another "
                       f"cluster")
    measured = next((n for n in NODE_TYPES.values() if n.card == table.card), None)
    if measured is not None:
        p = price(spec, packs, table, None)
        notes |= {n for r in p.rates for n in r.notes}
        out.append(bill_line(spec, p, measured, workers or CLUSTERS["aws"][2], "the measured card"))
    out.append(f"  rates: throughput table of {table.date[:10]} ({table.card}); "
               + ("; ".join(sorted(notes)) if notes else "every cell measured")
               + "; env stepping and evaluations from benchmarks/env_costs.json; checkpoints and the gather step "
                 "not counted")
    return out
