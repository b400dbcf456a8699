"""Figures of a sweep (matplotlib, Agg) from the gather step's typed results; each function writes one PNG.

Fig. 3a (KL vs IQM Pareto), Fig. 3b (CI widths), Fig. 5 (action distance), App. F (V over env steps, learning
curves), App. D (critic proxy).
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: figures are files, never windows
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from qed_ray.analysis import EARLY_INTERVALS, Aggregate, CriticProxy, GroupResult  # noqa: E402


def _label(row: Aggregate | GroupResult | CriticProxy) -> str:
    return f"{row.agent} {row.variant}"


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def pareto(aggregates: list[Aggregate], path: Path) -> Path:
    """IQM of normalised return (95% CI bars) against mean inter-run V (log x), one point per agent-variant."""
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for row in aggregates:
        x = row.V_mean if math.isfinite(row.V_mean) and row.V_mean > 0 else np.nan
        yerr = [[row.iqm - row.ci_lower], [row.ci_upper - row.iqm]]
        ax.errorbar([x], [row.iqm], yerr=yerr, fmt="o", capsize=3, label=_label(row))
    ax.set_xscale("log")
    ax.set_xlabel("inter-run variability V (symmetric pre-tanh KL, mean over tasks)")
    ax.set_ylabel("IQM normalised return")
    ax.set_title("Return vs behaviour consistency")
    ax.legend(fontsize=7)
    return _save(fig, path)


def _bars(aggregates: list[Aggregate], values: list[float], ylabel: str, title: str, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(max(4, 0.9 * len(aggregates) + 2), 3.6))
    labels = [_label(r) for r in aggregates]
    ax.bar(range(len(aggregates)), values, color="tab:blue")
    ax.set_xticks(range(len(aggregates)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return _save(fig, path)


def ci_widths(aggregates: list[Aggregate], path: Path) -> Path:
    """Width of the 95% bootstrap CI of the IQM per agent-variant (Fig. 3b)."""
    return _bars(aggregates, [a.ci_width for a in aggregates], "95% CI width of IQM",
                 "Return variance across seeds", path)


def action_distance(aggregates: list[Aggregate], path: Path) -> Path:
    """Cumulative pairwise L2 action distance, mean over tasks (Fig. 5)."""
    return _bars(aggregates, [a.action_distance_mean for a in aggregates], "cumulative pairwise L2 action distance",
                 "Rollout-level behaviour differences", path)


def _grid(groups: list[GroupResult]):
    tasks = sorted({g.task for g in groups})
    cols = min(3, len(tasks))
    rows = math.ceil(len(tasks) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    for ax in axes.flat[len(tasks):]:
        ax.set_visible(False)
    return fig, {t: axes.flat[i] for i, t in enumerate(tasks)}


def v_over_steps(groups: list[GroupResult], path: Path) -> Path:
    """V at the kept policy snapshots over env steps, per task and agent-variant (log y)."""
    fig, axes = _grid(groups)
    for g in groups:
        pts = np.array([p for p in g.v_curve if math.isfinite(p[1]) and p[1] > 0])
        if len(pts):
            axes[g.task].plot(pts[:, 0], pts[:, 1], marker=".", label=_label(g))
    for task, ax in axes.items():
        ax.set_title(task, fontsize=9)
        ax.set_xlabel("env steps")
        ax.set_ylabel("V")
        if ax.lines:
            ax.set_yscale("log")
            ax.legend(fontsize=6)
    return _save(fig, path)


def learning_curves(groups: list[GroupResult], path: Path) -> Path:
    """Eval return over env steps per task: mean over seeds with the min-max spread shaded."""
    fig, axes = _grid(groups)
    for g in groups:
        curves = [np.array(c) for c in g.learning_curves.values() if len(c)]
        if not curves:
            continue
        n = min(len(c) for c in curves)
        steps = curves[0][:n, 0]
        ys = np.stack([c[:n, 1] for c in curves])
        ax = axes[g.task]
        line, = ax.plot(steps, ys.mean(0), label=_label(g))
        ax.fill_between(steps, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.2)
    for task, ax in axes.items():
        ax.set_title(task, fontsize=9)
        ax.set_xlabel("env steps")
        ax.set_ylabel("eval return")
        if ax.lines:
            ax.legend(fontsize=6)
    return _save(fig, path)


def critic_proxy(proxy: list[CriticProxy], path: Path) -> Path:
    """Early within-run |Q1 - Q2| against final cross-seed Q1 dispersion, one point per task (App. D)."""
    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    for row in proxy:
        if row.early_q_gap:
            r2 = row.r_squared
            tag = f" (R²={r2:.2f})" if math.isfinite(r2) else ""
            ax.scatter(row.early_q_gap, row.q1_dispersion, label=_label(row) + tag)
    ax.set_xlabel(f"early within-run |Q1 - Q2| (first {EARLY_INTERVALS} evals)")
    ax.set_ylabel("final cross-seed Q1 dispersion")
    ax.set_title("Critic disagreement as a proxy for cross-run disagreement")
    if ax.collections:
        ax.legend(fontsize=7)
    return _save(fig, path)


def all_figures(groups: list[GroupResult], aggregates: list[Aggregate], proxy: list[CriticProxy],
                out: Path) -> list[Path]:
    """Writes every sweep figure into ``out``; returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    return [pareto(aggregates, out / "pareto_kl_vs_iqm.png"), ci_widths(aggregates, out / "ci_width.png"),
            action_distance(aggregates, out / "action_distance.png"),
            v_over_steps(groups, out / "v_over_env_steps.png"), learning_curves(groups, out / "learning_curves.png"),
            critic_proxy(proxy, out / "critic_proxy.png")]
