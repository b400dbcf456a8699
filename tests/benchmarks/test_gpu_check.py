"""benchmarks/gpu_check.sh in its CPU form: every step of the GPU run, CI-sized, into a temporary folder."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qed_ray.records.throughput import DEFAULT_PATH, load_throughput, parse_throughput

ROOT = Path(__file__).parents[2]


@pytest.mark.slow
def test_the_cpu_form_of_the_gpu_check_runs_every_step_and_writes_its_table_where_told(tmp_path):
    out = tmp_path / "out"
    committed = DEFAULT_PATH.read_text()
    subprocess.run(["bash", "benchmarks/gpu_check.sh", "--device", "cpu", "--quick", "--out", str(out)], cwd=ROOT,
                   env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=900,
                   check=True)
    assert sorted(os.listdir(out)) == ["env.txt", "gpu_check.log", "precision_gate.json", "precision_gate.md",
                                       "pytest.log", "throughput.json", "throughput.md"]
    log = (out / "gpu_check.log").read_text()
    assert "step 1: import check: passed (no dm_control, mujoco, ray, mlflow)" in log
    assert re.search(r"step 2: pytest exit 0 \(\d+ passed", log)
    # The check's own code runs eager against eager here (compile against eager: tests/rl/test_pack_update.py).
    m = re.search(r"deviation sac_ln off vs eager at fp32 over 6 updates: max \|diff\| (\S+) allclose True; sync "
                  r"check not run \(CPU\)", log)
    assert m and float(m.group(1)) == 0.0
    assert "step 3: precision gate exit 0" in log and "step 4: gpu_bench exit 0" in log
    assert "3xtf32: PASSED" in log and "tf32: FAILED" in log
    (gate,) = json.loads((out / "precision_gate.json").read_text())["runs"]  # no tensor cores: no second run
    assert (gate["device"], gate["emulated"], gate["graph"], len(gate["cases"])) == ("cpu", True, False, 9)
    assert gate["passed"] == {"3xtf32": True, "tf32": False}
    raw = json.loads((out / "throughput.json").read_text())
    table = parse_throughput(raw)
    agents, temps = ("sac_ln", "mad_sac"), ("qed", "te")
    expected = {(a, t, s, 1, "off") for a in agents for t in temps for s in (1, 2)}
    expected |= {("sac_ln", "qed", 2, 2, "off")}
    cells = [(e.agent, e.temperature, e.seeds, e.packs, e.mode) for e in table.entries]
    assert set(cells) == expected and len(cells) == len(expected) + 1  # two rows of the 2-pack cell, one each
    assert all(e.seed_decisions_per_s > 0 and e.decisions >= 3 for e in table.entries)
    assert {e.precision for e in table.entries} == {"fp32"}  # on the CPU: no precision cells
    assert raw["checks"]["failed"] == [] and raw["checks"]["skipped"] == []
    assert table.device == "cpu" and load_throughput(out / "throughput.json") is None  # a CPU table is no GPU one
    assert len((out / "throughput.md").read_text().splitlines()) >= 2 + len(cells)
    assert DEFAULT_PATH.read_text() == committed
