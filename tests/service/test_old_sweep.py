"""A sweep folder written by qed_ray at commit 672dd2c (tests/data/sweep_672dd2c/: cartpole-balance, te and qed0.2,
seeds 0 and 1 in packs of two, 2,000 env steps; its mlflow.db vacuumed, its Tune folder, MLflow artifacts, figures,
group cache and all but the final checkpoints left out) read by today's code: the driver's plan finds every trial
recorded and nothing new (and refuses the QED trials, whose name now means another target_alpha), every pack
resumes as it was trained from its final checkpoint with nothing left to train, and a re-analysis with the sweep's
own settings (offline: no Ray) gives the numbers and CSV columns that 672dd2c's gather step wrote.

The folder was made with ``git worktree add /tmp/old672 672dd2c`` and ``PYTHONPATH=/tmp/old672 QED_RESULTS_KEY_FILE=
tests/data/sweep_672dd2c.key python -m qed_ray.sweep tests/data/sweep_672dd2c.yaml``; the key is a throwaway one
made for it (a test key, signing nothing else)."""

import csv
import json
import shutil
from pathlib import Path

import pytest

from qed_ray.records.checkpoint import read_manifest
from qed_ray.records.manifests import CheckpointError
from qed_ray.records.layout import PackId, SweepDir
from qed_ray.records.run import read_history
from qed_ray.rl.run_folder import restore_latest
from qed_ray.rl.trainer import build_trainer
from qed_ray.service.reanalysis import main as gather_main
from qed_ray.service.results_key import KEY_FILE_ENV
from qed_ray.service.status import report
from qed_ray.service.sweep_state import check_folder, plan
from qed_ray.spec.sweep import load_spec

DATA = Path(__file__).parents[1] / "data"
FOLDER, SPEC, KEY = DATA / "sweep_672dd2c", DATA / "sweep_672dd2c.yaml", DATA / "sweep_672dd2c.key"
OLD_CACHE = DATA / "group_cache_adb7c93"
PACKS = ["cartpole-balance/sac_ln/te/pack0-1", "cartpole-balance/sac_ln/qed0.2/pack0-1"]
TABLES = ("aggregates.csv", "groups.csv", "comparisons.csv", "iqm_by_budget.csv")
# The columns the tables gained after 672dd2c (each appended after the columns it wrote).
ADDED = {"aggregates.csv": ["alpha_ratio_late", "n_tasks_hot"],
         "groups.csv": ["alpha_frac_hot_late", "alpha_ratio_late", "entropy_late", "entropy_gap_late", "alpha_regime"],
         "comparisons.csv": ["prob_improvement", "prob_improvement_ci_lower", "prob_improvement_ci_upper"],
         "iqm_by_budget.csv": []}


@pytest.fixture
def old_sweep(tmp_path, monkeypatch) -> SweepDir:
    """A private copy of the folder (``old672`` under ``tmp_path/results``), the key where the gather step finds it."""
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700)
    shutil.copy(KEY, keys / "results.key")
    (keys / "results.key").chmod(0o600)
    monkeypatch.setenv(KEY_FILE_ENV, str(keys / "results.key"))
    return SweepDir(shutil.copytree(FOLDER, tmp_path / "results" / "old672"))


def _rows(path: Path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames), list(reader)


def test_today_plans_nothing_new_and_every_pack_resumes_as_it_was_trained(old_sweep):
    """The driver reads sweep.json and refuses, naming the field, only what it refuses on purpose: QED trials named
    under the old ``target_alpha`` default (qed0.2 then meant target_alpha: qed, today floor). Each pack, built from
    the settings its checkpoint records (QED's target_alpha: qed), resumes from its final checkpoint with nothing
    left to train (its replay was pruned when it finished, so it cannot train on); a QED pack asked to resume under
    today's default is refused naming the setting and both values."""
    spec = load_spec(SPEC).model_copy(update={"storage_path": str(old_sweep.root.parent)})
    state = check_folder(old_sweep, spec)
    got = plan(state, spec, old_sweep)
    assert got.new == [] and [p.split(":")[0] for p in got.problems] == ["temperature.target_alpha"]
    assert sorted(state.packs) == sorted(PACKS) and all(old_sweep.done_marker(n).exists() for n in state.trials)
    floor = {"temperature": {"kind": "qed", "k": 0.2, "target_alpha": "floor"}}
    with pytest.raises(CheckpointError, match='mismatched temperature.target_alpha: checkpoint has "qed", this run '
                                              'needs "floor"'):
        _resume(old_sweep, state.packs[PACKS[1]], floor)
    for pack in PACKS:
        names = state.packs[pack]
        trainer = _resume(old_sweep, names)
        summaries = trainer.run()  # nothing left to train: no decision, no update, no evaluation
        trainer.close()
        assert (trainer.state.resumed_from, trainer.progress.decisions, trainer.progress.updates) == (2000, 200, 180)
        assert trainer.progress.cpu_s is None and {s.cpu_s for s in summaries} == {None}, "not recorded then: unknown"
        assert [s.status for s in summaries] == ["finished", "finished"]
        qed = [r.spec.temperature.target_alpha for r in trainer.state.runs if r.spec.temperature.kind == "qed"]
        assert qed == (["qed", "qed"] if "qed0.2" in pack else [])
        for name, s in zip(names, summaries):
            history = read_history(old_sweep, name)
            assert [e.env_steps for e in s.evals] == [h.env_steps for h in history] == [1000, 2000]
            assert [e.return_mean for e in s.evals] == [h.metrics["eval/return_mean"] for h in history]


