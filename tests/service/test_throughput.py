"""The throughput table's reader (qed_ray.service.throughput): schema, lookups and the no-GPU-yet case."""

import json

import pytest

from qed_ray.service.throughput import DEFAULT_PATH, load_throughput, parse_throughput

pytestmark = pytest.mark.torch_only

ENTRY = {"agent": "sac_ln", "temperature": "qed", "seeds": 10, "packs": 2, "mode": "graph",
         "seed_decisions_per_s": 1500.0, "peak_mib": 700.0}


def table(**over):
    raw = {"schema": 1, "device": "cuda", "card": "NVIDIA H100 80GB HBM3", "date": "2026-11-26T10:00:00+00:00",
           "entries": [ENTRY, {**ENTRY, "packs": 1, "seed_decisions_per_s": 2000.0}], "checks": {}}
    return {**raw, **over}


def test_a_gpu_table_gives_the_rate_of_the_whole_gpu_for_a_measured_cell(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table()))
    t = load_throughput(path)
    assert t.card == "NVIDIA H100 80GB HBM3"
    assert t.decisions_per_s("sac_ln", "qed", 10, packs_per_gpu=2) == 3000.0  # 2 packs x 1500 each
    assert t.decisions_per_s("sac_ln", "qed", 10) == 2000.0
    assert t.decisions_per_s("sac_ln", "te", 10) is None  # not measured: no guess
    assert t.decisions_per_s("sac_ln", "qed", 10, mode="off") is None
    with pytest.raises(ValueError, match="mode: 'fast' is not one of graph, compile, off, single"):
        t.decisions_per_s("sac_ln", "qed", 10, mode="fast")


def test_no_file_or_a_cpu_table_mean_no_gpu_measurement_yet_and_the_committed_table_is_the_gpu_run(tmp_path):
    assert load_throughput(tmp_path / "missing.json") is None
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps(table(device="cpu", card="cpu")))
    assert load_throughput(cpu) is None
    assert parse_throughput(json.loads(cpu.read_text())).decisions_per_s("sac_ln", "qed", 10) == 2000.0
    committed = load_throughput(DEFAULT_PATH)  # the H100 run of benchmarks/gpu_check.sh (benchmarks/README.md)
    assert committed is not None and committed.card == "NVIDIA H100 80GB HBM3"
    assert all(committed.decisions_per_s(a, t, s) > 0 for a in ("sac_ln", "mad_sac") for t in ("qed", "te")
               for s in (1, 10, 20))


@pytest.mark.parametrize("change,message", [
    ({"schema": 2}, "schema 2, this reader reads schema 1"),
    ({"entries": [{"agent": "sac_ln"}]}, r"entries\[0\] lacks temperature, seeds, packs, mode"),
    ({"entries": [{**ENTRY, "mode": "fast"}]}, r"entries\[0\].mode 'fast' is not one of graph, compile, off"),
])
def test_a_malformed_table_is_refused_naming_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        parse_throughput(table(**change))
    raw = table()
    del raw["card"]
    with pytest.raises(ValueError, match="field 'card' is missing"):
        parse_throughput(raw)


def test_an_unmeasured_sharing_cell_is_scaled_by_the_reference_cells_sharing_efficiency():
    mad = {**ENTRY, "agent": "mad_sac", "packs": 1, "seed_decisions_per_s": 400.0}
    t = parse_throughput(table(entries=[ENTRY, {**ENTRY, "packs": 1, "seed_decisions_per_s": 2000.0}, mad]))
    assert t.shared_rate("sac_ln", "qed", 10, 2) == (3000.0, False)  # measured: 2 packs x 1500
    assert t.shared_rate("mad_sac", "qed", 10, 2) == (400.0 * 3000.0 / 2000.0, True)  # scaled by 1.5
    assert t.shared_rate("mad_sac", "qed", 10, 1) == (400.0, False)
    assert t.shared_rate("mad_sac", "qed", 10, 3) is None, "no reference cell with 3 packs"
    assert t.shared_rate("mad_sac", "te", 10, 2) is None, "the one-pack cell itself was not measured"


def test_cells_are_read_at_their_precision_and_an_entry_without_one_is_fp32():
    three = {**ENTRY, "packs": 1, "seed_decisions_per_s": 3000.0, "precision": "3xtf32"}
    t = parse_throughput(table(entries=[ENTRY, {**ENTRY, "packs": 1, "seed_decisions_per_s": 2000.0}, three]))
    assert t.decisions_per_s("sac_ln", "qed", 10) == 2000.0  # the entries written before train.precision
    assert t.decisions_per_s("sac_ln", "qed", 10, precision="3xtf32") == 3000.0
    assert t.decisions_per_s("sac_ln", "qed", 10, precision="tf32") is None
    # 2 packs at 3xtf32 were not measured: scaled by the fp32 reference cell's sharing (1500 x 2 / 2000)
    assert t.shared_rate("sac_ln", "qed", 10, 2, precision="3xtf32") == (3000.0 * 3000.0 / 2000.0, True)
    with pytest.raises(ValueError, match=r"entries\[0\].precision 'bf16' is not one of fp32, 3xtf32, tf32"):
        parse_throughput(table(entries=[{**ENTRY, "precision": "bf16"}]))
