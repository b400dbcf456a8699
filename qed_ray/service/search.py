"""A sweep with a ``search:`` block: Optuna's multi-objective sampler, through Ray Tune's ``OptunaSearch``, suggests
QED's k (and alpha_max) per task and agent entry, and each point trains as one more variant of the same sweep, in
rounds (docs/running.md, "A k search")."""

from __future__ import annotations

import logging
import math
import signal

from qed_ray.analysis.results import read_results
from qed_ray.analysis.search_front import EXPLORATORY, SearchedPoint, front_rows, table_lines, write
from qed_ray.spec.config import AGENT_SPECS, TemperatureSpec, TrainSpec
from qed_ray.records.layout import SweepDir
from qed_ray.records.search import SearchRecord, read_search, write_search
from qed_ray.spec.search import SearchPoint, grown, rounded, studies
from qed_ray.spec.sweep import SpecError, SweepSpec

UNGATHERED = "ungathered"
RETRIES = 50  # suggestions asked for before a study whose sampler keeps repeating known points stops


def point_names(spec: SweepSpec, point: SearchPoint) -> list[str]:
    """The trial names of ``point`` in ``grown(spec, ...)``: its group's variant label, per seed."""
    return [f"{point.task}/{spec.agents[point.entry].name}/{variant}/{s}" for variant in [_variant(spec, point)]
            for s in spec.seeds]


def _run_key(task: str, agent, temperature, train) -> str:
    return "|".join([task, agent.model_dump_json(), temperature.model_dump_json(), train.model_dump_json()])


def _variant(spec: SweepSpec, point: SearchPoint) -> str:
    big = grown(spec, (point,))
    e = spec.agents[point.entry]
    want = _run_key(point.task, AGENT_SPECS[e.name].model_validate(e.overrides),
                    TemperatureSpec.model_validate(point.temperature()), TrainSpec.model_validate(spec.entry_train(e)))
    return next(t.variant for t in big.trials() if t.run.seed == spec.seeds[0]
                and _run_key(t.run.task, t.run.agent, t.run.temperature, t.run.train) == want)


def _finished(layout: SweepDir, names: list[str]) -> bool:
    return all(layout.trial_state(n) != "pending" for n in names)


def objectives(spec: SweepSpec, layout: SweepDir, points) -> dict[SearchPoint, dict | str | None]:
    """Per finished point, ``{"iqm", "V"}`` of its pack; :data:`UNGATHERED` when every seed is done but its group
    is not gathered yet (a stop during the gather step); None: no result, a failed trial to the searcher."""
    from qed_ray.analysis import metrics
    import numpy as np

    groups = {}
    if layout.results_json.exists():
        groups = {g.key.name: g for g in read_results(layout.results_json).groups}
    out = {}
    for p in points:
        names = point_names(spec, p)
        g = groups.get(names[0].rsplit("/", 1)[0])
        value = UNGATHERED if g is None and all(layout.trial_state(n) == "done" for n in names) else None
        if g is not None and math.isfinite(g.V) and g.scores:
            value = {"iqm": metrics.iqm(np.asarray(g.scores, dtype=float)[:, None]), "V": float(g.V)}
        out[p] = value
    return out


def searcher(spec: SweepSpec, index: int, done: dict[SearchPoint, dict | None], running: list[SearchPoint]):
    """Study ``index``'s OptunaSearch, rebuilt from its finished points (told their results) and told of those
    still running (suggested again, left open)."""
    import optuna
    from ray import tune
    from ray.tune.search.optuna import OptunaSearch

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("ray.tune.search.optuna").setLevel(logging.ERROR)
    s = spec.search
    seed = s.seed + index
    sampler = (optuna.samplers.TPESampler(seed=seed) if s.sampler == "tpe"
               else optuna.samplers.NSGAIISampler(seed=seed))
    space = OptunaSearch.convert_search_space({n: tune.loguniform(lo, hi) for n, (lo, hi) in s.space().items()})
    known = [*done, *running]
    opt = OptunaSearch(space, metric=["iqm", "V"], mode=["max", "min"], sampler=sampler,
                       points_to_evaluate=[_params(spec, p) for p in known] or None)
    for i, p in enumerate(known):
        opt.suggest(f"known-{i}")
        if p in done:
            opt.on_trial_complete(f"known-{i}", done[p], error=done[p] is None)
    return opt


