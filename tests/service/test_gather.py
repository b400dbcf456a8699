"""The gather step's Ray-free decisions: group task resources, cache keys, the checks of every file the gather reads
against the digest its trial signed and of every cache entry against its own signature, unverified seeds, metric
names MLflow accepts. (The live actor runs in tests/test_sweep_e2e.py on a real cluster.)"""

import json
import shutil

import pytest

from qed_ray.analysis import group_cache
from qed_ray.analysis.checksums import TamperedSnapshotError, Verifier, verify
from qed_ray.records.digests import Recorded, digest, file_sha256, inventory
from qed_ray.rl.run_folder import write_done
from qed_ray.service.gather import group_task_resources
from qed_ray.analysis.results import GroupKey
from qed_ray.spec.sweep import FinalEvalSpec
from qed_ray.service.mlflow.tracking import metric_key

NODE = lambda cpu, gpu=0: {"Resources": {"CPU": cpu, "GPU": gpu}}  # noqa: E731


@pytest.mark.parametrize("nodes, cpu, gpu, n, cap, want", [
    ([NODE(2)], 1, 0, 12, None, ({"num_cpus": 0}, 1)),  # a 2-core laptop: trials fill it, gather runs beside them
    ([NODE(2)], 1, 0, 12, 1, ({"num_cpus": 1}, 1)),  # one trial at a time leaves a core for gather
    ([NODE(2)], 1, 0, 1, None, ({"num_cpus": 1}, 1)),  # fewer trials than cores
    ([NODE(0), NODE(16, 1)], 1, 0.1, 100, None, ({"num_cpus": 1}, 6)),  # CPU-0 head + GPU node: 10 trials, 6 spare
    ([NODE(0), NODE(16, 1), NODE(16, 1)], 2, 0.25, 100, None, ({"num_cpus": 1}, 16)),
    ([NODE(4)], 0.5, 0, 100, None, ({"num_cpus": 0}, 1)),
])
def test_group_tasks_never_wait_behind_training(nodes, cpu, gpu, n, cap, want):
    assert group_task_resources(nodes, cpu, gpu, n, cap) == want


FE = FinalEvalSpec(episodes=4, bootstrap_reps=500)


def test_cache_key_covers_policies_and_evaluation_settings_only():
    key = GroupKey("cheetah-run", "sac_ln", "qed0.2")
    base = group_cache.cache_key(key, {0: "a" * 64, 1: "b" * 64}, FE)
    assert base == group_cache.cache_key(key, {1: "b" * 64, 0: "a" * 64}, FE)  # order of seeds is irrelevant
    assert base == group_cache.cache_key(key, {0: "a" * 64, 1: "b" * 64}, FE.model_copy(update={
        "bootstrap_reps": 100, "confidence": 0.9, "seed": 3, "keep_every": 5})), "tables only: same evaluation"
    for other in [group_cache.cache_key(key, {0: "a" * 64, 1: "c" * 64}, FE),  # a retrained seed
                  group_cache.cache_key(key, {0: "a" * 64}, FE),  # a seed left out
                  group_cache.cache_key(key._replace(task="walker-walk"), {0: "a" * 64, 1: "b" * 64}, FE)] + [
            group_cache.cache_key(key, {0: "a" * 64, 1: "b" * 64}, FE.model_copy(update={f: 7}))
            for f in group_cache.EVAL_FIELDS]:
        assert other != base
    assert len(base) == 64 and int(base, 16) >= 0


