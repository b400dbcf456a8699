"""``qed-ray sweep SPEC --status``: a sweep's progress and partial results, read from its folder alone, starting
nothing (docs/running.md, ``--status``)."""

from __future__ import annotations

import math
import os
import re
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from qed_ray.analysis import group_cache, tables
from qed_ray.analysis.report import format_table, unverified_line
from qed_ray.analysis.results import FailedTrial, SweepResults
from qed_ray.records.codec import RecordError
from qed_ray.records.file_reads import cut, read_tail
from qed_ray.records.layout import SweepDir
from qed_ray.records.checkpoint import MANIFEST_FILE, SNAPSHOT_FORMATS, CheckpointVersionError, read_manifest
from qed_ray.records.run import diverged_reason, read_done
from qed_ray.service.lock import STALE_AFTER_S, LockDamaged, read_lock, stale_reason
from qed_ray.service.packing import Pack, form_packs, pack_of, seed_checkpoint
from qed_ray.service.results_key import ResultsKeyError, key_path, load_key
from qed_ray.records.sweep import StateDamaged, read_state
from qed_ray.spec.field_hints import format_validation_error
from qed_ray.spec.sweep import SpecError, SweepSpec

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # terminal colour codes (Ray colours its task header)
RAY_TASK_HEADER = re.compile(r"^ray::\S+ \(pid=")  # "ray::ImplicitFunc.train() (pid=1, ip=...)": where, not why
STATES = ("done", "running", "stopped", "failed", "not started")


@dataclass(frozen=True)
class TrialState:
    """One trial as its folder shows it. ``wall_s`` is NaN where no checkpoint or snapshot recorded it, ``cpu_s``
    (:class:`~qed_ray.records.run.Timings`) None where none did."""

    name: str
    state: str  # one of STATES; "running"/"stopped": started, not finished, while a driver runs / none does
    env_steps: int
    budget: int
    wall_s: float
    error: str = ""
    cpu_s: float | None = None


def driver(layout: SweepDir, now: float | None = None) -> str | None:
    """Who runs the sweep now, from its lock (``pid 12 on host h (started ..., last heartbeat 3 s ago)``); None
    when no driver holds a live lock. Raises LockDamaged for a folder or a dangling link in place of ``sweep.lock``."""
    try:
        info, damage = read_lock(layout.lock_file), None
        mtime = layout.lock_file.stat().st_mtime
    except LockDamaged as e:
        if e.mtime is None:  # a folder or a dangling link: no driver holds that
            raise
        info, damage, mtime = None, e, e.mtime
    except OSError:
        return None
    now = time.time() if now is None else now
    if stale_reason(info, mtime, now, socket.gethostname(), STALE_AFTER_S) is not None:
        return None
    if info is not None:
        return info.describe(now)
    return f"unknown ({damage})" if damage is not None else "a driver that is starting"


def _progress(layout: SweepDir, name: str, pack: Pack) -> tuple[int, float, float | None, float]:
    """``(env steps, wall seconds, CPU seconds, mtime)`` of the trial's seed's part of its pack's newest checkpoint
    or, past it, of its newest policy snapshot."""
    steps, wall, cpu, mtime = 0, math.nan, None, 0.0
    seed = seed_checkpoint(layout, pack.id, name)
    checkpoints = {0: seed} if seed is not None and os.path.lexists(seed / MANIFEST_FILE) else {}
    for found, times in ((checkpoints, lambda m: m.require(folder / MANIFEST_FILE, "progress")[0]),
                         (layout.snapshots(name), lambda m: m)):
        if not found or max(found) < steps:
            continue
        folder = found[max(found)]
        try:
            m = read_manifest(folder, SNAPSHOT_FORMATS)  # progress only: an older run's files tell it too
        except CheckpointVersionError:
            continue  # written by a qed_ray that cannot be read here: its progress is unknown
        if m.env_steps < steps:
            continue
        steps, wall, cpu = m.env_steps, float(times(m).wall_s), times(m).cpu_s
        mtime = max(mtime, (folder / MANIFEST_FILE).stat().st_mtime)
    return steps, wall, cpu, mtime


