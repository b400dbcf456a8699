"""The gather step's Ray-free decisions: group task resources, cache keys, snapshot checks against the recorded
checksums, metric names MLflow accepts. (The live actor runs in tests/test_sweep_e2e.py on a real cluster.)"""

import pytest
import torch

from qed_ray.analysis import checksums, group_cache
from qed_ray.rl.agents import make_agent
from qed_ray.analysis.group_eval import trial_record
from qed_ray.rl.checkpoint import manifest_content, read_manifest, save_checkpoint
from qed_ray.analysis.checksums import TamperedSnapshotError, verify
from qed_ray.rl.digests import Recorded, recorded_values
from qed_ray.service.gather import group_task_resources
from qed_ray.analysis.results import GroupKey
from qed_ray.spec import FinalEvalSpec
from qed_ray.service.tracking import metric_key

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


def test_group_cache_round_trip_and_unreadable_files(tmp_path):
    from folder_helpers import group_result

    from qed_ray.layout import SweepDir

    layout, g = SweepDir(tmp_path), group_result("a")
    assert group_cache.load(layout, "k" * 64) is None
    group_cache.store(layout, "k" * 64, g)
    assert group_cache.load(layout, "k" * 64) == g and [p.name for p in layout.group_cache.iterdir()] == [
        "k" * 64 + ".json"]
    layout.cached_group("k" * 64).write_text("{half a fi")
    assert group_cache.load(layout, "k" * 64) is None, "a damaged cache entry is evaluated again"


def test_plan_groups():
    names = ["b/sac_ln/te/1", "a/sac_ln/qed0.2/0", "b/sac_ln/te/0"]
    assert group_cache.plan_groups(names) == {GroupKey("a", "sac_ln", "qed0.2"): ["a/sac_ln/qed0.2/0"],
                                              GroupKey("b", "sac_ln", "te"): ["b/sac_ln/te/0", "b/sac_ln/te/1"]}


def _rewrite(path, init_seed: int) -> None:
    """Rewrites a snapshot's weights and a manifest that matches them (what someone with share access could do)."""
    m = read_manifest(path)
    agent = make_agent(m.run.agent, m.run.temperature, m.obs_dim, m.action_dim, torch.device("cpu"), init_seed)
    save_checkpoint(path, {k: mod.state_dict() for k, mod in agent.modules().items()}, manifest_content(m))


def test_snapshots_are_checked_against_what_the_trial_recorded(sweep_copy):
    name = "cartpole-balance/sac_ln/te/0"
    recorded = recorded_values(sweep_copy, name)
    record = trial_record(sweep_copy, name)
    verify(record, recorded)  # untouched: passes
    assert recorded.policy_sha256 == checksums.file_sha256(sweep_copy.snapshot(name, 2000) / "state.pt")

    mid = sweep_copy.snapshot(name, 1000)
    _rewrite(mid, 999)
    with pytest.raises(TamperedSnapshotError, match=f"{sweep_copy.policies(name)}: the snapshots' SHA-256 digest"):
        verify(record, recorded)
    (mid / "state.pt").write_bytes(b"garbage")
    with pytest.raises(TamperedSnapshotError, match=f"{mid / 'state.pt'}: SHA-256 differs from its manifest.json"):
        verify(record, recorded)
    final = sweep_copy.snapshot(name, 2000)
    _rewrite(final, 998)
    with pytest.raises(TamperedSnapshotError, match=f"{final / 'state.pt'}: SHA-256 .* is not the "
                                                    f"{recorded.policy_sha256[:16]}"):
        verify(record, recorded)
    with pytest.raises(TamperedSnapshotError):
        verify(record, Recorded(policy_sha256="0" * 64, snapshots_sha256=recorded.snapshots_sha256))


def test_metric_names_are_ones_mlflow_accepts():
    assert metric_key("sac_ln.qed0.2+alpha_max=0.3", "V_mean") == "sac_ln.qed0.2_alpha_max_0.3/V_mean"
    assert metric_key("group", "finger-turn_easy", "sac_ln.te", "V") == "group/finger-turn_easy/sac_ln.te/V"
