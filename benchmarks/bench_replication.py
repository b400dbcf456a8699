"""Benchmark: the paper's headline claim at CPU scale, through the sweep service's public CLI.

The claim (paper Sec. 6.1, Fig. 3): QED lowers the inter-run variability V by one to two orders of magnitude
against target-entropy SAC at an IQM of normalised return within a few percent. This script writes a sweep spec
(one cheap task, SAC-LN with ``te`` and ``qed`` at ``k``, ``--seeds`` seeds, a small width), runs
``python -m qed_ray.sweep SPEC`` on it in a fresh folder (embedded Ray with token auth under a throwaway token,
MLflow in the sweep folder's SQLite file, then the gather step), reads ``gather/results.json`` and prints per
variant: IQM with its CI and CI width, mean score, V with its CI, the action distance with its CI, the
across-seed return variance with its CI, and the te/QED ratios (V, return variance, and IQM QED/te).

It also prints the sweep's wall time and its CPU time (the sweep process and every process of its session,
sampled from /proc every 2 s: a lower bound, as a process that lives less than 2 s is missed).

Run: ``MUJOCO_GL=disable nice -n 15 .venv/bin/python benchmarks/bench_replication.py`` (defaults:
cartpole-balance, 5 seeds, width 64, batch 64, 20,000 env steps). ``--out`` holds the spec, the sweep folder
and ``replication.json`` (the printed numbers); benchmarks/out/ is git-ignored.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

SWEEP_NAME = "replication"


def make_spec(args: argparse.Namespace, storage: Path) -> dict:
    """The sweep spec of the benchmark (every field the sweep reads is written out, so the spec is the record)."""
    return {
        "name": SWEEP_NAME,
        "tasks": [args.task],
        "seeds": args.seeds,
        "agents": [{"name": "sac_ln", "overrides": {"hidden": args.hidden, "batch_size": args.batch},
                    "temperatures": [{"kind": "te"}, {"kind": "qed", "k": args.k}]}],
        "train": {"env_steps": args.env_steps, "eval_every": args.eval_every, "eval_episodes": 2,
                  "warmup_decisions": args.warmup},
        "final_eval": {"episodes": args.episodes, "action_rollouts": args.episodes, "action_steps": 100,
                       "curve_episodes": 1, "bootstrap_reps": args.bootstrap_reps},
        "resources": {"cpu": 1, "gpu": 0},
        "max_retries": 1,
        "storage_path": str(storage),
    }


class CpuSampler:
    """Sums user + system CPU seconds of a process session by sampling ``/proc/<pid>/stat`` (Linux only).

    Each pid's last seen total (its own and its reaped children's time) is kept, so processes that end between
    samples still count with what they had used at the previous sample.
    """

    def __init__(self, sid: int, every: float = 2.0):
        self.sid, self.every, self.seen = sid, every, {}
        self.tick = os.sysconf("SC_CLK_TCK")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> None:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            # fields[0] is field 3 (state): session is field 6, utime/stime/cutime/cstime fields 14-17.
            if int(fields[3]) == self.sid:
                self.seen[int(entry)] = sum(int(x) for x in fields[11:15]) / self.tick

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def start(self) -> None:
        """Starts sampling in a background thread."""
        self._thread.start()

    def stop(self) -> float:
        """Stops sampling; returns the CPU seconds seen."""
        self._stop.set()
        self._thread.join()
        return sum(self.seen.values())


def run_sweep(spec_path: Path, log_path: Path) -> tuple[float, float, int]:
    """Runs ``python -m qed_ray.sweep SPEC`` in its own session; returns (wall s, CPU s, exit code)."""
    env = {**os.environ, "MUJOCO_GL": "disable", "RAY_USAGE_STATS_ENABLED": "0",
           # Ray keeps token auth on; the token is this run's own and lives in the environment only.
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    for var in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "QED_STORAGE_PATH", "RAY_AUTH_TOKEN_PATH"):
        env.pop(var, None)
    t0 = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "qed_ray.sweep", str(spec_path)], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        sampler = CpuSampler(proc.pid)
        sampler.start()
        rc = proc.wait()
    return time.perf_counter() - t0, sampler.stop(), rc


def _ci(x: float, lo: float, hi: float, p: int = 3) -> str:
    if not math.isfinite(x):
        return "n/a"
    return f"{x:.{p}g} [{lo:.{p}g}, {hi:.{p}g}]"


def table(results: dict) -> list[str]:
    """Markdown rows: one per variant, then the te/QED ratios."""
    aggs = {a["variant"]: a for a in results["aggregates"]}
    nan = float("nan")

    def f(a: dict, key: str) -> float:
        v = a.get(key)
        return nan if v is None else float(v)

    lines = ["| variant | seeds | IQM [95% CI] | CI width | mean score | V [95% CI] | action distance [95% CI] | "
             "return variance across seeds [95% CI] |", "|---|---:|---|---:|---:|---|---|---|"]

    def ci(a: dict, stat: str, lo: str, hi: str) -> str:
        return _ci(f(a, stat), f(a, lo), f(a, hi))

    for name, a in aggs.items():
        lines.append(f"| {name} | {a['n_runs']} | {ci(a, 'iqm', 'ci_lower', 'ci_upper')} | "
                     f"{f(a, 'ci_width'):.3g} | {f(a, 'mean_score'):.3g} | "
                     f"{ci(a, 'V_mean', 'V_mean_ci_lower', 'V_mean_ci_upper')} | "
                     f"{ci(a, 'action_distance_mean', 'action_distance_ci_lower', 'action_distance_ci_upper')} | "
                     f"{ci(a, 'score_var_mean', 'score_var_ci_lower', 'score_var_ci_upper')} |")
    te = aggs.get("te")
    for name, a in aggs.items():
        if name == "te" or te is None:
            continue
        iqm_ratio = f(a, "iqm") / f(te, "iqm") if f(te, "iqm") else nan
        lines.append("")
        lines.append(f"te/{name}: V ratio {ci(a, 'V_ratio', 'V_ratio_ci_lower', 'V_ratio_ci_upper')}; "
                     f"return-variance ratio "
                     f"{ci(a, 'score_var_ratio', 'score_var_ratio_ci_lower', 'score_var_ratio_ci_upper')}; "
                     f"IQM {name}/te {iqm_ratio:.3f}; action distance te/{name} "
                     f"{f(te, 'action_distance_mean') / f(a, 'action_distance_mean'):.3g}")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags (the grid and budget; defaults sized for ~25 minutes on 2 shared cores)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="cartpole-balance")
    p.add_argument("--seeds", type=int, default=5, help="seeds per variant (>= 2 for V)")
    p.add_argument("--hidden", type=int, default=64, help="SAC-LN width")
    p.add_argument("--batch", type=int, default=64, help="SAC-LN batch size")
    p.add_argument("--k", type=float, default=0.2, help="QED's k")
    p.add_argument("--env-steps", type=int, default=20_000, help="training budget per trial, control steps")
    p.add_argument("--eval-every", type=int, default=5_000, help="env steps between evaluations")
    p.add_argument("--warmup", type=int, default=1000, help="uniform-random decisions before updates")
    p.add_argument("--episodes", type=int, default=10, help="final-eval episodes and action-distance rollouts")
    p.add_argument("--bootstrap-reps", type=int, default=50_000)
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/replication"))
    args = p.parse_args(argv)
    if args.seeds < 2:
        p.error("--seeds: need at least 2 (V compares seeds)")
    return args


def main(argv: list[str] | None = None) -> int:
    """Writes the spec, runs the sweep, prints and saves the table."""
    args = parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    storage = out / f"storage-{time.strftime('%Y%m%d-%H%M%S')}"  # a fresh sweep folder every time
    spec_path = out / "replication.yaml"
    spec_path.write_text(yaml.safe_dump(make_spec(args, storage), sort_keys=False))
    print(f"spec {spec_path}:\n{spec_path.read_text()}", flush=True)
    wall, cpu, rc = run_sweep(spec_path, out / "sweep.log")
    print(f"sweep exit code {rc}; wall {wall:.0f} s; CPU {cpu:.0f} s (sampled, lower bound); log {out / 'sweep.log'}")
    results_path = storage / SWEEP_NAME / "gather" / "results.json"
    if rc != 0 or not results_path.exists():
        print(f"error: no results ({results_path}); see the log", file=sys.stderr)
        return 1
    results = json.loads(results_path.read_text())
    lines = table(results)
    print(f"\n{args.task}, SAC-LN {args.hidden}x{args.hidden} batch {args.batch}, {args.env_steps} env steps, "
          f"{args.seeds} seeds, final eval {args.episodes} episodes (tanh(mu)), "
          f"{results['final_eval']['bootstrap_reps']} bootstrap resamples:\n")
    print("\n".join(lines))
    (out / "replication.json").write_text(json.dumps(
        {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "wall_s": wall,
         "cpu_s": cpu, "results": str(results_path), "table": lines}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
