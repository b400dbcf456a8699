"""Behaviour-consistency and aggregate-performance metrics (pure numpy).

Definitions follow docs/definitions.md (Metrics) and the paper's App. E (policy-divergence protocol),
Sec. 6.1 (IQM with stratified-bootstrap CIs, after Agarwal et al. 2021) and Sec. 6.2 (action
distance). Shapes use the letters: I policies (seeds), S pooled states, A action dimensions,
P policies in a rollout comparison, T trajectories, L steps, D vector dimensions.
"""

from collections.abc import Sequence

import numpy as np

SIGMA_FLOOR = 1e-6
"""Smallest pre-tanh standard deviation used inside the KL. The actor bounds log-std to about
[-5, 2] (docs/definitions.md, Actor), so this only guards against a collapsed head dividing by ~0."""

DEFAULT_CHUNK_ELEMENTS = 1 << 18
"""Float64 elements per temporary in `pairwise_policy_divergence` (2 MiB each): small chunks stay
in cache and ran faster than 8-32 MiB ones (chunk sweep in benchmarks/bench_metrics.py)."""

DMC_MAX_RETURN = 1000.0
"""dm_control episodes are 1000 control steps with rewards in [0, 1] (docs/definitions.md, Environment)."""

_RETURN_TOLERANCE = 1e-3  # float32 reward sums may overshoot 1000 by rounding


def _as_float_array(name: str, x, ndim: int | None = None, min_ndim: int = 0) -> np.ndarray:
    """``x`` as a finite real array, or ValueError naming ``name``."""
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiu":
        raise ValueError(f"{name}: expected a real numeric array, got dtype {arr.dtype}")
    if arr.dtype.kind != "f":
        arr = arr.astype(np.float64)
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {arr.shape}")
    if arr.ndim < min_ndim:
        raise ValueError(f"{name}: expected at least {min_ndim} dimensions, got shape {arr.shape}")
    bad = arr.size - int(np.count_nonzero(np.isfinite(arr)))
    if bad:
        raise ValueError(f"{name}: contains {bad} non-finite values")
    return arr


def _check_same_shape(name: str, arr: np.ndarray, ref_name: str, ref: np.ndarray) -> None:
    if arr.shape != ref.shape:
        raise ValueError(f"{name}: expected shape {ref.shape} matching {ref_name}, got {arr.shape}")


def _check_positive(name: str, sigma: np.ndarray) -> None:
    """Rejects sigma <= 0: a non-positive std is a bug upstream, not something to floor."""
    bad = int(np.count_nonzero(sigma <= 0))
    if bad:
        raise ValueError(f"{name}: contains {bad} values <= 0; standard deviations must be > 0")


def _sym_kl_terms(mu_p, sigma_p, mu_q, sigma_q) -> np.ndarray:
    """Per-dimension symmetric KL of floored float64 inputs (no validation, broadcasting).

    0.5 * (KL(p||q) + KL(q||p)) per dimension: the log(s_q/s_p) terms cancel, leaving 0.25 * [v_p/v_q + v_q/v_p - 2 +
    d^2 (1/v_p + 1/v_q)] with v = s^2. Writing the ratio part as (v_p - v_q)^2 / (v_p v_q) makes every term a square
    times a positive number, so the result is >= 0 in floating point, exactly 0 for identical inputs and exactly
    symmetric in p, q."""
    var_p, var_q = sigma_p * sigma_p, sigma_q * sigma_q
    spread = (var_p - var_q) ** 2 / (var_p * var_q)
    mean_gap = (mu_p - mu_q) ** 2 * (1.0 / var_p + 1.0 / var_q)
    return 0.25 * (spread + mean_gap)


def symmetric_kl(mu_p, sigma_p, mu_q, sigma_q) -> np.ndarray:
    """Symmetric KL 0.5 * (KL(p||q) + KL(q||p)) between diagonal Gaussians in pre-tanh space, per state (App. E).

    Args:
        mu_p, sigma_p, mu_q, sigma_q: (..., A); sigmas > 0, floored at SIGMA_FLOOR.

    Returns:
        float64 (...): >= 0, exactly 0 where the two distributions are identical."""
    mu_p = _as_float_array("mu_p", mu_p, min_ndim=1)
    arrays = {"sigma_p": sigma_p, "mu_q": mu_q, "sigma_q": sigma_q}
    checked = {}
    for name, value in arrays.items():
        checked[name] = _as_float_array(name, value, min_ndim=1)
        _check_same_shape(name, checked[name], "mu_p", mu_p)
    _check_positive("sigma_p", checked["sigma_p"])
    _check_positive("sigma_q", checked["sigma_q"])
    s_p = np.maximum(checked["sigma_p"].astype(np.float64), SIGMA_FLOOR)
    s_q = np.maximum(checked["sigma_q"].astype(np.float64), SIGMA_FLOOR)
    terms = _sym_kl_terms(mu_p.astype(np.float64), s_p, checked["mu_q"].astype(np.float64), s_q)
    return np.asarray(terms.sum(axis=-1))


