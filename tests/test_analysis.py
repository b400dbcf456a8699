"""The gather step's per-group evaluation on real (tiny, untrained) policies: shapes, protocol and invariants;
the typed results and their strict-JSON round trip."""

import json
import math

import numpy as np
import pytest
import torch

from qed_ray import metrics
from qed_ray.agents import make_agent
from qed_ray.analysis import (Aggregate, CriticProxy, FailedTrial, GroupResult, SweepResults, TrialRecord,
                              action_rollouts, aggregate, critic_proxy, evaluate_group)
from qed_ray.checkpoint import save_checkpoint
from qed_ray.config import RunSpec
from qed_ray.evaluate import eval_seeds, rollout_many
from qed_ray.layout import SweepDir
from qed_ray.spec import FinalEvalSpec

FINAL_EVAL = FinalEvalSpec(episodes=2, action_rollouts=2, action_steps=30, curve_episodes=1, bootstrap_reps=200,
                           confidence=0.95, seed=0)


def _group(task="a", agent="sac_ln", variant="te", scores=(0.1, 0.2), V=1.0, action_distance=5.0, early_q_gap=1.0,
           q1_dispersion=2.0, **kw) -> GroupResult:
    """A GroupResult with the given numbers (returns consistent with the scores, the rest small and fixed)."""
    seeds = list(range(len(scores)))
    fields = dict(task=task, agent=agent, variant=variant, seeds=seeds, final_env_steps=2000,
                  returns=[[1000 * s, 1000 * s] for s in scores], scores=list(scores), V=V,
                  D=[[0.0] * len(seeds) for _ in seeds], action_distance=action_distance,
                  v_curve=[[1000, 2 * V], [2000, V]], q1_dispersion=q1_dispersion, early_q_gap=early_q_gap,
                  learning_curves={s: [[1000, 10.0], [2000, 20.0]] for s in seeds})
    return GroupResult(**{**fields, **kw})


def _snapshot(root, seed, step, variant="te", same_weights_as=None):
    spec = RunSpec.model_validate({"task": "cartpole-balance", "seed": seed, "agent": {"hidden": 16},
                                   "train": {"env_steps": 2000, "eval_every": 1000}})
    agent = make_agent(spec.agent, spec.temperature, 5, 1, torch.device("cpu"), same_weights_as or seed)
    d = root / f"s{seed}" / f"{step:010d}"
    save_checkpoint(d, {k: m.state_dict() for k, m in agent.modules().items()},
                    {"task": spec.task, "agent": "sac_ln", "variant": variant, "seed": seed, "obs_dim": 5,
                     "action_dim": 1, "env_steps": step, "run": spec.model_dump(mode="json")})
    return str(d)


def _record(root, seed, history=(), same_weights_as=None):
    pol = {s: _snapshot(root, seed, s, same_weights_as=same_weights_as) for s in (1000, 2000)}
    return TrialRecord(f"cartpole-balance/sac_ln/te/{seed}", "cartpole-balance", "sac_ln", "te", seed, 2, pol,
                       list(history))


def test_group_numbers_follow_the_protocol(tmp_path):
    hist = [{"env_steps": 1000, "eval/return_mean": 10.0, "q/abs_diff_mean": 0.5},
            {"env_steps": 2000, "eval/return_mean": 20.0, "q/abs_diff_mean": 0.3}]
    g = evaluate_group([_record(tmp_path, s, hist) for s in (2, 0, 1)], FINAL_EVAL)
    assert g.seeds == [0, 1, 2] and g.final_env_steps == 2000 and g.key == ("cartpole-balance", "sac_ln", "te")
    assert np.shape(g.returns) == (3, 2) and np.shape(g.D) == (3, 3)
    assert g.scores == pytest.approx([np.mean(r) / 1000 for r in g.returns])
    d = np.array(g.D)
    assert np.all(np.diag(d) == 0) and np.allclose(d, d.T) and g.V == pytest.approx(d.sum() / 6)
    assert [p[0] for p in g.v_curve] == [1000, 2000] and g.v_curve[1][1] == g.V
    assert g.early_q_gap == pytest.approx(0.4) and g.q1_dispersion >= 0
    assert g.learning_curves[0] == [[1000, 10.0], [2000, 20.0]]


