"""The gather actor: turns finished trials' policy snapshots into the sweep's metric tables and figures.

A named Ray actor per sweep receives trial records (folder paths, never weights), evaluates each
(task, agent, variant) group as a Ray task (groups run in parallel over the cluster), aggregates across tasks,
and writes ``results.json``, CSV tables and figures into the sweep's gather folder. The driver then logs that
folder to the sweep's MLflow parent run.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import ray

from qed_ray import analysis, plots
from qed_ray.analysis import TrialRecord

NAMESPACE = "qed_ray"


def actor_name(sweep_name: str, sweep_id: str) -> str:
    """The per-sweep actor name."""
    return f"qed-gather-{sweep_name}-{sweep_id}"


@ray.remote(num_cpus=1)
def _evaluate_group_task(records: list[dict], final_eval: dict) -> dict:
    import torch

    torch.set_num_threads(1)
    return analysis.evaluate_group([TrialRecord(**r) for r in records], final_eval,
                                   device="cuda" if torch.cuda.is_available() else "cpu")


def _clean(x):
    """NaN/inf -> None so results.json is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _write_csv(rows: list[dict], path: Path) -> None:
    if not rows:
        path.write_text("")
        return
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


@ray.remote(num_cpus=0)
class Gatherer:
    """Collects trial records for one sweep and computes its cross-seed metrics.

    Args:
        sweep_name: for the tables.
        final_eval: a FinalEvalSpec dump.
        out_dir: absolute folder for results.json, CSVs and figures.
        group_resources: Ray resources of each group-evaluation task.
    """

    def __init__(self, sweep_name: str, final_eval: dict, out_dir: str, group_resources: dict | None = None):
        self.sweep_name, self.final_eval, self.out = sweep_name, final_eval, Path(out_dir)
        self.group_resources = group_resources or {"num_cpus": 1}
        self.records: dict[str, dict] = {}

    def add(self, record: dict) -> int:
        """Adds (or replaces, keyed by trial name, so retries never double-count) a record; returns the count."""
        self.records[record["name"]] = record
        return len(self.records)

    def compute(self, failed: list[dict] | None = None) -> dict:
        """Evaluates every group, aggregates, writes outputs; returns the results dict."""
        by_group: dict[tuple, list[dict]] = {}
        for r in self.records.values():
            by_group.setdefault((r["task"], r["agent"], r["variant"]), []).append(r)
        task = _evaluate_group_task.options(**self.group_resources)
        groups = ray.get([task.remote(recs, self.final_eval) for _, recs in sorted(by_group.items())])
        aggregates = analysis.aggregate(groups, self.final_eval) if groups else []
        proxy = analysis.critic_proxy(groups)
        results = {"sweep": self.sweep_name, "final_eval": self.final_eval, "aggregates": aggregates,
                   "groups": groups, "critic_proxy": proxy, "failed_trials": failed or [],
                   "n_trials": len(self.records)}
        self._write(results)
        return _clean(results)

    def _write(self, results: dict) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "results.json").write_text(json.dumps(_clean(results), indent=1))
        _write_csv(results["aggregates"], self.out / "aggregates.csv")
        _write_csv(analysis.group_rows(results["groups"]), self.out / "groups.csv")
        if results["groups"]:
            plots.all_figures(results["groups"], results["aggregates"], results["critic_proxy"], self.out / "figures")


def gather(sweep_name: str, sweep_id: str, records: list[TrialRecord], final_eval: dict, out_dir: Path,
           failed: list[dict], group_resources: dict | None = None) -> dict:
    """Starts (or reuses) the sweep's named actor, hands it the records, returns its results."""
    actor = Gatherer.options(name=actor_name(sweep_name, sweep_id), namespace=NAMESPACE,
                             get_if_exists=True).remote(sweep_name, final_eval, str(out_dir), group_resources)
    ray.get([actor.add.remote(analysis.record_dict(r)) for r in records])
    try:
        return ray.get(actor.compute.remote(failed))
    finally:
        ray.kill(actor)
