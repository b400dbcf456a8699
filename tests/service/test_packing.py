"""Packs of a sweep without Ray: formed from the spec, membership fixed when the sweep grows, S = 1 unchanged,
refusals naming the field, --dry-run's packs and GPU-hours, the pack tags of a seed run's MLflow run."""

import json
import re
import uuid

import pytest

from kit import TRAIN, counts, flat, sweep_spec
from pydantic import ValidationError

from qed_ray.spec.field_hints import format_validation_error
from qed_ray.service.plan.dry_run import dry_run
from qed_ray.service.plan.machines import Machine
from qed_ray.records.layout import PackId, SweepDir, member_dirs, parse_trial_dirname, trial_dirname
from qed_ray.service.packing import TuneTrial, form_packs, pack_records
from qed_ray.spec.sweep import SweepSpec
from qed_ray.records.codec import dump
from qed_ray.records.run import HistoryEntry
from qed_ray.records.sweep import SweepState, read_state, write_state
from qed_ray.service.sweep_state import plan
from qed_ray.service.mlflow.tracking import PACK_SIZE_TAG, PACK_TAG, Tracker, TrialRun, pack_tags

PACKING = {"name": "p", "tasks": ["cartpole-balance", "walker-walk"], "seeds": 5}  # over kit's sweep


def _names(packs) -> list[tuple[str, list[str]]]:
    return [(p.name, p.names) for p in packs]


def test_packs_are_the_seed_runs_of_one_task_agent_variant_in_seed_order_in_chunks():
    packs = form_packs(sweep_spec(PACKING, pack={"seeds": 2}))
    seeds = [[0, 1], [2, 3], [4]]
    assert _names(packs) == [(f"{t}/sac_ln/te/pack{'-'.join(map(str, [s[0], s[-1]])) if len(s) > 1 else s[0]}",
                              [f"{t}/sac_ln/te/{x}" for x in s]) for t in PACKING["tasks"] for s in seeds]
    assert [p.id.dirname for p in packs[:3]] == ["cartpole-balance__sac_ln__te__pack0-1",
                                                 "cartpole-balance__sac_ln__te__pack2-3",
                                                 "cartpole-balance__sac_ln__te__pack4"]
    assert packs[0].env_steps == 4000 and [t.run.seed for t in packs[1].trials] == [2, 3]
    # Seeds in any order in the spec: packs in seed order; seeds that do not follow each other joined by +.
    scattered = form_packs(sweep_spec(PACKING, seeds=[7, 3, 5], tasks=["cartpole-balance"], pack={"seeds": 2}))
    assert [p.name for p in scattered] == ["cartpole-balance/sac_ln/te/pack3+5", "cartpole-balance/sac_ln/te/pack7"]
    # Variants never share a pack; a grid axis in the variant is in the pack's name.
    axes = sweep_spec(PACKING, tasks=["cartpole-balance"], seeds=2, pack={"seeds": 2},
                 agents=[{"name": "sac_ln", "overrides": {"hidden": [16, 32]},
                          "temperatures": [{"kind": "te"}, {"kind": "qed", "k": 0.2}]}])
    variants = ("te+hidden=16", "qed0.2+hidden=16", "te+hidden=32", "qed0.2+hidden=32")
    assert [p.name for p in form_packs(axes)] == [f"cartpole-balance/sac_ln/{v}/pack0-1" for v in variants]


