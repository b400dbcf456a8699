"""Re-analysis (``python -m qed_ray.gather SWEEP_DIR``) on a hand-built sweep folder with real snapshots, real rollouts
and a real SQLite MLflow store: cache hits, new settings, only gather/ and MLflow change (a child run of the
sweep's run per settings, with the new tables), tampered snapshots refused, MuJoCo's deprecation notices dropped."""

import csv
import hashlib
import json
import logging
import os

import pytest
import torch
from folder_helpers import SWEEP_ID, finish_running, is_nan, write_history

from kit import flat, outcomes
from qed_ray.rl.agents import make_agent
from qed_ray.records.checkpoint import read_manifest, save_checkpoint
from qed_ray.service.lock import SweepLock
from qed_ray.service.reanalysis import main as gather_main
from qed_ray.service.reanalysis import main, quiet_model_deprecations
from qed_ray.service.mlflow.tracking import Tracker, default_tracking_uri, open_sweep

SMALL = ["--episodes", "1", "--action-rollouts", "1", "--action-steps", "10", "--curve-episodes", "1",
         "--bootstrap-reps", "100"]
TE, QED = "cartpole-balance/sac_ln/te", "cartpole-balance/sac_ln/qed0.2"
SETTINGS = "episodes=1+action_rollouts=1+action_steps=10+curve_episodes=1+bootstrap_reps=100"  # SMALL's folder


def _gather_files(layout) -> dict:
    """The bytes of every file in gather/."""
    return {p: p.read_bytes() for p in layout.gather.rglob("*") if p.is_file()}


def _latest(layout, name: str):
    """``name`` in the re-analysis folder written last (``gather/reanalysis-<settings>/``; ``gather/`` keeps the
    sweep's own)."""
    return max(layout.reanalyses(), key=lambda p: (p / "results.json").stat().st_mtime_ns) / name


def _outside_gather(layout) -> dict:
    """SHA-256 of every file of the sweep folder outside gather/ and the MLflow store."""
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in layout.root.rglob("*")
            if p.is_file() and not {layout.gather, layout.mlartifacts} & set(p.parents) and p != layout.mlflow_db}


def _reanalysis_runs(layout):
    """The sweep's parent run, its tracker and ``{run name: run}`` of its re-analysis child runs."""
    tracker, parent = open_sweep(default_tracking_uri(layout.root), SWEEP_ID)
    runs = {r.info.run_name: r for r in tracker.runs() if r.data.tags["qed.role"] == "reanalysis"}
    return tracker, parent, runs


def _logged_as_child_run(layout, out: str, name: str, results: dict):
    """The re-analysis ``name`` is a FINISHED child run of the sweep's run holding its new tables, figures, summary
    (its description: te's row before QED's) and metrics; the sweep's run is left as it was."""
    assert f"MLflow: logged as run '{name}' under the sweep's run 'exp' (experiment 'exp')" in out
    tracker, parent, runs = _reanalysis_runs(layout)
    run = runs[name]
    assert run.info.status == "FINISHED" and run.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert run.data.params["final_eval.episodes"] == str(results["final_eval"]["episodes"])
    arts = {a.path for a in tracker.client.list_artifacts(run.info.run_id, "gather")}
    assert {"gather/aggregates.csv", "gather/comparisons.csv", "gather/verdict.json", "gather/results.json",
            "gather/summary.md", "gather/figures"} <= arts
    got = tracker.client.download_artifacts(run.info.run_id, "gather/results.json", str(layout.root.parent / name))
    assert json.loads(open(got).read()) == results, "the run holds this re-analysis's tables"
    te = next(a for a in results["aggregates"] if a["variant"] == "te")
    assert run.data.metrics["sac_ln.te/iqm"] == pytest.approx(te["iqm"])
    note = run.data.tags["mlflow.note.content"]
    assert note.startswith(f"### Re-analysis of sweep: {name.removeprefix('reanalysis ')}\n")
    assert note.index("| sac_ln | te |") < note.index("| sac_ln | qed0.2 |") and "*IQM: interquartile mean" in note
    assert "mlflow.note.content" not in parent.data.tags and not parent.data.metrics, "the sweep's run is as it was"
    return run


