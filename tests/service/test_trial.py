"""The worker side of a trial: the typed context that crosses the Ray boundary, the snapshot policy, and the one
trainable in this process (no Ray: ``tune.report`` outside a Tune session only warns) on real dm_control physics and
a real SQLite MLflow store: a NaN in one seed stops that seed only, a crashed pack resumes bit-exactly."""

import json
import math
import pickle

import pytest
import torch
from pydantic import ValidationError

from qed_ray.spec.config import RunSpec, TrainSpec
from qed_ray.records.layout import PackId, SweepDir
from qed_ray.rl.run_folder import snapshot_modules
from qed_ray.records.digests import Recorded, digest, inventory, key_id, signed
from qed_ray.service.mlflow.tracking import (DIGEST_TAG, GROUP_TAG, KEY_ID_TAG, MAC_TAG, PACK_SIZE_TAG, PACK_TAG, REASON_TAG,
                                      Tracker, run_name)
from qed_ray.rl.trainer import InjectedCrash
from qed_ray.service.trial import TrialContext, train_trial
from sweep_helpers import TINY_TRAIN

KEY = bytes(range(32))
CONTEXT = {"sweep_id": "0123456789ab", "sweep_dir": "/mnt/qed/sweeps/s", "tracking_uri": "http://head:5000",
           "experiment": "s", "parent_run_id": "abc", "keep_every": 2, "gpu_fraction": 0.1}


def test_context_is_typed_frozen_and_survives_pickling():
    ctx = TrialContext(**CONTEXT)
    assert ctx.layout == SweepDir("/mnt/qed/sweeps/s") and ctx.keep_every == 2
    assert pickle.loads(pickle.dumps(ctx)) == ctx  # how Ray ships it to a worker
    keyed = TrialContext(**CONTEXT, results_key=KEY.hex(), lock_token="t")
    assert KEY.hex() not in repr(keyed) and pickle.loads(pickle.dumps(keyed)).results_key == KEY.hex()
    with pytest.raises(ValidationError):
        ctx.keep_every = 3


@pytest.mark.parametrize("change, field", [({"keep_every": 0}, "keep_every"), ({"gpu_fraction": 1.5}, "gpu_fraction"),
                                           ({"sweep_id": ""}, "sweep_id"), ({"colour": "red"}, "colour"),
                                           ({"results_key": "not hex"}, "results_key")])
def test_bad_context_names_the_field(change, field):
    with pytest.raises(ValidationError, match=field):
        TrialContext(**{**CONTEXT, **change})
    missing = {k: v for k, v in CONTEXT.items() if k != "parent_run_id"}
    with pytest.raises(ValidationError, match="parent_run_id"):
        TrialContext(**missing)


def test_snapshots_keep_acting_modules_every_kth_eval_and_everything_at_the_end():
    train = TrainSpec(env_steps=6000, eval_every=1000)
    acting, every = ("encoder", "actor"), ("actor", "critic", "encoder", "model")
    kept = {s: snapshot_modules(s, train, 2, acting, every) for s in range(1000, 7000, 1000)}
    assert kept == {1000: None, 2000: acting, 3000: None, 4000: acting, 5000: None, 6000: every}
    kept = {s: snapshot_modules(s, train, 4, acting, every) for s in range(1000, 7000, 1000)}
    assert kept == {1000: None, 2000: None, 3000: None, 4000: acting, 5000: None, 6000: every}
    assert all(snapshot_modules(s, train, 1, acting, every) == acting for s in range(1000, 6000, 1000))


NAMES = ["cartpole-balance/sac_ln/te/0", "cartpole-balance/sac_ln/te/1"]


def _config(debug: dict, env_steps: int = 1000) -> dict:
    runs = [RunSpec.model_validate({
        "task": "cartpole-balance", "seed": s, "agent": {"hidden": 16, "batch_size": 16},
        "temperature": {"kind": "te"},
        "train": {**TINY_TRAIN, "env_steps": env_steps, "nan_check_every": 10, "debug": debug}}) for s in (0, 1)]
    return {"pack": {"name": "cartpole-balance/sac_ln/te/pack0-1",
                     "trials": [{"name": n, "run": r.model_dump(mode="json")} for n, r in zip(NAMES, runs)]}}


