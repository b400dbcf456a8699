"""The sweep driver on more than one Ray node, all on this machine (slow: real Ray clusters; run in CI with -m slow).

1. Cluster-aware refusals (``check_cluster``): a two-node cluster from ``ray start`` whose worker node runs in a
   private mount namespace with a tmpfs over one folder, so that folder is "local to the driver's node" exactly as
   a local disk is on a real cluster. The sweep must refuse a ``storage_path`` or a SQLite ``tracking.uri`` there
   (exit 2, one line naming the field, no trial started), and, on any cluster, resources no node has.
2. Reliability: Ray's own multi-node test cluster (``ray.cluster_utils.Cluster``: one raylet per node, shared
   filesystem), a worker node removed while its trial runs; Tune retries the lost trial from its last checkpoint
   on another node, and MLflow still holds exactly one run per trial with one point per evaluation.

Isolation from other Ray users of this machine (private short temp folders, token auth, clean-up of only this
test's processes): tests/ray_cluster.py.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path
from types import SimpleNamespace

import pytest

from qed_ray.records.layout import PackId, SweepDir, trial_dirname
from kit import free_port, lone_trial_process
from ray_cluster import HEAD_RESOURCE, RAY, ray_env, short_tmp, start_head
from sweep_helpers import ROOT, TINY_TRAIN, done_markers, run_sweep_cli, sweep_runs, tiny_spec

pytestmark = pytest.mark.slow


NODES_SCRIPT = """
import json, sys, time, ray
ray.init(logging_level="ERROR", log_to_driver=False)
want, deadline = int(sys.argv[1]), time.time() + float(sys.argv[2])
while len(alive := [n for n in ray.nodes() if n["Alive"]]) < want and time.time() < deadline:
    time.sleep(0.5)
