"""The summary a researcher reads (qed_ray/analysis/report.py), printed and as the MLflow run description: te first,
then its variants; headers in words and a two-line legend; every ratio with its interval or not at all; the
claim's columns (paired ratios, where QED sat, flags)."""

import functools
import math
import re

from folder_helpers import group_result

from qed_ray.analysis import report
from qed_ray.analysis.results import FailedTrial
from qed_ray.analysis.tables import sweep_results
from qed_ray.spec.sweep import FinalEvalSpec

FE = FinalEvalSpec(episodes=2, action_rollouts=2, action_steps=30, curve_episodes=1, bootstrap_reps=200,
                   confidence=0.9, seed=0)
CELL = re.compile(r"-|\S+ \[\S+, \S+\]")  # a statistic with its interval, or nothing
RATIOS = ("te V / V [90% CI]", "IQM / te IQM [90% CI]")


@functools.cache
def _results():
    """sac_ln: te, te+hidden=512, fixed0.1, qed0.2 (at its cap on task a; seeds of task b not te's) and
    qed0.2+hidden=512 on tasks a and b; mad_sac: qed0.3 alone (no te baseline)."""
    groups = []
    for task in ("a", "b"):
        for variant, scale in (("te", 1.0), ("te+hidden=512", 1.0), ("fixed0.1", 0.5), ("qed0.2+hidden=512", 0.2)):
            groups.append(group_result(task, variant=variant, scores=(0.1, 0.2, 0.3), V=4.0 * scale))
        cap = {"a": 0.9, "b": 0.3}[task]
        seeds = {"a": [0, 1, 2], "b": [0, 1, 3]}[task]
        groups.append(group_result(task, variant="qed0.2", scores=(0.2, 0.25, 0.3), V=0.5, seeds=seeds,
                                   alpha_frac_floor_late=0.1, alpha_frac_cap_late=cap))
        groups.append(group_result(task, agent="mad_sac", variant="qed0.3", scores=(0.2, 0.3), V=1.0))
    return sweep_results("s", FE, groups, [FailedTrial("a/sac_ln/te/3", "DivergenceError: boom")], 23)


def _table(results):
    """(header line, {(agent, variant): {header: cell}}, legend lines) of the printed table, checking that every
    cell is in its header's column: names start where their header starts, numbers end where theirs ends."""
    lines = report.format_table(results).splitlines()
    headers, cells = report.headers(FE.confidence), report.rows(results)
    assert len(lines) == 1 + len(cells) + 2
    for line, row in zip(lines[1:], cells):
        for h, c in zip(headers, row):
            at = lines[0].index(h)
            assert (line[at:at + len(c)] if h in report.NAMES else line[at + len(h) - len(c):at + len(h)]) == c
    return lines[0], {tuple(r[:2]): dict(zip(headers, r)) for r in cells}, lines[-2:]


def test_te_comes_first_then_its_variants_for_each_agent():
    _, rows, _ = _table(_results())
    assert list(rows) == [("mad_sac", "qed0.3"), ("sac_ln", "te"), ("sac_ln", "te+hidden=512"),
                          ("sac_ln", "fixed0.1"), ("sac_ln", "qed0.2"), ("sac_ln", "qed0.2+hidden=512")]
    assert rows[("sac_ln", "te")]["flags"] == rows[("sac_ln", "te+hidden=512")]["flags"] == "baseline"
    assert [a.variant for a in _results().aggregates][:3] == ["qed0.3", "fixed0.1", "qed0.2"], "the CSV keeps its order"


def test_headers_in_words_and_a_two_line_legend_with_units_directions_and_left_out_seeds():
    header, rows, legend = _table(_results())
    assert report.headers(0.9) == ["agent", "variant", "tasks", "seeds used", "seeds left out", "IQM [90% CI]",
                                   "V [90% CI]", "te V / V [90% CI]", "IQM / te IQM [90% CI]",
                                   "action distance [90% CI]", "alpha at floor / cap", "flags"]
    assert not any(old in header for old in ("act.dist", "te var / var", "this V"))
    assert len(legend) == 2
    assert legend[0].startswith("IQM: interquartile mean of final return / 1000 (0 to 1, higher is better). V: mean KL")
    assert "summed over 30 steps (lower: seeds agree)" in legend[0]  # final_eval.action_steps
    assert legend[1].startswith("Ratios > 1 favour the variant over its te (V: median over tasks).")
    assert legend[1].endswith("Seeds left out (failed, diverged, unfinished, refused) count in no statistic.")
    te = rows[("sac_ln", "te")]
    assert (te["tasks"], te["seeds used"], te["seeds left out"]) == ("2", "6", "1"), "the diverged seed of te"


