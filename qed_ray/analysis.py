"""Cross-seed evaluation of finished trials and the sweep's tables (Ray-free; the gather actor runs these).

Per (task, agent, variant) group: final scores, inter-run variability V on the states pooled from every seed's
own evaluation rollouts (paper App. C), cumulative pairwise action distance over 100-step rollouts from shared
seeds (Sec. 6.2), V at intermediate policy snapshots (App. D), and the critic-proxy quantities (App. A).
Per (agent, variant) across tasks: IQM with a stratified bootstrap CI, CI width, mean/median V.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field

import numpy as np

from qed_ray import metrics
from qed_ray.agents import load_policy
from qed_ray.evaluate import eval_seeds, rollout_many

EARLY_INTERVALS = 15  # App. A: "the early-training interval (first 15 rollouts)"


@dataclass
class TrialRecord:
    """What the gather step needs of one finished trial: paths and a small history, never weights."""

    name: str
    task: str
    agent: str
    variant: str
    seed: int
    frame_skip: int
    policies: dict[int, str]  # env_steps -> policy snapshot folder
    history: list[dict] = field(default_factory=list)  # per eval: env_steps, eval/return_mean, q/abs_diff_mean


def _policies(records: list[TrialRecord], step: int, device: str):
    return [load_policy(r.policies[step], device)[0] for r in records]


def variability(agents, task: str, episodes: int, frame_skip: int) -> tuple[float, np.ndarray, list]:
    """V and the pairwise matrix D on the states of every agent's own eval rollouts (pooled), and the rollouts."""
    rolls = rollout_many([a.act_batch for a in agents], task, eval_seeds(episodes), frame_skip=frame_skip)
    pooled = metrics.pool_states([r.pooled_obs() for r in rolls])
    dists = [a.policy_distribution(pooled) for a in agents]
    mus, sigmas = np.stack([d[0] for d in dists]), np.stack([d[1] for d in dists])
    if len(agents) < 2:
        return math.nan, np.zeros((1, 1)), rolls
    d = metrics.pairwise_policy_divergence(mus, sigmas)
    return metrics.variability_from_matrix(d), d, rolls


def action_rollouts(agents, rolls: list, task: str, n: int, steps: int, frame_skip: int) -> np.ndarray:
    """Actions [P, T, L, A] of every agent from the same ``n`` initial states for ``steps`` decisions (Sec. 6.2).

    Deterministic policies from the shared eval seeds repeat the eval episodes exactly, so when the eval
    rollouts cover them their first ``steps`` actions are reused instead of rolling out again.
    """
    if n <= rolls[0].actions.shape[0] and steps <= rolls[0].actions.shape[1]:
        return np.stack([r.actions[:n, :steps] for r in rolls])
    act = rollout_many([a.act_batch for a in agents], task, eval_seeds(n), max_decisions=steps,
                       frame_skip=frame_skip)
    return np.stack([r.actions for r in act])


def q1_dispersion(agents, pooled: np.ndarray) -> float:
    """Mean over seed pairs of |mean_s Q1_i(s, pi_i(s)) - mean_s Q1_j(s, pi_j(s))| (App. A, cross-seed Q1)."""
    means = [float(a.q_values(pooled, a.act_batch(pooled))[0].mean()) for a in agents]
    pairs = list(itertools.combinations(means, 2))
    return float(np.mean([abs(x - y) for x, y in pairs])) if pairs else math.nan


def evaluate_group(records: list[TrialRecord], final_eval: dict, device: str = "cpu") -> dict:
    """All per-group numbers for one (task, agent, variant); ``final_eval`` is a FinalEvalSpec dump."""
    records = sorted(records, key=lambda r: r.seed)
    task, fs = records[0].task, records[0].frame_skip
    final_step = max(records[0].policies)
    agents = _policies(records, final_step, device)
    v, d, rolls = variability(agents, task, final_eval["episodes"], fs)
    actions = action_rollouts(agents, rolls, task, final_eval["action_rollouts"], final_eval["action_steps"], fs)
    pooled = metrics.pool_states([r.pooled_obs() for r in rolls])
    common = sorted(set.intersection(*(set(r.policies) for r in records)))
    curve = []
    for step in common:
        if step == final_step:
            curve.append([step, v])
        elif len(records) > 1:
            curve.append([step, variability(_policies(records, step, device), task,
                                            final_eval["curve_episodes"], fs)[0]])
    early = [np.mean([h["q/abs_diff_mean"] for h in r.history[:EARLY_INTERVALS] if "q/abs_diff_mean" in h])
             for r in records if any("q/abs_diff_mean" in h for h in r.history)]
    returns = [r.returns.tolist() for r in rolls]
    return {
        "task": task, "agent": records[0].agent, "variant": records[0].variant,
        "seeds": [r.seed for r in records], "final_env_steps": final_step,
        "returns": returns, "scores": [float(np.mean(x)) / 1000.0 for x in returns],
        "V": v, "D": d.tolist(),
        "action_distance": metrics.cumulative_action_distance(actions) if len(agents) > 1 else math.nan,
        "v_curve": curve,
        "q1_dispersion": q1_dispersion(agents, pooled),
        "early_q_gap": float(np.mean(early)) if early else math.nan,
        "learning_curves": {r.seed: [[h["env_steps"], h["eval/return_mean"]] for h in r.history
                                     if "eval/return_mean" in h] for r in records},
    }


