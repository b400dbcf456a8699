"""One (task, agent, variant) group as it lands: its cross-seed numbers with intervals over its seeds and, where its
target-entropy baseline on the same task has landed too, its ratios against that baseline on this one task."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from qed_ray.analysis import bootstrap, comparisons
from qed_ray.analysis.report import with_ci
from qed_ray.analysis.results import Comparison, GroupKey, GroupResult
from qed_ray.analysis.tables import baseline_of
from qed_ray.spec.sweep import FinalEvalSpec

# (metric name, Comparison field): te / variant for the spreads, variant / te for the IQM (> 1 favours the variant).
RATIOS = (("te_V_ratio", "V_ratio_median"), ("te_action_distance_ratio", "action_distance_ratio_median"),
          ("te_return_variance_ratio", "score_var_ratio_median"), ("IQM_ratio", "iqm_ratio"))


@dataclass(frozen=True)
class GroupView:
    """A landed group's numbers: ``values`` maps each statistic to ``(point, lower, upper)`` (NaN: undefined);
    ``baseline`` is its te variant on the same task when that group has landed ("" otherwise, and for te itself),
    ``ratios`` then maps each :data:`RATIOS` name to ``(point, lower, upper)``; ``alpha_regime`` is the group's
    :attr:`~qed_ray.analysis.results.GroupResult.alpha_regime` (None: no estimate)."""

    key: GroupKey
    n_seeds: int
    values: dict[str, tuple[float, float, float]]
    alpha_frac_floor_late: float
    alpha_frac_cap_late: float
    baseline: str = ""
    ratios: dict[str, tuple[float, float, float]] | None = None
    alpha_regime: str | None = None

    def metrics(self) -> dict[str, float]:
        """The group run's metrics: ``V``, ``IQM``, ``action_distance``, ``return_variance`` with ``_ci_lower`` and
        ``_ci_upper``, the late alpha shares, ``n_seeds`` and the ratios to te with their intervals; finite ones only."""
        out: dict[str, float] = {"n_seeds": float(self.n_seeds), "alpha_frac_floor_late": self.alpha_frac_floor_late,
                                 "alpha_frac_cap_late": self.alpha_frac_cap_late}
        for name, triple in {**self.values, **(self.ratios or {})}.items():
            out.update({name: triple[0], f"{name}_ci_lower": triple[1], f"{name}_ci_upper": triple[2]})
        return {k: float(v) for k, v in out.items() if math.isfinite(v)}

    def line(self, confidence: float, verb: str = "gathered") -> str:
        """``gathered cartpole-balance/sac_ln/qed0.2 (3 seeds): V 0.12 [0.1, 0.2]  IQM 0.8 [0.7, 0.9]  te V / V 4.1
        [2.8, 5.8]  IQM / te IQM 1.02 [0.97, 1.1]`` (intervals at ``confidence``)."""
        v, iqm = self.values["V"], self.values["IQM"]
        text = (f"{verb} {self.key.name} ({self.n_seeds} seed{'s' if self.n_seeds != 1 else ''}, "
                f"{100 * confidence:g}% CI): V {with_ci(*v)}  IQM {with_ci(*iqm)}")
        if self.ratios is not None:
            text += (f"  te V / V {with_ci(*self.ratios['te_V_ratio'])}  IQM / te IQM "
                     f"{with_ci(*self.ratios['IQM_ratio'])}")
        return text


def _ci(reps: np.ndarray | None, point: float, confidence: float) -> tuple[float, float, float]:
    if reps is None or not math.isfinite(point):
        return math.nan, math.nan, math.nan
    return (point, *bootstrap.percentile_interval(reps, confidence))


def group_view(g: GroupResult, groups: Sequence[GroupResult], final_eval: FinalEvalSpec) -> GroupView:
    """The view of ``g`` among the landed ``groups`` (its baseline is looked for among those of its task and agent)."""
    fe, reps = final_eval, comparisons.Replicates(final_eval)
    iqm = bootstrap.iqm_interval([np.asarray(g.scores, dtype=np.float64)], fe.bootstrap_reps, fe.confidence, fe.seed)
    values = {"V": _ci(reps.get("V", g), float(g.V), fe.confidence),
              "IQM": (iqm["point"], iqm["lower"], iqm["upper"]),
              "action_distance": _ci(reps.get("action_distance", g), float(g.action_distance), fe.confidence),
              "return_variance": _ci(reps.get("score_var", g), comparisons.group_value("score_var", g),
                                     fe.confidence)}
    base = baseline_in(g, groups)
    c = comparisons.compare([next(o for o in groups if o.key == (g.task, g.agent, base))], [g], fe, reps.get) \
        if base else None
    return GroupView(g.key, len(g.seeds), values, float(g.alpha_frac_floor_late), float(g.alpha_frac_cap_late),
                     base, _ratios(c) if c is not None else None, g.alpha_regime)


def baseline_in(g: GroupResult, groups: Sequence[GroupResult]) -> str:
    """``g``'s te variant if its group on ``g``'s task is among ``groups`` ("" if not, and for a te group)."""
    return baseline_of(g, [o.variant for o in groups if (o.task, o.agent) == (g.task, g.agent)])


def _ratios(c: Comparison) -> dict[str, tuple[float, float, float]]:
    return {name: getattr(c, f).astuple() for name, f in RATIOS}


def variants_of_baseline(g: GroupResult, groups: Sequence[GroupResult]) -> list[GroupResult]:
    """The landed groups of ``g``'s task and agent whose baseline is ``g`` (empty unless ``g`` is a te group)."""
    same = [o for o in groups if (o.task, o.agent) == (g.task, g.agent)]
    return [o for o in same if o.variant != g.variant and baseline_of(o, [x.variant for x in same]) == g.variant]
