"""The result of a k search (:mod:`qed_ray.spec.search`): per task and agent, every searched point's IQM and within-pack
V, its paired ratios to te with intervals, the Pareto front of (IQM up, V down), and the k the pre-stated rule
chooses, as a table, a figure and a spec fragment for a confirmatory sweep. A search is exploratory: nothing here is
a verdict."""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import yaml

from qed_ray.analysis import comparisons, metrics
from qed_ray.analysis.results import GroupKey, GroupResult, Row, csv_row
from qed_ray.spec.claim import MIN_SEEDS
from qed_ray.records.atomic import atomic_file, write_text
from qed_ray.records.codec import Num
from qed_ray.spec.sweep import FinalEvalSpec

NAN = math.nan
EXPLORATORY = ("exploratory search: the front and the chosen k suggest what a confirmatory sweep should test; "
               "no verdict is judged on them")


@dataclass(frozen=True)
class SearchedPoint:
    """What the front needs of one suggested point: its group, its settings, and its agent entry (``name``,
    ``overrides``, ``train``) for the spec fragment."""

    task: str
    agent: str
    variant: str
    k: float
    alpha_max: float | None
    entry: dict[str, Any]


class FrontRow(Row):
    """One searched point (``front.csv``): IQM and within-pack V of its seeds, te/point V ratio and point/te IQM ratio
    with percentile intervals (``pairing``: over shared seeds or not), whether it is on its task's Pareto front,
    whether its IQM guard holds (the interval's lower end >= the guard; False when undefined), and whether the rule
    chose it."""

    task: str
    agent: str
    variant: str
    k: Num
    alpha_max: Num
    n_seeds: int
    iqm: Num
    V: Num
    V_ratio: Num
    V_ratio_ci_lower: Num
    V_ratio_ci_upper: Num
    iqm_ratio: Num
    iqm_ratio_ci_lower: Num
    iqm_ratio_ci_upper: Num
    pairing: str
    on_front: bool
    guard_holds: bool
    chosen: bool


def pareto(points: Sequence[tuple[float, float]]) -> list[bool]:
    """Per (iqm, V) point, whether no other point has IQM >= and V <= with one of them strict; a point with a NaN is
    never on the front."""
    ok = [math.isfinite(i) and math.isfinite(v) for i, v in points]
    out = []
    for a, (i, v) in enumerate(points):
        out.append(ok[a] and not any(ok[b] and b != a and points[b][0] >= i and points[b][1] <= v
                                     and (points[b][0] > i or points[b][1] < v) for b in range(len(points))))
    return out


def choose(rows: Sequence[FrontRow]) -> FrontRow | None:
    """The rule: among the rows whose guard holds and whose V ratio is defined, the largest te/point V ratio."""
    eligible = [r for r in rows if r.guard_holds and math.isfinite(r.V_ratio)]
    return max(eligible, key=lambda r: r.V_ratio) if eligible else None


def front_rows(groups: Sequence[GroupResult], points: Sequence[SearchedPoint], final_eval: FinalEvalSpec,
               iqm_guard: float, baseline: str = "te") -> list[FrontRow]:
    """Every gathered point, by task and agent in k order; a point whose group or te group is not gathered is left out
    (it has no numbers yet)."""
    by_key = {g.key: g for g in groups}
    reps = comparisons.Replicates(final_eval)
    out: list[FrontRow] = []
    for study in dict.fromkeys((p.task, p.agent) for p in points):
        base = by_key.get(GroupKey(*study, baseline))
        found = [(p, by_key[GroupKey(p.task, p.agent, p.variant)]) for p in points if (p.task, p.agent) == study
                 and GroupKey(p.task, p.agent, p.variant) in by_key]
        if base is None or not found:
            continue
        found.sort(key=lambda pg: (pg[0].k, pg[0].alpha_max or 0))
        rows = []
        for p, g in found:
            c = comparisons.compare([base], [g], final_eval, reps.get)
            # Fewer than MIN_SEEDS seeds give no interval (every resample of distinct seeds is the same pair):
            # the ends are unknown, so the guard is not judged and the rule cannot choose the point.
            few = c.n_seeds < MIN_SEEDS
            v_ci = (NAN, NAN) if few else (c.V_ratio_means.lower, c.V_ratio_means.upper)
            iqm_ci = (NAN, NAN) if few else (c.iqm_ratio.lower, c.iqm_ratio.upper)
            guard = math.isfinite(iqm_ci[0]) and iqm_ci[0] >= iqm_guard
            rows.append(FrontRow(p.task, p.agent, p.variant, p.k, NAN if p.alpha_max is None else p.alpha_max,
                                 c.n_seeds, metrics.iqm(np.asarray(g.scores, dtype=float)[:, None]), g.V,
                                 c.V_ratio_means.value, *v_ci, c.iqm_ratio.value, *iqm_ci, c.pairing, False, guard,
                                 False))
        front = pareto([(r.iqm, r.V) for r in rows])
        best = choose(rows)
        out += [r.model_copy(update={"on_front": f, "chosen": r is best}) for r, f in zip(rows, front)]
    return out