@pytest.mark.slow  # ~10 s: a real pack of two seeds trained to 1000 env steps
@pytest.mark.filterwarnings("ignore:`report` is meant to only be called")
def test_a_diverging_seed_fails_alone_and_the_pack_finishes_the_other(tmp_path):
    layout = SweepDir(tmp_path / "sweep")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "p", "sweep0")
    parent = tracker.parent_run("p", {}, {})
    context = TrialContext(sweep_id="sweep0", sweep_dir=layout.root, tracking_uri=uri, experiment="p",
                           parent_run_id=parent, mlflow_timeout_s=0, results_key=KEY.hex())
    train_trial(_config({"nan": {"seed": 1, "env_step": 600}}), context)

    marker = json.loads(layout.diverged_marker(NAMES[1]).read_text())
    assert marker["env_steps"] == 600 and marker["reason"].startswith("DivergenceError: non-finite loss/critic")
    assert "by env step 600" in marker["reason"] and not layout.done_marker(NAMES[1]).exists()
    assert layout.snapshots(NAMES[1]) == {}, "it diverged before its first evaluation"
    done = json.loads(layout.done_marker(NAMES[0]).read_text())
    assert done["env_steps"] == 1000 and math.isfinite(done["eval/return_mean"])
    assert list(layout.snapshots(NAMES[0])) == [1000] and not layout.diverged_marker(NAMES[0]).exists()
    pack = json.loads((layout.pack_checkpoint_steps(PackId.of(NAMES))[1000] / "pack.json").read_text())
    assert pack["status"] == ["finished", "diverged"] and pack["pack"] == "cartpole-balance/sac_ln/te/pack0-1"

    runs = {r.data.tags["qed.trial"]: r for r in tracker.runs() if "qed.trial" in r.data.tags}
    assert runs[NAMES[0]].info.status == "FINISHED" and runs[NAMES[1]].info.status == "FAILED"
    assert runs[NAMES[1]].data.tags[REASON_TAG] == marker["reason"]
    for name, run in runs.items():
        assert run.info.run_name == run_name(name) and run.data.tags["mlflow.parentRunId"] == parent
        assert run.data.tags[GROUP_TAG] == "cartpole-balance/sac_ln/te"
        assert (run.data.tags[PACK_TAG], run.data.tags[PACK_SIZE_TAG]) == ("cartpole-balance/sac_ln/te/pack0-1", "2")
    history = tracker.client.get_metric_history(runs[NAMES[0]].info.run_id, "eval/return_mean")
    assert [(m.step, m.value) for m in history] == [(1000, done["eval/return_mean"])]
    # The worker signed the digest of every file the gather reads of the finished seed; DONE.json lists them.
    tags = runs[NAMES[0]].data.tags
    assert sorted(done["files"]) == ["0000001000/manifest.json", "0000001000/state.pt", "history.json"]
    assert done["files"] == inventory(layout, NAMES[0])
    assert (tags[DIGEST_TAG], tags[KEY_ID_TAG]) == (digest(done["files"]), key_id(KEY))
    assert signed(KEY, "sweep0", NAMES[0], Recorded(tags[DIGEST_TAG], tags[MAC_TAG], tags[KEY_ID_TAG]))
    assert DIGEST_TAG not in runs[NAMES[1]].data.tags, "a diverged seed records none"


def _context(tmp_path, name: str, env_workers: int = 0) -> tuple[TrialContext, Tracker]:
    uri = f"sqlite:///{tmp_path / f'{name}.db'}"
    tracker = Tracker(uri, "p", "sweep0")
    return TrialContext(sweep_id="sweep0", sweep_dir=tmp_path / name, tracking_uri=uri, experiment="p",
                        parent_run_id=tracker.parent_run("p", {}, {}), mlflow_timeout_s=0,
                        env_workers=env_workers), tracker


