"""The worker side of a trial: the typed context that crosses the Ray boundary and the snapshot policy."""

import pickle

import pytest
from pydantic import ValidationError

from qed_ray.config import TrainSpec
from qed_ray.layout import SweepDir
from qed_ray.trial import TrialContext, snapshot_modules

CONTEXT = {"sweep_id": "0123456789ab", "sweep_dir": "/shared/results/s", "tracking_uri": "http://head:5000",
           "experiment": "s", "parent_run_id": "abc", "keep_every": 2, "gpu_fraction": 0.1}


def test_context_is_typed_frozen_and_survives_pickling():
    ctx = TrialContext(**CONTEXT)
    assert ctx.layout == SweepDir("/shared/results/s") and ctx.keep_every == 2
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
