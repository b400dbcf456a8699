"""One agent as the :class:`~qed_ray.rl.agents.learner.Learner` of its own update: the single-seed road a pack
(:class:`~qed_ray.rl.agents.packed.PackedAgent`) is checked against. Production trains packs only (a single seed is a
pack of one); this learner runs the same ``learn`` on one agent's own modules and optimisers, with torch's
global-norm clip and Polyak update, so the tests can compare a pack's slice with an independent single-seed run."""

from __future__ import annotations

from typing import Callable

import torch

from qed_ray.rl.agents.base import SACBase, params_of
from qed_ray.rl.agents.learner import Params
from qed_ray.rl.networks import polyak_lerp_


class SingleSeed:
    """The Learner over one agent's tensors: ``per_seed`` is the function itself, steps are the agent's optimisers."""

    def __init__(self, agent: SACBase):
        self.agent = agent

    @property
    def updates(self) -> int:
        return self.agent.updates

    @updates.setter
    def updates(self, value: int) -> None:
        self.agent.updates = value

    @property
    def memo(self) -> dict[str, torch.Tensor]:
        return self.agent.memo

    def params(self) -> dict[str, Params]:
        return self.agent.params()

    def target_params(self) -> Params:
        return params_of(self.agent.critic_target)

    def per_seed(self, fn: Callable) -> Callable:
        return fn

    def step(self, loss: torch.Tensor, *groups: tuple[str, float | None]) -> list[torch.Tensor]:
        """zero_grad -> backward -> global-norm clip per group (paper App. B: 20) -> Adam step per group."""
        opts = self.agent.optimizers()
        for name, _ in groups:
            opts[name].zero_grad(set_to_none=True)
        loss.sum().backward()
        norms = [torch.nn.utils.clip_grad_norm_(opts[name].param_groups[0]["params"], clip)
                 for name, clip in groups if clip is not None]
        for name, _ in groups:
            opts[name].step()
        return norms

    def polyak(self, rate: float) -> None:
        polyak_lerp_(list(self.agent.critic_target.parameters()), list(self.agent.critic.parameters()), rate)


def single_update(agent: SACBase, batch: dict[str, torch.Tensor], noise: torch.Tensor | None = None) -> torch.Tensor:
    """One learning step of ``agent`` on its own parameters; returns its metric vector [K] (``metric_layout``).

    ``batch``: obs [B, O], action [B, A], reward [B], next_obs [B, O], terminated [B]; ``noise``: the update's block
    [``agent.noise_rows(B)``, A], drawn from the agent's generator when None (one draw of fixed shape per update).
    """
    b = batch["obs"].shape[0]
    if noise is None:
        noise = agent.noise(agent.noise_rows(b))
    return agent.learn(SingleSeed(agent), batch, noise.split(agent.fn.noise_sizes(b)))


def assert_pack_holds_singles(pack, singles: list[SACBase], rtol: float) -> None:
    """Each seed's slice of ``pack`` equals its single-seed agent's parameters, module by module (rtol ``rtol``)."""
    for i, single in enumerate(singles):
        state = pack.seed_state_dict(i)
        for m, module in single.modules().items():
            for k, v in module.state_dict().items():
                torch.testing.assert_close(state[m][k], v, rtol=rtol, atol=1e-6, msg=f"{m}.{k}")
