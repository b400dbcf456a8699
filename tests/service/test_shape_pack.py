"""Packs by shape: members that differ in a temperature scalar (QED's k, a fixed alpha) train as one pack, each
exactly as it trains in a pack of its own value; what must not share a pack is refused naming the field; a sweep
with ``pack.by: shape`` forms them, and each member keeps its own name, folders, streams and checkpoint."""

import numpy as np
import pytest
import torch

from qed_ray.records.codec import dump, read_record
from qed_ray.spec.config import RunSpec, TemperatureSpec
from qed_ray.records.layout import PackId, SweepDir, trial_dirname
from qed_ray.rl.agents import make_packed_agent
from qed_ray.records.manifests import Manifest
from qed_ray.rl.pack import check_pack
from qed_ray.rl.run import run
from qed_ray.service.packing import form_packs
from qed_ray.records.sweep import read_state, write_state
from qed_ray.service.sweep_state import plan
from qed_ray.spec.sweep import load_spec
from kit import ACT, B, OBS, QED, spec_of, sweep_spec

SEEDS = (3, 7)
KS = (0.1, 0.2, 0.4)
LOSSES = ("loss/critic", "loss/actor", "loss/alpha")


def qed(k: float) -> TemperatureSpec:
    return TemperatureSpec(**{**QED, "k": k})


def _agent(name: str):
    return spec_of(name, {"model_every": 2})


