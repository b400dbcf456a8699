"""The seed axis of an update: where its parameters live and how its gradient steps are taken (docs/design.md,
"The packed update")."""

from __future__ import annotations

from typing import Callable, Protocol

import torch

Params = dict[str, torch.Tensor]


class Learner(Protocol):
    """Where an update's parameters live and how its gradient steps are taken (a pack: tensors stacked [S, ...])."""

    updates: int  # update() calls so far; MAD-SAC's model_every reads it (one counter for all seeds of a pack)
    memo: dict[str, torch.Tensor]  # what an update keeps for the next (MAD-SAC: the last model step's metrics)

    def params(self) -> dict[str, Params]:
        """Live trainable parameters per module name, and the temperature state."""

    def target_params(self) -> Params: ...

    def per_seed(self, fn: Callable) -> Callable:
        """``fn`` applied to each seed's slice (``vmap(fn)`` for a pack)."""

    def step(self, loss: torch.Tensor, *groups: tuple[str, float | None]) -> list[torch.Tensor]:
        """Backward of ``loss`` (summed over seeds), then per group ``(optimiser name, clip or None)`` the (clipped)
        Adam step; returns the pre-clip gradient norms of the clipped groups, in order."""

    def polyak(self, rate: float) -> None:
        """target <- (1 - rate) target + rate online."""
