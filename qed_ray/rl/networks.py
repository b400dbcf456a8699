"""Network building blocks shared by SAC-LN and MAD-SAC: MLPs, the tanh-Gaussian actor, twin critics.

Modules only: no optimisers, no environment objects, no random draws (noise is an input, so every forward is a
pure function of parameters and inputs and can be called through ``torch.func.functional_call`` and ``vmap``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

LOG2 = math.log(2.0)
HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)
MISH_EXP_MAX = 20.0  # beyond it n / (n + 2) rounds to 1 in float32 and float64 alike: Mish(x) = x there


def _mish_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e, n)``: e = exp(x), its exponent clamped at :data:`MISH_EXP_MAX` (so n never overflows), n = e (e + 2)."""
    e = torch.exp(x.clamp(max=MISH_EXP_MAX))
    return e, e * (e + 2.0)


def mish_exp_form(x: torch.Tensor) -> torch.Tensor:
    """Mish as x n / (n + 2) (:func:`mish`'s compiled forward)."""
    _, n = _mish_parts(x)
    return x * (n / (n + 2.0))


def mish_exp_form_backward(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` times Mish'(x) = w + x sigmoid(x) (1 - w)(1 + w) with 1 - w = 2 / (n + 2) (:func:`mish`'s compiled
    backward)."""
    e, n = _mish_parts(x)
    r = 2.0 / (n + 2.0)  # 1 - w
    return grad * ((1.0 - r) + x * (e / (e + 1.0)) * r * (2.0 - r))


class _CompiledMish(torch.autograd.Function):
    """Mish as inductor should see it: the one-exponential forward and the closed-form backward
    Mish'(x) = w + x sigmoid(x) (1 - w)(1 + w), w = n / (n + 2), 1 - w = 2 / (n + 2). Plain element-wise operations
    that inductor fuses, with their bias and LayerNorm neighbours, into loops with one exponential; it cannot fuse
    the opaque ``aten::mish``, which was ~40% of a CPU update. (Autograd through the formula would difference two
    nearly equal terms of size 1/n and lose ~1e-5 of the gradient near x = 20, hence the explicit backward.)
    ``generate_vmap_rule``: the packs compile their vmapped per-seed functions."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return mish_exp_form(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return mish_exp_form_backward(x, grad)


def mish(x: torch.Tensor) -> torch.Tensor:
    """Mish, x tanh(softplus(x)): compiled, in its one-exponential algebraic form x n / (n + 2), n = e (e + 2),
    e = exp(x) (exact: tanh(log(1 + e)) = ((1 + e)^2 - 1) / ((1 + e)^2 + 1); :class:`_CompiledMish`); eager, PyTorch's
    ``aten::mish``, bit for bit the former ``nn.Mish``. On the busy 2-core machine the eager formula's extra passes
    over memory cost 1.04x to 1.5x per update, and an autograd.Function under ``vmap`` (packs) 1.26x even around
    ``aten::mish`` (interleaved A/B in one process), so eager keeps PyTorch's kernel. Above the exponent clamp the
    ratio is 1 and the result is x, as float32 Mish gives; for very negative x, e underflows and the result goes to
    -0, within float32 of the true value (|Mish(x)| < |x| e^x). No data-dependent branch (``vmap``, CUDA graphs)."""
    return _CompiledMish.apply(x) if torch.compiler.is_compiling() else F.mish(x)


class Mish(nn.Module):
    """:func:`mish` as a module (parameter-free, so state dicts are those of ``nn.Mish``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mish(x)


def activation(name: str) -> nn.Module:
    """``mish`` (MAD-TD / TD-MPC2 default; :func:`mish`) or ``relu``."""
    return {"mish": Mish, "relu": nn.ReLU}[name]()


def mlp(in_dim: int, hidden: int, depth: int, out_dim: int, layer_norm: bool, act: str = "mish") -> nn.Sequential:
    """``depth`` blocks of Linear -> [LayerNorm] -> act, then a plain Linear to ``out_dim``.

    LayerNorm in the critics keeps Q bounded when queried off the data (paper Sec. 5.2, SAC-LN; Hussing et al.
    2024); the actor has none (paper App. B).
    """
    layers: list[nn.Module] = []
    d = in_dim
    for _ in range(depth):
        layers.append(nn.Linear(d, hidden))
        if layer_norm:
            layers.append(nn.LayerNorm(hidden))
        layers.append(activation(act))
        d = hidden
    layers.append(nn.Linear(d, out_dim))
    return nn.Sequential(*layers)


def mlp_state_action(net: nn.Sequential, x: torch.Tensor, a: torch.Tensor, repeats: int = 1) -> torch.Tensor:
    """``net(cat[x, a])`` where each row of ``x`` [B, D] pairs with ``repeats`` consecutive rows of ``a``.

    With ``repeats`` = 1 this is the plain concatenation. With ``repeats`` = N (``a`` is [B*N, A], state-major)
    the first layer is split as ``W [x; a] + b = (W_x x + b) + W_a a`` and ``W_x x + b`` is computed once per
    state, then repeated: the same function as ``net(cat[x.repeat_interleave(N), a])`` up to float rounding, with
    the state term's FLOPs divided by N (QED's N policy samples per state, paper Sec. 5.1).
    """
    if repeats == 1:
        return net(torch.cat([x, a], dim=-1))
    first = net[0]
    b, d = x.shape
    hx = F.linear(x, first.weight[:, :d], first.bias)  # [B, H], once per state
    ha = F.linear(a, first.weight[:, d:])  # [B * repeats, H]
    h = (ha.unflatten(0, (b, repeats)) + hx.unsqueeze(1)).flatten(0, 1)  # broadcast: no repeated copy of hx
    for layer in list(net)[1:]:
        h = layer(h)
    return h


def tanh_log_det_jacobian(u: torch.Tensor) -> torch.Tensor:
    """log(1 - tanh(u)^2) computed stably as 2 (log 2 - u - softplus(-2u)); shape preserved."""
    return 2.0 * (LOG2 - u - F.softplus(-2.0 * u))


def squashed_sample(mu: torch.Tensor, log_std: torch.Tensor, eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reparameterised tanh-Gaussian sample from pre-tanh ``mu``, ``log_std`` and standard-normal ``eps`` [B, A]:
    ``(action [B, A] = tanh(mu + sigma eps), log_prob [B])`` with the tanh change of variables."""
    u = mu + log_std.exp() * eps
    # log N(u; mu, sigma) with (u - mu)/sigma = eps exactly, avoiding a division.
    gauss = -0.5 * eps.pow(2) - log_std - HALF_LOG_2PI
    log_prob = (gauss - tanh_log_det_jacobian(u)).sum(-1)
    return torch.tanh(u), log_prob


class TanhGaussianActor(nn.Module):
    """pi(a|s): pre-tanh u ~ N(mu(s), diag sigma(s)^2), a = tanh(u) (paper Sec. 2, App. B); the log-std is bounded
    smoothly to [log_std_min, log_std_max] with a tanh rescale, so gradients never vanish at a hard clip."""

    def __init__(self, in_dim: int, action_dim: int, hidden: int, depth: int, act: str,
                 log_std_min: float, log_std_max: float):
        super().__init__()
        self.net = mlp(in_dim, hidden, depth, 2 * action_dim, layer_norm=False, act=act)
        self.action_dim = action_dim
        self.log_std_min = log_std_min
        self.log_std_max = log_std_max

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-tanh ``(mu, log_std)`` [B, A]."""
        mu, raw = self.net(x).chunk(2, dim=-1)
        log_std = self.log_std_min + 0.5 * (self.log_std_max - self.log_std_min) * (torch.tanh(raw) + 1.0)
        return mu, log_std

    def sample(self, x: torch.Tensor, eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(action [B, A], log_prob [B])`` with noise ``eps`` [B, A]."""
        return squashed_sample(*self(x), eps)

    def mode(self, x: torch.Tensor) -> torch.Tensor:
        """The deterministic action tanh(mu) [B, A]."""
        return torch.tanh(self(x)[0])


class TwinCritic(nn.Module):
    """Two independent Q(s, a) MLPs with LayerNorm (the double-Q trick; QED reads their disagreement)."""

    def __init__(self, in_dim: int, action_dim: int, hidden: int, depth: int, act: str, layer_norm: bool = True):
        super().__init__()
        self.q1 = mlp(in_dim + action_dim, hidden, depth, 1, layer_norm, act)
        self.q2 = mlp(in_dim + action_dim, hidden, depth, 1, layer_norm, act)

    def forward(self, x: torch.Tensor, a: torch.Tensor, repeats: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q1, q2)`` [B * repeats] (:func:`mlp_state_action`)."""
        return (mlp_state_action(self.q1, x, a, repeats).squeeze(-1),
                mlp_state_action(self.q2, x, a, repeats).squeeze(-1))


@torch.no_grad()
def polyak_lerp_(target: list[torch.Tensor], online: list[torch.Tensor], rate: float) -> None:
    """target <- (1 - rate) * target + rate * online, in place, one fused foreach call (element-wise, so stacked
    seeds stay independent)."""
    torch._foreach_lerp_(target, online, rate)


def freeze(module: nn.Module) -> nn.Module:
    """Marks every parameter as not requiring grad (targets are moved by Polyak only)."""
    for p in module.parameters():
        p.requires_grad_(False)
    return module


def make_adam(params, lr: float, device: torch.device) -> torch.optim.Adam:
    """Adam with the ``fused`` step (one kernel per group, no per-tensor Python: ~1 ms of a 256/256 CPU update
    against ``foreach``), ``capturable`` on CUDA (step counters stay on the device and the step has no host sync, so
    a CUDA graph can replay it). The default Adam's update rule, rounded differently (~1e-7 a step)."""
    return torch.optim.Adam(params, lr=lr, fused=True, capturable=torch.device(device).type == "cuda")


@torch.no_grad()
def per_seed_clip_(grads: list[torch.Tensor | None], max_norm: float) -> torch.Tensor:
    """Clips the gradients of S stacked seeds in place, each seed by its own global norm over all its tensors.

    ``torch.nn.utils.clip_grad_norm_`` over stacked [S, ...] tensors would compute one norm across the seeds and
    couple them; here seed s is scaled by min(1, max_norm / (norm_s + 1e-6)) exactly as ``clip_grad_norm_``
    scales a single seed's gradients (paper App. B: 20). ``grads``: [S, ...] of one optimiser's stacked parameters
    (None skipped); returns the [S] pre-clip global norms.
    """
    present = [g for g in grads if g is not None]
    norms = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.flatten(1), dim=1) for g in present]),
                                     dim=0)
    coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    for g in present:
        g.mul_(coef.view(-1, *([1] * (g.dim() - 1))))
    return norms


def require_fp32_matmul() -> None:
    """Full-FP32 matrix products for every critic pass (TF32 off on CUDA matmul and cuDNN).

    QED reads |Q1 - Q2| near the alpha_TE floor; TF32 rounding adds ~3.6e-4 |Q| of independent noise per head,
    which at |Q| ~ 100 inflates alpha several-fold (paper Sec. 5.1's disagreement would measure rounding). The
    TD target needs the same precision. Called where agents and trainers are built, never at import.
    """
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