def _params(spec: SweepSpec, p: SearchPoint) -> dict:
    out = {"k": _clip(p.k, spec.search.k)}
    if spec.search.alpha_max is not None:
        out["alpha_max"] = _clip(p.alpha_max or spec.search.alpha_max[0], spec.search.alpha_max)
    return out


def _clip(x: float, bounds: tuple[float, float]) -> float:
    return min(max(x, bounds[0]), bounds[1])


def suggest_round(spec: SweepSpec, layout: SweepDir, record: SearchRecord, ungathered_failed: bool = False
                  ) -> tuple[SearchRecord, list[SearchPoint], bool]:
    """Asks every study whose points are all finished and gathered for its next points; returns the record with
    them (written), the new points, and whether a study waits for a finished point's gather (with
    ``ungathered_failed`` such a point counts as failed: a start gathered and still found none)."""
    new: list[SearchPoint] = []
    waiting = False
    finished = {p: _finished(layout, point_names(spec, p)) for p in record.points}
    results = objectives(spec, layout, [p for p, f in finished.items() if f])
    for index, (entry, task) in enumerate(studies(spec)):
        mine = [p for p in record.points if p.study == (entry, task)]
        if any(not finished[p] for p in mine) or len(mine) >= spec.search.trials:
            continue
        if not ungathered_failed and any(results[p] == UNGATHERED for p in mine):
            waiting = True
            continue
        opt = searcher(spec, index, {p: None if results[p] == UNGATHERED else results[p] for p in mine}, [])
        want, taken = min(spec.search.per_round, spec.search.trials - len(mine)), {*mine}
        fixed = spec.agents[entry].temperature_specs()
        for j in range(RETRIES * want):
            if len(taken) - len(mine) >= want:
                break
            params = opt.suggest(f"new-{j}")
            p = SearchPoint(entry=entry, task=task, k=rounded(params["k"]),
                            alpha_max=rounded(params["alpha_max"]) if "alpha_max" in params else None)
            if TemperatureSpec.model_validate(p.temperature()) in fixed:  # an arm the entry trains anyway: not a
                opt.on_trial_complete(f"new-{j}", None, error=True)         # point of its own (its trials exist)
                continue
            if p in taken:  # the sampler repeated a point (after rounding): it learns the known result, asks again
                known = results.get(p) if isinstance(results.get(p), dict) else None
                opt.on_trial_complete(f"new-{j}", known, error=known is None)
                continue
            taken.add(p)
            new.append(p)
    if new:
        record = SearchRecord(points=[*record.points, *new])
        write_search(layout, record)
    return record, new, waiting


def write_front(spec: SweepSpec, layout: SweepDir, record: SearchRecord, uri: str | None = None) -> list[str]:
    """Writes ``gather/search/`` from ``gather/results.json`` and logs it to the parent MLflow run (best-effort);
    returns the lines the driver prints."""
    if not layout.results_json.exists():
        return ["search: nothing gathered yet"]
    results = read_results(layout.results_json)
    big = grown(spec, record.points)
    pts = [SearchedPoint(p.task, spec.agents[p.entry].name, _variant(spec, p), p.k, p.alpha_max,
                         {"name": spec.agents[p.entry].name, "overrides": spec.agents[p.entry].overrides,
                          "train": spec.agents[p.entry].train}) for p in record.points]
    rows = front_rows(results.groups, pts, big.final_eval, spec.search.iqm_guard)
    paths = write(rows, pts, layout.search_outputs, spec.name, spec.search.rule(), big.final_eval.confidence)
    if uri is not None:
        _log(uri, layout)
    chosen = [f"{r.task}/{r.agent}: k = {r.k:g} ({r.variant})" for r in rows if r.chosen]
    return ["", f"k search ({len(rows)} of {len(record.points)} suggested points gathered): {EXPLORATORY}.",
            f"rule, stated before the search: {spec.search.rule()}", *table_lines(rows, big.final_eval.confidence),
            "chosen: " + ("; ".join(chosen) if chosen else "none (no point's IQM guard held, or none could be judged)"),
            f"front figure, table and spec fragment: {paths[0].parent}/ (paste fragment.yaml into a confirmatory "
            f"sweep)"]


