"""The sweep folder before and after training, without Ray: refusals (exit 2, the field named once, nothing created),
growing sweeps and the identity checks behind them, --dry-run against the folder, and the folder as the record
that MLflow is brought in line with."""

import json
import os
import pickle
import re
import threading
import time
import uuid

import pytest

from kit import TRAIN, counts, flat, sweep_file, sweep_spec
from qed_ray.records.digests import Recorded, digest
from qed_ray.records.layout import PackId, SweepDir
from qed_ray.service.packing import form_packs
from qed_ray.analysis.results import FailedTrial
from qed_ray.records.run import read_history
from qed_ray.records.sweep import SweepState, read_state, write_state
from qed_ray.service.sweep_state import check_folder, move_aside, outcome, plan, sync_runs
from qed_ray.service.mlflow.tracking import DIGEST_TAG, UNVERIFIED_TAG, Tracker, digest_tags

SEED0 = "cartpole-balance/sac_ln/te/0"

@pytest.fixture
def cli(monkeypatch, tmp_path, capsys):
    """Runs ``python -m qed_ray.sweep`` in-process; returns ``(exit code, stderr)``."""
    for key in ("TUNE_DISABLE_SIGINT_HANDLER", "RAY_AIR_NEW_OUTPUT", "QED_STORAGE_PATH", "QED_STORAGE_ROOT",
                "RAY_JOB_CONFIG_JSON_ENV_VAR", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TUNE_DISABLE_SIGINT_HANDLER", "0")  # restored after the test (main() sets it)
    monkeypatch.setenv("RAY_AIR_NEW_OUTPUT", "0")
    from qed_ray.service.sweep_cli import main

    def run(changes: dict, *flags: str):
        path = sweep_file(tmp_path / f"spec-{uuid.uuid4().hex[:6]}.yaml", changes)
        capsys.readouterr()
        code = main([str(path), *flags])
        out = capsys.readouterr()
        return code, out.err, out.out

    return run


def _error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("storage, field, says", [
    ("/", "storage_path", "resolves to /, the filesystem root"),
    ("/etc", "storage_path", "resolves to /etc, a system folder"),
    ("/usr/share/qed", "storage_path", "resolves to /usr/share/qed, inside the system folder /usr"),
    ("/home", "storage_path", "resolves to /home, a system folder"),
    ("~", "storage_path", "your home folder itself"),
    ("s3://bucket/qed", "storage_path", "is a URI; give a filesystem path"),
])
def test_storage_in_system_folders_is_refused_before_anything_exists(cli, tmp_path, monkeypatch, storage, field,
                                                                     says):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    name = f"qedtest-{uuid.uuid4().hex[:8]}"
    for flags in ((), ("--dry-run",)):
        code, err, _ = cli({"name": name, "storage_path": storage}, *flags)
        line = _error_line(err)
        assert code == 2 and line.startswith(f"error: {field}: ") and says in line, line
        assert line.count("storage_path") == 1
    for parent in ("/", "/etc", "/usr/share/qed", "/home", str(tmp_path / "home")):
        assert not os.path.exists(os.path.join(parent, name))


def test_env_override_is_named_and_checked_too(cli, monkeypatch, tmp_path):
    monkeypatch.setenv("QED_STORAGE_PATH", "/var/tmp/qed-results")
    code, err, _ = cli({"storage_path": str(tmp_path)}, "--dry-run")
    assert code == 2 and _error_line(err).startswith(
        "error: QED_STORAGE_PATH: '/var/tmp/qed-results' resolves to /var/tmp/qed-results, inside the system folder "
        "/var")


def test_relative_storage_under_ray_job_submit_is_refused_or_resolved_against_the_stable_root(cli, monkeypatch,
                                                                                             tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")  # what Ray's job supervisor gives the driver
    code, err, _ = cli({"storage_path": "results"})
    lines = err.splitlines()  # the reason, then the --runtime-env-json line to add (tests/service/test_front_door.py)
    assert code == 2 and lines[0] == (f"error: storage_path: 'results' is relative, and this Ray job's working folder "
                                      f"is the folder the Ray head was started in ({tmp_path}), not the folder the "
                                      f"job was submitted from.")
    assert """error:   --runtime-env-json '{"env_vars": {"QED_STORAGE_ROOT": "'"$PWD"'"}}'""" in lines
    assert len(lines) == 4 and all(ln.startswith("error: ") for ln in lines), err
    assert not (tmp_path / "results").exists()
    monkeypatch.setenv("QED_STORAGE_ROOT", str(tmp_path / "stable"))
    code, err, out = cli({"storage_path": "results"}, "--dry-run")
    assert code == 0, err
    # wrapped to 100 columns, a path longer than a line broken inside it: compared without white space
    assert "".join(f"-> {tmp_path / 'stable' / 'results' / 's'} (MLflow sqlite:///{tmp_path}/stable/results/s/mlflow.db"
                   .split()) in "".join(out.split())
    monkeypatch.setenv("QED_STORAGE_ROOT", "relative/root")
    code, err, _ = cli({"storage_path": "results"}, "--dry-run")
    assert code == 2 and _error_line(err) == "error: QED_STORAGE_ROOT: 'relative/root' must be an absolute path"


def test_a_folder_that_is_not_this_sweeps_is_never_written_or_moved(cli, tmp_path):
    storage = tmp_path / "results"
    (storage / "s").mkdir(parents=True)
    (storage / "s" / "notes.txt").write_text("mine")
    for flags in ((), ("--fresh",), ("--dry-run",)):
        code, err, _ = cli({"storage_path": str(storage)}, *flags)
        assert code == 2 and _error_line(err) == (
            f"error: storage_path: {storage / 's'} already holds files but no sweep.json, so it is not a sweep folder; "
            f"refusing to write into it (choose another name or storage_path)")
    assert [p.name for p in (storage / "s").iterdir()] == ["notes.txt"]
    # A folder holding another sweep (a --fresh backup, say) is not this one either, --fresh or not.
    other = SweepDir(storage / "s.old-20260101-000000")
    write_state(other, plan(None, sweep_spec()).state)
    for flags in ((), ("--fresh",)):
        code, err, _ = cli({"name": "s.old-20260101-000000", "storage_path": str(storage)}, *flags)
        assert code == 2 and _error_line(err).startswith(
            f"error: name: {other.root} holds the sweep 's', not 's.old-20260101-000000'")
    assert [p.name for p in other.root.iterdir()] == ["sweep.json"]
    assert sorted(p.name for p in storage.iterdir()) == ["s", "s.old-20260101-000000"]


def test_a_changed_trial_is_refused_by_the_run_and_the_dry_run_naming_the_field_once(cli, tmp_path):
    storage = tmp_path / "results"
    layout = SweepDir(storage / "s")
    write_state(layout, plan(None, sweep_spec()).state)
    layout.done_marker("cartpole-balance/sac_ln/te/0").parent.mkdir(parents=True)
    layout.done_marker("cartpole-balance/sac_ln/te/0").write_text("{}")
    first = layout.pack_checkpoint(PackId.of(["cartpole-balance/sac_ln/te/1"]), 1000)  # its pack's checkpoint
    first.mkdir(parents=True)
    (first / "pack.json").write_text("{}")
    layout.replay("cartpole-balance/sac_ln/te/1").mkdir(parents=True)  # and its replay: the trial started
    before = {p: p.stat().st_mtime_ns for p in storage.rglob("*")}
    changed = {"storage_path": str(storage), "seeds": 3,
               "train": {**TRAIN, "warmup_decisions": 200}}
    for flags in ((), ("--dry-run",)):
        code, err, out = cli(changed, *flags)
        line = _error_line(err)
        assert code == 2 and line == (
            "error: train.warmup_decisions: this sweep's 2 trial(s) ran with 100 (e.g. cartpole-balance/sac_ln/te/0), "
            "the spec now gives 200; a sweep's trials cannot change: restore the value, or start over with --fresh or "
            "another name")
    assert {p: p.stat().st_mtime_ns for p in storage.rglob("*")} == before, "nothing written, no lock left"
    # The dry run shows what a run would do with each trial, from the folder.
    code, err, out = cli({"storage_path": str(storage), "seeds": 3}, "--dry-run", "--list")
    assert code == 0, err
    assert f"sweep s: 3 trials in 3 packs (Tune trials) of up to 1 seed -> {layout.root}" in flat(out)
    status = dict(re.findall(r"(\S+/te/\d) [^\[\]]*\[([^\]]*)\]", flat(out)))
    assert status == {"cartpole-balance/sac_ln/te/0": "done", "cartpole-balance/sac_ln/te/1": "resume from env step "
                      "1,000", "cartpole-balance/sac_ln/te/2": "new"}
    assert counts(out, "trials") == {"done": 1, "resume": 1, "new": 1}


def test_a_sweep_folder_of_qed_ray_0_1_is_refused_in_one_line_and_left_as_it_is(cli, tmp_path):
    """qed_ray 0.1 trained a sweep's trials outside packs, in their own checkpoint and Tune folders; this release
    does not resume such a sweep (the run and the dry run say so in one line; nothing is written)."""
    storage = tmp_path / "results"
    layout = SweepDir(storage / "s")
    write_state(layout, plan(None, sweep_spec()).state.model_copy(update={"packs": {}}))
    (layout.root / "checkpoints" / "cartpole-balance__sac_ln__te__s0" / "0000001000").mkdir(parents=True)
    (layout.tune_root / "20260101-000000" / "cartpole-balance__sac_ln__te__s1").mkdir(parents=True)
    before = {p: p.stat().st_mtime_ns for p in storage.rglob("*")}
    for flags in ((), ("--dry-run",)):
        code, err, _ = cli({"storage_path": str(storage)}, *flags)
        assert code == 2 and _error_line(err) == (
            f"error: sweep_dir: {layout.root} was started by qed_ray 0.1, which trained its trials outside packs "
            f"(checkpoints/cartpole-balance__sac_ln__te__s0); this release does not resume it: finish it with qed_ray "
            f"0.1, or start over with --fresh or another name")
    assert {p: p.stat().st_mtime_ns for p in storage.rglob("*")} == before, "nothing written, no lock left"
    (layout.root / "checkpoints" / "cartpole-balance__sac_ln__te__s0").rename(
        layout.pack_checkpoints(PackId.of([SEED0])))  # a pack's folder: today's layout
    (layout.tune_root / "20260101-000000" / "cartpole-balance__sac_ln__te__s1").rmdir()
    assert not plan(read_state(layout), sweep_spec(), layout).problems


def test_growing_adds_only_new_trials_and_keeps_the_sweeps_identity():
    first = plan(None, sweep_spec())
    assert first.new == ["cartpole-balance/sac_ln/te/0", "cartpole-balance/sac_ln/te/1"] and not first.problems
    grown = plan(first.state, sweep_spec(seeds=3, tasks=["cartpole-balance", "pendulum-swingup"],
                                    agents=[{"name": "sac_ln", "overrides": {"hidden": 16},
                                             "temperatures": [{"kind": "te"}, {"kind": "qed", "k": [0.2, 0.3]}]}]))
    assert not grown.problems and len(grown.new) == 2 * 3 * 3 - 2
    assert grown.state.sweep_id == first.state.sweep_id and grown.state.created == first.state.created
    assert set(grown.state.trials) == set(first.state.trials) | set(grown.new)
    assert grown.state.trials["cartpole-balance/sac_ln/qed0.3/2"]["temperature.k"] == 0.3
    # How a trial executes is not what it is: a device or thread count may change.
    again = plan(grown.state, sweep_spec(seeds=3, tasks=["cartpole-balance", "pendulum-swingup"],
                                    train={**TRAIN, "device": "cpu", "threads": 2},
                                    agents=[{"name": "sac_ln", "overrides": {"hidden": 16},
                                             "temperatures": [{"kind": "te"}, {"kind": "qed", "k": [0.2, 0.3]}]}]))
    assert not again.problems and not again.new


def test_renamed_and_dropped_trials_are_refused_naming_the_setting():
    state = plan(None, sweep_spec()).state
    axis = plan(state, sweep_spec(agents=[{"name": "sac_ln", "overrides": {"hidden": [16, 32]},
                                      "temperatures": [{"kind": "te"}]}]))
    assert axis.problems == [
        "agent.hidden: now a grid axis, so 2 trial(s) of this sweep would be renamed (e.g. "
        "cartpole-balance/sac_ln/te/0 -> cartpole-balance/sac_ln/te+hidden=16/0) and lose their checkpoints and MLflow "
        "runs; keep agent.hidden as it was for this sweep, or start over with --fresh or another name"]
    fewer = plan(state, sweep_spec(seeds=[1]))
    assert fewer.problems == ["seeds: the spec no longer has 1 trial(s) of this sweep (e.g. cartpole-balance/sac_ln/"
                              "te/0); a sweep only grows: add them back, or start over with --fresh or another name"]
    replaced = plan(state, sweep_spec(agents=[{"name": "sac_ln", "overrides": {"hidden": 16},
                                          "temperatures": [{"kind": "fixed", "alpha": 0.1}]}]))
    assert [p.split(":")[0] for p in replaced.problems] == ["temperature.alpha", "temperature.kind"]


def test_a_sweep_json_from_before_trial_identities_is_upgraded_only_if_its_grid_is_unchanged():
    spec = sweep_spec()
    old = SweepState.model_validate({"sweep_id": "abc123abc123", "fingerprint": spec.fingerprint(), "created": 1.0})
    upgraded = plan(old, sweep_spec(seeds=3))
    assert upgraded.problems and upgraded.problems[0].startswith("trials: the spec's grid changed")
    same = plan(old, spec)
    assert not same.problems and not same.new and same.state.sweep_id == "abc123abc123"
    assert sorted(same.state.trials) == ["cartpole-balance/sac_ln/te/0", "cartpole-balance/sac_ln/te/1"]


def test_qed_records_its_target_alpha_and_a_sweep_from_before_its_default_changed_is_refused_in_one_line():
    """temperature.target_alpha's default became floor (App. C): a new sweep records it for every QED trial even at
    the default; a sweep.json of format 2 meant target_alpha: qed by ``qed0.2`` and is refused once, naming it."""
    qed = sweep_spec(agents=[{"name": "sac_ln", "overrides": {"hidden": 16},
                         "temperatures": [{"kind": "te"}, {"kind": "qed", "k": 0.2}]}])
    first = plan(None, qed)
    assert first.state.format == 3 and not first.problems
    assert first.state.trials["cartpole-balance/sac_ln/qed0.2/0"]["temperature.target_alpha"] == "floor"
    assert "temperature.target_alpha" not in first.state.trials[SEED0], "te has no QED target"
    old_trials = {n: {k: v for k, v in i.items() if k != "temperature.target_alpha"}
                  for n, i in first.state.trials.items()}
    old = first.state.model_copy(update={"format": 2, "trials": old_trials})
    assert plan(old, qed).problems == [
        "temperature.target_alpha: this sweep.json predates the default target_alpha: floor (paper App. C), and its 2 "
        "QED trial(s) (e.g. cartpole-balance/sac_ln/qed0.2/0) were named under the old default qed, so their names "
        "now mean another setting: finish them with the release that started them, or start over with --fresh or "
        "another name"]
    te_only = plan(plan(None, sweep_spec()).state.model_copy(update={"format": 2}), sweep_spec())
    assert not te_only.problems and te_only.state.format == 3, "no QED trial: adopted as it is"


def test_damaged_sweep_json_gives_the_way_out(tmp_path):
    layout = SweepDir(tmp_path / "s")
    layout.root.mkdir()
    layout.state_file.write_text('{"sweep_id": "ab')
    with pytest.raises(Exception, match=r"sweep.json: not JSON .*start over with --fresh --force"):
        check_folder(layout, sweep_spec())


def test_fresh_moves_everything_but_the_lock_aside(tmp_path):
    layout = SweepDir(tmp_path / "s")
    write_state(layout, plan(None, sweep_spec()).state)
    (layout.root / "policies").mkdir()
    layout.lock_file.write_text("{}")
    backup = move_aside(layout)
    assert backup.name.startswith("s.old-") and sorted(p.name for p in backup.iterdir()) == ["policies", "sweep.json"]
    assert [p.name for p in layout.root.iterdir()] == ["sweep.lock"]
    assert check_folder(layout, sweep_spec()) is None, "a folder holding only the lock is a new sweep's"


def _fake_trial(layout: SweepDir, name: str, steps: list[int], done: bool, files: dict | None = None):
    for s in steps:
        (layout.snapshot(name, s)).mkdir(parents=True)
        (layout.snapshot(name, s) / "manifest.json").write_text("{}")
    history = [{"time_ms": 1000 + s, "metrics": {"env_steps": s, "eval/return_mean": s / 10.0, "q/abs_diff_mean": 0.5,
                                                 "perf/eval_s": 1.0}} for s in steps]
    layout.history(name).write_text(json.dumps(history))
    if done:
        layout.done_marker(name).write_text(json.dumps({**history[-1]["metrics"], "files": files}))


FILES = {"2000/state.pt": "a" * 64, "2000/manifest.json": "b" * 64}


def test_the_folder_is_the_record_and_mlflow_is_brought_in_line(tmp_path):
    spec = sweep_spec(seeds=5)
    layout = SweepDir(tmp_path / "s")
    names = [t.name for t in spec.trials()]
    _fake_trial(layout, names[0], [1000, 2000], done=True, files=FILES)  # finished, its run never reached MLflow
    _fake_trial(layout, names[1], [1000, 2000], done=True, files=FILES)  # finished and FINISHED in MLflow
    _fake_trial(layout, names[2], [1000], done=False)        # interrupted: RUNNING in MLflow
    layout.policies(names[3]).mkdir(parents=True)
    layout.diverged_marker(names[3]).write_text(json.dumps({"reason": "DivergenceError: non-finite loss/critic",
                                                            "env_steps": 1500}))
    _fake_trial(layout, names[4], [1000, 2000], done=True, files=FILES)  # FINISHED, MLflow down as it recorded
    failures, unfinished = outcome(layout, spec, failed={})
    assert unfinished == [names[2]]
    assert [(f.name, f.error) for f in failures] == [(names[3], "DivergenceError: non-finite loss/critic")]

    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "s", "sweep0000001")
    parent = tracker.parent_run("s", {}, {})
    finished = tracker.trial_run(parent, names[1], {})
    tracker.log_history(finished, read_history(layout, names[1]), -1)
    signed = Recorded(digest(FILES), "m" * 64, "k" * 16)  # what its worker recorded
    tracker.set_tags(finished, digest_tags(signed))
    tracker.end_run(finished)
    unrecorded = tracker.trial_run(parent, names[4], {})
    tracker.log_history(unrecorded, read_history(layout, names[4]), -1)
    tracker.end_run(unrecorded)
    running = tracker.trial_run(parent, names[2], {})
    end_before = tracker.client.get_run(finished).info.end_time
    time.sleep(0.01)
    sync_runs(tracker, parent, layout, spec, failures, unfinished, form_packs(spec))
    runs = tracker.trial_runs()
    assert {n: r.info.status for n, r in runs.items()} == {names[0]: "FINISHED", names[1]: "FINISHED",
                                                           names[2]: "KILLED", names[3]: "FAILED",
                                                           names[4]: "FINISHED"}
    assert runs[names[1]].info.end_time == end_before, "a FINISHED run with its digest is not touched"
    assert runs[names[2]].info.run_id == running and "qed.failure_reason" not in runs[names[2]].data.tags
    assert runs[names[3]].data.tags["qed.failure_reason"] == "DivergenceError: non-finite loss/critic"
    steps = [m.step for m in tracker.client.get_metric_history(runs[names[0]].info.run_id, "eval/return_mean")]
    assert sorted(steps) == [1000, 2000], "the missing run was created with every evaluation once"
    # Only a trial's worker records its digest: the driver copies nothing from DONE.json, it flags the runs without.
    assert tracker.recorded_digests() == {names[1]: signed}
    assert {n for n, r in runs.items() if UNVERIFIED_TAG in r.data.tags} == {names[0], names[4]}
    assert runs[names[4]].data.tags[UNVERIFIED_TAG].startswith("no reason in its DONE.json (an older qed_ray's end cut off")
    assert runs[names[4]].info.run_id == unrecorded and DIGEST_TAG not in runs[names[4]].data.tags
    again = {n: r.info.end_time for n, r in runs.items()}
    sync_runs(tracker, parent, layout, spec, failures, unfinished, form_packs(spec))
    assert {n: r.info.end_time for n, r in tracker.trial_runs().items()} == again, "flagged once, then left alone"
    assert outcome(layout, spec, failed={names[2]: "InjectedCrash: boom"}) == (
        [FailedTrial(names[2], "InjectedCrash: boom"), failures[0]], []), "given up by Tune in this start"


def test_ctrl_c_and_sigterm_stop_the_trials_once_then_exit_at_once():
    import signal

    from qed_ray.service.sweep import Interrupt

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    interrupt = Interrupt()
    try:
        interrupt.install()
        assert not interrupt.stop_all()
        os.kill(os.getpid(), signal.SIGTERM)  # `ray job stop`
        assert interrupt.signum == signal.SIGTERM and interrupt.stop_all() and not interrupt("trial", {})
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # a second signal: exit now
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    lost = threading.Event()  # SweepLock.lost: the heartbeat found another driver's token
    on_loss = Interrupt(lost)
    assert not on_loss.stop_all()
    lost.set()
    assert on_loss.stop_all() and on_loss.signum is None, "a lost lock stops the trials as Ctrl-C does"
    assert not pickle.loads(pickle.dumps(on_loss)).stop_all(), "Tune pickles its stopper (tuner.pkl): no Event in it"


def test_a_signal_taken_between_two_starts_stops_the_next_one():
    """An adaptive sweep's looks are starts in one driver: Ctrl-C after one look's trials ended (its stopper still
    installed) must stop the next look before it trains, not vanish with the old stopper."""
    import signal

    from qed_ray.service.sweep import Interrupt

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        look_1 = Interrupt()
        look_1.install()
        os.kill(os.getpid(), signal.SIGINT)  # between the looks: look 1's stopper takes it
        look_2 = Interrupt()
        look_2.install()
        assert (look_1.signum, look_2.signum, look_2.stop_all()) == (signal.SIGINT, signal.SIGINT, True)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C still exits at once
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a search does between its rounds
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        calm = Interrupt()
        calm.install()
        assert calm.signum is None and not calm.stop_all(), "no signal taken: nothing carries over"
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_failed_trials_are_summed_up_by_the_line_that_says_why():
    from qed_ray.service.status import error_summary
    from qed_ray.service.sweep_state import sqlite_on_many_machines

    traceback = ("Failure # 1 (occurred at 2026-01-01_00-00-00)\nray::ImplicitFunc.train() (pid=1, ip=10.0.0.1)\n"
                 "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n"
                 "qed_ray.rl.trainer.InjectedCrash: injected crash at env step 2500\n")
    assert error_summary(traceback) == "qed_ray.rl.trainer.InjectedCrash: injected crash at env step 2500"
    oom = ("Failure # 2 (occurred at 2026-01-01_00-00-00)\n1 worker(s) were killed due to the node running low on "
           "memory.\nObject store memory usage: [...]\nRefer to the documentation on how to address it.\n")
    assert error_summary(oom) == "1 worker(s) were killed due to the node running low on memory."
    assert error_summary("") == "failed (no error message)"
    one_machine = [{"NodeManagerAddress": "10.0.0.1"}, {"NodeManagerAddress": "10.0.0.1"}]
    two_machines = [{"NodeManagerAddress": "10.0.0.1"}, {"NodeManagerAddress": "10.0.0.2"}]
    assert sqlite_on_many_machines("sqlite:////mnt/qed/mlflow.db", one_machine) is None
    assert sqlite_on_many_machines("http://head:5000", two_machines) is None
    assert sqlite_on_many_machines("sqlite:////mnt/qed/mlflow.db", two_machines).startswith(
        "tracking.uri: a SQLite store (sqlite:////mnt/qed/mlflow.db) on a cluster of 2 machines")


def test_trials_that_never_started_may_still_change_or_go(tmp_path):
    layout = SweepDir(tmp_path / "s")
    state = plan(None, sweep_spec(seeds=3)).state  # recorded by a start that a cluster check then refused, say
    layout.policies(SEED0).mkdir(parents=True)  # only seed 0 got anywhere
    fewer = plan(state, sweep_spec(seeds=1), layout)
    assert not fewer.problems and sorted(fewer.state.trials) == [SEED0]
    changed = plan(state, sweep_spec(seeds=1, train={**TRAIN, "warmup_decisions": 200}), layout)
    assert [p.split(":")[0] for p in changed.problems] == ["train.warmup_decisions"], "a started trial still may not"


def test_a_damaged_history_json_costs_its_trial_only_and_every_run_still_ends(tmp_path):
    spec = sweep_spec(seeds=3)
    layout = SweepDir(tmp_path / "s")
    names = [t.name for t in spec.trials()]
    for name in names:  # all finished while MLflow was down: their runs must be created and ended now
        _fake_trial(layout, name, [1000, 2000], done=True, files=FILES)
    layout.history(names[1]).write_text('[{"time_ms": 1, "metrics": {"env_st')  # cut off mid-write
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "s", "sweep0000001")
    parent = tracker.parent_run("s", {}, {})
    damaged = sync_runs(tracker, parent, layout, spec, [], [], form_packs(spec))
    assert [(f.name, f.error.split(": not JSON")[0]) for f in damaged] == [(names[1], str(layout.history(names[1])))]
    runs = tracker.trial_runs()
    assert {n: r.info.status for n, r in runs.items()} == dict.fromkeys(names, "FINISHED"), "none left RUNNING"
    logged = {n: sorted(m.step for m in tracker.client.get_metric_history(r.info.run_id, "eval/return_mean"))
              for n, r in runs.items()}
    assert logged == {names[0]: [1000, 2000], names[1]: [], names[2]: [1000, 2000]}
    assert layout.history(names[1]).read_text() == '[{"time_ms": 1, "metrics": {"env_st', "the file is kept as it is"
    assert sync_runs(tracker, parent, layout, spec, [], [], form_packs(spec)) == [], "in line: nothing read again"


