"""The pre-registration (qed_ray/spec/claim.py, docs/claim.md, sweeps/claim.yaml): the block holds the design and the
thresholds the verdict applies, its hash is frozen in sweep.json at the first start and a changed block is refused
naming the file and the field, the claim sweep's dry run passes; entries of a spec may run on a subset of tasks."""

import json
import re
import shutil
from pathlib import Path

import pytest
from kit import flat, sweep_file, sweep_spec
from pydantic import ValidationError


from qed_ray.spec import claim
from qed_ray.service.plan.dry_run import dry_run
from qed_ray.records.layout import SweepDir
from qed_ray.spec.sweep import SweepSpec, load_spec
from qed_ray.service.sweep_cli import main
from qed_ray.records.codec import dump
from qed_ray.records.sweep import SweepState, write_state
from qed_ray.service.sweep_state import plan

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "claim.md"


def test_the_block_holds_the_design_and_the_thresholds_the_verdict_applies():
    block, raw = claim.read_block(DOC)
    assert block.endpoints == claim.Endpoints(), "a sweep without a claim file is judged by the same thresholds"
    keep = {"claim", "secondary"}
    assert block.model_dump(exclude=keep) == claim.registered_design().model_dump(exclude=keep), \
        "a sweep without a claim file is measured against the same design"
    e = block.endpoints
    assert (e.v_ratio.lower_at_least, e.iqm_kept.lower_at_least, e.guards.learned_above_random, e.guards.mean_kept,
            e.decision_confidence, e.correction) == (10, 0.95, 0.1, 0.95, 0.96, "bonferroni")
    assert (block.final_episodes, block.final_policies) == (20, ["mean", "sample"])
    assert (block.agent, block.baseline, block.variants, block.seeds, block.env_steps) == (
        "mad_sac", "te", ["qed0.2", "qed0.4"], 15, 2_000_000)
    assert block.tasks == ["cheetah-run", "walker-walk", "hopper-hop", "finger-spin", "reacher-hard", "quadruped-walk"]
    spec = load_spec(ROOT / "sweeps" / "claim.yaml")
    assert spec.claim == "docs/claim.md" and spec.pack.seeds == 15 and spec.final_eval.policies == ("mean", "sample")
    assert (spec.final_eval.confidence, spec.final_eval.bootstrap_reps) == (block.confidence, block.bootstrap_reps)
    trials = spec.trials()
    for variant in [block.baseline, *block.variants]:  # the design: every task x seed, at the budget, defaults
        mine = [t.run for t in trials if t.run.agent.name == block.agent and t.variant == variant]
        assert sorted((r.task, r.seed) for r in mine) == sorted((t, s) for t in block.tasks for s in range(15))
        assert all(r.train.env_steps == block.env_steps and r.agent.mad.actor_rows == "real"
                   and not r.train.shared_indices for r in mine)
    controls = {t.variant for t in trials if t.run.task == "cheetah-run"} - {block.baseline, *block.variants}
    assert controls == {"qed0.2+target_alpha=qed", "fixed0.2", "te+mad.actor_critic=target+mad.actor_rows=all",
                        "qed0.2+mad.actor_critic=target+mad.actor_rows=all", "te+shared_indices=true",
                        "qed0.2+shared_indices=true"}, "M2 runs QED at s' (the primary arm runs App. C's floor)"
    assert {t.run.task for t in trials if t.variant in controls} == {"cheetah-run", "walker-walk", "hopper-hop"}
    a3 = [t.run for t in trials if t.variant.endswith("+shared_indices=true")]
    assert len(a3) == 2 * 3 * 15 and all(r.train.shared_indices and r.train.env_steps == block.env_steps for r in a3)
    assert len(trials) == 6 * 3 * 15 + 3 * 6 * 15


