"""MAD-SAC: MaxEnt MAD-TD without MPC (paper Sec. 5.2, App. B): a SimNorm encoder, a one-step latent model and
HL-Gauss critics over critic batches that mix real and model transitions (docs/mad_sac.md)."""

from __future__ import annotations

import torch

from qed_ray.rl.agents.base import Learner, Params, SACBase, SACFunctions, call, detached, seeded_init
from qed_ray.spec.config import AgentSpec, TemperatureSpec
from qed_ray.rl.hlgauss import HLGauss, cross_entropy
from qed_ray.rl.networks import TanhGaussianActor, make_adam, squashed_sample
from qed_ray.rl.temperature import alpha_stats
from qed_ray.rl.world_model import Dynamics, Encoder, HLGaussCritic, RewardHead

# Self-prediction targets are smoothed towards uniform so log(0) never meets a 0 target weight's gradient
# (MAD-TD's model loss: 0.9999 * z' + 0.0001 / group).
LATENT_TARGET_SMOOTHING = 1e-4
MODEL_LOSSES = ("loss/model_reward", "loss/model_latent_ce", "loss/model_value_aware", "loss/model_encoder_critic")
MODEL_METRIC_KEYS = (*MODEL_LOSSES, "grad/encoder_norm", "grad/model_norm")
CRITIC_METRICS = ("loss/critic", "q/mean", "q/mean_real", "q/mean_model", "q/abs_diff_mean", "q/abs_diff_max",
                  "q/target_mean", "q/target_std", "mad/target_clip_frac", "mad/model_reward_mse")


def split_sizes(batch_size: int, proportion_real: float) -> tuple[int, int]:
    """Rows ``(n_real, B - n_real)`` of a critic batch, n_real = int(B * proportion_real) (MAD-TD's batch mixing):
    256/256 for B=512 at 0.5, 486/26 at 0.95."""
    if not 0.0 < proportion_real <= 1.0:
        raise ValueError(f"agent.mad.proportion_real: {proportion_real} is outside (0, 1]")
    n_real = int(batch_size * proportion_real)
    if n_real < 1:
        raise ValueError(f"agent.mad.proportion_real: {proportion_real} x agent.batch_size {batch_size} leaves "
                         f"no real row; need proportion_real >= 1 / batch_size")
    return n_real, batch_size - n_real


