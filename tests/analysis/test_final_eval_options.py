"""The final-evaluation options on real (tiny, untrained) policies: the ``sample`` evaluation policy draws
from the policy with noise fixed by the shared eval seeds, each policy's numbers come out apart, the critic-proxy
window, the cache keys, the tables and figures of every policy, and the Sec. 6.3 figure of the mean return."""

import hashlib
import json
import re

import numpy as np
import pytest
import torch
from folder_helpers import group_result

from qed_ray.records.run import EvalRecord
from qed_ray.analysis import bootstrap
from qed_ray.rl.agents import make_agent
from qed_ray.analysis.group_eval import evaluate_group
from qed_ray.records.checkpoint import new_manifest, save_checkpoint
from qed_ray.spec.config import RunSpec, SacLnSpec, TemperatureSpec
from qed_ray.rl.agents import make_packed_agent
from qed_ray.rl.env_pool import EnvPool
from qed_ray.rl.evaluate import eval_policy, eval_seeds, rollout_lockstep
from qed_ray.analysis.group_cache import ANALYSIS_VERSION, EVAL_FIELDS, cache_key
from qed_ray.records.layout import SweepDir
from qed_ray.analysis.outputs import policy_dir, write_results
from qed_ray.analysis.results import GroupKey, SweepResults, TrialRecord
from qed_ray.spec.sweep import FinalEvalSpec
from qed_ray.analysis.tables import sweep_results

TASK = "cartpole-balance"
FE = FinalEvalSpec(episodes=2, action_rollouts=2, action_steps=30, curve_episodes=1, bootstrap_reps=200)


def test_sample_policy_draws_from_the_policy_with_the_eval_seeds_noise():
    pack = make_packed_agent(SacLnSpec(hidden=16, batch_size=16), TemperatureSpec(), 5, 1, torch.device("cpu"),
                             [0, 0])  # the same policy twice
    seeds = eval_seeds(2)
    with EnvPool(TASK, [0] * 4, 2) as pool:
        index = np.arange(4).reshape(2, 2)
        rolls = rollout_lockstep(eval_policy(pack, "sample"), pool, index, seeds, max_decisions=20, record=True)
        mean = rollout_lockstep(eval_policy(pack, "mean"), pool, index, seeds, max_decisions=20, record=True)
        # the same policy twice sees the same noise: identical actions; the mean policy acts otherwise
        np.testing.assert_array_equal(rolls.actions[0], rolls.actions[1])
        assert not np.allclose(rolls.actions, mean.actions)
        # reproducible, and the noise is the episode's, not a stream running on across episodes
        again = rollout_lockstep(eval_policy(pack, "sample"), pool, index, seeds[::-1], max_decisions=20,
                                 record=True)
    np.testing.assert_array_equal(again.actions[:, 0], rolls.actions[:, 1])
    with pytest.raises(ValueError, match="final_eval.policies: 'greedy' is not one of 'mean', 'sample'"):
        eval_policy(pack, "greedy")


def _record(root, seed: int, history) -> TrialRecord:
    spec = RunSpec.model_validate({"task": TASK, "seed": seed, "agent": {"hidden": 16},
                                   "train": {"env_steps": 2000, "eval_every": 2000}})
    agent = make_agent(spec.agent, spec.temperature, 5, 1, torch.device("cpu"), seed)
    d = root / f"s{seed}"
    save_checkpoint(d, {k: m.state_dict() for k, m in agent.modules().items()},
                    new_manifest(task=TASK, agent="sac_ln", variant="te", seed=seed, obs_dim=5, action_dim=1,
                                 env_steps=2000, run=spec))
    return TrialRecord(f"{TASK}/sac_ln/te/{seed}", TASK, "sac_ln", "te", seed, 2, {2000: str(d)}, list(history))


def test_each_evaluation_policy_gives_its_own_numbers_and_the_first_keeps_todays(tmp_path):
    hist = [EvalRecord(env_steps=1000 * i, return_mean=1.0, alpha_mean=0.1, q_gap_mean=float(i)) for i in (1, 2, 3)]
    records = [_record(tmp_path, s, hist) for s in (0, 1)]
    mean_only = evaluate_group(records, FE)
    both = evaluate_group(records, FE.model_copy(update={"policies": ("mean", "sample"), "proxy_window": 2}))
    assert mean_only.policy == both.policy == "mean" and set(both.other_policies) == {"sample"}
    same = ("returns", "scores", "V", "D", "action_distance", "action_distance_pairs", "q1_dispersion")
    assert all(getattr(both, f) == getattr(mean_only, f) for f in same), "the first policy's numbers are today's"
    sample = both.other_policies["sample"]
    assert sample.policy == "sample" and sample.seeds == [0, 1] and sample.returns != both.returns
    assert np.isfinite(sample.V) and sample.V != both.V and sample.action_distance > 0
    assert mean_only.early_q_gap == pytest.approx(2.0) and both.early_q_gap == pytest.approx(1.5)  # windows 15, 2
    # the cache entry keeps every policy; results.json lists each policy's groups apart
    back = type(both).from_json(json.loads(json.dumps(both.to_json())))
    assert back.other_policies["sample"].returns == sample.returns
    assert "other_policies" not in both.to_json(with_others=False) or not both.to_json(with_others=False)[
        "other_policies"]


