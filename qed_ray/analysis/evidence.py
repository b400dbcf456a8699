"""The claim's verdict measured and judged (:func:`judge`, by the rules of :mod:`qed_ray.analysis.verdict`): per task
the learning floor and the guard's intervals, and the two endpoints over the tasks the guards admit, at the verdict's
decision level and from the comparisons' paired draws (:func:`qed_ray.analysis.comparisons.task_draws`, so the
replicates are those of ``comparisons.csv``). Letters: R bootstrap replicates, I seeds of a group."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from pydantic import ValidationError

from qed_ray.analysis import bootstrap, comparisons, metrics
from qed_ray.analysis.results import Comparison, EndpointResult, GroupResult, TaskGuard, Verdict
from qed_ray.analysis.verdict import (EXPLORATORY, combine, decision_level, departures, endpoint_rules, guard_outcome,
                                      interval_outcome, judge_variant, look_levels)
from qed_ray.spec.claim import MIN_SEEDS, ClaimBlock, Endpoints
from qed_ray.spec.sweep import FinalEvalSpec


def learning_floor(random_score, margin: float):
    """A task's learning floor in normalised score: ``random + margin * (1 - random)`` (any shape)."""
    r = np.asarray(random_score, dtype=np.float64)
    return r + margin * (1.0 - r)


def _reason(variant: str, outcome: str, floor: float, random: float, b: tuple, t: tuple, ratio: tuple,
            margin: float) -> str:
    if math.isnan(floor):
        return "no random-policy score for this task (gathered before it was measured): not enough data"
    if math.isnan(b[1]) or b[1] < floor:
        return (f"te did not clear its learning floor: mean score {b[0]:.3g}, lower end {b[1]:.3g} < floor "
                f"{floor:.3g} (random policy {random:.3g}): not enough data for this task")
    if t[2] < floor:
        return (f"{variant} below its learning floor while te cleared it: mean score {t[0]:.3g}, upper end "
                f"{t[2]:.3g} < floor {floor:.3g}")
    said = f"{variant}'s mean score {ratio[0]:.3g} [{ratio[1]:.3g}, {ratio[2]:.3g}] of te's"
    if outcome == "fail":
        return f"{said}: below the {margin:g} margin"
    return f"te learned (lower end {b[1]:.3g} >= floor {floor:.3g}); {said}"


def measure(c: Comparison, base: Sequence[GroupResult], this: Sequence[GroupResult], fe: FinalEvalSpec, level: float,
            endpoints: Endpoints, unpaired=None) -> tuple[list[TaskGuard], list[EndpointResult]]:
    """The guards of every task of comparison ``c`` and its two endpoints, every interval at the two-sided ``level``
    (Bonferroni-adjusted, :func:`~qed_ray.analysis.verdict.decision_level`), from te's groups ``base`` and the
    variant's ``this``; ``unpaired``: replicates from a group's own draws for tasks whose seeds differ (None: drawn
    here)."""
    by_task = {g.task: g for g in this}
    pairs = [(b, by_task[b.task]) for b in sorted(base, key=lambda g: g.task) if b.task in by_task]
    draws = comparisons.task_draws(pairs, fe, unpaired or comparisons.Replicates(fe).get)
    gr, guards, rows = endpoints.guards, [], []
    for (b, t), (db, dt, _) in zip(pairs, draws):
        random = b.random_score if math.isfinite(b.random_score) else t.random_score
        floor = float(learning_floor(random, gr.learned_above_random))
        mb, mt = db["scores"].mean(axis=1), dt["scores"].mean(axis=1)
        bm, tm = float(np.mean(b.scores)), float(np.mean(t.scores))
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = (tm / bm if bm > 0 else math.nan, *bootstrap.percentile_interval(mt / mb, level))
        be, te_ = (bm, *bootstrap.percentile_interval(mb, level)), (tm, *bootstrap.percentile_interval(mt, level))
        outcome = guard_outcome(floor, be[1], te_[2], ratio[2], gr.mean_kept)
        guards.append(TaskGuard(b.task, outcome, _reason(c.variant, outcome, floor, random, be, te_, ratio,
                                                         gr.mean_kept), random, floor, bm, be[1], tm, te_[2],
                                *ratio, t.alpha_regime))
        rows.append((b, t, db, dt))
    v_rule, q_rule = endpoint_rules(endpoints, c)
    v_use = [r for r, g in zip(rows, guards) if g.outcome == "pass" and r[2]["V"] is not None
             and r[3]["V"] is not None]
    v_est = _v_median(v_use, level)
    q_use = [r for r, g in zip(rows, guards) if g.outcome != "not enough data"]
    q_est = _iqm_ratio(q_use, level)
    v_name = f"V ratio >= {endpoints.v_ratio.lower_at_least:g}"
    return guards, [
        EndpointResult(v_name, interval_outcome(*v_est, endpoints.v_ratio.lower_at_least), *v_est,
                       f"{v_rule}; {len(v_use)} of {len(rows)} tasks"),
        EndpointResult("IQM kept", interval_outcome(*q_est, endpoints.iqm_kept.lower_at_least), *q_est,
                       f"{q_rule}; {len(q_use)} of {len(rows)} tasks")]


