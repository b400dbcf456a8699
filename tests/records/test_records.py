"""Every file the service writes and reads back has one model (:mod:`qed_ray.records.codec`): a damaged copy of each
(truncated, a wrong type, a folder, a dangling symbolic link) is refused where it is read, with one line naming the
file and the field, and every other file stays as it was; the commands that read them in real use (``--status``, a
driver start, ``python -m qed_ray.gather``, the run CLI's resume) exit 2 with that line, never a traceback.

The files are real: a tiny run trained once for this module (a seed that finishes and one that diverges) and the
hand-built sweep folder of the other service tests.
"""

import ast
import hashlib
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import yaml
from folder_helpers import group_result

from qed_ray.analysis import group_cache
from qed_ray.analysis.results import SweepResults, read_results
from qed_ray.records.codec import RecordError, dump, read_lines, read_record, write_record
from qed_ray.spec.config import RunSpec
from qed_ray.records.layout import PACK_FILE, PackId, SweepDir, seed_dir, trial_dirname
from qed_ray.records.checkpoint import SNAPSHOT_FORMATS, read_manifest
from qed_ray.rl.pack import read_pack
from qed_ray.rl.run import RUN_FILE, read_run_file, run
from qed_ray.records.run import (HistoryEntry, Metrics, RunSummary, diverged_reason, read_diverged, read_done,
                                 read_history)
from qed_ray.records.sweep import LockInfo
from qed_ray.service.lock import LockDamaged, read_lock
from qed_ray.records.sweep import read_state, write_state
from qed_ray.service.sweep_state import plan
from qed_ray.spec.sweep import FinalEvalSpec, SweepSpec

TRAIN = {"env_steps": 1000, "eval_every": 1000, "eval_episodes": 1, "warmup_decisions": 50, "frame_skip": 10,
         "nan_check_every": 10}
DONE, DIVERGED = "cartpole-balance/sac_ln/te/0", "cartpole-balance/sac_ln/te/1"
SPEC = {"name": "run", "tasks": ["cartpole-balance"], "seeds": 2, "pack": {"seeds": 2},
        "agents": [{"name": "sac_ln", "overrides": {"hidden": 16}, "temperatures": [{"kind": "te"}]}],
        "train": {"env_steps": 2000, "eval_every": 1000, "warmup_decisions": 100}}


