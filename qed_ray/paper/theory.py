"""Numerical checks of the paper's tabular theory (Sec. 4, App. A).

What ``qed-ray theory`` checks and prints: docs/definitions.md, "Relation to the theory"."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from qed_ray.spec import cli_help


def _require_positive(name: str, value: float) -> None:
    arr = np.asarray(value, dtype=float)
    if not np.all(np.isfinite(arr)) or not np.all(arr > 0):
        shown = value if arr.ndim == 0 else f"an array with min {float(np.nanmin(arr))}"
        raise ValueError(f"{name} must be finite and > 0 everywhere, got {shown}")


def log_boltzmann(q: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """Log-probabilities of ``pi(a) ∝ exp(q(a) / alpha)``: ``q [..., A]``, ``alpha [...]`` > 0 -> ``[..., A]``,
    max-shifted so that ``q / alpha`` of any magnitude stays finite."""
    _require_positive("alpha", alpha)
    z = q / np.asarray(alpha)[..., None]
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def soft_value(q: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """Soft value ``alpha log sum_a exp(q(a) / alpha)`` (Thm. 2's backup): ``q [..., A]``, ``alpha [...]`` > 0 ->
    ``[...]``; shifted by ``m = max_a q``, so it never overflows and tends to ``m`` as ``alpha -> 0``."""
    _require_positive("alpha", alpha)
    alpha = np.asarray(alpha)
    m = q.max(axis=-1)
    return m + alpha * np.log(np.exp((q - m[..., None]) / alpha[..., None]).sum(axis=-1))


def kl_categorical(log_p: np.ndarray, log_q: np.ndarray) -> np.ndarray:
    """``KL(p || q)`` of categoricals from ``log_p, log_q [..., A]`` -> ``[...]``, clipped at 0 (round-off)."""
    return np.maximum((np.exp(log_p) * (log_p - log_q)).sum(axis=-1), 0.0)


def disagreement_temperature(q1: np.ndarray, q2: np.ndarray, kappa: np.ndarray,
                             alpha_min: np.ndarray) -> np.ndarray:
    """Shared temperature ``max(alpha_min, ||q1 - q2||_inf / kappa)`` (Eq. 3): ``q1, q2 [..., A]``, ``kappa``,
    ``alpha_min`` > 0 scalars or ``[...]`` -> ``[...]``."""
    _require_positive("kappa", kappa)
    _require_positive("alpha_min", alpha_min)
    return np.maximum(alpha_min, np.abs(q1 - q2).max(axis=-1) / kappa)


def _loguniform(rng: np.random.Generator, low: float, high: float, size: int) -> np.ndarray:
    return np.exp(rng.uniform(np.log(low), np.log(high), size))


def _theorem1_group(rng: np.random.Generator, n: int, n_actions: int,
                    temperature_scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(kl_directed, kl_symmetric, kappa)``, each ``[n]``, of ``n`` random cases with ``n_actions`` actions.

    Scales, kappa and alpha_min are log-uniform over decades so that both regimes of Eq. 3 (floor or disagreement
    active) occur; half the cases use ``q2 = q1 ± delta``, where the bound is nearly tight for large kappa."""
    scale = _loguniform(rng, 1e-2, 1e2, n)[:, None]
    q1 = scale * rng.standard_normal((n, n_actions))
    delta = _loguniform(rng, 1e-3, 1e2, n)[:, None]
    noise = rng.standard_normal((n, n_actions))
    signs = np.where(rng.random((n, 1)) < 0.5, np.sign(noise), noise)
    q2 = q1 + delta * signs
    kappa = _loguniform(rng, 1e-2, 20.0, n)
    alpha_min = _loguniform(rng, 1e-3, 1.0, n)
    alpha = temperature_scale * disagreement_temperature(q1, q2, kappa, alpha_min)
    lp1, lp2 = log_boltzmann(q1, alpha), log_boltzmann(q2, alpha)
    kl12, kl21 = kl_categorical(lp1, lp2), kl_categorical(lp2, lp1)
    return kl12, 0.5 * (kl12 + kl21), kappa


def theorem1_check(n_cases: int, rng: np.random.Generator, temperature_scale: float = 1.0,
                   max_actions: int = 64) -> dict[str, np.ndarray | float]:
    """Checks Theorem 4.1 (``KL <= 2 kappa``) on ``n_cases`` random Q-vector pairs, ``|A|`` uniform in ``[2,
    max_actions]``.

    ``temperature_scale`` < 1 uses a *smaller* temperature than Eq. 3 allows, so violations become possible (the
    control). Returns ``kl_directed``, ``kl_symmetric``, ``bound`` (``2 kappa``) and ``n_actions``, each ``[n_cases]``,
    and the floats ``worst_directed`` / ``worst_symmetric`` = max of KL / (2 kappa)."""
    if int(n_cases) != n_cases or n_cases < 1:
        raise ValueError(f"n_cases must be an integer >= 1, got {n_cases!r}")
    _require_positive("temperature_scale", temperature_scale)
    if int(max_actions) != max_actions or max_actions < 2:
        raise ValueError(f"max_actions must be an integer >= 2, got {max_actions!r}")
    sizes = rng.integers(2, max_actions + 1, n_cases)
    out = {k: np.empty(n_cases) for k in ("kl_directed", "kl_symmetric", "bound")}
    # Vectorise within each action-set size; a few dozen groups at most.
    for n_actions in np.unique(sizes):
        idx = np.flatnonzero(sizes == n_actions)
        kl12, sym, kappa = _theorem1_group(rng, idx.size, int(n_actions), temperature_scale)
        out["kl_directed"][idx], out["kl_symmetric"][idx], out["bound"][idx] = kl12, sym, 2 * kappa
    out["n_actions"] = sizes
    out["worst_directed"] = float((out["kl_directed"] / out["bound"]).max())
    out["worst_symmetric"] = float((out["kl_symmetric"] / out["bound"]).max())
    return out


@dataclass(frozen=True)
class FiniteMDP:
    """A finite MDP: ``transitions [S, A, S]`` (rows sum to 1), ``rewards [S, A]``, ``gamma``."""

    transitions: np.ndarray
    rewards: np.ndarray
    gamma: float


def random_mdp(n_states: int, n_actions: int, gamma: float, rng: np.random.Generator) -> FiniteMDP:
    """A random MDP: Dirichlet(1) transitions, rewards uniform in [0, 1]; S >= 1, A >= 2, 0 < gamma < 1."""
    if n_states < 1:
        raise ValueError(f"n_states must be >= 1, got {n_states!r}")
    if n_actions < 2:
        raise ValueError(f"n_actions must be >= 2, got {n_actions!r}")
    if not 0.0 < gamma < 1.0:
        raise ValueError(f"gamma must be in (0, 1), got {gamma!r}")
    p = rng.dirichlet(np.ones(n_states), size=(n_states, n_actions))
    return FiniteMDP(p, rng.uniform(0.0, 1.0, (n_states, n_actions)), float(gamma))


def bellman_backup(mdp: FiniteMDP, next_values: np.ndarray) -> np.ndarray:
    """``r(s, a) + gamma * E_{s'}[v(s')]``; ``next_values [S]`` -> Q ``[S, A]``."""
    return mdp.rewards + mdp.gamma * mdp.transitions @ next_values


def optimal_q(mdp: FiniteMDP, tol: float = 1e-13, max_iters: int = 100_000) -> np.ndarray:
    """``Q* [S, A]`` of the unregularised MDP by value iteration (hard max), to ``tol`` in sup norm."""
    q = np.zeros_like(mdp.rewards)
    for _ in range(max_iters):
        q_next = bellman_backup(mdp, q.max(axis=1))
        if np.abs(q_next - q).max() < tol:
            return q_next
        q = q_next
    raise RuntimeError(f"value iteration did not reach tol={tol} in {max_iters} iterations")


def coupled_soft_iteration(mdp: FiniteMDP, q1: np.ndarray, q2: np.ndarray, kappa: float,
                           alpha_min: float, n_iters: int) -> tuple[np.ndarray, np.ndarray]:
    """Coupled soft value iteration ``Q_{t+1}^(i) = T_{alpha_t} Q_t^(i)`` (Thm. 2) from ``q1, q2 [S, A]`` for
    ``n_iters`` = T backups -> ``(iterates [T + 1, 2, S, A], alphas [T, S])``.

    Both runs share ``alpha_t(s) = max(alpha_min, ||Q_t^1(s,.) - Q_t^2(s,.)||_inf / kappa)``, evaluated at the next
    state ``s'`` inside the backup."""
    iterates = np.empty((n_iters + 1, 2) + q1.shape)
    alphas = np.empty((n_iters, q1.shape[0]))
    iterates[0, 0], iterates[0, 1] = q1, q2
    for t in range(n_iters):
        a, b = iterates[t]
        alphas[t] = disagreement_temperature(a, b, kappa, alpha_min)
        iterates[t + 1, 0] = bellman_backup(mdp, soft_value(a, alphas[t]))
        iterates[t + 1, 1] = bellman_backup(mdp, soft_value(b, alphas[t]))
    return iterates, alphas


def theorem2_bound(err0: np.ndarray, delta0: float, gamma: float, alpha_min: float,
                   kappa: float, n_actions: int, n_iters: int) -> np.ndarray:
    """Right-hand side of Theorem 4.2 for ``t = 0..T`` from ``err0 = ||Q_0^(i) - Q*||_inf`` per run ``[R]`` and ``delta0
    = ||Q_0^1 - Q_0^2||_inf``: ``[T + 1, R]``."""
    t = np.arange(n_iters + 1, dtype=float)[:, None]
    log_a = np.log(n_actions)
    floor_bias = gamma * alpha_min * log_a * (1 - gamma**t) / (1 - gamma)
    disagreement = delta0 * log_a * t * gamma**t / kappa
    return gamma**t * err0[None, :] + floor_bias + disagreement


def _theorem2_case(rng: np.random.Generator, n_iters: int) -> dict[str, np.ndarray | float]:
    """One random MDP + init pair + (kappa, alpha_min); returns error/bound curves."""
    mdp = random_mdp(int(rng.integers(2, 13)), int(rng.integers(2, 9)), rng.uniform(0.5, 0.97), rng)
    kappa, alpha_min = _loguniform(rng, 0.05, 5.0, 1)[0], _loguniform(rng, 1e-3, 0.5, 1)[0]
    init_scale = _loguniform(rng, 0.1, 30.0, 1)[0]
    q1, q2 = (init_scale * rng.standard_normal(mdp.rewards.shape) for _ in range(2))
    q_star = optimal_q(mdp)
    iterates, _ = coupled_soft_iteration(mdp, q1, q2, kappa, alpha_min, n_iters)
    err = np.abs(iterates - q_star).max(axis=(2, 3))  # [T + 1, 2]
    disagreement = np.abs(iterates[:, 0] - iterates[:, 1]).max(axis=(1, 2))  # [T + 1]
    delta0 = float(disagreement[0])
    bound = theorem2_bound(err[0], delta0, mdp.gamma, alpha_min, kappa, mdp.rewards.shape[1], n_iters)
    contraction = delta0 * mdp.gamma ** np.arange(n_iters + 1)
    return {"err": err, "bound": bound, "disagreement": disagreement, "contraction": contraction,
            "gamma": mdp.gamma, "kappa": kappa, "alpha_min": alpha_min}


def theorem2_check(n_mdps: int, rng: np.random.Generator, n_iters: int = 150) -> dict[str, object]:
    """Checks Theorem 4.2 and the disagreement contraction on ``n_mdps`` random MDPs (S in [2, 12], |A| in [2, 8], gamma
    in [0.5, 0.97], log-uniform kappa and alpha_min, two Gaussian initialisations).

    At ``t = 0`` both bounds hold with equality by construction, so the worst ratios are over ``t >= 1``. Returns
    ``worst_bound`` (error / bound), ``worst_contraction`` (``||Q_t^1 - Q_t^2|| / (gamma^t Delta_0)``) and ``cases``
    (per MDP: ``err [T+1, 2]``, ``bound [T+1, 2]``, ``disagreement [T+1]``, ``contraction [T+1]``)."""
    if int(n_mdps) != n_mdps or n_mdps < 1:
        raise ValueError(f"n_mdps must be an integer >= 1, got {n_mdps!r}")
    if int(n_iters) != n_iters or n_iters < 1:
        raise ValueError(f"n_iters must be an integer >= 1, got {n_iters!r}")
    cases = [_theorem2_case(rng, n_iters) for _ in range(n_mdps)]
    worst_bound = max(float((c["err"][1:] / c["bound"][1:]).max()) for c in cases)
    # The contraction bound reaches ~1e-300 for long runs; only compare where it
    # is well above round-off of the iterates.
    worst_contraction = 0.0
    for c in cases:
        keep = c["contraction"][1:] > 1e-9
        ratio = c["disagreement"][1:][keep] / c["contraction"][1:][keep]
        worst_contraction = max(worst_contraction, float(ratio.max(initial=0.0)))
    return {"worst_bound": worst_bound, "worst_contraction": worst_contraction, "cases": cases}


def _plot_theorem1(res: dict, control: dict, path: str) -> None:
    """Scatter of directed/symmetric KL (and the too-cold control) against ``2 kappa`` (log-log)."""
    from matplotlib.figure import Figure  # no pyplot state: the figure is a file, never a window

    fig = Figure(figsize=(5.5, 4.5))
    ax = fig.subplots()
    floor = 1e-12  # zero KLs cannot be drawn on a log axis
    ax.scatter(res["bound"], np.maximum(res["kl_directed"], floor), s=3, alpha=0.3, label="KL(pi1 || pi2)")
    ax.scatter(res["bound"], np.maximum(res["kl_symmetric"], floor), s=3, alpha=0.3, label="symmetric KL")
    ax.scatter(control["bound"], np.maximum(control["kl_directed"], floor), s=3, alpha=0.2,
               label="KL at alpha x 0.05 (control)")
    lims = [res["bound"].min(), res["bound"].max()]
    ax.plot(lims, lims, "k--", label="bound 2 kappa")
    ax.set(xscale="log", yscale="log", xlabel="2 kappa", ylabel="KL", title="Theorem 4.1")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _plot_theorem2(cases: list[dict], path: str, n_show: int = 4) -> None:
    """Error and bound curves over t (log y) for the first ``n_show`` MDPs."""
    from matplotlib.figure import Figure

    n_show = min(n_show, len(cases))
    fig = Figure(figsize=(3.6 * n_show, 3.4))
    axes = fig.subplots(1, n_show, squeeze=False)
    for ax, c in zip(axes[0], cases[:n_show]):
        ax.plot(c["err"][:, 0], label="||Q_t^1 - Q*||")
        ax.plot(c["bound"][:, 0], "--", label="Thm 2 bound")
        ax.plot(c["disagreement"], label="||Q_t^1 - Q_t^2||")
        ax.plot(c["contraction"], ":", label="gamma^t Delta_0")
        ax.set(yscale="log", xlabel="t", ylim=(1e-8, None),
               title=f"gamma={c['gamma']:.2f} kappa={c['kappa']:.2f} amin={c['alpha_min']:.3f}")
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """CLI: run both theorem checks, print worst ratios, save plots; returns the printed ratios by name."""
    parser = cli_help.parser("qed-ray theory", __doc__, (
        "qed-ray theory                        # both theorems, plots in theory_out/",
        "qed-ray theory --cases 1000 --mdps 10 --out /tmp/theory   # a quick check"))
    parser.add_argument("--cases", type=int, default=10_000, help="random Q-pairs for Theorem 4.1")
    parser.add_argument("--mdps", type=int, default=50, help="random MDPs for Theorem 4.2")
    parser.add_argument("--iters", type=int, default=150, help="soft value-iteration steps per MDP")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="theory_out", help="folder for the plots")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    t1 = theorem1_check(args.cases, rng)
    control = theorem1_check(args.cases, rng, temperature_scale=0.05)
    t2 = theorem2_check(args.mdps, rng, args.iters)
    worst = {"theorem 1 directed KL / 2kappa": t1["worst_directed"],
             "theorem 1 symmetric KL / 2kappa": t1["worst_symmetric"],
             "control (alpha x 0.05) directed KL / 2kappa": control["worst_directed"],
             "theorem 2 ||Q_t - Q*|| / bound": t2["worst_bound"],
             "theorem 2 ||Q_t^1 - Q_t^2|| / (gamma^t Delta_0)": t2["worst_contraction"]}
    over = [f"{args.cases} cases"] * 3 + [f"{args.mdps} MDPs x 2 runs x t=1..{args.iters}"] * 2
    for (name, value), where in zip(worst.items(), over):
        print(f"{name}: worst {value:.4g} over {where}")
    n_viol = int((control["kl_directed"] > control["bound"]).sum())
    print(f"control violations (KL > 2kappa at alpha x 0.05): {n_viol} / {args.cases}")
    os.makedirs(args.out, exist_ok=True)
    _plot_theorem1(t1, control, os.path.join(args.out, "theorem1_kl_vs_bound.png"))
    _plot_theorem2(t2["cases"], os.path.join(args.out, "theorem2_error_curves.png"))
    print(f"wall time {time.perf_counter() - start:.1f} s")
    return worst