def aggregate(groups: list[dict], final_eval: dict) -> list[dict]:
    """Per (agent, variant) across tasks: IQM + stratified bootstrap CI of scores, CI width, V mean/median."""
    out = []
    keys = sorted({(g["agent"], g["variant"]) for g in groups})
    for agent, variant in keys:
        gs = sorted((g for g in groups if (g["agent"], g["variant"]) == (agent, variant)), key=lambda g: g["task"])
        n = min(len(g["scores"]) for g in gs)  # a rectangular (seeds x tasks) matrix: drop extra seeds
        scores = np.array([g["scores"][:n] for g in gs]).T
        est = metrics.interval_estimate(scores, metrics.iqm, reps=final_eval["bootstrap_reps"],
                                        confidence=final_eval["confidence"], seed=final_eval["seed"])
        vs = np.array([g["V"] for g in gs], dtype=float)
        ad = np.array([g["action_distance"] for g in gs], dtype=float)
        fin = vs[np.isfinite(vs)]
        out.append({
            "agent": agent, "variant": variant, "n_tasks": len(gs), "n_seeds": n,
            "iqm": est["point"], "ci_lower": est["lower"], "ci_upper": est["upper"], "ci_width": est["width"],
            "mean_score": float(scores.mean()),
            "V_mean": float(fin.mean()) if fin.size else math.nan,
            "V_median": float(np.median(fin)) if fin.size else math.nan,
            "action_distance_mean": float(np.nanmean(ad)) if np.isfinite(ad).any() else math.nan,
        })
    return out


def critic_proxy(groups: list[dict]) -> list[dict]:
    """App. A per (agent, variant): early |Q1 - Q2| vs final cross-seed Q1 dispersion across tasks, with R^2."""
    out = []
    for agent, variant in sorted({(g["agent"], g["variant"]) for g in groups}):
        pts = [(g["task"], g["early_q_gap"], g["q1_dispersion"]) for g in groups
               if (g["agent"], g["variant"]) == (agent, variant)
               and math.isfinite(g["early_q_gap"]) and math.isfinite(g["q1_dispersion"])]
        x = np.array([p[1] for p in pts])
        y = np.array([p[2] for p in pts])
        r2 = math.nan
        if len(pts) >= 3 and np.ptp(x) > 0 and np.ptp(y) > 0:
            r2 = metrics.r_squared(x, y)
        out.append({"agent": agent, "variant": variant, "tasks": [p[0] for p in pts],
                    "early_q_gap": x.tolist(), "q1_dispersion": y.tolist(), "r_squared": r2})
    return out


def group_rows(groups: list[dict]) -> list[dict]:
    """Flat per-group table rows (CSV)."""
    return [{"task": g["task"], "agent": g["agent"], "variant": g["variant"], "n_seeds": len(g["seeds"]),
             "mean_return": float(np.mean([np.mean(r) for r in g["returns"]])),
             "std_return_across_seeds": float(np.std([np.mean(r) for r in g["returns"]])),
             "V": g["V"], "action_distance": g["action_distance"], "q1_dispersion": g["q1_dispersion"],
             "early_q_gap": g["early_q_gap"]} for g in groups]


def record_dict(r: TrialRecord) -> dict:
    """JSON-able view of a record."""
    return asdict(r)


def main(argv: list[str] | None = None) -> int:
    """``python -m qed_ray.analysis SWEEP_DIR``: the critic-proxy table (App. A) of a gathered sweep.

    Reads ``SWEEP_DIR/gather/results.json``, prints per agent-variant the early within-run |Q1 - Q2| and the final
    cross-seed Q1 dispersion per task with the R^2 of the line through them, and redraws the scatter plot.
    """
    import argparse
    import json
    import sys
    from pathlib import Path

    from qed_ray import plots

    p = argparse.ArgumentParser(prog="python -m qed_ray.analysis", description=main.__doc__.splitlines()[0])
    p.add_argument("sweep_dir", type=Path, help="a finished sweep folder (with gather/results.json)")
    args = p.parse_args(argv)
    path = args.sweep_dir / "gather" / "results.json"
    if not path.exists():
        print(f"error: sweep_dir: {path} not found (run the sweep to its gather step first)", file=sys.stderr)
        return 2
    results = json.loads(path.read_text())
    groups = [{**g, "early_q_gap": _nan(g["early_q_gap"]), "q1_dispersion": _nan(g["q1_dispersion"])}
              for g in results["groups"]]
    for row in critic_proxy(groups):
        print(f"{row['agent']} {row['variant']}: R^2 = {row['r_squared']:.3f} over {len(row['tasks'])} tasks")
        for task, x, y in zip(row["tasks"], row["early_q_gap"], row["q1_dispersion"]):
            print(f"  {task:18s} early |Q1-Q2| {x:9.4f}   final cross-seed Q1 dispersion {y:9.4f}")
    figures = args.sweep_dir / "gather" / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    out = plots.critic_proxy(critic_proxy(groups), figures / "critic_proxy.png")
    print(f"figure: {out}")
    return 0


def _nan(x):
    return math.nan if x is None else x


if __name__ == "__main__":
    raise SystemExit(main())
