"""Every file the service reads back goes through one bounded reader (qed_ray/records/file_reads.py): a device behind a link, a
FIFO, a huge file and a link out of the sweep folder, put where `--status`, the re-analysis, a driver start and the
results key read, are each refused in one line naming the file, without a traceback, within 5 s, and nothing in the
folder changes; error lines are cut to a bounded length."""

import json
import os
import time
from pathlib import Path

import pytest

from qed_ray.records.codec import RecordError
from qed_ray.records.file_reads import ERROR_LINE, LIMITS, cut, read_bytes
from qed_ray.service.reanalysis import main as gather_main
from qed_ray.service.results_key import KEY_FILE_ENV, ResultsKeyError, load_key
from qed_ray.service.status import error_summary
from qed_ray.service.sweep_cli import main as sweep_main

SPEC = {"name": "sweep", "tasks": ["cartpole-balance"], "seeds": 2,
        "agents": [{"name": "sac_ln", "overrides": {"hidden": 16},
                    "temperatures": [{"kind": "te"}, {"kind": "qed", "k": 0.2}]}],
        "train": {"env_steps": 2000, "eval_every": 1000, "warmup_decisions": 100}}


def _plant(path: Path, kind: str, outside: Path) -> str:
    """Puts ``kind`` where ``path`` was; returns what the refusal must say of it."""
    os.replace(path, outside / "moved-away")  # kept: nothing of the folder is lost by the test either
    if kind == "device link":
        path.symlink_to("/dev/zero")
        return f"{path}: a symbolic link to /dev/zero, outside {path.parent}"
    if kind == "fifo":
        os.mkfifo(path)
        return f"{path}: a FIFO (named pipe), not a regular file"
    if kind == "huge file":
        with open(path, "wb") as f:
            f.truncate(LIMITS["record"][0] + 1)  # sparse: no disk used
        return f"{path}: {LIMITS['record'][0] + 1:,} bytes, more than the {LIMITS['record'][0]:,} a record file may have"
    (outside / "sweep.json").write_bytes((outside / "moved-away").read_bytes())
    path.symlink_to(outside / "sweep.json")
    return f"{path}: a symbolic link to {outside / 'sweep.json'}, outside {path.parent}"


def _snapshot(root: Path) -> dict:
    return {p: (p.read_bytes() if p.is_file() and not p.is_symlink() else os.readlink(p) if p.is_symlink() else None)
            for p in sorted(root.rglob("*")) if p.name != "sweep.json"}


@pytest.mark.parametrize("kind", ["device link", "fifo", "huge file", "link out of the folder"])
def test_a_planted_sweep_json_is_refused_in_one_line_by_status_reanalysis_and_a_start(sweep_copy, tmp_path, capsys,
                                                                                     kind):
    spec = tmp_path / "spec.yaml"
    spec.write_text(json.dumps({**SPEC, "storage_path": str(sweep_copy.root.parent)}))
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    needle = _plant(sweep_copy.state_file, kind, outside)
    before = _snapshot(sweep_copy.root)
    for name, call in (("--status", lambda: sweep_main([str(spec), "--status", "--dir", str(sweep_copy.root)])),
                       ("re-analysis", lambda: gather_main([str(sweep_copy.root), "--no-verify"])),
                       ("driver start", lambda: sweep_main([str(spec)]))):
        t0 = time.monotonic()
        assert call() == 2, name
        took = time.monotonic() - t0
        out, err = capsys.readouterr()
        assert len(err.splitlines()) == 1 and err.startswith(f"error: {needle}"), (name, err)
        assert "Traceback" not in out + err and took < 5, (name, took)
    assert _snapshot(sweep_copy.root) == before, "nothing in the folder changed"


@pytest.mark.parametrize("kind", ["fifo", "huge file"])
def test_a_planted_snapshot_is_refused_in_one_line_by_the_reanalysis(sweep_copy, capsys, kind):
    trial = "cartpole-balance/sac_ln/te/0"
    state = next(iter(sweep_copy.snapshots(trial).values())) / "state.pt"
    state.unlink()
    if kind == "fifo":
        os.mkfifo(state)
        needle = f"{state}: a FIFO (named pipe), not a regular file"
    else:
        with open(state, "wb") as f:
            f.truncate(LIMITS["snapshot"][0] + 1)  # hashing it would read 16 GiB of zeros
        needle = f"{state}: {LIMITS['snapshot'][0] + 1:,} bytes, more than the {LIMITS['snapshot'][0]:,} a snapshot"
    t0 = time.process_time()  # CPU seconds: hashing the sparse 16 GiB would cost far more; wall time is the load's
    code = gather_main([str(sweep_copy.root)])
    out, err = capsys.readouterr()
    assert time.process_time() - t0 < 30 and "Traceback" not in out + err  # the other groups are still evaluated
    assert code != 0 and needle in out + err, out + err
    assert [ln for ln in (out + err).splitlines() if needle in ln and len(ln) > len(needle) + 400] == []


@pytest.mark.parametrize("kind", ["device", "fifo", "huge file", "folder"])
def test_a_results_key_that_is_no_plain_small_file_is_refused_in_one_line(tmp_path, monkeypatch, kind):
    key = tmp_path / "results.key"
    if kind == "device":
        key.symlink_to("/dev/zero")  # the user's own link may lead anywhere; a device is still refused
        needle = "/dev/zero: a character device, not a regular file"
    elif kind == "fifo":
        os.mkfifo(key, 0o600)
        needle = f"{key}: a FIFO (named pipe), not a regular file"
    elif kind == "huge file":
        with open(key, "wb") as f:
            f.truncate(1 << 30)
        needle = f"{key}: 1,073,741,824 bytes, more than the 4,096 a results key file may have (is it the right file?)"
    else:
        key.mkdir()
        needle = f"{key}: a folder, not a file"
    monkeypatch.setenv(KEY_FILE_ENV, str(key))
    t0 = time.process_time()
    with pytest.raises(ResultsKeyError) as e:
        load_key()
    assert str(e.value) == needle and time.process_time() - t0 < 5


def test_a_link_inside_the_folder_is_followed_and_a_record_that_grows_is_cut(tmp_path):
    (tmp_path / "real.json").write_text("{}")
    (tmp_path / "alias.json").symlink_to("real.json")
    assert read_bytes(tmp_path / "alias.json", "record", RecordError) == b"{}"
    with pytest.raises(RecordError, match=r"/dev/zero: a character device, not a regular file"):
        read_bytes("/dev/zero", "record", RecordError, within="/")


def test_error_lines_are_cut_and_rays_colour_header_is_not_the_reason(tmp_path):
    huge = "ValueError: " + "x" * 5_000_000
    line = error_summary(f"Failure # 1\nTraceback (most recent call last):\n  File \"a.py\", line 1\n{huge}\n")
    assert len(line) <= ERROR_LINE and line.startswith("ValueError: xxx") and "characters]..." in line
    task_error = ("Failure # 1 (occurred at 2026-01-01_00-00-00)\n\x1b[36mray::ImplicitFunc.train()\x1b[39m (pid=1, "
                  "ip=10.0.0.1, actor_id=ab)\n  File \"x.py\", line 3, in train\n    raise OSError(28)\n"
                  "OSError: [Errno 28] No space left on device\n")
    assert error_summary(task_error) == "OSError: [Errno 28] No space left on device"
    assert error_summary("\x1b[31mray::ImplicitFunc.train() (pid=1)\x1b[0m\nthe worker died\n") == "the worker died"
    assert cut("a\nb   c") == "a b c"