def test_fresh_needs_force_to_move_aside_a_folder_whose_sweep_json_cannot_be_read(cli, tmp_path):
    storage = tmp_path / "results"
    layout = SweepDir(storage / "s")
    write_state(layout, plan(None, sweep_spec()).state)
    (layout.root / "policies").mkdir()
    layout.state_file.write_text('{"sweep_id": "ab')
    before = sorted(p.name for p in storage.rglob("*"))
    code, err, _ = cli({"storage_path": str(storage)}, "--fresh")
    assert code == 2 and _error_line(err) == (
        f"error: {layout.state_file}: not JSON (Unterminated string starting at: line 1 column 14; truncated or "
        f"damaged); --fresh cannot check that this folder holds the sweep 's': add --force to move it aside anyway "
        f"(nothing is deleted)")
    code, err, _ = cli({"storage_path": str(storage)}, "--force")
    assert code == 2 and _error_line(err).startswith("error: --force: only with --fresh")
    code, err, _ = cli({"storage_path": str(storage)})
    assert code == 2 and "start over with --fresh --force" in _error_line(err)
    assert sorted(p.name for p in storage.rglob("*")) == before, "nothing moved or written"
    assert check_folder(layout, sweep_spec(), fresh=True, force=True) is None, "--fresh --force: moved aside unchecked"
    layout.state_file.unlink()
    layout.state_file.symlink_to(tmp_path / "gone.json")  # a dangling link moves aside too
    backup = move_aside(layout)
    assert sorted(p.name for p in backup.iterdir()) == ["policies", "sweep.json"] and backup.joinpath(
        "sweep.json").is_symlink() and not any(layout.root.iterdir())


