"""The gather actor: turns finished trials' policy snapshots into the sweep's metric tables and figures.

A named Ray actor per sweep receives trial records (folder paths, never weights), evaluates each
(task, agent, variant) group as a Ray task (groups run in parallel over the cluster), aggregates across tasks,
and writes ``results.json``, CSV tables and figures into the sweep's gather folder (paths from
:class:`~qed_ray.layout.SweepDir`). The driver then logs that folder to the sweep's MLflow parent run.
"""

from __future__ import annotations

import csv
from dataclasses import asdict
from pathlib import Path

import ray

from qed_ray import analysis, plots
from qed_ray.analysis import FailedTrial, GroupResult, SweepResults, TrialRecord
from qed_ray.atomic import atomic_file, write_json
from qed_ray.layout import SweepDir
from qed_ray.spec import FinalEvalSpec

NAMESPACE = "qed_ray"


def actor_name(sweep_name: str, sweep_id: str) -> str:
    """The per-sweep actor name."""
    return f"qed-gather-{sweep_name}-{sweep_id}"


@ray.remote(num_cpus=1)
def _evaluate_group_task(records: list[TrialRecord], final_eval: FinalEvalSpec) -> GroupResult:
    import torch

    torch.set_num_threads(1)
    return analysis.evaluate_group(records, final_eval, device="cuda" if torch.cuda.is_available() else "cpu")


def _write_csv(rows: list[dict], path: Path) -> None:
    with atomic_file(path) as tmp, open(tmp, "w", newline="") as f:
        if rows:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


def write_results(results: SweepResults, layout: SweepDir) -> None:
    """``results.json`` (strict JSON), ``aggregates.csv``, ``groups.csv`` and, with groups, the figures."""
    layout.gather.mkdir(parents=True, exist_ok=True)
    write_json(layout.results_json, results.to_json(), indent=1)
    _write_csv([asdict(a) for a in results.aggregates], layout.aggregates_csv)
    _write_csv(analysis.group_rows(results.groups), layout.groups_csv)
    if results.groups:
        plots.all_figures(results.groups, results.aggregates, results.critic_proxy, layout.figures)


@ray.remote(num_cpus=0)
class Gatherer:
    """Collects trial records for one sweep and computes its cross-seed metrics.

    Args:
        sweep_name: for the tables.
        final_eval: the sweep's final-evaluation settings.
        sweep_dir: absolute sweep folder (outputs go to its gather folder).
        group_resources: Ray resources of each group-evaluation task.
    """

    def __init__(self, sweep_name: str, final_eval: FinalEvalSpec, sweep_dir: str,
                 group_resources: dict | None = None):
        self.sweep_name, self.final_eval, self.layout = sweep_name, final_eval, SweepDir(sweep_dir)
        self.group_resources = group_resources or {"num_cpus": 1}
        self.records: dict[str, TrialRecord] = {}

    def add(self, record: TrialRecord) -> int:
        """Adds (or replaces, keyed by trial name, so retries never double-count) a record; returns the count."""
        self.records[record.name] = record
        return len(self.records)

    def compute(self, failed: list[FailedTrial] | None = None) -> SweepResults:
        """Evaluates every group, aggregates, writes outputs; returns the results."""
        by_group: dict[analysis.GroupKey, list[TrialRecord]] = {}
        for r in self.records.values():
            by_group.setdefault(r.group, []).append(r)
        task = _evaluate_group_task.options(**self.group_resources)
        groups = ray.get([task.remote(recs, self.final_eval) for _, recs in sorted(by_group.items())])
        results = SweepResults(
            sweep=self.sweep_name, final_eval=self.final_eval,
            aggregates=analysis.aggregate(groups, self.final_eval) if groups else [], groups=groups,
            critic_proxy=analysis.critic_proxy(groups), failed_trials=list(failed or []),
            n_trials=len(self.records))
        write_results(results, self.layout)
        return results


def gather(sweep_name: str, sweep_id: str, records: list[TrialRecord], final_eval: FinalEvalSpec,
           layout: SweepDir, failed: list[FailedTrial], group_resources: dict | None = None) -> SweepResults:
    """Starts (or reuses) the sweep's named actor, hands it the records, returns its results."""
    actor = Gatherer.options(name=actor_name(sweep_name, sweep_id), namespace=NAMESPACE,
                             get_if_exists=True).remote(sweep_name, final_eval, str(layout.root), group_resources)
    ray.get([actor.add.remote(r) for r in records])
    try:
        return ray.get(actor.compute.remote(failed))
    finally:
        ray.kill(actor)
