"""The toy's settings and reward (paper Sec. 5.2): what the experiment, its learner and its plots share."""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

LOG_STD_BOUNDS = (-5.0, 2.0)


class ToyConfig(BaseModel):
    """The toy's settings; defaults are the paper's values (Sec. 5.2) plus documented choices."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    action_low: float = -5.0
    action_high: float = 5.0
    modes: tuple[float, float] = (-2.0, 2.0)
    mode_weights: tuple[float, float] = (0.5, 0.5)
    variance: float = Field(0.5, gt=0)
    reward_scale: float = Field(1.0, gt=0)
    horizon: int = Field(2, ge=1)
    gamma: float = Field(0.9, gt=0, le=1)
    horizon_mode: Literal["step_terminal", "state_terminal", "state_bootstrap"] = "step_terminal"
    buffer_support: tuple[float, float] = (-3.0, 0.0)
    buffer_size: int = Field(1000, ge=1)
    batch_size: int = Field(256, ge=1)
    hidden: int = Field(64, ge=1)
    depth: int = Field(2, ge=1)
    layer_norm: bool = False
    critic_lr: float = Field(3e-4, gt=0)
    actor_lr: float = Field(3e-4, gt=0)
    polyak: float = Field(0.005, gt=0, le=1)
    init_mean: float = 0.0
    init_log_std: float = Field(0.0, gt=LOG_STD_BOUNDS[0], lt=LOG_STD_BOUNDS[1])
    snapshot_every: int = Field(50, ge=1)
    grid_points: int = Field(201, ge=2)

    @model_validator(mode="after")
    def _check_ranges(self) -> "ToyConfig":
        if not self.action_low < self.action_high:
            raise ValueError(f"action_low must be < action_high, got {self.action_low} and {self.action_high}")
        lo, hi = self.buffer_support
        if not self.action_low <= lo < hi <= self.action_high:
            raise ValueError(f"buffer_support must be an interval inside ({self.action_low}, "
                             f"{self.action_high}), got {self.buffer_support}")
        if min(self.mode_weights) < 0 or not math.isclose(sum(self.mode_weights), 1.0):
            raise ValueError(f"mode_weights must be >= 0 and sum to 1, got {self.mode_weights}")
        return self

    @property
    def center(self) -> float:
        return 0.5 * (self.action_low + self.action_high)

    @property
    def half_width(self) -> float:
        """Half-width of the action interval (the tanh scale)."""
        return 0.5 * (self.action_high - self.action_low)


def toy_reward(a: np.ndarray, cfg: ToyConfig | None = None) -> np.ndarray:
    """Bimodal reward ``r(a) = reward_scale * sum_k w_k N(a; m_k, variance)`` (Sec. 5.2), ``a``'s shape."""
    cfg = cfg or ToyConfig()
    a = np.asarray(a, dtype=float)
    norm = cfg.reward_scale / math.sqrt(2 * math.pi * cfg.variance)
    return sum(w * norm * np.exp(-(a - m) ** 2 / (2 * cfg.variance)) for w, m in zip(cfg.mode_weights, cfg.modes))
