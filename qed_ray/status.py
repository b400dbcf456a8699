"""``python -m qed_ray.sweep SPEC --status``: a sweep's progress and partial results, read from its folder alone.

Starts nothing (no Ray, no MLflow): ``DONE.json`` says a trial finished; its newest policy snapshot's manifest how
far it got and how long it has run; Tune's ``error.txt``, newer than its last snapshot, that it failed; the group
cache (``gather/cache/``) gives the partial table for the spec's final-evaluation settings.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass

from qed_ray import group_cache, tables
from qed_ray.checkpoint import MANIFEST_FILE, CheckpointError, read_manifest
from qed_ray.layout import SweepDir
from qed_ray.results import FailedTrial, SweepResults
from qed_ray.spec import SweepSpec

STATES = ("done", "running", "failed", "not started")


@dataclass(frozen=True)
class TrialState:
    """One trial as its folder shows it. ``wall_s`` is NaN where no snapshot recorded it."""

    name: str
    state: str  # one of STATES; "running": started and not finished (also when its sweep was stopped)
    env_steps: int
    budget: int
    wall_s: float
    error: str = ""


def trial_state(layout: SweepDir, name: str, budget: int) -> TrialState:
    """Reads one trial's state from DONE.json, its newest snapshot and Tune's error file."""
    snaps = layout.snapshots(name)
    steps, wall, newest = 0, math.nan, 0.0
    if snaps:
        try:
            m = read_manifest(snaps[max(snaps)])
            steps, wall = int(m["env_steps"]), float(m.get("wall_s", math.nan))
            newest = (snaps[max(snaps)] / MANIFEST_FILE).stat().st_mtime
        except (CheckpointError, KeyError, ValueError, OSError):
            pass
    done = layout.done_marker(name)
    if done.exists():
        metrics = json.loads(done.read_text())
        return TrialState(name, "done", budget, budget, float(metrics.get("perf/wall_s", wall)))
    error = layout.trial_dir(name) / "error.txt"
    if error.exists() and error.stat().st_mtime > newest:
        lines = error.read_text(errors="replace").strip().splitlines()
        return TrialState(name, "failed", steps, budget, wall, lines[-1] if lines else "failed")
    folder = layout.trial_dir(name)  # Tune makes every trial's folder up front, and fills it when it starts
    started = bool(snaps) or (folder.is_dir() and any(folder.iterdir()))
    return TrialState(name, "running" if started else "not started", steps, budget, wall)


def projected_wall_s(states: list[TrialState]) -> float:
    """Wall seconds the whole sweep will have cost: done trials as they took, the others scaled to their budget at
    their own pace so far, trials without a pace at the median pace of the others (NaN if none has one)."""
    paces = [s.wall_s / s.env_steps for s in states if s.env_steps > 0 and math.isfinite(s.wall_s)]
    if not paces:
        return math.nan
    median = statistics.median(paces)
    total = 0.0
    for s in states:
        own = s.wall_s / s.env_steps if s.env_steps > 0 and math.isfinite(s.wall_s) else median
        total += s.wall_s if s.state == "done" and math.isfinite(s.wall_s) else own * s.budget
    return total


def partial_results(spec: SweepSpec, layout: SweepDir, states: list[TrialState]) -> tuple[SweepResults, int]:
    """The tables of every group whose trials are all done or failed and whose evaluation is cached for the spec's
    final-evaluation settings; also returns the number of groups."""
    by_name = {s.name: s for s in states}
    groups = group_cache.plan_groups(list(by_name))
    found, failed = [], [FailedTrial(s.name, s.error) for s in states if s.state == "failed"]
    for key, names in groups.items():
        if any(by_name[n].state not in ("done", "failed") for n in names):
            continue
        done = [n for n in names if by_name[n].state == "done"]
        job = group_cache.prepare(layout, key, done, None, spec.final_eval) if done else None
        cached = group_cache.load(layout, job.key) if job is not None and job.records else None
        if cached is not None:
            found.append(cached)
    results = tables.sweep_results(spec.name, spec.final_eval, found, failed, len(states))
    return results, len(groups)


def report(spec: SweepSpec, layout: SweepDir) -> str:
    """The ``--status`` text: trial counts, env steps, compute spent and projected, the partial table."""
    trials = spec.trials()
    if not layout.state_file.exists():
        return f"sweep {spec.name}: not started ({layout.root} has no {layout.state_file.name})"
    states = [trial_state(layout, t.name, t.run.train.env_steps) for t in trials]
    counts = {k: sum(s.state == k for s in states) for k in STATES}
    steps, budget = sum(s.env_steps for s in states), sum(s.budget for s in states)
    spent = sum(s.wall_s for s in states if math.isfinite(s.wall_s))
    res = spec.resources
    lines = [f"sweep {spec.name}: {len(trials)} trials in {layout.root}",
             "trials: " + ", ".join(f"{counts[k]} {k}" for k in STATES)
             + "  (running = started, not finished; also the unfinished trials of a stopped sweep)",
             f"env steps: {steps:,} of {budget:,} ({100 * steps / max(budget, 1):.0f}%)"]
    projected = projected_wall_s(states)
    for unit, share in (("GPU", res.gpu), ("CPU", res.cpu)):
        if share > 0:
            lines.append(f"{unit}-hours: {spent * share / 3600:.3g} spent, {projected * share / 3600:.3g} projected "
                         f"for the whole sweep (trial wall time x {share:g} {unit} per trial)")
    results, n_groups = partial_results(spec, layout, states)
    lines.append(f"results: {len(results.groups)} of {n_groups} groups gathered (cached in {layout.group_cache} "
                 f"for this spec's final_eval)")
    if results.aggregates:
        lines += ["", tables.format_table(results.aggregates, spec.final_eval.confidence)]
    lines += [f"FAILED {s.name}: {s.error}" for s in states if s.state == "failed"]
    return "\n".join(lines)