def _ci(point: float, lo: float, hi: float, n_seeds: int) -> str:
    if not math.isfinite(point):
        return "no estimate"
    if n_seeds < MIN_SEEDS:
        return f"{point:.3g} [not enough seeds: {n_seeds}, an interval needs {MIN_SEEDS}]"
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return f"{point:.3g} [no interval]"
    return f"{point:.3g} [{lo:.3g}, {hi:.3g}]"


def _guard(r: FrontRow) -> str:
    if r.guard_holds:
        return "holds"
    return "not judged" if not math.isfinite(r.iqm_ratio_ci_lower) else "fails"


def table_lines(rows: Sequence[FrontRow], confidence: float) -> list[str]:
    """The table as Markdown: one line per point, intervals at ``confidence``."""
    pct = f"{100 * confidence:g}%"
    head = ["task", "agent", "variant", "k", "IQM", "V", f"te/k V ratio [{pct}]", f"k/te IQM ratio [{pct}]",
            "pairing", "front", "guard", "chosen"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.task, r.agent, r.variant, f"{r.k:g}", f"{r.iqm:.3g}", f"{r.V:.3g}" if math.isfinite(r.V) else
                 "no estimate", _ci(r.V_ratio, r.V_ratio_ci_lower, r.V_ratio_ci_upper, r.n_seeds),
                 _ci(r.iqm_ratio, r.iqm_ratio_ci_lower, r.iqm_ratio_ci_upper, r.n_seeds), r.pairing,
                 "yes" if r.on_front else "", _guard(r), "**chosen**" if r.chosen else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def fragment(rows: Sequence[FrontRow], points: Sequence[SearchedPoint], sweep: str, rule: str) -> str:
    """The chosen k as a spec fragment for a confirmatory sweep's ``agents:`` (te and the chosen QED per task and
    agent); a task and agent without a chosen point is named in a comment."""
    entry = {(p.task, p.agent, p.variant): p.entry for p in points}
    agents, none = [], []
    for study in dict.fromkeys((r.task, r.agent) for r in rows):
        best = next((r for r in rows if (r.task, r.agent) == study and r.chosen), None)
        if best is None:
            none.append("/".join(study))
            continue
        temp = {"kind": "qed", "k": best.k, **({"alpha_max": best.alpha_max} if math.isfinite(best.alpha_max) else {})}
        e = entry[(best.task, best.agent, best.variant)]
        agents.append({"name": e["name"], "tasks": [best.task], **({"overrides": e["overrides"]} if e["overrides"]
                       else {}), **({"train": e["train"]} if e.get("train") else {}),
                       "temperatures": [{"kind": "te"}, temp]})
    head = [f"# From the k search of sweep {sweep} (exploratory; confirm it in a sweep with its own seeds).",
            f"# Rule, stated before the search: {rule}."]
    head += [f"# Nothing chosen on {s}: no point's IQM guard held (or none could be judged)." for s in none]
    body = yaml.safe_dump({"agents": agents}, sort_keys=False) if agents else "agents: []  # nothing chosen\n"
    return "\n".join(head) + "\n" + body


def write(rows: Sequence[FrontRow], points: Sequence[SearchedPoint], out: Path, sweep: str, rule: str,
          confidence: float) -> list[Path]:
    """``front.csv``, ``front.md`` (the table with intervals), ``fragment.yaml`` and ``front.png`` (with an SVG) in
    ``out``, each replaced atomically; returns their paths."""
    from qed_ray.analysis import plots

    out.mkdir(parents=True, exist_ok=True)
    with atomic_file(out / "front.csv") as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(FrontRow.model_fields))
        w.writeheader()
        w.writerows(csv_row(r) for r in rows)
    write_text(out / "front.md", "\n".join([f"# k search of sweep {sweep}", "", EXPLORATORY + ".", "",
                                            f"Rule, stated before the search: {rule}.", "",
                                            *table_lines(rows, confidence), ""]))
    write_text(out / "fragment.yaml", fragment(rows, points, sweep, rule))
    png = plots.save(plots.search_front(rows, f"k search of {sweep}: IQM against V per searched k (Pareto front of "
                                          f"IQM up, V down)", EXPLORATORY + "."), out / "front.png")
    return [out / "front.csv", out / "front.md", out / "fragment.yaml", png]
