"""Agents: SAC-LN and MAD-SAC behind one interface, built by :func:`make_agent`."""

from __future__ import annotations

import torch

from qed_ray.config import AgentSpec, TemperatureSpec

IMPLEMENTED_AGENTS = ("sac_ln", "mad_sac")


def agent_state(agent) -> dict:
    """Modules, optimisers and the sampling generator of an agent as tensors (``weights_only``-loadable)."""
    state = {k: m.state_dict() for k, m in agent.modules().items()}
    state.update({k: o.state_dict() for k, o in agent.optimizers().items()})
    state["generator"] = agent.generator.get_state()
    return state


def load_agent_state(agent, state: dict) -> None:
    """Inverse of :func:`agent_state`; raises KeyError naming a missing part."""
    for k, m in agent.modules().items():
        m.load_state_dict(state[k])
    for k, o in agent.optimizers().items():
        o.load_state_dict(state[k])
    agent.generator.set_state(state["generator"])


def make_agent(agent: AgentSpec, temperature: TemperatureSpec, obs_dim: int, action_dim: int,
               device: torch.device, seed: int):
    """Builds the agent named by ``agent.name``; dims are derived from the env and passed in, never stored in config."""
    if agent.name == "sac_ln":
        from qed_ray.agents.sac_ln import SACLN
        return SACLN(agent, temperature, obs_dim, action_dim, device, seed)
    if agent.name == "mad_sac":
        from qed_ray.agents.mad_sac import MadSAC
        return MadSAC(agent, temperature, obs_dim, action_dim, device, seed)
    raise ValueError(f"agent.name: unknown agent {agent.name!r}; allowed: {', '.join(IMPLEMENTED_AGENTS)}")
