"""The worker side of a trial: the typed context that crosses the Ray boundary and the snapshot policy."""

import pickle

import pytest
from pydantic import ValidationError

from qed_ray.config import TrainSpec
from qed_ray.layout import SweepDir
from qed_ray.trial import TrialContext, snapshot_modules

CONTEXT = {"sweep_id": "0123456789ab", "sweep_dir": "/mnt/qed/sweeps/s", "tracking_uri": "http://head:5000",
           "experiment": "s", "parent_run_id": "abc", "keep_every": 2, "gpu_fraction": 0.1}


def test_context_is_typed_frozen_and_survives_pickling():
    ctx = TrialContext(**CONTEXT)
    assert ctx.layout == SweepDir("/mnt/qed/sweeps/s") and ctx.keep_every == 2
    assert pickle.loads(pickle.dumps(ctx)) == ctx  # how Ray ships it to a worker
    with pytest.raises(ValidationError):
        ctx.keep_every = 3


@pytest.mark.parametrize("change, field", [({"keep_every": 0}, "keep_every"), ({"gpu_fraction": 1.5}, "gpu_fraction"),
                                           ({"sweep_id": ""}, "sweep_id"), ({"colour": "red"}, "colour")])
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


def test_a_trial_resumes_from_its_newest_intact_checkpoint_in_the_sweep_folder(tmp_path, tiny_run):
    from qed_ray.atomic import atomic_dir
    from qed_ray.checkpoint import CheckpointError
    from qed_ray.replay import list_chunks
    from qed_ray.trainer import build_trainer
    from qed_ray.trial import prune_checkpoints, restore_latest

    spec = tiny_run(agent={"hidden": 16, "batch_size": 16}, train={"env_steps": 3000, "eval_every": 1000,
                                                                   "warmup_decisions": 100})
    layout, name = SweepDir(tmp_path), "cartpole-balance/sac_ln/te/0"

    def keep(metrics, save):  # what TuneReporter does with each evaluation's full checkpoint
        with atomic_dir(layout.checkpoint(name, metrics["env_steps"])) as d:
            save(d)
        prune_checkpoints(layout, name)

    build_trainer(spec, keep, layout.replay(name), log=lambda s: None).run()
    assert list(layout.checkpoint_steps(name)) == [2000, 3000], "the newest two are kept"
    assert restore_latest(build_trainer(spec, keep, layout.replay(name)), layout, name, print) == 3000

    newest_chunk = list_chunks(layout.replay(name))[-1][2]  # only the 3000-step checkpoint needs it
    newest_chunk.write_bytes(newest_chunk.read_bytes()[:100])
    said = []
    trainer = build_trainer(spec, keep, layout.replay(name))
    assert restore_latest(trainer, layout, name, said.append) == 2000
    assert trainer.p.decisions == 1000 and trainer.replay.added == 1000 and trainer.resumed_from == 2000
    assert said[0].startswith(f"WARNING {name}: cannot resume from {layout.checkpoint(name, 3000)}: {newest_chunk}: "
                              f"damaged replay chunk")
    assert said[1] == f"WARNING {name}: resumed from the older checkpoint at env step 2000"

    (layout.checkpoint(name, 2000) / "state.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=f"{name}: no intact checkpoint: .*damaged replay chunk.*state.pt: "
                                              f"corrupt"):
        restore_latest(build_trainer(spec, keep, layout.replay(name)), layout, name, said.append)
    assert restore_latest(build_trainer(spec, keep, tmp_path / "none"), SweepDir(tmp_path / "other"), name,
                          print) is None, "a new trial starts from scratch"

    import json
    for step in (2000, 3000):  # an older qed_ray wrote both: they cannot continue this run, so the trial starts over
        manifest = layout.checkpoint(name, step) / "manifest.json"
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format_version": 1}))
    said.clear()
    fresh = build_trainer(spec, keep, layout.replay(name))
    assert restore_latest(fresh, layout, name, said.append) is None and fresh.p.decisions == 0
    assert said[-1] == f"WARNING {name}: every checkpoint was written by an older qed_ray; starting this trial over"
    assert all("older version of qed_ray" in s or "format" in s for s in said[:-1]), said
