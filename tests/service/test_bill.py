"""The plan of a sweep (qed_ray.service.plan.dry_plan, dry_run): rates looked up in the measured tables and each
step that is not a measured cell named, a pack's wall time, the schedule's tail, the plan on this machine (its
cores injected), on every shipped cluster with its price, pack sizes that fit, "not runnable as shipped", and the
resources refused before anything is written."""

import re
from pathlib import Path

import pytest
import yaml

from kit import flat, widest
from qed_ray.spec.config import RunSpec
from qed_ray.spec.replay_memory import GIB
from qed_ray.service.plan.dry_plan import (ENV_COSTS_PATH, NODE_START_S, PACK_START_S, Rate, Tables, env_costs,
                                           fit_problem, machine_lines, order_packs, pack_rate, pack_seconds, per_node,
                                           schedule, size_packs)
from qed_ray.service.plan.machines import Machine, clusters, load_prices, this_machine
from qed_ray.service.packing import form_packs
from qed_ray.records.throughput import CPU_PATH, load_table, load_throughput, parse_throughput
from qed_ray.spec.sweep import PackSpec, SpecError, SweepSpec, load_spec

ROOT = Path(__file__).resolve().parents[2]
H100 = "NVIDIA H100 80GB HBM3"
TABLE = parse_throughput({"schema": 1, "device": "cuda", "card": H100, "date": "2026-11-26", "entries": [
    {"agent": "sac_ln", "temperature": "te", "seeds": 10, "packs": 1, "mode": "graph", "seed_decisions_per_s": 1000},
    {"agent": "sac_ln", "temperature": "te", "seeds": 20, "packs": 1, "mode": "graph", "seed_decisions_per_s": 1500},
    {"agent": "sac_ln", "temperature": "te", "seeds": 10, "packs": 2, "mode": "graph", "seed_decisions_per_s": 600}]})
PEAKS = {H100: 66.9, "NVIDIA A10G": 35.0}
H100_NODE = Machine("measured", "h", H100, 80 * GIB, 200 * GIB, 32, 1, 1)
SMOKE, DMC18 = ROOT / "sweeps" / "smoke.yaml", ROOT / "sweeps" / "dmc18.yaml"


def _run(**agent) -> RunSpec:
    return RunSpec.model_validate({"task": "cheetah-run", "agent": {"name": "sac_ln", "hidden": 512, "batch_size": 512,
                                                                    **agent},
                                   "temperature": {"kind": "te"}, "train": {"precision": "fp32"}})


def test_a_packs_rate_is_a_measured_cell_or_each_step_is_named_or_there_is_no_estimate():
    run = _run()
    assert pack_rate(run, 10, 1, H100_NODE, TABLE, PEAKS) == Rate(1000, 1000, frozenset())
    assert pack_rate(run, 10, 2, H100_NODE, TABLE, PEAKS) == Rate(1200, 1000, frozenset())  # 2 x 600, measured
    assert pack_rate(run, 15, 1, H100_NODE, TABLE, PEAKS) == Rate(1250, 1250, frozenset(
        {"sizes between measured ones linear"}))
    assert pack_rate(run, 30, 1, H100_NODE, TABLE, PEAKS) == Rate(1500, 1500, frozenset({"packs past S=20 at its rate"}))
    assert pack_rate(run, 15, 2, H100_NODE, TABLE, PEAKS) == Rate(1500, 1250, frozenset({  # 2 x 15 as one pack of 30
        "sizes between measured ones linear", "packs past S=20 at its rate", "2 packs on a card as one pack of their "
                                                                              "seeds"}))
    a10g = pack_rate(run, 10, 1, Machine("aws", "g5", "NVIDIA A10G", 1, 1, 16, 1, 8), TABLE, PEAKS)
    assert a10g.shared == pytest.approx(1000 * 35.0 / 66.9) and a10g.notes == {
        f"NVIDIA A10G extrapolated from the measured {H100} by FP32 peak (35/66.9)"}
    three = _run().model_copy(update={"train": _run().train.model_copy(update={"precision": "3xtf32"})})
    assert pack_rate(three, 10, 1, H100_NODE, TABLE, PEAKS).notes == {"3xtf32 priced as fp32"}
    assert pack_rate(_run(hidden=256), 10, 1, H100_NODE, TABLE, PEAKS) == (
        "sac_ln/te hidden 256, batch 512 (graph) was never measured on a GPU (the NVIDIA H100 80GB HBM3 table: "
        "hidden 512, batch 512)")
    cpu, here = load_table(CPU_PATH), this_machine(cpus=2, host_bytes=8 * GIB, gpus=0)
    small = _run(hidden=64, batch_size=64)
    want = cpu.rate("sac_ln", "te", 1, 1, "off", shape=(64, 64))
    assert pack_rate(small, 1, 0, here, cpu, PEAKS) == Rate(want, want, frozenset()) and want > 0
    assert pack_rate(small, 3, 0, here, cpu, PEAKS).startswith("sac_ln/te hidden 64, batch 64, S=3 was never "
                                                               "measured on the CPU")
    assert pack_rate(small, 1, 0, here, None, PEAKS) == "no CPU rate table (benchmarks/cpu_rates.py)"


