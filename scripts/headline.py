"""The README's headline figure and caption, regenerated from a finished demo sweep's gather/ (never typed).

    .venv/bin/python scripts/headline.py results/smoke

reads ``gather/results.json`` (validated as every reader of it does), copies ``gather/figures/pareto_kl_vs_iqm.png``
to ``docs/img/smoke_pareto.png``, writes the numbers the caption quotes to ``docs/img/smoke_pareto.json`` and
rewrites the caption between the README's ``headline`` markers from that file. ``tests/docs/test_docs.py`` checks the
README's caption against the committed data file.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURE, DATA, README = ROOT / "docs/img/smoke_pareto.png", ROOT / "docs/img/smoke_pareto.json", ROOT / "README.md"
BEGIN, END = "<!-- headline: scripts/headline.py writes this block -->", "<!-- /headline -->"
POLICY = {"mean": "deterministic tanh(mu) actions", "sample": "sampled actions"}


def numbers(sweep_dir: Path) -> dict:
    """The caption's numbers from ``sweep_dir/gather/results.json``: the one QED variant against its te baseline.
    Raises SystemExit naming the file when the sweep has no such single comparison."""
    from qed_ray.analysis.results import read_results
    from qed_ray.records.layout import SweepDir

    layout = SweepDir(sweep_dir)
    results = read_results(layout.results_json)
    if len(results.comparisons) != 1:
        raise SystemExit(f"{layout.results_json}: the headline quotes one variant against te; this sweep has "
                         f"{len(results.comparisons)} comparisons")
    c = results.comparisons[0]
    rows = {a.variant: a for a in results.aggregates if a.agent == c.agent}
    fe = results.final_eval
    return {"sweep": results.sweep, "agent": c.agent, "variant": c.variant, "baseline": c.baseline,
            "tasks": c.tasks, "seeds": c.n_seeds, "env_steps": c.env_steps, "policy": results.policy,
            "episodes": fe.episodes, "bootstrap_reps": fe.bootstrap_reps, "confidence": fe.confidence,
            "V_ratio_median": list(c.V_ratio_median.astuple()),
            "iqm_ratio": list(c.iqm_ratio.astuple()),
            "V_mean": {v: rows[v].V_mean for v in (c.baseline, c.variant)},
            "iqm": {v: rows[v].iqm for v in (c.baseline, c.variant)},
            "verdict": results.verdict.outcome if results.verdict else None,
            "claim_file": results.verdict.claim_file if results.verdict else None}


def _ci(values: list) -> str:
    """``point [lower, upper]`` as the summary table prints it; ``-`` where the data file holds null (no estimate)."""
    from qed_ray.analysis.report import with_ci

    return with_ci(*(math.nan if v is None else v for v in values))


def caption(data: dict) -> str:
    """The README's caption of the headline figure, from the data file's numbers alone."""
    return (f"*`make demo` (`sweeps/{data['sweep']}.yaml`: {' and '.join(data['tasks'])}, {data['seeds']} seeds, "
            f"{data['env_steps']:,} env steps each, far from the paper's 2M), {data['agent']} {data['variant']} "
            f"against target entropy ({data['baseline']}): te V / QED V = {_ci(data['V_ratio_median'])} (median "
            f"over tasks; above 1, QED's seeds act more alike), IQM / te IQM = {_ci(data['iqm_ratio'])}. Error "
            f"bars and intervals: {100 * data['confidence']:g}% bootstrap over seeds, {data['bootstrap_reps']:,} "
            f"resamples; final evaluation {data['episodes']} episodes per seed, {POLICY[data['policy']]}. "
            f"{_verdict(data)}*")


def _verdict(data: dict) -> str:
    if data["verdict"] is None:
        return "No verdict on the claim (no te and QED variant)."
    if data["verdict"] == "exploratory":
        return ("The claim is not judged (exploratory: far below the registered design of docs/claim.md"
                + (", and the demo names no pre-registration)." if data["claim_file"] is None else ")."))
    if data["claim_file"] is None:
        return (f"The verdict on the claim by docs/claim.md's default thresholds (exploratory: the demo names no "
                f"pre-registration): {data['verdict'].upper()}.")
    return f"The verdict on the claim pre-registered in {data['claim_file']}: {data['verdict'].upper()}."


def block(data: dict) -> str:
    """The README block between the markers: the figure and its caption."""
    alt = (f"IQM of final return against cross-seed divergence V for {data['agent']} {data['baseline']} and "
           f"{data['variant']} on the {data['sweep']} sweep")
    return f"{BEGIN}\n![{alt}](docs/img/{FIGURE.name})\n\n{caption(data)}\n{END}"


def readme_block(text: str) -> str:
    """The README's block between the markers (with them); raises ValueError when the markers are missing."""
    found = re.search(re.escape(BEGIN) + r".*?" + re.escape(END), text, re.S)
    if not found:
        raise ValueError(f"README.md: no block between {BEGIN!r} and {END!r}")
    return found.group(0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/headline.py", description=__doc__.split("\n\n")[0])
    p.add_argument("sweep_dir", type=Path, help="a finished demo sweep's folder (make demo: results/smoke)")
    args = p.parse_args(argv)
    from qed_ray.records.codec import strict_json

    data = json.loads(json.dumps(strict_json(numbers(args.sweep_dir))))  # as the data file will read back
    shutil.copyfile(args.sweep_dir / "gather/figures/pareto_kl_vs_iqm.png", FIGURE)
    DATA.write_text(json.dumps(data, indent=1) + "\n")
    text = README.read_text()
    README.write_text(text.replace(readme_block(text), block(data)))
    print(f"wrote {FIGURE.relative_to(ROOT)}, {DATA.relative_to(ROOT)} and the README's caption:\n{caption(data)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
