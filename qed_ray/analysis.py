"""Cross-seed evaluation of one group's saved policies (Ray-free; the gather step runs it as a task or in-process).

Per (task, agent, variant) group (:class:`~qed_ray.results.GroupResult`): final scores, inter-run variability V on
the states pooled from every seed's own evaluation rollouts (paper App. E), pairwise action distances over
100-step rollouts from shared seeds (Sec. 6.2), V at intermediate policy snapshots (App. E, curves as in App. F),
and the critic-proxy quantities (App. D). Returns, V's state sets and action distances come from each evaluation
policy of ``final_eval.policies`` in turn (:func:`qed_ray.evaluate.eval_policy`; the paper does not say which it
used). A trial's record is read from its policy snapshots alone (:func:`trial_record`). Tables across groups are
:mod:`qed_ray.tables`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Sequence

import numpy as np

from qed_ray import metrics
from qed_ray.agents import load_policy
from qed_ray.checkpoint import SNAPSHOT_FORMATS, read_manifest
from qed_ray.evaluate import EvalPolicy, eval_policy, eval_seeds, rollout_many
from qed_ray.layout import SweepDir, TrialId
from qed_ray.results import GroupResult, TrialRecord
from qed_ray.spec import FinalEvalSpec


def trial_record(layout: SweepDir, name: str) -> TrialRecord:
    """A finished trial's record from its policy snapshots (the final one's manifest holds the eval history).

    Raises:
        FileNotFoundError / ValueError: no snapshot, or the last one is not at the trial's budget.
    """
    snapshots = layout.snapshots(name)
    if not snapshots:
        raise FileNotFoundError(f"{layout.policies(name)}: no complete policy snapshot")
    final = max(snapshots)
    manifest = read_manifest(snapshots[final], SNAPSHOT_FORMATS)
    budget = manifest["run"]["train"]["env_steps"]
    if final != budget:
        raise ValueError(f"{layout.policies(name)}: last policy snapshot at {final:,} env steps, the trial's budget "
                         f"is {budget:,} (finished without a final snapshot)")
    history = []
    for e in manifest.get("evals", []):
        h = {"env_steps": e["env_steps"], "eval/return_mean": e["return_mean"]}
        if e.get("q_gap_mean") is not None and math.isfinite(e["q_gap_mean"]):
            h["q/abs_diff_mean"] = e["q_gap_mean"]
        history.append(h)
    t = TrialId.from_name(name)
    return TrialRecord(name, t.task, t.agent, t.variant, t.seed, manifest["run"]["train"]["frame_skip"],
                       {step: str(path) for step, path in snapshots.items()}, history)


def _policies(records: list[TrialRecord], step: int, device: str):
    return [load_policy(r.policies[step], device)[0] for r in records]


def variability(agents, task: str, episodes: int, frame_skip: int, policy: EvalPolicy = "mean"
                ) -> tuple[float, np.ndarray, list]:
    """V and the pairwise matrix D on the states of every agent's own eval rollouts (pooled) under the evaluation
    policy ``policy``, and the rollouts."""
    rolls = rollout_many([eval_policy(a, policy) for a in agents], task, eval_seeds(episodes), frame_skip=frame_skip)
    pooled = metrics.pool_states([r.pooled_obs() for r in rolls])
    dists = [a.policy_distribution(pooled) for a in agents]
    mus, sigmas = np.stack([d[0] for d in dists]), np.stack([d[1] for d in dists])
    if len(agents) < 2:
        return math.nan, np.zeros((1, 1)), rolls
    d = metrics.pairwise_policy_divergence(mus, sigmas)
    return metrics.variability_from_matrix(d), d, rolls


def action_rollouts(agents, rolls: list, task: str, n: int, steps: int, frame_skip: int,
                    policy: EvalPolicy = "mean") -> np.ndarray:
    """Actions [P, T, L, A] of every agent from the same ``n`` initial states for ``steps`` decisions (Sec. 6.2),
    under the evaluation policy ``policy`` (``rolls`` are that policy's eval rollouts).

    From the shared eval seeds a policy repeats its eval episodes exactly (tanh(mu) is deterministic, and a
    sampling policy's noise is fixed by the episode's seed), so when the eval rollouts cover them their first
    ``steps`` actions are reused instead of rolling out again.
    """
    if n <= rolls[0].actions.shape[0] and steps <= rolls[0].actions.shape[1]:
        return np.stack([r.actions[:n, :steps] for r in rolls])
    act = rollout_many([eval_policy(a, policy) for a in agents], task, eval_seeds(n), max_decisions=steps,
                       frame_skip=frame_skip)
    return np.stack([r.actions for r in act])


def q1_dispersion(agents, pooled: np.ndarray) -> float:
    """Mean over seed pairs of |mean_s Q1_i(s, pi_i(s)) - mean_s Q1_j(s, pi_j(s))| (App. D, cross-seed Q1)."""
    means = [float(a.q_values(pooled, a.act_batch(pooled))[0].mean()) for a in agents]
    pairs = list(itertools.combinations(means, 2))
    return float(np.mean([abs(x - y) for x, y in pairs])) if pairs else math.nan


def _early_q_gap(records: Sequence[TrialRecord], window: int) -> float:
    """Mean within-run |Q1 - Q2| over each seed's first ``window`` evaluations, then over seeds (App. D's
    "early-training interval (first 15 rollouts)", read as evaluations: ``final_eval.proxy_window``)."""
    early = [np.mean([h["q/abs_diff_mean"] for h in r.history[:window] if "q/abs_diff_mean" in h])
             for r in records if any("q/abs_diff_mean" in h for h in r.history)]
    return float(np.mean(early)) if early else math.nan


def evaluate_group(records: Sequence[TrialRecord], final_eval: FinalEvalSpec, device: str = "cpu") -> GroupResult:
    """All per-group numbers of one (task, agent, variant) from its seeds' records (any order): the first
    evaluation policy's, with every other policy's in ``other_policies``."""
    records = sorted(records, key=lambda r: r.seed)
    agents = _policies(records, max(records[0].policies), device)
    first, *others = final_eval.policies
    result = _evaluate_policy(records, agents, final_eval, device, first)
    return dataclasses.replace(result, other_policies={
        p: _evaluate_policy(records, agents, final_eval, device, p) for p in others})


def _evaluate_policy(records: Sequence[TrialRecord], agents: list, final_eval: FinalEvalSpec, device: str,
                     policy: EvalPolicy) -> GroupResult:
    """One evaluation policy's numbers of a group (records sorted by seed, ``agents`` their final policies)."""
    task, fs = records[0].task, records[0].frame_skip
    final_step = max(records[0].policies)
    v, d, rolls = variability(agents, task, final_eval.episodes, fs, policy)
    actions = action_rollouts(agents, rolls, task, final_eval.action_rollouts, final_eval.action_steps, fs, policy)
    pooled = metrics.pool_states([r.pooled_obs() for r in rolls])
    common = sorted(set.intersection(*(set(r.policies) for r in records)))
    curve = []
    for step in common:
        if step == final_step:
            curve.append([step, v])
        elif len(records) > 1:
            curve.append([step, variability(_policies(records, step, device), task, final_eval.curve_episodes,
                                            fs, policy)[0]])
    returns = [r.returns.tolist() for r in rolls]
    pairs = metrics.pairwise_action_distance(actions) if len(agents) > 1 else np.zeros((1, 1))
    return GroupResult(
        task=task, agent=records[0].agent, variant=records[0].variant, seeds=[r.seed for r in records],
        final_env_steps=final_step, returns=returns,
        scores=metrics.normalized_score([np.mean(x) for x in returns]).tolist(), V=v, D=d.tolist(),
        action_distance=metrics.cumulative_action_distance(actions) if len(agents) > 1 else math.nan,
        action_distance_pairs=pairs.tolist(),
        v_curve=curve, q1_dispersion=q1_dispersion(agents, pooled),
        early_q_gap=_early_q_gap(records, final_eval.proxy_window),
        learning_curves={r.seed: [[h["env_steps"], h["eval/return_mean"]] for h in r.history
                                  if "eval/return_mean" in h] for r in records}, policy=policy)


