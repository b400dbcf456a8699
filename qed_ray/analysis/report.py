"""The sweep's summary as a researcher reads it, without the code: the table (te first, then its variants) with a
two-line legend, each variant against te, and the claim's verdict; as plain text (the sweep's closing summary,
``--status``, ``python -m qed_ray.gather``) and as markdown (the MLflow run's description). Pure text from
:class:`~qed_ray.analysis.results.SweepResults`: no files, no MLflow."""

from __future__ import annotations

import math
from typing import Sequence

from qed_ray.analysis import metrics, verdict
from qed_ray.spec.config import HOT_RATIO
from qed_ray.analysis.results import Aggregate, Comparison, GroupResult, SweepResults
from qed_ray.spec.console import fit
from qed_ray.records.layout import SweepDir
from qed_ray.records.digests import unverified_reasons

NAMES = ("agent", "variant", "flags")  # left-aligned columns; the others are numbers, right-aligned
DASH = "-"


def _g(v: float) -> str:
    return f"{v:.3g}"


def with_ci(point: float, lower: float, upper: float) -> str:
    """``point [lower, upper]`` to 3 significant digits, or ``-`` when any of them is undefined (NaN)."""
    if not all(math.isfinite(x) for x in (point, lower, upper)):
        return DASH
    return f"{_g(point)} [{_g(lower)}, {_g(upper)}]"


def _share(x: float) -> str:
    return f"{100 * x:.0f}%" if math.isfinite(x) else DASH


def baselines(results: SweepResults) -> set[tuple[str, str]]:
    """The (agent, variant) of every te baseline among the results' groups (``te``, ``te+hidden=512``)."""
    return {(g.agent, g.variant) for g in results.groups if g.is_baseline}


def ordered(aggregates: Sequence[Aggregate], base: set[tuple[str, str]]) -> list[Aggregate]:
    """The table's rows: per agent, its te baselines (``base``) first, then the others; names sorted within."""
    return sorted(aggregates, key=lambda a: (a.agent, (a.agent, a.variant) not in base, a.variant))


def headers(confidence: float) -> list[str]:
    """The table's column headers (the legend explains the units and directions)."""
    ci = f"[{100 * confidence:g}% CI]"
    return ["agent", "variant", "tasks", "seeds used", "seeds left out", f"IQM {ci}", f"V {ci}",
            f"te V / V {ci}", f"IQM / te IQM {ci}", f"action distance {ci}", "alpha at floor / cap", "flags"]


def flags(a: Aggregate, c: Comparison | None, is_baseline: bool) -> str:
    """What a reader must know before trusting the row: the baseline, unpaired intervals, ratios over fewer
    tasks, QED at its cap (then te is compared with an almost fixed alpha), too few seeds for V."""
    out = []
    if is_baseline:
        out.append("baseline")
    elif c is None:
        out.append("no te baseline: no ratios")
    else:
        if c.pairing != "paired":
            out.append(f"intervals {c.pairing}")
        if c.n_tasks < a.n_tasks:
            out.append(f"ratios over {c.n_tasks} of {a.n_tasks} tasks")
        if c.n_tasks_V < c.n_tasks:
            out.append(f"V ratio over {c.n_tasks_V} of {c.n_tasks} tasks")
    if a.n_tasks_at_cap:
        out.append(f"QED AT ITS CAP on {a.n_tasks_at_cap} of {a.n_tasks} tasks")
    if a.n_tasks_hot:
        out.append(f"QED HOT (alpha >= {HOT_RATIO:g} x alpha_TE) on {a.n_tasks_hot} of {a.n_tasks} tasks")
    if a.n_seeds < 2:
        out.append("a task with 1 seed: no V there")
    return "; ".join(out)


def rows(results: SweepResults) -> list[list[str]]:
    """The table's cells, one row per (agent, variant) in :func:`ordered` order."""
    comps, base = {(c.agent, c.variant): c for c in results.comparisons}, baselines(results)
    out = []
    for a in ordered(results.aggregates, base):
        c, is_base = comps.get((a.agent, a.variant)), (a.agent, a.variant) in base
        v_ratio = with_ci(*c.V_ratio_median.astuple()) if c else DASH
        iqm_ratio = with_ci(*c.iqm_ratio.astuple()) if c else DASH
        at = DASH if is_base or not math.isfinite(a.alpha_frac_cap_late) else \
            f"{_share(a.alpha_frac_floor_late)} / {_share(a.alpha_frac_cap_late)}"
        out.append([a.agent, a.variant, str(a.n_tasks), str(a.n_runs), str(a.n_failed),
                    with_ci(a.iqm, a.ci_lower, a.ci_upper), with_ci(a.V_mean, a.V_mean_ci_lower, a.V_mean_ci_upper),
                    v_ratio, iqm_ratio,
                    with_ci(a.action_distance_mean, a.action_distance_ci_lower, a.action_distance_ci_upper), at,
                    flags(a, c, is_base)])
    return out


