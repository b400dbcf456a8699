"""``python -m qed_ray.sweep SPEC --dry-run [--list] [--workers N] [--card C] [--price-per-hour P]``: what a run
would do and cost, here and on every shipped cluster, and what a start from here would refuse; starts nothing."""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

from qed_ray.spec import console
from qed_ray.records.layout import SweepDir
from qed_ray.spec.replay_memory import replay_line
from qed_ray.service.plan.dry_plan import Tables, order_packs, plan_lines, size_packs
from qed_ray.service.plan.machines import Machine, check_machine, clusters, load_prices, this_machine
from qed_ray.service.packing import Pack, form_packs
from qed_ray.service.sweep_state import check_folder, plan, resolve_paths
from qed_ray.records.throughput import CPU_PATH, DEFAULT_PATH, load_table, load_throughput
from qed_ray.service.mlflow.tracking_uri import unreachable, uri_field
from qed_ray.service.ray_join import target
from qed_ray.spec.sweep import SpecError, SweepSpec, Trial

CLUSTER_ENV = "QED_CLUSTER"  # the shipped cluster a joined driver sizes auto packs for (default: all of them)


def sized_spec(spec: SweepSpec, recorded_seeds: int | None, here: Machine | None = None) -> SweepSpec:
    """``spec`` with ``pack.seeds: auto`` resolved: the size a started sweep registered, else the plan's for this
    machine (embedded), for the cluster :data:`CLUSTER_ENV` names, or the smallest over the shipped clusters."""
    if spec.pack.seeds != "auto":
        return spec
    if recorded_seeds:
        return spec.sized(recorded_seeds)
    prices, named = load_prices(), os.environ.get(CLUSTER_ENV)
    machines = [here or this_machine()] if target().address is None or prices is None else \
        [m for m in clusters(prices) if named in (None, m.name)]
    if not machines:
        raise SpecError(f"{CLUSTER_ENV}: {named!r} is not a cluster of cluster/prices.yaml "
                        f"({', '.join(prices.clusters)})")
    whole = form_packs(spec, size=10**6)
    return spec.sized(min(filter(None, (size_packs(spec, whole, m, False)[0] for m in machines)), default=1))


def dry_run(spec: SweepSpec, throughput_path: str | Path = DEFAULT_PATH, listing: bool = False,
            workers: int | None = None, fresh: bool = False, force: bool = False, card: str | None = None,
            price_per_hour: float | None = None, here: Machine | None = None) -> int:
    """Prints the plan (``workers``: nodes per cluster; ``card``: KubeRay's GPU; ``here``: this machine, for tests);
    raises SpecError with the refusals a start would give."""
    layout, uri, exp = resolve_paths(spec)
    columns = console.width()
    show = lambda line: print(console.fit(line, columns))  # noqa: E731
    if spec.search is not None:  # the whole trial budget, priced pack by pack as any sweep's
        from qed_ray.service.search import dry_spec

        spec, line = dry_spec(spec, layout, fresh)
        show(line)
    existing = check_folder(layout, spec, fresh, force)
    kept = None if fresh else existing  # a started sweep: its packs and their size hold
    recorded = kept and kept.packs
    run_spec = sized_spec(spec, kept and kept.pack_seeds, here)
    p = plan(kept, run_spec, None if fresh else layout)
    if fresh and existing is not None:
        show(f"--fresh: {layout.root} would be moved aside first (nothing is deleted); the plan below is of a new "
             f"sweep")
    trials, n, size = spec.trials(), len(p.packs), run_spec.pack.seeds
    auto = " (pack.seeds auto: sized per machine below)" if spec.pack.seeds == "auto" else ""
    s = "s" if n > 1 else ""
    show(f"sweep {spec.name}: {len(trials)} trials in {n} pack{s} (Tune trial{s}) of up to {size} seed"
         f"{'s' if size > 1 else ''}{auto} -> {layout.root}  (MLflow {uri}, experiment {exp})")
    if p.state.claim is not None:
        show(f"pre-registration: {p.state.claim.file} (claim block sha256 {p.state.claim.sha256[:12]}; frozen in "
             f"sweep.json at the first start, a changed block is refused)")
    what = {t.name: _what_next(layout, t, p.new, pack) for pack in p.packs for t in pack.trials}
    counts = Counter(w if not w.startswith("resume") else "resume" for w in what.values())
    show("trials: " + ", ".join(f"{n:,} {w}" for w, n in counts.most_common())
         + ("" if listing else " (each trial: --list)"))
    for pack in order_packs(run_spec, p.packs, load_throughput(throughput_path)) if listing else ():
        show(f"  pack {pack.name}  ({len(pack.trials)} seed{'s' if len(pack.trials) > 1 else ''})")
        for t in pack.trials:
            show(f"    {t.name:48s} env_steps={t.run.train.env_steps:,} hidden={t.run.agent.hidden} "
                 f"batch={t.run.agent.batch_size}  [{what[t.name]}]")
    res = run_spec.trial_resources()
    show(f"per pack: {res['cpu']:g} CPU ({spec.resources.cpu:g} + {run_spec.pack.env_workers} env workers), "
         f"{res['gpu']:g} GPU; all {n} packs at once: {res['cpu'] * n:g} CPU, {res['gpu'] * n:g} GPU; total env "
         f"steps {sum(t.run.train.env_steps for t in trials):,}")
    prices, here = load_prices(), here or this_machine()
    machines = [here] + (clusters(prices, card=card) if prices else [])
    tables = Tables(load_throughput(throughput_path), load_table(CPU_PATH), prices)
    lines = plan_lines(run_spec if recorded else spec, machines, tables, recorded, workers, price_per_hour)
    if spec.adaptive is not None:
        from qed_ray.service.looks import price_lines

        lines += price_lines(run_spec, p.packs, here, tables)
    for line in lines + [replay_line(run_spec.replay_needs())]:
        show(line)
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
    if (state := layout.trial_state(trial.name)) != "pending":
        return state
    steps = layout.pack_checkpoint_steps(pack.id)
    return f"resume from env step {max(steps):,}" if steps else "start"
