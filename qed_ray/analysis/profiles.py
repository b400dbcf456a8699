"""The field's standard figures of final returns (Agarwal et al., "Deep RL at the Edge of the Statistical Precipice",
the rliable package), in pure numpy: performance profiles with stratified-bootstrap bands, and the probability of
improvement of one variant over another.

Definitions: docs/definitions.md, "Performance profiles and the probability of improvement". Letters: R replicates, T
thresholds, K tasks, n and m runs of a task."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from qed_ray.analysis import bootstrap
from qed_ray.analysis.results import GroupResult, PerformanceProfile
from qed_ray.spec.sweep import FinalEvalSpec

TAUS = tuple(np.round(np.linspace(0.0, 1.0, 101), 2).tolist())  # thresholds on the normalised score (return / 1000)


def probability_of_improvement(x, y) -> np.ndarray:
    """P(X > Y) + P(X = Y) / 2 between the runs of one task (rliable's), along the last axis: ``x`` (..., n), ``y``
    (..., m), leading axes broadcast -> (...) in [0, 1]."""
    a, b = np.asarray(x, dtype=np.float64)[..., :, None], np.asarray(y, dtype=np.float64)[..., None, :]
    return (a > b).mean(axis=(-2, -1)) + 0.5 * (a == b).mean(axis=(-2, -1))


def mean_probability_of_improvement(x: Sequence[np.ndarray], y: Sequence[np.ndarray]) -> np.ndarray:
    """The mean over K tasks of :func:`probability_of_improvement` of task k's ``x[k]`` (..., n_k) over ``y[k]``
    (..., m_k); (...) as the leading axes."""
    if not x or len(x) != len(y):
        raise ValueError(f"x, y: expected the same number (>= 1) of tasks, got {len(x)} and {len(y)}")
    return np.mean([probability_of_improvement(a, b) for a, b in zip(x, y)], axis=0)


def score_profile(per_task: Sequence[np.ndarray], taus=TAUS) -> np.ndarray:
    """(T,) share of the runs pooled over tasks whose score is above each threshold (K arrays of n_k scores)."""
    runs = np.concatenate([np.asarray(t, dtype=np.float64).ravel() for t in per_task])
    return (runs[:, None] > np.asarray(taus, dtype=np.float64)[None, :]).mean(axis=0)


def resample_indices(per_task: Sequence[np.ndarray], reps: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Per task k, (R, n_k) indices of its runs drawn with replacement, tasks in order from one stream."""
    return [rng.integers(0, np.size(t), size=(reps, np.size(t))) for t in per_task]


def profile_replicates(per_task: Sequence[np.ndarray], indices: Sequence[np.ndarray], taus=TAUS) -> np.ndarray:
    """(R, T) :func:`score_profile` of every resample (``indices`` from :func:`resample_indices`)."""
    taus = np.asarray(taus, dtype=np.float64)
    above = np.zeros((indices[0].shape[0], taus.size))
    for scores, idx in zip(per_task, indices):
        s = np.asarray(scores, dtype=np.float64).ravel()
        counts = (idx[:, :, None] == np.arange(s.size)).sum(axis=1)  # (R, n_k) draws of each run
        above += counts @ (s[:, None] > taus[None, :])
    return above / sum(np.size(t) for t in per_task)


def performance_profiles(groups: Sequence[GroupResult], final_eval: FinalEvalSpec) -> list[PerformanceProfile]:
    """Per (agent, variant): the score distribution over :data:`TAUS` with its stratified-bootstrap band (each
    variant its own stream, ``final_eval``'s replicates and confidence)."""
    by_av: dict[tuple[str, str], list[GroupResult]] = {}
    for g in sorted(groups, key=lambda g: (g.agent, g.variant, g.task)):
        by_av.setdefault((g.agent, g.variant), []).append(g)
    out = []
    for (agent, variant), gs in by_av.items():
        per_task = [np.asarray(g.scores, dtype=np.float64) for g in gs]
        rng = bootstrap.rng_for(final_eval.seed, "profile", agent, variant)
        reps = profile_replicates(per_task, resample_indices(per_task, final_eval.bootstrap_reps, rng))
        tail = 100.0 * (1.0 - final_eval.confidence) / 2.0
        lower, upper = np.percentile(reps, [tail, 100.0 - tail], axis=0)
        out.append(PerformanceProfile(agent, variant, len(gs), sum(t.size for t in per_task), list(TAUS),
                                      score_profile(per_task).tolist(), lower.tolist(), upper.tolist()))
    return out
