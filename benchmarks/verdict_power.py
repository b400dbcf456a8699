"""Power and error rates of the pre-registered verdict (docs/claim.md), by simulation.

Simulates the registered design (6 tasks x 15 seeds, te and two QED variants, seeds paired) under stated effects
and degenerate scenarios, draws the paired seed bootstrap of every experiment at once (vectorised numpy), and
decides each experiment with the verdict's own rules (:mod:`qed_ray.analysis.verdict`: per-task guards with the
learning floors of :func:`qed_ray.analysis.evidence.learning_floor`, both endpoints on intervals, Bonferroni over
the two variants). Prints per scenario the claim's pass / fail / not-enough-data rates with their Monte-Carlo
standard errors, the per-variant pass rate and what the scenario must show.

The variance model (stated, not measured): per task a normalised-score mean and SD (``MEANS``, ``SDS``), seeds
failing to a random-policy score with probability ``FAIL_P`` (hopper-hop, reacher-hard), a paired-seed correlation
of 0.3 between te and QED scores; pairwise KL D_ij = s (a_i + a_j) / 2 w_ij with per-seed effects
a ~ LogNormal(0, sigma_a) and pair noise w ~ LogNormal(0, 0.3), te's scale s log-uniform in [5, 500] per task and
QED's s / rho. This is the model of an independent fidelity review's power simulation, where it found the
weaknesses the guards now close.

Run: ``nice -n 10 .venv/bin/python benchmarks/verdict_power.py [--quick] [--experiments 5000] [--reps 500]``
(``--quick``: 1,000 experiments per row at 300 resamples; ``--seeds``, ``--decision-confidence``: other designs;
``--adaptive START STEP MAX``: seeds by looks, each world grown to MAX seeds and judged look by look by
:mod:`qed_ray.analysis.sequential`'s rule at the looks' levels, with the mean stopping look and the expected seed
runs per task).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from qed_ray.analysis.evidence import learning_floor  # noqa: E402
from qed_ray.analysis.verdict import FAIL, NOT_ENOUGH, PASS, combine, decision_level, guard_outcome, \
    interval_outcome, look_levels  # noqa: E402
from qed_ray.spec.claim import AdaptiveSpec, Endpoints, registered_design  # noqa: E402

TASKS = ("cheetah-run", "walker-walk", "hopper-hop", "finger-spin", "reacher-hard", "quadruped-walk")
MEANS = np.array([0.80, 0.95, 0.35, 0.90, 0.85, 0.85])
SDS = np.array([0.05, 0.02, 0.10, 0.06, 0.08, 0.10])
FAIL_P = np.array([0.0, 0.0, 0.15, 0.0, 0.15, 0.0])
RANDOM = np.array([0.005, 0.04, 0.001, 0.01, 0.01, 0.04])  # a random policy's normalised score per task
COLLAPSED_SD = 0.01  # the spread of an arm stuck near a random policy's score (not a trained arm's)
PAIR_CORR = 0.3
PAIR_NOISE = 0.3
SEEDS, VARIANTS = registered_design().seeds, len(registered_design().variants)


@dataclass(frozen=True)
class Scenario:
    """One simulated world: the true te/QED V ratio ``rho`` and QED's score factor ``shift`` on every task, with
    per-task overrides (``qed_means``: QED's mean there, with the spread :data:`COLLAPSED_SD` of an arm that did not
    learn; ``te_means``: te's; ``rho_at``: rho there)."""

    name: str
    want: str
    rho: float = 100.0
    shift: float = 1.0
    sigma_a: float = 0.8
    te_means: dict = field(default_factory=dict)
    qed_means: dict = field(default_factory=dict)
    rho_at: dict = field(default_factory=dict)
    sd: float | None = None  # one SD for every task (near-random scores are not spread like trained ones)


SCENARIOS = [
    Scenario("S1 V x100, IQM equal (the paper)", "pass >= 0.80"),
    Scenario("S2 V x10, IQM equal", "(threshold: pass ~ rare)", rho=10.0),
    Scenario("S3 V x100, IQM -2%", "(information)", shift=0.98),
    Scenario("S4 V x100, IQM -5% (the margin)", "pass <= 0.025", shift=0.95),
    Scenario("S5 V x100, IQM -10%", "fail", shift=0.90),
    Scenario("S6 V x100, heavy seed effects (sigma_a 1.5)", "(power)", sigma_a=1.5),
    Scenario("D1 neither learned (te 0.02, QED 0.025)", "pass 0", te_means={t: 0.02 for t in TASKS},
             qed_means={t: 0.025 for t in TASKS}, sd=0.01),
    Scenario("D2 QED untrained (0.001), te learned, V x234", "pass 0", rho=234.0,
             qed_means={t: 0.001 for t in TASKS}),
    Scenario("D3 QED collapses on the weakest task (hopper-hop)", "pass 0", qed_means={"hopper-hop": 0.01},
             rho_at={"hopper-hop": 1000.0}),
    Scenario("D4 QED collapses on the strongest task (walker-walk)", "pass 0", qed_means={"walker-walk": 0.01},
             rho_at={"walker-walk": 1000.0}),
    Scenario("D5 no V effect, heavy seed effects (sigma_a 1.5)", "pass 0", rho=1.0, sigma_a=1.5),
]


def _scores(rng, n, means, sd, shared) -> np.ndarray:
    """(n, K, I) clipped normal scores with the paired component ``shared``; failed seeds near random."""
    own = rng.standard_normal((n, len(TASKS), SEEDS))
    z = np.sqrt(PAIR_CORR) * shared + np.sqrt(1 - PAIR_CORR) * own
    s = np.clip(means[None, :, None] + sd[None, :, None] * z, 0.0, 1.0)
    failed = rng.random((n, len(TASKS), SEEDS)) < FAIL_P[None, :, None]
    return np.where(failed, RANDOM[None, :, None] + np.abs(rng.normal(0, 0.01, s.shape)), s)


def _kl(rng, n, scale, sigma_a) -> np.ndarray:
    """(n, K, I, I) pairwise KL matrices, zero diagonal."""
    a = rng.lognormal(0.0, sigma_a, (n, len(TASKS), SEEDS))
    w = rng.lognormal(0.0, PAIR_NOISE, (n, len(TASKS), SEEDS, SEEDS))
    w = np.triu(w, 1) + np.triu(w, 1).swapaxes(-1, -2)
    return scale[..., None, None] * (a[..., :, None] + a[..., None, :]) / 2 * w


def _world(sc: Scenario, rng, n):
    """te's and each variant's scores (n, K, I) and KL matrices (n, K, I, I)."""
    sd = np.full(len(TASKS), sc.sd) if sc.sd is not None else SDS
    te_mu = np.array([sc.te_means.get(t, m) for t, m in zip(TASKS, MEANS)])
    q_mu = np.array([sc.qed_means.get(t, m * sc.shift) for t, m in zip(TASKS, te_mu)])
    q_sd = np.array([COLLAPSED_SD if t in sc.qed_means else x for t, x in zip(TASKS, sd)])
    rho = np.array([sc.rho_at.get(t, sc.rho) for t in TASKS])
    shared = rng.standard_normal((n, len(TASKS), SEEDS))
    scale = np.exp(rng.uniform(np.log(5), np.log(500), (n, len(TASKS))))
    te = (_scores(rng, n, te_mu, sd, shared), _kl(rng, n, scale, sc.sigma_a))
    variants = [(_scores(rng, n, q_mu, q_sd, shared), _kl(rng, n, scale / rho, sc.sigma_a)) for _ in range(VARIANTS)]
    return te, variants


def _ends(reps: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    """Percentile ends over the last axis (NaN rows give NaN)."""
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(reps, [tail, 100 - tail], axis=-1)
    return lo, hi


def masked_median(x: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Median over the last axis of the entries where ``keep`` (NaN where none is kept)."""
    s = np.sort(np.where(keep, x, np.inf), axis=-1)
    n = keep.sum(-1)
    lo = np.take_along_axis(s, np.maximum((n - 1) // 2, 0)[..., None], -1)[..., 0]
    hi = np.take_along_axis(s, np.maximum(n // 2, 0)[..., None] - (n == 0)[..., None], -1)[..., 0]
    return np.where(n > 0, (lo + hi) / 2, np.nan)


def masked_iqm(x: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """25% trimmed mean over the last axis of the entries where ``keep`` (int(0.25 n) cut at each end, as
    :func:`qed_ray.analysis.metrics.iqm`)."""
    s = np.sort(np.where(keep, x, np.inf), axis=-1)
    n = keep.sum(-1)
    g = n // 4
    cs = np.concatenate([np.zeros((*s.shape[:-1], 1)), np.cumsum(np.where(np.isfinite(s), s, 0.0), -1)], -1)
    total = np.take_along_axis(cs, (n - g)[..., None], -1)[..., 0] - np.take_along_axis(cs, g[..., None], -1)[..., 0]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n - 2 * g > 0, total / (n - 2 * g), np.nan)


def _draw(counts: np.ndarray, scores: np.ndarray, kl: np.ndarray):
    """Per task replicates of the mean score (n, K, R) and V (n, K, R) from draw counts (n, K, R, I)."""
    seeds = scores.shape[-1]
    c = counts.astype(np.float64)  # (n, K, R, I)
    mean = c @ scores[..., None] / seeds  # (n, K, R, 1)
    v = ((c @ kl) * c).sum(-1) / (seeds ** 2 - (c * c).sum(-1))
    return mean[..., 0], v


def _resampled(idx: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """(n, R, K, I) resampled scores from draw indices (n, K, R, I)."""
    return np.take_along_axis(scores[:, :, None, :], idx, -1).transpose(0, 2, 1, 3)


def _first(world: tuple, seeds: int) -> tuple:
    """An arm's scores and KL matrices on its first ``seeds`` seeds (the seeds of an earlier look)."""
    scores, kl = world
    return scores[..., :seeds], kl[..., :seeds, :seeds]


def _judge(te, variants, rng, reps: int, level: float, endpoints: Endpoints) -> np.ndarray:
    """Each variant's outcome (n, VARIANTS) by the verdict's rules at ``level``, from the arms' (n, K, I) scores
    and (n, K, I, I) KL matrices."""
    n, seeds = te[0].shape[0], te[0].shape[-1]
    idx = rng.integers(0, seeds, (n, len(TASKS), reps, seeds))
    counts = (idx[..., None] == np.arange(seeds)).sum(-2)
    g = endpoints.guards
    floor = learning_floor(RANDOM, g.learned_above_random)[None, :]
    te_mean_reps, te_v_reps = _draw(counts, *te)
    te_lo, _ = _ends(te_mean_reps, level)
    te_res = _resampled(idx, te[0]).reshape(n, reps, -1)
    te_v = te[1].sum((-1, -2)) / (seeds * (seeds - 1))
    out = []
    for scores, kl in variants:
        mean_reps, v_reps = _draw(counts, scores, kl)
        _, q_hi = _ends(mean_reps, level)
        _, r_hi = _ends(mean_reps / te_mean_reps, level)
        guards = guard_outcome(floor, te_lo, q_hi, r_hi, g.mean_kept)  # (n, K)
        v_keep = guards == PASS
        v_point = masked_median(te_v / (kl.sum((-1, -2)) / (seeds * (seeds - 1))), v_keep)
        v_rep = masked_median((te_v_reps / v_reps).transpose(0, 2, 1), v_keep[:, None, :])  # (n, R)
        v_out = interval_outcome(v_point, *_ends(v_rep, level), endpoints.v_ratio.lower_at_least)
        learned = np.repeat(guards != NOT_ENOUGH, seeds, axis=-1)  # (n, K*I)
        q_point = (masked_iqm(scores.reshape(n, -1), learned) / masked_iqm(te[0].reshape(n, -1), learned))
        res = _resampled(idx, scores).reshape(n, reps, -1)
        with np.errstate(invalid="ignore", divide="ignore"):
            q_rep = masked_iqm(res, learned[:, None]) / masked_iqm(te_res, learned[:, None])
        q_out = interval_outcome(q_point, *_ends(q_rep, level), endpoints.iqm_kept.lower_at_least)
        out.append(combine(np.concatenate([guards, v_out[:, None], q_out[:, None]], -1), any_pass=False))
    return np.stack(out, -1)


def decide(sc: Scenario, rng, n: int, reps: int, endpoints: Endpoints) -> tuple[np.ndarray, np.ndarray]:
    """The claim's outcome (n,) and each variant's (n, VARIANTS) for ``n`` simulated experiments."""
    te, variants = _world(sc, rng, n)
    per_variant = _judge(te, variants, rng, reps, decision_level(endpoints, VARIANTS), endpoints)
    return combine(per_variant, any_pass=True), per_variant


def decide_adaptive(sc: Scenario, rng, n: int, reps: int, endpoints: Endpoints, adaptive: AdaptiveSpec):
    """The adaptive design (:mod:`qed_ray.analysis.sequential`'s rule, look by look, on worlds of ``max_seeds``
    seeds): the claim's outcome (n,), each variant's (n, VARIANTS), the look where growth ended (n,) and the seed
    runs used per task (n,: te's seeds plus each variant's)."""
    te, variants = _world(sc, rng, n)
    looks, levels = adaptive.looks(), look_levels(endpoints, adaptive, VARIANTS)
    floor = learning_floor(RANDOM, endpoints.guards.learned_above_random)
    decided = np.full((n, VARIANTS), "", dtype="<U16")
    used = np.zeros((n, 1 + VARIANTS))  # te's seeds, then each variant's, where each stopped
    stop, going = np.zeros(n, dtype=int), np.ones(n, dtype=bool)
    for k, (seeds, level) in enumerate(zip(looks, levels), start=1):
        live = going[:, None] & (decided == "")
        used[going, 0], used[:, 1:] = seeds, np.where(live, seeds, used[:, 1:])
        out = _judge(_first(te, seeds), [_first(v, seeds) for v in variants], rng, reps, level, endpoints)
        te_stop = (te[0][..., :seeds].mean(-1) < floor).any(-1)  # te's mean score below its floor on a task
        now = np.where(np.isin(out, [PASS, FAIL]), out, np.where(te_stop[:, None], NOT_ENOUGH, ""))
        decided = np.where(live, now, decided)
        claim = combine(np.where(decided == "", NOT_ENOUGH, decided), any_pass=True)
        ended = going & (te_stop | (claim != NOT_ENOUGH) | (decided != "").all(-1) | (k == len(looks)))
        decided = np.where(ended[:, None] & (decided == ""), NOT_ENOUGH, decided)
        stop[ended], going = k, going & ~ended
    runs = used.sum(-1)
    return combine(decided, any_pass=True), decided, stop, runs


def run(sc: Scenario, experiments: int, reps: int, endpoints: Endpoints, seed: int, chunk: int = 50,
        adaptive: AdaptiveSpec | None = None) -> dict:
    """Rates of one scenario over ``experiments`` experiments (drawn ``chunk`` at a time); with ``adaptive`` also
    the mean stopping look and the seed runs used per task (mean and its standard error)."""
    rng = np.random.default_rng([seed, sum(map(ord, sc.name))])
    parts = [decide(sc, rng, min(chunk, experiments - start), reps, endpoints) if adaptive is None else
             decide_adaptive(sc, rng, min(chunk, experiments - start), reps, endpoints, adaptive)
             for start in range(0, experiments, chunk)]
    c, v, *more = (np.concatenate(x) for x in zip(*parts))
    rate = {o: float(np.mean(c == o)) for o in (PASS, FAIL, NOT_ENOUGH)}
    out = {"scenario": sc.name, "want": sc.want, "n": len(c), **rate,
           "se": {o: float(np.sqrt(p * (1 - p) / len(c))) for o, p in rate.items()},
           "variant_pass": float(np.mean(v == PASS))}
    if more:
        stop, runs = more
        out |= {"look": float(stop.mean()), "runs": float(runs.mean()), "runs_se": float(runs.std() / np.sqrt(len(c)))}
    return out


def _row(r: dict) -> str:
    cell = lambda o: f"{r[o]:.3f} ± {r['se'][o]:.3f}"  # noqa: E731
    seeds = f" {r['look']:.2f} | {r['runs']:.1f} ± {r['runs_se']:.1f} |" if "look" in r else ""
    return (f"| {r['scenario']} | {r['n']:,} | {cell(PASS)} | {cell(FAIL)} | {cell(NOT_ENOUGH)} | "
            f"{r['variant_pass']:.3f} |{seeds} {r['want']} |")


def main(argv: list[str] | None = None) -> int:
    global SEEDS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1,000 experiments per row at 300 resamples")
    p.add_argument("--experiments", type=int, default=5000, help="simulated experiments per scenario")
    p.add_argument("--reps", type=int, default=500, help="bootstrap resamples per experiment")
    p.add_argument("--decision-confidence", type=float, default=Endpoints().decision_confidence,
                   help="family-wise level to try (default: the registered one)")
    p.add_argument("--only", nargs="*", default=None, help="scenario name prefixes (e.g. S1 S4)")
    p.add_argument("--seeds", type=int, default=SEEDS, help="seeds per task and variant (the registered 10)")
    p.add_argument("--adaptive", nargs=3, type=int, metavar=("START", "STEP", "MAX"), default=None,
                   help="simulate seeds by looks instead (default: the registered block's adaptive, if any)")
    p.add_argument("--spending", default="obrien_fleming", choices=["obrien_fleming", "pocock"])
    p.add_argument("--fixed", action="store_true", help="the fixed design even when the registered one is adaptive")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    registered = registered_design().adaptive
    adaptive = (None if args.fixed else AdaptiveSpec(start=args.adaptive[0], step=args.adaptive[1],
                                                     max_seeds=args.adaptive[2], spending=args.spending)
                if args.adaptive else registered)
    SEEDS = adaptive.max_seeds if adaptive else args.seeds
    n, reps = (1000, 300) if args.quick else (args.experiments, args.reps)
    endpoints = Endpoints(decision_confidence=args.decision_confidence)
    if adaptive:
        levels = ", ".join(f"{100 * x:.4g}%" for x in look_levels(endpoints, adaptive, VARIANTS))
        print(f"verdict power, seeds by looks: {n:,} experiments per row, {reps:,} paired resamples each, "
              f"{len(TASKS)} tasks, looks at {', '.join(map(str, adaptive.looks()))} seeds, {VARIANTS} variants, "
              f"decision_confidence {args.decision_confidence:g} (Bonferroni, spent by {adaptive.spending}: "
              f"intervals at {levels})")
        print("| scenario | experiments | claim pass | claim fail | claim not enough data | per-variant pass | "
              "mean stopping look | seed runs per task (max " f"{adaptive.max_seeds * (1 + VARIANTS)}) | must |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    else:
        print(f"verdict power: {n:,} experiments per row, {reps:,} paired resamples each, {len(TASKS)} tasks x "
              f"{SEEDS} seeds, {VARIANTS} variants, decision_confidence {args.decision_confidence:g} (Bonferroni: "
              f"intervals at {100 * decision_level(endpoints, VARIANTS):.4g}%)")
        print("| scenario | experiments | claim pass | claim fail | claim not enough data | per-variant pass | must |")
        print("|---|---:|---:|---:|---:|---:|---|")
    for sc in SCENARIOS:
        if args.only and not any(sc.name.startswith(o) for o in args.only):
            continue
        t0 = time.perf_counter()
        print(_row(run(sc, n, reps, endpoints, args.seed, adaptive=adaptive))
              + f"  <!-- {time.perf_counter() - t0:.0f} s -->", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