def error_summary(error_txt: str) -> str:
    """One line of a Tune ``error.txt``: a traceback's last line, else the first line after the ``Failure # n``
    header that is not Ray's task header (a worker killed by Ray: ``1 worker(s) were killed due to ...``)."""
    lines = [ln.strip() for ln in ANSI.sub("", error_txt).splitlines()
             if ln.strip() and not ln.startswith("Failure # ")]
    if not lines:
        return "failed (no error message)"
    if any(ln.startswith(("Traceback", 'File "')) for ln in lines):  # Ray's task errors may have frames only
        return cut(lines[-1])
    return cut(next((ln for ln in lines if not RAY_TASK_HEADER.match(ln)), lines[0]))


def _last_error(layout: SweepDir, pack: Pack, newer_than: float) -> str | None:
    """The pack's ``error.txt`` of the latest start that ran it, unless a later checkpoint shows it ran on."""
    dirs = layout.pack_dirs(pack.id)
    error = dirs[-1] / "error.txt" if dirs else None
    if error is None or not error.exists() or error.stat().st_mtime <= newer_than:
        return None
    try:
        return error_summary(read_tail(error, RecordError, within=layout.root))
    except RecordError as e:
        return cut(str(e))


def trial_state(layout: SweepDir, name: str, budget: int, pack: Pack, live: bool = False) -> TrialState:
    """``live``: a driver runs the sweep now (a started, unfinished trial is "running", else "stopped")."""
    steps, wall, cpu, newest = _progress(layout, name, pack)
    state = layout.trial_state(name)
    if state == "done":
        metrics = read_done(layout, name).metrics
        cpu = metrics.get("perf/cpu_s", cpu)
        return TrialState(name, "done", budget, budget, float(metrics.get("perf/wall_s", wall)),
                          cpu_s=cpu if cpu is not None and math.isfinite(cpu) else None)
    if state == "diverged":
        return TrialState(name, "failed", steps, budget, wall, f"{diverged_reason(layout, name)} (final)", cpu)
    error = _last_error(layout, pack, newest)
    if error is not None:
        return TrialState(name, "failed", steps, budget, wall, f"{error} (the next start retries it)", cpu)
    started = steps > 0 or any(_non_empty(d) for d in layout.pack_dirs(pack.id))
    return TrialState(name, ("running" if live else "stopped") if started else "not started", steps, budget, wall,
                      cpu_s=cpu)


def _non_empty(folder: Path) -> bool:
    return folder.is_dir() and any(folder.iterdir())


def projected_wall_s(states: list[TrialState], shares: list[float] | None = None) -> float:
    """Wall seconds the whole sweep will have cost: done trials as they took, the others scaled to their budget at
    their own pace so far, or the median pace (NaN if none has one). ``shares``: per trial, 1 / its pack's size."""
    paces = [s.wall_s / s.env_steps for s in states if s.env_steps > 0 and math.isfinite(s.wall_s)]
    if not paces:
        return math.nan
    median = statistics.median(paces)
    total = 0.0
    for s, share in zip(states, shares or [1.0] * len(states)):
        own = s.wall_s / s.env_steps if s.env_steps > 0 and math.isfinite(s.wall_s) else median
        total += share * (s.wall_s if s.state == "done" and math.isfinite(s.wall_s) else own * s.budget)
    return total


def cpu_used_line(states: list[TrialState], shares: list[float]) -> str:
    """The CPU time the started trials' packs measured (their processes and env workers, over every start), each
    trial counting its ``share`` of its pack's; "no estimate" when one of them recorded none."""
    started = [(s, w) for s, w in zip(states, shares) if math.isfinite(s.wall_s)]
    known = [w * s.cpu_s for s, w in started if s.cpu_s is not None]
    if len(known) < len(started):
        others = f"; the others used {sum(known) / 3600:.3g}" if known else ""
        return (f"CPU-hours used: no estimate ({len(started) - len(known)} of {len(started)} started trials' files "
                f"were written before qed_ray measured it{others})")
    return f"CPU-hours used: {sum(known) / 3600:.3g} spent (measured CPU time of the packs' processes and env workers)"


