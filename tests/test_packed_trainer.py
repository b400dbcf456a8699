"""Packed training on real dm_control physics: exact resume, the per-seed files a sweep reads, one seed's NaN
stopping only that seed, and a seed's checkpoint continuing in the single-seed trainer.

The packs run once per module (tiny nets, frame skip 10: 100 decisions per episode and per evaluation) and every
test reads them.
"""

import json
import shutil

import numpy as np
import pytest
import torch

from qed_ray.agents import load_policy
from qed_ray.checkpoint import CheckpointError
from qed_ray.config import RunSpec
from qed_ray.layout import SweepDir
from qed_ray.pack_run import run_pack, seed_run_dir
from qed_ray.pack import PACK_FILE, seed_dir
from qed_ray.packed_trainer import build_packed_trainer
from qed_ray.trainer import build_trainer

TRAIN = {"env_steps": 2000, "eval_every": 1000, "eval_episodes": 1, "warmup_decisions": 50, "frame_skip": 10,
         "nan_check_every": 10}


def pack_specs(agent: str = "sac_ln", **train) -> list[RunSpec]:
    agent_spec = {"name": agent, "hidden": 8, "batch_size": 8}
    if agent == "mad_sac":
        agent_spec["mad"] = {"latent_dim": 8, "encoder_hidden": 8, "model_hidden": 8, "num_bins": 21,
                             "vmin": -50.0, "vmax": 50.0}
    return [RunSpec.model_validate({"task": "cartpole-balance", "seed": seed, "agent": agent_spec,
                                    "temperature": {"kind": "qed", "k": 0.2, "n_actions": 4},
                                    "train": {**TRAIN, **train}}) for seed in (0, 1)]


def quiet(line: str) -> None:
    pass


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    root = tmp_path_factory.mktemp("packs")
    out = {"straight": run_pack(pack_specs(), root / "straight", log=quiet),
           "half": run_pack(pack_specs(env_steps=1000), root / "half", log=quiet)}
    shutil.copytree(root / "half", root / "resumed")
    out["resumed"] = run_pack(pack_specs(), root / "resumed", log=quiet)
    out["nan"] = run_pack(pack_specs(debug={"nan": {"seed": 1, "env_step": 1500}}), root / "nan", env_workers=1,
                          log=quiet)
    return root, out


def seed_states(checkpoint) -> list[dict]:
    return [torch.load(checkpoint / seed_dir(s) / "state.pt", weights_only=True) for s in (0, 1)]


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
    for a, b in zip(seed_states(root / "straight" / "checkpoint"), seed_states(root / "resumed" / "checkpoint")):
        assert_same_tensors(a, b)  # every module, optimiser moment and generator state
    name = seed_run_dir(SweepDir(root / "resumed"), pack_specs()[0].name)
    assert [json.loads(x)["env_steps"] for x in (name / "metrics.jsonl").read_text().splitlines()] == [1000, 2000]
    again = run_pack(pack_specs(), root / "resumed", log=quiet)  # a finished pack resumes to its end: no training
    assert [x["evals"] for x in again] == [x["evals"] for x in s["straight"]]


def test_each_seed_of_a_pack_has_the_files_of_a_single_seed_trial(packs):
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
        summary = json.loads((seed_run_dir(layout, spec.name) / "summary.json").read_text())
        assert summary["status"] == "finished" and summary["seed"] == spec.seed and summary["name"] == spec.name
        manifest = json.loads((root / "straight" / "checkpoint" / seed_dir(spec.seed) / "manifest.json").read_text())
        assert (manifest["pack"], manifest["pack_size"], manifest["pack_index"]) == (
            "cartpole-balance/sac_ln/qed0.2+n_actions=4/pack0-1", 2, i)
        assert manifest["seed"] == spec.seed and manifest["progress"]["decisions"] == 200
        assert manifest["replay"] == {"added": 200, "external": True}
        assert len(list(layout.replay(spec.name).glob("chunk_*.npz"))) == 2
        agent, _ = load_policy(snaps[2000])  # the analysis loads a pack seed's snapshot as any other
        assert torch.equal(agent.actor.state_dict()["net.0.weight"],
                           seed_states(root / "straight" / "checkpoint")[i]["actor"]["net.0.weight"])
    pack = json.loads((root / "straight" / "checkpoint" / PACK_FILE).read_text())
    assert pack["seeds"] == [0, 1] and pack["status"] == ["finished", "finished"] and pack["decisions"] == 200
    assert s["straight"][0]["evals"] != s["straight"][1]["evals"]  # two different seeds


