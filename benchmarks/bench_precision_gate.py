"""The numerics gate of QED's precisions (benchmarks/precision_gate.py): alpha against FP64, per case, as a table.

Per case (|Q| level x alpha regime: near the alpha_TE floor, mid-range, near alpha_max) and precision: the mean and
max over states of |alpha - alpha64| / alpha64 from the whole QED pass (both heads' layers, |Q1 - Q2| over N = 8
samples, the tau = 0.9 expectile, the clip), and the per-head relative Q error. A precision passes when its mean
error is at most twice FP32's on every case. Exit 0 when 3xtf32 passed, 3 when it failed, 1 on an error.

On CUDA the products run on the tensor cores and each precision's pass is captured in a CUDA graph (``--graph``, as
``benchmarks/gpu_check.sh`` runs it), then the same cases run again with the emulation (``emulated`` rows) as a
cross-check: hardware and emulated errors of the same size say the tensor cores ran what the emulation models.

Run: ``python benchmarks/bench_precision_gate.py [--device cuda] [--graph] [--quick] [--out FILE.json]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from qed_ray.rl.precision import PRECISIONS
from benchmarks.precision_gate import TOLERANCE, GateResult, GateSettings, run_gate

QUICK = GateSettings(hidden=32, states=128, q_levels=(10.0, 120.0, 400.0))


def verdicts(result: GateResult) -> list[str]:
    """One line per precision: passed or failed, and its worst ratio to FP32's mean error over the cases."""
    lines = []
    for p in PRECISIONS[1:]:
        ratios = [c.errors[p].mean / c.errors["fp32"].mean for c in result.cases]
        lines.append(f"{p}: {'PASSED' if result.passed(p) else 'FAILED'} (mean alpha error / FP32's: worst "
                     f"{max(ratios):.3g}, best {min(ratios):.3g}, limit {TOLERANCE:g}, {len(ratios)} cases)")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--graph", action="store_true", help="capture each precision's pass in a CUDA graph (CUDA)")
    p.add_argument("--quick", action="store_true", help="width 32, 128 states, |Q| 10/120/400 (seconds on a CPU)")
    p.add_argument("--hidden", type=int, default=None, help="critic width (default 512, the paper's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args()
    torch.set_num_threads(1)
    base = QUICK if args.quick else GateSettings()
    settings = dataclasses.replace(base, seed=args.seed, hidden=args.hidden or base.hidden)
    device = torch.device(args.device)
    runs = [(None, args.graph)] + ([(True, False)] if device.type == "cuda" else [])
    results = []
    for emulate, graph in runs:
        t0 = time.perf_counter()
        r = run_gate(settings, device, emulate=emulate, graph=graph)
        what = "emulated" if r.emulated else "tensor cores" + (", in a CUDA graph" if r.graph else "")
        print(f"\n## {device} ({what}): width {settings.hidden}, depth {settings.depth}, {settings.states} states x "
              f"{settings.n_actions} samples, k {settings.k}, d {settings.action_dim}, alpha_TE {settings.alpha_te}, "
              f"alpha_max {settings.alpha_max}, tau {settings.tau}; {time.perf_counter() - t0:.1f} s\n", flush=True)
        print(r.table())
        print("\n" + "\n".join(verdicts(r)), flush=True)
        results.append(r)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"torch": torch.__version__, "runs": [r.to_json() for r in results]},
                                       indent=1) + "\n")
    return 0 if results[0].passed("3xtf32") else 3


if __name__ == "__main__":
    sys.exit(main())