def test_a_packs_wall_time_and_the_order_packs_go_to_tune():
    spec = SweepSpec.model_validate({
        "name": "b", "tasks": ["cartpole-balance", "quadruped-run"], "seeds": 10, "resources": {"cpu": 1, "gpu": 1},
        "pack": {"seeds": 10, "env_workers": 3}, "agents": [{"name": "sac_ln", "temperatures": [{"kind": "te"}],
                                                             "overrides": {"hidden": 512, "batch_size": 512}}],
        "train": {"env_steps": 20_000, "eval_every": 10_000, "eval_episodes": 2, "warmup_decisions": 100,
                  "precision": "fp32"}})
    packs = form_packs(spec)
    costs = env_costs(ENV_COSTS_PATH)
    assert ENV_COSTS_PATH == ROOT / "benchmarks" / "env_costs.json" and costs["quadruped-run"] > 0  # the measured file
    for p in packs:  # PACK_START_S + decisions x max(S Q / r_Q, S / r_1 + S c (1 + e) / W); e = 2 x 500 / 5,000
        want = PACK_START_S + 10_000 * max(10 / 1000, 10 / 1000 + 10 * costs[p.id.task] * 1.2 / 3)
        assert pack_seconds(p, Rate(1000, 1000, frozenset()), 1, 3) == pytest.approx(want)
    assert [p.id.task for p in order_packs(spec, packs, TABLE)] == ["quadruped-run", "cartpole-balance"]
    assert order_packs(spec, packs, None) == packs  # nothing to rank by: grid order


def test_the_schedule_holds_each_node_until_its_last_pack_ends():
    s = schedule([10, 10, 10], 1, 2)  # 10 + 10 on one slot: the node is held 20 s for 15 s of work
    assert (s.makespan_s, s.node_hours * 3600, s.busy_hours * 3600) == (20, 20, 15)
    s = schedule([3, 5, 3, 4, 3], 2, 2)  # 5, 4 | 3, 3, then the last 3 after a 3: the nodes end at 5 and 6
    assert s.makespan_s == 6 and s.node_hours * 3600 == pytest.approx(5 + 6) and s.busy_hours * 3600 == 9


@pytest.mark.parametrize("cores", [2, 8])
def test_the_smoke_plan_on_a_machine_of_n_cores_is_priced_from_the_stored_cpu_rates(cores, tmp_path, monkeypatch,
                                                                                     capsys):
    from qed_ray.service.plan.dry_run import dry_run

    monkeypatch.setenv("QED_STORAGE_PATH", str(tmp_path / "results"))
    spec, here = load_spec(SMOKE), this_machine(cpus=cores, host_bytes=16 * GIB, gpus=0)
    assert dry_run(spec, here=here) == 0
    out = capsys.readouterr().out
    assert widest(out) <= 100 and not (tmp_path / "results").exists()
    cpu, costs = load_table(CPU_PATH), env_costs(ENV_COSTS_PATH)
    seconds = []
    for p in form_packs(spec):  # the model by hand: 3,000 decisions at the stored rate plus env stepping
        run, t = p.trials[0].run, p.trials[0].run.train
        rate = cpu.rate("sac_ln", run.temperature.kind, 1, 1, "off", shape=(64, 64))
        evals = t.eval_episodes * t.episode_decisions / t.eval_every_decisions
        seconds.append(PACK_START_S + 3000 * (1 / rate + costs[run.task] * (1 + evals)))
    s = schedule(seconds, 1, cores)
    block = flat(out).split("this machine (no GPU; ")[1].split(" aws: ")[0]
    assert block.startswith(f"{cores} CPUs, 16.0 GiB for packs) packs of 1 (pack.seeds): 12 packs, {cores} per node")
    hours = f"CPU-hours {s.node_hours * cores:.2f} with the tail ({sum(seconds) / 3600:.2f} in packs)"
    minutes = s.makespan_s / 60  # tenths under 10 minutes: a short sweep's clock is never printed as 0
    assert hours in block and f"wall clock {minutes:.{1 if minutes < 10 else 0}f} min" in block
    assert sum(seconds) > 12 * PACK_START_S and s.node_hours > 0 and minutes > 0.1
    assert f"rates: {cpu.card} (cpu, {cpu.cpus} CPUs), measured {cpu.date[:10]}" in flat(out)