def _check_policy_stack(mus, sigmas) -> tuple[np.ndarray, np.ndarray]:
    """Validates (I, S, A) means and stds evaluated on one pooled state set."""
    mus = _as_float_array("mus", mus, ndim=3)
    sigmas = _as_float_array("sigmas", sigmas, ndim=3)
    _check_same_shape("sigmas", sigmas, "mus", mus)
    if min(mus.shape) < 1:
        raise ValueError(f"mus: expected shape (I, S, A) with every size >= 1, got {mus.shape}")
    _check_positive("sigmas", sigmas)
    return mus, sigmas


def pairwise_policy_divergence(mus, sigmas, *, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> np.ndarray:
    """Mean symmetric KL between every pair of policies on a pooled state set (App. E).

    D(i, j) = mean over the S states of symmetric_kl(policy i, policy j), computed in chunks of states so that no (I, I,
    S, A) array is built: temporaries hold at most about ``chunk_elements`` float64 values.

    Args:
        mus, sigmas: (I, S, A) pre-tanh means and stds (> 0), every policy on the SAME states.

    Returns:
        float64 (I, I): symmetric, exactly 0 on the diagonal, >= 0 elsewhere."""
    mus, sigmas = _check_policy_stack(mus, sigmas)
    if not isinstance(chunk_elements, (int, np.integer)) or chunk_elements < 1:
        raise ValueError(f"chunk_elements: expected a positive integer, got {chunk_elements!r}")
    n_pol, n_states, n_dims = mus.shape
    step = max(1, int(chunk_elements) // (n_pol * n_dims))
    totals = np.zeros((n_pol, n_pol), dtype=np.float64)
    for start in range(0, n_states, step):
        mu = mus[:, start : start + step].astype(np.float64)
        sigma = np.maximum(sigmas[:, start : start + step].astype(np.float64), SIGMA_FLOOR)
        for i in range(n_pol - 1):
            # Only j > i: the divergence is symmetric, so the lower triangle is mirrored below.
            terms = _sym_kl_terms(mu[i], sigma[i], mu[i + 1 :], sigma[i + 1 :])
            totals[i, i + 1 :] += terms.sum(axis=(1, 2))
    upper = np.triu(totals, k=1) / n_states
    return upper + upper.T


def variability_from_matrix(divergence) -> float:
    """Inter-run variability V from a divergence matrix (App. E, Def. 1).

    Args:
        divergence: (I, I), I >= 2, finite, >= 0 off the diagonal (the diagonal is not used).

    Returns:
        V = mean of divergence[i, j] over the I * (I - 1) ordered pairs i != j."""
    mat = _as_float_array("divergence", divergence, ndim=2)
    if mat.shape[0] != mat.shape[1] or mat.shape[0] < 2:
        raise ValueError(f"divergence: expected a square (I, I) matrix with I >= 2, got shape {mat.shape}")
    off_diagonal = mat[~np.eye(mat.shape[0], dtype=bool)].astype(np.float64)
    negative = int(np.count_nonzero(off_diagonal < 0))
    if negative:
        raise ValueError(f"divergence: contains {negative} negative off-diagonal values")
    return float(off_diagonal.mean())


def inter_run_variability(mus, sigmas, *, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> float:
    """Inter-run variability V of one method on one task (App. E; docs/definitions.md).

    Args:
        mus, sigmas: (I, S, A), I >= 2: the seeds' pre-tanh means and stds (> 0) on the pooled states.

    Returns:
        V = mean over ordered pairs i != j of D(i, j) (:func:`pairwise_policy_divergence`)."""
    n_pol = np.shape(mus)[0] if np.ndim(mus) >= 1 else 0
    if n_pol < 2:
        raise ValueError(f"mus: need at least 2 policies (I >= 2) for variability, got shape {np.shape(mus)}")
    return variability_from_matrix(pairwise_policy_divergence(mus, sigmas, chunk_elements=chunk_elements))


def share_at_lower_bound(sigmas, log_std_min: float, margin: float = 0.1) -> float:
    """Share of entries of ``sigmas`` (..., A), > 0, with log sigma < ``log_std_min`` + ``margin``, in [0, 1].

    The symmetric KL scales as 1/sigma^2, so V is set by the bound wherever policies sit at it (docs/definitions.md,
    Actor)."""
    s = _as_float_array("sigmas", sigmas, min_ndim=1)
    _check_positive("sigmas", s)
    return float(np.mean(np.log(s.astype(np.float64)) < log_std_min + margin))


def pool_states(per_policy_states: Sequence[np.ndarray]) -> np.ndarray:
    """Pools the states of every seed's evaluation rollouts into one set (App. E).

    Args:
        per_policy_states: one (..., obs_dim) array per seed, e.g. (episodes, steps, obs_dim).

    Returns:
        (sum_i N_i, obs_dim), seed 0's states first, N_i the product of seed i's leading dimensions."""
    if len(per_policy_states) == 0:
        raise ValueError("per_policy_states: expected at least one array of states, got an empty sequence")
    flat = []
    for k, states in enumerate(per_policy_states):
        arr = _as_float_array(f"per_policy_states[{k}]", states, min_ndim=2)
        if flat and arr.shape[-1] != flat[0].shape[-1]:
            raise ValueError(
                f"per_policy_states[{k}]: expected obs_dim {flat[0].shape[-1]} matching "
                f"per_policy_states[0], got shape {arr.shape}"
            )
        flat.append(arr.reshape(-1, arr.shape[-1]))
    return np.concatenate(flat, axis=0)


def check_scores(scores) -> np.ndarray:
    mat = _as_float_array("scores", scores, ndim=2)
    if mat.size == 0:
        raise ValueError(f"scores: expected a non-empty (runs, tasks) matrix, got shape {mat.shape}")
    return mat


def trimmed_mean_last_axis(values: np.ndarray) -> np.ndarray:
    """25% trimmed mean over the last axis, the way scipy.stats.trim_mean does it.

    Same cut rule (int(0.25 * n) from each end) and the same np.partition call, so the kept
    entries reach np.mean in the same order and the result is bit-identical to scipy/rliable.
    """
    n = values.shape[-1]
    low = int(0.25 * n)
    high = n - low
    kept = np.partition(values, (low, high - 1), axis=-1)[..., low:high]
    return np.mean(kept, axis=-1)


def iqm(scores) -> float:
    """Interquartile mean of all runs x tasks scores pooled (Sec. 6.1): scipy's trim_mean(scores, 0.25, axis=None),
    rliable's aggregate_iqm.

    Args:
        scores: (runs, tasks), e.g. normalised final scores.

    Returns:
        Mean of the entries left after dropping int(0.25 * runs * tasks) from each end."""
    return float(trimmed_mean_last_axis(check_scores(scores).ravel()))


def iqm_rows(samples) -> np.ndarray:
    """IQM of every row of a (R, N) array at once (bootstrap replicates of pooled scores); shape (R,)."""
    return trimmed_mean_last_axis(np.asarray(samples, dtype=np.float64))


RATIO_SUMMARIES = ("median", "geomean", "means")


def ratio_summaries(base, this) -> dict[str, np.ndarray]:
    """The ratio base / this of a per-task statistic (te over QED: V, action distance, return variance) summarised over
    tasks: the median and the geometric mean of the per-task ratios (one task cannot swing them) and the ratio of the
    task means (dominated by the tasks with the largest values).

    Args:
        base, this: (..., K) the baseline's and the variant's statistic on the same K tasks (a leading axis holds
            bootstrap replicates).

    Returns:
        ``{"median", "geomean", "means"}``, each float64 (...); NaN where a task's ratio is undefined (a statistic <= 0
        or not finite on either side)."""
    b, t = np.asarray(base, dtype=np.float64), np.asarray(this, dtype=np.float64)
    if b.shape != t.shape or b.ndim < 1 or b.shape[-1] < 1:
        raise ValueError(f"this: expected the shape of base (..., K) with K >= 1, got {t.shape} and {b.shape}")
    ok = np.isfinite(b) & np.isfinite(t) & (b > 0) & (t > 0)
    ratio = np.where(ok, b / np.where(ok, t, 1.0), np.nan)
    means = np.where(ok.all(-1), b.mean(-1) / np.where(ok.all(-1), t.mean(-1), 1.0), np.nan)
    return {"median": np.median(ratio, axis=-1), "geomean": np.exp(np.log(ratio).mean(-1)), "means": means}


def per_step_pairwise_distance(x) -> np.ndarray:
    """Mean over unordered policy pairs of the L2 distance at each step (Sec. 6.2, Fig. 1).

    Args:
        x: (P, T, L, D), P >= 2 policies, T trajectories from shared initial states, L steps, D dims (actions, or state
            vectors for the per-step state spread).

    Returns:
        float64 (T, L): mean over i < j of ||x[i, t, l] - x[j, t, l]||_2."""
    arr = _as_float_array("x", x, ndim=4)
    n_pol = arr.shape[0]
    if n_pol < 2:
        raise ValueError(f"x: need at least 2 policies (P >= 2) to compare, got shape {arr.shape}")
    total = np.zeros(arr.shape[1:3], dtype=np.float64)
    for i in range(n_pol - 1):
        # Loop over i (P is small) so only (P - i - 1, T, L, D) differences exist at once.
        gaps = arr[i + 1 :].astype(np.float64) - arr[i].astype(np.float64)
        total += np.sqrt(np.einsum("ptld,ptld->ptl", gaps, gaps)).sum(axis=0)
    return total / (n_pol * (n_pol - 1) / 2)


def cumulative_action_distance(actions) -> float:
    """Cumulative pairwise action distance over a rollout (Sec. 6.2).

    Args:
        actions: (P, T, L, D), deterministic actions of P >= 2 policies on T shared-start trajectories of L steps.

    Returns:
        The per-step pairwise L2 distance summed over the L steps, averaged over unordered pairs and trajectories."""
    return float(per_step_pairwise_distance(actions).sum(axis=1).mean())


def pairwise_action_distance(actions) -> np.ndarray:
    """Cumulative action distance of every pair of policies (Sec. 6.2), the matrix behind its bootstrap CI.

    Args:
        actions: (P, T, L, D), P >= 2, as in :func:`cumulative_action_distance`.

    Returns:
        float64 (P, P), symmetric, 0 on the diagonal: (i, j) is the L2 distance between the actions of i and j summed
        over the L steps, averaged over the T trajectories; its off-diagonal mean is
        ``cumulative_action_distance(actions)``."""
    arr = _as_float_array("actions", actions, ndim=4).astype(np.float64)
    n_pol = arr.shape[0]
    if n_pol < 2:
        raise ValueError(f"actions: need at least 2 policies (P >= 2) to compare, got shape {arr.shape}")
    out = np.zeros((n_pol, n_pol))
    for i in range(n_pol - 1):
        gaps = arr[i + 1 :] - arr[i]
        out[i, i + 1 :] = np.sqrt(np.einsum("ptld,ptld->ptl", gaps, gaps)).sum(axis=2).mean(axis=1)
    return out + out.T


def normalized_score(returns) -> np.ndarray:
    """DMC return / 1000, so scores lie in [0, 1] (docs/definitions.md, Normalised score): returns of any shape, in [0,
    1000] -> float64 of the same shape."""
    arr = _as_float_array("returns", returns).astype(np.float64)
    outside = int(np.count_nonzero((arr < -_RETURN_TOLERANCE) | (arr > DMC_MAX_RETURN + _RETURN_TOLERANCE)))
    if outside:
        raise ValueError(f"returns: {outside} values outside the dm_control range [0, 1000]")
    return arr / DMC_MAX_RETURN


def _check_xy(x, y) -> tuple[np.ndarray, np.ndarray]:
    xs = _as_float_array("x", x, ndim=1).astype(np.float64)
    ys = _as_float_array("y", y, ndim=1).astype(np.float64)
    _check_same_shape("y", ys, "x", xs)
    if xs.size < 2:
        raise ValueError(f"x: need at least 2 points for a line fit, got {xs.size}")
    if np.ptp(xs) == 0:
        raise ValueError(f"x: all values equal ({xs[0]}); the slope is undefined")
    return xs, ys


def linear_fit(x, y) -> tuple[float, float]:
    """``(slope, intercept)`` of the least-squares line y ~ intercept + slope * x (critic-proxy check, App. D); x, y:
    (N,), N >= 2, x not constant."""
    xs, ys = _check_xy(x, y)
    dx = xs - xs.mean()
    slope = float(np.dot(dx, ys - ys.mean()) / np.dot(dx, dx))
    return slope, float(ys.mean() - slope * xs.mean())


def r_squared(x, y) -> float:
    """R^2 in [0, 1] of the least-squares line y ~ a + b x (App. D), the squared Pearson correlation S_xy^2 / (S_xx *
    S_yy); x, y: (N,), N >= 2, neither constant."""
    xs, ys = _check_xy(x, y)
    if np.ptp(ys) == 0:
        raise ValueError(f"y: all values equal ({ys[0]}); R^2 is undefined (0/0)")
    dx, dy = xs - xs.mean(), ys - ys.mean()
    sxy = np.dot(dx, dy)
    return float(min(1.0, sxy * sxy / (np.dot(dx, dx) * np.dot(dy, dy))))