def test_a_nan_in_one_seed_stops_only_that_seed(packs, tmp_path):
    root, s = packs
    seed0, seed1 = s["nan"]
    assert seed1["status"] == "diverged" and seed1["decisions"] == 150
    assert seed1["reason"].startswith("non-finite loss/critic") and "by env step 1500" in seed1["reason"]
    # seed 0 learned exactly what it learns without the NaN next to it (here with its env on a worker process)
    assert seed0["status"] == "finished" and seed0["evals"] == s["straight"][0]["evals"]
    assert seed1["evals"] == s["straight"][1]["evals"][:1]  # its evaluation before the NaN
    layout = SweepDir(root / "nan")
    names = [spec.name for spec in pack_specs()]
    assert layout.done_marker(names[0]).exists() and not layout.done_marker(names[1]).exists()
    assert list(layout.snapshots(names[1])) == [1000]
    # its checkpoint stays the last one written before it diverged; its env was no longer stepped
    manifest = json.loads((root / "nan" / "checkpoint" / seed_dir(1) / "manifest.json").read_text())
    assert manifest["env_steps"] == 1000 and manifest["progress"]["episodes"] == 1
    pack = json.loads((root / "nan" / "checkpoint" / PACK_FILE).read_text())
    assert pack["status"] == ["finished", "diverged"] and pack["reasons"][1] == seed1["reason"]
    assert_same_tensors(seed_states(root / "nan" / "checkpoint")[1], seed_states(root / "half" / "checkpoint")[1])
    # resuming keeps it stopped, also when it diverged before its first checkpoint (no seed folder)
    shutil.copytree(root / "nan", tmp_path / "nan")
    shutil.rmtree(tmp_path / "nan" / "checkpoint" / seed_dir(1))
    again = run_pack(pack_specs(debug={"nan": {"seed": 1, "env_step": 1500}}), tmp_path / "nan", log=quiet)
    assert again[1]["status"] == "diverged" and again[1]["reason"] == seed1["reason"]
    assert again[1]["decisions"] == 150 and again[0]["evals"] == seed0["evals"]


def test_a_seed_checkpoint_from_a_pack_continues_in_the_single_seed_trainer(packs):
    root, s = packs
    spec = pack_specs()[0]
    seen = []
    trainer = build_trainer(spec, lambda metrics, save: seen.append(metrics["env_steps"]),
                            replay_dir=SweepDir(root / "half").replay(spec.name), log=quiet)
    manifest = trainer.restore(root / "half" / "checkpoint" / seed_dir(0))
    assert manifest["pack_index"] == 0 and trainer.p.decisions == 100 and trainer.replay.added == 100
    assert_same_tensors(trainer.agent.state_dict(), seed_states(root / "half" / "checkpoint")[0])
    summary = trainer.run()
    assert summary["status"] == "finished" and seen == [2000] and summary["updates"] == 150
    assert summary["evals"][0] == s["straight"][0]["evals"][0] and np.isfinite(summary["final_eval_return_mean"])


def test_a_pack_checkpoint_resumes_only_the_same_pack(packs, tmp_path):
    root, _ = packs
    for specs, needle in (([pack_specs()[0]], "mismatched seeds"), (pack_specs()[::-1], "mismatched seeds")):
        trainer = build_packed_trainer(specs, lambda m, save: None, None, log=quiet)
        try:
            with pytest.raises(CheckpointError, match=needle):
                trainer.restore(root / "straight" / "checkpoint")
            assert trainer.decisions == 0
        finally:
            trainer.close()


def test_a_mad_sac_pack_trains_and_its_seed_state_loads_into_the_single_seed_agent(tmp_path):
    from qed_ray.agents import make_agent
    from qed_ray.checkpoint import load_checkpoint

    specs = pack_specs("mad_sac", env_steps=1000, warmup_decisions=80)
    summaries = run_pack(specs, tmp_path, log=quiet)
    assert [x["status"] for x in summaries] == ["finished", "finished"] and summaries[0]["updates"] == 20
    assert all(np.isfinite(x["final_eval_return_mean"]) for x in summaries)
    state, manifest = load_checkpoint(tmp_path / "checkpoint" / seed_dir(1))
    agent = make_agent(specs[1].agent, specs[1].temperature, manifest["obs_dim"], manifest["action_dim"],
                       torch.device("cpu"), specs[1].seed)
    agent.load_state_dict(state)
    assert manifest["pack_index"] == 1 and agent.updates == 20  # the shared model_every counter
    assert torch.isfinite(agent.memo["model_metrics"]).all() and agent.memo["model_metrics"].shape == (6,)


@pytest.mark.parametrize("flags, needle", [
    (["--seeds", "0", "0"], "pack.seeds: [0, 0] repeats a seed"),
    (["--seeds", "0", "1", "--env-workers", "-1"], "--env-workers: -1 must be >= 0"),
    (["--seeds", "0", "--k", "0.2"], "temperature.k: applies only to kind 'qed'"),
])
def test_pack_cli_refuses_bad_input_before_building_anything(tmp_path, capsys, flags, needle):
    from qed_ray.pack_run import main

    assert main(["--task", "cartpole-balance", "--out", str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err
    assert not (tmp_path / "out").exists()
