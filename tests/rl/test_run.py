"""The one training path on real dm_control physics: a pack of S >= 1 seeds (a single run is a pack of one) trained
into a run folder by :func:`qed_ray.rl.run.run`: exact resume, the per-seed files a sweep reads, one seed's NaN
stopping only that seed, a finished seed's pruned replay, the newest intact checkpoint, a one-seed run agreeing with
seed 0 of a three-seed pack.

The packs run once per module (tiny nets, frame skip 10: 100 decisions per episode and per evaluation) and every
test reads them.
"""

import json
import math
import re
import shutil
import time

import numpy as np
import pytest
import torch

from kit import TINY_MAD

from qed_ray.rl.agents import load_policy, make_agent
from qed_ray.records.checkpoint import CheckpointError, load_checkpoint
from qed_ray.spec.config import RunSpec
from qed_ray.records.layout import PACK_FILE, PackId, SweepDir, seed_dir, trial_dirname
from qed_ray.rl.replay import list_chunks, prune_chunks
from qed_ray.rl.run_folder import restore_latest
from qed_ray.records.codec import dump
from qed_ray.rl.run import run
from qed_ray.rl.trainer import InjectedCrash, build_trainer
from qed_ray.records.run import read_history

TRAIN = {"env_steps": 2000, "eval_every": 1000, "eval_episodes": 1, "warmup_decisions": 50, "frame_skip": 10,
         "nan_check_every": 10}


def pack_specs(agent: str = "sac_ln", seeds=(0, 1), **train) -> list[RunSpec]:
    agent_spec = {"name": agent, "hidden": 8, "batch_size": 8, **({"mad": TINY_MAD} if agent == "mad_sac" else {})}
    return [RunSpec.model_validate({"task": "cartpole-balance", "seed": seed, "agent": agent_spec,
                                    "temperature": {"kind": "qed", "k": 0.2, "n_actions": 4},
                                    "train": {**TRAIN, **train}}) for seed in seeds]


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    root = tmp_path_factory.mktemp("packs")

    def summaries(*args, **kwargs) -> list[dict]:  # the summaries as summary.json holds them
        return [dump(x) for x in run(*args, **kwargs)]

    out = {"straight": summaries(pack_specs(), root / "straight"),
           "half": summaries(pack_specs(env_steps=1000), root / "half")}
    shutil.copytree(root / "half", root / "resumed")
    cpu0 = time.process_time()
    out["resumed"] = summaries(pack_specs(), root / "resumed")
    out["resumed_process_cpu_s"] = time.process_time() - cpu0  # the whole second start: build, resume, train
    out["nan"] = summaries(pack_specs(debug={"nan": {"seed": 1, "env_step": 1500}}), root / "nan", env_workers=1)
    return root, out


def checkpoint(root, name: str, step: int = 2000):
    return SweepDir(root / name).pack_checkpoint(PackId.of([s.name for s in pack_specs()]), step)


def seed_states(folder) -> list[dict]:
    return [torch.load(folder / seed_dir(s) / "state.pt", weights_only=True) for s in (0, 1)]


