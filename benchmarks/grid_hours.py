"""GPU-hours of a sweep grid (default ``sweeps/dmc18.yaml``) from the measured throughput table and env costs.

Inputs: the throughput table (``qed_ray/data/throughput.json``, written by the GPU run: seed-decisions/s of packs
without envs, per agent, temperature kind, seeds per pack S, packs per GPU Q and update mode), the CPU cost of
each task's env per decision (``benchmarks/env_costs.json``, ``benchmarks/env_costs.py``) and the sweep file
(trials per agent and temperature kind, decisions per trial, evaluation share).

Model of one pack's decision (lock-step loop: act, env step, update), per task::

    t = max(S Q / r_Q,  S / r_1 + S c (1 + e) / W)

r_Q: the GPU's measured seed-decisions/s with Q packs sharing it (when Q > 1 was measured only for SAC-LN QED
S=10, other cells are scaled by that measured sharing efficiency, and the output says so); r_1: one pack alone;
c: the task's env seconds per decision; e: evaluation decisions per training decision
(``eval_episodes x 500 / (eval_every / frame_skip)``); W: env worker processes per pack. The GPU then does
Q S / t seed-decisions per second. A layout must fit the node: Q (1 + W) vCPUs per GPU (a pack's main process
plus its workers) and Q x (peak GPU memory of the pack + its replay at 1M transitions per seed, largest task) in
the GPU's memory.

"As is" is today's single-seed path (S = 1), ten trials per GPU (``gpu: 0.1``), envs in each trial's process:
t = 1 / r_single + c (1 + e), and the ten processes are assumed not to slow each other on the GPU (a lower
bound on the as-is hours).

Run: ``python benchmarks/grid_hours.py [--throughput FILE] [--vcpus-per-gpu 16] [--gpu-gib 80]``. Without a GPU
table it says "no GPU measurement yet" and, given ``--throughput`` of a CPU table, prints CPU-measured figures
labelled as such. Needs pyyaml and numpy only (no torch).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from qed_ray.tasks import TASK_SETS  # noqa: E402
from qed_ray.service.throughput import DEFAULT_PATH, Throughput, load_throughput, parse_throughput  # noqa: E402

CONTROL_STEPS_PER_EPISODE = 1000
REPLAY_TRANSITIONS = 1_000_000  # per seed: the whole run (train.replay_capacity: none)


@dataclass(frozen=True)
class Layout:
    """Seeds per pack S, packs per GPU Q, env workers per pack W, update mode."""

    seeds: int
    packs: int
    workers: int
    mode: str = "graph"


def grid(sweep: dict) -> dict:
    """Trials per (agent, temperature kind), tasks, decisions per trial and evaluation decisions per training one."""
    tasks = TASK_SETS.get(sweep["tasks"], sweep["tasks"]) if isinstance(sweep["tasks"], str) else sweep["tasks"]
    trials: dict[tuple[str, str], int] = {}
    for agent in sweep["agents"]:
        for temp in agent["temperatures"]:
            variants = 1
            for v in temp.values():
                variants *= len(v) if isinstance(v, list) else 1
            key = (agent["name"], temp["kind"])
            trials[key] = trials.get(key, 0) + variants * sweep["seeds"] * len(tasks)
    t = sweep["train"]
    decisions = t["env_steps"] // t["frame_skip"]
    evals = t["eval_episodes"] * (CONTROL_STEPS_PER_EPISODE // t["frame_skip"]) / (t["eval_every"] / t["frame_skip"])
    return {"trials": trials, "tasks": list(tasks), "seeds": sweep["seeds"], "decisions": decisions,
            "eval_share": evals}


def gpu_rate(table: Throughput, agent: str, kind: str, layout: Layout) -> tuple[float, float, bool] | None:
    """(r_Q, r_1, scaled): the GPU's seed-decisions/s with Q packs and one pack alone; scaled when r_Q comes from
    the sharing efficiency of ``throughput.SHARE_CELL``. None if the S cell was not measured."""
    r1 = table.decisions_per_s(agent, kind, layout.seeds, 1, layout.mode)
    shared = table.shared_rate(agent, kind, layout.seeds, layout.packs, layout.mode)
    if r1 is None or shared is None:
        return None
    return shared[0], r1, shared[1]


def hours(table: Throughput, costs: dict, g: dict, layout: Layout) -> dict | None:
    """GPU-hours of the grid under ``layout``: total, per (agent, kind), and whether any rate was scaled; None if
    a needed cell was not measured."""
    per, scaled = {}, False
    for (agent, kind), n in g["trials"].items():
        rate = gpu_rate(table, agent, kind, layout)
        if rate is None:
            return None
        rq, r1, sc = rate
        scaled |= sc
        s, q, w = layout.seeds, layout.packs, max(layout.workers, 1)
        total = 0.0
        for task in g["tasks"]:
            c = costs["tasks"][task]["ms_per_decision"] / 1000
            t = max(s * q / rq, s / r1 + s * c * (1 + g["eval_share"]) / w)
            total += (n / len(g["tasks"])) * g["decisions"] / (q * s / t) / 3600
        per[f"{agent}/{kind}"] = total
    return {"total": sum(per.values()), "per": per, "scaled": scaled}


def as_is_hours(table: Throughput, costs: dict, g: dict, per_gpu: int = 10) -> dict | None:
    """GPU-hours of the single-seed path, ``per_gpu`` trials per GPU (see the module docstring)."""
    per = {}
    for (agent, kind), n in g["trials"].items():
        r = table.decisions_per_s(agent, kind, 1, 1, "single")
        if r is None:
            return None
        total = 0.0
        for task in g["tasks"]:
            t = 1 / r + costs["tasks"][task]["ms_per_decision"] / 1000 * (1 + g["eval_share"])
            total += (n / len(g["tasks"])) * g["decisions"] * t / per_gpu / 3600
        per[f"{agent}/{kind}"] = total
    return {"total": sum(per.values()), "per": per, "scaled": False}


def pack_memory_mib(table: Throughput, costs: dict, layout: Layout) -> float:
    """Peak GPU memory of one pack (largest measured over agents/kinds at S) plus its replay on the largest task."""
    peaks = [e["peak_mib"] for e in table.entries if e["seeds"] == layout.seeds and e["mode"] == layout.mode]
    width = max(2 * t["obs_dim"] + t.get("action_dim", 12) + 2 for t in costs["tasks"].values())
    return max(peaks, default=0.0) + layout.seeds * REPLAY_TRANSITIONS * width * 4 / 2**20


def pack_mode(table: Throughput) -> str:
    """The packs' update mode of the table: ``graph`` when measured (CUDA), else ``off`` (a CPU table)."""
    return "graph" if any(e["mode"] == "graph" for e in table.entries) else "off"


