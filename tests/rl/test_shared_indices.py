"""``train.shared_indices`` (the replay-coupling control of docs/claim.md): the seeds of one variant in a pack draw
the same replay positions at every update, as MAD-TD's multi-seed trainer draws one index set for all seeds; without
it (the default) each seed draws its own. It is part of the run's identity, and refused where it means nothing."""

import numpy as np
import pytest
import torch

from qed_ray.spec.config import RunSpec, TrainSpec
from qed_ray.spec.naming import identity, parse_variant
from qed_ray.rl.pack import sampler_seeds
from qed_ray.rl.run import main as run_cli
from qed_ray.rl.trainer import build_trainer
from qed_ray.service.sweep_state import plan
from qed_ray.spec.sweep import SweepSpec

QED = {"kind": "qed", "k": 0.2}
SWEEP = {"name": "s", "tasks": ["cartpole-balance"], "seeds": 3, "pack": {"seeds": 3},
         "agents": [{"name": "sac_ln", "overrides": {"hidden": 16}, "temperatures": [{"kind": "te"}]}],
         "train": {"env_steps": 2000, "eval_every": 1000, "warmup_decisions": 100}}


SHORT = {"env_steps": 1000, "eval_every": 1000, "frame_skip": 10, "warmup_decisions": 90}  # 100 decisions, 10 updates


def _pack(tiny_run, shared: bool):
    return build_trainer([tiny_run(seed=s, train={**SHORT, "shared_indices": shared}) for s in (3, 4)],
                         lambda *a: None, None, log=lambda s: None)


def _draws(replay, times: int = 20) -> np.ndarray:
    """[S, times, 32] positions drawn by every seed."""
    return np.stack([replay.indices(32, np.ones(replay.n, bool)) for _ in range(times)], axis=1)


def test_a_variants_seeds_draw_one_index_stream_with_the_option_and_their_own_without(tiny_run):
    shared, independent = _pack(tiny_run, True), _pack(tiny_run, False)
    try:
        states = [g.bit_generator.state for g in shared.replay.rngs]
        alone = [g.bit_generator.state for g in independent.replay.rngs]
        assert states == [alone[0], alone[0]] and alone[0] != alone[1], "the first seed samples as it would alone"
        n, o = 2, independent.pool.obs_dim
        for _ in range(100):  # what a ring holds does not change the positions drawn, only how many rows it has
            independent.replay.add(np.zeros((n, o)), np.zeros((n, 1)), np.zeros(n), np.zeros((n, o)), np.zeros(n),
                                   np.ones(n, bool))
        ind = _draws(independent.replay)
        assert (ind[0] != ind[1]).mean() > 0.9, "without the option each seed draws its own positions"
        shared.run()  # the seeds' samplers stay in step, their weights apart
        assert shared.progress.updates == 10 and shared.replay.added.tolist() == [100, 100]
        assert shared.replay.rng_state(0) == shared.replay.rng_state(1), "the same draws, update after update"
        actions = shared.replay.storage[:, :100, shared.replay.columns["action"]]
        assert not torch.equal(actions[0], actions[1]), "the same positions of two seeds' own transitions"
        draws = _draws(shared.replay)
        assert draws.shape == (2, 20, 32) and draws.max() < 100 and np.array_equal(draws[0], draws[1])
        idx = shared.replay.indices(32, np.array([False, True]))  # a stopped seed draws nothing
        assert (idx[0] == 0).all() and shared.replay.rng_state(0) != shared.replay.rng_state(1)
    finally:
        shared.close(), independent.close()


def test_each_variant_of_a_pack_shares_its_own_first_seeds_stream(tiny_run):
    te = [tiny_run(seed=s, train={"shared_indices": True}) for s in (3, 5)]
    qed = [tiny_run(seed=s, temperature=QED, train={"shared_indices": True}) for s in (4, 6)]
    assert sampler_seeds(te + qed) == [3, 3, 4, 4]  # a pack holding two variants (never across them)
    assert sampler_seeds([tiny_run(seed=s) for s in (3, 5)]) == [3, 5]  # the default: each its own
    assert sampler_seeds([tiny_run(seed=s, train={"shared_indices": True}) for s in (7, 2, 9)]) == [7, 7, 7]


def test_the_option_is_part_of_the_runs_identity(tiny_run):
    assert "train.shared_indices" not in identity(tiny_run())
    assert identity(tiny_run(train={"shared_indices": True}))["train.shared_indices"] is True
    assert SweepSpec.model_validate({**SWEEP, "train": {**SWEEP["train"], "shared_indices": True}}).fingerprint() \
        != SweepSpec.model_validate(SWEEP).fingerprint()
    axis = SweepSpec.model_validate({**SWEEP, "train": {**SWEEP["train"], "shared_indices": [False, True]}})
    names = [t.name for t in axis.trials()]
    assert names[:4] == ["cartpole-balance/sac_ln/te/0", "cartpole-balance/sac_ln/te/1",
                         "cartpole-balance/sac_ln/te/2", "cartpole-balance/sac_ln/te+shared_indices=true/0"]
    assert parse_variant("te+shared_indices=true")["train"] == {"shared_indices": True}
    started = plan(None, SweepSpec.model_validate(SWEEP)).state
    changed = plan(started, SweepSpec.model_validate({**SWEEP, "train": {**SWEEP["train"], "shared_indices": True}}))
    assert [p.split(":")[0] for p in changed.problems] == ["train.shared_indices"]


def test_the_option_is_refused_where_it_shares_nothing(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"shared_indices: true needs holdout_fraction 0 \(it is 0.05"):
        TrainSpec(shared_indices=True, holdout_fraction=0.05)
    with pytest.raises(ValueError, match=r"train.shared_indices: true .* but pack.seeds is 1"):
        SweepSpec.model_validate({**SWEEP, "pack": {"seeds": 1}, "train": {**SWEEP["train"], "shared_indices": True}})
    tiny = ["--task", "cartpole-balance", "--env-steps", "2000", "--eval-every", "1000", "--warmup-decisions", "50",
            "--shared-indices", "true", "--out", str(tmp_path / "run")]
    assert run_cli([*tiny, "--seed", "0"]) == 2
    err = capsys.readouterr().err
    assert "train.shared_indices (--shared-indices): a run of one seed shares its replay positions" in err
    assert not (tmp_path / "run").exists()
    assert RunSpec.model_validate({"task": "cartpole-balance", "train": {"shared_indices": True}}).train.shared_indices
