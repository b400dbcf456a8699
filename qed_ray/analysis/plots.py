"""Figures of a sweep (matplotlib, Agg) from the gather step's typed results, each written as PNG and SVG; what each
plots and the paper figure it stands for: docs/results.md, "Figures"."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")  # headless: figures are files, never windows
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib import ticker  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from qed_ray.records.atomic import atomic_file  # noqa: E402
from qed_ray.analysis.results import Aggregate, BudgetIqm, CriticProxy, GroupResult, SweepResults  # noqa: E402
from qed_ray.analysis.report import baselines  # noqa: E402

PNG_DPI = 110
MIN_WIDTH = 6.4  # inches: a figure of one panel still has room for its title and footnote
EDGE_PT = 6.0  # points between a figure's edge and its title or footnote
V_AXIS = "inter-run variability V: symmetric KL between seeds' pre-tanh policies"
POLICY_TEXT = {"mean": "deterministic tanh(mu) actions",
               "sample": "actions sampled from the policy (noise shared across seeds per episode)"}


def _label(row) -> str:
    return f"{row.agent} {row.variant}"


def _name_axes(ax, x: str, y: str, title: str) -> None:
    ax.set_xlabel(textwrap.fill(x, 80), fontsize=9)
    ax.set_ylabel(textwrap.fill(y, 45), fontsize=9)
    ax.set_title(textwrap.fill(title, 70), fontsize=10)


def _g(v: float) -> str:
    return f"{v:.3g}"


def caption(results: SweepResults) -> str:
    """The figure's footnote: ``"2 tasks x 3 seeds (12 runs; 1 trial left out). Final evaluation: 4 episodes per seed,
    deterministic tanh(mu) actions; intervals: ..."``"""
    groups = results.groups
    counts = sorted({len(g.seeds) for g in groups})
    seeds = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    left_out = sum(1 for f in results.failed_trials if f.group is not None)
    runs = sum(len(g.seeds) for g in groups)
    fe, policy = results.final_eval, POLICY_TEXT.get(results.policy, results.policy)
    return (f"{len({g.task for g in groups})} tasks x {seeds} seeds ({runs} runs; {left_out} "
            f"trial{'s' * (left_out != 1)} left out). Final evaluation: {fe.episodes} episodes per seed, {policy}; intervals: "
            f"{100 * fe.confidence:g}% bootstrap over seeds, {fe.bootstrap_reps} resamples.")


def _readable_log(axis) -> None:
    """Log-axis ticks at 1, 2 and 5 per decade written as plain numbers (0.02, not 2 x 10^-2)."""
    axis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_minor_locator(ticker.NullLocator())
    axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))


def _label_points(ax, xs, ys, color, most: int = 8) -> None:
    """Prints the value beside up to ``most`` evenly spaced points of a line (always the last)."""
    idx = sorted({round(i) for i in np.linspace(0, len(xs) - 1, min(len(xs), most))})
    for i in idx:
        ax.annotate(_g(ys[i]), (xs[i], ys[i]), fontsize=6, color=color, xytext=(3, 2), textcoords="offset points")


def _wrap_to(text, width: float, renderer) -> None:
    """Re-wraps a Text artist at spaces until its widest line fits ``width`` pixels."""
    words = " ".join(text.get_text().split())
    chars = len(words)
    while (wide := text.get_window_extent(renderer).width) > width and chars > 10:
        chars = max(10, min(chars - 1, int(chars * width / wide)))
        text.set_text(textwrap.fill(words, chars))