def _log(uri: str, layout: SweepDir) -> None:
    from qed_ray.records.sweep import sweep_id
    from qed_ray.service.mlflow.tracking import open_sweep

    try:
        found = open_sweep(uri, sweep_id(layout))
        if found is not None:
            tracker, parent = found
            tracker.log_artifacts(parent.info.run_id, layout.search_outputs, "gather/search")
    except Exception as e:  # noqa: BLE001 - gather/search/ is the record; MLflow is a mirror
        print(f"WARNING: MLflow: the search's front was not logged ({type(e).__name__}: {e}); it is in "
              f"{layout.search_outputs}", flush=True)


def _signal_in_round() -> int | None:
    """The signal the round's stopper (still installed) took during the round's final gather, or None."""
    return getattr(getattr(signal.getsignal(signal.SIGINT), "__self__", None), "signum", None)


def _default_signals() -> None:
    """Between rounds, Ctrl-C and SIGTERM act as before a start (not on a round's trials, which no longer run)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def run_search(spec: SweepSpec, spec_path, run_sweep, fresh: bool = False, gather_partial: bool = False,
               force: bool = False, allow_unverified: bool = False) -> int:
    """Runs (or resumes) the search, each round a start of the grown spec by ``run_sweep``; returns the exit code of
    the first round that did not succeed, else 0."""
    from qed_ray.service.sweep_state import resolve_paths

    layout, uri, _ = resolve_paths(spec)
    print(f"k search: {spec.search.trials} point(s) per task and agent, {spec.search.per_round} per round; "
          f"{EXPLORATORY}", flush=True)
    print(f"rule, stated before the search: {spec.search.rule()}", flush=True)
    if fresh:  # the folder (search.json with it) is moved aside by a start of the spec without points
        code = run_sweep(spec, spec_path, True, gather_partial, force, allow_unverified)
        if code:
            return code
        _default_signals()
    gather_only = False
    while True:
        record, new, waiting = suggest_round(spec, layout, read_search(layout, spec), gather_only)
        big = grown(spec, record.points)
        pending = [t.name for t in big.trials() if layout.trial_state(t.name) == "pending"]
        if not pending and (not waiting or gather_only):
            break
        gather_only = not pending  # a start that trains nothing gathers the points a stop left ungathered
        say = ", ".join(f"k={p.k:g}" + (f" alpha_max={p.alpha_max:g}" if p.alpha_max else "") + f" on {p.task}"
                        for p in new)
        print("k search: a start that gathers the points a stop left ungathered" if gather_only else
              f"k search: round with {len(record.points)} of {spec.search.trials * len(studies(spec))} points "
              f"suggested{'; new: ' + say if new else ''}", flush=True)
        code = run_sweep(big, spec_path, False, gather_partial, False, allow_unverified)
        if code:
            return code
        signum = _signal_in_round()
        _default_signals()
        if signum is not None:  # a stop during the round's end: the search stops after it, resumable
            write_front(spec, layout, record, uri)
            print(f"stopped after this round ({signal.Signals(signum).name}); the same command resumes the search",
                  flush=True)
            return 128 + signum
        write_front(spec, layout, record, uri)  # after every round: an interrupted search keeps its front so far
    for line in write_front(spec, layout, record, uri):
        print(line, flush=True)
    return 0


def dry_spec(spec: SweepSpec, layout: SweepDir, fresh: bool = False) -> tuple[SweepSpec, str]:
    """The spec a dry run prices for a search: grown by the points suggested so far and, for the rest of the trial
    budget, by placeholder k values spread over the range (log scale); and the line that says so."""
    s = spec.search
    record = SearchRecord() if fresh else read_search(layout, spec)
    points = list(record.points)
    for entry, task in studies(spec):
        mine = {p.k for p in points if p.study == (entry, task)}
        m = s.trials + len(mine)  # enough values that the recorded ones leave the budget's rest free
        spread = [rounded(s.k[0] * (s.k[1] / s.k[0]) ** (i / max(m - 1, 1))) for i in range(m)]
        free = [k for k in dict.fromkeys(spread) if k not in mine][:s.trials - len(mine)]
        points += [SearchPoint(entry=entry, task=task, k=k, alpha_max=s.alpha_max[0] if s.alpha_max else None)
                   for k in free]
    n = s.trials * len(studies(spec))
    return grown(spec, tuple(points)), (
        f"k search: {s.trials} point(s) x {len(studies(spec))} (task, agent) = {n} packs of {len(spec.seeds)} seeds "
        f"beside te's; priced below as per-pack cost x this budget ({len(record.points)} suggested so far, the "
        f"rest at placeholder k over [{s.k[0]:g}, {s.k[1]:g}]); exploratory: no verdict")
