"""The pack agent and replay: S seeds stacked, one vmapped update with the per-seed maths of S single-seed updates.

Everything here is torch + numpy only (no env): initial slices, the update against two single-seed agents (each the
definition of one seed's update) with their own generators and replay streams, seed isolation (other data, other
noise, NaN), per-seed clipping by hand, freezing, the single-seed state layout both ways, and the replay's chunks.
"""

import numpy as np
import pytest
import torch

from kit import ACT, B, OBS, TEMPERATURES, spec_of
from oracles.single_seed import assert_pack_holds_singles, single_update

from qed_ray.rl.agents import make_agent
from qed_ray.rl.agents.packed import PackedAgent
from qed_ray.rl.agents import make_packed_agent
from qed_ray.spec.config import TemperatureSpec
from qed_ray.rl.networks import per_seed_clip_
from qed_ray.rl.replay import FIELDS, Replay, list_chunks, read_chunks, replay_bytes

SEEDS = (3, 7)
EVERY_2 = {"model_every": 2}  # MAD-SAC's model step every other update: both branches run
QED = TEMPERATURES["qed"]
ON = np.ones(2, bool)


def pack_of(name: str, temperature=QED) -> PackedAgent:
    return make_packed_agent(spec_of(name, EVERY_2), temperature, OBS, ACT, torch.device("cpu"), SEEDS)


def singles_of(name: str, temperature=QED) -> list:
    return [make_agent(spec_of(name, EVERY_2), temperature, OBS, ACT, torch.device("cpu"), s) for s in SEEDS]


def stacked_batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"obs": torch.randn(2, B, OBS, generator=g), "action": torch.rand(2, B, ACT, generator=g) * 2 - 1,
            "reward": torch.rand(2, B, generator=g) * 2, "next_obs": torch.randn(2, B, OBS, generator=g),
            "terminated": torch.zeros(2, B)}


def transitions(n: int, seed: int) -> list[tuple]:
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=OBS).astype(np.float32), rng.uniform(-1, 1, ACT).astype(np.float32),
             float(rng.normal()), rng.normal(size=OBS).astype(np.float32), False) for _ in range(n)]


def replay_rngs(seed: int) -> np.random.Generator:
    """The replay sampler stream of a run: the first of SeedSequence(seed).spawn(2), as build_trainer derives it."""
    return np.random.default_rng(np.random.SeedSequence(seed).spawn(2)[0])


@pytest.mark.parametrize("name", ["sac_ln", "mad_sac"])
def test_each_slice_of_a_pack_is_its_seeded_single_agent(name):
    pack, singles = pack_of(name), singles_of(name)
    assert pack.n == 2 and pack.name == name and set(pack.state) == set(singles[0].modules())
    for i, single in enumerate(singles):
        for m, module in single.modules().items():
            for k, v in module.state_dict().items():
                assert torch.equal(pack.state[m][k][i], v), (i, m, k)
        assert torch.equal(pack.generators[i].get_state(), single.generator.get_state())
    # the two seeds really differ, and the trainable slices are leaves of the optimisers
    assert not torch.equal(pack.state["actor"]["net.0.weight"][0], pack.state["actor"]["net.0.weight"][1])
    assert all(p.requires_grad for m in ("actor", "critic") for p in pack.params()[m].values())
    assert not any(p.requires_grad for p in pack.target_params().values())


@pytest.mark.parametrize("name, kind", [("sac_ln", "qed"), ("sac_ln", "te"), ("mad_sac", "qed"), ("mad_sac", "te")])
def test_packed_update_follows_two_single_seed_runs(name, kind):
    temperature = QED if kind == "qed" else TemperatureSpec(kind="te")
    pack, singles = pack_of(name, temperature), singles_of(name, temperature)
    data = [transitions(40, 100 + s) for s in SEEDS]
    replay = Replay(64, OBS, ACT, [replay_rngs(s) for s in SEEDS], torch.device("cpu"))
    for rows in zip(*data):
        replay.add(*(np.stack([np.asarray(r[k]) for r in rows]) for k in range(5)), active=ON)
    own = [replay_rngs(s) for s in SEEDS]  # each seed's sampler, drawn as a one-seed run draws it
    obs = np.stack([d[0][0] for d in data])
    for step in range(10):
        actions = pack.act(obs, ON)  # acting draws [1, A] per seed before the update, as a one-seed run does
        for i, single in enumerate(singles):
            want = single.sample_with(single.params(), torch.as_tensor(obs[i])[None], single.noise(1))[0]
            np.testing.assert_allclose(actions[i], want.detach().numpy(), rtol=1e-6, atol=1e-6)
        batch, noise = replay.sample(B, ON), pack.noise(B, ON)
        metrics = pack.update(batch, noise)
        for i, single in enumerate(singles):
            rows = own[i].integers(0, 40, size=B)
            single_batch = {k: torch.as_tensor(np.stack([np.asarray(data[i][r][j], np.float32) for r in rows]))
                            for j, k in enumerate(FIELDS)}
            single_noise = single.noise(single.noise_rows(B))
            assert torch.equal(noise[i], single_noise), "the same noise block from the seed's own generator"
            for k in FIELDS:
                assert torch.equal(batch[k][i], single_batch[k]), f"the same replay indices ({k})"
            want = single_update(single, single_batch, single_noise)
            torch.testing.assert_close(metrics[i], want, rtol=1e-5, atol=1e-5)
    assert_pack_holds_singles(pack, singles, rtol=1e-6)
    for i, single in enumerate(singles):
        assert torch.equal(pack.generators[i].get_state(), single.generator.get_state())
        assert replay.rngs[i].bit_generator.state == own[i].bit_generator.state
    if name == "mad_sac":
        assert pack.updates == singles[0].updates == 10  # the shared model_every counter