def _finish(fig, footnote: str, title: str = "") -> Figure:
    """Puts the title (top, centred) and the footnote (bottom left) on the figure, each wrapped to its width, and lays
    the panels out between them, so neither is clipped nor covers a panel at any panel count."""
    fig.set_dpi(PNG_DPI)  # measured as the PNG draws it: a text's width in points changes with the dpi (hinting)
    renderer = fig.canvas.get_renderer()
    width, height = fig.bbox.width, fig.bbox.height
    edge = EDGE_PT * fig.dpi / 72  # pixels
    top = 0.0  # the figure fraction the title takes, with its margins (the footnote's: bottom)
    if title:
        head = fig.suptitle(title, fontsize=10, x=0.5, y=1 - edge / height, ha="center", va="top")
        head.set_in_layout(False)  # its room is the rect's top margin below (tight_layout would count it again)
        _wrap_to(head, width - 2 * edge, renderer)
        top = (head.get_window_extent(renderer).height + 2 * edge) / height
    foot = fig.text(edge / width, edge / height, footnote, fontsize=7, ha="left", va="bottom")
    _wrap_to(foot, width - 2 * edge, renderer)
    bottom = (foot.get_window_extent(renderer).height + 2 * edge) / height
    fig.tight_layout(rect=(0, bottom, 1, 1 - top))
    return fig


def save(fig, path: Path) -> Path:
    """Writes the figure as PNG to ``path`` and as SVG beside it, each atomically, and closes it."""
    with atomic_file(path) as tmp:  # rewritten while the sweep runs: a reader never sees half a figure
        fig.savefig(tmp, dpi=PNG_DPI)
    with atomic_file(path.with_suffix(".svg")) as tmp:
        fig.savefig(tmp)
    plt.close(fig)
    return path


def _return_vs_v(ax, rows: Sequence[Aggregate], stat: str, name: str) -> None:
    """One point per variant: ``stat`` (``iqm`` or ``mean_score``) with its CI against mean V with its CI (log x)."""
    lo, hi = {"iqm": ("ci_lower", "ci_upper"), "mean_score": ("mean_score_ci_lower", "mean_score_ci_upper")}[stat]
    for row in rows:
        if not (math.isfinite(row.V_mean) and row.V_mean > 0):
            continue
        y = getattr(row, stat)
        xerr = [[max(row.V_mean - row.V_mean_ci_lower, 0)], [max(row.V_mean_ci_upper - row.V_mean, 0)]]
        yerr = [[max(y - getattr(row, lo), 0)], [max(getattr(row, hi) - y, 0)]]
        ax.errorbar([row.V_mean], [y], xerr=np.nan_to_num(xerr), yerr=np.nan_to_num(yerr), fmt="o", capsize=3,
                    label=_label(row))
        ax.annotate(f"{_label(row)}\nV={_g(row.V_mean)}, {name}={_g(y)}", (row.V_mean, y), fontsize=7,
                    xytext=(5, 5), textcoords="offset points")
    ax.set_xscale("log")
    _readable_log(ax.xaxis)
    ax.margins(x=0.3, y=0.15)  # room for the value labels
    if ax.lines:
        ax.legend(fontsize=7)


def pareto(results: SweepResults) -> Figure:
    """IQM of normalised return against mean V (log x), both with their CIs, one labelled point per variant."""
    fig, ax = plt.subplots(figsize=(8, 5.2))
    _return_vs_v(ax, results.aggregates, "iqm", "IQM")
    _name_axes(ax, f"{V_AXIS}, mean over tasks (log scale; left = seeds behave more alike)",
               "IQM of normalised final return (return / 1000)",
               "Final return vs behaviour consistency across seeds (error bars: confidence intervals)")
    return _finish(fig, caption(results))


