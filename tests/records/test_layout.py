"""The sweep folder's layout: trial folder names round-trip, docs/results.md's table matches layout.py, snapshot
queries."""

import inspect
import re
from pathlib import Path

import pytest

from qed_ray.records import layout as L
from qed_ray.records.checkpoint import MANIFEST_FILE
from qed_ray.rl.envs import TASKS
from qed_ray.records.layout import DOCUMENTED, PACK_FILE, PackId, SweepDir, TrialId, parse_trial_dirname, trial_dirname
from qed_ray.records.run import HistoryEntry, read_history

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ["te", "qed0.2", "fixed0.05", "k=0.2+alpha_max=0.3", "hidden=64+kind=qed+k=0.1", "tau=0.95",
            "lr=3e-05", "x-y.z_w", "_lead", "trail_", "_"]


@pytest.mark.parametrize("task", TASKS)
def test_every_task_agent_variant_seed_round_trips(task):
    for agent in ("sac_ln", "mad_sac"):
        for variant in VARIANTS:
            for seed in (0, 7, 12345):
                name = f"{task}/{agent}/{variant}/{seed}"
                dirname = trial_dirname(name)
                assert "/" not in dirname and dirname.endswith(f"__s{seed}")
                trial = parse_trial_dirname(dirname)
                assert trial == TrialId(task, agent, variant, seed) and trial.name == name
                assert trial.dirname == dirname and TrialId.from_name(name) == trial


def test_folder_names_are_exactly_the_documented_format():
    assert trial_dirname("finger-turn_easy/sac_ln/qed0.2/3") == "finger-turn_easy__sac_ln__qed0.2__s3"
    assert trial_dirname("cheetah-run/mad_sac/k=0.2+alpha_max=0.3/10") == \
        "cheetah-run__mad_sac__k=0.2+alpha_max=0.3__s10"
    assert parse_trial_dirname("walker-walk__sac_ln___lead__s1") == ("walker-walk", "sac_ln", "_lead", 1)


