"""Benchmark: the pack update compiled (``train.compile: compile``, inductor) against eager on this device.

Per (agent, temperature): a pack of ``--seeds`` seeds at width/batch 512 (synthetic cheetah-run replay, as
``gpu_bench.py``), the first compiled update's wall time (the compile), then ms per update of the compiled and of
the eager update over ``--updates`` updates after one warm-up each (update only: no act, no replay writes).

Run: ``nice -n 10 .venv/bin/python benchmarks/bench_compile.py [--agents sac_ln mad_sac] [--updates 5]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_bench import Pack, sync  # noqa: E402


def per_update_ms(pack: Pack, n: int, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        pack.run(pack.replay.indices(pack.batch, pack.on), pack.agent.noise(pack.batch, pack.on))
    sync(device)
    return (time.perf_counter() - t0) * 1000 / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--agents", nargs="+", default=["sac_ln", "mad_sac"])
    p.add_argument("--temperatures", nargs="+", default=["qed", "te"])
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--updates", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, {device}, S={args.seeds}, width/batch {args.hidden}/{args.batch}, "
          f"{args.updates} timed updates")
    print("| agent | temperature | compile s (first update) | eager ms/update | compiled ms/update | eager/compiled |")
    print("|---|---|---|---|---|---|")
    for agent in args.agents:
        for temp in args.temperatures:
            eager = Pack(agent, temp, args.seeds, "off", device, args.hidden, args.batch)
            comp = Pack(agent, temp, args.seeds, "compile", device, args.hidden, args.batch)
            t0 = time.perf_counter()
            per_update_ms(comp, 1, device)
            compile_s = time.perf_counter() - t0
            per_update_ms(eager, 1, device)
            e, c = per_update_ms(eager, args.updates, device), per_update_ms(comp, args.updates, device)
            print(f"| {agent} | {temp} | {compile_s:.1f} | {e:.0f} | {c:.0f} | {e / c:.2f} |", flush=True)


if __name__ == "__main__":
    main()
