"""Figure 2 of the paper for the off-policy toy: Q landscapes and policy densities over training."""

from __future__ import annotations

import os

import numpy as np

from qed_ray.paper.toy_config import ToyConfig, toy_reward


def plot_panels(runs: dict[float, list[dict[str, np.ndarray]]], cfg: ToyConfig, out_dir: str,
                n_cols: int = 6, seeds: list[int] | None = None, dpi: int = 110) -> list[str]:
    """Draws Fig. 2 (a) Q landscapes and (b) policy densities into ``out_dir``; rows = alpha, columns = ``n_cols``
    evenly spaced snapshots; returns the two PNG paths.

    ``runs``: ``{alpha: [run_toys result per seed]}`` (the same snapshot steps in all); ``seeds`` label the lines
    (default: their index)."""
    from matplotlib.figure import Figure  # no pyplot state: the figures are files, never windows

    first = next(iter(runs.values()))[0]
    cols = np.unique(np.linspace(0, len(first["snapshot_steps"]) - 1, n_cols).round().astype(int))
    grid, paths = first["grid"], []
    panels = (("fig2a_q_landscapes.png", lambda r, k: r["q"][k, :, 0].min(axis=0), "min_j Q_j(a, t=0)"),
              ("fig2b_policy_densities.png", lambda r, k: r["density"][k], "policy density"))
    for name, value, ylabel in panels:
        fig = Figure(figsize=(2.6 * len(cols), 2.3 * len(runs)))
        axes = fig.subplots(len(runs), len(cols), squeeze=False, sharex=True, sharey="row")
        for row, (alpha, results) in enumerate(runs.items()):
            for col, k in enumerate(cols):
                ax = axes[row, col]
                ax.axvspan(*cfg.buffer_support, color="0.9", label="buffer support")
                ax.plot(grid, toy_reward(grid, cfg), "k--", lw=1, label="r(a)")
                for seed_idx, r in enumerate(results):
                    ax.plot(grid, value(r, k), lw=1, label=f"seed {seeds[seed_idx] if seeds else seed_idx}")
                ax.set_title(f"alpha={alpha:g}, step {first['snapshot_steps'][k]}", fontsize=8)
            axes[row, 0].set_ylabel(ylabel, fontsize=8)
        axes[0, 0].legend(fontsize=6)
        fig.tight_layout()
        paths.append(os.path.join(out_dir, name))
        fig.savefig(paths[-1], dpi=dpi)
    return paths
