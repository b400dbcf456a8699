"""The gather step's outputs in MLflow, a mirror of ``gather/`` (the files are the record): rows and aggregates as
metrics, the summary as the run's description, tables and figures as artifacts; on the sweep's parent run, or a
re-analysis's child run named for its settings (docs/results.md, "MLflow")."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from qed_ray.analysis import report
from qed_ray.analysis.results import GroupResult, SweepResults, csv_row
from qed_ray.spec.labels import settings_label  # noqa: F401 - API (re-exported)
from qed_ray.records.layout import SweepDir
from qed_ray.analysis.group_view import GroupView, group_view
from qed_ray.service.mlflow.tags import BASELINE_TAG, GROUP_TAG, NOTE_TAG, VERDICT_TAG, group_tags
from qed_ray.service.mlflow.mlflow_view import runs_page
from qed_ray.service.mlflow.tracking import Tracker, metric_key, open_sweep

GROUP_METRICS = ("V", "action_distance", "q1_dispersion", "early_q_gap", "alpha_frac_floor_late",
                 "alpha_frac_cap_late", "log_std_at_min", "alpha_frac_hot_late", "alpha_ratio_late", "entropy_late")
# Per variant against its te baseline (the verdict reads V_ratio_median and iqm_ratio with their intervals).
COMPARISON_METRICS = ("V_ratio_median", "V_ratio_median_ci_lower", "V_ratio_median_ci_upper", "V_ratio_geomean",
                      "V_ratio_means", "action_distance_ratio_median", "action_distance_ratio_geomean",
                      "action_distance_ratio_means", "score_var_ratio_median", "score_var_ratio_geomean",
                      "score_var_ratio_means", "iqm_ratio", "iqm_ratio_ci_lower", "iqm_ratio_ci_upper",
                      "prob_improvement", "prob_improvement_ci_lower", "prob_improvement_ci_upper")
# Tag values: MLflow 3 keeps 8,000 characters, older tracking servers 5,000; a longer summary is cut at a line.
NOTE_LIMIT = 5000
SUMMARY_FILE = "gather/summary.md"  # the whole summary, as an artifact beside the tables
SWEEP_FOOTER = ("Tables and figures: Artifacts, `gather/` (this summary in full: `gather/summary.md`). A re-analysis "
                "with other evaluation settings (`python -m qed_ray.gather DIR`) is a child run named `reanalysis "
                "<settings>`; this run keeps the numbers of the sweep's own settings.")


def log_rows(tracker: Tracker, run_id: str, results: SweepResults, new_groups: Sequence[GroupResult],
             heading: str | None = None, footer: str = SWEEP_FOOTER) -> None:
    """Logs the current aggregates and comparisons (step = groups gathered so far), the verdict tag, each new
    group's row and ``alpha_regime`` tag, and the summary as the run's description and ``gather/summary.md``."""
    finite = lambda d: {k: v for k, v in d.items() if math.isfinite(v)}  # noqa: E731
    metrics = {metric_key(f"{a.agent}.{a.variant}", k): v for a in results.aggregates
               for k, v in a.headline().items()}
    metrics.update({metric_key(f"{c.agent}.{c.variant}", k): csv_row(c)[k] for c in results.comparisons
                    for k in COMPARISON_METRICS})
    if results.verdict is not None:
        tracker.set_tags(run_id, {VERDICT_TAG: results.verdict.outcome})
    tracker.log_metrics(run_id, finite(metrics), step=len(results.groups))
    rows = {metric_key("group", g.task, f"{g.agent}.{g.variant}", k): float(getattr(g, k))
            for g in new_groups for k in GROUP_METRICS}
    rows.update({metric_key("group", g.task, f"{g.agent}.{g.variant}", "mean_score"): float(sum(g.scores)
                 / len(g.scores)) for g in new_groups})
    if rows:
        tracker.log_metrics(run_id, finite(rows), step=0)
    regimes = {metric_key("alpha_regime", g.task, f"{g.agent}.{g.variant}"): g.alpha_regime for g in new_groups
               if g.alpha_regime is not None}
    if regimes:
        tracker.set_tags(run_id, regimes)
    text = report.summary_markdown(results, heading or f"Sweep {results.sweep}: summary", footer,
                                   runs_link(tracker.experiment_id, tracker.sweep_id))
    tracker.set_tags(run_id, {NOTE_TAG: note(text)})
    tracker.log_text(run_id, text, SUMMARY_FILE)


def runs_link(experiment_id: str, sweep_id: str) -> str:
    """The description's first line: a relative link (whatever host serves the UI) to the sweep's group view."""
    return (f"[Per task: te and each variant side by side]({runs_page(experiment_id, sweep_id)}) (the group runs, "
            f"sorted by name: V, IQM and the ratios to te with their intervals)")


def log_groups(tracker: Tracker, parent_id: str, views: Sequence[GroupView], adopt: bool = False) -> None:
    """Logs each group's view to its group run under ``parent_id``, its te variant as ``qed.baseline`` once that has
    landed, and ends it FINISHED. ``adopt``: the seed runs of each group move under its run (the sweep's own)."""
    seeds: dict[str, list] = {}
    if adopt and views:
        for run in tracker.trial_runs().values():
            seeds.setdefault(run.data.tags.get(GROUP_TAG, ""), []).append(run)
    for view in views:
        run_id = tracker.group_run(parent_id, group_tags(*view.key, view.alpha_regime))
        tracker.log_metrics(run_id, view.metrics(), step=0)
        if view.baseline:
            tracker.set_tags(run_id, {BASELINE_TAG: view.baseline})
        tracker.adopt(run_id, seeds.get(view.key.name, []))
        tracker.end_run(run_id)


def note(markdown: str, limit: int = NOTE_LIMIT) -> str:
    """``markdown`` as a run description: whole if it fits ``limit`` characters, else cut at a line, saying so."""
    if len(markdown) <= limit:
        return markdown
    tail = f"\n\n*(cut to MLflow's tag limit: the whole summary is `{SUMMARY_FILE}` in Artifacts)*"
    return markdown[:markdown.rfind("\n", 0, limit - len(tail))] + tail


def log_files(tracker: Tracker, run_id: str, layout: SweepDir, folder: Path | None = None) -> None:
    """Uploads the tables and figures (not the cache) of ``folder`` (default ``gather/``) under ``gather/``."""
    folder = layout.gather if folder is None else folder
    for path in (layout.results_json, layout.aggregates_csv, layout.groups_csv, layout.budgets_csv,
                 layout.comparisons_csv, layout.verdict_json):
        tracker.log_artifact(run_id, folder / path.name, "gather")
    if (folder / layout.figures.name).is_dir():
        tracker.log_artifacts(run_id, folder / layout.figures.name, "gather/figures")


def log_reanalysis(uri: str, sweep_id: str, results: SweepResults, layout: SweepDir, fields: Sequence[str],
                   refused: Sequence[str], folder: Path | None = None) -> str:
    """Logs a re-analysis as a child run ``reanalysis <settings>`` of the sweep's parent run, as the sweep logs its
    own (its group runs adopt no seed runs), FAILED naming the ``refused`` groups; returns the line to print."""
    found = open_sweep(uri, sweep_id)
    if found is None:
        return f"MLflow: not updated: {uri} holds no parent run of sweep {sweep_id}"
    tracker, parent = found
    settings = results.final_eval.model_dump(mode="json")
    label = settings_label(settings, parent.data.params, fields)
    run_id = tracker.reanalysis_run(parent.info.run_id, label, {"final_eval": settings})
    log_rows(tracker, run_id, results, results.groups, f"Re-analysis of {results.sweep}: {label}",
             f"Tables and figures: Artifacts, `gather/`. The parent run `{parent.info.run_name}` keeps the numbers "
             f"of the sweep's own settings.")
    log_groups(tracker, run_id, [group_view(g, results.groups, results.final_eval) for g in results.groups])
    log_files(tracker, run_id, layout, folder)
    tracker.end_run(run_id, failed_reason="; ".join(refused) or None)
    return (f"MLflow: logged as run 'reanalysis {label}' under the sweep's run '{parent.info.run_name}' "
            f"(experiment '{tracker.experiment}')")
