"""``--status`` from the sweep folder alone, on a hand-built folder: unfinished, failed, finished, and the driver
holding the sweep's lock."""

import json
import math
import os
import socket
import subprocess
import sys
import time

import pytest
from folder_helpers import BUDGET, TEMPLATE_SWEEP, finished_trial, seed_checkpoint
from kit import counts, sweep_file, sweep_spec

from qed_ray.spec.console import PIPE_WIDTH, fit
from qed_ray.records.layout import PackId, SweepDir, seed_dir
from qed_ray.service.lock import SweepLock
from qed_ray.service.packing import Pack, form_packs
from qed_ray.service.reanalysis import main as reanalyze
from qed_ray.service.status import TrialState, driver, projected_wall_s, report, trial_state

TE, QED = "cartpole-balance/sac_ln/te", "cartpole-balance/sac_ln/qed0.2"
# The hand-built folder's trials (conftest.sweep_template): seed 1 of qed0.2 stopped at 1,000 env steps.
STOPPED = {"done": 3, "running": 0, "stopped": 1, "failed": 0, "not started": 0}
SPEC = {**TEMPLATE_SWEEP, "resources": {"cpu": 1, "gpu": 0.5}}  # the hand-built folder's sweep


def _alone(name: str) -> Pack:
    """The pack of one that trains trial ``name``."""
    (pack,) = [p for p in form_packs(sweep_spec(SPEC)) if p.names == [name]] or [
        Pack(PackId.of([name]), ())]
    return pack


def _checkpoint(layout: SweepDir, name: str, step: int, wall_s: float, cpu_s: float | None = None) -> None:
    """The seed's part of its pack of one's checkpoint (all --status reads of it) at ``step``."""
    pack = _alone(name).id
    folder = layout.pack_checkpoint(pack, step) / seed_dir(pack.seeds[0])
    seed_checkpoint(folder, name, step, wall_s, cpu_s=cpu_s)
    (folder.parent / "pack.json").write_text("{}")


def test_trial_states_from_the_folder(sweep_copy):
    layout, start = sweep_copy, "20260101-120000-0"

    def state(name, live=False):
        return trial_state(layout, name, BUDGET, _alone(name), live)

    assert state(f"{TE}/0") == TrialState(f"{TE}/0", "done", BUDGET, BUDGET, 20.0)
    assert state(f"{QED}/1") == TrialState(f"{QED}/1", "stopped", 1000, BUDGET, 10.0)
    assert state(f"{QED}/1", live=True).state == "running", "a driver runs the sweep"
    _checkpoint(layout, f"{QED}/1", 1500, 15.0)  # full checkpoints come at every evaluation, snapshots may not
    assert state(f"{QED}/1") == TrialState(f"{QED}/1", "stopped", 1500, BUDGET, 15.0)
    assert state(f"{QED}/7").state == "not started"
    tune_dir = layout.pack_dir(_alone(f"{QED}/7").id, start)
    tune_dir.mkdir(parents=True)  # Tune creates every pack's folder before it starts
    assert state(f"{QED}/7").state == "not started"
    (tune_dir / "params.json").write_text("{}")
    assert state(f"{QED}/7").state == "stopped", "started: no evaluation yet"
    time.sleep(0.01)
    error = layout.pack_dir(_alone(f"{QED}/1").id, start) / "error.txt"
    error.parent.mkdir(parents=True)
    error.write_text("Failure # 1\nTraceback ...\nInjectedCrash: injected crash at env step 1700\n")
    failed = state(f"{QED}/1")
    assert failed.state == "failed" and failed.error == ("InjectedCrash: injected crash at env step 1700 (the next "
                                                         "start retries it)"), "Tune gave up on it in that start"
    time.sleep(0.01)  # a newer checkpoint means the trial was retried and runs again
    _checkpoint(layout, f"{QED}/1", 2000 - 1, 19.0)
    assert state(f"{QED}/1").state == "stopped"
    layout.diverged_marker(f"{QED}/1").write_text(json.dumps({"reason": "DivergenceError: non-finite loss/critic",
                                                              "env_steps": 1990}))
    assert state(f"{QED}/1") == TrialState(
        f"{QED}/1", "failed", 1999, BUDGET, 19.0, "DivergenceError: non-finite loss/critic (final)")


