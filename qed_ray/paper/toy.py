"""Off-policy toy of Sec. 5.2 / Fig. 2: high entropy amplifies extrapolation error.

The setup, the choices the paper leaves open (:class:`~qed_ray.paper.toy_config.ToyConfig`'s fields) and the results:
docs/toy.md."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from qed_ray.spec import cli_help
from qed_ray.paper.toy_config import ToyConfig, toy_reward  # noqa: F401 - part of the toy's interface
from qed_ray.paper.toy_learner import ToyLearner


def maxent_objective(mu: np.ndarray, sigma: np.ndarray, alpha: float, cfg: ToyConfig | None = None) -> np.ndarray:
    """Per-step soft objective ``J = E_pi[r(a)] + alpha H(pi)`` of the tanh-Gaussian ``(mu, sigma)`` under the true
    reward; ``mu``, ``sigma`` (> 0) broadcast, ``J`` has their shape.

    What a policy would maximise with a perfect critic: one state and the same reward at both steps make a fixed
    policy's soft value ``(1 + gamma) J``. 96-point Gauss-Hermite quadrature over ``u``."""
    cfg = cfg or ToyConfig()
    z, w = np.polynomial.hermite_e.hermegauss(96)
    mu, sigma = np.broadcast_arrays(np.asarray(mu, dtype=float), np.asarray(sigma, dtype=float))
    u = mu[..., None] + sigma[..., None] * z
    log_jac = math.log(cfg.half_width) + 2 * (math.log(2) - u - np.logaddexp(0.0, -2 * u))
    log_prob = -0.5 * z**2 - np.log(sigma)[..., None] - 0.5 * math.log(2 * math.pi) - log_jac
    values = toy_reward(cfg.center + cfg.half_width * np.tanh(u), cfg) - alpha * log_prob
    return (values * w).sum(axis=-1) / w.sum()


@dataclass(frozen=True)
class ToyBuffer:
    """Fixed replay data: ``actions``, ``rewards``, ``steps`` (time index t), each shape ``[N]``."""

    actions: np.ndarray
    rewards: np.ndarray
    steps: np.ndarray


def make_buffer(n: int, rng: np.random.Generator, cfg: ToyConfig | None = None) -> ToyBuffer:
    """``n`` transitions with actions uniform on ``buffer_support``, each array ``[n]`` and read-only (the toy never
    adds data); consecutive episodes, so ``steps = arange(n) % horizon``."""
    if int(n) != n or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    cfg = cfg or ToyConfig()
    lo, hi = cfg.buffer_support
    actions = rng.uniform(lo, hi, int(n))
    actions = np.where(actions <= lo, np.nextafter(lo, hi), actions)  # keep the open interval
    arrays = (actions, toy_reward(actions, cfg), np.arange(int(n)) % cfg.horizon)
    for arr in arrays:
        arr.setflags(write=False)
    return ToyBuffer(*arrays)


def action_grid(cfg: ToyConfig) -> np.ndarray:
    """Cell midpoints of ``cfg.grid_points`` equal cells over the open action interval, ``[G]``."""
    edges = np.linspace(cfg.action_low, cfg.action_high, cfg.grid_points + 1)
    return 0.5 * (edges[:-1] + edges[1:])


def _snapshot(lrn: ToyLearner, grid: np.ndarray) -> dict[str, np.ndarray]:
    """Per run: Q on the grid ``[R, 2, H, G]`` (both critics, every step), densities ``[R, G]``, masses ``[R]``."""
    cfg, actor, n_runs = lrn.cfg, lrn.actor, lrn.actor.mu.shape[0]
    a = torch.as_tensor(grid, dtype=torch.float32).expand(n_runs, len(grid))
    with torch.no_grad():
        q = torch.stack([lrn.critic(a, torch.full_like(a, t, dtype=torch.long)) for t in range(cfg.horizon)], dim=2)
    return {"q": q.numpy(), "density": actor.density(grid), "policy_mean": actor.mean_action(),
            "mass_support": actor.interval_mass(*cfg.buffer_support),
            "mass_left_mode": actor.interval_mass(-3.0, -1.0), "mass_right": actor.interval_mass(0.0, cfg.action_high)}


