"""MLflow as a mirror of the sweep folder, on a real SQLite store: each evaluation logged once across attempts and
outages, reopened runs lose stale failure reasons, an unreachable server costs a warning, never an exception."""

import os
import socket

import pytest

from qed_ray.records.digests import Recorded
from qed_ray.records.run import HistoryEntry
from qed_ray.records.layout import SweepDir
from qed_ray.service.mlflow.tracking import Tracker, TrialRun, artifact_location, digest_tags, limit_http_retries, sweep_digests


def _history(*steps):
    return [HistoryEntry(time_ms=1_000_000 + s, metrics={"env_steps": s, "eval/return_mean": s / 100})
            for s in steps]


def _steps(tracker, run_id, key="eval/return_mean"):
    return sorted(m.step for m in tracker.client.get_metric_history(run_id, key))


@pytest.fixture
def store(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker(uri, "exp", "sweep0000001", artifact_location=str(tmp_path / "art"))
    return tracker, tracker.parent_run("exp", {}, {})


def test_each_evaluation_is_logged_once_across_attempts_and_retries(store):
    tracker, parent = store
    first = TrialRun(tracker.uri, "exp", "sweep0000001", parent, "t/sac_ln/te/0", {"seed": 0}, node_id="n1")
    assert first.sync(_history(1000, 2000))
    assert _steps(tracker, first.run_id) == [1000, 2000] and first.logged_up_to == 2000
    # A retried attempt (new process) resumed from the 2000 checkpoint: it finds the same run and continues it.
    second = TrialRun(tracker.uri, "exp", "sweep0000001", parent, "t/sac_ln/te/0", {"seed": 0}, node_id="n2")
    assert second.sync(_history(1000, 2000, 3000), tags={"qed.resumed_from_env_step": 2000})
    assert second.run_id == first.run_id and _steps(tracker, first.run_id) == [1000, 2000, 3000]
    # Logging entries again (an answer lost in transit) adds nothing: the points keep their recorded time.
    tracker.log_history(first.run_id, _history(1000, 2000, 3000), -1)
    assert _steps(tracker, first.run_id) == [1000, 2000, 3000]
    tags = tracker.tags(first.run_id)
    assert tags["qed.node_ids"] == "n1,n2" and tags["qed.resumed_from_env_step"] == "2000"
    assert "flag" not in tracker.client.get_run(first.run_id).data.metrics, "booleans are not metrics"
    assert second.finish(_history(1000, 2000, 3000), tags={"qed.status": "finished"})
    run = tracker.client.get_run(first.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["qed.status"] == "finished"
    assert len(tracker.trial_runs()) == 1


def test_a_reopened_run_drops_the_failure_reason_of_an_earlier_attempt(store):
    tracker, parent = store
    run_id = tracker.trial_run(parent, "t/sac_ln/te/1", {})
    tracker.end_run(run_id, failed_reason="InjectedCrash: boom")
    assert tracker.tags(run_id)["qed.failure_reason"] == "InjectedCrash: boom"
    again = TrialRun(tracker.uri, "exp", "sweep0000001", parent, "t/sac_ln/te/1", {})
    assert again.sync([])
    run = tracker.client.get_run(run_id)
    assert run.info.status == "RUNNING" and "qed.failure_reason" not in run.data.tags
    assert again.finish([], killed=True) and tracker.client.get_run(run_id).info.status == "KILLED"


def test_an_unreachable_server_costs_one_warning_and_no_exception(monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    said = []
    run = TrialRun(f"http://127.0.0.1:{port}", "exp", "sweep0000001", "parent", "t/sac_ln/te/0", {}, log=said.append)
    assert not run.sync(_history(1000)) and not run.sync(_history(1000, 2000))
    assert len(said) == 1 and said[0].startswith(f"WARNING: MLflow at http://127.0.0.1:{port} failed for "
                                                 f"t/sac_ln/te/0 (") and "metrics are kept" in said[0]
    assert not run.finish(_history(1000, 2000), timeout_s=0, retry_s=0)
    assert said[-1].startswith("WARNING: gave up ending the MLflow run of t/sac_ln/te/0 after 0 s")


def test_artifacts_stay_local_only_for_a_local_store(tmp_path):
    layout = SweepDir(tmp_path / "s")
    assert artifact_location(f"sqlite:///{tmp_path}/mlflow.db", layout) == str(layout.mlartifacts)
    assert artifact_location(f"file://{tmp_path}/mlruns", layout) == str(layout.mlartifacts)
    assert artifact_location("http://head:5000", layout) is None
    assert artifact_location("https://mlflow.example.org", layout) is None


def test_http_retries_are_bounded_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "90")
    limit_http_retries()
    assert (os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"], os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"],
            os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"]) == ("2", "1", "90")


def test_searches_read_every_page_of_runs(store):
    # A sweep may hold more trial runs than one MLflow search returns (50,000 at most; MAX_TRIALS is 100,000):
    # every search follows the page tokens. Seven trial runs in pages of three stand for that.
    tracker, parent = store
    paged = Tracker(tracker.uri, "exp", "sweep0000001", page_size=3)
    names = [f"t/sac_ln/te/{seed}" for seed in range(7)]
    for name in names:
        paged.set_tags(paged.trial_run(parent, name, {}), digest_tags(Recorded(f"d{name}", f"m{name}", "k")))
    one_page = paged.client.search_runs([paged.experiment_id], max_results=3)
    assert len(one_page) == 3 and one_page.token, "a single call stops at its page"
    assert sorted(paged.trial_runs()) == names and len(paged.runs()) == 8
    want = {name: Recorded(f"d{name}", f"m{name}", "k") for name in names}
    assert paged.recorded_digests() == want
    for name in ("newer", "newest"):  # listed newest first: the sweep's experiment is on the second page of two
        paged.client.create_experiment(name)
    first = [e.name for e in paged.client.search_experiments(max_results=2)]
    assert first == ["newest", "newer"]
    assert sweep_digests(tracker.uri, "sweep0000001", page_size=2) == want


def test_a_summary_longer_than_mlflows_tag_limit_is_cut_at_a_line_saying_where_the_rest_is():
    from qed_ray.service.mlflow.mirror import note

    text = "\n".join(f"| row {i} | {'x' * 40} |" for i in range(200))
    assert note(text[:4000]) == text[:4000]
    cut = note(text)
    assert len(cut) <= 5000 and cut.startswith(cut.split("\n\n*(cut")[0]) and text.startswith(cut.split("\n\n")[0])
    assert cut.split("\n\n")[0].endswith("x |"), "whole lines only"
    assert cut.endswith("\n\n*(cut to MLflow's tag limit: the whole summary is `gather/summary.md` in Artifacts)*")


def test_trial_runs_carry_their_parts_as_tags_and_a_name_that_fits_the_runs_list(store):
    tracker, parent = store
    name = "cheetah-run/sac_ln/qed0.2/3"
    # A run an older qed_ray created (named by its trial, no part tags) gets them when its trial runs again.
    old = tracker.client.create_run(tracker.experiment_id, run_name=name, tags={
        "qed.sweep_id": "sweep0000001", "qed.trial": name, "qed.role": "trial", "mlflow.parentRunId": parent})
    assert TrialRun(tracker.uri, "exp", "sweep0000001", parent, name, {}).sync([])
    new = tracker.trial_run(parent, "finger-turn_easy/mad_sac/te/10", {})
    runs = {r.info.run_id: r for r in tracker.runs()}
    tags = ("qed.task", "qed.agent", "qed.variant", "qed.seed", "qed.group")
    assert [runs[old.info.run_id].info.run_name, *(runs[old.info.run_id].data.tags[t] for t in tags)] == [
        "qed0.2 s3 cheetah-run sac_ln", "cheetah-run", "sac_ln", "qed0.2", "3", "cheetah-run/sac_ln/qed0.2"]
    assert [runs[new].info.run_name, *(runs[new].data.tags[t] for t in tags)] == [
        "te s10 finger-turn_easy mad_sac", "finger-turn_easy", "mad_sac", "te", "10", "finger-turn_easy/mad_sac/te"]
    assert len(runs) == 3 and set(tracker.trial_runs()) == {name, "finger-turn_easy/mad_sac/te/10"}
