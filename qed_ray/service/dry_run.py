"""``python -m qed_ray.sweep SPEC --dry-run [--list] [--workers N]``: what a run would do, and what it would cost;
starts nothing.

Prints the plan: the trials and packs (one Tune trial each) with what a run would do with them from the folder on
disk (``new``, ``start``, ``resume from env step N``, ``done``, ``diverged``: counted, and per trial with ``--list``,
packs in the order they go to Tune), the resources per Tune trial and all at once, one line per pack shape (hours
and memory per pack, the node it needs), the GPU-hours with the scheduling tail and the wall clock on each shipped
cluster's card and on the measured one (:mod:`qed_ray.service.dry_plan`, :mod:`qed_ray.service.bill`), and the
largest replay per trial and per pack against their caps (:mod:`qed_ray.replay_memory`). A spec that a real run
would refuse is refused the same way (exit 2); a tracking server that does not answer from here is only warned
about (:mod:`qed_ray.service.tracking_uri`).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from qed_ray import console
from qed_ray.records.layout import SweepDir
from qed_ray.service.packing import Pack
from qed_ray.spec import SpecError, SweepSpec, Trial
from qed_ray.service.sweep_state import check_folder, plan, resolve_paths
from qed_ray.replay_memory import replay_line
from qed_ray.service.tracking_uri import unreachable, uri_field
from qed_ray.service.dry_plan import order_packs, plan_lines
from qed_ray.service.throughput import DEFAULT_PATH, load_throughput


def tune_order(spec: SweepSpec, packs: list[Pack]) -> list[Pack]:
    """The packs in the order the driver hands them to Tune: longest first on the measured table's card
    (:func:`qed_ray.service.dry_plan.order_packs`)."""
    return order_packs(spec, packs, load_throughput())


def dry_run(spec: SweepSpec, throughput_path: str | Path = DEFAULT_PATH, listing: bool = False,
            workers: int | None = None, fresh: bool = False, force: bool = False) -> int:
    """Prints the plan (see the module notes; every trial with ``listing``; ``workers`` nodes instead of the
    clusters' ``max_workers``; with ``fresh``, that of the new sweep ``--fresh`` would start); raises SpecError with
    the refusals a run would give; no line wider than :func:`qed_ray.console.width`."""
    layout, uri, exp = resolve_paths(spec)
    columns = console.width()

    def show(line: str) -> None:
        print(console.fit(line, columns))

    existing = check_folder(layout, spec, fresh, force)
    p = plan(None, spec) if fresh else plan(existing, spec, layout)
    if fresh and existing is not None:
        show(f"--fresh: {layout.root} would be moved aside first (nothing is deleted); the plan below is of a new "
              f"sweep")
    trials = spec.trials()
    res = spec.trial_resources()
    plural = "s" if len(p.packs) > 1 else ""
    show(f"sweep {spec.name}: {len(trials)} trials in {len(p.packs)} pack{plural} (Tune trial{plural}) of up to "
         f"{spec.pack.seeds} seed{'s' if spec.pack.seeds > 1 else ''} -> {layout.root}  (MLflow {uri}, experiment "
         f"{exp})")
    if p.state.claim is not None:
        rec = p.state.claim
        show(f"pre-registration: {rec.file} (claim block sha256 {rec.sha256[:12]}; frozen in sweep.json at the "
             f"first start, a changed block is refused)")
    table = load_throughput(throughput_path)
    packs = order_packs(spec, p.packs, table)
    what = {t.name: _what_next(layout, t, p.new, pack) for pack in packs for t in pack.trials}
    counts = Counter(w if not w.startswith("resume") else "resume" for w in what.values())
    show("trials: " + ", ".join(f"{n:,} {w}" for w, n in counts.most_common())
         + ("" if listing else " (each trial: --list)"))
    for pack in packs if listing else ():
        show(f"  pack {pack.name}  ({len(pack.trials)} seed{'s' if len(pack.trials) > 1 else ''})")
        for t in pack.trials:
            r = t.run
            show(f"    {t.name:48s} env_steps={r.train.env_steps:,} hidden={r.agent.hidden} "
                 f"batch={r.agent.batch_size}  [{what[t.name]}]")
    total, n = sum(t.run.train.env_steps for t in trials), len(p.packs)
    show(f"per pack: {res['cpu']:g} CPU ({spec.resources.cpu:g} + {spec.pack.env_workers} env workers), "
         f"{res['gpu']:g} GPU; all {n} packs at once: {res['cpu'] * n:g} CPU, {res['gpu'] * n:g} GPU; total "
         f"env steps {total:,}")
    for line in plan_lines(spec, packs, table, workers):
        show(line)
    show(replay_line(spec.replay_needs()))
    problem = unreachable(uri)
    if problem:  # a cluster-only address is normal where a dry run is made: a start refuses it, this warns
        print(f"warning: {uri_field()}: {problem}; a start from here would be refused (fine if the address is "
              f"reachable only from the cluster's head)", file=sys.stderr)
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
