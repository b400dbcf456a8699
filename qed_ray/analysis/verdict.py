"""The verdict on the paper's central claim, judged by the rules of the pre-registration (docs/claim.md), from a
sweep's groups and te/QED comparisons (:func:`qed_ray.analysis.evidence.judge` measures and applies them). Pure
numpy: no files, no Ray, no MLflow. The rules are vectorised, so the
power tool (``benchmarks/verdict_power.py``) applies these very functions to thousands of simulated experiments."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import numpy as np

from qed_ray.spec.claim import MIN_SEEDS, AdaptiveSpec, ClaimBlock, Endpoints, registered_design
from qed_ray.analysis.results import Comparison, EndpointResult, TaskGuard, Verdict, VariantVerdict

if TYPE_CHECKING:
    from qed_ray.spec.sweep import FinalEvalSpec

PASS, FAIL, NOT_ENOUGH = "pass", "fail", "not enough data"
NOT_ENOUGH_SEEDS, EXPLORATORY = "not enough seeds", "exploratory"


def _out(a: np.ndarray):
    return a if a.ndim else str(a)


def interval_outcome(estimate, lower, upper, at_least: float):
    """An endpoint's outcome: pass if ``lower >= at_least``, fail if ``upper < at_least``, else (and with NaN in
    any of the three) not enough data. Arrays of any (equal) shape give an array of outcomes."""
    e, lo, hi = (np.asarray(x, dtype=np.float64) for x in (estimate, lower, upper))
    nan = np.isnan(e) | np.isnan(lo) | np.isnan(hi)
    passes, fails = lo >= at_least, hi < at_least
    return _out(np.where(nan | (passes & fails), NOT_ENOUGH, np.where(passes, PASS, np.where(fails, FAIL, NOT_ENOUGH))))


def guard_outcome(floor, baseline_lower, variant_upper, ratio_upper, mean_kept: float):
    """A task's guard (see the module notes) from the learning floor, the lower end of te's mean score, the upper
    end of QED's, and the upper end of QED's mean over te's; vectorised like :func:`interval_outcome`."""
    f, b, v, r = (np.asarray(x, dtype=np.float64) for x in (floor, baseline_lower, variant_upper, ratio_upper))
    te_unclear = np.isnan(f) | np.isnan(b) | (b < f)
    fails = (v < f) | (r < mean_kept)
    return _out(np.where(te_unclear, NOT_ENOUGH, np.where(fails, FAIL, np.where(np.isnan(r), NOT_ENOUGH, PASS))))


def combine(outcomes, any_pass: bool, axis: int = -1):
    """All must pass (``any_pass`` False: a variant's guards and endpoints) or one must (True: the claim over
    variants); a fail decides the first, all fails the second; otherwise (and with none) not enough data."""
    o = np.asarray(outcomes, dtype=str)
    if o.size == 0:
        return NOT_ENOUGH
    p, f = (o == PASS), (o == FAIL)
    if any_pass:
        got = np.where(p.any(axis), PASS, np.where(f.all(axis), FAIL, NOT_ENOUGH))
    else:
        got = np.where(f.any(axis), FAIL, np.where(p.all(axis), PASS, NOT_ENOUGH))
    return _out(got)


def decision_level(endpoints: Endpoints, n_judged: int) -> float:
    """The two-sided level of every interval that decides: Bonferroni over the ``n_judged`` variants."""
    return 1.0 - (1.0 - endpoints.decision_confidence) / max(1, n_judged)


def look_levels(endpoints: Endpoints, adaptive: AdaptiveSpec, n_judged: int) -> list[float]:
    """Per registered look, the two-sided level of every deciding interval: each variant's one-sided false-pass
    rate (1 - decision_confidence) / (2 m) (Bonferroni over the m judged variants) spent across the looks by
    ``adaptive.spending`` (:mod:`qed_ray.analysis.spending`); one look gives :func:`decision_level`."""
    from qed_ray.analysis.spending import nominal_levels  # scipy's root finding: only for an adaptive design

    alpha = (1.0 - endpoints.decision_confidence) / (2 * max(1, n_judged))
    return nominal_levels(adaptive.fractions(), alpha, adaptive.spending)


def departures(c: Comparison, block: ClaimBlock | None, final_eval: FinalEvalSpec,
               why_none: str = "no pre-registration named (spec field claim)") -> list[str]:
    """What in this comparison differs from the registered design (empty: it is the design); ``block`` None (the
    sweep names no claim file, ``why_none``) measures it against :func:`qed_ray.spec.claim.registered_design`."""
    out = [] if block else [why_none]
    block = block or registered_design()
    if (c.agent, c.baseline) != (block.agent, block.baseline) or c.variant not in block.variants:
        out.append(f"variant {c.agent} {c.variant} vs {c.baseline} is not among the pre-registered "
                   f"{block.agent} {', '.join(block.variants)} vs {block.baseline}")
    if sorted(c.tasks) != sorted(block.tasks):
        out.append(f"tasks: {len(set(c.tasks) & set(block.tasks))} of the {len(block.tasks)} pre-registered"
                   + (f" and {len(set(c.tasks) - set(block.tasks))} others" if set(c.tasks) - set(block.tasks) else ""))
    looks = block.adaptive.looks() if block.adaptive else [block.seeds]
    if c.n_seeds < looks[0] or (block.adaptive and c.n_seeds not in looks):
        out.append(f"seeds: {c.n_seeds} on some task (pre-registered {block.seeds}"
                   + (f", judged at the looks of {', '.join(map(str, looks))} seeds)" if block.adaptive else ")"))
    if c.env_steps == block.pilot_env_steps:
        out.append(f"pilot at {c.env_steps:,} env steps: read through the V curves only (docs/claim.md)")
    elif c.env_steps != block.env_steps:
        out.append(f"budget: {c.env_steps:,} env steps (pre-registered {block.env_steps:,})")
    if c.pairing != "paired":
        out.append(f"intervals {c.pairing} (pre-registered: paired over seeds)")
    if final_eval.episodes < block.final_episodes:
        out.append(f"final evaluation: {final_eval.episodes} episodes per seed (pre-registered {block.final_episodes})")
    policies = list(final_eval.policies)
    if policies[:1] != block.final_policies[:1] or set(block.final_policies) - set(policies):
        out.append(f"evaluation policies: {', '.join(final_eval.policies)} (pre-registered "
                   f"{', '.join(block.final_policies)}, the first read by the verdict)")
    if final_eval.confidence != block.confidence or final_eval.bootstrap_reps < block.bootstrap_reps:
        out.append(f"bootstrap: {100 * final_eval.confidence:g}% intervals from {final_eval.bootstrap_reps} "
                   f"resamples (pre-registered {100 * block.confidence:g}% from {block.bootstrap_reps})")
    return out


