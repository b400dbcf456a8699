"""Grid over the off-policy toy's open choices (paper Sec. 5.2, Fig. 2): where does alpha = 0.15 leave the data?

The paper fixes the MDP (one state, actions in (-5, 5), bimodal reward, H = 2, gamma = 0.9, buffer on (-3, 0),
SAC at fixed alpha in {0.1, 0.15}) and reports that alpha = 0.1 keeps to a mode on the data while alpha = 0.15
drifts off the data support. Everything else is open. This script fixes, **before any result is seen**, which
open choices are varied, how many seeds, the per-run criterion and the per-cell verdict; then runs them and
writes a JSON and a figure. Run (one process, one torch thread, low priority):

    nice -n 15 .venv/bin/python benchmarks/toy_grid.py --out benchmarks/out/toy_grid

Stages (all decided here, in advance):
1. A full factorial over the four choices judged most likely to matter (``FACTORIAL``, 24 cells).
2. One-factor-at-a-time variations (``OFAT``) around the stage-1 cell that ranks best by ``_rank_key``.
3. The best cell of stages 1-2 rerun on 10 fresh seeds (``CONFIRM_SEEDS``); its verdict on those seeds at its
   best checkpoint decides whether it becomes the toy's default (if it shows the effect, it does).

Every cell runs ``SEEDS`` x ``ALPHAS`` in one batched call of ``qed_ray.toy.run_toys`` for ``max(CHECKPOINTS)``
updates and is scored at each checkpoint (the number of updates is the paper's least specified choice, and
scoring the same runs at several points costs nothing). Resumes from an existing JSON (cells with the same
overrides are not rerun), and stops starting cells once the process has used ``CPU_BUDGET_S``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import time

import numpy as np
import torch

from qed_ray.paper.toy import ToyConfig, leaves_support, run_toys, stays_on_support, summarize

ALPHAS = (0.1, 0.15)
SEEDS = (0, 1, 2, 3, 4)
CONFIRM_SEEDS = tuple(range(5, 15))
CHECKPOINTS = (250, 1000, 4000)
SHOW_FRACTION = 0.8  # a cell shows the effect: >= 80% of seeds stay at alpha 0.1 AND >= 80% leave at 0.15
CPU_BUDGET_S = 6600.0  # the task's cap is 2 CPU-hours; leave room for the figure and the toy's own CLI

# Why these four (the full factorial):
# - horizon_mode: with the step in the critic's input and step 1 terminal (today), a bootstrapped target only
#   adds an action-independent constant to Q(., 0), so there is no loop for the paper's "Q-value divergence
#   spiral" (Sec. 5.2). The paper's MDP has a single state; without the step, Q bootstraps from itself
#   (state_terminal: half the rows, effective factor 0.45), and if the time limit is not a terminal, as
#   in SAC codes for dm_control, every row does (state_bootstrap: factor 0.9).
# - reward_scale: only alpha / reward scale matters for the max-ent optimum. "A bimodal Gaussian density"
#   reads as the 0.5/0.5 mixture (scale 1, peak 0.28) or as the sum of two Gaussian densities (scale 2).
#   With the true reward, the best tanh-Gaussian at scale 1 has a local optimum on a mode only for
#   alpha < ~0.095: alpha = 0.1 sits at the bifurcation, so the scale decides what "learns a mode" means.
# - lr (critic and actor together): how far the policy drifts within the update budget.
# - init_log_std: the paper's alpha = 0.15 policy becomes broad early ("visible at Step 60"); sigma_u = 1
#   (today) starts broad, -1.5 is where a bounded-log-std policy head starts (the midpoint of [-5, 2]).
FACTORIAL = {
    "horizon_mode": ("step_terminal", "state_terminal", "state_bootstrap"),
    "reward_scale": (1.0, 2.0),
    "lr": (3e-4, 1e-3),
    "init_log_std": (0.0, -1.5),
}

# One at a time around the stage-1 winner (relative changes apply to its values):
# width / depth change how a ReLU critic extrapolates beyond the data; LayerNorm bounds Q off the data (the
# paper's SAC-LN remedy, a control); faster targets speed up a bootstrap spiral; batch and buffer size set
# how well the support is fitted; separate actor / critic speeds; unit-peak reward bumps (the third reading
# of the reward, scale 2 sqrt(pi)); a policy that starts in the middle of the data (a = -1.5).
OFAT = (
    ("width256", {"hidden": 256}),
    ("depth3", {"depth": 3}),
    ("layernorm", {"layer_norm": True}),
    ("polyak0.05", {"polyak": 0.05}),
    ("batch64", {"batch_size": 64}),
    ("buffer100", {"buffer_size": 100}),
    ("actor_lr_x3", {"actor_lr": "x3"}),
    ("critic_lr_x3", {"critic_lr": "x3"}),
    ("reward_unit_peaks", {"reward_scale": 2 * math.sqrt(math.pi)}),
    ("init_mid_support", {"init_mean": math.atanh(-1.5 / 5.0)}),
)


def factorial_cells() -> list[tuple[str, dict]]:
    """Stage 1: ``(name, ToyConfig overrides)`` for every combination of ``FACTORIAL``."""
    cells = []
    for mode, scale, lr, log_std in itertools.product(*FACTORIAL.values()):
        name = f"{mode}/scale{scale:g}/lr{lr:g}/logstd{log_std:g}"
        cells.append((name, {"horizon_mode": mode, "reward_scale": scale, "critic_lr": lr, "actor_lr": lr,
                             "init_log_std": log_std}))
    return cells


def ofat_cells(base_name: str, base: dict) -> list[tuple[str, dict]]:
    """Stage 2: each ``OFAT`` change applied to the ``base`` overrides ("x3" triples the base's value)."""
    cells = []
    for label, change in OFAT:
        over = dict(base)
        for key, value in change.items():
            over[key] = 3 * over.get(key, ToyConfig.model_fields[key].default) if value == "x3" else value
        cells.append((f"{base_name}+{label}", over))
    return cells


def score_checkpoint(runs: list[dict], cfg: ToyConfig) -> dict:
    """Per-alpha counts and means at one checkpoint; ``runs`` holds ``{"alpha", "seed", **summary}`` rows."""
    out = {}
    for alpha in ALPHAS:
        sel = [r for r in runs if r["alpha"] == alpha]
        out[f"{alpha:g}"] = {
            "n": len(sel),
            "stays": sum(stays_on_support(r) for r in sel),
            "leaves": sum(leaves_support(r, cfg) for r in sel),
            "mean_mass_support": float(np.mean([r["mass_support"] for r in sel])),
            "mean_action": float(np.mean([r["final_policy_mean"] for r in sel])),
            "q_outside_above_inside": sum(r["q_max_outside"] > r["q_max_inside"] for r in sel),
        }
    low, high = out[f"{ALPHAS[0]:g}"], out[f"{ALPHAS[1]:g}"]
    out["shows_effect"] = bool(low["stays"] >= SHOW_FRACTION * low["n"] and high["leaves"] >= SHOW_FRACTION * high["n"])
    return out


def _rank_key(score: dict) -> tuple:
    """Higher is closer to the paper's effect: verdict, then stay + leave fractions, then the mass gap."""
    low, high = score[f"{ALPHAS[0]:g}"], score[f"{ALPHAS[1]:g}"]
    fractions = low["stays"] / low["n"] + high["leaves"] / high["n"]
    return (score["shows_effect"], fractions, low["mean_mass_support"] - high["mean_mass_support"])


def run_cell(name: str, stage: int, over: dict, seeds: tuple[int, ...]) -> dict:
    """Trains one cell (every seed at every alpha, batched) and scores it at each checkpoint."""
    cfg = ToyConfig(snapshot_every=math.gcd(*CHECKPOINTS), **over)
    pairs = [(a, s) for a in ALPHAS for s in seeds]
    start = time.process_time()
    results = run_toys(cfg, [a for a, _ in pairs], [s for _, s in pairs], max(CHECKPOINTS))
    cpu_s = time.process_time() - start
    checkpoints = {}
    for step in CHECKPOINTS:
        index = int(np.flatnonzero(results[0]["snapshot_steps"] == step)[0])
        runs = [{"alpha": a, "seed": s, **summarize(r, cfg, index)} for (a, s), r in zip(pairs, results)]
        for row in runs:
            row.update(stays=stays_on_support(row), leaves=leaves_support(row, cfg))
        checkpoints[str(step)] = {"score": score_checkpoint(runs, cfg), "runs": runs}
    return {"name": name, "stage": stage, "overrides": over, "seeds": list(seeds), "cpu_s": cpu_s,
            "checkpoints": checkpoints}


def best_cell(cells: list[dict]) -> tuple[dict, str]:
    """The ``(cell, checkpoint)`` with the highest ``_rank_key`` (first in grid order on ties)."""
    return max(((c, k) for c in cells for k in c["checkpoints"]),
               key=lambda ck: _rank_key(ck[0]["checkpoints"][ck[1]]["score"]))


class Grid:
    """Runs cells in order, saving the JSON after each; reuses cells already in an earlier JSON."""

    def __init__(self, path: str) -> None:
        """Loads ``path`` when it exists (resume)."""
        self.path, self.cells, self.done = path, [], {}
        if os.path.exists(path):
            with open(path) as fh:
                self.done = {(c["name"], json.dumps(c["overrides"], sort_keys=True), tuple(c["seeds"])): c
                             for c in json.load(fh)["cells"]}
        self.start_cpu = time.process_time()
        self.stopped = None

    def cpu_used(self) -> float:
        """CPU seconds of all cells so far, this process's and those reused from the earlier JSON."""
        return sum(c["cpu_s"] for c in self.cells if c.get("reused")) + time.process_time() - self.start_cpu

    def run(self, name: str, stage: int, over: dict, seeds: tuple[int, ...]) -> dict | None:
        """Runs (or reuses) one cell; ``None`` once the CPU budget is spent."""
        key = (name, json.dumps(over, sort_keys=True), tuple(seeds))
        if key in self.done:
            cell = {**self.done[key], "reused": True}
        elif self.cpu_used() > CPU_BUDGET_S:
            self.stopped = self.stopped or f"CPU budget {CPU_BUDGET_S:.0f} s spent before {name}"
            return None
        else:
            cell = run_cell(name, stage, over, seeds)
        self.cells.append(cell)
        self.save()
        print(_cell_line(cell), flush=True)
        return cell

    def save(self, **extra) -> None:
        """Writes every cell so far (atomically: a crash never leaves half a file)."""
        doc = {"alphas": ALPHAS, "checkpoints": CHECKPOINTS, "show_fraction": SHOW_FRACTION,
               "cpu_s_total": self.cpu_used(), "stopped": self.stopped, **extra,
               "cells": [{k: v for k, v in c.items() if k != "reused"} for c in self.cells]}
        with open(self.path + ".tmp", "w") as fh:
            json.dump(doc, fh, indent=1)
        os.replace(self.path + ".tmp", self.path)


def _cell_line(cell: dict) -> str:
    """One printed line per cell: per checkpoint, stays at 0.1 / leaves at 0.15, and the verdict."""
    parts = []
    for step, ck in cell["checkpoints"].items():
        s = ck["score"]
        low, high = s[f"{ALPHAS[0]:g}"], s[f"{ALPHAS[1]:g}"]
        mark = " *" if s["shows_effect"] else ""
        parts.append(f"{step}: {low['stays']}/{low['n']} stay, {high['leaves']}/{high['n']} leave, "
                     f"m {low['mean_mass_support']:.2f}/{high['mean_mass_support']:.2f}{mark}")
    return f"[{cell['stage']}] {cell['name']:<58} {cell['cpu_s']:6.1f} CPU s | " + " | ".join(parts)


def plot_grid(cells: list[dict], path: str) -> None:
    """Per cell (rows) and checkpoint (columns): each seed's mass on (-3, 0) at both alphas; * = effect."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CHECKPOINTS), figsize=(4.2 * len(CHECKPOINTS) + 3, 0.24 * len(cells) + 1.2),
                             sharey=True, squeeze=False)
    colours = {ALPHAS[0]: "tab:blue", ALPHAS[1]: "tab:orange"}
    for col, step in enumerate(CHECKPOINTS):
        ax = axes[0, col]
        for row, cell in enumerate(cells):
            for r in cell["checkpoints"][str(step)]["runs"]:
                y = row + (0.15 if r["alpha"] == ALPHAS[1] else -0.15)
                ax.plot(r["mass_support"], y, "o", ms=3.5, color=colours[r["alpha"]],
                        mfc=colours[r["alpha"]] if r["leaves"] else "none", mew=0.8)
            if cell["checkpoints"][str(step)]["score"]["shows_effect"]:
                ax.plot(1.04, row, "k*", ms=7, clip_on=False)
        ax.axvline(0.5, color="0.6", lw=0.8, ls="--")
        ax.set_xlim(0, 1)
        ax.set_title(f"after {step} updates", fontsize=9)
        ax.set_xlabel("policy mass on the data support (-3, 0)", fontsize=8)
        ax.grid(axis="y", color="0.93")
    axes[0, 0].set_yticks(range(len(cells)), [f"[{c['stage']}] {c['name']}" for c in cells], fontsize=6.5)
    axes[0, 0].invert_yaxis()
    handles = [plt.Line2D([], [], marker="o", ls="", color=c, label=f"alpha={a:g}") for a, c in colours.items()]
    handles.append(plt.Line2D([], [], marker="o", ls="", color="0.3", mfc="0.3", label="filled: left the support"))
    handles.append(plt.Line2D([], [], marker="*", ls="", color="k", label="cell shows the effect"))
    axes[0, -1].legend(handles=handles, fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    """Runs the three stages, writes ``toy_grid.json`` and ``toy_grid.png`` under ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/out/toy_grid")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    grid = Grid(os.path.join(args.out, "toy_grid.json"))
    stage1 = [c for c in (grid.run(n, 1, o, SEEDS) for n, o in factorial_cells()) if c]
    base, base_step = best_cell(stage1)
    stage2 = [c for c in (grid.run(n, 2, o, SEEDS) for n, o in ofat_cells(base["name"], base["overrides"])) if c]
    chosen, chosen_step = best_cell(stage1 + stage2)
    confirm = grid.run(f"confirm:{chosen['name']}", 3, chosen["overrides"], CONFIRM_SEEDS)
    verdict = None if confirm is None else confirm["checkpoints"][chosen_step]["score"]["shows_effect"]
    grid.save(stage2_base=[base["name"], base_step], chosen=[chosen["name"], chosen_step], confirmed=verdict)
    plot_grid(grid.cells, os.path.join(args.out, "toy_grid.png"))
    print(f"stage-2 base: {base['name']} at {base_step}; chosen: {chosen['name']} at {chosen_step}; "
          f"confirmed on seeds {CONFIRM_SEEDS[0]}-{CONFIRM_SEEDS[-1]}: {verdict}")
    print(f"CPU s: cells {grid.cpu_used():.0f}, process total {time.process_time():.0f}; stopped: {grid.stopped}")
    return {"base": base["name"], "chosen": chosen["name"], "step": chosen_step, "confirmed": verdict}


if __name__ == "__main__":
    main()
