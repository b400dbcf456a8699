"""What the paired bootstrap rests on (docs/claim.md, Statistics): runs of two variants with the same seed number
start from the same weights, the same training-env seed and random streams, and the same evaluation seeds; runs
with different seed numbers do not. A single run (a pack of one) and packs of several seeds alike."""

import numpy as np
import pytest
import torch

from qed_ray.rl.agents import make_agent
from qed_ray.spec.config import agent_spec
from qed_ray.rl.evaluate import eval_seeds
from qed_ray.rl.trainer import build_trainer
from kit import TINY_MAD

TEMPERATURES = {"te": {"kind": "te"}, "qed": {"kind": "qed", "k": 0.2}, "fixed": {"kind": "fixed", "alpha": 0.2}}
AGENTS = {"sac_ln": {"hidden": 32}, "mad_sac": {"name": "mad_sac", "hidden": 32, "batch_size": 32,
                                                "mad": TINY_MAD}}


def _weights(agent) -> dict[str, torch.Tensor]:
    return {f"{m}.{k}": v for m, mod in agent.modules().items() if m != "temperature"
            for k, v in mod.state_dict().items()}


@pytest.mark.parametrize("agent", AGENTS)
def test_the_same_seed_gives_the_same_initial_weights_across_temperatures(agent, tiny_run):
    spec = agent_spec(AGENTS[agent])
    built = {(t, seed): make_agent(spec, tiny_run(temperature=raw).temperature, 5, 2, torch.device("cpu"), seed)
             for t, raw in TEMPERATURES.items() for seed in (3, 4)}
    te = _weights(built[("te", 3)])
    assert {k.split(".")[0] for k in te} >= {"actor", "critic", "critic_target"}
    for t in ("qed", "fixed"):
        other = _weights(built[(t, 3)])
        assert other.keys() == te.keys() and all(torch.equal(te[k], other[k]) for k in te), t
        assert torch.equal(built[(t, 3)].generator.get_state(), built[("te", 3)].generator.get_state())
    assert not torch.equal(te["actor." + next(k for k in built[("te", 3)].actor.state_dict())],
                           _weights(built[("te", 4)])["actor." + next(k for k in built[("te", 4)].actor.state_dict())])


def test_the_same_seed_gives_the_same_env_streams_and_eval_seeds(tiny_run):
    te, qed, other = (build_trainer([tiny_run(seed=seed, temperature=TEMPERATURES[t])], lambda *a: None, None,
                                    log=lambda s: None) for t, seed in (("te", 3), ("qed", 3), ("te", 4)))
    try:
        np.testing.assert_array_equal(te.pool.reset([0]), qed.pool.reset([0]))  # the training env's initial state
        assert te.pool.random_state(0) == qed.pool.random_state(0)
        assert te.runs[0].warmup_rng.bit_generator.state == qed.runs[0].warmup_rng.bit_generator.state
        assert te.replay.rng_state(0) == qed.replay.rng_state(0)  # replay sampling
        assert other.runs[0].warmup_rng.bit_generator.state != te.runs[0].warmup_rng.bit_generator.state
        assert eval_seeds(3) == [1_000_000, 1_000_001, 1_000_002], "the same evaluation episodes for every run"
    finally:
        for trainer in (te, qed, other):
            trainer.close()


def test_packs_of_two_variants_pair_seed_by_seed(tiny_run):
    packs = {t: build_trainer([tiny_run(seed=s, temperature=TEMPERATURES[t]) for s in (0, 1)],
                              lambda *a: None, None, log=lambda s: None) for t in ("te", "qed")}
    try:
        te, qed = packs["te"], packs["qed"]
        np.testing.assert_array_equal(te.pool.reset([0, 1]), qed.pool.reset([0, 1]))
        assert [r.warmup_rng.bit_generator.state for r in te.runs] == [
            r.warmup_rng.bit_generator.state for r in qed.runs]
        assert [g.bit_generator.state for g in te.replay.rngs] == [g.bit_generator.state for g in qed.replay.rngs]
        shared = {k: v for k, v in te.agent.tensors().items() if not k.startswith(("temperature", "alpha"))}
        theirs = qed.agent.tensors()
        assert all(torch.equal(v, theirs[k]) for k, v in shared.items())
        single = make_agent(te.runs[1].spec.agent, te.runs[1].spec.temperature, te.pool.obs_dim, te.pool.action_dim,
                            torch.device("cpu"), 1)
        assert torch.equal(shared["actor." + next(iter(single.actor.state_dict()))][1],
                           next(iter(single.actor.state_dict().values())))
    finally:
        for p in packs.values():
            p.close()