@pytest.mark.parametrize("name", ["sac_ln", "mad_sac"])
def test_another_seeds_batch_noise_or_nan_leaves_a_seeds_update_bit_identical(name):
    packs = [pack_of(name) for _ in range(4)]
    for step in range(3):
        batch = stacked_batch(step)
        noise = packs[0].noise(B, ON)
        for p in packs[1:]:
            p.noise(B, ON)  # keep the generators in step
        other_batch = {k: v.clone() for k, v in batch.items()}
        other_batch["obs"][1] += 1.0
        other_noise = noise.clone()
        other_noise[1] *= -1.0
        nan_batch = {k: v.clone() for k, v in batch.items()}
        nan_batch["reward"][1, 0] = float("nan")
        out = [p.update(b, n) for p, b, n in zip(packs, (batch, other_batch, batch, nan_batch),
                                                  (noise, noise, other_noise, noise))]
        for p, m in zip(packs[1:], out[1:]):
            assert torch.equal(m[0], out[0][0])
            for mod, tensors in packs[0].state.items():
                for k, v in tensors.items():
                    assert torch.equal(p.state[mod][k][0], v[0]), (mod, k)
            for opt_name, opt in packs[0].opts.items():
                for a, b in zip(opt.state.values(), p.opts[opt_name].state.values()):
                    assert torch.equal(a["exp_avg"][0], b["exp_avg"][0]) and torch.equal(a["exp_avg_sq"][0],
                                                                                         b["exp_avg_sq"][0])
        assert not torch.equal(out[1][1], out[0][1]) and not torch.equal(out[2][1], out[0][1])
        assert not torch.isfinite(out[3][1]).all() and torch.isfinite(out[3][0]).all()


def test_per_seed_clip_scales_each_seed_by_its_own_norm():
    # seed 0: global norm sqrt(3^2 + 4^2 + 0) = 5 < 10, unchanged; seed 1: sqrt(30^2 + 40^2 + 0) = 50 -> x 10/50.
    a = torch.tensor([[3.0, 4.0], [30.0, 40.0]])
    b = torch.zeros(2, 1, 3)
    norms = per_seed_clip_([a, None, b], 10.0)
    assert torch.equal(norms, torch.tensor([5.0, 50.0]))
    coef = 10.0 / (50.0 + 1e-6)
    assert torch.equal(a[0], torch.tensor([3.0, 4.0]))
    torch.testing.assert_close(a[1], torch.tensor([30.0, 40.0]) * coef, rtol=0, atol=1e-6)
    # the same as clip_grad_norm_ on each seed alone
    g = torch.nn.Parameter(torch.zeros(2))
    g.grad = torch.tensor([30.0, 40.0])
    assert torch.nn.utils.clip_grad_norm_([g], 10.0) == 50.0 and torch.equal(g.grad, a[1])


@pytest.mark.parametrize("name", ["sac_ln", "mad_sac"])
def test_seed_state_is_the_single_seed_layout_both_ways(name):
    pack = pack_of(name)
    for step in range(3):
        pack.update(stacked_batch(step), pack.noise(B, ON))
    single = singles_of(name)[0]
    state = pack.seed_state_dict(1)
    assert set(state) == set(single.state_dict())
    single.load_state_dict(state)  # loads into the single-seed agent as its own checkpoint would
    for m, module in single.modules().items():
        assert all(torch.equal(v, pack.state[m][k][1]) for k, v in module.state_dict().items()), m
    obs = np.linspace(-1, 1, OBS, dtype=np.float32)
    want = single.sample_with(single.params(), torch.as_tensor(obs)[None], single.noise(1))[0].detach().numpy()
    np.testing.assert_allclose(want, pack.act(np.stack([obs, obs]), ON)[1], rtol=1e-6, atol=1e-6)  # same stream
    if name == "mad_sac":
        assert single.updates == 3 and torch.equal(single.memo["model_metrics"], pack.memo["model_metrics"][1])
    # and back: a fresh pack loaded from the two seed states continues bit-identically
    restored = pack_of(name)
    restored.load_seed_state_dicts([pack.seed_state_dict(0), pack.seed_state_dict(1)])
    batch = stacked_batch(9)
    noise, again = pack.noise(B, ON), restored.noise(B, ON)
    assert torch.equal(noise, again)
    assert torch.equal(pack.update(batch, noise), restored.update(batch, again))
    assert all(torch.equal(v, restored.state[m][k]) for m, sd in pack.state.items() for k, v in sd.items())
    fresh = pack_of(name).seed_state_dict(0)
    with pytest.raises(ValueError, match="step together"):
        pack_of(name).load_seed_state_dicts([fresh, pack.seed_state_dict(1)])