def _stacked_buffers(cfg: ToyConfig, seeds: list[int], buffers: list[ToyBuffer] | None) -> tuple[torch.Tensor, ...]:
    """Each run's replay data as ``(actions, rewards, steps)``, each ``[R, N]``."""
    if buffers is None:
        buffers = [make_buffer(cfg.buffer_size, np.random.default_rng(s), cfg) for s in seeds]
    if len(buffers) != len(seeds) or len({len(b.actions) for b in buffers}) != 1:
        raise ValueError(f"buffers must be one per run and of equal size, got {len(buffers)} for {len(seeds)} runs")
    return (torch.tensor(np.stack([b.actions for b in buffers]), dtype=torch.float32),
            torch.tensor(np.stack([b.rewards for b in buffers]), dtype=torch.float32),
            torch.tensor(np.stack([b.steps for b in buffers]), dtype=torch.long))


def _check_run_args(alphas: list[float], seeds: list[int], steps: int) -> None:
    """Clear errors for bad temperatures, seed lists and step counts."""
    for alpha in alphas:
        if not (math.isfinite(alpha) and alpha > 0):
            raise ValueError(f"alpha must be finite and > 0, got {alpha!r}")
    if len(alphas) != len(seeds) or not seeds:
        raise ValueError(f"alphas and seeds must be non-empty and of equal length, got {len(alphas)} and {len(seeds)}")
    if int(steps) != steps or steps < 0:
        raise ValueError(f"steps must be an integer >= 0, got {steps!r}")


def run_toys(cfg: ToyConfig, alphas: list[float], seeds: list[int], steps: int,
             buffers: list[ToyBuffer] | None = None) -> list[dict[str, np.ndarray]]:
    """Trains ``len(seeds)`` independent SAC runs at fixed temperatures ``alphas[r]``, batched, snapshotting at step 0,
    every ``cfg.snapshot_every`` updates and at the end.

    The seed fixes a run's buffer (when ``buffers`` is None), initialisation and sampling, so its result does not depend
    on the other runs. Per run: ``snapshot_steps [K]``, ``grid [G]``, ``q [K, 2, H, G]`` (both critics, every step t),
    ``density [K, G]``, ``policy_mean``/``mass_support``/``mass_left_mode``/``mass_right`` ``[K]``,
    ``critic_loss``/``actor_loss`` ``[steps]``."""
    _check_run_args(alphas, seeds, steps)
    data = _stacked_buffers(cfg, seeds, buffers)
    grid, lrn = action_grid(cfg), ToyLearner(cfg, seeds)
    alpha = torch.tensor(alphas, dtype=torch.float32)[:, None]
    rows = torch.arange(len(seeds))[:, None]
    snaps, losses = [(0, _snapshot(lrn, grid))], np.zeros((2, len(seeds), int(steps)))
    for step in range(1, int(steps) + 1):
        idx = torch.stack([torch.randint(data[0].shape[1], (cfg.batch_size,), generator=g) for g in lrn.gens])
        losses[:, :, step - 1] = lrn.update(tuple(d[rows, idx] for d in data), alpha)
        if step % cfg.snapshot_every == 0 or step == steps:
            snaps.append((step, _snapshot(lrn, grid)))
    stacked = {k: np.stack([s[k] for _, s in snaps], axis=1) for k in snaps[0][1]}
    return [{**{k: v[r] for k, v in stacked.items()}, "snapshot_steps": np.array([s for s, _ in snaps]),
             "grid": grid, "critic_loss": losses[0, r], "actor_loss": losses[1, r]} for r in range(len(seeds))]


def run_toy(cfg: ToyConfig, alpha: float, seed: int, steps: int,
            buffer: ToyBuffer | None = None) -> dict[str, np.ndarray]:
    """One run of ``run_toys`` (same result as that run inside a batch); see there for the returned arrays."""
    return run_toys(cfg, [alpha], [seed], steps, None if buffer is None else [buffer])[0]


def summarize(result: dict[str, np.ndarray], cfg: ToyConfig, index: int = -1) -> dict[str, float]:
    """Floats of one run at snapshot ``index``: ``step``, ``final_policy_mean``, the three masses, and
    ``q_max_inside``/``q_max_outside``, the maxima of ``min_j Q_j(a, t=0)`` over grid actions inside / outside
    ``buffer_support``."""
    inside = (result["grid"] > cfg.buffer_support[0]) & (result["grid"] < cfg.buffer_support[1])
    q0 = result["q"][index, :, 0].min(axis=0)
    masses = {k: float(result[k][index]) for k in ("mass_support", "mass_left_mode", "mass_right")}
    return {"step": int(result["snapshot_steps"][index]), "final_policy_mean": float(result["policy_mean"][index]),
            **masses, "q_max_inside": float(q0[inside].max()), "q_max_outside": float(q0[~inside].max())}


