"""The off-policy toy's learner (paper Sec. 5.2): critics, policy and SAC update, batched over independent runs (a
leading run axis ``R`` on every tensor; why a run's result does not depend on its batch: docs/toy.md)."""

from __future__ import annotations

import copy
import math

import numpy as np
import torch
from torch.nn import functional as F

from qed_ray.rl.networks import tanh_log_det_jacobian

from qed_ray.paper.toy_config import LOG_STD_BOUNDS, ToyConfig


def _uniform(shape: tuple[int, ...], bound: float, gens: list[torch.Generator]) -> torch.Tensor:
    """U(-bound, bound) of shape ``[R, *shape]``, run r drawn from ``gens[r]``."""
    return torch.stack([(2 * torch.rand(shape, generator=g) - 1) * bound for g in gens])


class ToyCritics(torch.nn.Module):
    """Twin MLP critics ``Q_j(a[, t])`` for ``R`` runs, initialised as ``torch.nn.Linear`` is, run r from ``gens[r]``.

    The input is the action scaled to (-1, 1), followed by ``one_hot(t)`` in ``step_terminal`` mode (the critic knows
    the time step); otherwise the action alone (the paper's MDP has a single state)."""

    def __init__(self, cfg: ToyConfig, gens: list[torch.Generator]) -> None:
        super().__init__()
        self.cfg, self.n_runs = cfg, len(gens)
        sizes = [self.in_dim(cfg)] + [cfg.hidden] * cfg.depth + [1]
        self.weights, self.biases = torch.nn.ParameterList(), torch.nn.ParameterList()
        for n_in, n_out in zip(sizes[:-1], sizes[1:]):
            bound = 1.0 / math.sqrt(n_in)
            self.weights.append(torch.nn.Parameter(_uniform((2, n_in, n_out), bound, gens)))
            self.biases.append(torch.nn.Parameter(_uniform((2, 1, n_out), bound, gens)))

    @staticmethod
    def in_dim(cfg: ToyConfig) -> int:
        return 1 + (cfg.horizon if cfg.horizon_mode == "step_terminal" else 0)

    def features(self, actions: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """Critic input ``[R, B, in_dim]`` from ``actions [R, B]`` and ``steps [R, B]`` (int64)."""
        x = ((actions - self.cfg.center) / self.cfg.half_width)[..., None]
        if self.cfg.horizon_mode != "step_terminal":
            return x
        return torch.cat([x, F.one_hot(steps, self.cfg.horizon).to(actions.dtype)], dim=-1)

    def forward(self, actions: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """Q-values ``[R, 2, B]`` of both critics from ``actions [R, B]``, int64 ``steps [R, B]`` < horizon."""
        x = self.features(actions, steps)
        n_runs, batch = actions.shape
        h = x[:, None].expand(n_runs, 2, batch, x.shape[-1]).reshape(2 * n_runs, batch, x.shape[-1])
        last = len(self.weights) - 1
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            h = torch.baddbmm(b.reshape(2 * n_runs, 1, -1), h, w.reshape(2 * n_runs, *w.shape[2:]))
            if i < last:
                h = F.relu(F.layer_norm(h, h.shape[-1:]) if self.cfg.layer_norm else h)
        return h.reshape(n_runs, 2, batch)


class ToyActor(torch.nn.Module):
    """State-independent tanh-Gaussians for ``R`` runs: ``a = c + h tanh(u)``, ``u ~ N(mu_r, sigma_r^2)``.

    With a single state a policy network reduces to its output, so ``(mu, log sigma)`` per run are the parameters; ``log
    sigma`` is bounded smoothly to ``LOG_STD_BOUNDS`` through a tanh, as the project's actor does."""

    def __init__(self, cfg: ToyConfig, n_runs: int) -> None:
        super().__init__()
        self.cfg = cfg
        lo, hi = LOG_STD_BOUNDS
        self.mu = torch.nn.Parameter(torch.full((n_runs,), float(cfg.init_mean)))
        raw = math.atanh(2 * (cfg.init_log_std - lo) / (hi - lo) - 1)
        self.raw_log_std = torch.nn.Parameter(torch.full((n_runs,), raw))

    def log_std(self) -> torch.Tensor:
        """Bounded log sigma, shape ``[R]``."""
        lo, hi = LOG_STD_BOUNDS
        return lo + 0.5 * (hi - lo) * (torch.tanh(self.raw_log_std) + 1)

    def sample(self, n: int, gens: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
        """Reparameterised ``(actions [R, n], log_prob [R, n])`` (tanh change of variables and scale ``h``), run r's
        noise from ``gens[r]``."""
        eps = torch.stack([torch.randn(n, generator=g) for g in gens])
        log_std = self.log_std()[:, None]
        u = self.mu[:, None] + log_std.exp() * eps
        log_normal = -0.5 * eps**2 - log_std - 0.5 * math.log(2 * math.pi)
        log_jac = math.log(self.cfg.half_width) + tanh_log_det_jacobian(u)
        return self.cfg.center + self.cfg.half_width * torch.tanh(u), log_normal - log_jac

    def stats(self) -> tuple[np.ndarray, np.ndarray]:
        """Pre-tanh ``(mu [R], sigma [R])`` as float64 numpy arrays."""
        return (self.mu.detach().double().numpy().copy(), self.log_std().detach().double().exp().numpy())

    def density(self, grid: np.ndarray) -> np.ndarray:
        """Exact action densities on ``grid [G]`` (strictly inside the interval) -> ``[R, G]``."""
        mu, sigma = (v[:, None] for v in self.stats())
        y = (np.asarray(grid, dtype=float) - self.cfg.center) / self.cfg.half_width
        u = np.arctanh(y)[None]
        normal = np.exp(-0.5 * ((u - mu) / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))
        return normal / (self.cfg.half_width * (1 - y**2))[None]

    def interval_mass(self, lo: float, hi: float) -> np.ndarray:
        """Exact probability of ``lo < a < hi`` per run, ``[R]`` (normal CDF at the atanh bounds)."""
        mu, sigma = self.stats()
        y = np.clip((np.array([lo, hi], dtype=float) - self.cfg.center) / self.cfg.half_width, -1.0, 1.0)
        with np.errstate(divide="ignore"):  # the interval's ends map to u = -inf / +inf
            z = (np.arctanh(y)[None] - mu[:, None]) / (sigma[:, None] * math.sqrt(2))
        erf = np.vectorize(math.erf)
        return 0.5 * (erf(z[:, 1]) - erf(z[:, 0]))

    def mean_action(self) -> np.ndarray:
        """``E[a]`` per run, ``[R]``, by 64-point Gauss-Hermite quadrature over ``u``."""
        mu, sigma = self.stats()
        z, w = np.polynomial.hermite_e.hermegauss(64)
        a = self.cfg.center + self.cfg.half_width * np.tanh(mu[:, None] + sigma[:, None] * z[None])
        return (a * w).sum(axis=1) / w.sum()


def td_targets(rewards: torch.Tensor, steps: torch.Tensor, next_q: torch.Tensor, next_log_prob: torch.Tensor,
               alpha: torch.Tensor | float, cfg: ToyConfig) -> torch.Tensor:
    """Soft TD targets ``y = r + gamma * m * (next_q - alpha * next_log_prob)`` (SAC, paper Sec. 2), all ``[R, B]`` (or
    ``[B]``), ``alpha`` a float or ``[R, 1]``.

    The bootstrap mask ``m`` is ``1[t < H - 1]`` in the ``*_terminal`` modes (the last step ends the episode) and 1 in
    ``state_bootstrap`` (the time limit is not a terminal, as SAC codes for dm_control treat it)."""
    if cfg.horizon_mode == "state_bootstrap":
        bootstrap = torch.ones_like(rewards)
    else:
        bootstrap = (steps < cfg.horizon - 1).to(rewards.dtype)
    return rewards + cfg.gamma * bootstrap * (next_q - alpha * next_log_prob)


def soft_td_targets(batch: tuple[torch.Tensor, ...], target: torch.nn.Module, actor: ToyActor,
                    alpha: torch.Tensor, gens: list[torch.Generator]) -> torch.Tensor:
    """:func:`td_targets` of a batch ``(actions, rewards, steps)``, each ``[R, B]``, without gradient: ``a' ~ actor``,
    ``target`` queried at ``(a', t + 1)`` (clamped to the last step, whose value is never used)."""
    _, rewards, steps = batch
    with torch.no_grad():
        next_a, next_logp = actor.sample(rewards.shape[1], gens)
        next_steps = torch.clamp(steps + 1, max=actor.cfg.horizon - 1)
        next_q = target(next_a, next_steps).min(dim=1).values
        return td_targets(rewards, steps, next_q, next_logp, alpha, actor.cfg)


class ToyLearner:
    """Critics, target critics, policy, optimisers and generators of ``R`` runs; ``seeds[r]`` seeds run r's generator,
    which initialises its critics and then drives all its sampling."""

    def __init__(self, cfg: ToyConfig, seeds: list[int]) -> None:
        self.cfg = cfg
        self.gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
        self.critic = ToyCritics(cfg, self.gens)
        self.target = copy.deepcopy(self.critic)
        self.actor = ToyActor(cfg, len(seeds))
        self.critic_opt = torch.optim.Adam(self.critic.parameters(), lr=cfg.critic_lr)
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=cfg.actor_lr)

    def update(self, batch: tuple[torch.Tensor, ...], alpha: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """One SAC step for every run at fixed ``alpha [R, 1]`` on ``batch`` (each ``[R, B]``): critic regression, actor
        step, Polyak averaging; returns ``(critic_loss [R], actor_loss [R])``.

        Each run's loss is a mean over its batch and the losses are summed over runs, so every run's gradient is its
        own."""
        actions, _, steps = batch
        y = soft_td_targets(batch, self.target, self.actor, alpha, self.gens)
        critic_loss = ((self.critic(actions, steps) - y[:, None]) ** 2).mean(dim=2).sum(dim=1)
        self.critic_opt.zero_grad()
        critic_loss.sum().backward()
        self.critic_opt.step()
        pi_a, logp = self.actor.sample(steps.shape[1], self.gens)
        actor_loss = (alpha * logp - self.critic(pi_a, steps).min(dim=1).values).mean(dim=1)
        self.actor_opt.zero_grad()
        actor_loss.sum().backward()  # critic grads from this pass are zeroed before their next use
        self.actor_opt.step()
        with torch.no_grad():
            for p, p_targ in zip(self.critic.parameters(), self.target.parameters()):
                p_targ.lerp_(p, self.cfg.polyak)
        return critic_loss.detach().numpy().copy(), actor_loss.detach().numpy().copy()