class MadFunctions(SACFunctions):
    """MAD-SAC's pure losses over its encoder, latent model, HL-Gauss critic pair, actor and temperature."""

    def __init__(self, encoder, dynamics, reward, actor, critic: HLGaussCritic, temperature, spec: AgentSpec):
        super().__init__(actor, critic, temperature)
        self.encoder, self.dynamics, self.reward = encoder, dynamics, reward
        self.hl, self.gamma, self.mad = critic.hl, spec.gamma, spec.mad

    def noise_sizes(self, b: int) -> tuple[int, ...]:
        """Rows of the noise block's parts for batch size b, in draw order (N = QED samples per state, N' the same
        at z' for the target, 0 with ``target_alpha: floor``): model step a' (B), QED(z') (B N'); critic batch
        model actions (n_model), a' (B), QED(z') (B N'); actor a (n_actor), QED(z) (n_actor N), where n_actor is
        :meth:`actor_rows`. The model-step rows are drawn even when ``model_every`` skips it: one shape always."""
        _, n_model = split_sizes(b, self.mad.proportion_real)
        n, n_target, n_actor = self.n_qed, self.n_qed_target, self.actor_rows(b)
        return b, b * n_target, n_model, b, b * n_target, n_actor, n_actor * n

    def actor_rows(self, b: int) -> int:
        """Critic-batch rows the actor and temperature steps read: the n_real real rows (``agent.mad.actor_rows:
        real``) or all B (``all``, MAD-TD's actor update: a model row's start state is a real replay state too)."""
        return b if self.mad.actor_rows == "all" else split_sizes(b, self.mad.proportion_real)[0]

    def q_pair(self, critic_p: Params, states: torch.Tensor, actions: torch.Tensor, repeats: int = 1
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(E[Q1], E[Q2])`` [B * repeats] of the HL-Gauss heads."""
        l1, l2 = self.logits(critic_p, states, actions, repeats)
        return self.hl.decode(l1), self.hl.decode(l2)

    def logits(self, critic_p: Params, z: torch.Tensor, a: torch.Tensor, repeats: int = 1
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Both heads' logits [B * repeats, bins]."""
        return super().q_pair(critic_p, z, a, repeats)

    def encode(self, encoder_p: Params, obs: torch.Tensor) -> torch.Tensor:
        return call(self.encoder, encoder_p, obs)

    def critic_ce(self, l1: torch.Tensor, l2: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """HL-Gauss loss of both heads (logits [B, bins]) against targets y [B], 0-d: mean over bins and batch per
        head, heads summed (MAD-TD's reduction, ``rl_targets.py``)."""
        probs = self.hl.encode(y.detach())
        return cross_entropy(l1, probs).mean() + cross_entropy(l2, probs).mean()

    @torch.no_grad()
    def soft_target(self, actor_p: Params, target_p: Params, tstate: Params, z_next: torch.Tensor,
                    reward: torch.Tensor, discount: torch.Tensor, eps: torch.Tensor, eps_qed: torch.Tensor,
                    dist: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(y [B], alpha(z') [B])``: y = r + discount (min_j E[Qtarg_j](z', a') - alpha(z') log pi(a'|z')),
        a' ~ pi, alpha(z') from the target critic, which produces the target value (or alpha_TE, see
        :meth:`SACFunctions.target_alpha`). ``dist``: the policy's (mu, log_std) at z' if already computed."""
        dist = self.policy(actor_p, z_next) if dist is None else dist
        a, logp = squashed_sample(*dist, eps)
        tq1, tq2 = self.q_pair(target_p, z_next, a)
        alpha = self.target_alpha(tstate, actor_p, target_p, z_next, eps_qed, dist=dist)
        return reward + discount * (torch.minimum(tq1, tq2) - alpha * logp), alpha

    def model_losses(self, params: dict[str, Params], target_p: Params, batch: dict[str, torch.Tensor],
                     eps: torch.Tensor, eps_qed: torch.Tensor) -> torch.Tensor:
        """The four encoder/model losses [4] on real data, in :data:`MODEL_LOSSES` order (MAD-TD's
        ``compute_model_loss``, made MaxEnt; what each trains, and why the "target encoder" is the online one under
        no_grad: docs/mad_sac.md, "The four encoder/model losses")."""
        obs, act, rew = batch["obs"], batch["action"], batch["reward"]
        b = obs.shape[0]
        z = self.encode(params["encoder"], obs)
        with torch.no_grad():
            z_next = self.encode(params["encoder"], batch["next_obs"])
            dist = self.policy(params["actor"], z_next)
            a_star = torch.tanh(dist[0])  # deterministic: the lowest-variance choice
            y, _ = self.soft_target(params["actor"], target_p, params["temperature"], z_next, rew,
                                    self.gamma * (1.0 - batch["terminated"]), eps, eps_qed, dist)
        pred_next, pred_logp = call(self.dynamics, params["dynamics"], z, act)
        smoothed = (1.0 - LATENT_TARGET_SMOOTHING) * z_next + LATENT_TARGET_SMOOTHING / self.mad.simnorm_group
        # One target-critic call for the target (z', a*) and the prediction (predicted z', a*) rows; only the
        # prediction half carries gradient (into dynamics and encoder, the critic itself is frozen).
        v1, v2 = self.logits(target_p, torch.cat([z_next, pred_next]), torch.cat([a_star, a_star]))
        t1, t2 = v1[:b].detach().softmax(-1), v2[:b].detach().softmax(-1)
        value_aware = 0.5 * (cross_entropy(v1[b:], t1).mean() + cross_entropy(v2[b:], t2).mean())
        l1, l2 = self.logits(detached(params["critic"]), z, act)
        r_pred = call(self.reward, params["reward"], z, act)
        return torch.stack([(r_pred - rew).pow(2).mean(), -(smoothed * pred_logp).mean(), value_aware,
                            self.critic_ce(l1, l2, y)])

    @torch.no_grad()
    def critic_batch(self, params: dict[str, Params], target_p: Params, batch: dict[str, torch.Tensor],
                     eps_model: torch.Tensor, eps: torch.Tensor, eps_qed: torch.Tensor) -> dict[str, torch.Tensor]:
        """The mixed critic batch (MAD-TD's ``update_critic``; docs/mad_sac.md, "Mixed real/model critic batches"),
        no gradient: z [B, L], a [B, A], y [B], is_model [B], next_alpha [B] and reward_mse 0-d (the reward head on
        the real rows, a model-quality diagnostic); the model rows' actions are drawn with ``eps_model``."""
        obs, act, rew = batch["obs"], batch["action"], batch["reward"]
        b = obs.shape[0]
        n_real, _ = split_sizes(b, self.mad.proportion_real)
        # One encoder call for s (all rows) and s' (real rows only: the model rows' s' is discarded).
        z_all = self.encode(params["encoder"], torch.cat([obs, batch["next_obs"][:n_real]]))
        z = z_all[:b]
        a_m = self.sample(params["actor"], z[n_real:], eps_model)[0]
        z_model = call(self.dynamics, params["dynamics"], z[n_real:], a_m)[0]
        z_next = torch.cat([z_all[b:], z_model])
        a = torch.cat([act[:n_real], a_m])
        r_pred = call(self.reward, params["reward"], z, a)
        r = torch.cat([rew[:n_real], r_pred[n_real:]])
        y, next_alpha = self.soft_target(params["actor"], target_p, params["temperature"], z_next, r,
                                         self.gamma * (1.0 - batch["terminated"]), eps, eps_qed)
        reward_mse = (r_pred[:n_real] - rew[:n_real]).pow(2).mean()
        is_model = torch.arange(b, device=obs.device) >= n_real
        return {"z": z, "a": a, "y": y, "is_model": is_model, "next_alpha": next_alpha, "reward_mse": reward_mse}

    def critic_loss(self, params: dict[str, Params], target_p: Params, batch: dict[str, torch.Tensor],
                    eps_model: torch.Tensor, eps: torch.Tensor, eps_qed: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """HL-Gauss critic loss on the mixed batch, gradient into ``params["critic"]`` only: ``(loss 0-d, metrics,
        z_actor)``, metrics :data:`CRITIC_METRICS` then the alpha/target statistics, z_actor [n_actor, L] the actor
        step's latents (:meth:`actor_rows`)."""
        cb = self.critic_batch(params, target_p, batch, eps_model, eps, eps_qed)
        l1, l2 = self.logits(params["critic"], cb["z"], cb["a"])
        loss = self.critic_ce(l1, l2, cb["y"])
        metrics = [loss.detach(), *self.q_metrics(l1.detach(), l2.detach(), cb),
                   *alpha_stats(cb["next_alpha"], self.temperature, params["temperature"])]
        return loss, torch.stack(metrics), cb["z"][:self.actor_rows(cb["z"].shape[0])]

    def q_metrics(self, l1: torch.Tensor, l2: torch.Tensor, cb: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Q diagnostics per row type, :data:`CRITIC_METRICS` [1:]; masked means keep an empty model share at 0."""
        q1, q2 = self.hl.decode(l1), self.hl.decode(l2)
        model = cb["is_model"].to(q1.dtype)
        real = 1.0 - model
        gap = (q1 - q2).abs()
        mean_real = (q1 * real).sum() / real.sum()
        return [mean_real, mean_real, (q1 * model).sum() / model.sum().clamp(min=1.0), gap.mean(), gap.max(),
                cb["y"].mean(), cb["y"].std(), self.hl.clip_fraction(cb["y"]).to(q1.dtype), cb["reward_mse"]]


class MadSAC(SACBase):
    """Encoder, latent model, HL-Gauss twin critic (+ target), actor, temperature and their optimisers; ``seed``
    seeds initialisation and the agent's own sampling generator."""

    name = "mad_sac"
    acting_modules = ("encoder", "actor")  # what an intermediate policy snapshot needs

    def __init__(self, spec: AgentSpec, temperature: TemperatureSpec, obs_dim: int, action_dim: int,
                 device: torch.device, seed: int):
        super().__init__(spec, action_dim, device)
        self.mad = spec.mad
        split_sizes(spec.batch_size, spec.mad.proportion_real)  # fail at construction, not at the first update
        m, act, dev = spec.mad, spec.activation, self.device
        with seeded_init(seed):
            self.encoder = Encoder(obs_dim, m.encoder_hidden, m.latent_dim, m.simnorm_group, act).to(dev)
            self.dynamics = Dynamics(m.latent_dim, action_dim, m.model_hidden, spec.depth, m.simnorm_group,
                                     act).to(dev)
            self.reward = RewardHead(m.latent_dim, action_dim, m.model_hidden, spec.depth, act).to(dev)
            hl = HLGauss(m.vmin, m.vmax, m.num_bins, m.sigma_ratio)
            critic = HLGaussCritic(m.latent_dim, action_dim, spec.hidden, spec.critic_layers, act, hl).to(dev)
            actor = TanhGaussianActor(m.latent_dim, action_dim, spec.hidden, spec.depth, act,
                                      spec.log_std_min, spec.log_std_max).to(dev)
        self._init_sac(actor, critic, temperature, seed)
        self.hl = self.critic.hl
        self.encoder_opt = make_adam(self.encoder.parameters(), m.encoder_lr, dev)
        self.model_opt = make_adam(self._model_params(), m.model_lr, dev)
        self.fn = MadFunctions(self.encoder, self.dynamics, self.reward, self.actor, self.critic, self.temperature,
                               spec)
        self.metric_layout = self.layout(CRITIC_METRICS, MODEL_METRIC_KEYS)
        # update() calls so far (self.updates, SACBase) drive model_every and are checkpointed as a tensor; the
        # last model step's metrics stand in for the model columns of an update that skips it.
        self.memo["model_metrics"] = torch.zeros(len(MODEL_METRIC_KEYS), device=dev)

    def _model_params(self) -> list[torch.nn.Parameter]:
        return [*self.dynamics.parameters(), *self.reward.parameters()]

    def encode(self, obs: torch.Tensor) -> torch.Tensor:
        """The SimNorm latent the actor and critics read."""
        return self.encoder(obs)

    # ---- learning ----------------------------------------------------------------------------------
    def encode_with(self, params: dict[str, Params], obs: torch.Tensor) -> torch.Tensor:
        return self.fn.encode(params["encoder"], obs)

    def model_step(self, x: Learner, params: dict[str, Params], target_p: Params, batch: dict[str, torch.Tensor],
                   eps: torch.Tensor, eps_qed: torch.Tensor) -> torch.Tensor:
        """One clipped Adam step on encoder (encoder_lr) and dynamics + reward (model_lr): [6] metrics
        (:data:`MODEL_METRIC_KEYS`), the four losses and both pre-clip gradient norms."""
        losses = x.per_seed(self.fn.model_losses)(params, target_p, batch, eps, eps_qed)
        clip = self.spec.grad_clip
        enc_norm, model_norm = x.step(losses, ("encoder_opt", clip), ("model_opt", clip))
        return torch.cat([losses.detach(), torch.stack([enc_norm, model_norm], -1).to(losses.dtype)], -1)

    def learn(self, x: Learner, batch: dict[str, torch.Tensor], noise: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """(0) model step every ``model_every``-th call, (1) mixed critic step, (2) actor + temperature on the real
        rows (or all rows, ``agent.mad.actor_rows``), (3) Polyak on the target critic (the order of MAD-TD's update
        step); the metric vector (:attr:`metric_layout`), the model columns the last model step's when skipped."""
        e_mt, e_mq, e_model, e_t, e_tq, e_a, e_aq = noise
        p, target_p = x.params(), x.target_params()
        if x.updates % self.mad.model_every == 0:
            x.memo["model_metrics"] = self.model_step(x, p, target_p, batch, e_mt, e_mq)
        x.updates += 1
        critic_loss, critic_metrics, z_actor = x.per_seed(self.fn.critic_loss)(p, target_p, batch, e_model, e_t,
                                                                               e_tq)
        # The actor maximises the critic named by agent.mad.actor_critic (online by default, as in SAC-LN).
        q_p = p["critic"] if self.mad.actor_critic == "online" else target_p
        steps = self.sac_steps(x, critic_loss, p, q_p, z_actor, e_a, e_aq)
        return torch.cat([critic_metrics, steps, x.memo["model_metrics"].to(critic_metrics.dtype)], -1)

    def report_warnings(self, metrics: dict[str, float]) -> list[str]:
        """A warning when the share of TD targets clipped by the HL-Gauss support exceeds
        ``agent.mad.clip_warn_fraction`` (large alpha or action dims push soft values out of the support)."""
        frac = metrics.get("mad/target_clip_frac")
        if frac is None or not frac > self.mad.clip_warn_fraction:
            return []
        return [f"mad/target_clip_frac {frac:.4f} > agent.mad.clip_warn_fraction {self.mad.clip_warn_fraction}: "
                f"TD targets fall outside the HL-Gauss support [{self.mad.vmin:g}, {self.mad.vmax:g}]; widen "
                f"agent.mad.vmin/vmax or lower temperature.alpha_max/init_alpha"]

    # ---- state -----------------------------------------------------------------------------------
    def extra_modules(self) -> dict[str, torch.nn.Module]:
        return {"encoder": self.encoder, "dynamics": self.dynamics, "reward": self.reward}

    def extra_optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"encoder_opt": self.encoder_opt, "model_opt": self.model_opt}

    def learner_state(self, updates: int, memo: dict[str, torch.Tensor]) -> dict:
        """The update counter (drives ``model_every`` on resume) and the last model step's metrics."""
        return {"updates": torch.tensor(updates, dtype=torch.int64),
                "model_metrics": memo["model_metrics"].detach().clone()}

    def read_learner_state(self, state: dict) -> tuple[int, dict[str, torch.Tensor]]:
        return int(state["updates"]), {"model_metrics": state["model_metrics"]}
