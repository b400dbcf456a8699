"""HL-Gauss distributional regression for MAD-SAC's binned critics (paper Sec. 5.2; MAD-TD's ``hl_gauss``; the
encoding and read-out: docs/mad_sac.md, "HL-Gauss critics")."""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

# MAD adds 17 x HL-Gauss(0) to the critic logits so that E[Q] ~ 0 at initialisation (MAD-TD's binned critic).
ZERO_PRIOR_SCALE = 17.0


def cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor,
                  reduction: Literal["mean", "sum"] = "mean") -> torch.Tensor:
    """Cross-entropy -sum_i p_i log softmax(logits)_i over the bin axis: logits, target_probs [..., bins] -> [...].

    ``mean`` divides by the number of bins, as MAD-TD's ``binned_bellman_crossentropy_loss`` does: the loss is then
    about 1/num_bins of the textbook value. Adam is invariant to that scale, but the global-norm gradient clip
    (20, paper App. B) and the relative weights inside the encoder objective are not, so ``mean`` is kept to
    match the MAD-TD code the paper ran; ``sum`` is the textbook cross-entropy.
    """
    per_bin = -(target_probs * F.log_softmax(logits, dim=-1))
    if reduction == "mean":
        return per_bin.mean(-1)
    if reduction == "sum":
        return per_bin.sum(-1)
    raise ValueError(f"reduction: {reduction!r} is not one of 'mean', 'sum'")


class HLGauss(nn.Module):
    """Histogram-loss Gaussian encoder/decoder over bin centres vmin..vmax (MAD: -300..300, 151 bins of width 4.0;
    sigma 0.75 bin widths)."""

    def __init__(self, vmin: float, vmax: float, num_bins: int, sigma_ratio: float = 0.75):
        super().__init__()
        if not vmin < vmax:
            raise ValueError(f"vmin/vmax: need vmin < vmax, got vmin={vmin}, vmax={vmax}")
        if num_bins < 2:
            raise ValueError(f"num_bins: {num_bins} is too small; need at least 2")
        if not sigma_ratio > 0:
            raise ValueError(f"sigma_ratio: {sigma_ratio} must be > 0")
        self.vmin, self.vmax, self.num_bins = float(vmin), float(vmax), int(num_bins)
        self.width = (self.vmax - self.vmin) / (num_bins - 1)
        self.sigma = sigma_ratio * self.width
        centres = torch.linspace(self.vmin, self.vmax, num_bins, dtype=torch.float64)
        # Edges sit half a bin outside the outer centres, so the outer bins are as wide as the inner ones.
        edges = torch.linspace(self.vmin - self.width / 2, self.vmax + self.width / 2, num_bins + 1,
                               dtype=torch.float64)
        self.register_buffer("centres", centres.float())
        self.register_buffer("edges", edges.float())

    def encode(self, y: torch.Tensor) -> torch.Tensor:
        """Target histogram [..., bins] of scalars y [...]: Gaussian mass per bin by erf differences, renormalised
        to sum 1. Targets outside the support are clipped to [vmin, vmax] first (MAD does this silently; MadSAC
        logs :meth:`clip_fraction`)."""
        y = y.clamp(self.vmin, self.vmax).unsqueeze(-1)
        cdf = torch.erf((self.edges - y) / (math.sqrt(2.0) * self.sigma))  # [..., bins + 1]
        mass = cdf[..., 1:] - cdf[..., :-1]
        # Renormalise by the mass inside the outer edges (the tails beyond them are dropped).
        return mass / (cdf[..., -1:] - cdf[..., :1])

    def decode(self, logits: torch.Tensor) -> torch.Tensor:
        """Expected value softmax(logits) . centres: [..., bins] -> [...]."""
        return F.softmax(logits, dim=-1) @ self.centres

    def loss(self, logits: torch.Tensor, y: torch.Tensor,
             reduction: Literal["mean", "sum"] = "mean") -> torch.Tensor:
        """[B] cross-entropy of ``logits`` [B, bins] against the encoded targets y [B] (no gradient through y)."""
        return cross_entropy(logits, self.encode(y.detach()), reduction)

    def clip_fraction(self, y: torch.Tensor) -> torch.Tensor:
        """Share of targets y [B] outside [vmin, vmax] (0-d tensor, no host sync)."""
        return ((y < self.vmin) | (y > self.vmax)).float().mean()

    def zero_prior(self, scale: float = ZERO_PRIOR_SCALE) -> torch.Tensor:
        """The fixed logit prior ``scale`` x encode(0) [bins], added to critic logits so E[Q] ~ 0 at init.

        With MAD's support this puts about +8.4 on the centre bin and +3.9 on its neighbours (MAD-TD's
        prior), which dominates the small random logits of a freshly initialised head.
        """
        return scale * self.encode(torch.zeros((), device=self.centres.device))
