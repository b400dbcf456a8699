"""Agents: SAC-LN and MAD-SAC behind one interface, built by :func:`make_agent`."""

from __future__ import annotations

import torch

from qed_ray.config import AgentSpec, TemperatureSpec

IMPLEMENTED_AGENTS = ("sac_ln", "mad_sac")


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
