"""Sweep specs: validation errors name the field, expansion is deterministic, dry-run starts nothing."""

from pathlib import Path

import pytest
import yaml

from qed_ray.records.layout import trial_dirname
from qed_ray.spec.sweep import SpecError, load_spec
from qed_ray.service.sweep_cli import main

ROOT = Path(__file__).resolve().parents[2]

BASE = {
    "name": "t", "tasks": ["cartpole-balance"], "seeds": 2,
    "agents": [{"name": "sac_ln", "overrides": {"hidden": 16},
                "temperatures": [{"kind": "te"}, {"kind": "qed", "k": [0.1, 0.2]}]}],
    "train": {"env_steps": 2000, "eval_every": 1000, "warmup_decisions": 100},
}


def _write(tmp_path, spec):
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(spec))
    return p


def _with(**changes):
    spec = yaml.safe_load(yaml.safe_dump(BASE))
    for path, value in changes.items():
        node = spec
        keys = path.split(".")
        for k in keys[:-1]:
            node = node[int(k)] if isinstance(node, list) else node[k]
        node[keys[-1]] = value
    return spec


def test_expansion_names_and_order(tmp_path):
    spec = load_spec(_write(tmp_path, BASE))
    runs = spec.runs()
    assert [r.name for r in runs] == [
        "cartpole-balance/sac_ln/te/0", "cartpole-balance/sac_ln/te/1",
        "cartpole-balance/sac_ln/qed0.1/0", "cartpole-balance/sac_ln/qed0.1/1",
        "cartpole-balance/sac_ln/qed0.2/0", "cartpole-balance/sac_ln/qed0.2/1"]
    assert all(r.agent.hidden == 16 and r.train.env_steps == 2000 for r in runs)
    assert trial_dirname(runs[2].name) == "cartpole-balance__sac_ln__qed0.1__s0"
    assert spec.fingerprint() == load_spec(_write(tmp_path, BASE)).fingerprint()


def test_shipped_specs_validate_and_dmc18_is_the_papers_grid():
    for path in (ROOT / "sweeps").glob("*.yaml"):
        load_spec(path)
    runs = load_spec(ROOT / "sweeps" / "dmc18.yaml").runs()
    assert len(runs) == 18 * 10 * 8
    variants = {(r.agent.name, r.variant) for r in runs}
    assert variants == {("sac_ln", "te"), ("sac_ln", "qed0.1"), ("sac_ln", "qed0.2"), ("sac_ln", "qed0.4"),
                        ("mad_sac", "te"), ("mad_sac", "qed0.2"), ("mad_sac", "qed0.3"), ("mad_sac", "qed0.4")}
    assert all(r.train.env_steps == 2_000_000 and r.train.frame_skip == 2 and r.agent.gamma == 0.99 for r in runs)


@pytest.mark.parametrize("changes,needle", [
    ({"colour": "red"}, "colour: unknown field; the fields here are name, tasks, seeds, agents, train"),
    ({"tasks": ["cartpole-balance", "cheetah-fly"]}, "tasks: Value error, unknown task(s) ['cheetah-fly']"),
    ({"agents.0.temperatures.1.k": [0.1, -0.2]}, "k (agent sac_ln, temperature entry 2): -0.2 is not above 0; "
                                                 "QED's alpha(s) = Delta / (k x action_dim) needs 0 < k <= 1000"),
    ({"agents.0.temperatures.1.k": 0}, "k (agent sac_ln, temperature entry 2): 0 is not above 0;"),
    ({"agents.0.temperatures.1.k": 1001}, "k (agent sac_ln, temperature entry 2): 1001 is above 1000;"),
    ({"resources": {"gpu": 1.5}}, "resources.gpu"),
    ({"resources": {"gpu": 0.3}}, "resources.gpu"),
    ({"train": {"env_steps": -10, "eval_every": 1000, "warmup_decisions": 100}}, "train.env_steps"),
    ({"agents.0.name": "td3"}, "unknown agent 'td3'; implemented agents: sac_ln, mad_sac"),
    ({"seeds": 0}, "seeds"),
    ({"agents.0.overrides": {"widht": 3}}, "agents.0.overrides.widht: unknown field; the fields here are depth"),
])
def test_bad_specs_name_the_field_and_start_nothing(tmp_path, capsys, changes, needle):
    spec = _with(**changes) if "." in next(iter(changes)) else {**BASE, **changes}
    spec["storage_path"] = str(tmp_path / "results")
    rc = main([str(_write(tmp_path, spec))])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and needle.replace("Value error, ", "") in \
        err.replace("Value error, ", ""), err
    assert not (tmp_path / "results").exists(), "nothing may be started or written"


