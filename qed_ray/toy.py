"""Off-policy toy of Sec. 5.2 / Fig. 2: high entropy amplifies extrapolation error.

Paper setup: one state, actions in (-5, 5), reward a bimodal Gaussian density
(modes -2 and 2, variance 0.5), horizon H = 2, gamma = 0.9; the buffer holds only
actions from (-3, 0) and no data is ever added. Choices the paper leaves open
(documented, not tuned to match Fig. 2):

* Mixture weights 0.5 / 0.5, so ``r`` is a probability density (peak ~0.28).
* Horizon 2: each twin critic takes ``(a, one_hot(t))``. Step-0 targets bootstrap
  from the step-1 soft value ``min_j Qtarg_j(a', 1) - alpha log pi(a')``, ``a' ~ pi``;
  step 1 is terminal (``y = r``).
* "Standard SAC-style" critics: two 2x64 ReLU MLPs **without** LayerNorm
  (``layer_norm=True`` adds it), Polyak targets (0.005), Adam 3e-4.
* Policy ``a = 5 tanh(u)``, ``u ~ N(mu, sigma^2)``, state-independent: with one
  state a policy network reduces to its output, so (mu, log sigma) are the
  parameters (init 0, 0). Sharing it over both steps is exact because
  ``Q(a, 0) - Q(a, 1)`` does not depend on ``a``. SAC actor loss at FIXED alpha.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn
from torch.nn import functional as F

_LOG_STD_BOUNDS = (-5.0, 2.0)


class ToyConfig(BaseModel):
    """The toy's settings; defaults are the paper's values (Sec. 5.2) plus documented choices."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    action_low: float = -5.0
    action_high: float = 5.0
    modes: tuple[float, float] = (-2.0, 2.0)
    mode_weights: tuple[float, float] = (0.5, 0.5)
    variance: float = Field(0.5, gt=0)
    horizon: int = Field(2, ge=1)
    gamma: float = Field(0.9, gt=0, le=1)
    buffer_support: tuple[float, float] = (-3.0, 0.0)
    buffer_size: int = Field(1000, ge=1)
    batch_size: int = Field(256, ge=1)
    hidden: int = Field(64, ge=1)
    layer_norm: bool = False
    critic_lr: float = Field(3e-4, gt=0)
    actor_lr: float = Field(3e-4, gt=0)
    polyak: float = Field(0.005, gt=0, le=1)
    init_log_std: float = Field(0.0, gt=_LOG_STD_BOUNDS[0], lt=_LOG_STD_BOUNDS[1])
    snapshot_every: int = Field(50, ge=1)
    grid_points: int = Field(201, ge=2)

    @model_validator(mode="after")
    def _check_ranges(self) -> "ToyConfig":
        """Rejects inconsistent intervals and mixture weights."""
        if not self.action_low < self.action_high:
            raise ValueError(f"action_low must be < action_high, got {self.action_low} and {self.action_high}")
        lo, hi = self.buffer_support
        if not self.action_low <= lo < hi <= self.action_high:
            raise ValueError(f"buffer_support must be an interval inside ({self.action_low}, "
                             f"{self.action_high}), got {self.buffer_support}")
        if min(self.mode_weights) < 0 or not math.isclose(sum(self.mode_weights), 1.0):
            raise ValueError(f"mode_weights must be >= 0 and sum to 1, got {self.mode_weights}")
        return self

    @property
    def center(self) -> float:
        """Midpoint of the action interval."""
        return 0.5 * (self.action_low + self.action_high)

    @property
    def half_width(self) -> float:
        """Half-width of the action interval (the tanh scale)."""
        return 0.5 * (self.action_high - self.action_low)


def toy_reward(a: np.ndarray, cfg: ToyConfig | None = None) -> np.ndarray:
    """Bimodal reward ``r(a) = sum_k w_k N(a; m_k, variance)`` (Sec. 5.2).

    Args:
        a: actions, any shape.
        cfg: toy config (defaults: weights 0.5/0.5, modes -2/2, variance 0.5).

    Returns:
        Rewards, same shape as ``a``.
    """
    cfg = cfg or ToyConfig()
    a = np.asarray(a, dtype=float)
    norm = 1.0 / math.sqrt(2 * math.pi * cfg.variance)
    return sum(w * norm * np.exp(-(a - m) ** 2 / (2 * cfg.variance)) for w, m in zip(cfg.mode_weights, cfg.modes))