def test_a_frozen_seed_stops_moving_while_the_other_learns():
    pack = pack_of("sac_ln")
    pack.update(stacked_batch(0), pack.noise(B, ON))
    pack.freeze(1)
    before = {m: {k: v.clone() for k, v in sd.items()} for m, sd in pack.state.items()}
    active = np.array([True, False])
    noise = pack.noise(B, active)
    assert torch.equal(noise[1], torch.zeros_like(noise[1])), "no draw from a stopped seed's generator"
    pack.update(stacked_batch(1), noise)
    assert all(torch.equal(pack.state[m][k][1], v[1]) for m, sd in before.items() for k, v in sd.items())
    assert not torch.equal(pack.state["actor"]["net.0.weight"][0], before["actor"]["net.0.weight"][0])


def test_replay_persists_each_seed_in_its_own_chunks(tmp_path):
    data = [transitions(30, s) for s in (0, 1)]
    replay = Replay(20, OBS, ACT, [replay_rngs(s) for s in SEEDS], torch.device("cpu"))
    for t, rows in enumerate(zip(*data)):
        active = np.array([True, t < 10])  # seed 1 stops after 10 transitions: later rows are ignored
        replay.add(*(np.stack([np.asarray(r[k]) for r in rows]) for k in range(5)), active=active)
    assert list(replay.added) == [30, 10] and list(replay.sizes()) == [20, 10]
    replay.plan_save(0, tmp_path / "s0").write()
    replay.plan_save(1, tmp_path / "s1").write()
    assert [(s, e) for s, e, _ in list_chunks(tmp_path / "s0")] == [(10, 30)]  # the ring kept the last 20
    assert [(s, e) for s, e, _ in list_chunks(tmp_path / "s1")] == [(0, 10)]
    (idx, fields), = read_chunks(tmp_path / "s0", 30, 20)
    assert idx.tolist() == [i % 20 for i in range(10, 30)] and sorted(fields) == sorted(FIELDS)
    for j, k in enumerate(FIELDS):  # float32 rows, exactly the transitions added (reward, flag as [n])
        want = np.stack([np.asarray(r[j], np.float32) for r in data[0][10:]])
        assert fields[k].dtype == np.float32 and np.array_equal(fields[k], want), k
    replay.plan_save(0, tmp_path / "s0").write()
    assert len(list_chunks(tmp_path / "s0")) == 1, "nothing new: no second chunk"
    again = Replay(20, OBS, ACT, [replay_rngs(s) for s in SEEDS], torch.device("cpu"))
    again.load(0, tmp_path / "s0", 30)
    again.load(1, tmp_path / "s1", 10)
    assert torch.equal(again.storage, replay.storage) and list(again.added) == [30, 10]
    assert replay_bytes(10, 1_000_000, 17, 6) == 10 * 1_000_000 * 42 * 4  # 1.68 GB: cheetah-run, 10 seeds
    half_empty = Replay(4, OBS, ACT, [replay_rngs(0), replay_rngs(1)], torch.device("cpu"))
    half_empty.add(*(np.stack([np.asarray(r[k]) for r in (data[0][0], data[1][0])]) for k in range(5)),
                   active=np.array([True, False]))
    assert half_empty.indices(3, np.array([True, False])).tolist() == [[0, 0, 0], [0, 0, 0]]
    with pytest.raises(RuntimeError, match="empty buffer of pack seed 1"):
        half_empty.indices(2, ON)


def test_the_pack_benchmark_times_whole_decisions_of_packs():
    import argparse
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "benchmarks" / "bench_pack.py"
    spec = importlib.util.spec_from_file_location("bench_pack", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.BUFFER = 64  # synthetic transitions per seed (10,000 in a real run)
    base = dict(agent="mad_sac", temperature="qed", device="cpu", hidden=8, batch=8, min_time=0.0,
                min_decisions=2, warmup=1, threads=1)
    packed = bench.run_cell(argparse.Namespace(**base, seeds=2))
    single = bench.run_cell(argparse.Namespace(**base, seeds=1))
    assert (packed["seeds"], packed["decisions"], single["seeds"], single["decisions"]) == (2, 2, 1, 2)
    assert packed["seed_decisions_per_s"] == pytest.approx(2 * 2 / packed["wall_s"])
    assert packed["seed_decisions_per_cpu_s"] == pytest.approx(2 * 2 / packed["cpu_s"])
    assert packed["peak_kind"] == "rss" and packed["peak_mib"] > 0