def stays_on_support(summary: dict[str, float]) -> bool:
    """The policy keeps at least half of its mass on the buffer's actions (paper Fig. 2b at alpha = 0.1)."""
    return summary["mass_support"] >= 0.5


def leaves_support(summary: dict[str, float], cfg: ToyConfig, margin: float = 0.5) -> bool:
    """The policy has left the data (paper Fig. 2b at alpha = 0.15): the collapse criterion.

    Less than half of its mass is on ``buffer_support`` **and** its mean action lies outside the support by
    at least ``margin`` (0.5 = a sixth of the support's width). The second clause separates a policy that
    moved off the data from one that is merely broad: the initial policy (mu = 0, sigma = 1) has 26% of
    its mass on (-3, 0) but mean action 0.
    """
    lo, hi = cfg.buffer_support
    mean = summary["final_policy_mean"]
    return summary["mass_support"] < 0.5 and (mean >= hi + margin or mean <= lo - margin)


def _print_table(rows: list[dict]) -> None:
    keys = ("final_policy_mean", "mass_support", "mass_left_mode", "mass_right", "q_max_inside", "q_max_outside")
    heads = ("mean_a", "m(-3,0)", "m(-3,-1)", "m(0,5)", "maxQin", "maxQout")
    print(f"{'alpha':>6} {'seed':>5}" + "".join(f" {h:>8}" for h in heads) + "   left")
    for alpha in sorted({r["alpha"] for r in rows}):
        sel = [r for r in rows if r["alpha"] == alpha]
        for r in sel:
            print(f"{alpha:>6g} {r['seed']:>5}" + "".join(f" {r[k]:>8.3f}" for k in keys) + f"   {r['left']}")
        means = "".join(f" {np.mean([s[k] for s in sel]):>8.3f}" for k in keys)
        print(f"{alpha:>6g} {'mean':>5}" + means + f"   {sum(r['left'] for r in sel)}/{len(sel)}")


def main(argv: list[str] | None = None) -> list[dict]:
    """CLI: the toy per (alpha, seed) in one batch; prints a table, saves PNGs and ``toy_summary.json`` (its rows)."""
    from qed_ray.paper.toy_plots import plot_panels  # matplotlib only when drawing

    parser = cli_help.parser("qed-ray toy", __doc__, (
        "qed-ray toy                           # Fig. 2's runs, figures in toy_out/",
        "qed-ray toy --alphas 0.05 0.2 --seeds 0 1 --steps 500 --out /tmp/toy   # a quick variant"))
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.1, 0.15])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=2000, help="gradient updates per run")
    parser.add_argument("--out", default="toy_out")
    parser.add_argument("--dpi", type=int, default=110, help="resolution of the figures")
    parser.add_argument("--overrides", default="{}", help='ToyConfig fields as JSON, e.g. \'{"hidden": 256}\'')
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the default run is sized for one core
    try:
        cfg = ToyConfig(**json.loads(args.overrides))
    except (json.JSONDecodeError, TypeError, ValueError) as err:  # pydantic's error names the field
        parser.error(f"--overrides: {err}")
    pairs = [(a, s) for a in args.alphas for s in args.seeds]
    start = time.process_time()
    results = run_toys(cfg, [a for a, _ in pairs], [s for _, s in pairs], args.steps)
    cpu_s = time.process_time() - start
    rows = [{"alpha": a, "seed": s, "steps": args.steps, **summarize(r, cfg)} for (a, s), r in zip(pairs, results)]
    for row in rows:
        row["left"] = leaves_support(row, cfg)
    os.makedirs(args.out, exist_ok=True)
    runs: dict[float, list[dict[str, np.ndarray]]] = {}
    for (a, _), r in zip(pairs, results):
        runs.setdefault(a, []).append(r)
    plot_panels(runs, cfg, args.out, seeds=args.seeds, dpi=args.dpi)
    with open(os.path.join(args.out, "toy_summary.json"), "w") as fh:
        json.dump({"config": cfg.model_dump(), "cpu_s": cpu_s, "runs": rows}, fh, indent=2)
    _print_table(rows)
    print(f"{len(rows)} runs x {args.steps} updates: {cpu_s:.1f} CPU s")
    return rows