def test_pack_ids_round_trip_and_are_never_trial_folders():
    pack = PackId.of(["cheetah-run/mad_sac/qed0.2/3", "cheetah-run/mad_sac/qed0.2/4"])
    assert pack == PackId("cheetah-run", "mad_sac", "qed0.2", (3, 4))
    assert pack.name == "cheetah-run/mad_sac/qed0.2/pack3-4"
    assert pack.trials == ["cheetah-run/mad_sac/qed0.2/3", "cheetah-run/mad_sac/qed0.2/4"]
    with pytest.raises(ValueError, match="task__agent__variant__sSEED"):
        parse_trial_dirname(pack.dirname)
    with pytest.raises(ValueError, match="differ in agent: a pack holds runs of one task and agent"):
        PackId.of(["cheetah-run/mad_sac/qed0.2/3", "cheetah-run/sac_ln/qed0.2/4"])
    with pytest.raises(ValueError, match="seeds \\[3, 3\\] repeat a seed"):
        PackId.of(["cheetah-run/mad_sac/qed0.2/3", "cheetah-run/mad_sac/qed0.2/3"])
    # Several variants of one task and agent: a pack by shape, named for its variants and their seeds.
    names = [f"cheetah-run/mad_sac/{v}/{s}" for v in ("qed0.2", "qed0.4") for s in (3, 4)]
    mixed = PackId.of(names)
    assert (mixed.name, mixed.dirname) == ("cheetah-run/mad_sac/qed0.2,qed0.4/pack3-4",
                                           "cheetah-run__mad_sac__qed0.2,qed0.4__pack3-4")
    assert mixed.trials == names and mixed.seeds == (3, 4, 3, 4) and PackId.of(names[:3]).label == "pack3-4,3"
    assert member_dirs(mixed.trials, mixed.seeds) == [trial_dirname(n) for n in names]
    assert member_dirs(pack.trials, pack.seeds) == ["seed_3", "seed_4"]  # a pack of one variant: as it always was
    with pytest.raises(ValueError, match="'cheetah-run/mad_sac/qed0.4/3' is in it twice"):
        PackId.of(names + names[2:3])
    run = {"task": "cheetah-run", "agent": {"name": "mad_sac"}, "temperature": {"kind": "qed", "k": 0.2}}
    config = {"pack": {"name": pack.name, "trials": [{"name": n, "run": {**run, "seed": int(n[-1])}}
                                                     for n in pack.trials]}}
    trial = TuneTrial.of(config)  # what the trainable and the driver's callbacks read of a Tune trial's config
    assert trial.names == pack.trials and trial.name == pack.name and trial.param() == TuneTrial.of(
        {"pack": trial.param()}).param()
    assert trial.id.dirname == "cheetah-run__mad_sac__qed0.2__pack3-4" and trial.trials[1].run.seed == 4
    with pytest.raises(ValueError, match=r"^Tune trial config: pack: name: 'cheetah-run/mad_sac/qed0.2/pack3' is not "
                                         r"the pack of its trials"):
        TuneTrial.of({"pack": {**config["pack"], "name": "cheetah-run/mad_sac/qed0.2/pack3"}})
    with pytest.raises(ValueError, match=r"^Tune trial config: pack: trials.0.run.seed: Input should be a valid "
                                         r"integer \(got '3'\)"):
        TuneTrial.of({"pack": {**config["pack"], "trials": [{"name": pack.trials[0], "run": {**run, "seed": "3"}}]}})
    alone = PackId.of(["cheetah-run/mad_sac/qed0.2/3"])  # a single seed is a pack of one
    assert (alone.name, alone.dirname) == ("cheetah-run/mad_sac/qed0.2/pack3", "cheetah-run__mad_sac__qed0.2__pack3")


def _started(layout: SweepDir, state: SweepState, spec: SweepSpec) -> None:
    """Marks every recorded pack as started (a checkpoint folder of its own) and writes sweep.json."""
    for members in state.packs.values():
        layout.pack_checkpoints(PackId.of(members)).mkdir(parents=True)
    for name in state.trials:
        layout.policies(name).mkdir(parents=True, exist_ok=True)
    write_state(layout, state)