def test_every_statistic_and_ratio_has_its_interval_or_is_left_out():
    results = _results()
    _, rows, _ = _table(results)
    comps = {(c.agent, c.variant): c for c in results.comparisons}
    for key, row in rows.items():
        assert all(CELL.fullmatch(row[h]) for h in report.headers(0.9)[5:10]), row
        c = comps.get(key)
        if c is None:  # te itself, or a variant without a te of its agent: no ratio at all
            assert [row[h] for h in RATIOS] == ["-", "-"]
            continue
        assert row[RATIOS[0]] == report.with_ci(c.V_ratio_median.value, c.V_ratio_median.lower,
                                                c.V_ratio_median.upper) != "-"
        assert row[RATIOS[1]] == report.with_ci(c.iqm_ratio.value, c.iqm_ratio.lower, c.iqm_ratio.upper) != "-"
    assert rows[("sac_ln", "fixed0.1")][RATIOS[0]] == "2 [2, 2]"  # te V 4 over 2 on both tasks
    assert rows[("sac_ln", "qed0.2+hidden=512")][RATIOS[0]] == "5 [5, 5]", "against te+hidden=512, not te"
    assert rows[("mad_sac", "qed0.3")]["flags"] == "no te baseline: no ratios"
    assert report.with_ci(1.0, math.nan, 2.0) == report.with_ci(math.nan, 1.0, 2.0) == "-"
    assert report.with_ci(0.123456, 0.1, 12345.0) == "0.123 [0.1, 1.23e+04]"


def test_the_claims_columns_where_qed_sat_and_its_flags():
    _, rows, _ = _table(_results())
    qed = rows[("sac_ln", "qed0.2")]
    assert qed["alpha at floor / cap"] == "10% / 60%"  # late shares, mean over tasks a (90%) and b (30%)
    assert qed["flags"] == "intervals paired on 1 of 2 tasks; QED AT ITS CAP on 1 of 2 tasks"
    assert rows[("sac_ln", "te")]["alpha at floor / cap"] == rows[("sac_ln", "fixed0.1")]["alpha at floor / cap"] \
        == "-", "te and fixed alpha log no QED shares"
    one_seed = sweep_results("s", FE, [group_result("a", scores=(0.1,)), group_result("a", variant="qed0.2",
                                                                                      scores=(0.2,))], [], 2)
    _, row = report.rows(one_seed)
    assert row[7] == "-" and row[-1] == "V ratio over 0 of 1 tasks; a task with 1 seed: no V there"


def test_the_markdown_description_holds_the_same_table_legend_and_verdict():
    results = _results()
    text = report.summary_markdown(results, "Sweep s: summary", "the footer")
    lines = text.splitlines()
    assert lines[0] == "### Sweep s: summary"
    assert lines[2] == ("12 groups on 2 tasks; 1 of 23 trials left out. Final evaluation: 2 episodes per seed, "
                        "policy `mean`; intervals: 90% bootstrap over seeds, 200 resamples.")
    table = lines[4:4 + 2 + len(results.aggregates)]
    assert table[0] == "| " + " | ".join(report.headers(0.9)) + " |"
    assert table[1] == "|:---|:---|" + "---:|" * 9 + ":---|"
    assert table[2:] == ["| " + " | ".join(c or " " for c in r) + " |" for r in report.rows(results)]
    assert lines[len(table) + 5:len(table) + 7] == [f"*{line}*  " for line in report.legend(results)]
    assert ("**Verdict on the claim: not judged** (by the registered design of docs/claim.md), judged over nothing: "
            "no variant runs the registered design (exploratory):") in lines
    assert "- sac_ln qed0.2 vs te: not judged (exploratory: no pre-registration named (spec field claim); variant " \
           "sac_ln qed0.2 vs te is not among the pre-registered mad_sac qed0.2, qed0.4 vs te;" in text
    assert "PASS" not in text and "FAIL" not in text and lines[-1] == "the footer"