def test_unreadable_and_non_mapping_specs(tmp_path, capsys):
    assert main([str(tmp_path / "missing.yaml")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'missing.yaml'}: no such file\n"
    (tmp_path / "smoke.yaml").mkdir()  # there, but no file
    assert main([str(tmp_path / "smoke.yaml")]) == 2
    assert "smoke.yaml: cannot be read" in capsys.readouterr().err
    p = tmp_path / "list.yaml"
    p.write_text("- a\n- b\n")
    with pytest.raises(SpecError, match="expected a mapping"):
        load_spec(p)


def test_dry_run_prints_trials_and_resources(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")  # a GPU spec planned from here for a cluster's head
    spec = {**BASE, "storage_path": str(tmp_path / "results"), "resources": {"cpu": 0.5, "gpu": 0.1}}
    assert main([str(_write(tmp_path, spec)), "--dry-run", "--list"]) == 0
    out = capsys.readouterr().out
    assert "6 trials" in out and "cartpole-balance/sac_ln/qed0.2/1" in out
    assert "per pack: 0.5 CPU (0.5 + 0 env workers), 0.1 GPU; all 6 packs at once: 3 CPU, 0.6 GPU" in out
    assert not (tmp_path / "results").exists()


def test_object_store_storage_is_refused_with_the_field(tmp_path, capsys, monkeypatch):
    spec = {**BASE, "storage_path": "s3://bucket/sweeps"}
    assert main([str(_write(tmp_path, spec))]) == 2
    assert capsys.readouterr().err.startswith("error: storage_path: 's3://bucket/sweeps' is a URI")
    monkeypatch.setenv("QED_STORAGE_PATH", "gs://bucket/x")
    assert main([str(_write(tmp_path, BASE))]) == 2
    assert capsys.readouterr().err.startswith("error: QED_STORAGE_PATH: 'gs://bucket/x' is a URI")


@pytest.mark.parametrize("changes,needle", [
    ({"agents.0.temperatures.1.k": float("inf")}, "k (agent sac_ln, temperature entry 2): Input should be a finite "
                                                  "number"),
    ({"resources": {"cpu": float("nan")}}, "resources.cpu: Input should be a finite number"),
    ({"seeds": [4294967296]}, "seeds: seeds [4294967296] are outside 0..4294967295"),
    ({"seeds": 1_000_000_000}, "seeds: a count of 1000000000 seeds; need 1 to 10,000"),
    ({"seeds": True}, "seeds: need a seed count or a list of integer seeds (got True)"),
    ({"seeds": "3"}, "seeds: need a seed count or a list of integer seeds (got '3')"),
    ({"seeds": 0}, "seeds: a count of 0 seeds; need 1 to 10,000"),
    ({"agents.0.overrides": {"hidden": True}}, "agents.0.overrides.hidden: Input should be a valid integer (got True)"),
    ({"agents.0.overrides": {"hidden": 10**9}}, "agents.0.overrides.hidden: Input should be less than or equal to"),
    ({"agents.0.temperatures.0": {"kind": "te", "k": 0.2}},
     "k (agent sac_ln, temperature entry 1): applies only to kind 'qed', but kind is 'te'"),
    ({"train": {"env_steps": 2000, "eval_every": 1500, "warmup_decisions": 100}},
     "train.eval_every: 1500 must be a multiple of 1000"),
    ({"train": {"env_steps": 2000, "eval_every": 1000, "device": "cuda:abc"}}, "train.device: 'cuda:abc' is not one"),
    ({"train": {"env_steps": 2000, "eval_every": 1000}}, "train.warmup_decisions: 5000 uniform-random decisions use up"),
    ({"resources": {"gpu": 0.00001}}, "resources.gpu: 1e-05 is too small to be useful"),
    ({"seeds": 10_000, "agents.0.temperatures.1.k": [0.01 * i for i in range(1, 12)]},
     "seeds: the grid has 120,000 trials"),
])
def test_bad_numbers_are_refused_naming_their_field_once(tmp_path, capsys, changes, needle):
    spec = yaml.safe_load(yaml.safe_dump(BASE))
    for path, value in changes.items():
        node, keys = spec, path.split(".")
        for k in keys[:-1]:
            node = node[int(k)] if isinstance(node, list) else node[k]
        node[int(keys[-1]) if isinstance(node, list) else keys[-1]] = value
    spec["storage_path"] = str(tmp_path / "results")
    rc = main([str(_write(tmp_path, spec))])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: ") and len(err.splitlines()) == 1 and needle in err, err
    field = needle.split(":")[0]
    assert err.count(field.split(".")[-1]) >= 1 and f"{field}.{field}" not in err and "train.train" not in err
    assert not (tmp_path / "results").exists()


def test_every_problem_of_a_spec_is_reported_at_once(tmp_path, capsys):
    spec = yaml.safe_load(yaml.safe_dump(BASE))
    spec.update(colour="red", seeds=0, train={"env_steps": 2000, "eval_evry": 1000})
    spec["agents"][0]["overrides"] = {"widht": 3}
    spec["agents"][0]["temperatures"][1]["k"] = [0.1, -1]
    spec["storage_path"] = str(tmp_path / "results")
    assert main([str(_write(tmp_path, spec))]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert sorted(line.split(":")[1].strip() for line in lines) == [
        "agents.0.overrides.widht", "colour", "k (agent sac_ln, temperature entry 2)", "seeds", "train.eval_evry"], lines
    assert all(line.startswith("error: ") for line in lines)


def test_yaml_is_read_strictly(tmp_path, capsys):
    p = tmp_path / "dupe.yaml"
    p.write_text(yaml.safe_dump(BASE) + "seeds: 500\n")
    assert main([str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "duplicate key 'seeds'" in err and err.startswith("error: ")
    p.write_bytes(b"name: t\ntasks: [caf\xe9]\n")
    assert main([str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {p}: is not UTF-8 text (byte 0xe9 at offset 19)"  # len("name: t\\ntasks: [caf")
    text = ("name: t\ntasks: [cartpole-balance]\nseeds: 1\nagents:\n- name: sac_ln\n  temperatures:\n"
            "  - {kind: te, lr: 3e-4}\ntrain: {env_steps: ENV, eval_every: 1000, warmup_decisions: 1e2}\n")
    p.write_text(text.replace("ENV", "2e3"))
    with pytest.raises(SpecError, match=r"train.env_steps: Input should be a valid integer \(got 2000.0\)"):
        load_spec(p)  # YAML 1.2 numbers: 2e3 is the float 2000.0 (not a string), and a float is not an int
    p.write_text(text.replace("ENV", "2000").replace("1e2", "100"))
    assert load_spec(p).trials()[0].run.temperature.lr == 3e-4  # PyYAML alone would read "3e-4" as a string