def test_the_claim_sweeps_dry_run_passes_with_gpu_hours(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("QED_STORAGE_PATH", str(tmp_path / "results"))
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")  # submitted to a cluster: this CPU machine not checked
    assert dry_run(load_spec(ROOT / "sweeps" / "claim.yaml")) == 0
    out = flat(capsys.readouterr().out)
    assert "540 trials in 36 packs (Tune trials) of up to 15 seeds" in out and "no estimate" not in out
    aws = out.split(" aws: 8 x g5.4xlarge (NVIDIA A10G, ")[1].split(" gcp: ")[0]
    assert "packs of 15 (pack.seeds): 36 packs, 2 per node; " in aws and " wall clock " in aws and " spot" in aws
    assert "not runnable as shipped" not in out.split(" aws: ")[1], "the A3 control (shared_indices) fits as well"
    assert f"pre-registration: docs/claim.md (claim block sha256 {claim.block_sha256(claim.read_block(DOC)[1])[:12]}" \
        in out
    assert not (tmp_path / "results").exists()
    # The cost docs/claim.md quotes is this dry run's, never typed: its trials, packs and each cloud's GPU-hours.
    hours = {cloud: re.search(rf" {cloud}: .*? GPU-hours ([\d,]+) with the tail", out).group(1)
             for cloud in ("aws", "gcp")}
    trials, packs = re.search(r"(\d+) trials in (\d+) packs", out).groups()
    doc = flat(DOC.read_text())
    quoted = (f"{trials} trials in {packs} packs of 15 seeds, {hours['aws']} GPU-hours on the shipped AWS cluster's "
              f"A10G cards ({hours['gcp']} on GCP's L4;")
    assert quoted in doc, f"docs/claim.md must quote the dry run's cost: {quoted}"
    assert f"the dry run's {hours['aws']} A10G GPU-hours" in doc


def test_the_block_is_frozen_at_the_first_start_and_a_changed_block_is_refused(tmp_path):
    doc = tmp_path / "claim.md"
    shutil.copy(DOC, doc)
    first = plan(None, sweep_spec(claim=str(doc)))
    rec = dump(first.state)["claim"]
    assert first.problems == [] and rec["sha256"] == claim.block_sha256(rec["block"]) and rec["file"] == str(doc)
    state = SweepState.model_validate(json.loads(json.dumps(dump(first.state))))  # as sweep.json keeps it
    doc.write_text(doc.read_text().replace("tasks: [cheetah-run", "# a comment\ntasks: [cheetah-run"))
    assert plan(state, sweep_spec(claim=str(doc))).problems == [], "comments and layout are not the block's values"

    doc.write_text(doc.read_text().replace("v_ratio: {summary: median, lower_at_least: 10}",
                                           "v_ratio: {summary: median, lower_at_least: 5}"))
    (problem,) = plan(state, sweep_spec(claim=str(doc))).problems
    assert problem.startswith(f"claim: {doc}: the claim block changed since this sweep started "
                              f"(endpoints.v_ratio.lower_at_least: 10 -> 5; block sha256 {rec['sha256'][:12]}")
    (problem,) = plan(state, sweep_spec(claim=None)).problems
    assert problem.startswith(f"claim: this sweep was started against {doc}") and "restore claim:" in problem
    unclaimed = state.model_copy(update={"claim": None})  # no claim at the start
    (problem,) = plan(unclaimed, sweep_spec(claim=str(DOC))).problems
    assert "was not named when this sweep first started" in problem


@pytest.mark.parametrize("text, needle", [
    (None, "cannot be read"), ("# no block\n", "expected one fenced block opened by ```yaml claim, found 0"),
    ("```yaml claim\n- a\n```\n", "the claim block must be a mapping"),
    ("```yaml claim\nclaim: x\n```\n", "claim block field agent: required field missing"),
])
def test_an_unusable_claim_file_is_refused_naming_it(tmp_path, text, needle):
    doc = tmp_path / "claim.md"
    if text is not None:
        doc.write_text(text)
    problems = plan(None, sweep_spec(claim=str(doc))).problems
    assert problems and problems[0].startswith(f"claim: {doc}: ") and needle in "\n".join(problems)


def test_an_agent_entry_may_run_on_a_subset_of_the_tasks():
    raw = {"name": "s", "tasks": ["cartpole-balance", "cheetah-run"], "seeds": 1,
           "agents": [{"name": "sac_ln", "temperatures": [{"kind": "te"}]},
                      {"name": "sac_ln", "tasks": ["cheetah-run"], "temperatures": [{"kind": "fixed", "alpha": 0.2}]}]}
    names = [t.name for t in SweepSpec.model_validate(raw).trials()]
    assert names == ["cartpole-balance/sac_ln/te/0", "cheetah-run/sac_ln/te/0", "cheetah-run/sac_ln/fixed0.2/0"]
    raw["agents"][1]["tasks"] = ["walker-walk"]
    with pytest.raises(ValidationError, match=r"agents\.1\.tasks: \['walker-walk'\] must be distinct tasks of the"):
        SweepSpec.model_validate(raw)


def test_an_agent_entry_may_set_train_settings_of_its_own():
    raw = {"name": "s", "tasks": ["cartpole-balance"], "seeds": 2, "pack": {"seeds": 2},
           "train": {"env_steps": 2000, "eval_every": 1000, "warmup_decisions": 100},
           "agents": [{"name": "sac_ln", "temperatures": [{"kind": "te"}]},
                      {"name": "sac_ln", "train": {"shared_indices": True}, "temperatures": [{"kind": "te"}]}]}
    trials = SweepSpec.model_validate(raw).trials()
    assert [(t.name, t.run.train.shared_indices, t.run.train.env_steps) for t in trials] == [
        ("cartpole-balance/sac_ln/te/0", False, 2000), ("cartpole-balance/sac_ln/te/1", False, 2000),
        ("cartpole-balance/sac_ln/te+shared_indices=true/0", True, 2000),
        ("cartpole-balance/sac_ln/te+shared_indices=true/1", True, 2000)]
    raw["agents"][1]["train"] = {"shared_indices": True, "holdout_fraction": 0.1}
    with pytest.raises(ValidationError, match=r"agents\.1\.train\.shared_indices: true needs holdout_fraction 0"):
        SweepSpec.model_validate(raw)


def test_a_run_and_a_dry_run_of_a_sweep_refuse_its_changed_block(tmp_path, capsys):
    doc, spec_file = tmp_path / "claim.md", tmp_path / "s.yaml"
    shutil.copy(DOC, doc)
    sweep_file(spec_file, claim=str(doc), storage_path=str(tmp_path / "results"))
    layout = SweepDir(tmp_path / "results" / "s")
    layout.root.mkdir(parents=True)
    write_state(layout, plan(None, load_spec(spec_file)).state)  # the first start froze the block
    doc.write_text(doc.read_text().replace("lower_at_least: 0.95", "lower_at_least: 0.9"))
    before = layout.state_file.read_text()
    for flags in (["--dry-run"], []):
        assert main([str(spec_file), *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: claim: {doc}: the claim block changed since this sweep started "
                              f"(endpoints.iqm_kept.lower_at_least: 0.95 -> 0.9;"), err
    assert layout.state_file.read_text() == before, "nothing is written"