@pytest.mark.slow  # ~20 s: a pack of two seeds crashed and resumed (its envs on a worker process), against one
# trained straight through in one process
@pytest.mark.filterwarnings("ignore:`report` is meant to only be called")
def test_a_crashed_pack_resumes_from_its_checkpoint_bit_exactly(tmp_path):
    config = _config({"crash_at_env_step": 1500}, env_steps=2000)
    straight, _ = _context(tmp_path, "straight")
    train_trial(_config({}, env_steps=2000), straight)
    crashed, tracker = _context(tmp_path, "crashed", env_workers=1)  # same bits whatever steps the envs
    with pytest.raises(InjectedCrash, match="injected crash at env step 1500"):
        train_trial(config, crashed)
    assert all(not crashed.layout.done_marker(n).exists() for n in NAMES)
    assert sorted(crashed.layout.pack_checkpoint_steps(PackId.of(NAMES))) == [1000]
    train_trial(config, crashed)  # what Tune's retry runs: the same config, resumed from the newest checkpoint
    for name in NAMES:  # the same tensors bit for bit (state.pt's own bytes name its staging file)
        a, b = (torch.load(c.layout.final_snapshot(name) / "state.pt", weights_only=True) for c in (straight, crashed))
        assert list(a) == list(b) == ["actor", "critic", "critic_target", "temperature"]
        assert all(torch.equal(a[m][k], b[m][k]) for m in a for k in a[m]), name
        a, b = (json.loads((c.layout.final_snapshot(name) / "manifest.json").read_text()) for c in (straight, crashed))
        assert a["env_steps"] == b["env_steps"] == 2000 and a["evals"] == b["evals"]
        first, last = (json.loads((crashed.layout.pack_checkpoint(PackId.of(NAMES), step) / "pack.json").read_text())
                       ["cpu_s"] for step in (1000, 2000))
        assert 0 < first < b["cpu_s"] <= last, "the CPU time of both starts, its env worker's included"
    runs = {r.data.tags["qed.trial"]: r for r in tracker.runs() if "qed.trial" in r.data.tags}
    for name in NAMES:
        assert runs[name].info.status == "FINISHED" and runs[name].data.tags["qed.resumed_from_env_step"] == "1000"
        steps = [m.step for m in tracker.client.get_metric_history(runs[name].info.run_id, "eval/return_mean")]
        assert sorted(steps) == [1000, 2000], "each evaluation logged once"


def _runs(tracker: Tracker) -> dict:
    return {r.data.tags["qed.trial"]: r for r in tracker.runs() if "qed.trial" in r.data.tags}