def _batch(step: int, members: int) -> dict[str, torch.Tensor]:
    """One batch per seed (member j gets its seed's rows, whatever its k)."""
    g = torch.Generator().manual_seed(step)
    per_seed = {"obs": torch.randn(2, B, OBS, generator=g), "action": torch.rand(2, B, ACT, generator=g) * 2 - 1,
                "reward": torch.rand(2, B, generator=g) * 2, "next_obs": torch.randn(2, B, OBS, generator=g),
                "terminated": torch.zeros(2, B)}
    return {k: v.repeat(members // 2, *([1] * (v.dim() - 1))) for k, v in per_seed.items()}


@pytest.mark.parametrize("name, rules, updates", [
    ("sac_ln", [qed(k) for k in KS], 20), ("mad_sac", [qed(k) for k in KS], 6),
    ("sac_ln", [TemperatureSpec(kind="fixed", alpha=a) for a in (0.05, 0.2)], 6)])
def test_a_pack_of_several_k_values_equals_one_pack_per_k_member_by_member(name, rules, updates):
    members = [(t, s) for t in rules for s in SEEDS]  # k-major, as a sweep packs them
    mixed = make_packed_agent(_agent(name), [t for t, _ in members], OBS, ACT, torch.device("cpu"),
                              [s for _, s in members])
    alone = [make_packed_agent(_agent(name), t, OBS, ACT, torch.device("cpu"), SEEDS) for t in rules]
    on, on2 = np.ones(len(members), bool), np.ones(2, bool)
    cols = [mixed.metric_layout.names.index(c) for c in LOSSES]
    for step in range(updates):
        noise = mixed.noise(B, on)
        own = [p.noise(B, on2) for p in alone]
        assert torch.equal(noise, torch.cat(own)), "each member draws its seed's noise, whatever its k"
        got = mixed.update(_batch(step, len(members)), noise)
        want = torch.cat([p.update(_batch(step, 2), n) for p, n in zip(alone, own)])
        torch.testing.assert_close(got[:, cols], want[:, cols], rtol=0, atol=1e-5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for j in range(len(members)):
        for m, tensors in alone[j // 2].seed_state_dict(j % 2).items():
            if isinstance(tensors, dict) and m not in ("actor_opt", "critic_opt", "alpha_opt", "encoder_opt",
                                                       "model_opt"):
                for k, v in tensors.items():
                    torch.testing.assert_close(mixed.seed_state_dict(j)[m][k], v, rtol=1e-5, atol=1e-6)
    if rules[0].kind == "qed":  # the values really differ: each member reads its own k
        assert mixed.settings["scale"].tolist() == pytest.approx([1 / (t.k * ACT) for t, _ in members])
        assert not torch.equal(got[0], got[2])


def _run(task="cartpole-balance", seed=0, kind="qed", k=0.2, hidden=8, **temperature) -> RunSpec:
    temp = {"kind": kind, **({"k": k} if kind == "qed" else {}), **temperature}
    return RunSpec.model_validate({"task": task, "seed": seed, "agent": {"hidden": hidden, "batch_size": 8},
                                   "temperature": temp})


@pytest.mark.parametrize("other, field", [
    (_run(task="walker-walk"), "task"),
    (_run(kind="te"), "temperature.kind"),
    (_run(hidden=16), "agent.hidden"),
    (_run(n_actions=4), "temperature.n_actions"),
    (_run(target_alpha="qed"), "temperature.target_alpha"),
    (RunSpec.model_validate({"task": "cartpole-balance", "agent": {"name": "mad_sac"},
                             "temperature": {"kind": "qed", "k": 0.2}}), "agent.name"),
])
def test_what_must_not_share_a_pack_is_refused_naming_the_field(other, field):
    with pytest.raises(ValueError) as e:
        check_pack([_run(seed=0), other.model_copy(update={"seed": 1})])
    assert str(e.value).startswith(f"{field}: run ") and "a pack holds runs of one task, agent, temperature kind " \
                                                        "and network shape" in str(e.value)
    check_pack([_run(seed=0, k=0.1), _run(seed=0, k=0.4, alpha_max=0.3, init_alpha=0.5), _run(seed=1, k=0.1)])
    with pytest.raises(ValueError, match=r"pack.seeds: \[0, 0\] repeats a seed"):
        check_pack([_run(seed=0), _run(seed=0)])
    with pytest.raises(ValueError, match="differs from agent 0 in temperature.kind, .*; a pack's members may differ "
                                         "only in temperature.k, temperature.alpha, temperature.alpha_max, "
                                         "temperature.init_alpha"):
        make_packed_agent(_agent("sac_ln"), [qed(0.2), TemperatureSpec(kind="te")], OBS, ACT, torch.device("cpu"),
                          [0, 1])


SHAPES = {"tasks": ["cartpole-balance", "walker-walk"],  # over kit's sweep: three shapes of QED/te
          "agents": [{"name": "sac_ln", "overrides": {"hidden": 16},
                      "temperatures": [{"kind": "te"}, {"kind": "qed", "k": [0.1, 0.2, 0.4]},
                                       {"kind": "qed", "k": 0.2, "target_alpha": "qed"}]}]}


def test_a_sweep_packs_by_shape_and_keeps_packing_by_variant_by_default():
    by_shape = form_packs(sweep_spec(SHAPES, pack={"seeds": 6, "by": "shape"}))
    assert [(p.name, len(p.trials)) for p in by_shape] == [
        (f"{t}/sac_ln/{v}/pack0-1", n) for t in SHAPES["tasks"]
        for v, n in (("te", 2), ("qed0.1,qed0.2,qed0.4", 6), ("qed0.2+target_alpha=qed", 2))]
    assert by_shape[1].names == [f"cartpole-balance/sac_ln/qed{k}/{s}" for k in KS for s in (0, 1)]
    check_pack([t.run for t in by_shape[1].trials])  # what the trial's worker checks again
    # Chunks of pack.seeds members, variant by variant; by variant (the default) as before.
    assert [p.name for p in form_packs(sweep_spec(SHAPES, pack={"seeds": 4, "by": "shape"}))][:3] \
        == ["cartpole-balance/sac_ln/te/pack0-1", "cartpole-balance/sac_ln/qed0.1,qed0.2/pack0-1",
            "cartpole-balance/sac_ln/qed0.4/pack0-1"]
    assert len(form_packs(sweep_spec(SHAPES, pack={"seeds": 6}))) == 10
    dmc18 = load_spec("sweeps/dmc18.yaml")
    packs = form_packs(dmc18.sized(30))  # pack.seeds auto: 30 on the AWS workers (tests/service/test_bill.py)
    assert dmc18.pack.by == "shape" and len(packs) == 72 and sorted({len(p.trials) for p in packs}) == [10, 30]
    assert packs[1].name == "acrobot-swingup/sac_ln/qed0.1,qed0.2,qed0.4/pack0-9"


def test_each_member_of_a_shape_pack_keeps_its_name_folders_and_checkpoint(tmp_path):
    train = {"env_steps": 1000, "eval_every": 1000, "eval_episodes": 1, "warmup_decisions": 50, "frame_skip": 10}
    specs = [RunSpec.model_validate({"task": "cartpole-balance", "seed": s, "agent": {"hidden": 8, "batch_size": 8},
                                     "temperature": {"kind": "qed", "k": k, "n_actions": 2, "alpha_max": 50.0},
                                     "train": train})
             for k in (0.1, 0.4) for s in (0,)]
    summaries = run(specs, tmp_path / "shape")
    assert [(x.name, x.variant, x.seed, x.status, x.pack_size) for x in summaries] == [
        (s.name, s.variant, s.seed, "finished", 2) for s in specs]
    layout, pack = SweepDir(tmp_path / "shape"), PackId.of([s.name for s in specs])
    assert pack.name == "cartpole-balance/sac_ln/qed0.1+n_actions=2+alpha_max=50,qed0.4+n_actions=2+alpha_max=50/pack0"
    folder = layout.pack_checkpoint(pack, 1000)
    assert sorted(p.name for p in folder.iterdir()) == sorted([*(trial_dirname(s.name) for s in specs), "files.json",
                                                               "pack.json"])
    for i, s in enumerate(specs):
        manifest = read_record(folder / trial_dirname(s.name) / "manifest.json", Manifest)
        assert (manifest.variant, manifest.seed, manifest.pack_index) == (s.variant, s.seed, i)
        assert manifest.run.temperature.k == s.temperature.k
        assert layout.done_marker(s.name).exists() and layout.final_snapshot(s.name).is_dir()
    # The two members share seed 0's streams but not their k: their alphas differ.
    assert summaries[0].final_alpha != summaries[1].final_alpha


def test_sweep_json_records_pack_by_only_when_not_the_default(tmp_path):
    layout = SweepDir(tmp_path / "s")
    shape = plan(None, sweep_spec(SHAPES, pack={"seeds": 6, "by": "shape"}))
    assert shape.problems == [] and shape.state.pack_by == "shape" and dump(shape.state)["pack_by"] == "shape"
    write_state(layout, shape.state)
    assert read_state(layout) == shape.state
    default = plan(None, sweep_spec(SHAPES, pack={"seeds": 6}))
    assert default.state.pack_by == "variant" and "pack_by" not in dump(default.state)  # sweep.json as before
    # Once packs are recorded, the packing cannot change (a started pack's checkpoint holds its members together).
    changed = plan(shape.state, sweep_spec(SHAPES, pack={"seeds": 6}))
    assert changed.problems == ["pack.by: this sweep packs by shape, the spec now gives variant; a started pack's "
                                "checkpoint holds its members together: restore pack.by: shape, or start over with "
                                "--fresh or another name"]
