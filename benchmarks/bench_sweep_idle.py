"""Benchmark: where a sweep waits. Runs the real CLI sweep (``python -m qed_ray.sweep SPEC``, embedded Ray, SQLite
MLflow) on a fresh storage folder and prints its wall and CPU time, the time to its first finished trial and to its
first gathered group, and each trial-to-trial hand-over: the seconds a slot stood idle between one trial's end and
the next trial's start (Tune's result rows: a trial starts its first report's ``time_this_iter_s`` before it, ends at
its last report). ``--trials N`` stops the sweep (Ctrl-C, as a user would) once N trials are done, so a loaded
machine can measure the first N.

CPU time is that of the sweep's whole process tree (the driver, Ray's daemons and workers), sampled every 0.5 s
from ``/proc`` (a process that ends between samples loses at most its last 0.5 s), so other users' load is left out;
the load average is printed at the start and the end. Linux only.

To time an older tree, put it first on ``PYTHONPATH``: the sweep runs from whatever ``qed_ray`` Python imports.
Run: ``MUJOCO_GL=disable .venv/bin/python benchmarks/bench_sweep_idle.py [sweeps/smoke.yaml] [--trials 6]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

TICKS = os.sysconf("SC_CLK_TCK")


def _tree_cpu(root: int, seen: dict[int, float]) -> None:
    """Updates ``seen`` {pid: CPU seconds} with every live descendant of ``root`` (and ``root``)."""
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(d.name)] = int(fields[1])
        cpu[int(d.name)] = (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime
    for pid in cpu:
        p = pid
        while p > 1 and p != root:
            p = parent.get(p, 0)
        if p == root:
            seen[pid] = max(seen.get(pid, 0.0), cpu[pid])


def trial_intervals(sweep_dir: Path) -> list[tuple[float, float, int]]:
    """``(start, end, pid)`` of every Tune trial with a result row, by start."""
    out = []
    for f in sweep_dir.glob("tune/*/*/result.json"):
        rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        if rows:
            out.append((rows[0]["timestamp"] - rows[0]["time_this_iter_s"], rows[-1]["timestamp"], rows[0]["pid"]))
    return sorted(out)


def hand_overs(intervals: list[tuple[float, float, int]], slots: int) -> list[float]:
    """Seconds between a slot's trial ending and the next trial starting: trial i (by start, i >= ``slots``) took
    the slot of the (i - slots)-th trial to end."""
    ends = sorted(e for _, e, _ in intervals)
    return [s - ends[i - slots] for i, (s, _, _) in enumerate(intervals) if i >= slots]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec", nargs="?", default="sweeps/smoke.yaml")
    p.add_argument("--trials", type=int, default=0, help="stop once this many trials are done (0: the whole sweep)")
    p.add_argument("--storage", default=None, help="storage root (default: a fresh temporary folder, removed after)")
    args = p.parse_args(argv)
    spec = yaml.safe_load(Path(args.spec).read_text())
    slots = max(1, min(int((os.cpu_count() or 1) // spec.get("resources", {}).get("cpu", 1)),
                       spec.get("max_concurrent_trials") or 10**9))
    tmp = None if args.storage else tempfile.TemporaryDirectory()
    storage = Path(args.storage or tmp.name)
    sweep_dir = storage / spec["name"]
    env = {**os.environ, "QED_STORAGE_PATH": str(storage), "MUJOCO_GL": "disable", "RAY_USAGE_STATS_ENABLED": "0"}
    for k in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI"):
        env.pop(k, None)
    print(f"spec {args.spec}, {os.cpu_count()} CPUs ({slots} slots), load average at start "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    marks: dict[str, float] = {}
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "qed_ray.sweep", args.spec], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def read() -> None:
        for line in proc.stdout:
            if line.startswith("gathered ") and "first group gathered" not in marks:
                marks["first group gathered"] = time.time()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    seen: dict[int, float] = {}
    stopped, cpu_at_stop = False, None
    while proc.poll() is None:
        _tree_cpu(proc.pid, seen)
        done = len(list(sweep_dir.glob("policies/*/DONE.json")))
        if done and "first trial done" not in marks:
            marks["first trial done"] = time.time()
        if args.trials and done >= args.trials and not stopped:
            marks[f"{args.trials} trials done"] = time.time()
            cpu_at_stop = sum(seen.values())
            proc.send_signal(signal.SIGINT)
            stopped = True
        time.sleep(0.5)
    wall = time.time() - t0
    reader.join(5)
    intervals = trial_intervals(sweep_dir)
    gaps = hand_overs([iv for iv in intervals if iv[0] <= marks.get(f"{args.trials} trials done", 1e18)], slots)
    print(f"exit {proc.returncode}; wall {wall:.1f} s, CPU of the sweep's processes {sum(seen.values()):.1f} s "
          f"({len(seen)} processes); load average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if cpu_at_stop is not None:
        print(f"  CPU of the sweep's processes when {args.trials} trials were done: {cpu_at_stop:.1f} s")
    for name, t in sorted(marks.items(), key=lambda kv: kv[1]):
        print(f"  {name}: {t - t0:.1f} s after the command")
    print(f"  trials with results: {len(intervals)}, worker processes: {len({pid for *_, pid in intervals})}, "
          f"first trial start {intervals[0][0] - t0:.1f} s" if intervals else "  no trial reported")
    if gaps:
        print(f"  hand-overs ({len(gaps)}): {' '.join(f'{g:.1f}' for g in gaps)} s; median {statistics.median(gaps):.1f}"
              f", mean {statistics.mean(gaps):.1f}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