def test_identical_policies_have_zero_divergence_and_distance(tmp_path):
    g = evaluate_group([_record(tmp_path, s, same_weights_as=7) for s in (0, 1)], FINAL_EVAL)
    assert g.V == 0.0 and g.action_distance == 0.0 and g.q1_dispersion == 0.0


def test_action_distance_reuses_eval_rollouts_exactly(tmp_path):
    from qed_ray.agents import load_policy

    agents = [load_policy(_snapshot(tmp_path, s, 1000))[0] for s in (0, 1)]
    rolls = rollout_many([a.act_batch for a in agents], "cartpole-balance", eval_seeds(3))
    reused = action_rollouts(agents, rolls, "cartpole-balance", 2, 40, 2)
    fresh = np.stack([r.actions for r in rollout_many([a.act_batch for a in agents], "cartpole-balance",
                                                       eval_seeds(2), max_decisions=40)])
    np.testing.assert_array_equal(reused, fresh)
    assert metrics.cumulative_action_distance(reused) > 0


def test_aggregate_and_proxy_tables():
    groups = [_group(t, scores=sc, V=v, action_distance=ad, early_q_gap=e, q1_dispersion=q)
              for t, sc, v, ad, e, q in [("c", [0.9, 0.8], float("nan"), 6.0, 3.0, 6.0),
                                          ("a", [0.1, 0.2, 0.3], 1.0, 5.0, 1.0, 2.0),
                                          ("b", [0.5, 0.6], 3.0, 7.0, 2.0, 4.5)]]
    (row,) = aggregate(groups, FINAL_EVAL)
    assert row.n_seeds == 2 and row.n_tasks == 3  # rectangular: the extra seed of task a is dropped
    assert row.iqm == pytest.approx(metrics.iqm(np.array([[0.1, 0.5, 0.9], [0.2, 0.6, 0.8]])))
    assert row.ci_lower <= row.iqm <= row.ci_upper
    assert row.V_mean == 2.0 and row.V_median == 2.0 and row.action_distance_mean == 6.0
    (proxy,) = critic_proxy(groups)
    assert proxy.tasks == ["a", "b", "c"]  # sorted by task whatever the input order
    assert proxy.r_squared == pytest.approx(metrics.r_squared([1.0, 2.0, 3.0], [2.0, 4.5, 6.0]))


def test_critic_proxy_command_prints_r2_and_draws(tmp_path, capsys):
    from qed_ray.analysis import main

    groups = [_group(t, agent="mad_sac", early_q_gap=x, q1_dispersion=y).to_json()
              for t, x, y in [("a", 1.0, 2.0), ("b", 2.0, 4.5), ("c", 3.0, 6.0)]]
    layout = SweepDir(tmp_path)
    layout.gather.mkdir()
    layout.results_json.write_text(json.dumps({"groups": groups}))
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    r2 = metrics.r_squared([1.0, 2.0, 3.0], [2.0, 4.5, 6.0])
    assert f"mad_sac te: R^2 = {r2:.3f} over 3 tasks" in out
    assert (layout.figures / "critic_proxy.png").stat().st_size > 5000
    assert main([str(tmp_path / "missing")]) == 2


GROUP_KEYS = ["task", "agent", "variant", "seeds", "final_env_steps", "returns", "scores", "V", "D",
              "action_distance", "v_curve", "q1_dispersion", "early_q_gap", "learning_curves"]
AGGREGATE_KEYS = ["agent", "variant", "n_tasks", "n_seeds", "iqm", "ci_lower", "ci_upper", "ci_width", "mean_score",
                  "V_mean", "V_median", "action_distance_mean"]


