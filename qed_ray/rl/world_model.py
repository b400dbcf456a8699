"""MAD-SAC's latent world model and binned critic (paper Sec. 5.2; MAD-TD's networks in TD-MPC2's layout).

"Block" below means Linear -> LayerNorm -> activation, the building block of :func:`qed_ray.rl.networks.mlp`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qed_ray.rl.hlgauss import ZERO_PRIOR_SCALE, HLGauss
from qed_ray.rl.networks import mlp, mlp_state_action


class SimNorm(nn.Module):
    """Simplicial normalisation: softmax over consecutive groups of ``group`` features (TD-MPC2, MAD: 8). The latent
    becomes ``dim / group`` probability simplices, which bounds it and makes the self-prediction loss a per-group
    cross-entropy (MAD-TD's self-prediction term)."""

    def __init__(self, group: int = 8):
        super().__init__()
        if group < 2:
            raise ValueError(f"simnorm_group: {group} must be >= 2")
        self.group = group

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % self.group:
            raise ValueError(f"SimNorm input: last dim {x.shape[-1]} is not a multiple of group {self.group}")
        return x.unflatten(-1, (x.shape[-1] // self.group, self.group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., D] -> [..., D] with every group of ``group`` entries summing to 1."""
        return F.softmax(self._grouped(x), dim=-1).flatten(-2)

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        """[..., D] -> [..., D] per-group log-softmax (numerically stable input to the latent cross-entropy)."""
        return F.log_softmax(self._grouped(x), dim=-1).flatten(-2)


class Encoder(nn.Module):
    """obs [B, O] -> latent [B, latent_dim]: Block(hidden), Linear(latent), LayerNorm, SimNorm (MAD-TD)."""

    def __init__(self, obs_dim: int, hidden: int, latent_dim: int, group: int, act: str):
        super().__init__()
        self.net = mlp(obs_dim, hidden, 1, latent_dim, layer_norm=True, act=act)
        self.norm = nn.LayerNorm(latent_dim)
        self.simnorm = SimNorm(group)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """Latent simplices [B, latent_dim] of observations [B, O]."""
        return self.simnorm(self.norm(self.net(obs)))


class Dynamics(nn.Module):
    """One-step latent model over concat(z, a): Block x depth, Linear(latent), LayerNorm, SimNorm (MAD-TD)."""

    def __init__(self, latent_dim: int, action_dim: int, hidden: int, depth: int, group: int, act: str):
        super().__init__()
        self.net = mlp(latent_dim + action_dim, hidden, depth, latent_dim, layer_norm=True, act=act)
        self.norm = nn.LayerNorm(latent_dim)
        self.simnorm = SimNorm(group)

    def forward(self, z: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Predicted next latent ``(probs, log_probs)`` [B, L] (simplices and their per-group log-softmax) from
        z [B, L] and a [B, A]."""
        h = self.norm(self.net(torch.cat([z, a], dim=-1)))
        return self.simnorm(h), self.simnorm.log_prob(h)


class RewardHead(nn.Module):
    """Scalar reward r(z, a) over concat(z, a): Block x depth, Linear(1); trained with MSE (MAD-TD)."""

    def __init__(self, latent_dim: int, action_dim: int, hidden: int, depth: int, act: str):
        super().__init__()
        self.net = mlp(latent_dim + action_dim, hidden, depth, 1, layer_norm=True, act=act)

    def forward(self, z: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Predicted reward [B] from z [B, L] and a [B, A]."""
        return self.net(torch.cat([z, a], dim=-1)).squeeze(-1)


class HLGaussCritic(nn.Module):
    """Two independent HL-Gauss Q heads over concat(z, a), each Block x depth -> Linear(num_bins) (MAD-TD).

    A fixed zero prior (17 x HL-Gauss(0), a buffer, never trained) is added to both heads' logits so the
    expected value starts near 0: without it, near-uniform logits give E[Q] a random spread over the whole
    support at initialisation. ``hl``, the support, is a submodule so its buffers follow ``.to(device)``.
    """

    def __init__(self, latent_dim: int, action_dim: int, hidden: int, depth: int, act: str, hl: HLGauss):
        super().__init__()
        self.hl = hl
        self.q1 = mlp(latent_dim + action_dim, hidden, depth, hl.num_bins, layer_norm=True, act=act)
        self.q2 = mlp(latent_dim + action_dim, hidden, depth, hl.num_bins, layer_norm=True, act=act)
        self.register_buffer("prior", self.hl.zero_prior(ZERO_PRIOR_SCALE))

    def forward(self, z: torch.Tensor, a: torch.Tensor, repeats: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Both heads' logits ``(l1, l2)`` [B * repeats, num_bins], prior included (``repeats``:
        :func:`~qed_ray.rl.networks.mlp_state_action`)."""
        return (mlp_state_action(self.q1, z, a, repeats) + self.prior,
                mlp_state_action(self.q2, z, a, repeats) + self.prior)

    def values(self, z: torch.Tensor, a: torch.Tensor, repeats: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Expected values ``(E[Q1], E[Q2])``, each [B * repeats]."""
        l1, l2 = self(z, a, repeats)
        return self.hl.decode(l1), self.hl.decode(l2)
