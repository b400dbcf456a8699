"""Benchmark: seed-decisions/s of packed training (S seeds in one batched update) against a pack of one (a single
run), for SAC-LN and MAD-SAC with the te and QED temperatures, at the paper's sizes (512, batch 512).

One decision of a pack = one batched ``act`` for the S observations + one replay row per seed + one packed update
(per-seed replay indices and noise blocks, the vmapped update): the trainer's work per decision at UTD 1 without
the envs (synthetic observations: cheetah-run's sizes, 17/6). Each cell runs in its
own process on the CPU (so its peak RSS is its own), times whole decisions until ``--min-time`` seconds and
``--min-decisions`` have passed, after ``--warmup`` untimed ones, and reports seed-decisions per wall second and
per process-CPU second (the steadier figure on a shared machine), and the peak memory (CPU: the process's peak
RSS; CUDA: ``torch.cuda.max_memory_allocated``). It also prints the memory of a pack's replay at 1M
transitions per seed and where it would live on this device.

Run: ``nice -n 10 .venv/bin/python benchmarks/bench_pack.py [--device cuda] [--seeds 1 2 4 8]``; needs only torch,
numpy and pydantic (no dm_control), so it runs on the GPU machine as it is. JSON lines land in
``benchmarks/out/pack.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from qed_ray.rl.agents import make_packed_agent
from qed_ray.spec.config import TemperatureSpec, agent_spec
from qed_ray.rl.replay import Replay, replay_bytes, replay_device

TEMPERATURES = {"te": TemperatureSpec(kind="te"), "qed": TemperatureSpec(kind="qed", k=0.2)}
OBS, ACT = 17, 6  # cheetah-run
BUFFER = 10_000  # synthetic transitions per seed in the timed replay
TASK_DIMS = {"cheetah-run": (17, 6), "quadruped-run": (78, 12)}


def synthetic(rng: np.random.Generator, n: int) -> tuple[np.ndarray, ...]:
    """n transitions (obs, action, reward, next_obs, terminated) of the benchmark's sizes."""
    return (rng.normal(size=(n, OBS)).astype(np.float32), rng.uniform(-1, 1, (n, ACT)).astype(np.float32),
            rng.normal(size=n), rng.normal(size=(n, OBS)).astype(np.float32), np.zeros(n, bool))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Packed:
    """A pack of S seeds with its replay: one decision = batched act + S replay rows + one packed update."""

    def __init__(self, args, device: torch.device):
        spec = agent_spec(name=args.agent, hidden=args.hidden, batch_size=args.batch)
        seeds = list(range(args.seeds))
        self.agent = make_packed_agent(spec, TEMPERATURES[args.temperature], OBS, ACT, device, seeds)
        rngs = [np.random.default_rng(np.random.SeedSequence(s).spawn(2)[0]) for s in seeds]
        where = replay_device(device, replay_bytes(len(seeds), BUFFER, OBS, ACT))
        self.replay = Replay(BUFFER, OBS, ACT, rngs, device, where)
        self.on, self.batch, self.rng = np.ones(len(seeds), bool), args.batch, np.random.default_rng(0)
        for _ in range(BUFFER):
            self.replay.add(*synthetic(self.rng, len(seeds)), self.on)
        self.obs = synthetic(self.rng, len(seeds))[0]

    def decide(self) -> None:
        self.agent.act(self.obs, self.on)
        t = synthetic(self.rng, len(self.on))
        self.replay.add(*t, self.on)
        self.agent.update(self.replay.sample(self.batch, self.on), self.agent.noise(self.batch, self.on))


