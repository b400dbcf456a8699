"""Seeds by looks on real tiny sweeps (slow: marked, run in CI; one test, the smallest runs, the shared Ray head).

An exploratory adaptive sweep (looks at 3 and 4 seeds) is interrupted between its looks and restarted: it resumes
at look 2, trains only look 2's seeds and grows to its maximum, each look in ``looks.json`` and in MLflow. A sweep
judged by a claim file whose learning floor te cannot clear (looks at 3 and 6 seeds) is decided at the first look
(not enough data: te below its floor) and never trains the seeds of the second; its dry run prices both looks.
"""

import json
import signal
from pathlib import Path

import pytest
import yaml

from qed_ray.records.layout import SweepDir
from sweep_helpers import run_sweep_cli, start_sweep, sweep_runs, tiny_spec, wait_for

pytestmark = pytest.mark.slow

TWO_ARMS = [{"name": "sac_ln", "overrides": {"hidden": 16, "batch_size": 16},
             "temperatures": [{"kind": "te"}, {"kind": "qed", "k": 0.2}]}]


def _looks(layout: SweepDir) -> list[dict]:
    return json.loads(layout.looks_file.read_text()) if layout.looks_file.exists() else []


def _claim_file(tmp_path: Path) -> Path:
    """A claim block for the tiny design, with a learning floor (random + 0.99 of the way to 1) te cannot clear."""
    block = {"claim": "tiny", "agent": "sac_ln", "baseline": "te", "variants": ["qed0.2"],
             "tasks": ["cartpole-balance"], "seeds": 6, "env_steps": 2000, "pilot_env_steps": 1000,
             "final_episodes": 2, "final_policies": ["mean"], "confidence": 0.95, "bootstrap_reps": 200,
             "endpoints": {"guards": {"learned_above_random": 0.99}},
             "adaptive": {"start": 3, "step": 3, "max_seeds": 6}}
    path = tmp_path / "claim.md"
    path.write_text(f"# tiny\n\n```yaml claim\n{yaml.safe_dump(block)}```\n")
    return path


def test_looks_grow_resume_after_an_interrupt_and_stop_at_the_first_look(tmp_path, ray_head):
    # ---- an exploratory sweep grows to its maximum; interrupted between looks, it resumes at look 2
    spec = tiny_spec(tmp_path, "grows", seeds=4, agents=TWO_ARMS, adaptive={"start": 3, "step": 1, "max_seeds": 4})
    layout = SweepDir(tmp_path / "results" / "grows")
    driver = start_sweep(spec, tmp_path / "first.log", env=ray_head.env())
    log = tmp_path / "first.log"
    wait_for(lambda: "look 2 of 2: training its seeds" in log.read_text(), 900, "look 1 recorded and logged, look 2 "
             "started", alive=driver)
    driver.send_signal(signal.SIGINT)
    assert driver.wait(120) == 130, log.read_text()[-3000:]
    (first,) = _looks(layout)
    assert (first["look"], first["baseline_seeds"], first["ended"]) == (1, 3, "")
    assert first["next_seeds"] == {"te": 4, "qed0.2": 4}
    assert [(v["variant"], v["decision"]) for v in first["variants"]] == [("qed0.2", "exploratory")]
    trained = {p: p.stat().st_mtime_ns for p in layout.policies_root.glob("*__s[0-2]/DONE.json")}
    assert len(trained) == 6 and not list(layout.policies_root.glob("*__s3"))

    again = run_sweep_cli(spec, env=ray_head.env())
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "look 2 of 2: training its seeds" in again.stdout and "look 1 of 2" not in again.stdout
    assert "8 trials (6 done, 2 new)" in again.stdout, again.stdout[-3000:]
    assert {p: p.stat().st_mtime_ns for p in trained} == trained, "look 1's seeds are not trained again"
    looks = _looks(layout)
    assert [(k["look"], k["baseline_seeds"], k["next_seeds"], k["ended"]) for k in looks] == [
        (1, 3, {"te": 4, "qed0.2": 4}, ""), (2, 4, {}, "the last registered look (4 seeds)")]
    assert "estimates at the stopping look (2 of 2, 4 seeds of 4)" in again.stdout
    tracker, runs = sweep_runs(layout.root, "grows")
    (parent,) = [r for r in runs if r.data.tags.get("qed.role") == "sweep"]
    history = tracker.client.get_metric_history(parent.info.run_id, "look_seeds")
    assert sorted((m.step, m.value) for m in history) == [(1, 3.0), (2, 4.0)]
    assert parent.data.tags["qed.look2/qed0.2"] == "exploratory" and parent.data.tags["qed.look2/claim"] == "exploratory"

    # ---- judged by a claim whose floor te cannot clear: decided at look 1, look 2's seeds never trained
    claim = _claim_file(tmp_path)
    spec = tiny_spec(tmp_path, "stops", seeds=6, agents=TWO_ARMS, pack={"seeds": 3}, claim=str(claim),
                     adaptive={"start": 3, "step": 3, "max_seeds": 6})
    priced = run_sweep_cli(spec, "--dry-run")
    line = " ".join(priced.stdout.split()).split("adaptive: ")[1]
    assert line.startswith("looks at 3, 6 seeds"), line  # its hours: tests/service/test_looks.py
    stops = run_sweep_cli(spec, env=ray_head.env())
    assert stops.returncode == 0, stops.stdout[-3000:] + stops.stderr[-3000:]
    layout = SweepDir(tmp_path / "results" / "stops")
    (look,) = _looks(layout)
    assert look["te_below_floor"] == ["cartpole-balance"] and look["next_seeds"] == {}
    assert [(v["decision"], v["decided_at"], v["seeds"]) for v in look["variants"]] == [
        ("not enough data: te below its learning floor", 1, 3)]
    assert look["ended"].startswith("te's mean score is below its learning floor on cartpole-balance")
    assert len(list(layout.policies_root.glob("*__s[0-2]/DONE.json"))) == 6
    assert not list(layout.policies_root.glob("*__s[3-5]")), "look 2's seeds never start"
    verdict = json.loads(layout.verdict_json.read_text())
    assert [(v["look"], v["outcome"]) for v in verdict["variants"]] == [(1, "not enough data")]