def test_membership_is_fixed_when_the_sweep_grows(tmp_path):
    layout = SweepDir(tmp_path / "p")
    first = plan(None, sweep_spec(PACKING, seeds=3, pack={"seeds": 2}), layout)
    assert first.problems == [] and first.state.pack_seeds == 2
    assert first.state.packs == pack_records(first.packs) == {
        f"{t}/sac_ln/te/{p}": [f"{t}/sac_ln/te/{s}" for s in seeds] for t in PACKING["tasks"]
        for p, seeds in (("pack0-1", (0, 1)), ("pack2", (2,)))}
    _started(layout, first.state, sweep_spec(PACKING, seeds=3))
    grown = plan(read_state(layout), sweep_spec(PACKING, seeds=6, pack={"seeds": 2}), layout)
    assert grown.problems == [] and grown.new == [f"{t}/sac_ln/te/{s}" for t in PACKING["tasks"] for s in (3, 4, 5)]
    # Seed 2's pack stays a pack of one; the new seeds form new packs of their own, in chunks of 2.
    assert [p.name for p in grown.packs] == [f"{t}/sac_ln/te/{p}" for t in PACKING["tasks"]
                                            for p in ("pack0-1", "pack2", "pack3-4", "pack5")]
    assert grown.state.packs == pack_records(grown.packs)
    # A recorded pack that never started (nothing of it in the folder) may re-form with the grown grid.
    unstarted = plan(first.state, sweep_spec(PACKING, seeds=6, pack={"seeds": 2}), SweepDir(tmp_path / "empty"))
    assert [p.name for p in unstarted.packs][:3] == [f"cartpole-balance/sac_ln/te/pack{p}"
                                                     for p in ("0-1", "2-3", "4-5")]


def test_a_sweep_of_single_seeds_trains_packs_of_one(tmp_path):
    plain, explicit = sweep_spec(PACKING), sweep_spec(PACKING, pack={"seeds": 1, "env_workers": 0})
    assert plain.pack == explicit.pack and plain.fingerprint() == explicit.fingerprint()
    assert [(t.name, t.run) for t in plain.trials()] == [(t.name, t.run) for t in explicit.trials()]
    assert plain.fingerprint() == sweep_spec(PACKING, pack={"seeds": 3}).fingerprint(), \
        "packing never changes a trial's identity"
    p = plan(None, explicit)
    assert [pk.name for pk in p.packs][:3] == [f"cartpole-balance/sac_ln/te/pack{s}" for s in range(3)]
    assert all(len(pk.trials) == 1 for pk in p.packs) and len(p.packs) == len(plain.trials())
    assert p.state.pack_seeds == 1 and p.state.packs == {pk.name: pk.names for pk in p.packs}
    assert explicit.trial_resources() == {"cpu": 1.0, "gpu": 0.0}
    assert sweep_spec(PACKING, pack={"env_workers": 1}).trial_resources() == {"cpu": 2.0, "gpu": 0.0}, \
        "its env on a worker"
    # A sweep.json of the previous release (seed runs outside packs: no packs recorded) resumes as packs of one.
    layout = SweepDir(tmp_path / "p")
    legacy = {k: v for k, v in dump(p.state).items() if k not in ("pack_seeds", "packs")}
    _started(layout, SweepState.model_validate(legacy), plain)
    layout.state_file.write_text(json.dumps(legacy))  # as that release wrote it: no pack fields
    again = plan(read_state(layout), explicit, layout)
    assert again.problems == [] and again.new == [] and dump(again.state) == {**legacy, "pack_seeds": 1,
                                                                              "packs": p.state.packs}
    big = sweep_spec(PACKING, pack={"seeds": 5, "env_workers": 3}, resources={"cpu": 2, "gpu": 0.5})
    assert big.trial_resources() == {"cpu": 5.0, "gpu": 0.5}


@pytest.mark.parametrize("pack, says", [
    ({"seeds": 0}, "pack.seeds: allowed 1 to 1000 seeds per pack, or auto (the largest pack that fits the machine; "
                   "got 0)"),
    ({"seeds": 1001}, "pack.seeds: allowed 1 to 1000 seeds per pack, or auto (the largest pack that fits the "
                      "machine; got 1001)"),
    ({"seeds": "3"}, "pack.seeds: allowed 1 to 1000 seeds per pack, or auto (the largest pack that fits the "
                     "machine; got '3')"),
    ({"seeds": 2, "env_workers": -1}, "pack.env_workers: Input should be greater than or equal to 0 (got -1)"),
    ({"seeds": 2, "env_workers": 3}, "pack.env_workers: 3 workers for the 2 training envs of a pack; allowed 0 to 2 "
                                     "(pack.seeds)"),
    ({"env_workers": 2}, "pack.env_workers: 2 workers for the 1 training env of a pack; allowed 0 to 1"),
    ({"seeds": 2, "workers": 2}, "pack.workers: not a pack field; pack takes seeds (1 to 1000 or auto), env_workers "
                                 "(0 to pack.seeds) and by (variant or shape)"),
    ({"by": "task"}, "pack.by: Input should be 'variant' or 'shape' (got 'task')"),
])
def test_bad_pack_fields_are_refused_naming_the_field_and_what_is_allowed(pack, says):
    with pytest.raises(ValidationError) as e:
        sweep_spec(PACKING, pack=pack)
    assert says in format_validation_error(e.value)


