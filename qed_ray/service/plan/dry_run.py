"""``python -m qed_ray.sweep SPEC --dry-run [--list] [--workers N] [--card C] [--price-per-hour P]``: what a run
would do (per trial from the folder on disk: ``new``, ``start``, ``resume from env step N``, ``done``,
``diverged``) and cost on this machine and every shipped cluster (:mod:`qed_ray.service.plan.dry_plan`); starts
nothing. What a start from here would refuse is refused the same way (exit 2) after the plan, a pack this machine
cannot place included where a start would run on it (:func:`~qed_ray.service.plan.machines.check_machine`); an
unreachable tracking server is warned of.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

from qed_ray.spec import console
from qed_ray.records.layout import SweepDir
from qed_ray.spec.replay_memory import replay_line
from qed_ray.service.plan.dry_plan import Tables, order_packs, plan_lines, size_packs
from qed_ray.service.plan.machines import Machine, check_machine, clusters, embedded, load_prices, placement_problem, \
    this_machine
from qed_ray.service.packing import Pack, form_packs
from qed_ray.service.sweep_state import check_folder, plan, resolve_paths
from qed_ray.records.throughput import CPU_PATH, DEFAULT_PATH, load_table, load_throughput
from qed_ray.service.mlflow.tracking_uri import unreachable, uri_field
from qed_ray.spec.sweep import SpecError, SweepSpec, Trial


CLUSTER_ENV = "QED_CLUSTER"  # the shipped cluster a joined driver sizes auto packs for (default: all of them)


def tune_order(spec: SweepSpec, packs: list[Pack]) -> list[Pack]:
    """The packs in the order the driver hands them to Tune (:func:`~qed_ray.service.plan.dry_plan.order_packs`)."""
    return order_packs(spec, packs, load_throughput())


def sized_spec(spec: SweepSpec, recorded_seeds: int | None, here: Machine | None = None) -> SweepSpec:
    """``spec`` with ``pack.seeds: auto`` resolved: the size a started sweep registered, else the plan's for this
    machine (embedded), for the cluster :data:`CLUSTER_ENV` names, or the smallest over the shipped clusters."""
    if spec.pack.seeds != "auto":
        return spec
    if recorded_seeds:
        return spec.sized(recorded_seeds)
    prices, named = load_prices(), os.environ.get(CLUSTER_ENV)
    machines = [here or this_machine()] if embedded() or prices is None else \
        [m for m in clusters(prices) if named in (None, m.name)]
    if not machines:
        raise SpecError(f"{CLUSTER_ENV}: {named!r} is not a cluster of cluster/prices.yaml "
                        f"({', '.join(prices.clusters)})")
    whole = form_packs(spec, size=10**6)
    sizes = [s for m in machines if not placement_problem(spec, m)
             for s, _, _ in [size_packs(spec, whole, m, False)] if s]
    return spec.sized(min(sizes) if sizes else 1)


def dry_run(spec: SweepSpec, throughput_path: str | Path = DEFAULT_PATH, listing: bool = False,
            workers: int | None = None, fresh: bool = False, force: bool = False, card: str | None = None,
            price_per_hour: float | None = None, here: Machine | None = None) -> int:
    """Prints the plan (the module notes; ``workers``: nodes per cluster; ``card``: KubeRay's GPU; ``here``: this
    machine, for tests); raises SpecError with the refusals a start would give."""
    layout, uri, exp = resolve_paths(spec)
    columns = console.width()

    def show(line: str) -> None:
        print(console.fit(line, columns))

    if spec.search is not None:  # the whole trial budget, priced pack by pack as any sweep's
        from qed_ray.service.search import dry_spec

        spec, line = dry_spec(spec, layout, fresh)
        show(line)
    existing = check_folder(layout, spec, fresh, force)
    recorded = None if fresh or existing is None else existing.packs
    run_spec = sized_spec(spec, None if fresh or existing is None else existing.pack_seeds, here)
    p = plan(None, run_spec) if fresh else plan(existing, run_spec, layout)
    if fresh and existing is not None:
        show(f"--fresh: {layout.root} would be moved aside first (nothing is deleted); the plan below is of a new "
             f"sweep")
    trials = spec.trials()
    n, size = len(p.packs), run_spec.pack.seeds
    auto = " (pack.seeds auto: sized per machine below)" if spec.pack.seeds == "auto" else ""
    show(f"sweep {spec.name}: {len(trials)} trials in {n} pack{'s' if n > 1 else ''} (Tune trial{'s' if n > 1 else ''}) "
         f"of up to {size} seed{'s' if size > 1 else ''}{auto} -> {layout.root}  (MLflow {uri}, experiment {exp})")
    if p.state.claim is not None:
        rec = p.state.claim
        show(f"pre-registration: {rec.file} (claim block sha256 {rec.sha256[:12]}; frozen in sweep.json at the "
             f"first start, a changed block is refused)")
    what = {t.name: _what_next(layout, t, p.new, pack) for pack in p.packs for t in pack.trials}
    counts = Counter(w if not w.startswith("resume") else "resume" for w in what.values())
    show("trials: " + ", ".join(f"{n:,} {w}" for w, n in counts.most_common())
         + ("" if listing else " (each trial: --list)"))
    for pack in order_packs(run_spec, p.packs, load_throughput(throughput_path)) if listing else ():
        show(f"  pack {pack.name}  ({len(pack.trials)} seed{'s' if len(pack.trials) > 1 else ''})")
        for t in pack.trials:
            r = t.run
            show(f"    {t.name:48s} env_steps={r.train.env_steps:,} hidden={r.agent.hidden} "
                 f"batch={r.agent.batch_size}  [{what[t.name]}]")
    res = run_spec.trial_resources()
    show(f"per pack: {res['cpu']:g} CPU ({spec.resources.cpu:g} + {run_spec.pack.env_workers} env workers), "
         f"{res['gpu']:g} GPU; all {n} packs at once: {res['cpu'] * n:g} CPU, {res['gpu'] * n:g} GPU; total env "
         f"steps {sum(t.run.train.env_steps for t in trials):,}")
    prices = load_prices()
    here = here or this_machine()
    machines = [here] + (clusters(prices, card=card) if prices else [])
    tables = Tables(load_throughput(throughput_path), load_table(CPU_PATH), prices)
    for line in plan_lines(run_spec if recorded else spec, machines, tables, recorded, workers, price_per_hour):
        show(line)
    if spec.adaptive is not None:
        from qed_ray.service.looks import price_lines

        for line in price_lines(run_spec, p.packs, machines[0], tables):
            show(line)
    show(replay_line(run_spec.replay_needs()))
    problem = unreachable(uri)
    if problem:  # a cluster-only address is normal where a dry run is made: a start refuses it, this warns
        print(f"warning: {uri_field()}: {problem}; a start from here would be refused (fine if the address is "
              f"reachable only from the cluster's head)", file=sys.stderr)
    check_machine(spec, here)
    if p.problems:
        raise SpecError("\n".join(p.problems))
    return 0


def _what_next(layout: SweepDir, trial: Trial, new: list[str], pack: Pack) -> str:
    if trial.name in new:
        return "new"
    state = layout.trial_state(trial.name)
    if state != "pending":
        return state
    steps = layout.pack_checkpoint_steps(pack.id)
    return f"resume from env step {max(steps):,}" if steps else "start"
