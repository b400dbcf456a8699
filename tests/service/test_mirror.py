"""The gather outputs in MLflow (qed_ray/service/mlflow/mirror.py) on a real SQLite store, as the sweep's gather actor
writes them to the parent run while groups land: the summary as the run's description and in full as
``gather/summary.md``, the verdict as a tag, each group's row and each comparison as metrics; and the name a
re-analysis run gets from the settings it changed."""

import math

import pytest
from folder_helpers import group_result

from qed_ray.analysis import report
from qed_ray.analysis.tables import sweep_results
from qed_ray.service.mlflow.mirror import SUMMARY_FILE, SWEEP_FOOTER, log_rows, note, runs_link, settings_label
from qed_ray.service.mlflow.tags import NOTE_TAG
from qed_ray.service.mlflow.tracking import Tracker
from qed_ray.spec.sweep import FinalEvalSpec

FE = FinalEvalSpec(episodes=2, action_rollouts=2, action_steps=30, curve_episodes=1, bootstrap_reps=200,
                   confidence=0.9, seed=0)
TE_A = group_result("a", scores=(0.1, 0.2, 0.3), V=4.0)
QED_A = group_result("a", variant="qed0.2", scores=(0.2, 0.3, 0.4), V=1.0, alpha_frac_cap_late=0.5)
TE_B = group_result("b", scores=(0.3, 0.4, 0.5), V=2.0)
QED_B = group_result("b", variant="qed0.2", scores=(0.3, 0.4, 0.4), V=0.5, alpha_frac_cap_late=0.1,
                     alpha_frac_hot_late=0.8, alpha_ratio_late=9.0)


@pytest.fixture(scope="module")
def uri(tmp_path_factory):
    """One SQLite store for the module (creating its tables takes seconds); each test opens its own sweep in it."""
    return f"sqlite:///{tmp_path_factory.mktemp('store')}/mlflow.db"


@pytest.fixture
def store(uri, request, tmp_path):
    """A sweep's tracker (its own experiment, named for the test) and its parent run."""
    tracker = Tracker(uri, request.node.name, "sweep0000001", artifact_location=str(tmp_path / "a"))
    return tracker, tracker.parent_run("s", {}, {})


def _description_and_file(tracker, run_id, tmp_path):
    run = tracker.client.get_run(run_id)
    path = tracker.client.download_artifacts(run_id, SUMMARY_FILE, str(tmp_path / f"dl{len(list(tmp_path.iterdir()))}"))
    return run, run.data.tags[NOTE_TAG], open(path).read()


def test_the_parent_runs_description_follows_the_groups_as_they_land(store, tmp_path):
    tracker, parent = store
    first = sweep_results("s", FE, [TE_A], [], 4)
    log_rows(tracker, parent, first, [TE_A])
    run, description, whole = _description_and_file(tracker, parent, tmp_path)
    LINK = runs_link(tracker.experiment_id, tracker.sweep_id)
    assert description.splitlines()[2] == LINK and LINK.startswith(
        f"[Per task: te and each variant side by side](#/experiments/{tracker.experiment_id}/runs?workflowType="
        f"machine_learning&viewStateShareKey=qed-groups-sweep0000001)"), "the Model-training view, the group view"
    assert description == whole == report.summary_markdown(first, "Sweep s: summary", SWEEP_FOOTER, LINK)
    assert description.startswith("### Sweep s: summary\n") and "| sac_ln | te | 1 | 3 | 0 |" in description
    assert "qed0.2" not in description and run.data.metrics["group/a/sac_ln.te/V"] == 4.0

    both = sweep_results("s", FE, [TE_A, QED_A, TE_B, QED_B], [], 4)
    log_rows(tracker, parent, both, [QED_A, TE_B, QED_B])
    run, description, whole = _description_and_file(tracker, parent, tmp_path)
    assert description == whole == report.summary_markdown(both, "Sweep s: summary", SWEEP_FOOTER, LINK)
    assert description.index("| sac_ln | te | 2 | 6 | 0 |") < description.index("| sac_ln | qed0.2 | 2 | 6 | 0 |")
    assert both.verdict.outcome == "exploratory" and "**Verdict on the claim: not judged**" in description
    assert description.endswith(SWEEP_FOOTER) and run.data.tags["qed.verdict"] == both.verdict.outcome
    (qed,) = both.comparisons
    assert run.data.metrics["sac_ln.qed0.2/V_ratio_median"] == pytest.approx(qed.V_ratio_median.value)
    assert run.data.metrics["sac_ln.qed0.2/V_ratio_median_ci_lower"] == pytest.approx(qed.V_ratio_median.lower)
    assert run.data.metrics["sac_ln.qed0.2/prob_improvement_ci_upper"] == pytest.approx(qed.prob_improvement.upper)
    assert run.data.metrics["group/b/sac_ln.qed0.2/alpha_frac_cap_late"] == 0.1
    assert run.data.metrics["group/b/sac_ln.qed0.2/alpha_ratio_late"] == 9.0
    assert run.data.metrics["sac_ln.qed0.2/n_tasks_hot"] == 1 and run.data.tags["alpha_regime/b/sac_ln.qed0.2"] == "hot"
    assert "alpha_regime/a/sac_ln.qed0.2" not in run.data.tags, "no estimate: no tag"
    assert run.data.metrics["group/b/sac_ln.te/mean_score"] == pytest.approx(0.4)
    history = tracker.client.get_metric_history(parent, "sac_ln.te/iqm")
    assert [m.step for m in history] == [1, 4], "step: groups gathered so far"
    assert not any(math.isnan(v) for v in run.data.metrics.values()), "a statistic without a value is not logged"


def test_a_long_summary_is_cut_in_the_description_and_whole_in_the_file(store, tmp_path):
    tracker, parent = store
    groups = [group_result(t, variant=v, scores=(0.1, 0.2, 0.3)) for t in "a"
              for v in ("te", *(f"qed{k / 10:g}" for k in range(1, 26)))]
    results = sweep_results("s", FE, groups, [], len(groups) * 3)
    log_rows(tracker, parent, results, [])
    _, description, whole = _description_and_file(tracker, parent, tmp_path)
    assert len(whole) > 5000 and whole == report.summary_markdown(results, "Sweep s: summary", SWEEP_FOOTER,
                                                                              runs_link(tracker.experiment_id, tracker.sweep_id))
    assert description == note(whole) and len(description) <= 5000
    assert description.endswith(f"the whole summary is `{SUMMARY_FILE}` in Artifacts)*")


def test_a_reanalysis_is_named_for_the_settings_it_changed():
    fields = ("policies", "episodes", "bootstrap_reps", "confidence")
    sweep = {"final_eval.policies": str(["mean"]), "final_eval.episodes": "4", "final_eval.bootstrap_reps": "200",
             "final_eval.confidence": "0.95"}
    same = {"policies": ["mean"], "episodes": 4, "bootstrap_reps": 200, "confidence": 0.95}
    assert settings_label(same, sweep, fields) == "sweep settings"
    changed = {**same, "policies": ["mean", "sample"], "episodes": 20}
    assert settings_label(changed, sweep, fields) == "policies=mean,sample episodes=20"
    assert settings_label({**same, "confidence": 0.9}, {}, fields) == \
        "policies=mean episodes=4 bootstrap_reps=200 confidence=0.9", "a parent without params: every setting"