def _v_median(rows: list, level: float) -> tuple[float, float, float]:
    if not rows:
        return math.nan, math.nan, math.nan
    point = metrics.ratio_summaries([comparisons.group_value("V", b) for b, *_ in rows],
                                    [comparisons.group_value("V", t) for _, t, *_ in rows])["median"]
    lo, hi = bootstrap.ratio_intervals(np.stack([db["V"] for *_, db, _ in rows], axis=1),
                                       np.stack([dt["V"] for *_, dt in rows], axis=1), level)["median"]
    return float(point), lo, hi


def _iqm_ratio(rows: list, level: float) -> tuple[float, float, float]:
    if not rows:
        return math.nan, math.nan, math.nan
    base = metrics.iqm(np.concatenate([np.asarray(b.scores, dtype=np.float64) for b, *_ in rows])[None, :])
    this = metrics.iqm(np.concatenate([np.asarray(t.scores, dtype=np.float64) for _, t, *_ in rows])[None, :])
    reps = bootstrap.iqm_ratio_replicates([db["scores"] for *_, db, _ in rows], [dt["scores"] for *_, dt in rows])
    return (this / base if base > 0 else math.nan, *bootstrap.percentile_interval(reps, level))


def _block(claim: dict | None) -> tuple[ClaimBlock | None, list[str]]:
    if not claim:
        return None, []
    try:
        return ClaimBlock.model_validate(claim["block"]), []
    except ValidationError as e:
        first = e.errors()[0]
        return None, [f"the claim block recorded in sweep.json (sha256 {claim['sha256'][:12]}) does not fit today's "
                      f"rules ({'.'.join(map(str, first['loc']))}: {first['msg']}): start a new sweep to judge it"]


def _look(block: ClaimBlock | None, c: Comparison, scope: list[str], level: float) -> tuple[int | None, float]:
    """The registered look a judged comparison's seeds make it and that look's level (adaptive: m is the registered k,
    so a variant frozen at an earlier look keeps its share); a fixed design: (None, ``level``)."""
    if block is None or block.adaptive is None or scope:
        return None, level
    look = block.adaptive.looks().index(c.n_seeds) + 1
    return look, look_levels(block.endpoints, block.adaptive, len(block.variants))[look - 1]


def judge(comparisons: Sequence[Comparison], groups: Sequence[GroupResult], final_eval: FinalEvalSpec,
          claim: dict | None = None, unpaired=None) -> Verdict | None:
    """The verdict over every QED variant with a te baseline (None if there is none); ``claim``: ``sweep.json``'s claim
    record (``{"file", "sha256", "block"}``) or None; ``unpaired``: as :func:`measure`."""
    block, problems = _block(claim)
    endpoints = block.endpoints if block else Endpoints()
    qed = {(g.agent, g.variant) for g in groups if g.temperature == "qed"}  # the variants judged, never controls
    rows = [c for c in comparisons if c.baseline and (c.agent, c.variant) in qed]
    if not rows:
        return None
    scopes = [departures(c, block, final_eval, *problems) for c in rows]
    judged = [c for c, s in zip(rows, scopes) if not s]
    level = decision_level(endpoints, len(judged) or len(rows))
    variants = []
    for c, scope in zip(rows, scopes):
        mine = [g for g in groups if (g.agent, g.variant) == (c.agent, c.variant) and g.task in c.tasks]
        base = [g for g in groups if (g.agent, g.variant) == (c.agent, c.baseline) and g.task in c.tasks]
        how = (None if min(len(g.seeds) for g in mine + base) < MIN_SEEDS else
                   lambda lv, c=c, b=base, t=mine: measure(c, b, t, final_eval, lv, endpoints, unpaired))
        look, lv = _look(block, c, scope, level)
        variant = judge_variant(c, endpoints, sum(g.at_cap for g in mine), scope, lv, how)
        variants.append(variant.model_copy(update={"look": look}) if look else variant)
    use = [v for v in variants if not v.scope]
    outcome = combine([v.outcome for v in use], any_pass=True) if use else EXPLORATORY
    over = (f"the {len(use)} pre-registered variant(s)" if use else
            "nothing: no variant runs the registered design (exploratory)")
    correction = f"{endpoints.correction} over {len(judged) or len(rows)} variant(s): intervals at {100 * level:.4g}%"
    if block is not None and block.adaptive is not None:
        a = block.adaptive
        correction = (f"{endpoints.correction} over the {len(block.variants)} registered variant(s), spent by "
                      f"{a.spending} over the looks at {', '.join(map(str, a.looks()))} seeds (docs/claim.md, seeds "
                      f"by looks)")
    return Verdict(claim["file"] if claim else None, claim["sha256"] if claim else None, outcome, over, variants,
                   correction)
