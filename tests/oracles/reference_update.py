"""The update maths of qed_ray's checkpoint format 1 (before the pure-function update), kept as a test oracle.

Copied from the previous ``SACLN.update`` and ``MadSAC.update`` and adapted only to read their random numbers
from the same noise blocks the current agents take, in the same order, instead of drawing them from a
generator: critic and actor gradients are isolated with ``requires_grad_`` toggles, QED repeats every state
N times and runs every network on B x N rows, the optimisers are default Adam. It runs on the modules of an
agent built with the same seed (identical initial weights), so the two can be compared update by update.
"""

from __future__ import annotations

import math

import torch

from qed_ray.rl.hlgauss import cross_entropy
from qed_ray.rl.networks import tanh_log_det_jacobian
from qed_ray.spec.config import HOT_RATIO
from qed_ray.rl.temperature import QEDTemperature, TargetEntropyTemperature, expectile

LATENT_TARGET_SMOOTHING = 1e-4


def sample(actor, x, eps):
    """The former ``TanhGaussianActor.sample`` with ``eps`` in place of its ``randn`` draw."""
    mu, log_std = actor(x)
    u = mu + log_std.exp() * eps
    gauss = -0.5 * eps.pow(2) - log_std - 0.5 * math.log(2 * math.pi)
    return torch.tanh(u), (gauss - tanh_log_det_jacobian(u)).sum(-1)


def clip_and_step(optimizer, params, loss, max_norm):
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    optimizer.step()
    return norm


def polyak(target, online, rate):
    with torch.no_grad():
        torch._foreach_lerp_(list(target.parameters()), list(online.parameters()), rate)


class OldTemperature:
    """The former temperature rules: alpha(states, sample_actions, q_pair), loss(log_prob), floor()."""

    def __init__(self, rule):
        self.rule = rule
        self.trainable = isinstance(rule, TargetEntropyTemperature)

    def floor(self):
        return self.rule.log_alpha.detach().exp() if self.trainable else self.rule.value

    @torch.no_grad()
    def alpha(self, states, sample_actions, q_pair):
        if not isinstance(self.rule, QEDTemperature):
            return self.floor().expand(states.shape[0])
        b, n = states.shape[0], self.rule.n_actions
        rep = states.repeat_interleave(n, dim=0)
        q1, q2 = q_pair(rep, sample_actions(rep))
        raw = expectile((q1 - q2).abs().view(b, n), self.rule.tau) * self.rule.scale
        return torch.maximum(raw.clamp(max=self.rule.alpha_max), self.floor())

    def loss(self, log_prob):
        if not self.trainable:
            return torch.zeros((), device=log_prob.device, dtype=log_prob.dtype)
        return -(self.rule.log_alpha * (log_prob.detach() + self.rule.target_entropy)).mean()

    def stats(self, alpha, prefix):
        """Read before the temperature step (as ``alpha/te``): the floor is the alpha_TE ``alpha`` was clipped at."""
        out = {f"{prefix}_mean": alpha.mean(), f"{prefix}_min": alpha.min(), f"{prefix}_max": alpha.max()}
        if isinstance(self.rule, QEDTemperature):
            out[f"{prefix}_frac_floor"] = (alpha <= self.floor()).to(alpha.dtype).mean()
            out[f"{prefix}_frac_cap"] = (alpha >= self.rule.alpha_max).to(alpha.dtype).mean()
            out[f"{prefix}_frac_hot"] = (alpha >= HOT_RATIO * self.floor()).to(alpha.dtype).mean()
        return out


class Noise:
    """Hands out consecutive row blocks of one update's noise, as the generator handed out draws."""

    def __init__(self, block, sizes):
        self.parts = [p for p in block.split(sizes) if p.shape[0]]  # te and fixed draw no QED samples

    def take(self, rows):
        part = self.parts.pop(0)
        assert part.shape[0] == rows, (part.shape, rows)
        return part