def run_cell(args) -> dict:
    """Times one (agent, temperature, S) cell in this process."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    setup = Packed(args, device)
    for _ in range(args.warmup):
        setup.decide()
    _sync(device)
    n, wall0, cpu0 = 0, time.perf_counter(), time.process_time()
    while n < args.min_decisions or time.perf_counter() - wall0 < args.min_time:
        setup.decide()
        n += 1
    _sync(device)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    seeds = args.seeds
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"agent": args.agent, "temperature": args.temperature, "mode": "packed", "seeds": seeds,
            "device": str(device), "decisions": n, "wall_s": wall, "cpu_s": cpu,
            "seed_decisions_per_s": seeds * n / wall, "seed_decisions_per_cpu_s": seeds * n / cpu,
            "peak_mib": peak / 2**20, "peak_kind": "cuda_allocated" if device.type == "cuda" else "rss"}


def cell_in_subprocess(args, agent: str, temperature: str, seeds: int) -> dict:
    cmd = [sys.executable, __file__, "--cell", "--agent", agent, "--temperature", temperature, "--seeds-one",
           str(seeds), "--device", args.device, "--hidden", str(args.hidden), "--batch",
           str(args.batch), "--min-time", str(args.min_time), "--min-decisions", str(args.min_decisions),
           "--warmup", str(args.warmup), "--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def print_replay_memory(device: torch.device, seeds: list[int]) -> None:
    print("replay of a pack at 1M transitions per seed (float32 rows obs|action|reward|next_obs|terminated):")
    for task, (o, a) in TASK_DIMS.items():
        for s in seeds:
            nbytes = replay_bytes(s, 1_000_000, o, a)
            print(f"  {task:14s} S={s:2d}: {nbytes / 2**30:6.2f} GiB -> on {replay_device(device, nbytes)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--agents", nargs="+", default=["sac_ln", "mad_sac"])
    p.add_argument("--temperatures", nargs="+", default=["te", "qed"])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--min-time", type=float, default=5.0, help="seconds timed per cell (at least)")
    p.add_argument("--min-decisions", type=int, default=3, help="decisions timed per cell (at least)")
    p.add_argument("--warmup", type=int, default=1, help="untimed decisions per cell")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/pack.jsonl"))
    # one cell (what the driver runs in a subprocess)
    p.add_argument("--cell", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--agent", help=argparse.SUPPRESS)
    p.add_argument("--temperature", help=argparse.SUPPRESS)
    p.add_argument("--seeds-one", type=int, dest="seeds_one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.cell:
        args.seeds = args.seeds_one
        print(json.dumps(run_cell(args)))
        return
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, device {device}"
          f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, {args.threads} "
          f"torch thread(s), width {args.hidden}, batch {args.batch}, obs/act {OBS}/{ACT}")
    print_replay_memory(device, args.seeds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(f"ratios (x S=1: against a pack of one, a single run) use seed-decisions per "
          f"{'wall' if device.type == 'cuda' else 'CPU'} second")
    print(f"{'agent':8s} {'temp':4s} {'S':>2s} {'dec':>4s} {'wall s':>7s} {'seed-dec/s':>10s} "
          f"{'/CPU-s':>8s} {'x S=1':>6s} {'peak MiB':>9s}")
    key = "seed_decisions_per_s" if device.type == "cuda" else "seed_decisions_per_cpu_s"
    for agent in args.agents:
        for temperature in args.temperatures:
            base = None
            for seeds in sorted({1, *args.seeds}):
                if device.type == "cuda":
                    r = run_cell(argparse.Namespace(**{**vars(args), "agent": agent, "temperature": temperature,
                                                       "seeds": seeds}))
                else:
                    r = cell_in_subprocess(args, agent, temperature, seeds)
                base = base or r[key]
                print(f"{agent:8s} {temperature:4s} {seeds:2d} {r['decisions']:4d} {r['wall_s']:7.1f} "
                      f"{r['seed_decisions_per_s']:10.2f} {r['seed_decisions_per_cpu_s']:8.2f} {r[key] / base:6.2f} "
                      f"{r['peak_mib']:9.0f}", flush=True)
                with open(args.out, "a") as f:
                    f.write(json.dumps({**r, "time": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")


if __name__ == "__main__":
    main()
