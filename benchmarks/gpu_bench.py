"""The GPU run's measurements: graph-vs-eager deviation, the sync check, and seed-decisions/s of packs.

Cells, in order of importance (each checks a global deadline first and is recorded as skipped past it; the JSON
is rewritten after every cell, so a later failure loses nothing):

1. ``check``: for SAC-LN and MAD-SAC with QED, a pack of :data:`CHECK_SEEDS` seeds, 100 updates with identical
   batch indices and noise through the update runner in ``graph`` mode and in ``off`` mode (eager): the max
   absolute deviation of every parameter, target, memo and Adam moment, and whether they are allclose (rtol 1e-4,
   atol 1e-5); the last 20 graphed updates run under ``torch.cuda.set_sync_debug_mode("error")`` (a host sync
   inside the update raises). On the CPU the graph is replaced by ``compile`` (``--cpu-compile``) or, without it, by
   eager again (SAC-LN only: the check's own code, rehearsed in CI without a cold inductor compile; compile against
   eager is tests/rl/test_pack_update.py's).
2. ``graph``: S in {1, 10, 20}, both agents, QED and te (auto mode: graph on CUDA, eager on the CPU); S = 1 is a
   single run (a pack of one); on CUDA, right after the S = 10 cells, the same S = 10 cells at ``train.precision``
   3xtf32 and tf32 (the check also runs SAC-LN's graph against eager at 3xtf32: the per-product TF32 switch must be
   captured as it runs eagerly).
3. ``off``: the eager pack update at S in {10, 20} (QED), against (2).
4. ``packs``: 2 and 3 packs of S = 10 (QED, graph) in separate processes sharing the device, timed over the same
   wall-clock window.

One decision = one batched act for S synthetic observations + S replay rows + one packed update (UTD 1), as the
pack trainer does per decision, without envs. Timed with CUDA events (wall clock on the CPU) for at least
``--cell-s`` seconds after warm-up (the graph's capture included in warm-up); peak memory is
``torch.cuda.max_memory_allocated`` of the cell's process. Imports only torch, numpy and pydantic.

Run: ``python3 benchmarks/gpu_bench.py --device cuda --out DIR`` (``benchmarks/gpu_check.sh`` runs it).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from qed_ray.rl.agents import make_packed_agent
from qed_ray.spec.config import TemperatureSpec, agent_spec
from qed_ray.rl.update import PackUpdater, resolve_mode
from qed_ray.rl.precision import set_run_precision
from qed_ray.rl.replay import Replay
from qed_ray.records.throughput import SCHEMA

TEMPERATURES = {"te": TemperatureSpec(kind="te"), "qed": TemperatureSpec(kind="qed", k=0.2)}
AGENTS = ("sac_ln", "mad_sac")
OBS, ACT = 17, 6  # cheetah-run
BUFFER = 10_000  # synthetic transitions per seed
CHECK_SEEDS, CHECK_UPDATES, SYNC_UPDATES = 4, 100, 20
RTOL, ATOL = 1e-4, 1e-5


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Pack:
    """A pack of S seeds on ``device`` with a filled replay and its update runner."""

    def __init__(self, agent: str, temperature: str, seeds: int, mode: str, device: torch.device, hidden: int,
                 batch: int, precision: str = "fp32"):
        spec = agent_spec(name=agent, hidden=hidden, batch_size=batch)
        ids = list(range(seeds))
        self.agent = make_packed_agent(spec, TEMPERATURES[temperature], OBS, ACT, device, ids)
        self.replay = Replay(BUFFER, OBS, ACT, [np.random.default_rng(s) for s in ids], device)
        g = torch.Generator(device=device).manual_seed(0)
        self.replay.storage.copy_(torch.randn(self.replay.storage.shape, generator=g, device=device))
        self.replay.storage[..., self.replay.columns["terminated"]] = 0.0
        self.replay.added[:] = BUFFER
        self.on, self.batch, self.rng = np.ones(seeds, bool), batch, np.random.default_rng(0)
        self.mode = resolve_mode(mode, device, self.agent)[0] if mode == "auto" else mode
        self.precision = set_run_precision(self.agent.template.fn, precision, device, self.mode)[0]
        self.run = PackUpdater(self.agent, self.replay, None, self.mode, batch)
        self.obs = self.rng.normal(size=(seeds, OBS)).astype(np.float32)

    def decide(self) -> None:
        s = len(self.on)
        actions = self.agent.act(self.obs, self.on)
        self.replay.add(self.obs, actions, self.rng.normal(size=s), self.obs, np.zeros(s, bool), self.on)
        self.run(self.replay.indices(self.batch, self.on), self.agent.noise(self.batch, self.on))


def measure(kind: str, agent: str, temperature: str, seeds: int, mode: str, args, start_at: float = 0.0,
            precision: str = "fp32") -> dict:
    """One cell in this process: build, warm up (and capture), wait for ``start_at`` (epoch s), time decisions."""
    device = torch.device(args.device)
    gc.collect()  # the previous cell's pack, graph and its memory pool
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    setup = Pack(agent, temperature, seeds, mode, device, args.hidden, args.batch, precision)
    for _ in range(args.warmup):
        setup.decide()
    sync(device)
    setup_s = time.perf_counter() - t0
    while time.time() < start_at:
        time.sleep(0.01)
    n, wall0 = 0, time.perf_counter()
    if device.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
    while time.perf_counter() - wall0 < args.cell_s or n < 3:
        setup.decide()
        n += 1
    if device.type == "cuda":
        end.record()
        end.synchronize()
        timed = begin.elapsed_time(end) / 1000.0
    else:
        timed = time.perf_counter() - wall0
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else math.nan
    return {"agent": agent, "temperature": temperature, "seeds": seeds, "packs": 1, "mode": setup.mode,
            "precision": setup.precision, "seed_decisions_per_s": seeds * n / timed, "decisions": n, "timed_s": timed,
            "setup_s": setup_s, "peak_mib": peak}


def deviation_check(agent: str, args, precision: str = "fp32") -> dict:
    """Graph (CUDA), compile (CPU, ``--cpu-compile``) or eager (CPU) against eager over identical inputs at
    ``precision``; the sync check."""
    device = torch.device(args.device)
    mode = "graph" if device.type == "cuda" else "compile" if args.cpu_compile else "off"
    a = Pack(agent, "qed", CHECK_SEEDS, mode, device, args.hidden, args.batch, precision)
    ref = Pack(agent, "qed", CHECK_SEEDS, "off", device, args.hidden, args.batch, precision)
    sync_error = None
    for i in range(args.check_updates):
        idx, noise = a.replay.indices(args.batch, a.on), a.agent.noise(args.batch, a.on)
        ref.replay.indices(args.batch, ref.on)
        ref.run(idx, ref.agent.noise(args.batch, ref.on))
        guarded = device.type == "cuda" and i >= args.check_updates - SYNC_UPDATES
        try:
            if guarded:
                torch.cuda.set_sync_debug_mode("error")
            a.run(idx, noise)
        except RuntimeError as e:  # under sync-debug "error": a host sync inside the update
            if not guarded:
                raise
            sync_error = sync_error or f"update {i}: {e}".splitlines()[0]
            torch.cuda.set_sync_debug_mode("default")
            a.run(idx, noise)
        finally:
            if guarded:
                torch.cuda.set_sync_debug_mode("default")
    sync(device)
    x = {k: v.detach() for k, v in a.agent.tensors().items()}
    r = {k: v.detach() for k, v in ref.agent.tensors().items()}
    devs = {k: float((x[k].double() - r[k].double()).abs().max()) for k in x}
    close = all(torch.allclose(x[k], r[k], rtol=RTOL, atol=ATOL) for k in x)
    worst = max(devs, key=devs.get)
    return {"agent": agent, "temperature": "qed", "seeds": CHECK_SEEDS, "updates": args.check_updates,
            "mode": mode, "precision": a.precision, "max_abs_deviation": devs[worst], "worst_tensor": worst,
            "allclose": close, "rtol": RTOL, "atol": ATOL,
            "sync_check": ("not run (CPU)" if device.type != "cuda" else
                           "passed" if sync_error is None else f"FAILED: {sync_error}")}


def shared_packs(k: int, args) -> list[dict]:
    """k processes, each one pack of ``--pack-seeds`` seeds (SAC-LN, QED, auto mode), timed over one window."""
    start = time.time() + args.pack_start_s
    cmd = [sys.executable, __file__, "--cell", "--device", args.device, "--hidden", str(args.hidden), "--batch",
           str(args.batch), "--cell-s", str(args.cell_s), "--warmup", str(args.warmup), "--start-at", str(start),
           "--pack-seeds", str(args.pack_seeds)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(k)]
    rows = []
    for p in procs:
        out, err = p.communicate(timeout=args.pack_start_s + 20 * args.cell_s + 60)
        if p.returncode:
            raise RuntimeError(f"pack process failed ({p.returncode}): {err[-2000:]}")
        rows.append(json.loads(out.strip().splitlines()[-1]))
    late = [r for r in rows if r["setup_s"] > args.pack_start_s]
    for r in rows:
        r["packs"], r["overlap_ok"] = k, not late
    return rows


def plan(args) -> list[tuple]:
    """The cells, most important first: (name, function, arguments)."""
    sizes = [1, 2] if args.quick else [1, 10, 20]
    big = [2] if args.quick else [10, 20]
    cuda = args.device != "cpu"
    checked = AGENTS if cuda else AGENTS[:1]
    cells = [("check", deviation_check, (a,)) for a in checked]
    cells += [("check", deviation_check, ("sac_ln", "3xtf32"))] if cuda else []
    first, rest = sizes[1:2], [s for s in sizes if s != sizes[1]]  # S = 10 first: the precision cells compare to it
    cells += [("graph", measure, ("pack", a, t, s, "auto")) for s in first for a in AGENTS for t in ("qed", "te")]
    if cuda:
        cells += [("graph", measure, ("pack", a, t, s, "auto", 0.0, p)) for p in ("3xtf32", "tf32") for s in first
                  for a in AGENTS for t in ("qed", "te")]
    cells += [("graph", measure, ("pack", a, t, s, "auto")) for s in rest for a in AGENTS for t in ("qed", "te")]
    if args.device != "cpu":
        cells += [("off", measure, ("pack", a, "qed", s, "off")) for s in big for a in AGENTS]
    cells += [("packs", shared_packs, (k,)) for k in ([2] if args.quick else [2, 3])]
    if args.device != "cpu" and not args.quick:  # last: a compile takes a minute or more, the deadline guards it
        cells += [("compile", measure, ("pack", a, "qed", 10, "compile")) for a in AGENTS]
    return cells


def write(out: Path, table: dict) -> None:
    tmp = out / "throughput.json.tmp"
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    os.replace(tmp, out / "throughput.json")
    lines = ["| agent | temperature | S | packs | mode | precision | seed-decisions/s | peak MiB | decisions | "
             "setup s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for e in table["entries"]:
        lines.append(f"| {e['agent']} | {e['temperature']} | {e['seeds']} | {e['packs']} | {e['mode']} | "
                     f"{e.get('precision', 'fp32')} | "
                     f"{e['seed_decisions_per_s']:.1f} | {e['peak_mib']:.0f} | {e['decisions']} | "
                     f"{e['setup_s']:.1f} |")
    for c in table["checks"].get("deviation", []):
        lines.append(f"\ndeviation {c['agent']} {c['mode']} vs eager at {c.get('precision', 'fp32')} over "
                     f"{c['updates']} updates (S={c['seeds']}): "
                     f"max |diff| {c['max_abs_deviation']:.3g} ({c['worst_tensor']}), allclose(rtol {RTOL}, "
                     f"atol {ATOL}) {c['allclose']}; sync check {c['sync_check']}")
    (out / "throughput.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/gpu"))
    p.add_argument("--quick", action="store_true", help="CI-sized: tiny networks, S in {1, 2}, short cells")
    p.add_argument("--cell-s", type=float, default=3.0, help="seconds timed per cell (at least)")
    p.add_argument("--deadline-s", type=float, default=270.0, help="no cell starts after this many seconds")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--warmup", type=int, default=5, help="untimed decisions per cell (3 eager + capture + 1)")
    p.add_argument("--check-updates", type=int, default=CHECK_UPDATES)
    p.add_argument("--pack-start-s", type=float, default=25.0, help="set-up time given to shared packs")
    p.add_argument("--pack-seeds", type=int, default=10, help="S of each of the packs sharing the device")
    p.add_argument("--cpu-compile", action="store_true", help="on the CPU, check compile against eager")
    p.add_argument("--cell", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.cell:
        print(json.dumps(measure("pack", "sac_ln", "qed", args.pack_seeds, "auto", args, args.start_at)))
        return
    if args.quick:
        args.hidden, args.batch, args.cell_s, args.check_updates, args.pack_start_s = 32, 32, 0.3, 6, 20.0
        args.pack_seeds = 2
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    table = {"schema": SCHEMA, "device": device.type, "card": card, "date": now(), "torch": torch.__version__,
             "hidden": args.hidden, "batch": args.batch, "obs_dim": OBS, "action_dim": ACT, "entries": [],
             "checks": {"deviation": [], "skipped": [], "failed": []}}
    t0 = time.perf_counter()
    for name, fn, cell_args in plan(args):
        label = f"{name} {' '.join(map(str, cell_args))}"
        if time.perf_counter() - t0 > args.deadline_s:
            table["checks"]["skipped"].append(label)
            print(f"[{time.perf_counter() - t0:6.1f}s] skipped (deadline) {label}", flush=True)
            continue
        try:
            result = fn(*cell_args, args)
        except Exception as e:  # record and go on: the cells after it still run
            table["checks"]["failed"].append(f"{label}: {type(e).__name__}: {e}")
            print(f"[{time.perf_counter() - t0:6.1f}s] FAILED {label}\n{traceback.format_exc()}", flush=True)
            torch.cuda.set_sync_debug_mode("default") if device.type == "cuda" else None
        else:
            if name == "check":
                table["checks"]["deviation"].append(result)
                print(f"[{time.perf_counter() - t0:6.1f}s] deviation {result['agent']} {result['mode']} vs eager "
                      f"at {result['precision']} over {result['updates']} updates: max |diff| "
                      f"{result['max_abs_deviation']:.3g} "
                      f"allclose {result['allclose']}; sync check {result['sync_check']}", flush=True)
            else:
                for r in result if isinstance(result, list) else [result]:
                    table["entries"].append(r)
                    print(f"[{time.perf_counter() - t0:6.1f}s] {r['agent']} {r['temperature']} S={r['seeds']} "
                          f"packs={r['packs']} {r['mode']} {r['precision']}: {r['seed_decisions_per_s']:.1f} "
                          f"seed-decisions/s, peak {r['peak_mib']:.0f} MiB, setup {r['setup_s']:.1f}s", flush=True)
        write(args.out, table)
    print(f"done in {time.perf_counter() - t0:.1f}s; table in {args.out / 'throughput.json'}", flush=True)


if __name__ == "__main__":
    main()
