"""Benchmark: decisions/s of SAC-LN and MAD-SAC with the target-entropy and the QED temperature, side by side.

One decision = policy sample (``act``) + env step + replay insert + one sampled batch + one ``update`` of a pack of
one seed (a single run), the trainer's steady-state work per decision at UTD 1. Each (agent, temperature) gets its own env and replay, first
filled with uniform-random decisions on the real task. Then all of them take turns, one decision each, for
``--warmup-updates`` untimed and ``--updates`` timed rounds: on a shared machine the load then hits every setup
alike, so the ratios (QED/te, MAD/SAC) are steadier than the absolute figures. Parts are timed in process CPU
seconds (one torch thread: the cost with other load factored out) and in wall seconds.
Run: ``MUJOCO_GL=disable .venv/bin/python benchmarks/bench_speed_mad.py [--hidden 512 --batch 512 --updates 30]``.
Prints one line per (agent, temperature) (``--temps``: te, qed, and floor = QED with ``target_alpha: floor``),
then per agent each temperature's update cost over te's, and MAD/SAC per decision. ``--compile`` compiles the
losses as ``train.compile: compile`` does; the first decision's wall time (the compile) is printed apart.
"""

import argparse
import os
import time

import numpy as np
import torch

from qed_ray.rl.agents import make_packed_agent
from qed_ray.spec.config import TemperatureSpec, agent_spec
from qed_ray.rl.envs import make_env
from qed_ray.rl.replay import Replay

TEMPERATURES = {"te": TemperatureSpec(kind="te"), "qed": TemperatureSpec(kind="qed", k=0.2),
                "floor": TemperatureSpec(kind="qed", k=0.2, target_alpha="floor")}  # QED at actor updates only


ON = np.ones(1, bool)


def fill_replay(env, n: int, seed: int) -> tuple[Replay, np.ndarray]:
    """Replay with ``n`` uniform-random decisions of ``env``; returns it and the current observation."""
    rng = np.random.default_rng(seed)
    replay = Replay(n + 100_000, env.obs_dim, env.action_dim, [np.random.default_rng(seed + 1)], torch.device("cpu"))
    obs = env.reset()
    for _ in range(n):
        action = rng.uniform(-1, 1, env.action_dim).astype(np.float32)
        obs = _step(env, replay, obs, action)
    return replay, obs


