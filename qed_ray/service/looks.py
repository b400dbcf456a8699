"""An adaptive sweep (``adaptive:`` in its spec) run look by look through the ordinary growth path (docs/claim.md,
"Growth and records"): each look is one start over :meth:`~qed_ray.spec.sweep.SweepSpec.at_look`, a frozen variant
at the seeds it was decided at (te's count for a variant the verdict does not judge, such as a control)."""

from __future__ import annotations

from typing import Callable

from qed_ray.analysis.sequential import Look, bias_note, next_look
from qed_ray.analysis.results import Verdict
from qed_ray.analysis.verdict import EXPLORATORY
from qed_ray.records.codec import Record, RecordError, read_record, write_record
from qed_ray.records.layout import SweepDir
from qed_ray.spec.sweep import SpecError, SweepSpec

Start = Callable[[SweepSpec], int]  # one start of the sweep over a look's spec; its exit code


def read_looks(layout: SweepDir) -> list[Look]:
    if not layout.looks_file.exists():
        return []
    return read_record(layout.looks_file, list[Look])


def check_design(spec: SweepSpec, looks: list[Look]) -> None:
    """Refuses (SpecError naming ``adaptive``) a design that differs from the one the recorded looks ran."""
    if not looks:
        return
    a = spec.adaptive
    now = (a.looks(), a.spending) if a else None
    if now != (looks[0].looks, looks[0].spending):
        raise SpecError(f"adaptive: this sweep's looks were fixed at {looks[0].looks} seeds, spent by "
                        f"{looks[0].spending}, at its first look ({len(looks)} recorded in looks.json); the spec now "
                        f"says {now or 'no adaptive design'}: restore it, or start over with --fresh or another name")


def look_spec(spec: SweepSpec, looks: list[Look]) -> tuple[int, SweepSpec]:
    """The look to run (1-based; the last recorded one again when growth ended) and the spec of its trials."""
    first = spec.adaptive.start
    if not looks:
        return 1, spec.at_look({}, first)
    last = looks[-1]
    if last.ended:
        seeds = {v.variant: v.seeds for v in last.variants}
        return last.look, spec.at_look(seeds, last.baseline_seeds)
    return last.look + 1, spec.at_look(last.next_seeds, last.next_seeds[last.baseline])


def read_verdict(layout: SweepDir) -> Verdict:
    """None written: no QED variant with te, judged as exploratory."""
    verdict = read_record(layout.verdict_json, Verdict | None)
    return verdict or Verdict(None, None, EXPLORATORY, "no QED variant with a te baseline")


def log_look(uri: str, layout: SweepDir, look: Look) -> None:
    """Mirrors one recorded look to the sweep's MLflow run; a failure costs a warning (``looks.json`` has it)."""
    try:
        _log_look(uri, layout, look)
    except Exception as e:  # noqa: BLE001 - MLflow mirrors the folder, which has the record
        print(f"WARNING: MLflow failed to record look {look.look} ({type(e).__name__}: {e}); looks.json has it",
              flush=True)


def _log_look(uri: str, layout: SweepDir, look: Look) -> None:
    import json

    from qed_ray.records.sweep import sweep_id
    from qed_ray.service.mlflow.tracking import metric_key, open_sweep

    found = open_sweep(uri, sweep_id(layout))
    if found is None:
        return
    tracker, run = found
    run_id, k = run.info.run_id, look.look
    tracker.log_metrics(run_id, {"look_seeds": float(look.baseline_seeds),
                                 **{metric_key("look_level", v.variant): v.level for v in look.variants
                                    if v.outcome not in (None, EXPLORATORY)}}, step=k)
    tracker.set_tags(run_id, {metric_key(f"qed.look{k}", v.variant): v.decision for v in look.variants}
                     | {f"qed.look{k}/claim": look.claim})
    tracker.log_text(run_id, json.dumps(look.to_json(), indent=1), f"looks/look{k}.json")


class AdaptivePower(Record):
    """``qed_ray/data/adaptive_power.json``: the power tool's expected seed runs per task for one adaptive design."""

    source: str
    looks: list[int]
    spending: str
    max_runs: int
    expected_runs: dict[str, float]


