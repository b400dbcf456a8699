"""Checkpoints: round-trip, exact resume, clear errors on corrupt, mismatched or outdated files."""

import json
import struct
import zipfile
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import torch

from qed_ray.rl.agents import make_agent
from qed_ray.records.checkpoint import (FORMAT_VERSION, CheckpointError, CheckpointVersionError, load_checkpoint,
                                        new_manifest, save_checkpoint)
from qed_ray.spec.config import RunSpec
from qed_ray.rl.replay import Replay, list_chunks, prune_chunks
from oracles.single_seed import single_update


def _agent(spec, seed=0):
    return make_agent(spec.agent, spec.temperature, 5, 1, torch.device("cpu"), seed)


def test_agent_roundtrip_gives_identical_actions_and_updates(tiny_run, tmp_path):
    spec = tiny_run(temperature={"kind": "qed", "k": 0.2})
    a = _agent(spec)
    batch = {"obs": torch.randn(32, 5), "action": torch.rand(32, 1) * 2 - 1, "reward": torch.rand(32),
             "next_obs": torch.randn(32, 5), "terminated": torch.zeros(32)}
    single_update(a, batch)
    ident = {"task": spec.task, "agent": "sac_ln", "variant": "qed0.2", "seed": 0, "obs_dim": 5, "action_dim": 1}
    save_checkpoint(tmp_path, a.state_dict(), new_manifest(**ident, env_steps=10))
    state, manifest = load_checkpoint(tmp_path, expect=ident)
    b = _agent(spec, seed=99)
    b.load_state_dict(state)
    obs = torch.as_tensor(np.random.default_rng(0).normal(size=(7, 5)).astype(np.float32))
    assert torch.equal(a.mode_with(a.params(), obs), b.mode_with(b.params(), obs))
    assert torch.equal(a.sample_with(a.params(), obs, a.noise(7)), b.sample_with(b.params(), obs, b.noise(7))), \
        "same generator state"
    assert torch.equal(single_update(a, batch), single_update(b, batch))
    assert manifest.env_steps == 10 and manifest.format_version == FORMAT_VERSION == 2
    assert manifest.versions["torch"] == metadata.version("torch")


def _replay() -> Replay:
    return Replay(100, 3, 2, [np.random.default_rng(1)], torch.device("cpu"))


def _fill(buf: Replay, rng: np.random.Generator, n: int, reward: float) -> None:
    for _ in range(n):
        buf.add(rng.normal(size=(1, 3)), rng.normal(size=(1, 2)), np.array([reward]), rng.normal(size=(1, 3)),
                np.zeros(1, bool), np.ones(1, bool))


def test_replay_saves_only_new_transitions(tmp_path):
    rng = np.random.default_rng(0)
    buf = _replay()
    _fill(buf, rng, 30, 1.0)
    first = buf.plan_save(0, tmp_path).write()
    _fill(buf, rng, 10, 2.0)
    second = buf.plan_save(0, tmp_path).write()
    assert second < first
    assert [(s, e) for s, e, _ in list_chunks(tmp_path)] == [(0, 30), (30, 40)]
    assert buf.plan_save(0, tmp_path).write() == 0
    other = _replay()
    other.load(0, tmp_path, 40)
    assert torch.equal(other.storage[0, :40], buf.storage[0, :40]) and other.added.tolist() == [40]
    with pytest.raises(CheckpointError, match="cover 30 transitions"):
        _replay().load(0, tmp_path, 35)


@pytest.mark.parametrize("version, needle", [
    (1, "written by an older version of qed_ray (checkpoint format 1; this version reads format 2"),
    (None, "checkpoint format None is not the format 2"),
    (3, "checkpoint format 3 is not the format 2"),
])
def test_checkpoint_of_another_format_is_refused_and_kept(tiny_run, tmp_path, version, needle):
    spec = tiny_run()
    ident = {"task": spec.task, "agent": "sac_ln", "variant": "te", "seed": 0, "obs_dim": 5, "action_dim": 1}
    ckpt = tmp_path / "checkpoint"
    save_checkpoint(ckpt, _agent(spec).state_dict(), new_manifest(**ident, env_steps=2000))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    if version is None:
        del manifest["format_version"]
    else:
        manifest["format_version"] = version
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    with pytest.raises(CheckpointVersionError, match=r"manifest\.json: ") as err:
        load_checkpoint(ckpt)
    assert needle in str(err.value) and isinstance(err.value, CheckpointError)
    if version == 1:
        assert "remove its checkpoint and replay folders" in str(err.value)
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before, "nothing is changed by reading it"