def test_reanalysis_evaluates_once_then_caches_and_changes_only_evaluation_outputs(sweep_copy, capsys, monkeypatch):
    layout = sweep_copy  # a copy of the session's template folder: its MLflow store points into the template
    before = _outside_gather(layout)
    assert main([str(layout.root), *SMALL]) == 0
    out = capsys.readouterr().out
    assert outcomes(out) == {TE: "evaluated", QED: "evaluated"}
    assert f"MLflow: {layout.root} was moved or copied: pointed 5 run(s) of its store from " in out
    assert f" to {layout.mlartifacts}\n" in out
    first = json.loads(_latest(layout, "results.json").read_text())
    assert layout.reanalyses() == [layout.reanalysis(SETTINGS)] and not layout.results_json.exists(), \
        "named for the settings that differ from the defaults (the folder has no gather of its own)"
    assert f"\nwrote {layout.reanalysis(SETTINGS)} (the sweep's own settings stay in {layout.gather})\n" in out
    _logged_as_child_run(layout, out, "reanalysis sweep settings", first)  # the parent's own final_eval
    te = next(g for g in first["groups"] if g["variant"] == "te")
    assert te["seeds"] == [0, 1] and [len(r) for r in te["returns"]] == [1, 1] and te["V"] >= 0
    assert te["learning_curves"] == {"0": [[1000, 100.0], [2000, 200.0]], "1": [[1000, 200.0], [2000, 300.0]]}
    qed = next(g for g in first["groups"] if g["variant"] == "qed0.2")
    assert qed["seeds"] == [0] and is_nan(qed["V"]), "the unfinished seed is left out, one seed has no V"
    assert first["failed_trials"] == [{"name": f"{QED}/1", "error": "did not finish (no DONE.json)"}]
    assert {(s["variant"], s["n_failed"]) for s in first["group_stats"]} == {("te", 0), ("qed0.2", 1)}

    assert main([str(layout.root), *SMALL]) == 0  # same settings: nothing is evaluated again
    out = capsys.readouterr().out
    assert outcomes(out) == {TE: "cached", QED: "cached"}
    assert json.loads(_latest(layout, "results.json").read_text()) == first
    assert list(_reanalysis_runs(layout)[2]) == ["reanalysis sweep settings"], "the same settings: the same run"
    _an_edited_cache_entry_is_refused_naming_it(layout, capsys, first)

    # The wrong store (an empty one: no trial of this sweep signed a digest there) would make every seed
    # unverified: refused before anything is read, gather/ keeps its outputs byte for byte.
    outputs = _gather_files(layout)
    empty = f"sqlite:///{layout.root.parent / 'empty.db'}"
    Tracker(empty, "other", "0000")
    assert main([str(layout.root), *SMALL, "--tracking-uri", empty]) == 2
    assert (f"error: --tracking-uri: {empty}: holds no signed digest of this sweep's trials"
            in capsys.readouterr().err)
    assert _gather_files(layout) == outputs
    assert main([str(layout.root), "--tracking-uri", f"sqlite:///{layout.root.parent / 'typo.db'}"]) == 2
    assert "no MLflow store at that path" in capsys.readouterr().err
    assert not (layout.root.parent / "typo.db").exists(), "no store is created for a mistyped URI"
    # A URI the service cannot use is refused as a spec's is, naming where it came from.
    assert main([str(layout.root), "--tracking-uri", "sqlite:///mlflow.db"]) == 2
    assert capsys.readouterr().err.startswith("error: --tracking-uri: 'sqlite:///mlflow.db' is not an absolute SQLite "
                                              "path (sqlite:/// and then a relative path; a Ray trial runs in another "
                                              "folder); use sqlite:////abs/path/mlflow.db (four slashes)")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "mlflow.example:5000")
    assert main([str(layout.root), *SMALL]) == 2
    assert capsys.readouterr().err.startswith("error: MLFLOW_TRACKING_URI: 'mlflow.example:5000' has unknown "
                                              "scheme 'mlflow.example'")
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert _gather_files(layout) == outputs
    # A damaged cache entry is named and its group evaluated again (the entry rewritten); the other stays cached.
    entry = next(p for p in layout.group_cache.glob("*.json")
                 if json.loads(p.read_text())["group"]["variant"] == "te")
    entry.write_text(entry.read_text()[:50])
    assert main([str(layout.root), *SMALL]) == 0
    out = capsys.readouterr().out
    assert f"WARNING: {entry}: not JSON" in out and outcomes(out) == {TE: "evaluated", QED: "cached"}
    assert json.loads(_latest(layout, "results.json").read_text()) == first and json.loads(entry.read_text())["key"] == entry.stem

    assert main([str(layout.root), *SMALL, "--episodes", "2", "--bootstrap-reps", "200"]) == 0
    out = capsys.readouterr().out
    assert out.count(": evaluated") == 2, "other episodes: another cache key"
    second = json.loads(_latest(layout, "results.json").read_text())
    _logged_as_child_run(layout, out, "reanalysis episodes=2 bootstrap_reps=200", second)
    assert len(_reanalysis_runs(layout)[2]) == 2
    te2 = next(g for g in second["groups"] if g["variant"] == "te")
    assert [len(r) for r in te2["returns"]] == [2, 2] and second["final_eval"]["episodes"] == 2
    assert te2["learning_curves"] == te["learning_curves"]
    assert te2["returns"][0][0] == pytest.approx(te["returns"][0][0], rel=1e-6), "episode 1 is the same episode"
    assert second["final_eval"]["bootstrap_reps"] == 200 and second["final_eval"]["action_steps"] == 10
    assert _outside_gather(layout) == before, "only gather/ changes (after the copy's store was relinked)"
    assert len(list(layout.group_cache.glob("*.json"))) == 4  # both settings stay cached

    assert main([str(layout.root), *SMALL, "--bootstrap-reps", "300"]) == 0  # tables only: no rollouts
    assert "evaluated" not in capsys.readouterr().out
    _paired_ratios_where_qed_sat_and_the_verdict(layout, capsys)