def _strict_loads(text: str):
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def test_typed_results_round_trip_through_strict_json():
    single = _group("d", scores=(0.25,), V=math.nan, action_distance=math.nan, early_q_gap=math.nan,
                    v_curve=[[2000, math.nan]])
    groups = [_group("a"), single]
    agg = aggregate(groups, FINAL_EVAL)
    results = SweepResults("s", FINAL_EVAL, agg, groups, critic_proxy(groups), [FailedTrial("x/y/z/0", "boom")], 3)
    text = json.dumps(results.to_json(), indent=1)
    raw = _strict_loads(text)  # NaN is written as null
    assert list(raw) == ["sweep", "final_eval", "aggregates", "groups", "critic_proxy", "failed_trials", "n_trials"]
    assert [list(g) for g in raw["groups"]] == [GROUP_KEYS] * 2 and list(raw["aggregates"][0]) == AGGREGATE_KEYS
    assert list(raw["critic_proxy"][0]) == ["agent", "variant", "tasks", "early_q_gap", "q1_dispersion", "r_squared"]
    assert raw["groups"][1]["V"] is None and raw["groups"][1]["v_curve"] == [[2000, None]]
    assert raw["groups"][0]["learning_curves"] == {"0": [[1000, 10.0], [2000, 20.0]], "1": [[1000, 10.0], [2000, 20.0]]}
    assert raw["failed_trials"] == [{"name": "x/y/z/0", "error": "boom"}] and raw["final_eval"]["bootstrap_reps"] == 200

    back = SweepResults.from_json(raw)
    assert back.to_json() == results.to_json()  # exact, and stable under a second round trip
    assert back.final_eval == FINAL_EVAL and back.failed_trials == [FailedTrial("x/y/z/0", "boom")]
    assert back.groups[0] == groups[0]  # finite groups compare equal field by field
    assert math.isnan(back.groups[1].V) and math.isnan(back.groups[1].v_curve[0][1])
    assert list(back.groups[0].learning_curves) == [0, 1]  # seeds are ints again
    assert back.aggregates == agg and isinstance(back.critic_proxy[0], CriticProxy)
    assert Aggregate.from_json(agg[0].to_json()) == agg[0] and GroupResult.from_json(groups[0].to_json()) == groups[0]


def test_gather_writes_results_and_tables_with_fixed_columns(tmp_path):
    import csv

    from qed_ray.gather import write_results

    groups = [_group(t, variant=v, scores=(0.1 * i, 0.2 * i), early_q_gap=float(i), q1_dispersion=2.0 * i)
              for v in ("te", "qed0.2") for i, t in enumerate(("a", "b", "c"), start=1)]
    results = SweepResults("s", FINAL_EVAL, aggregate(groups, FINAL_EVAL), groups, critic_proxy(groups), [], 12)
    layout = SweepDir(tmp_path)
    write_results(results, layout)
    assert _strict_loads(layout.results_json.read_text()) == results.to_json()
    with open(layout.aggregates_csv) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == AGGREGATE_KEYS and [(r["agent"], r["variant"]) for r in rows] == [
        ("sac_ln", "qed0.2"), ("sac_ln", "te")]
    assert float(rows[1]["iqm"]) == results.aggregates[1].iqm
    with open(layout.groups_csv) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["task", "agent", "variant", "n_seeds", "mean_return", "std_return_across_seeds", "V",
                             "action_distance", "q1_dispersion", "early_q_gap"]
    # task b: scores 0.2 and 0.4, i.e. mean returns 200 and 400 per seed
    assert len(rows) == 6 and rows[1]["task"] == "b" and float(rows[1]["mean_return"]) == pytest.approx(300.0)
    assert float(rows[1]["std_return_across_seeds"]) == pytest.approx(100.0)
    assert sorted(p.name for p in layout.figures.iterdir()) == [
        "action_distance.png", "ci_width.png", "critic_proxy.png", "learning_curves.png", "pareto_kl_vs_iqm.png",
        "v_over_env_steps.png"]