def test_the_lock_shows_whether_and_which_driver_runs_the_sweep(sweep_copy):
    layout, spec = sweep_copy, sweep_spec(SPEC, storage_path=str(sweep_copy.root.parent))
    assert driver(layout) is None and "driver: none running" in report(spec, layout)
    with SweepLock(layout.lock_file):
        holder = driver(layout)
        assert holder.startswith(f"pid {os.getpid()} on host {socket.gethostname()} (started ")
        text = report(spec, layout)
        assert f"driver: {holder}" in text and counts(text, "trials") == {**STOPPED, "running": 1, "stopped": 0}
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    layout.lock_file.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": 1.0,
                                            "heartbeat": time.time(), "token": "x"}))
    assert driver(layout) is None, "a lock whose driver is gone is stale: nobody runs the sweep"


def test_projection_scales_each_trial_to_its_budget():
    states = [TrialState("a", "done", 100, 100, 50.0), TrialState("b", "running", 20, 100, 20.0),
              TrialState("c", "not started", 0, 100, math.nan)]
    # a: 50 s as it took; b: 1 s per step -> 100 s; c: the median pace (0.5 and 1.0 -> 0.75) -> 75 s
    assert projected_wall_s(states) == pytest.approx(225.0)
    assert math.isnan(projected_wall_s([TrialState("c", "not started", 0, 100, math.nan)]))


def test_status_of_an_unfinished_then_finished_sweep(sweep_copy, capsys):
    layout = sweep_copy
    spec = sweep_spec(SPEC, storage_path=str(layout.root.parent))
    text = report(spec, layout)
    assert counts(text, "trials") == STOPPED
    assert "env steps: 7,000 of 8,000 (88%)" in text
    # spent: 20 + 20 + 20 + 10 s of trial wall time; projected: 60 s done + 10 s/1000 steps x 2000 = 80 s
    assert f"GPU-hours: {70 * 0.5 / 3600:.3g} spent, {80 * 0.5 / 3600:.3g} projected" in text
    assert f"CPU-hours held: {70 / 3600:.3g} spent, {80 / 3600:.3g} projected" in text
    assert "results: 0 of 2 groups gathered" in text and "IQM" not in text

    assert reanalyze([str(layout.root), "--episodes", "1", "--action-rollouts", "1", "--action-steps", "10",
                      "--curve-episodes", "1", "--bootstrap-reps", "100"]) == 0
    capsys.readouterr()
    text = report(spec, layout)
    assert "results: 1 of 2 groups gathered" in text, "the te group is complete and cached; qed0.2 still runs"
    table = text.split("results: ", 1)[1].splitlines()
    (folder,) = layout.reanalyses()
    assert folder.name == "reanalysis-episodes=1+action_rollouts=1+action_steps=10+curve_episodes=1+bootstrap_reps=100"
    assert table[1] == f"re-analysis (python -m qed_ray.gather): gather/{folder.name}/", "--status names it"
    assert table[4].split()[:5] == ["sac_ln", "te", "1", "2", "0"]  # agent variant tasks runs left-out
    _unverified_and_edited_entries(layout, spec)

    finished_trial(layout, f"{QED}/1")
    text = report(spec, layout)
    assert counts(text, "trials") == {**STOPPED, "done": 4, "stopped": 0} and "env steps: 8,000 of 8,000" in text
    assert "results: 1 of 2 groups gathered" in text, "qed0.2's cache key changed with its new seed"