def legend(results: SweepResults) -> list[str]:
    """Two lines under the table: units and which direction is better; the ratios, alpha and a left-out seed."""
    steps = results.final_eval.action_steps
    return [f"IQM: interquartile mean of final return / 1000 (0 to 1, higher is better). V: mean KL between two "
            f"seeds' policies; action distance: L2 between their actions summed over {steps} steps (lower: seeds "
            f"agree).",
            "Ratios > 1 favour the variant over its te (V: median over tasks). alpha at floor / cap: QED's share of "
            f"states at te's alpha / at alpha_max, last quarter (HOT: >= {HOT_RATIO:g} x alpha_TE on most). Seeds "
            "left out (failed, diverged, unfinished, refused) count in no statistic."]


def column_blocks(widths: Sequence[int], columns: int | None, keys: int = 2) -> list[list[int]]:
    """The table's columns split into blocks that fit ``columns`` characters (two between cells), each block led by
    the first ``keys`` columns (which rows they are); one block when ``columns`` is None or everything fits."""
    rest = list(range(keys, len(widths)))
    if columns is None or sum(widths) + 2 * (len(widths) - 1) <= columns:
        return [list(range(len(widths)))]
    lead = sum(widths[:keys]) + 2 * keys
    blocks: list[list[int]] = []
    for i in rest:
        if blocks and lead + sum(widths[j] + 2 for j in blocks[-1][keys:]) + widths[i] <= columns:
            blocks[-1].append(i)
        else:
            blocks.append([*range(keys), i])
    return blocks


def format_table(results: SweepResults, columns: int | None = None) -> str:
    """The summary table as text (columns padded to their widest cell), then its legend; with ``columns``, the
    table is split into blocks of columns that fit that width (agent and variant leading each) and the legend
    wrapped to it."""
    table = [headers(results.final_eval.confidence), *rows(results)]
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    names = [h in NAMES for h in table[0]]
    lines: list[str] = []
    for block in column_blocks(widths, columns):
        lines += [""] if lines else []
        lines += ["  ".join(r[i].ljust(widths[i]) if names[i] else r[i].rjust(widths[i]) for i in block).rstrip()
                  for r in table]
    return "\n".join(lines + [fit(line, columns) if columns else line for line in legend(results)])


def format_comparisons(results: SweepResults) -> str:
    """Each variant against its te baseline: the ratios summarised three ways over tasks with their intervals
    (``comparisons.csv``), the IQM ratio, and where QED sat late in training (``groups.csv``)."""
    ci = f"{100 * results.final_eval.confidence:g}% CI"
    aggs = {(a.agent, a.variant): a for a in results.aggregates}
    lines = [f"te / variant ratios over tasks (> 1: the variant varies less), [{ci}]: median | geometric mean | "
             f"ratio of task means"]
    for c in results.comparisons:
        lines.append(f"{c.agent} {c.variant} vs {c.baseline} ({c.n_tasks} tasks, {c.n_seeds}+ seeds, intervals "
                     f"{c.pairing}):")
        for stat, name in (("V", "V"), ("action_distance", "action distance"), ("score_var", "return variance")):
            parts = [with_ci(*getattr(c, f"{stat}_ratio_{s}").astuple()) for s in metrics.RATIO_SUMMARIES]
            lines.append(f"  {name:16s} {' | '.join(parts)}")
        lines.append(f"  {'IQM this / te':16s} {with_ci(*c.iqm_ratio.astuple())}")
        lines.append(f"  {'P(this > te)':16s} {with_ci(*c.prob_improvement.astuple())} "
                     f"(a run of this variant scores above one of te on the same task; 0.5: neither)")
        a = aggs.get((c.agent, c.variant))
        if a is not None and math.isfinite(a.alpha_frac_cap_late):
            at_cap = [g.task for g in results.groups if (g.agent, g.variant) == (c.agent, c.variant) and g.at_cap]
            lines.append(f"  where QED sat, last quarter of training (mean over tasks): at the floor "
                         f"{_g(a.alpha_frac_floor_late)}, at the cap {_g(a.alpha_frac_cap_late)} of actor-update "
                         f"states; log-std within 0.1 of its bound {_g(a.log_std_at_min)}; AT ITS CAP on "
                         f"{len(at_cap)} of {a.n_tasks} tasks{': ' + ', '.join(at_cap) if at_cap else ''}")
            lines += how_hot(results, c.agent, c.variant)
    return "\n".join(lines)


REGIME_TEXT = {"at_cap": "AT ITS CAP", "hot": "HOT", "ok": "ok", None: "no estimate"}


def how_hot(results: SweepResults, agent: str, variant: str) -> list[str]:
    """Per task of a QED variant, late in training: mean alpha / alpha_TE, the share of states at least HOT_RATIO
    times alpha_TE, the policy-entropy gap to te, and the group's ``alpha_regime``."""
    stats = {(s.task, s.agent, s.variant): s for s in results.group_stats}
    out = []
    for g in sorted(results.groups, key=lambda g: g.task):
        s = stats.get(g.key)
        if (g.agent, g.variant) != (agent, variant) or s is None or not math.isfinite(g.alpha_frac_cap_late):
            continue
        gap = f"{s.entropy_gap_late:+.3g}" if math.isfinite(s.entropy_gap_late) else DASH
        out.append(f"    {g.task}: alpha / alpha_TE {_g(g.alpha_ratio_late)}, at least {HOT_RATIO:g} x alpha_TE on "
                   f"{_share(g.alpha_frac_hot_late)} of states, at the cap on {_share(g.alpha_frac_cap_late)}; "
                   f"policy entropy minus te's {gap} nats: {REGIME_TEXT[g.alpha_regime]}")
    return out