def mean_return_vs_kl(results: SweepResults) -> Figure:
    """Sec. 6.3's figure: the MEAN normalised return against mean V, as the paper draws it, the IQM beside it."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2), sharex=True)
    for ax, stat, name, what in ((axes[0], "mean_score", "mean", "Mean"), (axes[1], "iqm", "IQM", "IQM")):
        _return_vs_v(ax, results.aggregates, stat, name)
        _name_axes(ax, f"{V_AXIS}, mean over tasks (log scale; left = seeds behave more alike)",
                   f"{what} of normalised final return (return / 1000)",
                   f"{what} final return vs behaviour consistency across seeds")
    return _finish(fig, caption(results), "Return vs consistency, as Sec. 6.3 draws it (left: mean return; "
                   "right: IQM); error bars: confidence intervals")


def _bars(results: SweepResults, values: Sequence[float], errors, ylabel: str, title: str) -> Figure:
    rows = results.aggregates
    fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(rows) + 2), 4.6))
    bars = ax.bar(range(len(rows)), np.nan_to_num(values), yerr=errors, capsize=3, color="tab:blue")
    for bar, v in zip(bars, values):
        ax.annotate(_g(v), (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(rows)), [_label(r) for r in rows], rotation=30, ha="right", fontsize=8)
    ax.margins(y=0.12)  # the value labels above the bars stay inside the panel, clear of its title
    _name_axes(ax, "agent and temperature variant", ylabel, title)
    return _finish(fig, caption(results))


def ci_widths(results: SweepResults) -> Figure:
    """Width of the bootstrap CI of the IQM per agent-variant (Fig. 3b): how far the return estimate could move."""
    pct = f"{100 * results.final_eval.confidence:g}%"
    return _bars(results, [a.ci_width for a in results.aggregates], None,
                 f"width of the {pct} CI of the IQM (normalised return)",
                 f"Uncertainty of the IQM: width of its {pct} bootstrap CI (narrower = steadier returns)")


def action_distance(results: SweepResults) -> Figure:
    """Cumulative pairwise L2 action distance, mean over tasks with its CI (Fig. 4)."""
    rows = results.aggregates
    err = np.nan_to_num([[max(a.action_distance_mean - a.action_distance_ci_lower, 0) for a in rows],
                         [max(a.action_distance_ci_upper - a.action_distance_mean, 0) for a in rows]])
    return _bars(results, [a.action_distance_mean for a in rows], err,
                 f"L2 distance between seeds' actions, summed over {results.final_eval.action_steps} steps",
                 "How differently seeds act from the same start states (mean over tasks and seed pairs)")


def _grid(groups: Sequence[GroupResult]):
    tasks = sorted({g.task for g in groups})
    cols = min(3, len(tasks))
    rows = math.ceil(len(tasks) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(max(MIN_WIDTH, 4.6 * cols), 3.4 * rows + 0.6), squeeze=False)
    for ax in axes.flat[len(tasks):]:
        ax.set_visible(False)
    return fig, {t: axes.flat[i] for i, t in enumerate(tasks)}


def _name_tasks(axes: dict, ylabel: str, log: bool = False) -> None:
    """Each task's panel over env steps: title, axis names and, where it has lines, a legend (and a log y axis)."""
    for task, ax in axes.items():
        ax.set_title(task, fontsize=9)
        ax.set_xlabel("env steps", fontsize=9)
        ax.set_ylabel(ylabel, fontsize=9)
        if ax.lines and log:
            ax.set_yscale("log")
            _readable_log(ax.yaxis)
        if ax.lines:
            ax.legend(fontsize=6)


def v_over_steps(results: SweepResults) -> Figure:
    """V at the kept policy snapshots over env steps, per task and agent-variant (log y, last value printed)."""
    fig, axes = _grid(results.groups)
    for g in results.groups:
        pts = np.array([p for p in g.v_curve if math.isfinite(p[1]) and p[1] > 0])
        if len(pts):
            line, = axes[g.task].plot(pts[:, 0], pts[:, 1], marker=".", label=_label(g))
            _label_points(axes[g.task], pts[:, 0], pts[:, 1], line.get_color())
    _name_tasks(axes, "V (log scale)", log=True)
    return _finish(fig, caption(results), f"Behaviour divergence across seeds over training, per task. {V_AXIS}")


def learning_curves(results: SweepResults) -> Figure:
    """Eval return over env steps per task: mean over seeds as the line, the min-max range over seeds shaded."""
    fig, axes = _grid(results.groups)
    for g in results.groups:
        curves = [np.array(c) for c in g.learning_curves.values() if len(c)]
        if not curves:
            continue
        n = min(len(c) for c in curves)
        steps = curves[0][:n, 0]
        ys = np.stack([c[:n, 1] for c in curves])
        ax = axes[g.task]
        line, = ax.plot(steps, ys.mean(0), label=f"{_label(g)} ({len(curves)} seeds)")
        ax.fill_between(steps, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.2)
        _label_points(ax, steps, ys.mean(0), line.get_color())
    _name_tasks(axes, "evaluation return (0-1000)")
    return _finish(fig, caption(results), "Evaluation return over training: line = mean over seeds, shaded band = "
                   "min to max over seeds")