@pytest.mark.slow  # ~40 s: one pack of two seeds trained to 1000 env steps, then five later starts of its end
@pytest.mark.filterwarnings("ignore:`report` is meant to only be called")
def test_an_end_cut_off_is_finished_at_the_next_start_and_planted_files_are_never_signed(tmp_path, monkeypatch,
                                                                                           capsys):
    import shutil

    from qed_ray.analysis.checksums import TamperedSnapshotError, Verifier, verify
    from qed_ray.records.checkpoint import CheckpointError
    from qed_ray.records.digests import unverified_reason
    from qed_ray.service.mlflow.tracking import UNVERIFIED_TAG, TrialRun

    context, tracker = _context(tmp_path, "s")
    context = context.model_copy(update={"results_key": KEY.hex()})
    layout, config = context.layout, _config({})
    finish = TrialRun.finish

    def ctrl_c_before_the_digest(self, history, tags=None, **kw):
        if tags and DIGEST_TAG in tags:
            raise KeyboardInterrupt  # Tune stopping the trial between its last evaluation and its digest
        return finish(self, history, tags=tags, **kw)

    monkeypatch.setattr(TrialRun, "finish", ctrl_c_before_the_digest)
    with pytest.raises(KeyboardInterrupt):
        train_trial(config, context)
    monkeypatch.setattr(TrialRun, "finish", finish)
    assert [layout.trial_state(n) for n in NAMES] == ["pending", "pending"], "no DONE.json before the digest"
    assert all(DIGEST_TAG not in r.data.tags for r in _runs(tracker).values())
    shutil.copytree(layout.root, tmp_path / "outage")

    train_trial(config, context)  # the next start: resumed at its final checkpoint, finished and signed
    runs, verifier = _runs(tracker), Verifier("sweep0", KEY, tracker.recorded_digests())
    for name in NAMES:
        done = json.loads(layout.done_marker(name).read_text())
        assert done["unverified"] is None and done["files"] == inventory(layout, name)
        assert UNVERIFIED_TAG not in runs[name].data.tags and runs[name].info.status == "FINISHED"
        verify(layout, name, verifier)  # signed: every file checks
    macs = {n: runs[n].data.tags[MAC_TAG] for n in NAMES}
    files0 = inventory(layout, NAMES[0])

    # DONE.json deleted, seed 1's final snapshot planted as seed 0's and an extra snapshot beside it
    seed0, seed1 = (layout.policies(n) for n in NAMES)
    layout.done_marker(NAMES[0]).unlink()
    for f in ("state.pt", "manifest.json"):
        shutil.copy(seed1 / "0000001000" / f, seed0 / "0000001000" / f)
    shutil.copytree(seed1 / "0000001000", seed0 / "0000000500")
    capsys.readouterr()
    train_trial(config, context)
    said = capsys.readouterr().err.splitlines()
    assert f"WARNING {NAMES[0]}: {seed0 / '0000000500' / 'state.pt'}: not written by its worker (planted); " \
           f"not signed" in said
    assert f"WARNING {NAMES[0]}: {seed0 / '0000001000' / 'state.pt'}: not the file its worker wrote (replaced); " \
           f"not signed" in said
    assert f"{NAMES[0]}: its run already holds the digest its worker signed; not signed again (4 file(s) differ " \
           f"from what its worker wrote: 0000000500/manifest.json: not written by its worker (planted)...)" in said
    assert {n: _runs(tracker)[n].data.tags[MAC_TAG] for n in NAMES} == macs, "nothing signed again"
    assert json.loads(layout.done_marker(NAMES[0]).read_text())["files"] == files0
    with pytest.raises(TamperedSnapshotError, match=f"{seed0 / '0000000500' / 'state.pt'}: is not among"):
        verify(layout, NAMES[0], Verifier("sweep0", KEY, tracker.recorded_digests()))

    # ... and with its digest deleted as well (locally the store is in the folder): re-finished, signing only what
    # its worker wrote (the final checkpoint's signed files.json), so the planted files are still refused
    tracker.client.delete_tag(runs[NAMES[0]].info.run_id, DIGEST_TAG)
    layout.done_marker(NAMES[0]).unlink()
    train_trial(config, context)
    tags = _runs(tracker)[NAMES[0]].data.tags  # signed again: the same files as before, not the planted ones
    assert (tags[DIGEST_TAG], tags[MAC_TAG]) == (digest(files0), macs[NAMES[0]]) != digest(inventory(layout, NAMES[0]))
    with pytest.raises(TamperedSnapshotError, match=f"{seed0 / '0000000500' / 'state.pt'}: is not among"):
        verify(layout, NAMES[0], Verifier("sweep0", KEY, tracker.recorded_digests()))
    # an edited files.json (the planted files listed) is refused before anything is signed
    files = layout.pack_checkpoint(PackId.of(NAMES), 1000) / "files.json"
    record = json.loads(files.read_text())
    record["files"][NAMES[0]] = inventory(layout, NAMES[0])
    files.write_text(json.dumps(record))
    tracker.client.delete_tag(runs[NAMES[0]].info.run_id, DIGEST_TAG)
    layout.done_marker(NAMES[0]).unlink()
    with pytest.raises(CheckpointError, match=f"{files}: macs.{NAMES[0]}: not this sweep's signature"):
        train_trial(config, context)
    assert not layout.done_marker(NAMES[0]).exists() and DIGEST_TAG not in _runs(tracker)[NAMES[0]].data.tags

    # A tracking outage at the end: finished, UNVERIFIED with the outage as its reason
    (tmp_path / "gone").write_text("a file where the store's folder should be: every call fails")
    outage = context.model_copy(update={"sweep_dir": tmp_path / "outage",
                                        "tracking_uri": f"sqlite:///{tmp_path / 'gone' / 'mlflow.db'}"})
    train_trial(config, outage)
    for name in NAMES:
        assert unverified_reason(outage.layout, name) == (
            f"tracking outage: MLflow at sqlite:///{tmp_path / 'gone' / 'mlflow.db'} did not answer for 0 s when it "
            f"finished, so its signed digest was never recorded")