class OldSACLN:
    """The former SAC-LN update on ``agent``'s modules, with its own default-Adam optimisers."""

    def __init__(self, agent, temperature_lr):
        self.spec = agent.spec
        self.actor, self.critic, self.critic_target = agent.actor, agent.critic, agent.critic_target
        self.temperature = OldTemperature(agent.temperature)
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=self.spec.actor_lr)
        self.critic_opt = torch.optim.Adam(self.critic.parameters(), lr=self.spec.critic_lr)
        t_params = [p for p in agent.temperature.parameters() if p.requires_grad]
        self.alpha_opt = torch.optim.Adam(t_params, lr=temperature_lr) if t_params else None
        self.n = getattr(agent.temperature, "n_actions", 0)

    @staticmethod
    def q(critic, x, a):
        xa = torch.cat([x, a], dim=-1)
        return critic.q1(xa).squeeze(-1), critic.q2(xa).squeeze(-1)

    def update(self, batch, block):
        b = batch["obs"].shape[0]
        noise = Noise(block, [b, b * self.n, b, b * self.n])
        sample_actions = lambda s: sample(self.actor, s, noise.take(s.shape[0]))[0]  # noqa: E731
        obs, act, rew, nxt = batch["obs"], batch["action"], batch["reward"], batch["next_obs"]
        discount = self.spec.gamma * (1.0 - batch["terminated"])
        with torch.no_grad():
            next_a, next_logp = sample(self.actor, nxt, noise.take(b))
            tq1, tq2 = self.q(self.critic_target, nxt, next_a)
            next_alpha = self.temperature.alpha(nxt, sample_actions, lambda s, a: self.q(self.critic_target, s, a))
            target = rew + discount * (torch.minimum(tq1, tq2) - next_alpha * next_logp)
        target_stats = self.temperature.stats(next_alpha, "alpha/target")
        q1, q2 = self.q(self.critic, obs, act)
        critic_loss = 0.5 * ((q1 - target).pow(2).mean() + (q2 - target).pow(2).mean())
        critic_norm = clip_and_step(self.critic_opt, self.critic.parameters(), critic_loss, self.spec.grad_clip)

        self.critic.requires_grad_(False)
        a, logp = sample(self.actor, obs, noise.take(b))
        pq1, pq2 = self.q(self.critic, obs, a)
        alpha = self.temperature.alpha(obs, sample_actions, lambda s, u: self.q(self.critic, s, u))
        actor_loss = (alpha * logp - torch.minimum(pq1, pq2)).mean()
        actor_norm = clip_and_step(self.actor_opt, self.actor.parameters(), actor_loss, self.spec.grad_clip)
        self.critic.requires_grad_(True)
        actor_stats = {"alpha/te": self.temperature.floor(), **self.temperature.stats(alpha, "alpha/actor")}

        alpha_loss = self.temperature.loss(logp)
        if self.alpha_opt is not None:
            self.alpha_opt.zero_grad(set_to_none=True)
            alpha_loss.backward()
            self.alpha_opt.step()
        polyak(self.critic_target, self.critic, self.spec.polyak)
        gap = (q1 - q2).detach().abs()
        return {
            "loss/critic": critic_loss.detach(), "loss/actor": actor_loss.detach(), "loss/alpha": alpha_loss.detach(),
            "grad/critic_norm": critic_norm, "grad/actor_norm": actor_norm,
            "policy/entropy": -logp.detach().mean(), "q/mean": q1.detach().mean(),
            "q/abs_diff_mean": gap.mean(), "q/abs_diff_max": gap.max(), "q/target_mean": target.mean(),
            **actor_stats, **target_stats,
        }


