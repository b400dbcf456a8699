"""SAC-LN: soft actor-critic with LayerNorm twin critics (paper Sec. 5.2, App. B).

The update is built from pure functions (:class:`SACLNFunctions`) of (parameters, target parameters, temperature
state, batch, noise). One noise block per update, ``[B * (2 + 2N), A]`` from the agent's own generator, is split
as next action | QED(s') | action | QED(s) (N = QED's samples per state, 0 for te and fixed). No host syncs:
the metrics come back as one vector (:attr:`SACLN.metric_layout`) that the trainer reads at report time.
"""

from __future__ import annotations

import torch

from qed_ray.agents.base import Learner, Params, SACBase, SACFunctions, seeded_init
from qed_ray.config import AgentSpec, TemperatureSpec
from qed_ray.networks import TanhGaussianActor, TwinCritic, squashed_sample
from qed_ray.temperature import alpha_stat_names, alpha_stats
from qed_ray.update_metrics import MetricLayout

CRITIC_METRICS = ("loss/critic", "q/mean", "q/abs_diff_mean", "q/abs_diff_max", "q/target_mean")
STEP_METRICS = ("grad/critic_norm", "loss/actor", "grad/actor_norm", "policy/entropy", "loss/alpha", "alpha/te")


class SACLNFunctions(SACFunctions):
    """SAC-LN's pure losses (the actor loss is :meth:`SACFunctions.actor_loss`)."""

    def __init__(self, actor, critic, temperature, gamma: float):
        super().__init__(actor, critic, temperature)
        self.gamma = gamma

    def noise_sizes(self, b: int) -> tuple[int, int, int, int]:
        """Rows of the noise block's parts for batch size b: next action, QED(s'), action, QED(s)."""
        return b, b * self.n_qed, b, b * self.n_qed

    def critic_loss(self, params: dict[str, Params], target_p: Params, batch: dict[str, torch.Tensor],
                    eps_next: torch.Tensor, eps_qed_next: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Twin-critic TD loss 0.5 * sum_j mean (Q_j(s, a) - y)^2 against the soft target
        y = r + gamma (1 - d) (min_j Qtarg_j(s', a') - alpha(s') log pi(a'|s')), a' ~ pi(.|s') (paper Eq. 1).

        alpha(s') is read from the target critics, which produce the target value.

        Args:
            params: ``actor``, ``critic``, ``temperature`` parameters (only the critic gets gradient).
            target_p: target critic parameters.
            batch: obs [B, O], action [B, A], reward [B], next_obs [B, O], terminated [B].
            eps_next: [B, A] noise of a'. eps_qed_next: [B * N, A] noise of QED's samples at s'.

        Returns:
            ``(loss 0-d, metrics [5 + alpha stats])``: :data:`CRITIC_METRICS` then alpha/target statistics.
        """
        obs, act, rew, nxt = batch["obs"], batch["action"], batch["reward"], batch["next_obs"]
        actor_p, tstate = params["actor"], params["temperature"]
        with torch.no_grad():
            dist = self.policy(actor_p, nxt)
            next_a, next_logp = squashed_sample(*dist, eps_next)
            tq1, tq2 = self.q_pair(target_p, nxt, next_a)
            next_alpha = self.alpha(tstate, actor_p, target_p, nxt, eps_qed_next, dist=dist)
            target = rew + self.gamma * (1.0 - batch["terminated"]) * (torch.minimum(tq1, tq2)
                                                                        - next_alpha * next_logp)
        q1, q2 = self.q_pair(params["critic"], obs, act)
        loss = 0.5 * ((q1 - target).pow(2).mean() + (q2 - target).pow(2).mean())
        gap = (q1 - q2).detach().abs()
        metrics = [loss.detach(), q1.detach().mean(), gap.mean(), gap.max(), target.mean(),
                   *alpha_stats(next_alpha, self.temperature, tstate)]
        return loss, torch.stack(metrics)


class SACLN(SACBase):
    """Actor, twin critics, target critics, temperature and their optimisers.

    Args:
        spec: agent hyper-parameters.
        temperature: temperature rule.
        obs_dim: observation size (from the env).
        action_dim: action size (from the env).
        device: where modules live.
        seed: seeds initialisation and the agent's own sampling generator.
    """

    name = "sac_ln"
    acting_modules = ("actor",)  # what an intermediate policy snapshot needs (acting and the KL metric)

    def __init__(self, spec: AgentSpec, temperature: TemperatureSpec, obs_dim: int, action_dim: int,
                 device: torch.device, seed: int):
        super().__init__(spec, action_dim, device)
        with seeded_init(seed):
            actor = TanhGaussianActor(obs_dim, action_dim, spec.hidden, spec.depth, spec.activation,
                                      spec.log_std_min, spec.log_std_max).to(self.device)
            critic = TwinCritic(obs_dim, action_dim, spec.hidden, spec.depth, spec.activation).to(self.device)
        self._init_sac(actor, critic, temperature, seed)
        self.fn = SACLNFunctions(self.actor, self.critic, self.temperature, spec.gamma)
        self.metric_layout = MetricLayout((*CRITIC_METRICS, *alpha_stat_names(self.temperature, "alpha/target"),
                                           *STEP_METRICS, *alpha_stat_names(self.temperature, "alpha/actor")))

    def learn(self, x: Learner, batch: dict[str, torch.Tensor], noise: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """One critic, actor, temperature and Polyak step on the learner's parameters (this agent's, or a pack's).

        Args:
            x: the :class:`~qed_ray.agents.base.Learner` whose parameters move.
            batch: replay batch (see :meth:`SACLNFunctions.critic_loss`; a leading seed axis in a pack).
            noise: the update's noise block split by :meth:`SACLNFunctions.noise_sizes`.

        Returns:
            the metric vector [K] ([S, K] in a pack), detached, columns named by :attr:`metric_layout`.
        """
        eps_next, eps_qed_next, eps_a, eps_qed = noise
        p = x.params()
        critic_loss, critic_metrics = x.per_seed(self.fn.critic_loss)(p, x.target_params(), batch, eps_next,
                                                                      eps_qed_next)
        (critic_norm,) = x.step(critic_loss, ("critic_opt", self.spec.grad_clip))
        # The actor reads the critics just updated (as in SAC), through detached parameters.
        actor_loss, actor_norm, logp, alpha = self.actor_step(x, p["actor"], p["critic"], p["temperature"],
                                                              batch["obs"], eps_a, eps_qed)
        alpha_loss = self.temperature_step(x, p["temperature"], logp)
        x.polyak(self.spec.polyak)
        return torch.cat([critic_metrics, self.step_metrics(x, critic_norm, actor_loss, actor_norm, logp, alpha_loss,
                                                            alpha, p["temperature"])], -1)