def test_policy_snapshots_of_format_1_still_load_for_analysis(tmp_path):
    from qed_ray.rl.agents import load_policies, load_policy

    # A final policy snapshot written by qed_ray at checkpoint format 1 (SAC-LN, QED k 0.2, hidden 16, after 20
    # updates), with the deterministic actions and log alpha_TE that version computed from it.
    snapshot = Path(__file__).parents[1] / "data" / "format1_sac_ln_qed"
    assert json.loads((snapshot / "manifest.json").read_text())["format_version"] == 1
    agent, manifest = load_policy(snapshot)
    pack, _ = load_policies([snapshot])
    obs = np.linspace(-1, 1, 15, dtype=np.float32).reshape(1, 3, 5)
    then = np.array([0.18644969165325165, 0.1844514161348343, 0.14497138559818268], np.float32)
    with torch.no_grad():  # (the last bit of a forward depends on the thread count and, in a pack, on vmap)
        np.testing.assert_allclose(agent.mode_with(agent.params(), torch.as_tensor(obs[0])).numpy().ravel(), then,
                                   rtol=1e-6)
    np.testing.assert_allclose(pack.act_deterministic(obs).ravel(), then, rtol=1e-6)
    assert agent.temperature.log_alpha.item() == pytest.approx(-2.3086886405944824, abs=1e-7)
    fresh = _agent(RunSpec.model_validate({**manifest.run.model_dump(mode="json"),
                                           "agent": {"name": "sac_ln", "hidden": 16, "batch_size": 16}}))
    assert not torch.equal(fresh.mode_with(fresh.params(), torch.as_tensor(obs[0])),
                           agent.mode_with(agent.params(), torch.as_tensor(obs[0])))  # the weights came from the file
    assert manifest.run.agent.hidden == 16, "the manifest's run is upgraded (visualize)"
    from qed_ray.records.checkpoint import SNAPSHOT_FORMATS, read_manifest
    import hashlib
    stated = read_manifest(snapshot, SNAPSHOT_FORMATS).state_sha256  # what gather and its checksums read
    assert stated == hashlib.sha256((snapshot / "state.pt").read_bytes()).hexdigest()
    with pytest.raises(CheckpointVersionError, match="written by an older version of qed_ray"):
        load_checkpoint(snapshot)  # resuming from it is still refused


def test_a_damaged_replay_chunk_is_named_and_pruning_removes_only_chunks(tmp_path):
    rng = np.random.default_rng(0)
    buf = _replay()
    for n in (30, 10):
        _fill(buf, rng, n, 1.0)
        buf.plan_save(0, tmp_path).write()
    (first, second) = [p for _, _, p in list_chunks(tmp_path)]
    intact = second.read_bytes()
    second.write_bytes(intact[: len(intact) // 2])  # truncated by a full disk or a crash without fsync
    with pytest.raises(CheckpointError, match=f"{second}: damaged replay chunk"):
        _replay().load(0, tmp_path, 40)
    second.write_bytes(intact)
    with zipfile.ZipFile(second) as z:
        info = z.getinfo("obs.npy")
    name_len, extra_len = struct.unpack("<HH", intact[info.header_offset + 26:info.header_offset + 30])
    flipped = bytearray(intact)
    flipped[info.header_offset + 30 + name_len + extra_len + info.compress_size - 1] ^= 0x01
    second.write_bytes(bytes(flipped))  # one flipped bit in the obs array: its zip CRC no longer matches
    with pytest.raises(CheckpointError, match=f"{second}: damaged replay chunk"):
        _replay().load(0, tmp_path, 40)
    older = _replay()
    older.load(0, tmp_path, 30)  # an older checkpoint needs only the intact first chunk
    assert torch.equal(older.storage[0, :30], buf.storage[0, :30])

    (tmp_path / "notes.txt").write_text("not ours")
    (tmp_path / ".chunk_0000000040_0000000050.tmp-1a2b3c4d.npz").write_bytes(b"left by a crash")
    ours = sum(p.stat().st_size for p in tmp_path.iterdir() if p.name != "notes.txt")
    assert prune_chunks(tmp_path) == ours
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    (tmp_path / "notes.txt").unlink()
    buf.plan_save(0, tmp_path / "again").write()
    prune_chunks(tmp_path / "again")
    assert not (tmp_path / "again").exists(), "an emptied replay folder goes too"


@pytest.mark.parametrize("kind, written, read", [("qed", None, "qed"), ("qed", "floor", "floor"), ("qed", "qed", "qed"),
                                                 ("te", "qed", "floor")])
def test_a_run_reads_as_it_was_trained_before_target_alpha_defaulted_to_floor(tmp_path, kind, written, read):
    """A QED run written before temperature.target_alpha existed used alpha(s') in the TD target (qed); older
    releases wrote ``qed`` into te's run too, where it never applied (today's default, unused, reads there)."""
    from qed_ray.records.checkpoint import read_manifest

    temperature = {"kind": kind, **({"k": 0.2} if kind == "qed" else {}),
                   **({"target_alpha": written} if written else {})}
    manifest = new_manifest(task="cartpole-balance", agent="sac_ln", variant="x", seed=0, obs_dim=5, action_dim=1,
                            env_steps=0, run=RunSpec(task="cartpole-balance"))
    data = json.loads(json.dumps(manifest.model_dump(mode="json")))
    data["run"]["temperature"] = temperature
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    assert read_manifest(tmp_path).run.temperature.target_alpha == read
