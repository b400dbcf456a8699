"""The seed axis of an update: where its parameters live and how its gradient steps are taken.

An agent's update rule (``learn``) is written once against :class:`Learner`. A pack
(:class:`~qed_ray.rl.agents.packed.PackedAgent`) is the learner of S seeds' stacked tensors, mapping every loss over
the seed axis, so a packed update runs exactly the per-seed maths of one seed alone (the tests' single-seed learner
checks that).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

Params = dict[str, torch.Tensor]


class Learner(Protocol):
    """Where an update's parameters live and how its gradient steps are taken (a pack: tensors stacked [S, ...] over
    S seeds)."""

    updates: int  # update() calls so far; MAD-SAC's model_every reads it (one counter for all seeds of a pack)
    memo: dict[str, torch.Tensor]  # what an update keeps for the next (MAD-SAC: the last model step's metrics)

    def params(self) -> dict[str, Params]:
        """Live trainable parameters per module name, and the temperature state."""

    def target_params(self) -> Params:
        """The target critic's parameters."""

    def per_seed(self, fn: Callable) -> Callable:
        """``fn`` applied to each seed's slice (``vmap(fn)`` for a pack)."""

    def step(self, loss: torch.Tensor, *groups: tuple[str, float | None]) -> list[torch.Tensor]:
        """Backward of ``loss`` (summed over seeds), then per group ``(optimiser name, clip or None)`` the (clipped)
        Adam step; returns the pre-clip gradient norms of the clipped groups, in order."""

    def polyak(self, rate: float) -> None:
        """Moves the target critic towards the online one by ``rate``."""
