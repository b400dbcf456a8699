"""Checkpoints: round-trip, exact resume, clear errors on corrupt, mismatched or outdated files."""

import json
import struct
import zipfile
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import torch

from qed_ray.agents import make_agent
from qed_ray.checkpoint import (FORMAT_VERSION, CheckpointError, CheckpointVersionError, load_checkpoint,
                                save_checkpoint)
from qed_ray.config import RunSpec
from qed_ray.replay import ReplayBuffer, list_chunks, prune_chunks
from qed_ray.spec import SpecError
from qed_ray.train import main, run


def _agent(spec, seed=0):
    return make_agent(spec.agent, spec.temperature, 5, 1, torch.device("cpu"), seed)


def test_agent_roundtrip_gives_identical_actions_and_updates(tiny_run, tmp_path):
    spec = tiny_run(temperature={"kind": "qed", "k": 0.2})
    a = _agent(spec)
    batch = {"obs": torch.randn(32, 5), "action": torch.rand(32, 1) * 2 - 1, "reward": torch.rand(32),
             "next_obs": torch.randn(32, 5), "terminated": torch.zeros(32)}
    a.update(batch)
    ident = {"task": spec.task, "agent": "sac_ln", "variant": "qed0.2", "seed": 0, "obs_dim": 5, "action_dim": 1}
    save_checkpoint(tmp_path, a.state_dict(), {**ident, "env_steps": 10})
    state, manifest = load_checkpoint(tmp_path, expect=ident)
    b = _agent(spec, seed=99)
    b.load_state_dict(state)
    obs = np.random.default_rng(0).normal(size=(7, 5)).astype(np.float32)
    np.testing.assert_array_equal(a.act_batch(obs), b.act_batch(obs))
    np.testing.assert_array_equal(a.act(obs[0], False), b.act(obs[0], False))  # same generator state
    assert torch.equal(a.update(batch), b.update(batch))
    assert manifest["env_steps"] == 10 and manifest["format_version"] == FORMAT_VERSION == 2
    assert manifest["versions"]["torch"] == metadata.version("torch")


def test_resume_continues_exactly(tiny_run, tmp_path):
    spec = tiny_run(temperature={"kind": "qed", "k": 0.2})
    straight = run(spec, tmp_path / "a")
    half = spec.model_copy(update={"train": spec.train.model_copy(update={"env_steps": 2000})})
    run(half, tmp_path / "b")
    resumed = run(spec, tmp_path / "b")
    assert resumed["evals"] == straight["evals"]
    assert resumed["updates"] == straight["updates"] and resumed["env_steps"] == 4000
    lines = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [m["env_steps"] for m in lines] == [2000, 4000]


def test_same_seed_same_returns_other_seed_differs(tiny_run, tmp_path):
    spec = tiny_run(train={"env_steps": 2000})
    r1, r2 = run(spec, tmp_path / "1"), run(spec, tmp_path / "2")
    r3 = run(spec.model_copy(update={"seed": 1}), tmp_path / "3")
    assert r1["evals"] == r2["evals"]
    assert r1["evals"] != r3["evals"]


def test_corrupt_and_mismatched_checkpoints_are_named(tiny_run, tmp_path):
    spec = tiny_run(train={"env_steps": 2000})
    run(spec, tmp_path / "r")
    ckpt = tmp_path / "r" / "checkpoint"
    with pytest.raises(CheckpointError, match="mismatched seed"):
        load_checkpoint(ckpt, expect={"seed": 5})
    (ckpt / "state.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"state\.pt: corrupt"):
        load_checkpoint(ckpt)
    (ckpt / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"manifest\.json: corrupt"):
        load_checkpoint(ckpt)


def test_resuming_with_another_variant_is_refused(tiny_run, tmp_path):
    spec = tiny_run(train={"env_steps": 2000})
    run(spec, tmp_path / "r")
    other = spec.model_copy(update={"temperature": spec.temperature.model_copy(update={"kind": "fixed",
                                                                                        "alpha": 0.1})})
    with pytest.raises(SpecError) as refused:
        run(other, tmp_path / "r")
    lines = str(refused.value).splitlines()
    assert [line.split(":")[0] for line in lines] == ["temperature.alpha", "temperature.kind"]
    assert 'trained with "te", this run gives "fixed"' in lines[1]
    # The checkpoint's own identity check still guards direct loads.
    with pytest.raises(CheckpointError, match="mismatched variant"):
        load_checkpoint(tmp_path / "r" / "checkpoint", expect={"variant": "fixed0.1"})


def test_replay_saves_only_new_transitions(tmp_path):
    rng = np.random.default_rng(0)
    buf = ReplayBuffer(100, 3, 2, np.random.default_rng(1))
    for _ in range(30):
        buf.add(rng.normal(size=3), rng.normal(size=2), 1.0, rng.normal(size=3), False)
    first = buf.save_incremental(tmp_path)
    for _ in range(10):
        buf.add(rng.normal(size=3), rng.normal(size=2), 2.0, rng.normal(size=3), False)
    second = buf.save_incremental(tmp_path)
    assert second < first
    assert [(s, e) for s, e, _ in list_chunks(tmp_path)] == [(0, 30), (30, 40)]
    assert buf.save_incremental(tmp_path) == 0
    other = ReplayBuffer(100, 3, 2, np.random.default_rng(1))
    other.load_incremental(tmp_path, 40)
    for k in buf.data:
        np.testing.assert_array_equal(other.data[k][:40], buf.data[k][:40])
    with pytest.raises(CheckpointError, match="cover 30 transitions"):
        ReplayBuffer(100, 3, 2, np.random.default_rng(1)).load_incremental(tmp_path, 35)


@pytest.mark.parametrize("version, needle", [
    (1, "written by an older version of qed_ray (checkpoint format 1; this version reads format 2"),
    (None, "checkpoint format None is not the format 2"),
    (3, "checkpoint format 3 is not the format 2"),
])
def test_checkpoint_of_another_format_is_refused_and_kept(tiny_run, tmp_path, capsys, version, needle):
    spec = tiny_run()
    ident = {"task": spec.task, "agent": "sac_ln", "variant": "te", "seed": 0, "obs_dim": 5, "action_dim": 1}
    ckpt = tmp_path / "checkpoint"
    save_checkpoint(ckpt, _agent(spec).state_dict(), {**ident, "env_steps": 2000})
    manifest = json.loads((ckpt / "manifest.json").read_text())
    if version is None:
        del manifest["format_version"]
    else:
        manifest["format_version"] = version
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "run.json").write_text("{}")  # a run folder of the CLI's own
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    with pytest.raises(CheckpointVersionError, match=r"manifest\.json: ") as err:
        load_checkpoint(ckpt)
    assert needle in str(err.value) and isinstance(err.value, CheckpointError)
    if version == 1:
        assert "remove its checkpoint and replay folders" in str(err.value)
    # The CLI refuses it with exit code 2 and the same message, and leaves the checkpoint as it was.
    rc = main(["--task", "cartpole-balance", "--hidden", "32", "--batch-size", "32", "--out", str(tmp_path)])
    err_text = capsys.readouterr().err
    assert rc == 2 and err_text.startswith("error: ") and needle in err_text
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before


