"""A sweep's ``search:`` block: Optuna searches QED's k, and optionally alpha_max, per task and agent entry, te being
the fixed reference; every point grows the spec by one QED variant (:func:`grown`). The rule that picks k is part of
the spec, so it is stated before the search and frozen with the spec in ``sweep.json`` (docs/running.md)."""

from __future__ import annotations

import importlib.util
import math
from typing import Any, Literal, Sequence

from pydantic import Field, model_validator

from qed_ray.spec.config import K_MAX, Frozen
from qed_ray.spec.grid import grid_size

EXTRA = "search"  # pyproject's optional dependencies that install Optuna


class SearchSpec(Frozen):
    """What to search, how many trials per (task, agent entry), and the rule that chooses k afterwards."""

    trials: int = Field(ge=1, le=1000, description="suggested points per task and agent entry (each a pack of "
                                                   "the sweep's seeds)")
    k: tuple[float, float] = Field((0.05, 2.0), description="QED's k range [low, high], searched on a log scale")
    alpha_max: tuple[float, float] | None = Field(None, description="QED's alpha_max range [low, high] (log "
                                                                    "scale); none: the entry's QED default")
    sampler: Literal["tpe", "nsga2"] = Field("tpe", description="Optuna's multi-objective sampler over (IQM up, "
                                                                "V down): 'tpe' (MOTPE) or 'nsga2'")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="the sampler's seed")
    per_round: int = Field(1, ge=1, le=1000, description="points suggested at once per task and agent entry (a "
                           "round trains them together, then the searcher hears of them)")
    iqm_guard: float = Field(0.9, ge=0, le=10, description="the rule: a point is eligible when its IQM ratio to te "
                             "on its task has its interval's lower end at or above this; the chosen k is the "
                             "eligible point with the largest te/k V ratio")

    @model_validator(mode="before")
    @classmethod
    def _ranges(cls, data: Any) -> Any:
        if isinstance(data, dict):  # YAML gives lists; the frozen model keeps tuples
            data = {k: tuple(v) if k in ("k", "alpha_max") and isinstance(v, list) else v for k, v in data.items()}
        return data

    @model_validator(mode="after")
    def _ordered(self) -> "SearchSpec":
        for name, bounds, top in (("k", self.k, K_MAX), ("alpha_max", self.alpha_max, 1e6)):
            if bounds is not None and not 0 < bounds[0] < bounds[1] <= top:
                raise ValueError(f"{name}: [{bounds[0]:g}, {bounds[1]:g}] is no range; need 0 < low < high <= "
                                 f"{top:g}")
        return self

    def space(self) -> dict[str, tuple[float, float]]:
        return {"k": self.k, **({"alpha_max": self.alpha_max} if self.alpha_max else {})}

    def rule(self) -> str:
        """In words (printed at the start and with the result)."""
        return (f"chosen k per task and agent: among the points whose IQM ratio to te has its lower end >= "
                f"{self.iqm_guard:g}, the one with the largest te/k V ratio (exploratory: confirm it in a sweep)")


class SearchPoint(Frozen):
    """One suggested point: the agent entry (its index in ``agents``), the task and the settings."""

    entry: int = Field(ge=0)
    task: str
    k: float = Field(gt=0)
    alpha_max: float | None = Field(None, gt=0)

    @property
    def study(self) -> tuple[int, str]:
        return self.entry, self.task

    def temperature(self) -> dict[str, Any]:
        return {"kind": "qed", "k": self.k, **({"alpha_max": self.alpha_max} if self.alpha_max else {})}


def rounded(x: float) -> float:
    """A suggested value to 3 significant digits: the variant label stays short, and a re-suggested value names the
    same trials."""
    return float(f"{x:.3g}") if x > 0 and math.isfinite(x) else x


def studies(spec) -> list[tuple[int, str]]:
    return [(i, task) for i, e in enumerate(spec.agents) for task in (e.tasks or spec.tasks)]


def search_problems(spec) -> list[str]:
    """Why ``spec`` (a SweepSpec with a ``search:`` block) cannot be searched, one line each (field first)."""
    out = []
    if len(spec.seeds) < 2:
        out.append("search: each point's V is measured across its pack's seeds; need 2 or more seeds")
    if spec.pack.seeds == "auto" or spec.pack.seeds < len(spec.seeds) or spec.pack.by != "variant":
        out.append(f"pack: a searched point is one pack of the sweep's {len(spec.seeds)} seeds; set pack.seeds to "
                   f"{len(spec.seeds)} (or more) and pack.by to variant")
    with_te = {(e.name, repr(e.overrides), repr(spec.entry_train(e)), task) for e in spec.agents
               if any(t.kind == "te" for t in e.temperature_specs()) for task in e.tasks or spec.tasks}
    for i, e in enumerate(spec.agents):
        if grid_size(e.overrides) != 1 or grid_size(spec.entry_train(e)) != 1:
            out.append(f"agents.{i}: a searched entry has one setting per field (no list axes in overrides or train)")
        # A grown spec's point entries have no te of their own: their base entry's te, same settings and task, is it.
        if any((e.name, repr(e.overrides), repr(spec.entry_train(e)), task) not in with_te
               for task in e.tasks or spec.tasks):
            out.append(f"agents.{i}.temperatures: a search compares each point with te, the fixed reference; add "
                       f"{{kind: te}}")
    return out


def grown(spec, points: Sequence[SearchPoint]):
    """``spec`` with one more agent entry per searched (entry, task) holding its points' QED variants (the same
    settings and task, so each point's baseline is the entry's te)."""
    if not points:
        return spec
    raw = spec.model_dump(mode="json")
    extra = []
    for entry, task in dict.fromkeys(p.study for p in points):
        base = raw["agents"][entry]
        temps = [p.temperature() for p in points if p.study == (entry, task)]
        extra.append({**base, "tasks": [task], "temperatures": list({str(t): t for t in temps}.values())})
    return type(spec).model_validate({**raw, "agents": [*raw["agents"], *extra]})


def optuna_problem() -> str | None:
    """None when Optuna can be imported; else the one line that refuses a ``search:`` spec (naming the extra)."""
    try:
        found = importlib.util.find_spec("optuna") is not None
    except (ImportError, ValueError):  # a blocked or broken install (sys.modules['optuna'] = None)
        found = False
    return None if found else (f"search: needs Optuna, which is not installed; install the '{EXTRA}' extra: pip "
                               f"install -e '.[{EXTRA}]'")
