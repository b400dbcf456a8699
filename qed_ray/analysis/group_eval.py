"""Cross-seed evaluation of one group's saved policies (Ray-free; the gather step runs it as a task or in-process)."""

from __future__ import annotations

import itertools
import math
import zlib
from typing import TYPE_CHECKING, Sequence

import numpy as np

from qed_ray.analysis import metrics
from qed_ray.records.layout import MANIFEST_FILE
from qed_ray.records.checkpoint import SNAPSHOT_FORMATS, read_manifest
from qed_ray.records.run import read_history
from qed_ray.rl.env_pool import EnvPool
from qed_ray.rl.evaluate import EvalPolicy, Rollouts, eval_policy, eval_seeds, rollout_in_chunks
from qed_ray.records.layout import SweepDir, TrialId
from qed_ray.analysis.results import GroupResult, TrialRecord
from qed_ray.spec.sweep import FinalEvalSpec

if TYPE_CHECKING:  # torch comes with the agents: loaded where policies are, not for --status's trial records
    from qed_ray.rl.agents import PackedAgent


def trial_record(layout: SweepDir, name: str) -> TrialRecord:
    """A finished trial's record from its policy snapshots (the final one's manifest holds the eval history).

    Raises:
        FileNotFoundError / ValueError: no snapshot, or the last one is not at the trial's budget; RecordError
        (a ValueError): a damaged manifest or ``history.json``, naming it.
    """
    snapshots = layout.snapshots(name)
    if not snapshots:
        raise FileNotFoundError(f"{layout.policies(name)}: no complete policy snapshot")
    final = max(snapshots)
    manifest = read_manifest(snapshots[final], SNAPSHOT_FORMATS)
    (run,) = manifest.require(snapshots[final] / MANIFEST_FILE, "run")
    budget = run.train.env_steps
    if final != budget:
        raise ValueError(f"{layout.policies(name)}: last policy snapshot at {final:,} env steps, the trial's budget "
                         f"is {budget:,} (finished without a final snapshot)")
    t = TrialId.from_name(name)
    return TrialRecord(name, t.task, t.agent, t.variant, t.seed, run.train.frame_skip,
                       {step: str(path) for step, path in snapshots.items()}, list(manifest.evals),
                       _diagnostic_history(layout, name))


# GroupResult field -> the history.json column its per-interval values come from (QED logs the shares; every rule
# logs the entropy). "alpha_ratio" is alpha/actor_mean / alpha/te, QED only (te's is 1 by definition).
INTERVAL_COLUMNS = {"alpha_frac_floor": "alpha/actor_frac_floor", "alpha_frac_cap": "alpha/actor_frac_cap",
                    "alpha_frac_hot": "alpha/actor_frac_hot", "entropy": "policy/entropy"}
WHOLE_AND_LATE = ("alpha_frac_floor", "alpha_frac_cap")  # the others are kept for the last quarter only


def _interval_values(metrics: dict) -> dict[str, float]:
    """One evaluation interval's diagnostics from its mean update metrics (absent: NaN)."""
    out = {k: float(metrics.get(col, math.nan)) for k, col in INTERVAL_COLUMNS.items()}
    qed = "alpha/actor_frac_cap" in metrics
    out["alpha_ratio"] = float(metrics["alpha/actor_mean"]) / float(metrics["alpha/te"]) if qed and \
        "alpha/actor_mean" in metrics and "alpha/te" in metrics else math.nan
    return out


def _diagnostic_history(layout: SweepDir, name: str) -> dict[int, dict[str, float]]:
    """``{env_steps: {diagnostic: value}}`` (:func:`_interval_values`) from the trial's ``history.json`` (the
    snapshot manifests do not carry them; a diagnostic, so the file is not among the checked snapshots)."""
    out = {}
    for entry in read_history(layout, name):
        values = _interval_values(entry.metrics)
        if any(math.isfinite(v) for v in values.values()):
            out[entry.env_steps] = values
    return out