class OldMadSAC:
    """The former MAD-SAC update on ``agent``'s modules, with its own default-Adam optimisers."""

    def __init__(self, agent, temperature_lr):
        self.spec, self.mad = agent.spec, agent.spec.mad
        for name in ("encoder", "dynamics", "reward", "critic", "critic_target", "actor"):
            setattr(self, name, getattr(agent, name))
        self.hl = self.critic.hl
        self.temperature = OldTemperature(agent.temperature)
        m = self.mad
        self.encoder_opt = torch.optim.Adam(self.encoder.parameters(), lr=m.encoder_lr)
        self.model_opt = torch.optim.Adam(self._model_params(), lr=m.model_lr)
        self.critic_opt = torch.optim.Adam(self.critic.parameters(), lr=self.spec.critic_lr)
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=self.spec.actor_lr)
        t_params = [p for p in agent.temperature.parameters() if p.requires_grad]
        self.alpha_opt = torch.optim.Adam(t_params, lr=temperature_lr) if t_params else None
        self.n = getattr(agent.temperature, "n_actions", 0)
        self.updates = 0
        self.noise = None

    def _model_params(self):
        return [*self.dynamics.parameters(), *self.reward.parameters()]

    def logits(self, critic, z, a):
        za = torch.cat([z, a], dim=-1)
        return critic.q1(za) + critic.prior, critic.q2(za) + critic.prior

    def values(self, critic, z, a):
        l1, l2 = self.logits(critic, z, a)
        return self.hl.decode(l1), self.hl.decode(l2)

    def sample_actions(self, z):
        return sample(self.actor, z, self.noise.take(z.shape[0]))[0]

    @torch.no_grad()
    def soft_target(self, z_next, reward, discount):
        a, logp = sample(self.actor, z_next, self.noise.take(z_next.shape[0]))
        tq1, tq2 = self.values(self.critic_target, z_next, a)
        alpha = self.temperature.alpha(z_next, self.sample_actions, lambda s, u: self.values(self.critic_target, s, u))
        return reward + discount * (torch.minimum(tq1, tq2) - alpha * logp), alpha

    def critic_ce(self, l1, l2, y):
        probs = self.hl.encode(y.detach())
        return cross_entropy(l1, probs).mean() + cross_entropy(l2, probs).mean()

    @torch.no_grad()
    def critic_batch(self, batch):
        obs, act, rew = batch["obs"], batch["action"], batch["reward"]
        b = obs.shape[0]
        n_real = int(b * self.mad.proportion_real)
        z_all = self.encoder(torch.cat([obs, batch["next_obs"][:n_real]]))
        z = z_all[:b]
        a_m = sample(self.actor, z[n_real:], self.noise.take(b - n_real))[0]
        z_next = torch.cat([z_all[b:], self.dynamics(z[n_real:], a_m)[0]])
        a = torch.cat([act[:n_real], a_m])
        r_pred = self.reward(z, a)
        r = torch.cat([rew[:n_real], r_pred[n_real:]])
        y, next_alpha = self.soft_target(z_next, r, self.spec.gamma * (1.0 - batch["terminated"]))
        reward_mse = (r_pred[:n_real] - rew[:n_real]).pow(2).mean()
        is_model = torch.arange(b, device=obs.device) >= n_real
        return {"z": z, "a": a, "y": y, "is_model": is_model, "next_alpha": next_alpha, "reward_mse": reward_mse}

    def model_losses(self, batch):
        obs, act, rew = batch["obs"], batch["action"], batch["reward"]
        b = obs.shape[0]
        z = self.encoder(obs)
        with torch.no_grad():
            z_next = self.encoder(batch["next_obs"])
            a_star = self.actor.mode(z_next)
            y, _ = self.soft_target(z_next, rew, self.spec.gamma * (1.0 - batch["terminated"]))
        pred_next, pred_logp = self.dynamics(z, act)
        smoothed = (1.0 - LATENT_TARGET_SMOOTHING) * z_next + LATENT_TARGET_SMOOTHING / self.mad.simnorm_group
        v1, v2 = self.logits(self.critic_target, torch.cat([z_next, pred_next]), torch.cat([a_star, a_star]))
        t1, t2 = v1[:b].detach().softmax(-1), v2[:b].detach().softmax(-1)
        value_aware = 0.5 * (cross_entropy(v1[b:], t1).mean() + cross_entropy(v2[b:], t2).mean())
        l1, l2 = self.logits(self.critic, z, act)
        return {"loss/model_reward": (self.reward(z, act) - rew).pow(2).mean(),
                "loss/model_latent_ce": -(smoothed * pred_logp).mean(),
                "loss/model_value_aware": value_aware,
                "loss/model_encoder_critic": self.critic_ce(l1, l2, y)}

    def model_step(self, batch):
        self.critic.requires_grad_(False)
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

    def actor_step(self, z):
        q_net = self.critic if self.mad.actor_critic == "online" else self.critic_target
        self.critic.requires_grad_(False)
        a, logp = sample(self.actor, z, self.noise.take(z.shape[0]))
        q1, q2 = self.values(q_net, z, a)
        alpha = self.temperature.alpha(z, self.sample_actions, lambda s, u: self.values(q_net, s, u))
        actor_loss = (alpha * logp - torch.minimum(q1, q2)).mean()
        actor_norm = clip_and_step(self.actor_opt, self.actor.parameters(), actor_loss, self.spec.grad_clip)
        self.critic.requires_grad_(True)
        stats = {"alpha/te": self.temperature.floor(), **self.temperature.stats(alpha, "alpha/actor")}
        alpha_loss = self.temperature.loss(logp)
        if self.alpha_opt is not None:
            self.alpha_opt.zero_grad(set_to_none=True)
            alpha_loss.backward()
            self.alpha_opt.step()
        return {"loss/actor": actor_loss.detach(), "loss/alpha": alpha_loss.detach(), "grad/actor_norm": actor_norm,
                "policy/entropy": -logp.detach().mean(), **stats}

    def update(self, batch, block, layout):
        """``layout``: the block's part sizes [model a', model QED, model actions, a', QED, actor a, actor QED]."""
        parts = list(block.split(layout))
        model_parts, rest = parts[:2], parts[2:]
        metrics = {}
        if self.updates % self.mad.model_every == 0:
            self.noise = Noise(torch.cat(model_parts), [p.shape[0] for p in model_parts])
            metrics.update(self.model_step(batch))
        self.updates += 1
        self.noise = Noise(torch.cat(rest), [p.shape[0] for p in rest])
        cb = self.critic_batch(batch)
        target_stats = self.temperature.stats(cb["next_alpha"], "alpha/target")
        l1, l2 = self.logits(self.critic, cb["z"], cb["a"])
        critic_loss = self.critic_ce(l1, l2, cb["y"])
        critic_norm = clip_and_step(self.critic_opt, self.critic.parameters(), critic_loss, self.spec.grad_clip)
        n_real = int(cb["z"].shape[0] * self.mad.proportion_real)
        metrics.update(self.actor_step(cb["z"][:n_real]))
        polyak(self.critic_target, self.critic, self.spec.polyak)
        q1, q2 = self.hl.decode(l1.detach()), self.hl.decode(l2.detach())
        gap = (q1 - q2).abs()
        return {"loss/critic": critic_loss.detach(), "grad/critic_norm": critic_norm, **metrics,
                "q/abs_diff_mean": gap.mean(), "q/abs_diff_max": gap.max(), "q/target_mean": cb["y"].mean(),
                **target_stats}