def _resume(layout: SweepDir, names: list[str], change: dict | None = None):
    """The trainer of the pack of trials ``names``, built from the settings its final checkpoint records (with
    ``change``: ``{section: {setting: value}}``), resumed from its newest checkpoint."""
    pack = PackId.of(names)
    runs = [read_manifest(layout.pack_checkpoint(pack, 2000) / f"seed_{seed}").run for seed in pack.seeds]
    runs = [r.model_validate(_merged(r.model_dump(), change or {})) for r in runs]
    trainer = build_trainer(runs, lambda metrics, save: None, [layout.replay(n) for n in names], names=names,
                            log=lambda line: None, pack=pack.name)
    try:
        assert restore_latest(trainer, layout, pack, lambda line: None) == 2000
    except BaseException:
        trainer.close()
        raise
    return trainer


def _merged(base: dict, change: dict) -> dict:
    return {k: {**v, **change[k]} if k in change else v for k, v in base.items()}


def test_status_of_the_old_folder_has_no_estimate_of_the_cpu_used(old_sweep):
    """672dd2c measured no CPU time: --status says so, and still counts the hours held (pack wall time x 1 CPU)."""
    spec = load_spec(SPEC).model_copy(update={"storage_path": str(old_sweep.root.parent)})
    trials = check_folder(old_sweep, spec).trials
    walls = [json.loads(old_sweep.done_marker(n).read_text())["perf/wall_s"] for n in trials]
    lines = report(spec, old_sweep).splitlines()
    assert "CPU-hours used: no estimate (4 of 4 started trials' files were written before qed_ray measured it)" in lines
    assert f"CPU-hours held: {sum(walls) / 2 / 3600:.3g} spent, {sum(walls) / 2 / 3600:.3g} projected for the whole " \
           f"sweep (pack wall time x 1 CPU per pack)" in lines


def test_a_reanalysis_today_gives_672dd2cs_numbers_and_columns(old_sweep, capsys):
    """Every column 672dd2c wrote, in its order, with every cell as it wrote it (numbers to the last digit); the
    columns added since come after them. The verdict's rules changed since (two seeds are now "not enough seeds"),
    its estimates did not. The groups are cached under the keys the code before the typed result rows gave them
    (tests/data/group_cache_adb7c93/, written by adb7c93 on this folder), and those entries are taken as they are:
    their signatures hold, and the tables from them are the same."""
    assert gather_main([str(old_sweep.root)]) == 0, capsys.readouterr().out[-3000:]
    new = old_sweep.reanalysis("sweep-settings")
    _same_tables_as_672dd2c(new)
    old_verdict, new_verdict = (json.loads((d / "verdict.json").read_text()) for d in (FOLDER / "gather", new))
    estimates = [[e["estimate"] for e in v["endpoints"]] for v in old_verdict["variants"]]
    assert [[e["estimate"] for e in v["endpoints"]] for v in new_verdict["variants"]] == estimates
    assert [e["outcome"] for e in new_verdict["variants"][0]["endpoints"]] == ["not enough seeds"] * 2
    old_results, new_results = (json.loads((d / "results.json").read_text()) for d in (FOLDER / "gather", new))
    assert [g["returns"] for g in new_results["groups"]] == [g["returns"] for g in old_results["groups"]]

    before = sorted(p.name for p in OLD_CACHE.iterdir())
    assert sorted(p.name for p in old_sweep.group_cache.iterdir()) == before  # the same cache keys
    for name in before:
        shutil.copy(OLD_CACHE / name, old_sweep.group_cache / name)
    capsys.readouterr()
    assert gather_main([str(old_sweep.root)]) == 0
    out = capsys.readouterr().out
    assert "cartpole-balance/sac_ln/te: cached" in out and "cartpole-balance/sac_ln/qed0.2: cached" in out, out
    _same_tables_as_672dd2c(new)


def _same_tables_as_672dd2c(new: Path) -> None:
    for name in TABLES:
        old_columns, old_rows = _rows(FOLDER / "gather" / name)
        new_columns, new_rows = _rows(new / name)
        assert new_columns == old_columns + ADDED[name], name
        assert [{k: row[k] for k in old_columns} for row in new_rows] == old_rows, name
