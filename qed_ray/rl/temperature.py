"""Temperature rules behind one pure interface (paper Sec. 2 Eq. 1 and Sec. 5.1).

A rule is a small module that owns its state (``log_alpha`` or a constant), but every method takes that state
explicitly as a dict (``state = temperature_state(rule)``), so the same code serves a single agent (the live
parameters) and a stack of seeds (stacked parameters under ``torch.func.vmap``): ``floor(state)`` is the scalar
alpha_TE (or the constant), ``alpha(state, batch, disagreement)`` the [B] temperatures (only QED, ``n_actions`` > 0,
reads ``disagreement``), ``loss(state, log_prob)`` the loss of the rule's trainable part, and ``n_target_actions``
QED's samples per next state for the TD target's alpha(s') (0: the target uses the floor).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from qed_ray.spec.config import HOT_RATIO, TemperatureSpec

PolicyFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # states [B, D] -> (mu, log_std) [B, A]
# (states [B, D], actions [B * repeats, A], repeats) -> (q1, q2) [B * repeats]
QPairFn = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
State = dict[str, torch.Tensor]


def expectile(x: torch.Tensor, tau: float) -> torch.Tensor:
    """Exact tau-expectile along the last axis (docs/definitions.md, "Expectile"): x [..., N] -> [...].

    With the samples sorted, each split position j (j samples below m) gives a closed-form candidate; exactly the
    one inside its own bracket [x_(j-1), x_(j)] is the expectile (the objective is strictly convex). When the
    expectile is itself a sample, it is the candidate of both brackets that meet there, and rounding may put both a
    hair outside; so the candidate nearest to its bracket is taken (distance 0 for the exact one), clamped into it.
    No iteration, no data-dependent control flow (compile- and vmap-friendly).
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
    # Distance of each candidate outside its bracket (0 inside); argmin takes the first of equals.
    outside = (lo - cand).clamp(min=0) + (cand - hi).clamp(min=0)
    best = outside.argmin(dim=-1, keepdim=True)
    return torch.clamp(cand.gather(-1, best), lo.gather(-1, best), hi.gather(-1, best)).squeeze(-1)


@torch.no_grad()
def qed_disagreement(policy: PolicyFn, q_pair: QPairFn, states: torch.Tensor, eps: torch.Tensor, n: int,
                     tau: float, share_state_terms: bool = True,
                     dist: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Delta(s) [B]: the tau-expectile of |Q1(s, a_i) - Q2(s, a_i)| over n policy samples a_i ~ pi(.|s).

    Sample i of state b uses noise row ``b * n + i`` of ``eps`` [B * n, A] (state-major). With
    ``share_state_terms`` (the default) the policy runs once per state and ``q_pair`` receives each state once
    with its n actions (``repeats = n``), so per-state work is not repeated n times; without it, states are
    repeated n times first and every network runs on B * n rows (the straightforward formula, kept as the
    reference the rewrite is tested and benchmarked against). Both give the same Delta up to float rounding.
    ``dist``: the policy's ``(mu, log_std)`` [B, A] at ``states`` when the caller has computed it already (for its
    own sample), so the actor does not run twice.
    """
    b = states.shape[0]
    if share_state_terms:
        mu, log_std = policy(states) if dist is None else dist
        u = mu.repeat_interleave(n, dim=0) + log_std.exp().repeat_interleave(n, dim=0) * eps
        q1, q2 = q_pair(states, torch.tanh(u), n)
    else:
        rep = states.repeat_interleave(n, dim=0)
        mu, log_std = policy(rep)
        q1, q2 = q_pair(rep, torch.tanh(mu + log_std.exp() * eps), 1)
    return expectile((q1 - q2).abs().reshape(b, n), tau)


def temperature_state(rule: nn.Module) -> State:
    """The rule's parameters and buffers by name (the live tensors: gradients reach ``log_alpha``)."""
    return {**dict(rule.named_parameters()), **dict(rule.named_buffers())}