def price_lines(spec: SweepSpec, packs: list, machine, tables) -> list[str]:
    """The dry run's line for an adaptive spec: the hours in packs on ``machine`` at the minimum (every group stops
    at the first look), expected under the power tool's scenarios (scaled linearly in seed runs) and at the
    maximum."""
    from pathlib import Path

    from qed_ray.service.plan.dry_plan import price

    a, gpu = spec.adaptive, spec.resources.gpu
    got = price(spec, packs, machine, tables)
    if isinstance(got, str):
        return [f"adaptive: looks at {', '.join(map(str, a.looks()))} seeds; hours on {machine.name}: no estimate "
                f"({got})"]
    seconds, _ = got
    unit, per = ("GPU-hours", gpu) if gpu else ("CPU-hours", spec.trial_resources()["cpu"])
    first = {s: i for i, s in enumerate(spec.seeds)}
    at_start = sum(s for p, s in zip(packs, seconds) if max(first[t.run.seed] for t in p.trials) < a.start)
    lo, hi = at_start * per / 3600, sum(seconds) * per / 3600
    sim = read_record(Path(__file__).resolve().parents[1] / "data" / "adaptive_power.json", AdaptivePower)
    if (sim.looks, sim.spending) == (list(a.looks()), a.spending) and sim.expected_runs:
        span = sim.max_runs * a.start / a.max_seeds  # seed runs per task when every group stops at look 1
        expected = "; ".join(f"{_hours(lo + (hi - lo) * (runs - span) / (sim.max_runs - span))} if {name}"
                             for name, runs in sim.expected_runs.items())
    else:
        expected = (f"not simulated for this design (benchmarks/verdict_power.py --adaptive {a.start} {a.step} "
                    f"{a.max_seeds} prices it)")
    return [f"adaptive: looks at {', '.join(map(str, a.looks()))} seeds ({a.spending}); {unit} in packs on "
            f"{machine.name}: minimum {_hours(lo)} (every group stops at the first look), maximum {_hours(hi)} "
            f"(every look); expected {expected}"]


def _hours(h: float) -> str:
    return f"{h:,.1f}" if h >= 1 else f"{h:.2g}"  # a tiny sweep's hours still show


def look_lines(look: Look) -> list[str]:
    lines = [f"look {look.look} of {len(look.looks)} ({look.baseline_seeds} seeds of te): the claim "
             f"{look.claim}" + (f"; growth ended: {look.ended}" if look.ended else
                                f"; next look: {', '.join(f'{k} {n}' for k, n in look.next_seeds.items())} seeds")]
    for v in look.variants:
        judged = "" if v.outcome in (None, EXPLORATORY) else f" (at {100 * v.level:.4g}%: {v.outcome})"
        lines.append(f"  {v.variant}: {v.decision}{judged}, {v.seeds} seeds"
                     + (f", decided at look {v.decided_at}" if v.decided_at else ""))
    return lines


def run_looks(spec: SweepSpec, layout: SweepDir, start: Start, log: Callable[[Look], None],
              say: Callable[[str], None]) -> int:
    """Runs the looks from where ``looks.json`` left off until growth ends; returns the exit code of the first
    start that does not succeed (0 once growth ended)."""
    looks = read_looks(layout)
    check_design(spec, looks)
    while True:
        k, this = look_spec(spec, looks)
        say(f"look {k} of {len(spec.adaptive.looks())}: " + ("growth ended at this look; gathering again" if
                                                           looks and looks[-1].ended else "training its seeds"))
        code = start(this)
        if code != 0 or (looks and looks[-1].ended):
            if code == 0:
                say(bias_note(looks[-1]))
            return code
        try:
            look = next_look(read_verdict(layout), spec.adaptive, k, looks[-1] if looks else None)
        except RecordError as e:
            say(f"error: look {k}: {e}")
            return 1
        looks = [*looks, look]
        write_record(layout.looks_file, looks, list[Look])
        log(look)
        for line in look_lines(look):
            say(line)
        if look.ended:
            say(bias_note(look))
            return 0