def best(table: Throughput, costs: dict, g: dict, vcpus: int, gpu_mib: float) -> tuple[Layout, dict] | None:
    """The fitting layout with the fewest GPU-hours over measured S (at most the sweep's seeds), Q in {1, 2, 3} and
    W in {1, 2, 3, 4}."""
    mode = pack_mode(table)
    # A pack holds seeds of one configuration: S up to the sweep's seeds per configuration.
    sizes = sorted({e["seeds"] for e in table.entries if e["mode"] == mode and e["seeds"] <= g["seeds"]})
    found = None
    for s, q, w in itertools.product(sizes, (1, 2, 3), (1, 2, 3, 4)):
        layout = Layout(s, q, w, mode)
        if q * (1 + w) > vcpus or q * pack_memory_mib(table, costs, layout) > gpu_mib:
            continue
        h = hours(table, costs, g, layout)
        if h is not None and (found is None or h["total"] < found[1]["total"]):
            found = (layout, h)
    return found


def report(table: Throughput, costs: dict, g: dict, vcpus: int, gpu_mib: float, label: str,
           unit: str = "GPU-hours") -> list[str]:
    """The printed lines (``unit``: what the hours are hours of)."""
    n = sum(g["trials"].values())
    lines = [f"{label}: {table.card} ({table.device}, {table.date}); {n} trials x {g['decisions']:,} decisions, "
             f"evaluation adds {g['eval_share']:.2f} env decisions per training decision; env costs measured on "
             f"{costs['machine']} (load {costs['load_avg_1m']:.1f})"]
    base = as_is_hours(table, costs, g)
    lines.append("as is (single-seed, 10 trials per GPU): " +
                 (f"{base['total']:,.0f} {unit}" if base else "not measured (no 'single' cells)"))
    default = hours(table, costs, g, Layout(10, 2, 3, pack_mode(table)))
    lines.append("default layout S=10, 2 packs per GPU, 3 env workers per pack: " +
                 (f"{default['total']:,.0f} {unit}" + (" (sharing scaled from sac_ln qed S=10)"
                                                          if default["scaled"] else "")
                  if default else "a needed cell was not measured"))
    found = best(table, costs, g, vcpus, gpu_mib)
    if found is None:
        lines.append(f"best layout: none measured fits {vcpus} vCPUs and {gpu_mib / 1024:.0f} GiB per GPU")
        return lines
    layout, h = found
    mem = pack_memory_mib(table, costs, layout)
    lines.append(f"best layout: S={layout.seeds} seeds per pack, {layout.packs} packs per GPU, {layout.workers} env "
                 f"workers per pack -> {h['total']:,.0f} {unit}"
                 + (" (sharing scaled from sac_ln qed S=10)" if h["scaled"] else ""))
    lines.append(f"  per pack: {1 + layout.workers} vCPUs, GPU share {1 / layout.packs:.2f}, GPU memory "
                 f"{mem / 1024:.1f} GiB (peak + replay of 1M transitions per seed on the largest task)")
    lines += [f"  {k}: {v:,.0f} {unit}" for k, v in h["per"].items()]
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--throughput", type=Path, default=DEFAULT_PATH)
    p.add_argument("--env-costs", type=Path, default=Path(__file__).with_name("env_costs.json"))
    p.add_argument("--sweep", type=Path, default=ROOT / "sweeps" / "dmc18.yaml")
    p.add_argument("--vcpus-per-gpu", type=int, default=16)
    p.add_argument("--gpu-gib", type=float, default=80.0)
    args = p.parse_args(argv)
    g = grid(yaml.safe_load(args.sweep.read_text()))
    costs = json.loads(args.env_costs.read_text())
    table = load_throughput(args.throughput)
    unit = "GPU-hours"
    if table is not None:
        label = "GPU-hours"
    else:
        print(f"no GPU measurement yet in {args.throughput} (the GPU run writes it: benchmarks/gpu_check.sh); the "
              f"layout is to be settled by that run")
        if not args.throughput.is_file():
            return
        table = parse_throughput(json.loads(args.throughput.read_text()))
        if not table.entries:
            return
        label, unit = "CPU-measured device-hours (NOT GPU-hours: the table was measured on a CPU)", "CPU-device-hours"
    print("\n".join(report(table, costs, g, args.vcpus_per_gpu, args.gpu_gib * 1024, label, unit)))


if __name__ == "__main__":
    main()