def main(argv: list[str] | None = None) -> int:
    """``python -m qed_ray.analysis SWEEP_DIR``: the critic-proxy table (App. D) of a gathered sweep.

    Reads ``SWEEP_DIR/gather/results.json``, prints per agent-variant the early within-run |Q1 - Q2| (over the
    gather's ``final_eval.proxy_window`` first evaluations) and the final cross-seed Q1 dispersion per task with the
    R^2 of the line through them, and redraws the scatter plot.
    """
    import argparse
    import json
    import sys
    from pathlib import Path

    from qed_ray import plots
    from qed_ray.tables import critic_proxy

    p = argparse.ArgumentParser(prog="python -m qed_ray.analysis", description=main.__doc__.splitlines()[0])
    p.add_argument("sweep_dir", type=Path, help="a finished sweep folder (with gather/results.json)")
    args = p.parse_args(argv)
    layout = SweepDir(args.sweep_dir)
    if not layout.results_json.exists():
        print(f"error: sweep_dir: {layout.results_json} not found (run the sweep to its gather step first)",
              file=sys.stderr)
        return 2
    try:
        raw = json.loads(layout.results_json.read_text())
        groups = [GroupResult.from_json(g) for g in raw["groups"]]
        window = FinalEvalSpec.model_validate(raw.get("final_eval", {})).proxy_window
    except KeyError as e:
        print(f"error: sweep_dir: {layout.results_json} lacks {e} (written by an older version); rewrite it with "
              f"python -m qed_ray.gather {args.sweep_dir}", file=sys.stderr)
        return 2
    proxy = critic_proxy(groups)
    for row in proxy:
        print(f"{row.agent} {row.variant}: R^2 = {row.r_squared:.3f} over {len(row.tasks)} tasks")
        for task, x, y in zip(row.tasks, row.early_q_gap, row.q1_dispersion):
            print(f"  {task:18s} early |Q1-Q2| {x:9.4f}   final cross-seed Q1 dispersion {y:9.4f}")
    layout.figures.mkdir(parents=True, exist_ok=True)
    print(f"figure: {plots.save(plots.critic_proxy(proxy, window=window), layout.figures / 'critic_proxy.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