def test_unverified_seeds_are_listed_by_the_reason_their_done_json_gives(tmp_path):
    from qed_ray.records.codec import write_record
    from qed_ray.records.layout import SweepDir
    from qed_ray.rl.run_folder import write_done

    layout = SweepDir(tmp_path)
    outage = "tracking outage: MLflow at http://head:5000 did not answer for 300 s when it finished, so its signed " \
             "digest was never recorded"
    for seed in (0, 2):  # signed-era seeds whose workers could not record their digests
        layout.policies(f"a/sac_ln/te/{seed}").mkdir(parents=True)
        write_done(layout, f"a/sac_ln/te/{seed}", {"env_steps": 2000}, {"history.json": "0" * 64}, outage)
    layout.policies("a/sac_ln/te/1").mkdir(parents=True)  # written before trials signed: no file list
    write_record(layout.done_marker("a/sac_ln/te/1"), {"env_steps": 2000, "eval/return_mean": 1.0}, dict)
    groups = [group_result("a", scores=(0.1, 0.2, 0.3), unverified_seeds=[0, 1, 2])]
    assert report.unverified_line(groups, layout) == (
        f"UNVERIFIED: 3 of 3 seeds were used without a check (no signed digest of their files in MLflow): {outage}: "
        f"a/sac_ln/te seeds 0, 2; trained by a qed_ray from before signed digests: a/sac_ln/te seed 1")
    assert report.unverified_line(groups) == (  # no folder (not checked against MLflow): no reason claimed
        "UNVERIFIED: 3 of 3 seeds were used without a check (not checked, or no signed digest of their files in "
        "MLflow: the reason is on each run's qed.unverified tag): a/sac_ln/te seeds 0, 1, 2")


def test_at_a_width_the_table_splits_into_blocks_led_by_agent_and_variant_and_no_line_is_wider():
    results = _results()
    whole = report.summary(results)
    assert max(map(len, whole.splitlines())) > 100, "the case must need wrapping"
    for columns in (100, 80):
        text = report.summary(results, columns=columns)
        assert max(map(len, text.splitlines())) <= columns
        table = report.format_table(results, columns).split("\n\n")
        cells = report.rows(results)
        assert len(table) > 1, "split into blocks of columns"
        shown = set()
        for block in table:
            lines = block.splitlines()[:1 + len(cells)]
            assert lines[0].split()[:2] == ["agent", "variant"]
            for line, row in zip(lines[1:], cells):
                assert line.split()[:2] == row[:2]
            shown |= {h for h in report.headers(FE.confidence) if h in lines[0]}
        assert shown == set(report.headers(FE.confidence)), "every column in some block"
    assert report.format_table(results, 10_000) == report.format_table(results), "fits: one block, as before"


def test_a_group_view_has_its_own_intervals_and_its_ratio_to_te_on_its_task_only_once_te_is_in():
    from qed_ray.analysis.group_view import group_view, variants_of_baseline

    results = _results()
    by = {(g.task, g.agent, g.variant): g for g in results.groups}
    qed, te = by[("a", "sac_ln", "qed0.2")], by[("a", "sac_ln", "te")]
    alone = group_view(qed, [qed], FE)
    assert alone.ratios is None and alone.baseline == "" and "te V / V" not in alone.line(0.9)
    view = group_view(qed, results.groups, FE)
    assert view.baseline == "te"
    point, lower, upper = view.ratios["te_V_ratio"]
    assert point == 4.0 / 0.5 and lower <= point <= upper
    stats = {(s.task, s.variant): s for s in results.group_stats}[("a", "qed0.2")]
    assert view.values["V"] == (0.5, stats.V_ci_lower, stats.V_ci_upper), "the draws behind groups.csv"
    iqm_point = view.values["IQM"][0]
    assert iqm_point == 0.25 and view.metrics()["IQM"] == iqm_point and view.metrics()["te_V_ratio"] == 8.0
    assert view.line(0.9).startswith("gathered a/sac_ln/qed0.2 (3 seeds, 90% CI): V 0.5 [")
    assert "te V / V 8 [" in view.line(0.9) and "IQM / te IQM 1.25 [" in view.line(0.9)
    assert group_view(te, results.groups, FE).ratios is None, "te is the baseline"
    assert {g.variant for g in variants_of_baseline(te, results.groups)} == {"fixed0.1", "qed0.2"}
    one = group_view(by[("a", "mad_sac", "qed0.3")], results.groups, FE)
    assert "V_ci_lower" in one.metrics() and "te_V_ratio" not in one.metrics(), "no te of mad_sac: no ratio, not 0"