def partial_results(spec: SweepSpec, layout: SweepDir, states: list[TrialState], signing_key: bytes | None = None,
                    notes: list[str] | None = None) -> tuple[SweepResults, int, list[str]]:
    """The tables of every ended group cached for the spec's ``final_eval`` (checked with ``signing_key``; None:
    unchecked), the number of groups and why entries were refused; a damaged entry adds a line to ``notes``."""
    by_name = {s.name: s for s in states}
    groups = group_cache.plan_groups(list(by_name))
    found, failed = [], [FailedTrial(s.name, s.error) for s in states if s.state == "failed"]
    refused = []
    for key, names in groups.items():
        if any(by_name[n].state not in ("done", "failed") for n in names):
            continue
        done = [n for n in names if by_name[n].state == "done"]
        job = group_cache.prepare(layout, key, done, None, spec.final_eval) if done else None
        try:
            cached = group_cache.load(layout, job.key, signing_key, key, (notes if notes is not None else []).append) \
                if job is not None and job.records else None
        except group_cache.TamperedCacheError as e:
            refused.append(str(e))
            continue
        if cached is not None:
            found.append(cached)
    results = tables.sweep_results(spec.name, spec.final_eval, found, failed, len(states),
                                   judge=spec.search is None)
    return results, len(groups), refused


def _status_key(layout: SweepDir) -> tuple[bytes | None, str]:
    """The results key if there is a usable one (never created here), else a note that the cache goes unchecked."""
    try:
        return load_key(sweep_dir=layout.root).secret, ""
    except ResultsKeyError as e:
        return None, f" (NOT CHECKED: {str(e).split(';')[0]})" if key_path().exists() else \
            f" (NOT CHECKED: no results key at {key_path()})"


def report(spec: SweepSpec, layout: SweepDir, source: str = "", columns: int | None = None) -> str:
    """The ``--status`` text; ``source`` says how the folder was found."""
    trials = spec.trials()
    found = f"; the folder is {source}" if source else ""
    check_owner(spec, layout, found)
    if not os.path.lexists(layout.state_file):
        return (f"sweep {spec.name}: not started ({layout.root} has no {layout.state_file.name}{found}). A sweep "
                f"submitted with `ray job submit` stores where its job's variables say: its driver's first lines "
                f"print the --status --dir command that finds it.")
    holder = driver(layout)
    packs = sweep_packs(spec, layout)
    in_pack = pack_of(packs)
    states = [trial_state(layout, t.name, t.run.train.env_steps, in_pack[t.name], holder is not None)
              for t in trials]
    counts = {k: sum(s.state == k for s in states) for k in STATES}
    steps, budget = sum(s.env_steps for s in states), sum(s.budget for s in states)
    # The seed runs of a pack share its wall time (and its resources): each counts 1 / pack size of it.
    shares = [1 / len(in_pack[s.name].trials) for s in states]
    spent = sum(w * s.wall_s for s, w in zip(states, shares) if math.isfinite(s.wall_s))
    res = spec.trial_resources()
    lines = [f"sweep {spec.name}: {len(trials)} trials in {layout.root}",
             f"driver: {holder}" if holder else "driver: none running (started trials resume from their newest "
                                                "checkpoint at the next start)",
             "trials: " + ", ".join(f"{counts[k]} {k}" for k in STATES),
             f"env steps: {steps:,} of {budget:,} ({100 * steps / max(budget, 1):.0f}%)"]
    projected = projected_wall_s(states, shares)
    for unit, share in (("GPU", res["gpu"]), ("CPU", res["cpu"])):
        lines += [cpu_used_line(states, shares)] if unit == "CPU" else []
        if share > 0:
            whole = "no estimate yet (no pack has a pace)" if math.isnan(projected) else \
                f"{projected * share / 3600:.3g} projected"
            lines.append(f"{unit}-hours{' held' if unit == 'CPU' else ''}: {spent * share / 3600:.3g} spent, {whole} "
                         f"for the whole sweep (pack wall time x {share:g} {unit} per pack)")
    signing_key, unchecked = _status_key(layout)
    notes: list[str] = []
    results, n_groups, refused = partial_results(spec, layout, states, signing_key, notes)
    lines.append(f"results: {len(results.groups)} of {n_groups} groups gathered (cached in {layout.group_cache} "
                 f"for this spec's final_eval){unchecked}")
    lines += [f"REFUSED {why}" for why in refused]
    lines += [f"re-analysis (python -m qed_ray.gather): {p.relative_to(layout.root)}/" for p in layout.reanalyses()]
    unverified = unverified_line(results.groups, layout)  # the gather's verdicts, with each DONE.json's reason
    lines += [unverified] if unverified else []
    if results.aggregates:
        lines += ["", format_table(results, columns)]
    by_name = {s.name: s for s in states}
    most = max((len(p.trials) for p in packs), default=1)
    lines += ["", f"packs ({len(packs)}, up to {most} seed{'s' if most > 1 else ''} each): "
                  f"seed: state [env steps]"]
    lines += [f"  {p.name}  " + "  ".join(_seed_cell(by_name[t.name], t.run.seed) for t in p.trials) for p in packs]
    lines += [f"FAILED {s.name} (pack {in_pack[s.name].name}): {cut(s.error)}" for s in states if s.state == "failed"]
    return "\n".join(lines + notes)