@pytest.mark.parametrize("before, after, says", [
    (2, 3, "pack.seeds: this sweep trains packs of 2 seeds, the spec now gives 3;"),
    (2, 1, "pack.seeds: this sweep trains packs of 2 seeds, the spec now gives 1;"),
    (1, 2, "pack.seeds: this sweep trains packs of 1 seed, the spec now gives 2;"),
])
def test_a_started_sweeps_pack_size_cannot_change(tmp_path, before, after, says):
    layout = SweepDir(tmp_path / "p")
    first = plan(None, sweep_spec(PACKING, pack={"seeds": before}), layout)
    _started(layout, first.state, sweep_spec(PACKING))
    again = plan(read_state(layout), sweep_spec(PACKING, pack={"seeds": after}), layout)
    assert len(again.problems) == 1 and again.problems[0].startswith(says)
    assert "restore pack.seeds: " + str(before) in again.problems[0]
    # Before anything started, the pack size may still change.
    assert plan(first.state, sweep_spec(PACKING, pack={"seeds": after}), SweepDir(tmp_path / "empty")).problems == []


def _dry(tmp_path, capsys, table: dict | None, listing: bool = False, **changes) -> str:
    spec = sweep_spec(PACKING, storage_path=str(tmp_path / "results"), **changes)
    path = tmp_path / f"throughput-{uuid.uuid4().hex[:6]}.json"
    if table is not None:
        path.write_text(json.dumps(table))
    capsys.readouterr()
    here = Machine("this machine", "this machine", "NVIDIA H100 80GB HBM3", 80 * 2**30, 64 * 2**30, 16, 1, 1)
    assert dry_run(spec, path, listing, here=here) == 0
    assert not (tmp_path / "results").exists()
    return capsys.readouterr().out


AGENT = sweep_spec(PACKING).runs()[0].agent  # the table is measured at its shape
TABLE = {"schema": 1, "device": "cuda", "card": "NVIDIA H100 80GB HBM3", "date": "2026-11-26", "hidden": AGENT.hidden,
         "batch": AGENT.batch_size,
         "entries": [{"agent": "sac_ln", "temperature": "te", "seeds": s, "packs": q, "mode": "graph",
                      "seed_decisions_per_s": r} for s, q, r in ((2, 2, 0.5), (1, 2, 0.25), (2, 1, 0.8), (1, 1, 0.4))]}