def test_policy_snapshots_of_format_1_still_load_for_analysis(tmp_path):
    from qed_ray.agents import load_policy

    # A final policy snapshot written by qed_ray at checkpoint format 1 (SAC-LN, QED k 0.2, hidden 16, after 20
    # updates), with the deterministic actions and log alpha_TE that version computed from it.
    snapshot = Path(__file__).parent / "data" / "format1_sac_ln_qed"
    assert json.loads((snapshot / "manifest.json").read_text())["format_version"] == 1
    agent, manifest = load_policy(snapshot)
    obs = np.linspace(-1, 1, 15, dtype=np.float32).reshape(3, 5)
    np.testing.assert_array_equal(agent.act_batch(obs).ravel(),
                                  np.array([0.18644969165325165, 0.1844514161348343, 0.14497138559818268],
                                           np.float32))
    assert agent.temperature.log_alpha.item() == pytest.approx(-2.3086886405944824, abs=1e-7)
    fresh = _agent(RunSpec.model_validate({**manifest["run"], "agent": {"name": "sac_ln", "hidden": 16,
                                                                        "batch_size": 16}}))
    assert not np.array_equal(fresh.act_batch(obs), agent.act_batch(obs))  # the weights came from the file
    assert RunSpec.model_validate(manifest["run"]).agent.hidden == 16, "the manifest's run is upgraded (visualize)"
    from qed_ray.checkpoint import SNAPSHOT_FORMATS, read_manifest
    import hashlib
    stated = read_manifest(snapshot, SNAPSHOT_FORMATS)["state_sha256"]  # what gather and its checksums read
    assert stated == hashlib.sha256((snapshot / "state.pt").read_bytes()).hexdigest()
    with pytest.raises(CheckpointVersionError, match="written by an older version of qed_ray"):
        load_checkpoint(snapshot)  # resuming from it is still refused


def test_a_damaged_replay_chunk_is_named_and_pruning_removes_only_chunks(tmp_path):
    rng = np.random.default_rng(0)
    buf = ReplayBuffer(100, 3, 2, np.random.default_rng(1))
    for n in (30, 10):
        for _ in range(n):
            buf.add(rng.normal(size=3), rng.normal(size=2), 1.0, rng.normal(size=3), False)
        buf.save_incremental(tmp_path)
    (first, second) = [p for _, _, p in list_chunks(tmp_path)]
    intact = second.read_bytes()
    second.write_bytes(intact[: len(intact) // 2])  # truncated by a full disk or a crash without fsync
    with pytest.raises(CheckpointError, match=f"{second}: damaged replay chunk"):
        ReplayBuffer(100, 3, 2, np.random.default_rng(1)).load_incremental(tmp_path, 40)
    second.write_bytes(intact)
    with zipfile.ZipFile(second) as z:
        info = z.getinfo("obs.npy")
    name_len, extra_len = struct.unpack("<HH", intact[info.header_offset + 26:info.header_offset + 30])
    flipped = bytearray(intact)
    flipped[info.header_offset + 30 + name_len + extra_len + info.compress_size - 1] ^= 0x01
    second.write_bytes(bytes(flipped))  # one flipped bit in the obs array: its zip CRC no longer matches
    with pytest.raises(CheckpointError, match=f"{second}: damaged replay chunk"):
        ReplayBuffer(100, 3, 2, np.random.default_rng(1)).load_incremental(tmp_path, 40)
    older = ReplayBuffer(100, 3, 2, np.random.default_rng(1))
    older.load_incremental(tmp_path, 30)  # an older checkpoint needs only the intact first chunk
    np.testing.assert_array_equal(older.data["obs"][:30], buf.data["obs"][:30])

    (tmp_path / "notes.txt").write_text("not ours")
    (tmp_path / ".chunk_0000000040_0000000050.tmp-1a2b3c4d.npz").write_bytes(b"left by a crash")
    ours = sum(p.stat().st_size for p in tmp_path.iterdir() if p.name != "notes.txt")
    assert prune_chunks(tmp_path) == ours
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    (tmp_path / "notes.txt").unlink()
    buf.save_incremental(tmp_path / "again")
    prune_chunks(tmp_path / "again")
    assert not (tmp_path / "again").exists(), "an emptied replay folder goes too"
