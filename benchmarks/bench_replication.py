"""Benchmark: the paper's headline claim at CPU scale, through the sweep service's public CLI.

The claim (paper Sec. 6.1, Fig. 3): QED lowers the inter-run variability V by one to two orders of magnitude
against target-entropy SAC at an IQM of normalised return within a few percent. This script writes a sweep spec
(one cheap task, SAC-LN with ``te`` and ``qed`` at ``k``, ``--seeds`` seeds, a small width), runs
``python -m qed_ray.sweep SPEC`` on it in a fresh folder (embedded Ray with token auth under a throwaway token,
MLflow in the sweep folder's SQLite file, then the gather step), reads ``gather/results.json`` and prints per
variant: IQM with its CI and CI width, mean score, V with its CI, the action distance with its CI, the
across-seed return variance with its CI (each variant's own seed bootstrap) and where QED's alpha sat late in
training; then the comparisons (the te/QED ratios of V, the action distance and the return variance, summarised
over tasks three ways, and the IQM ratio QED/te, each with its interval paired over seeds) and the verdict on the
claim, as the sweep's summary prints them (docs/claim.md's rules; exploratory here: one task, few seeds).

It also prints the sweep's wall time, its CPU time (the sweep process and every process of its session,
sampled from /proc every 2 s: a lower bound, as a process that lives less than 2 s is missed) and the machine's
load average at its start and end. ``--results gather/results.json`` prints the tables of a finished sweep again.

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

from qed_ray.analysis.results import read_results
from qed_ray.records.codec import RecordError, dump

SWEEP_NAME = "replication"
CLAIM_FILE = Path(__file__).resolve().parents[1] / "docs" / "claim.md"


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
        # The verdict lists every departure from the pre-registered design (agent, tasks, seeds, budget), so its
        # table says itself what this CPU budget cannot show.
        "claim": os.path.relpath(CLAIM_FILE),  # the sweep reads it relative to the current folder
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
    """Markdown rows, one per variant: its own seed-bootstrap intervals (each variant resampled alone), and where
    QED's alpha sat in the last quarter of training."""
    nan = float("nan")

    def f(a: dict, key: str) -> float:
        v = a.get(key)
        return nan if v is None else float(v)

    def ci(a: dict, stat: str, lo: str, hi: str) -> str:
        return _ci(f(a, stat), f(a, lo), f(a, hi))

    lines = ["| variant | seeds | IQM [95% CI] | CI width | mean score | V [95% CI] | action distance [95% CI] | "
             "return variance across seeds [95% CI] | alpha at floor / cap, last quarter |",
             "|---|---:|---|---:|---:|---|---|---|---|"]
    for a in results["aggregates"]:
        sat = (f"{f(a, 'alpha_frac_floor_late'):.2f} / {f(a, 'alpha_frac_cap_late'):.2f}"
               if math.isfinite(f(a, "alpha_frac_cap_late")) else "-")
        lines.append(f"| {a['variant']} | {a['n_runs']} | {ci(a, 'iqm', 'ci_lower', 'ci_upper')} | "
                     f"{f(a, 'ci_width'):.3g} | {f(a, 'mean_score'):.3g} | "
                     f"{ci(a, 'V_mean', 'V_mean_ci_lower', 'V_mean_ci_upper')} | "
                     f"{ci(a, 'action_distance_mean', 'action_distance_ci_lower', 'action_distance_ci_upper')} | "
                     f"{ci(a, 'score_var_mean', 'score_var_ci_lower', 'score_var_ci_upper')} | {sat} |")
    return lines


RATIOS = (("V", "V te / QED"), ("action_distance", "action distance te / QED"),
          ("score_var", "return variance te / QED"))