print(json.dumps([{"id": n["NodeID"], "head": %r in n["Resources"]} for n in alive]))
""" % HEAD_RESOURCE


def wait_for_nodes(env: dict, count: int, timeout: float = 180) -> list[dict]:
    """The cluster's live nodes (``{id, head}``) once ``count`` have joined (or the deadline passed)."""
    proc = subprocess.run([sys.executable, "-c", NODES_SCRIPT, str(count), str(timeout)], env=env,
                          capture_output=True, text=True, timeout=timeout + 60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def error_line(stderr: str) -> str:
    """The driver's single ``error: ...`` line (Ray may log other lines to stderr)."""
    lines = [ln for ln in stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def assert_no_trial_started(sweep_dir: Path) -> None:
    """A refused sweep leaves only its ``sweep.json`` id: no Tune state, trial folders, policies or MLflow db."""
    assert sorted(p.name for p in sweep_dir.iterdir()) == [SweepDir(sweep_dir).state_file.name]


# ---- 1. refusals on a cluster where one node cannot see a folder -------------------------------------------
@pytest.fixture(scope="module")
def blind_cluster():
    """Head (1 CPU) + worker (1 CPU) started with ``ray start``; the worker's mount namespace hides ``hidden``."""
    with short_tmp() as tmp:
        hidden = tmp / "hidden"
        hidden.mkdir()
        address = start_head(tmp, "--num-cpus=1")
        # --block keeps the worker node in the foreground of this namespace; killing its group ends it.
        join = (f"{RAY} start --address={address} --block --num-cpus=1 --temp-dir={tmp / 'ray'} "
                f"--dashboard-agent-listen-port={free_port()}")
        with open(tmp / "worker.log", "w") as log:
            worker = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c",
                                       f"mount -t tmpfs tmpfs {hidden} && exec {join}"],
                                      env=ray_env(tmp, address), start_new_session=True, stdout=log,
                                      stderr=subprocess.STDOUT)
        try:
            nodes = wait_for_nodes(ray_env(tmp, address), 2)
            assert len(nodes) == 2, (tmp / "worker.log").read_text()[-2000:]
            (worker_node,) = [n["id"] for n in nodes if not n["head"]]
            yield SimpleNamespace(env=ray_env(tmp, address), hidden=hidden, worker=worker_node)
        finally:
            try:
                os.killpg(worker.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            worker.wait(timeout=60)


def test_storage_path_invisible_to_a_worker_node_is_refused(blind_cluster, tmp_path):
    storage = blind_cluster.hidden / "results"
    spec = tiny_spec(tmp_path, "blind_store", storage_path=str(storage))
    proc = run_sweep_cli(spec, env=blind_cluster.env)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Exactly the worker node is named (by the first 8 hex digits of its id), not the head.
    assert error_line(proc.stderr).startswith(
        f"error: storage_path: {storage / 'blind_store'} is local to the driver's node; "
        f"nodes {blind_cluster.worker[:8]} cannot reach it.")
    assert "trials, results in" not in proc.stdout
    assert_no_trial_started(storage / "blind_store")
    assert not list(storage.glob("blind_store/.qed-reach-*")), "the reachability marker is removed"


def test_sqlite_tracking_uri_invisible_to_a_worker_node_is_refused(blind_cluster, tmp_path):
    # Storage is visible everywhere (tmp_path is not hidden), so that check passes and the next one speaks.
    db_dir = blind_cluster.hidden / "mlflow"
    db_dir.mkdir()
    spec = tiny_spec(tmp_path, "blind_db", tracking={"uri": f"sqlite:///{db_dir / 'mlflow.db'}"})
    proc = run_sweep_cli(spec, env=blind_cluster.env)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert error_line(proc.stderr).startswith(
        f"error: tracking.uri: {db_dir} is local to the driver's node; nodes {blind_cluster.worker[:8]} cannot "
        f"reach it.")
    assert_no_trial_started(tmp_path / "results" / "blind_db")
    assert list(db_dir.iterdir()) == [], "no MLflow store was created and the marker is removed"


# ---- 1c. resources no node has (the session's shared one-node cluster) --------------------------------------
@pytest.mark.parametrize("resources, asked", [({"cpu": 1, "gpu": 1}, "CPU=1, GPU=1"),
                                              ({"cpu": 64, "gpu": 0}, "CPU=64, GPU=0")])
def test_resources_no_node_has_are_refused_before_submitting(tmp_path, ray_head, resources, asked):
    from ray._private.utils import get_num_cpus

    proc = run_sweep_cli(tiny_spec(tmp_path, "greedy", resources=resources), env=ray_head.env())
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The node has the CPUs Ray detects here (cgroup-aware) and no GPU; the message lists them.
    assert error_line(proc.stderr) == (f"error: resources: a trial asks for {asked} but no node has that much "
                                       f"(nodes: CPU={get_num_cpus():g}, GPU=0)")
    assert_no_trial_started(tmp_path / "results" / "greedy")


# ---- 2. a worker node lost mid-sweep ---------------------------------------------------------------------
TRAIN = {**TINY_TRAIN, "env_steps": 5000}  # the victim is picked before 4000: 300 decisions or more to catch it
EVAL_STEPS = [1000, 2000, 3000, 4000, 5000]


def trial_nodes(db: Path) -> dict[str, list[str]]:
    """``{qed.trial: node ids it ran on}`` from the live MLflow SQLite store (read-only, tolerant of locks)."""
    if not db.exists():
        return {}
    try:
        with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)) as con:
            rows = con.execute("SELECT t.value, n.value FROM tags t JOIN tags n ON n.run_uuid = t.run_uuid "
                               "WHERE t.key = 'qed.trial' AND n.key = 'qed.node_ids'").fetchall()
    except sqlite3.DatabaseError:  # schema not created yet, or locked by a writer: ask again later
        return {}
    return {trial: nodes.split(",") for trial, nodes in rows}


def running_trial_with_checkpoint(sweep_dir: Path, names: dict[str, str], raylets: dict[str, int]):
    """``(trial, node, step, pid)`` of a trial running on a worker node (``raylets``: node id -> its raylet's pid)
    with a checkpoint in the sweep folder (its newest, at ``step``: Tune's own record of the report comes later)
    and at least two evaluations still to go; None if there is none yet."""
    layout = SweepDir(sweep_dir)
    nodes = trial_nodes(layout.mlflow_db)
    for trial in names.values():
        saved, ran_on = layout.pack_checkpoint_steps(PackId.of([trial])), nodes.get(trial, [])
        if saved and max(saved) < TRAIN["env_steps"] - TRAIN["eval_every"] and ran_on and ran_on[-1] in raylets \
                and not layout.done_marker(trial).exists() and (pid := lone_trial_process(raylets[ran_on[-1]])):
            return trial, ran_on[-1], max(saved), pid
    return None


