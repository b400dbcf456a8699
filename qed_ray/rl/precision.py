"""The matrix-product precision of a run (``train.precision``) and of QED's critic passes.

``fp32``: IEEE FP32 everywhere. ``3xtf32``: QED's no-grad critic passes as three TF32 tensor-core products per layer
(FP32 accuracy; every other pass stays FP32). ``tf32``: TF32 for every FP32 product (opt-in, for ablations). On a
CPU the tensor cores are emulated exactly; CPU *runs* are FP32 (:func:`resolve_precision`). Paper Sec. 5.1 reads
|Q1 - Q2| near the alpha_TE floor, so rounding in the critics feeds alpha: benchmarks/README.md, "The precision
gate", holds the numerics, the rounding model, the CUDA-graph and compile caveats and the unwritten fused kernel.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Literal, get_args

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from qed_ray.spec.config import Precision
from qed_ray.rl.networks import require_fp32_matmul

CHOICES: tuple[str, ...] = get_args(Precision)  # train.precision: "auto", then the precisions
PRECISIONS = CHOICES[1:]
# What ``train.precision: auto`` trains on CUDA: the fastest precision that passed the numerics gate on a GPU.
# The gate has run on CPU emulation only, so FP32 until benchmarks/gpu_check.sh's gate step passes; then this one
# line becomes "3xtf32" (benchmarks/README.md, "The precision gate").
CUDA_DEFAULT = "fp32"
Rounding = Literal["rna", "rne", "rz"]
TF32_DROPPED_BITS = 13  # FP32 has a 23-bit mantissa, TF32 a 10-bit one
_LOW = (1 << TF32_DROPPED_BITS) - 1  # 0x1FFF
_HALF = 1 << (TF32_DROPPED_BITS - 1)  # 0x1000


def round_tf32(x: torch.Tensor, rounding: Rounding = "rna") -> torch.Tensor:
    """``x`` (float32) rounded to TF32's 10-bit mantissa, kept in float32 (the low 13 mantissa bits zero).

    ``rna``: nearest, ties away from zero; ``rne``: nearest, ties to even; ``rz``: toward zero. A carry out of the
    mantissa moves to the next binade, as it should; inf and NaN pass unchanged. Integer operations on the bit
    pattern only, so it runs under ``vmap`` and on any device.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"round_tf32: needs float32, got {x.dtype}")
    bits = x.view(torch.int32)
    if rounding == "rna":
        bits = bits + _HALF
    elif rounding == "rne":
        bits = bits + (_HALF - 1) + ((bits >> TF32_DROPPED_BITS) & 1)
    elif rounding != "rz":
        raise ValueError(f"rounding: {rounding!r} is not one of 'rna', 'rne', 'rz'")
    rounded = (bits & ~_LOW).view(torch.float32)
    return torch.where(torch.isfinite(x), rounded, x)


def split_tf32(x: torch.Tensor, rounding: Rounding = "rna") -> tuple[torch.Tensor, torch.Tensor]:
    """``(hi, lo)``: hi = tf32(x) and lo = tf32(x - hi), both TF32 values in float32; x - hi is exact in FP32, so
    hi + lo equals x to ~2^-22 relative (3xTF32's operand split)."""
    hi = round_tf32(x, rounding)
    return hi, round_tf32(x - hi, rounding)


def tf32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                emulate: bool | None = None) -> torch.Tensor:
    """``F.linear`` with TF32 products (one tensor-core pass on CUDA; emulated elsewhere, or when ``emulate``)."""
    if _emulated(x, emulate):
        return F.linear(round_tf32(x), round_tf32(weight), bias)
    with _tf32_matmul():
        return F.linear(x, weight, bias)


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 emulate: bool | None = None) -> torch.Tensor:
    """``F.linear`` as 3xTF32: lo(x) hi(W) + hi(x) lo(W) + hi(x) hi(W) (+ bias), the small products first.

    Forward-only (the split has no gradient). On CUDA (unless ``emulate``) lo stays FP32 for the tensor cores' own
    conversion (an error of ~2^-11 of lo, ~2^-22 of x); elsewhere lo is rounded by :func:`round_tf32`.
    """
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        raise RuntimeError("split_linear: 3xTF32 products are forward-only (QED's no-grad critic passes); "
                           "call it under torch.no_grad()")
    emulated = _emulated(x, emulate)
    x_hi, w_hi = round_tf32(x), round_tf32(weight)
    x_lo, w_lo = x - x_hi, weight - w_hi
    if emulated:
        x_lo, w_lo = round_tf32(x_lo), round_tf32(w_lo)
    with contextlib.nullcontext() if emulated else _tf32_matmul():
        small = F.linear(x_lo, w_hi) + F.linear(x_hi, w_lo)
        return small + F.linear(x_hi, w_hi, bias)