def endpoint_rules(endpoints: Endpoints, c: Comparison) -> tuple[str, str]:
    """The two endpoints' rules in words."""
    v, q = endpoints.v_ratio.lower_at_least, endpoints.iqm_kept.lower_at_least
    return (f"median over the tasks passing their guard of {c.baseline} V / {c.variant} V: pass if the interval's "
            f"lower end >= {v:g}; fail if its upper end < {v:g}",
            f"IQM {c.variant} / IQM {c.baseline} over the tasks where {c.baseline} learned: pass if the interval's "
            f"lower end >= {q:g}; fail if its upper end < {q:g}")


def _no_intervals(c: Comparison, endpoints: Endpoints) -> list[EndpointResult]:
    v_rule, q_rule = endpoint_rules(endpoints, c)
    why = f" ({c.n_seeds} on some task; an interval needs {MIN_SEEDS})"
    return [EndpointResult(f"V ratio >= {endpoints.v_ratio.lower_at_least:g}", NOT_ENOUGH_SEEDS,
                           c.V_ratio_median.value, math.nan, math.nan, v_rule + why),
            EndpointResult("IQM kept", NOT_ENOUGH_SEEDS, c.iqm_ratio.value, math.nan, math.nan, q_rule + why)]


Measure = Callable[..., tuple[list[TaskGuard], list[EndpointResult]]]


def judge_variant(c: Comparison, endpoints: Endpoints, n_at_cap: int, scope: list[str], level: float,
                  measure: Measure | None) -> VariantVerdict:
    """One comparison's guards and endpoints (``measure``: its guards and endpoint intervals at ``level``, None
    when a task has fewer than 3 seeds) and its outcome (``exploratory`` off the design)."""
    if measure is None:
        guards, results, level = [], _no_intervals(c, endpoints), math.nan
    else:
        guards, results = measure(level)
    outcome = EXPLORATORY if scope else combine([g.outcome for g in guards] + [r.outcome for r in results],
                                                any_pass=False)
    return VariantVerdict(c.agent, c.variant, c.baseline, outcome, c.pairing, c.n_tasks, n_at_cap, scope,
                          results, level, guards)


def _g(x: float) -> str:
    return "no estimate" if math.isnan(x) else f"{x:.3g}"


def _guard_line(g: TaskGuard, judged: bool) -> str:
    regime = f"; alpha {g.alpha_regime}" if g.alpha_regime else ""
    return f"    {g.task}: {f'guard {g.outcome} (' if judged else '('}{g.reason}{regime})"


def format_verdict(v: Verdict, confidence: float) -> str:
    """The verdict as the summary prints it: off the registered design, "not judged (exploratory: ...)" and the
    numbers without outcomes; never PASS or FAIL there."""
    source = (f"{v.claim_file} (claim block sha256 {v.claim_sha256[:12]})" if v.claim_file else
              "the registered design and thresholds of docs/claim.md (this sweep names no claim file)")
    lines = [f"verdict on the claim, by {source}; {v.correction or f'{100 * confidence:g}% intervals'}:"]
    for r in v.variants:
        head = f"  {r.agent} {r.variant} vs {r.baseline}"
        if r.scope:
            lines.append(f"{head}: not judged (exploratory: {'; '.join(r.scope)})")
        else:
            at = f", look {r.look} of the registered ones" if r.look else ""
            lines.append(f"{head}: {r.outcome.upper()}  ({r.n_tasks} tasks, intervals {r.pairing} at "
                         f"{100 * r.level:.4g}%{at})")
        for e in r.endpoints:
            said = "" if r.scope and e.outcome in (PASS, FAIL) else f"{e.outcome}  "
            ends = ("no interval" if math.isnan(e.lower) and math.isnan(e.upper) else
                    f"[{_g(e.lower)}, {_g(e.upper)}]")
            lines.append(f"    {e.name}: {said}{_g(e.estimate)} {ends}  ({e.rule})")
        lines += [_guard_line(g, not r.scope) for g in r.guards if not r.scope or g.outcome != PASS or g.alpha_regime]
        if r.n_tasks_at_cap:
            lines.append(f"    QED's alpha sat at its cap on most states late in training on {r.n_tasks_at_cap} of "
                         f"{r.n_tasks} tasks: there te is compared with an almost fixed alpha")
    if v.outcome == EXPLORATORY:
        lines.append(f"  the claim: not judged, {v.judged_over}")
    else:
        lines.append(f"  the claim: {v.outcome.upper()}, judged over {v.judged_over}; pass if some variant passes "
                     f"every guard and both endpoints, fail if every variant fails one")
    return "\n".join(lines)
