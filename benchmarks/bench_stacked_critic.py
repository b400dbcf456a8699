"""Benchmark: the twin critics as two heads (``rl/networks.py::TwinCritic``, today's) against one stacked module (both
heads' weights stacked, one batched product per layer: ``baddbmm``, one LayerNorm, one Mish over [2, rows, width]).

Forward and backward of the sum of squares of both heads' Q over ``rows`` state-action rows (256: a TD loss at batch
256; 2048: QED's 8 samples per state), cheetah-run's sizes (17 + 6 inputs), critic depth 2, LayerNorm and Mish as
SAC-LN's. The stacked module is built from the same parameters, so both compute the same function (the max abs
difference is printed). One torch thread; the two alternate call by call (``--calls`` each, after one untimed), so a
shared machine's load hits both alike; medians of process CPU time per call. ``--compile``: the same with both
compiled by ``torch.compile`` (Mish in the package's compiled form), compile time printed apart.

Run: ``nice -n 5 .venv/bin/python benchmarks/bench_stacked_critic.py [--hidden 256] [--compile]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from qed_ray.rl.networks import TwinCritic, mish

OBS, ACT = 17, 6


def stacked(critic: TwinCritic):
    """The stacked twin of ``critic``: a function of [rows, in] -> [2, rows] with both heads' parameters stacked
    ([2, ...]), each layer one batched call."""
    layers = []
    for a, b in zip(critic.q1, critic.q2):
        if isinstance(a, (nn.Linear, nn.LayerNorm)):
            w = torch.stack([a.weight.detach(), b.weight.detach()]).requires_grad_()
            c = torch.stack([a.bias.detach(), b.bias.detach()]).requires_grad_()
            layers.append((type(a), w, c))
        else:
            layers.append((None, None, None))

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = x.expand(2, *x.shape)
        for kind, w, c in layers:
            if kind is nn.Linear:
                h = torch.baddbmm(c.unsqueeze(1), h, w.transpose(1, 2))
            elif kind is nn.LayerNorm:
                h = torch.addcmul(c.unsqueeze(1), F.layer_norm(h, h.shape[-1:]), w.unsqueeze(1))
            else:
                h = mish(h)
        return h.squeeze(-1)

    return forward


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--rows", type=int, nargs="+", default=[256, 2048])
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--compile", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    critic = TwinCritic(OBS, ACT, args.hidden, 2, "mish")
    two = lambda x: torch.stack([critic.q1(x).squeeze(-1), critic.q2(x).squeeze(-1)])  # noqa: E731
    one = stacked(critic)
    x_all = torch.randn(max(args.rows), OBS + ACT)
    with torch.no_grad():
        print(f"max abs difference of Q, stacked vs two heads: {(one(x_all) - two(x_all)).abs().max().item():.2e}")
    fns = {"two heads": two, "stacked": one}
    if args.compile:
        fns = {k: torch.compile(f) for k, f in fns.items()}
    print(f"width {args.hidden}, depth 2, LayerNorm, Mish, {'compiled' if args.compile else 'eager'}, 1 thread; "
          f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    for rows in args.rows:
        x = x_all[:rows]
        times: dict[str, list[float]] = {k: [] for k in fns}
        for r in range(args.calls + 1):
            for name, fn in fns.items():
                c = time.process_time()
                fn(x).pow(2).mean().backward()
                if r:
                    times[name].append(time.process_time() - c)
                elif args.compile:
                    print(f"  rows {rows}: first call of {name} (compile) {time.process_time() - c:.1f} CPU s")
        ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        print(f"rows {rows}: two heads {ms['two heads']:.2f} ms, stacked {ms['stacked']:.2f} ms per forward + "
              f"backward (CPU, median of {args.calls}); two heads / stacked {ms['two heads'] / ms['stacked']:.3f}",
              flush=True)
    print(f"load average at end {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
