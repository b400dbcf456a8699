"""End to end on a real local Ray cluster and a real SQLite MLflow store (slow: marked, run in CI)."""

import csv
import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from qed_ray.analysis.results import Aggregate, BudgetIqm
from qed_ray.records.layout import DOCUMENTED, PackId, SweepDir
from qed_ray.records.digests import digest, inventory
from qed_ray.service.mlflow.tracking import PACK_SIZE_TAG, PACK_TAG, default_tracking_uri
from kit import GROUP_COLUMNS, cmdline, counts, flat, widest
from ray_cluster import processes_naming
from sweep_helpers import (ROOT, TINY_TRAIN, MlflowServer, cli_env, done_markers, rest_experiment, rest_runs,
                           run_sweep_cli, sweep_runs, tiny_spec, wait_for)

pytestmark = pytest.mark.slow


def _job_workers(cluster_tmp) -> set[int]:
    """Worker processes of the cluster now running a job's actors (Ray titles them ``ray::<class>``; idle workers
    are ``ray::IDLE``, the node's agents ``ray::...Agent``)."""
    return {p for p in processes_naming(str(cluster_tmp))
            if cmdline(p).startswith("ray::") and not cmdline(p).startswith("ray::IDLE")
            and not cmdline(p).split()[0].endswith("Agent")}


def _children(runs):
    return [r for r in runs if r.data.tags.get("qed.role") == "trial"]


TASKS, VARIANTS, SEEDS = ("cartpole-balance", "pendulum-swingup"), ("te", "qed1000"), (0, 1)
# What gather/ holds after a sweep (the documented layout; gather/behaviour/ is the visualiser's).
GATHER_FILES = {"results.json", "aggregates.csv", "groups.csv", "iqm_by_budget.csv", "comparisons.csv", "verdict.json",
                "figures", "cache"}