def comparison_table(results: dict) -> list[str]:
    """Markdown rows of ``results.json``'s comparisons (``gather/comparisons.csv``): per QED variant the te/QED
    ratios summarised over tasks three ways and the IQM ratio QED/te, each with its interval, paired over seeds
    where both variants trained the same seeds (the table says which)."""
    lines = []
    for c in results.get("comparisons", []):
        def ci(key: str) -> str:
            return _ci(*(float("nan") if c[key][x] is None else c[key][x] for x in ("value", "lower", "upper")))
        lines += [f"{c['variant']} against {c['baseline']}: {c['n_tasks']} task(s), {c['n_seeds']} seeds, intervals "
                  f"{c['pairing']}", "",
                  "| ratio [95% CI] | median over tasks | geometric mean over tasks | ratio of task means |",
                  "|---|---|---|---|"]
        lines += [f"| {name} | {' | '.join(ci(f'{stat}_ratio_{s}') for s in ('median', 'geomean', 'means'))} |"
                  for stat, name in RATIOS]
        lines += [f"| IQM QED / te | {ci('iqm_ratio')} | | |", ""]
    return lines


def verdict_lines(results: dict) -> list[str]:
    """The verdict as the sweep's summary prints it (:func:`qed_ray.analysis.verdict.format_verdict`)."""
    from qed_ray.analysis.results import Verdict
    from qed_ray.analysis.verdict import format_verdict

    if results.get("verdict") is None:
        return ["(no verdict: results.json predates it)"]
    return format_verdict(Verdict.from_json(results["verdict"]), results["final_eval"]["confidence"]).splitlines()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags (the grid and budget; the defaults took ~25 minutes on 2 cores at load average 4-10)."""
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
    p.add_argument("--results", type=Path, help="print the tables of this gather/results.json instead of running")
    args = p.parse_args(argv)
    if args.seeds < 2:
        p.error("--seeds: need at least 2 (V compares seeds)")
    return args


def report(results: dict) -> list[str]:
    """Everything printed about a finished sweep: the variants, the paired comparisons, the verdict."""
    return [*table(results), "", *comparison_table(results), "```", *verdict_lines(results), "```"]


def read_results_json(path: Path) -> dict:
    """A ``gather/results.json`` validated by its model (:class:`SweepResults`), as the JSON the tables read;
    raises RecordError naming the file and the field."""
    return dump(read_results(path))


def main(argv: list[str] | None = None) -> int:
    """Writes the spec, runs the sweep, prints and saves the table (or, with ``--results``, only prints it)."""
    args = parse_args(argv)
    if args.results is not None:
        try:
            print("\n".join(report(read_results_json(args.results))))
        except RecordError as e:
            print(f"error: --results: {e}", file=sys.stderr)
            return 2
        return 0
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    storage = out / f"storage-{time.strftime('%Y%m%d-%H%M%S')}"  # a fresh sweep folder every time
    spec_path = out / "replication.yaml"
    spec_path.write_text(yaml.safe_dump(make_spec(args, storage), sort_keys=False))
    print(f"spec {spec_path}:\n{spec_path.read_text()}", flush=True)
    before = os.getloadavg()
    wall, cpu, rc = run_sweep(spec_path, out / "sweep.log")
    load = {"start": before, "end": os.getloadavg()}  # the machine's load average over 1, 5, 15 min
    print(f"sweep exit code {rc}; wall {wall:.0f} s; CPU {cpu:.0f} s (sampled, lower bound); load average "
          + "; ".join(f"at the {k} {' / '.join(f'{x:.1f}' for x in v)}" for k, v in load.items())
          + f"; log {out / 'sweep.log'}")
    results_path = storage / SWEEP_NAME / "gather" / "results.json"
    if rc != 0 or not results_path.exists():
        print(f"error: no results ({results_path}); see the log", file=sys.stderr)
        return 1
    results = read_results_json(results_path)
    lines = report(results)
    print(f"\n{args.task}, SAC-LN {args.hidden}x{args.hidden} batch {args.batch}, {args.env_steps} env steps, "
          f"{args.seeds} seeds, final eval {args.episodes} episodes (tanh(mu)), "
          f"{results['final_eval']['bootstrap_reps']} bootstrap resamples:\n")
    print("\n".join(lines))
    (out / "replication.json").write_text(json.dumps(
        {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "wall_s": wall,
         "cpu_s": cpu, "load_average": load, "results": str(results_path), "table": lines}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
