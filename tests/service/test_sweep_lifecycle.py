"""A sweep's life on a real local Ray cluster and a real ``mlflow server`` (slow: marked, run in CI).

One sweep is started, meets a second driver, loses its tracking server for 20 s, is stopped with Ctrl-C, is
resumed against a tracking server that moved to another port while growing from 2 to 3 seeds, loses its lock to a
third driver while its own is frozen (its machine asleep) and stops, and is finally refused a changed training
setting. A second sweep has one trial worker SIGKILLed and another killed by Ray's
memory monitor while the driver runs on. Each scenario is one sweep, so that every start earns its seconds.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml

from qed_ray.records.layout import PackId, SweepDir
from kit import lone_trial_process
from sweep_helpers import TINY_TRAIN, MlflowServer, cli_env, run_sweep_cli, start_sweep, sweep_runs, tiny_spec, wait_for

pytestmark = pytest.mark.slow

# Frame skip 2 here: the lock takeover needs seed 2 still training some 20 s after its first checkpoint. The killed
# workers' sweep only needs a moment to catch each trial between its first checkpoint and its end: 200 decisions.
TRAIN = {"env_steps": 3000, "eval_every": 1000, "eval_episodes": 1, "warmup_decisions": 100}
KILLED_TRAIN = {**TINY_TRAIN, "env_steps": 3000}
STEPS = [1000, 2000, 3000]
SEED = "cartpole-balance/sac_ln/te/{}".format


def _alone(name: str) -> PackId:
    """The pack of one that trains trial ``name`` (pack.seeds 1, the default)."""
    return PackId.of([name])


def _error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def _files(root) -> dict:
    return {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def _steps(tracker, run) -> list[int]:
    return sorted(m.step for m in tracker.client.get_metric_history(run.info.run_id, "eval/return_mean"))


@pytest.fixture
def server(tmp_path):
    """A real tracking server, stopped at the end whatever happens."""
    server = MlflowServer(tmp_path / "mlflow").start()
    yield server
    server.stop()


def test_second_driver_outage_ctrl_c_then_growth_against_a_moved_server(tmp_path, server):
    spec = tiny_spec(tmp_path, "life", seeds=2, max_concurrent_trials=1, train=TRAIN)
    layout = SweepDir(tmp_path / "results" / "life")
    driver = start_sweep(spec, tmp_path / "start1.log", env=cli_env(MLFLOW_TRACKING_URI=server.url))
    try:
        # One driver per sweep: a second one is refused at once, naming the first.
        wait_for(layout.lock_file.exists, 300, "the first driver's lock", alive=driver)
        second = run_sweep_cli(spec, env=cli_env(MLFLOW_TRACKING_URI=server.url))
        assert second.returncode == 2 and _error_line(second.stderr).startswith(
            f"error: {layout.lock_file}: this sweep is being run by another driver, pid {driver.pid} on host "
            f"{socket.gethostname()} (started ")
        # The tracking server goes away for 20 s right after the first trial's first evaluation.
        wait_for(lambda: layout.pack_checkpoint_steps(_alone(SEED(0))), 300, "seed 0's first checkpoint", alive=driver)
        server.stop()
        time.sleep(20)
        server.start(server.port)
        # Ctrl-C (SIGINT to the whole process group, as a terminal sends it) once seed 1 is under way.
        wait_for(lambda: layout.pack_checkpoint_steps(_alone(SEED(1))), 300, "seed 1's first checkpoint", alive=driver)
        os.killpg(driver.pid, signal.SIGINT)
        rc = driver.wait(timeout=120)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    log = (tmp_path / "start1.log").read_text()
    assert rc == 130, log[-4000:]
    assert "SIGINT: stopping the trials" in log and "nothing gathered" in log and not layout.gather.exists()
    assert not layout.lock_file.exists()
    tracker, runs = sweep_runs(layout.root, "life", server.url)
    by_trial = {r.data.tags.get("qed.trial"): r for r in runs}
    assert {t: r.info.status for t, r in by_trial.items()} == {None: "KILLED", SEED(0): "FINISHED",
                                                               SEED(1): "KILLED"}, "no FAILED run"
    assert _steps(tracker, by_trial[SEED(0)]) == STEPS, "the outage lost no evaluation and logged none twice"
    assert not any("qed.failure_reason" in r.data.tags for r in runs)

    # The second start: the server moved to another port, a stale lock lies around, the spec grew to 3 seeds.
    server.stop()
    server.start()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    layout.lock_file.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": 1.0,
                                            "heartbeat": time.time(), "token": "stale"}))
    finished_files = _files(layout.policies(SEED(0))) | _files(layout.pack_checkpoints(_alone(SEED(0))))
    finished_run = by_trial[SEED(0)]
    # (Two trials at a time now: how many run at once is not part of what a trial is.)
    spec.write_text(yaml.safe_dump({**yaml.safe_load(spec.read_text()), "seeds": 3, "max_concurrent_trials": 2}))
    env = cli_env(MLFLOW_TRACKING_URI=server.url)
    second, third = start_sweep(spec, tmp_path / "start2.log", env=env), None
    try:
        # Its machine sleeps while seed 2 trains: the driver is frozen (its trials are not), and a driver on another
        # machine finds its lock silent. The lock is made to look like that machine's with a stale heartbeat.
        wait_for(lambda: layout.pack_checkpoint_steps(_alone(SEED(2))), 300, "seed 2's first checkpoint", alive=second)
        os.kill(second.pid, signal.SIGSTOP)
        held = json.loads(layout.lock_file.read_text())
        old = time.time() - 600
        layout.lock_file.write_text(json.dumps({**held, "host": "sleeping-laptop", "heartbeat": old}))
        os.utime(layout.lock_file, (old, old))
        third = start_sweep(spec, tmp_path / "start3.log", env=env)
        wait_for(lambda: "taking over" in (tmp_path / "start3.log").read_text(), 300, "the takeover", alive=third)
        os.kill(second.pid, signal.SIGCONT)  # it wakes up: its heartbeat finds the other driver's token
        rc2 = second.wait(timeout=300)
        assert third.poll() is None, "the first driver stopped while the new one still trains"
        rc3 = third.wait(timeout=900)
    finally:
        for proc in (second, third):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGKILL)
    log2, log3 = ((tmp_path / f"start{i}.log").read_text() for i in (2, 3))
    assert f"taking over the sweep's stale lock: its driver (pid {dead.pid} on this host) is gone" in log2
    assert "3 trials (1 done, 1 resumed from env step " in log2 and ", 1 new) in 3 packs" in log2
    # The first driver stopped its trials and exited 3, leaving the sweep to the driver that took it over.
    assert rc2 == 3, log2[-4000:]
    lost = (f"{layout.lock_file} now belongs to another driver, pid {third.pid} on host {socket.gethostname()} "
            f"(started ")
    assert f"WARNING: {lost}" in log2 and "stopping this driver" in log2
    assert _error_line(log2).startswith(f"error: {lost}") and _error_line(log2).endswith(
        "this driver stopped its trials and leaves the sweep to the driver that holds it now")
    assert rc3 == 0, log3[-4000:]
    assert (f"taking over the sweep's stale lock: its driver (pid {second.pid} on host sleeping-laptop) sent no "
            f"heartbeat for 6") in log3
    # Seed 1 (resumed, running beside seed 2) may have reached its end while its driver was frozen: only the lock's
    # holder records a seed's end (its signed digest, then DONE.json), so the new driver finishes it and signs it.
    assert [line for line in log3.splitlines() if line.startswith("UNVERIFIED")] == []
    assert not layout.lock_file.exists()
    # Only the unfinished and the new trial ran in these starts; the finished one was not touched.
    start2, start3 = sorted(set(layout.tune_root.iterdir()) - {d.parent for d in layout.pack_dirs(_alone(SEED(0)))})
    packs = ["cartpole-balance__sac_ln__te__pack1", "cartpole-balance__sac_ln__te__pack2"]
    assert sorted(d.name for d in start2.iterdir() if d.is_dir()) == packs
    assert set(d.name for d in start3.iterdir() if d.is_dir()) <= set(packs)
    assert _files(layout.policies(SEED(0))) | _files(layout.pack_checkpoints(_alone(SEED(0)))) == finished_files
    tracker, runs = sweep_runs(layout.root, "life", server.url)  # the moved server has every run
    by_trial = {r.data.tags.get("qed.trial"): r for r in runs}
    assert {t: r.info.status for t, r in by_trial.items()} == {None: "FINISHED", SEED(0): "FINISHED",
                                                               SEED(1): "FINISHED", SEED(2): "FINISHED"}
    again = by_trial[SEED(0)]
    assert (again.info.run_id, again.info.end_time, again.data.metrics) == (
        finished_run.info.run_id, finished_run.info.end_time, finished_run.data.metrics)
    # No trial trained twice: each evaluation logged once (a deposed driver's trial stops before it writes or logs
    # anything more: it reads the lock before every evaluation's writes), every seed's files as its worker signed.
    assert all(_steps(tracker, by_trial[SEED(s)]) == STEPS for s in range(3))
    # seed 1 may have reached its end under the frozen driver: then it is resumed from its final checkpoint, only to
    # be signed (the files its worker recorded in files.json), never trained again
    assert int(by_trial[SEED(1)].data.tags["qed.resumed_from_env_step"]) in STEPS
    assert int(by_trial[SEED(2)].data.tags["qed.resumed_from_env_step"]) in STEPS[:-1], "the new driver resumed it"
    signed = {s for s in range(3) if "qed.files_hmac" in by_trial[SEED(s)].data.tags}
    assert signed == {0, 1, 2}, "every seed signed: none is left unverified"
    # Finished trials keep what gather and a rerun need, not their replay chunks.
    assert all(layout.trial_state(SEED(s)) == "done" and not layout.replay(SEED(s)).exists() for s in range(3))
    assert all(3000 in layout.snapshots(SEED(s)) for s in range(3))
    results = json.loads(layout.results_json.read_text())
    assert [g["seeds"] for g in results["groups"]] == [[0, 1, 2]]
    # Artifacts went through the tracking server, not to a client-side folder.
    parent = by_trial[None].info.run_id
    assert "gather/results.json" in {a.path for a in tracker.client.list_artifacts(parent, "gather")}
    assert list(server.artifacts.rglob("results.json")) and not layout.mlartifacts.exists()

    # A changed training setting is refused, naming it once; the folder is left as it was.
    state = layout.state_file.read_text()
    changed = yaml.safe_load(spec.read_text())
    spec.write_text(yaml.safe_dump({**changed, "train": {**changed["train"], "eval_episodes": 2}}))
    refused = run_sweep_cli(spec, env=cli_env(MLFLOW_TRACKING_URI=server.url))
    line = _error_line(refused.stderr)
    assert refused.returncode == 2 and line.startswith("error: train.eval_episodes: this sweep's 3 trial(s) ran with "
                                                       "1 (e.g. cartpole-balance/sac_ln/te/0), the spec now gives 2")
    assert line.count("eval_episodes") == 1 and layout.state_file.read_text() == state


def _meminfo() -> tuple[int, int]:
    fields = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in open("/proc/meminfo")}
    return fields["MemTotal"], fields["MemTotal"] - fields["MemAvailable"]


def _trial_worker(driver_pid: int, layout: SweepDir, name: str):
    """The pid of the Ray worker running trial ``name`` (the only trial running: max_concurrent_trials 1), once the
    trial has a checkpoint and is not done; None before."""
    if not layout.pack_checkpoint_steps(_alone(name)) or layout.trial_state(name) != "pending":
        return None
    return lone_trial_process(driver_pid)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# A program that takes the machine's memory half a GB at a time (up to 14 GB), until it is stopped.
HOG = "import numpy, time\nblocks = []\nfor _ in range(28):\n    blocks.append(numpy.ones(62_500_000))\n    " \
      "time.sleep(0.1)\ntime.sleep(600)"


def test_trial_workers_killed_from_outside_are_retried_while_the_driver_runs_on(tmp_path):
    # Ray's memory monitor, made sensitive: it kills a worker once the machine uses 6 GB more than now. The machine
    # is shared with other test files' clusters (scripts/test.sh runs three at a time), whose use moves by a few GB:
    # a helper process takes memory while a trial runs (as another program on a node would) until the kill, however
    # far that is.
    total, used = _meminfo()
    env = cli_env(RAY_memory_usage_threshold=f"{(used + 6e9) / total:.4f}", RAY_memory_monitor_refresh_ms="100")
    spec = tiny_spec(tmp_path, "killed", seeds=2, max_concurrent_trials=1, max_retries=2, train=KILLED_TRAIN)
    layout = SweepDir(tmp_path / "results" / "killed")
    driver = start_sweep(spec, tmp_path / "driver.log", env=env)
    hog = None
    try:
        # 1. A SIGKILLed trial worker (frozen first, so it cannot finish before the kill).
        pid = wait_for(lambda: _trial_worker(driver.pid, layout, SEED(0)), 300, "seed 0 running", alive=driver)
        os.kill(pid, signal.SIGSTOP)
        os.kill(pid, signal.SIGKILL)
        # 2. A trial worker killed by Ray's memory monitor.
        pid = wait_for(lambda: _trial_worker(driver.pid, layout, SEED(1)), 300, "seed 1 running", alive=driver)
        os.kill(pid, signal.SIGSTOP)
        hog = subprocess.Popen([sys.executable, "-c", HOG])
        wait_for(lambda: _gone(pid), 180, "Ray's memory monitor killing seed 1", poll_s=0.05, alive=driver)
        hog.kill()
        rc = driver.wait(timeout=600)
    finally:
        if hog is not None and hog.poll() is None:
            hog.kill()
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    log = (tmp_path / "driver.log").read_text()
    assert rc == 0, log[-4000:]
    assert "Trial task failed for trial cartpole-balance/sac_ln/te/pack0" in log  # Tune retried the SIGKILLed one
    assert "killed due to the node running low on memory" in log  # ... and the driver outlived the memory monitor
    tracker, runs = sweep_runs(layout.root, "killed")
    trials = {r.data.tags["qed.trial"]: r for r in runs if r.data.tags.get("qed.role") == "trial"}
    assert sorted(trials) == [SEED(0), SEED(1)] and all(r.info.status == "FINISHED" for r in trials.values())
    for run in trials.values():
        assert _steps(tracker, run) == STEPS
        assert int(run.data.tags["qed.resumed_from_env_step"]) in STEPS[:-1], "resumed from its checkpoint"
        assert len(run.data.tags["qed.node_ids"].split(",")) >= 2, "a second attempt"