def iqm_over_steps(results: SweepResults) -> Figure:
    """IQM of the training-time evaluation returns at every shared budget with its CI band (sample efficiency)."""
    fig, ax = plt.subplots(figsize=(8, 5))
    series: dict[tuple[str, str], list[BudgetIqm]] = {}
    for b in results.iqm_by_budget:
        series.setdefault((b.agent, b.variant), []).append(b)
    for rows in series.values():
        x = [b.env_steps for b in rows]
        line, = ax.plot(x, [b.iqm for b in rows], marker=".", label=_label(rows[0]))
        ax.fill_between(x, [b.ci_lower for b in rows], [b.ci_upper for b in rows], color=line.get_color(), alpha=0.2)
        _label_points(ax, x, [b.iqm for b in rows], line.get_color())
    _name_axes(ax, "env steps (training budget so far)", "IQM of normalised evaluation return (return / 1000)",
               "Sample efficiency: IQM of the training-time evaluations over training (band: confidence interval)")
    if ax.lines:
        ax.legend(fontsize=7)
    return _finish(fig, caption(results))


def critic_proxy(proxy: Sequence[CriticProxy], text: str = "", window: int = 15) -> Figure:
    """Early within-run |Q1 - Q2| (first ``window`` evaluations) against final cross-seed Q1 dispersion, one point per
    task, R^2 per variant (App. D)."""
    fig, ax = plt.subplots(figsize=(8, 5.2))
    for row in proxy:
        if not row.early_q_gap:
            continue
        r2 = f"R² = {row.r_squared:.2f}" if math.isfinite(row.r_squared) else "R²: needs 3+ tasks"
        pts = ax.scatter(row.early_q_gap, row.q1_dispersion, label=f"{_label(row)} ({r2})")
        for task, x, y in zip(row.tasks, row.early_q_gap, row.q1_dispersion):
            ax.annotate(task, (x, y), fontsize=6, color=pts.get_facecolor()[0], xytext=(3, 3),
                        textcoords="offset points")
    ax.margins(0.15)
    _name_axes(ax, f"early within-run critic gap |Q1 - Q2| (mean over the first {window} evaluations)",
               "final cross-seed dispersion of Q1 (mean over seed pairs)",
               "Does one run's critic disagreement predict disagreement across runs? One point per task (App. D)")
    if ax.collections:
        ax.legend(fontsize=7)
    return _finish(fig, text or "one point per task")


def performance_profiles(results: SweepResults) -> Figure:
    """rliable's performance profile per agent-variant with its band (:mod:`qed_ray.analysis.profiles`)."""
    fig, ax = plt.subplots(figsize=(8, 5))
    base = baselines(results)
    for p in results.performance_profiles:
        line, = ax.plot(p.taus, p.fraction, label=f"{_label(p)} ({p.n_runs} runs)",
                        linestyle="--" if (p.agent, p.variant) in base else "-")
        ax.fill_between(p.taus, p.ci_lower, p.ci_upper, color=line.get_color(), alpha=0.2)
        _label_points(ax, p.taus, p.fraction, line.get_color(), most=6)
    pct = f"{100 * results.final_eval.confidence:g}%"
    _name_axes(ax, "threshold tau on the normalised final return (return / 1000)",
               "share of runs scoring above tau",
               f"Performance profiles: the whole score distribution, pooled over tasks (band: {pct} stratified "
               f"bootstrap over seeds; higher and further right is better)")
    ax.set_ylim(-0.02, 1.1)  # room for the value labels along the top
    if ax.lines:
        ax.legend(fontsize=7)
    return _finish(fig, caption(results))