def assert_same_tensors(a, b, path=""):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same_tensors(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    else:
        assert a == b, path


def test_a_resumed_pack_continues_bit_exactly(packs):
    root, s = packs
    for straight, resumed in zip(s["straight"], s["resumed"]):
        assert resumed["evals"] == straight["evals"] and len(straight["evals"]) == 2
        assert resumed["updates"] == straight["updates"] == 150 and resumed["status"] == "finished"
    for a, b in zip(seed_states(checkpoint(root, "straight")), seed_states(checkpoint(root, "resumed"))):
        assert_same_tensors(a, b)  # every module, optimiser moment and generator state
    lines = (root / "resumed" / trial_dirname(pack_specs()[0].name) / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["env_steps"] for x in lines] == [1000, 2000]
    assert sorted(SweepDir(root / "resumed").pack_checkpoint_steps(PackId.of([x.name for x in pack_specs()]))) == \
        [1000, 2000], "the newest two checkpoints are kept"


def test_the_cpu_time_a_pack_used_is_measured_and_adds_up_over_its_starts(packs):
    """cpu_s: the process CPU time the training loop used, at most its wall time with one torch thread and no env
    workers; a resumed start adds its own to what the checkpoint recorded, within what the process used in it."""
    root, s = packs
    half, resumed, straight = s["half"][0]["cpu_s"], s["resumed"][0]["cpu_s"], s["straight"][0]["cpu_s"]
    for summary in (s["half"][0], s["resumed"][0], s["straight"][0]):
        assert 0 < summary["cpu_s"] <= summary["wall_s"] * 1.05
    assert half < resumed <= half + s["resumed_process_cpu_s"]
    assert s["half"][0]["cpu_s"] == s["half"][1]["cpu_s"], "the pack's, shared by its seeds"
    pack = json.loads((checkpoint(root, "resumed") / PACK_FILE).read_text())
    manifest = json.loads((checkpoint(root, "resumed") / seed_dir(0) / "manifest.json").read_text())
    snapshot = json.loads((SweepDir(root / "straight").snapshots(pack_specs()[0].name)[2000] / "manifest.json")
                          .read_text())
    assert half < pack["cpu_s"] <= resumed and half < manifest["progress"]["cpu_s"] <= resumed
    assert 0 < snapshot["cpu_s"] <= straight
    done = json.loads(SweepDir(root / "straight").done_marker(pack_specs()[0].name).read_text())
    assert 0 < done["perf/cpu_s"] <= straight, "the final metrics carry it to DONE.json (--status reads it there)"


def test_each_seed_has_the_files_of_a_sweep_trial(packs):
    root, s = packs
    layout = SweepDir(root / "straight")
    for i, spec in enumerate(pack_specs()):
        snaps = layout.snapshots(spec.name)
        assert list(snaps) == [1000, 2000]
        assert json.loads((snaps[1000] / "manifest.json").read_text())["modules"] == ["actor"]
        assert json.loads((snaps[2000] / "manifest.json").read_text())["modules"] == [
            "actor", "critic", "critic_target", "temperature"]
        done = json.loads(layout.done_marker(spec.name).read_text())
        assert done["env_steps"] == 2000 and done["eval/return_mean"] == s["straight"][i]["evals"][-1]["return_mean"]
        assert [h.env_steps for h in read_history(layout, spec.name)] == [1000, 2000]
        summary = json.loads((root / "straight" / trial_dirname(spec.name) / "summary.json").read_text())
        assert summary["status"] == "finished" and summary["seed"] == spec.seed and summary["name"] == spec.name
        assert summary["pack_size"] == 2 and summary["eval_s"] > 0 and summary["train_s"] > 0
        assert summary["evals"] == [e for e in s["straight"][i]["evals"]]
        manifest = json.loads((checkpoint(root, "straight") / seed_dir(spec.seed) / "manifest.json").read_text())
        assert (manifest["pack"], manifest["pack_size"], manifest["pack_index"]) == (
            "cartpole-balance/sac_ln/qed0.2+n_actions=4/pack0-1", 2, i)
        assert manifest["seed"] == spec.seed and manifest["progress"]["decisions"] == 200
        assert manifest["progress"]["evals"] == summary["evals"]
        assert manifest["replay"] == {"added": 200, "external": True}
        assert len(list_chunks(layout.replay(spec.name))) == 2
        agent, _ = load_policy(snaps[2000])  # the analysis loads a seed's snapshot as any other
        assert torch.equal(agent.actor.state_dict()["net.0.weight"],
                           seed_states(checkpoint(root, "straight"))[i]["actor"]["net.0.weight"])
    pack = json.loads((checkpoint(root, "straight") / PACK_FILE).read_text())
    assert pack["seeds"] == [0, 1] and pack["status"] == ["finished", "finished"] and pack["decisions"] == 200
    assert pack["warmup_s"] > 0 and pack["train_s"] > 0 and pack["eval_s"] > 0
    assert s["straight"][0]["evals"] != s["straight"][1]["evals"]  # two different seeds


def test_a_nan_in_one_seed_stops_only_that_seed(packs, tmp_path):
    root, s = packs
    seed0, seed1 = s["nan"]
    assert seed1["status"] == "diverged" and seed1["decisions"] == 150
    assert seed1["reason"].startswith("non-finite loss/critic") and "by env step 1500" in seed1["reason"]
    # seed 0 learned exactly what it learns without the NaN next to it (here with its env on a worker process)
    assert seed0["status"] == "finished" and seed0["evals"] == s["straight"][0]["evals"]
    assert seed1["evals"] == s["straight"][1]["evals"][:1]  # its evaluation before the NaN
    layout, names = SweepDir(root / "nan"), [spec.name for spec in pack_specs()]
    assert layout.done_marker(names[0]).exists() and not layout.done_marker(names[1]).exists()
    marker = json.loads(layout.diverged_marker(names[1]).read_text())
    assert marker == {"reason": f"DivergenceError: {seed1['reason']}", "env_steps": 1500}
    assert list(layout.snapshots(names[1])) == [1000]
    # its checkpoint stays the last one written before it diverged; its env was no longer stepped
    final = checkpoint(root, "nan")
    manifest = json.loads((final / seed_dir(1) / "manifest.json").read_text())
    assert manifest["env_steps"] == 1000 and manifest["progress"]["episodes"] == 1
    pack = json.loads((final / PACK_FILE).read_text())
    assert pack["status"] == ["finished", "diverged"] and pack["reasons"][1] == seed1["reason"]
    assert_same_tensors(seed_states(final)[1], seed_states(checkpoint(root, "half", 1000))[1])
    # resuming keeps it stopped, also when it diverged before its first checkpoint (no seed folder)
    shutil.copytree(root / "nan", tmp_path / "nan")
    shutil.rmtree(checkpoint(tmp_path, "nan") / seed_dir(1))
    (tmp_path / "nan" / trial_dirname(names[0]) / "summary.json").unlink()  # not reported: the run resumes
    again = [dump(x) for x in run(pack_specs(debug={"nan": {"seed": 1, "env_step": 1500}}), tmp_path / "nan")]
    assert again[1]["status"] == "diverged" and again[1]["reason"] == seed1["reason"]
    assert again[1]["decisions"] == 150 and again[0]["evals"] == seed0["evals"]


def test_a_finished_seed_with_pruned_replay_does_not_block_its_pack(packs, tmp_path):
    """The state a kill between two seeds' DONE.json writes of the final evaluation leaves: seed 0 done (and its
    replay pruned by a later start), seed 1 not; the pack resumes from its final checkpoint and finishes seed 1."""
    root, s = packs
    shutil.copytree(root / "straight", tmp_path / "r")
    layout, names = SweepDir(tmp_path / "r"), [spec.name for spec in pack_specs()]
    layout.done_marker(names[1]).unlink()
    for name in names:
        (tmp_path / "r" / trial_dirname(name) / "summary.json").unlink()
    prune_chunks(layout.replay(names[0]))
    again = [dump(x) for x in run(pack_specs(), tmp_path / "r")]
    assert [x["status"] for x in again] == ["finished", "finished"]
    assert [x["evals"] for x in again] == [x["evals"] for x in s["straight"]]
    done = json.loads(layout.done_marker(names[1]).read_text())
    assert done["env_steps"] == 2000 and done["files"] == json.loads(
        (root / "straight" / "policies" / trial_dirname(names[1]) / "DONE.json").read_text())["files"]


def test_a_pack_resumes_from_its_newest_intact_checkpoint(packs, tmp_path):
    root, _ = packs
    shutil.copytree(root / "straight", tmp_path / "r")
    layout, specs = SweepDir(tmp_path / "r"), pack_specs()
    pack = PackId.of([x.name for x in specs])
    newest_chunk = list_chunks(layout.replay(specs[1].name))[-1][2]  # only the final checkpoint needs it
    newest_chunk.write_bytes(newest_chunk.read_bytes()[:100])
    said = []

    def trainer_of(which=specs):
        return build_trainer(which, lambda m, save: None, [layout.replay(x.name) for x in which], log=said.append)

    # the final checkpoint says "finished": it needs no replay, so the damaged chunk only matters for a longer run
    longer = pack_specs(env_steps=3000)
    trainer = trainer_of(longer)
    assert restore_latest(trainer, layout, pack, said.append) == 1000
    assert trainer.progress.decisions == 100 and trainer.replay.added.tolist() == [100, 100] and trainer.state.resumed_from == 1000
    assert said[-2].startswith(f"WARNING {pack.name}: cannot resume from {layout.pack_checkpoint(pack, 2000)}: "
                               f"{newest_chunk}: damaged replay chunk")
    assert said[-1] == f"WARNING {pack.name}: resumed from the older checkpoint at env step 1000"
    (layout.pack_checkpoint(pack, 1000) / seed_dir(0) / "state.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=f"{re.escape(pack.name)}: no intact checkpoint: .*damaged replay "
                                              f"chunk.*state.pt: corrupt"):
        restore_latest(trainer_of(longer), layout, pack, said.append)
    other = trainer_of([specs[0]])  # another pack (one seed) never restores this pack's checkpoint
    assert restore_latest(other, layout, PackId.of([specs[0].name]), said.append) is None
    with pytest.raises(CheckpointError, match="mismatched seeds"):
        other.restore(checkpoint(root, "straight"))
    assert other.progress.decisions == 0
    shutil.copytree(root / "straight", tmp_path / "old")
    old = SweepDir(tmp_path / "old")
    for step in (1000, 2000):  # an older qed_ray wrote both: they cannot continue this run, so the pack starts over
        for seed in (0, 1):
            manifest = old.pack_checkpoint(pack, step) / seed_dir(seed) / "manifest.json"
            manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format_version": 1}))
    said.clear()
    fresh = build_trainer(longer, lambda m, save: None, [old.replay(x.name) for x in longer], log=said.append)
    assert restore_latest(fresh, old, pack, said.append) is None and fresh.progress.decisions == 0
    assert said[-1] == f"WARNING {pack.name}: every checkpoint was written by an older qed_ray; starting this pack over"


def test_a_mad_sac_pack_trains_and_its_seed_state_loads_into_the_single_seed_agent(tmp_path):
    specs = pack_specs("mad_sac", env_steps=1000, warmup_decisions=80)
    summaries = run(specs, tmp_path)
    assert [x.status for x in summaries] == ["finished", "finished"] and summaries[0].updates == 20
    assert all(np.isfinite(x.final_eval_return_mean) for x in summaries)
    state, manifest = load_checkpoint(SweepDir(tmp_path).pack_checkpoint(PackId.of([x.name for x in specs]), 1000)
                                      / seed_dir(1))
    agent = make_agent(specs[1].agent, specs[1].temperature, manifest.obs_dim, manifest.action_dim,
                       torch.device("cpu"), specs[1].seed)
    agent.load_state_dict(state)
    assert manifest.pack_index == 1 and agent.updates == 20  # the shared model_every counter
    assert torch.isfinite(agent.memo["model_metrics"]).all() and agent.memo["model_metrics"].shape == (6,)


def _first_updates(seeds, n: int = 20) -> list[torch.Tensor]:
    """The per-update metric vectors [S, K] of a run's first ``n`` updates."""
    specs = pack_specs(seeds=seeds, env_steps=1000, warmup_decisions=100 - n)  # 100 decisions at frame skip 10
    trainer = build_trainer(specs, lambda m, save: None, None, log=lambda s: None)
    seen, update = [], trainer.updater

    def recording(idx, noise):
        seen.append(update(idx, noise).clone())
        return seen[-1]

    trainer.updater = recording
    try:
        trainer.run()
    finally:
        trainer.close()
    assert len(seen) == n
    return seen


def test_a_one_seed_run_and_seed_0_of_a_three_seed_pack_agree():
    one, three = _first_updates([0]), _first_updates([0, 1, 2])
    names = build_trainer(pack_specs(seeds=[0]), lambda m, s: None, None, log=lambda s: None).agent.metric_layout.names
    losses = [i for i, n in enumerate(names) if n.startswith("loss/")]
    assert {names[i] for i in losses} == {"loss/critic", "loss/actor", "loss/alpha"}
    for a, b in zip(one, three):
        torch.testing.assert_close(a[0, losses], b[0, losses], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(three[-1][0, losses], three[-1][1, losses]), "the other seeds learn their own"


def test_an_injected_crash_happens_only_on_a_fresh_start(tmp_path):
    specs = pack_specs(seeds=[0], env_steps=3000, debug={"crash_at_env_step": 2500})
    with pytest.raises(InjectedCrash, match="injected crash at env step 2500"):
        run(specs, tmp_path)
    (summary,) = run(specs, tmp_path)  # resumes from the 2000-step checkpoint, so no crash
    assert summary.status == "finished" and summary.env_steps == 3000
    assert [e.env_steps for e in summary.evals] == [1000, 2000, 3000]


def test_heartbeat_and_eta_before_the_first_evaluation(tmp_path):
    beats, reports = [], []
    specs = pack_specs(seeds=[0], env_steps=2000, eval_every=2000, warmup_decisions=60)
    trainer = build_trainer(specs, lambda m, save: reports.append(m), None, log=lambda s: None,
                            heartbeat=beats.append, heartbeat_s=0.0)
    (summary,) = trainer.run()
    trainer.close()
    assert beats[0] == {"env_steps": 0, "total_env_steps": 2000, "warmup": True, "eta_s": None,
                        "wall_s": beats[0]["wall_s"]}
    assert [b["env_steps"] for b in beats] == [0, 1000], "every 100 decisions at heartbeat_s 0 (frame skip 10)"
    assert beats[1]["warmup"] is False and beats[1]["eta_s"] > 0, "known once training decisions were timed"
    assert reports[0][0]["perf/eta_s"] == 0.0 and len(reports) == 1
    assert summary.wall_s >= beats[-1]["wall_s"] > 0


def test_remaining_time_counts_warmup_training_and_evaluation():
    from qed_ray.spec.config import TrainSpec
    from qed_ray.rl.pack import remaining_s

    t = TrainSpec(env_steps=20_000, eval_every=4000, eval_episodes=2, warmup_decisions=1000)  # 10,000 decisions
    # at decision 400: 600 warm-up at 0.001 s, 9,000 training at 0.01 s, 5 evaluations at 3 s
    assert remaining_s(t, 400, 0, 0.001, 0.01, 3.0) == pytest.approx(0.6 + 90 + 15)
    # before any evaluation: one costs 2 episodes x 500 decisions at the warm-up cost
    assert remaining_s(t, 400, 0, 0.001, 0.01, None) == pytest.approx(0.6 + 90 + 5 * 1.0)
    assert remaining_s(t, 400, 0, 0.001, None, 3.0) is None, "training cost not measured yet"
    assert remaining_s(t, 6000, 3, None, 0.01, 3.0) == pytest.approx(40 + 6), "resumed past warm-up"
    assert remaining_s(t, 10_000, 5, None, None, None) == 0.0


def test_policy_snapshots_keep_exactly_the_named_modules(tmp_path):
    specs = pack_specs(seeds=[0])
    trainer = build_trainer(specs, lambda m, save: None, None, log=lambda s: None)
    try:
        trainer.checkpoints.save(tmp_path / "mid", modules=trainer.agent.acting_modules, index=0).result()
        mid = json.loads((tmp_path / "mid" / "manifest.json").read_text())
        assert mid["modules"] == ["actor"] and mid["policy_only"] and mid["env_steps"] == 0
        assert mid["evals"] == [] and mid["wall_s"] == 0.0, "the history and wall time ride along (none yet)"
        agent, _ = load_policy(tmp_path / "mid")
        assert torch.equal(agent.actor.state_dict()["net.0.weight"], trainer.agent.state["actor"]["net.0.weight"][0])
        with pytest.raises(ValueError, match=r"modules: \['critic_2'\] are not modules of sac_ln"):
            trainer.checkpoints.save(tmp_path / "bad", modules=("actor", "critic_2"), index=0)
        assert not (tmp_path / "bad").exists(), "nothing is written for a bad module name"
    finally:
        trainer.close()


def test_eval_records_round_trip_through_the_codec():
    from qed_ray.records.codec import RecordError, parse
    from qed_ray.records.run import EvalRecord

    rec = EvalRecord(env_steps=2000, return_mean=12.5, alpha_mean=0.0625, q_gap_mean=0.5)
    assert dump(rec) == {"env_steps": 2000, "return_mean": 12.5, "alpha_mean": 0.0625, "q_gap_mean": 0.5}
    assert parse(EvalRecord, dump(rec), "x") == rec
    warmup_only = parse(EvalRecord, json.loads(json.dumps(dump(EvalRecord(
        env_steps=1000, return_mean=3.0, alpha_mean=math.nan, q_gap_mean=math.nan)))), "x")
    assert warmup_only.env_steps == 1000 and math.isnan(warmup_only.alpha_mean) and math.isnan(warmup_only.q_gap_mean)
    older = parse(EvalRecord, {"env_steps": 1000, "return_mean": 3.0, "alpha_mean": 0.1}, "x")
    assert math.isnan(older.q_gap_mean), "a record written before q_gap_mean existed reads it as unknown"
    with pytest.raises(RecordError, match=r"^manifest.json: env_steps: Input should be a valid integer \(got '1000'\)"):
        parse(EvalRecord, {"env_steps": "1000", "return_mean": 3.0, "alpha_mean": 0.1}, "manifest.json")


def test_tf32_is_off_for_critic_passes_once_the_trainer_runs():
    def allow_tf32():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("high")

    seen = []

    def reporter(metrics, save):
        seen.append((torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
                     torch.backends.cudnn.allow_tf32))

    specs = pack_specs(seeds=[0], env_steps=1000, eval_every=1000)
    try:
        allow_tf32()
        trainer = build_trainer(specs, reporter, None, log=lambda s: None)
        assert torch.get_float32_matmul_precision() == "highest"  # set where the agent is built
        allow_tf32()  # something between construction and the run switches it on again
        trainer.run()
        trainer.close()
        assert seen == [("highest", False, False)]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("highest")


def test_a_non_finite_action_stops_its_seed_before_its_env_is_stepped(packs):
    """A policy that acts NaN (here: seed 1's actor weights set to NaN before training) stops that seed at its first
    policy action, with the reason, like a NaN loss; its env never gets the action and seed 0 trains as without it."""
    root, s = packs
    trainer = build_trainer(pack_specs(env_steps=1000), lambda m, save: None, None, log=lambda line: None)
    with torch.no_grad():
        for name in trainer.agent.param_names["actor"]:
            trainer.agent.state["actor"][name][1].fill_(float("nan"))
    stepped = []
    step = trainer.pool.step
    trainer.pool.step = lambda idx, actions: stepped.append((list(idx), np.isfinite(actions).all())) or step(idx,
                                                                                                          actions)
    seed0, seed1 = (dump(x) for x in trainer.run())
    trainer.close()
    warmup = TRAIN["warmup_decisions"]
    assert seed1["status"] == "diverged" and seed1["reason"] == f"non-finite action at env step {(warmup + 1) * 10}"
    assert seed1["decisions"] == warmup and seed1["updates"] == 0
    assert stepped[warmup - 1] == ([0, 1], True) and stepped[warmup] == ([0], True)
    assert all(finite for _, finite in stepped)
    assert seed0["status"] == "finished" and seed0["evals"] == s["half"][0]["evals"]