def test_dmc18s_plan_gives_each_shipped_cluster_a_pack_size_that_fits_a_wall_clock_and_a_price(tmp_path, monkeypatch,
                                                                                                capsys):
    from qed_ray.service.sweep_cli import main

    monkeypatch.setenv("QED_STORAGE_PATH", str(tmp_path / "results"))
    monkeypatch.setenv("RAY_ADDRESS", "local")  # a start from here would run on this CPU machine: refused after
    for where in ("machines", "dry_run"):  # a CPU machine, whatever this one has
        monkeypatch.setattr(f"qed_ray.service.plan.{where}.this_machine", lambda: this_machine(cpus=2, gpus=0))
    assert main([str(DMC18), "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert err == ("error: resources.gpu: a pack asks for 0.5 GPU and this machine has none; set resources.gpu: 0 to "
                   "train on CPUs, or run on a GPU cluster\n")
    assert widest(out) <= 100 and len(out.splitlines()) <= 60 and not (tmp_path / "results").exists()
    text, spec, prices = flat(out), load_spec(DMC18), load_prices()
    assert spec.pack.seeds == "auto" and "this machine (no GPU; " in text
    assert "not runnable as shipped: resources.gpu: a pack asks for 0.5 GPU" in text
    whole = form_packs(spec, size=10**6)
    for m in clusters(prices):
        block = text.split(f" {m.name}: {m.nodes} x {m.node} ({m.card}, ")[1].split(" legend: ")[0]
        size = int(re.search(r"packs of (\d+) \(auto\)", block).group(1))
        sized = spec.sized(size)
        packs = [p for p in form_packs(sized) if len(p.trials) == size]
        assert all(fit_problem(sized, p, m) is None for p in packs), m.name
        assert len(form_packs(sized)) >= m.nodes * per_node(sized, m)  # every node busy
        assert re.search(r"GPU-hours [\d,]+ with the tail \([\d,]+ in packs\); wall clock [\d,.]+ h", block)
        assert re.search(r"\$[\d,.]+ on demand, \$[\d,.]+ spot", block), m.name
        assert "spot: an interruption loses up to " in block and "not runnable" not in block.split(" rates: ")[0]
    assert [m.name for m in clusters(prices)] == ["aws", "gcp", "kuberay"]
    assert ("prices: list prices as of 2025-01 from cluster/prices.yaml (AWS EC2 On-Demand Pricing page" in text
            and "us-central1), not checked since: check them before you rely on them; --price-per-hour overrides "
                "them" in text)
    assert "legend: packs of S (auto): the largest pack that fits a node and keeps every node busy; with the tail" \
        in text


def test_a_node_that_holds_no_pack_is_not_runnable_as_shipped_with_the_reason_and_the_fix():
    spec, prices = load_spec(DMC18), load_prices()
    tables = Tables(load_throughput(), load_table(CPU_PATH), prices)
    tiny = Machine("tiny", "t1.small", "NVIDIA A10G", 22 * GIB, 4 * GIB, 16, 1, 4, 1.0, 0.5)
    whole = form_packs(spec, size=10**6)
    lines = machine_lines(spec, whole, tiny, tables, False, None, None)
    assert lines[0] == "tiny: 4 x t1.small (NVIDIA A10G, 22.0 GiB; 16 CPUs, 4.0 GiB for packs)"
    assert re.fullmatch(r"  not runnable as shipped: \w+/[\w.,]+ S=1: 2 x [\d.]+ GiB host memory > 90% of "
                        r"t1.small.s 4.0 GiB; fix: a machine with more memory", lines[1]) and len(lines) == 2
    fixed = spec.sized(30)  # a registered size: too large for a 40 GiB node, the size that fits is named
    mid = Machine("mid", "m1", "NVIDIA A10G", 24 * GIB, 40 * GIB, 16, 1, 4, 1.0, 0.5)  # 2 x 11.2 GiB packs per card
    (head, why) = machine_lines(fixed, whole, mid, tables, False, None, None)
    assert re.fullmatch(r"  not runnable as shipped: \w+/qed[\w.,]+ S=30: 2 x [\d.]+ GiB host memory "
                        r"> 90% of m1's 40.0 GiB; fix: pack.seeds: \d+ \(or auto\)", why)
    few_cpus = machine_lines(spec, whole, Machine("c", "c2", "NVIDIA A10G", 22 * GIB, 64 * GIB, 2, 1, 4), tables,
                             False, None, None)
    assert few_cpus[1] == ("  not runnable as shipped: resources.cpu: a pack asks for 4 CPUs (resources.cpu + "
                           "pack.env_workers) and c2 has 2; ask for at most 2")


def test_the_price_per_hour_and_the_card_options(tmp_path, monkeypatch, capsys):
    from qed_ray.service.sweep_cli import main

    monkeypatch.setenv("QED_STORAGE_PATH", str(tmp_path / "results"))
    monkeypatch.setenv("RAY_ADDRESS", "ray://elsewhere:10001")  # a joined cluster: this machine is not checked
    spec = load_spec(DMC18)
    assert main([str(DMC18), "--dry-run", "--price-per-hour", "2", "--card", "NVIDIA L4", "--workers", "4"]) == 0
    text = flat(capsys.readouterr().out)
    assert "kuberay: 4 x a 14-CPU pod (NVIDIA L4, 22.5 GiB; 14 CPUs, 40.0 GiB for packs)" in text
    aws = text.split(" aws: 4 x g5.4xlarge ")[1].split(" gcp: ")[0]
    hours = float(re.search(r"GPU-hours ([\d,]+) with the tail", aws).group(1).replace(",", ""))
    wall = float(re.search(r"wall clock ([\d,.]+) h", aws).group(1).replace(",", ""))
    dollars = float(re.search(r"\$([\d,]+) at --price-per-hour 2", aws).group(1).replace(",", ""))
    assert dollars == pytest.approx(hours * 2 + 0.384 * wall, abs=1 + 0.384 * 0.05 + 2)  # rounding of the printout
    assert main([str(DMC18), "--dry-run", "--card", "TPU"]) == 2
    assert "error: --card: 'TPU' is not a card of cluster/prices.yaml" in capsys.readouterr().err
    assert main([str(SMOKE), "--price-per-hour", "2"]) == 2
    assert capsys.readouterr().err == "error: --list, --workers, --card, --price-per-hour: only with --dry-run\n"
    assert spec.pack.seeds == "auto" and not (tmp_path / "results").exists()


def test_a_gpu_on_this_cpu_machine_is_refused_by_the_dry_run_and_by_a_start_before_any_folder(tmp_path, monkeypatch,
                                                                                           capsys):
    from qed_ray.service.sweep_cli import main

    raw = yaml.safe_load(SMOKE.read_text())
    raw["resources"] = {"cpu": 1, "gpu": 1}
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(raw))
    monkeypatch.setenv("QED_STORAGE_PATH", str(tmp_path / "results"))
    monkeypatch.setenv("RAY_ADDRESS", "local")
    for where in ("machines", "dry_run"):  # a CPU machine, whatever this one has
        monkeypatch.setattr(f"qed_ray.service.plan.{where}.this_machine", lambda: this_machine(cpus=2, gpus=0))
    message = ("error: resources.gpu: a pack asks for 1 GPU and this machine has none; set resources.gpu: 0 to train "
               "on CPUs, or run on a GPU cluster\n")
    assert main([str(path), "--dry-run"]) == 2
    assert capsys.readouterr().err == message
    assert main([str(path)]) == 2
    assert capsys.readouterr().err == message
    assert not (tmp_path / "results").exists()