def _runs() -> list[RunSpec]:
    return [RunSpec.model_validate({"task": "cartpole-balance", "seed": seed, "agent": {"hidden": 8, "batch_size": 8},
                                    "train": {**TRAIN, "debug": {"nan": {"seed": 1, "env_step": 700}}}})
            for seed in (0, 1)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A run folder of a real two-seed pack (seed 1 diverges), with the sweep's own files written beside it."""
    root = tmp_path_factory.mktemp("records") / "run"
    run(_runs(), root)
    layout = SweepDir(root)
    spec = SweepSpec.model_validate({**SPEC, "storage_path": str(root.parent)})
    write_state(layout, plan(None, spec).state)
    write_record(layout.lock_file, LockInfo(host="h", pid=12, started=1.0, heartbeat=2.0, token="t"))
    os.utime(layout.lock_file, (2.0, 2.0))  # another host's driver, long gone: its file untouched since
    group_cache.store(layout, "k", group_result(), b"k" * 32)
    write_record(layout.results_json, SweepResults("s", FinalEvalSpec(), [], [group_result()], [], [], 2))
    return layout


PACK = PackId.of([DONE, DIVERGED])
# kind -> (its path in the folder, the reader the service uses where it reads it)
KINDS = {
    "sweep.json": (lambda d: d.state_file, lambda d: read_state(d)),
    "sweep.lock": (lambda d: d.lock_file, lambda d: read_lock(d.lock_file)),
    "DONE.json": (lambda d: d.done_marker(DONE), lambda d: read_done(d, DONE)),
    "DIVERGED.json": (lambda d: d.diverged_marker(DIVERGED), lambda d: read_diverged(d, DIVERGED)),
    "history.json": (lambda d: d.history(DONE), lambda d: read_history(d, DONE)),
    "summary.json": (lambda d: d.root / trial_dirname(DONE) / "summary.json",
                     lambda d: read_record(d.root / trial_dirname(DONE) / "summary.json", RunSummary)),
    "metrics.jsonl": (lambda d: d.root / trial_dirname(DONE) / "metrics.jsonl",
                      lambda d: read_lines(d.root / trial_dirname(DONE) / "metrics.jsonl", Metrics)),
    "pack.json": (lambda d: d.pack_checkpoint(PACK, 1000) / PACK_FILE,
                  lambda d: read_pack(d.pack_checkpoint(PACK, 1000), [0, 1])),
    "checkpoint manifest": (lambda d: d.pack_checkpoint(PACK, 1000) / seed_dir(0) / "manifest.json",
                            lambda d: read_manifest(d.pack_checkpoint(PACK, 1000) / seed_dir(0))),
    "snapshot manifest": (lambda d: d.snapshot(DONE, 1000) / "manifest.json",
                          lambda d: read_manifest(d.snapshot(DONE, 1000), SNAPSHOT_FORMATS)),
    "cache entry": (lambda d: d.cached_group("k"), lambda d: group_cache.read_entry(d, "k")),
    "results.json": (lambda d: d.results_json, lambda d: read_results(d.results_json)),
    "run.json": (lambda d: d.root / RUN_FILE, lambda d: read_run_file(d.root)),
}


def _wrong_type(text: str) -> str:
    """The file (JSON, or one line of JSON) with its first value replaced by an object."""
    data = json.loads(text)
    first = data[0] if isinstance(data, list) else data
    first[next(iter(first))] = {"not": "this"}
    return json.dumps(data)


def _damage(path, how: str) -> None:
    text = path.read_text()
    if how == "truncated":
        path.write_text(text[: len(text) // 2])
    elif how == "a wrong type":
        path.write_text(_wrong_type(text))
    else:
        path.unlink()
        if how == "a folder":
            path.mkdir()
        else:
            path.symlink_to(path.parent / "gone.json")


def _files(root) -> dict:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


DAMAGES = ("truncated", "a wrong type", "a folder", "a dangling link")


@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_damaged_file_is_refused_where_it_is_read_naming_it(folder, tmp_path, kind, how):
    layout = SweepDir(shutil.copytree(folder.root, tmp_path / "run", symlinks=True))
    where, read = KINDS[kind]
    path = where(layout)
    read(layout)  # the intact file reads
    _damage(path, how)
    before = _files(layout.root)
    with pytest.raises((RecordError, LockDamaged)) as e:
        read(layout)
    message = str(e.value)
    assert message.startswith(str(path)) and "\n" not in message, message
    expected = {"truncated": ("not JSON", "line", "Field required", "valid"), "a wrong type": ("Input should",),
                "a folder": ("a folder, not a file",), "a dangling link": ("a dangling symbolic link",)}[how]
    assert any(word in message for word in expected), message
    assert _files(layout.root) == before, "reading changes nothing"


def test_what_each_model_refuses_names_the_field(folder, tmp_path):
    layout = SweepDir(shutil.copytree(folder.root, tmp_path / "run", symlinks=True))
    raw = json.loads(layout.lock_file.read_text())
    for field, value, says in (("pid", 2**40, "pid: Input should be less than or equal to 4194304"),
                               ("heartbeat", 1e30, "heartbeat: Input should be less than or equal to"),
                               ("pid", "12", "pid: Input should be a valid integer (got '12')")):
        layout.lock_file.write_text(json.dumps({**raw, field: value}))
        with pytest.raises(LockDamaged, match=f"^{layout.lock_file}: {field}"):
            read_lock(layout.lock_file)
        assert says in str(pytest.raises(LockDamaged, read_lock, layout.lock_file).value)
    state = json.loads(layout.state_file.read_text())
    layout.state_file.write_text(json.dumps({**state, "sweep_id": "x' or '1'='1"}))
    with pytest.raises(RecordError, match=r"sweep.json: sweep_id: String should match pattern .*start over with "
                                          r"--fresh --force"):
        read_state(layout)
    layout.state_file.write_text(json.dumps({**state, "packs": {"cartpole-balance/sac_ln/te/pack0": [DIVERGED]}}))
    with pytest.raises(RecordError, match=r"packs.cartpole-balance/sac_ln/te/pack0: its trials .* form the pack "
                                          r"'cartpole-balance/sac_ln/te/pack1'"):
        read_state(layout)
    marker = json.loads(layout.diverged_marker(DIVERGED).read_text())
    assert marker["reason"].startswith("DivergenceError: non-finite") and marker["env_steps"] == 700
    layout.diverged_marker(DIVERGED).write_text(json.dumps({**marker, "env_steps": -1}))
    assert diverged_reason(layout, DIVERGED) == (f"diverged ({layout.diverged_marker(DIVERGED)}: env_steps: Input "
                                                 f"should be greater than or equal to 0 (got -1))")
    entry = json.loads(layout.cached_group("k").read_text())
    layout.cached_group("k").write_text(json.dumps({**entry, "key": "other"}))
    with pytest.raises(RecordError, match=r"k.json: key: 'other', not this entry's 'k'"):
        group_cache.read_entry(layout, "k")
    said = []
    assert group_cache.load(layout, "k", None, log=said.append) is None and "evaluating the group again" in said[0]


def test_the_records_round_trip_as_strict_json(folder):
    done = read_done(folder, DONE)
    assert done.env_steps == 1000 and math.isfinite(done.metrics["eval/return_mean"])
    assert sorted(done.files) == ["0000001000/manifest.json", "0000001000/state.pt", "history.json"]
    history = read_history(folder, DONE)
    assert [h.env_steps for h in history] == [1000], "DONE.json holds the final evaluation's metrics"
    assert {k: v for k, v in dump(done).items() if k not in ("files", "unverified")} == dump(history[0])["metrics"]
    summary = read_record(folder.root / trial_dirname(DONE) / "summary.json", RunSummary)
    assert summary.status == "finished" and summary.evals == read_manifest(folder.snapshot(DONE, 1000)).evals
    assert read_record(folder.root / trial_dirname(DIVERGED) / "summary.json", RunSummary).reason.startswith(
        "non-finite")
    for path in folder.root.rglob("*.json"):  # NaN and inf are written as null: every file is strict JSON
        json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"{path}: {c}"))
    assert dump(history[0]) == json.loads(folder.history(DONE).read_text())[0]
    assert HistoryEntry.model_validate(dump(history[0])) == history[0]


# (command, the file it reads in real use); every case with each damage
COMMANDS = [("--status", "sweep.json"), ("--status", "DONE.json"), ("--status", "snapshot manifest"),
            ("--status", "checkpoint manifest"), ("start", "sweep.json"), ("start", "sweep.lock"),
            ("gather", "sweep.json"), ("gather", "results.json"), ("run", "run.json"), ("run", "DONE.json"),
            ("run", "summary.json"), ("resume", "metrics.jsonl"), ("resume", "pack.json"), ("resume", "history.json"),
            ("resume", "checkpoint manifest")]


def _command(command: str, layout: SweepDir, tmp_path) -> int:
    """Runs the command in this process as its CLI would; returns its exit code."""
    if command in ("--status", "start"):
        from qed_ray.service.sweep_cli import main

        spec = tmp_path / "spec.yaml"
        spec.write_text(yaml.safe_dump({**SPEC, "storage_path": str(layout.root.parent)}))
        return main([str(spec)] + ([command] if command == "--status" else []))
    if command == "gather":
        from qed_ray.service.reanalysis import main

        return main([str(layout.root)])
    from qed_ray.rl.run import main

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(_runs()[0].model_dump(mode="json")))
    budget = ["--env-steps", "2000"] if command == "resume" else []
    return main(["--config", str(config), "--seeds", "0", "1", "--out", str(layout.root), *budget])