def test_group_cache_round_trip_unreadable_and_edited_entries(tmp_path):
    from folder_helpers import group_result

    from qed_ray.records.layout import SweepDir

    layout, g, key = SweepDir(tmp_path), group_result("a"), b"k" * 32
    assert group_cache.load(layout, "k" * 64, key) is None
    group_cache.store(layout, "k" * 64, g, key)
    assert group_cache.load(layout, "k" * 64, key) == g and [p.name for p in layout.group_cache.iterdir()] == [
        "k" * 64 + ".json"]
    path = layout.cached_group("k" * 64)
    entry = json.loads(path.read_text())
    entry["group"]["scores"], entry["group"]["V"] = [0.999, 0.999], 1e-6  # published numbers, forged
    path.write_text(json.dumps(entry))
    with pytest.raises(group_cache.TamperedCacheError, match=f"^{path}: this cached group's content does not carry"):
        group_cache.load(layout, "k" * 64, key)
    group_cache.store(layout, "k" * 64, g, b"x" * 32)
    with pytest.raises(group_cache.TamperedCacheError, match="cached under another user's key"):
        group_cache.load(layout, "k" * 64, key)
    assert group_cache.load(layout, "k" * 64, None) == g, "--status without a key reads it unchecked (and says so)"
    path.write_text("{half a fi")
    assert group_cache.load(layout, "k" * 64, key) is None, "a damaged cache entry is evaluated again"
    path.write_text(json.dumps({"key": "k" * 64, "analysis_version": 3, "group": g.to_json()}))
    assert group_cache.load(layout, "k" * 64, key) is None, "an entry from before signatures is evaluated again"


def test_plan_groups():
    names = ["b/sac_ln/te/1", "a/sac_ln/qed0.2/0", "b/sac_ln/te/0"]
    assert group_cache.plan_groups(names) == {GroupKey("a", "sac_ln", "qed0.2"): ["a/sac_ln/qed0.2/0"],
                                              GroupKey("b", "sac_ln", "te"): ["b/sac_ln/te/0", "b/sac_ln/te/1"]}


TE0, TE = "cartpole-balance/sac_ln/te/0", GroupKey("cartpole-balance", "sac_ln", "te")


def _verifier(layout) -> Verifier:
    """What the gather step checks the hand-built sweep against: the signed digests in its MLflow store."""
    from folder_helpers import SWEEP_ID

    from qed_ray.service.results_key import load_key
    from qed_ray.service.mlflow.tracking import default_tracking_uri, sweep_digests

    return Verifier(SWEEP_ID, load_key().secret, sweep_digests(default_tracking_uri(layout.root), SWEEP_ID))


def test_every_file_the_gather_reads_is_checked_against_the_signed_digest(sweep_copy):
    layout, verifier = sweep_copy, _verifier(sweep_copy)
    assert sorted(inventory(layout, TE0)) == ["0000001000/manifest.json", "0000001000/state.pt",
                                              "0000002000/manifest.json", "0000002000/state.pt"]
    verify(layout, TE0, verifier)  # untouched: passes
    final = layout.snapshot(TE0, 2000)
    manifest = json.loads((final / "manifest.json").read_text())
    manifest["evals"][-1]["return_mean"] = 999.0  # a forged learning curve, state.pt untouched
    (final / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TamperedSnapshotError, match=f"^{final / 'manifest.json'}: has SHA-256 .* not the .* its "
                                                    f"trial recorded in MLflow when it finished"):
        verify(layout, TE0, verifier)
    job = group_cache.prepare(layout, TE, [TE0, "cartpole-balance/sac_ln/te/1"], verifier, FE)
    with pytest.raises(TamperedSnapshotError, match=str(final / "manifest.json")):
        group_cache.cached(job)  # checked before a cached entry is used, not only before evaluating
    with pytest.raises(TamperedSnapshotError, match=str(final / "manifest.json")):
        group_cache.evaluate(job, FE)

    manifest["evals"][-1]["return_mean"] = 200.0
    (final / "manifest.json").write_text(json.dumps(manifest, indent=1))  # the very bytes the trial wrote
    verify(layout, TE0, verifier)
    layout.history(TE0).write_text("[]")  # a file the gather reads that the trial never had
    with pytest.raises(TamperedSnapshotError, match=f"^{layout.history(TE0)}: is not among the files its trial "
                                                    f"recorded when it finished"):
        verify(layout, TE0, verifier)
    layout.history(TE0).unlink()
    shutil.rmtree(layout.snapshot(TE0, 1000))  # a snapshot of the V curve removed
    with pytest.raises(TamperedSnapshotError, match=f"^{layout.snapshot(TE0, 1000) / 'state.pt'}: is missing, "
                                                    f"but its trial recorded it"):  # of two, the weights named
        verify(layout, TE0, verifier)


