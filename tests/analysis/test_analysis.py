"""The gather step's per-group evaluation on real (tiny, untrained) policies: shapes, protocol and invariants; a
trial's record read from its snapshots; the critic-proxy command."""

import json
import math

import numpy as np
import pytest
import torch
from folder_helpers import group_result

from qed_ray.analysis import metrics
from qed_ray.rl.agents import make_agent
from qed_ray.rl.agents import load_policies
from qed_ray.analysis.group_eval import (GroupEnvs, RandomPolicy, action_rollouts, evaluate_group, random_score,
                                         trial_record)
from qed_ray.records.checkpoint import new_manifest, save_checkpoint
from qed_ray.spec.config import RunSpec
from qed_ray.rl.evaluate import eval_seeds
from qed_ray.records.layout import SweepDir
from qed_ray.analysis.results import GroupResult, SweepResults, TrialRecord
from qed_ray.records.run import EvalRecord
from qed_ray.spec.sweep import FinalEvalSpec

FINAL_EVAL = FinalEvalSpec(episodes=2, action_rollouts=2, action_steps=30, curve_episodes=1, bootstrap_reps=200,
                           confidence=0.95, seed=0)


def _snapshot(root, seed, step, variant="te", same_weights_as=None):
    spec = RunSpec.model_validate({"task": "cartpole-balance", "seed": seed, "agent": {"hidden": 16},
                                   "train": {"env_steps": 2000, "eval_every": 1000}})
    agent = make_agent(spec.agent, spec.temperature, 5, 1, torch.device("cpu"), same_weights_as or seed)
    d = root / f"s{seed}" / f"{step:010d}"
    save_checkpoint(d, {k: m.state_dict() for k, m in agent.modules().items()},
                    new_manifest(task=spec.task, agent="sac_ln", variant=variant, seed=seed, obs_dim=5, action_dim=1,
                                 env_steps=step, run=spec))
    return str(d)


def _record(root, seed, history=(), same_weights_as=None):
    pol = {s: _snapshot(root, seed, s, same_weights_as=same_weights_as) for s in (1000, 2000)}
    return TrialRecord(f"cartpole-balance/sac_ln/te/{seed}", "cartpole-balance", "sac_ln", "te", seed, 2, pol,
                       list(history))


def _eval(env_steps: int, return_mean: float, q_gap_mean: float = math.nan) -> EvalRecord:
    return EvalRecord(env_steps=env_steps, return_mean=return_mean, alpha_mean=0.1, q_gap_mean=q_gap_mean)


def test_group_numbers_follow_the_protocol(tmp_path):
    hist = [_eval(1000, 10.0, 0.5), _eval(2000, 20.0, 0.3)]
    g = evaluate_group([_record(tmp_path, s, hist) for s in (2, 0, 1)], FINAL_EVAL)
    assert g.seeds == [0, 1, 2] and g.final_env_steps == 2000 and g.key == ("cartpole-balance", "sac_ln", "te")
    assert np.shape(g.returns) == (3, 2) and np.shape(g.D) == (3, 3)
    assert g.scores == pytest.approx([np.mean(r) / 1000 for r in g.returns])
    d = np.array(g.D)
    assert np.all(np.diag(d) == 0) and np.allclose(d, d.T) and g.V == pytest.approx(d.sum() / 6)
    assert [p[0] for p in g.v_curve] == [1000, 2000] and g.v_curve[1][1] == g.V
    assert g.early_q_gap == pytest.approx(0.4) and g.q1_dispersion >= 0
    a = np.array(g.action_distance_pairs)
    assert a.shape == (3, 3) and np.all(np.diag(a) == 0) and np.allclose(a, a.T)
    assert g.action_distance == pytest.approx(a.sum() / 6), "the distance is the mean over pairs of the matrix"
    assert g.learning_curves[0] == [[1000, 10.0], [2000, 20.0]]
    assert 0 <= g.random_score <= 1


