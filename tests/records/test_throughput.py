"""The rate tables' reader (qed_ray.records.throughput): the model, lookups by cell and shape, the committed tables."""

import json

import pytest

from qed_ray.records.throughput import CPU_PATH, DEFAULT_PATH, load_table, load_throughput, parse_throughput

pytestmark = pytest.mark.torch_only

ENTRY = {"agent": "sac_ln", "temperature": "qed", "seeds": 10, "packs": 2, "mode": "graph",
         "seed_decisions_per_s": 1500.0, "peak_mib": 700.0}


def table(**over):
    raw = {"schema": 1, "device": "cuda", "card": "NVIDIA H100 80GB HBM3", "date": "2026-11-26T10:00:00+00:00",
           "entries": [ENTRY, {**ENTRY, "packs": 1, "seed_decisions_per_s": 2000.0}], "checks": {}}
    return {**raw, **over}


def test_a_measured_cell_gives_the_whole_devices_rate_and_nothing_else_is_guessed(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table()))
    t = load_throughput(path)
    assert t.card == "NVIDIA H100 80GB HBM3" and (t.hidden, t.batch) == (512, 512)
    assert t.rate("sac_ln", "qed", 10, packs=2) == 3000.0  # 2 packs x 1500 each
    assert t.rate("sac_ln", "qed", 10) == 2000.0
    assert t.rate("sac_ln", "qed", 10, shape=(256, 256)) is None  # another shape: never measured
    assert t.rate("sac_ln", "te", 10) is None and t.rate("sac_ln", "qed", 10, mode="off") is None
    assert t.sizes("sac_ln", "qed", "graph") == [10]
    cpu = parse_throughput(table(device="cpu", card="AMD EPYC", entries=[
        {**ENTRY, "packs": 1, "mode": "off", "seeds": 1, "hidden": 64, "batch": 64}]))
    assert cpu.rate("sac_ln", "qed", 1, 1, "off", shape=(64, 64)) == 1500.0 and cpu.rate("sac_ln", "qed", 1) is None


def test_no_file_or_a_cpu_table_mean_no_gpu_measurement_and_the_committed_tables_are_read(tmp_path):
    assert load_throughput(tmp_path / "missing.json") is None
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps(table(device="cpu", card="cpu")))
    assert load_throughput(cpu) is None and load_table(cpu).device == "cpu"
    committed = load_throughput(DEFAULT_PATH)  # the H100 run of benchmarks/gpu_check.sh (benchmarks/README.md)
    assert committed is not None and committed.card == "NVIDIA H100 80GB HBM3"
    assert all(committed.rate(a, t, s) > 0 for a in ("sac_ln", "mad_sac") for t in ("qed", "te") for s in (1, 10, 20))
    assert {e.mode for e in committed.entries} == {"graph", "off", "compile"}  # the deleted single mode is gone
    rates = load_table(CPU_PATH)  # benchmarks/cpu_rates.py on the machine it names
    assert rates.device == "cpu" and rates.cpus >= 1 and rates.host_bytes > 0 and rates.card
    assert rates.rate("sac_ln", "te", 1, 1, "off", shape=(64, 64)) > rates.rate("sac_ln", "qed", 1, 1, "off",
                                                                                 shape=(64, 64)) > 0


@pytest.mark.parametrize("change,message", [
    ({"schema": 2}, r"throughput: schema: Input should be 1 \(got 2\)"),
    ({"entries": [{"agent": "sac_ln"}]}, r"throughput: entries.0.temperature: Field required"),
    ({"entries": [{**ENTRY, "mode": "single"}]}, r"entries.0.mode: Input should be 'graph', 'compile' or 'off'"),
    ({"entries": [{**ENTRY, "precision": "bf16"}]}, r"entries.0.precision: Input should be"),
])
def test_a_malformed_table_is_refused_naming_the_field(change, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        parse_throughput(table(**change))
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(table(card=None)))
    with pytest.raises(ValueError, match=f"{path}: throughput: card: Input should be a valid string"):
        load_table(path)