def test_dry_run_prints_packs_resources_and_the_plan_per_machine_from_the_table(tmp_path, capsys):
    packed = dict(pack={"seeds": 2, "env_workers": 1}, resources={"cpu": 1, "gpu": 0.5}, seeds=4,
                  tasks=["cartpole-balance"])
    raw = _dry(tmp_path, capsys, TABLE, True, **packed)
    out = flat(raw)  # wrapped to 100 columns: compared flat
    assert out.startswith("sweep p: 4 trials in 2 packs (Tune trials) of up to 2 seeds -> ")
    assert counts(raw, "trials") == {"new": 4}
    assert "pack cartpole-balance/sac_ln/te/pack0-1 (2 seeds) cartpole-balance/sac_ln/te/0 " in out
    assert "per pack: 2 CPU (1 + 1 env workers), 0.5 GPU; all 2 packs at once: 4 CPU, 1 GPU; total env steps " \
           "8,000" in out
    assert " this machine (NVIDIA H100 80GB HBM3, 80.0 GiB; 16 CPUs, 64.0 GiB for packs) packs of 2 (pack.seeds): " \
           "2 packs, 2 per node; largest sac_ln/te (cartpole-balance): host " in out
    assert " aws: 8 x g5.4xlarge (NVIDIA A10G, 22.5 GiB; 16 CPUs, 64.0 GiB for packs) packs of 2 (pack.seeds): " \
           "2 packs, 2 per node; " in out
    assert "NVIDIA A10G extrapolated from the measured NVIDIA H100 80GB HBM3 by FP32 peak (35/66.9)" in out
    assert " rates: NVIDIA H100 80GB HBM3 (cuda), measured 2026-11-26; " in out
    short = _dry(tmp_path, capsys, TABLE, **packed)  # the plan without the per-trial list
    assert counts(short, "trials") == {"new": 4} and "--list" in short and " pack cartpole" not in flat(short)
    assert "packs of 2 (pack.seeds): 3 packs" in flat(_dry(tmp_path, capsys, TABLE, **{**packed, "seeds": 5}))
    missing = flat(_dry(tmp_path, capsys, {**TABLE, "entries": TABLE["entries"][:2]}, **packed))
    shape = f"hidden {AGENT.hidden}, batch {AGENT.batch_size}"
    assert f"GPU-hours and wall clock: no estimate: sac_ln/te {shape} (graph) was never measured on a GPU (the " \
           f"NVIDIA H100 80GB HBM3 table: {shape})" in missing
    none = flat(_dry(tmp_path, capsys, None, **packed))
    assert "GPU-hours and wall clock: no estimate: no GPU rate table (benchmarks/gpu_bench.py)" in none
    assert "GPU-hours 0" not in none and "CPU-hours " in flat(_dry(tmp_path, capsys, TABLE, pack={"seeds": 1}))
    # Each pack's cell at the precision it trains at on a GPU: a 3xtf32 cell, or the fp32 one, said so.
    three = {**TABLE, "entries": [{**e, "precision": "3xtf32", "seed_decisions_per_s": 2 * e["seed_decisions_per_s"]}
                                  for e in TABLE["entries"]]}
    fast = {**packed, "train": {**TRAIN, "precision": "3xtf32"}}
    assert "priced as fp32" not in flat(_dry(tmp_path, capsys, three, **fast))
    assert "3xtf32 priced as fp32" in flat(_dry(tmp_path, capsys, TABLE, **fast))


def test_a_seed_runs_mlflow_run_carries_its_packs_name_and_size(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "p", "sweep0")
    parent = tracker.parent_run("p", {}, {})
    name, pack = "cartpole-balance/sac_ln/te/1", "cartpole-balance/sac_ln/te/pack0-2"
    history = [HistoryEntry(time_ms=1000, metrics={"env_steps": 1000, "eval/return_mean": 5.0})]
    # A run the driver created without the pack's tags (synced as KILLED before the pack first ran) gets them.
    assert TrialRun(uri, "p", "sweep0", parent, name, {"seed": 1}).finish([], killed=True, timeout_s=0)
    run = TrialRun(uri, "p", "sweep0", parent, name, {"seed": 1}, run_tags=pack_tags(pack, 3))
    assert run.sync(history)
    (found,) = [r for r in tracker.runs() if r.data.tags.get("qed.trial") == name]
    assert found.info.run_name == "te s1 cartpole-balance sac_ln" and found.data.tags["mlflow.parentRunId"] == parent
    assert (found.data.tags[PACK_TAG], found.data.tags[PACK_SIZE_TAG]) == (pack, "3")
    assert found.data.params["seed"] == "1" and found.data.metrics["eval/return_mean"] == 5.0
    assert len([r for r in tracker.runs() if r.data.tags.get("qed.trial") == name]) == 1
    fresh = TrialRun(uri, "p", "sweep0", parent, "cartpole-balance/sac_ln/te/2", {}, run_tags=pack_tags(pack, 3))
    assert fresh.sync(history) and tracker.tags(fresh.run_id)[PACK_SIZE_TAG] == "3"
    assert re.fullmatch(r"[0-9a-f]+", fresh.run_id)
