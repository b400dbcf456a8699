"""Seeds by looks: what an adaptive sweep does after each registered look (the rules: docs/claim.md, "Seeds by looks").

Every look's :class:`Look` (intervals, levels, decisions, the next seeds) is recorded, so the decision can be audited
and a restart resumes at the next look. Pure: no files, no Ray, no MLflow."""

from __future__ import annotations

import math

from qed_ray.analysis.results import EndpointResult, Row, Verdict
from qed_ray.analysis.verdict import EXPLORATORY, FAIL, NOT_ENOUGH, PASS, combine
from qed_ray.spec.claim import AdaptiveSpec
from qed_ray.records.codec import Num

GROW = "grow"
TE_UNLEARNED = "not enough data: te below its learning floor"


class LookVariant(Row):
    """One QED variant at one look: its seeds, the verdict's outcome there (None: frozen earlier, not judged
    again), the level and intervals used, and the decision: ``pass`` / ``fail`` (frozen), ``grow``, ``not enough
    data`` (the last look, or te below its floor) or ``exploratory``; ``decided_at``: the look of the decision."""

    variant: str
    seeds: int
    decision: str
    decided_at: int | None
    outcome: str | None = None
    level: Num = math.nan
    endpoints: list[EndpointResult] = []


class Look(Row):
    """One registered look (1-based ``look`` of ``looks``, the seeds of each): te's seeds, every variant's decision,
    the tasks where te's mean score is below its floor, the claim's outcome so far, the seeds of te and of each
    variant at the next look (``next_seeds`` empty: growth ended, ``ended`` says why)."""

    look: int
    looks: list[int]
    spending: str
    baseline: str
    baseline_seeds: int
    variants: list[LookVariant]
    te_below_floor: list[str]
    claim: str
    next_seeds: dict[str, int]
    ended: str = ""


def te_below_floor(verdict: Verdict) -> list[str]:
    """Tasks where te's mean score (the point estimate) is below its learning floor, from any judged variant's
    guards (te's numbers are the same in each)."""
    return sorted({g.task for v in verdict.variants if not v.scope for g in v.guards
                   if math.isfinite(g.floor) and math.isfinite(g.baseline_mean) and g.baseline_mean < g.floor})


def _decide(outcome: str, last: bool, te_stop: bool) -> str:
    if outcome == EXPLORATORY:
        return EXPLORATORY
    if outcome in (PASS, FAIL):
        return outcome
    return TE_UNLEARNED if te_stop else NOT_ENOUGH if last else GROW


def next_look(verdict: Verdict, adaptive: AdaptiveSpec, look: int, before: Look | None = None) -> Look:
    """The decisions after ``look`` (1-based) from that look's ``verdict`` over the groups at its seeds, and the
    previous look's record ``before`` (None at the first look: nothing frozen yet)."""
    looks = adaptive.looks()
    frozen = {v.variant: v for v in (before.variants if before else []) if v.decision != GROW}
    te_stop = bool(te_below_floor(verdict))
    last = look == len(looks)
    rows = []
    for v in verdict.variants:
        if v.variant in frozen:
            old = frozen[v.variant]
            rows.append(LookVariant(old.variant, old.seeds, old.decision, old.decided_at))
            continue
        decision = _decide(v.outcome, last, te_stop)
        rows.append(LookVariant(v.variant, looks[look - 1], decision,
                                None if decision in (GROW, EXPLORATORY) else look, v.outcome, v.level, v.endpoints))
    judged = [r.decision.split(":")[0] for r in rows if r.decision != EXPLORATORY]
    claim = combine([d if d in (PASS, FAIL) else NOT_ENOUGH for d in judged], any_pass=True) if judged else EXPLORATORY
    growing = [r for r in rows if r.decision in (GROW, EXPLORATORY)]
    ended = ("te's mean score is below its learning floor on " + ", ".join(te_below_floor(verdict))
             + ": not enough data" if te_stop else
             f"the claim is decided ({claim})" if claim in (PASS, FAIL) else
             f"the last registered look ({looks[-1]} seeds)" if last else
             "" if growing or not rows else "every variant is decided")
    base = verdict.variants[0].baseline if verdict.variants else "te"
    if ended:  # a variant still growing is undecided where growth ends
        stop = TE_UNLEARNED if te_stop else NOT_ENOUGH
        rows = [r.model_copy(update={"decision": stop, "decided_at": look}) if r.decision == GROW else r for r in rows]
        nxt = {}
    else:
        nxt = {base: looks[look], **{r.variant: looks[look] if r in growing else r.seeds for r in rows}}
    return Look(look, looks, adaptive.spending, base, looks[look - 1], rows, te_below_floor(verdict), claim, nxt,
                ended)


def bias_note(look: Look) -> str:
    """What the summary says beside the estimates of a sequential verdict."""
    early = look.look < len(look.looks)
    return (f"estimates at the stopping look ({look.look} of {len(look.looks)}, {look.baseline_seeds} seeds of "
            f"{look.looks[-1]}); " + ("a design stopped early for a crossed boundary reports estimates biased away "
                                      "from the threshold (further from it than the truth, on average); no "
                                      "bias-adjusted estimate is given" if early else
                                      "the maximum was reached, so the estimates carry no early-stopping bias "
                                      "beyond the fixed design's"))
