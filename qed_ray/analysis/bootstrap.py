"""Bootstrap intervals over seeds for the cross-seed statistics (pure numpy), as rliable does for returns.

Pair statistics (V, the action distance) leave self-pairs out and condition on two distinct seeds; tasks are stratified;
te and QED draw the same seeds where they share them: docs/definitions.md, "Intervals over seeds for V and the action
distance" and "Paired intervals". Letters: I seeds of a group, R bootstrap replicates, K tasks, N runs pooled over
tasks."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

import numpy as np

from qed_ray.analysis import metrics

_MAX_REDRAWS = 1000  # P(one seed only) <= 1/2 per resample, so 1000 rounds leave ~2^-1000 of them


def rng_for(seed: int, *keys: str) -> np.random.Generator:
    """An independent, reproducible stream per (seed, keys), e.g. ``rng_for(0, "V", "cheetah-run", "qed0.2")``."""
    return np.random.default_rng([int(seed), *(zlib.crc32(k.encode()) for k in keys)])


def seed_counts(n_seeds: int, reps: int, rng: np.random.Generator, min_distinct: int = 1) -> np.ndarray:
    """(R, I) draw counts of ``reps`` resamples of ``n_seeds`` seeds with replacement, every row summing to I; rows with
    fewer than ``min_distinct`` distinct seeds are drawn again (2 for pair statistics)."""
    if n_seeds < 1 or reps < 1:
        raise ValueError(f"n_seeds, reps: expected >= 1, got {n_seeds}, {reps}")
    if n_seeds < min_distinct:
        raise ValueError(f"n_seeds: {n_seeds} seeds cannot give {min_distinct} distinct draws")
    counts = rng.multinomial(n_seeds, np.full(n_seeds, 1.0 / n_seeds), size=reps)
    for _ in range(_MAX_REDRAWS):
        bad = np.count_nonzero(counts, axis=1) < min_distinct
        if not bad.any():
            return counts
        counts[bad] = rng.multinomial(n_seeds, np.full(n_seeds, 1.0 / n_seeds), size=int(bad.sum()))
    raise RuntimeError("seed_counts: could not draw enough distinct seeds")  # unreachable in practice


def pair_mean(matrix, counts=None) -> np.ndarray | float:
    """Mean of a pairwise (I, I) ``matrix`` (symmetric, e.g. D of App. E; the diagonal never used) over ordered pairs of
    distinct seeds: a float, or with (R, I) draw ``counts`` (:func:`seed_counts`, min_distinct=2) the (R,) replicates
    ``sum_{i != j} c_i c_j M[i, j] / sum_{i != j} c_i c_j``."""
    m = np.asarray(matrix, dtype=np.float64)
    if m.ndim != 2 or m.shape[0] != m.shape[1] or m.shape[0] < 2:
        raise ValueError(f"matrix: expected a square (I, I) matrix with I >= 2, got shape {m.shape}")
    off = np.where(np.eye(m.shape[0], dtype=bool), 0.0, m)
    if counts is None:
        return float(off.sum() / (m.shape[0] * (m.shape[0] - 1)))
    c = np.asarray(counts, dtype=np.float64)
    num = np.einsum("ri,ij,rj->r", c, off, c)
    den = c.sum(axis=1) ** 2 - (c * c).sum(axis=1)
    return num / den


def pair_mean_replicates(matrix, reps: int, rng: np.random.Generator) -> np.ndarray:
    """(R,) bootstrap replicates of :func:`pair_mean` over seeds, self-pairs left out."""
    n = np.shape(matrix)[0]
    return pair_mean(matrix, seed_counts(n, reps, rng, min_distinct=2))


def seed_replicates(values, statistic: Callable[[np.ndarray], np.ndarray], reps: int,
                    rng: np.random.Generator) -> np.ndarray:
    """(R,) replicates of a per-seed statistic: ``statistic`` maps (R, I) resampled values to (R,)."""
    v = np.asarray(values, dtype=np.float64)
    idx = rng.integers(0, v.shape[0], size=(reps, v.shape[0]))
    return statistic(v[idx])


def across_seed_variance(samples: np.ndarray) -> np.ndarray:
    """Sample variance (ddof 1) over the last axis, shape ``samples.shape[:-1]``; needs at least 2 values."""
    s = np.asarray(samples, dtype=np.float64)
    if s.shape[-1] < 2:
        raise ValueError(f"samples: the variance across seeds needs at least 2 seeds, got shape {s.shape}")
    return s.var(axis=-1, ddof=1)


def percentile_interval(replicates, confidence: float) -> tuple[float, float]:
    """The (1 - c)/2 and (1 + c)/2 percentiles of the finite replicates (NaN, NaN if there are none)."""
    r = np.asarray(replicates, dtype=np.float64)
    r = r[np.isfinite(r)]
    if r.size == 0:
        return float("nan"), float("nan")
    tail = 100.0 * (1.0 - float(confidence)) / 2.0
    lo, hi = np.percentile(r, [tail, 100.0 - tail])
    return float(lo), float(hi)


def pair_mean_interval(matrix, reps: int, confidence: float, rng: np.random.Generator) -> tuple[float, float, float]:
    """(point, lower, upper) of a group's pair mean (V or action distance) over its seeds.

    Two seeds have a single pair, so their interval is that one value: the width says nothing about the spread
    then, and tables show the seed count beside it.
    """
    return (pair_mean(matrix), *percentile_interval(pair_mean_replicates(matrix, reps, rng), confidence))


def _columns(per_task: Sequence[np.ndarray]) -> list[np.ndarray]:
    cols = [np.asarray(t, dtype=np.float64).ravel() for t in per_task]
    if not cols or any(c.size == 0 for c in cols):
        raise ValueError("per_task: expected at least one task, each with at least one score")
    return cols


def iqm_interval(per_task: Sequence[np.ndarray], reps: int, confidence: float, seed: int) -> dict[str, float]:
    """IQM of the runs pooled over tasks with its stratified-bootstrap interval, ``{"point", "lower", "upper",
    "width"}``; ``per_task``: K arrays, task k's n_k >= 1 normalised scores (one per seed).

    With equal counts this is exactly :func:`interval_estimate` on the (seeds, tasks) matrix (rliable's estimate); else
    each resample redraws task k's n_k scores from its own n_k, and the IQM pools all N = sum n_k."""
    cols = _columns(per_task)
    if len({c.size for c in cols}) == 1:
        return interval_estimate(np.stack(cols, axis=1), metrics.iqm, reps, confidence, seed)
    rng = np.random.default_rng(seed)
    samples = np.concatenate([c[rng.integers(0, c.size, size=(reps, c.size))] for c in cols], axis=1)
    stats = metrics.iqm_rows(samples)
    lower, upper = percentile_interval(stats, confidence)
    point = metrics.iqm(np.concatenate(cols)[None, :])
    return {"point": point, "lower": lower, "upper": upper, "width": upper - lower}


def mean_interval(per_task: Sequence[np.ndarray], reps: int, confidence: float, seed: int) -> dict[str, float]:
    """Mean of the runs pooled over tasks with its stratified-bootstrap interval (the "mean return" of Sec. 6.3);
    ``per_task``, the arguments and the result as :func:`iqm_interval`."""
    cols = _columns(per_task)
    rng = np.random.default_rng(seed)
    total = np.zeros(reps)
    for c in cols:  # sums per task, so memory stays (R,) whatever the seed count
        total += c[rng.integers(0, c.size, size=(reps, c.size))].sum(axis=1)
    lower, upper = percentile_interval(total / sum(c.size for c in cols), confidence)
    point = float(np.concatenate(cols).mean())
    return {"point": point, "lower": lower, "upper": upper, "width": upper - lower}


def stratified_mean_replicates(per_task_replicates: Sequence[np.ndarray]) -> np.ndarray:
    """(R,) replicates of the mean over tasks, from K arrays of (R,) per-task replicates drawn independently."""
    if not per_task_replicates:
        raise ValueError("per_task_replicates: expected at least one task")
    return np.mean(np.stack([np.asarray(r, dtype=np.float64) for r in per_task_replicates]), axis=0)


# ---- paired resampling of two variants' seeds (te vs QED; docs/definitions.md, "Paired intervals") -----------
# Runs with the same seed number share their initial weights and seeds, so a resample that draws seed i draws it for
# both and the ratio's interval reflects the variation of the difference; one (R, I) draw-count array per task.


def joint_counts(n_seeds: int, reps: int, rng: np.random.Generator) -> np.ndarray:
    """(R, I) draw counts shared by every variant of one task; resamples with fewer than two distinct seeds are
    drawn again (as for :func:`pair_mean_replicates`; with one seed it is that seed every time)."""
    return seed_counts(n_seeds, reps, rng, min_distinct=min(2, n_seeds))


def resample(values, counts) -> np.ndarray:
    """(R, I) the values each resample drew: row r holds ``values[i]`` (I,) ``counts[r, i]`` times (ascending i);
    ``counts`` (R, I) rows sum to I."""
    v, c = np.asarray(values, dtype=np.float64), np.asarray(counts)
    if c.ndim != 2 or c.shape[1] != v.shape[0] or (c.sum(axis=1) != v.shape[0]).any():
        raise ValueError(f"counts: expected (R, {v.shape[0]}) rows summing to {v.shape[0]}, got shape {c.shape}")
    idx = np.repeat(np.tile(np.arange(v.shape[0]), c.shape[0]), c.ravel()).reshape(c.shape)
    return v[idx]


def count_variance(values, counts) -> np.ndarray:
    """(R,) sample variance (ddof 1) of each resample's draws, from (I,) values and (R, I) counts."""
    v, c = np.asarray(values, dtype=np.float64), np.asarray(counts, dtype=np.float64)
    n = c.sum(axis=1)
    mean = c @ v / n
    return (c * (v[None, :] - mean[:, None]) ** 2).sum(axis=1) / (n - 1)


def ratio_intervals(base, this, confidence: float) -> dict[str, tuple[float, float]]:
    """Percentile intervals of :func:`qed_ray.analysis.metrics.ratio_summaries` over (R, K) replicates ``base`` and
    ``this``: ``{"median": (lower, upper), "geomean": ..., "means": ...}`` (undefined ratios dropped)."""
    reps = metrics.ratio_summaries(base, this)
    return {name: percentile_interval(reps[name], confidence) for name in metrics.RATIO_SUMMARIES}


def iqm_ratio_replicates(base: Sequence[np.ndarray], this: Sequence[np.ndarray]) -> np.ndarray:
    """(R,) replicates of IQM(this) / IQM(base) pooling every task's runs; ``base``, ``this``: K arrays each, task k's
    (R, I_k) resampled scores (:func:`resample`)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return metrics.iqm_rows(np.concatenate(this, axis=1)) / metrics.iqm_rows(np.concatenate(base, axis=1))


# ---- the IQM's stratified bootstrap (rliable's estimate) ---------------------------------------------------
def _check_bootstrap_args(reps: int, confidence: float, seed: int) -> None:
    if not isinstance(reps, (int, np.integer)) or reps < 1:
        raise ValueError(f"reps: expected a positive integer, got {reps!r}")
    if not 0.0 < float(confidence) < 1.0:
        raise ValueError(f"confidence: expected a value in (0, 1), got {confidence!r}")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed: expected a non-negative integer, got {seed!r}")


def stratified_bootstrap_ci(scores, statistic: Callable[[np.ndarray], float] = metrics.iqm, reps: int = 2000,
                            confidence: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile confidence interval by stratified bootstrap over runs (Sec. 6.1, rliable).

    Args:
        scores: (runs, tasks).
        statistic: (runs, tasks) -> scalar; ``metrics.iqm`` runs vectorised over the replicates.

    Returns:
        (lower, upper): the (1 -/+ confidence)/2 percentiles (linear interpolation, as arch/rliable) of the statistic
        over the resampled matrices; the same ``seed`` gives the same interval."""
    mat = metrics.check_scores(scores)
    _check_bootstrap_args(reps, confidence, seed)
    n_runs, n_tasks = mat.shape  # runs drawn with replacement within each task's column (stratified)
    samples = mat[np.random.default_rng(int(seed)).integers(0, n_runs, size=(int(reps), n_runs, n_tasks)),
                  np.arange(n_tasks)]
    if statistic is metrics.iqm:
        stats = metrics.trimmed_mean_last_axis(samples.reshape(reps, -1))
    else:
        stats = np.array([float(statistic(sample)) for sample in samples])
    tail = 100.0 * (1.0 - float(confidence)) / 2.0
    lower, upper = np.percentile(stats, [tail, 100.0 - tail])
    return float(lower), float(upper)


def ci_width(lower: float, upper: float) -> float:
    """upper - lower of finite bounds with upper >= lower (Fig. 3b), else ValueError."""
    if not (np.isfinite(lower) and np.isfinite(upper)) or upper < lower:
        raise ValueError(f"upper: expected finite bounds with upper >= lower, got lower={lower}, upper={upper}")
    return float(upper - lower)


def interval_estimate(scores, statistic: Callable[[np.ndarray], float] = metrics.iqm, reps: int = 2000,
                      confidence: float = 0.95, seed: int = 0) -> dict[str, float]:
    """Point, lower, upper and width of ``statistic`` on (runs, tasks) ``scores`` (:func:`stratified_bootstrap_ci`)."""
    lower, upper = stratified_bootstrap_ci(scores, statistic, reps, confidence, seed)
    point = float(statistic(metrics.check_scores(scores)))
    return {"point": point, "lower": lower, "upper": upper, "width": ci_width(lower, upper)}
