"""MAD-SAC: MaxEnt MAD-TD without MPC (paper Sec. 5.2, App. B; DESIGN.md §3; ``research/mad_td.md`` §2, §5.3).

A SimNorm encoder, a one-step latent model (dynamics + reward) and two HL-Gauss critic heads. Each critic batch
mixes real transitions with one-step model transitions from the same real start states under policy actions
(``proportion_real`` real rows first). The actor is SAC-LN's tanh-Gaussian on the detached latent, and the
temperatures are the same rules as SAC-LN's. The interface is exactly :class:`qed_ray.agents.sac_ln.SACLN`'s.

The update is free of host syncs and of data-dependent Python control flow apart from the ``model_every``
counter check, so it stays capturable (DESIGN.md §5).
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from qed_ray.agents import agent_state, load_agent_state
from qed_ray.agents.sac_ln import seeded_init
from qed_ray.config import AgentSpec, TemperatureSpec
from qed_ray.hlgauss import HLGauss, cross_entropy
from qed_ray.networks import TanhGaussianActor, clip_and_step, freeze, polyak_update
from qed_ray.temperature import alpha_stats, make_temperature
from qed_ray.world_model import Dynamics, Encoder, HLGaussCritic, RewardHead

# Self-prediction targets are smoothed towards uniform so log(0) never meets a 0 target weight's gradient
# (research note §1.6 term 2: 0.9999 * z' + 0.0001 / group).
LATENT_TARGET_SMOOTHING = 1e-4
MODEL_METRIC_KEYS = ("loss/model_reward", "loss/model_latent_ce", "loss/model_value_aware",
                     "loss/model_encoder_critic", "grad/encoder_norm", "grad/model_norm")


def split_sizes(batch_size: int, proportion_real: float) -> tuple[int, int]:
    """Rows ``(n_real, n_model)`` of a critic batch: n_real = int(B * proportion_real) (research note §1.7).

    Args:
        batch_size: B, the rows sampled from replay.
        proportion_real: share of real rows in (0, 1].

    Returns:
        ``(n_real, B - n_real)``: 256/256 for B=512 at 0.5, 486/26 at 0.95.
    """
    if not 0.0 < proportion_real <= 1.0:
        raise ValueError(f"agent.mad.proportion_real: {proportion_real} is outside (0, 1]")
    n_real = int(batch_size * proportion_real)
    if n_real < 1:
        raise ValueError(f"agent.mad.proportion_real: {proportion_real} x agent.batch_size {batch_size} leaves "
                         f"no real row; need proportion_real >= 1 / batch_size")
    return n_real, batch_size - n_real


class MadSAC:
    """Encoder, latent model, HL-Gauss twin critic (+ target), actor, temperature and their optimisers.

    Args:
        spec: agent hyper-parameters (MAD-specific ones under ``spec.mad``).
        temperature: temperature rule.
        obs_dim: observation size (from the env).
        action_dim: action size (from the env).
        device: where modules live.
        seed: seeds initialisation and the agent's own sampling generator.
    """

    name = "mad_sac"
    acting_modules = ("encoder", "actor")  # what an intermediate policy snapshot needs

    def __init__(self, spec: AgentSpec, temperature: TemperatureSpec, obs_dim: int, action_dim: int,
                 device: torch.device, seed: int):
        self.spec, self.mad, self.device, self.action_dim = spec, spec.mad, device, action_dim
        split_sizes(spec.batch_size, spec.mad.proportion_real)  # fail at construction, not at the first update
        m, act = spec.mad, spec.activation
        with seeded_init(seed):
            self.encoder = Encoder(obs_dim, m.encoder_hidden, m.latent_dim, m.simnorm_group, act).to(device)
            self.dynamics = Dynamics(m.latent_dim, action_dim, m.model_hidden, spec.depth, m.simnorm_group,
                                     act).to(device)
            self.reward = RewardHead(m.latent_dim, action_dim, m.model_hidden, spec.depth, act).to(device)
            hl = HLGauss(m.vmin, m.vmax, m.num_bins, m.sigma_ratio)
            self.critic = HLGaussCritic(m.latent_dim, action_dim, spec.hidden, spec.depth, act, hl).to(device)
            self.actor = TanhGaussianActor(m.latent_dim, action_dim, spec.hidden, spec.depth, act,
                                           spec.log_std_min, spec.log_std_max).to(device)
        self.hl = self.critic.hl
        self.critic_target = freeze(copy.deepcopy(self.critic))
        self.temperature = make_temperature(temperature, action_dim).to(device)
        self.encoder_opt = torch.optim.Adam(self.encoder.parameters(), lr=m.encoder_lr)
        self.model_opt = torch.optim.Adam(self._model_params(), lr=m.model_lr)
        self.critic_opt = torch.optim.Adam(self.critic.parameters(), lr=spec.critic_lr)
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=spec.actor_lr)
        t_params = [p for p in self.temperature.parameters() if p.requires_grad]
        self.alpha_opt = torch.optim.Adam(t_params, lr=temperature.lr) if t_params else None
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.updates = 0  # update() calls so far: drives model_every, checkpointed as a tensor
        self._model_metrics = {k: torch.zeros((), device=device) for k in MODEL_METRIC_KEYS}

    def _model_params(self) -> list[torch.nn.Parameter]:
        return [*self.dynamics.parameters(), *self.reward.parameters()]

    # ---- acting ----------------------------------------------------------------------------------
    def sample_actions(self, z: torch.Tensor) -> torch.Tensor:
        """Policy samples [B, A] at latents z [B, L] (QED's disagreement estimate; no grad needed)."""
        return self.actor.sample(z, self.generator)[0]

    def _encode_np(self, obs: np.ndarray) -> torch.Tensor:
        return self.encoder(torch.as_tensor(obs, dtype=torch.float32, device=self.device))

    @torch.no_grad()
    def act(self, obs: np.ndarray, deterministic: bool) -> np.ndarray:
        """One action in [-1, 1]^A for an observation [O]: tanh(mu) if deterministic, else a policy sample."""
        z = self._encode_np(obs).unsqueeze(0)
        a = self.actor.mode(z) if deterministic else self.actor.sample(z, self.generator)[0]
        return a.squeeze(0).cpu().numpy()

    @torch.no_grad()
    def act_batch(self, obs: np.ndarray) -> np.ndarray:
        """Deterministic actions tanh(mu(enc(obs))) for observations [B, O] -> [B, A]."""
        return self.actor.mode(self._encode_np(obs)).cpu().numpy()

    @torch.no_grad()
    def policy_distribution(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Pre-tanh ``(mu, sigma)`` [B, A] at observations [B, O] (float64 numpy, for the KL metric)."""
        mu, sigma = self.actor.distribution(self._encode_np(obs))
        return mu.double().cpu().numpy(), sigma.double().cpu().numpy()

    @torch.no_grad()
    def q_values(self, obs: np.ndarray, action: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Online expected ``(Q1, Q2)`` [B] at (enc(obs) [B, O], action [B, A]) (critic proxy, paper App. A)."""
        a = torch.as_tensor(action, dtype=torch.float32, device=self.device)
        q1, q2 = self.critic(self._encode_np(obs), a)
        return q1.cpu().numpy(), q2.cpu().numpy()

    # ---- targets and batches -----------------------------------------------------------------------
    @torch.no_grad()
    def soft_target(self, z_next: torch.Tensor, reward: torch.Tensor, discount: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MaxEnt TD target y = r + discount (min_j E[Qtarg_j](z', a') - alpha(z') log pi(a'|z')), a' ~ pi.

        alpha(z') comes from the target critic, which produces the target value (DESIGN.md §3).

        Args:
            z_next: [B, L] next latents.
            reward: [B].
            discount: [B] gamma (1 - terminated).

        Returns:
            ``(y [B], alpha(z') [B])``.
        """
        a, logp = self.actor.sample(z_next, self.generator)
        tq1, tq2 = self.critic_target(z_next, a)
        alpha = self.temperature.alpha(z_next, self.sample_actions, self.critic_target)
        return reward + discount * (torch.minimum(tq1, tq2) - alpha * logp), alpha

    def critic_ce(self, l1: torch.Tensor, l2: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """HL-Gauss loss of both heads (logits [B, bins]) against scalar targets y [B]: head1 + head2, 0-d.

        Mean over bins and batch per head, heads summed: MAD's reduction (research note §1.4, M9).
        """
        probs = self.hl.encode(y.detach())
        return cross_entropy(l1, probs).mean() + cross_entropy(l2, probs).mean()

    @torch.no_grad()
    def critic_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The mixed critic batch (research note §5.3 steps 1-3); no gradient anywhere.

        Rows [0, n_real) are replay transitions with z' = enc(s'). Rows [n_real, B) keep only the real start
        state s: a_m ~ pi(.|enc(s)) (the generator's first draw here), and (z'_m, r_m) come from the latent
        model. Model rows inherit the real row's ``terminated`` flag (MAD M6; always 0 on dm_control).

        Args:
            batch: replay batch: obs [B, O], action [B, A], reward [B], next_obs [B, O], terminated [B].

        Returns:
            z [B, L] (enc(s)), a [B, A], y [B] soft targets, is_model [B] bool, next_alpha [B] alpha(z'),
            reward_mse 0-d (reward head on the real rows, a model-quality diagnostic).
        """
        obs, act, rew = batch["obs"], batch["action"], batch["reward"]
        b = obs.shape[0]
        n_real, _ = split_sizes(b, self.mad.proportion_real)
        # One encoder call for s (all rows) and s' (real rows only: the model rows' s' is discarded).
        z_all = self.encoder(torch.cat([obs, batch["next_obs"][:n_real]]))
        z = z_all[:b]
        a_m = self.actor.sample(z[n_real:], self.generator)[0]
        z_next = torch.cat([z_all[b:], self.dynamics(z[n_real:], a_m)[0]])
        a = torch.cat([act[:n_real], a_m])
        r_pred = self.reward(z, a)  # model rows' r_m, and the real rows' prediction for the diagnostic
        r = torch.cat([rew[:n_real], r_pred[n_real:]])
        y, next_alpha = self.soft_target(z_next, r, self.spec.gamma * (1.0 - batch["terminated"]))
        reward_mse = (r_pred[:n_real] - rew[:n_real]).pow(2).mean()
        is_model = torch.arange(b, device=obs.device) >= n_real
        return {"z": z, "a": a, "y": y, "is_model": is_model, "next_alpha": next_alpha, "reward_mse": reward_mse}

    # ---- learning ----------------------------------------------------------------------------------
    def model_losses(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The four encoder/model losses on real data (research note §1.6 with the MaxEnt changes of §2.7).

        Gradients reach only encoder, dynamics and reward head: the target critic is frozen, the online critic
        is frozen by the caller, actions a* = tanh(mu(z')) and soft targets are computed without grad. The
        "target encoder" is the online encoder under no_grad: MAD re-syncs it after every model step (tau 0,
        M3), and the encoder changes only in model steps, so the two are always equal.

        Returns:
            0-d losses: loss/model_reward (MSE), loss/model_latent_ce (self-prediction, mean over latent dims),
            loss/model_value_aware (target-critic CE through the predicted latent), loss/model_encoder_critic.
        """
        obs, act, rew = batch["obs"], batch["action"], batch["reward"]
        b = obs.shape[0]
        z = self.encoder(obs)
        with torch.no_grad():
            z_next = self.encoder(batch["next_obs"])
            a_star = self.actor.mode(z_next)  # deterministic: the lowest-variance choice (§2.7)
            y, _ = self.soft_target(z_next, rew, self.spec.gamma * (1.0 - batch["terminated"]))
        pred_next, pred_logp = self.dynamics(z, act)
        smoothed = (1.0 - LATENT_TARGET_SMOOTHING) * z_next + LATENT_TARGET_SMOOTHING / self.mad.simnorm_group
        # One target-critic call for the target (z', a*) and the prediction (predicted z', a*) rows; only the
        # prediction half carries gradient (into dynamics and encoder, the critic itself is frozen).
        v1, v2 = self.critic_target.logits(torch.cat([z_next, pred_next]), torch.cat([a_star, a_star]))
        t1, t2 = v1[:b].detach().softmax(-1), v2[:b].detach().softmax(-1)
        value_aware = 0.5 * (cross_entropy(v1[b:], t1).mean() + cross_entropy(v2[b:], t2).mean())
        l1, l2 = self.critic.logits(z, act)
        return {"loss/model_reward": (self.reward(z, act) - rew).pow(2).mean(),
                "loss/model_latent_ce": -(smoothed * pred_logp).mean(),
                "loss/model_value_aware": value_aware,
                "loss/model_encoder_critic": self.critic_ce(l1, l2, y)}

    def model_step(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One Adam step on encoder (lr encoder_lr) and dynamics + reward (lr model_lr), each clipped at 20.

        Returns:
            detached 0-d metrics: the four model losses and both pre-clip gradient norms.
        """
        self.critic.requires_grad_(False)  # critic-through-encoder trains the encoder only (§1.6 term 4)
        losses = self.model_losses(batch)
        self.encoder_opt.zero_grad(set_to_none=True)
        self.model_opt.zero_grad(set_to_none=True)
        torch.stack(list(losses.values())).sum().backward()
        clip = self.spec.grad_clip
        enc_norm = torch.nn.utils.clip_grad_norm_(self.encoder.parameters(), clip)
        model_norm = torch.nn.utils.clip_grad_norm_(self._model_params(), clip)
        self.encoder_opt.step()
        self.model_opt.step()
        self.critic.requires_grad_(True)
        return {**{k: v.detach() for k, v in losses.items()}, "grad/encoder_norm": enc_norm,
                "grad/model_norm": model_norm}

    def actor_step(self, z: torch.Tensor) -> dict[str, torch.Tensor]:
        """SAC actor and temperature steps on detached real latents z [n_real, L] (§2.5-2.6).

        The actor maximises the critic named by ``agent.mad.actor_critic`` (online by default, as in SAC-LN);
        alpha(s) is read from that same critic.
        """
        q_net = self.critic if self.mad.actor_critic == "online" else self.critic_target
        self.critic.requires_grad_(False)  # the actor loss must not leave gradients on the critic
        a, logp = self.actor.sample(z, self.generator)
        q1, q2 = q_net(z, a)
        alpha = self.temperature.alpha(z, self.sample_actions, q_net)
        actor_loss = (alpha * logp - torch.minimum(q1, q2)).mean()
        actor_norm = clip_and_step(self.actor_opt, self.actor.parameters(), actor_loss, self.spec.grad_clip)
        self.critic.requires_grad_(True)
        alpha_loss = self.temperature.loss(logp)
        if self.alpha_opt is not None:
            self.alpha_opt.zero_grad(set_to_none=True)
            alpha_loss.backward()
            self.alpha_opt.step()
        return {"loss/actor": actor_loss.detach(), "loss/alpha": alpha_loss.detach(), "grad/actor_norm": actor_norm,
                "policy/entropy": -logp.detach().mean(), **alpha_stats(alpha, self.temperature, "alpha/actor")}

    def update(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """(0) model step every ``model_every``-th call, (1) mixed critic step, (2) actor + temperature on real
        rows, (3) Polyak on the target critic (research note §5.3).

        Args:
            batch: replay batch: obs [B, O], action [B, A], reward [B], next_obs [B, O], terminated [B].

        Returns:
            detached 0-d metric tensors (model metrics are the last model step's when it is skipped).
        """
        if self.updates % self.mad.model_every == 0:
            self._model_metrics = self.model_step(batch)
        self.updates += 1
        cb = self.critic_batch(batch)
        l1, l2 = self.critic.logits(cb["z"], cb["a"])
        critic_loss = self.critic_ce(l1, l2, cb["y"])
        critic_norm = clip_and_step(self.critic_opt, self.critic.parameters(), critic_loss, self.spec.grad_clip)
        n_real, _ = split_sizes(cb["z"].shape[0], self.mad.proportion_real)
        actor_metrics = self.actor_step(cb["z"][:n_real])
        polyak_update(self.critic_target, self.critic, self.spec.polyak)
        return {"loss/critic": critic_loss.detach(), "grad/critic_norm": critic_norm, **actor_metrics,
                **self._q_metrics(l1.detach(), l2.detach(), cb), **self._model_metrics,
                "alpha/te": self.temperature.floor(),
                **alpha_stats(cb["next_alpha"], self.temperature, "alpha/target")}

    def _q_metrics(self, l1: torch.Tensor, l2: torch.Tensor, cb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Q diagnostics per row type; masked means keep an empty model share at 0 instead of NaN."""
        q1, q2 = self.hl.decode(l1), self.hl.decode(l2)
        model = cb["is_model"].float()
        real = 1.0 - model
        gap = (q1 - q2).abs()
        mean_real = (q1 * real).sum() / real.sum()
        return {"q/mean": mean_real, "q/mean_real": mean_real,
                "q/mean_model": (q1 * model).sum() / model.sum().clamp(min=1.0),
                "q/abs_diff_mean": gap.mean(), "q/abs_diff_max": gap.max(),
                "q/target_mean": cb["y"].mean(), "q/target_std": cb["y"].std(),
                "mad/target_clip_frac": self.hl.clip_fraction(cb["y"]), "mad/model_reward_mse": cb["reward_mse"]}

    def report_warnings(self, metrics: dict[str, float]) -> list[str]:
        """Warning lines for an evaluation interval's mean metrics (the trainer logs them).

        Warns when the share of TD targets clipped by the HL-Gauss support exceeds
        ``agent.mad.clip_warn_fraction`` (research note §2.8: large alpha or action dims push soft values out).
        """
        frac = metrics.get("mad/target_clip_frac")
        if frac is None or not frac > self.mad.clip_warn_fraction:
            return []
        return [f"mad/target_clip_frac {frac:.4f} > agent.mad.clip_warn_fraction {self.mad.clip_warn_fraction}: "
                f"TD targets fall outside the HL-Gauss support [{self.mad.vmin:g}, {self.mad.vmax:g}]; widen "
                f"agent.mad.vmin/vmax or lower temperature.alpha_max/init_alpha"]

    # ---- state -----------------------------------------------------------------------------------
    def modules(self) -> dict[str, torch.nn.Module]:
        """Every module whose parameters or buffers define the agent."""
        return {"encoder": self.encoder, "dynamics": self.dynamics, "reward": self.reward, "critic": self.critic,
                "critic_target": self.critic_target, "actor": self.actor, "temperature": self.temperature}

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """Every optimiser."""
        opts = {"encoder_opt": self.encoder_opt, "model_opt": self.model_opt, "critic_opt": self.critic_opt,
                "actor_opt": self.actor_opt}
        if self.alpha_opt is not None:
            opts["alpha_opt"] = self.alpha_opt
        return opts

    def state_dict(self) -> dict:
        """Tensors only (loadable with ``weights_only=True``), incl. the update counter and last model metrics."""
        state = agent_state(self)
        state["updates"] = torch.tensor(self.updates, dtype=torch.int64)
        state["model_metrics"] = {k: v.detach().clone() for k, v in self._model_metrics.items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        """Inverse of :meth:`state_dict`; raises KeyError naming a missing part."""
        load_agent_state(self, state)
        self.updates = int(state["updates"])
        self._model_metrics = {k: v.to(self.device) for k, v in state["model_metrics"].items()}