def probability_of_improvement(results: SweepResults) -> Figure:
    """P(variant > its te) per compared variant with its interval (paired over seeds), 0.5 marked."""
    rows = results.comparisons
    fig, ax = plt.subplots(figsize=(8, max(2.6, 0.6 * len(rows) + 1.8)))
    for i, c in enumerate(rows):
        point, lo, hi = c.prob_improvement.astuple()
        if math.isfinite(lo) and math.isfinite(hi):
            ax.plot([lo, hi], [i, i], color="tab:blue", linewidth=6, alpha=0.4, solid_capstyle="butt")
        ax.plot([point], [i], "o", color="tab:blue")
        ax.annotate(f"{_g(point)} [{_g(lo)}, {_g(hi)}] ({c.pairing})", (point, i),
                    fontsize=7, xytext=(0, 7), textcoords="offset points", ha="center")
    ax.axvline(0.5, color="grey", linestyle=":", linewidth=1)
    ax.set_yticks(range(len(rows)), [f"{c.agent} {c.variant} vs {c.baseline}" for c in rows], fontsize=8)
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.7, len(rows) - 0.3)
    pct = f"{100 * results.final_eval.confidence:g}%"
    _name_axes(ax, "probability that a run of the variant scores above a run of te on the same task (mean over "
               "tasks; 0.5: neither is better)", "variant vs its te baseline",
               f"Probability of improvement over te ({pct} interval, resampling seeds jointly where paired)")
    return _finish(fig, caption(results))


def search_front(rows: Sequence, title: str, footnote: str) -> Figure:
    """A k search's front (:class:`~qed_ray.analysis.search_front.FrontRow` rows), one panel per task and agent: IQM
    against V (log x) per point labelled with its k, the Pareto front joined, the chosen point ringed."""
    studies = list(dict.fromkeys((r.task, r.agent) for r in rows)) or [("", "")]
    fig, axes = plt.subplots(1, len(studies), figsize=(max(MIN_WIDTH, 4.2 * len(studies)), 4.2), squeeze=False)
    for ax, study in zip(axes[0], studies):
        mine = [r for r in rows if (r.task, r.agent) == study and math.isfinite(r.V) and r.V > 0]
        ax.scatter([r.V for r in mine], [r.iqm for r in mine], color="tab:blue", zorder=3)
        front = sorted((r for r in mine if r.on_front), key=lambda r: r.V)
        ax.plot([r.V for r in front], [r.iqm for r in front], color="tab:orange", label="Pareto front")
        for r in mine:
            ax.annotate(f"k={r.k:g}", (r.V, r.iqm), textcoords="offset points", xytext=(4, 4), fontsize=7)
            if r.chosen:
                ax.scatter([r.V], [r.iqm], s=160, facecolors="none", edgecolors="tab:red", label="chosen by the rule")
        if mine:
            ax.set_xscale("log")
        _name_axes(ax, "V: KL between the pack's seeds (lower: more alike)", "IQM of the normalised score",
                   "/".join(study))
        if front:
            ax.legend(fontsize=7)
    return _finish(fig, footnote, title)


FIGURES = ("pareto_kl_vs_iqm", "mean_return_vs_kl", "ci_width", "action_distance", "v_over_env_steps",
           "learning_curves", "iqm_over_env_steps", "performance_profiles", "probability_of_improvement",
           "critic_proxy")


def figures(results: SweepResults) -> dict[str, Figure]:
    """Every sweep figure, drawn and laid out, by file name stem (in :data:`FIGURES` order)."""
    draw = [pareto, mean_return_vs_kl, ci_widths, action_distance, v_over_steps, learning_curves, iqm_over_steps,
            performance_profiles, probability_of_improvement]
    out = {name: f(results) for f, name in zip(draw, FIGURES)}
    out["critic_proxy"] = critic_proxy(results.critic_proxy, caption(results), results.final_eval.proxy_window)
    return out


def all_figures(results: SweepResults, out: Path) -> list[Path]:
    """Writes every sweep figure into ``out`` (``<name>.png`` and ``<name>.svg``); returns the PNG paths."""
    out.mkdir(parents=True, exist_ok=True)
    return [save(fig, out / f"{name}.png") for name, fig in figures(results).items()]