def test_cache_keys_name_the_policies_and_window_and_keep_old_keys_valid():
    group, policies = GroupKey(TASK, "sac_ln", "te"), {0: "ab", 1: "cd"}
    old_payload = {"analysis_version": ANALYSIS_VERSION, "group": list(group), "policies": {"0": "ab", "1": "cd"},
                   "final_eval": {f: getattr(FE, f) for f in EVAL_FIELDS}}
    old = hashlib.sha256(json.dumps(old_payload, sort_keys=True).encode()).hexdigest()
    assert cache_key(group, policies, FE) == old, "a default final_eval keeps the keys written before the options"
    keys = {cache_key(group, policies, FE.model_copy(update=u)) for u in (
        {}, {"policies": ("sample",)}, {"policies": ("mean", "sample")}, {"proxy_window": 5})}
    assert len(keys) == 4
    assert cache_key(group, policies, FE.model_copy(update={"bootstrap_reps": 50_000})) == old


def test_final_eval_policies_are_validated_with_the_allowed_values():
    assert FinalEvalSpec.model_validate({"policies": ["mean", "sample"]}).policies == ("mean", "sample")
    assert FinalEvalSpec.model_validate({"policies": "sample"}).policies == ("sample",)
    for bad, needle in (([], "need at least one of mean, sample"), (["mean", "mean"], "names a policy twice"),
                        (["greedy"], "'mean' or 'sample'")):
        with pytest.raises(ValueError, match=needle):
            FinalEvalSpec.model_validate({"policies": bad})


def test_every_policy_gets_its_tables_and_figures(tmp_path):
    fe = FE.model_copy(update={"policies": ("mean", "sample")})
    groups = []
    for v in ("te", "qed0.2"):
        for i, t in enumerate(("a", "b"), start=1):
            g = group_result(t, variant=v, scores=(0.1 * i, 0.2 * i))
            other = group_result(t, variant=v, scores=(0.3 * i, 0.1 * i), V=2.0, policy="sample")
            groups.append(g.model_copy(update={"other_policies": {"sample": other}}))
    results = sweep_results("s", fe, groups, [], 8)
    assert results.policy == "mean" and results.other_policies["sample"].policy == "sample"
    assert results.other_policies["sample"].aggregates[0].V_mean == 2.0 and results.aggregates[0].V_mean == 1.0
    layout = SweepDir(tmp_path)
    write_results(results, layout)
    assert SweepResults.from_json(json.loads(layout.results_json.read_text())).to_json() == results.to_json()
    folder = policy_dir(layout, "sample")
    assert (folder / "aggregates.csv").exists() and (folder / "figures" / "mean_return_vs_kl.svg").exists()
    svg = (folder / "figures" / "ci_width.svg").read_text()
    caption = " ".join(re.findall(r"<!-- (.*?) -->", svg))  # the SVG's text lines, as the figure wraps them
    assert "sampled from the policy (noise shared across seeds per episode)" in caption
    assert "deterministic tanh(mu)" in (layout.figures / "ci_width.svg").read_text()


def test_the_fixed_alpha_figure_plots_the_mean_return_with_the_iqm_beside_it(tmp_path):
    # Task a: te scores 0.1/0.5/0.9, fixed0.1: 0.2/0.2/0.8. Mean and IQM differ for each (4 seeds below).
    scores = {"te": (0.1, 0.2, 0.3, 0.9), "fixed0.1": (0.2, 0.2, 0.2, 0.8)}
    groups = [group_result("a", variant=v, scores=s) for v, s in scores.items()]
    results = sweep_results("s", FE, groups, [], 8)
    rows = {a.variant: a for a in results.aggregates}
    assert rows["te"].mean_score == pytest.approx(0.375) and rows["te"].iqm == pytest.approx(0.25)
    assert rows["fixed0.1"].mean_score == pytest.approx(0.35) and rows["fixed0.1"].iqm == pytest.approx(0.2)
    want = bootstrap.mean_interval([np.array(scores["te"])], FE.bootstrap_reps, FE.confidence, FE.seed)
    assert (rows["te"].mean_score_ci_lower, rows["te"].mean_score_ci_upper) == (want["lower"], want["upper"])
    assert want["lower"] <= 0.375 <= want["upper"] and want["upper"] > want["lower"]
    from qed_ray.analysis.plots import mean_return_vs_kl, save

    svg = save(mean_return_vs_kl(results), tmp_path / "fig.png").with_suffix(".svg").read_text()
    assert "Mean of normalised final return" in svg and "IQM of normalised final return" in svg
    assert "mean=0.375" in svg and "IQM=0.25" in svg and "mean=0.35" in svg