def unverified_line(groups: Sequence[GroupResult], layout: SweepDir | None = None) -> str | None:
    """How many of the groups' seeds were used unchecked, and which (None: every seed was checked); with the sweep
    folder ``layout`` (seeds checked against MLflow, so each unverified one lacks its digest there), grouped by
    the reason each trial's ``DONE.json`` gives (:func:`~qed_ray.records.digests.unverified_reason`)."""
    seeds = [(g.key.name, s) for g in sorted(groups, key=lambda g: g.key) for s in g.unverified_seeds]
    if not seeds:
        return None
    reasons = unverified_reasons(layout, [f"{k}/{s}" for k, s in seeds]) if layout is not None else {}
    by_reason: dict[str, dict[str, list[int]]] = {}
    for key, seed in seeds:
        by_reason.setdefault(reasons.get(f"{key}/{seed}", ""), {}).setdefault(key, []).append(seed)
    found = [(f"{why}: " if why else "") + "; ".join(f"{k} seed{'s' if len(v) > 1 else ''} {', '.join(map(str, v))}"
                                                      for k, v in keys.items()) for why, keys in by_reason.items()]
    total = sum(len(g.seeds) for g in groups)
    why = "no signed digest of their files in MLflow" if layout is not None else \
        "not checked, or no signed digest of their files in MLflow: the reason is on each run's qed.unverified tag"
    return f"UNVERIFIED: {len(seeds)} of {total} seeds were used without a check ({why}): {'; '.join(found)}"


def summary(results: SweepResults, layout: SweepDir | None = None, columns: int | None = None) -> str:
    """What the sweep's summary and ``python -m qed_ray.gather`` print: the table, the unverified seeds (with their
    reasons, given the sweep folder whose seeds were checked: :func:`unverified_line`), the comparisons, the
    verdict; with ``columns``, no line wider than that (:func:`format_table`, :func:`qed_ray.spec.console.fit`)."""
    parts = [format_table(results, columns)]
    unverified = unverified_line(results.groups, layout)
    if unverified:
        parts.append(unverified)
    if results.comparisons:
        parts.append(format_comparisons(results))
    if results.verdict is not None:
        parts.append(verdict.format_verdict(results.verdict, results.final_eval.confidence))
    text = "\n\n".join(parts)
    return fit(text, columns) if columns else text


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|") or " "


def summary_markdown(results: SweepResults, heading: str, footer: str = "", lead: str = "") -> str:
    """The summary as markdown (an MLflow run's description): ``heading``, ``lead`` (a line shown before the page
    folds the description), what the tables rest on, the table and its legend, the claim's verdict per variant,
    then ``footer``."""
    fe = results.final_eval
    left_out = len([f for f in results.failed_trials if f.group is not None])
    lines = [f"### {heading}", "", *([lead, ""] if lead else []),
             f"{len(results.groups)} groups on {len({g.task for g in results.groups})} tasks; {left_out} of "
             f"{results.n_trials} trials left out. Final evaluation: {fe.episodes} episodes per seed, policy "
             f"`{results.policy}`; intervals: {100 * fe.confidence:g}% bootstrap over seeds, {fe.bootstrap_reps:,} "
             f"resamples.", ""]
    table = [headers(fe.confidence), *rows(results)]
    lines += ["| " + " | ".join(map(_md_cell, r)) + " |" for r in table[:1]]
    lines.append("|" + "|".join(":---" if h in NAMES else "---:" for h in table[0]) + "|")
    lines += ["| " + " | ".join(map(_md_cell, r)) + " |" for r in table[1:]]
    lines += [""] + [f"*{line}*  " for line in legend(results)]
    unverified = unverified_line(results.groups)
    if unverified:
        lines += ["", f"**{unverified}**"]
    v = results.verdict
    if v is not None:
        head = ("not judged" if v.outcome == verdict.EXPLORATORY else v.outcome.upper())
        lines += ["", f"**Verdict on the claim: {head}** (by "
                      f"{v.claim_file or 'the registered design of docs/claim.md'}), judged over {v.judged_over}:"]
        for r in v.variants:
            ends = "; ".join(f"{e.name}: {'' if r.scope else e.outcome + ' '}{with_ci(e.estimate, e.lower, e.upper)}"
                             for e in r.endpoints)
            said = f"not judged (exploratory: {'; '.join(r.scope)})" if r.scope else f"**{r.outcome.upper()}**"
            lines.append(f"- {r.agent} {r.variant} vs {r.baseline}: {said} ({ends})")
    return "\n".join(lines + (["", footer] if footer else []))
