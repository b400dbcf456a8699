"""A moved or copied local sweep folder keeps its MLflow artifacts: its own store (real SQLite, real MlflowClient, and
a real ``mlflow server`` in the slow test) is relinked to the copy's ``mlartifacts/``, by ``python -m
qed_ray relink`` or by the tracker a sweep start opens, and the artifacts download from the copy with the
original folder gone."""

import json
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from folder_helpers import SWEEP_ID
from mlflow.tracking import MlflowClient
from sweep_helpers import ROOT, MlflowServer, cli_env

from qed_ray.service.mlflow import relink
from qed_ray.records.layout import SweepDir
from qed_ray.service.mlflow.tracking import ROLE_TAG, Tracker, artifact_location, default_tracking_uri

FIGURE = "gather/figures"


def _with_artifacts(layout: SweepDir, tmp_path: Path) -> dict[str, str]:
    """Logs a figure to the sweep's parent run and a file to one trial's run with the real tracker (which relinks
    the folder first: it is itself a copy of the session's template); returns ``{run id: text}``."""
    tracker = Tracker(default_tracking_uri(layout.root), "exp", SWEEP_ID, artifact_location(
        default_tracking_uri(layout.root), layout))
    runs = tracker.runs()
    parent = next(r.info.run_id for r in runs if r.data.tags[ROLE_TAG] == "sweep")
    trial = tracker.trial_runs()["cartpole-balance/sac_ln/te/0"].info.run_id
    texts = {parent: "the parent's figure", trial: "a trial's file"}
    for run_id, text in texts.items():
        src = tmp_path / "upload" / run_id / "plot.txt"
        src.parent.mkdir(parents=True)
        src.write_text(text)
        tracker.log_artifact(run_id, src, FIGURE)
    assert all((layout.mlartifacts / r / "artifacts" / FIGURE / "plot.txt").read_text() == t for r, t in texts.items())
    return texts


def test_a_copied_folder_opens_its_own_artifacts_after_relink_with_the_original_gone(sweep_copy, tmp_path, capsys):
    texts = _with_artifacts(sweep_copy, tmp_path)
    copy = SweepDir(shutil.copytree(sweep_copy.root, tmp_path / "elsewhere" / "sweep"))
    sweep_copy.root.rename(tmp_path / "gone")  # nothing can be read from the original's path any more
    client = MlflowClient(default_tracking_uri(copy.root))
    run_ids = sorted(r.info.run_id for r in client.search_runs([client.get_experiment_by_name("exp").experiment_id]))
    assert len(run_ids) == 5 and all(client.list_artifacts(r, FIGURE) == [] for r in texts)  # silently lost
    capsys.readouterr()

    assert relink.main([str(copy.root)]) == 0
    out = capsys.readouterr().out
    assert out == (f"MLflow: {copy.root} was moved or copied: pointed 5 run(s) of its store from "
                   f"{sweep_copy.mlartifacts} to {copy.mlartifacts}\n")
    assert client.get_experiment_by_name("exp").artifact_location == str(copy.mlartifacts)
    assert [client.get_run(r).info.artifact_uri for r in run_ids] == [
        f"{copy.mlartifacts}/{r}/artifacts" for r in run_ids]
    for run_id, text in texts.items():
        assert [f.path for f in client.list_artifacts(run_id, FIGURE)] == [f"{FIGURE}/plot.txt"]
        got = client.download_artifacts(run_id, f"{FIGURE}/plot.txt", str(tmp_path / "download"))
        assert Path(got).read_text() == text
    assert not sweep_copy.root.exists()  # reading the copy recreated nothing at the original's path
    # A second run changes nothing and says so.
    assert relink.main([str(copy.root)]) == 0
    assert capsys.readouterr().out.startswith("nothing to relink: no artifact location of this sweep in ")
    assert client.get_run(run_ids[0]).info.artifact_uri == f"{copy.mlartifacts}/{run_ids[0]}/artifacts"


