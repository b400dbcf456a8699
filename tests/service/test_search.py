"""A k search's pieces without Ray: the ``search:`` block's checks, the grown spec, the searcher rebuilt from a
folder's points, the front and the rule on groups built to have a known answer, the fragment, the dry run's
price, and the one-line refusal without Optuna."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from folder_helpers import group_result
from kit import counts, flat, sweep_file

from qed_ray.analysis.search_front import SearchedPoint, choose, fragment, front_rows, pareto, table_lines, write
from qed_ray.records.layout import SweepDir
from qed_ray.records.search import SearchRecord
from qed_ray.spec.search import SearchPoint, grown, rounded
from qed_ray.spec.sweep import FinalEvalSpec, SpecError, SweepSpec, load_spec

ROOT = Path(__file__).resolve().parents[2]
FE = FinalEvalSpec(bootstrap_reps=300, seed=2)
TASK = "cartpole-balance"


SEARCH = {"name": "ks", "pack": {"seeds": 2}, "search": {"trials": 4, "k": [0.05, 2.0]}}  # over kit's sweep


def _file(tmp_path: Path, **changes) -> Path:
    return sweep_file(tmp_path / "ks.yaml", SEARCH, {"storage_path": str(tmp_path / "results")}, **changes)


def _spec(tmp_path: Path, **changes) -> SweepSpec:
    return load_spec(_file(tmp_path, **changes))


@pytest.mark.parametrize("changes, line", [
    ({"seeds": 1, "pack": {"seeds": 1}}, "search: each point's V is measured across its pack's seeds; need 2 or "
                                         "more seeds"),
    ({"pack": {"seeds": 1}}, "pack: a searched point is one pack of the sweep's 2 seeds; set pack.seeds to 2 (or "
                             "more) and pack.by to variant"),
    ({"pack": {"seeds": "auto"}}, "pack: a searched point is one pack of the sweep's 2 seeds; set pack.seeds to 2 (or "
                                  "more) and pack.by to variant"),
    ({"agents": [{"name": "sac_ln", "temperatures": [{"kind": "qed", "k": 0.2}]}]},
     "agents.0.temperatures: a search compares each point with te, the fixed reference; add {kind: te}"),
    ({"search": {"trials": 4, "k": [2.0, 0.5]}}, "search.k: [2, 0.5] is no range; need 0 < low < high <= 1000"),
    ({"search": {"trials": 4, "sampler": "grid"}}, "search.sampler: Input should be 'tpe' or 'nsga2'"),
])
def test_a_search_block_that_cannot_be_searched_is_refused_naming_the_field(tmp_path, changes, line):
    with pytest.raises(SpecError) as e:
        _spec(tmp_path, **changes)
    assert line in str(e.value).splitlines()[0], str(e.value)


def test_points_grow_the_spec_by_their_variants_and_keep_every_earlier_trial(tmp_path):
    spec = _spec(tmp_path)
    points = [SearchPoint(entry=0, task=TASK, k=rounded(0.23712)), SearchPoint(entry=0, task=TASK, k=1.2)]
    big = grown(spec, points)
    assert [t.name for t in big.trials()] == [f"{TASK}/sac_ln/{v}/{s}" for v in ("te", "qed0.237", "qed1.2")
                                              for s in (0, 1)]
    assert big.trials()[2].run.agent.hidden == 16 and grown(spec, []) is spec
    assert [t.name for t in grown(spec, points[:1]).trials()] == [t.name for t in big.trials()][:4]


def test_the_searcher_is_rebuilt_from_the_folders_finished_points_and_suggests_new_ones_in_range(tmp_path):
    from qed_ray.records.search import read_search
    from qed_ray.service.search import suggest_round

    spec = _spec(tmp_path, search={"trials": 4, "per_round": 2, "k": [0.1, 1.0]})
    layout = SweepDir(tmp_path / "results" / "ks")
    layout.root.mkdir(parents=True)
    old = [SearchPoint(entry=0, task=TASK, k=0.2), SearchPoint(entry=0, task=TASK, k=0.5)]
    layout.search_file.write_text(json.dumps(SearchRecord(points=old).model_dump(mode="json")))
    assert suggest_round(spec, layout, read_search(layout, spec)) == (SearchRecord(points=old), [], False)
    for p in old:  # both points still trained: nothing more was asked; now both are done
        for s in spec.seeds:
            name = f"{TASK}/sac_ln/qed{p.k:g}/{s}"
            layout.done_marker(name).parent.mkdir(parents=True)
            layout.done_marker(name).write_text("{}")
    # Done but not gathered (a stop during the gather step): the study waits for a start that gathers them ...
    assert suggest_round(spec, layout, read_search(layout, spec)) == (SearchRecord(points=old), [], True)
    # ... and after one that still found no result, the searcher hears of them as failed trials.
    record, new, waiting = suggest_round(spec, layout, read_search(layout, spec), ungathered_failed=True)
    assert len(new) == 2 and not waiting and record.points[:2] == old and read_search(layout, spec) == record
    assert all(0.1 <= p.k <= 1.0 and p.k == rounded(p.k) and p not in old for p in new)
    assert suggest_round(spec, layout, record) == (record, [], False)  # the new two train first


def test_a_point_of_an_entry_the_spec_does_not_search_is_refused_naming_search_json(tmp_path):
    from qed_ray.records.codec import RecordError
    from qed_ray.records.search import read_search

    spec = _spec(tmp_path)
    layout = SweepDir(tmp_path / "results" / "ks")
    layout.root.mkdir(parents=True)
    layout.search_file.write_text(json.dumps({"points": [{"entry": 3, "task": TASK, "k": 0.2}]}))
    with pytest.raises(RecordError, match=r"search.json: point .* names agent entry 3 on cartpole-balance, which "
                                          r"this spec does not search"):
        read_search(layout, spec)


def test_the_pareto_front_on_hand_made_points():
    assert pareto([(0.5, 1.0), (0.6, 1.0), (0.4, 0.1), (0.4, 0.2), (math.nan, 0.0)]) == \
        [False, True, True, False, False]


TE = [0.5, 0.6, 0.7, 0.8]


def _study(n_seeds: int = 4):
    """te (V 1) and four points: scores te x scale (so each IQM ratio is the scale on every paired resample) and V
    constant between seeds (so each V ratio is exact)."""
    te = group_result(TASK, variant="te", scores=TE[:n_seeds], V=1.0)
    cases = {"qed0.1": (0.1, 0.5, 0.01), "qed0.3": (0.3, 1.0, 0.1), "qed1": (1.0, 1.2, 0.5), "qed2": (2.0, 1.0, 0.6)}
    groups = [te] + [group_result(TASK, variant=v, scores=[scale * s for s in TE[:n_seeds]], V=V)
                     for v, (_, scale, V) in cases.items()]
    entry = {"name": "sac_ln", "overrides": {"hidden": 16}, "train": {}}
    return groups, [SearchedPoint(TASK, "sac_ln", v, k, None, entry) for v, (k, _, _) in cases.items()]


def test_the_rule_chooses_the_largest_v_reduction_whose_iqm_guard_holds():
    groups, points = _study()
    rows = front_rows(groups, points, FE, iqm_guard=0.9)
    assert [(r.variant, r.on_front, r.guard_holds, r.chosen) for r in rows] == [
        ("qed0.1", True, False, False), ("qed0.3", True, True, True), ("qed1", True, True, False),
        ("qed2", False, True, False)]
    assert [round(r.V_ratio, 6) for r in rows] == [100.0, 10.0, 2.0, round(1 / 0.6, 6)]
    assert [(round(r.iqm_ratio_ci_lower, 6), round(r.iqm_ratio_ci_upper, 6)) for r in rows] == \
        [(0.5, 0.5), (1.0, 1.0), (1.2, 1.2), (1.0, 1.0)]
    assert choose(rows) is rows[1] and rows[0].pairing == "paired"
    text = fragment(rows, points, "ks", "the rule")
    assert yaml.safe_load(text) == {"agents": [{"name": "sac_ln", "tasks": [TASK], "overrides": {"hidden": 16},
                                                "temperatures": [{"kind": "te"}, {"kind": "qed", "k": 0.3}]}]}
    assert text.startswith("# From the k search of sweep ks (exploratory; confirm it in a sweep with its own seeds).")
    assert "| cartpole-balance | sac_ln | qed0.3 | 0.3 | 0.65 | 0.1 | 10 [10, 10] | 1 [1, 1] | paired | yes | holds | " \
           "**chosen** |" in table_lines(rows, 0.95)



def test_the_front_is_written_as_table_csv_figure_and_fragment(tmp_path):
    groups, points = _study()
    rows = front_rows(groups, points, FE, iqm_guard=0.9)
    paths = write(rows, points, tmp_path / "search", "ks", "the rule", 0.95)
    assert [p.name for p in paths] == ["front.csv", "front.md", "fragment.yaml", "front.png"]
    csv_lines = (tmp_path / "search" / "front.csv").read_text().splitlines()
    assert len(csv_lines) == 5 and csv_lines[0].startswith("task,agent,variant,k,alpha_max,n_seeds,iqm,V,V_ratio,")
    md = (tmp_path / "search" / "front.md").read_text()
    assert "exploratory search" in md and "Rule, stated before the search: the rule." in md
    assert (tmp_path / "search" / "fragment.yaml").read_text() == fragment(rows, points, "ks", "the rule")
    assert (tmp_path / "search" / "front.png").stat().st_size > 10_000 and (tmp_path / "search" / "front.svg").exists()

def test_two_seeds_give_no_interval_so_no_point_is_chosen():
    groups, points = _study(n_seeds=2)
    rows = front_rows(groups, points, FE, iqm_guard=0.0)
    assert all(math.isnan(r.iqm_ratio_ci_lower) and not r.guard_holds and not r.chosen for r in rows)
    assert "0.5 [not enough seeds: 2, an interval needs 3]" in table_lines(rows, 0.95)[2]
    text = fragment(rows, points, "ks", "the rule")
    assert yaml.safe_load(text) == {"agents": []}
    assert "# Nothing chosen on cartpole-balance/sac_ln: no point's IQM guard held (or none could be judged)." in text


def test_the_dry_run_prices_the_whole_trial_budget(tmp_path):
    from qed_ray.service.search import dry_spec

    spec = _spec(tmp_path, search={"trials": 3, "k": [0.1, 1.0]})
    big, line = dry_spec(spec, SweepDir(tmp_path / "results" / "ks"))
    assert [t.variant for t in big.trials()][::2] == ["te", "qed0.1", "qed0.316", "qed1"]
    assert line.startswith("k search: 3 point(s) x 1 (task, agent) = 3 packs of 2 seeds beside te's; priced below "
                           "as per-pack cost x this budget (0 suggested so far")


def test_without_optuna_a_search_spec_is_refused_at_once_with_one_line_naming_the_extra(tmp_path):
    path = _file(tmp_path)
    code = ("import sys; sys.modules['optuna'] = None; from qed_ray.service.sweep_cli import main; "
            "r = main(sys.argv[1:]); assert 'ray' not in sys.modules and 'torch' not in sys.modules; sys.exit(r)")
    for args in ([], ["--dry-run"]):
        done = subprocess.run([sys.executable, "-c", code, str(path), *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert (done.returncode, done.stdout) == (2, "")
        assert done.stderr == ("error: search: needs Optuna, which is not installed; install the 'search' extra: "
                               "pip install -e '.[search]'\n")
    assert not (tmp_path / "results").exists()


def test_status_counts_the_points_searched_so_far_as_trials_of_the_sweep(sweep_copy, tmp_path, capsys):
    from qed_ray.records.search import write_search
    from qed_ray.service.sweep_cli import main

    path = _file(tmp_path, name=sweep_copy.root.name, storage_path=str(sweep_copy.root.parent))
    write_search(sweep_copy, SearchRecord(points=[SearchPoint(entry=0, task=TASK, k=0.2)]))
    assert main([str(path), "--status"]) == 0
    out = capsys.readouterr().out
    assert flat(out).startswith(f"sweep {sweep_copy.root.name}: 4 trials in {sweep_copy.root} ")
    assert counts(out, "trials")["done"] == 3
