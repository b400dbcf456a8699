"""Temperature rules behind one interface (DESIGN.md §3 'Temperatures', paper Sec. 2 Eq. 1 and Sec. 5.1).

Every rule offers ``alpha(states, sample_actions, q_pair) -> [B]`` (detached) and ``loss(log_prob)`` for its
own trainable part. ``sample_actions(states) -> actions`` draws from the current policy and
``q_pair(states, actions) -> (q1, q2)`` evaluates a pair of critics (scalar or HL-Gauss expected values);
only QED calls them.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from qed_ray.config import TemperatureSpec

SampleFn = Callable[[torch.Tensor], torch.Tensor]
QPairFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def expectile(x: torch.Tensor, tau: float) -> torch.Tensor:
    """Exact tau-expectile along the last axis: the m minimising sum_i |tau - 1[x_i < m]| (x_i - m)^2.

    The minimiser solves m = sum_i w_i x_i / sum_i w_i with w_i = tau above m and 1 - tau below. With the
    samples sorted, each split position j (j samples below m) gives a closed-form candidate; exactly the
    candidate lying inside its own bracket [x_(j-1), x_(j)] is the expectile (the objective is strictly convex).
    No iteration, no data-dependent control flow (compile-friendly).

    Args:
        x: [..., N] samples.
        tau: level in (0, 1); 0.5 gives the mean.

    Returns:
        [...] expectiles, each within [min x, max x].
    """
    xs, _ = torch.sort(x, dim=-1)
    n = xs.shape[-1]
    zero = torch.zeros_like(xs[..., :1])
    below_sum = torch.cat([zero, xs.cumsum(-1)], dim=-1)  # [..., N+1]: sum of the j smallest
    total = below_sum[..., -1:]
    j = torch.arange(n + 1, device=x.device, dtype=x.dtype)
    cand = ((1 - tau) * below_sum + tau * (total - below_sum)) / ((1 - tau) * j + tau * (n - j))
    lo = torch.cat([torch.full_like(zero, -float("inf")), xs], dim=-1)  # x_(j-1)
    hi = torch.cat([xs, torch.full_like(zero, float("inf"))], dim=-1)  # x_(j)
    valid = (cand >= lo) & (cand <= hi)
    first = valid.to(torch.int8).argmax(dim=-1, keepdim=True)
    return cand.gather(-1, first).squeeze(-1)


class FixedTemperature(nn.Module):
    """A constant alpha (paper Sec. 6.3 ablation)."""

    def __init__(self, alpha: float):
        super().__init__()
        self.register_buffer("value", torch.tensor(float(alpha)))

    def alpha(self, states: torch.Tensor, sample_actions: SampleFn, q_pair: QPairFn) -> torch.Tensor:
        """[B] constant."""
        return self.value.expand(states.shape[0])

    def loss(self, log_prob: torch.Tensor) -> torch.Tensor:
        """Nothing to learn: 0."""
        return torch.zeros((), device=log_prob.device)

    def floor(self) -> torch.Tensor:
        """The scalar alpha."""
        return self.value


class TargetEntropyTemperature(nn.Module):
    """SAC's learned scalar alpha_TE (paper Eq. 1) with H_target = -action_dim."""

    def __init__(self, action_dim: int, init_alpha: float):
        super().__init__()
        self.log_alpha = nn.Parameter(torch.tensor(float(init_alpha)).log())
        self.target_entropy = -float(action_dim)

    def floor(self) -> torch.Tensor:
        """alpha_TE, detached scalar."""
        return self.log_alpha.detach().exp()

    def alpha(self, states: torch.Tensor, sample_actions: SampleFn, q_pair: QPairFn) -> torch.Tensor:
        """[B] copies of alpha_TE."""
        return self.floor().expand(states.shape[0])

    def loss(self, log_prob: torch.Tensor) -> torch.Tensor:
        """-(log_alpha (log pi + H_target)).mean(); log_prob is detached here."""
        return -(self.log_alpha * (log_prob.detach() + self.target_entropy)).mean()


class QEDTemperature(nn.Module):
    """Q-value Expectile Disagreement (paper Sec. 5.1).

    alpha(s) = clip(expectile_tau(|Q1(s,a_i) - Q2(s,a_i)|, a_i ~ pi(.|s)) / (k * action_dim), alpha_TE, alpha_max).
    alpha_TE keeps training as in SAC and is the floor; if alpha_TE ever exceeds alpha_max the floor wins,
    so QED never runs colder than plain target-entropy SAC ("QED reduces to SAC with regular entropy tuning").
    """

    def __init__(self, action_dim: int, spec: TemperatureSpec):
        super().__init__()
        self.te = TargetEntropyTemperature(action_dim, spec.init_alpha)
        self.scale = 1.0 / (spec.k * action_dim)
        self.n_actions = spec.n_actions
        self.tau = spec.tau
        self.alpha_max = spec.alpha_max

    def floor(self) -> torch.Tensor:
        """alpha_TE."""
        return self.te.floor()

    @torch.no_grad()
    def disagreement(self, states: torch.Tensor, sample_actions: SampleFn, q_pair: QPairFn) -> torch.Tensor:
        """Delta(s) [B]: the tau-expectile of |Q1 - Q2| over n_actions policy samples per state."""
        b = states.shape[0]
        rep = states.repeat_interleave(self.n_actions, dim=0)  # batched: one critic call for all N samples
        q1, q2 = q_pair(rep, sample_actions(rep))
        return expectile((q1 - q2).abs().view(b, self.n_actions), self.tau)

    @torch.no_grad()
    def alpha(self, states: torch.Tensor, sample_actions: SampleFn, q_pair: QPairFn) -> torch.Tensor:
        """[B] state-dependent alpha, no gradient to critics or actor."""
        raw = self.disagreement(states, sample_actions, q_pair) * self.scale
        return torch.maximum(raw.clamp(max=self.alpha_max), self.floor())

    def loss(self, log_prob: torch.Tensor) -> torch.Tensor:
        """The alpha_TE loss (the floor keeps training as usual)."""
        return self.te.loss(log_prob)


def make_temperature(spec: TemperatureSpec, action_dim: int) -> nn.Module:
    """Builds the rule named by ``spec.kind``."""
    if spec.kind == "fixed":
        return FixedTemperature(spec.alpha)
    if spec.kind == "te":
        return TargetEntropyTemperature(action_dim, spec.init_alpha)
    return QEDTemperature(action_dim, spec)


def alpha_stats(alpha: torch.Tensor, temperature: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """mean/min/max of a [B] alpha and the fraction of states at the floor and at alpha_max (tensors, no sync)."""
    floor = temperature.floor()
    out = {f"{prefix}_mean": alpha.mean(), f"{prefix}_min": alpha.min(), f"{prefix}_max": alpha.max()}
    if isinstance(temperature, QEDTemperature):
        out[f"{prefix}_frac_floor"] = (alpha <= floor).float().mean()
        out[f"{prefix}_frac_cap"] = (alpha >= temperature.alpha_max).float().mean()
    return out
