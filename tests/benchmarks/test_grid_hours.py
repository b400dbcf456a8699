"""benchmarks/grid_hours.py: the grid's trial counts and the GPU-hours model on hand-computed cases."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

from qed_ray.service.throughput import parse_throughput

ROOT = Path(__file__).parents[2]


def load_module():
    spec = importlib.util.spec_from_file_location("grid_hours", ROOT / "benchmarks" / "grid_hours.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["grid_hours"] = mod  # dataclasses look their module up while the file runs
    spec.loader.exec_module(mod)
    return mod


GH = load_module()
SWEEP = {"tasks": ["cheetah-run"], "seeds": 10, "agents": [{"name": "sac_ln", "temperatures": [{"kind": "te"}]}],
         "train": {"env_steps": 2000, "frame_skip": 2, "eval_every": 1000, "eval_episodes": 1}}
COSTS = {"machine": "test", "load_avg_1m": 0.0, "tasks": {"cheetah-run": {"ms_per_decision": 1.0, "obs_dim": 17,
                                                                          "action_dim": 6}}}


def entry(seeds, packs, mode, rate, peak=100.0):
    return {"agent": "sac_ln", "temperature": "te", "seeds": seeds, "packs": packs, "mode": mode,
            "seed_decisions_per_s": rate, "peak_mib": peak}


TABLE = parse_throughput({"schema": 1, "device": "cuda", "card": "test card", "date": "d", "entries": [
    entry(10, 1, "graph", 1000.0), entry(10, 2, "graph", 800.0), entry(1, 1, "single", 100.0)]})


def test_the_paper_grid_has_1440_trials_of_a_million_decisions():
    g = GH.grid(yaml.safe_load((ROOT / "sweeps" / "dmc18.yaml").read_text()))
    assert g["trials"] == {("sac_ln", "te"): 180, ("sac_ln", "qed"): 540, ("mad_sac", "te"): 180,
                           ("mad_sac", "qed"): 540}
    assert len(g["tasks"]) == 18 and g["decisions"] == 1_000_000
    assert g["eval_share"] == 0.5  # 10 episodes x 500 decisions every 10,000 decisions


def test_hours_of_a_packed_layout_by_hand():
    g = GH.grid(SWEEP)
    assert (g["decisions"], g["eval_share"]) == (1000, 1.0)
    # S=10, Q=2 (GPU: 2 x 800 = 1600/s), W=2: t = max(10*2/1600, 10/1000 + 10*0.001*2/2) = 0.02 s per pack
    # decision; the GPU does 20/0.02 = 1000 seed-decisions/s; 10 trials x 1000 decisions = 10 s.
    h = GH.hours(TABLE, COSTS, g, GH.Layout(10, 2, 2))
    assert h["total"] == pytest.approx(10 / 3600) and not h["scaled"]
    # the single-seed path: t = 1/100 + 0.001 * 2 = 0.012 s per decision, 10 trials per GPU: 12 s
    assert GH.as_is_hours(TABLE, COSTS, g)["total"] == pytest.approx(12 / 3600)
    assert GH.hours(TABLE, COSTS, g, GH.Layout(20, 1, 1)) is None  # S=20 not measured: no guess


def test_the_best_layout_respects_the_vcpus_and_gpu_memory_of_a_node():
    g = GH.grid(SWEEP)
    layout, h = GH.best(TABLE, COSTS, g, vcpus=16, gpu_mib=80 * 1024)
    assert (layout.seeds, layout.packs) == (10, 2) and layout.workers == 4  # more workers: less env time
    assert h["total"] == pytest.approx(GH.hours(TABLE, COSTS, g, layout)["total"])
    assert GH.best(TABLE, COSTS, {**g, "seeds": 5}, vcpus=16, gpu_mib=80 * 1024) is None  # S=10 > 5 seeds
    layout, _ = GH.best(TABLE, COSTS, g, vcpus=4, gpu_mib=80 * 1024)  # 2 packs need 2 x (1 + W) vCPUs
    assert layout.packs * (1 + layout.workers) <= 4
    replay_mib = 10 * 1_000_000 * (2 * 17 + 6 + 2) * 4 / 2**20
    assert GH.pack_memory_mib(TABLE, COSTS, GH.Layout(10, 1, 1)) == pytest.approx(100.0 + replay_mib)
    assert GH.best(TABLE, COSTS, g, vcpus=16, gpu_mib=replay_mib) is None  # no pack fits


def test_without_a_gpu_table_it_says_so(tmp_path, capsys):
    GH.main(["--throughput", str(tmp_path / "none.json")])
    assert "no GPU measurement yet" in capsys.readouterr().out
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps({"schema": 1, "device": "cpu", "card": "cpu", "date": "d",
                               "entries": TABLE.entries}))
    GH.main(["--throughput", str(cpu), "--sweep", str(ROOT / "sweeps" / "dmc18.yaml")])
    out = capsys.readouterr().out
    assert "no GPU measurement yet" in out and "NOT GPU-hours" in out