def test_the_price_table_names_its_date_and_sources_and_the_clusters_are_the_configs_workers():
    prices = load_prices()
    assert prices.date == "2025-01" and set(prices.sources) == {"aws", "gcp"}
    assert all(n.spot < n.on_demand and n.card in prices.cards for n in prices.nodes.values())
    for name, c in prices.clusters.items():
        docs = list(yaml.safe_load_all((ROOT / c.config).read_text()))
        assert c.worker is None or c.worker in str(docs[0]["available_node_types"]), name
    kuberay = next(m for m in clusters(prices) if m.name == "kuberay")
    assert (kuberay.cpus, kuberay.host_bytes, kuberay.card) == (14, (56 - 16) * GIB, "NVIDIA A10G")  # less /dev/shm


SHIPPED_SIZES = {"ablations": (1, 1, 1), "fixed_alpha": (5, 5, 5), "hopper_hop": (1, 1, 1), "claim": (15, 15, 15)}


@pytest.mark.parametrize("name", sorted(SHIPPED_SIZES))
def test_every_shipped_gpu_spec_is_runnable_and_priced_on_each_shipped_cluster_at_a_size_that_fits(name):
    spec, prices = load_spec(ROOT / "sweeps" / f"{name}.yaml"), load_prices()
    tables = Tables(load_throughput(), load_table(CPU_PATH), prices)
    whole, how = form_packs(spec, size=10**6), "pack.seeds" if name == "claim" else "auto"
    assert spec.pack.seeds == (15 if name == "claim" else "auto")  # the claim's size is pre-registered
    for m, size in zip(clusters(prices), SHIPPED_SIZES[name], strict=True):
        text = flat("\n".join(machine_lines(spec, whole, m, tables, False, None, None)))
        assert f" packs of {size} ({how}): " in text, (m.name, text)
        sized = spec.sized(size)
        assert all(fit_problem(sized, p, m) is None for p in form_packs(sized)), m.name
        assert "not runnable" not in text and "no estimate" not in text, (m.name, text)
        assert re.search(r"GPU-hours [\d,.]+ with the tail .* wall clock [\d,.]+ h .*\$[\d,.]+ on demand", text), text


