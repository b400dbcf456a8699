"""SAC-LN: soft actor-critic with LayerNorm twin critics (paper Sec. 5.2, App. B), their heads scalar or HL-Gauss
(``agent.critic``, docs/definitions.md); QED and the TD target read the heads' expected values either way."""

from __future__ import annotations

import torch

from qed_ray.rl.agents.base import Learner, Params, SACBase, SACFunctions, seeded_init
from qed_ray.spec.config import AgentSpec, TemperatureSpec
from qed_ray.rl.hlgauss import HLGauss, cross_entropy
from qed_ray.rl.networks import TanhGaussianActor, TwinCritic, squashed_sample
from qed_ray.rl.temperature import alpha_stats
from qed_ray.rl.world_model import HLGaussCritic

CRITIC_METRICS = ("loss/critic", "q/mean", "q/abs_diff_mean", "q/abs_diff_max", "q/target_mean")
HL_METRICS = ("q/target_clip_frac",)  # HL-Gauss heads only: share of TD targets outside the support


class SACLNFunctions(SACFunctions):
    """SAC-LN's pure losses (the actor loss is :meth:`SACFunctions.actor_loss`)."""

    def __init__(self, actor, critic, temperature, gamma: float):
        super().__init__(actor, critic, temperature)
        self.gamma = gamma
        self.hl: HLGauss | None = getattr(critic, "hl", None)  # HL-Gauss heads (agent.critic: hlgauss) or None

    def noise_sizes(self, b: int) -> tuple[int, int, int, int]:
        """Rows of the noise block's parts for batch size b: next action, QED(s'), action, QED(s) (N' = N, or 0 with
        ``temperature.target_alpha: floor``)."""
        return b, b * self.n_qed_target, b, b * self.n_qed

    def q_pair(self, critic_p: Params, states: torch.Tensor, actions: torch.Tensor, repeats: int = 1
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Q1, Q2)`` [B * repeats]: the scalar heads' outputs, or the HL-Gauss heads' expected values."""
        q1, q2 = super().q_pair(critic_p, states, actions, repeats)
        if self.hl is None:
            return q1, q2
        return self.hl.decode(q1), self.hl.decode(q2)

    def td_loss(self, critic_p: Params, obs: torch.Tensor, act: torch.Tensor, target: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(loss 0-d, Q1 [B], Q2 [B])`` against ``target`` [B]. Scalar heads: 0.5 * sum_j mean (Q_j(s, a) - y)^2;
        HL-Gauss heads: each head's cross-entropy against the histogram of y, mean over bins and batch, heads summed
        (MAD-TD's reduction, as MAD-SAC's critic)."""
        if self.hl is None:
            q1, q2 = self.q_pair(critic_p, obs, act)
            return 0.5 * ((q1 - target).pow(2).mean() + (q2 - target).pow(2).mean()), q1, q2
        l1, l2 = super().q_pair(critic_p, obs, act)
        probs = self.hl.encode(target)
        loss = cross_entropy(l1, probs).mean() + cross_entropy(l2, probs).mean()
        return loss, self.hl.decode(l1), self.hl.decode(l2)

    def critic_loss(self, params: dict[str, Params], target_p: Params, batch: dict[str, torch.Tensor],
                    eps_next: torch.Tensor, eps_qed_next: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Twin-critic TD loss (:meth:`td_loss`) against the soft target
        y = r + gamma (1 - d) (min_j Qtarg_j(s', a') - alpha(s') log pi(a'|s')), a' ~ pi(.|s') (paper Eq. 1);
        alpha(s') is read from the target critics, which produce the target value (or is alpha_TE, see
        :meth:`SACFunctions.target_alpha`). Only the critic gets gradient. ``(loss 0-d, metrics)``:
        :data:`CRITIC_METRICS`, :data:`HL_METRICS` (HL-Gauss heads only), then the alpha/target statistics."""
        obs, act, rew, nxt = batch["obs"], batch["action"], batch["reward"], batch["next_obs"]
        actor_p, tstate = params["actor"], params["temperature"]
        with torch.no_grad():
            dist = self.policy(actor_p, nxt)
            next_a, next_logp = squashed_sample(*dist, eps_next)
            tq1, tq2 = self.q_pair(target_p, nxt, next_a)
            next_alpha = self.target_alpha(tstate, actor_p, target_p, nxt, eps_qed_next, dist=dist)
            target = rew + self.gamma * (1.0 - batch["terminated"]) * (torch.minimum(tq1, tq2)
                                                                        - next_alpha * next_logp)
        loss, q1, q2 = self.td_loss(params["critic"], obs, act, target)
        gap = (q1 - q2).detach().abs()
        metrics = [loss.detach(), q1.detach().mean(), gap.mean(), gap.max(), target.mean()]
        if self.hl is not None:
            metrics.append(self.hl.clip_fraction(target).to(target.dtype))
        metrics += alpha_stats(next_alpha, self.temperature, tstate)
        return loss, torch.stack(metrics)


def make_critic(spec: AgentSpec, obs_dim: int, action_dim: int) -> torch.nn.Module:
    """SAC-LN's twin critic: ``critic_layers`` LayerNorm blocks per head, then a scalar (``mse``) or HL-Gauss
    (``hlgauss``, on ``spec.hl``'s support, with MAD-TD's zero prior) output layer."""
    if spec.critic == "mse":
        return TwinCritic(obs_dim, action_dim, spec.hidden, spec.critic_layers, spec.activation)
    hl = HLGauss(spec.hl.vmin, spec.hl.vmax, spec.hl.num_bins, spec.hl.sigma_ratio)
    return HLGaussCritic(obs_dim, action_dim, spec.hidden, spec.critic_layers, spec.activation, hl)


class SACLN(SACBase):
    """Actor, twin critics, target critics, temperature and their optimisers; ``seed`` seeds initialisation and the
    agent's own sampling generator."""

    name = "sac_ln"
    acting_modules = ("actor",)  # what an intermediate policy snapshot needs (acting and the KL metric)

    def __init__(self, spec: AgentSpec, temperature: TemperatureSpec, obs_dim: int, action_dim: int,
                 device: torch.device, seed: int):
        super().__init__(spec, action_dim, device)
        with seeded_init(seed):
            actor = TanhGaussianActor(obs_dim, action_dim, spec.hidden, spec.depth, spec.activation,
                                      spec.log_std_min, spec.log_std_max).to(self.device)
            critic = make_critic(spec, obs_dim, action_dim).to(self.device)
        self._init_sac(actor, critic, temperature, seed)
        self.fn = SACLNFunctions(self.actor, self.critic, self.temperature, spec.gamma)
        hl_metrics = HL_METRICS if self.fn.hl is not None else ()
        self.metric_layout = self.layout((*CRITIC_METRICS, *hl_metrics))

    def learn(self, x: Learner, batch: dict[str, torch.Tensor], noise: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """One critic, actor, temperature and Polyak step on the learner's parameters; the metric vector [K] ([S, K]
        in a pack), columns named by :attr:`metric_layout`."""
        eps_next, eps_qed_next, eps_a, eps_qed = noise
        p = x.params()
        critic_loss, critic_metrics = x.per_seed(self.fn.critic_loss)(p, x.target_params(), batch, eps_next,
                                                                      eps_qed_next)
        # The actor reads the critics just updated (as in SAC), through detached parameters.
        steps = self.sac_steps(x, critic_loss, p, p["critic"], batch["obs"], eps_a, eps_qed)
        return torch.cat([critic_metrics, steps], -1)
