"""The agent interface and the SAC chassis both agents share, :class:`SACBase`, with the pure functions their
updates are built from, :class:`SACFunctions` (paper Sec. 2, Sec. 5.2; docs/design.md, "The agent interface")."""

from __future__ import annotations

import contextlib
import copy
from typing import ClassVar, Protocol, runtime_checkable

import torch
from torch import nn
from torch.func import functional_call

from qed_ray.rl.agents.learner import Learner, Params
from qed_ray.spec.config import AgentSpec, TemperatureSpec
from qed_ray.rl.networks import freeze, make_adam, require_fp32_matmul, squashed_sample
from qed_ray.rl.precision import qed_products
from qed_ray.rl.temperature import alpha_stat_names, alpha_stats, make_temperature, qed_disagreement, temperature_state
from qed_ray.rl.update_metrics import MetricLayout

# The metric columns after the critic's, both agents (sac_steps), then the actor's alpha statistics.
STEP_METRICS = ("grad/critic_norm", "loss/actor", "grad/actor_norm", "policy/entropy", "loss/alpha", "alpha/te")


@runtime_checkable
class Agent(Protocol):
    """One seed's agent: its modules, optimisers and state layout, and the definition of one seed's update (a
    :class:`~qed_ray.rl.agents.packed.PackedAgent` stacks such agents and is what trains, acts and is evaluated)."""

    name: str
    acting_modules: tuple[str, ...]  # the modules a policy snapshot must hold to act and to be compared
    device: torch.device
    generator: torch.Generator
    metric_layout: MetricLayout  # names of the columns of the metric vector learn() returns

    def modules(self) -> dict[str, nn.Module]: ...

    def optimizers(self) -> dict[str, torch.optim.Optimizer]: ...

    def state_dict(self) -> dict:
        """Tensors only."""

    def load_state_dict(self, state: dict) -> None: ...

    def report_warnings(self, metrics: dict[str, float]) -> list[str]: ...


