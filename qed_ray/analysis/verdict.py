"""The verdict on the paper's central claim, judged by the rules of the pre-registration (docs/claim.md), from a
sweep's te/QED comparisons (:mod:`qed_ray.analysis.comparisons`). Pure: no files, no Ray, no MLflow.

Per QED variant with a te baseline, two endpoints, each ``pass``, ``fail`` or ``not enough data``:

- "V ratio >= 10": the median over tasks of te V / QED V with its interval: *pass* if the median is >= 10 and the
  lower end is > 1; *fail* if the upper end is < 10; else not enough data (also when both rules hold at once,
  which a percentile interval that misses its own estimate allows).
- "IQM kept": IQM(QED) / IQM(te) with its interval: *pass* if the lower end is >= 0.95; *fail* if the upper end is
  < 0.95; else not enough data.

A variant passes when both endpoints pass and fails when either fails. The claim as a whole passes when some
variant passes, fails when every variant fails, and has not enough data otherwise; it is judged over the
pre-registered variants where the sweep runs the pre-registered design, else over every QED variant, and each
departure from the design is listed (``scope``): such a verdict is exploratory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from qed_ray.claim import ClaimBlock, Endpoints, IqmEndpoint, VRatioEndpoint
from qed_ray.codec import JsonRecord, Num
from qed_ray.naming import parse_variant

if TYPE_CHECKING:
    from qed_ray.analysis.results import Comparison, GroupResult
    from qed_ray.spec import FinalEvalSpec

PASS, FAIL, NOT_ENOUGH = "pass", "fail", "not enough data"


def v_ratio_outcome(estimate: float, lower: float, upper: float, rule: VRatioEndpoint = VRatioEndpoint()) -> str:
    """"V ratio >= 10" (see the module notes); NaN anywhere gives not enough data."""
    passes = estimate >= rule.at_least and lower > rule.lower_above
    fails = upper < rule.at_least
    return PASS if passes and not fails else FAIL if fails and not passes else NOT_ENOUGH


def iqm_outcome(lower: float, upper: float, rule: IqmEndpoint = IqmEndpoint()) -> str:
    """"IQM kept" (see the module notes); NaN anywhere gives not enough data."""
    passes, fails = lower >= rule.lower_at_least, upper < rule.lower_at_least
    return PASS if passes and not fails else FAIL if fails and not passes else NOT_ENOUGH


def combine(outcomes: Sequence[str], any_pass: bool) -> str:
    """All must pass (``any_pass`` False: a variant's endpoints) or one must (True: the claim over variants); a
    fail decides the first, all fails the second; otherwise not enough data."""
    if not outcomes:
        return NOT_ENOUGH
    if any_pass:
        return PASS if PASS in outcomes else FAIL if all(o == FAIL for o in outcomes) else NOT_ENOUGH
    return FAIL if FAIL in outcomes else PASS if all(o == PASS for o in outcomes) else NOT_ENOUGH


@dataclass(frozen=True)
class EndpointResult(JsonRecord):
    """One endpoint of one variant: its estimate and interval, the rule and the outcome."""

    name: str
    outcome: str
    estimate: Num
    lower: Num
    upper: Num
    rule: str


@dataclass(frozen=True)
class VariantVerdict(JsonRecord):
    """One QED variant against its te baseline; ``scope`` lists its departures from the pre-registered design
    (empty: pre-registered)."""

    agent: str
    variant: str
    baseline: str
    outcome: str
    pairing: str
    n_tasks: int
    n_tasks_at_cap: int
    scope: list[str]
    endpoints: list[EndpointResult]


@dataclass(frozen=True)
class Verdict(JsonRecord):
    """The claim's verdict: per variant and overall (``claim_file`` None: judged by the default thresholds)."""

    claim_file: str | None
    claim_sha256: str | None
    outcome: str
    judged_over: str
    variants: list[VariantVerdict] = field(default_factory=list)  # as JSON: gather/verdict.json


def _is_qed(label: str) -> bool:
    try:
        return parse_variant(label)["temperature"]["kind"] == "qed"
    except ValueError:
        return False


def departures(c: Comparison, block: ClaimBlock | None, final_eval: FinalEvalSpec) -> list[str]:
    """What in this comparison differs from the pre-registered design (empty: it is the design)."""
    if block is None:
        return ["no pre-registration named (spec field claim): the thresholds of docs/claim.md, read exploratively"]
    out = []
    if (c.agent, c.baseline) != (block.agent, block.baseline) or c.variant not in block.variants:
        out.append(f"variant {c.agent} {c.variant} vs {c.baseline} is not among the pre-registered "
                   f"{block.agent} {', '.join(block.variants)} vs {block.baseline}")
    if sorted(c.tasks) != sorted(block.tasks):
        out.append(f"tasks: {len(set(c.tasks) & set(block.tasks))} of the {len(block.tasks)} pre-registered"
                   + (f" and {len(set(c.tasks) - set(block.tasks))} others" if set(c.tasks) - set(block.tasks) else ""))
    if c.n_seeds < block.seeds:
        out.append(f"seeds: {c.n_seeds} on some task (pre-registered {block.seeds})")
    if c.env_steps == block.pilot_env_steps:
        out.append(f"pilot at {c.env_steps:,} env steps: read through the V curves only (docs/claim.md)")
    elif c.env_steps != block.env_steps:
        out.append(f"budget: {c.env_steps:,} env steps (pre-registered {block.env_steps:,})")
    if c.pairing != "paired":
        out.append(f"intervals {c.pairing} (pre-registered: paired over seeds)")
    if final_eval.confidence != block.confidence or final_eval.bootstrap_reps < block.bootstrap_reps:
        out.append(f"bootstrap: {100 * final_eval.confidence:g}% intervals from {final_eval.bootstrap_reps} "
                   f"resamples (pre-registered {100 * block.confidence:g}% from {block.bootstrap_reps})")
    return out


def judge_variant(c: Comparison, endpoints: Endpoints, n_at_cap: int, scope: list[str]) -> VariantVerdict:
    """Both endpoints of one comparison."""
    v, q = endpoints.v_ratio, endpoints.iqm_kept
    v_est = (c.V_ratio_median, c.V_ratio_median_ci_lower, c.V_ratio_median_ci_upper)
    q_est = (c.iqm_ratio, c.iqm_ratio_ci_lower, c.iqm_ratio_ci_upper)
    results = [
        EndpointResult(f"V ratio >= {v.at_least:g}", v_ratio_outcome(*v_est, v), *v_est,
                       f"median over tasks of {c.baseline} V / {c.variant} V: pass if >= {v.at_least:g} with the "
                       f"interval's lower end > {v.lower_above:g}; fail if its upper end < {v.at_least:g}"),
        EndpointResult("IQM kept", iqm_outcome(q_est[1], q_est[2], q), *q_est,
                       f"IQM {c.variant} / IQM {c.baseline}: pass if the interval's lower end >= "
                       f"{q.lower_at_least:g}; fail if its upper end < {q.lower_at_least:g}")]
    return VariantVerdict(c.agent, c.variant, c.baseline, combine([r.outcome for r in results], any_pass=False),
                          c.pairing, c.n_tasks, n_at_cap, scope, results)


def judge(comparisons: Sequence[Comparison], groups: Sequence[GroupResult], final_eval: FinalEvalSpec,
          claim: dict | None = None) -> Verdict | None:
    """The verdict over every QED variant with a te baseline (None if there is none).

    Args:
        comparisons: the sweep's comparisons (:func:`qed_ray.analysis.comparisons.compare`).
        groups: the sweep's groups (for the tasks where QED sat at its cap).
        final_eval: the bootstrap settings the intervals were drawn with.
        claim: ``sweep.json``'s claim record (``{"file", "sha256", "block"}``), or None.
    """
    block = ClaimBlock.model_validate(claim["block"]) if claim else None
    endpoints = block.endpoints if block else Endpoints()
    rows = [c for c in comparisons if c.baseline and _is_qed(c.variant)]
    if not rows:
        return None
    variants = [judge_variant(c, endpoints, sum(g.at_cap for g in groups if (g.agent, g.variant, g.task) in {
        (c.agent, c.variant, t) for t in c.tasks}), departures(c, block, final_eval)) for c in rows]
    registered = [v for v in variants if not v.scope]
    use = registered or variants
    over = "the pre-registered variants" if registered else "every QED variant (exploratory)"
    return Verdict(claim["file"] if claim else None, claim["sha256"] if claim else None,
                   combine([v.outcome for v in use], any_pass=True), over, variants)


def _g(x: float) -> str:
    return f"{x:.3g}"


def format_verdict(v: Verdict, confidence: float) -> str:
    """The verdict as the summary prints it."""
    source = (f"{v.claim_file} (claim block sha256 {v.claim_sha256[:12]})" if v.claim_file else
              "the default thresholds of docs/claim.md (this sweep names no claim file)")
    lines = [f"verdict on the claim, by {source}; {100 * confidence:g}% intervals:"]
    for r in v.variants:
        lines.append(f"  {r.agent} {r.variant} vs {r.baseline}: {r.outcome.upper()}  ({r.n_tasks} tasks, "
                     f"intervals {r.pairing}; {'pre-registered' if not r.scope else 'exploratory'})")
        for e in r.endpoints:
            lines.append(f"    {e.name}: {e.outcome}  {_g(e.estimate)} [{_g(e.lower)}, {_g(e.upper)}]  ({e.rule})")
        if r.n_tasks_at_cap:
            lines.append(f"    QED's alpha sat at its cap on most states late in training on {r.n_tasks_at_cap} of "
                         f"{r.n_tasks} tasks: there te is compared with an almost fixed alpha")
        lines += [f"    exploratory: {s}" for s in r.scope]
    lines.append(f"  the claim: {v.outcome.upper()}, judged over {v.judged_over}; pass if some variant passes both "
                 f"endpoints, fail if every variant fails one")
    return "\n".join(lines)