def test_a_forged_policy_with_its_done_json_and_manifest_fixed_is_refused_naming_done_json(sweep_copy):
    layout, verifier = sweep_copy, _verifier(sweep_copy)
    other = "cartpole-balance/sac_ln/te/1"
    # Seed 1's final policy copied over seed 0's, with seed 0's manifest and DONE.json made to match it (a forgery
    # that would publish V = 0 if the driver copied DONE.json's checksums into MLflow).
    final = layout.snapshot(TE0, 2000)
    shutil.copy(layout.snapshot(other, 2000) / "state.pt", final / "state.pt")
    manifest = json.loads((final / "manifest.json").read_text())
    manifest["state_sha256"] = file_sha256(final / "state.pt")
    (final / "manifest.json").write_text(json.dumps(manifest))
    write_done(layout, TE0, {"env_steps": 2000}, inventory(layout, TE0))
    with pytest.raises(TamperedSnapshotError, match=f"^{layout.done_marker(TE0)}: its file list is not the one its "
                                                    f"trial signed in MLflow"):
        verify(layout, TE0, verifier)
    # Setting the MLflow tags to the forged files' digest needs the results key to sign it.
    files = inventory(layout, TE0)
    forged = Verifier(verifier.sweep_id, verifier.key, {TE0: Recorded(digest(files), "0" * 64,
                                                                      verifier.recorded[TE0].key_id)})
    with pytest.raises(TamperedSnapshotError, match="does not carry its trial's signature"):
        verify(layout, TE0, forged)
    moved = Verifier(verifier.sweep_id, verifier.key, {TE0: verifier.recorded[other]})  # another trial's record
    with pytest.raises(TamperedSnapshotError, match="does not carry its trial's signature"):
        verify(layout, TE0, moved)
    other_key = Verifier(verifier.sweep_id, b"x" * 32, verifier.recorded)
    with pytest.raises(TamperedSnapshotError, match="signed its digest in MLflow with results key .* not with "
                                                    "this user's"):
        verify(layout, TE0, other_key)


def test_a_trial_without_a_recorded_digest_is_unverified_not_trusted(sweep_copy):
    layout = sweep_copy
    verifier = _verifier(layout)
    outage = Verifier(verifier.sweep_id, verifier.key, {n: r for n, r in verifier.recorded.items() if n != TE0})
    job = group_cache.prepare(layout, TE, [TE0, "cartpole-balance/sac_ln/te/1"], outage, FE)
    assert job.unverified_seeds == [0] and [r.seed for r in job.records] == [0, 1]
    group_cache.check(job)  # seed 1 is checked; seed 0 cannot be
    unchecked = group_cache.prepare(layout, TE, [TE0, "cartpole-balance/sac_ln/te/1"], None, FE, verifier.key)
    assert unchecked.unverified_seeds == [0, 1] and unchecked.key == job.key
    from folder_helpers import group_result

    group_cache.store(layout, job.key, group_result("cartpole-balance", unverified_seeds=[0, 1]), verifier.key)
    assert group_cache.cached(unchecked).unverified_seeds == [0, 1]
    assert group_cache.cached(job) is None, "computed with seed 1 unchecked: never used once seed 1 can be checked"
    group_cache.store(layout, job.key, group_result("cartpole-balance", unverified_seeds=[0]), verifier.key)
    assert group_cache.cached(job).unverified_seeds == [0]
    full = group_cache.prepare(layout, TE, [TE0, "cartpole-balance/sac_ln/te/1"], verifier, FE)
    assert group_cache.cached(full) is None, "seed 0 can be checked now: evaluated again"
    group_cache.store(layout, job.key, group_result("cartpole-balance"), verifier.key)
    assert group_cache.cached(job).unverified_seeds == [0], "a checked entry serves a job with unverified seeds"


def test_metric_names_are_ones_mlflow_accepts():
    assert metric_key("sac_ln.qed0.2+alpha_max=0.3", "V_mean") == "sac_ln.qed0.2_alpha_max_0.3/V_mean"
    assert metric_key("group", "finger-turn_easy", "sac_ln.te", "V") == "group/finger-turn_easy/sac_ln.te/V"