def test_tiny_sweep_end_to_end(tmp_path, ray_head, request):
    """2 tasks x 2 variants x 2 seeds in packs of two seeds (packs of one: every other slow sweep test): a laptop's
    first start, a start that finishes a pack left half done, --status and a re-analysis with other evaluation
    settings. QED runs with k = 1000, a known answer for where it sat: Delta / (k d) stays far below alpha_TE, so
    every state is at the floor (the same code path as any k). The group runs are read as the UI and any HTTP client
    read them: MLflow's REST API, from a real ``mlflow server`` over the sweep's SQLite store."""
    agents = [{"name": "sac_ln", "overrides": {"hidden": 16, "batch_size": 16},
               "temperatures": [{"kind": "te"}, {"kind": "qed", "k": 1000}]}]
    # One pack at a time: a reused worker starts the next pack at once, so only packs trained after the first group's
    # gather (worker start, final evaluation, MLflow) show that groups land while the sweep runs; two packs at a time
    # on 2 cores ended the sweep before it (a race lost by 4.9 s at load 20).
    spec = tiny_spec(tmp_path, "e2e", tasks=list(TASKS), agents=agents, pack={"seeds": 2}, max_concurrent_trials=1)
    proc = run_sweep_cli(spec)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "8 trials (0 done, 8 new) in 4 packs of up to 2 seeds" in proc.stdout
    assert "IQM" in proc.stdout and "-m mlflow ui --backend-store-uri sqlite:////" in proc.stdout
    assert "/#/experiments/1/runs?workflowType=machine_learning&viewStateShareKey=qed-groups-" in proc.stdout
    assert counts(proc.stdout, "gather") == {"group(s) evaluated": 4, "taken from the cache": 0}
    # The embedded start prints nothing alarming (token auth stays on); only the spec's warning about its k.
    assert proc.stderr == ("warning: k: 1000 (agent sac_ln) is outside 0.05 to 1 (the paper uses 0.1 to 0.4): "
                           "alpha(s) = Delta / (k x action_dim) is 2500 times smaller than at k = 0.4, so QED would "
                           "sit at its floor alpha_TE (training like te)\n"), proc.stderr[-3000:]
    sweep_dir = tmp_path / "results" / "e2e"
    server = MlflowServer(tmp_path / "mlflow-server", store_uri=default_tracking_uri(sweep_dir)).start()
    request.addfinalizer(server.stop)

    tracker, runs = sweep_runs(sweep_dir, "e2e")
    parents = [r for r in runs if r.data.tags.get("qed.role") == "sweep"]
    children = _children(runs)
    assert len(parents) == 1 and len(children) == 8
    pid = parents[0].info.run_id
    assert parents[0].info.status == "FINISHED"
    groups = _group_runs_between_the_parent_and_the_seeds(server.url, pid, sweep_dir)
    _a_console_line_per_group_before_a_summary_of_at_most_100_columns(proc.stdout)
    assert {r.data.tags["qed.trial"] for r in children} == {
        f"{t}/sac_ln/{v}/{s}" for t in TASKS for v in VARIANTS for s in SEEDS}
    for r in children:  # the UI groups te and QED of each task by qed.group; names lead with variant and seed
        task, agent, variant, seed = r.data.tags["qed.trial"].split("/")
        assert [r.data.tags[f"qed.{k}"] for k in ("task", "agent", "variant", "seed", "group")] == [
            task, agent, variant, seed, f"{task}/{agent}/{variant}"]
        assert r.info.run_name == f"{variant} s{seed} {task} {agent}"
        assert r.data.tags[PACK_TAG] == f"{task}/{agent}/{variant}/pack0-1" and r.data.tags[PACK_SIZE_TAG] == "2"
    note = parents[0].data.tags["mlflow.note.content"]  # the summary on the parent run's page
    assert note.startswith("### Sweep e2e: summary\n") and "*IQM: interquartile mean of final return" in note
    assert note.index("| sac_ln | te | 2 | 4 | 0 |") < note.index("| sac_ln | qed1000 | 2 | 4 | 0 |")
    assert "**Verdict on the claim: not judged** (by the registered design of docs/claim.md)" in note
    assert "child run named `reanalysis <settings>`" in note
    assert all(r.info.status == "FINISHED" for r in children)
    for r in children:
        hist = tracker.client.get_metric_history(r.info.run_id, "eval/return_mean")
        assert sorted(m.step for m in hist) == [1000, 2000], "x-axis is env steps, one point per eval"
        assert all(math.isfinite(m.value) for m in hist) and r.data.params["train.env_steps"] == "2000"
    arts = {a.path for a in tracker.client.list_artifacts(pid, "gather")}
    assert {"gather/results.json", "gather/aggregates.csv", "gather/groups.csv", "gather/figures"} <= arts
    figs = {a.path for a in tracker.client.list_artifacts(pid, "gather/figures")}
    names = ("pareto_kl_vs_iqm", "mean_return_vs_kl", "ci_width", "action_distance", "v_over_env_steps",
             "learning_curves", "iqm_over_env_steps", "performance_profiles", "probability_of_improvement",
             "critic_proxy")  # docs/results.md: what the sweep draws
    assert figs == {f"gather/figures/{n}.{ext}" for n in names for ext in ("png", "svg")}
    assert "gather/iqm_by_budget.csv" in arts
    assert "iqm" in "".join(tracker.client.get_run(pid).data.metrics)
    layout = SweepDir(sweep_dir)
    _comparisons_where_qed_sat_and_the_verdict(proc.stdout, tracker, pid, arts, layout)
    experiment_id, experiment_tags = rest_experiment(server.url, "e2e")
    assert experiment_id == tracker.experiment_id
    assert experiment_tags["mlflow.experimentKind"] == "custom_model_development"  # the UI opens on the runs
    view = json.loads(experiment_tags[f"mlflow.sharedViewState.qed-groups-{tracker.sweep_id}"])  # the address's view
    assert sorted(r.name for r in rest_runs(server.url, "e2e", view["searchFilter"])) == sorted(
        r.name for r in groups.values()), "the shared view lists the sweep's group runs"
    assert view["orderByKey"] == "tags.`mlflow.runName`" and view["selectedColumns"][:5] == [
        "metrics.`V`", "metrics.`te_V_ratio`", "metrics.`IQM`", "metrics.`IQM_ratio`", "tags.`alpha_regime`"]
    _groups_land_while_the_sweep_runs(tracker, pid, children, layout)
    _gather_tables_and_pack_folders(layout, children)
    _one_worker_trains_every_pack(layout)

    results = json.loads(layout.results_json.read_text())
    assert {(g["task"], g["variant"]) for g in results["groups"]} == {(t, v) for t in TASKS for v in VARIANTS}
    for g in results["groups"]:
        assert g["seeds"] == [0, 1] and len(g["returns"]) == 2 and len(g["returns"][0]) == 2
        assert g["V"] >= 0 and g["action_distance"] >= 0
        assert [p[0] for p in g["v_curve"]] == [1000, 2000]
    assert {a["variant"] for a in results["aggregates"]} == {"te", "qed1000"}
    for a in results["aggregates"]:
        assert all(math.isfinite(a[k]) for k in ("iqm", "ci_lower", "ci_upper"))
        assert a["ci_lower"] <= a["iqm"] <= a["ci_upper"] and a["V_mean"] >= 0 and a["n_tasks"] == 2
    for png in layout.figures.glob("*.png"):
        assert png.stat().st_size > 5000

    # The first start was a laptop's (embedded Ray); the next one joins a running cluster, as a second start may.
    _a_pack_left_half_done_resumes_and_nothing_else_runs(spec, layout, ray_head)
    assert len(_children(sweep_runs(sweep_dir, "e2e")[1])) == 8

    _reanalysis_is_a_child_run_with_the_new_tables(sweep_dir, pid, groups, server.url)
    status = subprocess.run([sys.executable, "-m", "qed_ray.sweep", str(spec), "--status"], cwd=ROOT, env=cli_env(),
                            capture_output=True, text=True, timeout=120)
    assert status.returncode == 0 and "trials: 8 done, 0 running, 0 stopped, 0 failed, 0 not started" in status.stdout
    assert "env steps: 16,000 of 16,000 (100%)" in status.stdout and "results: 4 of 4 groups gathered" in status.stdout
    assert "\nre-analysis (python -m qed_ray.gather): gather/reanalysis-episodes=3+bootstrap_reps=300/\n" in status.stdout
    assert widest(status.stdout) <= 100, "not a terminal: 100 columns at most"
    assert len(re.findall(r"^agent +variant +", status.stdout, re.M)) >= 2, "the partial table, in blocks of columns"


