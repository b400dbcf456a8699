"""A k search end to end (slow): the real CLI on the shared Ray head, Optuna's sampler, the real gather and MLflow.

Four points of packs of 2 seeds, two per round: Ctrl-C once the first two points are done, then the same command
runs only the remaining two and writes the front, its table and the spec fragment."""

import json
import os
import signal

import pytest
import yaml

from sweep_helpers import run_sweep_cli, start_sweep, sweep_runs, tiny_spec, wait_for
from qed_ray.records.layout import SweepDir

pytestmark = pytest.mark.slow


def _qed_done(layout: SweepDir) -> dict[str, int]:
    """``{trial: DONE.json's mtime}`` of the searched points' finished trials."""
    if not layout.policies_root.is_dir():
        return {}
    return {t.name: os.stat(layout.done_marker(t.name)).st_mtime_ns for t in layout.trials()
            if t.variant.startswith("qed") and layout.trial_state(t.name) == "done"}


def test_a_search_interrupted_after_two_points_runs_only_the_other_two_and_writes_its_front(tmp_path, ray_head):
    spec = tiny_spec(tmp_path, "ksearch", pack={"seeds": 2}, search={"trials": 4, "per_round": 2, "iqm_guard": 0.5})
    layout = SweepDir(tmp_path / "results" / "ksearch")
    proc = start_sweep(spec, tmp_path / "first.log", env=ray_head.env())
    try:
        first = wait_for(lambda: (d := _qed_done(layout)) and len(d) >= 4 and d, 1500, "two points done", poll_s=0.5,
                         alive=proc)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=600) == 130, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    first = _qed_done(layout)
    assert len(first) == 4, first  # the second round was stopped before any of its seeds finished

    again = run_sweep_cli(spec, env=ray_head.env(), timeout=1500)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    points = json.loads(layout.search_file.read_text())["points"]
    assert len(points) == 4 and len({p["k"] for p in points}) == 4
    assert all(0.05 <= p["k"] <= 2.0 for p in points)
    done = _qed_done(layout)
    assert len(done) == 8 and {n: done[n] for n in first} == first  # the first two points were not trained again
    assert "10 trials (6 done" in again.stdout  # te and the first two points done; only the other two trained

    out = layout.search_outputs
    table = (out / "front.md").read_text()
    assert "exploratory search" in table and table.count("| cartpole-balance | sac_ln | qed") == 4
    assert table.count("[not enough seeds: 2, an interval needs 3]") == 8 and table.count("not judged") == 4
    fragment = (out / "fragment.yaml").read_text()
    assert yaml.safe_load(fragment) == {"agents": []}
    assert "# Nothing chosen on cartpole-balance/sac_ln" in fragment
    assert (out / "front.png").stat().st_size > 10_000
    assert json.loads(layout.results_json.read_text())["verdict"] is None
    assert "Verdict" not in again.stdout and "verdict:" not in again.stdout.lower()
    assert "chosen: none" in again.stdout

    tracker, runs = sweep_runs(layout.root, "ksearch")
    parent = next(r for r in runs if r.data.tags.get("qed.role") == "sweep")
    logged = {os.path.basename(a.path) for a in tracker.client.list_artifacts(parent.info.run_id, "gather/search")}
    assert {"front.png", "front.md", "front.csv", "fragment.yaml"} <= logged
