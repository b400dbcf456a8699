"""Packed trials end to end (issue 12's acceptance): the smoke sweep, reduced, with ``pack: {seeds: 3}`` on a real local
Ray cluster and a real SQLite MLflow store (slow: marked, run in CI)."""

import csv
import json
import math
from dataclasses import fields

import pytest
import yaml

from qed_ray.layout import DOCUMENTED, PackId, SweepDir
from qed_ray.analysis.results import Aggregate, BudgetIqm
from qed_ray.service.tracking import PACK_SIZE_TAG, PACK_TAG, run_name
from kit import GROUP_COLUMNS
from sweep_helpers import ROOT, run_sweep_cli, sweep_runs

pytestmark = pytest.mark.slow

TASKS, VARIANTS, SEEDS = ("cartpole-balance", "cheetah-run"), ("te", "qed0.2"), (0, 1, 2)
# What gather/ holds after a sweep, S = 1 or not (the documented layout; gather/behaviour/ is the visualiser's).
GATHER_FILES = {"results.json", "aggregates.csv", "groups.csv", "iqm_by_budget.csv", "comparisons.csv", "verdict.json",
                "figures", "cache"}


def _smoke_packed(tmp_path):
    """sweeps/smoke.yaml (2 tasks x 2 variants x 3 seeds) with tiny networks, short budgets and packs of 3 seeds."""
    spec = yaml.safe_load((ROOT / "sweeps" / "smoke.yaml").read_text())
    spec["agents"][0]["overrides"] = {"hidden": 16, "batch_size": 16}
    spec.update(train={"env_steps": 2000, "eval_every": 1000, "eval_episodes": 1, "warmup_decisions": 100},
                final_eval={"episodes": 2, "action_rollouts": 2, "action_steps": 20, "curve_episodes": 1,
                            "bootstrap_reps": 200},
                pack={"seeds": 3}, storage_path=str(tmp_path / "results"))
    path = tmp_path / "smoke.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _csv(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return list(rows[0]), rows


def test_smoke_sweep_in_packs_of_three_gathers_what_an_unpacked_one_does(tmp_path, ray_head):
    proc = run_sweep_cli(_smoke_packed(tmp_path), env=ray_head.env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "12 trials (0 done, 12 new) in 4 packs of up to 3 seeds" in proc.stdout
    assert "gather: 4 group(s) evaluated" in proc.stdout
    layout = SweepDir(tmp_path / "results" / "smoke")

    # gather/: the same files, columns and row keys as the unpacked sweep writes.
    assert {p.name for p in layout.gather.iterdir()} == GATHER_FILES
    # (behaviour/ is written by `python -m qed_ray.visualize`, policy_<policy>/ only with a second eval policy)
    assert {k.split("/")[1] for k in DOCUMENTED if k.startswith("gather/") and "behaviour" not in k
            and "policy_" not in k} == GATHER_FILES
    columns, rows = _csv(layout.aggregates_csv)
    assert columns == [f.name for f in fields(Aggregate)]
    assert sorted((r["agent"], r["variant"]) for r in rows) == sorted(("sac_ln", v) for v in VARIANTS)
    assert all(math.isfinite(float(r[k])) for r in rows for k in ("iqm", "ci_lower", "ci_upper", "V_mean"))
    columns, rows = _csv(layout.groups_csv)
    assert columns == GROUP_COLUMNS
    assert sorted((r["task"], r["agent"], r["variant"]) for r in rows) == sorted(
        (t, "sac_ln", v) for t in TASKS for v in VARIANTS)
    assert all(r["n_seeds"] == "3" and r["n_failed"] == "0" and math.isfinite(float(r["V"])) for r in rows)
    columns, rows = _csv(layout.budgets_csv)
    assert columns == [f.name for f in fields(BudgetIqm)]
    assert sorted((r["agent"], r["variant"], r["env_steps"]) for r in rows) == sorted(
        ("sac_ln", v, s) for v in VARIANTS for s in ("1000", "2000"))
    results = json.loads(layout.results_json.read_text())
    assert all(g["seeds"] == list(SEEDS) and [p[0] for p in g["v_curve"]] == [1000, 2000] for g in results["groups"])

    # Per seed run, outward, nothing changed: its own MLflow run (today's name, plus the pack's tags), its files.
    tracker, runs = sweep_runs(layout.root, "smoke")
    children = [r for r in runs if r.data.tags.get("qed.role") == "trial"]
    names = {f"{t}/sac_ln/{v}/{s}" for t in TASKS for v in VARIANTS for s in SEEDS}
    assert len(children) == 12 and {r.data.tags["qed.trial"] for r in children} == names
    for r in children:
        name = r.data.tags["qed.trial"]
        task, agent, variant, _ = name.split("/")
        assert r.info.status == "FINISHED" and r.info.run_name == run_name(name)
        assert r.data.tags[PACK_TAG] == f"{task}/{agent}/{variant}/pack0-2" and r.data.tags[PACK_SIZE_TAG] == "3"
        history = tracker.client.get_metric_history(r.info.run_id, "eval/return_mean")
        assert sorted(m.step for m in history) == [1000, 2000] and all(math.isfinite(m.value) for m in history)
        manifest = json.loads((layout.final_snapshot(name) / "manifest.json").read_text())
        assert r.data.tags["qed.policy_sha256"] == manifest["state_sha256"]
        assert [e["env_steps"] for e in manifest["evals"]] == [1000, 2000]
        assert json.loads(layout.done_marker(name).read_text())["env_steps"] == 2000
        assert not list(layout.replay(name).glob("chunk_*")), "pruned once its pack ended"
    for task in TASKS:
        for variant in VARIANTS:
            pack = PackId(task, "sac_ln", variant, SEEDS)
            assert sorted(layout.pack_checkpoint_steps(pack)) == [1000, 2000]
            final = layout.pack_checkpoint_steps(pack)[2000]
            assert {p.name for p in final.iterdir()} == {"pack.json", "seed_0", "seed_1", "seed_2"}
            assert json.loads((final / "pack.json").read_text())["status"] == ["finished"] * 3
    state = json.loads(layout.state_file.read_text())
    assert state["pack_seeds"] == 3 and sorted(state["packs"]) == sorted(
        PackId(t, "sac_ln", v, SEEDS).name for t in TASKS for v in VARIANTS)

    # A kill between two seeds' DONE.json writes of a pack's final evaluation (a spot preemption, an OOM kill) left
    # seed 2 without its marker while seeds 0 and 1 were done and their replay pruned: the next driver start resumes
    # the pack from its final checkpoint (a finished seed's replay is not read) and finishes seed 2, training nothing.
    pack, name = PackId("cartpole-balance", "sac_ln", "te", SEEDS), "cartpole-balance/sac_ln/te/2"
    done = json.loads(layout.done_marker(name).read_text())
    layout.done_marker(name).unlink()
    again = run_sweep_cli(_smoke_packed(tmp_path), env=ray_head.env())
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "12 trials (11 done, 1 resumed from env step 2,000, 0 new) in 4 packs of up to 3 seeds" in again.stdout
    assert json.loads(layout.done_marker(name).read_text()) == done, "the same end, from the same checkpoint"
    assert sorted(layout.pack_checkpoint_steps(pack)) == [1000, 2000] and not list(layout.replay(name).glob("*"))