def _group_runs_between_the_parent_and_the_seeds(url: str, pid: str, sweep_dir) -> dict:
    """Through the REST API (``runs/search``): one FINISHED group run per (task, agent, variant) under the sweep's
    run, named task first (sorted by name, te and QED of a task side by side), holding V and IQM with their
    intervals and, for QED, its ratios to te on that task, tagged with its ``alpha_regime`` (k = 1000: ``ok``; te:
    ``no estimate``); every seed run under its group's run. Returns ``{group: run}``."""
    results = json.loads(SweepDir(sweep_dir).results_json.read_text())
    runs = rest_runs(url, "e2e")
    groups = {r.tags["qed.group"]: r for r in runs if r.tags.get("qed.role") == "group"}
    assert len(groups) == len([r for r in runs if r.tags.get("qed.role") == "group"]), "one run per group"
    assert sorted(groups) == sorted(f"{t}/sac_ln/{v}" for t in TASKS for v in VARIANTS)
    assert sorted(r.name for r in groups.values()) == [
        f"cartpole-balance {VARIANTS[1]} sac_ln", "cartpole-balance te sac_ln", f"pendulum-swingup {VARIANTS[1]} sac_ln",
        "pendulum-swingup te sac_ln"], "sorted by name: te and QED of each task side by side"
    by_group = {(g["task"], g["variant"]): g for g in results["groups"]}
    stats = {(s["task"], s["variant"]): s for s in results["group_stats"]}
    for name, run in groups.items():
        task, _, variant = name.split("/")
        m, g = run.metrics, by_group[(task, variant)]
        assert run.tags["mlflow.parentRunId"] == pid and run.status == "FINISHED"
        assert m["V"] == pytest.approx(g["V"]) and m["V_ci_lower"] <= m["V"] <= m["V_ci_upper"]
        assert m["IQM_ci_lower"] <= m["IQM"] <= m["IQM_ci_upper"] and m["n_seeds"] == 2
        assert {"action_distance_ci_upper", "return_variance_ci_lower"} <= set(m)
        assert run.tags["alpha_regime"] == (stats[(task, variant)]["alpha_regime"] or "no estimate") == (
            "no estimate" if variant == "te" else "ok"), "the results' field; none: said, never left out"
        if variant == "te":
            assert "te_V_ratio" not in m and "qed.baseline" not in run.tags, "te is the baseline"
        else:
            te = by_group[(task, "te")]
            assert run.tags["qed.baseline"] == "te" and m["te_V_ratio"] == pytest.approx(te["V"] / g["V"])
            assert m["te_V_ratio_ci_lower"] <= m["te_V_ratio"] <= m["te_V_ratio_ci_upper"]
            te_iqm = groups[f"{task}/sac_ln/te"].metrics["IQM"]
            if te_iqm > 0:
                assert m["IQM_ratio"] == pytest.approx(m["IQM"] / te_iqm)
            else:  # a tiny pendulum-swingup run scores 0: no ratio, never a 0 or an infinity
                assert "IQM_ratio" not in m
            assert 0 <= m["alpha_frac_cap_late"] <= 1
    seeds = [r for r in runs if r.tags.get("qed.role") == "trial"]
    assert len(seeds) == 8 and all(r.tags["mlflow.parentRunId"] == groups[r.tags["qed.group"]].id
                                   for r in seeds), "seeds nested under their group's run"
    return groups