def _an_edited_cache_entry_is_refused_naming_it(layout, capsys, first: dict):
    """A forged cache entry: scores 0.999 and V 1e-6 written into te's cache entry (its key unchanged)."""
    (entry,) = [p for p in layout.group_cache.glob("*.json") if '"variant": "te"' in p.read_text()]
    kept = entry.read_bytes()
    forged = json.loads(kept)
    forged["group"]["scores"], forged["group"]["V"] = [0.999, 0.999], 1e-6
    entry.write_text(json.dumps(forged))
    assert main([str(layout.root), *SMALL]) == 1
    out = capsys.readouterr().out
    assert f"{TE}: REFUSED: {entry}: this cached group's content does not carry the results key's signature" in out
    results = json.loads(_latest(layout, "results.json").read_text())
    assert [g["variant"] for g in results["groups"]] == ["qed0.2"] and "0.999" not in json.dumps(results)
    entry.write_bytes(kept)
    assert main([str(layout.root), *SMALL]) == 0 and json.loads(_latest(layout, "results.json").read_text()) == first
    capsys.readouterr()


def _paired_ratios_where_qed_sat_and_the_verdict(layout, capsys):
    """QED's second seed finishes: te and QED then share seeds 0 and 1, so their comparison is paired; the alpha
    fractions come from the trials' history.json; the summary and gather/ carry the comparison and the verdict."""
    finish_running(layout, f"{QED}/1")
    write_history(layout, f"{QED}/0", floor=[0.1, 0.3], cap=[0.6, 0.8])
    write_history(layout, f"{QED}/1", floor=[0.2, 0.0], cap=[0.7, 0.9])
    assert main([str(layout.root), *SMALL]) == 0
    out = capsys.readouterr().out
    assert outcomes(out) == {TE: "cached", QED: "evaluated"}
    results = json.loads(_latest(layout, "results.json").read_text())
    qed = next(g for g in results["groups"] if g["variant"] == "qed0.2")
    assert qed["seeds"] == [0, 1] and results["failed_trials"] == []
    # per seed the mean over its evaluations, then over seeds; late: the evaluation at 2000 of 2000 env steps
    assert qed["alpha_frac_floor"] == pytest.approx(0.15) and qed["alpha_frac_cap"] == pytest.approx(0.75)
    assert qed["alpha_frac_floor_late"] == pytest.approx(0.15) and qed["alpha_frac_cap_late"] == pytest.approx(0.85)
    assert 0 <= qed["log_std_at_min"] <= 1 and is_nan(next(g for g in results["groups"] if g["variant"] == "te")[
        "alpha_frac_cap"]), "te logs no QED fractions"
    with open(_latest(layout, "groups.csv")) as f:
        rows = {r["variant"]: r for r in csv.DictReader(f)}
    assert rows["qed0.2"]["qed_at_cap"] == "True" and rows["te"]["qed_at_cap"] == "False"
    (c,) = results["comparisons"]
    assert (c["variant"], c["baseline"], c["pairing"], c["tasks"]) == ("qed0.2", "te", "paired", ["cartpole-balance"])
    te = next(g for g in results["groups"] if g["variant"] == "te")
    assert c["V_ratio_median"]["value"] == pytest.approx(te["V"] / qed["V"])  # one task: every summary is its ratio
    with open(_latest(layout, "comparisons.csv")) as f:
        assert float(next(csv.DictReader(f))["V_ratio_geomean"]) == pytest.approx(te["V"] / qed["V"])
    verdict = json.loads(_latest(layout, "verdict.json").read_text())
    assert verdict == results["verdict"] and verdict["claim_file"] is None
    (v,) = verdict["variants"]
    assert [(e["outcome"], e["lower"]) for e in v["endpoints"]] == [("not enough seeds", None)] * 2, "2 seeds"
    assert v["n_tasks_at_cap"] == 1 and v["scope"][0] == "no pre-registration named (spec field claim)"
    assert (v["outcome"], verdict["outcome"]) == ("exploratory", "exploratory")
    assert "qed0.2 vs te (1 tasks, 2+ seeds, intervals paired)" in out and "AT ITS CAP on 1 of 1 tasks" in flat(out)
    assert "sac_ln qed0.2 vs te: not judged (exploratory: no pre-registration named (spec field claim); " in flat(out)
    assert "the claim: not judged" in flat(out)
    run = _logged_as_child_run(layout, out, "reanalysis sweep settings", results)
    assert run.data.tags["qed.verdict"] == verdict["outcome"]
    assert "**Verdict on the claim: not judged**" in run.data.tags["mlflow.note.content"]