def sweep_folders_in(folder: Path) -> list[Path]:
    try:
        return sorted(d for d in folder.iterdir() if (d / SweepDir(d).state_file.name).is_file())
    except OSError:
        return []


def _inside_hint(folder: Path) -> str:
    inside = sweep_folders_in(folder)
    if not inside:
        return ""
    return f"; it holds the sweep folder(s) {', '.join(d.name for d in inside)}: give --dir {inside[0]}"


def check_owner(spec: SweepSpec, layout: SweepDir, found: str = "") -> None:
    """Refuses (SpecError) a folder that holds another sweep, or files but no ``sweep.json``."""
    root = layout.root
    if os.path.lexists(layout.state_file):
        try:
            owner = read_state(layout).name or spec.name
        except StateDamaged:
            return  # a damaged sweep.json: the report (or a start) names the damage
        if owner != spec.name:
            raise SpecError(f"{root} holds the sweep {owner!r}, not {spec.name!r}{found}; give the folder of "
                            f"{spec.name!r} with --dir, or the spec of {owner!r}")
    elif root.is_dir() and [p for p in root.iterdir() if p.name != layout.lock_file.name]:
        raise SpecError(f"{root} is not a sweep folder (files but no {layout.state_file.name}{found})"
                        f"{_inside_hint(root)}")


def recorded_spec(layout: SweepDir) -> SweepSpec:
    """The spec ``sweep.json`` records (``--status --dir`` without a spec), validated as a spec file is (SpecError)."""
    state = read_state(layout)
    if state is None:
        raise SpecError(f"--dir: {layout.root} is not a sweep folder (no {layout.state_file.name})"
                        f"{_inside_hint(layout.root)}")
    if state.spec is None:
        raise SpecError(f"{layout.state_file}: records no spec (an older qed_ray wrote it; the next start records "
                        f"it); give the spec: {sys.executable} -m qed_ray.sweep SPEC --status --dir {layout.root}")
    try:
        return SweepSpec.model_validate(state.spec)
    except ValidationError as e:
        raise SpecError(format_validation_error(e, f"{layout.state_file}: spec.")) from None


def sweep_packs(spec: SweepSpec, layout: SweepDir) -> list[Pack]:
    """The sweep's packs as its ``sweep.json`` records them (and, for its trials in none, as a start forms them)."""
    state = read_state(layout)  # pack.seeds auto: the size the sweep registered (packs of one before it started)
    size = state.pack_seeds if state is not None else 1
    return form_packs(spec, state.packs if state is not None else {}, size if spec.pack.seeds == "auto" else None)


def _seed_cell(s: TrialState, seed: int) -> str:
    return f"{seed}:{s.state}" + ("" if s.state in ("done", "not started") else f"[{s.env_steps:,}]")