def interval_diagnostics(records: Sequence[TrialRecord], final_step: int) -> dict[str, float]:
    """Where QED's alpha sat and the policy's entropy: per seed the mean over its evaluation intervals of each
    diagnostic (:func:`_interval_values`), over the intervals ending in the last quarter of the budget
    (``*_late``) and, for the floor and cap shares, over all of training too; then the mean over seeds (NaN where
    nothing was logged)."""
    out = {}
    for field in (*INTERVAL_COLUMNS, "alpha_ratio"):
        for suffix, start in (("", 0), ("_late", 0.75 * final_step)):
            if not suffix and field not in WHOLE_AND_LATE:
                continue
            per_seed = [np.mean(v) for r in records if (v := [d[field] for step, d in r.diagnostics.items()
                                                              if math.isfinite(d[field]) and step > start])]
            out[field + suffix] = float(np.mean(per_seed)) if per_seed else math.nan
    return out


MAX_POOL_ENVS = 64  # a group's evaluation envs at once (a dm_control env holds ~10 MB); episodes run in chunks


class GroupEnvs:
    """One pool of envs for a group's P seeds, reused by every rollout of its evaluation (final, V curve, action
    distances): P x chunk envs, each reseeded before every episode (:func:`~qed_ray.rl.evaluate.rollout_in_chunks`).

    Args:
        task: the group's task.
        n_policies: P.
        episodes: the most episodes any one rollout runs (the chunk never exceeds it).
        frame_skip: control steps per decision.
    """

    def __init__(self, task: str, n_policies: int, episodes: int, frame_skip: int):
        chunk = max(1, min(episodes, MAX_POOL_ENVS // n_policies))
        self.pool = EnvPool(task, eval_seeds(chunk) * n_policies, frame_skip)
        self.index = np.arange(n_policies * chunk).reshape(n_policies, chunk)

    def rollouts(self, pack: PackedAgent, policy: EvalPolicy, seeds: list[int], max_decisions: int | None = None
                 ) -> Rollouts:
        """Every seed's policy of ``pack`` (evaluation policy ``policy``) from the episode seeds ``seeds``."""
        return rollout_in_chunks(eval_policy(pack, policy), self.pool, self.index, seeds, max_decisions)

    def close(self) -> None:
        """Frees the envs."""
        self.pool.close()


RANDOM_POLICY_KEY = 0x5A4D  # keys the random policy's action streams apart from the evaluation noise


class RandomPolicy:
    """Acts uniformly at random in [-1, 1]^A, from one stream per (task, episode env seed), so the same episodes
    get the same actions whatever the chunking (:func:`qed_ray.rl.evaluate.rollout_lockstep` calls
    ``start_episodes``)."""

    def __init__(self, task: str, action_dim: int):
        self.key, self.action_dim, self.rngs = zlib.crc32(task.encode()), action_dim, []

    def start_episodes(self, seeds) -> None:
        """Restarts the streams at the episodes with env seeds ``seeds``."""
        self.rngs = [np.random.default_rng([RANDOM_POLICY_KEY, self.key, s]) for s in seeds]

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        """Actions [1, E, A] for observations [1, E, O]."""
        return np.stack([r.uniform(-1.0, 1.0, self.action_dim) for r in self.rngs])[None].astype(np.float32)


def random_score(envs: GroupEnvs, task: str, episodes: int) -> float:
    """The mean normalised score of :class:`RandomPolicy` over ``episodes`` episodes from the shared eval seeds:
    the base of the verdict's learning floor (docs/claim.md); every group of a task measures the same number."""
    rolls = rollout_in_chunks(RandomPolicy(task, envs.pool.action_dim), envs.pool, envs.index[:1],
                              eval_seeds(episodes))
    return float(metrics.normalized_score(rolls.returns[0]).mean())


def _pack(records: list[TrialRecord], step: int, device: str) -> PackedAgent:
    from qed_ray.rl.agents import load_policies

    return load_policies([r.policies[step] for r in records], device)[0]


def variability(pack: PackedAgent, envs: GroupEnvs, episodes: int, policy: EvalPolicy = "mean"
                ) -> tuple[float, np.ndarray, Rollouts, float]:
    """V and the pairwise matrix D on the states of every seed's own eval rollouts (pooled) under the evaluation
    policy ``policy``, the rollouts, and the share of the policies' log-std within 0.1 of the actor's lower bound
    on those states (:func:`qed_ray.analysis.metrics.share_at_lower_bound`)."""
    rolls = envs.rollouts(pack, policy, eval_seeds(episodes))
    pooled = metrics.pool_states([rolls.pooled_obs(p) for p in range(pack.n)])
    mus, sigmas = pack.distribution(np.repeat(pooled[None], pack.n, axis=0))
    at_min = metrics.share_at_lower_bound(sigmas, pack.spec.log_std_min)
    if pack.n < 2:
        return math.nan, np.zeros((1, 1)), rolls, at_min
    d = metrics.pairwise_policy_divergence(mus, sigmas)
    return metrics.variability_from_matrix(d), d, rolls, at_min


def action_rollouts(pack: PackedAgent, envs: GroupEnvs, rolls: Rollouts, n: int, steps: int,
                    policy: EvalPolicy = "mean") -> np.ndarray:
    """Actions [P, T, L, A] of every seed from the same ``n`` initial states for ``steps`` decisions (Sec. 6.2),
    under the evaluation policy ``policy`` (``rolls`` are that policy's eval rollouts).

    From the shared eval seeds a policy repeats its eval episodes exactly (tanh(mu) is deterministic, and a
    sampling policy's noise is fixed by the episode's seed), so when the eval rollouts cover them their first
    ``steps`` actions are reused instead of rolling out again.
    """
    if n <= rolls.actions.shape[1] and steps <= rolls.actions.shape[2]:
        return rolls.actions[:, :n, :steps]
    return envs.rollouts(pack, policy, eval_seeds(n), max_decisions=steps).actions


def q1_dispersion(pack: PackedAgent, pooled: np.ndarray) -> float:
    """Mean over seed pairs of |mean_s Q1_i(s, pi_i(s)) - mean_s Q1_j(s, pi_j(s))| (App. D, cross-seed Q1)."""
    states = np.repeat(pooled[None], pack.n, axis=0)
    means = pack.q_values(states, pack.act_deterministic(states))[0].mean(axis=1)
    pairs = list(itertools.combinations(means.tolist(), 2))
    return float(np.mean([abs(x - y) for x, y in pairs])) if pairs else math.nan


def _early_q_gap(records: Sequence[TrialRecord], window: int) -> float:
    """Mean within-run |Q1 - Q2| over each seed's first ``window`` evaluations, then over seeds (App. D's
    "early-training interval (first 15 rollouts)", read as evaluations: ``final_eval.proxy_window``)."""
    early = [np.mean([e.q_gap_mean for e in r.history[:window] if math.isfinite(e.q_gap_mean)])
             for r in records if any(math.isfinite(e.q_gap_mean) for e in r.history)]
    return float(np.mean(early)) if early else math.nan


def evaluate_group(records: Sequence[TrialRecord], final_eval: FinalEvalSpec, device: str = "cpu") -> GroupResult:
    """All per-group numbers of one (task, agent, variant) from its seeds' records (any order): the first
    evaluation policy's, with every other policy's in ``other_policies``."""
    records = sorted(records, key=lambda r: r.seed)
    pack = _pack(records, max(records[0].policies), device)
    episodes = max(final_eval.episodes, final_eval.action_rollouts, final_eval.curve_episodes)
    envs = GroupEnvs(records[0].task, len(records), episodes, records[0].frame_skip)
    try:
        first, *others = final_eval.policies
        rand = random_score(envs, records[0].task, final_eval.episodes)
        result = _evaluate_policy(records, pack, envs, final_eval, device, first)
        return result.model_copy(update={"random_score": rand, "other_policies": {
            p: _evaluate_policy(records, pack, envs, final_eval, device, p).model_copy(update={"random_score": rand})
            for p in others}})
    finally:
        envs.close()


def _evaluate_policy(records: Sequence[TrialRecord], pack: PackedAgent, envs: GroupEnvs, final_eval: FinalEvalSpec,
                     device: str, policy: EvalPolicy) -> GroupResult:
    """One evaluation policy's numbers of a group (records sorted by seed, ``pack`` their final policies)."""
    final_step = max(records[0].policies)
    v, d, rolls, at_min = variability(pack, envs, final_eval.episodes, policy)
    actions = action_rollouts(pack, envs, rolls, final_eval.action_rollouts, final_eval.action_steps, policy)
    pooled = metrics.pool_states([rolls.pooled_obs(p) for p in range(pack.n)])
    common = sorted(set.intersection(*(set(r.policies) for r in records)))
    curve = []
    for step in common:
        if step == final_step:
            curve.append([step, v])
        elif len(records) > 1:
            curve.append([step, variability(_pack(list(records), step, device), envs, final_eval.curve_episodes,
                                            policy)[0]])
    returns = rolls.returns.tolist()
    pairs = metrics.pairwise_action_distance(actions) if pack.n > 1 else np.zeros((1, 1))
    return GroupResult(
        task=records[0].task, agent=records[0].agent, variant=records[0].variant, seeds=[r.seed for r in records],
        final_env_steps=final_step, returns=returns,
        scores=metrics.normalized_score([np.mean(x) for x in returns]).tolist(), V=v, D=d.tolist(),
        action_distance=metrics.cumulative_action_distance(actions) if pack.n > 1 else math.nan,
        action_distance_pairs=pairs.tolist(),
        v_curve=curve, q1_dispersion=q1_dispersion(pack, pooled),
        early_q_gap=_early_q_gap(records, final_eval.proxy_window),
        learning_curves={r.seed: [[e.env_steps, e.return_mean] for e in r.history] for r in records}, policy=policy,
        log_std_at_min=at_min, **interval_diagnostics(records, final_step))


def main(argv: list[str] | None = None) -> int:
    """``qed-ray analysis SWEEP_DIR``: the critic-proxy table (App. D) of a gathered sweep.

    Reads ``SWEEP_DIR/gather/results.json``, prints per agent-variant the early within-run |Q1 - Q2| (over the
    gather's ``final_eval.proxy_window`` first evaluations) and the final cross-seed Q1 dispersion per task with the
    R^2 of the line through them, and redraws the scatter plot.
    """
    from qed_ray.spec import cli_help
    import sys
    from pathlib import Path

    from qed_ray.analysis import plots
    from qed_ray.analysis.results import read_results
    from qed_ray.analysis.tables import critic_proxy
    from qed_ray.records.codec import RecordError

    p = cli_help.parser("qed-ray analysis", main.__doc__, (
        "qed-ray analysis results/smoke   # the critic-proxy table of the demo sweep",
        "qed-ray analysis results/dmc18   # App. D's table and scatter plot"))
    p.add_argument("sweep_dir", type=Path, help="a finished sweep folder (with gather/results.json)")
    args = p.parse_args(argv)
    layout = SweepDir(args.sweep_dir)
    if not layout.results_json.exists():
        print(f"error: sweep_dir: {layout.results_json} not found (run the sweep to its gather step first)",
              file=sys.stderr)
        return 2
    try:
        results = read_results(layout.results_json)
    except RecordError as e:
        print(f"error: {e}; rewrite it with {sys.executable} -m qed_ray.gather {args.sweep_dir}", file=sys.stderr)
        return 2
    groups, window = results.groups, results.final_eval.proxy_window
    proxy = critic_proxy(groups)
    for row in proxy:
        print(f"{row.agent} {row.variant}: R^2 = {row.r_squared:.3f} over {len(row.tasks)} tasks")
        for task, x, y in zip(row.tasks, row.early_q_gap, row.q1_dispersion):
            print(f"  {task:18s} early |Q1-Q2| {x:9.4f}   final cross-seed Q1 dispersion {y:9.4f}")
    layout.figures.mkdir(parents=True, exist_ok=True)
    print(f"figure: {plots.save(plots.critic_proxy(proxy, window=window), layout.figures / 'critic_proxy.png')}")
    return 0
