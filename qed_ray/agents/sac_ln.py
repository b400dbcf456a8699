"""SAC-LN: soft actor-critic with LayerNorm twin critics (paper Sec. 5.2, App. B; DESIGN.md §3).

The update is a function of (modules, optimisers, batch, generator) with no host syncs: metrics come back as
0-d tensors and the trainer reads them at report time (DESIGN.md §5, compiled updates).
"""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import torch

from qed_ray.agents import agent_state, load_agent_state
from qed_ray.config import AgentSpec, TemperatureSpec
from qed_ray.networks import TanhGaussianActor, TwinCritic, clip_and_step, freeze, polyak_update
from qed_ray.temperature import alpha_stats, make_temperature


@contextlib.contextmanager
def seeded_init(seed: int):
    """Context in which module construction draws from ``seed`` without touching the global torch RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class SACLN:
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
        self.spec, self.device, self.action_dim = spec, device, action_dim
        with seeded_init(seed):
            self.actor = TanhGaussianActor(obs_dim, action_dim, spec.hidden, spec.depth, spec.activation,
                                           spec.log_std_min, spec.log_std_max).to(device)
            self.critic = TwinCritic(obs_dim, action_dim, spec.hidden, spec.depth, spec.activation).to(device)
        self.critic_target = freeze(copy.deepcopy(self.critic))
        self.temperature = make_temperature(temperature, action_dim).to(device)
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=spec.actor_lr)
        self.critic_opt = torch.optim.Adam(self.critic.parameters(), lr=spec.critic_lr)
        t_params = [p for p in self.temperature.parameters() if p.requires_grad]
        self.alpha_opt = torch.optim.Adam(t_params, lr=temperature.lr) if t_params else None
        self.generator = torch.Generator(device=device).manual_seed(seed)

    # ---- acting ----------------------------------------------------------------------------------
    def sample_actions(self, obs: torch.Tensor) -> torch.Tensor:
        """Policy samples for QED's disagreement estimate (no grad)."""
        return self.actor.sample(obs, self.generator)[0]

    @torch.no_grad()
    def act(self, obs: np.ndarray, deterministic: bool) -> np.ndarray:
        """One action in [-1, 1]^A for a single observation: tanh(mu) if deterministic, else a policy sample."""
        x = torch.as_tensor(obs, dtype=torch.float32, device=self.device).unsqueeze(0)
        a = self.actor.mode(x) if deterministic else self.actor.sample(x, self.generator)[0]
        return a.squeeze(0).cpu().numpy()

    @torch.no_grad()
    def act_batch(self, obs: np.ndarray) -> np.ndarray:
        """Deterministic actions for a batch of observations [B, O] -> [B, A]."""
        x = torch.as_tensor(obs, dtype=torch.float32, device=self.device)
        return self.actor.mode(x).cpu().numpy()

    @torch.no_grad()
    def policy_distribution(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Pre-tanh ``(mu, sigma)`` [B, A] at observations [B, O] (float64 numpy, for metrics)."""
        x = torch.as_tensor(obs, dtype=torch.float32, device=self.device)
        mu, sigma = self.actor.distribution(x)
        return mu.double().cpu().numpy(), sigma.double().cpu().numpy()

    @torch.no_grad()
    def q_values(self, obs: np.ndarray, action: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Online ``(Q1, Q2)`` [B] at (obs, action) (critic-proxy analysis, paper App. A)."""
        x = torch.as_tensor(obs, dtype=torch.float32, device=self.device)
        a = torch.as_tensor(action, dtype=torch.float32, device=self.device)
        q1, q2 = self.critic(x, a)
        return q1.cpu().numpy(), q2.cpu().numpy()

    # ---- learning --------------------------------------------------------------------------------
    def update(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One critic, actor, temperature and Polyak step; returns detached 0-d metric tensors."""
        obs, act, rew, nxt = batch["obs"], batch["action"], batch["reward"], batch["next_obs"]
        discount = self.spec.gamma * (1.0 - batch["terminated"])
        gen = self.generator
        with torch.no_grad():
            next_a, next_logp = self.actor.sample(nxt, gen)
            tq1, tq2 = self.critic_target(nxt, next_a)
            # alpha(s') comes from the critics that produce the target value (DESIGN.md §3).
            next_alpha = self.temperature.alpha(nxt, self.sample_actions, self.critic_target)
            target = rew + discount * (torch.minimum(tq1, tq2) - next_alpha * next_logp)
        q1, q2 = self.critic(obs, act)
        critic_loss = 0.5 * ((q1 - target).pow(2).mean() + (q2 - target).pow(2).mean())
        critic_norm = clip_and_step(self.critic_opt, self.critic.parameters(), critic_loss, self.spec.grad_clip)

        self.critic.requires_grad_(False)  # the actor loss must not leave gradients on the critics
        a, logp = self.actor.sample(obs, gen)
        pq1, pq2 = self.critic(obs, a)
        alpha = self.temperature.alpha(obs, self.sample_actions, self.critic)  # online critics for the actor
        actor_loss = (alpha * logp - torch.minimum(pq1, pq2)).mean()
        actor_norm = clip_and_step(self.actor_opt, self.actor.parameters(), actor_loss, self.spec.grad_clip)
        self.critic.requires_grad_(True)

        alpha_loss = self.temperature.loss(logp)
        if self.alpha_opt is not None:
            self.alpha_opt.zero_grad(set_to_none=True)
            alpha_loss.backward()
            self.alpha_opt.step()
        polyak_update(self.critic_target, self.critic, self.spec.polyak)

        gap = (q1 - q2).detach().abs()
        return {
            "loss/critic": critic_loss.detach(), "loss/actor": actor_loss.detach(), "loss/alpha": alpha_loss.detach(),
            "grad/critic_norm": critic_norm, "grad/actor_norm": actor_norm,
            "policy/entropy": -logp.detach().mean(), "q/mean": q1.detach().mean(),
            "q/abs_diff_mean": gap.mean(), "q/abs_diff_max": gap.max(), "q/target_mean": target.mean(),
            "alpha/te": self.temperature.floor(),
            **alpha_stats(alpha, self.temperature, "alpha/actor"),
            **alpha_stats(next_alpha, self.temperature, "alpha/target"),
        }

    # ---- state -----------------------------------------------------------------------------------
    def modules(self) -> dict[str, torch.nn.Module]:
        """Every module whose parameters or buffers define the agent."""
        return {"actor": self.actor, "critic": self.critic, "critic_target": self.critic_target,
                "temperature": self.temperature}

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """Every optimiser."""
        opts = {"actor_opt": self.actor_opt, "critic_opt": self.critic_opt}
        if self.alpha_opt is not None:
            opts["alpha_opt"] = self.alpha_opt
        return opts

    def state_dict(self) -> dict:
        """Tensors only (loadable with ``weights_only=True``)."""
        return agent_state(self)

    def load_state_dict(self, state: dict) -> None:
        """Inverse of :meth:`state_dict`; raises KeyError naming a missing part."""
        load_agent_state(self, state)