def test_a_tampered_snapshot_is_refused_naming_the_file(sweep_copy, capsys):
    layout = sweep_copy
    final = layout.snapshot(f"{TE}/1", 2000)
    manifest = read_manifest(final)
    other = make_agent(*_agent_args(manifest), torch.device("cpu"), 12345)
    # Someone with write access to the share rewrites the weights and a manifest that matches them.
    save_checkpoint(final, {k: m.state_dict() for k, m in other.modules().items()}, manifest)
    assert read_manifest(final).state_sha256 != manifest.state_sha256
    assert gather_main is main  # python -m qed_ray.gather runs this command
    assert main([str(layout.root), *SMALL]) == 1
    out = capsys.readouterr().out
    assert f"{TE}: REFUSED: {final / 'state.pt'}: has SHA-256" in out and "recorded in MLflow" in out
    results = json.loads(_latest(layout, "results.json").read_text())
    assert [g["variant"] for g in results["groups"]] == ["qed0.2"], "the refused group has no row"
    refused = [f for f in results["failed_trials"] if f["name"].startswith(TE)]
    assert len(refused) == 2 and all(str(final / "state.pt") in f["error"] for f in refused)


@pytest.mark.parametrize("signed", [True, False])
def test_a_finished_seed_whose_manifest_no_longer_parses_refuses_its_group(sweep_copy, capsys, signed):
    layout = sweep_copy
    manifest = layout.snapshot(f"{TE}/1", 2000) / "manifest.json"
    manifest.write_text('{"format_version": ')  # cut off
    assert main([str(layout.root), *SMALL, *([] if signed else ["--no-verify"])]) == 1, "not exit 0 without it"
    out = capsys.readouterr().out
    assert f"{TE}: REFUSED: {TE}/1: {manifest}" in out
    assert "refusing its group rather than evaluating it without the seed" in out
    results = json.loads(_latest(layout, "results.json").read_text())
    assert [g["variant"] for g in results["groups"]] == ["qed0.2"], "the refused group has no row"
    assert {f["name"] for f in results["failed_trials"] if f["name"].startswith(TE)} == {f"{TE}/0", f"{TE}/1"}


def test_a_seed_whose_digest_never_reached_mlflow_is_reported_unverified(sweep_copy, capsys):
    from mlflow.tracking import MlflowClient

    from qed_ray.service.mlflow.tracking import DIGEST_TAG, default_tracking_uri

    layout = sweep_copy
    client = MlflowClient(default_tracking_uri(layout.root))
    (run,) = [r for r in client.search_runs(client.search_experiments()[0].experiment_id.split())
              if r.data.tags.get("qed.trial") == f"{TE}/1"]
    client.delete_tag(run.info.run_id, DIGEST_TAG)  # what an outage at the trial's end leaves: no record
    assert main([str(layout.root), *SMALL]) == 1, "published, but the exit code says a seed went unchecked"
    out, err = capsys.readouterr()
    assert err.splitlines() == ["error: 1 seed was used unverified (the UNVERIFIED line above): exit 1; "
                                "--allow-unverified accepts them"]
    assert ("UNVERIFIED: 1 of 3 seeds were used without a check (no signed digest of their files in MLflow): no "
            "reason in its DONE.json (an older qed_ray's end cut off before its digest, or the digest deleted from "
            f"the tracking store): {TE} seed 1") in flat(out)
    assert main([str(layout.root), *SMALL, "--allow-unverified"]) == 0
    assert capsys.readouterr().err == ""
    te = next(g for g in json.loads(_latest(layout, "results.json").read_text())["groups"] if g["variant"] == "te")
    assert te["seeds"] == [0, 1] and te["unverified_seeds"] == [1]
    with open(_latest(layout, "groups.csv")) as f:
        assert {r["variant"]: r["n_unverified"] for r in csv.DictReader(f)} == {"te": "1", "qed0.2": "0"}