def _step(env, replay: Replay, obs: np.ndarray, action: np.ndarray) -> np.ndarray:
    """One env step stored in replay; returns the next observation (a fresh one after a time limit)."""
    step = env.step(action)
    replay.add(obs[None], action[None], np.array([step.reward]), step.obs[None], np.array([step.terminated]), ON)
    return env.reset() if step.terminated or step.truncated else step.obs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Setup:
    """One (agent, temperature): its agent, env, replay, current observation and accumulated part times."""

    def __init__(self, name: str, temperature: str, args: argparse.Namespace, device: torch.device):
        self.env = make_env(args.task, seed=0)
        self.replay, self.obs = fill_replay(self.env, args.buffer, seed=0)
        spec = agent_spec(name=name, hidden=args.hidden, batch_size=args.batch)
        self.agent = make_packed_agent(spec, TEMPERATURES[temperature], self.env.obs_dim, self.env.action_dim,
                                       device, [0])
        self.batch, self.device = args.batch, device
        self.parts = {f"{k}_{c}": 0.0 for k in ("act", "env", "update") for c in ("cpu", "wall")}
        self.metrics, self.compile_s = None, None
        if args.compile:  # the path of train.compile: compile (PackUpdater); the first update pays the compile
            self.agent.compile_losses()

    def decision(self, timed: bool) -> None:
        """act + env step + replay insert + one update; adds each part's CPU and wall seconds when ``timed``."""
        if self.compile_s is None:  # first decision: its wall time is the compile (or eager warm-up) cost
            t0 = time.perf_counter()
            self.compile_s = 0.0
            self.decision(False)
            self.compile_s = time.perf_counter() - t0
            return
        stamps = [(time.process_time(), time.perf_counter())]
        action = self.agent.act(self.obs[None], ON)[0]
        stamps.append((time.process_time(), time.perf_counter()))
        self.obs = _step(self.env, self.replay, self.obs, action)
        stamps.append((time.process_time(), time.perf_counter()))
        self.metrics = self.agent.update(self.replay.sample(self.batch, ON), self.agent.noise(self.batch, ON))
        _sync(self.device)
        stamps.append((time.process_time(), time.perf_counter()))
        if timed:
            for i, part in enumerate(("act", "env", "update")):
                self.parts[f"{part}_cpu"] += stamps[i + 1][0] - stamps[i][0]
                self.parts[f"{part}_wall"] += stamps[i + 1][1] - stamps[i][1]

    def report(self, label: str, n: int) -> dict[str, float]:
        """Prints this setup's line; returns per-decision CPU ms of the update and of the whole decision."""
        self.metrics.sum().item()  # the update returns a lazy metric vector: force the last one
        ms = {k: 1e3 * v / n for k, v in self.parts.items()}
        cpu = ms["act_cpu"] + ms["env_cpu"] + ms["update_cpu"]
        wall = ms["act_wall"] + ms["env_wall"] + ms["update_wall"]
        print(f"{label} | {1e3 / cpu:7.2f} decisions per CPU s, {1e3 / wall:7.2f} per wall s | CPU ms per "
              f"decision: update {ms['update_cpu']:8.2f}, act {ms['act_cpu']:6.3f}, env {ms['env_cpu']:6.3f} | "
              f"update wall ms {ms['update_wall']:8.2f} | first decision {self.compile_s:5.1f} wall s", flush=True)
        return {"update": ms["update_cpu"], "decision": cpu}


def main() -> None:
    """Parses flags, benchmarks every agent with each temperature, prints the ratios to te."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="cheetah-run")
    p.add_argument("--agents", nargs="+", default=["sac_ln", "mad_sac"], choices=["sac_ln", "mad_sac"])
    p.add_argument("--updates", type=int, default=30, help="timed decisions (= updates at UTD 1) per agent")
    p.add_argument("--warmup-updates", type=int, default=5, help="untimed decisions first (allocations, caches)")
    p.add_argument("--buffer", type=int, default=5000, help="uniform-random decisions put in replay first")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--temps", nargs="+", default=["te", "qed", "floor"], choices=list(TEMPERATURES),
                   help="floor: QED with temperature.target_alpha floor (alpha_TE in the TD target)")
    p.add_argument("--compile", action="store_true", help="compile the losses (train.compile: compile)")
    args = p.parse_args()
    if "te" not in args.temps:
        p.error("--temps must include te (the ratios are against it)")
    os.environ.setdefault("MUJOCO_GL", "disable")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"{args.task}, width {args.hidden}, batch {args.batch}, UTD 1, QED k 0.2 (8 samples per state), {device}, "
          f"{torch.get_num_threads()} thread(s), torch {torch.__version__}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    setups = {(a, t): Setup(a, t, args, device) for a in args.agents for t in args.temps}
    for rounds, timed in ((args.warmup_updates, False), (args.updates, True)):
        for _ in range(rounds):
            for setup in setups.values():  # round robin: one decision each, so load hits all alike
                setup.decision(timed)
    res = {(a, t): s.report(f"{a:8s} {t:5s}", args.updates) for (a, t), s in setups.items()}
    for a in args.agents:
        te = res[(a, "te")]
        for t in (t for t in args.temps if t != "te"):
            print(f"{a}: {t}/te update CPU cost {res[(a, t)]['update'] / te['update']:.2f}x, per decision "
                  f"{res[(a, t)]['decision'] / te['decision']:.2f}x")
    print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if len(args.agents) == 2:
        for t in args.temps:
            ratio = res[("mad_sac", t)]["decision"] / res[("sac_ln", t)]["decision"]
            print(f"{t}: MAD-SAC costs {ratio:.2f}x SAC-LN per decision (CPU)")


if __name__ == "__main__":
    main()