@pytest.mark.parametrize("name, field", [
    ("a/b/c", "task/agent/variant/seed"), ("a/b/c/d/0", "task/agent/variant/seed"), ("a/b/c/-1", "seed"),
    ("a/b/c/x", "seed"), ("a__x/b/c/0", "task"), ("a/b/c__d/0", "variant"), ("a/b//0", "variant"),
    ("a_/b/c/0", "task"), ("a/b_/c/0", "agent"), ("/b/c/0", "task"),
])
def test_names_that_cannot_round_trip_are_refused_with_the_part(name, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        trial_dirname(name)


@pytest.mark.parametrize("dirname", ["a__b__c", "a__b__c__0", "a__b__c__sx", "policies", "a__b__s0",
                                     "a__b__c__s0.tmp"])
def test_other_folder_names_are_not_trials(dirname):
    with pytest.raises(ValueError, match="task__agent__variant__sSEED"):
        parse_trial_dirname(dirname)


def _documented_rows() -> list[str]:
    """The code spans of the first column of docs/results.md's "Sweep folder" table (the one table of the layout),
    in order."""
    lines = (ROOT / "docs" / "results.md").read_text().split("\n## Sweep folder\n", 1)[1].splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| path |"))
    table = []
    for ln in lines[start + 2:]:  # past the header and the |---| line
        if not ln.startswith("|"):
            break
        table.append(ln)
    return [span for row in table for span in re.findall(r"`([^`]+)`", row.split(" | ")[0])]


def _expand(pattern: str, name: str, env_steps: int, start: str) -> str:
    trial = TrialId.from_name(name)
    pack = PackId(trial.task, trial.agent, trial.variant, (trial.seed, trial.seed + 1))
    return (pattern.replace("<trial>", trial.dirname).replace("<pack>", pack.dirname)
            .replace("<seeds>", f"{trial.seed}-{trial.seed + 1}").replace("<env_steps>", f"{env_steps:010d}")
            .replace("<start>", start).replace("<policy>", "sample").replace("<settings>", "episodes=20")
            .replace("<task>", trial.task).replace("<agent>", trial.agent).replace("<variant>", trial.variant)
            .replace("<seed>", str(trial.seed)))


def test_the_documented_table_lists_exactly_what_layout_builds(tmp_path):
    assert _documented_rows() == list(DOCUMENTED), "docs/results.md 'Sweep folder' and layout.DOCUMENTED differ"
    layout = SweepDir(tmp_path)
    name, steps, start = "finger-turn_easy/mad_sac/k=0.2+alpha_max=0.3/4", 120000, "20260101-120000-0"
    for pattern, member in DOCUMENTED.items():
        attr = getattr(layout, member)
        if callable(attr):
            args = {"name": name, "env_steps": steps, "start": start, "key": "<key>", "policy": "sample", "settings": "episodes=20",
                    "pack": PackId("finger-turn_easy", "mad_sac", "k=0.2+alpha_max=0.3", (4, 5))}
            attr = attr(*(args[p] for p in inspect.signature(attr).parameters))
        rel = attr.relative_to(tmp_path).as_posix() + ("/" if pattern.endswith("/") else "")
        assert rel == _expand(pattern, name, steps, start), (pattern, member)
    # Every path-building member of SweepDir is documented (the queries and the parents of documented paths aside).
    members = {n for n in vars(SweepDir) if not n.startswith("_") and n != "root"}
    assert members - set(DOCUMENTED.values()) == {"policies_root", "policies", "gather", "snapshots", "final_snapshot",
                                                  "trials", "group_cache", "tune_root", "trial_state", "pack_dirs",
                                                  "pack_checkpoints",
                                                  "pack_checkpoint_steps", "reanalyses"}


def test_snapshots_are_the_complete_step_folders(tmp_path):
    layout = SweepDir(str(tmp_path))  # a str root is accepted
    name = "cartpole-balance/sac_ln/te/0"
    assert layout.snapshots(name) == {}
    with pytest.raises(FileNotFoundError, match=MANIFEST_FILE):
        layout.final_snapshot(name)
    for steps in (2000, 10000, 4000):
        layout.snapshot(name, steps).mkdir(parents=True)
        (layout.snapshot(name, steps) / MANIFEST_FILE).write_text("{}")
    layout.snapshot(name, 20000).mkdir()  # incomplete: no manifest yet
    layout.done_marker(name).write_text("{}")
    (layout.policies(name) / "notes").mkdir()
    assert layout.snapshots(name) == {s: layout.snapshot(name, s) for s in (2000, 4000, 10000)}
    assert list(layout.snapshots(name)) == [2000, 4000, 10000]
    assert layout.final_snapshot(name) == tmp_path / "policies" / "cartpole-balance__sac_ln__te__s0" / "0000010000"


def test_trials_lists_the_policy_folders_and_skips_others(tmp_path):
    layout = SweepDir(tmp_path)
    with pytest.raises(FileNotFoundError, match="sweep_dir: .*policies does not exist"):
        layout.trials()
    names = ["walker-walk/sac_ln/te/1", "walker-walk/sac_ln/te/0", "finger-turn_easy/mad_sac/k=0.3/2"]
    for n in names:
        layout.policies(n).mkdir(parents=True)
    (layout.policies_root / "stray").mkdir()
    (layout.policies_root / "README.txt").write_text("x")
    assert [t.name for t in layout.trials()] == sorted(names, key=trial_dirname)


def test_layout_is_frozen_and_compares_by_root(tmp_path):
    layout = SweepDir(tmp_path)
    assert layout == SweepDir(str(tmp_path)) and isinstance(layout.root, Path)
    with pytest.raises(AttributeError):
        layout.root = tmp_path / "x"
    assert L.SNAPSHOT_DIGITS == 10 and layout.state_file.parent == layout.root


def test_trial_state_history_pack_checkpoints_and_tune_folders(tmp_path):
    layout = SweepDir(tmp_path)
    name, pack = "cartpole-balance/sac_ln/qed0.2/3", PackId("cartpole-balance", "sac_ln", "qed0.2", (3,))
    assert layout.trial_state(name) == "pending" and read_history(layout, name) == []
    assert layout.pack_checkpoint_steps(pack) == {} and layout.pack_dirs(pack) == []
    for steps in (1000, 3000):
        layout.pack_checkpoint(pack, steps).mkdir(parents=True)
        (layout.pack_checkpoint(pack, steps) / PACK_FILE).write_text("{}")
    (layout.pack_checkpoints(pack) / ".0000004000.tmp-1a2b3c").mkdir()  # a checkpoint being written
    layout.pack_checkpoint(pack, 5000).mkdir()  # no pack.json: incomplete
    assert layout.pack_checkpoint_steps(pack) == {s: layout.pack_checkpoint(pack, s) for s in (1000, 3000)}
    assert layout.pack_checkpoint(pack, 1000) == tmp_path / "checkpoints" / "cartpole-balance__sac_ln__qed0.2__pack3" \
        / "0000001000"
    layout.policies(name).mkdir(parents=True)
    layout.history(name).write_text('[{"time_ms": 5, "metrics": {"env_steps": 1000}}]')
    assert read_history(layout, name) == [HistoryEntry(time_ms=5, metrics={"env_steps": 1000})]
    layout.diverged_marker(name).write_text("{}")
    assert layout.trial_state(name) == "diverged"
    layout.done_marker(name).write_text("{}")
    assert layout.trial_state(name) == "done"
    for start in ("20260102-000000-0", "20260101-000000-1", "20260101-000000-0"):
        layout.pack_dir(pack, start).mkdir(parents=True)
    (layout.tune_root / "20260103-000000-0").mkdir()  # a start that did not run this pack
    assert [d.parent.name for d in layout.pack_dirs(pack)] == ["20260101-000000-0", "20260101-000000-1",
                                                               "20260102-000000-0"]