def test_cpu_hours_used_are_what_the_packs_measured_and_held_their_wall_time(sweep_copy):
    """Used: the CPU time the packs recorded, summed (no estimate while a started trial's files have none, as a
    qed_ray before it wrote them); held: pack wall time x CPUs per pack, whatever the CPU did meanwhile."""
    layout = sweep_copy
    spec = sweep_spec(SPEC, storage_path=str(layout.root.parent))
    held = f"CPU-hours held: {70 / 3600:.3g} spent, {80 / 3600:.3g} projected for the whole sweep (pack wall time x 1 "
    assert "CPU-hours used: no estimate (4 of 4 started trials' files were written before qed_ray measured it)" \
        in report(spec, layout).splitlines() and held in report(spec, layout)
    for name, cpu_s in zip(["cartpole-balance/sac_ln/te/0", "cartpole-balance/sac_ln/te/1", f"{QED}/0"], (8, 9, 7.5)):
        finished_trial(layout, name, cpu_s=cpu_s)  # as today's trainer writes them
    assert f"CPU-hours used: no estimate (1 of 4 started trials' files were written before qed_ray measured it; " \
           f"the others used {24.5 / 3600:.3g})" in report(spec, layout).splitlines()
    _checkpoint(layout, f"{QED}/1", 1500, 15.0, cpu_s=3.25)
    lines = report(spec, layout).splitlines()
    assert f"CPU-hours used: {27.75 / 3600:.3g} spent (measured CPU time of the packs' processes and env workers)" in \
        lines
    assert lines.index(next(x for x in lines if x.startswith("CPU-hours used"))) + 1 == \
        lines.index(next(x for x in lines if x.startswith("CPU-hours held"))), "side by side"


def _unverified_and_edited_entries(layout, spec):
    """--status counts the seeds a cached group used unchecked, and names a cache entry edited since."""
    from qed_ray.analysis import group_cache
    from qed_ray.analysis.results import GroupResult
    from qed_ray.service.results_key import load_key

    (entry,) = [p for p in layout.group_cache.glob("*.json") if '"variant": "te"' in p.read_text()]
    kept, raw = entry.read_bytes(), json.loads(entry.read_text())
    group = GroupResult.from_json(raw["group"]).model_copy(update={"unverified_seeds": [1]})
    group_cache.store(layout, raw["key"], group, load_key().secret)  # as the gather wrote it after an outage
    text = report(spec, layout)
    assert "results: 1 of 2 groups gathered" in text
    assert ("UNVERIFIED: 1 of 2 seeds were used without a check (no signed digest of their files in MLflow): no reason "
            "in its DONE.json (an older qed_ray's end cut off before its digest, or the digest deleted from the "
            "tracking store): cartpole-balance/sac_ln/te seed 1") in text
    raw["group"]["V"] = 1e-6
    entry.write_text(json.dumps(raw))
    text = report(spec, layout)
    assert "results: 0 of 2 groups gathered" in text and f"REFUSED {entry}: this cached group's content" in text
    entry.write_bytes(kept)


def test_status_flag_starts_nothing_and_reads_the_folder(sweep_copy, tmp_path):
    spec_path = sweep_file(tmp_path / "sweep.yaml", SPEC, storage_path=str(sweep_copy.root.parent))
    proc = subprocess.run([sys.executable, "-m", "qed_ray.sweep", str(spec_path), "--status"], capture_output=True,
                          text=True, timeout=120, env={"MUJOCO_GL": "disable", "PATH": "/usr/bin:/bin",
                                                       "RAY_ADDRESS": "127.0.0.1:1"})  # nothing to reach
    assert proc.returncode == 0, proc.stderr
    assert counts(proc.stdout, "trials") == STOPPED and proc.stderr == ""
    nowhere = SweepDir(tmp_path / "none" / "sweep")
    spec = sweep_spec(SPEC, storage_path=str(nowhere.root.parent))
    assert report(spec, nowhere).startswith(f"sweep sweep: not started ({nowhere.root} has no sweep.json). ")