def test_a_tracker_opening_a_moved_folder_relinks_it_and_writes_into_it(sweep_copy, sweep_template, tmp_path,
                                                                        capsys):
    _with_artifacts(sweep_copy, tmp_path)
    assert not (sweep_template / "mlartifacts").exists(), "the copy's artifacts went into its own folder"
    moved = SweepDir(tmp_path / "moved")
    sweep_copy.root.rename(moved.root)
    capsys.readouterr()
    uri = default_tracking_uri(moved.root)
    tracker = Tracker(uri, "exp", SWEEP_ID, artifact_location(uri, moved))  # what a sweep start opens
    assert "was moved or copied: pointed 5 run(s)" in capsys.readouterr().out
    parent = next(r.info.run_id for r in tracker.runs() if r.data.tags[ROLE_TAG] == "sweep")
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: moved\n")
    tracker.log_artifact(parent, spec, "spec")
    assert (moved.mlartifacts / parent / "artifacts" / "spec" / "spec.yaml").read_text() == "name: moved\n"
    assert not sweep_copy.root.exists()
    # Only the folder's own SQLite store is relinked: a server, or a store elsewhere, is left alone.
    assert relink.own_store(uri, moved) and relink.own_store(f"sqlite:///{moved.root}/../moved/mlflow.db", moved)
    assert not relink.own_store(f"sqlite:///{tmp_path}/other/mlflow.db", moved)
    assert not relink.own_store("http://127.0.0.1:5000", moved)


def test_relink_refuses_a_folder_that_is_no_sweep_or_has_no_store(tmp_path, capsys):
    assert relink.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: sweep_dir: {tmp_path} is not a sweep folder (no sweep.json)\n"
    (tmp_path / "sweep.json").write_text(json.dumps({"sweep_id": SWEEP_ID}))
    assert relink.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"error: sweep_dir: {tmp_path} has no MLflow store (mlflow.db): a sweep "
                                       f"tracked by an MLflow server keeps its artifacts there, nothing to relink\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.json"]


@pytest.mark.slow
def test_mlflow_server_on_a_relinked_copy_serves_its_artifacts(sweep_copy, tmp_path):
    texts = _with_artifacts(sweep_copy, tmp_path)
    copy = SweepDir(shutil.copytree(sweep_copy.root, tmp_path / "copy"))
    sweep_copy.root.rename(tmp_path / "gone")
    done = subprocess.run([sys.executable, "-m", "qed_ray", "relink", str(copy.root)], cwd=ROOT, env=cli_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and f"to {copy.mlartifacts}" in done.stdout, done.stderr
    server = MlflowServer(tmp_path / "server", store_uri=default_tracking_uri(copy.root)).start()
    try:
        for run_id, text in texts.items():  # what the UI's artifact view fetches
            query = urllib.parse.urlencode({"run_uuid": run_id, "path": f"{FIGURE}/plot.txt"})
            with urllib.request.urlopen(f"{server.url}/get-artifact?{query}", timeout=30) as response:
                assert response.read().decode() == text
    finally:
        server.stop()


def test_an_artifact_location_edited_to_lead_out_of_the_folder_is_pointed_back_into_it(sweep_copy, tmp_path, capsys):
    import sqlite3

    elsewhere = tmp_path / "elsewhere"
    with sqlite3.connect(sweep_copy.mlflow_db) as conn:  # what a writer of the folder can do to its own store
        exp, old = conn.execute("SELECT experiment_id, artifact_location FROM experiments WHERE experiment_id IN "
                                "(SELECT experiment_id FROM runs)").fetchone()
        conn.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = ?", (str(elsewhere), exp))
        conn.execute("UPDATE runs SET artifact_uri = ? || substr(artifact_uri, ?)", (str(elsewhere), len(old) + 1))
    conn.close()
    done = relink.follow_move(sweep_copy)
    assert (done.old, done.new, done.experiments, done.runs) == ((str(elsewhere),), str(sweep_copy.mlartifacts), 1, 5)
    assert capsys.readouterr().out == (f"MLflow: {sweep_copy.root} had its store send artifacts out of the folder: "
                                       f"pointed 5 run(s) of its store from {elsewhere} to {sweep_copy.mlartifacts}\n")
    with sqlite3.connect(sweep_copy.mlflow_db) as conn:
        uris = [u for (u,) in conn.execute("SELECT artifact_uri FROM runs")]
    conn.close()
    assert len(uris) == 5 and all(u.startswith(f"{sweep_copy.mlartifacts}/") for u in uris), uris
    _with_artifacts(sweep_copy, tmp_path)  # written into the folder, nothing in elsewhere
    assert not elsewhere.exists()
