"""The bill of a sweep (qed_ray.service.bill, dry_plan): pack rates from the throughput table and their stated
scalings, a pack's wall time, packs longest first, the schedule's tail, every shipped GPU spec priced on the shipped
clusters' cards, and dmc18's dry run as a plan of at most 40 lines."""

import json
from pathlib import Path

import pytest

from kit import sweep_spec, widest
from qed_ray.config import RunSpec
from qed_ray.service.bill import CLUSTERS, ENV_COSTS_PATH, PackRate, pack_rate, pack_seconds, schedule
from qed_ray.service.dry_plan import bill_line, order_packs, price
from qed_ray.service.memory import NODE_TYPES
from qed_ray.service.packing import form_packs
from qed_ray.service.throughput import load_throughput, parse_throughput
from qed_ray.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
H100 = "NVIDIA H100 80GB HBM3"
TABLE = parse_throughput({"schema": 1, "device": "cuda", "card": H100, "date": "2026-11-26", "entries": [
    {"agent": "sac_ln", "temperature": "te", "seeds": 10, "packs": 1, "mode": "graph", "seed_decisions_per_s": 1000},
    {"agent": "sac_ln", "temperature": "te", "seeds": 20, "packs": 1, "mode": "graph", "seed_decisions_per_s": 1500},
    {"agent": "sac_ln", "temperature": "te", "seeds": 10, "packs": 2, "mode": "graph", "seed_decisions_per_s": 600}]})


# Two packs of 10 seeds at the paper's size, 10,000 decisions each, over kit's sweep.
BILLED = {"name": "b", "tasks": ["cartpole-balance", "quadruped-run"], "seeds": 10,
          "pack": {"seeds": 10, "env_workers": 3}, "resources": {"cpu": 1, "gpu": 1.0},
          "agents": [{"name": "sac_ln", "overrides": {"hidden": 512, "batch_size": 512},
                      "temperatures": [{"kind": "te"}]}],
          "train": {"env_steps": 20_000, "eval_every": 10_000, "eval_episodes": 2, "warmup_decisions": 100}}


def test_a_packs_rate_is_measured_or_scaled_as_stated():
    run = sweep_spec(BILLED).runs()[0]
    assert pack_rate(TABLE, run, 10, 1, None) == PackRate(1000, 1000, frozenset())
    assert pack_rate(TABLE, run, 10, 2, None) == PackRate(1200, 1000, frozenset())  # 2 packs x 600, measured
    assert pack_rate(TABLE, run, 15, 1, None) == PackRate(1250, 1250, frozenset({"S=15 between S=10 and S=20"}))
    held = pack_rate(TABLE, run, 30, 1, None)
    assert held == PackRate(1500, 1500, frozenset({"S=30 at the S=20 cell's rate"}))
    # Two packs of 15 on a card whose sharing was not measured for them: at most one pack of 30.
    assert pack_rate(TABLE, run, 15, 2, None) == PackRate(1500, 1250, frozenset({
        "S=15 between S=10 and S=20", "S=30 at the S=20 cell's rate", "2 packs of S=15 as one pack of S=30"}))
    a10g = pack_rate(TABLE, run, 10, 1, NODE_TYPES["g5.4xlarge"])
    assert a10g.shared == pytest.approx(1000 * 35.0 / 66.9) and a10g.notes == {
        f"NVIDIA A10G = {H100} x 35/66.9 FP32 TFLOP/s"}
    tf32 = run.model_copy(update={"train": run.train.model_copy(update={"precision": "tf32"})})
    assert pack_rate(TABLE, tf32, 10, 1, None).notes == {"tf32 priced as fp32"}
    mad = RunSpec.model_validate({"task": "cheetah-run", "agent": {"name": "mad_sac", "hidden": 512, "batch_size": 512},
                                  "temperature": {"kind": "te"}})
    assert pack_rate(TABLE, mad, 10, 1, None) is None  # nothing to scale from


def test_a_packs_wall_time_is_its_card_time_or_its_env_stepping_and_packs_go_longest_first():
    spec = sweep_spec(BILLED)
    packs = form_packs(spec)
    assert [p.id.task for p in packs] == ["cartpole-balance", "quadruped-run"]  # grid order
    costs = {t: d["ms_per_decision"] / 1000 for t, d in json.loads(ENV_COSTS_PATH.read_text())["tasks"].items()}
    evals = 2 * 500 / 5000  # eval episodes x decisions per episode / decisions between evaluations
    rate = pack_rate(TABLE, packs[0].trials[0].run, 10, 1, None)
    for p in packs:  # t = max(S Q / r_Q, S / r_1 + S c (1 + e) / W) per decision, 10,000 decisions
        want = 10_000 * max(10 / 1000, 10 / 1000 + 10 * costs[p.id.task] * (1 + evals) / 3)
        assert pack_seconds(p, rate, 1, 3) == pytest.approx(want)
    assert [p.id.task for p in order_packs(spec, packs, TABLE)] == ["quadruped-run", "cartpole-balance"]
    assert order_packs(spec, packs, None) == packs  # nothing to rank by: grid order
    cpu = sweep_spec(BILLED, resources={"cpu": 1, "gpu": 0})
    assert order_packs(cpu, form_packs(cpu), TABLE) == form_packs(cpu)