@dataclass(frozen=True)
class ToyBuffer:
    """Fixed replay data: ``actions``, ``rewards``, ``steps`` (time index t), each shape ``[N]``."""

    actions: np.ndarray
    rewards: np.ndarray
    steps: np.ndarray


def make_buffer(n: int, rng: np.random.Generator, cfg: ToyConfig | None = None) -> ToyBuffer:
    """Pre-fills the buffer with ``n`` transitions whose actions are uniform on ``buffer_support``.

    Transitions come from consecutive episodes, so ``steps = arange(n) % horizon``.
    The arrays are made read-only: the toy never adds or changes data.

    Args:
        n: number of transitions >= 1.
        rng: numpy generator.
        cfg: toy config.

    Returns:
        The buffer, each array shape ``[n]``.
    """
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


class TwinCritic(nn.Module):
    """Two MLP critics ``Q_j(a, t)``; input ``[(a - c) / h, one_hot(t)]``."""

    def __init__(self, cfg: ToyConfig) -> None:
        """Builds both critics (2 hidden layers of ``cfg.hidden``, optional LayerNorm)."""
        super().__init__()
        self.cfg = cfg

        def block(n_in: int) -> list[nn.Module]:
            norm = [nn.LayerNorm(cfg.hidden)] if cfg.layer_norm else []
            return [nn.Linear(n_in, cfg.hidden), *norm, nn.ReLU()]

        self.nets = nn.ModuleList(
            nn.Sequential(*block(1 + cfg.horizon), *block(cfg.hidden), nn.Linear(cfg.hidden, 1)) for _ in range(2))

    def forward(self, actions: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """Q-values of both critics.

        Args:
            actions: shape ``[B]``, in the action interval.
            steps: time indices, shape ``[B]`` (int64, in ``[0, horizon)``).

        Returns:
            Shape ``[2, B]``.
        """
        x = torch.cat([((actions - self.cfg.center) / self.cfg.half_width)[:, None],
                       F.one_hot(steps, self.cfg.horizon).to(actions.dtype)], dim=1)
        return torch.stack([net(x)[:, 0] for net in self.nets])


class ToyActor(nn.Module):
    """State-independent tanh-squashed Gaussian: ``a = c + h tanh(u)``, ``u ~ N(mu, sigma^2)``."""

    def __init__(self, cfg: ToyConfig) -> None:
        """Starts at ``mu = 0`` and ``log sigma = cfg.init_log_std``."""
        super().__init__()
        self.cfg = cfg
        lo, hi = _LOG_STD_BOUNDS
        self.mu = nn.Parameter(torch.zeros(1))
        # log sigma = lo + (hi - lo) * (tanh(raw) + 1) / 2: smooth bounds, no dead gradient.
        self.raw_log_std = nn.Parameter(torch.full((1,), math.atanh(2 * (cfg.init_log_std - lo) / (hi - lo) - 1)))

    def log_std(self) -> torch.Tensor:
        """Bounded log sigma, shape ``[1]``."""
        lo, hi = _LOG_STD_BOUNDS
        return lo + 0.5 * (hi - lo) * (torch.tanh(self.raw_log_std) + 1)

    def sample(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Reparameterised actions and their log-densities.

        Args:
            n: number of samples.
            generator: torch generator.

        Returns:
            ``(actions [n], log_prob [n])``; log_prob uses the stable tanh correction
            ``log(1 - tanh(u)^2) = 2 (log 2 - u - softplus(-2u))``.
        """
        log_std = self.log_std()
        u = self.mu + log_std.exp() * torch.randn(n, generator=generator)
        log_normal = -0.5 * ((u - self.mu) / log_std.exp()) ** 2 - log_std - 0.5 * math.log(2 * math.pi)
        log_jac = math.log(self.cfg.half_width) + 2 * (math.log(2) - u - F.softplus(-2 * u))
        return self.cfg.center + self.cfg.half_width * torch.tanh(u), log_normal - log_jac

    def _stats(self) -> tuple[float, float]:
        return float(self.mu.detach()), float(self.log_std().detach().exp())

    def density(self, grid: np.ndarray) -> np.ndarray:
        """Exact action density on ``grid [G]`` (strictly inside the interval) -> ``[G]``."""
        mu, sigma = self._stats()
        y = (np.asarray(grid) - self.cfg.center) / self.cfg.half_width
        u = np.arctanh(y)
        normal = np.exp(-0.5 * ((u - mu) / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))
        return normal / (self.cfg.half_width * (1 - y**2))

    def interval_mass(self, lo: float, hi: float) -> float:
        """Exact policy probability of ``lo < a < hi`` (via the normal CDF of atanh bounds)."""
        mu, sigma = self._stats()
        y = np.clip((np.array([lo, hi], dtype=float) - self.cfg.center) / self.cfg.half_width, -1.0, 1.0)
        with np.errstate(divide="ignore"):  # the interval's ends map to u = -inf / +inf
            z = (np.arctanh(y) - mu) / (sigma * math.sqrt(2))
        return 0.5 * (math.erf(z[1]) - math.erf(z[0]))

    def mean_action(self) -> float:
        """``E[a]`` by 64-point Gauss-Hermite quadrature over ``u``."""
        mu, sigma = self._stats()
        z, w = np.polynomial.hermite_e.hermegauss(64)
        return float((w * (self.cfg.center + self.cfg.half_width * np.tanh(mu + sigma * z))).sum() / w.sum())


def td_targets(rewards: torch.Tensor, steps: torch.Tensor, next_q: torch.Tensor,
               next_log_prob: torch.Tensor, alpha: float, cfg: ToyConfig) -> torch.Tensor:
    """Soft TD targets of the finite-horizon toy (SAC target, Sec. 2 / App. B).

    ``y = r + gamma * 1[t < H - 1] * (next_q - alpha * next_log_prob)``: the last
    step is terminal, every earlier step bootstraps from the next step's soft value.

    Args:
        rewards: shape ``[B]``.
        steps: time index t of each transition, shape ``[B]``.
        next_q: ``min_j Qtarg_j(a', t + 1)``, shape ``[B]`` (ignored where terminal).
        next_log_prob: ``log pi(a')``, shape ``[B]``.
        alpha: fixed temperature.
        cfg: toy config (horizon, gamma).

    Returns:
        Targets, shape ``[B]``.
    """
    bootstrap = (steps < cfg.horizon - 1).to(rewards.dtype)
    return rewards + cfg.gamma * bootstrap * (next_q - alpha * next_log_prob)


def soft_td_targets(batch: tuple[torch.Tensor, ...], target: TwinCritic, actor: ToyActor, alpha: float,
                    gen: torch.Generator) -> torch.Tensor:
    """Soft TD targets for a buffer batch, with next actions from the current policy.

    Args:
        batch: ``(actions, rewards, steps)``, each shape ``[B]``.
        target: target twin critic; queried at ``(a', t + 1)`` with ``a' ~ pi``.
        actor: current policy (sampled, not updated).
        alpha: fixed temperature.
        gen: torch generator for ``a'``.

    Returns:
        ``td_targets`` of the batch, shape ``[B]``, without gradient.
    """
    _, rewards, steps = batch
    with torch.no_grad():
        next_a, next_logp = actor.sample(len(rewards), gen)
        next_steps = torch.clamp(steps + 1, max=actor.cfg.horizon - 1)
        next_q = target(next_a, next_steps).min(dim=0).values
        return td_targets(rewards, steps, next_q, next_logp, alpha, actor.cfg)


class _Learner:
    """The toy's networks and optimisers (initialised from the torch RNG ``run_toy`` seeds)."""

    def __init__(self, cfg: ToyConfig) -> None:
        self.critic, self.target, self.actor = TwinCritic(cfg), TwinCritic(cfg), ToyActor(cfg)
        self.target.load_state_dict(self.critic.state_dict())
        self.critic_opt = torch.optim.Adam(self.critic.parameters(), lr=cfg.critic_lr)
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=cfg.actor_lr)


def _update(lrn: _Learner, batch: tuple[torch.Tensor, ...], alpha: float, gen: torch.Generator) -> tuple[float, float]:
    """One SAC update (critic, actor, Polyak) on a buffer batch; returns the two losses."""
    actions, _, steps = batch
    y = soft_td_targets(batch, lrn.target, lrn.actor, alpha, gen)
    critic_loss = ((lrn.critic(actions, steps) - y) ** 2).mean(dim=1).sum()
    lrn.critic_opt.zero_grad()
    critic_loss.backward()
    lrn.critic_opt.step()
    pi_a, logp = lrn.actor.sample(len(steps), gen)
    actor_loss = (alpha * logp - lrn.critic(pi_a, steps).min(dim=0).values).mean()
    lrn.actor_opt.zero_grad()
    actor_loss.backward()  # critic grads from this pass are zeroed before their next use
    lrn.actor_opt.step()
    with torch.no_grad():
        for p, p_targ in zip(lrn.critic.parameters(), lrn.target.parameters()):
            p_targ.lerp_(p, lrn.actor.cfg.polyak)
    return float(critic_loss.detach()), float(actor_loss.detach())


def action_grid(cfg: ToyConfig) -> np.ndarray:
    """Cell midpoints of ``cfg.grid_points`` equal cells over the open action interval, ``[G]``."""
    edges = np.linspace(cfg.action_low, cfg.action_high, cfg.grid_points + 1)
    return 0.5 * (edges[:-1] + edges[1:])


def _snapshot(lrn: _Learner, grid: np.ndarray) -> dict[str, np.ndarray | float]:
    """Q on the grid for both critics and all steps ``[2, H, G]``, policy density and masses."""
    cfg, actor = lrn.actor.cfg, lrn.actor
    a = torch.as_tensor(grid, dtype=torch.float32)
    with torch.no_grad():
        q = torch.stack([lrn.critic(a, torch.full_like(a, t, dtype=torch.long)) for t in range(cfg.horizon)], dim=1)
    return {"q": q.numpy(), "density": actor.density(grid), "policy_mean": actor.mean_action(),
            "mass_support": actor.interval_mass(*cfg.buffer_support),
            "mass_left_mode": actor.interval_mass(-3.0, -1.0), "mass_right": actor.interval_mass(0.0, cfg.action_high)}


def run_toy(cfg: ToyConfig, alpha: float, seed: int, steps: int,
            buffer: ToyBuffer | None = None) -> dict[str, np.ndarray]:
    """Trains SAC at fixed ``alpha`` on the fixed buffer and records snapshots.

    Snapshots are taken at step 0, every ``cfg.snapshot_every`` updates, and at the end.

    Args:
        cfg: toy config.
        alpha: fixed temperature > 0.
        seed: seeds the buffer (when not given), network init and sampling.
        steps: number of gradient updates >= 0.
        buffer: optional pre-made buffer (never modified).

    Returns:
        ``snapshot_steps [K]``, ``grid [G]``, ``q [K, 2, H, G]`` (both critics, every
        step t), ``density [K, G]``, ``policy_mean``/``mass_support``/``mass_left_mode``/
        ``mass_right`` ``[K]``, ``critic_loss``/``actor_loss`` ``[steps]``.
    """
    if not (math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha must be finite and > 0, got {alpha!r}")
    if int(steps) != steps or steps < 0:
        raise ValueError(f"steps must be an integer >= 0, got {steps!r}")
    if buffer is None:
        buffer = make_buffer(cfg.buffer_size, np.random.default_rng(seed), cfg)
    data = (torch.tensor(buffer.actions, dtype=torch.float32), torch.tensor(buffer.rewards, dtype=torch.float32),
            torch.tensor(buffer.steps, dtype=torch.long))
    grid, gen = action_grid(cfg), torch.Generator().manual_seed(seed)
    snaps, losses = [], np.zeros((2, int(steps)))
    with torch.random.fork_rng(devices=[]):  # seed network init without touching the caller's RNG
        torch.manual_seed(seed)
        lrn = _Learner(cfg)
    snaps.append((0, _snapshot(lrn, grid)))
    for step in range(1, int(steps) + 1):
        idx = torch.randint(len(data[0]), (cfg.batch_size,), generator=gen)
        losses[:, step - 1] = _update(lrn, tuple(d[idx] for d in data), alpha, gen)
        if step % cfg.snapshot_every == 0 or step == steps:
            snaps.append((step, _snapshot(lrn, grid)))
    out = {k: np.stack([np.asarray(s[k]) for _, s in snaps]) for k in snaps[0][1]}
    out.update(snapshot_steps=np.array([s for s, _ in snaps]), grid=grid,
               critic_loss=losses[0], actor_loss=losses[1])
    return out


def summarize(result: dict[str, np.ndarray], cfg: ToyConfig) -> dict[str, float]:
    """Final-snapshot summary of one run.

    ``q_max_inside``/``q_max_outside`` are maxima of ``min_j Q_j(a, t=0)`` over grid
    actions inside / outside ``buffer_support``.

    Args:
        result: output of ``run_toy``.
        cfg: its config.

    Returns:
        Dict of floats: ``final_policy_mean``, ``mass_support``, ``mass_left_mode``,
        ``mass_right``, ``q_max_inside``, ``q_max_outside``.
    """
    inside = (result["grid"] > cfg.buffer_support[0]) & (result["grid"] < cfg.buffer_support[1])
    q0 = result["q"][-1, :, 0].min(axis=0)
    final = {k: float(result[k][-1]) for k in ("mass_support", "mass_left_mode", "mass_right")}
    return {"final_policy_mean": float(result["policy_mean"][-1]), **final,
            "q_max_inside": float(q0[inside].max()), "q_max_outside": float(q0[~inside].max())}


def plot_panels(runs: dict[float, list[dict[str, np.ndarray]]], cfg: ToyConfig, out_dir: str,
                n_cols: int = 6) -> list[str]:
    """Draws Fig. 2 (a) Q landscapes and (b) policy densities; rows = alpha, cols = snapshots.

    Args:
        runs: ``{alpha: [run_toy result per seed]}`` (same snapshot steps in all).
        cfg: toy config.
        out_dir: folder for ``fig2a_q_landscapes.png`` and ``fig2b_policy_densities.png``.
        n_cols: number of evenly spaced snapshots shown.

    Returns:
        The two PNG paths.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    first = next(iter(runs.values()))[0]
    cols = np.unique(np.linspace(0, len(first["snapshot_steps"]) - 1, n_cols).round().astype(int))
    grid, paths = first["grid"], []
    panels = (("fig2a_q_landscapes.png", lambda r, k: r["q"][k, :, 0].min(axis=0), "min_j Q_j(a, t=0)"),
              ("fig2b_policy_densities.png", lambda r, k: r["density"][k], "policy density"))
    for name, value, ylabel in panels:
        fig, axes = plt.subplots(len(runs), len(cols), figsize=(2.6 * len(cols), 2.3 * len(runs)),
                                 squeeze=False, sharex=True, sharey="row")
        for row, (alpha, results) in enumerate(runs.items()):
            for col, k in enumerate(cols):
                ax = axes[row, col]
                ax.axvspan(*cfg.buffer_support, color="0.9", label="buffer support")
                ax.plot(grid, toy_reward(grid, cfg), "k--", lw=1, label="r(a)")
                for seed_idx, r in enumerate(results):
                    ax.plot(grid, value(r, k), lw=1, label=f"seed #{seed_idx}")
                ax.set_title(f"alpha={alpha:g}, step {first['snapshot_steps'][k]}", fontsize=8)
            axes[row, 0].set_ylabel(ylabel, fontsize=8)
        axes[0, 0].legend(fontsize=6)
        fig.tight_layout()
        paths.append(os.path.join(out_dir, name))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def _print_table(rows: list[dict]) -> None:
    """Prints one line per (alpha, seed) and a per-alpha mean line."""
    keys = ("final_policy_mean", "mass_support", "mass_left_mode", "mass_right", "q_max_inside", "q_max_outside")
    heads = ("mean_a", "m(-3,0)", "m(-3,-1)", "m(0,5)", "maxQin", "maxQout", "wall_s")
    print(f"{'alpha':>6} {'seed':>5}" + "".join(f" {h:>8}" for h in heads))
    for alpha in sorted({r["alpha"] for r in rows}):
        sel = [r for r in rows if r["alpha"] == alpha]
        for r in sel + [{"seed": "mean", "wall_s": float("nan"), **{k: np.mean([s[k] for s in sel]) for k in keys}}]:
            print(f"{alpha:>6g} {r['seed']:>5}" + "".join(f" {r[k]:>8.3f}" for k in keys) + f" {r['wall_s']:>8.1f}")


def main(argv: list[str] | None = None) -> list[dict]:
    """CLI: run the toy for each (alpha, seed), print a table, save PNGs and JSON.

    Args:
        argv: command-line arguments (``None`` reads ``sys.argv``).

    Returns:
        One summary dict per (alpha, seed), as written to ``toy_summary.json``.
    """
    parser = argparse.ArgumentParser(prog="python -m qed_ray.toy", description=__doc__.splitlines()[0])
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.1, 0.15])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=2000, help="gradient updates per run")
    parser.add_argument("--out", default="toy_out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the default run is sized for one core
    cfg, runs, rows = ToyConfig(), {}, []
    for alpha in args.alphas:
        for seed in args.seeds:
            start = time.perf_counter()
            runs.setdefault(alpha, []).append(run_toy(cfg, alpha, seed, args.steps))
            rows.append({"alpha": alpha, "seed": seed, "steps": args.steps, **summarize(runs[alpha][-1], cfg),
                         "wall_s": time.perf_counter() - start})
    os.makedirs(args.out, exist_ok=True)
    plot_panels(runs, cfg, args.out)
    with open(os.path.join(args.out, "toy_summary.json"), "w") as fh:
        json.dump({"config": cfg.model_dump(), "runs": rows}, fh, indent=2)
    _print_table(rows)
    return rows


if __name__ == "__main__":
    main()