def test_ten_mad_sac_packs_of_one_on_a_24_gb_card_are_not_runnable_and_the_fix_names_the_share_that_fits():
    spec, prices = load_spec(ROOT / "sweeps" / "fixed_alpha.yaml").sized(1), load_prices()
    spec = spec.model_copy(update={"resources": spec.resources.model_copy(update={"gpu": 0.1})})  # as once shipped
    tables = Tables(load_throughput(), load_table(CPU_PATH), prices)
    for m in clusters(prices):
        text = flat("\n".join(machine_lines(spec, form_packs(spec), m, tables, False, None, None)))
        assert re.search(r"not runnable as shipped: mad_sac/\S+ S=1: 10 x 2.5 GiB GPU memory > the NVIDIA \w+'s "
                         r"22.5 GiB; fix: resources.gpu: 0.125 \(8 packs per card\)$", text), text
    # At 8 per card a pack of 5 fits with quadruped-run's replay on the host, not with cheetah-run's on the card.
    eight = spec.model_copy(update={"resources": spec.resources.model_copy(update={"gpu": 0.125}),
                                    "pack": PackSpec(seeds="auto")})
    aws, whole = clusters(prices)[0], form_packs(eight, size=10**6)
    five = {p.id.task: p for p in form_packs(eight.sized(5))}
    assert fit_problem(eight.sized(5), five["quadruped-run"], aws) is None
    assert fit_problem(eight.sized(5), five["cheetah-run"], aws).startswith("8 x 3.3 GiB GPU memory > ")
    size, _, how = size_packs(eight, whole, aws, False)
    assert (size, how) == (1, "auto")


def test_auto_packs_resolve_to_the_registered_size_this_machine_or_the_named_cluster(monkeypatch):
    from qed_ray.service.plan.dry_run import sized_spec

    spec = load_spec(DMC18)
    assert sized_spec(spec, 20).pack.seeds == 20  # a started sweep keeps its registered size
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    monkeypatch.setenv("QED_CLUSTER", "aws")
    assert sized_spec(spec, None).pack.seeds == 30
    monkeypatch.delenv("QED_CLUSTER")
    assert sized_spec(spec, None).pack.seeds == 15  # every shipped cluster's workers hold packs of 15
    monkeypatch.setenv("QED_CLUSTER", "azure")
    with pytest.raises(SpecError, match=r"QED_CLUSTER: 'azure' is not a cluster of cluster/prices.yaml \(aws, gcp, "):
        sized_spec(spec, None)
    smoke = load_spec(SMOKE).model_copy(update={"pack": load_spec(SMOKE).pack.model_copy(update={"seeds": "auto"})})
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert sized_spec(smoke, None, this_machine(cpus=2, gpus=0)).pack.seeds == 1  # on CPUs: packs of one
    lines = machine_lines(smoke, form_packs(smoke, size=10**6), this_machine(cpus=2, gpus=0),
                          Tables(None, load_table(CPU_PATH), None), False, None, None)
    assert lines[1].startswith("  packs of 1 (auto: the CPU table measures packs of one only): 12 packs, 2 per node;")
