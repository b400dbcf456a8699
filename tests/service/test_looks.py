"""An adaptive sweep's looks without Ray (qed_ray/service/looks.py): which look a start runs and over which trials,
the record read back and validated, a changed design refused, and the dry run's minimum/expected/maximum hours."""

import json

import pytest

from qed_ray.analysis.sequential import GROW, Look, LookVariant
from qed_ray.records.codec import RecordError, write_record
from qed_ray.records.layout import SweepDir
from qed_ray.service import looks
from qed_ray.records.throughput import CPU_PATH, load_table
from qed_ray.service.plan.dry_plan import Tables
from qed_ray.service.plan.machines import this_machine
from qed_ray.service.packing import form_packs
from kit import sweep_spec
from qed_ray.spec.sweep import SpecError, SweepSpec

# kit's sweep with te and two QED variants, 15 seeds judged at looks of 10 and 15, packs of 5.
LOOKED = {"seeds": 15, "adaptive": {"start": 10, "step": 5, "max_seeds": 15}, "pack": {"seeds": 5},
          "agents": [{"name": "sac_ln", "temperatures": [{"kind": "te"}, {"kind": "qed", "k": [0.2, 0.4]}]}]}
HERE, TABLES = this_machine(cpus=16, host_bytes=64 * 2**30, gpus=0), Tables(None, load_table(CPU_PATH), None)
TWENTY = {"seeds": 20, "adaptive": {"start": 10, "step": 10, "max_seeds": 20}}


def _look(k: int, variants, next_seeds, ended="") -> Look:
    return Look(k, [10, 15], "obrien_fleming", "te", [10, 15][k - 1], variants, [], "not enough data", next_seeds,
                ended)


def _seeds(spec: SweepSpec) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in spec.trials():
        out[t.variant] = out.get(t.variant, 0) + 1
    return out


def test_each_start_runs_the_next_look_over_its_trials_and_a_finished_design_runs_its_last(tmp_path):
    spec, layout = sweep_spec(LOOKED), SweepDir(tmp_path)
    assert looks.read_looks(layout) == []
    k, first = looks.look_spec(spec, [])
    assert k == 1 and _seeds(first) == {"te": 10, "qed0.2": 10, "qed0.4": 10} and len(spec.trials()) == 45
    one = _look(1, [LookVariant("qed0.2", 10, "fail", 1), LookVariant("qed0.4", 10, GROW, None)],
                {"te": 15, "qed0.2": 10, "qed0.4": 15})
    write_record(layout.looks_file, [one], list[Look])
    recorded = looks.read_looks(layout)
    assert recorded == [one]
    k, second = looks.look_spec(spec, recorded)
    assert k == 2 and _seeds(second) == {"te": 15, "qed0.2": 10, "qed0.4": 15}, "the failed variant is frozen"
    assert [t.run.seed for t in second.trials() if t.variant == "qed0.2"] == list(range(10)), "the same seeds"
    done = _look(2, [LookVariant("qed0.2", 10, "fail", 1), LookVariant("qed0.4", 15, "pass", 2)], {},
                 "the claim is decided (pass)")
    k, again = looks.look_spec(spec, [one, done])
    assert k == 2 and _seeds(again) == {"te": 15, "qed0.2": 10, "qed0.4": 15}


def test_a_changed_design_and_a_damaged_record_are_refused_naming_them(tmp_path):
    layout = SweepDir(tmp_path)
    recorded = [_look(1, [], {"te": 15})]
    other = sweep_spec(LOOKED, **TWENTY)
    with pytest.raises(SpecError, match=r"adaptive: this sweep's looks were fixed at \[10, 15\] seeds"):
        looks.check_design(other, recorded)
    looks.check_design(sweep_spec(LOOKED), recorded)
    layout.looks_file.write_text(json.dumps([{"look": "one"}]))
    with pytest.raises(RecordError, match="looks.json"):
        looks.read_looks(layout)


def test_the_dry_run_prices_the_first_look_the_expected_seeds_and_every_look(tmp_path):
    spec = sweep_spec(LOOKED, pack={"seeds": 1}, storage_path=str(tmp_path))  # packs of one: the CPU table's
    (line,) = looks.price_lines(spec, form_packs(spec), HERE, TABLES)
    assert line.startswith("adaptive: looks at 10, 15 seeds (obrien_fleming); CPU-hours in packs on "), line
    lo, hi = (float(line.split(w)[1].split()[0].replace(",", "")) for w in ("minimum ", "maximum "))
    assert lo == pytest.approx(hi * 10 / 15, rel=0.05)
    s1 = float(line.split("expected ")[1].split()[0].replace(",", ""))
    assert s1 == pytest.approx(lo + (hi - lo) * (35.9 - 30) / 15, rel=0.05), "S1's 35.9 of 45 seed runs per task"
    other = sweep_spec(LOOKED, TWENTY, pack={"seeds": 1}, storage_path=str(tmp_path))
    (line,) = looks.price_lines(other, form_packs(other), HERE, TABLES)
    assert "expected not simulated for this design (benchmarks/verdict_power.py --adaptive 10 10 20" in line
