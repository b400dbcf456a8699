"""The slow files' order comes from a recorded run: scripts/slow_order.py adds up each file's durations from a
pytest log or a JUnit report, and tests/conftest.py orders the files by the committed result."""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import DURATIONS, file_seconds, pytest_collection_modifyitems

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("slow_order", ROOT / "scripts" / "slow_order.py")
slow_order = importlib.util.module_from_spec(spec)
spec.loader.exec_module(slow_order)

# A log as scripts/test.sh leaves it: the fast suite's block, then the slow suite's (old flat paths and new ones).
LOG = """\
============================= slowest 10 durations =============================
32.19s call     tests/analysis/test_tables.py::test_fast_one
........................................................................ [100%]
============================= slowest 40 durations =============================
300.50s call     tests/test_sweep_lifecycle.py::test_a
11.75s setup    tests/test_sweep_lifecycle.py::test_a
0.25s teardown tests/test_sweep_lifecycle.py::test_a
250.00s call     tests/service/test_sweep_e2e.py::test_b[param-1]
40.00s call     tests/test_relink.py::test_c
28 passed, 1 warning in 617.33s (0:10:17)
"""


def test_each_files_seconds_are_added_up_from_the_last_durations_block_longest_first(tmp_path):
    log, out = tmp_path / "test.log", tmp_path / "durations.json"
    log.write_text(LOG)
    assert slow_order.main([str(log), "--run", "a test log", "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == {"run": "a test log", "seconds": {
        "tests/service/test_sweep_lifecycle.py": 312.5, "tests/service/test_sweep_e2e.py": 250.0,
        "tests/service/test_relink.py": 40.0}}
    assert list(file_seconds(out)) == ["tests/service/test_sweep_lifecycle.py", "tests/service/test_sweep_e2e.py",
                                       "tests/service/test_relink.py"]


def test_a_junit_report_gives_the_same_sums(tmp_path):
    report = tmp_path / "slow.xml"
    report.write_text('<testsuites><testsuite name="pytest">'
                      '<testcase classname="tests.service.test_trial" name="a" time="20.5"/>'
                      '<testcase classname="tests.service.test_trial" name="b" time="1.5"/>'
                      '<testcase classname="tests.test_ray_token" name="c" time="9.25"/>'
                      '</testsuite></testsuites>')
    assert slow_order.per_file(slow_order.from_junit(report.read_text())) == {
        "tests/service/test_trial.py": 22.0, "tests/service/test_ray_token.py": 9.25}


def test_a_log_without_durations_is_refused_naming_the_flag(tmp_path):
    log = tmp_path / "test.log"
    log.write_text("28 passed in 617.33s\n")
    with pytest.raises(SystemExit, match="run pytest with --durations=N"):
        slow_order.main([str(log), "--run", "x", "--out", str(tmp_path / "d.json")])


def test_the_committed_order_names_slow_files_that_exist_and_orders_the_collection():
    seconds = file_seconds(DURATIONS)
    assert list(seconds.values()) == sorted(seconds.values(), reverse=True)
    for name in seconds:
        assert "pytest.mark.slow" in (ROOT / name).read_text(), name
    longest, second = list(seconds)[:2]
    items = [SimpleNamespace(nodeid=n) for n in ("tests/spec/test_spec.py::t", f"{second}::x", f"{longest}::y",
                                                 f"{second}::z")]
    pytest_collection_modifyitems(items)
    assert [i.nodeid for i in items] == [f"{longest}::y", f"{second}::x", f"{second}::z", "tests/spec/test_spec.py::t"]


def test_a_damaged_durations_file_is_refused_naming_it(tmp_path):
    bad = tmp_path / "slow_durations.json"
    bad.write_text(json.dumps({"run": "x", "seconds": {"tests/a.py": "long"}}))
    with pytest.raises(pytest.UsageError, match=f"{bad}: 'seconds' must map test files to seconds >= 0"):
        file_seconds(bad)