class FixedTemperature(nn.Module):
    """A constant alpha (paper Sec. 6.3 ablation)."""

    n_actions = n_target_actions = 0

    def __init__(self, alpha: float):
        super().__init__()
        self.register_buffer("value", torch.tensor(float(alpha)))

    def floor(self, state: State) -> torch.Tensor:
        return state["value"]

    def alpha(self, state: State, batch: int, disagreement: torch.Tensor | None = None) -> torch.Tensor:
        return self.floor(state).expand(batch)

    def loss(self, state: State, log_prob: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(log_prob).sum()


class TargetEntropyTemperature(nn.Module):
    """SAC's learned scalar alpha_TE (paper Eq. 1) with H_target = -action_dim."""

    n_actions = n_target_actions = 0

    def __init__(self, action_dim: int, init_alpha: float):
        super().__init__()
        self.log_alpha = nn.Parameter(torch.tensor(float(init_alpha)).log())
        self.target_entropy = -float(action_dim)

    def floor(self, state: State) -> torch.Tensor:
        """alpha_TE, detached."""
        return state["log_alpha"].detach().exp()

    def alpha(self, state: State, batch: int, disagreement: torch.Tensor | None = None) -> torch.Tensor:
        return self.floor(state).expand(batch)

    def loss(self, state: State, log_prob: torch.Tensor) -> torch.Tensor:
        """-(log_alpha (log pi + H_target)).mean(); log_prob is detached here."""
        return -(state["log_alpha"] * (log_prob.detach() + self.target_entropy)).mean()


class QEDTemperature(TargetEntropyTemperature):
    """Q-value Expectile Disagreement (paper Sec. 5.1; docs/definitions.md, "Clip and floor" and "Where alpha(s) is
    used"): alpha(s) = clip(expectile_tau(|Q1(s,a_i) - Q2(s,a_i)|, a_i ~ pi(.|s)) / (k * action_dim), alpha_TE,
    alpha_max), the floor applied last, so QED never runs colder than plain target-entropy SAC."""

    def __init__(self, action_dim: int, spec: TemperatureSpec):
        super().__init__(action_dim, spec.init_alpha)
        # 1 / (k d) and alpha_max are read from the rule's state, so that the members of a pack may differ in them
        # (one per member, [S] under vmap). Not persistent: the run spec gives them, and a checkpoint's layout stays.
        self.register_buffer("scale", torch.tensor(1.0 / (spec.k * action_dim)), persistent=False)
        self.register_buffer("alpha_max", torch.tensor(float(spec.alpha_max)), persistent=False)
        self.n_actions = spec.n_actions
        self.n_target_actions = spec.n_actions if spec.target_alpha == "qed" else 0
        self.tau = spec.tau

    @torch.no_grad()
    def alpha(self, state: State, batch: int, disagreement: torch.Tensor | None = None) -> torch.Tensor:
        """[B] state-dependent alpha from Delta(s) [B] (:func:`qed_disagreement`); no gradient anywhere."""
        if disagreement is None:
            raise ValueError("QEDTemperature.alpha: needs the disagreement Delta(s) [B]")
        return torch.maximum(torch.clamp(disagreement * state["scale"], max=state["alpha_max"]), self.floor(state))


def make_temperature(spec: TemperatureSpec, action_dim: int) -> nn.Module:
    if spec.kind == "fixed":
        return FixedTemperature(spec.alpha)
    if spec.kind == "te":
        return TargetEntropyTemperature(action_dim, spec.init_alpha)
    return QEDTemperature(action_dim, spec)


def alpha_stat_names(rule: nn.Module, prefix: str) -> tuple[str, ...]:
    """Names of :func:`alpha_stats`' entries, in order."""
    names = (f"{prefix}_mean", f"{prefix}_min", f"{prefix}_max")
    if isinstance(rule, QEDTemperature):
        names += (f"{prefix}_frac_floor", f"{prefix}_frac_cap", f"{prefix}_frac_hot")
    return names


def alpha_stats(alpha: torch.Tensor, rule: nn.Module, state: State) -> list[torch.Tensor]:
    """0-d mean/min/max of a [B] alpha and, for QED, the fractions of states at the floor, at alpha_max and at
    least :data:`HOT_RATIO` times the floor. ``state`` must be the one ``alpha`` was computed from (before a
    temperature step moves alpha_TE): at the floor alpha *is* that alpha_TE, so ``<=`` is exact there."""
    out = [alpha.mean(), alpha.min(), alpha.max()]
    if isinstance(rule, QEDTemperature):
        floor = rule.floor(state)
        out += [(alpha <= floor).to(alpha.dtype).mean(), (alpha >= state["alpha_max"]).to(alpha.dtype).mean(),
                (alpha >= HOT_RATIO * floor).to(alpha.dtype).mean()]
    return out
