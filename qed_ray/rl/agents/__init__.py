"""Agents: SAC-LN and MAD-SAC behind one interface; the registry, and loading them back from snapshots."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch

from qed_ray.spec.config import AgentSpec, TemperatureSpec
from qed_ray.records.layout import MANIFEST_FILE
from qed_ray.rl.agents.base import Agent, SACBase
from qed_ray.rl.agents.mad_sac import MadSAC
from qed_ray.rl.agents.packed import PackedAgent
from qed_ray.rl.agents.sac_ln import SACLN
from qed_ray.records.checkpoint import SNAPSHOT_FORMATS, load_checkpoint
from qed_ray.records.manifests import Manifest

AGENTS: dict[str, type[SACBase]] = {SACLN.name: SACLN, MadSAC.name: MadSAC}
# A snapshot's weights do not depend on the random streams that changed in format 2, so format 1 ones (qed_ray 0.1)
# still load, their few renamed parameters upgraded: QED's log alpha_TE was a submodule's parameter then.
FORMAT1_RENAMES = {"temperature": {"te.log_alpha": "log_alpha"}}


def make_agent(agent: AgentSpec, temperature: TemperatureSpec, obs_dim: int, action_dim: int,
               device: torch.device, seed: int) -> Agent:
    """Builds the agent named by ``agent.name``; dims are derived from the env and passed in, never stored in config."""
    try:
        cls = AGENTS[agent.name]
    except KeyError:
        raise ValueError(f"agent.name: unknown agent {agent.name!r}; allowed: {', '.join(AGENTS)}") from None
    return cls(agent, temperature, obs_dim, action_dim, torch.device(device), seed)


def make_packed_agent(agent: AgentSpec, temperature: TemperatureSpec | Sequence[TemperatureSpec], obs_dim: int,
                      action_dim: int, device: torch.device, seeds: Sequence[int]) -> PackedAgent:
    """The pack of ``seeds``, each member initialised exactly as its single-seed agent; ``temperature``: one rule for
    all, or one per member differing only in ``TemperatureSpec.MEMBER_FIELDS`` (a pack by shape)."""
    rules = [temperature] * len(seeds) if isinstance(temperature, TemperatureSpec) else list(temperature)
    if len(rules) != len(seeds):
        raise ValueError(f"temperature: {len(rules)} rules for a pack of {len(seeds)} members")
    return PackedAgent([make_agent(agent, t, obs_dim, action_dim, device, s) for t, s in zip(rules, seeds)])


def load_policy(directory: str | os.PathLike, device: str | torch.device = "cpu") -> tuple[Agent, Manifest]:
    """``(agent, manifest)`` a checkpoint or policy snapshot describes, its modules loaded (an intermediate
    snapshot's other modules keep their seeded initialisation; format 1 upgraded). Raises CheckpointError for bad
    files, ValueError for a snapshot without the modules needed to act."""
    state, manifest = load_checkpoint(directory, map_location=device, formats=SNAPSHOT_FORMATS)
    (spec,) = manifest.require(Path(directory) / MANIFEST_FILE, "run")
    if manifest.format_version == 1:
        state = {m: {FORMAT1_RENAMES[m].get(n, n): v for n, v in s.items()} if m in FORMAT1_RENAMES else s
                 for m, s in state.items()}
    agent = make_agent(spec.agent, spec.temperature, manifest.obs_dim, manifest.action_dim, torch.device(device),
                       spec.seed)
    missing = [n for n in agent.acting_modules if n not in state]
    if missing:
        raise ValueError(f"{directory}: snapshot lacks the modules {missing} needed to act")
    for name, module in agent.modules().items():
        if name in state:
            module.load_state_dict(state[name])
    return agent, manifest


def load_policies(directories: Sequence[str | os.PathLike], device: str | torch.device = "cpu"
                  ) -> tuple[PackedAgent, list[Manifest]]:
    """``(pack, manifests)`` of several snapshots of one configuration (a group's seeds, in this order): one call
    each acts, gives distributions or Q values for all; raises as :func:`load_policy`, or for mixed configurations."""
    loaded = [load_policy(d, device) for d in directories]
    return PackedAgent([agent for agent, _ in loaded]), [m for _, m in loaded]