def freeze_victim(sweep_dir: Path, names: dict[str, str], raylets: dict[str, int], driver, timeout: float = 900):
    """Waits for a trial to pick (see above) and SIGSTOPs its process, so it cannot finish before its node is
    removed (a lost machine stops everything at once); re-checks after stopping, resuming it if it slipped."""
    deadline = time.time() + timeout
    while driver.poll() is None and time.time() < deadline:
        victim = running_trial_with_checkpoint(sweep_dir, names, raylets)
        if victim is not None:
            os.kill(victim[3], signal.SIGSTOP)
            if running_trial_with_checkpoint(sweep_dir, names, raylets) == victim:
                return victim
            os.kill(victim[3], signal.SIGCONT)
        time.sleep(0.3)
    return None


def test_sweep_survives_losing_a_worker_node(tmp_path, monkeypatch):
    from ray._private.ray_constants import PROCESS_TYPE_RAYLET as RAYLET
    from ray.cluster_utils import Cluster

    from qed_ray.spec.sweep import load_spec

    spec_path = tiny_spec(tmp_path, "lose_node", seeds=2, train=TRAIN, max_retries=2)  # one trial per worker node
    names = {trial_dirname(r.name): r.name for r in load_spec(spec_path).runs()}
    sweep_dir = tmp_path / "results" / "lose_node"
    with short_tmp() as tmp:
        monkeypatch.setenv("RAY_TMPDIR", str(tmp))  # Cluster writes ray_current_cluster under it, not /tmp/ray
        # The head holds no CPU, so every trial runs on a worker node; each worker runs one trial at a time.
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "include_dashboard": False, "dashboard_agent_listen_port": free_port()})
        driver = None
        try:
            workers = {n.node_id: n for n in (cluster.add_node(num_cpus=1) for _ in range(2))}
            cluster.wait_for_nodes()
            with open(tmp_path / "out.log", "w") as out:
                driver = subprocess.Popen([sys.executable, "-m", "qed_ray.sweep", str(spec_path)], cwd=ROOT,
                                          env=ray_env(tmp, cluster.address), stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True)
            raylets = {i: n.all_processes[RAYLET][0].process.pid for i, n in workers.items()}
            victim = freeze_victim(sweep_dir, names, raylets, driver)
            assert victim is not None, (tmp_path / "out.log").read_text()[-3000:]
            lost_trial, lost_node, seen_step, pid = victim
            cluster.remove_node(workers[lost_node], allow_graceful=False)  # raylet, object store, agents: gone
            os.kill(pid, signal.SIGKILL)  # and the trial process (frozen, it cannot notice its raylet is gone)
            rc = driver.wait(timeout=1500)  # generous: CI shares 2 cores with the whole cluster
        finally:
            if driver is not None and driver.poll() is None:
                os.killpg(driver.pid, signal.SIGKILL)
            cluster.shutdown()
    log = (tmp_path / "out.log").read_text()
    assert rc == 0, log[-4000:]
    # Tune saw the trial's actor die with its node (then retried it: see the MLflow checks below).
    assert f"Trial task failed for trial {PackId.of([lost_trial]).name}" in log  # Tune's trial: its pack of one

    assert sorted(p.parent.name for p in done_markers(sweep_dir)) == sorted(names)
    tracker, runs = sweep_runs(sweep_dir, "lose_node")
    children = [r for r in runs if r.data.tags.get("qed.role") == "trial"]
    assert sorted(r.data.tags["qed.trial"] for r in children) == sorted(names.values()), "one run per trial"
    assert all(r.info.status == "FINISHED" for r in children)
    for r in children:
        steps = sorted(m.step for m in tracker.client.get_metric_history(r.info.run_id, "eval/return_mean"))
        assert steps == EVAL_STEPS, f"{r.data.tags['qed.trial']}: one point per eval, got {steps}"

    # Where each trial's attempts ran (qed.node_ids, appended by every attempt at its start).
    ran_on = {r.data.tags["qed.trial"]: r.data.tags["qed.node_ids"].split(",") for r in children}
    assert set().union(*ran_on.values()) == set(workers), "trials ran on both worker nodes, none on the CPU-less head"
    lost = next(r for r in children if r.data.tags["qed.trial"] == lost_trial)
    (survivor,) = set(workers) - {lost_node}
    assert ran_on.pop(lost_trial) == [lost_node, survivor], "lost with its node, retried once on the other one"
    assert all(len(nodes) == 1 for nodes in ran_on.values()), f"no other trial was disturbed: {ran_on}"
    # Resumed from the newest checkpoint in the sweep folder when the node went: at least the one we saw.
    resumed = int(lost.data.tags["qed.resumed_from_env_step"])
    assert resumed in EVAL_STEPS[:-1] and resumed >= seen_step
