"""Benchmark: the CPU rate table the dry run prices CPU sweeps by (``qed_ray/data/throughput_cpu.json``).

Per (agent, temperature, width = batch) cell: decisions per CPU second of a pack of one on one torch thread, act +
one update per decision (UTD 1), eager (``train.compile`` ``auto`` stays eager for runs this short on a CPU); env
stepping is priced apart from ``benchmarks/env_costs.json``. Timed in process CPU seconds with
``bench_speed_mad.py``'s harness (setups take turns, so load hits all alike). The table names the machine it came
from (CPU model, cores, memory) and the load while it ran.
Run: ``MUJOCO_GL=disable nice -n 10 .venv/bin/python benchmarks/cpu_rates.py [--updates 200] [--out PATH]``.
"""

import argparse
import datetime
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_speed_mad import Setup  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CELLS = [("sac_ln", 64), ("sac_ln", 256), ("sac_ln", 512), ("mad_sac", 256)]  # (agent, width = batch)


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (``unknown CPU`` elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown CPU"
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "unknown CPU")


def main() -> None:
    """Measures every cell of :data:`CELLS` with te and QED, writes the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--updates", type=int, default=200, help="timed decisions at width 64 (fewer when wider)")
    p.add_argument("--out", type=Path, default=ROOT / "qed_ray" / "data" / "throughput_cpu.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    load = [os.getloadavg()[0]]
    entries = []
    for agent, width in CELLS:
        n = max(10, args.updates * 64 // width // (4 if agent == "mad_sac" else 1))
        cfg = SimpleNamespace(task="cheetah-run", buffer=2000, hidden=width, batch=width, compile=False)
        setups = {t: Setup(agent, t, cfg, torch.device("cpu")) for t in ("te", "qed")}
        for rounds, timed in ((3, False), (n, True)):
            for _ in range(rounds):
                for s in setups.values():
                    s.decision(timed)
        for t, s in setups.items():
            ms = s.report(f"{agent:8s} {t:4s} {width:4d}", n)
            per_decision = ms["decision"] - 1e3 * s.parts["env_cpu"] / n  # env stepping: env_costs.json's
            entries.append({"agent": agent, "temperature": t, "seeds": 1, "packs": 1, "mode": "off",
                            "hidden": width, "batch": width, "seed_decisions_per_s": round(1e3 / per_decision, 2),
                            "decisions": n})
        load.append(os.getloadavg()[0])
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    table = {"schema": 1, "device": "cpu", "card": cpu_name(), "cpus": os.cpu_count(), "host_bytes": mem,
             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "torch": torch.__version__, "load_avg_1m": [round(x, 2) for x in load], "entries": entries}
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {args.out} ({len(entries)} cells; load {load[0]:.2f} -> {load[-1]:.2f})")


if __name__ == "__main__":
    main()
