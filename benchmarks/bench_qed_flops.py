"""Benchmark: FLOPs and CPU time of one QED alpha() call, straightforward formula vs the exact rewrite.

QED's alpha(s) reads N policy samples per state (paper Sec. 5.1). The straightforward formula repeats every state
N times and runs the actor and both critic heads on B x N rows; the rewrite runs the actor once per state and
splits each critic head's first layer as W_s s + W_a a with W_s s once per state (MAD-SAC: on the latent). Both
give the same alpha up to float rounding; this prints the FLOPs of each (``torch.utils.flop_counter``), the
relative difference of the alphas, and the median CPU time per call.

Run: ``.venv/bin/python benchmarks/bench_qed_flops.py [--hidden 512 --batch 512 --repeats 5]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from qed_ray.rl.agents import make_agent
from qed_ray.spec.config import TemperatureSpec, agent_spec

OBS, ACT = 17, 6  # cheetah-run


def alpha_call(agent, states: torch.Tensor, eps: torch.Tensor, share: bool) -> torch.Tensor:
    """One alpha() call at ``states`` with the online critic pair."""
    p = agent.params()
    return agent.fn.alpha(p["temperature"], p["actor"], p["critic"], states, eps, share_state_terms=share)


def flops(agent, states, eps, share: bool) -> int:
    """Total FLOPs counted by ``torch.utils.flop_counter`` over one call."""
    with FlopCounterMode(display=False) as counter:
        alpha_call(agent, states, eps, share)
    return counter.get_total_flops()


def cpu_ms(agent, states, eps, share: bool, repeats: int) -> float:
    """Median process CPU milliseconds per call over ``repeats`` calls (one warm-up call first)."""
    alpha_call(agent, states, eps, share)
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        alpha_call(agent, states, eps, share)
        times.append(time.process_time() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    """Prints one line per agent: GFLOP and ms per call for both formulas, the reductions, max relative alpha gap."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--n-actions", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    temp = TemperatureSpec(kind="qed", k=0.1, n_actions=args.n_actions, alpha_max=1e6, init_alpha=1e-8)
    print(f"one alpha() call: {args.batch} states x {args.n_actions} samples, width {args.hidden}, obs/act "
          f"{OBS}/{ACT}, CPU, {torch.get_num_threads()} thread(s), torch {torch.__version__}")
    for name in ("sac_ln", "mad_sac"):
        spec = agent_spec(name=name, hidden=args.hidden, batch_size=args.batch)
        agent = make_agent(spec, temp, OBS, ACT, torch.device("cpu"), 0)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            states = agent.encode(torch.randn(args.batch, OBS, generator=g))
        eps = torch.randn(args.batch * args.n_actions, ACT, generator=g)
        f_slow, f_fast = flops(agent, states, eps, False), flops(agent, states, eps, True)
        t_slow, t_fast = (cpu_ms(agent, states, eps, s, args.repeats) for s in (False, True))
        slow, fast = alpha_call(agent, states, eps, False), alpha_call(agent, states, eps, True)
        rel = float(((fast - slow).abs() / slow.abs()).max())
        print(f"{name:8s} straightforward {f_slow / 1e9:6.2f} GFLOP {t_slow:7.1f} ms | rewrite {f_fast / 1e9:6.2f} "
              f"GFLOP {t_fast:7.1f} ms | FLOPs -{100 * (1 - f_fast / f_slow):.1f}%, CPU time x{t_slow / t_fast:.2f} "
              f"faster | max relative alpha difference {rel:.1e}", flush=True)


if __name__ == "__main__":
    main()