def _a_console_line_per_group_before_a_summary_of_at_most_100_columns(stdout: str) -> None:
    """The driver printed one line per group as it landed (V and IQM with intervals, the ratios to te once both
    are in), all before the summary, whose lines fit 100 columns (stdout is not a terminal)."""
    lines = stdout.splitlines()
    gathered = [ln for ln in lines if ln.startswith("gathered ")]
    assert sorted(ln.split()[1] for ln in gathered) == sorted(f"{t}/sac_ln/{v}" for t in TASKS for v in VARIANTS)
    assert all(" CI): V " in ln and "  IQM " in ln for ln in gathered)
    for task in TASKS:  # the second of te and QED to land brings the ratio (QED's line, or its "te is in" line)
        assert any(f" {task}/sac_ln/{VARIANTS[1]} (" in ln and "te V / V " in ln for ln in lines)
    start = lines.index(next(ln for ln in lines if ln.startswith("agent ")))
    assert max(lines.index(ln) for ln in gathered) < start, "every group's line before the summary"
    end = next(i for i, ln in enumerate(lines) if ln.startswith("gather: "))
    summary = lines[start:end]
    assert len(summary) > 10 and widest("\n".join(summary)) <= 100, "not a terminal: 100 columns at most"


def _csv(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return list(rows[0]), rows


def _one_worker_trains_every_pack(layout: SweepDir) -> None:
    """4 packs, one at a time: the worker whose pack ended took the next one (Tune's reuse_actors), so one worker
    process trained them all (Tune's result rows name the process)."""
    (start,) = layout.tune_root.iterdir()
    files = list(start.glob("*/result.json"))
    pids = {json.loads(line)["pid"] for f in files for line in f.read_text().splitlines() if line}
    assert len(files) == 4 and len(pids) == 1, pids


def _gather_tables_and_pack_folders(layout: SweepDir, children: list) -> None:
    """gather/ holds the documented files with their fixed columns (packs or not); each seed keeps its own files, signed
    by its pack's worker, and each pack its checkpoints with every seed's state."""
    assert {p.name for p in layout.gather.iterdir()} == GATHER_FILES
    # (behaviour/ is written by `qed-ray visualize`, policy_<policy>/ only with a second eval policy,
    # reanalysis-<settings>/ by `python -m qed_ray.gather`, search/ only by a k search)
    assert {k.split("/")[1] for k in DOCUMENTED if k.startswith("gather/") and "behaviour" not in k
            and "policy_" not in k and "reanalysis-" not in k and k.split("/")[1] != "search"} == GATHER_FILES
    columns, rows = _csv(layout.aggregates_csv)
    assert columns == list(Aggregate.model_fields)
    assert sorted((r["agent"], r["variant"]) for r in rows) == sorted(("sac_ln", v) for v in VARIANTS)
    assert all(math.isfinite(float(r[k])) for r in rows for k in ("iqm", "ci_lower", "ci_upper", "V_mean"))
    columns, rows = _csv(layout.groups_csv)
    assert columns == GROUP_COLUMNS
    assert sorted((r["task"], r["agent"], r["variant"]) for r in rows) == sorted(
        (t, "sac_ln", v) for t in TASKS for v in VARIANTS)
    assert all(r["n_seeds"] == "2" and r["n_failed"] == "0" and math.isfinite(float(r["V"])) for r in rows)
    columns, rows = _csv(layout.budgets_csv)
    assert columns == list(BudgetIqm.model_fields)
    assert sorted((r["agent"], r["variant"], r["env_steps"]) for r in rows) == sorted(
        ("sac_ln", v, s) for v in VARIANTS for s in ("1000", "2000"))
    for r in children:
        name = r.data.tags["qed.trial"]
        assert r.data.tags["qed.files_sha256"] == digest(inventory(layout, name)), "signed by the pack's worker"
        manifest = json.loads((layout.final_snapshot(name) / "manifest.json").read_text())
        assert [e["env_steps"] for e in manifest["evals"]] == [1000, 2000]
        assert json.loads(layout.done_marker(name).read_text())["env_steps"] == 2000
        assert not list(layout.replay(name).glob("chunk_*")), "pruned once its pack ended"
    for pack in (PackId(t, "sac_ln", v, SEEDS) for t in TASKS for v in VARIANTS):
        assert sorted(layout.pack_checkpoint_steps(pack)) == [1000, 2000]
        final = layout.pack_checkpoint_steps(pack)[2000]
        assert {p.name for p in final.iterdir()} == {"pack.json", "seed_0", "seed_1", "files.json"}
        assert json.loads((final / "pack.json").read_text())["status"] == ["finished"] * 2
        # the final checkpoint lists the files its worker wrote of each seed: what it signed, what DONE.json lists
        assert json.loads((final / "files.json").read_text())["files"] == {
            n: json.loads(layout.done_marker(n).read_text())["files"] for n in pack.trials}
    state = json.loads(layout.state_file.read_text())
    assert state["pack_seeds"] == 2 and sorted(state["packs"]) == sorted(
        PackId(t, "sac_ln", v, SEEDS).name for t in TASKS for v in VARIANTS)


def _a_pack_left_half_done_resumes_and_nothing_else_runs(spec, layout: SweepDir, ray_head) -> None:
    """A kill between two seeds' DONE.json writes of a pack's final evaluation (a spot preemption, an OOM kill) left
    seed 1 without its marker while seed 0 was done and its replay pruned: the next driver start resumes the pack from
    its final checkpoint (a finished seed's replay is not read) and finishes seed 1, training nothing; no other
    pack's files change."""
    pack, name = PackId("cartpole-balance", "sac_ln", "te", SEEDS), "cartpole-balance/sac_ln/te/1"
    done = json.loads(layout.done_marker(name).read_text())
    layout.done_marker(name).unlink()
    others = {p: p.stat().st_mtime_ns for p in (layout.root / "policies").rglob("*")
              if p.is_file() and not p.is_relative_to(layout.policies(name))}
    again = run_sweep_cli(spec, env=ray_head.env())
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "8 trials (7 done, 1 resumed from env step 2,000, 0 new) in 4 packs of up to 2 seeds" in again.stdout
    # Seed 1's final policy is the same file again, so its group's cache key is too: nothing is evaluated again.
    assert "gather: 0 group(s) evaluated, 4 taken from the cache" in again.stdout
    assert json.loads(layout.done_marker(name).read_text()) == done, "the same end, from the same checkpoint"
    assert sorted(layout.pack_checkpoint_steps(pack)) == [1000, 2000] and not list(layout.replay(name).glob("*"))
    assert {p: p.stat().st_mtime_ns for p in others} == others, "no other seed was trained or written again"


def _reanalysis_is_a_child_run_with_the_new_tables(sweep_dir, parent_id: str, groups: dict, url: str) -> None:
    """``python -m qed_ray.gather DIR`` (its main, in this process) with other evaluation settings evaluates every
    group again (no training, no Ray) into ``gather/reanalysis-<settings>/`` and logs its tables, figures, summary,
    verdict and group runs as a child run of the sweep's run, named for the settings that differ from the run's
    params; ``gather/``, the sweep's run and its group runs keep their own (group runs read through the REST API
    at ``url``, before and after)."""
    from qed_ray.service.reanalysis import main as gather_main

    layout = SweepDir(sweep_dir)
    parent_note = sweep_runs(sweep_dir, "e2e")[0].client.get_run(parent_id).data.tags["mlflow.note.content"]
    sweeps_groups = f"tags.`qed.role` = 'group' and tags.`mlflow.parentRunId` = '{parent_id}'"
    runs_before = rest_runs(url, "e2e", sweeps_groups)
    assert {r.id: r.metrics for r in runs_before} == {r.id: r.metrics for r in groups.values()}, "the second start"
    before = {p: p.read_bytes() for p in layout.gather.rglob("*") if p.is_file()}
    assert gather_main([str(sweep_dir), "--episodes", "3", "--bootstrap-reps", "300"]) == 0
    folder = layout.reanalysis("episodes=3+bootstrap_reps=300")
    assert layout.reanalyses() == [folder]
    after = {p: p.read_bytes() for p in layout.gather.rglob("*") if p.is_file()}
    assert {p: after[p] for p in before} == before, "every file of gather/ byte for byte as it was"
    assert all(folder in p.parents or p.parent == layout.group_cache for p in set(after) - set(before)), \
        "new: the re-analysis's folder and the cache entries of its evaluations"
    assert json.loads(layout.results_json.read_text())["final_eval"]["episodes"] == 2, "the sweep's own settings"
    results = json.loads((folder / "results.json").read_text())
    assert {p.name for p in folder.iterdir()} == GATHER_FILES - {"cache"}
    assert results["final_eval"]["bootstrap_reps"] == 300 and results["final_eval"]["episodes"] == 3
    assert all(len(r) == 3 for g in results["groups"] for r in g["returns"]), "3 episodes per seed"
    assert len(list(layout.group_cache.glob("*.json"))) == 8, "both settings' evaluations stay cached"
    tracker, runs = sweep_runs(sweep_dir, "e2e")
    (child,) = [r for r in runs if r.data.tags.get("qed.role") == "reanalysis"]
    assert child.info.run_name == "reanalysis episodes=3 bootstrap_reps=300", "vs the parent's final_eval params"
    assert child.data.tags["mlflow.parentRunId"] == parent_id and child.info.status == "FINISHED"
    got = tracker.client.download_artifacts(child.info.run_id, "gather/results.json", str(sweep_dir.parent))
    assert json.loads(Path(got).read_text()) == results, "the re-analysis run holds the new tables"
    figs = {a.path for a in tracker.client.list_artifacts(child.info.run_id, "gather/figures")}
    assert "gather/figures/pareto_kl_vs_iqm.png" in figs and len(figs) == 20
    assert child.data.tags["qed.verdict"] == results["verdict"]["outcome"]
    qed = next(c for c in results["comparisons"] if c["variant"] == "qed1000")
    assert child.data.metrics["sac_ln.qed1000/V_ratio_median_ci_lower"] == pytest.approx(qed["V_ratio_median"]["lower"])
    assert child.data.tags["mlflow.note.content"].startswith("### Re-analysis of e2e: episodes=3 bootstrap_reps=300")
    assert tracker.client.get_run(parent_id).data.tags["mlflow.note.content"] == parent_note
    mine = {r.tags["qed.group"]: r for r in rest_runs(url, "e2e", f"tags.`qed.role` = 'group' and "
                                                                 f"tags.`mlflow.parentRunId` = '{child.info.run_id}'")}
    assert sorted(mine) == sorted(groups), "a group run per group under the re-analysis's run"
    for name, run in mine.items():
        g = next(x for x in results["groups"] if f"{x['task']}/{x['agent']}/{x['variant']}" == name)
        assert run.metrics["V"] == pytest.approx(g["V"]) and "IQM_ci_upper" in run.metrics
        assert ("te_V_ratio" in run.metrics) == (g["variant"] != "te") and run.status == "FINISHED"
        assert run.tags["alpha_regime"] == groups[name].tags["alpha_regime"], "the same training, the same regime"
    assert {r.id: (r.metrics, r.tags) for r in rest_runs(url, "e2e", sweeps_groups)} == {
        r.id: (r.metrics, r.tags) for r in runs_before}, "the sweep's group runs as they were"
    assert all(r.data.tags["mlflow.parentRunId"] in {r.id for r in runs_before}
               for r in _children(runs)), "the seed runs stay under the sweep's group runs"


def _comparisons_where_qed_sat_and_the_verdict(stdout: str, tracker, pid: str, arts: set, layout: SweepDir) -> None:
    """The summary, gather/ and the parent run carry the paired te/QED ratios, where QED sat and the verdict."""
    assert "sac_ln qed1000 vs te (2 tasks, 2+ seeds, intervals paired):" in stdout and "IQM this / te" in stdout
    assert "where QED sat, last quarter of training" in stdout
    # a tiny sweep is judged by nothing: not judged, with its real departures from the registered design, and 2
    # seeds give no interval at all
    verdict = stdout[stdout.index("verdict on the claim, by the registered design and thresholds of docs/claim.md"):]
    verdict = flat(verdict)  # wrapped to 100 columns: compared flat
    assert "sac_ln qed1000 vs te: not judged (exploratory: no pre-registration named (spec field claim); variant " \
           "sac_ln qed1000 vs te is not among the pre-registered mad_sac qed0.2, qed0.4 vs te; tasks: 0 of the 6 " \
           "pre-registered and 2 others; seeds: 2 on some task (pre-registered 15); budget: 2,000 env steps " \
           "(pre-registered 2,000,000);" in verdict
    assert verdict.count(": not enough seeds ") == 2 and " the claim: not judged, nothing: " in verdict
    assert "PASS" not in verdict and "FAIL" not in verdict
    assert {"gather/comparisons.csv", "gather/verdict.json"} <= arts
    results = json.loads(layout.results_json.read_text())
    (c,) = results["comparisons"]
    assert (c["variant"], c["pairing"], c["n_tasks"]) == ("qed1000", "paired", 2) and c["V_ratio_median"]["value"] > 0
    assert json.loads(layout.verdict_json.read_text()) == results["verdict"]
    for g in results["groups"]:  # the trials' history.json logged QED's shares at its floor and cap
        fractions = [g[k] for k in ("alpha_frac_floor", "alpha_frac_cap", "alpha_frac_cap_late")]
        assert all(0 <= f <= 1 for f in fractions) if g["variant"] == "qed1000" else fractions == [None] * 3
        assert 0 <= g["log_std_at_min"] <= 1
    _, rows = _csv(layout.groups_csv)
    for r in rows:  # k = 1000: every state at the floor (the share read 0 when compared after the alpha_TE step)
        if r["variant"] == "qed1000":
            assert float(r["alpha_frac_floor_late"]) >= 0.5 and float(r["alpha_frac_cap_late"]) == 0.0, r
            assert float(r["alpha_ratio_late"]) == pytest.approx(1.0, abs=1e-5), "alpha = alpha_TE: a ratio of 1"
            assert r["alpha_regime"] == "ok" and math.isfinite(float(r["entropy_gap_late"])), r
        else:
            assert r["alpha_regime"] == "" and math.isnan(float(r["alpha_frac_floor_late"])), r
    assert "P(this > te)" in stdout and 0 <= c["prob_improvement"]["value"] <= 1
    assert [(p["variant"], p["n_runs"]) for p in results["performance_profiles"]] == [("qed1000", 4), ("te", 4)]
    parent = tracker.client.get_run(pid)
    assert parent.data.tags["qed.verdict"] == results["verdict"]["outcome"] == "exploratory"
    assert all(g["random_score"] >= 0 for g in results["groups"]), "the learning floors' random-policy scores"
    assert {"sac_ln.qed1000/V_ratio_median", "sac_ln.qed1000/iqm_ratio", "sac_ln.qed1000/prob_improvement"} <= set(
        parent.data.metrics)
    assert "group/cartpole-balance/sac_ln.qed1000/alpha_frac_cap_late" in parent.data.metrics
    assert parent.data.tags["alpha_regime/cartpole-balance/sac_ln.qed1000"] == "ok"


def _groups_land_while_the_sweep_runs(tracker, parent_id: str, children: list, layout: SweepDir) -> None:
    """Each group's row reaches the parent run after its own trials ended; the first one before the sweep's last
    trial ended; every trial's worker signed the digest of its files with the session's results key."""
    from qed_ray.records.digests import digest, inventory
    from qed_ray.service.results_key import load_key

    end = {r.data.tags["qed.trial"]: r.info.end_time / 1000 for r in children}
    for r in children:
        name = r.data.tags["qed.trial"]
        files = json.loads(layout.done_marker(name).read_text())["files"]
        assert files == inventory(layout, name) and r.data.tags["qed.files_sha256"] == digest(files)
        assert r.data.tags["qed.results_key_id"] == load_key().id and len(r.data.tags["qed.files_hmac"]) == 64
    delays = {}
    for group in {n.rsplit("/", 1)[0] for n in end}:
        task, agent, variant = group.split("/")
        (row,) = tracker.client.get_metric_history(parent_id, f"group/{task}/{agent}.{variant}/V")
        last = max(t for n, t in end.items() if n.startswith(group + "/"))
        delays[group] = row.timestamp / 1000 - last
        assert delays[group] > 0, "a group is gathered only after its seeds finished"
    first = min(delays, key=lambda g: delays[g] + max(t for n, t in end.items() if n.startswith(g + "/")))
    landed = delays[first] + max(t for n, t in end.items() if n.startswith(first + "/"))
    assert landed < max(end.values()), f"{first} reached MLflow only after the last trial ended"
    cached = sorted(p.stat().st_mtime for p in layout.group_cache.glob("*.json"))
    assert len(cached) == 4 and cached[0] < max(layout.done_marker(n).stat().st_mtime for n in end)
    print(f"\nseconds from a group's last trial ending to its row in MLflow: {delays}")


def test_crashing_trials_are_retried_from_their_checkpoint_and_a_killed_driver_resumes_without_retraining(
        tmp_path, ray_head):
    # Every trial that starts fresh crashes at env step 1500 (after its first checkpoint) and Tune retries it from
    # that checkpoint; the driver is killed once the first trial is done.
    spec = tiny_spec(tmp_path, "kill", seeds=2, max_concurrent_trials=1,
                     train={**TINY_TRAIN, "debug": {"crash_at_env_step": 1500}})
    sweep_dir = tmp_path / "results" / "kill"
    driver = subprocess.Popen([sys.executable, "-m", "qed_ray.sweep", str(spec)], cwd=ROOT, env=ray_head.env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: done_markers(sweep_dir), 300, "the first trial's DONE marker", poll_s=0.5, alive=driver)
        done_before = done_markers(sweep_dir)
        jobs = _job_workers(ray_head.tmp)
        assert jobs, "the driver's trial and gather actors run on the cluster"
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        snapshots = {p: p.stat().st_mtime_ns for d in done_before for p in d.parent.rglob("*")}
        # Ray ends a dead driver's actors (its trials, its gather actor); the next driver starts once they are gone.
        wait_for(lambda: not any(cmdline(p) for p in jobs), 120, "the killed driver's actors to end")
    finally:
        if driver.poll() is None:
            driver.kill()
    proc = run_sweep_cli(spec, env=ray_head.env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The killed driver's lock is stale (its pid is gone on this host): taken over, not a refusal.
    assert f"taking over the sweep's stale lock: its driver (pid {driver.pid} on this host) is gone" in proc.stdout
    # Trials the killed driver never started are "new" (Tune makes a trial's folder only when it starts it).
    assert f"2 trials ({len(done_before)} done, " in proc.stdout
    assert {p: p.stat().st_mtime_ns for p in snapshots} == snapshots, "finished trials were not re-trained"
    tracker, runs = sweep_runs(sweep_dir, "kill")
    children, layout = _children(runs), SweepDir(sweep_dir)
    assert len(children) == 2 and all(r.info.status == "FINISHED" for r in children)
    for r in children:
        steps = [m.step for m in tracker.client.get_metric_history(r.info.run_id, "eval/return_mean")]
        assert sorted(steps) == [1000, 2000], f"{r.data.tags['qed.trial']}: {steps}"
    assert len(done_markers(sweep_dir)) == 2
    # The trial that finished before the kill had crashed and resumed.
    (run,) = [r for r in children if layout.done_marker(r.data.tags["qed.trial"]) == done_before[0]]
    first = run.data.tags["qed.trial"]
    assert run.data.tags["qed.resumed_from_env_step"] == "1000", "resumed from the 1000-step checkpoint"
    (tune_dir,) = layout.pack_dirs(PackId.of([first]))
    assert "injected crash at env step 1500" in (tune_dir / "error.txt").read_text()  # Tune's error file


def test_diverging_trials_fail_loudly_with_their_reason_recorded_and_are_not_retried(tmp_path, ray_head):
    spec = tiny_spec(tmp_path, "nan", seeds=1, max_retries=2,
                     agents=[{"name": "sac_ln", "overrides": {"hidden": 16, "batch_size": 16},
                              "temperatures": [{"kind": "te"}, {"kind": "fixed", "alpha": 0.1}]}],
                     train={**TINY_TRAIN, "debug": {"nan": {"env_step": 1500}}, "nan_check_every": 10})
    proc = run_sweep_cli(spec, env=ray_head.env())
    assert proc.returncode == 1
    failed = [line for line in proc.stdout.splitlines() if line.startswith("FAILED cartpole-balance/sac_ln/te/0: ")]
    assert failed and "DivergenceError: non-finite loss/critic" in failed[0] and "by env step 1500" in failed[0]
    tracker, runs = sweep_runs(tmp_path / "results" / "nan", "nan")
    by_trial = {r.data.tags.get("qed.trial"): r for r in _children(runs)}
    layout = SweepDir(tmp_path / "results" / "nan")
    for trial in ("cartpole-balance/sac_ln/te/0", "cartpole-balance/sac_ln/fixed0.1/0"):
        assert by_trial[trial].info.status == "FAILED"
        assert "non-finite loss/critic" in by_trial[trial].data.tags["qed.failure_reason"]
        # Final: recorded in the folder, and not retried from the same checkpoint (max_retries 2 notwithstanding).
        marker = json.loads(layout.diverged_marker(trial).read_text())
        assert marker["reason"].startswith("DivergenceError: non-finite loss/critic") and marker["env_steps"] == 1500
        assert len(by_trial[trial].data.tags["qed.node_ids"].split(",")) == 1, "one attempt only"
        assert not (layout.pack_dirs(PackId.of([trial]))[0] / "error.txt").exists(), "Tune saw a pack that ended"
    parent = [r for r in runs if r.data.tags.get("qed.role") == "sweep"][0]
    assert parent.info.status == "FAILED" and "DivergenceError" in parent.data.tags["qed.failure_reason"]
    # Before the rerun, one trial's run is left RUNNING (as an MLflow outage at its end leaves it) and its
    # history.json is damaged: the driver names the file, still ends that run and every other, and ends its own.
    te = "cartpole-balance/sac_ln/te/0"
    tracker.client.update_run(by_trial[te].info.run_id, status="RUNNING")
    layout.history(te).write_text(layout.history(te).read_text()[:40])
    again = run_sweep_cli(spec, env=ray_head.env())  # a rerun does not retry diverged trials either: they are final
    assert again.returncode == 1 and "2 trials (0 done, 0 new, 2 diverged (final))" in again.stdout
    assert f"WARNING: {te}: {layout.history(te)}: not JSON" in again.stdout
    assert len(list(layout.tune_root.iterdir())) == 1
    _, runs = sweep_runs(layout.root, "nan")
    assert {r.data.tags.get("qed.trial"): r.info.status for r in runs} == {
        None: "FAILED", te: "FAILED", "cartpole-balance/sac_ln/fixed0.1/0": "FAILED"}, "none left RUNNING"

    # An unreadable sweep.json: --fresh cannot check the folder is this sweep's, so --force confirms moving it aside
    # (the refusals without it: test_sweep_state). The new sweep (more CPUs than the node has) is then refused.
    layout.state_file.write_text("{")
    spec.write_text(yaml.safe_dump({**yaml.safe_load(spec.read_text()), "resources": {"cpu": 1000, "gpu": 0}}))
    forced = run_sweep_cli(spec, "--fresh", "--force", env=ray_head.env())
    (backup,) = layout.root.parent.glob("nan.old-*")
    assert (backup / "sweep.json").read_text() == "{" and (backup / "policies").is_dir()
    assert f"--fresh: moved the previous sweep to {backup}" in forced.stdout
    assert forced.returncode == 2 and "resources: a trial asks for CPU=1000" in forced.stderr