def test_status_shows_each_seed_run_with_its_pack(sweep_copy):
    from qed_ray.records.sweep import read_state, write_state

    layout, start = sweep_copy, "20260101-120000-0"
    spec = sweep_spec(SPEC, storage_path=str(layout.root.parent), pack={"seeds": 2})
    write_state(layout, read_state(layout).model_copy(update={
        "pack_seeds": 2, "packs": {p.name: p.names for p in form_packs(spec)}}))
    pack = PackId("cartpole-balance", "sac_ln", "qed0.2", (0, 1))
    folder = layout.pack_checkpoint(pack, 1500)
    seed_checkpoint(folder / "seed_1", f"{QED}/1", 1500, 15.0, 2, 1)  # the seed's part of the pack's checkpoint
    (folder / "pack.json").write_text("{}")
    (pack_, ) = [p for p in form_packs(spec) if p.id == pack]
    assert trial_state(layout, f"{QED}/1", BUDGET, pack_) == TrialState(f"{QED}/1", "stopped", 1500, BUDGET, 15.0)
    text = report(spec, layout)
    assert "packs (2, up to 2 seeds each): seed: state [env steps]" in text
    assert f"  {TE}/pack0-1  0:done  1:done\n  {QED}/pack0-1  0:done  1:stopped[1,500]" in text
    # A pack's seed runs share its wall time: (20 + 20 + 20 + 15) s / 2 seeds per pack x 0.5 GPU.
    assert "GPU-hours: 0.00521 spent" in text and "(pack wall time x 0.5 GPU per pack)" in text
    time.sleep(0.01)
    error = layout.pack_dir(pack, start) / "error.txt"  # Tune's error file is the pack's
    error.parent.mkdir(parents=True)
    error.write_text("Failure # 1\nTraceback ...\nInjectedCrash: injected crash at env step 1700\n")
    assert (f"FAILED {QED}/1 (pack {QED}/pack0-1): InjectedCrash: injected crash at env step 1700 (the next start "
            f"retries it)") in report(spec, layout)


def test_status_dir_needs_no_spec_and_imports_neither_torch_nor_ray(sweep_copy, tmp_path):
    from kit import cli_run

    from qed_ray.records.sweep import read_state, write_state
    from qed_ray.service.sweep_state import plan

    layout, spec = sweep_copy, sweep_spec(SPEC, storage_path=str(sweep_copy.root.parent))
    state = layout.state_file
    proc, _ = cli_run(tmp_path, "qed_ray.sweep", "--status", "--dir", str(layout.root))
    assert proc.returncode == 2 and proc.stderr == (
        f"error: {state}: records no spec (an older qed_ray wrote it; the next start records it); give the spec: "
        f"{sys.executable} -m qed_ray.sweep SPEC --status --dir {layout.root}\n")
    recorded = plan(None, spec).state.spec  # what a start writes into sweep.json
    assert recorded == spec.model_dump(mode="json")
    write_state(layout, read_state(layout).model_copy(update={"spec": recorded}))
    proc, loaded = cli_run(tmp_path, "qed_ray.sweep", "--status", "--dir", str(layout.root))
    assert (proc.returncode, proc.stderr) == (0, "") and loaded == [], loaded
    assert proc.stdout == fit(report(spec, layout, "given by --dir", PIPE_WIDTH), PIPE_WIDTH) + "\n", "100 columns"
    assert counts(proc.stdout, "trials") == STOPPED
    raw = json.loads(state.read_text())
    raw["spec"]["seeds"] = -3  # validated where it is read, as a spec file is
    state.write_text(json.dumps(raw))
    proc, _ = cli_run(tmp_path, "qed_ray.sweep", "--status", "--dir", str(layout.root))
    assert proc.returncode == 2 and proc.stderr == (
        f"error: {state}: spec.seeds: a count of -3 seeds; need 1 to 10,000 (or a list of seeds)\n")
    proc, _ = cli_run(tmp_path, "qed_ray.sweep", "--status", "--dir", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr == (f"error: --dir: {tmp_path} is not a sweep folder (no sweep.json); "
                                                    f"it holds the sweep folder(s) sweep: give --dir {layout.root}\n")