def test_a_fit_that_fails_outside_ray_is_a_failed_start_with_its_reason(tmp_path, monkeypatch, capsys):
    """A full disk under Tune: fit() raises an OSError of its own; the start reports its pending trials failed
    with the reason, in one line, and the driver goes on to its summary instead of dying with Tune's traceback."""
    from qed_ray.service import sweep as sweep_module
    from qed_ray.service.packing import form_packs
    from qed_ray.service.trial import TrialContext

    spec = sweep_spec()
    context = TrialContext(sweep_id="0123456789ab", sweep_dir=tmp_path / "s", tracking_uri="sqlite:////x/mlflow.db",
                           experiment="s", parent_run_id="p")

    class FullDisk:
        def fit(self):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(sweep_module, "build_tuner", lambda *args: FullDisk())
    failed = sweep_module.train_pending(spec, context, sweep_module.Interrupt(), [], form_packs(spec))
    why = ("this start failed in Tune (OSError: [Errno 28] No space left on device); the same command resumes it")
    assert failed == {"cartpole-balance/sac_ln/te/0": why, "cartpole-balance/sac_ln/te/1": why}
    assert capsys.readouterr().err == f"error: {why}\n"


def test_a_fresh_dry_run_shows_the_new_sweep_and_moves_nothing(tmp_path, capsys):
    """--fresh --dry-run shows what --fresh would start, not the plan of the sweep as it is."""
    from qed_ray.service.sweep_cli import main
    from qed_ray.records.sweep import write_state

    spec_file = sweep_file(tmp_path / "s.yaml", storage_path=str(tmp_path / "results"))
    layout = SweepDir(tmp_path / "results" / "s")
    layout.root.mkdir(parents=True)
    write_state(layout, plan(None, sweep_spec(storage_path=str(tmp_path / "results"))).state)
    (layout.policies("cartpole-balance/sac_ln/te/0") / "1000").mkdir(parents=True)  # started: it would resume
    before = sorted(p.relative_to(layout.root) for p in layout.root.rglob("*"))
    assert main([str(spec_file), "--dry-run", "--fresh"]) == 0
    out = capsys.readouterr().out
    assert flat(out).startswith(f"--fresh: {layout.root} would be moved aside first (nothing is deleted); the plan "
                                f"below is of a new sweep sweep s: "), out
    assert counts(out, "trials") == {"new": 2}
    assert sorted(p.relative_to(layout.root) for p in layout.root.rglob("*")) == before
    assert main([str(spec_file), "--dry-run", "--force"]) == 2
    assert capsys.readouterr().err.startswith("error: --force: only with --fresh")