def _emulated(x: torch.Tensor, emulate: bool | None) -> bool:
    return x.device.type != "cuda" if emulate is None else emulate


@contextlib.contextmanager
def _tf32_matmul() -> Iterator[None]:
    """TF32 tensor-core matmuls inside, the previous setting restored after (cuBLAS reads it per call)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


class _LinearProducts(TorchFunctionMode):
    """Routes every ``F.linear`` (``nn.Linear`` and the split first layer of ``mlp_state_action``) inside the
    scope through ``linear``; every other op runs as it is."""

    def __init__(self, linear, emulate: bool | None):
        super().__init__()
        self.linear, self.emulate = linear, emulate

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            call = {**dict(zip(("input", "weight", "bias"), args)), **kwargs}
            return self.linear(call["input"], call["weight"], call.get("bias"), emulate=self.emulate)
        return func(*args, **kwargs)


def qed_products(precision: str, emulate: bool | None = None) -> contextlib.AbstractContextManager:
    """Scope in which the linear layers of a critic pass run at ``precision`` (LayerNorm, activations and HL-Gauss
    read-outs do not change): tensor cores on CUDA, the exact emulation elsewhere or wherever ``emulate``."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: {precision!r} is not one of {', '.join(PRECISIONS)}")
    if precision == "fp32":
        return contextlib.nullcontext()
    return _LinearProducts(split_linear if precision == "3xtf32" else tf32_linear, emulate)


def resolve_precision(precision: str, device: torch.device | str, update_mode: str = "off") -> tuple[str, str]:
    """``(precision, reason)``: what a run trains at, from ``train.precision``, its device and its resolved update
    mode; raises ValueError for an unknown precision, or ``3xtf32`` with a compiled update on CUDA."""
    if precision not in CHOICES:
        raise ValueError(f"train.precision: {precision!r} is not one of {', '.join(CHOICES)}")
    device = torch.device(device)
    if device.type != "cuda":
        if precision in ("auto", "fp32"):
            return "fp32", f"{precision} on {device.type}"
        return "fp32", (f"train.precision {precision!r} is ignored on {device.type}: it has no TF32 tensor cores, "
                        f"every product is IEEE FP32")
    if precision == "auto":
        return CUDA_DEFAULT, f"auto on cuda: {CUDA_DEFAULT} until the 3xtf32 gate passes on a GPU"
    if precision == "3xtf32" and update_mode == "compile":
        raise ValueError("train.precision: '3xtf32' switches TF32 on around single products, which torch.compile "
                         "cannot keep per call; use train.compile auto, graph or off with it (or precision fp32 "
                         "or tf32 with compile)")
    return precision, {"fp32": "IEEE FP32 products", "3xtf32": "QED's critic passes in 3xTF32, the rest FP32",
                       "tf32": "TF32 for every FP32 product"}[precision]


def set_run_precision(fn, precision: str, device: torch.device | str, update_mode: str = "off") -> tuple[str, str]:
    """Resolves ``train.precision``, sets the process-wide matmul precision and QED's critic products on the
    agent's functions ``fn``; returns ``(precision, reason)`` for the run's log."""
    precision, why = resolve_precision(precision, device, update_mode)
    apply_matmul_precision(precision)
    fn.qed_precision = precision
    return precision, why


def apply_matmul_precision(precision: str) -> None:
    """TF32 everywhere for ``tf32``; IEEE FP32 otherwise (``3xtf32`` scopes its products itself)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: {precision!r} is not one of {', '.join(PRECISIONS)}")
    if precision != "tf32":
        require_fp32_matmul()
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("high")