def test_a_live_driver_refuses_the_reanalysis(sweep_copy, capsys):
    import os
    import socket
    import time

    layout = sweep_copy
    now = time.time()  # a driver on this host whose pid is alive (this process), its heartbeat long ago (Ctrl-Z)
    layout.lock_file.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": now,
                                            "heartbeat": now - 999, "token": "driver"}))
    assert main([str(layout.root), *SMALL]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: sweep_dir: a driver runs this sweep now (pid {os.getpid()} on host ")
    assert not layout.gather.exists() and json.loads(layout.lock_file.read_text())["token"] == "driver"


def _agent_args(manifest):
    return manifest.run.agent, manifest.run.temperature, manifest.obs_dim, manifest.action_dim


def test_bad_input_is_refused_naming_the_flag_and_nothing_is_written(sweep_copy, tmp_path, capsys):
    layout = sweep_copy
    assert main([str(layout.root), "--episodes", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: --episodes: Input should be greater than or equal to 1")
    assert main([str(layout.root), "--confidence", "1.5"]) == 2
    assert "error: --confidence:" in capsys.readouterr().err
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "is not a sweep folder (no sweep.json)" in capsys.readouterr().err
    layout.mlflow_db.rename(layout.root / "moved.db")
    assert main([str(layout.root)]) == 2
    err = capsys.readouterr().err
    assert "error: --tracking-uri: no MLflow store" in err and "--no-verify" in err
    # A driver running this sweep rewrites gather/ itself: a re-analysis beside it is refused, naming it.
    with SweepLock(layout.lock_file):
        assert main([str(layout.root), "--no-verify"]) == 2
        assert capsys.readouterr().err.startswith(f"error: sweep_dir: a driver runs this sweep now (pid {os.getpid()}")
    # A symbolic link in gather/ leading out of the folder would write elsewhere: refused before anything is read.
    layout.gather.mkdir()
    (layout.gather / "figures").symlink_to(tmp_path)
    assert main([str(layout.root), "--no-verify"]) == 2
    assert f"error: sweep_dir: {layout.gather / 'figures'} is a symbolic link to {tmp_path}, outside the sweep " \
           f"folder" in capsys.readouterr().err
    (layout.gather / "figures").unlink()
    layout.results_json.write_text('{"sweep": 3}')
    assert main([str(layout.root), "--no-verify"]) == 2
    assert capsys.readouterr().err == (f"error: {layout.results_json}: sweep: Input should be a valid string (got 3) "
                                       f"(and 6 more problems)\n")
    layout.state_file.write_text("[]")
    assert main([str(layout.root), "--no-verify"]) == 2
    assert capsys.readouterr().err.startswith(f"error: {layout.state_file}: Input should be a valid dictionary")
    assert sorted(p.name for p in layout.gather.iterdir()) == ["results.json"], "a refused call writes nothing"


def test_mujoco_deprecation_notices_are_dropped_and_other_absl_warnings_kept(caplog):
    """dm_control passes MuJoCo's compiler notices to absl's logger each time it builds a model (cheetah's
    settotalmass); the re-analysis drops those, and only those."""
    from absl import logging as absl_logging
    from dm_control import suite

    absl = logging.getLogger("absl")
    kept = list(absl.filters)
    with caplog.at_level(logging.WARNING, logger="absl"):
        absl.filters.clear()
        suite.load("cheetah", "run")
        assert any("'settotalmass' is deprecated" in r.getMessage() for r in caplog.records), "the real notice"
        caplog.clear()
        quiet_model_deprecations()
        quiet_model_deprecations()  # once is enough: a second call adds no second filter
        assert len(absl.filters) == 1
        suite.load("cheetah", "run")
        absl_logging.warning("Nan, Inf or huge value in QACC at DOF 0")
    absl.filters[:] = kept
    assert [r.getMessage() for r in caplog.records if r.name == "absl"] == ["Nan, Inf or huge value in QACC at DOF 0"]