def test_the_schedule_holds_each_node_until_its_last_pack_ends():
    # Three packs of 10 s on one node of 2 slots: 10 + 10 on one slot, so the node is held 20 s for 15 s of work.
    s = schedule([10, 10, 10], 1, 2)
    assert (s.makespan_s, s.node_hours * 3600, s.busy_hours * 3600) == (20, 20, 15)
    # Longest first on 2 nodes of 2 slots: 5, 4 | 3, 3, then the last 3 after a 3: the nodes end at 5 and 6.
    s = schedule([3, 5, 3, 4, 3], 2, 2)
    assert s.makespan_s == 6 and s.node_hours * 3600 == pytest.approx(5 + 6) and s.busy_hours * 3600 == 9


@pytest.mark.parametrize("name", ["dmc18", "ablations", "fixed_alpha", "hopper_hop", "claim"])
def test_every_shipped_gpu_spec_is_priced_on_each_shipped_card(name):
    spec = load_spec(ROOT / "sweeps" / f"{name}.yaml")
    assert spec.resources.gpu > 0
    packs, table = form_packs(spec), load_throughput()
    for node_name, card in (("g5.4xlarge", "NVIDIA A10G"), ("g2-standard-16", "NVIDIA L4")):
        node = NODE_TYPES[node_name]
        priced = price(spec, packs, table, node)
        assert None not in priced.rates
        line = bill_line(spec, priced, node, 8, "cluster/x.yaml")
        assert line.startswith(f"GPU-hours on the {card} (cluster/x.yaml: 8 x {node_name}, ") and "unknown" not in line
        assert " with the tail (" in line and "; wall clock " in line


def test_dmc18s_dry_run_is_a_plan_of_at_most_40_lines(tmp_path, monkeypatch, capsys):
    from qed_ray.service.sweep_cli import main

    monkeypatch.setenv("QED_STORAGE_PATH", str(tmp_path / "results"))
    assert main([str(ROOT / "sweeps" / "dmc18.yaml"), "--dry-run"]) == 0
    wrapped = capsys.readouterr().out.splitlines()  # not a terminal: 100 columns (qed_ray.console)
    assert widest("\n".join(wrapped)) <= 100 and len(wrapped) <= 40
    monkeypatch.setattr("qed_ray.console.width", lambda stream=None: 1000)  # a wide terminal: a line per item
    assert main([str(ROOT / "sweeps" / "dmc18.yaml"), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) > 100 and " ".join(" ".join(lines).split()) == " ".join(" ".join(wrapped).split())
    assert len(lines) <= 40 and not any("unknown" in line for line in lines)
    assert lines[1] == "trials: 1,440 new (each trial: --list)"
    shapes = [line for line in lines if line.startswith("  ") and " S=" in line and "memory per pack" in line]
    assert [s.split(":")[0].strip() for s in shapes] == [
        "mad_sac/qed0.2,qed0.3,qed0.4 S=30", "sac_ln/qed0.1,qed0.2,qed0.4 S=30", "mad_sac/te S=10", "sac_ln/te S=10"]
    assert all("18 packs, " in s and "(quadruped-run): host " in s and "; fits " in s for s in shapes)
    bills = [line for line in lines if line.startswith("GPU-hours on the ")]
    assert [b.split(" (")[0] for b in bills] == ["GPU-hours on the NVIDIA A10G", "GPU-hours on the NVIDIA L4",
                                                 f"GPU-hours on the {H100}"]
    assert "(cluster/aws.yaml: 8 x g5.4xlarge, 2 packs each)" in bills[0] and "wall clock" in bills[0]
    assert not (tmp_path / "results").exists()


def test_list_and_workers_belong_to_the_dry_run(tmp_path, monkeypatch, capsys):
    from qed_ray.service.sweep_cli import main

    monkeypatch.setenv("QED_STORAGE_PATH", str(tmp_path / "results"))
    smoke = str(ROOT / "sweeps" / "smoke.yaml")
    assert main([smoke, "--list"]) == 2
    assert capsys.readouterr().err == "error: --list, --workers: only with --dry-run\n"
    assert main([smoke, "--dry-run", "--workers", "0"]) == 2
    assert capsys.readouterr().err == "error: --workers: 0 worker nodes; allowed 1 or more\n"
    assert main([smoke, "--dry-run", "--list"]) == 0
    out = capsys.readouterr().out
    assert "trials: 12 new\n" in out and out.count("\n    cheetah-run/sac_ln/") == 6
    assert widest(out) <= 100, "not a terminal: 100 columns at most"
    assert "CPU-hours: at least " in out and "on 1 node(s) of 16 CPUs" in out
    assert not (tmp_path / "results").exists()


def test_the_shipped_clusters_are_the_configs_workers():
    import yaml

    for config, node, max_workers in CLUSTERS.values():
        cfg = yaml.safe_load((ROOT / config).read_text())
        assert cfg["max_workers"] == max_workers and node in str(cfg["available_node_types"])