SMALL = FinalEvalSpec(episodes=1, action_rollouts=1, action_steps=10, curve_episodes=1, bootstrap_reps=100)


def test_the_gather_engine_takes_a_finished_folder_to_its_files_without_ray_then_from_its_cache(sweep_copy):
    """The one engine the live actor and the re-analysis drive: each group prepared, evaluated by the caller's
    ``evaluate`` (here in this process; a Ray task in the actor) and stored, the tables computed and written; a
    second engine finds every group in the cache and gives the same tables; a group whose file was changed is
    refused, its seeds left out naming the file."""
    from conftest import TEMPLATE_FINISHED, TEMPLATE_RUNNING

    from qed_ray.analysis.gather_engine import GatherEngine
    from qed_ray.analysis.results import FailedTrial

    layout, verifier = sweep_copy, _verifier(sweep_copy)
    trials = [t.name for t in layout.trials()]
    finished = [n for n in trials if layout.done_marker(n).exists()]
    assert sorted(finished) == sorted(TEMPLATE_FINISHED)
    asked: list[str] = []

    def evaluate(job: group_cache.GroupJob):
        asked.append(job.group.name)
        return group_cache.evaluate(job, SMALL)

    def gather(folder: str, log=pytest.fail):  # nothing to warn of
        engine = GatherEngine(layout, SMALL, verifier.key, log=log, progress=lines.append)
        engine.exclude(FailedTrial(n, "did not finish") for n in trials if n not in finished)
        for key, names in group_cache.plan_groups(trials).items():
            engine.group(key, [n for n in names if n in finished], verifier, evaluate)
        results = engine.sweep_results("sweep", len(trials))
        engine.write(results, layout.reanalysis(folder))
        return engine, results

    lines: list[str] = []
    first, results = gather("first")
    qed = "cartpole-balance/sac_ln/qed0.2"
    assert asked == [qed, TE.name] and first.evaluated == [qed, TE.name] and first.from_cache == []
    assert [(g.key.name, g.seeds) for g in results.groups] == [(qed, [0]), (TE.name, [0, 1])]
    assert [(f.name, f.error) for f in results.failed_trials] == [(n, "did not finish") for n in TEMPLATE_RUNNING]
    assert [ln.split(" (")[0] for ln in lines] == [f"  {qed}: evaluated", f"  {TE.name}: evaluated"]
    written = {p.name: p.read_bytes() for p in layout.reanalysis("first").iterdir() if p.is_file()}
    assert sorted(written) == ["aggregates.csv", "comparisons.csv", "groups.csv", "iqm_by_budget.csv",
                               "results.json", "verdict.json"]
    assert json.loads(written["results.json"]) == results.to_json()

    lines.clear()
    second, again = gather("second")
    assert asked == [qed, TE.name] and second.from_cache == [qed, TE.name] and second.evaluated == []
    assert lines == [f"  {qed}: cached", f"  {TE.name}: cached"]
    assert again.to_json() == results.to_json()
    assert {p.name: p.read_bytes() for p in layout.reanalysis("second").iterdir() if p.is_file()} == written

    state = layout.snapshot(TE0, 2000) / "state.pt"
    state.write_bytes(state.read_bytes() + b"x")
    lines.clear()
    third = GatherEngine(layout, SMALL, verifier.key, log=lines.append)
    assert third.group(TE, [n for n in finished if n.startswith(f"{TE.name}/")], verifier, evaluate) is None
    assert third.results == {} and len(third.refused) == 1 and third.refused[0].startswith(
        f"{TE.name}: TamperedSnapshotError: {state}: has SHA-256")
    assert sorted(third.excluded) == [TE0, "cartpole-balance/sac_ln/te/1"]
    assert third.excluded[TE0].error.startswith(f"gather refused {TE.name}: {state}: has SHA-256")
    assert lines == [f"  {TE.name}: REFUSED: {third.excluded[TE0].error.removeprefix(f'gather refused {TE.name}: ')}"]
