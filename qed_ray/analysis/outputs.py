"""The gather step's output files: ``results.json``, the CSV tables, ``verdict.json`` and the figures of a sweep's
results, for every evaluation policy (the live gather and the re-analysis write them alike)."""

from __future__ import annotations

import csv
from pathlib import Path

from qed_ray.analysis import tables
from qed_ray.analysis.results import SweepResults, csv_row
from qed_ray.records.atomic import atomic_file, write_json
from qed_ray.records.layout import SweepDir


def _write_csv(rows: list[dict], path: Path) -> None:
    with atomic_file(path) as tmp, open(tmp, "w", newline="") as f:
        if rows:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


def policy_dir(layout: SweepDir, policy: str) -> Path:
    """``gather/policy_<name>/`` (:meth:`SweepDir.policy_gather`)."""
    return layout.policy_gather(policy)


def write_results(results: SweepResults, layout: SweepDir, folder: Path | None = None) -> None:
    """``results.json`` (strict JSON, every evaluation policy's tables in it), ``aggregates.csv``, ``groups.csv``,
    ``iqm_by_budget.csv``, ``comparisons.csv``, ``verdict.json`` (``null`` without a te and a QED variant) and,
    with groups, the figures (PNG and SVG), each replaced atomically (the live gather rewrites them while the sweep
    runs); the same tables and figures of each further evaluation policy under :func:`policy_dir`. Into
    ``folder`` (a re-analysis's, :meth:`SweepDir.reanalysis`) laid out as ``gather/``; default ``gather/``."""
    folder = layout.gather if folder is None else folder
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / layout.results_json.name, results.to_json(), indent=1)
    _write_tables(results, folder, layout)
    for policy, other in results.other_policies.items():
        _write_tables(other, folder / policy_dir(layout, policy).name, layout)


def _write_tables(results: SweepResults, folder: Path, layout: SweepDir) -> None:
    """The CSV tables and figures of one evaluation policy in ``folder`` (file names as in ``gather/``)."""
    folder.mkdir(parents=True, exist_ok=True)
    _write_csv([csv_row(a) for a in results.aggregates], folder / layout.aggregates_csv.name)
    _write_csv(tables.group_rows(results.groups, results.group_stats), folder / layout.groups_csv.name)
    _write_csv([csv_row(b) for b in results.iqm_by_budget], folder / layout.budgets_csv.name)
    _write_csv([csv_row(c) for c in results.comparisons], folder / layout.comparisons_csv.name)
    write_json(folder / layout.verdict_json.name, results.verdict.to_json() if results.verdict else None, indent=1)
    if results.groups:
        from qed_ray.analysis import plots  # matplotlib: for the figures, not for --help or a refused folder

        plots.all_figures(results, folder / layout.figures.name)