def test_the_random_policy_score_is_the_tasks_whatever_the_pool():
    """The learning floor's base: the same episodes get the same uniform actions however the pool chunks them, and
    the score is the mean normalised return of exactly those episodes, rolled out here by hand on one env."""
    from qed_ray.rl.env_pool import EnvPool
    from qed_ray.rl.evaluate import rollout_lockstep

    scores = []
    for n_policies in (1, 3):
        envs = GroupEnvs("cartpole-balance", n_policies, 3, 2)
        try:
            scores.append(random_score(envs, "cartpole-balance", 3))
        finally:
            envs.close()
    pool = EnvPool("cartpole-balance", eval_seeds(1), 2)
    try:
        by_hand = [rollout_lockstep(RandomPolicy("cartpole-balance", 1), pool, np.array([[0]]), [s]).returns[0, 0]
                   for s in eval_seeds(3)]
    finally:
        pool.close()
    assert scores[0] == scores[1] == pytest.approx(np.mean(by_hand) / 1000, rel=1e-12) and 0 < scores[0] < 1


def test_identical_policies_have_zero_divergence_and_distance(tmp_path):
    g = evaluate_group([_record(tmp_path, s, same_weights_as=7) for s in (0, 1)], FINAL_EVAL)
    assert g.V == 0.0 and g.action_distance == 0.0 and g.q1_dispersion == 0.0
    assert g.action_distance_pairs == [[0.0, 0.0], [0.0, 0.0]]


def test_action_distance_reuses_eval_rollouts_exactly(tmp_path):
    pack, _ = load_policies([_snapshot(tmp_path, s, 1000) for s in (0, 1)])
    envs = GroupEnvs("cartpole-balance", 2, 3, 2)
    try:
        rolls = envs.rollouts(pack, "mean", eval_seeds(3))
        reused = action_rollouts(pack, envs, rolls, 2, 40)
        fresh = envs.rollouts(pack, "mean", eval_seeds(2), max_decisions=40).actions
        assert reused.shape == fresh.shape == (2, 2, 40, 1)
        np.testing.assert_array_equal(reused, fresh)
        assert metrics.cumulative_action_distance(reused) > 0
        longer = action_rollouts(pack, envs, rolls, 4, 40)  # more than the eval rollouts cover: rolled out anew
        np.testing.assert_array_equal(longer[:, :2], fresh)
    finally:
        envs.close()


def test_trial_record_is_read_from_the_final_snapshot(sweep_copy):
    name = "cartpole-balance/sac_ln/te/1"
    r = trial_record(sweep_copy, name)
    assert (r.name, r.task, r.agent, r.variant, r.seed, r.frame_skip) == (name, "cartpole-balance", "sac_ln", "te",
                                                                          1, 2)
    assert r.policies == {s: str(sweep_copy.snapshot(name, s)) for s in (1000, 2000)}
    assert r.history == [_eval(1000, 200.0, 0.1), _eval(2000, 300.0, 0.2)], "the evaluations as the trainer recorded"
    with pytest.raises(ValueError, match=r"last policy snapshot at 1,000 env steps, the trial's budget is 2,000"):
        trial_record(sweep_copy, "cartpole-balance/sac_ln/qed0.2/1")
    with pytest.raises(FileNotFoundError, match="no complete policy snapshot"):
        trial_record(sweep_copy, "cartpole-balance/sac_ln/qed0.2/9")


def test_critic_proxy_command_prints_r2_and_draws(tmp_path, capsys):
    from qed_ray.analysis.group_eval import main

    groups = [group_result(t, agent="mad_sac", early_q_gap=x, q1_dispersion=y).to_json()
              for t, x, y in [("a", 1.0, 2.0), ("b", 2.0, 4.5), ("c", 3.0, 6.0)]]
    layout = SweepDir(tmp_path)
    layout.gather.mkdir()
    results = SweepResults("s", FinalEvalSpec(), [], [GroupResult.from_json(g) for g in groups], [], [], 3)
    layout.results_json.write_text(json.dumps(results.to_json()))
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    r2 = metrics.r_squared([1.0, 2.0, 3.0], [2.0, 4.5, 6.0])
    assert f"mad_sac te: R^2 = {r2:.3f} over 3 tasks" in out
    assert (layout.figures / "critic_proxy.png").stat().st_size > 5000
    assert main([str(tmp_path / "missing")]) == 2