def draw_noise(generator: torch.Generator, rows: int, action_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Standard-normal noise [rows, A] from ``generator``: the one way an agent draws noise."""
    return torch.randn((rows, action_dim), generator=generator, device=generator.device, dtype=dtype)


@contextlib.contextmanager
def seeded_init(seed: int):
    """Context in which module construction draws from ``seed`` without touching the global torch RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def params_of(module: nn.Module) -> Params:
    return dict(module.named_parameters())


def call(module: nn.Module, params: Params, *args, **kwargs):
    """``module(*args, **kwargs)`` with ``params`` in place of its parameters; the agents' modules share no weights,
    so the per-call search for tied weights is skipped."""
    return functional_call(module, params, args, kwargs, tie_weights=False)


def detached(params: Params) -> Params:
    """Views of ``params`` without gradient: a loss through them leaves none on the module."""
    return {k: v.detach() for k, v in params.items()}


class SACFunctions:
    """Pure functions of a SAC agent's actor, twin critic and temperature rule; the modules serve only as structure,
    each call takes its parameters explicitly."""

    def __init__(self, actor: nn.Module, critic: nn.Module, temperature: nn.Module):
        self.actor, self.critic, self.temperature = actor, critic, temperature
        self.n_qed = temperature.n_actions  # QED's policy samples per state; 0 for te and fixed
        self.n_qed_target = temperature.n_target_actions  # the same at s' for the TD target; 0: alpha_TE there
        self.qed_precision = "fp32"  # QED's critic products (qed_ray.rl.precision); the run's builder sets it

    def policy(self, actor_p: Params, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-tanh ``(mu, log_std)`` [B, A]."""
        return call(self.actor, actor_p, states)

    def sample(self, actor_p: Params, states: torch.Tensor, eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(action [B, A], log_prob [B])`` with noise ``eps`` [B, A]."""
        return squashed_sample(*self.policy(actor_p, states), eps)

    def q_pair(self, critic_p: Params, states: torch.Tensor, actions: torch.Tensor, repeats: int = 1
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Q1, Q2)`` [B * repeats] (scalar critics: the heads' outputs)."""
        return call(self.critic, critic_p, states, actions, repeats=repeats)

    def qed_q_pair(self, critic_p: Params, states: torch.Tensor, actions: torch.Tensor, repeats: int = 1
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`q_pair` for QED's no-grad passes, its linear layers at ``qed_precision``; the TD loss and the
        actor's critic pass call :meth:`q_pair`."""
        with qed_products(self.qed_precision):
            return self.q_pair(critic_p, states, actions, repeats)

    def alpha(self, tstate: Params, actor_p: Params, critic_p: Params, states: torch.Tensor,
              eps_qed: torch.Tensor, share_state_terms: bool = True,
              dist: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """[B] temperatures at ``states``; QED reads the critic pair ``critic_p`` at ``n_qed`` policy samples per
        state drawn with ``eps_qed`` [B * n_qed, A] (no gradient). ``dist``: the policy's (mu, log_std) at
        ``states`` if already computed."""
        delta = None
        if self.n_qed:
            delta = qed_disagreement(lambda s: self.policy(actor_p, s),
                                     lambda s, a, r: self.qed_q_pair(critic_p, s, a, r),
                                     states, eps_qed, self.n_qed, self.temperature.tau, share_state_terms, dist)
        return self.temperature.alpha(tstate, states.shape[0], delta)

    def target_alpha(self, tstate: Params, actor_p: Params, target_p: Params, next_states: torch.Tensor,
                     eps_qed: torch.Tensor, dist: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """[B] alpha of the TD target at ``next_states``: :meth:`alpha` read from the target critics, or, when the
        rule's ``n_target_actions`` is 0 under QED (``temperature.target_alpha: floor``), alpha_TE with no QED pass
        (``eps_qed`` is then empty)."""
        if self.n_qed and not self.n_qed_target:
            return self.temperature.floor(tstate).expand(next_states.shape[0])
        return self.alpha(tstate, actor_p, target_p, next_states, eps_qed, dist=dist)

    def actor_loss(self, actor_p: Params, critic_p: Params, tstate: Params, states: torch.Tensor,
                   eps: torch.Tensor, eps_qed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """SAC's actor loss (alpha(s) log pi(a|s) - min_j Q_j(s, a)).mean(), a ~ pi(.|s) (paper Eq. 1):
        ``(loss 0-d, log_prob [B], alpha [B])``. The critic enters detached, so gradients reach only the actor;
        alpha(s) is read from the same critic pair."""
        mu, log_std = self.policy(actor_p, states)
        a, logp = squashed_sample(mu, log_std, eps)
        q1, q2 = self.q_pair(detached(critic_p), states, a)
        alpha = self.alpha(tstate, actor_p, critic_p, states, eps_qed, dist=(mu.detach(), log_std.detach()))
        return (alpha * logp - torch.minimum(q1, q2)).mean(), logp, alpha


class SACBase:
    """Actor, twin critic (+ Polyak target), temperature, their optimisers and the agent's own generator.

    Subclasses build their networks under :func:`seeded_init`, call :meth:`_init_sac`, set ``fn`` (their
    :class:`SACFunctions`) and ``metric_layout``, and implement ``learn(learner, batch, noise_parts)`` against a
    :class:`Learner`; the hooks below (``encode_with``, ``extra_*``, ``learner_state``, ``report_warnings``) default
    to SAC-LN's.
    """

    name: ClassVar[str]
    acting_modules: ClassVar[tuple[str, ...]]

    def __init__(self, spec: AgentSpec, action_dim: int, device: torch.device):
        require_fp32_matmul()  # critic passes feed QED and the TD target (networks.require_fp32_matmul)
        self.spec, self.action_dim, self.device = spec, action_dim, torch.device(device)
        self.updates = 0
        self.memo: dict[str, torch.Tensor] = {}

    def _init_sac(self, actor: nn.Module, critic: nn.Module, temperature: TemperatureSpec, seed: int) -> None:
        self.actor, self.critic = actor, critic
        self.critic_target = freeze(copy.deepcopy(critic))
        self.temperature = make_temperature(temperature, self.action_dim).to(self.device)
        self.temperature_spec = temperature  # a pack's members share all of it but its MEMBER_FIELDS
        self.actor_opt = make_adam(self.actor.parameters(), self.spec.actor_lr, self.device)
        self.critic_opt = make_adam(self.critic.parameters(), self.spec.critic_lr, self.device)
        t_params = list(self.temperature.parameters())
        self.alpha_opt = make_adam(t_params, temperature.lr, self.device) if t_params else None
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    # ---- acting and noise, as pure functions of the parameters ----------------------------------------
    def noise(self, rows: int) -> torch.Tensor:
        return draw_noise(self.generator, rows, self.action_dim, next(self.actor.parameters()).dtype)

    def noise_rows(self, batch_size: int) -> int:
        return sum(self.fn.noise_sizes(batch_size))

    def encode_with(self, params: dict[str, Params], obs: torch.Tensor) -> torch.Tensor:
        """:meth:`encode` computed with ``params`` (a pure function, mapped over the seeds of a pack)."""
        return obs

    # The *_with functions read observations [B, O] (and actions, noise [B, A]); vmapped over a pack's seeds.
    def sample_with(self, params: dict[str, Params], obs: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        return self.fn.sample(params["actor"], self.encode_with(params, obs), eps)[0]

    def policy_with(self, params: dict[str, Params], obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn.policy(params["actor"], self.encode_with(params, obs))

    def mode_with(self, params: dict[str, Params], obs: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.policy_with(params, obs)[0])

    def q_with(self, params: dict[str, Params], obs: torch.Tensor, action: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn.q_pair(params["critic"], self.encode_with(params, obs), action)

    # ---- learning steps shared by both agents, against a Learner ---------------------------------------
    def sac_steps(self, x: Learner, critic_loss: torch.Tensor, p: dict[str, Params], critic_p: Params,
                  states: torch.Tensor, eps: torch.Tensor, eps_qed: torch.Tensor) -> torch.Tensor:
        """The critic's clipped Adam step, the actor's (its loss against ``critic_p`` at ``states``), the rule's own
        (alpha_TE, paper Eq. 1) and Polyak: the :data:`STEP_METRICS` columns, then the actor's alpha statistics.

        The statistics (alpha_TE and :func:`~qed_ray.rl.temperature.alpha_stats` of the actor loss's alpha) are read
        before the temperature step moves alpha_TE in place, so the floor share compares alpha with the floor it was
        clipped at (after the step, a falling alpha_TE would put no state "at the floor").
        """
        (critic_norm,) = x.step(critic_loss, ("critic_opt", self.spec.grad_clip))
        tstate = p["temperature"]
        actor_loss, alpha_loss, logp, stats = x.per_seed(self._actor_losses)(p["actor"], critic_p, tstate, states,
                                                                             eps, eps_qed)
        # One backward for both losses: the rule's reads log pi detached and the actor's reads alpha without gradient,
        # so each parameter gets the gradient a backward of its own loss gives.
        alpha_step = [("alpha_opt", None)] if self.alpha_opt is not None else []
        (actor_norm,) = x.step(actor_loss + alpha_loss, ("actor_opt", self.spec.grad_clip), *alpha_step)
        x.polyak(self.spec.polyak)
        steps = [critic_norm, actor_loss.detach(), actor_norm, -logp.mean(-1), alpha_loss.detach()]
        return torch.cat([torch.stack(steps, -1), stats], -1)

    def layout(self, critic: tuple[str, ...], after: tuple[str, ...] = ()) -> MetricLayout:
        """The metric columns in ``learn``'s order: ``critic``'s (then the TD target's alpha statistics),
        :data:`STEP_METRICS` (then the actor's), then ``after``."""
        t = self.temperature
        return MetricLayout((*critic, *alpha_stat_names(t, "alpha/target"), *STEP_METRICS,
                             *alpha_stat_names(t, "alpha/actor"), *after))

    def _actor_losses(self, actor_p: Params, critic_p: Params, tstate: Params, states: torch.Tensor,
                      eps: torch.Tensor, eps_qed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # One mapped call (one compiled region) for the actor's loss, the rule's and the alpha statistics.
        loss, logp, alpha = self.fn.actor_loss(actor_p, critic_p, tstate, states, eps, eps_qed)
        stats = torch.stack([self.temperature.floor(tstate), *alpha_stats(alpha, self.temperature, tstate)])
        return loss, self.temperature.loss(tstate, logp), logp.detach(), stats

    def report_warnings(self, metrics: dict[str, float]) -> list[str]:
        return []

    # ---- state -----------------------------------------------------------------------------------
    def extra_modules(self) -> dict[str, nn.Module]:
        return {}

    def extra_optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {}

    def extra_state(self) -> dict:
        """Tensors beyond modules, optimisers and the generator."""
        return self.learner_state(self.updates, self.memo)

    def load_extra_state(self, state: dict) -> None:
        self.updates, memo = self.read_learner_state(state)
        self.memo = {k: v.to(self.device) for k, v in memo.items()}

    def learner_state(self, updates: int, memo: dict[str, torch.Tensor]) -> dict:
        """The checkpoint entries of a learner's ``updates`` and ``memo`` (one seed's; none for SAC-LN)."""
        return {}

    def read_learner_state(self, state: dict) -> tuple[int, dict[str, torch.Tensor]]:
        return 0, {}

    def modules(self) -> dict[str, nn.Module]:
        """Every module whose parameters or buffers define the agent."""
        return {**self.extra_modules(), "actor": self.actor, "critic": self.critic,
                "critic_target": self.critic_target, "temperature": self.temperature}

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        opts = {**self.extra_optimizers(), "actor_opt": self.actor_opt, "critic_opt": self.critic_opt}
        if self.alpha_opt is not None:
            opts["alpha_opt"] = self.alpha_opt
        return opts

    def params(self) -> dict[str, Params]:
        """Live trainable parameters per module name, and the temperature state: what the losses take."""
        out = {k: params_of(m) for k, m in self.modules().items() if k not in ("critic_target", "temperature")}
        out["temperature"] = temperature_state(self.temperature)
        return out

    def state_dict(self) -> dict:
        """Modules, optimisers, the generator and :meth:`extra_state`: tensors only (``weights_only``-loadable)."""
        state = {k: m.state_dict() for k, m in self.modules().items()}
        state.update({k: o.state_dict() for k, o in self.optimizers().items()})
        state["generator"] = self.generator.get_state()
        state.update(self.extra_state())
        return state

    def load_state_dict(self, state: dict) -> None:
        """Raises KeyError naming a missing part."""
        for k, m in self.modules().items():
            m.load_state_dict(state[k])
        for k, o in self.optimizers().items():
            o.load_state_dict(state[k])
        self.generator.set_state(state["generator"])
        self.load_extra_state(state)