@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("command, kind", COMMANDS)
def test_each_command_refuses_the_damaged_file_it_reads_with_one_line(folder, tmp_path, capsys, monkeypatch, command,
                                                                      kind, how):
    for key in ("QED_STORAGE_PATH", "QED_STORAGE_ROOT", "RAY_JOB_CONFIG_JSON_ENV_VAR", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TUNE_DISABLE_SIGINT_HANDLER", "0")  # restored after the test (the sweep CLI sets it)
    layout = SweepDir(shutil.copytree(folder.root, tmp_path / "run", symlinks=True))
    if command in ("run", "resume"):  # the run CLI's own folder holds no sweep files
        for path in (layout.state_file, layout.lock_file, layout.gather):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    path = KINDS[kind][0](layout)
    _damage(path, how)
    before = {p: h for p, h in _files(layout.root).items() if p != path}
    capsys.readouterr()
    assert _command(command, layout, tmp_path) == 2
    out = capsys.readouterr()
    errors = [line for line in out.err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and str(path) in errors[0] and "Traceback" not in out.err + out.out, out.err
    assert {p: h for p, h in _files(layout.root).items() if p != path} == before, "nothing else changes"


# Where JSON may still be parsed outside the codec: none of them is a file of a sweep or run folder.
JSON_OUTSIDE_THE_CODEC = {
    "qed_ray/paper/toy.py": "the --overrides flag's JSON",
}


def _json_calls(tree, names: tuple[str, ...]) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "json" and node.func.attr in names]


def test_no_module_parses_a_folder_file_by_hand_outside_its_model():
    """Every file the service writes and reads back is parsed by the codec into its model: no other module loads
    JSON (a ``json.loads(json.dumps(x))`` copy aside)."""
    package = Path(__file__).resolve().parents[2] / "qed_ray"
    loads = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).as_posix()
        tree = ast.parse(path.read_text())
        dumps = {id(c) for c in _json_calls(tree, ("dumps",))}
        hand = [c.lineno for c in _json_calls(tree, ("load", "loads")) if not (c.args and id(c.args[0]) in dumps)]
        if hand and rel not in ("qed_ray/records/codec.py", *JSON_OUTSIDE_THE_CODEC):
            loads[rel] = hand
    assert loads == {}, "JSON parsed by hand outside qed_ray.records.codec (read it with codec.read_record and its model)"
